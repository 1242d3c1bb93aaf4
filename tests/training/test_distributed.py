"""Two synchronised CPU processes (gloo DDP under `accelerate launch`) train the same model as one
process with the same global batch."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training import finetune
from hf_softmax_rnn.training.metrics import read_metrics
from hf_softmax_rnn.training.trainer import check_launched_processes
from tests.training.helpers import tiny_config

RANK_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from hf_softmax_rnn.training import FinetuneConfig, Finetuner

finetuner = Finetuner(FinetuneConfig.from_flags(**json.loads(sys.argv[1])))
result = finetuner.run()
accelerator = finetuner.accelerator
torch.save(
    {"num_processes": accelerator.num_processes, "state": result.model.state_dict()},
    f"{sys.argv[2]}/rank{accelerator.process_index}.pt",
)
"""
SETTINGS = dict(attention="gated_softmax", transfer_steps=2, finetune_steps=2, eval_every=2, save_every=2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_cpu_processes_agree_with_each_other_and_with_one_process(tiny_models, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    config = tiny_config(tiny_models["llama"], tmp_path / "two", batch_size=1, **SETTINGS)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
        str(script), json.dumps(config.to_dict()), str(tmp_path),
    ]  # fmt: skip
    launched = subprocess.run(command, env={**os.environ, "ACCELERATE_USE_CPU": "1"}, capture_output=True, text=True)
    assert launched.returncode == 0, launched.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    for name, tensor in ranks[0]["state"].items():
        assert torch.equal(tensor, ranks[1]["state"][name]), name

    single = finetune(tiny_config(tiny_models["llama"], tmp_path / "one", batch_size=2, **SETTINGS))
    for name, tensor in single.model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    two_losses = [r["loss"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl") if "loss" in r]
    one_losses = [r["loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    assert two_losses == pytest.approx(one_losses, rel=1e-5)


@pytest.mark.parametrize(
    ("world_size", "num_processes", "refused"),
    [(None, 1, False), ("1", 1, False), ("2", 2, False), ("2", 1, True), ("4", 2, True)],
    ids=["not_launched", "one", "two_set_up", "two_launched_one_set_up", "four_launched_two_set_up"],
)
def test_launched_processes_that_accelerate_did_not_set_up_are_refused(monkeypatch, world_size, num_processes, refused):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    if not refused:
        check_launched_processes(num_processes)
        return
    with pytest.raises(
        UserInputError, match=rf"WORLD_SIZE={world_size} processes but Accelerate set up {num_processes}"
    ):
        check_launched_processes(num_processes)


@pytest.mark.slow  # two processes start torch and transformers
def test_two_launched_processes_without_gpu_or_cpu_flag_stop_in_one_line(tiny_models, tmp_path):
    output = tmp_path / "out"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
        "-m", "hf_softmax_rnn.cli", "finetune", "--output-dir", str(output), "--model", tiny_models["llama"],
    ]  # fmt: skip
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launched = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert launched.returncode != 0  # (torchrun reports its failed children with its own traceback)
    errors = [line for line in launched.stderr.splitlines() if "hf-softmax-rnn finetune: error:" in line]
    assert len(errors) == 2, launched.stderr[-3000:]
    assert all("WORLD_SIZE=2 processes but Accelerate set up 1" in line for line in errors)
    assert not output.exists()

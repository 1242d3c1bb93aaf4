"""Two synchronised CPU processes (gloo DDP under `accelerate launch`) train the same model as one
process with the same global batch."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_softmax_rnn.training import finetune
from hf_softmax_rnn.training.metrics import read_metrics
from tests.training.helpers import tiny_config

RANK_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from hf_softmax_rnn.training import FinetuneConfig, Finetuner

finetuner = Finetuner(FinetuneConfig(**json.loads(sys.argv[1])))
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

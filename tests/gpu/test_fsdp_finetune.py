"""`finetune` under `accelerate launch` with FSDP2 (scripts/accelerate_fsdp2.yaml, one GPU) ends with
the same held-out perplexities and saved weights as the plain one-process run (a tiny random Llama
with the offline word-level tokenizer, LoRA fine-tuning after attention transfer).

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.training.helpers import save_tiny_model, weights, word_tokenizer

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "scripts" / "accelerate_fsdp2.yaml"
SETTINGS = dict(
    attention="hedgehog_window_64", block_size=32, batch_size=2, eval_batch_size=4, max_eval_blocks=4,
    transfer_steps=2, finetune_steps=2, eval_every=2, save_every=2, seed=0,
)  # fmt: skip


def _finetune(launcher: list[str], model: str, output: Path) -> tuple[dict, str]:
    """(the held-out perplexities of the run's last report line, its log)."""
    flags = [item for key, value in SETTINGS.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    command = [*launcher, "-m", "hf_softmax_rnn.cli", "finetune", "--output-dir", str(output), "--model", model]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep the caller's packages
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    run = subprocess.run(command + flags, env=environment, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_fsdp2_finetune_equals_the_plain_run(tmp_path):
    model = save_tiny_model("llama", tmp_path / "model", word_tokenizer())
    plain, plain_log = _finetune([sys.executable], model, tmp_path / "plain")
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG)]
    sharded, sharded_log = _finetune(accelerate, model, tmp_path / "fsdp")
    assert "distributed: NO" in plain_log and "distributed: FSDP" in sharded_log, sharded_log[-3000:]
    assert sharded.keys() == plain.keys()
    assert list(sharded.values()) == pytest.approx(list(plain.values()), rel=1e-3)
    want, got = weights(tmp_path / "plain"), weights(tmp_path / "fsdp")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=1e-4, msg=name)

"""scripts/bench_recovery.py in its quick form: a tiny Llama trained for a few seconds on the
offline corpus stands in for the pretrained model; the recipe must lower the layer MSE and the
held-out loss (no fixed numbers)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.data.corpus import pydoc_corpus
from hf_softmax_rnn.training.data import eval_blocks

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_recovery.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_recovery", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pretrained_tiny_llama(tmp_path_factory) -> str:
    """A 2-layer Llama trained on the corpus' bytes, so that its attention matters (a byte is
    predicted from the bytes before it, which only attention can read)."""
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    blocks = eval_blocks(pydoc_corpus()["train"], tokenizer, 32, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        batch = blocks[torch.randint(len(blocks), (16,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_quick_recovery_lowers_layer_mse_and_heldout_loss(pretrained_tiny_llama, tmp_path):
    bench = _load_script()
    arguments = [
        "--model",
        pretrained_tiny_llama,
        "--rows",
        "base",
        "linear_hedgehog",
        "--block-size",
        "32",
        "--eval-blocks",
        "8",
        "--transfer-steps",
        "30",
        "--finetune-steps",
        "30",
        "--batch-size",
        "4",
        "--sample-tokens",
        "4",
        "--output",
        str(tmp_path),
    ]
    records = {record["row"]: record for record in bench.main(arguments)}
    hedgehog = records["linear_hedgehog"]
    points = hedgehog["points"]
    assert hedgehog["layer_mse"]["after"] < hedgehog["layer_mse"]["before"]
    assert points["transfer"]["eval_loss"] < points["converted"]["eval_loss"]
    assert points["finetune"]["eval_loss"] < points["transfer"]["eval_loss"]
    assert points["transfer"]["train_tokens"] == points["finetune"]["train_tokens"] == 30 * 4 * 32
    saved = json.loads((tmp_path / "recovery.json").read_text())
    assert [record["row"] for record in saved] == ["base", "linear_hedgehog"]
    table = (tmp_path / "recovery.md").read_text()
    assert "| linear_hedgehog | `linear_hedgehog` |" in table and (tmp_path / "recovery.png").stat().st_size > 0

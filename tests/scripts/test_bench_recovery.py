"""scripts/bench_recovery.py in its quick form: a tiny Llama trained for a few seconds on the
offline corpus stands in for the pretrained model; the recipe must lower the layer MSE and the
held-out loss (no fixed numbers); the long-context columns are those `position_perplexity` gives
the base model on its own; bad long-context settings are refused before any row runs."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.data.corpus import pydoc_corpus
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context import position_perplexity
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


@pytest.fixture(scope="module")
def long_texts(tmp_path_factory) -> str:
    """A folder of 3 .txt documents of held-out pydoc text, each over 64 bytes."""
    folder = tmp_path_factory.mktemp("long_texts")
    for index, text in enumerate(pydoc_corpus()["test"]["text"][:3]):
        (folder / f"{index}.txt").write_text(text)
    return str(folder)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--long-positions", "0", "64", "32"], r"bucket edges \[0, 64, 32\] are not allowed"),
        (["--long-positions", "0", "16", "128"], "bucket end=128 is more than the model's 64 positions"),
        (["--passkey", "256"], "passkey length=256 is more than the model's 64 positions"),
    ],
    ids=["unsorted-edges", "bucket-beyond-positions", "passkey-beyond-positions"],
)
def test_bad_long_context_settings_are_refused_before_any_row(
    pretrained_tiny_llama, long_texts, tmp_path, flags, message
):
    arguments = [
        "--model",
        pretrained_tiny_llama,
        "--rows",
        "base",
        "--long-texts",
        long_texts,
        "--output",
        str(tmp_path),
    ]
    with pytest.raises(UserInputError, match=message):
        _load_script().main([*arguments, "--long-positions", "0", "16", "64", "--passkey", "0", *flags])
    assert not (tmp_path / "recovery.json").exists()


@pytest.mark.slow
def test_quick_recovery_lowers_layer_mse_and_heldout_loss(pretrained_tiny_llama, long_texts, tmp_path):
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
        "--long-texts",
        long_texts,
        "--long-positions",
        "0",
        "16",
        "64",
        "--passkey",
        "0",
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
    texts = [(Path(long_texts) / f"{i}.txt").read_text().strip() for i in range(3)]
    base = LlamaForCausalLM.from_pretrained(pretrained_tiny_llama).eval()
    expected = position_perplexity(base, byte_tokenizer(), texts, ((0, 16), (16, 64)), num_sequences=2, progress=False)
    got = records["base"]["long_context"]["positions"]["buckets"]
    assert [b["perplexity"] for b in got] == pytest.approx([b["perplexity"] for b in expected["buckets"]], rel=1e-5)
    assert [b["tokens"] for b in hedgehog["long_context"]["positions"]["buckets"]] == [30, 96]
    assert "| linear_hedgehog | " in table.split("Perplexity by position")[1]
    assert (tmp_path / "long_context.png").stat().st_size > 10_000


def test_row_settings_override_the_command_line_but_not_the_heldout_blocks(tmp_path):
    """Every row builds a valid run; a row's own settings win, and held-out blocks keep --block-size."""
    script = _load_script()
    args = script.parse_args(["--block-size", "512", "--finetune-steps", "40"])
    for name in script.ROWS:
        preset, row_settings = script.row_recipe(name)
        config = script._settings(args, preset or "hedgehog_window_64", str(tmp_path / name), row_settings)
        assert config.data.heldout_block_size == 512
        assert config.data.block_size == row_settings.get("block_size", 512)
        assert config.finetune.finetune_steps == row_settings.get("finetune_steps", 40)
        assert config.state.state_steps == row_settings.get("state_steps", 0)
    preset, row_settings = script.row_recipe("long_recipe")
    long_recipe = script._settings(args, preset, str(tmp_path / "x"), row_settings)
    assert (long_recipe.data.block_size, long_recipe.finetune.finetune_steps) == (2048, 20)
    assert (long_recipe.state.state_steps, long_recipe.state.state_block_size) == (10, 4096)
    spec = long_recipe.model.attention_spec
    assert spec.window == 256 and spec.decay and spec.kept == 256

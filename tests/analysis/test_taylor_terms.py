import math
import re

import pytest
import torch
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_softmax_rnn.analysis.taylor_terms import (
    plot_heatmap,
    taylor_term_magnitudes,
    truncation_perplexities,
    write_csvs,
)
from hf_softmax_rnn.cli import main

from ..models.helpers import LLAMA_SHAPE

MAX_ORDER = 12
RECORDED: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []


def recording_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA that also records the q, k (after RoPE) that transformers computed."""
    RECORDED.append((module.layer_idx, query.detach().clone(), key.detach().clone(), scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register("recording_sdpa", recording_attention)


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_SHAPE | dict(vocab_size=97, max_position_embeddings=64, initializer_range=0.3))
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("recording_sdpa")
    return model


def reference_terms(num_layers: int) -> torch.Tensor:
    """mean |x|^n / n! with x from the recorded q, k, computed directly in float64."""
    means = torch.zeros(num_layers, MAX_ORDER + 1, dtype=torch.float64)
    for layer in range(num_layers):
        scores = []
        for index, query, key, scaling in RECORDED:
            if index != layer:
                continue
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            x = torch.einsum("bhqd,bhkd->bhqk", query.double(), key.double()) * scaling
            causal = torch.ones(x.shape[-2:], dtype=torch.bool).tril()
            scores.append(x[causal.expand_as(x)])
        x = torch.cat(scores).abs()
        means[layer] = torch.stack([(x**n).mean() / math.factorial(n) for n in range(MAX_ORDER + 1)])
    return means


@pytest.mark.parametrize("batch_size", [1, 3], ids=["batch1", "batch3"])
def test_matches_direct_float64_computation(model, batch_size):
    RECORDED.clear()
    blocks = torch.randint(97, (3, 16))
    terms = taylor_term_magnitudes(model, blocks, max_order=MAX_ORDER, batch_size=batch_size, progress=False)
    expected = reference_terms(num_layers=2)
    torch.testing.assert_close(terms.mean_abs_terms, expected, rtol=1e-6, atol=0)
    assert terms.dominant_order.tolist() == expected.argmax(1).tolist()
    assert terms.num_pairs == 3 * 4 * 16 * 17 // 2


def test_writes_csvs_and_heatmap(model, tmp_path):
    terms = taylor_term_magnitudes(model, torch.randint(97, (1, 8)), max_order=4, progress=False)
    long_csv, summary_csv = write_csvs(terms, tmp_path)
    assert len(long_csv.read_text().splitlines()) == 1 + 2 * 5
    assert len(summary_csv.read_text().splitlines()) == 1 + 2
    assert plot_heatmap(terms, tmp_path / "heat.png", "tiny").stat().st_size > 0


def test_rejects_bad_order_and_non_llama_models(model):
    for order in (0, 1025):
        with pytest.raises(ValueError, match=rf"^max_order={order} is not allowed; expected an int from 1 to 1024"):
            taylor_term_magnitudes(model, torch.randint(97, (1, 8)), max_order=order, progress=False)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no Llama-style"):
        taylor_term_magnitudes(gpt2, torch.zeros(1, 4, dtype=torch.long), progress=False)


def test_truncated_exp_converges_to_the_softmax_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    model = LlamaForCausalLM(config).double().eval()
    stream = torch.randint(97, (40,))
    results = truncation_perplexities(model, stream, [2, 40], max_length=16, stride=8, progress=False)
    ids = stream[None, :16]
    assert set(results) == {"softmax", "2", "40"}
    assert results["40"] == pytest.approx(results["softmax"], rel=1e-10)
    assert abs(results["2"] - results["softmax"]) > 1e-6
    whole = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    one_window = truncation_perplexities(model, stream[:16], [], max_length=16, stride=8, progress=False)
    assert one_window["softmax"] == pytest.approx(math.exp(whole), rel=1e-6)  # transformers: float32 loss


BAD_ARGUMENTS = {
    "zero-blocks": (["--num-blocks", "0"], r"--num-blocks=0 is not allowed; expected an int >= 1"),
    "zero-batch": (["--batch-size", "0"], r"--batch-size=0 is not allowed; expected an int >= 1"),
    "short-blocks": (["--block-size", "1"], r"--block-size=1 is not allowed; expected an int >= 2"),
    "zero-order": (["--max-order", "0"], r"--max-order=0 is not allowed; expected an int >= 1"),
    "negative-truncation-order": (
        ["--truncation-orders", "2", "-1"],
        r"--truncation-orders=\[2, -1\] is not allowed; expected ints from 0 to 1024",
    ),
    "huge-order": (["--max-order", "100000"], r"--max-order=100000 is not allowed; expected an int from 1 to 1024"),
    "huge-truncation-order": (
        ["--truncation-orders", "2000"],
        r"--truncation-orders=\[2000\] is not allowed; expected ints from 0 to 1024",
    ),
    "unknown-device": (["--device", "tpu9"], r"--device='tpu9' is not allowed"),
}


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_cli_rejects_bad_arguments_before_loading_the_model(tmp_path, capsys, argv, message):
    arguments = ["taylor-terms", str(tmp_path / "no_model"), *argv, "--output-dir", str(tmp_path / "out")]
    assert main(arguments) == 2
    assert re.match(r"hf-softmax-rnn taylor-terms: error: " + message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_cli_names_an_unreadable_dataset(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_bytes(b'{"text": "a"\n')
    arguments = ["taylor-terms", "default", "--dataset", str(tmp_path / "data.jsonl"), "--output-dir", str(tmp_path)]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert re.search(r"hf-softmax-rnn taylor-terms: error: Dataset '.*data\.jsonl' could not be read", error)

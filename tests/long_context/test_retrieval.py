"""Retrieval heads: the attention weight on the key's digits, against its closed form where every query
attends uniformly; top layers, their wider kept budget through `from_pretrained`, and bad input."""

import dataclasses
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context.retrieval import (
    ANSWER_ROOM,
    retrieval_layer_attention,
    retrieval_layers,
    retrieval_scores,
)

from .helpers import TEXTS, tiny_gpt2, tiny_llama, tokenizer

FILLER = TEXTS * 4
LENGTH = 400
KEPT_SPEC = AttentionSpec.from_preset("hedgehog_window_256_sinks_4_kept_256_decay", window=8, sinks=1, kept=4)


def uniform_attention(model) -> torch.nn.Module:
    """Zero query projections: every score is 0, so each query spreads its weight evenly over its prefix."""
    with torch.no_grad():
        if hasattr(model, "transformer"):  # GPT-2: the query third of c_attn
            for block in model.transformer.h:
                width = block.attn.c_attn.weight.shape[0]
                block.attn.c_attn.weight[:, :width].zero_()
                block.attn.c_attn.bias[:width].zero_()
        else:
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.zero_()
    return model


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_scores_of_uniform_attention_equal_the_closed_form(build):
    """Uniform attention puts 10 / (t + 1) on the 10 key digits from query t; the score is the mean of
    that over the 6 positions that predict " <key>" (a byte each), the same for every head."""
    model = uniform_attention(build())
    scores = retrieval_scores(model, tokenizer(), FILLER, length=LENGTH, depths=[0.2, 0.8], progress=False)
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    assert scores.shape == (config.num_hidden_layers, kv_heads)
    prompt = LENGTH - ANSWER_ROOM
    expected = sum(10 / (t + 1) for t in range(prompt - 1, prompt + 5)) / 6
    torch.testing.assert_close(scores, torch.full_like(scores, expected), atol=1e-6, rtol=1e-5)


def test_the_model_is_left_as_it_was():
    model = tiny_llama()
    ids = torch.tensor([tokenizer()(TEXTS[0])["input_ids"]])
    before = model(ids).logits
    retrieval_scores(model, tokenizer(), FILLER, length=LENGTH, depths=[0.5], trials=1, progress=False)
    assert model.config._attn_implementation == "sdpa"
    assert all(not layer.self_attn._forward_hooks for layer in model.model.layers)
    torch.testing.assert_close(model(ids).logits, before)


def test_top_layers_get_the_wider_kept_budget_when_loaded(tmp_path):
    scores = torch.tensor([[0.1, 0.3], [0.9, 0.0]])
    assert retrieval_layers(scores, 2) == [1, 0]
    overrides = retrieval_layer_attention(KEPT_SPEC, scores, count=1, kept=32)
    assert overrides == {1: dataclasses.replace(KEPT_SPEC, kept=32)}
    convert(tiny_llama(), KEPT_SPEC).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, layer_attention=overrides)
    assert [loaded.config.attention_spec(i).kept for i in range(2)] == [4, 32]
    assert [layer.self_attn.attention_spec.kept for layer in loaded.model.layers] == [4, 32]


def _converted_scores(_scores):
    return retrieval_scores(convert(tiny_llama(), KEPT_SPEC), tokenizer(), FILLER, progress=False)


def _too_long_scores(_scores):
    return retrieval_scores(tiny_llama(), tokenizer(), FILLER, length=1024, progress=False)


BAD_INPUT = {
    "count_above_layers": (lambda s: retrieval_layers(s, 3), "count=3 is not allowed; expected an int in 0..2"),
    "count_negative": (lambda s: retrieval_layers(s, -1), "count=-1 is not allowed"),
    "spec_without_kept": (
        lambda s: retrieval_layer_attention("hedgehog_window_64", s, 1, 32),
        "needs a spec with kept positions",
    ),
    "kept_below_spec": (
        lambda s: retrieval_layer_attention(KEPT_SPEC, s, 1, 2),
        "retrieval kept=2 is not allowed; expected an int >= the spec's kept=4",
    ),
    "converted_model": (_converted_scores, "pass the model it was converted from"),
    "length_above_positions": (_too_long_scores, "passkey length"),
}


@pytest.mark.parametrize(("call", "message"), BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_refused(call, message):
    with pytest.raises(UserInputError, match=re.escape(message)):
        call(torch.zeros(2, 2))

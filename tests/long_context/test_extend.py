"""`extend_context`: a rotary model, unmodified or converted, rescaled in place reads as transformers'
own model built from the YaRN config does; it keeps the scaling when saved; bad input is refused
before the model changes."""

import copy
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import convert
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context import extend_context, position_perplexity

from .helpers import LLAMA_KWARGS, POSITIONS, TEXTS, tiny_gpt2, tiny_llama, tokenizer

YARN_2 = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": POSITIONS}
PRESETS = [None, "hedgehog_window_64", "linear_elu"]


def _model(preset: str | None, config: LlamaConfig | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config or LlamaConfig(**LLAMA_KWARGS)).double().eval()
    return model if preset is None else convert(model, preset, attention_mode="parallel").eval()


def _logits(model, length: int = 2 * POSITIONS) -> torch.Tensor:
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("preset", PRESETS, ids=["llama", "hedgehog_window_64", "linear_elu"])
def test_an_extended_model_reads_as_the_model_built_from_the_yarn_config(preset):
    model = _model(preset)
    before = _logits(model)
    assert extend_context(model, 2) is model
    assert model.config.max_position_embeddings == 2 * POSITIONS
    assert model.config.rope_parameters == {**LlamaConfig(**LLAMA_KWARGS).rope_parameters, **YARN_2}
    config = LlamaConfig(**{**LLAMA_KWARGS, "max_position_embeddings": 2 * POSITIONS}, rope_parameters=YARN_2)
    reference = _model(preset, config)
    reference.load_state_dict(model.state_dict())
    after = _logits(model)
    torch.testing.assert_close(after, _logits(reference), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(after, before)


def test_an_extended_converted_model_keeps_its_scaling_when_saved(tmp_path):
    model = extend_context(_model("hedgehog_window_64"), 2)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-10, atol=1e-10)


def test_an_extended_model_scores_past_its_former_positions_without_being_asked():
    model = extend_context(tiny_llama(), 2)
    result = position_perplexity(model, tokenizer(), TEXTS, ((0, 600),), num_sequences=1, join=True, progress=False)
    assert result["max_positions"] == 2 * POSITIONS and result["buckets"][0]["tokens"] == 599


def test_extending_again_by_the_same_factor_leaves_the_model_as_it_is():
    model = extend_context(_model("hedgehog_window_64"), 2)
    rotary, config, logits = model.model.rotary_emb, model.config.to_dict(), _logits(model)
    assert extend_context(model, 2.0) is model
    assert model.model.rotary_emb is rotary and model.config.to_dict() == config
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=0)


def _rotary_state(model) -> list[tuple[object, dict[str, torch.Tensor], float]]:
    """Each rotary embedding of `model`: the module, a copy of its buffers and its attention scaling."""
    return [
        (module, {name: buffer.clone() for name, buffer in module.named_buffers()}, module.attention_scaling)
        for module in model.modules()
        if hasattr(module, "inv_freq")
    ]


TOO_MANY_POSITIONS = "is more than 9223372036854775807 positions"


@pytest.mark.parametrize(
    ("build", "factor", "message"),
    [
        (tiny_llama, 1, "factor=1 is not allowed; expected a finite number above 1"),
        (tiny_llama, 0.5, "factor=0.5 is not allowed"),
        (tiny_llama, float("inf"), "factor=inf is not allowed"),
        (tiny_llama, float("nan"), "factor=nan is not allowed"),
        (tiny_llama, True, "factor=True is not allowed"),
        (tiny_llama, "2", "factor='2' is not allowed"),
        (tiny_llama, 1e307, f"factor=1e\\+307 is not allowed: max_position_embeddings=512 .*{TOO_MANY_POSITIONS}"),
        (tiny_llama, np.float64(1e307), f"factor=np.float64\\(1e\\+307\\) is not allowed.*{TOO_MANY_POSITIONS}"),
        (tiny_llama, sys.float_info.max, f"factor=1.79.*e\\+308 is not allowed.*{TOO_MANY_POSITIONS}"),
        (tiny_llama, 1e300, f"{TOO_MANY_POSITIONS} .*; expected a factor of at most 18014398509481983$"),
        (tiny_llama, 10**400, TOO_MANY_POSITIONS),
        (tiny_gpt2, 2, "GPT2LMHeadModel has no rotary position embedding to rescale"),
        (lambda: extend_context(tiny_llama(), 3), 2, "already scaled \\(rope_type='yarn', factor=3.0\\)"),
    ],
    ids=[
        "one",
        "below-one",
        "inf",
        "nan",
        "bool",
        "string",
        "1e307",
        "numpy-1e307",
        "float-max",
        "beyond-int64-positions",
        "huge-int",
        "gpt2",
        "other-factor",
    ],
)
def test_bad_input_is_refused_and_leaves_the_model_as_it_was(build, factor, message):
    model = build()
    config, weights = copy.deepcopy(model.config.to_dict()), copy.deepcopy(model.state_dict())
    rotary = _rotary_state(model)
    with pytest.raises(UserInputError, match=message):
        extend_context(model, factor)
    assert model.config.to_dict() == config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name])
    assert [module for module, _, _ in _rotary_state(model)] == [module for module, _, _ in rotary]
    for module, buffers, scaling in rotary:
        assert module.attention_scaling == scaling
        assert all(torch.equal(buffer, buffers[name]) for name, buffer in module.named_buffers())


def test_a_rotary_embedding_that_fails_to_build_leaves_the_model_as_it_was(monkeypatch):
    """Whatever fails while the embeddings are rebuilt (here the rotary class itself), the config and the
    rotary embeddings stay as they were."""
    model = tiny_llama()
    config, rotary = copy.deepcopy(model.config.to_dict()), model.model.rotary_emb

    def failing_init(self, config):
        raise RuntimeError("rope init failed")

    monkeypatch.setattr(type(rotary), "__init__", failing_init)
    with pytest.raises(RuntimeError, match="rope init failed"):
        extend_context(model, 2)
    assert model.config.to_dict() == config and model.model.rotary_emb is rotary

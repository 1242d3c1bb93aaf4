"""The learned tensors a spec adds start where `RNNParams` says, however the model is made: converted, built from
its config, or loaded from a checkpoint that lacks them."""

import math

import pytest
import torch

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.analysis.small_models import small_llama
from hf_softmax_rnn.layers import RNNParams
from hf_softmax_rnn.layers.attention import DELTA_BIAS_INIT, GATE_BIAS_INIT, decay_half_lives
from hf_softmax_rnn.models import SoftmaxRNNGPT2LMHeadModel, SoftmaxRNNLlamaForCausalLM

from .helpers import tiny_source

#: Every projection and tensor `RNNParams` has: gates, decay, delta rule, hedgehog maps, a window's mixing weight,
#: the short convolution's taps.
SPEC = AttentionSpec(
    kind="linear",
    feature_map="hedgehog",
    window=4,
    sinks=1,
    decay=True,
    delta_rule=True,
    short_conv=3,
    input_gate=True,
    output_gate=True,
)
CLASSES = {"llama": SoftmaxRNNLlamaForCausalLM, "gpt2": SoftmaxRNNGPT2LMHeadModel}


def assert_initial(model):
    modules = [module for module in model.modules() if isinstance(module, RNNParams)]
    assert modules
    for params in modules:
        for gate in (params.input_gate, params.output_gate):
            assert torch.equal(gate.weight, torch.zeros_like(gate.weight))
            assert torch.equal(gate.bias, torch.full_like(gate.bias, GATE_BIAS_INIT))
        assert torch.equal(params.decay_proj.weight, torch.zeros_like(params.decay_proj.weight))
        half_lives = decay_half_lives(params.decay_proj.out_features).double()
        torch.testing.assert_close(torch.sigmoid(params.decay_proj.bias.double()), 2.0 ** (-1.0 / half_lives))
        assert math.isclose(half_lives[0].item(), 512.0) and math.isclose(half_lives[-1].item(), 16384.0)
        assert torch.equal(params.delta_proj.weight, torch.zeros_like(params.delta_proj.weight))
        assert torch.equal(params.delta_proj.bias, torch.full_like(params.delta_proj.bias, DELTA_BIAS_INIT))
        for maps in (params.hedgehog_q, params.hedgehog_k):
            assert torch.equal(maps, torch.eye(maps.shape[1], maps.shape[2]).expand_as(maps))
        assert torch.equal(params.linear_log_scale, torch.zeros_like(params.linear_log_scale))
        taps = params.short_conv_weight
        assert torch.equal(taps[..., -1], torch.ones_like(taps[..., -1]))
        assert torch.equal(taps[..., :-1], torch.zeros_like(taps[..., :-1]))


def test_a_converted_model_starts_at_the_initial_values(family):
    assert_initial(convert(tiny_source(family), SPEC))


def test_a_model_built_from_its_config_starts_at_the_initial_values(family):
    """transformers' own init of the base model inside (`LlamaModel`, `GPT2Model`) once gave these projections
    normal weights and a zero bias: gates at 0.5 and a decay that halves the state at every position."""
    config = convert(tiny_source(family), SPEC).config
    assert_initial(CLASSES[family](config))


def test_a_checkpoint_without_them_loads_them_at_the_initial_values(family, tmp_path):
    """A stock checkpoint loaded into a softmax_rnn class: the tensors it lacks once held uninitialised memory."""
    source = tiny_source(family)
    source.save_pretrained(tmp_path)
    loaded = CLASSES[family].from_pretrained(tmp_path, attention=SPEC.to_dict())
    assert_initial(loaded)
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("preset", ["softmax_gate", "gated_deltanet"])
def test_a_small_model_from_scratch_trains_with_open_gates(preset):
    model = small_llama(preset, vocab_size=32, hidden_size=16, num_layers=1, num_heads=2)
    params = model.model.layers[0].self_attn.rnn_params
    projection = params.output_gate if preset == "softmax_gate" else params.decay_proj
    assert torch.all(torch.sigmoid(projection.bias) > 0.99)


def test_a_short_convolution_starts_as_the_identity_so_the_logits_are_those_without_it(family):
    without = AttentionSpec(kind="linear", feature_map="hedgehog", window=3, sinks=1, decay=True, delta_rule=True)
    with_conv = AttentionSpec(**{**without.to_dict(), "short_conv": 4})
    source = tiny_source(family)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = convert(source, without).eval()(ids).logits
        torch.testing.assert_close(convert(source, with_conv).eval()(ids).logits, expected, rtol=0, atol=0)


def test_a_short_convolution_beside_a_state_too_large_to_decode_from_is_refused(family):
    """Order 30 at head_dim 8: C(38, 8) features, a state of 1.8 GB a KV head, which decodes from a KV cache."""
    spec = AttentionSpec(kind="recurrent_softmax", taylor_order=30, normalizer="l2", short_conv=2)
    with pytest.raises(ValueError, match=r"short_conv=2 is not allowed with .* too large to decode from"):
        convert(tiny_source(family), spec)


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(kind="recurrent_softmax", taylor_order=30, normalizer="l2", window=3, kept=2),
        AttentionSpec(kind="linear", feature_map="elu", window=4, kept=2**40),
    ],
    ids=["taylor-30", "kept-2**40"],
)
def test_kept_positions_beside_a_state_too_large_to_decode_from_are_refused(family, spec):
    """A KV cache cannot decode them: the model converted, scored its prompt, then generate raised 'mode=parallel
    needs a query at every key position' at the first new token."""
    with pytest.raises(ValueError, match=rf"kept={spec.kept} is not allowed with .* too large to decode from"):
        convert(tiny_source(family), spec)

"""Attention under autocast is one operation, as autocast treats `scaled_dot_product_attention`: its
output, and what the fused kernels read, is in autocast's dtype, and the body runs with autocast off.

Under bfloat16 autocast with float32 weights, q and k leave RoPE in float32 and v leaves its projection
in bfloat16. In their promoted dtype (float32), the fused kernels would run in float32 and the output
would be float32; in bfloat16 they run as in a bfloat16 model, and the PyTorch forms still compute in
float32 (autocast would have run their products in bfloat16).
"""

import pytest
import torch

from hf_softmax_rnn.ops import attention, backends
from hf_softmax_rnn.ops.fla_linear import chunk_simple_gla_reference
from tests.models.helpers import tiny_model

from .helpers import as_params, gated, make_inputs, make_params, quiet_preset

#: spec name -> modes it runs in
CASES = {
    "softmax": ["parallel"],
    "linear_elu": ["parallel", "chunked", "recurrent"],
    "softmax_taylor_2": ["parallel", "chunked"],
    "hedgehog_window_64": ["chunked", "recurrent"],
    "hedgehog_window_256_sinks_4_kept_256_decay": ["chunked"],
}
PARAMS = [pytest.param(name, mode, id=f"{name}-{mode}") for name, modes in CASES.items() for mode in modes]


def _call(name: str, mode: str, q, k, v, gate_logits, window: int = 3):
    spec = quiet_preset(name)
    if spec.window is not None:
        spec = quiet_preset(name, window=window, kept=spec.kept and 2, sinks=spec.sinks and 1)
    v, gates = gated(spec, v, gate_logits)
    params = as_params(make_params(spec, dtype=torch.float32))
    return attention(q, k, v, spec, mode=mode, gates=gates, params=params, return_state=False)[0]


@pytest.mark.parametrize(("name", "mode"), PARAMS)
def test_under_autocast_the_output_is_the_float32_result_in_autocast_s_dtype(name, mode):
    """float32 q, k and bfloat16 v (as RoPE leaves them) under bfloat16 autocast: the PyTorch forms compute
    in float32 (no bfloat16 products) and return in bfloat16; exact softmax runs SDPA on bfloat16 inputs,
    as autocast runs it."""
    q, k, v, gate_logits = make_inputs(length=9, dtype=torch.float32)
    v = v.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _call(name, mode, q, k, v, gate_logits)
    if name == "softmax":
        want = _call(name, mode, q.bfloat16(), k.bfloat16(), v, gate_logits)
    else:
        want = _call(name, mode, q, k, v.float(), gate_logits).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_io_dtype_sets_the_output_dtype_outside_autocast_as_autocast_does_inside():
    q, k, v, _ = make_inputs(length=9, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast, _ = attention(q, k, v, "linear_elu", mode="chunked")
    given, _ = attention(q, k, v, "linear_elu", mode="chunked", io_dtype=torch.bfloat16)
    assert given.dtype == torch.bfloat16
    torch.testing.assert_close(given, under_autocast, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.int32, torch.complex64, "bfloat16"], ids=str)
def test_a_bad_io_dtype_is_refused_with_its_value_and_the_allowed_ones(bad):
    q, k, v, _ = make_inputs(length=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"io_dtype=.*not allowed.*torch.bfloat16"):
        attention(q, k, v, "linear_elu", mode="chunked", io_dtype=bad)


def test_float64_inputs_are_left_alone_by_autocast():
    q, k, v, _ = make_inputs(length=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = attention(q, k, v, "linear_elu", mode="chunked")
    want, _ = attention(q, k, v, "linear_elu", mode="chunked")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gradients_reach_float32_inputs_through_autocast():
    """The gradients of q, k, v are those of the float32 computation (float32 leaves, float32 gradients)."""
    q, k, v, _ = make_inputs(length=7, dtype=torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(q, k, v, "linear_elu", mode="chunked")
    weights = torch.randn(out.shape)
    (out.float() * weights).sum().backward()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    want, _ = attention(*leaves, "linear_elu", mode="chunked")
    (want.bfloat16().float() * weights).sum().backward()
    for got_leaf, want_leaf in zip((q, k, v), leaves, strict=True):
        assert got_leaf.grad.dtype == torch.float32
        torch.testing.assert_close(got_leaf.grad, want_leaf.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["linear_elu", "hedgehog_window_64"])
def test_a_model_under_bfloat16_autocast_sends_bfloat16_to_fla(name, monkeypatch):
    """A converted float32 Llama trained under bfloat16 autocast: fla reads bfloat16 q, k, v (as the
    original's SDPA does), not the float32 in which q and k leave RoPE."""
    read = []

    def recorded(q, k, v, **kwargs):
        read.append({q.dtype, k.dtype, v.dtype})
        return chunk_simple_gla_reference(q, k, v, **kwargs)

    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: recorded)
    spec = quiet_preset(name, **({"window": 3} if quiet_preset(name).window else {}))
    model = tiny_model("llama", spec, attention_mode="chunked").train()
    ids = torch.randint(0, 64, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert read and all(dtypes == {torch.bfloat16} for dtypes in read), read
    assert torch.isfinite(loss)

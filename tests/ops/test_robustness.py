"""Inputs at the edges: huge scores, high Taylor orders in low precision, empty sequences, and
garbage (NaN, inf) in padded positions."""

from fractions import Fraction

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.attention_spec import MODES
from hf_softmax_rnn.ops import attention, taylor_exp

from .helpers import FINITE_SPECS, as_params, left_padding_mask, make_inputs, make_params, quiet_preset

LOW_PRECISION = [torch.float32, torch.bfloat16, torch.float16]


def exact_taylor(x: float, order: int) -> float:
    total, term = Fraction(0), Fraction(1)
    for n in range(order + 1):
        total += term
        term = term * Fraction(x) / (n + 1)
    return float(total)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("x", [-20.0, -38.0, -5.0, -0.25, 3.0, 25.0])
def test_order_79_truncation_is_right_in_every_dtype(x, dtype):
    """1/n! underflows in float32 for n >= 39, and the alternating sum cancels: both avoided."""
    got = taylor_exp(torch.tensor([x], dtype=dtype), 79).double().item()
    want = torch.tensor(exact_taylor(x, 79), dtype=torch.float64).to(dtype).double().item()  # what dtype can hold
    assert got == pytest.approx(want, rel={torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype])


@pytest.mark.parametrize("normalizer", ["clamp", "detach", "detach_eps"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_bounded_normalisers_of_exact_exp_stay_finite_for_huge_scores(normalizer, dtype):
    spec = AttentionSpec(kind="recurrent_softmax", normalizer=normalizer)
    q, k, v, _ = make_inputs(length=6)
    q, k = 100 * q, 100 * k
    got, _ = attention(q.to(dtype), k.to(dtype), v.to(dtype), spec)
    want, _ = attention(q, k, v, spec)  # float64: the scores reach ~e^3000 there too, but are shifted
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol={torch.float32: 1e-5}.get(dtype, 2e-2))


@pytest.mark.parametrize("name", ["linear_elu", "softmax_taylor_2", "window3_hedgehog"])
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_empty_sequences_return_empty_outputs_and_keep_the_state(name, mode):
    spec = FINITE_SPECS[name]
    q, k, v, _ = make_inputs(length=5)
    params = as_params(make_params(spec))
    state = None
    if mode != "parallel":
        _, state = attention(q, k, v, spec, mode="chunked", params=params)
    out, after = attention(q[..., :0, :], k[..., :0, :], v[..., :0, :], spec, mode=mode, params=params, state=state)
    assert out.shape == (2, 4, 0, 8)
    assert after is state


GARBAGE_CASES = [
    *[(name, mode) for name in ("linear_elu", "softmax_taylor_2", "window3_hedgehog") for mode in MODES],
    ("softmax", "parallel"),
    ("gated_softmax", "parallel"),
]


@pytest.mark.parametrize(("name", "mode"), GARBAGE_CASES, ids=[f"{name}-{mode}" for name, mode in GARBAGE_CASES])
def test_nan_and_inf_in_padding_do_not_reach_the_output(name, mode):
    spec = FINITE_SPECS.get(name) or quiet_preset(name)
    q, k, v, _ = make_inputs(length=7)
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, 7, [0, 3])
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[1, :, :3] = float("nan")
    dirty_v[1, :, :3] = float("inf")
    gates = {"output": torch.rand(2, 4, 7, dtype=torch.float64)} if spec.output_gate else None
    clean, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params, gates=gates)
    dirty, _ = attention(q, dirty_k, dirty_v, spec, mode=mode, attention_mask=mask, params=params, gates=gates)
    rows = mask.bool()[:, None, :, None].expand_as(clean)
    torch.testing.assert_close(dirty[rows], clean[rows], rtol=1e-12, atol=1e-12)

"""Inputs at the edges: huge scores, high Taylor orders in low precision, empty sequences, and
garbage (NaN, inf) in padded positions."""

import math
from fractions import Fraction

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.attention_spec import MODES
from hf_softmax_rnn.ops import attention, taylor_exp
from hf_softmax_rnn.ops.feature_maps import elu_plus_one

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


@pytest.mark.parametrize("dtype", [torch.float64, *LOW_PRECISION], ids=str)
@pytest.mark.parametrize("x", [-80.0, -40.0, -20.0, -1e-3, 0.0, 2.0, 1e4], ids=lambda x: f"x={x:g}")
def test_elu_plus_one_is_e_to_the_x_below_zero(x, dtype):
    """elu(x) + 1 is e^x for x <= 0: adding 1 to e^x - 1 would leave 0 (float32 below -17, float64 below -37)."""
    point = torch.tensor([x], dtype=dtype, requires_grad=True)
    got = elu_plus_one(point)
    (gradient,) = torch.autograd.grad(got.sum(), point)
    held = point.detach().double().item()  # x as dtype holds it
    want = held + 1.0 if held > 0 else math.exp(held)
    want_gradient = 1.0 if held > 0 else math.exp(held)
    tiniest = torch.finfo(dtype).tiny
    rel = {torch.float64: 1e-15, torch.float32: 1e-6}.get(dtype, 1e-2)
    for value, expected in ((got, want), (gradient, want_gradient)):
        if expected < tiniest:  # below what dtype holds as a normal number
            assert 0 <= value.item() < 2 * tiniest
        else:
            assert value.double().item() == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_elu_attention_of_very_negative_queries_and_keys_matches_float64(mode, dtype):
    """q and k near -30: each feature e^x ~ 1e-13, still a number in float32; the output is the average of the
    values weighted by sum_d e^(q_d + k_d), computed here from its definition in float64."""
    q, k, v, _ = make_inputs(length=7)
    q, k, v = (q - 30).to(dtype), (k - 30).to(dtype), v.to(dtype)
    got, _ = attention(q, k, v, "linear_elu", mode=mode)
    q64, k64, v64 = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    weights = torch.exp(q64) @ torch.exp(k64).repeat_interleave(groups, 1).mT
    weights = weights.tril()
    want = (weights @ v64.repeat_interleave(groups, 1)) / weights.sum(-1, keepdim=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol={torch.float32: 1e-5}.get(dtype, 2e-2))


@pytest.mark.parametrize(
    "spec", ["linear_elu", AttentionSpec(kind="linear", feature_map="elu", decay=True)], ids=["linear_elu", "elu_decay"]
)
@pytest.mark.parametrize("shifts", [(-52, -52), (-60, -60), (-200, -5), (-100, -20)], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_elu_attention_of_queries_and_keys_whose_products_underflow_matches_float64(mode, shifts, spec):
    """Every coordinate of q + k below about -104: each product e^(q_d) e^(k_d) is 0 in float32, the weights
    of the keys 0 / 0. The output is their average weighted by sum_d e^(q_d + k_d) (with decay, times the
    decays between them), computed here from its definition in log space in float64."""
    spec = AttentionSpec.coerce(spec)
    q, k, v, gate_logits = make_inputs(length=7)
    q, k = q + shifts[0], k + shifts[1]
    gates = {"decay": torch.nn.functional.logsigmoid(gate_logits["decay"])} if spec.decay else {}
    got, _ = attention(q.float(), k.float(), v.float(), spec, mode=mode, gates={n: g.float() for n, g in gates.items()})
    groups = q.shape[1] // k.shape[1]
    log_weights = torch.logsumexp(q[..., :, None, :] + k.repeat_interleave(groups, 1)[..., None, :, :], dim=-1)
    if spec.decay:
        decayed = gates["decay"].cumsum(-1).repeat_interleave(groups, 1)
        log_weights = log_weights + decayed[..., :, None] - decayed[..., None, :]
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    weights = torch.softmax(log_weights.masked_fill(~causal, -math.inf), dim=-1)
    want = weights @ v.repeat_interleave(groups, 1)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)

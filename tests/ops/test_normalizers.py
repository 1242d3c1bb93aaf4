"""Row-scalar invariance (SPEC section 2) and half-precision stability."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.attention_spec import ROW_SCALE_INVARIANT_NORMALIZERS
from hf_softmax_rnn.ops import attention
from hf_softmax_rnn.ops.normalizers import normalize

from .helpers import as_params, make_inputs, make_params


@pytest.mark.parametrize("normalizer", ROW_SCALE_INVARIANT_NORMALIZERS)
def test_invariant_normalizers_ignore_row_scale(normalizer):
    """exp(x) and exp(x - m) give the same output: N and G scaled by any positive row factor."""
    spec = AttentionSpec(kind="recurrent_softmax", normalizer=normalizer, norm_eps=1e-12)
    numerator = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    denominator = torch.rand(2, 3, 5, dtype=torch.float64) + 0.5
    visible = torch.arange(1, 6)[None, None].expand(2, 1, 5)
    row_factor = torch.exp(torch.randn(2, 3, 5, dtype=torch.float64).clamp(-3, 3))
    params = as_params(make_params(spec, heads=3, kv_heads=3))
    plain = normalize(numerator, denominator, visible, spec, params)
    scaled = normalize(numerator * row_factor[..., None], denominator * row_factor, visible, spec, params)
    torch.testing.assert_close(scaled, plain, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("normalizer", ["seqlen", "clamp", "none"])
def test_non_invariant_normalizers_see_row_scale(normalizer):
    spec = AttentionSpec(kind="recurrent_softmax", normalizer=normalizer)
    numerator = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    denominator = torch.full((1, 1, 4), 0.3, dtype=torch.float64)
    visible = torch.arange(1, 5)[None, None]
    plain = normalize(numerator, denominator, visible, spec, {})
    scaled = normalize(numerator * 7.0, denominator * 7.0, visible, spec, {})
    assert not torch.allclose(plain, scaled)


@pytest.mark.parametrize("normalizer", ROW_SCALE_INVARIANT_NORMALIZERS)
def test_exact_exp_is_stabilised_by_the_row_max(normalizer):
    """Parallel exact exp equals the unstabilised float64 formula, and bf16 with scores ~ 1e3 stays finite."""
    spec = AttentionSpec(kind="recurrent_softmax", normalizer=normalizer, norm_eps=1e-12)
    q, k, v, _ = make_inputs(length=9)
    params = make_params(spec)
    out, _ = attention(q, k, v, spec, params=as_params(params))
    scores = torch.exp(8**-0.5 * q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * torch.ones(9, 9).tril()
    numerator = scores @ v.repeat_interleave(2, 1)
    direct = normalize(
        numerator, scores.sum(-1), torch.arange(1, 10)[None, None].expand(2, 1, 9), spec, as_params(params)
    )
    torch.testing.assert_close(out, direct, rtol=1e-6, atol=1e-7)

    big_q, big_k = (40 * q).bfloat16(), (40 * k).bfloat16()
    half_params = as_params({name: p.bfloat16() for name, p in params.items()})
    half, _ = attention(big_q, big_k, v.bfloat16(), spec, params=half_params)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    reference, _ = attention(big_q.double(), big_k.double(), v.bfloat16().double(), spec, params=as_params(params))
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(half.double(), reference, rtol=0.05, atol=0.05)


def test_exp_without_norm_or_clamp_overflows_in_bf16():
    """The claim-4 instability: no normaliser and no clamp leaves exp unbounded."""
    spec = AttentionSpec(kind="recurrent_softmax", normalizer="none")
    q, k, v, _ = make_inputs(length=6, dtype=torch.float32)
    out, _ = attention(60 * q, 60 * k, v, spec)
    assert not torch.isfinite(out).all()


@pytest.mark.parametrize("mode", ["parallel", "chunked"])
@pytest.mark.parametrize("normalizer", [name for name in ROW_SCALE_INVARIANT_NORMALIZERS if name != "softmax"])
def test_norms_of_a_window_hybrid_do_not_overflow_in_float32(normalizer, mode):
    """Where every score in the window is far below lambda, the finite part's weight is capped at
    e^MAX_MIX_EXPONENT and its numerators exceed 1e19, whose squares overflow float32: the norms square them
    divided by the row's largest entry, so float32 matches float64 on the same inputs (the rows were zeros)."""
    spec = AttentionSpec(kind="recurrent_softmax", taylor_order=2, normalizer=normalizer, window=4)
    q, k, v, _ = make_inputs(length=30, dtype=torch.float32)
    q, k = 10 * q, 10 * k
    params = make_params(spec, dtype=torch.float32)
    out, _ = attention(q, k, v, spec, mode=mode, params=as_params(params))
    wide = as_params({name: p.double() for name, p in params.items()})
    reference, _ = attention(q.double(), k.double(), v.double(), spec, mode=mode, params=wide)
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)

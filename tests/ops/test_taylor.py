"""The Taylor family (ops/taylor.py): its feature map against the one-product-per-monomial
reference, and the claims of SPEC section 1 (claims 1 and 2 of section 6)."""

import itertools
import math
from fractions import Fraction

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.attention_spec import taylor_feature_dim
from hf_softmax_rnn.ops import (
    attention,
    softmax_attention_reference,
    taylor_exp,
    taylor_features,
    taylor_features_reference,
)
from hf_softmax_rnn.ops.taylor import taylor_features_gathered

from .helpers import make_inputs


@pytest.mark.parametrize("order", [0, 1, 2, 3, 4])
def test_taylor_features_dot_product_is_truncated_exp(order):
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.randn(7, 6, dtype=torch.float64)
    dots = x @ y.T
    expected = sum(dots**n / math.factorial(n) for n in range(order + 1))
    torch.testing.assert_close(taylor_features(x, order) @ taylor_features(y, order).T, expected)
    torch.testing.assert_close(taylor_exp(dots, order), expected)


@pytest.mark.parametrize(
    ("head_dim", "order", "size"), [(64, 2, 1 + 64 + 2080), (64, 3, 1 + 64 + 2080 + 45760), (8, 0, 1)]
)
def test_symmetric_basis_size(head_dim, order, size):
    assert taylor_feature_dim(head_dim, order) == size
    assert taylor_features(torch.zeros(1, head_dim), order).shape[-1] == size


def test_taylor_recurrence_converges_to_softmax():
    """Claim 1: error falls with N, below 1e-6 by N = 30 for |x| <= 5."""
    q, k, v, _ = make_inputs(batch=1, heads=2, kv_heads=1, length=16, head_dim=8)
    scale = 8**-0.5
    x = scale * q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    q = q * (5.0 / x.abs().max()).sqrt()
    k = k * (5.0 / x.abs().max()).sqrt()
    reference = softmax_attention_reference(q, k, v, None, scale)
    errors = []
    for order in (4, 8, 12, 16, 24, 30):
        spec = AttentionSpec(kind="recurrent_softmax", taylor_order=order, normalizer="softmax")
        out, _ = attention(q, k, v, spec, mode="parallel")
        errors.append((out - reference).abs().max().item())
    assert all(later < earlier for earlier, later in itertools.pairwise(errors))
    assert errors[-1] < 1e-6


def test_taylor_recurrent_form_converges_to_softmax():
    """The finite RNN itself (recurrent mode, order 8 on small scores) approaches softmax."""
    q, k, v, _ = make_inputs(batch=1, heads=2, kv_heads=1, length=10, head_dim=4)
    q, k = 0.5 * q, 0.5 * k
    reference = softmax_attention_reference(q, k, v, None, 0.5)
    errors = [
        (attention(q, k, v, AttentionSpec(kind="recurrent_softmax", taylor_order=n), mode="recurrent")[0] - reference)
        .abs()
        .max()
        .item()
        for n in (2, 4, 8)
    ]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-5


def test_order_one_numerator_is_identity_linear_attention():
    """Claim 2: the order-1 numerator minus the order-0 term equals identity-map linear attention."""
    q, k, v, _ = make_inputs(length=9)
    none = dict(normalizer="none")
    order1, _ = attention(q, k, v, AttentionSpec(kind="recurrent_softmax", taylor_order=1, **none), mode="recurrent")
    order0, _ = attention(q, k, v, AttentionSpec(kind="recurrent_softmax", taylor_order=0, **none), mode="recurrent")
    linear, _ = attention(q, k, v, AttentionSpec(kind="linear", feature_map="identity", **none), mode="recurrent")
    torch.testing.assert_close(order1 - order0, linear)
    causal = torch.ones(9, 9, dtype=torch.float64).tril()
    identity_direct = (8**-0.5 * q @ k.repeat_interleave(2, 1).transpose(-1, -2) * causal) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(linear, identity_direct)


def test_order_zero_denominator_is_visible_count():
    """Claim 2: the order-0 term of G_t is t, the number of visible positions."""
    q, k, _, _ = make_inputs(length=7)
    ones = torch.ones(2, 2, 7, 1, dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    spec = AttentionSpec(kind="recurrent_softmax", taylor_order=0, normalizer="none")
    for mode in ("parallel", "chunked", "recurrent"):
        g, state = attention(q, k, ones, spec, mode=mode, attention_mask=mask)
        expected = mask.cumsum(-1).to(torch.float64)[:, None, :].expand(2, 4, 7)
        torch.testing.assert_close(g[..., 0], expected)


@pytest.mark.parametrize("head_dim", [1, 2, 5, 8], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("order", [0, 1, 2, 3, 4], ids=lambda n: f"order{n}")
def test_features_match_reference(head_dim, order):
    """The fast construction (shifted products, gathers, hand-written backward) against one
    product per monomial: same features, same gradients, odd and even head sizes."""
    x = torch.randn(2, 3, 5, head_dim, dtype=torch.float64, requires_grad=True)
    fast, slow = taylor_features(x, order), taylor_features_reference(x, order)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    if order == 0:
        return
    weights = torch.randn_like(slow)
    grads = [torch.autograd.grad((features * weights).sum(), x)[0] for features in (fast, slow)]
    torch.testing.assert_close(*grads, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dim", [1, 2, 5, 8], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("order", [0, 1, 2, 3], ids=lambda n: f"order{n}")
def test_gathered_features_match_reference(head_dim, order):
    """The gather form that compiled decoding uses: same features and gradients as the reference."""
    x = torch.randn(2, 3, 5, head_dim, dtype=torch.float64, requires_grad=True)
    gathered, slow = taylor_features_gathered(x, order), taylor_features_reference(x, order)
    torch.testing.assert_close(gathered, slow, rtol=1e-12, atol=1e-12)
    if order > 0:
        weights = torch.randn_like(slow)
        grads = [torch.autograd.grad((features * weights).sum(), x)[0] for features in (gathered, slow)]
        torch.testing.assert_close(*grads, rtol=1e-12, atol=1e-12)


def test_taylor_features_compile_without_graph_breaks():
    x = torch.randn(1, 3, 1, 8)
    explanation = torch._dynamo.explain(lambda t: taylor_features(t, 2))(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(torch.compile(lambda t: taylor_features(t, 2))(x), taylor_features_reference(x, 2))


@pytest.mark.parametrize("order", [1, 2, 3])
def test_features_gradcheck(order):
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: taylor_features(t, order), (x,))


def _truncated_softmax_reference(q, k, v, order):
    """Causal attention with weights p(q.k) / sum_s p(q.k_s), p = sum_{n<=N} x^n/n! in exact rationals."""
    scores = (q.double() @ k.double().mT)[0, 0].tolist()
    rows = []
    for t, row in enumerate(scores):
        values = [sum(Fraction(x) ** n / math.factorial(n) for n in range(order + 1)) for x in row[: t + 1]]
        total = sum(values)
        rows.append([float(value / total) for value in values] + [0.0] * (len(row) - t - 1))
    return (torch.tensor(rows, dtype=torch.float64) @ v.double()[0, 0])[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("score", [200.0, 1e4], ids=["score_200", "score_1e4"])
def test_eighty_terms_stay_finite_and_exact_at_large_scores(dtype, score):
    """79^th-order terms at score 200 are 1e65, beyond float32 (and bf16/fp16): each row is divided by its
    largest score in float64 first, which the softmax denominator cancels."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 6, 4, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 1, 6, 4, generator=generator, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True) * math.sqrt(score)
    k = k / k.norm(dim=-1, keepdim=True) * math.sqrt(score)
    v = torch.randn(1, 1, 6, 4, generator=generator, dtype=torch.float64)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out, _ = attention(q, k, v, AttentionSpec.from_preset("softmax_taylor_80terms"), scale=1.0)
    assert out.dtype == dtype and torch.isfinite(out).all()
    expected = _truncated_softmax_reference(q, k, v, 79)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)

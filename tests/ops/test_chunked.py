"""The hand-written chunked engine (ops/chunked.py) against the generic chunked path with
autograd through the feature map (ops/linear.py), for every kernel it runs."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops.chunked import chunked_kernel_attention
from hf_softmax_rnn.ops.feature_maps import CosineKernel, ElementwiseKernel, HedgehogKernel, build_kernel
from hf_softmax_rnn.ops.kernels import AttentionParams
from hf_softmax_rnn.ops.linear import generic_chunked_linear_attention
from hf_softmax_rnn.ops.taylor import TaylorKernel


def chunk_kernel(spec, scale):
    return build_kernel(spec, scale, AttentionParams(hedgehog_q=torch.eye(8)[None], hedgehog_k=torch.eye(8)[None]))


KERNEL_SPECS = {
    **{
        f"taylor{order}": AttentionSpec(kind="recurrent_softmax", taylor_order=order, normalizer="l2")
        for order in range(4)
    },
    **{name: AttentionSpec(kind="linear", feature_map=name) for name in ("identity", "elu", "relu")},
}


def _inputs(spec, length, head_dim=6, groups=2, kv_heads=2, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()

    q = randn(2, kv_heads, groups, length, head_dim)
    k = randn(2, kv_heads, length, head_dim)
    v = randn(2, kv_heads, length, head_dim + 1)
    state = randn(2, kv_heads, spec.feature_dim(head_dim), head_dim + 1)
    return q, k, v, state


@pytest.mark.parametrize("name", sorted(KERNEL_SPECS))
@pytest.mark.parametrize(("length", "chunk_size"), [(13, 4), (8, 8), (5, 16), (1, 3)], ids=lambda x: str(x))
def test_engine_matches_generic_chunked_path(name, length, chunk_size):
    """Outputs, final state and the gradients of q, k, v and the initial state, with chunks
    that do not divide the length and grouped queries."""
    spec = KERNEL_SPECS[name]
    kernel = chunk_kernel(spec, 0.3)
    inputs = _inputs(spec, length)
    out_weights = torch.randn(2, 2, 2, length, 7, dtype=torch.float64)
    state_weights = torch.randn_like(inputs[3])

    def run(fn):
        out, state = fn()
        loss = (out * out_weights).sum() + (state * state_weights).sum()
        return [out, state, *torch.autograd.grad(loss, inputs)]

    fast = run(lambda: chunked_kernel_attention(*inputs, kernel, chunk_size))
    generic = run(lambda: generic_chunked_linear_attention(*inputs, kernel, chunk_size))
    for got, want in zip(fast, generic):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (AttentionSpec.from_preset("softmax_taylor_2"), TaylorKernel),
        (AttentionSpec.from_preset("linear_elu"), ElementwiseKernel),
        (AttentionSpec(kind="linear", feature_map="cosine"), CosineKernel),
        (AttentionSpec(kind="linear", feature_map="hedgehog"), HedgehogKernel),
    ],
    ids=["taylor", "elu", "cosine", "hedgehog"],
)
def test_kernel_choice(spec, expected):
    """Maps that are not elementwise (cosine normalises rows, hedgehog has weights) keep the generic path."""
    kernel = chunk_kernel(spec, 0.125)
    assert isinstance(kernel, expected)
    assert kernel.hand_written == (expected in (TaylorKernel, ElementwiseKernel))


FEATURE_MAPS = {
    **KERNEL_SPECS,
    "cosine": AttentionSpec(kind="linear", feature_map="cosine"),
    "hedgehog": AttentionSpec(kind="linear", feature_map="hedgehog"),
}


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_query_features_split_from_their_factor_multiply_back_to_the_query_features(name):
    """(phi(q) / c, c): what fla reads with c as its own scale; c is the q.k scale where the map multiplies
    phi(q) by it, else 1."""
    spec = FEATURE_MAPS[name]
    generator = torch.Generator().manual_seed(0)
    weights = AttentionParams(
        hedgehog_q=torch.randn(2, 6, 6, generator=generator, dtype=torch.float64),
        hedgehog_k=torch.randn(1, 6, 6, generator=generator, dtype=torch.float64),
    )
    kernel = build_kernel(spec, 0.3, weights)
    q = torch.randn(2, 1, 2, 5, 6, generator=generator, dtype=torch.float64)
    features, factor = kernel.query_features_and_factor(q)
    torch.testing.assert_close(features * factor, kernel.query_features(q), rtol=1e-12, atol=0)
    assert factor == (1.0 if name.startswith("taylor") else 0.3)


def test_float32_gradients_over_many_chunks():
    """The backward rewinds the state chunk by chunk (S_{c-1} = S_c - phi(k_c)^T v_c) from a
    float64 copy, so over 256 chunks the float32 gradients of the first positions stay as close
    to float64 as the rest (rewinding in float32 gives 7e-7 there, growing with the length)."""
    length, head_dim = 2048, 8
    spec = KERNEL_SPECS["taylor2"]
    inputs64 = _inputs(spec, length, head_dim=head_dim, groups=3, kv_heads=1, seed=3)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    weights = torch.randn(
        2, 1, 3, length, head_dim + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )

    def run(inputs):
        out, _ = chunked_kernel_attention(*inputs, TaylorKernel(2, head_dim**-0.5), 8)
        return [out, *torch.autograd.grad((out * weights.to(out.dtype)).sum(), inputs)]

    def relative(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    found, reference = run(inputs32), run(inputs64)
    for got, want in zip(found, reference):
        assert relative(got, want) < 3e-6
    assert relative(found[1][..., :256, :], reference[1][..., :256, :]) < 4e-7


@pytest.mark.parametrize("length", [8, 6], ids=["whole-chunks", "padded"])
def test_engine_takes_strided_inputs(length):
    """q, k, v as transposed views (as the layers hand them over), with and without padding."""
    spec = KERNEL_SPECS["taylor2"]
    q, k, v, state = (x.detach() for x in _inputs(spec, length))
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
    assert not any(x.is_contiguous() for x in strided)
    kernel = chunk_kernel(spec, 0.3)
    for got, want in zip(
        chunked_kernel_attention(*strided, state, kernel, 4), chunked_kernel_attention(q, k, v, state, kernel, 4)
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

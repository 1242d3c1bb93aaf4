"""The hand-written chunked engine (ops/chunked.py) against the chunk loops with autograd through
the feature map (ops/linear.py without decay, ops/decay.py with it), for every kernel it runs:
those that rebuild their features chunk by chunk and the maps computed before the call."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops.chunked import chunked_kernel_attention
from hf_softmax_rnn.ops.decay import chunked_decayed_linear_attention
from hf_softmax_rnn.ops.feature_maps import CosineKernel, ElementwiseKernel, HedgehogKernel, build_kernel
from hf_softmax_rnn.ops.kernels import AttentionParams
from hf_softmax_rnn.ops.linear import generic_chunked_linear_attention
from hf_softmax_rnn.ops.taylor import TaylorKernel

from .kernel_stand_ins import saved_bytes


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


FEATURE_MAPS = {
    **KERNEL_SPECS,
    "cosine": AttentionSpec(kind="linear", feature_map="cosine"),
    "hedgehog": AttentionSpec(kind="linear", feature_map="hedgehog"),
}


def _kernel_and_weights(spec, scale, head_dim=6, kv_heads=2, groups=2, seed=5):
    """The kernel of `spec` with random hedgehog weights (leaves), and those weights."""
    generator = torch.Generator().manual_seed(seed)
    weights = [
        torch.randn(heads, head_dim, head_dim, generator=generator, dtype=torch.float64).requires_grad_()
        for heads in (kv_heads * groups, kv_heads)
    ]
    kernel = build_kernel(spec, scale, AttentionParams(hedgehog_q=weights[0], hedgehog_k=weights[1]))
    return kernel, weights if spec.feature_map == "hedgehog" else []


def _log_decays(length, strength, kv_heads=2, seed=6):
    """Log-decays `[2, Hkv, L]` in [-strength, 0], a leaf."""
    generator = torch.Generator().manual_seed(seed)
    return (-strength * torch.rand(2, kv_heads, length, generator=generator, dtype=torch.float64)).requires_grad_()


def _outputs_and_gradients(function, inputs, seed=7):
    """Output, final state and the gradients of `inputs` of a random weighting of both."""
    out, state = function()
    generator = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=generator, dtype=out.dtype)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=generator, dtype=state.dtype)).sum()
    return [out, state, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
@pytest.mark.parametrize(("length", "chunk_size"), [(13, 4), (8, 8), (5, 16), (1, 3)], ids=lambda x: str(x))
def test_engine_matches_generic_chunked_path(name, length, chunk_size):
    """Outputs, final state and the gradients of q, k, v, the initial state and a map's weights, with
    chunks that do not divide the length and grouped queries."""
    spec = FEATURE_MAPS[name]
    kernel, weights = _kernel_and_weights(spec, 0.3)
    inputs = _inputs(spec, length)
    state_inputs = [*inputs, *weights]
    fast = _outputs_and_gradients(lambda: chunked_kernel_attention(*inputs, kernel, chunk_size), state_inputs)
    generic = _outputs_and_gradients(
        lambda: generic_chunked_linear_attention(*inputs, kernel, chunk_size), state_inputs
    )
    for got, want in zip(fast, generic, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
@pytest.mark.parametrize(
    ("length", "chunk_size", "strength"),
    [(13, 4, 1.0), (8, 8, 1.0), (5, 16, 1.0), (1, 3, 1.0), (12, 4, 60.0)],
    ids=["13-4", "8-8", "5-16", "1-3", "strong-decay"],
)
def test_engine_with_decay_matches_the_decayed_chunk_loop(name, length, chunk_size, strength):
    """The same with a decaying state, the log-decays' gradients included. With log-decays down to -60
    a chunk's total decay reaches e^-400: the backward replays the states forward (rewinding them would
    divide by the decay) and stays exact."""
    spec = FEATURE_MAPS[name]
    kernel, weights = _kernel_and_weights(spec, 0.3)
    inputs = _inputs(spec, length)
    log_decay = _log_decays(length, strength)
    leaves = [*inputs, log_decay, *weights]
    fast = _outputs_and_gradients(lambda: chunked_kernel_attention(*inputs, kernel, chunk_size, log_decay), leaves)
    q, k, v, state = inputs
    reference = _outputs_and_gradients(
        lambda: chunked_decayed_linear_attention(q, k, v, log_decay, state, kernel, chunk_size), leaves
    )
    for got, want in zip(fast, reference, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
def test_a_feature_map_keeps_only_the_inputs_for_the_backward(decay):
    """Maps computed before the call (hedgehog here) keep q, k, v, the map's weights, the initial state
    and the log-decays for the backward pass: no features and nothing per chunk, so memory stays flat in L
    (the backward rebuilds the features and the states)."""
    spec = FEATURE_MAPS["hedgehog"]
    length = 256
    kernel, weights = _kernel_and_weights(spec, 0.3)
    q, k, v, state = _inputs(spec, length, dtype=torch.float32)
    weights = [w.detach().float().requires_grad_() for w in weights]
    kernel = kernel.with_learned(*weights)
    log_decay = _log_decays(length, 1.0).float().detach().requires_grad_() if decay else None
    kept = [q, k, v, *weights, state, *([log_decay] if decay else [])]
    expected = sum(x.nbytes for x in kept)
    assert saved_bytes(lambda: chunked_kernel_attention(q, k, v, state, kernel, 16, log_decay)) == expected


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
    """Only Taylor kernels can rebuild their features chunk by chunk inside the engine (`hand_written`; it
    does for wide ones): the engine computes every other map's features for the whole call."""
    kernel = chunk_kernel(spec, 0.125)
    assert isinstance(kernel, expected)
    assert kernel.hand_written == (expected is TaylorKernel)


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


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
def test_float32_gradients_over_many_chunks(decay):
    """The backward rewinds the state chunk by chunk (S_{c-1} = S_c - phi(k_c)^T v_c) from a
    float64 copy, so over 256 chunks the float32 gradients of the first positions stay as close
    to float64 as the rest (rewinding in float32 gives 7e-7 there, growing with the length). A
    decayed state is replayed forward from a float64 copy instead, as close."""
    length, head_dim = 2048, 8
    spec = KERNEL_SPECS["taylor2"]
    inputs64 = _inputs(spec, length, head_dim=head_dim, groups=3, kv_heads=1, seed=3)
    if decay:
        inputs64 = [*inputs64, _log_decays(length, 0.02, kv_heads=1)]
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    weights = torch.randn(
        2, 1, 3, length, head_dim + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )

    def run(inputs):
        q, k, v, state, *log_decay = inputs
        out, _ = chunked_kernel_attention(q, k, v, state, TaylorKernel(2, head_dim**-0.5), 8, *log_decay)
        return [out, *torch.autograd.grad((out * weights.to(out.dtype)).sum(), inputs)]

    def relative(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    found, reference = run(inputs32), run(inputs64)
    for got, want in zip(found, reference, strict=True):
        assert relative(got, want) < 3e-6
    assert relative(found[1][..., :256, :], reference[1][..., :256, :]) < 4e-7


@pytest.mark.parametrize("name", ["taylor2", "elu"], ids=["chunk-by-chunk", "whole-call"])
@pytest.mark.parametrize("length", [8, 6], ids=["whole-chunks", "padded"])
def test_engine_takes_strided_inputs(name, length):
    """q, k, v as transposed views (as the layers hand them over), with and without padding, in both forms."""
    spec = KERNEL_SPECS[name]
    q, k, v, state = (x.detach() for x in _inputs(spec, length))
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
    assert not any(x.is_contiguous() for x in strided)
    kernel = chunk_kernel(spec, 0.3)
    for got, want in zip(
        chunked_kernel_attention(*strided, state, kernel, 4),
        chunked_kernel_attention(q, k, v, state, kernel, 4),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

"""The flash-linear-attention path of the chunked form, against the PyTorch chunked form.

On CPU, fla's `chunk_simple_gla` is replaced by its float64 PyTorch statement
(`chunk_simple_gla_reference`), which tests everything this package adds around it: the
features, the repeat over query heads, the augmented values, the state layout, the window
hybrids' older part and the gradients that reach learned feature maps. tests/gpu runs the same
comparison with fla's own kernel on CUDA.
"""

import pytest
import torch

from hf_softmax_rnn.ops import RecurrentState, attention, backends
from hf_softmax_rnn.ops.fla_linear import chunk_simple_gla_reference

from .helpers import FINITE_SPECS, as_params, gated, left_padding_mask, make_inputs, make_params

FLA_SPECS = sorted(
    name
    for name, spec in FINITE_SPECS.items()
    if spec.feature_dim(8) <= backends.FLA_MAX_FEATURES and spec.score_clamp is None
)
TOL = dict(rtol=1e-9, atol=1e-10)


@pytest.fixture
def reference_fla(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[0].shape, args[2].shape[-1]))  # (q features, value width)
        return chunk_simple_gla_reference(*args, **kwargs)

    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(backends, "FUSED_DTYPES", (*backends.FUSED_DTYPES, torch.float64))  # the float64 statement
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: counted)
    return calls


@pytest.mark.parametrize("name", FLA_SPECS)
def test_chunked_attention_through_fla_matches_pytorch(name, reference_fla):
    spec = FINITE_SPECS[name]
    q, k, v, gate_logits = make_inputs(length=13, requires_grad=True)
    params = make_params(spec, requires_grad=True)
    mask = left_padding_mask(2, 13, [0, 3])
    leaves = [q, k, v, *gate_logits.values(), *params.values()]
    weights = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)

    def run(fused: bool):
        gated_v, gates = gated(spec, v, gate_logits)
        with backends.fused_kernels(fused):
            first, state = attention(
                q[..., :7, :], k[..., :7, :], gated_v[..., :7, :], spec, mode="chunked",
                attention_mask=mask[:, :7], gates={n: g[..., :7] for n, g in gates.items()}, params=as_params(params),
            )  # fmt: skip
            second, state = attention(
                q[..., 7:, :], k[..., 7:, :], gated_v[..., 7:, :], spec, mode="chunked", attention_mask=mask,
                gates={n: g[..., 7:] for n, g in gates.items()}, params=as_params(params), state=state,
            )  # fmt: skip
        out = torch.cat([first, second], dim=-2)
        loss = (out * weights).sum() + 0.1 * state.S.sum() + 0.2 * state.z.sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return out, state, [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]

    fused_out, fused_state, fused_grads = run(True)
    assert len(reference_fla) == 2, "the fla path did not run"
    torch_out, torch_state, torch_grads = run(False)
    assert len(reference_fla) == 2, "fused_kernels(False) still ran the fla path"
    torch.testing.assert_close(fused_out, torch_out, **TOL)
    for got, want in zip(fused_state.tensors(), torch_state.tensors()):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(fused_grads, torch_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_fla_receives_one_head_per_query_head(reference_fla):
    spec = FINITE_SPECS["linear_elu"]
    q, k, v, _ = make_inputs(heads=6, kv_heads=2, length=5)
    state = RecurrentState.zeros(2, 2, spec.feature_dim(8), 8, 8)
    attention(q, k, v, spec, mode="chunked", state=state)
    assert reference_fla == [(torch.Size([2, 5, 6, 8]), 8)]  # time-major [B, L, H, F]


def test_fla_reads_the_values_without_the_denominator_column(reference_fla):
    """fla gets values of width Dv (64 in the real models, not 65 padded to 66): the denominator is
    a cumulative sum beside it. An odd Dv is padded to even and cut off again."""
    spec = FINITE_SPECS["linear_elu"]
    for value_dim, expected in [(8, 8), (7, 8)]:
        q, k, _, _ = make_inputs(heads=4, kv_heads=2, length=6)
        v = torch.randn(2, 2, 6, value_dim, dtype=q.dtype)
        with backends.fused_kernels(True):
            fused, fused_state = attention(q, k, v, spec, mode="chunked")
        with backends.fused_kernels(False):
            plain, plain_state = attention(q, k, v, spec, mode="chunked")
        assert reference_fla[-1][1] == expected
        torch.testing.assert_close(fused, plain, **TOL)
        for got, want in zip(fused_state.tensors(), plain_state.tensors()):
            torch.testing.assert_close(got, want, **TOL)

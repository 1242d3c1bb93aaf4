"""Finite-state attention (linear feature maps and Taylor-N exp) in chunked and recurrent form.

Both compute the augmented numerator N'_t = sum_{s<=t} k(q_t, k_s) [v_s, 1] = [N_t, G_t]:
the value carries a trailing column of ones so that the denominator G_t rides along with
the numerator and one state S' = [S, z] (`[B, Hkv, F, Dv + 1]`) holds both.
Padding is handled by the caller by zeroing the augmented values of padded positions.

Shapes: grouped q `[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v `[B, Hkv, L, Dv + 1]`,
state `[B, Hkv, F, Dv + 1]`.

- `chunked_linear_attention`: quadratic inside chunks of C positions, state carried between
  chunks. Kernels with a hand-written backward run the `ops.chunked` engine; the others
  (cosine, hedgehog) run `_ChunkedLinearAttention`, whose custom backward recomputes features
  chunk by chunk through autograd (two sweeps); under torch.compile every kernel takes the generic
  chunk loop, traced as plain autograd. Neither keeps an L x L matrix or the `[L, F]`
  features: memory is flat in L. The generic path is also the engine's reference in tests.
- On CUDA tensors with fla-core installed, `chunked_linear_attention` hands feature maps of at
  most 256 features to flash-linear-attention's kernel (`ops.fla_linear`, `ops.backends`).
- `recurrent_linear_attention`: one position at a time; the slow, obviously-correct form
  that decoding uses (L = 1) and the tests compare against.

Both take optional per-position log-decays `[B, Hkv, L]` (a data-dependent forget gate, see
`ops.decay`): the state is multiplied by their exp before each position's key enters. The chunked
form then runs fla's gated kernel on a GPU and `ops.decay` elsewhere.
"""

from __future__ import annotations

import torch

from hf_softmax_rnn.ops.backends import fla_linear_function
from hf_softmax_rnn.ops.chunked import chunked_kernel_attention
from hf_softmax_rnn.ops.decay import chunked_decayed_linear_attention
from hf_softmax_rnn.ops.fla_linear import fla_chunked_linear_attention
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import FeatureKernel


def _chunk_slices(length: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _chunk_terms(kernel: FeatureKernel, qc, kc, vc) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features and intra-chunk output of one chunk: (phi(q) `[B, Hkv, G, C, F]`, phi(k)
    `[B, Hkv, C, F]`, intra `[B, Hkv, G, C, Dv']`)."""
    size = kc.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=kc.device).tril()
    intra = grouped_matmul(kernel.scores(qc, kc).masked_fill(~causal, 0.0), vc)
    return kernel.query_features(qc), kernel.key_features(kc), intra


def _chunked_forward(q, k, v, state, kernel: FeatureKernel, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop: (augmented numerator, state after the last chunk)."""
    outputs, running = [], state
    for sl in _chunk_slices(q.shape[-2], chunk_size):
        phi_q, phi_k, intra = _chunk_terms(kernel, q[..., sl, :], k[..., sl, :], v[..., sl, :])
        outputs.append(intra + grouped_matmul(phi_q, running))
        running = running + phi_k.mT @ v[..., sl, :]
    if not outputs:
        return q.new_empty(*q.shape[:-1], v.shape[-1]), running
    return torch.cat(outputs, dim=-2), running


class _ChunkedLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, kernel, chunk_size, *learned):
        out, running = _chunked_forward(q, k, v, state, kernel, chunk_size)
        ctx.save_for_backward(q, k, v, state, *learned)
        ctx.kernel, ctx.chunk_size = kernel, chunk_size
        return out, running

    @staticmethod
    def backward(ctx, d_out, d_final_state):
        q, k, v, state, *learned = ctx.saved_tensors
        slices = _chunk_slices(q.shape[-2], ctx.chunk_size)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_learned = [torch.zeros_like(tensor) for tensor in learned]
        kernel = ctx.kernel.with_learned(*learned)

        def leaves(*tensors):
            return [t.detach().requires_grad_() for t in tensors]

        def accumulate(grads, targets):
            for grad, target in zip(grads, targets):
                if grad is not None:
                    target += grad

        # Sweep 1, forward order: the inter-chunk term phi(q_c) S_{c-1} needs the state before c.
        # d phi(q_c) = d_out_c S_{c-1}^T by hand; autograd only runs through the feature map.
        running = state.detach()
        for sl in slices:
            qc, kc, vc = q[..., sl, :], k[..., sl, :], v[..., sl, :]
            d_phi_q = grouped_matmul(d_out[..., sl, :], running.mT)
            with torch.enable_grad():
                qc_leaf, *learned_leaves = leaves(qc, *learned)
                phi_q = kernel.with_learned(*learned_leaves).query_features(qc_leaf)
                grads = torch.autograd.grad(phi_q, [qc_leaf, *learned_leaves], d_phi_q, allow_unused=True)
            accumulate(grads, [dq[..., sl, :], *d_learned])
            running = running + kernel.key_features(kc).mT @ vc

        # Sweep 2, reverse order: dS carries d(loss)/d(state after chunk c). The state update
        # phi(k_c)^T v_c gives d phi(k_c) = v_c dS^T and d v_c = phi(k_c) dS, by hand.
        d_state = d_final_state.clone()
        for sl in reversed(slices):
            qc, kc, vc, doc = q[..., sl, :], k[..., sl, :], v[..., sl, :], d_out[..., sl, :]
            with torch.enable_grad():
                qc_leaf, kc_leaf, vc_leaf, *learned_leaves = leaves(qc, kc, vc, *learned)
                phi_q, phi_k, intra = _chunk_terms(kernel.with_learned(*learned_leaves), qc_leaf, kc_leaf, vc_leaf)
                d_phi_k = vc @ d_state.mT
                inputs = [qc_leaf, kc_leaf, vc_leaf, *learned_leaves]
                grads = torch.autograd.grad([intra, phi_k], inputs, [doc, d_phi_k], allow_unused=True)
            accumulate(grads, [dq[..., sl, :], dk[..., sl, :], dv[..., sl, :], *d_learned])
            dv[..., sl, :] += phi_k.detach() @ d_state
            d_state = d_state + torch.einsum("bhgcf,bhgcd->bhfd", phi_q.detach(), doc)

        return dq, dk, dv, d_state, None, None, *d_learned


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    chunk_size: int,
    io_dtype: torch.dtype | None = None,
    log_decay: torch.Tensor | None = None,
    empty_state: bool = False,
    final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last position.
    `io_dtype`: the dtype a fused GPU kernel reads the features in (default q's); `log_decay`
    `[B, Hkv, L]`: the decay of the state at each position (None = no decay); `empty_state`: `state`
    is zero, which the fused kernel then need not read; `final_state=False`: the caller discards the
    state after the call (training), which the fused kernel then neither writes nor returns (None)."""
    io_dtype = io_dtype or q.dtype
    chunk_function = fla_linear_function(q.device.type, io_dtype, state.shape[-2], kernel.clamp)
    if chunk_function is not None:
        return fla_chunked_linear_attention(
            q, k, v, state, kernel, io_dtype, chunk_function, log_decay, empty_state, final_state
        )
    if log_decay is not None:
        return chunked_decayed_linear_attention(q, k, v, log_decay, state, kernel, chunk_size)
    if kernel.hand_written and not torch.compiler.is_compiling():  # its preallocated out= buffers do not trace
        return chunked_kernel_attention(q, k, v, state, kernel, chunk_size)
    return generic_chunked_linear_attention(q, k, v, state, kernel, chunk_size)


def generic_chunked_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, kernel: FeatureKernel, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The autograd path for any kernel (the reference of the hand-written engine). Under
    torch.compile the chunk loop is traced as it is (autograd keeps each chunk's features, which
    the custom backward would recompute): Dynamo cannot trace a Python loop inside an
    autograd.Function whose chunk count it has lifted to a symbol."""
    if torch.compiler.is_compiling():
        return _chunked_forward(q, k, v, state, kernel, chunk_size)
    return _ChunkedLinearAttention.apply(q, k, v, state, kernel, chunk_size, *kernel.learned)


def recurrent_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    in_place: bool = False,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S'_t = a_t S'_{t-1} + phi(k_t) v'_t^T, out_t = phi(q_t) S'_t, one position at a time, with
    a_t = exp(`log_decay` `[B, Hkv, L]`) or 1 without it.
    `in_place`: update `state` itself (decoding without autograd: one read and one write of the
    state per step instead of a new tensor that a cache then copies back)."""
    phi_q = kernel.query_features(q)
    phi_k = kernel.key_features(k)
    outputs = []
    for t in range(q.shape[-2]):
        if log_decay is not None:
            factor = log_decay[..., t, None, None].exp()
            state = state.mul_(factor) if in_place else state * factor
        state = _add_outer_product(state, phi_k[..., t, :], v[..., t, :], in_place)
        outputs.append(grouped_matmul(phi_q[..., t : t + 1, :], state))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)), state  # (decoding: no copy)


def _add_outer_product(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, in_place: bool) -> torch.Tensor:
    """state `[B, Hkv, F, Dv']` + key `[B, Hkv, F]` value^T `[B, Hkv, Dv']` as one batched product-and-add,
    which writes the state once (a product, then an addition, would write it twice)."""
    rows, columns = key.reshape(-1, key.shape[-1], 1), value.reshape(-1, 1, value.shape[-1])
    if in_place and state.is_contiguous():
        state.view(-1, *state.shape[-2:]).baddbmm_(rows, columns)
        return state
    if in_place:
        return state.add_(key[..., :, None] * value[..., None, :])
    return torch.baddbmm(state.reshape(-1, *state.shape[-2:]), rows, columns).view(state.shape)

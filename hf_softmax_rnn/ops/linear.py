"""Finite-state attention (linear feature maps and Taylor-N exp) in chunked and recurrent form.

Both compute the augmented numerator N'_t = sum_{s<=t} k(q_t, k_s) [v_s, 1] = [N_t, G_t]:
the value carries a trailing column of ones so that the denominator G_t rides along with
the numerator and one state S' = [S, z] (`[B, Hkv, F, Dv + 1]`) holds both.
Padding is handled by the caller by zeroing the augmented values of padded positions.

Shapes: grouped q `[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v `[B, Hkv, L, Dv + 1]`,
state `[B, Hkv, F, Dv + 1]` with F = `spec.feature_dim(D)`.

- `chunked_linear_attention`: quadratic inside chunks of C positions, state carried between
  chunks; a custom backward recomputes features chunk by chunk (two sweeps), so neither
  pass keeps an L x L matrix or the `[L, F]` features: memory is flat in L. Any feature
  map; the Taylor and elementwise maps run the hand-written `ops.chunked` engine instead,
  which this is the reference of.
- `recurrent_linear_attention`: one position at a time; the slow, obviously-correct form
  that decoding uses (L = 1) and the tests compare against.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.feature_maps import key_features, kernel_scores, query_features

_PARAM_NAMES = ("hedgehog_q", "hedgehog_k")


def _chunk_slices(length: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _causal_chunk_product(scores: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """(scores masked to s <= t) @ v for one chunk: `[B, Hkv, G, C, C] x [B, Hkv, C, Dv'] -> [B, Hkv, G, C, Dv']`."""
    size = scores.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=scores.device).tril()
    return grouped_matmul(scores.masked_fill(~causal, 0.0), vc)


def _chunk_terms(qc, kc, vc, spec, scale, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features and intra-chunk output of one chunk: (phi(q) `[B, Hkv, G, C, F]`, phi(k)
    `[B, Hkv, C, F]`, intra `[B, Hkv, G, C, Dv']`). Taylor kernels score pairs with the
    polynomial of q.k (D work per pair) instead of the F-wide features."""
    phi_q = query_features(qc, spec, scale, params)
    phi_k = key_features(kc, spec, scale, params)
    if spec.effective_feature_map == "taylor":
        scores = kernel_scores(qc, kc, spec, scale, params)
    else:
        scores = grouped_matmul(phi_q, phi_k.transpose(-1, -2))
    return phi_q, phi_k, _causal_chunk_product(scores, vc)


class _ChunkedLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, hedgehog_q, hedgehog_k, spec, scale, chunk_size):
        params = {name: p for name, p in zip(_PARAM_NAMES, (hedgehog_q, hedgehog_k)) if p is not None}
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        running = state
        for sl in _chunk_slices(q.shape[-2], chunk_size):
            phi_q, phi_k, intra = _chunk_terms(q[..., sl, :], k[..., sl, :], v[..., sl, :], spec, scale, params)
            out[..., sl, :] = intra + grouped_matmul(phi_q, running)
            running = running + phi_k.transpose(-1, -2) @ v[..., sl, :]
        ctx.save_for_backward(q, k, v, state, hedgehog_q, hedgehog_k)
        ctx.spec, ctx.scale, ctx.chunk_size = spec, scale, chunk_size
        return out, running

    @staticmethod
    def backward(ctx, d_out, d_final_state):
        q, k, v, state, hedgehog_q, hedgehog_k = ctx.saved_tensors
        spec, scale = ctx.spec, ctx.scale
        slices = _chunk_slices(q.shape[-2], ctx.chunk_size)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        raw_params = dict(zip(_PARAM_NAMES, (hedgehog_q, hedgehog_k)))
        d_params = {name: torch.zeros_like(p) for name, p in raw_params.items() if p is not None}

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
            d_phi_q = grouped_matmul(d_out[..., sl, :], running.transpose(-1, -2))
            with torch.enable_grad():
                (qc_leaf,) = leaves(qc)
                p_leaves = {name: leaves(p)[0] for name, p in raw_params.items() if p is not None}
                phi_q = query_features(qc_leaf, spec, scale, p_leaves)
                inputs = [qc_leaf, *p_leaves.values()]
                grads = torch.autograd.grad(phi_q, inputs, d_phi_q, allow_unused=True)
            accumulate(grads[:1], [dq[..., sl, :]])
            accumulate(grads[1:], list(d_params.values()))
            running = running + key_features(kc, spec, scale, raw_params).transpose(-1, -2) @ vc

        # Sweep 2, reverse order: dS carries d(loss)/d(state after chunk c). The state update
        # phi(k_c)^T v_c gives d phi(k_c) = v_c dS^T and d v_c = phi(k_c) dS, by hand.
        d_state = d_final_state.clone()
        for sl in reversed(slices):
            qc, kc, vc, doc = q[..., sl, :], k[..., sl, :], v[..., sl, :], d_out[..., sl, :]
            with torch.enable_grad():
                qc_leaf, kc_leaf, vc_leaf = leaves(qc, kc, vc)
                p_leaves = {name: leaves(p)[0] for name, p in raw_params.items() if p is not None}
                phi_q, phi_k, intra = _chunk_terms(qc_leaf, kc_leaf, vc_leaf, spec, scale, p_leaves)
                d_phi_k = vc @ d_state.transpose(-1, -2)
                inputs = [qc_leaf, kc_leaf, vc_leaf, *p_leaves.values()]
                grads = torch.autograd.grad([intra, phi_k], inputs, [doc, d_phi_k], allow_unused=True)
            accumulate(grads[:3], [dq[..., sl, :], dk[..., sl, :], dv[..., sl, :]])
            accumulate(grads[3:], list(d_params.values()))
            dv[..., sl, :] += phi_k.detach() @ d_state
            d_state = d_state + torch.einsum("bhgcf,bhgcd->bhfd", phi_q.detach(), doc)

        d_hedgehog = [d_params.get(name) for name in _PARAM_NAMES]
        return dq, dk, dv, d_state, *d_hedgehog, None, None, None


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    spec: AttentionSpec,
    scale: float,
    params: Mapping[str, torch.Tensor],
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last position."""
    return _ChunkedLinearAttention.apply(
        q, k, v, state, params.get("hedgehog_q"), params.get("hedgehog_k"), spec, scale, chunk_size
    )


def recurrent_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    spec: AttentionSpec,
    scale: float,
    params: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """S'_t = S'_{t-1} + phi(k_t) v'_t^T, out_t = phi(q_t) S'_t, one position at a time."""
    phi_q = query_features(q, spec, scale, params)
    phi_k = key_features(k, spec, scale, params)
    outputs = []
    for t in range(q.shape[-2]):
        state = state + phi_k[..., t, :, None] @ v[..., t, None, :]
        outputs.append(phi_q[..., t, :] @ state)
    return torch.stack(outputs, dim=-2), state

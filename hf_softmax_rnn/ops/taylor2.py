"""Chunked Taylor order-2 attention without query or key features.

The order-2 state lives in the symmetric monomial basis like every Taylor state (rows
1 + D + p of `[B, Hkv, F, Dv']`, p over pairs i <= j in colex order, feature
c_p x_i x_j with c_p = 1, or 1/sqrt(2) on the diagonal). Per chunk it is unpacked into a
symmetric `[D, D, Dv']` array A with sum_p c_p q_i q_j S_p = sum_ij q_i q_j A_ij, so that

    inter-chunk output = S_0 + q S_1 + sum_j q_j (q A)_j          (matmuls with K = D)
    state update       = [sum v', k^T v', fold(k^T (k (x) v'))]

and neither pass builds the `[C, F]` features (F = 2,145 for D = 64). The backward is
written out by hand in the same two sweeps as `linear._ChunkedLinearAttention`; the
intra-chunk part goes through autograd. Shapes as in `linear.py`; q and k arrive
unscaled, the kernel scale enters as sqrt(scale) on both sides.
"""

from __future__ import annotations

import functools
import math

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.feature_maps import kernel_scores
from hf_softmax_rnn.ops.grouping import grouped_matmul


@functools.lru_cache(maxsize=8)
def _pair_layout(head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair -> flat index i*D + j `[P]`, weights c_p `[P]`, flat index -> pair `[D*D]`,
    unpacking weights `[D*D]`: 1/2 off the diagonal, 1/sqrt(2) on it)."""
    pairs = [(i, j) for j in range(head_dim) for i in range(j + 1)]
    to_flat = torch.tensor([i * head_dim + j for i, j in pairs])
    weight = torch.tensor([1.0 if i < j else 1 / math.sqrt(2) for i, j in pairs], dtype=torch.float64)
    position = {pair: p for p, pair in enumerate(pairs)}
    from_flat = torch.tensor([position[min(a, b), max(a, b)] for a in range(head_dim) for b in range(head_dim)])
    unpack_weight = torch.tensor(
        [0.5 if a != b else 1 / math.sqrt(2) for a in range(head_dim) for b in range(head_dim)], dtype=torch.float64
    )
    return to_flat, weight, from_flat, unpack_weight


class _Layout:
    """The pair layout on a device and dtype, with unpack/fold between `[..., P, Dv']` and `[..., D, D*Dv']`."""

    def __init__(self, head_dim: int, like: torch.Tensor) -> None:
        to_flat, weight, from_flat, unpack_weight = _pair_layout(head_dim)
        self.d = head_dim
        self.to_flat, self.from_flat = to_flat.to(like.device), from_flat.to(like.device)
        self.weight = weight.to(device=like.device, dtype=like.dtype)[:, None]
        self.unpack_weight = unpack_weight.to(device=like.device, dtype=like.dtype)[:, None]

    def unpack(self, pairs: torch.Tensor) -> torch.Tensor:
        """`[..., P, Dv'] -> [..., D, D * Dv']`: the symmetric A with sum_ij x_i x_j A_ij = phi_2(x).S."""
        full = pairs.index_select(-2, self.from_flat) * self.unpack_weight
        return full.reshape(*pairs.shape[:-2], self.d, self.d * pairs.shape[-1])

    def fold(self, full: torch.Tensor) -> torch.Tensor:
        """`[..., D, D * Dv']` symmetric sum_t x_t (x) x_t (x) w_t -> its pair rows c_p (...)_ij `[..., P, Dv']`."""
        flat = full.reshape(*full.shape[:-2], self.d * self.d, -1)
        return flat.index_select(-2, self.to_flat) * self.weight


def _quadratic(x: torch.Tensor, a_full: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """T = x A `[..., C, D, Dv']` and sum_j x_j T_j `[..., C, Dv']` for x `[..., C, D]`."""
    product = grouped_matmul(x, a_full) if grouped else x @ a_full
    t = product.unflatten(-1, (x.shape[-1], -1))
    return t, (t * x.unsqueeze(-1)).sum(-2)


def _outer_sum(x: torch.Tensor, w: torch.Tensor, grouped: bool) -> torch.Tensor:
    """sum_t x_t (x) x_t (x) w_t `[..., D, D * Dv']` for x `[..., C, D]`, w `[..., C, Dv']` (summed over
    the query groups too when `grouped`)."""
    xw = (x.unsqueeze(-1) * w.unsqueeze(-2)).flatten(-2)
    if grouped:
        batch, kv_heads, groups, rows, d = x.shape
        return x.reshape(batch, kv_heads, groups * rows, d).transpose(-1, -2) @ xw.reshape(batch, kv_heads, groups * rows, -1)
    return x.transpose(-1, -2) @ xw


def _split(state: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return state[..., :1, :], state[..., 1 : 1 + d, :], state[..., 1 + d :, :]


def _inter(qs: torch.Tensor, state: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """phi_2(q) S for grouped scaled queries: (output `[B, Hkv, G, C, Dv']`, T for the backward)."""
    s0, s1, s2 = _split(state, layout.d)
    t, quadratic = _quadratic(qs, layout.unpack(s2), grouped=True)
    return s0.unsqueeze(2) + grouped_matmul(qs, s1) + quadratic, t


def _update(ks: torch.Tensor, v: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """phi_2(k)^T v' for scaled keys `[B, Hkv, C, D]`, v' `[B, Hkv, C, Dv']` -> `[B, Hkv, F, Dv']`."""
    order2 = layout.fold(_outer_sum(ks, v, grouped=False))
    return torch.cat([v.sum(-2, keepdim=True), ks.transpose(-1, -2) @ v, order2], dim=-2)


def _slices(length: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, scale: float) -> torch.Tensor:
    scores = kernel_scores(q, k, spec, scale, {})
    causal = torch.ones(scores.shape[-1], scores.shape[-1], dtype=torch.bool, device=scores.device).tril()
    return grouped_matmul(scores.masked_fill(~causal, 0.0), v)


class ChunkedTaylor2Attention(torch.autograd.Function):
    """Augmented numerator `[B, Hkv, G, L, Dv']` and final state of Taylor order 2, chunk by chunk."""

    @staticmethod
    def forward(ctx, q, k, v, state, spec, scale, chunk_size):
        root = math.sqrt(scale)
        layout = _Layout(q.shape[-1], q)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        running = state
        for sl in _slices(q.shape[-2], chunk_size):
            qc, kc, vc = q[..., sl, :], k[..., sl, :], v[..., sl, :]
            inter, _ = _inter(root * qc, running, layout)
            out[..., sl, :] = _intra(qc, kc, vc, spec, scale) + inter
            running = running + _update(root * kc, vc, layout)
        ctx.save_for_backward(q, k, v, state)
        ctx.spec, ctx.scale, ctx.chunk_size = spec, scale, chunk_size
        return out, running

    @staticmethod
    def backward(ctx, d_out, d_final_state):
        q, k, v, state = ctx.saved_tensors
        spec, scale = ctx.spec, ctx.scale
        root = math.sqrt(scale)
        layout = _Layout(q.shape[-1], q)
        d = layout.d
        slices = _slices(q.shape[-2], ctx.chunk_size)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        # Sweep 1, forward order: the inter-chunk term needs the state before each chunk.
        running = state
        for sl in slices:
            qs, doc = root * q[..., sl, :], d_out[..., sl, :]
            _, t = _inter(qs, running, layout)
            s1 = _split(running, d)[1]
            d_qs = grouped_matmul(doc, s1.transpose(-1, -2)) + 2 * (t * doc.unsqueeze(-2)).sum(-1)
            dq[..., sl, :] += root * d_qs
            running = running + _update(root * k[..., sl, :], v[..., sl, :], layout)

        # Sweep 2, reverse order: d_state is d(loss)/d(state after the chunk).
        d_state = d_final_state.clone()
        for sl in reversed(slices):
            qc, kc, vc, doc = q[..., sl, :], k[..., sl, :], v[..., sl, :], d_out[..., sl, :]
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (qc, kc, vc)]
                intra = _intra(*leaves, spec, scale)
                grads = torch.autograd.grad(intra, leaves, doc)
            dq[..., sl, :] += grads[0]
            dk[..., sl, :] += grads[1]
            dv[..., sl, :] += grads[2]
            # The state update: S_0 += sum v', S_1 += k^T v', S_2 += fold(k^T (k (x) v')).
            ks = root * kc
            ds0, ds1, ds2 = _split(d_state, d)
            tb, quadratic = _quadratic(ks, layout.unpack(ds2), grouped=False)
            dv[..., sl, :] += ds0 + ks @ ds1 + quadratic
            dk[..., sl, :] += root * (vc @ ds1.transpose(-1, -2) + 2 * (tb * vc.unsqueeze(-2)).sum(-1))
            # The inter-chunk term's use of the state before the chunk.
            qs = root * qc
            d_inter = torch.cat(
                [
                    doc.sum((2, 3)).unsqueeze(-2),
                    (qs.transpose(-1, -2) @ doc).sum(2),
                    layout.fold(_outer_sum(qs, doc, grouped=True)),
                ],
                dim=-2,
            )
            d_state = d_state + d_inter
        return dq, dk, dv, d_state, None, None, None

"""Chunked finite-state attention with both passes written by hand, for kernels whose features
are cheap to rebuild (Taylor-N, and the elementwise maps identity / elu / relu).

The generic `ops.linear.chunked_linear_attention` (autograd through the feature map, any map)
is its reference. What makes this one fast on a CPU, where the per-chunk tensors rather than
the matmuls set the pace:
- features are feature-major, `[Bt, F, T]`, so every state product is a plain batched matmul
  and no gradient needs a transpose;
- the backward is one reverse sweep that rewinds the state, S_{c-1} = S_c - phi(k_c)^T v_c,
  instead of a second sweep that recomputes it. The forward accumulates the state in
  float64 (a constant-size copy) and the backward subtracts the same increments, so the
  rewound states are as exact as the forward's;
- every per-chunk tensor lives in a `Scratch` buffer reused for all chunks (a fresh
  multi-MB tensor costs its page faults on every chunk).

Shapes as in `ops.linear`: grouped q `[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v
`[B, Hkv, L, Dv + 1]`, state `[B, Hkv, F, Dv + 1]`; inside, Bt = B * Hkv and T = G * C.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Scratch:
    """Named buffers reused across the chunks of one call (same shapes every chunk)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != torch.Size(shape) or buffer.dtype != like.dtype:
            buffer = self._buffers[name] = like.new_empty(shape)
        return buffer

    def get(self, name: str) -> torch.Tensor:
        """A buffer an earlier step filled."""
        return self._buffers[name]


class ChunkKernel(Protocol):
    """A kernel k(q, s) = phi(q).phi(s) as the chunked engine needs it."""

    def chunk_features(self, x: torch.Tensor, scratch: Scratch, query: bool) -> torch.Tensor:
        """phi of one chunk, x `[Bt, T, D]` -> `[Bt, F, T]` (a `scratch` buffer)."""

    def chunk_features_backward(self, grad: torch.Tensor, scratch: Scratch, query: bool) -> torch.Tensor:
        """d x `[Bt, T, D]` from d phi `[Bt, F, T]`, for the last `chunk_features` call on `scratch`."""

    def chunk_scores(
        self, q: torch.Tensor, k: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor, scratch: Scratch
    ) -> torch.Tensor:
        """k(q_t, k_s) within a chunk `[Bt, T, C]` (unmasked; the caller may overwrite it)."""

    def chunk_scores_backward(
        self,
        d_scores: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        phi_q: torch.Tensor,
        phi_k: torch.Tensor,
        scratch: Scratch,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(d q, d k, d phi(q), d phi(k)) from d scores, after the last `chunk_scores` call; None where
        the kernel sends nothing (it reaches q and k either directly or through the features)."""


class _Chunks:
    """q, k, v of one call laid out chunk-first and zero-padded to whole chunks:
    q `[n, Bt, G*C, D]`, k `[n, Bt, C, D]`, v `[n, Bt, C, Dv']`."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> None:
        self.chunk_size, self.groups, self.length = chunk_size, q.shape[2], q.shape[-2]
        self.chunks = -(-self.length // chunk_size)
        self.q = self.chunk_first(q)
        self.k = self.chunk_first(k.unsqueeze(2))
        self.v = self.chunk_first(v.unsqueeze(2))
        self.causal = torch.ones(chunk_size, chunk_size, dtype=q.dtype, device=q.device).tril()

    def chunk_first(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, Hkv, G, L, E]` -> `[n, B * Hkv, G * C, E]` (zero-padded to n * C positions)."""
        batch, kv_heads, groups, length, width = x.shape
        x = torch.nn.functional.pad(x, (0, 0, 0, self.chunks * self.chunk_size - length))
        x = x.reshape(batch * kv_heads, groups, self.chunks, self.chunk_size, width).permute(2, 0, 1, 3, 4)
        return x.reshape(self.chunks, batch * kv_heads, groups * self.chunk_size, width)

    def restore(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of `chunk_first`: `[n, Bt, G * C, E]` -> `shape` (`[B, Hkv, (G,) L, E]`)."""
        groups = x.shape[2] // self.chunk_size
        x = x.view(self.chunks, x.shape[1], groups, self.chunk_size, x.shape[-1]).permute(1, 2, 0, 3, 4)
        return x.reshape(x.shape[0], groups, self.chunks * self.chunk_size, x.shape[-1])[:, :, : self.length].reshape(
            shape
        )

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """Zero the pairs s > t of a `[Bt, G*C, C]` tensor, in place."""
        x.view(x.shape[0], self.groups, self.chunk_size, self.chunk_size).mul_(self.causal)
        return x


class _ChunkedKernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, kernel, chunk_size):
        chunks = _Chunks(q, k, v, chunk_size)
        query_scratch, key_scratch, scratch = Scratch(), Scratch(), Scratch()
        bt, feature_dim, width = chunks.q.shape[1], state.shape[-2], state.shape[-1]
        exact = state.reshape(bt, feature_dim, width).to(torch.float64, copy=True)
        running = exact if state.dtype == torch.float64 else exact.to(state.dtype)
        out = q.new_empty(chunks.chunks, bt, chunks.q.shape[2], width)
        for c in range(chunks.chunks):
            phi_q = kernel.chunk_features(chunks.q[c], query_scratch, query=True)
            phi_k = kernel.chunk_features(chunks.k[c], key_scratch, query=False)
            intra = chunks.masked(kernel.chunk_scores(chunks.q[c], chunks.k[c], phi_q, phi_k, scratch))
            torch.bmm(phi_q.mT, running, out=out[c]).baddbmm_(intra, chunks.v[c])
            exact += torch.bmm(phi_k, chunks.v[c], out=scratch("increment", (bt, feature_dim, width), q))
            if running is not exact:
                running.copy_(exact)
        ctx.save_for_backward(q, k, v, exact)
        ctx.kernel, ctx.chunk_size, ctx.state_shape = kernel, chunk_size, state.shape
        return chunks.restore(out, (*q.shape[:-1], width)), exact.to(state.dtype, copy=True).view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_final_state):
        q, k, v, final = ctx.saved_tensors
        kernel = ctx.kernel
        chunks = _Chunks(q, k, v, ctx.chunk_size)
        query_scratch, key_scratch, scratch = Scratch(), Scratch(), Scratch()
        n, bt, rows, _ = chunks.q.shape
        feature_dim, width = final.shape[-2:]
        exact = final.clone()
        running = exact if q.dtype == torch.float64 else exact.to(q.dtype)
        d_out = chunks.chunk_first(d_out)
        dq, dk, dv = torch.zeros_like(chunks.q), torch.zeros_like(chunks.k), torch.zeros_like(chunks.v)
        d_state = d_final_state.reshape(bt, feature_dim, width).clone()
        for c in reversed(range(n)):
            qc, kc, vc, doc = chunks.q[c], chunks.k[c], chunks.v[c], d_out[c]
            phi_k = kernel.chunk_features(kc, key_scratch, query=False)
            phi_q = kernel.chunk_features(qc, query_scratch, query=True)
            # Rewind S_c = S_{c-1} + phi(k_c)^T v_c to the state chunk c read.
            exact -= torch.bmm(phi_k, vc, out=scratch("increment", (bt, feature_dim, width), q))
            if running is not exact:
                running.copy_(exact)

            # Inside the chunk: out_c += (k(q_t, k_s) masked) v_s.
            d_intra = chunks.masked(torch.bmm(doc, vc.mT, out=scratch("d_intra", (bt, rows, ctx.chunk_size), q)))
            dv[c].baddbmm_(chunks.masked(kernel.chunk_scores(qc, kc, phi_q, phi_k, scratch)).mT, doc)
            dq_intra, dk_intra, d_phi_q_intra, d_phi_k_intra = kernel.chunk_scores_backward(
                d_intra, qc, kc, phi_q, phi_k, scratch
            )

            # Across chunks: out_c += phi(q_c) S_{c-1}, and S_c = S_{c-1} + phi(k_c)^T v_c
            # (d_state holds dL/dS_c until phi(q_c) adds its share for S_{c-1}).
            d_phi_k = torch.bmm(d_state, vc.mT, out=scratch("d_phi_k", (bt, feature_dim, ctx.chunk_size), q))
            d_phi_q = torch.bmm(running, doc.mT, out=scratch("d_phi_q", (bt, feature_dim, rows), q))
            dv[c].baddbmm_(phi_k.mT, d_state)
            d_state.baddbmm_(phi_q, doc)
            for found, total in (
                (d_phi_k_intra, d_phi_k),
                (d_phi_q_intra, d_phi_q),
                (dq_intra, dq[c]),
                (dk_intra, dk[c]),
            ):
                if found is not None:
                    total += found
            dk[c] += kernel.chunk_features_backward(d_phi_k, key_scratch, query=False)
            dq[c] += kernel.chunk_features_backward(d_phi_q, query_scratch, query=True)
        dq, dk, dv = chunks.restore(dq, q.shape), chunks.restore(dk, k.shape), chunks.restore(dv, v.shape)
        return dq, dk, dv, d_state.view(ctx.state_shape), None, None


def chunked_kernel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, kernel: ChunkKernel, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last position.
    Memory is flat in L apart from O(L D) copies of the inputs and their gradients. A call
    shorter than `chunk_size` runs as one chunk of its own length (no padding)."""
    return _ChunkedKernelAttention.apply(q, k, v, state, kernel, max(1, min(chunk_size, q.shape[-2])))

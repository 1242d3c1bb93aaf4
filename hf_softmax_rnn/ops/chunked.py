"""Chunked finite-state attention with both passes written by hand, for every feature map, with
or without a decaying state.

The generic `ops.linear.generic_chunked_linear_attention` (autograd through a chunk loop) and
`ops.decay.chunked_decayed_linear_attention` are its references. Two forms:

- Maps that cannot rebuild their features chunk by chunk (the elementwise maps, cosine, hedgehog)
  and Taylor kernels at most `WHOLE_CALL_FEATURES` times the head dimension wide (orders 0 and 1)
  are computed for the whole call in one product, and every chunk's products run in one batched
  product (`_feature_forward`, `_feature_backward`); only the states, one addition a chunk, run in
  order. The backward rebuilds the features and the states, so what a call keeps for its backward
  pass stays q, k and v; each pass holds O(L F) for its duration.
- Wider features (Taylor-2 and up: 2,145 a head for D = 64, too wide to hold for a whole call) are
  rebuilt chunk by chunk in both passes by their kernel's `chunk_*` methods (`hand_written = True`;
  `_forward`, `_backward`).

What makes the chunk-by-chunk form fast on a CPU, where the per-chunk tensors rather than the
matmuls set the pace:
- features are feature-major, `[Bt, F, T]`, so every state product is a plain batched matmul
  and no gradient needs a transpose;
- without decay, the backward is one reverse sweep that rewinds the state,
  S_{c-1} = S_c - phi(k_c)^T v_c, instead of a second sweep that recomputes it. The forward
  accumulates the state in float64 (a constant-size copy) and the backward subtracts the same
  increments, so the rewound states are as exact as the forward's. A decayed state cannot be
  rewound (it would divide by the decay), so the backward first replays the state updates and
  keeps the state before each chunk (n states of one call, for the backward of that call only);
- every per-chunk tensor lives in a `Scratch` buffer reused for all chunks (a fresh
  multi-MB tensor costs its page faults on every chunk).

With per-position log-decays g (`ops.decay`) and b_t their cumulative sum inside a chunk, chunk c
computes out_t = e^{b_t} phi(q_t) S_{c-1} + sum_{s<=t} e^{b_t - b_s} k(q_t, k_s) v_s and
S_c = e^{b_C} S_{c-1} + sum_s e^{b_C - b_s} phi(k_s)^T v_s: every factor is at most 1.

Shapes as in `ops.linear`: grouped q `[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v
`[B, Hkv, L, Dv + 1]`, state `[B, Hkv, F, Dv + 1]`, log-decays `[B, Hkv, L]`; inside, Bt = B * Hkv
and T = G * C.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hf_softmax_rnn.ops.kernels import FeatureKernel

#: Taylor kernels at most this many times the head dimension wide (orders 0 and 1) run every chunk
#: batched, as every other map does (their features for a whole call cost about what q does); wider
#: ones rebuild their features chunk by chunk.
WHOLE_CALL_FEATURES = 2


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
    """q, k, v (and log-decays) of one call laid out chunk-first and zero-padded to whole chunks:
    q `[n, Bt, G*C, D]`, k `[n, Bt, C, D]`, v `[n, Bt, C, Dv']`, and the log-decays' cumulative sums
    inside each chunk `[n, Bt, C]` (None without decay)."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int, log_decay: torch.Tensor | None
    ) -> None:
        self.chunk_size, self.groups, self.length = chunk_size, q.shape[2], q.shape[-2]
        self.chunks = -(-self.length // chunk_size)
        self.q = self.chunk_first(q)
        self.k = self.chunk_first(k.unsqueeze(2))
        self.v = self.chunk_first(v.unsqueeze(2))
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
        self.causal, self.hidden = causal.to(q.dtype), ~causal
        self.cumulative = None
        if log_decay is not None:  # (padding at the end: g = 0, no decay)
            self.cumulative = self.chunk_first(log_decay.to(q.dtype)[:, :, None, :, None]).squeeze(-1).cumsum(-1)

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

    def per_group(self, x: torch.Tensor) -> torch.Tensor:
        """`[Bt, G*C, E]` -> `[Bt, G, C, E]` (a view)."""
        return x.view(x.shape[0], self.groups, self.chunk_size, x.shape[-1])

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """Zero the pairs s > t of a `[Bt, G*C, C]` tensor, in place."""
        self.per_group(x).mul_(self.causal)
        return x

    def decay_weights(self, c: int, scratch: Scratch) -> torch.Tensor:
        """e^{b_t - b_s} for s <= t, else 0, inside chunk c: `[Bt, 1, C, C]` (a `scratch` buffer)."""
        b = self.cumulative[c]
        weights = scratch("decay_weights", (b.shape[0], 1, self.chunk_size, self.chunk_size), b)
        torch.sub(b[:, None, :, None], b[:, None, None, :], out=weights)
        return weights.masked_fill_(self.hidden, float("-inf")).exp_()

    def weighted(self, scores: torch.Tensor, c: int, scratch: Scratch) -> torch.Tensor:
        """The scores `[Bt, G*C, C]` of chunk c masked and, with decay, weighted by e^{b_t - b_s}, in place."""
        if self.cumulative is None:
            return self.masked(scores)
        self.per_group(scores).mul_(self.decay_weights(c, scratch))
        return scores


def _enter_chunk(chunks: _Chunks, c: int, exact: torch.Tensor, phi_k: torch.Tensor, scratch: Scratch) -> None:
    """S_c = e^{b_C} S_{c-1} + (e^{b_C - b_s} phi(k_c))^T v_c (without decay S_{c-1} + phi(k_c)^T v_c), in
    place on `exact` `[Bt, F, Dv']`, from chunk c's key features `phi_k` `[Bt, F, C]`."""
    if chunks.cumulative is not None:
        b = chunks.cumulative[c]
        total = b[:, -1:]
        exact.mul_(total.exp()[:, :, None])
        phi_k = torch.mul(phi_k, torch.exp(total - b)[:, None, :], out=scratch("entering", phi_k.shape, phi_k))
    exact += torch.bmm(phi_k, chunks.v[c], out=scratch("increment", exact.shape, phi_k))


def _forward(chunks: _Chunks, state: torch.Tensor, kernel: ChunkKernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop: (augmented numerator `[n, Bt, G*C, Dv']`, the final state in float64 `[Bt, F, Dv']`)."""
    query_scratch, key_scratch, scratch = Scratch(), Scratch(), Scratch()
    q = chunks.q
    bt, feature_dim, width = q.shape[1], state.shape[-2], state.shape[-1]
    exact = state.reshape(bt, feature_dim, width).to(torch.float64, copy=True)
    running = exact if state.dtype == torch.float64 else exact.to(state.dtype)
    out = q.new_empty(chunks.chunks, bt, q.shape[2], width)
    for c in range(chunks.chunks):
        phi_q = kernel.chunk_features(q[c], query_scratch, query=True)
        phi_k = kernel.chunk_features(chunks.k[c], key_scratch, query=False)
        intra = chunks.weighted(kernel.chunk_scores(q[c], chunks.k[c], phi_q, phi_k, scratch), c, scratch)
        torch.bmm(phi_q.mT, running, out=out[c])
        if chunks.cumulative is not None:
            chunks.per_group(out[c]).mul_(chunks.cumulative[c].exp()[:, None, :, None])
        out[c].baddbmm_(intra, chunks.v[c])
        _enter_chunk(chunks, c, exact, phi_k, scratch)
        if running is not exact:
            running.copy_(exact)
    return out, exact


def _replay_states(chunks: _Chunks, start: torch.Tensor, kernel: ChunkKernel) -> torch.Tensor:
    """The state each chunk read, `[n, Bt, F, Dv']` in q's dtype, replaying `_forward`'s updates from the
    initial state `start`."""
    scratch, key_scratch = Scratch(), Scratch()
    exact = start.reshape(chunks.q.shape[1], *start.shape[-2:]).to(torch.float64, copy=True)
    states = chunks.q.new_empty(chunks.chunks, *exact.shape)
    for c in range(chunks.chunks):
        states[c].copy_(exact)
        _enter_chunk(chunks, c, exact, kernel.chunk_features(chunks.k[c], key_scratch, query=False), scratch)
    return states


def _backward(chunks: _Chunks, saved_state: torch.Tensor, kernel: ChunkKernel, d_out, d_final_state):
    """(dq, dk, dv chunk-first, d state `[Bt, F, Dv']`, d log-decays `[n, Bt, C]` or None) of `_forward`.
    `saved_state`: without decay the final state in float64 (rewound chunk by chunk), with decay the
    initial state (replayed forward)."""
    query_scratch, key_scratch, scratch = Scratch(), Scratch(), Scratch()
    q = chunks.q
    n, bt, rows, _ = q.shape
    size = chunks.chunk_size
    feature_dim, width = saved_state.shape[-2:]
    decayed = chunks.cumulative is not None
    if decayed:
        states = _replay_states(chunks, saved_state, kernel)
        d_log = torch.empty_like(chunks.cumulative)
    else:
        exact = saved_state.clone()
        running = exact if q.dtype == torch.float64 else exact.to(q.dtype)
        d_log = None
    d_out = chunks.chunk_first(d_out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(chunks.k), torch.zeros_like(chunks.v)
    d_state = d_final_state.reshape(bt, feature_dim, width).clone()
    for c in reversed(range(n)):
        qc, kc, vc, doc = q[c], chunks.k[c], chunks.v[c], d_out[c]
        phi_k = kernel.chunk_features(kc, key_scratch, query=False)
        phi_q = kernel.chunk_features(qc, query_scratch, query=True)
        if decayed:
            previous = states[c]
        else:  # rewind S_c = S_{c-1} + phi(k_c)^T v_c to the state chunk c read
            exact -= torch.bmm(phi_k, vc, out=scratch("increment", (bt, feature_dim, width), q))
            if running is not exact:
                running.copy_(exact)
            previous = running

        # Inside the chunk: out_c += (weighted k(q_t, k_s)) v_s.
        d_intra = torch.bmm(doc, vc.mT, out=scratch("d_intra", (bt, rows, size), q))
        weighted = chunks.weighted(kernel.chunk_scores(qc, kc, phi_q, phi_k, scratch), c, scratch)
        dv[c].baddbmm_(weighted.mT, doc)
        if decayed:  # d b from e^{b_t - b_s}: + for the query t, - for the key s
            products = chunks.per_group(torch.mul(d_intra, weighted, out=scratch("products", d_intra.shape, q)))
            d_b = products.sum((1, 3)) - products.sum((1, 2))
            chunks.per_group(d_intra).mul_(scratch.get("decay_weights"))  # (`weighted` filled it)
        else:
            chunks.masked(d_intra)
        dq_intra, dk_intra, d_phi_q_intra, d_phi_k_intra = kernel.chunk_scores_backward(
            d_intra, qc, kc, phi_q, phi_k, scratch
        )

        # Across chunks: out_c += e^{b_t} phi(q_c) S_{c-1}, and S_c = e^{b_C} S_{c-1} + (e^{b_C - b_s}
        # phi(k_c))^T v_c (d_state holds dL/dS_c until it becomes dL/dS_{c-1}).
        if decayed:
            b = chunks.cumulative[c]
            total = b[:, -1:]
            entering = torch.exp(total - b)  # e^{b_C - b_s} [Bt, C]
            d_read = scratch("d_read", (bt, rows, width), q)
            torch.mul(chunks.per_group(doc), b.exp()[:, None, :, None], out=chunks.per_group(d_read))
            inter = torch.bmm(phi_q.mT, previous, out=scratch("inter", (bt, rows, width), q))
            d_b += chunks.per_group(inter.mul_(d_read)).sum((1, 3))
            d_entering_keys = torch.bmm(d_state, vc.mT, out=scratch("d_phi_k", (bt, feature_dim, size), q))
            d_entering = (d_entering_keys * phi_k).sum(1) * entering  # d e^{b_C - b_s}, times it
            d_b -= d_entering
            d_b[:, -1] += d_entering.sum(-1) + total.squeeze(-1).exp() * (previous * d_state).sum((-2, -1))
            d_phi_k = d_entering_keys.mul_(entering[:, None, :])
            dv[c].baddbmm_(torch.mul(phi_k, entering[:, None, :], out=scratch("entering", phi_k.shape, q)).mT, d_state)
            d_log[c] = d_b.flip(-1).cumsum(-1).flip(-1)  # b_t = g_1 + ... + g_t
            d_phi_q = torch.bmm(previous, d_read.mT, out=scratch("d_phi_q", (bt, feature_dim, rows), q))
            d_state.mul_(total.exp()[:, :, None]).baddbmm_(phi_q, d_read)
        else:
            d_phi_k = torch.bmm(d_state, vc.mT, out=scratch("d_phi_k", (bt, feature_dim, size), q))
            d_phi_q = torch.bmm(previous, doc.mT, out=scratch("d_phi_q", (bt, feature_dim, rows), q))
            dv[c].baddbmm_(phi_k.mT, d_state)
            d_state.baddbmm_(phi_q, doc)
        for found, total_grad in (
            (d_phi_k_intra, d_phi_k),
            (d_phi_q_intra, d_phi_q),
            (dq_intra, dq[c]),
            (dk_intra, dk[c]),
        ):
            if found is not None:
                total_grad += found
        dk[c] += kernel.chunk_features_backward(d_phi_k, key_scratch, query=False)
        dq[c] += kernel.chunk_features_backward(d_phi_q, query_scratch, query=True)
    return dq, dk, dv, d_state, d_log


class _ChunkedKernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, log_decay, kernel, chunk_size):
        chunks = _Chunks(q, k, v, chunk_size, log_decay)
        out, final = _forward(chunks, state, kernel)
        ctx.save_for_backward(q, k, v, log_decay, final if log_decay is None else state)
        ctx.kernel, ctx.chunk_size = kernel, chunk_size
        return chunks.restore(out, (*q.shape[:-1], state.shape[-1])), final.to(state.dtype, copy=True).view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_final_state):
        q, k, v, log_decay, saved_state = ctx.saved_tensors
        chunks = _Chunks(q, k, v, ctx.chunk_size, log_decay)
        dq, dk, dv, d_state, d_log = _backward(chunks, saved_state, ctx.kernel, d_out, d_final_state)
        return (
            chunks.restore(dq, q.shape),
            chunks.restore(dk, k.shape),
            chunks.restore(dv, v.shape),
            d_state.view(d_final_state.shape),
            None if d_log is None else chunks.restore(d_log[..., None], log_decay.shape),
            None,
            None,
        )


def _intra_weights(chunks: _Chunks) -> torch.Tensor:
    """The causal mask `[C, C]`, or with decay e^{b_t - b_s} for s <= t, else 0, `[n, Bt, 1, C, C]`."""
    if chunks.cumulative is None:
        return chunks.causal
    b = chunks.cumulative
    return (b[..., None, :, None] - b[..., None, None, :]).masked_fill_(chunks.hidden, float("-inf")).exp_()


def _batched_states(chunks: _Chunks, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the state each chunk reads `[n, Bt, F, Dv']` in q's dtype, the final state in float64 `[Bt, F, Dv']`)
    from the initial one: the increments of all chunks in one product, then their sum in float64."""
    k, v = chunks.k, chunks.v
    n, bt = k.shape[:2]
    if chunks.cumulative is not None:
        total = chunks.cumulative[..., -1:]
        k = k * torch.exp(total - chunks.cumulative)[..., None]
        decays = total.exp()[..., None].to(torch.float64)  # [n, Bt, 1, 1]
    increments = torch.bmm(k.flatten(0, 1).mT, v.flatten(0, 1)).view(n, bt, k.shape[-1], v.shape[-1])
    exact = start.reshape(increments.shape[1:]).to(torch.float64, copy=True)
    states = increments.new_empty(increments.shape)
    for c in range(n):
        states[c].copy_(exact)
        if chunks.cumulative is not None:
            exact.mul_(decays[c])
        exact += increments[c]
    return states, exact


def _feature_forward(chunks: _Chunks, start: torch.Tensor, query_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward` for features given whole (`chunks.q` `[n, Bt, G*C, F]`, `chunks.k` `[n, Bt, C, F]`, times
    `query_scale` for the queries), every chunk in one batched product: only the states run chunk by chunk."""
    q, k, v = (x.flatten(0, 1) for x in (chunks.q, chunks.k, chunks.v))
    n, bt, rows = chunks.q.shape[:3]
    scores = torch.bmm(q, k.mT)
    scores.view(n, bt, chunks.groups, chunks.chunk_size, -1).mul_(_intra_weights(chunks))
    states, final = _batched_states(chunks, start)
    out = torch.bmm(q, states.flatten(0, 1))
    if chunks.cumulative is not None:
        chunks.per_group(out).mul_(chunks.cumulative.flatten(0, 1).exp()[:, None, :, None])
    out.baddbmm_(scores, v).mul_(query_scale)
    return out.view(n, bt, rows, -1), final


def _feature_backward(chunks: _Chunks, start: torch.Tensor, query_scale: float, d_out, d_final_state):
    """(d phi(q) `[n, Bt, G*C, F]`, d phi(k), dv chunk-first, d state `[Bt, F, Dv']`, d log-decays `[n, Bt, C]`
    or None) of `_feature_forward`, batched the same way; the states are rebuilt first."""
    q, k, v = (x.flatten(0, 1) for x in (chunks.q, chunks.k, chunks.v))
    n, bt, rows, _ = chunks.q.shape
    groups, size, decayed = chunks.groups, chunks.chunk_size, chunks.cumulative is not None
    d_out = chunks.chunk_first(d_out).flatten(0, 1).mul_(query_scale)  # (chunk_first copies)
    states, _ = _batched_states(chunks, start)
    states = states.flatten(0, 1)
    d_read = d_out  # e^{b_t} d out_t: what the state read by chunk c receives
    if decayed:
        cumulative = chunks.cumulative.flatten(0, 1)  # [n * Bt, C]
        total = cumulative[:, -1:]
        d_read = chunks.per_group(d_out).mul(cumulative.exp()[:, None, :, None]).view(d_out.shape)
    reads = torch.bmm(q.mT, d_read).view(n, bt, *states.shape[-2:])
    d_after = torch.empty_like(reads)  # dL/dS_c, the state after chunk c
    d_state = d_final_state.reshape(reads.shape[1:]).clone()
    if decayed:
        decays = total.exp().view(n, bt, 1, 1)  # e^{b_C} of each chunk
    for c in reversed(range(n)):
        d_after[c].copy_(d_state)
        if decayed:
            d_state.mul_(decays[c])
        d_state += reads[c]
    del reads  # (the full-size tensors of this pass are dropped as soon as they are used up)
    d_after = d_after.flatten(0, 1)

    # Across chunks: out_c += e^{b_t} phi(q_c) S_{c-1}; S_c = e^{b_C} S_{c-1} + (e^{b_C - b_s} phi(k_c))^T v_c.
    dq = torch.bmm(d_read, states.mT)
    dk = torch.bmm(v, d_after.mT)  # v_s dS_c^T, before the factors e^{b_C - b_s}
    d_log = None
    if decayed:
        entering = torch.exp(total - cumulative)  # [n * Bt, C]
        d_entering = (dk * k).sum(-1) * entering  # d e^{b_C - b_s}, times it
        dk.mul_(entering[..., None])
        dv = torch.bmm(k * entering[..., None], d_after)
        inter = torch.bmm(q, states)  # phi(q_t) S_{c-1}, before e^{b_t}
        d_b = chunks.per_group(inter.mul_(d_read)).sum((1, 3)) - d_entering
        d_b[:, -1] += d_entering.sum(-1) + total.squeeze(-1).exp() * (states * d_after).sum((-2, -1))
        del inter
    else:
        dv = torch.bmm(k, d_after)
    del states, d_after, d_read

    # Inside a chunk: out_c += (weighted phi(q_t).phi(k_s)) v_s.
    weights = _intra_weights(chunks)
    weighted = torch.bmm(q, k.mT)
    weighted.view(n, bt, groups, size, size).mul_(weights)
    dv.baddbmm_(weighted.mT, d_out)
    d_scores = torch.bmm(d_out, v.mT)
    if decayed:  # d b from e^{b_t - b_s}: + for the query t, - for the key s
        products = chunks.per_group(weighted.mul_(d_scores))
        d_b += products.sum((1, 3)) - products.sum((1, 2))
        d_log = d_b.flip(-1).cumsum(-1).flip(-1).view(n, bt, size)  # b_t = g_1 + ... + g_t
    d_scores.view(n, bt, groups, size, size).mul_(weights)
    dq.baddbmm_(d_scores, k)
    dk.baddbmm_(d_scores.mT, q)
    shape = (n, bt, -1, q.shape[-1])
    return dq.view(shape), dk.view(shape), dv.view(n, bt, size, -1), d_state, d_log


class _ChunkedFeatureAttention(torch.autograd.Function):
    """Any feature map: its features for the whole call in one product, then every chunk at once
    (`_feature_forward`); the backward rebuilds the features and sends their gradients through the map
    (to q, k and the map's learned tensors) with autograd, so only q, k, v, the log-decays, the initial
    state and the map's tensors are kept. Each pass holds the call's features, their chunk-first copies
    and the states before each chunk for a while: O(L F) memory that is freed when the pass ends."""

    @staticmethod
    def forward(ctx, q, k, v, state, log_decay, kernel, chunk_size, *learned):
        phi_q, query_scale = kernel.query_features_and_factor(q)
        chunks = _Chunks(phi_q, kernel.key_features(k), v, chunk_size, log_decay)
        del phi_q  # (the loop reads the chunk-first copies)
        out, final = _feature_forward(chunks, state, query_scale)
        ctx.save_for_backward(q, k, v, log_decay, state, *learned)
        ctx.kernel, ctx.chunk_size = kernel, chunk_size
        return chunks.restore(out, (*q.shape[:-1], state.shape[-1])), final.to(state.dtype, copy=True).view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_final_state):
        q, k, v, log_decay, start, *learned = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [tensor.detach().requires_grad_() for tensor in (q, k, *learned)]
            kernel = ctx.kernel.with_learned(*leaves[2:])
            phi_q, query_scale = kernel.query_features_and_factor(leaves[0])
            phi_k = kernel.key_features(leaves[1])
        chunks = _Chunks(phi_q.detach(), phi_k.detach(), v, ctx.chunk_size, log_decay)
        d_phi_q, d_phi_k, dv, d_state, d_log = _feature_backward(chunks, start, query_scale, d_out, d_final_state)
        dv, d_log = (
            chunks.restore(dv, v.shape),
            None if d_log is None else chunks.restore(d_log[..., None], log_decay.shape),
        )
        d_features = [chunks.restore(d_phi_q, phi_q.shape), chunks.restore(d_phi_k, phi_k.shape)]
        del chunks, d_phi_q, d_phi_k  # (chunk-first copies: freed before autograd's pass through the map)
        grads = torch.autograd.grad([phi_q, phi_k], leaves, d_features, allow_unused=True)
        return (
            grads[0],
            grads[1],
            dv,
            d_state.view(d_final_state.shape),
            d_log,
            None,
            None,
            *grads[2:],
        )


def chunked_kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    chunk_size: int,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last position, the state
    decayed by exp(`log_decay` `[B, Hkv, L]`) at each position before that position's key enters (None:
    no decay). `kernel`: any `FeatureKernel` of `ops.kernels`. Its features are computed for the whole
    call and every chunk batched (`_ChunkedFeatureAttention`), unless its kernel can rebuild them chunk by
    chunk (`hand_written`) and they are more than `WHOLE_CALL_FEATURES` times the head dimension wide
    (Taylor-2 and up). What a call keeps for its backward pass is O(L D) either way. A call shorter than
    `chunk_size` runs as one chunk of its own length (no padding)."""
    chunk_size = max(1, min(chunk_size, q.shape[-2]))
    if kernel.hand_written and state.shape[-2] > WHOLE_CALL_FEATURES * q.shape[-1]:
        return _ChunkedKernelAttention.apply(q, k, v, state, log_decay, kernel, chunk_size)
    return _ChunkedFeatureAttention.apply(q, k, v, state, log_decay, kernel, chunk_size, *kernel.learned)

"""The parallel (masked L x L) form of every recurrent-softmax and linear variant.

It is exact for every variant (exact exp, Taylor, feature maps, clamps, sliding-window
hybrids) and is the reference the chunked and recurrent forms are tested against.
Shapes: grouped q `[B, Hkv, G, Lq, D]`, k and v `[B, Hkv, Lk, D]`, Lq <= Lk (the queries
are the last Lq positions); key_mask `[B, Lk]` bool (True = visible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_softmax_rnn.ops.decay import decay_weights
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kept import kept_schedule, rank_scores
from hf_softmax_rnn.ops.kernels import ExpKernel, FeatureKernel, row_shift, soft_cap
from hf_softmax_rnn.ops.sinks import sink_mask
from hf_softmax_rnn.ops.window import mix_weight, window_visibility


def visible_mask(key_mask: torch.Tensor, query_len: int, window: int | None = None) -> torch.Tensor:
    """Causal-and-padding visibility `[B, 1, 1, Lq, Lk]` for queries at the last Lq positions; with `window`
    W, only the keys fewer than W positions (by index) before the query."""
    key_len = key_mask.shape[-1]
    positions = torch.arange(key_len, device=key_mask.device)
    query_positions = positions[key_len - query_len :, None]
    causal = positions[None, :] <= query_positions
    if window is not None:
        causal &= positions[None, :] > query_positions - window
    return (causal[None] & key_mask[:, None, :])[:, None, None]


def visible_counts(key_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """t: the number of visible positions up to each query `[B, 1, Lq]` (the order-0 term of G)."""
    return key_mask.cumsum(-1)[:, None, -query_len:]


def parallel_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor,
    kernel: ExpKernel | FeatureKernel,
    window: int | None = None,
    window_scale: float | None = None,
    linear_log_scale: torch.Tensor | None = None,
    sinks: int | None = None,
    log_decay: torch.Tensor | None = None,
    kept: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The masked score matrix a_ts `[B, Hkv, G, Lq, Lk]` (zero where not visible), and the per-row
    log factor it was divided by when the normaliser must know it (`[B, Hkv, G, Lq]`, else None):
    the sum of `parallel_parts`' exact and finite-state scores."""
    parts = parallel_parts(
        q, k, key_mask, kernel, window, window_scale, linear_log_scale, sinks, log_decay, kept, softcap
    )
    scores = parts.finite if parts.exact is None else parts.exact + parts.finite
    return scores, parts.log_shift


@dataclass
class ParallelParts:
    """The parallel form's scores `[B, Hkv, G, Lq, Lk]` in two parts: `exact` (a hybrid's window, sinks and
    kept keys, exp(x - m_t); None without a window) and `finite` (the finite-state kernel's scores of the
    keys that have entered the state, with their decay and the hybrid's mixing weight), with the per-row log
    shift of exact exp (`[B, Hkv, G, Lq]`, or None) and, for a hybrid, the step at which each key enters
    the finite state (`entry` `[B, Hkv, Lk]`; steps past Lk - 1 for keys still kept) and whether it ever
    can (`enters` `[B, 1, Lk]`: visible, not a sink), and the factor of each row's finite part (`finite_scale`,
    a hybrid's mixing weight `[B, Hkv, G, Lq, 1]`; 1.0 without a window)."""

    exact: torch.Tensor | None
    finite: torch.Tensor
    log_shift: torch.Tensor | None
    entry: torch.Tensor
    enters: torch.Tensor
    finite_scale: torch.Tensor | float = 1.0


def parallel_parts(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor,
    kernel: ExpKernel | FeatureKernel,
    window: int | None = None,
    window_scale: float | None = None,
    linear_log_scale: torch.Tensor | None = None,
    sinks: int | None = None,
    log_decay: torch.Tensor | None = None,
    kept: int | None = None,
    softcap: float | None = None,
) -> ParallelParts:
    """The parallel form's scores by part (`ParallelParts`).

    With a `window`, the last `window` positions are scored with exp(`window_scale` q.k) and
    older ones with the kernel times e^{linear_log_scale}, both divided by e^{m_t} (m_t the
    row's largest window score; see `ops.window`). With `sinks`, the first `sinks` visible
    positions are scored like the window (once, when they are in it too) and are never older.
    With `kept`, the keys each query keeps (`ops.kept.kept_schedule`, queries at every position:
    Lq == Lk) are scored like the window too, and enter the finite state when they stop being kept.
    With `log_decay` `[B, Hkv, Lk]`, the finite-state scores are multiplied by the decay since the
    key entered the state (`ops.decay.decay_weights`). With `softcap` c, the exact scores x (window, sinks,
    kept keys, and the window softmax that ranks the kept keys) are c tanh(x / c); the finite-state
    scores are not capped.
    """
    visible = visible_mask(key_mask, q.shape[-2])
    key_len = k.shape[-2]
    positions = torch.arange(key_len, device=k.device).expand(*k.shape[:2], key_len)
    if window is None:
        scores, log_shift = kernel.masked_scores(q, k, visible)
        if log_decay is not None:
            scores = scores * decay_weights(log_decay, q.shape[-2], 0)
        return ParallelParts(None, scores, log_shift, positions, key_mask[:, None])
    near = visible & window_visibility(q.shape[-2], key_len, window, q.device)
    sink = torch.zeros_like(key_mask) if sinks is None else sink_mask(key_mask, sinks)
    near = near | (visible & sink[:, None, None, None, :])
    x = soft_cap(grouped_matmul(q * window_scale, k.mT), softcap)
    entry = positions + window
    if kept is not None:
        in_window = near & ~sink[:, None, None, None, :]
        probabilities = torch.softmax(x.masked_fill(~in_window, float("-inf")), -1).nan_to_num(0.0)
        saliency = (probabilities.detach() * key_mask[:, None, None, :, None]).amax(dim=(2, 3))
        ranking = rank_scores(saliency, torch.zeros_like(saliency[..., 0]))
        kept_mask, entry = kept_schedule(ranking, key_mask & ~sink, window, kept)
        near = near | (visible & kept_mask[:, :, None])
    x = x.masked_fill(~near, float("-inf"))
    row_max = row_shift(x)
    older = kernel.scores(q, k).masked_fill(~(visible & ~near), 0.0)
    if log_decay is not None:
        older = older * decay_weights(log_decay, q.shape[-2], window, None if kept is None else entry)
    mix = mix_weight(linear_log_scale, row_max, k.shape[1])
    return ParallelParts(torch.exp(x - row_max), older * mix, None, entry, (key_mask & ~sink)[:, None], mix)

"""The parallel (masked L x L) form of every recurrent-softmax and linear variant.

It is exact for every variant (exact exp, Taylor, feature maps, clamps) and is the
reference the chunked and recurrent forms are tested against.
Shapes: grouped q `[B, Hkv, G, Lq, D]`, k and v `[B, Hkv, Lk, D]`, Lq <= Lk (the queries
are the last Lq positions); key_mask `[B, Lk]` bool (True = visible).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.feature_maps import kernel_scores, taylor_exp


def visible_mask(key_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Causal-and-padding visibility `[B, 1, 1, Lq, Lk]` for queries at the last Lq positions."""
    key_len = key_mask.shape[-1]
    positions = torch.arange(key_len, device=key_mask.device)
    causal = positions[None, :] <= positions[key_len - query_len :, None]
    return (causal[None] & key_mask[:, None, :])[:, None, None]


def visible_counts(key_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """t: the number of visible positions up to each query `[B, 1, Lq]` (the order-0 term of G)."""
    return key_mask.long().cumsum(-1)[:, None, -query_len:]


def parallel_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor,
    spec: AttentionSpec,
    params: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """The masked score matrix a_ts `[B, Hkv, G, Lq, Lk]` (zero where not visible).

    Exact exp of a row-scale-invariant normaliser is computed as exp(x - rowmax), which
    never overflows; other normalisers see the true exp (and may overflow without a clamp).
    """
    scale = spec.scale(q.shape[-1])
    visible = visible_mask(key_mask, q.shape[-2])
    if spec.kind == "linear":
        scores = kernel_scores(q, k, spec, scale, params)
        if spec.score_clamp is not None:
            scores = scores.clamp_max(spec.score_clamp)
        return scores.masked_fill(~visible, 0.0)
    x = scale * grouped_matmul(q, k.transpose(-1, -2))
    if spec.score_clamp is not None:
        x = x.clamp_max(spec.score_clamp)
    if spec.uses_taylor:
        return taylor_exp(x, spec.taylor_order).masked_fill(~visible, 0.0)
    x = x.masked_fill(~visible, float("-inf"))
    if spec.is_row_scale_invariant:
        row_max = x.amax(-1, keepdim=True).detach()
        x = x - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    return torch.exp(x)

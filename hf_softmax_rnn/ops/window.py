"""The exact part of a sliding-window hybrid: exp(q.k) over the last W positions.

A hybrid layer scores the W most recent positions (the query's own included) with the exact
exponential and every older position with the finite-state kernel, under one normaliser:

    y_t = (sum_{t-W < s <= t} e^{x_ts} v_s + e^{lambda} sum_{s <= t-W} phi(q_t).phi(k_s) v_s) / (same with v = 1)

Computed as e^{x - m_t} and e^{lambda - m_t} phi.phi with m_t the largest score in the
window, so the exact part never overflows; the normalisers allowed with a window ignore a
per-row factor, so the shift changes nothing else.

`banded_exp_attention` computes the exact part for L new queries from the keys of the last
W positions before them (the window buffer of the state) and their own, block by block: each
block of C queries meets C + W keys, so time and memory are O(L (C + W)), never L x L.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_softmax_rnn.ops.kernels import row_shift


def banded_exp_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum over the window of exp(x - m) [v, 1] and m.

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`, at positions W .. W + L - 1 of `keys`.
        keys, values: `[B, Hkv, W + L, D]` and `[B, Hkv, W + L, Dv']`: the W positions before the
            queries, then the queries' own.
        key_valid: `[B, W + L]` bool, False for padding (and for an empty window buffer).
        scale: multiplier of q.k; window: W; block: queries per block C.

    Returns:
        (`[B, Hkv, G, L, Dv']` window numerator, `[B, Hkv, G, L, 1]` row max m, detached; 0 where a
        query sees no valid key).
    """
    batch, kv_heads, groups, length, head_dim = q.shape
    block = max(1, min(block, length))
    blocks = -(-length // block)
    pad, span = blocks * block - length, block + window
    q = F.pad(q, (0, 0, 0, pad)).view(batch, kv_heads, groups, blocks, block, head_dim)
    key_blocks = F.pad(keys, (0, 0, 0, pad)).unfold(2, span, block)
    value_blocks = F.pad(values, (0, 0, 0, pad)).unfold(2, span, block)
    valid_blocks = F.pad(key_valid, (0, pad)).unfold(1, span, block)
    rows = torch.arange(block, device=q.device)[:, None]
    cols = torch.arange(span, device=q.device)[None, :]
    visible = ((cols > rows) & (cols <= rows + window)) & valid_blocks[:, None, None, :, None, :]
    x = (scale * (q @ key_blocks.unsqueeze(2))).masked_fill(~visible, float("-inf"))
    row_max = row_shift(x)
    numerator = torch.exp(x - row_max) @ value_blocks.unsqueeze(2).mT
    numerator = numerator.reshape(batch, kv_heads, groups, blocks * block, -1)[..., :length, :]
    return numerator, row_max.reshape(batch, kv_heads, groups, blocks * block, 1)[..., :length, :]


def window_visibility(query_len: int, key_len: int, window: int, device=None) -> torch.Tensor:
    """`[Lq, Lk]` bool: key position p is inside the window of the query at position
    P = Lk - Lq + i, i.e. P - W < p (causality is checked apart)."""
    queries = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    return torch.arange(key_len, device=device)[None, :] > queries - window


#: Largest exponent of the finite-state part's factor. Beyond it the window's own terms (each at
#: most 1 after the shift) weigh less than e^-40 of it, so capping changes nothing visible and
#: keeps the factor finite when every score in the window is hugely negative.
MAX_MIX_EXPONENT = 40.0


def mix_weight(log_scale: torch.Tensor, row_max: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """e^{lambda_h - m_t}, the factor of the finite-state part: log_scale `[H]`, row_max
    `[B, Hkv, G, L, 1]` (or `[..., Lq, 1]`) -> same shape as row_max."""
    exponent = log_scale.to(row_max.dtype).view(kv_heads, -1, 1, 1) - row_max
    return torch.exp(exponent.clamp_max(MAX_MIX_EXPONENT))

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
`window_saliency` runs its scores alone, for the saliencies that rank the window's keys (`ops.kept`)
where another kernel computes the exact part itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import row_shift


def banded_exp_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    block: int,
    query_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """sum over the window of exp(x - m) [v, 1] and m (and, with `query_valid`, each key's saliency).

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`, at positions W .. W + L - 1 of `keys`.
        keys, values: `[B, Hkv, W + L, D]` and `[B, Hkv, W + L, Dv']`: the W positions before the
            queries, then the queries' own.
        key_valid: `[B, W + L]` bool, False for padding (and for an empty window buffer).
        scale: multiplier of q.k; window: W; block: queries per block C.
        query_valid: `[B, L]` bool, False for padding queries; given, the saliency of each key is
            returned as well: its largest window-softmax weight over these queries and the query heads
            of its KV head (`ops.kept`).

    Returns:
        (`[B, Hkv, G, L, Dv']` window numerator, `[B, Hkv, G, L, 1]` row max m, detached; 0 where a
        query sees no valid key) and with `query_valid` `[B, Hkv, W + L]` saliencies (detached).
    """
    batch, kv_heads, groups, length, _ = q.shape
    block = max(1, min(block, length))
    weights, row_max = _band_weights(q, keys, key_valid, scale, window, block)
    blocks, span = weights.shape[2], weights.shape[-1]
    value_blocks = _windows(F.pad(values, (0, 0, 0, blocks * block - length)), 2, span, block)
    numerator = weights.view(batch, kv_heads, blocks, groups * block, span) @ value_blocks.mT
    numerator, row_max = per_query(numerator, groups, length), per_query(row_max, groups, length)
    if query_valid is None:
        return numerator, row_max
    return numerator, row_max, _saliency(weights.detach().transpose(2, 3), query_valid, block, window, length)


def window_saliency(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    block: int,
    query_valid: torch.Tensor,
) -> torch.Tensor:
    """`[B, Hkv, W + L]` the saliencies `banded_exp_attention` returns with `query_valid`, without its
    numerator (the window's exact part computed elsewhere, FlexAttention's); no autograd."""
    block = max(1, min(block, q.shape[-2]))
    with torch.no_grad():
        weights, _ = _band_weights(q, keys, key_valid, scale, window, block)
        return _saliency(weights.transpose(2, 3), query_valid, block, window, q.shape[-2])


def _band_weights(
    q: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor, scale: float, window: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{x - m} `[B, Hkv, blocks, G, C, C + W]`, 0 where masked; m `[B, Hkv, blocks, G * C, 1]`, detached)
    of each block of C queries against its C + W keys (arguments as `banded_exp_attention`'s)."""
    batch, kv_heads, groups, length, _ = q.shape
    blocks = -(-length // block)
    pad, span = blocks * block - length, block + window
    q = query_blocks(q, blocks, block)
    key_blocks = _windows(F.pad(keys, (0, 0, 0, pad)), 2, span, block)  # [B, Hkv, blocks, D, C + W]
    valid_blocks = _windows(F.pad(key_valid, (0, pad)), 1, span, block)
    rows = torch.arange(block, device=q.device)[:, None]
    cols = torch.arange(span, device=q.device)[None, :]
    visible = ((cols > rows) & (cols <= rows + window)) & valid_blocks[:, None, :, None, None, :]
    weights, row_max = blocked_exp(q, key_blocks, visible, scale, groups)
    return weights, row_max.view(batch, kv_heads, blocks, groups * block, 1)


def blocked_exp(
    q_blocks: torch.Tensor, key_columns: torch.Tensor, visible: torch.Tensor, scale: float, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{x - m} `[B, Hkv, blocks, G, C, N]`, 0 where not `visible`; the row max m `[..., 1]`, detached) of
    x = scale q.k for the queries of each block (`query_blocks`, `[B, Hkv, blocks, G * C, D]`) against its
    own N keys as columns `[B, Hkv, blocks, D, N]`; `visible` broadcasts to x. The queries are scaled
    before the product (D wide, not N). Without autograd (prefill, evaluation) the mask, the shift and
    the exp are written over the product: one tensor of N columns a row instead of four. (With autograd,
    writing over a view of the product would make its backward copy the whole band.)"""
    batch, kv_heads, blocks, rows, _ = q_blocks.shape
    x = ((q_blocks * scale) @ key_columns).view(batch, kv_heads, blocks, groups, rows // groups, -1)
    if x.requires_grad:
        x = x.masked_fill(~visible, float("-inf"))
        row_max = row_shift(x)
        return torch.exp(x - row_max), row_max
    row_max = row_shift(x.masked_fill_(~visible, float("-inf")))
    return x.sub_(row_max).exp_(), row_max


def query_blocks(q: torch.Tensor, blocks: int, block: int) -> torch.Tensor:
    """Grouped queries `[B, Hkv, G, L, D]` -> `[B, Hkv, blocks, G * C, D]` (zero-padded to blocks * C): the
    query heads of a KV head stacked as the rows of each block, so that a product with the block's keys
    reads them once (a product broadcast over G would copy them G times)."""
    batch, kv_heads, groups, length, head_dim = q.shape
    rows = F.pad(q, (0, 0, 0, blocks * block - length)).view(batch, kv_heads, groups, blocks, block, head_dim)
    return rows.transpose(2, 3).reshape(batch, kv_heads, blocks, groups * block, head_dim)


def per_query(blocked: torch.Tensor, groups: int, length: int) -> torch.Tensor:
    """The inverse of `query_blocks` for a result per row: `[B, Hkv, blocks, G * C, X]` (or `[B, Hkv,
    blocks, G, C, X]`) -> `[B, Hkv, G, L, X]`."""
    batch, kv_heads, blocks = blocked.shape[:3]
    blocked = blocked.reshape(batch, kv_heads, blocks, groups, -1, blocked.shape[-1]).transpose(2, 3)
    return blocked.reshape(batch, kv_heads, groups, -1, blocked.shape[-1])[..., :length, :]


def _windows(x: torch.Tensor, dim: int, span: int, step: int) -> torch.Tensor:
    """`x.unfold(dim, span, step)`; where `x` holds exactly one window along `dim`, the same view made by
    moving `dim` last (torch.compile's CPU backward of a product with a one-window unfold crashes in
    PyTorch 2.13)."""
    if x.shape[dim] == span:
        return x.movedim(dim, -1).unsqueeze(dim)
    return x.unfold(dim, span, step)


def _saliency(weights: torch.Tensor, query_valid: torch.Tensor, block: int, window: int, length: int) -> torch.Tensor:
    """`[B, Hkv, W + L]` largest window-softmax weight of each key over the valid queries and heads,
    from the blocks' e^{x - m} `[B, Hkv, G, blocks, C, C + W]` (0 where masked)."""
    batch, kv_heads, _, blocks, _, span = weights.shape
    queries = F.pad(query_valid, (0, blocks * block - length)).view(batch, 1, 1, blocks, block, 1)
    factor = queries / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)  # 0 at padding
    per_block = (weights * factor).amax(dim=(2, 4))  # [B, Hkv, blocks, C + W]: one pass over the weights
    index = torch.arange(blocks, device=weights.device)[:, None] * block + torch.arange(span, device=weights.device)
    out = weights.new_zeros(batch, kv_heads, blocks * block + window)
    out.scatter_reduce_(-1, index.flatten().expand(batch, kv_heads, -1), per_block.flatten(-2), "amax")
    return out[..., : window + length]


def masked_exp_part(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """An exact part over a set of keys beside the window (sinks, kept keys): the sum over the visible
    keys of e^{x - m} [v, 1] and m.

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`; keys, values: `[B, Hkv, N, D]`, `[B, Hkv, N, Dv + 1]`.
        visible: bool, broadcastable to `[B, Hkv, G, L, N]`; scale: multiplier of q.k.

    Returns:
        (`[B, Hkv, G, L, Dv + 1]` numerator, `[B, Hkv, G, L, 1]` row max m, detached; -inf where a query
        sees none of the keys), as `merge_exact` takes them.
    """
    x = grouped_matmul(q * scale, keys.mT).masked_fill(~visible, float("-inf"))
    shift = row_shift(x)
    empty = ~visible.any(-1, keepdim=True)
    return grouped_matmul(torch.exp(x - shift), values), shift.masked_fill(empty, float("-inf"))


def merge_exact(
    numerator: torch.Tensor, row_max: torch.Tensor, other: torch.Tensor, other_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two exact parts, each shifted by its own row max, under their joint row max.

    Args:
        numerator, row_max: the window's part (`[..., Dv + 1]`, `[..., 1]`; a row is empty where its
            last column is 0).
        other, other_max: another part with its row max, -inf where the row is empty (`masked_exp_part`).

    Returns:
        (the summed numerator, the joint row max, detached).
    """
    mine = row_max.masked_fill(numerator[..., -1:] <= 0, float("-inf"))
    joint = row_shift(torch.maximum(mine, other_max))
    total = numerator * torch.exp(mine - joint) + other * torch.exp(other_max - joint)
    return total, joint


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
    if log_scale.dtype != row_max.dtype and log_scale.dtype.itemsize >= row_max.dtype.itemsize:
        log_scale = log_scale.to(row_max.dtype)  # (a narrower one is promoted by the subtraction below)
    exponent = log_scale.view(kv_heads, -1, 1, 1) - row_max
    return torch.exp(exponent.clamp_max(MAX_MIX_EXPONENT))

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

On a CPU, a block part whose scores are not needed otherwise (the window of a hybrid without kept keys;
the kept keys' part, `ops.kept`) runs in PyTorch's fused CPU flash-attention kernel with the block mask
(`flash_block_part`): one pass instead of five over a block's scores. With autograd (training) its
backward is the kernel's too, for blocks of at least `FLASH_MIN_KEYS_WITH_AUTOGRAD` keys. It returns the
log-sum-exp as the row's shift, which the merges and the finite part's weight take as they take the row
max; so only where the normaliser divides by the denominator (the softmax normaliser: the others see the
shift through their eps or their counts).

With a cap of the scores (`softcap` c, Gemma 2's `attn_logit_softcapping`), every exact score x is
c tanh(x / c) before its exp (`ops.kernels.soft_cap`): in the band, the sinks, the kept keys and the
saliencies that rank them. The fused CPU kernel cannot bend the scores, so capped calls take the block forms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import finite_or_zero, row_shift, soft_cap

#: With autograd, the fused CPU kernel's forward and backward pay only on blocks this wide or wider: one layer's
#: forward and backward at 4,096 positions took 0.85x the block forms' time over the kept keys' blocks of 320
#: and of up to 2,112 keys, 1.0x at 2,048 positions (blocks of 320), and 1.1x over a window of 64's bands of 128.
FLASH_MIN_KEYS_WITH_AUTOGRAD = 256


def banded_exp_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    block: int,
    query_valid: torch.Tensor | None = None,
    any_shift: bool = False,
    softcap: float | None = None,
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
        any_shift: the caller's normaliser divides by the denominator, so m may be any per-row shift
            that keeps exp finite: without saliencies, the log-sum-exp of the fused CPU kernel
            (`flash_block_part`) where it applies.
        softcap: c bends the scores x to c tanh(x / c) (`ops.kernels.soft_cap`; the saliencies read
            them bent too); None: no cap.

    Returns:
        (`[B, Hkv, G, L, Dv']` window numerator, `[B, Hkv, G, L, 1]` row max m (or with `any_shift` the
        log-sum-exp), detached; 0 where a query sees no valid key) and with `query_valid` `[B, Hkv, W + L]`
        saliencies (detached).
    """
    batch, kv_heads, groups, length, _ = q.shape
    block = max(1, min(block, length))
    # (saliencies need e^{x - m}; the fused kernel cannot bend the scores)
    if any_shift and query_valid is None and softcap is None and flash_applies(q, keys, values):
        return _flash_band(q, keys, values, key_valid, scale, window, block)
    weights, row_max = _band_weights(q, keys, key_valid, scale, window, block, softcap)
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
    softcap: float | None = None,
) -> torch.Tensor:
    """`[B, Hkv, W + L]` the saliencies `banded_exp_attention` returns with `query_valid`, without its
    numerator (the window's exact part computed elsewhere, FlexAttention's); no autograd."""
    block = max(1, min(block, q.shape[-2]))
    with torch.no_grad():
        weights, _ = _band_weights(q, keys, key_valid, scale, window, block, softcap)
        return _saliency(weights.transpose(2, 3), query_valid, block, window, q.shape[-2])


def _band_mask(key_valid: torch.Tensor, window: int, block: int, blocks: int) -> torch.Tensor:
    """`[B, 1, blocks, C, C + W]` bool: key column j of a block's C + W keys is in the window of the
    block's query row i (i < j <= i + W) and valid."""
    span = block + window
    valid_blocks = _windows(F.pad(key_valid, (0, blocks * block - key_valid.shape[-1] + window)), 1, span, block)
    rows = torch.arange(block, device=key_valid.device)[:, None]
    cols = torch.arange(span, device=key_valid.device)[None, :]
    return ((cols > rows) & (cols <= rows + window)) & valid_blocks[:, None, :, None, :]


def _band_weights(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    block: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{x - m} `[B, Hkv, blocks, G, C, C + W]`, 0 where masked; m `[B, Hkv, blocks, G * C, 1]`, detached)
    of each block of C queries against its C + W keys (arguments as `banded_exp_attention`'s)."""
    batch, kv_heads, groups, length, _ = q.shape
    blocks = -(-length // block)
    pad, span = blocks * block - length, block + window
    q = query_blocks(q, blocks, block)
    key_blocks = _windows(F.pad(keys, (0, 0, 0, pad)), 2, span, block)  # [B, Hkv, blocks, D, C + W]
    visible = _band_mask(key_valid, window, block, blocks)[:, :, :, None]
    weights, row_max = blocked_exp(q, key_blocks, visible, scale, groups, softcap)
    return weights, row_max.view(batch, kv_heads, blocks, groups * block, 1)


def blocked_exp(
    q_blocks: torch.Tensor,
    key_columns: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    groups: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{x - m} `[B, Hkv, blocks, G, C, N]`, 0 where not `visible`; the row max m `[..., 1]`, detached) of
    x = scale q.k (bent by `softcap`, `ops.kernels.soft_cap`) for the queries of each block (`query_blocks`,
    `[B, Hkv, blocks, G * C, D]`) against its own N keys as columns `[B, Hkv, blocks, D, N]`; `visible`
    broadcasts to x. The queries are scaled before the product (D wide, not N). Without autograd (prefill,
    evaluation) the cap, the mask, the shift and the exp are written over the product: one tensor of N
    columns a row instead of four. (With autograd,
    writing over a view of the product would make its backward copy the whole band.)"""
    batch, kv_heads, blocks, rows, _ = q_blocks.shape
    x = ((q_blocks * scale) @ key_columns).view(batch, kv_heads, blocks, groups, rows // groups, -1)
    if x.requires_grad:
        x = soft_cap(x, softcap).masked_fill(~visible, float("-inf"))
        row_max = row_shift(x)
        return torch.exp(x - row_max), row_max
    row_max = row_shift(soft_cap(x, softcap, in_place=True).masked_fill_(~visible, float("-inf")))
    return x.sub_(row_max).exp_(), row_max


def _flash_band(q, keys, values, key_valid, scale, window, block) -> tuple[torch.Tensor, torch.Tensor]:
    """`banded_exp_attention` without saliencies through `flash_block_part` (see `flash_applies`)."""
    groups, length = q.shape[2], q.shape[3]
    blocks = -(-length // block)
    pad, span = blocks * block - length, block + window
    key_blocks = _windows(F.pad(keys, (0, 0, 0, pad)), 2, span, block).mT  # [B, Hkv, blocks, C + W, D]
    value_blocks = _windows(F.pad(values, (0, 0, 0, pad)), 2, span, block).mT
    visible = _band_mask(key_valid, window, block, blocks)
    numerator, shift = flash_block_part(query_blocks(q, blocks, block), key_blocks, value_blocks, visible, scale)
    return per_query(numerator, groups, length), per_query(finite_or_zero(shift), groups, length)  # (as row_shift)


def flash_applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `flash_block_part` can compute a block part of these inputs: on a CPU, eager, with values
    one column (the weight column) wider than the keys, as the kernel reads values of the keys' width, and
    a weight column of ones and zeros, zero only on rows that are zero throughout (as `ops.attention`
    builds it: 0 at padding and for a sink on its way to the finite state), so that a row of weight 0 is
    a row left out. With autograd the weight column takes no gradient (it is the padding mask), and only
    blocks of at least `FLASH_MIN_KEYS_WITH_AUTOGRAD` keys take the kernel."""
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, keys, values))
    if not (
        q.device.type == "cpu"
        and not (training and keys.shape[-2] < FLASH_MIN_KEYS_WITH_AUTOGRAD)
        and not torch.compiler.is_compiling()  # (compiled, the block forms fuse; the weight check is data-dependent)
        and values.shape[-1] == keys.shape[-1] + 1
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    ):
        return False
    weight = values[..., -1].detach()
    return bool(((weight == 1) | ((weight == 0) & ~values[..., :-1].detach().any(-1))).all())


def flash_block_part(
    q_blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block part through PyTorch's fused CPU flash-attention kernel, forward and backward (`_FlashPart`;
    `flash_applies`).

    Args:
        q_blocks: `[B, Hkv, blocks, G * C, D]` (`query_blocks`).
        keys, values: `[B, Hkv, blocks, N, D]` and `[B, Hkv, blocks, N, D + 1]`: each block's own keys and
            augmented values, whose last (weight) column is 1 or 0, 0 only on rows that are 0 throughout
            (those rows are left out).
        visible: bool, `[B, 1 or Hkv, blocks, C, N]`: key j is visible to the block's query row c (the same
            for the G query heads of a KV head).
        scale: multiplier of q.k.

    Returns:
        (`[B, Hkv, blocks, G * C, D + 1]` numerator, `[B, Hkv, blocks, G * C, 1]` shift): the numerator under
        the shift lse = log sum exp(x) of each row, so [softmax(x) v, 1]; a row that sees no key has numerator
        0 and shift -inf, as `masked_exp_part` has it.
    """
    batch, kv_heads, blocks, rows, head_dim = q_blocks.shape
    block, width = visible.shape[-2], keys.shape[-2]
    groups = rows // block
    flat = batch * kv_heads * blocks
    visible = visible & (values[..., -1] != 0)[..., None, :]  # [B, Hkv, blocks, C, N]
    seen = visible.any(-1)  # [B, Hkv, blocks, C]
    # (a row that sees nothing is scored over every key, then zeroed: a row of -inf only would give NaN)
    hidden = ~(visible | ~seen[..., None])
    mask = torch.zeros(hidden.shape, dtype=q_blocks.dtype, device=q_blocks.device).masked_fill_(hidden, -torch.inf)
    seen = seen[:, :, :, None].expand(batch, kv_heads, blocks, groups, block).reshape(flat, groups, block, 1)
    numerator, lse = _FlashPart.apply(
        q_blocks.reshape(flat, groups, block, head_dim),
        keys.reshape(flat, 1, width, head_dim).expand(flat, groups, width, head_dim),
        values[..., :head_dim].reshape(flat, 1, width, head_dim).expand(flat, groups, width, head_dim),
        mask.view(flat, 1, block, width),
        seen,
        scale,
    )
    shift = lse.view(*q_blocks.shape[:-1], 1)
    return numerator.view(*q_blocks.shape[:-1], head_dim + 1), shift


class _FlashPart(torch.autograd.Function):
    """[softmax(x) v, 1] and the log-sum-exp of x = scale q.k + mask through the fused CPU kernel: the
    numerator sum_j e^{x_j - s} [v_j, 1] under the shift s = lse, taken (as every shift of the exact part)
    as a constant of the backward pass.

    With s constant, the numerator's gradient is that of (O, lse) = (softmax(x) v, lse) for dO = g_v and
    dlse = g_v . O + g_1 (g_v, g_1: the gradients of its value columns and its weight column). The kernel's
    backward takes dlse through the `out` it is given, which it reads only in delta = rowsum(dO * out):
    dS = P (dP - delta) + dlse P needs delta - dlse = -g_1 there, so it is given out = -g_1 dO / |dO|^2
    (0 where dO is 0; g_1 is then 0 too, both coming from the same output gradient). Rows with `seen`
    False are 0 with lse -inf and take no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, mask, seen, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        ctx.save_for_backward(q, k, v, mask, seen, out, lse)
        ctx.scale = scale
        numerator = torch.cat([out, seen.to(out.dtype)], dim=-1).masked_fill_(~seen, 0.0)
        shift = lse[..., None].masked_fill(~seen, -torch.inf)
        ctx.mark_non_differentiable(shift)
        return numerator, shift

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_numerator, _):
        q, k, v, mask, seen, out, lse = ctx.saved_tensors
        grad_numerator = grad_numerator.masked_fill(~seen, 0.0)
        grad_out, grad_weight = grad_numerator[..., :-1].contiguous(), grad_numerator[..., -1:]
        norm = grad_out.square().sum(-1, keepdim=True)
        delta_out = torch.where(norm > 0, -grad_weight / norm, 0.0) * grad_out
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, delta_out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale
        )
        return grad_q, grad_k, grad_v, None, None, None


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
    return _block_maxima(per_block, block, window, length)


def _block_maxima(per_block: torch.Tensor, block: int, window: int, length: int) -> torch.Tensor:
    """`[B, Hkv, W + L]` the largest of each key's values over the blocks that see it, from each block's
    `[B, Hkv, blocks, C + W]` (block b's column j is key b * C + j)."""
    batch, kv_heads, blocks, span = per_block.shape
    index = torch.arange(blocks, device=per_block.device)[:, None] * block + torch.arange(span, device=per_block.device)
    out = per_block.new_zeros(batch, kv_heads, blocks * block + window)
    out.scatter_reduce_(-1, index.flatten().expand(batch, kv_heads, -1), per_block.flatten(-2), "amax")
    return out[..., : window + length]


def masked_exp_part(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An exact part over a set of keys beside the window (sinks, kept keys): the sum over the visible
    keys of e^{x - m} [v, 1] and m.

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`; keys, values: `[B, Hkv, N, D]`, `[B, Hkv, N, Dv + 1]`.
        visible: bool, broadcastable to `[B, Hkv, G, L, N]`; scale: multiplier of q.k; softcap: the cap
            of the scores (`ops.kernels.soft_cap`), None for none.

    Returns:
        (`[B, Hkv, G, L, Dv + 1]` numerator, `[B, Hkv, G, L, 1]` row max m, detached; -inf where a query
        sees none of the keys), as `merge_exact` takes them.
    """
    x = soft_cap(grouped_matmul(q * scale, keys.mT), softcap).masked_fill(~visible, float("-inf"))
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

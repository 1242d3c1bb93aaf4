"""Exact causal softmax attention: SDPA fast path and a float64 reference.

Shapes: q `[B, H, Lq, D]`, k and v `[B, Hkv, Lk, D]` (grouped-query heads are never
repeated), key_mask `[B, Lk]` bool; queries are the last Lq positions. `window` W (sliding-window
softmax): each query sees only the keys fewer than W positions before it, by index. `softcap` c
(Gemma 2's `attn_logit_softcapping`): the scaled scores s become c tanh(s / c) before the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hf_softmax_rnn.ops.kernels import soft_cap
from hf_softmax_rnn.ops.parallel import visible_mask


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal (sliding-window) softmax through `scaled_dot_product_attention` -> `[B, H, Lq, Dv]`; with a
    `softcap`, through explicit scores, a block of queries at a time (`softcapped_softmax_attention`: SDPA
    cannot bend them).

    Query rows that see no position (left padding) return zeros instead of NaN.
    """
    query_len, key_len = q.shape[-2], k.shape[-2]
    if window is not None and window >= key_len:
        window = None
    if softcap is not None:
        return softcapped_softmax_attention(q, k, v, key_mask, scale, window, softcap)
    masked = key_mask is not None or query_len != key_len or window is not None
    k, v, enable_gqa = _grouped_kv_for_sdpa(q, k, v, masked=masked)
    if not masked:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if key_mask is None:
        key_mask = torch.ones(q.shape[0], key_len, dtype=torch.bool, device=q.device)
    visible = visible_mask(key_mask, query_len, window)[:, 0]
    row_sees_something = visible.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible | ~row_sees_something, scale=scale, enable_gqa=enable_gqa
    )
    return out * row_sees_something.to(out.dtype)


#: Queries per block of the soft-capped exact softmax (`softcapped_softmax_attention`).
SOFTCAP_QUERY_BLOCK = 128


def softcapped_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    window: int | None,
    softcap: float,
    block: int = SOFTCAP_QUERY_BLOCK,
) -> torch.Tensor:
    """Causal (sliding-window) softmax of the soft-capped scores softcap * tanh(scale q.k / softcap) ->
    `[B, H, Lq, Dv]`, `block` queries at a time: each block scores its C queries against the N keys they
    can see (up to its last query; with a window, from W - 1 before its first) as a `[B, Hkv, G, C, N]`
    matrix (grouped heads not repeated; softmax in float32 at least, as transformers' eager attention), so
    memory is O(C Lk), O(C (C + W)) with a window, never Lq x Lk. With autograd each block is recomputed
    in the backward pass (`torch.utils.checkpoint`) instead of kept, so the backward holds as little.
    Rows that see no position give zeros."""
    batch, heads, query_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[-2]
    if key_mask is None:
        key_mask = torch.ones(batch, key_len, dtype=torch.bool, device=q.device)
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, query_len, head_dim)
    offset = key_len - query_len  # (the queries are the last Lq positions)
    recompute = query_len > block and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for start in range(0, query_len, block):
        stop = min(start + block, query_len)
        first = 0 if window is None else max(0, offset + start - window + 1)
        keys = slice(first, offset + stop)
        inputs = (grouped_q[..., start:stop, :], k[..., keys, :], v[..., keys, :], key_mask[:, keys])
        arguments = (offset + start - first, scale, window, softcap)
        if recompute:
            outs.append(checkpoint(_capped_block, *inputs, *arguments, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(_capped_block(*inputs, *arguments))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.reshape(batch, heads, query_len, v.shape[-1])


def _capped_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor,
    first_query: int,
    scale: float,
    window: int | None,
    softcap: float,
) -> torch.Tensor:
    """`[B, Hkv, G, C, Dv]`: one block of `softcapped_softmax_attention`, grouped queries `[B, Hkv, G, C, D]` at
    positions `first_query` .. `first_query` + C - 1 of its keys k, v `[B, Hkv, N, D]` (key mask `[B, N]`)."""
    positions = torch.arange(k.shape[-2], device=q.device)
    queries = torch.arange(first_query, first_query + q.shape[-2], device=q.device)[:, None]
    visible = positions <= queries
    if window is not None:
        visible = visible & (positions > queries - window)
    visible = visible & key_mask[:, None, None, None, :]  # [B, 1, 1, C, N]
    scores = soft_cap((q @ k[:, :, None].transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).nan_to_num(0.0)
    return weights.to(v.dtype) @ v[:, :, None]


def _grouped_kv_for_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """K/V and `enable_gqa` for SDPA. On CUDA only the flash kernel (fp16/bf16, no mask) takes
    grouped heads; the memory-efficient kernel needs them repeated, which costs O(L d) where
    falling back to the math kernel would cost O(L^2). Elsewhere SDPA groups them itself."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, False
    if q.is_cuda and (masked or q.dtype not in (torch.float16, torch.bfloat16)):
        return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), False
    return k, v, True


def softmax_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The same in float64 with an explicit L x L matrix and repeated K/V (for tests)."""
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    if key_mask is None:
        key_mask = torch.ones(q.shape[0], k.shape[-2], dtype=torch.bool, device=q.device)
    visible = visible_mask(key_mask, q.shape[-2], window)[:, 0]
    scores = scale * q64 @ k64.transpose(-1, -2)
    scores = soft_cap(scores, softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v64).to(q.dtype)

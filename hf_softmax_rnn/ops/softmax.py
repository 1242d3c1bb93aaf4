"""Exact causal softmax attention: SDPA fast path and a float64 reference.

Shapes: q `[B, H, Lq, D]`, k and v `[B, Hkv, Lk, D]` (grouped-query heads are never
repeated), key_mask `[B, Lk]` bool; queries are the last Lq positions. `window` W (sliding-window
softmax): each query sees only the keys fewer than W positions before it, by index. `softcap` c
(Gemma 2's `attn_logit_softcapping`): the scaled scores s become c tanh(s / c) before the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    `softcap`, through explicit scores (`softcapped_softmax_attention`: SDPA cannot bend them).

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


def softcapped_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    window: int | None,
    softcap: float,
) -> torch.Tensor:
    """Causal (sliding-window) softmax of the soft-capped scores softcap * tanh(scale q.k / softcap), with an
    explicit `[B, Hkv, G, Lq, Lk]` score matrix (grouped heads not repeated; softmax in float32 at least, as
    transformers' eager attention) -> `[B, H, Lq, Dv]`; rows that see no position give zeros."""
    batch, heads, query_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[-2]
    if key_mask is None:
        key_mask = torch.ones(batch, key_len, dtype=torch.bool, device=q.device)
    visible = visible_mask(key_mask, query_len, window)  # [B, 1, 1, Lq, Lk]
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, query_len, head_dim)
    scores = (grouped_q @ k[:, :, None].transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).nan_to_num(0.0)
    out = weights.to(v.dtype) @ v[:, :, None]
    return out.reshape(batch, heads, query_len, v.shape[-1])


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
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v64).to(q.dtype)

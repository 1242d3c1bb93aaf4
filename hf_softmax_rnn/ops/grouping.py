"""Grouped-query products without materialising repeated key/value heads."""

from __future__ import annotations

import torch


def grouped_matmul(grouped: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, G, M, K] @ [B, Hkv, K, N] -> [B, Hkv, G, M, N]`.

    The G query heads of a KV head are stacked along M, so the KV-side operand is read
    once instead of being broadcast (and copied) G times.
    """
    batch, kv_heads, groups, rows, inner = grouped.shape
    out = grouped.reshape(batch, kv_heads, groups * rows, inner) @ shared
    return out.view(batch, kv_heads, groups, rows, shared.shape[-1])

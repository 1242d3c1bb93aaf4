"""Grouped-query products without materialising repeated key/value heads."""

from __future__ import annotations

import torch


def grouped_matmul(grouped: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, G, M, K] @ [B, Hkv, K, N] -> [B, Hkv, G, M, N]`.

    The G query heads of a KV head are stacked along M, so the KV-side operand is read
    once instead of being broadcast (and copied) G times. One `bmm` over the B * Hkv pairs: fewer
    dispatches than `matmul`, which expands and reshapes both operands first (on a CPU, and on a GPU
    without CUDA graphs, a decoding step costs about one dispatch per operation).
    """
    batch, kv_heads, groups, rows, inner = grouped.shape
    stacked = grouped.reshape(batch * kv_heads, groups * rows, inner)
    out = torch.bmm(stacked, shared.reshape(batch * kv_heads, *shared.shape[-2:]))
    return out.view(batch, kv_heads, groups, rows, shared.shape[-1])

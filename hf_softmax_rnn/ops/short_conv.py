"""A short causal depthwise convolution along positions (DeltaNet's short convolution of keys and values).

Each channel c of each head h becomes y_t = sum_j w[h, c, j] x_{t - K + 1 + j}, j = 0..K-1: a learned
combination of its last K positions, the current one weighted by the last tap. `tail` carries the
K - 1 inputs before the call, so that a sequence fed in pieces (prefill, then one position at a time)
gives what it gives whole. Padding positions read as zeros, so a left-padded row gives what the same
row gives unpadded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    batch, heads, length, channels = x.shape
    if weight.dim() != 3 or tuple(weight.shape[:2]) != (heads, channels) or weight.shape[2] < 2:
        raise ValueError(
            f"short_conv: weight has shape {tuple(weight.shape)}; expected [heads, channels, width >= 2] = "
            f"[{heads}, {channels}, K]"
        )
    expected_tail = (batch, heads, weight.shape[2] - 1, channels)
    if tail is not None and tuple(tail.shape) != expected_tail:
        raise ValueError(f"short_conv: tail has shape {tuple(tail.shape)}; expected {list(expected_tail)}")
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"short_conv: mask has shape {tuple(mask.shape)}; expected [{batch}, {length}]")


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[B, H, L, C]`, weight `[H, C, K]`, tail `[B, H, K - 1, C]` (the K - 1 inputs before x; None:
    zeros), mask `[B, L]` (False: padding, read as zero) -> (y `[B, H, L, C]`, the new tail
    `[B, H, K - 1, C]`, the last K - 1 inputs, padding zeroed)."""
    _check(x, weight, tail, mask)
    batch, heads, length, channels = x.shape
    width = weight.shape[2]
    if mask is not None:
        x = x * mask[:, None, :, None].to(x.dtype)
    if tail is None:
        tail = x.new_zeros(batch, heads, width - 1, channels)
    inputs = torch.cat([tail.to(x.dtype), x], dim=2)
    new_tail = inputs[:, :, -(width - 1) :]
    if length == 1:  # one decoding step: a dot product per channel is cheaper than a convolution call
        y = torch.einsum("bhkc,hck->bhc", inputs, weight.to(x.dtype)).unsqueeze(2)
        return y, new_tail
    flat = inputs.permute(0, 1, 3, 2).reshape(batch, heads * channels, length + width - 1)
    y = F.conv1d(flat, weight.to(x.dtype).reshape(heads * channels, 1, width), groups=heads * channels)
    return y.reshape(batch, heads, channels, length).permute(0, 1, 3, 2), new_tail


def short_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` as its definition, one position and one tap at a time in float64 (the reference)."""
    _check(x, weight, tail, mask)
    batch, heads, length, channels = x.shape
    width = weight.shape[2]
    x64, w64 = x.double(), weight.double()
    if mask is not None:
        x64 = torch.where(mask.bool()[:, None, :, None], x64, torch.zeros_like(x64))
    history = [x64.new_zeros(batch, heads, channels) for _ in range(width - 1)]
    if tail is not None:
        history = [tail[:, :, j].double() for j in range(width - 1)]
    outputs = []
    for t in range(length):
        history = [*history, x64[:, :, t]]
        outputs.append(sum(w64[:, :, j] * history[-width + j] for j in range(width)))
        history = history[1:]
    return torch.stack(outputs, dim=2).to(x.dtype), torch.stack(history, dim=2).to(x.dtype)

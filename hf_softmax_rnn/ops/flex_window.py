"""The exact part of a sliding-window hybrid through PyTorch's FlexAttention, and its log-space
combination with the finite-state part.

A hybrid layer scores the last W positions (the query's own included) and, optionally, the first
`sinks` visible positions with the exact exponential, and every other earlier position with the
finite-state kernel weighted by e^{lambda_h} (see `ops.window`). The exact part is ordinary
softmax attention under a mask, so a fused attention kernel computes it: `flex_window_attention`
returns its normalised output o_w and log-sum-exp l_w per row, and `combine_window_and_linear`
merges them with the finite-state numerator N and denominator G:

    y_t = (e^{l_w} o_w + e^{lambda} N) / (e^{l_w} + e^{lambda} G)

computed as the augmented numerator [o_w + c N, 1 + c G] with c = e^{lambda - l_w} (capped as in
`ops.window.mix_weight`): the same row divided by e^{l_w}, which the normalisers allowed with a
window ignore, so nothing overflows. A row that sees no exact key (padding) has l_w = -inf and
keeps only the finite-state part. Kept keys beside the window (`ops.kept`) are a second exact part,
merged with the window's under one row max first. A cap of the scores (`softcap`, Gemma 2's) is
FlexAttention's `score_mod`; the finite-state part is never capped.

`window_attention_reference` is the same (o_w, l_w) as a dense masked softmax, differentiable on
every device and in float64: the tests' reference, and the stand-in where FlexAttention has no
backward (CPU). Shapes: q `[B, H, L, D]`, k, v `[B, Hkv, L, D]` (H a multiple of Hkv), key_valid
`[B, L]` bool (False at padding, left padding), all positions of one call from the first.
"""

from __future__ import annotations

import functools
import importlib

import torch

from hf_softmax_rnn.ops.kernels import soft_cap
from hf_softmax_rnn.ops.window import MAX_MIX_EXPONENT, merge_exact


def first_visible(key_valid: torch.Tensor) -> torch.Tensor:
    """`[B]` long: the index of each row's first visible position (left padding: its padding count)."""
    return (~key_valid).long().sum(-1)


def exact_visibility(key_valid: torch.Tensor, window: int, sinks: int = 0) -> torch.Tensor:
    """`[B, L, L]` bool: key s is scored exactly by query t (causal, visible, and inside the last
    `window` positions or among the first `sinks` visible ones)."""
    length = key_valid.shape[-1]
    t = torch.arange(length, device=key_valid.device)[:, None]
    s = torch.arange(length, device=key_valid.device)[None, :]
    near = (s <= t) & (s > t - window)
    sink = (s[None] < first_visible(key_valid)[:, None, None] + sinks) & (s <= t)[None]
    return (near[None] | sink) & key_valid[:, None, :]


def window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    sinks: int = 0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_w `[B, H, L, Dv]`, l_w `[B, H, L]`) of the exact part as a dense masked softmax of the scores (bent
    by `softcap`, `ops.kernels.soft_cap`); o_w = 0 and l_w = -inf where a row sees no key. O(L^2) memory:
    tests and short calls."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    x = soft_cap(scale * q @ k.mT, softcap).masked_fill(
        ~exact_visibility(key_valid, window, sinks)[:, None], float("-inf")
    )
    lse = torch.logsumexp(x, dim=-1)
    weights = torch.exp(x - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return weights @ v, lse


def _mask_mod(key_valid: torch.Tensor, starts: torch.Tensor, window: int, sinks: int):
    """FlexAttention's mask: causal, visible, and (inside the window or a sink)."""

    def mask_mod(b, h, q_idx, kv_idx):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx < window)
        sink = (kv_idx < starts[b] + sinks) & (kv_idx <= q_idx)
        return (near | sink) & key_valid[b, kv_idx]

    return mask_mod


#: FlexAttention's default block size.
_BLOCK = 128


@functools.cache
def _flex_function(name: str, compiled: bool):
    """FlexAttention's `create_block_mask` or `flex_attention`, through `torch.compile` if `compiled`."""
    from torch.nn.attention import flex_attention as flex

    function = getattr(flex, name)
    return torch.compile(function, dynamic=False) if compiled else function


def flex_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int,
    sinks: int = 0,
    compiled: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_w `[B, H, L, Dv]` in q's dtype, l_w `[B, H, L]` float32) of the exact part through
    FlexAttention with a sliding-window (+ sinks) block mask: only the blocks along the band (and
    the sink columns) are computed. `compiled`: mask and attention through `torch.compile` (the
    fused kernel; CUDA); False runs FlexAttention's eager form (forward only on CPU). `softcap`: the
    cap of the scores as FlexAttention's `score_mod` (`_capped_scores`). Each new (shape, dtype, window,
    sinks, softcap) compiles once more."""
    batch, _, length, _ = q.shape
    # the kernel may evaluate the mask at indices past L in its last block: read False there
    readable = torch.nn.functional.pad(key_valid, (0, -length % _BLOCK + _BLOCK), value=False)
    mask_mod = _mask_mod(readable, first_visible(key_valid), window, sinks)
    block_mask = _flex_function("create_block_mask", compiled)(mask_mod, batch, None, length, length, device=q.device)
    attend = functools.partial(
        _flex_function("flex_attention", compiled),
        score_mod=None if softcap is None else _capped_scores(float(softcap)),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
    )
    aux_request = _aux_request()
    if aux_request is None:  # older PyTorch: the log-sum-exp through return_lse
        return attend(q, k, v, return_lse=True)
    out, aux = attend(q, k, v, return_aux=aux_request(lse=True))
    return out, aux.lse


@functools.cache
def _capped_scores(softcap: float):
    """FlexAttention's `score_mod` bending each scaled score s to softcap * tanh(s / softcap); one function per
    cap, so that the compiled kernel is reused."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


@functools.cache
def _aux_request():
    """FlexAttention's `AuxRequest` where this PyTorch has it (`return_lse` is deprecated there), or None."""
    return getattr(importlib.import_module("torch.nn.attention.flex_attention"), "AuxRequest", None)


def combine_window_and_linear(
    window_out: torch.Tensor,
    window_lse: torch.Tensor,
    linear: torch.Tensor,
    log_scale: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The augmented numerator [o_w + c N, 1 + c G] `[B, H, L, Dv + 1]` with c = e^{lambda_h - l_w}
    (capped), i.e. the hybrid's numerator and denominator divided by e^{l_w} per row.

    Args:
        window_out, window_lse: o_w `[B, H, L, Dv]` and l_w `[B, H, L]` of the exact part.
        linear: the finite-state part's augmented numerator [N, G] `[B, H, L, Dv + 1]`.
        log_scale: lambda `[H]`, the log weight of the finite-state part.
        kept: another exact part (the kept keys, `ops.kept`): its numerator `[B, H, L, Dv + 1]` and row
            max `[B, H, L, 1]` (-inf where a row has none), merged with the window's under one row max m
            (`ops.window.merge_exact`), which then takes the place of l_w in c.
    """
    finite = window_lse > float("-inf")  # l_w is finite, or -inf where a row sees no exact key
    shift = torch.where(finite, window_lse, 0.0)[..., None]
    exact = torch.cat([window_out, finite[..., None].to(window_out.dtype)], dim=-1)
    if kept is not None:
        exact, shift = merge_exact(exact.to(linear.dtype), shift.to(linear.dtype), *kept)
    exponent = (log_scale.to(shift.dtype)[:, None, None] - shift).clamp_max(MAX_MIX_EXPONENT)
    return torch.addcmul(exact, torch.exp(exponent).to(linear.dtype), linear)  # in linear's dtype, one pass

"""Normalisers: how the numerator N_t = sum_s a_ts v_s becomes the output (see docs/design.md).

All functions work per query head over the value dimension:
numerator `[B, H, L, Dv]`, denominator G_t `[B, H, L]`, visible count t `[B, 1, L]` (long).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.kernels import AttentionParams

#: Added to the detached denominator by the "detach_eps" normaliser (the authors' value).
DETACH_EPS = 1e-4


def _safe(denominator: torch.Tensor) -> torch.Tensor:
    """Rows that see no position (left padding) have G = 0 and N = 0: divide by 1 there."""
    return denominator.masked_fill(denominator == 0, 1.0)


def _over(n: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """n `[..., Dv]` / g `[...]` as a product with 1 / g: its backward makes two passes over n's size,
    where a division's makes four."""
    return n * torch.reciprocal(g).unsqueeze(-1)


def _unit_rows(n: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(n / s, eps / s^2) with s the largest |n| of each row (1 for a row of zeros): the norms below square
    n / s, whose entries are at most 1, so that a row of numerators beyond 1e19 (a window hybrid's finite part
    under its capped weight, float32) cannot overflow its square. s is detached: n * rsqrt(|n|^2 + eps) is
    the same function of n for every s > 0."""
    scale = n.detach().abs().amax(-1, keepdim=True)
    scale = scale.masked_fill(scale == 0, 1.0)
    return n / scale, eps / scale.pow(2)


def _l2(n: torch.Tensor, eps: float) -> torch.Tensor:
    unit, unit_eps = _unit_rows(n, eps)
    return unit * torch.rsqrt(unit.pow(2).sum(-1, keepdim=True) + unit_eps)


def _rms(n: torch.Tensor, eps: float, params: AttentionParams) -> torch.Tensor:
    unit, unit_eps = _unit_rows(n, eps)
    out = unit * torch.rsqrt(unit.pow(2).mean(-1, keepdim=True) + unit_eps)
    weight = params.norm_weight
    return out if weight is None else out * weight[:, None, :].to(out.dtype)


def _layer(n: torch.Tensor, eps: float, params: AttentionParams) -> torch.Tensor:
    unit, unit_eps = _unit_rows(n - n.mean(-1, keepdim=True), eps)
    out = unit * torch.rsqrt(unit.pow(2).mean(-1, keepdim=True) + unit_eps)
    weight, bias = params.norm_weight, params.norm_bias
    if weight is not None:
        out = out * weight[:, None, :].to(out.dtype)
    if bias is not None:
        out = out + bias[:, None, :].to(out.dtype)
    return out


def _per_position(t: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """max(t, 1) `[B, 1, L, 1]` in n's dtype, from the visible counts `[B, 1, L]` (long)."""
    return t.clamp_min(1).unsqueeze(-1).to(n.dtype)


def _at_least_one(g: torch.Tensor, unit: torch.Tensor | None) -> torch.Tensor:
    """max(G, 1), where `unit` is what 1 became when the scores were divided by e^shift."""
    return g.clamp_min(1.0) if unit is None else torch.maximum(g, unit)


def _plus_eps(g: torch.Tensor, unit: torch.Tensor | None) -> torch.Tensor:
    return g + (DETACH_EPS if unit is None else DETACH_EPS * unit)


NormalizerFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, AttentionParams, "torch.Tensor | None"], torch.Tensor
]

_NORMALIZERS: dict[str, NormalizerFn] = {
    "softmax": lambda n, g, t, eps, p, u: _over(n, _safe(g)),
    "l2": lambda n, g, t, eps, p, u: _l2(n, eps),
    "rms": lambda n, g, t, eps, p, u: _rms(n, eps, p),
    "layer": lambda n, g, t, eps, p, u: _layer(n, eps, p),
    "seqlen": lambda n, g, t, eps, p, u: n / _per_position(t, n),
    "seqlen_rms": lambda n, g, t, eps, p, u: _rms(n / _per_position(t, n), eps, p),
    "seqlen_layer": lambda n, g, t, eps, p, u: _layer(n / _per_position(t, n), eps, p),
    "seqlen_pow": lambda n, g, t, eps, p, u: (
        n / _per_position(t, n).pow(torch.sigmoid(p.seqlen_power).to(n.dtype)[:, None, None])
    ),
    "clamp": lambda n, g, t, eps, p, u: _over(n, _at_least_one(g, u)),
    "detach": lambda n, g, t, eps, p, u: _over(n, _at_least_one(g.detach(), u)),
    "detach_eps": lambda n, g, t, eps, p, u: _over(n, _plus_eps(g.detach(), u)),
    "none": lambda n, g, t, eps, p, u: n,
}


def normalize(
    numerator: torch.Tensor,
    denominator: torch.Tensor,
    visible: torch.Tensor,
    spec: AttentionSpec,
    params: AttentionParams,
    output_gate: torch.Tensor | None = None,
    log_shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply the spec's normaliser, and its output gate `[B, H, L]` before or after it.

    numerator `[B, H, L, Dv]`, denominator `[B, H, L]`, visible `[B, 1, L]` -> `[B, H, L, Dv]`.
    `log_shift` `[B, H, L]`: the scores were divided by e^log_shift (so that exp cannot overflow);
    the clamp and eps of the denominator normalisers are divided alike.
    """
    unit = None if log_shift is None else torch.exp(-log_shift).to(denominator.dtype)
    if output_gate is not None and spec.output_gate_position == "before_norm":
        gate = output_gate.unsqueeze(-1).to(numerator.dtype)
        numerator, denominator = numerator * gate, denominator * output_gate.to(denominator.dtype)
    normalizer = _NORMALIZERS[spec.normalizer]
    out = normalizer(numerator, denominator, visible, spec.norm_eps, params, unit)
    if output_gate is not None and spec.output_gate_position == "after_norm":
        out = out * output_gate.unsqueeze(-1).to(out.dtype)
    return out

"""The kernel object every attention path uses, and the learned tensors it is built from.

An attention variant scores a query against a key with a kernel k(q, s): exp(x) (exact, no
finite state) or phi(q).phi(s) for a feature map phi (linear maps, Taylor-N). `build_kernel`
(in `ops.feature_maps`) makes one kernel per call from the spec, the q.k scale and the
learned tensors; the parallel, chunked and recurrent paths then only call its methods:

- `ExpKernel`: exact exp, parallel form only (optionally clamped, optionally shifted by the
  row max where the normaliser ignores a per-row factor).
- `FeatureKernel` subclasses: `query_features` / `key_features` (recurrent path, and the
  features of a whole call for the chunked engine), `scores` (parallel form and the autograd
  chunk loops). The engine of `ops.chunked` computes the features of a whole call and
  sends their gradients back through the map with autograd (`learned` / `with_learned` hand it the
  map's tensors so that they receive gradients); kernels with `hand_written = True` (Taylor) also
  implement the `chunk_*` methods with which it rebuilds wide features chunk by chunk instead.

Shapes: grouped queries `[B, Hkv, G, L, D]`, keys `[B, Hkv, L, D]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_softmax_rnn.ops.grouping import grouped_matmul


@dataclass(frozen=True)
class AttentionParams:
    """The learned tensors of one attention layer that the ops read (None = not used).

    norm_weight, norm_bias `[H, Dv]`: rms / layer normalisers. seqlen_power `[H]`: the logit of
    the exponent of the seqlen_pow normaliser. hedgehog_q `[H, D, F]`, hedgehog_k `[Hkv, D, F]`:
    the hedgehog feature maps. linear_log_scale `[H]`: with a sliding window, the log weight of
    the finite-state part (keys older than the window) against the exact window.
    """

    norm_weight: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    seqlen_power: torch.Tensor | None = None
    hedgehog_q: torch.Tensor | None = None
    hedgehog_k: torch.Tensor | None = None
    linear_log_scale: torch.Tensor | None = None


#: How exact exp is shifted per row: by the row max where the normaliser ignores a per-row factor,
#: by max(row max, 0) where it clamps or pads the denominator in the scores' own units (the normaliser
#: is told the shift), not at all where the result itself grows with exp (seqlen, none).
EXP_SHIFTS = ("row_max", "positive_row_max", None)


def row_shift(x: torch.Tensor) -> torch.Tensor:
    """The detached row max of masked log-scores `x` (`-inf` where masked) `[..., 1]`; 0 for a row
    with nothing visible, so that exp(x - shift) never overflows and never gives NaN."""
    return finite_or_zero(x.detach().amax(-1, keepdim=True))  # (no autograd node keeping x)


def soft_cap(x: torch.Tensor, softcap: float | None, in_place: bool = False) -> torch.Tensor:
    """Scaled exact scores `x` bent to softcap * tanh(x / softcap) (Gemma 2's `attn_logit_softcapping`), or `x`
    itself where `softcap` is None; `in_place`: written over `x` (no autograd)."""
    if softcap is None:
        return x
    if in_place:
        return x.div_(softcap).tanh_().mul_(softcap)
    return torch.tanh(x / softcap) * softcap


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """`x` with 0 where it is not finite (one operation; `torch.isfinite` and `where` take six on a GPU).
    For values without a gradient: its backward is `isfinite`'s passes again."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


class ExpKernel:
    """exp(min(x, clamp)) with x = scale * q.k, divided per row by e^shift (see `EXP_SHIFTS`)."""

    def __init__(self, scale: float, clamp: float | None, shift: str | None) -> None:
        self.scale, self.clamp, self.shift = scale, clamp, shift

    def masked_scores(
        self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scores / e^shift `[B, Hkv, G, Lq, Lk]`, zero where `visible` (broadcastable bool) is
        False; the shift `[B, Hkv, G, Lq]`, or None when not shifted)."""
        x = grouped_matmul(q * self.scale, k.mT)  # (q scaled: D wide, not Lk)
        if self.clamp is not None:
            x = x.clamp_max(self.clamp)
        x = x.masked_fill(~visible, float("-inf"))
        if self.shift is None:
            return torch.exp(x), None
        row_max = row_shift(x)
        if self.shift == "positive_row_max":
            row_max = row_max.clamp_min(0.0)
        return torch.exp(x - row_max), row_max.squeeze(-1)


class FeatureKernel:
    """k(q, s) = phi(q).phi(s) with the scale folded into the query side (subclasses say how)."""

    hand_written = False
    learned: tuple[torch.Tensor, ...] = ()

    def __init__(self, scale: float, clamp: float | None = None) -> None:
        self.scale, self.clamp = scale, clamp

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        """phi(q) `[B, Hkv, G, L, D] -> [B, Hkv, G, L, F]`, times the scale."""
        raise NotImplementedError

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        """phi(k) `[B, Hkv, L, D] -> [B, Hkv, L, F]`."""
        raise NotImplementedError

    def query_features_and_factor(self, q: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(phi(q) / c, c) with (phi(q) / c) * c = `query_features(q)`: a caller that multiplies by c later
        (a fused kernel's own scale) saves a pass over the features. c = 1 unless a kernel says otherwise."""
        return self.query_features(q), 1.0

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Unmasked, unclamped k(q_t, k_s) `[B, Hkv, G, Lq, Lk]`."""
        return grouped_matmul(self.query_features(q), self.key_features(k).mT)

    def masked_scores(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, None]:
        """(scores, clamped and zero where not `visible`; None: never shifted)."""
        scores = self.scores(q, k)
        if self.clamp is not None:
            scores = scores.clamp_max(self.clamp)
        return scores.masked_fill(~visible, 0.0), None

    def with_learned(self, *tensors: torch.Tensor) -> FeatureKernel:
        """The same kernel reading `tensors` in place of `self.learned` (autograd leaves)."""
        return self

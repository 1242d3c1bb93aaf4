"""The kernel object every attention path uses, and the learned tensors it is built from.

An attention variant scores a query against a key with a kernel k(q, s): exp(x) (exact, no
finite state) or phi(q).phi(s) for a feature map phi (linear maps, Taylor-N). `build_kernel`
(in `ops.feature_maps`) makes one kernel per call from the spec, the q.k scale and the
learned tensors; the parallel, chunked and recurrent paths then only call its methods:

- `ExpKernel`: exact exp, parallel form only (optionally clamped, optionally shifted by the
  row max where the normaliser ignores a per-row factor).
- `FeatureKernel` subclasses: `query_features` / `key_features` (recurrent and generic chunked
  paths), `scores` (parallel form and the generic chunked path). Kernels with
  `hand_written = True` also implement the `chunk_*` methods the hand-written engine of
  `ops.chunked` runs; the others go through autograd (`ops.linear`), and `learned` /
  `with_learned` hand their tensors to it so that they receive gradients.

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


class ExpKernel:
    """exp(min(x, clamp)) with x = scale * q.k, computed as exp(x - rowmax) when `shift_rows`."""

    has_features = False

    def __init__(self, scale: float, clamp: float | None, shift_rows: bool) -> None:
        self.scale, self.clamp, self.shift_rows = scale, clamp, shift_rows

    def masked_scores(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Scores `[B, Hkv, G, Lq, Lk]`, zero where `visible` (broadcastable bool) is False."""
        x = self.scale * grouped_matmul(q, k.mT)
        if self.clamp is not None:
            x = x.clamp_max(self.clamp)
        x = x.masked_fill(~visible, float("-inf"))
        if self.shift_rows:
            row_max = x.amax(-1, keepdim=True).detach()
            x = x - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        return torch.exp(x)


class FeatureKernel:
    """k(q, s) = phi(q).phi(s) with the scale folded into the query side (subclasses say how)."""

    has_features = True
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

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Unmasked, unclamped k(q_t, k_s) `[B, Hkv, G, Lq, Lk]`."""
        return grouped_matmul(self.query_features(q), self.key_features(k).mT)

    def masked_scores(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        scores = self.scores(q, k)
        if self.clamp is not None:
            scores = scores.clamp_max(self.clamp)
        return scores.masked_fill(~visible, 0.0)

    def with_learned(self, *tensors: torch.Tensor) -> FeatureKernel:
        """The same kernel reading `tensors` in place of `self.learned` (autograd leaves)."""
        return self

"""Feature maps phi and kernels k(q, k) = phi(q).phi(k) of the finite-state attention variants.

Shapes: queries arrive grouped as `[B, Hkv, G, L, D]` (G query heads per KV head) and
keys as `[B, Hkv, L, D]`; learned per-head weights broadcast against those layouts
(`hedgehog_q` as `[Hkv, G, D, F]`, `hedgehog_k` as `[Hkv, D, F]`).

The Taylor feature map lives in `ops.taylor`. `chunk_kernel` hands the Taylor and elementwise
maps to the hand-written chunked engine (`ops.chunked`); cosine and hedgehog take the generic
chunked path through autograd (`ops.linear`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.chunked import ChunkKernel, Scratch
from hf_softmax_rnn.ops.taylor import TaylorKernel, taylor_exp, taylor_features


def _hedgehog(x: torch.Tensor, spec: AttentionSpec, weight: torch.Tensor | None) -> torch.Tensor:
    """softmax over [xW, -xW] with a learned per-head W `[..., D, F]` (LoLCATs / Hedgehog)."""
    if weight is None:
        raise ValueError("feature_map='hedgehog' needs its learned weights (params['hedgehog_q'/'hedgehog_k'])")
    projected = x @ weight.to(x.dtype)
    return torch.cat([torch.softmax(projected, dim=-1), torch.softmax(-projected, dim=-1)], dim=-1)


FeatureMapFn = Callable[[torch.Tensor, AttentionSpec, "torch.Tensor | None"], torch.Tensor]

ElementwiseFn = Callable[[torch.Tensor], torch.Tensor]

#: name -> (phi, d phi / dx) for the elementwise maps, which the hand-written chunked engine runs.
_ELEMENTWISE_MAPS: dict[str, tuple[ElementwiseFn, ElementwiseFn]] = {
    "identity": (lambda x: x.clone(), torch.ones_like),
    "elu": (lambda x: F.elu(x) + 1.0, lambda x: torch.where(x > 0, 1.0, x.exp())),
    "relu": (F.relu, lambda x: (x > 0).to(x.dtype)),
}


def _ignoring_spec(function: ElementwiseFn) -> FeatureMapFn:
    return lambda x, spec, weight: function(x)


#: name -> phi(x, spec, learned weight) for the maps whose kernel is phi(q).phi(k) times the scale.
_PLAIN_FEATURE_MAPS: dict[str, FeatureMapFn] = {
    **{name: _ignoring_spec(function) for name, (function, _) in _ELEMENTWISE_MAPS.items()},
    "cosine": lambda x, spec, weight: F.normalize(x, dim=-1, eps=spec.norm_eps),
    "hedgehog": _hedgehog,
}


class ElementwiseKernel:
    """phi(q).phi(k) for an elementwise map (identity, elu, relu) in `ops.chunked`, the scale
    folded into the query side as in `feature_map`."""

    def __init__(self, name: str, scale: float) -> None:
        self.function, self.derivative = _ELEMENTWISE_MAPS[name]
        self.scale = scale

    def features(self, x: torch.Tensor, scratch: Scratch, query: bool) -> torch.Tensor:
        rows = scratch("rows", (x.shape[0], x.shape[2], x.shape[1]), x)
        rows.copy_(x.mT)
        phi = self.function(rows)
        return phi.mul_(self.scale) if query else phi

    def features_backward(self, grad: torch.Tensor, scratch: Scratch, query: bool) -> torch.Tensor:
        grad_x = grad * self.derivative(scratch.get("rows"))
        return (grad_x.mul_(self.scale) if query else grad_x).mT

    def scores(self, q, k, phi_q, phi_k, scratch: Scratch) -> torch.Tensor:
        return torch.bmm(phi_q.mT, phi_k, out=scratch("scores", (q.shape[0], q.shape[1], k.shape[1]), q))

    def scores_backward(self, d_scores, q, k, phi_q, phi_k, scratch: Scratch):
        return None, None, phi_k @ d_scores.mT, phi_q @ d_scores


def chunk_kernel(spec: AttentionSpec, scale: float) -> ChunkKernel | None:
    """The kernel of `spec` for the hand-written chunked engine, or None for the maps that take
    the generic autograd path (cosine, hedgehog)."""
    name = spec.effective_feature_map
    if name == "taylor":
        return TaylorKernel(spec.taylor_order, scale)
    if name in _ELEMENTWISE_MAPS:
        return ElementwiseKernel(name, scale)
    return None


def feature_map(
    x: torch.Tensor,
    spec: AttentionSpec,
    scale: float,
    weight: torch.Tensor | None = None,
    is_query: bool = False,
) -> torch.Tensor:
    """phi(x) for a finite-state spec; the kernel's scale is folded into the query side
    (into both sides, as scale^(1/2), for Taylor features so they stay a power series)."""
    name = spec.effective_feature_map
    if name == "taylor":
        return taylor_features(x * math.sqrt(scale), spec.taylor_order)
    if name not in _PLAIN_FEATURE_MAPS:
        raise ValueError(f"{spec.describe()} has no finite feature map; expected one of {['taylor', *_PLAIN_FEATURE_MAPS]}")
    phi = _PLAIN_FEATURE_MAPS[name](x, spec, weight)
    return phi * scale if is_query else phi


def query_features(q: torch.Tensor, spec: AttentionSpec, scale: float, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """phi(q) for grouped queries `[B, Hkv, G, L, D] -> [B, Hkv, G, L, F]`."""
    weight = params.get("hedgehog_q")
    if weight is not None:
        weight = weight.view(q.shape[1], q.shape[2], *weight.shape[1:])
    return feature_map(q, spec, scale, weight, is_query=True)


def key_features(k: torch.Tensor, spec: AttentionSpec, scale: float, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """phi(k) for keys `[B, Hkv, L, D] -> [B, Hkv, L, F]`."""
    return feature_map(k, spec, scale, params.get("hedgehog_k"))


def kernel_scores(
    q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, scale: float, params: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Unnormalised, unmasked, unclamped scores of a finite kernel: grouped q `[B, Hkv, G, Lq, D]`,
    k `[B, Hkv, Lk, D]` -> `[B, Hkv, G, Lq, Lk]`. Taylor kernels use the polynomial of q.k
    directly (D work per pair instead of the feature width)."""
    if spec.effective_feature_map == "taylor":
        return taylor_exp(scale * grouped_matmul(q, k.transpose(-1, -2)), spec.taylor_order)
    phi_q = query_features(q, spec, scale, params)
    phi_k = key_features(k, spec, scale, params)
    return grouped_matmul(phi_q, phi_k.transpose(-1, -2))

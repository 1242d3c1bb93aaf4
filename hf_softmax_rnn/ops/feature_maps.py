"""Feature maps phi and kernels k(q, k) = phi(q).phi(k) of the finite-state attention variants.

Shapes: queries arrive grouped as `[B, Hkv, G, L, D]` (G query heads per KV head) and
keys as `[B, Hkv, L, D]`; learned per-head weights broadcast against those layouts
(`hedgehog_q` as `[Hkv, G, D, F]`, `hedgehog_k` as `[Hkv, D, F]`).

The Taylor feature map phi_N(x) = [x^alpha / sqrt(alpha!)]_{|alpha| <= N} lives in the
symmetric monomial basis: phi_N(q).phi_N(k) = sum_{n<=N} (q.k)^n / n! with
C(d+n-1, n) features per order instead of d^n.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.grouping import grouped_matmul


@functools.lru_cache(maxsize=32)
def _monomial_recursion(head_dim: int, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How to build the order-n monomials from the order-(n-1) ones, n >= 2.

    Monomials x^alpha are indexed by sorted index tuples. Order n is the flattened outer
    product (order n-1) x (x_j) restricted to j >= the tuple's last index: returns that
    selection `[C(d+n-1, n)]` into the `C(d+n-2, n-1) * d` products, and the weights
    1/sqrt(alpha!) of the order-n monomials.
    """
    parents = list(itertools.combinations_with_replacement(range(head_dim), order - 1))
    selection, weight = [], []
    for parent_index, parent in enumerate(parents):
        for j in range(parent[-1], head_dim):
            combo = (*parent, j)
            selection.append(parent_index * head_dim + j)
            multiplicities = [len(list(group)) for _, group in itertools.groupby(combo)]
            weight.append(1.0 / math.sqrt(math.prod(math.factorial(m) for m in multiplicities)))
    return torch.tensor(selection, dtype=torch.long), torch.tensor(weight, dtype=torch.float64)


def taylor_features(x: torch.Tensor, order: int) -> torch.Tensor:
    """phi_N(x): `[..., D] -> [..., sum_n C(D+n-1, n)]`, orders 0..N concatenated."""
    head_dim = x.shape[-1]
    parts = [x.new_ones(*x.shape[:-1], 1)]
    monomials = x
    if order >= 1:
        parts.append(x)
    for n in range(2, order + 1):
        selection, weight = _monomial_recursion(head_dim, n)
        products = (monomials.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)
        monomials = products.index_select(-1, selection.to(x.device))
        parts.append(monomials * weight.to(device=x.device, dtype=x.dtype))
    return torch.cat(parts, dim=-1)


def taylor_exp(x: torch.Tensor, order: int) -> torch.Tensor:
    """sum_{n<=N} x^n / n! by Horner's rule (elementwise)."""
    result = torch.full_like(x, 1.0 / math.factorial(order))
    for n in range(order - 1, -1, -1):
        result = result * x + 1.0 / math.factorial(n)
    return result


def _hedgehog(x: torch.Tensor, spec: AttentionSpec, weight: torch.Tensor | None) -> torch.Tensor:
    """softmax over [xW, -xW] with a learned per-head W `[..., D, F]` (LoLCATs / Hedgehog)."""
    if weight is None:
        raise ValueError("feature_map='hedgehog' needs its learned weights (params['hedgehog_q'/'hedgehog_k'])")
    projected = x @ weight.to(x.dtype)
    return torch.cat([torch.softmax(projected, dim=-1), torch.softmax(-projected, dim=-1)], dim=-1)


FeatureMapFn = Callable[[torch.Tensor, AttentionSpec, "torch.Tensor | None"], torch.Tensor]

#: name -> phi(x, spec, learned weight) for the maps whose kernel is phi(q).phi(k) times the scale.
_PLAIN_FEATURE_MAPS: dict[str, FeatureMapFn] = {
    "identity": lambda x, spec, weight: x,
    "elu": lambda x, spec, weight: F.elu(x) + 1.0,
    "relu": lambda x, spec, weight: F.relu(x),
    "cosine": lambda x, spec, weight: F.normalize(x, dim=-1, eps=spec.norm_eps),
    "hedgehog": _hedgehog,
}


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

"""Feature maps phi and kernels k(q, k) = phi(q).phi(k) of the finite-state attention variants.

Shapes: queries arrive grouped as `[B, Hkv, G, L, D]` (G query heads per KV head) and
keys as `[B, Hkv, L, D]`; learned per-head weights broadcast against those layouts
(`hedgehog_q` as `[Hkv, G, D, F]`, `hedgehog_k` as `[Hkv, D, F]`).

The Taylor feature map phi_N(x) = [x^alpha / sqrt(alpha!)]_{|alpha| <= N} lives in the
symmetric monomial basis: phi_N(q).phi_N(k) = sum_{n<=N} (q.k)^n / n! with
C(d+n-1, n) features per order instead of d^n.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.grouping import grouped_matmul


@functools.lru_cache(maxsize=32)
def _colex_monomials(head_dim: int, order: int) -> tuple[tuple[int, ...], ...]:
    """The order-n monomials x^alpha as sorted index tuples in colex order (by last index, then
    recursively by the rest): those ending at index <= j are a prefix of the list."""
    if order == 1:
        return tuple((i,) for i in range(head_dim))
    parents = _colex_monomials(head_dim, order - 1)
    return tuple((*parent, j) for j in range(head_dim) for parent in parents if parent[-1] <= j)


@functools.lru_cache(maxsize=32)
def _monomial_prefixes(head_dim: int, order: int) -> tuple[int, ...]:
    """Order-n monomials (n >= 2) without a gather: block j is (the first `prefix[j]` order-(n-1)
    monomials) * x_j, since those are the ones ending at an index <= j."""
    parent_last = [parent[-1] for parent in _colex_monomials(head_dim, order - 1)]
    return tuple(bisect.bisect_right(parent_last, j) for j in range(head_dim))


@functools.lru_cache(maxsize=32)
def _taylor_weights(head_dim: int, order: int) -> torch.Tensor:
    """1/sqrt(alpha!) for every feature of phi_N, orders 0..N `[F]` (float64)."""
    weights = [1.0] * (1 + head_dim * (order >= 1))
    for n in range(2, order + 1):
        weights += [
            1.0 / math.sqrt(math.prod(math.factorial(len(list(group))) for _, group in itertools.groupby(combo)))
            for combo in _colex_monomials(head_dim, n)
        ]
    return torch.tensor(weights, dtype=torch.float64)


@functools.lru_cache(maxsize=32)
def _monomial_selection(head_dim: int, order: int) -> torch.Tensor:
    """The same order-n monomials as one gather from the flattened products (order n-1) x x `[C(d+n-1, n)]`."""
    prefix = _monomial_prefixes(head_dim, order)
    return torch.tensor([parent * head_dim + j for j in range(head_dim) for parent in range(prefix[j])])


def taylor_features(x: torch.Tensor, order: int, *, gather: bool | None = None) -> torch.Tensor:
    """phi_N(x): `[..., D] -> [..., sum_n C(D+n-1, n)]`, orders 0..N concatenated (each in colex order).

    Each order is built from the previous one either by D contiguous block products (fast on
    CPU) or by one gather from the full outer product (one kernel, fast on GPUs); `gather=None`
    picks by device. Both give the same features."""
    gather = x.device.type != "cpu" if gather is None else gather
    head_dim = x.shape[-1]
    parts = [x.new_ones(*x.shape[:-1], 1)]
    if order >= 1:
        parts.append(x)
    monomials = x
    for n in range(2, order + 1):
        if gather:
            products = (monomials.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)
            monomials = products.index_select(-1, _monomial_selection(head_dim, n).to(x.device))
            parts.append(monomials)
            continue
        prefix = _monomial_prefixes(head_dim, n)
        blocks = [monomials[..., : prefix[j]] * x[..., j : j + 1] for j in range(head_dim)]
        parts += blocks
        if n < order:
            monomials = torch.cat(blocks, dim=-1)
    features = torch.cat(parts, dim=-1)
    return features if order < 2 else features * _taylor_weights(head_dim, order).to(device=x.device, dtype=x.dtype)


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

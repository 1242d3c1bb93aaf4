"""Feature-map kernels phi(q).phi(k) of the linear variants, and `build_kernel` for every spec.

- `ElementwiseKernel` (identity, elu = elu+1, relu), `CosineKernel` (L2-normalised q, k) and
  `HedgehogKernel` (learned per-head W, softmax over [xW, -xW]): the chunked engine (`ops.chunked`)
  computes their features for the whole call, with autograd through the map.
- The Taylor kernel lives in `ops.taylor`, exact exp in `ops.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_softmax_rnn.attention_spec import DENOMINATOR_NORMALIZERS, AttentionSpec
from hf_softmax_rnn.ops.kernels import AttentionParams, ExpKernel, FeatureKernel
from hf_softmax_rnn.ops.taylor import TaylorKernel

ElementwiseFn = Callable[[torch.Tensor], torch.Tensor]


class _EluPlusOne(torch.autograd.Function):
    """elu(x) + 1 as x + 1 above 0 and e^x at or below it, with one saved tensor (its output y, whose
    derivative is min(y, 1): 1 above 0, e^x = y below), as `F.elu` keeps one."""

    @staticmethod
    def forward(ctx, x):
        y = torch.maximum(x + 1.0, torch.exp(x.clamp_max(0.0)))  # (e^x >= 1 + x, equal at 0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y.clamp_max(1.0)


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1: x + 1 for x > 0, e^x otherwise, taken as e^x where `F.elu(x) + 1` adds 1 to e^x - 1, which
    leaves nothing of e^x below about -17 (float32) or -37 (float64): every feature of a negative key 0, and the
    keys' weights 0 / 0."""
    return _EluPlusOne.apply(x)


def row_shifted_elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 of each row `[..., D]` divided by e^m, m = min(max_d x_d, 0) (detached): the row itself where
    a coordinate is >= 0, else e^(x - max_d x_d), whose largest feature is 1. A query's features e^(q_d) then
    never underflow with the keys' (q_d + k_d below about -104 in float32: every product 0, the output 0 / 0);
    for the softmax normaliser only, which divides the factor out."""
    return elu_plus_one(x - x.detach().amax(-1, keepdim=True).clamp_max(0.0))


#: name -> phi of the elementwise maps.
ELEMENTWISE_MAPS: dict[str, ElementwiseFn] = {
    "identity": lambda x: x.clone(),
    "elu": elu_plus_one,
    "relu": F.relu,
}


class ElementwiseKernel(FeatureKernel):
    """phi applied elementwise (identity, elu, relu); the scale multiplies phi(q). `query_function`: phi(q) up
    to a positive factor per query, where the normaliser divides it out (None: phi)."""

    def __init__(
        self, name: str, scale: float, clamp: float | None = None, query_function: ElementwiseFn | None = None
    ) -> None:
        super().__init__(scale, clamp)
        self.function = ELEMENTWISE_MAPS[name]
        self.query_function = query_function or self.function

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        return self.query_function(q) * self.scale

    def query_features_and_factor(self, q: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.query_function(q), self.scale

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        return self.function(k)


class CosineKernel(FeatureKernel):
    """phi(x) = x / ||x||_2 over the head dimension."""

    def __init__(self, scale: float, eps: float, clamp: float | None = None) -> None:
        super().__init__(scale, clamp)
        self.eps = eps

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        return F.normalize(q, dim=-1, eps=self.eps) * self.scale

    def query_features_and_factor(self, q: torch.Tensor) -> tuple[torch.Tensor, float]:
        return F.normalize(q, dim=-1, eps=self.eps), self.scale

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        return F.normalize(k, dim=-1, eps=self.eps)


class HedgehogKernel(FeatureKernel):
    """phi(x) = [softmax(xW), softmax(-xW)] with a learned W per head (Hedgehog / LoLCATs):
    `weight_q` `[H, D, F]`, `weight_k` `[Hkv, D, F]`."""

    def __init__(
        self, scale: float, weight_q: torch.Tensor, weight_k: torch.Tensor, clamp: float | None = None
    ) -> None:
        super().__init__(scale, clamp)
        self.learned = (weight_q, weight_k)

    @staticmethod
    def _map(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[softmax(xW), softmax(-xW)] of x `[B, *heads, L, D]`, weight `[*heads, D, F]`, with one softmax
        over the two halves. A call of L >= 2F positions (training, prefill) takes one product with [W, -W]
        broadcast over B (no pass for -xW and none to join them, forward or backward; B copies of the
        weights cost less than a copy of x). A shorter call (decoding: 0.8 GB a layer, queries and keys,
        at SmolLM2's heads for 4,096 sequences in bfloat16) folds the batch into the rows of one product
        per head: with [W, -W] when its B * L rows outnumber D, else with W, its output then negated and
        joined (an output smaller than the weights: for a few sequences, far smaller); a single sequence of
        at most D positions takes that product without folding (the weights broadcast over B = 1 uncopied)."""
        if x.shape[-2] >= 2 * weight.shape[-1]:
            both = torch.cat([weight, -weight], dim=-1).to(x.dtype)  # [*heads, D, 2F], the size of the weights
            return torch.softmax((x @ both).unflatten(-1, (2, -1)), dim=-1).flatten(-2)
        if x.shape[0] == 1 and x.shape[-2] <= x.shape[-1]:  # one short sequence (decoding one): no fold, no copy
            products = x @ weight.to(x.dtype)
            return torch.softmax(torch.stack([products, -products], dim=-2), dim=-1).flatten(-2)
        heads = weight.shape[:-2]
        rows = x.movedim(0, len(heads)).reshape(-1, x.shape[0] * x.shape[-2], x.shape[-1])  # [heads, B * L, D]
        weight = weight.reshape(-1, *weight.shape[-2:]).to(x.dtype)
        if rows.shape[1] > x.shape[-1]:
            products = torch.bmm(rows, torch.cat([weight, -weight], dim=-1)).unflatten(-1, (2, -1))
        else:
            products = torch.bmm(rows, weight)  # (bmm: fewer dispatches than matmul)
            products = torch.stack([products, -products], dim=-2)
        features = torch.softmax(products, dim=-1).flatten(-2)  # [heads, B * L, 2F]
        return features.view(*heads, x.shape[0], x.shape[-2], -1).movedim(len(heads), 0)

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        features, factor = self.query_features_and_factor(q)
        return features * factor

    def query_features_and_factor(self, q: torch.Tensor) -> tuple[torch.Tensor, float]:
        weight = self.learned[0]
        return self._map(q, weight.view(q.shape[1], q.shape[2], *weight.shape[1:])), self.scale

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        return self._map(k, self.learned[1])

    def with_learned(self, *tensors: torch.Tensor) -> HedgehogKernel:
        return HedgehogKernel(self.scale, *tensors, clamp=self.clamp)


def _exp_shift(spec: AttentionSpec) -> str | None:
    if spec.is_row_scale_invariant:
        return "row_max"
    return "positive_row_max" if spec.normalizer in DENOMINATOR_NORMALIZERS else None


def build_kernel(spec: AttentionSpec, scale: float, params: AttentionParams) -> ExpKernel | FeatureKernel:
    """The kernel of `spec` with q.k scale `scale` and the learned tensors in `params`."""
    name, clamp = spec.effective_feature_map, spec.score_clamp
    if name is None:
        return ExpKernel(scale, clamp, shift=_exp_shift(spec))
    if name == "taylor":
        return TaylorKernel(spec.taylor_order, scale, clamp, shift=_exp_shift(spec))
    if name == "cosine":
        return CosineKernel(scale, spec.norm_eps, clamp)
    if name == "hedgehog":
        if params.hedgehog_q is None or params.hedgehog_k is None:
            raise ValueError(
                "feature_map='hedgehog' needs params.hedgehog_q [H, D, F] and params.hedgehog_k [Hkv, D, F]"
            )
        return HedgehogKernel(scale, params.hedgehog_q, params.hedgehog_k, clamp)
    if name == "elu" and _divides_out_query_factor(spec):
        return ElementwiseKernel(name, scale, clamp, query_function=row_shifted_elu_plus_one)
    return ElementwiseKernel(name, scale, clamp)


def _divides_out_query_factor(spec: AttentionSpec) -> bool:
    """Whether a positive factor per query on phi(q) leaves the output as it is: the softmax normaliser divides
    the numerator by the denominator, both linear in phi(q) (with additive_mass too: the recall reads phi(q)'s
    direction), unless a window adds exact scores in their own units or a clamp caps the scores."""
    return spec.normalizer == "softmax" and spec.window is None and spec.score_clamp is None

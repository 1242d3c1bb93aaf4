"""The Taylor family: exp(q.k) truncated at order N as a finite-state recurrence.

phi_N(x) = [x^alpha / sqrt(alpha!)]_{|alpha| <= N} lives in the symmetric monomial basis:
phi_N(q).phi_N(k) = sum_{n<=N} (q.k)^n / n! with C(d+n-1, n) features per order instead
of d^n (2,145 for d = 64, N = 2).

- `taylor_features` (fast, hand-written backward; under `torch.compile` the gather form
  `taylor_features_gathered`, which has no `out=` writes into strided buffers) /
  `taylor_features_reference` (one product per monomial).
- `feature_rows` / `feature_rows_backward`: the same features feature-major, `[Bt, F, T]`,
  in reusable buffers: order 2 is x times wrapped shifts of x (three products, no gather),
  higher orders gather rows of the order below.
- `TaylorKernel`: the kernel object (features, scores and the hand-written chunked engine's
  methods of `ops.chunked`).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from hf_softmax_rnn.ops.chunked import Scratch
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import FeatureKernel, finite_or_zero


def _wrapped_shifts(head_dim: int) -> int:
    """Shifts s = 1..S whose wrapped diagonals (i, i + s mod D) each hold D distinct pairs."""
    return (head_dim - 1) // 2


@functools.lru_cache(maxsize=32)
def _monomials(head_dim: int, order: int) -> tuple[tuple[int, ...], ...]:
    """The order-n monomials x^alpha as sorted index tuples, in the order of the feature rows.

    Order 2 runs along wrapped diagonals: (i, i) for every i, then (i, i + s mod D) for
    s = 1..S, then (i, i + D/2) for i < D/2 when D is even, so that each block is x times
    a shifted x (no gather). Order n >= 3 appends a last index j >= the parent's last one,
    j outermost."""
    if order == 0:
        return ((),)
    if order == 1:
        return tuple((i,) for i in range(head_dim))
    if order == 2:
        pairs = [(i, i) for i in range(head_dim)]
        for shift in range(1, _wrapped_shifts(head_dim) + 1):
            pairs += [tuple(sorted((i, (i + shift) % head_dim))) for i in range(head_dim)]
        if head_dim % 2 == 0:
            pairs += [(i, i + head_dim // 2) for i in range(head_dim // 2)]
        return tuple(pairs)
    parents = _monomials(head_dim, order - 1)
    return tuple((*parent, j) for j in range(head_dim) for parent in parents if parent[-1] <= j)


@functools.lru_cache(maxsize=32)
def _monomial_recursion(head_dim: int, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How the weighted order-n features (n >= 3) grow from order n-1: feature r is parent
    feature `parent[r]` times row `factor[r]` of the scaled inputs [x / sqrt(1); ...; x / sqrt(N)],
    the divisor sqrt(m) being the multiplicity m of the new last index, so that the products
    carry 1 / sqrt(alpha!) without a separate weighting pass."""
    parent_index = {monomial: r for r, monomial in enumerate(_monomials(head_dim, order - 1))}
    parent, factor = [], []
    for monomial in _monomials(head_dim, order):
        last = monomial[-1]
        parent.append(parent_index[monomial[:-1]])
        factor.append((monomial.count(last) - 1) * head_dim + last)
    return torch.tensor(parent), torch.tensor(factor)


@functools.lru_cache(maxsize=32)
def _order_offsets(head_dim: int, order: int) -> tuple[int, ...]:
    """Row offsets of each order's block in phi_N: (0, 1, 1 + D, ...), N + 2 entries."""
    offsets = [0]
    for n in range(order + 1):
        offsets.append(offsets[-1] + math.comb(head_dim + n - 1, n))
    return tuple(offsets)


@functools.lru_cache(maxsize=64)
def _recursion_rows(head_dim: int, n: int, order: int, batch: int, stride: int, device: torch.device):
    """Row indices for building order n of phi_N in `batch` blocks: (parent rows into a
    `[batch * stride, T]` view of features whose order n-1 starts at its offset, factor rows
    into the `[batch * N * D, T]` scaled inputs). 2-D index_select/index_add are the fast ones."""
    parent, factor = _monomial_recursion(head_dim, n)
    starts = torch.arange(batch)[:, None]
    parent_rows = starts * stride + _order_offsets(head_dim, order)[n - 1] + parent[None, :]
    factor_rows = starts * (order * head_dim) + factor[None, :]
    return parent_rows.flatten().to(device), factor_rows.flatten().to(device)


@functools.lru_cache(maxsize=32)
def _divisors(order: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """1 / sqrt(m) for m = 1..N, shaped to scale `[Bt, N, D, T]`."""
    return torch.arange(1, order + 1, dtype=torch.float64).rsqrt().to(device=device, dtype=dtype)[None, :, None, None]


_SQRT_HALF = math.sqrt(0.5)


def _shifted(xt: torch.Tensor, scratch: Scratch, name: str, fill: bool = True) -> torch.Tensor:
    """x shifted by s = 1..S rows with wrap-around, as a view `[Bt, S, D, T]` of [x; x]
    (`fill=False` reuses the copy the build of the same x left in `scratch`)."""
    batch, head_dim, tokens = xt.shape
    doubled = scratch(f"{name}.doubled", (batch, 2 * head_dim, tokens), xt)
    if fill:
        doubled[:, :head_dim] = xt
        doubled[:, head_dim:] = xt
    size = (batch, _wrapped_shifts(head_dim), head_dim, tokens)
    return doubled.as_strided(size, (2 * head_dim * tokens, tokens, tokens, 1), doubled.storage_offset() + tokens)


def _order2_rows(xt: torch.Tensor, out: torch.Tensor, scratch: Scratch, name: str) -> None:
    """The order-2 block of phi_N into `out` `[Bt, D(D+1)/2, T]`: three products, no gather."""
    batch, head_dim, tokens = xt.shape
    half, shifts = head_dim // 2, _wrapped_shifts(head_dim)
    torch.mul(xt, xt, out=out[:, :head_dim]).mul_(_SQRT_HALF)
    if shifts:
        middle = out[:, head_dim : head_dim * (1 + shifts)].view(batch, shifts, head_dim, tokens)
        torch.mul(xt[:, None], _shifted(xt, scratch, name), out=middle)
    if head_dim % 2 == 0:
        torch.mul(xt[:, :half], xt[:, half:], out=out[:, head_dim * (1 + shifts) :])


@functools.lru_cache(maxsize=64)
def _wrapped_rows(head_dim: int, batch: int, device: torch.device) -> torch.Tensor:
    """Row (i + s) mod D of each `[Bt * S * D]` middle-block product, as an index into `[Bt * D, T]`."""
    shifts = torch.arange(1, _wrapped_shifts(head_dim) + 1)[:, None]
    rows = (torch.arange(head_dim)[None, :] + shifts) % head_dim
    return (torch.arange(batch)[:, None] * head_dim + rows.flatten()[None, :]).flatten().to(device)


def _order2_rows_backward(xt: torch.Tensor, grad: torch.Tensor, scratch: Scratch, name: str) -> torch.Tensor:
    """Vector-Jacobian product of the last `_order2_rows` of this x and `scratch`: grad
    `[Bt, D(D+1)/2, T]` -> `[Bt, D, T]` (a new tensor)."""
    batch, head_dim, tokens = xt.shape
    half, shifts = head_dim // 2, _wrapped_shifts(head_dim)
    grad_x = grad[:, :head_dim] * xt
    grad_x.mul_(2 * _SQRT_HALF)
    if shifts:
        middle = grad[:, head_dim : head_dim * (1 + shifts)].view(batch, shifts, head_dim, tokens)
        products = scratch(f"{name}.order2_products", (batch, shifts, head_dim, tokens), xt)
        grad_x += torch.mul(middle, _shifted(xt, scratch, name, fill=False), out=products).sum(1)
        torch.mul(middle, xt[:, None], out=products)
        grad_x.view(-1, tokens).index_add_(0, _wrapped_rows(head_dim, batch, xt.device), products.view(-1, tokens))
    if head_dim % 2 == 0:
        last = grad[:, head_dim * (1 + shifts) :]
        grad_x[:, :half] += last * xt[:, half:]
        grad_x[:, half:] += last * xt[:, :half]
    return grad_x


def feature_rows(xt: torch.Tensor, order: int, scratch: Scratch, name: str = "features") -> torch.Tensor:
    """phi_N feature-major: `[Bt, D, T] -> [Bt, F, T]`, built in `scratch` buffers.

    Order 2 is x times shifted copies of x; order n >= 3 is (rows of order n-1, gathered) *
    (rows of [x / sqrt(1); ...; x / sqrt(N)], gathered). What the backward needs (the doubled
    x, the gathered factors) stays in `scratch` for `feature_rows_backward`."""
    batch, head_dim, tokens = xt.shape
    offsets = _order_offsets(head_dim, order)
    features = scratch(name, (batch, offsets[-1], tokens), xt)
    features[:, 0].fill_(1.0)
    if order >= 1:
        features[:, 1 : 1 + head_dim] = xt
    if order >= 2:
        _order2_rows(xt, features[:, offsets[2] : offsets[3]], scratch, name)
    if order >= 3:
        scaled = scratch(f"{name}.scaled", (batch, order, head_dim, tokens), xt)
        torch.mul(_divisors(order, xt.dtype, xt.device), xt[:, None], out=scaled)
        flat = features.view(-1, tokens)
        for n in range(3, order + 1):
            parent_rows, factor_rows = _recursion_rows(head_dim, n, order, batch, offsets[-1], xt.device)
            left = torch.index_select(
                flat, 0, parent_rows, out=scratch(f"{name}.left{n}", (len(parent_rows), tokens), xt)
            )
            right = torch.index_select(
                scaled.view(-1, tokens), 0, factor_rows, out=scratch(f"{name}.right{n}", (len(factor_rows), tokens), xt)
            )
            torch.mul(
                left.view(batch, -1, tokens),
                right.view(batch, -1, tokens),
                out=features[:, offsets[n] : offsets[n + 1]],
            )
    return features


def feature_rows_backward(
    xt: torch.Tensor, grad: torch.Tensor, order: int, scratch: Scratch, name: str = "features"
) -> torch.Tensor:
    """Vector-Jacobian product of the last `feature_rows(xt, order, scratch, name)`: grad
    `[Bt, F, T]` -> `[Bt, D, T]` (a new tensor). Reuses its gathered factors and leaves them
    as they were, so it may run more than once (retain_graph)."""
    batch, head_dim, tokens = xt.shape
    if order == 0:
        return torch.zeros_like(xt)
    grad_x = grad[:, 1 : 1 + head_dim].clone()
    if order == 1:
        return grad_x
    offsets = _order_offsets(head_dim, order)
    grad_2 = grad[:, offsets[2] : offsets[3]]
    if order >= 3:
        lower = offsets[order]
        grad_lower = scratch(f"{name}.grad_lower", (batch, lower, tokens), xt)
        grad_lower.copy_(grad[:, :lower])
        grad_scaled = scratch(f"{name}.grad_scaled", (batch, order, head_dim, tokens), xt).zero_()
        for n in range(order, 2, -1):
            grad_n = (grad if n == order else grad_lower)[:, offsets[n] : offsets[n + 1]]
            parent_rows, factor_rows = _recursion_rows(head_dim, n, order, batch, lower, xt.device)
            product = scratch(f"{name}.product{n}", tuple(grad_n.shape), xt)
            torch.mul(scratch.get(f"{name}.right{n}").view_as(product), grad_n, out=product)
            grad_lower.view(-1, tokens).index_add_(0, parent_rows, product.view(-1, tokens))
            torch.mul(scratch.get(f"{name}.left{n}").view_as(product), grad_n, out=product)
            grad_scaled.view(-1, tokens).index_add_(0, factor_rows, product.view(-1, tokens))
        grad_x += (grad_scaled * _divisors(order, xt.dtype, xt.device)).sum(1)
        grad_2 = grad_lower[:, offsets[2] : offsets[3]]
    return grad_x.add_(_order2_rows_backward(xt, grad_2, scratch, name))


class _TaylorFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: int) -> torch.Tensor:
        *lead, tokens, head_dim = x.shape
        xt = x.reshape(-1, tokens, head_dim).transpose(1, 2).contiguous()
        scratch = Scratch()
        features = feature_rows(xt, order, scratch)
        ctx.save_for_backward(xt)
        ctx.order, ctx.x_shape, ctx.scratch = order, x.shape, scratch
        return features.transpose(1, 2).view(*lead, tokens, features.shape[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (xt,) = ctx.saved_tensors
        batch, _, tokens = xt.shape
        grad = grad.reshape(batch, tokens, grad.shape[-1]).transpose(1, 2).contiguous()
        grad_x = feature_rows_backward(xt, grad, ctx.order, ctx.scratch)
        return grad_x.transpose(1, 2).reshape(ctx.x_shape), None


def taylor_features(x: torch.Tensor, order: int) -> torch.Tensor:
    """phi_N(x): `[..., T, D] -> [..., T, F]`, orders 0..N concatenated, each in the row order
    of `_monomials`.

    The result is a transposed view of a feature-major `[..., F, T]` buffer (matmuls take it
    as it is); the backward is hand-written. Under `torch.compile` (compiled decoding) the
    gather form runs instead: one graph, no writes into views."""
    if torch.compiler.is_compiling():
        return taylor_features_gathered(x, order)
    return _TaylorFeatures.apply(x, order)


@functools.lru_cache(maxsize=32)
def _gather_plan(head_dim: int, order: int) -> tuple[tuple[tuple[tuple[int, ...], ...], tuple[float, ...]], ...]:
    """Per order n = 0..N (n = 0, 1, 2 left empty: `taylor_features_gathered` builds them without a
    table): the monomials' indices (rows of an `[F_n, n]` table) and their weights 1 / sqrt(alpha!)."""
    plan = [((), ())] * 3
    for n in range(3, order + 1):
        monomials = _monomials(head_dim, n)
        weights = []
        for monomial in monomials:
            factorials, run = 1, 1
            for previous, index in itertools.pairwise(monomial):
                run = run + 1 if index == previous else 1
                factorials *= run
            weights.append(factorials**-0.5)
        plan.append((monomials, tuple(weights)))
    return tuple(plan)


def taylor_features_gathered(x: torch.Tensor, order: int) -> torch.Tensor:
    """phi_N(x) as `taylor_features`, from one gather and product per order (plain autograd;
    `[..., T, F_n, n]` of work per order, so meant for short inputs such as a decode step).
    Orders 1 and 2 index with a few tensor ops, which torch.compile folds at once."""
    blocks = [x.new_ones(*x.shape[:-1], 1)]
    if order >= 1:
        blocks.append(x)
    if order >= 2:
        first, second, weight = _order2_pairs(x.shape[-1], x.device, x.dtype)
        blocks.append(x[..., first] * x[..., second] * weight)
    for monomials, weights in _gather_plan(x.shape[-1], order)[3:] if order >= 3 else ():
        index = torch.tensor(monomials, device=x.device)
        scale = torch.tensor(weights, device=x.device, dtype=x.dtype)
        blocks.append(x[..., index].prod(-1) * scale)
    return torch.cat(blocks, dim=-1)


def _order2_pairs(head_dim: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The order-2 rows of `_monomials` as (first index, second index, weight) vectors: the wrapped
    diagonals (i, i + s mod D) for s = 0..S, then (i, i + D/2) for i < D/2 when D is even."""
    rows = torch.arange(head_dim, device=device)
    shifts = torch.arange(_wrapped_shifts(head_dim) + 1, device=device)
    half = torch.arange(head_dim // 2 if head_dim % 2 == 0 else 0, device=device)
    first = torch.cat([rows.repeat(len(shifts)), half])
    second = torch.cat([((rows[None, :] + shifts[:, None]) % head_dim).flatten(), half + head_dim // 2])
    weight = torch.ones(len(first), device=device, dtype=dtype)
    weight[:head_dim] = _SQRT_HALF
    return first, second, weight


def taylor_features_reference(x: torch.Tensor, order: int) -> torch.Tensor:
    """The slow, obviously-correct phi_N: one product per monomial, same order and weights."""
    columns = [x.new_ones(x.shape[:-1])]
    for n in range(1, order + 1):
        for monomial in _monomials(x.shape[-1], n):
            weight = math.prod(math.factorial(len(list(group))) for _, group in itertools.groupby(monomial)) ** -0.5
            columns.append(weight * math.prod(x[..., i] for i in monomial))
    return torch.stack(columns, dim=-1)


#: Orders above this are evaluated in float64, and for negative x as e^x minus the tail of the
#: series: the alternating sum of a high order cancels catastrophically (order 79 at x = -20 summed
#: directly gave 3,540 in float32 and 8.6e-10 in float64, against e^-20 - 1.7e-15 = 2.06e-9).
_FLOAT64_ABOVE_ORDER = 12
#: Terms of the tail series sum_{n>N} x^n/n!; for |x| <= (N+1)/2 each is at most half the one before.
_TAIL_TERMS = 60


def taylor_exp(x: torch.Tensor, order: int) -> torch.Tensor:
    """sum_{n<=N} x^n / n! (elementwise), as 1 + x (1 + x/2 (1 + ... (1 + x/N))): no 1/n! is
    formed, so no coefficient underflows. Orders above 12 run in float64; there, negative x with
    |x| <= (N+1)/2 is computed as e^x - sum_{n>N} x^n/n! (no cancellation)."""
    if order <= _FLOAT64_ABOVE_ORDER:
        return _horner(x, range(order, 0, -1))
    x64 = x.double()
    direct = _horner(x64, range(order, 0, -1))
    near = (x64 < 0) & (x64 >= -(order + 1) / 2)
    safe = torch.where(near, x64, torch.full_like(x64, -1.0))
    log_first = (order + 1) * safe.abs().log() - math.lgamma(order + 2)
    first = torch.exp(log_first) * (-1.0 if (order + 1) % 2 else 1.0)
    tail = first * _horner(safe, range(order + 1 + _TAIL_TERMS, order + 1, -1))
    return torch.where(near, safe.exp() - tail, direct).to(x.dtype)


def _horner(x: torch.Tensor, divisors: range) -> torch.Tensor:
    """1 + x/d_1 (1 + x/d_2 (1 + ...)) for divisors given innermost first."""
    result = torch.ones_like(x)
    for n in divisors:
        result = (result * x).mul_(1.0 / n).add_(1.0)
    return result


def taylor_exp_derivative(x: torch.Tensor, order: int) -> torch.Tensor:
    """d/dx of `taylor_exp(x, N)`, which is `taylor_exp(x, N - 1)` (0 for N = 0)."""
    return taylor_exp(x, order - 1) if order >= 1 else torch.zeros_like(x)


class TaylorKernel(FeatureKernel):
    """exp(q.k) truncated at order N: phi_N features with sqrt(scale) folded into q and k each;
    scores from the polynomial of q.k (D work per pair, not F)."""

    hand_written = True

    def __init__(self, order: int, scale: float, clamp: float | None = None, shift: str | None = None) -> None:
        super().__init__(scale, clamp)
        self.order, self.root, self.shift = order, math.sqrt(scale), shift

    def masked_scores(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor):
        """Orders above 12 (computed in float64): the scores divided per row by their largest magnitude
        where the normaliser allows a per-row factor (`shift` as for exact exp, `EXP_SHIFTS`), so that
        x^N/N! beyond the caller's dtype (x = 200 and N = 79 gives 1e65) cannot overflow it;
        (scores, log of the factor `[B, Hkv, G, Lq]`)."""
        if self.shift is None or self.order <= _FLOAT64_ABOVE_ORDER:
            return super().masked_scores(q, k, visible)
        scores = taylor_exp(self.scale * grouped_matmul(q.double(), k.double().mT), self.order)
        if self.clamp is not None:
            scores = scores.clamp_max(self.clamp)
        scores = scores.masked_fill(~visible, 0.0)
        log_max = finite_or_zero(scores.abs().amax(-1, keepdim=True).detach().log())
        if self.shift == "positive_row_max":
            log_max = log_max.clamp_min(0.0)
        return (scores * torch.exp(-log_max)).to(q.dtype), log_max.squeeze(-1).to(q.dtype)

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        return taylor_features(q * self.root, self.order)

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        return taylor_features(k * self.root, self.order)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return taylor_exp(grouped_matmul(q * self.scale, k.mT), self.order)

    # ------------------------------------------------------------------ the ops.chunked engine
    def chunk_features(self, x: torch.Tensor, scratch: Scratch, query: bool) -> torch.Tensor:
        rows = scratch("rows", (x.shape[0], x.shape[2], x.shape[1]), x)
        torch.mul(x.mT, self.root, out=rows)
        return feature_rows(rows, self.order, scratch)

    def chunk_features_backward(self, grad: torch.Tensor, scratch: Scratch, query: bool) -> torch.Tensor:
        return feature_rows_backward(scratch.get("rows"), grad, self.order, scratch).mT.mul_(self.root)

    def chunk_scores(self, q, k, phi_q, phi_k, scratch: Scratch) -> torch.Tensor:
        dots = torch.bmm(q, k.mT, out=scratch("dots", (q.shape[0], q.shape[1], k.shape[1]), q)).mul_(self.scale)
        return taylor_exp(dots, self.order)

    def chunk_scores_backward(self, d_scores, q, k, phi_q, phi_k, scratch: Scratch):
        d_dots = d_scores.mul_(taylor_exp_derivative(scratch.get("dots"), self.order)).mul_(self.scale)
        return d_dots @ k, d_dots.mT @ q, None, None

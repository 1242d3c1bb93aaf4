"""Fused causal Taylor-2 attention for GPUs (Triton), and its float64 reference.

Taylor-2 has 1 + D + D(D+1)/2 features per head (2,145 at D = 64), too wide for the
feature-map kernels of flash-linear-attention. This kernel never forms them: phi(q).phi(k)
equals the polynomial 1 + x + x^2/2 of x = scale * q.k, so it scores blocks of queries against
blocks of keys on chip, as flash attention does, with the polynomial in place of exp (no running
max: the polynomial is at least 1/2). Nothing of size L x L or L x F reaches GPU memory; the
backward recomputes the scores block by block.

It returns the numerator and denominator separately, so every normaliser of the variant runs
afterwards unchanged, and it keeps no recurrent state: it serves training and scoring (no
cache); decoding and prefill into a cache use `ops.chunked`.

Shapes: q `[B, H, L, D]`, k `[B, Hkv, Lk, D]`, v `[B, Hkv, Lk, Dv]` (zero at padding),
key_mask `[B, Lk]` (1 = token; None: nothing is padded, and no mask is read), Lk >= L,
query i sits at key position Lk - L + i.
D and Dv must be powers of two between 16 and 256.
"""

from __future__ import annotations

import os

import torch

try:  # imported only where triton is installed (ops.backends checks); the try block also keeps
    import triton  # transformers' remote-code import check from requiring triton everywhere
    import triton.language as tl
except ImportError as error:
    raise ImportError("the fused Taylor-2 kernel needs triton: pip install 'hf-softmax-rnn[gpu]'") from error


def _configs(blocks: tuple[tuple[int, int, int, int], ...], interpreted: tuple[int, int]) -> list:
    """`triton.Config`s from (BM, BN, num_warps, num_stages); in the interpreter the one small,
    unequal (BM, BN) `interpreted`, so that CPU tests cross many blocks of both sizes."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BM": interpreted[0], "BN": interpreted[1]})]
    return [triton.Config({"BM": m, "BN": n}, num_warps=w, num_stages=s) for m, n, w, s in blocks]


#: Candidate (query block BM, key block BN, warps, stages) per kernel, timed once per head size, dtype
#: and precision by `triton.autotune` at the first call (the key kernel walks query blocks of BM rows).
#: The backward kernels hold more tiles at once; their smallest candidates are for exact float32,
#: whose tiles are twice as wide and whose products run without tensor cores.
FORWARD_CONFIGS = _configs(((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)), interpreted=(32, 16))
QUERY_GRAD_CONFIGS = _configs(((64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (32, 32, 4, 2)), interpreted=(16, 32))
KEY_GRAD_CONFIGS = _configs(((64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (32, 32, 4, 2)), interpreted=(16, 32))
TUNING_KEY = ["D", "DV", "PRECISION"]


def supports(head_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes heads of this size (powers of two, 16..256)."""
    return all(16 <= n <= 256 and n & (n - 1) == 0 for n in (head_dim, value_dim))


@triton.jit
def _hide(t, mask_k, offs_m, offs_n, offset, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """`t` `[BM, BN]` with the entries of hidden keys set to 0: padding keys (mask_k = 0) and, on
    blocks that cross the diagonal (CAUSAL), keys after the query. Without either it is `t` itself."""
    if HAS_MASK:
        t = tl.where(mask_k[None, :] != 0, t, 0.0)
    if CAUSAL:
        t = tl.where(offs_n[None, :] <= offs_m[:, None] + offset, t, 0.0)
    return t


@triton.jit
def _scores(
    q, k, mask_k, offs_m, offs_n, offset, scale, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr
):
    """(A, x) `[BM, BN]`: x = scale q.k and A = 1 + x + x^2/2 at visible keys, 0 at hidden ones."""
    x = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    return _hide(1.0 + x + 0.5 * x * x, mask_k, offs_m, offs_n, offset, CAUSAL, HAS_MASK), x


@triton.jit
def _program(heads, group):
    """(block index, query head row b * H + h, batch row b, key/value head row b * Hkv + h // G)."""
    bh = tl.program_id(1)
    b = bh // heads
    return tl.program_id(0), bh, b, b * (heads // group) + (bh % heads) // group


@triton.jit
def _load_keys(
    K, V, MASK, kv, b, start, key_len,
    D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """(k `[BN, D]`, v `[BN, DV]`, key mask `[BN]`, key positions `[BN]`); without HAS_MASK the mask
    is not read (its ones are never used)."""
    offs_n = start + tl.arange(0, BN)
    cols = offs_n < key_len
    k = tl.load(K + (kv * key_len + offs_n[:, None]) * D + tl.arange(0, D)[None, :], mask=cols[:, None], other=0.0)
    v = tl.load(V + (kv * key_len + offs_n[:, None]) * DV + tl.arange(0, DV)[None, :], mask=cols[:, None], other=0.0)
    if HAS_MASK:
        mask_k = tl.load(MASK + b * key_len + offs_n, mask=cols, other=0.0)
    else:
        mask_k = tl.full([BN], 1.0, tl.float32)
    return k, v, mask_k, offs_n


@triton.jit
def _load_queries(Q, D_NUM, D_DEN, bh, start, length, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr):
    offs_m = start + tl.arange(0, BM)
    rows = offs_m < length
    q = tl.load(Q + (bh * length + offs_m[:, None]) * D + tl.arange(0, D)[None, :], mask=rows[:, None], other=0.0)
    d_num = tl.load(
        D_NUM + (bh * length + offs_m[:, None]) * DV + tl.arange(0, DV)[None, :], mask=rows[:, None], other=0.0
    )
    d_den = tl.load(D_DEN + bh * length + offs_m, mask=rows, other=0.0)
    return q, d_num, d_den, offs_m


@triton.jit
def _forward_step(
    acc, den, q, K, V, MASK, kv, b, start, offs_m, offset, key_len, scale,
    D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    k, v, mask_k, offs_n = _load_keys(K, V, MASK, kv, b, start, key_len, D, DV, BN, HAS_MASK)
    a, _ = _scores(q, k, mask_k, offs_m, offs_n, offset, scale, CAUSAL, HAS_MASK, PRECISION)
    acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
    return acc, den + tl.sum(a, 1)


@triton.autotune(configs=FORWARD_CONFIGS, key=TUNING_KEY)
@triton.jit
def _forward_kernel(
    Q, K, V, MASK, NUM, DEN,
    scale, length, key_len, offset, heads, group,
    D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, bh, b, kv = _program(heads, group)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d, offs_v = tl.arange(0, D), tl.arange(0, DV)
    rows = offs_m < length
    q = tl.load(Q + (bh * length + offs_m[:, None]) * D + offs_d[None, :], mask=rows[:, None], other=0.0)
    acc = tl.zeros([BM, DV], dtype=tl.float32)
    den = tl.zeros([BM], dtype=tl.float32)
    # Keys before `full_end` are visible to every row of the block; the rest need the causal mask.
    full_end = (pid_m * BM + offset + 1) // BN * BN
    end = tl.minimum(key_len, (pid_m + 1) * BM + offset)
    for start in range(0, full_end, BN):
        acc, den = _forward_step(
            acc, den, q, K, V, MASK, kv, b, start, offs_m, offset, key_len, scale,
            D, DV, BN, False, HAS_MASK, PRECISION,
        )  # fmt: skip
    for start in range(full_end, end, BN):
        acc, den = _forward_step(
            acc, den, q, K, V, MASK, kv, b, start, offs_m, offset, key_len, scale,
            D, DV, BN, True, HAS_MASK, PRECISION,
        )  # fmt: skip
    tl.store(NUM + (bh * length + offs_m[:, None]) * DV + offs_v[None, :], acc, mask=rows[:, None])
    tl.store(DEN + bh * length + offs_m, den, mask=rows)


@triton.jit
def _query_step(
    dq, q, d_num, d_den, K, V, MASK, kv, b, start, offs_m, offset, key_len, scale,
    D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    k, v, mask_k, offs_n = _load_keys(K, V, MASK, kv, b, start, key_len, D, DV, BN, HAS_MASK)
    _, x = _scores(q, k, mask_k, offs_m, offs_n, offset, scale, CAUSAL, HAS_MASK, PRECISION)
    d_a = tl.dot(d_num.to(v.dtype), tl.trans(v), input_precision=PRECISION) + d_den[:, None]
    d_x = _hide(d_a * (1.0 + x), mask_k, offs_m, offs_n, offset, CAUSAL, HAS_MASK)
    return dq + tl.dot(d_x.to(k.dtype), k, input_precision=PRECISION)


@triton.autotune(configs=QUERY_GRAD_CONFIGS, key=TUNING_KEY)
@triton.jit
def _backward_query_kernel(
    Q, K, V, MASK, D_NUM, D_DEN, DQ,
    scale, length, key_len, offset, heads, group,
    D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, bh, b, kv = _program(heads, group)
    q, d_num, d_den, offs_m = _load_queries(Q, D_NUM, D_DEN, bh, pid_m * BM, length, D, DV, BM)
    dq = tl.zeros([BM, D], dtype=tl.float32)
    full_end = (pid_m * BM + offset + 1) // BN * BN
    end = tl.minimum(key_len, (pid_m + 1) * BM + offset)
    for start in range(0, full_end, BN):
        dq = _query_step(
            dq, q, d_num, d_den, K, V, MASK, kv, b, start, offs_m, offset, key_len, scale,
            D, DV, BN, False, HAS_MASK, PRECISION,
        )  # fmt: skip
    for start in range(full_end, end, BN):
        dq = _query_step(
            dq, q, d_num, d_den, K, V, MASK, kv, b, start, offs_m, offset, key_len, scale,
            D, DV, BN, True, HAS_MASK, PRECISION,
        )  # fmt: skip
    out = (bh * length + offs_m[:, None]) * D + tl.arange(0, D)[None, :]
    tl.store(DQ + out, dq * scale, mask=(offs_m < length)[:, None])


@triton.jit
def _key_step(
    dk, dv, k, v, mask_k, offs_n, Q, D_NUM, D_DEN, bh, start, length, offset, scale,
    D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    q, d_num, d_den, offs_m = _load_queries(Q, D_NUM, D_DEN, bh, start, length, D, DV, BM)
    a, x = _scores(q, k, mask_k, offs_m, offs_n, offset, scale, CAUSAL, HAS_MASK, PRECISION)
    dv += tl.dot(tl.trans(a).to(v.dtype), d_num.to(v.dtype), input_precision=PRECISION)
    d_a = tl.dot(d_num.to(v.dtype), tl.trans(v), input_precision=PRECISION) + d_den[:, None]
    d_x = _hide(d_a * (1.0 + x), mask_k, offs_m, offs_n, offset, CAUSAL, HAS_MASK)
    dk += tl.dot(tl.trans(d_x).to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.autotune(configs=KEY_GRAD_CONFIGS, key=TUNING_KEY)
@triton.jit
def _backward_key_kernel(
    Q, K, V, MASK, D_NUM, D_DEN, DK, DV_OUT,
    scale, length, key_len, offset, heads, group,
    D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dk, dv of one block of keys for one query head (the caller sums the heads of a group)."""
    pid_n, bh, b, kv = _program(heads, group)
    k, v, mask_k, offs_n = _load_keys(K, V, MASK, kv, b, pid_n * BN, key_len, D, DV, BN, HAS_MASK)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, DV], dtype=tl.float32)
    # Query blocks from `full_start` on see every key of the block; earlier ones need the causal mask.
    first = tl.maximum(pid_n * BN - offset, 0) // BM * BM
    full_start = (tl.maximum(pid_n * BN + BN - 1 - offset, 0) + BM - 1) // BM * BM
    for start in range(first, full_start, BM):
        dk, dv = _key_step(
            dk, dv, k, v, mask_k, offs_n, Q, D_NUM, D_DEN, bh, start, length, offset, scale,
            D, DV, BM, True, HAS_MASK, PRECISION,
        )  # fmt: skip
    for start in range(full_start, length, BM):
        dk, dv = _key_step(
            dk, dv, k, v, mask_k, offs_n, Q, D_NUM, D_DEN, bh, start, length, offset, scale,
            D, DV, BM, False, HAS_MASK, PRECISION,
        )  # fmt: skip
    cols = (offs_n < key_len)[:, None]
    tl.store(DK + (bh * key_len + offs_n[:, None]) * D + tl.arange(0, D)[None, :], dk * scale, mask=cols)
    tl.store(DV_OUT + (bh * key_len + offs_n[:, None]) * DV + tl.arange(0, DV)[None, :], dv, mask=cols)


def _launch_args(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple:
    batch, heads, length, _ = q.shape
    key_len = k.shape[-2]
    return scale, length, key_len, key_len - length, heads, heads // k.shape[1]


def _meta(q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> dict:
    """Head sizes, whether a key mask is read, and the products' precision: float32 products as
    torch's own float32 matmuls (`torch.set_float32_matmul_precision`: "highest", the default, is
    exact float32, slow without tensor cores; "high" or "medium" allow TF32); half-precision
    inputs use tensor cores anyway."""
    exact = q.dtype == torch.float64 or (q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest")
    precision = "ieee" if exact else "tf32"
    return {"D": q.shape[-1], "DV": v.shape[-1], "HAS_MASK": mask is not None, "PRECISION": precision}


def _pointer(mask: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """The mask, or any tensor where there is none (the kernel compiled without HAS_MASK never reads it)."""
    return fallback if mask is None else mask


class _Taylor2Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        mask = None if key_mask is None else key_mask.to(torch.float32).contiguous()
        batch, heads, length, _ = q.shape
        num = torch.empty(batch, heads, length, v.shape[-1], device=q.device, dtype=torch.float32)
        den = torch.empty(batch, heads, length, device=q.device, dtype=torch.float32)
        grid = lambda meta: (triton.cdiv(length, meta["BM"]), batch * heads)  # noqa: E731
        _forward_kernel[grid](q, k, v, _pointer(mask, q), num, den, *_launch_args(q, k, scale), **_meta(q, v, mask))
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return num, den

    @staticmethod
    def backward(ctx, d_num, d_den):
        q, k, v, mask = ctx.saved_tensors
        batch, heads, length, head_dim = q.shape
        kv_heads, key_len = k.shape[1], k.shape[2]
        d_num = d_num.to(torch.float32).contiguous()
        d_den = d_den.to(torch.float32).contiguous()
        args, meta, mask_pointer = _launch_args(q, k, ctx.scale), _meta(q, v, mask), _pointer(mask, q)
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        grid_q = lambda meta: (triton.cdiv(length, meta["BM"]), batch * heads)  # noqa: E731
        _backward_query_kernel[grid_q](q, k, v, mask_pointer, d_num, d_den, dq, *args, **meta)
        dk = torch.empty(batch, heads, key_len, head_dim, device=q.device, dtype=torch.float32)
        dv = torch.empty(batch, heads, key_len, v.shape[-1], device=q.device, dtype=torch.float32)
        grid_k = lambda meta: (triton.cdiv(key_len, meta["BN"]), batch * heads)  # noqa: E731
        _backward_key_kernel[grid_k](q, k, v, mask_pointer, d_num, d_den, dk, dv, *args, **meta)
        group = heads // kv_heads
        dk = dk.view(batch, kv_heads, group, key_len, head_dim).sum(2)
        dv = dv.view(batch, kv_heads, group, key_len, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def taylor2_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal sum_j (1 + x_ij + x_ij^2 / 2) [v_j, 1] over visible keys, x_ij = scale q_i.k_j.
    `key_mask` None: every key is a token (the kernel then reads no mask).

    Returns (numerator `[B, H, L, Dv]`, denominator `[B, H, L]`), both float32; differentiable
    in q, k and v.
    """
    return _Taylor2Attention.apply(q, k, v, key_mask, scale)


def taylor2_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in float64 with an explicit L x Lk matrix (slow; for tests)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    length, key_len = q.shape[-2], k.shape[-2]
    x = scale * q @ k.mT
    visible = torch.ones(length, key_len, dtype=torch.bool, device=q.device).tril(key_len - length)
    if key_mask is not None:
        visible = visible & key_mask.bool()[:, None, None, :]
    weights = torch.where(visible, 1.0 + x + 0.5 * x * x, torch.zeros_like(x))
    return weights @ v, weights.sum(-1)

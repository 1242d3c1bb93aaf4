"""Chunked linear attention through flash-linear-attention's kernel (GPU).

Same contract as `ops.linear.chunked_linear_attention` (which is its reference): grouped q
`[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v `[B, Hkv, L, Dv + 1]` (values, then a
weight column: 1 at a token, 0 at padding), state `[B, Hkv, F, Dv + 1]` (S, then z). The
features are computed here in float32 (so learned maps such as hedgehog get their gradients
through autograd). The numerator goes to `chunk_simple_gla` (no decay, the kernel's query scale as its
`scale`, so that the query features are not multiplied by it in a pass of their own) with the
features in the caller's dtype (bfloat16 for a bfloat16 model); fla accumulates in float32, and
the state stays in the compute dtype (float32 or float64). The denominator
phi(q_t).(z_0 + sum_{s<=t} w_s phi(k_s)) is a cumulative sum beside it, as fla's own normalised
linear attention computes it, of the features as fla reads them (so that autograd keeps one copy of
them), summed in the compute dtype: the values fla reads keep their width (64, not 65 padded to 66,
for which fla's kernels would run one more block of 32 or 64 value columns).
fla wants as many key heads as query heads, so keys, values and the state are repeated over the
G query heads of a group; the G copies of the final state are equal and one is kept. Its backward
in half precision wants even feature and value widths: an odd one gets a zero column, which adds
nothing to any sum, and is cut off again. With a decay (`ops.decay`) the log-decays go to fla as
its gate `g`, and the weight column travels with the values, so that z decays with S.

fla's state pass walks the chunks of a row one after another, one program per (row, head, state
tile): a few long rows leave most of a GPU idle. `chunk_in_segments` cuts long rows into segments
that fla runs side by side from an empty state, then chains the segments' states and adds each
segment's start state to its outputs (`ops.backends` applies it to rows over 2,048 tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_softmax_rnn.ops.kernels import FeatureKernel


def _even(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` with a zero slice appended along `dim` when its size there is odd."""
    if x.shape[dim] % 2 == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, 1]
    return F.pad(x, pad)


def _time_major(x: torch.Tensor, dtype: torch.dtype, group: int = 1) -> torch.Tensor:
    """`[B, heads, L, F]` -> fla's contiguous `[B, L, heads * group, F]` in `dtype`, each head repeated
    `group` times and an odd F padded to even: converted before it is repeated, laid out in one copy."""
    x = x.transpose(1, 2)
    if group > 1:
        return _even(x.to(dtype).repeat_interleave(group, dim=2), -1)
    return _even(x.to(dtype, memory_format=torch.contiguous_format).contiguous(), -1)


def _initial_state(state: torch.Tensor, group: int) -> torch.Tensor:
    """`[B, Hkv, F, V]` -> fla's contiguous `[B, Hkv * group, F', V']`, each head repeated `group` times and
    odd widths padded to even."""
    return _even(_even(state.repeat_interleave(group, dim=1), -1), -2).contiguous()


def fla_chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    io_dtype: torch.dtype,
    chunk_function: Callable,
    log_decay: torch.Tensor | None = None,
    empty_state: bool = False,
    final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the final state, in q's dtype; `log_decay`
    `[B, Hkv, L]` decays the state (None = no decay). `empty_state`: `state` is zero (a call from the
    start), so fla gets no initial state and the denominator adds no initial z. `final_state=False`:
    fla does not write the final state, and None is returned in its place."""
    batch, kv_heads, group, length, _ = q.shape
    heads, (features, width) = kv_heads * group, state.shape[-2:]
    # with a decay the weight column goes through fla with the values (z decays with S); without, z is
    # a cumulative sum beside it and fla reads the values alone
    carried = width if log_decay is not None else width - 1
    (phi_q, factor), phi_k = kernel.query_features_and_factor(q), kernel.key_features(k).to(io_dtype)
    fla_q = _time_major(phi_q.reshape(batch, heads, length, -1), io_dtype)  # phi(q) / factor: fla multiplies
    out, final = chunk_function(
        fla_q,
        _time_major(phi_k, io_dtype, group),
        _time_major(v[..., :carried], io_dtype, group),
        g=None if log_decay is None else log_decay.transpose(1, 2).repeat_interleave(group, dim=2),  # (fp32)
        scale=factor,
        initial_state=None if empty_state else _initial_state(state[..., :carried], group),
        output_final_state=final_state,
    )
    numerator = out[..., :carried].transpose(1, 2).reshape(batch, kv_heads, group, length, carried)
    if final_state:
        final = final.view(batch, kv_heads, group, *final.shape[2:])[:, :, 0, :features, :carried].to(q.dtype)
    else:
        final = None
    if log_decay is not None:
        return numerator.to(q.dtype), final
    # the denominator reads the features as fla reads them (in io_dtype): autograd then keeps one copy
    # of them, the one fla keeps, not a float32 one beside it; the weight column is the padding mask,
    # detached: no gradient to send back (nor a zero-filled one to add)
    weighted_k = phi_k * v[..., -1:].detach().to(io_dtype).contiguous()  # (not a view that keeps all of v alive)
    running_z = torch.cumsum(weighted_k, dim=-2, dtype=state.dtype)  # [B, Hkv, L, F]
    if not empty_state:
        running_z = state[..., None, :, -1] + running_z
    grouped_q = fla_q[..., :features].view(batch, length, kv_heads, group, features).permute(0, 2, 3, 1, 4)
    denominator = (grouped_q * running_z[:, :, None]).sum(-1, keepdim=True) * factor  # in the state's dtype
    if final is not None:
        final = torch.cat([final, running_z[..., -1, :, None]], dim=-1)  # one copy per KV head
    return torch.cat([numerator, denominator], dim=-1), final  # (cat converts fla's dtype to the state's)


#: fla's chunk length: segments are a multiple of it where the segment length allows.
FLA_CHUNK_SIZE = 64


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chunk_in_segments(
    chunk_function: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    segment_length: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_function` (fla's `chunk_simple_gla` contract: time-major q, k `[B, L, H, F]`, v
    `[B, L, H, V]`, log-decay g `[B, L, H]`, state `[B, H, F, V]`) with rows longer than
    `segment_length` cut into S segments of equal length (zero-padded at the end), run as B x S
    rows from an empty state. Segment s starts from h_s, chained as h_{s+1} = e^{g_s} h_s + u_s
    (u_s its own final state, g_s its summed log-decay, h_0 the initial state), and adds
    scale e^{G_t} q_t h_s to its outputs (G_t its log-decay summed up to t): the same outputs and
    final state as one pass, in float32 (or the state's wider dtype)."""
    batch, length, heads, _ = q.shape
    if length <= segment_length:
        return chunk_function(
            q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state
        )
    segments = _ceil_div(length, segment_length)
    multiple = math.gcd(segment_length, FLA_CHUNK_SIZE)
    size = _ceil_div(_ceil_div(length, segments), multiple) * multiple  # at most segment_length
    padded = segments * size

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, L, ...] -> [B * S, size, ...]
        if padded > length:
            x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, padded - length])
        return x.reshape(batch * segments, size, *x.shape[2:])

    q_rows = rows(q)
    out, local = chunk_function(
        q_rows, rows(k), rows(v), g=None if g is None else rows(g), scale=scale, initial_state=None,
        output_final_state=True,
    )  # fmt: skip
    dtype = torch.promote_types(local.dtype, torch.float32)
    if initial_state is not None:
        dtype = torch.promote_types(dtype, initial_state.dtype)
    local = local.to(dtype).view(batch, segments, heads, *local.shape[-2:])
    state = torch.zeros_like(local[:, 0]) if initial_state is None else initial_state.to(dtype)
    queries = q_rows.to(dtype).view(batch, segments, size, heads, -1)
    if g is None:
        ends = state[:, None] + local.cumsum(1)  # [B, S, H, F, V]: the state after each segment
        starts = torch.cat([state[:, None], ends[:, :-1]], dim=1)
        state = ends[:, -1]
    else:
        within = rows(g).to(dtype).view(batch, segments, size, heads).cumsum(2)
        queries = queries * within.exp()[..., None]
        segment_decay = within[:, :, -1].exp()[..., None, None]  # [B, S, H, 1, 1]
        starts = []
        for segment in range(segments):
            starts.append(state)
            state = state * segment_decay[:, segment] + local[:, segment]
        starts = torch.stack(starts, dim=1)
    from_start = torch.einsum("bsthf,bshfv->bsthv", queries, starts) * scale
    out = out.to(dtype).view(batch, segments, size, heads, -1) + from_start
    return out.reshape(batch, padded, heads, -1)[:, :length], state if output_final_state else None


def chunk_simple_gla_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_simple_gla` in float64 PyTorch (tests; time-major `[B, L, H, *]`, g `[B, L, H]`):
    o_t = scale (sum_{s<=t} e^{G_t - G_s} (q_t.k_s) v_s + e^{G_t} q_t h0),
    final = e^{G_L} h0 + sum_s e^{G_L - G_s} k_s v_s^T, with G the cumulative sum of g (0 without g)
    and h0 zeros where `initial_state` is None."""
    dtype = q.dtype
    if initial_state is None:
        initial_state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    q, k, v, h0 = q.double(), k.double(), v.double(), initial_state.double()
    cumulative = torch.zeros(q.shape[:3], dtype=torch.float64) if g is None else g.double().cumsum(1)
    cumulative = cumulative.transpose(1, 2)  # [B, H, L]
    decay = torch.exp(cumulative[..., :, None] - cumulative[..., None, :]).tril()
    scores = torch.einsum("bthf,bshf->bhts", q, k) * decay
    from_h0 = torch.einsum("bthf,bhfv->bthv", q, h0) * cumulative.exp().transpose(1, 2)[..., None]
    out = scale * (torch.einsum("bhts,bshv->bthv", scores, v) + from_h0)
    key_weights = torch.exp(cumulative[..., -1:] - cumulative).transpose(1, 2)[..., None]  # [B, L, H, 1]
    final = h0 * cumulative[..., -1].exp()[..., None, None] + torch.einsum("bthf,bthv->bhfv", k * key_weights, v)
    return out.to(dtype), final.to(initial_state.dtype) if output_final_state else None

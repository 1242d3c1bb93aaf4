"""Chunked linear attention through flash-linear-attention's kernel (GPU).

Same contract as `ops.linear.chunked_linear_attention` (which is its reference): grouped q
`[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v `[B, Hkv, L, Dv + 1]` (values, then a
weight column: 1 at a token, 0 at padding), state `[B, Hkv, F, Dv + 1]` (S, then z). The
features are computed here in float32 (so learned maps such as hedgehog get their gradients
through autograd). The numerator goes to `chunk_simple_gla` (no decay, scale 1) with the
features in the caller's dtype (bfloat16 for a bfloat16 model); fla accumulates in float32, and
the state stays in the compute dtype (float32 or float64). The denominator
phi(q_t).(z_0 + sum_{s<=t} w_s phi(k_s)) is a cumulative sum of the float32 features beside it,
as fla's own normalised linear attention computes it: the values fla reads keep their width (64,
not 65 padded to 66, for which fla's kernels would run one more block of 32 or 64 value columns).
fla wants as many key heads as query heads, so keys, values and the state are repeated over the
G query heads of a group; the G copies of the final state are equal and one is kept. Its backward
in half precision wants even feature and value widths: an odd one gets a zero column, which adds
nothing to any sum, and is cut off again. With a decay (`ops.decay`) the log-decays go to fla as
its gate `g`, and the weight column travels with the values, so that z decays with S.
"""

from __future__ import annotations

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


def fla_chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    io_dtype: torch.dtype,
    chunk_function: Callable,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the final state, in q's dtype; `log_decay`
    `[B, Hkv, L]` decays the state (None = no decay)."""
    if log_decay is not None:
        return _fla_decayed(q, k, v, state, kernel, io_dtype, chunk_function, log_decay)
    batch, kv_heads, group, length, _ = q.shape
    heads, (features, width) = kv_heads * group, state.shape[-2:]
    value_dim = width - 1
    values, key_weights = v[..., :-1], v[..., -1:]
    initial_s, initial_z = state[..., :-1], state[..., -1]
    phi_q, phi_k = kernel.query_features(q), kernel.key_features(k)
    running_z = initial_z[..., None, :] + torch.cumsum(phi_k * key_weights, dim=-2)  # [B, Hkv, L, F]
    denominator = (phi_q * running_z[:, :, None]).sum(-1, keepdim=True)
    out, final = chunk_function(
        _even(phi_q.reshape(batch, heads, length, -1), -1).transpose(1, 2).to(io_dtype).contiguous(),
        *(
            _even(x.repeat_interleave(group, dim=1), -1).transpose(1, 2).to(io_dtype).contiguous()
            for x in (phi_k, values)
        ),
        scale=1.0,
        initial_state=_even(_even(initial_s.repeat_interleave(group, dim=1), -1), -2).contiguous(),
        output_final_state=True,
    )
    numerator = out[..., :value_dim].transpose(1, 2).to(q.dtype).reshape(batch, kv_heads, group, length, value_dim)
    final_s = final.view(batch, kv_heads, group, *final.shape[2:])[:, :, 0, :features, :value_dim].to(q.dtype)
    final_state = torch.cat([final_s, running_z[..., -1, :, None]], dim=-1)  # one copy per KV head
    return torch.cat([numerator, denominator], dim=-1), final_state


def _fla_decayed(q, k, v, state, kernel, io_dtype, chunk_function, log_decay):
    """`fla_chunked_linear_attention` with a decay: the augmented values (weight column included)
    and the whole state go through fla's gated kernel."""
    batch, kv_heads, group, length, _ = q.shape
    heads, (features, width) = kv_heads * group, state.shape[-2:]
    phi_q, phi_k = kernel.query_features(q), kernel.key_features(k)
    out, final = chunk_function(
        _even(phi_q.reshape(batch, heads, length, -1), -1).transpose(1, 2).to(io_dtype).contiguous(),
        *(_even(x.repeat_interleave(group, dim=1), -1).transpose(1, 2).to(io_dtype).contiguous() for x in (phi_k, v)),
        g=log_decay.repeat_interleave(group, dim=1).transpose(1, 2).contiguous(),  # fp32 (the compute dtype)
        scale=1.0,
        initial_state=_even(_even(state.repeat_interleave(group, dim=1), -1), -2).contiguous(),
        output_final_state=True,
    )
    numerator = out[..., :width].transpose(1, 2).to(q.dtype).reshape(batch, kv_heads, group, length, width)
    final_state = final.view(batch, kv_heads, group, *final.shape[2:])[:, :, 0, :features, :width].to(q.dtype)
    return numerator, final_state


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
    final = e^{G_L} h0 + sum_s e^{G_L - G_s} k_s v_s^T, with G the cumulative sum of g (0 without g)."""
    dtype = q.dtype
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

"""Chunked linear attention through flash-linear-attention's kernel (GPU).

Same contract as `ops.linear.chunked_linear_attention` (which is its reference): grouped q
`[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v `[B, Hkv, L, Dv + 1]` (values and a column
of ones, zero at padding), state `[B, Hkv, F, Dv + 1]`. The features are computed here in
float32 (so learned maps such as hedgehog get their gradients through autograd), then handed to
`chunk_simple_gla` (no decay, scale 1) in the caller's dtype (bfloat16 for a bfloat16 model);
fla accumulates in float32, and the state stays in the compute dtype (float32 or float64).
fla wants as many key heads as query heads, so keys, values and the state are repeated over
the G query heads of a group; the G copies of the final state are equal and one is kept. Its
backward in half precision wants even feature and value widths: an odd one (Dv + 1 = 65) gets
a zero column, which adds nothing to any sum, and is cut off again.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the final state, in q's dtype."""
    batch, kv_heads, group, length, _ = q.shape
    heads, (features, width) = kv_heads * group, state.shape[-2:]
    phi_q = _even(kernel.query_features(q).reshape(batch, heads, length, -1), -1)
    phi_k = _even(kernel.key_features(k).repeat_interleave(group, dim=1), -1)
    values = _even(v.repeat_interleave(group, dim=1), -1)
    initial = _even(_even(state.repeat_interleave(group, dim=1), -1), -2).contiguous()
    out, final = chunk_function(
        *(x.transpose(1, 2).to(io_dtype).contiguous() for x in (phi_q, phi_k, values)),
        scale=1.0,
        initial_state=initial,
        output_final_state=True,
    )
    out = out[..., :width].transpose(1, 2).to(q.dtype).reshape(batch, kv_heads, group, length, width)
    final = final.view(batch, kv_heads, group, *final.shape[2:])[:, :, 0, :features, :width]
    return out, final.to(q.dtype).contiguous()  # one copy per KV head, not a view of all G


def chunk_simple_gla_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_simple_gla` without decay, in float64 PyTorch (tests; time-major `[B, L, H, *]`):
    o_t = scale (sum_{s<=t} (q_t.k_s) v_s + q_t h0), final = h0 + sum_s k_s v_s^T."""
    dtype = q.dtype
    q, k, v, h0 = q.double(), k.double(), v.double(), initial_state.double()
    scores = torch.einsum("bthf,bshf->bhts", q, k).tril()
    out = scale * (torch.einsum("bhts,bshv->bthv", scores, v) + torch.einsum("bthf,bhfv->bthv", q, h0))
    final = h0 + torch.einsum("bthf,bthv->bhfv", k, v)
    return out.to(dtype), final.to(initial_state.dtype) if output_final_state else None

"""The single functional entry point: `attention(q, k, v, spec, mode=...)`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_softmax_rnn.attention_spec import DEFAULT_MAX_STATE_BYTES, MODES, AttentionSpec
from hf_softmax_rnn.ops.chunked import chunked_kernel_attention
from hf_softmax_rnn.ops.feature_maps import chunk_kernel
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.linear import chunked_linear_attention, recurrent_linear_attention
from hf_softmax_rnn.ops.normalizers import normalize
from hf_softmax_rnn.ops.parallel import parallel_scores, visible_counts
from hf_softmax_rnn.ops.softmax import softmax_attention

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class RecurrentState:
    """State of one layer after t visible positions, per KV head (never per query head).

    `packed` `[B, Hkv, F, Dv + 1]` holds S = sum_s phi(k_s) v_s^T in its first Dv columns
    and z = sum_s phi(k_s) in the last, so that decoding updates one tensor in place of
    two; `t` `[B]` counts the visible (non-padding) positions so far.
    """

    packed: torch.Tensor
    t: torch.Tensor

    @property
    def S(self) -> torch.Tensor:
        """`[B, Hkv, F, Dv]` numerator state."""
        return self.packed[..., :-1]

    @property
    def z(self) -> torch.Tensor:
        """`[B, Hkv, F]` denominator state."""
        return self.packed[..., -1]

    @classmethod
    def zeros(cls, batch: int, kv_heads: int, feature_dim: int, value_dim: int, device=None, dtype=None) -> "RecurrentState":
        return cls(
            packed=torch.zeros(batch, kv_heads, feature_dim, value_dim + 1, device=device, dtype=dtype),
            t=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.packed, self.t))

    def map(self, fn) -> "RecurrentState":
        """Apply `fn` to each tensor (index_select, repeat_interleave, ...) along the batch."""
        return RecurrentState(fn(self.packed), fn(self.t))


def _check_inputs(q, k, v, spec, mode, attention_mask, gates, state, params) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q [B, H, L, D] and k, v [B, Hkv, L, D]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention got mismatched shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if mode not in MODES:
        raise ValueError(f"attention: mode={mode!r} is not allowed; expected one of {list(MODES)}")
    if mode != "parallel" and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention: mode={mode!r} needs as many keys as queries (the past lives in `state`)")
    if mode == "parallel" and state is not None:
        raise ValueError("attention: mode='parallel' takes no state; pass past keys and values in k, v instead")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != q.shape[0]):
        raise ValueError(f"attention_mask must be a 2-D padding mask [B, L_total]; got shape {tuple(attention_mask.shape)}")
    if attention_mask is not None and attention_mask.shape[1] < k.shape[-2]:
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, fewer than the {k.shape[-2]} keys")
    for name, wanted in (("input", spec.input_gate), ("output", spec.output_gate)):
        if wanted and name not in gates:
            raise ValueError(f"{spec.describe()} needs gates[{name!r}]; got gates with keys {sorted(gates)}")
    if spec.effective_feature_map == "hedgehog" and not {"hedgehog_q", "hedgehog_k"} <= set(params):
        raise ValueError("feature_map='hedgehog' needs params['hedgehog_q'] [H, D, F] and params['hedgehog_k'] [Hkv, D, F]")
    if spec.normalizer == "seqlen_pow" and "seqlen_power" not in params:
        raise ValueError("normalizer='seqlen_pow' needs params['seqlen_power'] [H] (the learned exponent logit)")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    *,
    mode: str = "parallel",
    attention_mask: torch.Tensor | None = None,
    gates: Mapping[str, torch.Tensor] | None = None,
    state: RecurrentState | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
) -> tuple[torch.Tensor, RecurrentState | None]:
    """Causal attention of any variant in any of the three modes.

    Args:
        q: `[B, H, L, D]` queries (after RoPE); H a multiple of Hkv.
        k, v: `[B, Hkv, Lk, D]` keys and values. In parallel mode Lk >= L and the queries are
            the last L positions (decoding from a KV cache); otherwise Lk == L.
        spec: the attention variant.
        mode: "parallel" (masked L x L, every variant), "chunked" or "recurrent" (finite
            state only: linear feature maps or Taylor order N, no score clamp).
        attention_mask: `[B, L_total]` padding mask (1 = token, 0 = padding; left padding
            supported); its last Lk (parallel) or L (chunked/recurrent) columns are used.
        gates: {"input": `[B, Hkv, L]`, "output": `[B, H, L]`} sigmoid gate values, as the spec asks.
        state: the `RecurrentState` from the previous call (chunked/recurrent), None = empty.
        params: learned tensors of the variant: "norm_weight"/"norm_bias" `[H, Dv]`,
            "seqlen_power" `[H]`, "hedgehog_q" `[H, D, F]`, "hedgehog_k" `[Hkv, D, F]`.
        max_state_bytes: largest per-KV-head state the finite modes accept.

    Returns:
        `([B, H, L, Dv] output, new RecurrentState or None in parallel mode)`.
    """
    gates, params = gates or {}, params or {}
    _check_inputs(q, k, v, spec, mode, attention_mask, gates, state, params)
    spec.check_mode(mode, q.shape[-1], max_state_bytes)
    batch, heads, length, head_dim = q.shape
    kv_heads, value_dim = k.shape[1], v.shape[-1]
    scale = spec.scale(head_dim)
    key_len = k.shape[-2] if mode == "parallel" else length
    if attention_mask is None:
        key_mask = torch.ones(batch, key_len, dtype=torch.bool, device=q.device)
    else:
        key_mask = attention_mask[:, -key_len:].bool()

    if spec.kind == "softmax":
        return softmax_attention(q, k, v, None if attention_mask is None else key_mask, scale), None

    out_dtype = q.dtype
    compute_dtype = torch.float32 if out_dtype in _HALF_DTYPES else out_dtype
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, length, head_dim)
    if spec.input_gate:
        v = v * gates["input"].unsqueeze(-1).to(compute_dtype)

    new_state = None
    if mode == "parallel":
        scores = parallel_scores(grouped_q, k, key_mask, spec, params)
        numerator = grouped_matmul(scores, v)
        denominator = scores.sum(-1)
        visible = visible_counts(key_mask, length)
    else:
        token = key_mask.to(compute_dtype)[:, None, :, None]
        augmented_v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) * token
        if state is None:
            state = RecurrentState.zeros(batch, kv_heads, spec.feature_dim(head_dim), value_dim, q.device, compute_dtype)
        packed = state.packed.to(compute_dtype)
        kernel = chunk_kernel(spec, scale) if mode == "chunked" else None
        if kernel is not None:
            augmented, packed = chunked_kernel_attention(grouped_q, k, augmented_v, packed, kernel, spec.chunk_size)
        elif mode == "chunked":
            augmented, packed = chunked_linear_attention(grouped_q, k, augmented_v, packed, spec, scale, params, spec.chunk_size)
        else:
            augmented, packed = recurrent_linear_attention(grouped_q, k, augmented_v, packed, spec, scale, params)
        numerator, denominator = augmented[..., :value_dim], augmented[..., value_dim]
        visible = state.t[:, None, None] + key_mask.long().cumsum(-1)[:, None, :]
        new_state = RecurrentState(packed=packed, t=visible[:, 0, -1])

    out = normalize(
        numerator.reshape(batch, heads, length, value_dim),
        denominator.reshape(batch, heads, length),
        visible,
        spec,
        params,
        gates.get("output") if spec.output_gate else None,
    )
    return out.to(out_dtype), new_state

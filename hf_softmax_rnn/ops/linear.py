"""Finite-state attention (linear feature maps and Taylor-N exp) in chunked and recurrent form.

Both compute the augmented numerator N'_t = sum_{s<=t} k(q_t, k_s) [v_s, 1] = [N_t, G_t]:
the value carries a trailing column of ones so that the denominator G_t rides along with
the numerator and one state S' = [S, z] (`[B, Hkv, F, Dv + 1]`) holds both.
Padding is handled by the caller by zeroing the augmented values of padded positions.

Shapes: grouped q `[B, Hkv, G, L, D]`, k `[B, Hkv, L, D]`, augmented v `[B, Hkv, L, Dv + 1]`,
state `[B, Hkv, F, Dv + 1]`.

- `chunked_linear_attention`: quadratic inside chunks of C positions, state carried between
  chunks, in the hand-written engine of `ops.chunked` (every kernel, with or without decay), which
  builds no L x L matrix and keeps no `[L, F]` features for the backward pass (a pass may hold them
  while it runs, for maps at most 2D wide). Under torch.compile the
  chunk loop is traced as plain autograd instead (`generic_chunked_linear_attention`, and
  `ops.decay`'s loop with decay), and those loops are also the engine's references in tests.
- On CUDA tensors with fla-core installed, `chunked_linear_attention` hands feature maps of at
  most 256 features to flash-linear-attention's kernel (`ops.fla_linear`, `ops.backends`).
- `recurrent_linear_attention`: one position at a time; the slow, obviously-correct form
  that decoding uses (L = 1) and the tests compare against.

Both take optional per-position log-decays `[B, Hkv, L]` (a data-dependent forget gate, see
`ops.decay`): the state is multiplied by their exp before each position's key enters. The chunked
form then runs fla's gated kernel on a GPU and the engine elsewhere.
"""

from __future__ import annotations

import torch

from hf_softmax_rnn.ops.backends import fla_linear_function, note_pytorch_form
from hf_softmax_rnn.ops.chunked import chunked_kernel_attention
from hf_softmax_rnn.ops.decay import chunked_decayed_linear_attention
from hf_softmax_rnn.ops.delta import chunked_delta_attention, recurrent_delta_attention
from hf_softmax_rnn.ops.fla_linear import fla_chunked_linear_attention
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import FeatureKernel


def _chunk_slices(length: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _chunk_terms(kernel: FeatureKernel, qc, kc, vc) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features and intra-chunk output of one chunk: (phi(q) `[B, Hkv, G, C, F]`, phi(k)
    `[B, Hkv, C, F]`, intra `[B, Hkv, G, C, Dv']`)."""
    size = kc.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=kc.device).tril()
    intra = grouped_matmul(kernel.scores(qc, kc).masked_fill(~causal, 0.0), vc)
    return kernel.query_features(qc), kernel.key_features(kc), intra


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    chunk_size: int,
    io_dtype: torch.dtype | None = None,
    log_decay: torch.Tensor | None = None,
    empty_state: bool = False,
    final_state: bool = True,
    delta_strength: torch.Tensor | None = None,
    additive_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last position.
    `io_dtype`: the dtype a fused GPU kernel reads the features in (default q's); `log_decay`
    `[B, Hkv, L]`: the decay of the state at each position (None = no decay); `empty_state`: `state`
    is zero, which the fused kernel then need not read; `final_state=False`: the caller discards the
    state after the call (training), which the fused kernel then neither writes nor returns (None).
    `delta_strength` `[B, Hkv, L]`: the write strengths of a delta-rule state (`ops.delta`, which has no
    fused kernel: it runs in PyTorch on every device); None = the additive state. `additive_mass`: the
    delta-rule state's recall is weighed by an additive mass (`ops.delta`)."""
    if delta_strength is not None:
        note_pytorch_form(q.device.type, io_dtype or q.dtype, "the delta rule")
        return chunked_delta_attention(q, k, v, delta_strength, state, kernel, chunk_size, log_decay, additive_mass)
    io_dtype = io_dtype or q.dtype
    chunk_function = fla_linear_function(q.device.type, io_dtype, state.shape[-2], kernel.clamp)
    if chunk_function is not None:
        return fla_chunked_linear_attention(
            q, k, v, state, kernel, io_dtype, chunk_function, log_decay, empty_state, final_state
        )
    if torch.compiler.is_compiling():  # the engine's preallocated out= buffers do not trace
        if log_decay is not None:
            return chunked_decayed_linear_attention(q, k, v, log_decay, state, kernel, chunk_size)
        return generic_chunked_linear_attention(q, k, v, state, kernel, chunk_size)
    return chunked_kernel_attention(q, k, v, state, kernel, chunk_size, log_decay)


def generic_chunked_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, kernel: FeatureKernel, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop through autograd, for any kernel: the engine's reference, and the path under
    torch.compile, which traces the loop as it is (autograd then keeps each chunk's features)."""
    outputs, running = [], state
    for sl in _chunk_slices(q.shape[-2], chunk_size):
        phi_q, phi_k, intra = _chunk_terms(kernel, q[..., sl, :], k[..., sl, :], v[..., sl, :])
        outputs.append(intra + grouped_matmul(phi_q, running))
        running = running + phi_k.mT @ v[..., sl, :]
    if not outputs:
        return q.new_empty(*q.shape[:-1], v.shape[-1]), running
    return torch.cat(outputs, dim=-2), running


def recurrent_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    in_place: bool = False,
    log_decay: torch.Tensor | None = None,
    delta_strength: torch.Tensor | None = None,
    additive_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S'_t = a_t S'_{t-1} + phi(k_t) v'_t^T, out_t = phi(q_t) S'_t, one position at a time, with
    a_t = exp(`log_decay` `[B, Hkv, L]`) or 1 without it.
    `in_place`: update `state` itself (decoding without autograd: one read and one write of the
    state per step instead of a new tensor that a cache then copies back). `delta_strength`
    `[B, Hkv, L]`: a delta-rule state's write strengths (`ops.delta`, with `additive_mass` weighed by an
    additive mass); None = the additive state."""
    if delta_strength is not None:
        return recurrent_delta_attention(q, k, v, delta_strength, state, kernel, in_place, log_decay, additive_mass)
    phi_q = kernel.query_features(q)
    phi_k = kernel.key_features(k)
    outputs = []
    for t in range(q.shape[-2]):
        step_decay = None if log_decay is None else log_decay.narrow(-1, t, 1)
        state = recurrent_state_step(state, phi_k.select(-2, t), v.select(-2, t), in_place, step_decay)
        outputs.append(grouped_matmul(phi_q.narrow(-2, t, 1), state))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)), state  # (decoding: no copy)


def recurrent_state_step(
    state: torch.Tensor,
    key_features: torch.Tensor,
    value: torch.Tensor,
    in_place: bool = False,
    log_decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """The additive state after one position, S' = a S + phi(k) v'^T: state `[B, Hkv, F, Dv']`, key features
    `[B, Hkv, F]`, value `[B, Hkv, Dv']`, a = exp(`log_decay` `[B, Hkv, 1]`) or 1 without it; in place as
    `recurrent_linear_attention` takes `in_place`."""
    if log_decay is not None:
        factor = log_decay.exp().unsqueeze(-1)  # [B, Hkv, 1, 1]
        state = state.mul_(factor) if in_place else state * factor
    return _add_outer_product(state, key_features, value, in_place)


def _add_outer_product(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, in_place: bool) -> torch.Tensor:
    """state `[B, Hkv, F, Dv']` + key `[B, Hkv, F]` value^T `[B, Hkv, Dv']` as one batched product-and-add,
    which writes the state once (a product, then an addition, would write it twice)."""
    rows, columns = key.reshape(-1, key.shape[-1], 1), value.reshape(-1, 1, value.shape[-1])
    if in_place and state.is_contiguous():
        state.view(-1, *state.shape[-2:]).baddbmm_(rows, columns)
        return state
    if in_place:
        return state.add_(key[..., :, None] * value[..., None, :])
    return torch.baddbmm(state.reshape(-1, *state.shape[-2:]), rows, columns).view(state.shape)

"""One decoding step of a sliding-window hybrid: window, sinks and kept keys in one exact part.

A call of L positions computes the exact part block by block: the window (`ops.window`), then the
sinks (`ops.sinks`) and the kept keys (`ops.kept`), each with its own row max, merged under the
joint one. A decoding step has one query, which sees at most W + S + K exact keys: the last W
positions (the leaving key out, the new one in), the sink slots filled so far and the kept slots in
use. `window_hybrid_step` scores them with one masked exp under one row max, as `[B * Hkv, G, N]`
products over the three buffers as they lie (the kept keys are read in place, never copied), and
finds the leaving key's rank and sink status from the window's visible count, without ranking the
window: fewer tensor operations than the block forms (under 200 against about 560 for the finetune
default's spec; on a CPU, and on a GPU without CUDA graphs, a decoding step costs about one dispatch
per operation). Its outputs and state are those of the block forms (tested against them in float64).

The window buffers are a ring: the new position is written over the leaving one, in the slot
`state.window_start` names, which then moves on by one. A step in place (decoding without autograd)
so writes one row of each buffer instead of shifting all W; the softmax over the window does not
depend on the order of its keys. The block forms read the buffers in position order
(`window_in_order`).

Shapes: grouped q `[B, Hkv, G, 1, D]`, k `[B, Hkv, 1, D]`, augmented v `[B, Hkv, 1, Dv + 1]`
(a trailing weight column: 1 at a token, 0 at padding), key_mask `[B, 1]` bool.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.kept import exchange_slots, kept_step, write_slots
from hf_softmax_rnn.ops.kernels import FeatureKernel, finite_or_zero, row_shift, soft_cap
from hf_softmax_rnn.ops.linear import recurrent_linear_attention, recurrent_state_step
from hf_softmax_rnn.ops.recurrent_state import RecurrentState
from hf_softmax_rnn.ops.window import mix_weight


def window_hybrid_step(
    q: torch.Tensor,
    k: torch.Tensor,
    augmented_v: torch.Tensor,
    key_mask: torch.Tensor,
    state: RecurrentState,
    kernel: FeatureKernel,
    spec: AttentionSpec,
    scale: float,
    linear_log_scale: torch.Tensor,
    in_place: bool = False,
    log_decay: torch.Tensor | None = None,
    delta_strength: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, RecurrentState]:
    """The augmented numerator `[B, Hkv, G, 1, Dv + 1]` of one position and the state after it (its
    `t` and `made_by` are left to the caller).

    Args:
        q, k, augmented_v, key_mask: the step's query, key, augmented value and padding mask.
        state: the state before the step (window buffer, and sink and kept buffers where the spec
            has them). kernel: the finite-state kernel. spec: a spec with a window.
        scale: multiplier of q.k in the exact part. linear_log_scale: `[H]` log weight of the
            finite-state part.
        in_place, log_decay, delta_strength: as `ops.linear.recurrent_linear_attention` takes them
            (`[B, Hkv, 1]`).
        softcap: the cap of the exact scores (window, sinks, kept keys; `ops.kernels.soft_cap`), None for none.
    """
    dtype, window, sinks = q.dtype, spec.window, spec.sinks
    batch, kv_heads, groups = q.shape[:3]
    slot = ring_start(state).unsqueeze(1)  # [B, 1]: the leaving (oldest) position's slot, the new one's
    following = (slot + 1) % window  # the slot of the next oldest position, the ring's next start
    seen_before = state.t.unsqueeze(1)  # [B, 1]: visible positions before the step
    if sinks is not None or spec.kept is not None:
        leaving_valid = state.window_valid.gather(1, slot)  # [B, 1]
        # the visible rank of the window's oldest visible key (the leaving one's, where it is visible)
        oldest_rank = seen_before - state.window_valid.sum(-1, keepdim=True)
    rows = slot.view(batch, 1, 1, 1)
    leaving_key, window_keys = exchange_slots(state.window_keys.to(dtype), 2, rows.expand(k.shape), k, in_place)
    leaving_value, window_values = exchange_slots(
        state.window_values.to(dtype), 2, rows.expand(augmented_v.shape), augmented_v, in_place
    )
    window_valid = write_slots(state.window_valid, 1, slot, key_mask, in_place)  # [B, W], slot order
    fields = dict(window_keys=window_keys, window_values=window_values, window_valid=window_valid)
    fields["window_start"] = following.view(batch)
    visible, candidate = window_valid, None if sinks is None and spec.kept is None else leaving_valid
    keys, values = [window_keys], [window_values]
    hidden = [None]  # the window's, below
    if sinks is not None:
        leaving_sink = leaving_valid & (oldest_rank < sinks)
        candidate = leaving_valid & ~leaving_sink  # the leaving key may be kept or enter the state
        leaving_value = leaving_value.masked_fill(leaving_sink.view(batch, 1, 1, 1), 0.0)  # a sink never enters
        slots = torch.arange(sinks, device=q.device)
        written = ((slots == seen_before) & key_mask).view(batch, 1, sinks, 1)  # the new key's sink slot
        fields["sink_keys"] = torch.where(written, k, state.sink_keys.to(dtype))
        fields["sink_values"] = torch.where(written, augmented_v, state.sink_values.to(dtype))
        seen = seen_before + key_mask  # [B, 1] long: visible positions up to the new one
        keys.append(fields["sink_keys"])
        values.append(fields["sink_values"])
        hidden.append((slots >= seen).unsqueeze(1).expand(-1, kv_heads, -1))
        visible = _window_without_sinks(window_valid, following, seen, sinks)
    hidden[0] = (~visible).unsqueeze(1).expand(-1, kv_heads, -1)
    if spec.kept is not None:
        window_scores = state.window_scores.to(dtype)
        score_rows = slot.view(batch, 1, 1).expand(-1, kv_heads, -1)  # [B, Hkv, 1]
        leaving_saliency = window_scores.gather(2, score_rows)  # final: no later query has it in its window
        leaving_rank = torch.maximum(leaving_saliency, state.left_score.to(dtype).unsqueeze(-1))
        buffers = (
            state.kept_keys.to(dtype),
            state.kept_values.to(dtype),
            state.kept_scores.to(dtype),
            state.kept_positions,
            state.kept_valid,
        )
        leaving_key, leaving_value, buffers = kept_step(
            leaving_key, leaving_value, leaving_rank, oldest_rank, candidate, buffers, in_place
        )
        names = ("kept_keys", "kept_values", "kept_scores", "kept_positions", "kept_valid")
        fields.update(zip(names, buffers, strict=True))
        keys.append(buffers[0])
        values.append(buffers[1])
        hidden.append(~buffers[4])

    # one masked exp over the exact keys (window, sinks, kept) under one row max: [B * Hkv, G, N] products
    pairs = batch * kv_heads
    scaled_q = (q * scale).reshape(pairs, groups, -1)
    scores = [torch.bmm(scaled_q, part.reshape(pairs, *part.shape[2:]).mT) for part in keys]  # (keys not copied)
    x = (torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]).view(batch, kv_heads, groups, -1)
    x = soft_cap(x, softcap).masked_fill(
        (torch.cat(hidden, dim=-1) if len(hidden) > 1 else hidden[0]).unsqueeze(2), -torch.inf
    )
    row_max = row_shift(x)  # [B, Hkv, G, 1]
    weights = torch.exp(x - row_max).view(pairs, groups, -1)
    numerator, start = None, 0
    for part in values:
        size = part.shape[2]
        part_weights, part = weights.narrow(-1, start, size), part.reshape(pairs, size, -1)
        numerator = torch.bmm(part_weights, part) if numerator is None else numerator.baddbmm_(part_weights, part)
        start += size
    if spec.kept is not None:
        fields["left_score"] = leaving_saliency.squeeze(-1)
        entered = write_slots(window_scores, 2, score_rows, 0.0, in_place)  # the new key has no saliency yet
        fields["window_scores"] = torch.maximum(entered, _saliency(x.narrow(-1, 0, window).detach(), key_mask))
    mix = mix_weight(linear_log_scale, row_max.unsqueeze(-1), kv_heads)  # [B, Hkv, G, 1, 1]
    if delta_strength is not None:
        linear, fields["packed"] = recurrent_linear_attention(
            q,
            leaving_key,
            leaving_value,
            state.packed.to(dtype),
            kernel,
            in_place,
            log_decay,
            delta_strength,
            spec.additive_mass,
        )
        return numerator.view(linear.shape) + linear * mix, dataclasses.replace(state, **fields)
    entering = kernel.key_features(leaving_key).squeeze(-2), leaving_value.squeeze(-2)
    packed = recurrent_state_step(state.packed.to(dtype), *entering, in_place, log_decay)
    features, factor = kernel.query_features_and_factor(q)  # [B, Hkv, G, 1, F]: phi(q) / factor
    # the finite-state part, phi(q) S' e^{lambda - m}, added to the exact part's numerator in one product
    weighted = features.reshape(pairs, groups, -1) * mix.view(pairs, groups, 1)
    numerator.baddbmm_(weighted, packed.reshape(pairs, *packed.shape[2:]), alpha=factor)
    fields["packed"] = packed
    return numerator.view(batch, kv_heads, groups, 1, -1), dataclasses.replace(state, **fields)


def _window_without_sinks(
    window_valid: torch.Tensor, following: torch.Tensor, seen: torch.Tensor, sinks: int
) -> torch.Tensor:
    """`[B, W]` bool, slot order: the visible window keys after a step that are not sinks (a sink is
    scored from the sink buffer). `following` `[B, 1]`: the slot of the oldest position; `seen` `[B, 1]`:
    the visible positions so far. In position order the n visible keys hold the ranks seen - n to
    seen - 1, so the one that is the c-th of them is a sink (rank < S) where c <= S + n - seen."""
    window = window_valid.shape[1]
    order = (torch.arange(window, device=seen.device) + following) % window  # [B, W]: slots, oldest first
    in_order = window_valid.gather(1, order)
    up_to = in_order.cumsum(-1)  # visible keys up to each, in position order
    not_sink = in_order & (up_to > up_to[:, -1:] + (sinks - seen))
    return torch.empty_like(window_valid).scatter_(1, order, not_sink)


def _saliency(window_scores: torch.Tensor, query_valid: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, W]` the largest window-softmax weight of each window key over the query heads, from the
    masked scores `[B, Hkv, G, W]` (0 for a padding query), as `ops.window` computes it for a block."""
    probabilities = finite_or_zero(torch.softmax(window_scores, dim=-1))  # (a row with nothing visible: NaN -> 0)
    return probabilities.amax(dim=2) * query_valid[:, :, None]  # (0 where the bool is False)


def ring_start(state: RecurrentState) -> torch.Tensor:
    """`[B]` long: the slot of the oldest position in the state's window buffers (0 for a state without
    `window_start`, built in position order)."""
    if state.window_start is not None:
        return state.window_start
    return torch.zeros(state.t.shape, dtype=torch.long, device=state.t.device)


def window_in_order(state: RecurrentState) -> RecurrentState:
    """`state` with its window buffers (keys, values, validity, saliencies) in position order, oldest
    first, and `window_start` 0: what the block forms read. One gather of the W rows of each (a state
    without a window is returned as it is)."""
    if state.window_keys is None:
        return state
    batch, _, window, _ = state.window_keys.shape
    order = (ring_start(state)[:, None] + torch.arange(window, device=state.t.device)) % window  # [B, W]
    ordered = {"window_start": torch.zeros_like(order[:, 0]), "window_valid": state.window_valid.gather(1, order)}
    for name in ("window_keys", "window_values", "window_scores"):
        buffer = getattr(state, name)
        if buffer is not None:
            index = order.view(batch, 1, window, *[1] * (buffer.dim() - 3))
            ordered[name] = buffer.gather(2, index.expand(buffer.shape))
    return dataclasses.replace(state, **ordered)

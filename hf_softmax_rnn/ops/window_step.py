"""One decoding step of a sliding-window hybrid: window, sinks and kept keys in one exact part.

A call of L positions computes the exact part block by block: the window (`ops.window`), then the
sinks (`ops.sinks`) and the kept keys (`ops.kept`), each with its own row max, merged under the
joint one. A decoding step has one query, which sees at most W + S + K exact keys: the last W
positions (the leaving key out, the new one in), the sink slots filled so far and the kept slots in
use. `window_hybrid_step` scores them with one masked exp under one row max: fewer tensor operations
than the block forms (about 220 against about 560 for the finetune default's spec; on a CPU, and on a GPU
without CUDA graphs, a decoding step costs about one dispatch per operation), and the kept keys are
read in place, never copied. Its outputs and state are those of the block forms (tested against
them in float64).

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
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kept import exchange_slots, kept_step, write_slots
from hf_softmax_rnn.ops.kernels import FeatureKernel, finite_or_zero, row_shift
from hf_softmax_rnn.ops.linear import recurrent_linear_attention
from hf_softmax_rnn.ops.recurrent_state import RecurrentState
from hf_softmax_rnn.ops.sinks import visible_ranks
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
    """
    dtype, window, kv_heads = q.dtype, spec.window, k.shape[1]
    slot = ring_start(state)[:, None]  # [B, 1]: the leaving (oldest) position's slot, the new one's
    following = slot + 1  # [B, 1]: the next oldest position's slot (mod W), the ring's next start
    if spec.sinks is not None or spec.kept is not None:
        offsets = torch.arange(window, device=q.device)
        # in position order: the leaving key, the W - 1 that stay, the new one
        valid = torch.cat([state.window_valid.gather(1, (slot + offsets) % window), key_mask], dim=-1)
        ranks = visible_ranks(valid, state.t, window)
        candidate = valid  # may be scored as a window or kept key (visible, not a sink)
    rows = slot[:, :, None, None]  # [B, 1, 1, 1]
    key_rows, value_rows = rows.expand(k.shape), rows.expand(augmented_v.shape)
    leaving_key, window_keys = exchange_slots(state.window_keys.to(dtype), 2, key_rows, k, in_place)
    leaving_value, window_values = exchange_slots(state.window_values.to(dtype), 2, value_rows, augmented_v, in_place)
    visible = write_slots(state.window_valid, 1, slot, key_mask, in_place)  # [B, W], slot order
    fields = dict(window_keys=window_keys, window_values=window_values, window_valid=visible)
    fields["window_start"] = (following % window)[:, 0]
    sinks = []
    if spec.sinks is not None:
        is_sink = valid & (ranks < spec.sinks)
        candidate = valid & ~is_sink
        leaving_value = leaving_value.masked_fill(is_sink[:, None, :1, None], 0.0)  # a sink never enters
        slots = torch.arange(spec.sinks, device=q.device)
        # `ops.sinks.filled_sinks` for one position (one slot written at most), in fewer operations
        written = ((ranks[:, -1:] == slots) & is_sink[:, -1:])[:, None, :, None]  # [B, 1, S, 1]
        fields["sink_keys"] = torch.where(written, k, state.sink_keys.to(dtype))
        fields["sink_values"] = torch.where(written, augmented_v, state.sink_values.to(dtype))
        seen = state.t[:, None] + key_mask  # [B, 1] long: visible positions up to the new one
        sinks = [(fields["sink_keys"], fields["sink_values"], (slots < seen)[:, None].expand(-1, kv_heads, -1))]
        # slot j holds position (j - slot - 1) % W of the window after the step, `valid[:, 1:]`
        visible = candidate[:, 1:].gather(1, (offsets - following) % window)
    # the exact part's (keys, values, visibility [B, Hkv, N]): the window, the sinks, the kept keys
    exact = [(window_keys, window_values, visible[:, None].expand(-1, kv_heads, -1)), *sinks]
    if spec.kept is not None:
        window_scores = state.window_scores.to(dtype)
        score_rows = rows[..., 0].expand(-1, kv_heads, -1)  # [B, Hkv, 1]
        leaving_saliency = window_scores.gather(2, score_rows)  # final: no later query has it in its window
        leaving_rank = torch.maximum(leaving_saliency, state.left_score.to(dtype)[..., None])
        buffers = (
            state.kept_keys.to(dtype),
            state.kept_values.to(dtype),
            state.kept_scores.to(dtype),
            state.kept_positions,
            state.kept_valid,
        )
        leaving_key, leaving_value, buffers = kept_step(
            leaving_key, leaving_value, leaving_rank, ranks[:, :1], candidate[:, :1], buffers, in_place
        )
        names = ("kept_keys", "kept_values", "kept_scores", "kept_positions", "kept_valid")
        fields.update(zip(names, buffers, strict=True))
        exact.append((buffers[0], buffers[1], buffers[4]))

    keys, values, visible = zip(*exact, strict=True)
    scaled_q = q * scale
    scores = [grouped_matmul(scaled_q, part.mT) for part in keys]  # (no copy of the keys: they are large)
    visible = torch.cat(visible, dim=-1) if len(visible) > 1 else visible[0]
    x = (torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]).masked_fill(
        ~visible[:, :, None, None], -torch.inf
    )
    row_max = row_shift(x)  # [B, Hkv, G, 1, 1]
    weights = torch.exp(x - row_max).split([part.shape[2] for part in keys], dim=-1)
    numerator = grouped_matmul(weights[0], values[0])
    for part_weights, part in zip(weights[1:], values[1:], strict=True):
        numerator = numerator + grouped_matmul(part_weights, part)
    if spec.kept is not None:
        fields["left_score"] = leaving_saliency[..., 0]
        entered = write_slots(window_scores, 2, score_rows, 0.0, in_place)  # the new key has no saliency yet
        fields["window_scores"] = torch.maximum(entered, _saliency(x[..., :window].detach(), key_mask))
    linear, fields["packed"] = recurrent_linear_attention(
        q, leaving_key, leaving_value, state.packed.to(dtype), kernel, in_place, log_decay, delta_strength
    )
    return numerator + linear * mix_weight(linear_log_scale, row_max, kv_heads), dataclasses.replace(state, **fields)


def _saliency(window_scores: torch.Tensor, query_valid: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, W]` the largest window-softmax weight of each window key over the query heads, from the
    masked scores `[B, Hkv, G, 1, W]` (0 for a padding query), as `ops.window` computes it for a block."""
    probabilities = finite_or_zero(torch.softmax(window_scores, dim=-1))  # (a row with nothing visible: NaN -> 0)
    return probabilities.amax(dim=(2, 3)) * query_valid[:, :, None]  # (0 where the bool is False)


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

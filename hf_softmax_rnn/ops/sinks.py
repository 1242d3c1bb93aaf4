"""Attention sinks: the first S visible positions, scored with the exact exp(q.k) beside the window.

A hybrid with sinks scores a key exactly when it is in the window (the last W positions) or
among the first S visible (non-padding) positions of the sequence, and with the finite-state
kernel otherwise, under one normaliser and one row shift m_t (the largest exact score of the
row):

    y_t = (sum_{s in E_t} e^{x_ts - m_t} v_s + e^{lambda - m_t} sum_{s <= t-W, s not a sink} phi(q_t).phi(k_s) v_s)
          / (same with v = 1),     E_t = window(t) u sinks(t)

A sink never enters the finite state (its augmented value is zeroed on the way in), and a sink
inside the window is counted once (the window skips it; the sink block scores it). The
recurrent state keeps the S sink keys and values in a buffer of fixed size, slot j holding the
j-th visible position, so that memory stays constant.

Shapes: grouped q `[B, Hkv, G, L, D]`, keys `[B, Hkv, L, D]`, augmented values
`[B, Hkv, L, Dv + 1]` (a trailing column of ones, zero at padding), masks `[B, L]` bool.
"""

from __future__ import annotations

import torch

from hf_softmax_rnn.ops.window import masked_exp_part, merge_exact


def sink_mask(key_mask: torch.Tensor, sinks: int) -> torch.Tensor:
    """`[B, Lk]` bool: the key is one of the first `sinks` visible keys (keys from the sequence start)."""
    return key_mask & (key_mask.cumsum(-1) <= sinks)


def visible_ranks(valid: torch.Tensor, seen: torch.Tensor, buffered: int) -> torch.Tensor:
    """`[B, W + L]` long: the 0-based rank of each key among the visible positions (meaningful where
    `valid`; a sink is a visible key of rank < S).

    Args:
        valid: `[B, W + L]` bool, the window buffer's validity then the call's padding mask: the
            valid buffer entries are the last visible positions before the call.
        seen: `[B]` visible positions before the call (the state's t); buffered: W, the length of the
            buffer part of `valid`.
    """
    in_buffer = valid[:, :buffered].sum(-1, keepdim=True)  # (sums and cumsums of bools are long)
    return seen[:, None] - in_buffer + valid.cumsum(-1) - 1


def filled_sinks(
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    k: torch.Tensor,
    augmented_v: torch.Tensor,
    is_sink: torch.Tensor,
    ranks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink buffers `[B, Hkv, S, D]`, `[B, Hkv, S, Dv + 1]` with this call's sinks (`is_sink`,
    `ranks` `[B, L]`) written to their slots; slots filled before the call are kept."""
    slots = torch.arange(sink_keys.shape[2], device=k.device)
    placement = ((ranks[..., None] == slots) & is_sink[..., None]).to(k.dtype)  # [B, L, S]
    return (
        sink_keys + torch.einsum("bls,bhld->bhsd", placement, k),
        sink_values + torch.einsum("bls,bhld->bhsd", placement, augmented_v),
    )


def add_sink_attention(
    q: torch.Tensor,
    window_numerator: torch.Tensor,
    window_max: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact part over window and sinks under one row shift.

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`.
        window_numerator, window_max: what `banded_exp_attention` returned (sinks left out of its
            window): `[B, Hkv, G, L, Dv + 1]` and `[B, Hkv, G, L, 1]`.
        sink_keys, sink_values: the sink buffers after this call's sinks were written.
        seen: `[B, L]` visible positions up to and including each query: slot j is visible to it
            when j < seen.
        scale: multiplier of q.k; softcap: the cap of the sinks' scores (`ops.kernels.soft_cap`), None for none.

    Returns:
        (`[B, Hkv, G, L, Dv + 1]` exact numerator, `[B, Hkv, G, L, 1]` joint row max, detached).
    """
    slots = torch.arange(sink_keys.shape[2], device=q.device)
    visible = (slots < seen[..., None])[:, None, None]  # [B, 1, 1, L, S]
    return merge_exact(
        window_numerator, window_max, *masked_exp_part(q, sink_keys, sink_values, visible, scale, softcap)
    )

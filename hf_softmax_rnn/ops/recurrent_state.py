"""The recurrent state a chunked or recurrent `attention` call returns and takes back, and its tag."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec


@dataclass
class RecurrentState:
    """State of one layer after t visible positions, per KV head (never per query head).

    `packed` `[B, Hkv, F, Dv + 1]` holds S = sum_s phi(k_s) v_s^T in its first Dv columns
    and z = sum_s phi(k_s) in the last, so that decoding updates one tensor in place of
    two; `t` `[B]` counts the visible (non-padding) positions so far.
    A sliding-window hybrid also keeps the last W positions exactly: `window_keys`
    `[B, Hkv, W, D]`, `window_values` `[B, Hkv, W, Dv + 1]` (values with a column of ones,
    zero for padding) and `window_valid` `[B, W]`; `packed` then sums only older positions.
    The window buffers are a ring: `window_start` `[B]` is the slot of the oldest of the W positions
    (None: 0), and a decoding step writes the new position into it (`ops.window_step`).
    Attention sinks keep the first S visible positions exactly as well: `sink_keys`
    `[B, Hkv, S, D]` and `sink_values` `[B, Hkv, S, Dv + 1]`, slot j holding the j-th visible
    position (valid once j < t; zero before); `packed` never sums a sink.
    Kept positions (`spec.kept` = K, `ops.kept`) add `window_scores` `[B, Hkv, W]` (the saliency so far
    of each window position), `left_score` `[B, Hkv]` (the saliency of the last key that left the
    window) and the K kept keys beyond the window: `kept_keys` `[B, Hkv, K, D]`, `kept_values`
    `[B, Hkv, K, Dv + 1]`, `kept_scores` `[B, Hkv, K]` (rank scores), `kept_positions` `[B, Hkv, K]`
    (visible ranks) and `kept_valid` `[B, Hkv, K]`; `packed` sums a key only once it is not kept.
    A short convolution (`spec.short_conv` = K) adds `conv_tail` `[B, Hkv, K - 1, D + Dv]`: the last K - 1
    keys and values before the convolution (`ops.short_conv`), which the attention layer applies and
    stores here; `attention` itself neither reads nor writes it.
    `made_by`: what made the state (`state_tag`: the spec, scale, head layout and score cap), compared by
    equality when it is passed back, so that a state of another spec is refused whatever its
    shapes; None for a state built by hand (only its shapes are checked).
    """

    packed: torch.Tensor
    t: torch.Tensor
    window_keys: torch.Tensor | None = None
    window_values: torch.Tensor | None = None
    window_valid: torch.Tensor | None = None
    window_start: torch.Tensor | None = None
    sink_keys: torch.Tensor | None = None
    sink_values: torch.Tensor | None = None
    window_scores: torch.Tensor | None = None
    left_score: torch.Tensor | None = None
    kept_keys: torch.Tensor | None = None
    kept_values: torch.Tensor | None = None
    kept_scores: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    kept_valid: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None
    made_by: tuple | None = None

    @property
    def S(self) -> torch.Tensor:
        """`[B, Hkv, F, Dv]` numerator state."""
        return self.packed[..., :-1]

    @property
    def z(self) -> torch.Tensor:
        """`[B, Hkv, F]` denominator state."""
        return self.packed[..., -1]

    @classmethod
    def zeros(
        cls,
        batch: int,
        kv_heads: int,
        feature_dim: int,
        head_dim: int,
        value_dim: int,
        window: int | None = None,
        device=None,
        dtype=None,
        sinks: int | None = None,
        kept: int | None = None,
    ) -> RecurrentState:
        """The state before any position (empty window, sink and kept buffers when `window`, `sinks`,
        `kept` are set)."""
        state = cls(
            packed=torch.zeros(batch, kv_heads, feature_dim, value_dim + 1, device=device, dtype=dtype),
            t=torch.zeros(batch, dtype=torch.long, device=device),
        )
        if window is not None:
            state.window_keys = torch.zeros(batch, kv_heads, window, head_dim, device=device, dtype=dtype)
            state.window_values = torch.zeros(batch, kv_heads, window, value_dim + 1, device=device, dtype=dtype)
            state.window_valid = torch.zeros(batch, window, dtype=torch.bool, device=device)
            state.window_start = torch.zeros(batch, dtype=torch.long, device=device)
        if sinks is not None:
            state.sink_keys = torch.zeros(batch, kv_heads, sinks, head_dim, device=device, dtype=dtype)
            state.sink_values = torch.zeros(batch, kv_heads, sinks, value_dim + 1, device=device, dtype=dtype)
        if kept is not None:
            state.window_scores = torch.zeros(batch, kv_heads, window, device=device, dtype=dtype)
            state.left_score = torch.zeros(batch, kv_heads, device=device, dtype=dtype)
            state.kept_keys = torch.zeros(batch, kv_heads, kept, head_dim, device=device, dtype=dtype)
            state.kept_values = torch.zeros(batch, kv_heads, kept, value_dim + 1, device=device, dtype=dtype)
            state.kept_scores = torch.zeros(batch, kv_heads, kept, device=device, dtype=dtype)
            state.kept_positions = torch.zeros(batch, kv_heads, kept, dtype=torch.long, device=device)
            state.kept_valid = torch.zeros(batch, kv_heads, kept, dtype=torch.bool, device=device)
        return state

    def tensors(self) -> list[torch.Tensor]:
        values = (getattr(self, field.name) for field in dataclasses.fields(self))
        return [value for value in values if isinstance(value, torch.Tensor)]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RecurrentState:
        """Apply `fn` to each tensor (index_select, repeat_interleave, ...) along the batch."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return RecurrentState(
            **{name: fn(value) if isinstance(value, torch.Tensor) else value for name, value in values.items()}
        )


def state_tag(
    spec: AttentionSpec,
    scale: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    value_dim: int,
    softcap: float | None = None,
) -> tuple:
    """What a state made by `spec` holds: every spec field but `chunk_size` (which changes how the
    state is computed, not what it holds), the q.k scale, the head layout and the cap of the exact
    scores (which ranked the kept keys), as (name, value) pairs."""
    fields = tuple((field.name, getattr(spec, field.name)) for field in dataclasses.fields(spec))
    layout = (
        ("scale", scale),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("value_dim", value_dim),
        ("softcap", softcap),
    )
    return tuple(item for item in fields if item[0] != "chunk_size") + layout

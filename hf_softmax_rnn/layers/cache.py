"""transformers cache layers that hold a recurrent state instead of keys and values.

`RecurrentStateLayer` (a `CacheLayerMixin`) and `StaticRecurrentStateLayer` (a `StaticLayer`)
both register under `RECURRENT_LAYER_TYPE` (through `CacheLayerMixin._layer_type`), so
`DynamicCache(config=...)` and `StaticCache(config=..., max_cache_len=...)` build one for every
layer whose `config.layer_types` entry names it; layers that keep exact softmax stay
`DynamicLayer`s (a growing KV cache) in the same dynamic `Cache`. Their memory is the state
(S, z, t) per KV head, `[B, Hkv, F, Dv + 1]` (S and z packed) plus `[B]` (and a window's last W
keys and values), whatever the number of tokens seen. The static layer allocates it once and
updates it in place, so its tensor addresses stay fixed (torch.compile, CUDA graphs).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, StaticLayer
from transformers.utils.import_utils import is_torchdynamo_compiling

from hf_softmax_rnn.ops.recurrent_state import RecurrentState

#: The `config.layer_types` entry of a layer decoded from a recurrent state.
RECURRENT_LAYER_TYPE = "softmax_rnn_recurrent"


class _RecurrentStateHolder:
    """What the dynamic and static recurrent cache layers share: their size, the refusal of the
    key/value API (the attention layer reads `state` and writes it with `update_state`) and of
    cropping (a state has summed the positions in)."""

    state: RecurrentState | None

    @property
    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError(
            f"{type(self).__name__} holds a recurrent state, not keys and values; the attention layer reads "
            "and writes it with `state` / `update_state` (was the layer given a cache built for another model?)"
        )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                f"{type(self).__name__} cannot remove {abs(tokens_to_remove)} tokens: a recurrent state has summed "
                "them in (assisted and speculative decoding need a croppable KV cache)"
            )


class RecurrentStateLayer(_RecurrentStateHolder, CacheLayerMixin):
    """The cache of one attention layer decoded from its recurrent state.

    `state` is None until the first forward; `cumulative_length` counts every position
    fed so far (padding included), which is what transformers calls the sequence length
    (position ids, mask sizes). The state's own `t` counts only visible positions per row.
    """

    _layer_type = RECURRENT_LAYER_TYPE
    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False
    holds_recurrent_state = True

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.state: RecurrentState | None = None
        self.cumulative_length = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seen={self.cumulative_length}, bytes={self.nbytes})"

    # ------------------------------------------------------------------ the recurrent state
    def update_state(self, state: RecurrentState, num_new_positions: int) -> None:
        """Store the state after `num_new_positions` more positions (padding included)."""
        self.state = state
        self.device = state.t.device
        self.cumulative_length += num_new_positions
        self.is_initialized = True

    # ------------------------------------------------------------------ CacheLayerMixin API
    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.cumulative_length = 0
        self.is_initialized = False

    def offload(self) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.state is not None and self.state.t.device != self.device:
            self.state = self.state.map(lambda x: x.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda x: x[indices])


class StaticRecurrentStateLayer(_RecurrentStateHolder, StaticLayer):
    """The recurrent state of one attention layer in a `StaticCache`: allocated at the first
    forward (the prefill, which fixes batch size, dtype and device) and then updated in place
    with `copy_`, so that a compiled decode step (CUDA graphs included) sees the same tensors
    every step. `cumulative_length` is a 0-d tensor (as in `StaticLayer`); `max_cache_len` is
    kept only because `StaticCache` passes it: the state does not grow with the length.
    """

    _layer_type = RECURRENT_LAYER_TYPE
    is_compileable = True
    is_croppable = False
    is_sliding = False
    supports_early_init = False
    holds_recurrent_state = True

    def __init__(self, max_cache_len: int, **kwargs) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.state: RecurrentState | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bytes={self.nbytes})"

    def update_state(self, state: RecurrentState, num_new_positions: int) -> None:
        """Copy the state after `num_new_positions` more positions into the fixed buffers
        (allocated on the first call)."""
        if self.state is None:
            self._allocate(state)
        for buffer, new in zip(self.state.tensors(), state.tensors(), strict=True):
            buffer.copy_(new)
        self.cumulative_length.add_(num_new_positions)

    def _allocate(self, state: RecurrentState) -> None:
        self.state = state.map(lambda x: torch.zeros(x.shape, dtype=x.dtype, device=x.device))
        self.device = state.t.device
        self.cumulative_length = self.cumulative_length.to(self.device)
        self._mark_static()
        self.is_initialized = True

    def _mark_static(self) -> None:
        if not is_torchdynamo_compiling():
            for tensor in (*self.state.tensors(), self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Only the new positions' padding is needed: the past lives in the state (a fixed mask shape)."""
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Zero the state in place (a zero state is the empty one: no positions, an empty window)."""
        if self.state is not None:
            for tensor in self.state.tensors():
                tensor.zero_()
        self.cumulative_length.zero_()

    def offload(self) -> None:
        raise ValueError(f"{type(self).__name__} keeps fixed tensor addresses and cannot be offloaded")

    def prefetch(self) -> None:
        """Nothing to fetch: the state never leaves its device."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            for tensor in self.state.tensors():
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda x: x.repeat_interleave(repeats, dim=0))
            self._mark_static()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda x: x[indices].contiguous())
            self._mark_static()


def recurrent_state_layer(cache: Cache, layer_idx: int) -> RecurrentStateLayer:
    """The `RecurrentStateLayer` of `cache` at `layer_idx`, created in a lazily-built cache
    (e.g. a bare `DynamicCache()`) if that slot does not exist yet or holds nothing."""
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(cache.layers):
        raise ValueError(f"The cache has {len(cache.layers)} layers; layer {layer_idx} has no slot in it")
    layer = cache.layers[layer_idx]
    if getattr(layer, "holds_recurrent_state", False):
        return layer
    if isinstance(layer, StaticLayer):
        raise TypeError(
            f"Cache layer {layer_idx} is a {type(layer).__name__}, but this attention layer decodes from a recurrent "
            "state; build the cache with StaticCache(config=model.config, ...) or DynamicCache(config=model.config)"
        )
    if layer.get_seq_length() == 0:
        cache.layers[layer_idx] = RecurrentStateLayer()
        return cache.layers[layer_idx]
    raise TypeError(
        f"Cache layer {layer_idx} is a {type(layer).__name__} that already holds keys and values, but this attention "
        "layer decodes from a recurrent state; build the cache with DynamicCache(config=model.config)"
    )


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by a cache: recurrent states plus cached keys and values."""
    total = 0
    for layer in cache.layers:
        if getattr(layer, "holds_recurrent_state", False):
            total += layer.nbytes
            continue
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total

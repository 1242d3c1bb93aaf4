"""Token-by-token decoding on a GPU with one CUDA-graph launch per token instead of one per kernel.

Eager decoding of a 30-layer model launches hundreds of small kernels per token, so on a GPU it is
bound by launch overhead, not by the bytes of its state. `GraphedDecodeStep` records one decode step
over a prefilled `StaticCache` (whose recurrent states and positions are tensors updated in place)
as a CUDA graph, then replays it per token. It needs no `torch.compile` (recording costs one
forward), and it gives the eager step's numbers.

    cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
    logits = model(input_ids=prompt, cache=cache, use_cache=True).logits   # prefill, eager
    step = GraphedDecodeStep(model, cache)
    token = logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        token = step(token)[:, -1:].argmax(-1)      # logits [B, 1, V], overwritten by the next step

A step feeds one new token per row with no attention mask. Recurrent layers kept the prompt's
padding out of their states at prefill, so left-padded prompts decode correctly when the caller
passes each row's `position_ids`; a KV layer (an unmodified transformers model) would attend to the
padded prompt positions, so `prompt_mask` with padding is refused for a model with KV layers.

`static_cache_from` turns a prefilled `DynamicCache` (what `generate()` and a plain forward build) into
a `StaticCache` for such a step, each row repeated as many times as asked: one prompt prefilled once,
then decoded as a batch of B continuations.
"""

from __future__ import annotations

import numbers

import torch
from transformers import DynamicCache, PreTrainedConfig, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from hf_softmax_rnn.layers.cache import RecurrentStateLayer, StaticRecurrentStateLayer
from hf_softmax_rnn.utils import device_memory_bytes

__all__ = ["GraphedDecodeStep", "static_cache_from"]

_PREFILL_FIRST = "run the prompt through the model with this cache first"


def static_cache_from(
    cache: DynamicCache, config: PreTrainedConfig, max_cache_len: int, repeats: int = 1
) -> StaticCache:
    """A `StaticCache` holding what the prefilled `cache` holds, each row repeated `repeats` times (row i
    becomes rows i * repeats ... (i + 1) * repeats - 1, as `Cache.batch_repeat_interleave` orders them).

    Recurrent layers get their state; KV layers their keys and values in the first positions of buffers of
    `max_cache_len` positions, which must leave room for the tokens still to decode. KV layers are written
    from a broadcast view of their rows, and recurrent states too when the cache holds one row, so the
    repeated cache is never held twice (a KV cache at a batch that fills the GPU fits once); recurrent
    states of several rows are repeated into a copy first.

    Args:
        cache: a `DynamicCache` the model was run with (every layer filled).
        config: the model's config (`model.config`), which says which layers are recurrent.
        max_cache_len: positions each KV layer holds (prompt + new tokens); unused by recurrent layers.
        repeats: copies of each row (at least 1).
    """
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"static_cache_from copies a DynamicCache; got {type(cache).__name__}")
    if not isinstance(config, PreTrainedConfig):
        raise TypeError(
            "static_cache_from: config must be the model's PreTrainedConfig (model.config); got "
            f"{type(config).__name__}"
        )
    max_cache_len = _count("max_cache_len", max_cache_len)
    repeats = _count("repeats", repeats)
    static = StaticCache(config=config, max_cache_len=max_cache_len)
    if len(static.layers) != len(cache.layers):
        raise ValueError(
            f"the cache has {len(cache.layers)} layers but the config describes {len(static.layers)}; pass the config "
            "of the model that filled the cache"
        )
    _check_fits(cache, max_cache_len, repeats)
    for index, (source, target) in enumerate(zip(cache.layers, static.layers, strict=True)):
        if isinstance(source, RecurrentStateLayer) and isinstance(target, StaticRecurrentStateLayer):
            if source.state is None:
                raise ValueError(f"layer {index} of the cache holds no state yet: {_PREFILL_FIRST}")
            target.update_state(source.state.map(lambda x: _repeated(x, repeats)), source.cumulative_length)
        elif type(source) is DynamicLayer and type(target) is StaticLayer:
            _fill_static_layer(target, source, repeats, index)
        else:
            raise TypeError(
                f"layer {index}: a {type(source).__name__} cannot be copied into a {type(target).__name__}; pass the "
                "config of the model that filled the cache (sliding-window KV layers are not supported)"
            )
    return static


def _count(name: str, value) -> int:
    """`value` as an int >= 1 (a Python or NumPy integer, not a bool), else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"static_cache_from: {name}={value!r} has type {type(value).__name__}; expected an int >= 1")
    if value < 1:
        raise ValueError(f"static_cache_from: {name}={value} is not allowed; expected at least 1")
    return int(value)


def _check_fits(cache: DynamicCache, max_cache_len: int, repeats: int) -> None:
    """The static cache of `max_cache_len` positions and `repeats` copies of each row fits in its device's memory
    (KV buffers of max_cache_len positions, recurrent states repeated), else an error naming both and the
    largest max_cache_len that would fit, before anything is allocated."""
    fixed, per_position, device = 0, 0, None
    for source in cache.layers:
        if isinstance(source, RecurrentStateLayer) and source.state is not None:
            fixed += repeats * source.state.nbytes
            device = source.state.packed.device
        elif isinstance(source, DynamicLayer) and source.keys is not None and source.keys.numel():
            keys, values = source.keys, source.values  # [b, H, L, D]
            row_bytes = keys.shape[1] * keys.shape[-1] * keys.element_size()
            row_bytes += values.shape[1] * values.shape[-1] * values.element_size()
            per_position += keys.shape[0] * repeats * row_bytes
            device = keys.device
    memory = None if device is None else device_memory_bytes(device)
    needed = fixed + per_position * max_cache_len
    if memory is None or needed <= memory:
        return
    fitting = (memory - fixed) // per_position if per_position and memory > fixed else 0
    if fitting:
        allowed = f"max_cache_len <= {fitting:,} at repeats={repeats}"
    else:
        allowed = f"repeats <= {memory * repeats // needed:,} at max_cache_len={max_cache_len}"
    raise ValueError(
        f"static_cache_from: max_cache_len={max_cache_len} and repeats={repeats} need {needed:,} bytes of cache, "
        f"more than the {memory:,} bytes of {device}; expected {allowed}"
    )


def _repeated(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """`x` `[b, ...]` with each row repeated `repeats` times: a broadcast view for one row."""
    if x.shape[0] == 1:
        return x.expand(repeats, *x.shape[1:])
    return x.repeat_interleave(repeats, dim=0)


def _fill_static_layer(target: StaticLayer, source: DynamicLayer, repeats: int, index: int) -> None:
    keys, values = source.keys, source.values  # [b, H, L, D]
    if keys is None or keys.numel() == 0:
        raise ValueError(f"layer {index} of the cache holds no keys yet: {_PREFILL_FIRST}")
    length = keys.shape[-2]
    if length >= target.max_cache_len:
        raise ValueError(
            f"max_cache_len={target.max_cache_len} holds no new token after the {length} cached positions; expected "
            f"at least {length + 1} (prompt + new tokens)"
        )
    rows = keys.shape[0] * repeats
    target.lazy_initialization(keys[:1].expand(rows, *keys.shape[1:]), values[:1].expand(rows, *values.shape[1:]))
    for buffer, cached in ((target.keys, keys), (target.values, values)):
        buffer.view(keys.shape[0], repeats, *buffer.shape[1:])[..., :length, :].copy_(cached[:, None])
    target.cumulative_length.fill_(length)


class GraphedDecodeStep:
    """`model(input_ids [B, 1], cache=cache)` recorded as a CUDA graph at the call after `eager_steps`
    eager ones (which warm up kernels and allocations), then replayed; every call decodes a real token.

    Args:
        model: a causal LM on a CUDA device, in eval mode.
        cache: a prefilled `StaticCache` of that model, with room for the tokens still to decode.
        prompt_mask: the prompt's `[B, prompt_len]` attention mask, if it had one (checked, see above).
        eager_steps: calls run eagerly before recording (at least 1).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticCache,
        prompt_mask: torch.Tensor | None = None,
        eager_steps: int = 1,
    ) -> None:
        if not isinstance(cache, StaticCache):
            raise TypeError(
                f"GraphedDecodeStep needs a StaticCache (fixed tensor addresses); got {type(cache).__name__}"
            )
        if int(cache.get_seq_length()) == 0:
            raise ValueError("GraphedDecodeStep needs a prefilled cache: run the prompt through the model first")
        if eager_steps < 1:
            raise ValueError(
                f"eager_steps={eager_steps} is not allowed; expected at least 1 (a warm-up before recording)"
            )
        kv_layers = [i for i, layer in enumerate(cache.layers) if not getattr(layer, "holds_recurrent_state", False)]
        if kv_layers and prompt_mask is not None and not bool(prompt_mask.all()):
            raise ValueError(
                f"layers {kv_layers} keep a KV cache, which a graphed step (no attention mask) would let attend to the "
                "padded prompt positions; decode padded prompts with generate(), or prompts without padding"
            )
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"GraphedDecodeStep records CUDA graphs; the model is on {device}, expected a cuda device")
        self.model = model
        self.device = device
        self.cache = cache
        #: positions held so far, and room for them where a KV layer stores each one (None: no limit)
        self.length = int(cache.get_seq_length())
        self.capacity = cache.layers[kv_layers[0]].max_cache_len if kv_layers else None
        self.eager_steps_left = eager_steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.input_ids: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self._with_positions: bool | None = None

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True).logits

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per row: input_ids (and position_ids, given on every call or on none) `[B, 1]`;
        returns the logits `[B, 1, V]`, a buffer that the next call overwrites (clone to keep)."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}; a decode step takes [batch, 1]")
        if self.capacity is not None and self.length >= self.capacity:
            raise ValueError(
                f"the StaticCache's KV layers hold {self.capacity} positions, all used; build it with a larger "
                "max_cache_len (prompt length + new tokens)"
            )
        if self._with_positions is None:
            self._with_positions = position_ids is not None
        elif self._with_positions != (position_ids is not None):
            given = "without" if position_ids is None else "with"
            raise ValueError(f"called {given} position_ids, unlike the first call; pass them on every call or on none")
        if self.graph is not None and input_ids.shape != self.input_ids.shape:
            raise ValueError(
                f"input_ids of shape {tuple(input_ids.shape)}; the graph was recorded for {tuple(self.input_ids.shape)}"
            )
        if self.graph is None and self.eager_steps_left > 0:
            self.eager_steps_left -= 1
            logits = self._on_side_stream(lambda: self._forward(input_ids, position_ids))
        else:
            if self.graph is None:
                self._record(input_ids, position_ids)
            self.input_ids.copy_(input_ids)
            if position_ids is not None:
                self.position_ids.copy_(position_ids)
            self.graph.replay()
            logits = self.logits
        self.length += 1
        return logits

    def _on_side_stream(self, run):
        """Run eagerly on a side stream, as warm-ups before recording a CUDA graph should; the result
        is handed to the current stream."""
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            result = run()
        current.wait_stream(stream)
        result.record_stream(current)
        return result

    def _record(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Record one step; recording runs nothing, so the cache is unchanged until the first replay."""
        self.input_ids = input_ids.clone()
        self.position_ids = None if position_ids is None else position_ids.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward(self.input_ids, self.position_ids)

"""What the softmax_rnn configs share: the attention choice per layer and the cache layout.

A config class (a `@strict` subclass of `LlamaConfig` / `GPT2Config`) declares three fields,

    attention: dict | str | AttentionSpec | None       # the spec of every layer (None = "softmax")
    layer_attention: dict | None                        # {layer_idx: spec} overrides (hybrids; None = none)
    attention_mode: str = "chunked"                     # forward without cache: chunked | parallel (reference)

and inherits `SoftmaxRNNConfigMixin` for the logic. Specs are validated by `AttentionSpec`
(presets, dicts and specs all go through `AttentionSpec.coerce`) and stored as plain dicts
so that config.json holds every field explicitly. `attention` None (`"attention": null` in a
config.json) means exact softmax in every layer, the field's default: an unconverted model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_softmax_rnn.attention_spec import NO_CACHE_MODES, AttentionSpec
from hf_softmax_rnn.layers.cache import RECURRENT_LAYER_TYPE

#: `layer_types` entry of a layer decoded from a KV cache (transformers' `DynamicLayer`).
KV_LAYER_TYPE = "full_attention"


class SoftmaxRNNConfigMixin:
    """Attention-choice logic for configs with `attention`, `layer_attention`, `attention_mode` fields."""

    def __setattr__(self, name: str, value: Any) -> None:
        """`attention` and `layer_attention` are validated and stored as plain dicts with string layer
        keys whenever they are assigned: at construction, by hand, or by `from_pretrained(path,
        layer_attention=...)`, which sets keyword arguments on the loaded config."""
        if name == "attention":
            value = _spec_dict("attention", "softmax" if value is None else value, "None (exact softmax), " + _SPEC)
        elif name == "layer_attention" and value is not None:
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"layer_attention={value!r} has type {type(value).__name__}; expected None or a mapping of layer "
                    'index to spec, e.g. {"3": "softmax"} (JSON keys are strings)'
                )
            value = {
                str(self._layer_index(key)): _spec_dict(f"layer_attention[{key!r}]", spec)
                for key, spec in value.items()
            }
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        """transformers' `from_dict` (what `from_pretrained` builds a config with), refusing a config of
        another family: transformers would only warn, then build this class from another model's fields,
        its own defaults (a 7B Llama's sizes) filling the gaps. This class's model_type and its source
        family's (an unconverted checkpoint, loaded with exact softmax) are allowed."""
        given = config_dict.get("model_type")
        source = next(
            base.model_type for base in cls.__mro__ if getattr(base, "model_type", cls.model_type) != cls.model_type
        )
        if given == source:  # (the instance then keeps this class's model_type, as a save writes it)
            config_dict = {key: value for key, value in config_dict.items() if key != "model_type"}
        elif given is not None and given != cls.model_type:
            raise ValueError(
                f"a config of model_type {given!r} cannot load as {cls.__name__}; expected model_type "
                f"{cls.model_type!r} (or {source!r}, an unconverted checkpoint): AutoModelForCausalLM.from_pretrained "
                "picks the class from the model_type"
            )
        return super().from_dict(config_dict, **kwargs)

    def _layer_index(self, key: Any) -> int:
        """A layer index from an int or its string form (JSON keys are strings)."""
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.num_hidden_layers:
            raise ValueError(
                f"layer_attention has key {key!r}; expected layer indices in 0..{self.num_hidden_layers - 1}"
            )
        return index

    def validate_attention(self) -> None:
        """Part of `@strict` validation: every spec valid, layer keys in range, a known mode."""
        if self.attention_mode not in NO_CACHE_MODES:
            raise ValueError(
                f"attention_mode={self.attention_mode!r} is not allowed; expected one of {list(NO_CACHE_MODES)}"
            )
        AttentionSpec.coerce(self.attention)
        for key, value in (self.layer_attention or {}).items():
            self._layer_index(key)
            AttentionSpec.coerce(value)

    def validate_layer_type(self) -> None:
        """Our `layer_types` are derived from the specs (and include the recurrent cache layer type)."""

    def attention_spec(self, layer_idx: int) -> AttentionSpec:
        """The `AttentionSpec` of layer `layer_idx`."""
        self._layer_index(layer_idx)
        overrides = self.layer_attention or {}
        return AttentionSpec.coerce(overrides.get(str(layer_idx), self.attention))

    @property
    def attention_head_dim(self) -> int:
        return getattr(self, "head_dim", None) or self.hidden_size // self.num_attention_heads

    @property
    def layer_types(self) -> list[str]:
        """Cache layer type per layer: a recurrent state where the spec's state fits, else a KV cache."""
        return [
            RECURRENT_LAYER_TYPE
            if self.attention_spec(i).fits_recurrent_state(self.attention_head_dim)
            else KV_LAYER_TYPE
            for i in range(self.num_hidden_layers)
        ]

    def attention_summary(self) -> str:
        """Which layers use what, one part per distinct spec: "all 30 layers: ..." or
        "layers 0-3, 7: ...; layers 4-6: ..."."""
        groups: dict[str, list[int]] = {}
        for i in range(self.num_hidden_layers):
            groups.setdefault(self.attention_spec(i).describe(), []).append(i)
        if len(groups) == 1:
            return f"all {self.num_hidden_layers} layers: {next(iter(groups))}"
        return "; ".join(f"{_layer_ranges(layers)}: {description}" for description, layers in groups.items())


_SPEC = "a preset name, a dict of AttentionSpec fields or an AttentionSpec"


def _spec_dict(field: str, value: Any, expected: str = _SPEC) -> dict[str, Any]:
    """`value` (a spec, a dict of its fields or a preset name) as the dict a config stores, else a
    TypeError naming `field` and what it takes (`expected`)."""
    if not isinstance(value, (AttentionSpec, dict, str)):
        raise TypeError(f"{field}={value!r} has type {type(value).__name__}; expected {expected}")
    return AttentionSpec.coerce(value).to_dict()


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> "layers 0-3, 7" (sorted indices)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(parts)

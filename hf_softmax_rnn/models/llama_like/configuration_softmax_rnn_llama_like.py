"""Configurations of the families of Llama's pattern with the paper's attention (model_type
"softmax_rnn_<family>": "softmax_rnn_mistral", "softmax_rnn_qwen2", ...), one class per line of
`LLAMA_LIKE_FAMILIES`, made by `llama_like_config_class` and bound here by name
(`SoftmaxRNNMistralConfig`, `SoftmaxRNNQwen2Config`, ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.layers.cache import RECURRENT_LAYER_TYPE
from hf_softmax_rnn.models.configuration_softmax_rnn import KV_LAYER_TYPE, SoftmaxRNNConfigMixin
from hf_softmax_rnn.models.llama_like.families import LLAMA_LIKE_FAMILIES, LlamaLikeFamily, declares


class SoftmaxRNNLlamaLikeConfigMixin(SoftmaxRNNConfigMixin):
    """What the configs of the families of Llama's pattern add to `SoftmaxRNNConfigMixin`: each layer's window
    lives in its spec (sliding-window softmax is `AttentionSpec(window=W)`), so the family's own
    `sliding_window` must be None and `layer_types` given to a family's config, Qwen2's or Qwen3's, may only
    name full attention; and a cap of the scores (Gemma 2's `attn_logit_softcapping`, where the family's
    attention applies it: `softcapped_scores`) only where every layer has exact softmax scores to cap (exact
    softmax, or a window hybrid: `AttentionSpec.softcap_applies`)."""

    #: Whether the layers cap their scores at `attn_logit_softcapping` (`LlamaLikeFamily.softcapped_scores`).
    softcapped_scores = False

    @property
    def layer_types(self) -> list[str]:
        if self.__dict__.get("_building_family_modules"):
            return list(self.rope_layer_types)
        return SoftmaxRNNConfigMixin.layer_types.fget(self)

    @contextlib.contextmanager
    def rope_layer_types_as_layer_types(self) -> Iterator[None]:
        """While the family's own modules are built: `layer_types` gives `rope_layer_types` (the source's entries),
        by which a rotary embedding of one RoPE per layer type (Gemma 3's) builds each of them."""
        building = self.__dict__.get("_building_family_modules", False)
        self.__dict__["_building_family_modules"] = True
        try:
            yield
        finally:
            self.__dict__["_building_family_modules"] = building

    @property
    def _rope_type_labels(self) -> tuple[str, ...]:
        """The keys of a `rope_parameters` nested by layer type: those `rope_layer_types` names, where the family
        has them (transformers would look for them in `layer_types`, which here name cache layouts)."""
        return tuple(dict.fromkeys(getattr(self, "rope_layer_types", None) or ()))

    def validate_rope_layer_types(self) -> None:
        """Part of `@strict` validation: one `rope_parameters` key per layer, where the family has them."""
        rope_layer_types = getattr(self, "rope_layer_types", None)
        if rope_layer_types is None:
            return
        known = sorted(self.rope_parameters or {})
        unknown = sorted({kind for kind in rope_layer_types if kind not in known})
        if len(rope_layer_types) != self.num_hidden_layers or unknown:
            raise ValueError(
                f"{self.model_type} has rope_layer_types={rope_layer_types}: expected one entry per layer "
                f"({self.num_hidden_layers}), each a key of rope_parameters {known}"
            )

    @layer_types.setter
    def layer_types(self, value: list[str] | None) -> None:
        """The family config's `layer_types` argument: accepted (and not stored: the layer types are derived
        from the specs) when it names full attention only."""
        others = sorted({kind for kind in value or () if kind not in (KV_LAYER_TYPE, RECURRENT_LAYER_TYPE)})
        if others:
            raise ValueError(
                f"{self.model_type} has layer_types with {others}: a layer's window is given by its AttentionSpec "
                f"(AttentionSpec(window=W) in layer_attention); expected None or only {KV_LAYER_TYPE!r} entries"
            )

    def check_source_sliding_windows(self) -> None:
        """`source_sliding_windows`, where the family has it: None or `{layer index: W >= 1}` (keys stored as
        strings)."""
        windows = getattr(self, "source_sliding_windows", None)
        if windows is None:
            return
        if not isinstance(windows, dict) or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in windows.values()
        ):
            raise ValueError(
                f"source_sliding_windows={windows!r}; expected None or a mapping of layer index to a window >= 1"
            )
        layers = [str(i) for i in range(self.num_hidden_layers)]
        if any(str(key) not in layers for key in windows):
            raise ValueError(
                f"source_sliding_windows has keys {sorted(map(str, windows))}; expected layer indices in "
                f"0..{self.num_hidden_layers - 1}"
            )
        self.source_sliding_windows = {str(key): window for key, window in windows.items()}

    def validate_sliding_window(self) -> None:
        """Part of `@strict` validation (after the family's `__post_init__`, which may clear the window)."""
        window = getattr(self, "sliding_window", None)
        if window is not None:
            raise ValueError(
                f"{self.model_type} has sliding_window={window}: a layer's window is given by its AttentionSpec "
                "(sliding-window softmax: AttentionSpec(window=W), per layer in layer_attention); expected "
                "sliding_window=None"
            )

    def validate_attn_logit_softcapping(self) -> None:
        """Part of `@strict` validation: a cap of the scores (Gemma 2's) only where every layer has exact softmax
        scores to cap (`AttentionSpec.softcap_applies`)."""
        cap = getattr(self, "attn_logit_softcapping", None)
        if cap is None or not self.softcapped_scores:
            return
        uncapped = [i for i in range(self.num_hidden_layers) if not self.attention_spec(i).softcap_applies]
        if uncapped:
            raise ValueError(
                f"{self.model_type} has attn_logit_softcapping={cap}, which caps exact softmax scores, but layers "
                f"{uncapped} have none (a finite state alone: the cap does not factor into a feature map); expected "
                "those layers kind='softmax', a window hybrid (window=W: its window, sinks and kept keys take the "
                "cap, its finite state stays uncapped) or attn_logit_softcapping=None"
            )


def llama_like_config_class(family: LlamaLikeFamily) -> type[PreTrainedConfig]:
    """`SoftmaxRNN<Family>Config`: the family's config plus the attention choice (`attention`,
    `layer_attention`, `attention_mode`, as `SoftmaxRNNLlamaConfig` has them), `sliding_window` and
    `attn_logit_softcapping` None by default, and where the family has sliding windows `source_sliding_windows`
    (`{layer index: W}`, as strings: the converted layers that were sliding-window attention in the source, whose
    attention-transfer teacher keeps that window; None: none); for a family with one RoPE per layer type,
    `rope_layer_types`: the key of `rope_parameters` each layer rotates q and k with (the source's `layer_types`;
    None: every layer the full-attention RoPE)."""

    @strict
    class SoftmaxRNNLlamaLikeConfig(SoftmaxRNNLlamaLikeConfigMixin, family.config_class):
        model_type = family.model_type
        softcapped_scores = family.softcapped_scores

        attention: dict | str | AttentionSpec | None = None
        layer_attention: dict | None = None
        attention_mode: str = "chunked"
        if declares(family.config_class, "sliding_window"):
            sliding_window: int | None = None
            source_sliding_windows: dict | None = None
        if declares(family.config_class, "attn_logit_softcapping"):
            attn_logit_softcapping: float | None = None
        if family.rope_per_layer_type:
            rope_layer_types: list[str] | None = None

        def __post_init__(self, **kwargs: Any) -> None:
            self.validate_attention()
            self.check_source_sliding_windows()
            if family.rope_per_layer_type and self.rope_layer_types is None:
                self.rope_layer_types = [KV_LAYER_TYPE] * self.num_hidden_layers
            super().__post_init__(**kwargs)

    name = f"SoftmaxRNN{family.name}Config"
    SoftmaxRNNLlamaLikeConfig.__name__ = SoftmaxRNNLlamaLikeConfig.__qualname__ = name
    SoftmaxRNNLlamaLikeConfig.__doc__ = (
        f"`{family.config_class.__name__}` plus the attention choice (model_type {family.model_type!r}); see "
        "`SoftmaxRNNLlamaConfig` for `attention`, `layer_attention` and `attention_mode`."
    )
    return SoftmaxRNNLlamaLikeConfig


#: Family name ("Mistral") -> its softmax_rnn config class.
LLAMA_LIKE_CONFIGS = {family.name: llama_like_config_class(family) for family in LLAMA_LIKE_FAMILIES}
globals().update({config_class.__name__: config_class for config_class in LLAMA_LIKE_CONFIGS.values()})

__all__ = ["LLAMA_LIKE_CONFIGS", *(config_class.__name__ for config_class in LLAMA_LIKE_CONFIGS.values())]

"""Configuration of Llama with the paper's attention (model_type "softmax_rnn_llama")."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.models.configuration_softmax_rnn import SoftmaxRNNConfigMixin


@strict
class SoftmaxRNNLlamaConfig(SoftmaxRNNConfigMixin, LlamaConfig):
    """`LlamaConfig` plus the attention choice.

    Attributes:
        attention: the `AttentionSpec` of every layer, as a spec, a dict of its fields or a
            preset name (see `hf_softmax_rnn.PRESETS`); None = exact softmax. Stored as a dict.
        layer_attention: optional `{layer_idx: spec}` overrides, e.g. to keep softmax in some
            layers (a hybrid). Keys are stored as strings (JSON).
        attention_mode: how layers with a finite state run without a cache: "chunked" (no L x L
            matrix, linear in the length past the chunk; default) or "parallel" (the masked L x L
            form, the reference).

    Every `LlamaConfig` argument (hidden_size, num_hidden_layers, ...) is accepted too.

    `config.attention_spec(i)` gives layer i's spec; `config.layer_types` says which layers
    decode from a recurrent state ("softmax_rnn_recurrent") and which from a KV cache.
    """

    model_type = "softmax_rnn_llama"

    attention: dict | str | AttentionSpec | None = None
    layer_attention: dict | None = None
    attention_mode: str = "chunked"

    def __post_init__(self, **kwargs):
        self.validate_attention()
        super().__post_init__(**kwargs)


__all__ = ["SoftmaxRNNLlamaConfig"]

"""Configuration of GPT-2 with the paper's attention (model_type "softmax_rnn_gpt2")."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import GPT2Config

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.models.configuration_softmax_rnn import SoftmaxRNNConfigMixin


@strict
class SoftmaxRNNGPT2Config(SoftmaxRNNConfigMixin, GPT2Config):
    """`GPT2Config` plus the attention choice.

    Attributes:
        attention: the `AttentionSpec` of every layer, as a spec, a dict of its fields or a
            preset name (see `hf_softmax_rnn.PRESETS`); None = exact softmax. Stored as a dict.
        layer_attention: optional `{layer_idx: spec}` overrides (hybrids); string keys in JSON.
        attention_mode: how layers with a finite state run without a cache: "chunked" (default)
            or "parallel" (the masked L x L reference form).

    Every `GPT2Config` argument (n_embd, n_layer, n_head, ...) is accepted too; cross-attention
    (`add_cross_attention=True`) is not supported.

    The qk scale of a spec with `qk_scale=None` is GPT-2's own: head_dim**-0.5 (if
    `scale_attn_weights`), further divided by layer_idx + 1 if `scale_attn_by_inverse_layer_idx`.
    """

    model_type = "softmax_rnn_gpt2"

    attention: dict | str | AttentionSpec | None = None
    layer_attention: dict | None = None
    attention_mode: str = "chunked"

    def __post_init__(self, **kwargs):
        self.validate_attention()
        super().__post_init__(**kwargs)

    def validate_cross_attention(self) -> None:
        if self.add_cross_attention:
            raise ValueError("add_cross_attention=True is not supported by softmax_rnn_gpt2 (self-attention only)")


__all__ = ["SoftmaxRNNGPT2Config"]

"""What the softmax_rnn models share: the attention implementation name, the padding mask,
weight initialisation and Hub export.

The models run under their own attention implementation, `ATTN_IMPLEMENTATION`. Its mask
function (registered with transformers' `AttentionMaskInterface`) hands every attention
layer the 2-D padding mask `[B, past + L]` (or None when nothing is padded) instead of a
4-D causal mask: the ops apply causality themselves and need the padding per position to
keep padded tokens out of recurrent states. This registration is not an Auto-class
registration, so this module may travel with a checkpoint.
"""

from __future__ import annotations

import logging

import torch
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from hf_softmax_rnn.hub import RemoteCodeMixin
from hf_softmax_rnn.layers.attention import RNNParams
from hf_softmax_rnn.layers.cache import RECURRENT_LAYER_TYPE

logger = logging.getLogger(__name__)

#: `config._attn_implementation` of every softmax_rnn model.
ATTN_IMPLEMENTATION = "softmax_rnn"


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of `ATTN_IMPLEMENTATION`: the 2-D bool padding mask `[B, kv_length]`, or None
    when no position is padded. Custom mask functions (packed sequences, bidirectional blocks)
    cannot be expressed as a padding mask and raise."""
    if mask_function is not causal_mask_function:
        raise ValueError(
            "softmax_rnn attention applies causality and a 2-D padding mask only; it got a custom mask function "
            "(packed sequences with restarting position_ids?). Pass an attention_mask, or one sequence per row"
        )
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


def _refuse_attention_weights_hook(model, args, kwargs) -> None:
    model._refuse_attention_weights(kwargs.get("output_attentions"))


class SoftmaxRNNPreTrainedMixin(RemoteCodeMixin):
    """Mixin for the softmax_rnn `PreTrainedModel` classes (put it first among the bases)."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """Always `ATTN_IMPLEMENTATION`: the attention layers compute their spec themselves."""
        if requested_attention not in (None, ATTN_IMPLEMENTATION, "sdpa"):
            logger.warning(
                "%s ignores attn_implementation=%r: its layers compute their AttentionSpec with hf_softmax_rnn.ops",
                type(self).__name__,
                requested_attention,
            )
        return ATTN_IMPLEMENTATION

    def _refuse_attention_weights(self, requested: bool | None) -> None:
        if requested:
            raise ValueError(
                f"{type(self).__name__} does not return attention weights (output_attentions=True): its layers compute "
                "their AttentionSpec without an attention matrix (recurrent layers have none); call it without "
                "output_attentions"
            )

    def post_init(self) -> None:
        """transformers' `post_init`, plus a check before each forward (the forward keeps its
        signature, which `generate` reads): `output_attentions=True` raises."""
        super().post_init()
        if not getattr(self, "_refuses_attention_weights", False):
            self.register_forward_pre_hook(_refuse_attention_weights_hook, with_kwargs=True)
            self._refuses_attention_weights = True

    def generate(self, *args, **kwargs):
        """transformers' `generate`; refuses an empty prompt, attention weights and, for recurrent-state
        layers, a static cache, each with a message instead of an error from deep inside."""
        self._refuse_attention_weights(kwargs.get("output_attentions"))
        prompt = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(prompt, torch.Tensor) and prompt.shape[-1] == 0:
            raise ValueError("generate got an empty prompt (input_ids with 0 tokens); pass at least one token")
        config = kwargs.get("generation_config") or self.generation_config
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        if implementation not in (None, "dynamic") and self._is_stateful:
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by {type(self).__name__}: its "
                f"recurrent-state layers ({RECURRENT_LAYER_TYPE}) live in the dynamic cache; leave "
                "cache_implementation unset"
            )
        return super().generate(*args, **kwargs)

    @property
    def _is_stateful(self) -> bool:
        """Some layer decodes from a recurrent state, which cannot be rolled back (no assisted decoding)."""
        return RECURRENT_LAYER_TYPE in self.config.layer_types

    def _init_weights(self, module: torch.nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RNNParams):
            module.reset_parameters()

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


class SoftmaxRNNPreTrainedMixin(RemoteCodeMixin):
    """Mixin for the softmax_rnn `PreTrainedModel` classes (put it first among the bases)."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """Always `ATTN_IMPLEMENTATION`: the attention layers compute their spec themselves."""
        if requested_attention not in (None, ATTN_IMPLEMENTATION, "sdpa", "eager"):
            logger.warning(
                "%s ignores attn_implementation=%r: its layers compute their AttentionSpec with hf_softmax_rnn.ops",
                type(self).__name__,
                requested_attention,
            )
        return ATTN_IMPLEMENTATION

    @property
    def _is_stateful(self) -> bool:
        """Some layer decodes from a recurrent state, which cannot be rolled back (no assisted decoding)."""
        return RECURRENT_LAYER_TYPE in self.config.layer_types

    def _init_weights(self, module: torch.nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RNNParams):
            module.reset_parameters()

"""The families of Llama's pattern with the paper's attention: for each line of `LLAMA_LIKE_FAMILIES`,
`SoftmaxRNN<Family>Model` / `SoftmaxRNN<Family>ForCausalLM`, transformers' own classes whose attention
modules compute `config.attention_spec(layer_idx)`, made by `llama_like_model_classes` and bound here by
name (`SoftmaxRNNMistralForCausalLM`, `SoftmaxRNNQwen2ForCausalLM`, ..., and their attention classes
`SoftmaxRNNMistralAttention`, ...).

Only the attention modules change (`SoftmaxRNN<Family>Attention`, see `llama_like_attention_class`);
embeddings, RoPE, MLPs or experts, norms, the LM head, the forward passes and `generate` are
transformers' own, as for `SoftmaxRNNLlamaForCausalLM`.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from hf_softmax_rnn.layers.attention import llama_like_attention_class
from hf_softmax_rnn.models.llama_like.configuration_softmax_rnn_llama_like import LLAMA_LIKE_CONFIGS
from hf_softmax_rnn.models.llama_like.families import LLAMA_LIKE_FAMILIES, LlamaLikeFamily
from hf_softmax_rnn.models.modeling_softmax_rnn import SoftmaxRNNPreTrainedMixin


def _mask_per_layer_type(base_model: PreTrainedModel, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a base model that looks up each layer's mask by its `config.layer_types` entry
    (Qwen2, Qwen3): the mask `create_causal_mask` makes (the padding mask) for every layer type, the
    recurrent one included, which the base model's own mapping lacks."""
    inputs = {**dict(zip(base_model._mask_argument_names, args, strict=False)), **kwargs}  # (args: the first few)
    attention_mask = inputs.get("attention_mask")
    if isinstance(attention_mask, dict):
        return None
    tokens, input_ids = inputs.get("inputs_embeds"), inputs.get("input_ids")
    if tokens is None and input_ids is None:  # the forward raises
        return None
    if tokens is None:  # create_causal_mask reads the batch size, length, dtype and device only
        tokens = input_ids.new_empty((*input_ids.shape, 0), dtype=base_model.dtype)
    mask = create_causal_mask(
        config=base_model.config,
        inputs_embeds=tokens,
        attention_mask=attention_mask,
        cache=inputs.get("cache", inputs.get("past_key_values")),
        position_ids=inputs.get("position_ids"),
    )
    masks = dict.fromkeys(base_model.config.layer_types, mask)
    positional = base_model._mask_argument_names[: len(args)]
    if "attention_mask" in positional:
        index = positional.index("attention_mask")
        return (*args[:index], masks, *args[index + 1 :]), kwargs
    return args, {**kwargs, "attention_mask": masks}


class RotaryEmbeddingPerLayer(nn.Module):
    """A base model's `rotary_emb` of one RoPE per layer type (Gemma 3's local and global RoPE), for a model whose
    `layer_types` name cache layouts instead: asked for any layer type, it gives every RoPE,
    {`rope_layer_types` entry: (cos, sin) `[B, L, D]`}, and each attention module takes its layer's."""

    def __init__(self, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.rotary_emb = rotary_emb

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: self.rotary_emb(x, position_ids, kind) for kind in self.rotary_emb.layer_types}


class RopePerLayerTypeMixin:
    """Builds the family's modules while `config.layer_types` gives the source's entries (`rope_layer_types`),
    so that its rotary embedding makes every RoPE the layers use; `post_init` then wraps that embedding
    (`RotaryEmbeddingPerLayer`)."""

    def __init__(self, config, *args, **kwargs) -> None:
        with config.rope_layer_types_as_layer_types():
            super().__init__(config, *args, **kwargs)


class SoftmaxRNNLlamaLikePreTrainedMixin(SoftmaxRNNPreTrainedMixin):
    """`SoftmaxRNNPreTrainedMixin` for the classes of `llama_like_family`; where its base model looks up each
    layer's mask by `config.layer_types`, `post_init` also gives it every layer type's mask
    (`_mask_per_layer_type`); where the family has one RoPE per layer type, it gives each layer its own
    (`RotaryEmbeddingPerLayer`)."""

    llama_like_family: LlamaLikeFamily

    def post_init(self) -> None:
        super().post_init()
        family = self.llama_like_family
        if family.rope_per_layer_type:
            for module in self.modules():
                if isinstance(module, family.base_model) and not isinstance(module.rotary_emb, RotaryEmbeddingPerLayer):
                    module.rotary_emb = RotaryEmbeddingPerLayer(module.rotary_emb)
        if not family.has_layer_types:
            return
        for module in self.modules():
            if isinstance(module, family.base_model) and not hasattr(module, "_mask_argument_names"):
                module._mask_argument_names = tuple(inspect.signature(module.forward).parameters)
                module.register_forward_pre_hook(_mask_per_layer_type, with_kwargs=True)


def llama_like_model_classes(family: LlamaLikeFamily) -> tuple[type[PreTrainedModel], type[PreTrainedModel]]:
    """(`SoftmaxRNN<Family>Model`, `SoftmaxRNN<Family>ForCausalLM`): the family's base model and causal LM with
    `SoftmaxRNN<Family>Attention` in every decoder layer (their `post_init` swaps the attention modules)."""
    attention_class = llama_like_attention_class(
        family.attention,
        __name__,
        qkv_projections=family.qkv_projections,
        qk_norm=family.qk_norm,
        softcapped_scores=family.softcapped_scores,
    )
    classes = []
    for base, suffix in ((family.base_model, "Model"), (family.causal_lm, "ForCausalLM")):
        name = f"SoftmaxRNN{family.name}{suffix}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"`{base.__name__}` with `{attention_class.__name__}` in every decoder layer.",
            "config_class": LLAMA_LIKE_CONFIGS[family.name],
            "attention_slot": (family.decoder_layer, "self_attn", attention_class),
            "llama_like_family": family,
        }
        mixins = (RopePerLayerTypeMixin,) if family.rope_per_layer_type else ()
        classes.append(type(name, (*mixins, SoftmaxRNNLlamaLikePreTrainedMixin, base), namespace))
    return classes[0], classes[1]


#: Family name ("Mistral") -> (its softmax_rnn base model class, its softmax_rnn causal LM class).
LLAMA_LIKE_MODELS = {family.name: llama_like_model_classes(family) for family in LLAMA_LIKE_FAMILIES}
_CLASSES = {
    model_class.__name__: model_class
    for base_model, causal_lm in LLAMA_LIKE_MODELS.values()
    for model_class in (base_model, causal_lm, causal_lm.attention_slot[2])
}
globals().update(_CLASSES)

__all__ = ["LLAMA_LIKE_MODELS", *_CLASSES]

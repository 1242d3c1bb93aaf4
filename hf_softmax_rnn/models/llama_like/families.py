"""The decoder-only families whose attention follows Llama's pattern, one line each.

A family fits when its attention module has q_proj, k_proj, v_proj (or one fused qkv_proj, as Phi-3)
and o_proj, applies RoPE with its modeling file's `apply_rotary_pos_emb` (after an optional RMSNorm
of the queries and keys, `q_norm` / `k_norm`, per head as in Qwen3 or over the whole projection as in
OLMo 2; skipped in a layer whose module has `use_rope` false, SmolLM3's NoPE layers), scales q.k by
its module's `scaling` (Granite's `attention_multiplier`, Gemma 2's and Gemma 3's `query_pre_attn_scalar`),
is built as `Attention(config, layer_idx)` and sits at `self_attn` of its decoder layers; the rest of the
model (MLP or mixture of experts, norms, embeddings and their multipliers, Gemma 2's final logit
soft-capping) stays as it is. A family whose rotary embedding gives each layer type its own RoPE (Gemma 3's
`rope_parameters["sliding_attention"]`) keeps that choice per layer (`rope_per_layer_type`). The
softmax_rnn config, model and attention classes of each family are made from its line
(`configuration_softmax_rnn_llama_like`, `modeling_softmax_rnn_llama_like`).
"""

from __future__ import annotations

import dataclasses

from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
)
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3TextModel,
)
from transformers.models.granite.modeling_granite import (
    GraniteAttention,
    GraniteDecoderLayer,
    GraniteForCausalLM,
    GraniteModel,
)
from transformers.models.mistral.modeling_mistral import (
    MistralAttention,
    MistralDecoderLayer,
    MistralForCausalLM,
    MistralModel,
)
from transformers.models.mixtral.modeling_mixtral import (
    MixtralAttention,
    MixtralDecoderLayer,
    MixtralForCausalLM,
    MixtralModel,
)
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3DecoderLayer, Phi3ForCausalLM, Phi3Model
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
)
from transformers.models.smollm3.modeling_smollm3 import (
    SmolLM3Attention,
    SmolLM3DecoderLayer,
    SmolLM3ForCausalLM,
    SmolLM3Model,
)

#: Where a family's `q_norm` / `k_norm` normalise: over each head (Qwen3) or the whole projection (OLMo 2).
QK_NORMS = ("head", "projection")


@dataclasses.dataclass(frozen=True)
class LlamaLikeFamily:
    """The transformers classes of one family: its causal LM, base model, decoder layer and attention; the
    attention's q/k/v projections (one name: a fused projection of q, then k, then v), where its
    q/k norms normalise (`QK_NORMS`; unused without norms) and whether its base model's `rotary_emb` takes
    each layer's `layer_types` entry to choose that layer's RoPE (`rope_per_layer_type`: Gemma 3's local
    and global RoPE; the converted config keeps the source's entries in `rope_layer_types`), and whether its
    attention caps the scores at the config's `attn_logit_softcapping` (`softcapped_scores`: Gemma 2's does;
    Gemma 3's config has the field, which its attention ignores)."""

    causal_lm: type[PreTrainedModel]
    base_model: type[PreTrainedModel]
    decoder_layer: type[nn.Module]
    attention: type[nn.Module]
    qkv_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    qk_norm: str = "head"
    rope_per_layer_type: bool = False
    softcapped_scores: bool = False

    def __post_init__(self) -> None:
        if len(self.qkv_projections) not in (1, 3):
            raise ValueError(
                f"LlamaLikeFamily.qkv_projections={self.qkv_projections!r}: expected the names of the q, k and v "
                "projections, or of one fused projection"
            )
        if self.qk_norm not in QK_NORMS:
            raise ValueError(
                f"LlamaLikeFamily.qk_norm={self.qk_norm!r} is not allowed; expected one of {list(QK_NORMS)}"
            )

    @property
    def name(self) -> str:
        """The stem of the family's class names: "Mistral" for `MistralForCausalLM`."""
        return self.causal_lm.__name__.removesuffix("ForCausalLM")

    @property
    def config_class(self) -> type[PreTrainedConfig]:
        return self.causal_lm.config_class

    @property
    def model_type(self) -> str:
        """The `model_type` of the converted family: "softmax_rnn_mistral"."""
        return f"softmax_rnn_{self.config_class.model_type}"

    @property
    def has_layer_types(self) -> bool:
        """Whether the family's config has `layer_types`, by which its base model looks up each layer's mask."""
        return declares(self.config_class, "layer_types")


LLAMA_LIKE_FAMILIES = (
    LlamaLikeFamily(MistralForCausalLM, MistralModel, MistralDecoderLayer, MistralAttention),
    LlamaLikeFamily(Qwen2ForCausalLM, Qwen2Model, Qwen2DecoderLayer, Qwen2Attention),
    LlamaLikeFamily(Qwen3ForCausalLM, Qwen3Model, Qwen3DecoderLayer, Qwen3Attention),
    LlamaLikeFamily(Qwen3MoeForCausalLM, Qwen3MoeModel, Qwen3MoeDecoderLayer, Qwen3MoeAttention),
    LlamaLikeFamily(MixtralForCausalLM, MixtralModel, MixtralDecoderLayer, MixtralAttention),
    LlamaLikeFamily(Phi3ForCausalLM, Phi3Model, Phi3DecoderLayer, Phi3Attention, qkv_projections=("qkv_proj",)),
    LlamaLikeFamily(Olmo2ForCausalLM, Olmo2Model, Olmo2DecoderLayer, Olmo2Attention, qk_norm="projection"),
    LlamaLikeFamily(GraniteForCausalLM, GraniteModel, GraniteDecoderLayer, GraniteAttention),
    LlamaLikeFamily(SmolLM3ForCausalLM, SmolLM3Model, SmolLM3DecoderLayer, SmolLM3Attention),
    LlamaLikeFamily(Gemma2ForCausalLM, Gemma2Model, Gemma2DecoderLayer, Gemma2Attention, softcapped_scores=True),
    LlamaLikeFamily(Gemma3ForCausalLM, Gemma3TextModel, Gemma3DecoderLayer, Gemma3Attention, rope_per_layer_type=True),
)


def declares(config_class: type[PreTrainedConfig], name: str) -> bool:
    """Whether `config_class` has a field `name`."""
    return name in {field.name for field in dataclasses.fields(config_class)}


def sliding_window_layers(config: PreTrainedConfig) -> list[int]:
    """The layers in which a model of a family's `config` attends to only the last `config.sliding_window`
    positions, when that is set: those whose `layer_types` entry is "sliding_attention" where the config has
    `layer_types` (Qwen2, Qwen3, SmolLM3, Gemma 2, Gemma 3), else every layer (Mistral, Mixtral, Qwen3-MoE, Phi-3); none
    for a config without `sliding_window` (Llama, GPT-2)."""
    if getattr(config, "sliding_window", None) is None:
        return []
    if declares(type(config), "layer_types"):
        return [i for i, layer_type in enumerate(config.layer_types or ()) if layer_type == "sliding_attention"]
    return list(range(config.num_hidden_layers))

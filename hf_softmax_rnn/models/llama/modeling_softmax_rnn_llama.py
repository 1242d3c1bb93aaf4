"""Llama with the paper's attention: `LlamaModel` / `LlamaForCausalLM` whose attention modules
compute `config.attention_spec(layer_idx)`.

Only the attention modules change (`SoftmaxRNNLlamaAttention` keeps q_proj, k_proj, v_proj,
o_proj and adds `rnn_params`); embeddings, RoPE, MLPs, norms, the LM head, the forward
passes and `generate` are transformers' own. Layers with a finite state decode from a
`RecurrentStateLayer` in a `DynamicCache` (or a `StaticRecurrentStateLayer` in a `StaticCache`),
the others from a KV cache (see `config.layer_types`).
"""

from __future__ import annotations

from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
)

from hf_softmax_rnn.layers.attention import SoftmaxRNNLlamaAttention
from hf_softmax_rnn.models.llama.configuration_softmax_rnn_llama import SoftmaxRNNLlamaConfig
from hf_softmax_rnn.models.modeling_softmax_rnn import SoftmaxRNNPreTrainedMixin


class SoftmaxRNNLlamaPreTrainedModel(SoftmaxRNNPreTrainedMixin, LlamaPreTrainedModel):
    config_class = SoftmaxRNNLlamaConfig
    config: SoftmaxRNNLlamaConfig
    attention_slot = (LlamaDecoderLayer, "self_attn", SoftmaxRNNLlamaAttention)


class SoftmaxRNNLlamaModel(SoftmaxRNNLlamaPreTrainedModel, LlamaModel):
    """`LlamaModel` with `SoftmaxRNNLlamaAttention` in every decoder layer (`LlamaModel.__init__`, whose
    `post_init` swaps the attention modules)."""


class SoftmaxRNNLlamaForCausalLM(SoftmaxRNNLlamaPreTrainedModel, LlamaForCausalLM):
    """`LlamaForCausalLM` with `SoftmaxRNNLlamaAttention` in every decoder layer; `__init__`, `forward` and
    `generate` are transformers' own (its `post_init` swaps the attention modules)."""


__all__ = ["SoftmaxRNNLlamaForCausalLM", "SoftmaxRNNLlamaModel", "SoftmaxRNNLlamaPreTrainedModel"]

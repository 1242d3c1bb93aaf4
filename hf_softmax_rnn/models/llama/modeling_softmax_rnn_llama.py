"""Llama with the paper's attention: `LlamaModel` / `LlamaForCausalLM` whose attention modules
compute `config.attention_spec(layer_idx)`.

Only the attention modules change (`SoftmaxRNNLlamaAttention` keeps q_proj, k_proj, v_proj,
o_proj and adds `rnn_params`); embeddings, RoPE, MLPs, norms, the LM head, the forward
passes and `generate` are transformers' own. Layers with a finite state decode from a
`RecurrentStateLayer` in the cache, the others from a KV cache (see `config.layer_types`).
"""

from __future__ import annotations

from torch import nn
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel

from hf_softmax_rnn.layers.attention import SoftmaxRNNLlamaAttention
from hf_softmax_rnn.models.llama.configuration_softmax_rnn_llama import SoftmaxRNNLlamaConfig
from hf_softmax_rnn.models.modeling_softmax_rnn import SoftmaxRNNPreTrainedMixin


class SoftmaxRNNLlamaPreTrainedModel(SoftmaxRNNPreTrainedMixin, LlamaPreTrainedModel):
    config_class = SoftmaxRNNLlamaConfig
    config: SoftmaxRNNLlamaConfig


class SoftmaxRNNLlamaModel(SoftmaxRNNLlamaPreTrainedModel, LlamaModel):
    """`LlamaModel` with `SoftmaxRNNLlamaAttention` in every decoder layer."""

    def __init__(self, config: SoftmaxRNNLlamaConfig) -> None:
        super().__init__(config)
        for layer_idx, layer in enumerate(self.layers):
            layer.self_attn = SoftmaxRNNLlamaAttention(config, layer_idx)
        self.post_init()


class SoftmaxRNNLlamaForCausalLM(SoftmaxRNNLlamaPreTrainedModel, LlamaForCausalLM):
    """`LlamaForCausalLM` on a `SoftmaxRNNLlamaModel`; `forward` and `generate` are unchanged."""

    def __init__(self, config: SoftmaxRNNLlamaConfig) -> None:
        LlamaPreTrainedModel.__init__(self, config)
        self.model = SoftmaxRNNLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = ["SoftmaxRNNLlamaForCausalLM", "SoftmaxRNNLlamaModel", "SoftmaxRNNLlamaPreTrainedModel"]

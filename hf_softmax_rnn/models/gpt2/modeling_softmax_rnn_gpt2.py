"""GPT-2 with the paper's attention: `GPT2Model` / `GPT2LMHeadModel` whose attention modules
compute `config.attention_spec(layer_idx)`.

Only the attention modules change (`SoftmaxRNNGPT2Attention` keeps the Conv1D c_attn and
c_proj and GPT-2's qk scaling, and adds `rnn_params`); learned position embeddings, MLPs,
layer norms, the LM head, the forward passes and `generate` are transformers' own.
"""

from __future__ import annotations

from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel, GPT2Model, GPT2PreTrainedModel

from hf_softmax_rnn.layers.attention import SoftmaxRNNGPT2Attention
from hf_softmax_rnn.models.gpt2.configuration_softmax_rnn_gpt2 import SoftmaxRNNGPT2Config
from hf_softmax_rnn.models.modeling_softmax_rnn import SoftmaxRNNPreTrainedMixin


class SoftmaxRNNGPT2PreTrainedModel(SoftmaxRNNPreTrainedMixin, GPT2PreTrainedModel):
    config_class = SoftmaxRNNGPT2Config
    config: SoftmaxRNNGPT2Config


class SoftmaxRNNGPT2Model(SoftmaxRNNGPT2PreTrainedModel, GPT2Model):
    """`GPT2Model` with `SoftmaxRNNGPT2Attention` in every block."""

    def __init__(self, config: SoftmaxRNNGPT2Config) -> None:
        super().__init__(config)
        for layer_idx, block in enumerate(self.h):
            block.attn = SoftmaxRNNGPT2Attention(config, layer_idx)
        self.post_init()


class SoftmaxRNNGPT2LMHeadModel(SoftmaxRNNGPT2PreTrainedModel, GPT2LMHeadModel):
    """`GPT2LMHeadModel` on a `SoftmaxRNNGPT2Model`; `forward` and `generate` are unchanged."""

    def __init__(self, config: SoftmaxRNNGPT2Config) -> None:
        GPT2PreTrainedModel.__init__(self, config)
        self.transformer = SoftmaxRNNGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()


__all__ = ["SoftmaxRNNGPT2LMHeadModel", "SoftmaxRNNGPT2Model", "SoftmaxRNNGPT2PreTrainedModel"]

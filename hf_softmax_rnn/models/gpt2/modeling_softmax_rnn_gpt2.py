"""GPT-2 with the paper's attention: `GPT2Model` / `GPT2LMHeadModel` whose attention modules
compute `config.attention_spec(layer_idx)`.

Only the attention modules change (`SoftmaxRNNGPT2Attention` keeps the Conv1D c_attn and
c_proj and GPT-2's qk scaling, and adds `rnn_params`); learned position embeddings, MLPs,
layer norms, the LM head, the forward passes and `generate` are transformers' own.
"""

from __future__ import annotations

from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2LMHeadModel, GPT2Model, GPT2PreTrainedModel

from hf_softmax_rnn.layers.attention import SoftmaxRNNGPT2Attention
from hf_softmax_rnn.models.gpt2.configuration_softmax_rnn_gpt2 import SoftmaxRNNGPT2Config
from hf_softmax_rnn.models.modeling_softmax_rnn import SoftmaxRNNPreTrainedMixin


class SoftmaxRNNGPT2PreTrainedModel(SoftmaxRNNPreTrainedMixin, GPT2PreTrainedModel):
    config_class = SoftmaxRNNGPT2Config
    config: SoftmaxRNNGPT2Config
    attention_slot = (GPT2Block, "attn", SoftmaxRNNGPT2Attention)


class SoftmaxRNNGPT2Model(SoftmaxRNNGPT2PreTrainedModel, GPT2Model):
    """`GPT2Model` with `SoftmaxRNNGPT2Attention` in every block (`GPT2Model.__init__`, whose `post_init`
    swaps the attention modules)."""


class SoftmaxRNNGPT2LMHeadModel(SoftmaxRNNGPT2PreTrainedModel, GPT2LMHeadModel):
    """`GPT2LMHeadModel` with `SoftmaxRNNGPT2Attention` in every block; `__init__`, `forward` and `generate`
    are transformers' own (its `post_init` swaps the attention modules)."""


__all__ = ["SoftmaxRNNGPT2LMHeadModel", "SoftmaxRNNGPT2Model", "SoftmaxRNNGPT2PreTrainedModel"]

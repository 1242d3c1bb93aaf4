"""GPT-2 with the paper's attention."""

from hf_softmax_rnn.models.gpt2.configuration_softmax_rnn_gpt2 import SoftmaxRNNGPT2Config
from hf_softmax_rnn.models.gpt2.modeling_softmax_rnn_gpt2 import (
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNGPT2Model,
    SoftmaxRNNGPT2PreTrainedModel,
)

__all__ = ["SoftmaxRNNGPT2Config", "SoftmaxRNNGPT2LMHeadModel", "SoftmaxRNNGPT2Model", "SoftmaxRNNGPT2PreTrainedModel"]

"""Llama with the paper's attention."""

from hf_softmax_rnn.models.llama.configuration_softmax_rnn_llama import SoftmaxRNNLlamaConfig
from hf_softmax_rnn.models.llama.modeling_softmax_rnn_llama import (
    SoftmaxRNNLlamaForCausalLM,
    SoftmaxRNNLlamaModel,
    SoftmaxRNNLlamaPreTrainedModel,
)

__all__ = [
    "SoftmaxRNNLlamaConfig",
    "SoftmaxRNNLlamaForCausalLM",
    "SoftmaxRNNLlamaModel",
    "SoftmaxRNNLlamaPreTrainedModel",
]

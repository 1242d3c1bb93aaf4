"""nn.Modules: the softmax_rnn attention layers and the recurrent-state cache layer."""

from hf_softmax_rnn.layers.attention import (
    RNNParams,
    SoftmaxRNNAttentionMixin,
    SoftmaxRNNGPT2Attention,
    SoftmaxRNNLlamaAttention,
    set_attention_transfer,
    softmax_rnn_attention_modules,
    student_outputs,
    transfer_losses,
)
from hf_softmax_rnn.layers.cache import RECURRENT_LAYER_TYPE, RecurrentStateLayer, cache_nbytes

__all__ = [
    "RECURRENT_LAYER_TYPE",
    "RNNParams",
    "RecurrentStateLayer",
    "SoftmaxRNNAttentionMixin",
    "SoftmaxRNNGPT2Attention",
    "SoftmaxRNNLlamaAttention",
    "cache_nbytes",
    "set_attention_transfer",
    "softmax_rnn_attention_modules",
    "student_outputs",
    "transfer_losses",
]

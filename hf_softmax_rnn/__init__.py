"""hf_softmax_rnn: softmax attention as a sum of RNNs, for Hugging Face transformers."""

from hf_softmax_rnn.attention_spec import PRESETS, AttentionSpec
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.models import (
    SoftmaxRNNGPT2Config,
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNLlamaConfig,
    SoftmaxRNNLlamaForCausalLM,
)

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "AttentionSpec",
    "SoftmaxRNNGPT2Config",
    "SoftmaxRNNGPT2LMHeadModel",
    "SoftmaxRNNLlamaConfig",
    "SoftmaxRNNLlamaForCausalLM",
    "__version__",
    "convert",
]

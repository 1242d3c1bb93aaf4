"""hf_softmax_rnn: softmax attention as a sum of RNNs, for Hugging Face transformers."""

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import convert

# Binds the name after the submodule import has set `hf_softmax_rnn.default_model` to the module,
# so the package attribute is the function (the module stays importable by its dotted name).
from hf_softmax_rnn.default_model import default_model_and_tokenizer as default_model
from hf_softmax_rnn.models import (
    SoftmaxRNNGPT2Config,
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNLlamaConfig,
    SoftmaxRNNLlamaForCausalLM,
)
from hf_softmax_rnn.presets import PRESETS
from hf_softmax_rnn.version import __version__

__all__ = [
    "PRESETS",
    "AttentionSpec",
    "SoftmaxRNNGPT2Config",
    "SoftmaxRNNGPT2LMHeadModel",
    "SoftmaxRNNLlamaConfig",
    "SoftmaxRNNLlamaForCausalLM",
    "__version__",
    "convert",
    "default_model",
]

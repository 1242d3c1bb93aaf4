"""hf_softmax_rnn: softmax attention as a sum of RNNs, for Hugging Face transformers."""

from hf_softmax_rnn.attention_spec import PRESETS, AttentionSpec

__version__ = "0.1.0"

__all__ = ["PRESETS", "AttentionSpec", "__version__"]

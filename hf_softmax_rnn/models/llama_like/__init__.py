"""The families of Llama's pattern (Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Phi-3, OLMo 2, Granite,
SmolLM3, Gemma 2, Gemma 3) with the paper's attention."""

from hf_softmax_rnn.models.llama_like.configuration_softmax_rnn_llama_like import LLAMA_LIKE_CONFIGS
from hf_softmax_rnn.models.llama_like.families import (
    LLAMA_LIKE_FAMILIES,
    LlamaLikeFamily,
    declares,
    sliding_window_layers,
)
from hf_softmax_rnn.models.llama_like.modeling_softmax_rnn_llama_like import LLAMA_LIKE_MODELS

__all__ = [
    "LLAMA_LIKE_CONFIGS",
    "LLAMA_LIKE_FAMILIES",
    "LLAMA_LIKE_MODELS",
    "LlamaLikeFamily",
    "declares",
    "sliding_window_layers",
]

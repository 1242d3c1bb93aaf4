"""The softmax_rnn model families, registered with transformers' Auto classes on import.

After `import hf_softmax_rnn`, `AutoConfig` knows model_type "softmax_rnn_llama",
"softmax_rnn_gpt2" and "softmax_rnn_<family>" for each family of Llama's pattern
(`LLAMA_LIKE_FAMILIES`: "softmax_rnn_mistral", "softmax_rnn_qwen2", ...), and `AutoModel` /
`AutoModelForCausalLM` build and load them. (This
module is the only place that registers; the modeling files that travel with a checkpoint
for `trust_remote_code` do not.)
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_softmax_rnn.models.gpt2 import (
    SoftmaxRNNGPT2Config,
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNGPT2Model,
    SoftmaxRNNGPT2PreTrainedModel,
)
from hf_softmax_rnn.models.llama import (
    SoftmaxRNNLlamaConfig,
    SoftmaxRNNLlamaForCausalLM,
    SoftmaxRNNLlamaModel,
    SoftmaxRNNLlamaPreTrainedModel,
)
from hf_softmax_rnn.models.llama_like import LLAMA_LIKE_CONFIGS, LLAMA_LIKE_FAMILIES, LLAMA_LIKE_MODELS

for _config, _base, _lm in (
    (SoftmaxRNNLlamaConfig, SoftmaxRNNLlamaModel, SoftmaxRNNLlamaForCausalLM),
    (SoftmaxRNNGPT2Config, SoftmaxRNNGPT2Model, SoftmaxRNNGPT2LMHeadModel),
    *((LLAMA_LIKE_CONFIGS[family.name], *LLAMA_LIKE_MODELS[family.name]) for family in LLAMA_LIKE_FAMILIES),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _base, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

__all__ = [
    "LLAMA_LIKE_CONFIGS",
    "LLAMA_LIKE_FAMILIES",
    "LLAMA_LIKE_MODELS",
    "SoftmaxRNNGPT2Config",
    "SoftmaxRNNGPT2LMHeadModel",
    "SoftmaxRNNGPT2Model",
    "SoftmaxRNNGPT2PreTrainedModel",
    "SoftmaxRNNLlamaConfig",
    "SoftmaxRNNLlamaForCausalLM",
    "SoftmaxRNNLlamaModel",
    "SoftmaxRNNLlamaPreTrainedModel",
]

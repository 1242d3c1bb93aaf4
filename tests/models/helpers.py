"""Tiny random Llama / GPT-2 models and inputs for the model and generation tests."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import convert
from hf_softmax_rnn.layers import RNNParams

VOCAB = 64
FAMILIES = ("llama", "gpt2")
#: The tiny Llama shape of the tests (GQA: 4 heads, 2 KV heads, head_dim 8); override keys with {**LLAMA_SHAPE, ...}.
LLAMA_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
)


def tiny_source(family: str) -> torch.nn.Module:
    """A random stock model: Llama with GQA (4 heads, 2 KV heads, head_dim 8), or GPT-2 with
    scale_attn_by_inverse_layer_idx (its scaling differs per layer)."""
    special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if family == "llama":
        config = LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=64, **special)
        return LlamaForCausalLM(config).eval()
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        scale_attn_by_inverse_layer_idx=True,
        **special,
    )
    return GPT2LMHeadModel(config).eval()


def perturb_rnn_params(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """Move every rnn_params tensor off its initial value so that gates depend on the token
    and norms/feature maps are not the identity."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RNNParams):
                for param in module.parameters():
                    param.add_(scale * torch.randn_like(param))
    return model


def tiny_model(family: str, spec, **kwargs) -> torch.nn.Module:
    return perturb_rnn_params(convert(tiny_source(family), spec, **kwargs)).eval()


def left_padded_batch(lengths=(10, 6), vocab=VOCAB, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids `[B, max(lengths)]` with rows left-padded (pad id 0) and the matching mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask

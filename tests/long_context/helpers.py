"""Tiny random models (byte vocabulary, 512 positions) and byte texts for the long-context tests."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import convert
from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer

from ..models.helpers import LLAMA_SHAPE, perturb_rnn_params

POSITIONS = 512
LLAMA_KWARGS = {**LLAMA_SHAPE, "vocab_size": 257, "max_position_embeddings": POSITIONS}
#: Documents of 200-300 bytes (= tokens of the byte tokenizer), each different.
TEXTS = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(40)) for i in range(6)]


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**LLAMA_KWARGS, pad_token_id=256, eos_token_id=256)).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=257, n_positions=POSITIONS, eos_token_id=256)
    return GPT2LMHeadModel(config).eval()


def tiny_converted(preset: str = "hedgehog_window_64", mode: str = "parallel") -> torch.nn.Module:
    return perturb_rnn_params(convert(tiny_llama(), preset, attention_mode=mode)).eval()


def tokenizer():
    return byte_tokenizer()

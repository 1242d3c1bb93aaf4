"""Tiny random Llama / GPT-2 checkpoints with a word-level tokenizer, and small run settings."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from hf_softmax_rnn.data.corpus import load_corpus, pydoc_corpus
from hf_softmax_rnn.training import FinetuneConfig
from hf_softmax_rnn.training.data import eval_blocks

from ..models.helpers import LLAMA_SHAPE

VOCAB_SIZE = 128
MAX_POSITIONS = 64

TINY_MODELS = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(
            **LLAMA_SHAPE
            | dict(
                vocab_size=VOCAB_SIZE,
                max_position_embeddings=MAX_POSITIONS,
                tie_word_embeddings=True,
                bos_token_id=None,
                eos_token_id=1,
                pad_token_id=None,
            )
        )
    ),
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=MAX_POSITIONS,
            bos_token_id=1,
            eos_token_id=1,
        )
    ),
}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the 126 most frequent words of the offline corpus (+ <unk>, <eos>)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(pydoc_corpus()["train"]["text"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")


def save_tiny_model(family: str, path: Path, tokenizer: PreTrainedTokenizerFast) -> str:
    torch.manual_seed(0)
    TINY_MODELS[family]().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_config(model_dir: str, output_dir, **overrides) -> FinetuneConfig:
    """Settings small enough to train in a second or two on one CPU thread."""
    settings = dict(
        output_dir=str(output_dir),
        model=model_dir,
        attention="softmax_divS_norm",
        block_size=16,
        batch_size=2,
        eval_batch_size=4,
        max_eval_blocks=6,
        transfer_steps=3,
        finetune_steps=3,
        transfer_lr=1e-2,
        lr=1e-2,
        eval_every=2,
        save_every=2,
        progress=False,
        seed=0,
    )
    settings.update(overrides)
    return FinetuneConfig.from_flags(**settings)


def weights(path) -> dict[str, torch.Tensor]:
    """The tensors of a saved model folder (`model.safetensors`)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def direct_perplexity(model, model_dir: str, block_size: int, max_blocks: int) -> float:
    """exp(mean over held-out blocks of the model's own `labels` loss): each block has the same
    number of predictions, so the mean of block means is the mean over tokens."""
    blocks = eval_blocks(load_corpus()["test"], AutoTokenizer.from_pretrained(model_dir), block_size, max_blocks)
    with torch.no_grad():
        losses = [model(input_ids=block[None], labels=block[None]).loss for block in blocks]
    return math.exp(torch.stack(losses).mean().item())

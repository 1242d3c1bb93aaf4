"""A byte-level tokenizer (256 bytes + EOS) for small models trained from scratch on CPU.

No merges, no download: every UTF-8 string round-trips, and the vocabulary (257) keeps the
embedding and the output softmax of a tiny model cheap.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<eos>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0-255 are bytes (GPT-2 byte alphabet order), 256 is EOS (also pad)."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[EOS_TOKEN] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)

"""Training blocks that ask for recall: key-value facts written into the text and restated further on.

Distilled on plain prose, a converted model learns what the original does there, and prose seldom makes
the original copy an exact token from far back: the finite state is never asked to hold an association.
`FactPlanter` writes `count` facts into the first half of each training block ("Ledger entry: the kettle
code is 48213.") and restates each in the second half, in another order ("Checking the ledger, the kettle
code is 48213."), over the block's own text. The original predicts each restated value from its context;
distillation asks the converted model to do the same, from wherever the fact lies.

The facts' wording, keys and values are none of those that `evaluate --passkey`, `needles` or the
retrieval-layer calibration read, so recall measured there is recall in forms training never showed.
A block's facts are a pure function of the seed and the block's place in the stream, so a resumed run
reads the blocks an uninterrupted run would have read.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

#: How a fact is written, and how it is restated later in the block.
FACT = " Ledger entry: the {key} code is {value}."
RESTATED = " Checking the ledger, the {key} code is {value}."
#: The facts' keys (none is a key of the needle or passkey prompts).
KEYS = (
    "kettle", "ladder", "anvil", "bucket", "compass", "drum", "easel", "funnel", "goblet", "hinge", "inkwell",
    "jigsaw", "kayak", "ledger", "mallet", "napkin", "oar", "padlock", "quiver", "rudder", "sickle", "teapot",
    "trowel", "valve", "wagon", "whistle", "yoke", "zipper", "barrel", "candle", "chisel", "thimble",
)  # fmt: skip
_ADJECTIVES = ("silver", "crimson", "hollow", "brisk", "gentle", "frozen", "golden", "quiet", "rusty", "narrow")
_NOUNS = ("otter", "beacon", "cedar", "harp", "marble", "sparrow", "tundra", "violin", "walnut", "comet")
_CODE_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
#: Kinds of value: a 4- to 6-digit number, two words, or letters and digits ("KQ-3071").
VALUE_KINDS = ("number", "words", "code")
#: Of each half of a block, at least this share stays the block's own text.
_MIN_TEXT_SHARE = 0.5


def recall_value(kind: str, rng: random.Random) -> str:
    """A value of `kind` (one of `VALUE_KINDS`)."""
    if kind == "number":
        return str(rng.randrange(1_000, 1_000_000))
    if kind == "words":
        return f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    letters = "".join(rng.choice(_CODE_LETTERS) for _ in range(2))
    return f"{letters}-{rng.randrange(1_000, 10_000)}"


def _spans(lengths: Sequence[int], room: int, rng: random.Random) -> list[int]:
    """Start offsets of pieces of `lengths`, in that order and without overlap, spread at random over `room`
    positions."""
    free = room - sum(lengths)
    cuts = sorted(rng.randint(0, free) for _ in lengths)
    starts, used = [], 0
    for cut, length in zip(cuts, lengths, strict=True):
        starts.append(cut + used)
        used += length
    return starts


class FactPlanter:
    """Writes `count` facts into each block of `block_size` token ids and restates them later (module doc).

    `tokenizer` encodes the facts; `seed` and each block's key (its place in the stream) choose the facts,
    values and places. Refuses, naming the largest count that fits, a `count` whose facts and restatements
    would take more than half of either half of a block; `flag` is the setting that chose `count`.
    """

    def __init__(self, tokenizer, count: int, block_size: int, seed: int, flag: str = "--recall-facts") -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{flag} {count!r} is not allowed; expected an int >= 1")
        if count > len(KEYS):
            raise ValueError(f"{flag} {count} is not allowed; expected at most {len(KEYS)} (one key per fact)")
        self.tokenizer, self.count, self.block_size, self.seed = tokenizer, count, block_size, seed
        longest = self._longest_restatement()
        fits = int(block_size // 2 * _MIN_TEXT_SHARE) // longest
        if count > fits:
            raise ValueError(
                f"{flag} {count} does not fit blocks of {block_size} tokens: a fact or its restatement takes up "
                f"to {longest} tokens, and half of each half of a block stays text; expected at most {fits}, or longer "
                "blocks"
            )

    def _longest_restatement(self) -> int:
        """Tokens of the longest restatement (longer than its fact): the longest key's words, then the longest
        value (every two-word value; the longest numbers and the codes of every letter pair), each encoded
        alone (a value starts after a space, where the tokenizer splits)."""
        head, tail = RESTATED.split("{value}")
        values = [
            *(f"{adjective} {noun}" for adjective in _ADJECTIVES for noun in _NOUNS),
            "999999",
            "100000",
            *(f"{first}{second}-9999" for first in _CODE_LETTERS for second in _CODE_LETTERS),
        ]
        encode = lambda texts: self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
        return max(map(len, encode([head.format(key=key) for key in KEYS]))) + max(
            map(len, encode([f" {value}{tail}" for value in values]))
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def plant(self, ids: torch.Tensor, key: int) -> tuple[torch.Tensor, list[tuple[int, int]], list[str]]:
        """One block `[block_size]` with its facts written in -> (the new block, the (start, end) token span of
        each restatement, the value each restatement gives), restatements in their order in the block."""
        if ids.shape != (self.block_size,):
            raise ValueError(f"FactPlanter: a block has shape {tuple(ids.shape)}; expected [{self.block_size}]")
        rng = random.Random(f"{self.seed}/{key}")
        keys = rng.sample(KEYS, self.count)
        values = [recall_value(rng.choice(VALUE_KINDS), rng) for _ in keys]
        facts = [self._encode(FACT.format(key=k, value=v)) for k, v in zip(keys, values, strict=True)]
        order = rng.sample(range(self.count), self.count)
        restated = [self._encode(RESTATED.format(key=keys[i], value=values[i])) for i in order]
        half = self.block_size // 2
        out = ids.clone()
        for start, piece in zip(_spans([len(p) for p in facts], half, rng), facts, strict=True):
            out[start : start + len(piece)] = torch.tensor(piece, dtype=ids.dtype)
        spans = []
        for start, piece in zip(_spans([len(p) for p in restated], self.block_size - half, rng), restated, strict=True):
            out[half + start : half + start + len(piece)] = torch.tensor(piece, dtype=ids.dtype)
            spans.append((half + start, half + start + len(piece)))
        return out, spans, [values[i] for i in order]

    def __call__(self, blocks: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
        """Blocks `[N, block_size]` and each one's key -> the blocks with their facts written in."""
        return torch.stack([self.plant(block, key)[0] for block, key in zip(blocks, keys, strict=True)])

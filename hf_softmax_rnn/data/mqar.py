"""Multi-query associative recall (MQAR; Arora et al., "Zoology", 2023); see docs/design.md, MQAR.

One example of length `seq_len` with K = `num_kv_pairs`:

    k_1 v_1 k_2 v_2 ... k_K v_K | filler ... k_j v_j ... filler ... k_i v_i ... filler

Keys are drawn without replacement from the lower half of the vocabulary, values from the
upper half. The K pairs open the sequence; the query region after them is cut into
(seq_len - 2K) // 2 two-token slots, and each key reappears once, in a slot chosen without
replacement with weight (i+1)^(a-1) for slot i (a = `power_a`, small a favours short gaps),
followed by its value. `labels` are -100 except at those value positions, in the
transformers convention (`model(input_ids, labels=labels)` scores the prediction made at
each query key). Every other position holds a random token that is not one of the
example's keys, so that each query has exactly one earlier occurrence of its key (Zoology
draws filler from the whole vocabulary; with a small vocabulary that makes queries
ambiguous).

Generation is deterministic given the seed; `mqar_splits` derives the train and test
streams from distinct seed sequences, so they never share random draws.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from datasets import Dataset, DatasetDict

from hf_softmax_rnn.utils import device_memory_bytes

IGNORE_INDEX = -100
_SPLIT_STREAMS = {"train": 0, "test": 1}


@dataclass(frozen=True)
class MQARConfig:
    """The task's parameters (Zoology's defaults)."""

    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 8
    power_a: float = 0.01

    def __post_init__(self) -> None:
        if self.num_kv_pairs < 1:
            raise ValueError(f"MQARConfig.num_kv_pairs={self.num_kv_pairs} is not allowed; expected an int >= 1")
        if self.vocab_size < 4 * self.num_kv_pairs:
            raise ValueError(
                f"MQARConfig.vocab_size={self.vocab_size} is too small for num_kv_pairs={self.num_kv_pairs}; expected "
                f">= {4 * self.num_kv_pairs} (keys and values each need K tokens in their half, filler needs the rest)"
            )
        if self.seq_len < 4 * self.num_kv_pairs:
            raise ValueError(
                f"MQARConfig.seq_len={self.seq_len} is too short for num_kv_pairs={self.num_kv_pairs}; expected >= "
                f"{4 * self.num_kv_pairs} (2K tokens of pairs, then K query slots of 2 tokens)"
            )
        if not self.power_a > 0:
            raise ValueError(f"MQARConfig.power_a={self.power_a} is not allowed; expected a float > 0")

    @property
    def num_slots(self) -> int:
        """Two-token query slots after the pairs."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2

    def gap_probabilities(self) -> np.ndarray:
        """Probability of each query slot i: proportional to (i+1)^(a-1)."""
        weights = np.arange(1, self.num_slots + 1, dtype=np.float64) ** (self.power_a - 1)
        return weights / weights.sum()


def _distinct_draws(rng: np.random.Generator, high: int, shape: tuple[int, int]) -> np.ndarray:
    """Rows of `shape[1]` distinct ints in [0, high): draw with replacement, redraw rows with repeats."""
    draws = rng.integers(high, size=shape)
    while True:
        ordered = np.sort(draws, axis=1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if not repeated.any():
            return draws
        draws[repeated] = rng.integers(high, size=(int(repeated.sum()), shape[1]))


def _generate(config: MQARConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` examples at once: input_ids and labels, `[n, seq_len]` each."""
    half, k, length = config.vocab_size // 2, config.num_kv_pairs, config.seq_len
    keys = _distinct_draws(rng, half, (n, k))
    values = half + _distinct_draws(rng, config.vocab_size - half, (n, k))
    # Filler: uniform over the tokens that are not this row's keys. Draw r in [0, V - K) and
    # skip over the sorted keys: r -> r + #{i : sorted_key_i - i <= r}.
    filler = rng.integers(config.vocab_size - k, size=(n, length))
    shifted_keys = np.sort(keys, axis=1) - np.arange(k)
    input_ids = filler + sum(shifted_keys[:, i, None] <= filler for i in range(k))
    input_ids[:, 0 : 2 * k : 2], input_ids[:, 1 : 2 * k : 2] = keys, values
    # Query slots without replacement, weighted by (i+1)^(a-1): Gumbel top-k.
    gumbel = rng.gumbel(size=(n, config.num_slots))
    slots = np.argsort(-(np.log(config.gap_probabilities()) + gumbel), axis=1)[:, :k]
    rows = np.arange(n)[:, None]
    query_positions = 2 * k + 2 * slots
    input_ids[rows, query_positions], input_ids[rows, query_positions + 1] = keys, values
    labels = np.full((n, length), IGNORE_INDEX, dtype=np.int64)
    labels[rows, query_positions + 1] = values
    return input_ids, labels


#: Bytes the generator holds per token of an example at least: its input id and its label, int64 each.
EXAMPLE_TOKEN_BYTES = 2 * 8


def check_examples_fit(num_examples: int, config: MQARConfig, name: str = "num_examples") -> None:
    """`num_examples` sequences of `config.seq_len` tokens, generated at once, fit in the machine's memory (at
    `EXAMPLE_TOKEN_BYTES` a token), else a ValueError naming `name`, the bytes and the most that would fit."""
    per_example = EXAMPLE_TOKEN_BYTES * config.seq_len
    memory = device_memory_bytes("cpu")
    if memory is not None and num_examples * per_example > memory:
        fitting = memory // per_example
        longest = memory // EXAMPLE_TOKEN_BYTES
        allowed = f"{name} <= {fitting:,} at this seq_len" if fitting else f"seq_len <= {longest:,}"
        raise ValueError(
            f"{name}={num_examples:,} sequences of seq_len={config.seq_len:,} tokens are generated at once, at least "
            f"{num_examples * per_example:,} bytes, more than the machine's {memory:,}; expected {allowed}"
        )


def generate_mqar(
    num_examples: int, config: MQARConfig | None = None, *, seed: int | np.random.SeedSequence = 0
) -> Dataset:
    """`num_examples` MQAR sequences as a Dataset with "input_ids" and "labels" `[seq_len]` each."""
    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples} is not allowed; expected an int >= 1")
    config = MQARConfig() if config is None else config
    check_examples_fit(num_examples, config)
    input_ids, labels = _generate(config, np.random.default_rng(seed), num_examples)
    dataset = Dataset.from_dict({"input_ids": input_ids, "labels": labels})
    dataset.info.description = f"MQAR {asdict(config)}"
    return dataset


def mqar_splits(num_train: int, num_test: int, config: MQARConfig | None = None, *, seed: int = 0) -> DatasetDict:
    """Train and test sets from disjoint seed streams: SeedSequence([seed, 0]) and ([seed, 1])."""
    return DatasetDict(
        {
            split: generate_mqar(size, config, seed=np.random.SeedSequence([seed, _SPLIT_STREAMS[split]]))
            for split, size in (("train", num_train), ("test", num_test))
        }
    )

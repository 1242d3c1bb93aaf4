"""Packed token blocks for training and evaluation, read in an order that a checkpoint can resume.

Training reads one *global batch* per optimizer step: `batch_size x num_processes x grad_accum`
blocks, the same tensor on every process, of which each process keeps its own slice. The
position in the block stream is part of the checkpoint, so a resumed run reads exactly the
blocks an uninterrupted run would have read.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from datasets import Dataset, IterableDataset

from hf_softmax_rnn.data.corpus import pack_texts

logger = logging.getLogger(__name__)

#: What may rewrite the blocks a stream hands out: (blocks `[N, L]`, each block's place in the stream) ->
#: blocks `[N, L]` (`data.recall.FactPlanter`).
BlockTransform = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]


class ShuffledBlocks:
    """A map-style dataset of packed blocks, reshuffled every epoch.

    The block at stream position p is `blocks[perm_e[p mod n]]` with e = p // n and perm_e a
    permutation drawn from (seed, e): the order is a pure function of the position. `transform`, if given,
    rewrites each block handed out, told its stream position.
    """

    def __init__(
        self,
        blocks: Dataset,
        seed: int,
        shuffle: bool = True,
        flag: str = "--block-size",
        transform: BlockTransform | None = None,
    ) -> None:
        if len(blocks) == 0:
            raise ValueError(f"The training split has no full block; use a smaller {flag} or more data")
        self.blocks = blocks.with_format("torch", columns=["input_ids"])
        self.seed = seed
        self.shuffle = shuffle
        self.transform = transform
        self.position = 0
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order = (epoch, rng.permutation(len(self)) if self.shuffle else np.arange(len(self)))
        return self._epoch_order[1]

    def next_blocks(self, count: int) -> torch.Tensor:
        """The next `count` blocks as input ids `[count, block_size]`."""
        indices, positions = [], range(self.position, self.position + count)
        for position in positions:
            epoch, offset = divmod(position, len(self))
            indices.append(int(self._order(epoch)[offset]))
        self.position += count
        ids = self.blocks[indices]["input_ids"]
        return ids if self.transform is None else self.transform(ids, list(positions))

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class StreamedBlocks:
    """Packed blocks of a streamed dataset, read in order (with a seeded shuffle buffer) and restarted
    with the next epoch's shuffle when exhausted. Every process reads the whole stream. `transform`, if
    given, rewrites each block handed out, told its place (epoch and offset, as one int)."""

    def __init__(
        self,
        blocks: IterableDataset,
        seed: int,
        shuffle_buffer: int,
        flag: str = "--block-size",
        transform: BlockTransform | None = None,
    ) -> None:
        self.blocks = blocks.shuffle(seed=seed, buffer_size=shuffle_buffer) if shuffle_buffer > 1 else blocks
        self.flag = flag
        self.transform = transform
        self.epoch = 0
        self.offset = 0
        self._iterator = None

    def _restart(self) -> None:
        # Skip by reading: `IterableDataset.skip` drops the epoch of the shuffle (datasets 5.2).
        self.blocks.set_epoch(self.epoch)
        self._iterator = itertools.islice(iter(self.blocks), self.offset, None)

    def next_blocks(self, count: int) -> torch.Tensor:
        """The next `count` blocks as input ids `[count, block_size]`."""
        rows, places = [], []
        while len(rows) < count:
            if self._iterator is None:
                self._restart()
            row = next(self._iterator, None)
            if row is not None:
                rows.append(row["input_ids"])
                places.append(self.epoch << 40 | self.offset)
                self.offset += 1
            elif self.offset == 0:
                raise ValueError(
                    f"The streamed training split has no full block; use a smaller {self.flag} or more data"
                )
            else:
                self.epoch, self.offset, self._iterator = self.epoch + 1, 0, None
        ids = torch.tensor(rows, dtype=torch.long)
        return ids if self.transform is None else self.transform(ids, places)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset, self._iterator = state["epoch"], state["offset"], None


def eval_blocks(texts, tokenizer, block_size: int, max_blocks: int | None) -> torch.Tensor:
    """Held-out input ids `[N, block_size]` (the first `max_blocks` blocks of the test split)."""
    packed = pack_texts(texts, tokenizer, block_size)
    if isinstance(packed, IterableDataset):
        rows = [row["input_ids"] for row in (packed.take(max_blocks) if max_blocks else packed)]
        ids = torch.tensor(rows, dtype=torch.long)
    else:
        if max_blocks is not None:
            packed = packed.select(range(min(max_blocks, len(packed))))
        ids = packed.with_format("torch", columns=["input_ids"])[:]["input_ids"]
    if ids.numel() == 0:
        raise ValueError(f"The held-out split has no full block of {block_size} tokens; use a smaller --block-size")
    return ids.reshape(-1, block_size)


def train_blocks(
    texts,
    tokenizer,
    block_size: int,
    *,
    seed: int,
    shuffle_buffer: int,
    flag: str = "--block-size",
    transform: BlockTransform | None = None,
) -> ShuffledBlocks | StreamedBlocks:
    """The training split packed into `block_size`-token blocks, in a seeded order, each rewritten by
    `transform` if given; `flag` is the setting that chose `block_size` (named when the split holds no full
    block)."""
    packed = pack_texts(texts, tokenizer, block_size)
    if isinstance(packed, IterableDataset):
        return StreamedBlocks(packed, seed=seed, shuffle_buffer=shuffle_buffer, flag=flag, transform=transform)
    return ShuffledBlocks(packed, seed=seed, flag=flag, transform=transform)


def split_global_batch(batch: torch.Tensor, *, grad_accum: int, num_processes: int, process_index: int) -> torch.Tensor:
    """This process's micro-batches `[grad_accum, batch_size, L]` of a global batch `[G, L]`,
    G = grad_accum x num_processes x batch_size."""
    return batch.reshape(grad_accum, num_processes, -1, batch.shape[-1])[:, process_index]

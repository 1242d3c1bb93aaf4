"""Training blocks are read in an order that is a pure function of the position, so a reader
restored from its state continues exactly where the first one was."""

import pytest
import torch
from datasets import Dataset, IterableDataset

from hf_softmax_rnn.training.data import ShuffledBlocks, StreamedBlocks, split_global_batch

NUM_BLOCKS, BLOCK = 7, 3


def _blocks() -> list[list[int]]:
    return [[10 * i + j for j in range(BLOCK)] for i in range(NUM_BLOCKS)]


def _shuffled() -> ShuffledBlocks:
    return ShuffledBlocks(Dataset.from_dict({"input_ids": _blocks()}), seed=3)


def _streamed(shuffle_buffer: int = 1) -> StreamedBlocks:
    def rows():
        for block in _blocks():
            yield {"input_ids": block}

    return StreamedBlocks(IterableDataset.from_generator(rows), seed=3, shuffle_buffer=shuffle_buffer)


READERS = {"shuffled": _shuffled, "streamed-in-order": _streamed, "streamed-shuffle-buffer": lambda: _streamed(4)}


@pytest.mark.parametrize("make_reader", READERS.values(), ids=READERS.keys())
def test_reader_restored_from_state_continues_identically(make_reader):
    reference = make_reader().next_blocks(3 * NUM_BLOCKS)
    first = make_reader()
    head = torch.cat([first.next_blocks(2), first.next_blocks(6)])
    second = make_reader()
    second.load_state_dict(first.state_dict())
    tail = torch.cat([second.next_blocks(5), second.next_blocks(3 * NUM_BLOCKS - 13)])
    assert torch.equal(torch.cat([head, tail]), reference)


@pytest.mark.parametrize("make_reader", READERS.values(), ids=READERS.keys())
def test_every_epoch_reads_every_block_once(make_reader):
    read = make_reader().next_blocks(3 * NUM_BLOCKS)
    for epoch in range(3):
        rows = sorted(read[epoch * NUM_BLOCKS : (epoch + 1) * NUM_BLOCKS].tolist())
        assert rows == _blocks()


def test_shuffled_epochs_differ_and_stream_without_buffer_is_in_order():
    shuffled = _shuffled().next_blocks(2 * NUM_BLOCKS)
    assert not torch.equal(shuffled[:NUM_BLOCKS], shuffled[NUM_BLOCKS:])
    assert _streamed().next_blocks(NUM_BLOCKS).tolist() == _blocks()


def test_split_global_batch_gives_each_process_its_own_micro_batches():
    grad_accum, processes, batch = 2, 3, 2
    global_batch = torch.arange(grad_accum * processes * batch)[:, None].expand(-1, BLOCK)
    parts = [
        split_global_batch(global_batch, grad_accum=grad_accum, num_processes=processes, process_index=r)
        for r in range(processes)
    ]
    assert all(p.shape == (grad_accum, batch, BLOCK) for p in parts)
    for micro in range(grad_accum):
        expected = global_batch[micro * processes * batch : (micro + 1) * processes * batch]
        assert torch.equal(torch.cat([p[micro] for p in parts]), expected)

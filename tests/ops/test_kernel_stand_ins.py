"""The counters of `kernel_stand_ins`: what they count is what a GPU would launch and write."""

import torch

from .kernel_stand_ins import WrittenBytes, saved_bytes


def test_written_bytes_count_products_and_copies_but_not_reshapes():
    """A batched product over leading dimensions (bmm, then `_unsafe_view` back to them) writes its result
    once; a transpose writes nothing; a copy writes its size; an in-place update writes its target."""
    a, b = torch.randn(2, 3, 16, 8), torch.randn(8, 4)
    with WrittenBytes() as counter:
        product = a @ b  # [2, 3, 16, 4] float32
    assert (counter.operations, counter.bytes) == (1, product.numel() * 4)
    with WrittenBytes() as counter:
        product.transpose(1, 2).contiguous().mul_(2.0)
    assert (counter.operations, counter.bytes) == (2, 2 * product.numel() * 4)


def test_written_bytes_of_an_indexed_write_in_place_are_the_entries_written():
    """`scatter_` returns its whole target but writes one row of it (a ring buffer's slot); the copying
    `scatter` writes the whole result."""
    buffer, row = torch.zeros(4, 3, 64, 16), torch.randn(4, 3, 1, 16)
    index = torch.full((4, 3, 1, 16), 5)
    with WrittenBytes() as counter:
        buffer.scatter_(2, index, row)
        buffer.scatter_(2, index, 0.0)
    assert (counter.operations, counter.bytes) == (2, 2 * row.numel() * 4)
    with WrittenBytes() as counter:
        buffer.scatter(2, index, row)
    assert counter.bytes == buffer.numel() * 4


def test_saved_bytes_count_each_storage_once_and_only_what_the_graph_keeps():
    """x saved twice counts once; a node whose result is detached at once (a row max taken for a shift)
    is freed with it, and so is what it saved."""
    x = torch.randn(64, 64, requires_grad=True)
    assert saved_bytes(lambda: (x * x).sum()) == 64 * 64 * 4
    assert saved_bytes(lambda: (x.exp().amax(-1).detach(), x * 2)) == 0

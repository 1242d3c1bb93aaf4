"""`ops.short_conv` against its float64 one-position-at-a-time definition."""

import pytest
import torch

from hf_softmax_rnn.ops.short_conv import short_conv, short_conv_reference


def _inputs(batch=2, heads=3, length=11, channels=5, width=4, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, length, channels, generator=generator, dtype=dtype)
    weight = torch.randn(heads, channels, width, generator=generator, dtype=dtype)
    return x, weight


def _manual(x, weight):
    """y_t = sum_j w_j x_{t-K+1+j}, straight from the definition with zeros before the first position."""
    width = weight.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[2]):
        for j in range(width):
            source = t - width + 1 + j
            if source >= 0:
                out[:, :, t] += weight[None, :, :, j] * x[:, :, source]
    return out


@pytest.mark.parametrize("width", [2, 4], ids=lambda w: f"width{w}")
@pytest.mark.parametrize("length", [1, 3, 11], ids=lambda n: f"length{n}")
def test_short_conv_matches_its_definition(width, length):
    x, weight = _inputs(length=length, width=width)
    y, tail = short_conv(x, weight)
    reference, reference_tail = short_conv_reference(x, weight)
    torch.testing.assert_close(y, _manual(x, weight), rtol=0, atol=1e-12)
    torch.testing.assert_close(reference, _manual(x, weight), rtol=0, atol=1e-12)
    torch.testing.assert_close(tail, reference_tail, rtol=0, atol=0)
    assert tail.shape == (2, 3, width - 1, 5)


@pytest.mark.parametrize("pieces", [(11,), (4, 7), (1, 1, 9), (6, 1, 1, 1, 1, 1)], ids=str)
def test_a_sequence_fed_in_pieces_gives_what_it_gives_whole(pieces):
    x, weight = _inputs(dtype=torch.float32)
    whole, whole_tail = short_conv(x, weight)
    outputs, tail, start = [], None, 0
    for size in pieces:
        y, tail = short_conv(x[:, :, start : start + size], weight, tail)
        outputs.append(y)
        start += size
    torch.testing.assert_close(torch.cat(outputs, dim=2), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(tail, whole_tail, rtol=0, atol=0)


def test_padding_reads_as_zero_so_a_left_padded_row_gives_its_unpadded_output():
    x, weight = _inputs(batch=1, length=8, dtype=torch.float32)
    padded = torch.cat([torch.randn(1, 3, 3, 5), x], dim=2)
    mask = torch.tensor([[False] * 3 + [True] * 8])
    y, tail = short_conv(padded, weight, mask=mask)
    torch.testing.assert_close(y[:, :, 3:], short_conv(x, weight)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(y, short_conv_reference(padded, weight, mask=mask)[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(tail, x[:, :, -3:], rtol=0, atol=0)


def test_the_identity_taps_leave_the_input_unchanged():
    x, weight = _inputs(dtype=torch.float32)
    identity = torch.zeros_like(weight)
    identity[..., -1] = 1.0
    torch.testing.assert_close(short_conv(x, identity)[0], x, rtol=0, atol=0)


def test_gradients_match_the_reference():
    x, weight = _inputs(length=6, width=3)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    grads = torch.autograd.grad(short_conv(x, weight)[0].square().sum(), (x, weight))
    reference = torch.autograd.grad(short_conv_reference(x, weight)[0].square().sum(), (x, weight))
    for grad, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "weight_shape, tail_shape, mask_shape, message",
    [
        ((3, 4, 4), None, None, r"weight has shape \(3, 4, 4\); expected \[heads, channels, width >= 2\]"),
        ((3, 5, 1), None, None, r"weight has shape \(3, 5, 1\)"),
        ((3, 5, 4), (2, 3, 2, 5), None, r"tail has shape \(2, 3, 2, 5\); expected \[2, 3, 3, 5\]"),
        ((3, 5, 4), None, (2, 10), r"mask has shape \(2, 10\); expected \[2, 11\]"),
    ],
    ids=["weight_channels", "weight_width_1", "tail_width", "mask_length"],
)
def test_shapes_that_do_not_fit_are_refused_naming_them(weight_shape, tail_shape, mask_shape, message):
    x, _ = _inputs()
    weight = torch.randn(weight_shape, dtype=x.dtype)
    tail = None if tail_shape is None else torch.zeros(tail_shape, dtype=x.dtype)
    mask = None if mask_shape is None else torch.ones(mask_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        short_conv(x, weight, tail, mask)

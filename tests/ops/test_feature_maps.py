"""The hedgehog feature map in each of its layouts (the product with [W, -W] broadcast over the batch for
long calls; the batch folded into the rows for short ones, with [W, -W] for more rows than D and with W, its output
negated, for fewer) against its definition, values and gradients in float64."""

import pytest
import torch

from hf_softmax_rnn.ops.feature_maps import HedgehogKernel

HEADS, KV_HEADS, HEAD_DIM, FEATURES = 6, 2, 8, 5  # 2F = 10


def _definition(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    projected = x @ weight
    return torch.cat([torch.softmax(projected, -1), torch.softmax(-projected, -1)], -1)


@pytest.mark.parametrize("length", [1, 9, 10, 23], ids=["decoding", "short_many_rows", "at_2F", "long"])
@pytest.mark.parametrize("layout", ["time_major", "contiguous"])
def test_hedgehog_features_match_their_definition(length, layout):
    """q as a model makes it (a transposed view of the projection, time-major in memory) or contiguous."""
    generator = torch.Generator().manual_seed(length)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()

    projection, k = leaf(3, length, HEADS, HEAD_DIM), leaf(3, KV_HEADS, length, HEAD_DIM)
    weight_q, weight_k = leaf(HEADS, HEAD_DIM, FEATURES), leaf(KV_HEADS, HEAD_DIM, FEATURES)
    q = projection.transpose(1, 2)
    q = (q if layout == "time_major" else q.contiguous()).view(3, KV_HEADS, HEADS // KV_HEADS, length, HEAD_DIM)
    kernel = HedgehogKernel(0.5, weight_q, weight_k)
    (features, factor), keys = kernel.query_features_and_factor(q), kernel.key_features(k)
    expected = (_definition(q, weight_q.view(KV_HEADS, -1, HEAD_DIM, FEATURES)), _definition(k, weight_k))
    assert factor == 0.5
    torch.testing.assert_close(features, expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(keys, expected[1], rtol=0, atol=1e-12)
    probes = torch.randn_like(features), torch.randn_like(keys)
    leaves = [projection, k, weight_q, weight_k]

    def gradients(outputs):
        return torch.autograd.grad(sum((x * p).sum() for x, p in zip(outputs, probes, strict=True)), leaves)

    for got, want in zip(gradients((features, keys)), gradients(expected), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

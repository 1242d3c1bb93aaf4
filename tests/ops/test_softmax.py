"""Exact softmax: SDPA path against the float64 reference, with GQA, padding and a KV cache."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention, softmax_attention_reference

from .helpers import left_padding_mask, make_inputs


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("query_len", [10, 3, 1], ids=lambda n: f"q{n}")
def test_sdpa_matches_reference(padded, query_len):
    q, k, v, _ = make_inputs(length=10, dtype=torch.float32)
    q = q[..., -query_len:, :]
    mask = left_padding_mask(2, 10, [0, 4]) if padded else None
    out, state = attention(q, k, v, AttentionSpec(), attention_mask=mask)
    reference = softmax_attention_reference(q, k, v, None if mask is None else mask.bool(), 8**-0.5)
    assert state is None
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_recurrent_softmax_exact_exp_with_softmax_normaliser_is_softmax():
    q, k, v, _ = make_inputs(length=12)
    mask = left_padding_mask(2, 12, [5, 0])
    exact, _ = attention(q, k, v, AttentionSpec(), attention_mask=mask)
    recurrent, _ = attention(q, k, v, AttentionSpec(kind="recurrent_softmax"), attention_mask=mask)
    torch.testing.assert_close(recurrent, exact)


def test_fully_padded_rows_are_zero_not_nan():
    q, k, v, _ = make_inputs(length=6, dtype=torch.float32)
    mask = left_padding_mask(2, 6, [3, 0])
    for spec in (
        AttentionSpec(),
        AttentionSpec(kind="recurrent_softmax"),
        AttentionSpec(kind="linear", feature_map="elu"),
    ):
        out, _ = attention(q, k, v, spec, attention_mask=mask)
        assert torch.isfinite(out).all()
        assert out[0, :, :3].abs().max() == 0

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


def _explicit_sliding_softmax(q, k, v, mask, window, scale):
    """Sliding-window softmax with its mask written out key by key, in float64."""
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    query_len, key_len = q.shape[-2], k.shape[-2]
    allowed = torch.zeros(q.shape[0], query_len, key_len, dtype=torch.bool)
    for row in range(query_len):
        position = key_len - query_len + row
        for key in range(max(0, position - window + 1), position + 1):
            allowed[:, row, key] = True if mask is None else mask[:, key].bool()
    scores = (scale * q64 @ k64.transpose(-1, -2)).masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v64).to(q.dtype)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("query_len", [10, 3, 1], ids=lambda n: f"q{n}")
@pytest.mark.parametrize("window", [1, 4, 10], ids=lambda w: f"window{w}")
def test_sliding_window_softmax_reads_only_its_window(padded, query_len, window):
    q, k, v, _ = make_inputs(length=10, dtype=torch.float32)
    q = q[..., -query_len:, :]
    mask = left_padding_mask(2, 10, [0, 4]) if padded else None
    out, _ = attention(q, k, v, AttentionSpec(window=window), attention_mask=mask)
    expected = _explicit_sliding_softmax(q, k, v, mask, window, 8**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    reference = softmax_attention_reference(q, k, v, None if mask is None else mask.bool(), 8**-0.5, window)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-6)


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


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("query_len", [10, 1], ids=lambda n: f"q{n}")
@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_soft_capped_scores_match_the_reference_and_bend_the_scores(padded, query_len, window):
    """softcap c: c tanh(s / c) of each scaled score, as the float64 reference computes it (fully padded rows
    zero), in the full and the sliding-window form and for queries at the end (decoding from a KV cache)."""
    q, k, v, _ = make_inputs(length=10, dtype=torch.float32)
    q = 4 * q[..., -query_len:, :]  # scores of several units: a cap of 0.5 bends them
    mask = left_padding_mask(2, 10, [0, 4]) if padded else None
    key_mask = None if mask is None else mask.bool()
    out, _ = attention(q, k, v, AttentionSpec(window=window), attention_mask=mask, softcap=0.5)
    reference = softmax_attention_reference(q, k, v, key_mask, 8**-0.5, window, softcap=0.5)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
    uncapped = softmax_attention_reference(q, k, v, key_mask, 8**-0.5, window)
    assert (uncapped - reference).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("softcap", "spec", "message"),
    [
        (0.0, AttentionSpec(), r"softcap=0.0 is not allowed; expected None or a finite number > 0"),
        (float("inf"), AttentionSpec(), r"softcap=inf is not allowed"),
        (
            50.0,
            AttentionSpec.from_preset("linear_elu"),
            r"softcap=50.0 caps exact softmax scores, but the spec \(kind='linear', window=None\) has none .*"
            r"expected kind='softmax', a window hybrid \(window=W: its window, sinks and kept keys take the cap\)",
        ),
    ],
    ids=["zero", "infinite", "finite-state"],
)
def test_a_softcap_is_refused_without_exact_softmax_scores_or_out_of_range(softcap, spec, message):
    q, k, v, _ = make_inputs(length=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, spec, softcap=softcap)

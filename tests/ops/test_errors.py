"""Bad input to the ops raises with a message naming the value and what is allowed."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import RecurrentState, attention

from .helpers import make_inputs


@pytest.mark.parametrize(
    ("spec", "mode", "message"),
    [
        (AttentionSpec(), "chunked", "exact exponential"),
        (AttentionSpec(kind="recurrent_softmax", normalizer="l2"), "recurrent", "exact exponential"),
        (AttentionSpec(kind="recurrent_softmax", taylor_order=2, score_clamp=5.0), "chunked", "score_clamp=5.0"),
        (
            AttentionSpec(kind="recurrent_softmax", taylor_order=6),
            "recurrent",
            r"order-6 Taylor state for head_dim=8 needs",
        ),
        (AttentionSpec(kind="linear", feature_map="elu"), "sideways", "mode='sideways'"),
    ],
    ids=["softmax_chunked", "exact_exp_recurrent", "clamped_taylor", "state_too_big", "unknown_mode"],
)
def test_mode_errors(spec, mode, message):
    q, k, v, _ = make_inputs(length=4)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, spec, mode=mode, max_state_bytes=10_000)


def test_state_too_big_reports_bytes():
    spec = AttentionSpec(kind="recurrent_softmax", taylor_order=3, normalizer="l2")
    with pytest.raises(ValueError, match=r"needs 12,455,300 bytes per KV head \(47,905 features\)"):
        spec.check_mode("chunked", 64, max_state_bytes=1_000_000)
    assert spec.state_bytes(64) == (1 + 64 + 2080 + 45760) * 65 * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(q_heads=3), r"multiple of key/value heads"),
        (dict(gates={}), r"needs gates\['output'\]"),
        (dict(mask=torch.ones(2, 3)), "covers 3 positions"),
        (dict(state=True), "takes no state"),
    ],
    ids=["gqa_ratio", "missing_gate", "short_mask", "state_in_parallel"],
)
def test_input_errors(kwargs, message):
    q, k, v, _ = make_inputs(length=4)
    if "q_heads" in kwargs:
        q = q[:, :3]
    spec = AttentionSpec(kind="linear", feature_map="elu", output_gate="gates" in kwargs)
    state = RecurrentState.zeros(2, 2, 8, 8, 8) if kwargs.get("state") else None
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, spec, gates=kwargs.get("gates"), attention_mask=kwargs.get("mask"), state=state)


def test_hedgehog_needs_its_weights():
    q, k, v, _ = make_inputs(length=4)
    with pytest.raises(ValueError, match="hedgehog_q"):
        attention(q, k, v, AttentionSpec(kind="linear", feature_map="hedgehog"))

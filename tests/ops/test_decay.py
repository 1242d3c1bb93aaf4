"""The data-dependent decay of the finite state against its definition written out one query at a time
(float64): key s enters the state at step s + W (W the window, 0 without one) and weighs
exp(sum_{r=s+W+1..t} g_r) phi(q_t).phi(k_s) for query t; padding positions have g = 0."""

import pytest
import torch
import torch.nn.functional as F

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention

from .helpers import as_params, gated, left_padding_mask, make_inputs, make_params
from .test_window import naive_window_attention

SPECS = {
    "elu": AttentionSpec(kind="linear", feature_map="elu", decay=True, chunk_size=3),
    "elu_w3": AttentionSpec(kind="linear", feature_map="elu", window=3, decay=True, chunk_size=4),
    "hedgehog_w2_sinks2": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=2, decay=True, chunk_size=2
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_modes_match_the_definition(name, mode):
    spec = SPECS[name]
    q, k, v, gate_logits = make_inputs(length=10)
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, 10, [0, 3])
    log_decay = F.logsigmoid(gate_logits["decay"] + 1.0)
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params, gates={"decay": log_decay})
    want = naive_window_attention(q, k, v, spec, params, mask.bool(), 8**-0.5, log_decay)
    torch.testing.assert_close(got * mask[:, None, :, None], want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_log_decays_of_minus_inf_or_minus_1e30_forget_the_state(name, mode):
    """a_r = 0 (log-decay -inf) or e^-1e30: the state is forgotten there, as the definition says; the prefix
    sums of the log-decays gave NaN (inf - inf) or, at -1e30, kept no precision for the other positions."""
    spec = SPECS[name]
    q, k, v, gate_logits = make_inputs(length=10)
    params = as_params(make_params(spec))
    log_decay = F.logsigmoid(gate_logits["decay"] + 1.0)
    log_decay[0, :, 4] = float("-inf")
    log_decay[1, :, 6] = -1e30
    mask = torch.ones(2, 10, dtype=torch.bool)
    got, _ = attention(q, k, v, spec, mode=mode, params=params, gates={"decay": log_decay})
    want = naive_window_attention(q, k, v, spec, params, mask, 8**-0.5, log_decay)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_zero_log_decay_is_the_spec_without_decay(name):
    spec = SPECS[name]
    undecayed = AttentionSpec(**{**spec.to_dict(), "decay": False})
    q, k, v, _ = make_inputs(length=9)
    params = as_params(make_params(spec))
    zeros = {"decay": torch.zeros(2, 2, 9, dtype=torch.float64)}
    for mode in ("parallel", "chunked"):
        got, _ = attention(q, k, v, spec, mode=mode, params=params, gates=zeros)
        want, _ = attention(q, k, v, undecayed, mode=mode, params=params)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_padding_never_decays_the_state():
    spec = SPECS["elu_w3"]
    q, k, v, gate_logits = make_inputs(batch=1, length=8)
    params = as_params(make_params(spec))
    _, gates = gated(spec, v, gate_logits)
    pad = 3
    padded = [torch.cat([torch.randn(*x.shape[:-2], pad, x.shape[-1], dtype=x.dtype), x], dim=-2) for x in (q, k, v)]
    padded_gates = {"decay": torch.cat([torch.full((1, 2, pad), -5.0, dtype=torch.float64), gates["decay"]], dim=-1)}
    mask = left_padding_mask(1, 8 + pad, [pad])
    for mode in ("parallel", "chunked", "recurrent"):
        out_padded, _ = attention(*padded, spec, mode=mode, attention_mask=mask, params=params, gates=padded_gates)
        out_plain, _ = attention(q, k, v, spec, mode=mode, params=params, gates=gates)
        torch.testing.assert_close(out_padded[..., pad:, :], out_plain, rtol=1e-9, atol=1e-10)


def test_in_place_decoding_decays_the_passed_state():
    spec = SPECS["elu"]
    q, k, v, gate_logits = make_inputs(length=6)
    params = as_params(make_params(spec))
    _, gates = gated(spec, v, gate_logits)
    _, state = attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], spec, mode="chunked", params=params,
                         gates={"decay": gates["decay"][..., :5]})  # fmt: skip
    step = dict(mode="recurrent", params=params, gates={"decay": gates["decay"][..., 5:]})
    fresh, fresh_state = attention(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :], spec, state=state, **step)
    packed = state.packed.clone()
    state.packed = packed
    with torch.no_grad():
        out, new_state = attention(
            q[..., 5:, :], k[..., 5:, :], v[..., 5:, :], spec, state=state, update_state_in_place=True, **step
        )
    assert new_state.packed is packed
    torch.testing.assert_close(out, fresh)
    torch.testing.assert_close(new_state.packed, fresh_state.packed)


@pytest.mark.parametrize(
    ("spec", "gates", "message"),
    [
        (SPECS["elu"], {}, r"has decay=True, so it takes gates\['decay'\].*and needs them"),
        (AttentionSpec(kind="linear", feature_map="elu"), {"decay": torch.zeros(2, 2, 4)}, "only with decay=True"),
        (SPECS["elu"], {"decay": torch.zeros(2, 4, 4)}, r"has shape \(2, 4, 4\); expected .* \[2, 2, 4\]"),
    ],
    ids=["missing", "unexpected", "per-query-head"],
)
def test_bad_decay_gates_raise(spec, gates, message):
    q, k, v, _ = make_inputs(length=4)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, spec, mode="chunked", gates=gates)

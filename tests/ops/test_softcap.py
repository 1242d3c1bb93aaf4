"""Soft-capped scores (Gemma 2's `attn_logit_softcapping` c: each scaled exact score x becomes c tanh(x / c)).

- Window hybrids cap their exact part (window, sinks, kept keys, and the window softmax that ranks the kept
  keys) in the parallel, chunked and recurrent forms, as the float64 definitions written one query at a time
  do (`naive_window_attention`, `simulated_kept_attention`); their finite state stays uncapped.
- Prefill in pieces and decoding steps hand the state on as one call does; a state made under another cap
  is refused.
- FlexAttention's form (a `score_mod`) and a call whose keys are all exact (SDPA's shortcut) cap too.
- Exact softmax with a cap runs a block of queries at a time: the values of one block (the L x L form it
  was), and no L x L tensor of scores, neither computed nor kept for the backward pass.
"""

import importlib

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention, backends
from hf_softmax_rnn.ops.flex_window import flex_window_attention, window_attention_reference
from hf_softmax_rnn.ops.softmax import SOFTCAP_QUERY_BLOCK, softcapped_softmax_attention, softmax_attention_reference

from .helpers import as_params, gated, left_padding_mask, make_inputs, make_params
from .kernel_stand_ins import LargestTensor
from .test_kept import _assert_same_state, simulated_kept_attention
from .test_window import naive_window_attention

CAP = 1.0
TOL = dict(rtol=1e-9, atol=1e-10)
WINDOW_SPECS = {
    "elu_w3": AttentionSpec(kind="linear", feature_map="elu", window=3),
    "hedgehog_w1_sinks3_c2": AttentionSpec(kind="linear", feature_map="hedgehog", window=1, sinks=3, chunk_size=2),
    "taylor2_w2_sinks2_l2": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, window=2, sinks=2, normalizer="l2", norm_eps=1e-30
    ),
}
KEPT_SPECS = {
    "elu_w3_kept2": AttentionSpec(kind="linear", feature_map="elu", window=3, kept=2),
    "hedgehog_w2_kept3_sinks2_c2": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=2, kept=3, chunk_size=2
    ),
    "elu_w1_kept4_sinks1_decay": AttentionSpec(kind="linear", feature_map="elu", window=1, sinks=1, kept=4, decay=True),
}
#: Beside the above, a delta-rule state with a decay, sinks and kept keys.
HAND_OFF_SPECS = {
    **WINDOW_SPECS,
    **KEPT_SPECS,
    "delta_kept2_decay_w3_sinks1_hedgehog": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=3, sinks=1, kept=2, decay=True, delta_rule=True
    ),
}


def _case(spec, length=12, seed=0):
    """Scores of several units (q and k times 3), which a cap of 1 bends; row 1 left-padded by 3."""
    q, k, v, logits = make_inputs(length=length, seed=seed)
    v, gates = gated(spec, v, logits)
    return 3 * q, 3 * k, v, gates, as_params(make_params(spec)), left_padding_mask(2, length, [0, 3])


def _rows(mask):
    return mask[:, None, :, None]


@pytest.mark.parametrize("name", sorted(WINDOW_SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_a_window_hybrid_caps_its_window_and_sinks_as_the_definition(name, mode):
    spec = WINDOW_SPECS[name]
    q, k, v, _, params, mask = _case(spec, length=9)
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params, softcap=CAP)
    want = naive_window_attention(q, k, v, spec, params, mask.bool(), 8**-0.5, softcap=CAP)
    torch.testing.assert_close(got * _rows(mask), want, **TOL)
    uncapped = naive_window_attention(q, k, v, spec, params, mask.bool(), 8**-0.5)
    assert (uncapped - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(KEPT_SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_kept_keys_are_ranked_and_scored_under_the_cap_as_the_simulation(name, mode):
    spec = KEPT_SPECS[name]
    q, k, v, gates, params, mask = _case(spec)
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params, gates=gates, softcap=CAP)
    decay = gates.get("decay")
    want = simulated_kept_attention(q, k, v, spec, params, mask.bool(), 8**-0.5, decay, softcap=CAP)
    torch.testing.assert_close(got * _rows(mask), want, **TOL)
    uncapped = simulated_kept_attention(q, k, v, spec, params, mask.bool(), 8**-0.5, decay)
    assert (uncapped - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(HAND_OFF_SPECS))
def test_capped_states_hand_over_between_calls_and_decoding_steps(name):
    """Prefill in pieces, two decoding steps among them (recurrent mode: the step form), gives the outputs of
    one chunked call and of the parallel form, and one call's state."""
    spec = HAND_OFF_SPECS[name]
    q, k, v, gates, params, mask = _case(spec, length=13, seed=3)
    common = dict(attention_mask=mask, params=params, gates=gates, softcap=CAP)
    whole, whole_state = attention(q, k, v, spec, mode="chunked", **common)
    parallel, _ = attention(q, k, v, spec, mode="parallel", **common)
    pieces, state = [], None
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 13)):
        part, mode = slice(start, stop), "recurrent" if stop - start == 1 else "chunked"
        out, state = attention(
            q[..., part, :], k[..., part, :], v[..., part, :], spec, mode=mode,
            attention_mask=mask[:, :stop], params=params, gates={name: x[..., part] for name, x in gates.items()},
            state=state, softcap=CAP,
        )  # fmt: skip
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(whole * _rows(mask), parallel * _rows(mask), rtol=1e-10, atol=1e-12)
    _assert_same_state(state, whole_state)


def test_a_state_made_under_another_cap_is_refused():
    spec = KEPT_SPECS["elu_w3_kept2"]
    q, k, v, _, params, _ = _case(spec)
    _, state = attention(q[..., :6, :], k[..., :6, :], v[..., :6, :], spec, mode="chunked", params=params, softcap=CAP)
    with pytest.raises(ValueError, match=r"it has softcap=1.0 \(here None\); start from state=None"):
        attention(q[..., 6:7, :], k[..., 6:7, :], v[..., 6:7, :], spec, mode="recurrent", params=params, state=state)


@pytest.mark.parametrize(
    "spec",
    [AttentionSpec(kind="linear", feature_map="elu", window=4, sinks=2), KEPT_SPECS["elu_w3_kept2"]],
    ids=["window4_sinks2", "window3_kept2"],
)
def test_a_call_with_every_key_exact_caps_its_scores(spec):
    """A call no longer than the exact part that needs no state runs exact softmax (SDPA's shortcut, here the
    capped explicit form): the values of the band form that hands its state on, and of the float64 softmax."""
    q, k, v, _, params, mask = _case(spec, length=spec.exact_positions)
    common = dict(mode="chunked", attention_mask=mask, params=params, softcap=CAP)
    shortcut, _ = attention(q, k, v, spec, return_state=False, **common)
    band, state = attention(q, k, v, spec, **common)
    assert state is not None
    torch.testing.assert_close(shortcut * _rows(mask), band * _rows(mask), **TOL)
    want = softmax_attention_reference(q, k, v, mask.bool(), 8**-0.5, softcap=CAP)
    torch.testing.assert_close(shortcut, want, **TOL)


def test_flex_attention_caps_the_window_through_its_score_mod():
    """FlexAttention's eager form (forward; CPU) with the cap as its `score_mod`: the dense float64 reference."""
    q, k, v, _ = make_inputs(2, 4, 2, 23, 16, dtype=torch.float32)
    q, k = 3 * q, 3 * k
    valid = left_padding_mask(2, 23, [0, 5]).bool()
    with torch.no_grad():
        out, lse = flex_window_attention(q, k, v, valid, 0.25, 4, sinks=2, compiled=False, softcap=CAP)
    want_out, want_lse = window_attention_reference(q.double(), k.double(), v.double(), valid, 0.25, 4, 2, CAP)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    uncapped = window_attention_reference(q.double(), k.double(), v.double(), valid, 0.25, 4, 2)[1]
    assert (uncapped[valid[:, None].expand_as(uncapped)] - want_lse[valid[:, None].expand_as(want_lse)]).abs().max() > 1


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(kind="linear", feature_map="hedgehog", window=4, sinks=2, decay=True, chunk_size=8),
        AttentionSpec(kind="linear", feature_map="hedgehog", window=4, sinks=2, kept=3, chunk_size=8),
    ],
    ids=["window4_sinks2_decay", "window4_sinks2_kept3"],
)
def test_the_flex_path_of_a_capped_hybrid_has_the_parallel_form_s_values(monkeypatch, spec):
    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cpu",))
    calls = []
    monkeypatch.setattr(
        importlib.import_module("hf_softmax_rnn.ops.attention"),
        "flex_window_attention",
        lambda *args, **kwargs: calls.append(kwargs) or flex_window_attention(*args, **kwargs),
    )
    q, k, v, logits = make_inputs(2, 4, 2, 23, 16)
    q, k = 3 * q, 3 * k
    mask = left_padding_mask(2, 23, [0, 5])
    params = make_params(spec, 4, 2, 16)
    gates = {"decay": torch.nn.functional.logsigmoid(logits["decay"] + 2)} if spec.decay else {}
    want, _ = attention(
        q, k, v, spec, mode="parallel", attention_mask=mask, params=as_params(params), gates=gates, softcap=CAP
    )
    with torch.no_grad():
        got, _ = attention(
            q.float(), k.float(), v.float(), spec, mode="chunked", attention_mask=mask, return_state=False,
            params=as_params({name: x.float() for name, x in params.items()}),
            gates={name: x.float() for name, x in gates.items()}, softcap=CAP,
        )  # fmt: skip
    assert calls == [{"sinks": 2, "compiled": False, "softcap": CAP}]
    torch.testing.assert_close(got.double() * _rows(mask), want * _rows(mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "spec, softcap, message",
    [
        (AttentionSpec.from_preset("linear_elu"), 50.0, r"kind='linear', window=None\) has none"),
        (AttentionSpec(kind="recurrent_softmax"), 50.0, r"kind='recurrent_softmax', window=None\) has none"),
        (AttentionSpec(kind="linear", feature_map="elu", window=2), -1.0, r"softcap=-1.0 is not allowed"),
    ],
    ids=["finite-state", "exact-exp", "negative"],
)
def test_a_cap_is_refused_without_exact_softmax_scores_or_out_of_range(spec, softcap, message):
    q, k, v, _ = make_inputs(length=4)
    params = as_params(make_params(spec))
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, spec, params=params, softcap=softcap)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("query_len", [37, 5, 1], ids=lambda n: f"q{n}")
@pytest.mark.parametrize("window", [None, 4, 11], ids=["full", "window4", "window11"])
def test_blocks_of_queries_give_the_values_of_one_block(padded, query_len, window):
    """Blocks of 8 queries (each against the keys it sees) = one block of every query (the L x L form) to float32
    round-off, and the float64 reference; queries at the end of 37 keys (decoding from a KV cache) included."""
    q, k, v, _ = make_inputs(length=37, dtype=torch.float32)
    q = 3 * q[..., -query_len:, :]
    key_mask = left_padding_mask(2, 37, [0, 9]).bool() if padded else None
    blocks = softcapped_softmax_attention(q, k, v, key_mask, 8**-0.5, window, CAP, block=8)
    one_block = softcapped_softmax_attention(q, k, v, key_mask, 8**-0.5, window, CAP, block=37)
    torch.testing.assert_close(blocks, one_block, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        blocks, softmax_attention_reference(q, k, v, key_mask, 8**-0.5, window, CAP), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_the_gradients_of_blocks_recomputed_in_the_backward_are_the_reference_s(window):
    q, k, v, _ = make_inputs(length=21, requires_grad=True)
    key_mask = left_padding_mask(2, 21, [0, 6]).bool()
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)
    got = softcapped_softmax_attention(3 * q, k, v, key_mask, 8**-0.5, window, CAP, block=4)
    want = softmax_attention_reference(3 * q, k, v, key_mask, 8**-0.5, window, CAP)
    torch.testing.assert_close(got, want, **TOL)
    for got_grad, want_grad in zip(
        torch.autograd.grad((got * weights).sum(), (q, k, v)),
        torch.autograd.grad((want * weights).sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(got_grad, want_grad, **TOL)


@pytest.mark.parametrize("window", [None, 64], ids=["full", "window64"])
def test_capped_exact_softmax_never_holds_a_full_score_matrix(window):
    """1,024 queries and keys, 2 heads: the largest tensor is one block's scores (128 queries against the keys they
    see, at most all 1,024; with a window of 64, 191), not the 8 MB of 1,024 x 1,024 scores (float32), and with
    autograd the call keeps its inputs for the backward pass, not its scores (they are recomputed there)."""
    length, heads = 1024, 2
    q, k, v, _ = make_inputs(batch=1, heads=heads, kv_heads=1, length=length, dtype=torch.float32, requires_grad=True)
    spec = AttentionSpec(window=window)
    with LargestTensor() as largest, torch.no_grad():
        attention(q, k, v, spec, softcap=CAP)
    keys = length if window is None else SOFTCAP_QUERY_BLOCK + window - 1
    assert largest.bytes <= heads * SOFTCAP_QUERY_BLOCK * keys * 4, largest.bytes
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out, _ = attention(q, k, v, spec, softcap=CAP)
    assert sum(storages.values()) < 4 * q.numel() * 4, sum(storages.values())  # q, k, v (float32) and masks
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()

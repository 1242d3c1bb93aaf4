"""parallel == chunked == recurrent, outputs, states and gradients, for every finite-state variant."""

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_softmax_rnn.ops import attention

from .helpers import FINITE_SPECS, as_params, gated, left_padding_mask, make_inputs, make_params

#: the module, which `hf_softmax_rnn.ops.attention` (the function) hides
attention_module = importlib.import_module("hf_softmax_rnn.ops.attention")

SPEC_IDS = sorted(FINITE_SPECS)
TOL = dict(rtol=1e-9, atol=1e-10)


def _run(spec, mode, q, k, v, gate_logits, params, mask, state=None):
    v, gates = gated(spec, v, gate_logits)
    return attention(q, k, v, spec, mode=mode, attention_mask=mask, gates=gates, params=as_params(params), state=state)


@pytest.mark.parametrize("name", SPEC_IDS)
@pytest.mark.parametrize("chunk_size", [1, 4, 64], ids=lambda c: f"chunk{c}")
def test_outputs_agree(name, chunk_size):
    spec = FINITE_SPECS[name].__class__(**{**FINITE_SPECS[name].to_dict(), "chunk_size": chunk_size})
    q, k, v, gate_logits = make_inputs(length=11)
    params = make_params(spec)
    mask = left_padding_mask(2, 11, [0, 3])
    parallel, no_state = _run(spec, "parallel", q, k, v, gate_logits, params, mask)
    chunked, chunked_state = _run(spec, "chunked", q, k, v, gate_logits, params, mask)
    recurrent, recurrent_state = _run(spec, "recurrent", q, k, v, gate_logits, params, mask)
    assert no_state is None
    torch.testing.assert_close(chunked, parallel, **TOL)
    torch.testing.assert_close(recurrent, parallel, **TOL)
    for field in ("S", "z", "t"):
        torch.testing.assert_close(getattr(chunked_state, field), getattr(recurrent_state, field), **TOL)
    assert chunked_state.t.tolist() == [11, 8]


@pytest.mark.parametrize("name", SPEC_IDS)
def test_gradients_agree(name):
    spec = FINITE_SPECS[name].__class__(**{**FINITE_SPECS[name].to_dict(), "chunk_size": 4})
    q, k, v, gate_logits = make_inputs(length=10, requires_grad=True)
    params = make_params(spec, requires_grad=True)
    mask = left_padding_mask(2, 10, [2, 0])
    leaves = [q, k, v, *gate_logits.values(), *params.values()]
    weights = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)

    def grads(mode, with_state):
        out, state = _run(spec, mode, q, k, v, gate_logits, params, mask)
        loss = (out * weights).sum()
        if with_state:
            loss = loss + 0.1 * state.S.sum() + 0.2 * state.z.sum()
        found = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(found, leaves, strict=True)]

    reference = grads("parallel", with_state=False)
    for mode in ("chunked", "recurrent"):
        for got, want in zip(grads(mode, with_state=False), reference, strict=True):
            torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(grads("chunked", with_state=True), grads("recurrent", with_state=True), strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name", SPEC_IDS)
@pytest.mark.parametrize("second_mode", ["chunked", "recurrent"])
def test_state_handed_across_calls(name, second_mode):
    """Prefill in two pieces (then decode token by token) == prefill in one."""
    spec = FINITE_SPECS[name].__class__(**{**FINITE_SPECS[name].to_dict(), "chunk_size": 3})
    q, k, v, gate_logits = make_inputs(length=13)
    params = make_params(spec)
    mask = left_padding_mask(2, 13, [0, 5])
    whole, whole_state = _run(spec, "chunked", q, k, v, gate_logits, params, mask)
    state, pieces = None, []
    for piece in (slice(0, 7), slice(7, 12), slice(12, 13)):
        gates_piece = {name: g[..., piece] for name, g in gate_logits.items()}
        out, state = _run(
            spec,
            second_mode,
            q[..., piece, :],
            k[..., piece, :],
            v[..., piece, :],
            gates_piece,
            params,
            mask[:, : piece.stop],
            state,
        )
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), whole, **TOL)
    torch.testing.assert_close(state.S, whole_state.S, **TOL)
    assert state.t.tolist() == whole_state.t.tolist() == [13, 8]


@pytest.mark.parametrize("name", SPEC_IDS)
def test_long_call_in_segments_equals_the_parallel_form(name, monkeypatch):
    """A chunked call without autograd longer than `PREFILL_SEGMENT` runs in segments (here 4 positions, 4
    segments) and gives the parallel form's output and the one-piece call's state."""
    spec = FINITE_SPECS[name].__class__(**{**FINITE_SPECS[name].to_dict(), "chunk_size": 3})
    q, k, v, gate_logits = make_inputs(length=13)
    params = make_params(spec)
    mask = left_padding_mask(2, 13, [0, 5])
    parallel, _ = _run(spec, "parallel", q, k, v, gate_logits, params, mask)
    whole, whole_state = _run(spec, "chunked", q, k, v, gate_logits, params, mask)
    forms = attention_module._finite_state
    calls = []
    monkeypatch.setattr(attention_module, "PREFILL_SEGMENT", 4)
    monkeypatch.setattr(attention_module, "_finite_state", lambda *a, **kw: calls.append(1) or forms(*a, **kw))
    segmented, segmented_state = _run(spec, "chunked", q, k, v, gate_logits, params, mask)
    assert len(calls) == 4
    torch.testing.assert_close(segmented, parallel, **TOL)
    for field in ("S", "z", "t"):
        torch.testing.assert_close(getattr(segmented_state, field), getattr(whole_state, field), **TOL)
    torch.testing.assert_close(whole, parallel, **TOL)


def test_a_call_with_autograd_stays_whole(monkeypatch):
    """Segments are for calls without autograd: with it, one call (its backward is one pass)."""
    spec = FINITE_SPECS["hedgehog_window_64_sinks_4_decay"]
    q, k, v, gate_logits = make_inputs(length=13, requires_grad=True)
    forms = attention_module._finite_state
    calls = []
    monkeypatch.setattr(attention_module, "PREFILL_SEGMENT", 4)
    monkeypatch.setattr(attention_module, "_finite_state", lambda *a, **kw: calls.append(1) or forms(*a, **kw))
    out, _ = _run(spec, "chunked", q, k, v, gate_logits, make_params(spec), None)
    out.sum().backward()
    assert len(calls) == 1 and q.grad is not None


def test_left_padding_equals_unpadded_row():
    spec = FINITE_SPECS["linear_elu"]
    q, k, v, gate_logits = make_inputs(batch=1, length=9)
    params = make_params(spec)
    pad = 4
    padded = [torch.cat([torch.randn(*x.shape[:-2], pad, x.shape[-1], dtype=x.dtype), x], dim=-2) for x in (q, k, v)]
    mask = left_padding_mask(1, 9 + pad, [pad])
    for mode in ("parallel", "chunked", "recurrent"):
        out_padded, _ = attention(*padded, spec, mode=mode, attention_mask=mask, params=as_params(params))
        out_plain, _ = attention(q, k, v, spec, mode=mode, params=as_params(params))
        torch.testing.assert_close(out_padded[..., pad:, :], out_plain, **TOL)


def test_parallel_with_past_keys_matches_full_rows():
    """Decoding from a KV cache: the last Lq queries against all keys == the same rows of the full run."""
    spec = FINITE_SPECS["softmax_taylor_2_l2"]
    q, k, v, gate_logits = make_inputs(length=12)
    mask = left_padding_mask(2, 12, [0, 4])
    full, _ = attention(q, k, v, spec, attention_mask=mask)
    tail, _ = attention(q[..., 9:, :], k, v, spec, attention_mask=mask)
    torch.testing.assert_close(tail, full[..., 9:, :], **TOL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(SPEC_IDS),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 3),
    length=st.integers(1, 17),
    head_dim=st.sampled_from([2, 4, 6]),
    chunk_size=st.integers(1, 8),
    scale=st.floats(0.1, 2.0),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_property_modes_agree(name, batch, kv_heads, groups, length, head_dim, chunk_size, scale, seed, data):
    spec = FINITE_SPECS[name].__class__(**{**FINITE_SPECS[name].to_dict(), "chunk_size": chunk_size})
    q, k, v, gate_logits = make_inputs(batch, kv_heads * groups, kv_heads, length, head_dim, seed=seed)
    q, k = q * scale, k * scale
    params = make_params(spec, kv_heads * groups, kv_heads, head_dim, seed=seed + 1)
    pads = [data.draw(st.integers(0, length - 1)) for _ in range(batch)]
    mask = left_padding_mask(batch, length, pads)
    parallel, _ = _run(spec, "parallel", q, k, v, gate_logits, params, mask)
    chunked, _ = _run(spec, "chunked", q, k, v, gate_logits, params, mask)
    recurrent, _ = _run(spec, "recurrent", q, k, v, gate_logits, params, mask)
    assert torch.isfinite(parallel).all()
    torch.testing.assert_close(chunked, parallel, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(recurrent, parallel, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("name", ["linear_elu", "softmax_taylor_2", "hedgehog_window_64"])
def test_recurrent_state_updated_in_place_matches_a_new_state(name, layout):
    """Decoding without autograd may add to the state itself (one batched product-and-add where it is
    contiguous): same outputs, same new state, and the returned state holds the tensor that was passed in."""
    spec = FINITE_SPECS[name]
    q, k, v, _ = make_inputs(length=5)
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, 5, [0, 2])
    _, prefilled = attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], spec, mode="chunked",
                             attention_mask=mask[:, :4], params=params)  # fmt: skip
    step = dict(attention_mask=mask, params=params, mode="recurrent")
    with torch.no_grad():
        expected, expected_state = attention(q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], spec, state=prefilled, **step)
        packed = prefilled.packed.clone() if layout == "contiguous" else prefilled.packed.mT.contiguous().mT
        prefilled.packed = packed
        out, state = attention(
            q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], spec, state=prefilled, update_state_in_place=True, **step
        )
    assert state.packed is packed
    torch.testing.assert_close(out, expected, **TOL)
    for got, want in zip(state.tensors(), expected_state.tensors(), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_in_place_update_is_refused_with_autograd_or_outside_recurrent_mode():
    spec = FINITE_SPECS["linear_elu"]
    q, k, v, _ = make_inputs(length=1)
    with pytest.raises(ValueError, match="update_state_in_place needs mode='recurrent' without autograd"):
        attention(q, k, v, spec, mode="recurrent", update_state_in_place=True)
    with torch.no_grad(), pytest.raises(ValueError, match="got mode='chunked'"):
        attention(q, k, v, spec, mode="chunked", update_state_in_place=True)

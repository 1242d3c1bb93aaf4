"""One decoding step of a sliding-window hybrid (`ops.window_step`) against the block forms.

A one-position call in recurrent mode takes the step path; the same position in chunked mode takes
the block forms of the window, the sinks and the kept keys (`ops.window`, `ops.sinks`, `ops.kept`),
which the formula and simulation tests check in float64.
"""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention
from hf_softmax_rnn.ops.window_step import window_in_order

from .helpers import FINITE_SPECS, as_params, gated, left_padding_mask, make_inputs, make_params
from .kernel_stand_ins import DispatchedOperations, WrittenBytes
from .test_kept import SPECS as KEPT_SPECS
from .test_kept import _assert_same_state

WINDOW_SPECS = {
    **{name: spec for name, spec in FINITE_SPECS.items() if spec.window is not None},
    **{f"kept_{name}": spec for name, spec in KEPT_SPECS.items()},
}
TOL = dict(rtol=1e-10, atol=1e-12)
PREFILL, LENGTH = 5, 14


def _case(spec, seed=0, requires_grad=False):
    q, k, v, logits = make_inputs(length=LENGTH, seed=seed, requires_grad=requires_grad)
    q, k = 2 * q, 2 * k  # peaked window softmaxes: the ranking of kept keys matters
    v, gates = gated(spec, v, logits)
    params = make_params(spec, requires_grad=requires_grad)
    mask = left_padding_mask(2, LENGTH, [0, 7])  # row 1 decodes two padding positions
    return q, k, v, gates, params, mask


def _call(spec, inputs, part, mode, state, **kwargs):
    q, k, v, gates, params, mask = inputs
    return attention(
        q[..., part, :], k[..., part, :], v[..., part, :], spec, mode=mode, attention_mask=mask[:, : part.stop],
        gates={name: gate[..., part] for name, gate in gates.items()}, params=as_params(params), state=state,
        **kwargs,
    )  # fmt: skip


def _decode(spec, inputs, mode, **kwargs):
    """Prefill `PREFILL` positions in one chunked call, then one position per call in `mode`."""
    outs, state = _call(spec, inputs, slice(0, PREFILL), "chunked", None)
    outs = [outs]
    for step in range(PREFILL, LENGTH):
        out, state = _call(spec, inputs, slice(step, step + 1), mode, state, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=-2), state


@pytest.mark.parametrize("name", sorted(WINDOW_SPECS))
def test_steps_match_the_block_form_and_one_call(name):
    spec = WINDOW_SPECS[name]
    inputs = _case(spec)
    steps, step_state = _decode(spec, inputs, "recurrent")
    blocks, block_state = _decode(spec, inputs, "chunked")
    whole, whole_state = _call(spec, inputs, slice(0, LENGTH), "chunked", None)
    torch.testing.assert_close(steps, blocks, **TOL)
    torch.testing.assert_close(steps, whole, **TOL)
    for other in (block_state, whole_state):
        if spec.kept is None:  # (the steps' window buffers are a ring: compared in position order)
            for got, want in zip(window_in_order(step_state).tensors(), other.tensors(), strict=True):
                torch.testing.assert_close(got, want, **TOL)
        else:
            _assert_same_state(step_state, other)


@pytest.mark.parametrize("name", sorted(WINDOW_SPECS))
def test_block_calls_between_steps_read_the_ring_in_position_order(name):
    """Steps turn the window's ring (its oldest slot moves on); a block call of three positions after them
    reads the buffers in position order, and steps after it start from slot 0 again."""
    spec = WINDOW_SPECS[name]
    inputs = _case(spec)
    whole, whole_state = _call(spec, inputs, slice(0, LENGTH), "chunked", None)
    outs, state = _call(spec, inputs, slice(0, 3), "chunked", None)
    outs = [outs]
    starts = []
    for part in [slice(step, step + 1) for step in range(3, 8)] + [slice(8, 11), slice(11, 12), slice(12, 14)]:
        out, state = _call(spec, inputs, part, "recurrent" if part.stop - part.start == 1 else "chunked", state)
        outs.append(out)
        starts.append(int(state.window_start[0]))
    steps_then_block = [(step + 1) % spec.window for step in range(5)] + [0, 1 % spec.window, 0]
    assert starts == steps_then_block and torch.equal(state.window_start, torch.zeros(2, dtype=torch.long))
    torch.testing.assert_close(torch.cat(outs, dim=-2), whole, **TOL)
    _assert_same_state(state, whole_state)


def test_an_in_place_step_writes_one_row_of_each_window_buffer():
    """Decoding in place writes the new position over the leaving one in the window buffers themselves
    (the slot `window_start` names, which moves on by one), instead of shifting all W rows into new ones."""
    spec = WINDOW_SPECS["window3_hedgehog"]
    inputs = _case(spec)
    with torch.no_grad():
        _, state = _call(spec, inputs, slice(0, 9), "chunked", None)
        _, state = _call(spec, inputs, slice(9, 10), "recurrent", state, update_state_in_place=True)
        before = state.map(torch.clone)
        _, after = _call(spec, inputs, slice(10, 11), "recurrent", state, update_state_in_place=True)
    slot = 1  # 9 positions from the block call (slot 0 the oldest), one step (slot 0 overwritten)
    assert torch.equal(before.window_start, torch.full((2,), slot)) and torch.equal(
        after.window_start, before.window_start + 1
    )
    for name in ("window_keys", "window_values", "window_valid"):
        assert getattr(after, name) is getattr(state, name), name
        changed = getattr(after, name) != getattr(before, name)
        if name != "window_valid":
            changed = changed.any(-1).any(1)  # [B, W]
        assert not changed[:, [0, 2]].any(), name  # only the slot of the leaving position
    torch.testing.assert_close(after.window_keys[..., slot, :], inputs[1][..., 10, :])


@pytest.mark.parametrize(
    "name", ["window3_hedgehog", "decay_window2_sinks2_elu_gates", "kept_hedgehog_w2_kept3_sinks2_c2"]
)
def test_gradients_of_a_step_match_the_block_form(name):
    """Through the step's inputs, the learned tensors and the state it starts from."""
    spec = WINDOW_SPECS[name]
    inputs = _case(spec, seed=2, requires_grad=True)
    q, k, v, gates, params, mask = inputs
    weights = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)
    grads = []
    for mode in ("recurrent", "chunked"):
        _, state = _call(spec, inputs, slice(0, 9), "chunked", None)
        out, after = _call(spec, inputs, slice(9, 10), mode, state)
        loss = (out * weights).sum() + 0.1 * after.packed.sum()
        if spec.kept is not None:
            loss = loss + 0.1 * after.kept_keys.sum()  # (the slots may hold the kept keys in another order)
        leaves = [q, k, v, *[t for t in params.values() if t.requires_grad]]
        found = torch.autograd.grad(loss, leaves, allow_unused=True)
        grads.append([torch.zeros_like(leaf) if g is None else g for g, leaf in zip(found, leaves, strict=True)])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name", sorted(WINDOW_SPECS))
@pytest.mark.parametrize("in_place", [False, True], ids=["new_state", "in_place"])
def test_new_state_holds_no_view_of_another_old_buffer(name, in_place):
    """A static cache copies each new tensor into its old buffer one after another: a new tensor that
    were a view of another old buffer would read it after it was overwritten."""
    spec = WINDOW_SPECS[name]
    inputs = _case(spec)
    with torch.no_grad():
        _, state = _call(spec, inputs, slice(0, 9), "chunked", None)
        old = state.tensors()
        _, after = _call(spec, inputs, slice(9, 10), "recurrent", state, update_state_in_place=in_place)
    for new in after.tensors():
        shared = [x for x in old if x.untyped_storage().data_ptr() == new.untyped_storage().data_ptr()]
        assert all(x is new for x in shared), [tuple(x.shape) for x in shared]


def test_in_place_step_writes_the_state_it_was_given():
    spec = KEPT_SPECS["hedgehog_w2_kept3_sinks2_c2"]
    inputs = _case(spec)
    with torch.no_grad():
        _, state = _call(spec, inputs, slice(0, 9), "chunked", None)
        copy = state.map(torch.clone)
        expected, expected_state = _call(spec, inputs, slice(9, 10), "recurrent", copy)
        given = {name: getattr(state, name) for name in ("packed", "kept_keys", "kept_values", "kept_valid")}
        out, after = _call(spec, inputs, slice(9, 10), "recurrent", state, update_state_in_place=True)
    torch.testing.assert_close(out, expected, **TOL)
    assert all(getattr(after, name) is tensor for name, tensor in given.items())
    for got, want in zip(after.tensors(), expected_state.tensors(), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_a_step_of_the_finetune_default_takes_few_operations():
    """Decoding cost on a CPU is about one dispatch per tensor operation: one step of the finetune
    default's spec (window 256, 4 sinks, 256 kept, decay; SmolLM2's 9 query and 3 KV heads) stays
    under 200 dispatches, views included (the block forms take about 560): the leaving key's rank and sink
    status come from the window's visible count, not from ranking every window position, and the kept
    slot's choice from the lowest rank alone."""
    spec = AttentionSpec.coerce("hedgehog_window_256_sinks_4_kept_256_decay")
    q, k, v, logits = make_inputs(batch=1, heads=9, kv_heads=3, length=301, head_dim=16, dtype=torch.float32)
    params = as_params(make_params(spec, heads=9, kv_heads=3, head_dim=16, dtype=torch.float32))
    gates = {"decay": torch.full((1, 3, 301), -1e-3)}
    with torch.no_grad():
        _, state = attention(q[..., :300, :], k[..., :300, :], v[..., :300, :], spec, mode="chunked",
                             params=params, gates={"decay": gates["decay"][..., :300]})  # fmt: skip
        counter = DispatchedOperations()
        with counter:
            attention(q[..., 300:, :], k[..., 300:, :], v[..., 300:, :], spec, mode="recurrent", params=params,
                      gates={"decay": gates["decay"][..., 300:]}, state=state, update_state_in_place=True)  # fmt: skip
    assert counter.count < 200, counter.count


def test_a_step_of_the_finetune_default_writes_little_beside_its_state():
    """At SmolLM2's heads (9 query and 3 KV heads of 64), an in-place step of the finetune default writes
    under 600 kB: the decayed finite state twice (its decay and the new key's product, 200 kB), the rows
    it changes in the window and kept buffers, and the scores of the exact part. The hedgehog map of one
    query and one key no longer builds [W, -W] for each (590 kB a step)."""
    spec = AttentionSpec.coerce("hedgehog_window_256_sinks_4_kept_256_decay")
    q, k, v, _ = make_inputs(batch=1, heads=9, kv_heads=3, length=301, head_dim=64, dtype=torch.float32)
    params = as_params(make_params(spec, heads=9, kv_heads=3, head_dim=64, dtype=torch.float32))
    decay = torch.full((1, 3, 301), -1e-3)
    with torch.no_grad():
        _, state = attention(q[..., :300, :], k[..., :300, :], v[..., :300, :], spec, mode="chunked",
                             params=params, gates={"decay": decay[..., :300]})  # fmt: skip
        counter = WrittenBytes()
        with counter:
            attention(q[..., 300:, :], k[..., 300:, :], v[..., 300:, :], spec, mode="recurrent", params=params,
                      gates={"decay": decay[..., 300:]}, state=state, update_state_in_place=True)  # fmt: skip
    assert counter.bytes < 600_000, counter.bytes

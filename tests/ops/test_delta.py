"""The delta rule against a float64 loop of its defining update, one position at a time, and its properties."""

import pytest
import torch
import torch.nn.functional as F

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention
from hf_softmax_rnn.ops.feature_maps import build_kernel

from .helpers import as_params, left_padding_mask, make_inputs, make_params

TOL = dict(rtol=1e-9, atol=1e-10)
MODES = ("parallel", "chunked", "recurrent")


def reference(q, k, v, strength, log_decay, kernel, mask, window=None, log_scale=None, scale=None, mass=False):
    """The augmented numerator `[B, H, L, Dv + 1]` by the definition: S_t = a_t (I - b_t u u^T) S_{t-1}
    + b_t phi(k) [v, 1]^T for the key entering at step t (position t, or t - W with a window), read as
    phi(q_t) S_t, plus exp(q.k * scale) [v, 1] over the window scaled by e^{-log_scale}, one head and row
    at a time. `mass`: the value columns follow S_t = a_t (I - b_t u u^T) S_{t-1} + b_t u v^T and are read
    as y = phi(q_t) S_t / |phi(q_t)|; the finite part is m [y, 1] with m = phi(q_t).z_a, z_a = sum a phi(k)
    the additive sum of the keys that entered."""
    batch, heads, length, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1] + 1, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // group
            phi_q = kernel.query_features(q[b, h][None, None, None])[0, 0, 0]
            phi_k = kernel.key_features(k[b : b + 1, g : g + 1])[0, 0]
            state = torch.zeros(phi_k.shape[-1], v.shape[-1] + 1, dtype=torch.float64)
            additive = torch.zeros(phi_k.shape[-1], dtype=torch.float64)
            visible = mask[b].bool()
            for t in range(length):
                factor = log_decay[b, g, t].exp() if log_decay is not None and visible[t] else 1.0
                state, additive = state * factor, additive * factor
                s = t if window is None else t - window
                if s >= 0 and visible[s]:
                    features = phi_k[s]
                    unit = features / features.norm()
                    beta = strength[b, g, t]
                    value = torch.cat([v[b, g, s], torch.ones(1, dtype=torch.float64)])
                    if mass:  # the value columns recall v itself; the mass column is added
                        value = torch.cat([v[b, g, s], features.norm()[None]])
                    state = (torch.eye(len(unit), dtype=torch.float64) - beta * torch.outer(unit, unit)) @ state
                    state = state + beta * torch.outer(unit if mass else features, value)
                    additive = additive + features
                if not visible[t]:
                    continue
                finite = phi_q[t] @ state
                if mass:
                    weight = phi_q[t] @ additive
                    finite = torch.cat([(phi_q[t] / phi_q[t].norm()) @ state[:, :-1] * weight, weight[None]])
                if window is None:
                    out[b, h, t] = finite
                    continue
                exact = torch.zeros(v.shape[-1] + 1, dtype=torch.float64)
                for s in range(max(0, t - window + 1), t + 1):
                    if visible[s]:
                        weight = torch.exp(scale * q[b, h, t] @ k[b, g, s])
                        exact = exact + weight * torch.cat([v[b, g, s], torch.ones(1, dtype=torch.float64)])
                out[b, h, t] = exact + log_scale[h].exp() * finite
    return out


CASES = {
    "delta_identity_none": (AttentionSpec(kind="linear", feature_map="identity", normalizer="none", delta_rule=True)),
    "gated_delta_elu_none": AttentionSpec(
        kind="linear", feature_map="elu", normalizer="none", delta_rule=True, decay=True, chunk_size=3
    ),
    "gated_delta_taylor2_none": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="none", delta_rule=True, decay=True, chunk_size=4
    ),
    "gated_delta_mass_elu_none": AttentionSpec(
        kind="linear",
        feature_map="elu",
        normalizer="none",
        delta_rule=True,
        additive_mass=True,
        decay=True,
        chunk_size=3,
    ),  # fmt: skip
}


def _gates(spec, gate_logits):
    gates = {"delta": torch.sigmoid(gate_logits["delta"])}
    if spec.decay:
        gates["decay"] = F.logsigmoid(gate_logits["decay"])
    return gates


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_mode_equals_the_definition(name, mode):
    spec = CASES[name]
    q, k, v, gate_logits = make_inputs(length=9)
    mask = left_padding_mask(2, 9, [0, 3])
    gates = _gates(spec, gate_logits)
    kernel = build_kernel(spec, spec.scale(8), as_params(make_params(spec)))
    want = reference(q, k, v, gates["delta"], gates.get("decay"), kernel, mask, mass=spec.additive_mass)
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, gates=gates)
    visible = mask.bool()[:, None, :, None]
    torch.testing.assert_close(got * visible, want[..., :-1] * visible, **TOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mass", [False, True], ids=["shared_denominator", "additive_mass"])
def test_a_window_hybrid_equals_the_definition(mode, mass):
    """Window 3, softmax normaliser: keys enter the delta-rule state when they leave the window, with the write
    strength and decay of that step."""
    spec = AttentionSpec(
        kind="linear", feature_map="elu", window=3, decay=True, delta_rule=True, additive_mass=mass, chunk_size=2
    )
    q, k, v, gate_logits = make_inputs(length=10)
    mask = left_padding_mask(2, 10, [0, 2])
    params = make_params(spec)
    gates = _gates(spec, gate_logits)
    kernel = build_kernel(spec, spec.scale(8), as_params(params))
    want = reference(
        q, k, v, gates["delta"], gates["decay"], kernel, mask, 3, params["linear_log_scale"], spec.scale(8), mass
    )
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, gates=gates, params=as_params(params))
    visible = mask.bool()[:, None, :, None]
    expected = want[..., :-1] / want[..., -1:].where(visible, torch.ones(()))
    torch.testing.assert_close(got * visible, expected * visible, **TOL)


def test_orthogonal_keys_at_full_strength_add_up_as_linear_attention():
    """b = 1 and keys that share no direction: nothing is corrected, so the delta rule is linear attention."""
    length, dim = 6, 8
    keys = torch.eye(dim, dtype=torch.float64)[:length].view(1, 1, length, dim) * 3.0
    q, _, v, _ = make_inputs(batch=1, heads=1, kv_heads=1, length=length)
    additive = AttentionSpec(kind="linear", feature_map="identity", normalizer="none")
    delta = AttentionSpec(kind="linear", feature_map="identity", normalizer="none", delta_rule=True)
    full = {"delta": torch.ones(1, 1, length, dtype=torch.float64)}
    want, _ = attention(q, keys, v, additive, mode="parallel")
    for mode in MODES:
        got, _ = attention(q, keys, v, delta, mode=mode, gates=full)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_a_repeated_key_overwrites_its_value(mode):
    """Key k with value 1, then k again with value 2 at full strength: the state recalls 2 (an additive state
    recalls 1 + 2), times |k| for the unit query k / |k|."""
    key = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = key.expand(1, 1, 2, 8)
    v = torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 1, 2, 1)
    q = key.expand(1, 1, 2, 8) / key.norm()
    spec = AttentionSpec(kind="linear", feature_map="identity", normalizer="none", qk_scale=1.0, delta_rule=True)
    out, _ = attention(q, k, v, spec, mode=mode, gates={"delta": torch.ones(1, 1, 2, dtype=torch.float64)})
    torch.testing.assert_close(out[0, 0, :, 0], torch.tensor([1.0, 2.0], dtype=torch.float64) * key.norm())
    additive = AttentionSpec(kind="linear", feature_map="identity", normalizer="none", qk_scale=1.0)
    summed, _ = attention(q, k, v, additive, mode="parallel")
    torch.testing.assert_close(summed[0, 0, 1, 0], 3.0 * key.norm())


def test_padding_and_zero_keys_give_finite_outputs_and_gradients():
    spec = AttentionSpec(kind="linear", feature_map="relu", normalizer="l2", delta_rule=True, chunk_size=2)
    q, k, v, gate_logits = make_inputs(length=6, requires_grad=True)
    mask = left_padding_mask(2, 6, [0, 4])
    with torch.no_grad():
        k[0, :, 2] = -1.0  # relu(-1) = 0: a key with no direction
    for mode in MODES:
        strength = torch.sigmoid(gate_logits["delta"])
        out, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, gates={"delta": strength})
        grads = torch.autograd.grad(out.sum(), [q, k, v, gate_logits["delta"]])
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="softmax", delta_rule=True), r"delta_rule=True is not allowed with exact softmax"),
        (
            dict(kind="recurrent_softmax", score_clamp=5.0, normalizer="seqlen", delta_rule=True),
            r"delta_rule=True is not allowed with exp\(q\.k\)",
        ),
        (
            dict(kind="linear", feature_map="elu", delta_rule=True),
            r"normalizer='softmax' is not allowed with delta_rule=True and no window",
        ),
        (dict(kind="linear", feature_map="elu", normalizer="l2", delta_rule=1), r"delta_rule=1 has type int"),
        (
            dict(kind="linear", feature_map="elu", normalizer="l2", additive_mass=True),
            r"additive_mass=True is not allowed with delta_rule=False.*expected additive_mass=False, or delta_rule",
        ),
    ],
    ids=["softmax", "clamped-exp", "denominator-without-window", "not-a-bool", "mass-without-delta-rule"],
)
def test_specs_that_cannot_carry_a_delta_rule_are_refused(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AttentionSpec(**fields)


def test_the_write_strengths_are_required_and_checked():
    spec = AttentionSpec(kind="linear", feature_map="elu", normalizer="l2", delta_rule=True)
    q, k, v, _ = make_inputs()
    with pytest.raises(ValueError, match=r"delta_rule=True, so it takes gates\['delta'\].*and needs them"):
        attention(q, k, v, spec)
    with pytest.raises(ValueError, match=r"gates\['delta'\] has shape \(2, 2, 5\); expected .*\[2, 2, 11\]"):
        attention(q, k, v, spec, gates={"delta": torch.ones(2, 2, 5, dtype=torch.float64)})
    additive = AttentionSpec(kind="linear", feature_map="elu", normalizer="l2")
    with pytest.raises(ValueError, match=r"delta_rule=False, so it takes gates\['delta'\].*only with delta_rule"):
        attention(q, k, v, additive, gates={"delta": torch.ones(2, 2, 11, dtype=torch.float64)})


@pytest.mark.parametrize("mode", MODES)
def test_an_additive_mass_without_a_window_reads_the_additive_denominator(mode):
    """Softmax normaliser, no window: the mass cancels, so the output is the delta rule's recall y, and the
    state's last column is the uncorrected sum of phi(k) over the visible keys."""
    spec = AttentionSpec(kind="linear", feature_map="elu", delta_rule=True, additive_mass=True, chunk_size=4)
    q, k, v, gate_logits = make_inputs(length=9)
    mask = left_padding_mask(2, 9, [0, 3])
    strength = torch.sigmoid(gate_logits["delta"])
    kernel = build_kernel(spec, spec.scale(8), as_params(make_params(spec)))
    want = reference(q, k, v, strength, None, kernel, mask, mass=True)
    got, state = attention(q, k, v, spec, mode=mode, attention_mask=mask, gates={"delta": strength})
    visible = mask.bool()[:, None, :, None]
    recall = want[..., :-1] / want[..., -1:].where(visible, torch.ones(()))
    torch.testing.assert_close(got * visible, recall * visible, **TOL)
    if mode != "parallel":
        phi_k = kernel.key_features(k) * mask[:, None, :, None]
        torch.testing.assert_close(state.packed[..., -1], phi_k.sum(-2), **TOL)

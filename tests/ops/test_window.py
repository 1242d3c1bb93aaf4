"""Sliding-window hybrids (with and without attention sinks) against the formula written out one
query at a time, in float64.

y_t = (sum_{s in E_t} e^{x_ts} v_s + e^{lambda_h} sum_{s<=t-W, s not in E_t} phi(q_t).phi(k_s) v_s) / (same with v = 1)

with E_t the window t-W < s <= t and the first S visible positions (the sinks).
"""

import dataclasses
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention
from hf_softmax_rnn.ops import kept as kept_module
from hf_softmax_rnn.ops import window as window_module
from hf_softmax_rnn.ops.softmax import softmax_attention_reference
from hf_softmax_rnn.ops.window import MAX_MIX_EXPONENT, mix_weight

from .helpers import as_params, gated, left_padding_mask, make_inputs, make_params, quiet_preset
from .kernel_stand_ins import AllocatedBytes


def _phi(x, spec, weight):
    if spec.feature_map == "elu":
        return F.elu(x) + 1
    if spec.feature_map == "hedgehog":
        projected = x @ weight
        return torch.cat([torch.softmax(projected, -1), torch.softmax(-projected, -1)], -1)
    raise AssertionError(spec)


def naive_window_attention(q, k, v, spec, params, mask, scale, log_decay=None, softcap=None):
    """One query at a time, no shift, no state, no chunks: the definition. Without a window every key
    goes through the kernel; with `log_decay` `[B, Hkv, L]` key s weighs exp(sum_{r=s+W+1..t} g_r)
    times the kernel (it enters the state at step s + W and decays from there; padding has g = 0). With
    `softcap` c an exact key weighs exp(c tanh(x / c)) for its score x; the kernel is not capped."""
    batch, heads, length, head_dim = q.shape
    groups = heads // k.shape[1]
    window = spec.window or 0
    g = None if log_decay is None else log_decay * mask[:, None, :]
    linear_weight = params.linear_log_scale.exp() if spec.window is not None else torch.ones(heads, dtype=q.dtype)
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            kv = h // groups
            for t in range(length):
                if not mask[b, t]:
                    continue
                numerator, denominator = torch.zeros(head_dim, dtype=q.dtype), torch.zeros((), dtype=q.dtype)
                for s in range(t + 1):
                    if not mask[b, s]:
                        continue
                    is_sink = spec.sinks is not None and int(mask[b, :s].sum()) < spec.sinks
                    if t - s < window or is_sink:
                        x = scale * q[b, h, t] @ k[b, kv, s]
                        weight = torch.exp(x if softcap is None else softcap * torch.tanh(x / softcap))
                    else:
                        if spec.uses_taylor:
                            x = scale * q[b, h, t] @ k[b, kv, s]
                            kernel = sum(x**n / math.factorial(n) for n in range(3))
                        else:
                            phi_q = _phi(q[b, h, t], spec, None if params.hedgehog_q is None else params.hedgehog_q[h])
                            phi_k = _phi(
                                k[b, kv, s], spec, None if params.hedgehog_k is None else params.hedgehog_k[kv]
                            )
                            kernel = scale * phi_q @ phi_k
                        decay = 1.0 if g is None else torch.exp(g[b, kv, s + window + 1 : t + 1].sum())
                        weight = linear_weight[h] * decay * kernel
                    numerator, denominator = numerator + weight * v[b, kv, s], denominator + weight
                out[b, h, t] = (
                    numerator / denominator if spec.normalizer == "softmax" else F.normalize(numerator, dim=0)
                )
    return out


SPECS = {
    "elu_w3": AttentionSpec(kind="linear", feature_map="elu", window=3),
    "hedgehog_w2": AttentionSpec(kind="linear", feature_map="hedgehog", window=2),
    "taylor2_w4_l2": AttentionSpec(kind="recurrent_softmax", taylor_order=2, window=4, normalizer="l2", norm_eps=1e-30),
    "elu_w3_sinks2": AttentionSpec(kind="linear", feature_map="elu", window=3, sinks=2),
    "hedgehog_w1_sinks3": AttentionSpec(kind="linear", feature_map="hedgehog", window=1, sinks=3, chunk_size=2),
    "taylor2_w2_sinks4_l2": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, window=2, sinks=4, normalizer="l2", norm_eps=1e-30
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_modes_match_the_formula(name, mode):
    spec = SPECS[name]
    q, k, v, _ = make_inputs(length=9)
    q, k = 2 * q, 2 * k  # scores up to ~10: the shift by the window's max matters
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, 9, [0, 2])
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params)
    want = naive_window_attention(q, k, v, spec, params, mask.bool(), 8**-0.5)
    torch.testing.assert_close(got * mask[:, None, :, None], want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_a_weight_of_minus_infinity_leaves_the_exact_part_alone(name, mode):
    """lambda_h = -inf (`long_context.finite_state_off`): softmax over the window and the sinks, whatever the
    state holds (the feature maps are drawn again: the output does not move)."""
    spec = SPECS[name]
    q, k, v, _ = make_inputs(length=9)
    mask = left_padding_mask(2, 9, [0, 2])
    outputs = []
    for seed in (1, 2):
        tensors = make_params(spec, seed=seed)
        tensors["linear_log_scale"] = torch.full_like(tensors["linear_log_scale"], -torch.inf)
        params = as_params(tensors)
        got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params)
        want = naive_window_attention(q, k, v, spec, params, mask.bool(), 8**-0.5)
        torch.testing.assert_close(got * mask[:, None, :, None], want, rtol=1e-9, atol=1e-10)
        outputs.append(got)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_state_keeps_a_window_of_constant_size():
    spec = AttentionSpec(kind="linear", feature_map="elu", window=3, chunk_size=4)
    q, k, v, _ = make_inputs(length=11)
    params = as_params(make_params(spec))
    _, state = attention(q, k, v, spec, mode="chunked", params=params)
    assert state.window_keys.shape == (2, 2, 3, 8) and state.window_values.shape == (2, 2, 3, 9)
    torch.testing.assert_close(state.window_keys, k[..., -3:, :])
    assert state.window_valid.all()
    assert state.nbytes == sum(x.numel() * x.element_size() for x in state.tensors())


def test_huge_scores_stay_finite_in_bfloat16():
    spec = AttentionSpec(kind="recurrent_softmax", taylor_order=2, window=2)
    q, k, v, _ = make_inputs(length=8, dtype=torch.bfloat16)
    params = as_params({name: p.bfloat16() for name, p in make_params(spec).items()})
    for mode in ("parallel", "chunked", "recurrent"):
        out, _ = attention(30 * q, 30 * k, v, spec, mode=mode, params=params)
        assert torch.isfinite(out).all(), mode


def test_state_from_another_window_raises():
    spec = AttentionSpec(kind="linear", feature_map="elu", window=3)
    q, k, v, _ = make_inputs(length=4)
    params = as_params(make_params(spec))
    _, state = attention(q, k, v, spec, mode="chunked", params=params)
    other = AttentionSpec(kind="linear", feature_map="elu", window=2)
    with pytest.raises(ValueError, match=r"state was made for another attention.*window=3 \(here 2\)"):
        attention(q, k, v, other, mode="recurrent", params=params, state=state)
    with pytest.raises(ValueError, match=r"the state has shape \(2, 2, 8, 9\)"):
        attention(q[:1], k[:1], v[:1], spec, mode="recurrent", params=params, state=state)


@pytest.mark.parametrize(
    ("start", "shown"),
    [
        (torch.zeros(3, dtype=torch.long), r"shape \(3,\) and dtype torch.int64"),
        (torch.zeros(2), r"shape \(2,\) and dtype torch.float32"),
    ],
    ids=["batch-3-for-2", "float"],
)
def test_a_window_start_that_is_not_one_slot_per_sequence_raises(start, shown):
    spec = AttentionSpec(kind="linear", feature_map="elu", window=3)
    q, k, v, _ = make_inputs(length=4)
    params = as_params(make_params(spec))
    _, state = attention(q, k, v, spec, mode="chunked", params=params)
    state.window_start = start
    with pytest.raises(ValueError, match=rf"window_start has {shown}.*one integer slot per sequence, \[2\]"):
        attention(q[..., :1, :], k[..., :1, :], v[..., :1, :], spec, mode="recurrent", params=params, state=state)


def test_window_needs_its_weight():
    q, k, v, _ = make_inputs(length=4)
    with pytest.raises(ValueError, match="linear_log_scale"):
        attention(q, k, v, AttentionSpec(kind="linear", feature_map="elu", window=2))


def test_state_keeps_the_first_visible_positions_as_sinks():
    spec = AttentionSpec(kind="linear", feature_map="elu", window=2, sinks=3, chunk_size=4)
    q, k, v, _ = make_inputs(length=11)
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, 11, [0, 9])  # the second row has only 2 visible positions: one slot stays empty
    _, state = attention(q, k, v, spec, mode="chunked", params=params, attention_mask=mask)
    torch.testing.assert_close(state.sink_keys[0], k[0, :, :3])
    torch.testing.assert_close(state.sink_keys[1, :, :2], k[1, :, 9:])
    assert not state.sink_keys[1, :, 2].any() and not state.sink_values[1, :, 2].any()
    torch.testing.assert_close(state.sink_values[0, :, :, -1], torch.ones(2, 3, dtype=torch.float64))


def test_sinks_never_enter_the_finite_state():
    """With every key older than the window a sink, the state sums nothing."""
    spec = AttentionSpec(kind="linear", feature_map="elu", window=2, sinks=4)
    q, k, v, _ = make_inputs(length=6)
    _, state = attention(q, k, v, spec, mode="chunked", params=as_params(make_params(spec)))
    assert not state.packed.any()


def test_state_from_another_sink_count_raises():
    spec = AttentionSpec(kind="linear", feature_map="elu", window=3, sinks=2)
    q, k, v, _ = make_inputs(length=4)
    params = as_params(make_params(spec))
    _, state = attention(q, k, v, spec, mode="chunked", params=params)
    for other in (
        AttentionSpec(kind="linear", feature_map="elu", window=3),
        AttentionSpec(**{**spec.to_dict(), "sinks": 1}),
    ):
        with pytest.raises(ValueError, match=rf"state was made for another attention.*sinks=2 \(here {other.sinks}\)"):
            attention(q, k, v, other, mode="recurrent", params=params, state=state)


def test_compiled_training_of_a_window_hybrid_in_one_block_matches_eager():
    """torch.compile of a chunked hybrid call whose queries fill one block (L = C = W = 64), on 2 threads: the
    outputs and gradients of eager (the one window of keys is a plain view: inductor's parallel CPU
    backward of a product with a one-window unfold crashed the process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _compare_compiled_one_block()
    finally:
        torch.set_num_threads(threads)


def _compare_compiled_one_block():
    spec = quiet_preset("hedgehog_window_64")
    q, k, v, _ = make_inputs(batch=2, heads=4, kv_heads=2, length=64, head_dim=8, dtype=torch.float32)
    tensors = make_params(spec, dtype=torch.float32)

    def run(compiled: bool):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *tensors.values())]
        params = as_params(dict(zip(tensors, leaves[3:], strict=True)))

        def call(q, k, v):
            return attention(q, k, v, spec, mode="chunked", params=params, return_state=False)[0]

        out = (torch.compile(call) if compiled else call)(*leaves[:3])
        out.sum().backward()
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    torch._dynamo.reset()
    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("log_scale_dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_the_mix_weight_takes_the_row_max_dtype_whatever_the_log_scale_s(log_scale_dtype):
    """e^{lambda - m} in the row max's dtype (float32): a narrower log-scale is promoted by the subtraction,
    a wider one converted first."""
    log_scale = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=log_scale_dtype)
    row_max = torch.linspace(-3.0, 60.0, 2 * 2 * 2 * 3).view(2, 2, 2, 3, 1)
    weight = mix_weight(log_scale, row_max, kv_heads=2)
    expected = torch.exp((log_scale.double().view(2, 2, 1, 1) - row_max.double()).clamp_max(MAX_MIX_EXPONENT))
    assert weight.dtype == torch.float32
    torch.testing.assert_close(weight, expected.float(), rtol=1e-6, atol=0)


def test_a_call_without_autograd_allocates_the_band_once():
    """Prefill and evaluation (no autograd): the band's scores are masked, shifted and exponentiated in
    place, one tensor of C + W columns a row instead of four. One call of the finetune default's spec at
    SmolLM2's heads and 1,024 tokens, float32, allocates under 200,000 bytes a token (179,341; 237,229 when
    each of the three made a tensor of its own)."""
    spec = quiet_preset("hedgehog_window_256_sinks_4_kept_256_decay")
    q, k, v, _ = make_inputs(batch=1, heads=9, kv_heads=3, length=1024, head_dim=64, dtype=torch.float32)
    params = as_params(make_params(spec, heads=9, kv_heads=3, head_dim=64, dtype=torch.float32))
    gates = {"decay": torch.full((1, 3, 1024), -1e-3)}
    with torch.no_grad(), AllocatedBytes() as counter:
        attention(q, k, v, spec, mode="chunked", params=params, gates=gates)
    assert counter.bytes / 1024 < 200_000, counter.bytes / 1024


#: Hybrids whose exact part holds `exact_positions` keys: window, sinks, kept positions, gates and decay.
EXACT_PART_SPECS = {
    "hedgehog_w4_sinks2_decay": AttentionSpec(kind="linear", feature_map="hedgehog", window=4, sinks=2, decay=True),
    "elu_w3_kept3_gated": AttentionSpec(kind="linear", feature_map="elu", window=3, kept=3, output_gate=True),
    "taylor2_w2_sinks1_kept3_decay": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, window=2, sinks=1, kept=3, decay=True, chunk_size=2
    ),
}


def _exact_part_call(spec, mode, length, pads):
    """(output, gradients of q, k, v, the learned tensors and the log-decays) of one call without a state."""
    q, k, v, gate_logits = make_inputs(length=length, requires_grad=True)
    needed = ["linear_log_scale", *(["hedgehog_q", "hedgehog_k"] if spec.feature_map == "hedgehog" else [])]
    tensors = {key: x for key, x in make_params(spec, requires_grad=True).items() if key in needed}
    decay_logits = gate_logits["decay"].detach().requires_grad_()
    gates = {"output": torch.sigmoid(gate_logits["output"].detach())} if spec.output_gate else {}
    if spec.decay:
        gates["decay"] = F.logsigmoid(decay_logits)
    mask = left_padding_mask(2, length, pads)
    out, state = attention(
        q, k, v, spec, mode=mode, attention_mask=mask, gates=gates, params=as_params(tensors), return_state=False
    )
    assert state is None
    rows = mask[:, None, :, None]
    leaves = [q, k, v, *tensors.values(), *([decay_logits] if spec.decay else [])]
    grads = torch.autograd.grad((out * rows * torch.linspace(-1, 1, 8, dtype=out.dtype)).sum(), leaves)
    return out * rows, grads, (q, k, v, mask, gates)


@pytest.mark.parametrize("name", sorted(EXACT_PART_SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_a_call_within_the_exact_part_is_softmax_and_gives_the_state_zero_gradients(name, mode):
    """From an empty state, no key of a call of at most window + sinks + kept positions reaches the finite state:
    the output is causal softmax (float64 reference), and the feature maps, the mixing weight and the log-decays
    get gradients of exactly zero (as the finite-state path gives them), not None."""
    spec = EXACT_PART_SPECS[name]
    out, grads, (q, k, v, mask, gates) = _exact_part_call(spec, mode, spec.exact_positions, pads=[0, 3])
    want = softmax_attention_reference(q, k, v, mask.bool(), 8**-0.5)
    if spec.output_gate:
        want = want * gates["output"].unsqueeze(-1)
    torch.testing.assert_close(out, want * mask[:, None, :, None], rtol=1e-9, atol=1e-10)
    q_ref, k_ref, v_ref = (x.detach().requires_grad_() for x in (q, k, v))
    reference = softmax_attention_reference(q_ref, k_ref, v_ref, mask.bool(), 8**-0.5)
    if spec.output_gate:
        reference = reference * gates["output"].unsqueeze(-1)
    weights = mask[:, None, :, None] * torch.linspace(-1, 1, 8, dtype=torch.float64)
    want_grads = torch.autograd.grad((reference * weights).sum(), [q_ref, k_ref, v_ref])
    for got, expected in zip(grads[:3], want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
    assert all(grad is not None and not grad.any() for grad in grads[3:])


@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_one_position_past_the_exact_part_reads_the_finite_state(mode):
    """At window + sinks + 1 positions the oldest key that is not a sink enters the finite state: the output
    is the hybrid's formula, not softmax, and the feature maps get a gradient."""
    spec = dataclasses.replace(EXACT_PART_SPECS["hedgehog_w4_sinks2_decay"], decay=False)
    out, grads, (q, k, v, mask, _) = _exact_part_call(spec, mode, spec.exact_positions + 1, pads=[0, 0])
    params = as_params(make_params(spec))
    want = naive_window_attention(q.detach(), k.detach(), v.detach(), spec, params, mask.bool(), 8**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    softmax = softmax_attention_reference(q.detach(), k.detach(), v.detach(), mask.bool(), 8**-0.5)
    assert (out[..., -1, :] - softmax[..., -1, :]).abs().max() > 1e-3
    assert all(grad.abs().sum() > 0 for grad in grads[3:])  # the mixing weight and both feature maps


def test_only_a_call_that_fits_and_asks_for_no_state_skips_the_finite_state(monkeypatch):
    """The hybrid's own path (window band, kept selection, finite state) runs for a call one position longer
    than the exact part, for a call that returns its state (prefill) and for one that continues a state; a
    call that fits, without a state, runs causal softmax alone."""
    module = importlib.import_module("hf_softmax_rnn.ops.attention")
    calls = []

    def counting(name):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return counted

    for name in ("_finite_state", "parallel_scores"):
        monkeypatch.setattr(module, name, counting(name))
    spec = EXACT_PART_SPECS["elu_w3_kept3_gated"]
    params = as_params(make_params(spec))
    q, k, v, _ = make_inputs(length=spec.exact_positions + 1)
    gate = torch.full((2, 4, spec.exact_positions + 1), 0.5, dtype=torch.float64)

    def call(length, mode, **kwargs):
        qkv = (q[..., :length, :], k[..., :length, :], v[..., :length, :])
        return attention(*qkv, spec, mode=mode, gates={"output": gate[..., :length]}, params=params, **kwargs)

    for mode in ("parallel", "chunked", "recurrent"):
        call(spec.exact_positions, mode, return_state=False)
    assert calls == []
    call(spec.exact_positions + 1, "parallel")
    call(spec.exact_positions + 1, "chunked", return_state=False)
    _, state = call(spec.exact_positions, "chunked")
    call(1, "recurrent", state=state, return_state=False)
    assert calls == ["parallel_scores", "_finite_state", "_finite_state", "_finite_state"]
    assert int(state.t[0]) == spec.exact_positions


@pytest.mark.parametrize(
    "preset",
    [
        "taylor_2_window_64",
        "hedgehog_window_64",
        "hedgehog_window_64_sinks_4_decay",
        "hedgehog_window_64_sinks_4_delta",
    ],
)
def test_parallel_queries_over_more_keys_are_the_last_rows_of_the_full_call(preset):
    """3 queries over 40 keys (window 8): the keys older than the window reach the finite state even though the
    queries alone fit in the exact part (they were once scored as softmax over all 40 keys)."""
    spec = quiet_preset(preset, window=8)
    q, k, v, gate_logits = make_inputs(length=40)
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, 40, [0, 5])
    gated_v, gates = gated(spec, v, gate_logits)
    full, _ = attention(q, k, gated_v, spec, attention_mask=mask, gates=gates, params=params)
    last, _ = attention(q[..., -3:, :], k, gated_v, spec, attention_mask=mask, gates=gates, params=params)
    torch.testing.assert_close(last, full[..., -3:, :], rtol=1e-9, atol=1e-10)
    softmax, _ = attention(q[..., -3:, :], k, gated_v, "softmax", attention_mask=mask)
    assert (last - softmax).abs().max() > 1e-3


#: Hybrids whose exact part the fused CPU kernel may compute without autograd (softmax normaliser).
FUSED_CPU_SPECS = {
    "elu_w5": AttentionSpec(kind="linear", feature_map="elu", window=5, chunk_size=4),
    "hedgehog_w4_sinks2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=4, sinks=2, decay=True, chunk_size=3
    ),
    "elu_w3_kept4_sinks1": AttentionSpec(kind="linear", feature_map="elu", window=3, kept=4, sinks=1, chunk_size=4),
    "hedgehog_w6_sinks1_kept5_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=6, sinks=1, kept=5, decay=True, chunk_size=4
    ),
}


def _counting_fused_calls(monkeypatch) -> list[int]:
    """Count the calls of `ops.window.flash_block_part`, wherever the ops call it from."""
    calls = []
    fused = window_module.flash_block_part

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    for module in (window_module, kept_module):
        monkeypatch.setattr(module, "flash_block_part", counted)
    return calls


def _blocks_only(monkeypatch) -> None:
    """Make the ops take the block forms where they would take the fused CPU kernel."""
    for module in (window_module, kept_module):
        monkeypatch.setattr(module, "flash_applies", lambda *args: False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", sorted(FUSED_CPU_SPECS))
def test_the_fused_cpu_kernel_gives_the_block_forms_output_and_gradients(name, dtype, monkeypatch):
    """The exact part in PyTorch's fused CPU kernel, under the log-sum-exp, with and without autograd: the
    block forms' outputs, states and gradients (q, k, v, the learned maps and weights, the decay), padding
    included. The minimum width is lowered so that these small blocks take the kernel with autograd too."""
    spec = FUSED_CPU_SPECS[name]
    monkeypatch.setattr(window_module, "FLASH_MIN_KEYS_WITH_AUTOGRAD", 1)
    q, k, v, gate_logits = make_inputs(length=23, dtype=dtype)
    mask = left_padding_mask(2, 23, [0, 5])
    rows = mask[:, None, :, None]
    weights = torch.linspace(-1, 1, v.shape[-1], dtype=dtype)

    def run():
        params = as_params(make_params(spec, dtype=dtype))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        learned = [x for x in (params.hedgehog_q, params.hedgehog_k, params.linear_log_scale) if x is not None]
        learned = [x.requires_grad_() for x in learned]
        gates = {"decay": F.logsigmoid(gate_logits["decay"]).requires_grad_()} if spec.decay else {}
        out, state = attention(*leaves, spec, mode="chunked", attention_mask=mask, params=params, gates=gates)
        inputs = [*leaves, *learned, *gates.values()]
        loss = (out * rows * weights).square().sum()
        return out * rows, state, torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)

    calls = _counting_fused_calls(monkeypatch)
    with torch.no_grad():
        gates = {"decay": F.logsigmoid(gate_logits["decay"])} if spec.decay else {}
        params = as_params(make_params(spec, dtype=dtype))
        fused, fused_state = attention(q, k, v, spec, mode="chunked", attention_mask=mask, params=params, gates=gates)
    assert calls, "the fused CPU kernel did not run"
    calls.clear()
    trained, trained_state, trained_grads = run()
    assert calls, "the fused CPU kernel did not run with autograd"
    _blocks_only(monkeypatch)
    blocks, blocks_state, block_grads = run()
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 2e-5}
    torch.testing.assert_close(fused * rows, blocks.detach(), **tolerance)
    torch.testing.assert_close(trained.detach(), blocks.detach(), **tolerance)
    torch.testing.assert_close(fused_state.packed, blocks_state.packed.detach(), **tolerance)
    torch.testing.assert_close(trained_state.packed.detach(), blocks_state.packed.detach(), **tolerance)
    for got, want in zip(trained_grads, block_grads, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_narrow_blocks_keep_the_block_forms_with_autograd(monkeypatch):
    """With autograd a window of 5 (bands of 9 keys) stays in the block forms, where the kernel's backward
    does not pay; without, it takes the kernel."""
    spec = FUSED_CPU_SPECS["elu_w5"]
    q, k, v, _ = make_inputs(length=12)
    calls = _counting_fused_calls(monkeypatch)
    attention(q.clone().requires_grad_(), k, v, spec, mode="chunked", params=as_params(make_params(spec)))
    assert not calls
    with torch.no_grad():
        attention(q, k, v, spec, mode="chunked", params=as_params(make_params(spec)))
    assert calls


def test_the_fused_cpu_block_part_has_the_gradients_of_its_shift_free_uses():
    """`flash_block_part` under autograd, float64 gradcheck of a use that does not depend on the shift (the
    merge with another part under it, then the division by the denominator, as the ops use it): the shift is
    a constant of the backward pass, as every exact part's row shift is."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, blocks, groups, block, width, dim = 1, 2, 2, 2, 3, 5, 4
    q = torch.randn(batch, kv_heads, blocks, groups * block, dim, dtype=torch.float64, generator=generator)
    keys = torch.randn(batch, kv_heads, blocks, width, dim, dtype=torch.float64, generator=generator)
    values = torch.randn(batch, kv_heads, blocks, width, dim, dtype=torch.float64, generator=generator)
    visible = torch.rand(batch, kv_heads, blocks, block, width, generator=generator) > 0.3
    visible[0, 0, 0, 0] = False  # a row that sees nothing
    other = torch.linspace(-1, 1, dim, dtype=torch.float64)

    def merged(q, keys, values):
        augmented = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)
        numerator, shift = window_module.flash_block_part(q, keys, augmented, visible, 0.4)
        weight = torch.exp(0.3 - shift).nan_to_num(0.0)  # another part's mass under the shift
        return (numerator[..., :dim] + weight * other) / (numerator[..., dim:] + weight * 0.7)

    assert torch.autograd.gradcheck(merged, [x.requires_grad_() for x in (q, keys, values)])


def test_other_normalisers_keep_the_row_max(monkeypatch):
    """A normaliser that sees the exact part's shift (layer norm's eps) never gets the log-sum-exp."""
    spec = AttentionSpec(kind="linear", feature_map="elu", window=3, kept=2, normalizer="layer", chunk_size=4)
    q, k, v, _ = make_inputs(length=12)
    calls = _counting_fused_calls(monkeypatch)
    with torch.no_grad():
        attention(q, k, v, spec, mode="chunked", params=as_params(make_params(spec)))
    assert not calls


@pytest.mark.parametrize(
    ("case", "applies"),
    [("ones_and_zero_rows", True), ("a_weight_of_one_half", False), ("a_zero_weight_on_a_row_with_values", False),
     ("values_as_wide_as_keys", False), ("autograd", True), ("autograd_narrow_blocks", False)],
)  # fmt: skip
def test_the_fused_cpu_kernel_takes_only_weight_columns_it_can_leave_out(case, applies, monkeypatch):
    q, keys = torch.randn(1, 2, 3, 6, 4), torch.randn(1, 2, 3, 5, 4)
    values = torch.cat([torch.randn(1, 2, 3, 5, 4), torch.ones(1, 2, 3, 5, 1)], dim=-1)
    values[..., 1, :] = 0.0  # a padding row: weight 0, values 0
    if case == "a_weight_of_one_half":
        values[..., 2, -1] = 0.5
    elif case == "a_zero_weight_on_a_row_with_values":
        values[..., 3, -1] = 0.0
    elif case == "values_as_wide_as_keys":
        values = values[..., :-1]
    elif case == "autograd":
        monkeypatch.setattr(window_module, "FLASH_MIN_KEYS_WITH_AUTOGRAD", 5)
        q.requires_grad_()
    elif case == "autograd_narrow_blocks":
        monkeypatch.setattr(window_module, "FLASH_MIN_KEYS_WITH_AUTOGRAD", 6)
        q.requires_grad_()
    assert window_module.flash_applies(q, keys, values) is applies


def test_the_fused_cpu_block_part_is_the_masked_exp_part():
    """`flash_block_part` against `blocked_exp` in float64: the same numerator once both are taken to one
    shift, a row that sees no key 0 with shift -inf, zero-weight rows left out."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, blocks, groups, block, width, dim = 2, 2, 3, 2, 4, 7, 5
    q = torch.randn(batch, kv_heads, blocks, groups * block, dim, dtype=torch.float64, generator=generator)
    keys = torch.randn(batch, kv_heads, blocks, width, dim, dtype=torch.float64, generator=generator)
    values = torch.randn(batch, kv_heads, blocks, width, dim + 1, dtype=torch.float64, generator=generator)
    values[..., -1] = 1.0
    values[:, :, :, 2] = 0.0  # weight 0: left out
    visible = torch.rand(batch, kv_heads, blocks, block, width, generator=generator) > 0.3
    visible[0, 0, 0, 0] = False  # a row that sees nothing
    numerator, shift = window_module.flash_block_part(q, keys, values, visible, 0.4)
    seen = visible & (values[..., -1] != 0)[..., None, :]
    weights, row_max = window_module.blocked_exp(q, keys.mT, seen[:, :, :, None], 0.4, groups)
    want = weights.view(batch, kv_heads, blocks, groups * block, width) @ values
    empty = ~seen.any(-1)[:, :, :, None].expand(-1, -1, -1, groups, -1).reshape(*shift.shape)
    assert torch.equal(shift.isneginf(), empty) and not numerator[empty.squeeze(-1)].any()
    got = numerator * torch.exp(shift - row_max.view(shift.shape)).nan_to_num(0.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

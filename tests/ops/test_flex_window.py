"""The window part of a hybrid as (normalised output, log-sum-exp), its log-space combination with the
finite-state part, and FlexAttention's form of it, against float64 references on the CPU:

- combine(window reference, chunked finite-state part) = the float64 parallel form, values and
  gradients, fp32, left padding;
- FlexAttention's eager form (forward: it has no backward on CPU) = the dense reference and
  `banded_exp_attention`;
- sinks (the first S visible positions scored exactly) against a hybrid written out densely here;
- `ops.attention` picks FlexAttention where the backend allows it and gives the same values.
The GPU test (tests/gpu/test_flex_window.py) checks the compiled kernel and its gradients.
"""

import importlib
import warnings

import pytest
import torch

from hf_softmax_rnn.ops import attention, backends
from hf_softmax_rnn.ops.feature_maps import build_kernel
from hf_softmax_rnn.ops.flex_window import (
    combine_window_and_linear,
    exact_visibility,
    flex_window_attention,
    window_attention_reference,
)
from hf_softmax_rnn.ops.linear import chunked_linear_attention
from hf_softmax_rnn.ops.window import banded_exp_attention

from .helpers import as_params, left_padding_mask, make_inputs, make_params, quiet_preset
from .kernel_stand_ins import FlexStandIn, WrittenBytes, use_stand_ins

HEADS, KV_HEADS, LENGTH, HEAD_DIM = 4, 2, 23, 16
PADS = [0, 5]
SCALE = HEAD_DIM**-0.5
SPECS = ["hedgehog_window_64", "linear_elu"]


def _spec(name: str, window: int):
    return quiet_preset(name, window=window, chunk_size=8)


def _finite_state_part(q, k, v, key_valid, spec, params, window, sinks=0):
    """[N, G] `[B, H, L, Dv + 1]` over the keys older than the window (and not sinks): the chunked
    form on the keys shifted by `window` positions."""
    batch, heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    keep = key_valid.clone()
    starts = (~key_valid).long().sum(-1)
    keep &= torch.arange(length)[None, :] >= starts[:, None] + sinks
    augmented = torch.cat([v, torch.ones_like(v[..., :1])], -1) * keep[:, None, :, None].to(v.dtype)
    shifted_k = torch.nn.functional.pad(k, (0, 0, window, 0))[..., :length, :]
    shifted_v = torch.nn.functional.pad(augmented, (0, 0, window, 0))[..., :length, :]
    kernel = build_kernel(spec, spec.qk_scale or SCALE, params)
    grouped = q.view(batch, kv_heads, heads // kv_heads, length, head_dim)
    state = q.new_zeros(batch, kv_heads, spec.feature_dim(head_dim), v.shape[-1] + 1)
    linear, _ = chunked_linear_attention(grouped, shifted_k, shifted_v, state, kernel, spec.chunk_size)
    return linear.reshape(batch, heads, length, -1)


def _hybrid(q, k, v, key_valid, spec, params, window, sinks=0):
    """y = (e^l o_w + e^lambda N) / (e^l + e^lambda G) through the reference window part."""
    out, lse = window_attention_reference(q, k, v, key_valid, SCALE, window, sinks)
    linear = _finite_state_part(q, k, v, key_valid, spec, params, window, sinks)
    combined = combine_window_and_linear(out, lse, linear, params.linear_log_scale)
    denominator = combined[..., -1:]
    return combined[..., :-1] / torch.where(denominator == 0, 1.0, denominator)  # 0 only at padding


def _inputs(dtype, requires_grad=False):
    q, k, v, _ = make_inputs(2, HEADS, KV_HEADS, LENGTH, HEAD_DIM, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("window", [1, 4, 64], ids=["w1", "w4", "w64"])
def test_combination_equals_the_parallel_form_in_values_and_gradients(name, window):
    spec = _spec(name, window)
    mask = left_padding_mask(2, LENGTH, PADS)
    valid = mask.bool()
    want_leaves = [*_inputs(torch.float64, requires_grad=True)]
    want_params = make_params(spec, HEADS, KV_HEADS, HEAD_DIM, requires_grad=True)
    want, _ = attention(*want_leaves, spec, mode="parallel", attention_mask=mask, params=as_params(want_params))
    got_leaves = [x.detach().float().requires_grad_() for x in want_leaves]
    got_params = {key: x.detach().float().requires_grad_() for key, x in want_params.items()}
    got = _hybrid(*got_leaves, valid, spec, as_params(got_params), window)

    rows = valid[:, None, :, None]
    torch.testing.assert_close(got.double() * rows, want * rows, rtol=1e-4, atol=1e-5)
    weights = torch.linspace(-1, 1, HEAD_DIM, dtype=torch.float64)
    names = ["hedgehog_q", "hedgehog_k", "linear_log_scale"] if spec.feature_map == "hedgehog" else []
    targets_want = want_leaves + [want_params[key] for key in names]
    targets_got = got_leaves + [got_params[key] for key in names]
    grads_want = torch.autograd.grad((want * rows * weights).sum(), targets_want)
    grads_got = torch.autograd.grad((got * rows * weights.float()).sum(), targets_got)
    for got_grad, want_grad in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-4, atol=1e-5)


def test_a_row_without_exact_keys_keeps_the_finite_state_part():
    out, lse = torch.zeros(1, 1, 2, 3), torch.tensor([[[float("-inf"), 0.5]]])
    linear = torch.tensor([[[[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]]])
    combined = combine_window_and_linear(out, lse, linear, torch.tensor([0.25]))
    torch.testing.assert_close(combined[0, 0, 0], torch.tensor(0.25).exp() * linear[0, 0, 0])
    torch.testing.assert_close(combined[0, 0, 1], torch.tensor([0.0, 0.0, 0.0, 1.0]))


@pytest.mark.parametrize("window", [1, 4, 30], ids=["w1", "w4", "w30"])
def test_flex_window_part_equals_the_banded_form(window):
    q, k, v = _inputs(torch.float32)
    valid = left_padding_mask(2, LENGTH, PADS).bool()
    with torch.no_grad():
        out, lse = flex_window_attention(q, k, v, valid, SCALE, window, compiled=False)
        want_out, want_lse = window_attention_reference(q.double(), k.double(), v.double(), valid, SCALE, window)
        grouped = q.view(2, KV_HEADS, HEADS // KV_HEADS, LENGTH, HEAD_DIM)
        keys = torch.cat([k.new_zeros(2, KV_HEADS, window, HEAD_DIM), k], -2)
        values = torch.cat([v.new_zeros(2, KV_HEADS, window, HEAD_DIM), v], -2)
        values = torch.cat([values, torch.ones_like(values[..., :1])], -1)
        buffer_valid = torch.cat([torch.zeros(2, window, dtype=torch.bool), valid], -1)
        numerator, row_max = banded_exp_attention(grouped, keys, values, buffer_valid, SCALE, window, 8)
    banded_out = (numerator[..., :-1] / numerator[..., -1:]).reshape(out.shape)
    banded_lse = (row_max + numerator[..., -1:].log()).reshape(lse.shape)
    rows = valid[:, None, :]
    torch.testing.assert_close(out[rows.expand_as(lse)], banded_out[rows.expand_as(lse)], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[rows.expand_as(lse)], banded_lse[rows.expand_as(lse)], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[1, :, : PADS[1]]).all() and (out[1, :, : PADS[1]] == 0).all()


def _dense_hybrid_with_sinks(q, k, v, valid, spec, params, window, sinks):
    """The definition in float64: exp over the first `sinks` visible keys and the last `window`
    positions, e^lambda phi(q).phi(k) over every other earlier visible key, one denominator."""
    groups = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    exact = exact_visibility(valid, window, sinks)[:, None]
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    rest = causal & valid[:, None, None, :] & ~exact
    kernel = build_kernel(spec, spec.qk_scale or SCALE, params)
    grouped = q.view(2, KV_HEADS, groups, LENGTH, HEAD_DIM)
    phi = kernel.scores(grouped, k).reshape(2, HEADS, LENGTH, LENGTH)
    weights = torch.exp(SCALE * q @ k_full.mT) * exact + params.linear_log_scale.exp()[:, None, None] * phi * rest
    denominator = weights.sum(-1, keepdim=True)
    return (weights @ v_full) / torch.where(denominator == 0, 1.0, denominator)


@pytest.mark.parametrize("sinks", [1, 3], ids=["sinks1", "sinks3"])
def test_sinks_are_scored_exactly(sinks):
    spec, window = _spec("hedgehog_window_64", 4), 4
    q, k, v = _inputs(torch.float64)
    valid = left_padding_mask(2, LENGTH, PADS).bool()
    params = as_params(make_params(spec, HEADS, KV_HEADS, HEAD_DIM))
    want = _dense_hybrid_with_sinks(q, k, v, valid, spec, params, window, sinks)
    got = _hybrid(q, k, v, valid, spec, params, window, sinks)
    rows = valid[:, None, :, None]
    torch.testing.assert_close(got * rows, want * rows, rtol=1e-9, atol=1e-10)
    with torch.no_grad():
        out, lse = flex_window_attention(q.float(), k.float(), v.float(), valid, SCALE, window, sinks, compiled=False)
    want_out, want_lse = window_attention_reference(q, k, v, valid, SCALE, window, sinks)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want_lse, window_attention_reference(q, k, v, valid, SCALE, window)[1])


FLEX_SPECS = {
    "window": ("hedgehog_window_64", {}),
    "window-sinks": ("hedgehog_window_64_sinks_4", {"sinks": 2}),
    "window-sinks-decay": ("hedgehog_window_64_sinks_4_decay", {"sinks": 2}),
    "window-sinks-kept-decay": ("hedgehog_window_256_sinks_4_kept_256_decay", {"sinks": 2, "kept": 3}),
}


@pytest.mark.parametrize("preset, overrides", FLEX_SPECS.values(), ids=FLEX_SPECS.keys())
def test_attention_runs_the_window_part_in_flex_where_the_backend_allows(monkeypatch, preset, overrides):
    """The flex path of `attention` (window, sinks, decayed finite state) against the float64 parallel form."""
    spec = quiet_preset(preset, window=4, chunk_size=8, **overrides)
    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cpu",))
    calls = []
    monkeypatch.setattr(
        importlib.import_module("hf_softmax_rnn.ops.attention"),
        "flex_window_attention",
        lambda *args, **kwargs: calls.append(kwargs) or flex_window_attention(*args, **kwargs),
    )
    q, k, v = _inputs(torch.float64)
    mask = left_padding_mask(2, LENGTH, PADS)
    params = make_params(spec, HEADS, KV_HEADS, HEAD_DIM)
    log_decay = torch.nn.functional.logsigmoid(torch.randn(2, KV_HEADS, LENGTH, dtype=torch.float64) + 2)
    gates = {"decay": log_decay} if spec.decay else {}
    want, _ = attention(q, k, v, spec, mode="parallel", attention_mask=mask, params=as_params(params), gates=gates)
    float_params = as_params({key: x.float() for key, x in params.items()})
    with torch.no_grad():
        got, state = attention(
            q.float(), k.float(), v.float(), spec, mode="chunked", attention_mask=mask, params=float_params,
            return_state=False, gates={name: x.float() for name, x in gates.items()},
        )  # fmt: skip
        assert state is None and calls == [{"sinks": spec.sinks or 0, "compiled": False, "softcap": None}]
        attention(
            q.float(), k.float(), v.float(), spec, mode="chunked", attention_mask=mask, params=float_params,
            gates={name: x.float() for name, x in gates.items()},
        )  # fmt: skip
    assert len(calls) == 1  # a call that hands its state on keeps the banded form
    rows = mask.bool()[:, None, :, None]
    torch.testing.assert_close(got.double() * rows, want * rows, rtol=1e-4, atol=1e-5)


def test_the_flex_switch_keeps_the_banded_window(monkeypatch):
    """HF_SOFTMAX_RNN_FLEX=0: a call the flex path would take runs the banded PyTorch window instead."""
    spec = _spec("hedgehog_window_64", 4)
    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setenv(backends.FLEX_ENV_VARIABLE, "0")
    calls = []
    monkeypatch.setattr(
        importlib.import_module("hf_softmax_rnn.ops.attention"),
        "flex_window_attention",
        lambda *args, **kwargs: calls.append(kwargs) or flex_window_attention(*args, **kwargs),
    )
    q, k, v = _inputs(torch.float32)
    params = as_params({key: x.float() for key, x in make_params(spec, HEADS, KV_HEADS, HEAD_DIM).items()})
    with torch.no_grad():
        attention(q, k, v, spec, mode="chunked", params=params, return_state=False)
    assert calls == []


def test_bfloat16_hybrid_reads_the_caller_s_tensors_in_flex_and_writes_little_beside_the_kernels(monkeypatch):
    """SmolLM2's heads (9 query, 3 KV, 64 wide) in bfloat16, `hedgehog_window_64` through fla and FlexAttention
    (stand-ins that keep what the kernels keep): FlexAttention reads the caller's q, k, v (not copies made
    back from float32), the PyTorch around the kernels writes under 120,000 bytes per token forward and
    backward (146,806 when FlexAttention read copies, the query features were multiplied by the scale in a
    pass of their own and the merge took three passes; 125,314 when the hedgehog map negated and joined
    its halves in passes of their own) in under 125 operations (each a kernel launch on a GPU; 139 when,
    besides, the merge tested finiteness in four, a spec without sinks masked none out in three and the
    denominator sent a gradient back to the values' weight column), and the outputs are the PyTorch
    form's to bfloat16 rounding."""
    use_stand_ins(monkeypatch, flex=True)
    spec, length = quiet_preset("hedgehog_window_64"), 1024
    q, k, v, _ = make_inputs(batch=1, heads=9, kv_heads=3, length=length, head_dim=64, dtype=torch.bfloat16)
    params = make_params(spec, heads=9, kv_heads=3, head_dim=64, dtype=torch.float32)
    params = as_params({name: params[name] for name in ("hedgehog_q", "hedgehog_k", "linear_log_scale")})
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with WrittenBytes() as counter:
        fused, _ = attention(*leaves, spec, mode="chunked", return_state=False, params=params)
        fused.float().sum().backward()
    assert [tuple(x.data_ptr() for x in read) for read in FlexStandIn.read] == [tuple(x.data_ptr() for x in leaves)]
    assert counter.bytes / length < 120_000, counter.bytes / length
    assert counter.operations < 125, counter.operations
    with backends.fused_kernels(False):
        plain, _ = attention(*leaves, spec, mode="chunked", return_state=False, params=params)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_flex_window_asks_for_the_log_sum_exp_without_a_deprecated_argument():
    """FlexAttention's `return_lse` is deprecated where `return_aux` exists: no FutureWarning."""
    q, k, v = _inputs(torch.float32)
    valid = torch.ones(2, LENGTH, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out, lse = flex_window_attention(q, k, v, valid, SCALE, 4, compiled=False)
    want_out, want_lse = window_attention_reference(q, k, v, valid, SCALE, 4)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset, overrides", FLEX_SPECS.values(), ids=FLEX_SPECS.keys())
def test_the_flex_path_has_the_values_and_gradients_of_the_pytorch_form(monkeypatch, preset, overrides):
    """Through the stand-ins (FlexAttention's and fla's float64 statements, with their backward), left
    padding included: outputs and the gradients of q, k, v, the feature maps and the window weight equal
    the PyTorch form's. With kept positions the band ranks the keys without autograd and the kept keys'
    exact part is merged with FlexAttention's window under one row max."""
    use_stand_ins(monkeypatch, flex=True)
    spec = quiet_preset(preset, window=4, chunk_size=8, **overrides)
    q, k, v = (x.requires_grad_() for x in _inputs(torch.float32))
    mask = left_padding_mask(2, LENGTH, PADS)
    tensors = {name: x.float().requires_grad_() for name, x in make_params(spec, HEADS, KV_HEADS, HEAD_DIM).items()}
    log_decay = torch.nn.functional.logsigmoid(torch.randn(2, KV_HEADS, LENGTH) + 2)
    gates = {"decay": log_decay} if spec.decay else {}
    weights = torch.randn(2, HEADS, LENGTH, HEAD_DIM) * mask[:, None, :, None]
    leaves = [q, k, v, *tensors.values()]
    results = {}
    for fused in (True, False):
        with backends.fused_kernels(fused):
            out, _ = attention(q, k, v, spec, mode="chunked", attention_mask=mask, params=as_params(tensors),
                               gates=gates, return_state=False)  # fmt: skip
        grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
        results[fused] = [out * mask[:, None, :, None], *grads]
    assert len(FlexStandIn.read) == 1
    for got, want in zip(results[True], results[False], strict=True):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

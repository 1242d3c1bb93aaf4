"""The flash-linear-attention path of the chunked form, against the PyTorch chunked form.

On CPU, fla's `chunk_simple_gla` is replaced by its float64 PyTorch statement
(`chunk_simple_gla_reference`), which tests everything this package adds around it: the
features, the repeat over query heads, the augmented values, the state layout, the window
hybrids' older part and the gradients that reach learned feature maps. tests/gpu runs the same
comparison with fla's own kernel on CUDA.
"""

import pytest
import torch

from hf_softmax_rnn.ops import RecurrentState, attention, backends
from hf_softmax_rnn.ops.fla_linear import chunk_in_segments, chunk_simple_gla_reference

from .helpers import FINITE_SPECS, as_params, gated, left_padding_mask, make_inputs, make_params
from .kernel_stand_ins import WrittenBytes, saved_bytes, use_stand_ins

FLA_SPECS = sorted(
    name
    for name, spec in FINITE_SPECS.items()
    if spec.feature_dim(8) <= backends.FLA_MAX_FEATURES and spec.score_clamp is None and not spec.delta_rule
)
DELTA_SPECS = sorted(name for name, spec in FINITE_SPECS.items() if spec.delta_rule)
TOL = dict(rtol=1e-9, atol=1e-10)


@pytest.fixture
def reference_fla(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[0].shape, args[2].shape[-1]))  # (q features, value width)
        return chunk_simple_gla_reference(*args, **kwargs)

    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(backends, "FUSED_DTYPES", (*backends.FUSED_DTYPES, torch.float64))  # the float64 statement
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: counted)
    return calls


@pytest.mark.parametrize("name", DELTA_SPECS)
def test_a_delta_rule_state_runs_the_pytorch_form_where_fla_would_run(name, reference_fla, caplog):
    """fla's additive kernel cannot carry a delta rule: the call runs the PyTorch form, says so once, and gives
    the result with the fused kernels off."""
    spec = FINITE_SPECS[name]
    q, k, v, gate_logits = make_inputs(length=13)
    gated_v, gates = gated(spec, v, gate_logits)
    call = dict(mode="chunked", attention_mask=left_padding_mask(2, 13, [0, 3]), gates=gates)
    call["params"] = as_params(make_params(spec))
    backends._warn_no_kernel.cache_clear()
    with backends.fused_kernels(True), caplog.at_level("WARNING", logger=backends.logger.name):
        fused, _ = attention(q, k, gated_v, spec, **call)
        attention(q, k, gated_v, spec, **call)
    assert reference_fla == []
    assert [r.getMessage() for r in caplog.records] == [
        "the delta rule has no fused kernel in hf_softmax_rnn: it runs the PyTorch form on the GPU"
    ]
    with backends.fused_kernels(False):
        plain, _ = attention(q, k, gated_v, spec, **call)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


@pytest.mark.parametrize("segment", [0, 3], ids=["whole_rows", "segments_of_3"])
@pytest.mark.parametrize("name", FLA_SPECS)
def test_chunked_attention_through_fla_matches_pytorch(name, segment, reference_fla, monkeypatch):
    monkeypatch.setenv(backends.SEGMENT_ENV_VARIABLE, str(segment))
    spec = FINITE_SPECS[name]
    q, k, v, gate_logits = make_inputs(length=13, requires_grad=True)
    params = make_params(spec, requires_grad=True)
    mask = left_padding_mask(2, 13, [0, 3])
    leaves = [q, k, v, *gate_logits.values(), *params.values()]
    weights = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)

    def run(fused: bool):
        gated_v, gates = gated(spec, v, gate_logits)
        with backends.fused_kernels(fused):
            first, state = attention(
                q[..., :7, :], k[..., :7, :], gated_v[..., :7, :], spec, mode="chunked",
                attention_mask=mask[:, :7], gates={n: g[..., :7] for n, g in gates.items()}, params=as_params(params),
            )  # fmt: skip
            second, state = attention(
                q[..., 7:, :], k[..., 7:, :], gated_v[..., 7:, :], spec, mode="chunked", attention_mask=mask,
                gates={n: g[..., 7:] for n, g in gates.items()}, params=as_params(params), state=state,
            )  # fmt: skip
        out = torch.cat([first, second], dim=-2)
        loss = (out * weights).sum() + 0.1 * state.S.sum() + 0.2 * state.z.sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return out, state, [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)]

    fused_out, fused_state, fused_grads = run(True)
    assert len(reference_fla) == 2, "the fla path did not run"
    if segment:  # calls of 7 and 6 positions: 3 and 2 rows of 3 per sequence
        assert [shape[:2] for shape, _ in reference_fla] == [(6, 3), (4, 3)]
    torch_out, torch_state, torch_grads = run(False)
    assert len(reference_fla) == 2, "fused_kernels(False) still ran the fla path"
    torch.testing.assert_close(fused_out, torch_out, **TOL)
    for got, want in zip(fused_state.tensors(), torch_state.tensors(), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(fused_grads, torch_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_fla_receives_one_head_per_query_head(reference_fla):
    spec = FINITE_SPECS["linear_elu"]
    q, k, v, _ = make_inputs(heads=6, kv_heads=2, length=5)
    state = RecurrentState.zeros(2, 2, spec.feature_dim(8), 8, 8)
    attention(q, k, v, spec, mode="chunked", state=state)
    assert reference_fla == [(torch.Size([2, 5, 6, 8]), 8)]  # time-major [B, L, H, F]


@pytest.mark.parametrize("name", ["linear_elu", "decay_window2_sinks2_elu_gates", "window3_hedgehog"])
def test_a_call_without_a_state_asks_fla_for_no_final_state(name, monkeypatch):
    """`return_state=False` (training): fla writes no final state (`output_final_state=False`), and the
    outputs and gradients are those of a call that returns its state."""
    asked = []

    def reference(*args, **kwargs):
        asked.append(kwargs["output_final_state"])
        return chunk_simple_gla_reference(*args, **kwargs)

    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(backends, "FUSED_DTYPES", (*backends.FUSED_DTYPES, torch.float64))
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: reference)
    spec = FINITE_SPECS[name]
    q, k, v, gate_logits = make_inputs(length=9, requires_grad=True)
    params = make_params(spec, requires_grad=True)
    gated_v, gates = gated(spec, v, gate_logits)
    results = []
    for return_state in (False, True):
        out, state = attention(
            q, k, gated_v, spec, mode="chunked", attention_mask=left_padding_mask(2, 9, [0, 2]), gates=gates,
            params=as_params(params), return_state=return_state,
        )  # fmt: skip
        assert (state is None) == (not return_state)
        results.append((out, torch.autograd.grad(out.sum(), [q, k, v], retain_graph=True)))
    assert asked == [False, True]
    torch.testing.assert_close(results[0][0], results[1][0], **TOL)
    for got, want in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_fla_reads_the_values_without_the_denominator_column(reference_fla):
    """fla gets values of width Dv (64 in the real models, not 65 padded to 66): the denominator is
    a cumulative sum beside it. An odd Dv is padded to even and cut off again."""
    spec = FINITE_SPECS["linear_elu"]
    for value_dim, expected in [(8, 8), (7, 8)]:
        q, k, _, _ = make_inputs(heads=4, kv_heads=2, length=6)
        v = torch.randn(2, 2, 6, value_dim, dtype=q.dtype)
        with backends.fused_kernels(True):
            fused, fused_state = attention(q, k, v, spec, mode="chunked")
        with backends.fused_kernels(False):
            plain, plain_state = attention(q, k, v, spec, mode="chunked")
        assert reference_fla[-1][1] == expected
        torch.testing.assert_close(fused, plain, **TOL)
        for got, want in zip(fused_state.tensors(), plain_state.tensors(), strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_bfloat16_through_fla_keeps_little_beside_fla_and_matches_the_pytorch_form(monkeypatch):
    """SmolLM2's heads (9 query, 3 KV, 64 wide) in bfloat16: beside what fla keeps (its q, k, v), the
    PyTorch around it keeps under 7,000 bytes per token for the backward pass (the float32 features of
    the queries once, not twice, and not all of the augmented values for their weight column), and its
    outputs are the PyTorch form's to bfloat16 rounding."""
    use_stand_ins(monkeypatch)
    spec, length = FINITE_SPECS["linear_elu"], 1024
    q, k, v, _ = make_inputs(batch=1, heads=9, kv_heads=3, length=length, head_dim=64, dtype=torch.bfloat16)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    outputs = {}

    def run(fused: bool):
        with backends.fused_kernels(fused):
            outputs[fused], _ = attention(*leaves, spec, mode="chunked", return_state=False)

    kept_by_fla = 3 * 9 * 64 * 2  # bytes per token: q, k and v repeated to 9 heads of 64, bfloat16
    assert saved_bytes(lambda: run(True)) / length - kept_by_fla < 7000
    run(False)
    torch.testing.assert_close(outputs[True].float(), outputs[False].float(), rtol=2e-2, atol=2e-2)


#: What the elu+1 map writes per token beyond `F.elu(x) + 1` (which lost e^x below about -17 in float32): two
#: passes more over the float32 features of the 9 + 3 heads of 64 of the queries and keys in the forward
#: (e^min(x, 0), then its max with x + 1) and one in the backward (min(y, 1)); three operations more for each.
#: Its row shift adds three operations and a pass over the float32 query features, 9 heads of 64 (the max of each
#: row, its min with 0, the row less it: `ops.feature_maps.row_shifted_elu_plus_one`, without which a query below
#: 0 everywhere loses its products with the keys, e^(q_d + k_d), below about -104 in float32).
ELU_PLUS_ONE_BYTES = 3 * (9 + 3) * 64 * 4 + (9 * 64 + 2 * 9) * 4
ELU_PLUS_ONE_OPERATIONS = 3 * 2 + 3


def test_bfloat16_through_fla_writes_little_beside_fla(monkeypatch):
    """SmolLM2's heads in bfloat16, forward and backward: the PyTorch around fla writes under 60,000 bytes
    per token (features, layouts, the denominator, the normaliser and their gradients; fla's own
    outputs and gradients not counted; about 89,000 when the heads were repeated before converting,
    laid out in two copies, the normaliser divided and the augmented output sliced apart, 68,900 when
    the query features were multiplied by the scale in a pass of their own rather than by fla, and
    60,062 when a call from the start still handed fla a zero initial state and added a zero z to the
    denominator), in under 78 operations (83 when, besides, the denominator sent a gradient back to the
    values' weight column, the padding mask)."""
    use_stand_ins(monkeypatch)
    length = 1024
    q, k, v, _ = make_inputs(batch=1, heads=9, kv_heads=3, length=length, head_dim=64, dtype=torch.bfloat16)
    with WrittenBytes() as counter:
        out, _ = attention(*(x.requires_grad_() for x in (q, k, v)), "linear_elu", mode="chunked", return_state=False)
        out.float().sum().backward()
    assert counter.bytes / length < 60_000 + ELU_PLUS_ONE_BYTES, counter.bytes / length
    assert counter.operations < 78 + ELU_PLUS_ONE_OPERATIONS, counter.operations


#: segment length -> (segments, their length): equal segments, a multiple of gcd(length, 64), padded.
SEGMENTS = {1: (13, 1), 4: (4, 4), 5: (3, 5), 12: (2, 8), 13: (1, 13)}


@pytest.mark.parametrize("segment_length", list(SEGMENTS), ids=lambda n: f"segment_{n}")
@pytest.mark.parametrize("initial", [False, True], ids=["empty_state", "initial_state"])
@pytest.mark.parametrize("decay", [False, True], ids=["no_decay", "decay"])
def test_segments_give_the_outputs_final_state_and_gradients_of_one_pass(decay, initial, segment_length):
    """Rows of 13 cut into segments (padded where 13 does not divide), their states chained."""
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, features, width = 2, 13, 3, 4, 5

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q, k = randn(batch, length, heads, features), randn(batch, length, heads, features)
    v = randn(batch, length, heads, width)
    g = -torch.rand(batch, length, heads, generator=generator, dtype=torch.float64) if decay else None
    g = None if g is None else g.requires_grad_()
    h0 = randn(batch, heads, features, width) if initial else None
    leaves = [x for x in (q, k, v, g, h0) if x is not None]
    out_weights = randn(batch, length, heads, width).detach()
    state_weights = randn(batch, heads, features, width).detach()
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[:2])
        return chunk_simple_gla_reference(*args, **kwargs)

    def run(function):
        out, final = function(q, k, v, g=g, scale=0.7, initial_state=h0, output_final_state=True)
        loss = (out * out_weights).sum() + (final * state_weights).sum()
        return out, final, torch.autograd.grad(loss, leaves)

    whole = run(chunk_simple_gla_reference)
    split = run(lambda *args, **kwargs: chunk_in_segments(counted, *args, segment_length=segment_length, **kwargs))
    segments, size = SEGMENTS[segment_length]
    assert calls == [(batch * segments, size)]
    torch.testing.assert_close(split[0], whole[0], **TOL)
    torch.testing.assert_close(split[1], whole[1], **TOL)
    for got, want in zip(split[2], whole[2], strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_segments_are_a_multiple_of_fla_s_chunk_where_the_segment_length_allows():
    calls = []

    def counted(q, k, v, **kwargs):
        calls.append(q.shape[:2])
        return chunk_simple_gla_reference(q, k, v, **kwargs)

    q, k, v = torch.randn(1, 3000, 1, 2), torch.randn(1, 3000, 1, 2), torch.randn(1, 3000, 1, 2)
    chunk_in_segments(counted, q, k, v, segment_length=2048)
    chunk_in_segments(counted, q, k, v, segment_length=1000)  # gcd(1000, 64) = 8
    assert calls == [(2, 1536), (3, 1000)]


def test_the_state_segment_length_comes_from_the_context_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(backends.SEGMENT_ENV_VARIABLE, raising=False)
    assert backends.state_segment_length() == backends.DEFAULT_STATE_SEGMENT == 2048
    monkeypatch.setenv(backends.SEGMENT_ENV_VARIABLE, "0")
    assert backends.state_segment_length() == 0
    with backends.state_segments(512):
        assert backends.state_segment_length() == 512
    assert backends.state_segment_length() == 0


@pytest.mark.parametrize("value", ["-1", "2k", "1.5", ""])
def test_a_bad_state_segment_length_is_refused_with_its_value(value, monkeypatch):
    monkeypatch.setenv(backends.SEGMENT_ENV_VARIABLE, value)
    with pytest.raises(ValueError, match=f"HF_SOFTMAX_RNN_STATE_SEGMENT={value!r} is not allowed; expected 0"):
        backends.state_segment_length()
    with pytest.raises(ValueError, match=r"state_segments\(-3\) is not allowed"):
        with backends.state_segments(-3):
            pass

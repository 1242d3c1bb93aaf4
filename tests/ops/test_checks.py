"""Bad input to the ops raises with a message naming the value and what is allowed."""

import numpy as np
import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import RecurrentState, attention
from hf_softmax_rnn.ops.kernels import AttentionParams

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
            r"state of [\d,]+ bytes per KV head .*order-6 Taylor .* at head_dim=8",
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
    with pytest.raises(ValueError, match=r"state of 12,455,300 bytes per KV head \(47,905 features\)"):
        spec.check_mode("chunked", 64, max_state_bytes=1_000_000)
    assert spec.state_bytes(64) == (1 + 64 + 2080 + 45760) * 65 * 4


def test_a_feature_map_state_too_big_names_the_map_not_a_taylor_order():
    spec = AttentionSpec(kind="linear", feature_map="elu")
    with pytest.raises(ValueError, match=r"16,640 bytes .* elu feature map.*use mode='parallel'$") as error:
        spec.check_mode("recurrent", 64, max_state_bytes=1_000)
    assert "taylor" not in str(error.value).lower()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(q_heads=3), r"multiple of key/value heads"),
        (dict(gates={}), r"needs gates\['output'\]"),
        (dict(mask=torch.ones(2, 3)), "covers 3 positions"),
        (dict(state=True), "takes no state"),
        (dict(mask=torch.ones(2, 4, device="meta")), r"^attention_mask is on meta, q, k and v on cpu; expected one"),
    ],
    ids=["gqa_ratio", "missing_gate", "short_mask", "state_in_parallel", "mask_on_another_device"],
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


ELU = AttentionSpec.from_preset("linear_elu")
GATED_ELU = AttentionSpec.from_preset("linear_elu", output_gate=True)
WINDOW_ELU = AttentionSpec.from_preset("linear_elu", window=2)
RMS_ELU = AttentionSpec(kind="linear", feature_map="elu", normalizer="rms")


def _modified(name):
    """(q, k, v, keyword arguments) of a call with one bad argument `name`."""
    q, k, v, _ = make_inputs(length=4)
    call = dict(q=q, k=k, v=v, spec=ELU)
    bad = {
        "numpy_q": dict(q=q.numpy()),
        "int_tensors": dict(q=q.long(), k=k.long(), v=v.long()),
        "complex_tensors": dict(q=q.to(torch.complex128), k=k.to(torch.complex128), v=v.to(torch.complex128)),
        "fewer_keys_than_queries": dict(k=k[:, :, :2], v=v[:, :, :2]),
        "spec_none": dict(spec=None),
        "spec_list": dict(spec=["linear_elu"]),
        "list_mask": dict(attention_mask=[[1, 1, 1, 1]] * 2),
        "complex_mask": dict(attention_mask=torch.ones(2, 4, dtype=torch.complex64)),
        "dict_state": dict(mode="chunked", state={"packed": torch.zeros(2, 2, 8, 9)}),
        "scale_nan": dict(scale=float("nan")),
        "scale_inf": dict(scale=float("inf")),
        "scale_zero": dict(scale=0.0),
        "scale_negative": dict(scale=-0.5),
        "scale_string": dict(scale="0.5"),
        "head_dim_zero": dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]),
        "kv_heads_zero": dict(k=k[:, :0], v=v[:, :0]),
        "query_heads_zero": dict(q=q[:, :0]),
        "params_int": dict(params=3),
        "params_dict": dict(params={"linear_log_scale": None}),
        "max_state_bytes_string": dict(mode="chunked", max_state_bytes="1e9"),
        "max_state_bytes_nan": dict(mode="chunked", max_state_bytes=float("nan")),
        "max_state_bytes_negative": dict(mode="chunked", max_state_bytes=-1),
        "gates_int": dict(gates=3),
        "gates_list": dict(gates=[("output", torch.ones(2, 4, 4))]),
        "output_gate_wrong_shape": dict(spec=GATED_ELU, gates={"output": torch.rand(2, 4, 5, dtype=torch.float64)}),
        "output_gate_per_kv_head": dict(spec=GATED_ELU, gates={"output": torch.rand(2, 2, 4, dtype=torch.float64)}),
        "output_gate_not_a_tensor": dict(spec=GATED_ELU, gates={"output": [[0.5] * 4] * 4}),
        "output_gate_bool": dict(spec=GATED_ELU, gates={"output": torch.ones(2, 4, 4, dtype=torch.bool)}),
        "float32_q_float64_kv": dict(q=q.float()),
        "bfloat16_v_float32_qk": dict(q=q.float(), k=k.float(), v=v.bfloat16()),
        "float16_k": dict(k=k.half()),
        "float8_tensors": dict(q=q.to(torch.float8_e4m3fn), k=k.to(torch.float8_e4m3fn), v=v.to(torch.float8_e4m3fn)),
        "no_sequences_chunked": dict(q=q[:0], k=k[:0], v=v[:0], mode="chunked"),
        "return_state_string": dict(mode="chunked", return_state="no"),
        "update_state_in_place_int": dict(mode="recurrent", update_state_in_place=1),
        "log_scale_of_one_head": dict(
            spec=WINDOW_ELU, params=AttentionParams(linear_log_scale=torch.zeros(1, dtype=torch.float64))
        ),
        "norm_weight_one_wider": dict(
            spec=RMS_ELU, params=AttentionParams(norm_weight=torch.ones(4, 9, dtype=torch.float64))
        ),
        "norm_weight_of_one_head": dict(
            spec=RMS_ELU, params=AttentionParams(norm_weight=torch.ones(1, 8, dtype=torch.float64))
        ),
        "norm_weight_on_meta": dict(spec=RMS_ELU, params=AttentionParams(norm_weight=torch.ones(4, 8, device="meta"))),
        "seqlen_pow_without_power": dict(spec=AttentionSpec(kind="linear", feature_map="elu", normalizer="seqlen_pow")),
        "hedgehog_maps_of_another_head_size": dict(
            spec=AttentionSpec.from_preset("linear_hedgehog"),
            params=AttentionParams(hedgehog_q=torch.zeros(4, 16, 16), hedgehog_k=torch.zeros(2, 16, 16)),
            mode="chunked",
        ),
    }[name]
    return {**call, **bad}


_BAD_ARGUMENTS = [
    ("numpy_q", TypeError, "q must be a torch.Tensor; got ndarray"),
    ("int_tensors", TypeError, r"q has dtype torch.int64; expected one of \['float64', 'float32', 'bfloat16'"),
    ("float8_tensors", TypeError, r"q has dtype torch.float8_e4m3fn; expected one of \['float64'"),
    ("no_sequences_chunked", ValueError, r"have 0 sequences, 4 query heads.*expected at least 1 of each"),
    ("return_state_string", TypeError, r"return_state='no' is not allowed; expected True or False"),
    ("update_state_in_place_int", TypeError, r"update_state_in_place=1 is not allowed; expected True or False"),
    (
        "log_scale_of_one_head",
        ValueError,
        r"params.linear_log_scale has shape \(1,\); expected \[4\] \(one per query head\)",
    ),
    (
        "norm_weight_one_wider",
        ValueError,
        r"params.norm_weight has shape \(4, 9\); expected \[4, 8\] \(one per query head, by",
    ),
    ("norm_weight_of_one_head", ValueError, r"params.norm_weight has shape \(1, 8\); expected \[4, 8\]"),
    ("norm_weight_on_meta", TypeError, r"params.norm_weight must be a real floating tensor on cpu; got .* on meta"),
    ("seqlen_pow_without_power", ValueError, r"seqlen_pow normaliser needs params.seqlen_power \[H\]"),
    (
        "hedgehog_maps_of_another_head_size",
        ValueError,
        r"params.hedgehog_q has shape \(4, 16, 16\); expected \[4, 8, 8\] \(heads, head_dim, hedgehog_dim\)",
    ),
    ("complex_tensors", TypeError, "q has dtype torch.complex128"),
    ("fewer_keys_than_queries", ValueError, "got 2 keys for 4 queries"),
    ("spec_none", TypeError, "spec must be an AttentionSpec.*got None"),
    ("spec_list", TypeError, r"spec must be an AttentionSpec.*got \['linear_elu'\]"),
    ("list_mask", TypeError, "attention_mask must be a torch.Tensor.*got list"),
    ("complex_mask", TypeError, "attention_mask must hold 0/1 or bools; got dtype torch.complex64"),
    ("dict_state", TypeError, "state must be the RecurrentState.*got dict"),
    ("scale_nan", ValueError, "scale=nan is not allowed"),
    ("scale_inf", ValueError, "scale=inf is not allowed"),
    ("scale_zero", ValueError, "scale=0.0 is not allowed"),
    ("scale_negative", ValueError, "scale=-0.5 is not allowed"),
    ("scale_string", ValueError, "scale='0.5' is not allowed"),
    ("head_dim_zero", ValueError, "head_dim 0; expected at least 1 of each"),
    ("kv_heads_zero", ValueError, "0 key/value heads and head_dim 8; expected at least 1 of each"),
    ("query_heads_zero", ValueError, "0 query heads, 2 key/value heads"),
    ("params_int", TypeError, "params must be None or an AttentionParams; got int"),
    ("params_dict", TypeError, "params must be None or an AttentionParams; got dict"),
    ("max_state_bytes_string", ValueError, "max_state_bytes='1e9' is not allowed; expected a number of bytes >= 0"),
    ("max_state_bytes_nan", ValueError, "max_state_bytes=nan is not allowed"),
    ("max_state_bytes_negative", ValueError, "max_state_bytes=-1 is not allowed"),
    ("gates_int", TypeError, "gates must be None or a dict of tensors.*got int"),
    ("gates_list", TypeError, "gates must be None or a dict of tensors.*got list"),
    ("output_gate_wrong_shape", ValueError, r"gates\['output'\] has shape \(2, 4, 5\); expected .*\[2, 4, 4\]"),
    ("output_gate_per_kv_head", ValueError, r"gates\['output'\] has shape \(2, 2, 4\); expected .*\[2, 4, 4\]"),
    ("output_gate_not_a_tensor", TypeError, r"gates\['output'\] must be a real floating tensor on cpu; got list"),
    ("output_gate_bool", TypeError, r"gates\['output'\] must be a real floating tensor .*got a torch.bool tensor"),
    ("float32_q_float64_kv", TypeError, "q, k, v must have one dtype; got torch.float32, torch.float64, torch.float64"),
    ("bfloat16_v_float32_qk", TypeError, "one dtype; got torch.float32, torch.float32, torch.bfloat16"),
    ("float16_k", TypeError, "one dtype; got torch.float64, torch.float16, torch.float64"),
]


@pytest.mark.parametrize(("name", "error", "message"), [pytest.param(*case, id=case[0]) for case in _BAD_ARGUMENTS])
def test_bad_arguments_raise_naming_them(name, error, message):
    with pytest.raises(error, match=message):
        attention(**_modified(name))


def test_a_preset_name_is_accepted_as_spec():
    q, k, v, _ = make_inputs(length=4)
    torch.testing.assert_close(attention(q, k, v, "linear_elu")[0], attention(q, k, v, ELU)[0])


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")], ids=["half", "two", "minus_one", "nan"])
@pytest.mark.parametrize("mode", ["parallel", "chunked"])
def test_a_mask_with_values_other_than_0_and_1_raises(mode, value):
    q, k, v, _ = make_inputs(length=4)
    mask = torch.ones(2, 4, dtype=torch.float64)
    mask[1, 2] = value
    with pytest.raises(ValueError, match=f"attention_mask must hold only 0 .* it holds {value}"):
        attention(q, k, v, ELU, mode=mode, attention_mask=mask)


@pytest.mark.parametrize(
    ("made_with", "used_with", "differs"),
    [
        (dict(spec="linear_relu"), dict(spec="linear_elu"), "feature_map='relu' \\(here 'elu'\\)"),
        (dict(spec="linear_elu"), dict(spec=AttentionSpec.from_preset("linear_elu", input_gate=True)), "input_gate"),
        (dict(spec="linear_elu", scale=0.5), dict(spec="linear_elu", scale=0.25), "scale=0.5 \\(here 0.25\\)"),
        (dict(spec="linear_elu", heads=4), dict(spec="linear_elu", heads=2), "heads=4 \\(here 2\\)"),
    ],
    ids=["relu_state_into_elu", "ungated_state_into_gated", "other_scale", "other_query_heads"],
)
@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_a_state_made_for_another_attention_is_refused_whatever_its_shapes(mode, made_with, used_with, differs):
    q, k, v, _ = make_inputs(length=4)
    first, second = ({**dict(scale=None, heads=4), **call} for call in (made_with, used_with))
    _, state = attention(q[:, : first["heads"]], k, v, first["spec"], mode="chunked", scale=first["scale"])
    with pytest.raises(ValueError, match=f"state was made for another attention.*{differs}"):
        attention(q[:, : second["heads"]], k, v, second["spec"], mode=mode, state=state, scale=second["scale"])


def test_a_state_is_accepted_by_the_spec_that_made_it_with_another_chunk_size():
    q, k, v, _ = make_inputs(length=8)
    _, whole = attention(q, k, v, ELU, mode="chunked")
    _, half = attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], ELU, mode="chunked")
    other_chunks = AttentionSpec.from_preset("linear_elu", chunk_size=2)
    _, rest = attention(q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], other_chunks, mode="chunked", state=half)
    torch.testing.assert_close(rest.packed, whole.packed)


@pytest.mark.parametrize(
    "scale", [np.float32(0.5), np.float64(0.5), np.int64(2)], ids=["numpy_float32", "numpy_float64", "numpy_int64"]
)
@pytest.mark.parametrize("mode", ["parallel", "chunked"])
def test_a_numpy_scale_is_taken_as_the_python_number(mode, scale):
    q, k, v, _ = make_inputs(length=4)
    got, state = attention(q, k, v, ELU, mode=mode, scale=scale)
    want, want_state = attention(q, k, v, ELU, mode=mode, scale=float(scale))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert state is None or state.made_by == want_state.made_by


def test_mixed_float_dtypes_are_taken_under_autocast_in_their_promoted_dtype():
    """Under bf16 autocast q and k leave RoPE in float32 while v is bf16: as autocast lets SDPA take them, they
    are computed as float32 throughout (outside autocast they are refused, see above)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = attention(q, k, v, "linear_elu", mode="chunked")
    want, _ = attention(q, k, v.float(), "linear_elu", mode="chunked", io_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


DECAY_ELU = AttentionSpec(kind="linear", feature_map="elu", decay=True)
DELTA_ELU = AttentionSpec(kind="linear", feature_map="elu", normalizer="l2", delta_rule=True)
_BAD_GATE_VALUES = [
    (GATED_ELU, "output", -0.5, r"gates\['output'\] holds -0.5 at .* = \[1, 3, 3\]; expected sigmoid gate values in"),
    (GATED_ELU, "output", 1.5, r"gates\['output'\] holds 1.5 .*; expected sigmoid gate values in \[0, 1\]"),
    (GATED_ELU, "output", float("nan"), r"gates\['output'\] holds nan "),
    (DECAY_ELU, "decay", 0.25, r"gates\['decay'\] holds 0.25 at .* = \[1, 1, 3\]; expected log-decays <= 0"),
    (DECAY_ELU, "decay", float("inf"), r"gates\['decay'\] holds inf .*; expected log-decays <= 0"),
    (DECAY_ELU, "decay", float("nan"), r"gates\['decay'\] holds nan .*; expected log-decays <= 0"),
    (
        DELTA_ELU,
        "delta",
        -0.1,
        r"gates\['delta'\] holds -0.1 at .* = \[1, 1, 3\]; expected write strengths in \[0, 1\]",
    ),
    (DELTA_ELU, "delta", 2.0, r"gates\['delta'\] holds 2.0 .*; expected write strengths in \[0, 1\]"),
    (DELTA_ELU, "delta", float("nan"), r"gates\['delta'\] holds nan "),
]


@pytest.mark.parametrize(
    ("spec", "name", "value", "message"),
    _BAD_GATE_VALUES,
    ids=[f"{name}={value}" for _, name, value, _ in _BAD_GATE_VALUES],
)
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_a_gate_value_outside_its_range_is_refused_naming_it(mode, spec, name, value, message):
    q, k, v, _ = make_inputs(length=4)
    heads = q.shape[1] if name == "output" else k.shape[1]
    gates = {"output": torch.rand(2, 4, 4, dtype=torch.float64)} if spec.output_gate else {}
    gates[name] = torch.rand(2, heads, 4, dtype=torch.float64) * (-1.0 if name == "decay" else 1.0)
    gates[name][1, heads - 1 if name == "output" else 1, 3] = value
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, spec, mode=mode, gates=gates)


@pytest.mark.parametrize(
    ("spec", "name"),
    [(GATED_ELU, "output"), (DECAY_ELU, "decay"), (DELTA_ELU, "delta")],
    ids=["output", "decay", "delta"],
)
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_gate_values_at_padding_and_at_the_ends_of_their_range_are_taken(mode, spec, name):
    """Padding is never read, so a gate may hold anything there (NaN: the output at the tokens is that of a gate
    in range there); 0 and 1 (-inf and 0 for log-decays) are in range."""
    q, k, v, _ = make_inputs(length=4)
    heads = q.shape[1] if name == "output" else k.shape[1]
    ends = (float("-inf"), 0.0) if name == "decay" else (0.0, 1.0)
    clean = torch.tensor(ends, dtype=torch.float64).repeat(2, heads, 2)
    dirty = clean.clone()
    dirty[1, :, 0] = float("nan")
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    want, _ = attention(q, k, v, spec, mode=mode, gates={name: clean}, attention_mask=mask)
    got, _ = attention(q, k, v, spec, mode=mode, gates={name: dirty}, attention_mask=mask)
    tokens = mask.bool()[:, None, :, None].expand_as(got)
    assert torch.isfinite(want[tokens]).all()
    torch.testing.assert_close(got[tokens], want[tokens], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_an_output_gate_for_a_spec_without_one_is_refused(mode):
    """It would not be applied: the output is that of the ungated spec."""
    q, k, v, _ = make_inputs(length=4)
    with pytest.raises(ValueError, match=r"has output_gate=False, so it takes gates\['output'\] only with output_gate"):
        attention(q, k, v, ELU, mode=mode, gates={"output": torch.rand(2, 4, 4, dtype=torch.float64)})


@pytest.mark.parametrize(
    ("maps", "message"),
    [
        (
            torch.ones(4, 8, 8, dtype=torch.long),
            r"params.hedgehog_q must be a real floating tensor on cpu; got a torch",
        ),
        ([[0.5] * 8] * 8, r"params.hedgehog_q must be a real floating tensor on cpu; got list"),
        (torch.ones(4, 8, 8, dtype=torch.float64, device="meta"), r"hedgehog_q must be .* on cpu; got .* on meta"),
    ],
    ids=["int_maps", "list_maps", "maps_on_meta"],
)
def test_hedgehog_maps_of_another_kind_are_refused(maps, message):
    q, k, v, _ = make_inputs(length=4)
    params = AttentionParams(hedgehog_q=maps, hedgehog_k=torch.ones(2, 8, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=message):
        attention(q, k, v, AttentionSpec(kind="linear", feature_map="hedgehog"), params=params)

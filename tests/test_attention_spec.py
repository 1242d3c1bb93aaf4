"""AttentionSpec: presets, dict round trip and validation messages."""

import dataclasses
import math
import warnings

import numpy as np
import pytest

from hf_softmax_rnn import PRESETS, AttentionSpec
from hf_softmax_rnn.attention_spec import taylor_feature_dim


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_describes_and_round_trips(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = AttentionSpec.from_preset(name)
        assert AttentionSpec.from_dict(spec.to_dict()) == spec
    assert PRESETS[name] and spec.describe()


def test_headline_preset_is_exp_with_l2_norm():
    spec = AttentionSpec.from_preset("gated_softmax_no_gate_L2norm_nodivS_noclamp")
    assert (spec.kind, spec.taylor_order, spec.normalizer, spec.score_clamp) == ("recurrent_softmax", None, "l2", None)
    assert spec.is_exact_exp and not spec.has_finite_state


def test_preset_overrides_and_coerce():
    spec = AttentionSpec.from_preset("linear_elu", chunk_size=16)
    assert spec.chunk_size == 16 and spec.feature_map == "elu"
    assert AttentionSpec.coerce("linear_elu") == AttentionSpec.from_preset("linear_elu")
    assert AttentionSpec.coerce(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="quadratic"), r"kind='quadratic' is not allowed; expected one of \['softmax'"),
        (dict(kind="softmax", feature_map="elu"), r"feature_map='elu' is not allowed with kind='softmax'"),
        (dict(kind="softmax", normalizer="l2"), r"normalizer='l2' is not allowed with kind='softmax'"),
        (dict(kind="linear"), r"feature_map=None is not allowed with kind='linear'"),
        (dict(kind="linear", feature_map="taylor"), r"taylor_order=None is not allowed with feature_map='taylor'"),
        (
            dict(kind="linear", feature_map="elu", taylor_order=2),
            r"taylor_order=2 is not allowed with feature_map='elu'",
        ),
        (
            dict(kind="recurrent_softmax", feature_map="relu"),
            r"feature_map='relu' is not allowed with kind='recurrent_softmax'",
        ),
        (dict(kind="recurrent_softmax", normalizer="l3"), r"normalizer='l3' is not allowed; expected one of"),
        (dict(kind="recurrent_softmax", taylor_order=-1), r"taylor_order=-1 is not allowed"),
        (dict(chunk_size=0), r"chunk_size=0 is not allowed"),
        (dict(kind="linear", feature_map="elu", output_gate_position="middle"), r"output_gate_position='middle'"),
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 20 else None,
)
def test_invalid_fields_name_value_and_choices(fields, message):
    with pytest.raises(ValueError, match=message):
        AttentionSpec(**fields)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match=r"Unknown attention preset 'softmax_v9'; expected one of"):
        AttentionSpec.from_preset("softmax_v9")
    with pytest.raises(ValueError, match=r"unknown fields \['heads'\]"):
        AttentionSpec.from_dict({"kind": "softmax", "heads": 3})


def test_odd_taylor_order_with_denominator_warns():
    with pytest.warns(UserWarning, match="taylor_order=3 is odd"):
        AttentionSpec(kind="recurrent_softmax", taylor_order=3, normalizer="softmax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AttentionSpec(kind="recurrent_softmax", taylor_order=3, normalizer="l2")


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (dict(kind="softmax", window=0), ValueError, r"window=0 is not allowed; expected None or an int >= 1"),
        (dict(kind="softmax", window=3, sinks=1), ValueError, r"sinks=1 is not allowed with exact softmax attention"),
        (dict(kind="recurrent_softmax", normalizer="l2", window=3), ValueError, "Use kind='softmax' for sliding"),
        (
            dict(kind="linear", feature_map="elu", window=0),
            ValueError,
            r"window=0 is not allowed; expected None or an int >= 1",
        ),
        (dict(kind="linear", feature_map="elu", window=True), TypeError, "window=True has type bool"),
        (dict(kind="linear", feature_map="elu", window=2.5), TypeError, "window=2.5 has type float"),
        (
            dict(kind="linear", feature_map="elu", window=4, normalizer="seqlen"),
            ValueError,
            "normalizer='seqlen' is not allowed with window=4",
        ),
        (dict(kind="linear", feature_map="elu", input_gate="false"), TypeError, "input_gate='false' has type str"),
        (dict(kind="linear", feature_map="elu", chunk_size=8.0), TypeError, "chunk_size=8.0 has type float"),
    ],
    ids=[
        "softmax-zero",
        "softmax-sinks",
        "exact-exp",
        "zero",
        "bool",
        "float",
        "non-invariant-norm",
        "string-bool",
        "float-int",
    ],
)
def test_window_and_field_types_are_validated(fields, error, message):
    with pytest.raises(error, match=message):
        AttentionSpec(**fields)


def test_a_softmax_window_is_sliding_window_softmax_decoded_from_a_kv_cache():
    spec = AttentionSpec(window=8)
    assert spec.describe() == "exact softmax attention over the last 8 positions"
    assert not spec.fits_recurrent_state(64) and spec.exact_positions == 8
    with pytest.raises(ValueError, match="needs a finite state"):
        spec.check_mode("chunked", 64)


def test_window_presets_describe_and_size_their_state():
    spec = AttentionSpec.from_preset("hedgehog_window_64")
    assert "exact exp over the last 64 positions" in spec.describe()
    assert spec.state_bytes(64) == (128 * 65 + 64 * (64 + 65)) * 4
    assert AttentionSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(dict(norm_eps=float("inf")), r"norm_eps=inf is not allowed; expected a finite", id="norm_eps_inf"),
        pytest.param(dict(norm_eps=float("nan")), r"norm_eps=nan is not allowed", id="norm_eps_nan"),
        pytest.param(dict(taylor_order=10**9), r"taylor_order=1000000000 is not allowed.* 0 to 1024", id="order_1e9"),
        pytest.param(dict(taylor_order=1025), r"taylor_order=1025 is not allowed", id="order_1025"),
    ],
)
def test_values_that_cannot_be_computed_are_refused_at_construction(fields, message):
    """An infinite eps gives all-zero outputs; a huge Taylor order a call that does not return."""
    with pytest.raises(ValueError, match=message):
        AttentionSpec(kind="recurrent_softmax", **fields)


@pytest.mark.parametrize("order", [0, 2, 7], ids=lambda order: f"order_{order}")
def test_taylor_feature_dim_is_the_count_of_monomials(order):
    monomials = sum(math.comb(8 + n - 1, n) for n in range(order + 1))
    assert taylor_feature_dim(8, order) == monomials


def test_the_largest_taylor_order_states_its_size_quickly():
    spec = AttentionSpec(kind="recurrent_softmax", taylor_order=1024, normalizer="l2")
    assert not spec.fits_recurrent_state(64)
    with pytest.raises(ValueError, match=r"state of [\d,]+ bytes per KV head .*order-1024 Taylor .* at head_dim=64"):
        spec.check_mode("chunked", 64)


_ELU_WINDOW = dict(kind="linear", feature_map="elu", window=4)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({**_ELU_WINDOW, "sinks": 0}, ValueError, r"sinks=0 is not allowed; expected None or an int >= 1"),
        ({**_ELU_WINDOW, "sinks": -2}, ValueError, r"sinks=-2 is not allowed; expected None or an int >= 1"),
        ({**_ELU_WINDOW, "sinks": 2.0}, TypeError, "sinks=2.0 has type float; expected None or an int"),
        ({**_ELU_WINDOW, "sinks": True}, TypeError, "sinks=True has type bool"),
        (dict(kind="linear", feature_map="elu", sinks=4), ValueError, "sinks=4 is not allowed with linear attention"),
        (dict(kind="softmax", sinks=4), ValueError, "sinks=4 is not allowed with exact softmax"),
        (dict(kind="recurrent_softmax", normalizer="l2", sinks=4), ValueError, "set window"),
    ],
    ids=["zero", "negative", "float", "bool", "no-window", "softmax", "exact-exp"],
)
def test_sinks_are_validated(fields, error, message):
    with pytest.raises(error, match=message):
        AttentionSpec(**fields)


def test_sink_presets_describe_and_size_their_state():
    spec = AttentionSpec.from_preset("hedgehog_window_64_sinks_4")
    assert "exact exp over the last 64 positions and the first 4" in spec.describe()
    assert spec.state_bytes(64) == (128 * 65 + (64 + 4) * (64 + 65)) * 4
    assert AttentionSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (dict(kind="softmax", decay=True), ValueError, "decay=True is not allowed with exact softmax attention"),
        (dict(kind="recurrent_softmax", normalizer="l2", decay=True), ValueError, "expected decay=False, or a finite"),
        (
            dict(kind="recurrent_softmax", score_clamp=5.0, normalizer="seqlen", decay=True),
            ValueError,
            "does not have",
        ),
        (dict(kind="linear", feature_map="elu", decay=1), TypeError, "decay=1 has type int; expected true or false"),
    ],
    ids=["softmax", "exact-exp", "clamped", "int"],
)
def test_decay_is_validated(fields, error, message):
    with pytest.raises(error, match=message):
        AttentionSpec(**fields)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (
            dict(kind="linear", feature_map="elu", short_conv=1),
            ValueError,
            r"short_conv=1 is not allowed; expected None or an int >= 2",
        ),
        (dict(kind="linear", feature_map="elu", short_conv=-3), ValueError, r"short_conv=-3 is not allowed"),
        (
            dict(kind="linear", feature_map="elu", short_conv=4.0),
            TypeError,
            "short_conv=4.0 has type float; expected None or an int",
        ),
        (dict(kind="softmax", short_conv=4), ValueError, "short_conv=4 is not allowed with exact softmax attention"),
        (
            dict(kind="recurrent_softmax", normalizer="l2", short_conv=4),
            ValueError,
            "expected short_conv=None, or a finite",
        ),
    ],
    ids=["one", "negative", "float", "softmax", "exact-exp"],
)
def test_short_conv_is_validated(fields, error, message):
    with pytest.raises(error, match=message):
        AttentionSpec(**fields)


def test_short_conv_presets_describe_and_size_their_state():
    spec = AttentionSpec.from_preset("deltanet_conv")
    assert "short convolution of width 4" in spec.describe()
    without = AttentionSpec.from_preset("deltanet")
    assert spec.state_bytes(64) == without.state_bytes(64) + 3 * (64 + 64) * 4  # the last 3 keys and values
    assert AttentionSpec.from_dict(spec.to_dict()) == spec


def test_decay_preset_describes_itself():
    spec = AttentionSpec.from_preset("hedgehog_window_64_sinks_4_decay")
    assert spec.decay and "data-dependent decay of the state" in spec.describe()
    assert spec.state_bytes(64) == AttentionSpec.from_preset("hedgehog_window_64_sinks_4").state_bytes(64)
    assert "data-dependent decay" in AttentionSpec(kind="linear", feature_map="elu", decay=True).describe()


def test_a_spec_is_frozen_and_a_changed_copy_is_validated():
    """Assigning to a field once ran unchecked (`window = -5`, `feature_map = "gelu"` failing deep in the ops)."""
    spec = AttentionSpec.from_preset("hedgehog_window_64")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'window'"):
        spec.window = -5
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'feature_map'"):
        spec.feature_map = "gelu"
    assert spec.window == 64 and spec.feature_map == "hedgehog"
    with pytest.raises(ValueError, match=r"AttentionSpec.window=-5 is not allowed; expected None or an int >= 1"):
        dataclasses.replace(spec, window=-5)
    assert dataclasses.replace(spec, window=8).window == 8


@pytest.mark.parametrize("data", [None, ["kind", "linear"], "linear_elu"], ids=["none", "list", "string"])
def test_from_dict_refuses_what_is_not_a_dict(data):
    with pytest.raises(
        TypeError, match=f"AttentionSpec.from_dict takes a dict of spec fields; got {type(data).__name__}"
    ):
        AttentionSpec.from_dict(data)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (dict(head_dim=0), ValueError, r"^head_dim=0 is not allowed; expected an int >= 1"),
        (dict(head_dim=-1), ValueError, r"^head_dim=-1 is not allowed"),
        (dict(head_dim="64"), TypeError, r"^head_dim='64' has type str; expected an int >= 1"),
        (dict(head_dim=64.0), TypeError, r"^head_dim=64\.0 has type float"),
        (dict(head_dim=64, value_dim=0), ValueError, r"^value_dim=0 is not allowed"),
        (dict(head_dim=64, bytes_per_element=0), ValueError, r"^bytes_per_element=0 is not allowed"),
    ],
    ids=["zero", "negative", "string", "float", "zero-value-dim", "zero-bytes"],
)
def test_state_sizes_refuse_a_head_size_that_is_no_positive_int(arguments, error, message):
    spec = AttentionSpec.from_preset("hedgehog_window_64_sinks_4")
    with pytest.raises(error, match=message):
        spec.state_bytes(**arguments)
    if set(arguments) == {"head_dim"}:
        check_chunked = lambda head_dim: spec.check_mode("chunked", head_dim)  # noqa: E731
        for sized in (spec.feature_dim, spec.fits_recurrent_state, check_chunked):
            with pytest.raises(error, match=message):
                sized(**arguments)


@pytest.mark.parametrize(
    "fields",
    [
        dict(kind="linear", feature_map="elu", output_gate_position="before_norm"),
        dict(kind="recurrent_softmax", normalizer="l2", output_gate_position="before_norm"),
        dict(output_gate_position="before_norm"),
    ],
    ids=["linear", "recurrent_softmax", "softmax"],
)
def test_an_output_gate_position_without_an_output_gate_is_refused(fields):
    with pytest.raises(ValueError, match=r"output_gate_position='before_norm' is not allowed with output_gate=False"):
        AttentionSpec(**fields)


@pytest.mark.parametrize(
    ("field", "value", "python"),
    [
        ("score_clamp", np.float32(5.5), 5.5),
        ("score_clamp", np.float64(5.5), 5.5),
        ("score_clamp", np.int64(5), 5),
        ("qk_scale", np.float32(0.5), 0.5),
        ("norm_eps", np.float64(1e-5), 1e-5),
        ("chunk_size", np.int32(16), 16),
        ("window", np.int64(8), 8),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_a_numpy_scalar_field_is_the_python_number_it_equals(field, value, python):
    """Taken as that number: the same spec, dict and description (np.float32 and np.int64 were refused as not
    numbers, and np.float64 kept, printing as np.float64(5.5) in the description)."""
    base = dict(kind="linear", feature_map="elu") if field == "window" else dict(kind="recurrent_softmax")
    got = AttentionSpec(**base, **{field: value})
    want = AttentionSpec(**base, **{field: python})
    assert got == want and type(getattr(got, field)) is type(python)
    assert got.to_dict() == want.to_dict() and got.describe() == want.describe()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("score_clamp", np.array(5.0), r"score_clamp=array\(5\.\) has type ndarray; expected None or a number"),
        ("score_clamp", np.array([5.0]), r"score_clamp=array\(\[5\.\]\) has type ndarray"),
        ("score_clamp", np.float64("nan"), r"score_clamp=nan is not allowed; expected None or a finite float"),
        ("chunk_size", np.float64(16.0), r"chunk_size=np.float64\(16.0\) has type float64; expected an int"),
        ("output_gate", np.bool_(True), r"output_gate=np.True_ has type bool; expected true or false"),
    ],
    ids=["zero_d_array", "array", "numpy_nan", "float_chunk_size", "numpy_bool"],
)
def test_numpy_arrays_and_values_of_another_kind_are_refused(field, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        AttentionSpec(kind="recurrent_softmax", **{field: value})


def test_an_unknown_preset_override_is_named_with_the_fields():
    with pytest.raises(
        ValueError, match=r"unknown fields \['colour'\]; allowed fields are \['additive_mass', 'chunk_size'"
    ):
        AttentionSpec.from_preset("linear_elu", colour=2)
    with pytest.raises(ValueError, match=r"Unknown attention preset \['linear_elu'\]; expected one of"):
        AttentionSpec.from_preset(["linear_elu"])

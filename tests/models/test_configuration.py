"""The softmax_rnn configs: attention fields, validation through AttentionSpec, JSON round trip."""

import json

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, GPT2Config, LlamaConfig

from hf_softmax_rnn import AttentionSpec, SoftmaxRNNGPT2Config, SoftmaxRNNLlamaConfig
from hf_softmax_rnn.layers import RECURRENT_LAYER_TYPE

from .helpers import LLAMA_SHAPE

LLAMA = {**LLAMA_SHAPE, "num_hidden_layers": 3}
GPT2 = dict(n_embd=32, n_layer=3, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0)
CONFIGS = {"llama": (SoftmaxRNNLlamaConfig, LLAMA), "gpt2": (SoftmaxRNNGPT2Config, GPT2)}


@pytest.fixture(params=sorted(CONFIGS))
def make_config(request):
    config_class, kwargs = CONFIGS[request.param]
    return lambda **extra: config_class(**kwargs, **extra)


@pytest.mark.parametrize(
    "value",
    [AttentionSpec.from_preset("linear_elu"), AttentionSpec.from_preset("linear_elu").to_dict(), "linear_elu"],
    ids=["spec", "dict", "preset"],
)
def test_attention_accepts_spec_dict_or_preset_and_stores_a_dict(make_config, value):
    config = make_config(attention=value)
    assert config.attention == AttentionSpec.from_preset("linear_elu").to_dict()
    assert all(config.attention_spec(i) == AttentionSpec.from_preset("linear_elu") for i in range(3))


def test_default_attention_is_exact_softmax(make_config):
    assert make_config().attention_spec(0) == AttentionSpec.from_preset("softmax")


def test_layer_overrides_make_a_hybrid_with_matching_cache_layer_types(make_config):
    config = make_config(attention="softmax_taylor_2", layer_attention={1: "softmax", "2": "gated_softmax"})
    assert [config.attention_spec(i) for i in range(3)] == [
        AttentionSpec.from_preset(name) for name in ("softmax_taylor_2", "softmax", "gated_softmax")
    ]
    assert config.layer_types == [RECURRENT_LAYER_TYPE, "full_attention", "full_attention"]
    assert sorted(config.layer_attention) == ["1", "2"]


def test_fields_assigned_after_construction_are_normalised_like_construction(make_config):
    config = make_config(attention="linear_elu")
    config.attention = AttentionSpec.from_preset("linear_hedgehog")
    config.layer_attention = {1: "softmax", "2": AttentionSpec.from_preset("softmax_taylor_2")}
    assert config.attention == AttentionSpec.from_preset("linear_hedgehog").to_dict()
    assert [config.attention_spec(i) for i in range(3)] == [
        AttentionSpec.from_preset(name) for name in ("linear_hedgehog", "softmax", "softmax_taylor_2")
    ]
    assert config.to_dict()["layer_attention"] == {
        "1": AttentionSpec.from_preset("softmax").to_dict(),
        "2": AttentionSpec.from_preset("softmax_taylor_2").to_dict(),
    }


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("attention", "no_such_preset", "Unknown attention preset 'no_such_preset'"),
        ("layer_attention", {3: "softmax"}, "key 3; expected layer indices in 0..2"),
        ("layer_attention", {0: {"kind": "linear"}}, "feature_map=None is not allowed"),
    ],
    ids=["unknown-preset", "layer-out-of-range", "invalid-spec"],
)
def test_bad_assignment_raises_naming_the_value_and_keeps_the_old_one(make_config, field, value, message):
    config = make_config(attention="linear_elu")
    with pytest.raises(ValueError, match=message):
        setattr(config, field, value)
    assert config.attention_spec(0) == AttentionSpec.from_preset("linear_elu")


@pytest.mark.parametrize("key", [1, "1"], ids=["int-key", "str-key"])
def test_from_pretrained_keyword_overrides_reach_the_layers(make_config, tmp_path, key):
    make_config(attention="linear_elu").save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path, layer_attention={key: "softmax"}, attention="linear_hedgehog")
    assert [loaded.attention_spec(i) for i in range(3)] == [
        AttentionSpec.from_preset(name) for name in ("linear_hedgehog", "softmax", "linear_hedgehog")
    ]


@pytest.mark.parametrize(
    ("layer_attention", "expected"),
    [
        (None, "all 3 layers: E"),
        ({1: "softmax"}, "layers 0, 2: E; layer 1: S"),
        ({0: "softmax", 1: "softmax"}, "layers 0-1: S; layer 2: E"),
    ],
    ids=["one-spec", "split-run", "one-run"],
)
def test_attention_summary_names_layer_ranges(make_config, layer_attention, expected):
    config = make_config(attention="linear_elu", layer_attention=layer_attention)
    names = {
        "E": AttentionSpec.from_preset("linear_elu").describe(),
        "S": AttentionSpec.from_preset("softmax").describe(),
    }
    assert config.attention_summary() == expected.replace(": E", ": " + names["E"]).replace(": S", ": " + names["S"])


@pytest.mark.filterwarnings("ignore:AttentionSpec.taylor_order=79 is odd")
def test_state_too_large_for_the_head_size_decodes_from_a_kv_cache(make_config):
    config = make_config(attention="softmax_taylor_80terms")
    assert config.attention_spec(0).has_finite_state
    assert config.layer_types == ["full_attention"] * 3


def test_json_round_trip_through_auto_config(make_config, tmp_path):
    config = make_config(attention="linear_hedgehog", layer_attention={0: "softmax"}, attention_mode="chunked")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(config)
    assert {**loaded.to_dict(), "_name_or_path": ""} == config.to_dict()
    assert [loaded.attention_spec(i) for i in range(3)] == [config.attention_spec(i) for i in range(3)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"attention": "no_such_preset"}, "Unknown attention preset 'no_such_preset'"),
        ({"attention": {"kind": "linear"}}, "feature_map=None is not allowed"),
        ({"attention": {"kind": "softmax", "bogus": 1}}, "unknown fields \\['bogus'\\]"),
        ({"layer_attention": {3: "softmax"}}, "key 3; expected layer indices in 0..2"),
        ({"layer_attention": {"first": "softmax"}}, "key 'first'"),
        ({"layer_attention": {1.5: "softmax"}}, "key 1.5"),
        ({"attention_mode": "recurrent"}, "attention_mode='recurrent' is not allowed"),
    ],
    ids=[
        "unknown-preset",
        "invalid-spec",
        "unknown-field",
        "layer-out-of-range",
        "layer-not-an-int",
        "layer-float",
        "bad-mode",
    ],
)
def test_bad_attention_fields_raise_naming_the_value(make_config, extra, message):
    with pytest.raises(ValueError, match=message):
        make_config(**extra)


SPEC_WORDS = "expected a preset name, a dict of AttentionSpec fields or an AttentionSpec"
LAYER_MAPPING = "expected None or a mapping of layer index to spec"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"layer_attention": ["softmax", "linear_elu", "softmax"]},
            f"layer_attention=\\[.*\\] has type list; {LAYER_MAPPING}",
        ),
        ({"layer_attention": "softmax"}, f"layer_attention='softmax' has type str; {LAYER_MAPPING}"),
        ({"layer_attention": {"1": None}}, f"layer_attention\\['1'\\]=None has type NoneType; {SPEC_WORDS}"),
        ({"layer_attention": {1: 3}}, f"layer_attention\\[1\\]=3 has type int; {SPEC_WORDS}"),
        ({"attention": 3}, "attention=3 has type int; expected None \\(exact softmax\\), a preset name"),
        ({"attention": ["linear_elu"]}, "attention=\\['linear_elu'\\] has type list; expected None"),
    ],
    ids=["layer-list", "layer-string", "layer-spec-none", "layer-spec-int", "attention-int", "attention-list"],
)
def test_wrongly_typed_attention_fields_raise_naming_the_field(make_config, extra, message):
    with pytest.raises(TypeError, match=message):
        make_config(**extra)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"layer_attention": ["linear_elu"]}, f"layer_attention=\\['linear_elu'\\] has type list; {LAYER_MAPPING}"),
        ({"layer_attention": {"0": None}}, f"layer_attention\\['0'\\]=None has type NoneType; {SPEC_WORDS}"),
        ({"attention": 3}, "attention=3 has type int"),
    ],
    ids=["layer-list", "layer-spec-null", "attention-int"],
)
def test_an_edited_config_json_with_a_wrongly_typed_field_is_refused_naming_it(make_config, tmp_path, edit, message):
    make_config(attention="linear_elu").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(TypeError, match=message):
        AutoConfig.from_pretrained(tmp_path)


def test_attention_null_in_config_json_is_documented_exact_softmax(make_config, tmp_path):
    """`"attention": null` is the field's default, exact softmax (an unconverted model), as the config
    classes and docs/models.md say."""
    make_config(attention="linear_elu").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "attention": None}))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert [loaded.attention_spec(i) for i in range(3)] == [AttentionSpec.from_preset("softmax")] * 3


def test_attention_spec_of_a_missing_layer_raises(make_config):
    with pytest.raises(ValueError, match="key 7"):
        make_config().attention_spec(7)


def test_gpt2_cross_attention_is_rejected():
    with pytest.raises(
        (ValueError, StrictDataclassClassValidationError), match="add_cross_attention=True is not supported"
    ):
        SoftmaxRNNGPT2Config(**GPT2, add_cross_attention=True)


@pytest.mark.parametrize(
    "saved, loading",
    [("gpt2", SoftmaxRNNLlamaConfig), ("llama", SoftmaxRNNGPT2Config)],
    ids=["gpt2-as-llama", "llama-as-gpt2"],
)
def test_a_config_of_another_family_is_refused_naming_both_model_types(tmp_path, saved, loading):
    """transformers only warns and builds the class from another model's fields and its own defaults (a
    converted GPT-2 loaded as Llama became a 7B model's allocation)."""
    config_class, kwargs = CONFIGS[saved]
    config_class(**kwargs, attention="linear_elu").save_pretrained(tmp_path)
    given = json.loads((tmp_path / "config.json").read_text())["model_type"]
    with pytest.raises(
        ValueError,
        match=rf"model_type '{given}' cannot load as {loading.__name__}; expected model_type '{loading.model_type}'",
    ):
        loading.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_unconverted_checkpoint_loads_with_exact_softmax_and_the_converted_model_type(tmp_path, name):
    config_class, kwargs = CONFIGS[name]
    {"llama": LlamaConfig, "gpt2": GPT2Config}[name](**kwargs).save_pretrained(tmp_path)
    config = config_class.from_pretrained(tmp_path)
    assert config.model_type == config_class.model_type
    assert config.attention_spec(0) == AttentionSpec.from_preset("softmax")
    assert config.num_hidden_layers == 3

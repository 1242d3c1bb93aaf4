"""convert(): pretrained Llama / GPT-2 -> softmax_rnn models with the same weights."""

import math

import pytest
import torch
from transformers import BertConfig, BertLMHeadModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import AttentionSpec, SoftmaxRNNGPT2LMHeadModel, SoftmaxRNNLlamaForCausalLM, convert
from hf_softmax_rnn.layers import RNNParams, softmax_rnn_attention_modules
from hf_softmax_rnn.layers.attention import decay_half_lives

from .models.helpers import LLAMA_SHAPE

SOURCES = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(**LLAMA_SHAPE | dict(num_hidden_layers=3, tie_word_embeddings=True, pad_token_id=0))
    ),
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(
            n_embd=32,
            n_layer=3,
            n_head=4,
            vocab_size=64,
            n_positions=64,
            scale_attn_by_inverse_layer_idx=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    ),
}
TARGETS = {"llama": SoftmaxRNNLlamaForCausalLM, "gpt2": SoftmaxRNNGPT2LMHeadModel}


@pytest.fixture(params=sorted(SOURCES))
def family(request):
    return request.param


def batch():
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


def test_softmax_conversion_reproduces_the_original_logits(family):
    source = SOURCES[family]().eval()
    converted = convert(source, "softmax")
    assert type(converted) is TARGETS[family]
    ids, mask = batch()
    visible = mask.bool()
    difference = (logits(converted, ids, mask) - logits(source, ids, mask))[visible].abs().max()
    assert difference <= 1e-4


def test_conversion_from_a_checkpoint_directory(family, tmp_path):
    source = SOURCES[family]().eval()
    source.save_pretrained(tmp_path)
    converted = convert(tmp_path, "softmax")
    ids, mask = batch()
    visible = mask.bool()
    torch.testing.assert_close(
        logits(converted, ids, mask)[visible], logits(source, ids, mask)[visible], atol=1e-4, rtol=0
    )


def test_weights_are_copied_and_new_parameters_are_the_only_additions(family):
    source = SOURCES[family]()
    converted = convert(source, "gated_softmax")
    original, new = source.state_dict(), converted.state_dict()
    assert all(torch.equal(new[name], tensor) for name, tensor in original.items())
    added = {name for name in new if name not in original}
    assert added and added == {name for name in new if ".rnn_params." in name}
    next(converted.parameters()).data.add_(1.0)
    assert all(torch.equal(tensor, source.state_dict()[name]) for name, tensor in original.items())


def test_config_generation_config_dtype_and_mode_carry_over(family):
    source = SOURCES[family]().to(torch.bfloat16).train()
    source.generation_config.max_new_tokens = 17
    converted = convert(source, "linear_elu", attention_mode="chunked")
    assert converted.dtype == torch.bfloat16 and converted.training
    assert converted.generation_config.max_new_tokens == 17
    assert converted.config.attention_mode == "chunked"
    fields = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "pad_token_id",
        "tie_word_embeddings",
    )
    assert {f: getattr(converted.config, f) for f in fields} == {f: getattr(source.config, f) for f in fields}
    assert all(torch.equal(converted.state_dict()[name], tensor) for name, tensor in source.state_dict().items())


def test_listed_layers_are_converted_and_the_rest_keep_softmax(family):
    converted = convert(SOURCES[family](), "softmax_taylor_2", layers=[0, 2])
    specs = [module.attention_spec for module in softmax_rnn_attention_modules(converted)]
    assert specs == [AttentionSpec.from_preset(name) for name in ("softmax_taylor_2", "softmax", "softmax_taylor_2")]
    assert converted.config.layer_types == ["softmax_rnn_recurrent", "full_attention", "softmax_rnn_recurrent"]


def test_layer_attention_gives_converted_layers_their_own_spec(family):
    spec = AttentionSpec.from_preset("hedgehog_window_64_sinks_4")
    wider = AttentionSpec.from_preset("hedgehog_window_64_sinks_4", window=6)
    converted = convert(SOURCES[family](), spec, layers=[1, 2], layer_attention={2: wider})
    specs = [module.attention_spec for module in softmax_rnn_attention_modules(converted)]
    assert specs == [AttentionSpec.from_preset("softmax"), spec, wider]
    assert [converted.config.attention_spec(i) for i in range(3)] == specs


@pytest.mark.parametrize(
    ("layers", "layer_attention", "message"),
    [
        (None, {3: "linear_elu"}, r"names layers \[3\]; expected indices of converted layers \[0, 1, 2\]"),
        ([0, 2], {1: "linear_elu"}, r"names layers \[1\]; expected indices of converted layers \[0, 2\]"),
        (None, {"1": "linear_elu"}, r"names layers \['1'\]"),
    ],
    ids=["out-of-range", "unconverted", "string-key"],
)
def test_layer_attention_outside_the_converted_layers_raises(layers, layer_attention, message):
    with pytest.raises(ValueError, match=message):
        convert(SOURCES["llama"](), "linear_elu", layers=layers, layer_attention=layer_attention)


def test_new_parameters_start_at_their_documented_initialisation(family):
    converted = convert(SOURCES[family](), "gated_softmax")
    params = [module for module in converted.modules() if isinstance(module, RNNParams)]
    assert len(params) == 3
    for module in params:
        expected = RNNParams(AttentionSpec.from_preset("gated_softmax"), 4, module.input_gate.out_features, 8, 32)
        assert all(
            torch.equal(a, b) for a, b in zip(module.state_dict().values(), expected.state_dict().values(), strict=True)
        )


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        (
            lambda: BertLMHeadModel(
                BertConfig(
                    hidden_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    intermediate_size=64,
                    vocab_size=64,
                    is_decoder=True,
                )
            ),
            TypeError,
            "convert\\(\\) got a BertLMHeadModel",
        ),
        (lambda: convert(SOURCES["llama"](), "linear_elu"), TypeError, "already a softmax_rnn model"),
        (lambda: torch.nn.Linear(4, 4), TypeError, r"convert\(\) got a Linear; expected one of"),
        (lambda: 42, TypeError, r"convert\(\) got a int"),
        (lambda: "/no/such/folder", FileNotFoundError, "the folder '/no/such/folder' does not exist"),
        (lambda: "./no_such_folder", FileNotFoundError, "the folder './no_such_folder' does not exist"),
    ],
    ids=[
        "unsupported-class",
        "already-converted",
        "plain-module",
        "int",
        "missing-absolute-folder",
        "missing-relative",
    ],
)
def test_unsupported_models_raise(source, error, message):
    with pytest.raises(error, match=message):
        convert(source(), "linear_elu")


@pytest.mark.parametrize(
    "layers", [[3], [-1], [], ["0"], [0, 0]], ids=["out-of-range", "negative", "empty", "string", "repeated"]
)
def test_bad_layer_lists_raise(layers):
    with pytest.raises(ValueError, match="expected a non-empty list of distinct layer indices in 0..2"):
        convert(SOURCES["llama"](), "linear_elu", layers=layers)


@pytest.mark.parametrize("layers", [5, "0", 1.0], ids=["int", "string", "float"])
def test_layers_that_are_not_a_list_raise_naming_them(layers):
    with pytest.raises(TypeError, match=rf"convert\(layers={layers!r}\): expected None or a list of layer indices"):
        convert(SOURCES["llama"](), "linear_elu", layers=layers)


def test_bad_spec_raises_before_building_anything():
    with pytest.raises(ValueError, match="Unknown attention preset 'linear_eLU'"):
        convert(SOURCES["gpt2"](), "linear_eLU")


def test_a_converted_decay_starts_with_its_half_lives(family):
    """decay_proj starts at weight 0 and, per KV head, the bias whose constant decay has the half-life
    `decay_half_lives` gives: 2^(-1/h) per position, for every token."""
    spec = AttentionSpec(kind="linear", feature_map="hedgehog", window=3, sinks=2, decay=True)
    decayed = convert(SOURCES[family](), spec).eval()
    modules = [module for module in decayed.modules() if isinstance(module, RNNParams)]
    assert modules
    for module in modules:
        heads = module.decay_proj.out_features
        half_lives = decay_half_lives(heads)
        assert not module.decay_proj.weight.any()
        hidden = torch.randn(2, 5, module.decay_proj.in_features)
        log_decay = module.gates(hidden)["decay"]
        expected = (-math.log(2.0) / half_lives.double()).view(1, heads, 1).expand(2, heads, 5)
        torch.testing.assert_close(log_decay.double(), expected, rtol=1e-5, atol=0)
    lives = decay_half_lives(3).tolist()
    assert lives[0] == pytest.approx(512.0) and lives[-1] == pytest.approx(16384.0)
    assert decay_half_lives(1).item() == pytest.approx((512.0 * 16384.0) ** 0.5)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda model, path: convert(model, "linear_elu", layer_attention=["linear_elu"]),
            TypeError,
            r"convert\(layer_attention=...\) must be None or a dict \{layer index: spec\}; got list",
        ),
        (
            lambda model, path: convert(path, "linear_elu", dtype="float77"),
            ValueError,
            r"convert\(dtype='float77'\) is not allowed; expected 'auto', a torch dtype or its name",
        ),
        (
            lambda model, path: convert(model, "linear_elu", dtype=torch.bfloat16),
            TypeError,
            r"convert\(\) got \['dtype'\], which go to from_pretrained when loading from a path",
        ),
    ],
    ids=["layer-attention-list", "dtype-name", "kwargs-with-a-model"],
)
def test_arguments_of_the_wrong_kind_are_refused_naming_them(tmp_path, call, error, message):
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE))
    model.save_pretrained(tmp_path)
    with pytest.raises(error, match=message):
        call(model, str(tmp_path))


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE))
    with pytest.raises(ValueError, match=r"has weights on the meta device \(no values\); pass a model with its"):
        convert(model, "linear_elu")


def test_hedgehog_maps_bigger_than_the_device_are_refused_before_allocation():
    """hedgehog_dim=2**40 (maps of 2**40 columns a head) failed in the allocator; it is refused, naming the
    largest width that fits."""
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE))
    spec = AttentionSpec(kind="linear", feature_map="hedgehog", hedgehog_dim=2**40)
    with pytest.raises(
        ValueError, match=r"hedgehog_dim=1099511627776 is not allowed here: .* expected hedgehog_dim <="
    ):
        convert(model, spec)

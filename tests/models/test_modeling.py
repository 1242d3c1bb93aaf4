"""The softmax_rnn models against the unmodified transformers models, and their save/load."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

from hf_softmax_rnn import (
    AttentionSpec,
    SoftmaxRNNGPT2Config,
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNLlamaConfig,
    SoftmaxRNNLlamaForCausalLM,
    convert,
)
from hf_softmax_rnn.layers import softmax_rnn_attention_modules
from hf_softmax_rnn.models import SoftmaxRNNGPT2Model, SoftmaxRNNLlamaModel

from .helpers import VOCAB, left_padded_batch, perturb_rnn_params, tiny_model, tiny_source

CLASSES = {
    "llama": (SoftmaxRNNLlamaConfig, SoftmaxRNNLlamaForCausalLM, SoftmaxRNNLlamaModel),
    "gpt2": (SoftmaxRNNGPT2Config, SoftmaxRNNGPT2LMHeadModel, SoftmaxRNNGPT2Model),
}
FINITE_PRESETS = [
    "linear_elu",
    "linear_cosine",
    "linear_hedgehog",
    "softmax_taylor_2",
    "gated_ReLU_no_gate_L2norm_nodivS_noclamp",
    "gated_deltanet_conv",
]
WITH_PARAMS = ["gated_softmax", "softmax_divS_norm", "linear_cosine", "linear_hedgehog", "softmax_detach_denom_gate"]


def built_from_config(family, spec, source):
    """Our class built from a config (not via convert), holding the stock model's weights."""
    config_class, model_class, _ = CLASSES[family]
    fields = {
        k: v
        for k, v in source.config.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version")
    }
    model = model_class(config_class(attention=spec, **fields)).eval()
    incompatible = model.load_state_dict(source.state_dict(), strict=False)
    assert not incompatible.unexpected_keys
    assert all(".rnn_params." in key for key in incompatible.missing_keys)
    return model


def logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False, **kwargs).logits


def test_softmax_spec_reproduces_the_stock_model_with_left_padding(family):
    source = tiny_source(family)
    model = built_from_config(family, "softmax", source)
    ids, mask = left_padded_batch()
    visible = mask.bool()
    torch.testing.assert_close(logits(model, ids, mask)[visible], logits(source, ids, mask)[visible], atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["softmax", *WITH_PARAMS])
def test_parameter_names_are_transformers_plus_rnn_params(family, preset):
    source = tiny_source(family)
    names = set(built_from_config(family, preset, source).state_dict())
    stock = set(source.state_dict())
    assert stock <= names
    assert all(".rnn_params." in name for name in names - stock)


# what each spec adds per layer, by the spec's meaning (SPEC s.2-3): name -> shape with H=4, Hkv=2 (llama), D=8
EXPECTED_RNN_PARAMS = {
    "softmax": {},
    "gated_softmax": {
        "input_gate.weight": (2, 32),
        "input_gate.bias": (2,),
        "output_gate.weight": (4, 32),
        "output_gate.bias": (4,),
        "norm_weight": (4, 8),
        "norm_bias": (4, 8),
    },
    "softmax_divS_norm": {"norm_weight": (4, 8)},
    "linear_cosine": {"seqlen_power": (4,)},
    "linear_hedgehog": {"hedgehog_q": (4, 8, 8), "hedgehog_k": (2, 8, 8)},
    "softmax_detach_denom_gate": {"output_gate.weight": (4, 32), "output_gate.bias": (4,)},
}


@pytest.mark.parametrize("preset", sorted(EXPECTED_RNN_PARAMS))
def test_rnn_params_hold_exactly_what_the_spec_needs(preset):
    model = built_from_config("llama", preset, tiny_source("llama"))
    attention = model.model.layers[1].self_attn
    shapes = {name: tuple(p.shape) for name, p in attention.rnn_params.named_parameters()}
    assert shapes == EXPECTED_RNN_PARAMS[preset]


@pytest.mark.parametrize("preset", ["softmax", *WITH_PARAMS, "softmax_taylor_2"])
def test_save_and_auto_load_round_trip_bit_exactly(family, preset, tmp_path):
    model = tiny_model(family, preset, layers=[1])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert loaded.config.to_dict() == {**model.config.to_dict(), "_name_or_path": str(tmp_path)}
    expected, actual = model.state_dict(), loaded.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
    ids, mask = left_padded_batch()
    assert torch.equal(logits(loaded, ids, mask), logits(model, ids, mask))


@pytest.mark.parametrize("key", [1, "1"], ids=["int-key", "str-key"])
def test_from_pretrained_layer_overrides_reach_the_attention_modules(family, tmp_path, key):
    tiny_model(family, "linear_elu").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, layer_attention={key: "softmax"})
    specs = [module.attention_spec for module in softmax_rnn_attention_modules(loaded)]
    assert specs == [AttentionSpec.from_preset("linear_elu"), AttentionSpec.from_preset("softmax")]


def test_auto_model_builds_the_base_model(family):
    config_class, _, base_class = CLASSES[family]
    config = tiny_model(family, "linear_elu").config
    assert type(AutoModel.from_config(config)) is base_class


@pytest.mark.parametrize("preset", FINITE_PRESETS)
def test_chunked_forward_matches_parallel(family, preset):
    parallel = tiny_model(family, AttentionSpec.from_preset(preset, chunk_size=4))
    config_class, model_class, _ = CLASSES[family]
    chunked = model_class(config_class(**{**parallel.config.to_dict(), "attention_mode": "chunked"})).eval()
    chunked.load_state_dict(parallel.state_dict())
    assert [module.attention_mode for module in softmax_rnn_attention_modules(chunked)] == ["chunked", "chunked"]
    ids, mask = left_padded_batch(lengths=(11, 7))
    visible = mask.bool()
    torch.testing.assert_close(
        logits(chunked, ids, mask)[visible], logits(parallel, ids, mask)[visible], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("preset", ["gated_softmax", "linear_hedgehog", "linear_cosine", "softmax_divS_norm"])
def test_loss_gradients_reach_every_rnn_param(family, preset):
    model = tiny_model(family, preset).train()
    ids, mask = left_padded_batch()
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if ".rnn_params." in name}
    assert grads
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


def test_requested_attention_implementation_is_ignored(family, tmp_path):
    model = tiny_model(family, "linear_elu")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.config._attn_implementation == "softmax_rnn"
    ids, mask = left_padded_batch()
    assert torch.equal(logits(loaded, ids, mask), logits(model, ids, mask))


@pytest.mark.parametrize("preset", ["linear_elu", "gated_softmax"])
def test_step_by_step_forward_with_a_bare_dynamic_cache_matches_full_forward(family, preset):
    model = tiny_model(family, preset)
    ids = torch.randint(1, VOCAB, (2, 9))
    full = logits(model, ids, None)
    cache = DynamicCache()
    with torch.no_grad():
        steps = [model(ids[:, :5], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 9


CACHE_REQUESTS = {
    "nothing_said": ({}, False),
    "use_cache_true": ({"use_cache": True}, True),
    "use_cache_none": ({"use_cache": None}, False),
    "cache_given": ({"cache": "dynamic"}, True),
}


@pytest.mark.parametrize("preset", ["linear_elu", "hedgehog_window_64"])
@pytest.mark.parametrize("request_name", list(CACHE_REQUESTS))
def test_training_mode_builds_a_cache_only_when_asked(family, preset, request_name, monkeypatch):
    """In training mode a forward that asks for no cache builds none (no recurrent state per layer, so
    the state-free fused kernels may run), as transformers' recurrent models default; the loss is the
    one the model computes with use_cache=False."""
    import hf_softmax_rnn.layers.attention as layer_module

    kwargs, builds_cache = CACHE_REQUESTS[request_name]
    kwargs = {name: DynamicCache() if value == "dynamic" else value for name, value in kwargs.items()}
    model = tiny_model(family, preset).train()
    ids = torch.randint(1, VOCAB, (2, 9))
    asked_for_state = []
    original = layer_module.attention

    def recording_attention(*args, **options):
        asked_for_state.append(options.get("return_state", True))
        return original(*args, **options)

    monkeypatch.setattr(layer_module, "attention", recording_attention)
    torch.manual_seed(0)  # (GPT-2's dropout draws the same masks in both forwards)
    output = model(ids, labels=ids, **kwargs)
    assert (output.cache is not None) == builds_cache
    assert asked_for_state == [builds_cache] * 2
    torch.manual_seed(0)
    expected = model(ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(output.loss, expected, atol=0, rtol=0)


def test_eval_mode_keeps_the_configured_cache(family):
    model = tiny_model(family, "linear_elu").eval()
    with torch.no_grad():
        assert model(torch.randint(1, VOCAB, (1, 5))).cache is not None


PACKED_PATHS = {
    "forward_no_cache": lambda model, ids, positions, mask: model(
        ids, position_ids=positions, attention_mask=mask, use_cache=False
    ),
    "forward_default_cache": lambda model, ids, positions, mask: model(
        ids, position_ids=positions, attention_mask=mask
    ),
    "forward_bare_dynamic_cache": lambda model, ids, positions, mask: model(
        ids, position_ids=positions, attention_mask=mask, cache=DynamicCache(), use_cache=True
    ),
    "generate": lambda model, ids, positions, mask: model.generate(
        ids, position_ids=positions, attention_mask=mask, max_new_tokens=2, do_sample=False
    ),
}


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "all_ones_mask"])
@pytest.mark.parametrize("path", list(PACKED_PATHS))
def test_packed_sequences_raise_on_every_path(family, path, with_mask):
    """Position ids that restart inside a row (two documents packed) would attend across the documents."""
    model = tiny_model(family, "linear_elu")
    ids = torch.randint(1, VOCAB, (1, 8))
    restarting = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    mask = torch.ones_like(ids) if with_mask else None
    with pytest.raises(ValueError, match=r"position_ids restart.*columns 3-4: positions \[3, 0\]"):
        PACKED_PATHS[path](model, ids, restarting, mask)


def test_positions_restarting_only_across_padding_are_accepted(family):
    """generate's own positions for a left-padded batch (padding at position 1) are one sequence per row."""
    model = tiny_model(family, "linear_elu")
    ids, mask = left_padded_batch()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    batched = logits(model, ids, mask, position_ids=positions)
    for row in range(ids.shape[0]):
        visible = mask[row].bool()
        alone = logits(model, ids[row : row + 1, visible], None)
        torch.testing.assert_close(batched[row : row + 1, visible], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")], ids=["half", "two", "minus_one", "nan"])
def test_a_mask_with_values_other_than_0_and_1_raises(family, value):
    model = tiny_model(family, "linear_elu")
    ids = torch.randint(1, VOCAB, (1, 6))
    mask = torch.ones(1, 6)
    mask[0, 2] = value
    with pytest.raises(ValueError, match=f"attention_mask must hold only 0.*it holds {value}"):
        model(ids, attention_mask=mask)


def test_perturbation_helper_changes_the_output(family):
    """Guards the generation tests: perturbed rnn_params must matter to the logits."""
    model = tiny_model(family, "gated_softmax")
    ids, mask = left_padded_batch()
    before = logits(model, ids, mask)
    perturb_rnn_params(model)
    assert not torch.allclose(logits(model, ids, mask), before)


def test_peft_lora_with_rnn_params_saved_trains_only_adapters_and_rnn_params(family):
    model = tiny_model(family, "gated_softmax")
    targets = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}[family]
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=targets, modules_to_save=["rnn_params"]))
    trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    assert all(".lora_" in name or ".rnn_params.modules_to_save." in name for name in trainable)
    assert (
        sum(".rnn_params.modules_to_save." in name for name in trainable) == 2 * 6
    )  # 2 layers x (2 gates x 2 + norm w, b)
    ids, mask = left_padded_batch()
    wrapped(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is not None for name, p in wrapped.named_parameters() if ".rnn_params.modules_to_save." in name)


#: Window hybrids with sinks, a decay and kept positions, small enough that the 7- and 11-token rows cross window,
#: sinks and kept positions.
SINK_DECAY_SPECS = {
    "hedgehog_window3_sinks2": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, sinks=2, chunk_size=4),
    "hedgehog_window3_sinks2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=3, sinks=2, decay=True, chunk_size=4
    ),
    "taylor2_decay": AttentionSpec(kind="recurrent_softmax", taylor_order=2, decay=True, chunk_size=4),
    "hedgehog_window2_sinks1_kept2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=1, kept=2, decay=True, chunk_size=4
    ),
}


@pytest.mark.parametrize("name", sorted(SINK_DECAY_SPECS))
def test_chunked_forward_with_sinks_and_decay_matches_parallel_and_gradients_reach_rnn_params(family, name):
    parallel = tiny_model(family, SINK_DECAY_SPECS[name])
    config_class, model_class, _ = CLASSES[family]
    chunked = model_class(config_class(**{**parallel.config.to_dict(), "attention_mode": "chunked"})).eval()
    chunked.load_state_dict(parallel.state_dict())
    ids, mask = left_padded_batch(lengths=(11, 7))
    visible = mask.bool()
    torch.testing.assert_close(
        logits(chunked, ids, mask)[visible], logits(parallel, ids, mask)[visible], atol=1e-5, rtol=1e-5
    )
    chunked.train()(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    grads = {key: p.grad for key, p in chunked.named_parameters() if ".rnn_params." in key}
    assert any(".decay_proj." in key for key in grads) == SINK_DECAY_SPECS[name].decay
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("mode", ["parallel", "chunked"])
def test_a_block_within_the_exact_part_is_the_stock_model_and_every_rnn_param_gets_a_gradient(family, mode):
    """Window 4, a sink and 3 kept positions hold every key of 8 positions: the converted model computes the
    stock model's logits (the unmodified transformers model), and the finite state's parameters (hedgehog
    maps, mixing weight, decay projection) get zero gradients rather than none, as data-parallel training
    expects. One position more and the finite state is read."""
    spec = AttentionSpec(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=3, decay=True)
    source = tiny_source(family)
    model = perturb_rnn_params(convert(source, spec, attention_mode=mode)).eval()
    ids, mask = left_padded_batch(lengths=(8, 5))
    visible = mask.bool()
    torch.testing.assert_close(logits(model, ids, mask)[visible], logits(source, ids, mask)[visible], atol=1e-5, rtol=0)
    model.train()(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if ".rnn_params." in name}
    assert any(".decay_proj." in name for name in grads) and any(".hedgehog" in name for name in grads)
    assert all(grad is not None and not grad.any() for grad in grads.values())
    longer, longer_mask = left_padded_batch(lengths=(9, 5))
    difference = logits(model.eval(), longer, longer_mask)[0, -1] - logits(source, longer, longer_mask)[0, -1]
    assert difference.abs().max() > 1e-4


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (
            lambda ids: ids.masked_fill(ids == ids[0, 3], VOCAB + 7),
            rf"labels holds {VOCAB + 7}, outside the vocabulary",
        ),
        (lambda ids: ids.masked_fill(ids == ids[0, 3], -1), r"labels holds -1, outside the vocabulary: .* or -100"),
        (lambda ids: ids[:, :5], r"labels has shape \[2, 5\] for inputs of \[2, 10\] positions"),
        (lambda ids: ids.float(), "labels has dtype torch.float32; expected integer token ids"),
    ],
    ids=["beyond-vocabulary", "negative", "short", "float"],
)
def test_labels_outside_the_vocabulary_or_of_another_shape_are_refused(family, labels, message):
    """The loss would raise an IndexError on a CPU (a device-side assert on a GPU) or a batch-size mismatch."""
    model = tiny_model(family, "linear_elu")
    ids, _ = left_padded_batch()
    with pytest.raises((ValueError, TypeError), match=message):
        model(ids, labels=labels(ids))


def test_labels_of_minus_100_are_not_scored(family):
    """-100 (transformers' ignore index) is a label the loss skips: the mean over the other positions."""
    model = tiny_model(family, "linear_elu")
    ids, _ = left_padded_batch()
    labels = ids.clone()
    labels[:, :4] = -100
    logits = model(ids).logits[:, :-1]
    targets = labels[:, 1:]
    kept = targets != -100
    expected = torch.nn.functional.cross_entropy(logits[kept].float(), targets[kept])
    torch.testing.assert_close(model(ids, labels=labels).loss, expected)

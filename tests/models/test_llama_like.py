"""The families of Llama's pattern (Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Phi-3, OLMo 2, Granite, SmolLM3,
Gemma 2, Gemma 3): converted models against the unmodified transformers models they come from."""

import copy
import logging
import re

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BartConfig,
    BertConfig,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GraniteConfig,
    GraniteForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.convert import check_convertible, converted_model_type
from hf_softmax_rnn.layers import set_attention_transfer, softmax_rnn_attention_modules
from hf_softmax_rnn.models import LLAMA_LIKE_CONFIGS, LLAMA_LIKE_FAMILIES

from .helpers import LLAMA_SHAPE, left_padded_batch, perturb_rnn_params

#: GQA (4 heads, 2 KV heads) with head_dim 8, and no special tokens but padding (id 0).
SHAPE = dict(LLAMA_SHAPE, head_dim=8, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)
#: Granite's multipliers, all away from 1: the softmax scale (`attention_multiplier`, instead of 1/sqrt(8)) and the
#: embedding, residual and logits scales of its own code.
GRANITE_MULTIPLIERS = dict(
    attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0
)
#: Gemma 2 as it converts: every layer full attention, no attention soft-capping; its own softmax scale
#: (`query_pre_attn_scalar` 4 instead of head_dim 8) and the final logit soft-capping of its own code.
GEMMA2 = dict(layer_types=["full_attention"] * 2, attn_logit_softcapping=None, query_pre_attn_scalar=4)
#: Gemma 2 with its attention soft-capping, at 0.3 so that it bends these small scores; a sliding layer 0.
GEMMA2_SOFTCAP = {**GEMMA2, "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 0.3}
#: Gemma 3 with a local (sliding-window) layer and a global one, whose RoPEs differ (theta 10 and 10^6): its own
#: softmax scale (`query_pre_attn_scalar` 4) and q/k norms.
GEMMA3 = dict(
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=4,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    },
)
#: id -> (source class, its config): tied and untied embeddings, attention biases (Qwen2's own; Qwen3's
#: `attention_bias`), q/k norms per head (Qwen3, Qwen3-MoE) and over the projection (OLMo 2), experts (Qwen3-MoE,
#: Mixtral), a fused qkv_proj with RoPE on half of each head (Phi-3), Granite's multipliers, and SmolLM3's NoPE
#: layers (layer 1 of 2 without RoPE), Gemma 2's scale, Gemma 3's local and global RoPE (a window of 4).
SOURCES = {
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None)),
    "mistral-tied": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None, tie_word_embeddings=True)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE)),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE)),
    "qwen3-tied-bias": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, tie_word_embeddings=True, attention_bias=True)),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, **MOE, num_experts=4, moe_intermediate_size=16)),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, **MOE, num_local_experts=4)),
    "phi3-partial-rotary": (Phi3ForCausalLM, Phi3Config(**SHAPE, partial_rotary_factor=0.5)),
    "phi3-tied": (Phi3ForCausalLM, Phi3Config(**SHAPE, tie_word_embeddings=True)),
    "olmo2": (Olmo2ForCausalLM, Olmo2Config(**SHAPE)),
    "olmo2-tied-bias": (Olmo2ForCausalLM, Olmo2Config(**SHAPE, tie_word_embeddings=True, attention_bias=True)),
    "granite": (GraniteForCausalLM, GraniteConfig(**SHAPE, **GRANITE_MULTIPLIERS)),
    "granite-tied": (GraniteForCausalLM, GraniteConfig(**SHAPE, **GRANITE_MULTIPLIERS, tie_word_embeddings=True)),
    "smollm3-nope": (SmolLM3ForCausalLM, SmolLM3Config(**SHAPE, no_rope_layer_interval=2)),
    "smollm3-nope-untied": (
        SmolLM3ForCausalLM,
        SmolLM3Config(**SHAPE, no_rope_layer_interval=2, tie_word_embeddings=False),
    ),
    "gemma2-tied": (Gemma2ForCausalLM, Gemma2Config(**SHAPE, **GEMMA2, final_logit_softcapping=30.0)),
    "gemma2-untied": (Gemma2ForCausalLM, Gemma2Config(**SHAPE, **GEMMA2, tie_word_embeddings=False)),
    "gemma3-local-global": (Gemma3ForCausalLM, Gemma3TextConfig(**SHAPE, **GEMMA3, sliding_window=4)),
    "gemma3-untied": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(**SHAPE, **GEMMA3, sliding_window=4, tie_word_embeddings=False),
    ),
}
FINITE_STATE_SPECS = {
    "linear_elu": "linear_elu",
    "hedgehog-window-sinks-decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=3, sinks=2, decay=True, chunk_size=4
    ),
}


@pytest.fixture(params=sorted(SOURCES))
def source(request) -> torch.nn.Module:
    model_class, config = SOURCES[request.param]
    return model_class(copy.deepcopy(config)).eval()


def logits(model, ids, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


def greedy(model, ids, mask, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, **kwargs)


def assert_same_logits_and_generation(converted, source):
    """On a left-padded batch: the logits of the tokens within 2e-6 (Gemma 2's original runs eager attention,
    not SDPA), the same greedy tokens."""
    ids, mask = left_padded_batch()
    visible = mask.bool()
    difference = (logits(converted, ids, mask) - logits(source, ids, mask))[visible].abs().max()
    assert difference <= 2e-6
    assert torch.equal(greedy(converted, ids, mask), greedy(source, ids, mask))


def test_softmax_conversion_reproduces_the_original_logits_and_generation(source):
    converted = convert(source, "softmax")
    family = source.config.model_type
    assert converted.config.model_type == f"softmax_rnn_{family}"
    assert type(converted).__name__ == f"SoftmaxRNN{type(source).__name__}"
    assert converted.config.tie_word_embeddings == source.config.tie_word_embeddings
    assert_same_logits_and_generation(converted, source)


def test_weights_are_copied_and_rnn_params_are_the_only_additions(source):
    converted = convert(source, "gated_softmax")
    original, new = source.state_dict(), converted.state_dict()
    assert all(torch.equal(new[name], tensor) for name, tensor in original.items())
    assert {name for name in new if name not in original} == {name for name in new if ".rnn_params." in name}
    attention = softmax_rnn_attention_modules(converted)
    assert len(attention) == 2 and all(type(module).__name__.startswith("SoftmaxRNN") for module in attention)


@pytest.mark.parametrize("spec", list(FINITE_STATE_SPECS.values()), ids=list(FINITE_STATE_SPECS))
def test_finite_state_modes_agree_and_cached_generation_matches_recomputation(source, spec):
    converted = perturb_rnn_params(convert(source, spec, attention_mode="parallel")).eval()
    assert converted.config.layer_types == ["softmax_rnn_recurrent"] * 2
    ids, mask = left_padded_batch()
    visible = mask.bool()
    parallel = logits(converted, ids, mask)
    assert {module.attention_mode for module in softmax_rnn_attention_modules(converted)} == {"parallel"}
    for module in softmax_rnn_attention_modules(converted):
        module.set_attention_mode("chunked")
    torch.testing.assert_close(logits(converted, ids, mask)[visible], parallel[visible], atol=2e-5, rtol=0)
    assert torch.equal(greedy(converted, ids, mask), greedy(converted, ids, mask, use_cache=False))


def test_a_hybrid_decodes_its_softmax_layer_from_a_kv_cache(source):
    converted = perturb_rnn_params(convert(source, "linear_elu", layers=[1])).eval()
    assert converted.config.layer_types == ["full_attention", "softmax_rnn_recurrent"]
    ids, mask = left_padded_batch()
    assert torch.equal(greedy(converted, ids, mask), greedy(converted, ids, mask, use_cache=False))


def test_a_saved_converted_model_reloads_with_the_auto_classes(source, tmp_path):
    converted = perturb_rnn_params(convert(source, FINITE_STATE_SPECS["hedgehog-window-sinks-decay"])).eval()
    converted.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(converted)
    assert type(AutoConfig.from_pretrained(tmp_path)) is type(converted.config)
    ids, mask = left_padded_batch()
    assert torch.equal(logits(loaded, ids, mask), logits(converted, ids, mask))


def test_the_static_cache_decodes_as_the_dynamic_one():
    model_class, config = SOURCES["qwen2"]
    converted = perturb_rnn_params(convert(model_class(copy.deepcopy(config)).eval(), "linear_elu")).eval()
    ids, mask = left_padded_batch()
    assert torch.equal(greedy(converted, ids, mask, cache_implementation="static"), greedy(converted, ids, mask))


def test_every_family_is_registered_under_its_model_type():
    for family in LLAMA_LIKE_FAMILIES:
        source_config = family.config_class(**SHAPE, sliding_window=None, attn_logit_softcapping=None)
        assert converted_model_type(source_config) == family.model_type
        config = AutoConfig.for_model(family.model_type, **SHAPE, attention="linear_elu")
        assert type(config) is LLAMA_LIKE_CONFIGS[family.name]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert type(model).__name__ == f"SoftmaxRNN{family.name}ForCausalLM"
        assert isinstance(model, family.causal_lm)


SLIDING = {
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=4), [0, 1]),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, **MOE, num_local_experts=4, sliding_window=4), [0, 1]),
    "qwen2-layer-1": (
        Qwen2ForCausalLM,
        Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        [1],
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=4, max_window_layers=0),
        [0, 1],
    ),
    "phi3": (Phi3ForCausalLM, Phi3Config(**SHAPE, sliding_window=4), [0, 1]),
    "smollm3-nope-layer-1": (
        SmolLM3ForCausalLM,
        SmolLM3Config(**SHAPE, use_sliding_window=True, sliding_window=4, no_rope_layer_interval=2),
        [1],
    ),
    "gemma2-layer-0": (
        Gemma2ForCausalLM,
        Gemma2Config(**SHAPE, **{**GEMMA2, "layer_types": ["sliding_attention", "full_attention"]}, sliding_window=4),
        [0],
    ),
    "gemma3-layer-0": (Gemma3ForCausalLM, Gemma3TextConfig(**SHAPE, **GEMMA3, sliding_window=4), [0]),
    "gemma2-softcap-layer-0": (Gemma2ForCausalLM, Gemma2Config(**SHAPE, **GEMMA2_SOFTCAP, sliding_window=4), [0]),
}


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_layers_keep_their_window_in_a_softmax_conversion(name):
    """Prompts of 10 and 6 tokens and 5 new ones cross the window of 4: the converted model's sliding layers
    read the last 4 positions only, as the original's do (on the tokens: Gemma 2's eager attention gives padded
    positions other values)."""
    model_class, config, sliding = SLIDING[name]
    source = model_class(copy.deepcopy(config)).eval()
    converted = convert(source, "softmax")
    assert converted.config.sliding_window is None
    specs = [converted.config.attention_spec(i) for i in range(2)]
    assert specs == [AttentionSpec(window=4) if i in sliding else AttentionSpec() for i in range(2)]
    assert_same_logits_and_generation(converted, source)


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_the_transfer_teacher_of_a_converted_sliding_layer_keeps_its_window(name, tmp_path):
    """Every layer converted to a hybrid with a window of 2: teacher-forced, each layer passes on its teacher's
    output, so the model computes the original's logits only if a sliding layer's teacher reads the source's
    window of 4 (prompts of 10 and 6 tokens, left-padded), not every earlier position. The windows are saved."""
    model_class, config, sliding = SLIDING[name]
    torch.manual_seed(0)
    source = model_class(copy.deepcopy(config)).eval()
    converted = perturb_rnn_params(convert(source, AttentionSpec(kind="linear", feature_map="hedgehog", window=2)))
    assert converted.config.source_sliding_windows == {str(i): 4 for i in sliding}
    ids, mask = left_padded_batch()
    set_attention_transfer(converted.eval(), True)
    rows = mask.bool()
    torch.testing.assert_close(
        logits(converted, ids, mask)[rows], logits(source, ids, mask)[rows], atol=1e-5, rtol=1e-5
    )
    converted.save_pretrained(tmp_path)
    reloaded = type(converted).from_pretrained(tmp_path)
    assert reloaded.config.source_sliding_windows == converted.config.source_sliding_windows


def test_source_sliding_windows_must_name_layers_and_windows():
    config_class = LLAMA_LIKE_CONFIGS["Mistral"]
    with pytest.raises(ValueError, match=r"source_sliding_windows has keys \['7'\]; expected layer indices in 0..1"):
        config_class(**SHAPE, source_sliding_windows={"7": 4})
    with pytest.raises(ValueError, match=r"source_sliding_windows=\{'0': 0\}; expected None or a mapping"):
        config_class(**SHAPE, source_sliding_windows={"0": 0})
    assert config_class(**SHAPE, source_sliding_windows={0: 4}).source_sliding_windows == {"0": 4}


def test_a_sliding_layer_left_exact_in_a_hybrid_keeps_its_window(caplog):
    """Qwen2 with a sliding window in layer 1: converting layer 0 leaves layer 1 sliding-window softmax (decoded
    from a KV cache); converting both logs that layer 1 now reads every earlier position."""
    _, config, _ = SLIDING["qwen2-layer-1"]
    source = Qwen2ForCausalLM(copy.deepcopy(config)).eval()
    hybrid = convert(source, "linear_elu", layers=[0])
    assert hybrid.config.attention_spec(1) == AttentionSpec(window=4)
    ids, mask = left_padded_batch()
    cached = greedy(hybrid, ids, mask, output_logits=True, return_dict_in_generate=True)
    uncached = greedy(hybrid, ids, mask, output_logits=True, return_dict_in_generate=True, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step_cached, step_uncached in zip(cached.logits, uncached.logits, strict=True):
        torch.testing.assert_close(step_cached, step_uncached, atol=1e-4, rtol=0)
    with caplog.at_level(logging.INFO, logger="hf_softmax_rnn.convert"):
        converted = convert(source, "linear_elu")
    assert converted.config.attention_spec(1) == AttentionSpec.from_preset("linear_elu")
    assert "Layer 1 attends to the last 4 positions in the source model" in caplog.text


@pytest.mark.parametrize("spec", ["softmax", "linear_elu"])
def test_each_layer_keeps_the_rope_of_its_source_layer_type(spec):
    """Gemma 3's converted layers rotate q and k as the source's layer of that type does: a layer 0 of the local
    RoPE (theta 10) and a layer 1 of the global one (theta 10^6), both exact or both converted."""
    model_class, config = SOURCES["gemma3-local-global"]
    converted = convert(model_class(copy.deepcopy(config)).eval(), spec)
    assert converted.config.rope_layer_types == ["sliding_attention", "full_attention"]
    hidden = torch.randn(1, 5, SHAPE["hidden_size"])
    positions = torch.arange(5)[None]
    for layer, theta in ((0, 10.0), (1, 1e6)):
        attention = converted.model.layers[layer].self_attn
        rope = converted.model.rotary_emb(hidden, positions)
        query, _, _ = attention.project_qkv(hidden, rope)
        plain_query, _, _ = attention.project_qkv(hidden, (torch.ones(1, 5, 8), torch.zeros(1, 5, 8)))
        angle = positions[0, :, None] * theta ** -(torch.arange(0, 8, 2) / 8)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        rotated = plain_query * cos + torch.cat([-plain_query[..., 4:], plain_query[..., :4]], -1) * sin
        torch.testing.assert_close(query, rotated, atol=1e-6, rtol=0)


def test_rope_layer_types_name_keys_of_rope_parameters():
    with pytest.raises(StrictDataclassClassValidationError, match=r"rope_layer_types=\['local', 'full_attention'\]"):
        LLAMA_LIKE_CONFIGS["Gemma3"](**SHAPE, rope_layer_types=["local", "full_attention"])
    assert LLAMA_LIKE_CONFIGS["Gemma3"](**SHAPE).rope_layer_types == ["full_attention"] * 2


def test_a_sliding_window_that_no_layer_uses_is_dropped():
    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert config.sliding_window == 16 and "sliding_attention" not in config.layer_types
    source = Qwen2ForCausalLM(config).eval()
    converted = convert(source, "softmax")
    assert converted.config.sliding_window is None
    ids, mask = left_padded_batch(lengths=(20, 12))
    torch.testing.assert_close(logits(converted, ids, mask), logits(source, ids, mask), atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    ("model_class", "config", "full_attention"),
    [
        (
            MistralForCausalLM,
            MistralConfig(**SHAPE, sliding_window=16),
            dict(sliding_window=None),
        ),
        (
            Qwen2ForCausalLM,
            Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=1),
            dict(layer_types=["full_attention"] * 2),
        ),
        (
            Phi3ForCausalLM,
            Phi3Config(**SHAPE, sliding_window=16),
            dict(sliding_window=None),
        ),
        (
            SmolLM3ForCausalLM,
            SmolLM3Config(**SHAPE, use_sliding_window=True, sliding_window=16, no_rope_layer_interval=2),
            dict(layer_types=["full_attention"] * 2),
        ),
        (
            Gemma2ForCausalLM,
            Gemma2Config(**SHAPE),
            dict(layer_types=["full_attention"] * 2),
        ),
    ],
    ids=["mistral", "qwen2", "phi3", "smollm3", "gemma2"],
)
def test_a_model_loaded_as_full_attention_converts(model_class, config, full_attention, tmp_path):
    """A model loaded as full attention (`sliding_window=None`, or full-attention `layer_types`; Gemma 2 with its
    soft-capping of 50) converts as the full-attention model transformers loads with them (on the tokens:
    Gemma 2's eager attention gives padded positions other values)."""
    model_class(config).save_pretrained(tmp_path)
    converted = convert(tmp_path, "softmax", **full_attention)
    reference = model_class.from_pretrained(tmp_path, **full_attention).eval()
    ids, mask = left_padded_batch(lengths=(24, 12))
    visible = mask.bool()
    assert converted.config.sliding_window is None
    expected = logits(reference, ids, mask)[visible]
    torch.testing.assert_close(logits(converted, ids, mask)[visible], expected, atol=2e-6, rtol=0)


def test_attention_soft_capping_is_kept_in_exact_softmax_layers():
    """A softmax conversion of a soft-capped Gemma 2 caps its scores as the original does (the sliding-window
    test above compares the logits and greedy tokens); without the cap the logits move."""
    source = Gemma2ForCausalLM(Gemma2Config(**SHAPE, **GEMMA2_SOFTCAP, sliding_window=4)).eval()
    converted = convert(source, "softmax")
    assert converted.config.attn_logit_softcapping == 0.3
    ids, mask = left_padded_batch()
    visible = mask.bool()
    capped = logits(converted, ids, mask)[visible]
    torch.testing.assert_close(capped, logits(source, ids, mask)[visible], atol=2e-6, rtol=0)
    converted.config.attn_logit_softcapping = None
    assert (logits(converted, ids, mask)[visible] - capped).abs().max() > 1e-5


@pytest.mark.parametrize("layers", [None, [1]], ids=["all-layers", "layer-1"])
def test_attention_soft_capping_is_refused_for_finite_state_layers_before_the_weights_load(layers, tmp_path):
    config = Gemma2Config(**SHAPE, layer_types=["full_attention"] * 2, attn_logit_softcapping=50.0)
    converted = "[0, 1]" if layers is None else "[1]"
    message = (
        rf"attn_logit_softcapping=50.0\) in exact softmax scores only, but would convert layers "
        rf"{re.escape(converted)} to a spec without them: .* Convert them to a window hybrid \(window=W: .*"
        r" load it with attn_logit_softcapping=None"
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        convert(tmp_path, "linear_elu", layers=layers)
    with pytest.raises(ValueError, match=message):
        convert(Gemma2ForCausalLM(config), "linear_elu", layers=layers)
    with pytest.raises(
        StrictDataclassClassValidationError,
        match=r"attn_logit_softcapping=50.0, .* layers \[0, 1\] have none .* expected those layers kind='softmax', a "
        r"window hybrid",
    ):
        LLAMA_LIKE_CONFIGS["Gemma2"](**SHAPE, attention="linear_elu", attn_logit_softcapping=50.0)
    assert LLAMA_LIKE_CONFIGS["Gemma2"](**SHAPE, attn_logit_softcapping=50.0).attn_logit_softcapping == 50.0
    assert LLAMA_LIKE_CONFIGS["Gemma2"](**SHAPE).attn_logit_softcapping is None


#: A window hybrid with every exact part (window, sinks, kept keys) and a decayed finite state.
CAPPED_HYBRID = AttentionSpec(
    kind="linear", feature_map="hedgehog", window=3, sinks=2, kept=2, decay=True, chunk_size=4
)


def test_a_soft_capped_gemma2_converts_to_a_window_hybrid_that_caps_its_exact_part():
    """Gemma 2 with a cap of 0.3 (a sliding layer 0 of window 4) converted to a window hybrid: the cap stays in the
    config and in the layers' exact part (the logits move without it), the parallel and chunked forms agree, and
    greedy generation from the recurrent state (5 new tokens past the 7 exact positions: the finite state is read)
    gives the tokens and the logits of recomputation without a cache, from a dynamic or a static cache."""
    source = Gemma2ForCausalLM(Gemma2Config(**SHAPE, **GEMMA2_SOFTCAP, sliding_window=4)).eval()
    with torch.no_grad():  # scores of a few units, which the cap bends
        for layer in source.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    converted = perturb_rnn_params(convert(source, CAPPED_HYBRID)).eval()
    assert converted.config.attn_logit_softcapping == 0.3
    assert converted.config.layer_types == ["softmax_rnn_recurrent"] * 2
    ids, mask = left_padded_batch()
    visible = mask.bool()
    chunked = logits(converted, ids, mask)
    for module in softmax_rnn_attention_modules(converted):
        module.set_attention_mode("parallel")
    torch.testing.assert_close(logits(converted, ids, mask)[visible], chunked[visible], atol=2e-5, rtol=0)
    cached = greedy(converted, ids, mask, output_logits=True, return_dict_in_generate=True)
    uncached = greedy(converted, ids, mask, output_logits=True, return_dict_in_generate=True, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step_cached, step_uncached in zip(cached.logits, uncached.logits, strict=True):
        torch.testing.assert_close(step_cached, step_uncached, atol=1e-4, rtol=0)
    assert torch.equal(greedy(converted, ids, mask, cache_implementation="static"), cached.sequences)
    converted.config.attn_logit_softcapping = None
    assert (logits(converted, ids, mask)[visible] - chunked[visible]).abs().max() > 1e-2


def test_the_attention_transfer_teacher_of_a_soft_capped_model_caps_its_scores():
    """With teacher forcing, every converted layer passes on the teacher's output: the original's exact softmax, cap
    included, so the logits are the original Gemma 2's."""
    source = Gemma2ForCausalLM(Gemma2Config(**SHAPE, **{**GEMMA2, "attn_logit_softcapping": 0.3})).eval()
    converted = perturb_rnn_params(convert(source, CAPPED_HYBRID)).eval()
    set_attention_transfer(converted, True)
    ids, mask = left_padded_batch()
    visible = mask.bool()
    torch.testing.assert_close(
        logits(converted, ids, mask)[visible], logits(source, ids, mask)[visible], atol=2e-6, rtol=0
    )


def test_a_softcap_that_the_family_ignores_stays_ignored():
    """Gemma 3's config has `attn_logit_softcapping`, which its attention does not apply: the converted layers do not
    either (the original's logits), and no layer is refused for it."""
    model_class, config = SOURCES["gemma3-local-global"]
    source = model_class(Gemma3TextConfig(**{**config.to_dict(), "attn_logit_softcapping": 0.3})).eval()
    assert_same_logits_and_generation(convert(source, "softmax"), source)
    assert convert(source, "linear_elu").config.attn_logit_softcapping == 0.3


def test_converted_configs_refuse_a_sliding_window():
    with pytest.raises(StrictDataclassClassValidationError, match="softmax_rnn_mistral has sliding_window=8"):
        LLAMA_LIKE_CONFIGS["Mistral"](**SHAPE, sliding_window=8)
    with pytest.raises(ValueError, match=r"softmax_rnn_qwen2 has layer_types with \['sliding_attention'\]"):
        LLAMA_LIKE_CONFIGS["Qwen2"](**SHAPE, layer_types=["full_attention", "sliding_attention"])
    assert LLAMA_LIKE_CONFIGS["Mistral"](**SHAPE).sliding_window is None


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        (BertConfig(), TypeError, r"got model_type 'bert'"),
        (BartConfig(), TypeError, r"got model_type 'bart'"),
        (GPT2Config(add_cross_attention=True), ValueError, r"this gpt2 model has add_cross_attention=True"),
    ],
    ids=["encoder-only", "encoder-decoder", "cross-attention"],
)
def test_models_whose_attention_does_not_fit_are_refused_from_the_config(config, error, message, tmp_path):
    with pytest.raises(error, match=message) as refused:
        check_convertible(config)
    if error is TypeError:
        assert all(repr(family.config_class.model_type) in str(refused.value) for family in LLAMA_LIKE_FAMILIES)
    config.save_pretrained(tmp_path)
    with pytest.raises(error, match=message):
        convert(tmp_path, "linear_elu")

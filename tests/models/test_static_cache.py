"""`generate(cache_implementation="static")` and compiled decoding from recurrent states, against the
dynamic cache and uncached recomputation."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import CompileConfig, DynamicCache, StaticCache

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.layers.cache import StaticRecurrentStateLayer

from .helpers import left_padded_batch, tiny_model

GREEDY = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
# finite-state layers: a linear map, order-2 Taylor (also with a decay), gated DeltaNet, and window hybrids
# (with 2 sinks, and a decay; with 2 kept positions; with a gated delta-rule state, also weighed by an additive
# mass; with a short convolution)
# whose window (2 to 4 positions) the 10- and 6-token prompts and the 6 new tokens cross
SPECS = {
    "linear_elu": "linear_elu",
    "softmax_taylor_2": "softmax_taylor_2",
    "hedgehog_window3": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, chunk_size=4),
    "taylor2_l2_window4": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="l2", window=4, chunk_size=3
    ),
    "hedgehog_window3_sinks2": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, sinks=2, chunk_size=4),
    "elu_window3_sinks2_decay": AttentionSpec(
        kind="linear", feature_map="elu", window=3, sinks=2, decay=True, chunk_size=4
    ),
    "taylor2_decay": AttentionSpec(kind="recurrent_softmax", taylor_order=2, decay=True, chunk_size=3),
    "hedgehog_window2_sinks1_kept2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=1, kept=2, decay=True, chunk_size=4
    ),
    "gated_deltanet": AttentionSpec.from_preset("gated_deltanet", chunk_size=4),
    "hedgehog_window2_sinks1_kept2_gated_delta": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=1, kept=2, decay=True, delta_rule=True, chunk_size=4
    ),
    "gated_deltanet_conv": AttentionSpec.from_preset("gated_deltanet_conv", chunk_size=4),
    "hedgehog_window2_sinks1_kept2_gated_delta_mass": AttentionSpec(
        kind="linear",
        feature_map="hedgehog",
        window=2,
        sinks=1,
        kept=2,
        decay=True,
        delta_rule=True,
        additive_mass=True,
        chunk_size=4,
    ),
    "hedgehog_window2_sinks1_gated_delta_conv3": AttentionSpec(
        kind="linear",
        feature_map="hedgehog",
        window=2,
        sinks=1,
        decay=True,
        delta_rule=True,
        short_conv=3,
        chunk_size=4,
    ),
}


def assert_same_generation(first, second):
    assert torch.equal(first.sequences, second.sequences)
    for step_first, step_second in zip(first.logits, second.logits, strict=True):
        torch.testing.assert_close(step_first, step_second, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_static_cache_generation_matches_dynamic_cache_and_recomputation(family, name):
    model = tiny_model(family, SPECS[name])
    ids, mask = left_padded_batch(lengths=(10, 6, 3))
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert isinstance(static.cache, StaticCache)
    assert all(isinstance(layer, StaticRecurrentStateLayer) for layer in static.cache.layers)
    assert_same_generation(static, model.generate(ids, attention_mask=mask, **GREEDY))
    assert_same_generation(static, model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY))


def test_static_cache_with_a_larger_kept_budget_in_one_layer(family):
    """The `finetune` default's shape: one retrieval layer keeps more positions than the others."""
    spec = SPECS["hedgehog_window2_sinks1_kept2_decay"]
    model = tiny_model(family, spec, layer_attention={1: dict(spec.to_dict(), kept=5)})
    ids, mask = left_padded_batch(lengths=(10, 6, 3))
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert [layer.state.kept_keys.shape[2] for layer in static.cache.layers] == [2, 5]
    assert_same_generation(static, model.generate(ids, attention_mask=mask, **GREEDY))
    assert_same_generation(static, model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY))


@pytest.mark.parametrize(
    "name",
    [
        "linear_elu",
        "hedgehog_window3",
        "hedgehog_window3_sinks2",
        "elu_window3_sinks2_decay",
        "hedgehog_window2_sinks1_kept2_decay",
    ],
)
def test_static_cache_rows_match_their_unpadded_generation(family, name):
    model = tiny_model(family, SPECS[name])
    ids, mask = left_padded_batch(lengths=(10, 6, 3))
    batched = model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    for row in range(ids.shape[0]):
        alone = ids[row : row + 1, mask[row].bool()]
        single = model.generate(alone, attention_mask=torch.ones_like(alone), use_cache=False, **GREEDY)
        new = GREEDY["max_new_tokens"]
        assert torch.equal(batched.sequences[row, -new:], single.sequences[0, -new:])


def _prefilled(model, cache):
    ids, mask = left_padded_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
    return logits[:, -1:].argmax(-1), mask.sum(-1, keepdim=True)


def _decode(model, cache, token, position, steps):
    """Greedy steps fed one token with a one-column mask (what generate passes with a static cache)."""
    all_logits = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(
                input_ids=token,
                attention_mask=torch.ones_like(token),
                position_ids=position,
                cache=cache,
                use_cache=True,
            ).logits
        all_logits.append(logits[:, -1])
        token, position = logits[:, -1:].argmax(-1), position + 1
    return torch.stack(all_logits)


@pytest.mark.parametrize("name", ["linear_elu", "taylor2_l2_window4"])
def test_static_state_is_updated_in_place(family, name):
    model = tiny_model(family, SPECS[name])
    static, dynamic = StaticCache(config=model.config, max_cache_len=32), DynamicCache(config=model.config)
    token, position = _prefilled(model, static)
    assert torch.equal(token, _prefilled(model, dynamic)[0])
    addresses = [[t.data_ptr() for t in layer.state.tensors()] for layer in static.layers]
    static_logits = _decode(model, static, token, position, steps=4)
    torch.testing.assert_close(static_logits, _decode(model, dynamic, token, position, steps=4), atol=1e-5, rtol=0)
    assert [[t.data_ptr() for t in layer.state.tensors()] for layer in static.layers] == addresses
    assert static.is_compileable and int(static.get_seq_length()) == 10 + 4


@pytest.mark.parametrize("name", ["linear_elu", "hedgehog_window3", "softmax_taylor_2"])
def test_one_compiled_decode_step_has_no_graph_break(family, name):
    model = tiny_model(family, SPECS[name])
    cache = StaticCache(config=model.config, max_cache_len=32)
    token, position = _prefilled(model, cache)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(
            input_ids=token, attention_mask=torch.ones_like(token), position_ids=position, cache=cache, use_cache=True
        )
    breaks = [f"{r.reason} at {r.user_stack[-1].filename}:{r.user_stack[-1].lineno}" for r in explained.break_reasons]
    assert explained.graph_break_count == 0, "graph breaks in the decode step: " + "; ".join(breaks)


@pytest.mark.parametrize(
    "name", ["hedgehog_window3", "softmax_taylor_2", "hedgehog_window3_sinks2", "hedgehog_window2_sinks1_kept2_decay"]
)
def test_compiled_static_decoding_matches_eager(family, name):
    """torch.compile of the decode step (the default inductor backend on CPU) through the static cache."""
    model = tiny_model(family, SPECS[name])
    eager_cache, compiled_cache = (StaticCache(config=model.config, max_cache_len=32) for _ in range(2))
    token, position = _prefilled(model, eager_cache)
    _prefilled(model, compiled_cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(
        _decode(compiled, compiled_cache, token, position, steps=3),
        _decode(model, eager_cache, token, position, steps=3),
        atol=1e-5,
        rtol=0,
    )


def test_a_compiled_decode_step_writes_window_and_kept_slots_in_place(family):
    """A compiled step writes the changed rows of the window keys and values and of the kept keys and
    values into the cache's buffers themselves: the compiled code allocates no buffer of their size (a
    whole-buffer copy each step, and a copy back, which the compiler makes of a buffer written by a
    scatter or read after its write)."""
    spec = AttentionSpec(kind="linear", feature_map="hedgehog", window=7, sinks=1, kept=5, decay=True, chunk_size=4)
    model = tiny_model(family, spec)
    cache = StaticCache(config=model.config, max_cache_len=32)
    token, position = _prefilled(model, cache)
    buffers = {
        tuple(getattr(layer.state, name).shape)
        for layer in cache.layers
        for name in ("window_keys", "window_values", "kept_keys", "kept_values")
    }
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    _, code = run_and_get_code(_decode, compiled, cache, token, position, 1)
    allocations = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", "\n".join(code))
    assert allocations, "the compiled code allocates nothing: the pattern no longer reads it"
    shapes = {tuple(int(size) for size in shape.split(",") if size.strip()) for shape in allocations}
    assert not buffers & shapes, sorted(buffers & shapes)


def test_static_cache_is_refused_when_a_layer_keeps_a_kv_cache(family):
    model = tiny_model(family, "linear_elu", layers=[0])
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=r"layers \[1\] .* keep a KV cache"):
        model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=2)
    with pytest.raises(ValueError, match="decodes from a KV cache"):
        model(input_ids=ids, attention_mask=mask, cache=StaticCache(config=model.config, max_cache_len=32))


def test_generate_hands_a_static_cache_the_new_columns_of_the_mask(family):
    model = tiny_model(family, "linear_elu")
    cache = StaticCache(config=model.config, max_cache_len=32)
    _prefilled(model, cache)
    ids, mask = left_padded_batch()
    step = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    embeds = torch.empty(ids.shape[0], 1, 0)
    made = model.create_masks_for_generate(model.config, embeds, step, cache)
    assert torch.equal(made, step[:, -1:].bool())
    assert model.create_masks_for_generate(model.config, embeds, torch.ones_like(step), cache) is None


@pytest.mark.parametrize("name", ["hedgehog_window3", "softmax_taylor_2"])
def test_transformers_compiled_generate_matches_recomputation_without_recompiling(family, name):
    """generate's own torch.compile of the decode step (forced on CPU), as on an accelerator."""
    model = tiny_model(family, SPECS[name])
    ids, mask = left_padded_batch()
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(
            ids, attention_mask=mask, cache_implementation="static", compile_config=compile_config, **GREEDY
        )
    assert_same_generation(compiled, model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY))

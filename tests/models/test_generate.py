"""`model.generate()` with the recurrent-state / KV cache against full recomputation without cache."""

import warnings

import pytest
import torch

from hf_softmax_rnn import PRESETS, AttentionSpec
from hf_softmax_rnn.layers import RecurrentStateLayer, cache_nbytes

from .helpers import VOCAB, left_padded_batch, tiny_model

HEAD_DIM = 8


def _spec(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the odd order-79 Taylor preset warns
        return AttentionSpec.from_preset(name)


RECURRENT_PRESETS = [name for name in PRESETS if _spec(name).fits_recurrent_state(HEAD_DIM)]
KV_PRESETS = [name for name in PRESETS if name not in RECURRENT_PRESETS]
GREEDY = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
pytestmark = pytest.mark.filterwarnings("ignore:AttentionSpec.taylor_order=79 is odd")


def test_presets_cover_both_cache_kinds():
    assert {"linear_elu", "linear_hedgehog", "softmax_taylor_2"} <= set(RECURRENT_PRESETS)
    assert {"softmax", "gated_softmax", "softmax_taylor_80terms"} <= set(KV_PRESETS)


def assert_same_generation(cached, uncached, rows=slice(None)):
    assert torch.equal(cached.sequences[rows], uncached.sequences[rows])
    assert len(cached.logits) == len(uncached.logits)
    for step_cached, step_uncached in zip(cached.logits, uncached.logits, strict=True):
        torch.testing.assert_close(step_cached[rows], step_uncached[rows], atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", [*RECURRENT_PRESETS, *KV_PRESETS])
def test_cached_greedy_generation_matches_recomputation(family, preset):
    model = tiny_model(family, preset)
    ids, mask = left_padded_batch()
    cached = model.generate(ids, attention_mask=mask, **GREEDY)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY)
    assert_same_generation(cached, uncached)
    assert [isinstance(layer, RecurrentStateLayer) for layer in cached.cache.layers] == [
        preset in RECURRENT_PRESETS
    ] * 2


@pytest.mark.parametrize(
    "preset", [*RECURRENT_PRESETS, "softmax", "gated_softmax", "gated_softmax_no_gate_L2norm_nodivS_noclamp"]
)
def test_left_padded_rows_match_their_unpadded_generation(family, preset):
    model = tiny_model(
        family, AttentionSpec.from_preset(preset, chunk_size=4) if preset in RECURRENT_PRESETS else preset
    )
    ids, mask = left_padded_batch(lengths=(10, 6, 3))
    batched = model.generate(ids, attention_mask=mask, **GREEDY)
    for row in range(ids.shape[0]):
        alone = ids[row : row + 1, ~mask[row].eq(0)]
        single = model.generate(alone, attention_mask=torch.ones_like(alone), **GREEDY)
        assert torch.equal(
            batched.sequences[row, -GREEDY["max_new_tokens"] :], single.sequences[0, -GREEDY["max_new_tokens"] :]
        )
        for step_batched, step_single in zip(batched.logits, single.logits, strict=True):
            torch.testing.assert_close(step_batched[row], step_single[0], atol=1e-4, rtol=0)


def test_recurrent_cache_memory_does_not_grow_with_generated_tokens(family):
    model = tiny_model(family, "softmax_taylor_2")
    ids, mask = left_padded_batch()
    sizes = {}
    for new_tokens in (1, 4, 16):
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True
        )
        sizes[new_tokens] = cache_nbytes(out.cache)
    features = AttentionSpec.from_preset("softmax_taylor_2").feature_dim(HEAD_DIM)
    kv_heads = model.config.num_key_value_heads if family == "llama" else model.config.n_head
    per_layer = ids.shape[0] * (kv_heads * features * (HEAD_DIM + 1) * 4 + 8)  # float32 S and z, int64 t
    assert sizes == {1: 2 * per_layer, 4: 2 * per_layer, 16: 2 * per_layer}


def test_kv_cache_memory_grows_with_generated_tokens(family):
    """The measure above can see growth: a softmax model's cache grows by K and V per token."""
    model = tiny_model(family, "softmax")
    ids, mask = left_padded_batch()
    sizes = [
        cache_nbytes(
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, do_sample=False, return_dict_in_generate=True
            ).cache
        )
        for n in (2, 6)
    ]
    kv_heads = model.config.num_key_value_heads if family == "llama" else model.config.n_head
    assert sizes[1] - sizes[0] == 4 * 2 * ids.shape[0] * 2 * kv_heads * HEAD_DIM * 4  # 4 tokens, 2 layers, K+V, float32


@pytest.mark.parametrize("preset", ["linear_elu", "softmax_taylor_2_l2", "gated_softmax", "gated_deltanet_conv"])
def test_beam_search_with_several_returned_sequences_matches_uncached(family, preset):
    model = tiny_model(family, preset)
    ids, mask = left_padded_batch()
    settings = dict(
        max_new_tokens=5,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    cached = model.generate(ids, attention_mask=mask, **settings)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert cached.sequences.shape[0] == 2 * ids.shape[0]
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", ["linear_hedgehog", "gated_softmax", "deltanet_conv"])
def test_seeded_sampling_with_several_returned_sequences_matches_uncached(family, preset):
    model = tiny_model(family, preset)
    ids, mask = left_padded_batch()
    settings = dict(max_new_tokens=6, do_sample=True, top_k=20, temperature=0.9, num_return_sequences=3)
    torch.manual_seed(123)
    cached = model.generate(ids, attention_mask=mask, **settings)
    torch.manual_seed(123)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert cached.shape[0] == 3 * ids.shape[0]
    assert torch.equal(cached, uncached)


def test_hybrid_keeps_a_kv_cache_for_softmax_layers_in_the_same_cache(family):
    model = tiny_model(family, "softmax_taylor_2", layers=[1])
    ids, mask = left_padded_batch()
    cached = model.generate(ids, attention_mask=mask, **GREEDY)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY)
    assert_same_generation(cached, uncached)
    first, second = cached.cache.layers
    assert (
        not isinstance(first, RecurrentStateLayer)
        and first.keys.shape[-2] == ids.shape[1] + GREEDY["max_new_tokens"] - 1
    )
    assert isinstance(second, RecurrentStateLayer) and second.get_seq_length() == first.get_seq_length()


def test_assisted_generation_is_refused_for_recurrent_states():
    model = tiny_model("llama", "linear_elu")
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, attention_mask=mask, assistant_model=tiny_model("llama", "linear_elu"), max_new_tokens=3)


SMALL_WINDOWS = {
    "hedgehog_window3": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, chunk_size=4),
    "taylor2_l2_window4": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="l2", window=4, chunk_size=3
    ),
}


@pytest.mark.parametrize("name", sorted(SMALL_WINDOWS))
def test_window_hybrids_generate_as_recomputation_past_the_window(family, name):
    """Prompts of 10 and 6 tokens and 6 new ones: the window is crossed in the prefill and while decoding."""
    model = tiny_model(family, SMALL_WINDOWS[name])
    ids, mask = left_padded_batch()
    cached = model.generate(ids, attention_mask=mask, **GREEDY)
    assert_same_generation(cached, model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY))
    beams = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, return_dict_in_generate=True)
    beam_cached = model.generate(ids, attention_mask=mask, **beams)
    assert torch.equal(
        beam_cached.sequences, model.generate(ids, attention_mask=mask, use_cache=False, **beams).sequences
    )
    sampling = dict(max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(5)
    sampled = model.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(ids, attention_mask=mask, use_cache=False, **sampling))
    for row in range(ids.shape[0]):
        alone = ids[row : row + 1, ~mask[row].eq(0)]
        single = model.generate(alone, attention_mask=torch.ones_like(alone), **GREEDY)
        assert torch.equal(cached.sequences[row, -6:], single.sequences[0, -6:])


STATE_SIZE_SPECS = {
    "hedgehog_window3": SMALL_WINDOWS["hedgehog_window3"],
    "hedgehog_window3_sinks1_kept2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=3, sinks=1, kept=2, decay=True, chunk_size=4
    ),
    "hedgehog_window3_delta_conv3": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=3, delta_rule=True, short_conv=3, chunk_size=4
    ),
    "hedgehog_window3_delta_mass": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=3, delta_rule=True, additive_mass=True, chunk_size=4
    ),
}


@pytest.mark.parametrize("name", sorted(STATE_SIZE_SPECS))
def test_window_state_is_constant_in_size_and_as_large_as_the_spec_says(family, name):
    spec = STATE_SIZE_SPECS[name]
    model = tiny_model(family, spec)
    ids, mask = left_padded_batch()
    sizes = {
        n: cache_nbytes(
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, do_sample=False, return_dict_in_generate=True
            ).cache
        )
        for n in (1, 8)
    }
    kv_heads = model.config.num_key_value_heads if family == "llama" else model.config.n_head
    state = spec.state_bytes(HEAD_DIM) * kv_heads + spec.window  # + window validity flags (bool)
    assert sizes[1] == sizes[8] == 2 * ids.shape[0] * (state + 8 + 8)  # 2 layers; + int64 t and ring start per row


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(cache_implementation="offloaded_static"),
            r"'offloaded_static' is not supported .*expected one of \[None, 'dynamic', 'offloaded', 'static'\]",
        ),
        (dict(output_attentions=True, return_dict_in_generate=True), "does not return attention weights"),
        (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), "empty prompt"),
        (dict(prefill_chunk_size=0), r"^prefill_chunk_size=0 is not allowed; expected None or an int >= 1"),
        (dict(prefill_chunk_size=2.5), r"^prefill_chunk_size=2\.5 is not allowed"),
    ],
    ids=["offloaded-static-cache", "attention-weights", "empty-prompt", "no-prefill-chunk", "float-prefill-chunk"],
)
def test_generate_refuses_what_it_cannot_do_with_a_message(family, settings, message):
    model = tiny_model(family, "linear_elu")
    ids, mask = left_padded_batch()
    inputs = {"input_ids": ids, "attention_mask": mask} if "input_ids" not in settings else {}
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, **settings, max_new_tokens=2)


def _right_padded(ids, mask):
    return torch.stack([row.roll(-int((m == 0).sum())) for row, m in zip(ids, mask, strict=True)]), mask.flip(1)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (_right_padded, "row 1 ends in padding: generate continues every row after its last column"),
        (lambda ids, mask: (ids, mask * torch.tensor([[1], [0]])), "row 1 masks every prompt token"),
        (lambda ids, mask: (ids, mask[:, 2:]), r"shape \[2, 8\] for 2 sequences of 10 new tokens"),
        (lambda ids, mask: (ids, torch.cat([mask, mask[:, :1]], 1)), "11 columns for a prompt of 10 tokens"),
    ],
    ids=["right-padded", "empty-row", "short-mask", "long-mask"],
)
def test_generate_refuses_prompt_masks_it_would_continue_wrongly(family, prompt, message):
    """transformers only warns about right padding, and continues every row after its last column,
    padding included; an empty row or a mask of another width has no right continuation either."""
    model = tiny_model(family, "hedgehog_window_64_sinks_4_decay")
    ids, mask = prompt(*left_padded_batch())
    with pytest.raises(ValueError, match=message):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        (torch.tensor([[5, VOCAB]]), ValueError, rf"input_ids holds {VOCAB}, outside the vocabulary: .*0..{VOCAB - 1}"),
        (torch.tensor([[5, -1]]), ValueError, "input_ids holds -1, outside the vocabulary"),
        (torch.tensor([[5.0, 6.0]]), TypeError, "input_ids has dtype torch.float32; expected integer token ids"),
    ],
    ids=["beyond-vocabulary", "negative", "float"],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_id(family, ids, error, message):
    model = tiny_model(family, "linear_elu")
    with pytest.raises(error, match=message):
        model(ids)
    with pytest.raises(error, match=message):
        model.generate(ids, max_new_tokens=1, do_sample=False)


@pytest.mark.parametrize("name", ["input_ids", "inputs_embeds"])
def test_a_forward_without_tokens_is_refused_naming_the_input(family, name):
    model = tiny_model(family, "linear_elu")
    inputs = torch.zeros(2, 0, dtype=torch.long) if name == "input_ids" else torch.zeros(2, 0, 32)
    with pytest.raises(ValueError, match=rf"^{name} has shape \[2, 0(, 32)?\]: no token to read"):
        model(**{name: inputs})


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("input_ids", (10,), r"\[B, L\]"),
        ("input_ids", (), r"\[B, L\]"),
        ("input_ids", (1, 2, 10), r"\[B, L\]"),
        ("inputs_embeds", (10, 32), r"\[B, L, 32\]"),
        ("inputs_embeds", (2, 10, 16), r"\[B, L, 32\]"),
    ],
    ids=["ids-1d", "ids-0d", "ids-3d", "embeds-2d", "embeds-narrow"],
)
def test_a_forward_of_another_shape_than_a_batch_is_refused_naming_it(family, name, shape, expected):
    """A single sequence's ids (1-D) would fail deep inside the layers (a RuntimeError of sizes)."""
    model = tiny_model(family, "linear_elu")
    inputs = torch.ones(shape, dtype=torch.long) if name == "input_ids" else torch.zeros(shape)
    shown = ", ".join(map(str, shape))
    with pytest.raises(ValueError, match=rf"^{name} has shape \[{shown}\]; expected {expected}, one row per sequence"):
        model(**{name: inputs})


def test_forward_refuses_a_mask_with_fewer_columns_than_tokens(family):
    model = tiny_model(family, "linear_elu")
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=r"attention_mask has shape \[2, 9\] for 2 sequences of 10 new tokens"):
        model(ids, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match=r"attention_mask has shape \[1, 10\] for 2 sequences"):
        model(ids, attention_mask=mask[:1])


def test_forward_refuses_output_attentions_and_warns_on_eager(family, caplog, tmp_path):
    model = tiny_model(family, "linear_elu")
    ids, _ = left_padded_batch()
    with pytest.raises(ValueError, match="does not return attention weights"):
        model(input_ids=ids, output_attentions=True)
    model.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        type(model).from_pretrained(tmp_path, attn_implementation="eager")
    assert "ignores attn_implementation='eager'" in caplog.text

"""`GraphedDecodeStep` on a GPU: replayed steps give the eager static-cache steps' logits and tokens
(unmodified transformers models and converted ones, left-padded prompts with position_ids), and the
cache advances with every replay.

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.decoding import GraphedDecodeStep, static_cache_from

from ..models.helpers import FAMILIES, left_padded_batch, tiny_model, tiny_source

pytestmark = pytest.mark.gpu

SPECS = {
    "linear_elu": "linear_elu",
    "softmax_taylor_2": "softmax_taylor_2",
    "hedgehog_window3": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, chunk_size=4),
    "hedgehog_window2_sinks1_kept2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=1, kept=2, decay=True, chunk_size=4
    ),
}
STEPS = 6


def _prefill(model, ids, mask):
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + STEPS)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
    return cache, logits[:, -1:].argmax(-1)


def _decode(step, token, position, steps=STEPS):
    logits = []
    for _ in range(steps):
        out = step(token, position) if position is not None else step(token)
        logits.append(out[:, -1].clone())
        token = out[:, -1:].argmax(-1)
        position = None if position is None else position + 1
    return torch.stack(logits)


def _compare(model, ids, mask, position):
    model = model.cuda()
    ids, mask = ids.cuda(), None if mask is None else mask.cuda()
    position = None if position is None else position.cuda()
    eager_cache, token = _prefill(model, ids, mask)
    graph_cache, _ = _prefill(model, ids, mask)

    def eager(token, position=None):
        with torch.no_grad():
            return model(input_ids=token, position_ids=position, cache=eager_cache, use_cache=True).logits

    graphed = GraphedDecodeStep(model, graph_cache, prompt_mask=mask)
    want, got = _decode(eager, token, position), _decode(graphed, token, position)
    assert graphed.graph is not None
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert int(graph_cache.get_seq_length()) == int(eager_cache.get_seq_length()) == ids.shape[1] + STEPS


@pytest.mark.parametrize("family", FAMILIES)
def test_unmodified_transformers_model(family):
    ids, _ = left_padded_batch(lengths=(8, 8))
    _compare(tiny_source(family), ids, None, None)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_converted_model_with_left_padded_prompts(family, name):
    ids, mask = left_padded_batch(lengths=(10, 6, 3))
    _compare(tiny_model(family, SPECS[name]), ids, mask, mask.sum(-1, keepdim=True))


def test_calls_must_keep_to_the_first_call_s_position_ids():
    model = tiny_model("llama", "linear_elu").cuda()
    ids, _ = left_padded_batch(lengths=(5,))
    cache, token = _prefill(model, ids.cuda(), None)
    step = GraphedDecodeStep(model, cache)
    step(token)
    with pytest.raises(ValueError, match="called with position_ids, unlike the first call"):
        step(token, torch.full((1, 1), 5, device="cuda"))


def test_a_full_kv_cache_is_refused_before_the_step():
    model = tiny_source("llama").cuda()
    ids, _ = left_padded_batch(lengths=(5,))
    cache = StaticCache(config=model.config, max_cache_len=7)
    with torch.no_grad():
        token = model(input_ids=ids.cuda(), cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    step = GraphedDecodeStep(model, cache)
    step(token)  # position 6, eager
    step(token)  # position 7, recorded and replayed
    with pytest.raises(ValueError, match="KV layers hold 7 positions, all used"):
        step(token)
    assert int(cache.get_seq_length()) == 7


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["transformers", "linear_elu", "hedgehog_window3"])
def test_one_prompt_repeated_into_a_static_cache_replays_the_repeated_dynamic_cache(family, name):
    """`static_cache_from(..., repeats=4)` then `GraphedDecodeStep`: the logits of eager steps from the
    dynamic cache repeated with `batch_repeat_interleave(4)`, each row decoding its own tokens."""
    model = (tiny_source(family) if name == "transformers" else tiny_model(family, SPECS[name])).cuda()
    ids, _ = left_padded_batch(lengths=(7,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.cuda(), cache=cache, use_cache=True)
        graphed = GraphedDecodeStep(model, static_cache_from(cache, model.config, ids.shape[1] + STEPS, repeats=4))
        cache.batch_repeat_interleave(4)
        tokens = torch.arange(1, 5, device="cuda")[:, None]
        for _ in range(STEPS):
            want = model(input_ids=tokens, cache=cache, use_cache=True).logits
            got = graphed(tokens).clone()
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            tokens = (tokens * 7 + 3) % 50 + 1  # each row its own next token
    assert graphed.graph is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decoding_of_a_kept_hybrid_matches_eager(family):
    """torch.compile's CUDA graphs ("reduce-overhead") over a static cache write the window and kept
    slots with `index_put_` in the cache's own buffers: the steps' logits are the eager steps'."""
    model = tiny_model(family, SPECS["hedgehog_window2_sinks1_kept2_decay"]).cuda()
    ids, mask = left_padded_batch(lengths=(10, 6, 3))
    ids, mask = ids.cuda(), mask.cuda()
    position = mask.sum(-1, keepdim=True)
    eager_cache, token = _prefill(model, ids, mask)
    compiled_cache, _ = _prefill(model, ids, mask)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)

    def step(forward, cache):
        def run(token, position):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return forward(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits

        return run

    want = _decode(step(model, eager_cache), token, position)
    got = _decode(step(compiled, compiled_cache), token, position)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

"""torch.compile of the whole model (fullgraph=True) against eager: a training forward with and
without a padding mask, and generate through a static cache with `model.forward` compiled.

The backend is "aot_eager": Dynamo's whole-graph capture and AOTAutograd, the part that fails on
Python the ops cannot trace, without the minutes of C++ code generation inductor spends on CPU."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec

from .helpers import VOCAB, left_padded_batch, tiny_model

# one finite-state preset per family (and a short convolution); the window hybrid's window (3) and chunk (4)
# are crossed
SPECS = {
    "linear_elu": "linear_elu",
    "linear_hedgehog": "linear_hedgehog",
    "softmax_taylor_2": "softmax_taylor_2",
    "hedgehog_window3": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, chunk_size=4),
    "deltanet_conv": AttentionSpec.from_preset("deltanet_conv", chunk_size=4),
}
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPECS))
def test_whole_model_compiled_forward_matches_eager(family, name):
    """Without a mask (transformers' traced packed-sequence mask function must not be mistaken for
    packed input) and with left padding."""
    model = tiny_model(family, SPECS[name])
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    ids, mask = left_padded_batch(lengths=(10, 6))
    plain = torch.randint(1, VOCAB, ids.shape, generator=torch.Generator().manual_seed(1))
    for inputs in (dict(input_ids=plain), dict(input_ids=ids, attention_mask=mask)):
        expected = model(**inputs, use_cache=False).logits
        torch.testing.assert_close(compiled(**inputs, use_cache=False).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPECS))
def test_compiled_forward_generates_through_a_static_cache_as_eager(family, name):
    model = tiny_model(family, SPECS[name])
    ids, mask = left_padded_batch(lengths=(10, 6))
    greedy = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")
    expected = model.generate(ids, **greedy)
    model.forward = torch.compile(model.forward, fullgraph=True, backend=BACKEND)
    assert torch.equal(model.generate(ids, **greedy), expected)


@pytest.mark.slow
def test_compiled_decoding_with_kept_positions_generates_as_eager(family):
    """Kept positions (with sinks and a decay), whose prefill reads the number of slots in use on the
    host (a graph break: not fullgraph) and whose decode step scores window, sinks and kept keys
    together (`ops.window_step`)."""
    spec = AttentionSpec(kind="linear", feature_map="hedgehog", window=2, sinks=1, kept=2, decay=True, chunk_size=4)
    model = tiny_model(family, spec)
    ids, mask = left_padded_batch(lengths=(10, 6))
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    expected = model.generate(ids, **greedy)
    model.forward = torch.compile(model.forward, backend=BACKEND)
    assert torch.equal(model.generate(ids, **greedy), expected)


@pytest.mark.slow
def test_compiled_model_refuses_packed_sequences(family):
    model = tiny_model(family, "linear_elu")
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    restarting = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(RuntimeError, match="position_ids restart or jump inside a row"):
        compiled(torch.randint(1, VOCAB, (1, 8)), position_ids=restarting, use_cache=False)

"""Perplexity by position bucket against per-token NLL from one plain full forward, bucketed by hand."""

import math

import pytest
import torch

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import next_token_nll
from hf_softmax_rnn.layers import softmax_rnn_attention_modules
from hf_softmax_rnn.long_context.positions import (
    buckets_from_edges,
    eval_sequences,
    no_cache_mode,
    position_perplexity,
    token_nll,
)

from .helpers import TEXTS, tiny_converted, tiny_gpt2, tiny_llama, tokenizer

MODELS = {
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    "converted-hedgehog_window_64": tiny_converted,
    "converted-linear_elu": lambda: tiny_converted("linear_elu"),
}
BUCKETS = ((0, 8), (8, 40), (50, 120))


@pytest.fixture(scope="module")
def byte_tok():
    return tokenizer()


def _by_hand(model, sequences: torch.Tensor, buckets) -> list[tuple[int, float, float]]:
    """(tokens, mean NLL, standard error) per bucket from the full-vocabulary logits of one plain forward."""
    with torch.no_grad():
        nll = next_token_nll(model(input_ids=sequences, use_cache=False).logits, sequences)
    rows = []
    for start, end in buckets:
        values = [nll[row, t - 1].item() for row in range(len(sequences)) for t in range(max(start, 1), end)]
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        rows.append((len(values), mean, math.sqrt(variance / len(values))))
    return rows


@pytest.mark.parametrize("join", [False, True], ids=["documents", "joined"])
@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_buckets_match_a_plain_forward_bucketed_by_hand(name, join, byte_tok):
    model = MODELS[name]().double()
    result = position_perplexity(
        model, byte_tok, TEXTS, BUCKETS, num_sequences=2, join=join, slice_size=7, progress=False
    )
    sequences = eval_sequences(byte_tok, TEXTS, 120, num_sequences=2, join=join)
    expected = _by_hand(model, sequences, BUCKETS)
    assert [(b["start"], b["end"]) for b in result["buckets"]] == list(BUCKETS)
    for bucket, (tokens, mean, stderr) in zip(result["buckets"], expected, strict=True):
        assert bucket["tokens"] == tokens
        assert bucket["mean_nll"] == pytest.approx(mean, rel=1e-9)
        assert bucket["stderr"] == pytest.approx(stderr, rel=1e-6)
        assert bucket["perplexity"] == pytest.approx(math.exp(mean), rel=1e-9)
    assert (result["sequences"], result["sequence_length"], result["tokens"]) == (2, 120, 240)


def test_sequences_are_document_starts_or_the_joined_stream(byte_tok):
    ids = [byte_tok(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    documents = eval_sequences(byte_tok, TEXTS, 100)
    assert documents.tolist() == [row[:100] for row in ids]
    stream = [token for row in ids for token in [*row, byte_tok.eos_token_id]]
    joined = eval_sequences(byte_tok, TEXTS, 100, join=True)
    assert joined.tolist() == [stream[i : i + 100] for i in range(0, len(stream) - 99, 100)]


def test_chunked_mode_scores_like_parallel_and_is_restored(byte_tok):
    model = tiny_converted("linear_elu", mode="parallel").double()
    ids = eval_sequences(byte_tok, TEXTS, 64, num_sequences=1)
    reference = token_nll(model, ids)
    with no_cache_mode(model, "chunked"):
        assert {m.attention_mode for m in softmax_rnn_attention_modules(model)} == {"chunked"}
        chunked = token_nll(model, ids)
    assert {m.attention_mode for m in softmax_rnn_attention_modules(model)} == {"parallel"}
    torch.testing.assert_close(chunked, reference, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        (((0, 64), (32, 128)), "starts before the previous bucket (0, 64) ends"),
        (((64, 128), (0, 64)), "starts before the previous bucket (64, 128) ends"),
        (((10, 10),), "bucket (10, 10) is not allowed"),
        (((-1, 10),), "bucket (-1, 10) is not allowed"),
        (((0, 1.5),), "bucket (0, 1.5) is not allowed"),
        ((), "buckets=() is not allowed"),
        (((0, 64), (64, 1024)), "bucket end=1024 is more than the model's 512 positions"),
        (((0, 1),), "bucket (0, 1) holds no scored position"),
        (((0, 1), (1, 8)), "bucket (0, 1) holds no scored position"),
    ],
    ids=[
        "overlapping",
        "unsorted",
        "empty-bucket",
        "negative",
        "float",
        "none",
        "beyond-positions",
        "position-0-alone",
        "position-0-alone-then-more",
    ],
)
def test_bad_buckets_are_refused_before_scoring(buckets, message, byte_tok, monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        position_perplexity(model, byte_tok, TEXTS, buckets, progress=False)


@pytest.mark.parametrize("name", ["llama", "converted-hedgehog_window_64"], ids=["llama", "converted"])
def test_positions_past_max_position_embeddings_are_scored_only_when_asked(name, byte_tok):
    """A rotary model scores positions past its 512 only with `past_max_positions`, then as a plain forward
    bucketed by hand does; without it the refusal names the opt-in."""
    model = MODELS[name]().double()
    buckets = ((0, 256), (256, 600))
    with pytest.raises(UserInputError, match=r"bucket end=600 is more than the model's 512 .*past_max_positions=True"):
        position_perplexity(model, byte_tok, TEXTS, buckets, num_sequences=1, join=True, progress=False)
    result = position_perplexity(
        model, byte_tok, TEXTS, buckets, num_sequences=1, join=True, progress=False, past_max_positions=True
    )
    expected = _by_hand(model, eval_sequences(byte_tok, TEXTS, 600, num_sequences=1, join=True), buckets)
    assert [b["mean_nll"] for b in result["buckets"]] == pytest.approx([mean for _, mean, _ in expected], rel=1e-9)
    assert (result["sequence_length"], result["max_positions"]) == (600, 512)


def test_a_learned_position_table_is_not_scored_past_its_rows(byte_tok, monkeypatch):
    """GPT-2 looks positions up in a table of 512 rows: past it there is nothing to score, asked or not."""
    model = tiny_gpt2()
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(UserInputError, match="bucket end=600 .* a learned table of 512 rows"):
        position_perplexity(
            model, byte_tok, TEXTS, ((0, 600),), num_sequences=1, join=True, progress=False, past_max_positions=True
        )


@pytest.mark.parametrize(
    ("join", "message"),
    [(False, "evaluation text 0 has 2[0-9]{2} tokens, fewer than the 400 positions"), (True, "fewer than the 9 asked")],
    ids=["document", "stream"],
)
def test_texts_shorter_than_the_buckets_are_refused(join, message, byte_tok):
    with pytest.raises(UserInputError, match=message):
        position_perplexity(tiny_llama(), byte_tok, TEXTS, ((0, 400),), num_sequences=9, join=join, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(slice_size=0), UserInputError, "slice_size=0 is not allowed"),
        (dict(texts=None), TypeError, "texts must be a list of strings, got NoneType"),
        (dict(texts=[]), ValueError, "texts=\\[\\] is empty"),
        (dict(join="no"), UserInputError, "join='no' is not allowed; expected True or False"),
        (dict(attention_mode="fast"), UserInputError, "attention_mode='fast' is not allowed"),
    ],
    ids=["slice-zero", "texts-none", "texts-empty", "join-string", "unknown-mode"],
)
def test_bad_arguments_are_refused_before_scoring(kwargs, error, message, byte_tok, monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(error, match=message):
        position_perplexity(model, byte_tok, **{"texts": TEXTS, "buckets": ((0, 64),), "progress": False, **kwargs})


@pytest.mark.parametrize("edges", [[0], [0, 64, 64], [64, 0]], ids=["one", "repeated", "decreasing"])
def test_bad_bucket_edges_are_refused(edges):
    with pytest.raises(UserInputError, match=r"bucket edges \["):
        buckets_from_edges(edges)


def test_bucket_edges_make_contiguous_buckets():
    assert buckets_from_edges([0, 64, 256]) == ((0, 64), (64, 256))

import math
import sys

import evaluate
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_softmax_rnn.metrics
from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.evaluation import perplexity

from ..models.helpers import LLAMA_SHAPE

TEXTS = ["Softmax attention is a sum of RNNs.", "The denominator is a norm.", "Keys and values."]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_SHAPE | dict(vocab_size=257, max_position_embeddings=128))
    model, tokenizer = LlamaForCausalLM(config).eval(), byte_tokenizer()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), model, tokenizer


@pytest.fixture(scope="module")
def metric():
    return evaluate.load(hf_softmax_rnn.metrics.path("perplexity"))


def test_corpus_perplexity_matches_evaluation_function(metric, saved_model):
    path, model, tokenizer = saved_model
    result = metric.compute(predictions=TEXTS, model_id=path, max_length=16, stride=5, batch_size=2, device="cpu")
    expected = perplexity(model, tokenizer, TEXTS, max_length=16, stride=5, progress=False)
    assert result["num_tokens"] == expected["num_tokens"]
    assert result["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)


def test_per_text_perplexity_matches_transformers_loss(metric, saved_model):
    path, model, tokenizer = saved_model
    result = metric.compute(predictions=TEXTS, model_id=path, per_text=True, device="cpu")
    expected = []
    for text in TEXTS:
        ids = torch.tensor([tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
        expected.append(math.exp(model(input_ids=ids, labels=ids, use_cache=False).loss.item()))
    assert result["perplexities"] == pytest.approx(expected, rel=1e-5)
    assert result["mean_perplexity"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(predictions=["fine", ""]), ValueError, r"\[1\] are empty"),
        (dict(dtype="float8"), ValueError, "dtype='float8'"),
        (dict(predictions=None), TypeError, "predictions must be a list of texts; got NoneType"),
        (dict(predictions=[]), ValueError, "predictions is empty"),
        (dict(predictions={"text": "a"}), TypeError, "predictions must be a list of texts; got dict"),
        (dict(predictions=["fine", 3]), TypeError, r"predictions \[1\] are not strings"),
        (dict(model_id=None), TypeError, "model_id must be a model folder.*got None"),
    ],
    ids=["empty-text", "bad-dtype", "none", "no-texts", "dict", "int-text", "no-model-id"],
)
def test_bad_input_is_rejected(metric, saved_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        metric.compute(**{"predictions": TEXTS, "model_id": saved_model[0], **kwargs})


def test_unknown_metric_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="mqar_accuracy"):
        hf_softmax_rnn.metrics.path("bleu")


def _load():
    return evaluate.load(hf_softmax_rnn.metrics.path("perplexity"))


def _add_in_batches(metric):
    metric.add_batch(predictions=TEXTS[:2])
    metric.add_batch(predictions=TEXTS[2:])


def _add_one_by_one(metric):
    for text in TEXTS:
        metric.add(prediction=text)


@pytest.mark.parametrize("add", [_add_in_batches, _add_one_by_one], ids=["add_batch", "add"])
def test_added_texts_are_scored_like_one_compute_call(saved_model, add):
    metric, window = _load(), dict(model_id=saved_model[0], max_length=16, stride=5, per_text=True, device="cpu")
    add(metric)
    streamed = metric.compute(**window)
    assert streamed == metric.compute(predictions=TEXTS, **window)
    assert len(streamed["perplexities"]) == len(TEXTS)


def test_compute_with_nothing_added_names_both_ways_to_give_texts(saved_model):
    with pytest.raises(TypeError, match=r"predictions must be a list of texts; got NoneType.*add\(\) or add_batch\(\)"):
        _load().compute(model_id=saved_model[0])


ADDED_BAD_TEXTS = {
    "none": (dict(predictions=None), TypeError, "predictions must be a list of texts; got NoneType"),
    "one-string": (dict(predictions="a text"), TypeError, "predictions must be a list of texts; got str"),
    "int-text": (dict(predictions=["fine", 3]), TypeError, r"predictions \[1\] are not strings"),
    "empty-text": (dict(predictions=["fine", ""]), ValueError, r"predictions \[1\] are empty strings"),
}


@pytest.mark.parametrize("batch,error,match", ADDED_BAD_TEXTS.values(), ids=ADDED_BAD_TEXTS.keys())
def test_bad_texts_added_in_a_batch_name_the_argument(batch, error, match):
    with pytest.raises(error, match=match):
        _load().add_batch(**batch)


@pytest.mark.parametrize(
    "prediction,error,match",
    [
        (None, TypeError, "prediction must be a text; got None"),
        (["a text"], TypeError, r"prediction must be a text; got \['a text'\]"),
        ("", ValueError, "prediction is an empty string"),
    ],
    ids=["none", "list", "empty"],
)
def test_bad_text_added_alone_names_the_argument(prediction, error, match):
    with pytest.raises(error, match=match):
        _load().add(prediction=prediction)


BAD_OPTIONS = {
    "float-max-length": (dict(max_length=16.0), TypeError, r"max_length=16\.0 is not allowed; expected an int >= 2"),
    "bool-max-length": (dict(max_length=True), TypeError, r"max_length=True is not allowed; expected an int >= 2"),
    "short-max-length": (dict(max_length=1), ValueError, r"max_length=1 is not allowed; expected an int >= 2"),
    "float-stride": (dict(stride=4.5), TypeError, r"stride=4\.5 is not allowed; expected an int >= 1"),
    "zero-stride": (dict(stride=0), ValueError, r"stride=0 is not allowed; expected an int >= 1"),
    "stride-past-window": (
        dict(max_length=16, stride=16),
        ValueError,
        r"stride=16 is not allowed for max_length=16; expected 1 <= stride <= 15",
    ),
    "string-batch-size": (dict(batch_size="2"), TypeError, r"batch_size='2' is not allowed; expected an int >= 1"),
    "zero-batch-size": (dict(batch_size=0), ValueError, r"batch_size=0 is not allowed; expected an int >= 1"),
    "string-add-eos": (dict(add_eos="no"), TypeError, r"add_eos='no' is not allowed; expected True or False"),
    "int-per-text": (dict(per_text=1), TypeError, r"per_text=1 is not allowed; expected True or False"),
    "bad-dtype": (dict(dtype="float8"), ValueError, r"dtype='float8' is not allowed; expected one of \['float32'"),
    "unknown-device": (dict(device="tpu"), ValueError, r"device='tpu' is not allowed; expected 'auto', 'cpu', 'cuda'"),
    "int-device": (dict(device=0), TypeError, r"device=0 is not allowed; expected 'auto', 'cpu', 'cuda'"),
    "cuda-without-cuda": (
        dict(device="cuda"),
        ValueError,
        r"device='cuda' is not available on this machine; expected one of \['auto', 'cpu'\]",
    ),
    "misspelt-option": (dict(max_lenght=16), TypeError, r"max_lenght is not an argument of compute; expected one of"),
}


@pytest.mark.parametrize("options,error,match", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_refused_before_the_model_is_loaded(monkeypatch, saved_model, options, error, match):
    metric = _load()

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(sys.modules[type(metric).__module__], "resolve_model", load_model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(error, match=match):
        metric.compute(predictions=TEXTS, model_id=saved_model[0], **options)


def test_bad_options_keep_the_added_texts_for_the_next_compute(saved_model):
    metric, window = _load(), dict(model_id=saved_model[0], max_length=16, stride=5, device="cpu")
    metric.add_batch(predictions=TEXTS)
    with pytest.raises(TypeError, match="batch_size=2.0"):
        metric.compute(batch_size=2.0, **window)
    assert metric.compute(batch_size=2, **window) == metric.compute(predictions=TEXTS, batch_size=2, **window)

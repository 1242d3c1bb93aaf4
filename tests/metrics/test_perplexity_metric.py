import math

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

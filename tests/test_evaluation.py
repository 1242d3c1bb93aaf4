import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import SoftmaxRNNLlamaConfig, SoftmaxRNNLlamaForCausalLM
from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.evaluation import perplexity, sliding_windows, stream_nll, token_stream

from .models.helpers import LLAMA_SHAPE

TEXTS = ["The cat sat on the mat.", "Attention is a sum of RNNs", "ok"]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


LLAMA_KWARGS = {**LLAMA_SHAPE, "vocab_size": 257, "max_position_embeddings": 128}
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_KWARGS)),
    "softmax_rnn-linear_elu": lambda: SoftmaxRNNLlamaForCausalLM(
        SoftmaxRNNLlamaConfig(attention="linear_elu", **LLAMA_KWARGS)
    ),
    "softmax_rnn-l2": lambda: SoftmaxRNNLlamaForCausalLM(
        SoftmaxRNNLlamaConfig(attention="gated_softmax_no_gate_L2norm_nodivS_noclamp", **LLAMA_KWARGS)
    ),
}


@pytest.fixture(scope="module", params=MODELS.values(), ids=MODELS.keys())
def model(request):
    torch.manual_seed(0)
    return request.param().double().eval()


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return MODELS["llama"]().double().eval()


def context_start(i: int, max_length: int, stride: int) -> int:
    """First context token of target i: the earliest window start j*stride with j*stride + max_length > i."""
    return stride * max(0, math.ceil((i - max_length + 1) / stride))


def direct_nll(model, ids: list[int], max_length: int, stride: int) -> float:
    """Score each token alone, with exactly the context the windowing promises."""
    total = 0.0
    for i in range(1, len(ids)):
        context = torch.tensor([ids[context_start(i, max_length, stride) : i]])
        logits = model(input_ids=context, use_cache=False).logits[0, -1]
        total -= torch.log_softmax(logits, -1)[ids[i]].item()
    return total


@pytest.mark.parametrize(
    "max_length,stride,batch_size",
    [(8, 1, 1), (8, 3, 2), (8, 7, 4), (9, 4, 3), (128, 64, 1)],
    ids=["stride1", "stride3-batch2", "stride7-batch4", "odd-length-batch3", "one-window"],
)
def test_perplexity_matches_per_token_scoring(model, tokenizer, max_length, stride, batch_size):
    ids = token_stream(tokenizer, TEXTS)
    result = perplexity(
        model, tokenizer, TEXTS, max_length=max_length, stride=stride, batch_size=batch_size, progress=False
    )
    expected = direct_nll(model, ids, max_length, stride)
    assert result["num_tokens"] == len(ids) - 1
    assert result["mean_nll"] == pytest.approx(expected / (len(ids) - 1), rel=1e-9)
    assert result["perplexity"] == pytest.approx(math.exp(expected / (len(ids) - 1)), rel=1e-9)


def test_one_window_equals_transformers_loss(llama, tokenizer):
    model = llama
    ids = token_stream(tokenizer, TEXTS)
    reference = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]), use_cache=False).loss.item()
    result = perplexity(model, tokenizer, TEXTS, max_length=len(ids), stride=1, progress=False)
    assert result["mean_nll"] == pytest.approx(reference, rel=1e-6)  # transformers computes the loss in float32


def test_token_stream_joins_texts_with_eos(tokenizer):
    ids = token_stream(tokenizer, ["ab", "c"])
    eos = tokenizer.eos_token_id
    assert ids == [*tokenizer("ab")["input_ids"], eos, *tokenizer("c")["input_ids"], eos]
    assert token_stream(tokenizer, ["ab", "c"], add_eos=False) == [*tokenizer("abc")["input_ids"]]


@pytest.mark.parametrize("num_tokens,max_length,stride", [(50, 8, 3), (50, 8, 7), (7, 8, 1), (2, 2, 1)], ids=str)
def test_sliding_windows_score_every_token_once(num_tokens, max_length, stride):
    windows = sliding_windows(num_tokens, max_length, stride)
    scored = [i for w in windows for i in range(w.score_from, w.end)]
    assert scored == list(range(1, num_tokens))
    assert all(w.end - w.begin <= max_length and w.score_from > w.begin for w in windows)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_length=8, stride=8), "stride=8"),
        (dict(max_length=8, stride=0), "stride=0"),
        (dict(max_length=1, stride=1), "max_length=1"),
        (dict(batch_size=0), "batch_size=0"),
    ],
    ids=["stride-too-large", "stride-zero", "max-length-one", "batch-zero"],
)
def test_bad_arguments_are_rejected(llama, tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        perplexity(llama, tokenizer, TEXTS, progress=False, **kwargs)


WRONGLY_TYPED_WINDOWS = {
    "float-max-length": (dict(max_length=16.0), r"max_length=16\.0 is not allowed; expected an int >= 2 or None"),
    "float-stride": (dict(max_length=16, stride=4.5), r"stride=4\.5 is not allowed; expected an int >= 1 or None"),
    "string-batch-size": (dict(batch_size="2"), r"batch_size='2' is not allowed; expected an int >= 1"),
    "bool-batch-size": (dict(batch_size=True), r"batch_size=True is not allowed; expected an int >= 1"),
}


@pytest.mark.parametrize("kwargs,match", WRONGLY_TYPED_WINDOWS.values(), ids=WRONGLY_TYPED_WINDOWS.keys())
def test_window_settings_that_are_not_ints_are_named(llama, tokenizer, kwargs, match):
    with pytest.raises(TypeError, match=match):
        perplexity(llama, tokenizer, TEXTS, progress=False, **kwargs)


def test_numpy_ints_are_window_settings_like_ints(llama, tokenizer):
    window = dict(max_length=16, stride=5, batch_size=2)
    expected = perplexity(llama, tokenizer, TEXTS, progress=False, **window)
    numpy_window = {name: np.int64(value) for name, value in window.items()}
    assert perplexity(llama, tokenizer, TEXTS, progress=False, **numpy_window) == expected


@pytest.mark.parametrize(
    "texts,error,match",
    [
        ("one text", TypeError, "not a single string"),
        (None, TypeError, "got NoneType"),
        ([], ValueError, r"texts=\[\] is empty"),
        (["a text", 3], TypeError, r"texts\[1\] is a int"),
    ],
    ids=["string", "none", "empty", "not-a-string"],
)
def test_texts_that_are_not_a_list_of_strings_are_rejected(llama, tokenizer, texts, error, match):
    with pytest.raises(error, match=match):
        perplexity(llama, tokenizer, texts, progress=False)


def test_windows_longer_than_the_models_positions_are_rejected(llama, tokenizer):
    limit = llama.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_length={limit + 1} is more than the model's {limit} positions"):
        perplexity(llama, tokenizer, TEXTS, max_length=limit + 1, progress=False)


def test_too_short_stream_is_rejected(llama):
    with pytest.raises(ValueError, match="num_tokens=1"):
        stream_nll(llama, [5], progress=False)

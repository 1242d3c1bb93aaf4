import json

import pytest
import torch
from datasets import Dataset, DatasetDict

from hf_softmax_rnn.data import generated
from hf_softmax_rnn.data.corpus import join_corpora, source_names
from hf_softmax_rnn.data.generated import FORMS, TOPICS, GenerationSettings, generated_corpus, prompts
from hf_softmax_rnn.errors import UserInputError

from ..training.helpers import TINY_MODELS, word_tokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TINY_MODELS["llama"]().eval(), word_tokenizer()


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setattr(generated.hub_constants, "HF_HOME", str(tmp_path))


def test_prompts_cover_every_topic_and_form_before_repeating():
    count = len(TOPICS) * len(FORMS)
    first = prompts(count, seed=3)
    assert len(set(first)) == count
    assert prompts(count + 5, seed=3)[:count] == first
    assert prompts(10, seed=4) != prompts(10, seed=3)


def test_generated_texts_are_the_model_samples_and_cached(tiny, monkeypatch):
    model, tokenizer = tiny
    settings = GenerationSettings(num_texts=5, max_new_tokens=6, batch_size=2)
    corpus = generated_corpus(model, tokenizer, settings, test_every=2, progress=False)
    texts = list(corpus["train"]["text"]) + list(corpus["test"]["text"])
    assert len(corpus["train"]) == 3 and len(corpus["test"]) == 2
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= 6 for t in texts)
    cached = [json.loads(line)["text"] for line in generated.cache_path(model, settings).read_text().splitlines()]
    assert sorted(cached) == sorted(texts)

    def fail(*args, **kwargs):
        raise AssertionError("a cached corpus was generated again")

    monkeypatch.setattr(generated, "generate_texts", fail)
    again = generated_corpus(model, tokenizer, settings, test_every=2, progress=False)
    assert list(again["train"]["text"]) == list(corpus["train"]["text"])


def test_cache_key_follows_settings_and_weights(tiny):
    model, _ = tiny
    base = generated.cache_path(model, GenerationSettings())
    assert generated.cache_path(model, GenerationSettings(num_texts=3)) != base
    other = TINY_MODELS["llama"]()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    assert generated.cache_path(other, GenerationSettings()) != base


@pytest.mark.parametrize(
    "field, value",
    [("num_texts", 0), ("max_new_tokens", -1), ("batch_size", 1.5), ("temperature", 0.0), ("top_p", 1.5)],
    ids=["no-texts", "negative-tokens", "float-batch", "zero-temperature", "top-p-above-1"],
)
def test_bad_generation_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        GenerationSettings(**{field: value})


def test_source_names_split_on_plus():
    assert source_names("pydoc+generated") == ["pydoc", "generated"]
    assert source_names(None) == ["pydoc"]


@pytest.mark.parametrize("value", ["pydoc+", "pydoc+pydoc", "+generated"], ids=["trailing", "twice", "leading"])
def test_bad_source_lists_are_refused(value):
    with pytest.raises(UserInputError, match="joined by"):
        source_names(value)


def test_join_trains_on_all_and_holds_out_the_first():
    def corpus(prefix):
        return DatasetDict(
            {
                "train": Dataset.from_dict({"text": [f"{prefix}{i}" for i in range(3)]}),
                "test": Dataset.from_dict({"text": [f"{prefix}-test"]}),
            }
        )

    joined = join_corpora([corpus("a"), corpus("b")])
    assert list(joined["train"]["text"]) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert list(joined["test"]["text"]) == ["a-test"]

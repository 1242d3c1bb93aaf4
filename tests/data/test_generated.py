import copy
import json

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerFast

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


def _bare(tokenizer, **special_tokens) -> PreTrainedTokenizerFast:
    """`tokenizer` without its eos token (and no pad token unless given)."""
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>", **special_tokens)


#: Prompts of different lengths in one batch: the shorter ones are padded on the left.
UNEVEN = GenerationSettings(num_texts=4, max_new_tokens=6, batch_size=4)


def test_a_tokenizer_without_eos_or_pad_writes_the_texts_the_model_stops_on_its_own_eos(tiny):
    model, tokenizer = tiny
    bare = _bare(tokenizer)
    assert (bare.eos_token_id, bare.pad_token_id, model.generation_config.eos_token_id) == (None, None, 1)
    assert len({len(bare(p)["input_ids"]) for p in prompts(UNEVEN.num_texts, UNEVEN.seed)}) > 1
    texts = generated.generate_texts(model, bare, UNEVEN, progress=False)
    assert texts == generated.generate_texts(model, tokenizer, UNEVEN, progress=False)  # cut at the model's eos
    assert not any("<eos>" in text for text in texts)


def test_without_any_eos_or_pad_the_padding_is_masked_and_every_text_runs_to_its_length(tiny):
    model, tokenizer = tiny
    endless = copy.deepcopy(model)
    endless.generation_config.eos_token_id = None
    texts = generated.generate_texts(endless, _bare(tokenizer), UNEVEN, progress=False)
    padded_otherwise = _bare(tokenizer, pad_token="<eos>")  # id 1 instead of 0; in no prompt, stops nothing here
    assert padded_otherwise.pad_token_id == 1
    assert texts == generated.generate_texts(endless, padded_otherwise, UNEVEN, progress=False)
    assert len(texts) == UNEVEN.num_texts and all(texts)


@pytest.mark.parametrize("count,held_out", [(3, 1), (16, 1), (33, 2)], ids=["fewer-than-16", "16", "33"])
def test_a_few_generated_texts_still_hold_one_out(tiny, count, held_out):
    model, tokenizer = tiny
    settings = GenerationSettings(num_texts=count, max_new_tokens=2, batch_size=64)
    corpus = generated_corpus(model, tokenizer, settings, progress=False)
    assert (len(corpus["train"]), len(corpus["test"])) == (count - held_out, held_out)

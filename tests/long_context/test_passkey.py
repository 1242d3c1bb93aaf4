"""Passkey retrieval: prompts built as documented, accuracy counted exactly on stub models that answer
right or wrong by rule, a real generate path, and bad input refused before any prompt is answered."""

import re
import tracemalloc

import pytest
import torch

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context.passkey import INSTRUCTION, NEEDLE, QUESTION, passkey_prompt, passkey_retrieval

from .helpers import TEXTS, tiny_converted, tokenizer

FILLER = TEXTS * 4
KEY_PATTERN = re.compile(r"The pass key is (\d{5})\. Remember it")


class StubModel(torch.nn.Module):
    """Answers " <key>." when `knows(fraction)` says so (fraction: where the key sits in the prompt
    text), else a wrong key; records every prompt."""

    def __init__(self, tok, knows, positions: int = 1024):
        super().__init__()
        self.tok, self.knows, self.prompts = tok, knows, []
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": positions})()

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert not do_sample and attention_mask.shape == input_ids.shape
        text = self.tok.decode(input_ids[0])
        self.prompts.append(input_ids[0].tolist())
        match = KEY_PATTERN.search(text)
        key = match.group(1) if self.knows(match.start() / len(text)) else str(int(match.group(1)) % 99999 + 1)
        answer = self.tok(f" {key}.", add_special_tokens=False)["input_ids"][:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([answer])], dim=1)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.mark.parametrize(
    ("knows", "depth_accuracy"),
    [
        (lambda fraction: True, {"0.1": 1.0, "0.3": 1.0, "0.7": 1.0, "0.9": 1.0}),
        (lambda fraction: False, {"0.1": 0.0, "0.3": 0.0, "0.7": 0.0, "0.9": 0.0}),
        (lambda fraction: fraction < 0.5, {"0.1": 1.0, "0.3": 1.0, "0.7": 0.0, "0.9": 0.0}),
    ],
    ids=["always-right", "always-wrong", "right-in-the-first-half"],
)
def test_accuracy_is_counted_per_length_and_depth(knows, depth_accuracy, tok):
    model = StubModel(tok, knows)
    result = passkey_retrieval(
        model, tok, FILLER, lengths=(300, 600), depths=(0.1, 0.3, 0.7, 0.9), trials=3, max_new_tokens=8, progress=False
    )
    accuracy = sum(depth_accuracy.values()) / len(depth_accuracy)
    for length in ("300", "600"):
        record = result["lengths"][length]
        assert record["depths"] == depth_accuracy
        assert (record["trials"], record["correct"], record["accuracy"]) == (12, round(12 * accuracy), accuracy)
        assert record["tokens"] == 12 * (int(length) - 8)
    assert len(result["answers"]) == 24
    assert [len(prompt) for prompt in model.prompts] == [292] * 12 + [592] * 12


def test_prompt_holds_the_key_once_at_its_depth(tok):
    filler = "".join(FILLER)  # ASCII: one byte token per character
    ids = passkey_prompt(tok, tok(filler, add_special_tokens=False)["input_ids"], 300, 0.25, 12345)
    needle = NEEDLE.format(key=12345)
    room = 300 - len(INSTRUCTION) - len(needle) - len(QUESTION)
    cut = round(0.25 * room)
    assert tok.decode(ids) == INSTRUCTION + filler[:cut] + needle + filler[cut:room] + QUESTION
    assert len(ids) == 300


def test_same_seed_same_questions_other_seed_other_keys(tok):
    runs = [
        passkey_retrieval(StubModel(tok, lambda f: True), tok, FILLER, lengths=(300,), depths=(0.5,), trials=4,
                          seed=seed, progress=False)["answers"]
        for seed in (0, 0, 1)
    ]  # fmt: skip
    keys = [[answer["key"] for answer in run] for run in runs]
    assert keys[0] == keys[1] != keys[2]
    assert all(10000 <= key <= 99999 for key in keys[0])


def test_a_converted_model_answers_as_greedy_decoding_without_a_cache(tok, monkeypatch):
    model = tiny_converted("hedgehog_window_64")
    prompts, generate = [], model.generate
    monkeypatch.setattr(
        model, "generate", lambda input_ids, **kw: prompts.append(input_ids) or generate(input_ids, **kw)
    )
    result = passkey_retrieval(model, tok, FILLER, lengths=(260,), depths=(0.5,), trials=2, progress=False)
    assert len(prompts) == len(result["answers"]) == 2
    for prompt, answer in zip(prompts, result["answers"], strict=True):
        ids = prompt
        with torch.no_grad():
            for _ in range(8):  # the full sequence each step, no cache
                ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        assert answer["answer"] == tok.decode(ids[0, prompt.shape[1] :], skip_special_tokens=True).strip()
        digits = re.search(r"\d+", answer["answer"])
        assert answer["correct"] == bool(digits and digits.group() == str(answer["key"]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": (300, 2048)}, "passkey length=2048 is more than the model's 1024 positions"),
        ({"depths": (0.5, 1.5)}, r"passkey depth=1.5 is not allowed; expected a number in \[0, 1\]"),
        ({"trials": 0}, "trials=0 is not allowed"),
        ({"lengths": (200,)}, r"passkey length=200 is too short: .* expected a length of at least 2[0-9]{2}"),
        ({"lengths": (3,)}, r"passkey length=3 is too short"),
        ({"lengths": ()}, r"lengths=\(\) and depths"),
        ({"seed": -1}, r"seed=-1 is not allowed; expected an int >= 0"),
        ({"seed": 1.5}, r"seed=1.5 is not allowed"),
        ({"lengths": (300, 400, 300)}, r"passkey lengths=\[300, 400, 300\] names 300 more than once"),
        ({"depths": (0.5, 0.2, 0.5)}, r"passkey depths=\[0.5, 0.2, 0.5\] names 0.5 more than once .*counted twice"),
    ],
    ids=[
        "beyond-positions",
        "depth",
        "trials",
        "too-short-for-the-prompt",
        "shorter-than-the-answer",
        "no-lengths",
        "negative-seed",
        "float-seed",
        "length-twice",
        "depth-twice",
    ],
)
def test_bad_settings_are_refused_before_any_answer(kwargs, message, tok):
    model = StubModel(tok, lambda f: pytest.fail("a prompt was answered"))
    with pytest.raises(UserInputError, match=message):
        passkey_retrieval(model, tok, FILLER, **{"lengths": (300,), **kwargs}, progress=False)


@pytest.mark.parametrize(
    "kwargs",
    [{"lengths": 300}, {"depths": 0.5}, {"lengths": "300"}],
    ids=["int-lengths", "float-depths", "str-lengths"],
)
def test_lengths_and_depths_must_be_lists(kwargs, tok):
    model = StubModel(tok, lambda f: pytest.fail("a prompt was answered"))
    name, value = next(iter(kwargs.items()))
    with pytest.raises(TypeError, match=f"{name}={value!r} is not allowed; expected a list"):
        passkey_retrieval(model, tok, FILLER, **{"lengths": (300,), **kwargs}, progress=False)


def test_a_prompt_past_max_position_embeddings_is_answered_only_when_asked(tok):
    """A rotary model with 512 positions answers a prompt of 600 tokens only with `past_max_positions`."""
    model = tiny_converted("linear_elu")
    with pytest.raises(UserInputError, match="passkey length=600 is more than the model's 512 .*--past-max-positions"):
        passkey_retrieval(model, tok, FILLER, lengths=(600,), depths=(0.5,), trials=1, progress=False)
    result = passkey_retrieval(
        model, tok, FILLER, lengths=(600,), depths=(0.5,), trials=1, progress=False, past_max_positions=True
    )
    assert result["lengths"]["600"]["trials"] == 1 and result["lengths"]["600"]["tokens"] == 592


def test_too_little_filler_is_refused(tok):
    model = StubModel(tok, lambda f: pytest.fail("a prompt was answered"))
    with pytest.raises(UserInputError, match="the filler texts hold 2[0-9]{2} tokens, fewer than .* 400"):
        passkey_retrieval(model, tok, TEXTS[:1], lengths=(400,), progress=False)


class _FirstAnswer(Exception):
    """Raised by a stub model to stop a run at its first answer."""


def test_a_run_of_many_trials_starts_answering_without_listing_them_first(tok):
    """trials=10**12 (a typo of 10**2) ran out of memory listing every (length, depth, trial) before the first
    answer, with a MemoryError's traceback; 10**6 of them took 100 MB before the first answer (under 40 kB now)."""

    def stop(fraction):
        raise _FirstAnswer

    tracemalloc.start()
    try:
        with pytest.raises(_FirstAnswer):
            passkey_retrieval(StubModel(tok, stop), tok, FILLER, lengths=(300,), depths=(0.5,), trials=10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak

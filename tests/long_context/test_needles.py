"""The needle suite: prompts built as documented, accuracy counted exactly on stub models that answer right or
wrong by rule, a real generate path, and bad input refused before any prompt is answered."""

import random
import re

import pytest
import torch

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context import passkey
from hf_softmax_rnn.long_context.needles import (
    FILLERS,
    TEMPLATES,
    VARIANTS,
    is_correct,
    needle_prompt,
    needle_retrieval,
    needle_table,
)

from .helpers import TEXTS, tiny_converted, tokenizer

#: (key, value) of a needle in any template's words.
NEEDLE = re.compile(r"(?:magic \w+ for (\w+) is: |\(The (\w+) \w+ is |NOTE\. (\w+): )([0-9a-z-]+)")
FILLER = TEXTS * 40


class StubModel(torch.nn.Module):
    """Answers the values of the keys its prompt's question names (`right`), or nothing; records prompts."""

    def __init__(self, tok, right=True, positions=4096):
        super().__init__()
        self.tok, self.right, self.prompts = tok, right, []
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": positions})()

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert not do_sample and attention_mask.shape == input_ids.shape
        text = self.tok.decode(input_ids[0])
        self.prompts.append(input_ids[0].tolist())
        needles = [(next(filter(None, match.groups()[:3])), match.group(4)) for match in NEEDLE.finditer(text)]
        question = text[text.rindex("\n\n") :]
        values = [value for key, value in needles if key in question] if self.right else ["nothing"]
        answer = self.tok(" " + ", ".join(values), add_special_tokens=False)["input_ids"][:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([answer])], dim=1)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_prompt_has_its_length_its_needles_in_the_filler_and_the_asked_values(tok, variant, template):
    shape = VARIANTS[variant]
    filler = tok("\n\n".join(FILLER), add_special_tokens=False)["input_ids"]
    prompt = needle_prompt(tok, filler, 1000, shape, TEMPLATES[template], random.Random(3))
    assert len(prompt.ids) == 1000
    text = tok.decode(prompt.ids)
    needles = [(next(filter(None, match.groups()[:3])), match.group(4)) for match in NEEDLE.finditer(text)]
    assert len(needles) == shape.keys * shape.values
    assert len({key for key, _ in needles}) == shape.keys
    question = text[text.rindex("\n\n") :]
    asked = {key for key, _ in needles if key in question}
    assert len(asked) == shape.asked
    assert sorted(prompt.expected) == sorted(value for key, value in needles if key in asked)
    assert len(prompt.expected) == shape.asked * shape.values
    stripped = text
    for key, value in needles:
        stripped = stripped.replace(TEMPLATES[template].needle.format(kind=_kind(shape), key=key, value=value), "", 1)
    body = stripped[len(TEMPLATES[template].preface.format(kind=_kind(shape))) : stripped.rindex("\n\n")]
    assert body in tok.decode(filler)  # the filler reads on unbroken between the needles


def _kind(shape):
    return {"number": "number", "word": "word", "uuid": "code"}[shape.value_kind]


def test_values_have_their_kind(tok):
    filler = tok("\n\n".join(FILLER), add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    number = needle_prompt(tok, filler, 300, VARIANTS["single_number"], TEMPLATES["bare"], rng).expected[0]
    word = needle_prompt(tok, filler, 300, VARIANTS["single_word"], TEMPLATES["bare"], rng).expected[0]
    uuid = needle_prompt(tok, filler, 300, VARIANTS["single_uuid"], TEMPLATES["bare"], rng).expected[0]
    assert re.fullmatch(r"\d{7}", number) and re.fullmatch(r"[a-z]+", word)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}", uuid)


def test_an_answer_is_right_only_with_every_asked_value():
    assert is_correct("The numbers are 1234567 and 7654321.", ["1234567", "7654321"])
    assert not is_correct("The number is 1234567.", ["1234567", "7654321"])
    assert is_correct("VOLCANO", ["volcano"]) and not is_correct("", ["volcano"])


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_accuracy_is_counted_per_cell(tok, right):
    model = StubModel(tok, right=right)
    settings = dict(lengths=[1000, 1500], prompts=3, eval_texts=FILLER, progress=False)
    result = needle_retrieval(model, tok, **settings)
    cells = result["cells"]
    assert len(cells) == len(VARIANTS) * len(TEMPLATES) * len(FILLERS) * 2
    assert all(cell["prompts"] == 3 and cell["accuracy"] == float(right) for cell in cells)
    assert len(model.prompts) == len(result["answers"]) == 3 * len(cells)
    assert all(cell["tokens"] == 3 * (cell["length"] - VARIANTS[cell["variant"]].answer_tokens) for cell in cells)
    again = StubModel(tok, right=right)
    needle_retrieval(again, tok, **settings)
    assert again.prompts == model.prompts  # the same seed asks the same questions
    cell = "100% (27/27)" if right else "0% (0/27)"  # 3 templates x 3 fillers x 3 prompts
    assert f"| single_uuid | 1,000 | {cell} | {cell} |" in needle_table(
        {"original": result, "model": result}, "variant"
    )


def test_a_tiny_converted_model_answers_through_generate(tok):
    """The quick form CI runs: every variant once, on a random converted model (its answers are noise)."""
    model = tiny_converted("hedgehog_window_64", mode="chunked")
    result = needle_retrieval(
        model, tok, templates=["bare"], fillers=["noise"], lengths=[400], prompts=1, eval_texts=FILLER, progress=False
    )
    assert [cell["variant"] for cell in result["cells"]] == list(VARIANTS)
    assert all(isinstance(answer["answer"], str) and answer["expected"] for answer in result["answers"])


def test_no_form_of_the_suite_is_the_calibration_prompt():
    """Retrieval layers are calibrated on passkey prompts over the training text: no template words its needle
    or question as they do, and no filler is the training text."""
    for template in TEMPLATES.values():
        assert "pass key" not in (template.preface + template.needle + template.question).lower()
    assert passkey.NEEDLE.strip() not in {template.needle.strip() for template in TEMPLATES.values()}
    assert "pydoc" not in FILLERS


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(variants=["single_number", "needle"]), r"variant='needle' is not allowed; expected one of \['single_"),
        (dict(templates=["chat"]), r"template='chat' is not allowed; expected one of \['instructed', 'bare'"),
        (dict(fillers=["wiki"]), r"filler='wiki' is not allowed; expected one of \['shakespeare', 'code', 'noise'\]"),
        (dict(variants=[]), r"variants=\[\] is not allowed; expected a non-empty list"),
        (dict(prompts=0), r"prompts=0"),
        (dict(lengths=[8000]), r"needle prompt length"),
        (
            dict(lengths=[40]),
            r"^needle prompt length=40 \('single_number': \d+ tokens of prompt before its \d+-token answer\): a needle "
            r"prompt of \d+ tokens cannot hold 1 needles with filler between them",
        ),
        (dict(fillers=["shakespeare"], eval_texts=["short text"]), r"needs \d+ filler tokens, more than the"),
        (dict(variants=["single_number", "single_number"]), r"^variants=\['single_number', 'single_number'\] names"),
        (
            dict(lengths=[1000, 1000]),
            r"^lengths=\[1000, 1000\] names 1000 more than once \(its cell would count its prompts twice\)",
        ),
        (
            dict(lengths=[1]),
            r"^needle prompt length=1 is not allowed for 'single_number': its answer alone takes \d+ tokens; expected "
            r"a length above that",
        ),
    ],
    ids=[
        "variant",
        "template",
        "filler",
        "no-variants",
        "no-prompts",
        "beyond-positions",
        "too-short",
        "filler",
        "repeated-variant",
        "repeated-length",
        "shorter-than-the-answer",
    ],
)
def test_bad_settings_are_refused_before_any_prompt_is_answered(tok, settings, message):
    model = StubModel(tok, positions=4096)
    arguments = dict(lengths=[1000], prompts=1, eval_texts=FILLER, progress=False) | settings
    with pytest.raises(UserInputError, match=message):
        needle_retrieval(model, tok, **arguments)
    assert model.prompts == []

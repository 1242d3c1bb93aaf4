"""Needle-in-a-haystack retrieval in many forms, in the manner of RULER's NIAH tasks.

A prompt hides one or more needles ("the value of KEY is VALUE") in filler text and asks for one or
more of them; the model answers greedily with `generate` (its own cache: the recurrent state of a
converted model), and the prompt counts as right when every asked value appears in the answer. The
suite varies what a passkey test holds fixed:

- variants (`VARIANTS`): what is hidden and asked: one needle whose value is a number, a word or a
  UUID-like string; several needles with one asked (the others distract); several values for one key,
  all asked; several needles, two asked.
- templates (`TEMPLATES`): how the prompt reads: with an instruction and the needle inline, without
  any instruction and the needle as a parenthesis, or the needle set apart as a note; each words its
  question its own way.
- fillers (`FILLERS`): what the needles hide in: Shakespeare's plays, Python's standard-library source
  code, or RULER's repeated noise sentences.

None of these forms is the passkey prompt (`long_context.passkey`) that `retrieval_scores` calibrates
retrieval layers on, with the training text as filler: a converted model is scored here on forms no
calibration or training step read. Keys, values, needle depths and filler offsets come from
`random.Random(seed)` per cell, so a run with the same arguments asks the same questions.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import random
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.data.eval_texts import shakespeare_plays
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import check_within_positions
from hf_softmax_rnn.long_context.passkey import greedy_answer
from hf_softmax_rnn.long_context.positions import check_count
from hf_softmax_rnn.utils import check_distinct, device_memory_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """What a prompt hides and asks: `keys` needles' keys, `values` values per key, `asked` keys asked,
    values of kind `value_kind` ("number", "word" or "uuid"), and the answer tokens it leaves room for."""

    keys: int
    values: int
    asked: int
    value_kind: str
    answer_tokens: int


VARIANTS: dict[str, Variant] = {
    "single_number": Variant(keys=1, values=1, asked=1, value_kind="number", answer_tokens=16),
    "single_word": Variant(keys=1, values=1, asked=1, value_kind="word", answer_tokens=16),
    "single_uuid": Variant(keys=1, values=1, asked=1, value_kind="uuid", answer_tokens=32),
    "multi_key": Variant(keys=4, values=1, asked=1, value_kind="number", answer_tokens=16),
    "multi_value": Variant(keys=1, values=3, asked=1, value_kind="number", answer_tokens=40),
    "multi_query": Variant(keys=4, values=1, asked=2, value_kind="number", answer_tokens=40),
}


@dataclass(frozen=True)
class Template:
    """How a prompt reads: `preface` before the filler, `needle` (formatted with key and value) inserted in
    it, and `question` (formatted with the asked keys, `keys`, the value's name, `kind`, and `kinds`, the
    name in the number the answer holds) after it, ending where the answer begins."""

    preface: str
    needle: str
    question: str


_KIND_NAMES = {"number": "number", "word": "word", "uuid": "code"}
TEMPLATES: dict[str, Template] = {
    "instructed": Template(
        preface=(
            "Some special magic {kind}s are hidden inside the following text. Make sure to memorize them. I will "
            "quiz you about them afterwards.\n\n"
        ),
        needle=" One of the special magic {kind}s for {key} is: {value}. ",
        question=(
            "\n\nWhat are all the special magic {kind}s for {keys} mentioned in the text above? Answer: the special "
            "magic {kinds} for {keys}:"
        ),
    ),
    "bare": Template(
        preface="",
        needle=" (The {key} {kind} is {value}.) ",
        question="\n\nQ: Which {kinds} belong to {keys}?\nA: The {kinds} of {keys}:",
    ),
    "set_apart": Template(
        preface="Read the document below.\n\n",
        needle="\n\n---\nNOTE. {key}: {value}\n---\n\n",
        question="\n\nThe document contained a note for {keys}. Copy it here.\nNOTE. {keys}:",
    ),
}

FILLERS = ("shakespeare", "code", "noise")
#: RULER's noise filler: the same five sentences again and again.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: Standard-library modules whose source is the "code" filler (Python, comments and docstrings included).
_CODE_MODULES = ("json.decoder", "json.encoder", "argparse", "textwrap", "calendar", "fractions", "statistics")
_KEY_WORDS = (
    "amber", "basalt", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
    "lantern", "meadow", "nimbus", "orchid", "pebble", "quartz", "raven", "saffron", "thistle", "ursa", "velvet",
    "willow", "zephyr",
)  # fmt: skip
_VALUE_WORDS = (
    "apricot", "bicycle", "canyon", "dolphin", "envelope", "festival", "glacier", "hammock", "igloo", "jasmine",
    "kangaroo", "lighthouse", "marathon", "notebook", "octopus", "pyramid", "quilt", "rainbow", "saxophone",
    "telescope", "umbrella", "volcano", "waterfall", "yogurt",
)  # fmt: skip
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
_CELL_FIELDS = ("variant", "template", "filler", "length")


def filler_texts(kind: str, eval_texts: Sequence[str] | None = None) -> list[str]:
    """The texts of filler `kind`: "shakespeare" (`eval_texts`, else the plays of `data.eval_texts`), "code"
    (standard-library source) or "noise"."""
    check_names("filler", [kind], FILLERS)
    if kind == "noise":
        return [NOISE * 2000]
    if kind == "code":
        return [inspect.getsource(importlib.import_module(name)) for name in _CODE_MODULES]
    return list(eval_texts) if eval_texts is not None else shakespeare_plays()


def check_names(what: str, names: Sequence[str], allowed: Sequence[str]) -> None:
    """UserInputError naming the first of `names` not in `allowed` (and the allowed ones), or for no names."""
    if isinstance(names, str) or not names:
        raise UserInputError(f"{what}s={names!r} is not allowed; expected a non-empty list of {list(allowed)}")
    for name in names:
        if name not in allowed:
            raise UserInputError(f"{what}={name!r} is not allowed; expected one of {list(allowed)}")


def _value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "word":
        return rng.choice(_VALUE_WORDS)
    hexdigits = string.hexdigits[:16]
    return "-".join("".join(rng.choice(hexdigits) for _ in range(size)) for size in (8, 4, 4))


@dataclass(frozen=True)
class NeedlePrompt:
    """One prompt: its token ids and the values the answer must hold."""

    ids: list[int]
    expected: tuple[str, ...]


def needle_prompt(
    tokenizer,
    filler: Sequence[int],
    prompt_tokens: int,
    variant: Variant,
    template: Template,
    rng: random.Random,
) -> NeedlePrompt:
    """A prompt of exactly `prompt_tokens` tokens: the needles of `variant` at random depths of `filler`'s
    first tokens, in `template`'s words."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    kind = _KIND_NAMES[variant.value_kind]
    keys = rng.sample(_KEY_WORDS, variant.keys)
    needles = [(key, _value(variant.value_kind, rng)) for key in keys for _ in range(variant.values)]
    rng.shuffle(needles)
    asked = keys[: variant.asked]
    head = encode(template.preface.format(kind=kind))
    kinds = kind if variant.values * variant.asked == 1 else f"{kind}s"
    question = encode(template.question.format(kind=kind, kinds=kinds, keys=" and ".join(asked)))
    pieces = [encode(template.needle.format(kind=kind, key=key, value=value)) for key, value in needles]
    room = prompt_tokens - len(head) - len(question) - sum(map(len, pieces))
    if room < len(pieces) + 1:
        raise UserInputError(
            f"a needle prompt of {prompt_tokens} tokens cannot hold {len(pieces)} needles with filler between them: "
            f"the frame and needles take {prompt_tokens - room} tokens; pass a longer length or fewer needles"
        )
    if room > len(filler):
        raise UserInputError(
            f"a needle prompt of {prompt_tokens} tokens needs {room} filler tokens, more than the {len(filler)} of the "
            "filler texts; pass more filler text or a shorter length"
        )
    cuts = sorted(rng.sample(range(1, room), len(pieces)))
    ids, start = list(head), 0
    for cut, piece in zip(cuts, pieces, strict=True):
        ids += [*filler[start:cut], *piece]
        start = cut
    ids += [*filler[start:room], *question]
    expected = tuple(value for key, value in needles if key in asked)
    return NeedlePrompt(ids, expected)


def is_correct(answer: str, expected: Sequence[str]) -> bool:
    """Every expected value appears in the answer (case-insensitive)."""
    return all(value.lower() in answer.lower() for value in expected)


def check_needle_settings(
    model,
    variants: Sequence[str],
    templates: Sequence[str],
    fillers: Sequence[str],
    lengths: Sequence[int],
    prompts: int,
    seed: int,
    past_max_positions: bool = False,
) -> None:
    """Refuse names outside the suite, counts below 1, lengths beyond the model's positions, and a value named
    twice (its cell would count its prompts twice)."""
    check_names("variant", variants, tuple(VARIANTS))
    check_names("template", templates, tuple(TEMPLATES))
    check_names("filler", fillers, FILLERS)
    check_count("prompts", prompts)
    check_count("seed", seed, minimum=0)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise UserInputError(f"lengths={lengths!r} is not allowed; expected a non-empty list of ints")
    for what, values in (("variants", variants), ("templates", templates), ("fillers", fillers), ("lengths", lengths)):
        check_distinct(f"{what}={list(values)!r}", values, "its cell would count its prompts twice")
    for length in lengths:
        check_count("needle prompt length", length)
        check_within_positions(model, length, "needle prompt length", past_max_positions=past_max_positions)
    _check_prompts_fit(prompts, len(variants) * len(templates) * len(fillers), lengths)


#: Bytes a built prompt holds per token at least: a pointer in its list of ids.
PROMPT_TOKEN_BYTES = 8


def _check_prompts_fit(prompts: int, cells_per_length: int, lengths: Sequence[int]) -> None:
    """The prompts of every cell, all built before the first is answered, fit in the machine's memory (at
    `PROMPT_TOKEN_BYTES` a token), else an error naming `prompts` and the most that would fit."""
    per_prompt = PROMPT_TOKEN_BYTES * cells_per_length * sum(lengths)
    memory = device_memory_bytes("cpu")
    if memory is not None and prompts * per_prompt > memory:
        raise UserInputError(
            f"prompts={prompts:,} is not allowed: the {cells_per_length * len(lengths)} cells' prompts are all built "
            f"before the first is answered, at least {prompts * per_prompt:,} bytes, more than the machine's "
            f"{memory:,}; expected prompts <= {memory // per_prompt:,}"
        )


@torch.inference_mode()
def needle_retrieval(
    model,
    tokenizer,
    *,
    variants: Sequence[str] = tuple(VARIANTS),
    templates: Sequence[str] = tuple(TEMPLATES),
    fillers: Sequence[str] = FILLERS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    prompts: int = 4,
    seed: int = 0,
    eval_texts: Sequence[str] | None = None,
    progress: bool = True,
    past_max_positions: bool = False,
) -> dict:
    """Accuracy of greedy answers for every (variant, template, filler, length) cell of `prompts` prompts.

    Every prompt of every cell is built (and refused, when its filler or length cannot hold it) before
    the first is answered. `eval_texts`: the "shakespeare" filler's texts (default: the plays).

    Returns {"cells": [{"variant", "template", "filler", "length", "correct", "prompts", "accuracy",
    "tokens" (prompt tokens read), "seconds"}], "answers": [{"variant", "template", "filler", "length",
    "expected", "answer", "correct"}]}.
    """
    check_needle_settings(model, variants, templates, fillers, lengths, prompts, seed, past_max_positions)
    streams = {}
    for kind in fillers:
        ids: list[int] = []
        for text in filler_texts(kind, eval_texts):
            ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
            if len(ids) >= 2 * max(lengths):
                break
        streams[kind] = ids
    cases = []
    for variant in variants:
        for template in templates:
            for kind in fillers:
                for length in lengths:
                    rng = random.Random(f"{seed}/{variant}/{template}/{kind}/{length}")
                    room = length - VARIANTS[variant].answer_tokens
                    if room < 1:
                        raise UserInputError(
                            f"needle prompt length={length} is not allowed for {variant!r}: its answer alone takes "
                            f"{VARIANTS[variant].answer_tokens} tokens; expected a length above that, with room for "
                            "the frame, the needles and filler"
                        )
                    stream = streams[kind]
                    for _ in range(prompts):
                        offset = rng.randrange(0, max(1, len(stream) - room + 1))
                        try:
                            prompt = needle_prompt(
                                tokenizer, stream[offset:], room, VARIANTS[variant], TEMPLATES[template], rng
                            )
                        except UserInputError as error:
                            raise UserInputError(
                                f"needle prompt length={length} ({variant!r}: {room} tokens of prompt before its "
                                f"{VARIANTS[variant].answer_tokens}-token answer): {error}"
                            ) from error
                        cases.append(((variant, template, kind, length), prompt))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    cells: dict[tuple, dict] = {}
    answers = []
    try:
        for cell, prompt in tqdm(cases, desc="Needles", unit="prompt", disable=not progress):
            started = time.perf_counter()
            answer = greedy_answer(model, tokenizer, prompt.ids, VARIANTS[cell[0]].answer_tokens, device)
            correct = is_correct(answer, prompt.expected)
            names = dict(zip(_CELL_FIELDS, cell, strict=True))
            record = cells.setdefault(cell, {**names, "correct": 0, "prompts": 0, "tokens": 0, "seconds": 0.0})
            record["correct"] += correct
            record["prompts"] += 1
            record["tokens"] += len(prompt.ids)
            record["seconds"] = round(record["seconds"] + time.perf_counter() - started, 2)
            answers.append({**names, "expected": list(prompt.expected), "answer": answer, "correct": correct})
    finally:
        model.train(was_training)
    for record in cells.values():
        record["accuracy"] = record["correct"] / record["prompts"]
    return {"cells": list(cells.values()), "answers": answers}


def needle_table(results: dict[str, dict], by: str) -> str:
    """A Markdown table of accuracy per `by` ("variant", "template" or "filler") and length, one column per
    model of `results` ({label: `needle_retrieval` result}), the first model as the reference."""
    labels = list(results)
    lengths = sorted({cell["length"] for cell in results[labels[0]]["cells"]})
    groups = list(dict.fromkeys(cell[by] for cell in results[labels[0]]["cells"]))
    header = f"| {by} | length | " + " | ".join(labels) + " |"
    rows = [header, "|" + "---|" * (2 + len(labels))]
    for group in groups:
        for length in lengths:
            cells = []
            for label in labels:
                chosen = [c for c in results[label]["cells"] if c[by] == group and c["length"] == length]
                correct, total = sum(c["correct"] for c in chosen), sum(c["prompts"] for c in chosen)
                cells.append(f"{correct / total:.0%} ({correct}/{total})" if total else "-")
            rows.append(f"| {group} | {length:,} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_results(results: dict[str, dict], folder: Path) -> Path:
    """Write `results` ({label: `needle_retrieval` result}) to `folder`/needles.json."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "needles.json"
    path.write_text(json.dumps(results, indent=1))
    return path

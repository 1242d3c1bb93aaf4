"""`hf-softmax-rnn needles`: needle-in-a-haystack retrieval in many forms, a model beside its original.

    hf-softmax-rnn needles --model out/hybrid --lengths 1024 2048 4096 --prompts 4
    hf-softmax-rnn needles --model out/hybrid --variants single_number multi_key --templates bare --no-finite-state

Every (variant, template, filler, length) cell asks `--prompts` prompts of each model
(`hf_softmax_rnn.long_context.needles`); the report gives accuracy by variant, by template and by filler
and length, the original beside the model. None of the forms is the passkey prompt that `finetune`
calibrates retrieval layers on. One prompt is 100 / N points of a cell of N prompts, and a row of a
table sums the cells of the other two axes (3 templates x 3 fillers by default).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import types
from pathlib import Path

from hf_softmax_rnn.commands.evaluate import ORIGINAL, original_of
from hf_softmax_rnn.data.eval_texts import DEFAULT_EVAL_TEXTS, load_eval_texts
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS, resolve_config, resolve_model
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import add_dataclass_arguments, option
from hf_softmax_rnn.long_context.needles import (
    DEFAULT_LENGTHS,
    FILLERS,
    TEMPLATES,
    VARIANTS,
    check_needle_settings,
    needle_retrieval,
    needle_table,
    write_results,
)
from hf_softmax_rnn.long_context.state import finite_state_off


@dataclasses.dataclass(frozen=True)
class NeedlesOptions:
    """The flags of `needles` (each field is the flag of the same name)."""

    model: str = option(DEFAULT_MODEL_ALIAS, "model to evaluate: 'default' (the embedded model), a folder or a Hub id")
    original: str | None = option(
        None,
        "the model to compare with; default: the one a `finetune` output folder names, else 'default'; 'none' for "
        "no comparison",
    )
    variants: list[str] = option(list(VARIANTS), "what is hidden and asked", choices=list(VARIANTS))
    templates: list[str] = option(list(TEMPLATES), "how the prompt reads", choices=list(TEMPLATES))
    fillers: list[str] = option(list(FILLERS), "what the needles hide in", choices=list(FILLERS))
    lengths: list[int] = option(list(DEFAULT_LENGTHS[:2]), "prompt lengths in tokens, answer included")
    prompts: int = option(4, "prompts per (variant, template, filler, length) cell")
    seed: int = option(0, "seed of the keys, values, depths and filler offsets")
    texts: str = option(DEFAULT_EVAL_TEXTS, "texts of the 'shakespeare' filler: 'shakespeare' or local files")
    past_max_positions: bool = option(False, "allow lengths past the models' max_position_embeddings")
    finite_state: bool = option(
        True,
        "ask the model (not the original) with the finite-state part of its hybrid layers switched off",
        flag="--no-finite-state",
    )
    output: str | None = option(None, "folder for needles.json (default: no file)")
    progress: bool = option(True, "no progress bars", flag="--no-progress")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, NeedlesOptions)


def run(args: argparse.Namespace) -> str:
    options = NeedlesOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(NeedlesOptions)})
    if options.output is not None and Path(options.output).is_file():
        raise UserInputError(f"--output {options.output!r} is a file; expected a folder")
    if options.texts != DEFAULT_EVAL_TEXTS and "shakespeare" not in options.fillers:
        raise UserInputError(
            f"--texts {options.texts!r} sets the texts of the 'shakespeare' filler, which --fillers "
            f"{' '.join(options.fillers)} leaves out; add shakespeare to --fillers or drop --texts"
        )
    original = options.original or original_of(options.model)
    names = {ORIGINAL: original, "model": options.model}
    if original.lower() == "none" or original == options.model:
        names = {"model": options.model}
    for name in names.values():  # a name that names no model, or a setting it cannot take, stops before any loads
        without_weights = types.SimpleNamespace(config=resolve_config(name))
        check_needle_settings(
            without_weights,
            options.variants,
            options.templates,
            options.fillers,
            options.lengths,
            options.prompts,
            options.seed,
            options.past_max_positions,
        )
    texts = load_eval_texts(options.texts) if "shakespeare" in options.fillers else None
    settings = dict(
        variants=options.variants,
        templates=options.templates,
        fillers=options.fillers,
        lengths=options.lengths,
        prompts=options.prompts,
        seed=options.seed,
        eval_texts=texts,
        progress=options.progress,
        past_max_positions=options.past_max_positions,
    )
    results = {}
    for label, name in names.items():
        model, tokenizer = resolve_model(name)
        with contextlib.ExitStack() as stack:
            if label == "model" and not options.finite_state:
                stack.enter_context(finite_state_off(model))
            results[f"{label} ({name})"] = needle_retrieval(model, tokenizer, **settings)
    state = "" if options.finite_state else "; the model's finite state switched off"
    report = [f"Needles: {options.prompts} prompts per cell, seed {options.seed}{state}"]
    for axis in ("variant", "template", "filler"):
        report += ["", needle_table(results, axis)]
    if options.output is not None:
        path = write_results(results, Path(options.output))
        report += ["", f"Wrote {path}"]
    return "\n".join(report)

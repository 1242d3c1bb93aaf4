"""`hf-softmax-rnn` console script: one subcommand per job, each in its own module.

A subcommand module defines `add_arguments(parser)` (its flags, built from the fields of
its settings dataclasses, which hold each flag's help: `hf_softmax_rnn/flags.py`) and
`run(args) -> str | None`, which returns its report (printed here, exit status 0); it is
imported only when its subcommand runs, so `--help` stays fast. The environment settings and
output folders are checked (`check_environment`, `check_output_folders`) before a subcommand
starts. Bad input (`UserInputError`, or an `OSError` such as a missing file) ends with exit
status 2 and a one-line message, a `CommandError` with its own status; other exceptions are bugs
and propagate with their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from hf_softmax_rnn.commands.arguments import check_environment, check_output_folders
from hf_softmax_rnn.errors import CommandError, UserInputError
from hf_softmax_rnn.flags import DefaultsFormatter

logger = logging.getLogger(__name__)

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hf_softmax_rnn.commands.demo", "convert the default model to the paper's variants and compare them"),
    "finetune": (
        "hf_softmax_rnn.commands.finetune",
        "attention transfer and LoRA/full fine-tuning of a converted model",
    ),
    "evaluate": (
        "hf_softmax_rnn.commands.evaluate",
        "perplexity by position and passkey retrieval of a model beside its original, on long texts",
    ),
    "needles": (
        "hf_softmax_rnn.commands.needles",
        "needle-in-a-haystack retrieval in many forms (variants, templates, fillers), a model beside its original",
    ),
    "mqar": ("hf_softmax_rnn.commands.mqar", "train small models on multi-query associative recall"),
    "taylor-terms": (
        "hf_softmax_rnn.commands.taylor_terms",
        "mean |x^n/n!| of the attention scores per layer and order",
    ),
    "ablate": ("hf_softmax_rnn.commands.ablate", "train small models from scratch, one per variant group of the paper"),
}
#: Exceptions reported as one line (exit status: their `exit_code`, else 2).
REPORTED_ERRORS = (UserInputError, CommandError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-softmax-rnn", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (DEBUG also shows the traceback of a reported error; default: INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text, add_help=False)
        sub.set_defaults(module_name=module_name)
    return parser


def subcommand_parser(name: str) -> tuple[argparse.ArgumentParser, ModuleType]:
    """The parser of subcommand `name` (its flags from the module's `add_arguments`) and the module."""
    module_name, description = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"hf-softmax-rnn {name}", description=description, formatter_class=DefaultsFormatter
    )
    module.add_arguments(parser)
    return parser, module


def warn_flags_given_twice(parser: argparse.ArgumentParser, tokens: list[str]) -> None:
    """Log a WARNING for each flag given more than once, under any of its spellings (`--flag value`,
    `--flag=value`, an abbreviation argparse accepts): argparse keeps the last value, which overrides the
    earlier ones (a command line built as base flags plus overrides), and says nothing."""
    options = parser._option_string_actions  # (argparse's own table of every spelling of every flag)
    given: dict[str, list[str]] = {}
    for token in tokens:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not name.startswith("-"):
            continue
        matches = [options[name]] if name in options else [a for o, a in options.items() if o.startswith(name)]
        if len({id(action) for action in matches}) == 1 and matches[0].option_strings:
            given.setdefault(max(matches[0].option_strings, key=len), []).append(token)
    for flag, spellings in given.items():
        if len(spellings) > 1:
            logger.warning(
                "%s is given %d times (%s): the last one given is used, the others are ignored",
                flag,
                len(spellings),
                ", ".join(spellings),
            )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    sub, module = subcommand_parser(known.command)
    argv = sys.argv[1:] if argv is None else argv
    tokens = argv[argv.index(known.command) + 1 :]
    args = sub.parse_args(tokens)
    logging.basicConfig(level=known.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        warn_flags_given_twice(sub, tokens)
        check_environment()
        check_output_folders(args)
        report = module.run(args)
    except REPORTED_ERRORS as error:
        logger.debug("%s failed", known.command, exc_info=True)
        hint = "" if logger.isEnabledFor(logging.DEBUG) else " (--log-level DEBUG shows the traceback)"
        message = " ".join(str(error).split())
        sys.stderr.write(f"hf-softmax-rnn {known.command}: error: {message}{hint}\n")
        return getattr(error, "exit_code", 2)
    if report:
        sys.stdout.write(report.rstrip("\n") + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

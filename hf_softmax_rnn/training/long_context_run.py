"""`finetune --long-eval`: the long-context evaluation of a run, beside the unconverted model.

Everything is checked when the run is set up (texts, positions, passkey lengths); the unconverted
model is measured before training, the trained model after it is saved (LoRA merged), then (unless
--no-long-eval-fidelity) the trained model's agreement with the unconverted one, which is kept until
then; the results go into results.json ("long_context") and long_context.png.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hf_softmax_rnn.data.eval_texts import load_eval_texts
from hf_softmax_rnn.layers import student_outputs
from hf_softmax_rnn.long_context.report import comparison_tables, plot_long_context
from hf_softmax_rnn.training.output_settings import LongEvalSettings

logger = logging.getLogger(__name__)

LONG_CONTEXT_PLOT = "long_context.png"
ORIGINAL, TRAINED = "unconverted", "trained"


class LongContextRun:
    """The texts and settings of --long-eval (`LongEvalSettings`), checked against `model` (the unconverted one)."""

    def __init__(self, config: LongEvalSettings, model, tokenizer) -> None:
        self.config = config
        self.settings = config.long_context_settings()
        self.texts = load_eval_texts(config.long_eval_texts)
        self.tokenizer = tokenizer
        self.settings.check(model, tokenizer, self.texts)
        self.results: dict[str, dict] = {}
        self.original = None  # the unconverted model, kept from its measurement to the trained model's

    def measure(self, label: str, model, *, progress: bool) -> None:
        """Evaluate `model` as `label` (ORIGINAL first, which is kept for the agreement; then TRAINED, which is
        also compared with it)."""
        logger.info("Long-context evaluation of the %s model on %s", label, self.config.long_eval_texts)
        with student_outputs(model):
            self.results[label] = self.settings.evaluate(model, self.tokenizer, self.texts, progress=progress)
            if label == TRAINED and self.original is not None:
                logger.info("Agreement of the %s model with the %s one", TRAINED, ORIGINAL)
                self.results[label]["fidelity"] = self.settings.fidelity(
                    model, self.original, self.tokenizer, self.texts, progress=progress
                )
                self.original = None
        if label == ORIGINAL and self.config.long_eval_fidelity:
            self.original = model

    def save(self, output_dir: Path, results_file: str) -> dict:
        """Add the results to `results_file` in `output_dir` and plot them; returns what was added."""
        record = {"texts": self.config.long_eval_texts, **self.results}
        path = Path(output_dir) / results_file
        path.write_text(json.dumps({**json.loads(path.read_text()), "long_context": record}, indent=2))
        plot_long_context(
            self.results, ORIGINAL, Path(output_dir) / LONG_CONTEXT_PLOT, title=self.config.long_eval_texts
        )
        return record


def long_context_report(record: dict) -> str:
    """The tables of a run's long-context record (results.json "long_context")."""
    results = {name: value for name, value in record.items() if name in (ORIGINAL, TRAINED)}
    return f"Long-context evaluation on {record['texts']}:\n" + comparison_tables(results, ORIGINAL)

"""`hf-softmax-rnn finetune`: convert a model's attention, then attention transfer, LoRA (or full)
fine-tuning and the finite state alone on long blocks, with Accelerate.

    hf-softmax-rnn finetune --output-dir out/hybrid     # hedgehog_window_256_sinks_4_kept_256_decay: 20 + 10 steps
    hf-softmax-rnn finetune --output-dir out/l2 --attention gated_softmax_no_gate_L2norm_nodivS_noclamp
    hf-softmax-rnn finetune --output-dir out/hybrid --long-eval   # + perplexity by position, passkey

Several processes (GPUs, or gloo on CPU):

    accelerate launch -m hf_softmax_rnn.cli finetune ...
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m hf_softmax_rnn.cli finetune ...

(`accelerate launch --cpu --num_processes 2` runs a single process in this Accelerate release.)
A run killed at any point continues with `--resume` from its latest checkpoint, on the same path
as if it had never stopped.
"""

from __future__ import annotations

import argparse
import json
import logging

from hf_softmax_rnn.flags import add_dataclass_arguments
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.long_context_run import long_context_report
from hf_softmax_rnn.training.metrics import BEFORE_CONVERSION, memory_words, minutes_and_seconds
from hf_softmax_rnn.training.recipes import DEFAULT_ATTENTION

logger = logging.getLogger(__name__)

#: The largest ratio of the fine-tuned model's held-out perplexity to the unconverted model's that
#: the summary does not report as "not recovered".
RECOVERED_RATIO = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `FinetuneConfig` field (help and default from the field)."""
    add_dataclass_arguments(parser, FinetuneConfig)


def summary(result) -> str:
    """Held-out perplexity at each evaluation point and the last one's ratio to the unconverted model's,
    as lines and as one JSON line. A ratio above `RECOVERED_RATIO` is also logged as a WARNING."""
    evaluations = result.evaluations
    lines = [f"Held-out perplexity ({result.output_dir}):"]
    lines += [f"  {point:<10} {values['perplexity']:10.3f}" for point, values in evaluations.items()]
    last = list(evaluations)[-1]
    if BEFORE_CONVERSION in evaluations and last != BEFORE_CONVERSION:
        ratio = evaluations[last]["perplexity"] / evaluations[BEFORE_CONVERSION]["perplexity"]
        lines.append(f"  {last} / {BEFORE_CONVERSION}: {ratio:.2f}x")
        if not ratio <= RECOVERED_RATIO:  # (NaN included)
            logger.warning(
                "The model after %r has %.2fx the held-out perplexity of the unconverted model (%.4g against "
                "%.4g): it has not recovered. Train longer, or use a recipe that recovers (--attention %s; see "
                "docs/finetuning.md).",
                last, ratio, evaluations[last]["perplexity"], evaluations[BEFORE_CONVERSION]["perplexity"],
                DEFAULT_ATTENTION,
            )  # fmt: skip
    if time_and_memory := _time_and_memory(result):
        lines.append(time_and_memory)
    lines.append(json.dumps({point: round(values["perplexity"], 4) for point, values in evaluations.items()}))
    if getattr(result, "long_context", None):
        lines += ["", long_context_report(result.long_context)]
    return "\n".join(lines)


def _time_and_memory(result) -> str:
    """The stages this process trained and its peak memory, as one indented line ("" when it measured neither):
    `  training: finetune 9 min 43 s, state 15 min 41 s; peak memory 10.92 GiB resident`."""
    parts = []
    if result.stage_seconds:
        times = [f"{name} {minutes_and_seconds(seconds)}" for name, seconds in result.stage_seconds.items()]
        parts.append(f"training: {', '.join(times)}")
    if memory := memory_words(result.peak_memory):
        parts.append(f"peak memory {memory}")
    return "  " + "; ".join(parts) if parts else ""


def run(args: argparse.Namespace) -> str | None:
    # The trainer loads Accelerate and PEFT: imported when a run starts, so that `finetune --help` stays quick.
    from hf_softmax_rnn.training.trainer import Finetuner

    finetuner = Finetuner(FinetuneConfig.from_namespace(args))
    result = finetuner.run()
    return summary(result) if finetuner.accelerator.is_main_process else None

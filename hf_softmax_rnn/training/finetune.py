"""`hf-softmax-rnn finetune`: convert a model's attention, then attention transfer and LoRA (or full)
fine-tuning, with Accelerate.

    hf-softmax-rnn finetune --output-dir out/l2 --attention gated_softmax_no_gate_L2norm_nodivS_noclamp

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

from hf_softmax_rnn.commands.arguments import add_dataclass_arguments
from hf_softmax_rnn.training.config import FinetuneConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `FinetuneConfig` field (help and default from the field)."""
    add_dataclass_arguments(parser, FinetuneConfig)


def summary(result) -> str:
    """Held-out perplexity at each evaluation point, as lines and as one JSON line."""
    lines = [f"Held-out perplexity ({result.output_dir}):"]
    lines += [f"  {point:<10} {values['perplexity']:10.3f}" for point, values in result.evaluations.items()]
    lines.append(json.dumps({point: round(values["perplexity"], 4) for point, values in result.evaluations.items()}))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> str | None:
    from hf_softmax_rnn.training.trainer import Finetuner

    finetuner = Finetuner(FinetuneConfig.from_namespace(args))
    result = finetuner.run()
    return summary(result) if finetuner.accelerator.is_main_process else None

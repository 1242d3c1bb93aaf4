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
import dataclasses
import json

from hf_softmax_rnn.attention_spec import NO_CACHE_MODES
from hf_softmax_rnn.training.config import (
    DEFAULT_SCHEDULE,
    FINETUNE_LOSSES,
    FINETUNE_METHODS,
    LR_SCHEDULERS,
    MIXED_PRECISION,
    FinetuneConfig,
)

#: (group title, [(flag, argparse keywords)]); every flag's destination is the FinetuneConfig field of the same name.
ARGUMENTS: list[tuple[str, list[tuple[str, dict]]]] = [
    (
        "model and attention",
        [
            ("--model", dict(help="'default' (the embedded SmolLM2-135M-Instruct), a local folder or a Hub id")),
            (
                "--attention",
                dict(
                    help="preset name (`python -c 'import hf_softmax_rnn; print(*hf_softmax_rnn.PRESETS)'`), a JSON "
                    "object of AttentionSpec fields, or a .json file holding one"
                ),
            ),
            ("--layers", dict(type=int, nargs="+", help="convert only these layer indices; the others keep softmax")),
            (
                "--attention-mode",
                dict(
                    choices=NO_CACHE_MODES,
                    help="how finite-state layers compute a whole sequence while training and scoring (same result; "
                    "chunked needs O(L) memory and is several times faster than the L x L parallel form)",
                ),
            ),
        ],
    ),
    (
        "data",
        [
            (
                "--dataset",
                dict(
                    help="'pydoc' (offline corpus), local .txt/.json/.jsonl/.parquet/.csv files or folder, "
                    "or a Hub dataset"
                ),
            ),
            ("--dataset-config", dict(help="configuration name of a Hub dataset")),
            ("--text-column", dict(help="column holding the text")),
            ("--streaming", dict(action="store_true", help="stream the dataset instead of loading it whole")),
            ("--shuffle-buffer", dict(type=int, help="shuffle buffer of a streamed dataset (1 = in order)")),
            ("--test-fraction", dict(type=float, help="held-out share when the data has no test split")),
            ("--block-size", dict(type=int, help="tokens per packed block")),
            ("--batch-size", dict(type=int, help="blocks per process per micro-batch")),
            ("--grad-accum", dict(type=int, help="micro-batches per optimizer step")),
            ("--eval-batch-size", dict(type=int, help="blocks per process per evaluation batch")),
            ("--max-eval-blocks", dict(type=int, help="score only the first N held-out blocks (all when not given)")),
        ],
    ),
    (
        "stage 1: attention transfer",
        [
            ("--transfer-steps", dict(type=int, help="optimizer steps (0 skips the stage)")),
            ("--transfer-lr", dict(type=float, help="peak learning rate")),
            ("--transfer-lm-weight", dict(type=float, help="weight of the LM loss added to the transfer MSE")),
            (
                "--transfer-modules",
                dict(
                    nargs="+",
                    help="submodules of the converted attention layers to train (when not given: rnn_params, or the "
                    "q/k projections if the spec has no learned parameters)",
                ),
            ),
            (
                "--no-transfer-teacher-forcing",
                dict(
                    dest="transfer_teacher_forcing",
                    action="store_false",
                    help="let each converted layer pass its own output on while transferring (default: the exact "
                    "softmax output goes on, so every layer sees the original model's hidden states)",
                ),
            ),
        ],
    ),
    (
        "stage 2: language-model fine-tuning",
        [
            ("--finetune-steps", dict(type=int, help="optimizer steps (0 skips the stage)")),
            ("--finetune-method", dict(choices=FINETUNE_METHODS, help="LoRA adapters or all parameters")),
            (
                "--finetune-loss",
                dict(
                    choices=FINETUNE_LOSSES,
                    help="next-token cross-entropy, or KL divergence to the unconverted model's logits (distillation)",
                ),
            ),
            ("--lr", dict(type=float, help="peak learning rate")),
            ("--lora-rank", dict(type=int, help="LoRA rank r")),
            ("--lora-alpha", dict(type=float, help="LoRA alpha (scale alpha / r)")),
            ("--lora-dropout", dict(type=float, help="dropout on the LoRA input")),
            ("--lora-targets", dict(nargs="+", help="module name suffixes (the attention projections when not given)")),
        ],
    ),
    (
        "optimisation",
        [
            ("--lr-scheduler", dict(choices=LR_SCHEDULERS, help="learning-rate schedule of each stage")),
            ("--warmup-steps", dict(type=int, help="warm-up steps of each stage")),
            ("--weight-decay", dict(type=float, help="AdamW weight decay of matrices")),
            ("--max-grad-norm", dict(type=float, help="gradient clipping (0: none)")),
            ("--mixed-precision", dict(choices=MIXED_PRECISION, help="autocast dtype")),
            ("--seed", dict(type=int, help="seed of data order and initialisation")),
            ("--cpu", dict(action="store_true", help="train on CPU even where a GPU is available")),
        ],
    ),
    (
        "evaluation, checkpoints and publishing",
        [
            ("--eval-every", dict(type=int, help="held-out perplexity every N steps of a stage (and at its end)")),
            ("--save-every", dict(type=int, help="checkpoint every N steps of a stage (and at its end)")),
            ("--save-total-limit", dict(type=int, help="checkpoints kept")),
            ("--resume", dict(action="store_true", help="continue from the latest checkpoint in --output-dir")),
            (
                "--allow-inexact-resume",
                dict(
                    action="store_true",
                    help="resume even where the result cannot be exact (RNG states missing, training data changed), "
                    "with a warning",
                ),
            ),
            (
                "--overwrite",
                dict(
                    action="store_true",
                    help="write into an --output-dir that holds other files, a finished run or the --model, replacing "
                    "a previous run's checkpoints and outputs",
                ),
            ),
            ("--no-progress", dict(dest="progress", action="store_false", help="no progress bars")),
            ("--push-to-hub", dict(metavar="REPO", help="upload the outputs to this Hub repo")),
            ("--hub-private", dict(action="store_true", help="create the Hub repo as private")),
        ],
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {field.name: field.default for field in dataclasses.fields(FinetuneConfig)}
    parser.add_argument(
        "--output-dir", required=True, help="folder for the model, adapter, metrics, card and checkpoints"
    )
    for title, arguments in ARGUMENTS:
        group = parser.add_argument_group(title)
        for flag, options in arguments:
            destination = options.get("dest", flag.removeprefix("--").replace("-", "_"))
            if options.get("action") not in ("store_true", "store_false"):
                chosen = "the attention's recipe" if destination in DEFAULT_SCHEDULE else "%(default)s"
                options = {
                    **options,
                    "default": defaults[destination],
                    "help": options["help"] + f" (default: {chosen})",
                }
            group.add_argument(flag, **options)


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

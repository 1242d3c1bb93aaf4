"""Whole-model training throughput: tokens/s of forward + backward + AdamW step, and peak memory.

The model (`--model`, a config folder; default SmolLM2-135M's shape) is built with random weights
and timed as transformers' own class ("transformers": SDPA attention) beside converted copies
(`--presets`; finite-state layers in `attention_mode="chunked"`, the path whose memory is flat in
the length; on CUDA the fused kernels of `hf_softmax_rnn.ops.backends` run where installed). Every
step sees `--tokens-per-step` random tokens cut as B x L for each L in `--lengths`
(B = tokens / L), the language-model loss on them, `backward()` and one AdamW step. On CUDA the
forward runs under bfloat16 autocast (fp32 weights and optimizer state); on CPU in float32.
For each length the models are warmed up (`--warmup` steps each), then timed in interleaved
rounds (one step per model per round, `--steps` rounds), so a change in load falls on every
model alike; the time is the median step. On CUDA peak memory is the allocator's peak during
a step, weights, gradients and optimizer state included; a step that runs out of memory is
reported as such.

    python scripts/bench_train.py --device cuda --output gpu_results/bench_train   # 32,768 tokens x 2k/8k/32k
    python scripts/bench_train.py --layers 2 --tokens-per-step 256 --lengths 64 128 --output /tmp/bench_train

`--checkpointed MODEL ...` also times those models (`transformers` or names from `--presets`) with
activation checkpointing ("MODEL checkpointed": each decoder layer recomputed in the backward pass, as
`finetune --gradient-checkpointing` does), interleaved with the rest: what recomputing costs in time
and saves in memory, each against the same model keeping its activations.

`--unsegmented PRESET ...` also times those presets with fla's rows left whole ("PRESET unsegmented",
`hf_softmax_rnn.ops.backends.state_segments(0)`), interleaved with the rest: the gain of cutting
rows over 2,048 tokens into segments that run side by side (CUDA with fla-core only; elsewhere the
two rows run the same code).

Each model is called as a training loop calls it, `model(input_ids=ids, labels=ids)` in training
mode (the converted models then build no cache). `--profile` profiles one more step of each model
at each length (`hf_softmax_rnn.analysis.step_profile`): kernel time by kind, launches, and the share
of the median step the device is busy (OUTPUT/bench_train_profile.{md,json,png}).

Targets: hedgehog_window_64 at >= 0.9x the original's tokens/s at L = 2,048, >= 1.3x
at 8,192 and >= 2x at 32,768; linear_elu at least as fast.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_softmax_rnn.analysis.bench_report import (
    check_model_flags,
    device_or_exit,
    plot_panels,
    write_bench_report,
)
from hf_softmax_rnn.analysis.step_profile import StepProfile, plot_profiles, profile_step, profile_table
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.ops import backends
from hf_softmax_rnn.utils import hardware_name

logger = logging.getLogger("bench_train")

BASELINE = "transformers"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "smollm2_135m_config"
DEFAULT_PRESETS = ("linear_elu", "hedgehog_window_64", "softmax_taylor_2")
DEFAULT_LENGTHS = (2048, 8192, 32768)
DEFAULT_TOKENS = 32768
#: Target tokens/s of hedgehog_window_64 / the original, by length.
TARGETS = {2048: 0.9, 8192: 1.3, 32768: 2.0}
OUT_OF_MEMORY = "out of memory"
UNSEGMENTED = "unsegmented"
CHECKPOINTED = "checkpointed"


@dataclass
class Measurement:
    model: str
    length: int
    batch: int
    tokens_per_s: float | None
    step_ms: float | None
    peak_bytes: int | None
    error: str | None = None


class Trainer:
    """One model, its AdamW optimizer and its training step on a batch of token ids."""

    def __init__(
        self, name: str, model, device: torch.device, segment_length: int | None = None, compiled: bool = False
    ) -> None:
        """`segment_length`: fla's rows cut at this many tokens in the step (0: whole; None: the default);
        `compiled`: the forward through `torch.compile`."""
        self.name, self.model, self.device = name, model.to(device).train(), device
        self.segment_length = segment_length
        self.forward = torch.compile(self.model) if compiled else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)

    def step(self, ids: torch.Tensor) -> float:
        """Seconds of one forward + backward + optimizer step (device synchronised)."""
        segments = contextlib.nullcontext()
        if self.segment_length is not None:
            segments = backends.state_segments(self.segment_length)
        _synchronize(self.device)
        start = time.perf_counter()
        with segments:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                loss = self.forward(input_ids=ids, labels=ids).loss
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _synchronize(self.device)
        return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(trainer: Trainer, ids: torch.Tensor) -> tuple[float | str, int | None]:
    """(seconds, CUDA peak bytes) of one step, or (what went wrong, None): out of memory, or a kernel's
    error (logged with its traceback; the other models go on)."""
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    try:
        seconds = trainer.step(ids)
    except torch.OutOfMemoryError:
        error = OUT_OF_MEMORY
    except Exception as exception:  # noqa: BLE001 (a benchmark reports a failing model and times the rest)
        logger.exception("%s failed at L=%d", trainer.name, ids.shape[-1])
        error = f"error: {type(exception).__name__}"
    else:
        return seconds, torch.cuda.max_memory_allocated(trainer.device) if cuda else None
    trainer.optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.empty_cache()
    return error, None


def _profiled_step(trainer: Trainer, ids: torch.Tensor, step_ms: float | None) -> list[StepProfile]:
    """[the profile of one more step], or [] where that step fails (logged; the other models go on)."""
    try:
        profile = profile_step(functools.partial(trainer.step, ids), trainer.device, trainer.name, ids.shape[-1])
    except Exception:  # noqa: BLE001 (out of memory under the profiler, or a kernel's error)
        logger.exception("%s: the profiled step failed at L=%d; left out of the profile", trainer.name, ids.shape[-1])
        trainer.optimizer.zero_grad(set_to_none=True)
        return []
    profile.step_ms = step_ms
    return [profile]


def run_benchmark(
    trainers: list[Trainer],
    vocab_size: int,
    args,
    done: Callable[[list[Measurement], list[StepProfile]], None],
) -> list[Measurement]:
    """For each length: warm every model up, then time them in interleaved rounds (and with `--profile`
    profile one more step of each); `done` is handed the measurements and profiles so far after each
    length (a run cut short keeps what finished)."""
    measurements, profiles = [], []
    generator = torch.Generator().manual_seed(0)
    for length in args.lengths:
        batch = args.tokens_per_step // length
        ids = torch.randint(0, vocab_size, (batch, length), generator=generator).to(trainers[0].device)
        failed: dict[str, str] = {}
        for trainer in trainers:
            for _ in range(args.warmup):
                result = _timed_step(trainer, ids)[0]
                if isinstance(result, str):
                    failed[trainer.name] = result
                    break
        times: dict[str, list[float]] = {trainer.name: [] for trainer in trainers}
        peaks: dict[str, int] = {}
        for _ in range(args.steps):
            for trainer in (t for t in trainers if t.name not in failed):
                seconds, peak = _timed_step(trainer, ids)
                if isinstance(seconds, str):
                    failed[trainer.name] = seconds
                    continue
                times[trainer.name].append(seconds)
                if peak is not None:
                    peaks[trainer.name] = max(peaks.get(trainer.name, 0), peak)
        for trainer in trainers:
            if trainer.name in failed:
                measurement = Measurement(trainer.name, length, batch, None, None, None, failed[trainer.name])
            else:
                seconds = statistics.median(times[trainer.name])
                measurement = Measurement(
                    trainer.name, length, batch, batch * length / seconds, 1000 * seconds, peaks.get(trainer.name)
                )
            logger.info("%s", measurement)
            measurements.append(measurement)
            if args.profile and trainer.name not in failed:
                profiles += _profiled_step(trainer, ids, measurement.step_ms)
        done(measurements, profiles)
    return measurements


def markdown_table(measurements: list[Measurement], lengths: list[int]) -> str:
    """length | B | tokens/s of each model | each converted model / transformers | peak GiB of each."""
    names = list(dict.fromkeys(m.model for m in measurements))
    cell = {(m.model, m.length): m for m in measurements}
    converted = [name for name in names if name != BASELINE]
    header = ["L", "B", *(f"{n} tokens/s" for n in names), *(f"{n} / {BASELINE}" for n in converted)]
    header += [f"{n} peak GiB" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
    for length in lengths:
        row = [str(length), str(cell[names[0], length].batch)]
        row += [_rate(cell[n, length]) for n in names]
        row += [_ratio(cell[n, length], cell[BASELINE, length]) for n in converted]
        row += [_gib(cell[n, length].peak_bytes) for n in names]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _rate(m: Measurement) -> str:
    return m.error if m.tokens_per_s is None else f"{m.tokens_per_s:,.0f}"


def _ratio(m: Measurement, baseline: Measurement) -> str:
    if m.tokens_per_s is None or baseline.tokens_per_s is None:
        return "-"
    return f"{m.tokens_per_s / baseline.tokens_per_s:.2f}x"


def _gib(peak: int | None) -> str:
    return "-" if peak is None else f"{peak / 2**30:.2f}"


def summary(measurements: list[Measurement]) -> list[str]:
    """The targets for hedgehog_window_64 and linear_elu, and each checkpointed model against the same model
    keeping its activations, where both sides were measured."""
    rate = {(m.model, m.length): m.tokens_per_s for m in measurements}
    lines = []
    for (name, length), value in rate.items():
        baseline = rate.get((BASELINE, length))
        if name == BASELINE or value is None or baseline is None:
            continue
        target = TARGETS.get(length) if name == "hedgehog_window_64" else 1.0 if name == "linear_elu" else None
        if target is not None:
            lines.append(f"- `{name}` at L={length}: {value / baseline:.2f}x {BASELINE} (target >= {target}x)")
    cell = {(m.model, m.length): m for m in measurements}
    for m in measurements:
        plain = cell.get((m.model.removesuffix(f" {CHECKPOINTED}"), m.length))
        if not m.model.endswith(f" {CHECKPOINTED}") or plain is None or None in (m.tokens_per_s, plain.tokens_per_s):
            continue
        memory = f", peak {_gib(m.peak_bytes)} against {_gib(plain.peak_bytes)} GiB" if m.peak_bytes else ""
        lines.append(
            f"- `{m.model}` at L={m.length}: {m.tokens_per_s / plain.tokens_per_s:.2f}x the tokens/s of "
            f"`{plain.model}`{memory}"
        )
    return lines


def plot(measurements: list[Measurement], path: Path, title: str) -> None:
    timed = [m for m in measurements if m.tokens_per_s is not None]
    models = {name: [m for m in timed if m.model == name] for name in dict.fromkeys(m.model for m in measurements)}
    rate = {name: ([m.length for m in rows], [m.tokens_per_s for m in rows]) for name, rows in models.items()}
    memory = {
        name: ([m.length for m in rows if m.peak_bytes], [m.peak_bytes / 2**30 for m in rows if m.peak_bytes])
        for name, rows in models.items()
    }
    panels = [("training tokens/s (fwd+bwd+AdamW)", rate), ("peak memory (GiB)", memory)]
    plot_panels(path, title, "sequence length L (same tokens per step)", panels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_CONFIG, help="folder of the config.json to time")
    parser.add_argument(
        "--presets",
        nargs="+",
        default=list(DEFAULT_PRESETS),
        help=f"converted models, timed beside '{BASELINE}' (default: {' '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument(
        "--checkpointed",
        nargs="+",
        default=[],
        metavar="MODEL",
        help=f"also time these models ('{BASELINE}' or names from --presets) with activation checkpointing "
        f"('MODEL {CHECKPOINTED}'; default: none)",
    )
    parser.add_argument(
        "--unsegmented",
        nargs="+",
        default=[],
        metavar="PRESET",
        help=f"also time these presets with fla's rows left whole ('PRESET {UNSEGMENTED}'; default: none)",
    )
    parser.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_LENGTHS), help="sequence lengths L")
    parser.add_argument("--tokens-per-step", type=int, default=DEFAULT_TOKENS, help="B x L of every step")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and length (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and length")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (bfloat16 autocast on cuda)")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="every model recomputes its decoder layers' activations in the backward pass (as finetune's flag)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="every model's forward through torch.compile (the operations around the attention kernels fused; "
        "each length compiles during its warm-up steps)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, one more step of each model under torch.profiler: its kernel time by kind, "
        "launches and the share of the step the device is busy (OUTPUT/bench_train_profile.{md,json,png})",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("bench_train"), help="writes OUTPUT/bench_train.{md,json,png}"
    )
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stops with one line (exit status 2) on a setting that is not allowed, before anything is loaded."""
    check_model_flags(parser, args, ("steps", "warmup", "tokens_per_step"))
    stray = [name for name in args.unsegmented if name not in args.presets]
    if stray:
        parser.error(f"--unsegmented {' '.join(stray)}: not in --presets; expected names from {' '.join(args.presets)}")
    timed = [BASELINE, *args.presets]
    stray = [name for name in args.checkpointed if name not in timed]
    if stray:
        parser.error(f"--checkpointed {' '.join(stray)}: not timed; expected names from {' '.join(timed)}")
    if args.checkpointed and args.gradient_checkpointing:
        parser.error(
            "--checkpointed is not allowed with --gradient-checkpointing, where every model recomputes its layers; "
            "pass one of them"
        )
    bad = [n for n in args.lengths if n < 1 or args.tokens_per_step % n]
    if bad or sorted(set(args.lengths)) != args.lengths:
        parser.error(
            f"--lengths={args.lengths} is not allowed; expected increasing lengths that divide "
            f"--tokens-per-step={args.tokens_per_step}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = device_or_exit("bench_train.py", args.device)  # parse_args checks GPU commands anywhere
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = AutoConfig.from_pretrained(args.model)
    config.max_position_embeddings = max(config.max_position_embeddings, args.lengths[-1])
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    compiled = args.compile
    trainers = [
        Trainer(name, convert(base_model, name, attention_mode="chunked"), device, compiled=compiled)
        for name in args.presets
    ]
    trainers += [
        Trainer(
            f"{name} {UNSEGMENTED}", convert(base_model, name, attention_mode="chunked"), device, 0, compiled=compiled
        )
        for name in args.unsegmented
    ]
    checkpointed = [
        Trainer(
            f"{name} {CHECKPOINTED}",
            copy.deepcopy(base_model) if name == BASELINE else convert(base_model, name, attention_mode="chunked"),
            device,
            compiled=compiled,
        )
        for name in args.checkpointed
    ]
    trainers.insert(0, Trainer(BASELINE, base_model, device, compiled=compiled))
    trainers += checkpointed
    for trainer in trainers if args.gradient_checkpointing else checkpointed:  # never both (_check_args)
        trainer.model.activation_checkpointing_enable({"use_reentrant": False})
    hardware = hardware_name(device)
    precision = "bfloat16 autocast" if device.type == "cuda" else "float32"
    title = (
        f"{args.model.name}, {config.num_hidden_layers} layers, random weights: training step (fwd+bwd+AdamW), "
        f"{args.tokens_per_step} tokens per step, {precision}"
        f"{', activation checkpointing' if args.gradient_checkpointing else ''}"
        f"{', torch.compile' if args.compile else ''}, {hardware}; median of {args.steps}"
    )
    run_benchmark(trainers, config.vocab_size, args, lambda *done: write_report(*done, args, title))
    print((args.output / "bench_train.md").read_text(), end="")
    if args.profile:
        print((args.output / "bench_train_profile.md").read_text(), end="")


def write_report(
    measurements: list[Measurement], profiles: list[StepProfile], args: argparse.Namespace, title: str
) -> None:
    """OUTPUT/bench_train.{md,json,png} (and bench_train_profile.*) for the lengths measured so far."""
    lengths = [n for n in args.lengths if any(m.length == n for m in measurements)]
    body = [markdown_table(measurements, lengths), "", *summary(measurements)]
    write_bench_report(args.output, "bench_train", title, body, measurements, vars(args), plot)
    if profiles:
        kind = "device kernels" if profiles[0].device_type == "cuda" else "aten operators (CPU time)"
        profile_title = f"{title}; one profiled step each, {kind}; busy = kernel time / median step"
        body = profile_table(profiles)
        write_bench_report(args.output, "bench_train_profile", profile_title, body, profiles, vars(args), plot_profiles)


if __name__ == "__main__":
    sys.exit(main())

"""Prefill: a whole model's forward over one long prompt, the converted model against the original.

Each model reads one random prompt of each length in `--lengths` as scoring and the first forward of
`generate` read it: `model(ids, logits_to_keep=1, use_cache=False)` without autograd (a converted model
then runs its chunked form, the state handed from chunk to chunk, and builds no cache). The original is
`--model` ("default": the embedded SmolLM2-135M-Instruct) with transformers' SDPA attention. The converted
model is `--converted DIR` (a folder that `finetune` or `save_pretrained` wrote), or else `finetune`'s
default structure converted from `--model` untrained (its attention in every layer, `RETRIEVAL_LAYERS`
of them keeping 2,048 positions): time does not depend on the weights, nor on which layers keep more.

For each length both models run once untimed, then `--rounds` interleaved rounds (one forward each per
round), so a change in load falls on both alike; the time is the best of the rounds. `--profile` adds,
for each model at the longest length, the operators' own CPU time by kind (`analysis.step_profile`).
Prints a markdown table and writes OUTPUT/bench_prefill.{md,json,png}.

    python scripts/bench_prefill.py --output /tmp/bench_prefill                      # 1,024 ... 16,384
    python scripts/bench_prefill.py --converted out/hybrid --lengths 1024 4096 16384 32768 --output /tmp/prefill
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.analysis.bench_report import plot_panels, write_bench_report
from hf_softmax_rnn.analysis.step_profile import StepProfile, profile_step, profile_table
from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.default_model import default_model, load_causal_lm
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training.recipes import DEFAULT_ATTENTION, KEPT_RETRIEVAL_LAYERS, RETRIEVAL_KEPT
from hf_softmax_rnn.utils import check_at_least, hardware_name, set_threads

logger = logging.getLogger("bench_prefill")
#: the module (`hf_softmax_rnn.ops.attention`, which the function of that name hides), whose segment length
#: `--prefill-segment` sets
attention_ops = importlib.import_module("hf_softmax_rnn.ops.attention")

ORIGINAL = "original"
CONVERTED = "converted"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384)


@dataclass
class PrefillTime:
    """One model at one length: the best of the rounds, and every round's seconds."""

    model: str
    length: int
    seconds: float
    rounds: list[float]


def spread_layers(num_layers: int, count: int) -> list[int]:
    """`count` layer indices spread evenly over `num_layers` (the middle of each of `count` equal spans;
    every layer where there are no more than `count`)."""
    count = min(count, num_layers)
    return [(2 * i + 1) * num_layers // (2 * count) for i in range(count)]


def default_structure(original: torch.nn.Module) -> torch.nn.Module:
    """`finetune`'s default conversion of (a copy of) `original`, untrained: `DEFAULT_ATTENTION` in every
    layer, `RETRIEVAL_KEPT` kept positions in `KEPT_RETRIEVAL_LAYERS` layers spread over the depth."""
    spec = AttentionSpec.coerce(DEFAULT_ATTENTION)
    retrieval = dataclasses.replace(spec, kept=RETRIEVAL_KEPT)
    layers = spread_layers(original.config.num_hidden_layers, KEPT_RETRIEVAL_LAYERS)
    return convert(copy.deepcopy(original), spec, layer_attention=dict.fromkeys(layers, retrieval))


def prefill_seconds(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Seconds of one forward of `ids` `[1, L]` without autograd, the last position's logits only."""
    with torch.no_grad():
        start = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
        return time.perf_counter() - start


def measure(models: dict, lengths: list[int], rounds: int, seed: int) -> list[PrefillTime]:
    """Every model at every length: one untimed forward each, then `rounds` interleaved rounds."""
    vocab = next(iter(models.values())).config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    results = []
    with tqdm(total=len(lengths) * (rounds + 1) * len(models), desc="prefill", unit="forward") as bar:
        for length in lengths:
            ids = torch.randint(0, vocab, (1, length), generator=generator)
            times: dict[str, list[float]] = {name: [] for name in models}
            for model in models.values():
                prefill_seconds(model, ids)
                bar.update()
            for _ in range(rounds):
                for name, model in models.items():
                    times[name].append(prefill_seconds(model, ids))
                    bar.update()
            results += [PrefillTime(name, length, min(seconds), seconds) for name, seconds in times.items()]
    return results


def table(results: list[PrefillTime]) -> list[str]:
    """Markdown rows: tokens, each model's seconds, the converted model's time ratio, tokens/s."""
    by_key = {(r.model, r.length): r for r in results}
    rows = [
        "| tokens | original s | converted s | converted / original | original tokens/s | converted tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for length in sorted({r.length for r in results}):
        original, converted = by_key[ORIGINAL, length], by_key[CONVERTED, length]
        rows.append(
            f"| {length:,} | {original.seconds:.2f} | {converted.seconds:.2f} "
            f"| {converted.seconds / original.seconds:.2f}x | {length / original.seconds:,.0f} "
            f"| {length / converted.seconds:,.0f} |"
        )
    return rows


def plot(results: list[PrefillTime], path: Path, title: str) -> None:
    """Seconds against length for both models, and the converted model's time over the original's."""
    series = {
        name: ([r.length for r in results if r.model == name], [r.seconds for r in results if r.model == name])
        for name in (ORIGINAL, CONVERTED)
    }
    original = dict(zip(*series[ORIGINAL], strict=True))
    lengths, seconds = series[CONVERTED]
    ratio = {CONVERTED: (lengths, [s / original[length] for length, s in zip(lengths, seconds, strict=True)])}
    plot_panels(path, title, "prompt tokens", [("seconds", series), ("time / the original's", ratio)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--model", default="default", help="the original: 'default' or an unconverted model's folder")
    parser.add_argument(
        "--converted", type=Path, default=None, help="a converted model's folder (default: the default structure)"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="timed interleaved rounds per length")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--profile", action="store_true", help="profile each model once at the longest length")
    parser.add_argument(
        "--prefill-segment",
        type=int,
        default=attention_ops.PREFILL_SEGMENT,
        help="positions a chunked call runs in one piece (hf_softmax_rnn.ops.attention.PREFILL_SEGMENT; "
        f"0: no limit; default {attention_ops.PREFILL_SEGMENT})",
    )
    parser.add_argument("--output", type=Path, default=Path("bench_prefill"), help="folder of the report files")
    args = parser.parse_args(argv)
    try:
        check_at_least("--rounds", args.rounds)
        check_at_least("--threads", args.threads)
        check_at_least("--prefill-segment", args.prefill_segment, 0)
        for length in args.lengths:
            check_at_least("--lengths", length)
    except UserInputError as error:
        parser.error(str(error))
    if args.model != "default" and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model={args.model!r} is not allowed; expected 'default' or a folder with a config.json")
    if args.converted is not None and not (args.converted / "config.json").is_file():
        parser.error(f"--converted={str(args.converted)!r} is not allowed; expected a folder with a config.json")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"--output={str(args.output)!r} is not allowed; it is a file, expected a folder")
    return args


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    commit = _commit()  # (the code that runs: taken before a long run, during which the checkout may move on)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    set_threads(args.threads)
    original = default_model() if args.model == "default" else load_causal_lm(args.model, args.model)
    if hasattr(original.config, "attention_spec"):
        sys.exit(f"--model={args.model!r} is converted already; pass the original as --model, this one as --converted")
    if args.converted is None:
        converted, converted_name = default_structure(original), f"{DEFAULT_ATTENTION} (untrained)"
    else:
        converted, converted_name = load_causal_lm(str(args.converted), args.converted), str(args.converted)
        if not hasattr(converted.config, "attention_spec"):
            sys.exit(f"--converted={str(args.converted)!r} is not a converted model (its config has no attention_spec)")
    models = {ORIGINAL: original.eval(), CONVERTED: converted.eval()}
    segment, attention_ops.PREFILL_SEGMENT = attention_ops.PREFILL_SEGMENT, args.prefill_segment or sys.maxsize
    try:
        results = measure(models, sorted(args.lengths), args.rounds, args.seed)
    finally:
        attention_ops.PREFILL_SEGMENT = segment
    provenance = (
        f"{datetime.date.today()}, commit {commit}, {hardware_name(torch.device('cpu'))}, "
        f"float32: `python scripts/bench_prefill.py {' '.join(sys.argv[1:])}`"
    )
    body = [f"converted: {converted_name}; best of {args.rounds} interleaved rounds", "", *table(results)]
    profiles: list[StepProfile] = []
    if args.profile:
        ids = torch.randint(0, original.config.vocab_size, (1, max(args.lengths)))
        for name, model in models.items():
            profiles.append(
                profile_step(lambda m=model: prefill_seconds(m, ids), torch.device("cpu"), name, ids.shape[1])
            )
        body += ["", *profile_table(profiles)]
    body += ["", provenance]
    print("\n".join(body))
    write_bench_report(args.output, "bench_prefill", "Prefill time", body, results, vars(args), plot)


if __name__ == "__main__":
    main()

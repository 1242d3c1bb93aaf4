"""Per-token decode latency of unmodified transformers against converted models, by context length.

The model (`--model`) runs as transformers' own class ("transformers", a KV cache) and converted to
each preset (linear_elu and softmax_taylor_2 decode from a fixed-size recurrent state), all in one
process. For each context length in turn, every model gets a fresh cache, is prefilled with the
same token stream up to that length (in chunks, not timed) and decodes `--warmup` greedy tokens
untimed (this compiles and records CUDA graphs with `--compile`); then the models are timed in
interleaved rounds (`--rounds` x `--steps` tokens each), so a change in load from other processes
falls on every model alike. Latencies are medians; each step is synchronised on a GPU before the
clock is read. `--clock cpu` (CPU, `--threads 1`) reads the process's CPU time instead of the wall
clock: on a machine that other work shares, a step's wall time also counts the time the process
waited for a core; its CPU time is what an idle machine's wall clock would show.

    python scripts/bench_generate.py                     # 128 ... 16384, writes docs/figures/bench_generate.*
    python scripts/bench_generate.py --contexts 128 1024 --steps 4 --rounds 1
    python scripts/bench_generate.py --device cuda --dtype bfloat16 --compile   # static caches + CUDA graphs
    python scripts/bench_generate.py --device cuda --dtype bfloat16 --cuda-graph   # the same graphs, no compile
    python scripts/bench_generate.py --device cuda --random-weights --model CONFIG_DIR   # speed only, no checkpoint
    python scripts/bench_generate.py --presets --converted out/hybrid   # a saved converted model, as trained

`--converted` times saved converted models (folders written by `hf-softmax-rnn finetune` or
`save_pretrained`) beside the presets, as they were saved: with the attention of each layer, which
a preset cannot express when layers differ (the `finetune` default's retrieval layers). Each must
be a conversion of `--model` (the same vocabulary); it is named by its path in the tables.

`--compile` decodes every model (the plain one included) through transformers' `StaticCache`
(a `StaticRecurrentStateLayer` per recurrent layer, updated in place), with the forward wrapped in
`torch.compile(mode=--compile-mode)`: "reduce-overhead" (CUDA graphs) by default on a GPU,
"default" elsewhere. `--cuda-graph` decodes through the same static caches with each step recorded
once as a CUDA graph and replayed (`hf_softmax_rnn.decoding.GraphedDecodeStep`: no compile, the
eager step's kernels). Without either, every model decodes eagerly from a `DynamicCache`.

`--random-weights` builds the model from its config alone with random weights and feeds random
token ids: the cost per token does not depend on the weights, so a GPU machine needs only a
config.json.

Targets: a recurrent variant's latency at the longest context within 1.2x of its
latency at the shortest, and its latency within 1.05x of transformers' at the shortest.
SmolLM2 was trained on 8192 positions; beyond that the text is meaningless but the cost per
token is what is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

from hf_softmax_rnn import PRESETS
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.decoding import GraphedDecodeStep
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME, resolve_model
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.layers.cache import cache_nbytes
from hf_softmax_rnn.models.configuration_softmax_rnn import SoftmaxRNNConfigMixin
from hf_softmax_rnn.utils import resolve_device

logger = logging.getLogger("bench_generate")

BASELINE = "transformers"
DEFAULT_PRESETS = ("linear_elu", "softmax_taylor_2")
DEFAULT_CONTEXTS = (128, 512, 2048, 8192, 16384)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LATENCY_RATIO_TARGET = 1.2
BASELINE_RATIO_TARGET = 1.05


@dataclass
class Measurement:
    model: str
    context: int
    latency_ms: float
    cache_bytes: int
    prefill_s: float


class Decoder:
    """One model, its decode step and the cache it is on: eager over a `DynamicCache`, or over a
    `StaticCache` compiled (`compile_mode`) or recorded as a CUDA graph (`cuda_graph`)."""

    def __init__(
        self, name: str, model, compile_mode: str | None = None, cuda_graph: bool = False, clock=time.perf_counter
    ) -> None:
        self.name = name
        self.model = model
        self.clock = clock
        self.compiled = compile_mode is not None
        self.cuda_graph = cuda_graph
        self.forward = torch.compile(model, mode=compile_mode) if self.compiled else model
        self.cache = None
        self.graphed_step: GraphedDecodeStep | None = None
        self.next_token: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(self, stream: torch.Tensor, length: int, capacity: int, chunk: int) -> float:
        """A fresh cache (room for `capacity` positions if static) fed `stream[:length]` eagerly; seconds."""
        config = self.model.config
        static = self.compiled or self.cuda_graph
        self.cache = StaticCache(config=config, max_cache_len=capacity) if static else DynamicCache(config=config)
        _synchronize(stream.device)
        start = time.perf_counter()
        for begin in range(0, length, chunk):
            ids = stream[None, begin : min(begin + chunk, length)]
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
            self.next_token = logits[:, -1:].argmax(-1)
        _synchronize(stream.device)
        seconds = time.perf_counter() - start
        self.graphed_step = GraphedDecodeStep(self.model, self.cache) if self.cuda_graph else None
        return seconds

    def step(self) -> torch.Tensor:
        """The logits `[B, 1, V]` of one decode step fed `next_token`."""
        if self.graphed_step is not None:
            return self.graphed_step(self.next_token)
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the graph may reuse its output buffers
        return self.forward(input_ids=self.next_token, cache=self.cache, use_cache=True).logits

    @torch.no_grad()
    def decode(self, steps: int) -> list[float]:
        """Greedy decode `steps` tokens; returns the seconds of each step (device synchronised)."""
        latencies = []
        device = self.next_token.device
        _synchronize(device)
        for _ in range(steps):
            start = self.clock()
            self.next_token = self.step()[:, -1:].argmax(-1).clone()
            _synchronize(device)
            latencies.append(self.clock() - start)
        return latencies

    def release(self) -> None:
        """Drop the cache and the recorded graph (and the memory they hold)."""
        self.cache = self.graphed_step = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_benchmark(decoders: list[Decoder], stream: torch.Tensor, args) -> list[Measurement]:
    """For each context: prefill every model, warm each up, then time them in interleaved rounds."""
    measurements = []
    capacity_extra = args.warmup + args.rounds * args.steps
    for context in tqdm(args.contexts, desc="Contexts", unit="length"):
        prefill_s = {}
        for decoder in decoders:
            prefill_s[decoder.name] = decoder.prefill(stream, context, context + capacity_extra, args.prefill_chunk)
            decoder.decode(args.warmup)
        latencies: dict[str, list[float]] = {decoder.name: [] for decoder in decoders}
        for _ in range(args.rounds):
            for decoder in decoders:
                latencies[decoder.name] += decoder.decode(args.steps)
        for decoder in decoders:
            measurement = Measurement(
                model=decoder.name,
                context=context,
                latency_ms=1000 * statistics.median(latencies[decoder.name]),
                cache_bytes=cache_nbytes(decoder.cache),
                prefill_s=prefill_s[decoder.name],
            )
            logger.info("%s", measurement)
            measurements.append(measurement)
            decoder.release()
    return measurements


def summary(measurements: list[Measurement], contexts: list[int]) -> list[str]:
    """The targets, one line per converted model."""
    latency = {(m.model, m.context): m.latency_ms for m in measurements}
    shortest, longest = min(contexts), max(contexts)
    lines = []
    for name in dict.fromkeys(m.model for m in measurements):
        if name == BASELINE:
            continue
        ratio = latency[name, longest] / latency[name, shortest]
        line = f"- `{name}`: latency {longest} / {shortest} = {ratio:.2f}x (target <= {LATENCY_RATIO_TARGET}x)"
        if (BASELINE, shortest) in latency:
            against = latency[name, shortest] / latency[BASELINE, shortest]
            line += f"; / {BASELINE} at {shortest} = {against:.2f}x (target <= {BASELINE_RATIO_TARGET}x)"
        lines.append(line)
    return lines


def markdown_table(measurements: list[Measurement], contexts: list[int]) -> str:
    """context | ms/token of each model | each converted model's ratio to transformers | cache MiB |
    prefill seconds."""
    names = list(dict.fromkeys(m.model for m in measurements))
    by_key = {(m.model, m.context): m for m in measurements}
    converted = [name for name in names if name != BASELINE] if BASELINE in names else []
    header = ["context", *(f"{n} ms/token" for n in names), *(f"{n} / {BASELINE}" for n in converted)]
    header += [f"{n} cache MiB" for n in names] + [f"{n} prefill s" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
    for context in contexts:
        row = [str(context)]
        row += [f"{by_key[n, context].latency_ms:.2f}" for n in names]
        row += [f"{by_key[n, context].latency_ms / by_key[BASELINE, context].latency_ms:.2f}x" for n in converted]
        row += [f"{by_key[n, context].cache_bytes / 2**20:.2f}" for n in names]
        row += [f"{by_key[n, context].prefill_s:.2f}" for n in names]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(measurements: list[Measurement], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_latency, ax_bytes) = plt.subplots(2, 1, figsize=(7, 7))  # one under another: readable at page width
    for name in dict.fromkeys(m.model for m in measurements):
        rows = [m for m in measurements if m.model == name]
        contexts = [m.context for m in rows]
        ax_latency.plot(contexts, [m.latency_ms for m in rows], marker="o", label=name)
        ax_bytes.plot(contexts, [m.cache_bytes / 2**20 for m in rows], marker="o", label=name)
    for ax, ylabel in ((ax_latency, "decode latency (ms / token, median)"), (ax_bytes, "cache (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_bytes.set_yscale("log")
    fig.suptitle(textwrap.fill(title, 90), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_ALIAS, help="'default', a local dir or a Hub id")
    parser.add_argument(
        "--presets",
        nargs="*",
        default=None,
        help=f"presets to convert --model to, timed beside '{BASELINE}' (default: {' '.join(DEFAULT_PRESETS)}, "
        "or none when --converted is given; '--presets' alone: none)",
    )
    parser.add_argument(
        "--converted",
        nargs="+",
        default=[],
        metavar="DIR",
        help="saved converted models of --model (folders of finetune or save_pretrained), timed as saved",
    )
    parser.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--steps", type=int, default=8, help="decode steps per model per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per context length")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps per model and context")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill forward")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what a step's time is: the wall clock, or the process's CPU time (CPU, --threads 1; a shared machine)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations")
    parser.add_argument(
        "--compile", action="store_true", help="decode through a StaticCache with the forward in torch.compile"
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode (default: reduce-overhead, i.e. CUDA graphs, on cuda; default elsewhere)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="decode through a StaticCache with each step replayed from a CUDA graph (GraphedDecodeStep; no compile)",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="build --model from its config with random weights; random token ids",
    )
    parser.add_argument("--dataset", default=None, help="text that fills the context (default: offline pydoc corpus)")
    parser.add_argument(
        "--output", type=Path, default=Path("docs/figures/bench_generate"), help="writes OUTPUT.png, .md and .json"
    )
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stops with one line (exit status 2) on a setting that is not allowed, before anything is loaded."""
    if sorted(args.contexts) != args.contexts or args.contexts[0] < 1:
        parser.error(f"--contexts={args.contexts} is not allowed; expected increasing positive ints")
    for flag in ("warmup", "steps", "rounds", "prefill_chunk"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} is not allowed; expected an int >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} is not allowed; expected an int >= 1")
    unknown = [name for name in args.presets or () if name not in PRESETS]
    if unknown:
        parser.error(f"--presets {' '.join(unknown)}: unknown; expected names from {', '.join(PRESETS)}")
    missing = [path for path in args.converted if not (Path(path) / "config.json").is_file()]
    if missing:
        parser.error(f"--converted {' '.join(missing)}: not a saved model folder (no config.json)")
    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        parser.error(
            f"--clock cpu needs --device cpu (got {args.device!r}) and --threads 1 (got {args.threads}): the process's "
            "CPU time is a step's time only when one thread computes it"
        )
    if args.compile and args.cuda_graph:
        parser.error("--compile and --cuda-graph are two ways to decode; pass one of them")
    if args.cuda_graph and (not args.device.startswith("cuda") or args.warmup < 2):
        parser.error(
            f"--cuda-graph needs --device cuda (got {args.device!r}) and --warmup >= 2 (got {args.warmup}): "
            "the first step runs eagerly, the second records the graph"
        )


def converted_configs(paths: list[str]) -> dict[str, SoftmaxRNNConfigMixin]:
    """The config of each saved converted model; `UserInputError` for a folder that holds another model."""
    configs = {}
    for path in paths:
        config = AutoConfig.from_pretrained(path)
        if not isinstance(config, SoftmaxRNNConfigMixin):
            raise UserInputError(
                f"--converted {path}: model_type {config.model_type!r} is not a converted model; expected one of "
                "'softmax_rnn_llama', 'softmax_rnn_gpt2'"
            )
        configs[path] = config
    return configs


def load_converted(path: str, config: SoftmaxRNNConfigMixin, vocab_size: int, random_weights: bool = False):
    """The converted model saved at `path` (random weights from `config` with `random_weights`);
    `UserInputError` when its vocabulary is not `vocab_size` (that of the model it is timed beside)."""
    if config.vocab_size != vocab_size:
        raise UserInputError(
            f"--converted {path}: vocabulary of {config.vocab_size} tokens, --model has {vocab_size}; "
            "expected a conversion of --model"
        )
    if random_weights:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_pretrained(path)


def _exit_with(error: UserInputError) -> None:
    print(f"bench_generate.py: error: {error}", file=sys.stderr)
    raise SystemExit(2) from error


def main() -> None:
    args = parse_args()
    try:  # what this machine has, apart from parse_args (which checks the documentation's GPU commands anywhere)
        resolve_device(args.device)
        saved_configs = converted_configs(args.converted)
    except UserInputError as error:
        _exit_with(error)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.presets is None:
        args.presets = [] if args.converted else list(DEFAULT_PRESETS)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    compile_mode = None
    if args.compile:
        compile_mode = args.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
        # one compiled step per model and context (new cache shapes and addresses): keep them all compiled
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(args.contexts))
    if args.random_weights:
        torch.manual_seed(0)
        base_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        stream = torch.randint(0, base_model.config.vocab_size, (args.contexts[-1],))
    else:
        from hf_softmax_rnn.data.corpus import load_corpus
        from hf_softmax_rnn.evaluation import token_stream

        base_model, tokenizer = resolve_model(args.model)
        stream = token_stream(tokenizer, load_corpus(args.dataset)["train"]["text"])
        stream = torch.tensor(stream * -(-args.contexts[-1] // len(stream)))
    models = {name: convert(base_model, name) for name in args.presets}
    try:
        for path, config in saved_configs.items():
            models[path] = load_converted(path, config, base_model.config.vocab_size, args.random_weights)
    except UserInputError as error:
        _exit_with(error)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    decoders = [
        Decoder(name, model.eval().to(device=device, dtype=dtype), compile_mode, args.cuda_graph, clock)
        for name, model in models.items()
    ]
    baseline = base_model.eval().to(device=device, dtype=dtype)
    decoders.insert(0, Decoder(BASELINE, baseline, compile_mode, args.cuda_graph, clock))
    measurements = run_benchmark(decoders, stream.to(device), args)

    model_name = DEFAULT_MODEL_NAME if args.model == DEFAULT_MODEL_ALIAS else args.model
    weights = ", random weights" if args.random_weights else ""
    hardware = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"
    )
    how = "eager, dynamic cache"
    if compile_mode:
        how = f"static cache + torch.compile(mode={compile_mode!r})"
    elif args.cuda_graph:
        how = "static cache + CUDA graph per step (GraphedDecodeStep)"
    clock_name = ", CPU time per token" if args.clock == "cpu" else ""
    title = f"{model_name}{weights}: greedy decoding, {args.dtype}, {how}, {hardware}{clock_name}"
    table = markdown_table(measurements, args.contexts)
    report = "\n".join([title, "", table, "", *summary(measurements, args.contexts)])
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(report + "\n")
    args.output.with_suffix(".json").write_text(
        json.dumps(
            {"settings": {k: str(v) for k, v in vars(args).items()}, "measurements": [asdict(m) for m in measurements]},
            indent=2,
        )
        + "\n"
    )
    plot(measurements, args.output.with_suffix(".png"), title)
    logger.info("Wrote %s.{md,json,png}", args.output)


if __name__ == "__main__":
    main()

"""Batched greedy decoding throughput: tokens/s over all sequences at the largest batch that fits.

The model (`--model`, a config folder; default SmolLM2-135M's shape) is built with random weights
and served as transformers' own class ("transformers": a KV cache that grows with the context)
beside converted copies (`--presets`: a recurrent state of fixed size per sequence). For each
context length, each model prefills one random sequence to that length (in chunks, not timed),
then its cache is repeated to B sequences and B tokens are decoded per step, eagerly from a
`DynamicCache` (`--warmup` untimed steps, then `--steps` timed; the cost of a step does not depend
on what the sequences hold). B doubles from 1 up to `--max-batch` until a try runs out of memory,
then is bisected between the last batch that fitted and the first that did not, so each model is
reported at the largest batch found. Peak memory is the allocator's peak above the weights during
the timed steps (the cache of B sequences and the step's activations; CUDA only).

A `DynamicCache` is what `generate()` builds by default: its KV layers grow by concatenation, so each
step of the KV model copies its whole cache. `--static-cache` decodes each batch eagerly from a
`StaticCache` instead (the prefilled cache copied B times, `hf_softmax_rnn.decoding.static_cache_from`),
whose KV layers are written in place. Eager decoding launches every kernel of a step from Python, so on
a GPU at small and middling batches it is bound by launches, not by the GPU. `--cuda-graph` decodes each
batch from such a `StaticCache` through one CUDA graph per step (`GraphedDecodeStep`): the first untimed
step runs eagerly, the second records the graph.

    python scripts/bench_serve.py --device cuda --dtype bfloat16 --output gpu_results/bench_serve
    python scripts/bench_serve.py --device cuda --dtype bfloat16 --cuda-graph --output gpu_results/bench_serve_graph
    python scripts/bench_serve.py --contexts 2048 8192 --max-batch 32 --static-cache --output /tmp/bench_serve
    python scripts/bench_serve.py --layers 2 --contexts 64 128 --max-batch 8 --output /tmp/bench_serve

Target: at 8,192 tokens of context, each recurrent model >= 3x the KV model's tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Cache, DynamicCache

from hf_softmax_rnn.analysis.bench_report import (
    check_model_flags,
    device_or_exit,
    plot_panels,
    write_bench_report,
)
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.decoding import GraphedDecodeStep, static_cache_from
from hf_softmax_rnn.layers.cache import cache_nbytes
from hf_softmax_rnn.utils import hardware_name

logger = logging.getLogger("bench_serve")

BASELINE = "transformers"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "smollm2_135m_config"
DEFAULT_PRESETS = ("linear_elu", "hedgehog_window_64", "softmax_taylor_2")
DEFAULT_CONTEXTS = (2048, 8192, 32768)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGET_CONTEXT, TARGET_RATIO = 8192, 3.0


@dataclass
class Measurement:
    model: str
    context: int
    batch: int
    tokens_per_s: float
    step_ms: float
    cache_bytes: int
    peak_bytes: int | None


class Server:
    """One model and the cache of one prefilled sequence, decoded as a batch of copies: eagerly from a
    `DynamicCache`, eagerly from a `StaticCache` (`static`), or from a `StaticCache` through CUDA graphs
    (`graphed`)."""

    def __init__(self, name: str, model, graphed: bool = False, static: bool = False) -> None:
        self.name, self.model, self.graphed, self.static = name, model, graphed, static or graphed
        self.cache: DynamicCache | None = None
        self.next_token: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(self, stream: torch.Tensor, chunk: int) -> None:
        """A fresh cache fed `stream` `[L]` (one sequence) in chunks."""
        self.cache = DynamicCache(config=self.model.config)
        for begin in range(0, stream.shape[0], chunk):
            ids = stream[None, begin : begin + chunk]
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        self.next_token = logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def decode(self, batch: int, warmup: int, steps: int) -> Measurement:
        """Decode `batch` copies of the prefilled sequence; raises torch.OutOfMemoryError."""
        device = self.next_token.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            baseline = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        cache, decode_step = self._batch(batch, warmup + steps)
        tokens = self.next_token.repeat(batch, 1)
        seconds = 0.0
        for step in range(warmup + steps):
            _synchronize(device)
            start = time.perf_counter()
            tokens = decode_step(tokens)[:, -1:].argmax(-1)
            _synchronize(device)
            if step >= warmup:
                seconds += time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) - baseline if cuda else None
        context = self.cache.get_seq_length()
        return Measurement(
            self.name, context, batch, batch * steps / seconds, 1000 * seconds / steps, cache_nbytes(cache), peak
        )

    def _batch(self, batch: int, new_tokens: int) -> tuple[Cache, Callable[[torch.Tensor], torch.Tensor]]:
        """The cache of `batch` copies of the prefilled sequence, with room for `new_tokens` more, and the
        decode step over it (token ids `[B, 1]` -> logits `[B, 1, V]`)."""
        if self.static:
            context = self.cache.get_seq_length()
            cache = static_cache_from(self.cache, self.model.config, context + new_tokens + 1, repeats=batch)
            if self.graphed:
                return cache, GraphedDecodeStep(self.model, cache)
        else:
            cache = copy.deepcopy(self.cache)
            cache.batch_repeat_interleave(batch)
        return cache, lambda tokens: self.model(input_ids=tokens, cache=cache, use_cache=True).logits


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def largest_batch(attempt: Callable[[int], Measurement | None], cap: int) -> Measurement | None:
    """The measurement at the largest batch <= `cap` for which `attempt` returns one (None: out of
    memory): doubling from 1, then bisecting between the last fit and the first miss to within 1/8."""
    best, batch, miss = None, 1, None
    while batch <= cap:
        result = attempt(batch)
        if result is None:
            miss = batch
            break
        best, batch = result, batch * 2
    if best is None:
        return None
    if miss is None and best.batch < cap:
        result = attempt(cap)
        if result is not None:
            return result
        miss = cap
    while miss is not None and miss - best.batch > max(1, best.batch // 8):
        middle = (best.batch + miss) // 2
        result = attempt(middle)
        if result is None:
            miss = middle
        else:
            best = result
    return best


def _attempt(server: Server, args) -> Callable[[int], Measurement | None]:
    def attempt(batch: int) -> Measurement | None:
        try:
            measurement = server.decode(batch, args.warmup, args.steps)
        except torch.OutOfMemoryError:
            measurement = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("%s, context %d, batch %d: %s", server.name, server.cache.get_seq_length(), batch, measurement)
        return measurement

    return attempt


def run_benchmark(
    servers: list[Server], vocab_size: int, device: torch.device, args, done: Callable[[list[Measurement]], None]
) -> list[Measurement]:
    """For each context, each model at its largest batch; `done` is handed the measurements so far after
    each context (a run cut short keeps what finished)."""
    measurements = []
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(0, vocab_size, (args.contexts[-1],), generator=generator).to(device)
    for context in args.contexts:
        for server in servers:
            server.prefill(stream[:context], args.prefill_chunk)
            result = largest_batch(_attempt(server, args), args.max_batch)
            if result is not None:
                measurements.append(result)
            server.cache = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        done(measurements)
    return measurements


def markdown_table(measurements: list[Measurement], contexts: list[int]) -> str:
    """context | per model: largest batch, tokens/s, peak GiB | each converted model's tokens/s / transformers."""
    names = list(dict.fromkeys(m.model for m in measurements))
    cell = {(m.model, m.context): m for m in measurements}
    converted = [name for name in names if name != BASELINE]
    header = ["context"]
    for name in names:
        header += [f"{name} batch", f"{name} tokens/s", f"{name} peak GiB"]
    header += [f"{name} / {BASELINE}" for name in converted]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
    for context in contexts:
        row = [str(context)]
        for name in names:
            m = cell.get((name, context))
            peak = "-" if m is None or m.peak_bytes is None else f"{m.peak_bytes / 2**30:.2f}"
            row += ["-", "out of memory", "-"] if m is None else [str(m.batch), f"{m.tokens_per_s:,.0f}", peak]
        for name in converted:
            m, base = cell.get((name, context)), cell.get((BASELINE, context))
            row.append("-" if m is None or base is None else f"{m.tokens_per_s / base.tokens_per_s:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(measurements: list[Measurement]) -> list[str]:
    rate = {(m.model, m.context): m.tokens_per_s for m in measurements}
    base = rate.get((BASELINE, TARGET_CONTEXT))
    return [
        f"- `{name}` at context {context}: {value / base:.2f}x {BASELINE} tokens/s (target >= {TARGET_RATIO}x)"
        for (name, context), value in rate.items()
        if name != BASELINE and context == TARGET_CONTEXT and base
    ]


def plot(measurements: list[Measurement], path: Path, title: str) -> None:
    models = {
        name: [m for m in measurements if m.model == name] for name in dict.fromkeys(m.model for m in measurements)
    }
    rate = {name: ([m.context for m in rows], [m.tokens_per_s for m in rows]) for name, rows in models.items()}
    batch = {name: ([m.context for m in rows], [m.batch for m in rows]) for name, rows in models.items()}
    panels = [("decoded tokens/s, all sequences", rate), ("largest batch that fits", batch)]
    plot_panels(path, title, "context length (tokens)", panels, log_y=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_CONFIG, help="folder of the config.json to time")
    parser.add_argument(
        "--presets",
        nargs="+",
        default=list(DEFAULT_PRESETS),
        help=f"converted models, served beside '{BASELINE}' (default: {' '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--max-batch", type=int, default=512, help="largest batch tried")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps per batch")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill forward")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations")
    parser.add_argument(
        "--static-cache",
        action="store_true",
        help="decode eagerly from a StaticCache (written in place) instead of a DynamicCache (grown by concatenation)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="decode from a StaticCache through one CUDA graph per step (needs --device cuda and --warmup >= 2)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("bench_serve"), help="writes OUTPUT/bench_serve.{md,json,png}"
    )
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stops with one line (exit status 2) on a setting that is not allowed, before anything is loaded."""
    check_model_flags(parser, args, ("max_batch", "steps", "warmup", "prefill_chunk"))
    if sorted(set(args.contexts)) != args.contexts or args.contexts[0] < 1:
        parser.error(f"--contexts={args.contexts} is not allowed; expected increasing positive ints")
    if args.cuda_graph and not args.device.startswith("cuda"):
        parser.error(f"--cuda-graph needs a GPU; --device={args.device!r}, expected cuda or cuda:N")
    if args.cuda_graph and args.warmup < 2:
        parser.error(
            f"--warmup={args.warmup} is not allowed with --cuda-graph; expected at least 2 (an eager step, then the "
            "recording of the graph)"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = device_or_exit("bench_serve.py", args.device)  # parse_args checks GPU commands anywhere
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dtype = DTYPES[args.dtype]
    config = AutoConfig.from_pretrained(args.model)
    config.max_position_embeddings = max(config.max_position_embeddings, args.contexts[-1] + args.warmup + args.steps)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_config(config)
    models = [(name, convert(base_model, name)) for name in args.presets]
    models.insert(0, (BASELINE, base_model))
    servers = [
        Server(name, model.eval().to(device=device, dtype=dtype), args.cuda_graph, args.static_cache)
        for name, model in models
    ]
    hardware = hardware_name(device)
    if args.cuda_graph:
        decoding = "CUDA graphs over a static cache"
    else:
        decoding = "eager over a static cache" if args.static_cache else "eager over a dynamic cache"
    title = (
        f"{args.model.name}, {config.num_hidden_layers} layers, random weights: batched greedy decoding, {decoding}, "
        f"{args.dtype}, {hardware}; largest batch <= {args.max_batch} that fits, {args.steps} timed steps"
    )
    run_benchmark(servers, config.vocab_size, device, args, lambda done: write_report(done, args, title))
    print((args.output / "bench_serve.md").read_text(), end="")


def write_report(measurements: list[Measurement], args: argparse.Namespace, title: str) -> None:
    """OUTPUT/bench_serve.{md,json,png} for the contexts measured so far."""
    contexts = [c for c in args.contexts if any(m.context == c for m in measurements)]
    body = [markdown_table(measurements, contexts), "", *summary(measurements)]
    write_bench_report(args.output, "bench_serve", title, body, measurements, vars(args), plot)


if __name__ == "__main__":
    sys.exit(main())

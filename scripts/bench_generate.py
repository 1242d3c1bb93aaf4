"""Per-token decode latency and cache bytes against context length, KV cache vs recurrent state.

The default model is converted to each preset (softmax keeps a KV cache; linear_elu and
softmax_taylor_2 decode from a fixed-size recurrent state). Every model reads the same
token stream: it is prefilled in chunks up to each context length in turn (chunked mode for
the recurrent layers, attention to the growing KV cache for softmax), then decodes greedily
one token at a time. A snapshot of each cache is kept at each length, and all (length,
model) cells are timed in interleaved rounds at the end, so a change in load from other
processes falls on every cell alike; latencies are medians. Each cell's cache grows by the
`rounds * steps` tokens it decodes (cache bytes are reported after them).

    python scripts/bench_generate.py                     # 128 ... 16384, writes docs/figures/bench_generate.*
    python scripts/bench_generate.py --contexts 128 1024 --steps 4 --rounds 1
    python scripts/bench_generate.py --device cuda --random-weights --model CONFIG_DIR   # speed only, no checkpoint

`--random-weights` builds the model from its config alone with random weights and feeds random
token ids: the cost per token does not depend on the weights, so a GPU machine needs only a
config.json.

Target (issue 3): a recurrent variant's latency at 16384 within 1.2x of its latency at 128,
and at least 2x faster than softmax at 16384. SmolLM2 was trained on 8192 positions; beyond
that the text is meaningless but the cost per token is what is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME, resolve_model
from hf_softmax_rnn.layers.cache import cache_nbytes

logger = logging.getLogger("bench_generate")

DEFAULT_PRESETS = ("softmax", "linear_elu", "softmax_taylor_2")
DEFAULT_CONTEXTS = (128, 512, 2048, 8192, 16384)
LATENCY_RATIO_TARGET = 1.2
SPEEDUP_TARGET = 2.0


@dataclass
class Measurement:
    preset: str
    context: int
    latency_ms: float
    cache_bytes: int
    prefill_s: float


class DecodeSession:
    """One model, its cache and the greedy continuation, grown in place."""

    def __init__(self, preset: str, model) -> None:
        self.preset = preset
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.next_token: torch.Tensor | None = None

    @torch.inference_mode()
    def prefill_to(self, stream: torch.Tensor, length: int, chunk: int) -> float:
        """Feed tokens of `stream` until the cache holds `length` positions; returns seconds."""
        start = time.perf_counter()
        for begin in range(self.length, length, chunk):
            ids = stream[None, begin : min(begin + chunk, length)]
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
            self.length += ids.shape[1]
            self.next_token = logits[:, -1:].argmax(-1)
        _synchronize(self.next_token.device)
        return time.perf_counter() - start

    def snapshot(self) -> DecodeSession:
        """An independent copy (own cache) that decodes on from this point; the model is shared."""
        clone = DecodeSession.__new__(DecodeSession)
        clone.__dict__.update(self.__dict__, cache=deepcopy(self.cache), next_token=self.next_token.clone())
        return clone

    @torch.inference_mode()
    def decode(self, steps: int) -> list[float]:
        """Greedy decode `steps` tokens; returns the seconds of each step."""
        latencies = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = self.model(input_ids=self.next_token, cache=self.cache, use_cache=True).logits
            self.next_token = logits[:, -1:].argmax(-1)
            _synchronize(self.next_token.device)
            latencies.append(time.perf_counter() - start)
            self.length += 1
        return latencies


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_benchmark(sessions: list[DecodeSession], stream: torch.Tensor, args) -> list[Measurement]:
    """Prefill every model to each context length and keep a snapshot there; then time all
    (context, preset) snapshots in interleaved rounds, so that load from other processes
    falls on every cell alike."""
    snapshots: dict[tuple[int, str], DecodeSession] = {}
    prefill_s: dict[tuple[int, str], float] = {}
    for context in tqdm(args.contexts, desc="Prefilling", unit="length"):
        for session in sessions:
            prefill_s[context, session.preset] = session.prefill_to(stream, context, args.prefill_chunk)
            snapshots[context, session.preset] = session.snapshot()
    latencies: dict[tuple[int, str], list[float]] = {key: [] for key in snapshots}
    for _ in tqdm(range(args.rounds), desc="Timing rounds", unit="round"):
        for key, snapshot in snapshots.items():
            latencies[key] += snapshot.decode(args.steps)
    measurements = []
    for (context, preset), snapshot in snapshots.items():
        measurement = Measurement(
            preset=preset,
            context=context,
            latency_ms=1000 * statistics.median(latencies[context, preset]),
            cache_bytes=cache_nbytes(snapshot.cache),
            prefill_s=prefill_s[context, preset],
        )
        logger.info("%s", measurement)
        measurements.append(measurement)
    return measurements


def summary(measurements: list[Measurement], contexts: list[int]) -> list[str]:
    """The issue's two targets, one line per recurrent preset."""
    latency = {(m.preset, m.context): m.latency_ms for m in measurements}
    shortest, longest = min(contexts), max(contexts)
    lines = []
    for preset in dict.fromkeys(m.preset for m in measurements):
        if preset == "softmax":
            continue
        ratio = latency[preset, longest] / latency[preset, shortest]
        line = f"- `{preset}`: latency {longest} / {shortest} = {ratio:.2f}x (target <= {LATENCY_RATIO_TARGET}x)"
        if ("softmax", longest) in latency:
            speedup = latency["softmax", longest] / latency[preset, longest]
            line += f"; softmax / {preset} at {longest} = {speedup:.2f}x (target >= {SPEEDUP_TARGET}x)"
        lines.append(line)
    return lines


def markdown_table(measurements: list[Measurement], contexts: list[int]) -> str:
    presets = list(dict.fromkeys(m.preset for m in measurements))
    by_key = {(m.preset, m.context): m for m in measurements}
    header = ["context"] + [f"{p} ms/token" for p in presets] + [f"{p} cache MiB" for p in presets]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
    for context in contexts:
        row = [str(context)]
        row += [f"{by_key[p, context].latency_ms:.1f}" for p in presets]
        row += [f"{by_key[p, context].cache_bytes / 2**20:.2f}" for p in presets]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(measurements: list[Measurement], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_latency, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for preset in dict.fromkeys(m.preset for m in measurements):
        rows = [m for m in measurements if m.preset == preset]
        contexts = [m.context for m in rows]
        ax_latency.plot(contexts, [m.latency_ms for m in rows], marker="o", label=preset)
        ax_bytes.plot(contexts, [m.cache_bytes / 2**20 for m in rows], marker="o", label=preset)
    for ax, ylabel in ((ax_latency, "decode latency (ms / token, median)"), (ax_bytes, "cache (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_bytes.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_ALIAS, help="'default', a local dir or a Hub id")
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--steps", type=int, default=8, help="decode steps per model per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per context length")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill forward")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="build --model from its config with random weights; random token ids",
    )
    parser.add_argument("--dataset", default=None, help="text that fills the context (default: offline pydoc corpus)")
    parser.add_argument(
        "--output", type=Path, default=Path("docs/figures/bench_generate"), help="writes OUTPUT.png, .md and .json"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sorted(args.contexts) != args.contexts or args.contexts[0] < 1:
        raise ValueError(f"--contexts={args.contexts} is not allowed; expected increasing positive ints")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
    sessions = [DecodeSession(preset, convert(base_model, preset).eval().to(args.device)) for preset in args.presets]
    del base_model
    measurements = run_benchmark(sessions, stream.to(args.device), args)

    model_name = DEFAULT_MODEL_NAME if args.model == DEFAULT_MODEL_ALIAS else args.model
    weights = ", random weights" if args.random_weights else ""
    hardware = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else f"{torch.get_num_threads()} CPU thread(s)"
    )
    title = f"{model_name}{weights}: greedy decoding, {hardware}"
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

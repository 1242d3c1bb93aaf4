"""Operator benchmark: forward and forward+backward time and peak memory against length.

Shapes are the embedded default model's attention (B=1, H=9, Hkv=3, D=64). Each
(variant, mode, length) runs in its own subprocess so that peak memory is the process's
peak resident set size minus its resident size just before the call. Prints a markdown
table and writes a PNG.

    python scripts/bench_ops.py                       # 512 ... 16384
    python scripts/bench_ops.py --lengths 512 1024 --output /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention

SHAPE = dict(batch=1, heads=9, kv_heads=3, head_dim=64)
#: (label, preset, mode, longest length it is run at: the quadratic forms would need tens of GB).
CASES = [
    ("softmax (SDPA)", "softmax", "parallel", 16384),
    ("linear elu, parallel", "linear_elu", "parallel", 4096),
    ("linear elu, chunked", "linear_elu", "chunked", 16384),
    ("linear elu, recurrent", "linear_elu", "recurrent", 4096),
    ("Taylor-2, parallel", "softmax_taylor_2", "parallel", 4096),
    ("Taylor-2, chunked", "softmax_taylor_2", "chunked", 16384),
]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_case(preset: str, mode: str, length: int, backward: bool, repeats: int, chunk_size: int | None) -> dict:
    """Time one call (best of `repeats`) and measure its peak memory above the inputs."""
    torch.manual_seed(0)
    spec = AttentionSpec.from_preset(preset, **({} if chunk_size is None else {"chunk_size": chunk_size}))
    b, h, hkv, d = SHAPE["batch"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    q = torch.randn(b, h, length, d, requires_grad=backward)
    k = torch.randn(b, hkv, length, d, requires_grad=backward)
    v = torch.randn(b, hkv, length, d, requires_grad=backward)
    baseline = _rss_bytes()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out, _ = attention(q, k, v, spec, mode=mode)
            if backward:
                out.sum().backward()
        times.append(time.perf_counter() - start)
        del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": min(times), "peak_bytes": max(peak - baseline, 0)}


def _measure_in_subprocess(preset, mode, length, backward, repeats, chunk_size) -> dict:
    job = json.dumps(dict(preset=preset, mode=mode, length=length, backward=backward, repeats=repeats, chunk_size=chunk_size))
    done = subprocess.run([sys.executable, __file__, "--worker", job], capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _format_cell(result: dict | None, key: str) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return "error"
    return f"{result['seconds']:.3f}" if key == "seconds" else f"{result['peak_bytes'] / 2**20:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--chunk-size", type=int, default=None, help="override the presets' chunk size")
    parser.add_argument("--repeats", type=int, default=2, help="best-of repeats below 4096 tokens (1 above)")
    parser.add_argument("--output", type=Path, default=Path("docs/figures/bench_ops"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(run_case(**job)))
        return

    from tqdm import tqdm

    results: dict[tuple[str, int, bool], dict] = {}
    jobs = [(case, n, bw) for case in CASES for n in args.lengths if n <= case[3] for bw in (False, True)]
    for (label, preset, mode, _), length, backward in tqdm(jobs, desc="bench_ops"):
        repeats = args.repeats if length < 4096 else 1
        results[label, length, backward] = _measure_in_subprocess(preset, mode, length, backward, repeats, args.chunk_size)

    lines = [
        f"B={SHAPE['batch']}, H={SHAPE['heads']}, Hkv={SHAPE['kv_heads']}, D={SHAPE['head_dim']}, float32, "
        f"{torch.get_num_threads()} threads. Time in seconds, peak memory above the inputs in MiB.",
        "",
        "| variant | " + " | ".join(f"L={n} fwd / fwd+bwd (s)" for n in args.lengths) + " |",
        "|---|" + "---|" * len(args.lengths),
    ]
    for label, *_ in CASES:
        cells = [f"{_format_cell(results.get((label, n, False)), 'seconds')} / {_format_cell(results.get((label, n, True)), 'seconds')}" for n in args.lengths]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| variant | " + " | ".join(f"L={n} fwd+bwd peak (MiB)" for n in args.lengths) + " |", "|---|" + "---|" * len(args.lengths)]
    for label, *_ in CASES:
        lines.append(f"| {label} | " + " | ".join(_format_cell(results.get((label, n, True)), "peak") for n in args.lengths) + " |")
    longest = max(args.lengths)
    sdpa = results.get(("softmax (SDPA)", longest, True))
    if sdpa and "error" not in sdpa:
        lines.append("")
        for label in ("linear elu, chunked", "Taylor-2, chunked"):
            other = results.get((label, longest, True))
            if other and "error" not in other:
                lines.append(f"- fwd+bwd at L={longest}: {label} is {sdpa['seconds'] / other['seconds']:.1f}x faster than SDPA softmax")
    table = "\n".join(lines)
    print(table)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(table + "\n")
    _plot(results, args.lengths, args.output.with_suffix(".png"))


def _plot(results: dict, lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, *_ in CASES:
        points = [(n, results[label, n, True]) for n in lengths if "seconds" in results.get((label, n, True), {})]
        if points:
            time_axis.plot([n for n, _ in points], [r["seconds"] for _, r in points], marker="o", label=label)
            memory_axis.plot([n for n, _ in points], [r["peak_bytes"] / 2**20 for _, r in points], marker="o", label=label)
    for axis, ylabel in ((time_axis, "forward+backward time (s)"), (memory_axis, "peak memory above inputs (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length L")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
    time_axis.legend(fontsize=8)
    figure.suptitle("Attention operators, B=1, H=9, Hkv=3, D=64 (CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

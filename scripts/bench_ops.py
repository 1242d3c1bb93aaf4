"""Operator benchmark: forward and forward+backward time and peak memory against length.

Shapes are the embedded default model's attention (B=1, H=9, Hkv=3, D=64). On CPU each
(variant, mode, length) runs in a forked child process so that peak memory is the process's
peak resident set size minus its resident size just before the call; on CUDA it runs in
process and peak memory is the allocator's peak above the inputs. Prints a markdown table
and writes a PNG.

    python scripts/bench_ops.py                       # 512 ... 16384 on CPU
    python scripts/bench_ops.py --lengths 512 1024 --output /tmp/bench
    python scripts/bench_ops.py --device cuda --output docs/figures/bench_ops_cuda
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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


def run_case(
    preset: str, mode: str, length: int, backward: bool, repeats: int, chunk_size: int | None, device: str = "cpu"
) -> dict:
    """Time one call (best of `repeats`, after a warm-up call: at the same length on CUDA, at
    256 positions on CPU) and measure its peak memory above the inputs."""
    torch.manual_seed(0)
    spec = AttentionSpec.from_preset(preset, **({} if chunk_size is None else {"chunk_size": chunk_size}))
    q, k, v = _inputs(length, backward, device)
    cuda = device.startswith("cuda")

    def call() -> float:
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out, _ = attention(q, k, v, spec, mode=mode)
            if backward:
                out.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    if cuda:
        call()
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        _warm_up(spec, mode, backward)
        baseline = _rss_bytes()
    times = [call() for _ in range(repeats)]
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": min(times), "peak_bytes": max(peak - baseline, 0)}


def _inputs(length: int, backward: bool, device: str = "cpu") -> list[torch.Tensor]:
    """Random q `[B, H, L, D]`, k, v `[B, Hkv, L, D]` of the benchmark's shape."""
    b, h, hkv, d = SHAPE["batch"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    return [torch.randn(b, heads, length, d, device=device, requires_grad=backward) for heads in (h, hkv, hkv)]


def _warm_up(spec: AttentionSpec, mode: str, backward: bool, length: int = 256) -> None:
    """One short call first, so that the timed calls do not also pay for the thread pool's and
    the allocator's first use (a few MiB of peak memory may be reused)."""
    with torch.set_grad_enabled(backward):
        out, _ = attention(*_inputs(length, backward), spec, mode=mode)
        if backward:
            out.sum().backward()


def _measure(preset, mode, length, backward, repeats, chunk_size, device) -> dict:
    """On CUDA in this process; on CPU in a forked child (so its peak RSS is this call's)."""
    if device.startswith("cuda"):
        try:
            return run_case(preset, mode, length, backward, repeats, chunk_size, device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return {"error": "out of memory"}
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return pool.submit(run_case, preset, mode, length, backward, repeats, chunk_size).result()
        except (BrokenProcessPool, RuntimeError, MemoryError) as error:
            return {"error": f"{type(error).__name__}: {error}"}


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
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="time the best of this many calls (machines with neighbours vary by 20%%)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--output", type=Path, default=Path("docs/figures/bench_ops"))
    args = parser.parse_args()
    from tqdm import tqdm

    results: dict[tuple[str, int, bool], dict] = {}
    jobs = [(case, n, bw) for case in CASES for n in args.lengths if n <= case[3] for bw in (False, True)]
    for (label, preset, mode, _), length, backward in tqdm(jobs, desc="bench_ops"):
        results[label, length, backward] = _measure(
            preset, mode, length, backward, args.repeats, args.chunk_size, args.device
        )

    lines = [
        f"B={SHAPE['batch']}, H={SHAPE['heads']}, Hkv={SHAPE['kv_heads']}, D={SHAPE['head_dim']}, float32, "
        f"{_device_name(args.device)}. Time in seconds, peak memory above the inputs in MiB.",
        "",
        "| variant | " + " | ".join(f"L={n} fwd / fwd+bwd (s)" for n in args.lengths) + " |",
        "|---|" + "---|" * len(args.lengths),
    ]
    for label, *_ in CASES:
        cells = [
            f"{_format_cell(results.get((label, n, False)), 'seconds')} / "
            f"{_format_cell(results.get((label, n, True)), 'seconds')}"
            for n in args.lengths
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| variant | " + " | ".join(f"L={n} fwd+bwd peak (MiB)" for n in args.lengths) + " |",
        "|---|" + "---|" * len(args.lengths),
    ]
    for label, *_ in CASES:
        lines.append(
            f"| {label} | "
            + " | ".join(_format_cell(results.get((label, n, True)), "peak") for n in args.lengths)
            + " |"
        )
    longest = max(args.lengths)
    sdpa = results.get(("softmax (SDPA)", longest, True))
    if sdpa and "error" not in sdpa:
        lines.append("")
        for label in ("linear elu, chunked", "Taylor-2, chunked"):
            other = results.get((label, longest, True))
            if other and "error" not in other:
                lines.append(
                    f"- fwd+bwd at L={longest}: {label} runs at {sdpa['seconds'] / other['seconds']:.3g}x the "
                    "speed of SDPA softmax"
                )
    table = "\n".join(lines)
    print(table)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(table + "\n")
    _plot(results, args.lengths, args.output.with_suffix(".png"), _device_name(args.device))


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU, {torch.get_num_threads()} threads"


def _plot(results: dict, lengths: list[int], path: Path, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, *_ in CASES:
        points = [(n, results[label, n, True]) for n in lengths if "seconds" in results.get((label, n, True), {})]
        if points:
            time_axis.plot([n for n, _ in points], [r["seconds"] for _, r in points], marker="o", label=label)
            memory_axis.plot(
                [n for n, _ in points], [r["peak_bytes"] / 2**20 for _, r in points], marker="o", label=label
            )
    for axis, ylabel in ((time_axis, "forward+backward time (s)"), (memory_axis, "peak memory above inputs (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length L")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
    time_axis.legend(fontsize=8)
    figure.suptitle(f"Attention operators, B=1, H=9, Hkv=3, D=64 ({device_name})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

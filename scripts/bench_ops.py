"""Operator benchmark: forward and forward+backward time and peak memory against length.

Shapes are the embedded default model's attention (B=1, H=9, Hkv=3, D=64; `--batch` sets B,
`--presets` keeps the rows of those presets, `fla` naming fla's own kernel). On CUDA the rows
marked "fused" run the GPU kernels (flash-linear-attention for feature maps, this package's
Triton kernel for Taylor-2; see `hf_softmax_rnn.ops.backends`), the rows marked "PyTorch" the
same maths without them, and "fla chunk_linear_attn" is flash-linear-attention's own elu linear
attention on the same shapes (GQA repeated, its own normaliser), for reference. On CPU each
(variant, mode, length) runs in a forked child process so that peak memory is the process's
peak resident set size minus its resident size just before the call; on CUDA it runs in
process and peak memory is the allocator's peak above the inputs. Prints a markdown table
and writes a PNG.

    python scripts/bench_ops.py                       # 512 ... 16384 on CPU
    python scripts/bench_ops.py --lengths 512 1024 --output /tmp/bench
    python scripts/bench_ops.py --device cuda --dtype bfloat16 --output docs/figures/bench_ops_cuda_bf16
    python scripts/bench_ops.py --device cuda --dtype bfloat16 --batch 8 --presets softmax linear_elu fla
    python scripts/bench_ops.py --device cuda --dtype bfloat16 --lengths 16384 --presets hedgehog_window_64 fla
    python scripts/bench_ops.py --lengths 1024 2048 4096 --presets hedgehog_window_256_sinks_4_kept_256_decay

The row "no state (FlexAttention)" is the window hybrid as training runs it: its window part in
FlexAttention (`ops.flex_window`), the rest in fla; "chunked" hands a state on and keeps the
PyTorch window part.
The "finetune default" rows are `finetune`'s attention with a decaying state, as its layers run
(256 kept positions) and as its retrieval layers run (2,048), handing a state on (a prefill); the
last, a retrieval layer training without a state, is causal softmax up to its 2,308 exact positions.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.ops import attention, backends
from hf_softmax_rnn.ops.kernels import AttentionParams
from hf_softmax_rnn.training.metrics import peak_resident_bytes
from hf_softmax_rnn.training.recipes import DEFAULT_ATTENTION
from hf_softmax_rnn.utils import resolve_device

SHAPE = dict(batch=1, heads=9, kv_heads=3, head_dim=64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLA_REFERENCE = "fla"


@dataclass(frozen=True)
class Case:
    """One row: `preset` in `mode` up to `max_length` (the quadratic forms would need tens of GB);
    `fused`: the GPU kernels allowed; `return_state`: False for training without a cache; `kept`: the
    preset's kept positions replaced (as in a retrieval layer)."""

    label: str
    preset: str
    mode: str
    max_length: int
    fused: bool = True
    return_state: bool = True
    cuda_only: bool = False
    kept: int | None = None


CASES = [
    Case("softmax (SDPA)", "softmax", "parallel", 16384),
    Case("linear elu, parallel", "linear_elu", "parallel", 4096),
    Case("linear elu, chunked", "linear_elu", "chunked", 16384),
    Case("linear elu, chunked, PyTorch", "linear_elu", "chunked", 16384, fused=False, cuda_only=True),
    Case("fla chunk_linear_attn (elu)", FLA_REFERENCE, "chunked", 16384, cuda_only=True),
    Case("linear elu, recurrent", "linear_elu", "recurrent", 4096),
    Case("linear hedgehog, chunked", "linear_hedgehog", "chunked", 16384),
    Case("hedgehog + window 64, chunked", "hedgehog_window_64", "chunked", 16384),
    Case(
        "hedgehog + window 64, no state (FlexAttention)",
        "hedgehog_window_64",
        "chunked",
        16384,
        return_state=False,
        cuda_only=True,
    ),
    Case("Taylor-2, parallel", "softmax_taylor_2", "parallel", 4096),
    Case("Taylor-2, chunked", "softmax_taylor_2", "chunked", 16384),
    Case("Taylor-2, no state (Triton)", "softmax_taylor_2", "chunked", 16384, return_state=False, cuda_only=True),
    Case("finetune default (256 kept), chunked", DEFAULT_ATTENTION, "chunked", 8192),
    Case("finetune default, retrieval layer (2,048 kept), chunked", DEFAULT_ATTENTION, "chunked", 8192, kept=2048),
    Case(
        "finetune default, retrieval layer (2,048 kept), no state (training)",
        DEFAULT_ATTENTION,
        "chunked",
        8192,
        return_state=False,
        kept=2048,
    ),
]
ROW_PRESETS = {case.preset for case in CASES}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def run_case(
    case: Case,
    length: int,
    backward: bool,
    repeats: int,
    chunk_size: int | None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Time one call (best of `repeats`, after a warm-up call: at the same length on CUDA, at
    256 positions on CPU) and measure its peak memory above the inputs."""
    torch.manual_seed(0)
    q, k, v = _inputs(length, backward, device, dtype)
    forward = _forward(case, chunk_size, device)
    cuda = device.startswith("cuda")

    def call() -> float:
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = forward(q, k, v)
            if backward:
                out.float().sum().backward()
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
        _warm_up(forward, backward)
        baseline = _rss_bytes()
    times = [call() for _ in range(repeats)]
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_resident_bytes()
    return {"seconds": min(times), "peak_bytes": max(peak - baseline, 0)}


def _inputs(length: int, backward: bool, device: str = "cpu", dtype=torch.float32) -> list[torch.Tensor]:
    """Random q `[B, H, L, D]`, k, v `[B, Hkv, L, D]` of the benchmark's shape."""
    b, h, hkv, d = SHAPE["batch"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    return [
        torch.randn(b, heads, length, d, device=device, dtype=dtype, requires_grad=backward) for heads in (h, hkv, hkv)
    ]


def _forward(case: Case, chunk_size: int | None, device: str):
    """The timed function (q, k, v) -> output of one row."""
    if case.preset == FLA_REFERENCE:
        return _fla_linear_attention
    overrides = {"chunk_size": chunk_size, "kept": case.kept}
    spec = AttentionSpec.from_preset(case.preset, **{name: v for name, v in overrides.items() if v is not None})
    params = _params(spec, device)

    def forward(q, k, v):
        # a decaying state: a half-life of about 385 positions at every key
        gates = {"decay": torch.full(k.shape[:3], -1.8e-3, device=k.device, dtype=k.dtype)} if spec.decay else {}
        with backends.fused_kernels(case.fused):
            out = attention(q, k, v, spec, mode=case.mode, params=params, gates=gates, return_state=case.return_state)
            return out[0]

    return forward


def _params(spec: AttentionSpec, device: str) -> AttentionParams:
    """Learned tensors as a freshly converted layer has them (random hedgehog maps)."""
    heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    width = spec.hedgehog_dim or head_dim
    return AttentionParams(
        hedgehog_q=0.1 * torch.randn(heads, head_dim, width, device=device),
        hedgehog_k=0.1 * torch.randn(kv_heads, head_dim, width, device=device),
        linear_log_scale=torch.zeros(heads, device=device),
        norm_weight=torch.ones(heads, head_dim, device=device),
        norm_bias=torch.zeros(heads, head_dim, device=device),
    )


def _fla_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """flash-linear-attention's own normalised elu linear attention (keys repeated per query head)."""
    import torch.nn.functional as F
    from fla.ops.linear_attn import chunk_linear_attn

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    phi_q, phi_k = (F.elu(x) + 1.0 for x in (q, k))
    out, _ = chunk_linear_attn(phi_q.transpose(1, 2), phi_k.transpose(1, 2), v.transpose(1, 2), normalize=True)
    return out.transpose(1, 2)


def _warm_up(forward, backward: bool, length: int = 256) -> None:
    """One short call first, so that the timed calls do not also pay for the thread pool's and
    the allocator's first use (a few MiB of peak memory may be reused)."""
    with torch.set_grad_enabled(backward):
        out = forward(*_inputs(length, backward))
        if backward:
            out.sum().backward()


def _measure(case, length, backward, repeats, chunk_size, device, dtype) -> dict:
    """On CUDA in this process; on CPU in a forked child (so its peak RSS is this call's)."""
    if device.startswith("cuda"):
        try:
            return run_case(case, length, backward, repeats, chunk_size, device, dtype)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return {"error": "out of memory"}
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return pool.submit(run_case, case, length, backward, repeats, chunk_size, device, dtype).result()
        except (BrokenProcessPool, RuntimeError, MemoryError) as error:
            return {"error": f"{type(error).__name__}: {error}"}


def _format_cell(result: dict | None, key: str) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return "error"
    return f"{result['seconds'] * 1000:.3g}" if key == "seconds" else f"{result['peak_bytes'] / 2**20:.0f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of q, k, v")
    parser.add_argument("--batch", type=int, default=SHAPE["batch"], help="batch size B")
    parser.add_argument(
        "--presets",
        nargs="+",
        choices=sorted(ROW_PRESETS),
        default=None,
        help="keep only the rows of these presets (default: every row)",
    )
    parser.add_argument("--output", type=Path, default=Path("docs/figures/bench_ops"))
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch={args.batch} is not allowed; expected an int >= 1")
    try:
        resolve_device(args.device)
    except UserInputError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    SHAPE["batch"] = args.batch  # read by the forked children too
    from tqdm import tqdm

    cuda = args.device.startswith("cuda")
    cases = [
        case for case in CASES if (cuda or not case.cuda_only) and (not args.presets or case.preset in args.presets)
    ]
    results: dict[tuple[str, int, bool], dict] = {}
    jobs = [(case, n, bw) for case in cases for n in args.lengths if n <= case.max_length for bw in (False, True)]
    for case, length, backward in tqdm(jobs, desc="bench_ops"):
        results[case.label, length, backward] = _measure(
            case, length, backward, args.repeats, args.chunk_size, args.device, DTYPES[args.dtype]
        )

    lines = [
        f"{_shape_text()}, {args.dtype}, "
        f"{_device_name(args.device)}. Time in ms (best of {args.repeats}), peak memory above the inputs in MiB.",
        "",
        "| variant | " + " | ".join(f"L={n} fwd / fwd+bwd (ms)" for n in args.lengths) + " |",
        "|---|" + "---|" * len(args.lengths),
    ]
    for label in (case.label for case in cases):
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
    for label in (case.label for case in cases):
        lines.append(
            f"| {label} | "
            + " | ".join(_format_cell(results.get((label, n, True)), "peak") for n in args.lengths)
            + " |"
        )
    longest = max(args.lengths)
    sdpa = results.get(("softmax (SDPA)", longest, True))
    if sdpa and "error" not in sdpa:
        lines.append("")
        for label in (case.label for case in cases if case.label != "softmax (SDPA)"):
            other = results.get((label, longest, True))
            if other and "error" not in other:
                lines.append(
                    f"- fwd+bwd at L={longest}: {label} runs at {sdpa['seconds'] / other['seconds']:.3g}x the "
                    "speed of SDPA softmax"
                )
    lines += _window_hybrid_target(results, longest)
    table = "\n".join(lines)
    print(table)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".md").write_text(table + "\n")
    _plot(results, cases, args.lengths, args.output.with_suffix(".png"), f"{_device_name(args.device)}, {args.dtype}")


#: Target: the window hybrid's fwd+bwd time in training form / fla's chunked linear attention alone.
WINDOW_HYBRID_TARGET = 1.5
WINDOW_HYBRID_ROW = "hedgehog + window 64, no state (FlexAttention)"


def _window_hybrid_target(results: dict, length: int) -> list[str]:
    """A line per finite-state reference row the window hybrid's training form is held against."""
    hybrid = results.get((WINDOW_HYBRID_ROW, length, True))
    if not hybrid or "error" in hybrid:
        return []
    lines = []
    for label in ("fla chunk_linear_attn (elu)", "linear hedgehog, chunked"):
        other = results.get((label, length, True))
        if other and "error" not in other:
            lines.append(
                f"- fwd+bwd at L={length}: {WINDOW_HYBRID_ROW} takes {hybrid['seconds'] / other['seconds']:.3g}x "
                f"the time of {label} (target <= {WINDOW_HYBRID_TARGET}x against fla)"
            )
    return lines


def _shape_text() -> str:
    return f"B={SHAPE['batch']}, H={SHAPE['heads']}, Hkv={SHAPE['kv_heads']}, D={SHAPE['head_dim']}"


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU, {torch.get_num_threads()} threads"


def _plot(results: dict, cases: list[Case], lengths: list[int], path: Path, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(2, 1, figsize=(7, 7))  # one under another: readable at page width
    for label in (case.label for case in cases):
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
    figure.suptitle(f"Attention operators, {_shape_text()} ({device_name})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

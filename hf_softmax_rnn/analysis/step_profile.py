"""Where a step's time goes: one call under `torch.profiler`, its kernels summed by kind.

On a GPU the rows are the device kernels (time on the device, launches); on a CPU the `aten::`
operators (their own CPU time, calls). `busy` compares the kernels' time with the step's
wall-clock time taken without the profiler: well under 1 means the device waits for the
host to launch work, so fewer launches would pay more than fewer bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

#: (kind, pattern over the lower-cased kernel or operator name), first match wins; the rest is "other".
KINDS = (
    ("attention kernels", re.compile(r"flash|fmha|attention|sdpa|flex|triton_tem|chunk|gla|taylor")),
    ("matrix products", re.compile(r"gemm|cutlass|cublas|nvjet|xmma|aten::(mm|bmm|addmm|baddbmm|matmul|linear)$")),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam")),
)
OTHER = "other (elementwise, copies, reductions)"
KIND_NAMES = (*(name for name, _ in KINDS), OTHER)


def kind_of(name: str) -> str:
    """The kind of a kernel or operator, by its name (`KINDS`)."""
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if pattern.search(lowered)), OTHER)


@dataclass
class StepProfile:
    """One profiled step of `model` at sequence length `length`: kernel time by kind (ms), launches,
    and the `top` kernels as (name, ms, launches)."""

    model: str
    length: int
    device_type: str
    kernel_ms: float
    launches: int
    ms_by_kind: dict[str, float]
    top: list[tuple[str, float, int]] = field(default_factory=list)
    step_ms: float | None = None

    @property
    def busy(self) -> float | None:
        """Kernel time / the unprofiled step's wall-clock time (None when not timed)."""
        return None if not self.step_ms else self.kernel_ms / self.step_ms


@dataclass(frozen=True)
class KernelRow:
    name: str
    microseconds: float
    calls: int


def kernel_rows(events, device_type: str) -> list[KernelRow]:
    """The rows of `profile.key_averages()` that are device kernels (`device_type` "cuda") or, on a CPU,
    `aten::` operators, with their own time."""
    if device_type == "cuda":
        return [KernelRow(e.key, e.self_device_time_total, e.count) for e in events if e.device_type == DeviceType.CUDA]
    return [KernelRow(e.key, e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::")]


def summarize(rows: Sequence[KernelRow], model: str, length: int, device_type: str, top: int = 8) -> StepProfile:
    """The `StepProfile` of a step's kernel rows."""
    by_kind = dict.fromkeys(KIND_NAMES, 0.0)
    for row in rows:
        by_kind[kind_of(row.name)] += row.microseconds / 1000
    largest = sorted(rows, key=lambda row: -row.microseconds)[:top]
    return StepProfile(
        model=model,
        length=length,
        device_type=device_type,
        kernel_ms=sum(row.microseconds for row in rows) / 1000,
        launches=sum(row.calls for row in rows),
        ms_by_kind=by_kind,
        top=[(row.name, row.microseconds / 1000, row.calls) for row in largest],
    )


def profile_step(step: Callable[[], object], device: torch.device, model: str, length: int) -> StepProfile:
    """Run `step()` once under the profiler (device synchronised after it) and summarise its kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return summarize(kernel_rows(profiler.key_averages(), device.type), model, length, device.type)


def profile_table(profiles: Sequence[StepProfile]) -> list[str]:
    """Markdown: one row per (length, model) with step time, kernel time, busy, launches and ms by kind;
    then each model's largest kernels."""
    header = ["L", "model", "step ms", "kernel ms", "busy", "launches", *KIND_NAMES]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:", "---", *["---:"] * (len(header) - 2)]) + "|"]
    for p in profiles:
        busy = "-" if p.busy is None else f"{p.busy:.0%}"
        step = "-" if p.step_ms is None else f"{p.step_ms:.1f}"
        cells = [str(p.length), p.model, step, f"{p.kernel_ms:.1f}", busy, f"{p.launches:,}"]
        lines.append("| " + " | ".join(cells + [f"{p.ms_by_kind[kind]:.1f}" for kind in KIND_NAMES]) + " |")
    for p in profiles:
        lines += ["", f"Largest kernels, {p.model}, L={p.length} (ms, launches):", ""]
        lines += [f"- {ms:.2f} ms, {calls:,}x `{_short(name)}`" for name, ms, calls in p.top]
    return lines


def _short(name: str, width: int = 110) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def plot_profiles(profiles: Sequence[StepProfile], path, title: str) -> None:
    """Stacked bars of kernel time by kind, one bar per (model, length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p.model}\nL={p.length}" for p in profiles]
    figure, axis = plt.subplots(figsize=(max(6.0, 1.3 * len(profiles)) + 2.5, 4.5))
    bottom = [0.0] * len(profiles)
    for kind in KIND_NAMES:
        heights = [p.ms_by_kind[kind] for p in profiles]
        axis.bar(labels, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.set_ylabel(
        "kernel time per step (ms)" if profiles and profiles[0].device_type == "cuda" else "operator time (ms)"
    )
    axis.tick_params(axis="x", labelsize=7)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axis.set_title(title, fontsize=8, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

"""Training metrics: one JSON line per record, TensorBoard scalars where installed, a final plot."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import textwrap
from pathlib import Path

import torch

from hf_softmax_rnn.errors import UserInputError

# Defined in `hf_softmax_rnn.utils` (model cards write durations too); imported here only to stay
# importable from this module.
from hf_softmax_rnn.utils import minutes_and_seconds  # noqa: F401

try:
    import resource
except ImportError:  # Windows
    resource = None

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss_curves.png"
PANEL_INCHES = (7.0, 3.5)  # width and height of one stage's panel; the panels lie one under another
TENSORBOARD_DIR = "runs"
#: Evaluation points before any training (stages log under their own names).
BEFORE_CONVERSION = "base"
AFTER_CONVERSION = "converted"


def peak_resident_bytes() -> int | None:
    """The most resident memory this process has held so far, in bytes (None where the system does not tell)."""
    if resource is None:
        return None
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss counts bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far, in GiB: `resident_gib` (what the operating system counted, where it
    tells) and, on CUDA, `cuda_allocated_gib` (the most the allocator held for tensors)."""
    peak = {}
    if (resident := peak_resident_bytes()) is not None:
        peak["resident_gib"] = round(resident / 2**30, 2)
    if device.type == "cuda":
        peak["cuda_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return peak


def memory_words(peak: dict[str, float]) -> str:
    """`peak_memory`'s result in words: "10.92 GiB resident, 3.20 GiB CUDA tensors" ("" when nothing was counted)."""
    words = {"resident_gib": "resident", "cuda_allocated_gib": "CUDA tensors"}
    return ", ".join(f"{peak[key]:.2f} GiB {text}" for key, text in words.items() if key in peak)


class MetricsLogger:
    """Appends records `{"step": global step, "stage": name, ...numbers}` to `metrics.jsonl` and
    mirrors the numbers to TensorBoard (when the `tensorboard` package is installed).

    `resume_from_step` drops records past that step (written by a killed run after its last
    checkpoint), so the log of a resumed run reads like the log of an uninterrupted one.
    """

    def __init__(self, output_dir: str | Path, *, resume_from_step: int | None = None) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is None:
            self.path.write_text("")
        else:
            self._truncate(resume_from_step)
        self._tensorboard = None
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_from_step is None else resume_from_step + 1
            self._tensorboard = SummaryWriter(str(Path(output_dir) / TENSORBOARD_DIR), purge_step=purge)

    def _truncate(self, step: int) -> None:
        records = read_metrics(self.path) if self.path.exists() else []
        kept = "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(kept)
        os.replace(temporary, self.path)

    def log(self, step: int, stage: str, **values: float) -> None:
        record = {"step": step, "stage": stage, **values}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"{stage}/{name}", value, step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a `metrics.jsonl` file. A half-written last line (a run killed while writing
    it) is dropped with a warning; a damaged line before it raises `UserInputError`."""
    lines = [(number, line) for number, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    records = []
    for number, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number != lines[-1][0]:
                message = f"{path}:{number} is not a JSON record ({error}); repair or remove that line"
                raise UserInputError(message) from error
            logger.warning("Dropping the half-written last line %d of %s: %r", number, path, line[:80])
    return records


def plot_loss_curves(
    records: list[dict],
    path: str | Path,
    *,
    title: str = "",
    references: tuple[str, ...] = (BEFORE_CONVERSION, AFTER_CONVERSION),
) -> Path:
    """One panel per stage, one under another: training loss per step, and held-out perplexity on a second axis
    with the perplexities of the `references` points (records without a loss) as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(dict.fromkeys(r["stage"] for r in records if "loss" in r))
    reference_values = {r["stage"]: r["perplexity"] for r in records if r["stage"] in references and "perplexity" in r}
    panels = max(len(stages), 1)
    fig, axes = plt.subplots(panels, 1, figsize=(PANEL_INCHES[0], PANEL_INCHES[1] * panels), squeeze=False)
    for axis, stage in zip(axes[:, 0], stages, strict=False):
        train = [r for r in records if r["stage"] == stage and "loss" in r]
        axis.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue")
        axis.set_xlabel("step")
        axis.set_ylabel("training loss", color="tab:blue")
        axis.set_title(stage)
        evals = [r for r in records if r["stage"] == stage and "perplexity" in r and math.isfinite(r["perplexity"])]
        twin = axis.twinx()
        twin.plot([r["step"] for r in evals], [r["perplexity"] for r in evals], "o-", color="tab:red", label=f"{stage}")
        for (name, value), style in zip(reference_values.items(), ("--", ":"), strict=False):
            twin.axhline(value, color="tab:gray", linestyle=style, label=name)
        twin.set_yscale("log")
        twin.set_ylabel("held-out perplexity (log scale)", color="tab:red")
        twin.legend(loc="best", fontsize="small")
    if title:  # wrapped to the figure's width (about 11 characters per inch at this size)
        fig.suptitle(textwrap.fill(title, width=int(11 * PANEL_INCHES[0])), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)

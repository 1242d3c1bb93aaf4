"""What the benchmark scripts share: the name of the hardware they ran on, and their report files
(`<stem>.md` with the table, `<stem>.json` with every measurement and the settings, `<stem>.png`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def hardware_name(device: torch.device) -> str:
    """The GPU's name, or the number of CPU threads torch uses."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"


def write_bench_report(
    output: Path,
    stem: str,
    title: str,
    body: Sequence[str],
    measurements: Sequence[Any],
    settings: dict[str, Any],
    plot: Callable[[Sequence[Any], Path, str], None],
) -> None:
    """OUTPUT/<stem>.{md,json,png}: the title and `body` lines, the measurements (dataclasses) with the
    settings as strings, and `plot(measurements, path, title)`."""
    output.mkdir(parents=True, exist_ok=True)
    (output / f"{stem}.md").write_text("\n".join([title, "", *body]) + "\n")
    record = {
        "title": title,
        "settings": {key: str(value) for key, value in settings.items()},
        "measurements": [asdict(m) for m in measurements],
    }
    (output / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(measurements, output / f"{stem}.png", title)
    logger.info("Wrote %s/%s.{md,json,png}", output, stem)


def plot_panels(
    path: Path,
    title: str,
    xlabel: str,
    panels: Sequence[tuple[str, dict[str, tuple[list, list]]]],
    log_y: bool = False,
) -> None:
    """One panel per (ylabel, {model: (x values, y values)}), side by side, x on a log2 scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for axis, (ylabel, series) in zip(axes[0], panels):
        for name, (xs, ys) in series.items():
            axis.plot(xs, ys, marker="o", label=name)
        axis.set_xscale("log", base=2)
        if log_y:
            axis.set_yscale("log", base=2)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

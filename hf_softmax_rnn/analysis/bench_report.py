"""What the whole-model benchmark scripts share: the checks of their common flags, the device, the
name of the hardware they ran on, and their report files (`<stem>.md` with the table, `<stem>.json`
with every measurement and the settings, `<stem>.png`)."""

from __future__ import annotations

import argparse
import json
import logging
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.presets import PRESETS

# Defined in `hf_softmax_rnn.utils` (the trainer names its hardware too); imported here only to stay
# importable from this module.
from hf_softmax_rnn.utils import (
    hardware_name,  # noqa: F401
    resolve_device,
)

logger = logging.getLogger(__name__)

#: Width and height of one panel of a benchmark plot, in inches; the panels lie one under another.
PANEL_INCHES = (7.0, 3.5)


def check_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, counts: Sequence[str]) -> None:
    """Stop with one line (exit status 2) on `counts` flags below 1, --layers below 1, an unknown preset
    or a --model folder without a config.json, before anything is loaded."""
    for flag in counts:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} is not allowed; expected an int >= 1")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers={args.layers} is not allowed; expected an int >= 1")
    unknown = [name for name in args.presets if name not in PRESETS]
    if unknown:
        parser.error(f"--presets {' '.join(unknown)}: unknown; expected names from {', '.join(PRESETS)}")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model={str(args.model)!r} is not allowed; expected a folder with a config.json")


def device_or_exit(script: str, name: str) -> torch.device:
    """`name` as a device this machine has, or one line (exit status 2) saying why not."""
    try:
        resolve_device(name)
    except UserInputError as error:  # argparse's one line and exit status, as for the other flags
        argparse.ArgumentParser(prog=script, usage=argparse.SUPPRESS, add_help=False).error(str(error))
    return torch.device(name)


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
    """One panel per (ylabel, {model: (x values, y values)}), one under another, x on a log2 scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(PANEL_INCHES[0], PANEL_INCHES[1] * len(panels)), squeeze=False)
    for axis, (ylabel, series) in zip(axes[:, 0], panels, strict=True):
        for name, (xs, ys) in series.items():
            axis.plot(xs, ys, marker="o", label=name)
        axis.set_xscale("log", base=2)
        if log_y:
            axis.set_yscale("log", base=2)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(textwrap.fill(title, 90), fontsize=9)  # a long title on as many lines as it needs
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

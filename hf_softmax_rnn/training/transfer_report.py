"""Per-layer attention-transfer error before and after the transfer stage: JSON and a plot.

`transfer_layer_mse.json` holds {"before": [...], "after": [...]} (one held-out MSE per
converted layer, teacher-forced); `transfer_layer_mse.png` draws both on a log scale.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

LAYER_MSE_FILE = "transfer_layer_mse.json"
LAYER_MSE_PLOT = "transfer_layer_mse.png"


def record_layer_mse(output_dir: str | Path, point: str, values: list[float]) -> dict[str, list[float]]:
    """Store the per-layer MSE at `point` ("before" or "after") and redraw the plot; returns all points."""
    path = Path(output_dir) / LAYER_MSE_FILE
    points = json.loads(path.read_text()) if path.exists() else {}
    points[point] = values
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(points, indent=1))
    temporary.replace(path)
    logger.info(
        "Held-out transfer MSE %s transfer: mean %.4g over %d layers", point, sum(values) / len(values), len(values)
    )
    _plot(points, Path(output_dir) / LAYER_MSE_PLOT)
    return points


def _plot(points: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    for point, values in points.items():
        axis.plot(
            range(len(values)),
            values,
            marker="o",
            markersize=3,
            label=f"{point} transfer (mean {sum(values) / len(values):.3g})",
        )
    axis.set_yscale("log")
    axis.set_xlabel("converted layer")
    axis.set_ylabel("held-out MSE to softmax")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

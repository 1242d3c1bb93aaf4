"""training.metrics: the loss-curve plot."""

import matplotlib.pyplot as plt
import pytest

from hf_softmax_rnn.training.metrics import plot_loss_curves

RECORDS = [
    {"stage": "base", "step": 0, "perplexity": 12.9},
    {"stage": "converted", "step": 0, "perplexity": 28.5},
    *({"stage": "finetune", "step": step, "loss": 1.0 / step} for step in range(1, 11)),
    {"stage": "finetune", "step": 10, "perplexity": 15.5},
]
LONG_TITLE = (
    "SmolLM2-135M-Instruct: all 30 layers: linear attention with the hedgehog feature map, exact exp over the "
    "last 64 positions, softmax normaliser"
)


@pytest.mark.parametrize("stages", [1, 2], ids=["one_stage", "two_stages"])
def test_a_long_title_stays_inside_the_figure(tmp_path, monkeypatch, stages):
    records = RECORDS + [{**r, "stage": "transfer"} for r in RECORDS[2:]] * (stages - 1)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    path = plot_loss_curves(records, tmp_path / "curves.png", title=LONG_TITLE)
    assert path.stat().st_size > 0
    (figure,) = figures
    (title,) = [text for text in figure.texts if text.get_text() == figure.get_suptitle()]
    assert " ".join(title.get_text().split()) == LONG_TITLE
    box, frame = title.get_window_extent(figure.canvas.get_renderer()), figure.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1


def test_the_stage_panels_lie_one_under_another(tmp_path, monkeypatch):
    records = RECORDS + [{**r, "stage": "transfer"} for r in RECORDS[2:]]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_loss_curves(records, tmp_path / "curves.png")
    (figure,) = figures
    finetune, transfer = (axis.get_position() for axis in figure.axes if axis.get_title())
    assert finetune.y0 > transfer.y1 and finetune.width > 0.6

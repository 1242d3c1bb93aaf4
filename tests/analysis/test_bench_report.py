"""analysis.bench_report: the panel plot of the benchmark scripts."""

import matplotlib.pyplot as plt

from hf_softmax_rnn.analysis.bench_report import plot_panels


def test_the_panels_lie_one_under_another_each_as_wide_as_the_figure(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    series = {"softmax": ([256, 512], [1.0, 2.0]), "hybrid": ([256, 512], [1.5, 1.8])}
    plot_panels(tmp_path / "plot.png", "a title", "tokens", [("seconds", series), ("ratio", series)])
    (figure,) = figures
    upper, lower = (axis.get_position() for axis in figure.axes)
    assert upper.y0 > lower.y1 and upper.width > 0.7
    assert [axis.get_ylabel() for axis in figure.axes] == ["seconds", "ratio"]
    assert (tmp_path / "plot.png").stat().st_size > 10_000

"""Tables and plot of several models' long-context results, and the settings' own checks."""

import pytest

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context.report import LongContextSettings, comparison_tables, plot_long_context


def _result(perplexities, passkey=None, seconds=3.0):
    buckets = [
        {"start": start, "end": end, "tokens": 2 * (end - max(start, 1)), "perplexity": value}
        # Fewer perplexities than buckets: a model measured on the first buckets only.
        for (start, end), value in zip(((0, 64), (64, 256)), perplexities, strict=False)
    ]
    positions = {"buckets": buckets, "tokens": 512, "seconds": seconds}
    if passkey is None:
        return {"positions": positions, "passkey": None}
    record = {"accuracy": passkey, "correct": int(passkey * 4), "trials": 4, "tokens": 4064, "seconds": 9}
    depths = {"0.1": 0.0, "0.5": passkey, "0.9": 1.0}
    lengths = {"1024": {**record, "depths": depths}, "2048": {**record, "depths": {**depths, "0.1": passkey}}}
    return {"positions": positions, "passkey": {"lengths": lengths}}


def test_table_gives_each_model_beside_the_reference():
    results = {"original": _result([10.0, 8.0], 1.0), "trained": _result([15.0, 12.0], 0.25)}
    text = comparison_tables(results, "original")
    assert "0-64: 126, 64-256: 384; in brackets the ratio to original" in text
    assert "| original | 10.00 | 8.00 | 512 | 3 s |" in text
    assert "| trained | 15.00 (1.50x) | 12.00 (1.50x) | 512 | 3 s |" in text
    assert "| trained | 25% (1/4; 4k tok, 9 s) | 25% (1/4; 4k tok, 9 s) |" in text


@pytest.mark.parametrize("limit", [100, 256, None], ids=["past-the-limit", "at-the-limit", "no-limit"])
def test_buckets_past_max_position_embeddings_are_marked_in_the_table_and_the_plot(limit, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    results = {"original": _result([10.0, 8.0]), "trained": _result([15.0, 12.0])}
    for result in results.values():
        result["positions"]["max_positions"] = limit
    text = comparison_tables(results, "original")
    plot_long_context(results, "original", tmp_path / "plot.png")
    marked = [line for axis in figures[0].axes for line in axis.lines if "max_position_embeddings" in line.get_label()]
    if limit == 100:
        assert "| model | 0-64 | 64-256 * | tokens | time |" in text
        assert "; * past max_position_embeddings, 100)." in text
        assert [list(line.get_xdata()) for line in marked] == [[0.5, 0.5]] * 2
    else:
        assert "*" not in text and marked == []


def test_table_without_passkey_has_no_passkey_section():
    assert "Passkey" not in comparison_tables({"original": _result([10.0, 8.0])}, "original")


@pytest.mark.parametrize("names", [("original",), ("original", "trained")], ids=["one-model", "two-models"])
def test_plot_is_written(tmp_path, names):
    results = {name: _result([10.0 + i, 8.0 + i]) for i, name in enumerate(names)}
    plot_long_context(results, "original", tmp_path / "plot.png", title="t")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_each_model_keeps_its_colour_in_both_panels(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    results = {name: _result([10.0 + i, 8.0 + i]) for i, name in enumerate(("original", "a", "b"))}
    plot_long_context(results, "original", tmp_path / "plot.png")
    curves, ratios = figures[0].axes
    colours = {line.get_label(): line.get_color() for line in curves.get_lines()}
    for line in ratios.get_lines():
        if line.get_label() in ("a", "b"):
            assert line.get_color() == colours[line.get_label()]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequences": 0}, "sequences=0 is not allowed"),
        ({"trials": -1}, "trials=-1 is not allowed"),
        ({"buckets": ((0, 64), (0, 128))}, r"bucket \(0, 128\) starts before"),
        ({"passkey_lengths": (-5,)}, "passkey length=-5 is not allowed"),
        ({"depths": (2.0,)}, r"passkey depth=2.0 is not allowed; expected a number in \[0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is not allowed"),
        ({"seed": "a"}, "seed='a' is not allowed"),
        ({"seed": -1}, "seed=-1 is not allowed"),
        ({"join": "no"}, "join='no' is not allowed; expected True or False"),
        ({"past_max_positions": "false"}, "past_max_positions='false' is not allowed"),
    ],
    ids=[
        "sequences",
        "trials",
        "overlap",
        "negative-length",
        "depth",
        "max-new-tokens",
        "str-seed",
        "negative-seed",
        "str-join",
        "str-past-max-positions",
    ],
)
def test_settings_refuse_bad_values_when_built(kwargs, message):
    with pytest.raises(UserInputError, match=message):
        LongContextSettings(**kwargs)


def test_settings_refuse_passkey_lengths_that_are_not_a_list():
    with pytest.raises(TypeError, match="lengths='1024' is not allowed; expected a list"):
        LongContextSettings(passkey_lengths="1024")


def test_a_model_measured_on_fewer_buckets_is_drawn_at_the_ones_it_has(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    short = _result([15.0])  # measured on 0-64 only
    plot_long_context({"original": _result([10.0, 8.0]), "short": short}, "original", tmp_path / "plot.png")
    curves, ratios = figures[0].axes
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ratios.lines}
    assert drawn["short"] == ([0], [1.5])
    assert {line.get_label(): list(line.get_xdata()) for line in curves.lines} == {"original": [0, 1], "short": [0]}


def test_passkey_panel_draws_accuracy_by_depth_per_model_and_length_in_the_model_colour(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    results = {"original": _result([10.0, 8.0], 1.0), "trained": _result([15.0, 12.0], 0.25)}
    plot_long_context(results, "original", tmp_path / "plot.png")
    curves, _, passkey = figures[0].axes
    colours = {line.get_label(): line.get_color() for line in curves.get_lines()}
    drawn = {line.get_label(): line for line in passkey.get_lines()}
    assert sorted(drawn) == [
        "original, 1,024 tokens",
        "original, 2,048 tokens",
        "trained, 1,024 tokens",
        "trained, 2,048 tokens",
    ]
    assert list(drawn["trained, 2,048 tokens"].get_xdata()) == [10.0, 50.0, 90.0]
    assert list(drawn["trained, 2,048 tokens"].get_ydata()) == [25.0, 25.0, 100.0]
    assert list(drawn["trained, 1,024 tokens"].get_ydata()) == [0.0, 25.0, 100.0]
    assert drawn["trained, 1,024 tokens"].get_color() == colours["trained"]
    assert drawn["trained, 1,024 tokens"].get_linestyle() != drawn["trained, 2,048 tokens"].get_linestyle()


def test_no_passkey_panel_without_passkey_results(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_long_context(
        {"original": _result([10.0, 8.0]), "trained": _result([15.0, 12.0])}, "original", tmp_path / "p.png"
    )
    assert len(figures[0].axes) == 2


def _with_fidelity(result, agreements, kls=(0.5, 0.25), seconds=4.0):
    buckets = [
        {"start": b["start"], "end": b["end"], "tokens": b["tokens"], "kl": kl, "kl_stderr": 0.01, "top1_agreement": a}
        for b, a, kl in zip(result["positions"]["buckets"], agreements, kls, strict=True)
    ]
    return {**result, "fidelity": {"buckets": buckets, "tokens": 512, "seconds": seconds}}


def test_agreement_table_gives_each_compared_model_by_bucket():
    results = {"original": _result([10.0, 8.0]), "trained": _with_fidelity(_result([15.0, 12.0]), [0.875, 0.5])}
    text = comparison_tables(results, "original")
    assert "Agreement with original by position" in text
    assert "| trained | 87.5% (0.500) | 50.0% (0.250) | 4 s |" in text
    assert "Agreement" not in comparison_tables({"original": _result([10.0, 8.0])}, "original")


def test_agreement_panel_draws_each_model_in_its_colour(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    results = {
        "original": _result([10.0, 8.0], 1.0),
        "trained": _with_fidelity(_result([15.0, 12.0], 0.25), [0.875, 0.5]),
    }
    plot_long_context(results, "original", tmp_path / "plot.png")
    curves, _, agreement, _ = figures[0].axes
    colours = {line.get_label(): line.get_color() for line in curves.get_lines()}
    (drawn,) = agreement.get_lines()
    assert (drawn.get_label(), list(drawn.get_xdata()), list(drawn.get_ydata())) == ("trained", [0, 1], [87.5, 50.0])
    assert drawn.get_color() == colours["trained"]
    assert agreement.get_ylabel() == "top-1 agreement with original (%)"


def test_the_panels_lie_one_under_another_each_as_wide_as_the_figure(tmp_path, monkeypatch):
    """A page fits a figure to its width: side by side, three panels would each get a third of it."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    results = {"original": _result([10.0, 8.0], 1.0), "trained": _result([15.0, 12.0], 0.25)}
    plot_long_context(results, "original", tmp_path / "plot.png")
    curves, ratios, passkey = (axis.get_position() for axis in figures[0].axes)
    assert curves.y0 > ratios.y1 and ratios.y0 > passkey.y1
    assert min(curves.width, ratios.width, passkey.width) > 0.7

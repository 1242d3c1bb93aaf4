"""scripts/bench_distill_loss.py in its quick form: both forms timed on small logits, the bytes each keeps
for the backward measured; bad settings refused."""

import pytest

from .helpers import load_script


def test_times_both_forms_and_measures_what_each_keeps(monkeypatch, capsys):
    rows = load_script("bench_distill_loss", monkeypatch).main(
        ["--positions", "8", "16", "--vocab", "300", "--rounds", "2"]
    )
    cells = {(row["positions"], row["form"]): row for row in rows}
    assert set(cells) == {(n, form) for n in (8, 16) for form in ("reference", "sliced")}
    assert all(row["ms"] > 0 and row["cuda_peak_mib"] is None for row in rows)
    for positions in (8, 16):
        assert cells[positions, "sliced"]["kept_mib"] == 0
        # the reference keeps at least both float32 log-probability tensors
        assert cells[positions, "reference"]["kept_mib"] >= 2 * positions * 300 * 4 / 2**20
    assert "| 16 | sliced |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--positions", "0"], "--positions=[0] is not allowed"),
        (["--vocab", "-3"], "--vocab=-3 is not allowed"),
        (["--dtype", "float16"], "invalid choice: 'float16'"),
        (["--device", "tpu"], "tpu"),
    ],
    ids=["no-positions", "negative-vocab", "unknown-dtype", "unknown-device"],
)
def test_bad_settings_are_refused_in_one_line(monkeypatch, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        load_script("bench_distill_loss", monkeypatch).main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

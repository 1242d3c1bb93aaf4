"""scripts/bench_ops.py in its quick form on CPU: two presets, one short length, batch 2."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ops.py"


def _run(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    spec = importlib.util.spec_from_file_location("bench_ops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_ops", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    module.main()


def test_rows_of_the_chosen_presets_at_the_chosen_batch(tmp_path, monkeypatch, capsys):
    output = tmp_path / "ops"
    _run(monkeypatch, "--lengths", "64", "--repeats", "1", "--batch", "2", "--presets", "softmax", "linear_elu",
         "--output", str(output))  # fmt: skip
    table = output.with_suffix(".md").read_text()
    assert table == capsys.readouterr().out
    assert table.startswith("B=2, H=9, Hkv=3, D=64, float32")
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines() if line.startswith("| ")]
    expected = ["softmax (SDPA)", "linear elu, parallel", "linear elu, chunked", "linear elu, recurrent"]
    assert [row for row in rows if row != "variant"] == expected * 2  # the time table, then the memory table
    assert "error" not in table
    assert "- fwd+bwd at L=64: linear elu, chunked runs at" in table
    assert output.with_suffix(".png").stat().st_size > 0


def test_rows_of_the_finetune_default_and_its_retrieval_layers(tmp_path, monkeypatch, capsys):
    """Past the 256-position window, so that keys are kept; the three rows run without an error."""
    output = tmp_path / "ops"
    _run(monkeypatch, "--lengths", "320", "--repeats", "1", "--presets", "hedgehog_window_256_sinks_4_kept_256_decay",
         "--output", str(output))  # fmt: skip
    rows = [line.split(" | ")[0].lstrip("| ") for line in output.with_suffix(".md").read_text().splitlines()]
    expected = [
        "finetune default (256 kept), chunked",
        "finetune default, retrieval layer (2,048 kept), chunked",
        "finetune default, retrieval layer (2,048 kept), no state (training)",
    ]
    assert [row for row in rows if row in expected] == expected * 2
    assert "error" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "0"], "--batch=0"),
        (["--presets", "nope"], "nope"),
        (["--device", "cuda"], "--device='cuda' is not available on this machine"),
        (["--device", "tpu9"], "--device='tpu9' is not allowed"),
    ],
    ids=["batch_0", "unknown_preset", "cuda_without_gpu", "unknown_device"],
)
def test_bad_arguments_are_refused(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:  # a refusal that failed would write here, not into docs/
        _run(monkeypatch, *argv, "--output", str(tmp_path / "ops"))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

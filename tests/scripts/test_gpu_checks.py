"""scripts/gpu_checks.sh without a GPU: its settings are checked before anything runs, the
autotuning winners of one run are handed to the next (the stage run here fails at once on CPU),
and every stage's command is one its script accepts."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from .helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.sh"
ROOT = SCRIPT.parents[1]


def _run(results: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    return subprocess.run(
        ["bash", str(SCRIPT), str(results), "60"], cwd=ROOT, env=environment, capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"STAGES": "bench_ops_bf16 nope"},
            "unknown stage 'nope' in STAGES; stages: bench_train bench_ops_window flex_window_tests",
        ),
        ({"AUTOTUNE_CACHE": "missing.tgz"}, "AUTOTUNE_CACHE 'missing.tgz' is not a file"),
    ],
    ids=["unknown_stage", "missing_autotune_cache"],
)
def test_bad_settings_stop_before_anything_runs(tmp_path, env, message):
    run = _run(tmp_path / "results", **env)
    assert run.returncode == 2
    assert message in run.stderr
    assert not (tmp_path / "results").exists()


def test_autotuning_winners_travel_from_one_run_to_the_next(tmp_path):
    first_cache = tmp_path / "triton_first"
    (first_cache / "f00d").mkdir(parents=True)
    (first_cache / "f00d" / "_kernel.autotune.json").write_text('{"configs_timings": []}')
    (first_cache / "f00d" / "_kernel.cubin").write_bytes(b"\0" * 64)
    first = _run(tmp_path / "first", STAGES="decode_graph_bf16", TRITON_CACHE_DIR=str(first_cache))
    assert "=== decode_graph_bf16" in first.stdout and "=== end" in first.stdout
    assert "decode_graph_fp32" not in first.stdout  # only the chosen stage ran
    archive = tmp_path / "first" / "autotune_cache.tgz"
    with tarfile.open(archive) as saved:
        assert [name for name in saved.getnames() if not saved.getmember(name).isdir()] == [
            "./f00d/_kernel.autotune.json"
        ]
    second_cache = tmp_path / "triton_second"
    _run(tmp_path / "second", STAGES="decode_graph_bf16", TRITON_CACHE_DIR=str(second_cache),
         AUTOTUNE_CACHE=str(archive))  # fmt: skip
    assert (second_cache / "f00d" / "_kernel.autotune.json").read_text() == '{"configs_timings": []}'


def test_every_stage_s_command_is_one_its_script_accepts(tmp_path, monkeypatch):
    """Each stage's command line, recorded by a stand-in `python`, parses with its script's own
    parser as on a GPU machine, and each pytest stage names test files that exist: a wrong flag
    would otherwise surface only on the device."""
    bin_dir, record = tmp_path / "bin", tmp_path / "commands.jsonl"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(record)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    (bin_dir / "python").chmod(0o755)
    run = _run(tmp_path / "results", PATH=f"{bin_dir}:{os.environ['PATH']}", TRITON_CACHE_DIR=str(tmp_path / "t"))
    assert run.returncode == 0, run.stderr
    commands = [json.loads(line) for line in record.read_text().splitlines()]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    scripts, test_files = [], []
    for argv in commands:
        if argv[:2] == ["-m", "pytest"]:
            test_files += [word for word in argv if word.endswith(".py")]
            continue
        script = Path(argv[0])
        scripts.append(script.stem)
        load_script(script.stem, monkeypatch).parse_args(argv[1:])
    assert sorted(set(scripts)) == ["bench_generate", "bench_ops", "bench_recovery", "bench_serve", "bench_train"]
    assert len(commands) == 20  # one per stage, three for decode_default (eager, graphed, batched)
    assert test_files and all((ROOT / name).is_file() for name in test_files), test_files

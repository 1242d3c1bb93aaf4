"""`hf-softmax-rnn ablate`: its flags, the budget they set, and bad input refused in one line."""

import argparse
import csv
import re

import pytest

from hf_softmax_rnn.analysis.ablate import QUICK_BUDGET
from hf_softmax_rnn.cli import main
from hf_softmax_rnn.commands import ablate

QUICK_VARIANTS = ["softmax", "l2", "exp_no_norm_no_clamp", "linear_elu", "taylor_2_l2"]


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    assert (
        main(["ablate", "--quick", "--no-progress", "--output-dir", str(tmp_path), "--variants", *QUICK_VARIANTS]) == 0
    )
    table = (tmp_path / "ablation.md").read_text().splitlines()
    assert [row.split(" | ")[1] for row in table[2:]] == QUICK_VARIANTS
    with (tmp_path / "ablation.csv").open() as handle:
        runs = list(csv.DictReader(handle))
    assert [r["variant"] for r in runs] == QUICK_VARIANTS
    for run in runs:  # an untrained byte model sits near log(257) nats; a diverged run is marked, never a crash
        assert run["diverged_at"] != "" or 3.0 < float(run["final_loss"]) < 7.0
    with (tmp_path / "curves.csv").open() as handle:
        steps = {(r["variant"], int(r["step"])) for r in csv.DictReader(handle)}
    assert {step for _, step in steps} == {2, 4}
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert "ablation.md" in capsys.readouterr().out


def test_size_flags_override_the_quick_budget():
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    budget = ablate.budget_from_args(parser.parse_args(["--quick", "--steps", "7", "--seeds", "3", "4"]))
    assert (budget.steps, budget.seeds, budget.d_model) == (7, (3, 4), QUICK_BUDGET.d_model)


BAD_ARGUMENTS = {
    "zero-steps": (["--steps", "0"], r"--steps=0 is not allowed; expected an int >= 1"),
    "zero-eval-blocks": (["--eval-blocks", "0"], r"--eval-blocks=0 is not allowed; expected an int >= 1"),
    "zero-test-blocks": (["--test-blocks", "0"], r"--test-blocks=0 is not allowed; expected an int >= 1"),
    "zero-eval-every": (["--eval-every", "0"], r"--eval-every=0 is not allowed; expected an int >= 1"),
    "short-sequences": (["--seq-len", "1"], r"--seq-len=1 is not allowed; expected an int >= 2"),
    "indivisible-width": (["--d-model", "30", "--num-heads", "4"], r"--d-model=30 is not divisible by --num-heads=4"),
    "negative-weight-decay": (["--weight-decay", "-1"], r"--weight-decay=-1\.0 is not allowed; expected a number >= 0"),
    "zero-threads": (["--threads", "0"], r"--threads=0 is not allowed; expected an int >= 1"),
    "unknown-device": (["--device", "tpu9"], r"--device='tpu9' is not allowed"),
    "repeated-seed": (
        ["--variants", "softmax", "--seeds", "0", "1", "0"],
        r"--seeds 0 1 0 repeats seed 0; expected distinct seeds \(each seed is one independent run\)",
    ),
    "negative-seed": (
        ["--variants", "softmax", "--seeds", "0", "-1"],
        r"--seeds 0 -1 has seed -1, which is not allowed; expected ints from 0 to 2\*\*32 - 1",
    ),
    "seed-past-2**32": (
        ["--variants", "softmax", "--seeds", str(2**32)],
        r"--seeds 4294967296 has seed 4294967296, which is not allowed; expected ints from 0 to 2\*\*32 - 1",
    ),
    "repeated-variant": (
        ["--variants", "softmax", "l2", "softmax"],
        r"--variants names 'softmax' more than once \(its runs would be trained and reported again\)",
    ),
    "more-test-blocks-than-held-out": (
        ["--variants", "softmax", "--test-blocks", str(10**12)],
        r"--test-blocks=1000000000000 is more than the \d+ held-out blocks of 32 bytes; expected at most \d+",
    ),
    "more-eval-blocks-than-held-out": (
        ["--variants", "softmax", "--eval-blocks", str(10**12)],
        r"--eval-blocks=1000000000000 is more than the \d+ held-out blocks of 32 bytes",
    ),
}


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_cli_rejects_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    assert main(["ablate", "--quick", *argv, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    # the last line: a run that read the corpus has written its progress bars first
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"hf-softmax-rnn ablate: error: " + message, error), error
    assert not (tmp_path / "out").exists()


def test_cli_names_an_unreadable_dataset(tmp_path, capsys):
    (tmp_path / "data.txt").write_bytes(b"")
    argv = ["ablate", "--quick", "--dataset", str(tmp_path / "data.txt"), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    assert re.search(r"hf-softmax-rnn ablate: error: Dataset file '.*data\.txt' is empty", capsys.readouterr().err)


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    assert [action.dest for action in parser._actions if not action.help] == []

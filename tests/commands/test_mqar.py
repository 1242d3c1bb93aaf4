"""`hf-softmax-rnn mqar`: the table, CSV and plots it writes, and bad input refused in one line."""

import argparse
import csv
import re

import pytest

from hf_softmax_rnn.cli import main
from hf_softmax_rnn.commands.mqar import add_arguments


def test_cli_writes_table_csv_and_plots(tmp_path):
    argv = [
        "mqar",
        "--attention",
        "softmax",
        "linear_elu",
        "--num-kv-pairs",
        "2",
        "4",
        "--seq-len",
        "16",
        "--vocab-size",
        "32",
        "--d-model",
        "16",
        "--steps",
        "2",
        "--num-train",
        "64",
        "--num-test",
        "16",
        "--batch-size",
        "8",
        "--warmup-steps",
        "1",
        "--no-progress",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    with (tmp_path / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["attention"], r["num_kv_pairs"]) for r in rows] == [
        ("softmax", "2"),
        ("linear_elu", "2"),
        ("softmax", "4"),
        ("linear_elu", "4"),
    ]
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 and r["steps"] == "2" for r in rows)
    assert len((tmp_path / "results.md").read_text().splitlines()) == 2 + 4
    for name in ("accuracy_vs_kv_pairs.png", "accuracy_vs_state_size.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_cli_rejects_unknown_attention(tmp_path, capsys):
    assert main(["mqar", "--attention", "softmaxx", "--output-dir", str(tmp_path)]) == 2
    assert "hf-softmax-rnn mqar: error: Unknown attention preset 'softmaxx'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


#: A run of a second or two, so that a check missing from it shows as a run, not a long wait.
TINY = [*"--attention linear_elu --d-model 16 --num-kv-pairs 2 --seq-len 16 --vocab-size 32".split()]
TINY += [*"--steps 1 --batch-size 4 --num-train 16 --num-test 8".split()]
BAD_ARGUMENTS = {
    "zero-steps": (["--steps", "0"], r"--steps=0 is not allowed; expected an int >= 1"),
    "zero-eval-every": (["--eval-every", "0"], r"--eval-every=0 is not allowed; expected an int >= 1"),
    "zero-num-test": (["--num-test", "0"], r"--num-test=0 is not allowed; expected an int >= 1"),
    "zero-heads": (["--num-heads", "0"], r"--num-heads=0 is not allowed; expected an int >= 1"),
    "indivisible-width": (["--d-model", "30", "--num-heads", "4"], r"--d-model=30 is not divisible by --num-heads=4"),
    "too-many-pairs": (["--num-kv-pairs", "40"], r"MQARConfig.seq_len=64 is too short for num_kv_pairs=40"),
    "zero-lr": (["--lr", "0"], r"--lr=0\.0 is not allowed; expected a number > 0"),
    "zero-threads": (["--threads", "0"], r"--threads=0 is not allowed; expected an int >= 1"),
    "unknown-device": (["--device", "tpu9"], r"--device='tpu9' is not allowed"),
    "repeated-width": ([*TINY, "--d-model", "16", "32", "16"], r"--d-model names 16 more than once"),
    "repeated-attention": (
        [*TINY, "--attention", "linear_elu", "linear_elu"],
        r"--attention names 'linear_elu' more than once",
    ),
    "repeated-pairs": ([*TINY, "--num-kv-pairs", "2", "2"], r"--num-kv-pairs names 2 more than once"),
    "negative-seed": ([*TINY, "--seed", "-1"], r"--seed=-1 is not allowed; expected an int from 0 to 2\*\*32 - 1"),
    "seed-past-2**32": (
        [*TINY, "--seed", str(2**32)],
        r"--seed=4294967296 is not allowed; expected an int from 0 to 2\*\*32 - 1",
    ),
    "train-beyond-memory": (
        [*TINY, "--num-train", str(10**15)],
        r"--num-train=1,000,000,000,000,000 sequences of seq_len=16 tokens are generated at once, at least "
        r"256,000,000,000,000,000 bytes, more than the machine's [\d,]+; expected --num-train <= [\d,]+ at this",
    ),
    "sequence-beyond-memory": (
        [*TINY, "--seq-len", str(10**13)],
        r"--num-train=16 sequences of seq_len=10,000,000,000,000 tokens .*; expected seq_len <= [\d,]+ ",
    ),
}


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_cli_rejects_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    assert main(["mqar", *argv, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert re.match(r"hf-softmax-rnn mqar: error: " + message, error), error
    assert error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert [action.dest for action in parser._actions if not action.help] == []

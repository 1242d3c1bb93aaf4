"""`hf-softmax-rnn taylor-terms`: bad input refused in one line before the model loads."""

import re

import pytest

from hf_softmax_rnn.cli import main

BAD_ARGUMENTS = {
    "zero-blocks": (["--num-blocks", "0"], r"--num-blocks=0 is not allowed; expected an int >= 1"),
    "zero-batch": (["--batch-size", "0"], r"--batch-size=0 is not allowed; expected an int >= 1"),
    "short-blocks": (["--block-size", "1"], r"--block-size=1 is not allowed; expected an int >= 2"),
    "zero-order": (["--max-order", "0"], r"--max-order=0 is not allowed; expected an int >= 1"),
    "negative-truncation-order": (
        ["--truncation-orders", "2", "-1"],
        r"--truncation-orders=\[2, -1\] is not allowed; expected ints from 0 to 1024",
    ),
    "huge-order": (["--max-order", "100000"], r"--max-order=100000 is not allowed; expected an int from 1 to 1024"),
    "huge-truncation-order": (
        ["--truncation-orders", "2000"],
        r"--truncation-orders=\[2000\] is not allowed; expected ints from 0 to 1024",
    ),
    "unknown-device": (["--device", "tpu9"], r"--device='tpu9' is not allowed"),
    "truncation-order-twice": (
        ["--truncation-orders", "2", "4", "2"],
        r"--truncation-orders names 2 more than once \(its perplexity would be measured again\)",
    ),
}


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_cli_rejects_bad_arguments_before_loading_the_model(tmp_path, capsys, argv, message):
    arguments = ["taylor-terms", str(tmp_path / "no_model"), *argv, "--output-dir", str(tmp_path / "out")]
    assert main(arguments) == 2
    assert re.match(r"hf-softmax-rnn taylor-terms: error: " + message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_cli_names_an_unreadable_dataset(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_bytes(b'{"text": "a"\n')
    arguments = ["taylor-terms", "default", "--dataset", str(tmp_path / "data.jsonl"), "--output-dir", str(tmp_path)]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert re.search(r"hf-softmax-rnn taylor-terms: error: Dataset '.*data\.jsonl' could not be read", error)

"""`hf-softmax-rnn finetune` refuses contradicting or malformed flags in one line (exit status 2)
before any work: nothing is loaded, nothing is written."""

import re

import pytest

from hf_softmax_rnn import cli

CONTRADICTIONS = {
    "lora-rank-with-full": (
        ["--finetune-method", "full", "--lora-rank", "4"],
        r"--lora-rank 4 contradicts --finetune-method full",
    ),
    "lora-alpha-with-full": (
        ["--finetune-method", "full", "--lora-alpha", "16"],
        r"--lora-alpha 16\.0 contradicts --finetune-method full",
    ),
    "lora-targets-with-full": (
        ["--finetune-method", "full", "--lora-targets", "q_proj", "v_proj"],
        r"--lora-targets \['q_proj', 'v_proj'\] contradicts --finetune-method full",
    ),
    "hub-private-without-push": (["--hub-private"], r"--hub-private without --push-to-hub"),
    "text-column-for-pydoc": (
        ["--dataset", "pydoc", "--text-column", "body"],
        r"--text-column 'body' does not apply to --dataset 'pydoc'",
    ),
    "bad-repo-id": (
        ["--push-to-hub", "not a repo name!!"],
        r"--push-to-hub 'not a repo name!!' is not a Hub repo id",
    ),
}


@pytest.mark.parametrize("flags,message", CONTRADICTIONS.values(), ids=CONTRADICTIONS.keys())
def test_contradicting_flags_stop_before_any_work(tmp_path, capsys, caplog, flags, message):
    out = tmp_path / "out"
    with caplog.at_level("INFO"):
        code = cli.main(["finetune", "--output-dir", str(out), "--model", str(tmp_path / "no-model"), *flags])
    error = capsys.readouterr().err
    assert code == 2, error
    assert re.fullmatch(rf"hf-softmax-rnn finetune: error: .*{message}.*\n", error), error
    assert "Loading" not in caplog.text and not out.exists()


def test_help_shows_the_lora_defaults(capsys):
    with pytest.raises(SystemExit, match="^0$"):  # (--help exits with success)
        cli.main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "LoRA rank r (default: 8)" in text
    assert "LoRA alpha (scale alpha / r) (default: 16.0)" in text
    assert "dropout on the LoRA input (default: 0.0)" in text

"""Every command that reads `--dataset` through `load_corpus` refuses a text column holding nulls in one
line (exit status 2) naming the file, the column and the first bad row, before writing anything."""

import re

import pytest

from hf_softmax_rnn import cli

from ..training.helpers import save_tiny_model, word_tokenizer

#: (command, its flags besides --dataset, its output flag)
COMMANDS = {
    "finetune": (["--model", "{llama}", "--block-size", "16", "--no-progress"], "--output-dir"),
    "demo": (
        ["--model", "{llama}", "--presets", "softmax", "--contexts", "8", "--new-tokens", "2", "--eval-window", "32"],
        "--output",
    ),
    "taylor-terms": (["{llama}", "--block-size", "16", "--num-blocks", "1", "--no-progress"], "--output-dir"),
    "ablate": (["--quick", "--variants", "softmax", "--no-progress"], "--output-dir"),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return {"llama": save_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama"), word_tokenizer())}


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS)
def test_a_null_text_is_refused_in_one_line(command, tiny_models, tmp_path, capsys):
    data = tmp_path / "mixed.jsonl"
    data.write_text('{"text": "hello world"}\n{"text": null}\n' + '{"text": "hello world again"}\n' * 20)
    flags, output_flag = COMMANDS[command]
    flags = [flag.format(llama=tiny_models["llama"]) for flag in flags]
    out = tmp_path / "out"
    assert cli.main([command, *flags, "--dataset", str(data), output_flag, str(out)]) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert re.search(
        rf"^hf-softmax-rnn {command}: error: Dataset '{re.escape(str(data))}': column 'text' holds a null \(None\) "
        r"instead of text at row 1 of its train split .*$",
        error,
        re.MULTILINE,
    ), error
    assert not out.exists()

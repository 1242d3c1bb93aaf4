"""`hf-softmax-rnn needles`: the tables of a saved model beside its original, the file it writes (the answers
of the library function, model by model), and bad input as one line with status 2."""

import json

import pytest
from transformers import AutoModelForCausalLM

from hf_softmax_rnn import cli
from hf_softmax_rnn.long_context import finite_state_off
from hf_softmax_rnn.long_context.needles import needle_retrieval

from ..long_context.helpers import tiny_converted, tiny_llama, tokenizer

SETTINGS = ["--templates", "bare", "--fillers", "noise", "--lengths", "400", "--prompts", "1", "--no-progress"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"original": folder, "converted": folder with a finetune-style results.json naming the original}."""
    root = tmp_path_factory.mktemp("needles")
    tok = tokenizer()
    for name, model in (("original", tiny_llama()), ("converted", tiny_converted("hedgehog_window_64"))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "converted" / "results.json").write_text(json.dumps({"config": {"model": "../original"}}))
    return {name: str(root / name) for name in ("original", "converted")}


@pytest.mark.parametrize("finite_state", [True, False], ids=["with-state", "state-off"])
def test_tables_of_a_model_beside_its_original(saved, tmp_path, capsys, finite_state):
    argv = ["needles", "--model", saved["converted"], *SETTINGS, "--output", str(tmp_path)]
    assert cli.main(argv if finite_state else [*argv, "--no-finite-state"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "needles.json").read_text())
    labels = [f"original ({saved['converted']}/../original)", f"model ({saved['converted']})"]
    assert list(record) == labels
    tok = tokenizer()
    for label, folder in zip(labels, ("original", "converted"), strict=True):
        model = AutoModelForCausalLM.from_pretrained(saved[folder]).eval()
        settings = dict(templates=["bare"], fillers=["noise"], lengths=[400], prompts=1, progress=False)
        if folder == "converted" and not finite_state:
            with finite_state_off(model):
                expected = needle_retrieval(model, tok, **settings)
        else:
            expected = needle_retrieval(model, tok, **settings)
        assert record[label]["answers"] == expected["answers"]
    header = f"| variant | length | {labels[0]} | {labels[1]} |"
    assert header in out and "| multi_query | 400 |" in out and "| bare | 400 |" in out and "| noise | 400 |" in out
    assert ("finite state switched off" in out) != finite_state


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "needle"], "argument --variants: invalid choice: 'needle'"),
        (["--lengths", "100000"], "needle prompt length=100000"),
        (["--prompts", "0"], "prompts=0"),
        (["--model", "no/such/folder/here"], "no/such/folder/here"),
        (["--prompts", str(10**15)], "prompts=1,000,000,000,000,000 is not allowed: the 6 cells' prompts are all"),
        (["--texts", "books/"], "--texts 'books/' sets the texts of the 'shakespeare' filler, which --fillers noise"),
    ],
    ids=["variant", "length", "prompts", "model", "prompts-beyond-memory", "texts-without-their-filler"],
)
def test_bad_input_is_one_line_with_status_2(saved, tmp_path, capsys, monkeypatch, argv, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("hf_softmax_rnn.commands.needles.resolve_model", no_loading)
    base = ["needles", "--model", saved["converted"], *SETTINGS, "--output", str(tmp_path / "out")]
    if argv[0] == "--variants":  # refused by the flag's choices
        with pytest.raises(SystemExit) as exit_status:
            cli.main([*base, *argv])
        assert exit_status.value.code == 2
    else:
        assert cli.main([*base, *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

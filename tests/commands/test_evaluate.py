"""`hf-softmax-rnn evaluate`: the tables of a saved model beside its original (the model named in a
finetune folder's results.json), the files it writes, and bad input as one line with status 2."""

import json
import re
import shutil

import pytest
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_softmax_rnn import cli
from hf_softmax_rnn.commands.evaluate import original_of
from hf_softmax_rnn.long_context import extend_context, finite_state_off, passkey_retrieval, position_perplexity
from hf_softmax_rnn.long_context.fidelity import position_fidelity

from ..long_context.helpers import LLAMA_KWARGS, TEXTS, tiny_converted, tiny_llama, tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"original": folder, "converted": folder (with a finetune-style results.json naming the original),
    "texts": folder of .txt documents, "short": a folder of one short .txt, "blank" and "binary": .txt files
    with nothing to read}."""
    root = tmp_path_factory.mktemp("evaluate")
    tok = tokenizer()
    for name, model in (("original", tiny_llama()), ("converted", tiny_converted("hedgehog_window_64"))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "converted" / "results.json").write_text(json.dumps({"config": {"model": "../original"}}))
    (root / "texts").mkdir()
    for index, text in enumerate(TEXTS * 2):
        (root / "texts" / f"{index:02}.txt").write_text(text * 3)
    (root / "short").mkdir()
    (root / "short" / "note.txt").write_text("Too short to fill the buckets.")
    (root / "blank.txt").write_text("  \n\n")
    (root / "binary.txt").write_bytes(bytes(range(128, 256)) * 4)
    return {name: str(root / name) for name in ("original", "converted", "texts", "short")} | {
        name: str(root / f"{name}.txt") for name in ("blank", "binary")
    }


def test_tables_of_a_model_beside_its_original(saved, tmp_path, capsys):
    argv = ["evaluate", "--model", saved["converted"], "--texts", saved["texts"], "--positions", "0", "16", "128"]
    argv += ["--sequences", "3", "--passkey", "300", "--depths", "0.5", "--trials", "2", "--output", str(tmp_path)]
    assert cli.main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["models"] == {"original": f"{saved['converted']}/../original", "model": saved["converted"]}
    texts = [open(f"{saved['texts']}/{i:02}.txt").read().strip() for i in range(3)]
    tok = tokenizer()
    for label in ("original", "model"):
        model = AutoModelForCausalLM.from_pretrained(saved["converted" if label == "model" else "original"]).eval()
        expected = position_perplexity(model, tok, texts, ((0, 16), (16, 128)), num_sequences=3, progress=False)
        assert [b["perplexity"] for b in record[label]["positions"]["buckets"]] == pytest.approx(
            [b["perplexity"] for b in expected["buckets"]], rel=1e-5
        )
        passkey = passkey_retrieval(model, tok, texts, lengths=(300,), depths=(0.5,), trials=2, progress=False)
        assert record[label]["passkey"]["answers"] == passkey["answers"]
    ratio = (
        record["model"]["positions"]["buckets"][1]["perplexity"]
        / record["original"]["positions"]["buckets"][1]["perplexity"]
    )
    assert f"({ratio:.2f}x)" in out
    assert "| original | " in out and "| model | " in out and "300 tokens" in out
    assert (tmp_path / "long_context.png").stat().st_size > 10_000


def test_past_max_positions_scores_buckets_past_the_models_positions(saved, tmp_path, capsys):
    """--past-max-positions: a bucket past the models' 512 positions is scored (as the library scores it)
    and marked in the table; the settings record it."""
    argv = ["evaluate", "--model", saved["converted"], "--texts", saved["texts"], "--positions", "0", "256", "600"]
    argv += ["--sequences", "1", "--passkey", "0", "--past-max-positions", "--no-progress", "--output", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| model | 0-256 | 256-600 * | tokens | time |" in out and "* past max_position_embeddings, 512" in out
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["settings"]["past_max_positions"] is True
    model = AutoModelForCausalLM.from_pretrained(saved["converted"]).eval()
    text = open(f"{saved['texts']}/00.txt").read().strip()
    expected = position_perplexity(
        model, tokenizer(), [text], ((0, 256), (256, 600)), num_sequences=1, progress=False, past_max_positions=True
    )
    assert [b["perplexity"] for b in record["model"]["positions"]["buckets"]] == pytest.approx(
        [b["perplexity"] for b in expected["buckets"]], rel=1e-5
    )


def test_extend_context_rescales_both_models_before_they_are_scored(saved, tmp_path, capsys):
    """--extend-context 2: both models read 1,024 positions (YaRN), as `extend_context` makes them; a bucket
    past their former 512 needs no --past-max-positions."""
    argv = ["evaluate", "--model", saved["converted"], "--texts", saved["texts"], "--positions", "0", "256", "600"]
    argv += ["--sequences", "1", "--passkey", "0", "--extend-context", "2", "--no-progress", "--output", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rotary embeddings extended 2x (YaRN)" in out and "*" not in out
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["extend_context"] == 2.0
    text = open(f"{saved['texts']}/00.txt").read().strip()
    for label, folder in (("model", saved["converted"]), ("original", saved["original"])):
        model = extend_context(AutoModelForCausalLM.from_pretrained(folder).eval(), 2)
        buckets = ((0, 256), (256, 600))
        expected = position_perplexity(model, tokenizer(), [text], buckets, num_sequences=1, progress=False)
        assert [b["perplexity"] for b in record[label]["positions"]["buckets"]] == pytest.approx(
            [b["perplexity"] for b in expected["buckets"]], rel=1e-5
        )


def test_fidelity_compares_the_model_with_its_original_as_the_library_does(saved, tmp_path, capsys):
    """--fidelity: top-1 agreement and KL of the model against its original per bucket, in the table, the
    JSON and the plot, equal to `position_fidelity` on the two saved models."""
    argv = ["evaluate", "--model", saved["converted"], "--texts", saved["texts"], "--positions", "0", "16", "128"]
    argv += ["--sequences", "2", "--passkey", "0", "--fidelity", "--no-progress", "--output", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "long_context.json").read_text())
    model, original = (AutoModelForCausalLM.from_pretrained(saved[name]).eval() for name in ("converted", "original"))
    texts = [open(f"{saved['texts']}/{i:02}.txt").read().strip() for i in range(2)]
    expected = position_fidelity(model, original, tokenizer(), texts, ((0, 16), (16, 128)), num_sequences=2)
    got = record["model"]["fidelity"]["buckets"]
    assert [b["kl"] for b in got] == pytest.approx([b["kl"] for b in expected["buckets"]], rel=1e-4)
    assert [b["top1_agreement"] for b in got] == [b["top1_agreement"] for b in expected["buckets"]]
    assert "fidelity" not in record["original"]
    cells = " | ".join(f"{b['top1_agreement']:.1%} ({b['kl']:.3f})" for b in got)
    assert f"| model | {cells} |" in out


def test_no_finite_state_scores_the_model_with_its_exact_parts_alone(saved, tmp_path, capsys):
    """--no-finite-state: the model is scored as `finite_state_off` makes it (the original as it is), the table
    and the JSON say so, and the saved model is not changed."""
    argv = ["evaluate", "--model", saved["converted"], "--texts", saved["texts"], "--positions", "0", "64", "256"]
    argv += ["--sequences", "1", "--passkey", "0", "--no-finite-state", "--no-progress", "--output", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "the model's finite state switched off (exact parts only)" in capsys.readouterr().out
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["finite_state"] is False
    text = open(f"{saved['texts']}/00.txt").read().strip()
    model, original = (AutoModelForCausalLM.from_pretrained(saved[name]).eval() for name in ("converted", "original"))
    buckets = ((0, 64), (64, 256))
    with finite_state_off(model):
        off = position_perplexity(model, tokenizer(), [text], buckets, num_sequences=1, progress=False)
    on = position_perplexity(model, tokenizer(), [text], buckets, num_sequences=1, progress=False)
    plain = position_perplexity(original, tokenizer(), [text], buckets, num_sequences=1, progress=False)
    got = {label: [b["perplexity"] for b in record[label]["positions"]["buckets"]] for label in ("model", "original")}
    assert got["model"] == pytest.approx([b["perplexity"] for b in off["buckets"]], rel=1e-5)
    assert got["original"] == pytest.approx([b["perplexity"] for b in plain["buckets"]], rel=1e-5)
    # within the 64-position window nothing changes; past it the state is missing
    assert off["buckets"][0]["perplexity"] == pytest.approx(on["buckets"][0]["perplexity"], rel=1e-5)
    assert off["buckets"][1]["perplexity"] != pytest.approx(on["buckets"][1]["perplexity"], rel=1e-6)


def test_original_is_read_from_results_json_else_the_default(saved, tmp_path):
    assert original_of(saved["converted"]) == f"{saved['converted']}/../original"
    assert original_of(str(tmp_path)) == "default"
    (tmp_path / "results.json").write_text(json.dumps({"config": {"model": "HuggingFaceTB/SmolLM2-135M"}}))
    assert original_of(str(tmp_path)) == "HuggingFaceTB/SmolLM2-135M"
    # a run that trained a converted model on names it as --model and the original as --teacher
    run = {"model": "../hybrid", "teacher": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    (tmp_path / "results.json").write_text(json.dumps({"config": run}))
    assert original_of(str(tmp_path)) == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--positions", "0", "64", "1024"], "bucket end=1024 is more than the model's 512 positions"),
        (["--positions", "0", "64", "32"], "bucket edges [0, 64, 32] are not allowed"),
        (["--passkey", "4096"], "passkey length=4096 is more than the model's 512 positions"),
        (["--depths", "2"], "passkey depth=2.0 is not allowed"),
        (["--sequences", "50"], "fewer than the 50 asked for"),
        (["--texts", "short"], "evaluation text 0 has 30 tokens, fewer than the 64 positions"),
        (["--extend-context", "1"], "extend_context: factor=1.0 is not allowed; expected a finite number above 1"),
        (["--extend-context", "2", "--positions", "0", "64", "1100"], "bucket end=1100 is more than the model's 1024"),
        (["--fidelity"], "--fidelity compares the model with its original, but --original is 'none'"),
        (["--positions", "0", "1", "16"], "bucket (0, 1) holds no scored position"),
        (["--passkey", "0", "128"], "--passkey 0 128 mixes 0 (no passkey test) with lengths"),
        (["--passkey", "0", "--depths", "0.5"], "--depths sets the passkey test, which --passkey 0 turns off"),
        (["--passkey", "0", "--trials", "5"], "--trials sets the passkey test, which --passkey 0 turns off"),
        (["--passkey", "0", "--seed", "3"], "--seed sets the passkey test, which --passkey 0 turns off"),
        (["--seed", "-1"], "seed=-1 is not allowed; expected an int >= 0"),
        (["--passkey", "3"], "passkey length=3 is too short"),
        (["--texts", "blank"], "hold no text"),
        (["--texts", "binary"], "is not UTF-8 text"),
        (["--no-finite-state"], "LlamaForCausalLM has no converted layer with a finite state"),
        (["--passkey", "300", "300"], "passkey lengths=[300, 300] names 300 more than once"),
    ],
    ids=[
        "bucket-beyond-positions",
        "unsorted-edges",
        "passkey-beyond-positions",
        "depth",
        "too-few",
        "too-short",
        "extend-factor",
        "beyond-extended-positions",
        "fidelity-without-original",
        "bucket-of-position-0-alone",
        "passkey-0-with-lengths",
        "passkey-0-with-depths",
        "passkey-0-with-trials",
        "passkey-0-with-seed",
        "negative-seed",
        "passkey-too-short",
        "blank-texts",
        "binary-texts",
        "no-finite-state-of-an-unconverted-model",
        "passkey-length-twice",
    ],
)
def test_bad_input_is_one_line_with_status_2(saved, tmp_path, capsys, flags, message):
    argv = ["evaluate", "--model", saved["original"], "--texts", saved["texts"], "--positions", "0", "16", "64"]
    flags = [saved.get(flag, flag) for flag in flags]
    argv += ["--original", "none", "--passkey", "300", "--output", str(tmp_path / "out"), *flags]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_model_name_that_names_no_model_stops_before_any_model_loads(saved, tmp_path, capsys, monkeypatch):
    """`--model` naming no model is one line with status 2 before its original (loaded first) is read, and so
    is `--extend-context` for a model without rotary embeddings."""

    def loaded(name, *args, **kwargs):
        raise AssertionError(f"{name} loaded before every model name was checked")

    monkeypatch.setattr("hf_softmax_rnn.commands.evaluate.resolve_model", loaded)
    missing = str(tmp_path / "no_model")
    argv = ["evaluate", "--model", missing, "--original", saved["original"], "--texts", saved["texts"]]
    assert cli.main([*argv, "--passkey", "0", "--output", str(tmp_path / "out")]) == 2
    assert f"Model {missing!r} is not a directory" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=300)).save_pretrained(gpt2)
    argv = ["evaluate", "--model", str(gpt2), "--original", "none", "--texts", saved["texts"], "--passkey", "0"]
    assert cli.main([*argv, "--extend-context", "2", "--output", str(tmp_path / "out")]) == 2
    message = "GPT2LMHeadModel has no rotary position embedding to rescale"
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def _with_swapped_ids(tok: PreTrainedTokenizerFast, first: str, second: str) -> PreTrainedTokenizerFast:
    """`tok` with the ids of two tokens exchanged."""
    state = json.loads(tok.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)), eos_token=tok.eos_token, pad_token=tok.pad_token
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [("vocabulary", "the model scores 257 tokens and the reference 300"), ("tokenizer", "the tokenizers of")],
    ids=["other-vocabulary", "other-tokenizer"],
)
def test_fidelity_refuses_an_original_of_another_vocabulary(saved, tmp_path, capsys, change, message):
    tok = tokenizer()
    if change == "vocabulary":
        other = type(tiny_llama())(type(tiny_llama().config)(**{**LLAMA_KWARGS, "vocab_size": 300}))
    else:
        other = tiny_llama()
        tok = _with_swapped_ids(tok, "a", "b")  # as many ids, another mapping
    other.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    argv = ["evaluate", "--model", saved["converted"], "--original", str(tmp_path / "other"), "--texts", saved["texts"]]
    argv += ["--positions", "0", "16", "--passkey", "0", "--fidelity", "--output", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_model_whose_config_contradicts_its_weights_is_one_line_with_status_2(saved, tmp_path, capsys):
    """A config.json with a layer the weights lack would give a randomly initialised layer (transformers only
    logs a report): the command stops, naming the weights."""
    model = tmp_path / "model"
    shutil.copytree(saved["original"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_hidden_layers": config["num_hidden_layers"] + 1}))
    argv = ["evaluate", "--model", str(model), "--original", "none", "--texts", saved["texts"], "--passkey", "0"]
    assert cli.main([*argv, "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "LOAD REPORT" not in error
    assert re.search(
        rf"^hf-softmax-rnn evaluate: error: Model '{model}': its weights do not fit the model its config\.json "
        r"describes \(num_hidden_layers=3, .*\): 9 weights it needs missing from the files \(model\.layers\.2\.",
        error,
        re.MULTILINE,
    ), error
    assert not (tmp_path / "out").exists()

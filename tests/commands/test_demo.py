import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_softmax_rnn import convert
from hf_softmax_rnn.cli import main
from hf_softmax_rnn.commands.demo import chat_sample
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.evaluation import stream_nll, token_stream

from ..models.helpers import LLAMA_SHAPE

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
CONTEXTS = (8, 16)
NEW_TOKENS = 4
EVAL_TOKENS, EVAL_WINDOW = 64, 16
PREFILL_CHUNK = 6


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random 2-layer Llama (hidden 32, 2 KV heads) with a 300-token BPE trained on the corpus and a chat template."""
    texts = load_corpus()["train"]["text"][:5]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        **LLAMA_SHAPE
        | dict(vocab_size=300, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_demo(model_dir, *extra):
    return main(
        [
            "--log-level",
            "WARNING",
            "demo",
            "--model",
            str(model_dir),
            "--contexts",
            *map(str, CONTEXTS),
            "--max-eval-tokens",
            str(EVAL_TOKENS),
            "--eval-window",
            str(EVAL_WINDOW),
            "--prefill-chunk",
            str(PREFILL_CHUNK),
            "--new-tokens",
            str(NEW_TOKENS),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def demo_results(tiny_llama_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("demo")
    assert (
        run_demo(
            tiny_llama_dir,
            "--presets",
            "softmax",
            "gated_softmax_no_gate_L2norm_nodivS_noclamp",
            "linear_elu",
            "--output",
            str(output),
        )
        == 0
    )
    return output, {r["name"]: r for r in json.loads((output / "demo.json").read_text())["results"]}


def test_demo_writes_the_table(demo_results, capsys):
    output, results = demo_results
    table = (output / "demo.md").read_text()
    for preset in results:
        assert f"`{preset}`" in table
    assert "hf-softmax-rnn finetune" in table
    assert all(isinstance(r["sample"], str) for r in results.values())


def test_softmax_row_is_the_unconverted_model(demo_results, tiny_llama_dir):
    """Perplexity and sample of the 'softmax' conversion equal those of the plain Llama."""
    _, results = demo_results
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)
    ids = token_stream(tokenizer, load_corpus()["test"]["text"])[:EVAL_TOKENS]
    nll, count = stream_nll(reference, ids, max_length=EVAL_WINDOW, stride=EVAL_WINDOW - 1, progress=False)
    assert results["softmax"]["eval_tokens"] == count
    assert results["softmax"]["perplexity"] == pytest.approx(torch.tensor(nll / count).exp().item(), rel=1e-5)
    assert results["softmax"]["sample"] == chat_sample(
        reference, tokenizer, "What is a Python dictionary? Answer in one sentence.", NEW_TOKENS
    )


@pytest.mark.parametrize(
    "preset", ["softmax", "gated_softmax_no_gate_L2norm_nodivS_noclamp"], ids=["softmax", "l2-exact-exp"]
)
def test_kv_cache_bytes_grow_with_context(demo_results, tiny_llama_dir, preset):
    """A KV cache holds keys and values of every position fed to the model (context + new tokens - 1)."""
    _, results = demo_results
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    for timing in results[preset]["timings"]:
        positions = timing["context"] + NEW_TOKENS - 1
        expected = config.num_hidden_layers * 2 * config.num_key_value_heads * positions * head_dim * 4
        assert timing["cache_bytes"] == expected
    assert results[preset]["decode_state"].startswith("KV cache")


def test_recurrent_state_bytes_do_not_grow(demo_results):
    _, results = demo_results
    sizes = {t["context"]: t["cache_bytes"] for t in results["linear_elu"]["timings"]}
    assert sizes[CONTEXTS[0]] == sizes[CONTEXTS[1]] > 0
    assert results["linear_elu"]["decode_state"] == "recurrent state"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--presets", "no_such_preset"], "no_such_preset"),
        (["--new-tokens", "0"], "--new-tokens=0"),
        (["--contexts", "62"], "max_position_embeddings=64"),
        (["--eval-window", "65"], "--eval-window=65 is more than the model's max_position_embeddings=64"),
        (["--presets", "softmax", "linear_elu", "softmax"], "--presets names 'softmax' more than once"),
        (["--contexts", "8", "8"], "--contexts names '8' more than once"),
        (["--prompt", " "], "--prompt ' ' is empty; expected the text of a chat prompt"),
    ],
    ids=[
        "unknown-preset",
        "no-new-tokens",
        "context-too-long",
        "window-too-long",
        "repeated-preset",
        "repeated-context",
        "blank-prompt",
    ],
)
def test_demo_rejects_bad_arguments(tiny_llama_dir, extra, message, capsys, monkeypatch):
    from hf_softmax_rnn.commands import demo

    monkeypatch.setattr(demo, "resolve_model", lambda *args: pytest.fail("the model loaded before the check"))
    assert run_demo(tiny_llama_dir, *extra) == 2
    error = capsys.readouterr().err
    assert "hf-softmax-rnn demo: error: " in error and message in error.split("hf-softmax-rnn demo: error: ")[-1]


def test_demo_names_an_unreadable_dataset(tiny_llama_dir, tmp_path, capsys):
    (tmp_path / "held_out.txt").write_bytes(b"\xff\xfe" * 100)
    assert run_demo(tiny_llama_dir, "--dataset", str(tmp_path / "held_out.txt")) == 2
    error = capsys.readouterr().err
    assert "hf-softmax-rnn demo: error: Dataset file " in error and "held_out.txt' is not UTF-8 text" in error


@pytest.fixture(scope="module")
def trained_results(tiny_llama_dir, tmp_path_factory):
    """The demo with a saved converted model and the unconverted model itself as `--trained` rows."""
    converted_dir = tmp_path_factory.mktemp("converted-elu")
    convert(LlamaForCausalLM.from_pretrained(tiny_llama_dir), "linear_elu").save_pretrained(converted_dir)
    output = tmp_path_factory.mktemp("demo-trained")
    argv = ["--presets", "softmax", "--trained", str(converted_dir), str(tiny_llama_dir), "--output", str(output)]
    assert run_demo(tiny_llama_dir, *argv) == 0
    results = json.loads((output / "demo.json").read_text())["results"]
    return converted_dir, output, results


def test_trained_rows_are_measured_like_the_presets(trained_results, tiny_llama_dir):
    converted_dir, output, results = trained_results
    softmax, converted, plain = results
    assert [r["kind"] for r in results] == ["preset", "trained", "trained"]
    assert (converted["name"], plain["name"]) == (str(converted_dir), str(tiny_llama_dir))
    # the unconverted model loaded from its folder is the softmax row again
    assert plain["perplexity"] == pytest.approx(softmax["perplexity"], rel=1e-6)
    assert plain["sample"] == softmax["sample"] and plain["decode_state"] == "KV cache"
    assert [t["cache_bytes"] for t in plain["timings"]] == [t["cache_bytes"] for t in softmax["timings"]]
    # the saved conversion: its own perplexity, computed here directly, and a constant state
    model = AutoModelForCausalLM.from_pretrained(converted_dir).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)
    ids = token_stream(tokenizer, load_corpus()["test"]["text"])[:EVAL_TOKENS]
    nll, count = stream_nll(model, ids, max_length=EVAL_WINDOW, stride=EVAL_WINDOW - 1, progress=False)
    assert converted["perplexity"] == pytest.approx(torch.tensor(nll / count).exp().item(), rel=1e-5)
    assert converted["decode_state"] == "recurrent state"
    assert converted["timings"][0]["cache_bytes"] == converted["timings"][1]["cache_bytes"] > 0
    assert converted["description"].startswith("saved model; all 2 layers: linear attention with the elu feature")
    assert plain["description"] == "saved model; unconverted attention"
    table = (output / "demo.md").read_text()
    assert f"| `{converted_dir}` | recurrent state |" in table and f"| `{tiny_llama_dir}` | KV cache |" in table


def test_trained_folders_are_checked_before_anything_is_measured(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Before anything is measured, and before the model and the data load (from its config alone)."""
    from hf_softmax_rnn.commands import demo

    monkeypatch.setattr(demo, "evaluate_preset", lambda *args: pytest.fail("measured before the check"))
    monkeypatch.setattr(demo, "resolve_model", lambda *args: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(demo, "load_corpus", lambda *args: pytest.fail("the data loaded before the check"))
    assert run_demo(tiny_llama_dir, "--trained", str(tmp_path / "missing")) == 2
    assert "--trained '" + str(tmp_path / "missing") + "' does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert run_demo(tiny_llama_dir, "--trained", str(tmp_path / "config.json")) == 2
    assert "--trained '" + str(tmp_path / "config.json") + "' is a file" in capsys.readouterr().err
    (tmp_path / "no-model").mkdir()
    assert run_demo(tiny_llama_dir, "--trained", str(tmp_path / "no-model")) == 2
    assert "--trained '" + str(tmp_path / "no-model") + "' holds no config.json" in capsys.readouterr().err
    other = tmp_path / "other-vocab"
    LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE | dict(vocab_size=301))).save_pretrained(other)
    assert run_demo(tiny_llama_dir, "--trained", str(other)) == 2
    error = capsys.readouterr().err
    assert "has vocab_size=301, the --model has 300" in error


def test_a_trained_folder_whose_weights_are_damaged_is_one_line_before_anything_is_measured(
    tiny_llama_dir, tmp_path, capsys, monkeypatch
):
    from hf_softmax_rnn.commands import demo

    monkeypatch.setattr(demo, "evaluate_preset", lambda *args: pytest.fail("measured before the check"))
    trained = tmp_path / "trained"
    shutil.copytree(tiny_llama_dir, trained)
    weights = trained / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert run_demo(tiny_llama_dir, "--presets", "softmax", "--trained", str(trained), "--output", str(tmp_path)) == 2
    error = capsys.readouterr().err
    assert (
        f"hf-softmax-rnn demo: error: Model '{trained}': weight file '{weights}' cannot be read: it is truncated"
        in error
    )
    assert not (tmp_path / "demo.json").exists()

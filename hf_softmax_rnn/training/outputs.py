"""What a fine-tuning run leaves in its output folder, and the upload to the Hub.

<output_dir>/
    config.json, model.safetensors, tokenizer files, modelling code   the trained model (LoRA merged)
    README.md                                                         model card
    adapter/, adapter_base/     LoRA stage only: the adapter and the model it applies to
    metrics.jsonl, runs/        metrics as JSON lines and TensorBoard events (runs/ is not uploaded)
    loss_curves.png, results.json
    transfer_layer_mse.json/.png  transfer stage only: held-out error of each layer before and after it
    checkpoints/                resumable training state (not uploaded)

`--push-to-hub` uploads an allow-list of these (`uploaded_files`), never anything else found in
the folder. The card and results.json name local paths relative to the output folder.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.data.corpus import SOURCE_SEPARATOR
from hf_softmax_rnn.data.generated import GENERATED_CORPUS
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_HUB_ID
from hf_softmax_rnn.errors import CommandError
from hf_softmax_rnn.hub import export_remote_code, is_exported_code
from hf_softmax_rnn.model_card import softmax_rnn_model_card
from hf_softmax_rnn.training.attention_source import is_attention_file
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.disk import reporting_full_disk
from hf_softmax_rnn.training.metrics import METRICS_FILE, PLOT_FILE, memory_words, plot_loss_curves, read_metrics
from hf_softmax_rnn.training.output_settings import HubSettings
from hf_softmax_rnn.training.transfer_report import LAYER_MSE_FILE

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER_BASE_DIR = "adapter_base"
RESULTS_FILE = "results.json"
#: tokenizer_config.json entries that are not part of the tokenizer (see `save_tokenizer`).
_LOADING_KEYS = ("auto_map", "is_local", "local_files_only")
#: What `--push-to-hub` uploads: files of a saved model (top level and adapter_base/, plus the flat
#: modelling code), the adapter, the card and the run's records; never checkpoints/, runs/
#: (TensorBoard files named after host and process), dot files or anything else in the folder.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
RUN_FILES = ("README.md", METRICS_FILE, RESULTS_FILE, LAYER_MSE_FILE, "*.png")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")
OFFLINE_CORPUS_TEXT = "Python's own documentation (`pydoc_data.topics`, the package's offline corpus)"
#: Offline source name -> how the model card names it (formatted with the run's `data` settings).
_OFFLINE_SOURCES = {
    "pydoc": OFFLINE_CORPUS_TEXT,
    GENERATED_CORPUS: "{data.generated_texts} texts of up to {data.generated_tokens} tokens written by the "
    "unconverted model itself (stories, letters, articles, essays and dialogues on varied subjects)",
}


class PushToHubError(CommandError):
    """The upload failed; everything is saved locally."""


@dataclass(frozen=True)
class RunSummary:
    """What the outputs of a finished run record (built by the trainer): its settings and folder, the
    tokenizer saved with the model, the held-out metrics per point of the run, one dict per trained
    stage (name, steps, learning_rate, trains, trainable_parameters, block_size, tokens, seconds_this_process),
    the global step and batch, the number of processes, this process's wall time in seconds, its peak memory
    in GiB (`hf_softmax_rnn.training.metrics.peak_memory`) and the hardware it ran on."""

    config: FinetuneConfig
    output_dir: Path
    tokenizer: PreTrainedTokenizerBase
    evaluations: dict[str, dict]
    stages: list[dict]
    global_step: int
    global_batch: int
    num_processes: int
    seconds: float
    peak_memory: dict[str, float]
    #: what the run trained on: a GPU's name, or the CPU threads torch used
    hardware: str


def save_model(model: PreTrainedModel, tokenizer, path: Path) -> None:
    """Save weights, config, tokenizer and the modelling code for `trust_remote_code` loading
    (without registering the class, which would change every later save in this process)."""
    model.save_pretrained(path)
    export_remote_code(path, type(model), type(model.config), "AutoModelForCausalLM")
    save_tokenizer(tokenizer, path)


def save_tokenizer(tokenizer, path: Path) -> None:
    """`tokenizer.save_pretrained`, minus the entries of tokenizer_config.json that describe how this
    process loaded it (`local_files_only` under HF_HUB_OFFLINE) or point at custom code: the tokenizer
    is a plain one and must load as such anywhere."""
    tokenizer.save_pretrained(path)
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if any(key in config for key in _LOADING_KEYS):
        kept = {key: value for key, value in config.items() if key not in _LOADING_KEYS}
        config_file.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _is_local_path(name: str) -> bool:
    return Path(name).expanduser().is_absolute() or name.startswith(".") or Path(name).exists()


def portable_path(name: str, output_dir: Path) -> str:
    """A model, dataset or spec file argument as the output folder may record it: a local path
    relative to the output folder, anything else ("default", "pydoc", a Hub id) unchanged."""
    if name in (DEFAULT_MODEL_ALIAS, *_OFFLINE_SOURCES) or not _is_local_path(name):
        return name
    return os.path.relpath(Path(name).expanduser().resolve(), output_dir.resolve())


def portable_config(run: RunSummary) -> dict:
    """The run's settings with local paths relative to the output folder (itself ".")."""
    config = run.config.to_dict()
    config["output_dir"] = "."
    for name in ("model", "teacher"):
        if config[name] is not None:
            config[name] = portable_path(config[name], run.output_dir)
    if is_attention_file(config["attention"]):
        config["attention"] = portable_path(config["attention"], run.output_dir)
    sources = run.config.data.dataset_sources
    config["dataset"] = SOURCE_SEPARATOR.join(portable_path(name, run.output_dir) for name in sources)
    return config


def _model_card(run: RunSummary, model: PreTrainedModel, has_adapter: bool):
    config = run.config
    original = config.model.original
    base_on_hub = original == DEFAULT_MODEL_ALIAS or not _is_local_path(original)
    sources = config.data.dataset_sources
    dataset_on_hub = len(sources) == 1 and sources[0] not in _OFFLINE_SOURCES and not _is_local_path(sources[0])
    dataset = SOURCE_SEPARATOR.join(portable_path(name, run.output_dir) for name in sources)
    dataset_text = " and ".join(
        _OFFLINE_SOURCES.get(name, f"`{portable_path(name, run.output_dir)}`").format(data=config.data)
        for name in sources
    )
    base_model = portable_path(original, run.output_dir)
    if original == DEFAULT_MODEL_ALIAS:
        base_model = DEFAULT_MODEL_HUB_ID
    tokens = next(iter(run.evaluations.values()), {}).get("eval_tokens", 0)
    return softmax_rnn_model_card(
        layer_specs=[model.config.attention_spec(i) for i in range(model.config.num_hidden_layers)],
        head_dim=model.config.attention_head_dim,
        base_model=base_model,
        base_model_on_hub=base_on_hub,
        repo_id=config.hub.push_to_hub or f"./{run.output_dir.resolve().name}",
        evaluations=run.evaluations,
        evaluation_text=(
            f"Perplexity is exp of the mean next-token negative log-likelihood over the test split of the data, "
            f"packed into {config.data.heldout_block_size}-token blocks that are each scored on their own ({tokens:,} "
            "predicted tokens)."
        ),
        stages=run.stages,
        dataset=dataset,
        dataset_on_hub=dataset_on_hub,
        dataset_text=dataset_text,
        global_batch=run.global_batch,
        num_processes=run.num_processes,
        has_adapter=has_adapter,
        rope_parameters=getattr(model.config, "rope_parameters", None),
        max_positions=getattr(model.config, "max_position_embeddings", None),
        hardware=run.hardware,
        peak_memory=memory_words(run.peak_memory) or None,
    )


def _plot_title(model: PreTrainedModel) -> str:
    """The attention of `model`'s layers in words: each spec other than the base one with its layers (by the
    fields in which it differs from the base when they are few, e.g. a retrieval layer's `kept`), then the base."""
    config = model.config
    base = AttentionSpec.coerce(config.attention).to_dict()
    others: dict[str, list[int]] = {}
    for index in range(config.num_hidden_layers):
        spec = config.attention_spec(index).to_dict()
        if spec != base:
            others.setdefault(json.dumps(spec), []).append(index)
    if not others:
        return f"all layers: {AttentionSpec.from_dict(base).describe()}"
    parts = []
    for text, layers in others.items():
        spec = json.loads(text)
        differing = [f"{name} {value}" for name, value in spec.items() if base[name] != value]
        words = ", ".join(differing) if len(differing) <= 2 else AttentionSpec.from_dict(spec).describe()
        parts.append(f"layers {', '.join(map(str, layers))}: {words}")
    return "; ".join([*parts, f"other layers: {AttentionSpec.from_dict(base).describe()}"])


def save_outputs(run: RunSummary, model, *, is_main: bool) -> PreTrainedModel:
    """Merge LoRA (call on every process) and write the output folder (`is_main`); returns the merged
    model. The caller waits for every process afterwards."""
    output_dir = run.output_dir
    needed = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    with reporting_full_disk(output_dir, "the trained model into", needed):
        return _save_outputs(run, model, is_main=is_main)


def _save_outputs(run: RunSummary, model, *, is_main: bool) -> PreTrainedModel:
    output_dir = run.output_dir
    has_adapter = isinstance(model, PeftModel)
    if has_adapter:
        if is_main:
            model.save_pretrained(output_dir / ADAPTER_DIR)
            save_model(copy.deepcopy(model).unload(), run.tokenizer, output_dir / ADAPTER_BASE_DIR)
        model = model.merge_and_unload()
    if is_main:
        save_model(model, run.tokenizer, output_dir)
        results = {
            "evaluations": run.evaluations,
            "stages": run.stages,
            "global_step": run.global_step,
            "num_processes": run.num_processes,
            "seconds_this_process": round(run.seconds, 1),
            "peak_memory_this_process": run.peak_memory,
            "hardware": run.hardware,
            "config": portable_config(run),
        }
        (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        plot_loss_curves(read_metrics(output_dir / METRICS_FILE), output_dir / PLOT_FILE, title=_plot_title(model))
        _model_card(run, model, has_adapter).save(output_dir / "README.md")
        logger.info("Saved the trained model, metrics and model card to %s", output_dir)
    return model


def _matching(directory: Path, patterns: tuple[str, ...]) -> list[str]:
    """Names of the regular files directly in `directory` that match one of `patterns`."""
    if not directory.is_dir():
        return []
    return sorted(
        path.name
        for path in directory.iterdir()
        if path.is_file() and not path.is_symlink() and any(fnmatch.fnmatchcase(path.name, p) for p in patterns)
    )


def _model_files(directory: Path) -> list[str]:
    code = [name for name in _matching(directory, ("*.py",)) if is_exported_code(directory / name)]
    return _matching(directory, MODEL_FILES) + code


def uploaded_files(output_dir: Path) -> list[str]:
    """The files of an output folder that `--push-to-hub` uploads, relative to it (see `MODEL_FILES`)."""
    files = _model_files(output_dir) + _matching(output_dir, RUN_FILES)
    files += [f"{ADAPTER_DIR}/{name}" for name in _matching(output_dir / ADAPTER_DIR, ADAPTER_FILES)]
    files += [f"{ADAPTER_BASE_DIR}/{name}" for name in _model_files(output_dir / ADAPTER_BASE_DIR)]
    return sorted(set(files))


def publish(hub: HubSettings, output_dir: Path) -> None:
    """Upload the allow-listed files of `output_dir` to `hub.push_to_hub`, if set (call on the main process).

    Raises PushToHubError naming the cause (offline, no token, network, permissions)."""
    repo = hub.push_to_hub
    if not repo:
        return
    files = uploaded_files(output_dir)
    try:
        api = HfApi()
        api.create_repo(repo, private=hub.hub_private, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=output_dir, allow_patterns=files)
    except Exception as error:  # any failure of the upload: the outputs are saved already
        raise PushToHubError(
            f"Could not push {output_dir} to the Hub repo {repo!r}: {error}. Everything is saved in "
            f"{output_dir}; to push it later, run the same command again with --resume (the training is "
            "complete: it only writes and uploads the outputs)"
        ) from error
    logger.info("Pushed %d files of %s to https://huggingface.co/%s", len(files), output_dir, repo)

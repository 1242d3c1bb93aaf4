"""What a fine-tuning run leaves in its output folder, and the upload to the Hub.

<output_dir>/
    config.json, model.safetensors, tokenizer files, modelling code   the trained model (LoRA merged)
    README.md                                                         model card
    adapter/, adapter_base/     LoRA stage only: the adapter and the model it applies to
    metrics.jsonl, runs/        metrics as JSON lines and TensorBoard events
    loss_curves.png, results.json
    checkpoints/                resumable training state (not uploaded)
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import HfApi
from peft import PeftModel
from transformers import PreTrainedModel

from hf_softmax_rnn.cli import CommandError
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_HUB_ID
from hf_softmax_rnn.model_card import softmax_rnn_model_card
from hf_softmax_rnn.training.checkpointing import CHECKPOINTS_DIR
from hf_softmax_rnn.training.metrics import METRICS_FILE, PLOT_FILE, plot_loss_curves, read_metrics

if TYPE_CHECKING:
    from hf_softmax_rnn.training.stages import Stage
    from hf_softmax_rnn.training.trainer import Finetuner

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER_BASE_DIR = "adapter_base"
RESULTS_FILE = "results.json"
OFFLINE_CORPUS_TEXT = "Python's own documentation (`pydoc_data.topics`, the package's offline corpus)"


class PushToHubError(CommandError):
    """The upload failed; everything is saved locally."""


def save_model(model: PreTrainedModel, tokenizer, path: Path) -> None:
    """Save weights, config, tokenizer and the modelling code for `trust_remote_code` loading."""
    type(model).register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _stage_summary(run: Finetuner, stage: Stage) -> dict:
    return {
        "name": stage.name,
        "steps": stage.steps,
        "learning_rate": stage.learning_rate,
        "trains": stage.trains,
        "trainable_parameters": run.state.trainable_parameters.get(stage.name),
        "tokens": stage.steps * run.global_batch * run.config.block_size,
    }


def _model_card(run: Finetuner, model: PreTrainedModel, stages: list[dict], has_adapter: bool):
    config = run.config
    base_on_hub = config.model == DEFAULT_MODEL_ALIAS or not Path(config.model).exists()
    dataset_on_hub = config.dataset != "pydoc" and not Path(config.dataset).exists()
    dataset_text = OFFLINE_CORPUS_TEXT if config.dataset == "pydoc" else f"`{config.dataset}`"
    evaluations = {point: values for point, values in run.state.evaluations.items()}
    tokens = next(iter(evaluations.values()), {}).get("eval_tokens", 0)
    return softmax_rnn_model_card(
        layer_specs=[model.config.attention_spec(i) for i in range(model.config.num_hidden_layers)],
        head_dim=model.config.attention_head_dim,
        base_model=DEFAULT_MODEL_HUB_ID if config.model == DEFAULT_MODEL_ALIAS else config.model,
        base_model_on_hub=base_on_hub,
        repo_id=config.push_to_hub or str(run.output_dir.resolve()),
        evaluations=evaluations,
        evaluation_text=(
            f"Perplexity is exp of the mean next-token negative log-likelihood over the test split of the data, "
            f"packed into {config.block_size}-token blocks that are each scored on their own ({tokens:,} predicted tokens)."
        ),
        stages=stages,
        dataset=config.dataset,
        dataset_on_hub=dataset_on_hub,
        dataset_text=dataset_text,
        block_size=config.block_size,
        global_batch=run.global_batch,
        num_processes=run.accelerator.num_processes,
        has_adapter=has_adapter,
    )


def _plot_title(config) -> str:
    layers = "all layers" if config.layers is None else f"layers {', '.join(map(str, config.layers))}"
    return f"{layers}: {config.attention_spec.describe()}"


def save_outputs(run: Finetuner, model, stages: list[Stage], *, seconds: float) -> PreTrainedModel:
    """Merge LoRA (on every process) and write the output folder (main process); returns the merged model."""
    output_dir = run.output_dir
    is_main = run.accelerator.is_main_process
    has_adapter = isinstance(model, PeftModel)
    if has_adapter:
        if is_main:
            model.save_pretrained(output_dir / ADAPTER_DIR)
            save_model(copy.deepcopy(model).unload(), run.tokenizer, output_dir / ADAPTER_BASE_DIR)
        model = model.merge_and_unload()
    if is_main:
        save_model(model, run.tokenizer, output_dir)
        summaries = [_stage_summary(run, stage) for stage in stages]
        results = {
            "evaluations": run.state.evaluations,
            "stages": summaries,
            "global_step": run.state.global_step,
            "num_processes": run.accelerator.num_processes,
            "seconds_this_process": round(seconds, 1),
            "config": run.config.to_dict(),
        }
        (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        plot_loss_curves(read_metrics(output_dir / METRICS_FILE), output_dir / PLOT_FILE, title=_plot_title(run.config))
        _model_card(run, model, summaries, has_adapter).save(output_dir / "README.md")
        logger.info("Saved the trained model, metrics and model card to %s", output_dir)
    run.accelerator.wait_for_everyone()
    return model


def publish(run: Finetuner) -> None:
    """Upload the output folder (without checkpoints) to `--push-to-hub` (main process).

    Raises PushToHubError naming the cause (offline, no token, network, permissions)."""
    repo = run.config.push_to_hub
    if not repo or not run.accelerator.is_main_process:
        return
    try:
        api = HfApi()
        api.create_repo(repo, private=run.config.hub_private, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=run.output_dir, ignore_patterns=[f"{CHECKPOINTS_DIR}/**"])
    except Exception as error:  # any failure of the upload: the outputs are saved already
        raise PushToHubError(
            f"Could not push {run.output_dir} to the Hub repo {repo!r}: {error}. Everything is saved in "
            f"{run.output_dir}; upload it later with `hf upload {repo} {run.output_dir}`"
        ) from error
    logger.info("Pushed %s to https://huggingface.co/%s", run.output_dir, repo)

"""Model cards for converted (and fine-tuned) checkpoints, with `huggingface_hub.ModelCard`.

The card is rendered from the Jinja template `model_cards/softmax_rnn_model.md` shipped with
the package. It states the base checkpoint, the attention of every layer (in words and as
`AttentionSpec` JSON), the training data and stages, the held-out perplexities and how to
load the model with and without this package; its metadata carries base_model,
library_name, tags, datasets and the final perplexity in model-index form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.utils import minutes_and_seconds
from hf_softmax_rnn.version import __version__

TEMPLATE_PATH = Path(__file__).parent / "model_cards" / "softmax_rnn_model.md"
PAPER_URL = "https://arxiv.org/abs/2507.23632"
CITATION = """@article{mongaras2025expressiveness,
  title   = {On the Expressiveness of Softmax Attention: A Recurrent Neural Network Perspective},
  author  = {Mongaras, Gabriel and Larson, Eric C.},
  journal = {Transactions on Machine Learning Research},
  year    = {2025},
  url     = {https://arxiv.org/abs/2507.23632}
}"""
TAGS = ["hf_softmax_rnn", "softmax-attention-rnn", "custom_code"]
#: Labels of the evaluation points a fine-tuning run records, in the order of the run.
EVALUATION_LABELS = {
    "base": "base model (exact softmax)",
    "converted": "converted, before training",
    "transfer": "after attention transfer",
    "finetune": "after fine-tuning",
    "state": "after training the state on long blocks",
}


def attention_groups(layer_specs: Sequence[AttentionSpec], head_dim: int) -> list[dict]:
    """Runs of consecutive layers with the same spec: [{"layers": "0-29", "description", "generation", "spec"}]."""
    groups: list[dict] = []
    for index, spec in enumerate(layer_specs):
        if groups and groups[-1]["spec"] == spec.to_dict():
            groups[-1]["last"] = index
        else:
            generation = "constant-size recurrent state" if spec.fits_recurrent_state(head_dim) else "KV cache"
            groups.append(
                {
                    "first": index,
                    "last": index,
                    "spec": spec.to_dict(),
                    "description": spec.describe(),
                    "generation": generation,
                }
            )
    for group in groups:
        first, last = group.pop("first"), group.pop("last")
        group["layers"] = str(first) if first == last else f"{first}-{last}"
    return groups


def _with_wall_time(stage: Mapping) -> dict:
    seconds = stage.get("seconds_this_process")
    return {**stage, "wall_time": "-" if seconds is None else minutes_and_seconds(seconds)}


def softmax_rnn_model_card(
    *,
    layer_specs: Sequence[AttentionSpec],
    head_dim: int,
    base_model: str,
    base_model_on_hub: bool,
    repo_id: str,
    evaluations: Mapping[str, Mapping[str, float]] | None = None,
    evaluation_text: str = "",
    stages: Sequence[Mapping] = (),
    dataset: str | None = None,
    dataset_on_hub: bool = False,
    dataset_text: str | None = None,
    global_batch: int | None = None,
    num_processes: int = 1,
    has_adapter: bool = False,
    rope_parameters: Mapping | None = None,
    max_positions: int | None = None,
    hardware: str | None = None,
    peak_memory: str | None = None,
) -> ModelCard:
    """Render the card of a converted model.

    Args:
        layer_specs: the attention spec of every layer, in order.
        head_dim: the attention head size (whether a layer's state fits a constant-size
            recurrent cache depends on it).
        base_model: the checkpoint converted.
        base_model_on_hub: `base_model` is a Hub id, which goes to the metadata.
        repo_id: where the model is loaded from in the card's snippets (Hub repo or folder).
        evaluations: point of the run ("base", "converted", "transfer", "finetune", "state", or any
            other name) -> {"perplexity", "eval_loss"}; the last one goes to model-index.
        evaluation_text: how the perplexities were measured (one sentence).
        stages: one mapping per training stage: name, steps, learning_rate, trains, block_size (tokens per
            training block), tokens, and seconds_this_process where this process trained it.
        dataset: the training data.
        dataset_on_hub: `dataset` is a Hub id, which goes to the metadata.
        dataset_text: how the card names the data.
        has_adapter: the repo also holds `adapter/` (LoRA) and `adapter_base/`.
        rope_parameters: the model's rotary settings; YaRN scaling (`extend_context`) is stated in the card.
        max_positions: the model's `max_position_embeddings`.
        hardware: what the stages' wall times were measured on ("2 CPU thread(s)", a GPU's name).
        peak_memory: the training process's peak memory in words.
    """
    evaluations = dict(evaluations or {})
    groups = attention_groups(layer_specs, head_dim)
    rows = [{"label": EVALUATION_LABELS.get(point, point), **values} for point, values in evaluations.items()]
    eval_results = None
    if evaluations:
        final_point, final = list(evaluations.items())[-1]
        eval_results = [
            EvalResult(
                task_type="text-generation",
                dataset_type=dataset or "unknown",
                dataset_name=dataset_text or dataset or "held-out text",
                dataset_split="test",
                metric_type="perplexity",
                metric_name=f"held-out perplexity ({EVALUATION_LABELS.get(final_point, final_point)})",
                metric_value=round(final["perplexity"], 4),
            )
        ]
    card_data = ModelCardData(
        model_name=Path(repo_id).name,
        base_model=base_model if base_model_on_hub else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(TAGS),
        datasets=[dataset] if dataset and dataset_on_hub else None,
        eval_results=eval_results,
    )
    base_model_text = f"[{base_model}](https://huggingface.co/{base_model})" if base_model_on_hub else f"`{base_model}`"
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE_PATH),
        model_name=Path(repo_id).name,
        base_model_text=base_model_text,
        library_version=__version__,
        attention_groups=groups,
        attention_json=json.dumps([{"layers": group["layers"], **group["spec"]} for group in groups], indent=2),
        stages=[_with_wall_time(stage) for stage in stages],
        resumed=any(stage.get("seconds_this_process") is None for stage in stages),
        hardware=hardware,
        peak_memory=peak_memory,
        dataset_text=dataset_text or dataset,
        global_batch=global_batch,
        num_processes=num_processes,
        evaluations=rows,
        evaluation_text=evaluation_text,
        yarn=rope_parameters if (rope_parameters or {}).get("rope_type") == "yarn" else None,
        max_positions=max_positions,
        repo_id=repo_id,
        has_adapter=has_adapter,
        citation=CITATION,
    )

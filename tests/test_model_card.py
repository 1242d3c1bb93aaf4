"""The model card states the attention per layer (words and JSON), training, perplexities and
loading, and its metadata parses back with huggingface_hub."""

import json
import re

import pytest
from huggingface_hub import ModelCard

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.model_card import attention_groups, softmax_rnn_model_card

L2 = AttentionSpec.from_preset("gated_softmax_no_gate_L2norm_nodivS_noclamp")
SOFTMAX = AttentionSpec.from_preset("softmax")
ELU = AttentionSpec.from_preset("linear_elu")
HYBRID = [L2, SOFTMAX, L2, L2]
EVALUATIONS = {
    "base": {"perplexity": 20.5, "eval_loss": 3.02},
    "converted": {"perplexity": 900.0, "eval_loss": 6.8},
    "finetune": {"perplexity": 31.25, "eval_loss": 3.44},
}


def _card(**overrides) -> ModelCard:
    settings = dict(
        layer_specs=HYBRID,
        head_dim=64,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        base_model_on_hub=True,
        repo_id="someone/smollm2-l2",
        evaluations=EVALUATIONS,
        stages=[
            {
                "name": "finetune",
                "steps": 10,
                "learning_rate": 2e-4,
                "trains": "LoRA",
                "block_size": 256,
                "tokens": 40960,
            },
            {
                "name": "state",
                "steps": 2,
                "learning_rate": 1e-2,
                "trains": "rnn_params",
                "block_size": 4096,
                "tokens": 131072,
            },
        ],
        dataset="wikitext",
        dataset_on_hub=True,
        global_batch=16,
        has_adapter=True,
    )
    settings.update(overrides)
    return ModelCard(str(softmax_rnn_model_card(**settings)))


def test_layer_groups_follow_consecutive_equal_specs():
    groups = attention_groups(HYBRID + [ELU], head_dim=64)
    assert [(g["layers"], g["description"], g["generation"]) for g in groups] == [
        ("0", L2.describe(), "KV cache"),
        ("1", SOFTMAX.describe(), "KV cache"),
        ("2-3", L2.describe(), "KV cache"),
        ("4", ELU.describe(), "constant-size recurrent state"),
    ]


def test_card_json_gives_back_every_layer_spec():
    text = _card().text
    groups = json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))
    specs = {}
    for group in groups:
        first, _, last = group.pop("layers").partition("-")
        for index in range(int(first), int(last or first) + 1):
            specs[index] = AttentionSpec.from_dict(group)
    assert [specs[i] for i in range(len(HYBRID))] == HYBRID
    assert f"| 2-3 | {L2.describe()} | KV cache |" in text


def test_metadata_has_base_model_datasets_tags_and_final_perplexity_in_model_index():
    data = _card().data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data.library_name == "transformers"
    assert data.datasets == ["wikitext"]
    assert "hf_softmax_rnn" in data.tags
    (result,) = data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_split) == ("perplexity", 31.25, "test")


def test_text_has_perplexities_loading_and_citation():
    text = _card().text
    for point, label in (
        ("base", "base model (exact softmax)"),
        ("converted", "converted, before training"),
        ("finetune", "after fine-tuning"),
    ):
        assert f"| {label} | {EVALUATIONS[point]['perplexity']:.3f} |" in text
    assert 'from_pretrained("someone/smollm2-l2", trust_remote_code=True)' in text
    assert 'subfolder="adapter"' in text
    assert "arXiv:2507.23632" in text and "Mongaras" in text and "Transactions on Machine Learning Research" in text


def test_training_table_gives_each_stage_its_block_length_and_tokens():
    text = _card().text
    assert "| finetune | 10 | 0.0002 | LoRA | 256 | 40,960 | - |" in text
    assert "| state | 2 | 0.01 | rnn_params | 4,096 | 131,072 | - |" in text
    assert "16 blocks per optimizer step (1 process)" in text
    assert "1 block per optimizer step (1 process)" in _card(global_batch=1).text


def test_training_table_gives_each_stage_trained_here_its_wall_time_on_the_hardware_named():
    stages = [
        {"name": "finetune", "steps": 10, "learning_rate": 2e-4, "trains": "LoRA", "block_size": 256, "tokens": 40960},
        {"name": "state", "steps": 2, "learning_rate": 1e-2, "trains": "rnn_params", "block_size": 4096,
         "tokens": 131072, "seconds_this_process": 941.4},
    ]  # fmt: skip
    text = _card(stages=stages, hardware="2 CPU thread(s)", peak_memory="10.92 GiB resident").text
    assert "| finetune | 10 | 0.0002 | LoRA | 256 | 40,960 | - |" in text
    assert "| state | 2 | 0.01 | rnn_params | 4,096 | 131,072 | 15 min 41 s |" in text
    assert (
        "Wall times of the main process on 2 CPU thread(s) (its peak memory: 10.92 GiB resident); a stage trained "
        "before a resume has none, and the stage resumed counts only its part after it." in text
    )
    stages[0]["seconds_this_process"] = 583.4
    text = _card(stages=stages, hardware="NVIDIA H200").text
    assert "| finetune | 10 | 0.0002 | LoRA | 256 | 40,960 | 9 min 43 s |" in text
    assert "Wall times of the main process on NVIDIA H200.\n" in text
    assert "Wall times" not in _card().text


def test_local_base_model_and_data_stay_out_of_the_metadata():
    data = _card(
        base_model="/models/mine", base_model_on_hub=False, dataset="pydoc", dataset_on_hub=False, has_adapter=False
    )
    assert data.data.base_model is None and data.data.datasets is None
    assert "`/models/mine`" in data.text and "adapter_base" not in data.text


@pytest.mark.parametrize(
    ("rope", "stated"),
    [
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "rope_theta": 1e5}, True),
        ({"rope_type": "default", "rope_theta": 1e5}, False),
        (None, False),
    ],
    ids=["yarn", "default", "none"],
)
def test_the_card_states_yarn_scaling_of_the_positions(rope, stated):
    text = _card(rope_parameters=rope, max_positions=16384 if stated else 8192).text
    line = "scaled by YaRN by a factor of 2.0, from the original's\n8,192 to 16,384 positions"
    assert (line in text) == stated
    assert ("YaRN" in text) == stated

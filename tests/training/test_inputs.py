"""Bad inputs stop a run before any training, with a message naming the bad value."""

import re

import huggingface_hub.constants
import pytest

from hf_softmax_rnn.cli import main
from hf_softmax_rnn.training import FinetuneConfig, Finetuner, finetune
from tests.training.helpers import MAX_POSITIONS, tiny_config

BAD_RUNS = {
    "missing-dataset": (dict(dataset="{tmp}/missing.txt"), FileNotFoundError, r"missing\.txt"),
    "block-size-above-max-positions": (
        dict(block_size=MAX_POSITIONS * 2),
        ValueError,
        rf"block_size=128 is larger than the model's maximum of {MAX_POSITIONS} positions",
    ),
    "lora-target-matching-nothing": (
        dict(lora_targets=["q_proj", "query_key_value"]),
        ValueError,
        r"LoRA target 'query_key_value' matches no Linear/Conv1D module .* \['down_proj', 'gate_proj', 'k_proj'",
    ),
    "transfer-module-not-in-layers": (
        dict(transfer_modules=["gates"]),
        ValueError,
        r"'gates' is not a submodule .* 'rnn_params'",
    ),
    "transfer-modules-without-parameters": (
        dict(attention="linear_elu", transfer_modules=["rnn_params"]),
        ValueError,
        r"\['rnn_params'\] hold no parameters",
    ),
    "transfer-without-converted-layers": (
        dict(attention="softmax"),
        ValueError,
        "every attention layer is exact softmax",
    ),
    "layer-out-of-range": (dict(layers=[0, 7]), ValueError, r"layers=\[0, 7\]"),
    "missing-model": (dict(model="{tmp}/no_model"), FileNotFoundError, "no_model"),
}


@pytest.mark.parametrize("settings,error,message", BAD_RUNS.values(), ids=BAD_RUNS.keys())
def test_bad_input_stops_before_training(tiny_models, tmp_path, settings, error, message):
    settings = {key: value.format(tmp=tmp_path) if isinstance(value, str) else value for key, value in settings.items()}
    config = tiny_config(settings.pop("model", tiny_models["llama"]), tmp_path / "out", **settings)
    with pytest.raises(error, match=message):
        Finetuner(config)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert not (tmp_path / "out" / "checkpoints").exists()


BAD_SETTINGS = {
    "unknown-preset": (
        dict(attention="softmax_quadratic"),
        r"Unknown attention preset 'softmax_quadratic'; expected one of \[",
    ),
    "bad-spec-json": (dict(attention='{"kind": "cubic"}'), r"AttentionSpec.kind='cubic' is not allowed"),
    "unknown-method": (
        dict(finetune_method="qlora"),
        r"finetune_method='qlora' is not allowed; expected one of \['lora', 'full'\]",
    ),
    "nothing-to-train": (dict(transfer_steps=0, finetune_steps=0), "nothing to train"),
    "zero-batch": (dict(batch_size=0), r"batch_size=0 is not allowed"),
}


@pytest.mark.parametrize("settings,message", BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_bad_settings_are_refused(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        FinetuneConfig(output_dir=str(tmp_path), **settings)


def test_cli_reports_bad_input_and_exits_2(tiny_models, tmp_path, capsys):
    code = main(
        ["finetune", "--output-dir", str(tmp_path / "out"), "--model", tiny_models["llama"], "--attention", "nope"]
    )
    assert code == 2
    assert "hf-softmax-rnn finetune: error: Unknown attention preset 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_push_to_hub_offline_fails_after_saving_everything(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    arguments = [
        "--output-dir",
        str(out),
        "--model",
        tiny_models["llama"],
        "--block-size",
        "16",
        "--max-eval-blocks",
        "4",
    ]
    arguments += [
        "--transfer-steps",
        "0",
        "--finetune-steps",
        "1",
        "--push-to-hub",
        "someone/tiny-softmax-rnn",
        "--no-progress",
    ]
    assert main(["finetune", *arguments]) == 1
    error = capsys.readouterr().err
    assert re.search(
        r"error: Could not push .* to the Hub repo 'someone/tiny-softmax-rnn': .*offline.* Everything is saved", error
    )
    for name in (
        "config.json",
        "model.safetensors",
        "README.md",
        "metrics.jsonl",
        "results.json",
        "loss_curves.png",
        "adapter",
    ):
        assert (out / name).exists(), name
    assert "someone/tiny-softmax-rnn" in (out / "README.md").read_text()


def test_diverging_run_stops_instead_of_training_on_nan(tiny_models, tmp_path):
    config = tiny_config(
        tiny_models["llama"], tmp_path / "out", transfer_steps=0, finetune_method="full", lr=1e30, max_grad_norm=None
    )
    with pytest.raises(
        FloatingPointError, match=r"Stage finetune: the loss is nan at step \d; lower the learning rate"
    ):
        finetune(config)

"""A run killed with SIGKILL and resumed ends exactly where an uninterrupted run ends."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_softmax_rnn.training import FinetuneConfig, finetune
from hf_softmax_rnn.training.checkpointing import checkpoint_dirs, write_manifest
from hf_softmax_rnn.training.metrics import read_metrics
from tests.training.helpers import tiny_config, weights

# Runs `finetune` and SIGKILLs itself at a chosen checkpoint: "after" the N-th one is complete,
# or "before-rename" of the (N+1)-th, when its files are written but not yet renamed into place.
KILLED_RUN = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from hf_softmax_rnn.training import FinetuneConfig, checkpointing, finetune, trainer

settings, kill_at, moment = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
saves = 0
save_checkpoint = checkpointing.save_checkpoint

def die(*args):
    os.kill(os.getpid(), signal.SIGKILL)

def save_and_maybe_die(*args, **kwargs):
    global saves
    saves += 1
    if moment == "before-rename" and saves == kill_at + 1:
        checkpointing.os.replace = die
    path = save_checkpoint(*args, **kwargs)
    if moment == "after" and saves == kill_at:
        die()
    return path

trainer.save_checkpoint = save_and_maybe_die
finetune(FinetuneConfig.from_flags(**settings))
"""

# stage 1: 3 steps, checkpoints at global steps 2, 3; stage 2 (LoRA): 4 steps, checkpoints at 5, 7;
# stage 3 (the state on 32-token blocks): 3 steps, checkpoints at 9, 10
SETTINGS = dict(
    attention="gated_softmax",
    transfer_steps=3,
    finetune_steps=4,
    state_steps=3,
    state_block_size=32,
    save_every=2,
    eval_every=2,
)
KILLS = {
    "after-2nd-checkpoint-stage-boundary": (2, "after", 3),
    "after-3rd-checkpoint-inside-lora": (3, "after", 5),
    "before-rename-of-3rd-checkpoint": (2, "before-rename", 3),
    "after-4th-checkpoint-before-the-state-stage": (4, "after", 7),
    "after-5th-checkpoint-inside-the-state-stage": (5, "after", 9),
}


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    finetune(tiny_config(tiny_models["llama"], out, **SETTINGS))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_at,moment,resumed_step", KILLS.values(), ids=KILLS.keys())
def test_killed_run_resumes_to_the_same_weights(tiny_models, uninterrupted, tmp_path, kill_at, moment, resumed_step):
    config = tiny_config(tiny_models["llama"], tmp_path / "run", **SETTINGS)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, json.dumps(config.to_dict()), str(kill_at), moment],
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint_dirs(tmp_path / "run")[-1].name == f"checkpoint-{resumed_step:07d}"
    assert not (tmp_path / "run" / "model.safetensors").exists()

    result = finetune(config.with_flags(resume=True))

    reference, resumed = weights(uninterrupted), weights(tmp_path / "run")
    assert reference.keys() == resumed.keys()
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == read_metrics(uninterrupted / "metrics.jsonl")
    assert result.evaluations == json.loads((uninterrupted / "results.json").read_text())["evaluations"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))


def test_resume_refuses_changed_settings(tiny_models, tmp_path):
    config = tiny_config(tiny_models["llama"], tmp_path / "run", transfer_steps=2, finetune_steps=0)
    finetune(config)
    with pytest.raises(ValueError, match=r"different settings: lr: checkpoint 0\.01, now 0\.5"):
        finetune(config.with_flags(resume=True, lr=0.5))


#: How a checkpoint of an earlier release recorded the settings of `test_resume_refuses_changed_settings`'s run (one
#: entry per flag; "MODEL" and "OUT" stand for its folders): such a checkpoint resumes.
FLAT_RECORD = {
    "output_dir": "OUT",
    "model": "MODEL",
    "teacher": None,
    "attention": "softmax_divS_norm",
    "layers": None,
    "retrieval_layers": 0,
    "retrieval_kept": 2048,
    "extend_context": None,
    "attention_mode": "chunked",
    "dataset": "pydoc",
    "dataset_config": None,
    "text_column": "text",
    "streaming": False,
    "test_fraction": 0.1,
    "block_size": 16,
    "eval_block_size": None,
    "batch_size": 2,
    "grad_accum": 1,
    "eval_batch_size": 4,
    "max_eval_blocks": 6,
    "shuffle_buffer": 10000,
    "generated_texts": 256,
    "generated_tokens": 512,
    "recall_facts": 0,
    "transfer_steps": 2,
    "transfer_lr": 0.01,
    "transfer_lm_weight": 0.0,
    "transfer_modules": None,
    "transfer_teacher_forcing": True,
    "finetune_steps": 0,
    "finetune_method": "lora",
    "finetune_loss": "lm",
    "lr": 0.01,
    "rnn_lr": 0.01,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    "lora_targets": None,
    "state_steps": 0,
    "state_block_size": 4096,
    "state_lr": 0.01,
    "state_gradient_checkpointing": True,
    "lr_scheduler": "cosine",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "mixed_precision": "no",
    "seed": 0,
    "cpu": False,
    "gradient_checkpointing": False,
    "eval_every": 2,
    "save_every": 2,
    "save_total_limit": 2,
    "resume": False,
    "allow_inexact_resume": False,
    "overwrite": False,
    "progress": False,
    "long_eval": False,
    "long_eval_texts": "shakespeare",
    "long_eval_positions": [0, 64, 256, 1024, 2048, 4096],
    "long_eval_sequences": 2,
    "long_eval_passkey": [1024, 2048],
    "long_eval_trials": 4,
    "long_eval_fidelity": True,
    "push_to_hub": None,
    "hub_private": False,
}


def test_a_checkpoint_recorded_in_the_flat_layout_of_an_older_release_resumes(tiny_models, tmp_path):
    config = tiny_config(tiny_models["llama"], tmp_path / "run", transfer_steps=2, finetune_steps=0)
    first = finetune(config)
    record = FLAT_RECORD | {"model": tiny_models["llama"], "output_dir": str(tmp_path / "run")}
    assert config.to_dict() == record  # the layout is the one recorded before
    for checkpoint in checkpoint_dirs(tmp_path / "run"):
        path = checkpoint / "trainer_state.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"config": record}))
        write_manifest(checkpoint)
    with pytest.raises(ValueError, match=r"different settings: lr: checkpoint 0\.01, now 0\.5"):
        finetune(config.with_flags(resume=True, lr=0.5))
    resumed = finetune(config.with_flags(resume=True))
    assert resumed.evaluations == first.evaluations


@pytest.mark.parametrize("rnn_lr", [None, 0.5], ids=["as-lr", "its-own"])
def test_a_checkpoint_recorded_without_rnn_lr_trained_rnn_params_at_lr(tmp_path, rnn_lr):
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path / "run"), lr=0.01, rnn_lr=rnn_lr)
    recorded = {name: value for name, value in config.to_dict().items() if name != "rnn_lr"}
    expected = [] if rnn_lr is None else ["rnn_lr: checkpoint 0.01, now 0.5"]
    assert config.resume_conflicts(recorded) == expected


def test_a_checkpoint_recorded_without_state_settings_trained_no_state_stage(tmp_path):
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path / "run"), attention="gated_softmax")
    recorded = {name: value for name, value in config.to_dict().items() if not name.startswith("state_")}
    assert config.resume_conflicts(_as_read_back(recorded)) == []
    with_state = FinetuneConfig.from_flags(output_dir=str(tmp_path / "run"), attention="gated_softmax", state_steps=2)
    assert with_state.resume_conflicts(_as_read_back(recorded)) == ["state_steps: checkpoint 0, now 2"]


def _as_read_back(settings: dict) -> dict:
    """`settings` as a checkpoint's JSON gives them back."""
    return json.loads(json.dumps(settings))


def test_existing_checkpoints_need_resume(tiny_models, tmp_path):
    config = tiny_config(tiny_models["llama"], tmp_path / "run", transfer_steps=2, finetune_steps=0)
    finetune(config)
    with pytest.raises(ValueError, match="already holds checkpoints .* pass --resume"):
        finetune(config)


def test_resume_accepts_the_model_folder_spelt_another_way(tiny_models, tmp_path, monkeypatch):
    model = Path(tiny_models["llama"])
    config = tiny_config(str(model), tmp_path / "run", transfer_steps=2, finetune_steps=0)
    first = finetune(config)
    trained = (tmp_path / "run" / "metrics.jsonl").read_text()
    monkeypatch.chdir(model.parent)
    resumed = finetune(config.with_flags(model=f"./{model.name}/", resume=True))
    assert resumed.evaluations == first.evaluations  # the finished run's results, not a second run's
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == trained  # no step trained again


def _saved_and_now(tmp_path, saved: str, now: str, **settings) -> list[str]:
    """The conflicts of a config naming `now` with a checkpoint that named `saved` (paths under `tmp_path`)."""
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path / "run"), model=now, **settings)
    return config.resume_conflicts({**config.to_dict(), "model": saved, **{k: saved for k in settings}})


@pytest.mark.parametrize(
    "saved,now",
    [
        ("{tmp}/llama", "./llama/"),
        ("{tmp}/llama", "llama"),
        ("./llama", "{tmp}/../{tmp_name}/llama/"),
        ("{tmp}/link", "{tmp}/llama"),
    ],
    ids=["relative-with-slash", "bare-name", "dotdot", "symlink"],
)
def test_a_local_model_folder_compares_resolved(tmp_path, monkeypatch, saved, now):
    (tmp_path / "llama").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    spelled = [value.format(tmp=tmp_path, tmp_name=tmp_path.name) for value in (saved, now)]
    assert _saved_and_now(tmp_path, *spelled) == []


@pytest.mark.parametrize(
    "saved,now",
    [("{tmp}/llama", "{tmp}/gpt2"), ("Org/Model", "org/model"), ("default", "./default"), ("{tmp}/gone", "./gone")],
    ids=["another-folder", "hub-ids-as-given", "the-embedded-model-is-no-folder", "a-folder-that-is-gone"],
)
def test_another_model_still_conflicts(tmp_path, monkeypatch, saved, now):
    for name in ("llama", "gpt2", "default"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    saved, now = (value.format(tmp=tmp_path) for value in (saved, now))
    assert _saved_and_now(tmp_path, saved, now) == [f"model: checkpoint {saved!r}, now {now!r}"]


def test_a_local_dataset_file_compares_resolved(tmp_path, monkeypatch):
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    monkeypatch.chdir(tmp_path)
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path / "run"), dataset="pydoc+./data.jsonl")
    saved = config.to_dict()
    assert config.resume_conflicts({**saved, "dataset": f"pydoc+{tmp_path}/data.jsonl"}) == []
    assert config.resume_conflicts({**saved, "dataset": f"{tmp_path}/data.jsonl"})  # other sources

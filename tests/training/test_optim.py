"""One weight-decay rule for every optimizer: the weights of linear and embedding layers only."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_softmax_rnn import convert
from hf_softmax_rnn.analysis.small_models import optimizer_and_schedule, small_llama
from hf_softmax_rnn.training import Finetuner
from hf_softmax_rnn.training.optim import weight_decay_groups
from tests.training.helpers import tiny_config


def decayed_names(model, groups):
    decayed = {id(p) for group in groups if group["weight_decay"] > 0 for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in decayed}


def test_decays_layer_weights_but_not_biases_norms_or_feature_maps(tiny_models):
    model = convert(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), "linear_hedgehog")
    groups = weight_decay_groups(model, 0.1)
    names = decayed_names(model, groups)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names
    assert not any("norm" in name or "hedgehog" in name or name.endswith("bias") for name in names)
    # the 3-D hedgehog maps are not decayed, although they are matrices
    hedgehog = [name for name, p in model.named_parameters() if "hedgehog" in name]
    assert hedgehog and all(model.get_parameter(name).dim() >= 2 for name in hedgehog)
    assert sum(len(group["params"]) for group in groups) == len(list(model.parameters()))
    assert {group["weight_decay"] for group in groups} == {0.1, 0.0}


def test_gpt2_conv1d_and_lora_matrices_are_decayed_frozen_weights_left_out(tiny_models):
    model = convert(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]), "gated_softmax")
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["rnn_params"]))
    groups = weight_decay_groups(model, 0.5)
    names = decayed_names(model, groups)
    assert any("lora_A" in name for name in names) and any("lora_B" in name for name in names)
    # besides LoRA, only the gate matrices of the trained copy of rnn_params (modules_to_save)
    assert all("lora_" in name or (name.endswith("_gate.weight") and "rnn_params" in name) for name in names)
    assert all(p.requires_grad for group in groups for p in group["params"])
    full = convert(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]), "gated_softmax")
    full_names = decayed_names(full, weight_decay_groups(full, 0.5))
    assert "transformer.h.0.attn.c_attn.weight" in full_names  # transformers' Conv1D
    assert "transformer.h.0.attn.rnn_params.output_gate.weight" in full_names  # gates are linear layers
    assert not any(name.endswith("bias") or "ln_" in name for name in full_names)


def test_rnn_params_take_their_own_learning_rate_and_keep_the_decay_rule(tiny_models):
    model = convert(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), "hedgehog_window_64_sinks_4_decay")
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["rnn_params"]))
    groups = weight_decay_groups(model, 0.1, own_lr=5e-3)
    in_groups = [id(p) for group in groups for p in group["params"]]
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert sorted(in_groups) == sorted(id(p) for p in trainable.values())  # each trainable parameter once
    own = {id(p) for group in groups if group.get("lr") == 5e-3 for p in group["params"]}
    own_names = {name for name, p in trainable.items() if id(p) in own}
    expected = {name for name in trainable if ".rnn_params.modules_to_save." in name}
    assert own_names == expected and any("hedgehog_q" in name for name in own_names)
    assert any("decay_proj.weight" in name for name in own_names)
    assert all("lr" not in group for group in groups if not set(map(id, group["params"])) <= own)
    # the decay rule is the same with or without a learning rate of their own
    assert decayed_names(model, groups) == decayed_names(model, weight_decay_groups(model, 0.1))
    # LoRA's matrices are all decayed; rnn_params holds decayed gate weights and undecayed maps and biases
    assert [(group.get("lr"), group["weight_decay"]) for group in groups] == [(None, 0.1), (5e-3, 0.1), (5e-3, 0.0)]


def test_small_models_and_the_finetuner_use_the_rule(tiny_models, tmp_path, monkeypatch):
    model = small_llama("gated_softmax", vocab_size=40, hidden_size=16, num_heads=2, max_position_embeddings=10)
    optimizer, _ = optimizer_and_schedule(model, lr=1e-3, weight_decay=0.1, warmup_steps=1, steps=10)
    assert decayed_names(model, optimizer.param_groups) == decayed_names(model, weight_decay_groups(model, 0.1))

    made = []
    adamw = torch.optim.AdamW

    def recording_adamw(groups, **kwargs):
        made.append(groups)
        return adamw(groups, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", recording_adamw)
    config = tiny_config(
        tiny_models["llama"],
        tmp_path / "out",
        transfer_steps=0,
        finetune_steps=1,
        finetune_method="full",
        weight_decay=0.2,
    )
    finetuner = Finetuner(config)
    finetuner.run()
    (groups,) = made
    assert {group["weight_decay"] for group in groups} == {0.2, 0.0}
    assert all("name" not in group for group in groups)  # rnn_lr = lr: no groups of their own (checkpoints as before)
    model = finetuner.converted
    names = decayed_names(model, groups)
    assert names == decayed_names(model, weight_decay_groups(model, 0.2))
    # the RMSNorm weight of the converted attention is a matrix [heads, head_dim], and not decayed
    norm = "model.layers.0.self_attn.rnn_params.norm_weight"
    assert model.get_parameter(norm).dim() == 2 and norm not in names


def one_adam_step(tiny_models, tmp_path, **settings):
    """One unclipped LM-loss step of the tiny Llama converted to `linear_hedgehog`, no transfer stage."""
    return tiny_config(
        tiny_models["llama"],
        tmp_path / "out",
        attention="linear_hedgehog",
        transfer_steps=0,
        finetune_steps=1,
        finetune_loss="lm",
        max_grad_norm=0.0,
        **settings,
    )


@pytest.mark.parametrize("rnn_lr", [None, 3e-2], ids=["rnn-lr-as-lr", "rnn-lr-own"])
def test_the_first_adam_step_moves_feature_maps_by_the_rnn_learning_rate(tiny_models, tmp_path, rnn_lr):
    """Adam's first step moves each parameter by its learning rate (times sign of the gradient, up
    to eps), so the largest move of the hedgehog maps is the rnn_params learning rate."""
    config = one_adam_step(tiny_models, tmp_path, lr=1e-3, rnn_lr=rnn_lr)
    assert config.finetune.rnn_lr == (rnn_lr or 1e-3)
    finetuner = Finetuner(config)
    finetuner.run()
    maps = [p for name, p in finetuner.converted.named_parameters() if name.endswith("hedgehog_q")]
    eye = torch.eye(maps[0].shape[1], maps[0].shape[2])
    moved = max((p.detach() - eye).abs().max().item() for p in maps)
    assert moved == pytest.approx(config.finetune.rnn_lr, rel=1e-2)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    (step,) = [row for row in rows if row["stage"] == "finetune" and "loss" in row]
    assert step["lr"] == 1e-3 and step.get("rnn_lr") == rnn_lr  # logged where it differs from lr
    (stage,) = finetuner.stages
    assert ("rnn_params in full at lr 0.03" in stage.trains) == (rnn_lr is not None)
    named = "learning rate (0.001)" if rnn_lr is None else "learning rates (lr 0.001, rnn_lr 0.03)"
    assert stage.learning_rates() == named  # as the divergence message names them


def test_the_rnn_method_trains_rnn_params_alone_at_the_rnn_learning_rate(tiny_models, tmp_path):
    """--finetune-method rnn: one optimizer group at --rnn-lr (--lr names no other parameter), the
    projections untouched."""
    config = one_adam_step(tiny_models, tmp_path, finetune_method="rnn", lr=1e-3, rnn_lr=3e-2)
    finetuner = Finetuner(config)
    before = {name: p.detach().clone() for name, p in finetuner.converted.named_parameters()}
    finetuner.run()
    after = dict(finetuner.converted.named_parameters())
    moved = {name: (after[name].detach() - tensor).abs().max().item() for name, tensor in before.items()}
    assert {name for name, change in moved.items() if change > 0} == {name for name in moved if ".rnn_params." in name}
    assert max(moved[name] for name in moved if name.endswith("hedgehog_q")) == pytest.approx(3e-2, rel=1e-2)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    (step,) = [row for row in rows if row["stage"] == "finetune" and "loss" in row]
    assert step["lr"] == 3e-2 and "rnn_lr" not in step
    (stage,) = finetuner.stages
    assert stage.trains == "rnn_params of the converted layers (LM loss)"
    assert stage.learning_rates() == "learning rate (0.03)"

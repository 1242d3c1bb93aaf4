"""The three training stages of a converted model, and what each one trains.

1. "transfer" (attention transfer): every converted attention layer also computes exact
   softmax attention on the same q, k, v, and the loss is the mean over layers of the MSE
   between the two outputs (optionally plus `transfer_lm_weight` x the LM cross-entropy).
   By default the teacher's output is what each layer passes on (teacher forcing), so every
   layer sees the original model's hidden states and trains only on its own error.
   Only the chosen submodules of the converted layers train (by default their `rnn_params`;
   a spec without learned parameters trains the query/key projections instead).
2. "finetune": LoRA adapters from PEFT on the attention projections, with `rnn_params` as
   fully trained `modules_to_save`; full fine-tuning; or the converted layers' `rnn_params` alone,
   which leaves every exact score as the unconverted model computes it. On the LM loss, or
   distilled from the unconverted model (KL divergence of the next-token distributions, every
   position).
3. "state": the converted layers' `rnn_params` alone (inside the LoRA model when stage 2 made
   one), distilled from the unconverted model on blocks of their own length, longer than the
   exact part of every layer: the finite state learns the positions that the other stages'
   blocks leave to the exact part.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import ModulesToSaveWrapper
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_softmax_rnn.layers import set_attention_transfer, transfer_losses
from hf_softmax_rnn.layers.attention import softmax_rnn_attention_modules
from hf_softmax_rnn.models.llama_like.families import LLAMA_LIKE_FAMILIES
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.distill import distillation_loss
from hf_softmax_rnn.training.optim import weight_decay_groups

logger = logging.getLogger(__name__)

RNN_PARAMS = "rnn_params"
#: Default LoRA targets per model type (suffixes of module names, as PEFT matches them): the attention projections,
#: for each family of Llama's pattern its q/k/v projections (or fused qkv_proj) and o_proj.
LORA_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "softmax_rnn_llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gpt2": ["attn.c_attn", "attn.c_proj"],
    "softmax_rnn_gpt2": ["attn.c_attn", "attn.c_proj"],
    **{
        model_type: [*family.qkv_projections, "o_proj"]
        for family in LLAMA_LIKE_FAMILIES
        for model_type in (family.config_class.model_type, family.model_type)
    },
}
#: Attention-transfer fallback when the converted layers have no learned parameters:
#: the projections that make q and k, per model type (a fused projection makes v too).
QUERY_KEY_PROJECTIONS: dict[str, list[str]] = {
    "softmax_rnn_llama": ["q_proj", "k_proj"],
    "softmax_rnn_gpt2": ["c_attn"],
    **{family.model_type: list(family.qkv_projections[:2]) for family in LLAMA_LIKE_FAMILIES},
}
#: Submodules of an attention layer that its pre-projection output (what attention transfer compares) depends on.
FEED_ATTENTION_OUTPUT = frozenset({RNN_PARAMS, "q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"})
#: Module types LoRA can adapt here (GPT-2's projections are transformers' Conv1D).
_LORA_MODULE_TYPES = (nn.Linear, Conv1D)


def _for_model_type(mapping: dict, model_type: str, what: str):
    if model_type not in mapping:
        raise ValueError(f"No default {what} for model type {model_type!r}; known types are {sorted(mapping)}")
    return mapping[model_type]


def lora_targets(model: nn.Module, targets: list[str] | None) -> list[str]:
    """The LoRA target suffixes (the model type's default when None), each checked to match
    at least one Linear/Conv1D module of `model`."""
    targets = list(targets) if targets else _for_model_type(LORA_TARGETS, model.config.model_type, "LoRA targets")
    adaptable = [name for name, module in model.named_modules() if isinstance(module, _LORA_MODULE_TYPES)]
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in adaptable):
            leaves = sorted({name.rsplit(".", 1)[-1] for name in adaptable})
            raise ValueError(
                f"LoRA target {target!r} matches no Linear/Conv1D module of {type(model).__name__}; "
                f"module names end in {leaves} (a target matches a name or a dotted suffix of it)"
            )
    return targets


def has_rnn_params(model: nn.Module) -> bool:
    """Whether any attention layer has learned parameters of its own (gates, norms, maps)."""
    return any(
        next(module.rnn_params.parameters(), None) is not None for module in softmax_rnn_attention_modules(model)
    )


def transfer_modules(model: nn.Module, names: list[str] | None) -> list[str]:
    """Submodules of each converted attention layer that attention transfer trains, checked.

    None picks `rnn_params` when the layers have learned parameters, else the q/k projections."""
    converted = [module for module in softmax_rnn_attention_modules(model) if module.is_converted]
    if not converted:
        raise ValueError(
            "Attention transfer needs converted layers, but every attention layer is exact softmax; "
            "choose a non-softmax --attention or set --transfer-steps 0"
        )
    if names is None:
        names = (
            [RNN_PARAMS]
            if has_rnn_params(model)
            else _for_model_type(QUERY_KEY_PROJECTIONS, model.config.model_type, "q/k projections")
        )
        logger.info("Attention transfer trains %s of %d converted layers", names, len(converted))
    available = sorted(name for name, _ in converted[0].named_children())
    for name in names:
        if not hasattr(converted[0], name) or not isinstance(getattr(converted[0], name), nn.Module):
            raise ValueError(
                f"--transfer-modules {name!r} is not a submodule of the converted attention layers; they have "
                f"{available}"
            )
    if not any(p.numel() for module in converted for name in names for p in getattr(module, name).parameters()):
        raise ValueError(
            f"--transfer-modules {names} hold no parameters in the converted layers "
            f"({converted[0].attention_spec.describe()}); "
            f"choose from {available}"
        )
    return names


def _freeze_all_but(model: nn.Module, trainable: list[nn.Module]) -> None:
    model.requires_grad_(False)
    for module in trainable:
        module.requires_grad_(True)


def _train_rnn_params_alone(model: nn.Module) -> nn.Module:
    """Freeze `model` but each attention layer's `rnn_params` as its forward uses them: inside a LoRA model, the
    trained copy that PEFT's `modules_to_save` wrapper holds (its original stays frozen)."""
    in_use = [
        params.modules_to_save[params.active_adapter] if isinstance(params, ModulesToSaveWrapper) else params
        for params in (module.rnn_params for module in softmax_rnn_attention_modules(model))
    ]
    _freeze_all_but(model, in_use)
    return model


def set_activation_checkpointing(model: nn.Module, enable: bool) -> None:
    """Recompute each decoder layer of `model` (a transformers model) in the backward pass, non-reentrant, or keep
    its activations."""
    if enable == model.is_activation_checkpointing:
        return
    if enable:
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()


@dataclass
class Stage:
    """One training stage. `trains` says in words what it trains; `setup(model)` returns the
    module to train (freezing or wrapping `model`); `loss(model, unwrapped, input_ids)` returns
    {"loss": scalar, ...parts to log}; `teardown(unwrapped)` undoes what only this stage needs.
    `may_leave_parameters_unused`: some trainable parameter may get no gradient from the loss
    (DDP must then look for unused parameters every step)."""

    name: str
    steps: int
    learning_rate: float
    #: tokens per training block
    block_size: int
    trains: str
    setup: Callable[[nn.Module], nn.Module]
    loss: Callable[[nn.Module, nn.Module, torch.Tensor], dict[str, torch.Tensor]]
    teardown: Callable[[nn.Module], None] = lambda model: None
    #: the flag that sets `block_size`
    block_size_flag: str = "--block-size"
    may_leave_parameters_unused: bool = False
    #: learning rate of the parameters inside the converted layers' `rnn_params` where it differs from
    #: `learning_rate` (None: the same)
    rnn_learning_rate: float | None = None
    #: recompute each decoder layer in the backward pass of this stage, whatever the run's setting for the others
    activation_checkpointing: bool = False

    def parameter_groups(self, trainable: nn.Module, weight_decay: float) -> list[dict]:
        """The optimizer's parameter groups of this stage over `trainable`: weight decay, and the converted
        layers' own learning rate."""
        return weight_decay_groups(trainable, weight_decay, own_lr=self.rnn_learning_rate, own_module=RNN_PARAMS)

    def learning_rates(self) -> str:
        """The stage's learning rate in words, and that of rnn_params where it differs."""
        if self.rnn_learning_rate is None:
            return f"learning rate ({self.learning_rate:g})"
        return f"learning rates (lr {self.learning_rate:g}, rnn_lr {self.rnn_learning_rate:g})"


def _lm_loss(model: nn.Module, unwrapped: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": model(input_ids=input_ids, labels=input_ids, use_cache=False).loss}


def _distill_loss(teacher: nn.Module) -> Callable[[nn.Module, nn.Module, torch.Tensor], dict[str, torch.Tensor]]:
    def loss(model: nn.Module, unwrapped: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=input_ids, use_cache=False).logits
        output = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        kl = distillation_loss(output.logits, teacher_logits)
        return {"loss": kl, "distill_kl": kl, "lm_loss": output.loss.detach()}

    return loss


def transfer_stage(config: FinetuneConfig, modules: list[str]) -> Stage:
    settings = config.transfer

    def setup(model: nn.Module) -> nn.Module:
        converted = [m for m in softmax_rnn_attention_modules(model) if m.is_converted]
        _freeze_all_but(model, [getattr(m, name) for m in converted for name in modules])
        set_attention_transfer(model, True, trained=modules, teacher_forcing=settings.transfer_teacher_forcing)
        return model

    def loss(model: nn.Module, unwrapped: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        weight = settings.transfer_lm_weight
        output = model(input_ids=input_ids, labels=input_ids if weight else None, use_cache=False)
        mse = torch.stack(transfer_losses(unwrapped)).mean()
        if not weight:
            return {"loss": mse, "transfer_mse": mse}
        return {"loss": mse + weight * output.loss, "transfer_mse": mse, "lm_loss": output.loss}

    forcing = ", teacher-forced" if settings.transfer_teacher_forcing else ""
    objective = f"attention-transfer MSE{forcing}" + (
        f" + {settings.transfer_lm_weight:g} x LM loss" if settings.transfer_lm_weight else ""
    )
    trains = f"{', '.join(modules)} of the converted layers ({objective})"
    return Stage(
        "transfer",
        settings.transfer_steps,
        settings.transfer_lr,
        config.data.block_size,
        trains,
        setup,
        loss,
        teardown=lambda model: set_attention_transfer(model, False),
        may_leave_parameters_unused=not settings.transfer_lm_weight and not set(modules) <= FEED_ATTENTION_OUTPUT,
    )


def finetune_stage(
    config: FinetuneConfig, targets: list[str], *, with_rnn_params: bool, teacher: nn.Module | None = None
) -> Stage:
    """The stage-2 `Stage`; `teacher` (the unconverted model, frozen) is needed for `finetune_loss="distill"`."""
    settings = config.finetune
    if settings.finetune_loss == "distill" and teacher is None:
        raise ValueError("finetune_loss='distill' needs the unconverted model as `teacher`")
    only_rnn_params = settings.finetune_method == "rnn"
    if only_rnn_params and not with_rnn_params:
        raise ValueError(
            "--finetune-method rnn trains the converted layers' own parameters (rnn_params), and this attention has "
            "none (no feature map, decay, gate or normaliser weights to learn); use --finetune-method lora or full"
        )
    rnn_lr = settings.rnn_lr if with_rnn_params and settings.rnn_lr != settings.lr and not only_rnn_params else None
    at_rnn_lr = "" if rnn_lr is None else f" at lr {rnn_lr:g}"

    def setup_lora(model: nn.Module) -> PeftModel:
        model.requires_grad_(False)
        lora = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=targets,
            modules_to_save=[RNN_PARAMS] if with_rnn_params else None,
            fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
            task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            return get_peft_model(model, lora)

    def setup_full(model: nn.Module) -> nn.Module:
        return model.requires_grad_(True)

    def lora_words() -> str:  # LoRA settings are None in a full fine-tuning run
        in_full = f", rnn_params in full{at_rnn_lr}" if with_rnn_params else ""
        return f"LoRA r={settings.lora_rank}, alpha={settings.lora_alpha:g} on {', '.join(targets)}{in_full}"

    setups = {"lora": setup_lora, "full": setup_full, "rnn": _train_rnn_params_alone}
    losses = {"lm": ("LM loss", _lm_loss), "distill": ("KL to the unconverted model's logits", None)}
    words, loss = losses[settings.finetune_loss]
    full_words = f"all parameters{'' if rnn_lr is None else f', rnn_params{at_rnn_lr}'}"
    method_words = {"lora": lora_words, "full": lambda: full_words, "rnn": lambda: "rnn_params of the converted layers"}
    trains = f"{method_words[settings.finetune_method]()} ({words})"
    return Stage(
        "finetune",
        settings.finetune_steps,
        settings.rnn_lr if only_rnn_params else settings.lr,
        config.data.block_size,
        trains,
        setups[settings.finetune_method],
        loss or _distill_loss(teacher),
        rnn_learning_rate=rnn_lr,
    )


def state_stage(config: FinetuneConfig, *, with_rnn_params: bool, teacher: nn.Module | None) -> Stage:
    """The stage-3 `Stage`: `rnn_params` alone on `config.state.state_block_size`-token blocks, distilled from
    `teacher`."""
    settings = config.state
    if teacher is None:
        raise ValueError("The state stage distils from the unconverted model: pass it as `teacher`")
    if not with_rnn_params:
        raise ValueError(
            f"--state-steps {settings.state_steps} trains the converted layers' own parameters (rnn_params), and this "
            "attention has none (no feature map, decay, gate or normaliser weights to learn); set --state-steps 0"
        )

    trains = (
        f"rnn_params of the converted layers on {settings.state_block_size:,}-token blocks (KL to the unconverted "
        "model's logits)"
    )
    return Stage(
        "state",
        settings.state_steps,
        settings.state_lr,
        settings.state_block_size,
        trains,
        _train_rnn_params_alone,
        _distill_loss(teacher),
        block_size_flag="--state-block-size",
        activation_checkpointing=settings.state_gradient_checkpointing,
    )


def build_stages(
    config: FinetuneConfig, model: nn.Module, *, lora_target_names: list[str] | None, teacher: nn.Module | None = None
) -> list[Stage]:
    """The stages of this run in order (a stage with 0 steps is left out); `teacher` (the unconverted model,
    frozen) is needed for distillation (`config.needs_teacher`)."""
    with_rnn_params = has_rnn_params(model)
    builders = {
        "transfer": lambda: transfer_stage(config, transfer_modules(model, config.transfer.transfer_modules)),
        "finetune": lambda: finetune_stage(
            config, lora_target_names or [], with_rnn_params=with_rnn_params, teacher=teacher
        ),
        "state": lambda: state_stage(config, with_rnn_params=with_rnn_params, teacher=teacher),
    }
    return [builders[name]() for name in config.stage_names]


@torch.no_grad()
def heldout_layer_mse(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> list[float]:
    """Attention-transfer MSE of each converted layer on `blocks` `[N, L]`, teacher-forced (each
    layer sees the original hidden states), averaged over the blocks. The teacher is whatever the
    layers hold now (a frozen copy of the projections while a transfer stage trains them)."""
    converted = [module for module in softmax_rnn_attention_modules(model) if module.is_converted]
    saved = [(module.attention_transfer, module.teacher_forcing) for module in converted]
    was_training = model.training
    model.eval()
    for module in converted:
        module.attention_transfer, module.teacher_forcing = True, True
    totals = torch.zeros(len(converted), dtype=torch.float64)
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size].to(next(model.parameters()).device)
        model(input_ids=ids, use_cache=False)
        totals += torch.stack([module.transfer_loss for module in converted]).double().cpu() * len(ids)
    for module, (transfer, forcing) in zip(converted, saved, strict=True):
        module.attention_transfer, module.teacher_forcing, module.transfer_loss = transfer, forcing, None
    model.train(was_training)
    return (totals / len(blocks)).tolist()

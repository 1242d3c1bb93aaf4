"""The settings of a run checked against its model: against the model's config, before its weights and the
data load (`fit_to_model_config`), and against the converted model (`fit_state_stage`). Each returns the
config fitted to the model (the recipe's blocks cut to its positions, the recipe's state stage left out where
it would train nothing) as a new `FinetuneConfig`, or refuses a setting the model cannot take."""

from __future__ import annotations

import logging

import psutil
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedConfig

from hf_softmax_rnn.convert import check_convertible, converted_layers, converted_model_type
from hf_softmax_rnn.default_model import resolve_config
from hf_softmax_rnn.errors import UserInputError, user_input_checks
from hf_softmax_rnn.layers import softmax_rnn_attention_modules
from hf_softmax_rnn.long_context.extend import extended_max_positions
from hf_softmax_rnn.long_context.retrieval import check_retrieval_count
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.stages import lora_targets

logger = logging.getLogger(__name__)

#: Config entries in which a converted --model must equal its --teacher.
_SHAPE_SETTINGS = ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
#: Bytes of one logit under each `--mixed-precision`: a forward pass holds at least one per token and vocabulary entry.
_LOGIT_BYTES = {"no": 4, "bf16": 2, "fp16": 2}


def device_memory(device: torch.device) -> int:
    """Bytes of memory of `device`: a GPU's own, else the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def _architecture(config: PreTrainedConfig) -> str:
    """The model class a config names (its first architecture), else the config's class."""
    return (config.architectures or [type(config).__name__])[0]


def fit_to_model_config(config: FinetuneConfig, model_config: PreTrainedConfig, device: torch.device) -> FinetuneConfig:
    """`config` fitted to the unconverted model's config `model_config`, read alone (before its weights and the
    data load). Refused: a model type `convert` does not take, layers or a retrieval-layer count beyond its
    layers, LoRA targets that match none of its modules (built on the meta device, without weights), an
    `--extend-context` it cannot take, blocks the user asked for longer than its positions (extended, with
    `--extend-context`), batches whose logits need more than the memory of `device`; a converted --model that
    is no conversion of a model shaped as --teacher."""
    model, num_layers = config.model, model_config.num_hidden_layers
    with user_input_checks(ValueError, TypeError):
        check_convertible(model_config)
        if model.layers is not None:
            converted_layers(model.layers, num_layers)
        if config.finetune.finetune_steps and config.finetune.finetune_method == "lora":
            with torch.device("meta"):  # the modules without their weights
                lora_targets(AutoModelForCausalLM.from_config(model_config), config.finetune.lora_targets)
    if model.continues_converted:
        _check_teacher(config, resolve_config(model.model), model_config)
    if "retrieval_layers" not in config.chosen:
        check_retrieval_count(model.retrieval_layers, num_layers)
    maximum = getattr(model_config, "max_position_embeddings", None)
    if model.extend_context is not None:
        maximum = extended_max_positions(model_config, model.extend_context)
    fitted = config.fitted_to_positions(maximum)
    _check_batch_memory(fitted, model_config.vocab_size, device)
    return fitted


def _check_teacher(config: FinetuneConfig, converted: PreTrainedConfig, teacher: PreTrainedConfig) -> None:
    """A converted --model must be a conversion of a model shaped as --teacher: the same family, layers,
    heads and vocabulary (from the two configs)."""
    shape = {name: getattr(converted, name, None) for name in _SHAPE_SETTINGS}
    expected = {name: getattr(teacher, name, None) for name in _SHAPE_SETTINGS}
    if converted.model_type != converted_model_type(teacher) or shape != expected:
        raise UserInputError(
            f"--model {config.model.model!r} ({_architecture(converted)}, {shape}) is not a conversion of --teacher "
            f"{config.model.teacher!r} ({_architecture(teacher)}, {expected}); pass the model it was converted from"
        )


def _check_batch_memory(config: FinetuneConfig, vocab_size: int, device: torch.device) -> None:
    """A batch whose logits alone (blocks x tokens x vocabulary entries) need more than the device's memory
    cannot run: refused from the config, before the weights and the data load."""
    data, memory = config.data, device_memory(device)
    training_block = max([data.block_size] + ([config.state.state_block_size] if config.state.state_steps else []))
    per_logit = _LOGIT_BYTES[config.optim.mixed_precision]
    batches = {"batch_size": training_block, "eval_batch_size": data.heldout_block_size}
    for name, block in batches.items():
        blocks, per_block = getattr(data, name), block * vocab_size * per_logit
        if blocks * per_block > memory:
            raise UserInputError(
                f"--{name.replace('_', '-')} {blocks} needs at least {blocks * per_block:,} bytes for the logits "
                f"of one batch ({blocks} blocks x {block} tokens x {vocab_size} vocabulary entries x {per_logit} "
                f"bytes), more than the {memory:,} bytes of {device.type}; use "
                f"--{name.replace('_', '-')} <= {max(memory // per_block, 1)}"
            )


def exact_positions_of_finite_states(model: nn.Module) -> dict[int, int]:
    """{layer index: positions its exact part scores (window, sinks, kept)} of each converted layer of `model`
    with a finite state: a training block must be longer for that state to be read."""
    return {
        module.layer_idx: module.attention_spec.exact_positions
        for module in softmax_rnn_attention_modules(model)
        if module.is_converted and module.attention_spec.has_finite_state
    }


def fit_state_stage(config: FinetuneConfig, converted: nn.Module) -> FinetuneConfig:
    """`config` fitted to the `converted` model: a state stage whose blocks fit in the exact part of every
    converted layer with a finite state would train nothing, so the recipe's is left out with a warning, and
    one the user asked for is refused."""
    exact = exact_positions_of_finite_states(converted).values()
    block = config.state.state_block_size
    if not (config.state.state_steps and exact and block <= min(exact)):
        return config
    reason = (
        f"a {block}-token block fits in the exact part of every converted layer (window, sinks and kept positions: "
        f"at least {min(exact)}), so no finite state would get any training"
    )
    if "state_steps" not in config.chosen:
        raise UserInputError(
            f"--state-block-size {block} is not allowed: {reason}; use more than {min(exact)} tokens, or "
            "--state-steps 0"
        )
    logger.warning("No state stage: %s", reason)
    if not (config.transfer.transfer_steps or config.finetune.finetune_steps):
        raise UserInputError(
            f"Nothing to train: the recipe's state stage is left out ({reason}) and --transfer-steps and "
            "--finetune-steps are 0; set one of them > 0"
        )
    return config.without_state_stage(reason)


def log_untrained_states(converted: nn.Module, block: int) -> None:
    """Name the converted layers whose exact part holds every key of a `block`-token training block: their finite
    state stays empty in training, so the parameters that only it uses (feature maps, decay) keep their values."""
    layers = {layer: exact for layer, exact in exact_positions_of_finite_states(converted).items() if exact >= block}
    if layers:
        logger.info(
            "Layers %s score every key of a %d-token training block exactly (window, sinks and kept positions: "
            "%s): their finite state gets no training; blocks longer than %d tokens train it",
            sorted(layers),
            block,
            " / ".join(map(str, sorted(set(layers.values())))),
            min(layers.values()),
        )

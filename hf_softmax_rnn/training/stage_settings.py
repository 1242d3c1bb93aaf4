"""How a fine-tuning run trains: its three stages (`TransferSettings`, `FinetuneSettings`, `StateSettings`)
and what every stage shares (`OptimSettings`).

Each group checks its own fields when it is built; a field left None is chosen by `FinetuneConfig`
(the attention's recipe), which also checks the stages against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import SHOWN_DEFAULT, option
from hf_softmax_rnn.training.optim import WEIGHT_DECAY_HELP
from hf_softmax_rnn.training.recipes import FROM_RECIPE, STATE_BLOCK_SIZE, WIDE_WINDOW
from hf_softmax_rnn.training.validation import (
    check_at_least,
    check_block_size,
    check_choice,
    check_field_types,
    check_positive,
    check_texts,
    flag_of,
)

_TRANSFER, _FINETUNE = "stage 1: attention transfer", "stage 2: language-model fine-tuning"
_STATE, _OPTIM = "stage 3: the finite state on long blocks", "optimisation"
FINETUNE_METHODS = ("lora", "full", "rnn")
#: Stage-2 objectives: next-token cross-entropy, or KL divergence to the unconverted model's logits.
FINETUNE_LOSSES = ("lm", "distill")
LR_SCHEDULERS = ("cosine", "linear", "constant_with_warmup")
MIXED_PRECISION = ("no", "fp16", "bf16")
#: The LoRA settings, with their values when --finetune-method lora is not given them; a full fine-tuning run,
#: which they do not apply to, refuses them and leaves them None.
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": None}
#: The settings of the transfer stage beside its step count and learning rate, which act only where it trains.
TRANSFER_SETTINGS = ("transfer_modules", "transfer_lm_weight", "transfer_teacher_forcing")
#: The settings of the state stage beside its step count, compared on --resume only where both runs train it.
STATE_SETTINGS = ("state_block_size", "state_lr")
#: Every setting of the state stage beside its step count, which acts only where it trains.
STATE_STAGE_SETTINGS = (*STATE_SETTINGS, "state_gradient_checkpointing")


@dataclass(frozen=True)
class TransferSettings:
    """Stage 1, attention transfer: the converted layers learn to give the softmax layers' outputs."""

    transfer_steps: int | None = option(None, "optimizer steps (0 skips the stage)", group=_TRANSFER, **FROM_RECIPE)
    transfer_lr: float | None = option(None, "peak learning rate", group=_TRANSFER, **FROM_RECIPE)
    transfer_lm_weight: float = option(0.0, "weight of the LM loss added to the transfer MSE", group=_TRANSFER)
    transfer_modules: list[str] | None = option(
        None,
        "submodules of the converted attention layers to train (when not given: rnn_params, or the q/k projections "
        "if the spec has no learned parameters)",
        group=_TRANSFER,
    )
    transfer_teacher_forcing: bool = option(
        True,
        "let each converted layer pass its own output on while transferring (default: the exact softmax output goes "
        "on, so every layer sees the original model's hidden states)",
        flag="--no-transfer-teacher-forcing",
        group=_TRANSFER,
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        if self.transfer_steps is not None:
            check_at_least("transfer_steps", self.transfer_steps, minimum=0)
        if self.transfer_lr is not None:
            check_positive("transfer_lr", self.transfer_lr)
        check_at_least("transfer_lm_weight", self.transfer_lm_weight, minimum=0)


@dataclass(frozen=True)
class FinetuneSettings:
    """Stage 2, language-model fine-tuning: LoRA, all parameters or the converted layers' own."""

    finetune_steps: int | None = option(None, "optimizer steps (0 skips the stage)", group=_FINETUNE, **FROM_RECIPE)
    finetune_method: str = option(
        "lora",
        "LoRA adapters (with rnn_params in full), all parameters, or rnn_params alone (the converted layers' own: "
        "feature maps, decay, gates; at --rnn-lr): the projections stay as converted, so the exact parts of a "
        "hybrid (window, sinks, kept positions) score as the unconverted model does",
        choices=FINETUNE_METHODS,
        group=_FINETUNE,
    )
    finetune_loss: str | None = option(
        None,
        "next-token cross-entropy, or KL divergence to the unconverted model's logits (distillation)",
        choices=FINETUNE_LOSSES,
        group=_FINETUNE,
        **FROM_RECIPE,
    )
    lr: float | None = option(None, "peak learning rate", group=_FINETUNE, **FROM_RECIPE)
    rnn_lr: float | None = option(
        None,
        "peak learning rate of the converted layers' own parameters (rnn_params: feature maps, decay, gates, "
        "normaliser weights), trained in full beside the LoRA adapters or the other weights; with --finetune-method "
        "rnn, the stage's one learning rate",
        group=_FINETUNE,
        **{SHOWN_DEFAULT: "--lr"},
    )
    lora_rank: int | None = option(None, "LoRA rank r", group=_FINETUNE, **{SHOWN_DEFAULT: LORA_DEFAULTS["lora_rank"]})
    lora_alpha: float | None = option(
        None, "LoRA alpha (scale alpha / r)", group=_FINETUNE, **{SHOWN_DEFAULT: LORA_DEFAULTS["lora_alpha"]}
    )
    lora_dropout: float | None = option(
        None, "dropout on the LoRA input", group=_FINETUNE, **{SHOWN_DEFAULT: LORA_DEFAULTS["lora_dropout"]}
    )
    lora_targets: list[str] | None = option(
        None, "module name suffixes (the attention projections when not given)", group=_FINETUNE
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        if self.finetune_steps is not None:
            check_at_least("finetune_steps", self.finetune_steps, minimum=0)
        check_choice("finetune_method", self.finetune_method, FINETUNE_METHODS)
        self._check_lora()
        if self.finetune_loss is not None:
            check_choice("finetune_loss", self.finetune_loss, FINETUNE_LOSSES)
        for name in ("lr", "rnn_lr"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))

    def _check_lora(self) -> None:
        """The LoRA settings given: with --finetune-method lora, checked; with the other methods, which they do not
        apply to, refused."""
        if self.finetune_method != "lora":
            given = [name for name in LORA_DEFAULTS if getattr(self, name) is not None]
            if given:
                flag = flag_of(given[0])
                raise UserInputError(
                    f"{flag} {getattr(self, given[0])!r} contradicts --finetune-method {self.finetune_method} "
                    f"(LoRA settings apply to --finetune-method lora only); drop {flag} or use --finetune-method lora"
                )
            return
        if self.lora_rank is not None:
            check_at_least("lora_rank", self.lora_rank)
        if self.lora_alpha is not None:
            check_positive("lora_alpha", self.lora_alpha)
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise UserInputError(f"lora_dropout={self.lora_dropout!r} is not allowed; expected a number in [0, 1)")


@dataclass(frozen=True)
class StateSettings:
    """Stage 3: the converted layers' own parameters alone, distilled on blocks past their exact part."""

    state_steps: int | None = option(
        None,
        "optimizer steps that train only the converted layers' own parameters (rnn_params: feature maps, decay, "
        "gates), distilled from the unconverted model on --state-block-size blocks, after the other stages: the "
        "finite state of each layer learns the positions past its exact part, and every exact score stays as it was "
        "(0 skips the stage; recipe: 10 for a spec with kept positions and a window of "
        f"{WIDE_WINDOW} or more, else 0)",
        group=_STATE,
        **FROM_RECIPE,
    )
    state_block_size: int | None = option(
        None,
        "tokens per training block of the stage: more than a layer's exact part (window, sinks and kept positions), "
        "past which its finite state is read",
        group=_STATE,
        **{SHOWN_DEFAULT: f"{STATE_BLOCK_SIZE}, cut to the model's positions"},
    )
    state_lr: float = option(1e-2, "peak learning rate", group=_STATE)
    state_gradient_checkpointing: bool = option(
        True,
        "keep every activation of this stage for its backward pass (default: recompute each decoder layer there, as "
        "--gradient-checkpointing does in every stage: the same gradients in about a third of the memory of its long "
        "blocks)",
        flag="--no-state-gradient-checkpointing",
        group=_STATE,
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        if self.state_steps is not None:
            check_at_least("state_steps", self.state_steps, minimum=0)
        check_block_size("state_block_size", self.state_block_size)
        check_positive("state_lr", self.state_lr)


@dataclass(frozen=True)
class OptimSettings:
    """What every stage shares: the schedule, regularisation, precision, seed and device."""

    lr_scheduler: str = option("cosine", "learning-rate schedule of each stage", choices=LR_SCHEDULERS, group=_OPTIM)
    warmup_steps: int = option(0, "warm-up steps of each stage", group=_OPTIM)
    weight_decay: float = option(0.0, WEIGHT_DECAY_HELP, group=_OPTIM)
    max_grad_norm: float | None = option(1.0, "gradient clipping (0: none)", group=_OPTIM)
    mixed_precision: str = option("no", "autocast dtype", choices=MIXED_PRECISION, group=_OPTIM)
    seed: int = option(0, "seed of data order and initialisation", group=_OPTIM)
    cpu: bool = option(False, "train on CPU even where a GPU is available", group=_OPTIM)
    gradient_checkpointing: bool = option(
        False,
        "keep only each decoder layer's input for the backward pass and recompute the layer there, in every stage: "
        "the same gradients in less memory, at the cost of a second forward pass",
        group=_OPTIM,
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        if not 0 <= self.seed < 2**32:
            raise UserInputError(f"seed={self.seed} is not allowed; expected an int from 0 to 2**32 - 1")
        check_at_least("warmup_steps", self.warmup_steps, minimum=0)
        check_at_least("weight_decay", self.weight_decay, minimum=0)
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise UserInputError(
                f"max_grad_norm={self.max_grad_norm!r} is not allowed; expected a number >= 0 (0: no clipping)"
            )

    def check_device(self, device_type: str) -> None:
        """Refuse settings the training device cannot honour (Accelerate ignores fp16 on CPU without a word)."""
        if self.mixed_precision == "fp16" and device_type == "cpu":
            raise UserInputError(
                f"mixed_precision='fp16' is not allowed on {device_type}; expected 'bf16' or 'no' (fp16 needs a GPU)"
            )

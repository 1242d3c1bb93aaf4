"""Every setting of a fine-tuning run, validated in one place.

`FinetuneConfig` is what the `hf-softmax-rnn finetune` command builds from its arguments and
what `finetune()` reads; it is saved in the outputs (`results.json`) and inside
each checkpoint, so that `--resume` can refuse a run whose settings would change the result.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_softmax_rnn.attention_spec import AttentionSpec

#: The paper's headline replacement of the softmax denominator.
DEFAULT_ATTENTION = "gated_softmax_no_gate_L2norm_nodivS_noclamp"
FINETUNE_METHODS = ("lora", "full")
LR_SCHEDULERS = ("cosine", "linear", "constant_with_warmup")
MIXED_PRECISION = ("no", "fp16", "bf16")

#: Fields that may change between a run and its `--resume` without changing the trained weights.
RESUMABLE_CHANGES = frozenset(
    {"resume", "output_dir", "eval_every", "save_every", "save_total_limit", "progress", "push_to_hub", "hub_private"}
)


def parse_attention(value: str | dict | AttentionSpec) -> AttentionSpec:
    """An `AttentionSpec` from a preset name, a JSON object of spec fields, or a path to a JSON file."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"--attention {value!r} is not valid JSON: {error}") from error
    elif isinstance(value, str) and value.endswith(".json"):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"--attention file {value!r} does not exist")
        value = json.loads(path.read_text())
    return AttentionSpec.coerce(value)


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; expected one of {list(allowed)}")


def _check_at_least(name: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed; expected a number >= {minimum}")


@dataclass
class FinetuneConfig:
    """Settings of one fine-tuning run (see `hf-softmax-rnn finetune --help` for each one)."""

    output_dir: str
    model: str = "default"
    attention: str | dict = DEFAULT_ATTENTION
    layers: list[int] | None = None

    dataset: str = "pydoc"
    dataset_config: str | None = None
    text_column: str = "text"
    streaming: bool = False
    test_fraction: float = 0.1
    block_size: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    eval_batch_size: int = 8
    max_eval_blocks: int | None = None
    shuffle_buffer: int = 10_000

    transfer_steps: int = 100
    transfer_lr: float = 1e-3
    transfer_lm_weight: float = 0.0
    transfer_modules: list[str] | None = None

    finetune_steps: int = 200
    finetune_method: str = "lora"
    lr: float = 2e-4
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None

    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0

    eval_every: int = 50
    save_every: int = 50
    save_total_limit: int = 2
    seed: int = 0
    resume: bool = False
    mixed_precision: str = "no"
    cpu: bool = False
    progress: bool = True
    push_to_hub: str | None = None
    hub_private: bool = False

    def __post_init__(self) -> None:
        self.attention_spec = parse_attention(self.attention)
        _check_choice("finetune_method", self.finetune_method, FINETUNE_METHODS)
        _check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        for name in (
            "batch_size",
            "grad_accum",
            "eval_batch_size",
            "eval_every",
            "save_every",
            "save_total_limit",
            "lora_rank",
        ):
            _check_at_least(name, getattr(self, name))
        for name in ("transfer_steps", "finetune_steps", "warmup_steps"):
            _check_at_least(name, getattr(self, name), minimum=0)
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} is not allowed; expected an int >= 2")
        if self.max_eval_blocks is not None:
            _check_at_least("max_eval_blocks", self.max_eval_blocks)
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction} is not allowed; expected a number in (0, 1)")
        if self.transfer_lm_weight < 0:
            raise ValueError(f"transfer_lm_weight={self.transfer_lm_weight} is not allowed; expected a number >= 0")
        if self.transfer_steps + self.finetune_steps == 0:
            raise ValueError("transfer_steps and finetune_steps are both 0: nothing to train; set at least one > 0")
        if self.layers is not None and any(index < 0 for index in self.layers):
            raise ValueError(f"layers={self.layers} is not allowed; expected layer indices >= 0")

    @property
    def stage_names(self) -> list[str]:
        """The stages this run trains, in order ("transfer", "finetune")."""
        return [name for name, steps in (("transfer", self.transfer_steps), ("finetune", self.finetune_steps)) if steps]

    def to_dict(self) -> dict[str, Any]:
        """The constructor arguments (JSON-serialisable)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_namespace(cls, namespace: Any) -> FinetuneConfig:
        """Build from an argparse namespace whose destinations are the field names."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(namespace).items() if name in names})

    def resume_conflicts(self, saved: dict[str, Any]) -> list[str]:
        """Settings that differ from a checkpoint's and would change the trained weights."""
        current = self.to_dict()
        return [
            f"{name}: checkpoint {saved.get(name)!r}, now {current[name]!r}"
            for name in sorted(current)
            if name not in RESUMABLE_CHANGES and json.loads(json.dumps(current[name])) != saved.get(name)
        ]

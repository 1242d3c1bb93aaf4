"""Every setting of a fine-tuning run: `FinetuneConfig`, one group of settings per section of
`hf-softmax-rnn finetune --help` (`input_settings`, `stage_settings`, `output_settings`).

Each flag is the field of the same name in one group; `FinetuneConfig.from_flags(lr=..., ...)` builds a config
from flags by name, as the command does. Each group checks its own fields; the config fills the flags left
unset (the attention's recipe, a converted --model) and checks the groups against each other, once, when it
is built. It never changes afterwards: the settings fitted to a model are a new config (`fitted_to_positions`,
`without_state_stage`). The outputs (`results.json`) and each checkpoint record it as one entry per flag
(`to_dict`), so that `--resume` can refuse a run whose settings would change the result (`resume_policy`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import flag_group, option, option_fields
from hf_softmax_rnn.long_context.retrieval import check_retrieval_budget
from hf_softmax_rnn.training.attention_source import converted_attention
from hf_softmax_rnn.training.input_settings import DataSettings, ModelSettings
from hf_softmax_rnn.training.output_settings import HubSettings, LongEvalSettings, OutputSettings
from hf_softmax_rnn.training.recipes import (
    DEFAULT_ATTENTION,
    HELDOUT_BLOCK_SIZE,
    RETRIEVAL_KEPT,
    STATE_BLOCK_SIZE,
    recipe_defaults,
)
from hf_softmax_rnn.training.resume_policy import resume_conflicts
from hf_softmax_rnn.training.stage_settings import (
    LORA_DEFAULTS,
    STATE_STAGE_SETTINGS,
    TRANSFER_SETTINGS,
    FinetuneSettings,
    OptimSettings,
    StateSettings,
    TransferSettings,
)
from hf_softmax_rnn.training.validation import check_field_types, check_texts, field_default, flag_of, refuse_unused

logger = logging.getLogger(__name__)

#: The groups of settings of a `FinetuneConfig`, by field name, in the order of `--help`.
GROUPS = {
    "model": ModelSettings,
    "data": DataSettings,
    "transfer": TransferSettings,
    "finetune": FinetuneSettings,
    "state": StateSettings,
    "optim": OptimSettings,
    "output": OutputSettings,
    "evaluation": LongEvalSettings,
    "hub": HubSettings,
}
#: The group of each flag (but `output_dir`, a field of the config itself).
GROUP_OF = {field.name: group for group, settings in GROUPS.items() for field in option_fields(settings)}
#: The settings of a conversion, which a run that continues an already converted --model takes from it.
CONVERSION_SETTINGS = ("attention", "layers", "retrieval_layers", "retrieval_kept", "extend_context")


@dataclass(frozen=True)
class FinetuneConfig:
    """Settings of one fine-tuning run: the output folder and one group of settings per `--help` section, each
    field of a group the `hf-softmax-rnn finetune` flag of the same name (`from_flags` builds from flags).

    `chosen` names the flags left unset whose values the config chose (from the attention's recipe or a
    converted --model, or as the flag's help says); `state_left_out` is why the model leaves out the state stage
    that the recipe chose (`without_state_stage`)."""

    output_dir: str = option(help="folder for the model, adapter, metrics, card and checkpoints")
    model: ModelSettings = flag_group(ModelSettings)
    data: DataSettings = flag_group(DataSettings)
    transfer: TransferSettings = flag_group(TransferSettings)
    finetune: FinetuneSettings = flag_group(FinetuneSettings)
    state: StateSettings = flag_group(StateSettings)
    optim: OptimSettings = flag_group(OptimSettings)
    output: OutputSettings = flag_group(OutputSettings)
    evaluation: LongEvalSettings = flag_group(LongEvalSettings)
    hub: HubSettings = flag_group(HubSettings)
    chosen: frozenset[str] = frozenset()
    state_left_out: str | None = None

    def __post_init__(self) -> None:
        """Fill the flags left unset (the attention of a converted --model or the default one, then the attention's
        recipe, then the flags derived from others), then check the groups together."""
        check_field_types(self)
        check_texts(self)
        self._choose(self._conversion_values())
        self._choose(recipe_defaults(self.model.attention_spec) | {"state_block_size": STATE_BLOCK_SIZE})
        self._choose(self._derived_values())
        self._check_groups_together()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_flags(cls, **flags: Any) -> FinetuneConfig:
        """Build from `hf-softmax-rnn finetune` flags by field name (`output_dir="out", lr=1e-3`); a flag left
        out keeps its default."""
        unknown = sorted(set(flags) - set(GROUP_OF) - {"output_dir"})
        if unknown:
            raise TypeError(f"FinetuneConfig has no flag {unknown[0]!r}")
        groups = {
            group: settings(**{name: value for name, value in flags.items() if GROUP_OF.get(name) == group})
            for group, settings in GROUPS.items()
        }
        return cls(**{name: flags[name] for name in flags if name == "output_dir"}, **groups)

    @classmethod
    def from_namespace(cls, namespace: Any) -> FinetuneConfig:
        """Build from an argparse namespace whose destinations are the flags' field names."""
        names = {field.name for field in option_fields(cls)}
        return cls.from_flags(**{name: value for name, value in vars(namespace).items() if name in names})

    def with_flags(self, **changes: Any) -> FinetuneConfig:
        """The config of the flags this one was given, `changes` replacing some (the flags it chose are chosen
        again, for the new values)."""
        given = {name: value for name, value in self.to_dict().items() if name not in self.chosen}
        return self.from_flags(**given | changes)

    def to_dict(self) -> dict[str, Any]:
        """Every flag by field name (JSON-serialisable), in the order of `--help`: the layout of results.json's
        "config" and of each checkpoint's record, one entry per flag."""
        return {"output_dir": self.output_dir} | {name: self.flag(name) for name in GROUP_OF}

    def flag(self, name: str) -> Any:
        """The value of flag `name`, from its group."""
        return self.output_dir if name == "output_dir" else getattr(getattr(self, GROUP_OF[name]), name)

    def _replaced(self, flags: dict[str, Any], **fields: Any) -> FinetuneConfig:
        """A new config with these flags and fields of the config itself."""
        for group, changes in _by_group(flags).items():
            fields[group] = dataclasses.replace(getattr(self, group), **changes)
        return dataclasses.replace(self, **fields)

    def _choose(self, values: dict[str, Any]) -> None:
        """Give the flags of `values` that are unset their value, and name them in `chosen` (while the config is
        built: it is frozen after)."""
        values = {name: value for name, value in values.items() if self.flag(name) is None and value is not None}
        for group, changes in _by_group(values).items():
            object.__setattr__(self, group, dataclasses.replace(getattr(self, group), **changes))
        object.__setattr__(self, "chosen", self.chosen.union(values))

    def _conversion_values(self) -> dict[str, Any]:
        """A converted --model (a local folder) keeps the attention of its config: the conversion settings must
        be unset, --teacher set, and the attention (so the recipe) comes from the model, with no new retrieval
        layers (its layers keep theirs). An unconverted --model is its own teacher, converted to --attention."""
        model = self.model
        attention = converted_attention(model.model)
        defaults = {"attention": DEFAULT_ATTENTION, "retrieval_kept": RETRIEVAL_KEPT}
        if attention is None:
            if model.teacher is not None:
                raise UserInputError(
                    f"--teacher {model.teacher!r} applies to a --model folder that holds a converted model; --model "
                    f"{model.model!r} is none (an unconverted model is converted here and is its own teacher: drop "
                    "--teacher; a converted model on the Hub: download it into a folder and pass that)"
                )
            return defaults
        given = [name for name in CONVERSION_SETTINGS if getattr(model, name) is not None and name not in self.chosen]
        if given:
            raise UserInputError(
                f"{flag_of(given[0])} {getattr(model, given[0])!r} contradicts --model {model.model!r}, which is "
                f"converted already (its attention is in its config.json and stays); drop {flag_of(given[0])}, or "
                "convert the original model"
            )
        if model.teacher is None:
            raise UserInputError(
                f"--model {model.model!r} is converted already: pass --teacher, the unconverted model it was "
                f"converted from ({DEFAULT_MODEL_ALIAS!r} for the embedded model), to distil from and compare with"
            )
        try:
            AttentionSpec.coerce(attention)
        except (TypeError, ValueError) as error:
            raise UserInputError(f"Model {model.model!r}: its model could not be loaded ({error})") from error
        return defaults | {"attention": attention, "retrieval_layers": 0}

    def _derived_values(self) -> dict[str, Any]:
        """The flags whose help derives them from others: --rnn-lr is --lr; the held-out blocks of the recipe's
        training blocks are at most `HELDOUT_BLOCK_SIZE`; LoRA's settings of --finetune-method lora."""
        values = {"rnn_lr": self.finetune.lr}
        if "block_size" in self.chosen:
            values["eval_block_size"] = min(self.data.block_size, HELDOUT_BLOCK_SIZE)
        if self.finetune.finetune_method == "lora":
            values |= LORA_DEFAULTS
        return values

    # ------------------------------------------------------------------ checks of several groups
    def _check_groups_together(self) -> None:
        if not self.stage_names:
            raise UserInputError(
                "transfer_steps, finetune_steps and state_steps are all 0: nothing to train; set at least one > 0"
            )
        if self.model.retrieval_layers:
            check_retrieval_budget(self.model.attention_spec, self.model.retrieval_kept)
        self._check_warmup()
        refuse_unused(
            self.model,
            ("retrieval_kept",),
            acts_with="retrieval layers (--retrieval-layers is 0)",
            present=bool(self.model.retrieval_layers),
            defaults={"retrieval_kept": RETRIEVAL_KEPT},
        )
        refuse_unused(
            self.transfer,
            TRANSFER_SETTINGS,
            acts_with="a transfer stage (--transfer-steps is 0)",
            present=bool(self.transfer.transfer_steps),
        )
        # the settings of a state stage the model leaves out acted on the run that was asked for
        refuse_unused(
            self.state,
            STATE_STAGE_SETTINGS,
            acts_with="a state stage (--state-steps is 0)",
            present=bool(self.state.state_steps) or self.state_left_out is not None,
            defaults={"state_block_size": STATE_BLOCK_SIZE},
        )

    def _check_warmup(self) -> None:
        """A warm-up longer than a stage would keep its learning rate from its peak."""
        trained = {name: self.flag(f"{name}_steps") for name in self.stage_names}
        shortest = min(trained, key=trained.get)
        warmup = self.optim.warmup_steps
        if warmup > trained[shortest]:
            raise UserInputError(
                f"--warmup-steps {warmup} is longer than the {shortest} stage ({flag_of(shortest + '_steps')} "
                f"{trained[shortest]}), whose learning rate would never reach its peak; use --warmup-steps <= "
                f"{trained[shortest]}"
            )

    # ------------------------------------------------------------------ fitted to a model
    def fitted_to_positions(self, maximum: int | None) -> FinetuneConfig:
        """This config for a model of `maximum` positions (None: any number): the blocks the recipe chose cut to
        them, the blocks the user asked for refused if longer (the state stage's only where it trains)."""
        names = ("block_size", "eval_block_size") + (("state_block_size",) if self.state.state_steps else ())
        cut = {}
        for name in names:
            value = self.flag(name)
            if maximum is None or value is None or value <= maximum:
                continue
            if name not in self.chosen:
                raise UserInputError(
                    f"{name}={value} is larger than the model's maximum of {maximum} positions "
                    f"(max_position_embeddings of {self.model.model!r}); use {flag_of(name)} <= {maximum}"
                )
            logger.info("The recipe's %s=%d is cut to the model's %d positions", name, value, maximum)
            cut[name] = maximum
        return self._replaced(cut) if cut else self

    def without_state_stage(self, reason: str) -> FinetuneConfig:
        """This config without the state stage that the recipe chose, which the model cannot train (`reason`)."""
        return self._replaced({"state_steps": 0}, state_left_out=reason)

    # ------------------------------------------------------------------ what the run does
    @property
    def stage_names(self) -> list[str]:
        """The stages this run trains, in order ("transfer", "finetune", "state")."""
        return [name for name in ("transfer", "finetune", "state") if self.flag(f"{name}_steps")]

    @property
    def needs_teacher(self) -> bool:
        """Whether a stage distils from the unconverted model (stage 2 with --finetune-loss distill, stage 3)."""
        return self.finetune.finetune_loss == "distill" or bool(self.state.state_steps)

    def resume_conflicts(self, saved: dict[str, Any]) -> list[str]:
        """The settings that differ from a checkpoint's record `saved` and would change the trained weights
        (`resume_policy.resume_conflicts`)."""
        defaults = {field.name: field_default(field) for field in option_fields(type(self))}
        return resume_conflicts(self.to_dict(), saved, defaults)


def _by_group(flags: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`flags` by the group that holds each."""
    groups: dict[str, dict[str, Any]] = {}
    for name, value in flags.items():
        groups.setdefault(GROUP_OF[name], {})[name] = value
    return groups

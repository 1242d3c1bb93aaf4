"""The groups of `finetune` settings: each refuses its own bad values on its own, naming the field (or its
flag) and the value; `FinetuneConfig` composes them, one group per `--help` section, and never changes."""

import dataclasses
import re

import pytest

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import option_fields
from hf_softmax_rnn.training.config import GROUP_OF, GROUPS, FinetuneConfig
from hf_softmax_rnn.training.input_settings import DataSettings, ModelSettings
from hf_softmax_rnn.training.output_settings import HubSettings, LongEvalSettings, OutputSettings
from hf_softmax_rnn.training.stage_settings import FinetuneSettings, OptimSettings, StateSettings, TransferSettings

#: id -> (group, its fields, what the refusal says: the field or its flag, then the value)
BAD_GROUPS = {
    "model-empty": (ModelSettings, dict(model=""), r"^--model '' is empty"),
    "teacher-nul": (ModelSettings, dict(teacher="a\0b"), r"^--teacher 'a\\x00b' holds a NUL byte"),
    "attention-unknown": (ModelSettings, dict(attention="nope"), r"^Unknown attention preset 'nope'"),
    "attention-json": (ModelSettings, dict(attention="{bad"), r"^--attention '\{bad' is not valid JSON"),
    "layers-negative": (ModelSettings, dict(layers=[0, -1]), r"^layers=\[0, -1\] is not allowed"),
    "retrieval-layers-negative": (ModelSettings, dict(retrieval_layers=-1), r"^retrieval_layers=-1 is not allowed"),
    "extend-context-below-1": (ModelSettings, dict(extend_context=0.5), r"^extend_context: factor=0\.5 is not allowed"),
    "attention-mode": (ModelSettings, dict(attention_mode="serial"), r"^attention_mode='serial' is not allowed"),
    "dataset-twice": (DataSettings, dict(dataset="pydoc+pydoc"), r"^dataset='pydoc\+pydoc' is not allowed"),
    "batch-size-0": (DataSettings, dict(batch_size=0), r"^batch_size=0 is not allowed; expected a number >= 1"),
    "grad-accum-0": (DataSettings, dict(grad_accum=0), r"^grad_accum=0 is not allowed"),
    "eval-batch-size-0": (DataSettings, dict(eval_batch_size=0), r"^eval_batch_size=0 is not allowed"),
    "block-size-1": (DataSettings, dict(block_size=1), r"^block_size=1 is not allowed; expected an int >= 2"),
    "eval-block-size-1": (DataSettings, dict(eval_block_size=1), r"^eval_block_size=1 is not allowed"),
    "max-eval-blocks-0": (DataSettings, dict(max_eval_blocks=0), r"^max_eval_blocks=0 is not allowed"),
    "test-fraction-1": (DataSettings, dict(test_fraction=1.0), r"^test_fraction=1\.0 is not allowed"),
    "shuffle-buffer-0": (DataSettings, dict(shuffle_buffer=0, streaming=True), r"^shuffle_buffer=0 is not allowed"),
    "generated-texts-0": (DataSettings, dict(generated_texts=0), r"^generated_texts=0 is not allowed"),
    "recall-facts-negative": (DataSettings, dict(recall_facts=-1), r"^recall_facts=-1 is not allowed"),
    "text-column-of-pydoc": (DataSettings, dict(text_column="body"), r"^--text-column 'body' does not apply"),
    "dataset-config-of-pydoc": (DataSettings, dict(dataset_config="en"), r"^--dataset-config 'en' applies to a Hub"),
    "generated-tokens-unused": (DataSettings, dict(generated_tokens=9), r"^--generated-tokens 9 has no effect"),
    "shuffle-buffer-unused": (DataSettings, dict(shuffle_buffer=5), r"^--shuffle-buffer 5 has no effect"),
    "transfer-steps-negative": (TransferSettings, dict(transfer_steps=-1), r"^transfer_steps=-1 is not allowed"),
    "transfer-lr-0": (TransferSettings, dict(transfer_lr=0.0), r"^transfer_lr=0\.0 is not allowed"),
    "transfer-lm-weight-inf": (
        TransferSettings,
        dict(transfer_lm_weight=float("inf")),
        r"^transfer_lm_weight=inf is not allowed; expected a finite number >= 0",
    ),
    "finetune-steps-negative": (FinetuneSettings, dict(finetune_steps=-1), r"^finetune_steps=-1 is not allowed"),
    "finetune-method": (FinetuneSettings, dict(finetune_method="qlora"), r"^finetune_method='qlora' is not allowed"),
    "finetune-loss": (FinetuneSettings, dict(finetune_loss="kl"), r"^finetune_loss='kl' is not allowed"),
    "lr-0": (FinetuneSettings, dict(lr=0.0), r"^lr=0\.0 is not allowed; expected a number > 0"),
    "rnn-lr-nan": (FinetuneSettings, dict(rnn_lr=float("nan")), r"^rnn_lr=nan is not allowed"),
    "lora-rank-0": (FinetuneSettings, dict(lora_rank=0), r"^lora_rank=0 is not allowed"),
    "lora-alpha-0": (FinetuneSettings, dict(lora_alpha=0.0), r"^lora_alpha=0\.0 is not allowed"),
    "lora-dropout-1": (FinetuneSettings, dict(lora_dropout=1.0), r"^lora_dropout=1\.0 is not allowed"),
    "lora-rank-with-full": (
        FinetuneSettings,
        dict(finetune_method="full", lora_rank=4),
        r"^--lora-rank 4 contradicts --finetune-method full",
    ),
    "state-steps-negative": (StateSettings, dict(state_steps=-1), r"^state_steps=-1 is not allowed"),
    "state-block-size-1": (StateSettings, dict(state_block_size=1), r"^state_block_size=1 is not allowed"),
    "state-lr-0": (StateSettings, dict(state_lr=0.0), r"^state_lr=0\.0 is not allowed"),
    "lr-scheduler": (OptimSettings, dict(lr_scheduler="step"), r"^lr_scheduler='step' is not allowed"),
    "mixed-precision": (OptimSettings, dict(mixed_precision="fp8"), r"^mixed_precision='fp8' is not allowed"),
    "seed-negative": (OptimSettings, dict(seed=-1), r"^seed=-1 is not allowed"),
    "warmup-negative": (OptimSettings, dict(warmup_steps=-1), r"^warmup_steps=-1 is not allowed"),
    "weight-decay-negative": (OptimSettings, dict(weight_decay=-0.1), r"^weight_decay=-0\.1 is not allowed"),
    "max-grad-norm-negative": (OptimSettings, dict(max_grad_norm=-1.0), r"^max_grad_norm=-1\.0 is not allowed"),
    "eval-every-0": (OutputSettings, dict(eval_every=0), r"^eval_every=0 is not allowed"),
    "save-every-0": (OutputSettings, dict(save_every=0), r"^save_every=0 is not allowed"),
    "save-total-limit-0": (OutputSettings, dict(save_total_limit=0), r"^save_total_limit=0 is not allowed"),
    "inexact-resume-unused": (
        OutputSettings,
        dict(allow_inexact_resume=True),
        r"^--allow-inexact-resume has no effect without --resume",
    ),
    "resume-and-overwrite": (OutputSettings, dict(resume=True, overwrite=True), r"^--resume and --overwrite"),
    "long-eval-texts-empty": (LongEvalSettings, dict(long_eval_texts=" "), r"^--long-eval-texts ' ' is empty"),
    "long-eval-trials-unused": (
        LongEvalSettings,
        dict(long_eval_trials=2),
        r"^--long-eval-trials 2 has no effect without --long-eval",
    ),
    "long-eval-passkey-mixed": (
        LongEvalSettings,
        dict(long_eval=True, long_eval_passkey=[0, 1024]),
        r"^--long-eval-passkey 0 1024 mixes 0",
    ),
    "hub-private-alone": (HubSettings, dict(hub_private=True), r"^--hub-private without --push-to-hub"),
    "push-to-hub-bad": (HubSettings, dict(push_to_hub="a/b/c"), r"^--push-to-hub 'a/b/c' is not a Hub repo id"),
}


@pytest.mark.parametrize("group,fields,message", BAD_GROUPS.values(), ids=BAD_GROUPS.keys())
def test_each_group_refuses_its_bad_values_on_its_own(group, fields, message):
    with pytest.raises(UserInputError, match=message):
        group(**fields)
    # the config built from the same flags refuses them with the same words
    with pytest.raises(UserInputError, match=message):
        FinetuneConfig.from_flags(output_dir="out", **fields)


@pytest.mark.parametrize("group", GROUPS.values(), ids=GROUPS.keys())
def test_each_group_builds_from_its_defaults_and_stays_frozen(group):
    settings = group()
    name = option_fields(group)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, name, getattr(settings, name))


def test_the_fp16_check_of_the_device_names_the_value_and_the_device():
    OptimSettings(mixed_precision="fp16").check_device("cuda")
    with pytest.raises(UserInputError, match=r"^mixed_precision='fp16' is not allowed on cpu; expected 'bf16' or 'no'"):
        OptimSettings(mixed_precision="fp16").check_device("cpu")


#: Settings of several groups that contradict each other: refused by the config, not by a group.
ACROSS_GROUPS = {
    "nothing-to-train": (
        dict(transfer_steps=0, finetune_steps=0, state_steps=0),
        r"^transfer_steps, finetune_steps and state_steps are all 0",
    ),
    "warmup-past-a-stage": (dict(warmup_steps=15), r"^--warmup-steps 15 is longer than the state stage"),
    "retrieval-kept-unused": (
        dict(attention="hedgehog_window_64", retrieval_kept=512),
        r"^--retrieval-kept 512 has no effect without retrieval layers",
    ),
    "transfer-settings-unused": (
        dict(transfer_lm_weight=0.5),
        r"^--transfer-lm-weight 0\.5 has no effect without a transfer stage",
    ),
    "state-settings-unused": (
        dict(attention="hedgehog_window_64", state_lr=0.5),
        r"^--state-lr 0\.5 has no effect without a state stage",
    ),
    "teacher-of-an-unconverted-model": (
        dict(teacher="default"),
        r"^--teacher 'default' applies to a --model folder that holds a converted model",
    ),
}


@pytest.mark.parametrize("flags,message", ACROSS_GROUPS.values(), ids=ACROSS_GROUPS.keys())
def test_settings_of_several_groups_are_checked_together(flags, message):
    for name in flags:
        GROUPS[GROUP_OF[name]](**{key: value for key, value in flags.items() if GROUP_OF[key] == GROUP_OF[name]})
    with pytest.raises(UserInputError, match=message):
        FinetuneConfig.from_flags(output_dir="out", **flags)


def test_each_flag_is_the_field_of_one_group_and_the_flat_layout_round_trips():
    names = [field.name for field in option_fields(FinetuneConfig)]
    assert len(names) == len(set(names)) == len(GROUP_OF) + 1  # + output_dir, the config's own
    config = FinetuneConfig.from_flags(output_dir="out", lr=0.5, block_size=128, long_eval=True)
    assert list(config.to_dict()) == names
    assert (config.finetune.lr, config.data.block_size, config.evaluation.long_eval) == (0.5, 128, True)
    assert FinetuneConfig.from_flags(**config.to_dict()).to_dict() == config.to_dict()
    with pytest.raises(TypeError, match=r"FinetuneConfig has no flag 'learning_rate'"):
        FinetuneConfig.from_flags(output_dir="out", learning_rate=0.5)


def test_the_config_names_what_it_chose_and_chooses_it_again_for_new_flags():
    config = FinetuneConfig.from_flags(output_dir="out", lr=0.5)
    assert {"attention", "finetune_steps", "block_size", "state_steps", "rnn_lr", "lora_rank"} <= config.chosen
    assert not {"lr", "output_dir"} & config.chosen
    assert (config.finetune.finetune_steps, config.finetune.rnn_lr) == (20, 0.5)  # the window recipe; --lr
    other = config.with_flags(attention="linear_hedgehog", lr=0.1)
    # the learned map's recipe: transfer first, 300 LoRA steps, no state stage; --rnn-lr follows the new --lr
    assert (other.transfer.transfer_steps, other.finetune.finetune_steps, other.state.state_steps) == (100, 300, 0)
    assert other.finetune.rnn_lr == 0.1 and config.finetune.lr == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.output_dir = "elsewhere"


def test_a_config_fitted_to_a_model_is_a_new_one():
    config = FinetuneConfig.from_flags(output_dir="out", block_size=None)
    fitted = config.fitted_to_positions(64)
    assert (fitted.data.block_size, fitted.data.eval_block_size, fitted.state.state_block_size) == (64, 64, 64)
    assert (config.data.block_size, config.data.eval_block_size, config.state.state_block_size) == (2048, 1024, 4096)
    assert config.fitted_to_positions(None) is config
    given = FinetuneConfig.from_flags(output_dir="out", block_size=128)
    with pytest.raises(UserInputError, match=re.escape("block_size=128 is larger than the model's maximum of 64")):
        given.fitted_to_positions(64)


def test_the_state_stage_left_out_keeps_the_settings_given_for_it():
    """A model that cannot train the recipe's state stage leaves it out: the state settings given for it are
    no error then (they acted on the run that was asked for), where a run without the stage refuses them."""
    config = FinetuneConfig.from_flags(output_dir="out", state_lr=0.5)
    assert config.state.state_steps == 10
    left_out = config.without_state_stage("too short")
    assert (left_out.state.state_steps, left_out.state.state_lr, left_out.state_left_out) == (0, 0.5, "too short")
    assert left_out.stage_names == ["finetune"] and config.stage_names == ["finetune", "state"]
    with pytest.raises(UserInputError, match=r"^--state-lr 0\.5 has no effect without a state stage"):
        config.with_flags(state_steps=0)

"""Bad inputs stop a run before any training, with a message naming the bad value."""

import dataclasses
import json
import os
import random
import re
import shutil

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

from hf_softmax_rnn import convert
from hf_softmax_rnn.cli import main
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training import FinetuneConfig, Finetuner, finetune, loading, model_checks
from tests.training.helpers import MAX_POSITIONS, tiny_config

BAD_RUNS = {
    "missing-dataset": (dict(dataset="{tmp}/missing.txt"), FileNotFoundError, r"missing\.txt"),
    "block-size-above-max-positions": (
        dict(block_size=MAX_POSITIONS * 2),
        UserInputError,
        rf"block_size=128 is larger than the model's maximum of {MAX_POSITIONS} positions",
    ),
    "eval-block-size-above-max-positions": (
        dict(eval_block_size=MAX_POSITIONS + 1),
        UserInputError,
        rf"eval_block_size={MAX_POSITIONS + 1} is larger than the model's maximum of {MAX_POSITIONS} positions",
    ),
    "lora-target-matching-nothing": (
        dict(lora_targets=["q_proj", "query_key_value"]),
        UserInputError,
        r"LoRA target 'query_key_value' matches no Linear/Conv1D module .* \['down_proj', 'gate_proj', 'k_proj'",
    ),
    "transfer-module-not-in-layers": (
        dict(transfer_modules=["gates"]),
        UserInputError,
        r"'gates' is not a submodule .* 'rnn_params'",
    ),
    "transfer-modules-without-parameters": (
        dict(attention="linear_elu", transfer_modules=["rnn_params"]),
        UserInputError,
        r"\['rnn_params'\] hold no parameters",
    ),
    "transfer-without-converted-layers": (
        dict(attention="softmax"),
        UserInputError,
        "every attention layer is exact softmax",
    ),
    "layer-out-of-range": (dict(layers=[0, 7]), UserInputError, r"layers=\[0, 7\]"),
    "retrieval-layers-above-the-model": (
        dict(attention=dict(kind="linear", feature_map="elu", window=4, kept=2), retrieval_layers=3),
        UserInputError,
        r"retrieval layer count=3 is not allowed; expected an int in 0..2",
    ),
    "retrieval-layers-with-a-word-tokenizer": (
        dict(attention=dict(kind="linear", feature_map="elu", window=4, kept=2), retrieval_layers=1),
        UserInputError,
        r"the tokenizer writes a key with no token that decodes to digits alone",
    ),
    "missing-model": (dict(model="{tmp}/no_model"), FileNotFoundError, "no_model"),
    "recall-facts-that-do-not-fit-the-blocks": (
        dict(recall_facts=3),
        UserInputError,
        r"--recall-facts 3 does not fit blocks of 16 tokens: .*; expected at most 0, or longer blocks",
    ),
    "rnn-method-without-rnn-params": (
        dict(attention="linear_elu", transfer_steps=0, finetune_method="rnn"),
        UserInputError,
        r"--finetune-method rnn trains the converted layers' own parameters \(rnn_params\), and this attention has "
        r"none .*; use --finetune-method lora or full",
    ),
}


@pytest.mark.parametrize("settings,error,message", BAD_RUNS.values(), ids=BAD_RUNS.keys())
def test_bad_input_stops_before_training(tiny_models, tmp_path, settings, error, message):
    settings = {key: value.format(tmp=tmp_path) if isinstance(value, str) else value for key, value in settings.items()}
    config = tiny_config(settings.pop("model", tiny_models["llama"]), tmp_path / "out", **settings)
    with pytest.raises(error, match=message):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


#: Settings that contradict the model's config alone (its type, layers, positions, rotary embeddings).
BEFORE_LOADING = {
    name: BAD_RUNS[name]
    for name in (
        "block-size-above-max-positions",
        "eval-block-size-above-max-positions",
        "layer-out-of-range",
        "retrieval-layers-above-the-model",
        "lora-target-matching-nothing",
    )
}
BEFORE_LOADING |= {
    "block-size-above-extended-positions": (
        dict(extend_context=2, block_size=MAX_POSITIONS * 3),
        UserInputError,
        rf"block_size=192 is larger than the model's maximum of {MAX_POSITIONS * 2} positions",
    ),
    "extend-context-without-rotary-embeddings": (
        dict(model="gpt2", extend_context=2),
        UserInputError,
        "GPT2LMHeadModel has no rotary position embedding to rescale",
    ),
    "unsupported-model-type": (
        dict(model="gpt_neox"),
        UserInputError,
        r"takes a model of type \['gemma2', 'gemma3_text', 'gpt2', 'granite', 'llama', 'mistral', 'mixtral', 'olmo2', "
        r"'phi3', "
        r"'qwen2', 'qwen3', 'qwen3_moe', 'smollm3'\] .*; "
        r"got model_type 'gpt_neox' \(GPTNeoXForCausalLM\)",
    ),
}


@pytest.mark.parametrize("settings,error,message", BEFORE_LOADING.values(), ids=BEFORE_LOADING.keys())
def test_settings_against_the_models_config_stop_before_its_weights_and_the_data_load(
    tiny_models, tmp_path, monkeypatch, settings, error, message
):
    """A run whose settings contradict the model's config (read alone) stops before the weights and the
    corpus load, which for a Hub model or dataset can take minutes."""

    def loaded(*args, **kwargs):
        raise AssertionError("weights or data loaded before the settings were checked against the model's config")

    monkeypatch.setattr(loading, "resolve_model", loaded)
    monkeypatch.setattr(loading, "load_corpus", loaded)
    models = dict(tiny_models, gpt_neox=str(tmp_path / "gpt_neox"))
    GPTNeoXForCausalLM(
        GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    ).save_pretrained(models["gpt_neox"])
    settings = dict(settings)
    config = tiny_config(models[settings.pop("model", "llama")], tmp_path / "out", **settings)
    with pytest.raises(error, match=message):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


BAD_DATA = {
    "binary-file": ("data.txt", bytes(range(256)) * 8, r"Dataset file '.*data\.txt' is not UTF-8 text"),
    "too-little-text": ("data.txt", b"one short line\n" * 12, r"The held-out split has no full block of 16 tokens"),
}


@pytest.mark.parametrize("name,content,message", BAD_DATA.values(), ids=BAD_DATA.keys())
def test_cli_reports_bad_data_and_exits_2(tiny_models, tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    arguments = ["--output-dir", str(tmp_path / "out"), "--model", tiny_models["llama"], "--block-size", "16"]
    assert main(["finetune", *arguments, "--dataset", str(tmp_path / name), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert re.search(r"^hf-softmax-rnn finetune: error: " + message, error, re.MULTILINE), error
    assert not (tmp_path / "out").exists()


BAD_SETTINGS = {
    "unknown-preset": (
        dict(attention="softmax_quadratic"),
        r"Unknown attention preset 'softmax_quadratic'; expected one of \[",
    ),
    "bad-spec-json": (dict(attention='{"kind": "cubic"}'), r"AttentionSpec.kind='cubic' is not allowed"),
    "unknown-method": (
        dict(finetune_method="qlora"),
        r"finetune_method='qlora' is not allowed; expected one of \['lora', 'full', 'rnn'\]",
    ),
    "nothing-to-train": (
        dict(transfer_steps=0, finetune_steps=0, state_steps=0),
        r"transfer_steps, finetune_steps and state_steps are all 0: nothing to train",
    ),
    "negative-state-steps": (dict(state_steps=-1), r"state_steps=-1 is not allowed; expected a number >= 0"),
    "state-block-too-short": (dict(state_block_size=1), r"state_block_size=1 is not allowed; expected an int >= 2"),
    "zero-state-lr": (dict(state_lr=0.0), r"state_lr=0\.0 is not allowed; expected a number > 0"),
    "zero-batch": (dict(batch_size=0), r"batch_size=0 is not allowed"),
    "negative-max-grad-norm": (
        dict(max_grad_norm=-1.0),
        r"max_grad_norm=-1\.0 is not allowed; expected a number >= 0 \(0: no clipping\)",
    ),
    "negative-weight-decay": (dict(weight_decay=-0.1), r"weight_decay=-0\.1 is not allowed; expected a number >= 0"),
    "zero-lora-alpha": (dict(lora_alpha=0.0), r"lora_alpha=0\.0 is not allowed; expected a number > 0"),
    "negative-lora-alpha": (dict(lora_alpha=-16.0), r"lora_alpha=-16\.0 is not allowed; expected a number > 0"),
    "zero-lr": (dict(lr=0.0), r"lr=0\.0 is not allowed; expected a number > 0"),
    "negative-lr": (dict(lr=-1e-3), r"lr=-0\.001 is not allowed; expected a number > 0"),
    "nan-lr": (dict(lr=float("nan")), r"lr=nan is not allowed; expected a number > 0"),
    "zero-transfer-lr": (dict(transfer_lr=0.0), r"transfer_lr=0\.0 is not allowed; expected a number > 0"),
    "zero-rnn-lr": (dict(rnn_lr=0.0), r"rnn_lr=0\.0 is not allowed; expected a number > 0"),
    "inf-rnn-lr": (dict(rnn_lr=float("inf")), r"rnn_lr=inf is not allowed; expected a number > 0"),
    "lora-dropout-one": (dict(lora_dropout=1.0), r"lora_dropout=1\.0 is not allowed; expected a number in \[0, 1\)"),
    "negative-lora-dropout": (
        dict(lora_dropout=-0.1),
        r"lora_dropout=-0\.1 is not allowed; expected a number in \[0, 1\)",
    ),
    "spec-json-wrong-type": (
        dict(attention='{"kind": "recurrent_softmax", "taylor_order": "two"}'),
        r"--attention .*AttentionSpec\.taylor_order='two' has type str",
    ),
    "spec-json-list": (
        dict(attention='["softmax"]'),
        r"--attention '\[\"softmax\"\]' is not allowed; expected a preset name, a JSON object or a \.json file",
    ),
    "zero-shuffle-buffer": (dict(shuffle_buffer=0), r"shuffle_buffer=0 is not allowed; expected a number >= 1"),
    "negative-recall-facts": (dict(recall_facts=-1), r"recall_facts=-1 is not allowed; expected a number >= 0"),
    "negative-seed": (dict(seed=-1), r"seed=-1 is not allowed; expected an int from 0 to 2\*\*32 - 1"),
    "seed-above-32-bits": (dict(seed=2**32), r"seed=4294967296 is not allowed"),
    "eval-block-size-1": (dict(eval_block_size=1), r"eval_block_size=1 is not allowed; expected an int >= 2"),
    "generated-texts-0": (dict(generated_texts=0), r"generated_texts=0 is not allowed"),
    "dataset-source-twice": (dict(dataset="pydoc+pydoc"), r"dataset='pydoc\+pydoc' is not allowed"),
    "retrieval-layers-negative": (
        dict(retrieval_layers=-1),
        r"retrieval_layers=-1 is not allowed; expected a number >= 0",
    ),
    "retrieval-layers-without-kept": (
        dict(attention="hedgehog_window_64", retrieval_layers=2),
        r"a larger kept budget for retrieval layers needs a spec with kept positions; .* has none",
    ),
    "retrieval-kept-below-the-spec": (
        dict(attention="hedgehog_window_256_sinks_4_kept_256_decay", retrieval_layers=2, retrieval_kept=128),
        r"retrieval kept=128 is not allowed; expected an int >= the spec's kept=256",
    ),
    "resume-and-overwrite": (
        dict(resume=True, overwrite=True),
        r"--resume and --overwrite contradict each other .*; pass one",
    ),
    "push-to-hub-not-a-repo-id": (
        dict(push_to_hub="not a repo name!!"),
        r"--push-to-hub 'not a repo name!!' is not a Hub repo id .*; expected 'name' or 'owner/name'",
    ),
    "push-to-hub-three-parts": (
        dict(push_to_hub="a/b/c"),
        r"--push-to-hub 'a/b/c' is not a Hub repo id .*; expected 'name' or 'owner/name'",
    ),
    "lora-rank-with-full": (
        dict(finetune_method="full", lora_rank=8),
        r"--lora-rank 8 contradicts --finetune-method full .*; drop --lora-rank or use --finetune-method lora",
    ),
    "lora-alpha-with-full": (dict(finetune_method="full", lora_alpha=32.0), r"--lora-alpha 32\.0 contradicts"),
    "lora-dropout-with-full": (dict(finetune_method="full", lora_dropout=0.1), r"--lora-dropout 0\.1 contradicts"),
    "lora-rank-with-rnn": (
        dict(finetune_method="rnn", lora_rank=8),
        r"--lora-rank 8 contradicts --finetune-method rnn .*; drop --lora-rank or use --finetune-method lora",
    ),
    "lora-targets-with-full": (
        dict(finetune_method="full", lora_targets=["q_proj"]),
        r"--lora-targets \['q_proj'\] contradicts --finetune-method full",
    ),
    "hub-private-without-push-to-hub": (
        dict(hub_private=True),
        r"--hub-private without --push-to-hub: there is no Hub repo to make private; pass --push-to-hub REPO",
    ),
    "text-column-for-pydoc": (
        dict(dataset="pydoc", text_column="body"),
        r"--text-column 'body' does not apply to --dataset 'pydoc': .* only a 'text' column; drop --text-column",
    ),
    "warmup-longer-than-a-stage": (
        dict(warmup_steps=15),
        r"--warmup-steps 15 is longer than the state stage \(--state-steps 10\), whose learning rate would never "
        r"reach its peak; use --warmup-steps <= 10",
    ),
    "retrieval-kept-without-retrieval-layers": (
        dict(retrieval_layers=0, retrieval_kept=0),
        r"--retrieval-kept 0 has no effect without retrieval layers \(--retrieval-layers is 0\); drop --retrieval-kept",
    ),
    "retrieval-kept-for-a-spec-without-kept": (
        dict(attention="hedgehog_window_64", retrieval_kept=512),
        r"--retrieval-kept 512 has no effect without retrieval layers",
    ),
    "dataset-config-for-pydoc": (
        dict(dataset="pydoc", dataset_config="en"),
        r"--dataset-config 'en' applies to a Hub dataset, and --dataset 'pydoc' names none .*; drop --dataset-config",
    ),
    "transfer-modules-without-a-transfer-stage": (
        dict(transfer_modules=["rnn_params"]),
        r"--transfer-modules \['rnn_params'\] has no effect without a transfer stage \(--transfer-steps is 0\)",
    ),
    "no-transfer-teacher-forcing-without-a-transfer-stage": (
        dict(transfer_teacher_forcing=False),
        r"^--no-transfer-teacher-forcing has no effect without a transfer stage",
    ),
    "state-lr-without-a-state-stage": (
        dict(state_steps=0, state_lr=0.1),
        r"--state-lr 0\.1 has no effect without a state stage \(--state-steps is 0\); drop --state-lr",
    ),
    "state-block-size-for-a-recipe-without-a-state-stage": (
        dict(attention="hedgehog_window_64", state_block_size=2048),
        r"--state-block-size 2048 has no effect without a state stage \(--state-steps is 0\)",
    ),
    "no-state-gradient-checkpointing-without-a-state-stage": (
        dict(state_steps=0, state_gradient_checkpointing=False),
        r"^--no-state-gradient-checkpointing has no effect without a state stage",
    ),
    "long-eval-texts-without-long-eval": (
        dict(long_eval_texts="books.txt"),
        r"--long-eval-texts 'books\.txt' has no effect without --long-eval; drop --long-eval-texts",
    ),
    "generated-texts-without-generated-source": (
        dict(generated_texts=6),
        r"--generated-texts 6 has no effect without the 'generated' dataset source",
    ),
    "shuffle-buffer-without-streaming": (
        dict(shuffle_buffer=1),
        r"--shuffle-buffer 1 has no effect without --streaming \(loaded data is shuffled whole\)",
    ),
    "allow-inexact-resume-without-resume": (
        dict(allow_inexact_resume=True),
        r"^--allow-inexact-resume has no effect without --resume",
    ),
    "nul-byte-in-a-path": (
        dict(dataset="data\0.txt"),
        r"--dataset 'data\\x00\.txt' holds a NUL byte, which no path or name can hold",
    ),
    "non-utf8-bytes-in-a-path": (
        dict(output_dir=os.fsdecode(b"out\xff\xfe")),
        r"^--output-dir 'out\\udcff\\udcfe' holds bytes that are not UTF-8 \(the escapes above\), which TensorBoard",
    ),
    "empty-output-dir": (dict(output_dir=""), r"^--output-dir '' is empty; expected a name or a path"),
    "blank-dataset": (dict(dataset=" "), r"^--dataset ' ' is empty; expected a name or a path"),
    "empty-model": (dict(model=""), r"^--model '' is empty; expected a name or a path"),
    "text-column-for-generated": (
        dict(dataset="pydoc+generated", text_column="body"),
        r"--text-column 'body' does not apply to --dataset 'pydoc\+generated'",
    ),
    "infinite-weight-decay": (
        dict(weight_decay=float("inf")),
        r"^weight_decay=inf is not allowed; expected a finite number >= 0",
    ),
    "infinite-transfer-lm-weight": (
        dict(transfer_lm_weight=float("inf")),
        r"^transfer_lm_weight=inf is not allowed; expected a finite number >= 0",
    ),
}


WRONG_TYPES = {
    "float-block-size": (dict(block_size=4.5), r"^block_size=4.5 has type float; expected None or an int$"),
    "text-batch-size": (dict(batch_size="4"), r"^batch_size='4' has type str; expected an int$"),
    "bool-seed": (dict(seed=True), r"^seed=True has type bool; expected an int$"),
    "text-lr": (dict(lr="1e-3"), r"^lr='1e-3' has type str; expected None or a number$"),
    "int-layers": (dict(layers=3), r"^layers=3 has type int; expected None or a list of ints$"),
    "float-in-layers": (dict(layers=[0, 1.0]), r"^layers=\[0, 1.0\] has type list; expected None or a list of ints$"),
    "none-warmup": (dict(warmup_steps=None), r"^warmup_steps=None has type NoneType; expected an int$"),
    "list-retrieval-layers": (dict(retrieval_layers=[0]), r"^retrieval_layers=\[0\] has type list; expected None"),
    "text-lora-targets": (dict(lora_targets="q_proj"), r"^lora_targets='q_proj' has type str; expected None or a list"),
    "text-switch": (dict(progress="no"), r"^progress='no' has type str; expected True or False$"),
}


@pytest.mark.parametrize("settings,message", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_settings_of_another_type_than_declared_are_refused_naming_them(tmp_path, settings, message):
    """From Python (the command line parses them): a float block size, a string of digits or one layer index
    in place of a list failed deep inside the run (a TypeError of '>=' between str and int), or went through."""
    with pytest.raises(UserInputError, match=message):
        FinetuneConfig.from_flags(**dict(output_dir=str(tmp_path)) | settings)


@pytest.mark.parametrize("settings,message", BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_bad_settings_are_refused(tmp_path, settings, message):
    with pytest.raises(UserInputError, match=message):
        FinetuneConfig.from_flags(**dict(output_dir=str(tmp_path)) | settings)


def test_lora_settings_keep_their_defaults_and_stay_unset_for_full_fine_tuning(tmp_path):
    lora = FinetuneConfig.from_flags(output_dir=str(tmp_path)).finetune
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_dropout, lora.lora_targets) == (8, 16.0, 0.0, None)
    full = FinetuneConfig.from_flags(output_dir=str(tmp_path), finetune_method="full").finetune
    assert (full.lora_rank, full.lora_alpha, full.lora_dropout, full.lora_targets) == (None, None, None, None)
    full, lora = (FinetuneConfig.from_flags(output_dir=str(tmp_path), finetune_method=m) for m in ("full", "lora"))
    # a config rebuilt from its flags, or from its groups, stays valid
    assert full.with_flags(resume=True).finetune.lora_rank is None
    assert lora.with_flags(resume=True).finetune.lora_rank == 8
    assert dataclasses.replace(full, output=dataclasses.replace(full.output, resume=True)).finetune.lora_rank is None
    assert dataclasses.replace(lora, output=dataclasses.replace(lora.output, resume=True)).finetune.lora_rank == 8


@pytest.mark.parametrize(
    "settings",
    [
        dict(dataset="pydoc", text_column="text"),
        dict(dataset="pydoc+data.jsonl", text_column="body"),
        dict(push_to_hub="someone/model", hub_private=True),
        dict(push_to_hub="model-name_1.0"),
        dict(warmup_steps=10),
        dict(retrieval_kept=4096),
        dict(dataset="pydoc+someone/dataset", dataset_config="en"),
        dict(transfer_steps=2, transfer_modules=["rnn_params"], transfer_teacher_forcing=False),
        dict(long_eval=True, long_eval_texts="books.txt"),
        dict(dataset="pydoc+generated", generated_texts=6),
        dict(streaming=True, shuffle_buffer=1),
        dict(resume=True, allow_inexact_resume=True),
    ],
    ids=[
        "pydoc-text-column",
        "file-source-reads-the-column",
        "private-push",
        "repo-without-owner",
        "warmup-as-long-as-the-shortest-stage",
        "retrieval-kept-of-the-recipes-retrieval-layers",
        "dataset-config-of-a-hub-source",
        "transfer-settings-with-a-transfer-stage",
        "long-eval-settings-with-long-eval",
        "generated-settings-with-the-generated-source",
        "shuffle-buffer-when-streaming",
        "inexact-resume-when-resuming",
    ],
)
def test_consistent_settings_are_accepted(tmp_path, settings):
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path), **settings)
    # a config rebuilt from its flags, or from its groups, stays valid
    config.with_flags(overwrite=not config.output.resume)
    dataclasses.replace(config, output=dataclasses.replace(config.output, overwrite=not config.output.resume))


def test_a_config_without_retrieval_layers_rebuilt_from_its_fields_stays_valid(tmp_path):
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path), attention="hedgehog_window_64")
    assert (config.model.retrieval_layers, config.model.retrieval_kept) == (0, 2048)
    assert config.with_flags(resume=True).model.retrieval_kept == 2048
    rebuilt = dataclasses.replace(config, output=dataclasses.replace(config.output, resume=True))
    assert rebuilt.model.retrieval_kept == 2048


def test_dataset_config_for_a_local_file_is_refused_before_anything_is_written(tiny_models, tmp_path, capsys):
    data = tmp_path / "texts.jsonl"
    data.write_text('{"text": "a line of text"}\n')
    arguments = ["--output-dir", str(tmp_path / "out"), "--model", tiny_models["llama"], "--dataset", str(data)]
    assert main(["finetune", *arguments, "--dataset-config", "en", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert f"error: --dataset-config 'en' applies to a Hub dataset, and --dataset '{data}' names none" in error
    assert not (tmp_path / "out").exists()


def test_spec_file_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "spec.json").write_text("{kind: softmax")
    with pytest.raises(UserInputError, match=r"--attention file '.*spec\.json' is not valid JSON"):
        FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"), attention=str(tmp_path / "spec.json"))


def test_fp16_without_a_gpu_is_refused(tiny_models, tmp_path, fresh_accelerator_state):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", mixed_precision="fp16", cpu=True)
    with pytest.raises(UserInputError, match=r"mixed_precision='fp16' is not allowed on cpu; expected 'bf16' or 'no'"):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


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
        FloatingPointError, match=r"Stage finetune: training diverged at step \d \(.* is (nan|not finite)\); lower the"
    ):
        finetune(config)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_learning_rate_whose_step_overflows_is_reported_as_divergence(tiny_models, tmp_path, capsys):
    """At lr 1e38 Adam's step (lr / (1 - beta1)) is beyond float32, which torch reports as an overflow: the run
    stops as one that diverges does (at 1e30 the parameters become NaN), in one line with exit status 1."""
    out = tmp_path / "out"
    arguments = ["--output-dir", str(out), "--model", tiny_models["llama"], "--block-size", "16", "--batch-size", "2"]
    arguments += ["--max-eval-blocks", "4", "--transfer-steps", "0", "--finetune-steps", "2", "--state-steps", "0"]
    arguments += ["--attention", "softmax_divS_norm", "--finetune-method", "full", "--lr", "1e38", "--no-progress"]
    assert main(["finetune", *arguments]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert re.search(
        r"^hf-softmax-rnn finetune: error: Stage finetune: training diverged at step 1 \(the optimizer update is "
        r"inf\); lower the learning rate \(1e\+38\)",
        error,
        re.MULTILINE,
    ), error
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("name", ["batch_size", "eval_batch_size"])
def test_a_batch_whose_logits_exceed_the_devices_memory_stops_before_the_weights_and_the_data_load(
    tiny_models, tmp_path, monkeypatch, name
):
    def loaded(*args, **kwargs):
        raise AssertionError("weights or data loaded before the batch was checked against the memory")

    monkeypatch.setattr(loading, "resolve_model", loaded)
    monkeypatch.setattr(loading, "load_corpus", loaded)
    monkeypatch.setattr(model_checks, "device_memory", lambda device: 10**6)
    config = tiny_config(tiny_models["llama"], tmp_path / "out", **{name: 200})
    flag = "--" + name.replace("_", "-")
    with pytest.raises(
        UserInputError,
        match=rf"^{flag} 200 needs at least 1,638,400 bytes for the logits of one batch \(200 blocks x 16 tokens x 128 "
        rf"vocabulary entries x 4 bytes\), more than the 1,000,000 bytes of cpu; use {flag} <= 122$",
    ):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


def test_a_batch_larger_than_the_training_data_stops_before_the_run_writes(tiny_models, tmp_path):
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(load_corpus()["train"]["text"][:2]))
    config = tiny_config(tiny_models["llama"], tmp_path / "out", dataset=str(data), batch_size=100_000)
    with pytest.raises(
        UserInputError,
        match=r"^--batch-size 100000 x 1 processes x --grad-accum 1 = 100000 blocks per step, more than the \d+ "
        r"training blocks of 16 tokens \(--block-size, stage transfer\); use --batch-size <= \d+, more data or "
        r"shorter blocks$",
    ):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


def _broken_attention_type(folder):
    config = json.loads((folder / "config.json").read_text())
    config["attention"] = {**(config.get("attention") or {}), "kind": "linear", "feature_map": "elu"}
    config["attention"]["input_gate"] = "false"
    (folder / "config.json").write_text(json.dumps(config))


def _without_tokenizer(folder):
    for path in folder.iterdir():
        if path.name.startswith("tokenizer"):
            path.unlink()


def _config_says(**entries):
    """A damage: config.json entries that contradict the weights beside it."""

    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | entries))

    return damage


def _truncated_weights(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _embeddings_of(rows: int):
    """A damage: the model saved again with `rows` token embeddings, fewer than its tokenizer's ids."""

    def damage(folder):
        model = AutoModelForCausalLM.from_pretrained(folder)
        model.resize_token_embeddings(rows)
        model.save_pretrained(folder)

    return damage


def _random_weights(folder):
    (folder / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))


class _NotATensor:
    """What torch's weights-only loader refuses: a pickle that calls a function when it loads."""

    def __reduce__(self):
        return print, ("loaded",)


def _pickle_with_code(folder):
    weights = folder / "model.safetensors"
    torch.save({**load_file(weights), "extra": _NotATensor()}, folder / "pytorch_model.bin")
    weights.unlink()


BROKEN_MODEL_FOLDERS = {
    "attention-field-of-wrong-type": (
        _broken_attention_type,
        r"its model could not be loaded \(AttentionSpec\.input_gate='false' has type str",
    ),
    "no-tokenizer": (_without_tokenizer, r"its tokenizer could not be loaded"),
    "dtype-that-torch-lacks": (
        _config_says(dtype="float77", torch_dtype="float77"),
        r"its config could not be loaded \(module 'torch' has no attribute 'float77'\)",
    ),
    "tokenizer-beyond-the-embeddings": (
        _embeddings_of(64),
        r"its tokenizer has 128 tokens \(ids 0\.\.127\) but the model embeds 64 \(vocab_size=64\); expected the "
        r"tokenizer saved with the model",
    ),
    "heads-that-do-not-divide-the-hidden-size": (
        _config_says(num_attention_heads=3, num_key_value_heads=3),
        r"its config could not be loaded \(.*The hidden size \(32\) is not a multiple of the number of attention "
        r"heads \(3\)",
    ),
    "config-with-a-layer-the-weights-lack": (
        _config_says(num_hidden_layers=3),
        r"its weights do not fit the model its config\.json describes \(num_hidden_layers=3, .*\): 9 weights it needs "
        r"missing from the files \(model\.layers\.2\.input_layernorm\.weight, .*, and 5 more\)",
    ),
    "config-with-fewer-layers-than-the-weights": (
        _config_says(num_hidden_layers=1),
        r"its weights do not fit .*\(num_hidden_layers=1, .*\): 9 weights in the files it has no place for "
        r"\(model\.layers\.1\.",
    ),
    "hidden-size-contradicting-the-weights": (
        _config_says(hidden_size=64),
        r"its weights do not fit .*\(.*hidden_size=64.*\): 20 weights of another shape "
        r"\(model\.embed_tokens\.weight \[128, 32\] in the files, \[128, 64\] in the model",
    ),
    "vocab-size-contradicting-the-weights": (
        _config_says(vocab_size=100),
        r"its weights do not fit .*\(.*vocab_size=100\): 1 weight of another shape "
        r"\(model\.embed_tokens\.weight \[128, 32\] in the files, \[100, 32\] in the model\)",
    ),
    "truncated-safetensors": (
        _truncated_weights,
        r"weight file '.*model/model\.safetensors' cannot be read: it is truncated or no safetensors file",
    ),
    "random-bytes-safetensors": (
        _random_weights,
        r"weight file '.*model/model\.safetensors' cannot be read: it is truncated or no safetensors file",
    ),
    "pickle-the-weights-only-loader-refuses": (
        _pickle_with_code,
        r"weight file '.*model/pytorch_model\.bin' cannot be read: torch's weights-only loader refuses it, as it "
        r"holds objects besides tensors \(Unsupported global: GLOBAL print was not an allowed global",
    ),
}


@pytest.mark.parametrize("damage,message", BROKEN_MODEL_FOLDERS.values(), ids=BROKEN_MODEL_FOLDERS.keys())
def test_cli_reports_a_broken_model_folder_in_one_line(tiny_models, tmp_path, capsys, damage, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    arguments = ["finetune", "--output-dir", str(tmp_path / "out"), "--model", str(folder), "--no-progress"]
    if damage is _broken_attention_type:
        convert(str(folder), "linear_elu").save_pretrained(folder)
        arguments += ["--teacher", tiny_models["llama"]]
    damage(folder)
    capsys.readouterr()
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and "LOAD REPORT" not in error
    assert re.search(rf"^hf-softmax-rnn finetune: error: Model '.*model': {message}", error, re.MULTILINE), error
    assert not (tmp_path / "out").exists()


def test_heldout_blocks_follow_eval_block_size(tiny_models, tmp_path):
    """Trained on 16-token blocks, scored on 32-token ones: the held-out tensor has the eval length."""
    finetuner = Finetuner(tiny_config(tiny_models["llama"], tmp_path / "out", block_size=16, eval_block_size=32))
    assert finetuner.eval_ids.shape[1] == 32
    assert [blocks.next_blocks(1).shape[1] for blocks in finetuner.train_data.values()] == [16]


def test_the_recipe_trains_kept_specs_on_2048_token_blocks_held_out_on_1024(tmp_path):
    from hf_softmax_rnn.training.recipes import HELDOUT_BLOCK_SIZE

    def blocks(**settings) -> tuple[int, int]:
        config = FinetuneConfig.from_flags(output_dir=str(tmp_path), **settings)
        return config.data.block_size, config.data.heldout_block_size

    assert blocks() == (2048, HELDOUT_BLOCK_SIZE) == (2048, 1024)  # the default spec keeps positions
    assert blocks(attention="hedgehog_window_256_sinks_4_decay") == (1024, 1024)
    assert blocks(attention=dict(kind="linear", feature_map="hedgehog", window=64, kept=64)) == (1024, 1024)
    assert blocks(block_size=512) == (512, 512)  # blocks the user gives are held out at their own length
    assert blocks(block_size=4096, eval_block_size=2048) == (4096, 2048)


def test_recipe_blocks_longer_than_the_model_are_cut_to_its_positions(tiny_models, tmp_path, caplog):
    attention = dict(kind="linear", feature_map="elu", window=4, kept=2, chunk_size=4)
    config = tiny_config(tiny_models["llama"], tmp_path / "out", attention=attention, block_size=None)
    with caplog.at_level("INFO"):
        finetuner = Finetuner(config)
    assert (finetuner.config.data.block_size, finetuner.config.data.heldout_block_size) == (MAX_POSITIONS,) * 2
    assert (config.data.block_size, config.data.heldout_block_size) == (1024, 1024)  # the given config is unchanged
    assert f"The recipe's block_size=1024 is cut to the model's {MAX_POSITIONS} positions" in caplog.text


def test_a_heldout_block_the_user_gives_is_never_cut_even_when_the_recipe_sets_the_training_blocks(
    tiny_models, tmp_path
):
    attention = dict(kind="linear", feature_map="elu", window=4, kept=2, chunk_size=4)
    config = tiny_config(
        tiny_models["llama"], tmp_path / "out", attention=attention, block_size=None, eval_block_size=MAX_POSITIONS + 1
    )
    with pytest.raises(UserInputError, match=rf"eval_block_size={MAX_POSITIONS + 1} is larger than the model's"):
        Finetuner(config)
    assert not (tmp_path / "out").exists()

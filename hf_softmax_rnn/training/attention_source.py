"""Where a run's attention comes from: an `--attention` value (a preset name, inline JSON or a .json file),
or the config.json of a `--model` folder that holds a converted model (read from disk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import FAMILIES
from hf_softmax_rnn.errors import UserInputError


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

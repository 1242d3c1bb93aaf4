"""The checks the groups of `finetune` settings share, each refusal naming the field (or its flag) and value."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hf_softmax_rnn.errors import UserInputError


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise UserInputError(f"{name}={value!r} is not allowed; expected one of {list(allowed)}")


def check_at_least(name: str, value: float, minimum: float = 1) -> None:
    if not value >= minimum:
        raise UserInputError(f"{name}={value!r} is not allowed; expected a number >= {minimum}")
    # a weight decay or loss weight of inf diverges at the first step
    if not math.isfinite(value):
        raise UserInputError(f"{name}={value!r} is not allowed; expected a finite number >= {minimum}")


def check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserInputError(f"{name}={value!r} is not allowed; expected a number > 0")


def check_block_size(name: str, value: int | None) -> None:
    """A block of tokens, unless unset: at least two (one prediction)."""
    if value is not None and not value >= 2:
        raise UserInputError(f"{name}={value} is not allowed; expected an int >= 2")


def check_texts(settings: Any) -> None:
    """Every text flag of `settings` (a dataclass of `option` fields; not those of its groups) is a UTF-8 name
    or path without NUL bytes, and not blank."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name) if "help" in field.metadata else None
        if not isinstance(value, str):
            continue
        if "\0" in value:
            raise UserInputError(f"{flag_of(field.name)} {value!r} holds a NUL byte, which no path or name can hold")
        if not _is_utf8(value):
            raise UserInputError(
                f"{flag_of(field.name)} {value!r} holds bytes that are not UTF-8 (the escapes above), which "
                "TensorBoard, the model card and the Hub cannot write; expected a UTF-8 path or name"
            )
        if not value.strip():
            raise UserInputError(f"{flag_of(field.name)} {value!r} is empty; expected a name or a path")


def _is_utf8(value: str) -> bool:
    """`value` encodes as UTF-8: a command-line path of other bytes arrives with surrogate escapes, which
    only the file system accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def flag_of(name: str) -> str:
    """The `finetune` flag of field `name`."""
    return "--" + name.replace("_", "-")


def as_given(settings: Any, name: str) -> str:
    """Field `name` of `settings` as the command line gives it: its flag (of a switch, as the switch's flag
    reads, such as --no-progress), then its value."""
    value, field = getattr(settings, name), settings.__dataclass_fields__[name]
    return field.metadata.get("flag", flag_of(name)) if isinstance(value, bool) else f"{flag_of(name)} {value!r}"


def field_default(field: dataclasses.Field) -> Any:
    """The default value of a dataclass field (a fresh one of a mutable default)."""
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def refuse_unused(
    settings: Any, names: tuple[str, ...], *, acts_with: str, present: bool, defaults: dict[str, Any] | None = None
) -> None:
    """Refuse a field of `names` given (other than its default, or the one in `defaults`) where what it
    `acts_with` is not `present`: it would be ignored without a word."""
    if present:
        return
    fields = settings.__dataclass_fields__
    defaults = {name: field_default(fields[name]) for name in names} | (defaults or {})
    given = [name for name in names if getattr(settings, name) != defaults[name]]
    if given:
        flag = as_given(settings, given[0])
        raise UserInputError(
            f"{flag} has no effect without {acts_with}; drop {flag.split()[0]}, or add what it acts on"
        )

"""The checks the groups of `finetune` settings share, each refusal naming the field (or its flag) and value."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
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


#: Declared type -> (the types a value of it may have, in words); bool is refused where an int or a float is declared.
_CHECKED_TYPES: dict[type, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an int"),
    float: ((int, float), "a number"),
    bool: ((bool,), "True or False"),
}
_LIST_TYPES = {int: ((int,), "a list of ints"), str: ((str,), "a list of strings")}


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    return isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))


def check_field_types(settings: Any) -> None:
    """Each number, switch and list flag of `settings` (a dataclass of `option` fields) holds its declared type:
    from Python, a block size of 4.5, a batch size of "4" or layers=3 would fail deep inside the run, or be
    truncated without a word (the command line parses them). Text fields are not checked: a `Path` or an
    `AttentionSpec` stands for a path or a recipe there."""
    hints = typing.get_type_hints(type(settings))
    for field in dataclasses.fields(settings):
        if "help" not in field.metadata:
            continue
        annotation, value, optional = hints[field.name], getattr(settings, field.name), False
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
            raise UserInputError(f"{field.name}={value!r} has type {type(value).__name__}; expected {none}{words}")

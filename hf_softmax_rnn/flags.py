"""Command-line flags built from dataclass fields, so that each flag's help lives in one place.

A field declared with `option(default, "help", ...)` becomes `--field-name` (or the name given as
`flag`); its type, `nargs` and boolean action follow the annotation, its default the field's. A field
declared with `flag_group(cls)` holds a dataclass of such fields, whose flags join those of the dataclass
holding it (flat on the command line, nested in Python). `DefaultsFormatter` shows each default after
the help when `--help` prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

#: The default of a field that `--help` shows in place of its value (e.g. "the attention's recipe").
SHOWN_DEFAULT = "shown_default"
#: Metadata key of a `flag_group` field.
_GROUP_OF_FLAGS = "group_of_flags"


def option(default: Any = dataclasses.MISSING, help: str = "", **argparse_options: Any) -> Any:
    """A dataclass field that is also a flag. `argparse_options` go to `add_argument` (`choices`,
    `metavar`, `nargs`, `type`), plus `flag` (its name, e.g. "--no-progress"), `group` (a help
    section title), `positional` and `shown_default` (the default as `--help` shows it)."""
    metadata = {"help": help, **argparse_options}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_group(cls: type) -> Any:
    """A dataclass field holding a `cls` (its defaults unless given), whose `option` fields are flags of the
    dataclass that holds the field."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP_OF_FLAGS: True})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, annotation) of every flag of `cls` in order, those of each `flag_group` in its place."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        if field.metadata.get(_GROUP_OF_FLAGS):
            found += flag_fields(hints[field.name])
        elif "help" in field.metadata:
            found.append((field, hints[field.name]))
    return found


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags (declared with `option`, those of its `flag_group`s included)."""
    return [field for field, _ in flag_fields(cls)]


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _argparse_type(annotation: Any) -> tuple[Any, bool]:
    """(element type, is a sequence) of an annotation such as `int`, `list[int] | None`, `str | dict`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _argparse_type(members[0])
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return typing.get_args(annotation)[0], True
    if annotation in (int, float, str, bool, Path):
        return annotation, False
    return str, False


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, *, defaults: dict[str, Any] | None = None
) -> list[argparse.Action]:
    """Add a flag for every `option` field of `cls` (sections by `group`); `defaults` replaces the
    parser default of the named fields (the field's own default is then only shown in `--help`)."""
    groups: dict[str, Any] = {}
    actions = []
    for field, annotation in flag_fields(cls):
        options = dict(field.metadata)
        flag = options.pop("flag", "--" + field.name.replace("_", "-"))
        title = options.pop("group", None)
        positional = options.pop("positional", False)
        shown = options.pop(SHOWN_DEFAULT, None)
        kind, is_sequence = _argparse_type(annotation)
        default = _default(field)
        if kind is bool:
            options["action"] = "store_false" if default else "store_true"
        else:
            options.setdefault("type", kind)
            if is_sequence:
                options.setdefault("nargs", "+")
        if default is dataclasses.MISSING:
            options["required"] = True
        else:
            options["default"] = default
        if defaults and field.name in defaults:
            shown = default if shown is None else shown
            options["default"] = defaults[field.name]
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups.get(title, parser)
        if not positional:
            options["dest"] = field.name
        action = target.add_argument(field.name if positional else flag, **options)
        if shown is not None:
            setattr(action, SHOWN_DEFAULT, shown)
        actions.append(action)
    return actions


class DefaultsFormatter(argparse.HelpFormatter):
    """Help followed by "(default: ...)" for every flag that takes a value and has a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        shown = getattr(action, SHOWN_DEFAULT, action.default)
        if action.nargs == 0 or shown in (None, argparse.SUPPRESS) or shown == []:
            return action.help
        return f"{action.help} (default: {str(shown).replace('%', '%%')})"

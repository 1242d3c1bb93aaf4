"""Hub-ready checkpoints: flat copies of the code a saved model needs (`trust_remote_code`).

transformers loads remote code from files that sit flat next to the weights and import each
other with single-dot relative imports (`from .x import Y`); it copies the modeling file
named in `auto_map` and follows those imports. This package uses absolute imports
(`from hf_softmax_rnn.ops.attention import attention`), so after `save_pretrained` of a
model whose class was registered with `register_for_auto_class(...)`,
`RemoteCodeMixin.save_pretrained` calls `export_remote_code`, which

1. finds, with `ast`, every package module the modeling and configuration modules need
   (transitively, imports inside functions included);
2. writes each one flat into the checkpoint directory, rewriting
   `from hf_softmax_rnn.a.b import X` into `from .b import X`;
3. points `auto_map` in config.json at them (AutoConfig and the registered auto class).

A module's flat name is its basename; different modules whose basenames collide
(`ops/attention.py` and `layers/attention.py`) are named by their path in the package
instead (`ops_attention`, `layers_attention`). It fails loudly on what cannot be
flattened: an import of the package root, `import hf_softmax_rnn.x` statements, flat
names that still collide, and modules that register with Auto classes at import time
(only the package `__init__` may do that; it never travels).

This module uses only the standard library, so it can itself travel with the checkpoint.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_HEADER = "# Flat copy of {module} for trust_remote_code loading, written by hf_softmax_rnn.hub.\n"
_REGISTERING_CALLS = ("register", "register_for_auto_class")


@dataclass
class _Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module


def _load_module(name: str) -> _Module:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ImportError(f"export_remote_code: cannot find the source file of module {name!r}")
        path = spec.origin
    path = Path(path)
    return _Module(
        name, path, path.name == "__init__.py", ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    )


def _package_of(module: _Module) -> str:
    return module.name if module.is_package else module.name.rpartition(".")[0]


def _internal_target(module: _Module, node: ast.ImportFrom, root: str) -> str | None:
    """The absolute module an import-from names, if it lies inside `root`; else None."""
    relative = "." * node.level + (node.module or "")
    target = importlib.util.resolve_name(relative, _package_of(module)) if node.level else node.module
    if target != root and not target.startswith(root + "."):
        return None
    if target == root:
        raise ValueError(
            f"{module.path}:{node.lineno} imports the package root {root!r}; modules that travel with a checkpoint "
            f"must import from the module that defines the name (from {root}.<module> import ...)"
        )
    return target


def _check_module(module: _Module, root: str) -> None:
    """Reject `import root.x` statements and Auto-class registration at import time."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import) and any(
            alias.name == root or alias.name.startswith(root + ".") for alias in node.names
        ):
            raise ValueError(
                f"{module.path}:{node.lineno}: use `from {root}.<module> import name`, not `import {root}...`"
            )
    for statement in module.tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _REGISTERING_CALLS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id.startswith("Auto")
            ):
                raise ValueError(
                    f"{module.path}:{node.lineno} registers with {node.func.value.id} at import time; only the package "
                    "__init__ (which does not travel) may register with Auto classes"
                )


def needed_modules(entry_modules: list[str]) -> dict[str, _Module]:
    """The entry modules and every module of their package they import, transitively."""
    root = entry_modules[0].split(".")[0]
    found: dict[str, _Module] = {}
    pending = list(entry_modules)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        module = found[name] = _load_module(name)
        _check_module(module, root)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and (target := _internal_target(module, node, root)) is not None:
                pending.append(target)
    return found


def flat_names(sources: dict[str, str]) -> dict[str, str]:
    """Flat file stem per module (given as {module name: source text}): the basename, or, where
    different sources share a basename, the module path below the package root joined by '_'.
    Identical sources under one basename (the same file loaded twice, as remote code can be)
    share the basename."""
    root = next(iter(sources)).split(".")[0]
    by_basename: dict[str, list[str]] = {}
    for name in sources:
        by_basename.setdefault(name.rpartition(".")[2], []).append(name)
    names = {}
    for base, owners in by_basename.items():
        distinct = len({sources[owner] for owner in owners}) > 1
        for owner in owners:
            names[owner] = owner.removeprefix(root + ".").replace(".", "_") if distinct else base
    owners_of: dict[str, set[str]] = {}
    for module, stem in names.items():
        owners_of.setdefault(stem, set()).add(sources[module])
    for stem, texts in owners_of.items():
        if len(texts) > 1:
            clashing = sorted(module for module, other in names.items() if other == stem)
            raise ValueError(f"Modules {clashing} would all be flattened to {stem}.py")
    return names


def _rewrite(module: _Module, names: dict[str, str], root: str) -> str:
    """The module's source with internal imports turned into single-dot relative imports."""
    lines = module.path.read_text(encoding="utf-8").splitlines(keepends=True)
    imports = [
        (node, target)
        for node in ast.walk(module.tree)
        if isinstance(node, ast.ImportFrom) and (target := _internal_target(module, node, root)) is not None
    ]
    for node, target in sorted(imports, key=lambda item: item[0].lineno, reverse=True):
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        indent, tail = first[: node.col_offset], last[node.end_col_offset :]
        if indent.strip() or tail.split("#")[0].strip():
            raise ValueError(f"{module.path}:{node.lineno}: put each package import on its own line(s)")
        aliases = ", ".join(alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in node.names)
        lines[node.lineno - 1 : node.end_lineno] = [f"{indent}from .{names[target]} import {aliases}\n"]
    if lines and lines[0].startswith(_HEADER.partition("{")[0]):  # re-saving code that already travelled
        lines = lines[1:]
    return _HEADER.format(module=module.name) + "".join(lines)


def is_exported_code(path: str | os.PathLike) -> bool:
    """Whether `path` is a flat code file written by `export_remote_code` (it starts with its header)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.readline().startswith(_HEADER.partition("{")[0])


def export_remote_code(
    save_directory: str | os.PathLike, model_class: type, config_class: type, auto_class: str
) -> list[Path]:
    """Write flat modules for `model_class` and `config_class` into `save_directory` and
    point config.json's auto_map at them. Returns the files written."""
    directory = Path(save_directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"export_remote_code: {config_file} does not exist; call save_pretrained first")
    entries = [model_class.__module__, config_class.__module__]
    root = entries[0].split(".")[0]
    modules = needed_modules(entries)
    names = flat_names({name: module.path.read_text(encoding="utf-8") for name, module in modules.items()})
    written = []
    for name, module in modules.items():
        path = directory / f"{names[name]}.py"
        if path not in written:
            path.write_text(_rewrite(module, names, root), encoding="utf-8")
            written.append(path)
    for entry in entries:  # transformers copied the entry files by basename; drop copies we renamed
        copied = directory / f"{entry.rpartition('.')[2]}.py"
        if copied not in written and copied.exists():
            copied.unlink()

    config = json.loads(config_file.read_text(encoding="utf-8"))
    auto_map = config.get("auto_map", {})
    auto_map["AutoConfig"] = f"{names[config_class.__module__]}.{config_class.__name__}"
    auto_map[auto_class] = f"{names[model_class.__module__]}.{model_class.__name__}"
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info("Wrote %d flat code files for remote loading to %s", len(written), directory)
    return written


class RemoteCodeMixin:
    """Mixin for `PreTrainedModel` subclasses: `save_pretrained` of a class registered with
    `register_for_auto_class(...)`, or of a model whose config has an `auto_map` (loaded from a
    checkpoint saved that way), also writes the flat code files and auto_map, so that
    config.json never names code the folder does not hold."""

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs) -> None:
        # transformers logs this and returns, saving nothing
        if os.path.isfile(save_directory):
            raise NotADirectoryError(
                f"{type(self).__name__}.save_pretrained({str(save_directory)!r}): that path is a file; expected a "
                "folder to save into (new or existing)"
            )
        auto_class = self._remote_code_auto_class()
        if auto_class is None:
            return super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if kwargs.get("push_to_hub"):
            raise ValueError(
                f"{type(self).__name__}.save_pretrained(push_to_hub=True) would upload before the flat code files are "
                "written; call model.push_to_hub(repo_id) instead (it saves with them)"
            )
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            export_remote_code(save_directory, type(self), type(self.config), auto_class)
            self.config.auto_map = json.loads((Path(save_directory) / "config.json").read_text(encoding="utf-8"))[
                "auto_map"
            ]

    def _remote_code_auto_class(self) -> str | None:
        """The Auto class a saved checkpoint names in auto_map: the registered one, else the model
        class's entry of `config.auto_map`; None for a plain checkpoint (no auto_map)."""
        if self.is_remote_code():
            return self._auto_class
        auto_map = getattr(self.config, "auto_map", None) or {}
        if not auto_map:
            return None
        return next((name for name in auto_map if name != "AutoConfig"), "AutoModelForCausalLM")

"""Loading a script of `scripts/` as a module, and a tiny Llama config folder to time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from transformers import LlamaConfig

from ..models.helpers import LLAMA_SHAPE

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str, monkeypatch):
    """`scripts/<name>.py` as the module `name` (registered, since dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def tiny_config_dir(tmp_path: Path, max_positions: int) -> Path:
    """A folder holding the config.json of the tests' tiny Llama."""
    config_dir = tmp_path / "config"
    LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=max_positions).save_pretrained(config_dir)
    return config_dir

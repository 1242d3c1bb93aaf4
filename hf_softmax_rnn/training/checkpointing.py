"""Atomic checkpoints that a killed run resumes from bit for bit.

A checkpoint is a folder `checkpoints/checkpoint-<global step>` holding Accelerate's state
(model weights, optimizer, gradient scaler, each process's RNG states) plus this package's
`trainer_state.json` (stage, step, data position, evaluations, settings) and `scheduler.pt`.
It is written under a temporary name and renamed when complete, and older checkpoints are
removed only after that rename, so the newest complete checkpoint survives a kill at any moment.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_TEMPORARY_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


@dataclass
class TrainerState:
    """Where a run stands: everything besides tensors that a resumed run needs.

    global_step counts optimizer steps over all stages; stage_index / stage_step locate it in
    the run's stages; data is the block reader's position; evaluations maps a point of the run
    ("base", "converted", "transfer", "finetune") to its held-out metrics; trainable_parameters
    counts them per stage; config is the run's `FinetuneConfig.to_dict()`.
    """

    global_step: int = 0
    stage_index: int = 0
    stage_step: int = 0
    data: dict = field(default_factory=dict)
    evaluations: dict = field(default_factory=dict)
    trainable_parameters: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        return cls(**json.loads(path.read_text()))


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and (p / TRAINER_STATE_FILE).is_file()
    ]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def remove_incomplete(output_dir: str | Path) -> None:
    """Delete what a killed run left half-written or half-deleted (main process only)."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith((_TEMPORARY_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(accelerator, output_dir: str | Path, state: TrainerState, scheduler, *, keep: int) -> Path:
    """Write a checkpoint for `state.global_step` atomically, then keep only the newest `keep`.

    Called on every process (each one writes its RNG states)."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    final = root / f"checkpoint-{state.global_step:07d}"
    temporary = root / f"{_TEMPORARY_PREFIX}{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), temporary / SCHEDULER_FILE)
        state.save(temporary / TRAINER_STATE_FILE)
        if final.exists():
            _discard(final)
        os.replace(temporary, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            _discard(old)
        logger.info("Saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def _discard(path: Path) -> None:
    """Rename out of the way first (atomic), so a half-deleted folder never looks like a checkpoint."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}")
    os.replace(path, trash)
    shutil.rmtree(trash)


def load_checkpoint(accelerator, path: Path, scheduler) -> TrainerState:
    """Restore the prepared model and optimizer, RNG states and scheduler from `path`."""
    accelerator.load_state(str(path))
    scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, weights_only=True))
    logger.info("Resumed from %s", path)
    return TrainerState.load(path / TRAINER_STATE_FILE)

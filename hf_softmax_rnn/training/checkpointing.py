"""Atomic, verified checkpoints that a killed run resumes from bit for bit.

A checkpoint is a folder `checkpoints/checkpoint-<global step>` holding Accelerate's state
(model weights, optimizer, gradient scaler, each process's RNG states) plus this package's
`trainer_state.json` (stage, step, data position, data fingerprint, evaluations, settings),
`scheduler.pt` and, written last, `manifest.json` (size and sha256 of every other file).
It is written under a temporary name and renamed when complete, and older checkpoints are
removed only after that rename, so the newest complete checkpoint survives a kill at any moment.

`--resume` takes the newest checkpoint that verifies against its manifest (warning about each
newer one that does not, naming the file), and refuses (`InexactResumeError`) to continue where
the result could not be exact: RNG states missing or unreadable, or training data whose
fingerprint differs from the checkpoint's; `--allow-inexact-resume` turns that into a warning.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import broadcast_object_list
from accelerate.utils import load as accelerate_load
from accelerate.utils.constants import RNG_STATE_NAME
from safetensors import safe_open

from hf_softmax_rnn.default_model import weight_file_problem
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training.data import ShuffledBlocks, StreamedBlocks
from hf_softmax_rnn.training.disk import bytes_in, reporting_full_disk

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
MANIFEST_FILE = "manifest.json"
#: Training blocks of a streamed dataset that its fingerprint covers (a stream is not read whole).
FINGERPRINT_STREAM_BLOCKS = 64
#: What Accelerate's RNG state files hold on every machine.
_RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
#: The files of a checkpoint that hold tensors (Accelerate's weights and optimizer, the scheduler), checked readable.
TENSOR_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "optimizer*.bin", SCHEDULER_FILE)
_NAME = re.compile(r"^checkpoint-(\d+)$")
_TEMPORARY_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


@dataclass
class TrainerState:
    """Where a run stands: everything besides tensors that a resumed run needs.

    global_step counts optimizer steps over all stages; stage_index / stage_step locate it in
    the run's stages; data is the block reader's position and data_fingerprint what it reads
    (`data_fingerprint`); evaluations maps a point of the run ("base", "converted", "transfer",
    "finetune") to its held-out metrics; trainable_parameters counts them per stage; config is
    the run's `FinetuneConfig.to_dict()`.
    """

    global_step: int = 0
    stage_index: int = 0
    stage_step: int = 0
    data: dict = field(default_factory=dict)
    data_fingerprint: str = ""
    evaluations: dict = field(default_factory=dict)
    trainable_parameters: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        return cls(**json.loads(path.read_text()))


def named_checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The folders named as checkpoints (`checkpoint-<global step>`), complete or not, oldest first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those holding their trainer state), oldest first."""
    return [path for path in named_checkpoint_dirs(output_dir) if (path / TRAINER_STATE_FILE).is_file()]


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
    previous = checkpoint_dirs(output_dir)[-1:]
    needed = bytes_in(previous[0]) if previous else _model_bytes(accelerator)
    with reporting_full_disk(temporary, "checkpoint", needed):
        accelerator.save_state(str(temporary))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            torch.save(scheduler.state_dict(), temporary / SCHEDULER_FILE)
            state.save(temporary / TRAINER_STATE_FILE)
            write_manifest(temporary)
    if accelerator.is_main_process:
        if final.exists():
            _discard(final)
        os.replace(temporary, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            _discard(old)
        logger.info("Saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def _model_bytes(accelerator) -> int:
    """Bytes of the prepared models' tensors (what a first checkpoint needs at least)."""
    return sum(t.numel() * t.element_size() for model in accelerator._models for t in model.state_dict().values())


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


# ---------------------------------------------------------------------------------- verification
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record size and sha256 of every file in `directory` in its manifest.json (the last file written)."""
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }
    (directory / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=2))


def checkpoint_problems(path: Path) -> list[str]:
    """What keeps checkpoint `path` from being resumed, one line per file: its trainer state missing, a file
    that does not match its manifest (missing, truncated or changed), no readable manifest, or, when everything
    matches, a file that cannot be read as what it is (the trainer state as JSON, the weights, optimizer and
    scheduler as safetensors or pickles of tensors that torch's weights-only loader takes); [] when it resumes."""
    problems = [] if (path / TRAINER_STATE_FILE).is_file() else [f"{TRAINER_STATE_FILE} is missing"]
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [*problems, f"{MANIFEST_FILE} is missing or unreadable ({error.__class__.__name__})"]
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != expected["size"]:
            problems.append(f"{name} has {file.stat().st_size} bytes instead of {expected['size']}")
        elif _sha256(file) != expected["sha256"]:
            problems.append(f"{name} does not match its sha256 (corrupted)")
    return list(dict.fromkeys(problems)) or _unreadable_files(path)


def _unreadable_files(path: Path) -> list[str]:
    """The files of checkpoint `path` that `--resume` reads and that cannot be read as what they are."""
    try:
        TrainerState.load(path / TRAINER_STATE_FILE)
    except (ValueError, TypeError) as error:
        return [f"{TRAINER_STATE_FILE} is no trainer state ({error.__class__.__name__}: {error})"]
    files = sorted(file for pattern in TENSOR_FILE_PATTERNS for file in path.glob(pattern))
    return [f"{file.name}: {problem}" for file in files if (problem := weight_file_problem(file))]


def _newest_intact(output_dir: Path) -> tuple[str | None, str | None]:
    """(newest checkpoint that verifies, error message): warns about each newer one that does not."""
    found = named_checkpoint_dirs(output_dir)
    damaged = []
    for path in reversed(found):
        problems = checkpoint_problems(path)
        if not problems:
            return str(path), None
        logger.warning(
            "Checkpoint %s is damaged: %s; falling back to the previous checkpoint", path, "; ".join(problems)
        )
        damaged.append(f"{path.name}: {'; '.join(problems)}")
    if not found:
        return None, None
    return None, (
        f"--resume: no checkpoint in {output_dir / CHECKPOINTS_DIR} is complete and intact ({'; '.join(damaged)}); "
        "start a new run with --overwrite or another --output-dir"
    )


def checkpoint_to_resume(accelerator, output_dir: str | Path) -> Path | None:
    """The newest checkpoint of `output_dir` that verifies against its manifest, None if there is
    none at all; raises `UserInputError` when checkpoints exist but none verifies. Verified by the
    main process, the same answer on every process."""
    answer = [_newest_intact(Path(output_dir)) if accelerator.is_main_process else None]
    path, error = broadcast_object_list(answer)[0]
    if error is not None:
        raise UserInputError(error)
    return None if path is None else Path(path)


#: The optimizer state and the weights Accelerate saves in a checkpoint (of a run's one optimizer and model).
OPTIMIZER_FILE, MODEL_FILE = "optimizer.bin", "model.safetensors"
#: The most weight names a refusal lists.
LISTED_NAMES = 3


def _some(names: list[str]) -> str:
    more = f", and {len(names) - LISTED_NAMES} more" if len(names) > LISTED_NAMES else ""
    return ", ".join(names[:LISTED_NAMES]) + more


def model_state_problem(path: Path, module: torch.nn.Module) -> str | None:
    """How the weights in checkpoint `path` do not fit `module` (the one the run trains now, which
    `accelerator.load_state` loads them into, strictly): weights missing (but for a tied one saved once),
    left over or of another shape; None when they fit, or when the checkpoint holds no safetensors file."""
    if not (path / MODEL_FILE).is_file():
        return None
    with safe_open(path / MODEL_FILE, "pt") as saved:
        shapes = {key: list(saved.get_slice(key).get_shape()) for key in saved.keys()}
    state = module.state_dict()
    saved_storage = {tensor.data_ptr() for key, tensor in state.items() if key in shapes}
    missing = [key for key, tensor in state.items() if key not in shapes and tensor.data_ptr() not in saved_storage]
    left_over = [key for key in shapes if key not in state]
    resized = [
        f"{key} {shapes[key]} in the file, {list(state[key].shape)} now"
        for key in shapes
        if key in state and shapes[key] != list(state[key].shape)
    ]
    problems = [
        f"{len(names)} weight{'s' if len(names) != 1 else ''} {what} ({_some(names)})"
        for what, names in (("missing", missing), ("left over", left_over), ("of another shape", resized))
        if names
    ]
    return "; ".join(problems) or None


def _group_sizes(sizes: list[int]) -> str:
    groups, tensors = f"parameter group{'s' if len(sizes) != 1 else ''}", f"tensor{'s' if sum(sizes) != 1 else ''}"
    return f"{len(sizes)} {groups} of {'+'.join(map(str, sizes))} {tensors}"


def optimizer_state_problem(path: Path, groups: list[dict]) -> str | None:
    """How the optimizer state in checkpoint `path` does not fit the parameter `groups` that the run trains
    now (as `torch.optim.Optimizer` takes them): other group sizes, or a moment of another shape than its
    parameter; None when it fits (torch would refuse the first, and fail at the first step on the second)."""
    saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    saved_sizes = [len(group["params"]) for group in saved["param_groups"]]
    sizes = [len(group["params"]) for group in groups]
    if saved_sizes != sizes:
        return f"{_group_sizes(saved_sizes)} in the file, {_group_sizes(sizes)} now"
    for group_index, (saved_group, group) in enumerate(zip(saved["param_groups"], groups, strict=True)):
        for position, (index, parameter) in enumerate(zip(saved_group["params"], group["params"], strict=True)):
            for name, moment in saved["state"].get(index, {}).items():
                if torch.is_tensor(moment) and moment.dim() and moment.shape != parameter.shape:
                    return (
                        f"{name} of tensor {position} of parameter group {group_index} has shape "
                        f"{list(moment.shape)} in the file, its parameter {list(parameter.shape)} now"
                    )
    return None


# ---------------------------------------------------------------------------------- exact resume
class InexactResumeError(UserInputError):
    """`--resume` could not continue exactly where the checkpoint stopped (see `check_exact_resume`)."""


def _rng_state_problem(path: Path, process_index: int) -> str | None:
    file = path / f"{RNG_STATE_NAME}_{process_index}.pkl"
    if not file.is_file():
        return f"{file.name} is missing"
    try:
        states = accelerate_load(file)
    except Exception as error:  # unpickling fails in many ways; each means the same here
        return f"{file.name} is unreadable ({error.__class__.__name__})"
    if not isinstance(states, dict) or any(key not in states for key in _RNG_KEYS):
        return f"{file.name} lacks the random states"
    return None


def _inexact_reasons(path: Path, num_processes: int, saved_fingerprint: str, fingerprint: str) -> list[str]:
    reasons = [problem for index in range(num_processes) if (problem := _rng_state_problem(path, index))]
    if saved_fingerprint != fingerprint:
        reasons.append(
            f"the training data changed since the checkpoint (fingerprint {saved_fingerprint[:12] or 'none'} "
            f"then, {fingerprint[:12]} now)"
        )
    return reasons


def check_exact_resume(accelerator, path: Path, state: TrainerState, fingerprint: str, *, allow_inexact: bool) -> None:
    """Refuse (`InexactResumeError`) to resume from checkpoint `path` when the result could not be the
    one of an uninterrupted run: a process's RNG states missing or unreadable, or training data
    whose `fingerprint` differs from `state.data_fingerprint`; with `allow_inexact`, warn instead."""
    reasons = [
        _inexact_reasons(path, accelerator.num_processes, state.data_fingerprint, fingerprint)
        if accelerator.is_main_process
        else None
    ]
    reasons = broadcast_object_list(reasons)[0]
    if not reasons:
        return
    if not allow_inexact:
        raise InexactResumeError(
            f"--resume cannot continue {path.name} exactly: {'; '.join(reasons)}; restore what changed, or pass "
            "--allow-inexact-resume to continue anyway"
        )
    logger.warning(
        "Resuming from %s is not exact (%s): the result will differ from an uninterrupted run",
        path,
        "; ".join(reasons),
    )


def data_fingerprint(train_data: list[ShuffledBlocks | StreamedBlocks], held_out: torch.Tensor) -> str:
    """sha256 of the token ids a run trains and evaluates on: every training block of each stream in
    turn (the first `FINGERPRINT_STREAM_BLOCKS` of a streamed one) with their count, and the held-out blocks."""
    digest = hashlib.sha256()
    for blocks in train_data:
        if isinstance(blocks, ShuffledBlocks):
            digest.update(f"{len(blocks)} blocks\n".encode())
            for batch in blocks.blocks.with_format("numpy", columns=["input_ids"]).iter(batch_size=4096):
                digest.update(np.ascontiguousarray(batch["input_ids"]).tobytes())
        else:
            rows = itertools.islice(iter(blocks.blocks), FINGERPRINT_STREAM_BLOCKS)
            digest.update(f"stream\n{[row['input_ids'] for row in rows]}\n".encode())
    digest.update(held_out.cpu().numpy().tobytes())
    return digest.hexdigest()

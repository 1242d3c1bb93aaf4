"""The output folder of a fine-tuning run: checked before anything is written, then claimed.

A run writes into a folder that is new or empty, or that holds a run of this package (marked by
`MARKER_FILE`, written before anything else, so every folder a run wrote into carries it): one that
has checkpoints only with --resume (continue) or --overwrite (start over), a finished one with
--resume (write and push its outputs again) or --overwrite. A folder holding other files (a
`checkpoints/` folder of another tool included), or that is, contains or lies inside the --model
folder, needs --overwrite; --overwrite then deletes none of its files (only a marked run folder has a
previous run to clear), the run writes its own beside them.
While the run lasts it holds an exclusive `fcntl.flock` on `LOCK_FILE`, so a second run into the
same folder stops at once with a message naming the first.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import IO

from accelerate.utils import broadcast_object_list

from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training.checkpointing import CHECKPOINTS_DIR, checkpoint_dirs, remove_incomplete
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.metrics import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from hf_softmax_rnn.training.outputs import ADAPTER_BASE_DIR, ADAPTER_DIR, MODEL_FILES, RESULTS_FILE
from hf_softmax_rnn.training.transfer_report import LAYER_MSE_FILE
from hf_softmax_rnn.version import __version__

logger = logging.getLogger(__name__)

MARKER_FILE = ".hf_softmax_rnn_run.json"
LOCK_FILE = ".hf_softmax_rnn.lock"
#: What a replaced run leaves that the new one would not overwrite (--overwrite removes it first).
PREVIOUS_RUN = (CHECKPOINTS_DIR, TENSORBOARD_DIR, ADAPTER_DIR, ADAPTER_BASE_DIR, METRICS_FILE, RESULTS_FILE)
#: The folders a run writes into, and the files it writes (of its model, its card and records, its marker and
#: lock): a path of the other kind in their place would stop the run after it trained.
RUN_FOLDERS = (CHECKPOINTS_DIR, TENSORBOARD_DIR, ADAPTER_DIR, ADAPTER_BASE_DIR)
RUN_FILES = (
    *(name for name in MODEL_FILES if "*" not in name),
    "README.md",
    METRICS_FILE,
    RESULTS_FILE,
    PLOT_FILE,
    LAYER_MSE_FILE,
    MARKER_FILE,
    LOCK_FILE,
)
#: Lock file handles held by this process, by folder: a later claim from the same process (runs one
#: after the other in one interpreter) takes the lock over instead of failing.
_HELD: dict[Path, IO] = {}


def read_marker(directory: Path) -> dict | None:
    """The run marker of `directory`, or None if it is not (readably) a run folder of this package."""
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_marker(directory: Path, *, finished: bool) -> None:
    marker = {"created_by": "hf_softmax_rnn", "version": __version__, "finished": finished}
    (directory / MARKER_FILE).write_text(json.dumps(marker) + "\n")


def _check_model_overlap(directory: Path, model: str, flag: str = "--model") -> None:
    path = Path(model).expanduser()
    if model == DEFAULT_MODEL_ALIAS or not path.is_dir():
        return
    output, model_dir = directory.resolve(), path.resolve()
    if output == model_dir:
        relation = f"is the {flag} folder"
    elif model_dir in output.parents:
        relation = f"is inside the {flag} folder {str(model_dir)!r}"
    elif output in model_dir.parents:
        relation = f"contains the {flag} folder {str(model_dir)!r}"
    else:
        return
    raise UserInputError(
        f"--output-dir {str(directory)!r} {relation}: the run would write over or next to the model's files; "
        "choose another --output-dir, or pass --overwrite"
    )


def _holder(directory: Path) -> str | None:
    """Who holds the lock of `directory` (another process), or None (read-only probe)."""
    lock = directory / LOCK_FILE
    if directory.resolve() in _HELD or not lock.is_file():
        return None
    with lock.open() as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "another process"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _in_use(directory: Path, holder: str) -> UserInputError:
    return UserInputError(
        f"--output-dir {str(directory)!r} is in use by another hf-softmax-rnn run ({holder}); wait for it to finish "
        "or choose another --output-dir"
    )


def _check_contents(directory: Path, config: FinetuneConfig) -> None:
    contents = sorted(p.name for p in directory.iterdir() if p.name not in (MARKER_FILE, LOCK_FILE))
    if not contents or config.output.overwrite:
        return
    marker = read_marker(directory)
    if marker is None:
        shown = ", ".join(contents[:5]) + (", ..." if len(contents) > 5 else "")
        raise UserInputError(
            f"--output-dir {str(directory)!r} holds files that are not from a hf-softmax-rnn run ({shown}); choose a "
            "new or empty folder, or pass --overwrite to write into it anyway"
        )
    if config.output.resume:
        return
    checkpoints = checkpoint_dirs(directory)
    if checkpoints:
        status = "finished" if marker and marker.get("finished") else "did not finish"
        raise UserInputError(
            f"Output directory {str(directory)!r} already holds checkpoints (latest {checkpoints[-1].name}; the run "
            f"{status}); pass --resume to continue that run, --overwrite to start over, or choose another --output-dir"
        )
    if marker and marker.get("finished"):
        raise UserInputError(
            f"--output-dir {str(directory)!r} holds a finished run; pass --overwrite to replace it, or choose another "
            "--output-dir"
        )


def check_output_dir(config: FinetuneConfig) -> None:
    """Refuse (`UserInputError`) an output folder the run may not write into; writes nothing."""
    directory = Path(config.output_dir)
    if directory.exists() and not directory.is_dir():
        raise UserInputError(f"--output-dir {str(directory)!r} is a file; expected a folder")
    if not config.output.overwrite:
        _check_model_overlap(directory, config.model.model)
        if config.model.teacher is not None:
            _check_model_overlap(directory, config.model.teacher, "--teacher")
    if not directory.is_dir():
        return
    holder = _holder(directory)
    if holder is not None:
        raise _in_use(directory, holder)
    _check_contents(directory, config)
    _check_run_paths(directory, config)


def _check_run_paths(directory: Path, config: FinetuneConfig) -> None:
    """Refuse a path the run writes that is of the other kind: a file where it makes a folder (`checkpoints`),
    a folder where it writes a file; what `--overwrite` removes from a run folder first (`PREVIOUS_RUN`) is none."""
    removed = PREVIOUS_RUN if config.output.overwrite and read_marker(directory) is not None else ()
    for name in (*RUN_FOLDERS, *RUN_FILES):
        path, folder = directory / name, name in RUN_FOLDERS
        if name in removed or not (path.exists() or path.is_symlink()) or path.is_dir() == folder:
            continue
        held, written = ("a file", "a folder") if folder else ("a folder", "a file")
        raise UserInputError(
            f"--output-dir {str(directory)!r} holds {held} {name!r} where the run writes {written} of that name; move "
            "or delete it, or choose another --output-dir"
        )


class OutputDirClaim:
    """This run's hold on its output folder: the lock (main process only) until `finish()`."""

    def __init__(self, directory: Path, handle: IO | None) -> None:
        self.directory = directory
        self.handle = handle

    def finish(self) -> None:
        """Mark the run finished (its outputs are written) and release the lock."""
        if self.handle is None:
            return
        _write_marker(self.directory, finished=True)
        _release(self.directory.resolve())
        self.handle = None


def _lock(directory: Path) -> IO:
    key = directory.resolve()
    if key in _HELD:
        _release(key)
    handle = (directory / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise _in_use(directory, holder) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _HELD[key] = handle
    return handle


def _release(key: Path) -> None:
    handle = _HELD.pop(key)
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


def _clear_previous_run(directory: Path) -> None:
    """--overwrite of a run folder: remove what the replaced run wrote that this one would not overwrite."""
    for name in PREVIOUS_RUN:
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    logger.warning("--overwrite: removed the previous run's checkpoints and records from %s", directory)


def _claim(config: FinetuneConfig) -> IO:
    directory = Path(config.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    handle = _lock(directory)
    if read_marker(directory) is not None:  # only a run folder holds what a previous run left
        if config.output.overwrite:
            _clear_previous_run(directory)
        remove_incomplete(directory)
    _write_marker(directory, finished=False)
    return handle


def claim_output_dir(config: FinetuneConfig, accelerator) -> OutputDirClaim:
    """Lock the output folder for this run, mark it as a run folder (unfinished), clear what a
    replaced run (--overwrite) or a killed one (half-written checkpoints) left. The main process
    claims; a refusal (another run holds the lock) is raised on every process."""
    handle, error = None, None
    if accelerator.is_main_process:
        try:
            handle = _claim(config)
        except UserInputError as refusal:
            error = str(refusal)
    error = broadcast_object_list([error])[0]
    if error is not None:
        raise UserInputError(error)
    accelerator.wait_for_everyone()
    return OutputDirClaim(Path(config.output_dir), handle)

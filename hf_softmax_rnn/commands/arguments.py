"""What every subcommand checks before any work: the package's environment settings and the folders it
writes into (`hf_softmax_rnn.cli` runs both; the flags themselves are built by `hf_softmax_rnn.flags`)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from hf_softmax_rnn.errors import UserInputError, user_input_checks
from hf_softmax_rnn.ops import backends

#: Flags that name a folder a command writes into (created if missing, files in it replaced).
OUTPUT_FOLDER_FLAGS = ("output", "output_dir")


def check_environment() -> None:
    """Before any work: the package's environment settings hold allowed values."""
    with user_input_checks():
        backends.state_segment_length()


def check_output_folders(args: argparse.Namespace) -> None:
    """Before any work: every output folder flag names a folder that is, or can be created, writable
    (not an existing file, not under a file, not in a read-only place)."""
    for name in OUTPUT_FOLDER_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag, path = f"--{name.replace('_', '-')}", Path(value)
        if "\0" in str(value):
            raise UserInputError(
                f"{flag}={str(value)!r} holds a NUL byte, which no path can hold; expected a folder name"
            )
        if path.exists() and not path.is_dir():
            raise UserInputError(f"{flag}={value} is an existing file; expected a folder to write into (or a new name)")
        existing = next(parent for parent in (path, *path.absolute().parents) if parent.exists())
        if not existing.is_dir():
            raise UserInputError(f"{flag}={value} lies under {existing}, which is a file, not a folder")
        _check_folder_creatable(f"{flag}={value}", existing)


#: Prefix of the folder `_check_folder_creatable` creates and removes at once.
_PROBE_PREFIX = ".hf_softmax_rnn-write-check-"


def _check_folder_creatable(given: str, existing: Path) -> None:
    """Create and remove a folder in `existing`, the nearest existing folder of an output path: permission
    bits (`os.access`) say yes to root and to places that refuse every write (/sys, a read-only mount)."""
    try:
        probe = tempfile.mkdtemp(prefix=_PROBE_PREFIX, dir=existing)
    except OSError as error:
        raise UserInputError(
            f"{given} cannot be written: no folder can be created in {existing} ({error.strerror or error}); "
            "expected a writable place"
        ) from error
    os.rmdir(probe)

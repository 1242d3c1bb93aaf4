"""A full disk (or a file size limit, `ulimit -f`) while saving: one line naming the path and the bytes.

Writers report it differently: an `OSError` with errno ENOSPC / EFBIG / EDQUOT (Python files),
a `SafetensorError` (safetensors), a `RuntimeError` from torch.save's zip writer; each becomes a
`DiskFullError` (exit status 2), whose message names what was being written, about how many bytes
it needs and how many are free on the disk. Checkpoints are written into a temporary folder and
renamed when complete, so the ones saved before stay intact.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hf_softmax_rnn.errors import CommandError

_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
#: How the writers that do not raise OSError word a full disk or a file size limit.
_FULL_WORDS = ("no space left", "file too large", "quota exceeded", "storagefull", "filetoolarge", "write failed")


class DiskFullError(CommandError, OSError):
    """Saving stopped for lack of disk space (or a file size limit); earlier checkpoints are intact."""

    exit_code = 2


def _is_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
        return True
    return any(word in str(error).lower() for word in _FULL_WORDS)


def bytes_in(path: Path) -> int:
    """Bytes of the files in folder `path` (0 if it does not exist)."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) if path.is_dir() else 0


@contextmanager
def reporting_full_disk(path: str | Path, what: str, needed: int) -> Iterator[None]:
    """Turn a full disk while writing `what` (about `needed` bytes) into `path` into a `DiskFullError`;
    anything else propagates."""
    path = Path(path)
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        if not _is_full(error):
            raise
        existing = next(parent for parent in (path, *path.absolute().parents) if parent.exists())
        free = shutil.disk_usage(existing).free
        raise DiskFullError(
            f"Could not write {what} {path}: {' '.join(str(error).split())[:200]} (it needs about {needed:,} bytes, "
            f"{free:,} are free on its disk); the checkpoints saved before are intact. Free space (or raise the file "
            "size limit) and continue with --resume"
        ) from error

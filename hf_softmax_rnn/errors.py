"""Errors that the `hf-softmax-rnn` command reports in one line instead of a traceback.

`UserInputError` is bad input (a setting, file or folder the user named): its message names the
bad value and what is allowed, and it is raised before anything is written. `CommandError` is
a command that failed in an expected way (an upload after everything was saved, a run that
diverged). Every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserInputError(ValueError):
    """A setting, file or folder given by the user is not allowed (the command exits with status 2)."""

    exit_code = 2


class CommandError(Exception):
    """A command failed in an expected way; the command exits with `exit_code`."""

    exit_code = 1


class TrainingDivergedError(CommandError, FloatingPointError):
    """Training produced a non-finite loss, gradient or parameter; nothing of it was saved."""


class MissingPackageError(CommandError, ImportError):
    """An optional package the command needs is not installed; the message says how to install it."""

    exit_code = 2


@contextmanager
def user_input_checks(*errors: type[Exception]) -> Iterator[None]:
    """Re-raise `errors` (default: ValueError) from inside as `UserInputError`.

    For calls whose every such error is about their input (checks in code that raises plain
    exceptions); wrapping anything else would hide bugs behind a one-line message.
    """
    wrapped = errors or (ValueError,)
    try:
        yield
    except UserInputError:
        raise
    except Exception as error:
        if not isinstance(error, wrapped):
            raise
        raise UserInputError(str(error)) from error

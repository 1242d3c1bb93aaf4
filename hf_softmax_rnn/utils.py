"""Small helpers that modules of every layer share: range checks of a setting, the device to run on,
the hardware a measurement ran on, and durations in words."""

from __future__ import annotations

import math
import numbers
import os
from collections import Counter
from collections.abc import Sequence

import torch

from hf_softmax_rnn.errors import UserInputError


# ---------------------------------------------------------------------------------- range checks
def check_at_least(flag: str, value: float | None, minimum: int = 1) -> None:
    """Refuse `value` below `minimum` (None passes: the flag was not given)."""
    if value is not None and not value >= minimum:
        kind = "an int" if isinstance(value, int) else "a number"
        raise UserInputError(f"{flag}={value!r} is not allowed; expected {kind} >= {minimum}")
    if value is not None and not math.isfinite(value):  # (a weight decay of inf diverges at the first step)
        raise UserInputError(f"{flag}={value!r} is not allowed; expected a finite number >= {minimum}")


def check_positive(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserInputError(f"{flag}={value!r} is not allowed; expected a number > 0")


#: Seeds that every generator of the package accepts (numpy's refuse negatives; finetune's `seed` has the same range).
SEED_RANGE = range(2**32)
_SEED_RANGE_TEXT = "from 0 to 2**32 - 1"


def _is_seed(seed) -> bool:
    return isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and seed in SEED_RANGE


def check_seed(flag: str, seed: int) -> None:
    """Refuse a seed outside `SEED_RANGE`."""
    if not _is_seed(seed):
        raise UserInputError(f"{flag}={seed!r} is not allowed; expected an int {_SEED_RANGE_TEXT}")


def check_seeds(flag: str, seeds: Sequence[int]) -> None:
    """One run per seed: at least one seed, each in `SEED_RANGE`, none repeated (a repeat would be the
    same run counted twice, shown as if it were an independent seed)."""
    given = f"{flag} {' '.join(map(str, seeds))}"
    if not seeds:
        raise UserInputError(f"{flag} is empty; expected at least one seed")
    bad = next((seed for seed in seeds if not _is_seed(seed)), None)
    if bad is not None:
        raise UserInputError(f"{given} has seed {bad!r}, which is not allowed; expected ints {_SEED_RANGE_TEXT}")
    repeated = [seed for seed, count in Counter(seeds).items() if count > 1]
    if repeated:
        shown = ", ".join(map(str, repeated))
        raise UserInputError(
            f"{given} repeats seed {shown}; expected distinct seeds (each seed is one independent run)"
        )


def check_distinct(flag: str, values: Sequence, consequence: str) -> None:
    """Refuse a list that names a value twice; `consequence` says what the repeat would do."""
    repeated = next((value for index, value in enumerate(values) if value in values[:index]), None)
    if repeated is not None:
        raise UserInputError(f"{flag} names {repeated!r} more than once ({consequence}); name each once")


# ---------------------------------------------------------------------------------- devices and threads
#: Help of a `--device` flag: the values `resolve_device` accepts.
DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps"
#: Help of a `--threads` flag (`set_threads`).
THREADS_HELP = "torch CPU threads (default: torch's choice)"


def resolve_device(device: str | torch.device, *, name: str = "--device") -> torch.device:
    """ "auto" -> cuda if available, else mps, else cpu; anything else as given, if this machine has it.
    `name` is how a refusal names the setting (the flag, or a function's argument)."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    allowed = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name}={device!r} is not allowed; expected {allowed}")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise UserInputError(f"{name}={device!r} is not allowed; expected {allowed}") from error
    if not _is_available(resolved):
        raise UserInputError(
            f"{name}={device!r} is not available on this machine; expected one of {available_devices()}"
        )
    return resolved


def available_devices() -> list[str]:
    """The devices `resolve_device` accepts on this machine: 'auto', 'cpu', then each GPU."""
    gpus = [f"cuda:{index}" for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["auto", "cpu", *(["cuda"] if gpus else []), *gpus, *(["mps"] if torch.backends.mps.is_available() else [])]


def _is_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return torch.backends.mps.is_available()
    backend = getattr(torch, device.type, None)
    return bool(getattr(backend, "is_available", lambda: False)())


def set_threads(threads: int | None) -> None:
    """`torch.set_num_threads(threads)`, unless None (torch's choice)."""
    check_at_least("--threads", threads)
    if threads is not None:
        torch.set_num_threads(threads)


def hardware_name(device: torch.device) -> str:
    """The GPU's name, or the number of CPU threads torch uses."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"


# ---------------------------------------------------------------------------------- durations
def minutes_and_seconds(seconds: float) -> str:
    """583.4 -> "9 min 43 s"; 41.2 -> "41 s"."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def device_memory_bytes(device: torch.device | str) -> int | None:
    """The memory of `device` in bytes (a GPU's, or the machine's for the CPU); None for other devices."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None

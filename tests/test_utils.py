"""`hf_softmax_rnn.utils`: device and thread settings refused in one line naming the setting, durations in
words, and the same objects behind the names that the analysis and training modules also offer."""

import pytest
import torch

from hf_softmax_rnn import utils
from hf_softmax_rnn.analysis import bench_report, small_models
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training import metrics
from hf_softmax_rnn.utils import check_distinct, minutes_and_seconds, resolve_device, set_threads


def test_resolve_device_refuses_unknown_and_missing_devices(monkeypatch):
    with pytest.raises(UserInputError, match=r"--device='tpu9' is not allowed; expected 'auto', 'cpu'"):
        resolve_device("tpu9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(
        UserInputError, match=r"--device='cuda' is not available on this machine; expected one of \['auto', 'cpu'\]$"
    ):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "mps")


def test_set_threads_refuses_zero():
    with pytest.raises(UserInputError, match=r"--threads=0 is not allowed; expected an int >= 1"):
        set_threads(0)


def test_resolve_device_names_the_argument_it_checks():
    with pytest.raises(UserInputError, match=r"^device='tpu9' is not allowed; expected 'auto', 'cpu'"):
        resolve_device("tpu9", name="device")
    with pytest.raises(TypeError, match=r"^device=0 is not allowed; expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"):
        resolve_device(0, name="device")
    assert resolve_device(torch.device("cpu"), name="device") == torch.device("cpu")


DURATIONS = {"seconds": (41.2, "41 s"), "minutes": (583.4, "9 min 43 s"), "rounded-up": (59.6, "1 min 0 s")}


@pytest.mark.parametrize("seconds,words", DURATIONS.values(), ids=DURATIONS.keys())
def test_minutes_and_seconds(seconds, words):
    assert minutes_and_seconds(seconds) == words


KEPT_PATHS = {
    "small_models": (
        small_models,
        ("resolve_device", "available_devices", "set_threads", "check_at_least", "check_seeds"),
    ),
    "bench_report": (bench_report, ("hardware_name",)),
    "training.metrics": (metrics, ("minutes_and_seconds",)),
}


@pytest.mark.parametrize("module,names", KEPT_PATHS.values(), ids=KEPT_PATHS.keys())
def test_names_offered_elsewhere_are_the_utils_objects(module, names):
    assert [getattr(module, name) for name in names] == [getattr(utils, name) for name in names]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_check_at_least_refuses_numbers_that_are_not_finite(value):
    """inf passes `value >= minimum`: a weight decay of inf would diverge at the first step."""
    with pytest.raises(
        UserInputError, match=rf"^--weight-decay={value!r} is not allowed; expected a (finite )?number >= 0"
    ):
        utils.check_at_least("--weight-decay", value, minimum=0)


def test_check_distinct_names_the_first_value_given_twice_and_what_it_would_do():
    check_distinct("--sizes", [1, 2, 3], "unused")
    with pytest.raises(UserInputError, match=r"^--sizes names 2 more than once \(it runs twice\); name each once$"):
        check_distinct("--sizes", [1, 2, 3, 2, 1], "it runs twice")

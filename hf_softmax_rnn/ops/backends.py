"""Which fused GPU kernel, if any, computes a call of `ops.attention`.

On CUDA tensors two kernels replace the PyTorch forms where they apply (same values, same
gradients, tested against the float64 references):

- `"fla"`: chunked linear attention on feature-mapped q and k through flash-linear-attention's
  `chunk_simple_gla` (`pip install hf-softmax-rnn[gpu]`), for feature maps of at most
  `FLA_MAX_FEATURES` features (elu, relu, identity, cosine, hedgehog, Taylor-1) and for the part
  of the sliding-window hybrids older than the window, with a data-dependent decay as fla's gate
  `g` where the spec has one. It carries the recurrent state, so it serves training, scoring and
  prefill alike. fla's state pass walks the chunks of a row one after another, so rows longer
  than `state_segment_length()` tokens (default 2,048) are cut into segments that fla runs side
  by side, whose states are then chained (`ops.fla_linear.chunk_in_segments`).
- `"taylor2"`: the Triton kernel of `ops.triton_taylor` for Taylor order 2 without a window or
  a decay, when the caller needs no recurrent state (training and scoring without a cache).
- `"flex"`: the exact part of a sliding-window hybrid (window and sinks) through PyTorch's
  FlexAttention (`ops.flex_window`, compiled; needs triton), when the call starts from an empty
  state and needs none back (training and scoring without a cache); the part older than the
  window still runs in fla, and kept positions (`ops.kept`) add their exact part beside it.

Everything else, every CPU call and every float64 call runs the PyTorch forms. `HF_SOFTMAX_RNN_FUSED_KERNELS=0`
or `fused_kernels(False)` turns the fused kernels off (for comparisons);
`HF_SOFTMAX_RNN_STATE_SEGMENT=0` or `state_segments(0)` keeps rows whole in fla. Where a fused kernel would
apply but its package is not installed, the first such call logs a WARNING naming the package (the
PyTorch forms are tens of times slower on a GPU), once per package.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.ops.fla_linear import chunk_in_segments

#: The widest feature map sent to fla (checked on a GPU at 64 and 128 features: elu, hedgehog);
#: wider maps, Taylor-2 at D = 64 among them, run the PyTorch forms.
FLA_MAX_FEATURES = 256
#: The dtypes the fused kernels read (float64 runs the PyTorch forms).
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENV_VARIABLE = "HF_SOFTMAX_RNN_FUSED_KERNELS"
#: `HF_SOFTMAX_RNN_FLEX=0` keeps the window part of hybrids out of FlexAttention:
#: each new sequence length compiles FlexAttention again, which short jobs may not want to pay.
FLEX_ENV_VARIABLE = "HF_SOFTMAX_RNN_FLEX"
#: `HF_SOFTMAX_RNN_STATE_SEGMENT=N` cuts rows longer than N tokens into segments of at most N for
#: fla's state pass (0: rows stay whole).
SEGMENT_ENV_VARIABLE = "HF_SOFTMAX_RNN_STATE_SEGMENT"
DEFAULT_STATE_SEGMENT = 2048
INSTALL_HINT = "pip install 'hf-softmax-rnn[gpu]'"
logger = logging.getLogger(__name__)
#: The device types the fused kernels run on (tests add "cpu" to run Triton's interpreter).
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_override: list[bool] = []
_segment_override: list[int] = []


@contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Turn the fused GPU kernels on or off inside the block (the default is on)."""
    _override.append(enabled)
    try:
        yield
    finally:
        _override.pop()


def fused_kernels_enabled() -> bool:
    if _override:
        return _override[-1]
    return os.environ.get(ENV_VARIABLE, "1") != "0"


@contextmanager
def state_segments(length: int) -> Iterator[None]:
    """Inside the block, fla's rows are cut into segments of at most `length` tokens (0: rows stay whole)."""
    _segment_override.append(_checked_segment(length, f"state_segments({length!r})"))
    try:
        yield
    finally:
        _segment_override.pop()


def state_segment_length() -> int:
    """The longest row fla's state pass walks in one piece (0: no limit); `state_segments` or
    `HF_SOFTMAX_RNN_STATE_SEGMENT`, else 2,048."""
    if _segment_override:
        return _segment_override[-1]
    value = os.environ.get(SEGMENT_ENV_VARIABLE)
    if value is None:
        return DEFAULT_STATE_SEGMENT
    try:
        length = int(value)
    except ValueError:
        length = -1
    return _checked_segment(length, f"{SEGMENT_ENV_VARIABLE}={value!r}")


def _checked_segment(length: int, name: str) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"{name} is not allowed; expected 0 (rows stay whole) or a number of tokens >= 1")
    return length


@functools.cache
def triton_available() -> bool:
    try:  # (transformers' remote-code import check skips imports inside try blocks)
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def fla_chunk_function() -> Callable | None:
    """flash-linear-attention's `chunk_simple_gla`, or None where fla-core is not installed."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return chunk_simple_gla


def _fused_device(device_type: str, dtype: torch.dtype) -> bool:
    return device_type in FUSED_DEVICE_TYPES and dtype in FUSED_DTYPES and fused_kernels_enabled()


def fla_linear_function(device_type: str, dtype: torch.dtype, feature_dim: int, clamp: float | None) -> Callable | None:
    """fla's chunk function where the chunked recurrence of `feature_dim` features read in `dtype`
    runs in it, else None."""
    if not _fused_device(device_type, dtype) or clamp is not None:
        return None
    if feature_dim > FLA_MAX_FEATURES:
        return None
    function = fla_chunk_function()
    if function is None:
        _warn_missing("fla-core", "chunked linear attention (feature maps, window hybrids)")
        return None
    segment_length = state_segment_length()
    if segment_length == 0:
        return function
    return functools.partial(chunk_in_segments, function, segment_length=segment_length)


def polynomial_backend(
    device_type: str,
    dtype: torch.dtype,
    spec: AttentionSpec,
    mode: str,
    needs_state: bool,
    head_dim: int,
    value_dim: int,
) -> str | None:
    """The name of the state-free kernel that computes the call ("taylor2", the Triton kernel), or None."""
    if not _fused_device(device_type, dtype) or needs_state or mode == "recurrent":
        return None
    if spec.effective_feature_map != "taylor" or spec.taylor_order != 2 or spec.window is not None:
        return None
    if spec.decay or spec.delta_rule:  # the Triton kernel has neither a forget gate nor a delta rule
        return None
    if spec.score_clamp is not None:
        return None
    if not triton_available():
        _warn_missing("triton", "Taylor-2 attention without a cache")
        return None
    from hf_softmax_rnn.ops.triton_taylor import supports

    return "taylor2" if supports(head_dim, value_dim) else None


#: Head and value widths FlexAttention's compiled kernels take (powers of two).
FLEX_DIMS = (16, 32, 64, 128, 256)


@functools.cache
def flex_attention_available() -> bool:
    """PyTorch has FlexAttention (2.5 and later)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def window_backend(
    device_type: str,
    dtype: torch.dtype,
    spec: AttentionSpec,
    mode: str,
    needs_state: bool,
    fresh_state: bool,
    head_dim: int,
    value_dim: int,
) -> str | None:
    """ "flex" where the exact window part of a hybrid runs in FlexAttention (`ops.flex_window`), or None."""
    if spec.window is None or not _fused_device(device_type, dtype) or needs_state or not fresh_state:
        return None
    if os.environ.get(FLEX_ENV_VARIABLE, "1") == "0":
        return None
    if mode != "chunked" or head_dim not in FLEX_DIMS or value_dim not in FLEX_DIMS:
        return None
    if not triton_available():
        _warn_missing("triton", "the window part of sliding-window hybrids")
        return None
    return "flex" if flex_attention_available() else None


def note_pytorch_form(device_type: str, dtype: torch.dtype, computes: str) -> None:
    """Say once, where the fused kernels would run, that `computes` has none and runs the PyTorch form."""
    if _fused_device(device_type, dtype):
        _warn_no_kernel(computes)


@functools.cache
def _warn_no_kernel(computes: str) -> None:
    logger.warning("%s has no fused kernel in hf_softmax_rnn: it runs the PyTorch form on the GPU", computes)


@functools.cache
def _warn_missing(package: str, computes: str) -> None:
    """Say once per package that a fused kernel applies on this GPU call but `package` is missing."""
    logger.warning(
        "%s is not installed, so %s runs the PyTorch form on the GPU, tens of times slower than the fused "
        "kernel (%s; HF_SOFTMAX_RNN_FUSED_KERNELS=0 silences this)",
        package, computes, INSTALL_HINT,
    )  # fmt: skip

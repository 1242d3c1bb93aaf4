"""Kept positions on the GPU (the PyTorch selection beside fla's gated chunk kernel) against the float64
parallel form on the CPU: values and gradients, left padding, the state handed from one call to the
next. float32 only: the kept sets follow a ranking of saliencies, which bfloat16 rounding reorders
wherever two are close, so a bfloat16 run keeps other keys than the float64 reference, not wrong ones.

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec

from .test_decay_kernels import check_against_float64

pytestmark = pytest.mark.gpu

SPEC = AttentionSpec(kind="linear", feature_map="hedgehog", window=64, sinks=4, kept=16, decay=True)


@pytest.mark.parametrize("pad", [0, 37], ids=["no_padding", "left_padding"])
def test_kept_positions_match_float64_reference(pad):
    check_against_float64(SPEC, torch.float32, pad)

"""Kept positions on the GPU (the PyTorch selection beside fla's gated chunk kernel) against the float64
parallel form on the CPU: values and gradients, left padding, the state handed from one call to the
next. float32 only: the kept sets follow a ranking of saliencies, which bfloat16 rounding reorders
wherever two are close, so a bfloat16 run keeps other keys than the float64 reference, not wrong ones.

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import backends

from ..ops.helpers import left_padding_mask, make_params
from .test_decay_kernels import HEAD_DIM, HEADS, KV_HEADS, LENGTH, SPLIT, TOLERANCE, _relative_error, _run

pytestmark = pytest.mark.gpu

SPEC = AttentionSpec(kind="linear", feature_map="hedgehog", window=64, sinks=4, kept=16, decay=True)


@pytest.mark.parametrize("pad", [0, 37], ids=["no_padding", "left_padding"])
def test_kept_positions_match_float64_reference(pad):
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, HEADS, LENGTH, HEAD_DIM), *[(2, KV_HEADS, LENGTH, HEAD_DIM)] * 2, (2, KV_HEADS, LENGTH)]
    inputs = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    inputs[3] = inputs[3] + 3.0
    params = list(make_params(SPEC, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM).values())
    cpu = [t.clone().requires_grad_() for t in inputs + params]
    gpu = [t.to("cuda", torch.float32).requires_grad_() for t in inputs + params]
    mask = left_padding_mask(2, LENGTH, [0, pad])
    weights = torch.linspace(-1, 1, HEAD_DIM, dtype=torch.float64)

    with backends.fused_kernels(False):
        reference = _run(SPEC, cpu, mask, None)
    reference_grads = torch.autograd.grad((reference * weights).sum(), cpu, allow_unused=True)
    out = _run(SPEC, gpu, mask.cuda(), SPLIT)
    grads = torch.autograd.grad((out * weights.float().cuda()).sum(), gpu, allow_unused=True)

    rows = mask.bool()[:, None, :, None].expand_as(reference)
    assert _relative_error(out[rows.cuda()], reference[rows]) < TOLERANCE[torch.float32]
    for index, (got, want) in enumerate(zip(grads, reference_grads)):
        if want is not None:
            assert got is not None, f"gradient {index} is missing"
            assert _relative_error(got, want) < 2 * TOLERANCE[torch.float32], f"gradient {index}"

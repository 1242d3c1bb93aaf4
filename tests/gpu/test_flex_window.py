"""The window hybrids' exact part through compiled FlexAttention on CUDA (`ops.flex_window`), beside
fla's chunked part: `ops.attention` in training form (no state) against the float64 parallel form
on the CPU, values and gradients, fp32 and bf16, left padding; and the window part with sinks
against its dense float64 reference, gradients through the log-sum-exp included.

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import importlib

import pytest
import torch

from hf_softmax_rnn.ops.flex_window import flex_window_attention, window_attention_reference

from ..ops.helpers import left_padding_mask, quiet_preset
from .test_fused_kernels import HEAD_DIM, HEADS, KV_HEADS, LENGTH, TOLERANCE, _compare, _relative_error, fla_calls

pytestmark = pytest.mark.gpu
__all__ = ["fla_calls"]  # the fixture, shared with test_fused_kernels


@pytest.fixture
def flex_calls(monkeypatch):
    calls = []
    module = importlib.import_module("hf_softmax_rnn.ops.attention")
    real = module.flex_window_attention

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "flex_window_attention", counted)
    return calls


HYBRIDS = {
    "window": quiet_preset("hedgehog_window_64"),
    "window-sinks-kept": quiet_preset("hedgehog_window_256_sinks_4_kept_256_decay", window=32, kept=16, decay=False),
}


#: (hybrid, dtype) cases. The kept spec runs in float32 only: with bfloat16 features its hedgehog_k
#: gradient is 6.6% off the float64 reference in the PyTorch form as in the fused one (CPU stand-ins),
#: beyond the bfloat16 tolerance, which says nothing about FlexAttention.
CASES = [("window", torch.float32), ("window", torch.bfloat16), ("window-sinks-kept", torch.float32)]


@pytest.mark.parametrize("pad", [0, 37], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{name}-{str(dtype)[6:]}" for name, dtype in CASES])
def test_flex_window_hybrid_matches_float64_reference(name, dtype, pad, fla_calls, flex_calls):
    """With kept positions, the kept keys' exact part is merged with FlexAttention's window (and sinks)."""
    _compare(HYBRIDS[name], dtype, pad, "chunked", split=None)
    assert flex_calls == [dtype] and {called for called, _ in fla_calls} == {dtype}


@pytest.mark.parametrize("softcap", [None, 1.0], ids=["uncapped", "softcap1"])
@pytest.mark.parametrize("sinks", [0, 4], ids=["no_sinks", "sinks4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_window_part_matches_dense_reference(dtype, sinks, softcap):
    """With a soft cap of the scores (Gemma 2's), FlexAttention's `score_mod` bends them as the reference does."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, HEADS, LENGTH, HEAD_DIM), *[(2, KV_HEADS, LENGTH, HEAD_DIM)] * 2]
    cpu = [torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_() for shape in shapes]
    gpu = [x.detach().to("cuda", dtype).requires_grad_() for x in cpu]
    valid = left_padding_mask(2, LENGTH, [0, 37]).bool()
    scale, window = HEAD_DIM**-0.5, 64
    want_out, want_lse = window_attention_reference(*cpu, valid, scale, window, sinks, softcap)
    got_out, got_lse = flex_window_attention(*gpu, valid.cuda(), scale, window, sinks, softcap=softcap)
    rows = valid[:, None, :].expand_as(want_lse)
    assert _relative_error(got_out[rows.cuda()], want_out[rows]) < TOLERANCE[dtype]
    assert _relative_error(got_lse[rows.cuda()], want_lse[rows]) < TOLERANCE[dtype]
    weights = torch.linspace(-1, 1, HEAD_DIM, dtype=torch.float64)
    loss_want = (want_out[rows] * weights).sum() + want_lse[rows].sum()
    loss_got = (got_out[rows.cuda()].float() * weights.float().cuda()).sum() + got_lse[rows.cuda()].float().sum()
    for name, got, want in zip(
        "qkv", torch.autograd.grad(loss_got, gpu), torch.autograd.grad(loss_want, cpu), strict=True
    ):
        assert _relative_error(got, want) < 2 * TOLERANCE[dtype], f"d{name}"

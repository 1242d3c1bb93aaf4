"""The fused GPU paths (fla for linear maps and window hybrids, Triton for Taylor-2) inside
`ops.attention`, against the float64 parallel form on the CPU: values, gradients, left padding,
fp32 and bf16, and the state handed from one call to the next.

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import pytest
import torch

from hf_softmax_rnn.ops import attention, backends, triton_taylor

from ..ops.helpers import as_params, left_padding_mask, make_params, quiet_preset

pytestmark = pytest.mark.gpu

LINEAR = ["linear_elu", "linear_hedgehog", "hedgehog_window_64"]
TAYLOR = ["softmax_taylor_2", "softmax_taylor_2_l2"]
#: Relative error (in norm) allowed against the float64 reference.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
HEADS, KV_HEADS, HEAD_DIM, LENGTH = 9, 3, 64, 200  # SmolLM2's heads: fla tunes once per shape


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-12)).item()


def _leaves(spec, dtype):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, LENGTH, HEAD_DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(2, KV_HEADS, LENGTH, HEAD_DIM, generator=generator, dtype=torch.float64)
    v = torch.randn(2, KV_HEADS, LENGTH, HEAD_DIM, generator=generator, dtype=torch.float64)
    params = make_params(spec, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    gpu = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    params_cpu = {name: t.clone().requires_grad_() for name, t in params.items()}
    params_gpu = {name: t.to("cuda", torch.float32).requires_grad_() for name, t in params.items()}
    return cpu, gpu, params_cpu, params_gpu


def _compare(spec, dtype, pad, mode, split):
    cpu, gpu, params_cpu, params_gpu = _leaves(spec, dtype)
    mask = left_padding_mask(2, LENGTH, [0, pad])
    weights = torch.linspace(-1, 1, HEAD_DIM, dtype=torch.float64)
    with backends.fused_kernels(False):
        reference, _ = attention(*cpu, spec, mode="parallel", attention_mask=mask, params=as_params(params_cpu))
    reference_grads = torch.autograd.grad(
        (reference * weights).sum(), cpu + list(params_cpu.values()), allow_unused=True
    )

    mask_gpu = mask.cuda()
    if split:
        q, k, v = gpu
        first, state = attention(
            q[..., :split, :], k[..., :split, :], v[..., :split, :], spec, mode=mode,
            attention_mask=mask_gpu[:, :split], params=as_params(params_gpu),
        )  # fmt: skip
        second, _ = attention(
            q[..., split:, :], k[..., split:, :], v[..., split:, :], spec, mode=mode,
            attention_mask=mask_gpu, params=as_params(params_gpu), state=state,
        )  # fmt: skip
        out = torch.cat([first, second], dim=-2)
    else:
        out, _ = attention(
            *gpu, spec, mode=mode, attention_mask=mask_gpu, params=as_params(params_gpu), return_state=False
        )
    assert out.dtype == dtype and torch.isfinite(out).all()
    grads = torch.autograd.grad(
        (out.float() * weights.float().cuda()).sum(), gpu + list(params_gpu.values()), allow_unused=True
    )
    rows = mask.bool()[:, None, :, None].expand_as(reference)  # padding rows are free to differ
    assert _relative_error(out[rows.cuda()], reference[rows]) < TOLERANCE[dtype]
    names = ["q", "k", "v", *params_gpu]
    for name, got, want in zip(names, grads, reference_grads, strict=True):
        if want is not None:
            assert got is not None, f"d{name} is missing"
            assert _relative_error(got, want) < 2 * TOLERANCE[dtype], f"d{name}"


@pytest.fixture
def fla_calls(monkeypatch):
    calls = []
    real = backends.fla_chunk_function()
    assert real is not None, "fla-core is not installed: pip install hf-softmax-rnn[gpu]"

    def counted(*args, **kwargs):
        calls.append((args[0].dtype, tuple(args[0].shape[:2])))  # (dtype, (rows, positions)), time-major q
        return real(*args, **kwargs)

    monkeypatch.setattr(backends, "fla_chunk_function", lambda: counted)
    return calls


@pytest.mark.parametrize("segment", [0, 64], ids=["whole_rows", "segments_of_64"])
@pytest.mark.parametrize("pad", [0, 37], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", LINEAR)
def test_fla_path_matches_float64_reference(name, dtype, pad, segment, fla_calls):
    """With segments of 64, the calls of 130 and 70 positions run as 3 and 2 rows of 64 per sequence."""
    with backends.state_segments(segment):
        _compare(quiet_preset(name), dtype, pad, "chunked", split=130)
    assert fla_calls and {called for called, _ in fla_calls} == {dtype}
    assert [rows for _, rows in fla_calls] == ([(6, 64), (4, 64)] if segment else [(2, 130), (2, 70)])


@pytest.mark.parametrize("mode", ["parallel", "chunked"])
@pytest.mark.parametrize("pad", [0, 37], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TAYLOR)
def test_triton_taylor_path_matches_float64_reference(name, dtype, pad, mode, monkeypatch):
    calls = []
    real = triton_taylor.taylor2_attention

    def counted(*args):
        calls.append(args[0].dtype)
        return real(*args)

    monkeypatch.setattr(triton_taylor, "taylor2_attention", counted)
    _compare(quiet_preset(name), dtype, pad, mode, split=None)
    assert calls == [dtype]


@pytest.mark.parametrize("name", ["linear_elu", "hedgehog_window_64"])
def test_under_bfloat16_autocast_fla_reads_bfloat16_and_matches_float64(name, fla_calls):
    """float32 q, k and bfloat16 v (as RoPE and the projections leave them under autocast): fla reads
    bfloat16, the output is bfloat16 and within the bfloat16 tolerance of the float64 reference, gradients
    included."""
    spec = quiet_preset(name)
    cpu, gpu, params_cpu, params_gpu = _leaves(spec, torch.float32)
    gpu[2] = gpu[2].detach().bfloat16().requires_grad_()
    weights = torch.linspace(-1, 1, HEAD_DIM, dtype=torch.float64)
    with backends.fused_kernels(False):
        reference, _ = attention(*cpu, spec, mode="parallel", params=as_params(params_cpu))
    reference_grads = torch.autograd.grad((reference * weights).sum(), cpu)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = attention(*gpu, spec, mode="chunked", params=as_params(params_gpu), return_state=False)
    assert out.dtype == torch.bfloat16 and {called for called, _ in fla_calls} == {torch.bfloat16}
    grads = torch.autograd.grad((out.float() * weights.float().cuda()).sum(), gpu)
    assert _relative_error(out, reference) < TOLERANCE[torch.bfloat16]
    for name_, got, want in zip("qkv", grads, reference_grads, strict=True):
        assert _relative_error(got, want) < 2 * TOLERANCE[torch.bfloat16], f"d{name_}"

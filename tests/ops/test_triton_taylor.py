"""The Triton Taylor-2 kernel against its float64 reference, alone and inside `ops.attention`.

On a machine without CUDA the kernel runs in Triton's interpreter (conftest sets
TRITON_INTERPRET=1); on a GPU machine the same tests run the compiled kernel.
"""

import pytest
import torch

from hf_softmax_rnn.ops import attention, backends, triton_taylor
from hf_softmax_rnn.ops.triton_taylor import supports, taylor2_attention, taylor2_attention_reference

from .helpers import FINITE_SPECS, as_params, gated, left_padding_mask, make_inputs, make_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {
    "mha": dict(heads=2, kv_heads=2, length=37, key_len=37, pads=[0, 0]),
    "gqa_padded": dict(heads=4, kv_heads=2, length=70, key_len=70, pads=[0, 13]),
    "queries_after_cache": dict(heads=4, kv_heads=1, length=20, key_len=83, pads=[5, 0]),
    "one_key_visible": dict(heads=2, kv_heads=1, length=3, key_len=3, pads=[2, 0]),
}


def _inputs(heads, kv_heads, length, key_len, pads, head_dim=16, value_dim=32):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE).requires_grad_()

    q = randn(2, heads, length, head_dim)
    k, v = randn(2, kv_heads, key_len, head_dim), randn(2, kv_heads, key_len, value_dim)
    mask = left_padding_mask(2, key_len, pads).to(DEVICE)
    return q, k, v, mask


@pytest.mark.parametrize("mask_given", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_float64_reference(case, mask_given):
    """With a key mask, and without one (the kernel compiled to read none) on unpadded inputs."""
    q, k, v, mask = _inputs(**(CASES[case] | ({} if mask_given else {"pads": [0, 0]})))
    v_masked = v * mask[:, None, :, None]  # the kernel's contract: values are zero at padding
    numerator, denominator = taylor2_attention(q, k, v_masked, mask if mask_given else None, 0.3)
    ref_numerator, ref_denominator = taylor2_attention_reference(q, k, v_masked, mask, 0.3)
    torch.testing.assert_close(numerator.double(), ref_numerator, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(denominator.double(), ref_denominator, rtol=1e-5, atol=1e-4)

    d_num = torch.randn_like(numerator)
    d_den = torch.randn_like(denominator)
    got = torch.autograd.grad((numerator * d_num).sum() + (denominator * d_den).sum(), [q, k, v], retain_graph=True)
    want = torch.autograd.grad(
        (ref_numerator * d_num.double()).sum() + (ref_denominator * d_den.double()).sum(), [q, k, v]
    )
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(
            g.double(), w.double(), rtol=1e-5, atol=1e-4, msg=lambda m, name=name: f"d{name}: {m}"
        )


def test_padding_query_rows_are_zero():
    q, k, v, mask = _inputs(**CASES["gqa_padded"])
    numerator, denominator = taylor2_attention(q, k, v * mask[:, None, :, None], mask, 0.3)
    assert torch.all(denominator[1, :, :13] == 0) and torch.all(numerator[1, :, :13] == 0)
    assert torch.all(denominator[1, :, 13:] >= 0.5)


@pytest.mark.parametrize(("head_dim", "value_dim", "expected"), [(64, 64, True), (16, 128, True), (8, 64, False)])
def test_supported_head_sizes(head_dim, value_dim, expected):
    assert supports(head_dim, value_dim) is expected


TAYLOR2_SPECS = sorted(
    name
    for name, spec in FINITE_SPECS.items()
    if spec.effective_feature_map == "taylor" and spec.taylor_order == 2 and spec.window is None and not spec.decay
)


@pytest.fixture
def fused_on_this_device(monkeypatch):
    """On a machine without CUDA, the kernel runs in the interpreter on CPU tensors."""
    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "no_mask"])
@pytest.mark.parametrize("mode", ["parallel", "chunked"])
@pytest.mark.parametrize("name", TAYLOR2_SPECS)
def test_attention_with_kernel_matches_pytorch_forms(name, mode, padded, fused_on_this_device, monkeypatch):
    """Every normaliser and gate runs after the kernel as after the PyTorch forms; without an
    attention mask the kernel is given none (and reads none)."""
    spec = FINITE_SPECS[name]
    q, k, v, gate_logits = make_inputs(head_dim=16, length=19, dtype=torch.float32, requires_grad=True)
    params = make_params(spec, head_dim=16, dtype=torch.float32, requires_grad=True)
    mask = left_padding_mask(2, 19, [0, 4]).to(DEVICE) if padded else None
    leaves = [q, k, v, *gate_logits.values(), *params.values()]
    kernel_masks = []

    def recording_kernel(q, k, v, key_mask, scale):
        kernel_masks.append(key_mask)
        return taylor2_attention(q, k, v, key_mask, scale)

    monkeypatch.setattr(triton_taylor, "taylor2_attention", recording_kernel)

    def run(fused: bool):
        gated_v, gates = gated(spec, v, gate_logits)
        on_device = [x.to(DEVICE) for x in (q, k, gated_v)]
        with backends.fused_kernels(fused):
            out, state = attention(
                *on_device, spec, mode=mode, attention_mask=mask,
                gates={name: g.to(DEVICE) for name, g in gates.items()},
                params=as_params({name: p.to(DEVICE) for name, p in params.items()}), return_state=False,
            )  # fmt: skip
        assert state is None
        weights = torch.linspace(-1, 1, 16, device=DEVICE)
        grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
        return out.cpu(), [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)]

    assert backends.polynomial_backend(DEVICE, torch.float32, spec, mode, False, 16, 16) == "taylor2"
    fused_out, fused_grads = run(True)
    assert len(kernel_masks) == 1 and (kernel_masks[0] is None) is not padded
    torch_out, torch_grads = run(False)
    torch.testing.assert_close(fused_out, torch_out, rtol=1e-4, atol=1e-5)
    for got, want in zip(fused_grads, torch_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(("setting", "expected"), [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")])
def test_float32_products_follow_torch_matmul_precision(setting, expected):
    from hf_softmax_rnn.ops.triton_taylor import _meta

    q = torch.zeros(1, 1, 4, 16)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        assert _meta(q, q, None)["PRECISION"] == expected
        assert _meta(q.bfloat16(), q.bfloat16(), None)["PRECISION"] == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)

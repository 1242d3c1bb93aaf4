"""The data-dependent decay on the GPU: fla's gated chunk kernel (`chunk_simple_gla` with `g`) for
linear maps and window hybrids with sinks, and the PyTorch chunked form for Taylor-2 (the Triton
kernel has no forget gate), against the float64 parallel form on the CPU: values and gradients
(q, k, v, the decay logits, the learned maps), left padding, fp32 and bf16, and the state handed
from one call to the next.

Marked `gpu`: CI (CPU only) deselects them; on a GPU machine run `pytest -m gpu tests/gpu`.
"""

import pytest
import torch
import torch.nn.functional as F

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention, backends

from ..ops.helpers import as_params, left_padding_mask, make_params, quiet_preset

pytestmark = pytest.mark.gpu

SPECS = {
    "hedgehog_window_64_sinks_4_decay": quiet_preset("hedgehog_window_64_sinks_4_decay"),
    "elu_decay": AttentionSpec(kind="linear", feature_map="elu", decay=True),
    "taylor2_decay": AttentionSpec(kind="recurrent_softmax", taylor_order=2, decay=True),
}
#: Relative error (in norm) allowed against the float64 reference.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
HEADS, KV_HEADS, HEAD_DIM, LENGTH, SPLIT = 9, 3, 64, 200, 130


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-12)).item()


def _run(spec, leaves, mask, split):
    """Chunked attention in two calls (state handed over at `split`), or parallel when split is None."""
    q, k, v, decay_logits, *params = leaves
    names = list(make_params(spec, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM))
    params = as_params(dict(zip(names, params, strict=True)))
    log_decay = F.logsigmoid(decay_logits)
    if split is None:
        out, _ = attention(q, k, v, spec, attention_mask=mask, params=params, gates={"decay": log_decay})
        return out
    first, state = attention(
        q[..., :split, :], k[..., :split, :], v[..., :split, :], spec, mode="chunked", attention_mask=mask[:, :split],
        params=params, gates={"decay": log_decay[..., :split]},
    )  # fmt: skip
    second, _ = attention(
        q[..., split:, :], k[..., split:, :], v[..., split:, :], spec, mode="chunked", attention_mask=mask,
        params=params, gates={"decay": log_decay[..., split:]}, state=state,
    )  # fmt: skip
    return torch.cat([first, second], dim=-2)


@pytest.fixture
def fla_calls(monkeypatch):
    calls = []
    real = backends.fla_chunk_function()
    assert real is not None, "fla-core is not installed: pip install hf-softmax-rnn[gpu]"

    def counted(*args, **kwargs):
        calls.append(kwargs.get("g") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(backends, "fla_chunk_function", lambda: counted)
    return calls


def check_against_float64(spec, dtype, pad):
    """Chunked attention on the GPU (two calls, `dtype` q/k/v, float32 parameters) against the float64
    parallel form on the CPU: values and gradients, within `TOLERANCE`."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, HEADS, LENGTH, HEAD_DIM), *[(2, KV_HEADS, LENGTH, HEAD_DIM)] * 2, (2, KV_HEADS, LENGTH)]
    inputs = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    inputs[3] = inputs[3] + 3.0  # decays of 0.9-0.99 per position: the state forgets within the sequence
    params = list(make_params(spec, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM).values())
    cpu = [t.clone().requires_grad_() for t in inputs + params]
    gpu = [t.to("cuda", dtype).requires_grad_() for t in inputs[:3]]
    gpu += [t.to("cuda", torch.float32).requires_grad_() for t in inputs[3:] + params]
    mask = left_padding_mask(2, LENGTH, [0, pad])
    weights = torch.linspace(-1, 1, HEAD_DIM, dtype=torch.float64)

    with backends.fused_kernels(False):
        reference = _run(spec, cpu, mask, None)
    reference_grads = torch.autograd.grad((reference * weights).sum(), cpu, allow_unused=True)
    out = _run(spec, gpu, mask.cuda(), SPLIT)
    assert out.dtype == dtype and torch.isfinite(out).all()
    grads = torch.autograd.grad((out.float() * weights.float().cuda()).sum(), gpu, allow_unused=True)

    rows = mask.bool()[:, None, :, None].expand_as(reference)  # padding rows are free to differ
    assert _relative_error(out[rows.cuda()], reference[rows]) < TOLERANCE[dtype]
    for index, (got, want) in enumerate(zip(grads, reference_grads, strict=True)):
        if want is not None:
            assert got is not None, f"gradient {index} is missing"
            assert _relative_error(got, want) < 2 * TOLERANCE[dtype], f"gradient {index}"


@pytest.mark.parametrize("pad", [0, 37], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_decayed_chunked_path_matches_float64_reference(name, dtype, pad, fla_calls):
    spec = SPECS[name]
    check_against_float64(spec, dtype, pad)
    uses_fla = spec.feature_dim(HEAD_DIM) <= backends.FLA_MAX_FEATURES
    assert fla_calls == ([True, True] if uses_fla else [])

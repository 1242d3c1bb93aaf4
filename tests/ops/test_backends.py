"""Which calls the fused GPU kernels take (the selection itself; tests/gpu checks the kernels)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import backends
from hf_softmax_rnn.ops.fla_linear import chunk_in_segments

TAYLOR2 = AttentionSpec(kind="recurrent_softmax", taylor_order=2)


FLA = object()


@pytest.fixture
def installed(monkeypatch):
    """Both packages "installed"; fla's rows whole (fla_linear_function then returns fla's function)."""
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: FLA)
    monkeypatch.setenv(backends.SEGMENT_ENV_VARIABLE, "0")


@pytest.mark.parametrize(
    ("device", "feature_dim", "clamp", "expected"),
    [
        ("cuda", 64, None, FLA),
        ("cuda", 256, None, FLA),
        ("cuda", 257, None, None),
        ("cuda", 64, 5.0, None),
        ("cpu", 64, None, None),
    ],
    ids=["elu64", "hedgehog256", "too_wide", "clamped", "cpu"],
)
def test_fla_linear_function(device, feature_dim, clamp, expected, installed):
    assert backends.fla_linear_function(device, torch.float32, feature_dim, clamp) is expected


@pytest.mark.parametrize(
    ("spec", "mode", "needs_state", "head_dim", "expected"),
    [
        (TAYLOR2, "parallel", False, 64, "taylor2"),
        (TAYLOR2, "chunked", False, 64, "taylor2"),
        (TAYLOR2, "chunked", True, 64, None),
        (TAYLOR2, "recurrent", False, 64, None),
        (TAYLOR2, "parallel", False, 48, None),
        (AttentionSpec(kind="recurrent_softmax", taylor_order=3), "parallel", False, 64, None),
        (AttentionSpec(kind="recurrent_softmax", taylor_order=2, window=4), "parallel", False, 64, None),
        (AttentionSpec(kind="linear", feature_map="elu"), "parallel", False, 64, None),
        (AttentionSpec(kind="recurrent_softmax", taylor_order=2, decay=True), "parallel", False, 64, None),
    ],
    ids=["parallel", "chunked_no_state", "chunked_state", "recurrent", "head48", "order3", "window", "elu", "decay"],
)
def test_polynomial_backend(spec, mode, needs_state, head_dim, expected, installed):
    assert backends.polynomial_backend("cuda", torch.bfloat16, spec, mode, needs_state, head_dim, head_dim) == expected


def test_float64_runs_the_pytorch_forms(installed):
    assert backends.fla_linear_function("cuda", torch.float64, 64, None) is None
    assert backends.polynomial_backend("cuda", torch.float64, TAYLOR2, "parallel", False, 64, 64) is None


def test_fla_gets_long_rows_in_segments_unless_told_to_keep_them_whole(installed, monkeypatch):
    monkeypatch.delenv(backends.SEGMENT_ENV_VARIABLE)
    function = backends.fla_linear_function("cuda", torch.bfloat16, 64, None)
    assert function.func is chunk_in_segments and function.args == (FLA,)
    assert function.keywords == {"segment_length": 2048}
    with backends.state_segments(512):
        assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None).keywords == {"segment_length": 512}
    with backends.state_segments(0):
        assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None) is FLA


def test_switches_turn_fused_kernels_off(installed, monkeypatch):
    with backends.fused_kernels(False):
        assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None) is None
        with backends.fused_kernels(True):
            assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None) is FLA
    monkeypatch.setenv(backends.ENV_VARIABLE, "0")
    assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None) is None
    assert backends.polynomial_backend("cuda", torch.bfloat16, TAYLOR2, "parallel", False, 64, 64) is None


@pytest.fixture
def missing_packages(monkeypatch):
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: None)
    backends._warn_missing.cache_clear()
    yield
    backends._warn_missing.cache_clear()


def test_missing_packages_fall_back_and_say_so_once(missing_packages, caplog):
    with caplog.at_level("WARNING", logger=backends.__name__):
        for _ in range(2):
            assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None) is None
            assert backends.polynomial_backend("cuda", torch.bfloat16, TAYLOR2, "parallel", False, 64, 64) is None
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].startswith("fla-core is not installed, so chunked linear attention (feature maps, window")
    assert warnings[1].startswith("triton is not installed, so Taylor-2 attention without a cache runs the PyTorch")
    assert all(backends.INSTALL_HINT in warning for warning in warnings)


@pytest.mark.parametrize(
    "call",
    [
        lambda: backends.fla_linear_function("cpu", torch.float32, 64, None),
        lambda: backends.fla_linear_function("cuda", torch.bfloat16, 512, None),
        lambda: backends.polynomial_backend("cuda", torch.bfloat16, TAYLOR2, "recurrent", False, 64, 64),
        lambda: backends.polynomial_backend("cuda", torch.float64, TAYLOR2, "parallel", False, 64, 64),
    ],
    ids=["cpu", "too_wide_for_fla", "recurrent", "float64"],
)
def test_no_warning_where_no_fused_kernel_applies(missing_packages, caplog, call):
    with caplog.at_level("WARNING", logger=backends.__name__):
        assert call() is None
    assert not caplog.records


def test_no_warning_when_fused_kernels_are_off(missing_packages, caplog, monkeypatch):
    monkeypatch.setenv(backends.ENV_VARIABLE, "0")
    with caplog.at_level("WARNING", logger=backends.__name__):
        assert backends.fla_linear_function("cuda", torch.bfloat16, 64, None) is None
        assert backends.polynomial_backend("cuda", torch.bfloat16, TAYLOR2, "parallel", False, 64, 64) is None
    assert not caplog.records


def test_package_works_without_triton_and_fla():
    """Where neither is installed (blocked here), the package imports, never loads them, and computes."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("triton", "fla"):
                    raise ImportError(f"{name} is blocked")

        for name in [name for name in sys.modules if name.split(".")[0] in ("triton", "fla")]:
            del sys.modules[name]  # a site hook may have loaded them already
        sys.meta_path.insert(0, Block())
        import torch
        from hf_softmax_rnn import AttentionSpec
        from hf_softmax_rnn.ops import attention, backends

        backends.FUSED_DEVICE_TYPES = ("cpu",)
        assert not backends.triton_available() and backends.fla_chunk_function() is None
        q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
        taylor = AttentionSpec(kind="recurrent_softmax", taylor_order=2)
        for spec in (taylor, AttentionSpec(kind="linear", feature_map="elu")):
            out, _ = attention(q, k, v, spec, mode="chunked", return_state=False)
            assert torch.isfinite(out).all()
        assert not [name for name in sys.modules if name.split(".")[0] in ("triton", "fla")]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]

"""`hf_softmax_rnn.analysis.step_profile`: kernels and operators sorted into kinds by name, a step's rows
summed, and one profiled CPU step against the operations it is known to run."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from hf_softmax_rnn.analysis.step_profile import (
    KIND_NAMES,
    OTHER,
    KernelRow,
    kernel_rows,
    kind_of,
    profile_step,
    profile_table,
    summarize,
)

NAMES = {
    "flash_attention_cuda": (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>",
        "attention kernels",
    ),
    "fla_state_pass": ("chunk_fwd_kernel_h", "attention kernels"),
    "fla_output": ("chunk_simple_gla_fwd_kernel_o", "attention kernels"),
    "flex_template": ("triton_tem_fused_flex_attention_0", "attention kernels"),
    "sdpa_cpu": ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention kernels"),
    "cutlass_gemm": ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matrix products"),
    "nvjet": ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NNT", "matrix products"),
    "aten_mm": ("aten::mm", "matrix products"),
    "aten_bmm": ("aten::bmm", "matrix products"),
    "adam_foreach": (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
        "optimizer",
    ),
    "elementwise": ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", OTHER),
    "aten_mul": ("aten::mul", OTHER),
}


@pytest.mark.parametrize("label", list(NAMES))
def test_kernels_and_operators_are_sorted_into_kinds_by_name(label):
    name, kind = NAMES[label]
    assert kind_of(name) == kind


def test_a_step_s_rows_are_summed_by_kind_and_the_largest_listed():
    rows = [
        KernelRow("aten::mm", 3000.0, 6),
        KernelRow("chunk_fwd_kernel_h", 1500.0, 2),
        KernelRow("aten::mul", 250.0, 40),
        KernelRow("aten::add", 250.0, 10),
    ]
    profile = summarize(rows, "m", 128, "cpu", top=2)
    assert profile.kernel_ms == pytest.approx(5.0)
    assert profile.launches == 58
    assert profile.ms_by_kind == pytest.approx(
        {"attention kernels": 1.5, "matrix products": 3.0, "optimizer": 0.0, OTHER: 0.5}
    )
    assert profile.top == [("aten::mm", 3.0, 6), ("chunk_fwd_kernel_h", 1.5, 2)]
    assert profile.busy is None
    profile.step_ms = 10.0
    assert profile.busy == pytest.approx(0.5)


def test_on_a_gpu_the_rows_are_the_device_kernels_only():
    events = [
        SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, self_cpu_time_total=9.0,
                        self_device_time_total=0.0, count=1),
        SimpleNamespace(key="nvjet_tst_gemm", device_type=DeviceType.CUDA, self_cpu_time_total=0.0,
                        self_device_time_total=40.0, count=3),
        SimpleNamespace(key="cudaLaunchKernel", device_type=DeviceType.CPU, self_cpu_time_total=5.0,
                        self_device_time_total=0.0, count=3),
    ]  # fmt: skip
    assert kernel_rows(events, "cuda") == [KernelRow("nvjet_tst_gemm", 40.0, 3)]
    assert kernel_rows(events, "cpu") == [KernelRow("aten::mm", 9.0, 1)]


def test_a_profiled_cpu_step_counts_the_operations_it_runs():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        for _ in range(3):
            torch.mm(a, b)
        torch.mul(a, b)

    profile = profile_step(step, torch.device("cpu"), "toy", 256)
    assert ("aten::mm", pytest.approx(profile.ms_by_kind["matrix products"]), 3) == profile.top[0]
    assert profile.launches >= 4
    assert sum(profile.ms_by_kind.values()) == pytest.approx(profile.kernel_ms)
    lines = profile_table([profile])
    assert lines[0] == "| " + " | ".join(["L", "model", "step ms", "kernel ms", "busy", "launches", *KIND_NAMES]) + " |"
    assert lines[2].startswith("| 256 | toy | - | ")

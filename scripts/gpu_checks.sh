#!/usr/bin/env bash
# The GPU checks and tables in one run, each stage under a share of a time budget, so that a short
# lease still brings back what finished, quickest and most telling first: CUDA-graph decoding (tests,
# then bench_generate bf16 on SmolLM2's shape with random weights), bench_ops bf16 (and linear elu
# against SDPA and fla at batch 8), the same two tables in fp32, the fused-kernel tests, and last
# transformers' own compiled decoding (minutes of compilation).
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR] [SECONDS]      # default: gpu_results, 600
#
# Needs CUDA and `pip install -e ".[dev,gpu]"`; MODEL_CONFIG names the folder of the config.json to
# time (default: scripts/smollm2_135m_config, SmolLM2-135M-Instruct's). fla-core autotunes dozens of
# configurations per kernel on first use, and the Taylor-2 kernel three per kernel: on a fresh machine
# the first fused calls take minutes of that alone.
set -u -o pipefail
results=${1:-gpu_results}
end=$((SECONDS + ${2:-600}))
config=${MODEL_CONFIG:-scripts/smollm2_135m_config}
mkdir -p "$results"
left() { local r=$((end - SECONDS)); [ "$r" -lt 1 ] && r=1; [ "$r" -lt "$1" ] && echo "$r" || echo "$1"; }
stage() { echo "=== $1 $(date +%T), $((end - SECONDS)) s left"; }
run_tests() {  # log name, seconds, pytest arguments
  local log="$results/$1.log" seconds=$2
  shift 2
  timeout "$(left "$seconds")" python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider "$@" > "$log" 2>&1
  echo "pytest exit status $?"; grep -E "passed|failed|FAILED" "$log" | tail -15
}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
decode=(python scripts/bench_generate.py --device cuda --random-weights --model "$config"
  --contexts 128 16384 --steps 8 --rounds 3 --warmup 3 --prefill-chunk 4096)
ops=(python scripts/bench_ops.py --device cuda --lengths 4096 16384 --repeats 3)

stage graphed_decoding_tests
run_tests gpu_tests_graphed 60 tests/gpu/test_graphed_decoding.py
stage decode_graph_bf16
timeout "$(left 100)" "${decode[@]}" --dtype bfloat16 --cuda-graph \
  --presets linear_elu hedgehog_window_64 softmax_taylor_2 --output "$results/bench_generate_cuda_bf16_graph"
stage bench_ops_bf16
timeout "$(left 90)" "${ops[@]}" --dtype bfloat16 --output "$results/bench_ops_cuda_bf16"
stage bench_ops_bf16_batch8
timeout "$(left 60)" "${ops[@]}" --dtype bfloat16 --batch 8 --lengths 16384 --presets softmax linear_elu fla \
  --output "$results/bench_ops_cuda_bf16_batch8"
stage decode_graph_fp32
timeout "$(left 60)" "${decode[@]}" --dtype float32 --cuda-graph --presets linear_elu softmax_taylor_2 \
  --output "$results/bench_generate_cuda_fp32_graph"
stage bench_ops_fp32
timeout "$(left 120)" "${ops[@]}" --dtype float32 --output "$results/bench_ops_cuda_fp32"
stage fused_kernel_tests
run_tests gpu_tests_fused 200 tests/gpu/test_fused_kernels.py tests/ops/test_triton_taylor.py \
  tests/ops/test_fla_linear.py tests/ops/test_backends.py
stage decode_compiled
timeout "$(left 300)" "${decode[@]}" --dtype bfloat16 --compile --presets linear_elu \
  --output "$results/bench_generate_cuda_bf16_compiled"
stage end

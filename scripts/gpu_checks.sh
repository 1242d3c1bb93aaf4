#!/usr/bin/env bash
# The GPU checks and tables in one run, each stage under a share of a time budget, so that a short
# lease still brings back what finished: the fused-kernel tests, then bench_ops (bf16), compiled and
# eager decoding (bench_generate, SmolLM2's shape with random weights), then bench_ops (fp32).
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR] [SECONDS]      # default: gpu_results, 390
#
# Needs CUDA and `pip install -e ".[dev,gpu]"`; MODEL_CONFIG names the folder of the config.json to
# time (default: scripts/smollm2_135m_config, SmolLM2-135M-Instruct's). fla-core autotunes dozens of
# configurations per kernel on first use: on a fresh machine the first tests take minutes of that alone.
set -u -o pipefail
results=${1:-gpu_results}
end=$((SECONDS + ${2:-390}))
config=${MODEL_CONFIG:-scripts/smollm2_135m_config}
mkdir -p "$results"
left() { local r=$((end - SECONDS)); [ "$r" -lt 1 ] && r=1; [ "$r" -lt "$1" ] && echo "$r" || echo "$1"; }
stage() { echo "=== $1 $(date +%T), $((end - SECONDS)) s left"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

stage tests
timeout "$(left 150)" python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/gpu \
  tests/ops/test_triton_taylor.py tests/ops/test_fla_linear.py tests/ops/test_backends.py > "$results/gpu_tests.log" 2>&1
echo "pytest exit status $?"; grep -E "passed|failed|FAILED" "$results/gpu_tests.log" | tail -15
stage bench_ops_bf16
timeout "$(left 90)" python scripts/bench_ops.py --device cuda --dtype bfloat16 --lengths 1024 4096 16384 \
  --repeats 3 --output "$results/bench_ops_cuda_bf16"
decode=(python scripts/bench_generate.py --device cuda --dtype bfloat16 --random-weights --model "$config"
  --contexts 128 16384 --steps 8 --rounds 2 --warmup 3 --prefill-chunk 4096)
stage decode_compiled
timeout "$(left 130)" "${decode[@]}" --compile --presets linear_elu --output "$results/bench_generate_cuda_bf16_compiled"
stage decode_eager
timeout "$(left 50)" "${decode[@]}" --presets linear_elu hedgehog_window_64 softmax_taylor_2 \
  --output "$results/bench_generate_cuda_bf16_eager"
stage bench_ops_fp32
timeout "$(left 60)" python scripts/bench_ops.py --device cuda --dtype float32 --lengths 4096 16384 --repeats 3 \
  --output "$results/bench_ops_cuda_fp32"
stage end

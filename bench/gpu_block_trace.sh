#!/usr/bin/env bash
# Where the block recipe's step goes, kernel by kernel, on one GPU, building nothing: the FP8 tests
# (test_cuda_fp8), the block quantisation table (`bench_fp8 block-quant`), then each model's eager steps
# under bench/trace's CUPTI recorder (per-tensor current scaling and block scaling, bf16 moments), each
# summarised by kernel (bench/trace/summary.py), and last the captured training rows of both recipes
# beside PyTorch's Llama 1B (bench/gpu_block_gemm.sh's rows). Logs under $OUT.
# usage: bash bench/gpu_block_trace.sh BUILD_DIR [steps] [parts]   (parts: any of test quant trace train;
#   MODELS="1.3b llama1b" picks the models)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-20}
PARTS=${3:-"test quant trace train"}
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
has() { [[ " $PARTS " == *" $1 "* ]]; }
has test && kiln_gpu_tests "$B" test_cuda_fp8
if has quant; then
  timeout 240 "$B/bin/bench_fp8" block-quant > "$OUT/bench_fp8_block_quant.log" 2>&1
  echo "bench_fp8 block-quant rc=$?"
  cat "$OUT/bench_fp8_block_quant.log" | tail -30
fi
if has trace && [ -f "$B/lib/libkiln_trace.so" ]; then
  for m in ${MODELS:-1.3b llama1b}; do
    p=pipelines/gpt-1.3b.toml
    [ "$m" = llama1b ] && p=pipelines/llama-1b.toml
    for recipe in current block; do
      CUDA_INJECTION64_PATH="$PWD/$B/lib/libkiln_trace.so" KILN_TRACE="$OUT/t-$m-$recipe.csv" \
        kiln_row "trace-$m-$recipe" 1 10 $p --set fp8.enabled=true --set optim.moments=bf16 \
        --set fp8.recipe=$recipe
      python3 bench/trace/summary.py "$OUT/t-$m-$recipe.csv" --steps 10 --skip 4 --top 40 --width 110 \
        > "$OUT/trace-$m-$recipe.txt" 2>&1
      echo "---- $m $recipe (eager steps, per kernel)"
      head -60 "$OUT/trace-$m-$recipe.txt"
      rm -f "$OUT/t-$m-$recipe.csv"
    done
  done
fi
if has train; then
  OUT=$OUT KERNELS=cublaslt bash bench/gpu_block_gemm.sh "$B" "$STEPS" "train torch" | tail -12
fi
rm -f "$OUT"/*.jsonl

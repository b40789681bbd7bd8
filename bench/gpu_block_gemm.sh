#!/usr/bin/env bash
# kiln's own block-scaled FP8 GEMM (fp8.block_gemm, kiln/fp8/cuda/block_gemm.hpp) on one GPU, building
# nothing: its tests (test_cuda_fp8), its rates against cuBLASLt's at 1.3B's and Llama 1B's shapes
# (`bench_fp8 block`), then training rows of the block recipe with each kernel choice beside per-tensor
# current scaling (captured steps), and PyTorch's Llama 1B in the same call. A table last.
# usage: bash bench/gpu_block_gemm.sh BUILD_DIR [steps] [parts]
#   parts: any of test kernel train torch (default all); MODELS="1.3b llama1b", MOMENTS="bf16 f32",
#   KERNELS="cublaslt kiln kiln_wgrad" pick the training rows. Logs under $OUT.
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-30}
PARTS=${3:-"test kernel train torch"}
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has test; then
  kiln_gpu_tests "$B" test_cuda_fp8
  grep -E "relative (error|difference)" "$OUT/test_cuda_fp8.log" | head -20
fi
if has kernel; then
  timeout 240 "$B/bin/bench_fp8" block > "$OUT/bench_fp8_block.log" 2>&1
  echo "bench_fp8 block rc=$?"
  sed -n '/block GEMM/,/^$/p' "$OUT/bench_fp8_block.log"
fi
if has train; then
  G=(--set backend.cuda_graph=true --set fp8.enabled=true)
  for m in ${MODELS:-1.3b llama1b}; do
    p=pipelines/gpt-1.3b.toml
    [ "$m" = llama1b ] && p=pipelines/llama-1b.toml
    for moments in ${MOMENTS:-bf16}; do
      M=(--set optim.moments="$moments")
      kiln_row "$m-current-$moments" 1 "$STEPS" $p "${G[@]}" "${M[@]}" --set fp8.recipe=current
      for k in ${KERNELS:-cublaslt kiln kiln_wgrad}; do
        kiln_row "$m-block-$k-$moments" 1 "$STEPS" $p "${G[@]}" "${M[@]}" --set fp8.recipe=block \
          --set fp8.block_gemm="$k"
      done
    done
  done
fi
if has torch && python3 -c "import torch" 2>/dev/null; then
  timeout 300 python3 bench/torch_llama.py --batch 4 --steps "$STEPS" --out "$OUT/torch-llama.json" > "$OUT/torch-llama.log" 2>&1
  echo "torch llama-1b bf16 rc=$? $(cat "$OUT/torch-llama.json" 2>/dev/null)"
fi
rm -f "$OUT"/*.jsonl
kiln_rows_table

#!/usr/bin/env bash
# optim.moments = "bf16" on one GPU, building nothing: the GPU tests of the updates it changes (the
# flat AdamW, the fused FP8 updates per-tensor and block-scaled, captured steps, checkpoints, FSDP),
# then the 1.3B and Llama 1B FP8 runs with f32 and bf16 moments (captured steps), and the 1.3B with
# bf16 moments and the LM head in chunks of 2,048 rows; a table last (bench/kiln_rows.sh).
# usage: bash bench/gpu_moments.sh BUILD_DIR [steps]   (logs under $OUT; TESTS=0 skips the tests)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-30}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
: > "$OUT/rows.txt"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
K="$B/bin/kiln"
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
if [ "${TESTS:-1}" = 1 ]; then
  for t in test_cuda_ops test_cuda_fp8 test_gpu_model test_gpu_training_checkpoint test_gpu_fsdp; do
    timeout 300 "$B/bin/$t" > "$OUT/$t.log" 2>&1
    echo "$t rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$t.log" | tail -1)"
    grep -B3 -A12 "ERROR" "$OUT/$t.log" | head -40
  done
fi
G=(--set backend.cuda_graph=true --set fp8.enabled=true)
kiln_row 1.3b-fp8-m32 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}"
kiln_row 1.3b-fp8-m16 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" --set optim.moments=bf16
kiln_row 1.3b-fp8-m16-chunk2048 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" --set optim.moments=bf16 \
  --set model.head_chunk_rows=2048
kiln_row llama1b-fp8-m32 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}"
kiln_row llama1b-fp8-m16 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}" --set optim.moments=bf16
kiln_row 1.3b-bf16-m16 1 "$STEPS" pipelines/gpt-1.3b.toml --set backend.cuda_graph=true --set optim.moments=bf16
grep -h "optimizer\|moments" "$OUT"/1.3b-fp8-m16.log | head -5
kiln_rows_table

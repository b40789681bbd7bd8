#!/usr/bin/env bash
# optim.moments = "bf16" on one GPU, building nothing: the GPU tests of the updates it changes (the
# flat AdamW, the fused FP8 updates per-tensor and block-scaled, captured steps, checkpoints, FSDP),
# then the 1.3B, Llama 1B and 124M FP8 runs with f32 and bf16 moments (captured steps), with the FP8
# weights' transposed codes kept and not (fp8.keep_weight_transpose = false: -nt), the 1.3B also with
# the LM head in chunks of 2,048 rows; a table last (bench/kiln_rows.sh).
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
  for t in test_cuda_ops test_cuda_fp8 test_gpu_model test_gpu_training_checkpoint test_gpu_fsdp test_gpu_recompute; do
    timeout 300 "$B/bin/$t" > "$OUT/$t.log" 2>&1
    echo "$t rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$t.log" | tail -1)"
    grep -B3 -A12 "ERROR" "$OUT/$t.log" | head -40
  done
fi
G=(--set backend.cuda_graph=true --set fp8.enabled=true)
M16=(--set optim.moments=bf16)
NT=(--set fp8.keep_weight_transpose=false)  # the FP8 weights' rowwise codes alone
kiln_row 1.3b-fp8-m32 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}"
kiln_row 1.3b-fp8-m16 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${M16[@]}"
kiln_row 1.3b-fp8-m16-nt 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${M16[@]}" "${NT[@]}"
kiln_row 1.3b-fp8-m16-nt-chunk2048 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${M16[@]}" "${NT[@]}" \
  --set model.head_chunk_rows=2048
kiln_row 1.3b-fp8-m32-nt 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${NT[@]}"
kiln_row llama1b-fp8-m32 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}"
kiln_row llama1b-fp8-m16 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}" "${M16[@]}"
kiln_row llama1b-fp8-m16-nt 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}" "${M16[@]}" "${NT[@]}"
kiln_row 124m-fp8-m16 1 $((STEPS + 16)) pipelines/gpt2-124m.toml "${G[@]}" "${M16[@]}"
kiln_row 124m-fp8-m16-nt 1 $((STEPS + 16)) pipelines/gpt2-124m.toml "${G[@]}" "${M16[@]}" "${NT[@]}"
grep -h "cuda_graph" "$OUT"/1.3b-fp8-m16-nt.log | head -2
rm -f "$OUT"/*.jsonl "$OUT"/1.3b*.log "$OUT"/llama*.log "$OUT"/124m*.log
kiln_rows_table

#!/usr/bin/env bash
# The LM head a chunk of rows at a time (model.head_chunk_rows, ChunkedLossHead) on two H200s (kind
# nvidia-h200-x2), building nothing; a table last.
#   test    test_gpu_model (one GPU: the chunked head's CUDA step against the CPU reference, and captured
#           against eager)
#   bf16    gpt-1.3b (8 sequences of 1024 a GPU, 20 steps): one GPU and FSDP full_shard on two, the whole
#           logits (head_chunk_rows = 0) against chunks of CHUNKS rows (default "2048 1024"): ms/step,
#           tokens/s per GPU, peak memory
#   fp8     the same in FP8 delayed (the LM head in bf16)
#   8b      llama-8b bf16 (FSDP full_shard, every block recomputed, 12 steps), head_chunk_rows 0 and 2048
# usage: bash bench/gpu_chunked_head.sh BUILD_DIR [test] [bf16] [fp8] [8b]   (logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
shift || true
PARTS=" ${*:-test bf16 fp8} "
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$PWD/$B/bin/kiln"
want() { [[ $PARTS == *" $1 "* ]]; }
source "$(dirname "$0")/kiln_rows.sh"
: > "$OUT/rows.txt"

if want test; then
  CUDA_VISIBLE_DEVICES=0 timeout 400 "$B/bin/test_gpu_model" > "$OUT/test_gpu_model.log" 2>&1
  echo "test_gpu_model rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/test_gpu_model.log" | tail -1)"
  grep -B3 -A12 "ERROR" "$OUT/test_gpu_model.log" | head -40
fi


for prec in bf16 fp8; do
  if want $prec; then
    F=(pipelines/gpt-1.3b.toml --set fp8.enabled=$([ $prec = fp8 ] && echo true || echo false))
    for c in 0 ${CHUNKS:-2048 1024}; do
      CUDA_VISIBLE_DEVICES=0 kiln_row "one-13b-$prec-chunk_$c" 1 20 "${F[@]}" --set train.batch_size=8 \
        --set model.head_chunk_rows=$c
    done
    for c in 0 ${CHUNKS:-2048 1024}; do
      kiln_row "fsdp13b-$prec-chunk_$c" 2 20 "${F[@]}" --set train.batch_size=16 --set fsdp.strategy=full_shard \
        --set model.head_chunk_rows=$c
    done
  fi
done

if want 8b; then
  for c in 0 2048; do
    kiln_row "8b-bf16-chunk_$c" 2 12 pipelines/llama-8b.toml --set train.batch_size=8 --set activation_checkpoint.mode=full \
      --set model.head_chunk_rows=$c
  done
fi

kiln_rows_table

#!/usr/bin/env bash
# The LM head in FP8 (fp8.lm_head) against the bf16 head, one GPU, building nothing: each FP8 model
# with captured steps, bf16 AdamW moments and the inputs kept (model.recompute_norm and
# model.recompute_gelu false), with and without the FP8 head; then the 1.3B model with less memory
# (the FP8 weights' transposes made in the backward, the norms' outputs kept), and with the head a
# chunk of 2,048 rows at a time (model.head_chunk_rows; the FP8 head's dlogits codes then a chunk's).
# A table last (bench/kiln_rows.sh).
# usage: bash bench/gpu_lm_head.sh BUILD_DIR [steps] [parts]   (parts: any of 124m 1.3b llama1b
#   chunked; default all; logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-20}
PARTS=${3:-"124m 1.3b llama1b chunked"}
has() { [[ " $PARTS " == *" $1 "* ]]; }
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
F=(--set backend.cuda_graph=true --set fp8.enabled=true --set optim.moments=bf16)
KEPT=(--set model.recompute_norm=false --set model.recompute_gelu=false)
H=(--set fp8.lm_head=true)
pair() {  # name steps pipeline args...: the row, then with the FP8 head
  local name=$1 steps=$2 pipe=$3
  shift 3
  kiln_row "$name" 1 "$steps" "$pipe" "${F[@]}" "$@"
  kiln_row "$name-head" 1 "$steps" "$pipe" "${F[@]}" "$@" "${H[@]}"
}
has 124m && pair 124m-fp8-kept $((2 * STEPS)) pipelines/gpt2-124m.toml "${KEPT[@]}"
LOW=(--set fp8.keep_weight_transpose=false --set model.recompute_norm=false)
if has 1.3b; then
  pair 1.3b-fp8-kept "$STEPS" pipelines/gpt-1.3b.toml "${KEPT[@]}"
  pair 1.3b-fp8-lowmem "$STEPS" pipelines/gpt-1.3b.toml "${LOW[@]}"
fi
has llama1b && pair llama1b-fp8-kept "$STEPS" pipelines/llama-1b.toml "${KEPT[@]}"
if has chunked; then
  C=(--set model.head_chunk_rows=2048)
  pair 1.3b-fp8-lowmem-chunked "$STEPS" pipelines/gpt-1.3b.toml "${LOW[@]}" "${C[@]}"
  pair 1.3b-fp8-recomputed-chunked "$STEPS" pipelines/gpt-1.3b.toml --set fp8.keep_weight_transpose=false "${C[@]}"
  kiln_row 1.3b-fp8-kept-lowmem-chunked-head 1 "$STEPS" pipelines/gpt-1.3b.toml "${F[@]}" "${KEPT[@]}" "${H[@]}" \
    --set fp8.keep_weight_transpose=false "${C[@]}"
fi
rm -f "$OUT"/*.jsonl
kiln_rows_table

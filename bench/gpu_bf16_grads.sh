#!/usr/bin/env bash
# The gradients held in bf16 (optim.grads = "bf16") against f32, one GPU, building nothing: each
# model's fastest FP8 configuration (captured steps, bf16 AdamW moments, the inputs kept, the LM head
# in FP8) with f32 and bf16 gradients; the 1.3B model in less memory (the FP8 weights' transposes made
# in the backward, the head a chunk of 2,048 rows at a time) with bf16 gradients; the 124M bf16
# pipeline with both; `profile`: the 1.3B low-memory configuration's per-op breakdown (backend.profile,
# eager steps) with f32 and with bf16 gradients. A table last (bench/kiln_rows.sh).
# usage: bash bench/gpu_bf16_grads.sh BUILD_DIR [steps] [parts]   (parts: any of 1.3b 124m llama1b
#   profile; default all; logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-20}
PARTS=${3:-"1.3b 124m llama1b profile"}
has() { [[ " $PARTS " == *" $1 "* ]]; }
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
F=(--set backend.cuda_graph=true --set fp8.enabled=true --set optim.moments=bf16 --set fp8.lm_head=true
   --set model.recompute_norm=false --set model.recompute_gelu=false)
G=(--set optim.grads=bf16)
LOW=(--set fp8.keep_weight_transpose=false --set model.head_chunk_rows=2048)
pair() {  # name steps pipeline args...: the row with f32 gradients, then with bf16 ones
  local name=$1 steps=$2 pipe=$3
  shift 3
  kiln_row "$name" 1 "$steps" "$pipe" "$@"
  kiln_row "$name-g16" 1 "$steps" "$pipe" "$@" "${G[@]}"
}
if has 1.3b; then
  pair 1.3b-fp8-kept-head "$STEPS" pipelines/gpt-1.3b.toml "${F[@]}"
  pair 1.3b-fp8-kept-head-lowmem "$STEPS" pipelines/gpt-1.3b.toml "${F[@]}" "${LOW[@]}"
  kiln_row 1.3b-fp8-kept-head-chunked-g16 1 "$STEPS" pipelines/gpt-1.3b.toml "${F[@]}" \
    --set model.head_chunk_rows=2048 "${G[@]}"
fi
if has 124m; then
  pair 124m-bf16 $((2 * STEPS)) pipelines/gpt2-124m.toml
  pair 124m-fp8-kept-head $((2 * STEPS)) pipelines/gpt2-124m.toml "${F[@]}"
fi
has llama1b && pair llama1b-fp8-kept-head "$STEPS" pipelines/llama-1b.toml "${F[@]}"
if has profile; then
  for g in f32 bf16; do
    timeout 300 "$K" run pipelines/gpt-1.3b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
      --set log.val_every=0 --set log.every=4 --set train.steps=12 --set checkpoint.every=0 \
      --set checkpoint.at_end=false --set checkpoint.resume=never "${F[@]}" "${LOW[@]}" --set optim.grads=$g \
      --set backend.profile=true > "$OUT/profile-$g.log" 2>&1
    echo "profile, $g gradients (rc=$?):"
    sed -n '/op time breakdown/,+34p' "$OUT/profile-$g.log"
  done
fi
rm -f "$OUT"/*.jsonl
kiln_rows_table

#!/usr/bin/env bash
# Issue 29's speed aim (block scaling >= 1.3x PyTorch bf16) with AdamW's moments in bf16
# (optim.moments), on one GPU, building nothing: 1.3B and Llama 1B with per-tensor current scaling,
# block scaling and block scaling with the weight gradient's input in 128 x 128 blocks, each with f32
# and bf16 moments, captured steps; PyTorch's Llama 1B (bench/torch_llama.py, compiled, bf16 autocast,
# fused AdamW with f32 moments) in the same call. A table last (bench/kiln_rows.sh).
# usage: bash bench/gpu_block_moments.sh BUILD_DIR [steps]   (logs under $OUT; TORCH=0 skips PyTorch)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-30}
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
G=(--set backend.cuda_graph=true --set fp8.enabled=true)
for m in 1.3b llama1b; do
  p=pipelines/gpt-1.3b.toml
  [ $m = llama1b ] && p=pipelines/llama-1b.toml
  for moments in f32 bf16; do
    M=(--set optim.moments=$moments)
    kiln_row "$m-current-$moments" 1 "$STEPS" $p "${G[@]}" "${M[@]}" --set fp8.recipe=current
    kiln_row "$m-block-$moments" 1 "$STEPS" $p "${G[@]}" "${M[@]}" --set fp8.recipe=block
    kiln_row "$m-block2d-$moments" 1 "$STEPS" $p "${G[@]}" "${M[@]}" --set fp8.recipe=block \
      --set fp8.block_2d_wgrad_input=true
  done
done
if [ "${TORCH:-1}" = 1 ] && python3 -c "import torch" 2>/dev/null; then
  timeout 300 python3 bench/torch_llama.py --batch 4 --steps "$STEPS" --out "$OUT/torch-llama.json" > "$OUT/torch-llama.log" 2>&1
  echo "torch llama-1b bf16 rc=$? $(cat "$OUT/torch-llama.json" 2>/dev/null)"
fi
rm -f "$OUT"/*.jsonl "$OUT"/*.log
kiln_rows_table

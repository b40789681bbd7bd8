#!/usr/bin/env bash
# kiln's one-GPU aims beside PyTorch's references measured in the same call, building nothing: PyTorch's
# GPT-2 124M and 1.3B (bench/torch_gpt.py) and Llama 1B (bench/torch_llama.py), compiled, bf16 autocast,
# fused AdamW with f32 moments; kiln's rows of the same shapes with captured steps (bf16 with f32
# moments; FP8 delayed, current and block scaling with bf16 moments). A table last (bench/kiln_rows.sh),
# then each kiln row's ratio to its PyTorch reference of the same call.
# usage: bash bench/gpu_references.sh BUILD_DIR [steps] [parts]   (parts: any of 124m 1.3b llama1b;
#   default all; logs under $OUT). RECIPES="delayed current block" picks the FP8 rows; STORED=1 adds
#   each row again with the norms' and the activation's outputs not recomputed (model.recompute_norm
#   and model.recompute_gelu false: the FP8 layers then keep their inputs' FP8 copies), as PyTorch's
#   reference recomputes nothing. KERNELS="kiln_wgrad ..." adds block rows with those fp8.block_gemm
#   choices. HEAD=1 adds each FP8 row with the inputs kept and the LM head in FP8 too (fp8.lm_head);
#   TUNE=1 adds each bf16 row with backend.gemm_autotune.
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-20}
PARTS=${3:-"124m 1.3b llama1b"}
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
has() { [[ " $PARTS " == *" $1 "* ]]; }
G=(--set backend.cuda_graph=true)
S=(--set model.recompute_norm=false --set model.recompute_gelu=false)
row() {  # name args...: the row, and with STORED=1 the row with the inputs kept
  local name=$1
  shift
  kiln_row "$name" "$@"
  [ "${STORED:-0}" = 1 ] && kiln_row "$name-stored" "$@" "${S[@]}"
  if [[ " $* " == *" fp8.enabled=true "* ]]; then
    [ "${HEAD:-0}" = 1 ] && kiln_row "$name-stored-head" "$@" "${S[@]}" --set fp8.lm_head=true
  else
    [ "${TUNE:-0}" = 1 ] && kiln_row "$name-tuned" "$@" --set backend.gemm_autotune=true
  fi
  return 0
}
F=(--set fp8.enabled=true --set optim.moments=bf16)
torch_ref() {  # name script args...
  local name=$1
  shift
  python3 -c "import torch" 2>/dev/null || return 0
  timeout 300 python3 "$@" --steps "$STEPS" --out "$OUT/torch-$name.json" > "$OUT/torch-$name.log" 2>&1
  echo "torch $name rc=$? $(cat "$OUT/torch-$name.json" 2>/dev/null)"
}
if has 124m; then
  torch_ref 124m bench/torch_gpt.py --model 124m --batch 16
  row 124m-bf16 1 $((2 * STEPS)) pipelines/gpt2-124m.toml "${G[@]}"
  row 124m-fp8-delayed 1 $((2 * STEPS)) pipelines/gpt2-124m.toml "${G[@]}" "${F[@]}"
fi
fp8_rows() {  # name pipeline: the FP8 rows of each recipe, and the block rows of each KERNELS choice
  local m=$1 p=$2 r k
  for r in ${RECIPES:-delayed current block}; do
    row "$m-fp8-$r" 1 "$STEPS" "$p" "${G[@]}" "${F[@]}" --set fp8.recipe=$r
    [ "$r" = block ] && for k in ${KERNELS:-}; do
      row "$m-fp8-block-$k" 1 "$STEPS" "$p" "${G[@]}" "${F[@]}" --set fp8.recipe=block --set fp8.block_gemm="$k"
    done
  done
  return 0
}
if has 1.3b; then
  torch_ref 1.3b bench/torch_gpt.py --model 1.3b --batch 8
  [ -z "${RECIPES:-}" ] && row 1.3b-bf16 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}"
  fp8_rows 1.3b pipelines/gpt-1.3b.toml
fi
if has llama1b; then
  torch_ref llama1b bench/torch_llama.py --batch 4
  fp8_rows llama1b pipelines/llama-1b.toml
fi
rm -f "$OUT"/*.jsonl
kiln_rows_table
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
refs = {os.path.basename(p)[6:-5]: json.load(open(p)) for p in glob.glob(f"{out}/torch-*.json")}
print()
for name, r in sorted(refs.items()):
    print(f"PyTorch {name:<8} {r['ms_per_step']:9.2f} ms {r['tokens_per_s']:12,.0f} tok/s {r['peak_gib']:7.2f} GiB")
for line in open(f"{out}/rows.txt"):
    f = line.split()
    ref = refs.get(f[0].split("-")[0])
    if ref and len(f) > 2 and f[2].replace(",", "").isdigit():
        print(f"{f[0]:<30} {int(f[2].replace(',', '')) / ref['tokens_per_s']:.3f}x PyTorch bf16 (same call)")
PY

#!/usr/bin/env bash
# Issue 5's numerics runs in one call, building nothing: gpt2-124m on the Brown corpus (data/brown,
# carried with the build) for train.steps (2,000 by default) in bf16, FP8 delayed and FP8 current
# scaling from the same seed, metrics to $OUT/numerics-*.jsonl. With four GPUs visible the three runs
# go side by side on GPUs 0-2 while GPU 3 takes per-op profiles of FP8 steps; with fewer, one after
# another; SUITE=1 puts `bench/gpu_suite.sh BUILD fp8` on GPU 3 instead (logs under $OUT/suite). Plot locally: kiln plot $OUT/numerics-bf16.jsonl=bf16 ... -o docs/fp8-loss.svg
# usage: bash bench/gpu_numerics.sh BUILD_DIR [STEPS]
# RUNS="bf16 fp8-block ..." picks the runs (one after another on fewer than four GPUs; default the
# three above; fp8-block is issue 29's block scaling, fp8-block-2d with the weight gradient's input in
# 128x128 blocks; bf16-m16, fp8-delayed-m16 and fp8-block-m16 with optim.moments = "bf16"; fp8-delayed-m16-head with the LM head in FP8 too,
# fp8.lm_head; bf16-g16, fp8-delayed-m16-g16 and fp8-delayed-m16-head-g16 with the gradients in bf16, optim.grads); MODEL=llama1b runs pipelines/llama-1b.toml on
# the Brown GPT-2 BPE tokens (data/brown-gpt2, carried) instead, metrics to $OUT/numerics-llama1b-*.jsonl.
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-2000}
RUNS=${RUNS:-"bf16 fp8-delayed fp8-current"}
MODEL=${MODEL:-124m}
PIPE=pipelines/gpt2-124m.toml
PREFIX=numerics
if [ "$MODEL" = llama1b ]; then PIPE=pipelines/llama-1b.toml; PREFIX=numerics-llama1b; fi
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
ngpu=$(nvidia-smi -L | wc -l)
data=data/brown
[ "$MODEL" = llama1b ] && data=data/brown-gpt2
[ -f $data/train_000000.bin ] || { echo "$data missing: carry it"; exit 1; }
# run NAME GPU ARGS...
run() {
  local name=$1 gpu=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout 560 "$K" run "$PIPE" --set train.steps="$STEPS" \
    --set log.every=50 --set log.val_every=100 --set log.metrics="$OUT/$PREFIX-$name.jsonl" "$@" > "$OUT/$PREFIX-$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/$PREFIX-$name.log"
}
# The arguments of each named run.
args_of() {
  case $1 in
    bf16) ;;
    fp8-delayed) echo --set fp8.enabled=true ;;
    fp8-current) echo --set fp8.enabled=true --set fp8.recipe=current ;;
    fp8-block) echo --set fp8.enabled=true --set fp8.recipe=block ;;
    fp8-block-2d) echo --set fp8.enabled=true --set fp8.recipe=block --set fp8.block_2d_wgrad_input=true ;;
    fp8-block-e4m3) echo --set fp8.enabled=true --set fp8.recipe=block --set fp8.format=e4m3 ;;
    bf16-m16) echo --set optim.moments=bf16 ;;  # AdamW's moments in bf16
    fp8-delayed-m16) echo --set fp8.enabled=true --set optim.moments=bf16 ;;
    fp8-block-m16) echo --set fp8.enabled=true --set fp8.recipe=block --set optim.moments=bf16 ;;
    fp8-delayed-m16-head) echo --set fp8.enabled=true --set optim.moments=bf16 --set fp8.lm_head=true ;;
    fp8-delayed-m16-head-g16) echo --set fp8.enabled=true --set optim.moments=bf16 --set fp8.lm_head=true --set optim.grads=bf16 ;;
    fp8-delayed-m16-g16) echo --set fp8.enabled=true --set optim.moments=bf16 --set optim.grads=bf16 ;;
    bf16-g16) echo --set optim.grads=bf16 ;;  # the gradients held in bf16
    *) echo "unknown run $1" >&2; exit 2 ;;
  esac
}
profile() {  # NAME GPU PIPELINE ARGS...
  local name=$1 gpu=$2 pipe=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout 120 "$K" run "$pipe" --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=4 --set backend.profile=true --set log.metrics="$OUT/profile-$name.jsonl" "$@" \
    > "$OUT/profile-$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/profile-$name.log"
}
t0=$(date +%s)
if [ "$ngpu" -ge 4 ]; then
  run bf16 0 &
  run fp8-delayed 1 --set fp8.enabled=true &
  run fp8-current 2 --set fp8.enabled=true --set fp8.recipe=current &
  if [ "${SUITE:-0}" = 1 ]; then  # GPU 3: the FP8 tests and benchmarks of bench/gpu_suite.sh
    ( CUDA_VISIBLE_DEVICES=3 OUT="$OUT/suite" bash bench/gpu_suite.sh "$B" fp8 > "$OUT/suite-summary.txt" 2>&1 ) &
  else
    ( profile 124m-fp8 3 pipelines/gpt2-124m.toml --set train.steps=12 --set fp8.enabled=true
      profile 1.3b-fp8 3 pipelines/gpt-1.3b.toml --set train.steps=8 --set fp8.enabled=true ) &
  fi
  wait
else
  # shellcheck disable=SC2046
  for r in $RUNS; do run "$r" 0 $(args_of "$r"); done
fi
echo "all runs: $(( $(date +%s) - t0 )) s"
for f in "$OUT"/$PREFIX-*.log "$OUT"/profile-*.log; do
  [ -f "$f" ] || continue
  echo "===== $(basename "$f")"
  cat "$f"
done > "$OUT/$PREFIX-logs.txt"
rm -f "$OUT"/$PREFIX-*.log "$OUT"/profile-*.log "$OUT"/profile-*.jsonl  # the device returns few files
python3 - "$OUT" "$PREFIX" $RUNS <<'PY'
import json, sys, pathlib
out, prefix, runs = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
print(f"{'run':<14} {'steps':>5} {'final loss':>10} {'final val':>10} {'vs first':>8} {'median tok/s':>12}")
base = None
for name in runs:
    p = out / f"{prefix}-{name}.jsonl"
    if not p.exists():
        print(f"{name:<14} missing"); continue
    rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    vals = [r for r in rows if "val_loss" in r]
    v = vals[-1]["val_loss"] if vals else float("nan")
    if base is None: base = v
    tps = sorted(r["tokens_per_s"] for r in rows[len(rows)//4:])
    print(f"{name:<14} {rows[-1]['step']:>5} {rows[-1]['loss']:>10.4f} {v:>10.4f} {100*(v/base-1):>7.2f}% {tps[len(tps)//2]:>12,.0f}")
PY
[ -f "$OUT/suite-summary.txt" ] && tail -16 "$OUT/suite-summary.txt"

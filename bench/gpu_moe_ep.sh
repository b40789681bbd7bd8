#!/usr/bin/env bash
# moe-1b FP8 on one GPU against ep = 2 on two, building nothing: each timed, then each traced
# (bench/trace: rank 0's and rank 1's timelines under ep = 2), and the summaries (GPU busy and idle
# per step, kernels by time, idle gaps by what ended them) last. Needs two GPUs and libkiln_trace.so.
# usage: bash bench/gpu_moe_ep.sh BUILD_DIR [steps] [extra --set args...]   (logs under $OUT; TRACE=0: no
#   traced runs; VARIANTS=1: ep = 2 again with NCCL's point-to-point chunk and channels raised, and with
#   parallel.copy_engine; ROUNDS=N: one GPU and ep = 2 alternated N times, each round's share of one GPU
#   printed (one step moves a 24-step median by ~1%); LT=1: bench_lt_algos first, cuBLASLt's memsets per
#   candidate of moe-1b's FP8 products)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-24}
shift 2 || shift $#
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} kiln_gpu_env "$B"
moe=(pipelines/moe-1b.toml --set fp8.enabled=true --set optim.moments=bf16 "$@")
if [ "${LT:-0}" = 1 ] && [ -x "$B/bin/bench_lt_algos" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 "$B/bin/bench_lt_algos" 8 20 > "$OUT/lt_algos.txt" 2>&1
  echo "bench_lt_algos rc=$?"
  grep -v 'split cv' "$OUT/lt_algos.txt" | cut -c1-140
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  sfx=$([ "${ROUNDS:-1}" = 1 ] || echo "-r$r")
  kiln_row "moe-one$sfx" 1 "$STEPS" "${moe[@]}"
  kiln_row "moe-ep2$sfx" 2 "$STEPS" "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16
done
if [ "${VARIANTS:-0}" = 1 ]; then  # NCCL's point-to-point settings, and the copy engines
  NCCL_P2P_NVL_CHUNKSIZE=2097152 kiln_row moe-ep2-nvlchunk2m 2 "$STEPS" "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16
  NCCL_MIN_P2P_NCHANNELS=32 kiln_row moe-ep2-p2pch32 2 "$STEPS" "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16
  kiln_row moe-ep2-ce 2 "$STEPS" "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16 --set parallel.copy_engine=true
fi
if [ "${TRACE:-1}" = 1 ] && [ -f "$B/lib/libkiln_trace.so" ]; then
  export CUDA_INJECTION64_PATH="$PWD/$B/lib/libkiln_trace.so" KILN_TRACE_API=0
  KILN_TRACE="$OUT/one.csv" kiln_row moe-one-traced 1 14 "${moe[@]}"
  KILN_TRACE="$OUT/ep2-{rank}.csv" kiln_row moe-ep2-traced 2 14 "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16
  unset CUDA_INJECTION64_PATH
  for t in one ep2-0 ep2-1; do
    [ -f "$OUT/$t.csv" ] || { echo "no trace $t"; continue; }
    echo "================ trace $t"
    python3 bench/trace/summary.py "$OUT/$t.csv" --steps 14 --skip 6 --top 40 > "$OUT/$t-summary.txt" 2>&1
    head -75 "$OUT/$t-summary.txt"
    gzip -f "$OUT/$t.csv"
  done
fi
kiln_rows_table
# Each round's ep = 2 tokens/s per GPU over its one-GPU run's.
python3 - "$OUT/rows.txt" <<'PY'
import re, sys
rows = {l.split()[0]: l.split() for l in open(sys.argv[1]) if l.strip()}
for name, f in rows.items():
    one = rows.get(name.replace("moe-ep2", "moe-one"))
    if re.fullmatch(r"moe-ep2(-r\d+)?", name) and one and len(f) > 2 and len(one) > 2:
        print(f"{name}: {float(f[2].replace(',', '')) / float(one[2].replace(',', '')):.1%} of one GPU")
PY

#!/usr/bin/env bash
# parallel.copy_engine on two GPUs (kind nvidia-h200-x2), building nothing: the communicator's test,
# bench_collectives (bandwidth, and an all-reduce beside a GEMM, NCCL against copy engines), then
# training rows, each against the same layout on NCCL: 1.3B TP=2 with and without sequence parallelism
# and tp_comm_overlap; 1.3B DP=2 and FSDP full_shard; moe-1b FP8 at ep = 2; each beside its one-GPU
# run; `trace`: rank 0's CUPTI timeline of TP=2 on NCCL and on copy engines.
# usage: bash bench/gpu_copy_engine.sh BUILD_DIR [test] [coll] [tp] [fsdp] [moe] [trace]
#   (default: all but trace; logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
shift || true
PARTS=${*:-test coll tp fsdp moe}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
source bench/kiln_rows.sh
: > "$OUT/rows.txt"
want() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi -L

if want test; then
  timeout 200 "$B/bin/gpu_copy_engine_main" --nproc 2 2>&1 | tail -5
  echo "copy-engine test rc=${PIPESTATUS[0]}"
fi
if want coll; then
  timeout 300 "$B/bin/bench_collectives" --nproc 2 > "$OUT/collectives.txt" 2>&1
  echo "bench_collectives rc=$?"
  grep -v '^\[rank' "$OUT/collectives.txt" | head -60
fi
if want tp; then
  m13=(pipelines/gpt2-124m.toml --set model.n_layer=24 --set model.n_head=16 --set model.n_embd=2048
       --set train.batch_size=8 --set model.recompute_gelu=true)
  tp=(--set parallel.tp=2)
  sp=(--set parallel.sequence_parallel=true)
  lap=(--set parallel.tp_comm_overlap=true)
  ce=(--set parallel.copy_engine=true)
  kiln_row 1.3b-one 1 16 "${m13[@]}"
  kiln_row 1.3b-tp2 2 16 "${m13[@]}" "${tp[@]}"
  kiln_row 1.3b-tp2-ce 2 16 "${m13[@]}" "${tp[@]}" "${ce[@]}"
  kiln_row 1.3b-tp2-lap-ce 2 16 "${m13[@]}" "${tp[@]}" "${lap[@]}" "${ce[@]}"
  kiln_row 1.3b-tp2-sp 2 16 "${m13[@]}" "${tp[@]}" "${sp[@]}"
  kiln_row 1.3b-tp2-sp-ce 2 16 "${m13[@]}" "${tp[@]}" "${sp[@]}" "${ce[@]}"
  kiln_row 1.3b-tp2-sp-lap-ce 2 16 "${m13[@]}" "${tp[@]}" "${sp[@]}" "${lap[@]}" "${ce[@]}"
  kiln_row 1.3b-fp8-tp2 2 16 "${m13[@]}" "${tp[@]}" --set fp8.enabled=true
  kiln_row 1.3b-fp8-tp2-ce 2 16 "${m13[@]}" "${tp[@]}" --set fp8.enabled=true "${ce[@]}"
fi
if want fsdp; then  # data parallelism and FSDP full_shard at 1.3B (the dp group on copy engines)
  f13=(pipelines/gpt-1.3b.toml)
  kiln_row fsdp-one 1 20 "${f13[@]}" --set train.batch_size=8
  kiln_row fsdp-fp8-one 1 20 "${f13[@]}" --set train.batch_size=8 --set fp8.enabled=true
  kiln_row dp2 2 20 "${f13[@]}" --set train.batch_size=16
  kiln_row dp2-ce 2 20 "${f13[@]}" --set train.batch_size=16 --set parallel.copy_engine=true
  kiln_row fsdp2 2 20 "${f13[@]}" --set train.batch_size=16 --set fsdp.strategy=full_shard
  kiln_row fsdp2-ce 2 20 "${f13[@]}" --set train.batch_size=16 --set fsdp.strategy=full_shard \
    --set parallel.copy_engine=true
  kiln_row fsdp2-fp8 2 20 "${f13[@]}" --set train.batch_size=16 --set fsdp.strategy=full_shard --set fp8.enabled=true
  kiln_row fsdp2-fp8-ce 2 20 "${f13[@]}" --set train.batch_size=16 --set fsdp.strategy=full_shard \
    --set parallel.copy_engine=true --set fp8.enabled=true
fi
if want moe; then
  moe=(pipelines/moe-1b.toml --set fp8.enabled=true)
  kiln_row moe-one 1 24 "${moe[@]}"
  kiln_row moe-ep2 2 24 "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16
  kiln_row moe-ep2-ce 2 24 "${moe[@]}" --set parallel.ep=2 --set train.batch_size=16 --set parallel.copy_engine=true
fi
if want trace && [ -f "$B/lib/libkiln_trace.so" ]; then  # rank 0's timeline, NCCL against copy engines
  m13=(pipelines/gpt2-124m.toml --set model.n_layer=24 --set model.n_head=16 --set model.n_embd=2048
       --set train.batch_size=8 --set model.recompute_gelu=true --set data.synthetic_vocab=50257
       --set 'data.val_files=""' --set log.val_every=0 --set train.steps=10 --set parallel.tp=2)
  for v in nccl ce; do
    extra=()
    [ "$v" = ce ] && extra=(--set parallel.copy_engine=true)
    CUDA_INJECTION64_PATH="$PWD/$B/lib/libkiln_trace.so" KILN_TRACE="$OUT/trace-$v-{rank}.csv" \
      timeout 300 "$K" run --nproc 2 "${m13[@]}" "${extra[@]}" > "$OUT/trace-$v.log" 2>&1
    echo "== trace $v rc=$?"
    python3 bench/trace/summary.py "$OUT/trace-$v-0.csv" --steps 10 --skip 4 --top 14 2>&1 | head -60
  done
fi
for f in "$OUT"/*.log; do
  grep -H -m3 -iE 'error|fail|check failed' "$f" | grep -v 'failures: 0' | head -3
done
kiln_rows_table

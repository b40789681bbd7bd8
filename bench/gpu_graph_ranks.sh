#!/usr/bin/env bash
# backend.cuda_graph with two ranks (kind nvidia-h200-x2), building nothing; a table last.
#   test    test_gpu_model (one GPU), then tests/parallel/gpu_graph_ranks_test.sh: captured steps equal
#           eager ones bit for bit (TP + SP + recompute, TP overlap, Llama with vocabulary parallelism, DP
#           buckets with FP8 and micro-batches, FSDP full_shard and shard_grad_op)
#   bench   GPT-2 124M, eager against captured, alternating (ROUNDS rounds, default 1): data parallelism
#           and FSDP full_shard (16 sequences a GPU) and tensor parallelism (TP = 2, 16 sequences), bf16
#           and FP8 delayed
#   ctas    NCCL's CTAs per collective (NCCL_MAX_CTAS) for FSDP full_shard on two GPUs: gpt-1.3b bf16
#           (8 sequences a GPU) and, with CTAS8B=1, llama-8b bf16 with every block recomputed, at NCCL's
#           default and at CTAS (default "16 8") CTAs: tokens/s per GPU and peak memory; and the one-GPU
#           1.3B run the FSDP rows are a share of
# usage: bash bench/gpu_graph_ranks.sh BUILD_DIR [test] [bench] [ctas]   (logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
shift || true
PARTS=" ${*:-test bench} "
OUT=${OUT:-gpu-logs}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
want() { [[ $PARTS == *" $1 "* ]]; }
: > "$OUT/rows.txt"

if want test; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 "$B/bin/test_gpu_model" > "$OUT/test_gpu_model.log" 2>&1
  echo "test_gpu_model rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/test_gpu_model.log" | tail -1)"
  grep -B3 -A12 "ERROR" "$OUT/test_gpu_model.log" | head -40
  timeout 500 bash tests/parallel/gpu_graph_ranks_test.sh "$K" > "$OUT/test.log" 2>&1
  echo "gpu_graph_ranks_test rc=$?"
  head -60 "$OUT/test.log"
fi

run() {  # name steps args... : one two-rank kiln command; its row (median ms/step, tokens/s per GPU, peak) to rows.txt
  local name=$1 steps=$2
  shift 2
  timeout 300 "$K" run --nproc "${NPROC:-2}" --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0 \
    --set log.every=1000 --set train.steps="$steps" --set parallel.timeout_s=300 --set checkpoint.every=0 \
    --set checkpoint.at_end=false --set checkpoint.resume=never --set log.metrics="$OUT/$name.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  python3 - "$OUT/$name.jsonl" "$OUT/$name.log" "$name" "${NPROC:-2}" >> "$OUT/rows.txt" <<'PY'
import json, re, statistics, sys
try:
    r = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    r = [x for x in r if "step_ms" in x]
    st = r[len(r) // 4:] or r
    ms = statistics.median(x["step_ms"] for x in st)
    tps = statistics.median(x["tokens_per_s"] for x in st) / int(sys.argv[4])
    peaks = [float(g) for g in re.findall(r"peak device memory ([0-9.]+)", open(sys.argv[2]).read())]
    print(f"{sys.argv[3]:<28} {ms:>9.2f} {tps:>12,.0f} {max(peaks) if peaks else float('nan'):>9.2f} {r[-1]['loss']:>10.6f}")
except Exception as e:
    print(f"{sys.argv[3]:<28} (no figures: {e})")
PY
}

if want bench; then
  for prec in bf16 fp8; do
    F=(--set fp8.enabled=$([ $prec = fp8 ] && echo true || echo false))
    for round in $(seq 1 "${ROUNDS:-1}"); do
      for g in false true; do
        run "dp2-$prec-graph_$g-$round" "$STEPS" pipelines/gpt2-124m.toml --set train.batch_size=32 "${F[@]}" \
          --set backend.cuda_graph=$g
        run "fsdp2-$prec-graph_$g-$round" "$STEPS" pipelines/gpt2-124m.toml --set train.batch_size=32 "${F[@]}" \
          --set fsdp.strategy=full_shard --set backend.cuda_graph=$g
        run "tp2-$prec-graph_$g-$round" "$STEPS" pipelines/gpt2-124m.toml --set train.batch_size=16 --set parallel.tp=2 \
          "${F[@]}" --set backend.cuda_graph=$g
      done
    done
  done
  grep -h "backend.cuda_graph" "$OUT"/*graph_true-1.log | sort | uniq -c
fi

if want ctas; then
  NPROC=1 run "one-13b-bf16" 20 pipelines/gpt-1.3b.toml --set train.batch_size=8
  for c in default ${CTAS:-16 8}; do
    NAME="fsdp13b-bf16-ctas_$c"
    if [ "$c" = default ]; then
      run "$NAME" 20 pipelines/gpt-1.3b.toml --set train.batch_size=16 --set fsdp.strategy=full_shard
    else
      NCCL_MAX_CTAS=$c run "$NAME" 20 pipelines/gpt-1.3b.toml --set train.batch_size=16 --set fsdp.strategy=full_shard
    fi
  done
  if [ "${CTAS8B:-0}" = 1 ]; then
    for c in default ${CTAS:-16 8}; do
      a=(pipelines/llama-8b.toml --set train.batch_size=8 --set activation_checkpoint.mode=full)
      if [ "$c" = default ]; then run "8b-bf16-ctas_$c" 12 "${a[@]}"; else NCCL_MAX_CTAS=$c run "8b-bf16-ctas_$c" 12 "${a[@]}"; fi
    done
  fi
fi

echo
printf "%-28s %9s %12s %9s %10s\n" run "ms/step" "tok/s/GPU" "peak GiB" "last loss"
cat "$OUT/rows.txt"

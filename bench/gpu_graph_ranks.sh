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
source "$(dirname "$0")/kiln_rows.sh"
: > "$OUT/rows.txt"

if want test; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 "$B/bin/test_gpu_model" > "$OUT/test_gpu_model.log" 2>&1
  echo "test_gpu_model rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/test_gpu_model.log" | tail -1)"
  grep -B3 -A12 "ERROR" "$OUT/test_gpu_model.log" | head -40
  timeout 500 bash tests/parallel/gpu_graph_ranks_test.sh "$K" > "$OUT/test.log" 2>&1
  echo "gpu_graph_ranks_test rc=$?"
  head -60 "$OUT/test.log"
fi

run() {  # name steps args... : one kiln command on NPROC (default 2) ranks; its row to rows.txt
  local name=$1 steps=$2
  shift 2
  KILN_ROW_TIMEOUT=300 kiln_row "$name" "${NPROC:-2}" "$steps" "$@"
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

kiln_rows_table

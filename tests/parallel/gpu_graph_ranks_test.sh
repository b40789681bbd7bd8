#!/usr/bin/env bash
# backend.cuda_graph with two ranks on two GPUs (`kiln run --nproc 2`, NCCL): every micro-batch's
# forward and backward captured with their collectives at step 3 and replayed after it, and where
# no system of theirs keeps the host (all but FSDP) the last micro-batch's graph runs through the
# gradient sync (the DP buckets' last launches, the TP and amax all-reduces) and the optimizer (the
# gradient's norm summed over the ranks on the stream); the run must say which. Each layout
# runs 7 steps captured and 7 eager from the same seed; the losses and gradient norms of every step
# must be equal bit for bit (dropout on, so every replay must draw fresh masks as the eager steps
# do), and the captured run must say it captured. Layouts: tensor parallelism with sequence
# parallelism and full recompute; with the collectives beside split GEMMs (parallel.tp_comm_overlap),
# in bf16 and in FP8 (with sequence parallelism too: FP8 codes gathered in pieces); with the copy-engine
# transport (parallel.copy_engine) under sequence parallelism, the norms' outputs kept;
# a Llama with vocabulary parallelism; data parallelism with two micro-batches and FP8 (the
# gradient buckets the last micro-batch's backward starts are inside its graph); FSDP full_shard
# with two micro-batches (its gathers and reduce-scatters in the graphs), and shard_grad_op in FP8
# reduced once a step; activation offload under FSDP and under TP + SP.
# Skipped (KILN_SKIP) without two GPUs.
# usage: [ONLY="layout ..."] gpu_graph_ranks_test.sh KILN
set -u
KILN=$(realpath "$1")
if ! command -v nvidia-smi >/dev/null || [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -lt 2 ]; then
  echo "KILN_SKIP: needs two GPUs"
  exit 0
fi
export NCCL_NVLS_ENABLE=0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
cat > run.toml <<TOML
[engine]
device = "cuda"
[train]
steps = 7
batch_size = 8
seq_len = 128
[model]
n_layer = 3
n_head = 4
n_embd = 128
vocab_size = 512
max_seq_len = 128
dropout = 0.1
[optim]
[data]
synthetic_vocab = 512
[backend]
attention_deterministic = true
[log]
every = 1
TOML
fail=0
check() {  # name through-optimizer(yes|no) sets...
  local name=$1 through=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="name ...": those layouts
  for graph in true false; do
    timeout 240 "$KILN" run run.toml --nproc 2 --set backend.cuda_graph=$graph \
      --set log.metrics="$name-$graph.jsonl" "$@" > "$name-$graph.log" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
      echo "FAIL $name (cuda_graph=$graph): exit $rc"
      tail -20 "$name-$graph.log"
      fail=1
      return
    fi
  done
  local said="the last with the gradient sync and optimizer"
  [ "$through" = no ] && said="the gradient sync and optimizer run eagerly"
  if ! grep "backend.cuda_graph: each micro-batch's forward and backward captured" "$name-true.log" | grep -q "$said"; then
    echo "FAIL $name: the run did not say \"$said\":"
    grep "backend.cuda_graph" "$name-true.log"
    fail=1
    return
  fi
  if ! python3 - "$name-true.jsonl" "$name-false.jsonl" <<'PY'
import json, sys
rows = [[json.loads(l) for l in open(p) if l.strip()] for p in sys.argv[1:]]
pick = lambda rs: [(r["step"], r["loss"], r["grad_norm"]) for r in rs if "loss" in r]
g, e = pick(rows[0]), pick(rows[1])
if len(g) != 7 or g != e:
    print("captured:", g, "\neager:   ", e)
    sys.exit(1)
PY
  then
    echo "FAIL $name: the captured run's losses or gradient norms differ from the eager run's"
    fail=1
    return
  fi
  echo "ok   $name"
}
check tp-sp-recompute yes --set parallel.tp=2 --set parallel.sequence_parallel=true --set activation_checkpoint.mode=full
check tp-overlap yes --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.tp_comm_overlap=true \
  --set parallel.tp_comm_chunks=2
check llama-tp-vocab yes --set parallel.tp=2 --set parallel.vocab_parallel=true --set model.arch=llama \
  --set model.n_kv_head=2
check tp-fp8 yes --set parallel.tp=2 --set fp8.enabled=true --set optim.grad_clip=0.5
check tp-fp8-overlap yes --set parallel.tp=2 --set fp8.enabled=true --set parallel.tp_comm_overlap=true \
  --set parallel.tp_comm_chunks=2
check tp-sp-fp8-overlap yes --set parallel.tp=2 --set parallel.sequence_parallel=true --set fp8.enabled=true \
  --set parallel.tp_comm_overlap=true --set parallel.tp_comm_chunks=2
# The copy-engine transport (messages above its 256 KiB floor: d256, 16 sequences) with the norms kept.
check tp-sp-ce-overlap yes --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.tp_comm_overlap=true \
  --set parallel.copy_engine=true --set model.recompute_norm=false --set model.n_embd=256 --set train.batch_size=16
check dp-fp8-micro yes --set train.micro_batch_size=2 --set fp8.enabled=true --set parallel.dp_bucket_mb=0.05
check fsdp-full-micro no --set fsdp.strategy=full_shard --set train.micro_batch_size=2
check fsdp-sgo-fp8-step no --set fsdp.strategy=shard_grad_op --set fp8.enabled=true --set fsdp.reduce=step \
  --set train.micro_batch_size=2
# Activations offloaded to host memory (activation_offload: the copies captured with the passes),
# under FSDP with two micro-batches and under TP + SP through the optimizer.
check fsdp-offload no --set fsdp.strategy=full_shard --set train.micro_batch_size=2 --set activation_offload.blocks=2 \
  --set activation_offload.every=1 --set activation_offload.slots=1
check tp-sp-offload yes --set parallel.tp=2 --set parallel.sequence_parallel=true --set activation_offload.blocks=2 \
  --set activation_offload.every=1 --set activation_offload.slots=1
exit $fail

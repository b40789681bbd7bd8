#!/usr/bin/env bash
# Prints the training and validation losses of a matrix of tiny CPU runs, every step, to the last
# bit (JSON's 17 significant digits): GPT-2 and Llama blocks under tensor, sequence, vocabulary and
# data parallelism, FSDP, recompute, dropout, micro-batches, FP8 (delayed, current and block), bf16
# emulation and a resumed checkpoint. Run it before and after a change that must not change the
# numbers (a refactor) and diff the two outputs:
#   bash scripts/loss-fingerprint.sh build/bin/kiln > before.txt
set -euo pipefail
KILN=$(realpath "${1:-build/bin/kiln}")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

cat > gpt2.toml <<'EOF'
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 6
seed = 7
batch_size = 8
seq_len = 32
[model]
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 256
max_seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 2
[data]
synthetic_vocab = 256
val_batches = 1
[log]
every = 1
val_every = 0
metrics = "metrics.jsonl"
EOF
sed -e 's/^n_head = 4/n_head = 4\narch = "llama"\nn_kv_head = 2\nffn_hidden = 96\ntie_embeddings = false/' gpt2.toml > llama.toml

run() {  # name, pipeline, nproc, --set arguments...
  local name=$1 pipe=$2 nproc=$3
  shift 3
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  rm -f metrics.jsonl
  if ! "$KILN" run "$pipe" --nproc "$nproc" "${sets[@]}" > "log-$name.txt" 2>&1; then
    echo "$name: FAILED"
    tail -5 "log-$name.txt"
    return
  fi
  echo "$name: $(grep -oE '"(loss|grad_norm|norm)":[^,}]+' metrics.jsonl | tr '\n' ' ')"
}

for arch in gpt2 llama; do
  p=$arch.toml
  run "$arch.plain" $p 1
  run "$arch.dropout" $p 1 model.dropout=0.1
  run "$arch.keep_norm_act" $p 1 model.recompute_norm=false model.recompute_gelu=false
  run "$arch.micro" $p 1 train.micro_batch_size=2 model.dropout=0.1
  run "$arch.bf16" $p 1 backend.cpu_round_bf16=true
  run "$arch.full" $p 1 activation_checkpoint.mode=full model.dropout=0.1
  run "$arch.sel_attn" $p 1 activation_checkpoint.mode=selective activation_checkpoint.selective=attention model.dropout=0.1
  run "$arch.sel_mlp" $p 1 activation_checkpoint.mode=selective activation_checkpoint.selective=mlp activation_checkpoint.every=2
  run "$arch.tp2" $p 2 parallel.tp=2 model.dropout=0.1
  run "$arch.tp2_sp" $p 2 parallel.tp=2 parallel.sequence_parallel=true model.dropout=0.1 activation_checkpoint.mode=full
  run "$arch.tp2_vocab" $p 2 parallel.tp=2 parallel.vocab_parallel=true model.recompute_norm=false
  run "$arch.tp2_dist" $p 2 parallel.tp=2 activation_checkpoint.mode=full activation_checkpoint.distribute_saved_activations=true model.dropout=0.1
  run "$arch.dp2" $p 2 model.dropout=0.1 parallel.dp_bucket_mb=0.01
  run "$arch.fsdp2" $p 2 fsdp.strategy=full_shard train.micro_batch_size=2 activation_checkpoint.mode=full
  run "$arch.fsdp2_fp8" $p 2 fsdp.strategy=full_shard fp8.enabled=true backend.cpu_round_bf16=true
  run "$arch.tp2_fsdp2" $p 4 parallel.tp=2 fsdp.strategy=full_shard parallel.sequence_parallel=true
  run "$arch.fp8_delayed" $p 1 fp8.enabled=true backend.cpu_round_bf16=true model.dropout=0.1
  run "$arch.fp8_current" $p 1 fp8.enabled=true fp8.recipe=current backend.cpu_round_bf16=true
  run "$arch.fp8_keep" $p 1 fp8.enabled=true model.recompute_norm=false model.recompute_gelu=false backend.cpu_round_bf16=true
  run "$arch.fp8_full" $p 1 fp8.enabled=true activation_checkpoint.mode=full model.dropout=0.1 train.micro_batch_size=4
  run "$arch.fp8_tp2_sp" $p 2 fp8.enabled=true parallel.tp=2 parallel.sequence_parallel=true backend.cpu_round_bf16=true
  run "$arch.fp8_nofuse" $p 1 fp8.enabled=true fp8.fuse_weight_update=false fp8.weights_in_compute_copy=false
  run "$arch.fp8_block" $p 1 fp8.enabled=true fp8.recipe=block model.dropout=0.1
  run "$arch.fsdp2_fp8_block" $p 2 fsdp.strategy=full_shard fp8.enabled=true fp8.recipe=block
  run "$arch.ckpt_save" $p 1 train.steps=3 checkpoint.dir=ckpt-$arch checkpoint.every=3 model.dropout=0.1 fp8.enabled=true
  run "$arch.ckpt_resume" $p 1 checkpoint.dir=ckpt-$arch checkpoint.every=100 model.dropout=0.1 fp8.enabled=true
done

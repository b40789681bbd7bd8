#!/usr/bin/env bash
# pipelines/fsdp-fp8.toml, the headline pipeline (FSDP full_shard, FP8 delayed scaling, full
# activation checkpointing with dropout drawn from the RNG tracker, a mixture of experts split over
# the two ranks (parallel.ep = 2) with expert dropout, async training-state checkpoints), shrunk to
# the CPU on two thread ranks: a run stopped after step 20 and run again with the same command
# continues to step 30 with the losses of a run that was never stopped.
# usage: headline_pipeline_test.sh KILN PIPELINE
set -u
KILN=$1
PIPELINE=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
base=(--set engine.device=cpu --set backend.cpu_threads=1 --set model.n_layer=2 --set model.n_head=2
  --set model.n_embd=32 --set model.max_seq_len=32 --set train.seq_len=32 --set train.batch_size=4
  --set train.steps=30 --set data.synthetic_vocab=256 --set 'data.train_files=""' --set 'data.val_files=""'
  --set log.val_every=0 --set log.every=1 --set checkpoint.every=10 --set parallel.ep=2)
small=(--nproc 2 "${base[@]}")
losses() { grep -o '"step":[0-9]*,"loss":[^,]*' "$1" | awk -F'[:,]' '$2 > 20'; }
fail() { echo "FAIL: $*"; exit 1; }

"$KILN" run "$PIPELINE" "${small[@]}" --set checkpoint.dir=straight --set log.metrics=straight.jsonl > straight.txt 2>&1 ||
  { cat straight.txt; fail "the straight run failed"; }
grep -q "fsdp rank 1 holds 1/2" straight.txt || { cat straight.txt; fail "FSDP did not shard over two ranks"; }
grep -q "activation checkpoint: full recompute in 2 of 2 blocks" straight.txt || fail "no activation checkpointing"
grep -q "fp8: 6 of 8 linear layers and 2 of 2 grouped (expert) linears in FP8 (delayed scaling" straight.txt ||
  { cat straight.txt; fail "FP8 is not on, or the mixture of experts is missing"; }
grep -q "parameters (.* active per token)" straight.txt || { cat straight.txt; fail "no mixture of experts"; }
[ -f straight/step_000030/manifest.json ] || fail "no checkpoint at step 30"
for blob in rng fp8; do  # the RNG tracker's states and the FP8 scaling state are in the checkpoint
  grep -q "\"name\": *\"$blob\"" straight/step_000030/manifest.json || fail "the checkpoint lacks the $blob state"
done
grep -q '"name": *"model/blocks.0.mlp.experts.fc.weight"' straight/step_000030/manifest.json ||
  fail "the checkpoint lacks the experts' weights"

"$KILN" run "$PIPELINE" "${small[@]}" --set checkpoint.dir=ck --set log.metrics=resumed.jsonl \
  --set train.exit_interval=20 > first.txt 2>&1 || { cat first.txt; fail "the first half failed"; }
grep -q "train.exit_interval: stopping after step 20" first.txt || { cat first.txt; fail "did not stop at step 20"; }
"$KILN" run "$PIPELINE" "${small[@]}" --set checkpoint.dir=ck --set log.metrics=resumed.jsonl > second.txt 2>&1 ||
  { cat second.txt; fail "the resumed run failed"; }
grep -q "checkpoint: resumed from ck/step_000020 at step 20" second.txt || { cat second.txt; fail "did not resume"; }
[ "$(losses straight.jsonl | wc -l)" = 10 ] || fail "the straight run logged $(losses straight.jsonl | wc -l) of steps 21-30"
diff <(losses straight.jsonl) <(losses resumed.jsonl) || fail "steps 21-30 differ after the resume"
echo "headline pipeline: steps 21-30 after the resume equal the straight run's bit for bit"

# With pipeline stages too: four ranks, two stages of one block, each stage's parameters sharded
# over its two data-parallel ranks (which split the experts), four micro-batches in a 1F1B schedule.
pp=(--nproc 4 "${base[@]}" --set parallel.pp=2 --set train.micro_batch_size=1)
"$KILN" run "$PIPELINE" "${pp[@]}" --set checkpoint.dir=pp-straight --set log.metrics=pp-straight.jsonl \
  > pp-straight.txt 2>&1 || { cat pp-straight.txt; fail "the pipeline-stage run failed"; }
"$KILN" run "$PIPELINE" "${pp[@]}" --set checkpoint.dir=pp-ck --set log.metrics=pp-resumed.jsonl \
  --set train.exit_interval=20 > pp-first.txt 2>&1 || { cat pp-first.txt; fail "the pipeline-stage first half failed"; }
"$KILN" run "$PIPELINE" "${pp[@]}" --set checkpoint.dir=pp-ck --set log.metrics=pp-resumed.jsonl \
  > pp-second.txt 2>&1 || { cat pp-second.txt; fail "the pipeline-stage resumed run failed"; }
diff <(losses pp-straight.jsonl) <(losses pp-resumed.jsonl) || fail "pipeline stages: steps 21-30 differ after the resume"
echo "headline pipeline with pipeline stages (pp 2 x 2 FSDP ranks): resumed bit for bit"

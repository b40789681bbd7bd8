#!/usr/bin/env bash
# Checkpoints, export and generation on one GPU, in one call, building nothing:
#   1. the GPU tests of decode attention, the Generator and resumed training;
#   2. a byte-level model trained on the Brown corpus, exported, read by a plain PyTorch GPT-2
#      (bench/check_export.py) whose loss on the first batch must match kiln's, and sampled with
#      kiln generate;
#   3. the 1.3B model's training state (fp32 weights and AdamW moments, ~15.6 GB): the time the step
#      waits for a synchronous and an asynchronous save, the write bandwidth against dd's on the
#      same disk, and the time to load it.
# usage: bash bench/gpu_checkpoint.sh BUILD_DIR      (logs under $OUT; needs data/brown)
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
W=${WORK:-/tmp/kiln-ckpt-bench}
rm -rf "$W"
mkdir -p "$W"
log="$OUT/checkpoint-logs.txt"
: > "$log"
summary=()
note() { summary+=("$1"); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$log" 2>&1
note "device: $(head -1 "$log"); disk of $W: $(df -h "$W" | tail -1 | awk '{print $1, $2, "free", $4}')"

for t in test_cuda_ops test_gpu_generator test_gpu_training_checkpoint test_gpu_recompute; do
  timeout 240 "$B/bin/$t" >> "$log" 2>&1
  note "$t: rc=$? $(grep -E '^\[doctest\] test cases' "$log" | tail -1)"
done

# 2. Export, a plain PyTorch GPT-2, generation.
tiny=(pipelines/tiny-cpu.toml --set engine.device=cuda --set log.val_every=0)
timeout 120 "$K" run "${tiny[@]}" --set train.steps=300 --set checkpoint.dir="$W/tiny" >> "$log" 2>&1
note "tiny byte model, 300 steps on the GPU: rc=$? $(grep -E '^step 300/' "$log" | tail -1 | cut -d'|' -f1-2)"
timeout 60 "$K" export "$W/tiny" -o "$W/export/model.safetensors" >> "$log" 2>&1
note "kiln export rc=$?"
timeout 60 "$K" run "${tiny[@]}" --set train.steps=1 --set model.init_from="$W/export/model.safetensors" \
  --set data.shuffle=false --set model.dropout=0 --set checkpoint.dir="$W/none" --set checkpoint.at_end=false \
  --set log.metrics="$W/first.jsonl" >> "$log" 2>&1
kiln_loss=$(grep -o '"loss":[^,]*' "$W/first.jsonl" | head -1 | cut -d: -f2)
if python3 -c "import torch" 2>/dev/null; then
  python3 bench/check_export.py "$W/export" data/brown/train_000000.bin --batch 16 --seq 64 \
    --kiln-loss "$kiln_loss" > "$W/check.txt" 2>&1
  rc=$?
  cat "$W/check.txt" >> "$log"
  note "export in plain PyTorch: rc=$rc $(head -1 "$W/check.txt")"
else
  note "export in plain PyTorch: torch not importable"
fi
start=$(date +%s.%N)
timeout 60 "$K" generate "$W/tiny" --prompt "The jury said " --tokens 200 --seed 7 > "$W/gen.txt" 2>&1
note "kiln generate rc=$? in $(awk "BEGIN{print $(date +%s.%N) - $start}") s: $(head -c 160 "$W/gen.txt" | tr '\n' ' ')"
cat "$W/gen.txt" >> "$log"
rm -rf "$W/tiny" "$W/export"

# The headline pipeline (FSDP full_shard, FP8, recompute with dropout, async checkpoints) on one
# GPU: 60 steps straight, and stopped at 30 then run again; steps 31-60 must match bit for bit.
hl=(pipelines/fsdp-fp8.toml --set train.steps=60 --set checkpoint.every=30 --set log.val_every=0 --set log.every=10)
timeout 200 "$K" run "${hl[@]}" --set checkpoint.dir="$W/hl-straight" --set log.metrics="$OUT/hl-straight.jsonl" \
  > "$W/hl.txt" 2>&1
rc1=$?
timeout 200 "$K" run "${hl[@]}" --set checkpoint.dir="$W/hl" --set log.metrics="$OUT/hl-resumed.jsonl" \
  --set train.exit_interval=30 >> "$W/hl.txt" 2>&1
timeout 200 "$K" run "${hl[@]}" --set checkpoint.dir="$W/hl" --set log.metrics="$OUT/hl-resumed.jsonl" >> "$W/hl.txt" 2>&1
rc2=$?
cat "$W/hl.txt" >> "$log"
hl_losses() { grep -o '"step":[0-9]*,"loss":[^,]*' "$1" | awk -F'[:,]' '$2 > 30'; }
if diff -q <(hl_losses "$OUT/hl-straight.jsonl") <(hl_losses "$OUT/hl-resumed.jsonl") >/dev/null &&
  [ "$(hl_losses "$OUT/hl-straight.jsonl" | wc -l)" = 30 ]; then same="steps 31-60 bit-identical after the resume"
else same="steps 31-60 DIFFER after the resume"; fi
note "pipelines/fsdp-fp8.toml on one GPU: rc=$rc1/$rc2, $same; $(grep -E '^step 60/' "$W/hl.txt" | head -1 | cut -d'|' -f2,5,7)"
rm -rf "$W/hl" "$W/hl-straight"

# 3. The 1.3B model's training state.
dd_line=$(dd if=/dev/zero of="$W/dd.bin" bs=64M count=160 conv=fsync 2>&1 | tail -1)
rm -f "$W/dd.bin"
note "dd 10 GiB with fsync: $dd_line"
big=(pipelines/gpt-1.3b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
  --set log.every=1)
save() {  # name steps every extra...
  local name=$1 steps=$2 every=$3
  shift 3
  timeout 400 "$K" run "${big[@]}" --set train.steps="$steps" --set checkpoint.dir="$W/$name" \
    --set checkpoint.every="$every" --set checkpoint.keep=1 --set log.metrics="$OUT/ckpt-$name.jsonl" "$@" \
    > "$W/$name.txt" 2>&1
  local rc=$?
  cat "$W/$name.txt" >> "$log"
  note "1.3B $name rc=$rc:"
  while read -r line; do note "    $line"; done < <(grep -E "^checkpoint: (saved|resumed|host staging)|peak device" "$W/$name.txt")
  note "    step ms: $(grep -o '"step_ms":[0-9.]*' "$OUT/ckpt-$name.jsonl" | cut -d: -f2 | cut -d. -f1 | tr '\n' ' ')"
}
save async 9 3 --set checkpoint.async=true
rm -rf "$W/async"
save sync 6 3
save resume 8 100 --set checkpoint.dir="$W/sync" --set checkpoint.at_end=false
du -sh "$W/sync"/step_* >> "$log" 2>&1
rm -rf "$W/sync"
rm -rf "$W"

echo "==== summary ===="
printf '%s\n' "${summary[@]}"

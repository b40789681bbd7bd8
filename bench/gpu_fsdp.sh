#!/usr/bin/env bash
# FSDP throughput and memory on whatever GPUs are visible, in one call, building nothing: GPT-2 124M
# (batch 16 per GPU) and the 1.3B model (batch 8 per GPU), one GPU against every strategy on all of
# them (no_shard, full_shard, shard_grad_op; hybrid_shard with shard_size 2 on 4 or more), bf16
# and FP8. Prints tokens/s per GPU, its share of the one-GPU figure, ms/step and peak memory per
# GPU last. With TORCH=1 it runs bench/torch_fsdp2.py (PyTorch FSDP2) beside it on the same GPUs.
# usage: bash bench/gpu_fsdp.sh BUILD_DIR [steps]      (logs and metrics under $OUT)
#   STRATEGIES="full_shard shard_grad_op"  the strategies run on all GPUs (default: no_shard too)
#   ONE_FSDP=0                            skip the one-GPU full_shard runs
#   MODELS="1.3b"                         the models (default: 124m 1.3b)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-20}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
N=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$N" -ge 1 ] || { echo "no GPU visible"; exit 1; }
log="$OUT/fsdp-logs.txt"
: > "$log"
nvidia-smi -L >> "$log"

run() {  # name model gpus per_gpu_batch steps [args...]
  local name=$1 model=$2 gpus=$3 per=$4 steps=$5
  shift 5
  local pipe=pipelines/gpt2-124m.toml
  [ "$model" = 1.3b ] && pipe=pipelines/gpt-1.3b.toml
  local one="$OUT/run.txt"
  timeout 300 "$K" run "$pipe" --nproc "$gpus" --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=5 --set parallel.timeout_s=120 --set train.steps="$steps" \
    --set train.batch_size=$((per * gpus)) --set log.metrics="$OUT/$name.jsonl" "$@" > "$one" 2>&1
  local rc=$?
  { echo "===== $name ($gpus GPUs) rc=$rc"; cat "$one"; } >> "$log"
  echo "$name rc=$rc"
  # The largest of the ranks' peaks ("peak device memory X GiB (rank r)" on each rank's last line).
  echo "$name $gpus $(grep -o 'peak device memory [0-9.]* GiB' "$one" | awk '{print $4}' | sort -g | tail -1)" \
    >> "$OUT/memory.txt"
}

: > "$OUT/memory.txt"
for model in ${MODELS:-124m 1.3b}; do
  per=16
  [ "$model" = 1.3b ] && per=8
  for prec in bf16 fp8; do
    F=()
    [ "$prec" = fp8 ] && F=(--set fp8.enabled=true)
    run "$model-$prec-1gpu" "$model" 1 "$per" "$STEPS" "${F[@]}"
    [ "${ONE_FSDP:-1}" = 1 ] &&
      run "$model-$prec-1gpu-full_shard" "$model" 1 "$per" "$STEPS" "${F[@]}" --set fsdp.strategy=full_shard
    if [ "$N" -ge 2 ]; then
      for strategy in ${STRATEGIES:-no_shard full_shard shard_grad_op}; do
        run "$model-$prec-$strategy" "$model" "$N" "$per" "$STEPS" "${F[@]}" --set fsdp.strategy=$strategy
      done
      if [ "$N" -ge 4 ]; then
        run "$model-$prec-hybrid_shard" "$model" "$N" "$per" "$STEPS" "${F[@]}" --set fsdp.strategy=hybrid_shard \
          --set fsdp.shard_size=2
      fi
    fi
  done
done

if [ "${TORCH:-0}" = 1 ]; then
  for model in ${MODELS:-124m 1.3b}; do
    per=16
    [ "$model" = 1.3b ] && per=8
    echo "===== torch fsdp2 $model" >> "$log"
    timeout 400 torchrun --standalone --nproc_per_node "$N" bench/torch_fsdp2.py --model "$model" --batch "$per" \
      --steps "$STEPS" --out "$OUT/torch-$model.json" >> "$log" 2>&1
    echo "torch-$model rc=$?"
  done
fi

rm -f "$OUT/run.txt"
echo "================ FSDP summary ($N GPUs) ================"
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
mem = {}
for line in (out / "memory.txt").read_text().splitlines():
    parts = line.split()
    mem[parts[0]] = parts[2] if len(parts) == 3 else "-"
gpus_of, rows = {}, {}
for line in (out / "memory.txt").read_text().splitlines():
    parts = line.split()
    gpus_of[parts[0]] = int(parts[1])
for p in sorted(out.glob("*.jsonl")):
    r = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    steady = r[len(r) // 4:] or r
    rows[p.stem] = (statistics.median(x["tokens_per_s"] for x in steady), statistics.median(x["step_ms"] for x in steady))
print(f"{'run':<34} {'GPUs':>4} {'tok/s per GPU':>14} {'of 1 GPU':>9} {'ms/step':>9} {'peak GiB/GPU':>12}")
for name, (tps, ms) in rows.items():
    gpus = gpus_of.get(name, 1)
    model, prec = name.split("-")[:2]
    one = rows.get(f"{model}-{prec}-1gpu")
    per = tps / gpus
    share = f"{100 * per / one[0]:.0f}%" if one else "-"
    print(f"{name:<34} {gpus:>4} {per:>14,.0f} {share:>9} {ms:>9.2f} {mem.get(name, '-'):>12}")
for p in sorted(out.glob("torch-*.json")):
    t = json.loads(p.read_text())
    print(f"{p.stem:<34} {t['gpus']:>4} {t['tokens_per_s_per_gpu']:>14,.0f} {'':>9} {t['ms_per_step']:>9.2f} "
          f"{t['peak_gib']:>12.2f}")
PY

#!/usr/bin/env bash
# Two-GPU checks in one call (kind nvidia-h200-x2), building nothing: tensor- and data-parallel
# gpt2-124m runs against the one-GPU run, throughput, and a rank killed mid-run.
# usage: bash bench/gpu_pair.sh BUILD_DIR     (logs and metrics under $OUT)
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
common=(pipelines/gpt2-124m.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
        --set log.every=5 --set parallel.timeout_s=60)
log="$OUT/pair-logs.txt"
: > "$log"
run() {  # name steps [args...]
  local name=$1 steps=$2
  shift 2
  echo "===== $name" >> "$log"
  timeout 240 "$K" run "${common[@]}" --set train.steps="$steps" --set log.metrics="$OUT/$name.jsonl" "$@" >> "$log" 2>&1
  echo "$name rc=$?"
}
nvidia-smi -L >> "$log"
echo "===== collectives" >> "$log"
timeout 200 "$B/bin/bench_collectives" --nproc 2 > "$OUT/collectives.txt" 2>&1
echo "collectives rc=$?"
cat "$OUT/collectives.txt" >> "$log"

run one 30
run tp2 30 --nproc 2 --set parallel.tp=2
run tp2-sp 30 --nproc 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
run dp2 30 --nproc 2 --set train.batch_size=32
run tp2-mb 30 --nproc 2 --set parallel.tp=2 --set train.micro_batch_size=8
big=(--set model.n_layer=24 --set model.n_head=16 --set model.n_embd=2048 --set train.batch_size=8
     --set model.recompute_gelu=true)
run 1.3b-one 16 "${big[@]}"
run 1.3b-tp2 16 "${big[@]}" --nproc 2 --set parallel.tp=2
run 1.3b-tp2-sp 16 "${big[@]}" --nproc 2 --set parallel.tp=2 --set parallel.sequence_parallel=true

# Kill rank 1 with SIGKILL once training is under way; rank 0 must stop soon, naming it.
kill_log="$OUT/kill-log.txt"
"$K" run "${common[@]}" --set train.steps=100000 --nproc 2 --set parallel.tp=2 > "$kill_log" 2>&1 &
launcher=$!
for i in $(seq 1 240); do
  sleep 0.5
  grep -qE "step +5/" "$kill_log" && break
done
victim=""
for pid in $(pgrep -P "$launcher"); do
  if tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx "RANK=1"; then victim=$pid; fi
done
killed_at=$(date +%s.%N)
[ -n "$victim" ] && kill -9 "$victim"
wait "$launcher"
rc=$?
end=$(date +%s.%N)
echo "kill: launcher rc=$rc, stopped $(python3 -c "print(round($end-$killed_at,2))") s after rank 1 (pid ${victim:-none}) was killed"

python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
logs = (out / "pair-logs.txt").read_text().split("===== ")
mem = {}
for chunk in logs:
    name = chunk.split("\n", 1)[0].strip()
    for line in chunk.splitlines():
        if "peak device memory" in line:
            mem[name] = line.split("memory ")[1].split(" GiB")[0]
print(f"{'run':<12} {'tok/s':>10} {'per GPU':>9} {'ms/step':>9} {'GiB/GPU':>8} {'max |dloss|/loss vs 1 GPU':>26}")
for n, ref, gpus in [("one", "one", 1), ("tp2", "one", 2), ("tp2-sp", "one", 2), ("dp2", None, 2), ("tp2-mb", "one", 2),
                     ("1.3b-one", "1.3b-one", 1), ("1.3b-tp2", "1.3b-one", 2), ("1.3b-tp2-sp", "1.3b-one", 2)]:
    r = load(n)
    if not r:
        print(f"{n:<12} (no metrics)"); continue
    st = r[len(r) // 3:]
    base = load(ref) if ref else []
    d = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(r, base)) if base else float("nan")
    tps = statistics.median(x['tokens_per_s'] for x in st)
    print(f"{n:<12} {tps:>10,.0f} {tps/gpus:>9,.0f} {statistics.median(x['step_ms'] for x in st):>9.2f} {mem.get(n, '?'):>8} {d:>26.2e}")
PY
cat "$OUT/collectives.txt"
echo "--- the killed run's messages:"
grep -vE "^step|^model" "$kill_log" | tail -8
echo "===== kill" >> "$log"
cat "$kill_log" >> "$log"
rm -f "$kill_log"

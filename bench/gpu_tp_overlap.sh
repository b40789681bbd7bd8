#!/usr/bin/env bash
# Tensor parallelism with and without its communication overlapped with the GEMMs
# (parallel.tp_comm_overlap), on two GPUs (kind nvidia-h200-x2), building nothing: the one-GPU run,
# then TP=2 with and without sequence parallelism, each plain and overlapped, in one call; then a
# CUPTI trace of rank 0 of an overlapped run: how much of the NCCL kernels' time runs beside other
# kernels. Variants: pieces per rank (tp_comm_chunks, default 1), SMs the GEMMs leave to the
# collectives (tp_comm_sms, default 0). FP8=1: every run in FP8 (delayed scaling; its linears take
# part in the overlapped sums, not in the gathers of sequence parallelism); COPY=1: the copy-engine
# transport (parallel.copy_engine) for every run.
# usage: bash bench/gpu_tp_overlap.sh BUILD_DIR [MODEL]   (MODEL: 1.3b (default) or 124m; logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
MODEL=${2:-1.3b}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
common=(pipelines/gpt2-124m.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
        --set log.every=5 --set parallel.timeout_s=60)
steps=30
if [ "$MODEL" = 1.3b ]; then
  common+=(--set model.n_layer=24 --set model.n_head=16 --set model.n_embd=2048 --set train.batch_size=8
           --set model.recompute_gelu=true)
  steps=16
fi
[ "${FP8:-0}" = 1 ] && common+=(--set fp8.enabled=true)
[ "${COPY:-0}" = 1 ] && common+=(--set parallel.copy_engine=true)
log="$OUT/tp-overlap-logs.txt"
: > "$log"
run() {  # name [args...]
  local name=$1
  shift
  echo "===== $name" >> "$log"
  timeout 300 "$K" run "${common[@]}" --set train.steps="$steps" --set log.metrics="$OUT/$name.jsonl" "$@" >> "$log" 2>&1
  echo "$name rc=$?"
}
nvidia-smi -L | tee -a "$log"
tp=(--nproc 2 --set parallel.tp=2)
sp=(--set parallel.sequence_parallel=true)
lap=(--set parallel.tp_comm_overlap=true)
run one
run tp2 "${tp[@]}"
run tp2-lap "${tp[@]}" "${lap[@]}"
run tp2-lap2 "${tp[@]}" "${lap[@]}" --set parallel.tp_comm_chunks=2
run tp2-lap-sm16 "${tp[@]}" "${lap[@]}" --set parallel.tp_comm_sms=16
run tp2-sp "${tp[@]}" "${sp[@]}"
run tp2-sp-lap "${tp[@]}" "${sp[@]}" "${lap[@]}"
run tp2-sp-lap2 "${tp[@]}" "${sp[@]}" "${lap[@]}" --set parallel.tp_comm_chunks=2
run tp2-sp-lap-sm16 "${tp[@]}" "${sp[@]}" "${lap[@]}" --set parallel.tp_comm_sms=16

if [ -f "$B/lib/libkiln_trace.so" ]; then
  for v in plain lap; do
    extra=()
    [ "$v" = lap ] && extra=("${lap[@]}")
    echo "===== trace-$v" >> "$log"
    CUDA_INJECTION64_PATH="$PWD/$B/lib/libkiln_trace.so" KILN_TRACE="$OUT/trace-$v-{rank}.csv" \
      timeout 300 "$K" run "${common[@]}" --set train.steps=8 "${tp[@]}" "${extra[@]}" >> "$log" 2>&1
    echo "trace-$v rc=$?"
  done
fi

python3 - "$OUT" <<'PY'
import csv, json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
mem = {}
for chunk in (out / "tp-overlap-logs.txt").read_text().split("===== "):
    name = chunk.split("\n", 1)[0].strip()
    for line in chunk.splitlines():
        if "peak device memory" in line:
            mem[name] = line.split("memory ")[1].split(" GiB")[0]
one = load("one")
one_tps = statistics.median(x["tokens_per_s"] for x in one[len(one) // 3:]) if one else float("nan")
print(f"{'run':<18} {'tok/s':>10} {'per GPU':>9} {'of 1 GPU':>9} {'ms/step':>9} {'GiB/GPU':>8} {'max |dloss|/loss vs 1 GPU':>26}")
runs = [c.split("\n", 1)[0].strip() for c in (out / "tp-overlap-logs.txt").read_text().split("===== ")[1:]]
for n in [r for r in runs if not r.startswith("trace")]:
    gpus = 1 if n == "one" else 2
    r = load(n)
    if not r:
        print(f"{n:<18} (no metrics)"); continue
    st = r[len(r) // 3:]
    d = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(r, one)) if one else float("nan")
    tps = statistics.median(x["tokens_per_s"] for x in st)
    print(f"{n:<18} {tps:>10,.0f} {tps/gpus:>9,.0f} {tps/gpus/one_tps:>9.3f} {statistics.median(x['step_ms'] for x in st):>9.2f} {mem.get(n, '?'):>8} {d:>26.2e}")

# From rank 0's trace, over the last half of the run: NCCL kernels' time, and how much of it other
# kernels ran beside (on other streams).
for v in ("plain", "lap"):
    p = out / f"trace-{v}-0.csv"
    if not p.exists():
        continue
    ks = [(int(r["start"]), int(r["end"]), r["name"]) for r in csv.DictReader(p.open()) if r["kind"] == "kernel"]
    if not ks:
        continue
    t0 = min(k[0] for k in ks); t1 = max(k[1] for k in ks); mid = t0 + (t1 - t0) // 2
    ks = [k for k in ks if k[0] >= mid]
    nccl = sorted((s, e) for s, e, n in ks if "nccl" in n.lower())
    other = sorted((s, e) for s, e, n in ks if "nccl" not in n.lower())
    busy = []  # union of other kernels' intervals
    for s, e in other:
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e)
        else:
            busy.append([s, e])
    total = sum(e - s for s, e in nccl)
    covered, j = 0, 0
    for s, e in nccl:
        while j < len(busy) and busy[j][1] <= s:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < e:
            covered += max(0, min(e, busy[k][1]) - max(s, busy[k][0]))
            k += 1
    span = max(e for _, e, _ in ks) - min(s for s, _, _ in ks)
    print(f"trace {v:<6}: NCCL kernels {total/1e6:8.1f} ms over a window of {span/1e6:8.1f} ms; "
          f"{covered/1e6:8.1f} ms ({covered/max(total,1):.0%}) beside other kernels")
PY

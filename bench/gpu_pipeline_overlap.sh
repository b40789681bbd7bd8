#!/usr/bin/env bash
# Pipeline transfers overlapped with compute, three ways in one call on two GPUs (kind
# nvidia-h200-x2), building nothing: "old", every call in order on the compute stream (the three
# libraries that differ, from the commit before, under BUILD_DIR/oldlib); "side", every call on the
# pipeline's own stream, a pass waiting only for what it receives (BUILD_DIR/sidelib); "new" (this
# build), only the calls no pass waits for right away posted on that stream. gpt2-124m at pp = 2
# (1F1B and interleaved) against one GPU's losses; gpt-1.3b and Llama 1B (untied head) at pp = 2 with
# 8 micro-batches, the three taken in turn, each against one GPU; the timeline of gpt-1.3b at pp = 2.
# usage: bash bench/gpu_pipeline_overlap.sh BUILD_DIR     (logs and metrics under $OUT; a table last)
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
NEW_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
OLD_PATH="$PWD/$B/oldlib:$NEW_PATH"
SIDE_PATH="$PWD/$B/sidelib:$NEW_PATH"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
log="$OUT/overlap-logs.txt"
: > "$log"
nvidia-smi -L >> "$log"
common=(--set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0 --set log.every=2
        --set parallel.timeout_s=120)
run() {  # libs name steps pipeline [args...]
  local libs=$1 name=$2 steps=$3 file=$4
  shift 4
  echo "===== $name" >> "$log"
  LD_LIBRARY_PATH=$libs timeout 300 "$K" run "$file" "${common[@]}" --set train.steps="$steps" \
    --set log.metrics="$OUT/$name.jsonl" "$@" >> "$log" 2>&1
  echo "$name rc=$?"
}
run "$NEW_PATH" 124m-one 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4
run "$NEW_PATH" 124m-pp2 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2
run "$NEW_PATH" 124m-vpp2 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2 \
  --set parallel.vpp=2
g13=(--set train.batch_size=8 --set train.micro_batch_size=1)
run "$NEW_PATH" 1.3b-one 16 pipelines/gpt-1.3b.toml "${g13[@]}"
for round in 1 2; do
  for k in old side new; do
    P=$NEW_PATH; [ $k = old ] && P=$OLD_PATH; [ $k = side ] && P=$SIDE_PATH
    run "$P" 1.3b-pp2-$k$round 16 pipelines/gpt-1.3b.toml "${g13[@]}" --nproc 2 --set parallel.pp=2
  done
done
ll=(--set model.tie_embeddings=false --set train.batch_size=8 --set train.micro_batch_size=1)
run "$NEW_PATH" llama-one 16 pipelines/llama-1b.toml "${ll[@]}"
for v in 1 2; do
  for k in old side new; do
    P=$NEW_PATH; [ $k = old ] && P=$OLD_PATH; [ $k = side ] && P=$SIDE_PATH
    run "$P" llama-vpp$v-$k 16 pipelines/llama-1b.toml "${ll[@]}" --nproc 2 --set parallel.pp=2 --set parallel.vpp=$v
  done
done
run "$NEW_PATH" 1.3b-pp2-tl 6 pipelines/gpt-1.3b.toml "${g13[@]}" --nproc 2 --set parallel.pp=2 \
  --set log.timeline="$OUT/tl-1.3b" --set log.timeline_step=5
LD_LIBRARY_PATH=$NEW_PATH "$K" plot --timeline "$OUT/tl-1.3b.rank0" "$OUT/tl-1.3b.rank1" -o "$OUT/timeline-1.3b.svg" \
  --title "gpt-1.3b, pp 2, step 5" | tee -a "$log"

python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
mem = {}
for chunk in (out / "overlap-logs.txt").read_text().split("===== "):
    name = chunk.split("\n", 1)[0].strip()
    for line in chunk.splitlines():
        if "peak device memory" in line:
            mem[name] = line.split("memory ")[1].split(" GiB")[0]
print(f"{'run':<16} {'tok/s':>9} {'per GPU':>9} {'ms/step':>8} {'GiB':>6} {'vs (1-b) x 1 GPU':>17} {'max dloss/loss':>15}")
rows = [("124m-one", None, 1, 1, 4), ("124m-pp2", "124m-one", 2, 1, 4), ("124m-vpp2", "124m-one", 2, 2, 4),
        ("1.3b-one", None, 1, 1, 8)]
rows += [(f"1.3b-pp2-{k}{r}", "1.3b-one", 2, 1, 8) for r in (1, 2) for k in ("old", "side", "new")]
rows += [("llama-one", None, 1, 1, 8)]
rows += [(f"llama-vpp{v}-{k}", "llama-one", 2, v, 8) for v in (1, 2) for k in ("old", "side", "new")]
for n, ref, gpus, vpp, m in rows:
    r = load(n)
    if not r:
        print(f"{n:<16} (no metrics)"); continue
    st = r[len(r) // 3:]
    tps = statistics.median(x["tokens_per_s"] for x in st)
    base = load(ref) if ref else []
    ratio = ""
    if base:
        b = statistics.median(x["tokens_per_s"] for x in base[len(base) // 3:])
        bubble = (gpus - 1) / (vpp * m + gpus - 1)
        ratio = f"{tps / gpus / ((1 - bubble) * b):.3f}"
    d = max((abs(a["loss"] - c["loss"]) / c["loss"] for a, c in zip(r, base)), default=float("nan")) if base else float("nan")
    print(f"{n:<16} {tps:>9,.0f} {tps/gpus:>9,.0f} {statistics.median(x['step_ms'] for x in st):>8.1f} {mem.get(n, '?'):>6} {ratio:>17} {d:>15.2e}")
PY
grep -h "bubble" "$log" | tail -3

#!/usr/bin/env bash
# Pipeline stages on two GPUs in one call (kind nvidia-h200-x2), building nothing: gpt2-124m at pp = 2
# (1F1B and interleaved) against one GPU's losses, then 1.3B GPT and Llama 1B (untied head) at
# pp = 2 with 8 micro-batches against one GPU with the same micro-batches, and PyTorch's
# torch.distributed.pipelining on the same Llama (Schedule1F1B, ScheduleInterleaved1F1B).
# usage: bash bench/gpu_pipeline.sh BUILD_DIR     (logs and metrics under $OUT; a table last)
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
log="$OUT/pipeline-logs.txt"
: > "$log"
nvidia-smi -L >> "$log"
common=(--set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0 --set log.every=2
        --set parallel.timeout_s=120)
run() {  # name steps pipeline [args...]
  local name=$1 steps=$2 file=$3
  shift 3
  echo "===== $name" >> "$log"
  timeout 300 "$K" run "$file" "${common[@]}" --set train.steps="$steps" --set log.metrics="$OUT/$name.jsonl" "$@" \
    >> "$log" 2>&1
  echo "$name rc=$?"
}
run 124m-one 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4
run 124m-pp2 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2
run 124m-pp2-vpp2 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2 \
  --set parallel.vpp=2
g13=(--set train.batch_size=8 --set train.micro_batch_size=1)
run 1.3b-one 16 pipelines/gpt-1.3b.toml "${g13[@]}"
run 1.3b-pp2 16 pipelines/gpt-1.3b.toml "${g13[@]}" --nproc 2 --set parallel.pp=2
run 1.3b-pp2-vpp2 16 pipelines/gpt-1.3b.toml "${g13[@]}" --nproc 2 --set parallel.pp=2 --set parallel.vpp=2
ll=(--set model.tie_embeddings=false --set train.batch_size=8 --set train.micro_batch_size=1)
run llama-one 16 pipelines/llama-1b.toml "${ll[@]}"
run llama-pp2 16 pipelines/llama-1b.toml "${ll[@]}" --nproc 2 --set parallel.pp=2
run llama-pp2-vpp2 16 pipelines/llama-1b.toml "${ll[@]}" --nproc 2 --set parallel.pp=2 --set parallel.vpp=2
for v in 1 2; do
  echo "===== torch-vpp$v" >> "$log"
  timeout 360 torchrun --nproc_per_node 2 bench/torch_pipeline.py --vpp "$v" --batch 8 --microbatches 8 --steps 16 \
    --out "$OUT/torch-vpp$v.json" >> "$log" 2>&1
  echo "torch-vpp$v rc=$?"
done

python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
mem = {}
for chunk in (out / "pipeline-logs.txt").read_text().split("===== "):
    name = chunk.split("\n", 1)[0].strip()
    for line in chunk.splitlines():
        if "peak device memory" in line:
            mem[name] = line.split("memory ")[1].split(" GiB")[0]
print(f"{'run':<15} {'tok/s':>9} {'per GPU':>9} {'ms/step':>8} {'GiB':>6} {'vs (1-b) x 1 GPU':>17} {'max dloss/loss':>15}")
for n, ref, gpus, vpp, m in [("124m-one", None, 1, 1, 4), ("124m-pp2", "124m-one", 2, 1, 4),
                             ("124m-pp2-vpp2", "124m-one", 2, 2, 4), ("1.3b-one", None, 1, 1, 8),
                             ("1.3b-pp2", "1.3b-one", 2, 1, 8), ("1.3b-pp2-vpp2", "1.3b-one", 2, 2, 8),
                             ("llama-one", None, 1, 1, 8), ("llama-pp2", "llama-one", 2, 1, 8),
                             ("llama-pp2-vpp2", "llama-one", 2, 2, 8)]:
    r = load(n)
    if not r:
        print(f"{n:<15} (no metrics)"); continue
    st = r[len(r) // 3:]
    tps = statistics.median(x["tokens_per_s"] for x in st)
    base = load(ref) if ref else []
    ratio = ""
    if base:
        b = statistics.median(x["tokens_per_s"] for x in base[len(base) // 3:])
        bubble = (gpus - 1) / (vpp * m + gpus - 1)
        ratio = f"{tps / gpus / ((1 - bubble) * b):.3f}"
    d = max((abs(a["loss"] - c["loss"]) / c["loss"] for a, c in zip(r, base)), default=float("nan")) if base else float("nan")
    print(f"{n:<15} {tps:>9,.0f} {tps/gpus:>9,.0f} {statistics.median(x['step_ms'] for x in st):>8.1f} {mem.get(n, '?'):>6} {ratio:>17} {d:>15.2e}")
for v in (1, 2):
    p = out / f"torch-vpp{v}.json"
    if p.exists():
        t = json.loads(p.read_text())
        print(f"torch-vpp{v:<6} {t['tokens_per_s']:>9,.0f} {t['tokens_per_s']/2:>9,.0f} {t['ms_per_step']:>8.1f} {t['peak_gib_per_gpu']:>6.2f}  (compiled {t['compiled']})")
    else:
        print(f"torch-vpp{v}: no result")
PY

#!/usr/bin/env bash
# Pipeline stages on two GPUs, second call (kind nvidia-h200-x2), building nothing: the per-stage
# timeline of gpt-1.3b and Llama 1B at pp = 2 (log.timeline, then kiln plot --timeline), FSDP inside
# the stages, a mixture of experts over stages, and the headline pipeline with stages, each against
# the one-GPU (or same-ranks) run's losses.
# usage: bash bench/gpu_pipeline_more.sh BUILD_DIR     (logs, timelines and SVGs under $OUT; a table last)
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
log="$OUT/pipeline-more-logs.txt"
: > "$log"
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
g13=(--set train.batch_size=8 --set train.micro_batch_size=1)
run 1.3b-pp2-tl 6 pipelines/gpt-1.3b.toml "${g13[@]}" --nproc 2 --set parallel.pp=2 --set log.timeline="$OUT/tl-1.3b" \
  --set log.timeline_step=5
"$K" plot --timeline "$OUT/tl-1.3b.rank0" "$OUT/tl-1.3b.rank1" -o "$OUT/timeline-1.3b.svg" \
  --title "gpt-1.3b, pp 2, 2 H100s, step 5" | tee -a "$log"
ll=(--set model.tie_embeddings=false --set train.batch_size=8 --set train.micro_batch_size=1)
run llama-vpp2-tl 6 pipelines/llama-1b.toml "${ll[@]}" --nproc 2 --set parallel.pp=2 --set parallel.vpp=2 \
  --set log.timeline="$OUT/tl-llama" --set log.timeline_step=5
"$K" plot --timeline "$OUT/tl-llama.rank0" "$OUT/tl-llama.rank1" -o "$OUT/timeline-llama.svg" \
  --title "llama-1b, pp 2 x vpp 2, 2 H100s, step 5" | tee -a "$log"
# FSDP over two data-parallel ranks of one stage each would need four GPUs: here FSDP over the one
# data-parallel rank of each stage (its machinery, gathers and reduce-scatters, on a stage), tied table.
run 124m-one 20 pipelines/gpt2-124m.toml --set train.micro_batch_size=4
run 124m-pp2-fsdp 20 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2 \
  --set fsdp.strategy=full_shard
run moe-one 20 pipelines/moe-1b.toml --set train.micro_batch_size=2 --set train.batch_size=8
run moe-pp2 20 pipelines/moe-1b.toml --set train.micro_batch_size=2 --set train.batch_size=8 --nproc 2 --set parallel.pp=2
run headline-pp2 20 pipelines/fsdp-fp8.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2 \
  --set checkpoint.dir="$OUT/ck" --set data.synthetic_vocab=256 --set model.moe.expert_dropout=0
run headline-one 20 pipelines/fsdp-fp8.toml --set train.micro_batch_size=4 --set checkpoint.dir="$OUT/ck1" \
  --set data.synthetic_vocab=256 --set model.moe.expert_dropout=0

python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
print(f"{'run':<15} {'tok/s':>9} {'ms/step':>8} {'max dloss/loss':>15} {'against':>12}")
for n, ref in [("124m-one", None), ("124m-pp2-fsdp", "124m-one"), ("moe-one", None), ("moe-pp2", "moe-one"),
               ("headline-one", None), ("headline-pp2", "headline-one"), ("1.3b-pp2-tl", None), ("llama-vpp2-tl", None)]:
    r = load(n)
    if not r:
        print(f"{n:<15} (no metrics)"); continue
    st = r[len(r) // 3:]
    base = load(ref) if ref else []
    d = max((abs(a["loss"] - c["loss"]) / c["loss"] for a, c in zip(r, base)), default=float("nan"))
    print(f"{n:<15} {statistics.median(x['tokens_per_s'] for x in st):>9,.0f} {statistics.median(x['step_ms'] for x in st):>8.1f} {d:>15.2e} {ref or '':>12}")
PY
grep -h "bubble" "$log"

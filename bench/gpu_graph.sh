#!/usr/bin/env bash
# backend.cuda_graph on one GPU, building nothing: the GPU tests of the captured step (test_gpu_model),
# the CUDA ops and recompute, then each model eager and with the captured forward and
# backward in one call, alternating; a table last: median ms/step and tokens/s over the last three
# quarters of the steps, and the peak memory.
# usage: bash bench/gpu_graph.sh BUILD_DIR [steps] [models...]   (logs under $OUT; TESTS=0 skips tests)
#   models: g124 (GPT-2 124M bf16), g124f (FP8), g13f (1.3B FP8), l1bf (Llama 1B FP8), l1b (Llama 1B bf16)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-40}
shift 2 2>/dev/null || shift $#
MODELS=${*:-g124 g124f g13f l1bf}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
if [ "${TESTS:-1}" = 1 ]; then
  for t in "test_gpu_model" "test_cuda_ops" "test_gpu_recompute"; do
    set -- $t
    timeout 300 "$B/bin/$1" "${@:2}" > "$OUT/$1.log" 2>&1
    echo "$t rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$1.log" | tail -1)"
    grep -B3 -A12 "ERROR" "$OUT/$1.log" | head -40
  done
fi
run() {  # name pipeline args...
  local name=$1 pipe=$2
  shift 2
  timeout 300 "$B/bin/kiln" run "$pipe" --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set train.steps="$STEPS" --set log.val_every=0 --set log.every=1000 --set log.metrics="$OUT/$name.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
for m in $MODELS; do
  case $m in
    g124) args=(pipelines/gpt2-124m.toml) ;;
    g124f) args=(pipelines/gpt2-124m.toml --set fp8.enabled=true) ;;
    g13f) args=(pipelines/gpt-1.3b.toml --set fp8.enabled=true) ;;
    l1bf) args=(pipelines/llama-1b.toml --set fp8.enabled=true) ;;
    l1b) args=(pipelines/llama-1b.toml) ;;
    *) echo "unknown model $m"; continue ;;
  esac
  for round in 1 2; do
    run "$m-eager-$round" "${args[@]}" --set backend.cuda_graph=false
    run "$m-graph-$round" "${args[@]}" --set backend.cuda_graph=true
  done
done
python3 - "$OUT" $MODELS <<'PY'
import json, re, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'run':<16} {'ms/step':>8} {'tok/s':>10} {'peak GiB':>9}  {'last loss':>9}")
for m in sys.argv[2:]:
    for kind in ("eager", "graph"):
        for rnd in (1, 2):
            n = f"{m}-{kind}-{rnd}"
            p = out / f"{n}.jsonl"
            if not p.exists():
                print(f"{n:<16} (no metrics)"); continue
            r = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
            st = r[len(r) // 4:] or r
            ms = statistics.median(x["step_ms"] for x in st)
            tps = statistics.median(x["tokens_per_s"] for x in st)
            g = re.findall(r"peak device memory ([0-9.]+)", (out / f"{n}.log").read_text())
            print(f"{n:<16} {ms:>8.2f} {tps:>10,.0f} {g[-1] if g else '-':>9}  {r[-1]['loss']:>9.4f}")
PY
grep -h "cuda_graph" "$OUT"/*-graph-1.log | sort | uniq -c

#!/usr/bin/env bash
# Two builds side by side on one GPU, building nothing: a change that must not move a number (a
# refactor) against the commit before it, in one call on one machine.
#   1. The GPU test suites of build B.
#   2. A few steps of GPT-2 124M and Llama 1B (bf16 and FP8 delayed) with deterministic attention,
#      once with each build: the losses and gradient norms must be equal to the last digit.
#   3. The benchmark pipelines (GPT-2 124M, the 1.3B model, Llama 1B; bf16, FP8 delayed and FP8
#      current) with A, then B, then A again: tokens/s (median of the last three quarters of the
#      steps), ms/step, MFU and peak memory of each; B against the mean of A's two runs.
# A table last. Logs and metrics under $OUT.
# usage (on the GPU machine, from the repository root):
#   bash bench/gpu_compare.sh BUILD_A BUILD_B [all|tests|det|bench]
# (each build a folder made by scripts/devbuild.sh: bin/, lib/, syslib/; a part alone where one call
# may not hold them all: tests and det take about 6 minutes, bench about 8)
set -uo pipefail
A=${1:?build A}
B=${2:?build B}
PART=${3:-all}
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT/runs"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
LOG="$OUT/compare-logs.txt"
: > "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
libs() { echo "$PWD/$1/lib:$PWD/$1/syslib:${LD_LIBRARY_PATH:-}"; }  # a build's libraries first

notes=()
want tests && for t in test_cuda_ops test_cuda_fp8 test_gpu_model test_gpu_generator test_gpu_recompute test_gpu_training_checkpoint \
  test_gpu_fsdp; do
  [ -x "$B/bin/$t" ] || { notes+=("$t: not built"); continue; }
  LD_LIBRARY_PATH=$(libs "$B") timeout 300 "$B/bin/$t" > "$OUT/runs/$t.log" 2>&1
  notes+=("$t rc=$?: $(grep -E '^\[doctest\] test cases' "$OUT/runs/$t.log" | tail -1)")
done

run() {  # build tag pipeline steps extra-args...
  local b=$1 tag=$2 pipe=$3 steps=$4
  shift 4
  LD_LIBRARY_PATH=$(libs "$b") timeout 300 "$b/bin/kiln" run "$pipe" --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=1 --set train.steps="$steps" --set log.metrics="$OUT/runs/$tag.jsonl" "$@" \
    > "$OUT/runs/$tag.log" 2>&1
  echo "$tag rc=$?" >> "$LOG"
}
FP8=(--set fp8.enabled=true)
CUR=(--set fp8.enabled=true --set fp8.recipe=current)
DET=(--set backend.attention_deterministic=true)
want det && for b in A B; do
  dir=$A
  [ $b = B ] && dir=$B
  run "$dir" "det-gpt2-bf16-$b" pipelines/gpt2-124m.toml 8 "${DET[@]}"
  run "$dir" "det-gpt2-fp8-$b" pipelines/gpt2-124m.toml 8 "${DET[@]}" "${FP8[@]}"
  run "$dir" "det-llama-bf16-$b" pipelines/llama-1b.toml 6 "${DET[@]}"
  run "$dir" "det-llama-fp8-$b" pipelines/llama-1b.toml 6 "${DET[@]}" "${FP8[@]}"
done
want bench && for cfg in "gpt2-124m pipelines/gpt2-124m.toml 60" "gpt-1.3b pipelines/gpt-1.3b.toml 30" \
  "llama-1b pipelines/llama-1b.toml 30"; do
  set -- $cfg
  for prec in bf16 fp8 fp8-current; do
    extra=()
    [ $prec = fp8 ] && extra=("${FP8[@]}")
    [ $prec = fp8-current ] && extra=("${CUR[@]}")
    run "$A" "$1-$prec-A1" "$2" "$3" "${extra[@]}"
    run "$B" "$1-$prec-B" "$2" "$3" "${extra[@]}"
    run "$A" "$1-$prec-A2" "$2" "$3" "${extra[@]}"
  done
done

echo "================ $A (A) against $B (B) ================"
for n in "${notes[@]}"; do echo "$n"; done
python3 - "$OUT/runs" <<'PY'
import json, re, statistics, sys, pathlib
runs = pathlib.Path(sys.argv[1])
def rows(tag):
    p = runs / f"{tag}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
def peak(tag):  # GiB, and MiB where the build prints it
    p = runs / f"{tag}.log"
    m = re.findall(r"peak device memory ([0-9.]+) GiB(?: \(([0-9]+) MiB)?", p.read_text()) if p.exists() else []
    return (float(m[-1][0]), m[-1][1] or "-") if m else (float("nan"), "-")
def stats(tag):
    r = rows(tag)
    st = r[len(r) // 4:] or r
    if not st:
        return None
    med = lambda k: statistics.median(x[k] for x in st)
    return med("tokens_per_s"), med("step_ms"), med("mfu"), peak(tag)
print("deterministic steps (losses and gradient norms, A against B):")
for name in ("det-gpt2-bf16", "det-gpt2-fp8", "det-llama-bf16", "det-llama-fp8"):
    a, b = rows(name + "-A"), rows(name + "-B")
    if not a and not b:
        continue
    key = lambda r: [(x["loss"], x.get("grad_norm")) for x in r]
    same = bool(a) and key(a) == key(b)
    worst = max((abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)), default=float("nan"))
    print(f"  {name:<16} {len(a)} steps: {'identical' if same else f'DIFFERENT (worst relative loss difference {worst:.2e})'}")
print(f"{'run':<22} {'A tok/s':>10} {'B tok/s':>10} {'B/A':>7} {'B ms':>8} {'B MFU':>6} {'A GiB':>7} {'B GiB':>7} {'A MiB':>7} {'B MiB':>7}")
for model in ("gpt2-124m", "gpt-1.3b", "llama-1b"):
    for prec in ("bf16", "fp8", "fp8-current"):
        t = f"{model}-{prec}"
        a1, b, a2 = stats(t + "-A1"), stats(t + "-B"), stats(t + "-A2")
        if not (a1 and b and a2):
            continue
        a = (a1[0] + a2[0]) / 2
        print(f"{t:<22} {a:>10,.0f} {b[0]:>10,.0f} {b[0] / a:>7.3f} {b[1]:>8.2f} {100 * b[2]:>5.1f}% {a1[3][0]:>7.2f} "
              f"{b[3][0]:>7.2f} {a1[3][1]:>7} {b[3][1]:>7}")
PY
# The device returns at most 8 files: the logs folded into one, the metrics into another.
for f in "$OUT"/runs/*.log; do echo "===== $(basename "$f")"; cat "$f"; done >> "$LOG"
for f in "$OUT"/runs/*.jsonl; do echo "===== $(basename "$f")"; cat "$f"; done > "$OUT/compare-metrics.txt"
rm -rf "$OUT/runs"

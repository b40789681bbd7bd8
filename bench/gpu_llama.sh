#!/usr/bin/env bash
# Llama on one GPU, building nothing: the CUDA op tests (RMSNorm, RoPE, SwiGLU, grouped-query
# attention against the CPU), a Llama training step on CUDA against the CPU, then
# pipelines/llama-1b.toml in bf16, FP8 delayed and FP8 current against PyTorch (bench/torch_llama.py,
# when torch imports) on the same GPU. A table last: tokens/s, ms/step, MFU, peak memory.
# usage: bash bench/gpu_llama.sh BUILD_DIR [steps]     (logs and metrics under $OUT; GPU 0; TORCH=0 skips PyTorch)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-30}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
K="$B/bin/kiln"
LOG="$OUT/llama-logs.txt"
: > "$LOG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$LOG" 2>&1
notes=()
for t in test_cuda_ops test_gpu_model; do
  if [ -x "$B/bin/$t" ]; then
    timeout 240 "$B/bin/$t" >> "$LOG" 2>&1
    notes+=("$t rc=$?: $(grep -E '^\[doctest\] test cases' "$LOG" | tail -1)")
  fi
done
run() {  # name args...
  local name=$1
  shift
  timeout 300 "$K" run pipelines/llama-1b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=5 --set train.steps="$STEPS" --set log.metrics="$OUT/$name.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  { echo "===== $name rc=$rc"; cat "$OUT/$name.log"; } >> "$LOG"
  echo "$name rc=$rc"
}
run llama-bf16
run llama-fp8 --set fp8.enabled=true
run llama-fp8-current --set fp8.enabled=true --set fp8.recipe=current
if [ "${TORCH:-1}" = 1 ] && python3 -c "import torch" 2>/dev/null; then
  timeout 400 python3 bench/torch_llama.py --batch 4 --steps "$STEPS" --out "$OUT/torch-llama.json" >> "$LOG" 2>&1
  echo "torch rc=$?"
fi
echo "================ Llama 1B (pipelines/llama-1b.toml, batch 4 x 2048) ================"
python3 - "$OUT" <<'PY'
import json, re, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
torch = None
if (out / "torch-llama.json").exists():
    torch = json.loads((out / "torch-llama.json").read_text())
print(f"{'run':<20} {'tok/s':>10} {'ms/step':>9} {'MFU':>6} {'peak GiB':>9} {'vs torch bf16':>13}")
for n in ("llama-bf16", "llama-fp8", "llama-fp8-current"):
    p = out / f"{n}.jsonl"
    if not p.exists():
        print(f"{n:<20} (no metrics)"); continue
    r = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    st = r[len(r) // 4:] or r
    tps = statistics.median(x["tokens_per_s"] for x in st)
    ms = statistics.median(x["step_ms"] for x in st)
    mfu = statistics.median(x["mfu"] for x in st if x.get("mfu") is not None) if any(x.get("mfu") for x in st) else float("nan")
    log = (out / f"{n}.log").read_text()
    m = re.findall(r"peak device memory ([0-9.]+)", log)
    share = f"{tps / torch['tokens_per_s']:.2f}x" if torch else "-"
    print(f"{n:<20} {tps:>10,.0f} {ms:>9.1f} {100 * mfu:>5.1f}% {m[-1] if m else '-':>9} {share:>13}")
if torch:
    print(f"{'torch bf16':<20} {torch['tokens_per_s']:>10,.0f} {torch['ms_per_step']:>9.1f} {'':>6} {torch['peak_gib']:>9.2f}")
PY
printf '%s\n' "${notes[@]}"
rm -f "$OUT"/*.log

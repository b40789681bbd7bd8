#!/usr/bin/env bash
# Mixture of experts on one GPU, building nothing: the CUDA op tests (the MoE ops and grouped GEMMs
# against the CPU), whole MoE training steps on CUDA against the CPU, then pipelines/moe-1b.toml in
# bf16 (and with FP8 where the experts run it) against PyTorch written the way torchtitan's MoE is
# (bench/torch_moe.py, when torch imports) on the same GPU, and one profiled kiln run (the per-op
# breakdown). A table last: tokens/s, ms/step, MFU (active FLOPs), peak memory.
# usage: bash bench/gpu_moe.sh BUILD_DIR [steps]   (logs under $OUT; GPU 0; TORCH=0 skips PyTorch; TESTS=0 skips tests;
#   PROFILE=0 skips the profiled run). Each precision runs with f32 and with bf16 AdamW moments (-m16,
#   the pipeline's own).
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-30}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
K="$B/bin/kiln"
LOG="$OUT/moe-logs.txt"
: > "$LOG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$LOG" 2>&1
notes=()
if [ "${TESTS:-1}" = 1 ]; then
  for t in "test_cuda_ops -tc=*moe*,*grouped*,*gelu_backward*" "test_gpu_model"; do
    set -- $t
    if [ -x "$B/bin/$1" ]; then
      timeout 300 "$B/bin/$1" "${@:2}" >> "$LOG" 2>&1
      notes+=("$1 rc=$?: $(grep -E '^\[doctest\] test cases' "$LOG" | tail -1)")
    fi
  done
fi
run() {  # name args...
  local name=$1
  shift
  timeout 400 "$K" run pipelines/moe-1b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=5 --set train.steps="$STEPS" --set log.metrics="$OUT/$name.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  { echo "===== $name rc=$rc"; cat "$OUT/$name.log"; } >> "$LOG"
  echo "$name rc=$rc"
}
# AdamW's moments in bf16 (optim.moments; PyTorch's fused AdamW keeps its f32 parameters' moments in f32)
# RUNS: which of the four base runs (default all); FP8_VARIANTS="name=key=value,key=value ...": more
# FP8 runs with bf16 moments and those overrides (named moe-fp8-m16-NAME).
want_run() { [[ " ${RUNS:-bf16 fp8 bf16-m16 fp8-m16} " == *" $1 "* ]]; }
want_run bf16 && run moe-bf16 --set optim.moments=f32
want_run fp8 && run moe-fp8 --set fp8.enabled=true --set optim.moments=f32
want_run bf16-m16 && run moe-bf16-m16 --set optim.moments=bf16
want_run fp8-m16 && run moe-fp8-m16 --set fp8.enabled=true --set optim.moments=bf16
for v in ${FP8_VARIANTS:-}; do
  extra=()
  IFS=, read -ra kv <<< "${v#*=}"
  for x in "${kv[@]}"; do extra+=(--set "$x"); done
  run "moe-fp8-m16-${v%%=*}" --set fp8.enabled=true --set optim.moments=bf16 "${extra[@]}"
done
[ "${PROFILE:-1}" = 1 ] && run moe-profile --set backend.profile=true --set train.steps=12
if [ "${TORCH:-1}" = 1 ] && python3 -c "import torch" 2>/dev/null; then
  timeout 500 python3 bench/torch_moe.py --batch 8 --steps "$STEPS" --out "$OUT/torch-moe.json" >> "$LOG" 2>&1
  echo "torch rc=$?"
fi
echo "================ MoE 1B (pipelines/moe-1b.toml, batch 8 x 2048, 8 experts top-2) ================"
python3 - "$OUT" <<'PY'
import json, re, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
torch = json.loads((out / "torch-moe.json").read_text()) if (out / "torch-moe.json").exists() else None
print(f"{'run':<22} {'tok/s':>10} {'ms/step':>9} {'MFU':>6} {'peak GiB':>9} {'vs torch bf16':>13}")
names = ["moe-bf16", "moe-fp8", "moe-bf16-m16", "moe-fp8-m16"]
names += sorted(p.stem for p in out.glob("moe-fp8-m16-*.jsonl"))
for n in names:
    p = out / f"{n}.jsonl"
    if not p.exists():
        if (out / f"{n}.log").exists():
            print(f"{n:<12} (no metrics) {(out / f'{n}.log').read_text()[-300:]!r}")
        continue
    r = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    st = r[len(r) // 4:] or r
    tps = statistics.median(x["tokens_per_s"] for x in st)
    ms = statistics.median(x["step_ms"] for x in st)
    mfu = statistics.median(x["mfu"] for x in st)
    log = (out / f"{n}.log").read_text()
    m = re.findall(r"peak device memory ([0-9.]+)", log)
    share = f"{tps / torch['tokens_per_s']:.2f}x" if torch else "-"
    cv = statistics.median(x.get("blocks.0.mlp.tokens_cv", float("nan")) for x in st)
    print(f"{n:<22} {tps:>10,.0f} {ms:>9.1f} {100 * mfu:>5.1f}% {m[-1] if m else '-':>9} {share:>13}   (block 0 load cv {cv:.2f})")
if torch:
    print(f"{'torch bf16':<22} {torch['tokens_per_s']:>10,.0f} {torch['ms_per_step']:>9.1f} {'':>6} {torch['peak_gib']:>9.2f}")
prof = out / "moe-profile.log"
if prof.exists():
    t = prof.read_text()
    i = t.find("op time breakdown")
    print("--- per-op breakdown (kiln bf16, 12 steps)")
    print("\n".join(t[i:].splitlines()[:40]) if i >= 0 else "(no breakdown)")
PY
printf '%s\n' "${notes[@]}"
grep -E "model:|fp8:" "$OUT/moe-bf16.log" "$OUT/moe-fp8.log" 2>/dev/null | head -4
rm -f "$OUT"/moe-*.log "$OUT"/moe-*.jsonl

#!/usr/bin/env bash
# Everything one GPU session needs, in one call, building nothing: GPU op tests, kernel benchmarks,
# and end-to-end training throughput of gpt2-124m and gpt-1.3b with a per-op breakdown.
# usage (on the GPU machine, from the repository root):
#   bash bench/gpu_suite.sh BUILD_DIR [full|train|tests|fp8|attn|block|moe-block]
# attn: the GPU tests, bench_attention, and bf16 / FP8 runs of both models with cuDNN's attention
# (deterministic and atomic-dQ) beside kiln's kernels. block: issue 29's block scaling (test_cuda_fp8,
# bench_fp8 block, 1.3B and Llama 1B with block scaling beside per-tensor current scaling and bf16).
# moe-block: test_cuda_fp8 and moe-1b with its experts block-scaled beside per-tensor FP8 and bf16.
# Logs go to $OUT (or ./gpu-logs); a summary table is printed last.
set -uo pipefail
B=${1:-.devbuild}
MODE=${2:-full}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
summary=()
note() { summary+=("$1"); }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
note "device: $(tail -1 "$OUT/gpu.txt")"

run_tests() {
  local exe=$1
  [ -x "$B/bin/$exe" ] || { note "$exe: not built"; return; }
  timeout 150 "$B/bin/$exe" > "$OUT/$exe.log" 2>&1
  local rc=$?
  note "$exe: rc=$rc $(grep -E '^\[doctest\] test cases' "$OUT/$exe.log" | tail -1)"
}
if [ "$MODE" = "block" ] || [ "$MODE" = "moe-block" ]; then
  run_tests test_cuda_fp8
elif [ "$MODE" = "fp8" ] || [ "$MODE" = "attn" ]; then
  run_tests test_cuda_fp8
  run_tests test_cuda_ops
  run_tests test_gpu_model
  run_tests test_gpu_recompute
  run_tests test_gpu_fsdp
elif [ "$MODE" != "train" ]; then
  run_tests test_cuda_ops
  run_tests test_gpu_model
  run_tests test_cuda_fp8
fi

if [ "$MODE" = "block" ]; then
  timeout 100 "$B/bin/bench_fp8" block > "$OUT/bench_fp8.log" 2>&1; note "bench_fp8 block rc=$?"
elif [ "$MODE" = "fp8" ]; then
  timeout 100 "$B/bin/bench_fp8" > "$OUT/bench_fp8.log" 2>&1; note "bench_fp8 rc=$?"
elif [ "$MODE" = "attn" ]; then
  timeout 100 "$B/bin/bench_attention" > "$OUT/bench_attention.log" 2>&1; note "bench_attention rc=$?"
elif [ "$MODE" = "train" ] || [ "$MODE" = "moe-block" ]; then
  :
elif [ "$MODE" != "tests" ]; then
  timeout 100 "$B/bin/bench_fp8" > "$OUT/bench_fp8.log" 2>&1; note "bench_fp8 rc=$?"
  timeout 100 "$B/bin/bench_kernels" > "$OUT/bench_kernels.log" 2>&1; note "bench_kernels rc=$?"
  timeout 100 "$B/bin/bench_attention" > "$OUT/bench_attention.log" 2>&1; note "bench_attention rc=$?"
fi
if [ "$MODE" != "tests" ]; then
  train() {  # name pipeline steps extra-args...
    local name=$1 pipe=$2 steps=$3
    shift 3
    timeout 120 "$B/bin/kiln" run "$pipe" --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
      --set train.steps="$steps" --set log.val_every=0 --set log.every=5 --set log.metrics="$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1
    note "$name rc=$? $(grep -E 'peak device memory' "$OUT/$name.log")"
  }
  if [ "$MODE" = "attn" ]; then
    K=(--set backend.attention=kiln)
    A=(--set backend.attention_deterministic=false)
    F=(--set fp8.enabled=true)
    train gpt2-124m pipelines/gpt2-124m.toml 60
    train gpt2-124m-kiln pipelines/gpt2-124m.toml 60 "${K[@]}"
    train gpt2-124m-atomic pipelines/gpt2-124m.toml 60 "${A[@]}"
    train gpt2-124m-fp8 pipelines/gpt2-124m.toml 60 "${F[@]}"
    train gpt2-124m-fp8-atomic pipelines/gpt2-124m.toml 60 "${F[@]}" "${A[@]}"
    train gpt2-124m-fp8-kiln pipelines/gpt2-124m.toml 60 "${F[@]}" "${K[@]}"
    train gpt-1.3b pipelines/gpt-1.3b.toml 30
    train gpt-1.3b-kiln pipelines/gpt-1.3b.toml 30 "${K[@]}"
    train gpt-1.3b-atomic pipelines/gpt-1.3b.toml 30 "${A[@]}"
    train gpt-1.3b-fp8 pipelines/gpt-1.3b.toml 30 "${F[@]}"
    train gpt-1.3b-fp8-atomic pipelines/gpt-1.3b.toml 30 "${F[@]}" "${A[@]}"
    train gpt-1.3b-fp8-kiln pipelines/gpt-1.3b.toml 30 "${F[@]}" "${K[@]}"
    train gpt-1.3b-profile pipelines/gpt-1.3b.toml 8 --set backend.profile=true
    train gpt-1.3b-fp8-profile pipelines/gpt-1.3b.toml 8 "${F[@]}" --set backend.profile=true
  elif [ "$MODE" = "block" ]; then  # issue 29: block scaling against per-tensor current scaling and bf16
    F=(--set fp8.enabled=true)
    STORED=(--set model.recompute_norm=false --set model.recompute_gelu=false --set fp8.weights_in_compute_copy=false)
    train gpt-1.3b-bf16 pipelines/gpt-1.3b.toml 30
    train gpt-1.3b-current pipelines/gpt-1.3b.toml 30 "${F[@]}" --set fp8.recipe=current
    train gpt-1.3b-block pipelines/gpt-1.3b.toml 30 "${F[@]}" --set fp8.recipe=block
    # Without the operands on load and the weights' codes from the optimizer (the outputs stored, the
    # codes in their own buffers, made from the bf16 copy after each step): the path before them.
    train gpt-1.3b-block-stored pipelines/gpt-1.3b.toml 30 "${F[@]}" --set fp8.recipe=block "${STORED[@]}"
    train gpt-1.3b-block-2d pipelines/gpt-1.3b.toml 30 "${F[@]}" --set fp8.recipe=block --set fp8.block_2d_wgrad_input=true
    train gpt-1.3b-block-profile pipelines/gpt-1.3b.toml 8 "${F[@]}" --set fp8.recipe=block --set backend.profile=true
    train gpt-1.3b-current-profile pipelines/gpt-1.3b.toml 8 "${F[@]}" --set fp8.recipe=current --set backend.profile=true
    train llama-1b-bf16 pipelines/llama-1b.toml 30
    train llama-1b-current pipelines/llama-1b.toml 30 "${F[@]}" --set fp8.recipe=current
    train llama-1b-block pipelines/llama-1b.toml 30 "${F[@]}" --set fp8.recipe=block
    train llama-1b-block-stored pipelines/llama-1b.toml 30 "${F[@]}" --set fp8.recipe=block "${STORED[@]}"
    train llama-1b-block-2d pipelines/llama-1b.toml 30 "${F[@]}" --set fp8.recipe=block --set fp8.block_2d_wgrad_input=true
    train llama-1b-block-profile pipelines/llama-1b.toml 8 "${F[@]}" --set fp8.recipe=block --set backend.profile=true
    # The same machine's PyTorch bf16 reference (torch.compile'd Llama 1B, bench/torch_llama.py).
    timeout 300 python3 bench/torch_llama.py --batch 4 --steps 30 --out "$OUT/torch-llama.json" > "$OUT/torch-llama.log" 2>&1
    note "torch llama-1b bf16 rc=$? $(cat "$OUT/torch-llama.json" 2>/dev/null)"
  elif [ "$MODE" = "moe-block" ]; then  # issue 29: the experts block-scaled (moe-1b), beside per-tensor and bf16
    F=(--set fp8.enabled=true)
    train moe-1b-bf16 pipelines/moe-1b.toml 30
    train moe-1b-delayed pipelines/moe-1b.toml 30 "${F[@]}"
    train moe-1b-current pipelines/moe-1b.toml 30 "${F[@]}" --set fp8.recipe=current
    train moe-1b-block pipelines/moe-1b.toml 30 "${F[@]}" --set fp8.recipe=block
    train moe-1b-block-profile pipelines/moe-1b.toml 8 "${F[@]}" --set fp8.recipe=block --set backend.profile=true
    train moe-1b-current-profile pipelines/moe-1b.toml 8 "${F[@]}" --set fp8.recipe=current --set backend.profile=true
    # The same machine's PyTorch bf16 reference (torchtitan-style MoE, bench/torch_moe.py).
    timeout 300 python3 bench/torch_moe.py --batch 8 --steps 30 --out "$OUT/torch-moe.json" > "$OUT/torch-moe.log" 2>&1
    note "torch moe-1b bf16 rc=$? $(cat "$OUT/torch-moe.json" 2>/dev/null)"
  elif [ "$MODE" = "fp8" ]; then
    train gpt2-124m pipelines/gpt2-124m.toml 60 --set fp8.enabled=true
    train gpt2-124m-current pipelines/gpt2-124m.toml 60 --set fp8.enabled=true --set fp8.recipe=current
    train gpt2-124m-profile pipelines/gpt2-124m.toml 12 --set fp8.enabled=true --set backend.profile=true
    train gpt-1.3b pipelines/gpt-1.3b.toml 30 --set fp8.enabled=true
    train gpt-1.3b-profile pipelines/gpt-1.3b.toml 8 --set fp8.enabled=true --set backend.profile=true
    # The same machine's references: FP8 without the fused weight update, and bf16.
    train gpt-1.3b-unfused pipelines/gpt-1.3b.toml 30 --set fp8.enabled=true --set fp8.fuse_weight_update=false
    train gpt-1.3b-bf16 pipelines/gpt-1.3b.toml 30
    train gpt2-124m-bf16 pipelines/gpt2-124m.toml 60
  else
    train gpt2-124m pipelines/gpt2-124m.toml 60
    train gpt2-124m-profile pipelines/gpt2-124m.toml 12 --set backend.profile=true
  fi
  if [ "$MODE" = "full" ] || [ "$MODE" = "train" ]; then
    train gpt-1.3b pipelines/gpt-1.3b.toml 30
    train gpt-1.3b-profile pipelines/gpt-1.3b.toml 8 --set backend.profile=true
  fi
fi

echo "================ summary ================"
for line in "${summary[@]}"; do echo "$line"; done
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'run':<22} {'steps':>5} {'tok/s (median)':>15} {'ms/step':>9} {'MFU':>6} {'final loss':>10}")
for p in sorted(out.glob("*.jsonl")):
    name = p.stem
    if name.endswith("-profile"):
        continue
    rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    steady = rows[len(rows) // 4:] or rows
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    ms = statistics.median(r["step_ms"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady)
    print(f"{name:<22} {len(rows):>5} {tps:>15,.0f} {ms:>9.2f} {100*mfu:>5.1f}% {rows[-1]['loss']:>10.4f}")
PY
for f in "$OUT"/*.log; do
  if grep -qE "FAILED|ERROR|error:" "$f"; then echo "--- problems in $f:"; grep -E "FAILED|ERROR|error:" "$f" | head -15; fi
done
# The device returns at most 8 files: fold the logs into one.
for f in "$OUT"/gpu.txt "$OUT"/*.log; do
  echo "===== $(basename "$f")"
  cat "$f"
done > "$OUT/all-logs.txt"
rm -f "$OUT"/*.log "$OUT"/gpu.txt "$OUT"/*-profile.jsonl "$OUT"/gpt2-124m-current.jsonl
if [ "$MODE" = "attn" ]; then rm -f "$OUT"/*.jsonl; fi

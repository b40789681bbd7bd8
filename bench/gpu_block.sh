#!/usr/bin/env bash
# Issue 29's GPU checks and figures, building nothing: the FP8 GPU tests (block quantisation and
# cuBLASLt's block-scaled GEMMs among them), the packed-documents attention case, and
# `bench_fp8 block` (block-scaled GEMMs against per-tensor ones, the block casts). A summary last.
# usage: OUT=DIR bash bench/gpu_block.sh BUILD_DIR
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
summary=("device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)")
t() {
  local name=$1
  shift
  timeout 300 "$B/bin/$name" "$@" > "$OUT/$name$(echo "$*" | tr -c 'a-z0-9' _).log" 2>&1
  summary+=("$name $*: rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$name$(echo "$*" | tr -c 'a-z0-9' _).log" | tail -1)")
}
t test_cuda_fp8
t test_cuda_ops -tc=*packed*
t test_cuda_ops
timeout 300 "$B/bin/bench_fp8" block > "$OUT/bench_block.log" 2>&1
summary+=("bench_fp8 block: rc=$?")
grep -B2 -A12 "ERROR\|MESSAGE\|refused" "$OUT"/test_cuda_fp8*.log | head -80
printf '%s\n' "${summary[@]}"
cat "$OUT/bench_block.log"

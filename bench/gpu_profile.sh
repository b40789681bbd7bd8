#!/usr/bin/env bash
# One GPU, building nothing: the GPU test binaries named in TESTS (default: the op, FP8, model,
# checkpoint, FSDP and recompute suites), then per-op profiles (`backend.profile = true`, eager steps,
# CUDA events around every op) of the FP8 benchmark models with bf16 AdamW moments, each its
# breakdown sorted by time, then the same runs captured and timed (bench/kiln_rows.sh); a table last.
# usage: bash bench/gpu_profile.sh BUILD_DIR [steps] [models...]   (models: 124m 1.3b llama1b moe1b; logs under
#   $OUT; TESTS="" runs no tests, GRAPH=0 no timed runs; a model "none" runs the tests alone)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-20}
shift 2 || shift $#
MODELS=${*:-124m 1.3b llama1b}
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
# shellcheck disable=SC2086  # a list of names
kiln_gpu_tests "$B" ${TESTS-$kiln_gpu_suites}
pipeline() {
  case $1 in
    124m) echo pipelines/gpt2-124m.toml ;;
    1.3b) echo pipelines/gpt-1.3b.toml ;;
    llama1b) echo pipelines/llama-1b.toml ;;
    moe1b) echo pipelines/moe-1b.toml ;;  # eager steps: a mixture of experts is never captured
  esac
}
F=(--set fp8.enabled=true --set optim.moments=bf16)
for m in $MODELS; do
  [ -n "$(pipeline "$m")" ] || { echo "no model '$m' (124m 1.3b llama1b moe1b): skipped"; continue; }
  kiln_row "$m-fp8-profile" 1 12 "$(pipeline "$m")" "${F[@]}" --set backend.profile=true
  echo "---- $m FP8 (bf16 moments), ms per step, eager, profiled"
  sed -n '/op time breakdown/,/total (ops only)/p' "$OUT/$m-fp8-profile.log" | tail -n +3 | grep -v "total (ops" |
    sort -rn -k3 | head -28
  grep "total (ops only)" "$OUT/$m-fp8-profile.log"
done
[ "${GRAPH:-1}" = 1 ] && for m in $MODELS; do
  [ -n "$(pipeline "$m")" ] || continue
  kiln_row "$m-fp8-graph" 1 "$STEPS" "$(pipeline "$m")" "${F[@]}" --set backend.cuda_graph=true
done
rm -f "$OUT"/*.jsonl "$OUT"/*-graph.log
kiln_rows_table

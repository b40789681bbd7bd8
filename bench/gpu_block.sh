#!/usr/bin/env bash
# Issue 29's block scaling in one call on one GPU, building nothing: `bench/gpu_suite.sh BUILD block`
# (GPU tests, bench_fp8 block, 1.3B and Llama 1B with block scaling beside per-tensor current scaling,
# bf16 and PyTorch's Llama) into $OUT/suite, then the numerics runs of gpt2-124m on Brown
# (bench/gpu_numerics.sh, RUNS: bf16, block, block with the weight gradient's input in 128x128 blocks)
# into $OUT. Needs data/brown carried. Prints both tables last.
#   bash bench/gpu_block.sh BUILD [STEPS]
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-2000}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT/suite"
OUT="$OUT/suite" bash bench/gpu_suite.sh "$B" block > "$OUT/suite-summary.txt" 2>&1
rm -f "$OUT"/suite/*.jsonl  # the device returns few files: the table is in the summary
RUNS=${RUNS:-"bf16 fp8-block fp8-block-2d"} OUT="$OUT" bash bench/gpu_numerics.sh "$B" "$STEPS" > "$OUT/numerics-summary.txt" 2>&1
tail -30 "$OUT/suite-summary.txt"
tail -8 "$OUT/numerics-summary.txt"

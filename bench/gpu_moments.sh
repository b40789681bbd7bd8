#!/usr/bin/env bash
# optim.moments = "bf16" on one GPU, building nothing: the GPU tests of the updates it changes (the
# flat AdamW, the fused FP8 updates per-tensor and block-scaled, captured steps, checkpoints, FSDP),
# then the 1.3B, Llama 1B and 124M FP8 runs with f32 and bf16 moments (captured steps), with the FP8
# weights' transposed codes kept and not (fp8.keep_weight_transpose = false: -nt), the 1.3B also with
# the LM head in chunks of 2,048 rows; a table last (bench/kiln_rows.sh).
# usage: bash bench/gpu_moments.sh BUILD_DIR [steps]   (logs under $OUT; TESTS=0 skips the tests)
set -uo pipefail
B=${1:-.devbuild}
STEPS=${2:-30}
# shellcheck source=bench/kiln_rows.sh
source bench/kiln_rows.sh
kiln_gpu_env "$B"
# shellcheck disable=SC2086  # a list of names
[ "${TESTS:-1}" = 1 ] && kiln_gpu_tests "$B" $kiln_gpu_suites
G=(--set backend.cuda_graph=true --set fp8.enabled=true)
M16=(--set optim.moments=bf16)
NT=(--set fp8.keep_weight_transpose=false)  # the FP8 weights' rowwise codes alone
kiln_row 1.3b-fp8-m32 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}"
kiln_row 1.3b-fp8-m16 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${M16[@]}"
kiln_row 1.3b-fp8-m16-nt 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${M16[@]}" "${NT[@]}"
kiln_row 1.3b-fp8-m16-nt-chunk2048 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${M16[@]}" "${NT[@]}" \
  --set model.head_chunk_rows=2048
kiln_row 1.3b-fp8-m32-nt 1 "$STEPS" pipelines/gpt-1.3b.toml "${G[@]}" "${NT[@]}"
kiln_row llama1b-fp8-m32 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}"
kiln_row llama1b-fp8-m16 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}" "${M16[@]}"
kiln_row llama1b-fp8-m16-nt 1 "$STEPS" pipelines/llama-1b.toml "${G[@]}" "${M16[@]}" "${NT[@]}"
kiln_row 124m-fp8-m16 1 $((STEPS + 16)) pipelines/gpt2-124m.toml "${G[@]}" "${M16[@]}"
kiln_row 124m-fp8-m16-nt 1 $((STEPS + 16)) pipelines/gpt2-124m.toml "${G[@]}" "${M16[@]}" "${NT[@]}"
grep -h "cuda_graph" "$OUT"/1.3b-fp8-m16-nt.log | head -2
rm -f "$OUT"/*.jsonl "$OUT"/1.3b*.log "$OUT"/llama*.log "$OUT"/124m*.log
kiln_rows_table

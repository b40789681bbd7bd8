#!/usr/bin/env bash
# Hugging Face interop on the GPU machine, building nothing: the CUDA op tests (RoPE with llama3
# scaling among them), the GPU model tests, then bench/hf_llama_check.py (kiln eval and kiln export
# against transformers) and, when present, the tokenizer.json reference check.
# usage: OUT=DIR bash bench/gpu_hf.sh BUILD_DIR
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
summary=()
for exe in test_cuda_ops test_gpu_model test_gpu_generator; do
  if [ -x "$B/bin/$exe" ]; then
    timeout 200 "$B/bin/$exe" > "$OUT/$exe.log" 2>&1
    summary+=("$exe: rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$exe.log" | tail -1)")
  fi
done
timeout 300 python3 bench/hf_llama_check.py "$PWD/$B/bin/kiln" "$OUT/hf" > "$OUT/hf_llama_check.log" 2>&1
summary+=("hf_llama_check: rc=$?")
grep -E "^(ok|FAIL)|hf_llama_check:" "$OUT/hf_llama_check.log" | while read -r l; do echo "  $l"; done > "$OUT/hf_lines.txt"
tail -20 "$OUT/hf_llama_check.log" | grep -E "Error|error" | head -5 >> "$OUT/hf_lines.txt"
rm -rf "$OUT/hf"
grep -h "FAILED\|ERROR" "$OUT"/test_*.log | head -10
printf '%s\n' "${summary[@]}"
cat "$OUT/hf_lines.txt"

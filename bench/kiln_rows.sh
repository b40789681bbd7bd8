# Sourced by the GPU benchmark scripts: their environment, the GPU test suites, and one timed kiln run
# and its row of figures.
#   kiln_gpu_env BUILD  exports BUILD's libraries on the library path, NCCL_NVLS_ENABLE=0 and (unless
#   set) CUDA_VISIBLE_DEVICES=0; sets K (BUILD's kiln) and OUT (default gpu-logs), made, with an empty
#   rows.txt.
#   kiln_gpu_tests BUILD TEST...  runs each GPU test binary (300 s at most), printing its doctest
#   summary and the context of any failure; its log to $OUT/TEST.log. kiln_gpu_suites names the usual
#   ones: the op, FP8, model, checkpoint, FSDP and recompute suites.
#   kiln_row NAME NPROC STEPS ARGS...  runs "$K run --nproc NPROC" with ARGS on synthetic tokens (no
#   validation, no checkpoints), logs to $OUT/NAME.log and .jsonl, and appends to $OUT/rows.txt the
#   median ms/step and tokens/s per GPU over the last three quarters of the steps, the peak device
#   memory and the last loss. Needs K (the kiln binary) and OUT.
kiln_gpu_env() {
  OUT=${OUT:-gpu-logs}
  mkdir -p "$OUT"
  : > "$OUT/rows.txt"
  export LD_LIBRARY_PATH="$PWD/$1/lib:$PWD/$1/syslib:${LD_LIBRARY_PATH:-}"
  export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  K="$1/bin/kiln"
}

kiln_gpu_suites="test_cuda_ops test_cuda_fp8 test_gpu_model test_gpu_training_checkpoint test_gpu_fsdp test_gpu_recompute"

kiln_gpu_tests() {
  local b=$1 t
  shift
  for t in "$@"; do
    timeout 300 "$b/bin/$t" > "$OUT/$t.log" 2>&1
    echo "$t rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$t.log" | tail -1)"
    grep -B3 -A12 "ERROR" "$OUT/$t.log" | head -40
  done
}

kiln_row() {
  local name=$1 nproc=$2 steps=$3
  shift 3
  timeout "${KILN_ROW_TIMEOUT:-400}" "$K" run --nproc "$nproc" --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=1000 --set train.steps="$steps" --set parallel.timeout_s=300 \
    --set checkpoint.every=0 --set checkpoint.at_end=false --set checkpoint.resume=never \
    --set log.metrics="$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  python3 - "$OUT/$name.jsonl" "$OUT/$name.log" "$name" "$nproc" >> "$OUT/rows.txt" <<'PY'
import json, re, statistics, sys
try:
    r = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    r = [x for x in r if "step_ms" in x]
    st = r[len(r) // 4:] or r
    ms = statistics.median(x["step_ms"] for x in st)
    tps = statistics.median(x["tokens_per_s"] for x in st) / int(sys.argv[4])
    peaks = [float(g) for g in re.findall(r"peak device memory ([0-9.]+)", open(sys.argv[2]).read())]
    print(f"{sys.argv[3]:<30} {ms:>9.2f} {tps:>12,.0f} {max(peaks) if peaks else float('nan'):>9.2f} {r[-1]['loss']:>10.6f}")
except Exception as e:
    print(f"{sys.argv[3]:<30} (no figures: {e})")
PY
}

# The table of $OUT/rows.txt, with its header.
kiln_rows_table() {
  echo
  printf "%-30s %9s %12s %9s %10s\n" run "ms/step" "tok/s/GPU" "peak GiB" "last loss"
  cat "$OUT/rows.txt"
}

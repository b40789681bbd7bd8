#!/usr/bin/env bash
# Four-GPU session in one call (kind nvidia-h200-x4), building nothing.
#   Phase A, all GPUs, one job at a time: collectives on 4 GPUs; gpt2-124m on 1 GPU, data parallel on
#   2 and 4 GPUs with and without gradient buckets, tensor parallel on 4 GPUs.
#   Phase B, side by side on separate GPUs: activation checkpointing benchmarks on GPU 0 (124M and
#   1.3B in each mode; the largest batch predicted from the activation memory and then run); the
#   GPU test suites on GPU 1; tp=2 recompute with distributed saved inputs against tp=2 without, on
#   GPUs 2 and 3.
# usage: bash bench/gpu_x4.sh BUILD_DIR [all|ckpt|vocab]   (logs and metrics under $OUT; a summary last)
#   vocab: the CUDA op and model test suites, then tensor parallel on GPUs 0-1 with and without
#   vocabulary parallelism against one GPU (gpt2-124m and gpt-1.3b); runs on an x2 machine too.
#   tune: the CUDA op suite, then gpt2-124m and gpt-1.3b on one GPU with and without
#   backend.gemm_autotune (kind nvidia-h200 is enough).
#   equiv: gpt2-124m with the same global batch (16) on 1 GPU and as DP=2, DP=4, TP=2 x DP=2 (losses
#   and gradient norms compared step by step); then a 2-rank job under mpirun (MPI bootstrap).
#   ckpt: only the activation checkpointing runs, one at a time (timings free of neighbours), then the
#   largest-batch runs spread over the four GPUs, then the tp=2 recompute runs.
set -uo pipefail
B=${1:-.devbuild}
WHAT=${2:-all}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
LOG="$OUT/x4-logs.txt"
: > "$LOG"
nvidia-smi --query-gpu=index,name,memory.total --format=csv >> "$LOG"
small=(pipelines/gpt2-124m.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
       --set log.every=4 --set parallel.timeout_s=60)
big=(pipelines/gpt-1.3b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
     --set log.every=2 --set model.recompute_gelu=true)
# run NAME GPUS STEPS ARGS... : one kiln run on the listed GPUs, its output in its own log.
run() {
  local name=$1 gpus=$2 steps=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout 200 "$K" run "$@" --set train.steps="$steps" --set log.metrics="$OUT/$name.jsonl" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.log"
}

# ---- Phase A
t0=$(date +%s)
if [ "$WHAT" = all ]; then
CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 150 "$B/bin/bench_collectives" --nproc 4 > "$OUT/collectives4.log" 2>&1
run one 0 24 "${small[@]}"
run dp4 0,1,2,3 24 "${small[@]}" --nproc 4 --set train.batch_size=64
run dp4-nobucket 0,1,2,3 24 "${small[@]}" --nproc 4 --set train.batch_size=64 --set parallel.dp_bucket_mb=0
run dp2 0,1 24 "${small[@]}" --nproc 2 --set train.batch_size=32
run dp2-nobucket 0,1 24 "${small[@]}" --nproc 2 --set train.batch_size=32 --set parallel.dp_bucket_mb=0
run tp4 0,1,2,3 24 "${small[@]}" --nproc 4 --set parallel.tp=4
fi
echo "phase A: $(( $(date +%s) - t0 )) s" >> "$LOG"

if [ "$WHAT" = vocab ]; then
  for t in test_cuda_ops test_gpu_model; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 "$B/bin/$t" > "$OUT/$t.log" 2>&1
    echo "$t rc=$?" >> "$OUT/$t.log"
  done
  run one 0 24 "${small[@]}"
  run tp2 0,1 24 "${small[@]}" --nproc 2 --set parallel.tp=2
  run tp2-vp 0,1 24 "${small[@]}" --nproc 2 --set parallel.tp=2 --set parallel.vocab_parallel=true
  run tp2-vp-sp 0,1 24 "${small[@]}" --nproc 2 --set parallel.tp=2 --set parallel.vocab_parallel=true \
    --set parallel.sequence_parallel=true
  run 1.3b-one 0 10 "${big[@]}"
  run 1.3b-tp2 0,1 10 "${big[@]}" --nproc 2 --set parallel.tp=2
  run 1.3b-tp2-vp 0,1 10 "${big[@]}" --nproc 2 --set parallel.tp=2 --set parallel.vocab_parallel=true
fi

if [ "$WHAT" = tune ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 "$B/bin/test_cuda_ops" > "$OUT/test_cuda_ops.log" 2>&1
  echo "test_cuda_ops rc=$?" >> "$OUT/test_cuda_ops.log"
  run one 0 30 "${small[@]}"
  run one-tuned 0 30 "${small[@]}" --set backend.gemm_autotune=true
  run 1.3b-one 0 12 "${big[@]}"
  run 1.3b-tuned 0 12 "${big[@]}" --set backend.gemm_autotune=true
fi

if [ "$WHAT" = equiv ]; then
  run one 0 24 "${small[@]}"
  run eq-dp2 0,1 24 "${small[@]}" --nproc 2
  run eq-dp4 0,1,2,3 24 "${small[@]}" --nproc 4
  run eq-tp2dp2 0,1,2,3 24 "${small[@]}" --nproc 4 --set parallel.tp=2
  run eq-tp2dp2-vp 0,1,2,3 24 "${small[@]}" --nproc 4 --set parallel.tp=2 --set parallel.vocab_parallel=true
  # MPI: the plugin built against this machine's MPI when it has mpicxx, else the packaged one.
  plugin="$PWD/$B/lib/libkiln_mpi_bootstrap.so"
  if command -v mpicxx > /dev/null; then
    mpicxx -shared -fPIC -O2 modules/parallel/mpi/kiln_mpi_bootstrap.cpp -o /tmp/libkiln_mpi_bootstrap.so \
      > "$OUT/mpi-build.log" 2>&1 && plugin=/tmp/libkiln_mpi_bootstrap.so
  fi
  { echo "mpirun: $(command -v mpirun) $(mpirun --version 2>&1 | head -1); plugin $plugin"; } > "$OUT/mpi.log"
  mpi_args=(-np 2)
  if mpirun --version 2>&1 | grep -q "Open MPI"; then
    mpi_args+=(--allow-run-as-root -x LD_LIBRARY_PATH -x KILN_MPI_BOOTSTRAP -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES)
  fi
  (unset MASTER_ADDR MASTER_PORT; export CUDA_VISIBLE_DEVICES=0,1 KILN_MPI_BOOTSTRAP=$plugin
   timeout 120 mpirun "${mpi_args[@]}" "$K" run "${small[@]}" --set train.steps=12 --set log.metrics="$OUT/mpi2.jsonl") \
    >> "$OUT/mpi.log" 2>&1
  echo "mpirun rc=$?" >> "$OUT/mpi.log"
fi

# ---- Phase B
t0=$(date +%s)
modes=("none|" "attn|--set activation_checkpoint.mode=selective --set activation_checkpoint.selective=attention"
       "mlp|--set activation_checkpoint.mode=selective --set activation_checkpoint.selective=mlp"
       "full|--set activation_checkpoint.mode=full")
cap_gib=$(nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print $1/1024 - 1.5}')
ckpt() {
  for m in "${modes[@]}"; do
    local tag=${m%%|*}
    local args=${m#*|}
    # shellcheck disable=SC2086
    run "ck-124m-$tag" 0 24 "${small[@]}" $args
    # shellcheck disable=SC2086
    run "ck-1.3b-$tag" 0 10 "${big[@]}" $args
  done
}
# The largest batch: peak = fixed + batch x (activation memory per sequence); run the prediction.
maxbatch() {  # model mode-index gpu
  local model=$1 m=${modes[$2]} gpu=$3
  local tag=${m%%|*}
  local args=${m#*|}
  local f="$OUT/ck-$model-$tag.log"
  local batch act peak bmax
  batch=$([ "$model" = 124m ] && echo 16 || echo 8)
  act=$(grep -oE 'activation memory [0-9.]+' "$f" | awk '{print $3}')
  peak=$(grep -oE 'peak device memory [0-9.]+' "$f" | awk '{print $4}')
  if [ -z "$act" ] || [ -z "$peak" ]; then return; fi
  bmax=$(python3 -c "print(min(512, int(($cap_gib - ($peak - $act)) / ($act / $batch))))")  # 512: bounded run time
  local pipe=("${small[@]}")
  [ "$model" = 1.3b ] && pipe=("${big[@]}")
  # shellcheck disable=SC2086
  run "max-$model-$tag" "$gpu" 2 "${pipe[@]}" $args --set train.batch_size="$bmax"
  echo "predicted max batch $bmax (capacity $cap_gib GiB, fixed $(python3 -c "print(round($peak-$act,2))") GiB)" >> "$OUT/max-$model-$tag.log"
}
maxbatches() {
  for gpu in 0 1 2 3; do
    (maxbatch 124m "$gpu" "$gpu"; maxbatch 1.3b "$gpu" "$gpu") &
  done
  wait
}
tests() {
  for t in test_gpu_recompute test_gpu_model test_cuda_fp8; do
    CUDA_VISIBLE_DEVICES=1 timeout 150 "$B/bin/$t" > "$OUT/$t.log" 2>&1
    echo "$t rc=$?" >> "$OUT/$t.log"
  done
}
dist() {
  local d=(--set model.dropout=0.1 --nproc 2 --set parallel.tp=2)
  run tp2-drop 2,3 12 "${small[@]}" "${d[@]}"
  run tp2-drop-full-dist 2,3 12 "${small[@]}" "${d[@]}" --set activation_checkpoint.mode=full \
    --set activation_checkpoint.distribute_saved_activations=true
  run tp2-drop-attn-dist 2,3 12 "${small[@]}" "${d[@]}" --set activation_checkpoint.mode=selective \
    --set activation_checkpoint.distribute_saved_activations=true
}
if [ "$WHAT" = vocab ] || [ "$WHAT" = equiv ] || [ "$WHAT" = tune ]; then
  :
elif [ "$WHAT" = all ]; then
  (ckpt; maxbatch 124m 0 0; maxbatch 124m 1 0; maxbatch 124m 2 0; maxbatch 124m 3 0
   maxbatch 1.3b 0 0; maxbatch 1.3b 1 0; maxbatch 1.3b 2 0; maxbatch 1.3b 3 0) & p1=$!
  tests & p2=$!
  dist & p3=$!
  wait $p1 $p2 $p3
else
  ckpt
  maxbatches
  dist
fi
echo "phase B: $(( $(date +%s) - t0 )) s" >> "$LOG"

# ---- Summary
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib, re
out = pathlib.Path(sys.argv[1])
def rows(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
def text(n):
    p = out / f"{n}.log"
    return p.read_text() if p.exists() else ""
def mem(n):
    m = re.search(r"peak device memory ([0-9.]+)", text(n)); return m.group(1) if m else "-"
def act(n):
    m = re.search(r"activation memory ([0-9.]+)", text(n)); return m.group(1) if m else "-"
def med(n, k):
    r = rows(n); st = r[len(r) // 3:] or r
    return statistics.median(x[k] for x in st) if st else float("nan")
print(f"{'run':<22} {'tok/s':>10} {'per GPU':>9} {'ms/step':>8} {'GiB':>6} {'act GiB':>7} {'loss rel diff':>14}")
ref = {"one": rows("one")}
for n, g, base in [("one", 1, None), ("dp2", 2, None), ("dp2-nobucket", 2, None), ("dp4", 4, None),
                   ("dp4-nobucket", 4, None), ("tp4", 4, "one"),
                   ("ck-124m-none", 1, None), ("ck-124m-attn", 1, "ck-124m-none"), ("ck-124m-mlp", 1, "ck-124m-none"),
                   ("ck-124m-full", 1, "ck-124m-none"), ("ck-1.3b-none", 1, None), ("ck-1.3b-attn", 1, "ck-1.3b-none"),
                   ("ck-1.3b-mlp", 1, "ck-1.3b-none"), ("ck-1.3b-full", 1, "ck-1.3b-none"),
                   ("tp2-drop", 2, None), ("tp2-drop-full-dist", 2, "tp2-drop"), ("tp2-drop-attn-dist", 2, "tp2-drop"),
                   ("tp2", 2, "one"), ("tp2-vp", 2, "one"), ("tp2-vp-sp", 2, "one"), ("1.3b-one", 1, None),
                   ("1.3b-tp2", 2, "1.3b-one"), ("1.3b-tp2-vp", 2, "1.3b-one"),
                   ("eq-dp2", 2, "one"), ("eq-dp4", 4, "one"), ("eq-tp2dp2", 4, "one"), ("eq-tp2dp2-vp", 4, "one"),
                   ("mpi2", 2, "one"), ("one-tuned", 1, "one"), ("1.3b-tuned", 1, "1.3b-one")]:
    r = rows(n)
    if not r:
        if text(n):
            print(f"{n:<22} (no metrics) {text(n)[-300:]!r}")
        continue
    tps, ms = med(n, "tokens_per_s"), med(n, "step_ms")
    d = "-"
    if base and rows(base):
        d = f"{max(abs(a['loss'] - b['loss']) / b['loss'] for a, b in zip(r, rows(base))):.2e}"
        if n.startswith("eq-"):
            d += f" norm {max(abs(a['grad_norm'] - b['grad_norm']) / b['grad_norm'] for a, b in zip(r, rows(base))):.1e}"
    print(f"{n:<22} {tps:>10,.0f} {tps / g:>9,.0f} {ms:>8.2f} {mem(n):>6} {act(n):>7} {d:>14}")
for n in sorted(p.stem for p in out.glob("max-*.log")):
    t = text(n)
    ok = "rc=0" in t
    m = re.search(r"predicted max batch (\d+)", t)
    print(f"{n:<22} batch {m.group(1) if m else '?':>4}: {'fits' if ok else 'FAILED'}, peak {mem(n)} GiB")
for t in ["test_gpu_recompute", "test_gpu_model", "test_cuda_fp8", "test_cuda_ops"]:
    m = re.findall(r"\[doctest\] test cases.*", text(t))
    if text(t):
        print(f"{t}: {m[-1] if m else 'no result'}")
if text("mpi"):
    print("mpi:", " | ".join(l for l in text("mpi").splitlines() if l.startswith(("mpirun", "kiln:", "done", "step 12"))))
c = text("collectives4")
if c:
    print("collectives (4 GPUs):"); print("\n".join(c.strip().splitlines()[-16:]))
PY
# The device returns at most 8 files: fold the logs into one.
for f in "$OUT"/*.log; do echo "===== $(basename "$f")"; cat "$f"; done >> "$LOG"
rm -f "$OUT"/*.log
mkdir -p "$OUT/metrics" && mv "$OUT"/*.jsonl "$OUT/metrics/" 2>/dev/null
tar -C "$OUT" -czf "$OUT/metrics.tgz" metrics && rm -rf "$OUT/metrics"

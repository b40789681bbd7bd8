#!/usr/bin/env bash
# Issue 18's runs on every visible GPU (nvidia-h200-x2 or -x4), building nothing; a table last.
#   fsdp   bench/gpu_fsdp.sh: every FSDP strategy, bf16 and FP8, 124M and 1.3B, against one GPU and
#          (TORCH=1) PyTorch FSDP2 on the same GPUs
#   tp     1.3B on one GPU against TP=2, each with backend.profile (the per-op breakdown)
#   equiv  gpt2-124m with the same global batch (16) on 1 GPU, as DP, FSDP full_shard and
#          shard_grad_op on all GPUs, TP=2 (x DP=2 on 4): losses and gradient norms over 50 steps
#   ckpt   checkpoints: FSDP full_shard and TP=2 stopped at step 6 and resumed on the same GPUs
#          (steps 7-12 against an uninterrupted run, deterministic attention), the same checkpoints
#          loaded on one GPU (resharded); the 1.3B training state saved async and sync on all GPUs
#   fail   a rank killed with SIGKILL during FSDP training (its all-gathers) and during a checkpoint
#          save; the survivors must stop naming it, and the last complete checkpoint must load
#   big    (issue 25, four or more GPUs) a ~20 B Llama (d6144, 48 blocks, 48 query / 8 key-value heads,
#          SwiGLU 16384: 19.35 B parameters) with FSDP full_shard over every GPU, deferred init and
#          every block recomputed, bf16 and FP8 delayed, 8 steps of 4 x 2048 tokens per GPU
# STRATEGIES (default "full_shard shard_grad_op") picks the fsdp part's strategies; EQUIV4=1 runs only
# the equivalence part's one-GPU baselines and its four-GPU rows.
# usage: bash bench/gpu_multi.sh BUILD_DIR [all|fsdp|tp|equiv|ckpt|fail]...   (logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
shift || true
PARTS=${*:-all}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
N=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$N" -ge 2 ] || { echo "gpu_multi.sh: needs two or more GPUs, sees $N"; exit 1; }
W=${WORK:-/tmp/kiln-multi}
rm -rf "$W"
mkdir -p "$W"
LOG="$OUT/multi-logs.txt"
: > "$LOG"
nvidia-smi --query-gpu=index,name,memory.total --format=csv >> "$LOG"
# BUDGET=S: a part starts only while fewer than S seconds have passed minus its usual length (the
# device tool stops a command at 600 s; the summary must still print).
BUDGET=${BUDGET:-100000}
declare -A PART_S=([fsdp]=420 [tp]=100 [equiv]=150 [ckpt]=260 [fail]=150 [big]=200)
want() {
  [[ " $PARTS " == *" all "* || " $PARTS " == *" $1 "* ]] || return 1
  if [ $((SECONDS + PART_S[$1])) -gt "$BUDGET" ]; then
    note "part $1 skipped: $SECONDS s gone of the $BUDGET s budget, it takes about ${PART_S[$1]} s"
    return 1
  fi
}
notes=()
note() { notes+=("$1"); echo "$1"; }

small=(pipelines/gpt2-124m.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
       --set log.every=5 --set parallel.timeout_s=60)
big=(pipelines/gpt-1.3b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
     --set log.every=2 --set parallel.timeout_s=60)
all_gpus=$(seq -s, 0 $((N - 1)))
# run NAME GPUS STEPS ARGS... : one kiln run on the listed GPUs, its output in $W/NAME.log.
run() {
  local name=$1 gpus=$2 steps=$3
  shift 3
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpus timeout 300 "$K" run "$@" --set train.steps="$steps" \
    --set log.metrics="$OUT/$name.jsonl" > "$W/$name.log" 2>&1
  local rc=$?
  { echo "===== $name (GPUs $gpus) rc=$rc, $((SECONDS - t0)) s"; cat "$W/$name.log"; } >> "$LOG"
  echo "$name rc=$rc ($((SECONDS - t0)) s)"
  return $rc
}
# losses NAME [FIRST]: "step loss" lines of a run's metrics from step FIRST on.
losses() { python3 -c "
import json, sys
for l in open('$OUT/$1.jsonl'):
    r = json.loads(l)
    if r['step'] >= ${2:-0}: print(r['step'], repr(r['loss']))" 2>/dev/null; }
# pid of rank R under launcher L
rank_pid() {
  local pid
  for pid in $(pgrep -P "$1"); do
    tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$pid"; return; }
  done
}

# ---------------------------------------------------------------- big
if [ "$N" -ge 4 ] && want big; then
  # 19.35 B x 16 bytes (f32 weights, gradients, AdamW moments) / N per rank: 77 GB on four GPUs.
  b20=(pipelines/llama-8b.toml --set model.n_layer=48 --set model.n_embd=6144 --set model.n_head=48 --set model.n_kv_head=8
       --set model.ffn_hidden=16384 --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
       --set log.every=1 --set parallel.timeout_s=600 --set checkpoint.every=0 --set checkpoint.at_end=false
       --set checkpoint.resume=never --set train.batch_size=$((4 * N)) --set fsdp.strategy=full_shard
       --set activation_checkpoint.mode=full)
  run big-20b-bf16 "$all_gpus" 8 "${b20[@]}" --nproc "$N" --set fp8.enabled=false
  run big-20b-fp8 "$all_gpus" 8 "${b20[@]}" --nproc "$N" --set fp8.enabled=true
  for n in big-20b-bf16 big-20b-fp8; do
    note "$n: $(grep -hE 'holds 1/|^model' "$W/$n.log" | head -3 | tr '\n' ';' | cut -c1-600)"
  done
fi

# ---------------------------------------------------------------- fsdp
if want fsdp; then
  OUT="$OUT" STRATEGIES="${STRATEGIES:-full_shard shard_grad_op}" ONE_FSDP=0 bash bench/gpu_fsdp.sh "$B" 20 > "$W/fsdp-summary.txt" 2>&1
  cat "$OUT/fsdp-logs.txt" >> "$LOG" && rm -f "$OUT/fsdp-logs.txt" "$OUT/memory.txt"
  note "fsdp: $(sed -n '/FSDP summary/,$p' "$W/fsdp-summary.txt" | head -1)"
  sed -n '/FSDP summary/,$p' "$W/fsdp-summary.txt" | tail -n +2 > "$W/fsdp-table.txt"
fi

# ---------------------------------------------------------------- tp
if want tp; then
  run tp-1.3b-one 0 12 "${big[@]}" --set backend.profile=true
  run tp-1.3b-tp2 0,1 12 "${big[@]}" --set backend.profile=true --nproc 2 --set parallel.tp=2
  run tp-1.3b-tp2-sp 0,1 12 "${big[@]}" --nproc 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
fi

# ---------------------------------------------------------------- equiv
if want equiv; then
  eq=("${small[@]}" --set backend.attention_deterministic=true)
  run eq-one 0 50 "${eq[@]}"
  if [ "${EQUIV4:-0}" != 1 ]; then
    run eq-dp 0,1 50 "${eq[@]}" --nproc 2
    run eq-fsdp-full 0,1 50 "${eq[@]}" --nproc 2 --set fsdp.strategy=full_shard
    run eq-fsdp-grad 0,1 50 "${eq[@]}" --nproc 2 --set fsdp.strategy=shard_grad_op
    run eq-fsdp-full-fp8 0,1 50 "${eq[@]}" --nproc 2 --set fsdp.strategy=full_shard --set fp8.enabled=true
    run eq-one-fp8 0 50 "${eq[@]}" --set fp8.enabled=true
    run eq-tp2 0,1 50 "${eq[@]}" --nproc 2 --set parallel.tp=2
  fi
  if [ "$N" -ge 4 ]; then
    run eq-fsdp4-full 0,1,2,3 50 "${eq[@]}" --nproc 4 --set fsdp.strategy=full_shard
    run eq-tp2-fsdp2 0,1,2,3 50 "${eq[@]}" --nproc 4 --set parallel.tp=2 --set fsdp.strategy=full_shard
  fi
fi

# ---------------------------------------------------------------- ckpt
if want ckpt; then
  ck=("${small[@]}" --set backend.attention_deterministic=true --set log.every=1 --set checkpoint.every=6)
  for layout in "fsdp|--set fsdp.strategy=full_shard" "tp2|--set parallel.tp=2"; do
    tag=${layout%%|*}
    # shellcheck disable=SC2206
    args=(${layout#*|})
    run "ck-$tag-straight" "$all_gpus" 12 "${ck[@]}" --nproc "$N" "${args[@]}" --set checkpoint.dir="$W/ck-$tag-a"
    run "ck-$tag-stop" "$all_gpus" 12 "${ck[@]}" --nproc "$N" "${args[@]}" --set checkpoint.dir="$W/ck-$tag-b" \
      --set train.exit_interval=6
    run "ck-$tag-resumed" "$all_gpus" 12 "${ck[@]}" --nproc "$N" "${args[@]}" --set checkpoint.dir="$W/ck-$tag-b" \
      --set checkpoint.at_end=false
    if diff -q <(losses "ck-$tag-straight" 7) <(losses "ck-$tag-resumed" 7) > /dev/null &&
       [ "$(losses "ck-$tag-resumed" 7 | wc -l)" = 6 ]; then
      note "ckpt $tag on $N GPUs: steps 7-12 after the resume bit-identical to the uninterrupted run"
    else
      note "ckpt $tag on $N GPUs: steps 7-12 after the resume DIFFER: $(losses "ck-$tag-straight" 7 | tr '\n' ' ') vs $(losses "ck-$tag-resumed" 7 | tr '\n' ' ')"
    fi
    for g in 1 2; do
      [ "$g" -lt "$N" ] || continue
      gl=$(seq -s, 0 $((g - 1)))
      run "ck-$tag-on$g" "$gl" 12 "${ck[@]}" --nproc "$g" --set checkpoint.dir="$W/ck-$tag-on$g" \
        --set checkpoint.resume="$W/ck-$tag-b/step_000006" --set checkpoint.at_end=false
      note "ckpt $tag saved on $N GPUs, loaded on $g: $(grep -m1 -o 'checkpoint: resumed.*' "$W/ck-$tag-on$g.log" | cut -c1-160); max rel loss diff steps 7-12 vs $N GPUs: $(python3 -c "
a = dict(l.split() for l in '''$(losses "ck-$tag-straight" 7)'''.splitlines())
b = dict(l.split() for l in '''$(losses "ck-$tag-on$g" 7)'''.splitlines())
print(f'{max(abs(float(a[k]) - float(b[k])) / float(a[k]) for k in b):.2e}' if b else 'no steps')")"
    done
    rm -rf "$W/ck-$tag-"*/
  done
  dd_line=$(dd if=/dev/zero of="$W/dd.bin" bs=64M count=160 conv=fsync 2>&1 | tail -1)
  rm -f "$W/dd.bin"
  note "disk of $W: $(df -h "$W" | tail -1 | awk '{print $1, $2}'); dd 10 GiB with fsync: $dd_line"
  for mode in async sync; do
    run "ck-1.3b-$mode" "$all_gpus" 6 "${big[@]}" --nproc "$N" --set fsdp.strategy=full_shard --set log.every=1 \
      --set checkpoint.dir="$W/big-$mode" --set checkpoint.every=3 --set checkpoint.keep=1 \
      --set checkpoint.async=$([ $mode = async ] && echo true || echo false)
    note "1.3B full_shard on $N GPUs, $mode saves: $(grep -hE '^(\[rank 0\] )?checkpoint: (saved|host staging)' "$W/ck-1.3b-$mode.log" | tr '\n' ';' | cut -c1-600)"
    note "    step ms: $(grep -o '"step_ms":[0-9.]*' "$OUT/ck-1.3b-$mode.jsonl" | cut -d: -f2 | cut -d. -f1 | tr '\n' ' ')"
  done
  run ck-1.3b-load "$all_gpus" 7 "${big[@]}" --nproc "$N" --set fsdp.strategy=full_shard \
    --set checkpoint.dir="$W/big-sync" --set checkpoint.at_end=false
  note "1.3B full_shard on $N GPUs, load: $(grep -m1 -o 'checkpoint: resumed.*' "$W/ck-1.3b-load.log")"
  du -sh "$W"/big-sync/step_* >> "$LOG" 2>&1
  rm -rf "$W"/big-*
fi

# ---------------------------------------------------------------- fail
# kill_rank NAME DIR_TO_WAIT_FOR|STEP_PATTERN ARGS...: start a job on every GPU, SIGKILL rank 1 once
# the pattern shows in its log (or the directory exists), report how long the others took to stop.
kill_rank() {
  local name=$1 trigger=$2
  shift 2
  local log="$W/$name.log"
  CUDA_VISIBLE_DEVICES=$all_gpus "$K" run "$@" --nproc "$N" > "$log" 2>&1 &
  local launcher=$! victim="" i
  for i in $(seq 1 600); do
    sleep 0.2
    if [[ $trigger == /* ]]; then [ -e "$trigger" ] && break; else grep -qE "$trigger" "$log" && break; fi
    kill -0 "$launcher" 2>/dev/null || break
  done
  [[ $trigger == /* ]] && sleep 1  # well inside the save
  victim=$(rank_pid "$launcher" 1)
  local t0
  t0=$(date +%s.%N)
  [ -n "$victim" ] && kill -9 "$victim"
  local waited=0
  while kill -0 "$launcher" 2>/dev/null && [ $waited -lt 600 ]; do sleep 0.1; waited=$((waited + 1)); done
  kill -9 "$launcher" 2>/dev/null
  wait "$launcher"
  local rc=$?
  local took
  took=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))")
  { echo "===== $name rc=$rc"; cat "$log"; } >> "$LOG"
  note "fail $name: rank 1 (pid ${victim:-none}) killed; launcher exit $rc after $took s; $(grep -vE '^(\[rank [0-9]+\] )?(step|model|checkpoint: saved)' "$log" | grep -iE 'rank 1|killed|collective' | head -3 | tr '\n' ' ' | cut -c1-500)"
}
if want fail; then
  kill_rank fail-fsdp "step +8/" "${small[@]}" --set train.steps=100000 --set log.every=1 --set fsdp.strategy=full_shard
  kill_rank fail-save "$W/fail-ck/step_000004.tmp" "${big[@]}" --set train.steps=100000 --set log.every=1 \
    --set fsdp.strategy=full_shard --set checkpoint.dir="$W/fail-ck" --set checkpoint.every=2
  ls -la "$W/fail-ck" >> "$LOG" 2>&1
  note "fail-save: left in the checkpoint folder: $(ls "$W/fail-ck" 2>/dev/null | tr '\n' ' ')"
  run fail-resume "$all_gpus" 3 "${big[@]}" --nproc "$N" --set fsdp.strategy=full_shard \
    --set checkpoint.dir="$W/fail-ck" --set checkpoint.at_end=false
  note "fail-resume rc=$?: $(grep -m1 -o 'checkpoint: resumed.*' "$W/fail-resume.log")"
  rm -rf "$W/fail-ck"
  bash tests/reliability/gpu_rank_killed_test.sh "$PWD/$K" > "$W/gpu-killed-test.log" 2>&1
  note "tests/reliability/gpu_rank_killed_test.sh rc=$?: $(tail -1 "$W/gpu-killed-test.log")"
  cat "$W/gpu-killed-test.log" >> "$LOG"
fi

# ---------------------------------------------------------------- summary
echo "================ issue 18 runs on $N GPUs ================"
[ -s "$W/fsdp-table.txt" ] && cat "$W/fsdp-table.txt"
python3 - "$OUT" "$W" <<'PY'
import json, re, statistics, sys, pathlib
out, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def rows(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
def text(n):
    p = work / f"{n}.log"
    return p.read_text() if p.exists() else ""
def mem(n):
    m = re.findall(r"peak device memory ([0-9.]+)", text(n)); return max(m, key=float) if m else "-"
printed = False
for n, g, base in [("tp-1.3b-one", 1, None), ("tp-1.3b-tp2", 2, "tp-1.3b-one"), ("tp-1.3b-tp2-sp", 2, "tp-1.3b-one"),
                   ("eq-one", 1, None), ("eq-dp", 2, "eq-one"), ("eq-fsdp-full", 2, "eq-one"),
                   ("eq-fsdp-grad", 2, "eq-one"), ("eq-tp2", 2, "eq-one"), ("eq-one-fp8", 1, None),
                   ("eq-fsdp-full-fp8", 2, "eq-one-fp8"), ("eq-fsdp4-full", 4, "eq-one"), ("eq-tp2-fsdp2", 4, "eq-one"),
                   ("big-20b-bf16", 4, None), ("big-20b-fp8", 4, None)]:
    r = rows(n)
    if not r:
        if text(n): print(f"{n:<18} (no metrics) {text(n)[-300:]!r}")
        continue
    if not printed:
        print(f"{'run':<18} {'GPUs':>4} {'tok/s per GPU':>13} {'of 1 GPU':>8} {'ms/step':>8} {'GiB/GPU':>7} {'loss rel diff':>13} {'norm rel diff':>13}")
        printed = True
    st = r[len(r) // 3:] or r
    tps = statistics.median(x["tokens_per_s"] for x in st) / g
    ms = statistics.median(x["step_ms"] for x in st)
    share, dl, dn = "-", "-", "-"
    if base and rows(base):
        b = rows(base)
        bs = b[len(b) // 3:] or b
        share = f"{100 * tps / statistics.median(x['tokens_per_s'] for x in bs):.0f}%"
        dl = f"{max(abs(x['loss'] - y['loss']) / y['loss'] for x, y in zip(r, b)):.1e}"
        if "grad_norm" in r[0]:
            dn = f"{max(abs(x['grad_norm'] - y['grad_norm']) / y['grad_norm'] for x, y in zip(r, b)):.1e}"
    print(f"{n:<18} {g:>4} {tps:>13,.0f} {share:>8} {ms:>8.2f} {mem(n):>7} {dl:>13} {dn:>13}")
for n in ("big-20b-bf16", "big-20b-fp8"):
    r = rows(n)
    if r:
        st = r[len(r) // 4:] or r
        print(f"{n}: MFU {100 * statistics.median(x['mfu'] for x in st):.1f}% (kiln's model FLOPs / 989.4 TFLOP/s a GPU)")
for n in ("tp-1.3b-one", "tp-1.3b-tp2"):
    t = text(n)
    i = t.find("op time breakdown")
    if i >= 0:
        print(f"--- {n}: profile"); print("\n".join(t[i:].splitlines()[:40]))
PY
printf '%s\n' "${notes[@]}"
mkdir -p "$OUT/metrics" && mv "$OUT"/*.jsonl "$OUT/metrics/" 2>/dev/null
tar -C "$OUT" -czf "$OUT/multi-metrics.tgz" metrics && rm -rf "$OUT/metrics"
rm -rf "$W"

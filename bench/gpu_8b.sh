#!/usr/bin/env bash
# Issue 25's two-GPU runs in one call, building nothing (kind nvidia-h200-x2, or -x4: there the kiln
# lane runs on GPUs 0-1 while the PyTorch lane runs on GPUs 2-3 at the same time; with two GPUs
# the lanes run one after the other). A table last.
#   bench   pipelines/llama-8b.toml (7.39 B parameters) under FSDP full_shard on two GPUs, deferred
#           init, bf16 and FP8 delayed, every block recomputed and none: tokens/s per GPU, ms/step,
#           MFU, peak memory, what each rank holds at start
#   ckpt    the 8 B training state (f32 master + AdamW moments + FP8 state, 88.7 GB) saved async at
#           step 3 of 5, then a second run resumed from it: steps 4-5 must equal the first run's
#           bit for bit (FP8 delayed, deterministic attention)
#   torch   PyTorch 2.11 FSDP2 on the same model and batch (bench/torch_fsdp2_llama.py: fully_shard
#           per block, bf16 parameters, fp32 reduction, compiled blocks, fused AdamW), with and
#           without activation checkpointing
#   variants (not in all) bf16 with all but the last LAST (default 8) blocks recomputed
#           (activation_checkpoint.first: what fits beside PyTorch's activation-checkpointed memory), with
#           fp32 and with bf16 gradient reduce-scatters; CE=1 adds copy-engine collectives
#           (parallel.copy_engine), every block and all but the last LAST recomputed; RBF16=1 adds
#           bf16 reduce-scatters; OFFLOAD="B:F:S ..." adds runs with B blocks' activations in host
#           memory (activation_offload, S device slots) and the other blocks below F recomputed;
#           PIPELINE=1 adds bf16 and FP8 runs with the pipeline's own activation settings (half the
#           blocks offloaded, the other half recomputed); FP8OFF="B:E ..." adds FP8 runs with B blocks
#           every E offloaded and the others recomputed
#   trace   (not in all) the 8 B bf16 and FP8 steps under bench/trace's CUPTI tracer, summarised per
#           rank: busy and idle GPU time, per-stream busy time, exposed communication, kernels
#   loss1b  the time to a loss for Llama 1B (pipelines/llama-1b.toml, data parallel, 8 x 2048 tokens a
#           step) on the same tokens, bf16 and FP8 (TTL1B_STEPS, default 300)
#   moe     (issue 26) pipelines/moe-1b.toml in FP8 on one GPU against parallel.ep = 2 on two (the
#           experts split, tokens moved by all-to-all), and a profiled ep = 2 run (per-op breakdown)
#   loss    the time to a loss: the headline pipeline's model (pipelines/fsdp-fp8.toml with GPT-2's
#           BPE vocabulary) on the Brown GPT-2 tokens (data/brown-gpt2, carried) for a fixed number
#           of tokens, bf16 and FP8, validation every 25 steps; plot locally with
#           kiln plot $OUT/ttl-bf16.jsonl=bf16 $OUT/ttl-fp8.jsonl=FP8 --x elapsed_s --y val_loss -o ...
# usage: bash bench/gpu_8b.sh BUILD_DIR [all|bench|ckpt|torch|loss|loss1b|moe|trace]...   (logs under $OUT)
# SMALL=1 shrinks the model to two blocks of d256 and runs everything on the CPU (two thread ranks):
# a rehearsal of the script's commands and checks on a machine without GPUs.
set -uo pipefail
B=${1:-.devbuild}
shift || true
PARTS=" ${*:-all} "
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
W=${WORK:-/tmp/kiln-8b}
rm -rf "$W"
mkdir -p "$W"
want() { [[ ($PARTS == *" all "* && $1 != trace && $1 != variants) || $PARTS == *" $1 "* ]]; }
# DEADLINE: no run starts later than this many seconds into the call, and none runs past HARD (the
# device tool stops a command at 600 s; the summary must still print).
DEADLINE=${DEADLINE:-540}
HARD=${HARD:-570}
cap() { local left=$((HARD - SECONDS)); echo $(($1 < left ? $1 : left)); }

if [ "${SMALL:-0}" = 1 ]; then
  N=0
  STEPS=${STEPS:-6}
  s8=(--set engine.device=cpu --set model.n_layer=2 --set model.n_embd=256 --set model.n_head=8 --set model.n_kv_head=2
      --set model.ffn_hidden=512 --set train.seq_len=64 --set model.max_seq_len=64 --set activation_offload.blocks=1)
  sttl=(--set engine.device=cpu --set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set train.seq_len=64
        --set model.max_seq_len=64 --set model.moe.n_experts=4)
  smoe=(--set engine.device=cpu --set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set model.n_kv_head=2
        --set train.seq_len=64 --set model.max_seq_len=64 --set model.moe.hidden=128)
  TTL_STEPS=${TTL_STEPS:-20}
  lane_a="" lane_b=""
else
  N=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$N" -ge 2 ] || { echo "gpu_8b.sh: needs two GPUs, sees $N"; exit 1; }
  STEPS=${STEPS:-12}
  s8=() sttl=() smoe=()
  lane_a=0,1
  lane_b=$([ "$N" -ge 4 ] && echo 2,3 || echo 0,1)
fi
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>/dev/null; df -h /tmp | tail -1; } > "$OUT/machine.txt"

# run NAME GPUS TIMEOUT ARGS... : one kiln command, its output in $OUT/NAME.log.
run() {
  local name=$1 gpus=$2 limit=$3
  shift 3
  if [ "$SECONDS" -gt "$DEADLINE" ]; then echo "$name skipped: $SECONDS s gone" | tee "$OUT/$name.log"; return 1; fi
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpus timeout "$(cap "$limit")" "$K" run "$@" --set log.metrics="$OUT/$name.jsonl" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc, $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  return $rc
}
k8=(pipelines/llama-8b.toml --nproc 2 "${s8[@]}" --set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0
    --set log.every=1 --set parallel.timeout_s=600 --set checkpoint.every=0 --set checkpoint.at_end=false
    --set checkpoint.resume=never)

lane_kiln() {
  if want bench; then
    for prec in bf16 fp8; do
      for ac in full none; do
        run "8b-$prec-$ac" "$lane_a" 240 "${k8[@]}" --set train.steps="$STEPS" --set fp8.enabled=$([ $prec = fp8 ] && echo true || echo false) \
          --set activation_checkpoint.mode=$ac --set activation_offload.blocks=0
      done
    done
  fi
  if want variants; then
    local first=$((32 - ${LAST:-8})) ce=(--set parallel.copy_engine=true)
    [ "${SMALL:-0}" = 1 ] && first=1
    local v=("${k8[@]}" --set train.steps="$STEPS" --set fp8.enabled=false --set activation_checkpoint.mode=full
             --set activation_offload.blocks=0)
    # FP8OFF="B:E ...": FP8 with B blocks every E offloaded (two slots), the others recomputed
    for o in ${FP8OFF:-}; do
      IFS=: read -r ob oe <<< "$o"
      [ "${SMALL:-0}" = 1 ] && { ob=1; oe=1; }
      run "8b-fp8-off$ob-every$oe" "$lane_a" 240 "${k8[@]}" --set train.steps="$STEPS" --set fp8.enabled=true \
        --set activation_checkpoint.mode=full --set activation_offload.blocks="$ob" --set activation_offload.every="$oe"
    done
    if [ "${PIPELINE:-0}" = 1 ]; then  # the pipeline's own activation settings (offload and recompute)
      run 8b-bf16-pipeline "$lane_a" 240 "${k8[@]}" --set train.steps="$STEPS" --set fp8.enabled=false
      run 8b-fp8-pipeline "$lane_a" 240 "${k8[@]}" --set train.steps="$STEPS" --set fp8.enabled=true
    fi
    if [ "${CE:-0}" = 1 ]; then
      run 8b-bf16-full-ce "$lane_a" 240 "${v[@]}" "${ce[@]}"
      run "8b-bf16-first$first-ce" "$lane_a" 240 "${v[@]}" "${ce[@]}" --set activation_checkpoint.first=$first
    fi
    run "8b-bf16-first$first" "$lane_a" 240 "${v[@]}" --set activation_checkpoint.first=$first
    if [ "${RBF16:-0}" = 1 ]; then
      run "8b-bf16-first$first-rbf16" "$lane_a" 240 "${v[@]}" --set activation_checkpoint.first=$first \
        --set fsdp.reduce_dtype=bf16
    fi
    # OFFLOAD="B:F:S ...": blocks 0, 2, ..., 2(B-1) keep their saved activations in host memory over S
    # device slots (activation_offload), the other blocks below F recomputed, the rest kept.
    for o in ${OFFLOAD:-}; do
      IFS=: read -r ob of os <<< "$o"
      [ "${SMALL:-0}" = 1 ] && { ob=1; of=2; os=1; }
      run "8b-bf16-off$ob-first$of-s$os" "$lane_a" 240 "${v[@]}" --set activation_checkpoint.first="$of" \
        --set activation_offload.blocks="$ob" --set activation_offload.every=2 --set activation_offload.slots="$os"
    done
  fi
  if want trace; then  # the GPU's timeline of both ranks (bench/trace), then its summary per rank
    for prec in bf16 fp8; do
      CUDA_INJECTION64_PATH=$PWD/$B/lib/libkiln_trace.so KILN_TRACE="$W/t-$prec-{rank}.csv" \
        run "trace-8b-$prec" "$lane_a" 240 "${k8[@]}" --set train.steps=6 --set fp8.enabled=$([ $prec = fp8 ] && echo true || echo false)
      for r in 0 1; do
        python3 bench/trace/summary.py "$W/t-$prec-$r.csv" --steps 6 --skip 3 --top 25 > "$OUT/trace-8b-$prec-rank$r.txt" 2>&1
      done
      rm -f "$W"/t-$prec-*.csv
    done
  fi
  if want ckpt; then
    local ck=("${k8[@]}" --set fp8.enabled=true --set backend.attention_deterministic=true --set train.steps=5
              --set checkpoint.dir="$W/ck8b" --set checkpoint.async=true --set checkpoint.keep=1)
    run 8b-ckpt-straight "$lane_a" 300 "${ck[@]}" --set checkpoint.every=3
    run 8b-ckpt-resumed "$lane_a" 300 "${ck[@]}" --set checkpoint.resume=auto
    du -sh "$W"/ck8b/step_* >> "$OUT/8b-ckpt-resumed.log" 2>&1
    rm -rf "$W/ck8b"
  fi
}

lane_torch() {
  if want torch && [ "$N" -ge 2 ]; then
    for ac in ${TORCH_AC:-full none}; do
      if [ "$SECONDS" -gt "$DEADLINE" ]; then echo "torch-8b-$ac skipped" | tee "$OUT/torch-8b-$ac.log"; continue; fi
      CUDA_VISIBLE_DEVICES=$lane_b timeout "$(cap 300)" torchrun --standalone --nproc_per_node 2 bench/torch_fsdp2_llama.py \
        --batch 4 --steps "$STEPS" --ac $ac --out "$OUT/torch-8b-$ac.json" > "$OUT/torch-8b-$ac.log" 2>&1
      echo "torch-8b-$ac rc=$?" | tee -a "$OUT/torch-8b-$ac.log"
    done
  fi
  if want loss; then
    [ -f data/brown-gpt2/train_000000.bin ] || { echo "data/brown-gpt2 missing: carry it"; return; }
    local tl=(pipelines/fsdp-fp8.toml --nproc 2 "${sttl[@]}" --set model.vocab_size=50257 --set 'data.train_files="data/brown-gpt2/train_*.bin"'
              --set 'data.val_files="data/brown-gpt2/val_*.bin"' --set train.steps="${TTL_STEPS:-600}" --set log.every=25
              --set log.val_every=25 --set checkpoint.every=0 --set checkpoint.at_end=false --set checkpoint.resume=never)
    run ttl-bf16 "$lane_b" 200 "${tl[@]}" --set fp8.enabled=false
    run ttl-fp8 "$lane_b" 200 "${tl[@]}" --set fp8.enabled=true
  fi
  if want loss1b; then  # the same for Llama 1B (data parallel over the two GPUs, 8 x 2048 tokens a step)
    [ -f data/brown-gpt2/train_000000.bin ] || { echo "data/brown-gpt2 missing: carry it"; return; }
    local tb=(pipelines/llama-1b.toml --nproc 2 "${s8[@]}" --set train.batch_size=8 --set train.steps="${TTL1B_STEPS:-300}"
              --set optim.warmup_steps=30 --set log.every=20 --set log.val_every=20 --set data.val_batches=8)
    run ttl1b-bf16 "$lane_b" 200 "${tb[@]}" --set fp8.enabled=false
    run ttl1b-fp8 "$lane_b" 200 "${tb[@]}" --set fp8.enabled=true
  fi
  if want moe; then  # issue 26: expert parallelism over the two GPUs against one GPU
    local moe=(pipelines/moe-1b.toml "${smoe[@]}" --set data.synthetic_vocab=50257 --set 'data.val_files=""'
               --set log.val_every=0 --set log.every=5 --set train.steps="$((2 * STEPS))" --set fp8.enabled=true)
    run moe-one "${lane_b%%,*}" 150 "${moe[@]}"
    run moe-ep2 "$lane_b" 150 "${moe[@]}" --nproc 2 --set parallel.ep=2 --set train.batch_size=16
    run moe-ep2-profile "$lane_b" 150 "${moe[@]}" --nproc 2 --set parallel.ep=2 --set train.batch_size=16 \
      --set backend.profile=true
  fi
}

if [ -n "$lane_a" ] && [ "$lane_a" != "$lane_b" ]; then
  lane_kiln > "$OUT/lane-kiln.txt" 2>&1 &
  lane_torch > "$OUT/lane-torch.txt" 2>&1
  wait
  cat "$OUT/lane-kiln.txt" "$OUT/lane-torch.txt"
else
  lane_kiln
  lane_torch
fi

echo "================ issue 25 on two GPUs ($(head -2 "$OUT/machine.txt" | tail -1 | cut -d, -f2)) ================"
python3 - "$OUT" <<'PY'
import json, pathlib, re, statistics, sys
out = pathlib.Path(sys.argv[1])
FLOPS = 46.30e9  # model FLOPs per token of llama-8b.toml (docs/PERF.md's formula), 989.4 TFLOP/s peak
def rows(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
def text(n):
    p = out / f"{n}.log"
    return p.read_text() if p.exists() else ""
print(f"{'run':<22} {'tok/s per GPU':>13} {'ms/step':>8} {'MFU':>6} {'peak GiB/GPU':>12}")
names = ["8b-bf16-full", "8b-bf16-none", "8b-fp8-full", "8b-fp8-none"]
names += sorted(p.stem for p in out.glob("8b-*.jsonl") if p.stem not in names and "ckpt" not in p.stem)
for n in names:
    r = rows(n)
    if not r:
        if text(n):
            print(f"{n:<22} (no metrics) {text(n)[-400:]!r}")
        continue
    st = r[len(r) // 4:] or r
    tps = statistics.median(x["tokens_per_s"] for x in st) / 2
    ms = statistics.median(x["step_ms"] for x in st)
    m = re.findall(r"peak device memory ([0-9.]+)", text(n))
    print(f"{n:<22} {tps:>13,.0f} {ms:>8.1f} {100 * FLOPS * tps / 989.4e12:>5.1f}% {(m[-1] if m else '-'):>12}")
base = [n for n in names if re.fullmatch(r"8b-bf16-first\d+", n)]
for n in names:
    if "-off" not in n and "pipeline" not in n or n.startswith("8b-fp8"):
        continue
    for line in text(n).splitlines():
        if line.startswith("activation offload:") or line.startswith("activation checkpoint:"):
            print(f"  {n}: {line[:240]}")
    if base and rows(n) and rows(base[0]):
        ref = {x["step"]: x["loss"] for x in rows(base[0])}
        d = max(abs(x["loss"] - ref[x["step"]]) / abs(ref[x["step"]]) for x in rows(n) if x["step"] in ref)
        print(f"  {n}: losses within {d:.2e} relative of {base[0]}'s (atomic-dQ attention: not bit-reproducible)")
for ac in ("full", "none"):
    p = out / f"torch-8b-{ac}.json"
    if p.exists():
        t = json.loads(p.read_text())
        print(f"{'torch-8b-' + ac:<22} {t['tokens_per_s_per_gpu']:>13,.0f} {t['ms_per_step']:>8.1f} "
              f"{100 * FLOPS * t['tokens_per_s_per_gpu'] / 989.4e12:>5.1f}% {t.get('peak_device_gib', t['peak_gib']):>12.2f}  (weights at start "
              f"{t['weights_at_start_gib']:.2f} GiB; tensors' peak {t['peak_gib']:.2f}, reserved {t.get('peak_reserved_gib', 0):.2f})")
    elif (out / f"torch-8b-{ac}.log").exists():
        print(f"torch-8b-{ac}: no result: {(out / f'torch-8b-{ac}.log').read_text()[-600:]!r}")
for p in sorted(out.glob("trace-8b-*-rank*.txt")):
    print(f"--- {p.stem}"); print("\n".join(p.read_text().splitlines()[:40]))
for line in text("8b-bf16-full").splitlines():
    if "holds 1/" in line or line.startswith("model:") or "parameters" in line[:40]:
        print("  " + line[:300])
a, b = rows("8b-ckpt-straight"), rows("8b-ckpt-resumed")
if a and b:
    sa = {x["step"]: (x["loss"], x["grad_norm"]) for x in a}
    same = all(sa.get(x["step"]) == (x["loss"], x["grad_norm"]) for x in b)
    print(f"ckpt: resumed steps {[x['step'] for x in b]} {'BIT-IDENTICAL' if same and len(b) == 2 else 'DIFFER'}: "
          f"{[(x['step'], x['loss']) for x in b]} vs {[(s, sa[s][0]) for s in sorted(sa) if s > 3]}")
for n in ("8b-ckpt-straight", "8b-ckpt-resumed"):
    for line in text(n).splitlines():
        if "checkpoint:" in line or " rc=" in line:
            print(f"  {n}: {line[:260]}")
one = rows("moe-one")
for n, g in (("moe-one", 1), ("moe-ep2", 2)):
    r = rows(n)
    if r:
        st = r[len(r) // 4:] or r
        tps = statistics.median(x["tokens_per_s"] for x in st) / g
        share = f", {100 * tps / statistics.median(x['tokens_per_s'] for x in one[len(one) // 4:]):.0f}% of one GPU" if one and g > 1 else ""
        m = re.findall(r"peak device memory ([0-9.]+)", text(n))
        print(f"{n}: {tps:,.0f} tok/s per GPU, {statistics.median(x['step_ms'] for x in st):.1f} ms/step{share}, "
              f"peak {(m[-1] if m else '-')} GiB")
    elif text(n):
        print(f"{n}: no metrics {text(n)[-300:]!r}")
t = text("moe-ep2-profile")
i = t.find("op time breakdown")
if i >= 0:
    print("moe-ep2-profile: " + "\n".join(t[i:].splitlines()[:45]))
for n in ("ttl-bf16", "ttl-fp8", "ttl1b-bf16", "ttl1b-fp8"):
    r = rows(n)
    v = [x for x in r if "val_loss" in x]
    if v:
        best = min(v, key=lambda x: x["val_loss"])
        print(f"{n}: {r[-1]['tokens']:,} tokens in {r[-1]['elapsed_s']:.1f} s; final val {v[-1]['val_loss']:.4f}; "
              f"best val {best['val_loss']:.4f} at step {best['step']} ({best['elapsed_s']:.1f} s)")
    elif text(n):
        print(f"{n}: no validation rows {text(n)[-300:]!r}")
PY

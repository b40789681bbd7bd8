#!/usr/bin/env bash
# Issue 28's GPU part in one call, building nothing (kind nvidia-h200-x2): the CUDA op tests (the
# attention kernels on packed documents among them), then a fine-tune of ~1 B Llama-shaped weights
# from a Hugging Face directory on two GPUs with FSDP, and what comes out of it checked against
# transformers. A table last.
#   1. bench/sft_check.py make: a random Llama 3.2 1B-shaped LlamaForCausalLM (vocabulary 50304), bf16
#   2. pipelines/llama-sft.toml from it on data/sft-brown (bench/make_chat_data.py + kiln tokenize
#      --format chat, carried): FSDP full_shard over two GPUs, packed conversations attending within
#      themselves, SFT_STEPS steps (default 40), saved at the end; the same with attention across
#      documents for the cost of the masking; tokens/s per GPU and MFU
#   3. kiln export of the fine-tuned checkpoint (bf16, Hugging Face layout), then kiln eval of it on
#      the validation shard within documents and across them, beside transformers loading the export
#      (bench/sft_check.py loss: each document run alone, and whole windows)
# usage: OUT=DIR bash bench/gpu_sft.sh BUILD_DIR
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
W=${WORK:-/tmp/kiln-sft}
rm -rf "$W"
mkdir -p "$W"
STEPS=${SFT_STEPS:-40}
summary=()
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/machine.txt" 2>&1
summary+=("device: $(tail -1 "$OUT/machine.txt") x $(($(wc -l < "$OUT/machine.txt") - 1))")

for exe in test_cuda_ops test_gpu_model test_gpu_recompute; do
  if [ -x "$B/bin/$exe" ]; then
    timeout 200 "$B/bin/$exe" > "$OUT/$exe.log" 2>&1
    summary+=("$exe: rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$exe.log" | tail -1)")
  fi
done
"$B/bin/test_cuda_ops" -tc="*packed documents*" > "$OUT/docs-case.log" 2>&1
summary+=("packed-documents attention case: rc=$? $(grep -E '^\[doctest\] (test cases|assertions)' "$OUT/docs-case.log" | tr '\n' ' ')")

python3 bench/sft_check.py make "$W/hf1b" 50304 > "$OUT/make.log" 2>&1
summary+=("random 1B Llama saved: rc=$? $(tail -1 "$OUT/make.log")")

sft=(pipelines/llama-sft.toml --nproc 2 --set model.init_from="$W/hf1b" --set 'data.train_files=data/sft-brown/train_*.bin'
     --set 'data.val_files=data/sft-brown/val_*.bin' --set fsdp.strategy=full_shard --set log.every=1
     --set log.val_every=20 --set parallel.timeout_s=300)
run() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$K" run "${sft[@]}" "$@" --set log.metrics="$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc, $((SECONDS - t0)) s")
  return $rc
}
run sft-docs 240 --set train.steps="$STEPS" --set checkpoint.dir="$W/ck" --set checkpoint.every="$STEPS"
run sft-across 150 --set train.steps=20 --set data.attend_within_documents=false --set checkpoint.every=0 \
  --set checkpoint.at_end=false

"$K" export "$W/ck" -o "$W/ft" --dtype bf16 > "$OUT/export.log" 2>&1
summary+=("export: rc=$? $(tail -1 "$OUT/export.log")")
VAL=$(ls data/sft-brown/val_*.bin | head -1)
for mode in within across; do
  extra=()
  [ $mode = across ] && extra=(--attend-across-documents)
  timeout 200 "$K" eval "$W/ft" --data "$VAL" --seq-len 2048 --device cuda "${extra[@]}" > "$OUT/eval-$mode.log" 2>&1
  summary+=("kiln eval ($mode documents): rc=$? $(tail -1 "$OUT/eval-$mode.log")")
done
timeout 300 python3 bench/sft_check.py loss "$W/ft" "$VAL" 2048 > "$OUT/hf-loss.log" 2>&1
summary+=("transformers on the export: rc=$? $(tail -1 "$OUT/hf-loss.log")")

printf '%s\n' "${summary[@]}"
python3 - "$OUT" <<'PY'
import json, pathlib, re, statistics, sys
out = pathlib.Path(sys.argv[1])
# Model FLOPs a token: 6 x the weights the tokens pass through (blocks + head) + attention's
# 6 x 2 x layers x seq x d (causal half of 12 L T d); documents shorten attention, not counted.
L, d, T, ffn, kv, V = 16, 2048, 2048, 8192, 512, 50304
weights = L * (d * d * 2 + 2 * d * kv + 3 * d * ffn) + V * d
flops = 6 * weights + 6 * L * T * d
print(f"model FLOPs per token {flops / 1e9:.2f} G (6 x {weights / 1e9:.3f} B weights + attention), H200 peak 989.4 TFLOP/s")
print(f"{'run':<12} {'tok/s per GPU':>13} {'ms/step':>8} {'MFU':>6} {'peak GiB':>9} {'loss first -> last':>22} {'val':>8}")
for n in ("sft-docs", "sft-across"):
    p = out / f"{n}.jsonl"
    if not p.exists():
        print(f"{n}: no metrics: {(out / (n + '.log')).read_text()[-500:]!r}"); continue
    r = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    st = [x for x in r if "tokens_per_s" in x]
    tail = st[len(st) // 4:] or st
    tps = statistics.median(x["tokens_per_s"] for x in tail) / 2
    ms = statistics.median(x["step_ms"] for x in tail)
    val = [x["val_loss"] for x in r if "val_loss" in x]
    m = re.findall(r"peak device memory ([0-9.]+)", (out / f"{n}.log").read_text())
    print(f"{n:<12} {tps:>13,.0f} {ms:>8.1f} {100 * flops * tps / 989.4e12:>5.1f}% {(m[-1] if m else '-'):>9} "
          f"{st[0]['loss']:>10.4f} -> {st[-1]['loss']:<9.4f} {(val[-1] if val else float('nan')):>8.4f}")
for line in (out / "sft-docs.log").read_text().splitlines():
    if line.startswith("model:") or "init_from" in line or "holds 1/" in line:
        print("  " + line[:240])
PY

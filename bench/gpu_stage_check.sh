#!/usr/bin/env bash
# One call on two GPUs (kind nvidia-h200-x2), building nothing: the CUDA tests that cover the model,
# FSDP, recompute and checkpoints (GPU 0), then pipeline stages against one GPU (gpt2-124m 1F1B and
# interleaved, gpt-1.3b and Llama 1B at pp 2 with 8 micro-batches), then bench/fsdp_fp8_probe.sh.
# usage: bash bench/gpu_stage_check.sh BUILD_DIR    (logs under $OUT; a table last)
set -uo pipefail
B=${1:-.devbuild}
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}" NCCL_NVLS_ENABLE=0
K="$B/bin/kiln"
for t in test_gpu_model test_gpu_fsdp test_gpu_recompute test_gpu_training_checkpoint test_cuda_fp8; do
  CUDA_VISIBLE_DEVICES=0 timeout 200 "$B/bin/$t" > "$OUT/$t.txt" 2>&1
  echo "$t rc=$? $(grep -E '^\[doctest\] test cases' "$OUT/$t.txt" | tail -1)"
done
common=(--set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0 --set log.every=2
        --set parallel.timeout_s=120)
run() {  # name steps pipeline [args...]
  local name=$1 steps=$2 file=$3
  shift 3
  timeout 300 "$K" run "$file" "${common[@]}" --set train.steps="$steps" --set log.metrics="$OUT/$name.jsonl" "$@" \
    > "/tmp/$name.log" 2>&1
  echo "$name rc=$?"
}
run 124m-one 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4
run 124m-pp2 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2
run 124m-vpp2 30 pipelines/gpt2-124m.toml --set train.micro_batch_size=4 --nproc 2 --set parallel.pp=2 --set parallel.vpp=2
g13=(--set train.batch_size=8 --set train.micro_batch_size=1)
run 1.3b-one 16 pipelines/gpt-1.3b.toml "${g13[@]}"
run 1.3b-pp2 16 pipelines/gpt-1.3b.toml "${g13[@]}" --nproc 2 --set parallel.pp=2
ll=(--set model.tie_embeddings=false --set train.batch_size=8 --set train.micro_batch_size=1)
run llama-one 16 pipelines/llama-1b.toml "${ll[@]}"
run llama-vpp2 16 pipelines/llama-1b.toml "${ll[@]}" --nproc 2 --set parallel.pp=2 --set parallel.vpp=2
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
for n, ref, vpp, m in [("124m-pp2", "124m-one", 1, 4), ("124m-vpp2", "124m-one", 2, 4), ("1.3b-pp2", "1.3b-one", 1, 8),
                       ("llama-vpp2", "llama-one", 2, 8)]:
    r, b = load(n), load(ref)
    if not r or not b:
        print(n, "(no metrics)"); continue
    t = statistics.median(x["tokens_per_s"] for x in r[len(r) // 3:])
    tb = statistics.median(x["tokens_per_s"] for x in b[len(b) // 3:])
    d = max(abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(r, b))
    print(f"{n:<11} {t:>9,.0f} tok/s, one GPU {tb:>9,.0f}, ratio {t / 2 / ((1 - 1 / (vpp * m + 1)) * tb):.3f}, dloss {d:.1e}")
PY
OUT="$OUT/probe" && mkdir -p "$OUT" && OUT=$OUT bash bench/fsdp_fp8_probe.sh "$B" | tail -10

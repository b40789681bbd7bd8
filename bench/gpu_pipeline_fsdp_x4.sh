#!/usr/bin/env bash
# pp = 2 x FSDP 2 on four GPUs (kind nvidia-h100-x4 / nvidia-h200-x4), building nothing: gpt-1.3b with
# 16 micro-batches of one sequence a step (8 per data-parallel rank), its gradients reduce-scattered
# per micro-batch or once a step (fsdp.reduce), full_shard and shard_grad_op, against pp 2 x DP 2 and
# one GPU. First the CUDA FSDP test (two thread ranks on GPU 0).
# usage: bash bench/gpu_pipeline_fsdp_x4.sh BUILD_DIR   (metrics under $OUT; a table last)
B=${1:-.devbuild}
export LD_LIBRARY_PATH=$PWD/$B/lib:$PWD/$B/syslib NCCL_NVLS_ENABLE=0
K=$B/bin/kiln
nvidia-smi -L
CUDA_VISIBLE_DEVICES=0 timeout 300 $B/bin/test_gpu_fsdp > $OUT/test_gpu_fsdp.txt 2>&1; echo "test_gpu_fsdp rc=$? $(tail -1 $OUT/test_gpu_fsdp.txt)"
c=(--set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0 --set log.every=2 --set train.steps=16
   --set parallel.timeout_s=120 --set train.batch_size=16 --set train.micro_batch_size=1)
run() { n=$1; shift; timeout 300 $K run "$@" "${c[@]}" --set log.metrics=$OUT/$n.jsonl > /tmp/$n.log 2>&1; echo "$n rc=$? $(grep -h 'peak device' /tmp/$n.log | head -1)"; }
pp=(pipelines/gpt-1.3b.toml --nproc 4 --set parallel.pp=2)
run one pipelines/gpt-1.3b.toml
run dp2 "${pp[@]}"
run full-mb "${pp[@]}" --set fsdp.strategy=full_shard
run full-step "${pp[@]}" --set fsdp.strategy=full_shard --set fsdp.reduce=step
run gradop-mb "${pp[@]}" --set fsdp.strategy=shard_grad_op
run gradop-step "${pp[@]}" --set fsdp.strategy=shard_grad_op --set fsdp.reduce=step
python3 - $OUT <<'PY'
import json, statistics, sys, pathlib
o = pathlib.Path(sys.argv[1])
def L(n):
    p = o / f"{n}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
def med(n, k):
    r = L(n); st = r[len(r) // 3:]
    return statistics.median(x[k] for x in st) if r else float("nan")
base = med("one", "tokens_per_s")
bub = 1 / 9
print(f"{'run':<12} {'tok/s':>9} {'per GPU':>9} {'ms/step':>8} {'MFU':>6} {'vs (1-b) x 1 GPU':>17} {'dloss':>8}")
for n in ["one", "dp2", "full-mb", "full-step", "gradop-mb", "gradop-step"]:
    t = med(n, "tokens_per_s"); g = 1 if n == "one" else 4
    ratio = "" if n == "one" else f"{t / g / ((1 - bub) * base):.3f}"
    d = max((abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(L(n), L("one"))), default=float("nan"))
    print(f"{n:<12} {t:>9,.0f} {t/g:>9,.0f} {med(n, 'step_ms'):>8.1f} {med(n, 'mfu'):>6.3f} {ratio:>17} {d:>8.1e}")
PY

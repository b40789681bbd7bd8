#!/usr/bin/env bash
# Probe (2026-11-28): FSDP (reduced once a step) against plain data parallelism on two GPUs under FP8
# delayed scaling with two micro-batches, the test model of tests/parallel/test_gpu_fsdp.cpp, with
# the delayed recipe's settings varied one at a time; prints each pair's first differing step.
# Found: they parted at step 4 with the defaults (shard_grad_op too) and matched with
# amax_history_len = 1, amax_compute_algo = most_recent, fuse_weight_update = false or one
# micro-batch: the fused AdamW update's FMA contraction differed between the whole-weight and the
# parts kernels (fixed in ops::adamw_update; since then every pair matches but amax_group = tp, which
# FSDP now refuses). usage: bash bench/fsdp_fp8_probe.sh BUILD_DIR  (under $OUT)
B=${1:-.devbuild}
export LD_LIBRARY_PATH=$PWD/$B/lib:$PWD/$B/syslib NCCL_NVLS_ENABLE=0
K=$B/bin/kiln
cat > /tmp/probe.toml <<'T'
[engine]
device = "cuda"
[train]
steps = 8
seed = 23
batch_size = 8
seq_len = 64
[model]
n_layer = 3
n_head = 4
n_embd = 128
vocab_size = 300
max_seq_len = 64
[optim]
lr = 1e-3
grad_clip = 0
[data]
synthetic_vocab = 300
val_files = ""
[log]
every = 1
val_every = 0
[parallel]
timeout_s = 120
T
run() { n=$1; shift; timeout 120 $K run /tmp/probe.toml --nproc 2 --set train.micro_batch_size=2 --set log.metrics=$OUT/$n.jsonl "$@" > $OUT/$n.log 2>&1; echo "$n rc=$?"; }
F=(--set fsdp.strategy=full_shard --set fsdp.reduce=step)
D=(--set fp8.enabled=true)
run dp "${D[@]}"
run fsdp "${D[@]}" "${F[@]}"
run dp-again "${D[@]}"
run fsdp-again "${D[@]}" "${F[@]}"
run fsdp-gradop "${D[@]}" --set fsdp.strategy=shard_grad_op --set fsdp.reduce=step
run dp-nobuckets "${D[@]}" --set parallel.dp_bucket_mb=0
run dp-h1 "${D[@]}" --set fp8.amax_history_len=1
run fsdp-h1 "${D[@]}" "${F[@]}" --set fp8.amax_history_len=1
run dp-recent "${D[@]}" --set fp8.amax_compute_algo=most_recent
run fsdp-recent "${D[@]}" "${F[@]}" --set fp8.amax_compute_algo=most_recent
run dp-tp "${D[@]}" --set fp8.amax_group=tp
run fsdp-tp "${D[@]}" "${F[@]}" --set fp8.amax_group=tp
run dp-nofast "${D[@]}" --set fp8.forward_fast_accum=false
run fsdp-nofast "${D[@]}" "${F[@]}" --set fp8.forward_fast_accum=false
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
def L(n):
    p = o / f"{n}.jsonl"
    return [json.loads(l)["loss"] for l in p.read_text().splitlines()] if p.exists() else []
for a, b in [("dp", "fsdp"), ("dp", "dp-again"), ("fsdp", "fsdp-again"), ("dp", "fsdp-gradop"), ("dp", "dp-nobuckets"), ("dp-h1", "fsdp-h1"),
             ("dp-recent", "fsdp-recent"), ("dp-tp", "fsdp-tp"), ("dp-nofast", "fsdp-nofast")]:
    x, y = L(a), L(b)
    diff = [i + 1 for i, (p, q) in enumerate(zip(x, y)) if p != q]
    print(f"{a} vs {b}: {len(x)}/{len(y)} steps, first differing step {diff[0] if diff else '-'}; "
          f"losses {x[:3]} / {y[:3]}")
PY

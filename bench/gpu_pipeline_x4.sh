#!/usr/bin/env bash
# Pipeline stages on four GPUs (kind nvidia-h100-x4 / nvidia-h200-x4), building nothing: 1.3B GPT and Llama 1B
# (untied) at pp = 4 (1F1B, interleaved), pp = 2 x DP 2 and pp = 2 x FSDP 2, 16 micro-batches of one
# sequence a step, against one GPU. usage: bash bench/gpu_pipeline_x4.sh   (metrics under $OUT)
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:$PWD/.devbuild/syslib NCCL_NVLS_ENABLE=0
K=.devbuild/bin/kiln
c=(--set data.synthetic_vocab=50257 --set 'data.val_files=""' --set log.val_every=0 --set log.every=2 --set train.steps=16 --set parallel.timeout_s=120 --set train.batch_size=16 --set train.micro_batch_size=1)
run() { n=$1; shift; timeout 300 $K run "$@" "${c[@]}" --set log.metrics=$OUT/$n.jsonl > /tmp/$n.log 2>&1; echo "$n rc=$? $(grep 'peak device' /tmp/$n.log)"; }
nvidia-smi -L
run g-one pipelines/gpt-1.3b.toml
run g-pp4 pipelines/gpt-1.3b.toml --nproc 4 --set parallel.pp=4
run g-pp2-fsdp2 pipelines/gpt-1.3b.toml --nproc 4 --set parallel.pp=2 --set fsdp.strategy=full_shard
run g-pp2-dp2 pipelines/gpt-1.3b.toml --nproc 4 --set parallel.pp=2
run l-one pipelines/llama-1b.toml --set model.tie_embeddings=false
run l-pp4 pipelines/llama-1b.toml --set model.tie_embeddings=false --nproc 4 --set parallel.pp=4
run l-pp4-vpp2 pipelines/llama-1b.toml --set model.tie_embeddings=false --nproc 4 --set parallel.pp=4 --set parallel.vpp=2
python3 - $OUT <<'PY'
import json,statistics,sys,pathlib
o=pathlib.Path(sys.argv[1])
def L(n):
    p=o/f"{n}.jsonl"; return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
def tps(n):
    r=L(n); st=r[len(r)//3:]; return statistics.median(x['tokens_per_s'] for x in st) if r else float('nan'), (statistics.median(x['step_ms'] for x in st) if r else 0), (statistics.median(x['mfu'] for x in st) if r else 0)
for n,ref,gpus,pp,vpp,m in [("g-one",None,1,1,1,16),("g-pp4","g-one",4,4,1,16),("g-pp2-fsdp2","g-one",4,2,1,8),("g-pp2-dp2","g-one",4,2,1,8),("l-one",None,1,1,1,16),("l-pp4","l-one",4,4,1,16),("l-pp4-vpp2","l-one",4,4,2,16)]:
    t,ms,mfu=tps(n)
    rr=""
    if ref:
        b=tps(ref)[0]; bub=(pp-1)/(vpp*m+pp-1); rr=f"{t/gpus/((1-bub)*b):.3f} (bubble {bub:.3f})"
    ra=L(n); rb=L(ref) if ref else []
    d=max((abs(a['loss']-c['loss'])/c['loss'] for a,c in zip(ra,rb)),default=float('nan'))
    print(f"{n:<12} {t:>9,.0f} {t/gpus:>9,.0f} {ms:>7.1f} {mfu:.3f} {rr} dloss {d:.1e}")
PY

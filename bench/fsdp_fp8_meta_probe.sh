#!/usr/bin/env bash
# Probe (2026-11-28): the FP8 scaling state (amax histories, scales) of plain DP and of FSDP
# reduced once a step, under delayed scaling with two micro-batches, after each of the first 5 of 8 steps, read from
# training-state checkpoints; prints which slots (linear, role) and history rows differ.
# usage: bash bench/fsdp_fp8_meta_probe.sh BUILD_DIR   (under $OUT; bench/fsdp_fp8_probe.sh's model)
B=${1:-.devbuild}
export LD_LIBRARY_PATH=$PWD/$B/lib:$PWD/$B/syslib NCCL_NVLS_ENABLE=0
K=$B/bin/kiln
OUT=${OUT:-gpu-logs}
bash bench/fsdp_fp8_probe.sh "$B" > /dev/null 2>&1 || true   # writes /tmp/probe.toml
for k in dp fsdp; do
  extra=(); [ $k = fsdp ] && extra=(--set fsdp.strategy=full_shard --set fsdp.reduce=step)
  timeout 120 $K run /tmp/probe.toml --nproc 2 --set train.micro_batch_size=2 --set fp8.enabled=true \
    --set train.steps=8 --set checkpoint.dir=$OUT/ck-$k --set checkpoint.every=1 --set log.metrics=$OUT/meta-$k.jsonl "${extra[@]}" > $OUT/meta-$k.log 2>&1
  echo "$k rc=$?"
done
python3 - $OUT <<'PY'
import struct, sys, pathlib
o = pathlib.Path(sys.argv[1])
MAGIC = struct.pack("<I", 0x38504B46)
def snaps(d):
    out = []
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        b = f.read_bytes(); i = b.find(MAGIC)
        while i >= 0:
            _, ver, n, ln = struct.unpack_from("<4I", b, i); (cnt,) = struct.unpack_from("<Q", b, i + 16)
            if ver == 1 and 0 < n < 100000 and cnt < 10**8:
                at = i + 24 + 2 * n
                st = struct.unpack_from(f"<{cnt}f", b, at)
                out.append((f.name, n, ln, b[i + 24 + n:i + 24 + 2 * n], st))
                break
            i = b.find(MAGIC, i + 1)
    return out
roles = ["input", "weight", "grad_output"]
import json
for k in ("dp", "fsdp"):
    p = o / f"meta-{k}.jsonl"
    print(k, "losses", [json.loads(l)["loss"] for l in p.read_text().splitlines()] if p.exists() else "none")
for s in (1, 2, 3, 4, 5):
    a, c = snaps(o / "ck-dp" / f"step_{s:06d}"), snaps(o / "ck-fsdp" / f"step_{s:06d}")
    print(f"after step {s}: dp {[x[0] for x in a]} fsdp {[x[0] for x in c]}")
    for (fa, n, ln, ra, sa), (fc, _, _, rc, sc) in zip(a, c):
        if ra != rc: print("  ready differs", fa, fc)
        diffs = [i for i in range(min(len(sa), len(sc))) if sa[i] != sc[i]]
        print(f"  {fa} vs {fc}: n {n} len {ln}, {len(diffs)} values differ")
        regions = {}
        for i in diffs:
            if i < ln * n: key = ("row 0" if i < n else f"rows 1+", roles[i % n % 3])
            elif i < ln * n + n: key = ("scale", roles[(i - ln * n) % 3])
            else: key = ("after the scales", "")
            regions[key] = regions.get(key, 0) + 1
        print("   ", ", ".join(f"{a} {b}: {c}" for (a, b), c in sorted(regions.items())))
        for i in [j for j in diffs if j >= n][:6]:
            if i < ln * n: where = f"history row {i // n}, slot {i % n} (linear {i % n // 3}, {roles[i % n % 3]})"
            elif i < ln * n + n: where = f"scale, slot {i - ln * n} (linear {(i - ln * n) // 3}, {roles[(i - ln * n) % 3]})"
            else: where = f"[{i}] (after the scales)"
            print(f"    {where}: dp {sa[i]!r} fsdp {sc[i]!r}")
PY

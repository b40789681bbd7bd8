#!/usr/bin/env python3
"""Per stream, over the last half of a kiln_trace CSV (bench/trace/kiln_trace.cpp): the time its
kernels, copies and memsets ran, and, for the stream with the most kernel time (the compute stream),
the gaps between its records, totalled by the name of the record after the gap (what it waited for
shows as what ran on the other streams meanwhile).
  python3 bench/trace/streams.py trace.csv [--from 0.5] [--top 25]"""
import argparse
import collections
import csv
import re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--from", dest="frm", type=float, default=0.5)
ap.add_argument("--top", type=int, default=25)
a = ap.parse_args()
rows = [r for r in csv.DictReader(open(a.csv)) if r["kind"] in ("kernel", "memcpy", "memset")]
rows = [(int(r["start"]), int(r["end"]), r["stream"], r["kind"], re.sub(r"\(.*", "", r["name"])[:60]) for r in rows]
t0, t1 = min(r[0] for r in rows), max(r[1] for r in rows)
cut = t0 + int((t1 - t0) * a.frm)
rows = sorted(r for r in rows if r[0] >= cut)
span = max(r[1] for r in rows) - rows[0][0]
busy = collections.defaultdict(int)
kinds = collections.defaultdict(collections.Counter)
for s, e, st, k, n in rows:
    busy[st] += e - s
    kinds[st][k] += e - s
print(f"window {span / 1e6:.1f} ms")
for st, b in sorted(busy.items(), key=lambda x: -x[1]):
    ks = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in kinds[st].most_common())
    print(f"stream {st:<5} busy {b / 1e6:8.1f} ms ({b / span:.0%}): {ks}")
main = max(busy, key=busy.get)
mine = [r for r in rows if r[2] == main]
gaps = collections.defaultdict(lambda: [0, 0])
total = 0
for prev, cur in zip(mine, mine[1:]):
    g = cur[0] - prev[1]
    if g > 2000:  # 2 us: launch spacing below that
        gaps[cur[4]][0] += g
        gaps[cur[4]][1] += 1
        total += g
copies = collections.defaultdict(list)
for s_, e_, st, k, n in rows:
    if k == "memcpy":
        copies[(st, n)].append(e_ - s_)
for (st, n), d in sorted(copies.items(), key=lambda x: -sum(x[1])):
    d.sort()
    print(f"stream {st:<5} {n:<20} {len(d):6d} copies, median {d[len(d) // 2] / 1e3:7.1f} us, "
          f"90th percentile {d[len(d) * 9 // 10] / 1e3:7.1f} us, total {sum(d) / 1e6:7.1f} ms")
print(f"stream {main}: gaps over 2 us {total / 1e6:.1f} ms of {span / 1e6:.1f}; by the record after the gap:")
for n, (g, c) in sorted(gaps.items(), key=lambda x: -x[1][0])[: a.top]:
    print(f"  {g / 1e6:8.2f} ms {c:6d}x  {n}")

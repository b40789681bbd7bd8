#!/usr/bin/env python3
"""Sums a kiln_trace CSV's host-side records (runtime and driver API calls, synchronisations) over the
second half of the run, by name: where the host spends its time between launches.
  python3 bench/trace/host_calls.py trace.csv [--top 15]"""
import argparse
import collections
import csv
import re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=15)
a = ap.parse_args()
rows = list(csv.DictReader(open(a.csv)))
dev = [r for r in rows if r["kind"] in ("kernel", "memcpy", "memset")]
t0, t1 = min(int(r["start"]) for r in dev), max(int(r["end"]) for r in dev)
mid = t0 + (t1 - t0) // 2
tot, n = collections.Counter(), collections.Counter()
for r in rows:
    if r["kind"] in ("runtime", "driver", "sync") and int(r["start"]) >= mid:
        k = r["kind"] + " " + re.sub(r"\(.*", "", r["name"])[:50]
        tot[k] += int(r["end"]) - int(r["start"])
        n[k] += 1
busy = sum(int(r["end"]) - int(r["start"]) for r in dev if int(r["start"]) >= mid)
print(f"window {(t1 - mid) / 1e6:.1f} ms, device records' time {busy / 1e6:.1f} ms")
for k, v in tot.most_common(a.top):
    print(f"{v / 1e6:9.2f} ms {n[k]:7d}  {k}")

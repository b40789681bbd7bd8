#!/usr/bin/env python3
"""Prints a kiln_trace CSV's kernels, copies and memsets in a window of the run, one per line with
start and end (us from the window's start), stream and a short name: to see what ran beside what.
  python3 bench/trace/window.py trace.csv [--at 0.75] [--count 60] [--grep REGEX]
--at: where the window starts, as a fraction of the run's device time; --grep: start at the first
record from there whose name matches."""
import argparse
import csv
import re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--at", type=float, default=0.75)
ap.add_argument("--count", type=int, default=60)
ap.add_argument("--grep", default="")
a = ap.parse_args()
rows = [r for r in csv.DictReader(open(a.csv)) if r["kind"] in ("kernel", "memcpy", "memset")]
rows.sort(key=lambda r: int(r["start"]))
t0, t1 = int(rows[0]["start"]), max(int(r["end"]) for r in rows)
at = t0 + int((t1 - t0) * a.at)
i = next(k for k, r in enumerate(rows) if int(r["start"]) >= at)
if a.grep:
    i = next(k for k in range(i, len(rows)) if re.search(a.grep, rows[k]["name"]))
base = int(rows[i]["start"])
for r in rows[i:i + a.count]:
    name = re.sub(r"\(.*", "", r["name"])[:70]
    print(f"{(int(r['start']) - base) / 1e3:10.1f} {(int(r['end']) - base) / 1e3:10.1f} "
          f"{(int(r['end']) - int(r['start'])) / 1e3:8.1f} s{r['stream']:<4} {name}")

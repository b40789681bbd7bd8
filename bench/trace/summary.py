#!/usr/bin/env python3
"""Summarises a kiln_trace CSV (bench/trace/kiln_trace.cpp) over a run's steady steps: ms per step,
the GPU's busy and idle time per step, the kernels by time, and the idle gaps by the work that
ended them (a gap is time when no kernel, copy or memset runs: the GPU waiting for the host).
  python3 bench/trace/summary.py trace.csv --steps 16 --skip 4 [--marker REGEX] [--top 30]
Steps are found by a kernel that runs a fixed number of times a step (--marker, default the
cross-entropy forward); the window runs from the end of step `skip` to the end of the last step."""
import argparse
import collections
import csv
import re


def short(name, width):
    """A kernel's name without its parameter list and anonymous namespaces, cut to `width`."""
    name = name.replace("(anonymous namespace)::", "")
    if name.endswith(")") and "(" in name:  # drop the parameter list: the last balanced (...)
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = re.sub(r"^void ", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--marker", default=r"\bce_(stream|scalar)\b")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gap-us", type=float, default=1.0, help="smallest idle gap counted")
    ap.add_argument("--width", type=int, default=90)
    a = ap.parse_args()

    work, syncs, api = [], [], []
    launch = {}  # correlation id -> (start, end) of the API call that launched the work
    stream_of = {}  # (start, correlation) of a kernel, copy or memset -> its stream
    with open(a.csv) as f:
        for r in csv.DictReader(f):
            rec = (int(r["start"]), int(r["end"]), r["name"], r["kind"], int(r["correlation"]))
            if r["kind"] in ("kernel", "memcpy", "memset"):
                stream_of[(rec[0], rec[4])] = r["stream"]
            if r["kind"] == "sync":
                syncs.append(rec)
            elif r["kind"] in ("runtime", "driver"):
                api.append(rec)
                if r["kind"] == "runtime" or rec[4] not in launch:
                    launch[rec[4]] = (rec[0], rec[1])
            else:
                work.append(rec)
    work.sort()
    marker = re.compile(a.marker)
    ends = sorted(e for s, e, n, k, c in work if k == "kernel" and marker.search(n))
    if len(ends) % a.steps:
        raise SystemExit(f"{len(ends)} '{a.marker}' kernels do not divide into {a.steps} steps")
    per = len(ends) // a.steps
    lo, hi = ends[a.skip * per - 1], ends[-1]
    steps = a.steps - a.skip
    span = (hi - lo) / 1e6
    print(f"window: steps {a.skip + 1}..{a.steps} ({steps} steps), {span / steps:.2f} ms a step")

    by_name = collections.Counter()
    calls = collections.Counter()
    gaps = collections.Counter()
    gap_calls = collections.Counter()
    busy_until = lo
    busy = 0.0
    late = 0.0  # idle time before work whose launch call began after the GPU went idle
    gap_list = []
    for s, e, n, k, c in work:
        if e <= lo or s >= hi:
            continue
        s, e = max(s, lo), min(e, hi)
        key = short(n, a.width)
        by_name[key] += (e - s) / 1e6
        calls[key] += 1
        if s > busy_until:
            gap = (s - busy_until) / 1e6
            if gap * 1e3 >= a.gap_us:
                gaps[key] += gap
                gap_calls[key] += 1
                gap_list.append((busy_until, s))
                if c in launch and launch[c][0] > busy_until:
                    late += (s - launch[c][0]) / 1e6
        if e > busy_until:
            busy += (e - max(s, busy_until)) / 1e6
            busy_until = e
    idle = span - busy
    print(f"GPU busy {busy / steps:.2f} ms a step, idle {idle / steps:.2f} ms a step "
          f"({100 * idle / span:.1f}%); gaps of {a.gap_us} us or more: {sum(gaps.values()) / steps:.2f} ms a step")
    if launch:
        print(f"  of which the host launched the next work only after the GPU had gone idle: "
              f"{late / steps:.2f} ms a step")
    # Per stream: its busy time (union of its work), and the time the busiest stream (the compute
    # stream) had nothing to run while other streams (communication) did: exposed communication.
    per_stream = collections.defaultdict(list)
    for s, e, n, k, c in work:
        if e > lo and s < hi:
            per_stream[stream_of.get((s, c), "?")].append((max(s, lo), min(e, hi)))
    def union(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    unions = {st: union(iv) for st, iv in per_stream.items()}
    busy_of = {st: sum(e - s for s, e in u) / 1e6 for st, u in unions.items()}
    if len(unions) > 1:
        main_stream = max(busy_of, key=busy_of.get)
        others = union([iv for st, u in unions.items() if st != main_stream for iv in u])
        # others minus main: time only other streams work
        exposed, j, m = 0.0, 0, unions[main_stream]
        for s, e in others:
            cur = s
            while j < len(m) and m[j][1] <= cur:
                j += 1
            k = j
            while cur < e:
                if k < len(m) and m[k][0] <= cur:
                    cur = max(cur, min(m[k][1], e)); k += 1
                    continue
                nxt = min(e, m[k][0]) if k < len(m) else e
                exposed += (nxt - cur) / 1e6
                cur = nxt
        print("streams (busy ms a step): " + ", ".join(f"{st}: {busy_of[st] / steps:.2f}"
                                                      for st in sorted(busy_of, key=busy_of.get, reverse=True)))
        print(f"  stream {main_stream} idle {(span - busy_of[main_stream]) / steps:.2f} ms a step, of which other "
              f"streams alone ran work (exposed) {exposed / steps:.2f} ms")
    sync_t = collections.Counter()
    for s, e, n, k, c in syncs:
        if lo <= s < hi:
            sync_t[n] += (e - s) / 1e6
    for n, t in sync_t.most_common():
        print(f"host waits, {n}: {t / steps:.2f} ms a step")
    print(f"\nkernels (sum of durations; concurrent kernels overlap), ms a step:")
    print(f"  {'ms':>7} {'calls':>6}  name")
    for n, t in by_name.most_common(a.top):
        print(f"  {t / steps:7.3f} {calls[n] / steps:6.1f}  {n}")
    print(f"\nidle gaps by the work that ended them, ms a step:")
    print(f"  {'ms':>7} {'gaps':>6}  next work")
    for n, t in gaps.most_common(a.top):
        print(f"  {t / steps:7.3f} {gap_calls[n] / steps:6.1f}  {n}")
    if api:
        # The host's calls during the idle gaps (runtime calls; driver calls made outside the runtime).
        inside = collections.Counter()
        api_sorted = sorted(x for x in api if lo <= x[0] < hi)
        import bisect
        starts = [x[0] for x in api_sorted]
        for g0, g1 in gap_list:
            i = max(bisect.bisect_left(starts, g0) - 1, 0)
            while i < len(api_sorted) and api_sorted[i][0] < g1:
                s, e, n, k, c = api_sorted[i]
                ov = min(e, g1) - max(s, g0)
                if ov > 0:
                    inside[f"{k}: {n}"] += ov / 1e6
                i += 1
        print(f"\nthe host's API calls during the idle gaps (overlap with the gaps), ms a step:")
        for n, t in inside.most_common(15):
            print(f"  {t / steps:7.3f}  {n}")
        total = collections.Counter()
        for s, e, n, k, c in api_sorted:
            if k == "runtime":
                total[n] += (e - s) / 1e6
        print(f"\nthe host's runtime calls over the window, ms a step:")
        for n, t in total.most_common(12):
            print(f"  {t / steps:7.3f}  {n}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A request's host path: its queue time when it arrives with nothing else in service, per point.

    scripts/host_path.py RAW_DIR [RAW_DIR ...] [--load 1] [--others-max 0]

RAW_DIR holds the per-request records of a `kairos bench run` (OUT/raw/*.raw.json, kairos-raw/1:
per request its arrival_ns, queue_ns, gpu_ns, done_ns). `gpu_ns` runs from the request's first
kernel issued to the dispatcher's completion, and `queue_ns` is the rest of its latency: from its
arrival until the dispatcher issued its first kernel, plus from the dispatcher's completion until
the client heard of it. A request that arrives while no other request is in service (no other
window [arrival, done] covers its arrival) waits for nothing, so its queue time is the engine's
host path alone: the submission queue, waking the dispatcher thread, admission, the first launch
call, and the completion callback back to the client.

Prints, per raw file (at the loads given, all by default), the requests after the warm-up with at
most `--others-max` others in service at their arrival, and the p10/p50/p90 of their queue time,
with the same for all requests for comparison. On a real GPU's records (the threaded engine) this
is the per-request host charge the simulator adds (`LatencyDesc::request_host_ns`,
data/gpus/h100_sxm.json); on the simulator's own records it is what the simulated run charges
(0 before the charge: the virtual driver issues at the arrival instant).
"""
import argparse
import glob
import json
import os


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def others_at_arrival(arr, done):
    """For each request, the number of other requests whose [arrival, done] covers its arrival."""
    ends = []  # sorted done times of requests that arrived earlier
    import bisect

    order = sorted(range(len(arr)), key=lambda i: arr[i])
    out = [0] * len(arr)
    for i in order:
        t = arr[i]
        # drop nothing: count earlier arrivals still running at t
        k = len(ends) - bisect.bisect_right(ends, t)
        out[i] = k
        bisect.insort(ends, done[i])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw_dirs", nargs="+")
    ap.add_argument("--load", type=float, action="append", help="only these loads (repeatable)")
    ap.add_argument("--others-max", type=int, default=7, help="the host-path requests: at most this many others in service")
    a = ap.parse_args()
    files = []
    for d in a.raw_dirs:
        files += sorted(glob.glob(os.path.join(d, "*.raw.json"))) if os.path.isdir(d) else [d]
    rows = []
    for f in files:
        r = json.load(open(f))
        if a.load and r["load"] not in a.load:
            continue
        idx = [i for i, s in enumerate(r["status"]) if s == "done"]
        arr = [r["arrival_ns"][i] for i in idx]
        done = [r["done_ns"][i] for i in idx]
        queue = [r["queue_ns"][i] for i in idx]
        others = others_at_arrival(arr, done)
        keep = [j for j in range(len(idx)) if arr[j] >= r.get("warmup_ns", 0)]
        rows.append((r["policy"], r["load"], [(others[j], queue[j]) for j in keep]))
    ms = lambda x: f"{x / 1e6:6.3f}"
    print("queue time (ms) of the requests after the warm-up, by the others in service at their arrival")
    print(f"{'policy':<18} {'load':>4} | {'0 p50':>6} {'1 p50':>6} {'2 p50':>6} {'3 p50':>6} {'4+ p50':>6} |"
          f" {'n':>5} {'<=' + str(a.others_max) + ' p10':>7} {'p50':>6} {'p90':>6} | {'all p50':>7} {'p90':>6}")
    for policy, load, reqs in sorted(rows, key=lambda x: (x[0], x[1])):
        b = lambda lo, hi: [q for o, q in reqs if lo <= o <= hi]
        host = b(0, a.others_max)
        allq = [q for _, q in reqs]
        print(f"{policy:<18} {load:>4} | {ms(pct(b(0, 0), .5))} {ms(pct(b(1, 1), .5))} {ms(pct(b(2, 2), .5))} {ms(pct(b(3, 3), .5))}"
              f" {ms(pct(b(4, a.others_max), .5))} | {len(host):>5} {ms(pct(host, .1)):>7} {ms(pct(host, .5))} {ms(pct(host, .9))} |"
              f" {ms(pct(allq, .5)):>7} {ms(pct(allq, .9))}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How much slower a request's GPU time gets with other requests in service, per point.

    scripts/corun_slowdown.py RAW_DIR --latency LAT.md [LAT.md ...] [--others-max 8]

RAW_DIR holds the per-request records of a `kairos bench run` (OUT/raw/*.raw.json, kairos-raw/1:
per request its stream, arrival_ns, queue_ns, gpu_ns = first kernel issued to completion, done_ns).
For each request after the warm-up, its GPU window is [arrival + queue, done]; "others" is the
time-weighted mean number of other requests whose GPU windows overlap it, and its slowdown is its
GPU time over its model's latency alone (p50 of `kairos bench latency`, from the latency.md files
given; several are averaged, e.g. one per policy). Prints, per raw file, the mean slowdown and
the mean slowdown per bin of "others" (0, 1, ..., others-max and above), and a least-squares
line slowdown = a + b * others over the requests with fewer than 6 others.

This is how the simulator's co-run interference (`corun_slowdown_per_launch`) and graph node gap
(`graph_node_gap_ns`) were calibrated against the H100 (data/gpus/h100_sxm.json): run it on the
GPU's raw records and on the simulator's with the GPU's latencies alone, and compare the bins.
"""
import argparse
import bisect
import collections
import glob
import json
import os


def latencies_alone(paths):
    got = collections.defaultdict(list)
    for path in paths:
        for line in open(path):
            c = [x.strip() for x in line.split("|")]
            if len(c) > 4 and c[1] and c[1][0].isalpha():
                try:
                    v = float(c[3])
                except ValueError:
                    continue
                got[c[1]].append(v)
    return {k: sum(v) / len(v) for k, v in got.items()}


def windows(path):
    d = json.load(open(path))
    names = d["streams"]
    out = []
    for i in range(len(d["arrival_ns"])):
        if d["status"][i] != "done" or d["arrival_ns"][i] < d["warmup_ns"]:
            continue
        start = d["arrival_ns"][i] + d["queue_ns"][i]
        if d["done_ns"][i] > start:
            out.append((start, d["done_ns"][i], names[d["stream"][i]]))
    return out


def with_others(ws):
    """(model, GPU ms, mean number of other requests in their GPU window) per request."""
    ev = sorted([(s, 1) for s, _, _ in ws] + [(e, -1) for _, e, _ in ws])
    ts, cum, after = [], [], []
    conc = acc = 0
    last = ev[0][0]
    for t, delta in ev:
        acc += conc * (t - last)
        last = t
        conc += delta
        ts.append(t)
        cum.append(acc)
        after.append(conc)

    def integral(t):
        k = bisect.bisect_right(ts, t) - 1
        return cum[k] + after[k] * (t - ts[k])

    return [(m, (e - s) / 1e6, (integral(e) - integral(s)) / (e - s) - 1) for s, e, m in ws]


def fit(rows, alone):
    xs = [o for _, _, o in rows]
    ys = [g / alone[m] for m, g, _ in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw_dir")
    ap.add_argument("--latency", nargs="+", required=True, help="latency.md of `kairos bench latency` (alone)")
    ap.add_argument("--others-max", type=int, default=8)
    a = ap.parse_args()
    alone = latencies_alone(a.latency)
    for path in sorted(glob.glob(os.path.join(a.raw_dir, "*.raw.json"))):
        rows = [r for r in with_others(windows(path)) if r[0] in alone]
        if not rows:
            continue
        bins = collections.defaultdict(list)
        for m, g, o in rows:
            bins[min(int(o), a.others_max)].append(g / alone[m])
        slow = sum(g / alone[m] for m, g, _ in rows) / len(rows)
        others = sum(o for _, _, o in rows) / len(rows)
        few = [r for r in rows if r[2] < 6]
        line = "a=%.2f b=%.3f" % fit(few, alone) if len(few) > 2 else ""
        print(
            f"{os.path.basename(path).replace('.raw.json', '')}: {len(rows)} requests, slowdown {slow:.2f} with "
            f"{others:.2f} others; {line}; by others: "
            + " ".join(f"{k}:{sum(v) / len(v):.2f}({len(v)})" for k, v in sorted(bins.items()))
        )


if __name__ == "__main__":
    main()

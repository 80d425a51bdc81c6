#!/usr/bin/env python3
"""Where each corpus model's batch-1 time goes, from `scripts/onnx-kernel-times.sh`'s folder: the
summed kernel time of `kairos profile` (each launch alone on the whole GPU, median of its repeats)
by kernel, the slowest launches, and the end-to-end latency (`kairos bench latency`, without and
with autotuning) beside PyTorch's fp16 eager and CUDA graph of the same module and, when the folder
has `ort-latency.json` (scripts/ort_cuda_peer.py), onnxruntime's CUDA provider (its best fp16
configuration per model). Models without a profile (PROFILE=0) get latency rows only.

    python3 scripts/onnx_kernel_table.py DIR [--top 6] [--json OUT.json]
"""
import argparse
import glob
import json
import math
import os
from collections import defaultdict


def profile_summary(path, top):
    d = json.load(open(path))
    by_kernel = defaultdict(lambda: [0, 0])
    for k in d["kernels"]:
        by_kernel[k["kernel"]][0] += 1
        by_kernel[k["kernel"]][1] += k["duration_ns"]
    total_ns = sum(v[1] for v in by_kernel.values())
    slowest = sorted(d["kernels"], key=lambda k: -k["duration_ns"])[:top]
    return {
        "launches": len(d["kernels"]),
        "kernel_sum_ms": total_ns / 1e6,
        "by_kernel": {name: {"launches": c, "ms": ns / 1e6, "share": ns / total_ns if total_ns else 0.0}
                      for name, (c, ns) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])},
        "slowest": [{"name": k["name"], "kernel": k["kernel"], "ctas": k["ctas"], "logical_blocks": k["logical_blocks"],
                     "us": k["duration_ns"] / 1e3} for k in slowest],
    }


def latency_rows(path):
    """model file stem -> (kairos p50 ms, eager ms, graph ms) from a `bench latency` JSON."""
    if not os.path.exists(path):
        return {}
    d = json.load(open(path))
    out = {}
    for t in d.get("tables", []):
        for r in t["rows"]:
            stem = os.path.basename(r["model"]).removesuffix(".onnx")
            peer = r.get("peer") or {}
            out[stem] = (r.get("p50_ms"), peer.get("eager_ms"), peer.get("graph_ms"))
    return out


def ort_rows(path):
    """model file stem -> onnxruntime CUDA provider's best ms (None when every configuration failed)."""
    if not os.path.exists(path):
        return {}
    d = json.load(open(path))
    return {os.path.basename(r["model"]).removesuffix(".onnx"): r.get("best_ms") for r in d.get("rows", [])}


def f(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lat = {at: latency_rows(os.path.join(a.dir, f"latency-autotune{at}", "latency.json")) for at in (0, 1)}
    unfused = latency_rows(os.path.join(a.dir, "latency-unfused", "latency.json"))
    ab = latency_rows(os.path.join(a.dir, "latency-ab", "latency.json"))
    label_file = os.path.join(a.dir, "ab-label.txt")
    ab_label = open(label_file).read().strip() if os.path.exists(label_file) else "A/B"
    ort = ort_rows(os.path.join(a.dir, "ort-latency.json"))
    profiles = {os.path.basename(p)[len("profile-"):-len(".json")]: p
                for p in glob.glob(os.path.join(a.dir, "profile-*.json"))}
    report = {}
    for stem in sorted(set(profiles) | set(lat[0]) | set(lat[1])):
        s = profile_summary(profiles[stem], a.top) if stem in profiles else {"launches": None, "kernel_sum_ms": None}
        s["latency"] = {f"autotune{at}": lat[at].get(stem) for at in (0, 1)}
        s["latency"]["unfused"] = unfused.get(stem)
        s["latency"]["ab"] = ab.get(stem)
        s["latency"]["ort"] = ort.get(stem)
        report[stem] = s
        if stem not in profiles:
            continue
        print(f"## {stem}: {s['launches']} launches, kernels alone sum to {s['kernel_sum_ms']:.3f} ms")
        print("kernel: launches, ms, share — " + "; ".join(
            f"{k} {v['launches']}, {v['ms']:.3f}, {v['share']:.0%}" for k, v in s["by_kernel"].items()))
        for k in s["slowest"]:
            print(f"  {k['us']:8.1f} us  {k['kernel']:<10} ctas {k['ctas']:>5} blocks {k['logical_blocks']:>6}  {k['name']}")
    print()
    extra = (" acts unfused (autotuned) |" if unfused else "") + (f" {ab_label} (autotuned) |" if ab else "")
    extra += " onnxruntime CUDA (best) | autotuned / onnxruntime |" if ort else ""
    print("| model | launches | kernels alone (ms) | kairos p50, no autotune | kairos p50, autotuned | PyTorch eager | PyTorch graph | autotuned / graph |" + extra)
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if unfused else "") + ("---:|" if ab else "")
          + ("---:|---:|" if ort else ""))
    for stem, s in report.items():
        l0, l1 = s["latency"]["autotune0"], s["latency"]["autotune1"]
        k0 = l0[0] if l0 else None
        k1 = l1[0] if l1 else None
        peer = l1 or l0 or (None, None, None)
        ratio = k1 / peer[2] if k1 and peer[2] else None
        u = s["latency"]["unfused"]
        tail = f" {f(u[0] if u else None)} |" if unfused else ""
        b = s["latency"]["ab"]
        tail += f" {f(b[0] if b else None)} |" if ab else ""
        o = s["latency"]["ort"]
        tail += f" {f(o)} | {f(k1 / o if k1 and o else None, 2)} |" if ort else ""
        launches = "–" if s["launches"] is None else s["launches"]
        print(f"| {stem} | {launches} | {f(s['kernel_sum_ms'])} | {f(k0)} | {f(k1)} | {f(peer[1])} | {f(peer[2])} | {f(ratio, 2)} |" + tail)
    def geomean(pairs):
        pairs = [(x, y) for x, y in pairs if x and y]
        return (math.exp(sum(math.log(x / y) for x, y in pairs) / len(pairs)), len(pairs)) if pairs else (None, 0)

    rows = [s["latency"] for s in report.values()]
    for label, key in (("no autotune", "autotune0"), ("autotuned", "autotune1"), ("acts unfused", "unfused"), (ab_label, "ab")):
        g, n = geomean([((r[key] or (None,))[0], (r["autotune1"] or r["autotune0"] or (None, None, None))[2]) for r in rows])
        if n:
            print(f"kairos {label} / PyTorch CUDA graph, geomean over {n} models: {g:.3f}")
    g, n = geomean([((r["autotune1"] or (None,))[0], r["ort"]) for r in rows])
    if n:
        print(f"kairos autotuned / onnxruntime CUDA provider (best fp16 configuration), geomean over {n} models: {g:.3f}")
    g, n = geomean([(r["ort"], (r["autotune1"] or r["autotune0"] or (None, None, None))[2]) for r in rows])
    if n:
        print(f"onnxruntime CUDA provider / PyTorch CUDA graph, geomean over {n} models: {g:.3f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Simulator fidelity: the same `kairos bench paella` run on the real GPU and on the simulator,
point by point (policy, offered load): p50, p99 and throughput, with the simulator's deviation.

    python3 scripts/compare_fidelity.py REAL/paella.json SIM/paella.json [EXPERIMENT ...]
"""
import json, sys


def policy(label):
    for sep in "( [":
        label = label.split(sep)[0]
    return label


def main():
    real, sim = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
    wanted = sys.argv[3:] or sorted(set(real) & set(sim))
    for exp in wanted:
        if exp not in real or exp not in sim:
            print(f"{exp}: missing in {'real' if exp not in real else 'sim'}")
            continue
        print(f"\n### {exp}\n")
        print("| policy | load | p50 real / sim (ms) | p99 real / sim (ms) | throughput real / sim (/s) | dev p50 | dev p99 | dev tput |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        devs = {"p50": [], "p99": [], "tput": []}
        sim_by = {}
        for p in sim[exp]:
            sim_by.setdefault(policy(p["policy"]), []).append(p)
        counts = {}
        for p in real[exp]:
            pol = policy(p["policy"])
            i = counts.get(pol, 0)
            counts[pol] = i + 1
            cands = sim_by.get(pol, [])
            if i >= len(cands):
                continue
            q = cands[i]
            r50, s50 = p["latency"]["p50_ns"] / 1e6, q["latency"]["p50_ns"] / 1e6
            r99, s99 = p["latency"]["p99_ns"] / 1e6, q["latency"]["p99_ns"] / 1e6
            rt, st = p["throughput_per_s"], q["throughput_per_s"]
            d = lambda a, b: (b - a) / a * 100 if a else float("nan")
            devs["p50"].append(abs(d(r50, s50)))
            devs["p99"].append(abs(d(r99, s99)))
            devs["tput"].append(abs(d(rt, st)))
            print(f"| {pol} | {i + 1} | {r50:.2f} / {s50:.2f} | {r99:.2f} / {s99:.2f} | {rt:.0f} / {st:.0f} | {d(r50, s50):+.0f}% | {d(r99, s99):+.0f}% | {d(rt, st):+.0f}% |")
        for k, v in devs.items():
            if v:
                v.sort()
                print(f"\n{k}: median |deviation| {v[len(v) // 2]:.0f}%, within 15% at {sum(x <= 15 for x in v)}/{len(v)} points", end="")
        print()


if __name__ == "__main__":
    main()

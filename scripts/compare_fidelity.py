#!/usr/bin/env python3
"""The simulator against the GPU: the same `kairos bench run` points, side by side.

    scripts/compare_fidelity.py GPU/results.json SIM/results.json [--tolerance 0.15] [--md OUT.md]

Both files are `kairos bench run` results (kairos-bench/1): one measured with `--backend cuda`, one
with `--backend sim` on the same presets, variants, policies and loads (and the same seed, so the
same arrival traces). Points are matched by (preset, variant, policy, load); for each the script
prints served/s, p50 and p99 on both and the simulator's relative error, and marks a point whose
error exceeds the tolerance (15%: the bar for using the simulator to argue about speed). Points
that saturated on either side are compared on served/s only (their latencies measure how long the
run lasted). Exit status 0 always: this is a report, not a test.
"""
import argparse
import json
import sys


def points(path):
    r = json.load(open(path))
    out = {}
    for preset in r["presets"]:
        for p in preset["points"]:
            if p.get("system", "kairos") != "kairos":
                continue
            key = (preset["preset"], p["variant"], p["policy"], float(p["load"]))
            m = p["metrics"]["overall"]
            out[key] = {
                "served": m["throughput_per_s"],
                "p50": m["latency"]["p50_ns"] / 1e6,
                "p99": m["latency"]["p99_ns"] / 1e6,
                "saturated": bool(p.get("saturated")),
            }
    return r.get("device", "?"), out


def rel(sim, gpu):
    return (sim - gpu) / gpu if gpu else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gpu")
    ap.add_argument("sim")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--md", help="also write the table here (markdown)")
    a = ap.parse_args()
    gdev, g = points(a.gpu)
    sdev, s = points(a.sim)
    keys = sorted(set(g) & set(s))
    if not keys:
        print(f"no common points between {a.gpu} ({len(g)}) and {a.sim} ({len(s)})", file=sys.stderr)
        return
    lines = [
        f"Simulator ({sdev}) against the GPU ({gdev}); error = sim / GPU - 1, '!' beyond {a.tolerance:.0%}.",
        "",
        "| preset | variant | policy | load | served/s GPU | sim | err | p50 ms GPU | sim | err | p99 ms GPU | sim | err |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    within = total = 0

    def cell(e):
        nonlocal within, total
        total += 1
        ok = abs(e) <= a.tolerance
        within += ok
        return f"{e:+.0%}{'' if ok else ' !'}"

    for k in keys:
        gp, sp = g[k], s[k]
        served = cell(rel(sp["served"], gp["served"]))
        if gp["saturated"] or sp["saturated"]:
            lat = ["-", "-"]
            note = " (saturated)"
        else:
            lat = [cell(rel(sp["p50"], gp["p50"])), cell(rel(sp["p99"], gp["p99"]))]
            note = ""
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]}{note} | {k[3]:g} | {gp['served']:.0f} | {sp['served']:.0f} | {served} | "
            f"{gp['p50']:.2f} | {sp['p50']:.2f} | {lat[0]} | {gp['p99']:.1f} | {sp['p99']:.1f} | {lat[1]} |"
        )
    lines.append("")
    lines.append(f"{within} of {total} compared values within {a.tolerance:.0%}.")
    text = "\n".join(lines)
    print(text)
    if a.md:
        open(a.md, "w").write(text + "\n")


if __name__ == "__main__":
    main()

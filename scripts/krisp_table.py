#!/usr/bin/env python3
"""KRISP's metrics (HPCA'23, Fig. 13/14, Table IV) from `kairos bench run custom --arrival closed:1` outputs.

    python3 scripts/krisp_table.py RESULTS.json[#SUFFIX] [...] [--power power.csv] [--json out.json]

Each RESULTS.json is one model's sweep (`--models ARCH@bN --arrival closed:1 --loads 1,2,4`: load = closed-loop
workers), with the PyTorch peer merged in (`kairos bench report --results RESULTS.json --peers peers.json`); a
#SUFFIX appends /SUFFIX to that file's policy names (another setting of the same policies). Per model,
policy and worker count: completions per second, that throughput over one isolated worker's (kairos `streams` at
1 worker: the model alone on the whole GPU), p99 latency against the SLO (2x the isolated worker's p99, KRISP's
choice), energy per inference (mean GPU power over the point's wall-clock window, from --power, divided by its
throughput), and the policy's time per launch on the dispatcher thread (ns). Last, per model and policy, the most workers that met the SLO (KRISP's Table IV).

--power: `unix_ms,watts` lines, as the device scripts write them from `nvidia-smi --query-gpu=power.draw -lms 100`.
"""
import argparse, bisect, json, sys


def load_power(path):
    if not path:
        return [], []
    ts, ws = [], []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                t, w = int(parts[0]), float(parts[1])
            except (ValueError, IndexError):
                continue
            ts.append(t)
            ws.append(w)
    order = sorted(range(len(ts)), key=lambda i: ts[i])
    return [ts[i] for i in order], [ws[i] for i in order]


def mean_power(ts, ws, start_ms, end_ms):
    """Mean of the samples in [start_ms, end_ms], or None."""
    if start_ms is None or not ts:
        return None
    i, j = bisect.bisect_left(ts, start_ms), bisect.bisect_right(ts, end_ms)
    return sum(ws[i:j]) / (j - i) if j > i else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--power")
    ap.add_argument("--json")
    a = ap.parse_args()
    ts, ws = load_power(a.power)
    rows, best = [], []
    by_model = {}  # model -> points (policy names suffixed by the file's #SUFFIX)
    for arg in a.results:
        path, _, suffix = arg.partition("#")
        res = json.load(open(path))
        for pr in res["presets"]:
            for p in pr["points"]:
                ms = p["metrics"]["models"]
                model = ms[0]["name"].split("/")[0] if ms else pr["preset"]
                if suffix:
                    p = dict(p, policy=f"{p['policy']}/{suffix}")
                by_model.setdefault(model, []).append(p)
    for model, pts in by_model.items():
        iso = next((p for p in pts if p["policy"] == "streams" and p["load"] == 1), None)
        if iso is None:
            print(f"{model}: no streams point at 1 worker (the isolated reference); skipped", file=sys.stderr)
            continue
        iso_tput = iso["metrics"]["overall"]["throughput_per_s"]
        slo_ms = 2 * iso["metrics"]["overall"]["latency"]["p99_ns"] / 1e6
        met = {}
        for p in sorted(pts, key=lambda p: (p["policy"], p["load"])):
            o = p["metrics"]["overall"]
            tput = o["throughput_per_s"]
            p99 = o["latency"]["p99_ns"] / 1e6
            start = p.get("started_unix_ms")
            watts = mean_power(ts, ws, start, start + p["wall_s"] * 1000) if start else None
            workers = int(round(p["load"]))
            ok = p99 <= slo_ms
            if ok:
                met[p["policy"]] = max(met.get(p["policy"], 0), workers)
            else:
                met.setdefault(p["policy"], 0)
            rows.append({
                "model": model, "policy": p["policy"], "workers": workers, "completed": o["completed"],
                "per_s": tput, "x_isolated": tput / iso_tput if iso_tput else float("nan"),
                "p50_ms": o["latency"]["p50_ns"] / 1e6, "p99_ms": p99, "slo_ms": slo_ms, "slo_met": ok,
                "watts": watts, "j_per_inference": watts / tput if watts and tput else None,
                "policy_ns_per_launch": (d["policy_ns"] / d["launches"]) if (d := p.get("dispatcher")) and d.get("launches") else None,
            })
        for pol, n in sorted(met.items()):
            best.append({"model": model, "policy": pol, "workers_within_slo": n})
    hdr = f"{'model':<18} {'policy':<20} {'wk':>2} {'done':>6} {'req/s':>8} {'x iso':>6} {'p50 ms':>7} {'p99 ms':>7} {'SLO':>7} {'W':>6} {'J/inf':>7} {'pol ns':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        w = f"{r['watts']:.0f}" if r["watts"] else "-"
        j = f"{r['j_per_inference']:.3f}" if r["j_per_inference"] else "-"
        slo = f"{'ok' if r['slo_met'] else 'MISS'} {r['slo_ms']:.1f}"
        pol = f"{r['policy_ns_per_launch']:.0f}" if r["policy_ns_per_launch"] else "-"
        print(f"{r['model']:<18} {r['policy']:<20} {r['workers']:>2} {r['completed']:>6} {r['per_s']:>8.1f} {r['x_isolated']:>6.2f} "
              f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {slo:>7} {w:>6} {j:>7} {pol:>6}")
    print()
    print("most workers within the SLO (2x isolated p99):")
    for b in best:
        print(f"  {b['model']:<18} {b['policy']:<20} {b['workers_within_slo']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "workers_within_slo": best}, f, indent=1)


if __name__ == "__main__":
    main()

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

A RESULTS.json whose points serve two (or more) models is a pair of different models (KRISP's Fig. 14: one
closed-loop worker per model, scripts/krisp-bench.sh's PAIRS). Per pair and policy: each model's throughput over
ITS OWN isolated worker (from that model's sweep among the inputs; left blank, and said so, where there is none),
their sum (KRISP's normalised throughput: 2.00 = both models at isolated speed), each model's p99 against its own
SLO and whether all met theirs, and energy per inference (the pair's mean power over its total throughput). Then
per policy over the pairs (points at load 1): the mean normalised throughput and the pairs within the SLO. The
workers and how they are laid out come from the point's trace (traces/ beside the results), where it is there.

--power: `unix_ms,watts` lines, as the device scripts write them from `nvidia-smi --query-gpu=power.draw -lms 100`.
"""
import argparse, bisect, json, os, sys


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


def point_watts(ts, ws, p):
    start = p.get("started_unix_ms")
    return mean_power(ts, ws, start, start + p["wall_s"] * 1000) if start else None


def isolated_point(pts):
    """The isolated reference of a model's sweep: kairos `streams` at 1 worker, or None."""
    return next((p for p in pts if p["policy"] == "streams" and p["load"] == 1), None)


def is_pair(res):
    """Whether a results file's points serve more than one model (a pair, not a one-model sweep)."""
    return any(len(p["metrics"]["models"]) > 1 for pr in res["presets"] for p in pr["points"])


def trace_layout(path, cache):
    """(workers, description, stream models in order) of a point's trace, or (None, None, None)."""
    if path not in cache:
        cache[path] = (None, None, None)
        try:
            t = json.load(open(path))
            streams = [s["model"] for s in t["streams"]]
            closed = [s for s in t["sources"] if s["arrival"]["kind"] == "closed_loop"]
            workers = sum(s["arrival"]["clients"] for s in closed)
            if closed and len(closed) == len(t["sources"]) and len(closed) == len(streams) \
                    and all(s["arrival"]["clients"] == 1 and len(s["streams"]) == 1 for s in closed):
                what = "one closed-loop worker per model"
            elif closed:
                what = f"{workers} closed-loop client{'s' if workers != 1 else ''}, each request's model drawn at random (NOT one worker per model)"
            else:
                what = "open-loop arrivals"
            cache[path] = (workers, what, streams)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return cache[path]


def pair_tables(pairs, by_model, ts, ws):
    """KRISP Fig. 14 rows (one per pair and policy point) and the per-policy summary."""
    refs = {}
    for model, pts in by_model.items():
        iso = isolated_point(pts)
        if iso is not None:
            o = iso["metrics"]["overall"]
            refs[model] = (o["throughput_per_s"], 2 * o["latency"]["p99_ns"] / 1e6)
    rows, traces = [], {}
    for path, pts in pairs:
        order = []
        for p in pts:
            _, _, streams = trace_layout(os.path.join(os.path.dirname(path), "traces", p.get("trace") or ""), traces)
            for m in (streams or []) + [m["name"].split("/")[0] for m in p["metrics"]["models"]]:
                if m not in order:
                    order.append(m)
        for p in sorted(pts, key=lambda p: (p["policy"], p["load"])):
            o = p["metrics"]["overall"]
            workers, layout, _ = trace_layout(os.path.join(os.path.dirname(path), "traces", p.get("trace") or ""), traces)
            stats = {m["name"].split("/")[0]: m for m in p["metrics"]["models"]}
            models = []
            for name in order:
                m = stats.get(name)
                if m is None:
                    continue
                tput, p99 = m["throughput_per_s"], m["latency"]["p99_ns"] / 1e6
                ref = refs.get(name)
                models.append({
                    "model": name, "group": m["name"].partition("/")[2], "completed": m["completed"], "per_s": tput,
                    "isolated_per_s": ref[0] if ref else None,
                    "x_isolated": (tput / ref[0] if ref[0] else float("nan")) if ref else None,
                    "p99_ms": p99, "slo_ms": ref[1] if ref else None, "slo_met": (p99 <= ref[1]) if ref else None,
                })
            xs = [m["x_isolated"] for m in models]
            verdicts = [m["slo_met"] for m in models]
            watts = point_watts(ts, ws, p)
            tput = o["throughput_per_s"]
            rows.append({
                "pair": "+".join(order), "file": path, "policy": p["policy"], "load": p["load"], "workers": workers,
                "layout": layout, "models": models, "per_s": tput,
                "sum_x_isolated": sum(xs) if xs and None not in xs else None,
                "slo_met": False if False in verdicts else (None if None in verdicts else True),
                "watts": watts, "j_per_inference": watts / tput if watts and tput else None,
            })
    summary = {}
    for r in rows:
        if r["load"] != 1:
            continue
        s = summary.setdefault(r["policy"], {"policy": r["policy"], "pairs": 0, "sums": [], "within_slo": 0, "slo_unknown": 0})
        s["pairs"] += 1
        if r["sum_x_isolated"] is not None:
            s["sums"].append(r["sum_x_isolated"])
        if r["slo_met"] is None:
            s["slo_unknown"] += 1
        elif r["slo_met"]:
            s["within_slo"] += 1
    out = []
    for pol in sorted(summary):
        s = summary[pol]
        sums = s.pop("sums")
        s["pairs_normalised"] = len(sums)
        s["mean_sum_x_isolated"] = sum(sums) / len(sums) if sums else None
        out.append(s)
    return rows, out, refs


def print_pairs(rows, summary, refs):
    print()
    print("pairs of different models (KRISP Fig. 14): each model's throughput over its own isolated worker (kairos streams")
    print("at 1 worker, from its sweep), their sum (2.00 = both at isolated speed), each p99 against 2x its isolated p99")
    last = None
    for r in rows:
        if (r["file"], r["pair"]) != last:
            last = (r["file"], r["pair"])
            names = [m["model"] for m in r["models"]]
            print()
            print(f"{r['pair']}  ({r['file']}; {r['layout'] or 'no trace beside it: worker layout unknown'})")
            groups = {m["group"] for m in r["models"]}
            for k, m in enumerate(r["models"]):
                tag = chr(ord("A") + k)
                ref = refs.get(m["model"])
                cls = f" ({m['group']})" if len(groups) > 1 else ""
                if ref:
                    print(f"  {tag} {m['model']}{cls}: isolated {ref[0]:.1f}/s, SLO {ref[1]:.2f} ms")
                else:
                    print(f"  {tag} {m['model']}{cls}: no sweep of it among the inputs (no isolated reference): x iso and SLO left blank")
            if len(groups) > 1:
                print("  classes differ: a real-time model ranks first under paella and gets the high-priority CUDA streams")
            hdr = f"  {'policy':<20} {'wk':>2}"
            for k in range(len(names)):
                t = chr(ord("A") + k)
                hdr += f" {t + ' req/s':>8} {t + ' x':>5} {t + ' p99':>7} {'SLO':>4}"
            hdr += f" {'sum x':>6} {'both':>5} {'req/s':>8} {'W':>5} {'J/inf':>7}"
            print(hdr)
            print("  " + "-" * (len(hdr) - 2))
        line = f"  {r['policy']:<20} {r['workers'] if r['workers'] is not None else '-':>2}"
        for m in r["models"]:
            x = f"{m['x_isolated']:.2f}" if m["x_isolated"] is not None else "-"
            ok = "-" if m["slo_met"] is None else ("ok" if m["slo_met"] else "MISS")
            line += f" {m['per_s']:>8.1f} {x:>5} {m['p99_ms']:>7.2f} {ok:>4}"
        s = f"{r['sum_x_isolated']:.2f}" if r["sum_x_isolated"] is not None else "-"
        both = "-" if r["slo_met"] is None else ("ok" if r["slo_met"] else "MISS")
        w = f"{r['watts']:.0f}" if r["watts"] else "-"
        j = f"{r['j_per_inference']:.3f}" if r["j_per_inference"] else "-"
        line += f" {s:>6} {both:>5} {r['per_s']:>8.1f} {w:>5} {j:>7}"
        if r["load"] != 1:
            line += f"  (load {r['load']:g})"
        print(line)
    print()
    print("pairs per policy (load 1): mean normalised throughput (sum of x iso over the pairs with both references),")
    print("pairs with every model within its SLO")
    print(f"  {'policy':<20} {'pairs':>5} {'mean sum x':>10} {'within SLO':>10}")
    for s in summary:
        m = f"{s['mean_sum_x_isolated']:.2f}" if s["mean_sum_x_isolated"] is not None else "-"
        if s["pairs_normalised"] != s["pairs"]:
            m += f" ({s['pairs_normalised']})"
        within = f"{s['within_slo']}/{s['pairs'] - s['slo_unknown']}"
        extra = f"  ({s['slo_unknown']} without a reference)" if s["slo_unknown"] else ""
        print(f"  {s['policy']:<20} {s['pairs']:>5} {m:>10} {within:>10}{extra}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--power")
    ap.add_argument("--json")
    a = ap.parse_args()
    ts, ws = load_power(a.power)
    rows, best = [], []
    by_model = {}  # model -> points (policy names suffixed by the file's #SUFFIX)
    pairs = []  # (path, points) of the files that serve several models at once
    for arg in a.results:
        path, _, suffix = arg.partition("#")
        res = json.load(open(path))
        pair = is_pair(res)
        pair_pts = []
        for pr in res["presets"]:
            for p in pr["points"]:
                ms = p["metrics"]["models"]
                model = ms[0]["name"].split("/")[0] if ms else pr["preset"]
                if suffix:
                    p = dict(p, policy=f"{p['policy']}/{suffix}")
                if pair:
                    pair_pts.append(p)
                else:
                    by_model.setdefault(model, []).append(p)
        if pair:
            pairs.append((path, pair_pts))
    for model, pts in by_model.items():
        iso = isolated_point(pts)
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
            watts = point_watts(ts, ws, p)
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
    if by_model or not pairs:
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
    out = {"rows": rows, "workers_within_slo": best}
    if pairs:
        pair_rows, pair_summary, refs = pair_tables(pairs, by_model, ts, ws)
        print_pairs(pair_rows, pair_summary, refs)
        out["pairs"] = {"rows": pair_rows, "summary": pair_summary}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

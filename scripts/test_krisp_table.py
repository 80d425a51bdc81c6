#!/usr/bin/env python3
"""Tests of scripts/krisp_table.py on small synthetic results (no GPU, no kairos binary).

    python3 scripts/test_krisp_table.py    # exits non-zero on a failure

Two one-model sweeps (A, B: `custom --models M --arrival closed:1 --loads 1,2`), a pair A+B (one closed-loop
worker per model, with a trace beside it and the PyTorch peer merged in), a pair C+A whose C has no sweep, and
a power log: the pair's per-model normalisation over each model's own isolated worker, their sum, the SLO
verdicts (2x each model's isolated p99, inclusive), energy per inference and the per-policy summary, worked out
by hand below; and the per-model table untouched by the pairs.
"""
import json, math, os, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(HERE, "krisp_table.py")
T0 = 1_800_000_000_000  # unix ms of the first point
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")


def near(a, b, tol=1e-9):
    return a is not None and b is not None and math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def stats(name, tput, p99_ms, completed=100):
    return {"name": name, "completed": completed, "throughput_per_s": tput,
            "latency": {"p50_ns": int(p99_ms * 5e5), "p99_ns": int(round(p99_ms * 1e6))}}


def point(policy, load, models, start_ms, system="kairos", trace="custom-load1.trace.json"):
    """A point of `kairos bench run` (the fields krisp_table.py reads); models: [(name/group, req/s, p99 ms)]."""
    ms = [stats(n, t, p) for n, t, p in models]
    total = sum(t for _, t, _ in models)
    overall = stats("all", total, max(p for _, _, p in models), completed=100 * len(ms))
    p = {"preset": "custom", "variant": "", "system": system, "policy": policy, "load": float(load),
         "metrics": {"overall": overall, "models": ms}, "wall_s": 1.0, "started_unix_ms": start_ms, "trace": trace}
    if system == "kairos":
        p["dispatcher"] = {"launches": 1000, "policy_ns": 500_000}
    return p


def results(points):
    return {"format": "kairos-bench/1", "presets": [{"preset": "custom", "points": points}]}


def write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def run(args):
    r = subprocess.run([sys.executable, TABLE] + args, capture_output=True, text=True)
    check(r.returncode == 0, f"krisp_table.py {' '.join(args)} exits 0 (stderr: {r.stderr.strip()})")
    return r.stdout


def main():
    with tempfile.TemporaryDirectory() as d:
        # A: isolated 1000/s, p99 1 ms (SLO 2 ms). B: isolated 200/s, p99 5 ms (SLO 10 ms).
        a = os.path.join(d, "A@b1", "results.json")
        b = os.path.join(d, "B@b1", "results.json")
        write(a, results([
            point("streams", 1, [("A@b1/be", 1000.0, 1.0)], T0),
            point("streams", 2, [("A@b1/be", 1800.0, 1.5)], T0 + 2000),
            point("paella", 1, [("A@b1/be", 950.0, 2.5)], T0 + 4000),
        ]))
        write(b, results([
            point("streams", 1, [("B@b1/be", 200.0, 5.0)], T0 + 6000),
            point("streams", 2, [("B@b1/be", 300.0, 12.0)], T0 + 8000),
        ]))
        # Pair A+B at 2 workers, one per model; power 200 W inside the streams point's window [T0+10000, +1000].
        ab_dir = os.path.join(d, "pair-A@b1+B@b1")
        ab = os.path.join(ab_dir, "results.json")
        write(ab, results([
            # 800/1000 + 150/200 = 0.80 + 0.75 = 1.55; A 1.9 <= 2, B 10.0 <= 10 (inclusive): both ok.
            point("streams", 1, [("B@b1/be", 150.0, 10.0), ("A@b1/be", 800.0, 1.9)], T0 + 10000),
            # 900/1000 + 180/200 = 0.90 + 0.90 = 1.80; A 2.5 > 2: MISS.
            point("krisp", 1, [("B@b1/be", 180.0, 6.0), ("A@b1/be", 900.0, 2.5)], T0 + 12000),
            # The PyTorch peer: 500/1000 + 100/200 = 1.00; both ok.
            point("pytorch-graph4", 1, [("B@b1/be", 100.0, 4.0), ("A@b1/be", 500.0, 1.0)], T0 + 14000, system="pytorch"),
            # Another load (not what krisp-bench.sh runs): a row of its own, left out of the summary.
            point("streams", 2, [("B@b1/be", 100.0, 20.0), ("A@b1/be", 100.0, 20.0)], T0 + 20000, trace="custom-load2.trace.json"),
        ]))
        write(os.path.join(ab_dir, "traces", "custom-load1.trace.json"), {
            "format": "kairos-trace/1",
            "streams": [{"name": "A@b1", "model": "A@b1", "class": "be"}, {"name": "B@b1", "model": "B@b1", "class": "be"}],
            "sources": [{"arrival": {"kind": "closed_loop", "clients": 1, "think_ns": 0}, "streams": [[0, 1.0]]},
                        {"arrival": {"kind": "closed_loop", "clients": 1, "think_ns": 0}, "streams": [[1, 1.0]]}],
            "arrivals": {"t_ns": [], "stream": []},
        })
        # Pair C+A, no trace beside it, C without a sweep: C's x iso and SLO unknown.
        ca = os.path.join(d, "pair-C@b1+A@b1", "results.json")
        write(ca, results([
            point("streams", 1, [("C@b1/be", 300.0, 3.0), ("A@b1/be", 700.0, 1.0)], T0 + 16000),  # A ok, C unknown
            point("krisp", 1, [("C@b1/be", 300.0, 3.0), ("A@b1/be", 700.0, 3.0)], T0 + 18000),  # A MISS
        ]))
        power = os.path.join(d, "power.csv")
        with open(power, "w") as f:
            f.write("garbage line\n")
            for t in range(T0 + 9000, T0 + 11500, 100):
                f.write(f"{t},{200.0 if T0 + 10000 <= t <= T0 + 11000 else 999.0}\n")

        # The old inputs alone: no pairs anywhere.
        out_old = os.path.join(d, "old.json")
        text_old = run([a, b, "--power", power, "--json", out_old])
        old = json.load(open(out_old))
        check("pairs" not in old, "no pairs key without pair inputs")
        check("pairs of different models" not in text_old, "no pair section without pair inputs")

        out = os.path.join(d, "t.json")
        text = run([a, b, ab, ca, "--power", power, "--json", out])
        j = json.load(open(out))
        check(j["rows"] == old["rows"] and j["workers_within_slo"] == old["workers_within_slo"],
              "per-model rows unchanged by the pair inputs")
        check(text.startswith(text_old), "per-model text unchanged by the pair inputs")
        check({r["model"] for r in j["rows"]} == {"A@b1", "B@b1"}, "pair files stay out of the per-model rows")
        a2 = next(r for r in j["rows"] if r["model"] == "A@b1" and r["policy"] == "streams" and r["workers"] == 2)
        check(near(a2["x_isolated"], 1.8), f"A at 2 workers is 1.8x isolated, got {a2['x_isolated']}")

        check(len(j["pairs"]["rows"]) == 6, f"6 pair rows, got {len(j['pairs']['rows'])}")
        rows = {(r["pair"], r["policy"]): r for r in j["pairs"]["rows"] if r["load"] == 1}
        s = rows.get(("A@b1+B@b1", "streams"))
        check(s is not None, "A+B streams row (named in the trace's stream order)")
        if s:
            by = {m["model"]: m for m in s["models"]}
            check([m["model"] for m in s["models"]] == ["A@b1", "B@b1"], "models in the trace's order")
            check(near(by["A@b1"]["x_isolated"], 0.8) and near(by["B@b1"]["x_isolated"], 0.75), "A 0.80x, B 0.75x")
            check(near(s["sum_x_isolated"], 1.55), f"A+B streams sum 1.55, got {s['sum_x_isolated']}")
            check(near(by["A@b1"]["slo_ms"], 2.0) and near(by["B@b1"]["slo_ms"], 10.0), "SLOs 2 ms and 10 ms")
            check(by["A@b1"]["slo_met"] is True and by["B@b1"]["slo_met"] is True, "A 1.9 ms and B 10.0 ms meet their SLOs")
            check(s["slo_met"] is True, "A+B streams within the SLO")
            check(s["workers"] == 2 and s["layout"] == "one closed-loop worker per model", f"2 workers, one per model: {s['layout']}")
            check(near(s["watts"], 200.0) and near(s["j_per_inference"], 200.0 / 950.0), f"200 W / 950 req/s, got {s['j_per_inference']}")
        k = rows.get(("A@b1+B@b1", "krisp"))
        check(k is not None and near(k["sum_x_isolated"], 1.8), "A+B krisp sum 1.80")
        check(k is not None and k["slo_met"] is False and k["models"][0]["slo_met"] is False and k["models"][1]["slo_met"] is True,
              "A+B krisp: A misses (2.5 > 2 ms), B meets, the pair misses")
        pt = rows.get(("A@b1+B@b1", "pytorch-graph4"))
        check(pt is not None and near(pt["sum_x_isolated"], 1.0) and pt["slo_met"] is True, "PyTorch peer row: sum 1.00, within SLO")
        check(pt is not None and pt["watts"] is None, "no power samples in the peer's window: no watts")
        c = rows.get(("C@b1+A@b1", "streams"))
        check(c is not None and c["sum_x_isolated"] is None and c["slo_met"] is None, "C+A streams: no sum, verdict unknown")
        check(c is not None and c["models"][0]["x_isolated"] is None and near(c["models"][1]["x_isolated"], 0.7), "C blank, A 0.70x")
        check(c is not None and c["workers"] is None, "no trace: workers unknown")
        ck = rows.get(("C@b1+A@b1", "krisp"))
        check(ck is not None and ck["slo_met"] is False, "C+A krisp: A misses, so the pair misses though C is unknown")
        check("C@b1: no sweep of it among the inputs" in text, "says that C has no sweep")

        summ = {x["policy"]: x for x in j["pairs"]["summary"]}
        st, kr, py = summ.get("streams"), summ.get("krisp"), summ.get("pytorch-graph4")
        check(st is not None and st["pairs"] == 2 and st["pairs_normalised"] == 1 and near(st["mean_sum_x_isolated"], 1.55)
              and st["within_slo"] == 1 and st["slo_unknown"] == 1, f"streams summary: {st}")
        check(kr is not None and kr["pairs"] == 2 and near(kr["mean_sum_x_isolated"], 1.8) and kr["within_slo"] == 0
              and kr["slo_unknown"] == 0, f"krisp summary: {kr}")
        check(py is not None and py["pairs"] == 1 and near(py["mean_sum_x_isolated"], 1.0) and py["within_slo"] == 1,
              f"pytorch summary: {py}")
        line = next((l for l in text.splitlines() if l.strip().startswith("streams") and "1.55" in l), None)
        check(line is not None and " ok " in line, "the A+B streams text row shows 1.55 and ok")

        # A #SUFFIX renames a pair file's policies as it does a sweep's.
        js = os.path.join(d, "s.json")
        run([a, b, ab + "#g", "--json", js])
        pols = {r["policy"] for r in json.load(open(js))["pairs"]["rows"]}
        check(pols == {"streams/g", "krisp/g", "pytorch-graph4/g"}, f"suffixed pair policies: {pols}")

        # Only pair files (and no sweeps): no per-model table, every normalisation blank.
        text_only = run([ab])
        check(not text_only.startswith("model "), "no per-model table without sweeps")
    if failures:
        print(f"test_krisp_table.py: {len(failures)} failure(s)")
        sys.exit(1)
    print("test_krisp_table.py: ok")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""REEF's metrics from `kairos bench run disb-*` outputs and the PyTorch peer, in one table.

    python3 scripts/reef_table.py DIR[=TAG] [DIR[=TAG] ...] [--peers peers.json ...] [--json out.json] [--matrix]

Each DIR is a `kairos bench run` output folder (raw/*.raw.json per point, traces/*.trace.json). Runs
of the variant `rt-only` (`--rt-only`) are the RT-Only reference (a variant's other parts, e.g.
`rt-rate=220` from `--rt-rate`, name the workload: `disb-b@rt-rate=220`): each system's real-time latency
is divided by the same system's RT-Only latency on the same workload (kairos: the `reef` RT-Only
run, or the policy's own when there is one; a peer mode: its replay of the rt-only trace). Only
requests that arrived in the measured window (after the warm-up) count. A DIR=TAG argument appends
TAG to its systems' names (runs of one policy under other settings, e.g. `reef host-flag`). Per row: real-time requests
done, their mean / p50 / p99 latency (ms) and the ratios to RT-Only, arrival to first block taken
(us, kairos only), real-time, best-effort and overall completions per second, overall throughput
over RT-Only's, best-effort completions over kairos `streams`' on the same workload, best-effort p99 (ms), preemptions
and launches confined by an SM mask (kairos: `reef`'s padding; empty where the run predates the counter). REEF reports RT mean latency and overall throughput; its overall throughput counts best-effort
requests *normalised* to real-time ones (REEF section 7, footnote 5: BE throughput x BE latency alone / RT
latency alone). With the models' isolated latencies in results.json (`isolated_ms`, measured by the DISB
presets), `BEn/s` is that normalised best-effort throughput (each best-effort completion weighted by its
model's isolated latency over the mean isolated latency of the workload's real-time requests) and `alln/RTo`
the overall throughput so normalised over RT-Only's; the peer's rows use kairos' isolated latencies of the
same workload (the weights convert requests to work; they are not the peer's latencies).

`reef-pairs` (REEF's padding experiment, section 7.4): variants `rt=M,be=N`; the RT-Only reference of
a pair is the run of variant `rt=M,rt-only`. `--matrix` also prints REEF's Fig. 16 as 5x5 matrices
(real-time model per row, best-effort model per column, each system): real-time mean latency over
RT-Only, real-time p99 over RT-Only, and overall normalised throughput over RT-Only, with averages.
`1st issue` (kairos only, where recorded): arrival at the dispatcher to the real-time request's first
launch call, the host's part of `1st blk`.
"""
import argparse, glob, json, os, sys


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def model_of(stream):
    """A DISB stream's model: its name without the class suffix (`vgg19-rt` -> `vgg19`)."""
    return stream.rsplit("-", 1)[0]


def summarize(streams, rows, warmup_ns, duration_ns, isolated_ms=None):
    """rows: (stream index, arrival_ns, done_ns or None, first_block_ns or None). isolated_ms: the
    models' isolated latencies (REEF's normalisation of best-effort throughput), or None."""
    rt_lat, be_lat, first, issue, rt_done, be_done = [], [], [], [], 0, 0
    rt_iso, be_iso = [], []
    for row in rows:
        s, a, d, fb = row[:4]
        fi = row[4] if len(row) > 4 else None
        if a < warmup_ns or a >= duration_ns or d is None:
            continue
        iso = (isolated_ms or {}).get(model_of(streams[s]))
        if streams[s].endswith("-rt"):
            rt_lat.append((d - a) / 1e6)
            rt_done += 1
            rt_iso.append(iso)
            if fb is not None:
                first.append(fb / 1e3)
            if fi is not None:
                issue.append(fi / 1e3)
        else:
            be_done += 1
            be_lat.append((d - a) / 1e6)
            be_iso.append(iso)
    window_s = (duration_ns - warmup_ns) / 1e9
    mean = sum(rt_lat) / len(rt_lat) if rt_lat else float("nan")
    # REEF's normalisation: a best-effort completion counts as its model's isolated latency over
    # the real-time requests' mean isolated latency (the workload's RT-Only run supplies the latter
    # when this run has no real-time request; see main).
    be_norm = float("nan")
    if be_iso and None not in be_iso and rt_iso and None not in rt_iso:
        be_norm = sum(be_iso) / (sum(rt_iso) / len(rt_iso)) / window_s
    elif not be_iso:
        be_norm = 0.0
    return {
        "rt_done": rt_done,
        "rt_mean_ms": mean,
        "rt_p50_ms": pct(rt_lat, 0.5),
        "rt_p99_ms": pct(rt_lat, 0.99),
        "first_block_p50_us": pct(first, 0.5),
        "first_block_p99_us": pct(first, 0.99),
        "first_issue_p50_us": pct(issue, 0.5),
        "first_issue_p99_us": pct(issue, 0.99),
        "be_p99_ms": pct(be_lat, 0.99),
        "rt_per_s": rt_done / window_s,
        "be_per_s": be_done / window_s,
        "be_norm_per_s": be_norm,
        "total_per_s": (rt_done + be_done) / window_s,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--peers", nargs="*", default=[])
    ap.add_argument("--json")
    ap.add_argument("--matrix", action="store_true", help="reef-pairs: REEF's Fig. 16 as 5x5 matrices")
    a = ap.parse_args()
    rows = {}  # (workload, system, "rt-only" or "") -> summary

    def key(preset, variant):
        """(workload, "rt-only" or ""): the variant's rt-only part apart, the rest names the workload."""
        parts = [p for p in (variant or "").split(",") if p]
        rest = [p for p in parts if p != "rt-only"]
        return preset + ("@" + ",".join(rest) if rest else ""), ("rt-only" if "rt-only" in parts else "")

    def rt_only_of(workload):
        """The workload whose rt-only run is this one's reference: itself, or for a reef-pairs
        pair (`reef-pairs@rt=M,be=N`) the real-time model alone (`reef-pairs@rt=M`)."""
        preset, _, rest = workload.partition("@")
        kept = [p for p in rest.split(",") if p and not p.startswith("be=")]
        return preset + ("@" + ",".join(kept) if kept else "")

    traces = {}
    isolated = {}  # preset -> model -> isolated latency, ms
    for arg in a.dirs:
        d, _, tag = arg.partition("=")
        suffix = " " + tag if tag else ""
        for f in glob.glob(os.path.join(d, "traces", "*.trace.json")):
            traces[os.path.basename(f)] = json.load(open(f))
        stats = {}
        res = os.path.join(d, "results.json")
        if os.path.exists(res):
            for p in json.load(open(res))["presets"]:
                isolated.setdefault(p["preset"], {}).update(p.get("isolated_ms") or {})
                for pt in p["points"]:
                    stats[(p["preset"], pt["policy"], pt.get("variant", ""), pt["load"])] = pt.get("dispatcher") or {}
        for f in sorted(glob.glob(os.path.join(d, "raw", "*.raw.json"))):
            r = json.load(open(f))
            fb = r.get("first_block_ns") or [None] * len(r["stream"])
            fi = r.get("first_issue_ns") or [None] * len(r["stream"])
            s = summarize(r["streams"], list(zip(r["stream"], r["arrival_ns"], r["done_ns"], fb, fi)), r["warmup_ns"], r["duration_ns"],
                          isolated.get(r["preset"]))
            st = stats.get((r["preset"], r["policy"], r["variant"], r["load"]), {})
            s["preemptions"], s["masked"] = st.get("preemptions"), st.get("masked_launches")
            s["load"] = r["load"]
            workload, rt_only = key(r["preset"], r["variant"])
            rows[(workload, "kairos " + r["policy"] + suffix, rt_only)] = s
    for pf in a.peers:
        for run in json.load(open(pf)).get("runs", []):
            t = traces.get(os.path.basename(run["trace"]))
            if t is None:
                continue
            names = [s["name"] for s in t["streams"]]
            s = summarize(names, list(zip(run["stream"], run["arrival_ns"], run["done_ns"], [None] * len(run["stream"]))),
                          t["warmup_ns"], t["duration_ns"], isolated.get(t["preset"]))
            s["preemptions"], s["masked"], s["load"] = None, None, t["load"]
            workload, rt_only = key(t["preset"], t["variant"])
            rows[(workload, "pytorch " + run["mode"], rt_only)] = s
    out = []
    ww = max([12] + [len(w.removeprefix("disb-")) for w, _, _ in rows])
    hdr = (f"{'workload':<{ww}} {'system':<30} {'RT n':>5} {'mean':>6} {'p50':>6} {'p99':>6} {'mean/RTo':>8} {'p99/RTo':>7} "
           f"{'1st blk p50':>11} {'p99 us':>7} {'1st issue p50':>13} {'p99 us':>7} {'RT/s':>6} {'BE/s':>6} {'all/s':>6} {'all/RTo':>7} {'BEn/s':>6} {'alln/RTo':>8} {'BE/str':>6} "
           f"{'BE p99':>6} {'preempt':>7} {'masked':>7}")
    print(hdr)
    for (preset, system, variant), s in sorted(rows.items()):
        base = rt_only_of(preset)
        ref = rows.get((base, system, "rt-only")) or rows.get((base, "kairos reef", "rt-only"))
        if system.startswith("pytorch"):
            ref = rows.get((base, system, "rt-only"))
        r_mean = s["rt_mean_ms"] / ref["rt_mean_ms"] if ref and variant != "rt-only" else float("nan")
        r_p99 = s["rt_p99_ms"] / ref["rt_p99_ms"] if ref and variant != "rt-only" else float("nan")
        r_all = s["total_per_s"] / ref["total_per_s"] if ref and variant != "rt-only" else float("nan")
        r_all_norm = (s["rt_per_s"] + s["be_norm_per_s"]) / ref["rt_per_s"] if ref and ref["rt_per_s"] > 0 and variant != "rt-only" else float("nan")
        streams = rows.get((preset, "kairos streams", ""))
        be_str = s["be_per_s"] / streams["be_per_s"] if streams and streams["be_per_s"] > 0 and variant != "rt-only" else float("nan")
        label = system + (" [RT-Only]" if variant == "rt-only" else "")
        pre = "" if s["preemptions"] is None else str(s["preemptions"])
        masked = "" if s["masked"] is None else str(s["masked"])
        print(f"{preset.removeprefix('disb-'):<{ww}} {label:<30} {s['rt_done']:>5} {s['rt_mean_ms']:>6.2f} {s['rt_p50_ms']:>6.2f} {s['rt_p99_ms']:>6.2f} "
              f"{r_mean:>8.3f} {r_p99:>7.3f} {s['first_block_p50_us']:>11.1f} {s['first_block_p99_us']:>7.1f} "
              f"{s['first_issue_p50_us']:>13.1f} {s['first_issue_p99_us']:>7.1f} {s['rt_per_s']:>6.1f} "
              f"{s['be_per_s']:>6.1f} {s['total_per_s']:>6.1f} {r_all:>7.2f} {s['be_norm_per_s']:>6.1f} {r_all_norm:>8.2f} {be_str:>6.2f} "
              f"{s['be_p99_ms']:>6.1f} {pre:>7} {masked:>7}")
        out.append({"preset": preset, "system": system, "variant": variant, **s,
                    "rt_mean_over_rt_only": r_mean, "rt_p99_over_rt_only": r_p99, "total_over_rt_only": r_all, "total_normalised_over_rt_only": r_all_norm, "be_over_streams": be_str})
    if a.matrix:
        print_matrices(out)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1, default=str)


def print_matrices(out):
    """REEF's Fig. 16: per system and metric, real-time models as rows, best-effort ones as columns."""
    cells = {}  # (system, rt, be) -> row of `out`
    for o in out:
        preset, _, rest = o["preset"].partition("@")
        if preset != "reef-pairs" or o["variant"] == "rt-only":
            continue
        parts = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
        if "rt" in parts and "be" in parts:
            cells[(o["system"], parts["rt"], parts["be"])] = o
    if not cells:
        return
    order = ["vgg19", "resnet152", "densenet201", "inception_v3", "distilbert"]
    seen = lambda i: sorted({k[i] for k in cells}, key=lambda m: (order.index(m) if m in order else len(order), m))
    systems, rts, bes = seen(0), seen(1), seen(2)
    for metric, title in (("rt_mean_over_rt_only", "real-time mean latency / RT-Only"),
                          ("rt_p99_over_rt_only", "real-time p99 latency / RT-Only"),
                          ("total_normalised_over_rt_only", "overall throughput (best-effort normalised) / RT-Only")):
        for system in systems:
            print(f"\n{title}, {system} (rows: real-time model, columns: best-effort model)")
            print(f"{'':<14}" + "".join(f"{b[:12]:>13}" for b in bes) + f"{'mean':>9}")
            col = {b: [] for b in bes}
            every = []
            for r in rts:
                vals = []
                line = f"{r[:14]:<14}"
                for b in bes:
                    v = (cells.get((system, r, b)) or {}).get(metric)
                    ok = isinstance(v, float) and v == v
                    line += f"{v:>13.3f}" if ok else f"{'':>13}"
                    if ok:
                        vals.append(v)
                        col[b].append(v)
                        every.append(v)
                line += f"{sum(vals) / len(vals):>9.3f}" if vals else ""
                print(line)
            print(f"{'mean':<14}" + "".join(f"{sum(c) / len(c):>13.3f}" if c else f"{'':>13}" for c in col.values())
                  + (f"{sum(every) / len(every):>9.3f}" if every else ""))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Copy bandwidths of a multi-GPU host, measured with PyTorch: the facts DeepPlan's parallel transmission
(EuroSys'23, section 4.3.3) rests on, and the peer for `kairos inspect --gpus --measure`.

For every GPU g (all visible ones, or --gpus):
  h2d_alone[g]      pinned host -> GPU g, --mib MiB in one copy, nothing else running
  h2d_chunked[g]    the same bytes as --chunk-mib copies on one stream (as a pipelined cold start issues them)
For every ordered pair (a, b), a != b:
  peer_access       torch.cuda.can_device_access_peer(a, b)
  d2d[a->b]         GPU a -> GPU b, --mib MiB in one copy (NVLink if the pair has it; through the host otherwise)
For every pair {a, b}:
  h2d_both          pinned host -> a and pinned host -> b at the same time (each its own buffer and stream):
                    the time from the start of both to the end of the later; each GPU's own rate beside it
  parallel          DeepPlan's parallel-pipeline transmission by hand: the first half of the bytes host -> a,
                    the second half host -> b in --chunk-mib pieces, each piece forwarded b -> a on a
                    migration stream of b as soon as it has arrived (CUDA events per piece); time until the
                    last byte is on a, and the speed-up over h2d_chunked[a]

Each measure: --warmup untimed repetitions, then --reps timed ones, each started on idle GPUs and timed by the
host clock after synchronizing every GPU (CUDA events cannot time work spread over several devices); p50 / p10
/ p90 in ms and GB/s (10^9 bytes/s) from the p50. `nvidia-smi topo -m` and NVML's NVLink state are recorded
when present. JSON to --out, a table to stdout.

    python3 scripts/links_peer.py --out "$OUT/links_peer.json" [--mib 256] [--chunk-mib 2] [--reps 20]
"""
import argparse, datetime, json, subprocess, sys, time


def pcts(xs):
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]
    return {"p50": pick(0.5), "p10": pick(0.1), "p90": pick(0.9)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gpus", default=None, help="comma-separated ordinals (default: all)")
    ap.add_argument("--out", default="links_peer.json")
    a = ap.parse_args()
    import torch

    n = torch.cuda.device_count()
    gpus = [int(x) for x in a.gpus.split(",")] if a.gpus else list(range(n))
    nbytes = a.mib << 20
    chunk = a.chunk_mib << 20
    elems = nbytes // 2
    host = torch.empty(elems, dtype=torch.float16).pin_memory()
    host.uniform_()
    dev = {g: torch.empty(elems, dtype=torch.float16, device=f"cuda:{g}") for g in gpus}
    stage = {g: torch.empty(elems, dtype=torch.float16, device=f"cuda:{g}") for g in gpus}
    streams = {g: torch.cuda.Stream(device=g) for g in gpus}
    mig = {g: torch.cuda.Stream(device=g) for g in gpus}

    def sync_all():
        for g in gpus:
            torch.cuda.synchronize(g)

    def timed(fn):
        for _ in range(a.warmup):
            sync_all(); fn(); sync_all()
        out = []
        for _ in range(a.reps):
            sync_all()
            t0 = time.perf_counter()
            fn()
            sync_all()
            out.append((time.perf_counter() - t0) * 1e3)
        return pcts(out)

    def gbps(bytes_, ms):
        return round(bytes_ / (ms * 1e-3) / 1e9, 2)

    def h2d(g, lo=0, hi=None, chunked=False, dst=None):
        hi = elems if hi is None else hi
        dst = dev[g] if dst is None else dst
        step = (chunk // 2) if chunked else (hi - lo)
        with torch.cuda.stream(streams[g]):
            for s in range(lo, hi, step):
                e = min(hi, s + step)
                dst[s:e].copy_(host[s:e], non_blocking=True)

    rec = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
           "devices": [torch.cuda.get_device_name(g) for g in gpus], "mib": a.mib, "chunk_mib": a.chunk_mib,
           "reps": a.reps, "h2d_alone": {}, "h2d_chunked": {}, "d2d": {}, "peer_access": {}, "h2d_both": {},
           "parallel": {}}
    try:
        rec["topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except Exception as e:  # noqa: BLE001
        rec["topo"] = f"unavailable: {e}"
    try:
        import pynvml
        pynvml.nvmlInit()
        links = {}
        for g in gpus:
            h = pynvml.nvmlDeviceGetHandleByIndex(g)
            up = 0
            for l in range(18):
                try:
                    up += 1 if pynvml.nvmlDeviceGetNvLinkState(h, l) else 0
                except pynvml.NVMLError:
                    break
            links[str(g)] = up
        rec["nvlinks_up"] = links
    except Exception as e:  # noqa: BLE001
        rec["nvlinks_up"] = f"unavailable: {e}"

    for g in gpus:
        rec["h2d_alone"][str(g)] = t = timed(lambda: h2d(g))
        t["gbps"] = gbps(nbytes, t["p50"])
        rec["h2d_chunked"][str(g)] = t = timed(lambda: h2d(g, chunked=True))
        t["gbps"] = gbps(nbytes, t["p50"])
        print(f"GPU {g}: h2d {rec['h2d_alone'][str(g)]['gbps']} GB/s, chunked {t['gbps']} GB/s", file=sys.stderr)
    for x in gpus:
        for y in gpus:
            if x == y:
                continue
            key = f"{x}->{y}"
            rec["peer_access"][key] = bool(torch.cuda.can_device_access_peer(x, y))

            def d2d():
                with torch.cuda.stream(streams[x]):
                    dev[y].copy_(dev[x], non_blocking=True)
            rec["d2d"][key] = t = timed(d2d)
            t["gbps"] = gbps(nbytes, t["p50"])
            print(f"d2d {key}: {t['gbps']} GB/s (peer access {rec['peer_access'][key]})", file=sys.stderr)
    for i, x in enumerate(gpus):
        for y in gpus[i + 1:]:
            key = f"{x}+{y}"

            def both():
                h2d(x)
                h2d(y)
            rec["h2d_both"][key] = t = timed(both)
            t["gbps_total"] = gbps(2 * nbytes, t["p50"])
            half = (elems // 2 // (chunk // 2)) * (chunk // 2)

            def parallel(p=x, s=y):
                h2d(p, 0, half, chunked=True)
                step = chunk // 2
                for lo in range(half, elems, step):
                    hi = min(elems, lo + step)
                    with torch.cuda.stream(streams[s]):
                        stage[s][lo:hi].copy_(host[lo:hi], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(streams[s])
                    mig[s].wait_event(ev)
                    with torch.cuda.stream(mig[s]):
                        dev[p][lo:hi].copy_(stage[s][lo:hi], non_blocking=True)
            # correctness: the primary holds exactly the host bytes afterwards
            dev[x].zero_(); sync_all(); parallel(); sync_all()
            ok = bool(torch.equal(dev[x].cpu(), host))
            rec["parallel"][f"{x}<-{y}"] = t = timed(parallel)
            t["gbps"] = gbps(nbytes, t["p50"])
            t["speedup_over_chunked"] = round(rec["h2d_chunked"][str(x)]["p50"] / t["p50"], 3)
            t["bytes_match"] = ok
            print(f"parallel {x}<-{y}: {t['gbps']} GB/s, x{t['speedup_over_chunked']} (match {ok})", file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"{'measure':<22}{'p50 ms':>9}{'GB/s':>9}")
    for k in ("h2d_alone", "h2d_chunked", "d2d", "parallel"):
        for key, t in rec[k].items():
            print(f"{k + ' ' + key:<22}{t['p50']:>9.3f}{t['gbps']:>9.2f}")
    for key, t in rec["h2d_both"].items():
        print(f"{'h2d_both ' + key:<22}{t['p50']:>9.3f}{t['gbps_total']:>9.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch serving peer for kairos' cold-start serving experiment (DeepPlan, EuroSys'23, Sec. 5.3): the same
arrivals over instances of one model, more instances than the GPU holds, answered by what a user would write
with PyTorch: a fixed number of GPU slots, each a copy of the model with a CUDA graph of its forward captured
once (static input, weights at fixed device addresses); a request to an instance in a slot copies its input and
replays that slot's graph; a request to an instance in no slot first copies the instance's weights into the
least recently used slot (load-then-run: every parameter and buffer `copy_(non_blocking=True)` from pinned host
memory, as scripts/cold_peer.py's `load_then_run_graph_ms`), then replays. One server thread, one CUDA stream,
requests in arrival order (FIFO), each waited for before the next: the serial load-then-run server, the peer of
`kairos bench cold --policy fifo --strategies load-then-run`.

The arrivals are read from a `kairos bench cold --serve-instances` JSON (`--replay FILE`): the records of its
first point at `--rate` (every point of one rate and instance count has the same seeded arrivals), so both
systems answer the very same stream. The first `--slots` instances (default: the file's budget in whole copies)
are in the slots at the start, as kairos loads its first instances up to the budget. All instances share one
set of weights in pinned host memory (a load copies the same bytes as a distinct instance's would; the answers
are not compared with kairos').

Latency of a request: from its scheduled arrival (the start of the run + its offset) to the end of its replay,
host clock (`time.perf_counter_ns`) after synchronizing the stream. Output: JSON (`--out`) with the summary
(p50, p99, max, goodput at 100 and 50 ms and at `--slo-ms`, cold-start rate, served/s) and every request as
[instance, arrival ns, latency ns, answered, cold start], as kairos writes them; a one-line table to stdout.

    python3 scripts/cold_serve_peer.py --replay "$OUT/goodput.json" --rate 300 --out "$OUT/goodput-peer.json"
    python3 scripts/cold_serve_peer.py --self-test    # the serving loop on a virtual clock, no torch, no GPU
"""
import argparse, datetime, json, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# One slot's state: which instance's weights it holds and when it was last used (LRU).
EMPTY = None


def lru_slot(slots, last_used):
    """The slot to load into: an empty one first, else the least recently used (lowest index on ties)."""
    for s, inst in enumerate(slots):
        if inst is EMPTY:
            return s
    return min(range(len(slots)), key=lambda s: (last_used[s], s))


def serve(arrivals, slots, clock, wait_until, run_warm, run_cold):
    """Answers `arrivals` ([(offset ns, instance)], in arrival order) one at a time: waits for an arrival when
    idle, runs a warm request on the slot holding its instance, else loads it into the LRU slot first.
    `clock()` is ns since the start; `run_warm(slot)` and `run_cold(slot)` return once the request is answered.
    Returns [(instance, arrival ns, latency ns, answered, cold)] and the loads done."""
    slots = list(slots)
    last_used = [-1] * len(slots)
    records, loads = [], 0
    for k, (arrival, inst) in enumerate(arrivals):
        if clock() < arrival:
            wait_until(arrival)
        cold = inst not in slots
        if cold:
            s = lru_slot(slots, last_used)
            slots[s] = inst
            loads += 1
        else:
            s = slots.index(inst)
        last_used[s] = k
        ok = True
        try:
            (run_cold if cold else run_warm)(s)
        except Exception as e:  # a failed request is recorded, the others go on
            print(f"request {k} ({inst}): {e!r}", file=sys.stderr)
            ok = False
        records.append((inst, arrival, clock() - arrival, ok, cold))
    return records, loads


def summary(records, loads, span_ns, slo_ms):
    """The serving point's summary, with kairos' key names."""
    lat = sorted(r[2] for r in records if r[3])
    n = max(len(records), 1)

    def q(p):  # nearest rank, rounded index (kairos' `rounded_index`)
        if not lat:
            return None
        return lat[min(len(lat) - 1, int(p / 100.0 * (len(lat) - 1) + 0.5))] / 1e6

    def good(ms):
        return sum(1 for v in lat if v <= ms * 1e6) / n

    return {"requests": len(records), "failed": sum(1 for r in records if not r[3]), "p50_ms": q(50), "p99_ms": q(99),
            "max_ms": q(100), "goodput_100ms": good(100.0), "goodput_50ms": good(50.0), "goodput_slo": good(slo_ms),
            "slo_ms": slo_ms, "cold_starts": loads, "cold_start_rate": loads / n,
            "served_per_s": len(lat) / max(span_ns / 1e9, 1e-9)}


def arrivals_of(doc, rate, instances):
    """The (offset ns, instance) arrivals of the first point of `doc` at `rate` (and `instances`), and its key."""
    for p in doc.get("points", []):
        if "records" not in p or abs(p.get("rate_per_s", -1) - rate) > 1e-9:
            continue
        if instances is not None and p.get("instances") != instances:
            continue
        recs = sorted(p["records"], key=lambda r: r[1])
        return [(int(r[1]), r[0]) for r in recs], p
    which = f"{rate} req/s" + (f" and {instances} instances" if instances else "")
    raise SystemExit(f"no point at {which} with records")


def self_test():
    """The serving loop on a virtual clock: LRU order, waiting for arrivals, latency from the scheduled arrival."""
    now = [0]
    clock = lambda: now[0]  # noqa: E731

    def wait_until(t):
        now[0] = t

    def advance(ns):
        def run(_slot):
            now[0] += ns
        return run

    # Two slots holding a and b; warm 1 ms, cold 5 ms (load + run).
    arrivals = [(0, "a"), (0, "c"), (2_000_000, "a"), (20_000_000, "b"), (20_000_000, "c"), (30_000_000, "a")]
    records, loads = serve(arrivals, ["a", "b"], clock, wait_until, advance(1_000_000), advance(5_000_000))
    got = [(r[0], r[2] // 1000, r[4]) for r in records]
    # a warm 0 -> 1 ms; c cold into b's slot (b never used) 1 -> 6; a warm 6 -> 7 (arrived at 2); idle until 20;
    # b cold into c's slot (c last used before a) 20 -> 25; c cold into a's slot (a before b) 25 -> 30;
    # a cold into b's slot (b before c) 30 -> 35.
    want = [("a", 1000, False), ("c", 6000, True), ("a", 5000, False), ("b", 5000, True), ("c", 10000, True),
            ("a", 5000, True)]
    assert got == want, f"{got} != {want}"
    assert loads == 4
    s = summary(records, loads, now[0], 5.0)
    assert s["cold_start_rate"] == 4 / 6 and s["goodput_slo"] == 4 / 6, s
    assert abs(s["p50_ms"] - 5.0) < 1e-9 and abs(s["max_ms"] - 10.0) < 1e-9, s
    # A failing request is recorded as not answered and the server goes on.
    def boom(_slot):
        raise RuntimeError("injected")
    now[0] = 0
    records, loads = serve([(0, "x"), (0, "a")], ["a", EMPTY], clock, wait_until, advance(1), boom)
    assert [(r[0], r[3], r[4]) for r in records] == [("x", False, True), ("a", True, False)] and loads == 1, records
    assert lru_slot([EMPTY, "a"], [-1, 5]) == 0 and lru_slot(["a", "b"], [3, 2]) == 1
    print("cold_serve_peer.py self-test: ok")


def main():
    ap = argparse.ArgumentParser(description="PyTorch load-then-run serving peer on kairos' recorded arrivals "
                                             "(slots with CUDA graphs, LRU, one stream, FIFO).")
    ap.add_argument("--replay", help="a `kairos bench cold --serve-instances` JSON whose arrivals to serve")
    ap.add_argument("--rate", type=float, help="the point's offered rate, req/s (default: the file's first point)")
    ap.add_argument("--instances", type=int, help="the point's instance count (default: any)")
    ap.add_argument("--slots", type=int, help="model copies in GPU memory (default: the file's budget in whole "
                    "copies, at least 1)")
    ap.add_argument("--model", help="default: the file's model")
    ap.add_argument("--seq", type=int, help="sequence length (default: the file's)")
    ap.add_argument("--slo-ms", type=float, default=5.0, help="a tighter SLO for goodput (default 5 ms, as kairos)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "cold_serve_peer.json"))
    ap.add_argument("--self-test", action="store_true", help="test the serving loop on a virtual clock and exit")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return
    if not a.replay:
        ap.error("--replay FILE is needed (or --self-test)")
    with open(a.replay) as f:
        doc = json.load(f)
    rate = a.rate if a.rate is not None else next(p["rate_per_s"] for p in doc["points"] if "records" in p)
    arrivals, point = arrivals_of(doc, rate, a.instances)
    model_name = a.model or doc.get("model", "bert_base")
    seq = a.seq or doc.get("seq_len", 128)
    n_slots = a.slots or max(1, int(doc.get("budget_instances", 1)))
    # kairos names instance k "i{k}" and loads the first ones up to its budget before the run.
    instances = sorted({i for _, i in arrivals}, key=lambda s: (len(s), s))
    first = instances[:n_slots]

    import torch
    import cold_peer
    import pytorch_peer
    cold_peer.torch, cold_peer.pytorch_peer = torch, pytorch_peer
    if not torch.cuda.is_available():
        sys.exit("cold_serve_peer.py: no CUDA device")
    torch.backends.cudnn.benchmark = True
    dtype = torch.float16 if doc.get("dtype", "f16") in ("f16", "F16") else torch.float32
    host_model, kind = cold_peer.build(model_name, dtype)
    host = [t.detach().pin_memory() for _, t in cold_peer.state_tensors(host_model)]
    weight_bytes = sum(h.numel() * h.element_size() for h in host)
    if kind[0] == "vision":
        x_host = torch.randn(1, *kind[1], dtype=dtype).pin_memory()
    else:
        x_host = torch.randint(0, kind[1], (1, seq)).pin_memory()
    stream = torch.cuda.Stream()
    slots = []  # (device tensors, static input, graph)
    for s in range(n_slots):
        m, _ = cold_peer.build(model_name, dtype)
        m.cuda()
        dev = [t for _, t in cold_peer.state_tensors(m)]
        for d, h in zip(dev, host, strict=True):
            if d.shape != h.shape or d.dtype != h.dtype or not d.is_cuda:
                sys.exit(f"slot {s}: a device tensor {tuple(d.shape)} {d.dtype} against its host copy "
                         f"{tuple(h.shape)} {h.dtype}")
        x = x_host.cuda()
        if kind[0] == "vision":
            fwd = lambda m=m, x=x: m(x)  # noqa: E731
        elif model_name == "gpt2":
            fwd = lambda m=m, x=x: m(input_ids=x, use_cache=False)  # noqa: E731
        else:  # HF's default mask (all ones): an explicit one makes BERT's forward sync (see scripts/cold_peer.py)
            fwd = lambda m=m, x=x: m(input_ids=x)  # noqa: E731
        graph, _ = cold_peer.capture(fwd)
        slots.append((dev, x, graph))
        print(f"slot {s}: {model_name} captured", file=sys.stderr)
    torch.cuda.synchronize()

    def run_warm(s):
        dev, x, graph = slots[s]
        with torch.cuda.stream(stream):
            x.copy_(x_host, non_blocking=True)
            graph.replay()
        stream.synchronize()

    def run_cold(s):
        dev, x, graph = slots[s]
        with torch.cuda.stream(stream), torch.no_grad():
            for d, h in zip(dev, host):
                d.copy_(h, non_blocking=True)
            x.copy_(x_host, non_blocking=True)
            graph.replay()
        stream.synchronize()

    # A few untimed requests so that the first timed ones do not pay lazy initialisations.
    for s in range(n_slots):
        run_warm(s)
    run_cold(0)
    start = time.perf_counter_ns()
    clock = lambda: time.perf_counter_ns() - start  # noqa: E731

    def wait_until(t):
        while clock() < t:
            pass

    print(f"serving {len(arrivals)} requests over {len(instances)} instances of {model_name} with {n_slots} slots "
          f"({rate:g} req/s offered)", file=sys.stderr)
    records, loads = serve(arrivals, first, clock, wait_until, run_warm, run_cold)
    span_ns = clock()
    s = summary(records, loads, span_ns, a.slo_ms)
    out = {"peer": "pytorch load-then-run, CUDA graph per slot, LRU, one stream, FIFO",
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": model_name, "seq_len": seq,
           "dtype": "f16" if dtype == torch.float16 else "f32", "weight_bytes": weight_bytes, "slots": n_slots,
           "replay": os.path.basename(a.replay), "rate_per_s": rate, "instances": point.get("instances"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           **s, "records": [list(r) for r in records]}
    if os.path.dirname(a.out):
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f)
    print("| rate /s | instances | slots | p50 ms | p99 ms | goodput 100 ms | goodput 50 ms | goodput "
          f"{a.slo_ms:g} ms | cold-start rate | served /s |")
    print(f"| {rate:g} | {point.get('instances')} | {n_slots} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
          f"{s['goodput_100ms']:.3f} | {s['goodput_50ms']:.3f} | {s['goodput_slo']:.3f} | {s['cold_start_rate']:.2f} | "
          f"{s['served_per_s']:.1f} |")


if __name__ == "__main__":
    main()

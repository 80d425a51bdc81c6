#!/usr/bin/env python3
"""The PyTorch half of `held_bench` (crates/gputest/examples/held_bench.rs): device-side time of one
forward pass replayed from a captured CUDA graph, with the GPU handed all the work at once.

A stream is held by `torch.cuda._sleep` (a spin of HOLD_MS), the work is queued behind it (other
streams wait on an event recorded after the spin), and each stream's time runs from the release
to its last work's end (CUDA events). So host launch costs are out of the picture: this is what
the GPU does with the kernels once they are queued.

  alone       each model's graph alone on one stream (median of --reps)
  concurrent  every model's graph at once, one stream each (median makespan of --reps)

    python3 scripts/held_peer.py --models resnet18,resnet50 [--reps 20] [--out held_peer.json]
"""
import argparse, json, os, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import pytorch_peer  # noqa: E402

HOLD_MS = 8.0


def spin_cycles(ms):
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "clock_rate", 0) or 1_980_000
    return int(ms * clock_khz)


def held(streams, work, cycles):
    """Runs work(i, stream) on every stream behind one spin; per-stream ms from release to end."""
    s0 = streams[0]
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    with torch.cuda.stream(s0):
        torch.cuda._sleep(cycles)
        start.record(s0)
    for s in streams[1:]:
        s.wait_event(start)
    for i, s in enumerate(streams):
        with torch.cuda.stream(s):
            work(i, s)
            ends[i].record(s)
    torch.cuda.synchronize()
    return [start.elapsed_time(e) for e in ends]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,mobilenet_v2,resnet34,squeezenet1_1,resnet50,densenet121,googlenet,inception_v3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="held_peer.json")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    names = a.models.split(",")
    cycles = spin_cycles(HOLD_MS)
    streams = [torch.cuda.Stream() for _ in names]
    graphs = []
    for name in names:
        model, args = pytorch_peer.build(name, 1, 128)
        s = torch.cuda.Stream()
        with torch.no_grad(), torch.cuda.stream(s):
            for _ in range(3):
                model(*args)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, stream=s):
            model(*args)
        torch.cuda.synchronize()
        graphs.append((name, g, model, args))
        print(f"captured {name}", file=sys.stderr, flush=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "hold_ms": HOLD_MS, "alone_ms": {}, "concurrent": {}}
    for name, g, _, _ in graphs:
        t = [held(streams[:1], lambda i, s, g=g: g.replay(), cycles)[0] for _ in range(a.reps + 3)][3:]
        out["alone_ms"][name] = statistics.median(t)
    spans = []
    for _ in range(a.reps + 3):
        t = held(streams, lambda i, s: graphs[i][1].replay(), cycles)
        spans.append(t)
    spans = spans[3:]
    makespans = [max(t) for t in spans]
    out["concurrent"] = {
        "models": names,
        "makespan_ms": statistics.median(makespans),
        "per_stream_ms": {n: statistics.median(t[i] for t in spans) for i, n in enumerate(names)},
        "sum_alone_ms": sum(out["alone_ms"].values()),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

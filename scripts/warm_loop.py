#!/usr/bin/env python3
"""Warm requests on one GPU, for measuring what another GPU's work costs them (DeepPlan, EuroSys'23,
section 5: interference of parallel transmission with a secondary GPU's own requests).

Builds one model as scripts/pytorch_peer.py builds it (random weights, fp16, batch 1, eval mode),
captures a CUDA graph of its forward on GPU --gpu, then replays it back to back for --seconds:
each replay timed by CUDA events (start and end on the replay's stream, synchronized after each,
so every sample is one isolated warm request). Writes every sample (ms) and p50/p90/p99 as JSON;
prints one line.

    python3 scripts/warm_loop.py --gpu 1 --model resnet50 --seconds 8 --out "$OUT/warm_alone.json"
"""
import argparse, json, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", type=int, default=1)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", default="warm_loop.json")
    a = ap.parse_args()
    import torch
    import pytorch_peer

    torch.cuda.set_device(a.gpu)
    dev = torch.device(f"cuda:{a.gpu}")
    torch.backends.cudnn.benchmark = True
    # pytorch_peer builds on the current device ("cuda"), set above.
    model, inputs = pytorch_peer.build(a.model, 1, a.seq)
    s = torch.cuda.Stream(device=dev)
    with torch.inference_mode():
        with torch.cuda.stream(s):
            for _ in range(3):
                model(*inputs)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            model(*inputs)
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    t_end = time.perf_counter() + a.seconds
    while time.perf_counter() < t_end:
        with torch.cuda.stream(s):
            start.record(s)
            g.replay()
            end.record(s)
        end.synchronize()
        samples.append(start.elapsed_time(end))
    xs = sorted(samples)
    q = lambda p: xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]
    rec = {"gpu": a.gpu, "model": a.model, "device": torch.cuda.get_device_name(a.gpu), "n": len(xs),
           "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99), "max_ms": xs[-1], "samples_ms": samples}
    with open(a.out, "w") as f:
        json.dump(rec, f)
    print(f"warm {a.model} on GPU {a.gpu}: n {len(xs)}, p50 {q(0.5):.3f} ms, p90 {q(0.9):.3f}, p99 {q(0.99):.3f}, max {xs[-1]:.3f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where PyTorch's time goes, kernel by kernel: the CUDA kernels of one forward pass of zoo models
(fp16, eval, cudnn.benchmark on; the same builds as scripts/pytorch_peer.py) with their device
durations (torch.profiler, the median of 5 profiled passes after warm-up), grouped by kernel name,
slowest groups first. The peer side of `kernel_speed --plain` (crates/gputest/examples), which lists
kairos' launches the same way.

    python3 scripts/torch_kernel_times.py [--batch 1] [--seq 128] [--top 12] MODEL...
"""
import argparse, statistics, sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
import pytorch_peer  # noqa: E402


def profile_once(model, args):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(*args)
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if "memcpy" in name.lower() or "memset" in name.lower():
            continue
        out.append((name, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("models", nargs="*", default=["bert_base"])
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    for name in a.models:
        model, kind = pytorch_peer.build_model(name)
        args = pytorch_peer.inputs(kind, a.batch, a.seq)
        with torch.no_grad():
            for _ in range(10):
                model(*args)
            torch.cuda.synchronize()
            passes = [profile_once(model, args) for _ in range(5)]
        # Kernels in launch order are the same in every pass: take each one's median duration.
        n = min(len(p) for p in passes)
        per_kernel = [(passes[0][i][0], statistics.median(p[i][1] for p in passes)) for i in range(n)]
        groups = {}
        for nm, us in per_kernel:
            c, t = groups.get(nm, (0, 0.0))
            groups[nm] = (c + 1, t + us)
        total = sum(us for _, us in per_kernel)
        print(f"== PyTorch {torch.__version__} {name} batch {a.batch} fp16: {n} kernels, {total / 1000:.3f} ms of kernel time")
        print(f"{'total us':>9} {'count':>5} {'each us':>8}  kernel")
        for nm, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"{t:9.1f} {c:5d} {t / c:8.2f}  {nm[:110]}")
        del model, args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

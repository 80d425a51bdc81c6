#!/usr/bin/env python3
"""PyTorch peer numbers for the zoo architectures, measured on the device in the same call as kairos.

For each model (random weights, fp16, eval, cudnn.benchmark on): CUDA kernels per forward pass
(torch.profiler, memcpy/memset excluded), eager latency and CUDA-graph replay latency (medians of
CUDA-event timings). Writes JSON to the path given (default: $OUT/pytorch_peer.json).

    python3 scripts/pytorch_peer.py [--batch 1] [--models resnet50,bert_base] [--out file.json]
"""
import argparse, json, os, statistics, sys, time

import torch


def vision(name):
    import torchvision.models as tv
    if name == "googlenet":
        return tv.googlenet(weights=None, aux_logits=False, init_weights=True), (3, 224, 224)
    if name == "inception_v3":
        return tv.inception_v3(weights=None, aux_logits=False, init_weights=True), (3, 299, 299)
    return getattr(tv, name)(weights=None), (3, 224, 224)


def transformer(name):
    import transformers as hf
    if name == "bert_base":
        return hf.BertModel(hf.BertConfig()), 30522
    if name == "distilbert":
        return hf.DistilBertModel(hf.DistilBertConfig()), 30522
    if name == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config()), 50257
    raise KeyError(name)


VISION = ["resnet18", "resnet34", "resnet50", "resnet152", "mobilenet_v2", "squeezenet1_1", "vgg19",
          "densenet121", "densenet201", "googlenet", "inception_v3"]
TRANSFORMERS = ["bert_base", "distilbert", "gpt2"]


def build(name, batch, seq):
    if name in VISION:
        m, shape = vision(name)
        x = torch.randn(batch, *shape, device="cuda", dtype=torch.half)
        return m.cuda().half().eval(), (x,)
    m, vocab = transformer(name)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    return m.cuda().half().eval(), (ids,)


def count_kernels(model, args):
    from torch.profiler import profile, ProfilerActivity
    with torch.no_grad():
        model(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(*args)
            torch.cuda.synchronize()
    n = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            nm = e.name.lower()
            if "memcpy" in nm or "memset" in nm:
                continue
            n += 1
    return n


def time_ms(fn, reps):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def measure(name, batch, seq, reps):
    model, args = build(name, batch, seq)
    kernels = count_kernels(model, args)
    with torch.no_grad():
        for _ in range(10):
            model(*args)
        torch.cuda.synchronize()
        eager = time_ms(lambda: model(*args), reps)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(*args)
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        graph = time_ms(g.replay, reps)
    del model, g
    torch.cuda.empty_cache()
    return {"model": name, "batch": batch, "kernels_per_forward": kernels, "eager_ms": eager, "graph_ms": graph}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--models", default=",".join(VISION + TRANSFORMERS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "pytorch_peer.json"))
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    print(f"# PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, fp16, batch {a.batch}", flush=True)
    for name in a.models.split(","):
        t = time.time()
        try:
            r = measure(name, a.batch, a.seq, a.reps)
        except Exception as e:  # one model failing must not lose the others
            r = {"model": name, "batch": a.batch, "error": repr(e)}
        rows.append(r)
        print(json.dumps(r), f"({time.time() - t:.1f} s)", flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "fp16", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

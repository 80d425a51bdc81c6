#!/usr/bin/env python3
"""PyTorch peer numbers for the zoo architectures, measured on the device in the same call as kairos.

For each model (random weights, fp16, eval, cudnn.benchmark on) and each batch size: CUDA kernels
per forward pass (torch.profiler, memcpy/memset excluded), eager latency and CUDA-graph replay
latency (median and p99 of CUDA-event timings, input resident on the GPU). A model is built once
and measured at every batch size. Writes JSON to the path given (default: $OUT/pytorch_peer.json):
{device, torch, dtype, batches, seq, rows: [{model, batch, kernels_per_forward, eager_ms, graph_ms,
eager_p99_ms, graph_p99_ms} or {model, batch, error}]}; `kairos bench latency --peer` reads it.

    python3 scripts/pytorch_peer.py [--batch 1,8] [--models resnet50,bert_base] [--out file.json]
"""
import argparse, json, os, statistics, sys, time

import torch


def vision(name):
    import torchvision.models as tv
    if name == "googlenet":
        return tv.googlenet(weights=None, aux_logits=False, init_weights=True), (3, 224, 224)
    if name == "inception_v3":
        return tv.inception_v3(weights=None, aux_logits=False, init_weights=True), (3, 299, 299)
    if name == "shufflenet_v2":
        return tv.shufflenet_v2_x1_0(weights=None), (3, 224, 224)
    return getattr(tv, name)(weights=None), (3, 224, 224)


def transformer(name):
    import transformers as hf
    if name == "bert_base":
        return hf.BertModel(hf.BertConfig()), 30522
    if name == "bert_large":
        return hf.BertModel(hf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                          intermediate_size=4096)), 30522
    if name == "roberta_base":
        return hf.RobertaModel(hf.RobertaConfig(vocab_size=50265, max_position_embeddings=514)), 50265
    if name == "distilbert":
        return hf.DistilBertModel(hf.DistilBertConfig()), 30522
    if name == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config()), 50257
    if name == "albert":  # albert-base-v2's shape (AlbertConfig's defaults are xxlarge)
        cfg = hf.AlbertConfig(vocab_size=30000, embedding_size=128, hidden_size=768, num_attention_heads=12,
                              intermediate_size=3072)
        return hf.AlbertModel(cfg), 30000
    raise KeyError(name)


VISION = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "mobilenet_v2", "squeezenet1_1", "vgg19",
          "densenet121", "densenet201", "googlenet", "inception_v3", "alexnet", "resnext101_32x8d", "shufflenet_v2"]
TRANSFORMERS = ["bert_base", "bert_large", "roberta_base", "distilbert", "gpt2", "albert"]


def build_model(name):
    """The model on the GPU in fp16 eval mode, and what its input looks like (see `inputs`)."""
    if name in VISION:
        m, shape = vision(name)
        return m.cuda().half().eval(), ("vision", shape)
    if name in TRANSFORMERS:
        m, vocab = transformer(name)
        return m.cuda().half().eval(), ("tokens", vocab)
    raise KeyError(f"unknown model {name!r}: use {', '.join(VISION + TRANSFORMERS)}")


def inputs(kind, batch, seq):
    if kind[0] == "vision":
        return (torch.randn(batch, *kind[1], device="cuda", dtype=torch.half),)
    return (torch.randint(0, kind[1], (batch, seq), device="cuda"),)


def build(name, batch, seq):
    """The model and its arguments at one batch size (scripts/peer_replay.py uses this)."""
    model, kind = build_model(name)
    return model, inputs(kind, batch, seq)


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
    """Median and p99 (nearest rank) of `reps` CUDA-event timings of fn, issued back to back."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return statistics.median(t), t[max(0, -(-99 * len(t) // 100) - 1)]


def eager_and_graph(model, args, reps):
    """Median and p99 ms of `model(*args)` eager, then of one captured CUDA graph of it replayed
    (warmed up, captured on a side stream): (eager, eager_p99, graph, graph_p99)."""
    with torch.no_grad():
        for _ in range(10):
            model(*args)
        torch.cuda.synchronize()
        eager, eager_p99 = time_ms(lambda: model(*args), reps)
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
        graph, graph_p99 = time_ms(g.replay, reps)
    del g
    torch.cuda.empty_cache()
    return eager, eager_p99, graph, graph_p99


def measure(model, kind, name, batch, seq, reps):
    args = inputs(kind, batch, seq)
    kernels = count_kernels(model, args)
    eager, eager_p99, graph, graph_p99 = eager_and_graph(model, args, reps)
    del args
    r = {"model": name, "batch": batch, "kernels_per_forward": kernels, "eager_ms": eager, "graph_ms": graph,
         "eager_p99_ms": eager_p99, "graph_p99_ms": graph_p99}
    if name in TRANSFORMERS:
        r["seq"] = seq
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated (e.g. 1,8)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--models", default=",".join(VISION + TRANSFORMERS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "pytorch_peer.json"))
    a = ap.parse_args()
    batches = [int(b) for b in a.batch.split(",") if b.strip()]
    torch.backends.cudnn.benchmark = True
    rows = []
    print(f"# PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, fp16, batch {a.batch}", flush=True)

    def write():  # after every model, so a run cut short keeps what it measured
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "fp16",
                       "batches": batches, "seq": a.seq, "rows": rows}, f, indent=1)

    for name in a.models.split(","):
        model = None
        try:
            model, kind = build_model(name)
        except Exception as e:  # one model failing must not lose the others
            rows.extend({"model": name, "batch": b, "error": repr(e)} for b in batches)
            print(name, "failed to build:", repr(e), flush=True)
            continue
        for b in batches:
            t = time.time()
            try:
                r = measure(model, kind, name, b, a.seq, a.reps)
            except Exception as e:  # out of memory at one batch size must not lose the others
                r = {"model": name, "batch": b, "error": repr(e)}
                torch.cuda.empty_cache()
            rows.append(r)
            print(json.dumps(r), f"({time.time() - t:.1f} s)", flush=True)
        del model
        torch.cuda.empty_cache()
        write()
    write()


if __name__ == "__main__":
    main()

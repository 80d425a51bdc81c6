#!/usr/bin/env python3
"""PyTorch peer for kairos' cold-start benchmark (DeepPlan, EuroSys'23): a request to a model whose weights
are not in GPU memory.

The models are built exactly as scripts/pytorch_peer.py builds them (its `vision` and `transformer`: HF
BertModel(BertConfig()) and GPT2LMHeadModel(GPT2Config()), torchvision ResNets, random weights, nothing
downloaded), in eval mode, fp16 by default (`--dtype f32` for fp32), batch 1, transformers at `--seq` tokens
(input ids random in the vocabulary; BERT with an all-ones attention mask; GPT-2 with use_cache=False),
224x224 images for the ResNets; cudnn.benchmark on. Every parameter and buffer (tied weights once) has a
copy kept in pinned host memory. For each model:

  copy_ms                 copy_(non_blocking=True) of every parameter and buffer from its pinned host copy
                          into the model's (pre-allocated) device tensor, CUDA events around the whole set;
                          with weight_bytes and copy_gbps (weight_bytes / p50)
  load_then_run_eager_ms  the same copies, then one eager forward under torch.inference_mode(): time from
                          before the first copy to the end of the forward
  load_then_run_graph_ms  the same copies, then the replay of a CUDA graph of the forward captured once
                          beforehand (static input, weights at fixed device addresses)
  warm_eager_ms           the eager forward alone, weights resident
  warm_graph_ms           the graph replay alone, weights resident
  pipelined_ms            PipeSwitch-style per-layer pipeline: the copies of each stage's parameters on a
                          separate copy stream, an event after each stage's copies; the forward runs stage by
                          stage on the compute stream, each stage waiting on its own event. Stages: ResNets
                          conv1, bn1, relu, maxpool, every bottleneck block of layer1..layer4, avgpool,
                          flatten, fc; BERT embeddings, each encoder layer, pooler; GPT-2 wte+wpe, each block
                          h[i], ln_f, the (tied) lm head. The layers are called with the arguments the model
                          itself passes them (recorded by forward pre-hooks in one plain forward). Checked
                          against the plain forward (max abs diff printed; relative tolerance 1e-2 in fp16,
                          1e-3 in fp32) before it is timed. Other architectures: null, with a reason.

Every measure: --warmup untimed repetitions, then --reps timed; each repetition starts on an idle GPU
(synchronize before) and is waited for (synchronize after), timed by CUDA events on the compute stream;
p50/p10/p90 in ms. The copies are issued in every repetition (the weights are overwritten by the same values),
so every timed load pays the full host-to-device transfer. A measure that fails records {"error": ...} and the
others go on. Should the forward synchronize with the host (CUDA-graph capture forbids it; HF does it for some
masks), BERT falls back to no attention mask (HF's default: all ones) for every measure, recorded in
"attention_mask"; otherwise the graph measures record the error.

JSON (written after every model, so a run cut short keeps what it measured):
{device, torch, cuda, transformers, dtype, seq, warmup, reps, date, models: [{model, weight_bytes, tensors,
copy_ms: {p50, p10, p90}, copy_gbps, load_then_run_eager_ms, load_then_run_graph_ms, pipelined_ms,
warm_eager_ms, warm_graph_ms, graph_check, pipelined_check, pipelined_stages, ...}]}. One progress line per
model goes to stderr, a fixed-width table (p50 in ms) to stdout at the end.

    python3 scripts/cold_peer.py --out "$OUT/cold_peer.json"
    python3 scripts/cold_peer.py [--models bert_base,gpt2,resnet50,resnet152] [--seq 128] [--dtype f16|f32] \\
        [--reps 50] [--warmup 5] [--out cold_peer.json]
"""
import argparse, datetime, gc, json, math, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Imported in main once the arguments are parsed, so that --help runs without torch.
torch = None
pytorch_peer = None  # scripts/pytorch_peer.py: the same model builds (importing it has no side effects)

DEFAULT_MODELS = "bert_base,gpt2,resnet50,resnet152"
CAPTURE_WARMUP = 3  # eager passes on a side stream before a capture (as PyTorch's CUDA-graph docs do)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def quantiles(ts):
    s = sorted(ts)

    def q(p):  # linear interpolation between closest ranks
        k = (len(s) - 1) * p
        f = int(math.floor(k))
        c = min(f + 1, len(s) - 1)
        return s[f] + (s[c] - s[f]) * (k - f)

    return {"p50": round(q(0.5), 4), "p10": round(q(0.1), 4), "p90": round(q(0.9), 4)}


def timed(fn, warmup, reps):
    """p50/p10/p90 (ms) of `reps` CUDA-event timings of fn() after `warmup` untimed calls. Each repetition
    starts on an idle GPU and is waited for: one request on an idle server."""
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end))
    return quantiles(ts)


def settle():
    """After a failed measure: let the device drain and give cached memory back (errors here are ignored)."""
    try:
        torch.cuda.synchronize()
    except Exception:
        pass
    gc.collect()
    try:
        torch.cuda.empty_cache()
    except Exception:
        pass


def attempt(rec, key, fn):
    try:
        rec[key] = fn()
    except Exception as e:  # one measure failing must not lose the others
        rec[key] = {"error": repr(e)}
        log(f"  {rec['model']}: {key} failed: {e!r}")
        settle()
    return rec[key]


def p50(v):
    return v["p50"] if isinstance(v, dict) and "p50" in v else None


# ---------------------------------------------------------------------------------------------- the model

def build(name, dtype):
    """The model on the host (scripts/pytorch_peer.py's builds), eval, in `dtype`, no grads; and its input kind."""
    torch.manual_seed(0)
    if name in pytorch_peer.VISION:
        m, shape = pytorch_peer.vision(name)
        kind = ("vision", shape)
    elif name in pytorch_peer.TRANSFORMERS:
        m, vocab = pytorch_peer.transformer(name)
        kind = ("tokens", vocab)
    else:
        raise KeyError(f"unknown model {name!r}: use {', '.join(pytorch_peer.VISION + pytorch_peer.TRANSFORMERS)}")
    m = m.eval()
    m = m.half() if dtype == torch.float16 else m.float()
    for p in m.parameters():
        p.requires_grad_(False)
    return m, kind


def state_tensors(model):
    """Every parameter and buffer once (tied weights once), in module order: [(name, tensor)]."""
    seen, out = set(), []
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((n, t))
    return out


def tensors_of(o):
    """The tensors of a model output (tensor, tuple, HF ModelOutput), flattened in order."""
    if isinstance(o, torch.Tensor):
        return [o]
    if hasattr(o, "to_tuple"):
        o = o.to_tuple()
    elif isinstance(o, dict):
        o = list(o.values())
    if isinstance(o, (tuple, list)):
        return [t for x in o for t in tensors_of(x)]
    return []


def compare(ref, out):
    """(max abs diff, max abs diff relative to the reference's max magnitude) over the output tensors."""
    got = tensors_of(out)
    if len(got) != len(ref):
        raise RuntimeError(f"{len(got)} output tensors, the plain forward gives {len(ref)}")
    worst_abs = worst_rel = 0.0
    for r, o in zip(ref, got):
        if tuple(r.shape) != tuple(o.shape):
            raise RuntimeError(f"output shape {tuple(o.shape)}, the plain forward gives {tuple(r.shape)}")
        d = (o.float() - r.float()).abs().max().item()
        scale = r.float().abs().max().item()
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / scale if scale > 0 else d)
    return worst_abs, worst_rel


def host_sync_error(fn):
    """The error text if fn() makes a synchronizing CUDA call (CUDA-graph capture forbids them), else None."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            fn()
        return None
    except RuntimeError as e:  # "called a synchronizing CUDA operation" (or any other failure of the forward)
        return str(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def capture(fn):
    """A CUDA graph of fn() (warmed up on a side stream first) and its static output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(CAPTURE_WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        with torch.cuda.graph(g):
            out = fn()
    torch.cuda.synchronize()
    return g, out


# ------------------------------------------------------------------------------------- pipelined (PipeSwitch)

def record_calls(forward, mods):
    """The (args, kwargs) each module of `mods` is called with in one plain forward (forward pre-hooks)."""
    calls = {}
    handles = []
    for i, mod in enumerate(mods):
        def hook(_m, args, kwargs, i=i):
            calls.setdefault(i, (tuple(args), dict(kwargs)))
            return None
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.inference_mode():
            forward()
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    missing = [i for i in range(len(mods)) if i not in calls]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(mods)} pipeline modules were not called by the forward")
    return [calls[i] for i in range(len(mods))]


def call_with_hidden(mod, call, h):
    """mod called as the model called it, with `h` in place of its hidden-state argument; the hidden state out."""
    args, kwargs = call
    if args:
        args = (h,) + args[1:]
    else:
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = h
    out = mod(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def first_arg(call):
    args, kwargs = call
    return args[0] if args else next(iter(kwargs.values()))


def pipeline_stages(model, forward):
    """[(label, fn(state) -> state, [modules whose weights the stage needs])] and the initial state, or
    (None, reason) for an architecture without a module walk."""
    import torchvision
    if isinstance(model, torchvision.models.ResNet):
        m = model
        stages = [(n, getattr(m, n), [getattr(m, n)]) for n in ("conv1", "bn1", "relu", "maxpool")]
        for ln in ("layer1", "layer2", "layer3", "layer4"):
            for j, blk in enumerate(getattr(m, ln)):
                stages.append((f"{ln}.{j}", blk, [blk]))
        stages += [("avgpool", m.avgpool, [m.avgpool]),
                   ("flatten", lambda x: torch.flatten(x, 1), []),
                   ("fc", lambda x: (m.fc(x),), [m.fc])]
        return stages, None
    cls = type(model).__name__
    if cls in ("BertModel", "RobertaModel"):
        emb, layers, pooler = model.embeddings, list(model.encoder.layer), model.pooler
        calls = record_calls(forward, [emb] + layers)
        stages = [("embeddings", lambda _s, c=calls[0]: emb(*c[0], **c[1]), [emb])]
        for i, layer in enumerate(layers):
            stages.append((f"encoder.layer.{i}", lambda h, l=layer, c=calls[1 + i]: call_with_hidden(l, c, h), [layer]))
        if pooler is not None:
            stages.append(("pooler", lambda h: (h, pooler(h)), [pooler]))
        else:
            stages.append(("output", lambda h: (h,), []))
        return stages, None
    if cls == "GPT2LMHeadModel":
        tr = model.transformer
        blocks = list(tr.h)
        calls = record_calls(forward, [tr.wte, tr.wpe] + blocks)
        ids, pos = first_arg(calls[0]), first_arg(calls[1])
        stages = [("wte+wpe", lambda _s: tr.drop(tr.wte(ids) + tr.wpe(pos)), [tr.wte, tr.wpe])]
        for i, blk in enumerate(blocks):
            stages.append((f"h.{i}", lambda h, b=blk, c=calls[2 + i]: call_with_hidden(b, c, h), [blk]))
        stages += [("ln_f", lambda h: tr.ln_f(h), [tr.ln_f]),
                   ("lm_head", lambda h: (model.lm_head(h),), [model.lm_head])]
        return stages, None
    return None, f"no per-layer module walk for {cls} (implemented for torchvision ResNets, BertModel, RobertaModel, GPT2LMHeadModel)"


def stage_groups(stages, pairs):
    """Each stage's (device tensor, pinned host copy) pairs: a tensor goes to the first stage whose modules hold it
    (GPT-2's tied lm head to wte's stage); any tensor no stage holds goes to the first stage. And that count."""
    host_of = {id(d): h for d, h in pairs}
    seen, groups = set(), []
    for _label, _fn, mods in stages:
        g = []
        for mod in mods:
            for t in list(mod.parameters()) + list(mod.buffers()):
                if id(t) in host_of and id(t) not in seen:
                    seen.add(id(t))
                    g.append((t, host_of[id(t)]))
        groups.append(g)
    rest = [(d, h) for d, h in pairs if id(d) not in seen]
    groups[0] = rest + groups[0]
    return groups, len(rest)


def make_pipelined(stages, groups, x0):
    copy_stream = torch.cuda.Stream()
    events = [torch.cuda.Event() if g else None for g in groups]
    done = torch.cuda.Event()

    def run():
        compute = torch.cuda.current_stream()
        copy_stream.wait_stream(compute)  # the copies start after what the compute stream has queued
        with torch.no_grad(), torch.cuda.stream(copy_stream):
            for g, ev in zip(groups, events):
                for d, h in g:
                    d.copy_(h, non_blocking=True)
                if ev is not None:
                    ev.record(copy_stream)
            done.record(copy_stream)
        state = x0
        with torch.inference_mode():
            for (_label, fn, _mods), ev in zip(stages, events):
                if ev is not None:
                    compute.wait_event(ev)
                state = fn(state)
        compute.wait_event(done)  # every copy finished before the request counts as done
        return state

    return run


# --------------------------------------------------------------------------------------------- measuring

def measure(name, a, dtype):
    rec = {"model": name}
    model, kind = build(name, dtype)
    host = {n: t.detach().pin_memory() for n, t in state_tensors(model)}
    model.cuda()
    pairs = []
    for n, d in state_tensors(model):
        h = host[n]
        if d.shape != h.shape or d.dtype != h.dtype or not d.is_cuda:
            raise RuntimeError(f"{n}: device {tuple(d.shape)} {d.dtype}, host {tuple(h.shape)} {h.dtype}")
        pairs.append((d, h))
    del host
    rec["weight_bytes"] = sum(h.numel() * h.element_size() for _, h in pairs)
    rec["tensors"] = len(pairs)

    if kind[0] == "vision":
        x = torch.randn(1, *kind[1], device="cuda", dtype=dtype)
        rec["input"] = [1, *kind[1]]
        forward = lambda: model(x)  # noqa: E731
        forward_alt = None
    else:
        ids = torch.randint(0, kind[1], (1, a.seq), device="cuda")
        rec["input"] = [1, a.seq]
        rec["seq"] = a.seq
        if name == "gpt2":
            forward = lambda: model(input_ids=ids, use_cache=False)  # noqa: E731
            forward_alt = None
        else:
            mask = torch.ones(1, a.seq, dtype=torch.long, device="cuda")
            forward = lambda: model(input_ids=ids, attention_mask=mask)  # noqa: E731
            forward_alt = lambda: model(input_ids=ids)  # noqa: E731
            rec["attention_mask"] = "ones"

    def copy_all():
        with torch.no_grad():
            for d, h in pairs:
                d.copy_(h, non_blocking=True)

    with torch.inference_mode():
        forward()  # cudnn.benchmark's search, lazy initialisations
    torch.cuda.synchronize()
    sync_err = host_sync_error(forward)
    if sync_err and forward_alt is not None:
        with torch.inference_mode():
            forward_alt()
        torch.cuda.synchronize()
        if host_sync_error(forward_alt) is None:
            log(f"  {name}: the forward with an all-ones mask synchronizes with the host; measuring without a mask")
            forward, sync_err = forward_alt, None
            rec["attention_mask"] = "none (HF's default, all ones: with an explicit all-ones mask the forward " \
                                    "synchronizes with the host, which CUDA-graph capture forbids)"
    if sync_err:
        rec["forward_syncs"] = sync_err
    with torch.inference_mode():
        ref = [t.detach().clone() for t in tensors_of(forward())]
    torch.cuda.synchronize()
    tol = 1e-2 if dtype == torch.float16 else 1e-3

    # 1. the copies alone
    if p50(attempt(rec, "copy_ms", lambda: timed(copy_all, a.warmup, a.reps))) is not None:
        rec["copy_gbps"] = round(rec["weight_bytes"] / rec["copy_ms"]["p50"] / 1e6, 3)

    # 2 and 4. eager
    def eager():
        with torch.inference_mode():
            forward()

    def load_eager():
        copy_all()
        eager()

    attempt(rec, "load_then_run_eager_ms", lambda: timed(load_eager, a.warmup, a.reps))
    attempt(rec, "warm_eager_ms", lambda: timed(eager, a.warmup, a.reps))

    # 5. pipelined
    rec["pipelined_ms"] = None
    try:
        stages, reason = pipeline_stages(model, forward)
        if stages is None:
            rec["pipelined_reason"] = reason
        else:
            groups, unstaged = stage_groups(stages, pairs)
            x0 = x if kind[0] == "vision" else None
            run = make_pipelined(stages, groups, x0)
            out = run()
            torch.cuda.synchronize()
            d_abs, d_rel = compare(ref, out)
            del out
            ok = d_rel <= tol
            rec["pipelined_stages"] = len(stages)
            rec["pipelined_unstaged_tensors"] = unstaged
            rec["pipelined_check"] = {"max_abs_diff": d_abs, "max_rel_diff": d_rel, "tolerance": tol, "ok": ok}
            log(f"  {name}: pipelined ({len(stages)} stages) vs plain forward: max abs diff {d_abs:.3g}, "
                f"relative {d_rel:.3g} ({'ok' if ok else 'OVER TOLERANCE'} at {tol:g})")
            if ok:
                rec["pipelined_ms"] = timed(run, a.warmup, a.reps)
            else:
                rec["pipelined_ms"] = {"error": f"pipelined output differs from the plain forward: relative "
                                                f"{d_rel:.3g} > {tol:g}"}
    except Exception as e:
        rec["pipelined_ms"] = {"error": repr(e)}
        log(f"  {name}: pipelined failed: {e!r}")
        settle()

    # 3 and 4. CUDA graph
    if sync_err:
        err = {"error": f"the forward synchronizes with the host, so it cannot be captured: {sync_err}"}
        rec["load_then_run_graph_ms"], rec["warm_graph_ms"] = err, dict(err)
    else:
        g = gout = None
        try:
            g, gout = capture(forward)
            copy_all()
            g.replay()
            torch.cuda.synchronize()
            d_abs, d_rel = compare(ref, gout)
            rec["graph_check"] = {"max_abs_diff": d_abs, "max_rel_diff": d_rel, "tolerance": tol, "ok": d_rel <= tol}

            def load_graph():
                copy_all()
                g.replay()

            attempt(rec, "load_then_run_graph_ms", lambda: timed(load_graph, a.warmup, a.reps))
            attempt(rec, "warm_graph_ms", lambda: timed(g.replay, a.warmup, a.reps))
        except Exception as e:
            err = {"error": repr(e)}
            rec.setdefault("load_then_run_graph_ms", err)
            rec.setdefault("warm_graph_ms", dict(err))
            log(f"  {name}: CUDA graph failed: {e!r}")
            settle()
        del g, gout
    del model, pairs, ref
    return rec


def fmt(v, width):
    if v is None:
        s = "-"
    elif isinstance(v, dict) and "error" in v:
        s = "err"
    elif isinstance(v, dict):
        s = f"{v['p50']:.2f}"
    else:
        s = f"{v:.2f}"
    return s.rjust(width)


def table(models):
    cols = [("model", 12), ("MB", 9), ("copy", 8), ("copy GB/s", 10), ("load+eager", 11), ("load+graph", 11),
            ("pipelined", 10), ("warm eager", 11), ("warm graph", 11)]
    lines = [" ".join(n.ljust(w) if i == 0 else n.rjust(w) for i, (n, w) in enumerate(cols))]
    for r in models:
        if "weight_bytes" not in r:
            lines.append(r["model"].ljust(12) + "  error: " + str(r.get("error", "?"))[:100])
            continue
        vals = [r["weight_bytes"] / 1e6, r.get("copy_ms"), r.get("copy_gbps"), r.get("load_then_run_eager_ms"),
                r.get("load_then_run_graph_ms"), r.get("pipelined_ms"), r.get("warm_eager_ms"), r.get("warm_graph_ms")]
        lines.append(r["model"][:12].ljust(12) + " " + " ".join(fmt(v, w) for v, (_, w) in zip(vals, cols[1:])))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(
        description="PyTorch cold-start peer: weight copy, load-then-run (eager, CUDA graph), PipeSwitch-style "
                    "pipelined load, and warm forward times per model (CUDA events, p50/p10/p90 ms).")
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated (default {DEFAULT_MODELS}); "
                    "any name scripts/pytorch_peer.py builds")
    ap.add_argument("--seq", type=int, default=128, help="sequence length of the transformers (default 128)")
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16", help="weights and activations (default f16)")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions per measure (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed repetitions before them (default 5)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "cold_peer.json"),
                    help="JSON results, rewritten after every model (default $OUT/cold_peer.json)")
    a = ap.parse_args()
    if a.reps < 1 or a.warmup < 0:
        ap.error("--reps must be at least 1 and --warmup at least 0")

    global torch, pytorch_peer
    import torch as _torch
    torch = _torch
    import pytorch_peer as _pp
    pytorch_peer = _pp
    try:
        import transformers
        hf_version = transformers.__version__
    except Exception:
        hf_version = None

    if not torch.cuda.is_available():
        sys.exit("cold_peer.py: no CUDA device")
    torch.backends.cudnn.benchmark = True  # as scripts/pytorch_peer.py
    dtype = torch.float16 if a.dtype == "f16" else torch.float32
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": hf_version, "dtype": a.dtype, "seq": a.seq, "warmup": a.warmup, "reps": a.reps,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "models": []}
    if os.path.dirname(a.out):
        os.makedirs(os.path.dirname(a.out), exist_ok=True)

    def write():  # after every model, so a run cut short keeps what it measured
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)

    log(f"# PyTorch {torch.__version__} on {doc['device']}, {a.dtype}, batch 1, seq {a.seq}, "
        f"{a.warmup} warm-up + {a.reps} timed repetitions per measure")
    for name in names:
        t0 = time.time()
        try:
            rec = measure(name, a, dtype)
        except Exception as e:  # one model failing must not lose the others
            rec = {"model": name, "error": repr(e)}
        settle()
        try:
            torch._C._host_emptyCache()  # the pinned host copies (private API: skipped where absent)
        except Exception:
            pass
        doc["models"].append(rec)
        write()
        if "error" in rec:
            log(f"{name}: failed: {rec['error']} ({time.time() - t0:.1f} s)")
            continue

        def ms(k):
            v = rec.get(k)
            return "-" if v is None else ("err" if "error" in v else f"{v['p50']:.2f}")

        gbps = rec.get("copy_gbps")
        log(f"{name}: {rec['weight_bytes'] / 1e6:.1f} MB in {rec['tensors']} tensors, copy {ms('copy_ms')} ms"
            f" ({'-' if gbps is None else f'{gbps:.1f}'} GB/s), load+eager {ms('load_then_run_eager_ms')}, "
            f"load+graph {ms('load_then_run_graph_ms')}, pipelined {ms('pipelined_ms')}, warm eager "
            f"{ms('warm_eager_ms')}, warm graph {ms('warm_graph_ms')} ms ({time.time() - t0:.1f} s)")
    write()
    print(f"# {doc['device']}, PyTorch {doc['torch']}, {a.dtype}, batch 1, seq {a.seq}: p50 of {a.reps} (ms)")
    print(table(doc["models"]))
    print(f"# written to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

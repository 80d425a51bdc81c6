#!/usr/bin/env python3
"""onnxruntime's CUDA execution provider as the peer of the ONNX corpus: the batch-1 latency of
every TorchScript export in a corpus folder (scripts/onnx_corpus.py's manifest), the way an
onnxruntime user would deploy it on a GPU:

  ort_f16        the export converted to fp16 by onnxruntime's own converter
                 (onnxruntime.transformers.float16, inputs and outputs kept f32), CUDA provider,
                 graph optimizations ORT_ENABLE_ALL, inputs and outputs bound on the GPU (IO binding)
  ort_fixed_f16  the same after fixing the inputs' shapes to the timed ones
                 (onnxruntime.tools.onnx_model_utils.make_input_shape_fixed, fix_output_shapes): the
                 shape arithmetic folds away, so no node is left on the CPU provider and CUDA graph
                 capture becomes possible (a user serving one shape would do this)
  ort_fixed_opt_f16  transformers only: fixed shapes, then onnxruntime's transformer optimizer
                 (onnxruntime.transformers.optimizer: fused attention / LayerNorm / GELU for the
                 model type), then the same fp16 conversion
  *_graph        the same session with the CUDA provider's CUDA graph capture (enable_cuda_graph),
                 replayed per run; onnxruntime refuses it when some node runs on the CPU provider.
                 Without CUDA graphs a configuration is timed only where capture is refused (or with
                 --all-configs): on the H200 it was never the faster one.

best_ms is the fastest of them. Each time is the median (and p99) wall-clock time of `run_with_iobinding` (synchronous: the host
waits for the GPU) over --reps runs after warm-up, in ms. A configuration that fails keeps its
error in the row. The feeds are the corpus case 0 inputs (batch 1, sequence 16), as for PyTorch's
peer (`onnx_corpus.py --latency`).

    python3 scripts/ort_cuda_peer.py CORPUS_DIR --out ort-latency.json [--reps 100] [--only REGEX]

`--device cpu` runs the same steps on onnxruntime's CPU provider without CUDA graphs: a check of
the script itself on a machine without a GPU, not a peer number.

onnxruntime-gpu need not be installed: put its package folder first on PYTHONPATH (the device's
own onnxruntime is the CPU build). CUDA and cuDNN libraries come from PyTorch's wheels
(`onnxruntime.preload_dlls`).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

# The transformer configuration of every corpus architecture (scripts/onnx_corpus.py's
# transformer_models(): hidden size 32, 2 heads), which the optimizer needs for GPT-2 and ViT.
OPT_NUM_HEADS, OPT_HIDDEN_SIZE = 2, 32
# model architecture (corpus name) -> onnxruntime.transformers.optimizer model_type
OPT_MODEL_TYPE = {
    "bert": "bert", "distilbert": "bert", "roberta": "bert", "albert": "bert", "electra": "bert",
    "gpt2": "gpt2", "t5_encoder": "t5", "clip_text": "clip", "vit_hf": "vit", "deit": "vit", "clip_vision": "clip",
}


def error_summary(ex):
    text = str(ex).strip().splitlines()
    return f"{type(ex).__name__}: {(text[0] if text else '')[:300]}"


def timed_runs(sess, binding, reps):
    for _ in range(10):
        sess.run_with_iobinding(binding)
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        t.append((time.perf_counter() - t0) * 1e3)
    t.sort()
    return statistics.median(t), t[max(0, -(-99 * len(t) // 100) - 1)]


def measure(ort, model_bytes, feeds, reps, cuda_graph, device):
    """(median ms, p99 ms) of one configuration; raises on failure."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if device == "cuda":
        cuda = {"device_id": "0"}
        if cuda_graph:
            cuda["enable_cuda_graph"] = "1"
        provider = ("CUDAExecutionProvider", cuda)
    else:
        provider = ("CPUExecutionProvider", {})
    sess = ort.InferenceSession(model_bytes, so, providers=[provider])
    if provider[0] not in sess.get_providers():
        raise RuntimeError(f"{provider[0]} not used (providers {sess.get_providers()})")
    binding = sess.io_binding()
    inputs = {}
    for meta in sess.get_inputs():
        inputs[meta.name] = ort.OrtValue.ortvalue_from_numpy(feeds[meta.name], device, 0)
        binding.bind_ortvalue_input(meta.name, inputs[meta.name])
    if cuda_graph:
        # Captured graphs need fixed output addresses: shapes from one plain run, buffers bound.
        plain = sess.run(None, {k: feeds[k] for k in inputs})
        outs = []  # the bound buffers stay alive as long as the session runs
        for meta, val in zip(sess.get_outputs(), plain):
            o = ort.OrtValue.ortvalue_from_shape_and_type(val.shape, val.dtype, device, 0)
            outs.append(o)
            binding.bind_ortvalue_output(meta.name, o)
    else:
        for meta in sess.get_outputs():
            binding.bind_output(meta.name, device)
    return timed_runs(sess, binding, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--only", default=None, help="regular expression on architecture names")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the CPU provider, no CUDA graphs (checks the script; not a peer number)")
    ap.add_argument("--all-configs", action="store_true",
                    help="also time each configuration without CUDA graphs where capture works (about twice the time)")
    ap.add_argument("--require-all", action="store_true",
                    help="exit 1 when a model got no time in any configuration, or no model was found")
    a = ap.parse_args()

    import numpy as np
    import onnx

    try:  # PyTorch's CUDA libraries into the process first, as onnxruntime's documentation suggests
        import torch  # noqa: F401
    except ImportError:
        torch = None
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception as ex:  # noqa: BLE001 - reported, the session creation says whether it matters
            print(f"preload_dlls: {error_summary(ex)}", flush=True)
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_input_shape_fixed
    from onnxruntime.transformers import float16, optimizer

    print(f"onnxruntime {ort.__version__} from {os.path.dirname(ort.__file__)}, providers {ort.get_available_providers()}",
          flush=True)
    m = json.load(open(os.path.join(a.corpus, "manifest.json")))
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" and torch is not None else None
    tmp = tempfile.mkdtemp(prefix="ort-peer-")
    rows = []
    for e in m["entries"]:
        if e["exporter"] != "torchscript" or e["status"] != "ok":
            continue
        if a.only and not re.search(a.only, e["arch"]):
            continue
        path = os.path.join(a.corpus, e["file"])
        feeds = {n: np.load(os.path.join(a.corpus, f)) for n, f in zip(e["inputs"], e["cases"][0]["inputs"])}
        row = {"model": path, "arch": e["arch"], "batch": 1}
        t0 = time.time()
        variants = {}
        try:
            variants["ort_f16"] = float16.convert_float_to_float16(onnx.load(path), keep_io_types=True)
        except Exception as ex:  # noqa: BLE001 - kept as data
            row["ort_f16_error"] = error_summary(ex)
        fixed_path = os.path.join(tmp, "fixed.onnx")
        try:
            fixed = onnx.load(path)
            for name, x in feeds.items():
                make_input_shape_fixed(fixed.graph, name, list(x.shape))
            fix_output_shapes(fixed)
            onnx.save(fixed, fixed_path)
            variants["ort_fixed_f16"] = float16.convert_float_to_float16(fixed, keep_io_types=True)
        except Exception as ex:  # noqa: BLE001
            row["ort_fixed_f16_error"] = error_summary(ex)
        if e["arch"] in OPT_MODEL_TYPE and "ort_fixed_f16" in variants:
            try:
                opt = optimizer.optimize_model(fixed_path, model_type=OPT_MODEL_TYPE[e["arch"]],
                                               num_heads=OPT_NUM_HEADS, hidden_size=OPT_HIDDEN_SIZE,
                                               use_gpu=a.device == "cuda")
                opt.convert_float_to_float16(keep_io_types=True)
                row["ort_opt_fused_ops"] = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
                variants["ort_fixed_opt_f16"] = opt.model
            except Exception as ex:  # noqa: BLE001
                row["ort_fixed_opt_f16_error"] = error_summary(ex)
        for key, model in variants.items():
            data = model.SerializeToString()
            # CUDA graph first; the same session without it only where capture is refused (it was
            # never faster on the H200: 2026-11-29 records) or with --all-configs.
            for graph in (True, False) if a.device == "cuda" else (False,):
                k = key + ("_graph" if graph else "")
                if not graph and f"{key}_graph_ms" in row and not a.all_configs:
                    continue
                try:
                    row[f"{k}_ms"], row[f"{k}_p99_ms"] = measure(ort, data, feeds, a.reps, graph, a.device)
                except Exception as ex:  # noqa: BLE001
                    row[f"{k}_error"] = error_summary(ex)
        times = [row[k] for k in row if k.endswith("_ms") and not k.endswith("p99_ms")]
        row["best_ms"] = min(times) if times else None
        rows.append(row)
        show = ", ".join(f"{k[:-3]} {row[k]:.3f}" for k in row if k.endswith("_ms") and not k.endswith("p99_ms")
                         and k != "best_ms")
        errs = [k for k in row if k.endswith("_error")]
        print(f"{e['arch']}: {show or 'no time'}{' (errors: ' + ', '.join(errs) + ')' if errs else ''} "
              f"[{time.time() - t0:.0f} s]", flush=True)
        # Written after every model: a run cut short by a timeout keeps what it measured.
        with open(a.out, "w") as fh:
            json.dump({"onnxruntime": ort.__version__, "provider": a.device, "device": dev, "dtype": "f16",
                       "reps": a.reps, "rows": rows}, fh, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    ok = sum(1 for r in rows if r["best_ms"] is not None)
    print(f"onnxruntime {a.device} provider: {ok} of {len(rows)} models timed -> {a.out}")
    if a.require_all and (not rows or ok < len(rows)):
        for r in rows:
            if r["best_ms"] is None:
                print(f"  no time: {r['model']}: " + "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("_error")))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

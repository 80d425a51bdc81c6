#!/usr/bin/env python3
"""Self-test of scripts/onnx_kernel_table.py on a made-up folder (no GPU, no torch): profiles
summed by kernel, the slowest launch first, the latency columns, onnxruntime's columns, a model
without a profile and the geometric means."""
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import onnx_kernel_table  # noqa: E402


def kernel(launch, name, kind, ns):
    return {"launch": launch, "name": name, "kernel": kind, "duration_ns": ns, "logical_blocks": 4, "ctas": 4}


def latency(path, rows):
    os.makedirs(path, exist_ok=True)
    json.dump({"tables": [{"batch": 1, "rows": [
        {"model": f"/x/{m}.onnx", "p50_ms": p50, "peer": {"eager_ms": 3.0, "graph_ms": g}} for m, p50, g in rows]}]},
        open(os.path.join(path, "latency.json"), "w"))


def main():
    with tempfile.TemporaryDirectory() as d:
        json.dump({"kernels": [kernel(0, "a", "gemm", 30_000), kernel(1, "b", "reduce", 60_000), kernel(2, "c", "gemm", 10_000)]},
                  open(os.path.join(d, "profile-m1.json"), "w"))
        json.dump({"kernels": [kernel(0, "a", "conv2d", 5_000)]}, open(os.path.join(d, "profile-m2.json"), "w"))
        latency(os.path.join(d, "latency-autotune0"), [("m1", 2.0, 1.0), ("m2", 1.0, 1.0)])
        latency(os.path.join(d, "latency-autotune1"), [("m1", 1.0, 1.0), ("m2", 0.25, 1.0), ("m3", 0.5, 0.25)])
        json.dump({"rows": [{"model": "/x/m1.onnx", "best_ms": 2.0}, {"model": "/x/m2.onnx", "best_ms": 0.5},
                            {"model": "/x/m3.onnx", "best_ms": None}]}, open(os.path.join(d, "ort-latency.json"), "w"))
        out = io.StringIO()
        sys.argv = ["onnx_kernel_table.py", d, "--top", "2", "--json", os.path.join(d, "t.json")]
        with redirect_stdout(out):
            onnx_kernel_table.main()
        text = out.getvalue()
        assert "## m1: 3 launches, kernels alone sum to 0.100 ms" in text, text
        assert "reduce 1, 0.060, 60%; gemm 2, 0.040, 40%" in text, text
        lines = text.splitlines()
        first = lines.index(next(l for l in lines if l.startswith("## m1"))) + 2
        assert "reduce" in lines[first] and "60.0 us" in lines[first], lines[first]
        assert "| m1 | 3 | 0.100 | 2.000 | 1.000 | 3.000 | 1.000 | 1.00 | 2.000 | 0.50 |" in text, text
        # m3 has latency but no profile: a row with dashes, and no ## section
        assert "| m3 | – | – | – | 0.500 | 3.000 | 0.250 | 2.00 | – | – |" in text, text
        assert "## m3" not in text, text
        assert "autotuned / PyTorch CUDA graph, geomean over 3 models: 0.794" in text, text
        assert "no autotune / PyTorch CUDA graph, geomean over 2 models: 1.414" in text, text
        assert "kairos autotuned / onnxruntime CUDA provider (best fp16 configuration), geomean over 2 models: 0.500" in text, text
        assert "onnxruntime CUDA provider / PyTorch CUDA graph, geomean over 2 models: 1.000" in text, text
        report = json.load(open(os.path.join(d, "t.json")))
        assert report["m2"]["by_kernel"]["conv2d"]["share"] == 1.0
    print("onnx_kernel_table self-test ok")


if __name__ == "__main__":
    main()

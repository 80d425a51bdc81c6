#!/usr/bin/env python3
"""Where does an export's error grow? Cuts one corpus export (scripts/onnx_corpus.py's manifest)
at its intermediate tensors and writes a probe corpus: one model per intermediate (the export up
to that tensor, `onnx.utils.extract_model`), its onnxruntime (CPU, f32) outputs on the export's own
cases, and a manifest, so `kairos check-onnx PROBE_DIR --backend cpu --dtype f16` (the CPU
reference's fp16 emulation) or `--backend cuda` prints the error of each intermediate in graph
order.

    python3 scripts/onnx_probe.py CORPUS_DIR t5_encoder.ts18 PROBE_DIR [--ops MatMul,Softmax]

Probes are named p00, p01, ... in graph order; `PROBE_DIR/probes.txt` maps them to the tensors.
A tensor fed by -inf (additive masks) compares as inf: read those rows as "not comparable".
"""
import argparse
import json
import os
import shutil


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus")
    ap.add_argument("export", help="the export's file name without .onnx, e.g. t5_encoder.ts18")
    ap.add_argument("out")
    ap.add_argument("--ops", default="MatMul,Softmax,LayerNormalization,Gemm",
                    help="op types whose outputs are probed (comma list); Softmax inputs are probed too")
    a = ap.parse_args()

    import numpy as np
    import onnx
    import onnx.utils
    import onnxruntime as ort

    m = json.load(open(os.path.join(a.corpus, "manifest.json")))
    found = [e for e in m["entries"] if os.path.basename(e["file"]).removesuffix(".onnx") == a.export]
    if not found:
        raise SystemExit(f"{a.export}: not in {a.corpus}/manifest.json")
    e = found[0]
    path = os.path.join(a.corpus, e["file"])
    ops = set(a.ops.split(","))
    tensors = []
    for n in onnx.load(path).graph.node:
        if n.op_type == "Softmax":
            tensors.append(n.input[0])
        if n.op_type in ops:
            tensors.append(n.output[0])
    os.makedirs(a.out, exist_ok=True)
    # The export's inputs, once: every probe reads the same files.
    feeds = []
    for case in e["cases"]:
        for f in case["inputs"]:
            os.makedirs(os.path.dirname(os.path.join(a.out, f)) or a.out, exist_ok=True)
            shutil.copy(os.path.join(a.corpus, f), os.path.join(a.out, f))
        feeds.append({n: np.load(os.path.join(a.corpus, f)) for n, f in zip(e["inputs"], case["inputs"])})
    entries, lines = [], []
    for i, t in enumerate(tensors):
        name = f"p{i:02d}"
        file = os.path.join(a.out, f"{name}.onnx")
        onnx.utils.extract_model(path, file, e["inputs"], [t])
        sess = ort.InferenceSession(file, providers=["CPUExecutionProvider"])
        cases = []
        for ci, case in enumerate(e["cases"]):
            out = f"{name}.case{ci}.out0.npy"
            np.save(os.path.join(a.out, out), sess.run(None, feeds[ci])[0])
            cases.append({**case, "outputs": [out]})
        entries.append({**e, "arch": name, "family": t[-60:], "file": f"{name}.onnx",
                        "outputs": [sess.get_outputs()[0].name], "cases": cases})
        lines.append(f"{name} {t}")
    json.dump({**m, "entries": entries}, open(os.path.join(a.out, "manifest.json"), "w"), indent=1)
    open(os.path.join(a.out, "probes.txt"), "w").write("\n".join(lines) + "\n")
    print(f"{len(entries)} probes of {a.export} in {a.out} (map: probes.txt); next: kairos check-onnx {a.out} "
          f"--backend cpu --dtype f16")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Markdown table of `kairos check-onnx` reports: one row per architecture, one column per export.

    python3 scripts/onnx_corpus_table.py check-cpu-f32.json [more reports...]

Each cell is the largest relative L2 error against onnxruntime over the model's two input shapes,
or why there is none: `unsupported` (the op kairos stopped at), `FAIL`, or `refused` (the exporter
itself failed; not a kairos result). A column's opset is the one asked of the exporter; where the
exporter wrote another (the dynamo exporter keeps 18 when it cannot convert down), the cell says so.
"""

import json
import sys


def cell(r):
    o = r["outcome"]
    if o == "pass":
        return f"{r['max_relative_error']:.0e}"
    if o == "export-failed":
        return "refused"
    note = (r.get("note") or "").replace("|", "/")
    if o == "unsupported":
        op = note.split("unsupported op ", 1)[-1].split(" ", 1)[0] if "unsupported op " in note else "?"
        return f"unsupported: {op}"
    return "**FAIL**"


def main():
    for path in sys.argv[1:]:
        rep = json.load(open(path))
        rows, cols = {}, []
        for r in rep["results"]:
            col = f"{'ts' if r['exporter'] == 'torchscript' else 'dynamo'} {r['opset']}"
            if col not in cols:
                cols.append(col)
            text = cell(r)
            if r.get("opset_written") and r["opset_written"] != r["opset"]:
                text += f" (wrote {r['opset_written']})"
            rows.setdefault((r["arch"], r["family"], r["source"]), {})[col] = text
        s = rep["summary"]
        print(f"{rep.get('tier', '?')} tier, {rep['backend']} {rep['dtype']} (tolerance {rep['tolerance']:.0e}): "
              f"{s['pass']} pass, {s['unsupported']} unsupported, {s['fail']} FAIL, {s['export_failed']} refused by "
              f"the exporter\n")
        print("| model | family | from | " + " | ".join(cols) + " |")
        print("|---|---|---|" + "---:|" * len(cols))
        for (arch, family, source), cells in rows.items():
            print(f"| {arch} | {family} | {source} | " + " | ".join(cells.get(c, "–") for c in cols) + " |")
        print()


if __name__ == "__main__":
    main()

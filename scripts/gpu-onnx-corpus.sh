#!/usr/bin/env bash
# The ONNX exporter corpus on a GPU machine, in one device call: the corpus is generated there with
# the machine's own PyTorch (both exporters; the tiny tier at opsets 17, 18 and the newest, the
# full tier -- standard sizes, 224x224 -- at FULL_OPSETS), then every export is run by
# `kairos check-onnx --backend cuda` (f16, relative L2 <= 2e-3 against onnxruntime's f32), and
# the tiny tier also on the CPU reference (f32, <= 1e-4). A short table is printed last.
#
#   here:       cargo build --release -p kairos && mkdir -p $CARRY && gzip -c target/release/kairos > $CARRY/kairos.gz
#               (and the wheels the machine lacks, see WHEELS below, into $CARRY/wheels)
#   on device:  CARRY=.carry-onnx OUT=$OUT scripts/gpu-onnx-corpus.sh
#
# Environment: CARRY (default .carry-onnx), OUT (default out/gpu-onnx-corpus), TIERS (default
# "tiny full"), FULL_OPSETS (default 18), ONLY (a regular expression on architecture names).
# WHEELS: timm and onnxscript (the dynamo exporter needs it) are installed from $CARRY/wheels when
# the machine's Python lacks them (no network there).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry-onnx}
OUT=${OUT:-out/gpu-onnx-corpus}
TIERS=${TIERS:-tiny full}
FULL_OPSETS=${FULL_OPSETS:-18}
mkdir -p "$OUT"
bin=/tmp/kairos-onnx
gunzip -c "$CARRY/kairos.gz" > "$bin" && chmod +x "$bin" || { echo "no $CARRY/kairos.gz"; exit 1; }
python3 - <<'EOF' > "$OUT/python.txt" 2>&1
import importlib
for m in ("torch", "torchvision", "transformers", "timm", "onnx", "onnxscript", "onnxruntime"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "missing:", e)
EOF
if grep -q "missing" "$OUT/python.txt" && [ -d "$CARRY/wheels" ]; then
    python3 -m pip install --quiet --no-index --no-deps --find-links "$CARRY/wheels" timm onnxscript onnx-ir ml_dtypes \
        >> "$OUT/python.txt" 2>&1 || echo "wheel install failed" >> "$OUT/python.txt"
fi
cat "$OUT/python.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
for tier in $TIERS; do
    dir=/tmp/onnx-corpus-$tier
    opsets="17,18,newest"
    [ "$tier" = full ] && opsets=$FULL_OPSETS
    t0=$(date +%s)
    python3 scripts/onnx_corpus.py --out "$dir" --tier "$tier" --opsets "$opsets" "${only[@]}" 2>&1 |
        grep -E '^\[[0-9]+\]|written' > "$OUT/generate-$tier.log"
    echo "generated the $tier tier in $(($(date +%s) - t0)) s: $(tail -1 "$OUT/generate-$tier.log")"
    cp "$dir/manifest.json" "$OUT/manifest-$tier.json"
    t0=$(date +%s)
    "$bin" check-onnx "$dir" --backend cuda --json "$OUT/check-$tier-cuda-f16.json" > "$OUT/check-$tier-cuda-f16.md" 2> "$OUT/check-$tier-cuda-f16.log"
    echo "checked $tier on the GPU in $(($(date +%s) - t0)) s: $(tail -1 "$OUT/check-$tier-cuda-f16.md")"
    if [ "$tier" = tiny ]; then
        "$bin" check-onnx "$dir" --backend cpu --json "$OUT/check-$tier-cpu-f32.json" > "$OUT/check-$tier-cpu-f32.md" 2> "$OUT/check-$tier-cpu-f32.log"
        echo "checked $tier on the CPU reference: $(tail -1 "$OUT/check-$tier-cpu-f32.md")"
    fi
done
echo
echo "| tier | backend | pass | unsupported | FAIL | refused by the exporter |"
echo "|---|---|---:|---:|---:|---:|"
for j in "$OUT"/check-*.json; do
    python3 - "$j" <<'EOF'
import json, os, sys
r = json.load(open(sys.argv[1]))
s = r["summary"]
tier = os.path.basename(sys.argv[1]).split("-")[1]
print(f"| {tier} | {r['backend']} {r['dtype']} | {s['pass']} | {s['unsupported']} | {s['fail']} | {s['export_failed']} |")
EOF
done

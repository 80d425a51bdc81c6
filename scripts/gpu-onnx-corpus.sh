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
# "tiny full"), FULL_OPSETS (default 18), ONLY (a regular expression on architecture names),
# SHARDS (generators run side by side, default 12), LATENCY=0 skips the full tier's batch-1 latency
# (kairos `bench latency` beside PyTorch fp16 eager and CUDA graph of the same modules).
# WHEELS: timm and onnxscript (the dynamo exporter needs it) are installed from $CARRY/wheels when
# the machine's Python lacks them (no network there).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry-onnx}
OUT=${OUT:-out/gpu-onnx-corpus}
TIERS=${TIERS:-tiny full}
FULL_OPSETS=${FULL_OPSETS:-18}
SHARDS=${SHARDS:-12}
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
    # The exporters run on one core each: SHARDS generators side by side, then one manifest.
    rm -rf "$dir"
    parts=()
    for k in $(seq 0 $((SHARDS - 1))); do
        parts+=("$dir/shard$k")
        python3 scripts/onnx_corpus.py --out "$dir/shard$k" --tier "$tier" --opsets "$opsets" --shard "$k/$SHARDS" \
            "${only[@]}" > "$OUT/generate-$tier-$k.log" 2>&1 &
    done
    wait
    python3 scripts/onnx_corpus.py --out "$dir" --merge "${parts[@]}" | tee "$OUT/generate-$tier.log"
    grep -h -E '^\[[0-9]+\]' "$OUT"/generate-$tier-*.log >> "$OUT/generate-$tier.log"
    rm -f "$OUT"/generate-$tier-*.log
    echo "generated the $tier tier in $(($(date +%s) - t0)) s"
    cp "$dir/manifest.json" "$OUT/manifest-$tier.json"
    t0=$(date +%s)
    "$bin" check-onnx "$dir" --backend cuda --json "$OUT/check-$tier-cuda-f16.json" > "$OUT/check-$tier-cuda-f16.md" 2> "$OUT/check-$tier-cuda-f16.log"
    echo "checked $tier on the GPU in $(($(date +%s) - t0)) s: $(tail -1 "$OUT/check-$tier-cuda-f16.md")"
    if [ "$tier" = full ] && [ "${LATENCY:-1}" = 1 ]; then
        # Batch-1 latency of each TorchScript export (the exports of one model differ little): kairos
        # through its engine beside PyTorch fp16 eager and CUDA graph of the module it came from.
        t0=$(date +%s)
        python3 scripts/onnx_corpus.py --out "$dir" --latency "$OUT/torch-latency-$tier.json" > "$OUT/torch-latency-$tier.log" 2>&1
        models=$(python3 -c 'import json, os, sys
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
print(",".join(os.path.join(d, e["file"]) for e in m["entries"] if e["exporter"] == "torchscript" and e["status"] == "ok"))' "$dir")
        "$bin" bench latency --backend cuda --batch 1 --seq-len 16 --no-autotune --requests 50 --budget-s 5 \
            --models "$models" --peer "$OUT/torch-latency-$tier.json" --out "$OUT/latency-$tier" > "$OUT/latency-$tier.log" 2>&1
        echo "latency of the $tier tier in $(($(date +%s) - t0)) s: $(grep -i geomean "$OUT/latency-$tier/latency.md" | head -2)"
    fi
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

#!/usr/bin/env bash
# What the GPU does with a forward pass's kernels once they are all queued, kairos against
# PyTorch's CUDA graphs, in one device call: crates/gputest/examples/held_bench.rs (protocol, plain
# grids, CUDA graphs of kairos' kernels; alone and 8 models at once) and scripts/held_peer.py
# (PyTorch graphs, the same way). docs/benchmarks.md, "Where the GPU time goes".
#
#   scripts/held-bench.sh build   here: the example, release, stripped and gzipped into .carry-gpu/
#   scripts/held-bench.sh run     on the device (carry .carry-gpu); MODELS, REPS
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-run}" = build ]; then
    set -e
    cargo build --release -p kairos-gputest --example held_bench
    mkdir -p .carry-gpu
    strip -o .carry-gpu/held_bench target/release/examples/held_bench
    gzip -9f .carry-gpu/held_bench
    exit 0
fi
OUTD=${OUT:-out/held-bench}
mkdir -p "$OUTD"
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
gunzip -c .carry-gpu/held_bench.gz >/tmp/held_bench && chmod +x /tmp/held_bench ||
    { echo "missing .carry-gpu/held_bench.gz: run scripts/held-bench.sh build first"; exit 1; }
MODELS=${MODELS:-resnet18,mobilenet_v2,resnet34,squeezenet1_1,resnet50,densenet121,googlenet,inception_v3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUTD/device.txt"
t=$(date +%s)
timeout "${KAIROS_S:-420}" /tmp/held_bench --models "$MODELS" --reps "${REPS:-20}" --out "$OUTD/held_bench.json" >"$OUTD/held_bench.log" 2>&1
echo "== held_bench: rc $? in $(( $(date +%s) - t )) s"
tail -25 "$OUTD/held_bench.log"
t=$(date +%s)
timeout "${PEER_S:-240}" python3 scripts/held_peer.py --models "$MODELS" --reps "${REPS:-20}" --out "$OUTD/held_peer.json" >"$OUTD/held_peer.log" 2>&1
echo "== held_peer: rc $? in $(( $(date +%s) - t )) s"
python3 - "$OUTD" <<'EOF'
import json, sys, os
d = sys.argv[1]
try:
    k = json.load(open(os.path.join(d, "held_bench.json")))
    p = json.load(open(os.path.join(d, "held_peer.json")))
except Exception as e:
    print("no table:", e); sys.exit(0)
print(f"device time once queued (ms, median); kairos: {k['device']}, PyTorch {p['torch']}")
V = ("plain", "graph", "job", "kernel", "job-light", "kernel-light", "job-run", "job-run-plain")
print(f"{'model':<14}{'launches':>9}" + "".join(f"{v:>13}" for v in V) + f"{'torch':>8}  us/launch over graph: kernel, kernel-light")
for m, r in k["alone_ms"].items():
    t = p["alone_ms"].get(m, float("nan"))
    per = lambda v: (r[v] - r["graph"]) * 1e3 / r["launches"]
    print(f"{m:<14}{r['launches']:>9}" + "".join(f"{r[v]:>13.3f}" for v in V) + f"{t:>8.3f}  {per('kernel'):6.2f} {per('kernel-light'):6.2f}")
c = k["concurrent"]
pc = p["concurrent"]
print("all at once, one stream each: makespan ms (sum of alone)")
for v in V:
    print(f"  kairos {v:<7}{c[v]['makespan_ms']:>8.3f} ({c[v]['sum_alone_ms']:.3f})")
print(f"  torch graph   {pc['makespan_ms']:>8.3f} ({pc['sum_alone_ms']:.3f})")
EOF

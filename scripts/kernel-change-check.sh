#!/usr/bin/env bash
# Checks a change to the kernel library in one device call: the GPU kernel tests (every kernel case
# against the CPU reference, protocol and plain builds, zoo models against the CPU reference and
# tract), then `kairos bench latency` at batch 1 with this build and with an earlier one on the same
# GPU, interleaved, so a slowdown shows beside the run-to-run spread.
#
#   scripts/gpu-suite.sh build                  here: the GPU test binary (CARRY=.carry-gpu) and
#                                               both CUBIN variants in .carry-cubin
#   KEEP_CUBIN=1 scripts/carry-build.sh         here: .carry/kairos.gz
#   cp <earlier .carry/kairos.gz> .carry/kairos-base.gz
#   scripts/kernel-change-check.sh              on the device, carrying .carry, .carry-gpu and .carry-cubin
#
# Environment: KAIROS_ZOO_MODELS (zoo test models), LATENCY_MODELS (default: the zoo), REPEATS (2).
# Records in $OUT (out/kernel-change otherwise): tests.log, latency-{base,new}-N/latency.json; the
# table of p50s is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/kernel-change}
mkdir -p "$OUT"
BIN=/tmp/kairos-check
mkdir -p "$BIN"
gunzip -c .carry-gpu/kairos-cuda-gpu-tests.gz >"$BIN/gpu-tests" && chmod +x "$BIN/gpu-tests" || { echo "missing .carry-gpu/kairos-cuda-gpu-tests.gz"; exit 1; }
for b in kairos kairos-base; do
    gunzip -c ".carry/$b.gz" >"$BIN/$b" && chmod +x "$BIN/$b" || { echo "missing .carry/$b.gz"; exit 1; }
done
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} KAIROS_PROGRESS=lines
. scripts/cubin-carry.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"

t0=$(date +%s)
KAIROS_ZOO_MODELS=${KAIROS_ZOO_MODELS:-resnet50,mobilenet_v2,densenet121,bert_base,gpt2} \
    timeout "${TESTS_S:-300}" "$BIN/gpu-tests" --include-ignored --test-threads=1 --nocapture kernels_match_cpu_reference \
    protocol_and_plain_builds_agree zoo_models_match >"$OUT/tests.log" 2>&1
tests_rc=$?
t1=$(date +%s)

models=${LATENCY_MODELS:-resnet18,resnet34,resnet50,resnet152,mobilenet_v2,squeezenet1_1,vgg19,densenet121,densenet201,googlenet,inception_v3,bert_base,distilbert,gpt2}
for i in $(seq "${REPEATS:-2}"); do
    for b in base new; do
        bin="$BIN/kairos"
        [ "$b" = base ] && bin="$BIN/kairos-base"
        timeout 150 "$bin" bench latency --backend cuda --batch 1 --requests 50 --budget-s 3 --models "$models" \
            --out "$OUT/latency-$b-$i" >"$OUT/latency-$b-$i.log" 2>&1
        echo "latency $b $i: rc $?"
    done
done
t2=$(date +%s)

echo
echo "== GPU tests (rc $tests_rc, $((t1 - t0)) s)"
grep -E "FAIL|panicked|^test .* (ok|FAILED)$|^test result" "$OUT/tests.log" | head -40
echo "== latency at batch 1, p50 ms: base build | this build ($((t2 - t1)) s)"
python3 - "$OUT" "${REPEATS:-2}" <<'PY'
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
rows = {}
for i in range(1, n + 1):
    for b in ("base", "new"):
        p = os.path.join(out, f"latency-{b}-{i}", "latency.json")
        if not os.path.exists(p):
            continue
        for r in json.load(open(p))["tables"][0]["rows"]:
            rows.setdefault(r["model"], {}).setdefault(b, []).append(r.get("p50_ms"))
import math
logs = []
for m, v in rows.items():
    f = lambda l: " ".join(f"{x:.3f}" if x else "-" for x in l)
    base, new = [x for x in v.get("base", []) if x], [x for x in v.get("new", []) if x]
    ratio = min(new) / min(base) if base and new else float("nan")
    if ratio == ratio:
        logs.append(math.log(ratio))
    print(f"  {m:14s} {f(v.get('base', []))} | {f(v.get('new', []))}   best new/base {ratio:.3f}")
if logs:
    print(f"  geomean of best new/base: {math.exp(sum(logs) / len(logs)):.3f}")
PY
exit $tests_rc

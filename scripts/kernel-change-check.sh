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
# Environment: KAIROS_ZOO_MODELS (zoo test models), LATENCY_MODELS (default: the zoo), REPEATS (2),
# LATENCY_POLICY (the engine's policy, default fifo; paella times kernel-by-kernel dispatch),
# SKIP_TESTS=1 (latency only), CARRY (the folder of the binaries, default .carry). With .carry/dispatch_cost.gz and .carry/dispatch_cost-base.gz (the
# kairos-sched example of each build) both builds' dispatcher cost is measured too, interleaved.
# Records in $OUT (out/kernel-change otherwise): tests.log, latency-{base,new}-N/latency.json; the
# table of p50s is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/kernel-change}
mkdir -p "$OUT"
BIN=/tmp/kairos-check
mkdir -p "$BIN"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    gunzip -c .carry-gpu/kairos-cuda-gpu-tests.gz >"$BIN/gpu-tests" && chmod +x "$BIN/gpu-tests" || { echo "missing .carry-gpu/kairos-cuda-gpu-tests.gz"; exit 1; }
fi
for b in kairos kairos-base; do
    gunzip -c "${CARRY:-.carry}/$b.gz" >"$BIN/$b" && chmod +x "$BIN/$b" || { echo "missing ${CARRY:-.carry}/$b.gz"; exit 1; }
done
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} KAIROS_PROGRESS=lines
. scripts/cubin-carry.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"

t0=$(date +%s)
tests_rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    KAIROS_ZOO_MODELS=${KAIROS_ZOO_MODELS:-resnet50,mobilenet_v2,densenet121,bert_base,gpt2} \
        timeout "${TESTS_S:-300}" "$BIN/gpu-tests" --include-ignored --test-threads=1 --nocapture kernels_match_cpu_reference \
        protocol_and_plain_builds_agree zoo_models_match >"$OUT/tests.log" 2>&1
    tests_rc=$?
fi
t1=$(date +%s)

models=${LATENCY_MODELS:-resnet18,resnet34,resnet50,resnet152,mobilenet_v2,squeezenet1_1,vgg19,densenet121,densenet201,googlenet,inception_v3,bert_base,distilbert,gpt2}
for i in $(seq "${REPEATS:-2}"); do
    for b in base new; do
        bin="$BIN/kairos"
        [ "$b" = base ] && bin="$BIN/kairos-base"
        timeout 150 "$bin" bench latency --backend cuda --batch 1 --requests 50 --budget-s 3 --models "$models" \
            --policy "${LATENCY_POLICY:-fifo}" --out "$OUT/latency-$b-$i" >"$OUT/latency-$b-$i.log" 2>&1
        echo "latency $b $i: rc $?"
    done
done
t2=$(date +%s)
if [ -f "${CARRY:-.carry}/dispatch_cost.gz" ] && [ -f "${CARRY:-.carry}/dispatch_cost-base.gz" ]; then
    for b in dispatch_cost dispatch_cost-base; do
        gunzip -c "${CARRY:-.carry}/$b.gz" >"$BIN/$b" && chmod +x "$BIN/$b"
    done
    for i in $(seq "${REPEATS:-2}"); do
        for b in base new; do
            bin="$BIN/dispatch_cost"
            [ "$b" = base ] && bin="$BIN/dispatch_cost-base"
            timeout 120 taskset -c 2 "$bin" >"$OUT/dispatch-cost-$b-$i.txt" 2>&1
            echo "dispatch cost $b $i: rc $?"
        done
    done
fi

echo
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== GPU tests (rc $tests_rc, $((t1 - t0)) s)"
    grep -E "FAIL|panicked|^test .* (ok|FAILED)$|^test result" "$OUT/tests.log" | head -40
fi
echo "== latency at batch 1 (policy ${LATENCY_POLICY:-fifo}), p50 ms: base build | this build ($((t2 - t1)) s)"
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
if ls "$OUT"/dispatch-cost-new-*.txt >/dev/null 2>&1; then
    echo "== dispatcher cost (crates/sched/examples/dispatch_cost.rs, one core): this build / base, best of runs"
    python3 - "$OUT" <<'PY'
import glob, math, os, re, sys
def rows(path):
    out, table = {}, None
    for line in open(path):
        if line.startswith("## "):
            table = "decision" if "decision" in line.split("(")[0].lower() else "sustained"
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if table and len(cells) >= 3 and re.fullmatch(r"[0-9.]+", cells[-1] or "x") and cells[1].isdigit():
            # decision: ns/decision is the last cell; sustained: ns/launch is the second to last
            ns = float(cells[-1]) if table == "decision" else float(cells[-2])
            out[(table, cells[0], int(cells[1]))] = ns
    return out
best = {}
for b in ("base", "new"):
    for f in glob.glob(os.path.join(sys.argv[1], f"dispatch-cost-{b}-*.txt")):
        for k, v in rows(f).items():
            best.setdefault(b, {})[k] = min(v, best.get(b, {}).get(k, float("inf")))
for table in ("decision", "sustained"):
    r = [(k, best["new"][k] / best["base"][k]) for k in best.get("base", {}) if k[0] == table and k in best.get("new", {}) and best["base"][k] > 0]
    if r:
        g = math.exp(sum(math.log(x) for _, x in r) / len(r))
        worst = max(r, key=lambda t: t[1])
        print(f"  {table:9s}: {len(r)} rows, geomean new/base {g:.3f}, worst {worst[1]:.3f} ({worst[0][1]}, {worst[0][2]})")
PY
fi
exit $tests_rc

#!/usr/bin/env bash
# Kernel-by-kernel dispatch against a CUDA-graph server, on one GPU, in one device call: the
# measurements behind docs/benchmarks.md's "Dispatch speed" section.
#
#   scripts/dispatch-bench.sh build    here (no GPU): the release binary, stripped and gzipped, into
#                                      .carry/kairos.gz, and the kernel library as CUBIN into
#                                      .carry-cubin/ (needs libnvrtc: LD_LIBRARY_PATH at an NVRTC 13)
#   scripts/dispatch-bench.sh run      on the device, with .carry/kairos.gz and .carry-cubin carried
#
# STEPS (comma-separated, default "check,peers,breakdown"; "serve" is the long one):
#   check      four requests at once through the dispatcher (CHECK_POLICIES: paella, streams) on
#              CHECK_MODELS (resnet50, bert_base, densenet121), outputs compared with tract
#   peers      PyTorch eager and CUDA-graph latency per model (scripts/pytorch_peer.py, batch 1)
#   breakdown  `kairos bench breakdown`: every model alone and the mix (BREAKDOWN_RATE req/s),
#              launch by launch, under fifo, streams and paella (BREAKDOWN_POLICIES)
#   profile    `kairos profile` of PROFILE_MODELS (mix8's, the rest of paella-mix's, bert_base) into
#              $WORK/profiles/<gpu key>/ (the layout of data/profiles/, for the simulator)
#   serve      `kairos bench run SERVE_SPECS` (default mix8:0.5:1:1.5:2:2.5; SERVE_SIGMAS, SERVE_POLICIES;
#              SERVE_REQUESTS (2000) a point, the threaded engine, traces kept; SERVE_ARGS: more options,
#              e.g. "--models resnet18,resnet50 --arrival lognormal:1.5 --rate 1" for custom), then each run of
#              SERVE_EXTRA ("NAME|SPECS|POLICIES|SIGMAS|ARGS;...", e.g.
#              "tenants|mix8:1:1.5|paella,paella:2000|2|--tenant-per-model") into serve-NAME/; then, unless
#              NO_PEERS=1, scripts/peer_replay.py on the very same traces (PEER_MODES) and
#              `kairos bench report` merging both into one table and plot
#   replay     the peers alone, on the traces and results of an earlier call carried in
#              REPLAY_DIR (default .carry-serve: results.json and traces/ of a serve step)
#
# CUDA_DEVICE_MAX_CONNECTIONS defaults to 32 here (one hardware queue per stream of the
# dispatcher's pool); set it to 8 to see the default. Models are autotuned at load unless
# NO_AUTOTUNE=1; the tuned tiles are saved to $OUT/autotune/ (carry them in .carry-cubin/ to skip
# tuning in the next call). Everything is written under $WORK (/tmp/dispatch-bench) and packed into
# $OUT/results.tgz (the device tool returns 8 files); the summary and the tables are copied beside
# it, and a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
[ "$mode" = build ] && exec scripts/carry-build.sh

FINAL=${OUT:-out/dispatch-bench}
OUT=${WORK:-/tmp/dispatch-bench}
mkdir -p "$OUT" "$FINAL"
BIN=/tmp/kairos-bin
mkdir -p "$BIN"
gunzip -c .carry/kairos.gz >"$BIN/kairos" && chmod +x "$BIN/kairos" || { echo "missing .carry/kairos.gz: run scripts/dispatch-bench.sh build first"; exit 1; }
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
. scripts/cubin-carry.sh
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export PYTHONUNBUFFERED=1
[ "${NO_AUTOTUNE:-0}" = 1 ] && export KAIROS_NO_AUTOTUNE=true
steps=${STEPS:-check,peers,breakdown}
has() { [[ ",$steps," == *",$1,"* ]]; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "== $name"; timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1; echo "== $name: rc $? in $(( $(date +%s) - t )) s" | tee -a "$OUT/summary.txt"; }
MODELS=${MODELS:-resnet18,mobilenet_v2,resnet34,squeezenet1_1,resnet50,densenet121,googlenet,inception_v3,bert_base}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; echo "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"; } | tee "$OUT/device.txt"

if has check; then
    for m in ${CHECK_MODELS:-resnet50 bert_base densenet121}; do
        for p in ${CHECK_POLICIES:-paella streams}; do
            step "check-$m-$p" 120 "$BIN/kairos" run "$m" --backend cuda --dtype f16 --policy "$p" --requests 4 --check
        done
    done
fi
has peers && step peers "${PEERS_S:-200}" python3 scripts/pytorch_peer.py --batch 1 --models "$MODELS" --reps 30 --out "$OUT/pytorch_peer.json"
if has breakdown; then
    step breakdown "${BREAKDOWN_S:-420}" "$BIN/kairos" bench breakdown --backend cuda --models "$MODELS" \
        --policies "${BREAKDOWN_POLICIES:-fifo,streams,paella}" --requests "${BREAKDOWN_REQUESTS:-100}" \
        --mix-rate "${BREAKDOWN_RATE:-600}" --mix-requests "${BREAKDOWN_MIX_REQUESTS:-2000}" --out "$OUT/breakdown"
fi
if has profile; then
    key=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '/H200/ {print "h200"; next} /H100/ && /PCIe/ {print "h100_pcie"; next} {print "h100_sxm"}')
    mkdir -p "$OUT/profiles/$key"
    t0=$(date +%s)
    for m in ${PROFILE_MODELS:-resnet18 mobilenet_v2 resnet34 squeezenet1_1 resnet50 densenet121 googlenet inception_v3 resnet152 densenet201 vgg19 bert_base}; do
        step "profile-$m" 120 "$BIN/kairos" profile "$m" --dtype f16 -o "$OUT/profiles/$key/$m-f16-b1.json"
    done
    echo "== profiles: $(ls "$OUT/profiles/$key" | wc -l) in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
fi
serve_run() { # name out-dir specs policies sigmas extra-args...
    local name=$1 dir=$2 specs=$3 policies=$4 sigmas=$5; shift 5
    step "$name" "${SERVE_KAIROS_S:-300}" "$BIN/kairos" bench run "$specs" --backend cuda --engine threaded \
        --sigma "$sigmas" --policies "$policies" --saturation 0.8 --traces \
        --requests "${SERVE_REQUESTS:-2000}" --out "$dir" "$@"
}
replay() { # dir with results.json and traces/ [step name suffix]
    local suffix=${2:-}
    step "serve-peers$suffix" "${SERVE_PEERS_S:-280}" python3 scripts/peer_replay.py --traces "$1/traces" \
        --modes "${PEER_MODES:-graph:1,graph:4,graph:8,graph-priority:4,streams:4}" --budget-s "${SERVE_PEERS_BUDGET_S:-260}" --out "$1/peers.json"
    [ -f "$1/peers.json" ] && step "serve-report$suffix" 60 "$BIN/kairos" bench report --results "$1/results.json" --peers "$1/peers.json"
}
if has serve; then
    sout="$OUT/serve"
    # shellcheck disable=SC2086
    serve_run serve-kairos "$sout" "${SERVE_SPECS:-mix8:0.5:1:1.5:2:2.5}" "${SERVE_POLICIES:-paella,streams}" "${SERVE_SIGMAS:-2}" ${SERVE_ARGS:-}
    IFS=';' read -ra extra <<<"${SERVE_EXTRA:-}"
    for e in "${extra[@]}"; do
        [ -n "$e" ] || continue
        IFS='|' read -r name specs policies sigmas args <<<"$e"
        # shellcheck disable=SC2086
        serve_run "serve-$name" "$OUT/serve-$name" "$specs" "$policies" "$sigmas" $args
    done
    [ "${NO_PEERS:-0}" = 1 ] || replay "$sout"
fi
if has replay; then
    # REPLAY_DIR: one serve step's folder (results.json, traces/), or folders of them (serve, serve-NAME).
    src=${REPLAY_DIR:-.carry-serve}
    if [ -f "$src/results.json" ]; then
        mkdir -p "$OUT/serve" && cp -r "$src"/. "$OUT/serve/" && replay "$OUT/serve"
    else
        # One replay over every folder's traces (the graphs are captured once; a trace in several
        # folders replays once), merged into each (only runs of the folder's own traces: traces are
        # named by preset and load, so runs with other arguments may share a name).
        tdirs=()
        for d in "$src"/*/; do
            n=$(basename "$d")
            [ -f "$d/results.json" ] || continue
            rm -rf "${OUT:?}/$n" && mkdir -p "$OUT/$n" && cp -r "$d". "$OUT/$n/" && tdirs+=("$OUT/$n/traces")
        done
        step serve-peers "${SERVE_PEERS_S:-280}" python3 scripts/peer_replay.py --traces "${tdirs[@]}" \
            --modes "${PEER_MODES:-graph:1,graph:4,graph:8,graph-priority:4,streams:4}" --budget-s "${SERVE_PEERS_BUDGET_S:-260}" --out "$OUT/peers.json"
        for d in "$OUT"/serve*/; do
            [ -f "$OUT/peers.json" ] && [ -f "$d/results.json" ] &&
                step "report-$(basename "$d")" 60 "$BIN/kairos" bench report --results "$d/results.json" --peers "$OUT/peers.json"
        done
    fi
fi
# The tuned tiles, for the next call's carry.
mkdir -p "$OUT/autotune" && cp "$KAIROS_CACHE_DIR"/autotune-*.json "$OUT/autotune/" 2>/dev/null
tar czf /tmp/results.tgz -C "$OUT" . 2>/dev/null
# The device tool returns files of at most 16 MiB: larger archives come back in parts
# (cat results.tgz.part-* > results.tgz).
if [ "$(stat -c %s /tmp/results.tgz)" -gt 15000000 ]; then
    split -b 15000000 /tmp/results.tgz "$FINAL/results.tgz.part-"
else
    cp /tmp/results.tgz "$FINAL/results.tgz"
fi
cp "$OUT/summary.txt" "$FINAL/" 2>/dev/null
[ -f "$OUT/breakdown/breakdown.md" ] && cp "$OUT/breakdown/breakdown.md" "$FINAL/"
[ -f "$OUT/serve/results.md" ] && cp "$OUT/serve/results.md" "$FINAL/serve.md"
for d in "$OUT"/serve-*/; do [ -f "$d/results.md" ] && cp "$d/results.md" "$FINAL/$(basename "$d").md"; done

echo
echo "== summary"
cat "$OUT/summary.txt"
for f in "$OUT"/check-*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E 'copies through|relative L2' "$f" | tr '\n' ' ')"; done
if [ -f "$OUT/pytorch_peer.json" ]; then
    python3 - "$OUT/pytorch_peer.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"PyTorch {d['torch']} on {d['device']} (batch 1): model eager_ms graph_ms")
for r in d["rows"]:
    print(f"  {r['model']:<14} {r.get('eager_ms', float('nan')):7.3f} {r.get('graph_ms', float('nan')):7.3f} {r.get('error', '')}")
PY
fi
[ -f "$OUT/breakdown/breakdown.md" ] && cat "$OUT/breakdown/breakdown.md"
for res in "$OUT"/serve/results.json "$OUT"/serve-*/results.json; do
    [ -f "$res" ] || continue
    python3 - "$res" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"\n== {sys.argv[1]} on {r['device']} (peers: {'; '.join(r['peers']) or 'none'})")
print(f"{'preset variant':<22} {'system':<8} {'policy':<16} {'load':>5} {'offered':>8} {'served/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'disp us/req':>11} {'rec/launch':>10}")
for p in r["presets"]:
    for pt in sorted(p["points"], key=lambda x: (x["variant"], x["system"] != "kairos", x["policy"], x["load"])):
        m = pt["metrics"]["overall"]
        d = pt.get("dispatcher") or {}
        per = d.get("busy_ns", 0) / max(d.get("completed", 0), 1) / 1e3 if d else float("nan")
        rl = d.get("events", 0) / max(d.get("launches", 0), 1) if d else float("nan")
        sat = " sat" if pt["saturated"] else ""
        print(f"{p['preset'] + ' ' + pt['variant']:<22} {pt['system']:<8} {pt['policy'].removeprefix(pt['system'] + '-'):<16} {pt['load']:>5} "
              f"{pt['metrics']['offered_per_s']:>8.0f} {m['throughput_per_s']:>9.1f} {m['latency']['p50_ns'] / 1e6:>8.2f} {m['latency']['p99_ns'] / 1e6:>8.2f} {per:>11.1f} {rl:>10.2f}{sat}")
PY
done

#!/usr/bin/env bash
# A soak on the GPU longer than one device command (10 min at most): `kairos bench soak --backend
# cuda` runs in the background on the device, across two calls made back to back (the device keeps
# a machine ~30 s between calls, and what a call started in its own session goes on running):
#
#   scripts/gpu-soak.sh start    unpacks $CARRY/kairos.gz (default .carry) and the CUBIN cache,
#                                starts the soak (SOAK_S seconds of load, default 600, at SOAK_RATE
#                                requests/s, default 100, over SOAK_MODELS) detached, and waits
#                                WAIT_S seconds (default 560) printing its progress
#   scripts/gpu-soak.sh finish   waits for the soak to end (FINISH_WAIT_S, default 400), copies its
#                                results and log to $OUT and prints its verdict
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
OUT=${OUT:-out/gpu-soak}
mkdir -p "$OUT"
WORK=/tmp/kairos-gpu-soak
case "$mode" in
start)
    BIN=/tmp/kairos-bin
    mkdir -p "$BIN" "$WORK"
    CARRY=${CARRY:-.carry}
    gunzip -c "$CARRY/kairos.gz" >"$BIN/kairos" && chmod +x "$BIN/kairos" || { echo "missing $CARRY/kairos.gz"; exit 1; }
    export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
    . scripts/cubin-carry.sh
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$WORK/device.txt"
    rm -rf "$WORK/soak"
    setsid nohup "$BIN/kairos" bench soak --backend cuda --duration-s "${SOAK_S:-600}" \
        --models "${SOAK_MODELS:-mlp,pair,embed,resnet18,resnet50}" --rate "${SOAK_RATE:-100}" --out "$WORK/soak" \
        >"$WORK/soak.log" 2>&1 </dev/null &
    echo $! >"$WORK/pid"
    echo "soak started (pid $(cat "$WORK/pid")) at $(date -u +%T)"
    waited=0
    while [ "$waited" -lt "${WAIT_S:-560}" ]; do
        sleep 20
        waited=$((waited + 20))
        kill -0 "$(cat "$WORK/pid")" 2>/dev/null || { echo "the soak ended early"; break; }
        [ $((waited % 60)) = 0 ] && grep -E '^\[' "$WORK/soak.log" | tail -1
    done
    tail -3 "$WORK/soak.log"
    ;;
finish)
    [ -f "$WORK/pid" ] || { echo "no soak was started here (a fresh machine?)"; exit 1; }
    pid=$(cat "$WORK/pid")
    for _ in $(seq 1 "${FINISH_WAIT_S:-400}"); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    kill -0 "$pid" 2>/dev/null && { echo "the soak is still running after ${FINISH_WAIT_S:-400} s"; exit 1; }
    cp -r "$WORK/soak" "$WORK/soak.log" "$WORK/device.txt" "$OUT/" 2>/dev/null
    grep -vE '^\[' "$WORK/soak.log" | tail -40
    ;;
*)
    echo "usage: scripts/gpu-soak.sh start|finish"
    exit 2
    ;;
esac

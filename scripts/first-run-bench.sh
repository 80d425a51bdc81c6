#!/usr/bin/env bash
# First run on a fresh GPU machine: time from process start to the first correct response, with an
# empty kernel cache (the binary without embedded kernels, .carry/kairos-plain.gz, or without it the
# embedded images missed on purpose, see below) and with the
# prebuilt images (the binary scripts/build-release.sh builds, .carry/kairos.gz, an empty cache
# folder), and the whole library compiled from scratch on every core.
#
#   scripts/carry-build.sh                  here (needs NVRTC): both binaries into .carry/
#   scripts/first-run-bench.sh [STEPS]      on the device, with .carry carried
#
# STEPS (comma-separated, default all): run, run-f16, serve1, serveall, library. Every step uses a
# fresh cache folder. Records land in $OUT (one JSON per step, logs); a table is printed last.
# EMPTY_ONLY=1 skips the prebuilt half of each step, PREBUILT_ONLY=1 the empty-cache half. SETTLE_S (default 0): after a serve step's first responses, wait up to that long for the quick
# kernel builds to be replaced by the optimized ones, then ask every model again (checked too).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-run,run-f16,serve1,serveall,library}
OUT=${OUT:-out/first-run}
mkdir -p "$OUT"
BIN=/tmp/first-run-bin
mkdir -p "$BIN"
gunzip -c .carry/kairos.gz >"$BIN/kairos" && chmod +x "$BIN/kairos" || { echo "missing .carry/kairos.gz: run scripts/carry-build.sh first"; exit 1; }
if [ -e .carry/kairos-plain.gz ]; then
    gunzip -c .carry/kairos-plain.gz >"$BIN/kairos-plain" && chmod +x "$BIN/kairos-plain"
else
    # No second binary: the embedded images are missed on purpose instead. A define that no kernel
    # reads enters every cache key (KAIROS_NVRTC_OPTIONS), so no embedded or cached image matches and
    # every unit compiles from source, as on a fresh machine with a binary that embeds none.
    printf '#!/bin/sh\nKAIROS_NVRTC_OPTIONS=-DKAIROS_COLD_START exec %s "$@"\n' "$BIN/kairos" >"$BIN/kairos-plain"
    chmod +x "$BIN/kairos-plain"
    echo "empty cache: the embedded images are missed through KAIROS_NVRTC_OPTIONS=-DKAIROS_COLD_START"
fi
export PYTHONUNBUFFERED=1 KAIROS_PROGRESS=lines
has() { [[ ",$steps," == *",$1,"* ]]; }
fresh() { local d; d=$(mktemp -d /tmp/kairos-cache-XXXX); echo "$d"; }
# NVRTC 12.9+ also caches its output in the driver's compute cache (~/.nv/ComputeCache): an empty
# cache means that one too, so every step gets its own (CUDA_CACHE_PATH), as a fresh machine has.
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
ZOO=resnet18,resnet34,resnet50,resnet152,mobilenet_v2,squeezenet1_1,vgg19,densenet121,densenet201,googlenet,inception_v3,bert_base,distilbert,gpt2
nproc | sed 's/^/host cores: /' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/device.txt"
"$BIN/kairos" kernels status --arch 90 --cache-dir /nonexistent | head -1 | tee -a "$OUT/device.txt"

# `kairos run MODEL --backend cuda`: wall time of the whole command, and the time it reports
# from its start to the output (before the tract check).
run_cmd() { # name bin model dtype
    local name=$1 bin=$2 model=$3 dtype=$4 cache t0 t1
    cache=$(fresh)
    t0=$(date +%s.%N)
    KAIROS_CACHE_DIR=$cache CUDA_CACHE_PATH=$(fresh) timeout 400 "$BIN/$bin" run "$model" --backend cuda --dtype "$dtype" --check >"$OUT/$name.log" 2>&1
    local rc=$?
    t1=$(date +%s.%N)
    local since ok
    since=$(grep -o '[0-9.]* s since the command started' "$OUT/$name.log" | cut -d' ' -f1)
    ok=$(grep -o 'relative L2 error vs tract: [0-9.e+-]*' "$OUT/$name.log" | awk '{print $NF}' | head -1)
    printf '%s\trc %s\tfirst response %s s\twall %s s\trel L2 vs tract %s\tcache files %s\n' "$name" "$rc" "${since:-?}" \
        "$(secs "$t0" "$t1")" "${ok:-?}" "$(ls "$cache" | wc -l)" | tee -a "$OUT/table.txt"
}
if has run; then
    [ "${PREBUILT_ONLY:-0}" = 1 ] || run_cmd run-resnet50-f32-empty kairos-plain resnet50 f32
    [ "${EMPTY_ONLY:-0}" = 1 ] || run_cmd run-resnet50-f32-prebuilt kairos resnet50 f32
fi
if has run-f16; then
    [ "${PREBUILT_ONLY:-0}" = 1 ] || run_cmd run-resnet50-f16-empty kairos-plain resnet50 f16
    [ "${EMPTY_ONLY:-0}" = 1 ] || run_cmd run-resnet50-f16-prebuilt kairos resnet50 f16
fi
serve() { # name bin models
    local name=$1 bin=$2 models=$3
    CUDA_CACHE_PATH=$(fresh) timeout 500 python3 scripts/first_run.py --bin "$BIN/$bin" --models "$models" --dtype f16 --cache-dir "$(fresh)" \
        --label "$name" --out "$OUT/$name.json" --settle-s "${SETTLE_S:-0}" 2>&1 | tee -a "$OUT/table.txt"
}
if has serve1; then
    [ "${PREBUILT_ONLY:-0}" = 1 ] || serve serve-resnet50-empty kairos-plain resnet50
    [ "${EMPTY_ONLY:-0}" = 1 ] || serve serve-resnet50-prebuilt kairos resnet50
fi
if has serveall; then
    [ "${PREBUILT_ONLY:-0}" = 1 ] || serve serve-zoo-empty kairos-plain "$ZOO"
    [ "${EMPTY_ONLY:-0}" = 1 ] || serve serve-zoo-prebuilt kairos "$ZOO"
fi
if has library; then
    cache=$(fresh)
    t0=$(date +%s.%N)
    KAIROS_CACHE_DIR=$cache CUDA_CACHE_PATH=$(fresh) timeout 500 "$BIN/kairos-plain" kernels compile --arch 90 >"$OUT/library.log" 2>&1
    rc=$?
    printf 'library-from-scratch\trc %s\twall %s s\t%s\n' "$rc" "$(secs "$t0" "$(date +%s.%N)")" \
        "$(tail -1 "$OUT/library.log")" | tee -a "$OUT/table.txt"
    grep "compiled in" "$OUT/library.log" | sort -t'[' -k2 >"$OUT/library-units.txt"
fi
echo "== first run on $(tail -n +2 "$OUT/device.txt" | head -1)"
cat "$OUT/table.txt"

#!/usr/bin/env bash
# Where the corpus models' batch-1 time goes on a GPU, in one device call: the full tier of the
# ONNX exporter corpus (TorchScript exporter, opset 18) is generated for some architectures,
# each is profiled kernel by kernel (`kairos profile --dtype f16 --no-autotune`: every launch's duration, grid
# and kernel), and timed end to end (`kairos bench latency`, with and without autotuning) beside
# PyTorch fp16 eager and CUDA graph of the same modules. `scripts/onnx_kernel_table.py` then groups
# the launches by kernel and by op; a short table is printed last.
#
#   here:       the kairos binary gzipped in $CARRY/kairos.gz (scripts/carry-build.sh), and the GPU
#               test binary in $CARRY/gpu-tests.gz (`cargo test --release -p kairos-gputest --test
#               gpu --no-run`, stripped, gzipped) for the kernel check
#   on device:  OUT=$OUT scripts/onnx-kernel-times.sh
#
# Environment: CARRY (default .carry), OUT (default out/onnx-kernel-times), ONLY (a regular
# expression on architecture names), AUTOTUNE (default "0 1": latency without and with
# autotuning), TESTS (GPU tests run first, default kernels_match_cpu_reference), SKIP_TRANSFORMERS
# (non-empty: vision models only), AB_FUSE_ACTS (1: also the autotuned latency with
# KAIROS_FUSE_ACTS=0, activations other than ReLU as element-wise launches), AB_ENV (VAR=value
# words: also the autotuned latency with that environment, e.g. another kernel build), AB_LABEL
# (its column's name), PROFILE (default 1; 0 skips the per-model kernel profiles) and the parts of
# onnxruntime-gpu packed by scripts/ort-gpu-pack.sh: found as .carry-ort-X/ort.part or
# /tmp/ort-parts/X.part for X = a, b, ... (a part carried in an earlier call of the same warm
# machine and copied to /tmp/ort-parts), they are unpacked and scripts/ort_cuda_peer.py times
# onnxruntime's CUDA provider on the same exports (ort-latency.json, columns in the table).
set -uo pipefail
cd "$(dirname "$0")/.."
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} PYTHONUNBUFFERED=1
. scripts/cubin-carry.sh
CARRY=${CARRY:-.carry}
OUT=${OUT:-out/onnx-kernel-times}
ONLY=${ONLY:-^(vit|efficientnet_b0|convnext|regnet_y|resnext50|mobilenet_v3|swin|shufflenet_v2)$}
AUTOTUNE=${AUTOTUNE:-0 1}
mkdir -p "$OUT"
bin=/tmp/kairos-kt
gunzip -c "$CARRY/kairos.gz" >"$bin" && chmod +x "$bin" || { echo "no $CARRY/kairos.gz"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# The kernels against the CPU reference first, when the test binary is carried (TESTS="" skips).
TESTS=${TESTS-kernels_match_cpu_reference}
if [ -n "$TESTS" ] && [ -f "$CARRY/gpu-tests.gz" ]; then
    gunzip -c "$CARRY/gpu-tests.gz" >/tmp/kairos-kt-tests && chmod +x /tmp/kairos-kt-tests
    timeout 200 /tmp/kairos-kt-tests --test-threads 1 --include-ignored --nocapture $TESTS >"$OUT/tests.log" 2>&1
    echo "tests ($TESTS): rc $?, $(grep -E '^test result' "$OUT/tests.log" | tail -1)"
    grep -E "FAIL|panicked" "$OUT/tests.log" | head -20
fi
dir=/tmp/onnx-kt
rm -rf "$dir"
t0=$(date +%s)
shards=16
parts=()
for k in $(seq 0 $((shards - 1))); do
    parts+=("$dir/shard$k")
    python3 scripts/onnx_corpus.py --out "$dir/shard$k" --tier full --exporters ts --opsets 18 --only "$ONLY" \
        ${SKIP_TRANSFORMERS:+--skip-transformers} --shard "$k/$shards" >"$OUT/generate-$k.log" 2>&1 &
done
wait
python3 scripts/onnx_corpus.py --out "$dir" --merge "${parts[@]}" | tee "$OUT/generate.log"
echo "generated in $(($(date +%s) - t0)) s"
t=$(date +%s)
"$bin" check-onnx "$dir" --backend cuda --json "$OUT/check-cuda-f16.json" >"$OUT/check-cuda-f16.md" 2>"$OUT/check-cuda-f16.log"
echo "checked on the GPU in $(($(date +%s) - t)) s: $(tail -1 "$OUT/check-cuda-f16.md")"
python3 scripts/onnx_corpus.py --out "$dir" --latency "$OUT/torch-latency.json" >"$OUT/torch-latency.log" 2>&1
tail -n +1 "$OUT/torch-latency.log" | tail -12
files=$(python3 -c 'import json, os, sys
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
print(" ".join(os.path.join(d, e["file"]) for e in m["entries"] if e["status"] == "ok"))' "$dir")
[ "${PROFILE:-1}" = 0 ] && echo "profiles skipped (PROFILE=0)"
for f in $files; do
    [ "${PROFILE:-1}" = 0 ] && break
    arch=$(basename "$f" .onnx)
    t=$(date +%s)
    timeout 240 "$bin" profile "$f" --dtype f16 --seq-len 16 --no-autotune --repeats 5 -o "$OUT/profile-$arch.json" >"$OUT/profile-$arch.log" 2>&1
    echo "profiled $arch: rc $? in $(($(date +%s) - t)) s"
done
for at in $AUTOTUNE; do
    flag=--no-autotune
    [ "$at" = 1 ] && flag=
    models=$(echo $files | tr ' ' ',')
    t=$(date +%s)
    timeout 400 "$bin" bench latency --backend cuda --batch 1 --seq-len 16 $flag --requests 100 --budget-s 5 --models "$models" \
        --peer "$OUT/torch-latency.json" --out "$OUT/latency-autotune$at" >"$OUT/latency-autotune$at.log" 2>&1
    echo "latency (autotune $at): rc $? in $(($(date +%s) - t)) s"
done
if [ "${AB_FUSE_ACTS:-0}" = 1 ]; then
    # A/B: activations other than ReLU as element-wise launches instead of epilogues (autotuned).
    t=$(date +%s)
    KAIROS_FUSE_ACTS=0 timeout 400 "$bin" bench latency --backend cuda --batch 1 --seq-len 16 --requests 100 --budget-s 5 \
        --models "$models" --peer "$OUT/torch-latency.json" --out "$OUT/latency-unfused" >"$OUT/latency-unfused.log" 2>&1
    echo "latency (acts unfused): rc $? in $(($(date +%s) - t)) s"
fi
if [ -n "${AB_ENV:-}" ]; then
    # A/B: the autotuned latency again with extra environment (e.g. another kernel build:
    # KAIROS_NVRTC_OPTIONS=-DKAIROS_NO_WGMMA and a cache folder holding those images).
    t=$(date +%s)
    echo "${AB_LABEL:-A/B}" >"$OUT/ab-label.txt"
    env $AB_ENV timeout 400 "$bin" bench latency --backend cuda --batch 1 --seq-len 16 --requests 100 --budget-s 5 \
        --models "$models" --peer "$OUT/torch-latency.json" --out "$OUT/latency-ab" >"$OUT/latency-ab.log" 2>&1
    echo "latency (${AB_LABEL:-A/B}): rc $? in $(($(date +%s) - t)) s"
fi
# onnxruntime's CUDA provider on the same exports, when its packed parts are here.
ort_parts=()
for x in a b c d e f g h; do
    if [ -f ".carry-ort-$x/ort.part" ]; then ort_parts+=(".carry-ort-$x/ort.part")
    elif [ -f "/tmp/ort-parts/$x.part" ]; then ort_parts+=("/tmp/ort-parts/$x.part")
    else break; fi
done
if [ ${#ort_parts[@]} -gt 0 ]; then
    rm -rf /tmp/ort-gpu && mkdir -p /tmp/ort-gpu
    if cat "${ort_parts[@]}" | xz -d | tar -C /tmp/ort-gpu -xf -; then
        t=$(date +%s)
        PYTHONPATH=/tmp/ort-gpu${PYTHONPATH:+:$PYTHONPATH} timeout ${ORT_TIMEOUT_S:-300} python3 scripts/ort_cuda_peer.py "$dir" \
            --out "$OUT/ort-latency.json" >"$OUT/ort-latency.log" 2>&1
        echo "onnxruntime CUDA provider (${#ort_parts[@]} parts): rc $? in $(($(date +%s) - t)) s; $(tail -1 "$OUT/ort-latency.log")"
    else
        echo "onnxruntime parts ${ort_parts[*]} do not unpack (a part missing or from another pack)"
    fi
fi
python3 scripts/onnx_kernel_table.py "$OUT" --json "$OUT/table.json" | tee "$OUT/table.txt"
# Everything in one archive (the device tool brings back a few files only).
rm -f "$OUT"/generate-*.log
tar -C "$OUT" -czf /tmp/onnx-kt-records.tar.gz . && rm -rf "${OUT:?}"/* && mv /tmp/onnx-kt-records.tar.gz "$OUT/records.tar.gz"

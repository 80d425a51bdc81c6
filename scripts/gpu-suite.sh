#!/usr/bin/env bash
# kairos' GPU suite in one device call: every GPU test (kernels vs the CPU reference, zoo models vs
# the CPU reference and tract, partitions and SM masks, direct host access, preemption and
# resume, notification accounting), then the measurements (notification latency, protocol
# overhead, preemption latency) and `profile` of the zoo, with a short table printed last.
#
#   scripts/gpu-suite.sh build          here (no GPU): build and strip the binaries into .carry/
#   scripts/gpu-suite.sh smoke|full     on the device, with .carry/ carried: run them (the recovery tests
#                                       first, each in its own process: they reset the device's context)
#   scripts/gpu-suite.sh recovery       on the device: only the recovery tests (an illegal address, a ring
#                                       overflow and a hung launch while a model is served; the engine
#                                       answers every request and serves again)
#   scripts/gpu-suite.sh speed          on the device: the kernel tests, preemption and the zoo
#                                       models in KAIROS_ZOO_MODELS, then the kernel_speed example
#                                       (lowering's tiles vs autotuned) on SPEED_MODELS; with
#                                       PROFILE_ZOO=1 also the fp16 profiles of every zoo model
#                                       (data/profiles/<gpu>/ layout) into $OUT/profiles.tgz
#
# CARRY names the carry folder (default .carry), so engineers building side by side do not collide.
# Logs and JSON go to $OUT (the device tool's output folder; out/gpu-suite otherwise):
#   device.txt, tests.log, suite.log, measurements.json, profiles.json
# Environment: KAIROS_ZOO_MODELS (comma list) limits the zoo tests; SUITE_ARGS is passed to the
# measurement binary (e.g. "--dtypes f16 --profile-budget-s 120").
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
CARRY=${CARRY:-.carry}

if [ "$mode" = build ]; then
    set -e
    mkdir -p "$CARRY"
    test_bin() {
        cargo test --release -p kairos-gputest --test "$1" --no-run --message-format=json 2>/dev/null |
            python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
    }
    gpu_bin=$(test_bin gpu)
    recovery_bin=$(test_bin recovery)
    cold_bin=$(test_bin cold)
    cargo build --release -p kairos-gputest --example gpu_suite --example kernel_speed --example profile_zoo
    strip -o "$CARRY/kairos-cuda-gpu-tests" "$gpu_bin"
    strip -o "$CARRY/kairos-cuda-recovery-test" "$recovery_bin"
    strip -o "$CARRY/kairos-cuda-cold-test" "$cold_bin"
    strip -o "$CARRY/gpu_suite" target/release/examples/gpu_suite
    strip -o "$CARRY/kernel_speed" target/release/examples/kernel_speed
    strip -o "$CARRY/profile_zoo" target/release/examples/profile_zoo
    gzip -9f "$CARRY/kairos-cuda-gpu-tests" "$CARRY/kairos-cuda-recovery-test" "$CARRY/kairos-cuda-cold-test" "$CARRY/gpu_suite" "$CARRY/kernel_speed" "$CARRY/profile_zoo"
    ls -la "$CARRY"
    # Both builds of the kernel library as CUBIN for sm_90 (the tests also run the plain grids).
    cargo build --release -p kairos
    [ "${KEEP_CUBIN:-0}" = 1 ] || rm -rf .carry-cubin
    target/release/kairos kernels compile --cache-dir .carry-cubin --variants both && gzip -9f .carry-cubin/*.cubin ||
        echo "note: no CUBIN cache prepared; the device compiles the kernels"
    exit 0
fi

OUT=${OUT:-out/gpu-suite}
mkdir -p "$OUT"
BIN=/tmp/kairos-bin
mkdir -p "$BIN"
for f in kairos-cuda-gpu-tests kairos-cuda-recovery-test kairos-cuda-cold-test gpu_suite kernel_speed profile_zoo; do
    # The recovery mode needs only its own binary (a carry of just that one fits beside others).
    [ "$mode" = recovery ] && [ "$f" != kairos-cuda-recovery-test ] && continue
    gunzip -c "$CARRY/$f.gz" >"$BIN/$f" && chmod +x "$BIN/$f" || { echo "missing $CARRY/$f.gz: run scripts/gpu-suite.sh build first"; exit 1; }
done
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
# The CUBIN cache compiled ahead of time here, when carried (scripts/cubin-carry.sh).
. scripts/cubin-carry.sh
export RUST_BACKTRACE=1

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; nproc; } 2>&1 | tee "$OUT/device.txt"

# The recovery tests reset the device's primary context (an illegal address also leaves a sticky
# error for the life of the process): each in its own process, before the others, each bounded.
recovery_rc=0
if [ "$mode" != speed ]; then
    : > "$OUT/recovery.log"
    for t in $("$BIN/kairos-cuda-recovery-test" --list --ignored --format terse | sed -n 's/: test$//p'); do
        t0=$(date +%s.%N)
        timeout 300 "$BIN/kairos-cuda-recovery-test" --include-ignored --exact "$t" --nocapture 2>&1 | tee -a "$OUT/recovery.log"
        rc=${PIPESTATUS[0]}
        # The process's own end counts: one that leaves a kernel running must still exit at once.
        echo "recovery: process of $t ended after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s (rc $rc)" | tee -a "$OUT/recovery.log"
        [ "$rc" = 124 ] && echo "test $t ... FAILED (no verdict within 300 s)" | tee -a "$OUT/recovery.log"
        recovery_rc=$((recovery_rc | rc))
    done
    if [ "$mode" = recovery ]; then
        echo
        echo "== recovery test (rc $recovery_rc) =="
        grep -E "^recovery:|^test .* (ok|FAILED)$|panicked" "$OUT/recovery.log"
        exit $recovery_rc
    fi
fi

if [ "$mode" = speed ]; then
    export KAIROS_ZOO_MODELS=${KAIROS_ZOO_MODELS:-resnet50,mobilenet_v2,bert_base,gpt2}
    t0=$(date +%s)
    "$BIN/kairos-cuda-gpu-tests" --include-ignored --test-threads=1 --nocapture kernels_match_cpu_reference preempted_launches_resume_exactly \
        protocol_and_plain_builds_agree zoo_models_match 2>&1 | tee "$OUT/tests.log"
    tests_rc=${PIPESTATUS[0]}
    t1=$(date +%s)
    # shellcheck disable=SC2086
    "$BIN/kernel_speed" ${SPEED_ARGS:-} ${SPEED_MODELS:-resnet50 vgg19 bert_base} 2>&1 | tee "$OUT/speed.log"
    speed_rc=${PIPESTATUS[0]}
    t2=$(date +%s)
    prof_rc=0
    if [ "${PROFILE_ZOO:-0}" = 1 ]; then
        "$BIN/profile_zoo" /tmp/kairos-profiles --dtype f16 2>&1 | tee "$OUT/profiles.log"
        prof_rc=${PIPESTATUS[0]}
        tar -C /tmp/kairos-profiles -czf "$OUT/profiles.tgz" .
    fi
    t3=$(date +%s)
    echo
    echo "== tests (rc $tests_rc, $((t1 - t0)) s) =="
    grep -E "FAIL|^test .* (ok|FAILED)$|^test result" "$OUT/tests.log"
    echo "== kernel speed (rc $speed_rc, $((t2 - t1)) s) =="
    sed -n '/^== kernel speed/,$p' "$OUT/speed.log"
    [ "${PROFILE_ZOO:-0}" = 1 ] && { echo "== zoo profiles (rc $prof_rc, $((t3 - t2)) s) =="; cat "$OUT/profiles.log"; }
    exit $((tests_rc | speed_rc | prof_rc))
fi

if [ "$mode" = smoke ]; then
    export KAIROS_ZOO_MODELS=${KAIROS_ZOO_MODELS:-resnet18,distilbert}
    suite_args="--smoke ${SUITE_ARGS:-}"
else
    suite_args="${SUITE_ARGS:-}"
fi

t0=$(date +%s)
"$BIN/kairos-cuda-gpu-tests" --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
# Cold starts under a weight budget (crates/gputest/tests/cold.rs): answers of every strategy.
"$BIN/kairos-cuda-cold-test" --include-ignored --test-threads=1 --nocapture 2>&1 | tee -a "$OUT/tests.log"
tests_rc=$((tests_rc | PIPESTATUS[0]))
t1=$(date +%s)
# shellcheck disable=SC2086
"$BIN/gpu_suite" --out "$OUT" $suite_args 2>&1 | tee "$OUT/suite.log"
suite_rc=${PIPESTATUS[0]}
t2=$(date +%s)

echo
echo "== recovery test (rc $recovery_rc) =="
grep -E "^recovery:|^test .* (ok|FAILED)$" "$OUT/recovery.log"
echo "== tests (rc $tests_rc, $((t1 - t0)) s) =="
grep -E "^test .* (ok|FAILED)$|^test result" "$OUT/tests.log"
echo "== measurements and profiles (rc $suite_rc, $((t2 - t1)) s) =="
sed -n '/^== kairos GPU suite/,$p' "$OUT/suite.log"
exit $((recovery_rc | tests_rc | suite_rc))

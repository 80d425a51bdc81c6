#!/usr/bin/env bash
# Builds what a device call carries (shared by scripts/device-bench.sh and scripts/dispatch-bench.sh
# `build`): the release binary with the kernel library for sm_90 embedded (as
# scripts/build-release.sh builds it), stripped and gzipped, into .carry/kairos.gz, and the same
# binary without embedded kernels into .carry/kairos-plain.gz (for cold-start measurements). The
# images themselves stay in .carry-cubin/ (gzipped; the device scripts also copy them into the
# cache folder). Needs libnvrtc here (LD_LIBRARY_PATH at an NVRTC 13 lib folder); without it the
# embedded build is skipped with a note and the device compiles the kernels.
# KEEP_CUBIN=1 keeps .carry-cubin/ as it is (valid while the kernel sources are unchanged).
# FEATURES: cargo features of the binary (e.g. cpu-profile: KAIROS_CPU_PROFILE=PATH on the device).
set -euo pipefail
cd "$(dirname "$0")/.."
unset KAIROS_PREBUILT_KERNELS
cargo build --release -p kairos ${FEATURES:+--features $FEATURES}
mkdir -p .carry
strip -o .carry/kairos-plain target/release/kairos
gzip -9f .carry/kairos-plain
if [ "${KEEP_CUBIN:-0}" != 1 ]; then
    rm -rf .carry-cubin
    target/release/kairos kernels compile --cache-dir .carry-cubin --variants both --gzip ||
        { rm -rf .carry-cubin; echo "note: no CUBIN cache prepared; the device compiles the kernels (minutes)"; }
fi
if [ -d .carry-cubin ]; then
    KAIROS_PREBUILT_KERNELS="$PWD/.carry-cubin" cargo build --release -p kairos ${FEATURES:+--features $FEATURES}
fi
strip -o .carry/kairos target/release/kairos
gzip -9f .carry/kairos
du -sh .carry/* .carry-cubin 2>/dev/null || true

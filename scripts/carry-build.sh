#!/usr/bin/env bash
# Builds what a device call carries (shared by scripts/device-bench.sh and scripts/dispatch-bench.sh
# `build`): the release binary, stripped and gzipped, into .carry/kairos.gz, and the kernel library
# as CUBIN for sm_90 into .carry-cubin/ so the device does not spend minutes compiling it (needs
# libnvrtc here: LD_LIBRARY_PATH at an NVRTC 13 lib folder; skipped with a note otherwise).
# KEEP_CUBIN=1 keeps .carry-cubin/ as it is (valid while the kernel sources are unchanged).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p kairos
mkdir -p .carry
strip -o .carry/kairos target/release/kairos
gzip -9f .carry/kairos
if [ "${KEEP_CUBIN:-0}" != 1 ]; then
    rm -rf .carry-cubin
    target/release/kairos kernels compile --cache-dir .carry-cubin && gzip -9f .carry-cubin/*.cubin ||
        echo "note: no CUBIN cache prepared; the device compiles the kernels (minutes)"
fi
du -sh .carry .carry-cubin 2>/dev/null || true

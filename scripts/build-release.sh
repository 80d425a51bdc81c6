#!/usr/bin/env bash
# Builds target/release/kairos with the kernel library embedded for the GPU architectures users
# run, so a fresh GPU machine serves without compiling a kernel:
#   1. cargo build --release (the binary that compiles),
#   2. `kairos kernels compile --arch $KAIROS_ARCHS --variants both --gzip` into
#      target/prebuilt-kernels (NVRTC on the CPU, no GPU needed; every core): the protocol build
#      every launch uses and the plain build that recorded runs (CUDA graphs of whole jobs) replay,
#   3. cargo build --release again with KAIROS_PREBUILT_KERNELS=target/prebuilt-kernels (only the
#      kairos crate relinks; crates/kairos/build.rs embeds the images).
# NVRTC: the CUDA toolkit's libnvrtc, or the pip wheel nvidia-cuda-nvrtc (installed into
# target/nvrtc when libnvrtc cannot be loaded). KAIROS_ARCHS: comma-separated compute capabilities
# (default 90: H100/H200, the only one tested). Re-running after a kernel change recompiles only the changed units.
set -euo pipefail
cd "$(dirname "$0")/.."
archs="${KAIROS_ARCHS:-90}"
out="$PWD/target/prebuilt-kernels"
cargo build --release -p kairos
if ! target/release/kairos kernels status --arch 90 --cache-dir "$out" 2>/dev/null | grep -q "NVRTC [0-9]"; then
    if [ ! -e target/nvrtc/nvidia/cu13/lib/libnvrtc.so ]; then
        echo "libnvrtc not found: installing the nvidia-cuda-nvrtc wheel into target/nvrtc" >&2
        python3 -m pip install --quiet --no-deps --target target/nvrtc "nvidia-cuda-nvrtc==13.0.*"
        ln -sf libnvrtc.so.13 target/nvrtc/nvidia/cu13/lib/libnvrtc.so
    fi
    export LD_LIBRARY_PATH="$PWD/target/nvrtc/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}"
fi
mkdir -p "$out"
target/release/kairos kernels compile --arch "$archs" --cache-dir "$out" --variants both --gzip
KAIROS_PREBUILT_KERNELS="$out" cargo build --release -p kairos
target/release/kairos kernels status --arch "${archs%%,*}" --cache-dir /nonexistent | head -1

#!/usr/bin/env bash
# Packs onnxruntime-gpu (the CUDA execution provider, the corpus' named peer) for the GPU machine,
# which has no network and takes at most 64 MiB per call. The wheel is 256 MB; its CUDA provider
# library carries GPU code for sm_75 to sm_120, of which an H100/H200 runs only the sm_90 images.
# This script downloads the wheel from the package registry, zeroes the payloads of the other
# architectures' images in the provider's fatbin (scripts/fatbin_keep_arch.py: headers, sizes and
# offsets unchanged, the sm_90 images byte for byte as shipped), leaves out the C API library the
# Python module does not load, compresses the package folder (xz) and splits it into parts that
# travel in separate device calls (each part carried as its own ignored folder; the machine keeps
# them while it stays warm). On the device, `cat` the parts in order into `xz -d | tar -x`
# (scripts/onnx-kernel-times.sh does, with ORT_PARTS).
#
#   scripts/ort-gpu-pack.sh [OUT_PREFIX]     default .carry-ort; writes OUT_PREFIX-a/ort.part, -b/ort.part, ...
#
# Environment: ORT_VERSION (default 1.31.1, a CUDA 13 build), ORT_PYTHON (the device's Python,
# default 312), PART_MB (default 48), KEEP_ARCH (default 90).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-.carry-ort}
version=${ORT_VERSION:-1.31.1}
py=${ORT_PYTHON:-312}
part_mb=${PART_MB:-48}
work=$(mktemp -d /tmp/ort-pack.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "downloading onnxruntime-gpu $version (cp$py) ..."
pip download -q --no-deps "onnxruntime-gpu==$version" --python-version "$py" --only-binary=:all: \
    --platform manylinux_2_28_x86_64 -d "$work"
mkdir "$work/pkg"
(cd "$work/pkg" && unzip -q "$work"/onnxruntime_gpu-*.whl)
capi="$work/pkg/onnxruntime/capi"
python3 scripts/fatbin_keep_arch.py "$capi/libonnxruntime_providers_cuda.so" "${KEEP_ARCH:-90}"
rm -f "$capi"/libonnxruntime.so.* "$capi/libonnxruntime_providers_tensorrt.so"
echo "compressing ..."
# The provider library first: the first parts hold only it, whatever the Python version.
(cd "$work/pkg" && tar --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - onnxruntime/capi/libonnxruntime_providers_cuda.so \
    --exclude onnxruntime/capi/libonnxruntime_providers_cuda.so onnxruntime) | xz -T2 -6 >"$work/ort.tar.xz"
rm -rf "$prefix"-?
split -b "${part_mb}M" -a 1 "$work/ort.tar.xz" "$work/ort.part."
for f in "$work"/ort.part.*; do
    d="$prefix-${f##*.}"
    mkdir -p "$d" && mv "$f" "$d/ort.part"
    echo "$d/ort.part: $(du -m "$d/ort.part" | cut -f1) MB"
done
echo "onnxruntime-gpu $version cp$py packed in $(ls -d "$prefix"-? | wc -l) parts (total $(du -m "$work/ort.tar.xz" | cut -f1) MB)"

#!/usr/bin/env bash
# A standalone probe of Hopper's warpgroup MMA (wgmma) outside kairos' kernel protocol, on the
# device (needs nvcc and PyTorch): checks the no-swizzle K-major shared-memory layouts and matrix
# descriptors tc_tile_wgmma64 (crates/kernels/cuda/tile.cuh) relies on against a naive kernel,
# splits a tile's time into loads and multiplications (MODES: no loads, no MMA, no fences, ...),
# and times tiles of 64..128 x 64..256 on the products of ViT-B/16 and BERT beside cuBLAS (torch.mm
# replayed in a CUDA graph). Results of 2026-11-29 (H200) in docs/models.md.
#   on the device:  bash scripts/wgmma_probe/run.sh        (MODES_ONLY=1: checks and modes only)
set -euo pipefail
cd "$(dirname "$0")"
python3 gen.py /tmp/wgmma_probe.cu
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_probe /tmp/wgmma_probe.cu
/tmp/wgmma_probe
[ -n "${MODES_ONLY:-}" ] || python3 torch_mm.py

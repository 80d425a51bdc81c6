// The shared-memory tile engine of the convolution and matrix-product kernels (SIMT, f32 accumulate).
//
// One logical block computes a tile of up to TILE_MAX x TILE_MAX outputs of C = A B. K is walked in
// steps of TILE_K: the CTA stages A[tm][TILE_K] and B[TILE_K][tn] in shared memory as f32 (fp16 is
// converted on load), then every thread accumulates 4x4 micro-tiles from it. A thread owns up to
// MICRO_PER_THREAD micro-tiles; a tile with more micro-tiles than that is computed in passes, so
// any tile size up to TILE_MAX and any CTA size are correct (the plan's choice only moves speed).
//
// A loader supplies the operands and consumes the results:
//   float a(u32 mm, u32 k)      A at tile row mm (0 <= mm < tm), column k < K
//   float b(u32 k, u32 nn)      B at row k < K, tile column nn (0 <= nn < tn)
//   bool a_k_fastest, b_k_fastest   which index is contiguous in memory (load order for coalescing)
//   void store(u32 mm, u32 nn, float acc)

#pragma once
#include "kairos/common.cuh"

#define TILE_MAX 128u
#define TILE_K 16u
#define TILE_STRIDE (TILE_MAX + 4u)
#define MICRO_PER_THREAD 4u

struct TileSmem {
    float a[TILE_K][TILE_STRIDE];
    float b[TILE_K][TILE_STRIDE];
};

template <typename L>
__device__ __forceinline__ void tile_gemm(L& ld_, TileSmem& sm, u32 tm, u32 tn, u32 K) {
    const u32 T = blockDim.x;
    const u32 tid = threadIdx.x;
    const u32 mcols = (tn + 3u) / 4u;
    const u32 U = ((tm + 3u) / 4u) * mcols;
    for (u32 pass = 0; pass < U; pass += T * MICRO_PER_THREAD) {
        float acc[MICRO_PER_THREAD][4][4];
#pragma unroll
        for (u32 j = 0; j < MICRO_PER_THREAD; ++j)
#pragma unroll
            for (u32 x = 0; x < 4; ++x)
#pragma unroll
                for (u32 y = 0; y < 4; ++y) acc[j][x][y] = 0.0f;
        for (u32 k0 = 0; k0 < K; k0 += TILE_K) {
            const u32 kn = min(TILE_K, K - k0);
            for (u32 i = tid; i < tm * TILE_K; i += T) {
                u32 kk, mm;
                if (ld_.a_k_fastest) {
                    kk = i % TILE_K;
                    mm = i / TILE_K;
                } else {
                    mm = i % tm;
                    kk = i / tm;
                }
                sm.a[kk][mm] = kk < kn ? ld_.a(mm, k0 + kk) : 0.0f;
            }
            for (u32 i = tid; i < tn * TILE_K; i += T) {
                u32 kk, nn;
                if (ld_.b_k_fastest) {
                    kk = i % TILE_K;
                    nn = i / TILE_K;
                } else {
                    nn = i % tn;
                    kk = i / tn;
                }
                sm.b[kk][nn] = kk < kn ? ld_.b(k0 + kk, nn) : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (u32 j = 0; j < MICRO_PER_THREAD; ++j) {
                const u32 u = pass + tid + j * T;
                if (u < U) {
                    const u32 r = (u / mcols) * 4u;
                    const u32 c = (u % mcols) * 4u;
#pragma unroll 4
                    for (u32 kk = 0; kk < TILE_K; ++kk) {
                        const float4 av = *(const float4*)&sm.a[kk][r];
                        const float4 bv = *(const float4*)&sm.b[kk][c];
                        const float a4[4] = {av.x, av.y, av.z, av.w};
                        const float b4[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
                        for (u32 x = 0; x < 4; ++x)
#pragma unroll
                            for (u32 y = 0; y < 4; ++y) acc[j][x][y] = fmaf(a4[x], b4[y], acc[j][x][y]);
                    }
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (u32 j = 0; j < MICRO_PER_THREAD; ++j) {
            const u32 u = pass + tid + j * T;
            if (u < U) {
                const u32 r = (u / mcols) * 4u;
                const u32 c = (u % mcols) * 4u;
#pragma unroll
                for (u32 x = 0; x < 4; ++x)
#pragma unroll
                    for (u32 y = 0; y < 4; ++y)
                        if (r + x < tm && c + y < tn) ld_.store(r + x, c + y, acc[j][x][y]);
            }
        }
    }
}

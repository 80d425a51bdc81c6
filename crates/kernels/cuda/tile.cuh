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

// ---------------------------------------------------------------------------------------------
// The tensor-core tile engine (fp16 operands, f32 accumulate): mma.sync m16n8k16 through inline
// PTX, operands staged in shared memory as fp16 and read with ldmatrix, two stages filled with
// cp.async while the other is multiplied. Like the SIMT engine it computes any tile up to
// TILE_MAX x TILE_MAX with any CTA size (whole warps); the plan's choice only moves speed.
//
// Per logical block, with tm x tn the (clipped) tile rounded up to tmp x tnp (multiples of 16):
// - K is walked in stages of tk (32, 64 or 128: the largest whose two stages fit TC_SMEM_BYTES,
//   capped near K). A stage holds A as [tmp][tk] and B as [tnp][tk] (K contiguous, padded rows
//   so ldmatrix is free of bank conflicts), or B as [tk][tnp] when B's contiguous index is n
//   (read with ldmatrix.trans).
// - Warps own warp tiles of up to 4 x 4 mma fragments (64 x 32 outputs, 64 f32 accumulators
//   per thread). Tiles larger than 32 x 32 are halved while there are warps to spare; warps left
//   over then split each stage's k16 steps among them (ksplit, a power of two) and their sums are
//   added in shared memory in a fixed order, so results do not depend on timing. A tile needing
//   more warp tiles than the CTA has warps is computed in passes.
//
// The loader supplies the operands as fp16 bits and consumes f32 results:
//   h16 ah(u32 mm, u32 k), h16 bh(u32 k, u32 nn)    scalar element (in range)
//   const h16* a_ptr(u32 mm, u32 k)   8 halves at (mm, k..k+8), 16-byte aligned, or null (zeros);
//                                     used when a_vec (k is a multiple of 8, K % 8 == 0)
//   const h16* b_ptr(u32 k, u32 nn)   likewise 8 halves along k (b_kn false) or along n (b_kn true)
//   bool a_vec, b_vec, b_kn, a_k_fastest, b_k_fastest
//   void store(u32 mm, u32 nn, float acc)

// Whether a storage type is fp16 (which engine a kernel instantiates).
template <typename T>
struct IsHalf {
    static constexpr bool value = false;
};
template <>
struct IsHalf<h16> {
    static constexpr bool value = true;
};

#define TC_SMEM_BYTES 40960u
#define TC_STAGE_HALVES (TC_SMEM_BYTES / 4u)  // two stages of fp16

struct TcSmem {
    alignas(16) h16 buf[TC_SMEM_BYTES / 2u];
};

__device__ __forceinline__ u32 tc_smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// 16 bytes global -> shared without registers (cp.async, completed by tc_cp_wait_*), or 16 zero
// bytes stored directly when `src` is null (padding, rows past the tile).
__device__ __forceinline__ void tc_put16(h16* dst, const h16* src) {
    if (src) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(tc_smem_addr(dst)), "l"(src) : "memory");
    } else {
        float4 z;
        z.x = z.y = z.z = z.w = 0.0f;
        *(float4*)dst = z;
    }
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void tc_cp_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void tc_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void tc_ldmatrix_x4(u32 (&r)[4], const h16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(p))
                 : "memory");
}
__device__ __forceinline__ void tc_ldmatrix_x4_trans(u32 (&r)[4], const h16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(p))
                 : "memory");
}

// d += a b for one m16n8k16 fragment (A row-major, B column-major, f32 accumulate).
__device__ __forceinline__ void tc_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The engine's decomposition of one tile (the same in every thread of the CTA).
struct TcShape {
    u32 tmp, tnp, tk, lda, ldb;  // padded tile, stage depth, shared-memory row strides (halves)
    u32 a_halves;                // A's part of a stage
    u32 wtm, wtn;                // warp tile in fragments (m16, n8)
    u32 wgn;                     // warp tiles along n
    u32 wt;                      // warp tiles
    u32 ksplit;                  // warps per warp tile (splitting the k16 steps)
    u32 passes;
};

__device__ __forceinline__ TcShape tc_shape(u32 tm, u32 tn, u32 K, u32 warps, bool b_kn) {
    TcShape s;
    s.tmp = (tm + 15u) & ~15u;
    s.tnp = (tn + 15u) & ~15u;
    s.tk = 32u;
    for (u32 tk = 128u; tk > 32u; tk >>= 1) {
        const u32 a = s.tmp * (tk + 8u);
        const u32 b = b_kn ? tk * (s.tnp + 8u) : s.tnp * (tk + 8u);
        if (a + b <= TC_STAGE_HALVES && tk / 2u < K) {
            s.tk = tk;
            break;
        }
    }
    s.lda = s.tk + 8u;
    s.ldb = b_kn ? s.tnp + 8u : s.tk + 8u;
    s.a_halves = s.tmp * s.lda;
    const u32 fm = s.tmp / 16u, fn = s.tnp / 8u;
    s.wtm = min(4u, fm);
    s.wtn = min(4u, fn);
    u32 wgm = (fm + s.wtm - 1u) / s.wtm;
    s.wgn = (fn + s.wtn - 1u) / s.wtn;
    while (wgm * s.wgn * 2u <= warps && s.wtm > 2u) {
        s.wtm /= 2u;
        wgm = (fm + s.wtm - 1u) / s.wtm;
    }
    s.wt = wgm * s.wgn;
    s.ksplit = 1u;
    if (s.wt < warps) {
        const u32 q = min(warps / s.wt, s.tk / 16u);
        while (s.ksplit * 2u <= q) s.ksplit *= 2u;
    }
    s.passes = s.ksplit > 1u ? 1u : (s.wt + warps - 1u) / warps;
    return s;
}

// Fills one stage: A[tmp][tk] and B (either layout) for k in [k0, k0 + tk); zeros outside.
template <typename L>
__device__ __forceinline__ void tc_load_stage(const L& ld_, const TcShape& s, h16* As, h16* Bs, u32 tm, u32 tn, u32 K, u32 k0) {
    const u32 T = blockDim.x;
    const u32 tid = threadIdx.x;
    const u32 kc = s.tk / 8u;  // 8-half chunks per row
    const u32 ks = kc == 4u ? 2u : kc == 8u ? 3u : 4u;
    if (ld_.a_vec) {
        for (u32 i = tid; i < s.tmp * kc; i += T) {
            const u32 mm = i >> ks;
            const u32 k = k0 + (i & (kc - 1u)) * 8u;
            const h16* src = (mm < tm && k < K) ? ld_.a_ptr(mm, k) : (const h16*)0;
            tc_put16(As + mm * s.lda + (k - k0), src);
        }
    } else if (ld_.a_k_fastest) {
        for (u32 i = tid; i < s.tmp * s.tk; i += T) {
            const u32 mm = i / s.tk;
            const u32 kk = i % s.tk;
            As[mm * s.lda + kk] = (mm < tm && k0 + kk < K) ? ld_.ah(mm, k0 + kk) : (h16)0;
        }
    } else {
        for (u32 i = tid; i < s.tmp * s.tk; i += T) {
            const u32 mm = i % s.tmp;
            const u32 kk = i / s.tmp;
            As[mm * s.lda + kk] = (mm < tm && k0 + kk < K) ? ld_.ah(mm, k0 + kk) : (h16)0;
        }
    }
    if (!ld_.b_kn) {
        if (ld_.b_vec) {
            for (u32 i = tid; i < s.tnp * kc; i += T) {
                const u32 nn = i >> ks;
                const u32 k = k0 + (i & (kc - 1u)) * 8u;
                const h16* src = (nn < tn && k < K) ? ld_.b_ptr(k, nn) : (const h16*)0;
                tc_put16(Bs + nn * s.ldb + (k - k0), src);
            }
        } else if (ld_.b_k_fastest) {
            for (u32 i = tid; i < s.tnp * s.tk; i += T) {
                const u32 nn = i / s.tk;
                const u32 kk = i % s.tk;
                Bs[nn * s.ldb + kk] = (nn < tn && k0 + kk < K) ? ld_.bh(k0 + kk, nn) : (h16)0;
            }
        } else {
            for (u32 i = tid; i < s.tnp * s.tk; i += T) {
                const u32 nn = i % s.tnp;
                const u32 kk = i / s.tnp;
                Bs[nn * s.ldb + kk] = (nn < tn && k0 + kk < K) ? ld_.bh(k0 + kk, nn) : (h16)0;
            }
        }
    } else {
        const u32 nc = s.tnp / 8u;
        for (u32 i = tid; i < s.tk * nc; i += T) {
            const u32 kk = i / nc;
            const u32 nn = (i % nc) * 8u;
            h16* dst = Bs + kk * s.ldb + nn;
            const bool krow = k0 + kk < K;
            if (ld_.b_vec && krow && nn + 8u <= tn) {
                tc_put16(dst, ld_.b_ptr(k0 + kk, nn));
            } else {
#pragma unroll
                for (u32 j = 0; j < 8u; ++j) dst[j] = (krow && nn + j < tn) ? ld_.bh(k0 + kk, nn + j) : (h16)0;
            }
        }
    }
}

template <typename L>
__device__ __forceinline__ void tile_mma(L& ld_, TcSmem& sm, u32 tm, u32 tn, u32 K) {
    const u32 warps = blockDim.x / 32u;
    const u32 warp = threadIdx.x / 32u;
    const u32 lane = threadIdx.x % 32u;
    const TcShape s = tc_shape(tm, tn, K, warps, ld_.b_kn);
    const u32 stages = (K + s.tk - 1u) / s.tk;
    const u32 fm = s.tmp / 16u, fn = s.tnp / 8u;
    const u32 ksteps = s.tk / 16u;
    for (u32 pass = 0; pass < s.passes; ++pass) {
        // This warp's role: warp tile `t` (row-major over the warp-tile grid), k16 slice `slice`.
        const u32 t = s.ksplit > 1u ? warp % s.wt : pass * warps + warp;
        const u32 slice = s.ksplit > 1u ? warp / s.wt : 0u;
        const bool active = s.ksplit > 1u ? warp < s.wt * s.ksplit : t < s.wt;
        const u32 fm0 = (t / s.wgn) * s.wtm;
        const u32 fn0 = (t % s.wgn) * s.wtn;
        const u32 mi_n = active ? min(s.wtm, fm > fm0 ? fm - fm0 : 0u) : 0u;
        const u32 nj_n = active ? min(s.wtn, fn > fn0 ? fn - fn0 : 0u) : 0u;
        float acc[4][4][4];
#pragma unroll
        for (u32 i = 0; i < 4u; ++i)
#pragma unroll
            for (u32 j = 0; j < 4u; ++j)
#pragma unroll
                for (u32 r = 0; r < 4u; ++r) acc[i][j][r] = 0.0f;

        tc_load_stage(ld_, s, sm.buf, sm.buf + s.a_halves, tm, tn, K, 0u);
        tc_cp_commit();
        for (u32 st = 0; st < stages; ++st) {
            h16* cur = sm.buf + (st & 1u) * TC_STAGE_HALVES;
            if (st + 1u < stages) {
                h16* nxt = sm.buf + ((st + 1u) & 1u) * TC_STAGE_HALVES;
                tc_load_stage(ld_, s, nxt, nxt + s.a_halves, tm, tn, K, (st + 1u) * s.tk);
            }
            tc_cp_commit();
            tc_cp_wait_one();
            __syncthreads();
            const h16* As = cur;
            const h16* Bs = cur + s.a_halves;
            const u32 kvalid = K - st * s.tk;  // > 0
            for (u32 kk = slice; kk < ksteps && kk * 16u < kvalid; kk += s.ksplit) {
                u32 bf[4][2];
#pragma unroll
                for (u32 j = 0; j < 4u; j += 2u) {
                    if (j < nj_n) {
                        u32 r[4];
                        const u32 n0 = (fn0 + j) * 8u;
                        if (!ld_.b_kn) {
                            tc_ldmatrix_x4(r, Bs + (n0 + (lane & 7u) + ((lane >> 4) << 3)) * s.ldb + kk * 16u +
                                                  ((lane >> 3) & 1u) * 8u);
                        } else {
                            tc_ldmatrix_x4_trans(r, Bs + (kk * 16u + (lane & 7u) + ((lane >> 3) & 1u) * 8u) * s.ldb + n0 +
                                                        (lane >> 4) * 8u);
                        }
                        bf[j][0] = r[0];
                        bf[j][1] = r[1];
                        bf[j + 1u][0] = r[2];
                        bf[j + 1u][1] = r[3];
                    }
                }
#pragma unroll
                for (u32 i = 0; i < 4u; ++i) {
                    if (i < mi_n) {
                        u32 af[4];
                        tc_ldmatrix_x4(af, As + ((fm0 + i) * 16u + (lane & 15u)) * s.lda + kk * 16u + (lane >> 4) * 8u);
#pragma unroll
                        for (u32 j = 0; j < 4u; ++j)
                            if (j < nj_n) tc_mma(acc[i][j], af, bf[j][0], bf[j][1]);
                    }
                }
            }
            __syncthreads();
        }
        tc_cp_wait_all();

        // Warps of slices > 0 hand their sums to slice 0 through shared memory, in rounds of as
        // many slices as fit, always added in slice order.
        if (s.ksplit > 1u) {
            float* red = (float*)sm.buf;
            const u32 per_tile = s.wtm * s.wtn * 128u;  // floats: fragments x 4 x 32 lanes
            const u32 per_slice = s.wt * per_tile;
            const u32 fit = max(1u, (TC_SMEM_BYTES / 4u) / per_slice);
            for (u32 s0 = 1u; s0 < s.ksplit; s0 += fit) {
                const u32 s1 = min(s.ksplit, s0 + fit);
                if (active && slice >= s0 && slice < s1) {
                    float* dst = red + (slice - s0) * per_slice + t * per_tile;
#pragma unroll
                    for (u32 i = 0; i < 4u; ++i)
#pragma unroll
                        for (u32 j = 0; j < 4u; ++j)
                            if (i < mi_n && j < nj_n)
#pragma unroll
                                for (u32 r = 0; r < 4u; ++r) dst[((i * s.wtn + j) * 4u + r) * 32u + lane] = acc[i][j][r];
                }
                __syncthreads();
                if (active && slice == 0u) {
                    for (u32 q = s0; q < s1; ++q) {
                        const float* src = red + (q - s0) * per_slice + t * per_tile;
#pragma unroll
                        for (u32 i = 0; i < 4u; ++i)
#pragma unroll
                            for (u32 j = 0; j < 4u; ++j)
                                if (i < mi_n && j < nj_n)
#pragma unroll
                                    for (u32 r = 0; r < 4u; ++r) acc[i][j][r] += src[((i * s.wtn + j) * 4u + r) * 32u + lane];
                    }
                }
                __syncthreads();
            }
        }

        if (active && slice == 0u) {
#pragma unroll
            for (u32 i = 0; i < 4u; ++i)
#pragma unroll
                for (u32 j = 0; j < 4u; ++j)
                    if (i < mi_n && j < nj_n) {
                        const u32 r0 = (fm0 + i) * 16u + (lane >> 2);
                        const u32 c0 = (fn0 + j) * 8u + (lane & 3u) * 2u;
#pragma unroll
                        for (u32 r = 0; r < 4u; ++r) {
                            const u32 mm = r0 + (r >> 1) * 8u;
                            const u32 nn = c0 + (r & 1u);
                            if (mm < tm && nn < tn) ld_.store(mm, nn, acc[i][j][r]);
                        }
                    }
        }
        __syncthreads();
    }
}

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

// 16-byte aligned: the inner loop reads it as float4. A shared variable is otherwise only aligned
// to its type (4 bytes here); the optimized build happened to place it at a multiple of 16, a build
// with --Ofast-compile did not (CUDA_ERROR_MISALIGNED_ADDRESS on an H100).
struct __align__(16) TileSmem {
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
// PTX, operands staged in shared memory as fp16 and read with ldmatrix, a pipeline of stages
// filled with cp.async while earlier ones are multiplied. Like the SIMT engine it computes any
// tile up to TILE_MAX x TILE_MAX with any CTA size (whole warps); the plan's choice only moves speed.
// Products tiled by at most GV_ROWS_MAX (8) rows whose B has k contiguous take the small-M path
// below (tile_gemv, the `_gv` and `_sk_gv` entries) instead: same loader, same results up to f32
// summation order. Elsewhere an edge tile of a few rows stays on this engine.
//
// Shared memory is the launch's dynamic shared memory (at least TC_SMEM_MIN_BYTES; the host
// passes the plan's LaunchShape::shared_mem_bytes, raised to that minimum). Per logical block,
// with tm x tn the (clipped) tile rounded up to tmp x tnp (multiples of 16):
// - K is walked in stages of tk (32, 64, 128 or 256, capped near K): the largest that leaves room for
//   four stages, else three, else two. A stage holds A as [tmp][tk] and B as [tnp][tk] (K contiguous,
//   rows padded by 16 bytes so ldmatrix is free of bank conflicts), or B as [tk][tnp] when B's
//   contiguous index is n (read with ldmatrix.trans). As many stages as fit (up to
//   TC_STAGES_MAX) form the pipeline: all but one are in flight while one is multiplied.
// - Warps own warp tiles of up to 8 mma fragments (4 x 2 or 2 x 4: 64 x 16 or 32 x 32 outputs, 32
//   f32 accumulators per thread; 4 in the narrow entries). 4 x 4 warp tiles (64 accumulators) no
//   longer exist: in the 128-register entries they spilled in the hot loop (ncu on an H200: 1.7 M
//   local-memory requests in one batch-8 BERT-base product; without them ptxas' spill loads in
//   gemm_f16 went from 3.3 KB to 1.5 KB and the batch-8 zoo from 1.97x to 1.89x CUDA graph).
//   Tiles larger than 32 x 32 are halved while there are warps to spare; warps left
//   over then split each stage's k16 steps among them (ksplit, a power of two) and their sums are
//   added in shared memory in a fixed order, so results do not depend on timing. A tile needing
//   more warp tiles than the CTA has warps is computed in passes.
// - The hot loop (one k16 step: ldmatrix of the warp tile's fragments, then its mma.sync) keeps
//   only 32-bit shared-memory addresses (a base per operand, a step per fragment; no 64-bit
//   generic pointers), reads every fragment of the warp tile whatever the tile's edge (past the
//   edge it re-reads the last one and never stores those products: per-fragment predicates cost
//   more than the wasted mma), and in the 168-register entries reads the next step's fragments
//   while this step's products run. On sm_90 this took a 4 x 4 warp tile's step from 176 SASS
//   instructions to 48 (16 of them mma) and a 2 x 2 one from 73 to about 20 per 4 mma.
//
// The loader supplies the operands as fp16 bits and consumes f32 results:
//   h16 ah(u32 mm, u32 k), h16 bh(u32 k, u32 nn)    scalar element (in range)
//   auto a_col(u32 k)                 what A's address needs of k alone (k a multiple of 8 below K)
//   const h16* a_ptr(u32 mm, col)     8 halves at (mm, k..k+8), 16-byte aligned, or null (zeros);
//                                     used when a_vec (K % 8 == 0)
//   const h16* b_ptr(u32 k, u32 nn)   likewise 8 halves along k (b_kn false) or along n (b_kn true)
//   bool a_vec, b_vec, b_kn, a_k_fastest, b_k_fastest
//   void store(u32 mm, u32 nn, float acc)
// and for the fast loads (tc_fast_*; used when a_vec, b_vec and fast_ok):
//   bool fast_ok                      every offset below fits 32 bits
//   void a_row(u32 mm, u32& off, u32& aux)   row mm's offset (and loader data) for a_src
//   ACol a_col_at(u32 k), void a_col_step(ACol&, u32 dk)   A's column state at k, moved by dk
//   const h16* a_src(u32 off, u32 aux, const ACol&)        8 halves of A, or null (padding); called
//                                     for rows past the tile too (off TC_NO_ROW), result unused
//   A_SRC_NONNULL                     (static constexpr bool) a_src never returns null
//   const h16* b_base(), u32 b_row(u32 nn), u64 b_kstride()
//                                     B at (k, nn) is b_base() + b_row(nn) + k * b_kstride()

#define TC_SMEM_MIN_BYTES 40960u  // two stages of the largest tile at tk = 32
// Deepest stage: fewer, deeper stages shorten the chain of dependent waits a block walks along K
// (what bounds the small tiles of products with long K, e.g. BERT's 128 x 768 x 3072).
#define TC_TK_MAX 256u
#define TC_STAGES_MAX 8u

extern __shared__ float4 kairos_dyn_smem[];  // float4: 16-byte aligned

__device__ __forceinline__ u32 tc_dyn_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Whether a storage type is fp16 (which engine a kernel instantiates).
template <typename T>
struct IsHalf {
    static constexpr bool value = false;
};
template <>
struct IsHalf<h16> {
    static constexpr bool value = true;
};

__device__ __forceinline__ u32 tc_smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// 16 bytes global -> shared without registers (cp.async, completed by tc_cp_wait_*) when `valid`,
// else 16 zero bytes: the same copy with a source size of 0, which reads nothing (src may be any
// address) and fills zeros, so there is no branch per chunk. `dst` is a shared-memory address (32
// bits: what the hot loops keep in registers instead of generic 64-bit pointers).
__device__ __forceinline__ void tc_put16_if(u32 dst, const h16* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16u : 0u) : "memory");
}
// The same with null `src` for padding.
__device__ __forceinline__ void tc_put16_at(u32 dst, const h16* src) { tc_put16_if(dst, src, src != nullptr); }
__device__ __forceinline__ void tc_put16(h16* dst, const h16* src) { tc_put16_at(tc_smem_addr(dst), src); }
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void tc_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most `n` (< TC_STAGES_MAX) of this thread's newest groups are still in flight.
__device__ __forceinline__ void tc_cp_wait(u32 n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    }
}

// ldmatrix at a shared-memory address: four 8x8 b16 matrices, or (B) transposed when `trans`
// (uniform across the warp; one of the two predicated instructions runs, no branch).
__device__ __forceinline__ void tc_ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void tc_ldsm_x4_b(u32 (&r)[4], u32 addr, bool trans) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " @p ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        " @!p ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr), "r"((u32)trans)
        : "memory");
}

// d += a b for one m16n8k16 fragment (A row-major, B column-major, f32 accumulate). Registers
// only, so not volatile: the compiler may interleave it with the shared-memory loads around it.
__device__ __forceinline__ void tc_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The engine's decomposition of one tile (the same in every thread of the CTA).
struct TcShape {
    u32 tmp, tnp, tk, lda, ldb;  // padded tile, stage depth, shared-memory row strides (halves)
    u32 a_halves;                // A's part of a stage
    u32 stage_halves;            // one stage (A and B)
    u32 nstages;                 // stages in the pipeline (2..TC_STAGES_MAX)
    u32 wtm, wtn;                // warp tile in fragments (m16, n8)
    u32 wgn;                     // warp tiles along n
    u32 wt;                      // warp tiles
    u32 ksplit;                  // warps per warp tile (splitting the k16 steps)
    u32 passes;
    u32 kc, ks;                  // 16-byte chunks per stage row (tk / 8, a power of two), log2 of it
    u32 threads;                 // the CTA's threads (blockDim.x; a constant in tc_shape_wide)
};

// The warp-tile classes of the tensor-core entries (common.cuh), what tile_mma instantiates:
// TC_NARROW (`_f16n`, up to 168 registers): warp tiles of at most 4 fragments; TC_STD (`_f16`, 128
// registers): at most 8; TC_WIDE (`_f16w_*`, 128-thread CTAs, up to 255 registers): 4 x 8 fragments,
// 64 x 64 outputs per warp (128 f32 accumulators per thread), so a k16 step reads 8 fragment
// sets for 32 mma (the 8-fragment tiles read 5 for 8: bound by shared memory, not tensor cores).
#define TC_NARROW 0u
#define TC_STD 1u
#define TC_WIDE 2u
// The small-M entries (`_gv`, `_gvn`, and `_sk_gv`, `_sk_gvn` for split-K): tile_gemv alone. The
// host sends them only products tiled by at most GV_ROWS_MAX rows with B's k contiguous; the other
// entries have no small-M path, so an edge tile of a few rows runs on the tensor-core engine like
// any other edge tile.
#define TC_GEMV 3u

__device__ __forceinline__ TcShape tc_shape(u32 tm, u32 tn, u32 K, u32 warps, bool b_kn, u32 smem_halves, u32 cls) {
    TcShape s;
    s.tmp = (tm + 15u) & ~15u;
    s.tnp = (tn + 15u) & ~15u;
    // The deepest stage that leaves room for 4 stages, else 3, else 2 (and no deeper than K needs).
    s.tk = 0u;
    for (u32 want = 4u; want >= 2u && s.tk == 0u; --want) {
        for (u32 tk = TC_TK_MAX; tk >= 32u; tk >>= 1) {
            const u32 a = s.tmp * (tk + 8u);
            const u32 b = b_kn ? tk * (s.tnp + 8u) : s.tnp * (tk + 8u);
            if ((a + b) * want <= smem_halves && (tk == 32u || tk / 2u < K)) {
                s.tk = tk;
                break;
            }
        }
    }
    if (s.tk == 0u) s.tk = 32u;  // less than two stages fit: tile_mma traps
    s.kc = s.tk / 8u;
    s.ks = __ffs(s.kc) - 1u;
    s.lda = s.tk + 8u;
    s.ldb = b_kn ? s.tnp + 8u : s.tk + 8u;
    s.a_halves = s.tmp * s.lda;
    s.stage_halves = s.a_halves + (b_kn ? s.tk * s.ldb : s.tnp * s.ldb);
    s.nstages = min(TC_STAGES_MAX, smem_halves / s.stage_halves);
    const u32 fm = s.tmp / 16u, fn = s.tnp / 8u;
    s.wtm = min(4u, fm);
    s.wtn = min(cls == TC_WIDE ? 8u : 4u, fn);
    const u32 frags_max = cls == TC_NARROW ? 4u : cls == TC_STD ? 8u : 32u;
    while (s.wtm * s.wtn > frags_max) {
        if (s.wtm >= s.wtn) s.wtm /= 2u;
        else s.wtn /= 2u;
    }
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
    s.threads = warps * 32u;
    return s;
}

// The wide entries' common case as constants: a whole 128 x 128 tile, stages of k32, B stored
// [n][k], 128 threads, one 4 x 8 warp tile per warp. tile_mma runs tc_pass with this shape when
// tc_shape computed exactly it, so every stride and offset of the stage loads and the hot loop is
// an immediate (the same shape computed at run time kept ~25 registers of them and spilled).
__device__ __forceinline__ bool tc_is_wide_common(const TcShape& s, bool b_kn) {
    return !b_kn && s.tmp == 128u && s.tnp == 128u && s.tk == 32u && s.threads == 128u && s.wtm == 4u && s.wtn == 8u &&
           s.ksplit == 1u && s.passes == 1u;
}
__device__ __forceinline__ TcShape tc_shape_wide(u32 nstages) {
    TcShape s;
    s.tmp = 128u;
    s.tnp = 128u;
    s.tk = 32u;
    s.lda = 40u;
    s.ldb = 40u;
    s.a_halves = 128u * 40u;
    s.stage_halves = 2u * 128u * 40u;
    s.nstages = nstages;
    s.wtm = 4u;
    s.wtn = 8u;
    s.wgn = 2u;
    s.wt = 4u;
    s.ksplit = 1u;
    s.passes = 1u;
    s.kc = 4u;
    s.ks = 2u;
    s.threads = 128u;
    return s;
}

// Fills one stage: A[tmp][tk] and B (either layout) for k in [k0, k0 + tk); zeros outside.
template <typename L>
__device__ __forceinline__ void tc_load_stage(const L& ld_, const TcShape& s, h16* As, h16* Bs, u32 tm, u32 tn, u32 K, u32 k0) {
    const u32 T = blockDim.x;
    const u32 tid = threadIdx.x;
    const u32 kc = s.kc;
    const u32 ks = s.ks;
    // A thread's 16-byte chunks all sit in one chunk column c (T is a multiple of kc), so what
    // depends on k alone (for a convolution: the kernel tap and channel) is worked out once per
    // stage, and the rows only add their own offsets.
    const u32 c = tid & (kc - 1u);
    const u32 k = k0 + c * 8u;
    if (ld_.a_vec) {
        const bool kin = k < K;
        const auto col = ld_.a_col(kin ? k : 0u);
        for (u32 mm = tid >> ks; mm < s.tmp; mm += T >> ks) {
            tc_put16(As + mm * s.lda + c * 8u, (mm < tm && kin) ? ld_.a_ptr(mm, col) : (const h16*)0);
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
            const bool kin = k < K;
            for (u32 nn = tid >> ks; nn < s.tnp; nn += T >> ks) {
                tc_put16(Bs + nn * s.ldb + c * 8u, (nn < tn && kin) ? ld_.b_ptr(k, nn) : (const h16*)0);
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

// The fast way to fill stages, when both operands come in 16-byte chunks (a_vec, b_vec) and the
// loader allows it (fast_ok: its offsets fit 32 bits). A thread loads the same chunks of every
// stage, only k moves, so where they are is worked out once per tile: per A row (and per B row,
// or per B chunk when B's contiguous index is n) an element offset in a register, and for A the
// loader's column state, stepped by tk from stage to stage (a convolution walks its kernel taps
// without dividing). A stage then costs an add, a bounds test and a cp.async per chunk.
// Tiles needing more than TC_FAST_CHUNKS chunks per thread of either operand use
// tc_load_stage, and so do the 128-register entries (only the narrow _f16n entries, NARROW in
// tile_mma, have the registers for this state; measured on an H200: BERT-base's products at
// M = 128 ran 10-17% faster, ResNet-50's 16 x 16 convolution tiles 3-5%).
#define TC_FAST_CHUNKS 4u
#define TC_NO_ROW 0xffffffffu

template <typename L>
struct TcFast {
    u32 c;                        // this thread's chunk column (A, and B stored [n][k])
    u32 row0, step;               // its first row and the rows between its chunks
    u32 a_off[TC_FAST_CHUNKS];    // A row offsets from the loader's base, or TC_NO_ROW (zeros)
    u32 a_aux[TC_FAST_CHUNKS];    // the loader's per-row data (a convolution: input row, column)
    u32 b_off[TC_FAST_CHUNKS];    // B row (or chunk) offsets at k = 0, or TC_NO_ROW
    u32 b_kk[TC_FAST_CHUNKS];     // b_kn: the chunk's k within a stage
    u32 b_dst[TC_FAST_CHUNKS];    // b_kn: the chunk's place in the stage (halves)
    typename L::ACol col;         // A's column state at this thread's next stage
};

// Whether the fast loads cover this tile; the same answer in every thread of the CTA.
template <typename L>
__device__ __forceinline__ bool tc_fast_fits(const L& ld_, const TcShape& s, u32 tn) {
    if (!ld_.a_vec || !ld_.b_vec || !ld_.fast_ok) return false;
    const u32 step = s.threads >> s.ks;
    if ((s.tmp + step - 1u) / step > TC_FAST_CHUNKS) return false;
    if (!ld_.b_kn) return (s.tnp + step - 1u) / step <= TC_FAST_CHUNKS;
    return tn % 8u == 0u && (s.tk * (s.tnp / 8u) + s.threads - 1u) / s.threads <= TC_FAST_CHUNKS;
}

template <typename L>
__device__ __forceinline__ void tc_fast_init(const L& ld_, const TcShape& s, u32 tm, u32 tn, TcFast<L>& f) {
    const u32 tid = threadIdx.x;
    f.c = tid & (s.kc - 1u);
    f.row0 = tid >> s.ks;
    f.step = s.threads >> s.ks;
#pragma unroll
    for (u32 r = 0; r < TC_FAST_CHUNKS; ++r) {
        const u32 mm = f.row0 + r * f.step;
        f.a_off[r] = TC_NO_ROW;
        f.a_aux[r] = 0u;
        if (mm < tm) ld_.a_row(mm, f.a_off[r], f.a_aux[r]);
    }
    if (!ld_.b_kn) {
#pragma unroll
        for (u32 r = 0; r < TC_FAST_CHUNKS; ++r) {
            const u32 nn = f.row0 + r * f.step;
            f.b_off[r] = nn < tn ? ld_.b_row(nn) : TC_NO_ROW;
            f.b_kk[r] = 0u;
            f.b_dst[r] = 0u;
        }
    } else {
        const u32 nc = s.tnp / 8u;
#pragma unroll
        for (u32 j = 0; j < TC_FAST_CHUNKS; ++j) {
            const u32 i = tid + j * s.threads;
            const u32 kk = i / nc;
            const u32 nn = (i % nc) * 8u;
            f.b_kk[j] = kk;
            f.b_dst[j] = kk * s.ldb + nn;
            f.b_off[j] = (kk < s.tk && nn < tn) ? ld_.b_row(nn) + kk * ld_.b_kstride() : TC_NO_ROW;
        }
    }
    f.col = ld_.a_col_at(f.c * 8u);
}

// Fills the next stage (k0 = this thread's next stage start; stages are filled in order).
template <typename L>
__device__ __forceinline__ void tc_fast_stage(const L& ld_, const TcShape& s, TcFast<L>& f, u32 As, u32 Bs, u32 K, u32 k0) {
    const u32 k = k0 + f.c * 8u;
    const bool kin = k < K;
    // Every row of the tile is some thread's (the wide entries' constant shape: always), so no
    // bounds test per chunk.
    const bool rows_whole = s.tmp == TC_FAST_CHUNKS * (s.threads >> s.ks);
    const bool cols_whole = s.tnp == TC_FAST_CHUNKS * (s.threads >> s.ks);
#pragma unroll
    for (u32 r = 0; r < TC_FAST_CHUNKS; ++r) {
        const u32 mm = f.row0 + r * f.step;
        if (rows_whole || mm < s.tmp) {
            const bool in = kin && f.a_off[r] != TC_NO_ROW;
            const h16* src = ld_.a_src(f.a_off[r], f.a_aux[r], f.col);
            tc_put16_if(As + (mm * s.lda + f.c * 8u) * 2u, src, in && (L::A_SRC_NONNULL || src));
        }
    }
    if (!ld_.b_kn) {
        const h16* base = ld_.b_base() + k;
#pragma unroll
        for (u32 r = 0; r < TC_FAST_CHUNKS; ++r) {
            const u32 nn = f.row0 + r * f.step;
            if (cols_whole || nn < s.tnp)
                tc_put16_if(Bs + (nn * s.ldb + f.c * 8u) * 2u, base + f.b_off[r], kin && f.b_off[r] != TC_NO_ROW);
        }
    } else {
        const h16* base = ld_.b_base() + (u64)k0 * ld_.b_kstride();
        const u32 chunks = s.tk * (s.tnp / 8u);
#pragma unroll
        for (u32 j = 0; j < TC_FAST_CHUNKS; ++j) {
            if (threadIdx.x + j * s.threads < chunks) {
                const bool in = f.b_off[j] != TC_NO_ROW && k0 + f.b_kk[j] < K;
                tc_put16_at(Bs + f.b_dst[j] * 2u, in ? base + f.b_off[j] : (const h16*)0);
            }
        }
    }
    ld_.a_col_step(f.col, s.tk);
}

// Where a lane's fragments sit in a stage (tc_pass).
struct TcFragAddr {
    u32 a0, a_step, a_last;       // A: fragment row 0, + a_step per fragment row (bytes), last row
    u32 b0, b_step, b_k, b_last;  // B: fragment columns 0-1, + b_step per pair, + b_k per k16 step, last pair
    bool b_kn;            // B stored [k][n] (read transposed)
};

// One k16 step's fragments of a warp tile, all MI x NI of them whatever the tile's edge: a
// fragment past the warp's last one (a_last, b_last: index of the last A row fragment, of the
// last pair of B column fragments) reads that last one again, and its products are never stored.
// No per-fragment predicates in the hot loop (they cost more than the wasted products).
template <u32 MI, u32 NI>
__device__ __forceinline__ void tc_frags(u32 (&af)[MI][4], u32 (&bf)[NI][2], u32 a_st, u32 b_st, const TcFragAddr& fa, u32 kk) {
    const u32 b_at = b_st + fa.b0 + kk * fa.b_k;
#pragma unroll
    for (u32 j = 0; j < NI; j += 2u) {
        u32 r[4];
        tc_ldsm_x4_b(r, b_at + min(j / 2u, fa.b_last) * fa.b_step, fa.b_kn);
        bf[j][0] = r[0];
        bf[j][1] = r[1];
        bf[j + 1u][0] = r[2];
        bf[j + 1u][1] = r[3];
    }
    const u32 a_at = a_st + fa.a0 + kk * 32u;
#pragma unroll
    for (u32 i = 0; i < MI; ++i) tc_ldsm_x4(af[i], a_at + min(i, fa.a_last) * fa.a_step);
}

template <u32 MI, u32 NI>
__device__ __forceinline__ void tc_mmas(float (&acc)[MI][NI][4], const u32 (&af)[MI][4], const u32 (&bf)[NI][2]) {
#pragma unroll
    for (u32 i = 0; i < MI; ++i)
#pragma unroll
        for (u32 j = 0; j < NI; ++j) tc_mma(acc[i][j], af[i], bf[j][0], bf[j][1]);
}

// Hands a warp tile's sums to the loader: fragment (i, j) of this lane holds rows r0 + 16 i and
// r0 + 16 i + 8, columns c0 + 8 j and c0 + 8 j + 1 (r0, c0: the lane's first row and column in the
// tile); fragments past mi_n x nj_n and outputs past tm x tn are not stored. Pairs of columns
// go out together (the loader's store2), and the activation's class is chosen once, so the
// unrolled stores stay compact code (common.cuh: kairos_act_tagged). AHEAD: the bias pairs, and
// the residual pairs of IG fragment rows at a time (at most 32 words), are read before any of
// their stores, all in flight at once (read between the stores, each waits out its own round
// trip: a load may not pass a store that could alias it); without it each pair is read beside its
// store, which keeps the generic engine's registers for its main loop (with AHEAD there, its
// 128-thread entries spilled in the stage loop and ResNet-18 ran 26% slower at batch 1, H100).
template <u32 ACT, bool AHEAD, u32 MI, u32 NI, typename L>
__device__ __forceinline__ void tc_store_frags_as(const L& ld_, const float (&acc)[MI][NI][4], u32 r0, u32 c0, u32 mi_n,
                                                  u32 nj_n, u32 tm, u32 tn) {
    if constexpr (!AHEAD) {
#pragma unroll
        for (u32 i = 0; i < MI; ++i)
#pragma unroll
            for (u32 j = 0; j < NI; ++j) {
                const u32 mm = r0 + i * 16u;
                const u32 nn = c0 + j * 8u;
                if (i < mi_n && j < nj_n && nn < tn) {
                    const bool two = nn + 1u < tn;
                    if (mm < tm)
                        ld_.template store2<ACT>(mm, nn, acc[i][j][0], acc[i][j][1], two, ld_.bias2(nn, two), ld_.res2(mm, nn, two));
                    if (mm + 8u < tm)
                        ld_.template store2<ACT>(mm + 8u, nn, acc[i][j][2], acc[i][j][3], two, ld_.bias2(nn, two),
                                                 ld_.res2(mm + 8u, nn, two));
                }
            }
        return;
    }
    constexpr u32 IG = MI * NI * 2u <= 32u ? MI : (16u / NI > 0u ? 16u / NI : 1u);
    u32 bias[NI];
#pragma unroll
    for (u32 j = 0; j < NI; ++j) {
        const u32 nn = c0 + j * 8u;
        bias[j] = j < nj_n && nn < tn ? ld_.bias2(nn, nn + 1u < tn) : 0u;
    }
#pragma unroll
    for (u32 i0 = 0; i0 < MI; i0 += IG) {
        u32 res[IG][NI][2];
#pragma unroll
        for (u32 g = 0; g < IG; ++g)
#pragma unroll
            for (u32 j = 0; j < NI; ++j) {
                const u32 i = i0 + g, mm = r0 + i * 16u, nn = c0 + j * 8u;
                const bool frag = i < MI && i < mi_n && j < nj_n && nn < tn;
                res[g][j][0] = frag && mm < tm ? ld_.res2(mm, nn, nn + 1u < tn) : 0u;
                res[g][j][1] = frag && mm + 8u < tm ? ld_.res2(mm + 8u, nn, nn + 1u < tn) : 0u;
            }
#pragma unroll
        for (u32 g = 0; g < IG; ++g)
#pragma unroll
            for (u32 j = 0; j < NI; ++j) {
                const u32 i = i0 + g, mm = r0 + i * 16u, nn = c0 + j * 8u;
                if (i < MI && i < mi_n && j < nj_n && nn < tn) {
                    const bool two = nn + 1u < tn;
                    if (mm < tm) ld_.template store2<ACT>(mm, nn, acc[i][j][0], acc[i][j][1], two, bias[j], res[g][j][0]);
                    if (mm + 8u < tm) ld_.template store2<ACT>(mm + 8u, nn, acc[i][j][2], acc[i][j][3], two, bias[j], res[g][j][1]);
                }
            }
    }
}

template <u32 MI, u32 NI, bool AHEAD = false, typename L>
__device__ __forceinline__ void tc_store_frags(const L& ld_, const float (&acc)[MI][NI][4], u32 r0, u32 c0, u32 mi_n, u32 nj_n,
                                               u32 tm, u32 tn) {
    const u32 act = ld_.act();
#ifdef KAIROS_ACT_ONLY
    // The host picks the entry of the launch's class (kairos_kernels::source::entry_key).
    if (KAIROS_ACT_ONLY != KAIROS_ACT_ANY && act != KAIROS_ACT_ONLY) asm volatile("trap;");
    tc_store_frags_as<KAIROS_ACT_ONLY, AHEAD>(ld_, acc, r0, c0, mi_n, nj_n, tm, tn);
    return;
#endif
    if (act == KAIROS_ACT_NONE) tc_store_frags_as<KAIROS_ACT_NONE, AHEAD>(ld_, acc, r0, c0, mi_n, nj_n, tm, tn);
    else if (act == KAIROS_ACT_RELU) tc_store_frags_as<KAIROS_ACT_RELU, AHEAD>(ld_, acc, r0, c0, mi_n, nj_n, tm, tn);
    else tc_store_frags_as<KAIROS_ACT_ANY, AHEAD>(ld_, acc, r0, c0, mi_n, nj_n, tm, tn);
}

// The epilogue of a whole tile from shared memory (the fixed-shape tiles): the f32 sums sit in
// `cs` ([BM][BN + TCX_CPAD] floats) and each thread takes runs of 8 outputs along a row, so the
// loader reads bias and residual and writes the outputs 16 bytes at a time (store8), and no
// accumulator is live across an out-of-line activation call (in registers, the 64 sums of a
// 128 x 128 tile's thread were spilled around each call: half of a GELU product's time, H100).
#define TCX_CPAD 8u  // floats of padding per row: a half-warp's float2 fragment writes hit 16 banks

template <u32 ACT, u32 BM, u32 BN, u32 T, typename L>
__device__ __forceinline__ void tcx_epilogue_as(const L& ld_, const float* cs, u32 tm, u32 tn) {
    constexpr u32 RUNS = BM * BN / 8u;
#pragma unroll
    for (u32 q0 = 0; q0 < RUNS; q0 += T) {
        const u32 q = q0 + threadIdx.x;
        const u32 mm = q / (BN / 8u), nn = (q % (BN / 8u)) * 8u;
        if (mm < tm && nn < tn) {
            const float4 lo = *(const float4*)(cs + mm * (BN + TCX_CPAD) + nn);
            const float4 hi = *(const float4*)(cs + mm * (BN + TCX_CPAD) + nn + 4u);
            const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            ld_.template store8<ACT>(mm, nn, v, min(8u, tn - nn));
        }
    }
}

// The generic engine's epilogue for an activation that is an out-of-line call (none and ReLU are
// inline: common.cuh, kairos_act_tagged). Called beside the accumulators (tc_store_frags), it made
// the warp tile's live sums spill around every call: ConvNeXt's 96 -> 384 GELU product on 32 x
// 128 tiles ran 2.2x the time of its same-size 384 -> 96 product without an activation (H200).
// When every warp's tile fits in the idle stage buffers (`tc_staged_act`), a warp writes its sums
// there ([MI * 16][NI * 8 + TCX_CPAD] floats per warp) and finishes by runs of 8 outputs along a
// row through the loader's store8, as the fixed tiles do (tcx_epilogue_as): no sum is live across
// a call. A unit compiled for none or ReLU only (KAIROS_ACT_ONLY) never takes this path.
#if defined(KAIROS_ACT_ONLY)
#define TC_STAGED_ACT (KAIROS_ACT_ONLY == KAIROS_ACT_ANY)
#else
#define TC_STAGED_ACT 1
#endif

template <u32 MI, u32 NI>
__device__ __forceinline__ bool tc_staged_act(u32 act, u32 threads, u32 smem_bytes) {
    constexpr u32 per_warp_bytes = MI * 16u * (NI * 8u + TCX_CPAD) * 4u;
    return TC_STAGED_ACT && act != KAIROS_ACT_NONE && act != KAIROS_ACT_RELU && (threads / 32u) * per_warp_bytes <= smem_bytes;
}

// Warp `warp`'s tile (first row wr0, first column wc0 in the CTA tile; mi_n x nj_n fragments hold
// data) through its part of shared memory; the caller synchronises the CTA before the stages are
// refilled.
template <u32 MI, u32 NI, typename L>
__device__ __forceinline__ void tc_store_frags_staged(const L& ld_, const float (&acc)[MI][NI][4], u32 wr0, u32 wc0, u32 mi_n,
                                                      u32 nj_n, u32 tm, u32 tn, u32 warp, u32 lane) {
    constexpr u32 C = NI * 8u + TCX_CPAD;
    float* const w = (float*)kairos_dyn_smem + warp * (MI * 16u * C);
    const u32 lr = lane >> 2, lc = (lane & 3u) * 2u;
#pragma unroll
    for (u32 i = 0; i < MI; ++i)
#pragma unroll
        for (u32 j = 0; j < NI; ++j)
            if (i < mi_n && j < nj_n) {
                *(float2*)(w + (i * 16u + lr) * C + j * 8u + lc) = make_float2(acc[i][j][0], acc[i][j][1]);
                *(float2*)(w + (i * 16u + lr + 8u) * C + j * 8u + lc) = make_float2(acc[i][j][2], acc[i][j][3]);
            }
    __syncwarp();
    const u32 runs = mi_n * 16u * nj_n;
    for (u32 q = lane; q < runs; q += 32u) {
        const u32 r = q / nj_n, c = (q % nj_n) * 8u;
        const u32 mm = wr0 + r, nn = wc0 + c;
        if (mm < tm && nn < tn) {
            const float4 lo = *(const float4*)(w + r * C + c);
            const float4 hi = *(const float4*)(w + r * C + c + 4u);
            const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            ld_.template store8<KAIROS_ACT_ANY>(mm, nn, v, min(8u, tn - nn));
        }
    }
}

// One pass of the engine with warp tiles of at most MI x NI fragments (compile-time, so the
// accumulators of small warp tiles take few registers).
template <u32 MI, u32 NI, bool FAST, typename L>
__device__ __forceinline__ void tc_pass(L& ld_, const TcShape& s, u32 smem_bytes, u32 tm, u32 tn, u32 K, u32 pass) {
    h16* const smem = (h16*)kairos_dyn_smem;
    const u32 smem0 = tc_smem_addr(smem);  // stage addresses as 32-bit shared-memory offsets
    const u32 stage_bytes = s.stage_halves * 2u;
    const u32 warps = s.threads / 32u;
    const u32 warp = threadIdx.x / 32u;
    const u32 lane = threadIdx.x % 32u;
    const u32 stages = (K + s.tk - 1u) / s.tk;
    const u32 fm = s.tmp / 16u, fn = s.tnp / 8u;
    const u32 ksteps = s.tk / 16u;
    {
        // This warp's role: warp tile `t` (row-major over the warp-tile grid), k16 slice `slice`.
        const u32 t = s.ksplit > 1u ? warp % s.wt : pass * warps + warp;
        const u32 slice = s.ksplit > 1u ? warp / s.wt : 0u;
        const bool active = s.ksplit > 1u ? warp < s.wt * s.ksplit : t < s.wt;
        const u32 fm0 = (t / s.wgn) * s.wtm;
        const u32 fn0 = (t % s.wgn) * s.wtn;
        const u32 mi_n = active ? min(s.wtm, fm > fm0 ? fm - fm0 : 0u) : 0u;
        const u32 nj_n = active ? min(s.wtn, fn > fn0 ? fn - fn0 : 0u) : 0u;
        float acc[MI][NI][4];
#pragma unroll
        for (u32 i = 0; i < MI; ++i)
#pragma unroll
            for (u32 j = 0; j < NI; ++j)
#pragma unroll
                for (u32 r = 0; r < 4u; ++r) acc[i][j][r] = 0.0f;

        // This lane's ldmatrix addresses within a stage (bytes): A's first fragment row and the
        // step to the next (16 rows), B's first pair of fragment columns and the step to the next
        // (16 columns); a k16 step adds 32 bytes (B stored [k][n]: 16 rows). Four registers
        // whatever the warp tile (per-fragment offsets pushed the 128-register entries to spill).
        TcFragAddr fa;
        const u32 fm0r = min(fm0, fm - 1u), fn0r = min(fn0, fn - 2u);  // fn is even (tnp: 16s)
        fa.a0 = ((fm0r * 16u + (lane & 15u)) * s.lda + (lane >> 4) * 8u) * 2u;
        fa.a_step = 16u * s.lda * 2u;
        fa.a_last = mi_n > 0u ? mi_n - 1u : 0u;
        fa.b_last = nj_n > 0u ? (nj_n - 1u) / 2u : 0u;
        if (ld_.b_kn) {
            fa.b0 = (((lane & 7u) + ((lane >> 3) & 1u) * 8u) * s.ldb + fn0r * 8u + (lane >> 4) * 8u) * 2u;
            fa.b_step = 16u * 2u;
            fa.b_k = 32u * s.ldb;
        } else {
            fa.b0 = ((fn0r * 8u + (lane & 7u) + ((lane >> 4) << 3)) * s.ldb + ((lane >> 3) & 1u) * 8u) * 2u;
            fa.b_step = 16u * s.ldb * 2u;
            fa.b_k = 32u;
        }
        fa.b_kn = ld_.b_kn;

        // Prologue: stages 0 .. nstages - 2 in flight (one commit group each, empty past K).
        // Fast loads where the warp tile leaves registers for them (see TC_FAST_CHUNKS).
        const bool fast = FAST && tc_fast_fits(ld_, s, tn);
        TcFast<L> fl;
        if (fast) tc_fast_init(ld_, s, tm, tn, fl);
        for (u32 p = 0; p + 1u < s.nstages; ++p) {
            if (p < stages) {
                h16* buf = smem + p * s.stage_halves;
                if (fast) tc_fast_stage(ld_, s, fl, smem0 + p * stage_bytes, smem0 + p * stage_bytes + s.a_halves * 2u, K, p * s.tk);
                else tc_load_stage(ld_, s, buf, buf + s.a_halves, tm, tn, K, p * s.tk);
            }
            tc_cp_commit();
        }
        u32 cur_buf = 0;                 // buffer of stage st
        u32 next_buf = s.nstages - 1u;   // buffer of stage st + nstages - 1
        for (u32 st = 0; st < stages; ++st) {
            tc_cp_wait(s.nstages - 2u);  // stage st has landed (this thread's copies)
            __syncthreads();             // everyone's copies are visible; stage st - 1 is consumed
            const u32 ahead = st + s.nstages - 1u;
            if (ahead < stages) {
                h16* buf = smem + next_buf * s.stage_halves;
                if (fast) {
                    const u32 at = smem0 + next_buf * stage_bytes;
                    tc_fast_stage(ld_, s, fl, at, at + s.a_halves * 2u, K, ahead * s.tk);
                } else {
                    tc_load_stage(ld_, s, buf, buf + s.a_halves, tm, tn, K, ahead * s.tk);
                }
            }
            tc_cp_commit();
            next_buf = next_buf + 1u == s.nstages ? 0u : next_buf + 1u;
            const u32 a_st = smem0 + cur_buf * stage_bytes;
            const u32 b_st = a_st + s.a_halves * 2u;
            cur_buf = cur_buf + 1u == s.nstages ? 0u : cur_buf + 1u;
            // k16 steps holding data (none for a warp without a warp tile)
            const u32 kend = mi_n > 0u ? min(ksteps, (K - st * s.tk + 15u) / 16u) : 0u;
            if constexpr (FAST && MI * NI <= 8u) {
                // Small warp tiles of the 168-register entries have registers to spare: the fragments of the next k16 step
                // are read while this one's products run (two register sets, unrolled by two
                // so their indices stay static).
                u32 af0[MI][4], bf0[NI][2], af1[MI][4], bf1[NI][2];
                u32 kk = slice;
                if (kk < kend) tc_frags<MI, NI>(af0, bf0, a_st, b_st, fa, kk);
                while (kk < kend) {
                    const u32 k1 = kk + s.ksplit;
                    if (k1 < kend) tc_frags<MI, NI>(af1, bf1, a_st, b_st, fa, k1);
                    tc_mmas<MI, NI>(acc, af0, bf0);
                    if (k1 >= kend) break;
                    const u32 k2 = k1 + s.ksplit;
                    if (k2 < kend) tc_frags<MI, NI>(af0, bf0, a_st, b_st, fa, k2);
                    tc_mmas<MI, NI>(acc, af1, bf1);
                    kk = k2;
                }
            } else {
                for (u32 kk = slice; kk < kend; kk += s.ksplit) {
                    u32 af[MI][4], bf[NI][2];
                    tc_frags<MI, NI>(af, bf, a_st, b_st, fa, kk);
                    tc_mmas<MI, NI>(acc, af, bf);
                }
            }
        }
        tc_cp_wait_all();  // only empty groups can be left
        __syncthreads();   // every warp is done with the stages (shared memory is reused below)

        // Warps of slices > 0 hand their sums to slice 0 through shared memory, in rounds of as
        // many slices as fit, always added in slice order.
        if (s.ksplit > 1u) {
            float* red = (float*)kairos_dyn_smem;
            const u32 per_tile = s.wtm * s.wtn * 128u;  // floats: fragments x 4 x 32 lanes
            const u32 per_slice = s.wt * per_tile;
            const u32 fit = max(1u, (smem_bytes / 4u) / per_slice);
            for (u32 s0 = 1u; s0 < s.ksplit; s0 += fit) {
                const u32 s1 = min(s.ksplit, s0 + fit);
                if (active && slice >= s0 && slice < s1) {
                    float* dst = red + (slice - s0) * per_slice + t * per_tile;
#pragma unroll
                    for (u32 i = 0; i < MI; ++i)
#pragma unroll
                        for (u32 j = 0; j < NI; ++j)
                            if (i < mi_n && j < nj_n)
#pragma unroll
                                for (u32 r = 0; r < 4u; ++r) dst[((i * s.wtn + j) * 4u + r) * 32u + lane] = acc[i][j][r];
                }
                __syncthreads();
                if (active && slice == 0u) {
                    for (u32 q = s0; q < s1; ++q) {
                        const float* src = red + (q - s0) * per_slice + t * per_tile;
#pragma unroll
                        for (u32 i = 0; i < MI; ++i)
#pragma unroll
                            for (u32 j = 0; j < NI; ++j)
                                if (i < mi_n && j < nj_n)
#pragma unroll
                                    for (u32 r = 0; r < 4u; ++r) acc[i][j][r] += src[((i * s.wtn + j) * 4u + r) * 32u + lane];
                    }
                }
                __syncthreads();
            }
        }

        if (active && slice == 0u) {
            if (tc_staged_act<MI, NI>(ld_.act(), s.threads, smem_bytes))
                tc_store_frags_staged<MI, NI>(ld_, acc, fm0 * 16u, fn0 * 8u, mi_n, nj_n, tm, tn, warp, lane);
            else
                tc_store_frags<MI, NI>(ld_, acc, fm0 * 16u + (lane >> 2), fn0 * 8u + (lane & 3u) * 2u, mi_n, nj_n, tm, tn);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// The small-M path of the tensor-core engine's loaders (fp16): a logical block of at most
// GV_ROWS_MAX rows (batch-1 classifier layers, the last rows of a tall product) with B's k
// contiguous. An m16n8k16 fragment would waste at least half of every mma on such a tile and the
// block is bound by streaming its tn x K weights, so the CTA instead
// - stages the tile's rows of A in shared memory (fp16, zeros past tm and K), a K chunk at a
//   time (as much of K as fits beside the sums),
// - streams B's columns GV_COLS at a time: every thread of the CTA takes 8-half chunks along K
//   (16-byte non-caching loads when b_vec, element loads otherwise), two chunks per column in
//   flight, and accumulates in f32 registers,
// - adds each thread's sums across its warp (shuffles), then the warps' sums in warp order into
//   the block's sums in shared memory, K chunk after K chunk,
// - and hands every output to the loader's store (the fused epilogue) once K is done.
// The order of every addition is fixed, so results do not depend on timing; any tn up to
// TILE_MAX and any CTA size up to GV_WARPS_MAX warps (the kernels' launch bound) are correct.
// Shared memory: warp sums [GV_WARPS_MAX][GV_ROWS_MAX][GV_COLS] f32, block sums
// [GV_ROWS_MAX][TILE_MAX] f32, then A (GV_SMEM_FIXED_BYTES + 16 halves per row at least; the
// engine's TC_SMEM_MIN_BYTES leaves room for K chunks of 2240 halves at 8 rows).

#define GV_ROWS_MAX 8u
#define GV_COLS 4u
#define GV_WARPS_MAX 8u
#define GV_RED_FLOATS (GV_WARPS_MAX * GV_ROWS_MAX * GV_COLS)
#define GV_SMEM_FIXED_BYTES ((GV_RED_FLOATS + GV_ROWS_MAX * TILE_MAX) * 4u)

// 16 bytes of streamed operand (read once per block: no L1 allocation). Volatile, so it is
// never hoisted above the bounds check that guards it.
__device__ __forceinline__ uint4 gv_ld_stream(const h16* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// B at (k .. k + 8, nn) as 8 halves; zeros past K.
template <bool BVEC, typename L>
__device__ __forceinline__ uint4 gv_load_b(const L& ld_, u32 k, u32 nn, u32 K) {
    if constexpr (BVEC) {
        return gv_ld_stream(ld_.b_ptr(k, nn));
    } else {
        u32 w[4];
#pragma unroll
        for (u32 i = 0; i < 4u; ++i) {
            const u32 lo = k + 2u * i < K ? (u32)ld_.bh(k + 2u * i, nn) : 0u;
            const u32 hi = k + 2u * i + 1u < K ? (u32)ld_.bh(k + 2u * i + 1u, nn) : 0u;
            w[i] = lo | (hi << 16);
        }
        uint4 r;
        r.x = w[0];
        r.y = w[1];
        r.z = w[2];
        r.w = w[3];
        return r;
    }
}

template <u32 MT, bool BVEC, typename L>
__device__ __forceinline__ void tile_gemv_rows(L& ld_, u32 tm, u32 tn, u32 K, u32 smem_bytes) {
    const u32 T = blockDim.x;
    const u32 tid = threadIdx.x;
    const u32 warps = T / 32u;
    const u32 warp = tid / 32u;
    const u32 lane = tid % 32u;
    float* red = (float*)kairos_dyn_smem;  // [warps][MT][GV_COLS]
    float* part = red + GV_RED_FLOATS;     // [MT][tn]
    h16* As = (h16*)(part + GV_ROWS_MAX * TILE_MAX);
    // Halves of A per row in one K chunk: a multiple of 8, no more than K needs.
    const u32 kc = smem_bytes < GV_SMEM_FIXED_BYTES ? 8u : min(((smem_bytes - GV_SMEM_FIXED_BYTES) / 2u / MT) & ~7u, (K + 7u) & ~7u);
    if (smem_bytes < GV_SMEM_FIXED_BYTES + 16u * MT || warps > GV_WARPS_MAX) asm volatile("trap;");
    for (u32 i = tid; i < MT * tn; i += T) part[i] = 0.0f;
    for (u32 k0 = 0; k0 < K; k0 += kc) {
        const u32 nch = (min(kc, K - k0) + 7u) / 8u;  // 8-half chunks of this K chunk
        __syncthreads();  // the previous K chunk's A is consumed (and the sums are zeroed)
        for (u32 i = tid; i < MT * nch; i += T) {
            const u32 mm = i / nch;
            const u32 c = i % nch;
            const u32 k = k0 + c * 8u;
            h16* dst = As + mm * kc + c * 8u;
            if (ld_.a_vec) {  // K % 8 == 0, so k + 8 <= K
                uint4 v;
                v.x = v.y = v.z = v.w = 0u;
                if (mm < tm) {
                    const h16* src = ld_.a_ptr(mm, ld_.a_col(k));
                    if (src) v = *(const uint4*)src;
                }
                *(uint4*)dst = v;
            } else {
#pragma unroll
                for (u32 j = 0; j < 8u; ++j) dst[j] = (mm < tm && k + j < K) ? ld_.ah(mm, k + j) : (h16)0;
            }
        }
        __syncthreads();
        for (u32 g = 0; g < tn; g += GV_COLS) {
            u32 col[GV_COLS];
#pragma unroll
            for (u32 j = 0; j < GV_COLS; ++j) col[j] = min(g + j, tn - 1u);  // columns past tn: loaded, not kept
            float acc[MT][GV_COLS];
#pragma unroll
            for (u32 mm = 0; mm < MT; ++mm)
#pragma unroll
                for (u32 j = 0; j < GV_COLS; ++j) acc[mm][j] = 0.0f;
            for (u32 c = tid; c < nch; c += 2u * T) {
                uint4 bv[2][GV_COLS];
#pragma unroll
                for (u32 u = 0; u < 2u; ++u) {
                    const u32 cc = c + u * T;
#pragma unroll
                    for (u32 j = 0; j < GV_COLS; ++j) {
                        if (cc < nch) {
                            bv[u][j] = gv_load_b<BVEC>(ld_, k0 + cc * 8u, col[j], K);
                        } else {
                            bv[u][j].x = bv[u][j].y = bv[u][j].z = bv[u][j].w = 0u;
                        }
                    }
                }
#pragma unroll
                for (u32 u = 0; u < 2u; ++u) {
                    const u32 cc = c + u * T;
                    if (cc < nch) {
                        float bf[GV_COLS][8];
#pragma unroll
                        for (u32 j = 0; j < GV_COLS; ++j) unpack_h16x8(bv[u][j], bf[j]);
#pragma unroll
                        for (u32 mm = 0; mm < MT; ++mm) {
                            float af[8];
                            unpack_h16x8(*(const uint4*)(As + mm * kc + cc * 8u), af);
#pragma unroll
                            for (u32 j = 0; j < GV_COLS; ++j)
#pragma unroll
                                for (u32 e = 0; e < 8u; ++e) acc[mm][j] = fmaf(af[e], bf[j][e], acc[mm][j]);
                        }
                    }
                }
            }
#pragma unroll
            for (u32 mm = 0; mm < MT; ++mm)
#pragma unroll
                for (u32 j = 0; j < GV_COLS; ++j) {
                    float v = acc[mm][j];
#pragma unroll
                    for (u32 off = 16u; off > 0u; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
                    if (lane == 0u) red[(warp * MT + mm) * GV_COLS + j] = v;
                }
            __syncthreads();
            if (tid < MT * GV_COLS) {
                const u32 mm = tid / GV_COLS;
                const u32 j = tid % GV_COLS;
                if (g + j < tn) {
                    float s = 0.0f;
                    for (u32 w = 0; w < warps; ++w) s += red[(w * MT + mm) * GV_COLS + j];
                    part[mm * tn + g + j] += s;
                }
            }
            __syncthreads();  // the warp sums are read before the next column group writes them
        }
    }
    for (u32 i = tid; i < tm * tn; i += T) ld_.store(i / tn, i % tn, part[i]);
    __syncthreads();  // the sums are read before the next logical block zeroes them
}

template <typename L>
__device__ __forceinline__ void tile_gemv(L& ld_, u32 tm, u32 tn, u32 K, u32 smem_bytes) {
    if (ld_.b_vec) {
        if (tm <= 1u) tile_gemv_rows<1, true>(ld_, tm, tn, K, smem_bytes);
        else if (tm <= 2u) tile_gemv_rows<2, true>(ld_, tm, tn, K, smem_bytes);
        else if (tm <= 4u) tile_gemv_rows<4, true>(ld_, tm, tn, K, smem_bytes);
        else tile_gemv_rows<8, true>(ld_, tm, tn, K, smem_bytes);
    } else {
        if (tm <= 1u) tile_gemv_rows<1, false>(ld_, tm, tn, K, smem_bytes);
        else if (tm <= 2u) tile_gemv_rows<2, false>(ld_, tm, tn, K, smem_bytes);
        else if (tm <= 4u) tile_gemv_rows<4, false>(ld_, tm, tn, K, smem_bytes);
        else tile_gemv_rows<8, false>(ld_, tm, tn, K, smem_bytes);
    }
}

// CLS: the entry's warp-tile class (TC_NARROW, TC_STD, TC_WIDE, TC_GEMV above), so each entry
// compiles only the tc_pass instantiations its register budget holds.
template <u32 CLS, typename L>
__device__ __forceinline__ void tile_mma(L& ld_, u32 tm, u32 tn, u32 K) {
    constexpr bool NARROW = CLS == TC_NARROW;
    const u32 smem_bytes = tc_dyn_smem_bytes();
    if constexpr (CLS == TC_GEMV) {
        if (tm <= GV_ROWS_MAX && !ld_.b_kn) {
            tile_gemv(ld_, tm, tn, K, smem_bytes);
            return;
        }
    }
    if constexpr (CLS == TC_GEMV) {
        asm volatile("trap;");  // not a small-M product: the host picked the wrong entry
    } else {
        const TcShape s = tc_shape(tm, tn, K, blockDim.x / 32u, ld_.b_kn, smem_bytes / 2u, CLS);
        if (s.nstages < 2u) asm volatile("trap;");  // launched with less than TC_SMEM_MIN_BYTES
        for (u32 pass = 0; pass < s.passes; ++pass) {
            if constexpr (CLS == TC_WIDE) {
                // Whole tiles with the constant shape and the fast loads; the rest (edge tiles, B
                // stored [k][n], other depths) with the shape at run time. Smaller warp tiles (the
                // edges of a product) re-read their last fragments and compute products never stored.
                if (tc_is_wide_common(s, ld_.b_kn)) {
                    L kn_free = ld_;  // b_kn as a constant too
                    kn_free.b_kn = false;
                    tc_pass<4, 8, true>(kn_free, tc_shape_wide(s.nstages), smem_bytes, tm, tn, K, pass);
                } else {
                    tc_pass<4, 8, false>(ld_, s, smem_bytes, tm, tn, K, pass);
                }
            } else if (s.wtm <= 1u && s.wtn <= 2u) {
                // The fast loads' state needs registers only the narrow entries have to spare (in the
                // 128-register entries it pushed the large warp tiles into spilling more).
                tc_pass<1, 2, NARROW>(ld_, s, smem_bytes, tm, tn, K, pass);
            } else if (s.wtm <= 1u) {
                tc_pass<1, 4, NARROW>(ld_, s, smem_bytes, tm, tn, K, pass);
            } else if (NARROW || (s.wtm <= 2u && s.wtn <= 2u)) {
                tc_pass<2, 2, NARROW>(ld_, s, smem_bytes, tm, tn, K, pass);
            } else if (s.wtm <= 2u) {
                tc_pass<2, 4, false>(ld_, s, smem_bytes, tm, tn, K, pass);
            } else {
                tc_pass<4, 2, false>(ld_, s, smem_bytes, tm, tn, K, pass);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The fixed-shape tensor-core tiles (tc_tile_fixed): the common tiles of the plan with every
// dimension a compile-time constant, so the hot loop is straight-line code on immediates and
// the warp tiles are as large as the entry's registers hold. Used by tile_mma_planned when both
// operands come in 16-byte chunks, B has k contiguous and the loader's fast offsets fit
// (fast_ok): the plan's tile (not the clipped one: the edge tiles of a product run the same
// code, with rows, columns and k past the product filled with zeros and never stored).
//   the TC_STD entries' (256 threads, 128 registers) large tiles: 128 x 128 on 2 x 4 warps of
//   64 x 32, 64 x 128 on 2 x 4 and 128 x 64 on 4 x 2 warps of 32 x 32.
// Smaller tiles stay on the generic engine: its deeper stages (up to k256) keep more bytes in
// flight per CTA, which bounds small tiles along long K (measured on an H100: with fixed k32
// versions of the 128-thread and 64 x 64 tiles as well, ResNet-18..152 and DenseNet ran 10-40%
// slower at batch 1).
// Stages are k32 deep (rows of 32 halves + 8 of padding, so ldmatrix is free of bank conflicts),
// as many as the launch's dynamic shared memory holds (2 .. TC_STAGES_MAX). A thread always copies
// the same 16-byte chunk column of the same rows, so its row offsets and the loader's column state
// are worked out once per tile. The generic engine (tile_mma) covers every other case and is the
// fallback when fewer than two stages fit. Measured on an H100: docs/benchmarks.md ("Compact
// epilogues and fixed-shape tiles").
#define TCX_TK 32u
#define TCX_LD 40u  // halves per stage row

template <u32 BM, u32 BN>
__device__ __forceinline__ constexpr u32 tcx_stage_bytes() {
    return (BM + BN) * TCX_LD * 2u;
}
// A stage of the wgmma tiles (tc_tile_wgmma64): unpadded core matrices.
template <u32 BM, u32 BN>
__device__ __forceinline__ constexpr u32 tcw_stage_bytes() {
    return (BM + BN) * TCX_TK * 2u;
}


// A thread's share of the k32 stage loads of the fixed-shape tiles (tc_tile_fixed,
// tc_tile_wgmma64): the same 16-byte chunk column of the same rows every stage, their offsets (TC_NO_ROW
// past the tile) and the loader's column state worked out once per tile.
template <u32 AR, u32 BR, u32 RPP, typename L>
struct TcxChunks {
    u32 a_off[AR], a_aux[AR], b_off[BR];
    typename L::ACol col;
    const h16* b_base;
    u32 c;  // the chunk column

    __device__ __forceinline__ TcxChunks(const L& ld_, u32 tid, u32 tm, u32 tn)
        : col(ld_.a_col_at((tid & (TCX_TK / 8u - 1u)) * 8u)), b_base(ld_.b_base()), c(tid & (TCX_TK / 8u - 1u)) {
        const u32 row0 = tid / (TCX_TK / 8u);
#pragma unroll
        for (u32 r = 0; r < AR; ++r) {
            const u32 mm = row0 + r * RPP;
            a_off[r] = TC_NO_ROW;
            a_aux[r] = 0u;
            if (mm < tm) ld_.a_row(mm, a_off[r], a_aux[r]);
        }
#pragma unroll
        for (u32 r = 0; r < BR; ++r) {
            const u32 nn = row0 + r * RPP;
            b_off[r] = nn < tn ? ld_.b_row(nn) : TC_NO_ROW;
        }
    }

    // Copies k in [k0, k0 + 32): A's chunk of pass r to `at` + r * `row_step` bytes, B's to `at` +
    // `b_delta` + r * `row_step` (stages are filled in order: the column state moves by 32 each time).
    __device__ __forceinline__ void load(const L& ld_, u32 at, u32 row_step, u32 b_delta, u32 k0, u32 K) {
        const u32 k = k0 + c * 8u;
        const bool kin = k < K;
#pragma unroll
        for (u32 r = 0; r < AR; ++r) {
            const h16* src = ld_.a_src(a_off[r], a_aux[r], col);
            const bool in = kin && a_off[r] != TC_NO_ROW && (L::A_SRC_NONNULL || src != nullptr);
            tc_put16_if(at + r * row_step, src, in);
        }
#pragma unroll
        for (u32 r = 0; r < BR; ++r) tc_put16_if(at + b_delta + r * row_step, b_base + b_off[r] + k, kin && b_off[r] != TC_NO_ROW);
        ld_.a_col_step(col, TCX_TK);
    }
};

// The fixed-shape tiles' sums, warp tiles of MI x NI m16n8 fragments at rows r0 + 16 i (+ 8) and columns
// c0 + 8 j (+ 1), into `cs` ([BM][BN + TCX_CPAD] floats).
template <u32 MI, u32 NI, u32 BN>
__device__ __forceinline__ void tcx_stage_sums(float* cs, const float (&acc)[MI][NI][4], u32 r0, u32 c0) {
#pragma unroll
    for (u32 i = 0; i < MI; ++i)
#pragma unroll
        for (u32 j = 0; j < NI; ++j) {
            float* const p = cs + (r0 + i * 16u) * (BN + TCX_CPAD) + c0 + j * 8u;
            *(float2*)p = make_float2(acc[i][j][0], acc[i][j][1]);
            *(float2*)(p + 8u * (BN + TCX_CPAD)) = make_float2(acc[i][j][2], acc[i][j][3]);
        }
}

// The epilogue of the sums in `cs` with the launch's activation class.
template <u32 BM, u32 BN, u32 T, typename L>
__device__ __forceinline__ void tcx_epilogue(const L& ld_, const float* cs, u32 tm, u32 tn) {
    const u32 act = ld_.act();
#ifdef KAIROS_ACT_ONLY
    if (KAIROS_ACT_ONLY != KAIROS_ACT_ANY && act != KAIROS_ACT_ONLY) asm volatile("trap;");
    tcx_epilogue_as<KAIROS_ACT_ONLY, BM, BN, T>(ld_, cs, tm, tn);
#else
    if (act == KAIROS_ACT_NONE) tcx_epilogue_as<KAIROS_ACT_NONE, BM, BN, T>(ld_, cs, tm, tn);
    else if (act == KAIROS_ACT_RELU) tcx_epilogue_as<KAIROS_ACT_RELU, BM, BN, T>(ld_, cs, tm, tn);
    else tcx_epilogue_as<KAIROS_ACT_ANY, BM, BN, T>(ld_, cs, tm, tn);
#endif
}

template <u32 BM, u32 BN, u32 WGM, u32 WGN, typename L>
__device__ __forceinline__ void tc_tile_fixed(const L& ld_, u32 tm, u32 tn, u32 K, u32 nstages) {
    constexpr u32 T = WGM * WGN * 32u;
    constexpr u32 WTM = BM / WGM, WTN = BN / WGN;  // warp tile
    constexpr u32 MI = WTM / 16u, NI = WTN / 8u;    // its fragments
    constexpr u32 RPP = T / (TCX_TK / 8u);          // rows one pass of the CTA's chunks covers
    constexpr u32 AR = BM / RPP, BR = BN / RPP;     // chunks per thread and stage of A, of B
    constexpr u32 A_BYTES = BM * TCX_LD * 2u;
    constexpr u32 STAGE_BYTES = tcx_stage_bytes<BM, BN>();
    static_assert(MI >= 1u && NI >= 2u && NI % 2u == 0u, "warp tile of whole ldmatrix.x4 loads");
    static_assert(AR >= 1u && BR >= 1u && BM % RPP == 0u && BN % RPP == 0u, "whole chunk passes");

    const u32 tid = threadIdx.x;
    const u32 warp = tid / 32u, lane = tid % 32u;
    const u32 smem0 = tc_smem_addr(kairos_dyn_smem);
    TcxChunks<AR, BR, RPP, L> chunks(ld_, tid, tm, tn);
    // Rows of TCX_LD halves: a thread's chunk at (row0, c), a pass RPP rows further.
    const u32 dst0 = ((tid / (TCX_TK / 8u)) * TCX_LD + chunks.c * 8u) * 2u;
    auto load = [&](u32 buf, u32 k0) { chunks.load(ld_, smem0 + buf * STAGE_BYTES + dst0, RPP * TCX_LD * 2u, A_BYTES, k0, K); };

    float acc[MI][NI][4];
#pragma unroll
    for (u32 i = 0; i < MI; ++i)
#pragma unroll
        for (u32 j = 0; j < NI; ++j)
#pragma unroll
            for (u32 e = 0; e < 4u; ++e) acc[i][j][e] = 0.0f;

    // This lane's ldmatrix addresses in stage 0 (bytes): A rows of its warp tile (16 per fragment),
    // B columns (pairs of n8 fragments, k contiguous); a k16 step adds 32 bytes.
    const u32 wm = warp / WGN, wn = warp % WGN;
    const u32 a_ld = smem0 + ((wm * WTM + (lane & 15u)) * TCX_LD + (lane >> 4) * 8u) * 2u;
    const u32 b_ld = smem0 + A_BYTES + ((wn * WTN + (lane & 7u) + ((lane >> 4) << 3)) * TCX_LD + ((lane >> 3) & 1u) * 8u) * 2u;

    const u32 stages = (K + TCX_TK - 1u) / TCX_TK;
    for (u32 p = 0; p + 1u < nstages; ++p) {
        if (p < stages) load(p, p * TCX_TK);
        tc_cp_commit();
    }
    u32 cur = 0u, next = nstages - 1u;
    for (u32 st = 0; st < stages; ++st) {
        tc_cp_wait(nstages - 2u);  // stage st has landed (this thread's copies)
        __syncthreads();           // everyone's copies are visible; stage st - 1 is consumed
        const u32 ahead = st + nstages - 1u;
        if (ahead < stages) load(next, ahead * TCX_TK);
        tc_cp_commit();
        next = next + 1u == nstages ? 0u : next + 1u;
        const u32 off = cur * STAGE_BYTES;
        cur = cur + 1u == nstages ? 0u : cur + 1u;
#pragma unroll
        for (u32 kk = 0; kk < TCX_TK / 16u; ++kk) {
            u32 af[MI][4], bf[NI][2];
#pragma unroll
            for (u32 j = 0; j < NI; j += 2u) {
                u32 r4[4];
                tc_ldsm_x4(r4, b_ld + off + kk * 32u + (j / 2u) * 16u * TCX_LD * 2u);
                bf[j][0] = r4[0];
                bf[j][1] = r4[1];
                bf[j + 1u][0] = r4[2];
                bf[j + 1u][1] = r4[3];
            }
#pragma unroll
            for (u32 i = 0; i < MI; ++i) tc_ldsm_x4(af[i], a_ld + off + kk * 32u + i * 16u * TCX_LD * 2u);
            tc_mmas<MI, NI>(acc, af, bf);
        }
    }
    tc_cp_wait_all();  // only empty groups can be left
    __syncthreads();   // every warp is done with the stages (the next logical block refills them)

    const u32 r0 = wm * WTM + (lane >> 2), c0 = wn * WTN + (lane & 3u) * 2u;
    if (tc_dyn_smem_bytes() < BM * (BN + TCX_CPAD) * 4u) {
        tc_store_frags<MI, NI, true>(ld_, acc, r0, c0, MI, NI, tm, tn);
        return;
    }
    // The sums through shared memory (the stages are free now), then the epilogue by runs of 8.
    float* const cs = (float*)kairos_dyn_smem;
    tcx_stage_sums<MI, NI, BN>(cs, acc, r0, c0);
    __syncthreads();
    tcx_epilogue<BM, BN, T>(ld_, cs, tm, tn);
    __syncthreads();  // the sums are read before the next logical block refills the stages
}

// ---------------------------------------------------------------------------------------------
// Hopper warpgroup MMA (wgmma) for 64 x 64 tiles on 128 threads, compiled where the target is
// sm_90a (kairos_cuda::nvrtc asks NVRTC for it on sm_90 devices; elsewhere, and with
// -DKAIROS_NO_WGMMA, they stay on the generic mma.sync engine). The loads are the fixed tiles'
// k32 cp.async chunks through the loader, but each stage is laid out as wgmma's K-major core
// matrices without swizzle (8 rows x 16 bytes, 128 contiguous bytes; the four k chunks of an 8-row
// group side by side: leading byte offset 128 along K, stride byte offset 512 between row groups),
// and the warpgroup multiplies straight from shared memory: no ldmatrix, no operand fragments in
// registers, only the 32 accumulators. Measured on an H200 with a standalone copy (2026-11-29):
// the multiplications alone ran at 720 TFLOPS on 4096^3 (the whole kernel ~160: the cp.async loads
// bound it; cuBLAS, with TMA, 760), and at batch 1 the products are bound by the few warps per
// SM their few tiles give (one per scheduler): each k32 stage costs ~0.4 us however deep the
// pipeline (tile_mma_planned says where this pays).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(KAIROS_NO_WGMMA)
#define KAIROS_WGMMA 1
#endif

#ifdef KAIROS_WGMMA
// A shared-memory matrix descriptor (no swizzle): start address, leading (K) and stride (M/N)
// byte offsets, each in 16-byte units.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)((lbo & 0x3ffffu) >> 4) << 16) | ((u64)((sbo & 0x3ffffu) >> 4) << 32);
}
__device__ __forceinline__ void wg_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async one.
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across an asynchronous MMA.
template <u32 R>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
    for (u32 i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wg_mma_m64n64(float* d, u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}

// One logical block of a 64 x 64 tile on one warpgroup's wgmma (see above). Accumulator layout of
// m64n64k16 for thread t: rows 16 (t / 32) + (t % 32) / 4 (+ 8), columns 8 j + 2 (t % 4) (+ 1) in
// registers 4 j .. 4 j + 3: mma.sync's m16n8 fragments side by side, so the epilogues take them as
// a [1][8][4] warp tile.
template <typename L>
__device__ __forceinline__ void tc_tile_wgmma64(const L& ld_, u32 tm, u32 tn, u32 K, u32 nstages) {
    constexpr u32 BM = 64u, BN = 64u, T = 128u;
    constexpr u32 NJ = BN / 8u;
    constexpr u32 RPP = T / (TCX_TK / 8u);     // 32 rows per pass of the CTA's chunks
    constexpr u32 PASS_BYTES = RPP / 8u * 512u;  // RPP / 8 row groups
    constexpr u32 AR = BM / RPP, BR = BN / RPP;
    constexpr u32 A_BYTES = BM * TCX_TK * 2u;
    constexpr u32 STAGE_BYTES = (BM + BN) * TCX_TK * 2u;

    const u32 tid = threadIdx.x;
    const u32 warp = tid / 32u, lane = tid % 32u;
    const u32 smem0 = tc_smem_addr(kairos_dyn_smem);
    TcxChunks<AR, BR, RPP, L> chunks(ld_, tid, tm, tn);
    // Core matrix (row group g, chunk c) at (4 g + c) * 128 bytes, row r % 8 at 16 (r % 8).
    const u32 row0 = tid / 4u;
    const u32 dst0 = ((row0 / 8u) * 4u + chunks.c) * 128u + (row0 % 8u) * 16u;
    auto load = [&](u32 buf, u32 k0) { chunks.load(ld_, smem0 + buf * STAGE_BYTES + dst0, PASS_BYTES, A_BYTES, k0, K); };

    float acc[1][NJ][4];
#pragma unroll
    for (u32 j = 0; j < NJ; ++j)
#pragma unroll
        for (u32 e = 0; e < 4u; ++e) acc[0][j][e] = 0.0f;
    float* const d = &acc[0][0][0];

    const u32 stages = (K + TCX_TK - 1u) / TCX_TK;
    for (u32 p = 0; p + 1u < nstages; ++p) {
        if (p < stages) load(p, p * TCX_TK);
        tc_cp_commit();
    }
    u32 cur = 0u, next = nstages - 1u;
    for (u32 st = 0; st < stages; ++st) {
        tc_cp_wait(nstages - 2u);  // stage st has landed (this thread's copies)
        wg_fence_proxy();
        __syncthreads();  // everyone's copies are visible; the MMAs of stage st - 1 have finished
        const u32 ahead = st + nstages - 1u;
        if (ahead < stages) load(next, ahead * TCX_TK);
        tc_cp_commit();
        next = next + 1u == nstages ? 0u : next + 1u;
        const u32 a_at = smem0 + cur * STAGE_BYTES;
        const u32 b_at = a_at + A_BYTES;
        cur = cur + 1u == nstages ? 0u : cur + 1u;
        wg_fence_regs<NJ * 4u>(d);
        wg_arrive();
#pragma unroll
        for (u32 kk = 0; kk < TCX_TK / 16u; ++kk)
            wg_mma_m64n64(d, wg_desc(a_at + kk * 256u, 128u, 512u), wg_desc(b_at + kk * 256u, 128u, 512u));
        wg_commit();
        wg_wait_all();  // the stage is read before the barrier of the next one lets it refill
        wg_fence_regs<NJ * 4u>(d);
    }
    tc_cp_wait_all();  // only empty groups can be left
    __syncthreads();   // the stages are free (the next logical block refills them)

    const u32 r0 = warp * 16u + (lane >> 2);
    const u32 c0 = (lane & 3u) * 2u;
    if (tc_dyn_smem_bytes() < BM * (BN + TCX_CPAD) * 4u) {
        tc_store_frags<1u, NJ, true>(ld_, acc, r0, c0, 1u, NJ, tm, tn);
        return;
    }
    float* const cs = (float*)kairos_dyn_smem;
    tcx_stage_sums<1u, NJ, BN>(cs, acc, r0, c0);
    __syncthreads();
    tcx_epilogue<BM, BN, T>(ld_, cs, tm, tn);
    __syncthreads();  // the sums are read before the next logical block refills the stages
}
#endif  // KAIROS_WGMMA

// Whether the fixed-shape tiles can take this product: 16-byte operand chunks, B with k
// contiguous, 32-bit offsets, and room for two stages of `stage_bytes`.
template <typename L>
__device__ __forceinline__ u32 tcx_stages(const L& ld_, u32 stage_bytes) {
    if (!ld_.a_vec || !ld_.b_vec || ld_.b_kn || !ld_.fast_ok) return 0u;
    const u32 n = min(TC_STAGES_MAX, tc_dyn_smem_bytes() / stage_bytes);
    return n >= 2u ? n : 0u;
}

// One logical block of the plan's tile tile_m x tile_n (clipped to tm x tn): a fixed-shape tile
// where the entry has one for this tile and CTA size, else tile_mma.
template <u32 CLS, typename L>
__device__ __forceinline__ void tile_mma_planned(L& ld_, u32 tile_m, u32 tile_n, u32 tm, u32 tn, u32 K) {
    if constexpr (CLS == TC_STD) {
        if (blockDim.x == 256u) {
            if (tile_m == 128u && tile_n == 128u) {
                if (const u32 n = tcx_stages(ld_, tcx_stage_bytes<128, 128>())) return tc_tile_fixed<128, 128, 2, 4>(ld_, tm, tn, K, n);
            } else if (tile_m == 64u && tile_n == 128u) {
                if (const u32 n = tcx_stages(ld_, tcx_stage_bytes<64, 128>())) return tc_tile_fixed<64, 128, 2, 4>(ld_, tm, tn, K, n);
            } else if (tile_m == 128u && tile_n == 64u) {
                if (const u32 n = tcx_stages(ld_, tcx_stage_bytes<128, 64>())) return tc_tile_fixed<128, 64, 4, 2>(ld_, tm, tn, K, n);
            }
        }
    }
#ifdef KAIROS_WGMMA
    // wgmma where it measured faster than the mma.sync engine: 64 x 64 tiles on 128 threads (the
    // narrow entries: kairos_kernels::source::entry_key). On an H200, 197-row products of ViT-B/16
    // and BERT shapes: 197 x 768 x 768 42.5 -> 17.3 us, 12 heads of 197 x 197 x 64 14.2 -> 8.7 us.
    // On the 256-thread fixed tiles it did not pay: 128 x 128 beat the mma.sync tile per shape
    // (45.7 -> 32.9 us) but 64 x 128 and 128 x 64 lost (17.2 -> 19.7 us), and with 128 x 128 and
    // 64 x 64 (two warpgroups splitting K) on wgmma the corpus's convolutional networks ran up to
    // 16% slower at batch 1 (docs/models.md).
    if constexpr (CLS == TC_NARROW) {
        if (blockDim.x == 128u && tile_m == 64u && tile_n == 64u) {
            if (const u32 n = tcx_stages(ld_, tcw_stage_bytes<64, 64>())) return tc_tile_wgmma64(ld_, tm, tn, K, n);
        }
    }
#endif
    tile_mma<CLS>(ld_, tm, tn, K);
}

// ---------------------------------------------------------------------------------------------
// Split-K (kairos_ir::plan: `split_k` of conv2d and gemm). A logical block is one K slice
// [kb, kb + len) of one tile: the engines walk K' = len as if it were the whole product, through
// a loader that shifts every reduction index by kb, and the results leave raw (f32, no alpha,
// bias, residual or activation) into the slice's part of the workspace; the splitk_sum kernel
// adds the slices in order and applies the epilogue. kb is a multiple of 32 (plan::split_k_len),
// so 16-byte chunks along K stay 16-byte chunks and every alignment test of the base loader holds.

// The tensor-core engine's loaders (fp16).
template <typename L>
struct SplitKTcLoader {
    const L& in;
    u32 kb;
    float* ws;  // the workspace at (slice, tile origin)
    u32 ws_ld;  // its row stride (the product's n)
    bool a_vec, b_vec, b_kn, a_k_fastest, b_k_fastest, fast_ok;

    typedef typename L::ACol ACol;
    static constexpr bool A_SRC_NONNULL = L::A_SRC_NONNULL;
    __device__ void a_row(u32 mm, u32& off, u32& aux) const { in.a_row(mm, off, aux); }
    __device__ ACol a_col_at(u32 k) const { return in.a_col_at(kb + k); }
    __device__ void a_col_step(ACol& c, u32 dk) const { in.a_col_step(c, dk); }
    __device__ const h16* a_src(u32 off, u32 aux, const ACol& c) const { return in.a_src(off, aux, c); }
    __device__ const h16* b_base() const { return in.b_base() + (u64)kb * in.b_kstride(); }
    __device__ u32 b_row(u32 nn) const { return in.b_row(nn); }
    __device__ u64 b_kstride() const { return in.b_kstride(); }

    __device__ auto a_col(u32 k) const { return in.a_col(kb + k); }
    template <typename C>
    __device__ const h16* a_ptr(u32 mm, const C& c) const {
        return in.a_ptr(mm, c);
    }
    __device__ h16 ah(u32 mm, u32 k) const { return in.ah(mm, kb + k); }
    __device__ const h16* b_ptr(u32 k, u32 nn) const { return in.b_ptr(kb + k, nn); }
    __device__ h16 bh(u32 k, u32 nn) const { return in.bh(kb + k, nn); }
    __device__ void store(u32 mm, u32 nn, float v) const { ws[(u64)mm * ws_ld + nn] = v; }
    // Raw sums: no activation (the splitk_sum kernel applies the epilogue).
    __device__ u32 act() const { return KAIROS_ACT_NONE; }
    __device__ u32 bias2(u32, bool) const { return 0u; }
    __device__ u32 res2(u32, u32, bool) const { return 0u; }
    template <u32 ACT>
    __device__ void store8(u32 mm, u32 nn, const float (&v)[8], u32 n) const {
        float* p = ws + (u64)mm * ws_ld + nn;
        for (u32 e = 0; e < n; ++e) p[e] = v[e];
    }
    template <u32 ACT>
    __device__ void store2(u32 mm, u32 nn, float v0, float v1, bool two, u32, u32) const {
        float* p = ws + (u64)mm * ws_ld + nn;
        p[0] = v0;
        if (two) p[1] = v1;
    }
};

template <typename L>
__device__ __forceinline__ SplitKTcLoader<L> split_k_tc(const L& in, u32 kb, float* ws, u32 ws_ld) {
    return SplitKTcLoader<L>{in, kb, ws, ws_ld, in.a_vec, in.b_vec, in.b_kn, in.a_k_fastest, in.b_k_fastest, in.fast_ok};
}

// The SIMT engine's loaders (f32).
template <typename L>
struct SplitKSimtLoader {
    const L& in;
    u32 kb;
    float* ws;
    u32 ws_ld;
    bool a_k_fastest, b_k_fastest;

    __device__ float a(u32 mm, u32 k) const { return in.a(mm, kb + k); }
    __device__ float b(u32 k, u32 nn) const { return in.b(kb + k, nn); }
    __device__ void store(u32 mm, u32 nn, float v) const { ws[(u64)mm * ws_ld + nn] = v; }
};

template <typename L>
__device__ __forceinline__ SplitKSimtLoader<L> split_k_simt(const L& in, u32 kb, float* ws, u32 ws_ld) {
    return SplitKSimtLoader<L>{in, kb, ws, ws_ld, in.a_k_fastest, in.b_k_fastest};
}

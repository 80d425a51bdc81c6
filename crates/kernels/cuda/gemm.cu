// gemm: batched strided matrix product C = act(alpha * A B + bias + residual)
// (kairos_ir::plan::GemmParams). Strides are in elements; C and the residual have unit column
// stride. One logical block is one (batch, tile row, tile column) on the tile engine; operands
// are staged in the order that makes their contiguous index the fast one, so both [m][k] and
// [k][m] layouts of A (and [k][n] / [n][k] of B) load coalesced. fp16 runs on the tensor-core
// engine (16-byte cp.async loads where strides and alignment allow; blocks of at most 8 rows
// stream B along K on the engine's small-M path), f32 on the SIMT engine.
// Split-K (split_k > 1, the gemm_sk_* entries): block b is K slice b / (batches * m_tiles * n_tiles) of the tile above,
// written raw into the f32 workspace [split_k][batches][m][n] at `c` (tile.cuh: SplitK*Loader).

#include "kairos/tile.cuh"

struct GemmArgs {
    u64 a, b, bias, res, c;  // bias and res are 0 when absent
    u64 a_s0, a_s1, a_sm, a_sk;
    u64 b_s0, b_s1, b_sk, b_sn;
    u64 c_s0, c_s1, c_sm;
    u64 r_s0, r_s1, r_sm;
    u32 batch0, batch1, m, n, k;
    float alpha;
    u32 act, tile_m, tile_n, split_k;
    u32 k_split_len;  // K per slice (plan::split_k_len), when split_k > 1
};
static_assert(sizeof(GemmArgs) == 200, "GemmArgs layout");

template <typename T>
struct GemmTileLoader {
    const GemmArgs& A;
    const T* pa;     // A at (b0, b1, m0, 0)
    const T* pb;     // B at (b0, b1, 0, n0)
    T* pc;           // C at (b0, b1, m0, n0)
    const T* pr;     // residual at (b0, b1, m0, n0), or null
    const T* pbias;  // bias + n0, or null
    bool a_k_fastest, b_k_fastest;

    __device__ float a(u32 mm, u32 k) const { return ld(pa + mm * A.a_sm + k * A.a_sk); }
    __device__ float b(u32 k, u32 nn) const { return ld(pb + k * A.b_sk + nn * A.b_sn); }
    __device__ void store(u32 mm, u32 nn, float v) const {
        v *= A.alpha;
        if (pbias) v += ld(pbias + nn);
        if (pr) v += ld(pr + mm * A.r_sm + nn);
        st(pc + mm * A.c_sm + nn, kairos_act(A.act, v));
    }
};

// The tensor-core engine's loader (fp16): B is staged [n][k] when k is its contiguous index
// (weights stored [n][k], K^T of attention), [k][n] when n is (b_kn).
struct GemmTcLoader {
    const GemmArgs& A;
    const h16* pa;
    const h16* pb;
    h16* pc;
    const h16* pr;
    const h16* pbias;
    bool a_vec, b_vec, b_kn, a_k_fastest, b_k_fastest, fast_ok;

    // Fast loads (tile.cuh): A's column state is k itself.
    typedef u32 ACol;
    static constexpr bool A_SRC_NONNULL = true;
    __device__ void a_row(u32 mm, u32& off, u32& aux) const {
        off = mm * (u32)A.a_sm;
        aux = 0u;
    }
    __device__ u32 a_col_at(u32 k) const { return k; }
    __device__ void a_col_step(u32& k, u32 dk) const { k += dk; }
    __device__ const h16* a_src(u32 off, u32, u32 k) const { return pa + off + k; }
    __device__ const h16* b_base() const { return pb; }
    __device__ u32 b_row(u32 nn) const { return nn * (u32)A.b_sn; }
    __device__ u64 b_kstride() const { return A.b_sk; }

    __device__ u32 a_col(u32 k) const { return k; }
    __device__ const h16* a_ptr(u32 mm, u32 k) const { return pa + mm * A.a_sm + k; }
    __device__ h16 ah(u32 mm, u32 k) const { return pa[mm * A.a_sm + k * A.a_sk]; }
    __device__ const h16* b_ptr(u32 k, u32 nn) const { return pb + k * A.b_sk + nn * A.b_sn; }
    __device__ h16 bh(u32 k, u32 nn) const { return pb[k * A.b_sk + nn * A.b_sn]; }
    __device__ void store(u32 mm, u32 nn, float v) const {
        v *= A.alpha;
        if (pbias) v += ld(pbias + nn);
        if (pr) v += ld(pr + mm * A.r_sm + nn);
        st(pc + mm * A.c_sm + nn, kairos_act(A.act, v));
    }
    // The paired epilogue (tile.cuh, tc_store_frags): the bias and residual pairs of outputs
    // (mm, nn) and, when `two`, (mm, nn + 1) as raw halves, then the store of both with those
    // addends and the activation of class ACT (KAIROS_ACT_NONE, _RELU or _ANY: common.cuh,
    // kairos_act_tagged); paired loads and stores where aligned.
    __device__ u32 act() const { return A.act; }
    __device__ u32 bias2(u32 nn, bool two) const { return pbias ? ld_pair_bits(pbias + nn, two) : 0u; }
    __device__ u32 res2(u32 mm, u32 nn, bool two) const { return pr ? ld_pair_bits(pr + mm * A.r_sm + nn, two) : 0u; }
    // Outputs (mm, nn .. nn + n), n <= 8, with the same epilogue (common.cuh, store8_h16).
    template <u32 ACT>
    __device__ void store8(u32 mm, u32 nn, const float (&v)[8], u32 n) const {
        store8_h16<ACT>(pc + mm * A.c_sm + nn, pbias ? pbias + nn : nullptr, pr ? pr + mm * A.r_sm + nn : nullptr, A.alpha, A.act, v,
                        n);
    }
    template <u32 ACT>
    __device__ void store2(u32 mm, u32 nn, float v0, float v1, bool two, u32 bias, u32 res) const {
        v0 *= A.alpha;
        v1 *= A.alpha;
        if (pbias) add_pair_bits(bias, v0, v1);
        if (pr) add_pair_bits(res, v0, v1);
        st_pair(pc + mm * A.c_sm + nn, two, kairos_act_tagged<ACT>(A.act, v0), kairos_act_tagged<ACT>(A.act, v1));
    }
};

// One tile, or with `ws` its K slice [kb, kb + kn) into the workspace: the tensor-core engine for
// fp16, the SIMT one for f32.
template <typename T, u32 CLS, bool SPLIT>
__device__ __forceinline__ void gemm_tile(const GemmArgs& A, const T* a, const T* b, T* c, const T* r, const T* bias, u32 tm,
                                          u32 tn, u32 kb, u32 kn, float* ws) {
    const bool a_k_fastest = A.a_sk == 1 || A.a_sm != 1;
    const bool b_k_fastest = A.b_sk == 1 && A.b_sn != 1;
    if constexpr (IsHalf<T>::value) {
        const bool a_vec = A.a_sk == 1 && A.a_sm % 8 == 0 && A.a_s0 % 8 == 0 && A.a_s1 % 8 == 0 && (A.a & 15ull) == 0 &&
                           A.k % 8u == 0u;
        const bool b_kn = A.b_sk != 1 && A.b_sn == 1;
        const bool b_vec = b_kn ? (A.b_sk % 8 == 0 && A.b_s0 % 8 == 0 && A.b_s1 % 8 == 0 && (A.b & 15ull) == 0 &&
                                   A.tile_n % 8u == 0u)
                                : (A.b_sk == 1 && A.b_sn % 8 == 0 && A.b_s0 % 8 == 0 && A.b_s1 % 8 == 0 &&
                                   (A.b & 15ull) == 0 && A.k % 8u == 0u);
        // Row offsets within a tile (and B's within a stage of at most TC_TK_MAX k) fit 32 bits.
        const u64 lim = 1ull << 32;
        const bool fast_ok = (u64)A.tile_m * A.a_sm < lim &&
                             (b_kn ? (u64)TC_TK_MAX * A.b_sk + A.tile_n < lim : (u64)A.tile_n * A.b_sn < lim);
        GemmTcLoader L{A, a, b, c, r, bias, a_vec, b_vec, b_kn, a_k_fastest, b_k_fastest, fast_ok};
        if constexpr (SPLIT) {
            auto S = split_k_tc(L, kb, ws, A.n);
            tile_mma_planned<CLS>(S, A.tile_m, A.tile_n, tm, tn, kn);
        } else {
            tile_mma_planned<CLS>(L, A.tile_m, A.tile_n, tm, tn, A.k);
        }
    } else {
        __shared__ TileSmem smem;
        GemmTileLoader<T> L{A, a, b, c, r, bias, a_k_fastest, b_k_fastest};
        if constexpr (SPLIT) {
            auto S = split_k_simt(L, kb, ws, A.n);
            tile_gemm(S, smem, tm, tn, kn);
        } else {
            tile_gemm(L, smem, tm, tn, A.k);
        }
    }
}

// SPLIT: the _sk entries (split_k > 1), compiled apart so the split path costs the whole-K
// kernels no registers.
template <typename T, u32 CLS = TC_STD, bool SPLIT = false>
__device__ __forceinline__ void gemm_body(const KairosProto& P, const GemmArgs& A) {
    const u32 m_tiles = (A.m + A.tile_m - 1) / A.tile_m;
    const u32 n_tiles = (A.n + A.tile_n - 1) / A.tile_n;
    const bool tiled = A.tile_m <= TILE_MAX && A.tile_n <= TILE_MAX;
    const u32 batches = A.batch0 * A.batch1;
    const u32 per_slice = batches * m_tiles * n_tiles;
    kairos_run(P, [&](u32 blk) {
        u32 slice = 0u;
        if constexpr (SPLIT) {
            slice = blk / per_slice;
            blk %= per_slice;
        }
        const u32 bb = blk / (m_tiles * n_tiles);
        const u32 rest = blk % (m_tiles * n_tiles);
        const u32 b0 = bb / A.batch1;
        const u32 b1 = bb % A.batch1;
        const u32 m0 = (rest / n_tiles) * A.tile_m;
        const u32 n0 = (rest % n_tiles) * A.tile_n;
        const u32 tm = min(A.tile_m, A.m - m0);
        const u32 tn = min(A.tile_n, A.n - n0);
        const T* a = (const T*)A.a + b0 * A.a_s0 + b1 * A.a_s1 + m0 * A.a_sm;
        const T* b = (const T*)A.b + b0 * A.b_s0 + b1 * A.b_s1 + n0 * A.b_sn;
        T* c = (T*)A.c + b0 * A.c_s0 + b1 * A.c_s1 + m0 * A.c_sm + n0;
        const T* r = A.res ? (const T*)A.res + b0 * A.r_s0 + b1 * A.r_s1 + m0 * A.r_sm + n0 : (const T*)0;
        const T* bias = A.bias ? (const T*)A.bias + n0 : (const T*)0;
        // Split-K: this block's K slice and its tile of the workspace.
        const u32 kb = SPLIT ? slice * A.k_split_len : 0u;
        const u32 kn = SPLIT ? min(A.k_split_len, A.k - kb) : A.k;
        float* ws = SPLIT ? (float*)A.c + (((u64)slice * batches + bb) * A.m + m0) * A.n + n0 : (float*)0;
        if (tiled) {
            gemm_tile<T, CLS, SPLIT>(A, a, b, c, r, bias, tm, tn, kb, kn, ws);
        } else {
            GemmTileLoader<T> L{A, a, b, c, r, bias, A.a_sk == 1 || A.a_sm != 1, A.b_sk == 1 && A.b_sn != 1};
            for (u32 i = threadIdx.x; i < tm * tn; i += blockDim.x) {
                const u32 mm = i / tn;
                const u32 nn = i % tn;
                float acc = 0.0f;
                for (u32 k = kb; k < kb + kn; ++k) acc = fmaf(L.a(mm, k), L.b(k, nn), acc);
                if constexpr (SPLIT) ws[(u64)mm * A.n + nn] = acc;
                else L.store(mm, nn, acc);
            }
        }
    });
}

KAIROS_KERNELS_TC(gemm, GemmArgs, gemm_body)

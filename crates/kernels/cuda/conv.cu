// conv2d and dwconv2d: convolutions on NHWC activations (kairos_ir::plan::Conv2dParams).
//
// conv2d with groups == 1 is an implicit GEMM on the tile engine: A[m][k] is the input patch of
// output pixel m (k runs over kernel_h, kernel_w, in_c with in_c fastest, matching the weight
// layout [out_c][kernel_h][kernel_w][in_c]), B[k][n] = weights[n][k]. fp16 runs on the tensor-core
// engine (16-byte cp.async loads when in_c and the pixel stride are multiples of 8, element loads
// otherwise, e.g. a 3-channel stem; tiles of at most 8 output pixels, e.g. 1x1 convolutions on
// 1x1 maps, stream the weights on the engine's small-M path), f32 on the SIMT engine. Grouped convolutions and
// tiles larger than the engine's maximum take a direct path, one output per thread.
// dwconv2d (weights [kernel_h][kernel_w][c]) is direct, channel fastest for coalescing.
// Epilogue: y = act(acc + bias[n] + residual[m][n]).
// Split-K (split_k > 1, groups == 1, the conv2d_sk_* entries): block b is reduction slice b / (m_tiles * n_tiles) of the tile
// above, written raw into the f32 workspace [split_k][M][out_c] at `out` (tile.cuh: SplitK*Loader).

#include "kairos/tile.cuh"

struct ConvArgs {
    u64 in, w, bias, res, out;  // bias and res are 0 when absent
    u32 batch, in_h, in_w, in_c, out_h, out_w, out_c;
    u32 kh, kw, sh, sw, ph, pw, dh, dw, groups;
    u32 in_ps, out_ps, res_ps;
    u32 act, tile_m, tile_n;
    u32 split_k, k_split_len;  // reduction slices and their length (plan::split_k_len)
};
static_assert(sizeof(ConvArgs) == 136, "ConvArgs layout");

template <typename T>
__device__ __forceinline__ float conv_epilogue(const ConvArgs& A, u64 m, u32 n, float v) {
    if (A.bias) v += ld((const T*)A.bias + n);
    if (A.res) v += ld((const T*)A.res + m * A.res_ps + n);
    return kairos_act(A.act, v);
}

template <typename T>
struct ConvTileLoader {
    const ConvArgs& A;
    const int* ih0;
    const int* iw0;
    const u32* img;
    u32 K, m0, n0;
    bool a_k_fastest, b_k_fastest;

    __device__ float a(u32 mm, u32 k) const {
        const u32 ci = k % A.in_c;
        const u32 t = k / A.in_c;
        const u32 kx = t % A.kw;
        const u32 ky = t / A.kw;
        const int ih = ih0[mm] + (int)(ky * A.dh);
        const int iw = iw0[mm] + (int)(kx * A.dw);
        if (ih < 0 || iw < 0 || ih >= (int)A.in_h || iw >= (int)A.in_w) return 0.0f;
        return ld((const T*)A.in + (u64)(img[mm] + (u32)ih * A.in_w + (u32)iw) * A.in_ps + ci);
    }
    __device__ float b(u32 k, u32 nn) const { return ld((const T*)A.w + (u64)(n0 + nn) * K + k); }
    __device__ void store(u32 mm, u32 nn, float v) const {
        const u64 m = m0 + mm;
        const u32 n = n0 + nn;
        st((T*)A.out + m * A.out_ps + n, conv_epilogue<T>(A, m, n, v));
    }
};

// The tensor-core engine's loader (fp16). A's 8-element chunks along k stay inside one kernel tap
// when in_c % 8 == 0, so they are 16 contiguous bytes of one input pixel (or padding).
struct ConvTcLoader {
    const ConvArgs& A;
    const int* ih0;
    const int* iw0;
    const u32* img;
    u32 K, m0, n0;
    bool a_vec, b_vec, b_kn, a_k_fastest, b_k_fastest, fast_ok;

    // Fast loads (tile.cuh). A row's offset is that of its output pixel's window origin (input
    // row ih0, column iw0, possibly in the padding), aux packs ih0 and iw0 as 16-bit integers;
    // the column state is the kernel tap and channel of k, stepped without dividing.
    struct ACol {
        int dy, dx, coff;  // tap offsets in rows and columns; (dy * in_w + dx) * in_ps + ci
        u32 ci, kx, ky;
    };
    static constexpr bool A_SRC_NONNULL = false;  // null in the padding
    __device__ void a_row(u32 mm, u32& off, u32& aux) const {
        const int ih = ih0[mm];
        const int iw = iw0[mm];
        off = (u32)(((int)img[mm] + ih * (int)A.in_w + iw) * (int)A.in_ps);
        aux = ((u32)ih & 0xffffu) | ((u32)iw << 16);
    }
    __device__ void a_col_fill(ACol& c) const {
        c.dy = (int)(c.ky * A.dh);
        c.dx = (int)(c.kx * A.dw);
        c.coff = (c.dy * (int)A.in_w + c.dx) * (int)A.in_ps + (int)c.ci;
    }
    __device__ ACol a_col_at(u32 k) const {
        ACol c;
        const u32 t = k / A.in_c;
        c.ci = k - t * A.in_c;
        c.kx = t % A.kw;
        c.ky = t / A.kw;
        a_col_fill(c);
        return c;
    }
    __device__ void a_col_step(ACol& c, u32 dk) const {
        c.ci += dk;
        while (c.ci >= A.in_c) {
            c.ci -= A.in_c;
            if (++c.kx == A.kw) {
                c.kx = 0u;
                ++c.ky;
            }
        }
        a_col_fill(c);
    }
    __device__ const h16* a_src(u32 off, u32 aux, const ACol& c) const {
        const int ih = (int)(short)(aux & 0xffffu) + c.dy;
        const int iw = (int)(short)(aux >> 16) + c.dx;
        if ((u32)ih >= A.in_h || (u32)iw >= A.in_w) return (const h16*)0;
        return (const h16*)A.in + (i64)((int)off + c.coff);
    }
    __device__ const h16* b_base() const { return (const h16*)A.w + (u64)n0 * K; }
    __device__ u32 b_row(u32 nn) const { return nn * K; }
    __device__ u64 b_kstride() const { return 1ull; }

    // The kernel tap (row and column offsets) and channel of reduction index k.
    struct Col {
        int dy, dx;
        u32 ci;
    };
    __device__ Col a_col(u32 k) const {
        const u32 t = k / A.in_c;
        return Col{(int)((t / A.kw) * A.dh), (int)((t % A.kw) * A.dw), k - t * A.in_c};
    }
    __device__ const h16* a_ptr(u32 mm, const Col& c) const {
        const int ih = ih0[mm] + c.dy;
        const int iw = iw0[mm] + c.dx;
        if (ih < 0 || iw < 0 || ih >= (int)A.in_h || iw >= (int)A.in_w) return (const h16*)0;
        return (const h16*)A.in + (u64)(img[mm] + (u32)ih * A.in_w + (u32)iw) * A.in_ps + c.ci;
    }
    __device__ h16 ah(u32 mm, u32 k) const {
        const u32 ci = k % A.in_c;
        const u32 t = k / A.in_c;
        const u32 kx = t % A.kw;
        const u32 ky = t / A.kw;
        const int ih = ih0[mm] + (int)(ky * A.dh);
        const int iw = iw0[mm] + (int)(kx * A.dw);
        if (ih < 0 || iw < 0 || ih >= (int)A.in_h || iw >= (int)A.in_w) return (h16)0;
        return ((const h16*)A.in)[(u64)(img[mm] + (u32)ih * A.in_w + (u32)iw) * A.in_ps + ci];
    }
    __device__ const h16* b_ptr(u32 k, u32 nn) const { return (const h16*)A.w + (u64)(n0 + nn) * K + k; }
    __device__ h16 bh(u32 k, u32 nn) const { return *b_ptr(k, nn); }
    __device__ void store(u32 mm, u32 nn, float v) const {
        const u64 m = m0 + mm;
        const u32 n = n0 + nn;
        st((h16*)A.out + m * A.out_ps + n, conv_epilogue<h16>(A, m, n, v));
    }
    // Outputs (mm, nn) and, when `two`, (mm, nn + 1), the activation of class ACT (KAIROS_ACT_NONE,
    // _RELU or _ANY: common.cuh, kairos_act_tagged): paired loads and stores where aligned.
    __device__ u32 act() const { return A.act; }
    __device__ u32 bias2(u32 nn, bool two) const { return A.bias ? ld_pair_bits((const h16*)A.bias + n0 + nn, two) : 0u; }
    __device__ u32 res2(u32 mm, u32 nn, bool two) const {
        return A.res ? ld_pair_bits((const h16*)A.res + (u64)(m0 + mm) * A.res_ps + n0 + nn, two) : 0u;
    }
    template <u32 ACT>
    __device__ void store8(u32 mm, u32 nn, const float (&v)[8], u32 n) const {
        const u64 m = m0 + mm;
        const u32 c = n0 + nn;
        store8_h16<ACT>((h16*)A.out + m * A.out_ps + c, A.bias ? (const h16*)A.bias + c : nullptr,
                        A.res ? (const h16*)A.res + m * A.res_ps + c : nullptr, 1.0f, A.act, v, n);
    }
    template <u32 ACT>
    __device__ void store2(u32 mm, u32 nn, float v0, float v1, bool two, u32 bias, u32 res) const {
        const u64 m = m0 + mm;
        const u32 n = n0 + nn;
        if (A.bias) add_pair_bits(bias, v0, v1);
        if (A.res) add_pair_bits(res, v0, v1);
        st_pair((h16*)A.out + m * A.out_ps + n, two, kairos_act_tagged<ACT>(A.act, v0), kairos_act_tagged<ACT>(A.act, v1));
    }
};

// One tile of a groups == 1 convolution, or with `ws` its reduction slice [kb, kb + kn) into the
// workspace: the tensor-core engine for fp16, the SIMT one for f32.
template <typename T, u32 CLS, bool SPLIT>
__device__ __forceinline__ void conv_tile(const ConvArgs& A, u32 m0, u32 n0, u32 tm, u32 tn, u32 kb, u32 kn, float* ws) {
    __shared__ int s_ih0[TILE_MAX];
    __shared__ int s_iw0[TILE_MAX];
    __shared__ u32 s_img[TILE_MAX];
    for (u32 mm = threadIdx.x; mm < tm; mm += blockDim.x) {
        const u32 m = m0 + mm;
        const u32 ow = m % A.out_w;
        const u32 t = m / A.out_w;
        const u32 oh = t % A.out_h;
        const u32 ni = t / A.out_h;
        s_ih0[mm] = (int)(oh * A.sh) - (int)A.ph;
        s_iw0[mm] = (int)(ow * A.sw) - (int)A.pw;
        s_img[mm] = ni * A.in_h * A.in_w;
    }
    __syncthreads();
    const u32 K = A.kh * A.kw * A.in_c;
    if constexpr (IsHalf<T>::value) {
        const bool a_vec = A.in_c % 8u == 0u && A.in_ps % 8u == 0u && (A.in & 15ull) == 0ull;
        const bool b_vec = K % 8u == 0u && (A.w & 15ull) == 0ull;
        // Input offsets as 32-bit integers, rows and columns as 16-bit ones, weights below 2^32.
        const bool fast_ok = (u64)A.batch * A.in_h * A.in_w * A.in_ps < (1ull << 31) && A.in_h < 32768u &&
                             A.in_w < 32768u && (u64)A.out_c * K < (1ull << 32);
        ConvTcLoader L{A, s_ih0, s_iw0, s_img, K, m0, n0, a_vec, b_vec, false, true, true, fast_ok};
        if constexpr (SPLIT) {
            auto S = split_k_tc(L, kb, ws, A.out_c);
            tile_mma_planned<CLS>(S, A.tile_m, A.tile_n, tm, tn, kn);
        } else {
            tile_mma_planned<CLS>(L, A.tile_m, A.tile_n, tm, tn, K);
        }
    } else {
        __shared__ TileSmem smem;
        ConvTileLoader<T> L{A, s_ih0, s_iw0, s_img, K, m0, n0, true, true};
        if constexpr (SPLIT) {
            auto S = split_k_simt(L, kb, ws, A.out_c);
            tile_gemm(S, smem, tm, tn, kn);
        } else {
            tile_gemm(L, smem, tm, tn, K);
        }
    }
}

// One output of a (possibly grouped) convolution, computed directly.
template <typename T>
__device__ __forceinline__ float conv_direct(const ConvArgs& A, u32 m, u32 n) {
    const u32 ow = m % A.out_w;
    const u32 t = m / A.out_w;
    const u32 oh = t % A.out_h;
    const u32 ni = t / A.out_h;
    const u32 cin_g = A.in_c / A.groups;
    const u32 cout_g = A.out_c / A.groups;
    const u32 c0 = (n / cout_g) * cin_g;
    const T* w = (const T*)A.w + (u64)n * A.kh * A.kw * cin_g;
    float acc = 0.0f;
    for (u32 ky = 0; ky < A.kh; ++ky) {
        const int ih = (int)(oh * A.sh + ky * A.dh) - (int)A.ph;
        if (ih < 0 || ih >= (int)A.in_h) continue;
        for (u32 kx = 0; kx < A.kw; ++kx) {
            const int iw = (int)(ow * A.sw + kx * A.dw) - (int)A.pw;
            if (iw < 0 || iw >= (int)A.in_w) continue;
            const T* x = (const T*)A.in + ((u64)(ni * A.in_h + (u32)ih) * A.in_w + (u32)iw) * A.in_ps + c0;
            const T* wk = w + (ky * A.kw + kx) * cin_g;
            for (u32 ci = 0; ci < cin_g; ++ci) acc = fmaf(ld(x + ci), ld(wk + ci), acc);
        }
    }
    return acc;
}

// One output of a groups == 1 convolution over reduction indices [k0, k1) (k = (ky * kw + kx) * in_c + ci).
template <typename T>
__device__ __forceinline__ float conv_direct_range(const ConvArgs& A, u32 m, u32 n, u32 k0, u32 k1) {
    const u32 ow = m % A.out_w;
    const u32 t = m / A.out_w;
    const u32 oh = t % A.out_h;
    const u32 ni = t / A.out_h;
    const T* w = (const T*)A.w + (u64)n * A.kh * A.kw * A.in_c;
    float acc = 0.0f;
    for (u32 k = k0; k < k1; ++k) {
        const u32 ci = k % A.in_c;
        const u32 tap = k / A.in_c;
        const int ih = (int)(oh * A.sh + (tap / A.kw) * A.dh) - (int)A.ph;
        const int iw = (int)(ow * A.sw + (tap % A.kw) * A.dw) - (int)A.pw;
        if (ih < 0 || ih >= (int)A.in_h || iw < 0 || iw >= (int)A.in_w) continue;
        acc = fmaf(ld((const T*)A.in + ((u64)(ni * A.in_h + (u32)ih) * A.in_w + (u32)iw) * A.in_ps + ci), ld(w + k), acc);
    }
    return acc;
}

// SPLIT: the _sk entries (split_k > 1), compiled apart so the split path costs the whole-K
// kernels no registers.
template <typename T, u32 CLS = TC_STD, bool SPLIT = false>
__device__ __forceinline__ void conv2d_body(const KairosProto& P, const ConvArgs& A) {
    const u32 M = A.batch * A.out_h * A.out_w;
    const u32 n_tiles = (A.out_c + A.tile_n - 1) / A.tile_n;
    const bool tiled = A.groups == 1 && A.tile_m <= TILE_MAX && A.tile_n <= TILE_MAX;
    const u32 per_slice = ((M + A.tile_m - 1) / A.tile_m) * n_tiles;
    const u32 K = A.kh * A.kw * A.in_c;  // split-K is for groups == 1
    kairos_run(P, [&](u32 b) {
        u32 slice = 0u;
        if constexpr (SPLIT) {
            slice = b / per_slice;
            b %= per_slice;
        }
        const u32 m0 = (b / n_tiles) * A.tile_m;
        const u32 n0 = (b % n_tiles) * A.tile_n;
        const u32 tm = min(A.tile_m, M - m0);
        const u32 tn = min(A.tile_n, A.out_c - n0);
        const u32 kb = SPLIT ? slice * A.k_split_len : 0u;
        const u32 kn = SPLIT ? min(A.k_split_len, K - kb) : K;
        float* ws = SPLIT ? (float*)A.out + ((u64)slice * M + m0) * A.out_c + n0 : (float*)0;
        if (tiled) {
            conv_tile<T, CLS, SPLIT>(A, m0, n0, tm, tn, kb, kn, ws);
        } else if (SPLIT) {
            // A tile past the engines' maximum: one output per thread over this slice.
            for (u32 i = threadIdx.x; i < tm * tn; i += blockDim.x) {
                const u32 mm = i / tn;
                const u32 nn = i % tn;
                ws[(u64)mm * A.out_c + nn] = conv_direct_range<T>(A, m0 + mm, n0 + nn, kb, kb + kn);
            }
        } else {
            for (u32 i = threadIdx.x; i < tm * tn; i += blockDim.x) {
                const u32 m = m0 + i / tn;
                const u32 n = n0 + i % tn;
                const float v = conv_direct<T>(A, m, n);
                st((T*)A.out + (u64)m * A.out_ps + n, conv_epilogue<T>(A, m, n, v));
            }
        }
    });
}

template <typename T>
__device__ __forceinline__ void dwconv2d_body(const KairosProto& P, const ConvArgs& A) {
    const u32 M = A.batch * A.out_h * A.out_w;
    const u32 C = A.out_c;
    const u32 n_tiles = (C + A.tile_n - 1) / A.tile_n;
    kairos_run(P, [&](u32 b) {
        const u32 m0 = (b / n_tiles) * A.tile_m;
        const u32 n0 = (b % n_tiles) * A.tile_n;
        const u32 tm = min(A.tile_m, M - m0);
        const u32 tn = min(A.tile_n, C - n0);
        for (u32 i = threadIdx.x; i < tm * tn; i += blockDim.x) {
            const u32 m = m0 + i / tn;
            const u32 c = n0 + i % tn;
            const u32 ow = m % A.out_w;
            const u32 t = m / A.out_w;
            const u32 oh = t % A.out_h;
            const u32 ni = t / A.out_h;
            float acc = 0.0f;
            for (u32 ky = 0; ky < A.kh; ++ky) {
                const int ih = (int)(oh * A.sh + ky * A.dh) - (int)A.ph;
                if (ih < 0 || ih >= (int)A.in_h) continue;
                for (u32 kx = 0; kx < A.kw; ++kx) {
                    const int iw = (int)(ow * A.sw + kx * A.dw) - (int)A.pw;
                    if (iw < 0 || iw >= (int)A.in_w) continue;
                    const float x = ld((const T*)A.in + ((u64)(ni * A.in_h + (u32)ih) * A.in_w + (u32)iw) * A.in_ps + c);
                    acc = fmaf(x, ld((const T*)A.w + (ky * A.kw + kx) * C + c), acc);
                }
            }
            st((T*)A.out + (u64)m * A.out_ps + c, conv_epilogue<T>(A, m, c, acc));
        }
    });
}

KAIROS_KERNELS_TC(conv2d, ConvArgs, conv2d_body)
KAIROS_KERNELS(dwconv2d, ConvArgs, dwconv2d_body, 256)

// softmax and layernorm over contiguous rows (kairos_ir::plan::SoftmaxParams, LayerNormParams).
// One warp per row; a logical block's rows are dealt to the CTA's warps in turn (the lowering gives
// a block one row per warp of the CTA). f32 statistics. Rows of up to 1024 halves (512 floats) in
// 16-byte chunks stay in registers: read once, with vector loads.

#include "kairos/common.cuh"

struct SoftmaxArgs {
    u64 x, y;
    u32 rows, cols;
    float scale;
    u32 flags, causal_rows, rows_per_block;  // flags: SOFTMAX_CAUSAL | SOFTMAX_ZERO_NAN
};
#define SOFTMAX_CAUSAL 1u
// A NaN result is 0 (the exporters' Where(IsNaN(y), 0, y) after a masked softmax, fused).
#define SOFTMAX_ZERO_NAN 2u
static_assert(sizeof(SoftmaxArgs) == 40, "SoftmaxArgs layout");

struct LayerNormArgs {
    u64 x, gamma, beta, y;
    u32 rows, cols;
    float eps;
    u32 rows_per_block, flags;  // flags: LN_RMS
};
// Root-mean-square normalization (T5's, LLaMA's): no mean subtracted.
#define LN_RMS 1u
static_assert(sizeof(LayerNormArgs) == 56, "LayerNormArgs layout");

// Rows that fit in registers: LN_CHUNKS 16-byte chunks per lane (a row of up to 1024 halves or
// 512 floats) are read once, with vector loads, and the mean, the variance and the output all
// come from the registers (the general path below reads the row three times, element by element:
// BERT-base's 768-wide layer norms took ~10 µs each that way on an H200).
#define LN_CHUNKS 4u

__device__ __forceinline__ void ln_unpack(const uint4& v, float (&f)[8]) { unpack_h16x8(v, f); }
__device__ __forceinline__ void ln_unpack(const uint4& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ uint4 ln_pack(const float (&f)[8]) {
    u32 w[4];
#pragma unroll
    for (u32 i = 0; i < 4u; ++i) w[i] = (u32)f2h(f[2u * i]) | ((u32)f2h(f[2u * i + 1u]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 ln_pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
}

// Whether rows of `cols` take the register path: whole 16-byte chunks, few enough of them, and
// every operand (`addresses`: their bitwise or) 16-byte aligned, so rows are aligned too.
template <typename T>
__device__ __forceinline__ bool rows_in_registers(u32 cols, u64 addresses) {
    constexpr u32 E = 16u / sizeof(T);
    return cols % E == 0u && cols <= 32u * LN_CHUNKS * E && (addresses & 15ull) == 0ull;
}

// A lane's chunks of a row (chunk lane + 32 i in v[i]; zeros past the row's `chunks`).
template <typename T, u32 E>
__device__ __forceinline__ void row_load(const T* x, u32 lane, u32 chunks, float (&v)[LN_CHUNKS][E]) {
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i) {
        const u32 c = lane + 32u * i;
        if (c < chunks) {
            ln_unpack(*(const uint4*)(x + c * E), v[i]);
        } else {
#pragma unroll
            for (u32 e = 0; e < E; ++e) v[i][e] = 0.0f;
        }
    }
}

// Stores a lane's chunks of a row (the inverse of row_load).
template <typename T, u32 E>
__device__ __forceinline__ void row_store(T* y, u32 lane, u32 chunks, const float (&v)[LN_CHUNKS][E]) {
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i) {
        const u32 c = lane + 32u * i;
        if (c < chunks) *(uint4*)(y + c * E) = ln_pack(v[i]);
    }
}

template <typename T>
__device__ __forceinline__ void layernorm_row_in_registers(const LayerNormArgs& A, const T* x, T* y, u32 lane) {
    constexpr u32 E = 16u / sizeof(T);
    const u32 chunks = A.cols / E;
    float v[LN_CHUNKS][E];
    row_load<T, E>(x, lane, chunks, v);
    float s = 0.0f;
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i)
        if (lane + 32u * i < chunks)
#pragma unroll
            for (u32 e = 0; e < E; ++e) s += v[i][e];
    const float mean = A.flags & LN_RMS ? 0.0f : warp_sum(s) / (float)A.cols;
    float q = 0.0f;
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i)
        if (lane + 32u * i < chunks)
#pragma unroll
            for (u32 e = 0; e < E; ++e) {
                const float d = v[i][e] - mean;
                q = fmaf(d, d, q);
            }
    const float rstd = rsqrtf(warp_sum(q) / (float)A.cols + A.eps);
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i) {
        const u32 c = lane + 32u * i;
        if (c < chunks) {
            float g[E], bt[E];
            ln_unpack(*(const uint4*)((const T*)A.gamma + c * E), g);
            ln_unpack(*(const uint4*)((const T*)A.beta + c * E), bt);
#pragma unroll
            for (u32 e = 0; e < E; ++e) v[i][e] = (v[i][e] - mean) * rstd * g[e] + bt[e];
        }
    }
    row_store<T, E>(y, lane, chunks, v);
}

// Runs `row_fn(row, x, y, lane)` under the protocol for every row of every logical block, the
// block's rows dealt to the CTA's warps in turn (x and y: the row's input and output).
template <typename T, typename RowFn>
__device__ __forceinline__ void kairos_rows(const KairosProto& P, u64 x, u64 y, u32 rows, u32 cols, u32 rows_per_block,
                                            RowFn row_fn) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    kairos_run(P, [&](u32 b) {
        const u32 r0 = b * rows_per_block;
        const u32 r1 = min(r0 + rows_per_block, rows);
        for (u32 row = r0 + warp; row < r1; row += warps)
            row_fn(row, (const T*)x + (u64)row * cols, (T*)y + (u64)row * cols, lane);
    });
}

template <typename T>
__device__ __forceinline__ void layernorm_body(const KairosProto& P, const LayerNormArgs& A) {
    const bool in_registers = rows_in_registers<T>(A.cols, A.x | A.y | A.gamma | A.beta);
    kairos_rows<T>(P, A.x, A.y, A.rows, A.cols, A.rows_per_block, [&](u32, const T* x, T* y, u32 lane) {
        if (in_registers) {
            layernorm_row_in_registers<T>(A, x, y, lane);
            return;
        }
        float s = 0.0f;
        if (!(A.flags & LN_RMS))
            for (u32 j = lane; j < A.cols; j += 32) s += ld(x + j);
        const float mean = warp_sum(s) / (float)A.cols;
        float v = 0.0f;
        for (u32 j = lane; j < A.cols; j += 32) {
            const float d = ld(x + j) - mean;
            v = fmaf(d, d, v);
        }
        const float rstd = rsqrtf(warp_sum(v) / (float)A.cols + A.eps);
        for (u32 j = lane; j < A.cols; j += 32)
            st(y + j, (ld(x + j) - mean) * rstd * ld((const T*)A.gamma + j) + ld((const T*)A.beta + j));
    });
}

// Softmax rows held in registers (as the layer norm's above): 16-byte chunks, one read of the row,
// the exponentials kept for the output. Same arithmetic as the general path (scale * x, max, expf
// of the difference, times 1 / sum); only the order of the sum's terms differs.
template <typename T>
__device__ __forceinline__ void softmax_row_in_registers(const SoftmaxArgs& A, const T* x, T* y, u32 lane, u32 kept) {
    constexpr u32 E = 16u / sizeof(T);
    const u32 chunks = A.cols / E;
    float v[LN_CHUNKS][E];
    row_load<T, E>(x, lane, chunks, v);
    float mx = -KAIROS_INF;
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i) {
        const u32 c = lane + 32u * i;
        if (c < chunks) {
#pragma unroll
            for (u32 e = 0; e < E; ++e) {
                v[i][e] *= A.scale;
                if (c * E + e < kept) mx = fmaxf(mx, v[i][e]);
            }
        }
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i) {
        const u32 c = lane + 32u * i;
        if (c < chunks) {
#pragma unroll
            for (u32 e = 0; e < E; ++e) {
                const float p = c * E + e < kept ? expf(v[i][e] - mx) : 0.0f;
                v[i][e] = p;
                sum += p;
            }
        }
    }
    sum = warp_sum(sum);
    const float inv = kept ? 1.0f / sum : 0.0f;
#pragma unroll
    for (u32 i = 0; i < LN_CHUNKS; ++i)
#pragma unroll
        for (u32 e = 0; e < E; ++e) {
            const float p = v[i][e] * inv;
            v[i][e] = (A.flags & SOFTMAX_ZERO_NAN) && isnan(p) ? 0.0f : p;
        }
    row_store<T, E>(y, lane, chunks, v);
}

template <typename T>
__device__ __forceinline__ void softmax_body(const KairosProto& P, const SoftmaxArgs& A) {
    const bool in_registers = rows_in_registers<T>(A.cols, A.x | A.y);
    kairos_rows<T>(P, A.x, A.y, A.rows, A.cols, A.rows_per_block, [&](u32 row, const T* x, T* y, u32 lane) {
        // keys j < kept survive the causal mask
        u32 kept = A.cols;
        if (A.flags & SOFTMAX_CAUSAL) {
            const u32 q = row % A.causal_rows;
            const i64 lim = (i64)q + A.cols - A.causal_rows + 1;
            kept = lim < 0 ? 0u : (lim > (i64)A.cols ? A.cols : (u32)lim);
        }
        if (in_registers) {
            softmax_row_in_registers<T>(A, x, y, lane, kept);
            return;
        }
        float mx = -KAIROS_INF;
        for (u32 j = lane; j < kept; j += 32) mx = fmaxf(mx, A.scale * ld(x + j));
        mx = warp_max(mx);
        float sum = 0.0f;
        for (u32 j = lane; j < kept; j += 32) sum += expf(A.scale * ld(x + j) - mx);
        sum = warp_sum(sum);
        const float inv = kept ? 1.0f / sum : 0.0f;
        const bool zero_nan = A.flags & SOFTMAX_ZERO_NAN;
        for (u32 j = lane; j < A.cols; j += 32) {
            const float p = j < kept ? expf(A.scale * ld(x + j) - mx) * inv : 0.0f;
            st(y + j, zero_nan && isnan(p) ? 0.0f : p);
        }
    });
}

KAIROS_KERNELS(softmax, SoftmaxArgs, softmax_body, 256)
KAIROS_KERNELS(layernorm, LayerNormArgs, layernorm_body, 256)

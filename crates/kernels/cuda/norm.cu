// softmax and layernorm over contiguous rows (kairos_ir::plan::SoftmaxParams, LayerNormParams).
// One warp per row; a logical block's rows are dealt to the CTA's warps in turn. f32 statistics.

#include "kairos/common.cuh"

struct SoftmaxArgs {
    u64 x, y;
    u32 rows, cols;
    float scale;
    u32 causal, causal_rows, rows_per_block;
};
static_assert(sizeof(SoftmaxArgs) == 40, "SoftmaxArgs layout");

struct LayerNormArgs {
    u64 x, gamma, beta, y;
    u32 rows, cols;
    float eps;
    u32 rows_per_block;
};
static_assert(sizeof(LayerNormArgs) == 48, "LayerNormArgs layout");

template <typename T>
__device__ __forceinline__ void softmax_body(const KairosProto& P, const SoftmaxArgs& A) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    kairos_run(P, [&](u32 b) {
        const u32 r0 = b * A.rows_per_block;
        const u32 r1 = min(r0 + A.rows_per_block, A.rows);
        for (u32 row = r0 + warp; row < r1; row += warps) {
            const T* x = (const T*)A.x + (u64)row * A.cols;
            T* y = (T*)A.y + (u64)row * A.cols;
            // keys j < kept survive the causal mask
            u32 kept = A.cols;
            if (A.causal) {
                const u32 q = row % A.causal_rows;
                const i64 lim = (i64)q + A.cols - A.causal_rows + 1;
                kept = lim < 0 ? 0u : (lim > (i64)A.cols ? A.cols : (u32)lim);
            }
            float mx = -KAIROS_INF;
            for (u32 j = lane; j < kept; j += 32) mx = fmaxf(mx, A.scale * ld(x + j));
            mx = warp_max(mx);
            float sum = 0.0f;
            for (u32 j = lane; j < kept; j += 32) sum += expf(A.scale * ld(x + j) - mx);
            sum = warp_sum(sum);
            const float inv = kept ? 1.0f / sum : 0.0f;
            for (u32 j = lane; j < A.cols; j += 32) st(y + j, j < kept ? expf(A.scale * ld(x + j) - mx) * inv : 0.0f);
        }
    });
}

template <typename T>
__device__ __forceinline__ void layernorm_body(const KairosProto& P, const LayerNormArgs& A) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    kairos_run(P, [&](u32 b) {
        const u32 r0 = b * A.rows_per_block;
        const u32 r1 = min(r0 + A.rows_per_block, A.rows);
        for (u32 row = r0 + warp; row < r1; row += warps) {
            const T* x = (const T*)A.x + (u64)row * A.cols;
            T* y = (T*)A.y + (u64)row * A.cols;
            float s = 0.0f;
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
        }
    });
}

KAIROS_KERNELS(softmax, SoftmaxArgs, softmax_body, 256)
KAIROS_KERNELS(layernorm, LayerNormArgs, layernorm_body, 256)

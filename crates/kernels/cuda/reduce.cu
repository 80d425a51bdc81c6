// reduce: sum/mean/max/min over the middle axis of a contiguous [outer, reduce, inner] tensor
// (kairos_ir::plan::ReduceParams). With inner > 1 one thread per output walks the axis (adjacent
// threads read adjacent elements, four independent accumulators so the loads overlap); when a
// logical block has fewer outputs than half its threads, the axis is split among groups of threads
// and each output's partials are combined in group order through shared memory (global average
// pooling of a 112x112x32 activation is 32 outputs: one thread each walked 12544 elements, 2 ms on
// an H200). With inner == 1 the axis is contiguous and a warp per output reduces it with shuffles.
// Long axes with few outputs are also cut into equal chunks by the lowering (two launches).

#include "kairos/common.cuh"

struct ReduceArgs {
    u64 x, y;
    u32 kind;  // 0 sum, 1 mean, 2 max, 3 min
    u32 outer, reduce, inner, elems_per_block, pad;
};
static_assert(sizeof(ReduceArgs) == 40, "ReduceArgs layout");

__device__ __forceinline__ float reduce_init(u32 kind) {
    return kind == 2 ? -KAIROS_INF : (kind == 3 ? KAIROS_INF : 0.0f);
}

__device__ __forceinline__ float reduce_step(u32 kind, float acc, float x) {
    return kind == 2 ? fmaxf(acc, x) : (kind == 3 ? fminf(acc, x) : acc + x);
}

// Threads of a CTA that may split axes (the kernel's block size); `partial` holds one float each.
#define REDUCE_SPLIT_THREADS 256u

// Elements first, first + step, ... of an axis of `len` elements `stride` apart, in four
// independent accumulators (combined in a fixed order) so that four loads are in flight.
template <typename T>
__device__ __forceinline__ float reduce_strided(u32 kind, const T* x, u64 stride, u32 first, u32 step, u32 len) {
    float a0 = reduce_init(kind), a1 = a0, a2 = a0, a3 = a0;
    u32 r = first;
    for (; r + 3u * step < len; r += 4u * step) {
        a0 = reduce_step(kind, a0, ld(x + (u64)r * stride));
        a1 = reduce_step(kind, a1, ld(x + (u64)(r + step) * stride));
        a2 = reduce_step(kind, a2, ld(x + (u64)(r + 2u * step) * stride));
        a3 = reduce_step(kind, a3, ld(x + (u64)(r + 3u * step) * stride));
    }
    for (; r < len; r += step) a0 = reduce_step(kind, a0, ld(x + (u64)r * stride));
    return reduce_step(kind, reduce_step(kind, a0, a1), reduce_step(kind, a2, a3));
}

template <typename T>
__device__ __forceinline__ void reduce_body(const KairosProto& P, const ReduceArgs& A) {
    const u64 total = (u64)A.outer * A.inner;
    kairos_run(P, [&](u32 b) {
        const u64 e0 = (u64)b * A.elems_per_block;
        const u64 e1 = min(e0 + A.elems_per_block, total);
        if (A.inner == 1 && blockDim.x >= 32) {
            const u32 lane = threadIdx.x % 32, warps = blockDim.x / 32;
            for (u64 e = e0 + threadIdx.x / 32; e < e1; e += warps) {
                const T* x = (const T*)A.x + e * A.reduce;
                float acc = reduce_init(A.kind);
                for (u32 r = lane; r < A.reduce; r += 32) acc = reduce_step(A.kind, acc, ld(x + r));
                acc = A.kind == 2 ? warp_max(acc) : (A.kind == 3 ? warp_min(acc) : warp_sum(acc));
                if (A.kind == 1) acc /= (float)A.reduce;
                if (lane == 0) st((T*)A.y + e, acc);
            }
        } else {
            const u32 cnt = e1 > e0 ? (u32)(e1 - e0) : 0u;
            const u32 threads = min(blockDim.x, REDUCE_SPLIT_THREADS);
            const u32 parts = cnt > 0u && 2u * cnt <= threads ? threads / cnt : 1u;
            if (parts > 1u) {
                __shared__ float partial[REDUCE_SPLIT_THREADS];
                const u32 t = threadIdx.x, j = t % cnt, part = t / cnt;
                if (part < parts) {
                    const u64 e = e0 + j, o = e / A.inner, i = e % A.inner;
                    const T* x = (const T*)A.x + o * A.reduce * A.inner + i;
                    partial[t] = reduce_strided<T>(A.kind, x, A.inner, part, parts, A.reduce);
                }
                __syncthreads();
                if (t < cnt) {
                    float acc = partial[t];
                    for (u32 q = 1u; q < parts; ++q) acc = reduce_step(A.kind, acc, partial[q * cnt + t]);
                    if (A.kind == 1) acc /= (float)A.reduce;
                    st((T*)A.y + e0 + t, acc);
                }
                __syncthreads();  // `partial` is the next logical block's
            } else {
                for (u64 e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
                    const u64 o = e / A.inner, i = e % A.inner;
                    const T* x = (const T*)A.x + o * A.reduce * A.inner + i;
                    float acc = reduce_strided<T>(A.kind, x, A.inner, 0u, 1u, A.reduce);
                    if (A.kind == 1) acc /= (float)A.reduce;
                    st((T*)A.y + e, acc);
                }
            }
        }
    });
}

KAIROS_KERNELS(reduce, ReduceArgs, reduce_body, 256)

// splitk_sum: the second half of a split-K conv2d or gemm (kairos_ir::plan::SplitKSumParams):
// out = act(alpha * sum_s ws[s] + bias + residual), the f32 slices of the workspace added in slice
// order (the result does not depend on which CTA ran which slice). One thread per output element;
// adjacent threads read adjacent elements of every slice.
struct SplitKSumArgs {
    u64 ws, bias, res, out;  // bias and res are 0 when absent
    u64 c_s0, c_s1, c_sm, r_s0, r_s1, r_sm;
    u32 splits, batch0, batch1, m, n;
    float alpha;
    u32 act, elems_per_block;
};
static_assert(sizeof(SplitKSumArgs) == 112, "SplitKSumArgs layout");

template <typename T>
__device__ __forceinline__ void splitk_sum_body(const KairosProto& P, const SplitKSumArgs& A) {
    const u64 total = (u64)A.batch0 * A.batch1 * A.m * A.n;
    kairos_run(P, [&](u32 b) {
        const u64 e0 = (u64)b * A.elems_per_block;
        const u64 e1 = min(e0 + A.elems_per_block, total);
        for (u64 e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
            const float* ws = (const float*)A.ws + e;
            float acc = 0.0f;
            for (u32 s = 0; s < A.splits; ++s) acc += ws[(u64)s * total];
            const u32 j = (u32)(e % A.n);
            const u64 row = e / A.n;
            const u64 i = row % A.m;
            const u64 bb = row / A.m;
            const u64 b0 = bb / A.batch1, b1 = bb % A.batch1;
            float v = A.alpha * acc;
            if (A.bias) v += ld((const T*)A.bias + j);
            if (A.res) v += ld((const T*)A.res + b0 * A.r_s0 + b1 * A.r_s1 + i * A.r_sm + j);
            st((T*)A.out + b0 * A.c_s0 + b1 * A.c_s1 + i * A.c_sm + j, kairos_act(A.act, v));
        }
    });
}

KAIROS_KERNELS(splitk_sum, SplitKSumArgs, splitk_sum_body, 256)

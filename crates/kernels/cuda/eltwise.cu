// eltwise: the strided element-wise kernel (kairos_ir::plan::EltwiseParams). Each input and the
// output have their own element type and strides over a rank-6 shape (stride 0 broadcasts), so one
// kernel covers casts, layout changes, broadcasting binary ops, batch-norm affines and selects.
// Computed in f32, then the activation, then stored in the output's type.

#include "kairos/common.cuh"

#define ELT_RANK 6

struct EltArgs {
    u64 in[3];
    u64 out;
    u64 out_strides[ELT_RANK];
    u64 in_strides[3][ELT_RANK];
    u32 shape[ELT_RANK];
    u32 in_dt[3];
    u32 out_dt;
    u32 func;  // 0 copy, 1 unary, 2 binary, 3 binary with scalar s0, 4 affine, 5 where
    u32 op;    // unary: sqrt rsqrt recip exp erf neg abs square isnan; binary: add sub mul div pow max min
    u32 act, inputs, elems_per_block;
    float s0, s1;
    u32 pad;
};
static_assert(sizeof(EltArgs) == 296, "EltArgs layout");

__device__ __forceinline__ float elt_unary(u32 op, float x) {
    switch (op) {
        case 0: return sqrtf(x);
        case 1: return 1.0f / sqrtf(x);
        case 2: return 1.0f / x;
        case 3: return expf(x);
        case 4: return erff(x);
        case 5: return -x;
        case 6: return fabsf(x);
        case 8: return isnan(x) ? 1.0f : 0.0f;
        default: return x * x;
    }
}

__device__ __forceinline__ float elt_binary(u32 op, float a, float b) {
    switch (op) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        case 3: return a / b;
        case 4: return b == 2.0f ? a * a : (b == 3.0f ? a * a * a : powf(a, b));
        case 5: return fmaxf(a, b);
        case 7: return a == b ? 1.0f : 0.0f;
        case 8: return a < b ? 1.0f : 0.0f;
        case 9: return a > b ? 1.0f : 0.0f;
        default: return fminf(a, b);
    }
}

template <typename T>
__device__ __forceinline__ void eltwise_body(const KairosProto& P, const EltArgs& A) {
    u64 total = 1;
    for (int d = 0; d < ELT_RANK; ++d) total *= A.shape[d];
    const bool raw = A.func == 0 && A.act == KAIROS_ACT_NONE && A.inputs == 1 && A.in_dt[0] == A.out_dt;
    const bool small = total <= 0xffffffffull;  // element indices fit 32 bits
    kairos_run(P, [&](u32 b) {
        const u64 e0 = (u64)b * A.elems_per_block;
        const u64 e1 = min(e0 + A.elems_per_block, total);
        for (u64 e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
            u64 o = 0, i0 = 0, i1 = 0, i2 = 0;
            if (small) {
                // 32-bit coordinates, extents of 1 skipped (a uniform branch: the rank-6 shape is
                // mostly padding). 64-bit division took ~10 µs per batch-1 DenseNet affine on an H200.
                u32 rest = (u32)e;
#pragma unroll
                for (int d = ELT_RANK - 1; d >= 0; --d) {
                    const u32 n = A.shape[d];
                    if (n == 1u) continue;
                    const u32 q = rest / n;
                    const u64 c = rest - q * n;
                    rest = q;
                    o += c * A.out_strides[d];
                    i0 += c * A.in_strides[0][d];
                    i1 += c * A.in_strides[1][d];
                    i2 += c * A.in_strides[2][d];
                }
            } else {
                u64 rest = e;
#pragma unroll
                for (int d = ELT_RANK - 1; d >= 0; --d) {
                    const u64 c = rest % A.shape[d];
                    rest /= A.shape[d];
                    o += c * A.out_strides[d];
                    i0 += c * A.in_strides[0][d];
                    i1 += c * A.in_strides[1][d];
                    i2 += c * A.in_strides[2][d];
                }
            }
            if (raw) {  // same-type copy: bit exact, also for i64 beyond f32's 24-bit mantissa
                if (A.out_dt == KAIROS_DT_I64) ((i64*)A.out)[o] = ((const i64*)A.in[0])[i0];
                else if (A.out_dt == KAIROS_DT_F16) ((h16*)A.out)[o] = ((const h16*)A.in[0])[i0];
                else ((float*)A.out)[o] = ((const float*)A.in[0])[i0];
                continue;
            }
            const float x0 = A.inputs > 0 ? ld_dt(A.in[0], i0, A.in_dt[0]) : 0.0f;
            const float x1 = A.inputs > 1 ? ld_dt(A.in[1], i1, A.in_dt[1]) : 0.0f;
            const float x2 = A.inputs > 2 ? ld_dt(A.in[2], i2, A.in_dt[2]) : 0.0f;
            float v;
            switch (A.func) {
                case 1: v = elt_unary(A.op, x0); break;
                case 2: v = elt_binary(A.op, x0, x1); break;
                case 3: v = elt_binary(A.op, x0, A.s0); break;
                case 4: v = fmaf(x0, x1, x2); break;
                case 5: v = x0 != 0.0f ? x1 : x2; break;
                default: v = x0; break;
            }
            st_dt(A.out, o, A.out_dt, kairos_act(A.act, v));
        }
    });
}

KAIROS_KERNELS(eltwise, EltArgs, eltwise_body, 256)

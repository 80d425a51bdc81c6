// Shared helpers of kairos' kernels: storage types, conversions, activations.
//
// No CUDA headers are needed: fp16 values are stored as their 16 bit patterns and converted with
// the PTX cvt instructions, so NVRTC compiles the library with no include path at all.
// All arithmetic is f32; fp16 is a storage type only.

#pragma once
#include "kairos/protocol.cuh"

typedef unsigned short h16;

#define KAIROS_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float h2f(h16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ h16 f2h(float f) {
    h16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// 16 bytes as 8 halves (in memory order), widened to f32.
__device__ __forceinline__ void unpack_h16x8(const uint4& v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (u32 i = 0; i < 4u; ++i) {
        f[2u * i] = h2f((h16)(w[i] & 0xffffu));
        f[2u * i + 1u] = h2f((h16)(w[i] >> 16));
    }
}

// Two adjacent halves p[0], p[1] (the second only when `two`, else zero bits) as one raw word, p[0]
// in the low half: one 4-byte load when aligned.
__device__ __forceinline__ u32 ld_pair_bits(const h16* p, bool two) {
    if (two && ((u64)p & 3ull) == 0ull) return *(const u32*)p;
    return (u32)p[0] | (two ? (u32)p[1] << 16 : 0u);
}

// a += the low half of `bits`, b += the high half (a pair from ld_pair_bits).
__device__ __forceinline__ void add_pair_bits(u32 bits, float& a, float& b) {
    a += h2f((h16)(bits & 0xffffu));
    b += h2f((h16)(bits >> 16));
}

// Stores a (and b after it when `two`) as halves: one 4-byte store when aligned.
__device__ __forceinline__ void st_pair(h16* p, bool two, float a, float b) {
    const h16 h0 = f2h(a);
    if (two && ((u64)p & 3ull) == 0ull) {
        *(u32*)p = (u32)h0 | ((u32)f2h(b) << 16);
    } else {
        p[0] = h0;
        if (two) p[1] = f2h(b);
    }
}

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const h16* p) { return h2f(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(h16* p, float v) { *p = f2h(v); }

// Element types as the host encodes them (kairos_ir::DType).
#define KAIROS_DT_F32 0u
#define KAIROS_DT_F16 1u
#define KAIROS_DT_I64 2u

__device__ __forceinline__ float ld_dt(u64 base, u64 i, u32 dt) {
    if (dt == KAIROS_DT_F16) return h2f(((const h16*)base)[i]);
    if (dt == KAIROS_DT_I64) return (float)((const i64*)base)[i];
    return ((const float*)base)[i];
}

__device__ __forceinline__ void st_dt(u64 base, u64 i, u32 dt, float v) {
    if (dt == KAIROS_DT_F16) ((h16*)base)[i] = f2h(v);
    else if (dt == KAIROS_DT_I64) ((i64*)base)[i] = (i64)v;  // cvt.rzi: truncates, saturates, NaN -> 0
    else ((float*)base)[i] = v;
}

// Activations (kairos_ir::graph::Act, in declaration order).
#define KAIROS_ACT_NONE 0u
#define KAIROS_ACT_RELU 1u
#define KAIROS_ACT_RELU6 2u
#define KAIROS_ACT_SIGMOID 3u
#define KAIROS_ACT_TANH 4u
#define KAIROS_ACT_HARDSWISH 5u
#define KAIROS_ACT_GELU 6u
#define KAIROS_ACT_GELU_TANH 7u
#define KAIROS_ACT_SILU 8u
#define KAIROS_ACT_QUICK_GELU 9u

__device__ __forceinline__ float kairos_act(u32 act, float x) {
    switch (act) {
        case KAIROS_ACT_RELU: return fmaxf(x, 0.0f);
        case KAIROS_ACT_RELU6: return fminf(fmaxf(x, 0.0f), 6.0f);
        case KAIROS_ACT_SIGMOID: return 1.0f / (1.0f + expf(-x));
        case KAIROS_ACT_SILU: return x / (1.0f + expf(-x));
        case KAIROS_ACT_QUICK_GELU: return x / (1.0f + expf(-1.702f * x));  // kairos_ir::graph::QUICK_GELU_SCALE
        case KAIROS_ACT_TANH: return tanhf(x);
        case KAIROS_ACT_HARDSWISH: return x * fminf(fmaxf(x + 3.0f, 0.0f), 6.0f) / 6.0f;
        case KAIROS_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case KAIROS_ACT_GELU_TANH: {
            const float k = 0.79788456080286536f;  // sqrt(2 / pi)
            return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
        }
        default: return x;
    }
}

// The activation of an unrolled epilogue (the tensor-core tiles store 16 to 128 outputs per thread
// in straight-line code): none and ReLU inline, every other one through one out-of-line call, so
// the epilogue's code stays small. With kairos_act inlined at every output the gemm entries held
// ~3800 MUFU instructions and an epilogue pass streamed tens of KB of code through the
// instruction cache per warp (ncu on an H200: 53% of stalls waiting for an instruction fetch).
#define KAIROS_ACT_ANY 0xffu
__device__ __noinline__ float kairos_act_call(u32 act, float x) { return kairos_act(act, x); }

template <u32 ACT>
__device__ __forceinline__ float kairos_act_tagged(u32 act, float x) {
    if constexpr (ACT == KAIROS_ACT_NONE) return x;
    else if constexpr (ACT == KAIROS_ACT_RELU) return fmaxf(x, 0.0f);
    else return kairos_act_call(act, x);
}

// 16 bytes through the non-coherent path; not volatile, so the compiler may move it among the
// thread's stores (only for data no thread of the kernel writes before this read).
__device__ __forceinline__ uint4 ld_nc16(const h16* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Eight outputs o[0 .. n) (n <= 8) of the paired epilogue from their f32 sums: alpha * v + bias
// + residual (each when present), the activation of class ACT, stored as halves. One 16-byte
// load of bias and of residual and one 16-byte store when all eight are there and aligned (the
// addends read non-coherently: each is read once, before any write of this kernel to its own
// output, so they may be scheduled ahead of the earlier runs' stores); else pair by pair.
template <u32 ACT>
__device__ __forceinline__ void store8_h16(h16* o, const h16* b, const h16* r, float alpha, u32 act, const float (&v)[8], u32 n) {
    if (n == 8u && (((u64)o | (u64)b | (u64)r) & 15ull) == 0ull) {
        float x[8];
#pragma unroll
        for (u32 e = 0; e < 8u; ++e) x[e] = v[e] * alpha;
        if (b) {
            float f[8];
            unpack_h16x8(ld_nc16(b), f);
#pragma unroll
            for (u32 e = 0; e < 8u; ++e) x[e] += f[e];
        }
        if (r) {
            float f[8];
            unpack_h16x8(ld_nc16(r), f);
#pragma unroll
            for (u32 e = 0; e < 8u; ++e) x[e] += f[e];
        }
        u32 w[4];
#pragma unroll
        for (u32 e = 0; e < 4u; ++e)
            w[e] = (u32)f2h(kairos_act_tagged<ACT>(act, x[2u * e])) | ((u32)f2h(kairos_act_tagged<ACT>(act, x[2u * e + 1u])) << 16);
        *(uint4*)o = make_uint4(w[0], w[1], w[2], w[3]);
        return;
    }
    for (u32 e = 0; e < n; ++e) {
        float x = v[e] * alpha;
        if (b) x += h2f(b[e]);
        if (r) x += h2f(r[e]);
        o[e] = f2h(kairos_act_tagged<ACT>(act, x));
    }
}


__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Entry selection. A compilation unit of the library (kairos_kernels::source::Unit) compiles one
// module with -DKAIROS_ENTRIES=<mask> and so emits only the entries of that mask; without it every
// entry is emitted. The tensor-core modules are compiled one entry kind per unit, so their entries
// compile in parallel and a model compiles only those its plan launches. What made a unit slow to
// compile decided the kinds (NVRTC 13, sm_90, one core): the small-M path (tile_gemv, 8
// instantiations) cost 12-26 s in every tensor-core entry, so it has entries of its own (`_gv`,
// `_gvn`); the wide entry's three epilogue classes cost 60 of its 90 s, so it is one entry per
// activation class (`_f16w_none`, `_f16w_relu`, `_f16w_act`: 20 s each).
#define KAIROS_E_F32 1
#define KAIROS_E_F16 2
#define KAIROS_E_F16N 4
#define KAIROS_E_F16W_NONE 8
#define KAIROS_E_F16W_RELU 16
#define KAIROS_E_F16W_ACT 32
#define KAIROS_E_GV 64
#define KAIROS_E_GVN 128
#define KAIROS_E_SK_F32 256
#define KAIROS_E_SK_F16 512
#define KAIROS_E_SK_F16N 1024
#define KAIROS_E_SK_GV 2048
#define KAIROS_E_SK_GVN 4096
#ifndef KAIROS_ENTRIES
#define KAIROS_ENTRIES 8191
#endif

// A unit of one wide activation class compiles its epilogues for that class only (tile.cuh:
// tc_store_frags, tcx_epilogue); compiled together, the entries dispatch on the launch's class.
#if KAIROS_ENTRIES == KAIROS_E_F16W_NONE
#define KAIROS_ACT_ONLY KAIROS_ACT_NONE
#elif KAIROS_ENTRIES == KAIROS_E_F16W_RELU
#define KAIROS_ACT_ONLY KAIROS_ACT_RELU
#elif KAIROS_ENTRIES == KAIROS_E_F16W_ACT
#define KAIROS_ACT_ONLY KAIROS_ACT_ANY
#endif

// One entry: `extern "C" name##suffix` with launch bounds (threads, min CTAs per SM) running
// body<...>(P, A).
#define KAIROS_ENTRY(fname, Args, threads, ctas, ...)                                                         \
    extern "C" __global__ void __launch_bounds__(threads, ctas)                                               \
        fname(const __grid_constant__ KairosProto P, const __grid_constant__ Args A) {                        \
        __VA_ARGS__(P, A);                                                                                    \
    }

#if KAIROS_ENTRIES & KAIROS_E_F32
#define KAIROS_ENTRY_F32(name, Args, body, t) KAIROS_ENTRY(name##_f32, Args, t, 2, body<float>)
#else
#define KAIROS_ENTRY_F32(name, Args, body, t)
#endif
#if KAIROS_ENTRIES & KAIROS_E_SK_F32
#define KAIROS_ENTRY_SK_F32(name, Args, body) KAIROS_ENTRY(name##_sk_f32, Args, 256, 2, body<float, TC_STD, true>)
#else
#define KAIROS_ENTRY_SK_F32(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_F16
#define KAIROS_ENTRY_F16(name, Args, body, t) KAIROS_ENTRY(name##_f16, Args, t, 2, body<h16>)
#else
#define KAIROS_ENTRY_F16(name, Args, body, t)
#endif
#if KAIROS_ENTRIES & KAIROS_E_F16N
#define KAIROS_ENTRY_F16N(name, Args, body) KAIROS_ENTRY(name##_f16n, Args, 128, 3, body<h16, TC_NARROW>)
#else
#define KAIROS_ENTRY_F16N(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_F16W_NONE
#define KAIROS_ENTRY_F16W_NONE(name, Args, body) KAIROS_ENTRY(name##_f16w_none, Args, 128, 2, body<h16, TC_WIDE>)
#else
#define KAIROS_ENTRY_F16W_NONE(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_F16W_RELU
#define KAIROS_ENTRY_F16W_RELU(name, Args, body) KAIROS_ENTRY(name##_f16w_relu, Args, 128, 2, body<h16, TC_WIDE>)
#else
#define KAIROS_ENTRY_F16W_RELU(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_F16W_ACT
#define KAIROS_ENTRY_F16W_ACT(name, Args, body) KAIROS_ENTRY(name##_f16w_act, Args, 128, 2, body<h16, TC_WIDE>)
#else
#define KAIROS_ENTRY_F16W_ACT(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_GV
#define KAIROS_ENTRY_GV(name, Args, body) KAIROS_ENTRY(name##_gv, Args, 256, 2, body<h16, TC_GEMV>)
#else
#define KAIROS_ENTRY_GV(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_GVN
#define KAIROS_ENTRY_GVN(name, Args, body) KAIROS_ENTRY(name##_gvn, Args, 128, 3, body<h16, TC_GEMV>)
#else
#define KAIROS_ENTRY_GVN(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_SK_F16
#define KAIROS_ENTRY_SK_F16(name, Args, body) KAIROS_ENTRY(name##_sk_f16, Args, 256, 2, body<h16, TC_STD, true>)
#else
#define KAIROS_ENTRY_SK_F16(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_SK_F16N
#define KAIROS_ENTRY_SK_F16N(name, Args, body) KAIROS_ENTRY(name##_sk_f16n, Args, 128, 3, body<h16, TC_NARROW, true>)
#else
#define KAIROS_ENTRY_SK_F16N(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_SK_GV
#define KAIROS_ENTRY_SK_GV(name, Args, body) KAIROS_ENTRY(name##_sk_gv, Args, 256, 2, body<h16, TC_GEMV, true>)
#else
#define KAIROS_ENTRY_SK_GV(name, Args, body)
#endif
#if KAIROS_ENTRIES & KAIROS_E_SK_GVN
#define KAIROS_ENTRY_SK_GVN(name, Args, body) KAIROS_ENTRY(name##_sk_gvn, Args, 128, 3, body<h16, TC_GEMV, true>)
#else
#define KAIROS_ENTRY_SK_GVN(name, Args, body)
#endif

// Defines `extern "C" name_f32` and `name_f16` kernels that run `body<T>(P, A)`.
#define KAIROS_KERNELS(name, Args, body, max_threads)                                                         \
    KAIROS_ENTRY_F32(name, Args, body, max_threads)                                                           \
    KAIROS_ENTRY_F16(name, Args, body, max_threads)

// The tensor-core kernels (fp16 conv2d and gemm) also get `name_f16n`: the body for CTAs of at
// most 128 threads (the small tiles) with warp tiles of at most 4 fragments (tile.cuh: TC_NARROW),
// allowed up to 168 registers (3 CTAs per SM) instead of 128, so the fast operand loads keep
// their state in registers; `name_f16w_<none|relu|act>`: 128-thread CTAs on tiles of at least
// 64 x 64 outputs per warp (tile.cuh: TC_WIDE), up to 255 registers (2 CTAs per SM) for 64 x 64
// warp tiles, one per activation class; and `name_gv` / `name_gvn` (256 threads at 128 registers,
// 128 threads at 168): the small-M path alone (tile.cuh: TC_GEMV), for products tiled by at most 8
// rows with B's k contiguous (kairos_kernels::source::function_name picks the entry by the CTA
// size, the tile, B's layout and the activation).
#define KAIROS_KERNELS_TC(name, Args, body)                                                                   \
    KAIROS_KERNELS(name, Args, body, 256)                                                                     \
    KAIROS_ENTRY_F16N(name, Args, body)                                                                       \
    KAIROS_ENTRY_F16W_NONE(name, Args, body)                                                                  \
    KAIROS_ENTRY_F16W_RELU(name, Args, body)                                                                  \
    KAIROS_ENTRY_F16W_ACT(name, Args, body)                                                                   \
    KAIROS_ENTRY_GV(name, Args, body)                                                                         \
    KAIROS_ENTRY_GVN(name, Args, body)                                                                        \
    KAIROS_KERNELS_SPLIT_K(name, Args, body)

// Their split-K entries `name_sk_f32`, `name_sk_f16` and `name_sk_f16n` (body<T, CLS, true>), for
// launches with split_k > 1: apart from the others, so the split path costs them no registers; and
// `name_sk_gv` / `name_sk_gvn`, the split-K small-M path alone (tiles of at most 8 rows: a 1-row
// product over a long K), which cost the other split-K entries 30 of their ~50 s of compile time.
#define KAIROS_KERNELS_SPLIT_K(name, Args, body)                                                              \
    KAIROS_ENTRY_SK_F32(name, Args, body)                                                                     \
    KAIROS_ENTRY_SK_F16(name, Args, body)                                                                     \
    KAIROS_ENTRY_SK_F16N(name, Args, body)                                                                    \
    KAIROS_ENTRY_SK_GV(name, Args, body)                                                                      \
    KAIROS_ENTRY_SK_GVN(name, Args, body)

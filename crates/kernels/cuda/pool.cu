// pool2d: max and average pooling on NHWC tensors (kairos_ir::plan::Pool2dParams).
// One thread per output element, channel fastest. Average with padding counted divides by the
// window clipped to the padded input (PyTorch/ONNX count_include_pad); without, by the in-bounds
// elements.

#include "kairos/common.cuh"

struct PoolArgs {
    u64 in, out;
    u32 kind;  // 0 max, 1 average counting padding, 2 average over in-bounds elements
    u32 batch, in_h, in_w, channels, out_h, out_w;
    u32 kh, kw, sh, sw, pad_top, pad_left, pad_bottom, pad_right;
    u32 in_ps, out_ps, elems_per_block;
};
static_assert(sizeof(PoolArgs) == 88, "PoolArgs layout");

template <typename T>
__device__ __forceinline__ void pool2d_body(const KairosProto& P, const PoolArgs& A) {
    const u64 total = (u64)A.batch * A.out_h * A.out_w * A.channels;
    const bool small = total <= 0xffffffffull;  // element indices fit 32 bits
    kairos_run(P, [&](u32 b) {
        const u64 e0 = (u64)b * A.elems_per_block;
        const u64 e1 = min(e0 + A.elems_per_block, total);
        for (u64 e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
            u32 c, ow, oh, ni;
            u64 pix;
            if (small) {  // 32-bit division (64-bit division costs several times more)
                const u32 e32 = (u32)e;
                const u32 p32 = e32 / A.channels;
                c = e32 - p32 * A.channels;
                pix = p32;
                const u32 t = p32 / A.out_w;
                ow = p32 - t * A.out_w;
                ni = t / A.out_h;
                oh = t - ni * A.out_h;
            } else {
                c = (u32)(e % A.channels);
                pix = e / A.channels;
                ow = (u32)(pix % A.out_w);
                const u64 t = pix / A.out_w;
                oh = (u32)(t % A.out_h);
                ni = (u32)(t / A.out_h);
            }
            const int hs = (int)(oh * A.sh) - (int)A.pad_top;
            const int ws = (int)(ow * A.sw) - (int)A.pad_left;
            const int he_pad = min(hs + (int)A.kh, (int)(A.in_h + A.pad_bottom));
            const int we_pad = min(ws + (int)A.kw, (int)(A.in_w + A.pad_right));
            const int h0 = max(hs, 0), w0 = max(ws, 0);
            const int h1 = min(hs + (int)A.kh, (int)A.in_h), w1 = min(ws + (int)A.kw, (int)A.in_w);
            float acc = A.kind == 0 ? -KAIROS_INF : 0.0f;
            for (int h = h0; h < h1; ++h)
                for (int w = w0; w < w1; ++w) {
                    const float x = ld((const T*)A.in + ((u64)(ni * A.in_h + (u32)h) * A.in_w + (u32)w) * A.in_ps + c);
                    acc = A.kind == 0 ? fmaxf(acc, x) : acc + x;
                }
            if (A.kind == 1) acc /= (float)((he_pad - hs) * (we_pad - ws));
            else if (A.kind == 2) acc /= (float)max((h1 - h0) * (w1 - w0), 1);
            st((T*)A.out + pix * A.out_ps + c, acc);
        }
    });
}

KAIROS_KERNELS(pool2d, PoolArgs, pool2d_body, 256)

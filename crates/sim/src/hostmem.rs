//! Mapped host memory, emulated: how the simulator lets kernels read and write memory a caller
//! lent it through [`Gpu::map_host`](kairos_gpu::Gpu::map_host).
//!
//! **Guarantee:** a launch whose arguments lie in a mapping computes exactly what it would on
//! device memory, reads the caller's bytes as they are when the launch ends (the instant its CPU
//! reference blocks run, see the crate docs), and changes only the bytes its kernel writes, so a
//! caller may fill other parts of the mapping meanwhile (the shared-memory channel's next request).
//!
//! How: when a launch that computes ends, every argument in a mapping is *staged*. Its byte
//! extent (what the kernel can touch from the argument's start, [`arg_extent_bytes`]) is read
//! from the caller's memory into an aligned buffer, arguments whose extents overlap share one
//! buffer (so aliasing behaves as in device memory), the kernel's blocks run on the buffers, and
//! the bytes that differ from what was read are written back through
//! [`HostMemory::write_at`](kairos_gpu::HostMemory::write_at). Staged buffers start at the
//! mapping's 256-byte alignment, so elements keep the alignment they have in the mapping.
//!
//! Timing needs nothing of this: a mapping is memory of kind `HostMapped`, so its bytes cross
//! PCIe in the launch's block model (at the link's rate shared with copies), as DeepPlan's direct
//! host access does.

use kairos_core::DType;
use kairos_core::plan::{ELTWISE_RANK_MAX, Kernel};

/// Bytes a kernel may read or write from the start of each argument, in argument order: one past
/// the highest byte any of its logical blocks touches (0 for an argument it cannot touch). It
/// follows the layouts the kernels' doc comments define (pixel strides of convolutions and
/// pooling, the strides of matrix products and element-wise kernels), so it is exact for every
/// launch and never larger than the argument's byte range in a plan.
pub fn arg_extent_bytes(kernel: &Kernel, dtype: DType) -> Vec<u64> {
    let e = dtype.size_bytes() as u64;
    // One past the last element of a strided view: 1 + sum of (count - 1) * stride, 0 if any
    // count is 0.
    let view = |dims: &[(u64, u64)]| -> u64 {
        if dims.iter().any(|&(n, _)| n == 0) { 0 } else { 1 + dims.iter().map(|&(n, s)| (n - 1) * s).sum::<u64>() }
    };
    match kernel {
        Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => {
            let in_pixels = p.batch as u64 * p.in_h as u64 * p.in_w as u64;
            let out_pixels = p.gemm_m() as u64;
            let input = view(&[(in_pixels, p.in_pixel_stride as u64), (p.in_c as u64, 1)]) * e;
            let weights = p.out_c as u64 * (p.kernel_h * p.kernel_w) as u64 * (p.in_c / p.groups.max(1)) as u64 * e;
            let mut v = vec![input, weights];
            if p.epilogue.bias {
                v.push(p.out_c as u64 * e);
            }
            if p.epilogue.residual {
                v.push(view(&[(out_pixels, p.res_pixel_stride as u64), (p.out_c as u64, 1)]) * e);
            }
            if p.split_k > 1 {
                v.push(p.split_k as u64 * out_pixels * p.out_c as u64 * 4);
            } else {
                v.push(view(&[(out_pixels, p.out_pixel_stride as u64), (p.out_c as u64, 1)]) * e);
            }
            v
        }
        Kernel::Gemm(p) => {
            let (b0, b1, m, n, k) = (p.batch0 as u64, p.batch1 as u64, p.m as u64, p.n as u64, p.k as u64);
            let a = view(&[(b0, p.a_stride0), (b1, p.a_stride1), (m, p.a_stride_m), (k, p.a_stride_k)]) * e;
            let b = view(&[(b0, p.b_stride0), (b1, p.b_stride1), (k, p.b_stride_k), (n, p.b_stride_n)]) * e;
            let mut v = vec![a, b];
            if p.epilogue.bias {
                v.push(n * e);
            }
            if p.epilogue.residual {
                v.push(view(&[(b0, p.r_stride0), (b1, p.r_stride1), (m, p.r_stride_m), (n, 1)]) * e);
            }
            if p.split_k > 1 {
                v.push(p.split_k as u64 * b0 * b1 * m * n * 4);
            } else {
                v.push(view(&[(b0, p.c_stride0), (b1, p.c_stride1), (m, p.c_stride_m), (n, 1)]) * e);
            }
            v
        }
        Kernel::Pool2d(p) => {
            let in_pixels = p.batch as u64 * p.in_h as u64 * p.in_w as u64;
            let out_pixels = p.batch as u64 * p.out_h as u64 * p.out_w as u64;
            let c = p.channels as u64;
            vec![
                view(&[(in_pixels, p.in_pixel_stride as u64), (c, 1)]) * e,
                view(&[(out_pixels, p.out_pixel_stride as u64), (c, 1)]) * e,
            ]
        }
        Kernel::Softmax(p) => vec![p.rows as u64 * p.cols as u64 * e; 2],
        Kernel::LayerNorm(p) => {
            let x = p.rows as u64 * p.cols as u64 * e;
            vec![x, p.cols as u64 * e, p.cols as u64 * e, x]
        }
        Kernel::Reduce(p) => vec![p.outer as u64 * p.reduce as u64 * p.inner as u64 * e, p.outer as u64 * p.inner as u64 * e],
        Kernel::Gather(p) => {
            vec![
                p.table_rows as u64 * p.cols as u64 * e,
                p.count as u64 * DType::I64.size_bytes() as u64,
                p.count as u64 * p.cols as u64 * e,
            ]
        }
        Kernel::Eltwise(p) => {
            let dims = |strides: &[u64; ELTWISE_RANK_MAX]| -> Vec<(u64, u64)> {
                (0..ELTWISE_RANK_MAX).map(|d| (p.shape[d] as u64, strides[d])).collect()
            };
            let mut v: Vec<u64> =
                (0..p.inputs as usize).map(|j| view(&dims(&p.in_strides[j])) * p.in_dtypes[j].size_bytes() as u64).collect();
            v.push(view(&dims(&p.out_strides)) * p.out_dtype.size_bytes() as u64);
            v
        }
        Kernel::SplitKSum(p) => {
            let (b0, b1, m, n) = (p.batch0 as u64, p.batch1 as u64, p.m as u64, p.n as u64);
            let mut v = vec![p.splits as u64 * p.elems() * 4];
            if p.epilogue.bias {
                v.push(n * e);
            }
            if p.epilogue.residual {
                v.push(view(&[(b0, p.r_stride0), (b1, p.r_stride1), (m, p.r_stride_m), (n, 1)]) * e);
            }
            v.push(view(&[(b0, p.c_stride0), (b1, p.c_stride1), (m, p.c_stride_m), (n, 1)]) * e);
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kairos_core::graph::Act;
    use kairos_core::plan::{EltFunc, EltwiseParams, EpilogueParams, GemmParams};

    #[test]
    fn extents_of_strided_views() {
        // C = A B over a 2 x 3 batch, A read with a row stride of 10 (a slice of a wider tensor).
        let g = GemmParams {
            batch0: 2,
            batch1: 3,
            m: 4,
            n: 5,
            k: 6,
            a_stride0: 3 * 40,
            a_stride1: 40,
            a_stride_m: 10,
            a_stride_k: 1,
            b_stride0: 0,
            b_stride1: 0,
            b_stride_k: 5,
            b_stride_n: 1,
            c_stride0: 60,
            c_stride1: 20,
            c_stride_m: 5,
            r_stride0: 0,
            r_stride1: 0,
            r_stride_m: 0,
            alpha: 1.0,
            epilogue: EpilogueParams { bias: true, residual: false, act: Act::None },
            tile_m: 4,
            tile_n: 5,
            split_k: 1,
        };
        let x = arg_extent_bytes(&Kernel::Gemm(g), DType::F32);
        // A: 1 + 1*120 + 2*40 + 3*10 + 5*1 = 236 elements; B: 1 + 5*5 + 4 = 30; bias 5; C: 1 + 60 + 40 + 15 + 4 = 120.
        assert_eq!(x, vec![236 * 4, 30 * 4, 5 * 4, 120 * 4]);
        // A broadcast input (stride 0) and an f16 output with a gap between rows.
        let mut shape = [1u32; ELTWISE_RANK_MAX];
        shape[4] = 3;
        shape[5] = 8;
        let mut in_strides = [[0u64; ELTWISE_RANK_MAX]; 3];
        in_strides[0][4] = 8;
        in_strides[0][5] = 1;
        in_strides[1][5] = 1;
        let mut out_strides = [0u64; ELTWISE_RANK_MAX];
        out_strides[4] = 16;
        out_strides[5] = 1;
        let p = EltwiseParams {
            func: EltFunc::Binary(kairos_core::plan::BinaryOpParam::Add),
            act: Act::None,
            inputs: 2,
            shape,
            out_strides,
            in_strides,
            in_dtypes: [DType::F32, DType::F32, DType::F32],
            out_dtype: DType::F16,
            scalars: [0.0; 2],
            elems_per_block: 8,
        };
        assert_eq!(arg_extent_bytes(&Kernel::Eltwise(p), DType::F32), vec![24 * 4, 8 * 4, 40 * 2]);
    }
}

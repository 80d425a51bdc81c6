//! CPU reference kernels: one Rust implementation per kernel of the library, block by block.
//!
//! Each kernel runs any range of its logical blocks and computes exactly the part of the output
//! those blocks own (see `kairos_core::plan`), so the simulator can run just the blocks a GPU would
//! have run before a preemption. Accumulation is f32, as on the GPU; f16 tensors are converted on
//! load and rounded to nearest on store.

mod conv;
mod eltwise;
mod gemm;
mod misc;
pub mod plan;

use half::f16;
use kairos_core::DType;
use kairos_core::plan::Kernel;
use std::ops::Range;

pub use plan::{PlanMemory, execute_plan};

/// Relative L2 error a GPU result may have against this reference, for fp32 kernels and plans.
pub const TOL_F32: f64 = 1e-4;
/// Relative L2 error a GPU result may have against this reference with fp16 storage (fp32
/// accumulation on both sides).
pub const TOL_F16: f64 = 1e-2;

/// The named tolerance of `dtype` ([`TOL_F32`] or [`TOL_F16`]).
pub fn tolerance(dtype: kairos_core::DType) -> f64 {
    if dtype == kairos_core::DType::F16 { TOL_F16 } else { TOL_F32 }
}

/// Memory a kernel runs on: argument `i` of the launch, as bytes from the argument's start to the
/// end of its allocation. Arguments may share an allocation (views into one arena buffer, such as
/// channel slices of a concatenation), so kernels read what a block needs before writing its output.
pub trait KernelMemory {
    fn arg(&self, i: usize) -> &[u8];
    fn arg_mut(&mut self, i: usize) -> &mut [u8];
}

/// Runs logical blocks `blocks` of a kernel; blocks past the kernel's count are ignored.
pub fn run_blocks(kernel: &Kernel, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let blocks = blocks.start..blocks.end.min(kernel.logical_blocks());
    if blocks.is_empty() {
        return;
    }
    match kernel {
        Kernel::Conv2d(p) => conv::conv2d(p, dtype, mem, blocks),
        Kernel::DepthwiseConv2d(p) => conv::depthwise(p, dtype, mem, blocks),
        Kernel::Gemm(p) => gemm::gemm(p, dtype, mem, blocks),
        Kernel::Pool2d(p) => misc::pool2d(p, dtype, mem, blocks),
        Kernel::Softmax(p) => misc::softmax(p, dtype, mem, blocks),
        Kernel::LayerNorm(p) => misc::layer_norm(p, dtype, mem, blocks),
        Kernel::Reduce(p) => misc::reduce(p, dtype, mem, blocks),
        Kernel::Gather(p) => misc::gather(p, dtype, mem, blocks),
        Kernel::Eltwise(p) => eltwise::eltwise(p, mem, blocks),
        Kernel::SplitKSum(p) => misc::splitk_sum(p, dtype, mem, blocks),
    }
}

/// Positions of an epilogue's arguments after `operands` leading ones: the bias (if any), the
/// residual (if any), and the output that follows them.
pub(crate) fn epilogue_args(operands: usize, ep: &kairos_core::plan::EpilogueParams) -> (Option<usize>, Option<usize>, usize) {
    let bias = ep.bias.then_some(operands);
    let res = ep.residual.then_some(operands + ep.bias as usize);
    (bias, res, operands + ep.bias as usize + ep.residual as usize)
}

/// A read-only typed view of an argument.
#[derive(Clone, Copy)]
pub(crate) enum Elems<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    I64(&'a [i64]),
}

impl<'a> Elems<'a> {
    pub fn new(bytes: &'a [u8], dtype: DType) -> Elems<'a> {
        let n = bytes.len() / dtype.size_bytes();
        let b = &bytes[..n * dtype.size_bytes()];
        match dtype {
            DType::F32 => Elems::F32(bytemuck::cast_slice(b)),
            DType::F16 => Elems::F16(bytemuck::cast_slice(b)),
            DType::I64 => Elems::I64(bytemuck::cast_slice(b)),
        }
    }

    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Elems::F32(v) => v[i],
            Elems::F16(v) => v[i].to_f32(),
            Elems::I64(v) => v[i] as f32,
        }
    }

    /// Copies `n` elements from `start` into `out` as f32.
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Elems::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Elems::F16(v) => {
                for (o, x) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = x.to_f32();
                }
            }
            Elems::I64(v) => {
                for (o, x) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = *x as f32;
                }
            }
        }
    }
}

/// A writable typed view of an argument.
pub(crate) enum ElemsMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    /// Integers computed in f32 (exact below 2^24) and truncated toward zero, as the GPU's
    /// `cvt.rzi` does (NaN becomes 0, out-of-range values saturate).
    I64(&'a mut [i64]),
}

impl<'a> ElemsMut<'a> {
    pub fn new(bytes: &'a mut [u8], dtype: DType) -> ElemsMut<'a> {
        let n = bytes.len() / dtype.size_bytes();
        let b = &mut bytes[..n * dtype.size_bytes()];
        match dtype {
            DType::F32 => ElemsMut::F32(bytemuck::cast_slice_mut(b)),
            DType::F16 => ElemsMut::F16(bytemuck::cast_slice_mut(b)),
            DType::I64 => ElemsMut::I64(bytemuck::cast_slice_mut(b)),
        }
    }

    #[inline(always)]
    pub fn set(&mut self, i: usize, v: f32) {
        match self {
            ElemsMut::F32(o) => o[i] = v,
            ElemsMut::F16(o) => o[i] = f16::from_f32(v),
            ElemsMut::I64(o) => o[i] = v as i64,
        }
    }

    /// Writes `vals` at consecutive positions from `start`.
    pub fn write_from(&mut self, start: usize, vals: &[f32]) {
        match self {
            ElemsMut::F32(o) => o[start..start + vals.len()].copy_from_slice(vals),
            ElemsMut::F16(o) => {
                for (d, s) in o[start..start + vals.len()].iter_mut().zip(vals) {
                    *d = f16::from_f32(*s);
                }
            }
            ElemsMut::I64(o) => {
                for (d, s) in o[start..start + vals.len()].iter_mut().zip(vals) {
                    *d = *s as i64;
                }
            }
        }
    }
}

//! Lowering: from the graph IR to a kernel plan.
//!
//! 1. [`fuse`]: constant folding, canonical forms, and fusion (batch norm into convolutions;
//!    bias, residual add and activation into convolution and matrix-product epilogues; GELU,
//!    layer norm and scaled causal softmax recognized from their decomposed forms; affine chains).
//! 2. [`emit`]: a layout per tensor (NHWC images, row-major sequences), views for reshapes,
//!    transposes, slices and concatenations, kernel selection, the weight blob with one layer per
//!    launch, arena planning, and complete launch dependencies.

pub mod emit;
pub mod fuse;

use crate::Error;
use crate::graph::Graph;
use crate::plan::Plan;
use crate::tensor::DType;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Clone, Copy, Debug)]
pub struct LowerOptions {
    /// Storage type of activations and weights; accumulation is f32 either way.
    pub dtype: DType,
    /// Cut long fp16 reductions into split-K slices ([`emit::split_k_for`]). Off by default: on
    /// the H200 it sped VGG-19 up (batch 1: 1.66 -> 1.44 ms) but not the zoo's geometric mean, and
    /// its GPU kernel checks have not run yet (docs/benchmarks.md).
    pub split_k: bool,
}

/// Whether [`LowerOptions::new`] turns split-K on: off unless a program sets it with
/// [`set_split_k_default`] (the binary does for `KAIROS_SPLIT_K=1`, the latency benchmark's A/B).
/// This crate never reads the environment.
static SPLIT_K_DEFAULT: AtomicBool = AtomicBool::new(false);

/// Sets what [`LowerOptions::new`] chooses for split-K in this process (before planning models).
pub fn set_split_k_default(on: bool) {
    SPLIT_K_DEFAULT.store(on, Ordering::Relaxed);
}

/// Whether activations other than ReLU join convolution and product epilogues ([`fuse::optimize`]):
/// on unless a program turns it off with [`set_fuse_acts_default`] (the binary does for
/// `KAIROS_FUSE_ACTS=0`: an A/B of the tensor-core engine's out-of-line activation epilogue
/// against element-wise launches). This crate never reads the environment.
static FUSE_ACTS_DEFAULT: AtomicBool = AtomicBool::new(true);

/// Sets whether this process fuses activations other than ReLU into epilogues.
pub fn set_fuse_acts_default(on: bool) {
    FUSE_ACTS_DEFAULT.store(on, Ordering::Relaxed);
}

pub(crate) fn fuse_acts_default() -> bool {
    FUSE_ACTS_DEFAULT.load(Ordering::Relaxed)
}

impl LowerOptions {
    /// Options at `dtype`; split-K as [`set_split_k_default`] chose (off by default).
    pub fn new(dtype: DType) -> LowerOptions {
        LowerOptions { dtype, split_k: SPLIT_K_DEFAULT.load(Ordering::Relaxed) }
    }
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions::new(DType::F32)
    }
}

/// The graph after fusion, before kernels are chosen (what `kairos inspect` reports as fused ops).
pub fn optimized(graph: &Graph) -> Graph {
    let mut g = graph.clone();
    fuse::optimize(&mut g);
    g
}

pub fn lower(graph: &Graph, opts: &LowerOptions) -> Result<Plan, Error> {
    if opts.dtype == DType::I64 {
        return Err(Error::Invalid("plans store activations as f32 or f16, not i64".into()));
    }
    let g = optimized(graph);
    emit::emit(&g, opts.dtype, opts.split_k)
}

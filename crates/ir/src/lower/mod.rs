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

#[derive(Clone, Copy, Debug)]
pub struct LowerOptions {
    /// Storage type of activations and weights; accumulation is f32 either way.
    pub dtype: DType,
    /// Cut long fp16 reductions into split-K slices ([`emit::split_k_for`]). Off by default: on
    /// the H200 it sped VGG-19 up (batch 1: 1.66 -> 1.44 ms) but not the zoo's geometric mean, and
    /// its GPU kernel checks have not run yet (docs/benchmarks.md).
    pub split_k: bool,
}

/// Set to `1` to lower with split-K (the latency benchmark's A/B); read by [`LowerOptions::new`].
pub const SPLIT_K_ENV: &str = "KAIROS_SPLIT_K";

impl LowerOptions {
    /// Options at `dtype`; split-K only with `KAIROS_SPLIT_K=1`.
    pub fn new(dtype: DType) -> LowerOptions {
        let split_k = std::env::var(SPLIT_K_ENV).is_ok_and(|v| v.trim() == "1");
        LowerOptions { dtype, split_k }
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

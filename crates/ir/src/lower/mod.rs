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
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions { dtype: DType::F32 }
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
    emit::emit(&g, opts.dtype)
}

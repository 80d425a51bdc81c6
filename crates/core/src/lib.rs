//! kairos-core: the plain data every layer shares — tensors and dtypes ([`tensor`]), the graph
//! IR's node types ([`graph`]) and plans ([`plan`]: kernel launches with their parameters,
//! logical blocks, arguments and dependencies). It depends on no ONNX runtime, so the client and
//! the `Gpu` trait build without tract; kairos-ir re-exports these modules under the same paths
//! (`kairos_ir::plan::Plan` is `kairos_core::plan::Plan`).

#![forbid(unsafe_code)]

pub mod graph;
pub mod plan;
pub mod tensor;

pub use tensor::{DType, Tensor, TensorData};

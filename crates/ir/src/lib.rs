//! kairos-ir: tensors, the graph IR, the ONNX front door, the model zoo, lowering and kernel plans.

#![forbid(unsafe_code)]

pub mod interp;
pub mod lower;
pub mod model;
pub mod npy;
pub mod onnx;
pub mod signature;
pub mod zoo;

/// The plain data types live in kairos-core (no ONNX runtime there); re-exported here under the
/// same paths.
pub use kairos_core::{graph, plan, tensor};
pub use tensor::{DType, Tensor, TensorData};

/// Errors of the IR layer: loading, importing and lowering models.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown model '{0}': not a zoo name and not an .onnx file")]
    UnknownModel(String),
    #[error("model '{model}': cannot read ONNX: {reason}")]
    Malformed { model: String, reason: String },
    #[error("model '{model}': unsupported op {op} at node '{node}'{detail}")]
    Unsupported { model: String, op: String, node: String, detail: String },
    #[error("{0}")]
    Invalid(String),
    #[error("io error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

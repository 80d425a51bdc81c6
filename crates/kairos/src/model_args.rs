//! Command-line arguments shared by every command that takes a model.

use clap::Args;
use kairos_ir::DType;
use kairos_ir::model::ModelSpec;

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// An .onnx file or a zoo model name (`kairos zoo list`).
    pub model: String,
    /// Storage type of activations and weights: f32 or f16 (accumulation is f32 either way).
    #[arg(long, env = "KAIROS_DTYPE", default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Batch size (zoo models, and the dynamic batch dimension of .onnx files).
    #[arg(long, env = "KAIROS_BATCH", default_value_t = 1)]
    pub batch: usize,
    /// Sequence length of transformer zoo models, and other dynamic dimensions of .onnx files.
    #[arg(long, env = "KAIROS_SEQ_LEN", default_value_t = kairos_ir::zoo::DEFAULT_SEQ_LEN)]
    pub seq_len: usize,
    /// Seed of the zoo's random weights.
    #[arg(long, env = "KAIROS_SEED", default_value_t = kairos_ir::zoo::DEFAULT_SEED)]
    pub seed: u64,
}

pub fn parse_dtype(s: &str) -> Result<DType, String> {
    match DType::parse(s) {
        Some(d @ (DType::F32 | DType::F16)) => Ok(d),
        _ => Err(format!("'{s}' is not a float type: use f32 or f16")),
    }
}

impl ModelArgs {
    pub fn spec(&self) -> ModelSpec {
        ModelSpec { model: self.model.clone(), batch: self.batch, seq_len: self.seq_len, seed: self.seed, dtype: self.dtype }
    }
}

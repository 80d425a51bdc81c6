//! Resolving what users call a model: a path to an .onnx file or the name of a zoo model.

use crate::Error;
use crate::graph::Graph;
use crate::lower::{LowerOptions, lower};
use crate::onnx::{LoadOptions, load_bytes};
use crate::plan::Plan;
use crate::tensor::DType;
use crate::zoo::{self, ZooOptions};
use std::path::Path;

#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// An .onnx path or a zoo name.
    pub model: String,
    pub batch: usize,
    pub seq_len: usize,
    pub seed: u64,
    pub dtype: DType,
}

impl ModelSpec {
    pub fn new(model: &str) -> ModelSpec {
        ModelSpec {
            model: model.to_string(),
            batch: 1,
            seq_len: zoo::DEFAULT_SEQ_LEN,
            seed: zoo::DEFAULT_SEED,
            dtype: DType::F32,
        }
    }

    pub fn is_file(&self) -> bool {
        self.model.ends_with(".onnx") || Path::new(&self.model).is_file()
    }

    /// A short name: the zoo name, or the file's stem.
    pub fn name(&self) -> String {
        if self.is_file() {
            Path::new(&self.model).file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| self.model.clone())
        } else {
            self.model.clone()
        }
    }

    /// The model's ONNX bytes (read from disk or built by the zoo).
    pub fn onnx_bytes(&self) -> Result<Vec<u8>, Error> {
        if self.is_file() {
            std::fs::read(&self.model).map_err(|e| Error::Io { path: self.model.clone(), source: e })
        } else {
            zoo::build(&self.model, &ZooOptions { batch: self.batch, seq_len: self.seq_len, seed: self.seed })
        }
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions { batch: Some(self.batch), seq_len: Some(self.seq_len) }
    }

    pub fn graph(&self) -> Result<Graph, Error> {
        let bytes = self.onnx_bytes()?;
        load_bytes(&self.name(), &bytes, &self.load_options())
    }

    pub fn plan(&self) -> Result<Plan, Error> {
        lower(&self.graph()?, &LowerOptions::new(self.dtype))
    }
}

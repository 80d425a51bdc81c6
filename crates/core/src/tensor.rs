//! Dense host tensors: the values that flow in and out of plans, and the constants of graphs.

use half::f16;
use serde::{Deserialize, Serialize};

/// Element types kairos moves through plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    I64,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
            DType::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::I64 => "i64",
        }
    }

    /// The KServe v2 datatype string.
    pub fn kserve_name(self) -> &'static str {
        match self {
            DType::F32 => "FP32",
            DType::F16 => "FP16",
            DType::I64 => "INT64",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Some(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Some(DType::F16),
            "i64" | "int64" => Some(DType::I64),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The elements of a tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    I64(Vec<i64>),
}

/// A dense row-major host tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: TensorData,
}

pub fn element_count(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        assert_eq!(element_count(&shape), data.len(), "shape {shape:?} does not match {} elements", data.len());
        Tensor { shape, data: TensorData::F32(data) }
    }

    pub fn f16(shape: Vec<usize>, data: Vec<f16>) -> Tensor {
        assert_eq!(element_count(&shape), data.len(), "shape {shape:?} does not match {} elements", data.len());
        Tensor { shape, data: TensorData::F16(data) }
    }

    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Tensor {
        assert_eq!(element_count(&shape), data.len(), "shape {shape:?} does not match {} elements", data.len());
        Tensor { shape, data: TensorData::I64(data) }
    }

    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n = element_count(&shape);
        let data = match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::F16 => TensorData::F16(vec![f16::ZERO; n]),
            DType::I64 => TensorData::I64(vec![0; n]),
        };
        Tensor { shape, data }
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            TensorData::F32(_) => DType::F32,
            TensorData::F16(_) => DType::F16,
            TensorData::I64(_) => DType::I64,
        }
    }

    pub fn len(&self) -> usize {
        element_count(&self.shape)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn size_bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    /// The elements converted to f32 (i64 converts by value).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            TensorData::F32(v) => v.clone(),
            TensorData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            TensorData::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Converts float tensors to `dtype`; i64 tensors stay as they are.
    pub fn cast(&self, dtype: DType) -> Tensor {
        let shape = self.shape.clone();
        match (&self.data, dtype) {
            (_, d) if d == self.dtype() => self.clone(),
            (TensorData::I64(v), DType::F32) => Tensor::f32(shape, v.iter().map(|&x| x as f32).collect()),
            (TensorData::I64(v), DType::F16) => Tensor::f16(shape, v.iter().map(|&x| f16::from_f32(x as f32)).collect()),
            (_, DType::F32) => Tensor::f32(shape, self.to_f32_vec()),
            (_, DType::F16) => Tensor::f16(shape, self.to_f32_vec().into_iter().map(f16::from_f32).collect()),
            (_, DType::I64) => Tensor::i64(shape, self.to_f32_vec().into_iter().map(|x| x as i64).collect()),
        }
    }

    /// Little-endian bytes of the elements.
    pub fn to_bytes(&self) -> Vec<u8> {
        match &self.data {
            TensorData::F32(v) => bytemuck::cast_slice(v).to_vec(),
            TensorData::F16(v) => bytemuck::cast_slice(v).to_vec(),
            TensorData::I64(v) => bytemuck::cast_slice(v).to_vec(),
        }
    }

    /// Builds a tensor from little-endian bytes; fails when the byte count does not match.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<Tensor, String> {
        let n = element_count(&shape);
        if bytes.len() != n * dtype.size_bytes() {
            return Err(format!(
                "{} bytes do not hold a {dtype} tensor of shape {shape:?} ({} bytes expected)",
                bytes.len(),
                n * dtype.size_bytes()
            ));
        }
        let data = match dtype {
            DType::F32 => TensorData::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()),
            DType::F16 => TensorData::F16(bytes.chunks_exact(2).map(|c| f16::from_le_bytes(c.try_into().unwrap())).collect()),
            DType::I64 => TensorData::I64(bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()),
        };
        Ok(Tensor { shape, data })
    }
}

/// Relative L2 error ||a - b|| / ||b|| (b is the reference). NaN in either gives infinity.
pub fn relative_l2_error(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(actual.len(), reference.len(), "compared tensors differ in length");
    let mut diff = 0.0f64;
    let mut norm = 0.0f64;
    for (&a, &r) in actual.iter().zip(reference) {
        if !a.is_finite() || !r.is_finite() {
            return f64::INFINITY;
        }
        diff += (a as f64 - r as f64).powi(2);
        norm += (r as f64).powi(2);
    }
    if norm == 0.0 { if diff == 0.0 { 0.0 } else { f64::INFINITY } } else { (diff / norm).sqrt() }
}

/// Root mean square of the elements: tests use it to check outputs are not near zero.
pub fn rms(values: &[f32]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    (values.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / values.len() as f64).sqrt()
}

//! A model's signature as the ONNX file declares it: each graph input's and output's name,
//! element type and dimensions, fixed or dynamic (a symbol such as `batch`, or unnamed). Read
//! straight from the protobuf, without typing the graph, so it is cheap and shows what the import
//! (`onnx.rs`) fixes: a dynamic axis 0 takes the load's batch, every other dynamic axis its
//! sequence length.

use crate::Error;
use crate::tensor::DType;
use prost::Message;
use tract_onnx::pb;

/// One dimension of a declared tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Fixed(usize),
    /// A dynamic dimension: its symbol (`dim_param`), or `?` when the file names none.
    Symbol(String),
}

impl Dim {
    pub fn is_dynamic(&self) -> bool {
        matches!(self, Dim::Symbol(_))
    }
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Fixed(v) => write!(f, "{v}"),
            Dim::Symbol(s) => write!(f, "{s}"),
        }
    }
}

/// What a dynamic axis of an input becomes when the model is imported at a fixed shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AxisRole {
    /// Axis 0: the load's batch.
    Batch,
    /// Any other dynamic axis: the load's sequence length.
    Seq,
}

/// A graph input or output as declared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSignature {
    pub name: String,
    /// ONNX's element type number (1 float, 10 float16, 7 int64, ...).
    pub elem_type: i32,
    pub dims: Vec<Dim>,
}

impl TensorSignature {
    /// The element type as kairos names it, if it has one.
    pub fn dtype(&self) -> Option<DType> {
        match self.elem_type {
            1 => Some(DType::F32),
            10 => Some(DType::F16),
            7 => Some(DType::I64),
            _ => None,
        }
    }

    /// The role of each axis: `None` for a fixed one.
    pub fn roles(&self) -> Vec<Option<AxisRole>> {
        self.dims
            .iter()
            .enumerate()
            .map(|(axis, d)| match (d, axis) {
                (Dim::Fixed(_), _) => None,
                (Dim::Symbol(_), 0) => Some(AxisRole::Batch),
                (Dim::Symbol(_), _) => Some(AxisRole::Seq),
            })
            .collect()
    }

    /// `[batch, seq, 16]`.
    pub fn dims_text(&self) -> String {
        format!("[{}]", self.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
    }
}

/// The declared graph inputs (initializers listed as inputs left out) and outputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    pub inputs: Vec<TensorSignature>,
    pub outputs: Vec<TensorSignature>,
}

impl Signature {
    /// Some input has a dynamic axis 0.
    pub fn has_dynamic_batch(&self) -> bool {
        self.inputs.iter().any(|t| t.roles().first().copied().flatten() == Some(AxisRole::Batch))
    }

    /// Some input has a dynamic axis other than axis 0.
    pub fn has_dynamic_seq(&self) -> bool {
        self.inputs.iter().any(|t| t.roles().contains(&Some(AxisRole::Seq)))
    }
}

fn tensor_signature(model: &str, v: &pb::ValueInfoProto) -> Result<TensorSignature, Error> {
    let Some(pb::type_proto::Value::TensorType(t)) = v.r#type.as_ref().and_then(|t| t.value.as_ref()) else {
        return Err(Error::Malformed { model: model.to_string(), reason: format!("'{}' is not a tensor", v.name) });
    };
    use pb::tensor_shape_proto::dimension::Value;
    let dims = t
        .shape
        .as_ref()
        .map(|s| s.dim.as_slice())
        .unwrap_or(&[])
        .iter()
        .map(|d| match &d.value {
            Some(Value::DimValue(n)) if *n > 0 => Dim::Fixed(*n as usize),
            Some(Value::DimParam(p)) if !p.is_empty() => Dim::Symbol(p.clone()),
            _ => Dim::Symbol("?".into()),
        })
        .collect();
    Ok(TensorSignature { name: v.name.clone(), elem_type: t.elem_type, dims })
}

/// Reads the signature of serialized ONNX bytes (`name` for error messages).
pub fn read_signature(name: &str, bytes: &[u8]) -> Result<Signature, Error> {
    let model = pb::ModelProto::decode(bytes)
        .map_err(|e| Error::Malformed { model: name.to_string(), reason: format!("not an ONNX protobuf: {e}") })?;
    let graph = model.graph.as_ref().ok_or_else(|| Error::Malformed { model: name.to_string(), reason: "no graph".into() })?;
    let initializers: std::collections::HashSet<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    let inputs = graph
        .input
        .iter()
        .filter(|i| !initializers.contains(i.name.as_str()))
        .map(|v| tensor_signature(name, v))
        .collect::<Result<_, _>>()?;
    let outputs = graph.output.iter().map(|v| tensor_signature(name, v)).collect::<Result<_, _>>()?;
    Ok(Signature { inputs, outputs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zoo::builder::OnnxBuilder;

    #[test]
    fn symbols_fixed_and_unnamed_dims() {
        let mut b = OnnxBuilder::new("dyn", 17, 1);
        let x = b.input_dims("x", DType::F32, &[Dim::Symbol("batch".into()), Dim::Symbol("seq".into()), Dim::Fixed(16)]);
        let y = b.matmul_linear(&x, "fc", 16, 4, 0.1);
        b.output_dims(&y, "y", DType::F32, &[Dim::Symbol("batch".into()), Dim::Symbol("?".into()), Dim::Fixed(4)]);
        let s = read_signature("dyn", &b.finish_bytes()).unwrap();
        assert_eq!(s.inputs.len(), 1);
        assert_eq!(s.inputs[0].dims_text(), "[batch, seq, 16]");
        assert_eq!(s.inputs[0].dtype(), Some(DType::F32));
        assert_eq!(s.inputs[0].roles(), vec![Some(AxisRole::Batch), Some(AxisRole::Seq), None]);
        assert_eq!(s.outputs[0].dims_text(), "[batch, ?, 4]");
        assert!(s.has_dynamic_batch() && s.has_dynamic_seq());
    }

    #[test]
    fn a_fixed_model_has_no_dynamic_axis() {
        let bytes = crate::zoo::build("resnet18", &Default::default()).unwrap();
        let s = read_signature("resnet18", &bytes).unwrap();
        assert_eq!(s.inputs[0].dims, vec![Dim::Fixed(1), Dim::Fixed(3), Dim::Fixed(224), Dim::Fixed(224)]);
        assert!(!s.has_dynamic_batch() && !s.has_dynamic_seq());
        assert!(read_signature("junk", b"\xff\xff not onnx").is_err());
    }
}

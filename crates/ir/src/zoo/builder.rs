//! A small ONNX graph builder with seeded random weights, used by the zoo.
//!
//! The zoo is written as ONNX so that the one front door (tract parse, type, declutter, then
//! our import) serves zoo models and user files alike.

use crate::signature::Dim;
use crate::tensor::{DType, Tensor, TensorData};
use prost::Message;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use tract_onnx::pb;

/// ONNX TensorProto data types.
pub const ONNX_FLOAT: i32 = 1;
pub const ONNX_BOOL: i32 = 9;
pub const ONNX_INT64: i32 = 7;
pub const ONNX_FLOAT16: i32 = 10;

pub fn onnx_elem_type(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => ONNX_FLOAT,
        DType::F16 => ONNX_FLOAT16,
        DType::I64 => ONNX_INT64,
    }
}

pub enum Attr {
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
    Str(&'static str),
    Tensor(Tensor),
}

pub struct OnnxBuilder {
    graph: pb::GraphProto,
    opset: i64,
    rng: SmallRng,
    next_id: usize,
    pub weight_count: usize,
}

impl OnnxBuilder {
    pub fn new(name: &str, opset: i64, seed: u64) -> OnnxBuilder {
        let graph = pb::GraphProto { name: name.to_string(), ..Default::default() };
        OnnxBuilder { graph, opset, rng: SmallRng::seed_from_u64(seed), next_id: 0, weight_count: 0 }
    }

    pub(crate) fn fresh(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}_{}", self.next_id)
    }

    fn value_info(name: &str, dtype_onnx: i32, shape: &[usize]) -> pb::ValueInfoProto {
        use pb::tensor_shape_proto::{Dimension, dimension::Value};
        let dims = shape.iter().map(|&d| Dimension { value: Some(Value::DimValue(d as i64)), ..Default::default() }).collect();
        pb::ValueInfoProto {
            name: name.to_string(),
            r#type: Some(pb::TypeProto {
                value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                    elem_type: dtype_onnx,
                    shape: Some(pb::TensorShapeProto { dim: dims }),
                })),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A graph input with dynamic dimensions ([`Dim::Symbol`]) where the model takes any size.
    pub fn input_dims(&mut self, name: &str, dtype: DType, dims: &[Dim]) -> String {
        self.graph.input.push(Self::value_info_dims(name, onnx_elem_type(dtype), dims));
        name.to_string()
    }

    /// [`OnnxBuilder::output`] with dynamic dimensions.
    pub fn output_dims(&mut self, value: &str, name: &str, dtype: DType, dims: &[Dim]) {
        self.output(value, name, dtype, &[]);
        let out = self.graph.output.last_mut().expect("output just added");
        *out = Self::value_info_dims(&out.name, onnx_elem_type(dtype), dims);
    }

    fn value_info_dims(name: &str, dtype_onnx: i32, dims: &[Dim]) -> pb::ValueInfoProto {
        use pb::tensor_shape_proto::dimension::Value;
        let mut v = Self::value_info(name, dtype_onnx, &[]);
        if let Some(pb::type_proto::Value::TensorType(t)) = v.r#type.as_mut().and_then(|t| t.value.as_mut()) {
            t.shape = Some(pb::TensorShapeProto {
                dim: dims
                    .iter()
                    .map(|d| pb::tensor_shape_proto::Dimension {
                        value: Some(match d {
                            Dim::Fixed(n) => Value::DimValue(*n as i64),
                            Dim::Symbol(s) => Value::DimParam(s.clone()),
                        }),
                        ..Default::default()
                    })
                    .collect(),
            });
        }
        v
    }

    pub fn input(&mut self, name: &str, dtype: DType, shape: &[usize]) -> String {
        self.graph.input.push(Self::value_info(name, onnx_elem_type(dtype), shape));
        name.to_string()
    }

    /// Marks `value` as a graph output named `name` (through an Identity when the names differ).
    pub fn output(&mut self, value: &str, name: &str, dtype: DType, shape: &[usize]) {
        let v = if value == name {
            value.to_string()
        } else {
            self.graph.node.push(pb::NodeProto {
                input: vec![value.to_string()],
                output: vec![name.to_string()],
                name: format!("{name}_identity"),
                op_type: "Identity".into(),
                ..Default::default()
            });
            name.to_string()
        };
        self.graph.output.push(Self::value_info(&v, onnx_elem_type(dtype), shape));
    }

    pub fn init(&mut self, name: &str, t: &Tensor) -> String {
        let mut proto = pb::TensorProto {
            name: name.to_string(),
            dims: t.shape.iter().map(|&d| d as i64).collect(),
            data_type: onnx_elem_type(t.dtype()),
            ..Default::default()
        };
        proto.raw_data = t.to_bytes();
        if let TensorData::F32(v) = &t.data {
            self.weight_count += v.len();
        }
        self.graph.initializer.push(proto);
        name.to_string()
    }

    pub fn init_bool(&mut self, name: &str, shape: &[usize], values: &[bool]) -> String {
        let proto = pb::TensorProto {
            name: name.to_string(),
            dims: shape.iter().map(|&d| d as i64).collect(),
            data_type: ONNX_BOOL,
            raw_data: values.iter().map(|&b| b as u8).collect(),
            ..Default::default()
        };
        self.graph.initializer.push(proto);
        name.to_string()
    }

    pub fn const_i64(&mut self, values: &[i64]) -> String {
        let name = self.fresh("const");
        self.init(&name, &Tensor::i64(vec![values.len()], values.to_vec()))
    }

    pub fn const_f32_scalar(&mut self, value: f32) -> String {
        let name = self.fresh("const");
        self.init(&name, &Tensor::f32(vec![], vec![value]))
    }

    /// Uniform values in [-bound, bound].
    pub fn uniform(&mut self, name: &str, shape: &[usize], bound: f32) -> String {
        let n: usize = shape.iter().product();
        let data = (0..n).map(|_| self.rng.random_range(-bound..=bound)).collect();
        self.init(name, &Tensor::f32(shape.to_vec(), data))
    }

    /// Uniform values in [lo, hi].
    pub fn uniform_range(&mut self, name: &str, shape: &[usize], lo: f32, hi: f32) -> String {
        let n: usize = shape.iter().product();
        let data = (0..n).map(|_| self.rng.random_range(lo..=hi)).collect();
        self.init(name, &Tensor::f32(shape.to_vec(), data))
    }

    pub fn node(&mut self, op_type: &str, name: &str, inputs: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        let out = if name.is_empty() { self.fresh(op_type) } else { format!("{name}_out") };
        self.node_multi(op_type, name, inputs, &[&out], attrs);
        out
    }

    pub fn node_multi(&mut self, op_type: &str, name: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<(&str, Attr)>) {
        let attribute = attrs
            .into_iter()
            .map(|(n, a)| {
                let mut p = pb::AttributeProto { name: n.to_string(), ..Default::default() };
                match a {
                    Attr::Int(i) => {
                        p.i = i;
                        p.r#type = pb::attribute_proto::AttributeType::Int as i32;
                    }
                    Attr::Ints(v) => {
                        p.ints = v;
                        p.r#type = pb::attribute_proto::AttributeType::Ints as i32;
                    }
                    Attr::Float(f) => {
                        p.f = f;
                        p.r#type = pb::attribute_proto::AttributeType::Float as i32;
                    }
                    Attr::Str(s) => {
                        p.s = s.as_bytes().to_vec();
                        p.r#type = pb::attribute_proto::AttributeType::String as i32;
                    }
                    Attr::Tensor(t) => {
                        p.t = Some(pb::TensorProto {
                            dims: t.shape.iter().map(|&d| d as i64).collect(),
                            data_type: onnx_elem_type(t.dtype()),
                            raw_data: t.to_bytes(),
                            ..Default::default()
                        });
                        p.r#type = pb::attribute_proto::AttributeType::Tensor as i32;
                    }
                }
                p
            })
            .collect();
        let node_name = if name.is_empty() { self.fresh(op_type) } else { name.to_string() };
        self.graph.node.push(pb::NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            name: node_name,
            op_type: op_type.to_string(),
            attribute,
            ..Default::default()
        });
    }

    pub fn finish(self) -> pb::ModelProto {
        pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: self.opset }],
            producer_name: "kairos-zoo".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            graph: Some(self.graph),
            ..Default::default()
        }
    }

    pub fn finish_bytes(self) -> Vec<u8> {
        self.finish().encode_to_vec()
    }

    // ---- layers -------------------------------------------------------------------------

    /// Conv with He-uniform weights (gain for ReLU), optional bias.
    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        &mut self,
        x: &str,
        name: &str,
        cin: usize,
        cout: usize,
        kernel: (usize, usize),
        stride: usize,
        pad: (usize, usize),
        groups: usize,
        bias: bool,
    ) -> String {
        self.conv_full(x, name, cin, cout, kernel, (stride, stride), pad, (1, 1), groups, bias)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn conv_full(
        &mut self,
        x: &str,
        name: &str,
        cin: usize,
        cout: usize,
        kernel: (usize, usize),
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
        groups: usize,
        bias: bool,
    ) -> String {
        let fan_in = cin / groups * kernel.0 * kernel.1;
        let bound = (6.0 / fan_in as f32).sqrt();
        let w = self.uniform(&format!("{name}.weight"), &[cout, cin / groups, kernel.0, kernel.1], bound);
        let mut inputs = vec![x.to_string(), w];
        if bias {
            let b = self.uniform(&format!("{name}.bias"), &[cout], 0.1);
            inputs.push(b);
        }
        let refs: Vec<&str> = inputs.iter().map(|s| s.as_str()).collect();
        self.node(
            "Conv",
            name,
            &refs,
            vec![
                ("kernel_shape", Attr::Ints(vec![kernel.0 as i64, kernel.1 as i64])),
                ("strides", Attr::Ints(vec![stride.0 as i64, stride.1 as i64])),
                ("pads", Attr::Ints(vec![pad.0 as i64, pad.1 as i64, pad.0 as i64, pad.1 as i64])),
                ("dilations", Attr::Ints(vec![dilation.0 as i64, dilation.1 as i64])),
                ("group", Attr::Int(groups as i64)),
            ],
        )
    }

    /// BatchNormalization in inference mode with random statistics. `gamma` bounds the scale:
    /// the last BN of a residual branch gets a small scale so deep networks keep sensible magnitudes.
    pub fn bn(&mut self, x: &str, name: &str, c: usize, eps: f32, gamma: (f32, f32)) -> String {
        let s = self.uniform_range(&format!("{name}.weight"), &[c], gamma.0, gamma.1);
        let b = self.uniform(&format!("{name}.bias"), &[c], 0.1);
        let m = self.uniform(&format!("{name}.running_mean"), &[c], 0.1);
        let v = self.uniform_range(&format!("{name}.running_var"), &[c], 0.5, 1.5);
        self.node("BatchNormalization", name, &[x, &s, &b, &m, &v], vec![("epsilon", Attr::Float(eps))])
    }

    pub fn relu(&mut self, x: &str) -> String {
        self.node("Relu", "", &[x], vec![])
    }

    pub fn relu6(&mut self, x: &str) -> String {
        let lo = self.const_f32_scalar(0.0);
        let hi = self.const_f32_scalar(6.0);
        self.node("Clip", "", &[x, &lo, &hi], vec![])
    }

    pub fn add(&mut self, a: &str, b: &str) -> String {
        self.node("Add", "", &[a, b], vec![])
    }

    pub fn mul(&mut self, a: &str, b: &str) -> String {
        self.node("Mul", "", &[a, b], vec![])
    }

    pub fn maxpool(&mut self, x: &str, k: usize, stride: usize, pad: usize, ceil: bool) -> String {
        self.node(
            "MaxPool",
            "",
            &[x],
            vec![
                ("kernel_shape", Attr::Ints(vec![k as i64, k as i64])),
                ("strides", Attr::Ints(vec![stride as i64, stride as i64])),
                ("pads", Attr::Ints(vec![pad as i64; 4])),
                ("ceil_mode", Attr::Int(ceil as i64)),
            ],
        )
    }

    pub fn avgpool(&mut self, x: &str, k: usize, stride: usize, pad: usize, count_include_pad: bool) -> String {
        self.node(
            "AveragePool",
            "",
            &[x],
            vec![
                ("kernel_shape", Attr::Ints(vec![k as i64, k as i64])),
                ("strides", Attr::Ints(vec![stride as i64, stride as i64])),
                ("pads", Attr::Ints(vec![pad as i64; 4])),
                ("count_include_pad", Attr::Int(count_include_pad as i64)),
            ],
        )
    }

    pub fn global_avgpool(&mut self, x: &str) -> String {
        self.node("GlobalAveragePool", "", &[x], vec![])
    }

    pub fn flatten(&mut self, x: &str) -> String {
        self.node("Flatten", "", &[x], vec![("axis", Attr::Int(1))])
    }

    pub fn concat(&mut self, xs: &[&str], axis: i64) -> String {
        self.node("Concat", "", xs, vec![("axis", Attr::Int(axis))])
    }

    /// Fully connected layer as Gemm(transB=1), as PyTorch's TorchScript exporter writes nn.Linear on 2-D inputs.
    pub fn gemm_linear(&mut self, x: &str, name: &str, fin: usize, fout: usize) -> String {
        let bound = (3.0 / fin as f32).sqrt();
        let w = self.uniform(&format!("{name}.weight"), &[fout, fin], bound);
        let b = self.uniform(&format!("{name}.bias"), &[fout], 0.1);
        self.node(
            "Gemm",
            name,
            &[x, &w, &b],
            vec![("transB", Attr::Int(1)), ("alpha", Attr::Float(1.0)), ("beta", Attr::Float(1.0))],
        )
    }

    /// Linear layer on N-D inputs as MatMul with a [in, out] weight plus Add, as exporters write nn.Linear on 3-D inputs.
    pub fn matmul_linear(&mut self, x: &str, name: &str, fin: usize, fout: usize, std: f32) -> String {
        let bound = std * 3f32.sqrt();
        let w = self.uniform(&format!("{name}.weight"), &[fin, fout], bound);
        let b = self.uniform(&format!("{name}.bias"), &[fout], 0.02);
        let y = self.node("MatMul", &format!("{name}.matmul"), &[x, &w], vec![]);
        self.node("Add", &format!("{name}.bias_add"), &[&y, &b], vec![])
    }

    pub fn reshape(&mut self, x: &str, shape: &[i64]) -> String {
        let s = self.const_i64(shape);
        self.node("Reshape", "", &[x, &s], vec![])
    }

    pub fn transpose(&mut self, x: &str, perm: &[i64]) -> String {
        self.node("Transpose", "", &[x], vec![("perm", Attr::Ints(perm.to_vec()))])
    }

    /// LayerNormalization over the last axis (opset 17).
    pub fn layer_norm_op(&mut self, x: &str, name: &str, c: usize, eps: f32) -> String {
        let g = self.uniform_range(&format!("{name}.weight"), &[c], 0.8, 1.2);
        let b = self.uniform(&format!("{name}.bias"), &[c], 0.1);
        self.node("LayerNormalization", name, &[x, &g, &b], vec![("axis", Attr::Int(-1)), ("epsilon", Attr::Float(eps))])
    }

    /// LayerNorm spelled out as the TorchScript exporter writes it before opset 17:
    /// ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add.
    pub fn layer_norm_decomposed(&mut self, x: &str, name: &str, c: usize, eps: f32) -> String {
        let g = self.uniform_range(&format!("{name}.weight"), &[c], 0.8, 1.2);
        let b = self.uniform(&format!("{name}.bias"), &[c], 0.1);
        let axes = self.const_i64(&[-1]);
        let mean_attrs = || vec![("keepdims", Attr::Int(1))];
        let mean = if self.opset >= 18 {
            self.node("ReduceMean", "", &[x, &axes], mean_attrs())
        } else {
            self.node("ReduceMean", "", &[x], vec![("axes", Attr::Ints(vec![-1])), ("keepdims", Attr::Int(1))])
        };
        let d = self.node("Sub", "", &[x, &mean], vec![]);
        let two = self.const_f32_scalar(2.0);
        let sq = self.node("Pow", "", &[&d, &two], vec![]);
        let var = if self.opset >= 18 {
            self.node("ReduceMean", "", &[&sq, &axes], mean_attrs())
        } else {
            self.node("ReduceMean", "", &[&sq], vec![("axes", Attr::Ints(vec![-1])), ("keepdims", Attr::Int(1))])
        };
        let e = self.const_f32_scalar(eps);
        let ve = self.node("Add", "", &[&var, &e], vec![]);
        let sd = self.node("Sqrt", "", &[&ve], vec![]);
        let n = self.node("Div", "", &[&d, &sd], vec![]);
        let y = self.node("Mul", "", &[&n, &g], vec![]);
        self.node("Add", name, &[&y, &b], vec![])
    }

    /// GELU with erf, as exporters write torch.nn.GELU(): x * 0.5 * (1 + erf(x / sqrt(2))).
    pub fn gelu_erf(&mut self, x: &str) -> String {
        let s2 = self.const_f32_scalar(std::f32::consts::SQRT_2);
        let d = self.node("Div", "", &[x, &s2], vec![]);
        let e = self.node("Erf", "", &[&d], vec![]);
        let one = self.const_f32_scalar(1.0);
        let a = self.node("Add", "", &[&e, &one], vec![]);
        let m = self.node("Mul", "", &[x, &a], vec![]);
        let half = self.const_f32_scalar(0.5);
        self.node("Mul", "", &[&m, &half], vec![])
    }

    /// GPT-2's tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    pub fn gelu_tanh(&mut self, x: &str) -> String {
        let three = self.const_f32_scalar(3.0);
        let cube = self.node("Pow", "", &[x, &three], vec![]);
        let c = self.const_f32_scalar(0.044715);
        let cc = self.node("Mul", "", &[&cube, &c], vec![]);
        let inner = self.node("Add", "", &[x, &cc], vec![]);
        let k = self.const_f32_scalar((2.0 / std::f32::consts::PI).sqrt());
        let ki = self.node("Mul", "", &[&inner, &k], vec![]);
        let t = self.node("Tanh", "", &[&ki], vec![]);
        let one = self.const_f32_scalar(1.0);
        let a = self.node("Add", "", &[&t, &one], vec![]);
        let half = self.const_f32_scalar(0.5);
        let hx = self.node("Mul", "", &[x, &half], vec![]);
        self.node("Mul", "", &[&hx, &a], vec![])
    }

    pub fn softmax(&mut self, x: &str, axis: i64) -> String {
        self.node("Softmax", "", &[x], vec![("axis", Attr::Int(axis))])
    }
}

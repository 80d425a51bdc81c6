//! The ONNX front door: tract-onnx parses and types the model and runs its constant- and
//! mask-folding declutter passes; this module then maps tract's typed ops onto the graph IR.
//!
//! We keep tract's op-rewriting declutter passes out on purpose: they target tract's own CPU
//! runtime (1x1 convolutions become einsums, unit batch axes disappear, layer norms become RMS
//! norms) and would hide the structure our fusion passes look for.

use crate::Error;
use crate::graph::*;
use crate::tensor::{DType, Tensor};
use std::collections::HashMap;
use std::sync::Arc;
use tract_onnx::pb;
use tract_onnx::prelude::{
    DatumType, Framework, InferenceFact, InferenceModelExt, IntoRunnable, IntoTensor, OutletId, TDim, TValue, TVec,
    Tensor as TractTensor, TypedModel, TypedNode, tract_ndarray,
};
use tract_onnx::tract_core;
use tract_onnx::tract_core::ops;

/// Constant indices into a computed tensor become this many slices at most; more scattered
/// indices become one row lookup (the gather kernel on the moved, flattened tensor).
pub const GATHER_SLICES_MAX: usize = 8;

/// Longest axis a cumulative sum runs over: it becomes a product with an n x n constant (16 MiB
/// of f32 at 2048; RoBERTa-style position ids need the sequence length).
pub const CUMSUM_LEN_MAX: usize = 2048;

/// How to give fixed values to the dynamic dimensions of a model's inputs.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Value for a dynamic first (batch) dimension; 1 when unset.
    pub batch: Option<usize>,
    /// Value for other dynamic dimensions (sequence length); an error when unset and needed.
    pub seq_len: Option<usize>,
}

/// Reads and imports an .onnx file.
pub fn load_path(path: &std::path::Path, opts: &LoadOptions) -> Result<Graph, Error> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io { path: path.display().to_string(), source: e })?;
    let name = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
    load_bytes(&name, &bytes, opts)
}

fn malformed(model: &str, reason: impl std::fmt::Display) -> Error {
    Error::Malformed { model: model.to_string(), reason: format!("{reason:#}") }
}

/// Imports serialized ONNX bytes. Never panics on bad input: a malformed file is an error.
pub fn load_bytes(name: &str, bytes: &[u8], opts: &LoadOptions) -> Result<Graph, Error> {
    // tract is defensive but not panic-free on hostile input; keep a panic from taking the server down.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load_bytes_inner(name, bytes, opts)));
    match result {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "parser panicked".into());
            Err(malformed(name, msg))
        }
    }
}

fn load_bytes_inner(name: &str, bytes: &[u8], opts: &LoadOptions) -> Result<Graph, Error> {
    let onnx = tract_onnx::onnx();
    let mut proto = onnx.proto_model_for_read(&mut &bytes[..]).map_err(|e| malformed(name, e))?;
    let graph_proto = proto.graph.as_mut().ok_or_else(|| malformed(name, "the file holds no graph"))?;
    let model_name = if graph_proto.name.is_empty() { name.to_string() } else { graph_proto.name.clone() };
    // ONNX node name -> op type, for error messages that name the model's own nodes.
    let node_ops: HashMap<String, String> = graph_proto.node.iter().map(|n| (n.name.clone(), n.op_type.clone())).collect();
    check_ops_known(&model_name, graph_proto)?;
    let (input_shapes, symbols) = fixed_input_shapes(&model_name, graph_proto, opts)?;
    pin_symbols(graph_proto, &symbols);
    default_constant_of_shape(graph_proto);

    let mut model = onnx.model_for_proto_model(&proto).map_err(|e| malformed(&model_name, e))?;
    for (i, (dt, shape)) in input_shapes.iter().enumerate() {
        let fact = InferenceFact::dt_shape(*dt, shape.clone());
        model.set_input_fact(i, fact).map_err(|e| malformed(&model_name, e))?;
    }
    let mut typed = model.into_typed().map_err(|e| malformed(&model_name, format!("typing failed: {e:#}")))?;
    let mut folding = tract_core::optim::Optimizer::declutter();
    folding.passes.retain(|p| {
        let n = format!("{p:?}");
        n.starts_with("PropConst") || n.starts_with("PropagateUniformTdim") || n.starts_with("FoldUniformMask")
    });
    folding.optimize(&mut typed).map_err(|e| malformed(&model_name, format!("constant folding failed: {e:#}")))?;
    expand_strided_slices(&mut typed).map_err(|e| malformed(&model_name, format!("strided slices: {e:#}")))?;
    let mut g =
        Importer { model: &typed, name: &model_name, node_ops: &node_ops, graph: Graph::new(&model_name), map: HashMap::new() }
            .run()?;
    g.prune();
    g.assert_valid();
    Ok(g)
}

/// ONNX ops tract has no parser for show up as "unimplemented" much later; catch them here with the node's name.
fn check_ops_known(model: &str, graph: &pb::GraphProto) -> Result<(), Error> {
    let onnx = tract_onnx::onnx();
    for n in &graph.node {
        let domain_ok = n.domain.is_empty() || n.domain == "ai.onnx" || n.domain == "com.microsoft";
        if !domain_ok || !onnx.op_register.0.contains_key(&n.op_type) {
            return Err(Error::Unsupported {
                model: model.to_string(),
                op: if n.domain.is_empty() { n.op_type.clone() } else { format!("{}::{}", n.domain, n.op_type) },
                node: n.name.clone(),
                detail: String::new(),
            });
        }
    }
    Ok(())
}

fn elem_type_to_datum(t: i32) -> Option<DatumType> {
    Some(match t {
        1 => DatumType::F32,
        10 => DatumType::F16,
        7 => DatumType::I64,
        6 => DatumType::I32,
        9 => DatumType::Bool,
        _ => return None,
    })
}

/// Input shapes with every dynamic dimension given its value, and the value of each named symbol.
type FixedInputs = (Vec<(DatumType, Vec<usize>)>, HashMap<String, usize>);

/// The dynamo exporter writes its symbols (`s77`) into the shapes of intermediate values and
/// outputs too; once the inputs are fixed, a symbol tract cannot unify with the fixed value stops
/// typing. Each symbol an input axis names takes that axis' value in the outputs' shapes; any
/// other symbolic dimension (an expression such as `s77*2`) is left for tract to infer.
fn pin_symbols(graph: &mut pb::GraphProto, symbols: &HashMap<String, usize>) {
    use pb::tensor_shape_proto::dimension::Value;
    // Intermediate annotations are hints tract re-derives from the inputs, and they can disagree
    // with what tract derives (its ConstantOfShape without a value is f64, the exporter's
    // annotation float32), which onnxruntime ignores and tract refuses. Derive them all, as
    // onnxruntime does.
    graph.value_info.clear();
    for info in graph.output.iter_mut() {
        let Some(pb::type_proto::Value::TensorType(t)) = info.r#type.as_mut().and_then(|t| t.value.as_mut()) else {
            continue;
        };
        let Some(shape) = t.shape.as_mut() else { continue };
        for d in shape.dim.iter_mut() {
            if let Some(Value::DimParam(p)) = &d.value {
                d.value = symbols.get(p.as_str()).map(|&v| Value::DimValue(v as i64));
            }
        }
    }
}

/// ONNX Slices with steps (Swin's patch merging takes every other row) stay tract
/// StridedSlices unless decluttered; expand just those into plain slices and downsamplings.
fn expand_strided_slices(model: &mut TypedModel) -> tract_onnx::prelude::TractResult<()> {
    use tract_onnx::tract_core::ops::TypedOp;
    loop {
        let mut patch = None;
        for id in model.eval_order()? {
            let node = &model.nodes[id];
            if let Some(op) = node.op_as::<ops::array::StridedSlice>() {
                patch = op.declutter(model, node)?;
                if patch.is_some() {
                    break;
                }
            }
        }
        match patch {
            Some(p) => p.apply(model)?,
            None => return Ok(()),
        }
    }
}

/// ONNX's ConstantOfShape without a `value` fills float32 zeros; tract's parser makes them f64,
/// which then meets float32 tensors downstream (the dynamo exporter's Swin masks). Write the
/// default out.
fn default_constant_of_shape(graph: &mut pb::GraphProto) {
    for n in graph.node.iter_mut().filter(|n| n.op_type == "ConstantOfShape") {
        if n.attribute.iter().all(|a| a.name != "value") {
            n.attribute.push(pb::AttributeProto {
                name: "value".into(),
                r#type: pb::attribute_proto::AttributeType::Tensor as i32,
                t: Some(pb::TensorProto { dims: vec![1], data_type: 1, float_data: vec![0.0], ..Default::default() }),
                ..Default::default()
            });
        }
    }
}

fn fixed_input_shapes(model: &str, graph: &pb::GraphProto, opts: &LoadOptions) -> Result<FixedInputs, Error> {
    let initializers: std::collections::HashSet<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    let mut symbols = HashMap::new();
    let mut out = Vec::new();
    for input in graph.input.iter().filter(|i| !initializers.contains(i.name.as_str())) {
        let tensor_type = match input.r#type.as_ref().and_then(|t| t.value.as_ref()) {
            Some(pb::type_proto::Value::TensorType(t)) => t,
            _ => {
                return Err(malformed(model, format!("input '{}' is not a tensor", input.name)));
            }
        };
        let dt = elem_type_to_datum(tensor_type.elem_type).ok_or_else(|| Error::Unsupported {
            model: model.to_string(),
            op: format!("input element type {}", tensor_type.elem_type),
            node: input.name.clone(),
            detail: " (kairos takes float32, float16, int64, int32 and bool inputs)".into(),
        })?;
        let dims = tensor_type.shape.as_ref().map(|s| s.dim.as_slice()).unwrap_or(&[]);
        let mut shape = Vec::with_capacity(dims.len());
        for (axis, d) in dims.iter().enumerate() {
            use pb::tensor_shape_proto::dimension::Value;
            let v = match &d.value {
                Some(Value::DimValue(v)) if *v > 0 => *v as usize,
                Some(Value::DimParam(p)) if symbols.contains_key(p.as_str()) => symbols[p.as_str()],
                _ if axis == 0 => opts.batch.unwrap_or(1),
                other => {
                    let sym = match other {
                        Some(Value::DimParam(p)) => p.clone(),
                        _ => "?".into(),
                    };
                    opts.seq_len.ok_or_else(|| {
                        Error::Invalid(format!(
                            "model '{model}': input '{}' has a dynamic dimension '{sym}' at axis {axis}; give it a value (--seq-len)",
                            input.name
                        ))
                    })?
                }
            };
            if let Some(Value::DimParam(p)) = &d.value {
                symbols.entry(p.clone()).or_insert(v);
            }
            shape.push(v);
        }
        out.push((dt, shape));
    }
    Ok((out, symbols))
}

struct Importer<'a> {
    model: &'a TypedModel,
    name: &'a str,
    node_ops: &'a HashMap<String, String>,
    graph: Graph,
    map: HashMap<OutletId, NodeId>,
}

fn dtype_of(model: &str, node: &str, dt: DatumType) -> Result<DType, Error> {
    Ok(match dt {
        DatumType::F32 | DatumType::Bool => DType::F32,
        DatumType::F16 => DType::F16,
        DatumType::I64 | DatumType::I32 | DatumType::TDim => DType::I64,
        other => {
            return Err(Error::Unsupported {
                model: model.to_string(),
                op: format!("tensor of {other:?}"),
                node: node.to_string(),
                detail: String::new(),
            });
        }
    })
}

/// Converts a tract tensor to ours: bools become 0/1 floats, i32 and TDim become i64.
fn tensor_of(model: &str, node: &str, t: &TractTensor) -> Result<Tensor, Error> {
    let shape = t.shape().to_vec();
    let err = |e: anyhow::Error| malformed(model, format!("constant at node '{node}': {e:#}"));
    Ok(match t.datum_type() {
        DatumType::F32 => Tensor::f32(shape, t.to_plain_array_view::<f32>().map_err(err)?.iter().copied().collect()),
        DatumType::F16 => {
            let v: Vec<half::f16> = t
                .to_plain_array_view::<tract_onnx::prelude::f16>()
                .map_err(err)?
                .iter()
                .map(|x| half::f16::from_f32(x.to_f32()))
                .collect();
            Tensor::f16(shape, v)
        }
        DatumType::Bool => {
            Tensor::f32(shape, t.to_plain_array_view::<bool>().map_err(err)?.iter().map(|&b| b as u8 as f32).collect())
        }
        DatumType::I64 => Tensor::i64(shape, t.to_plain_array_view::<i64>().map_err(err)?.iter().copied().collect()),
        DatumType::I32 => Tensor::i64(shape, t.to_plain_array_view::<i32>().map_err(err)?.iter().map(|&x| x as i64).collect()),
        DatumType::TDim => {
            let v: Result<Vec<i64>, _> = t.to_plain_array_view::<TDim>().map_err(err)?.iter().map(|d| d.to_i64()).collect();
            Tensor::i64(shape, v.map_err(|e| malformed(model, format!("constant at node '{node}': {e:?}")))?)
        }
        other => {
            return Err(Error::Unsupported {
                model: model.to_string(),
                op: format!("constant of {other:?}"),
                node: node.to_string(),
                detail: String::new(),
            });
        }
    })
}

fn window_of(spec: &ops::cnn::PoolSpec, input_hw: [usize; 2]) -> Result<(Window, bool), String> {
    if spec.kernel_shape.len() != 2 {
        return Err(format!("{}-D windows (kairos handles 2-D)", spec.kernel_shape.len()));
    }
    let kernel = [spec.kernel_shape[0], spec.kernel_shape[1]];
    let stride = spec.strides.as_ref().map(|s| [s[0], s[1]]).unwrap_or([1, 1]);
    let dilation = spec.dilations.as_ref().map(|s| [s[0], s[1]]).unwrap_or([1, 1]);
    use ops::cnn::PaddingSpec::*;
    let (pad_begin, pad_end, ceil) = match &spec.padding {
        Explicit(b, a) => ([b[0], b[1]], [a[0], a[1]], false),
        ExplicitOnnxPool(b, a, ceil) => ([b[0], b[1]], [a[0], a[1]], *ceil),
        Valid => ([0, 0], [0, 0], false),
        SameUpper | SameLower => {
            let mut pb = [0; 2];
            let mut pa = [0; 2];
            for d in 0..2 {
                let out = input_hw[d].div_ceil(stride[d]);
                let span = dilation[d] * (kernel[d] - 1) + 1;
                let total = ((out - 1) * stride[d] + span).saturating_sub(input_hw[d]);
                let (small, big) = (total / 2, total - total / 2);
                if matches!(spec.padding, SameUpper) {
                    pb[d] = small;
                    pa[d] = big;
                } else {
                    pb[d] = big;
                    pa[d] = small;
                }
            }
            (pb, pa, false)
        }
    };
    Ok((Window { kernel, stride, dilation, pad_begin, pad_end }, ceil))
}

impl Importer<'_> {
    fn unsupported(&self, node: &TypedNode, detail: impl Into<String>) -> Error {
        // Name the model's own node and op when tract's node comes from one (expansions add suffixes).
        let mut onnx_name = node.name.clone();
        let mut op = node.op.name().to_string();
        let mut prefix = node.name.as_str();
        loop {
            if let Some(o) = self.node_ops.get(prefix) {
                onnx_name = prefix.to_string();
                op = format!("{o} (as tract {})", node.op.name());
                break;
            }
            match prefix.rfind('.') {
                Some(i) => prefix = &prefix[..i],
                None => break,
            }
        }
        let d = detail.into();
        Error::Unsupported {
            model: self.name.to_string(),
            op,
            node: onnx_name,
            detail: if d.is_empty() { d } else { format!(": {d}") },
        }
    }

    fn shape(&self, node: &TypedNode, slot: usize) -> Result<Vec<usize>, Error> {
        let fact = &node.outputs[slot].fact;
        fact.shape
            .as_concrete()
            .map(|s| s.to_vec())
            .ok_or_else(|| self.unsupported(node, format!("dynamic shape {:?}", fact.shape)))
    }

    fn input(&self, node: &TypedNode, i: usize) -> Result<NodeId, Error> {
        let outlet = node.inputs[i];
        self.map
            .get(&outlet)
            .copied()
            .ok_or_else(|| self.unsupported(node, format!("input {i} comes from an unsupported output")))
    }

    fn add(&mut self, name: &str, op: Op, inputs: Vec<NodeId>, shape: Vec<usize>, dtype: DType) -> NodeId {
        self.graph.add(name, op, inputs, shape, dtype)
    }

    fn transpose(&mut self, name: &str, x: NodeId, perm: &[usize]) -> NodeId {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return x;
        }
        let src = &self.graph.nodes[x];
        let shape = perm.iter().map(|&p| src.shape[p]).collect();
        let dtype = src.dtype;
        self.add(name, Op::Transpose { perm: perm.to_vec() }, vec![x], shape, dtype)
    }

    fn reshape(&mut self, name: &str, x: NodeId, shape: Vec<usize>) -> NodeId {
        if self.graph.nodes[x].shape == shape {
            return x;
        }
        let dtype = self.graph.nodes[x].dtype;
        self.add(name, Op::Reshape, vec![x], shape, dtype)
    }

    fn run(mut self) -> Result<Graph, Error> {
        let model = self.model;
        let input_outlets = model.input_outlets().map_err(|e| malformed(self.name, e))?.to_vec();
        if model.output_outlets().map_err(|e| malformed(self.name, e))?.is_empty() {
            return Err(malformed(self.name, "the graph declares no outputs"));
        }
        // Inputs first (an input no output depends on is still part of the signature), then the rest.
        let mut order: Vec<usize> = input_outlets.iter().map(|o| o.node).collect();
        let rest: Vec<usize> =
            model.eval_order().map_err(|e| malformed(self.name, e))?.into_iter().filter(|n| !order.contains(n)).collect();
        order.extend(rest);
        for id in order {
            let node = &model.nodes[id];
            for slot in 0..node.outputs.len() {
                // Multi-output nodes are only acceptable when the extra outputs are unused.
                if slot > 0 && !node.outputs[slot].successors.is_empty() {
                    return Err(self.unsupported(node, "a second output is used"));
                }
            }
            let out = self.convert(node, &input_outlets)?;
            if let Some(out) = out {
                self.map.insert(OutletId::new(id, 0), out);
            }
        }
        for (i, outlet) in input_outlets.iter().enumerate() {
            let node = self.map[outlet];
            self.graph.inputs.push(GraphInput { name: model.nodes[outlet.node].name.clone(), node });
            debug_assert!(matches!(self.graph.nodes[node].op, Op::Input { index } if index == i));
        }
        for outlet in model.output_outlets().map_err(|e| malformed(self.name, e))? {
            let name =
                model.outlet_label(*outlet).map(|s| s.to_string()).unwrap_or_else(|| model.nodes[outlet.node].name.clone());
            let node = *self.map.get(outlet).ok_or_else(|| malformed(self.name, format!("output '{name}' has no producer")))?;
            self.graph.outputs.push(GraphOutput { name, node });
        }
        Ok(self.graph)
    }

    fn convert(&mut self, node: &TypedNode, input_outlets: &[OutletId]) -> Result<Option<NodeId>, Error> {
        let name = node.name.as_str();
        let fact = &node.outputs[0].fact;
        let dtype = dtype_of(self.name, name, fact.datum_type)?;
        let shape = self.shape(node, 0)?;
        // Anything tract knows to be constant becomes a constant, whatever op computed it.
        if let Some(k) = &fact.konst {
            let t = tensor_of(self.name, name, k)?;
            return Ok(Some(self.graph.add_const(name, t)));
        }
        let op: &dyn tract_onnx::tract_core::ops::TypedOp = node.op.as_ref();
        if op.downcast_ref::<ops::source::TypedSource>().is_some() {
            let index = input_outlets.iter().position(|o| o.node == node.id).expect("source is a model input");
            return Ok(Some(self.add(name, Op::Input { index }, vec![], shape, dtype)));
        }
        if op.downcast_ref::<ops::identity::Identity>().is_some() {
            return Ok(Some(self.input(node, 0)?));
        }
        if let Some(c) = op.downcast_ref::<ops::cast::Cast>() {
            let x = self.input(node, 0)?;
            let to = dtype_of(self.name, name, c.to)?;
            if to == self.graph.nodes[x].dtype {
                return Ok(Some(x));
            }
            return Ok(Some(self.add(name, Op::Cast, vec![x], shape, to)));
        }
        if let Some(conv) = op.downcast_ref::<ops::cnn::Conv>() {
            return self.conv(node, conv, shape, dtype).map(Some);
        }
        if let Some(p) = op.downcast_ref::<ops::cnn::MaxPool>() {
            return self.pool(node, &p.pool_spec, PoolKind::Max, shape, dtype).map(Some);
        }
        if let Some(p) = op.downcast_ref::<ops::cnn::SumPool>() {
            if !p.normalize {
                return Err(self.unsupported(node, "sum pooling without normalization"));
            }
            return self
                .pool(node, &p.pool_spec, PoolKind::Avg { count_include_pad: p.count_include_pad }, shape, dtype)
                .map(Some);
        }
        if let Some(e) = op.downcast_ref::<ops::einsum::EinSum>() {
            if e.q_params.is_some() {
                return Err(self.unsupported(node, "quantized einsum"));
            }
            return self.einsum(node, &e.axes.to_string(), shape, dtype).map(Some);
        }
        if let Some(b) = op.downcast_ref::<ops::binary::TypedBinOp>() {
            // Booleans are 0/1 floats: And is a product, Or a maximum; the negated comparisons
            // (and Xor, "not equal") are one minus the comparison.
            let (bop, negate) = match b.0.name() {
                "Add" => (BinaryOp::Add, false),
                "Sub" => (BinaryOp::Sub, false),
                "Mul" => (BinaryOp::Mul, false),
                "Div" => (BinaryOp::Div, false),
                "Pow" => (BinaryOp::Pow, false),
                "Max" => (BinaryOp::Max, false),
                "Min" => (BinaryOp::Min, false),
                "Eq" => (BinaryOp::Equal, false),
                "NE" | "Xor" => (BinaryOp::Equal, true),
                "LT" => (BinaryOp::Less, false),
                "GTE" => (BinaryOp::Less, true),
                "GT" => (BinaryOp::Greater, false),
                "LTE" => (BinaryOp::Greater, true),
                "And" => (BinaryOp::Mul, false),
                "Or" => (BinaryOp::Max, false),
                _ => return Err(self.unsupported(node, "")),
            };
            let (a, c) = (self.input(node, 0)?, self.input(node, 1)?);
            if !negate {
                return Ok(Some(self.add(name, Op::Binary(bop), vec![a, c], shape, dtype)));
            }
            let cmp = self.add(&format!("{name}.cmp"), Op::Binary(bop), vec![a, c], shape.clone(), dtype);
            return Ok(Some(self.not(name, cmp, shape, dtype)));
        }
        if let Some(ew) = op.downcast_ref::<ops::element_wise::ElementWiseOp>() {
            if ew.0.name() == "Not" {
                let x = self.input(node, 0)?;
                return Ok(Some(self.not(name, x, shape, dtype)));
            }
            let u = match ew.0.name().as_str() {
                "Sigmoid" => UnaryOp::Act(Act::Sigmoid),
                "Tanh" => UnaryOp::Act(Act::Tanh),
                "HardSwish" => UnaryOp::Act(Act::HardSwish),
                "GeluExact" => UnaryOp::Act(Act::Gelu),
                "GeluApproximate" => UnaryOp::Act(Act::GeluTanh),
                "Erf" => UnaryOp::Erf,
                "Sqrt" => UnaryOp::Sqrt,
                "Rsqrt" => UnaryOp::Rsqrt,
                "Recip" => UnaryOp::Recip,
                "Exp" => UnaryOp::Exp,
                "Neg" => UnaryOp::Neg,
                "Abs" => UnaryOp::Abs,
                "Square" => UnaryOp::Square,
                "IsNan" => UnaryOp::IsNaN,
                _ => return Err(self.unsupported(node, "")),
            };
            let x = self.input(node, 0)?;
            return Ok(Some(self.add(name, Op::Unary(u), vec![x], shape, dtype)));
        }
        if let Some(r) = op.downcast_ref::<ops::nn::Reduce>() {
            use ops::nn::Reducer;
            let x = self.input(node, 0)?;
            let axes: Vec<usize> = r.axes.to_vec();
            let rop = match r.reducer {
                Reducer::Sum => ReduceOp::Sum,
                Reducer::Max => ReduceOp::Max,
                Reducer::Min => ReduceOp::Min,
                Reducer::MeanOfSquares => {
                    let in_shape = self.graph.nodes[x].shape.clone();
                    let sq = self.add(&format!("{name}.square"), Op::Unary(UnaryOp::Square), vec![x], in_shape, dtype);
                    return Ok(Some(self.add(name, Op::Reduce { op: ReduceOp::Mean, axes }, vec![sq], shape, dtype)));
                }
                Reducer::ArgMax(last) | Reducer::ArgMin(last) if axes.len() == 1 => {
                    let max = matches!(r.reducer, Reducer::ArgMax(_));
                    return self.arg_extreme(node, x, axes[0], max, last, shape, dtype).map(Some);
                }
                _ => return Err(self.unsupported(node, format!("reducer {:?}", r.reducer))),
            };
            return Ok(Some(self.add(name, Op::Reduce { op: rop, axes }, vec![x], shape, dtype)));
        }
        if let Some(a) = op.downcast_ref::<ops::change_axes::AxisOp>() {
            let x = self.input(node, 0)?;
            let rank = self.graph.nodes[x].shape.len();
            return Ok(Some(match a {
                &ops::change_axes::AxisOp::Move(from, to) => {
                    let mut perm: Vec<usize> = (0..rank).collect();
                    let ax = perm.remove(from);
                    perm.insert(to, ax);
                    self.transpose(name, x, &perm)
                }
                _ => self.reshape(name, x, shape),
            }));
        }
        if let Some(c) = op.downcast_ref::<ops::array::TypedConcat>() {
            let inputs: Result<Vec<_>, _> = (0..node.inputs.len()).map(|i| self.input(node, i)).collect();
            return Ok(Some(self.add(name, Op::Concat { axis: c.axis }, inputs?, shape, dtype)));
        }
        if let Some(s) = op.downcast_ref::<ops::array::Slice>() {
            let x = self.input(node, 0)?;
            let (start, end) = match (s.start.to_i64(), s.end.to_i64()) {
                (Ok(a), Ok(b)) if a >= 0 && b >= a => (a as usize, b as usize),
                _ => return Err(self.unsupported(node, "symbolic slice bounds")),
            };
            return Ok(Some(self.add(name, Op::Slice { axis: s.axis, start, end }, vec![x], shape, dtype)));
        }
        if let Some(g) = op.downcast_ref::<ops::array::Gather>() {
            let (d, i) = (self.input(node, 0)?, self.input(node, 1)?);
            // `x[0]`, `qkv[:, :, 1]`: constant indices into a computed tensor are slices.
            if self.graph.konst(d).is_none()
                && let Some(idx) = self.graph.konst(i).cloned()
            {
                return self.gather_by_slices(node, d, &idx, g.axis, shape).map(Some);
            }
            return Ok(Some(self.add(name, Op::Gather { axis: g.axis }, vec![d, i], shape, dtype)));
        }
        if let Some(ds) = op.downcast_ref::<ops::downsample::Downsample>() {
            // Every |stride|-th element from `modulo` (from the end when the stride is negative):
            // a gather of constant indices.
            let x = self.input(node, 0)?;
            let n = self.graph.nodes[x].shape[ds.axis];
            let step = ds.stride.unsigned_abs();
            let picks: Vec<i64> = if ds.stride > 0 {
                (ds.modulo..n).step_by(step).map(|i| i as i64).collect()
            } else {
                (ds.modulo..n).rev().step_by(step).map(|i| i as i64).collect()
            };
            let idx = Tensor::i64(vec![picks.len()], picks);
            return self.gather_by_slices(node, x, &idx, ds.axis, shape).map(Some);
        }
        if let Some(gnd) = op.downcast_ref::<ops::array::GatherNd>() {
            let (d, i) = (self.input(node, 0)?, self.input(node, 1)?);
            if gnd.batch_dims != 0 {
                return Err(self.unsupported(node, format!("batch_dims {}", gnd.batch_dims)));
            }
            return match self.graph.konst(i).cloned() {
                Some(idx) => self.gather_nd_rows(node, d, &idx, shape).map(Some),
                None => self.gather_nd_computed(node, d, i, shape).map(Some),
            };
        }
        if let Some(a) = op.downcast_ref::<tract_transformers::ops::sdpa::Sdpa>() {
            return self.attention(node, a, shape, dtype).map(Some);
        }
        if let Some(ge) = op.downcast_ref::<ops::array::GatherElements>() {
            return self.gather_elements(node, ge.axis, shape, dtype).map(Some);
        }
        if let Some(c) = op.downcast_ref::<ops::array::CumSum>() {
            return self.cumsum(node, c, shape, dtype).map(Some);
        }
        if let Some(p) = op.downcast_ref::<ops::array::Pad>() {
            return self.pad(node, p, shape, dtype).map(Some);
        }
        if let Some(s) = op.downcast_ref::<ops::nn::Softmax>() {
            if s.axes.len() != 1 || !matches!(s.kind, ops::nn::SoftmaxKind::Softmax) {
                return Err(self.unsupported(node, format!("{:?} over axes {:?}", s.kind, s.axes)));
            }
            let x = self.input(node, 0)?;
            return Ok(Some(self.add(
                name,
                Op::Softmax { axis: s.axes[0], scale: 1.0, causal: false, zero_nan: false },
                vec![x],
                shape,
                dtype,
            )));
        }
        if op.downcast_ref::<ops::logic::Iff>().is_some() {
            let (c, a, b) = (self.input(node, 0)?, self.input(node, 1)?, self.input(node, 2)?);
            return Ok(Some(self.add(name, Op::Where, vec![c, a, b], shape, dtype)));
        }
        if op.downcast_ref::<ops::array::MultiBroadcastTo>().is_some() {
            let x = self.input(node, 0)?;
            return Ok(Some(self.add(name, Op::Expand, vec![x], shape, dtype)));
        }
        Err(self.unsupported(node, ""))
    }

    /// Logical not of a 0/1 tensor: 1 - x.
    fn not(&mut self, name: &str, x: NodeId, shape: Vec<usize>, dtype: DType) -> NodeId {
        let one = self.graph.add_const(format!("{name}.one"), Tensor::f32(vec![], vec![1.0]).cast(dtype));
        self.add(name, Op::Binary(BinaryOp::Sub), vec![one, x], shape, dtype)
    }

    /// A gather of constant indices from a computed tensor: one slice per run of consecutive
    /// indices, concatenated, reshaped to the gather's shape (a scalar index drops the axis).
    fn gather_by_slices(
        &mut self,
        node: &TypedNode,
        data: NodeId,
        indices: &Tensor,
        axis: usize,
        shape: Vec<usize>,
    ) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let mut in_shape = self.graph.nodes[data].shape.clone();
        let dtype = self.graph.nodes[data].dtype;
        let dim = in_shape[axis] as i64;
        let Some(raw) = indices.as_i64() else {
            return Err(self.unsupported(node, "constant indices that are not integers"));
        };
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &r in raw {
            let i = if r < 0 { r + dim } else { r };
            if !(0..dim).contains(&i) {
                return Err(self.unsupported(node, format!("index {r} outside an axis of {dim}")));
            }
            let i = i as usize;
            match runs.last_mut() {
                Some((_, end)) if *end == i => *end += 1,
                _ => runs.push((i, i + 1)),
            }
        }
        if runs.len() > GATHER_SLICES_MAX {
            return Ok(self.gather_rows_along(node, data, indices, axis, shape));
        }
        let mut pieces = Vec::new();
        for (k, &(start, end)) in runs.iter().enumerate() {
            if start == 0 && end == in_shape[axis] {
                pieces.push(data);
                continue;
            }
            let mut s = in_shape.clone();
            s[axis] = end - start;
            pieces.push(self.add(&format!("{name}.slice{k}"), Op::Slice { axis, start, end }, vec![data], s, dtype));
        }
        let joined = if pieces.len() == 1 {
            pieces[0]
        } else {
            in_shape[axis] = raw.len();
            self.add(&format!("{name}.concat"), Op::Concat { axis }, pieces, in_shape, dtype)
        };
        Ok(self.reshape(name, joined, shape))
    }

    /// GatherND of constant indices (exporters index masks and pooling windows this way): the
    /// data seen as a table of rows (the indexed leading axes) by columns (the rest), one row
    /// lookup per index tuple.
    fn gather_nd_rows(&mut self, node: &TypedNode, data: NodeId, indices: &Tensor, shape: Vec<usize>) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let in_shape = self.graph.nodes[data].shape.clone();
        let dtype = self.graph.nodes[data].dtype;
        let Some(raw) = indices.as_i64() else {
            return Err(self.unsupported(node, "constant indices that are not integers"));
        };
        let k = *indices.shape.last().unwrap_or(&0);
        if k == 0 || k > in_shape.len() {
            return Err(self.unsupported(node, format!("index tuples of {k} into a tensor of rank {}", in_shape.len())));
        }
        let rows: usize = in_shape[..k].iter().product();
        let cols: usize = in_shape[k..].iter().product();
        let mut flat = Vec::with_capacity(raw.len() / k);
        for tuple in raw.chunks(k) {
            let mut r = 0i64;
            for (axis, &i) in tuple.iter().enumerate() {
                let dim = in_shape[axis] as i64;
                let i = if i < 0 { i + dim } else { i };
                if !(0..dim).contains(&i) {
                    return Err(self.unsupported(node, format!("index {i} outside an axis of {dim}")));
                }
                r = r * dim + i;
            }
            flat.push(r);
        }
        let lookups = indices.shape[..indices.shape.len() - 1].to_vec();
        let table = self.reshape(&format!("{name}.table"), data, vec![rows, cols]);
        let idx = self.graph.add_const(format!("{name}.rows"), Tensor::i64(lookups.clone(), flat));
        let mut out_shape = lookups;
        out_shape.push(cols);
        let picked = self.add(&format!("{name}.gather"), Op::Gather { axis: 0 }, vec![table, idx], out_shape, dtype);
        Ok(self.reshape(name, picked, shape))
    }

    /// ArgMax / ArgMin along one axis from reductions the kernels have: the extreme value, where
    /// the input equals it, and the first (or last) such position: min (max) over
    /// where(equal, position, n (-1)). CLIP's text pooling finds the end token this way. Values
    /// are compared in f32: token ids below 2^24 exactly.
    #[allow(clippy::too_many_arguments)]
    fn arg_extreme(
        &mut self,
        node: &TypedNode,
        x: NodeId,
        axis: usize,
        max: bool,
        last: bool,
        shape: Vec<usize>,
        dtype: DType,
    ) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let in_shape = self.graph.nodes[x].shape.clone();
        let float = DType::F32;
        let n = in_shape[axis];
        let mut kept = in_shape.clone();
        kept[axis] = 1;
        let extreme_op = if max { ReduceOp::Max } else { ReduceOp::Min };
        let extreme =
            self.add(&format!("{name}.value"), Op::Reduce { op: extreme_op, axes: vec![axis] }, vec![x], kept.clone(), float);
        let hit = self.add(&format!("{name}.hit"), Op::Binary(BinaryOp::Equal), vec![x, extreme], in_shape.clone(), float);
        let mut iota_shape = vec![1; in_shape.len()];
        iota_shape[axis] = n;
        let iota = self.graph.add_const(format!("{name}.positions"), Tensor::f32(iota_shape, (0..n).map(|i| i as f32).collect()));
        let miss = self.graph.add_const(format!("{name}.miss"), Tensor::f32(vec![], vec![if last { -1.0 } else { n as f32 }]));
        let candidates = self.add(&format!("{name}.candidates"), Op::Where, vec![hit, iota, miss], in_shape, float);
        let pick = if last { ReduceOp::Max } else { ReduceOp::Min };
        let pos =
            self.add(&format!("{name}.first"), Op::Reduce { op: pick, axes: vec![axis] }, vec![candidates], kept.clone(), float);
        let pos = self.reshape(&format!("{name}.shape"), pos, shape.clone());
        Ok(if dtype == float { pos } else { self.add(name, Op::Cast, vec![pos], shape, dtype) })
    }

    /// ONNX Attention (opset 23; the dynamo exporter's scaled_dot_product_attention): softmax(scale
    /// q k^T + mask) v with 4-D q, k, v of equal head counts, written as the MatMul -> Softmax ->
    /// MatMul the fusion passes already recognise. A boolean mask keeps the scores where it is 1
    /// (-inf elsewhere); a float mask is added.
    fn attention(
        &mut self,
        node: &TypedNode,
        a: &tract_transformers::ops::sdpa::Sdpa,
        shape: Vec<usize>,
        dtype: DType,
    ) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let (q, k, v) = (self.input(node, 0)?, self.input(node, 1)?, self.input(node, 2)?);
        let (qs, ks) = (self.graph.nodes[q].shape.clone(), self.graph.nodes[k].shape.clone());
        if qs.len() != 4 || ks.len() != 4 || qs[1] != ks[1] {
            return Err(self.unsupported(
                node,
                format!("q {qs:?} and k {ks:?}: kairos takes 4-D attention with as many key heads as query heads"),
            ));
        }
        let scale = match &a.scale {
            Some(t) => t.cast_to_scalar::<f32>().map_err(|e| self.unsupported(node, format!("scale: {e}")))?,
            None => 1.0 / (qs[3] as f32).sqrt(),
        };
        if a.is_causal && qs[2] != ks[2] {
            return Err(self.unsupported(node, "a causal mask with more keys than queries"));
        }
        let kt = self.transpose(&format!("{name}.kt"), k, &[0, 1, 3, 2]);
        let scores_shape = vec![qs[0], qs[1], qs[2], ks[2]];
        let mut scores = self.add(
            &format!("{name}.qk"),
            Op::MatMul { epilogue: Epilogue::default(), alpha: 1.0 },
            vec![q, kt],
            scores_shape.clone(),
            dtype,
        );
        let mut softmax_scale = scale;
        if node.inputs.len() > 3 {
            let mask = self.input(node, 3)?;
            let boolean = self.model.outlet_fact(node.inputs[3]).map(|f| f.datum_type == DatumType::Bool).unwrap_or(false);
            let k_scale = self.graph.add_const(format!("{name}.scale"), Tensor::f32(vec![], vec![scale]).cast(dtype));
            let scaled = self.add(
                &format!("{name}.scaled"),
                Op::Binary(BinaryOp::Mul),
                vec![scores, k_scale],
                scores_shape.clone(),
                dtype,
            );
            scores = if boolean {
                let ninf = self.graph.add_const(format!("{name}.ninf"), Tensor::f32(vec![], vec![f32::NEG_INFINITY]).cast(dtype));
                self.add(&format!("{name}.masked"), Op::Where, vec![mask, scaled, ninf], scores_shape.clone(), dtype)
            } else {
                self.add(&format!("{name}.masked"), Op::Binary(BinaryOp::Add), vec![scaled, mask], scores_shape.clone(), dtype)
            };
            softmax_scale = 1.0;
        }
        let probs = self.add(
            &format!("{name}.softmax"),
            Op::Softmax { axis: 3, scale: softmax_scale, causal: a.is_causal, zero_nan: false },
            vec![scores],
            scores_shape,
            dtype,
        );
        Ok(self.add(name, Op::MatMul { epilogue: Epilogue::default(), alpha: 1.0 }, vec![probs, v], shape, dtype))
    }

    /// GatherElements from a constant table (RoBERTa's token types, looked up by position ids):
    /// a uniform table gives a constant; a table whose only axis longer than 1 is the gathered
    /// one is a row lookup per index.
    fn gather_elements(&mut self, node: &TypedNode, axis: usize, shape: Vec<usize>, dtype: DType) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let (d, i) = (self.input(node, 0)?, self.input(node, 1)?);
        let Some(table) = self.graph.konst(d).cloned() else {
            return Err(self.unsupported(node, "a table computed at run time (kairos takes constant tables)"));
        };
        let values = table.to_f32_vec();
        let uniform = match table.as_i64() {
            Some(v) => v.iter().all(|&x| x == v[0]),
            None => values.iter().all(|&x| x.to_bits() == values[0].to_bits()),
        };
        if uniform && !values.is_empty() {
            let n = shape.iter().product();
            let t = match table.as_i64() {
                Some(v) => Tensor::i64(shape, vec![v[0]; n]),
                None => Tensor::f32(shape, vec![values[0]; n]).cast(dtype),
            };
            return Ok(self.graph.add_const(name, t));
        }
        let len = table.shape[axis];
        if table.shape.iter().enumerate().any(|(a, &n)| a != axis && n != 1) {
            return Err(self.unsupported(node, format!("a table of shape {:?} gathered along axis {axis}", table.shape)));
        }
        // Integer tables are looked up as floats (exact below 2^24) and cast back.
        let float = if dtype == DType::I64 { DType::F32 } else { dtype };
        let rows = self.graph.add_const(format!("{name}.rows"), Tensor::f32(vec![len, 1], values).cast(float));
        let mut picked_shape = self.graph.nodes[i].shape.clone();
        picked_shape.push(1);
        let picked = self.add(&format!("{name}.gather"), Op::Gather { axis: 0 }, vec![rows, i], picked_shape, float);
        let picked = if float == dtype {
            picked
        } else {
            let s = self.graph.nodes[picked].shape.clone();
            self.add(&format!("{name}.int"), Op::Cast, vec![picked], s, dtype)
        };
        Ok(self.reshape(name, picked, shape))
    }

    /// CumSum as a product with a constant triangle of ones (RoBERTa's position ids count the
    /// non-padding tokens this way): the axis moved last, times T[i][j] = 1 where i precedes j
    /// (or equals it, unless exclusive; the other way round when reversed), moved back. Integer
    /// inputs are summed in the model's float type (exact up to 2^24 in f32, 2048 in f16).
    fn cumsum(&mut self, node: &TypedNode, c: &ops::array::CumSum, shape: Vec<usize>, dtype: DType) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let mut x = self.input(node, 0)?;
        let in_shape = self.graph.nodes[x].shape.clone();
        let rank = in_shape.len();
        let n = in_shape[c.axis];
        if n > CUMSUM_LEN_MAX {
            return Err(self.unsupported(node, format!("a cumulative sum over {n} elements (at most {CUMSUM_LEN_MAX})")));
        }
        let float = if dtype == DType::I64 { DType::F32 } else { dtype };
        if self.graph.nodes[x].dtype != float {
            x = self.add(&format!("{name}.float"), Op::Cast, vec![x], in_shape.clone(), float);
        }
        let mut perm: Vec<usize> = (0..rank).filter(|&a| a != c.axis).collect();
        perm.push(c.axis);
        let moved = self.transpose(&format!("{name}.last"), x, &perm);
        let moved_shape: Vec<usize> = perm.iter().map(|&p| in_shape[p]).collect();
        // [.., M, n]: a rank-1 input gets a leading 1.
        let (a, a_shape) = if rank == 1 {
            (self.reshape(&format!("{name}.row"), moved, vec![1, n]), vec![1, n])
        } else {
            (moved, moved_shape.clone())
        };
        let mut tri = vec![0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                let precedes = if c.reverse { i > j } else { i < j };
                if precedes || (i == j && !c.exclusive) {
                    tri[i * n + j] = 1.0;
                }
            }
        }
        let mut t_shape = vec![1; a_shape.len() - 2];
        t_shape.extend([n, n]);
        let t = self.graph.add_const(format!("{name}.triangle"), Tensor::f32(t_shape, tri).cast(float));
        let summed = self.add(
            &format!("{name}.sum"),
            Op::MatMul { epilogue: Epilogue::default(), alpha: 1.0 },
            vec![a, t],
            a_shape,
            float,
        );
        let summed = self.reshape(&format!("{name}.shape"), summed, moved_shape);
        let mut back = vec![0; rank];
        for (k, &p) in perm.iter().enumerate() {
            back[p] = k;
        }
        let out = self.transpose(&format!("{name}.back"), summed, &back);
        if dtype == float {
            return Ok(out);
        }
        Ok(self.add(name, Op::Cast, vec![out], shape, dtype))
    }

    /// GatherND of indices computed at run time (CLIP's text pooling picks each row's end token):
    /// the row number sum(index[j] * stride[j]) computed element-wise (exact in f32 below 2^24;
    /// indices are taken as non-negative), then a row lookup as for constant indices.
    fn gather_nd_computed(
        &mut self,
        node: &TypedNode,
        data: NodeId,
        indices: NodeId,
        shape: Vec<usize>,
    ) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let in_shape = self.graph.nodes[data].shape.clone();
        let dtype = self.graph.nodes[data].dtype;
        let idx_shape = self.graph.nodes[indices].shape.clone();
        let k = *idx_shape.last().unwrap_or(&0);
        if k == 0 || k > in_shape.len() {
            return Err(self.unsupported(node, format!("index tuples of {k} into a tensor of rank {}", in_shape.len())));
        }
        let rows: usize = in_shape[..k].iter().product();
        let cols: usize = in_shape[k..].iter().product();
        let last = idx_shape.len() - 1;
        let mut part_shape = idx_shape.clone();
        part_shape[last] = 1;
        let mut row: Option<NodeId> = None;
        for j in 0..k {
            let stride: usize = in_shape[j + 1..k].iter().product();
            let part = self.add(
                &format!("{name}.index{j}"),
                Op::Slice { axis: last, start: j, end: j + 1 },
                vec![indices],
                part_shape.clone(),
                DType::I64,
            );
            let c = self.graph.add_const(format!("{name}.stride{j}"), Tensor::i64(vec![], vec![stride as i64]));
            let term =
                self.add(&format!("{name}.term{j}"), Op::Binary(BinaryOp::Mul), vec![part, c], part_shape.clone(), DType::I64);
            row = Some(match row {
                None => term,
                Some(r) => {
                    self.add(&format!("{name}.sum{j}"), Op::Binary(BinaryOp::Add), vec![r, term], part_shape.clone(), DType::I64)
                }
            });
        }
        let lookups = idx_shape[..last].to_vec();
        let row = self.reshape(&format!("{name}.rows"), row.expect("k >= 1"), lookups.clone());
        let table = self.reshape(&format!("{name}.table"), data, vec![rows, cols]);
        let mut out_shape = lookups;
        out_shape.push(cols);
        let picked = self.add(&format!("{name}.gather"), Op::Gather { axis: 0 }, vec![table, row], out_shape, dtype);
        Ok(self.reshape(name, picked, shape))
    }

    /// A gather along any axis as a row lookup: the axis moved first, the rest flattened into
    /// columns, one row per index, the result's axes put back in Gather's order (timm's
    /// `as_strided` windows export as hundreds of scattered indices).
    fn gather_rows_along(&mut self, node: &TypedNode, data: NodeId, indices: &Tensor, axis: usize, shape: Vec<usize>) -> NodeId {
        let name = node.name.as_str();
        let in_shape = self.graph.nodes[data].shape.clone();
        let dtype = self.graph.nodes[data].dtype;
        let rank = in_shape.len();
        let dim = in_shape[axis] as i64;
        let mut perm = vec![axis];
        perm.extend((0..rank).filter(|&a| a != axis));
        let front = self.transpose(&format!("{name}.front"), data, &perm);
        let cols: usize = in_shape.iter().product::<usize>() / in_shape[axis];
        let table = self.reshape(&format!("{name}.table"), front, vec![in_shape[axis], cols]);
        let rows: Vec<i64> = indices.as_i64().unwrap_or(&[]).iter().map(|&r| if r < 0 { r + dim } else { r }).collect();
        let idx = self.graph.add_const(format!("{name}.rows"), Tensor::i64(indices.shape.clone(), rows));
        let mut picked_shape = indices.shape.clone();
        picked_shape.push(cols);
        let picked = self.add(&format!("{name}.gather"), Op::Gather { axis: 0 }, vec![table, idx], picked_shape, dtype);
        // [idx.., pre.., post..] -> [pre.., idx.., post..]
        let q = indices.shape.len();
        let mut split = indices.shape.clone();
        split.extend(in_shape[..axis].iter().copied());
        split.extend(in_shape[axis + 1..].iter().copied());
        let picked = self.reshape(&format!("{name}.split"), picked, split);
        let mut order: Vec<usize> = (q..q + axis).collect();
        order.extend(0..q);
        order.extend(q + axis..q + rank - 1);
        let out = self.transpose(&format!("{name}.order"), picked, &order);
        self.reshape(name, out, shape)
    }

    /// Constant padding as a concatenation with constant blocks, axis by axis; no padding is the
    /// identity (the exporters emit a Pad for shapes that may need it, often zero at the shape served).
    fn pad(&mut self, node: &TypedNode, p: &ops::array::Pad, shape: Vec<usize>, dtype: DType) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        let mut x = self.input(node, 0)?;
        let value = match &p.mode {
            ops::array::PadMode::Constant(v) => {
                v.cast_to_scalar::<f32>().map_err(|e| self.unsupported(node, format!("pad value: {e}")))?
            }
            other => return Err(self.unsupported(node, format!("{other:?} padding (kairos pads with a constant)"))),
        };
        for (axis, &(before, after)) in p.pads.iter().enumerate() {
            if before == 0 && after == 0 {
                continue;
            }
            let cur = self.graph.nodes[x].shape.clone();
            let mut parts = Vec::new();
            for (side, n) in [("before", before), ("after", after)] {
                if n == 0 {
                    continue;
                }
                let mut s = cur.clone();
                s[axis] = n;
                let block = Tensor::f32(s.clone(), vec![value; s.iter().product()]).cast(dtype);
                parts.push((side, self.graph.add_const(format!("{name}.{side}{axis}"), block)));
            }
            let mut inputs = Vec::new();
            if let Some(&(_, b)) = parts.iter().find(|(s, _)| *s == "before") {
                inputs.push(b);
            }
            inputs.push(x);
            if let Some(&(_, a)) = parts.iter().find(|(s, _)| *s == "after") {
                inputs.push(a);
            }
            let mut out_shape = cur;
            out_shape[axis] += before + after;
            x = self.add(&format!("{name}.axis{axis}"), Op::Concat { axis }, inputs, out_shape, dtype);
        }
        debug_assert_eq!(self.graph.nodes[x].shape, shape);
        Ok(x)
    }

    fn conv(&mut self, node: &TypedNode, conv: &ops::cnn::Conv, shape: Vec<usize>, dtype: DType) -> Result<NodeId, Error> {
        let name = node.name.as_str();
        if conv.q_params.is_some() {
            return Err(self.unsupported(node, "quantized convolution"));
        }
        if conv.pool_spec.data_format != ops::nn::DataFormat::NCHW {
            return Err(self.unsupported(node, format!("data format {:?}", conv.pool_spec.data_format)));
        }
        let x = self.input(node, 0)?;
        let xs = self.graph.nodes[x].shape.clone();
        if xs.len() != 4 {
            return Err(self.unsupported(node, format!("{}-D input (kairos handles 2-D convolutions)", xs.len())));
        }
        let (window, _) = window_of(&conv.pool_spec, [xs[2], xs[3]]).map_err(|d| self.unsupported(node, d))?;
        let mut w = self.input(node, 1)?;
        let perm = match conv.kernel_fmt {
            ops::cnn::KernelFormat::OIHW => None,
            ops::cnn::KernelFormat::HWIO => Some([3, 2, 0, 1]),
            ops::cnn::KernelFormat::OHWI => Some([0, 3, 1, 2]),
        };
        if let Some(p) = perm {
            w = self.transpose(&format!("{name}.kernel_oihw"), w, &p);
        }
        let mut inputs = vec![x, w];
        let mut epilogue = Epilogue::default();
        if node.inputs.len() > 2 {
            let b = self.input(node, 2)?;
            let bias_is_zero = self.graph.konst(b).map(|t| t.to_f32_vec().iter().all(|&v| v == 0.0)).unwrap_or(false);
            if !bias_is_zero {
                let bshape = self.graph.nodes[b].shape.clone();
                let o = shape[1];
                let b = if bshape != [o] {
                    let e = self.add(&format!("{name}.bias_expand"), Op::Expand, vec![b], vec![o], dtype);
                    self.reshape(&format!("{name}.bias"), e, vec![o])
                } else {
                    b
                };
                inputs.push(b);
                epilogue.bias = true;
            }
        }
        Ok(self.add(name, Op::Conv { window, groups: conv.group, epilogue }, inputs, shape, dtype))
    }

    fn pool(
        &mut self,
        node: &TypedNode,
        spec: &ops::cnn::PoolSpec,
        kind: PoolKind,
        shape: Vec<usize>,
        dtype: DType,
    ) -> Result<NodeId, Error> {
        if spec.data_format != ops::nn::DataFormat::NCHW {
            return Err(self.unsupported(node, format!("data format {:?}", spec.data_format)));
        }
        let x = self.input(node, 0)?;
        let xs = self.graph.nodes[x].shape.clone();
        if xs.len() != 4 {
            return Err(self.unsupported(node, format!("{}-D input", xs.len())));
        }
        let (window, _) = window_of(spec, [xs[2], xs[3]]).map_err(|d| self.unsupported(node, d))?;
        Ok(self.add(&node.name, Op::Pool { kind, window }, vec![x], shape, dtype))
    }

    /// Two-input einsum as transposes, reshapes and a batched matmul:
    /// A -> [batch, m, k], B -> [batch, k, n], C = A B -> [batch, m, n] -> output order.
    fn einsum(&mut self, node: &TypedNode, expr: &str, shape: Vec<usize>, dtype: DType) -> Result<NodeId, Error> {
        let name = node.name.clone();
        let (lhs, out) = expr.split_once("->").ok_or_else(|| self.unsupported(node, format!("einsum '{expr}'")))?;
        let ins: Vec<Vec<char>> = lhs.split(',').map(|s| s.chars().collect()).collect();
        let out: Vec<char> = out.chars().collect();
        if ins.len() != 2 {
            return Err(self.unsupported(node, format!("einsum '{expr}' with {} inputs", ins.len())));
        }
        let mut a = self.input(node, 0)?;
        let mut b = self.input(node, 1)?;
        let (mut ia, mut ib) = (ins[0].clone(), ins[1].clone());
        // Sum away axes that appear in one input only.
        for (x, axes, other) in [(&mut a, &mut ia, &ins[1]), (&mut b, &mut ib, &ins[0])] {
            let lone: Vec<usize> =
                axes.iter().enumerate().filter(|(_, c)| !other.contains(c) && !out.contains(c)).map(|(i, _)| i).collect();
            if !lone.is_empty() {
                let mut s = self.graph.nodes[*x].shape.clone();
                for &i in &lone {
                    s[i] = 1;
                }
                let r = self.add(
                    &format!("{name}.sum"),
                    Op::Reduce { op: ReduceOp::Sum, axes: lone.clone() },
                    vec![*x],
                    s.clone(),
                    dtype,
                );
                let kept: Vec<usize> = s.iter().enumerate().filter(|(i, _)| !lone.contains(i)).map(|(_, &d)| d).collect();
                *x = self.reshape(&format!("{name}.squeeze"), r, kept);
                let mut i = 0;
                axes.retain(|_| {
                    i += 1;
                    !lone.contains(&(i - 1))
                });
            }
        }
        let size_of = |g: &Graph, x: NodeId, axes: &[char], c: char| g.nodes[x].shape[axes.iter().position(|&a| a == c).unwrap()];
        let batch: Vec<char> = out.iter().copied().filter(|c| ia.contains(c) && ib.contains(c)).collect();
        let m: Vec<char> = out.iter().copied().filter(|c| ia.contains(c) && !ib.contains(c)).collect();
        let n: Vec<char> = out.iter().copied().filter(|c| ib.contains(c) && !ia.contains(c)).collect();
        let k: Vec<char> = ia.iter().copied().filter(|c| ib.contains(c) && !out.contains(c)).collect();
        for c in &out {
            if !ia.contains(c) && !ib.contains(c) {
                return Err(self.unsupported(node, format!("einsum '{expr}' creates axis '{c}'")));
            }
        }
        for c in batch.iter().chain(&k) {
            if size_of(&self.graph, a, &ia, *c) != size_of(&self.graph, b, &ib, *c) {
                return Err(self.unsupported(node, format!("einsum '{expr}' broadcasts axis '{c}'")));
            }
        }
        let pos = |axes: &[char], c: char| axes.iter().position(|&x| x == c).unwrap();
        let perm_a: Vec<usize> = batch.iter().chain(&m).chain(&k).map(|&c| pos(&ia, c)).collect();
        let perm_b: Vec<usize> = batch.iter().chain(&k).chain(&n).map(|&c| pos(&ib, c)).collect();
        let sizes =
            |g: &Graph, x: NodeId, axes: &[char], cs: &[char]| cs.iter().map(|&c| size_of(g, x, axes, c)).collect::<Vec<_>>();
        let batch_sizes = sizes(&self.graph, a, &ia, &batch);
        let m_sizes = sizes(&self.graph, a, &ia, &m);
        let kk: usize = sizes(&self.graph, a, &ia, &k).iter().product();
        let nn: usize = sizes(&self.graph, b, &ib, &n).iter().product();
        // numpy matmul: A [batch.., m_1.., M, K] x B [batch.., 1.., K, N]. Leading m axes act as
        // batch dims broadcast against B, so no reshape separates the product from its bias.
        let m_dims: Vec<usize> = if m_sizes.is_empty() { vec![1] } else { m_sizes.clone() };
        let at = self.transpose(&format!("{name}.a_t"), a, &perm_a);
        let a_shape: Vec<usize> = batch_sizes.iter().chain(&m_dims).copied().chain([kk]).collect();
        let ar = self.reshape(&format!("{name}.a_r"), at, a_shape);
        let bt_node = self.transpose(&format!("{name}.b_t"), b, &perm_b);
        let b_shape: Vec<usize> =
            batch_sizes.iter().copied().chain(std::iter::repeat_n(1, m_dims.len() - 1)).chain([kk, nn]).collect();
        let br = self.reshape(&format!("{name}.b_r"), bt_node, b_shape);
        let mm_shape: Vec<usize> = batch_sizes.iter().chain(&m_dims).copied().chain([nn]).collect();
        let prod_node = self.add(&name, Op::MatMul { epilogue: Epilogue::default(), alpha: 1.0 }, vec![ar, br], mm_shape, dtype);
        // [batch.., m.., n..] in the output's axis sizes, then into the output order.
        let natural: Vec<char> = batch.iter().chain(&m).chain(&n).copied().collect();
        let natural_shape: Vec<usize> = natural.iter().map(|&c| shape[pos(&out, c)]).collect();
        let r = self.reshape(&format!("{name}.c_r"), prod_node, natural_shape);
        let perm_c: Vec<usize> = out.iter().map(|&c| pos(&natural, c)).collect();
        let y = self.transpose(&format!("{name}.c_t"), r, &perm_c);
        debug_assert_eq!(self.graph.nodes[y].shape, shape);
        Ok(y)
    }
}

/// Runs the model with tract on the given inputs: the independent oracle for tests.
pub fn tract_reference(bytes: &[u8], inputs: &[Tensor]) -> Result<Vec<Tensor>, Error> {
    let onnx = tract_onnx::onnx();
    let mut model = onnx.model_for_read(&mut &bytes[..]).map_err(|e| malformed("reference", e))?;
    for (i, t) in inputs.iter().enumerate() {
        let dt = match t.dtype() {
            DType::F32 => DatumType::F32,
            DType::F16 => DatumType::F16,
            DType::I64 => DatumType::I64,
        };
        model.set_input_fact(i, InferenceFact::dt_shape(dt, t.shape.clone())).map_err(|e| malformed("reference", e))?;
    }
    let runnable = model.into_optimized().and_then(|m| m.into_runnable()).map_err(|e| malformed("reference", e))?;
    let tv: TVec<TValue> = inputs
        .iter()
        .map(|t| {
            let tt = match &t.data {
                crate::TensorData::F32(v) => {
                    tract_ndarray::ArrayD::from_shape_vec(t.shape.clone(), v.clone()).unwrap().into_tensor()
                }
                crate::TensorData::I64(v) => {
                    tract_ndarray::ArrayD::from_shape_vec(t.shape.clone(), v.clone()).unwrap().into_tensor()
                }
                crate::TensorData::F16(v) => {
                    let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                    tract_ndarray::ArrayD::from_shape_vec(t.shape.clone(), f).unwrap().into_tensor()
                }
            };
            tt.into()
        })
        .collect();
    let out = runnable.run(tv).map_err(|e| malformed("reference", e))?;
    out.iter().map(|t| tensor_of("reference", "output", t)).collect()
}

/// Keeps `Arc` in scope for callers matching on constants.
pub type ConstTensor = Arc<Tensor>;

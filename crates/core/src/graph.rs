//! The graph IR: what the ONNX front door produces and the lowering passes rewrite.
//!
//! Semantics follow ONNX (logical NCHW for images, row-major tensors, numpy broadcasting), with
//! static shapes: every node knows its output shape and element type. Nodes are kept in a valid
//! topological order; a node has exactly one output.

use crate::tensor::{DType, Tensor};
use std::sync::Arc;

pub type NodeId = usize;

/// Activation applied by a fused epilogue or an element-wise kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    None,
    Relu,
    Relu6,
    Sigmoid,
    Tanh,
    HardSwish,
    /// Exact GELU: x * Phi(x) with erf.
    Gelu,
    /// GPT-2's tanh approximation of GELU.
    GeluTanh,
    /// SiLU (swish): x * sigmoid(x), EfficientNet's activation (exporters write Sigmoid and Mul).
    Silu,
    /// x * sigmoid(1.702 x), CLIP's "quick GELU" (exporters write Mul, Sigmoid and Mul).
    QuickGelu,
}

/// The sigmoid's scale in `Act::QuickGelu` (CLIP's constant; kernels' common.cuh has it too).
pub const QUICK_GELU_SCALE: f32 = 1.702;

impl Act {
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Act::None => x,
            Act::Relu => x.max(0.0),
            Act::Relu6 => x.clamp(0.0, 6.0),
            Act::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Act::Silu => x / (1.0 + (-x).exp()),
            Act::QuickGelu => x / (1.0 + (-QUICK_GELU_SCALE * x).exp()),
            Act::Tanh => x.tanh(),
            Act::HardSwish => x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
            Act::Gelu => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
            Act::GeluTanh => {
                let k = (2.0 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Act::None => "none",
            Act::Relu => "relu",
            Act::Relu6 => "relu6",
            Act::Sigmoid => "sigmoid",
            Act::Tanh => "tanh",
            Act::HardSwish => "hardswish",
            Act::Gelu => "gelu",
            Act::GeluTanh => "gelu_tanh",
            Act::Silu => "silu",
            Act::QuickGelu => "quick_gelu",
        }
    }
}

/// erf with float64 internals (Abramowitz-Stegun 7.1.26 is too coarse for a 1e-4 oracle).
pub fn erf(x: f32) -> f32 {
    erf64(x as f64) as f32
}

/// erf to about 1e-15 by series for small |x| and a continued fraction for large |x|.
pub fn erf64(x: f64) -> f64 {
    let ax = x.abs();
    if ax == 0.0 || x.is_nan() {
        return x;
    }
    let r = if ax < 2.5 {
        // Maclaurin series: erf(x) = 2/sqrt(pi) * sum (-1)^n x^(2n+1) / (n! (2n+1))
        let mut term = ax;
        let mut sum = ax;
        let x2 = ax * ax;
        let mut n = 0.0;
        loop {
            n += 1.0;
            term *= -x2 / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            // At |x| < 2.5 the terms fall below 1e-17 of the sum within ~50 steps.
            if add.abs() <= 1e-17 * sum.abs() || n >= 200.0 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else if ax > 6.0 {
        1.0
    } else {
        // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...)))) evaluated backwards.
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (ax + f);
        }
        1.0 - (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f)
    };
    if x < 0.0 { -r } else { r }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    /// 1 where a == b, else 0 (ONNX's booleans are 0/1 floats here).
    Equal,
    /// 1 where a < b, else 0.
    Less,
    /// 1 where a > b, else 0.
    Greater,
}

impl BinaryOp {
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Pow => {
                if b == 2.0 {
                    a * a
                } else if b == 3.0 {
                    a * a * a
                } else {
                    a.powf(b)
                }
            }
            BinaryOp::Max => a.max(b),
            BinaryOp::Min => a.min(b),
            BinaryOp::Equal => (a == b) as u8 as f32,
            BinaryOp::Less => (a < b) as u8 as f32,
            BinaryOp::Greater => (a > b) as u8 as f32,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Act(Act),
    Sqrt,
    Rsqrt,
    Recip,
    Exp,
    Erf,
    Neg,
    Abs,
    Square,
    /// 1 where x is NaN, else 0 (ONNX IsNaN: exporters guard softmax with it).
    IsNaN,
}

impl UnaryOp {
    pub fn apply(self, x: f32) -> f32 {
        match self {
            UnaryOp::Act(a) => a.apply(x),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => 1.0 / x.sqrt(),
            UnaryOp::Recip => 1.0 / x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Erf => erf(x),
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Square => x * x,
            UnaryOp::IsNaN => {
                if x.is_nan() {
                    1.0
                } else {
                    0.0
                }
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Max,
    /// Average; with `count_include_pad` the divisor counts the declared padding (never the ceil-mode overhang).
    Avg {
        count_include_pad: bool,
    },
}

/// 2-D window geometry shared by convolutions and pools (NCHW: dims are H then W).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    /// Padding before (top, left).
    pub pad_begin: [usize; 2],
    /// Padding after (bottom, right), declared by the model (ceil-mode overhang not included).
    pub pad_end: [usize; 2],
}

impl Window {
    /// Output extent along dim `d` for input extent `input`, with floor or ceil rounding
    /// (ceil never starts a window in the end padding, as PyTorch and ONNX define it).
    pub fn output_extent(&self, d: usize, input: usize, ceil: bool) -> usize {
        let span = self.dilation[d] * (self.kernel[d] - 1) + 1;
        let padded = input + self.pad_begin[d] + self.pad_end[d];
        assert!(padded >= span, "window {span} larger than padded input {padded}");
        let num = padded - span;
        let mut out = if ceil { num.div_ceil(self.stride[d]) + 1 } else { num / self.stride[d] + 1 };
        if ceil && (out - 1) * self.stride[d] >= input + self.pad_begin[d] {
            out -= 1;
        }
        out
    }
}

/// Epilogue of a fused convolution or matrix product: y = act(acc + bias + residual).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Epilogue {
    pub bias: bool,
    pub residual: bool,
    pub act: ActOpt,
}

/// `Act` with a Default (none), so epilogues derive Default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActOpt(pub Act);

impl Default for ActOpt {
    fn default() -> Self {
        ActOpt(Act::None)
    }
}

#[derive(Clone, Debug)]
pub enum Op {
    Input {
        index: usize,
    },
    Const(Arc<Tensor>),
    /// inputs: x [N,C,H,W], w [O, C/groups, KH, KW], then bias [O] if `epilogue.bias`, then residual [N,O,OH,OW] if `epilogue.residual`.
    Conv {
        window: Window,
        groups: usize,
        epilogue: Epilogue,
    },
    /// numpy matmul on inputs a [.., M, K] and b [.., K, N] of equal rank (batch dims broadcast),
    /// times `alpha`, then bias [N] and residual [.., M, N] (batch dims broadcast) per the epilogue:
    /// act(alpha * a b + bias + residual).
    MatMul {
        epilogue: Epilogue,
        alpha: f32,
    },
    Binary(BinaryOp),
    /// `act(a op b)`, produced by fusion.
    BinaryAct {
        op: BinaryOp,
        act: Act,
    },
    Unary(UnaryOp),
    /// `act(x * scale + shift)` with broadcasting (inference batch norm), produced by fusion.
    Affine {
        act: Act,
    },
    /// NCHW pooling. The output shape (in the node) records floor or ceil rounding.
    Pool {
        kind: PoolKind,
        window: Window,
    },
    /// Reduction keeping the reduced axes as size 1.
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
    },
    /// softmax(scale * x) along `axis`; with `causal`, entries past the diagonal of the last two axes are masked out;
    /// with `zero_nan`, a NaN result is 0 (the guard exporters write after a masked softmax: a row whose every key is
    /// masked to -inf gives NaN, then Where(IsNaN(y), 0, y)).
    Softmax {
        axis: usize,
        scale: f32,
        causal: bool,
        zero_nan: bool,
    },
    /// Layer normalization over the last axis: inputs x, gamma, beta.
    LayerNorm {
        eps: f32,
        /// Root-mean-square normalization (T5's, LLaMA's): x / sqrt(mean(x^2) + eps), no mean
        /// subtracted (then gamma and beta as for a layer norm).
        rms: bool,
    },
    Concat {
        axis: usize,
    },
    /// Same elements, new shape (the node's shape).
    Reshape,
    Transpose {
        perm: Vec<usize>,
    },
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    /// inputs: data, indices (i64); output shape = data[..axis] ++ indices ++ data[axis+1..].
    Gather {
        axis: usize,
    },
    /// inputs: condition (nonzero = true), a, b, broadcast.
    Where,
    /// Broadcast to the node's shape.
    Expand,
    /// Convert to the node's dtype.
    Cast,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "Input",
            Op::Const(_) => "Const",
            Op::Conv { .. } => "Conv",
            Op::MatMul { .. } => "MatMul",
            Op::Binary(b) => match b {
                BinaryOp::Add => "Add",
                BinaryOp::Sub => "Sub",
                BinaryOp::Mul => "Mul",
                BinaryOp::Div => "Div",
                BinaryOp::Pow => "Pow",
                BinaryOp::Max => "Max",
                BinaryOp::Min => "Min",
                BinaryOp::Equal => "Equal",
                BinaryOp::Less => "Less",
                BinaryOp::Greater => "Greater",
            },
            Op::BinaryAct { .. } => "BinaryAct",
            Op::Affine { .. } => "Affine",
            Op::Unary(u) => match u {
                UnaryOp::Act(_) => "Activation",
                UnaryOp::Sqrt => "Sqrt",
                UnaryOp::Rsqrt => "Rsqrt",
                UnaryOp::Recip => "Reciprocal",
                UnaryOp::Exp => "Exp",
                UnaryOp::Erf => "Erf",
                UnaryOp::Neg => "Neg",
                UnaryOp::Abs => "Abs",
                UnaryOp::Square => "Square",
                UnaryOp::IsNaN => "IsNaN",
            },
            Op::Pool { kind: PoolKind::Max, .. } => "MaxPool",
            Op::Pool { .. } => "AveragePool",
            Op::Reduce { .. } => "Reduce",
            Op::Softmax { .. } => "Softmax",
            Op::LayerNorm { .. } => "LayerNorm",
            Op::Concat { .. } => "Concat",
            Op::Reshape => "Reshape",
            Op::Transpose { .. } => "Transpose",
            Op::Slice { .. } => "Slice",
            Op::Gather { .. } => "Gather",
            Op::Where => "Where",
            Op::Expand => "Expand",
            Op::Cast => "Cast",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

#[derive(Clone, Debug)]
pub struct GraphInput {
    pub name: String,
    pub node: NodeId,
}

#[derive(Clone, Debug)]
pub struct GraphOutput {
    pub name: String,
    pub node: NodeId,
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub inputs: Vec<GraphInput>,
    pub outputs: Vec<GraphOutput>,
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph { name: name.to_string(), ..Default::default() }
    }

    pub fn add(&mut self, name: impl Into<String>, op: Op, inputs: Vec<NodeId>, shape: Vec<usize>, dtype: DType) -> NodeId {
        for &i in &inputs {
            assert!(i < self.nodes.len(), "node input {i} does not precede the node");
        }
        self.nodes.push(Node { name: name.into(), op, inputs, shape, dtype });
        self.nodes.len() - 1
    }

    pub fn add_const(&mut self, name: impl Into<String>, t: Tensor) -> NodeId {
        let (shape, dtype) = (t.shape.clone(), t.dtype());
        self.add(name, Op::Const(Arc::new(t)), vec![], shape, dtype)
    }

    pub fn konst(&self, id: NodeId) -> Option<&Arc<Tensor>> {
        match &self.nodes[id].op {
            Op::Const(t) => Some(t),
            _ => None,
        }
    }

    /// How many times each node is read (by other nodes and by graph outputs).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut uses = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for &i in &n.inputs {
                uses[i] += 1;
            }
        }
        for o in &self.outputs {
            uses[o.node] += 1;
        }
        uses
    }

    /// The readers of each node.
    pub fn consumers(&self) -> Vec<Vec<NodeId>> {
        let mut c = vec![Vec::new(); self.nodes.len()];
        for (id, n) in self.nodes.iter().enumerate() {
            for &i in &n.inputs {
                if !c[i].contains(&id) {
                    c[i].push(id);
                }
            }
        }
        c
    }

    pub fn is_output(&self, id: NodeId) -> bool {
        self.outputs.iter().any(|o| o.node == id)
    }

    /// Replaces every use of `old` (as input or output) by `new`.
    pub fn replace_uses(&mut self, old: NodeId, new: NodeId) {
        for n in &mut self.nodes {
            for i in &mut n.inputs {
                if *i == old {
                    *i = new;
                }
            }
        }
        for o in &mut self.outputs {
            if o.node == old {
                o.node = new;
            }
        }
    }

    /// Drops nodes that no output depends on and renumbers the rest, keeping the order.
    /// Inputs always stay (an unused input is still part of the model's signature).
    pub fn prune(&mut self) {
        let mut live = vec![false; self.nodes.len()];
        for o in &self.outputs {
            live[o.node] = true;
        }
        for i in &self.inputs {
            live[i.node] = true;
        }
        for id in (0..self.nodes.len()).rev() {
            if live[id] {
                for &i in &self.nodes[id].inputs {
                    live[i] = true;
                }
            }
        }
        let mut remap = vec![usize::MAX; self.nodes.len()];
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for (id, n) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            if live[id] {
                remap[id] = nodes.len();
                nodes.push(n);
            }
        }
        for n in &mut nodes {
            for i in &mut n.inputs {
                *i = remap[*i];
            }
        }
        for o in &mut self.outputs {
            o.node = remap[o.node];
        }
        for i in &mut self.inputs {
            i.node = remap[i.node];
        }
        self.nodes = nodes;
    }

    /// Restores topological order after passes that appended nodes used by earlier ones.
    pub fn toposort(&mut self) {
        let n = self.nodes.len();
        let mut order = Vec::with_capacity(n);
        let mut state = vec![0u8; n]; // 0 new, 1 visiting, 2 done
        fn visit(g: &Graph, id: NodeId, state: &mut [u8], order: &mut Vec<NodeId>) {
            // Iterative DFS to survive deep graphs.
            let mut stack = vec![(id, 0usize)];
            while let Some((node, child)) = stack.pop() {
                if child == 0 {
                    if state[node] == 2 {
                        continue;
                    }
                    assert!(state[node] != 1 || child > 0, "graph has a cycle at node {node}");
                    state[node] = 1;
                }
                if child < g.nodes[node].inputs.len() {
                    stack.push((node, child + 1));
                    let next = g.nodes[node].inputs[child];
                    if state[next] == 0 {
                        stack.push((next, 0));
                    } else {
                        assert!(state[next] == 2, "graph has a cycle through node {next}");
                    }
                } else {
                    state[node] = 2;
                    order.push(node);
                }
            }
        }
        for id in 0..n {
            if state[id] == 0 {
                visit(self, id, &mut state, &mut order);
            }
        }
        if order.iter().enumerate().all(|(i, &o)| i == o) {
            return;
        }
        let mut remap = vec![0; n];
        for (new, &old) in order.iter().enumerate() {
            remap[old] = new;
        }
        let mut old_nodes: Vec<Option<Node>> = std::mem::take(&mut self.nodes).into_iter().map(Some).collect();
        self.nodes = order.iter().map(|&o| old_nodes[o].take().unwrap()).collect();
        for node in &mut self.nodes {
            for i in &mut node.inputs {
                *i = remap[*i];
            }
        }
        for o in &mut self.outputs {
            o.node = remap[o.node];
        }
        for i in &mut self.inputs {
            i.node = remap[i.node];
        }
    }

    /// Checks structural invariants; panics with the first violation (a bug in a pass, not bad input).
    pub fn assert_valid(&self) {
        for (id, n) in self.nodes.iter().enumerate() {
            for &i in &n.inputs {
                assert!(i < id, "node {id} ({}) reads node {i} that does not precede it", n.name);
            }
        }
        for o in &self.outputs {
            assert!(o.node < self.nodes.len(), "output {} points past the graph", o.name);
        }
    }

    /// Counts of ops, for `kairos inspect`.
    pub fn op_histogram(&self) -> Vec<(&'static str, usize)> {
        let mut h: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for n in &self.nodes {
            *h.entry(n.op.name()).or_default() += 1;
        }
        let mut v: Vec<_> = h.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }
}

/// numpy broadcast of two shapes; None when incompatible.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

/// Row-major strides of a shape, in elements.
pub fn strides_of(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Strides to read a tensor of `shape` broadcast to `out` (0 on broadcast dims), right-aligned.
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides_of(shape);
    let off = out.len() - shape.len();
    (0..out.len()).map(|i| if i < off || shape[i - off] == 1 { 0 } else { s[i - off] }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        // Values from Abramowitz & Stegun table 7.1.
        for (x, e) in
            [(0.0, 0.0), (0.1, 0.1124629160), (0.5, 0.5204998778), (1.0, 0.8427007929), (2.0, 0.9953222650), (3.0, 0.9999779095)]
        {
            assert!((erf64(x) - e).abs() < 1e-9, "erf({x}) = {}", erf64(x));
            assert!((erf64(-x) + e).abs() < 1e-9);
        }
        assert!(erf64(f64::NAN).is_nan());
        assert_eq!(erf64(10.0), 1.0);
    }

    #[test]
    fn window_extent_floor_and_ceil() {
        let w = Window { kernel: [3, 3], stride: [2, 2], dilation: [1, 1], pad_begin: [0, 0], pad_end: [0, 0] };
        assert_eq!(w.output_extent(0, 10, false), 4);
        assert_eq!(w.output_extent(0, 10, true), 5);
        // Ceil mode never starts a window in the padding.
        let p = Window { pad_begin: [1, 1], pad_end: [1, 1], ..w };
        assert_eq!(p.output_extent(0, 8, true), 5);
        assert_eq!(p.output_extent(0, 7, true), 4);
    }
}

//! Graph-level passes: constant folding, canonical forms, common subexpressions, pattern fusion
//! (GELU, layer norm, softmax with scale, causal mask and NaN guard, scalar factors into matrix
//! products, batch norm into convolutions, epilogues, affine chains).
//!
//! Every pass keeps the graph valid: a rewritten node only reads nodes before it, new constants
//! are appended and put in place by a topological sort, and dead nodes are pruned at the end.

use crate::graph::*;
use crate::interp;
use crate::tensor::{DType, Tensor, element_count};
use std::collections::HashMap;
use std::sync::Arc;

/// Largest constant folding may create, in elements. Bigger folds (a transposed embedding table)
/// stay as ops: the emitter reads them as strided views of the original constant instead.
const FOLD_ELEMS_MAX: usize = 4 << 20;

/// Largest constant whose value common-subexpression elimination compares, in elements (the
/// scalars and small masks exporters repeat per layer; weights are never equal).
const CSE_CONST_ELEMS_MAX: usize = 4096;

/// Smallest window (pixels) of a patch convolution lowered as a product (`patch_convs_as_products`).
const PATCH_CONV_WINDOW_MIN: usize = 16;

/// `fuse_acts`: whether activations other than ReLU join convolution and matrix-product
/// epilogues (the tensor-core engine inlines ReLU only; others are an out-of-line call per output;
/// `kairos_ir::lower::set_fuse_acts_default`). Off, they run as element-wise launches.
pub fn optimize(g: &mut Graph) {
    optimize_with(g, super::fuse_acts_default())
}

pub fn optimize_with(g: &mut Graph, fuse_acts: bool) {
    fold_constants(g);
    for _ in 0..8 {
        if !canonicalize(g) {
            break;
        }
        fold_constants(g);
    }
    patch_convs_as_products(g);
    fuse_gelu(g);
    fuse_silu(g);
    fuse_layer_norm(g);
    // Before common subexpressions: a scaling repeated in two layers folds into both products
    // instead of becoming one launch both read.
    fuse_product_scales(g);
    eliminate_common(g);
    fuse_softmax(g);
    // A product's bias joins its epilogue first; an activation or residual add behind a reshape
    // of it then moves before the reshape and joins it too.
    fuse_epilogues(g, fuse_acts);
    while views_after_epilogues(g) {
        fuse_epilogues(g, fuse_acts);
    }
    // After the epilogues: the siblings' biases are in them and concatenate with the weights.
    merge_sibling_products(g);
    fuse_eltwise(g);
    g.prune();
    g.assert_valid();
}

fn konst(g: &Graph, id: NodeId) -> Option<&Arc<Tensor>> {
    g.konst(id)
}

/// The value of a one-element float constant.
fn scalar(g: &Graph, id: NodeId) -> Option<f32> {
    let t = konst(g, id)?;
    (t.len() == 1 && t.dtype() != DType::I64).then(|| t.to_f32_vec()[0])
}

fn all_equal(g: &Graph, id: NodeId, v: f32) -> bool {
    konst(g, id).is_some_and(|t| t.dtype() != DType::I64 && t.to_f32_vec().iter().all(|&x| x == v))
}

fn close(a: f32, b: f32, rel: f32) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-30)
}

/// Values of a constant that broadcasts against `shape` and varies only along `axis` (or not at
/// all), expanded to `shape[axis]` values.
fn per_axis(g: &Graph, id: NodeId, shape: &[usize], axis: usize) -> Option<Vec<f32>> {
    let t = konst(g, id)?;
    if t.dtype() == DType::I64 || t.shape.len() > shape.len() {
        return None;
    }
    let off = shape.len() - t.shape.len();
    let n = shape[axis];
    let mut along = None;
    for (d, &s) in t.shape.iter().enumerate() {
        let d_out = d + off;
        if s == 1 {
            continue;
        }
        if d_out != axis || s != n {
            return None;
        }
        along = Some(());
    }
    let v = t.to_f32_vec();
    Some(if along.is_some() { v } else { vec![v[0]; n] })
}

fn alias(g: &mut Graph, id: NodeId, to: NodeId) {
    g.replace_uses(id, to);
}

/// Common subexpressions: a node that computes what an earlier node computes (the same op on the
/// same inputs, with the same shape and type; constants of at most CSE_CONST_ELEMS_MAX elements
/// with equal values) is replaced by the earlier one. Exporters repeat per layer what does not
/// depend on the layer: the TorchScript exporter's BERT builds the additive attention mask (a
/// Where on the padding mask) once per layer, one launch each.
pub fn eliminate_common(g: &mut Graph) {
    let mut seen: HashMap<String, NodeId> = HashMap::new();
    let mut merged = false;
    for id in 0..g.nodes.len() {
        if g.is_output(id) {
            continue;
        }
        let n = &g.nodes[id];
        let key = match &n.op {
            Op::Input { .. } => continue,
            Op::Const(t) if t.len() > CSE_CONST_ELEMS_MAX => continue,
            Op::Const(t) => format!("const {:?} {:?} {:?}", t.dtype(), t.shape, t.to_bytes()),
            op => format!("{op:?} {:?} {:?} {:?}", n.inputs, n.shape, n.dtype),
        };
        match seen.get(&key) {
            // Later nodes read the earlier one from here on, so their keys name it.
            Some(&first) => {
                g.replace_uses(id, first);
                merged = true;
            }
            None => {
                seen.insert(key, id);
            }
        }
    }
    if merged {
        g.prune();
    }
}

/// A convolution whose windows tile its input exactly (kernel = stride, no padding, no dilation,
/// one group) with windows of at least [`PATCH_CONV_WINDOW_MIN`] pixels (a vision transformer's
/// patch embedding, ConvNeXt's and Swin's 4 x 4 stems) is a matrix product of the patches, [N, OH
/// OW, C KH KW], by the weights as [C KH KW, O]: the patches are one transposed copy of the input,
/// the product runs on the tensor-core engine's linear-layer tiles, and its output is viewed back
/// as [N, O, OH, OW]. ViT-B/16's 16 x 16 patches: 58 µs as a convolution, 7 + 16 µs as copy and
/// product (H200); ConvNeXt's 4 x 4 stem: the same either way; its 2 x 2 downsampling layers:
/// 13 µs as a convolution, 8 + 13 µs as copy and product, so they stay convolutions.
fn patch_convs_as_products(g: &mut Graph) {
    let mut changed = false;
    for id in 0..g.nodes.len() {
        let n = g.nodes[id].clone();
        let Op::Conv { window: w, groups: 1, epilogue } = n.op else { continue };
        let (x, wk) = (n.inputs[0], n.inputs[1]);
        let Some(weights) = konst(g, wk).cloned() else { continue };
        let xs = g.nodes[x].shape.clone();
        let [kh, kw] = w.kernel;
        if w.stride != w.kernel
            || w.dilation != [1, 1]
            || w.pad_begin != [0, 0]
            || w.pad_end != [0, 0]
            || epilogue.residual
            || xs.len() != 4
            || n.shape.len() != 4
            || xs[2] != n.shape[2] * kh
            || xs[3] != n.shape[3] * kw
            || kh * kw < PATCH_CONV_WINDOW_MIN
        {
            continue;
        }
        let (batch, c, o, oh, ow) = (xs[0], xs[1], n.shape[1], n.shape[2], n.shape[3]);
        let k = c * kh * kw;
        let dt = n.dtype;
        let x6 = g.add(format!("{}.patches6", n.name), Op::Reshape, vec![x], vec![batch, c, oh, kh, ow, kw], dt);
        let xt = g.add(
            format!("{}.patches_t", n.name),
            Op::Transpose { perm: vec![0, 2, 4, 1, 3, 5] },
            vec![x6],
            vec![batch, oh, ow, c, kh, kw],
            dt,
        );
        let a = g.add(format!("{}.patches", n.name), Op::Reshape, vec![xt], vec![batch, oh * ow, k], dt);
        // Weights [O, C, KH, KW] as [1, C KH KW, O].
        let wv = weights.to_f32_vec();
        let mut wt = vec![0f32; k * o];
        for oo in 0..o {
            for kk in 0..k {
                wt[kk * o + oo] = wv[oo * k + kk];
            }
        }
        let b = g.add_const(format!("{}.weight_kn", n.name), Tensor::f32(vec![1, k, o], wt));
        let mut inputs = vec![a, b];
        inputs.extend_from_slice(&n.inputs[2..]);
        let y = g.add(n.name.clone(), Op::MatMul { epilogue, alpha: 1.0 }, inputs, vec![batch, oh * ow, o], dt);
        let y4 = g.add(format!("{}.nhwc", n.name), Op::Reshape, vec![y], vec![batch, oh, ow, o], dt);
        g.nodes[id].op = Op::Transpose { perm: vec![0, 3, 1, 2] };
        g.nodes[id].inputs = vec![y4];
        changed = true;
    }
    if changed {
        g.toposort();
        g.prune();
    }
}

/// Most output columns a merged sibling product may have (a bound on the weight it concatenates:
/// 3 x 4096 covers the query, key and value projections of every common transformer).
const SIBLING_PRODUCT_COLUMNS_MAX: usize = 16384;

/// Matrix products that read the same activations with constant weights ([K, N], or [1, .., K, N]:
/// the importer gives weights the activations' rank), such as attention's query, key and value
/// projections that BERT-style models write as three `nn.Linear`, become one product over the
/// weights side by side, [K, N1 + N2 + ..], with the biases side by side in its
/// epilogue; each original product becomes a slice of its columns, which its readers take as a
/// strided view (no copy: reshapes into heads and transposes stay views). One launch instead of
/// three, with three times the columns: at batch 1 the separate products each fill a few CTAs of
/// the GPU, the merged one more. Products merge only with the same alpha, activation and bias
/// presence, no residual, fp32 weights, and none of them a graph output.
fn merge_sibling_products(g: &mut Graph) {
    /// What sibling products share: the activations they read, the weights' rank and K, alpha (as
    /// bits), activation and whether a bias is fused.
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    struct Siblings {
        a: NodeId,
        rank: usize,
        k: usize,
        alpha_bits: u32,
        act: Act,
        bias: bool,
    }
    let mut groups: HashMap<Siblings, Vec<NodeId>> = HashMap::new();
    for (id, n) in g.nodes.iter().enumerate() {
        let Op::MatMul { epilogue, alpha } = &n.op else { continue };
        if epilogue.residual || g.is_output(id) || n.inputs.len() != 2 + usize::from(epilogue.bias) {
            continue;
        }
        let (a, w) = (n.inputs[0], n.inputs[1]);
        let Some(wt) = konst(g, w) else { continue };
        let rank = wt.shape.len();
        if rank < 2 || wt.shape[..rank - 2].iter().any(|&d| d != 1) || wt.dtype() != DType::F32 || konst(g, a).is_some() {
            continue;
        }
        let (k, width) = (wt.shape[rank - 2], wt.shape[rank - 1]);
        if epilogue.bias && konst(g, n.inputs[2]).is_none_or(|b| b.dtype() != DType::F32 || b.len() != width) {
            continue;
        }
        let key = Siblings { a, rank, k, alpha_bits: alpha.to_bits(), act: epilogue.act.0, bias: epilogue.bias };
        groups.entry(key).or_default().push(id);
    }
    let mut changed = false;
    let mut groups: Vec<_> = groups.into_iter().filter(|(_, ids)| ids.len() > 1).collect();
    groups.sort_by_key(|(_, ids)| ids[0]);
    for (Siblings { a, rank, k, bias, .. }, ids) in groups {
        let widths: Vec<usize> = ids.iter().map(|&id| g.nodes[g.nodes[id].inputs[1]].shape[rank - 1]).collect();
        let n_total: usize = widths.iter().sum();
        if n_total > SIBLING_PRODUCT_COLUMNS_MAX {
            continue;
        }
        let first = g.nodes[ids[0]].clone();
        let mut w = vec![0f32; k * n_total];
        let mut b = Vec::with_capacity(n_total);
        let mut col = 0;
        for (&id, &width) in ids.iter().zip(&widths) {
            let wv = konst(g, g.nodes[id].inputs[1]).expect("grouped weights are constants").to_f32_vec();
            for r in 0..k {
                w[r * n_total + col..r * n_total + col + width].copy_from_slice(&wv[r * width..(r + 1) * width]);
            }
            if bias {
                b.extend(konst(g, g.nodes[id].inputs[2]).expect("grouped biases are constants").to_f32_vec());
            }
            col += width;
        }
        let names: Vec<&str> = ids.iter().map(|&id| g.nodes[id].name.as_str()).collect();
        let merged_name = format!("{}.merged{}", names[0], names.len());
        let mut w_shape = vec![1; rank - 2];
        w_shape.extend([k, n_total]);
        let wid = g.add_const(format!("{merged_name}.weight"), Tensor::f32(w_shape, w));
        let mut inputs = vec![a, wid];
        if bias {
            inputs.push(g.add_const(format!("{merged_name}.bias"), Tensor::f32(vec![n_total], b)));
        }
        let mut shape = first.shape.clone();
        *shape.last_mut().expect("a product's output has rank >= 2") = n_total;
        let merged = g.add(merged_name, first.op.clone(), inputs, shape, first.dtype);
        let axis = first.shape.len() - 1;
        let mut start = 0;
        for (&id, &width) in ids.iter().zip(&widths) {
            g.nodes[id].op = Op::Slice { axis, start, end: start + width };
            g.nodes[id].inputs = vec![merged];
            start += width;
        }
        changed = true;
    }
    if changed {
        g.toposort();
        g.prune();
    }
}

/// Scalar factors of a matrix product's operands and of its result move into its alpha:
/// (c1 a)(c2 b) = c1 c2 (a b), computed in f32 in the product's epilogue. The TorchScript
/// exporter's scaled-dot-product attention multiplies queries and keys by the fourth root of
/// 1 / head size each, torchvision's attention scales the queries, eager attention divides the
/// scores: each was an element-wise launch over a [B, H, S, D] or [B, H, S, S] tensor.
fn fuse_product_scales(g: &mut Graph) {
    loop {
        let mut changed = false;
        let uses = g.use_counts();
        for id in 0..g.nodes.len() {
            let n = g.nodes[id].clone();
            match (&n.op, n.inputs.as_slice()) {
                (Op::MatMul { epilogue, alpha }, &[a, b]) if *epilogue == Epilogue::default() => {
                    let mut alpha = *alpha;
                    let mut ins = [a, b];
                    for x in &mut ins {
                        if uses[*x] != 1 || g.is_output(*x) {
                            continue;
                        }
                        if let (Op::Binary(BinaryOp::Mul), &[y, c]) = (&g.nodes[*x].op, g.nodes[*x].inputs.as_slice())
                            && let Some(s) = scalar(g, c)
                            && g.nodes[y].shape == g.nodes[*x].shape
                            && g.nodes[y].dtype == g.nodes[*x].dtype
                        {
                            alpha *= s;
                            *x = y;
                        }
                    }
                    if ins != [a, b] {
                        g.nodes[id].op = Op::MatMul { epilogue: Epilogue::default(), alpha };
                        g.nodes[id].inputs = ins.to_vec();
                        changed = true;
                    }
                }
                (Op::Binary(BinaryOp::Mul), &[p, c]) if uses[p] == 1 && !g.is_output(p) => {
                    let Some(s) = scalar(g, c) else { continue };
                    let prod = &g.nodes[p];
                    if let Op::MatMul { epilogue, alpha } = prod.op
                        && epilogue == Epilogue::default()
                        && prod.shape == n.shape
                        && prod.dtype == n.dtype
                    {
                        let (name, inputs) = (prod.name.clone(), prod.inputs.clone());
                        g.nodes[id].op = Op::MatMul { epilogue, alpha: alpha * s };
                        g.nodes[id].inputs = inputs;
                        g.nodes[id].name = name;
                        changed = true;
                    }
                }
                _ => {}
            }
        }
        if !changed {
            break;
        }
        g.prune();
    }
}

/// Evaluates every node whose inputs are all constants (within the size limit).
pub fn fold_constants(g: &mut Graph) {
    for id in 0..g.nodes.len() {
        let n = &g.nodes[id];
        if matches!(n.op, Op::Input { .. } | Op::Const(_)) || n.inputs.is_empty() {
            continue;
        }
        if element_count(&n.shape) > FOLD_ELEMS_MAX || !n.inputs.iter().all(|&i| konst(g, i).is_some()) {
            continue;
        }
        let ins: Vec<&Tensor> = n.inputs.iter().map(|&i| konst(g, i).unwrap().as_ref()).collect();
        let t = interp::eval(&n.op, &ins, &n.shape, n.dtype);
        g.nodes[id].op = Op::Const(Arc::new(t));
        g.nodes[id].inputs.clear();
    }
}

/// Small rewrites to one canonical form, so fusion patterns have fewer shapes to match.
fn canonicalize(g: &mut Graph) -> bool {
    let mut changed = false;
    let uses = g.use_counts();
    for id in 0..g.nodes.len() {
        let node = g.nodes[id].clone();
        match (&node.op, node.inputs.as_slice()) {
            // Constants second in commutative ops.
            (Op::Binary(BinaryOp::Add | BinaryOp::Mul | BinaryOp::Max | BinaryOp::Min), &[a, b])
                if konst(g, a).is_some() && konst(g, b).is_none() =>
            {
                g.nodes[id].inputs = vec![b, a];
                changed = true;
            }
            (Op::Binary(BinaryOp::Sub), &[x, c]) if konst(g, c).is_some() && konst(g, x).is_none() => {
                let t = konst(g, c).unwrap();
                let neg = Tensor::f32(t.shape.clone(), t.to_f32_vec().iter().map(|v| -v).collect());
                let k = g.add_const(format!("{}.neg", node.name), neg);
                g.nodes[id].op = Op::Binary(BinaryOp::Add);
                g.nodes[id].inputs = vec![x, k];
                changed = true;
            }
            // (x + c1) + c2 = x + (c1 + c2), and likewise for products.
            (Op::Binary(op @ (BinaryOp::Add | BinaryOp::Mul)), &[inner, c2])
                if konst(g, c2).is_some() && uses[inner] == 1 && same_op_with_const(g, inner, *op, &node.shape).is_some() =>
            {
                let (x, c1) = same_op_with_const(g, inner, *op, &node.shape).unwrap();
                let (t1, t2) = (konst(g, c1).unwrap().clone(), konst(g, c2).unwrap().clone());
                if let Some(cs) = broadcast_shapes(&t1.shape, &t2.shape) {
                    let combined = interp::eval(&Op::Binary(*op), &[&t1, &t2], &cs, DType::F32);
                    let k = g.add_const(format!("{}.combined", node.name), combined);
                    g.nodes[id].inputs = vec![x, k];
                    changed = true;
                }
            }
            // 1 / sqrt(z) is rsqrt(z), 1 / z is recip(z) (T5's RMS norm: x * (1 / sqrt(mean(x^2) + eps))).
            (Op::Binary(BinaryOp::Div), &[one, d]) if all_equal(g, one, 1.0) && g.nodes[d].shape == node.shape => {
                match (&g.nodes[d].op, g.nodes[d].inputs.as_slice()) {
                    (Op::Unary(UnaryOp::Sqrt), &[z]) if uses[d] == 1 => {
                        g.nodes[id].op = Op::Unary(UnaryOp::Rsqrt);
                        g.nodes[id].inputs = vec![z];
                    }
                    _ => {
                        g.nodes[id].op = Op::Unary(UnaryOp::Recip);
                        g.nodes[id].inputs = vec![d];
                    }
                }
                changed = true;
            }
            (Op::Binary(BinaryOp::Div), &[x, c]) if konst(g, c).is_some() && konst(g, x).is_none() => {
                let t = konst(g, c).unwrap();
                let inv = Tensor::f32(t.shape.clone(), t.to_f32_vec().iter().map(|v| 1.0 / v).collect());
                let k = g.add_const(format!("{}.recip", node.name), inv);
                g.nodes[id].op = Op::Binary(BinaryOp::Mul);
                g.nodes[id].inputs = vec![x, k];
                changed = true;
            }
            (Op::Binary(BinaryOp::Add), &[x, c]) if all_equal(g, c, 0.0) && g.nodes[x].shape == node.shape => {
                alias(g, id, x);
                changed = true;
            }
            (Op::Binary(BinaryOp::Mul), &[x, c]) if all_equal(g, c, 1.0) && g.nodes[x].shape == node.shape => {
                alias(g, id, x);
                changed = true;
            }
            (Op::Binary(BinaryOp::Pow), &[x, c]) if scalar(g, c).is_some() => {
                let e = scalar(g, c).unwrap();
                if e == 2.0 {
                    g.nodes[id].op = Op::Unary(UnaryOp::Square);
                    g.nodes[id].inputs = vec![x];
                    changed = true;
                } else if e == 0.5 {
                    g.nodes[id].op = Op::Unary(UnaryOp::Sqrt);
                    g.nodes[id].inputs = vec![x];
                    changed = true;
                } else if e == 1.0 && g.nodes[x].shape == node.shape {
                    alias(g, id, x);
                    changed = true;
                }
            }
            (Op::Binary(BinaryOp::Max), &[x, c]) if scalar(g, c) == Some(0.0) && g.nodes[x].shape == node.shape => {
                // max(min(x, 6), 0) is ReLU6.
                let inner = &g.nodes[x];
                if let (Op::Binary(BinaryOp::Min), &[y, six]) = (&inner.op, inner.inputs.as_slice())
                    && scalar(g, six) == Some(6.0)
                    && uses[x] == 1
                {
                    g.nodes[id].op = Op::Unary(UnaryOp::Act(Act::Relu6));
                    g.nodes[id].inputs = vec![y];
                } else {
                    g.nodes[id].op = Op::Unary(UnaryOp::Act(Act::Relu));
                    g.nodes[id].inputs = vec![x];
                }
                changed = true;
            }
            (Op::Binary(BinaryOp::Min), &[x, c]) if scalar(g, c) == Some(6.0) && g.nodes[x].shape == node.shape => {
                let inner = &g.nodes[x];
                if let (Op::Unary(UnaryOp::Act(Act::Relu)), &[y]) = (&inner.op, inner.inputs.as_slice())
                    && uses[x] == 1
                {
                    g.nodes[id].op = Op::Unary(UnaryOp::Act(Act::Relu6));
                    g.nodes[id].inputs = vec![y];
                    changed = true;
                }
            }
            // sum(x) * (1/n) is mean(x).
            (Op::Binary(BinaryOp::Mul), &[r, c]) if scalar(g, c).is_some() && uses[r] == 1 => {
                if let Op::Reduce { op: ReduceOp::Sum, axes } = &g.nodes[r].op {
                    let src = g.nodes[r].inputs[0];
                    let count: usize = axes.iter().map(|&a| g.nodes[src].shape[a]).product();
                    if close(scalar(g, c).unwrap(), 1.0 / count as f32, 1e-5) && g.nodes[r].shape == node.shape {
                        g.nodes[id].op = Op::Reduce { op: ReduceOp::Mean, axes: axes.clone() };
                        g.nodes[id].inputs = vec![src];
                        changed = true;
                    }
                }
            }
            (Op::Reshape, &[x]) => {
                if g.nodes[x].shape == node.shape {
                    alias(g, id, x);
                    changed = true;
                } else if let (Op::Reshape, &[y]) = (&g.nodes[x].op, g.nodes[x].inputs.as_slice()) {
                    g.nodes[id].inputs = vec![y];
                    changed = true;
                }
            }
            (Op::Transpose { perm }, &[x]) => {
                // Dims of size 1 may move freely: a transpose that keeps the others in order is a
                // reshape (torchvision's attention at batch 1: [S, 1, E] -> [1, S, E]), which
                // epilogues see through (views_after_epilogues).
                let in_shape = &g.nodes[x].shape;
                let kept: Vec<usize> = perm.iter().copied().filter(|&p| in_shape[p] != 1).collect();
                if perm.iter().enumerate().all(|(i, &p)| i == p) {
                    alias(g, id, x);
                    changed = true;
                } else if kept.windows(2).all(|w| w[0] < w[1]) {
                    g.nodes[id].op = Op::Reshape;
                    changed = true;
                } else if let (Op::Transpose { perm: inner }, &[y]) = (&g.nodes[x].op, g.nodes[x].inputs.as_slice()) {
                    let composed: Vec<usize> = perm.iter().map(|&p| inner[p]).collect();
                    g.nodes[id].op = Op::Transpose { perm: composed };
                    g.nodes[id].inputs = vec![y];
                    changed = true;
                }
            }
            (Op::Cast, &[x]) if g.nodes[x].dtype == node.dtype => {
                alias(g, id, x);
                changed = true;
            }
            (Op::Expand, &[x]) if g.nodes[x].shape == node.shape => {
                alias(g, id, x);
                changed = true;
            }
            _ => {}
        }
    }
    if changed {
        g.toposort();
        g.prune();
    }
    changed
}

/// `x op c` (c constant, x not) with x of shape `shape`: returns (x, c).
fn same_op_with_const(g: &Graph, id: NodeId, op: BinaryOp, shape: &[usize]) -> Option<(NodeId, NodeId)> {
    let n = &g.nodes[id];
    match (&n.op, n.inputs.as_slice()) {
        (Op::Binary(o), &[x, c])
            if *o == op && konst(g, c).is_some() && konst(g, x).is_none() && g.nodes[x].shape == shape && !g.is_output(id) =>
        {
            Some((x, c))
        }
        _ => None,
    }
}

/// Flattens a product tree rooted at `id` into its factors (following single-use Muls).
fn factors(g: &Graph, uses: &[usize], id: NodeId, root: bool, out: &mut Vec<NodeId>) {
    let n = &g.nodes[id];
    if matches!(n.op, Op::Binary(BinaryOp::Mul)) && (root || uses[id] == 1) {
        factors(g, uses, n.inputs[0], false, out);
        factors(g, uses, n.inputs[1], false, out);
    } else {
        out.push(id);
    }
}

fn as_op<'a>(g: &'a Graph, id: NodeId, op_name: &str) -> Option<&'a [NodeId]> {
    let n = &g.nodes[id];
    (n.op.name() == op_name).then_some(n.inputs.as_slice())
}

/// x * c with c a scalar constant close to `value`: returns x.
fn times_scalar(g: &Graph, uses: &[usize], id: NodeId, value: f32) -> Option<NodeId> {
    let mut f = Vec::new();
    factors(g, uses, id, true, &mut f);
    if f.len() != 2 {
        return None;
    }
    let (a, b) = (f[0], f[1]);
    if scalar(g, b).is_some_and(|v| close(v, value, 1e-4)) {
        Some(a)
    } else if scalar(g, a).is_some_and(|v| close(v, value, 1e-4)) {
        Some(b)
    } else {
        None
    }
}

/// `1 + inner(...)` where inner is Erf or Tanh: returns inner's argument.
fn one_plus(g: &Graph, id: NodeId, inner: &str) -> Option<NodeId> {
    let ins = as_op(g, id, "Add")?;
    let (a, b) = (ins[0], ins[1]);
    let (t, one) = if scalar(g, b).is_some() { (a, b) } else { (b, a) };
    if scalar(g, one) != Some(1.0) {
        return None;
    }
    let arg = as_op(g, t, inner)?;
    Some(arg[0])
}

/// Replaces x * 0.5 * (1 + erf(x / sqrt 2)) and GPT-2's tanh form by one GELU activation.
fn fuse_gelu(g: &mut Graph) {
    let uses = g.use_counts();
    for id in 0..g.nodes.len() {
        if !matches!(g.nodes[id].op, Op::Binary(BinaryOp::Mul)) {
            continue;
        }
        let mut f = Vec::new();
        factors(g, &uses, id, true, &mut f);
        if f.len() != 3 {
            continue;
        }
        let Some(half_pos) = f.iter().position(|&x| scalar(g, x).is_some_and(|v| close(v, 0.5, 1e-6))) else { continue };
        f.remove(half_pos);
        for (x, a) in [(f[0], f[1]), (f[1], f[0])] {
            // Exact: a = 1 + erf(x * 0.70710678).
            if let Some(arg) = one_plus(g, a, "Erf")
                && times_scalar(g, &uses, arg, std::f32::consts::FRAC_1_SQRT_2) == Some(x)
            {
                g.nodes[id].op = Op::Unary(UnaryOp::Act(Act::Gelu));
                g.nodes[id].inputs = vec![x];
                break;
            }
            // Tanh form: a = 1 + tanh(k * (x + 0.044715 * x^3)).
            if let Some(t_in) = tanh_arg(g, a)
                && let Some(inner) = times_scalar(g, &uses, t_in, (2.0 / std::f32::consts::PI).sqrt())
                && let Some(ins) = as_op(g, inner, "Add")
            {
                let (p, q) = (ins[0], ins[1]);
                let cubic = |c: NodeId| {
                    let y = times_scalar(g, &uses, c, 0.044715)?;
                    let pw = as_op(g, y, "Pow")?;
                    (pw[0] == x && scalar(g, pw[1]) == Some(3.0)).then_some(())
                };
                if (p == x && cubic(q).is_some()) || (q == x && cubic(p).is_some()) {
                    g.nodes[id].op = Op::Unary(UnaryOp::Act(Act::GeluTanh));
                    g.nodes[id].inputs = vec![x];
                    break;
                }
            }
        }
    }
    g.prune();
}

/// Replaces x * sigmoid(x) (how exporters write SiLU, EfficientNet's activation) by one SiLU
/// activation, which the epilogue fusion then moves into the convolution or product before it:
/// two element-wise launches fewer per activation.
fn fuse_silu(g: &mut Graph) {
    for id in 0..g.nodes.len() {
        if !matches!(g.nodes[id].op, Op::Binary(BinaryOp::Mul)) || g.nodes[id].inputs.len() != 2 {
            continue;
        }
        let (a, b) = (g.nodes[id].inputs[0], g.nodes[id].inputs[1]);
        let sigmoid_of = |s: NodeId| match &g.nodes[s].op {
            Op::Unary(UnaryOp::Act(Act::Sigmoid)) => Some(g.nodes[s].inputs[0]),
            _ => None,
        };
        // x * sigmoid(x), or CLIP's x * sigmoid(1.702 x).
        let quick_of = |s: NodeId| {
            let arg = sigmoid_of(s)?;
            let ins = as_op(g, arg, "Mul")?;
            scalar(g, ins[1]).is_some_and(|c| close(c, QUICK_GELU_SCALE, 1e-6)).then_some(ins[0])
        };
        let (x, act) = if sigmoid_of(b) == Some(a) {
            (a, Act::Silu)
        } else if sigmoid_of(a) == Some(b) {
            (b, Act::Silu)
        } else if quick_of(b) == Some(a) {
            (a, Act::QuickGelu)
        } else if quick_of(a) == Some(b) {
            (b, Act::QuickGelu)
        } else {
            continue;
        };
        if g.nodes[id].shape != g.nodes[x].shape {
            continue;
        }
        g.nodes[id].op = Op::Unary(UnaryOp::Act(act));
        g.nodes[id].inputs = vec![x];
    }
    g.prune();
}

/// The argument of tanh in `1 + tanh(arg)`.
fn tanh_arg(g: &Graph, id: NodeId) -> Option<NodeId> {
    let ins = as_op(g, id, "Add")?;
    let (a, b) = (ins[0], ins[1]);
    let (t, one) = if scalar(g, b).is_some() { (a, b) } else { (b, a) };
    if scalar(g, one) != Some(1.0) {
        return None;
    }
    match &g.nodes[t].op {
        Op::Unary(UnaryOp::Act(Act::Tanh)) => Some(g.nodes[t].inputs[0]),
        _ => None,
    }
}

fn is_mean_last(g: &Graph, id: NodeId) -> Option<NodeId> {
    let n = &g.nodes[id];
    match &n.op {
        Op::Reduce { op: ReduceOp::Mean, axes } if axes.len() == 1 => {
            let x = n.inputs[0];
            (axes[0] == g.nodes[x].shape.len() - 1).then_some(x)
        }
        _ => None,
    }
}

/// Matches the normalized value of a layer norm: (x - mean(x)) / sqrt(mean((x - mean)^2) + eps),
/// or of an RMS norm, x / sqrt(mean(x^2) + eps), spelled with Div/Sqrt or Mul/Rsqrt. Returns (x,
/// eps, whether it is an RMS norm).
fn match_normalized(g: &Graph, id: NodeId) -> Option<(NodeId, f32, bool)> {
    let n = &g.nodes[id];
    let (d, denom_in) = match (&n.op, n.inputs.as_slice()) {
        (Op::Binary(BinaryOp::Div), &[d, s]) => (d, as_op(g, s, "Sqrt")?[0]),
        (Op::Binary(BinaryOp::Mul), &[a, b]) => {
            if let Some(r) = as_op(g, b, "Rsqrt") {
                (a, r[0])
            } else if let Some(r) = as_op(g, a, "Rsqrt") {
                (b, r[0])
            } else {
                return None;
            }
        }
        _ => return None,
    };
    // d = x - mean(x), or d = x (RMS)
    let (x, rms) = match (&g.nodes[d].op, g.nodes[d].inputs.as_slice()) {
        (Op::Binary(BinaryOp::Sub), &[x, m]) if is_mean_last(g, m) == Some(x) => (x, false),
        _ => (d, true),
    };
    // denom_in = var + eps, var = mean(square(d))
    let ins = as_op(g, denom_in, "Add")?;
    let (var, eps) = if scalar(g, ins[1]).is_some() { (ins[0], ins[1]) } else { (ins[1], ins[0]) };
    let eps = scalar(g, eps)?;
    let sq = is_mean_last(g, var)?;
    let sq_in = as_op(g, sq, "Square")?[0];
    (sq_in == d).then_some((x, eps, rms))
}

fn fuse_layer_norm(g: &mut Graph) {
    // Outermost pattern first: y = n * gamma + beta must win over its inner n * gamma.
    for id in (0..g.nodes.len()).rev() {
        let shape = g.nodes[id].shape.clone();
        if shape.is_empty() {
            continue;
        }
        let last = shape.len() - 1;
        let c = shape[last];
        // y = n * gamma + beta, y = n * gamma, y = n + beta, or y = n.
        let n = &g.nodes[id];
        let (norm, gamma, beta) = match (&n.op, n.inputs.as_slice()) {
            (Op::Binary(BinaryOp::Add), &[m, b]) if per_axis(g, b, &shape, last).is_some() => {
                match (&g.nodes[m].op, g.nodes[m].inputs.as_slice()) {
                    (Op::Binary(BinaryOp::Mul), &[nn, gm]) if per_axis(g, gm, &shape, last).is_some() => {
                        (nn, per_axis(g, gm, &shape, last), per_axis(g, b, &shape, last))
                    }
                    _ => (m, None, per_axis(g, b, &shape, last)),
                }
            }
            (Op::Binary(BinaryOp::Mul), &[nn, gm]) if per_axis(g, gm, &shape, last).is_some() => {
                (nn, per_axis(g, gm, &shape, last), None)
            }
            _ => (id, None, None),
        };
        let Some((x, eps, rms)) = match_normalized(g, norm) else { continue };
        if g.nodes[x].shape != shape {
            continue;
        }
        let name = g.nodes[id].name.clone();
        let gk = g.add_const(format!("{name}.gamma"), Tensor::f32(vec![c], gamma.unwrap_or_else(|| vec![1.0; c])));
        let bk = g.add_const(format!("{name}.beta"), Tensor::f32(vec![c], beta.unwrap_or_else(|| vec![0.0; c])));
        g.nodes[id].op = Op::LayerNorm { eps, rms };
        g.nodes[id].inputs = vec![x, gk, bk];
    }
    g.toposort();
    g.prune();
}

/// A constant mask over the last two axes that keeps key j for query i iff j <= i + (keys - queries).
fn is_causal_keep_mask(g: &Graph, id: NodeId, keep_if_nonzero: bool, shape: &[usize]) -> bool {
    let Some(t) = konst(g, id) else { return false };
    if t.shape.len() < 2 || shape.len() < 2 {
        return false;
    }
    let (q, k) = (t.shape[t.shape.len() - 2], t.shape[t.shape.len() - 1]);
    if q != shape[shape.len() - 2] || k != shape[shape.len() - 1] || k < q {
        return false;
    }
    let v = t.to_f32_vec();
    v.chunks(q * k).all(|m| (0..q).all(|i| (0..k).all(|j| ((m[i * k + j] != 0.0) == keep_if_nonzero) == (j <= i + k - q))))
}

/// Folds scales and causal masks into the softmax that consumes them.
fn fuse_softmax(g: &mut Graph) {
    for id in 0..g.nodes.len() {
        let Op::Softmax { axis, mut scale, mut causal, zero_nan } = g.nodes[id].op.clone() else { continue };
        let shape = g.nodes[id].shape.clone();
        if axis != shape.len() - 1 {
            continue;
        }
        let uses = g.use_counts();
        let mut src = g.nodes[id].inputs[0];
        loop {
            if uses[src] != 1 {
                break;
            }
            let n = &g.nodes[src];
            match (&n.op, n.inputs.as_slice()) {
                (Op::Binary(BinaryOp::Mul), &[x, c]) if scalar(g, c).is_some() => {
                    scale *= scalar(g, c).unwrap();
                    src = x;
                }
                (Op::Where, &[m, x, neg]) if !causal && scalar(g, neg).is_some_and(|v| v <= -1e4) => {
                    if is_causal_keep_mask(g, m, true, &shape) && g.nodes[x].shape == shape {
                        causal = true;
                        src = x;
                    } else {
                        break;
                    }
                }
                (Op::Binary(BinaryOp::Add), &[x, m]) if !causal && konst(g, m).is_some() => {
                    let t = konst(g, m).unwrap();
                    let ok_values = t.to_f32_vec().iter().all(|&v| v == 0.0 || v <= -1e4);
                    if ok_values && is_causal_keep_mask(g, m, false, &shape) && g.nodes[x].shape == shape {
                        causal = true;
                        src = x;
                    } else {
                        break;
                    }
                }
                _ => break,
            }
        }
        g.nodes[id].op = Op::Softmax { axis, scale, causal, zero_nan };
        g.nodes[id].inputs = vec![src];
    }
    // The NaN guard exporters write after a masked softmax, Where(IsNaN(y), 0, y): a row whose
    // every key is masked gives NaN, which becomes 0. The softmax does it (`zero_nan`).
    let uses = g.use_counts();
    for id in 0..g.nodes.len() {
        let (Op::Where, &[m, z, y]) = (&g.nodes[id].op, g.nodes[id].inputs.as_slice()) else { continue };
        let guard = matches!(g.nodes[y].op, Op::Softmax { .. })
            && uses[y] == 2
            && uses[m] == 1
            && !g.is_output(m)
            && !g.is_output(y)
            && matches!((&g.nodes[m].op, g.nodes[m].inputs.as_slice()), (Op::Unary(UnaryOp::IsNaN), &[x]) if x == y)
            && scalar(g, z) == Some(0.0)
            && g.nodes[id].shape == g.nodes[y].shape
            && g.nodes[id].dtype == g.nodes[y].dtype;
        if guard {
            if let Op::Softmax { zero_nan, .. } = &mut g.nodes[y].op {
                *zero_nan = true;
            }
            alias(g, id, y);
        }
    }
    g.prune();
}

/// Which axis of a fused op's output carries its channels (bias and batch-norm axis).
fn channel_axis(op: &Op, rank: usize) -> usize {
    match op {
        Op::Conv { .. } => 1,
        _ => rank - 1,
    }
}

/// Folds batch-norm scales and shifts, biases, residual adds and activations into the
/// convolution or matrix product that produces their input.
fn fuse_epilogues(g: &mut Graph, fuse_acts: bool) {
    loop {
        let mut changed = false;
        let uses = g.use_counts();
        for id in 0..g.nodes.len() {
            let n = g.nodes[id].clone();
            if n.inputs.is_empty() {
                continue;
            }
            // The producer r must be a conv or matmul whose only reader is this node; for an Add the
            // producer may be either operand (a residual add is written both ways round).
            let mut n = n;
            if matches!(n.op, Op::Binary(BinaryOp::Add))
                && n.inputs.len() == 2
                && !is_fusable_producer(g, &uses, n.inputs[0])
                && is_fusable_producer(g, &uses, n.inputs[1])
            {
                n.inputs.swap(0, 1);
            }
            let r = n.inputs[0];
            if uses[r] != 1 || g.is_output(r) {
                continue;
            }
            let prod = g.nodes[r].clone();
            let ep = match &prod.op {
                Op::Conv { epilogue, .. } | Op::MatMul { epilogue, .. } => *epilogue,
                _ => continue,
            };
            if n.shape != prod.shape || n.dtype != prod.dtype {
                continue;
            }
            let axis = channel_axis(&prod.op, prod.shape.len());
            let weights_const = konst(g, prod.inputs[1]).is_some();
            let bias_pos = 2;
            let new = match (&n.op, n.inputs.as_slice()) {
                // Scale: fold into the weights (and existing bias).
                (Op::Binary(BinaryOp::Mul), &[_, c])
                    if ep.act.0 == Act::None && !ep.residual && weights_const && per_axis(g, c, &n.shape, axis).is_some() =>
                {
                    let s = per_axis(g, c, &n.shape, axis).unwrap();
                    let w = konst(g, prod.inputs[1]).unwrap().clone();
                    let scaled = scale_weights(&prod.op, &w, &s);
                    let wk = g.add_const(format!("{}.weight_scaled", prod.name), scaled);
                    let mut inputs = prod.inputs.clone();
                    inputs[1] = wk;
                    if ep.bias {
                        let b = konst(g, inputs[bias_pos]);
                        let Some(b) = b else { continue };
                        let bv: Vec<f32> = b.to_f32_vec().iter().zip(&s).map(|(b, s)| b * s).collect();
                        inputs[bias_pos] = g.add_const(format!("{}.bias_scaled", prod.name), Tensor::f32(vec![s.len()], bv));
                    }
                    Some((prod.op.clone(), inputs))
                }
                // Shift: becomes or joins the bias.
                (Op::Binary(BinaryOp::Add), &[_, c])
                    if ep.act.0 == Act::None && !ep.residual && per_axis(g, c, &n.shape, axis).is_some() =>
                {
                    let t = per_axis(g, c, &n.shape, axis).unwrap();
                    let mut inputs = prod.inputs.clone();
                    let mut ep2 = ep;
                    if ep.bias {
                        let Some(b) = konst(g, inputs[bias_pos]) else { continue };
                        let bv: Vec<f32> = b.to_f32_vec().iter().zip(&t).map(|(b, t)| b + t).collect();
                        inputs[bias_pos] = g.add_const(format!("{}.bias_shifted", prod.name), Tensor::f32(vec![t.len()], bv));
                    } else {
                        let bk = g.add_const(format!("{}.bias", prod.name), Tensor::f32(vec![t.len()], t));
                        inputs.insert(bias_pos, bk);
                        ep2.bias = true;
                    }
                    Some((with_epilogue(&prod.op, ep2), inputs))
                }
                // Residual: a second tensor of the same shape; for a matrix product also one that
                // broadcasts along rows and batch dims (an attention mask [B, 1, 1, K] or [B, 1, Q,
                // K] added to scores [B, H, Q, K]).
                (Op::Binary(BinaryOp::Add), &[_, other])
                    if ep.act.0 == Act::None
                        && !ep.residual
                        && konst(g, other).is_none()
                        && (g.nodes[other].shape == n.shape
                            || (matches!(prod.op, Op::MatMul { .. })
                                && broadcasts_over_rows(&g.nodes[other].shape, &n.shape)))
                        && g.nodes[other].dtype == n.dtype =>
                {
                    let mut inputs = prod.inputs.clone();
                    inputs.push(other);
                    Some((with_epilogue(&prod.op, Epilogue { residual: true, ..ep }), inputs))
                }
                (Op::Unary(UnaryOp::Act(a)), _) if ep.act.0 == Act::None && (fuse_acts || *a == Act::Relu) => {
                    Some((with_epilogue(&prod.op, Epilogue { act: ActOpt(*a), ..ep }), prod.inputs.clone()))
                }
                _ => None,
            };
            if let Some((op, inputs)) = new {
                g.nodes[id].op = op;
                g.nodes[id].inputs = inputs;
                g.nodes[id].name = prod.name.clone();
                changed = true;
            }
        }
        if !changed {
            break;
        }
        g.toposort();
        g.prune();
    }
}

/// Whether `shape` has `out`'s last dim and broadcasts to `out` (a matrix product's residual read
/// with row and batch strides, 0 where broadcast; its columns stay contiguous).
fn broadcasts_over_rows(shape: &[usize], out: &[usize]) -> bool {
    let (r, ro) = (shape.len(), out.len());
    r >= 1
        && r <= ro
        && shape[r - 1] == out[ro - 1]
        && shape[..r - 1].iter().zip(&out[ro - r..ro - 1]).all(|(&s, &o)| s == 1 || s == o)
}

/// An activation, a residual add or a constant scale or shift applied to a reshaped or
/// transposed product moves before the view, so it joins the product's epilogue:
/// act(view(p)) = view(act(p)), view(p) + r = view(p + view⁻¹(r)), view(p) * c = view(p * c')
/// (c' the constant in the product's axis order; a reshape only for a scalar c). Hugging Face's
/// GPT-2 `Conv1D` exports as Reshape -> Gemm -> Reshape, its GELU and residual adds reading the
/// second reshape; torchvision's ConvNeXt block ends Linear -> Permute -> layer scale ([C, 1, 1])
/// -> residual add, each an element-wise launch over the block's output.
fn views_after_epilogues(g: &mut Graph) -> bool {
    let mut any = false;
    loop {
        let mut changed = false;
        let uses = g.use_counts();
        for id in 0..g.nodes.len() {
            let n = g.nodes[id].clone();
            // A view (reshape or transpose) of a product that only this node reads.
            let viewed_product = |r: NodeId| {
                matches!(g.nodes[r].op, Op::Reshape | Op::Transpose { .. })
                    && uses[r] == 1
                    && !g.is_output(r)
                    && is_fusable_producer(g, &uses, g.nodes[r].inputs[0])
                    && g.nodes[r].dtype == n.dtype
            };
            // The op that undoes view `r`, taking a tensor of r's shape to its input's.
            let inverse = |r: NodeId| match &g.nodes[r].op {
                Op::Transpose { perm } => {
                    let mut inv = vec![0; perm.len()];
                    for (i, &p) in perm.iter().enumerate() {
                        inv[p] = i;
                    }
                    Op::Transpose { perm: inv }
                }
                _ => Op::Reshape,
            };
            let same = |v: NodeId| g.nodes[v].shape == n.shape && g.nodes[v].dtype == n.dtype;
            let (r, operand) = match (&n.op, n.inputs.as_slice()) {
                (Op::Unary(UnaryOp::Act(_)), &[r]) if viewed_product(r) => (r, None),
                (Op::Binary(op @ (BinaryOp::Add | BinaryOp::Mul)), &[a, b]) => {
                    let (r, other) = if viewed_product(a) { (a, b) } else { (b, a) };
                    if !viewed_product(r) || !same(r) {
                        continue;
                    }
                    let p_shape = g.nodes[g.nodes[r].inputs[0]].shape.clone();
                    let moved = if let Some(t) = konst(g, other).cloned() {
                        // A constant that broadcasts to the output: scalars through any view,
                        // others through a transpose, permuted into the product's axis order.
                        let rank = n.shape.len();
                        if t.len() == 1 {
                            other
                        } else if matches!(g.nodes[r].op, Op::Transpose { .. })
                            && t.shape.len() <= rank
                            && broadcast_shapes(&t.shape, &n.shape).as_deref() == Some(&n.shape[..])
                        {
                            let full_shape: Vec<usize> =
                                std::iter::repeat_n(1, rank - t.shape.len()).chain(t.shape.iter().copied()).collect();
                            let full = Tensor::f32(full_shape.clone(), t.to_f32_vec());
                            let inv = inverse(r);
                            let Op::Transpose { perm: inv_perm } = &inv else { unreachable!() };
                            let moved_shape: Vec<usize> = inv_perm.iter().map(|&i| full_shape[i]).collect();
                            let c = interp::eval(&inv, &[&full], &moved_shape, DType::F32);
                            g.add_const(format!("{}.moved", n.name), c)
                        } else {
                            continue;
                        }
                    } else if *op == BinaryOp::Add && same(other) {
                        g.add(format!("{}.unviewed", n.name), inverse(r), vec![other], p_shape, n.dtype)
                    } else {
                        continue;
                    };
                    (r, Some((*op, moved)))
                }
                _ => continue,
            };
            // r becomes the op on the product, id the view of it.
            let p = g.nodes[r].inputs[0];
            let view = g.nodes[r].op.clone();
            g.nodes[r].shape = g.nodes[p].shape.clone();
            match operand {
                None => g.nodes[r].op = n.op.clone(),
                Some((op, moved)) => {
                    g.nodes[r].op = Op::Binary(op);
                    g.nodes[r].inputs = vec![p, moved];
                }
            }
            g.nodes[id].op = view;
            g.nodes[id].inputs = vec![r];
            changed = true;
            break;
        }
        if !changed {
            break;
        }
        any = true;
        g.toposort();
    }
    g.prune();
    any
}

fn is_fusable_producer(g: &Graph, uses: &[usize], id: NodeId) -> bool {
    uses[id] == 1 && !g.is_output(id) && matches!(g.nodes[id].op, Op::Conv { .. } | Op::MatMul { .. })
}

fn with_epilogue(op: &Op, ep: Epilogue) -> Op {
    match op {
        Op::Conv { window, groups, .. } => Op::Conv { window: *window, groups: *groups, epilogue: ep },
        Op::MatMul { alpha, .. } => Op::MatMul { epilogue: ep, alpha: *alpha },
        _ => unreachable!("only convolutions and matrix products have epilogues"),
    }
}

/// Multiplies output channel o of conv weights [O, ...] or column o of matmul weights [.., K, O] by s[o].
fn scale_weights(op: &Op, w: &Tensor, s: &[f32]) -> Tensor {
    let mut v = w.to_f32_vec();
    match op {
        Op::Conv { .. } => {
            let per = v.len() / s.len();
            for (o, chunk) in v.chunks_mut(per).enumerate() {
                chunk.iter_mut().for_each(|x| *x *= s[o]);
            }
        }
        _ => {
            let n = s.len();
            for (i, x) in v.iter_mut().enumerate() {
                *x *= s[i % n];
            }
        }
    }
    Tensor::f32(w.shape.clone(), v)
}

/// Fuses x * scale + shift (+ activation) into one affine node, and binary ops with a following activation.
fn fuse_eltwise(g: &mut Graph) {
    let uses = g.use_counts();
    for id in 0..g.nodes.len() {
        let n = g.nodes[id].clone();
        match (&n.op, n.inputs.as_slice()) {
            (Op::Binary(BinaryOp::Add), &[m, shift]) if konst(g, shift).is_some() && uses[m] == 1 => {
                if let (Op::Binary(BinaryOp::Mul), &[x, scale]) = (&g.nodes[m].op, g.nodes[m].inputs.as_slice())
                    && konst(g, scale).is_some()
                    && g.nodes[x].shape == n.shape
                {
                    g.nodes[id].op = Op::Affine { act: Act::None };
                    g.nodes[id].inputs = vec![x, scale, shift];
                }
            }
            (Op::Unary(UnaryOp::Act(a)), &[x]) if uses[x] == 1 && !g.is_output(x) && g.nodes[x].shape == n.shape => {
                match g.nodes[x].op.clone() {
                    Op::Affine { act: Act::None } => {
                        g.nodes[id].op = Op::Affine { act: *a };
                        g.nodes[id].inputs = g.nodes[x].inputs.clone();
                    }
                    Op::Binary(op) => {
                        g.nodes[id].op = Op::BinaryAct { op, act: *a };
                        g.nodes[id].inputs = g.nodes[x].inputs.clone();
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    g.prune();
}

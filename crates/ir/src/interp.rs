//! A naive interpreter of the graph IR: the plainest possible loops, in f32 (i64 for indices).
//!
//! It folds constants during lowering and is the "naive reference" the CPU kernels are
//! property-tested against. It is deliberately simple rather than fast.

use crate::graph::*;
use crate::tensor::{DType, Tensor, TensorData, element_count};

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec()
}

fn i64s(t: &Tensor) -> Vec<i64> {
    match &t.data {
        TensorData::I64(v) => v.clone(),
        _ => t.to_f32_vec().into_iter().map(|x| x as i64).collect(),
    }
}

/// Multi-index iteration helper: converts a flat index into coordinates of `shape`.
fn unravel(mut flat: usize, shape: &[usize], coord: &mut [usize]) {
    for d in (0..shape.len()).rev() {
        coord[d] = flat % shape[d];
        flat /= shape[d];
    }
}

fn broadcast_map(out_shape: &[usize], in_shape: &[usize]) -> Vec<usize> {
    let st = broadcast_strides(in_shape, out_shape);
    let n = element_count(out_shape);
    let mut coord = vec![0; out_shape.len()];
    (0..n)
        .map(|i| {
            unravel(i, out_shape, &mut coord);
            coord.iter().zip(&st).map(|(c, s)| c * s).sum()
        })
        .collect()
}

/// Evaluates one node on concrete inputs. `shape` and `dtype` are the node's declared output.
pub fn eval(op: &Op, inputs: &[&Tensor], shape: &[usize], dtype: DType) -> Tensor {
    let out = match op {
        Op::Input { .. } => panic!("inputs are not evaluated"),
        Op::Const(t) => (**t).clone(),
        Op::Conv { window, groups, epilogue } => conv(inputs, shape, window, *groups, epilogue),
        Op::MatMul { epilogue, alpha } => matmul(inputs, shape, epilogue, *alpha),
        Op::Binary(b) => {
            let (a, c) = (f32s(inputs[0]), f32s(inputs[1]));
            let (ma, mc) = (broadcast_map(shape, &inputs[0].shape), broadcast_map(shape, &inputs[1].shape));
            let compares = matches!(b, BinaryOp::Equal | BinaryOp::Less | BinaryOp::Greater);
            if inputs[0].dtype() == DType::I64 && inputs[1].dtype() == DType::I64 && compares {
                // Token ids and positions compared exactly, not through f32.
                let (a, c) = (i64s(inputs[0]), i64s(inputs[1]));
                let v = (0..ma.len())
                    .map(|i| {
                        let (x, y) = (a[ma[i]], c[mc[i]]);
                        let r = match b {
                            BinaryOp::Equal => x == y,
                            BinaryOp::Less => x < y,
                            _ => x > y,
                        };
                        r as u8 as f32
                    })
                    .collect();
                Tensor::f32(shape.to_vec(), v)
            } else if inputs[0].dtype() == DType::I64 && inputs[1].dtype() == DType::I64 {
                let (a, c) = (i64s(inputs[0]), i64s(inputs[1]));
                let v = (0..ma.len())
                    .map(|i| {
                        let (x, y) = (a[ma[i]], c[mc[i]]);
                        match b {
                            BinaryOp::Add => x + y,
                            BinaryOp::Sub => x - y,
                            BinaryOp::Mul => x * y,
                            BinaryOp::Div => x / y,
                            BinaryOp::Pow => x.pow(y as u32),
                            BinaryOp::Max => x.max(y),
                            BinaryOp::Min => x.min(y),
                            BinaryOp::Equal | BinaryOp::Less | BinaryOp::Greater => unreachable!("compared above"),
                        }
                    })
                    .collect();
                Tensor::i64(shape.to_vec(), v)
            } else {
                Tensor::f32(shape.to_vec(), (0..ma.len()).map(|i| b.apply(a[ma[i]], c[mc[i]])).collect())
            }
        }
        Op::BinaryAct { op, act } => {
            let t = eval(&Op::Binary(*op), inputs, shape, DType::F32);
            Tensor::f32(shape.to_vec(), f32s(&t).into_iter().map(|x| act.apply(x)).collect())
        }
        Op::Affine { act } => {
            let (x, s, b) = (f32s(inputs[0]), f32s(inputs[1]), f32s(inputs[2]));
            let (mx, ms, mb) = (
                broadcast_map(shape, &inputs[0].shape),
                broadcast_map(shape, &inputs[1].shape),
                broadcast_map(shape, &inputs[2].shape),
            );
            Tensor::f32(shape.to_vec(), (0..mx.len()).map(|i| act.apply(x[mx[i]] * s[ms[i]] + b[mb[i]])).collect())
        }
        Op::Unary(u) => Tensor::f32(shape.to_vec(), f32s(inputs[0]).into_iter().map(|x| u.apply(x)).collect()),
        Op::Pool { kind, window } => pool(inputs[0], shape, *kind, window),
        Op::Reduce { op, axes } => reduce(inputs[0], shape, *op, axes),
        Op::Softmax { axis, scale, causal, zero_nan } => softmax(inputs[0], *axis, *scale, *causal, *zero_nan),
        Op::LayerNorm { eps, rms } => layer_norm(inputs, *eps, *rms),
        Op::Concat { axis } => concat(inputs, shape, *axis),
        Op::Reshape => {
            let mut t = inputs[0].clone();
            t.shape = shape.to_vec();
            t
        }
        Op::Transpose { perm } => transpose(inputs[0], perm),
        Op::Slice { axis, start, end } => slice(inputs[0], *axis, *start, *end),
        Op::Gather { axis } => gather(inputs[0], inputs[1], *axis, shape),
        Op::Where => {
            let c = f32s(inputs[0]);
            let (mc, ma, mb) = (
                broadcast_map(shape, &inputs[0].shape),
                broadcast_map(shape, &inputs[1].shape),
                broadcast_map(shape, &inputs[2].shape),
            );
            if inputs[1].dtype() == DType::I64 {
                let (a, b) = (i64s(inputs[1]), i64s(inputs[2]));
                Tensor::i64(shape.to_vec(), (0..mc.len()).map(|i| if c[mc[i]] != 0.0 { a[ma[i]] } else { b[mb[i]] }).collect())
            } else {
                let (a, b) = (f32s(inputs[1]), f32s(inputs[2]));
                Tensor::f32(shape.to_vec(), (0..mc.len()).map(|i| if c[mc[i]] != 0.0 { a[ma[i]] } else { b[mb[i]] }).collect())
            }
        }
        Op::Expand => {
            let m = broadcast_map(shape, &inputs[0].shape);
            match &inputs[0].data {
                TensorData::I64(v) => Tensor::i64(shape.to_vec(), m.iter().map(|&i| v[i]).collect()),
                _ => {
                    let v = f32s(inputs[0]);
                    Tensor::f32(shape.to_vec(), m.iter().map(|&i| v[i]).collect())
                }
            }
        }
        Op::Cast => inputs[0].cast(dtype),
    };
    let out = if out.dtype() != dtype { out.cast(dtype) } else { out };
    assert_eq!(out.shape, shape, "{} produced shape {:?}, node declares {:?}", op.name(), out.shape, shape);
    out
}

fn conv(inputs: &[&Tensor], shape: &[usize], w: &Window, groups: usize, ep: &Epilogue) -> Tensor {
    let x = f32s(inputs[0]);
    let k = f32s(inputs[1]);
    let (n, c, h, wd) = (inputs[0].shape[0], inputs[0].shape[1], inputs[0].shape[2], inputs[0].shape[3]);
    let (o, oh, ow) = (shape[1], shape[2], shape[3]);
    let cg = c / groups;
    let og = o / groups;
    let mut next = 2;
    let bias = if ep.bias {
        next += 1;
        Some(f32s(inputs[next - 1]))
    } else {
        None
    };
    let res = if ep.residual { Some(f32s(inputs[next])) } else { None };
    let mut y = vec![0f32; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0f64;
                    for ic in 0..cg {
                        for ky in 0..w.kernel[0] {
                            let iy = (oy * w.stride[0] + ky * w.dilation[0]) as isize - w.pad_begin[0] as isize;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            for kx in 0..w.kernel[1] {
                                let ix = (ox * w.stride[1] + kx * w.dilation[1]) as isize - w.pad_begin[1] as isize;
                                if ix < 0 || ix >= wd as isize {
                                    continue;
                                }
                                let xv = x[((b * c + g * cg + ic) * h + iy as usize) * wd + ix as usize];
                                let kv = k[((oc * cg + ic) * w.kernel[0] + ky) * w.kernel[1] + kx];
                                acc += xv as f64 * kv as f64;
                            }
                        }
                    }
                    let idx = ((b * o + oc) * oh + oy) * ow + ox;
                    let mut v = acc as f32;
                    if let Some(bias) = &bias {
                        v += bias[oc];
                    }
                    if let Some(r) = &res {
                        v += r[idx];
                    }
                    y[idx] = ep.act.0.apply(v);
                }
            }
        }
    }
    Tensor::f32(shape.to_vec(), y)
}

fn matmul(inputs: &[&Tensor], shape: &[usize], ep: &Epilogue, alpha: f32) -> Tensor {
    let (a, b) = (inputs[0], inputs[1]);
    let r = shape.len();
    let (m, kk, n) = (a.shape[r - 2], a.shape[r - 1], b.shape[r - 1]);
    assert_eq!(b.shape[r - 2], kk, "matmul inner dims differ");
    let batch_shape = &shape[..r - 2];
    let batches = element_count(batch_shape);
    let (av, bv) = (f32s(a), f32s(b));
    let a_b = broadcast_strides(&a.shape[..r - 2], batch_shape);
    let b_b = broadcast_strides(&b.shape[..r - 2], batch_shape);
    let mut next = 2;
    let bias = if ep.bias {
        next += 1;
        Some(f32s(inputs[next - 1]))
    } else {
        None
    };
    // The residual broadcasts to the output (an attention mask [B, 1, 1, K] added to scores [B, H, Q, K]).
    let res = if ep.residual { Some((f32s(inputs[next]), broadcast_map(shape, &inputs[next].shape))) } else { None };
    let mut out = vec![0f32; batches * m * n];
    let mut coord = vec![0; batch_shape.len()];
    for bi in 0..batches {
        unravel(bi, batch_shape, &mut coord);
        let ao: usize = coord.iter().zip(&a_b).map(|(c, s)| c * s).sum::<usize>() * m * kk;
        let bo: usize = coord.iter().zip(&b_b).map(|(c, s)| c * s).sum::<usize>() * kk * n;
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f64;
                for p in 0..kk {
                    acc += av[ao + i * kk + p] as f64 * bv[bo + p * n + j] as f64;
                }
                let idx = (bi * m + i) * n + j;
                let mut v = alpha * acc as f32;
                if let Some(bias) = &bias {
                    v += bias[j];
                }
                if let Some((r, at)) = &res {
                    v += r[at[idx]];
                }
                out[idx] = ep.act.0.apply(v);
            }
        }
    }
    Tensor::f32(shape.to_vec(), out)
}

fn pool(x: &Tensor, shape: &[usize], kind: PoolKind, w: &Window) -> Tensor {
    let v = f32s(x);
    let (n, c, h, wd) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (oh, ow) = (shape[2], shape[3]);
    let mut y = vec![0f32; n * c * oh * ow];
    for b in 0..n {
        for ch in 0..c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let y0 = (oy * w.stride[0]) as isize - w.pad_begin[0] as isize;
                    let x0 = (ox * w.stride[1]) as isize - w.pad_begin[1] as isize;
                    let mut acc = if kind == PoolKind::Max { f32::NEG_INFINITY } else { 0.0 };
                    let mut count = 0usize;
                    for ky in 0..w.kernel[0] {
                        for kx in 0..w.kernel[1] {
                            let (iy, ix) = (y0 + (ky * w.dilation[0]) as isize, x0 + (kx * w.dilation[1]) as isize);
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                continue;
                            }
                            let val = v[((b * c + ch) * h + iy as usize) * wd + ix as usize];
                            count += 1;
                            acc = if kind == PoolKind::Max { acc.max(val) } else { acc + val };
                        }
                    }
                    let out = match kind {
                        PoolKind::Max => acc,
                        PoolKind::Avg { count_include_pad } => {
                            let div = if count_include_pad {
                                let ey = (y0 + w.kernel[0] as isize).min((h + w.pad_end[0]) as isize);
                                let ex = (x0 + w.kernel[1] as isize).min((wd + w.pad_end[1]) as isize);
                                ((ey - y0) * (ex - x0)) as usize
                            } else {
                                count
                            };
                            acc / div as f32
                        }
                    };
                    y[((b * c + ch) * oh + oy) * ow + ox] = out;
                }
            }
        }
    }
    Tensor::f32(shape.to_vec(), y)
}

fn reduce(x: &Tensor, shape: &[usize], op: ReduceOp, axes: &[usize]) -> Tensor {
    let v = f32s(x);
    let n_out = element_count(shape);
    let mut acc = vec![
        match op {
            ReduceOp::Max => f32::NEG_INFINITY,
            ReduceOp::Min => f32::INFINITY,
            _ => 0.0,
        };
        n_out
    ];
    let out_strides = strides_of(shape);
    let mut coord = vec![0; x.shape.len()];
    let count: usize = axes.iter().map(|&a| x.shape[a]).product();
    for (i, &val) in v.iter().enumerate() {
        unravel(i, &x.shape, &mut coord);
        let o: usize = coord.iter().enumerate().map(|(d, &c)| if axes.contains(&d) { 0 } else { c * out_strides[d] }).sum();
        acc[o] = match op {
            ReduceOp::Sum | ReduceOp::Mean => acc[o] + val,
            ReduceOp::Max => acc[o].max(val),
            ReduceOp::Min => acc[o].min(val),
        };
    }
    if op == ReduceOp::Mean {
        for a in &mut acc {
            *a /= count as f32;
        }
    }
    Tensor::f32(shape.to_vec(), acc)
}

fn softmax(x: &Tensor, axis: usize, scale: f32, causal: bool, zero_nan: bool) -> Tensor {
    let v = f32s(x);
    let shape = &x.shape;
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut y = vec![0f32; v.len()];
    let rank = shape.len();
    for o in 0..outer {
        for i in 0..inner {
            // Row index along the second-to-last axis, for the causal mask (axis must be the last).
            let row = if causal { o % shape[rank - 2] } else { 0 };
            let allowed = |j: usize| !causal || j <= row;
            let mut mx = f32::NEG_INFINITY;
            for j in 0..len {
                if allowed(j) {
                    mx = mx.max(scale * v[(o * len + j) * inner + i]);
                }
            }
            let mut sum = 0f64;
            for j in 0..len {
                if allowed(j) {
                    sum += ((scale * v[(o * len + j) * inner + i]) - mx).exp() as f64;
                }
            }
            for j in 0..len {
                let idx = (o * len + j) * inner + i;
                let p = if allowed(j) { (((scale * v[idx]) - mx).exp() as f64 / sum) as f32 } else { 0.0 };
                y[idx] = if zero_nan && p.is_nan() { 0.0 } else { p };
            }
        }
    }
    Tensor::f32(shape.clone(), y)
}

fn layer_norm(inputs: &[&Tensor], eps: f32, rms: bool) -> Tensor {
    let x = f32s(inputs[0]);
    let (g, b) = (f32s(inputs[1]), f32s(inputs[2]));
    let c = *inputs[0].shape.last().unwrap();
    let mut y = vec![0f32; x.len()];
    for (row, out) in x.chunks(c).zip(y.chunks_mut(c)) {
        let mean = if rms { 0.0 } else { row.iter().map(|&v| v as f64).sum::<f64>() / c as f64 };
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for j in 0..c {
            out[j] = (((row[j] as f64 - mean) * inv) as f32) * g[j] + b[j];
        }
    }
    Tensor::f32(inputs[0].shape.clone(), y)
}

fn concat(inputs: &[&Tensor], shape: &[usize], axis: usize) -> Tensor {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let is_i64 = inputs.iter().all(|t| t.dtype() == DType::I64);
    let mut f = Vec::with_capacity(element_count(shape));
    let mut l = Vec::new();
    for o in 0..outer {
        for t in inputs {
            let len = t.shape[axis] * inner;
            if is_i64 {
                l.extend_from_slice(&i64s(t)[o * len..(o + 1) * len]);
            } else {
                f.extend_from_slice(&f32s(t)[o * len..(o + 1) * len]);
            }
        }
    }
    if is_i64 { Tensor::i64(shape.to_vec(), l) } else { Tensor::f32(shape.to_vec(), f) }
}

pub fn transpose(x: &Tensor, perm: &[usize]) -> Tensor {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let in_strides = strides_of(&x.shape);
    let n = x.len();
    let mut coord = vec![0; shape.len()];
    let map: Vec<usize> = (0..n)
        .map(|i| {
            unravel(i, &shape, &mut coord);
            coord.iter().enumerate().map(|(d, &c)| c * in_strides[perm[d]]).sum()
        })
        .collect();
    match &x.data {
        TensorData::F32(v) => Tensor::f32(shape, map.iter().map(|&i| v[i]).collect()),
        TensorData::F16(v) => Tensor::f16(shape, map.iter().map(|&i| v[i]).collect()),
        TensorData::I64(v) => Tensor::i64(shape, map.iter().map(|&i| v[i]).collect()),
    }
}

fn slice(x: &Tensor, axis: usize, start: usize, end: usize) -> Tensor {
    let mut shape = x.shape.clone();
    shape[axis] = end - start;
    let outer: usize = x.shape[..axis].iter().product();
    let inner: usize = x.shape[axis + 1..].iter().product();
    let len = x.shape[axis];
    let idx: Vec<usize> =
        (0..outer).flat_map(|o| (start..end).flat_map(move |a| (0..inner).map(move |i| (o * len + a) * inner + i))).collect();
    match &x.data {
        TensorData::F32(v) => Tensor::f32(shape, idx.iter().map(|&i| v[i]).collect()),
        TensorData::F16(v) => Tensor::f16(shape, idx.iter().map(|&i| v[i]).collect()),
        TensorData::I64(v) => Tensor::i64(shape, idx.iter().map(|&i| v[i]).collect()),
    }
}

fn gather(data: &Tensor, indices: &Tensor, axis: usize, shape: &[usize]) -> Tensor {
    let ind = i64s(indices);
    let outer: usize = data.shape[..axis].iter().product();
    let inner: usize = data.shape[axis + 1..].iter().product();
    let len = data.shape[axis];
    let mut idx = Vec::with_capacity(element_count(shape));
    for o in 0..outer {
        for &k in &ind {
            let k = if k < 0 { k + len as i64 } else { k };
            assert!(k >= 0 && (k as usize) < len, "gather index {k} out of range 0..{len}");
            for i in 0..inner {
                idx.push((o * len + k as usize) * inner + i);
            }
        }
    }
    match &data.data {
        TensorData::I64(v) => Tensor::i64(shape.to_vec(), idx.iter().map(|&i| v[i]).collect()),
        _ => {
            let v = f32s(data);
            Tensor::f32(shape.to_vec(), idx.iter().map(|&i| v[i]).collect())
        }
    }
}

/// Runs a whole graph on the given inputs (in graph input order) and returns its outputs.
pub fn run(graph: &Graph, inputs: &[Tensor]) -> Vec<Tensor> {
    assert_eq!(inputs.len(), graph.inputs.len(), "graph {} takes {} inputs", graph.name, graph.inputs.len());
    let mut values: Vec<Option<Tensor>> = vec![None; graph.nodes.len()];
    let uses = graph.use_counts();
    let mut remaining = uses.clone();
    for (id, node) in graph.nodes.iter().enumerate() {
        let v = match &node.op {
            Op::Input { index } => inputs[*index].clone(),
            _ => {
                let ins: Vec<&Tensor> = node.inputs.iter().map(|&i| values[i].as_ref().expect("value freed too early")).collect();
                eval(&node.op, &ins, &node.shape, node.dtype)
            }
        };
        values[id] = Some(v);
        for &i in &node.inputs {
            remaining[i] -= 1;
            if remaining[i] == 0 && !graph.is_output(i) {
                values[i] = None;
            }
        }
    }
    graph.outputs.iter().map(|o| values[o.node].clone().expect("output computed")).collect()
}

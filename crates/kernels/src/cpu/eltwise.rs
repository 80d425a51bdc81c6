//! The strided element-wise kernel: copies, casts, layout changes and fused arithmetic.

use super::{Elems, ElemsMut, KernelMemory};
use kairos_core::graph::Act;
use kairos_core::plan::{ELTWISE_RANK_MAX, EltFunc, EltwiseParams};
use kairos_core::tensor::DType;
use std::ops::Range;

const R: usize = ELTWISE_RANK_MAX;

pub(crate) fn eltwise(p: &EltwiseParams, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let total = p.elems() as usize;
    let n_in = p.inputs as usize;
    let mut vals: Vec<f32> = Vec::new();
    let mut out_idx: Vec<usize> = Vec::new();
    // A same-type int64 copy is bit exact (as the GPU's raw path), not a trip through f32.
    let raw_i64 =
        p.func == EltFunc::Copy && p.act == Act::None && n_in == 1 && p.in_dtypes[0] == DType::I64 && p.out_dtype == DType::I64;
    let mut raw: Vec<i64> = Vec::new();
    for block in blocks {
        let e0 = block as usize * p.elems_per_block as usize;
        let e1 = (e0 + p.elems_per_block as usize).min(total);
        vals.clear();
        out_idx.clear();
        {
            let ins: Vec<Elems> = (0..n_in).map(|j| Elems::new(mem.arg(j), p.in_dtypes[j])).collect();
            // Coordinates of e0, then incremented in row-major order.
            let mut coord = [0usize; R];
            let mut rem = e0;
            for d in (0..R).rev() {
                coord[d] = rem % p.shape[d] as usize;
                rem /= p.shape[d] as usize;
            }
            for _ in e0..e1 {
                let mut x = [0f32; 3];
                for (j, src) in ins.iter().enumerate() {
                    let off: usize = (0..R).map(|d| coord[d] * p.in_strides[j][d] as usize).sum();
                    if raw_i64 && let Elems::I64(v) = src {
                        raw.push(v[off]);
                    }
                    x[j] = src.get(off);
                }
                let y = match p.func {
                    EltFunc::Copy => x[0],
                    EltFunc::Unary(u) => u.to_graph().apply(x[0]),
                    EltFunc::Binary(b) => b.to_graph().apply(x[0], x[1]),
                    EltFunc::BinaryScalar(b) => b.to_graph().apply(x[0], p.scalars[0]),
                    EltFunc::Affine => x[0] * x[1] + x[2],
                    EltFunc::Where => {
                        if x[0] != 0.0 {
                            x[1]
                        } else {
                            x[2]
                        }
                    }
                };
                vals.push(p.act.apply(y));
                out_idx.push((0..R).map(|d| coord[d] * p.out_strides[d] as usize).sum());
                for d in (0..R).rev() {
                    coord[d] += 1;
                    if coord[d] < p.shape[d] as usize {
                        break;
                    }
                    coord[d] = 0;
                }
            }
        }
        let mut out = ElemsMut::new(mem.arg_mut(n_in), p.out_dtype);
        if raw_i64 && let ElemsMut::I64(o) = &mut out {
            for (i, v) in out_idx.iter().zip(&raw) {
                o[*i] = *v;
            }
            raw.clear();
            continue;
        }
        for (i, v) in out_idx.iter().zip(&vals) {
            out.set(*i, *v);
        }
    }
}

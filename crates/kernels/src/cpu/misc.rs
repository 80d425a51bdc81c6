//! Pooling, softmax, layer norm, reductions, gathers and the split-K sum.

use super::{Elems, ElemsMut, KernelMemory};
use kairos_core::DType;
use kairos_core::plan::{
    GatherParams, LayerNormParams, Pool2dParams, PoolKindParam, ReduceKind, ReduceParams, SoftmaxParams, SplitKSumParams,
};
use std::ops::Range;

pub(crate) fn pool2d(p: &Pool2dParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let total = p.out_elems() as usize;
    let (c, oh, ow) = (p.channels as usize, p.out_h as usize, p.out_w as usize);
    let (h, w) = (p.in_h as isize, p.in_w as isize);
    let mut vals = Vec::new();
    for block in blocks {
        let e0 = block as usize * p.elems_per_block as usize;
        let e1 = (e0 + p.elems_per_block as usize).min(total);
        vals.clear();
        {
            let x = Elems::new(mem.arg(0), dtype);
            for e in e0..e1 {
                let ch = e % c;
                let pix = e / c;
                let (b, oy, ox) = (pix / (oh * ow), (pix / ow) % oh, pix % ow);
                let y0 = (oy * p.stride_h as usize) as isize - p.pad_top as isize;
                let x0 = (ox * p.stride_w as usize) as isize - p.pad_left as isize;
                let mut acc = if p.kind == PoolKindParam::Max { f32::NEG_INFINITY } else { 0.0 };
                let mut count = 0usize;
                for ky in 0..p.kernel_h as isize {
                    let iy = y0 + ky;
                    if iy < 0 || iy >= h {
                        continue;
                    }
                    for kx in 0..p.kernel_w as isize {
                        let ix = x0 + kx;
                        if ix < 0 || ix >= w {
                            continue;
                        }
                        let v =
                            x.get(((b * h as usize + iy as usize) * w as usize + ix as usize) * p.in_pixel_stride as usize + ch);
                        acc = if p.kind == PoolKindParam::Max { acc.max(v) } else { acc + v };
                        count += 1;
                    }
                }
                let v = match p.kind {
                    PoolKindParam::Max => acc,
                    PoolKindParam::AvgExcludePad => acc / count.max(1) as f32,
                    PoolKindParam::AvgIncludePad => {
                        // The divisor counts declared padding but not the ceil-mode overhang.
                        let ey = (y0 + p.kernel_h as isize).min(h + p.pad_bottom as isize);
                        let ex = (x0 + p.kernel_w as isize).min(w + p.pad_right as isize);
                        acc / ((ey - y0) * (ex - x0)).max(1) as f32
                    }
                };
                vals.push(v);
            }
        }
        let mut out = ElemsMut::new(mem.arg_mut(1), dtype);
        for (k, e) in (e0..e1).enumerate() {
            out.set((e / c) * p.out_pixel_stride as usize + e % c, vals[k]);
        }
    }
}

pub(crate) fn softmax(p: &SoftmaxParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let cols = p.cols as usize;
    let mut row = vec![0f32; cols];
    for block in blocks {
        let r0 = block as usize * p.rows_per_block as usize;
        let r1 = (r0 + p.rows_per_block as usize).min(p.rows as usize);
        for r in r0..r1 {
            Elems::new(mem.arg(0), dtype).read_into(r * cols, &mut row);
            let limit = if p.causal {
                let q = r % p.causal_rows as usize;
                (q + cols - p.causal_rows as usize + 1).min(cols)
            } else {
                cols
            };
            let mut mx = f32::NEG_INFINITY;
            for v in &row[..limit] {
                mx = mx.max(p.scale * v);
            }
            let mut sum = 0f32;
            for v in &mut row[..limit] {
                *v = (p.scale * *v - mx).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            for v in &mut row[..limit] {
                *v *= inv;
                if p.zero_nan && v.is_nan() {
                    *v = 0.0;
                }
            }
            row[limit..].fill(0.0);
            ElemsMut::new(mem.arg_mut(1), dtype).write_from(r * cols, &row);
        }
    }
}

pub(crate) fn layer_norm(p: &LayerNormParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let cols = p.cols as usize;
    let mut row = vec![0f32; cols];
    let mut gamma = vec![0f32; cols];
    let mut beta = vec![0f32; cols];
    Elems::new(mem.arg(1), dtype).read_into(0, &mut gamma);
    Elems::new(mem.arg(2), dtype).read_into(0, &mut beta);
    for block in blocks {
        let r0 = block as usize * p.rows_per_block as usize;
        let r1 = (r0 + p.rows_per_block as usize).min(p.rows as usize);
        for r in r0..r1 {
            Elems::new(mem.arg(0), dtype).read_into(r * cols, &mut row);
            let mean = if p.rms { 0.0 } else { row.iter().sum::<f32>() / cols as f32 };
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
            let inv = 1.0 / (var + p.eps).sqrt();
            for j in 0..cols {
                row[j] = (row[j] - mean) * inv * gamma[j] + beta[j];
            }
            ElemsMut::new(mem.arg_mut(3), dtype).write_from(r * cols, &row);
        }
    }
}

pub(crate) fn reduce(p: &ReduceParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let (red, inner) = (p.reduce as usize, p.inner as usize);
    let total = p.outer as usize * inner;
    let mut vals = Vec::new();
    for block in blocks {
        let e0 = block as usize * p.elems_per_block as usize;
        let e1 = (e0 + p.elems_per_block as usize).min(total);
        vals.clear();
        {
            let x = Elems::new(mem.arg(0), dtype);
            for e in e0..e1 {
                let (o, i) = (e / inner, e % inner);
                let base = o * red * inner + i;
                let mut acc = match p.kind {
                    ReduceKind::Max => f32::NEG_INFINITY,
                    ReduceKind::Min => f32::INFINITY,
                    _ => 0.0,
                };
                for r in 0..red {
                    let v = x.get(base + r * inner);
                    acc = match p.kind {
                        ReduceKind::Sum | ReduceKind::Mean => acc + v,
                        ReduceKind::Max => acc.max(v),
                        ReduceKind::Min => acc.min(v),
                    };
                }
                if p.kind == ReduceKind::Mean {
                    acc /= red as f32;
                }
                vals.push(acc);
            }
        }
        ElemsMut::new(mem.arg_mut(1), dtype).write_from(e0, &vals);
    }
}

pub(crate) fn gather(p: &GatherParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let cols = p.cols as usize;
    let mut row = vec![0f32; cols];
    for block in blocks {
        let r0 = block as usize * p.rows_per_block as usize;
        let r1 = (r0 + p.rows_per_block as usize).min(p.count as usize);
        for r in r0..r1 {
            let idx = match Elems::new(mem.arg(1), DType::I64) {
                Elems::I64(v) => v[r],
                _ => unreachable!(),
            };
            let rows = p.table_rows as i64;
            let idx = if idx < 0 { idx + rows } else { idx };
            if (0..rows).contains(&idx) {
                Elems::new(mem.arg(0), dtype).read_into(idx as usize * cols, &mut row);
            } else {
                row.fill(0.0);
            }
            ElemsMut::new(mem.arg_mut(2), dtype).write_from(r * cols, &row);
        }
    }
}

/// The split-K sum: the slices of the f32 workspace added in slice order, then the epilogue.
pub(crate) fn splitk_sum(p: &SplitKSumParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let total = p.elems() as usize;
    let (m, n) = (p.m as usize, p.n as usize);
    let (bias_arg, res_arg, out_arg) = super::epilogue_args(1, &p.epilogue);
    let place = |e: usize, s0: u64, s1: u64, sm: u64| -> usize {
        let (j, i, bb) = (e % n, (e / n) % m, e / (m * n));
        let (b0, b1) = ((bb / p.batch1 as usize) as u64, (bb % p.batch1 as usize) as u64);
        (b0 * s0 + b1 * s1 + i as u64 * sm) as usize + j
    };
    let mut vals = Vec::new();
    for block in blocks {
        let e0 = block as usize * p.elems_per_block as usize;
        let e1 = (e0 + p.elems_per_block as usize).min(total);
        vals.clear();
        {
            let ws = Elems::new(mem.arg(0), DType::F32);
            let bias = bias_arg.map(|a| Elems::new(mem.arg(a), dtype));
            let res = res_arg.map(|a| Elems::new(mem.arg(a), dtype));
            for e in e0..e1 {
                let mut acc = 0.0f32;
                for s in 0..p.splits as usize {
                    acc += ws.get(s * total + e);
                }
                let mut v = p.alpha * acc;
                if let Some(b) = &bias {
                    v += b.get(e % n);
                }
                if let Some(r) = &res {
                    v += r.get(place(e, p.r_stride0, p.r_stride1, p.r_stride_m));
                }
                vals.push(p.epilogue.act.apply(v));
            }
        }
        let mut out = ElemsMut::new(mem.arg_mut(out_arg), dtype);
        for (k, e) in (e0..e1).enumerate() {
            out.set(place(e, p.c_stride0, p.c_stride1, p.c_stride_m), vals[k]);
        }
    }
}

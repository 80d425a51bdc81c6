//! Convolutions on NHWC tensors: implicit GEMM (im2col per tile) and depthwise.

use super::gemm::{epilogue_store, sgemm};
use super::{Elems, ElemsMut, KernelMemory};
use kairos_core::DType;
use kairos_core::plan::{Conv2dParams, split_k_len};
use std::ops::Range;

fn arg_positions(p: &Conv2dParams) -> (Option<usize>, Option<usize>, usize) {
    super::epilogue_args(2, &p.epilogue)
}

/// Output pixel index -> (batch, oh, ow).
#[inline]
fn pixel(p: &Conv2dParams, m: usize) -> (usize, usize, usize) {
    let (oh, ow) = (p.out_h as usize, p.out_w as usize);
    (m / (oh * ow), (m / ow) % oh, m % ow)
}

/// The output tile of a logical block: pixel rows [m0, m1) and channels [n0, n1).
fn tile_of(p: &Conv2dParams, block: u32) -> (usize, usize, usize, usize) {
    let nt = p.n_tiles();
    let (bm, bn) = (block / nt, block % nt);
    let m0 = (bm * p.tile_m) as usize;
    let n0 = (bn * p.tile_n) as usize;
    (m0, (m0 + p.tile_m as usize).min(p.gemm_m() as usize), n0, (n0 + p.tile_n as usize).min(p.out_c as usize))
}

/// Calls `f(tap, pixel_offset)` for every kernel tap (ky * kernel_w + kx) of output pixel `m` that
/// falls inside the input, with the element offset of that input pixel; padding taps are skipped.
fn for_each_tap(p: &Conv2dParams, m: usize, mut f: impl FnMut(usize, usize)) {
    let (b, oy, ox) = pixel(p, m);
    let (h, w, kw) = (p.in_h as isize, p.in_w as isize, p.kernel_w as usize);
    for ky in 0..p.kernel_h as usize {
        let iy = (oy * p.stride_h as usize + ky * p.dilation_h as usize) as isize - p.pad_h as isize;
        if iy < 0 || iy >= h {
            continue;
        }
        for kx in 0..kw {
            let ix = (ox * p.stride_w as usize + kx * p.dilation_w as usize) as isize - p.pad_w as isize;
            if ix < 0 || ix >= w {
                continue;
            }
            f(ky * kw + kx, ((b * h as usize + iy as usize) * w as usize + ix as usize) * p.in_pixel_stride as usize);
        }
    }
}

/// Reads the bias values and residual tile a block needs.
fn epilogue_inputs(
    p: &Conv2dParams,
    dtype: DType,
    mem: &dyn KernelMemory,
    (bias_arg, res_arg): (Option<usize>, Option<usize>),
    (m0, m1, n0, n1): (usize, usize, usize, usize),
    bias_vals: &mut Vec<f32>,
    res_tile: &mut Vec<f32>,
) {
    if let Some(ba) = bias_arg {
        let bv = Elems::new(mem.arg(ba), dtype);
        bias_vals.clear();
        bias_vals.extend((n0..n1).map(|j| bv.get(j)));
    }
    if let Some(ra) = res_arg {
        let rv = Elems::new(mem.arg(ra), dtype);
        let rs = p.res_pixel_stride as usize;
        res_tile.clear();
        res_tile.extend((m0..m1).flat_map(|m| (n0..n1).map(move |j| m * rs + j)).map(|i| rv.get(i)));
    }
}

pub(crate) fn conv2d(p: &Conv2dParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let (bias_arg, res_arg, out_arg) = arg_positions(p);
    let groups = p.groups as usize;
    let cin_g = p.in_c as usize / groups;
    let cout_g = p.out_c as usize / groups;
    let kdim = (p.kernel_h * p.kernel_w) as usize * cin_g;
    let mut a_tile: Vec<f32> = Vec::new();
    let mut b_tile: Vec<f32> = Vec::new();
    let mut c_tile: Vec<f32> = Vec::new();
    let mut part: Vec<f32> = Vec::new();
    let mut bias_vals = Vec::new();
    let mut res_tile = Vec::new();
    let per_slice = p.m_tiles() * p.n_tiles();
    let k_len = split_k_len(kdim as u32, p.split_k) as usize;
    for block in blocks {
        let slice = (block / per_slice) as usize;
        let (m0, m1, n0, n1) = tile_of(p, block % per_slice);
        let (rows, cols) = (m1 - m0, n1 - n0);
        // This block's part of the reduction: all of it, or its split-K slice.
        let (k0, kl) = if p.split_k > 1 { (slice * k_len, k_len.min(kdim - slice * k_len)) } else { (0, kdim) };
        c_tile.clear();
        c_tile.resize(rows * cols, 0.0);
        {
            let x = Elems::new(mem.arg(0), dtype);
            let wt = Elems::new(mem.arg(1), dtype);
            // Columns of one group at a time: they share the group's input channels.
            let mut j = n0;
            while j < n1 {
                let g = j / cout_g;
                let jg1 = ((g + 1) * cout_g).min(n1);
                let gcols = jg1 - j;
                // im2col of this tile for group g: row r = pixel, col = (tap, c).
                a_tile.clear();
                a_tile.resize(rows * kdim, 0.0);
                for r in 0..rows {
                    for_each_tap(p, m0 + r, |tap, src| {
                        let dst = r * kdim + tap * cin_g;
                        x.read_into(src + g * cin_g, &mut a_tile[dst..dst + cin_g]);
                    });
                }
                part.clear();
                part.resize(rows * gcols, 0.0);
                match wt {
                    // Weights [out_c][kdim]: B[q][jj] = w[(j + jj) * kdim + q].
                    Elems::F32(wv) => {
                        sgemm(rows, kl, gcols, &a_tile[k0..], kdim, 1, &wv[j * kdim + k0..], 1, kdim, &mut part, gcols)
                    }
                    _ => {
                        b_tile.clear();
                        b_tile.resize(gcols * kdim, 0.0);
                        wt.read_into(j * kdim, &mut b_tile);
                        sgemm(rows, kl, gcols, &a_tile[k0..], kdim, 1, &b_tile[k0..], 1, kdim, &mut part, gcols);
                    }
                }
                for r in 0..rows {
                    c_tile[r * cols + (j - n0)..r * cols + (jg1 - n0)].copy_from_slice(&part[r * gcols..(r + 1) * gcols]);
                }
                j = jg1;
            }
            epilogue_inputs(p, dtype, mem, (bias_arg, res_arg), (m0, m1, n0, n1), &mut bias_vals, &mut res_tile);
        }
        if p.split_k > 1 {
            // Raw partial sums into the f32 workspace [split_k][gemm_m][out_c].
            let (m, n) = (p.gemm_m() as usize, p.out_c as usize);
            let mut ws = ElemsMut::new(mem.arg_mut(out_arg), DType::F32);
            for (r, row) in c_tile.chunks(cols).enumerate() {
                ws.write_from((slice * m + m0 + r) * n + n0, row);
            }
            continue;
        }
        let ops = p.out_pixel_stride as usize;
        let mut out = ElemsMut::new(mem.arg_mut(out_arg), dtype);
        epilogue_store(
            &mut c_tile,
            cols,
            &p.epilogue,
            1.0,
            bias_arg.map(|_| bias_vals.as_slice()),
            res_arg.map(|_| res_tile.as_slice()),
            |r, row| out.write_from((m0 + r) * ops + n0, row),
        );
    }
}

/// Depthwise convolution: one filter per channel; weights [kernel_h][kernel_w][channels].
pub(crate) fn depthwise(p: &Conv2dParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let (bias_arg, res_arg, out_arg) = arg_positions(p);
    let c = p.in_c as usize;
    let mut c_tile: Vec<f32> = Vec::new();
    let mut xs: Vec<f32> = Vec::new();
    let mut ws: Vec<f32> = Vec::new();
    let mut bias_vals = Vec::new();
    let mut res_tile = Vec::new();
    for block in blocks {
        let (m0, m1, n0, n1) = tile_of(p, block);
        let (rows, cols) = (m1 - m0, n1 - n0);
        c_tile.clear();
        c_tile.resize(rows * cols, 0.0);
        {
            let x = Elems::new(mem.arg(0), dtype);
            let wt = Elems::new(mem.arg(1), dtype);
            ws.resize(cols, 0.0);
            xs.resize(cols, 0.0);
            for r in 0..rows {
                let acc = &mut c_tile[r * cols..(r + 1) * cols];
                for_each_tap(p, m0 + r, |tap, src| {
                    x.read_into(src + n0, &mut xs);
                    wt.read_into(tap * c + n0, &mut ws);
                    for ((a, xv), wv) in acc.iter_mut().zip(&xs).zip(&ws) {
                        *a += xv * wv;
                    }
                });
            }
            epilogue_inputs(p, dtype, mem, (bias_arg, res_arg), (m0, m1, n0, n1), &mut bias_vals, &mut res_tile);
        }
        let ops = p.out_pixel_stride as usize;
        let mut out = ElemsMut::new(mem.arg_mut(out_arg), dtype);
        epilogue_store(
            &mut c_tile,
            cols,
            &p.epilogue,
            1.0,
            bias_arg.map(|_| bias_vals.as_slice()),
            res_arg.map(|_| res_tile.as_slice()),
            |r, row| out.write_from((m0 + r) * ops + n0, row),
        );
    }
}

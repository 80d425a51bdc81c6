//! Batched strided matrix product with a fused epilogue.

use super::{Elems, ElemsMut, KernelMemory};
use kairos_core::DType;
use kairos_core::plan::{EpilogueParams, GemmParams, split_k_len};
use std::ops::Range;

/// c[i * ldc + j] = sum_p a[i * rsa + p * csa] * b[p * rsb + j * csb] for an m x k by k x n product (f32).
/// Bounds are checked here, so the call below never reads or writes outside the slices.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    rsa: usize,
    csa: usize,
    b: &[f32],
    rsb: usize,
    csb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            c[i * ldc..i * ldc + n].fill(0.0);
        }
        return;
    }
    assert!((m - 1) * rsa + (k - 1) * csa < a.len(), "sgemm: A view exceeds its slice");
    assert!((k - 1) * rsb + (n - 1) * csb < b.len(), "sgemm: B view exceeds its slice");
    assert!((m - 1) * ldc + n <= c.len(), "sgemm: C view exceeds its slice");
    assert!(ldc >= n, "sgemm: C rows overlap");
    #[allow(unsafe_code)]
    // SAFETY: matrixmultiply reads A at i*rsa + p*csa for i < m, p < k, B at p*rsb + j*csb for p < k,
    // j < n, and writes C at i*ldc + j for i < m, j < n. The asserts above bound every such index by
    // its slice's length, the strides fit in isize because the slices' lengths do, and `c` is a
    // unique borrow so the write cannot alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            0.0,
            c.as_mut_ptr(),
            ldc as isize,
            1,
        );
    }
}

/// Applies bias, residual and activation to an accumulator tile and stores it.
/// `tile` is rows x cols row-major; `res` holds the residual tile in the same shape when present.
pub(crate) fn epilogue_store(
    tile: &mut [f32],
    cols: usize,
    ep: &EpilogueParams,
    alpha: f32,
    bias: Option<&[f32]>,
    res: Option<&[f32]>,
    mut store: impl FnMut(usize, &[f32]),
) {
    for (r, row) in tile.chunks_mut(cols).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            let mut x = alpha * *v;
            if let Some(b) = bias {
                x += b[j];
            }
            if let Some(rt) = res {
                x += rt[r * cols + j];
            }
            *v = ep.act.apply(x);
        }
        store(r, row);
    }
}

pub(crate) fn gemm(p: &GemmParams, dtype: DType, mem: &mut dyn KernelMemory, blocks: Range<u32>) {
    let (m, n) = (p.m as usize, p.n as usize);
    let (mt, nt) = (p.m_tiles(), p.n_tiles());
    let per_slice = p.batch0 * p.batch1 * mt * nt;
    let k_len = split_k_len(p.k, p.split_k) as usize;
    let (bias_arg, res_arg, out_arg) = super::epilogue_args(2, &p.epilogue);
    let mut a_tile = Vec::new();
    let mut b_tile = Vec::new();
    let mut c_tile = Vec::new();
    let mut res_tile = Vec::new();
    let mut bias_vals = Vec::new();
    for block in blocks {
        let slice = (block / per_slice) as usize;
        let block = block % per_slice;
        // This block's part of K: all of it, or its split-K slice.
        let (k0, k) = if p.split_k > 1 {
            let k0 = slice * k_len;
            (k0, k_len.min(p.k as usize - k0))
        } else {
            (0, p.k as usize)
        };
        let bb = block / (mt * nt);
        let rest = block % (mt * nt);
        let (bm, bn) = (rest / nt, rest % nt);
        let (b0, b1) = ((bb / p.batch1) as u64, (bb % p.batch1) as u64);
        let i0 = (bm * p.tile_m) as usize;
        let i1 = (i0 + p.tile_m as usize).min(m);
        let j0 = (bn * p.tile_n) as usize;
        let j1 = (j0 + p.tile_n as usize).min(n);
        let (rows, cols) = (i1 - i0, j1 - j0);
        let a_off = (b0 * p.a_stride0 + b1 * p.a_stride1) as usize + i0 * p.a_stride_m as usize + k0 * p.a_stride_k as usize;
        let b_off = (b0 * p.b_stride0 + b1 * p.b_stride1) as usize + j0 * p.b_stride_n as usize + k0 * p.b_stride_k as usize;
        c_tile.clear();
        c_tile.resize(rows * cols, 0.0);
        {
            let a = Elems::new(mem.arg(0), dtype);
            let b = Elems::new(mem.arg(1), dtype);
            let (sam, sak) = (p.a_stride_m as usize, p.a_stride_k as usize);
            let (sbk, sbn) = (p.b_stride_k as usize, p.b_stride_n as usize);
            match (a, b) {
                (Elems::F32(av), Elems::F32(bv)) => {
                    sgemm(rows, k, cols, &av[a_off..], sam, sak, &bv[b_off..], sbk, sbn, &mut c_tile, cols)
                }
                _ => {
                    // Convert the operand tiles to f32, packed row-major.
                    a_tile.clear();
                    a_tile.extend((0..rows).flat_map(|i| (0..k).map(move |q| a_off + i * sam + q * sak)).map(|idx| a.get(idx)));
                    b_tile.clear();
                    b_tile.extend((0..k).flat_map(|q| (0..cols).map(move |j| b_off + q * sbk + j * sbn)).map(|idx| b.get(idx)));
                    sgemm(rows, k, cols, &a_tile, k, 1, &b_tile, cols, 1, &mut c_tile, cols);
                }
            }
            if let Some(ba) = bias_arg {
                let bv = Elems::new(mem.arg(ba), dtype);
                bias_vals.clear();
                bias_vals.extend((j0..j1).map(|j| bv.get(j)));
            }
            if let Some(ra) = res_arg {
                let rv = Elems::new(mem.arg(ra), dtype);
                let r_off = (b0 * p.r_stride0 + b1 * p.r_stride1) as usize;
                res_tile.clear();
                res_tile.extend(
                    (i0..i1).flat_map(|i| (j0..j1).map(move |j| r_off + i * p.r_stride_m as usize + j)).map(|idx| rv.get(idx)),
                );
            }
        }
        if p.split_k > 1 {
            // Raw partial sums into the f32 workspace [split_k][batches][m][n].
            let mut ws = ElemsMut::new(mem.arg_mut(out_arg), DType::F32);
            let base = (slice * (p.batch0 * p.batch1) as usize + bb as usize) * m * n;
            for (r, row) in c_tile.chunks(cols).enumerate() {
                ws.write_from(base + (i0 + r) * n + j0, row);
            }
            continue;
        }
        let c_off = (b0 * p.c_stride0 + b1 * p.c_stride1) as usize;
        let mut out = ElemsMut::new(mem.arg_mut(out_arg), dtype);
        epilogue_store(
            &mut c_tile,
            cols,
            &p.epilogue,
            p.alpha,
            bias_arg.map(|_| bias_vals.as_slice()),
            res_arg.map(|_| res_tile.as_slice()),
            |r, row| out.write_from(c_off + (i0 + r) * p.c_stride_m as usize + j0, row),
        );
    }
}

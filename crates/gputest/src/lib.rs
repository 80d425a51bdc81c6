//! kairos-gputest: the GPU suite, test support that needs a real GPU (a dev-only crate: the binary
//! never depends on it). Correctness checks and measurements shared by `tests/gpu.rs`
//! (`#[ignore]`d without a GPU; run with `--include-ignored`), `tests/cold.rs`, `tests/recovery.rs`
//! and `examples/gpu_suite.rs` (what `scripts/gpu-suite.sh` runs on the device).
//!
//! Kernel checks run one case list against the CPU reference (`kairos_kernels::cpu::run_blocks`)
//! on random inputs, with the named tolerances [`TOL_F32`] and [`TOL_F16`] on the relative L2
//! error of the output. Outputs start from the same random poison on both sides, so an element
//! the GPU fails to write shows up as an error.

use kairos_cuda::profile::{PlanBuffers, run_plan, synthetic_input};
use kairos_cuda::{CudaGpu, LaunchOptions};
use kairos_gpu::*;
use kairos_ir::graph::Act;
use kairos_ir::plan::*;
use kairos_ir::tensor::relative_l2_error;
use kairos_ir::{DType, Tensor};
use kairos_kernels::cpu::{KernelMemory, run_blocks};

pub use kairos_kernels::cpu::{TOL_F16, TOL_F32, tolerance};

/// xorshift64*: the suite's only source of randomness; every case prints its seed.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// How an argument buffer is filled.
#[derive(Clone, Copy, Debug)]
pub enum Fill {
    /// Uniform floats in [lo, hi), stored in the argument's dtype.
    Float(f32, f32),
    /// Uniform i64 in [lo, hi).
    Index(i64, i64),
    /// Uniform floats in [-1, 1) with every n-th element NaN.
    NanEvery(usize),
}

#[derive(Clone, Debug)]
pub struct Arg {
    pub elems: usize,
    pub fill: Fill,
    /// The argument's element type; None: the launch dtype.
    pub dtype: Option<DType>,
}

/// A layer norm over `rows` x `cols` (eps 1e-5), `rows_per_block` rows per logical block.
fn layernorm_case(rows: u32, cols: u32, rows_per_block: u32, threads: u32) -> KernelCase {
    norm_case(rows, cols, rows_per_block, threads, false)
}

/// A layer norm, or with `rms` an RMS norm (T5's: no mean subtracted).
fn norm_case(rows: u32, cols: u32, rows_per_block: u32, threads: u32, rms: bool) -> KernelCase {
    let (r, c) = (rows as usize, cols as usize);
    KernelCase {
        smem_bytes: 0,
        name: format!("{} {cols}", if rms { "rms norm" } else { "layernorm" }),
        kernel: Kernel::LayerNorm(LayerNormParams { rows, cols, eps: 1e-5, rms, rows_per_block }),
        threads,
        args: vec![f(r * c), f(c), f(c), f(r * c)],
    }
}

/// A softmax over `rows` x `cols` scaled by `scale`, causal over `causal_rows` query rows when given,
/// `rows_per_block` rows per logical block.
fn softmax_case(
    name: &str,
    rows: u32,
    cols: u32,
    scale: f32,
    causal_rows: Option<u32>,
    rows_per_block: u32,
    threads: u32,
) -> KernelCase {
    let n = rows as usize * cols as usize;
    KernelCase {
        smem_bytes: 0,
        name: name.into(),
        kernel: Kernel::Softmax(SoftmaxParams {
            rows,
            cols,
            scale,
            causal: causal_rows.is_some(),
            causal_rows: causal_rows.unwrap_or(1),
            zero_nan: false,
            rows_per_block,
        }),
        threads,
        args: vec![f(n), f(n)],
    }
}

/// A softmax with `zero_nan` whose input has every `nan_every`-th element NaN.
fn softmax_zero_nan_case(name: &str, rows: u32, cols: u32, nan_every: usize) -> KernelCase {
    let mut case = softmax_case(name, rows, cols, 0.5, None, 2, 256);
    if let Kernel::Softmax(p) = &mut case.kernel {
        p.zero_nan = true;
    }
    case.args[0].fill = Fill::NanEvery(nan_every);
    case
}

fn f(elems: usize) -> Arg {
    Arg { elems, fill: Fill::Float(-1.0, 1.0), dtype: None }
}

/// One kernel launch to check: its last argument is the output.
#[derive(Clone, Debug)]
pub struct KernelCase {
    pub name: String,
    pub kernel: Kernel,
    pub threads: u32,
    /// The launch's dynamic shared memory (LaunchShape::shared_mem_bytes).
    pub smem_bytes: u32,
    pub args: Vec<Arg>,
}

impl KernelCase {
    fn with_smem(mut self, bytes: u32) -> KernelCase {
        self.smem_bytes = bytes;
        self
    }
}

#[allow(clippy::too_many_arguments)]
fn conv_case(
    name: &str,
    (batch, in_h, in_w, in_c, out_c): (u32, u32, u32, u32, u32),
    (k, stride, pad, dil, groups): (u32, u32, u32, u32, u32),
    (bias, residual, act): (bool, bool, Act),
    (in_extra, out_extra): (u32, u32),
    (tile_m, tile_n, threads): (u32, u32, u32),
    depthwise: bool,
) -> KernelCase {
    let out_h = (in_h + 2 * pad - dil * (k - 1) - 1) / stride + 1;
    let out_w = (in_w + 2 * pad - dil * (k - 1) - 1) / stride + 1;
    let p = Conv2dParams {
        batch,
        in_h,
        in_w,
        in_c,
        out_h,
        out_w,
        out_c,
        kernel_h: k,
        kernel_w: k,
        stride_h: stride,
        stride_w: stride,
        pad_h: pad,
        pad_w: pad,
        dilation_h: dil,
        dilation_w: dil,
        groups,
        in_pixel_stride: in_c + in_extra,
        out_pixel_stride: out_c + out_extra,
        res_pixel_stride: out_c + out_extra,
        epilogue: EpilogueParams { bias, residual, act },
        tile_m,
        tile_n,
        split_k: 1,
    };
    let pixels_out = (batch * out_h * out_w) as usize;
    let mut args = vec![f((batch * in_h * in_w) as usize * p.in_pixel_stride as usize)];
    args.push(f(if depthwise { (k * k * in_c) as usize } else { (out_c * k * k * (in_c / groups)) as usize }));
    if bias {
        args.push(f(out_c as usize));
    }
    if residual {
        args.push(f(pixels_out * p.res_pixel_stride as usize));
    }
    args.push(f(pixels_out * p.out_pixel_stride as usize));
    KernelCase {
        smem_bytes: 0,
        name: name.into(),
        kernel: if depthwise { Kernel::DepthwiseConv2d(p) } else { Kernel::Conv2d(p) },
        threads,
        args,
    }
}

/// The case as a split-K product: `splits` slices of K writing raw f32 partial sums (no alpha, no
/// epilogue) into a workspace [splits][batches][m][n], the case's new output.
fn split_k(mut case: KernelCase, splits: u32) -> KernelCase {
    case.kernel = case.kernel.split_k_partials(splits);
    let (batches, m, n) = match &case.kernel {
        Kernel::Gemm(p) => (p.batch0 * p.batch1, p.m, p.n),
        Kernel::Conv2d(p) => (1, p.gemm_m(), p.out_c),
        k => panic!("split_k of a {} case", k.name()),
    };
    if let Err(e) = case.kernel.check_split_k() {
        panic!("case {}: {e}", case.name);
    }
    case.args.truncate(2);
    case.args.push(Arg { elems: (splits * batches * m * n) as usize, fill: Fill::Float(-1.0, 1.0), dtype: Some(DType::F32) });
    case
}

/// A splitk_sum case: `splits` f32 slices of batch0 x batch1 x m x n, the output rows `out_pad`
/// elements wider than n (a strided destination), optional bias and residual.
fn splitk_sum_case(
    name: &str,
    splits: u32,
    (b0, b1, m, n): (u32, u32, u32, u32),
    out_pad: u32,
    alpha: f32,
    epilogue: EpilogueParams,
) -> KernelCase {
    let (b1_, m_, n_, ld) = (b1 as u64, m as u64, n as u64, (n + out_pad) as u64);
    let p = SplitKSumParams {
        splits,
        batch0: b0,
        batch1: b1,
        m,
        n,
        c_stride0: b1_ * m_ * ld,
        c_stride1: m_ * ld,
        c_stride_m: ld,
        r_stride0: b1_ * m_ * n_,
        r_stride1: m_ * n_,
        r_stride_m: n_,
        alpha,
        epilogue,
        elems_per_block: 128,
    };
    let elems = p.elems() as usize;
    let mut args = vec![Arg { elems: splits as usize * elems, fill: Fill::Float(-1.0, 1.0), dtype: Some(DType::F32) }];
    if epilogue.bias {
        args.push(f(n as usize));
    }
    if epilogue.residual {
        args.push(f(elems));
    }
    args.push(f(b0 as usize * (b1_ * m_ * ld) as usize));
    KernelCase { smem_bytes: 0, name: name.into(), kernel: Kernel::SplitKSum(p), threads: 256, args }
}

/// The case with a residual of one row of n per batch0 index, broadcast over batch1 and the rows
/// (strides 0): an attention mask [B, 1, 1, K] added to the scores [B, H, Q, K].
fn with_key_mask(mut case: KernelCase) -> KernelCase {
    let Kernel::Gemm(p) = &mut case.kernel else { panic!("with_key_mask of a {} case", case.kernel.name()) };
    assert!(!p.epilogue.residual && !p.epilogue.bias, "with_key_mask: {}", case.name);
    p.epilogue.residual = true;
    (p.r_stride0, p.r_stride1, p.r_stride_m) = (p.n as u64, 0, 0);
    let elems = (p.batch0 * p.n) as usize;
    let out = case.args.len() - 1;
    case.args.insert(out, f(elems));
    case.name = format!("{} (residual strides {}, 0, 0)", case.name, p.n);
    case
}

/// Gemm layouts the plans use.
#[derive(Clone, Copy, Debug)]
pub enum GemmLayout {
    /// A [b][m][k], weights B stored [n][k] shared by the batch (linear layers).
    Linear,
    /// A [b][k][m] (transposed), B [b][k][n].
    Transposed,
    /// Attention scores: A = Q and B = K^T read out of [batch, seq, heads, dim] tensors.
    Heads,
    /// Attention output: A = P [b][h][m][k] contiguous, B = V read out of a [batch, seq, heads, dim]
    /// tensor (n contiguous).
    HeadsPv,
}

#[allow(clippy::too_many_arguments)]
fn gemm_case(
    name: &str,
    layout: GemmLayout,
    (b0, b1, m, n, k): (u32, u32, u32, u32, u32),
    alpha: f32,
    epi: EpilogueParams,
    tile: (u32, u32),
    threads: u32,
) -> KernelCase {
    let (m64, n64, k64, b164) = (m as u64, n as u64, k as u64, b1 as u64);
    let mut p = GemmParams {
        batch0: b0,
        batch1: b1,
        m,
        n,
        k,
        a_stride0: 0,
        a_stride1: 0,
        a_stride_m: 0,
        a_stride_k: 0,
        b_stride0: 0,
        b_stride1: 0,
        b_stride_k: 0,
        b_stride_n: 0,
        c_stride0: b164 * m64 * n64,
        c_stride1: m64 * n64,
        c_stride_m: n64,
        r_stride0: b164 * m64 * n64,
        r_stride1: m64 * n64,
        r_stride_m: n64,
        alpha,
        epilogue: epi,
        tile_m: tile.0,
        tile_n: tile.1,
        split_k: 1,
    };
    let (a_elems, b_elems);
    match layout {
        GemmLayout::Linear => {
            (p.a_stride0, p.a_stride1, p.a_stride_m, p.a_stride_k) = (b164 * m64 * k64, m64 * k64, k64, 1);
            (p.b_stride0, p.b_stride1, p.b_stride_k, p.b_stride_n) = (0, 0, 1, k64);
            a_elems = b0 as u64 * b164 * m64 * k64;
            b_elems = n64 * k64;
        }
        GemmLayout::Transposed => {
            (p.a_stride0, p.a_stride1, p.a_stride_m, p.a_stride_k) = (b164 * m64 * k64, m64 * k64, 1, m64);
            (p.b_stride0, p.b_stride1, p.b_stride_k, p.b_stride_n) = (b164 * k64 * n64, k64 * n64, n64, 1);
            a_elems = b0 as u64 * b164 * m64 * k64;
            b_elems = b0 as u64 * b164 * k64 * n64;
        }
        GemmLayout::Heads => {
            // batch0 = batch, batch1 = heads, m = n = seq, k = head dim.
            let row = b164 * k64;
            (p.a_stride0, p.a_stride1, p.a_stride_m, p.a_stride_k) = (m64 * row, k64, row, 1);
            (p.b_stride0, p.b_stride1, p.b_stride_k, p.b_stride_n) = (n64 * row, k64, 1, row);
            a_elems = b0 as u64 * m64 * row;
            b_elems = b0 as u64 * n64 * row;
        }
        GemmLayout::HeadsPv => {
            // batch0 = batch, batch1 = heads, m = seq, k = seq, n = head dim.
            let row = b164 * n64;
            (p.a_stride0, p.a_stride1, p.a_stride_m, p.a_stride_k) = (b164 * m64 * k64, m64 * k64, k64, 1);
            (p.b_stride0, p.b_stride1, p.b_stride_k, p.b_stride_n) = (k64 * row, n64, row, 1);
            a_elems = b0 as u64 * b164 * m64 * k64;
            b_elems = b0 as u64 * k64 * row;
        }
    }
    let c_elems = (b0 as u64 * b164 * m64 * n64) as usize;
    let mut args = vec![f(a_elems as usize), f(b_elems as usize)];
    if epi.bias {
        args.push(f(n as usize));
    }
    if epi.residual {
        args.push(f(c_elems));
    }
    args.push(f(c_elems));
    KernelCase { smem_bytes: 0, name: name.into(), kernel: Kernel::Gemm(p), threads, args }
}

#[allow(clippy::too_many_arguments)]
fn pool_case(
    name: &str,
    kind: PoolKindParam,
    (batch, in_h, in_w, c): (u32, u32, u32, u32),
    k: u32,
    stride: u32,
    pad: (u32, u32),
    out_extra: u32,
) -> KernelCase {
    let (pad_lo, pad_hi) = pad;
    let out_h = (in_h + pad_lo + pad_hi - k) / stride + 1;
    let out_w = (in_w + pad_lo + pad_hi - k) / stride + 1;
    let p = Pool2dParams {
        kind,
        batch,
        in_h,
        in_w,
        channels: c,
        out_h,
        out_w,
        kernel_h: k,
        kernel_w: k,
        stride_h: stride,
        stride_w: stride,
        pad_top: pad_lo,
        pad_left: pad_lo,
        pad_bottom: pad_hi,
        pad_right: pad_hi,
        in_pixel_stride: c,
        out_pixel_stride: c + out_extra,
        elems_per_block: 256,
    };
    KernelCase {
        smem_bytes: 0,
        name: name.into(),
        kernel: Kernel::Pool2d(p),
        threads: 256,
        args: vec![f((batch * in_h * in_w * c) as usize), f((batch * out_h * out_w) as usize * p.out_pixel_stride as usize)],
    }
}

fn eltwise_case(
    name: &str,
    func: EltFunc,
    act: Act,
    shape: [u32; 6],
    ins: Vec<([u64; 6], DType, Fill)>,
    out: ([u64; 6], DType),
    scalars: [f32; 2],
) -> KernelCase {
    let extent = |strides: &[u64; 6]| -> usize { (0..6).map(|d| (shape[d] as u64 - 1) * strides[d]).sum::<u64>() as usize + 1 };
    let mut in_strides = [[0u64; 6]; 3];
    let mut in_dtypes = [DType::F32; 3];
    let mut args = Vec::new();
    for (j, (s, d, fill)) in ins.iter().enumerate() {
        in_strides[j] = *s;
        in_dtypes[j] = *d;
        args.push(Arg { elems: extent(s), fill: *fill, dtype: Some(*d) });
    }
    args.push(Arg { elems: extent(&out.0), fill: Fill::Float(-1.0, 1.0), dtype: Some(out.1) });
    let p = EltwiseParams {
        func,
        act,
        inputs: ins.len() as u32,
        shape,
        out_strides: out.0,
        in_strides,
        in_dtypes,
        out_dtype: out.1,
        scalars,
        elems_per_block: 1024,
    };
    KernelCase { smem_bytes: 0, name: name.into(), kernel: Kernel::Eltwise(p), threads: 256, args }
}

/// Row-major strides of a rank-6 shape.
fn contiguous(shape: [u32; 6]) -> [u64; 6] {
    let mut s = [0u64; 6];
    let mut acc = 1u64;
    for d in (0..6).rev() {
        s[d] = acc;
        acc *= shape[d] as u64;
    }
    s
}

/// The kernel case list at a launch dtype (eltwise cases store their floats in it too).
pub fn kernel_cases(dtype: DType) -> Vec<KernelCase> {
    let none = EpilogueParams::default();
    let mut v = vec![
        conv_case(
            "conv3x3 bias relu",
            (2, 13, 11, 24, 40),
            (3, 1, 1, 1, 1),
            (true, false, Act::Relu),
            (0, 0),
            (64, 64, 256),
            false,
        ),
        conv_case("conv7x7 s2 stem", (1, 37, 37, 3, 16), (7, 2, 3, 1, 1), (true, false, Act::None), (0, 0), (64, 64, 256), false),
        conv_case(
            "conv1x1 residual slices",
            (1, 9, 9, 64, 72),
            (1, 1, 0, 1, 1),
            (true, true, Act::Relu),
            (8, 24),
            (64, 64, 256),
            false,
        ),
        conv_case(
            "conv3x3 dilated s2",
            (1, 17, 15, 16, 20),
            (3, 2, 2, 2, 1),
            (false, false, Act::Sigmoid),
            (0, 0),
            (32, 32, 128),
            false,
        ),
        conv_case(
            "conv tile 128x32 two passes",
            (1, 21, 21, 40, 36),
            (3, 1, 1, 1, 1),
            (true, false, Act::HardSwish),
            (0, 0),
            (128, 32, 32),
            false,
        ),
        conv_case("conv grouped", (1, 10, 10, 32, 48), (3, 1, 1, 1, 4), (true, false, Act::Relu6), (0, 0), (64, 64, 256), false),
        // The lowering's direct tiles (`direct_conv_tile`): one output per thread.
        conv_case(
            "conv grouped 32 tile 4x64",
            (1, 9, 9, 64, 64),
            (3, 1, 1, 1, 32),
            (true, false, Act::Silu),
            (0, 0),
            (4, 64, 256),
            false,
        ),
        conv_case("conv1x1 silu", (1, 8, 8, 32, 64), (1, 1, 0, 1, 1), (true, false, Act::Silu), (0, 0), (64, 64, 256), false),
        conv_case(
            "dwconv7x7 tile 8x32",
            (1, 14, 14, 96, 96),
            (7, 1, 3, 1, 96),
            (true, false, Act::None),
            (0, 0),
            (8, 32, 256),
            true,
        ),
        conv_case(
            "dwconv3x3 s2 relu6",
            (2, 15, 15, 48, 48),
            (3, 2, 1, 1, 48),
            (true, false, Act::Relu6),
            (0, 0),
            (32, 64, 256),
            true,
        ),
        conv_case(
            "dwconv5x5 residual",
            (1, 12, 12, 40, 40),
            (5, 1, 2, 1, 40),
            (true, true, Act::None),
            (0, 8),
            (32, 64, 256),
            true,
        ),
        gemm_case(
            "gemm linear bias gelu",
            GemmLayout::Linear,
            (1, 1, 37, 53, 71),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::Gelu },
            (64, 64),
            256,
        ),
        gemm_case(
            "gemm linear residual",
            GemmLayout::Linear,
            (2, 1, 64, 96, 128),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::None },
            (64, 64),
            256,
        ),
        gemm_case("gemm transposed batched", GemmLayout::Transposed, (2, 3, 20, 33, 45), 0.5, none, (32, 32), 128),
        gemm_case("gemm attention heads", GemmLayout::Heads, (2, 4, 24, 24, 16), 0.25, none, (64, 64), 256),
        gemm_case(
            "gemm tanh-gelu tile 128",
            GemmLayout::Linear,
            (1, 1, 130, 70, 50),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::GeluTanh },
            (128, 128),
            256,
        ),
        // Cases for the fp16 tensor-core engine's paths (f32 runs them on the SIMT engine):
        // 16-byte loads, ksplit, passes, both B layouts, element loads, tails in m, n and k.
        conv_case(
            "conv3x3 vec tile 128x128",
            (1, 14, 14, 64, 96),
            (3, 1, 1, 1, 1),
            (true, false, Act::Relu),
            (0, 0),
            (128, 128, 256),
            false,
        ),
        conv_case(
            "conv3x3 vec tile 16x16 ksplit",
            (1, 7, 7, 32, 48),
            (3, 1, 1, 1, 1),
            (true, true, Act::Relu),
            (0, 8),
            (16, 16, 256),
            false,
        ),
        conv_case(
            "conv vec 1 warp passes",
            (1, 12, 12, 16, 130),
            (3, 2, 1, 1, 1),
            (false, false, Act::None),
            (8, 0),
            (128, 128, 32),
            false,
        ),
        conv_case(
            "conv1x1 vec s2 tile 64x32",
            (2, 9, 9, 136, 72),
            (1, 2, 0, 1, 1),
            (true, true, Act::None),
            (0, 0),
            (64, 32, 128),
            false,
        ),
        gemm_case(
            "gemm linear vec 16x64",
            GemmLayout::Linear,
            (1, 1, 128, 192, 264),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Gelu },
            (16, 64),
            128,
        ),
        gemm_case("gemm transposed kn vec", GemmLayout::Transposed, (1, 2, 32, 48, 40), 1.0, none, (32, 32), 128),
        gemm_case("gemm heads qk vec", GemmLayout::Heads, (1, 2, 40, 40, 64), 0.125, none, (32, 64), 256),
        gemm_case("gemm heads pv kn", GemmLayout::HeadsPv, (2, 3, 24, 32, 24), 1.0, none, (16, 32), 128),
        gemm_case("gemm heads pv kn tail", GemmLayout::HeadsPv, (1, 2, 20, 20, 20), 1.0, none, (64, 16), 64),
        // Warp tiles of 2 x 2 and 4 x 2 fragments (and 1 x 2 in the second row tile).
        gemm_case("gemm 32x16 warp tiles 2x2", GemmLayout::Linear, (1, 1, 45, 40, 72), 1.0, none, (32, 16), 64),
        gemm_case(
            "gemm 64x16 one warp 4x2",
            GemmLayout::Linear,
            (1, 1, 70, 20, 72),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::Relu },
            (64, 16),
            32,
        ),
        // The wide entries (fp16: 128 threads on 128 x 128 tiles, four 64 x 64 warp tiles): tails in
        // m, n and k, both B layouts, the convolution loader, the shallowest pipeline (52 KB: two
        // stages) and a deep one; edge tiles of 72 rows run 32-row warp tiles.
        gemm_case(
            "gemm wide 128x128 residual gelu",
            GemmLayout::Linear,
            (1, 1, 200, 260, 264),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Gelu },
            (128, 128),
            128,
        )
        .with_smem(104 * 1024),
        gemm_case("gemm wide heads pv kn", GemmLayout::HeadsPv, (1, 2, 130, 136, 72), 1.0, none, (128, 128), 128),
        // An edge tile of 8 rows (no small-M path outside the `_gv` entries: the wide engine's
        // run-time shape takes it), the ReLU entry.
        gemm_case(
            "gemm wide 128x128 relu edge 8 rows",
            GemmLayout::Linear,
            (1, 1, 136, 130, 72),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::Relu },
            (128, 128),
            128,
        ),
        conv_case(
            "conv3x3 wide 128x128",
            (1, 19, 17, 64, 136),
            (3, 1, 1, 1, 1),
            (true, true, Act::Relu),
            (0, 8),
            (128, 128, 128),
            false,
        )
        .with_smem(104 * 1024),
        // The fixed-shape tiles (tile.cuh: tc_tile_fixed; 256 threads on 128x128, 64x128, 128x64):
        // edge tiles in m, n and k (K not a multiple of the k32 stage), odd n (unaligned paired
        // stores), bias, residual and activations (the shared-memory epilogue with whole, partial
        // and unaligned runs of 8; the register one where the stages are too small for the f32
        // tile, as in "two stages"), the attention layout (B = K^T), batches, the
        // convolution loader (padding, strided output), split-K, two stages and deep pipelines;
        // then the generic engine's paired epilogue at other tiles and CTA sizes.
        gemm_case(
            "gemm fixed 128x128 residual gelu",
            GemmLayout::Linear,
            (1, 1, 200, 260, 264),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Gelu },
            (128, 128),
            256,
        )
        .with_smem(104 * 1024),
        gemm_case("gemm fixed 128x128 two stages", GemmLayout::Linear, (2, 1, 130, 136, 72), 1.0, none, (128, 128), 256),
        gemm_case("gemm fixed 64x128 heads qk", GemmLayout::Heads, (1, 2, 130, 136, 64), 0.125, none, (64, 128), 256)
            .with_smem(104 * 1024),
        gemm_case(
            "gemm fixed 128x64 odd n",
            GemmLayout::Linear,
            (1, 2, 136, 75, 96),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Relu },
            (128, 64),
            256,
        )
        .with_smem(52 * 1024),
        gemm_case("gemm 64x64 8 warps", GemmLayout::Linear, (1, 1, 100, 70, 136), 1.0, none, (64, 64), 256),
        gemm_case(
            "gemm narrow 64x64 odd n",
            GemmLayout::Linear,
            (1, 1, 100, 75, 136),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Tanh },
            (64, 64),
            128,
        )
        .with_smem(52 * 1024),
        gemm_case("gemm narrow 64x32 heads qk", GemmLayout::Heads, (2, 3, 70, 40, 64), 0.125, none, (64, 32), 128),
        // 64 x 64 on 128 threads: one warpgroup's wgmma on sm_90a (tc_tile_wgmma), with K past the
        // last k32 stage, edge tiles in m and n, a residual and GELU.
        gemm_case(
            "gemm 64x64 128 threads heads qk, k tail",
            GemmLayout::Heads,
            (2, 3, 70, 72, 40),
            0.125,
            EpilogueParams { bias: false, residual: true, act: Act::Gelu },
            (64, 64),
            128,
        ),
        // The attention mask fused as the scores' residual, broadcast over heads and query rows.
        with_key_mask(gemm_case(
            "gemm narrow 64x32 heads qk, key mask",
            GemmLayout::Heads,
            (2, 3, 70, 40, 64),
            0.35,
            none,
            (64, 32),
            128,
        )),
        with_key_mask(
            gemm_case(
                "gemm fixed 64x128 heads qk, key mask",
                GemmLayout::Heads,
                (1, 2, 130, 136, 64),
                0.125,
                none,
                (64, 128),
                256,
            )
            .with_smem(104 * 1024),
        ),
        gemm_case("gemm narrow 32x64", GemmLayout::Linear, (1, 1, 40, 130, 520), 1.0, none, (32, 64), 128).with_smem(104 * 1024),
        gemm_case("gemm narrow 32x32", GemmLayout::Linear, (1, 1, 33, 33, 40), 1.0, none, (32, 32), 128),
        gemm_case(
            "gemm narrow 32x32 quick gelu",
            GemmLayout::Linear,
            (1, 1, 33, 40, 40),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::QuickGelu },
            (32, 32),
            128,
        ),
        gemm_case("gemm narrow 128x64", GemmLayout::Linear, (1, 1, 130, 66, 104), 1.0, none, (128, 64), 128)
            .with_smem(104 * 1024),
        gemm_case("gemm narrow 64x128", GemmLayout::Linear, (1, 1, 66, 130, 104), 1.0, none, (64, 128), 128).with_smem(52 * 1024),
        conv_case(
            "conv3x3 fixed 128x128",
            (1, 19, 17, 64, 136),
            (3, 1, 1, 1, 1),
            (true, true, Act::Relu),
            (0, 8),
            (128, 128, 256),
            false,
        )
        .with_smem(104 * 1024),
        conv_case(
            "conv1x1 s2 narrow 64x64",
            (2, 9, 9, 136, 72),
            (1, 2, 0, 1, 1),
            (true, false, Act::None),
            (8, 0),
            (64, 64, 128),
            false,
        ),
        conv_case(
            "conv3x3 s2 narrow 32x64",
            (1, 15, 15, 32, 64),
            (3, 2, 1, 1, 1),
            (false, true, Act::Relu),
            (0, 0),
            (32, 64, 128),
            false,
        ),
        split_k(
            gemm_case("gemm split-k 3 fixed 128x64", GemmLayout::Linear, (1, 1, 140, 72, 1000), 1.0, none, (128, 64), 256),
            3,
        ),
        // Deeper pipelines (more dynamic shared memory): ring wrap-around, fewer stages than slots.
        gemm_case("gemm linear deep pipeline", GemmLayout::Linear, (1, 1, 40, 48, 1000), 1.0, none, (16, 16), 128)
            .with_smem(104 * 1024),
        conv_case(
            "conv3x3 vec deep pipeline",
            (1, 10, 10, 64, 80),
            (3, 1, 1, 1, 1),
            (true, false, Act::Relu),
            (0, 0),
            (32, 64, 256),
            false,
        )
        .with_smem(104 * 1024),
        gemm_case("gemm heads pv kn deep", GemmLayout::HeadsPv, (1, 2, 24, 64, 200), 1.0, none, (16, 32), 128)
            .with_smem(52 * 1024),
        // The small-M path (at most 8 rows per tile, B with k contiguous): M = 1, 2, 5, 8; K not a
        // multiple of 8 (element loads); K chunks of A (long K, more shared memory); tiles of 2 to
        // 128 columns; 1 to 8 warps; batched attention rows; 1x1 convolutions at 1x1 pixels.
        gemm_case(
            "gemm small-m 1 bias relu",
            GemmLayout::Linear,
            (1, 1, 1, 200, 1000),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::Relu },
            (8, 8),
            128,
        ),
        gemm_case("gemm small-m 2 k odd", GemmLayout::Linear, (1, 1, 2, 37, 333), 0.5, none, (8, 16), 64),
        gemm_case(
            "gemm small-m 5 residual gelu tile 128",
            GemmLayout::Linear,
            (1, 1, 5, 130, 520),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Gelu },
            (8, 128),
            256,
        ),
        gemm_case(
            "gemm small-m 8 long k chunks",
            GemmLayout::Linear,
            (1, 1, 8, 24, 20000),
            1.0,
            EpilogueParams { bias: true, residual: false, act: Act::None },
            (8, 4),
            128,
        ),
        gemm_case(
            "gemm small-m 1 long odd k one warp",
            GemmLayout::Linear,
            (1, 1, 1, 12, 40001),
            1.0,
            EpilogueParams { bias: false, residual: true, act: Act::Sigmoid },
            (8, 2),
            32,
        ),
        gemm_case(
            "gemm small-m 8 deep smem",
            GemmLayout::Linear,
            (2, 1, 8, 40, 4104),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Relu },
            (16, 32),
            256,
        )
        .with_smem(104 * 1024),
        gemm_case("gemm small-m heads qk", GemmLayout::Heads, (2, 4, 6, 6, 64), 0.125, none, (8, 8), 128),
        with_key_mask(gemm_case(
            "gemm small-m heads qk, key mask",
            GemmLayout::Heads,
            (2, 4, 6, 6, 64),
            0.125,
            none,
            (8, 8),
            128,
        )),
        gemm_case("gemm small-m 3 rows tile 64", GemmLayout::Linear, (1, 1, 3, 70, 96), 1.0, none, (64, 64), 64),
        // The small-M tiles over more rows than one tile holds (the autotuner tries them up to 32
        // rows): 20 rows in three 8-row blocks per column range, with an epilogue.
        gemm_case(
            "gemm small-m tiles over 20 rows",
            GemmLayout::Linear,
            (1, 1, 20, 70, 96),
            1.0,
            EpilogueParams { bias: true, residual: true, act: Act::Gelu },
            (8, 16),
            128,
        ),
        conv_case(
            "conv1x1 1x1 pixels small-m",
            (1, 1, 1, 264, 100),
            (1, 1, 0, 1, 1),
            (true, true, Act::Relu),
            (0, 0),
            (8, 16, 128),
            false,
        ),
        conv_case(
            "conv1x1 1x1 pixels batch 3 odd k",
            (3, 1, 1, 30, 20),
            (1, 1, 0, 1, 1),
            (true, false, Act::None),
            (0, 0),
            (8, 8, 64),
            false,
        ),
        pool_case("maxpool 3x3 s2", PoolKindParam::Max, (2, 17, 17, 24), 3, 2, (1, 1), 0),
        pool_case("avgpool include pad", PoolKindParam::AvgIncludePad, (1, 9, 9, 16), 3, 1, (1, 1), 8),
        pool_case("avgpool exclude pad ceil", PoolKindParam::AvgExcludePad, (1, 10, 10, 16), 3, 2, (1, 2), 0),
        pool_case("global avgpool", PoolKindParam::AvgExcludePad, (2, 7, 7, 64), 7, 1, (0, 0), 0),
        softmax_case("softmax scaled", 37, 129, 0.125, None, 4, 128),
        softmax_case("softmax causal", 4 * 24, 24, 0.5, Some(24), 1, 256),
        softmax_case("softmax 1000 classes", 2, 1000, 1.0, None, 1, 256),
        // The register path: GPT-2's causal 128-column rows, 8 rows per block (one per warp), and
        // the path's limit (fp16: 1024 columns; f32 rows of 1024 take the general path), two rows
        // per warp.
        softmax_case("softmax causal 128 columns, 8 rows per block", 3 * 128, 128, 0.125, Some(128), 8, 256),
        softmax_case("softmax 1024 columns, 2 rows per warp", 21, 1024, 0.5, None, 8, 128),
        // The exporters' NaN guard fused (zero_nan): rows holding a NaN give zeros, the others a
        // softmax; the register path and the general one (fp16 rows past 1024 columns).
        softmax_zero_nan_case("softmax zero_nan, NaN in some rows", 24, 16, 37),
        softmax_zero_nan_case("softmax zero_nan 1500 columns", 6, 1500, 4001),
        layernorm_case(19, 768, 2, 256),
        // T5's RMS norm: the register path (512 columns) and the general one (odd length).
        norm_case(7, 512, 2, 256, true),
        norm_case(5, 1001, 1, 128, true),
        // The register path's limits (fp16 up to 1024 columns, f32 up to 512) and a row of odd
        // length (the general path in both).
        layernorm_case(5, 1024, 1, 128),
        layernorm_case(7, 512, 3, 64),
        layernorm_case(6, 100, 2, 96),
        KernelCase {
            smem_bytes: 0,
            name: "gather ids".into(),
            kernel: Kernel::Gather(GatherParams { count: 40, table_rows: 50, cols: 72, rows_per_block: 3 }),
            threads: 128,
            args: vec![f(50 * 72), Arg { elems: 40, fill: Fill::Index(-60, 60), dtype: Some(DType::I64) }, f(40 * 72)],
        },
    ];
    // Split-K: products cut into K slices (vector and element loads, both B layouts, the small-M
    // path, a slice shorter than the rest, the SIMT engine at f32) and the sums that finish them.
    v.extend([
        split_k(gemm_case("gemm split-k 3 linear", GemmLayout::Linear, (1, 1, 70, 48, 1000), 1.0, none, (32, 32), 128), 3),
        split_k(
            gemm_case("gemm split-k 4 transposed batched", GemmLayout::Transposed, (1, 2, 40, 40, 296), 1.0, none, (16, 32), 128),
            4,
        ),
        split_k(gemm_case("gemm split-k 2 pv kn", GemmLayout::HeadsPv, (1, 2, 24, 64, 200), 1.0, none, (32, 32), 256), 2),
        split_k(gemm_case("gemm split-k 2 small-m", GemmLayout::Linear, (1, 1, 5, 40, 336), 1.0, none, (8, 16), 64), 2),
        split_k(
            conv_case(
                "conv3x3 split-k 3",
                (1, 9, 9, 64, 48),
                (3, 1, 1, 1, 1),
                (false, false, Act::None),
                (0, 0),
                (32, 32, 128),
                false,
            ),
            3,
        ),
        split_k(
            conv_case(
                "conv3x3 split-k 2 odd channels strided",
                (1, 7, 7, 20, 24),
                (3, 2, 1, 1, 1),
                (false, false, Act::None),
                (4, 0),
                (16, 16, 64),
                false,
            ),
            2,
        ),
        splitk_sum_case(
            "splitk_sum 3 batched bias residual gelu",
            3,
            (2, 3, 5, 40),
            8,
            0.5,
            EpilogueParams { bias: true, residual: true, act: Act::Gelu },
        ),
        splitk_sum_case(
            "splitk_sum 5 rows relu",
            5,
            (1, 1, 30, 24),
            0,
            1.0,
            EpilogueParams { bias: false, residual: false, act: Act::Relu },
        ),
    ]);
    for (kind, name) in [(ReduceKind::Sum, "sum"), (ReduceKind::Mean, "mean"), (ReduceKind::Max, "max"), (ReduceKind::Min, "min")]
    {
        // Rows a warp each; outputs a thread each or (few in a block) a group of threads each,
        // over short and long axes.
        for (outer, red, inner) in [(6, 77, 1), (3, 19, 50), (1, 1003, 24), (2, 9, 7)] {
            v.push(KernelCase {
                smem_bytes: 0,
                name: format!("reduce {name} [{outer},{red},{inner}]"),
                kernel: Kernel::Reduce(ReduceParams { kind, outer, reduce: red, inner, elems_per_block: 64 }),
                threads: 256,
                args: vec![f((outer * red * inner) as usize), f((outer * inner) as usize)],
            });
        }
    }
    // Element-wise: broadcasting, unary functions, affine, select, casts, transposes.
    let sh = [1, 1, 2, 5, 7, 33];
    let c = contiguous(sh);
    let fl = Fill::Float(-1.0, 1.0);
    let pos = Fill::Float(0.1, 2.0);
    let mut bcast = [0u64; 6];
    bcast[5] = 1; // a per-channel vector broadcast over the other dims
    let mut tr = [0u64; 6]; // the input read transposed: dims 4 and 5 swapped
    tr[2] = 5 * 7 * 33;
    tr[3] = 7 * 33;
    tr[4] = 1;
    tr[5] = 7;
    v.push(eltwise_case(
        "eltwise add bcast relu",
        EltFunc::Binary(BinaryOpParam::Add),
        Act::Relu,
        sh,
        vec![(c, dtype, fl), (bcast, dtype, fl)],
        (c, dtype),
        [0.0; 2],
    ));
    v.push(eltwise_case(
        "eltwise div",
        EltFunc::Binary(BinaryOpParam::Div),
        Act::None,
        sh,
        vec![(c, dtype, fl), (c, dtype, pos)],
        (c, dtype),
        [0.0; 2],
    ));
    v.push(eltwise_case(
        "eltwise pow scalar",
        EltFunc::BinaryScalar(BinaryOpParam::Pow),
        Act::None,
        sh,
        vec![(c, dtype, pos)],
        (c, dtype),
        [1.5, 0.0],
    ));
    v.push(eltwise_case(
        "eltwise max tanh",
        EltFunc::Binary(BinaryOpParam::Max),
        Act::Tanh,
        sh,
        vec![(c, dtype, fl), (c, dtype, fl)],
        (c, dtype),
        [0.0; 2],
    ));
    for (u, fill) in [
        (UnaryOpParam::Sqrt, pos),
        (UnaryOpParam::Rsqrt, pos),
        (UnaryOpParam::Recip, pos),
        (UnaryOpParam::Exp, fl),
        (UnaryOpParam::Erf, fl),
        (UnaryOpParam::Neg, fl),
        (UnaryOpParam::Abs, fl),
        (UnaryOpParam::Square, fl),
        (UnaryOpParam::IsNan, Fill::NanEvery(7)),
    ] {
        v.push(eltwise_case(
            &format!("eltwise {u:?}"),
            EltFunc::Unary(u),
            Act::None,
            sh,
            vec![(c, dtype, fill)],
            (c, dtype),
            [0.0; 2],
        ));
    }
    v.push(eltwise_case(
        "eltwise affine sigmoid",
        EltFunc::Affine,
        Act::Sigmoid,
        sh,
        vec![(c, dtype, fl), (bcast, dtype, fl), (bcast, dtype, fl)],
        (c, dtype),
        [0.0; 2],
    ));
    v.push(eltwise_case(
        "eltwise where",
        EltFunc::Where,
        Act::None,
        sh,
        vec![(c, DType::I64, Fill::Index(0, 2)), (c, dtype, fl), (c, dtype, fl)],
        (c, dtype),
        [0.0; 2],
    ));
    v.push(eltwise_case("eltwise transpose copy", EltFunc::Copy, Act::None, sh, vec![(tr, dtype, fl)], (c, dtype), [0.0; 2]));
    v.push(eltwise_case(
        "eltwise cast f32 in",
        EltFunc::Copy,
        Act::HardSwish,
        sh,
        vec![(c, DType::F32, fl)],
        (c, dtype),
        [0.0; 2],
    ));
    v.push(eltwise_case("eltwise gelu", EltFunc::Copy, Act::Gelu, sh, vec![(c, dtype, fl)], (c, dtype), [0.0; 2]));
    v
}

/// Random bytes for an argument.
fn fill_bytes(arg: &Arg, dtype: DType, rng: &mut Rng) -> AlignedBytes {
    let d = arg.dtype.unwrap_or(dtype);
    let mut b = AlignedBytes::zeroed(arg.elems * d.size_bytes());
    let s = b.as_mut_slice();
    for i in 0..arg.elems {
        match (arg.fill, d) {
            (Fill::Float(lo, hi), DType::F32) => s[i * 4..i * 4 + 4].copy_from_slice(&rng.uniform(lo, hi).to_le_bytes()),
            (Fill::Float(lo, hi), DType::F16) => {
                s[i * 2..i * 2 + 2].copy_from_slice(&half::f16::from_f32(rng.uniform(lo, hi)).to_le_bytes())
            }
            (Fill::NanEvery(n), DType::F32 | DType::F16) => {
                let v = if i % n.max(1) == 0 { f32::NAN } else { rng.uniform(-1.0, 1.0) };
                if d == DType::F32 {
                    s[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes())
                } else {
                    s[i * 2..i * 2 + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes())
                }
            }
            (Fill::Index(lo, hi), DType::I64) => {
                let v = lo + (rng.next_u64() % (hi - lo) as u64) as i64;
                s[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes())
            }
            (fill, d) => panic!("cannot fill a {d:?} argument with {fill:?}"),
        }
    }
    b
}

struct VecMemory(Vec<AlignedBytes>);

impl KernelMemory for VecMemory {
    fn arg(&self, i: usize) -> &[u8] {
        self.0[i].as_slice()
    }
    fn arg_mut(&mut self, i: usize) -> &mut [u8] {
        self.0[i].as_mut_slice()
    }
}

fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        DType::I64 => bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32).collect(),
    }
}

/// The outcome of one kernel case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    pub name: String,
    pub dtype: DType,
    pub seed: u64,
    pub rel_err: f64,
    pub ok: bool,
}

/// The output dtype of a case (the launch dtype except for eltwise's own).
fn out_dtype(case: &KernelCase, dtype: DType) -> DType {
    case.args.last().and_then(|a| a.dtype).unwrap_or(dtype)
}

/// Runs a case on the CPU reference and on the GPU (with `ctas` persistent CTAs, 0 = default) and
/// compares the outputs.
pub fn check_kernel_case(
    gpu: &mut CudaGpu,
    stream: StreamId,
    case: &KernelCase,
    dtype: DType,
    seed: u64,
    ctas: u32,
) -> Result<CaseResult> {
    let mut rng = Rng::new(seed);
    let bufs: Vec<AlignedBytes> = case.args.iter().map(|a| fill_bytes(a, dtype, &mut rng)).collect();
    let mut cpu = VecMemory(bufs.clone());
    let blocks = case.kernel.logical_blocks();
    run_blocks(&case.kernel, dtype, &mut cpu, 0..blocks);

    let mut allocs = Vec::new();
    for b in &bufs {
        let a = gpu.alloc(b.len().max(1) as u64, MemKind::Device)?;
        gpu.write(a.ptr, b.as_slice())?;
        allocs.push(a);
    }
    let ptrs: Vec<DevicePtr> = allocs.iter().map(|a| a.ptr).collect();
    let shape = LaunchShape { logical_blocks: blocks, threads_per_block: case.threads, shared_mem_bytes: case.smem_bytes };
    let whole = gpu.info().partitions[0].sms;
    let req = LaunchRequest {
        kernel: &case.kernel,
        dtype,
        shape,
        args: &ptrs,
        first_block: 0,
        ctas,
        sm_mask: whole,
        partition: PartitionId::WHOLE,
        stream,
        after: None,
        report_ctas: true,
        report_start: false,
        preemptible: true,
        report_end: true,
        stop_word: None,
    };
    let r = (|| {
        let id = gpu.launch(&req)?;
        let (next, preempted) = gpu.wait_done(id)?;
        if next != blocks || preempted {
            return Err(GpuError::Driver(format!("{} stopped at block {next} of {blocks}", case.name)));
        }
        let mut out = vec![0u8; bufs.last().unwrap().len()];
        gpu.read(*ptrs.last().unwrap(), &mut out)?;
        Ok(out)
    })();
    for a in allocs {
        gpu.free(a)?;
    }
    let out = r?;
    let od = out_dtype(case, dtype);
    let rel_err = relative_l2_error(&to_f32(&out, od), &to_f32(cpu.0.last().unwrap().as_slice(), od));
    Ok(CaseResult { name: case.name.clone(), dtype, seed, rel_err, ok: rel_err <= tolerance(dtype) })
}

/// One zoo model lowered, with its ONNX bytes and inputs.
pub struct ZooModel {
    pub name: String,
    pub onnx: Vec<u8>,
    pub plan: Plan,
    pub inputs: Vec<Tensor>,
}

/// Builds, imports and lowers a zoo model.
pub fn zoo_model(name: &str, dtype: DType, batch: usize, seq_len: usize) -> std::result::Result<ZooModel, String> {
    use kairos_ir::{lower, onnx, zoo};
    let onnx = zoo::build(name, &zoo::ZooOptions { batch, seq_len, seed: zoo::DEFAULT_SEED }).map_err(|e| e.to_string())?;
    let graph = onnx::load_bytes(name, &onnx, &onnx::LoadOptions { batch: Some(batch), seq_len: Some(seq_len) })
        .map_err(|e| e.to_string())?;
    let plan = lower::lower(&graph, &lower::LowerOptions::new(dtype)).map_err(|e| e.to_string())?;
    plan.validate()?;
    let inputs = plan
        .inputs
        .iter()
        .enumerate()
        .map(|(i, t)| synthetic_input(t, 17 + i as u64).cast(if t.dtype == DType::I64 { DType::I64 } else { DType::F32 }))
        .collect();
    Ok(ZooModel { name: name.to_string(), onnx, plan, inputs })
}

/// Runs a plan on the GPU with its weights in device or mapped host memory; returns the outputs.
pub fn run_on_gpu(gpu: &mut CudaGpu, plan: &Plan, inputs: &[Tensor], weights: MemKind) -> Result<Vec<Tensor>> {
    let bufs = PlanBuffers::new(gpu, plan, inputs, weights)?;
    let stream = gpu.utility_stream()?;
    let r = run_plan(gpu, plan, &bufs, stream).and_then(|_| bufs.outputs(gpu, plan));
    bufs.free(gpu)?;
    r
}

/// Relative L2 error over all outputs, as f32.
pub fn outputs_error(actual: &[Tensor], reference: &[Tensor]) -> f64 {
    let a: Vec<f32> = actual.iter().flat_map(|t| t.to_f32_vec()).collect();
    let r: Vec<f32> = reference.iter().flat_map(|t| t.to_f32_vec()).collect();
    if a.len() != r.len() {
        return f64::INFINITY;
    }
    relative_l2_error(&a, &r)
}

/// Default launch options on the whole device ([`CudaGpu::whole_device`]).
/// The measurement programs' common end of `main`: the CUDA backend's settings from the
/// environment (README), GPU 0 opened (exit status 2 without one), `body` run on it (exit status 1
/// with its error), each message prefixed with `program`.
pub fn run_on_gpu0(program: &str, body: impl FnOnce(&mut CudaGpu) -> Result<()>) {
    kairos_cuda::settings::configure_from_env();
    let mut gpu = match CudaGpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("{program}: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = body(&mut gpu) {
        eprintln!("{program} failed: {e}");
        std::process::exit(1);
    }
}

pub fn whole_device(gpu: &CudaGpu, stream: StreamId) -> LaunchOptions {
    gpu.whole_device(stream)
}

/// p-th percentile (0..=1) of a sample: the value at the rounded index p x (n - 1), as
/// `kairos_bench::stats::rounded_index` (this dev-only crate does not link the bench harness).
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Polls until `launch` is done and returns its events (others are dropped).
pub fn launch_events(gpu: &mut CudaGpu, launch: LaunchId) -> Result<Vec<GpuEvent>> {
    let mut mine = Vec::new();
    let mut events = Vec::new();
    let deadline = gpu.now_ns() + 60_000_000_000;
    loop {
        events.clear();
        gpu.poll(&mut events)?;
        for e in &events {
            if launch_of(e) != launch {
                continue;
            }
            mine.push(*e);
            match e {
                GpuEvent::LaunchDone { .. } => return Ok(mine),
                // Its end will never be reported: say so now rather than after the deadline.
                GpuEvent::LaunchLost { .. } => {
                    return Err(GpuError::Driver(format!("launch {}'s notifications were lost (the ring overflowed)", launch.0)));
                }
                _ => {}
            }
        }
        if gpu.now_ns() > deadline {
            return Err(GpuError::Driver(format!("launch {} did not finish within 60 s", launch.0)));
        }
        let now = gpu.now_ns();
        gpu.wait(now + 1_000_000)?;
    }
}

fn launch_of(e: &GpuEvent) -> LaunchId {
    match *e {
        GpuEvent::CtasPlaced { launch, .. }
        | GpuEvent::CtasFinished { launch, .. }
        | GpuEvent::LaunchDone { launch, .. }
        | GpuEvent::LaunchStarted { launch, .. }
        | GpuEvent::LaunchLost { launch, .. } => launch,
        GpuEvent::CopyDone { .. } => LaunchId(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The case list is well formed: the CPU reference runs every case in bounds and writes a
    /// non-trivial output (checked here, without a GPU, so no device time goes to a broken case).
    #[test]
    fn every_case_runs_on_the_cpu_reference() {
        for dtype in [DType::F32, DType::F16] {
            for case in kernel_cases(dtype) {
                assert_eq!(case.args.len(), kairos_kernels::source::arg_count(&case.kernel), "{}", case.name);
                kairos_kernels::source::check_shape(
                    &case.kernel,
                    &LaunchShape {
                        logical_blocks: case.kernel.logical_blocks(),
                        threads_per_block: case.threads,
                        shared_mem_bytes: case.smem_bytes,
                    },
                )
                .unwrap();
                let mut rng = Rng::new(1);
                let bufs: Vec<AlignedBytes> = case.args.iter().map(|a| fill_bytes(a, dtype, &mut rng)).collect();
                let before = bufs.last().unwrap().as_slice().to_vec();
                let mut mem = VecMemory(bufs);
                run_blocks(&case.kernel, dtype, &mut mem, 0..case.kernel.logical_blocks());
                let out = mem.0.last().unwrap().as_slice();
                assert_ne!(out, &before[..], "{} {dtype:?}: the reference wrote nothing", case.name);
                let od = out_dtype(&case, dtype);
                assert!(to_f32(out, od).iter().all(|x| x.is_finite()), "{} {dtype:?}: non-finite output", case.name);
                kairos_kernels::source::pack_args(&case.kernel, &vec![0u64; case.args.len()]).unwrap();
            }
        }
    }
}

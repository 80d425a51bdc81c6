//! Kernel plans: what lowering produces and every backend executes.
//!
//! A plan is a list of kernel launches in a valid order. Each launch names a kernel of kairos'
//! kernel library with its parameters and launch shape, binds its arguments to byte ranges of
//! four memory spaces (the activation arena, the weight blob, the request's inputs and outputs),
//! and lists the earlier launches it must wait for. Those dependencies are complete: they include
//! data flow and the hazards of arena reuse, so any execution order that respects them (the
//! dispatcher's virtual streams, concurrent branches) computes the same result.
//!
//! Every kernel splits its work into *logical blocks*, numbered 0..logical_blocks. Block b always
//! covers the same part of the output, whichever backend runs it, so a preempted launch can resume
//! at any block and the CPU reference can execute exactly the blocks a GPU would.

use crate::graph::{Act, BinaryOp, PoolKind, UnaryOp};
use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The largest rank of the strided element-wise kernel.
pub const ELTWISE_RANK_MAX: usize = 6;
/// Byte alignment of every buffer in the arena and the weight blob.
pub const BUFFER_ALIGN_BYTES: u64 = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Space {
    /// Activations, planned for reuse; one arena per in-flight request.
    Arena,
    /// The model's weights, one blob per model.
    Weights,
    /// A request input, by index.
    Input(u32),
    /// A request output, by index.
    Output(u32),
}

/// A byte range of one memory space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BufRef {
    pub space: Space,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

impl BufRef {
    pub fn end_bytes(&self) -> u64 {
        self.offset_bytes + self.len_bytes
    }

    pub fn overlaps(&self, other: &BufRef) -> bool {
        self.space == other.space && self.offset_bytes < other.end_bytes() && other.offset_bytes < self.end_bytes()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchShape {
    pub logical_blocks: u32,
    pub threads_per_block: u32,
    /// Dynamic shared memory per CTA.
    pub shared_mem_bytes: u32,
}

/// Fused epilogue of convolutions and matrix products: y = act(alpha * acc + bias + residual).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EpilogueParams {
    pub bias: bool,
    pub residual: bool,
    pub act: Act,
}

impl Default for EpilogueParams {
    fn default() -> Self {
        EpilogueParams { bias: false, residual: false, act: Act::None }
    }
}

/// Direct convolution as an implicit GEMM on NHWC activations.
///
/// Pixel (n, h, w) of a tensor starts at element ((n * H + h) * W + w) * pixel_stride of its
/// buffer, channels contiguous: a pixel stride larger than the channel count reads or writes a
/// channel slice of a wider tensor (how concatenations are fused away).
/// Weights are [out_c][kernel_h][kernel_w][in_c / groups] (depthwise: [kernel_h][kernel_w][c]).
/// Args: input, weights, then bias [out_c] if `epilogue.bias`, then residual if `epilogue.residual`, then output.
/// Logical block b covers output rows (pixels) [bm * tile_m, +tile_m) and channels [bn * tile_n, +tile_n),
/// with bm = b / n_tiles and bn = b % n_tiles.
///
/// Split-K (`split_k` > 1, groups 1 only): the reduction (kernel_h * kernel_w * in_c) is cut into
/// `split_k` slices of [`split_k_len`] and logical block b is slice b / (m_tiles * n_tiles) of the
/// tile b % (m_tiles * n_tiles). The output argument is then an f32 workspace
/// [split_k][gemm_m][out_c] of raw partial sums (no bias, residual or activation: the epilogue must
/// be empty), which a [`SplitKSumParams`] launch adds up in slice order and finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Conv2dParams {
    pub batch: u32,
    pub in_h: u32,
    pub in_w: u32,
    pub in_c: u32,
    pub out_h: u32,
    pub out_w: u32,
    pub out_c: u32,
    pub kernel_h: u32,
    pub kernel_w: u32,
    pub stride_h: u32,
    pub stride_w: u32,
    pub pad_h: u32,
    pub pad_w: u32,
    pub dilation_h: u32,
    pub dilation_w: u32,
    pub groups: u32,
    pub in_pixel_stride: u32,
    pub out_pixel_stride: u32,
    pub res_pixel_stride: u32,
    pub epilogue: EpilogueParams,
    pub tile_m: u32,
    pub tile_n: u32,
    /// Slices of the reduction, each its own logical blocks (1: the whole reduction per block).
    #[serde(default = "one")]
    pub split_k: u32,
}

fn one() -> u32 {
    1
}

/// Elements of the reduction one split-K slice covers: K / `split_k` rounded up to a multiple of
/// 32, so every slice but the last starts 16-byte aligned and walks whole pipeline stages.
pub fn split_k_len(k: u32, split_k: u32) -> u32 {
    k.div_ceil(split_k.max(1)).div_ceil(32) * 32
}

impl Conv2dParams {
    pub fn gemm_m(&self) -> u32 {
        self.batch * self.out_h * self.out_w
    }
    /// The length of the reduction: kernel_h * kernel_w * in_c / groups.
    pub fn gemm_k(&self) -> u32 {
        self.kernel_h * self.kernel_w * self.in_c / self.groups.max(1)
    }
    pub fn m_tiles(&self) -> u32 {
        self.gemm_m().div_ceil(self.tile_m)
    }
    pub fn n_tiles(&self) -> u32 {
        self.out_c.div_ceil(self.tile_n)
    }
    pub fn is_depthwise(&self) -> bool {
        self.groups > 1 && self.groups == self.in_c && self.groups == self.out_c
    }
    pub fn flops(&self) -> u64 {
        2 * self.gemm_m() as u64 * self.out_c as u64 * (self.kernel_h * self.kernel_w * self.in_c / self.groups) as u64
    }
}

/// Batched matrix product C = act(alpha * A B + bias + residual) over two batch dimensions.
///
/// Element (b0, b1, i, p) of A is at b0 * a_stride0 + b1 * a_stride1 + i * a_stride_m + p * a_stride_k;
/// B likewise with (k, n) strides; C and the residual have unit column stride. Strides let one
/// kernel read attention heads straight out of [batch, seq, heads, dim] tensors and weights
/// stored [n][k] (b_stride_k = 1).
/// Args: a, b, then bias [n] if `epilogue.bias`, then residual if `epilogue.residual`, then c.
/// Logical block b covers batch bb = b / (m_tiles * n_tiles), rows [bm * tile_m, +tile_m) and columns
/// [bn * tile_n, +tile_n) with the rest r = b % (m_tiles * n_tiles), bm = r / n_tiles, bn = r % n_tiles;
/// bb splits into b0 = bb / batch1, b1 = bb % batch1.
///
/// Split-K (`split_k` > 1): K is cut into `split_k` slices of [`split_k_len`]; logical block b is
/// slice b / (batches * m_tiles * n_tiles) of the block b % (batches * m_tiles * n_tiles) above.
/// The output argument is then an f32 workspace [split_k][batch0 * batch1][m][n] of raw partial
/// sums (alpha 1, no epilogue), which a [`SplitKSumParams`] launch adds up and finishes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmParams {
    pub batch0: u32,
    pub batch1: u32,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub a_stride0: u64,
    pub a_stride1: u64,
    pub a_stride_m: u64,
    pub a_stride_k: u64,
    pub b_stride0: u64,
    pub b_stride1: u64,
    pub b_stride_k: u64,
    pub b_stride_n: u64,
    pub c_stride0: u64,
    pub c_stride1: u64,
    pub c_stride_m: u64,
    pub r_stride0: u64,
    pub r_stride1: u64,
    pub r_stride_m: u64,
    pub alpha: f32,
    pub epilogue: EpilogueParams,
    pub tile_m: u32,
    pub tile_n: u32,
    /// Slices of K, each its own logical blocks (1: all of K per block).
    #[serde(default = "one")]
    pub split_k: u32,
}

impl GemmParams {
    pub fn m_tiles(&self) -> u32 {
        self.m.div_ceil(self.tile_m)
    }
    pub fn n_tiles(&self) -> u32 {
        self.n.div_ceil(self.tile_n)
    }
    pub fn flops(&self) -> u64 {
        2 * (self.batch0 * self.batch1) as u64 * self.m as u64 * self.n as u64 * self.k as u64
    }
}

/// The second half of a split-K product: out = act(alpha * sum_s ws[s] + bias + residual), the
/// slices added in order 0..splits (so the result does not depend on which CTA ran which slice).
///
/// `ws` is the f32 workspace [splits][batch0 * batch1][m][n] a split-K `gemm` or `conv2d` wrote;
/// output element (b0, b1, i, j) is at b0 * c_stride0 + b1 * c_stride1 + i * c_stride_m + j, the
/// residual likewise with its strides (a convolution: one batch, its pixels as rows).
/// Args: ws, then bias [n] if `epilogue.bias`, then residual if `epilogue.residual`, then out.
/// Logical block b covers elements [b * elems_per_block, +elems_per_block) in (batch, i, j) order.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SplitKSumParams {
    pub splits: u32,
    pub batch0: u32,
    pub batch1: u32,
    pub m: u32,
    pub n: u32,
    pub c_stride0: u64,
    pub c_stride1: u64,
    pub c_stride_m: u64,
    pub r_stride0: u64,
    pub r_stride1: u64,
    pub r_stride_m: u64,
    pub alpha: f32,
    pub epilogue: EpilogueParams,
    pub elems_per_block: u32,
}

impl SplitKSumParams {
    /// Output elements (and elements of one workspace slice).
    pub fn elems(&self) -> u64 {
        self.batch0 as u64 * self.batch1 as u64 * self.m as u64 * self.n as u64
    }
}

/// Max or average pooling on NHWC tensors with pixel strides as in [`Conv2dParams`].
/// Args: input, output. Logical block b covers output elements [b * elems_per_block, +elems_per_block)
/// in (n, oh, ow, c) order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pool2dParams {
    pub kind: PoolKindParam,
    pub batch: u32,
    pub in_h: u32,
    pub in_w: u32,
    pub channels: u32,
    pub out_h: u32,
    pub out_w: u32,
    pub kernel_h: u32,
    pub kernel_w: u32,
    pub stride_h: u32,
    pub stride_w: u32,
    pub pad_top: u32,
    pub pad_left: u32,
    pub pad_bottom: u32,
    pub pad_right: u32,
    pub in_pixel_stride: u32,
    pub out_pixel_stride: u32,
    pub elems_per_block: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKindParam {
    Max,
    /// Average with the divisor counting the declared padding.
    AvgIncludePad,
    /// Average over in-bounds elements only.
    AvgExcludePad,
}

impl From<PoolKind> for PoolKindParam {
    fn from(k: PoolKind) -> Self {
        match k {
            PoolKind::Max => PoolKindParam::Max,
            PoolKind::Avg { count_include_pad: true } => PoolKindParam::AvgIncludePad,
            PoolKind::Avg { count_include_pad: false } => PoolKindParam::AvgExcludePad,
        }
    }
}

impl Pool2dParams {
    pub fn out_elems(&self) -> u64 {
        self.batch as u64 * self.out_h as u64 * self.out_w as u64 * self.channels as u64
    }
}

/// Row softmax of softmax(scale * x) over `cols`, rows contiguous.
/// With `causal`, row r (query q = r % causal_rows) keeps keys j <= q + cols - causal_rows; the rest are 0.
/// With `zero_nan`, an output that would be NaN (a row whose every kept key is -inf) is 0.
/// Args: x, y. Logical block b covers rows [b * rows_per_block, +rows_per_block).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SoftmaxParams {
    pub rows: u32,
    pub cols: u32,
    pub scale: f32,
    pub causal: bool,
    pub causal_rows: u32,
    /// Absent in plans written before the flag existed.
    #[serde(default)]
    pub zero_nan: bool,
    pub rows_per_block: u32,
}

/// Layer normalization of rows of `cols` contiguous elements, then y = norm * gamma + beta; with `rms`,
/// norm = x / sqrt(mean(x^2) + eps) (T5's and LLaMA's RMS norm) instead of (x - mean) / sqrt(var + eps).
/// Args: x, gamma, beta, y. Logical block b covers rows [b * rows_per_block, +rows_per_block).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerNormParams {
    pub rows: u32,
    pub cols: u32,
    pub eps: f32,
    /// Root-mean-square normalization: no mean subtracted (absent in plans written before it).
    #[serde(default)]
    pub rms: bool,
    pub rows_per_block: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
    Min,
}

/// Reduction of the middle axis of a contiguous [outer, reduce, inner] tensor to [outer, inner].
/// Args: x, y. Logical block b covers output elements [b * elems_per_block, +elems_per_block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReduceParams {
    pub kind: ReduceKind,
    pub outer: u32,
    pub reduce: u32,
    pub inner: u32,
    pub elems_per_block: u32,
}

/// Embedding lookup: out[i, :] = table[indices[i], :]; indices are i64, negative ones count from the end,
/// out-of-range ones give zero rows (and never read outside the table).
/// Args: table, indices, out. Logical block b covers indices [b * rows_per_block, +rows_per_block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GatherParams {
    pub count: u32,
    pub table_rows: u32,
    pub cols: u32,
    pub rows_per_block: u32,
}

/// What an element-wise kernel computes from inputs i0, i1, i2 and scalars s0, s1, before its activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EltFunc {
    /// y = i0 (with dtype conversion: also layout changes and casts).
    Copy,
    /// y = op(i0).
    Unary(UnaryOpParam),
    /// y = i0 op i1.
    Binary(BinaryOpParam),
    /// y = i0 op s0.
    BinaryScalar(BinaryOpParam),
    /// y = i0 * i1 + i2 (per-channel scale and shift: inference batch norm).
    Affine,
    /// y = i0 != 0 ? i1 : i2.
    Where,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaryOpParam {
    Sqrt,
    Rsqrt,
    Recip,
    Exp,
    Erf,
    Neg,
    Abs,
    Square,
    IsNan,
}

impl UnaryOpParam {
    pub fn from_graph(u: UnaryOp) -> Option<UnaryOpParam> {
        Some(match u {
            UnaryOp::Sqrt => UnaryOpParam::Sqrt,
            UnaryOp::Rsqrt => UnaryOpParam::Rsqrt,
            UnaryOp::Recip => UnaryOpParam::Recip,
            UnaryOp::Exp => UnaryOpParam::Exp,
            UnaryOp::Erf => UnaryOpParam::Erf,
            UnaryOp::Neg => UnaryOpParam::Neg,
            UnaryOp::Abs => UnaryOpParam::Abs,
            UnaryOp::Square => UnaryOpParam::Square,
            UnaryOp::IsNaN => UnaryOpParam::IsNan,
            UnaryOp::Act(_) => return None,
        })
    }
    pub fn to_graph(self) -> UnaryOp {
        match self {
            UnaryOpParam::Sqrt => UnaryOp::Sqrt,
            UnaryOpParam::Rsqrt => UnaryOp::Rsqrt,
            UnaryOpParam::Recip => UnaryOp::Recip,
            UnaryOpParam::Exp => UnaryOp::Exp,
            UnaryOpParam::Erf => UnaryOp::Erf,
            UnaryOpParam::Neg => UnaryOp::Neg,
            UnaryOpParam::Abs => UnaryOp::Abs,
            UnaryOpParam::Square => UnaryOp::Square,
            UnaryOpParam::IsNan => UnaryOp::IsNaN,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BinaryOpParam {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    Equal,
    Less,
    Greater,
}

impl BinaryOpParam {
    pub fn from_graph(b: BinaryOp) -> BinaryOpParam {
        match b {
            BinaryOp::Add => BinaryOpParam::Add,
            BinaryOp::Sub => BinaryOpParam::Sub,
            BinaryOp::Mul => BinaryOpParam::Mul,
            BinaryOp::Div => BinaryOpParam::Div,
            BinaryOp::Pow => BinaryOpParam::Pow,
            BinaryOp::Max => BinaryOpParam::Max,
            BinaryOp::Min => BinaryOpParam::Min,
            BinaryOp::Equal => BinaryOpParam::Equal,
            BinaryOp::Less => BinaryOpParam::Less,
            BinaryOp::Greater => BinaryOpParam::Greater,
        }
    }
    pub fn to_graph(self) -> BinaryOp {
        match self {
            BinaryOpParam::Add => BinaryOp::Add,
            BinaryOpParam::Sub => BinaryOp::Sub,
            BinaryOpParam::Mul => BinaryOp::Mul,
            BinaryOpParam::Div => BinaryOp::Div,
            BinaryOpParam::Pow => BinaryOp::Pow,
            BinaryOpParam::Max => BinaryOp::Max,
            BinaryOpParam::Min => BinaryOp::Min,
            BinaryOpParam::Equal => BinaryOp::Equal,
            BinaryOpParam::Less => BinaryOp::Less,
            BinaryOpParam::Greater => BinaryOp::Greater,
        }
    }
}

/// Strided element-wise kernel over a shape of rank <= 6 (leading dims padded with 1).
///
/// Output element at coordinate c is written at sum(c[d] * out_strides[d]) of the output buffer;
/// input j is read at sum(c[d] * in_strides[j][d]) (stride 0 broadcasts). The output is computed in
/// f32, then `act`, then stored as `out_dtype`.
/// Args: the `inputs` inputs, then output. Logical block b covers output elements
/// [b * elems_per_block, +elems_per_block) in row-major order of `shape`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EltwiseParams {
    pub func: EltFunc,
    pub act: Act,
    pub inputs: u32,
    pub shape: [u32; ELTWISE_RANK_MAX],
    pub out_strides: [u64; ELTWISE_RANK_MAX],
    pub in_strides: [[u64; ELTWISE_RANK_MAX]; 3],
    pub in_dtypes: [DType; 3],
    pub out_dtype: DType,
    pub scalars: [f32; 2],
    pub elems_per_block: u32,
}

impl EltwiseParams {
    pub fn elems(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// Why a launch does not suit its kernel's GPU code (checked by `kairos_kernels::source` before
/// anything reaches a GPU): a plan that a lowering got wrong, never outside input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("kernel {kernel} has no {dtype} variant (launch dtype must be f32 or f16)")]
    NoVariant { kernel: &'static str, dtype: crate::tensor::DType },
    #[error("kernel {kernel} takes 32..={threads_max} threads per block in whole warps, the launch asks for {threads}")]
    Threads { kernel: &'static str, threads_max: u32, threads: u32 },
    #[error("kernel {kernel} launches with at most {max_bytes} bytes of dynamic shared memory, the launch asks for {bytes}")]
    SharedMemory { kernel: &'static str, max_bytes: u32, bytes: u32 },
    #[error("kernel {kernel} has {expected} logical blocks, the launch says {got}")]
    LogicalBlocks { kernel: &'static str, expected: u32, got: u32 },
    #[error("kernel {kernel} takes {expected} arguments, got {got}")]
    Arguments { kernel: &'static str, expected: usize, got: usize },
    #[error("kernel {kernel} takes at most {max} inputs, the plan gives {got}")]
    Inputs { kernel: &'static str, max: usize, got: usize },
    #[error("the parameter block of {kernel} outgrows {max_bytes} bytes")]
    ParamBlockOverflow { kernel: &'static str, max_bytes: usize },
    #[error("the parameter block of {kernel} is {bytes} bytes, the CUDA struct has {expected}")]
    ParamBlock { kernel: &'static str, bytes: usize, expected: usize },
}

/// The kernels of kairos' library, with their parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kernel", rename_all = "snake_case")]
pub enum Kernel {
    Conv2d(Conv2dParams),
    #[serde(rename = "dwconv2d")]
    DepthwiseConv2d(Conv2dParams),
    Gemm(GemmParams),
    Pool2d(Pool2dParams),
    Softmax(SoftmaxParams),
    #[serde(rename = "layernorm")]
    LayerNorm(LayerNormParams),
    Reduce(ReduceParams),
    Gather(GatherParams),
    Eltwise(EltwiseParams),
    #[serde(rename = "splitk_sum")]
    SplitKSum(SplitKSumParams),
}

impl Kernel {
    /// The kernel's name in the library (the CUDA function is `<name>_<dtype>`).
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Conv2d(_) => "conv2d",
            Kernel::DepthwiseConv2d(_) => "dwconv2d",
            Kernel::Gemm(_) => "gemm",
            Kernel::Pool2d(_) => "pool2d",
            Kernel::Softmax(_) => "softmax",
            Kernel::LayerNorm(_) => "layernorm",
            Kernel::Reduce(_) => "reduce",
            Kernel::Gather(_) => "gather",
            Kernel::Eltwise(_) => "eltwise",
            Kernel::SplitKSum(_) => "splitk_sum",
        }
    }

    pub const NAMES: [&'static str; 10] =
        ["conv2d", "dwconv2d", "gemm", "pool2d", "softmax", "layernorm", "reduce", "gather", "eltwise", "splitk_sum"];

    pub fn logical_blocks(&self) -> u32 {
        match self {
            Kernel::Conv2d(p) => p.split_k * p.m_tiles() * p.n_tiles(),
            Kernel::DepthwiseConv2d(p) => p.m_tiles() * p.n_tiles(),
            Kernel::Gemm(p) => p.split_k * p.batch0 * p.batch1 * p.m_tiles() * p.n_tiles(),
            Kernel::Pool2d(p) => p.out_elems().div_ceil(p.elems_per_block as u64) as u32,
            Kernel::Softmax(p) => p.rows.div_ceil(p.rows_per_block),
            Kernel::LayerNorm(p) => p.rows.div_ceil(p.rows_per_block),
            Kernel::Reduce(p) => ((p.outer as u64 * p.inner as u64).div_ceil(p.elems_per_block as u64)) as u32,
            Kernel::Gather(p) => p.count.div_ceil(p.rows_per_block),
            Kernel::Eltwise(p) => p.elems().div_ceil(p.elems_per_block as u64) as u32,
            Kernel::SplitKSum(p) => p.elems().div_ceil(p.elems_per_block as u64) as u32,
        }
    }

    /// Split-K's rules: at least one slice, every slice non-empty, no epilogue on a split product
    /// (its sum kernel applies it), no split of a grouped convolution, at least one slice summed.
    pub fn check_split_k(&self) -> Result<(), String> {
        let (split, k, ep, alpha) = match self {
            Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => {
                if p.split_k > 1 && p.groups != 1 {
                    return Err(format!("split_k {} on a convolution of {} groups", p.split_k, p.groups));
                }
                (p.split_k, p.gemm_k(), p.epilogue, 1.0)
            }
            Kernel::Gemm(p) => (p.split_k, p.k, p.epilogue, p.alpha),
            Kernel::SplitKSum(p) if p.splits == 0 => return Err("splitk_sum of no slices".into()),
            _ => return Ok(()),
        };
        if split == 0 {
            return Err("split_k 0 (1 means no split)".into());
        }
        if split > 1 {
            if (split - 1) * split_k_len(k, split) >= k {
                return Err(format!("split_k {split} leaves slices of K = {k} empty"));
            }
            if ep != EpilogueParams::default() || alpha != 1.0 {
                return Err(format!("split_k {split} with an epilogue (the sum kernel applies it)"));
            }
        }
        Ok(())
    }

    /// The partial-sum half of this product cut into `splits` K slices: the same conv2d or gemm with
    /// `split_k` set and its epilogue (and alpha) left to the splitk_sum that follows. Other
    /// kernels come back unchanged.
    pub fn split_k_partials(&self, splits: u32) -> Kernel {
        let mut k = *self;
        match &mut k {
            Kernel::Conv2d(p) => (p.split_k, p.epilogue) = (splits, EpilogueParams::default()),
            Kernel::Gemm(p) => (p.split_k, p.alpha, p.epilogue) = (splits, 1.0, EpilogueParams::default()),
            _ => {}
        }
        k
    }

    /// Whether the kernel writes split-K partial sums (its output is an f32 workspace).
    pub fn is_split_k(&self) -> bool {
        match self {
            Kernel::Conv2d(p) => p.split_k > 1,
            Kernel::Gemm(p) => p.split_k > 1,
            _ => false,
        }
    }

    /// Bytes a kernel must move through device memory at least once (each input read once, each
    /// output written once), for rooflines and the simulator. `dtype` is the launch's float type.
    pub fn bytes_moved(&self, dtype: DType) -> u64 {
        let e = dtype.size_bytes() as u64;
        match self {
            Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => {
                let input = p.batch as u64 * p.in_h as u64 * p.in_w as u64 * p.in_c as u64;
                let weights = p.out_c as u64 * (p.kernel_h * p.kernel_w * p.in_c / p.groups) as u64;
                let out = p.gemm_m() as u64 * p.out_c as u64;
                let extra = if p.epilogue.residual { out } else { 0 } + if p.epilogue.bias { p.out_c as u64 } else { 0 };
                if p.split_k > 1 {
                    return (input + weights) * e + p.split_k as u64 * out * 4;
                }
                (input + weights + out + extra) * e
            }
            Kernel::Gemm(p) => {
                let batch = (p.batch0 * p.batch1) as u64;
                // Weights shared across the batch (stride 0) are read once.
                let a = if p.a_stride0 == 0 && p.a_stride1 == 0 { 1 } else { batch } * p.m as u64 * p.k as u64;
                let b = if p.b_stride0 == 0 && p.b_stride1 == 0 { 1 } else { batch } * p.k as u64 * p.n as u64;
                let c = batch * p.m as u64 * p.n as u64;
                let extra = if p.epilogue.residual { c } else { 0 } + if p.epilogue.bias { p.n as u64 } else { 0 };
                if p.split_k > 1 {
                    return (a + b) * e + p.split_k as u64 * c * 4;
                }
                (a + b + c + extra) * e
            }
            Kernel::Pool2d(p) => (p.batch as u64 * p.in_h as u64 * p.in_w as u64 * p.channels as u64 + p.out_elems()) * e,
            Kernel::Softmax(p) => 2 * p.rows as u64 * p.cols as u64 * e,
            Kernel::LayerNorm(p) => (2 * p.rows as u64 * p.cols as u64 + 2 * p.cols as u64) * e,
            Kernel::Reduce(p) => (p.outer as u64 * p.reduce as u64 * p.inner as u64 + p.outer as u64 * p.inner as u64) * e,
            Kernel::Gather(p) => p.count as u64 * (8 + 2 * p.cols as u64 * e),
            Kernel::Eltwise(p) => {
                let n = p.elems();
                let ins: u64 = (0..p.inputs as usize)
                    .map(|j| {
                        // A broadcast input (some stride 0) is read about once per distinct element; count the
                        // product of the dims it does not broadcast over.
                        let distinct: u64 =
                            (0..ELTWISE_RANK_MAX).filter(|&d| p.in_strides[j][d] != 0).map(|d| p.shape[d] as u64).product();
                        distinct * p.in_dtypes[j].size_bytes() as u64
                    })
                    .sum();
                ins + n * p.out_dtype.size_bytes() as u64
            }
            Kernel::SplitKSum(p) => {
                let n = p.elems();
                let extra = if p.epilogue.residual { n } else { 0 } + if p.epilogue.bias { p.n as u64 } else { 0 };
                p.splits as u64 * n * 4 + (n + extra) * e
            }
        }
    }

    /// Floating-point operations (multiply-adds count 2), for rooflines and reports.
    pub fn flops(&self) -> u64 {
        match self {
            Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => p.flops(),
            Kernel::Gemm(p) => p.flops(),
            Kernel::Pool2d(p) => p.out_elems() * (p.kernel_h * p.kernel_w) as u64,
            Kernel::Softmax(p) => 5 * p.rows as u64 * p.cols as u64,
            Kernel::LayerNorm(p) => 8 * p.rows as u64 * p.cols as u64,
            Kernel::Reduce(p) => p.outer as u64 * p.reduce as u64 * p.inner as u64,
            Kernel::Gather(_) => 0,
            Kernel::Eltwise(p) => p.elems() * 2,
            Kernel::SplitKSum(p) => p.elems() * (p.splits as u64 + 2),
        }
    }
}

/// One kernel launch of a plan.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Launch {
    /// The graph node(s) this launch implements, for people reading plans and profiles.
    pub name: String,
    pub kernel: Kernel,
    /// Element type of the kernel's float tensors (an eltwise kernel says its own per argument).
    pub dtype: DType,
    pub shape: LaunchShape,
    pub args: Vec<BufRef>,
    /// Indices of earlier launches that must finish first (data flow and arena-reuse hazards).
    pub deps: Vec<u32>,
    /// The weight layer this launch reads, if any.
    pub layer: Option<u32>,
    pub flops: u64,
    /// Bytes read and written, at least once each: the memory side of a roofline.
    pub bytes: u64,
}

/// The weights of one launch, a contiguous range of the weight blob: the unit cold starts move.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Layer {
    pub name: String,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IoTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl IoTensor {
    pub fn len_bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size_bytes() as u64
    }
}

/// Bytes with 16-byte alignment (element views of any dtype are aligned).
#[derive(Clone, Default)]
pub struct AlignedBytes {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBytes {
    pub fn zeroed(len: usize) -> AlignedBytes {
        AlignedBytes { words: vec![0; len.div_ceil(16)], len }
    }
    pub fn from_slice(bytes: &[u8]) -> AlignedBytes {
        let mut a = AlignedBytes::zeroed(bytes.len());
        a.as_mut_slice().copy_from_slice(bytes);
        a
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}

/// A model lowered to kernels.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    pub model: String,
    /// Element type of activations and weights (accumulation is always f32).
    pub dtype: DType,
    pub inputs: Vec<IoTensor>,
    pub outputs: Vec<IoTensor>,
    pub launches: Vec<Launch>,
    /// Peak activation memory of one request.
    pub arena_bytes: u64,
    pub weight_bytes: u64,
    pub layers: Vec<Layer>,
    #[serde(skip)]
    pub weights: Arc<AlignedBytes>,
}

impl Plan {
    pub fn flops(&self) -> u64 {
        self.launches.iter().map(|l| l.flops).sum()
    }

    /// Whether every launch may run again whole after it stopped part-way with the same result:
    /// none reads memory it writes (a launch writes its last argument, and only that). What a
    /// recorded run stopped between kernels relies on ([`crate::plan`] users: the dispatcher's
    /// stoppable segments).
    pub fn launches_rerunnable(&self) -> bool {
        self.launches.iter().all(|l| match l.args.split_last() {
            Some((out, inputs)) => inputs.iter().all(|a| !a.overlaps(out)),
            None => true,
        })
    }

    /// Kernel names with their launch counts, most frequent first.
    pub fn kernel_histogram(&self) -> Vec<(&'static str, usize)> {
        let mut h: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for l in &self.launches {
            *h.entry(l.kernel.name()).or_default() += 1;
        }
        let mut v: Vec<_> = h.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }

    /// Checks the plan's invariants: arguments inside their spaces, dependencies pointing backwards,
    /// launch shapes matching the kernels' logical blocks, weight layers inside the blob.
    pub fn validate(&self) -> Result<(), String> {
        for (i, l) in self.launches.iter().enumerate() {
            if l.shape.logical_blocks != l.kernel.logical_blocks() {
                return Err(format!(
                    "launch {i} ({}) has {} logical blocks, its kernel needs {}",
                    l.name,
                    l.shape.logical_blocks,
                    l.kernel.logical_blocks()
                ));
            }
            if l.shape.logical_blocks == 0 {
                return Err(format!("launch {i} ({}) has no work", l.name));
            }
            l.kernel.check_split_k().map_err(|e| format!("launch {i} ({}): {e}", l.name))?;
            for d in &l.deps {
                if *d as usize >= i {
                    return Err(format!("launch {i} ({}) depends on launch {d} that does not precede it", l.name));
                }
            }
            for a in &l.args {
                let limit = match a.space {
                    Space::Arena => self.arena_bytes,
                    Space::Weights => self.weight_bytes,
                    Space::Input(k) => {
                        self.inputs.get(k as usize).map(|t| t.len_bytes()).ok_or(format!("launch {i} reads input {k}"))?
                    }
                    Space::Output(k) => {
                        self.outputs.get(k as usize).map(|t| t.len_bytes()).ok_or(format!("launch {i} writes output {k}"))?
                    }
                };
                if a.end_bytes() > limit {
                    return Err(format!("launch {i} ({}) argument {a:?} exceeds its space of {limit} bytes", l.name));
                }
            }
            if let Some(layer) = l.layer
                && layer as usize >= self.layers.len()
            {
                return Err(format!("launch {i} names layer {layer} of {}", self.layers.len()));
            }
        }
        for layer in &self.layers {
            if layer.offset_bytes + layer.len_bytes > self.weight_bytes {
                return Err(format!("layer {} exceeds the weight blob", layer.name));
            }
        }
        if self.weights.len() as u64 != self.weight_bytes {
            return Err(format!("weight blob holds {} bytes, plan says {}", self.weights.len(), self.weight_bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_k_slices_cover_k_and_are_checked() {
        assert_eq!(split_k_len(4608, 4), 1152);
        assert_eq!(split_k_len(296, 4), 96);
        assert_eq!(split_k_len(100, 1), 128);
        let mut p = GemmParams {
            batch0: 1,
            batch1: 1,
            m: 64,
            n: 64,
            k: 1000,
            a_stride0: 0,
            a_stride1: 0,
            a_stride_m: 1000,
            a_stride_k: 1,
            b_stride0: 0,
            b_stride1: 0,
            b_stride_k: 1,
            b_stride_n: 1000,
            c_stride0: 0,
            c_stride1: 0,
            c_stride_m: 64,
            r_stride0: 0,
            r_stride1: 0,
            r_stride_m: 0,
            alpha: 1.0,
            epilogue: EpilogueParams::default(),
            tile_m: 32,
            tile_n: 32,
            split_k: 1,
        };
        for (split, ok) in [(1, true), (3, true), (0, false), (40, false)] {
            p.split_k = split;
            assert_eq!(Kernel::Gemm(p).check_split_k().is_ok(), ok, "split_k {split}");
        }
        p.split_k = 2;
        p.epilogue.bias = true;
        assert!(Kernel::Gemm(p).check_split_k().is_err(), "a split product with an epilogue");
        assert_eq!(Kernel::Gemm(p).logical_blocks(), 2 * p.m_tiles() * p.n_tiles());
    }
}

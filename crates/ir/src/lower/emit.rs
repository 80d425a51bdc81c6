//! From an optimized graph to a kernel plan.
//!
//! Every value of the graph becomes a *view*: a buffer, an element offset, a logical shape and
//! strides. Reshapes, transposes, slices and broadcasts are views of their input (no kernel);
//! concatenations are views of one buffer whose producers write their slices in place; kernels
//! state which views they can read and write, and a copy kernel bridges the rest. The physical
//! layout of a buffer is a choice per tensor: NHWC for images, row-major for the rest, or the
//! order its only transposing consumer wants (attention heads).
//!
//! After emission the weight blob is laid out in launch order (one layer per launch), arena
//! buffers get offsets by interval packing over their live ranges, and each launch records the
//! launches it waits for: producers of what it reads, and every earlier user of arena memory it
//! reuses.

use crate::Error;
use crate::graph::*;
use crate::plan::*;
use crate::tensor::{DType, Tensor, element_count};
use std::collections::{BTreeSet, HashMap};

/// Tile of the implicit-GEMM convolution and the matrix product (rows, columns) in f32 (the SIMT
/// engine); fp16 chooses per shape ([`tile_for`]), direct convolutions by channels
/// ([`direct_conv_tile`]).
const GEMM_TILE: (u32, u32) = (64, 64);
/// fp16 tiles of the tensor-core engine, preferred first (larger tiles reuse more of each
/// operand), with the CTA size each ran best at on the H200 (256 threads let the engine split
/// K between warp pairs of a 64 x 64 or 32 x 64 tile).
const TC_TILES: [(u32, u32, u32); 10] = [
    (128, 128, 256),
    (128, 64, 256),
    (64, 128, 256),
    (64, 64, 256),
    (64, 32, 128),
    (32, 64, 256),
    (32, 32, 128),
    (16, 64, 128),
    (16, 32, 128),
    (16, 16, 128),
];
/// Logical blocks a matrix product should have to keep a whole GPU busy (about 1.5 per SM of the
/// H100 SXM and H200, 132 SMs; 192 blocks): below it, smaller tiles leave fewer SMs idle at batch 1. The
/// H200's autotuner picked tiles giving 192 to 416 blocks for most ResNet-50, VGG-19 and BERT shapes.
const TILE_BLOCKS_TARGET: u32 = 192;

/// Products of at most this many rows (per batch) get tiles of this many rows. Where B's k is
/// contiguous (weights stored [n][k]) they run on the engine's small-M path (tile.cuh:
/// `tile_gemv`: every logical block streams its columns of B along K; VGG-19's fc1 on the H200
/// went from 237 to 64 us). Where it is not (the zoo's N = 1000 classifiers store weights
/// [k][n]) they run on the mma path, where these narrow tiles measured slower than the 16 x 16
/// of before (resnet50's fc 37 -> 49 us); the autotuner also tries the larger tiles.
pub const SMALL_M_ROWS: u32 = 8;
/// Columns per logical block of a small-M product, preferred first: each block streams
/// tile_n x K weights, so fewer columns give more blocks to spread the weight traffic over SMs.
const SMALL_M_TILE_N: [u32; 5] = [64, 32, 16, 8, 4];
/// Logical blocks a small-M product should have so every SM streams weights (about 3 per SM of
/// the H100/H200's 132; the 4 CTAs of 128 threads an SM holds keep enough 16-byte loads in flight).
const SMALL_M_BLOCKS_TARGET: u32 = 384;

/// Folds a matrix product's innermost batch dims into its rows while the right operand (index 1
/// of each stride list) is shared across them (batch stride 0) and every other operand's rows
/// continue across the dim: its batch stride is `m` rows (or `m` is 1, so the batch stride becomes
/// the row stride). `dims` are the merged batch dims, innermost last, each (size, strides per
/// operand: left, right, output, residual); `row_strides` the operands' row strides (the right
/// operand's unused). The product is the same; the weight is read once per tile of rows instead
/// of once per batch.
pub fn fold_shared_rhs_batches(dims: &mut Vec<(usize, Vec<usize>)>, m: &mut usize, row_strides: &mut [usize]) {
    while let Some((size, strides)) = dims.last() {
        let rows_continue = strides
            .iter()
            .zip(row_strides.iter())
            .enumerate()
            .all(|(i, (&batch, &row))| if i == 1 { batch == 0 } else { *m == 1 || batch == *m * row });
        if !rows_continue {
            break;
        }
        if *m == 1 {
            for (i, row) in row_strides.iter_mut().enumerate() {
                if i != 1 {
                    *row = strides[i];
                }
            }
        }
        *m *= size;
        dims.pop();
    }
}

/// Into how many equal chunks a reduction of `outputs` results over an axis of `len` elements
/// (`inner` apart) is cut, 1 for one launch. The reduce kernel gives an output one thread (a warp
/// when the axis is contiguous, `inner` = 1; a group of the CTA's threads when a logical block has
/// few outputs), which walks the axis serially: global average pooling of EfficientNet's 112x112x32
/// activation, 32 outputs, kept one CTA busy for 2 ms on an H200. Cut, a first launch reduces each
/// chunk (`outputs` x chunks results, each over `len / chunks` elements) and a second the chunks'
/// results: the same kind of reduction, exact for a mean too since the chunks are equal. The chunk
/// count divides `len`; none that leaves chunks of [`REDUCE_CHUNK_LEN_MIN`] elements and more
/// than 3 of them: one launch.
pub fn reduce_chunks(outputs: usize, len: usize, inner: usize) -> usize {
    let per_block = reduce_elems_per_block(outputs) as usize;
    let per_output = if inner == 1 { 32 } else { (THREADS as usize / per_block).max(1) };
    let serial = len.div_ceil(per_output);
    if serial <= REDUCE_SERIAL_MAX || outputs.div_ceil(per_block) >= REDUCE_SPLIT_BLOCKS_MAX {
        return 1;
    }
    let most = (REDUCE_SPLIT_OUTPUTS / outputs.max(1)).min(len / REDUCE_CHUNK_LEN_MIN);
    let chunks = (1..=most).rev().find(|c| len.is_multiple_of(*c)).unwrap_or(1);
    if chunks < 4 { 1 } else { chunks }
}

/// Outputs per logical block of a reduction of `outputs` results: the largest power of two from 8
/// to [`REDUCE_ELEMS_PER_BLOCK`] that still gives [`REDUCE_BLOCKS_TARGET`] blocks, so that few
/// outputs spread over many CTAs, and inside each over groups of threads (the reduce kernel splits
/// an output's axis among 256 / outputs-per-block threads; a warp each when the axis is contiguous).
pub fn reduce_elems_per_block(outputs: usize) -> u32 {
    let mut per_block = REDUCE_ELEMS_PER_BLOCK;
    while per_block > 8 && outputs.div_ceil(per_block as usize) < REDUCE_BLOCKS_TARGET {
        per_block /= 2;
    }
    per_block
}

/// Tile (pixels, channels) of the direct convolutions, grouped and depthwise: one output per
/// thread of a [`THREADS`] CTA, output channels fastest (32 or 64 of them, whichever divides
/// `out_c`; all of them below 32), so that a layer has many logical blocks. Tiles of 4096 and 2048
/// outputs gave ResNeXt-50's last grouped 3x3 convolution 16 blocks (267 µs on an H200) and
/// ConvNeXt's 7x7 depthwise ones 196 blocks of 8 outputs a thread (61 µs).
pub fn direct_conv_tile(out_c: usize) -> (u32, u32) {
    let tile_n = if out_c < 32 {
        out_c.max(1) as u32
    } else if !out_c.is_multiple_of(64) && out_c.is_multiple_of(32) {
        32
    } else {
        64
    };
    ((THREADS / tile_n).max(1), tile_n)
}

/// The tile (rows, columns) of a convolution or matrix product with `batches` independent
/// products of m x n outputs. f32: the fixed SIMT tile. fp16 with m at most [`SMALL_M_ROWS`]:
/// [`SMALL_M_ROWS`] rows and the widest of [`SMALL_M_TILE_N`] giving [`SMALL_M_BLOCKS_TARGET`]
/// logical blocks (else the narrowest). Other fp16 products: the first of [`TC_TILES`] that
/// gives at least [`TILE_BLOCKS_TARGET`] logical blocks, skipping tiles more than 16 past the
/// problem in either dimension; when none does, the one with the most blocks. Any tile up to
/// TILE_MAX is correct; this only picks a fast default (the CUDA backend's autotuner refines it).
pub fn tile_for(dtype: DType, batches: u32, m: u32, n: u32) -> (u32, u32) {
    if dtype != DType::F16 {
        return GEMM_TILE;
    }
    if m <= SMALL_M_ROWS {
        let blocks = |tn: u32| batches.max(1) * n.div_ceil(tn);
        let tn = SMALL_M_TILE_N
            .iter()
            .copied()
            .find(|&tn| blocks(tn) >= SMALL_M_BLOCKS_TARGET)
            .unwrap_or(SMALL_M_TILE_N[SMALL_M_TILE_N.len() - 1]);
        return (SMALL_M_ROWS, tn);
    }
    let round16 = |x: u32| x.max(1).div_ceil(16) * 16;
    let fits = |t: &&(u32, u32, u32)| t.0 <= round16(m) && t.1 <= round16(n);
    let blocks = |t: &(u32, u32, u32)| batches.max(1) * m.div_ceil(t.0) * n.div_ceil(t.1);
    let t = TC_TILES
        .iter()
        .filter(fits)
        .find(|t| blocks(t) >= TILE_BLOCKS_TARGET)
        .or_else(|| TC_TILES.iter().filter(fits).rev().max_by_key(|t| blocks(t)))
        .unwrap_or(&TC_TILES[TC_TILES.len() - 1]);
    (t.0, t.1)
}

/// Split-K: a reduction this long or longer is cut into slices of about this many elements (four
/// 256-deep pipeline stages), so no logical block walks a long chain of dependent stages alone
/// (what bounds the small tiles of VGG's and ResNet's late 3x3 convolutions, K = 4608, and BERT's
/// second feed-forward product, K = 3072, at batch 1).
pub const SPLIT_K_SLICE: u32 = 1024;
/// Most slices of one product, and most logical blocks the slices may bring it to (about two
/// waves of the 128-thread CTAs an H100/H200 holds at once).
pub const SPLIT_K_MAX: u32 = 8;
const SPLIT_K_BLOCKS_MAX: u32 = 1024;
/// Elements one CTA of the split-K sum finishes.
const SPLIT_K_SUM_ELEMS_PER_BLOCK: u32 = 1024;

/// The split-K slices of an fp16 product with `blocks` logical blocks (its tiles) of `m` rows per
/// batch and reduction length `k`: K / [`SPLIT_K_SLICE`] slices, at most [`SPLIT_K_MAX`] and
/// at most what keeps the launch within [`SPLIT_K_BLOCKS_MAX`] blocks; 1 (no split) for f32 (the
/// SIMT engine is bound by arithmetic, not by the chain), for small-M products (their path
/// streams the weights and is bound by memory) and where fewer than 2 slices would result.
pub fn split_k_for(dtype: DType, blocks: u32, m: u32, k: u32) -> u32 {
    if dtype != DType::F16 || m <= SMALL_M_ROWS || blocks == 0 {
        return 1;
    }
    let s = (k / SPLIT_K_SLICE).min(SPLIT_K_MAX).min(SPLIT_K_BLOCKS_MAX / blocks);
    // Every slice must hold some of K (split_k_len rounds slices up to 32).
    let mut s = s.max(1);
    while s > 1 && (s - 1) * split_k_len(k, s) >= k {
        s -= 1;
    }
    s
}

/// Threads per CTA of a launch: the tensor-core engine's choice for fp16 convolutions and
/// matrix products (as listed in [`TC_TILES`]; other tiles: 256 from 128 x 64 outputs up, else 128),
/// [`THREADS`] otherwise.
pub fn threads_for(kernel: &Kernel, dtype: DType) -> u32 {
    let tile = match kernel {
        Kernel::Conv2d(p) if p.groups == 1 => (p.tile_m, p.tile_n),
        Kernel::Gemm(p) => (p.tile_m, p.tile_n),
        Kernel::Gather(_) => return 128,
        _ => return THREADS,
    };
    if dtype != DType::F16 {
        return THREADS;
    }
    TC_TILES.iter().find(|t| (t.0, t.1) == tile).map_or(if tile.0 * tile.1 >= 128 * 64 { 256 } else { 128 }, |t| t.2)
}
/// Dynamic shared memory of an fp16 convolution or matrix product on the tensor-core engine, by
/// CTA size: as much as keeps the CTAs per SM that registers allow on an H100/H200 (228 KiB per
/// SM, 1 KiB reserved per CTA; 128 registers per thread), so the operand pipeline is as deep as
/// occupancy permits: 40 KiB (the engine's minimum) for 64 threads, 52 KiB for 128 (4 CTAs per
/// SM), 104 KiB for 256 (2 CTAs per SM). 0 for every other kernel.
pub fn smem_for(kernel: &Kernel, dtype: DType, threads: u32) -> u32 {
    let tensor_cores = match kernel {
        Kernel::Conv2d(p) => p.groups == 1,
        Kernel::Gemm(_) => true,
        _ => false,
    };
    if dtype != DType::F16 || !tensor_cores {
        return 0;
    }
    match threads {
        0..=64 => 40 * 1024,
        65..=128 => 52 * 1024,
        _ => 104 * 1024,
    }
}

const ELTWISE_ELEMS_PER_BLOCK: u32 = 1024;
const POOL_ELEMS_PER_BLOCK: u32 = 256;
const REDUCE_ELEMS_PER_BLOCK: u32 = 256;
/// Logical blocks a reduction should have (about one per SM of an H100/H200): below it, fewer
/// outputs per block (`reduce_elems_per_block`).
const REDUCE_BLOCKS_TARGET: usize = 128;
/// A reduction whose threads would each walk more than this many elements of the axis in one
/// launch goes in two (`reduce_chunks`), unless it already fills this many logical blocks.
const REDUCE_SERIAL_MAX: usize = 64;
const REDUCE_SPLIT_BLOCKS_MAX: usize = 64;
/// The first of the two launches: each chunk at least this long, at most about this many outputs.
const REDUCE_CHUNK_LEN_MIN: usize = 32;
const REDUCE_SPLIT_OUTPUTS: usize = 64 * REDUCE_ELEMS_PER_BLOCK as usize;
const THREADS: u32 = 256;
/// Rows per logical block of the row kernels (softmax, layer norm): one per warp of a THREADS CTA.
/// (With one row per block, 7 of a CTA's 8 warps idled and every row cost a take: BERT-base's
/// batch-8 softmax took 35 µs on an H200.)
const ROWS_PER_BLOCK: u32 = THREADS / 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum BufKind {
    Arena,
    Weights(usize),
    Input(u32),
    Output(u32),
}

#[derive(Clone, Debug)]
struct Buf {
    kind: BufKind,
    elems: usize,
    dtype: DType,
    first_write: Option<u32>,
    last_access: Option<u32>,
    accessors: Vec<u32>,
}

/// A strided window onto a buffer, in elements.
#[derive(Clone, Debug, PartialEq)]
struct View {
    buf: usize,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
    dtype: DType,
    /// Launches that wrote the elements this view covers.
    writers: Vec<u32>,
}

impl View {
    fn same_place(&self, other: &View) -> bool {
        self.buf == other.buf && self.offset == other.offset && self.shape == other.shape && self.strides == other.strides
    }

    /// One past the last element it touches.
    fn extent(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        1 + self.shape.iter().zip(&self.strides).map(|(d, s)| (d - 1) * s).sum::<usize>()
    }

    fn is_contiguous(&self) -> bool {
        let c = strides_of(&self.shape);
        self.shape.iter().zip(self.strides.iter().zip(&c)).all(|(&d, (s, c))| d == 1 || s == c)
    }

    /// Pixel stride of a 4-D NCHW-logical view laid out NHWC with contiguous channels.
    fn nhwc_pixel_stride(&self) -> Option<usize> {
        if self.shape.len() != 4 {
            return None;
        }
        let (n, c, h, w) = (self.shape[0], self.shape[1], self.shape[2], self.shape[3]);
        let s = &self.strides;
        if c > 1 && s[1] != 1 {
            return None;
        }
        let ps = if w > 1 {
            s[3]
        } else if h > 1 {
            s[2]
        } else if n > 1 {
            s[0]
        } else {
            c
        };
        let ok = ps >= c && (w == 1 || s[3] == ps) && (h == 1 || s[2] == w * ps) && (n == 1 || s[0] == h * w * ps);
        ok.then_some(ps)
    }

    fn permute(&self, perm: &[usize]) -> View {
        View {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            ..self.clone()
        }
    }

    /// The view restricted to [start, start + len) along `axis`.
    fn narrow(&self, axis: usize, start: usize, len: usize) -> View {
        let mut v = self.clone();
        v.offset += start * self.strides[axis];
        v.shape[axis] = len;
        v
    }

    /// The view broadcast to `shape` (numpy rules; broadcast dims get stride 0).
    fn broadcast_to(&self, shape: &[usize]) -> View {
        let off = shape.len() - self.shape.len();
        let strides = (0..shape.len())
            .map(|i| if i < off || (self.shape[i - off] == 1 && shape[i] != 1) { 0 } else { self.strides[i - off] })
            .collect();
        View { shape: shape.to_vec(), strides, ..self.clone() }
    }

    /// The same elements under a new shape, when the layout allows it without a copy.
    fn reshape(&self, new_shape: &[usize]) -> Option<View> {
        // Drop size-1 dims, then match groups of old dims to groups of new dims.
        let old: Vec<(usize, usize)> =
            self.shape.iter().copied().zip(self.strides.iter().copied()).filter(|(d, _)| *d != 1).collect();
        let new: Vec<usize> = new_shape.to_vec();
        let mut new_strides = vec![0usize; new.len()];
        let (mut i, mut j) = (0, 0);
        let new_nz: Vec<usize> = (0..new.len()).filter(|&k| new[k] != 1).collect();
        while i < old.len() || j < new_nz.len() {
            if i >= old.len() || j >= new_nz.len() {
                return None;
            }
            // Grow both groups until their element counts match.
            let (i0, j0) = (i, j);
            let (mut po, mut pn) = (old[i].0, new[new_nz[j]]);
            i += 1;
            j += 1;
            while po != pn {
                if po < pn {
                    if i >= old.len() {
                        return None;
                    }
                    po *= old[i].0;
                    i += 1;
                } else {
                    if j >= new_nz.len() {
                        return None;
                    }
                    pn *= new[new_nz[j]];
                    j += 1;
                }
            }
            // The old group must be contiguous among itself.
            for k in i0..i - 1 {
                if old[k].1 != old[k + 1].1 * old[k + 1].0 {
                    return None;
                }
            }
            let mut s = old[i - 1].1;
            for k in (j0..j).rev() {
                new_strides[new_nz[k]] = s;
                s *= new[new_nz[k]];
            }
        }
        // Size-1 dims take any stride; give them the next inner one for tidiness.
        for k in (0..new.len()).rev() {
            if new[k] == 1 {
                new_strides[k] = if k + 1 < new.len() { new_strides[k + 1] * new[k + 1] } else { 1 };
            }
        }
        Some(View { shape: new, strides: new_strides, ..self.clone() })
    }
}

/// Row-major strides for a buffer laid out in physical axis order `order`, viewed in logical order.
fn strides_for_order(shape: &[usize], order: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut s = 1;
    for &ax in order.iter().rev() {
        strides[ax] = s;
        s *= shape[ax];
    }
    strides
}

const NHWC: [usize; 4] = [0, 2, 3, 1];

fn identity(rank: usize) -> Vec<usize> {
    (0..rank).collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Transform {
    AsIs,
    /// OIHW -> [O][KH][KW][I] for the implicit-GEMM convolution.
    ConvOhwi,
    /// [C][1][KH][KW] -> [KH][KW][C] for the depthwise convolution.
    DepthwiseHwc,
    /// [..][K][N] -> [..][N][K]: a constant right operand of a matrix product stored with K
    /// contiguous (the view keeps the logical [..][K][N] shape, with the strides swapped).
    KMajor,
}

struct Entry {
    bytes: Vec<u8>,
    first_use: Option<u32>,
}

struct Pending {
    name: String,
    kernel: Kernel,
    dtype: DType,
    args: Vec<View>,
    deps: BTreeSet<u32>,
}

struct Emitter<'g> {
    g: &'g Graph,
    dtype: DType,
    /// Whether long reductions may be split ([`split_k_for`]).
    split_k: bool,
    bufs: Vec<Buf>,
    entries: Vec<Entry>,
    entry_of: HashMap<(usize, Transform, DType), usize>,
    views: Vec<Option<View>>,
    /// Where a node's output must go, when a consumer (a concatenation, a graph output) decided it.
    placed: HashMap<NodeId, (NodeId, usize, usize)>,
    out_views: HashMap<NodeId, View>,
    consumers: Vec<Vec<NodeId>>,
    launches: Vec<Pending>,
}

fn unsupported(g: &Graph, id: NodeId, detail: impl Into<String>) -> Error {
    let n = &g.nodes[id];
    Error::Unsupported {
        model: g.name.clone(),
        op: n.op.name().to_string(),
        node: n.name.clone(),
        detail: format!(": {}", detail.into()),
    }
}

/// Lowers an optimized graph at `dtype`; `split_k` allows split-K products.
pub fn emit(g: &Graph, dtype: DType, split_k: bool) -> Result<Plan, Error> {
    let mut e = Emitter {
        g,
        dtype,
        split_k,
        bufs: Vec::new(),
        entries: Vec::new(),
        entry_of: HashMap::new(),
        views: vec![None; g.nodes.len()],
        placed: HashMap::new(),
        out_views: HashMap::new(),
        consumers: g.consumers(),
        launches: Vec::new(),
    };
    e.plan_concats();
    for id in 0..g.nodes.len() {
        e.emit_node(id)?;
    }
    e.finish_outputs()?;
    e.assemble()
}

impl Emitter<'_> {
    fn float(&self, dt: DType) -> DType {
        if dt == DType::I64 { DType::I64 } else { self.dtype }
    }

    fn new_buf(&mut self, kind: BufKind, elems: usize, dtype: DType) -> usize {
        self.bufs.push(Buf { kind, elems, dtype, first_write: None, last_access: None, accessors: Vec::new() });
        self.bufs.len() - 1
    }

    /// A fresh arena buffer for `shape` laid out in physical order `order`.
    fn fresh(&mut self, shape: &[usize], order: &[usize], dtype: DType) -> View {
        let buf = self.new_buf(BufKind::Arena, element_count(shape).max(1), dtype);
        View { buf, offset: 0, shape: shape.to_vec(), strides: strides_for_order(shape, order), dtype, writers: Vec::new() }
    }

    fn default_order(&self, shape: &[usize]) -> Vec<usize> {
        if shape.len() == 4 { NHWC.to_vec() } else { identity(shape.len()) }
    }

    // ---- placement -------------------------------------------------------------------------

    /// Decides which concatenation inputs write straight into the concatenation's buffer.
    /// Later concatenations go first, so DenseNet's growing concatenations become prefixes of the
    /// last one of each block and cost no copies.
    fn plan_concats(&mut self) {
        let g = self.g;
        for id in (0..g.nodes.len()).rev() {
            let Op::Concat { axis } = g.nodes[id].op else { continue };
            let inputs = &g.nodes[id].inputs;
            // Already placed together, in order, inside one parent? Then this concat is a view of it.
            if !self.placed.contains_key(&id)
                && let Some(&(parent, paxis, start)) = self.placed.get(&inputs[0])
                && paxis == axis
            {
                let mut off = start;
                let mut contiguous = true;
                for &i in inputs {
                    match self.placed.get(&i) {
                        Some(&(p, a, o)) if p == parent && a == axis && o == off => off += g.nodes[i].shape[axis],
                        _ => {
                            contiguous = false;
                            break;
                        }
                    }
                }
                if contiguous {
                    self.placed.insert(id, (parent, axis, start));
                    continue;
                }
            }
            let mut off = 0;
            for &i in inputs {
                let len = g.nodes[i].shape[axis];
                let placeable = !self.placed.contains_key(&i)
                    && !g.is_output(i)
                    && inputs.iter().filter(|&&x| x == i).count() == 1
                    && matches!(
                        g.nodes[i].op,
                        Op::Conv { .. }
                            | Op::Pool { .. }
                            | Op::MatMul { .. }
                            | Op::Binary(_)
                            | Op::BinaryAct { .. }
                            | Op::Unary(_)
                            | Op::Affine { .. }
                            | Op::Concat { .. }
                            | Op::Where
                            | Op::Cast
                    );
                if placeable {
                    self.placed.insert(i, (id, axis, off));
                }
                off += len;
            }
        }
    }

    /// Where node `id` should write its output (the view a concatenation or graph output wants).
    fn out_view(&mut self, id: NodeId, order: &[usize]) -> View {
        if let Some(v) = self.out_views.get(&id) {
            return v.clone();
        }
        let node = &self.g.nodes[id];
        let dtype = self.float(node.dtype);
        let v = if let Some(&(parent, axis, off)) = self.placed.get(&id) {
            let porder = self.default_order(&self.g.nodes[parent].shape);
            let pv = self.out_view(parent, &porder);
            pv.narrow(axis, off, node.shape[axis])
        } else if let Some(k) = self.g.outputs.iter().position(|o| o.node == id)
            && node.dtype == dtype
            && dtype != DType::I64
        {
            // A graph output whose natural layout is row-major: write it in place.
            let buf = self.new_buf(BufKind::Output(k as u32), element_count(&node.shape).max(1), dtype);
            View { buf, offset: 0, shape: node.shape.clone(), strides: strides_of(&node.shape), dtype, writers: Vec::new() }
        } else {
            self.fresh(&node.shape, order, dtype)
        };
        self.out_views.insert(id, v.clone());
        v
    }

    // ---- values ------------------------------------------------------------------------------

    fn entry(&mut self, id: NodeId, t: &Tensor, transform: Transform, dtype: DType) -> Result<usize, Error> {
        let key_ptr = match &self.g.nodes[id].op {
            Op::Const(a) => std::sync::Arc::as_ptr(a) as usize,
            _ => unreachable!(),
        };
        let key = (key_ptr, transform, dtype);
        if let Some(&e) = self.entry_of.get(&key) {
            return Ok(e);
        }
        let data = match transform {
            Transform::AsIs => t.clone(),
            Transform::ConvOhwi => crate::interp::transpose(t, &[0, 2, 3, 1]),
            Transform::DepthwiseHwc => {
                let mut tt = crate::interp::transpose(t, &[2, 3, 0, 1]);
                tt.shape = vec![t.shape[2], t.shape[3], t.shape[0]];
                tt
            }
            Transform::KMajor => {
                let rank = t.shape.len();
                let mut perm = identity(rank);
                perm.swap(rank - 2, rank - 1);
                crate::interp::transpose(t, &perm)
            }
        };
        let bytes = data.cast(dtype).to_bytes();
        self.entries.push(Entry { bytes, first_use: None });
        let eid = self.entries.len() - 1;
        self.entry_of.insert(key, eid);
        Ok(eid)
    }

    fn const_view(&mut self, id: NodeId, transform: Transform) -> Result<View, Error> {
        let t = self.g.konst(id).expect("const").clone();
        let dtype = self.float(t.dtype());
        let e = self.entry(id, &t, transform, dtype)?;
        let elems = t.len();
        let buf = self.new_buf(BufKind::Weights(e), elems.max(1), dtype);
        let shape = match transform {
            Transform::AsIs | Transform::KMajor => t.shape.clone(),
            Transform::ConvOhwi => vec![t.shape[0], t.shape[2], t.shape[3], t.shape[1]],
            Transform::DepthwiseHwc => vec![t.shape[2], t.shape[3], t.shape[0]],
        };
        let strides = if transform == Transform::KMajor {
            // Stored [..][N][K]: the logical [..][K][N] view has its last two strides swapped.
            let rank = shape.len();
            let mut stored = shape.clone();
            stored.swap(rank - 2, rank - 1);
            let mut st = strides_of(&stored);
            st.swap(rank - 2, rank - 1);
            st
        } else {
            strides_of(&shape)
        };
        Ok(View { buf, offset: 0, shape, strides, dtype, writers: Vec::new() })
    }

    /// The view of a node's value.
    fn value(&mut self, id: NodeId) -> Result<View, Error> {
        if let Some(v) = &self.views[id] {
            return Ok(v.clone());
        }
        match &self.g.nodes[id].op {
            Op::Const(_) => {
                let v = self.const_view(id, Transform::AsIs)?;
                self.views[id] = Some(v.clone());
                Ok(v)
            }
            _ => panic!("node {id} ({}) read before it was emitted", self.g.nodes[id].name),
        }
    }

    /// A copy of `src` laid out in `order` with element type `dtype`, into a fresh buffer (or `dst`).
    fn copy(&mut self, name: &str, src: &View, dst: Option<View>, order: &[usize], dtype: DType) -> View {
        let dst = dst.unwrap_or_else(|| self.fresh(&src.shape, order, dtype));
        let mut out = dst.clone();
        let l = self.eltwise(name, EltFunc::Copy, Act::None, std::slice::from_ref(src), &dst, [0.0; 2]);
        out.writers = vec![l];
        out
    }

    /// `v` if it is row-major and of `dtype`, else a row-major copy.
    fn contiguous(&mut self, name: &str, v: View, dtype: DType) -> View {
        if v.is_contiguous() && v.dtype == dtype {
            v
        } else {
            self.copy(&format!("{name}.contiguous"), &v, None, &identity(v.shape.len()), dtype)
        }
    }

    /// `v` as an NHWC view with contiguous channels and element type `dtype`.
    fn nhwc(&mut self, name: &str, v: View, dtype: DType) -> View {
        if v.nhwc_pixel_stride().is_some() && v.dtype == dtype {
            v
        } else {
            self.copy(&format!("{name}.nhwc"), &v, None, &NHWC, dtype)
        }
    }

    // ---- launches ----------------------------------------------------------------------------

    fn push_launch(&mut self, name: &str, kernel: Kernel, dtype: DType, args: Vec<View>, out_arg: usize) -> u32 {
        let id = self.launches.len() as u32;
        let mut deps = BTreeSet::new();
        for (i, a) in args.iter().enumerate() {
            if i != out_arg {
                deps.extend(a.writers.iter().copied());
            }
            let b = &mut self.bufs[a.buf];
            b.accessors.push(id);
            b.last_access = Some(id);
            if i == out_arg && b.first_write.is_none() {
                b.first_write = Some(id);
            }
            if let BufKind::Weights(e) = b.kind
                && self.entries[e].first_use.is_none()
            {
                self.entries[e].first_use = Some(id);
            }
        }
        self.launches.push(Pending { name: name.to_string(), kernel, dtype, args, deps });
        id
    }

    /// Emits an element-wise kernel computing `func` over `inputs` (broadcast to `out`'s shape) into `out`.
    fn eltwise(&mut self, name: &str, func: EltFunc, act: Act, inputs: &[View], out: &View, scalars: [f32; 2]) -> u32 {
        let rank = out.shape.len();
        let ins: Vec<View> = inputs.iter().map(|v| v.broadcast_to(&out.shape)).collect();
        // Coalesce dims that are contiguous with their inner neighbour in every operand, drop size-1 dims.
        let mut dims: Vec<(usize, usize, Vec<usize>)> = Vec::new(); // (size, out stride, in strides)
        for d in 0..rank {
            if out.shape[d] == 1 {
                continue;
            }
            dims.push((out.shape[d], out.strides[d], ins.iter().map(|v| v.strides[d]).collect()));
        }
        let mut merged: Vec<(usize, usize, Vec<usize>)> = Vec::new();
        for (size, os, is) in dims {
            if let Some(last) = merged.last_mut() {
                let ok = last.1 == os * size && last.2.iter().zip(&is).all(|(&a, &b)| a == b * size);
                if ok {
                    last.0 *= size;
                    last.1 = os;
                    last.2 = is;
                    continue;
                }
            }
            merged.push((size, os, is));
        }
        assert!(merged.len() <= ELTWISE_RANK_MAX, "eltwise {name}: {} dims after coalescing", merged.len());
        let pad = ELTWISE_RANK_MAX - merged.len();
        let mut shape = [1u32; ELTWISE_RANK_MAX];
        let mut out_strides = [0u64; ELTWISE_RANK_MAX];
        let mut in_strides = [[0u64; ELTWISE_RANK_MAX]; 3];
        for (k, (size, os, is)) in merged.iter().enumerate() {
            shape[pad + k] = *size as u32;
            out_strides[pad + k] = *os as u64;
            for (j, s) in is.iter().enumerate() {
                in_strides[j][pad + k] = *s as u64;
            }
        }
        let mut in_dtypes = [self.dtype; 3];
        for (j, v) in ins.iter().enumerate() {
            in_dtypes[j] = v.dtype;
        }
        let p = EltwiseParams {
            func,
            act,
            inputs: ins.len() as u32,
            shape,
            out_strides,
            in_strides,
            in_dtypes,
            out_dtype: out.dtype,
            scalars,
            elems_per_block: ELTWISE_ELEMS_PER_BLOCK,
        };
        let mut args = ins;
        args.push(out.clone());
        let n = args.len() - 1;
        // The kernel reads and writes each argument in its own type (the parameters carry them);
        // the launch's type picks the compiled variant, and there is none for int64: an int64
        // result runs in the plan's float variant.
        let launch_dtype = if out.dtype == DType::I64 { self.dtype } else { out.dtype };
        self.push_launch(name, Kernel::Eltwise(p), launch_dtype, args, n)
    }

    // ---- nodes -------------------------------------------------------------------------------

    fn set_value(&mut self, id: NodeId, v: View) {
        self.views[id] = Some(v);
    }

    fn emit_node(&mut self, id: NodeId) -> Result<(), Error> {
        let g = self.g;
        let node = &g.nodes[id];
        let name = node.name.clone();
        let shape = node.shape.clone();
        match &node.op {
            Op::Input { index } => {
                let dtype = node.dtype;
                let buf = self.new_buf(BufKind::Input(*index as u32), element_count(&shape).max(1), dtype);
                let v = View { buf, offset: 0, strides: strides_of(&shape), shape, dtype, writers: Vec::new() };
                self.set_value(id, v);
            }
            Op::Const(_) => {} // views of constants are made where they are read, in the form the reader needs
            Op::Reshape => {
                let x = self.value(node.inputs[0])?;
                let v = match x.reshape(&shape) {
                    Some(v) => v,
                    None => {
                        let c = self.contiguous(&name, x, self.float(node.dtype));
                        c.reshape(&shape).expect("contiguous views reshape")
                    }
                };
                self.set_value(id, v);
            }
            Op::Transpose { perm } => {
                let x = self.value(node.inputs[0])?;
                self.set_value(id, x.permute(perm));
            }
            Op::Slice { axis, start, end } => {
                let x = self.value(node.inputs[0])?;
                self.set_value(id, x.narrow(*axis, *start, end - start));
            }
            Op::Expand => {
                let x = self.value(node.inputs[0])?;
                self.set_value(id, x.broadcast_to(&shape));
            }
            Op::Concat { axis } => {
                let order = self.default_order(&shape);
                let mut out = self.out_view(id, &order);
                let mut writers = Vec::new();
                let mut off = 0;
                for &i in &node.inputs {
                    let len = g.nodes[i].shape[*axis];
                    let slot = out.narrow(*axis, off, len);
                    let v = self.value(i)?;
                    if v.same_place(&slot) {
                        writers.extend(v.writers);
                    } else {
                        let c = self.copy(&format!("{name}.part{off}"), &v, Some(slot), &order, out.dtype);
                        writers.extend(c.writers);
                    }
                    off += len;
                }
                writers.sort_unstable();
                writers.dedup();
                out.writers = writers;
                self.set_value(id, out);
            }
            Op::Conv { .. } => self.emit_conv(id)?,
            Op::MatMul { .. } => self.emit_matmul(id)?,
            Op::Pool { kind, window } => {
                let x = self.value(node.inputs[0])?;
                let x = self.nhwc(&name, x, self.dtype);
                let mut out = self.out_view(id, &NHWC);
                if out.nhwc_pixel_stride().is_none() || out.dtype != self.dtype {
                    out = self.fresh(&shape, &NHWC, self.dtype);
                }
                let p = Pool2dParams {
                    kind: (*kind).into(),
                    batch: shape[0] as u32,
                    in_h: x.shape[2] as u32,
                    in_w: x.shape[3] as u32,
                    channels: shape[1] as u32,
                    out_h: shape[2] as u32,
                    out_w: shape[3] as u32,
                    kernel_h: window.kernel[0] as u32,
                    kernel_w: window.kernel[1] as u32,
                    stride_h: window.stride[0] as u32,
                    stride_w: window.stride[1] as u32,
                    pad_top: window.pad_begin[0] as u32,
                    pad_left: window.pad_begin[1] as u32,
                    pad_bottom: window.pad_end[0] as u32,
                    pad_right: window.pad_end[1] as u32,
                    in_pixel_stride: x.nhwc_pixel_stride().unwrap() as u32,
                    out_pixel_stride: out.nhwc_pixel_stride().unwrap() as u32,
                    elems_per_block: POOL_ELEMS_PER_BLOCK,
                };
                if window.dilation != [1, 1] {
                    return Err(unsupported(g, id, "dilated pooling"));
                }
                let l = self.push_launch(&name, Kernel::Pool2d(p), self.dtype, vec![x, out.clone()], 1);
                out.writers = vec![l];
                self.set_value(id, out);
            }
            Op::Reduce { op, axes } => self.emit_reduce(id, *op, axes)?,
            Op::Softmax { axis, scale, causal, zero_nan } => {
                let (axis, scale, causal, zero_nan) = (*axis, *scale, *causal, *zero_nan);
                self.emit_rows(
                    id,
                    axis,
                    |rows, cols, causal_rows| {
                        Kernel::Softmax(SoftmaxParams {
                            rows,
                            cols,
                            scale,
                            causal,
                            causal_rows,
                            zero_nan,
                            rows_per_block: ROWS_PER_BLOCK,
                        })
                    },
                    causal,
                )?;
            }
            Op::LayerNorm { eps, rms } => {
                let (eps, rms) = (*eps, *rms);
                let rank = shape.len();
                self.emit_rows(
                    id,
                    rank - 1,
                    |rows, cols, _| Kernel::LayerNorm(LayerNormParams { rows, cols, eps, rms, rows_per_block: ROWS_PER_BLOCK }),
                    false,
                )?;
            }
            Op::Gather { axis } => self.emit_gather(id, *axis)?,
            Op::Binary(b) => self.emit_binary(id, *b, Act::None)?,
            Op::BinaryAct { op, act } => self.emit_binary(id, *op, *act)?,
            Op::Unary(u) => {
                let x = self.value(node.inputs[0])?;
                let (func, act) = match u {
                    UnaryOp::Act(a) => (EltFunc::Copy, *a),
                    other => (EltFunc::Unary(UnaryOpParam::from_graph(*other).unwrap()), Act::None),
                };
                self.emit_eltwise_node(id, func, act, vec![x], [0.0; 2])?;
            }
            Op::Affine { act } => {
                let ins = node.inputs.iter().map(|&i| self.value(i)).collect::<Result<Vec<_>, _>>()?;
                self.emit_eltwise_node(id, EltFunc::Affine, *act, ins, [0.0; 2])?;
            }
            Op::Where => {
                let ins = node.inputs.iter().map(|&i| self.value(i)).collect::<Result<Vec<_>, _>>()?;
                self.emit_eltwise_node(id, EltFunc::Where, Act::None, ins, [0.0; 2])?;
            }
            Op::Cast => {
                let x = self.value(node.inputs[0])?;
                self.emit_eltwise_node(id, EltFunc::Copy, Act::None, vec![x], [0.0; 2])?;
            }
        }
        Ok(())
    }

    /// Emits an element-wise node into its output view (any strided layout works).
    fn emit_eltwise_node(&mut self, id: NodeId, func: EltFunc, act: Act, ins: Vec<View>, scalars: [f32; 2]) -> Result<(), Error> {
        let node = &self.g.nodes[id];
        // Integer tensors at run time (masks, position ids from token ids) are computed in f32 by
        // the element-wise kernel: exact for magnitudes below 2^24, which token ids, positions
        // and masks stay under; an int64 result is truncated toward zero.
        let int_math = node.dtype == DType::I64 || ins.iter().any(|v| v.dtype == DType::I64);
        if int_math
            && !matches!(func, EltFunc::Copy | EltFunc::Binary(_) | EltFunc::BinaryScalar(_) | EltFunc::Where | EltFunc::Unary(_))
        {
            return Err(unsupported(self.g, id, "integer arithmetic at run time"));
        }
        if ins.len() > 3 {
            return Err(unsupported(self.g, id, "more than three inputs"));
        }
        // Keep the layout of the first input that is not broadcast (NHWC stays NHWC).
        let order = ins
            .iter()
            .find(|v| v.shape == node.shape && v.strides.iter().all(|&s| s != 0))
            .map(physical_order)
            .unwrap_or_else(|| identity(node.shape.len()));
        let mut out = self.out_view(id, &order);
        let l = self.eltwise(&node.name.clone(), func, act, &ins, &out, scalars);
        out.writers = vec![l];
        self.set_value(id, out);
        Ok(())
    }

    fn emit_binary(&mut self, id: NodeId, op: BinaryOp, act: Act) -> Result<(), Error> {
        let node = &self.g.nodes[id];
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let scalar_b = self.g.konst(b).filter(|t| t.len() == 1 && t.dtype() != DType::I64).map(|t| t.to_f32_vec()[0]);
        let av = self.value(a)?;
        if let Some(s) = scalar_b {
            return self.emit_eltwise_node(id, EltFunc::BinaryScalar(BinaryOpParam::from_graph(op)), act, vec![av], [s, 0.0]);
        }
        let bv = self.value(b)?;
        self.emit_eltwise_node(id, EltFunc::Binary(BinaryOpParam::from_graph(op)), act, vec![av, bv], [0.0; 2])
    }

    fn emit_conv(&mut self, id: NodeId) -> Result<(), Error> {
        let g = self.g;
        let node = &g.nodes[id];
        let Op::Conv { window, groups, epilogue } = &node.op else { unreachable!() };
        let name = node.name.clone();
        let shape = node.shape.clone();
        let w_id = node.inputs[1];
        let Some(w) = g.konst(w_id).cloned() else {
            return Err(unsupported(g, id, "convolution weights computed at run time"));
        };
        let (o, cin_g, kh, kw) = (w.shape[0], w.shape[1], w.shape[2], w.shape[3]);
        let x = self.value(node.inputs[0])?;
        let x = self.nhwc(&name, x, self.dtype);
        let c = x.shape[1];
        let depthwise = *groups > 1 && *groups == c && o == c && cin_g == 1;
        let wv = self.const_view(w_id, if depthwise { Transform::DepthwiseHwc } else { Transform::ConvOhwi })?;
        let mut args = vec![x.clone(), wv];
        let mut next = 2;
        if epilogue.bias {
            let bid = node.inputs[next];
            if g.konst(bid).is_none() {
                return Err(unsupported(g, id, "a bias computed at run time"));
            }
            args.push(self.const_view(bid, Transform::AsIs)?);
            next += 1;
        }
        let mut res_ps = 0;
        if epilogue.residual {
            let r = self.value(node.inputs[next])?;
            let r = self.nhwc(&format!("{name}.residual"), r, self.dtype);
            res_ps = r.nhwc_pixel_stride().unwrap();
            args.push(r);
        }
        let mut out = self.out_view(id, &NHWC);
        if out.nhwc_pixel_stride().is_none() || out.dtype != self.dtype {
            out = self.fresh(&shape, &NHWC, self.dtype);
        }
        let tile = if *groups == 1 {
            tile_for(self.dtype, 1, (shape[0] * shape[2] * shape[3]) as u32, o as u32)
        } else {
            direct_conv_tile(o)
        };
        let p = Conv2dParams {
            batch: shape[0] as u32,
            in_h: x.shape[2] as u32,
            in_w: x.shape[3] as u32,
            in_c: c as u32,
            out_h: shape[2] as u32,
            out_w: shape[3] as u32,
            out_c: o as u32,
            kernel_h: kh as u32,
            kernel_w: kw as u32,
            stride_h: window.stride[0] as u32,
            stride_w: window.stride[1] as u32,
            pad_h: window.pad_begin[0] as u32,
            pad_w: window.pad_begin[1] as u32,
            dilation_h: window.dilation[0] as u32,
            dilation_w: window.dilation[1] as u32,
            groups: *groups as u32,
            in_pixel_stride: x.nhwc_pixel_stride().unwrap() as u32,
            out_pixel_stride: out.nhwc_pixel_stride().unwrap() as u32,
            res_pixel_stride: res_ps as u32,
            epilogue: EpilogueParams { bias: epilogue.bias, residual: epilogue.residual, act: epilogue.act.0 },
            tile_m: tile.0,
            tile_n: tile.1,
            split_k: 1,
        };
        if *groups == 1 {
            let split = if self.split_k { split_k_for(self.dtype, p.m_tiles() * p.n_tiles(), p.gemm_m(), p.gemm_k()) } else { 1 };
            if split > 1 {
                let sum = SplitKSumParams {
                    splits: split,
                    batch0: 1,
                    batch1: 1,
                    m: p.gemm_m(),
                    n: p.out_c,
                    c_stride0: 0,
                    c_stride1: 0,
                    c_stride_m: p.out_pixel_stride as u64,
                    r_stride0: 0,
                    r_stride1: 0,
                    r_stride_m: p.res_pixel_stride as u64,
                    alpha: 1.0,
                    epilogue: p.epilogue,
                    elems_per_block: SPLIT_K_SUM_ELEMS_PER_BLOCK,
                };
                let operands = args.drain(..2).collect();
                self.split_k_launches(&name, id, Kernel::Conv2d(p).split_k_partials(split), operands, sum, args, out);
                return Ok(());
            }
        }
        let kernel = if depthwise { Kernel::DepthwiseConv2d(p) } else { Kernel::Conv2d(p) };
        args.push(out.clone());
        let n = args.len() - 1;
        let l = self.push_launch(&name, kernel, self.dtype, args, n);
        out.writers = vec![l];
        self.set_value(id, out);
        Ok(())
    }

    /// A split-K product: `product` (a conv2d or gemm with `split_k` > 1 and no epilogue) reads
    /// `operands` and writes its partial sums into a fresh f32 workspace; a splitk_sum launch adds
    /// them up with `epilogue_args` (bias, residual) into `out`, which becomes node `id`'s value.
    #[allow(clippy::too_many_arguments)]
    fn split_k_launches(
        &mut self,
        name: &str,
        id: NodeId,
        product: Kernel,
        mut operands: Vec<View>,
        sum: SplitKSumParams,
        epilogue_args: Vec<View>,
        mut out: View,
    ) {
        let ws_elems = sum.splits as usize * sum.elems() as usize;
        let mut ws = self.fresh(&[ws_elems], &[0], DType::F32);
        operands.push(ws.clone());
        let l = self.push_launch(name, product, self.dtype, operands, 2);
        ws.writers = vec![l];
        let mut args = vec![ws];
        args.extend(epilogue_args);
        args.push(out.clone());
        let n = args.len() - 1;
        let s = self.push_launch(&format!("{name}.splitk_sum"), Kernel::SplitKSum(sum), self.dtype, args, n);
        out.writers = vec![s];
        self.set_value(id, out);
    }

    /// The physical order a matmul output should have: the order its only consumer, a transpose
    /// keeping the last axis last, reads contiguously (attention heads merge for free).
    fn preferred_matmul_order(&self, id: NodeId) -> Vec<usize> {
        let rank = self.g.nodes[id].shape.len();
        if self.g.is_output(id) || self.placed.contains_key(&id) {
            return identity(rank);
        }
        if let [c] = self.consumers[id].as_slice()
            && let Op::Transpose { perm } = &self.g.nodes[*c].op
            && perm.last() == Some(&(rank - 1))
        {
            return perm.clone();
        }
        identity(rank)
    }

    /// The right operand of a matrix product. A constant one of the fp16 plans (a linear layer's
    /// weight as ONNX MatMul stores it, [K][N]) is kept K-major: the tensor-core tiles copy B
    /// into shared memory in 16-byte chunks along K, and their fixed-shape and wide constant
    /// paths take only that layout (tile.cuh); an [N][K] weight already is, and stays as is.
    fn matmul_rhs(&mut self, id: NodeId) -> Result<View, Error> {
        if self.dtype == DType::F16
            && let Some(t) = self.g.konst(id)
            && t.shape.len() >= 2
            && t.shape[t.shape.len() - 1] > 1
            && t.shape[t.shape.len() - 2] > 1
        {
            return self.const_view(id, Transform::KMajor);
        }
        self.value(id)
    }

    fn emit_matmul(&mut self, id: NodeId) -> Result<(), Error> {
        let g = self.g;
        let node = &g.nodes[id];
        let Op::MatMul { epilogue, alpha } = &node.op else { unreachable!() };
        let alpha = *alpha;
        let name = node.name.clone();
        let shape = node.shape.clone();
        let rank = shape.len();
        let (m, n) = (shape[rank - 2], shape[rank - 1]);
        let mut a = self.value(node.inputs[0])?;
        let mut b = self.matmul_rhs(node.inputs[1])?;
        let k = a.shape[rank - 1];
        if a.dtype != self.dtype {
            a = self.contiguous(&name, a, self.dtype);
        }
        if b.dtype != self.dtype {
            b = self.contiguous(&name, b, self.dtype);
        }
        let mut bias = None;
        let mut next = 2;
        if epilogue.bias {
            let bid = node.inputs[next];
            if g.konst(bid).is_none() {
                return Err(unsupported(g, id, "a bias computed at run time"));
            }
            bias = Some(self.const_view(bid, Transform::AsIs)?);
            next += 1;
        }
        let mut residual = None;
        if epilogue.residual {
            // Broadcast to the output (fuse.rs: a product's residual may broadcast along rows and
            // batch dims): stride 0 where it does.
            let r = self.value(node.inputs[next])?.broadcast_to(&shape);
            residual = Some(if r.dtype == self.dtype && (r.strides[rank - 1] == 1 || n == 1) {
                r
            } else {
                self.contiguous(&name, r, self.dtype)
            });
        }
        let order = self.preferred_matmul_order(id);
        let mut out = self.out_view(id, &order);
        if out.dtype != self.dtype || (out.strides[rank - 1] != 1 && n != 1) {
            out = self.fresh(&shape, &order, self.dtype);
        }
        // Batch dims of every operand broadcast to the output's, then merged to at most two.
        let batch_shape = &shape[..rank - 2];
        let bcast = |v: &View| -> Vec<usize> {
            let full = v.broadcast_to(&[batch_shape, &v.shape[rank - 2..]].concat());
            full.strides[..rank - 2].to_vec()
        };
        let mut operands = vec![bcast(&a), bcast(&b), out.strides[..rank - 2].to_vec()];
        if let Some(r) = &residual {
            operands.push(bcast(r));
        }
        let mut dims: Vec<(usize, Vec<usize>)> = Vec::new();
        for d in 0..rank - 2 {
            if batch_shape[d] == 1 {
                continue;
            }
            let strides: Vec<usize> = operands.iter().map(|s| s[d]).collect();
            if let Some(last) = dims.last_mut()
                && last.1.iter().zip(&strides).all(|(&outer, &inner)| outer == inner * batch_shape[d])
            {
                last.0 *= batch_shape[d];
                last.1 = strides;
                continue;
            }
            dims.push((batch_shape[d], strides));
        }
        // Batch dims over which the right operand (weights) is shared fold into the rows: a
        // sequence-first or channels-last activation times a weight (`nn.MultiheadAttention`'s
        // input projection, [T, B, E] x [E, 3E]; ConvNeXt's and Swin's linear layers on [B, H, W,
        // C]) is one product of T (H x W) rows, not T products of one row (W) that each read the
        // whole weight again (`fold_shared_rhs_batches`).
        let mut m = m;
        let mut row_strides = vec![a.strides[rank - 2], 0, out.strides[rank - 2]];
        if let Some(r) = &residual {
            row_strides.push(r.strides[rank - 2]);
        }
        fold_shared_rhs_batches(&mut dims, &mut m, &mut row_strides);
        if dims.len() > 2 {
            return Err(unsupported(g, id, "a matrix product whose batch dims do not merge into two"));
        }
        while dims.len() < 2 {
            dims.insert(0, (1, vec![0; operands.len()]));
        }
        let mut p = GemmParams {
            batch0: dims[0].0 as u32,
            batch1: dims[1].0 as u32,
            m: m as u32,
            n: n as u32,
            k: k as u32,
            a_stride0: dims[0].1[0] as u64,
            a_stride1: dims[1].1[0] as u64,
            a_stride_m: row_strides[0] as u64,
            a_stride_k: a.strides[rank - 1] as u64,
            b_stride0: dims[0].1[1] as u64,
            b_stride1: dims[1].1[1] as u64,
            b_stride_k: b.strides[rank - 2] as u64,
            b_stride_n: b.strides[rank - 1] as u64,
            c_stride0: dims[0].1[2] as u64,
            c_stride1: dims[1].1[2] as u64,
            c_stride_m: row_strides[2] as u64,
            r_stride0: residual.as_ref().map(|_| dims[0].1[3] as u64).unwrap_or(0),
            r_stride1: residual.as_ref().map(|_| dims[1].1[3] as u64).unwrap_or(0),
            r_stride_m: row_strides.get(3).copied().unwrap_or(0) as u64,
            alpha,
            epilogue: EpilogueParams { bias: epilogue.bias, residual: epilogue.residual, act: epilogue.act.0 },
            tile_m: 0,
            tile_n: 0,
            split_k: 1,
        };
        (p.tile_m, p.tile_n) = tile_for(self.dtype, p.batch0 * p.batch1, p.m, p.n);
        let split =
            if self.split_k { split_k_for(self.dtype, p.batch0 * p.batch1 * p.m_tiles() * p.n_tiles(), p.m, p.k) } else { 1 };
        if split > 1 {
            let sum = SplitKSumParams {
                splits: split,
                batch0: p.batch0,
                batch1: p.batch1,
                m: p.m,
                n: p.n,
                c_stride0: p.c_stride0,
                c_stride1: p.c_stride1,
                c_stride_m: p.c_stride_m,
                r_stride0: p.r_stride0,
                r_stride1: p.r_stride1,
                r_stride_m: p.r_stride_m,
                alpha: p.alpha,
                epilogue: p.epilogue,
                elems_per_block: SPLIT_K_SUM_ELEMS_PER_BLOCK,
            };
            let epilogue_args = bias.into_iter().chain(residual).collect();
            self.split_k_launches(&name, id, Kernel::Gemm(p).split_k_partials(split), vec![a, b], sum, epilogue_args, out);
            return Ok(());
        }
        let mut args = vec![a, b];
        args.extend(bias);
        args.extend(residual);
        args.push(out.clone());
        let last = args.len() - 1;
        let l = self.push_launch(&name, Kernel::Gemm(p), self.dtype, args, last);
        out.writers = vec![l];
        self.set_value(id, out);
        Ok(())
    }

    /// Row-wise kernels (softmax, layer norm) over `axis`: the input is made row-major with `axis`
    /// last, the output is row-major in that order and the node's value is viewed back.
    fn emit_rows(
        &mut self,
        id: NodeId,
        axis: usize,
        kernel: impl Fn(u32, u32, u32) -> Kernel,
        causal: bool,
    ) -> Result<(), Error> {
        let g = self.g;
        let node = &g.nodes[id];
        let name = node.name.clone();
        let rank = node.shape.len();
        if causal && axis != rank - 1 {
            return Err(unsupported(g, id, "a causal softmax over an axis that is not the last"));
        }
        let mut perm: Vec<usize> = (0..rank).filter(|&d| d != axis).collect();
        perm.push(axis);
        let x = self.value(node.inputs[0])?.permute(&perm);
        let x = self.contiguous(&name, x, self.dtype);
        let cols = x.shape[rank - 1];
        let rows = element_count(&x.shape) / cols.max(1);
        let causal_rows = if rank >= 2 { x.shape[rank - 2] } else { 1 };
        let mut args = vec![x.clone()];
        if let Op::LayerNorm { .. } = node.op {
            for &p in &node.inputs[1..3] {
                if g.konst(p).is_none() {
                    return Err(unsupported(g, id, "layer-norm scale or shift computed at run time"));
                }
                args.push(self.const_view(p, Transform::AsIs)?);
            }
        }
        // The output in `perm` order, row-major; the value is its inverse permutation.
        let mut inv = vec![0; rank];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let wanted = self.out_view(id, &perm);
        let out_rows = if wanted.permute(&perm).is_contiguous() && wanted.dtype == self.dtype {
            wanted.permute(&perm)
        } else {
            self.fresh(&x.shape, &identity(rank), self.dtype)
        };
        args.push(out_rows.clone());
        let last = args.len() - 1;
        let l = self.push_launch(&name, kernel(rows as u32, cols as u32, causal_rows as u32), self.dtype, args, last);
        let mut v = out_rows.permute(&inv);
        v.writers = vec![l];
        self.set_value(id, v);
        Ok(())
    }

    fn emit_reduce(&mut self, id: NodeId, op: ReduceOp, axes: &[usize]) -> Result<(), Error> {
        let g = self.g;
        let node = &g.nodes[id];
        let name = node.name.clone();
        let rank = node.shape.len();
        let mut x = self.value(node.inputs[0])?;
        // Physical order of a dense input; the reduced axes must be one block of it.
        let reduced = |d: usize| axes.contains(&d);
        let dense = is_dense(&x);
        let mut order = physical_order(&x);
        let block_ok = |order: &[usize], xs: &[usize]| {
            let pos: Vec<usize> =
                order.iter().enumerate().filter(|(_, d)| reduced(**d) && xs[**d] != 1).map(|(i, _)| i).collect();
            pos.windows(2).all(|w| w[1] == w[0] + 1)
        };
        if !dense || x.dtype != self.dtype || !block_ok(&order, &x.shape) {
            // Kept axes first (logical order), reduced axes last.
            let mut o: Vec<usize> = (0..rank).filter(|d| !reduced(*d)).collect();
            o.extend(axes.iter().copied());
            x = self.copy(&format!("{name}.for_reduce"), &x, None, &o, self.dtype);
            order = o;
        }
        let sizes: Vec<usize> = order.iter().map(|&d| x.shape[d]).collect();
        let first = order.iter().position(|&d| reduced(d) && x.shape[d] != 1);
        let (outer, red, inner) = match first {
            None => (element_count(&x.shape), 1, 1),
            Some(f) => {
                let count = order.iter().filter(|&&d| reduced(d) && x.shape[d] != 1).count();
                let outer: usize = sizes[..f].iter().product();
                let red: usize = sizes[f..f + count].iter().product();
                let inner: usize = sizes[f + count..].iter().product();
                (outer, red, inner)
            }
        };
        // x's first element must be the buffer view's origin of the dense block.
        let kind = match op {
            ReduceOp::Sum => ReduceKind::Sum,
            ReduceOp::Mean => ReduceKind::Mean,
            ReduceOp::Max => ReduceKind::Max,
            ReduceOp::Min => ReduceKind::Min,
        };
        let kept_order: Vec<usize> = order.iter().copied().filter(|d| !reduced(*d)).chain(axes.iter().copied()).collect();
        let wanted = self.out_view(id, &kept_order);
        let expected = View { strides: strides_for_order(&node.shape, &kept_order), ..wanted.clone() };
        let mut out = if wanted.same_place(&expected)
            && wanted.offset == 0
            && wanted.dtype == self.dtype
            && self.bufs[wanted.buf].kind == BufKind::Arena
        {
            wanted
        } else {
            self.fresh(&node.shape, &kept_order, self.dtype)
        };
        // A long axis with few outputs: each chunk first, then the chunks (`reduce_chunks`).
        let chunks = reduce_chunks(outer * inner, red, inner);
        let (x, red) = if chunks > 1 {
            let mut part = self.fresh(&[outer, chunks, inner], &[0, 1, 2], self.dtype);
            let p = ReduceParams {
                kind,
                outer: (outer * chunks) as u32,
                reduce: (red / chunks) as u32,
                inner: inner as u32,
                elems_per_block: reduce_elems_per_block(outer * chunks * inner),
            };
            let l = self.push_launch(&format!("{name}.chunks"), Kernel::Reduce(p), self.dtype, vec![x, part.clone()], 1);
            part.writers = vec![l];
            (part, chunks)
        } else {
            (x, red)
        };
        let p = ReduceParams {
            kind,
            outer: outer as u32,
            reduce: red as u32,
            inner: inner as u32,
            elems_per_block: reduce_elems_per_block(outer * inner),
        };
        let l = self.push_launch(&name, Kernel::Reduce(p), self.dtype, vec![x, out.clone()], 1);
        out.writers = vec![l];
        self.set_value(id, out);
        Ok(())
    }

    fn emit_gather(&mut self, id: NodeId, axis: usize) -> Result<(), Error> {
        let g = self.g;
        let node = &g.nodes[id];
        let name = node.name.clone();
        let (data, indices) = (node.inputs[0], node.inputs[1]);
        let table_shape = &g.nodes[data].shape;
        if axis != 0 || table_shape.len() != 2 || g.nodes[data].dtype == DType::I64 {
            return Err(unsupported(g, id, "only row lookups (axis 0 of a 2-D float table) are supported"));
        }
        let (rows, cols) = (table_shape[0], table_shape[1]);
        let tv = if g.konst(data).is_some() {
            // An embedding table: read from the weights.
            self.const_view(data, Transform::AsIs)?
        } else {
            // A computed table (an ONNX GatherND of constant indices): rows read from the arena.
            let v = self.value(data)?;
            if v.is_contiguous() && v.dtype == self.dtype {
                v
            } else {
                let order = identity(table_shape.len());
                self.copy(&format!("{name}.table"), &v, None, &order, self.dtype)
            }
        };
        let iv = self.value(indices)?;
        if iv.dtype != DType::I64 || !iv.is_contiguous() {
            return Err(unsupported(g, id, "indices must be contiguous int64"));
        }
        let count = element_count(&iv.shape);
        let wanted = self.out_view(id, &identity(node.shape.len()));
        let mut out = if wanted.is_contiguous() && wanted.dtype == self.dtype {
            wanted
        } else {
            self.fresh(&node.shape, &identity(node.shape.len()), self.dtype)
        };
        let p = GatherParams { count: count as u32, table_rows: rows as u32, cols: cols as u32, rows_per_block: 1 };
        let l = self.push_launch(&name, Kernel::Gather(p), self.dtype, vec![tv, iv, out.clone()], 2);
        out.writers = vec![l];
        self.set_value(id, out);
        Ok(())
    }

    /// Every graph output lands row-major in its output buffer.
    fn finish_outputs(&mut self) -> Result<(), Error> {
        for (k, o) in self.g.outputs.iter().enumerate() {
            let v = self.value(o.node)?;
            let dtype = self.g.nodes[o.node].dtype;
            if dtype == DType::I64 {
                return Err(unsupported(self.g, o.node, "an int64 model output"));
            }
            if self.bufs[v.buf].kind == BufKind::Output(k as u32) && v.is_contiguous() && v.offset == 0 {
                continue;
            }
            let shape = self.g.nodes[o.node].shape.clone();
            let buf = self.new_buf(BufKind::Output(k as u32), element_count(&shape).max(1), dtype);
            let dst = View { buf, offset: 0, strides: strides_of(&shape), shape, dtype, writers: Vec::new() };
            self.copy(&format!("{}.output", o.name), &v, Some(dst), &[], dtype);
        }
        Ok(())
    }

    // ---- assembly ----------------------------------------------------------------------------

    fn assemble(self) -> Result<Plan, Error> {
        let g = self.g;
        let launches_n = self.launches.len();
        // Weight blob in launch order: each launch's new entries form its layer.
        let mut order: Vec<usize> = (0..self.entries.len()).filter(|&e| self.entries[e].first_use.is_some()).collect();
        order.sort_by_key(|&e| (self.entries[e].first_use.unwrap(), e));
        let mut entry_offset = vec![0u64; self.entries.len()];
        let mut blob_len = 0u64;
        let mut layers: Vec<Layer> = Vec::new();
        let mut layer_of_launch: Vec<Option<u32>> = vec![None; launches_n];
        for &e in &order {
            let l = self.entries[e].first_use.unwrap() as usize;
            blob_len = blob_len.next_multiple_of(BUFFER_ALIGN_BYTES);
            entry_offset[e] = blob_len;
            match layer_of_launch[l] {
                Some(li) => {
                    let layer = &mut layers[li as usize];
                    layer.len_bytes = blob_len + self.entries[e].bytes.len() as u64 - layer.offset_bytes;
                }
                None => {
                    layer_of_launch[l] = Some(layers.len() as u32);
                    layers.push(Layer {
                        name: self.launches[l].name.clone(),
                        offset_bytes: blob_len,
                        len_bytes: self.entries[e].bytes.len() as u64,
                    });
                }
            }
            blob_len += self.entries[e].bytes.len() as u64;
        }
        let mut blob = AlignedBytes::zeroed(blob_len as usize);
        for &e in &order {
            let o = entry_offset[e] as usize;
            blob.as_mut_slice()[o..o + self.entries[e].bytes.len()].copy_from_slice(&self.entries[e].bytes);
        }

        // Arena: interval packing of buffers over [first write, last access].
        let mut arena: Vec<usize> =
            (0..self.bufs.len()).filter(|&b| self.bufs[b].kind == BufKind::Arena && self.bufs[b].last_access.is_some()).collect();
        for &b in &arena {
            if self.bufs[b].first_write.is_none() {
                return Err(Error::Invalid(format!("model '{}': an arena buffer is read before anything writes it", g.name)));
            }
        }
        arena.sort_by_key(|&b| std::cmp::Reverse(self.bufs[b].elems * self.bufs[b].dtype.size_bytes()));
        let mut buf_offset = vec![0u64; self.bufs.len()];
        let mut placed: Vec<(u64, u64, u32, u32)> = Vec::new(); // (start, end, first, last)
        let mut arena_bytes = 0u64;
        for &b in &arena {
            let size = (self.bufs[b].elems * self.bufs[b].dtype.size_bytes()) as u64;
            let (first, last) = (self.bufs[b].first_write.unwrap(), self.bufs[b].last_access.unwrap());
            let mut live: Vec<(u64, u64)> = placed.iter().filter(|p| p.2 <= last && first <= p.3).map(|p| (p.0, p.1)).collect();
            live.sort();
            let mut offset = 0u64;
            for (s, e) in live {
                if offset + size <= s {
                    break;
                }
                offset = offset.max(e.next_multiple_of(BUFFER_ALIGN_BYTES));
            }
            buf_offset[b] = offset;
            placed.push((offset, offset + size, first, last));
            arena_bytes = arena_bytes.max(offset + size);
        }
        for (b, buf) in self.bufs.iter().enumerate() {
            if let BufKind::Weights(e) = buf.kind {
                buf_offset[b] = entry_offset[e];
            }
        }

        // Hazards of arena reuse: whoever writes a buffer waits for every earlier user of memory it overlaps.
        let mut hazard: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); launches_n];
        for &b in &arena {
            let size = (self.bufs[b].elems * self.bufs[b].dtype.size_bytes()) as u64;
            let (bs, be) = (buf_offset[b], buf_offset[b] + size);
            let first = self.bufs[b].first_write.unwrap();
            for &a in &arena {
                if a == b || self.bufs[a].last_access.unwrap() >= first {
                    continue;
                }
                let asz = (self.bufs[a].elems * self.bufs[a].dtype.size_bytes()) as u64;
                if buf_offset[a] < be && bs < buf_offset[a] + asz {
                    for &w in &self.bufs[b].accessors {
                        hazard[w as usize].extend(self.bufs[a].accessors.iter().copied().filter(|&x| x < w));
                    }
                }
            }
        }

        let space = |kind: BufKind| match kind {
            BufKind::Arena => Space::Arena,
            BufKind::Weights(_) => Space::Weights,
            BufKind::Input(i) => Space::Input(i),
            BufKind::Output(i) => Space::Output(i),
        };
        let mut launches = Vec::with_capacity(launches_n);
        for (i, p) in self.launches.into_iter().enumerate() {
            let args = p
                .args
                .iter()
                .map(|v| {
                    let size = v.dtype.size_bytes() as u64;
                    BufRef {
                        space: space(self.bufs[v.buf].kind),
                        offset_bytes: buf_offset[v.buf] + v.offset as u64 * size,
                        len_bytes: v.extent().max(1) as u64 * size,
                    }
                })
                .collect();
            let mut deps: BTreeSet<u32> = p.deps;
            deps.extend(hazard[i].iter().copied());
            deps.remove(&(i as u32));
            let logical_blocks = p.kernel.logical_blocks();
            let threads = threads_for(&p.kernel, p.dtype);
            launches.push(Launch {
                name: p.name,
                flops: p.kernel.flops(),
                bytes: p.kernel.bytes_moved(p.dtype),
                kernel: p.kernel,
                dtype: p.dtype,
                shape: LaunchShape {
                    logical_blocks,
                    threads_per_block: threads,
                    shared_mem_bytes: smem_for(&p.kernel, p.dtype, threads),
                },
                args,
                deps: deps.into_iter().collect(),
                layer: layer_of_launch[i],
            });
        }
        let inputs = g
            .inputs
            .iter()
            .map(|i| IoTensor { name: i.name.clone(), shape: g.nodes[i.node].shape.clone(), dtype: g.nodes[i.node].dtype })
            .collect();
        let outputs = g
            .outputs
            .iter()
            .map(|o| IoTensor { name: o.name.clone(), shape: g.nodes[o.node].shape.clone(), dtype: g.nodes[o.node].dtype })
            .collect();
        let plan = Plan {
            model: g.name.clone(),
            dtype: self.dtype,
            inputs,
            outputs,
            launches,
            arena_bytes: arena_bytes.next_multiple_of(BUFFER_ALIGN_BYTES),
            weight_bytes: blob_len,
            layers,
            weights: std::sync::Arc::new(blob),
        };
        plan.validate().map_err(|e| Error::Invalid(format!("model '{}': lowering produced an invalid plan: {e}", g.name)))?;
        Ok(plan)
    }
}

/// Axes of a view from the largest stride to the smallest (size-1 axes last).
fn physical_order(v: &View) -> Vec<usize> {
    let mut order: Vec<usize> = (0..v.shape.len()).collect();
    order.sort_by(|&a, &b| {
        let ka = (v.shape[a] != 1, v.strides[a]);
        let kb = (v.shape[b] != 1, v.strides[b]);
        kb.cmp(&ka).then(a.cmp(&b))
    });
    order
}

/// Whether a view covers a dense block of its buffer in some axis order.
fn is_dense(v: &View) -> bool {
    let order = physical_order(v);
    let mut s = 1;
    for &d in order.iter().rev() {
        if v.shape[d] == 1 {
            continue;
        }
        if v.strides[d] != s {
            return false;
        }
        s *= v.shape[d];
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_outputs_spread_over_blocks() {
        assert_eq!(reduce_elems_per_block(32), 8);
        assert_eq!(reduce_elems_per_block(2048), 16);
        assert_eq!(reduce_elems_per_block(12_544), 64);
        assert_eq!(reduce_elems_per_block(1 << 20), REDUCE_ELEMS_PER_BLOCK);
    }

    #[test]
    fn direct_convolutions_give_each_thread_one_output() {
        for out_c in [1, 16, 24, 32, 96, 144, 672, 1024, 2048] {
            let (tm, tn) = direct_conv_tile(out_c);
            assert!(tm * tn <= THREADS && tm * tn > THREADS / 2, "{out_c} channels: {tm} x {tn}");
        }
        assert_eq!(direct_conv_tile(96), (8, 32));
        assert_eq!(direct_conv_tile(1024), (4, 64));
        assert_eq!(direct_conv_tile(24), (10, 24));
    }

    #[test]
    fn long_reductions_with_few_outputs_go_in_two_launches() {
        // EfficientNet-B0's first squeeze-excitation pool: 32 channels over 112 x 112.
        assert_eq!(reduce_chunks(32, 12544, 32), 392);
        // EfficientNet's 56 x 56 x 144 pool: 98 chunks of 32.
        assert_eq!(reduce_chunks(144, 3136, 144), 98);
        // MobileNet v3's 28 x 28 x 72 pool: 8 outputs a block, 32 threads each walk 25 elements.
        assert_eq!(reduce_chunks(72, 784, 72), 1);
        // ResNet-50's 7 x 7 x 2048 pool, a BERT row (contiguous, a warp each): one launch.
        assert_eq!(reduce_chunks(2048, 49, 2048), 1);
        assert_eq!(reduce_chunks(128, 768, 1), 1);
        // A contiguous axis long enough for a warp to walk it slowly: cut.
        assert_eq!(reduce_chunks(1, 1 << 20, 1), 16384);
        // Enough outputs to fill the GPU anyway, or an axis that no chunk length divides: one.
        assert_eq!(reduce_chunks(64 * 256, 4096, 64 * 256), 1);
        assert_eq!(reduce_chunks(8, 65_537, 8), 1);
    }

    #[test]
    fn batches_sharing_the_weight_fold_into_rows() {
        // [T = 197, B = 1, E = 768] x [768, 2304]: 197 batches of one row -> one product of 197 rows.
        let mut dims = vec![(197, vec![768, 0, 2304])];
        let (mut m, mut rows) = (1, vec![768 * 197, 0, 2304 * 197]);
        fold_shared_rhs_batches(&mut dims, &mut m, &mut rows);
        assert_eq!((dims.len(), m, rows), (0, 197, vec![768, 0, 2304]));
        // [1, 56, 56, 96] channels-last: batch 56 of 56 rows whose rows continue -> 3136 rows.
        let mut dims = vec![(56, vec![56 * 96, 0, 56 * 384])];
        let (mut m, mut rows) = (56, vec![96, 0, 384]);
        fold_shared_rhs_batches(&mut dims, &mut m, &mut rows);
        assert_eq!((dims.len(), m, rows), (0, 3136, vec![96, 0, 384]));
        // Two batch dims, the outer one also continuing: both fold.
        let mut dims = vec![(2, vec![12 * 16, 0, 12 * 8]), (3, vec![4 * 16, 0, 4 * 8])];
        let mut m = 4;
        let mut rows = vec![16, 0, 8];
        fold_shared_rhs_batches(&mut dims, &mut m, &mut rows);
        assert_eq!((dims.len(), m), (0, 24));
        // The weight differs per batch (attention scores): nothing folds.
        let mut dims = vec![(12, vec![197 * 64, 197 * 64, 197 * 197])];
        let mut m = 197;
        let mut rows = vec![64, 0, 197];
        fold_shared_rhs_batches(&mut dims, &mut m, &mut rows);
        assert_eq!((dims.len(), m), (1, 197));
        // Rows that do not continue across the batch (a transposed input): nothing folds.
        let mut dims = vec![(4, vec![16, 0, 5 * 24])];
        let mut m = 5;
        let mut rows = vec![64, 0, 24];
        fold_shared_rhs_batches(&mut dims, &mut m, &mut rows);
        assert_eq!((dims.len(), m), (1, 5));
        // The outer dim stops the fold where its rows do not continue; the inner one still folds.
        let mut dims = vec![(2, vec![1000, 0, 12 * 8]), (3, vec![4 * 16, 0, 4 * 8])];
        let mut m = 4;
        let mut rows = vec![16, 0, 8];
        fold_shared_rhs_batches(&mut dims, &mut m, &mut rows);
        assert_eq!((dims.len(), m, rows), (1, 12, vec![16, 0, 8]));
    }

    #[test]
    fn split_k_goes_to_long_fp16_reductions_only() {
        // VGG-19's 28x28 3x3 convolution over 512 channels: K = 4608, 208 tiles -> 4 slices.
        assert_eq!(split_k_for(DType::F16, 208, 784, 4608), 4);
        // The block cap: 600 tiles leave room for one more slice only.
        assert_eq!(split_k_for(DType::F16, 600, 784, 4608), 1);
        assert_eq!(split_k_for(DType::F16, 24, 16, 3072), 3);
        assert_eq!(split_k_for(DType::F16, 24, 16, 30_000), SPLIT_K_MAX);
        // Short reductions, f32, small-M products: never.
        assert_eq!(split_k_for(DType::F16, 24, 16, 2047), 1);
        assert_eq!(split_k_for(DType::F32, 24, 16, 4608), 1);
        assert_eq!(split_k_for(DType::F16, 24, SMALL_M_ROWS, 4608), 1);
    }
}

//! CUDA sources of the kernel library and the host side of their calling convention.
//!
//! Every kernel is `extern "C" __global__ void <name>_<f32|f16>(KairosProto P, <Args> A)`: the
//! protocol parameters of `cuda/protocol.cuh` (launch slot, preempt flag, notification ring, SM
//! mask, logical-block range), then the kernel's own parameter struct (argument pointers, then
//! its parameters), both passed by value. The sources are embedded here with `include_str!`;
//! the runtime (`kairos-cuda`) compiles one module per family with NVRTC, handing it the headers
//! by name, so no CUDA include path is needed at all (fp16 is converted with PTX `cvt`).
//!
//! The structs below mirror the C structs byte for byte: every field is aligned to its own size
//! and the struct is padded to 8 bytes, as C lays them out; each C struct has a `static_assert` on
//! its size and [`pack_args`] checks the same size here.

use kairos_core::DType;
use kairos_core::graph::Act;
use kairos_core::plan::{
    BinaryOpParam, EltFunc, Kernel, LaunchError, LaunchShape, PoolKindParam, ReduceKind, UnaryOpParam, split_k_len,
};

/// The headers every module may include, by the name the sources include them under.
pub const HEADERS: [(&str, &str); 3] = [
    ("kairos/protocol.cuh", include_str!("../cuda/protocol.cuh")),
    ("kairos/common.cuh", include_str!("../cuda/common.cuh")),
    ("kairos/tile.cuh", include_str!("../cuda/tile.cuh")),
];

/// The compilation units of the library: one NVRTC module each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Module {
    Conv,
    Gemm,
    Pool,
    Norm,
    Reduce,
    Gather,
    Eltwise,
    /// Runtime helpers and measurement kernels (spin, noop, empty, SM map, clock).
    Util,
}

impl Module {
    pub const ALL: [Module; 8] =
        [Module::Conv, Module::Gemm, Module::Pool, Module::Norm, Module::Reduce, Module::Gather, Module::Eltwise, Module::Util];

    pub fn name(self) -> &'static str {
        match self {
            Module::Conv => "conv",
            Module::Gemm => "gemm",
            Module::Pool => "pool",
            Module::Norm => "norm",
            Module::Reduce => "reduce",
            Module::Gather => "gather",
            Module::Eltwise => "eltwise",
            Module::Util => "util",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Module::Conv => include_str!("../cuda/conv.cu"),
            Module::Gemm => include_str!("../cuda/gemm.cu"),
            Module::Pool => include_str!("../cuda/pool.cu"),
            Module::Norm => include_str!("../cuda/norm.cu"),
            Module::Reduce => include_str!("../cuda/reduce.cu"),
            Module::Gather => include_str!("../cuda/gather.cu"),
            Module::Eltwise => include_str!("../cuda/eltwise.cu"),
            Module::Util => include_str!("../cuda/util.cu"),
        }
    }

    /// The kernels of the module (the base names of its entries; none for [`Module::Util`]).
    pub fn kernels(self) -> &'static [&'static str] {
        match self {
            Module::Conv => &["conv2d", "dwconv2d"],
            Module::Gemm => &["gemm"],
            Module::Pool => &["pool2d"],
            Module::Norm => &["softmax", "layernorm"],
            Module::Reduce => &["reduce", "splitk_sum"],
            Module::Gather => &["gather"],
            Module::Eltwise => &["eltwise"],
            Module::Util => &[],
        }
    }

    /// Whether the module is compiled one [`EntryKind`] per [`Unit`] (the tensor-core modules,
    /// which took about 300 s each as one program on an H100 host's core).
    pub fn split_by_entry(self) -> bool {
        matches!(self, Module::Conv | Module::Gemm)
    }

    /// The `extern "C"` functions the module defines.
    pub fn functions(self) -> Vec<String> {
        if self == Module::Util {
            return UTIL_FUNCTIONS.iter().map(|s| s.to_string()).collect();
        }
        let kernels = self.kernels();
        let mut f: Vec<String> = kernels.iter().flat_map(|k| [format!("{k}_f32"), format!("{k}_f16")]).collect();
        for k in kernels.iter().filter(|k| TENSOR_CORE_KERNELS.contains(k)) {
            let others = EntryKind::ALL.into_iter().filter(|e| !matches!(e, EntryKind::F32 | EntryKind::F16));
            f.extend(others.map(|e| format!("{k}{}", e.suffix())));
        }
        f
    }
}

/// The entry kinds of the tensor-core modules: one compilation [`Unit`] each (the C side selects
/// them with `-DKAIROS_ENTRIES=<mask>`, common.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntryKind {
    F32,
    F16,
    F16n,
    /// The wide entries, one per activation class of the epilogue (none, ReLU, any other).
    F16wNone,
    F16wRelu,
    F16wAct,
    /// The small-M path alone, 256- and 128-thread CTAs.
    Gv,
    Gvn,
    SkF32,
    SkF16,
    SkF16n,
    /// The split-K small-M path alone, 256- and 128-thread CTAs.
    SkGv,
    SkGvn,
}

impl EntryKind {
    pub const ALL: [EntryKind; 13] = [
        EntryKind::F32,
        EntryKind::F16,
        EntryKind::F16n,
        EntryKind::F16wNone,
        EntryKind::F16wRelu,
        EntryKind::F16wAct,
        EntryKind::Gv,
        EntryKind::Gvn,
        EntryKind::SkF32,
        EntryKind::SkF16,
        EntryKind::SkF16n,
        EntryKind::SkGv,
        EntryKind::SkGvn,
    ];

    /// The suffix of the entry functions of this kind (`gemm` + `_f16w_relu`).
    pub fn suffix(self) -> &'static str {
        match self {
            EntryKind::F32 => "_f32",
            EntryKind::F16 => "_f16",
            EntryKind::F16n => "_f16n",
            EntryKind::F16wNone => "_f16w_none",
            EntryKind::F16wRelu => "_f16w_relu",
            EntryKind::F16wAct => "_f16w_act",
            EntryKind::Gv => "_gv",
            EntryKind::Gvn => "_gvn",
            EntryKind::SkF32 => "_sk_f32",
            EntryKind::SkF16 => "_sk_f16",
            EntryKind::SkF16n => "_sk_f16n",
            EntryKind::SkGv => "_sk_gv",
            EntryKind::SkGvn => "_sk_gvn",
        }
    }

    /// The wide entry of an epilogue's activation class.
    pub fn wide(act: Act) -> EntryKind {
        match act {
            Act::None => EntryKind::F16wNone,
            Act::Relu => EntryKind::F16wRelu,
            _ => EntryKind::F16wAct,
        }
    }

    /// The launch bounds of the entries of this kind (common.cuh, `KAIROS_ENTRY_*`): threads per
    /// CTA and the CTAs per SM ptxas must fit, which bound the registers of every build of them.
    pub fn launch_bounds(self) -> (u32, u32) {
        match self {
            EntryKind::F32 | EntryKind::F16 | EntryKind::Gv | EntryKind::SkF32 | EntryKind::SkF16 | EntryKind::SkGv => (256, 2),
            EntryKind::F16n | EntryKind::Gvn | EntryKind::SkF16n | EntryKind::SkGvn => (128, 3),
            EntryKind::F16wNone | EntryKind::F16wRelu | EntryKind::F16wAct => (128, 2),
        }
    }

    /// The most registers per thread ptxas may give an entry of this kind: its launch bounds' share
    /// of the SM's 64 Ki registers, in the allocation's steps of 8, at most 255 (128 for 256-thread
    /// entries at 2 CTAs per SM, 168 for 128 threads at 3, 255 for 128 threads at 2).
    pub fn registers_max(self) -> u32 {
        let (threads, ctas) = self.launch_bounds();
        (65_536 / (threads * ctas) / 8 * 8).min(255)
    }

    /// The bit of `KAIROS_ENTRIES` (common.cuh: `KAIROS_E_*`).
    pub fn mask(self) -> u32 {
        1 << (self as u32)
    }

    pub fn from_suffix(suffix: &str) -> Option<EntryKind> {
        EntryKind::ALL.into_iter().find(|k| k.suffix() == suffix)
    }
}

/// The NVRTC option of a unit's quick build ([`Unit::has_quick_build`]): NVRTC 13 on one core
/// compiled the whole library in 52 s of CPU time with it (the slowest unit, conv_f16, in 5.6 s)
/// against several minutes optimized.
pub const QUICK_BUILD_OPTION: &str = "--Ofast-compile=mid";

/// A compilation unit: one NVRTC program and one module image. The small modules are one unit
/// each; the tensor-core modules ([`Module::split_by_entry`]) are one unit per [`EntryKind`], so
/// their entries compile in parallel (each alone takes a fraction of the whole module's time) and a
/// model compiles only the units its plan launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub module: Module,
    /// The one entry kind this unit compiles; `None`: the whole module.
    pub entry: Option<EntryKind>,
}

impl Unit {
    /// Every unit of the library.
    pub fn all() -> Vec<Unit> {
        Module::ALL.into_iter().flat_map(Unit::of_module).collect()
    }

    /// The units of one module.
    pub fn of_module(module: Module) -> Vec<Unit> {
        if module.split_by_entry() {
            EntryKind::ALL.into_iter().map(|k| Unit { module, entry: Some(k) }).collect()
        } else {
            vec![Unit { module, entry: None }]
        }
    }

    /// `gemm_f16w_relu`, `eltwise`: names the cache files and the progress lines.
    pub fn name(self) -> String {
        match self.entry {
            Some(k) => format!("{}{}", self.module.name(), k.suffix()),
            None => self.module.name().to_string(),
        }
    }

    /// The unit a name of [`Unit::name`] names.
    pub fn by_name(name: &str) -> Option<Unit> {
        Unit::all().into_iter().find(|u| u.name() == name)
    }

    /// The preprocessor definition that selects this unit's entries, if it is not a whole module.
    pub fn define(self) -> Option<String> {
        self.entry.map(|k| format!("-DKAIROS_ENTRIES={}", k.mask()))
    }

    /// The `extern "C"` functions this unit defines.
    pub fn functions(self) -> Vec<String> {
        let all = self.module.functions();
        match self.entry {
            None => all,
            Some(k) => {
                let bases = self.module.kernels();
                all.into_iter().filter(|f| bases.iter().any(|b| f.strip_prefix(b) == Some(k.suffix()))).collect()
            }
        }
    }

    /// About how long the unit takes to compile, in seconds on one core of an H100 host with 16
    /// units compiling at once (NVRTC 13, sm_90, 2026-11-25). Only the order matters: parallel
    /// compiles start the longest first, so the last to finish is not a long one started late.
    pub fn compile_cost_s(self) -> u32 {
        match self.entry {
            Some(EntryKind::F16) => 50,
            Some(EntryKind::F16wNone | EntryKind::F16wRelu | EntryKind::F16wAct) => 42,
            Some(EntryKind::SkF16n) => 16,
            Some(EntryKind::SkF16) => 20,
            Some(EntryKind::SkGv | EntryKind::SkGvn) => 25,
            Some(EntryKind::F16n) => 28,
            Some(EntryKind::Gv | EntryKind::Gvn) => 25,
            Some(EntryKind::F32) => 13,
            Some(EntryKind::SkF32) => 3,
            None => 3,
        }
    }

    /// Whether the unit also has a quick build (compiled with [`QUICK_BUILD_OPTION`], slower
    /// code in a fraction of the time) that serves while its optimized build compiles: the units of
    /// the tensor-core modules, which take 10-60 s each to optimize.
    pub fn has_quick_build(self) -> bool {
        self.entry.is_some()
    }

    /// The unit that defines a launch's entry function.
    pub fn of_entry(module: Module, key: EntryKey) -> Unit {
        let entry = if module.split_by_entry() { EntryKind::from_suffix(key.suffix) } else { None };
        Unit { module, entry }
    }
}

/// The unit that holds a launch's entry function (see [`function_name`]).
pub fn unit_of(kernel: &Kernel, dtype: DType, threads_per_cta: u32) -> Result<Unit, LaunchError> {
    Ok(Unit::of_entry(module_of(kernel), entry_key(kernel, dtype, threads_per_cta)?))
}

/// The units of every entry the autotuner may try for a kernel at a dtype: the plan's own and the
/// other CTA sizes and tiles of its candidates (fp16 tensor-core kernels: `_f16`, `_f16n`, the
/// wide entry of its activation class and, for products of at most [`GV_ROWS_MAX`] rows, the
/// small-M entries; or their split-K entries; otherwise the one entry of the dtype).
pub fn tuning_units(kernel: &Kernel, dtype: DType) -> Vec<Unit> {
    let module = module_of(kernel);
    let sk = kernel.is_split_k();
    let kinds: Vec<EntryKind> = match dtype {
        DType::F16 if uses_tensor_cores(kernel, dtype) && sk => {
            let mut k = vec![EntryKind::SkF16, EntryKind::SkF16n];
            let rows = match kernel {
                Kernel::Conv2d(p) => p.gemm_m(),
                Kernel::Gemm(p) => p.m,
                _ => u32::MAX,
            };
            if is_small_m(kernel) || rows <= GV_ROWS_MAX {
                k.extend([EntryKind::SkGv, EntryKind::SkGvn]);
            }
            k
        }
        DType::F16 if uses_tensor_cores(kernel, dtype) => {
            let mut k = vec![EntryKind::F16, EntryKind::F16n, EntryKind::wide(epilogue_act(kernel))];
            let rows = match kernel {
                Kernel::Conv2d(p) => p.gemm_m(),
                Kernel::Gemm(p) => p.m,
                _ => u32::MAX,
            };
            if is_small_m(kernel) || rows <= GV_ROWS_MAX {
                k.extend([EntryKind::Gv, EntryKind::Gvn]);
            }
            k
        }
        DType::F16 if sk => vec![EntryKind::SkF16],
        DType::F16 => vec![EntryKind::F16],
        DType::F32 if sk => vec![EntryKind::SkF32],
        _ => vec![EntryKind::F32],
    };
    let mut units: Vec<Unit> =
        kinds.into_iter().map(|k| Unit::of_entry(module, EntryKey { base: kernel.name(), suffix: k.suffix() })).collect();
    units.dedup();
    units
}

/// Kernels with a tensor-core fp16 engine, which also have a `<name>_f16n` entry for small CTAs,
/// `<name>_f16w_<none|relu|act>` entries for large tiles on 128-thread CTAs, `<name>_gv` and
/// `<name>_gvn` for the small-M path, and split-K entries `<name>_sk_<f32|f16|f16n>` (and
/// `<name>_sk_gv` / `<name>_sk_gvn` for small-M split-K products) for launches with `split_k` > 1.
pub const TENSOR_CORE_KERNELS: [&str; 2] = ["conv2d", "gemm"];
/// CTAs of at most this many threads run a tensor-core kernel's `_f16n` entry (launch bound
/// 128 threads, 3 CTAs per SM: up to 168 registers per thread instead of 128).
pub const TC_NARROW_THREADS_MAX: u32 = 128;
/// Tensor-core launches of [`TC_WIDE_THREADS`] threads whose tile holds at least this many outputs
/// per warp run a `_f16w_*` entry (64 x 64 warp tiles, launch bound 128 threads and 2 CTAs per SM:
/// up to 255 registers per thread for 128 accumulators).
pub const TC_WIDE_OUTPUTS_PER_WARP_MIN: u32 = 64 * 64;
/// The CTA size of the `_f16w_*` entries.
pub const TC_WIDE_THREADS: u32 = 128;

/// Functions of [`Module::Util`].
pub const UTIL_FUNCTIONS: [&str; 6] =
    ["kairos_spin", "kairos_noop", "kairos_empty", "kairos_smmap", "kairos_clock", "kairos_gpcmap"];

/// The module that holds a plan kernel.
pub fn module_of(kernel: &Kernel) -> Module {
    match kernel {
        Kernel::Conv2d(_) | Kernel::DepthwiseConv2d(_) => Module::Conv,
        Kernel::Gemm(_) => Module::Gemm,
        Kernel::Pool2d(_) => Module::Pool,
        Kernel::Softmax(_) | Kernel::LayerNorm(_) => Module::Norm,
        Kernel::Reduce(_) | Kernel::SplitKSum(_) => Module::Reduce,
        Kernel::Gather(_) => Module::Gather,
        Kernel::Eltwise(_) => Module::Eltwise,
    }
}

/// The CUDA function of a kernel at a launch dtype and CTA size: `<name>_<f32|f16>`, or for
/// tensor-core launches (not split-K) `<name>_gv` / `<name>_gvn` for small-M products
/// ([`is_small_m`]; `_gvn` at most [`TC_NARROW_THREADS_MAX`] threads), `<name>_f16w_<none|relu|act>`
/// (the epilogue's activation class) when the CTA has [`TC_WIDE_THREADS`] threads and the tile at
/// least [`TC_WIDE_OUTPUTS_PER_WARP_MIN`] outputs per warp, else `<name>_f16n` at most
/// [`TC_NARROW_THREADS_MAX`] threads; split-K launches take the `<name>_sk_` entries (`_sk_gv` /
/// `_sk_gvn` for small-M products, else `_sk_f16n` at most [`TC_NARROW_THREADS_MAX`] threads,
/// `_sk_f16`).
pub fn function_name(kernel: &Kernel, dtype: DType, threads_per_cta: u32) -> Result<String, LaunchError> {
    entry_key(kernel, dtype, threads_per_cta).map(|k| format!("{}{}", k.base, k.suffix))
}

/// What names a launch's entry function without building the name: the kernel's base name and the
/// entry's suffix (`function_name` is the two joined). A small `Copy` key for per-launch lookups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryKey {
    pub base: &'static str,
    pub suffix: &'static str,
}

/// The entry key of a launch (see [`function_name`]).
pub fn entry_key(kernel: &Kernel, dtype: DType, threads_per_cta: u32) -> Result<EntryKey, LaunchError> {
    let base = kernel.name();
    let sk = kernel.is_split_k();
    let kind = match dtype {
        DType::F16 if uses_tensor_cores(kernel, dtype) && !sk => {
            if is_small_m(kernel) {
                if threads_per_cta <= TC_NARROW_THREADS_MAX { EntryKind::Gvn } else { EntryKind::Gv }
            } else if is_wide(kernel, threads_per_cta) {
                EntryKind::wide(epilogue_act(kernel))
            } else if threads_per_cta <= TC_NARROW_THREADS_MAX {
                EntryKind::F16n
            } else {
                EntryKind::F16
            }
        }
        DType::F16 if uses_tensor_cores(kernel, dtype) && is_small_m(kernel) => {
            if threads_per_cta <= TC_NARROW_THREADS_MAX {
                EntryKind::SkGvn
            } else {
                EntryKind::SkGv
            }
        }
        DType::F16 if uses_tensor_cores(kernel, dtype) && threads_per_cta <= TC_NARROW_THREADS_MAX => EntryKind::SkF16n,
        DType::F16 if sk => EntryKind::SkF16,
        DType::F16 => EntryKind::F16,
        DType::F32 if sk => EntryKind::SkF32,
        DType::F32 => EntryKind::F32,
        DType::I64 => return Err(LaunchError::NoVariant { kernel: base, dtype }),
    };
    Ok(EntryKey { base, suffix: kind.suffix() })
}

/// Rows per tile up to which a tensor-core product with B's k contiguous runs the small-M path
/// (tile.cuh: GV_ROWS_MAX; the plan gives such tiles to products of at most
/// `kairos_ir::lower::emit::SMALL_M_ROWS` rows).
pub const GV_ROWS_MAX: u32 = 8;

/// Whether a tensor-core launch runs the small-M entries (`_gv`, `_gvn`): tiles of at most
/// [`GV_ROWS_MAX`] rows and B's k contiguous (gemm: not stored [k][n]; conv weights always are).
pub fn is_small_m(kernel: &Kernel) -> bool {
    match kernel {
        Kernel::Conv2d(p) => p.tile_m <= GV_ROWS_MAX,
        Kernel::Gemm(p) => p.tile_m <= GV_ROWS_MAX && !(p.b_stride_k != 1 && p.b_stride_n == 1),
        _ => false,
    }
}

/// Whether a tensor-core launch of this tile and CTA size runs a `_f16w_*` entry (see
/// [`function_name`]).
pub fn is_wide_tile(tile_m: u32, tile_n: u32, threads_per_cta: u32) -> bool {
    threads_per_cta == TC_WIDE_THREADS && tile_m * tile_n >= TC_WIDE_OUTPUTS_PER_WARP_MIN * (threads_per_cta / 32)
}

fn is_wide(kernel: &Kernel, threads_per_cta: u32) -> bool {
    match kernel {
        Kernel::Conv2d(p) => is_wide_tile(p.tile_m, p.tile_n, threads_per_cta),
        Kernel::Gemm(p) => is_wide_tile(p.tile_m, p.tile_n, threads_per_cta),
        _ => false,
    }
}

fn epilogue_act(kernel: &Kernel) -> Act {
    match kernel {
        Kernel::Conv2d(p) => p.epilogue.act,
        Kernel::Gemm(p) => p.epilogue.act,
        _ => Act::None,
    }
}

/// The most threads per CTA a kernel is compiled for (its `__launch_bounds__`): 256 for every
/// kernel (ptxas caps some kernels at 32 registers, and spills, under a bound of 512).
pub fn threads_max(kernel: &Kernel) -> u32 {
    let _ = kernel;
    256
}

/// Dynamic shared memory the fp16 tensor-core engine needs at least (`TC_SMEM_MIN_BYTES` in
/// tile.cuh: two pipeline stages of a 128 x 128 tile).
pub const TC_SMEM_MIN_BYTES: u32 = 40960;
/// Most dynamic shared memory a launch may ask for (an H100/H200 CTA may have 227 KiB in all).
pub const DYNAMIC_SMEM_MAX_BYTES: u32 = 200 * 1024;

/// Whether a launch runs on the tensor-core engine (fp16 convolutions of one group, fp16 gemm),
/// whose operand pipeline lives in the launch's dynamic shared memory.
pub fn uses_tensor_cores(kernel: &Kernel, dtype: DType) -> bool {
    dtype == DType::F16 && (matches!(kernel, Kernel::Conv2d(p) if p.groups == 1) || matches!(kernel, Kernel::Gemm(_)))
}

/// Dynamic shared memory to launch with: the plan's `shared_mem_bytes`, raised to the
/// tensor-core engine's minimum for its kernels (more memory only deepens the pipeline).
pub fn dynamic_smem_bytes(kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> u32 {
    if uses_tensor_cores(kernel, dtype) { shape.shared_mem_bytes.max(TC_SMEM_MIN_BYTES) } else { shape.shared_mem_bytes }
}

/// Checks that a launch shape suits the kernel's CUDA code: whole warps, within its launch bounds.
pub fn check_shape(kernel: &Kernel, shape: &LaunchShape) -> Result<(), LaunchError> {
    let t = shape.threads_per_block;
    if t == 0 || !t.is_multiple_of(32) || t > threads_max(kernel) {
        return Err(LaunchError::Threads { kernel: kernel.name(), threads_max: threads_max(kernel), threads: t });
    }
    if shape.shared_mem_bytes > DYNAMIC_SMEM_MAX_BYTES {
        return Err(LaunchError::SharedMemory {
            kernel: kernel.name(),
            max_bytes: DYNAMIC_SMEM_MAX_BYTES,
            bytes: shape.shared_mem_bytes,
        });
    }
    if shape.logical_blocks != kernel.logical_blocks() {
        return Err(LaunchError::LogicalBlocks {
            kernel: kernel.name(),
            expected: kernel.logical_blocks(),
            got: shape.logical_blocks,
        });
    }
    Ok(())
}

/// Bytes of `KairosProto`.
pub const PROTO_BYTES: usize = 128;
/// Bytes of one `KairosRecord`.
pub const RECORD_BYTES: usize = 32;
/// Bytes of one `KairosSlot` (per-launch device state).
pub const SLOT_BYTES: usize = 32 + 4 * SM_COUNT_MAX + 8 * SM_COUNT_MAX;
/// Bytes of `KairosRingHost` and `KairosRingDev`.
pub const RING_HOST_BYTES: usize = 16;
pub const RING_DEV_BYTES: usize = 16;
/// `KAIROS_SM_COUNT_MAX`.
pub const SM_COUNT_MAX: usize = 256;

/// A record is 4 words of `seq << 32 | payload`; word 0's payload packs these fields.
pub fn unpack_record_word0(w: u32) -> (u32, u32, u32, u32, u32) {
    // (kind, aux, slot, sm, ctas)
    (w >> 30, (w >> 29) & 1, (w >> 19) & 0x3ff, (w >> 11) & 0xff, w & 0x7ff)
}

/// `KairosRecord.kind` values.
pub const REC_PLACED: u32 = 1;
pub const REC_FINISHED: u32 = 2;
pub const REC_DONE: u32 = 3;

/// `KairosProto.flags` bits.
pub const FLAG_NOTIFY: u32 = 1;
pub const FLAG_SM_BITMAP: u32 = 2;
/// The launch writes mapped pinned host memory: CTAs fence at system scope before counting as done.
pub const FLAG_FENCE_SYSTEM: u32 = 4;
/// Every CTA lands in the launch's SM mask and the grid covers the blocks left: one take per CTA.
pub const FLAG_ONE_TAKE: u32 = 8;
/// KAIROS_FLAG_NO_CTA_RECORDS: only the launch's end is reported (no placement or completion records).
pub const FLAG_NO_CTA_RECORDS: u32 = 16;
/// KAIROS_FLAG_OVERLAPPED: the launch is a programmatic dependent of the kernel before it (its CTAs
/// read the stream gate only after waiting for that kernel).
pub const FLAG_OVERLAPPED: u32 = 32;
/// KAIROS_FLAG_START_RECORD: the CTA that takes the launch's first block writes a placement record
/// with aux 1 (the launch's start).
pub const FLAG_START_RECORD: u32 = 64;
/// KAIROS_FLAG_LIGHT: one CTA per logical block, no takes or polls; stops only whole, at its gate.
pub const FLAG_LIGHT: u32 = 128;
/// KAIROS_FLAG_SILENT: a light launch that reports nothing (a later launch on its stream implies its end).
pub const FLAG_SILENT: u32 = 256;
/// KAIROS_FLAG_DEVICE_STOP: the preempt flag is a device-memory word, raised when it holds the
/// launch's `seq`, read at every take (without it: a mapped host word, polled every `poll_ns`).
pub const FLAG_DEVICE_STOP: u32 = 512;

/// KAIROS_FLAG_STOP_WORD: `preempt_flag` is a stop word (protocol.cuh point 8: raised when
/// nonzero; a run's light launch skips its block when it is raised, `slot` holding its position in
/// the run + 1; a full launch reports the run's first skipped position in its end record).
pub const FLAG_STOP_WORD: u32 = 1024;

/// Bytes of a stop word in device memory (`KairosStopWord`).
pub const STOP_WORD_BYTES: u64 = 8;

/// The protocol parameters of one launch (mirror of `KairosProto`). Addresses are device addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProtoParams {
    pub slot_state: u64,
    pub preempt_flag: u64,
    pub ring_records: u64,
    pub ring_host: u64,
    pub ring_dev: u64,
    pub sm_mask: [u64; SM_COUNT_MAX / 64],
    pub sm_bitmap: u64,
    pub ring_timeout_ns: u64,
    pub slot: u32,
    pub first_block: u32,
    pub total_blocks: u32,
    pub ring_capacity: u32,
    pub flags: u32,
    /// Least interval between two reads of the host's preempt flag by the launch's CTAs.
    pub poll_ns: u32,
    /// The stream's gate word (`u32`, device memory): the `seq` of the last launch on the stream
    /// that stopped early. 0: no gate.
    pub gate_word: u64,
    /// This launch's sequence number (not 0 when `gate_word` is set).
    pub seq: u32,
    /// The `seq` of the launch before this one on its stream (0: none): if it stopped early, this
    /// launch stops before running any block.
    pub gate_seq: u32,
}

impl ProtoParams {
    pub fn to_block(&self) -> ParamBlock {
        let mut w = ParamBlock::default();
        for v in [self.slot_state, self.preempt_flag, self.ring_records, self.ring_host, self.ring_dev] {
            w.u64(v);
        }
        for v in self.sm_mask {
            w.u64(v);
        }
        w.u64(self.sm_bitmap);
        w.u64(self.ring_timeout_ns);
        for v in [self.slot, self.first_block, self.total_blocks, self.ring_capacity, self.flags, self.poll_ns] {
            w.u32(v);
        }
        w.u64(self.gate_word);
        w.u32(self.seq);
        w.u32(self.gate_seq);
        w.finish();
        assert_eq!(w.len(), PROTO_BYTES, "ProtoParams layout drifted from KairosProto");
        w
    }
}

/// Most bytes of one parameter struct (the launcher passes at most 1 KiB of parameters in all).
pub const PARAM_BLOCK_BYTES_MAX: usize = 1024;

/// A kernel parameter struct as bytes, 8-byte aligned (what `cuLaunchKernel` copies). Built on the
/// launch path, so it lives inline (no allocation); a struct that would outgrow
/// [`PARAM_BLOCK_BYTES_MAX`] reads back as [`ParamBlock::overflowed`] and is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamBlock {
    words: [u64; PARAM_BLOCK_BYTES_MAX / 8],
    len: usize,
    overflowed: bool,
}

impl Default for ParamBlock {
    fn default() -> Self {
        ParamBlock { words: [0; PARAM_BLOCK_BYTES_MAX / 8], len: 0, overflowed: false }
    }
}

impl ParamBlock {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether a value did not fit (the block then holds only what came before it).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
    /// Pointer to the first byte, for `cuLaunchKernel`'s parameter array (valid while `self` lives).
    pub fn as_ptr(&self) -> *const u8 {
        self.words.as_ptr() as *const u8
    }

    fn put(&mut self, bytes: &[u8]) {
        let size = bytes.len();
        let start = self.len.next_multiple_of(size);
        let end = start + size;
        if self.overflowed || end > PARAM_BLOCK_BYTES_MAX {
            self.overflowed = true;
            return;
        }
        bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[start..end].copy_from_slice(bytes);
        self.len = end;
    }
    pub fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.put(&v.to_le_bytes());
    }
    /// Pads to the struct's alignment (8); the padding bytes are zero.
    pub fn finish(&mut self) {
        let end = self.len.next_multiple_of(8);
        bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[self.len..end].fill(0);
        self.len = end;
    }
}

fn act_code(a: Act) -> u32 {
    match a {
        Act::None => 0,
        Act::Relu => 1,
        Act::Relu6 => 2,
        Act::Sigmoid => 3,
        Act::Tanh => 4,
        Act::HardSwish => 5,
        Act::Gelu => 6,
        Act::GeluTanh => 7,
        Act::Silu => 8,
        Act::QuickGelu => 9,
    }
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::I64 => 2,
    }
}

fn unary_code(u: UnaryOpParam) -> u32 {
    match u {
        UnaryOpParam::Sqrt => 0,
        UnaryOpParam::Rsqrt => 1,
        UnaryOpParam::Recip => 2,
        UnaryOpParam::Exp => 3,
        UnaryOpParam::Erf => 4,
        UnaryOpParam::Neg => 5,
        UnaryOpParam::Abs => 6,
        UnaryOpParam::Square => 7,
        UnaryOpParam::IsNan => 8,
    }
}

fn binary_code(b: BinaryOpParam) -> u32 {
    match b {
        BinaryOpParam::Add => 0,
        BinaryOpParam::Sub => 1,
        BinaryOpParam::Mul => 2,
        BinaryOpParam::Div => 3,
        BinaryOpParam::Pow => 4,
        BinaryOpParam::Max => 5,
        BinaryOpParam::Min => 6,
        BinaryOpParam::Equal => 7,
        BinaryOpParam::Less => 8,
        BinaryOpParam::Greater => 9,
    }
}

/// The number of buffer arguments a kernel takes, in the order the plan binds them.
pub fn arg_count(kernel: &Kernel) -> usize {
    match kernel {
        Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => 3 + p.epilogue.bias as usize + p.epilogue.residual as usize,
        Kernel::Gemm(p) => 3 + p.epilogue.bias as usize + p.epilogue.residual as usize,
        Kernel::Pool2d(_) | Kernel::Softmax(_) | Kernel::Reduce(_) => 2,
        Kernel::LayerNorm(_) => 4,
        Kernel::Gather(_) => 3,
        Kernel::Eltwise(p) => p.inputs as usize + 1,
        Kernel::SplitKSum(p) => 2 + p.epilogue.bias as usize + p.epilogue.residual as usize,
    }
}

/// Packs a kernel's own parameter struct from the device addresses of its arguments (in the
/// plan's argument order).
pub fn pack_args(kernel: &Kernel, args: &[u64]) -> Result<ParamBlock, LaunchError> {
    if args.len() != arg_count(kernel) {
        return Err(LaunchError::Arguments { kernel: kernel.name(), expected: arg_count(kernel), got: args.len() });
    }
    let mut w = ParamBlock::default();
    let expected = match kernel {
        Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => {
            let mut it = args.iter().copied();
            let input = it.next().unwrap();
            let weights = it.next().unwrap();
            let bias = if p.epilogue.bias { it.next().unwrap() } else { 0 };
            let res = if p.epilogue.residual { it.next().unwrap() } else { 0 };
            let out = it.next().unwrap();
            for v in [input, weights, bias, res, out] {
                w.u64(v);
            }
            for v in [
                p.batch,
                p.in_h,
                p.in_w,
                p.in_c,
                p.out_h,
                p.out_w,
                p.out_c,
                p.kernel_h,
                p.kernel_w,
                p.stride_h,
                p.stride_w,
                p.pad_h,
                p.pad_w,
                p.dilation_h,
                p.dilation_w,
                p.groups,
                p.in_pixel_stride,
                p.out_pixel_stride,
                p.res_pixel_stride,
            ] {
                w.u32(v);
            }
            w.u32(act_code(p.epilogue.act));
            w.u32(p.tile_m);
            w.u32(p.tile_n);
            w.u32(p.split_k);
            w.u32(split_k_len(p.gemm_k(), p.split_k));
            136
        }
        Kernel::Gemm(p) => {
            let mut it = args.iter().copied();
            let a = it.next().unwrap();
            let b = it.next().unwrap();
            let bias = if p.epilogue.bias { it.next().unwrap() } else { 0 };
            let res = if p.epilogue.residual { it.next().unwrap() } else { 0 };
            let c = it.next().unwrap();
            for v in [a, b, bias, res, c] {
                w.u64(v);
            }
            for v in [
                p.a_stride0,
                p.a_stride1,
                p.a_stride_m,
                p.a_stride_k,
                p.b_stride0,
                p.b_stride1,
                p.b_stride_k,
                p.b_stride_n,
                p.c_stride0,
                p.c_stride1,
                p.c_stride_m,
                p.r_stride0,
                p.r_stride1,
                p.r_stride_m,
            ] {
                w.u64(v);
            }
            for v in [p.batch0, p.batch1, p.m, p.n, p.k] {
                w.u32(v);
            }
            w.f32(p.alpha);
            for v in [act_code(p.epilogue.act), p.tile_m, p.tile_n, p.split_k, split_k_len(p.k, p.split_k)] {
                w.u32(v);
            }
            200
        }
        Kernel::Pool2d(p) => {
            w.u64(args[0]);
            w.u64(args[1]);
            let kind = match p.kind {
                PoolKindParam::Max => 0,
                PoolKindParam::AvgIncludePad => 1,
                PoolKindParam::AvgExcludePad => 2,
            };
            for v in [
                kind,
                p.batch,
                p.in_h,
                p.in_w,
                p.channels,
                p.out_h,
                p.out_w,
                p.kernel_h,
                p.kernel_w,
                p.stride_h,
                p.stride_w,
                p.pad_top,
                p.pad_left,
                p.pad_bottom,
                p.pad_right,
                p.in_pixel_stride,
                p.out_pixel_stride,
                p.elems_per_block,
            ] {
                w.u32(v);
            }
            88
        }
        Kernel::Softmax(p) => {
            w.u64(args[0]);
            w.u64(args[1]);
            w.u32(p.rows);
            w.u32(p.cols);
            w.f32(p.scale);
            // Bit 0: causal; bit 1: zero_nan (norm.cu, SOFTMAX_CAUSAL / SOFTMAX_ZERO_NAN).
            w.u32(p.causal as u32 | (p.zero_nan as u32) << 1);
            w.u32(p.causal_rows.max(1));
            w.u32(p.rows_per_block);
            40
        }
        Kernel::LayerNorm(p) => {
            for &a in args {
                w.u64(a);
            }
            w.u32(p.rows);
            w.u32(p.cols);
            w.f32(p.eps);
            w.u32(p.rows_per_block);
            // flags (norm.cu, LN_RMS) and the struct's padding to 8 bytes
            w.u32(p.rms as u32);
            w.u32(0);
            56
        }
        Kernel::Reduce(p) => {
            w.u64(args[0]);
            w.u64(args[1]);
            let kind = match p.kind {
                ReduceKind::Sum => 0,
                ReduceKind::Mean => 1,
                ReduceKind::Max => 2,
                ReduceKind::Min => 3,
            };
            for v in [kind, p.outer, p.reduce, p.inner, p.elems_per_block, 0] {
                w.u32(v);
            }
            40
        }
        Kernel::Gather(p) => {
            for &a in args {
                w.u64(a);
            }
            for v in [p.count, p.table_rows, p.cols, p.rows_per_block] {
                w.u32(v);
            }
            40
        }
        Kernel::Eltwise(p) => {
            let inputs = p.inputs as usize;
            if inputs > 3 {
                return Err(LaunchError::Inputs { kernel: kernel.name(), max: 3, got: inputs });
            }
            for a in args[..inputs].iter().copied().chain(std::iter::repeat(0)).take(3) {
                w.u64(a);
            }
            w.u64(args[inputs]);
            for v in p.out_strides {
                w.u64(v);
            }
            for s in p.in_strides {
                for v in s {
                    w.u64(v);
                }
            }
            for v in p.shape {
                w.u32(v);
            }
            for d in p.in_dtypes {
                w.u32(dtype_code(d));
            }
            w.u32(dtype_code(p.out_dtype));
            let (func, op) = match p.func {
                EltFunc::Copy => (0, 0),
                EltFunc::Unary(u) => (1, unary_code(u)),
                EltFunc::Binary(b) => (2, binary_code(b)),
                EltFunc::BinaryScalar(b) => (3, binary_code(b)),
                EltFunc::Affine => (4, 0),
                EltFunc::Where => (5, 0),
            };
            for v in [func, op, act_code(p.act), p.inputs, p.elems_per_block] {
                w.u32(v);
            }
            w.f32(p.scalars[0]);
            w.f32(p.scalars[1]);
            w.u32(0);
            296
        }
        Kernel::SplitKSum(p) => {
            let mut it = args.iter().copied();
            let ws = it.next().unwrap();
            let bias = if p.epilogue.bias { it.next().unwrap() } else { 0 };
            let res = if p.epilogue.residual { it.next().unwrap() } else { 0 };
            let out = it.next().unwrap();
            for v in [ws, bias, res, out, p.c_stride0, p.c_stride1, p.c_stride_m, p.r_stride0, p.r_stride1, p.r_stride_m] {
                w.u64(v);
            }
            for v in [p.splits, p.batch0, p.batch1, p.m, p.n] {
                w.u32(v);
            }
            w.f32(p.alpha);
            w.u32(act_code(p.epilogue.act));
            w.u32(p.elems_per_block);
            112
        }
    };
    w.finish();
    if w.overflowed() {
        return Err(LaunchError::ParamBlockOverflow { kernel: kernel.name(), max_bytes: PARAM_BLOCK_BYTES_MAX });
    }
    if w.len() != expected {
        return Err(LaunchError::ParamBlock { kernel: kernel.name(), bytes: w.len(), expected });
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_is_in_exactly_one_unit() {
        for m in Module::ALL {
            for f in m.functions() {
                let holders: Vec<Unit> = Unit::of_module(m).into_iter().filter(|u| u.functions().contains(&f)).collect();
                assert_eq!(holders.len(), 1, "{f} is in {holders:?}");
            }
        }
        let gemm_w = Unit { module: Module::Gemm, entry: Some(EntryKind::F16wRelu) };
        assert_eq!(gemm_w.functions(), vec!["gemm_f16w_relu".to_string()]);
        assert_eq!(gemm_w.name(), "gemm_f16w_relu");
        assert_eq!(Unit::by_name("gemm_f16w_relu"), Some(gemm_w));
        assert_eq!(Unit { module: Module::Conv, entry: Some(EntryKind::Gvn) }.functions(), vec!["conv2d_gvn".to_string()]);
        let conv_f16 = Unit { module: Module::Conv, entry: Some(EntryKind::F16) };
        assert_eq!(conv_f16.functions(), vec!["conv2d_f16".to_string(), "dwconv2d_f16".to_string()]);
        assert_eq!(Unit::all().len(), 6 + 2 * EntryKind::ALL.len());
        assert!(Unit::all().iter().all(|u| Unit::by_name(&u.name()) == Some(*u)));
    }

    #[test]
    fn entry_masks_agree_with_common_cuh() {
        let header = HEADERS.iter().find(|h| h.0 == "kairos/common.cuh").unwrap().1;
        for k in EntryKind::ALL {
            let name = format!("KAIROS_E{}", k.suffix().to_uppercase());
            let line = header
                .lines()
                .find(|l| l.split_whitespace().nth(1) == Some(name.as_str()))
                .unwrap_or_else(|| panic!("common.cuh defines no {name}"));
            assert_eq!(line.split_whitespace().nth(2), Some(k.mask().to_string().as_str()), "{line}");
            assert!(header.contains(&format!("#if KAIROS_ENTRIES & {name}")), "common.cuh never tests {name}");
        }
    }

    #[test]
    fn launch_bounds_agree_with_common_cuh() {
        let header = HEADERS.iter().find(|h| h.0 == "kairos/common.cuh").unwrap().1;
        for k in EntryKind::ALL {
            // `#define KAIROS_ENTRY_F16N(name, Args, body) KAIROS_ENTRY(name##_f16n, Args, 128, 3, ...)`
            let macro_name = format!("KAIROS_ENTRY{}(", k.suffix().to_uppercase());
            let line = header
                .lines()
                .find(|l| l.starts_with("#define ") && l.contains(&macro_name) && l.contains("KAIROS_ENTRY(name##"))
                .unwrap_or_else(|| panic!("common.cuh defines no {macro_name}"));
            let args: Vec<&str> = line.rsplit("KAIROS_ENTRY(").next().unwrap().split(',').map(str::trim).collect();
            let (threads, ctas) = k.launch_bounds();
            let threads_text = if matches!(k, EntryKind::F32 | EntryKind::F16) { "t".to_string() } else { threads.to_string() };
            assert_eq!((args[2], args[3]), (threads_text.as_str(), ctas.to_string().as_str()), "{line}");
        }
        // The tensor-core modules' F32/F16 entries take the module's 256 threads.
        assert!(header.contains("KAIROS_KERNELS(name, Args, body, 256)"));
        assert_eq!(EntryKind::F16.registers_max(), 128);
        assert_eq!(EntryKind::F16n.registers_max(), 168);
        assert_eq!(EntryKind::F16wRelu.registers_max(), 255);
        assert!(Unit::all().iter().all(|u| u.has_quick_build() == u.module.split_by_entry()));
    }

    #[test]
    fn param_block_aligns_fields_like_c() {
        let mut w = ParamBlock::default();
        w.u32(1);
        w.u64(2);
        w.u32(3);
        w.finish();
        assert_eq!(w.len(), 24);
        assert_eq!(&w.as_bytes()[..4], &1u32.to_le_bytes());
        assert_eq!(&w.as_bytes()[8..16], &2u64.to_le_bytes());
        assert_eq!(&w.as_bytes()[16..20], &3u32.to_le_bytes());
    }

    #[test]
    fn param_block_refuses_what_outgrows_it() {
        let mut w = ParamBlock::default();
        for i in 0..PARAM_BLOCK_BYTES_MAX / 8 {
            w.u64(i as u64);
        }
        assert!(!w.overflowed());
        assert_eq!(w.len(), PARAM_BLOCK_BYTES_MAX);
        w.u32(9);
        assert!(w.overflowed());
        assert_eq!(w.len(), PARAM_BLOCK_BYTES_MAX, "nothing is written past the end");
        assert_eq!(&w.as_bytes()[8..16], &1u64.to_le_bytes());
    }

    #[test]
    fn proto_block_has_the_c_size() {
        let p = ProtoParams { slot: 7, total_blocks: 9, ..Default::default() };
        let b = p.to_block();
        assert_eq!(b.len(), PROTO_BYTES);
        assert_eq!(&b.as_bytes()[88..92], &7u32.to_le_bytes());
        let g = ProtoParams { gate_word: 0xabc, seq: 5, gate_seq: 4, ..Default::default() }.to_block();
        assert_eq!(&g.as_bytes()[112..120], &0xabcu64.to_le_bytes());
        assert_eq!(&g.as_bytes()[120..124], &5u32.to_le_bytes());
        assert_eq!(&g.as_bytes()[124..128], &4u32.to_le_bytes());
        assert_eq!(&b.as_bytes()[96..100], &9u32.to_le_bytes());
    }

    #[test]
    fn record_word0_unpacks_what_protocol_cuh_packs() {
        // kind << 30 | aux << 29 | slot << 19 | sm << 11 | ctas
        let w = (REC_DONE << 30) | (1 << 29) | (1023 << 19) | (131 << 11) | 2047;
        assert_eq!(unpack_record_word0(w), (REC_DONE, 1, 1023, 131, 2047));
        assert_eq!(unpack_record_word0(REC_PLACED << 30 | 5 << 19 | 7 << 11 | 3), (REC_PLACED, 0, 5, 7, 3));
    }

    #[test]
    fn every_module_declares_its_functions_in_its_source() {
        for m in Module::ALL {
            for f in m.functions() {
                let kind = EntryKind::ALL.into_iter().filter(|k| f.ends_with(k.suffix())).max_by_key(|k| k.suffix().len());
                let (kernel, suffix) = match kind {
                    Some(k) => (f.trim_end_matches(k.suffix()).to_string(), Some(k)),
                    None => (f.clone(), None),
                };
                let needle = match suffix {
                    Some(k) if !matches!(k, EntryKind::F32 | EntryKind::F16) => format!("KAIROS_KERNELS_TC({kernel},"),
                    Some(_) if TENSOR_CORE_KERNELS.contains(&kernel.as_str()) => format!("KAIROS_KERNELS_TC({kernel},"),
                    Some(_) => format!("KAIROS_KERNELS({kernel},"),
                    None => format!("void {f}("),
                };
                assert!(m.source().contains(&needle), "module {} does not define {f}", m.name());
            }
        }
    }

    #[test]
    fn split_k_launches_take_the_sk_entries_and_pack_their_sum() {
        use kairos_core::plan::{EpilogueParams, SplitKSumParams};
        let lowered =
            kairos_ir::lower::lower(&split_graph(), &kairos_ir::lower::LowerOptions { dtype: DType::F16, split_k: true })
                .unwrap();
        let gemm = lowered.launches.iter().find(|l| l.kernel.is_split_k()).expect("a split-K gemm");
        assert_eq!(function_name(&gemm.kernel, DType::F16, 128).unwrap(), "gemm_sk_f16n");
        assert_eq!(function_name(&gemm.kernel, DType::F16, 256).unwrap(), "gemm_sk_f16");
        assert_eq!(function_name(&gemm.kernel, DType::F32, 256).unwrap(), "gemm_sk_f32");
        assert!(Module::Gemm.functions().contains(&"gemm_sk_f16n".to_string()));
        // A small-M split-K product (tiles of at most 8 rows) takes the split-K small-M entries.
        let mut small = gemm.kernel;
        if let Kernel::Gemm(p) = &mut small {
            p.tile_m = GV_ROWS_MAX;
        }
        assert!(is_small_m(&small));
        assert_eq!(function_name(&small, DType::F16, 256).unwrap(), "gemm_sk_gv");
        assert_eq!(function_name(&small, DType::F16, 128).unwrap(), "gemm_sk_gvn");
        for threads in [128, 256] {
            let unit = unit_of(&small, DType::F16, threads).unwrap();
            assert!(tuning_units(&small, DType::F16).contains(&unit), "{unit:?}");
        }
        for (dtype, threads) in [(DType::F16, 128), (DType::F16, 256), (DType::F32, 256)] {
            let unit = unit_of(&gemm.kernel, dtype, threads).unwrap();
            assert!(unit.functions().contains(&function_name(&gemm.kernel, dtype, threads).unwrap()), "{unit:?}");
            assert!(tuning_units(&gemm.kernel, dtype).contains(&unit), "{unit:?}");
        }
        // The C structs' sizes: GemmArgs 200, SplitKSumArgs 112 (pack_args checks them).
        assert_eq!(pack_args(&gemm.kernel, &[1, 2, 3]).unwrap().len(), 200);
        let sum = Kernel::SplitKSum(SplitKSumParams {
            splits: 3,
            batch0: 1,
            batch1: 1,
            m: 4,
            n: 8,
            c_stride0: 0,
            c_stride1: 0,
            c_stride_m: 8,
            r_stride0: 0,
            r_stride1: 0,
            r_stride_m: 8,
            alpha: 1.0,
            epilogue: EpilogueParams { bias: true, residual: true, act: Act::Relu },
            elems_per_block: 16,
        });
        assert_eq!(function_name(&sum, DType::F16, 256).unwrap(), "splitk_sum_f16");
        assert_eq!(pack_args(&sum, &[1, 2, 3, 4]).unwrap().len(), 112);
        // Bias and residual make four arguments.
        let e = pack_args(&sum, &[1, 2, 3]).unwrap_err();
        assert_eq!(e, LaunchError::Arguments { kernel: sum.name(), expected: 4, got: 3 });
        assert_eq!(function_name(&sum, DType::I64, 256), Err(LaunchError::NoVariant { kernel: sum.name(), dtype: DType::I64 }));
    }

    /// x [32, 4096] times constant weights [4096, 64]: long enough a reduction to split.
    fn split_graph() -> kairos_core::graph::Graph {
        use kairos_core::graph::*;
        let mut g = Graph::new("split");
        let x = g.add("x", Op::Input { index: 0 }, vec![], vec![32, 4096], DType::F32);
        g.inputs.push(GraphInput { name: "x".into(), node: x });
        let w = g.add_const("w", kairos_core::Tensor::f32(vec![4096, 64], vec![0.5; 4096 * 64]));
        let y = g.add("y", Op::MatMul { epilogue: Epilogue::default(), alpha: 1.0 }, vec![x, w], vec![32, 64], DType::F32);
        g.outputs.push(GraphOutput { name: "y".into(), node: y });
        g
    }

    #[test]
    fn large_tiles_on_128_thread_ctas_take_the_wide_entries() {
        let lowered =
            kairos_ir::lower::lower(&split_graph(), &kairos_ir::lower::LowerOptions { dtype: DType::F16, split_k: false })
                .unwrap();
        let gemm = lowered.launches.iter().find(|l| matches!(l.kernel, Kernel::Gemm(_))).expect("a gemm").kernel;
        let tiled = |tm: u32, tn: u32| {
            let mut k = gemm;
            if let Kernel::Gemm(p) = &mut k {
                (p.tile_m, p.tile_n) = (tm, tn);
            }
            k
        };
        // 64 x 64 outputs per warp or more at 128 threads: wide, the entry of the epilogue's
        // activation class; fewer, or other CTA sizes: as before.
        assert_eq!(function_name(&tiled(128, 128), DType::F16, 128).unwrap(), "gemm_f16w_none");
        let with_act = |act: Act| {
            let mut k = tiled(128, 128);
            if let Kernel::Gemm(p) = &mut k {
                p.epilogue.act = act;
            }
            function_name(&k, DType::F16, 128).unwrap()
        };
        assert_eq!(with_act(Act::Relu), "gemm_f16w_relu");
        assert_eq!(with_act(Act::Gelu), "gemm_f16w_act");
        assert_eq!(with_act(Act::Relu6), "gemm_f16w_act");
        assert_eq!(function_name(&tiled(128, 64), DType::F16, 128).unwrap(), "gemm_f16n");
        assert_eq!(function_name(&tiled(64, 64), DType::F16, 128).unwrap(), "gemm_f16n");
        assert_eq!(function_name(&tiled(128, 128), DType::F16, 256).unwrap(), "gemm_f16");
        assert_eq!(function_name(&tiled(128, 128), DType::F16, 64).unwrap(), "gemm_f16n");
        assert_eq!(function_name(&tiled(128, 128), DType::F32, 128).unwrap(), "gemm_f32");
        // Tiles of at most 8 rows: the small-M entries, unless B is stored [k][n].
        assert_eq!(function_name(&tiled(8, 64), DType::F16, 128).unwrap(), "gemm_gvn");
        assert_eq!(function_name(&tiled(8, 64), DType::F16, 256).unwrap(), "gemm_gv");
        assert_eq!(function_name(&tiled(16, 64), DType::F16, 128).unwrap(), "gemm_f16n");
        let mut kn = tiled(8, 64);
        if let Kernel::Gemm(p) = &mut kn {
            (p.b_stride_k, p.b_stride_n) = (p.n as u64, 1);
        }
        assert_eq!(function_name(&kn, DType::F16, 128).unwrap(), "gemm_f16n");
        for f in ["gemm_f16w_none", "gemm_f16w_relu", "gemm_f16w_act", "gemm_gv", "gemm_gvn"] {
            assert!(Module::Gemm.functions().contains(&f.to_string()), "{f}");
        }
        assert!(Module::Conv.functions().contains(&"conv2d_f16w_act".to_string()));
        // Every CTA size and tile the autotuner may try is in the units it compiles first.
        for (tm, tn, threads) in [(128, 128, 128), (128, 64, 128), (128, 128, 256), (16, 16, 64), (8, 64, 128), (8, 32, 256)] {
            for dtype in [DType::F16, DType::F32] {
                let unit = unit_of(&tiled(tm, tn), dtype, threads).unwrap();
                assert!(unit.functions().contains(&function_name(&tiled(tm, tn), dtype, threads).unwrap()));
                assert!(tuning_units(&tiled(tm, tn), dtype).contains(&unit), "{unit:?} for {tm}x{tn}x{threads} {dtype:?}");
            }
        }
        let tile = HEADERS.iter().find(|h| h.0 == "kairos/common.cuh").unwrap().1;
        assert!(
            tile.contains(&format!("KAIROS_ENTRY(name##_f16w_relu, Args, {TC_WIDE_THREADS}, 2,")),
            "the wide entries' launch bound"
        );
    }

    #[test]
    fn protocol_flags_and_record_kinds_match_protocol_cuh() {
        let proto = HEADERS.iter().find(|h| h.0 == "kairos/protocol.cuh").unwrap().1;
        for (name, value) in [
            ("KAIROS_FLAG_NOTIFY", FLAG_NOTIFY),
            ("KAIROS_FLAG_SM_BITMAP", FLAG_SM_BITMAP),
            ("KAIROS_FLAG_FENCE_SYSTEM", FLAG_FENCE_SYSTEM),
            ("KAIROS_FLAG_ONE_TAKE", FLAG_ONE_TAKE),
            ("KAIROS_FLAG_NO_CTA_RECORDS", FLAG_NO_CTA_RECORDS),
            ("KAIROS_FLAG_OVERLAPPED", FLAG_OVERLAPPED),
            ("KAIROS_FLAG_START_RECORD", FLAG_START_RECORD),
            ("KAIROS_FLAG_LIGHT", FLAG_LIGHT),
            ("KAIROS_FLAG_SILENT", FLAG_SILENT),
            ("KAIROS_FLAG_DEVICE_STOP", FLAG_DEVICE_STOP),
            ("KAIROS_FLAG_STOP_WORD", FLAG_STOP_WORD),
            ("KAIROS_REC_PLACED", REC_PLACED),
            ("KAIROS_REC_FINISHED", REC_FINISHED),
            ("KAIROS_REC_DONE", REC_DONE),
        ] {
            assert!(proto.contains(&format!("#define {name} {value}u")), "{name} is not {value} in protocol.cuh");
        }
    }

    #[test]
    fn tensor_core_smem_minimum_matches_tile_cuh() {
        let tile = HEADERS.iter().find(|h| h.0 == "kairos/tile.cuh").unwrap().1;
        assert!(tile.contains(&format!("#define TC_SMEM_MIN_BYTES {TC_SMEM_MIN_BYTES}u")));
    }

    #[test]
    fn sources_include_only_known_headers() {
        let known: Vec<&str> = HEADERS.iter().map(|h| h.0).collect();
        let sources = Module::ALL.iter().map(|m| m.source()).chain(HEADERS.iter().map(|h| h.1));
        for s in sources {
            for line in s.lines().filter(|l| l.trim_start().starts_with("#include")) {
                let name = line.split('"').nth(1).expect("quoted include");
                assert!(known.contains(&name), "unknown header {name}");
            }
        }
    }
}

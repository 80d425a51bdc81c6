//! The tile autotuner: per launch shape, the fastest tile configuration of convolutions and matrix
//! products on this GPU, cached on disk next to the CUBIN images.
//!
//! Guarantee: a tuned plan computes exactly what the untuned plan computes, block for block. The
//! tuner changes only what the logical-block contract of `kairos_ir::plan` leaves free — the
//! tile (`tile_m`, `tile_n`, any size up to the engines' TILE_MAX of 128 is correct), the CTA size
//! (whole warps, within the kernel's launch bounds) and, with them, the launch's logical-block
//! count — and it rewrites the plan before any dispatcher sees it, so the CPU reference and the
//! simulator run the same blocks as the GPU. The tuned plan passes `Plan::validate`.
//!
//! Behaviour: launches are grouped by shape (the kernel's parameters without its tile, and the
//! dtype); only `conv2d` with one group and `gemm` are tuned (the other kernels' blocks are not
//! tiles of a product). Each shape's candidates ([`CANDIDATES_F16`] / [`CANDIDATES_F32`], minus
//! tiles more than 16 past the problem in either dimension, plus the plan's own choice) run on
//! the whole GPU, one warm-up then `repeats` timed runs each, on the model's real weights and
//! synthetic inputs; the kept time is the median of the device-measured spans (first CTA placed
//! to LaunchDone, %globaltimer). The plan's own choice is kept unless a candidate beats it by
//! more than [`KEEP_PLAN_SLACK`] (timing noise must not churn plans). Choices are saved in
//! `autotune-sm<arch>-<key>.json` in the kernel cache folder (`$KAIROS_CACHE_DIR`, default
//! `~/.cache/kairos/cubin`), the key hashing the tuned kernels' sources and headers, the compile
//! options, the driver and NVRTC versions, the device's name and its SM count: a second load of
//! the model times nothing, and editing a kernel or moving to another GPU starts afresh. At the
//! time of writing, resnet50 (fp16, batch 1) has 25 distinct shapes and 10 to 25 candidates per
//! shape; on the H200 tuning it took 0.16 to 0.4 s (weight upload included), inception_v3's 52
//! shapes 0.46 s.
//!
//! Entry points: [`autotune_plan`] (the CUDA backend at model load), and [`apply_table`] (pure:
//! the same rewrite from a saved table, e.g. for the simulator to agree with a tuned GPU).

use crate::gpu::CudaGpu;
use crate::profile::{PlanBuffers, synthetic_input};
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::lower::emit::{SMALL_M_ROWS, smem_for};
use kairos_ir::plan::{Conv2dParams, GemmParams, Kernel, LaunchShape, Plan};
use kairos_kernels::source::{Unit, is_wide_tile, unit_of};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// fp16 candidates (tile_m, tile_n, threads per CTA) for the tensor-core engine. (128, 128, 256),
/// (128, 64, 256) and (64, 128, 256) run fixed-shape tiles (tile.cuh: tc_tile_fixed) when the
/// operands allow it (16-byte chunks, B with k contiguous); the others the generic engine. (128, 128, 128)
/// runs a `_f16w_*` entry (kairos_kernels::source::is_wide_tile: four 64 x 64 warp tiles), with
/// [`WIDE_SHALLOW_SMEM_BYTES`], [`WIDE_SMEM_BYTES`] and [`DEEP_SMEM_BYTES`] (two, three and five
/// stages of k32).
pub const CANDIDATES_F16: [(u32, u32, u32); 21] = [
    (128, 128, 128),
    (128, 128, 256),
    (128, 64, 256),
    (64, 128, 256),
    (128, 64, 128),
    (64, 64, 256),
    (64, 64, 128),
    (64, 32, 128),
    (32, 64, 128),
    (32, 64, 256),
    (32, 32, 256),
    (32, 32, 128),
    (32, 32, 64),
    (16, 64, 256),
    (16, 64, 128),
    (16, 32, 256),
    (16, 32, 128),
    (16, 32, 64),
    (16, 16, 256),
    (16, 16, 128),
    (16, 16, 64),
];
/// Extra fp16 candidates (tile_n, threads per CTA, with tile_m 8) of products with at most
/// `SMALL_M_ROWS` (8) rows: every tile of such a product has at most 8 rows, so when B's k is
/// contiguous all of them take the engine's small-M path, where only the columns per block and
/// the CTA size move speed.
pub const CANDIDATES_F16_SMALL_M: [(u32, u32); 12] =
    [(64, 128), (32, 128), (16, 128), (16, 256), (8, 64), (8, 128), (8, 256), (4, 64), (4, 128), (4, 256), (2, 64), (2, 128)];
/// f32 candidates for the SIMT engine.
pub const CANDIDATES_F32: [(u32, u32, u32); 8] =
    [(128, 128, 256), (128, 64, 256), (64, 128, 256), (64, 64, 256), (64, 32, 128), (32, 64, 128), (32, 32, 128), (32, 32, 64)];
/// The plan's own choice stays unless a candidate is faster by more than this factor.
pub const KEEP_PLAN_SLACK: f64 = 0.97;
/// Most shapes a table holds (a full table stops growing; tuning still rewrites the plan).
pub const TABLE_ENTRIES_MAX: usize = 16_384;

/// One tile configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TileChoice {
    pub tile_m: u32,
    pub tile_n: u32,
    pub threads: u32,
    /// Dynamic shared memory (the tensor-core engine's pipeline depth).
    pub smem_bytes: u32,
}

impl TileChoice {
    /// `tile_m`x`tile_n`x`threads` and the shared memory, as the progress lines print it.
    pub fn label(&self) -> String {
        format!("{}x{}x{} {} KiB", self.tile_m, self.tile_n, self.threads, self.smem_bytes / 1024)
    }
}

/// A tuned shape: the choice, its time and the time of the configuration it replaced.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuneEntry {
    pub choice: TileChoice,
    pub duration_ns: u64,
    pub plan_duration_ns: u64,
    /// The choice's estimated time per logical block ([`block_ns`]); 0 in tables written before
    /// it was recorded.
    #[serde(default)]
    pub block_ns: u64,
}

/// Estimated time of one logical block of a launch that took `duration_ns` on the whole GPU:
/// its persistent CTAs (at most `ctas_per_sm` on each of `sm_count` SMs) take the blocks in
/// rounds, so a block lasts about the duration over the rounds.
pub fn block_ns(duration_ns: u64, logical_blocks: u32, ctas_per_sm: u32, sm_count: u32) -> u64 {
    let resident = (ctas_per_sm.max(1) as u64 * sm_count.max(1) as u64).min(logical_blocks.max(1) as u64);
    duration_ns / (logical_blocks.max(1) as u64).div_ceil(resident)
}

/// The table key of a shape tuned under a block-time budget (`shape_key` plus the budget).
pub fn budget_key(shape_key: &str, block_budget_ns: Option<u64>) -> String {
    match block_budget_ns {
        Some(b) => format!("{shape_key}|block<={b}ns"),
        None => shape_key.to_string(),
    }
}

/// The candidate a tuning keeps, from (choice, duration, block time) in timing order, the plan's
/// own choice first: without a budget the fastest, where the plan's own choice stays unless a
/// candidate beats it by more than [`KEEP_PLAN_SLACK`]; under a budget the same among candidates
/// whose blocks fit it, and the one with the shortest blocks when none fits.
pub fn pick(timed: &[(TileChoice, u64, u64)], block_budget_ns: Option<u64>) -> Option<(TileChoice, u64, u64)> {
    let fastest = |it: &mut dyn Iterator<Item = &(TileChoice, u64, u64)>| {
        let mut best: Option<(TileChoice, u64, u64)> = None;
        for &c in it {
            match best {
                None => best = Some(c),
                Some(b) if (c.1 as f64) < b.1 as f64 * KEEP_PLAN_SLACK => best = Some(c),
                _ => {}
            }
        }
        best
    };
    match block_budget_ns {
        None => fastest(&mut timed.iter()),
        Some(budget) => {
            fastest(&mut timed.iter().filter(|c| c.2 <= budget)).or_else(|| timed.iter().copied().min_by_key(|c| (c.2, c.1)))
        }
    }
}

/// Choices by shape key ([`shape_key`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TuneTable {
    pub device: String,
    pub entries: BTreeMap<String, TuneEntry>,
}

impl TuneTable {
    pub fn load(path: &Path) -> Result<TuneTable, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes the table (to a temporary file first, then renamed, so readers never see half of it).
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// The kernel's tile, when it is a tunable one.
fn tile_of(kernel: &Kernel) -> Option<(u32, u32)> {
    match kernel {
        Kernel::Conv2d(p) if p.groups == 1 => Some((p.tile_m, p.tile_n)),
        Kernel::Gemm(p) => Some((p.tile_m, p.tile_n)),
        _ => None,
    }
}

/// The kernel with another tile.
pub fn with_tile(kernel: &Kernel, tile_m: u32, tile_n: u32) -> Kernel {
    let mut k = *kernel;
    match &mut k {
        Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => (p.tile_m, p.tile_n) = (tile_m, tile_n),
        Kernel::Gemm(p) => (p.tile_m, p.tile_n) = (tile_m, tile_n),
        _ => {}
    }
    k
}

/// The shape a launch is tuned by: dtype and kernel parameters without the tile. None for kernels
/// the tuner leaves alone.
pub fn shape_key(kernel: &Kernel, dtype: DType) -> Option<String> {
    tile_of(kernel)?;
    if !matches!(dtype, DType::F16 | DType::F32) {
        return None;
    }
    let k = with_tile(kernel, 0, 0);
    Some(format!("{}:{}", dtype.name(), serde_json::to_string(&k).ok()?))
}

/// The problem a tunable kernel computes: (independent products, m, n).
fn problem(kernel: &Kernel) -> (u32, u32, u32) {
    match kernel {
        Kernel::Conv2d(p) => (1, p.gemm_m(), p.out_c),
        Kernel::Gemm(p) => (p.batch0 * p.batch1, p.m, p.n),
        _ => (1, 1, 1),
    }
}

/// The fp16 candidates of at most 32 x 64 outputs also run with this much dynamic shared memory
/// (a deeper pipeline at fewer CTAs per SM).
pub const DEEP_SMEM_BYTES: u32 = 104 * 1024;
/// The wide entry's shallower pipelines (three and two stages of k32 at 128 x 128): they leave the
/// L1 cache room for the entry's register spills (ptxas: ~400 bytes of stack per thread; two CTAs
/// of 104 KiB leave L1 about 20 KiB).
pub const WIDE_SMEM_BYTES: u32 = 64 * 1024;
pub const WIDE_SHALLOW_SMEM_BYTES: u32 = 48 * 1024;

/// fp16 products of at most this many rows also try the small-M tiles ([`CANDIDATES_F16_SMALL_M`],
/// 8 rows each): at a few rows more than 8 (a short sequence's linear layers, 16 tokens) a few
/// small-M blocks per column range may beat one tensor-core tile, whose fixed cost is higher
/// (~7 µs against ~4.5 for a product of 16 x 32 x 32, H200).
pub const SMALL_M_CANDIDATE_ROWS_MAX: u32 = 4 * SMALL_M_ROWS;

/// Candidates for one launch: the dtype's list without tiles more than 16 past the problem, and
/// the plan's own choice first; fp16 products of at most [`SMALL_M_CANDIDATE_ROWS_MAX`] rows also
/// try [`CANDIDATES_F16_SMALL_M`] (before the rest: where B's k is not contiguous, e.g. classifier
/// weights stored [k][n], such tiles run on the mma path, and the larger tiles may win).
pub fn candidates(kernel: &Kernel, dtype: DType, plan_shape: &LaunchShape) -> Vec<TileChoice> {
    let Some((tm, tn)) = tile_of(kernel) else { return Vec::new() };
    let (_, m, n) = problem(kernel);
    let round16 = |x: u32| x.max(1).div_ceil(16) * 16;
    let own =
        TileChoice { tile_m: tm, tile_n: tn, threads: plan_shape.threads_per_block, smem_bytes: plan_shape.shared_mem_bytes };
    let mut v = vec![own];
    if dtype == DType::F16 && m <= SMALL_M_CANDIDATE_ROWS_MAX {
        for &(b, t) in &CANDIDATES_F16_SMALL_M {
            if b > round16(n) {
                continue;
            }
            let c = TileChoice { tile_m: SMALL_M_ROWS, tile_n: b, threads: t, smem_bytes: smem_for(kernel, dtype, t) };
            if !v.contains(&c) {
                v.push(c);
            }
        }
    }
    let list: &[(u32, u32, u32)] = if dtype == DType::F16 { &CANDIDATES_F16 } else { &CANDIDATES_F32 };
    for &(a, b, t) in list {
        if a > round16(m) || b > round16(n) {
            continue;
        }
        let smem = smem_for(kernel, dtype, t);
        let mut sizes = vec![smem];
        if dtype == DType::F16 && is_wide_tile(a, b, t) {
            sizes = vec![WIDE_SHALLOW_SMEM_BYTES, WIDE_SMEM_BYTES, DEEP_SMEM_BYTES];
        } else if dtype == DType::F16 && a * b <= 32 * 64 && smem < DEEP_SMEM_BYTES {
            sizes.push(DEEP_SMEM_BYTES);
        }
        for smem_bytes in sizes {
            let c = TileChoice { tile_m: a, tile_n: b, threads: t, smem_bytes };
            if !v.contains(&c) {
                v.push(c);
            }
        }
    }
    v
}

/// Rewrites every launch whose shape the table knows; returns how many launches changed.
pub fn apply_table(plan: &mut Plan, table: &TuneTable) -> usize {
    apply_table_within(plan, table, None)
}

/// [`apply_table`] with the choices made under a block-time budget.
pub fn apply_table_within(plan: &mut Plan, table: &TuneTable, block_budget_ns: Option<u64>) -> usize {
    let mut changed = 0;
    for l in &mut plan.launches {
        let Some(key) = shape_key(&l.kernel, l.dtype) else { continue };
        let Some(e) = table.entries.get(&budget_key(&key, block_budget_ns)) else { continue };
        let k = with_tile(&l.kernel, e.choice.tile_m, e.choice.tile_n);
        let shape = LaunchShape {
            logical_blocks: k.logical_blocks(),
            threads_per_block: e.choice.threads,
            shared_mem_bytes: e.choice.smem_bytes,
        };
        if k != l.kernel || shape != l.shape {
            l.kernel = k;
            l.shape = shape;
            changed += 1;
        }
    }
    changed
}

/// How to tune.
#[derive(Clone, Debug)]
pub struct TuneOptions {
    /// Timed runs per candidate (the median is kept), after one warm-up.
    pub repeats: usize,
    /// Launch dtypes to tune.
    pub dtypes: Vec<DType>,
    /// Read and write the on-disk table.
    pub use_cache: bool,
    /// Progress lines on stderr.
    pub progress: bool,
    /// Stop timing new shapes after this long (they keep the plan's choice, and are not saved).
    pub time_budget_ms: u64,
    /// Every candidate's time on stderr, not only the choice (diagnosis: `kernel_speed --tune-log`).
    pub log_candidates: bool,
    /// Compile every kernel unit the candidates may run before timing (true), or (false: what a
    /// server's first load wants) time only the candidates whose units are at hand, compile the
    /// others in the background into the cache, and save nothing (the next load tunes them all).
    pub compile_all_candidates: bool,
    /// A block-time budget (the REEF issue's best-effort plans): choose the fastest candidate
    /// whose logical blocks each take at most this long ([`block_ns`]), else the one with the
    /// shortest blocks. A preempted launch stops at a block boundary, so its blocks bound how long
    /// a preemption waits. `None`: the fastest candidate. Budgeted choices have table keys of
    /// their own ([`budget_key`]).
    pub block_budget_ns: Option<u64>,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            repeats: 5,
            dtypes: vec![DType::F16],
            use_cache: true,
            progress: true,
            time_budget_ms: 60_000,
            log_candidates: false,
            compile_all_candidates: true,
            block_budget_ns: None,
        }
    }
}

/// What a tuning did.
#[derive(Clone, Debug, Default)]
pub struct TuneReport {
    /// Distinct tunable shapes in the plan.
    pub shapes: usize,
    /// Shapes timed now.
    pub timed: usize,
    /// Shapes whose choice came from the table.
    pub from_table: usize,
    /// Launches whose tile or CTA size changed.
    pub launches_changed: usize,
    /// Sum over tunable launches of the plan's and the chosen configuration's durations (ns).
    pub plan_kernel_ns: u64,
    pub tuned_kernel_ns: u64,
    pub elapsed_ms: f64,
    pub table_file: Option<PathBuf>,
    /// Tuned without the candidates of units not yet compiled (`compile_all_candidates` false);
    /// nothing was saved.
    pub partial: bool,
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn describe(kernel: &Kernel, dtype: DType) -> String {
    let what = match kernel {
        Kernel::Conv2d(p) => format!(
            "conv2d {dtype} {}x{} {}->{} k{}x{} s{} (m {}, k {})",
            p.out_h,
            p.out_w,
            p.in_c,
            p.out_c,
            p.kernel_h,
            p.kernel_w,
            p.stride_h,
            p.gemm_m(),
            p.kernel_h * p.kernel_w * p.in_c
        ),
        Kernel::Gemm(p) => format!("gemm {dtype} {}x{} m {} n {} k {}", p.batch0, p.batch1, p.m, p.n, p.k),
        k => k.name().to_string(),
    };
    match kernel {
        Kernel::Conv2d(Conv2dParams { split_k, .. }) | Kernel::Gemm(GemmParams { split_k, .. }) if *split_k > 1 => {
            format!("{what}, split-k {split_k}")
        }
        _ => what,
    }
}

/// Tunes a plan on this GPU and rewrites it (see the module doc). The table file is read first
/// and written back with the shapes timed now.
pub fn autotune_plan(gpu: &mut CudaGpu, plan: &mut Plan, opts: &TuneOptions) -> Result<TuneReport> {
    let t0 = Instant::now();
    let table_file = if opts.use_cache { gpu.kernel_cache().tuning_file(&gpu.info().name, gpu.info().sm_count) } else { None };
    // The table in the cache folder, else one embedded in the binary under the same name.
    let mut table = table_file
        .as_deref()
        .and_then(|p| {
            TuneTable::load(p).ok().or_else(|| {
                let bytes = crate::nvrtc::prebuilt(&p.file_name()?.to_string_lossy())?;
                serde_json::from_slice(&bytes).ok()
            })
        })
        .unwrap_or_default();
    table.device = gpu.info().name.clone();

    // Distinct shapes, each with its first launch.
    let mut shapes: Vec<(String, usize)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, l) in plan.launches.iter().enumerate() {
        if !opts.dtypes.contains(&l.dtype) {
            continue;
        }
        if let Some(key) = shape_key(&l.kernel, l.dtype).map(|k| budget_key(&k, opts.block_budget_ns))
            && seen.insert(key.clone())
        {
            shapes.push((key, i));
        }
    }
    let mut report = TuneReport { shapes: shapes.len(), table_file: table_file.clone(), ..Default::default() };
    let todo: Vec<&(String, usize)> = shapes.iter().filter(|(k, _)| !table.entries.contains_key(k)).collect();
    report.from_table = shapes.len() - todo.len();
    if opts.progress {
        eprintln!(
            "autotune {} ({}): {} shapes, {} from {}",
            plan.model,
            gpu.info().name,
            shapes.len(),
            report.from_table,
            table_file.as_ref().map_or("no table".to_string(), |p| p.display().to_string())
        );
    }

    let mut chosen: BTreeMap<String, TuneEntry> = BTreeMap::new();
    let mut skip: Vec<Unit> = Vec::new();
    if !todo.is_empty() {
        // Every entry the candidates may run, compiled in parallel up front (not one by one as
        // the timing meets them).
        let mut units: Vec<(Unit, crate::Variant)> = Vec::new();
        for (_, i) in &todo {
            let l = &plan.launches[*i];
            units.extend(
                kairos_kernels::source::tuning_units(&l.kernel, l.dtype).into_iter().map(|u| (u, crate::Variant::Protocol)),
            );
        }
        units.sort();
        units.dedup();
        let missing: Vec<(Unit, crate::Variant)> = units.iter().copied().filter(|&(u, v)| !gpu.unit_optimized(u, v)).collect();
        if opts.compile_all_candidates || missing.is_empty() {
            // Timed code must be the optimized builds.
            let quick = gpu.quick_builds();
            gpu.set_quick_builds(false);
            let r = gpu.prepare_units(&units, &format!("autotuning {}", plan.model));
            gpu.set_quick_builds(quick);
            r?;
        } else {
            // The plan's own units (its launches need them anyway), now (as quick builds where
            // quick builds are on); the other candidates' in the background, for the next load.
            // Only optimized builds are timed.
            let own = CudaGpu::plan_units(plan)?;
            gpu.prepare_units(&own, &plan.model)?;
            skip = units.iter().filter(|&&(u, v)| !gpu.unit_optimized(u, v)).map(|m| m.0).collect();
            let later: Vec<(Unit, crate::Variant)> = missing.iter().copied().filter(|&(u, v)| !own.contains(&(u, v))).collect();
            if !skip.is_empty() {
                report.partial = true;
                let names: Vec<String> = skip.iter().map(|u| u.name()).collect();
                eprintln!(
                    "autotune {}: tuning without the candidates of kernel units {} (compiling them in the background for \
                     the next load; these choices are not saved)",
                    plan.model,
                    names.join(", ")
                );
                if !later.is_empty() {
                    gpu.compile_in_background(later, format!("autotuning {} later", plan.model));
                }
            }
        }
        // The time budget bounds the timing, not the compilation above.
        let timing_t0 = Instant::now();
        let inputs: Vec<_> = plan.inputs.iter().enumerate().map(|(i, t)| synthetic_input(t, i as u64 + 1)).collect();
        let bufs = PlanBuffers::new(gpu, plan, &inputs, MemKind::Device)?;
        let r = time_shapes(gpu, plan, &bufs, &todo, opts, timing_t0, &skip, &mut chosen);
        bufs.free(gpu)?;
        r?;
    }
    report.timed = chosen.len();
    for (k, e) in &chosen {
        if table.entries.len() < TABLE_ENTRIES_MAX || table.entries.contains_key(k) {
            table.entries.insert(k.clone(), *e);
        }
    }
    if let Some(path) = &table_file
        && !chosen.is_empty()
        && !report.partial
        && let Err(e) = table.save(path)
    {
        eprintln!("autotune: could not save {e} (the next load tunes again)");
    }
    // Rewrite with the saved choices and the ones timed now (also when the table was full).
    let mut all = table.clone();
    all.entries.extend(chosen);
    for l in &plan.launches {
        if let Some(key) = shape_key(&l.kernel, l.dtype).map(|k| budget_key(&k, opts.block_budget_ns))
            && let Some(e) = all.entries.get(&key)
            && opts.dtypes.contains(&l.dtype)
        {
            report.plan_kernel_ns += e.plan_duration_ns;
            report.tuned_kernel_ns += e.duration_ns;
        }
    }
    all.entries.retain(|k, _| shapes.iter().any(|(s, _)| s == k));
    report.launches_changed = apply_table_within(plan, &all, opts.block_budget_ns);
    plan.validate().map_err(|e| GpuError::Invalid(format!("autotuned plan is invalid: {e}")))?;
    report.elapsed_ms = t0.elapsed().as_secs_f64() * 1e3;
    if opts.progress {
        eprintln!(
            "autotune {}: {} launches changed; tunable kernels {:.3} ms -> {:.3} ms; {:.0} ms",
            plan.model,
            report.launches_changed,
            report.plan_kernel_ns as f64 / 1e6,
            report.tuned_kernel_ns as f64 / 1e6,
            report.elapsed_ms
        );
    }
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
fn time_shapes(
    gpu: &mut CudaGpu,
    plan: &Plan,
    bufs: &PlanBuffers,
    todo: &[&(String, usize)],
    opts: &TuneOptions,
    t0: Instant,
    skip: &[Unit],
    chosen: &mut BTreeMap<String, TuneEntry>,
) -> Result<()> {
    let stream = gpu.utility_stream()?;
    let whole = gpu.info().partitions[0].sms;
    let sm_count = gpu.info().sm_count;
    let mut args = Vec::new();
    let activity = crate::progress::Activity::begin(format!("autotuning {}: 0/{} shapes", plan.model, todo.len()));
    for (n, (key, i)) in todo.iter().enumerate() {
        activity.set(format!("autotuning {}: {n}/{} shapes, {:.1} s", plan.model, todo.len(), t0.elapsed().as_secs_f64()));
        if t0.elapsed().as_millis() as u64 > opts.time_budget_ms {
            if opts.progress {
                eprintln!("autotune: time budget spent; {} shapes keep the plan's tiles", todo.len() - n);
            }
            break;
        }
        let l = &plan.launches[*i];
        bufs.bases.resolve_all(&l.args, &mut args);
        let mut timed_all: Vec<(TileChoice, u64, u64)> = Vec::new();
        for c in candidates(&l.kernel, l.dtype, &l.shape) {
            let kernel = with_tile(&l.kernel, c.tile_m, c.tile_n);
            if !skip.is_empty() && unit_of(&kernel, l.dtype, c.threads).is_ok_and(|u| skip.contains(&u)) {
                continue;
            }
            let shape = LaunchShape {
                logical_blocks: kernel.logical_blocks(),
                threads_per_block: c.threads,
                shared_mem_bytes: c.smem_bytes,
            };
            let req = LaunchRequest {
                kernel: &kernel,
                dtype: l.dtype,
                shape,
                args: &args,
                first_block: 0,
                ctas: 0,
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
            let timed = (|| {
                gpu.time_span(&req)?;
                let mut t: Vec<u64> = (0..opts.repeats.max(1)).map(|_| gpu.time_span(&req)).collect::<Result<_>>()?;
                Ok::<u64, GpuError>(median(&mut t))
            })();
            let ns = match timed {
                Ok(ns) => ns,
                Err(e) => {
                    if opts.progress {
                        eprintln!("autotune: {} {} skipped: {e}", describe(&l.kernel, l.dtype), c.label());
                    }
                    continue;
                }
            };
            let per_sm = gpu.kernel_resources(&kernel, l.dtype, &shape).map_or(1, |r| r.ctas_per_sm_max);
            let b_ns = block_ns(ns, shape.logical_blocks, per_sm, sm_count);
            if opts.log_candidates {
                eprintln!(
                    "autotune   {} {}: {:.1} us, blocks of {:.1} us",
                    describe(&l.kernel, l.dtype),
                    c.label(),
                    ns as f64 / 1e3,
                    b_ns as f64 / 1e3
                );
            }
            timed_all.push((c, ns, b_ns)); // the plan's own choice comes first
        }
        let Some((choice, duration_ns, chosen_block_ns)) = pick(&timed_all, opts.block_budget_ns) else { continue };
        let plan_duration_ns = timed_all.first().map_or(duration_ns, |c| c.1);
        if opts.progress {
            let own = TileChoice {
                tile_m: tile_of(&l.kernel).map_or(0, |t| t.0),
                tile_n: tile_of(&l.kernel).map_or(0, |t| t.1),
                threads: l.shape.threads_per_block,
                smem_bytes: l.shape.shared_mem_bytes,
            };
            eprintln!(
                "autotune [{}/{}] {}: {} {:.1} us (plan's {} {:.1} us)",
                n + 1,
                todo.len(),
                describe(&l.kernel, l.dtype),
                choice.label(),
                duration_ns as f64 / 1e3,
                own.label(),
                plan_duration_ns as f64 / 1e3
            );
        }
        chosen.insert(key.clone(), TuneEntry { choice, duration_ns, plan_duration_ns, block_ns: chosen_block_ns });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kairos_ir::graph::Act;
    use kairos_ir::plan::{Conv2dParams, EpilogueParams};

    /// A linear layer's product: 16 x 32 x 32, B's k contiguous, tiles to be set.
    fn gemm_like() -> kairos_ir::plan::GemmParams {
        kairos_ir::plan::GemmParams {
            batch0: 1,
            batch1: 1,
            m: 16,
            n: 32,
            k: 32,
            a_stride0: 0,
            a_stride1: 0,
            a_stride_m: 32,
            a_stride_k: 1,
            b_stride0: 0,
            b_stride1: 0,
            b_stride_k: 1,
            b_stride_n: 32,
            c_stride0: 0,
            c_stride1: 0,
            c_stride_m: 32,
            r_stride0: 0,
            r_stride1: 0,
            r_stride_m: 0,
            alpha: 1.0,
            epilogue: EpilogueParams::default(),
            tile_m: 16,
            tile_n: 32,
            split_k: 1,
        }
    }

    fn conv(tile_m: u32, tile_n: u32, groups: u32) -> Kernel {
        Kernel::Conv2d(Conv2dParams {
            batch: 1,
            in_h: 7,
            in_w: 7,
            in_c: 512,
            out_h: 7,
            out_w: 7,
            out_c: 512,
            kernel_h: 3,
            kernel_w: 3,
            stride_h: 1,
            stride_w: 1,
            pad_h: 1,
            pad_w: 1,
            dilation_h: 1,
            dilation_w: 1,
            groups,
            in_pixel_stride: 512,
            out_pixel_stride: 512,
            res_pixel_stride: 0,
            epilogue: EpilogueParams { bias: true, residual: false, act: Act::Relu },
            tile_m,
            tile_n,
            split_k: 1,
        })
    }

    #[test]
    fn shape_keys_ignore_the_tile_and_skip_untunable_kernels() {
        let a = shape_key(&conv(64, 64, 1), DType::F16).unwrap();
        assert_eq!(Some(a.clone()), shape_key(&conv(16, 32, 1), DType::F16));
        assert_ne!(Some(a), shape_key(&conv(64, 64, 1), DType::F32));
        assert_eq!(shape_key(&conv(64, 64, 2), DType::F16), None);
    }

    #[test]
    fn candidates_fit_the_problem_and_start_with_the_plans_choice() {
        let shape = LaunchShape { logical_blocks: 8, threads_per_block: 256, shared_mem_bytes: 40 * 1024 };
        let c = candidates(&conv(64, 64, 1), DType::F16, &shape);
        assert_eq!(c[0], TileChoice { tile_m: 64, tile_n: 64, threads: 256, smem_bytes: 40 * 1024 });
        // m = 49 rounds to 64: no 128-row tiles.
        assert!(c.iter().all(|c| c.tile_m <= 64));
        assert!(c.iter().any(|c| (c.tile_m, c.tile_n, c.smem_bytes) == (16, 16, DEEP_SMEM_BYTES)));
        assert_eq!(c.iter().filter(|x| **x == c[0]).count(), 1);
    }

    #[test]
    fn large_products_try_the_wide_entry_with_a_deep_pipeline() {
        let shape = LaunchShape { logical_blocks: 8, threads_per_block: 256, shared_mem_bytes: 104 * 1024 };
        // 7 x 7 pixels (m = 49): no 128 x 128 tile.
        assert!(candidates(&conv(64, 64, 1), DType::F16, &shape).iter().all(|c| !is_wide_tile(c.tile_m, c.tile_n, c.threads)));
        let mut big = conv(64, 64, 1);
        if let Kernel::Conv2d(p) = &mut big {
            (p.in_h, p.in_w, p.out_h, p.out_w) = (28, 28, 28, 28);
        }
        let c = candidates(&big, DType::F16, &shape);
        let wide: Vec<_> = c.iter().filter(|c| is_wide_tile(c.tile_m, c.tile_n, c.threads)).collect();
        let wide_at = |smem_bytes| TileChoice { tile_m: 128, tile_n: 128, threads: 128, smem_bytes };
        assert_eq!(wide, [&wide_at(WIDE_SHALLOW_SMEM_BYTES), &wide_at(WIDE_SMEM_BYTES), &wide_at(DEEP_SMEM_BYTES)]);
        // Not for f32 (the SIMT engine has no wide entry).
        assert!(candidates(&big, DType::F32, &shape).iter().all(|c| c.threads != 128 || c.tile_m * c.tile_n < 128 * 128));
    }

    #[test]
    fn small_m_products_get_narrow_tiles_and_small_m_candidates() {
        use kairos_ir::lower::emit::tile_for;
        // A batch-1 classifier: 1 x 25088 times 25088 x 4096 (VGG-19's fc1), and N = 1000.
        assert_eq!(tile_for(DType::F16, 1, 1, 4096), (SMALL_M_ROWS, 8));
        assert_eq!(tile_for(DType::F16, 1, 1, 1000), (SMALL_M_ROWS, 4));
        assert_eq!(tile_for(DType::F16, 8, 8, 4096), (SMALL_M_ROWS, 64));
        assert_eq!(tile_for(DType::F32, 1, 1, 4096), (64, 64));
        assert_ne!(tile_for(DType::F16, 1, 9, 4096).0, SMALL_M_ROWS);
        // 16 rows (a 16-token sequence): the plan's tensor-core tile first, the small-M tiles tried too.
        let mut g = gemm_like();
        (g.tile_m, g.tile_n) = tile_for(DType::F16, 1, 16, 32);
        let shape16 = LaunchShape { logical_blocks: 2, threads_per_block: 128, shared_mem_bytes: 52 * 1024 };
        let c16 = candidates(&Kernel::Gemm(g), DType::F16, &shape16);
        assert_ne!(c16[0].tile_m, SMALL_M_ROWS);
        assert!(c16.iter().any(|c| (c.tile_m, c.tile_n, c.threads) == (SMALL_M_ROWS, 16, 128)));
        let mut g = gemm_like();
        (g.m, g.n) = (SMALL_M_CANDIDATE_ROWS_MAX + 1, 32);
        assert!(candidates(&Kernel::Gemm(g), DType::F16, &shape16).iter().all(|c| c.tile_m != SMALL_M_ROWS));
        // conv(..) is a 7x7 map; one of 1x1 pixels is a product of one row.
        let mut k = conv(SMALL_M_ROWS, 8, 1);
        if let Kernel::Conv2d(p) = &mut k {
            (p.in_h, p.in_w, p.out_h, p.out_w, p.kernel_h, p.kernel_w, p.pad_h, p.pad_w) = (1, 1, 1, 1, 1, 1, 0, 0);
        }
        let shape = LaunchShape { logical_blocks: k.logical_blocks(), threads_per_block: 128, shared_mem_bytes: 52 * 1024 };
        let c = candidates(&k, DType::F16, &shape);
        assert_eq!((c[0].tile_m, c[0].tile_n, c[0].threads), (SMALL_M_ROWS, 8, 128));
        assert!(c.iter().any(|c| (c.tile_m, c.tile_n, c.threads) == (SMALL_M_ROWS, 4, 256)));
        assert!(c.iter().any(|c| (c.tile_m, c.tile_n) == (16, 16)));
        assert!(c.iter().all(|c| c.tile_m <= 16));
        assert_eq!(c.iter().filter(|x| **x == c[0]).count(), 1);
        // Not for f32 (beyond the plan's own choice) or taller products.
        assert!(candidates(&conv(64, 64, 1), DType::F16, &shape).iter().all(|c| c.tile_m != SMALL_M_ROWS));
        assert!(candidates(&k, DType::F32, &shape).iter().skip(1).all(|c| c.tile_m != SMALL_M_ROWS));
    }

    #[test]
    fn applying_a_table_rewrites_tiles_blocks_and_threads() {
        let k = conv(64, 64, 1);
        let key = shape_key(&k, DType::F16).unwrap();
        let mut table = TuneTable::default();
        let choice = TileChoice { tile_m: 16, tile_n: 16, threads: 128, smem_bytes: 52 * 1024 };
        table.entries.insert(key.clone(), TuneEntry { choice, duration_ns: 1, plan_duration_ns: 2, block_ns: 1 });
        // A budgeted table entry applies only to plans tuned under that budget.
        let wider = TileChoice { tile_m: 32, tile_n: 32, threads: 128, smem_bytes: 0 };
        table.entries.insert(
            budget_key(&key, Some(10_000)),
            TuneEntry { choice: wider, duration_ns: 1, plan_duration_ns: 2, block_ns: 1 },
        );
        let mut plan = Plan {
            model: "t".into(),
            dtype: DType::F16,
            inputs: vec![],
            outputs: vec![],
            launches: vec![kairos_ir::plan::Launch {
                name: "c".into(),
                kernel: k,
                dtype: DType::F16,
                shape: LaunchShape { logical_blocks: k.logical_blocks(), threads_per_block: 256, shared_mem_bytes: 0 },
                args: vec![],
                deps: vec![],
                flops: 0,
                bytes: 0,
                layer: None,
            }],
            arena_bytes: 0,
            weight_bytes: 0,
            layers: vec![],
            weights: Default::default(),
        };
        assert_eq!(k.logical_blocks(), 8);
        assert_eq!(apply_table(&mut plan, &table), 1);
        let l = &plan.launches[0];
        assert_eq!(l.kernel, conv(16, 16, 1));
        assert_eq!((l.shape.logical_blocks, l.shape.threads_per_block, l.shape.shared_mem_bytes), (4 * 32, 128, 52 * 1024));
        assert_eq!(apply_table(&mut plan, &table), 0, "a second application changes nothing");
        assert_eq!(apply_table_within(&mut plan, &table, Some(10_000)), 1);
        assert_eq!(plan.launches[0].kernel, conv(32, 32, 1));
        assert_eq!(apply_table_within(&mut plan, &table, Some(5_000)), 0, "no entry under another budget");
    }

    #[test]
    fn block_time_is_the_duration_over_the_rounds_of_resident_ctas() {
        // 132 SMs x 2 CTAs: 264 resident; 100 blocks run in one round, 600 in three.
        assert_eq!(block_ns(30_000, 100, 2, 132), 30_000);
        assert_eq!(block_ns(30_000, 600, 2, 132), 10_000);
        assert_eq!(block_ns(30_000, 264, 2, 132), 30_000);
        assert_eq!(block_ns(30_000, 265, 2, 132), 15_000);
        // Degenerate inputs do not divide by zero.
        assert_eq!(block_ns(30_000, 0, 0, 0), 30_000);
    }

    #[test]
    fn a_block_budget_picks_the_fastest_candidate_whose_blocks_fit() {
        let c = |t: u32| TileChoice { tile_m: t, tile_n: t, threads: 128, smem_bytes: 0 };
        // (choice, duration, block time); the plan's own choice first.
        let timed = [(c(128), 40_000, 40_000), (c(64), 42_000, 21_000), (c(32), 50_000, 8_000), (c(16), 48_000, 9_000)];
        // Unbudgeted: the plan's own choice unless beaten by more than the slack.
        assert_eq!(pick(&timed, None).unwrap().0, c(128));
        assert_eq!(pick(&[(c(128), 40_000, 1), (c(64), 39_500, 1)], None).unwrap().0, c(128));
        assert_eq!(pick(&[(c(128), 40_000, 1), (c(64), 30_000, 1)], None).unwrap().0, c(64));
        // A 10 us budget: the fastest of those with blocks of at most 10 us.
        assert_eq!(pick(&timed, Some(10_000)).unwrap().0, c(16));
        assert_eq!(pick(&timed, Some(25_000)).unwrap().0, c(64));
        // Nothing fits: the shortest blocks.
        assert_eq!(pick(&timed, Some(1_000)).unwrap().0, c(32));
        assert_eq!(pick(&[], Some(1_000)), None);
    }
}

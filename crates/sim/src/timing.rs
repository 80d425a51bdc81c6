//! How long a logical block takes: measured profiles, roofline estimates, and the per-launch
//! calibration that turns either into per-block parameters for the event loop.
//!
//! A block's time on an SM is
//!
//! ```text
//! t = jitter * (fixed_ns * max(1, sm_load) + dev_bytes / dev_rate_max + host_bytes / host_rate_max)
//! t = max(t, dev_bytes / level_dev, host_read_bytes / level_h2d, host_write_bytes / level_d2h)
//! ```
//!
//! `fixed_ns` is the part that scales with how crowded the SM is (compute, latency); the byte terms
//! are the block's traffic at the most one CTA can pull, and the levels are the water levels of the
//! shared bandwidth pools (see `bandwidth.rs`) when they are saturated. `sm_load` is the sum, over
//! the CTAs resident on the SM, of 1 / (CTAs of that kernel that fit on one SM): a kernel alone at
//! its own occupancy has load 1.
//!
//! For a kernel with a measured profile, `fixed_ns` is solved so that the kernel alone on the SMs
//! it was measured on takes exactly its measured time; with `duration_by_sms` the measurement at
//! the launch's SM count (linear between measured counts) is matched instead. Without a profile,
//! a roofline of the kernel's FLOPs and bytes gives the block time.

use crate::desc::GpuDesc;
use kairos_core::DType;
use kairos_core::plan::{Kernel, LaunchShape, Plan};
use kairos_gpu::profile::{KernelProfile, ModelProfile, ProfileError};
use kairos_gpu::{KernelResources, SmLimits};
use std::collections::HashMap;
use std::hash::Hasher;

/// A kernel's measured timing and resources on one GPU (one entry of a `kairos profile` JSON, or
/// a synthetic kernel registered by a benchmark).
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredKernel {
    /// Duration alone on `sm_count` SMs, launch to completion as CUDA events see it.
    pub duration_ns: u64,
    /// SM count of the measurement (the whole GPU it was measured on).
    pub sm_count: u32,
    /// Durations measured on fewer SMs, as (sm_count, duration_ns).
    pub duration_by_sms: Vec<(u32, u64)>,
    /// Resources of one CTA, if known (else the simulator's estimate is used).
    pub resources: Option<CtaResources>,
}

/// What one CTA of a kernel asks of an SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtaResources {
    pub threads_per_cta: u32,
    pub registers_per_thread: u32,
    /// Static plus dynamic shared memory.
    pub shared_mem_bytes: u32,
}

impl CtaResources {
    /// The simulator's guess for kernels without a profile: the launch shape's threads and dynamic
    /// shared memory; 64 registers per thread for conv/gemm (tiles in registers), 32 for the rest.
    pub fn estimate(kernel: &Kernel, shape: &LaunchShape) -> CtaResources {
        let registers_per_thread = match kernel {
            Kernel::Conv2d(_) | Kernel::Gemm(_) => 64,
            _ => 32,
        };
        CtaResources { threads_per_cta: shape.threads_per_block, registers_per_thread, shared_mem_bytes: shape.shared_mem_bytes }
    }

    pub fn occupancy(&self, limits: &SmLimits) -> u32 {
        KernelResources::occupancy(self.threads_per_cta, self.registers_per_thread, self.shared_mem_bytes, limits)
    }

    /// Registers one CTA holds (allocation granularity: 256 per warp group, as the occupancy rule).
    pub fn registers_per_cta(&self) -> u32 {
        (self.registers_per_thread.max(1) * self.threads_per_cta).next_multiple_of(256)
    }

    pub fn to_resources(&self, limits: &SmLimits) -> KernelResources {
        KernelResources {
            threads_per_cta: self.threads_per_cta,
            registers_per_thread: self.registers_per_thread,
            shared_mem_bytes: self.shared_mem_bytes,
            ctas_per_sm_max: self.occupancy(limits),
        }
    }
}

/// Key of a kernel in the timing table: a hash of its JSON form and its dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub hash: u64,
    pub dtype: DType,
}

/// Hashes bytes 8 at a time with a multiply-rotate mix (not cryptographic; collisions between two
/// distinct kernels of one process are astronomically unlikely at 64 bits).
struct MixWriter(u64);

impl MixWriter {
    fn mix(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl std::io::Write for MixWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut chunks = buf.chunks_exact(8);
        for c in &mut chunks {
            self.mix(u64::from_le_bytes(c.try_into().unwrap()));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.mix(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl KernelKey {
    pub fn of(kernel: &Kernel, dtype: DType) -> KernelKey {
        let mut w = MixWriter(0x9e37_79b9_7f4a_7c15);
        serde_json::to_writer(&mut w, kernel).expect("a Kernel always serializes");
        let mut h = std::hash::DefaultHasher::new();
        h.write_u64(w.0);
        KernelKey { hash: h.finish(), dtype }
    }
}

/// Measured kernels by key.
#[derive(Clone, Debug, Default)]
pub struct TimingTable {
    kernels: HashMap<KernelKey, MeasuredKernel>,
    /// Per kernel, the completion tail calibrated from its model's profile (see [`TimingTable::tail_ns`]).
    tails: HashMap<KernelKey, u64>,
}

impl TimingTable {
    pub fn len(&self) -> usize {
        self.kernels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kernels.is_empty()
    }

    pub fn insert(&mut self, kernel: &Kernel, dtype: DType, m: MeasuredKernel) {
        self.kernels.insert(KernelKey::of(kernel, dtype), m);
    }

    /// Time from a launch's last CTA leaving until the launch is complete for its stream and
    /// visible to the host, beyond the description's base latencies. Calibrated per model from its
    /// profile: the plan's end-to-end latency issued kernel by kernel, less the sum of the kernels'
    /// durations, spread over its launches (on the H200: 4 us per launch for resnet18, 25 us for
    /// resnet50, 41 us for bert_base — the protocol's end-of-launch work on persistent grids).
    pub fn tail_ns(&self, kernel: &Kernel, dtype: DType) -> u64 {
        if self.tails.is_empty() {
            return 0;
        }
        self.tails.get(&KernelKey::of(kernel, dtype)).copied().unwrap_or(0)
    }

    pub fn get(&self, kernel: &Kernel, dtype: DType) -> Option<&MeasuredKernel> {
        if self.kernels.is_empty() {
            return None;
        }
        self.kernels.get(&KernelKey::of(kernel, dtype))
    }

    /// Registers every kernel of `profile` against the launches of `plan` it was measured on.
    /// Returns how many entries were added. The profile must be of this plan: same launch count,
    /// and for each profiled launch the same logical block count. Every launch gets a completion
    /// tail: `fixed_tail_ns`, else what the profile's kernel-by-kernel latency adds to its
    /// kernels' durations, per launch.
    pub fn insert_plan(
        &mut self,
        plan: &Plan,
        profile: &ModelProfile,
        fixed_tail_ns: Option<u64>,
    ) -> Result<usize, ProfileError> {
        check_profile(plan, profile)?;
        // What the kernel-by-kernel latency adds to the kernels' durations, per launch.
        let kernel_sum: u64 = profile.kernels.iter().map(|k| k.duration_ns).sum();
        let tail = if let Some(t) = fixed_tail_ns {
            t
        } else if profile.kernels.is_empty() {
            0
        } else {
            profile.latency_ns.saturating_sub(kernel_sum) / profile.kernels.len() as u64
        };
        for k in &profile.kernels {
            let l = &plan.launches[k.launch as usize];
            self.kernels.insert(KernelKey::of(&l.kernel, l.dtype), measured_from_profile(k, profile.sm_count));
            self.tails.insert(KernelKey::of(&l.kernel, l.dtype), tail);
        }
        Ok(profile.kernels.len())
    }
}

/// Whether `profile` was measured on `plan` (see [`ModelProfile::check_plan`]).
pub fn check_profile(plan: &Plan, profile: &ModelProfile) -> Result<(), ProfileError> {
    profile.check_plan(plan)
}

fn measured_from_profile(k: &KernelProfile, sm_count: u32) -> MeasuredKernel {
    let mut by_sms: Vec<(u32, u64)> = k.duration_by_sms.iter().copied().filter(|&(s, d)| s > 0 && d > 0).collect();
    by_sms.sort_unstable();
    by_sms.dedup_by_key(|p| p.0);
    let resources = (k.threads_per_cta > 0).then_some(CtaResources {
        threads_per_cta: k.threads_per_cta,
        registers_per_thread: k.registers_per_thread,
        shared_mem_bytes: k.shared_mem_bytes,
    });
    MeasuredKernel { duration_ns: k.duration_ns.max(1), sm_count: sm_count.max(1), duration_by_sms: by_sms, resources }
}

/// Number of arguments a kernel takes, in its documented order.
pub fn arg_count(kernel: &Kernel) -> usize {
    kairos_kernels::source::arg_count(kernel)
}

/// Bytes each argument contributes to [`Kernel::bytes_moved`] (the output is always the last
/// argument). The sum equals `bytes_moved(dtype)`.
pub fn arg_bytes(kernel: &Kernel, dtype: DType) -> Vec<u64> {
    let e = dtype.size_bytes() as u64;
    match kernel {
        Kernel::Conv2d(p) | Kernel::DepthwiseConv2d(p) => {
            let input = p.batch as u64 * p.in_h as u64 * p.in_w as u64 * p.in_c as u64 * e;
            let weights = p.out_c as u64 * (p.kernel_h * p.kernel_w * p.in_c / p.groups) as u64 * e;
            let out = p.gemm_m() as u64 * p.out_c as u64 * e;
            let mut v = vec![input, weights];
            if p.epilogue.bias {
                v.push(p.out_c as u64 * e);
            }
            if p.epilogue.residual {
                v.push(out);
            }
            v.push(if p.split_k > 1 { p.split_k as u64 * p.gemm_m() as u64 * p.out_c as u64 * 4 } else { out });
            v
        }
        Kernel::Gemm(p) => {
            let batch = (p.batch0 * p.batch1) as u64;
            let a = if p.a_stride0 == 0 && p.a_stride1 == 0 { 1 } else { batch } * p.m as u64 * p.k as u64 * e;
            let b = if p.b_stride0 == 0 && p.b_stride1 == 0 { 1 } else { batch } * p.k as u64 * p.n as u64 * e;
            let c = batch * p.m as u64 * p.n as u64 * e;
            let mut v = vec![a, b];
            if p.epilogue.bias {
                v.push(p.n as u64 * e);
            }
            if p.epilogue.residual {
                v.push(c);
            }
            v.push(if p.split_k > 1 { p.split_k as u64 * batch * p.m as u64 * p.n as u64 * 4 } else { c });
            v
        }
        Kernel::Pool2d(p) => vec![p.batch as u64 * p.in_h as u64 * p.in_w as u64 * p.channels as u64 * e, p.out_elems() * e],
        Kernel::Softmax(p) => vec![p.rows as u64 * p.cols as u64 * e; 2],
        Kernel::LayerNorm(p) => {
            let x = p.rows as u64 * p.cols as u64 * e;
            vec![x, p.cols as u64 * e, p.cols as u64 * e, x]
        }
        Kernel::Reduce(p) => vec![p.outer as u64 * p.reduce as u64 * p.inner as u64 * e, p.outer as u64 * p.inner as u64 * e],
        Kernel::Gather(p) => {
            let rows = p.count as u64 * p.cols as u64 * e;
            vec![rows, p.count as u64 * 8, rows]
        }
        Kernel::Eltwise(p) => {
            let mut v: Vec<u64> = (0..p.inputs as usize)
                .map(|j| {
                    let distinct: u64 = (0..kairos_core::plan::ELTWISE_RANK_MAX)
                        .filter(|&d| p.in_strides[j][d] != 0)
                        .map(|d| p.shape[d] as u64)
                        .product();
                    distinct * p.in_dtypes[j].size_bytes() as u64
                })
                .collect();
            v.push(p.elems() * p.out_dtype.size_bytes() as u64);
            v
        }
        Kernel::SplitKSum(p) => {
            let n = p.elems();
            let mut v = vec![p.splits as u64 * n * 4];
            if p.epilogue.bias {
                v.push(p.n as u64 * e);
            }
            if p.epilogue.residual {
                v.push(n * e);
            }
            v.push(n * e);
            v
        }
    }
}

/// Per-block parameters of one launch, fixed when it is issued.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockModel {
    /// Compute/latency part of a block at SM load 1, in ns.
    pub fixed_ns: f64,
    /// Device-memory bytes one block moves.
    pub dev_bytes: f64,
    /// Most device bandwidth one CTA pulls (bytes per ns).
    pub dev_rate_max: f64,
    /// Bytes one block reads from mapped host memory, and writes to it.
    pub host_read_bytes: f64,
    pub host_write_bytes: f64,
    /// Most host-mapped bandwidth one CTA pulls (bytes per ns).
    pub host_rate_max: f64,
    /// Average demands of one CTA on the pools (bytes per ns), for the water levels.
    pub dev_demand: f64,
    pub h2d_demand: f64,
    pub d2h_demand: f64,
}

impl BlockModel {
    /// Uncontended block time at SM load 1, in ns.
    pub fn base_ns(&self) -> f64 {
        self.fixed_ns + self.dev_bytes / self.dev_rate_max + (self.host_read_bytes + self.host_write_bytes) / self.host_rate_max
    }

    /// Block time given the SM's load, a jitter factor and the pools' water levels.
    pub fn block_ns(&self, sm_load: f64, jitter: f64, level_dev: f64, level_h2d: f64, level_d2h: f64) -> f64 {
        let mut t = jitter
            * (self.fixed_ns * sm_load.max(1.0)
                + self.dev_bytes / self.dev_rate_max
                + (self.host_read_bytes + self.host_write_bytes) / self.host_rate_max);
        if self.dev_demand > level_dev {
            t = t.max(self.dev_bytes / level_dev);
        }
        if self.h2d_demand > level_h2d {
            t = t.max(self.host_read_bytes / level_h2d);
        }
        if self.d2h_demand > level_d2h {
            t = t.max(self.host_write_bytes / level_d2h);
        }
        t
    }
}

/// Where a launch's arguments live, as fractions of its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostSplit {
    /// Fraction of the kernel's bytes read from mapped host memory.
    pub read: f64,
    /// Fraction written to mapped host memory.
    pub write: f64,
}

/// Everything the calibration needs about one launch.
pub struct LaunchSpec<'a> {
    pub kernel: &'a Kernel,
    pub dtype: DType,
    /// CTAs of this kernel that fit on one SM.
    pub occupancy: u32,
    /// SMs the launch may do work on (mask within partition).
    pub sm_count: u32,
    pub host: HostSplit,
    pub measured: Option<&'a MeasuredKernel>,
}

/// Rate at which one SM can pull device memory, in bytes per ns.
pub fn sm_bandwidth(desc: &GpuDesc) -> f64 {
    desc.device_mem_bytes_per_s / 1e9 / (desc.sm_count as f64 * desc.model.bandwidth_saturation_sm_fraction).max(1.0)
}

/// Total device bandwidth kernels share, in bytes per ns.
pub fn kernel_bandwidth(desc: &GpuDesc) -> f64 {
    desc.device_mem_bytes_per_s / 1e9 * desc.model.kernel_memory_efficiency
}

/// Peak FLOP rate (per ns, whole GPU) the roofline uses for a kernel.
fn flop_rate(desc: &GpuDesc, kernel: &Kernel, dtype: DType) -> f64 {
    let m = &desc.model;
    let r = match (kernel, dtype) {
        (Kernel::Conv2d(_) | Kernel::Gemm(_), DType::F16) => desc.fp16_tensor_flops_per_s * m.tensor_core_efficiency,
        (Kernel::Conv2d(_) | Kernel::Gemm(_), _) => desc.fp32_flops_per_s * m.fp32_gemm_efficiency,
        _ => desc.fp32_flops_per_s * m.simt_efficiency,
    };
    r / 1e9
}

/// Measured duration at `sms` SMs, linear between measured points; returns the SM count the
/// returned duration belongs to (clamped into the measured range).
fn measured_at(m: &MeasuredKernel, sms: u32) -> (u32, f64) {
    if m.duration_by_sms.is_empty() {
        return (m.sm_count, m.duration_ns as f64);
    }
    let mut pts: Vec<(u32, u64)> = m.duration_by_sms.clone();
    if !pts.iter().any(|p| p.0 == m.sm_count) {
        pts.push((m.sm_count, m.duration_ns));
        pts.sort_unstable();
    }
    let first = pts[0];
    let last = *pts.last().unwrap();
    if sms <= first.0 {
        return (first.0, first.1 as f64);
    }
    if sms >= last.0 {
        return (last.0, last.1 as f64);
    }
    for w in pts.windows(2) {
        let (s0, d0) = w[0];
        let (s1, d1) = w[1];
        if sms >= s0 && sms <= s1 {
            let f = (sms - s0) as f64 / (s1 - s0) as f64;
            return (sms, d0 as f64 + f * (d1 as f64 - d0 as f64));
        }
    }
    (last.0, last.1 as f64)
}

/// The per-block model of a launch. See the module docs.
pub fn calibrate(desc: &GpuDesc, spec: &LaunchSpec<'_>) -> BlockModel {
    let n = spec.kernel.logical_blocks().max(1) as f64;
    let occ = spec.occupancy.max(1) as f64;
    let mut bytes_blk = spec.kernel.bytes_moved(spec.dtype) as f64 / n;
    let mut dev_rate_max = sm_bandwidth(desc) / occ;
    let host_rate_max = desc.model.host_read_per_cta_bytes_per_s / 1e9;
    let fixed_ns;
    match spec.measured {
        None => {
            let flops_blk = spec.kernel.flops() as f64 / n;
            let cta_rate = flop_rate(desc, spec.kernel, spec.dtype) / desc.sm_count as f64 / occ;
            fixed_ns = desc.model.block_latency_ns + flops_blk / cta_rate;
        }
        Some(m) => {
            let (s_cal, duration) = measured_at(m, spec.sm_count);
            let overhead = (desc.latency.grid_dispatch_ns + desc.latency.grid_complete_ns) as f64;
            let blocks_ns = (duration - overhead).max(100.0);
            let ctas = (s_cal as f64 * occ).min(n).max(1.0);
            let waves = (n / ctas).ceil();
            let t_b = blocks_ns / waves;
            // Measured faster than the pool allows: the kernel moves fewer bytes through DRAM than
            // counted (L2 reuse), so count fewer.
            let bw = kernel_bandwidth(desc);
            if ctas * bytes_blk > 0.98 * bw * t_b {
                bytes_blk = 0.98 * bw * t_b / ctas;
            }
            let mem = bytes_blk / dev_rate_max;
            if t_b - mem >= 0.05 * t_b {
                fixed_ns = t_b - mem;
            } else {
                // One CTA moves its bytes faster than the per-SM rate assumes: raise this kernel's rate.
                fixed_ns = 0.05 * t_b;
                dev_rate_max = bytes_blk / (0.95 * t_b);
            }
        }
    }
    let host_read_bytes = bytes_blk * spec.host.read;
    let host_write_bytes = bytes_blk * spec.host.write;
    let dev_bytes = bytes_blk * (1.0 - spec.host.read - spec.host.write).max(0.0);
    let mut model = BlockModel {
        fixed_ns,
        dev_bytes,
        dev_rate_max,
        host_read_bytes,
        host_write_bytes,
        host_rate_max,
        dev_demand: 0.0,
        h2d_demand: 0.0,
        d2h_demand: 0.0,
    };
    let base = model.base_ns().max(1.0);
    model.dev_demand = dev_bytes / base;
    model.h2d_demand = host_read_bytes / base;
    model.d2h_demand = host_write_bytes / base;
    model
}

#[cfg(test)]
mod tests {
    use super::*;
    use kairos_core::graph::Act;
    use kairos_core::plan::*;

    pub(crate) fn gemm(m: u32, n: u32, k: u32, tile: u32) -> Kernel {
        Kernel::Gemm(GemmParams {
            batch0: 1,
            batch1: 1,
            m,
            n,
            k,
            a_stride0: 0,
            a_stride1: 0,
            a_stride_m: k as u64,
            a_stride_k: 1,
            b_stride0: 0,
            b_stride1: 0,
            b_stride_k: n as u64,
            b_stride_n: 1,
            c_stride0: 0,
            c_stride1: 0,
            c_stride_m: n as u64,
            r_stride0: 0,
            r_stride1: 0,
            r_stride_m: 0,
            alpha: 1.0,
            epilogue: EpilogueParams { bias: true, residual: true, act: Act::Relu },
            tile_m: tile,
            tile_n: tile,
            split_k: 1,
        })
    }

    #[test]
    fn arg_bytes_sum_to_bytes_moved() {
        let k = gemm(256, 512, 128, 64);
        for dt in [DType::F32, DType::F16] {
            assert_eq!(arg_bytes(&k, dt).iter().sum::<u64>(), k.bytes_moved(dt));
            assert_eq!(arg_bytes(&k, dt).len(), arg_count(&k));
        }
    }

    #[test]
    fn kernel_keys_tell_kernels_apart() {
        let a = gemm(256, 512, 128, 64);
        let b = gemm(256, 512, 129, 64);
        assert_eq!(KernelKey::of(&a, DType::F16), KernelKey::of(&a, DType::F16));
        assert_ne!(KernelKey::of(&a, DType::F16), KernelKey::of(&b, DType::F16));
        assert_ne!(KernelKey::of(&a, DType::F16), KernelKey::of(&a, DType::F32));
    }

    #[test]
    fn measured_durations_interpolate_between_sm_counts() {
        let m = MeasuredKernel {
            duration_ns: 100_000,
            sm_count: 132,
            duration_by_sms: vec![(8, 900_000), (64, 200_000)],
            resources: None,
        };
        assert_eq!(measured_at(&m, 132), (132, 100_000.0));
        assert_eq!(measured_at(&m, 4), (8, 900_000.0));
        assert_eq!(measured_at(&m, 64), (64, 200_000.0));
        let (s, d) = measured_at(&m, 98);
        assert_eq!(s, 98);
        assert!((d - 150_000.0).abs() < 1.0, "{d}");
    }

    #[test]
    fn roofline_fp16_gemm_is_faster_than_fp32() {
        let desc = GpuDesc::h100_sxm();
        let k = gemm(2048, 2048, 2048, 128);
        let spec =
            |dtype| LaunchSpec { kernel: &k, dtype, occupancy: 2, sm_count: 132, host: HostSplit::default(), measured: None };
        let f16 = calibrate(&desc, &spec(DType::F16));
        let f32 = calibrate(&desc, &spec(DType::F32));
        assert!(f16.base_ns() * 3.0 < f32.base_ns(), "f16 {} f32 {}", f16.base_ns(), f32.base_ns());
    }

    #[test]
    fn host_mapped_arguments_move_bytes_off_device_memory() {
        let desc = GpuDesc::h100_sxm();
        let k = gemm(64, 4096, 4096, 64);
        let spec = |host| LaunchSpec { kernel: &k, dtype: DType::F16, occupancy: 4, sm_count: 132, host, measured: None };
        let dev = calibrate(&desc, &spec(HostSplit::default()));
        let host = calibrate(&desc, &spec(HostSplit { read: 0.9, write: 0.0 }));
        assert!(host.dev_bytes < dev.dev_bytes * 0.2);
        assert!(host.base_ns() > dev.base_ns(), "reading weights over PCIe must be slower");
    }
}

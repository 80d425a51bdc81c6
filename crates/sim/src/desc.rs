//! GPU descriptions: what the simulator needs to know about a GPU model.
//!
//! The descriptions live as JSON under `data/gpus/` (one file per GPU, editable by users who want to
//! ask "what if" about a GPU kairos has no file for) and are embedded into the binary, so
//! [`GpuDesc::h100_sxm`] and friends work from any directory. Every figure names its source in the
//! file's `notes`: vendor datasheets for peaks, the device probe on the H200 for latencies and
//! bandwidths that were measured, and named assumptions for the rest.

use kairos_gpu::{DeviceInfo, Partition, PartitionId, SM_COUNT_MAX, SmLimits, SmMask};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Latencies of the launch path, notifications and copies, in nanoseconds, and the spread of their
/// random jitter (the sigma of a log-normal factor with median 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencyDesc {
    /// Host time one launch (or async copy) call costs: the simulator advances its clock by this much
    /// inside [`kairos_gpu::Gpu::launch`]. H100 SXM: 4.0 us, the dispatcher's measured time per
    /// launch (3.3 us with 2 launcher threads) and policy decision (0.6-1.2 us).
    pub launch_host_ns: u64,
    /// From the start of the launch call until the command sits in its hardware queue (median).
    pub launch_latency_ns: u64,
    /// From a grid leaving the head of its hardware queue until its first CTAs can be placed.
    pub grid_dispatch_ns: u64,
    /// From a grid's last CTA exiting until the grid counts as complete for its stream (the next
    /// command of that stream may only start then).
    pub grid_complete_ns: u64,
    /// From an event on the GPU until the host can poll it from the notification ring (median).
    /// Probe: launch -> block start seen 6.0 us p50 / 9.7 us p99 = launch latency + dispatch + this.
    pub notify_delay_ns: u64,
    /// Host time one notification costs the dispatcher (decoding the record, updating the job, the
    /// occupancy model and the estimates): the simulator advances its clock by this much per event
    /// that [`kairos_gpu::Gpu::poll`] delivers, so the dispatcher thread is a busy resource shared by
    /// launches and records. 0 (free) unless a description measured it.
    #[serde(default)]
    pub event_host_ns: u64,
    /// Completion tail of every launch of a profiled kernel: what the dispatcher's kernel-by-kernel
    /// latency adds to the profile's kernel durations. `None`: calibrated per model from the
    /// profile itself (its kernel-by-kernel latency beyond its kernels' durations, which counts
    /// the profiler's own host round trips). H100 SXM: 4.0 us, the fit of the dispatcher's
    /// latency alone against the profiles' kernel sums over 8 models (3.9-5.4 us per launch).
    #[serde(default)]
    pub profiled_launch_tail_ns: Option<u64>,
    /// The same tail for a light launch (one that is not preemptible, runs on its whole partition
    /// and reports no CTAs: kairos-cuda runs it without the per-block protocol work), and for a
    /// silent one (a light launch that reports neither its start nor its end). `None`: the tail of
    /// every launch. H100 SXM: 2.2 and 0.5 us (data/gpus/h100_sxm.json says how they were fitted).
    #[serde(default)]
    pub light_launch_tail_ns: Option<u64>,
    #[serde(default)]
    pub silent_launch_tail_ns: Option<u64>,
    /// Between two launches of one replayed recorded run (a CUDA graph's kernel nodes) on a
    /// stream: from the earlier one's last CTA (after its tail) until the later one's CTAs can be
    /// placed. It replaces `grid_complete_ns + grid_dispatch_ns`, which a profile's event-timed
    /// kernel durations include and which the GPU's graph executor mostly hides by staging the
    /// next node while one runs. `None`: no difference (a replayed launch waits the two in full).
    /// H100 SXM: 1.5 us, calibrated on the isolated latencies of 8 models (data/gpus/h100_sxm.json).
    #[serde(default)]
    pub graph_node_gap_ns: Option<u64>,
    /// The serving engine's host path per request, outside the dispatcher's own work: the
    /// threaded engine's submission queue and waking its dispatcher thread on the way in, the
    /// completion callback back to the client on the way out. The simulated GPU never sees it;
    /// a virtual serving run (`kairos bench run --backend sim`) charges it by handing each request
    /// to the dispatcher this long after its arrival (`VirtualDriver::set_request_host_ns`), so
    /// its latency counts it. 0 (none) unless a description measured it. H100 SXM: 90 us, the
    /// p50 queue time of requests that found a stream free at load 1 in call 26
    /// (`scripts/host_path.py`, data/gpus/h100_sxm.json).
    #[serde(default)]
    pub request_host_ns: u64,
    /// Log-normal sigma of launch latencies and notification delays (p99/p50 = exp(2.33 sigma)).
    pub latency_sigma: f64,
    /// One read of the host's preempt flag over PCIe: a poll that finds the flag set makes the
    /// launch's stop bit visible this much later.
    pub preempt_flag_delay_ns: u64,
    /// A launch's CTAs read the host's preempt flag at most this often (a take claims the poll when
    /// the last one is older; kairos-cuda's `PREEMPT_POLL_NS`).
    #[serde(default = "default_preempt_poll_ns")]
    pub preempt_poll_ns: u64,
    /// With kairos-cuda's device-memory preempt flag (its default, `KAIROS_PREEMPT_FLAG=device`):
    /// from the host's stream-write call until the flag is in device memory; every take reads it
    /// first and takes nothing once it is there, so the two fields above do not apply. `None`:
    /// the host-memory flag.
    #[serde(default)]
    pub preempt_flag_write_ns: Option<u64>,
    /// Fixed setup time of one DMA copy on a copy engine, and of a synchronous read or write.
    pub copy_setup_ns: u64,
    /// Time a CTA that takes no logical block (outside its SM mask, nothing left, flag set) holds
    /// its SM slot before it is gone.
    pub cta_exit_ns: u64,
}

fn default_preempt_poll_ns() -> u64 {
    4_000
}

/// Knobs of the timing model for kernels without a measured profile, and of the contention model.
/// See the crate docs ("Timing model") for how they are used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelDesc {
    /// Fixed latency of one logical block (memory latency, setup, tail), for roofline estimates.
    pub block_latency_ns: f64,
    /// Fraction of the dense fp16 tensor-core peak that kairos' own conv/gemm kernels reach.
    pub tensor_core_efficiency: f64,
    /// Fraction of the fp32 peak that fp32 conv/gemm kernels reach.
    pub fp32_gemm_efficiency: f64,
    /// Fraction of the fp32 peak that the other kernels (element-wise, reductions, ...) reach.
    pub simt_efficiency: f64,
    /// Fraction of `device_mem_bytes_per_s` that kernels (as opposed to pure streaming) can reach
    /// in total.
    pub kernel_memory_efficiency: f64,
    /// Fraction of the SMs needed to saturate device memory: one SM can pull at most
    /// `device_mem_bytes_per_s / (sm_count * this)`. Assumption: half of the SMs saturate HBM.
    pub bandwidth_saturation_sm_fraction: f64,
    /// Most bandwidth one CTA can pull from mapped host memory (PCIe round trips bound it).
    pub host_read_per_cta_bytes_per_s: f64,
    /// Log-normal sigma of a launch's duration factor (drawn once per launch).
    pub kernel_duration_sigma: f64,
    /// Log-normal sigma of one wave of logical blocks (drawn once per group of CTAs per block).
    pub block_duration_sigma: f64,
    /// Co-run interference, a fraction: a block takes `1 + this * others` times its time, where
    /// `others` counts the other launches with CTAs working on the GPU when the block starts, each
    /// weighted by the fraction of the GPU's SMs its working CTAs cover (at most 1). It
    /// stands for what the SM-sharing and bandwidth pools do not see: co-running kernels evicting
    /// each other's working sets from L2, queueing in the memory system well below its bandwidth
    /// limit, contending for the SMs' instruction caches and warp schedulers. 0 (none) unless a
    /// description calibrated it. H100 SXM: 0.14, fitted to the per-request GPU time against the
    /// requests in service in the 8-model mix under `streams:8` (data/gpus/h100_sxm.json).
    #[serde(default)]
    pub corun_slowdown_per_launch: f64,
}

/// A GPU model as the simulator sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuDesc {
    /// Short key, also the folder name of its profiles under `data/profiles/` (e.g. "h100_sxm").
    pub key: String,
    pub name: String,
    pub arch: String,
    pub sm_count: u32,
    pub sm_limits: SmLimits,
    /// Largest CTA in threads.
    pub threads_per_cta_max: u32,
    /// Largest shared memory one CTA may use (227 KiB on sm_90; the SM has 228 KiB).
    pub shared_mem_per_cta_bytes_max: u32,
    pub memory_bytes: u64,
    /// Most pinned host memory the simulator lets a process map.
    pub host_mapped_bytes_max: u64,
    /// Smallest hardware partition (green context) in SMs.
    pub partition_granularity_sms: u32,
    /// Partition sizes offered besides the whole device: aligned groups of each size.
    pub partition_sizes_sms: Vec<u32>,
    /// Hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default).
    pub hardware_queues: u32,
    /// Grids the compute work distributor holds at once (128 on Hopper).
    pub concurrent_grids_max: u32,
    pub h2d_bytes_per_s: f64,
    pub d2h_bytes_per_s: f64,
    /// Device memory bandwidth kernels and copies share (measured read bandwidth where known).
    pub device_mem_bytes_per_s: f64,
    /// Bytes copied per second by a device-to-device copy alone (each byte is read and written).
    pub d2d_copy_bytes_per_s: f64,
    /// Total rate at which kernels can read mapped pinned host memory.
    pub host_mapped_read_bytes_per_s: f64,
    /// Host memcpy rate for synchronous writes into host-mapped memory.
    pub host_memcpy_bytes_per_s: f64,
    /// Peak fp32 rate on the CUDA cores.
    pub fp32_flops_per_s: f64,
    /// Peak dense fp16 tensor-core rate (fp32 accumulate).
    pub fp16_tensor_flops_per_s: f64,
    pub latency: LatencyDesc,
    pub model: ModelDesc,
    /// Where the figures come from.
    #[serde(default)]
    pub notes: Vec<String>,
}

const H100_SXM_JSON: &str = include_str!("../../../data/gpus/h100_sxm.json");
const H100_PCIE_JSON: &str = include_str!("../../../data/gpus/h100_pcie.json");
const H200_JSON: &str = include_str!("../../../data/gpus/h200.json");

impl GpuDesc {
    /// NVIDIA H100 SXM5 80 GB: 132 SMs, HBM3.
    pub fn h100_sxm() -> GpuDesc {
        Self::parse(H100_SXM_JSON).expect("embedded data/gpus/h100_sxm.json is valid")
    }

    /// NVIDIA H100 PCIe 80 GB: 114 SMs, HBM2e.
    pub fn h100_pcie() -> GpuDesc {
        Self::parse(H100_PCIE_JSON).expect("embedded data/gpus/h100_pcie.json is valid")
    }

    /// NVIDIA H200 SXM 141 GB: 132 SMs, HBM3e.
    pub fn h200() -> GpuDesc {
        Self::parse(H200_JSON).expect("embedded data/gpus/h200.json is valid")
    }

    /// The built-in descriptions.
    pub fn builtin() -> Vec<GpuDesc> {
        vec![Self::h100_sxm(), Self::h100_pcie(), Self::h200()]
    }

    /// A built-in description by key ("h100_sxm", "h100_pcie", "h200").
    pub fn by_key(key: &str) -> Option<GpuDesc> {
        Self::builtin().into_iter().find(|d| d.key == key)
    }

    pub fn parse(json: &str) -> Result<GpuDesc, String> {
        let d: GpuDesc = serde_json::from_str(json).map_err(|e| format!("GPU description is not valid: {e}"))?;
        d.validate()?;
        Ok(d)
    }

    pub fn load(path: &Path) -> Result<GpuDesc, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Where this GPU's measured profiles live under a repository root: `data/profiles/<key>/`.
    pub fn profile_dir(&self, repo_root: &Path) -> std::path::PathBuf {
        repo_root.join("data").join("profiles").join(&self.key)
    }

    /// Checks the description's relations (sizes in range, rates positive).
    pub fn validate(&self) -> Result<(), String> {
        let l = &self.sm_limits;
        let fail = |what: &str| Err(format!("GPU description '{}': {what}", self.key));
        if self.sm_count == 0 || self.sm_count as usize > SM_COUNT_MAX {
            return fail(&format!("sm_count {} outside 1..={SM_COUNT_MAX}", self.sm_count));
        }
        if l.threads_max == 0 || l.registers_max == 0 || l.shared_mem_bytes_max == 0 || l.ctas_max == 0 {
            return fail("an SM limit is zero");
        }
        if self.threads_per_cta_max == 0 || self.threads_per_cta_max > l.threads_max {
            return fail("threads_per_cta_max must be in 1..=sm_limits.threads_max");
        }
        if self.shared_mem_per_cta_bytes_max > l.shared_mem_bytes_max {
            return fail("shared_mem_per_cta_bytes_max exceeds the SM's shared memory");
        }
        if self.partition_granularity_sms == 0
            || self.partition_sizes_sms.iter().any(|&s| s % self.partition_granularity_sms != 0)
        {
            return fail("partition sizes must be multiples of a nonzero granularity");
        }
        if self.hardware_queues == 0 || self.hardware_queues > 128 {
            return fail("hardware_queues outside 1..=128");
        }
        if self.concurrent_grids_max == 0 {
            return fail("concurrent_grids_max is zero");
        }
        let rates = [
            self.h2d_bytes_per_s,
            self.d2h_bytes_per_s,
            self.device_mem_bytes_per_s,
            self.d2d_copy_bytes_per_s,
            self.host_mapped_read_bytes_per_s,
            self.host_memcpy_bytes_per_s,
            self.fp32_flops_per_s,
            self.fp16_tensor_flops_per_s,
            self.model.tensor_core_efficiency,
            self.model.fp32_gemm_efficiency,
            self.model.simt_efficiency,
            self.model.kernel_memory_efficiency,
            self.model.bandwidth_saturation_sm_fraction,
            self.model.host_read_per_cta_bytes_per_s,
        ];
        if rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return fail("every rate and efficiency must be positive and finite");
        }
        let sigmas = [self.latency.latency_sigma, self.model.kernel_duration_sigma, self.model.block_duration_sigma];
        if sigmas.iter().any(|s| !(s.is_finite() && (0.0..=1.0).contains(s))) {
            return fail("jitter sigmas must be in [0, 1]");
        }
        if !(self.model.block_latency_ns.is_finite() && self.model.block_latency_ns >= 0.0) {
            return fail("block_latency_ns must be finite and >= 0");
        }
        if !(self.model.corun_slowdown_per_launch.is_finite() && self.model.corun_slowdown_per_launch >= 0.0) {
            return fail("corun_slowdown_per_launch must be finite and >= 0");
        }
        Ok(())
    }

    /// The hardware partitions: [0] the whole device, then for each size in `partition_sizes_sms`
    /// (smaller than the device) the aligned groups [k * size, (k + 1) * size) that fit.
    pub fn partitions(&self) -> Vec<Partition> {
        let mut parts = vec![Partition { id: PartitionId::WHOLE, sms: SmMask::first(self.sm_count) }];
        for &size in &self.partition_sizes_sms {
            if size == 0 || size >= self.sm_count {
                continue;
            }
            for k in 0..self.sm_count / size {
                parts.push(Partition { id: PartitionId(parts.len() as u32), sms: SmMask::range(k * size, size) });
            }
        }
        parts
    }

    /// What [`kairos_gpu::Gpu::info`] reports.
    pub fn device_info(&self) -> DeviceInfo {
        DeviceInfo {
            name: format!("{} (simulated)", self.name),
            arch: self.arch.clone(),
            sm_count: self.sm_count,
            sm_limits: self.sm_limits,
            memory_bytes: self.memory_bytes,
            partitions: self.partitions(),
            partition_granularity_sms: self.partition_granularity_sms,
            hardware_queues: self.hardware_queues,
            h2d_bytes_per_s: self.h2d_bytes_per_s,
            d2h_bytes_per_s: self.d2h_bytes_per_s,
            device_mem_bytes_per_s: self.device_mem_bytes_per_s,
            host_mapped_read_bytes_per_s: self.host_mapped_read_bytes_per_s,
            launches_in_flight_max: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_descriptions_parse_and_match_the_datasheets() {
        let sxm = GpuDesc::h100_sxm();
        let pcie = GpuDesc::h100_pcie();
        let h200 = GpuDesc::h200();
        assert_eq!((sxm.sm_count, pcie.sm_count, h200.sm_count), (132, 114, 132));
        for d in [&sxm, &pcie, &h200] {
            assert_eq!(d.arch, "sm_90");
            assert_eq!(
                d.sm_limits,
                SmLimits { threads_max: 2048, registers_max: 65536, shared_mem_bytes_max: 228 * 1024, ctas_max: 32 }
            );
            assert_eq!(d.shared_mem_per_cta_bytes_max, 227 * 1024);
            assert_eq!(d.partition_granularity_sms, 8);
            assert_eq!(d.hardware_queues, 8);
        }
        assert!(
            h200.device_mem_bytes_per_s > sxm.device_mem_bytes_per_s && sxm.device_mem_bytes_per_s > pcie.device_mem_bytes_per_s
        );
        assert!(h200.memory_bytes > sxm.memory_bytes);
    }

    #[test]
    fn partitions_are_aligned_groups_and_whole_comes_first() {
        let d = GpuDesc::h100_sxm();
        let parts = d.partitions();
        assert_eq!(parts[0].sms.count(), 132);
        for (i, p) in parts.iter().enumerate() {
            assert_eq!(p.id, PartitionId(i as u32));
            if i > 0 {
                let first = p.sms.iter().next().unwrap();
                assert_eq!(first % p.sms.count(), 0, "partition {i} is not aligned");
                assert_eq!(p.sms.count() % 8, 0);
            }
        }
        // 16 of 8, 8 of 16, 4 of 32, 2 of 64.
        assert_eq!(parts.len(), 1 + 16 + 8 + 4 + 2);
    }

    #[test]
    fn invalid_descriptions_are_rejected() {
        let mut d = GpuDesc::h100_sxm();
        d.sm_count = 0;
        assert!(d.validate().is_err());
        let mut d = GpuDesc::h100_sxm();
        d.device_mem_bytes_per_s = 0.0;
        assert!(d.validate().is_err());
        assert!(GpuDesc::parse("{").is_err());
    }
}

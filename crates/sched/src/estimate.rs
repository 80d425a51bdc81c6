//! Kernel duration estimates: where SRPT's "remaining time" comes from.
//!
//! Each launch of a model starts from its profiled duration (a `kairos profile` JSON, when one is
//! given and matches the plan) or else from a roofline: the larger of FLOPs over the compute rate
//! and bytes over the memory bandwidth, both scaled by the share of the GPU the launch's CTAs can
//! cover, plus a fixed launch overhead. Every completed launch then refines its own estimate with
//! the duration the GPU reported (first logical block taken to launch done, for launches that
//! report their start; otherwise first CTA placed, or the end of the launch before it on its
//! stream if that came later, to launch done): a running mean over the first `window` samples, an
//! exponential average with weight 1/window after that. A job's remaining time is the sum of the
//! *current* estimates of its launches not done: the dispatcher moves every admitted job's
//! remaining time when an estimate moves.

use crate::request::EstimateSource;
use kairos_core::DType;
use kairos_core::plan::Plan;
use kairos_gpu::profile::ModelProfile;

/// The device rates a roofline needs. `DeviceInfo` carries the memory bandwidth; compute rates
/// are configuration because kairos' own kernels reach a fraction of the datasheet peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RooflineRates {
    pub flops_per_s_f32: f64,
    pub flops_per_s_f16: f64,
    pub mem_bytes_per_s: f64,
    /// Added to every kernel: launch, first-CTA and drain costs.
    pub launch_overhead_ns: f64,
    pub sm_count: u32,
}

impl RooflineRates {
    /// Estimated duration of a launch that starts `ctas` CTAs.
    pub fn duration_ns(&self, flops: u64, bytes: u64, dtype: DType, ctas: u32) -> f64 {
        let share = (ctas as f64 / self.sm_count.max(1) as f64).clamp(1.0 / self.sm_count.max(1) as f64, 1.0);
        let flops_rate = match dtype {
            DType::F16 => self.flops_per_s_f16,
            _ => self.flops_per_s_f32,
        } * share;
        let mem_rate = self.mem_bytes_per_s * share;
        let compute_ns = flops as f64 / flops_rate.max(1.0) * 1e9;
        let memory_ns = bytes as f64 / mem_rate.max(1.0) * 1e9;
        self.launch_overhead_ns + compute_ns.max(memory_ns)
    }
}

/// Per-launch duration estimates of one model.
#[derive(Clone, Debug)]
pub struct Estimates {
    est_ns: Vec<f64>,
    samples: Vec<u32>,
    total_ns: f64,
    window: u32,
    source: EstimateSource,
}

impl Estimates {
    /// `ctas[i]` is the number of CTAs launch i starts by default (for the roofline's GPU share).
    pub fn new(plan: &Plan, profile: Option<&ModelProfile>, rates: &RooflineRates, ctas: &[u32], window: u32) -> Estimates {
        let n = plan.launches.len();
        let from_profile = profile.filter(|p| {
            p.kernels.len() == n && p.kernels.iter().enumerate().all(|(i, k)| k.launch as usize == i && k.duration_ns > 0)
        });
        let (est_ns, source): (Vec<f64>, _) = match from_profile {
            Some(p) => (p.kernels.iter().map(|k| k.duration_ns as f64).collect(), EstimateSource::Profile),
            None => (
                plan.launches.iter().zip(ctas).map(|(l, &c)| rates.duration_ns(l.flops, l.bytes, l.dtype, c)).collect(),
                EstimateSource::Roofline,
            ),
        };
        let total_ns = est_ns.iter().sum();
        Estimates { est_ns, samples: vec![0; n], total_ns, window: window.max(1), source }
    }

    pub fn source(&self) -> EstimateSource {
        self.source
    }

    pub fn get(&self, launch: u32) -> f64 {
        self.est_ns[launch as usize]
    }

    pub fn samples(&self, launch: u32) -> u32 {
        self.samples[launch as usize]
    }

    /// Sum over all launches: one request's GPU time.
    pub fn total_ns(&self) -> f64 {
        self.total_ns
    }

    /// Folds in one observed duration of a launch that ran all its blocks; returns how far the
    /// launch's estimate moved (new minus old).
    pub fn observe(&mut self, launch: u32, duration_ns: u64) -> f64 {
        let i = launch as usize;
        let n = (self.samples[i] + 1).min(self.window);
        let old = self.est_ns[i];
        let new = old + (duration_ns as f64 - old) / n as f64;
        self.est_ns[i] = new;
        self.samples[i] = self.samples[i].saturating_add(1);
        self.total_ns += new - old;
        new - old
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates() -> RooflineRates {
        RooflineRates {
            flops_per_s_f32: 1e12,
            flops_per_s_f16: 2e12,
            mem_bytes_per_s: 1e12,
            launch_overhead_ns: 1000.0,
            sm_count: 100,
        }
    }

    #[test]
    fn roofline_takes_the_slower_side_and_scales_with_ctas() {
        let r = rates();
        // 1 GFLOP on the whole GPU at 1 TFLOP/s: 1 ms; bytes are cheaper.
        assert_eq!(r.duration_ns(1_000_000_000, 1000, DType::F32, 100), 1000.0 + 1e6);
        // fp16 runs at twice the rate.
        assert_eq!(r.duration_ns(1_000_000_000, 1000, DType::F16, 100), 1000.0 + 5e5);
        // Ten CTAs cover a tenth of the GPU: ten times slower.
        assert_eq!(r.duration_ns(1_000_000_000, 1000, DType::F32, 10), 1000.0 + 1e7);
        // Memory bound.
        assert_eq!(r.duration_ns(0, 2_000_000, DType::F32, 200), 1000.0 + 2000.0);
    }
}

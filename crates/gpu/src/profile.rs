//! Kernel profiles: what `kairos profile` measures on a real GPU, and what the dispatcher (SRPT
//! estimates, right-sizing) and the simulator (kernel durations) read.

use kairos_core::DType;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What can go wrong with a profile: reading or writing it, parsing it, or using it for a plan it
/// was not measured on.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot {what} profile {}: {source}", path.display())]
    Io { what: &'static str, path: std::path::PathBuf, source: std::io::Error },
    #[error("profile {} is not valid: {source}", path.display())]
    Invalid { path: std::path::PathBuf, source: serde_json::Error },
    /// Measured on another lowering of the model (other dtype, tiles or launches): the message says
    /// what differs.
    #[error("{0}")]
    Stale(String),
}

impl From<ProfileError> for crate::GpuError {
    fn from(e: ProfileError) -> Self {
        crate::GpuError::Invalid(e.to_string())
    }
}

/// One launch of a plan, as measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelProfile {
    /// Index of the launch in the plan.
    pub launch: u32,
    pub name: String,
    pub kernel: String,
    /// Median duration on the whole GPU.
    pub duration_ns: u64,
    pub logical_blocks: u32,
    pub ctas: u32,
    pub threads_per_cta: u32,
    pub registers_per_thread: u32,
    pub shared_mem_bytes: u32,
    pub ctas_per_sm_max: u32,
    /// Fraction of the SM's thread slots one resident CTA set fills (0..1).
    pub occupancy: f64,
    /// KRISP's right size: the fewest SMs at which the duration stays within 5% of the whole
    /// GPU's, searched in partition steps and then SM by SM below the first step that kept it
    /// ([`refine_right_size`]; profiles made before that stop at the step).
    pub min_sms: u32,
    /// Durations measured at each SM count tried, as (sm_count, duration_ns).
    #[serde(default)]
    pub duration_by_sms: Vec<(u32, u64)>,
}

/// Profile of one model's plan on one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub model: String,
    pub dtype: DType,
    pub batch: usize,
    pub device: String,
    pub sm_count: u32,
    /// Median end-to-end latency of the plan issued launch by launch.
    pub latency_ns: u64,
    pub kernels: Vec<KernelProfile>,
    /// DeepPlan's per-layer profile (`kairos profile --layers`), for cold-start plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<LayerProfile>,
    /// Kernel times on SM sets placed over the GPCs (`kairos profile --placements`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placements: Option<PlacementProfile>,
}

/// What a cold start costs layer by layer (DeepPlan, EuroSys'23, Sec. 4.3.1): every launch's time
/// with its weights in device memory and with them read in place from pinned host memory (direct
/// host access), and every weight layer's copy time from pinned host memory, layers copied back to
/// back on one stream as a cold load copies them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerProfile {
    /// Per launch of the plan, in launch order.
    pub launches: Vec<LaunchColdTimes>,
    /// Per weight layer of the plan (`Plan::layers`), in blob order.
    pub layers: Vec<LayerLoad>,
    /// Wall time the profiling took (DeepPlan's Table 5).
    pub profiling_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchColdTimes {
    pub launch: u32,
    /// Median duration with every weight it reads in device memory.
    pub exec_gpu_ns: u64,
    /// Median duration with every weight it reads in pinned host memory mapped into the device.
    pub exec_host_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerLoad {
    pub layer: u32,
    pub bytes: u64,
    /// Median time of its copy from pinned host memory into device memory.
    pub load_ns: u64,
}

impl LayerProfile {
    /// Whether it was measured on `plan`: one entry per launch and per layer, same layer sizes.
    pub fn check_plan(&self, plan: &kairos_core::plan::Plan) -> Result<(), ProfileError> {
        if self.launches.len() != plan.launches.len() || self.launches.iter().enumerate().any(|(i, l)| l.launch as usize != i) {
            return Err(ProfileError::Stale(format!(
                "layer profile has {} launches, the plan {}: profile and plan differ",
                self.launches.len(),
                plan.launches.len()
            )));
        }
        if self.layers.len() != plan.layers.len()
            || self.layers.iter().zip(&plan.layers).enumerate().any(|(i, (p, l))| p.layer as usize != i || p.bytes != l.len_bytes)
        {
            return Err(ProfileError::Stale(format!(
                "layer profile has {} weight layers, the plan {} (or their sizes differ): profile and plan differ",
                self.layers.len(),
                plan.layers.len()
            )));
        }
        Ok(())
    }
}

impl ModelProfile {
    /// Whether this profile was measured on `plan`: same dtype, and every profiled launch exists in
    /// the plan with the same logical block count. A profile of another lowering of the model
    /// (other tiles, other launches) is stale and must not be used for that plan.
    pub fn check_plan(&self, plan: &kairos_core::plan::Plan) -> Result<(), ProfileError> {
        if self.dtype != plan.dtype {
            return Err(ProfileError::Stale(format!(
                "profile of '{}' is {:?}, the plan is {:?}",
                self.model, self.dtype, plan.dtype
            )));
        }
        for k in &self.kernels {
            let Some(l) = plan.launches.get(k.launch as usize) else {
                return Err(ProfileError::Stale(format!(
                    "profile of '{}' names launch {} of a plan of {}",
                    self.model,
                    k.launch,
                    plan.launches.len()
                )));
            };
            if l.shape.logical_blocks != k.logical_blocks {
                return Err(ProfileError::Stale(format!(
                    "profile of '{}' launch {} has {} logical blocks, the plan's has {}: profile and plan differ",
                    self.model, k.launch, k.logical_blocks, l.shape.logical_blocks
                )));
            }
        }
        Ok(())
    }

    /// The part of a stale profile that still describes `plan`: when the plan has the profile's
    /// launches (same count, same kernels in the same order) and only some differ in their
    /// logical block count (a lowering change of tiles or blocks per launch), the profile of the
    /// others, its latency less the dropped launches' durations; with how many were dropped. `None`
    /// when the launches themselves differ (or the dtype): nothing of it can be trusted.
    pub fn matching_part(&self, plan: &kairos_core::plan::Plan) -> Option<(ModelProfile, usize)> {
        if self.dtype != plan.dtype || self.kernels.len() != plan.launches.len() {
            return None;
        }
        let mut part =
            ModelProfile { kernels: Vec::with_capacity(self.kernels.len()), layers: None, placements: None, ..self.clone() };
        let mut dropped = 0;
        for k in &self.kernels {
            let l = plan.launches.get(k.launch as usize)?;
            if l.kernel.name() != k.kernel {
                return None;
            }
            if l.shape.logical_blocks == k.logical_blocks {
                part.kernels.push(k.clone());
            } else {
                dropped += 1;
                part.latency_ns = part.latency_ns.saturating_sub(k.duration_ns);
            }
        }
        Some((part, dropped))
    }

    /// This profile for `plan` when the plan has the profile's launches (same count, same kernels
    /// in the same order) retiled: an autotuner's picks differ from run to run, so a plan
    /// autotuned at load rarely has the block counts of the one `kairos profile` autotuned. Every
    /// launch keeps its measured whole-GPU time as its estimate (the tiles an autotuner chooses
    /// between run within a few percent of each other: otherwise the dispatcher starts from
    /// roofline estimates and cuts its recorded segments from them); a retiled launch takes the
    /// plan's block count, and its right size becomes unknown (`min_sms` 0, no
    /// `duration_by_sms`: the dispatcher takes the SMs its grid spreads over). With how many
    /// launches were retiled. `None` when the launches themselves differ (or the dtype).
    pub fn retiled_for(&self, plan: &kairos_core::plan::Plan) -> Option<(ModelProfile, usize)> {
        if self.dtype != plan.dtype || self.kernels.len() != plan.launches.len() {
            return None;
        }
        let mut out = self.clone();
        let mut retiled = 0;
        for (i, k) in out.kernels.iter_mut().enumerate() {
            let l = plan.launches.get(k.launch as usize).filter(|_| k.launch as usize == i)?;
            if l.kernel.name() != k.kernel {
                return None;
            }
            if l.shape.logical_blocks != k.logical_blocks {
                retiled += 1;
                k.logical_blocks = l.shape.logical_blocks;
                k.ctas = l.shape.logical_blocks.min(k.ctas_per_sm_max.max(1) * self.sm_count);
                k.min_sms = 0;
                k.duration_by_sms.clear();
            }
        }
        Some((out, retiled))
    }

    pub fn load(path: &Path) -> Result<ModelProfile, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|e| ProfileError::Io { what: "read", path: path.into(), source: e })?;
        serde_json::from_str(&text).map_err(|e| ProfileError::Invalid { path: path.into(), source: e })
    }

    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| ProfileError::Invalid { path: path.into(), source: e })?;
        std::fs::write(path, text).map_err(|e| ProfileError::Io { what: "write", path: path.into(), source: e })
    }

    /// Sum of kernel durations: the GPU time of one request on an otherwise idle GPU.
    pub fn kernel_time_ns(&self) -> u64 {
        self.kernels.iter().map(|k| k.duration_ns).sum()
    }
}

/// A set of model profiles for one device, as committed under data/profiles/<device>/.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProfileSet {
    pub models: Vec<ModelProfile>,
}

impl ProfileSet {
    /// Loads every *.json profile in a folder; a missing folder is an empty set.
    pub fn load_dir(dir: &Path) -> Result<ProfileSet, ProfileError> {
        let mut models = Vec::new();
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ProfileSet::default()),
            Err(e) => return Err(ProfileError::Io { what: "list", path: dir.to_path_buf(), source: e }),
        };
        let mut paths: Vec<_> =
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "json")).collect();
        paths.sort();
        for p in paths {
            models.push(ModelProfile::load(&p)?);
        }
        Ok(ProfileSet { models })
    }

    pub fn find(&self, model: &str, dtype: DType, batch: usize) -> Option<&ModelProfile> {
        self.models.iter().find(|m| m.model == model && m.dtype == dtype && m.batch == batch)
    }
}

/// KRISP's right size to one SM: `kairos profile` first measures a kernel in steps of the
/// partition granularity (8 SMs on an H100/H200), which finds `knee`, the fewest SMs of those
/// steps within `slack` of the whole GPU's `whole_ns`, and `below`, the step under it that was
/// not. This measures `knee - 1`, `knee - 2`, ... down to `below + 1` (with `measure`, under SM
/// masks) and stops at the first size that is not within `slack`: a duration curve is not
/// monotone to the nanosecond, so the right size is the fewest SMs from which every size measured
/// up to `knee` keeps the speed. Returns the right size and the sizes measured, as (sm_count,
/// duration_ns), the failing one included (it tells the estimates the curve's slope).
pub fn refine_right_size<E>(
    knee: u32,
    below: u32,
    whole_ns: u64,
    slack: f64,
    mut measure: impl FnMut(u32) -> Result<u64, E>,
) -> Result<(u32, Vec<(u32, u64)>), E> {
    let mut right = knee;
    let mut measured = Vec::new();
    for sms in (below.saturating_add(1).max(1)..knee).rev() {
        let d = measure(sms)?;
        measured.push((sms, d));
        if d as f64 > whole_ns as f64 * slack {
            break;
        }
        right = sms;
    }
    Ok((right, measured))
}

/// Where the SMs of a set of one size lie over the GPCs (KRISP §IV-B, Fig. 6 and 7, whose MI50
/// has 4 shader engines of 15 CUs; an H100/H200 has 8 GPCs of 16 or 18 SMs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SmPlacement {
    /// The first n SM ids: what a profile's sizes and software masks use. On an H100/H200 the ids
    /// interleave over the GPCs two at a time (GPC k holds 2k, 2k+1, 16+2k, ...), so this is
    /// close to `Distributed`.
    FirstIds,
    /// Evenly over every GPC, one SM of each in turn (KRISP's "Distributed", the hardware's own
    /// spread).
    Distributed,
    /// GPC after GPC, the largest first (KRISP's "Packed").
    Packed,
    /// The fewest GPCs that hold n SMs, evenly over them (KRISP's "Conserved", its choice).
    Conserved,
}

impl SmPlacement {
    pub const ALL: [SmPlacement; 4] =
        [SmPlacement::FirstIds, SmPlacement::Distributed, SmPlacement::Packed, SmPlacement::Conserved];

    pub fn label(self) -> &'static str {
        match self {
            SmPlacement::FirstIds => "first_ids",
            SmPlacement::Distributed => "distributed",
            SmPlacement::Packed => "packed",
            SmPlacement::Conserved => "conserved",
        }
    }
}

/// `n` SMs placed `how` over `gpcs` (disjoint SM sets, one a GPC, in the order given; SMs of
/// `whole` in no GPC are used only by `FirstIds`). None when the SMs asked for are not there.
pub fn place_sms(whole: &crate::SmMask, gpcs: &[crate::SmMask], n: u32, how: SmPlacement) -> Option<crate::SmMask> {
    let mut out = crate::SmMask::EMPTY;
    if n == 0 {
        return Some(out);
    }
    // Largest first, the given order among equals (a stable sort).
    let mut by_size: Vec<Vec<u32>> = gpcs.iter().map(|g| g.iter().collect()).collect();
    by_size.sort_by_key(|g| std::cmp::Reverse(g.len()));
    let take_round_robin = |sets: &[Vec<u32>], out: &mut crate::SmMask| {
        let mut taken = 0u32;
        for i in 0.. {
            let before = taken;
            for g in sets {
                if taken < n && i < g.len() {
                    out.insert(g[i]);
                    taken += 1;
                }
            }
            if taken == n || taken == before {
                break;
            }
        }
        taken == n
    };
    let ok = match how {
        SmPlacement::FirstIds => {
            for sm in whole.iter().take(n as usize) {
                out.insert(sm);
            }
            out.count() == n
        }
        SmPlacement::Distributed => {
            let sets: Vec<Vec<u32>> = gpcs.iter().map(|g| g.iter().collect()).collect();
            take_round_robin(&sets, &mut out)
        }
        SmPlacement::Packed => {
            for sm in by_size.iter().flatten().take(n as usize) {
                out.insert(*sm);
            }
            out.count() == n
        }
        SmPlacement::Conserved => {
            let mut held = 0usize;
            let k = by_size.iter().position(|g| {
                held += g.len();
                held >= n as usize
            });
            k.is_some_and(|k| take_round_robin(&by_size[..=k], &mut out))
        }
    };
    ok.then_some(out)
}

/// `kairos profile --placements`: every kernel of a plan timed on SM sets of a few sizes placed
/// each [`SmPlacement`] way over the device's GPCs, as software masks (KRISP's Fig. 6 on Hopper).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementProfile {
    /// The GPCs used, as SM ids (the probe's sets of at least 8 SMs).
    pub gpcs: Vec<Vec<u32>>,
    pub points: Vec<PlacementPoint>,
}

/// One size and placement: each launch's median duration on it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementPoint {
    pub sm_count: u32,
    pub placement: SmPlacement,
    /// The SMs used.
    pub sms: Vec<u32>,
    /// In plan order, one a launch.
    pub duration_ns: Vec<u64>,
}

impl PlacementPoint {
    pub fn kernel_time_ns(&self) -> u64 {
        self.duration_ns.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::refine_right_size;
    use super::{SmPlacement, place_sms};
    use crate::SmMask;

    /// Four GPCs of 4, 4, 6 and 2 SMs whose ids interleave as an H200's do.
    fn gpcs() -> (SmMask, Vec<SmMask>) {
        let sets: [&[u32]; 4] = [&[0, 4, 8, 12], &[1, 5, 9, 13], &[2, 6, 10, 14, 3, 7], &[11, 15]];
        let g: Vec<SmMask> = sets
            .iter()
            .map(|s| {
                let mut m = SmMask::EMPTY;
                s.iter().for_each(|&x| m.insert(x));
                m
            })
            .collect();
        (SmMask::first(16), g)
    }

    fn ids(m: SmMask) -> Vec<u32> {
        m.iter().collect()
    }

    #[test]
    fn placements_spread_pack_and_conserve_over_the_gpcs() {
        let (whole, g) = gpcs();
        assert_eq!(ids(place_sms(&whole, &g, 5, SmPlacement::FirstIds).unwrap()), vec![0, 1, 2, 3, 4]);
        // One of each GPC in turn: 0, 1, 2 (the third GPC's lowest), 11, then 4.
        assert_eq!(ids(place_sms(&whole, &g, 5, SmPlacement::Distributed).unwrap()), vec![0, 1, 2, 4, 11]);
        // The largest GPC (6 SMs) whole, then one of the next largest (the first of the 4s).
        assert_eq!(ids(place_sms(&whole, &g, 7, SmPlacement::Packed).unwrap()), vec![0, 2, 3, 6, 7, 10, 14]);
        // 7 SMs need two GPCs (6 + 4): 4 from the 6, 3 from the 4, taken in turn.
        let c = place_sms(&whole, &g, 7, SmPlacement::Conserved).unwrap();
        assert_eq!(c.count(), 7);
        assert_eq!(c.intersect(&g[2]).count(), 4);
        assert_eq!(c.intersect(&g[0]).count(), 3);
        // 6 fit in one GPC: Conserved is Packed there.
        assert_eq!(place_sms(&whole, &g, 6, SmPlacement::Conserved), place_sms(&whole, &g, 6, SmPlacement::Packed));
        for how in SmPlacement::ALL {
            for n in 0..=16 {
                let m = place_sms(&whole, &g, n, how).unwrap();
                assert_eq!(m.count(), n, "{how:?} {n}");
            }
            assert_eq!(place_sms(&whole, &g, 17, how), None, "{how:?}: more SMs than there are");
        }
        // SMs in no GPC count only for FirstIds.
        assert_eq!(place_sms(&SmMask::first(20), &g, 17, SmPlacement::Distributed), None);
        assert_eq!(place_sms(&SmMask::first(20), &g, 17, SmPlacement::FirstIds).map(|m| m.count()), Some(17));
    }

    #[test]
    fn the_right_size_is_found_to_one_sm_below_the_step() {
        // Steps of 8: 48 kept the speed, 40 did not.
        let mut calls = Vec::new();
        // A kernel with 45 SMs' worth of parallel work: full speed from 45 SMs on.
        let (right, points) = refine_right_size(48, 40, 100_000, 1.05, |s| {
            calls.push(s);
            Ok::<_, ()>(100_000 * 45 / s.min(45) as u64)
        })
        .unwrap();
        // 45 / 43 = 1.047 keeps, 45 / 42 = 1.071 does not.
        assert_eq!(right, 43);
        assert_eq!(calls, vec![47, 46, 45, 44, 43, 42], "down from the knee, stopping at the first miss");
        assert_eq!(points.last(), Some(&(42, 107_142)));
    }

    #[test]
    fn a_miss_just_below_the_knee_keeps_the_knee_and_nothing_below_the_step_is_tried() {
        let mut calls = Vec::new();
        let (right, points) = refine_right_size(48, 40, 100_000, 1.05, |s| {
            calls.push(s);
            Ok::<_, ()>(if s == 47 { 106_000 } else { 100_000 })
        })
        .unwrap();
        assert_eq!((right, points), (48, vec![(47, 106_000)]));
        // Everything down to the step below keeps the speed: stop at 41, never 40.
        let (right, points) = refine_right_size(48, 40, 100_000, 1.05, |_| Ok::<_, ()>(100_000)).unwrap();
        assert_eq!((right, points.len()), (41, 7));
        // The smallest step kept the speed: down to one SM.
        let (right, _) = refine_right_size(8, 0, 100_000, 1.05, |_| Ok::<_, ()>(100_000)).unwrap();
        assert_eq!(right, 1);
        // A measurement error ends the search with it.
        assert_eq!(refine_right_size(48, 40, 100_000, 1.05, |_| Err::<u64, _>("lost")), Err("lost"));
    }
}

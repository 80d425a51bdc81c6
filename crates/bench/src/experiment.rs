//! Offered-load sweeps of a preset: every policy at every load, stopping a policy at saturation.
//!
//! [`run_preset`] measures the isolated latency of the preset's models on the target when the
//! workload depends on it (loads are multiples of capacities derived from them), builds the
//! workload of each variant and load, materializes its schedule from the seed — the same arrivals
//! for every policy, written as a trace file for the peers — and runs it under each policy. A
//! policy's sweep goes up the loads and stops after the first point at which it served less than
//! `saturation` of the offered load (or left more than 1% unfinished): points past it are listed as
//! skipped, not run.

use crate::Error;
use crate::metrics::measure;
use crate::presets::{Calibration, HOL_KERNEL_NS, HOL_KERNELS, HOL_MODEL, Length, Preset, PresetOptions};
use crate::report::{Point, PresetResults};
use crate::runner::{Catalog, RunOptions, run};
use crate::target::{Completion, Target};
use crate::trace::{TraceFile, TraceModel};
use kairos_gpu::profile::{ModelProfile, ProfileSet};
use kairos_gpu::synthetic;
use kairos_ir::DType;
use kairos_sched::{Config, ModelSpec, PolicyConfig, RequestOptions, STREAMS_MAX};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Shortest and longest run of one point.
pub const DURATION_NS_MIN: u64 = 20_000_000;
pub const DURATION_NS_MAX: u64 = 600_000_000_000;

/// How a sweep runs; `None` fields take the preset's defaults.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    /// Dispatcher configuration (the policy is replaced per point).
    pub base: Config,
    pub policies: Option<Vec<String>>,
    pub loads: Option<Vec<f64>>,
    pub length: Option<Length>,
    /// Fraction of each run left out of the statistics at its start.
    pub warmup_fraction: f64,
    /// Time outstanding requests get after the last arrival; default: half the run, 50 ms to 5 s.
    pub drain_ns: Option<u64>,
    pub saturation: f64,
    /// SLO for goodput of streams without a deadline.
    pub slo_ns: Option<u64>,
    pub seed: u64,
    /// Where trace files go (and the folder `Point::trace` is relative to).
    pub trace_dir: Option<PathBuf>,
    /// Where each point's per-request records go (`kairos-raw/1`; `Point::raw` names the file).
    pub raw_dir: Option<PathBuf>,
    pub preset: PresetOptions,
    /// Repeats (after one warm-up) of each isolated-latency measurement.
    pub isolated_repeats: usize,
}

impl Default for SweepOptions {
    fn default() -> Self {
        SweepOptions {
            base: Config::default(),
            policies: None,
            loads: None,
            length: None,
            warmup_fraction: 0.1,
            drain_ns: None,
            saturation: 0.9,
            slo_ns: None,
            seed: 1,
            trace_dir: None,
            raw_dir: None,
            preset: PresetOptions::default(),
            isolated_repeats: 3,
        }
    }
}

/// What a sweep reports as it goes.
pub trait Progress {
    fn message(&mut self, _text: &str) {}
    fn point_start(&mut self, _label: &str, _index: usize, _total: usize) {}
    fn fraction(&mut self, _f: f64) {}
    fn point_done(&mut self, _point: &Point) {}
}

/// Reports nothing.
pub struct Quiet;
impl Progress for Quiet {}

/// A policy's dispatcher configuration: a `streams` policy gets a pool of at least its streams.
pub fn config_for(base: &Config, policy: &PolicyConfig) -> Config {
    let mut c = base.clone().with_policy(policy.clone());
    if let PolicyConfig::Streams { streams, .. } = policy {
        let want = (*streams).min(STREAMS_MAX as u32);
        c.stream_count = Some(c.stream_count.map_or(want, |s| s.max(want)));
    }
    c
}

/// Parses policy names (any the dispatcher knows: `PolicyConfig::by_name`).
pub fn parse_policies(names: &[String]) -> Result<Vec<PolicyConfig>, Error> {
    names
        .iter()
        .map(|n| {
            PolicyConfig::by_name(n.trim()).ok_or_else(|| {
                Error::Invalid(format!(
                    "unknown policy '{n}': the dispatcher has {} (streams:N, paella:THRESHOLD_US|inf and edf:SLOWDOWN set a parameter)",
                    PolicyConfig::NAMES.join(", ")
                ))
            })
        })
        .collect()
}

/// Lowers the zoo architectures (and builds the synthetic head-of-line job) with their profiles.
/// `on_model` is told each model's name and lowering time.
pub fn lower_models(
    archs: &[String],
    dtype: DType,
    profiles: &ProfileSet,
    mut on_model: impl FnMut(&str, f64),
) -> Result<Catalog, Error> {
    let mut c = Catalog::default();
    for a in archs {
        let t = std::time::Instant::now();
        let spec = if a == HOL_MODEL {
            let plan = synthetic::chain_plan(HOL_MODEL, HOL_KERNELS, 1024);
            // The simulator takes the kernels' duration from this profile; on a GPU the chain is calibrated.
            let profile = synthetic::chain_profile(&plan, HOL_KERNEL_NS, "simulated", 132);
            ModelSpec { name: a.clone(), plan: Arc::new(plan), profile: Some(profile) }
        } else {
            let (arch, batch) = split_batch(a)?;
            let mut ir = kairos_ir::model::ModelSpec::new(arch);
            ir.dtype = dtype;
            ir.batch = batch;
            let plan = ir.plan().map_err(|e| Error::Model { model: a.clone(), message: e.to_string() })?;
            // A profile of an older lowering would misplace every estimate: roofline instead. The
            // simulator still times the launches it describes unchanged (their kernels are the same).
            let mut profile = None;
            if let Some(p) = profiles.find(arch, dtype, batch) {
                match p.check_plan(&plan) {
                    Ok(()) => profile = Some(p.clone()),
                    Err(e) => match p.matching_part(&plan) {
                        Some((part, dropped)) => {
                            eprintln!(
                                "  stale profile: roofline estimates instead; on a simulator the {} of {} launches it \
                                 still describes keep their measured times ({e})",
                                p.kernels.len() - dropped,
                                p.kernels.len()
                            );
                            c.insert_sim_timing(a, part);
                        }
                        None => eprintln!("  stale profile skipped, roofline estimates instead: {e}"),
                    },
                }
            }
            ModelSpec { name: a.clone(), plan: Arc::new(plan), profile }
        };
        on_model(a, t.elapsed().as_secs_f64());
        c.insert(spec);
    }
    Ok(c)
}

/// A catalog name's architecture and batch size: `resnet50` is batch 1, `resnet50@b8` batch 8
/// (the name the workload and the results use). A `~TAG` at the end names a copy of the same
/// model (its own weights, slots and plan: `vgg19~be`, a best-effort copy, see
/// [`crate::presets::BE_COPY_TAG`]).
pub fn split_batch(name: &str) -> Result<(&str, usize), Error> {
    let name = match name.split_once('~') {
        None => name,
        Some((base, tag))
            if !base.is_empty() && !tag.is_empty() && tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            base
        }
        Some(_) => {
            return Err(Error::Invalid(format!("model '{name}': a copy is ARCH~TAG with a tag of letters, digits, '_' or '-'")));
        }
    };
    match name.split_once("@b") {
        None => Ok((name, 1)),
        Some((arch, b)) => match b.parse::<usize>() {
            Ok(n) if (1..=1024).contains(&n) && !arch.is_empty() => Ok((arch, n)),
            _ => Err(Error::Invalid(format!("model '{name}': write ARCH@bN with a batch size N from 1 to 1024"))),
        },
    }
}

/// Gives the simulator the measured (or synthetic) kernel times of every model with a profile.
pub fn register_on_sim(sim: &mut kairos_sim::SimGpu, catalog: &Catalog) -> Result<usize, Error> {
    register_on_sim_scaled(sim, catalog, &|_| None)
}

/// [`register_on_sim`], every launch for which `scale` gives a factor timed that much faster or
/// slower (its duration and its durations by SM count; the profile's latency keeps its per-launch
/// overhead): what a GPU that autotuned the plans runs, from an autotune table's tuned and plan
/// times per shape (`kairos bench run --sim-autotune`). Only the simulated GPU's times change; the
/// dispatcher's estimates stay the profile's, as on a GPU that keeps profiled times for retiled
/// launches.
pub fn register_on_sim_scaled(
    sim: &mut kairos_sim::SimGpu,
    catalog: &Catalog,
    scale: &dyn Fn(&kairos_ir::plan::Launch) -> Option<f64>,
) -> Result<usize, Error> {
    let mut n = 0;
    for s in catalog.specs() {
        if let Some(p) = catalog.sim_timing(s) {
            let scaled = scaled_profile(p, &s.plan, scale);
            sim.register_plan(&s.plan, &scaled).map_err(|e| Error::Model { model: s.name.clone(), message: e.to_string() })?;
            n += 1;
        }
    }
    Ok(n)
}

/// `profile` with each launch's times multiplied by `scale(launch)` where it gives a factor.
pub fn scaled_profile(
    profile: &ModelProfile,
    plan: &kairos_ir::plan::Plan,
    scale: &dyn Fn(&kairos_ir::plan::Launch) -> Option<f64>,
) -> ModelProfile {
    let mut p = profile.clone();
    let before: u64 = p.kernels.iter().map(|k| k.duration_ns).sum();
    for k in &mut p.kernels {
        let Some(f) = plan.launches.get(k.launch as usize).and_then(scale).filter(|f| f.is_finite() && *f > 0.0) else {
            continue;
        };
        let times = |d: u64| ((d as f64 * f).round() as u64).max(1);
        k.duration_ns = times(k.duration_ns);
        for x in &mut k.duration_by_sms {
            x.1 = times(x.1);
        }
    }
    let after: u64 = p.kernels.iter().map(|k| k.duration_ns).sum();
    p.latency_ns = (p.latency_ns + after).saturating_sub(before);
    p
}

/// Waits for one completion (at most `timeout_ns` on the target's clock).
fn wait_one(target: &mut dyn Target, timeout_ns: u64) -> Result<Completion, Error> {
    let deadline = target.now_ns() + timeout_ns;
    let mut out = Vec::new();
    while out.is_empty() {
        if target.now_ns() >= deadline {
            return Err(Error::Invalid(format!("no completion within {} ms", timeout_ns / 1_000_000)));
        }
        target.wait(deadline, &mut out)?;
    }
    Ok(out.swap_remove(0))
}

/// Median latency of `repeats` requests of one model, each alone on the target, after one warm-up.
pub fn isolated_latency_ns(target: &mut dyn Target, config: &Config, spec: &ModelSpec, repeats: usize) -> Result<u64, Error> {
    target.begin(config)?;
    let result = (|| -> Result<u64, Error> {
        target.load_model(spec)?;
        let mut lat = Vec::new();
        for i in 0..=repeats.max(1) {
            let t = target.now_ns();
            target.submit(i as u64, &spec.name, t, RequestOptions { skip_io: true, ..Default::default() })?;
            let c = wait_one(target, 60_000_000_000)?;
            c.result.map_err(Error::from)?;
            if i > 0 {
                lat.push(c.done_ns.saturating_sub(t));
            }
        }
        lat.sort_unstable();
        Ok(lat[lat.len() / 2])
    })();
    let ended = target.end();
    let v = result?;
    ended?;
    Ok(v)
}

/// On a real GPU: finds the reduce length at which one kernel of the head-of-line chain takes
/// about [`HOL_KERNEL_NS`] (scaling linearly from a probe, three times) and returns its model.
pub fn calibrate_hol(target: &mut dyn Target, config: &Config, progress: &mut dyn Progress) -> Result<ModelSpec, Error> {
    let mut len: u32 = 1 << 16;
    for _ in 0..3 {
        let s = ModelSpec {
            name: HOL_MODEL.into(),
            plan: Arc::new(synthetic::chain_plan(HOL_MODEL, HOL_KERNELS, len)),
            profile: None,
        };
        let lat = isolated_latency_ns(target, config, &s, 3)?;
        let per_kernel = (lat / HOL_KERNELS as u64).max(1);
        len = (len as f64 * HOL_KERNEL_NS as f64 / per_kernel as f64).clamp(1.0, (1u64 << 28) as f64) as u32;
    }
    progress.message(&format!("calibrated the head-of-line kernel: reduce length {len} for ~{} us", HOL_KERNEL_NS / 1000));
    Ok(ModelSpec { name: HOL_MODEL.into(), plan: Arc::new(synthetic::chain_plan(HOL_MODEL, HOL_KERNELS, len)), profile: None })
}

fn duration_for(length: Length, open_rate_per_s: f64) -> u64 {
    let ns = match length {
        Length::DurationNs(d) => d,
        Length::Requests(n) if open_rate_per_s > 0.0 => (n as f64 / open_rate_per_s * 1e9) as u64,
        Length::Requests(_) => 2_000_000_000,
    };
    ns.clamp(DURATION_NS_MIN, DURATION_NS_MAX)
}

/// The trace models of a workload: name, architecture and shape as the peer builds them.
fn trace_models(models: &[String], catalog: &Catalog) -> Result<Vec<TraceModel>, Error> {
    models
        .iter()
        .map(|m| {
            let spec = catalog.get(m)?;
            Ok(TraceModel {
                name: m.clone(),
                arch: if spec.plan.model == HOL_MODEL { "synthetic-chain".into() } else { spec.plan.model.clone() },
                dtype: spec.plan.dtype.to_string(),
                batch: spec.plan.inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1),
                seq_len: kairos_ir::zoo::DEFAULT_SEQ_LEN,
            })
        })
        .collect()
}

/// Runs one preset's sweep on `target`. `catalog` must hold every architecture of
/// `preset.archs()` (on a simulator, registered with it: [`register_on_sim`]).
pub fn run_preset(
    target: &mut dyn Target,
    preset: &Preset,
    catalog: &Catalog,
    opts: &SweepOptions,
    progress: &mut dyn Progress,
) -> Result<PresetResults, Error> {
    let mut catalog = catalog.clone();
    let archs = preset.archs(&opts.preset);
    let policy_names: Vec<String> =
        opts.policies.clone().unwrap_or_else(|| preset.default_policies().iter().map(|s| s.to_string()).collect());
    let policies = parse_policies(&policy_names)?;
    let mut loads = opts.loads.clone().unwrap_or_else(|| preset.default_loads());
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    if loads.is_empty() || policies.is_empty() {
        return Err(Error::Invalid("a sweep needs at least one policy and one load".into()));
    }
    let length = opts.length.unwrap_or(preset.default_length());

    if matches!(preset, Preset::PaellaHol) && !target.simulated() {
        catalog.insert(calibrate_hol(target, &opts.base, progress)?);
    }
    crate::presets::add_instances(&mut catalog, preset, opts.preset.instances)?;
    let mut calib = Calibration::default();
    if preset.needs_isolated() {
        for a in &archs {
            progress.message(&format!("isolated latency of {a}"));
            let ns = isolated_latency_ns(target, &opts.base, catalog.get(a)?, opts.isolated_repeats)?;
            calib.isolated.insert(a.clone(), ns);
        }
    }
    if let Some(w) = preset.capacity_workload(&calib)? {
        let duration_ns = duration_for(length, 0.0).min(2_000_000_000);
        let schedule = w.schedule(duration_ns, duration_ns / 5, opts.seed).map_err(Error::Invalid)?;
        progress.message("throughput of the task mix in closed loop");
        let run_opts = RunOptions { drain_ns: duration_ns / 2, ..RunOptions::default() };
        let rec = run(target, &opts.base, &schedule, &catalog, &run_opts, &mut |_| {})?;
        let m = measure(&schedule, &rec.outcomes, None);
        if m.overall.throughput_per_s <= 0.0 {
            return Err(Error::Invalid(format!("{}: no request completed in the capacity run", preset.name())));
        }
        progress.message(&format!("capacity: {:.1} requests/s", m.overall.throughput_per_s));
        calib.capacity_per_s = Some(m.overall.throughput_per_s);
    }

    let variants = preset.variants(&opts.preset);
    let total = variants.len() * policies.len() * loads.len();
    let mut results = PresetResults {
        preset: preset.name(),
        about: preset.about(),
        load_meaning: preset.load_meaning().into(),
        headline: preset.headline(),
        isolated_ms: calib.isolated.iter().map(|(k, v)| (k.clone(), *v as f64 / 1e6)).collect(),
        capacity_per_s: calib.capacity_per_s,
        points: Vec::new(),
        skipped: Vec::new(),
    };
    let mut index = 0;
    let mut traces_written: BTreeMap<(String, u64), String> = BTreeMap::new();
    for v in &variants {
        for policy in &policies {
            let mut saturated = false;
            for &load in &loads {
                index += 1;
                let label = format!(
                    "{}{} {} load {load}",
                    preset.name(),
                    if v.is_empty() { String::new() } else { format!(" {v}") },
                    policy.label()
                );
                if saturated {
                    results.skipped.push(format!(
                        "{}{} at load {load}",
                        policy.label(),
                        if v.is_empty() { "".into() } else { format!(" ({v})") }
                    ));
                    continue;
                }
                let (workload, residency) = preset.workload(load, v, &calib, &catalog, &opts.preset)?;
                let duration_ns = match (opts.length, preset.variant_duration_ns(v, &calib, opts.warmup_fraction)) {
                    (None, Some(d)) => d.clamp(DURATION_NS_MIN, DURATION_NS_MAX),
                    _ => duration_for(length, workload.open_rate_per_s()),
                };
                let warmup_ns = (duration_ns as f64 * opts.warmup_fraction.clamp(0.0, 0.9)) as u64;
                let schedule = workload.schedule(duration_ns, warmup_ns, opts.seed).map_err(Error::Invalid)?;
                let drain_ns = opts.drain_ns.unwrap_or((duration_ns / 2).clamp(50_000_000, 5_000_000_000));
                let trace = match &opts.trace_dir {
                    Some(dir) => {
                        let key = (v.clone(), load.to_bits());
                        if let Some(f) = traces_written.get(&key) {
                            Some(f.clone())
                        } else {
                            let file = format!(
                                "{}{}-load{load}.trace.json",
                                preset.name(),
                                if v.is_empty() { String::new() } else { format!("-{}", v.replace('=', "")) }
                            );
                            let models = trace_models(&workload.models(), &catalog)?;
                            TraceFile::new(&preset.name(), v, load, &schedule, drain_ns, models).write(&dir.join(&file))?;
                            traces_written.insert(key, file.clone());
                            Some(file)
                        }
                    }
                    None => None,
                };
                progress.point_start(&label, index, total);
                let started_unix_ms =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
                let run_opts = RunOptions { drain_ns, residency, ..RunOptions::default() };
                let config = config_for(&opts.base, policy);
                let rec = run(target, &config, &schedule, &catalog, &run_opts, &mut |f| progress.fraction(f))?;
                let metrics = measure(&schedule, &rec.outcomes, opts.slo_ns);
                saturated = metrics.saturated(opts.saturation);
                let raw = match &opts.raw_dir {
                    Some(dir) => {
                        let file = format!(
                            "{}{}-{}-load{load}.raw.json",
                            preset.name(),
                            if v.is_empty() { String::new() } else { format!("-{}", v.replace('=', "")) },
                            // The parameters too: two settings of one policy must not share a file.
                            policy
                                .to_string()
                                .chars()
                                .map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '-' })
                                .collect::<String>()
                                .trim_end_matches('-')
                        );
                        crate::trace::RawFile::new(&preset.name(), v, &policy.label(), load, &schedule, &rec.outcomes)
                            .write(&dir.join(&file))?;
                        Some(file)
                    }
                    None => None,
                };
                let point = Point {
                    preset: preset.name(),
                    variant: v.clone(),
                    system: "kairos".into(),
                    policy: policy.label(),
                    policy_detail: policy.to_string(),
                    load,
                    duration_ns,
                    warmup_ns,
                    metrics,
                    saturated,
                    model_loads: rec.model_loads,
                    model_unloads: rec.model_unloads,
                    wall_s: rec.wall_ns as f64 * 1e-9,
                    trace,
                    raw,
                    dispatcher: rec.counters,
                    started_unix_ms: Some(started_unix_ms),
                };
                progress.point_done(&point);
                results.points.push(point);
            }
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_carry_their_batch() {
        assert_eq!(split_batch("resnet50").unwrap(), ("resnet50", 1));
        assert_eq!(split_batch("resnet50@b8").unwrap(), ("resnet50", 8));
        assert_eq!(split_batch("vgg19~be").unwrap(), ("vgg19", 1));
        assert_eq!(split_batch("resnet50@b8~be").unwrap(), ("resnet50", 8));
        for bad in ["~be", "vgg19~", "vgg19~b e", "vgg19~be~x"] {
            assert!(split_batch(bad).is_err(), "{bad}");
        }
        for bad in ["resnet50@b0", "resnet50@bx", "@b8", "resnet50@b2000"] {
            assert!(split_batch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_scaled_profile_times_the_launches_given_a_factor_and_keeps_the_overhead() {
        let plan = synthetic::chain_plan("chain", 3, 64);
        let mut p = synthetic::profile_with_durations(&plan, &[100_000, 200_000, 300_000], "sim", 132);
        p.latency_ns = 700_000; // 100 us of launch overhead beside 600 us of kernels
        p.kernels[1].duration_by_sms = vec![(66, 390_000), (132, 200_000)];
        // The second launch tuned to 3/4 of its time, the third given a factor that is not one.
        let second = plan.launches[1].name.clone();
        let third = plan.launches[2].name.clone();
        let scale = move |l: &kairos_ir::plan::Launch| {
            if l.name == second {
                Some(0.75)
            } else if l.name == third {
                Some(f64::NAN)
            } else {
                None
            }
        };
        let s = scaled_profile(&p, &plan, &scale);
        assert_eq!(s.kernels.iter().map(|k| k.duration_ns).collect::<Vec<_>>(), vec![100_000, 150_000, 300_000]);
        assert_eq!(s.kernels[1].duration_by_sms, vec![(66, 292_500), (132, 150_000)]);
        assert_eq!(s.latency_ns, 650_000, "the 100 us of overhead stay");
        // Still the plan's profile: a simulator takes it.
        let mut sim = kairos_sim::SimGpu::new(kairos_sim::GpuDesc::h200(), kairos_sim::SimOptions::timing_only(1));
        assert_eq!(sim.register_plan(&plan, &s).unwrap(), 3);
    }
}

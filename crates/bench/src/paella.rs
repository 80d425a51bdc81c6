//! Paella's experiments, runnable on any [`Gpu`]: the simulator (virtual time, deterministic) or
//! a real GPU (the same open-loop driver in real time on the calling thread).
//!
//! - [`head_of_line`] (a): jobs of 8 one-CTA kernels of ~300 us, p99 latency against offered load.
//! - [`mix`] (b): a uniform mix of models with lognormal inter-arrival times, p99 against throughput.
//! - [`short_long`] (c): short and long jobs, the short ones' share inversely proportional to
//!   size; p99 of the short jobs.
//! - [`fairness_sweep`] (d): `paella`'s fairness threshold swept, mean latency of short and long jobs.
//!
//! Every run is an open loop: arrival times are drawn up front from one seed, requests skip input
//! and output copies (`skip_io`: the experiments measure scheduling, not PCIe), and the first
//! `warmup` requests are left out of the statistics. Each function takes the GPU and gives it back,
//! so one device serves every policy of a sweep in turn.

use crate::stats::{self, LatencySummary};
use kairos_gpu::Gpu;
use kairos_gpu::profile::ModelProfile;
use kairos_gpu::synthetic;
use kairos_sched::request::*;
use kairos_sched::{Config, DispatcherStats, PolicyConfig, VirtualDriver};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};
use serde::Serialize;
use std::fmt::Write;

/// How inter-arrival gaps are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum ArrivalProcess {
    /// Exponential gaps.
    Poisson,
    /// Lognormal gaps with the given sigma of the underlying normal, mean 1/rate.
    LogNormal { sigma: f64 },
}

impl ArrivalProcess {
    /// Arrival times (ns from 0) of `count` requests at `rate_per_s` on average.
    pub fn times_ns(&self, rate_per_s: f64, count: usize, rng: &mut SmallRng) -> Vec<u64> {
        assert!(rate_per_s > 0.0);
        let mean_ns = 1e9 / rate_per_s;
        let mut t = 0.0f64;
        let mut out = Vec::with_capacity(count);
        match *self {
            ArrivalProcess::Poisson => {
                let d = Exp::new(1.0 / mean_ns).expect("positive rate");
                for _ in 0..count {
                    t += d.sample(rng);
                    out.push(t as u64);
                }
            }
            ArrivalProcess::LogNormal { sigma } => {
                // E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = mean.
                let d = LogNormal::new(mean_ns.ln() - sigma * sigma / 2.0, sigma).expect("valid lognormal");
                for _ in 0..count {
                    t += d.sample(rng);
                    out.push(t as u64);
                }
            }
        }
        out
    }

    pub fn label(&self) -> String {
        match self {
            ArrivalProcess::Poisson => "poisson".into(),
            ArrivalProcess::LogNormal { sigma } => format!("lognormal(sigma={sigma})"),
        }
    }
}

/// A model in a workload, with its share of the requests.
#[derive(Clone, Debug)]
pub struct WorkloadModel {
    pub spec: ModelSpec,
    pub share: f64,
    pub tenant: TenantId,
    pub class: Class,
    /// Latency alone on the GPU, when known: the run then reports slowdowns (latency / this).
    pub isolated_ns: Option<u64>,
}

/// One open-loop run.
#[derive(Clone, Debug)]
pub struct OpenLoop {
    pub config: Config,
    pub process: ArrivalProcess,
    pub rate_per_s: f64,
    pub requests: usize,
    pub warmup: usize,
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelSummary {
    pub model: String,
    pub latency: LatencySummary,
}

/// What one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    pub policy: String,
    pub process: String,
    pub offered_per_s: f64,
    pub throughput_per_s: f64,
    pub latency: LatencySummary,
    pub per_model: Vec<ModelSummary>,
    pub completed: usize,
    pub failed: usize,
    /// From the first measured arrival to the last measured completion.
    pub span_ns: u64,
    #[serde(skip)]
    pub stats: DispatcherStats,
    /// The parameter swept when it is not the load (e.g. the fairness threshold in ns).
    pub parameter: Option<f64>,
    /// Slowdown (latency over the model's isolated latency) over all requests, when the models'
    /// isolated latencies are known: a scale-free tail for mixes of models of very different sizes.
    pub slowdown: Option<Slowdown>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Slowdown {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Slowdown {
    fn of(mut v: Vec<f64>) -> Option<Slowdown> {
        if v.is_empty() {
            return None;
        }
        stats::sort_f64(&mut v);
        let at = |p: f64| stats::nearest_rank(&v, p).expect("not empty");
        Some(Slowdown { mean: v.iter().sum::<f64>() / v.len() as f64, p50: at(50.0), p99: at(99.0) })
    }
}

impl RunSummary {
    pub fn model(&self, name: &str) -> Option<&LatencySummary> {
        self.per_model.iter().find(|m| m.model == name).map(|m| &m.latency)
    }
}

/// Gives a streams policy enough streams in the pool.
fn config_for(base: &Config, policy: &PolicyConfig) -> Config {
    let mut c = base.clone().with_policy(policy.clone());
    if let PolicyConfig::Streams { streams, .. } = policy {
        let want = (*streams).min(kairos_sched::STREAMS_MAX as u32);
        c.stream_count = Some(c.stream_count.map_or(want, |s| s.max(want)));
    }
    c
}

/// Runs one open-loop workload and summarizes it.
pub fn run_open_loop<G: Gpu>(gpu: G, models: &[WorkloadModel], run: &OpenLoop) -> Result<(G, RunSummary), Error> {
    assert!(!models.is_empty());
    let mut driver = VirtualDriver::new(run.config.clone(), gpu)?;
    for m in models {
        driver.load_model(m.spec.clone())?;
    }
    let mut rng = SmallRng::seed_from_u64(run.seed);
    let times = run.process.times_ns(run.rate_per_s, run.requests, &mut rng);
    let total_share: f64 = models.iter().map(|m| m.share).sum();
    // Start a little after now so loading costs nothing to the first requests.
    let t0 = driver.now_ns() + 1_000_000;
    for t in times {
        let mut u = rng.random::<f64>() * total_share;
        let m = models.iter().find(|m| {
            u -= m.share;
            u < 0.0
        });
        let m = m.unwrap_or(models.last().unwrap());
        let options = RequestOptions { class: m.class, tenant: m.tenant, skip_io: true, ..Default::default() };
        driver.submit_at(t0 + t, &m.spec.name, vec![], options);
    }
    driver.run_until_idle()?;
    let stats = driver.dispatcher().stats();
    let records = driver.take_records();
    let gpu = driver.into_gpu();
    let measured: Vec<_> = records.iter().filter(|r| r.id.0 as usize >= run.warmup).collect();
    let ok: Vec<_> = measured.iter().filter(|r| r.result.is_ok()).collect();
    let first = measured.iter().map(|r| r.arrival_ns).min().unwrap_or(0);
    let last = measured.iter().map(|r| r.done_ns).max().unwrap_or(0);
    let span_ns = last.saturating_sub(first).max(1);
    let per_model = models
        .iter()
        .map(|m| ModelSummary {
            model: m.spec.name.clone(),
            latency: LatencySummary::of(ok.iter().filter(|r| *r.model == *m.spec.name).map(|r| r.latency_ns()).collect()),
        })
        .collect();
    let isolated: std::collections::HashMap<&str, u64> =
        models.iter().filter_map(|m| Some((m.spec.name.as_str(), m.isolated_ns?))).collect();
    let slowdown = if isolated.len() == models.len() {
        Slowdown::of(ok.iter().map(|r| r.latency_ns() as f64 / isolated[&*r.model].max(1) as f64).collect())
    } else {
        None
    };
    let summary = RunSummary {
        policy: run.config.policy.to_string(),
        process: run.process.label(),
        offered_per_s: run.rate_per_s,
        throughput_per_s: ok.len() as f64 / (span_ns as f64 * 1e-9),
        latency: LatencySummary::of(ok.iter().map(|r| r.latency_ns()).collect()),
        per_model,
        completed: ok.len(),
        failed: measured.len() - ok.len(),
        span_ns,
        stats,
        parameter: None,
        slowdown,
    };
    Ok((gpu, summary))
}

/// Median latency of `repeats` requests of one model, each alone on the GPU.
pub fn isolated_latency_ns<G: Gpu>(gpu: G, spec: &ModelSpec, config: &Config, repeats: usize) -> Result<(G, u64), Error> {
    let mut driver = VirtualDriver::new(config.clone(), gpu)?;
    driver.load_model(spec.clone())?;
    let mut lat = Vec::new();
    for _ in 0..repeats.max(1) {
        let now = driver.now_ns();
        driver.submit_at(now, &spec.name, vec![], RequestOptions { skip_io: true, ..Default::default() });
        driver.run_until_idle()?;
        for r in driver.take_records() {
            r.result.clone()?;
            lat.push(r.latency_ns());
        }
    }
    lat.sort_unstable();
    let median = lat[lat.len() / 2];
    Ok((driver.into_gpu(), median))
}

/// [`sweep`] over `params.loads` as multiples of `capacity_per_s`, with `params`' run settings.
fn sweep_loads<G: Gpu>(
    gpu: G,
    models: &[WorkloadModel],
    params: &ExperimentParams,
    process: ArrivalProcess,
    capacity_per_s: f64,
    progress: impl FnMut(&RunSummary),
) -> Result<(G, Vec<RunSummary>), Error> {
    let base = OpenLoop {
        config: params.config.clone(),
        process,
        rate_per_s: capacity_per_s,
        requests: params.requests,
        warmup: params.warmup,
        seed: params.seed,
    };
    let rates: Vec<f64> = params.loads.iter().map(|l| l * capacity_per_s).collect();
    sweep(gpu, models, &base, &params.policies, &rates, params.saturation, progress)
}

/// Runs every policy at every rate (ascending). A policy's sweep stops after the first rate at
/// which it completes less than `saturation` of the offered load (e.g. 0.9), when given.
pub fn sweep<G: Gpu>(
    mut gpu: G,
    models: &[WorkloadModel],
    base: &OpenLoop,
    policies: &[PolicyConfig],
    rates_per_s: &[f64],
    saturation: Option<f64>,
    mut progress: impl FnMut(&RunSummary),
) -> Result<(G, Vec<RunSummary>), Error> {
    let mut out = Vec::new();
    for p in policies {
        for &rate in rates_per_s {
            let run = OpenLoop { config: config_for(&base.config, p), rate_per_s: rate, ..base.clone() };
            let (g, s) = run_open_loop(gpu, models, &run)?;
            gpu = g;
            progress(&s);
            let saturated = saturation.is_some_and(|f| s.throughput_per_s < f * rate);
            out.push(s);
            if saturated {
                break;
            }
        }
    }
    Ok((gpu, out))
}

/// Parameters shared by the experiments.
#[derive(Clone, Debug)]
pub struct ExperimentParams {
    /// Dispatcher configuration (the policy is replaced per run).
    pub config: Config,
    pub policies: Vec<PolicyConfig>,
    /// Offered loads as fractions of the experiment's reference capacity.
    pub loads: Vec<f64>,
    pub requests: usize,
    pub warmup: usize,
    pub seed: u64,
    /// Stop a policy's sweep once it completes less than this fraction of the offered load.
    pub saturation: Option<f64>,
}

impl ExperimentParams {
    pub fn new(policies: &[&str], loads: &[f64], requests: usize, seed: u64) -> ExperimentParams {
        ExperimentParams {
            config: Config::default(),
            policies: policies.iter().map(|p| PolicyConfig::by_name(p).unwrap_or_else(|| panic!("unknown policy {p}"))).collect(),
            loads: loads.to_vec(),
            requests,
            warmup: requests / 10,
            seed,
            saturation: Some(0.75),
        }
    }
}

/// (a) Head-of-line blocking. Jobs of `kernels` chained one-CTA kernels (the [`synthetic::chain_plan`]
/// model `hol`), Poisson arrivals. Loads are fractions of the rate at which every stream of the
/// pool is busy: `stream_pool / (kernels * kernel_ns)`. `profile` gives the simulator the kernel
/// duration (see [`synthetic::chain_profile`]); on a real GPU pass `None` and a `reduce_len` from
/// [`calibrate_chain`].
pub fn head_of_line<G: Gpu>(
    gpu: G,
    params: &ExperimentParams,
    kernels: u32,
    reduce_len: u32,
    kernel_ns: u64,
    profile: Option<ModelProfile>,
    progress: impl FnMut(&RunSummary),
) -> Result<(G, Vec<RunSummary>), Error> {
    let plan = synthetic::chain_plan("hol", kernels, reduce_len);
    let spec = ModelSpec { name: "hol".into(), plan: plan.into(), profile };
    let pool =
        params.config.stream_count.unwrap_or(gpu.info().hardware_queues.max(kairos_sched::STREAM_COUNT_DEFAULT_MIN)).max(1);
    let capacity = pool as f64 / (kernels as f64 * kernel_ns as f64 * 1e-9);
    let isolated_ns = Some(kernels as u64 * kernel_ns);
    let models = [WorkloadModel { spec, share: 1.0, tenant: TenantId(0), class: Class::BestEffort, isolated_ns }];
    sweep_loads(gpu, &models, params, ArrivalProcess::Poisson, capacity, progress)
}

/// Finds the `reduce_len` at which one chain kernel takes about `target_ns` on this GPU: runs the
/// chain alone with a probe length and scales linearly (twice, to settle fixed costs).
pub fn calibrate_chain<G: Gpu>(mut gpu: G, config: &Config, kernels: u32, target_ns: u64) -> Result<(G, u32), Error> {
    let mut len: u32 = 1 << 16;
    for _ in 0..3 {
        let spec = ModelSpec {
            name: "hol-calibrate".into(),
            plan: synthetic::chain_plan("hol-calibrate", kernels, len).into(),
            profile: None,
        };
        let (g, lat) = isolated_latency_ns(gpu, &spec, config, 5)?;
        gpu = g;
        let per_kernel = (lat / kernels as u64).max(1);
        let scaled = (len as f64 * target_ns as f64 / per_kernel as f64).clamp(1.0, (1u64 << 28) as f64);
        len = scaled as u32;
    }
    Ok((gpu, len))
}

/// Isolated latencies of each model, in order.
fn isolated_all<G: Gpu>(mut gpu: G, specs: &[ModelSpec], config: &Config) -> Result<(G, Vec<u64>), Error> {
    let mut out = Vec::new();
    for s in specs {
        let (g, l) = isolated_latency_ns(gpu, s, config, 3)?;
        gpu = g;
        out.push(l.max(1));
    }
    Ok((gpu, out))
}

/// (b) A uniform mix of `models` with lognormal inter-arrival gaps of the given sigma. Loads are
/// fractions of the serial capacity: one request at a time, 1 / mean isolated latency. Returns
/// the isolated latencies too.
pub fn mix<G: Gpu>(
    gpu: G,
    params: &ExperimentParams,
    models: &[ModelSpec],
    sigma: f64,
    progress: impl FnMut(&RunSummary),
) -> Result<(G, Vec<RunSummary>, Vec<u64>), Error> {
    let (gpu, isolated) = isolated_all(gpu, models, &params.config)?;
    let mean_ns = isolated.iter().sum::<u64>() as f64 / isolated.len() as f64;
    let capacity = 1e9 / mean_ns;
    let workload: Vec<_> = models
        .iter()
        .zip(&isolated)
        .map(|(s, &iso)| WorkloadModel {
            spec: s.clone(),
            share: 1.0,
            tenant: TenantId(0),
            class: Class::BestEffort,
            isolated_ns: Some(iso),
        })
        .collect();
    let (gpu, points) = sweep_loads(gpu, &workload, params, ArrivalProcess::LogNormal { sigma }, capacity, progress)?;
    Ok((gpu, points, isolated))
}

/// The short/long workload of (c) and (d): shares inversely proportional to isolated latency
/// (so each side offers the same GPU time), short jobs as tenant 0, long ones as tenant 1,
/// Poisson arrivals. Returns the workload and its serial capacity in requests per second.
fn short_long_workload<G: Gpu>(
    gpu: G,
    config: &Config,
    short: &ModelSpec,
    long: &ModelSpec,
) -> Result<(G, Vec<WorkloadModel>, f64), Error> {
    let (gpu, iso) = isolated_all(gpu, &[short.clone(), long.clone()], config)?;
    let (ls, ll) = (iso[0] as f64, iso[1] as f64);
    let (ws, wl) = (1.0 / ls, 1.0 / ll);
    let (ps, pl) = (ws / (ws + wl), wl / (ws + wl));
    let capacity = 1e9 / (ps * ls + pl * ll);
    let workload = vec![
        WorkloadModel {
            spec: short.clone(),
            share: ps,
            tenant: TenantId(0),
            class: Class::BestEffort,
            isolated_ns: Some(iso[0]),
        },
        WorkloadModel { spec: long.clone(), share: pl, tenant: TenantId(1), class: Class::BestEffort, isolated_ns: Some(iso[1]) },
    ];
    Ok((gpu, workload, capacity))
}

/// (c) Short vs long jobs (Paella: resnet18 vs inception_v3). Loads are fractions of the serial
/// capacity. Read each point's `model(short)` for the short jobs' p99.
pub fn short_long<G: Gpu>(
    gpu: G,
    params: &ExperimentParams,
    short: &ModelSpec,
    long: &ModelSpec,
    progress: impl FnMut(&RunSummary),
) -> Result<(G, Vec<RunSummary>), Error> {
    let (gpu, workload, capacity) = short_long_workload(gpu, &params.config, short, long)?;
    sweep_loads(gpu, &workload, params, ArrivalProcess::Poisson, capacity, progress)
}

/// (d) `paella` with each fairness threshold (ns; `u64::MAX` is pure SRPT) on the short/long
/// workload at one load (fraction of serial capacity). Each point's `parameter` is the threshold.
pub fn fairness_sweep<G: Gpu>(
    mut gpu: G,
    params: &ExperimentParams,
    short: &ModelSpec,
    long: &ModelSpec,
    load: f64,
    thresholds_ns: &[u64],
    mut progress: impl FnMut(&RunSummary),
) -> Result<(G, Vec<RunSummary>), Error> {
    let (g, workload, capacity) = short_long_workload(gpu, &params.config, short, long)?;
    gpu = g;
    // The first paella of the run's policies lends its other parameters to the threshold sweep.
    let (backfill, slowdown_bound) = params
        .policies
        .iter()
        .find_map(|p| match p {
            PolicyConfig::Paella { backfill, slowdown_bound, .. } => Some((*backfill, *slowdown_bound)),
            _ => None,
        })
        .unwrap_or((false, None));
    let mut out = Vec::new();
    for &t in thresholds_ns {
        let policy = PolicyConfig::Paella { fairness_threshold_ns: t, backfill, slowdown_bound };
        let run = OpenLoop {
            config: config_for(&params.config, &policy),
            process: ArrivalProcess::Poisson,
            rate_per_s: load * capacity,
            requests: params.requests,
            warmup: params.warmup,
            seed: params.seed,
        };
        let (g, mut s) = run_open_loop(gpu, &workload, &run)?;
        gpu = g;
        s.parameter = Some(t as f64);
        progress(&s);
        out.push(s);
    }
    Ok((gpu, out))
}

/// The highest throughput a policy sustains with p99 at most `p99_ns`, interpolating linearly
/// between the last sweep point under the target and the first over it. `None` if even its
/// lightest load misses the target.
pub fn throughput_at_p99(points: &[RunSummary], policy: &str, p99_ns: u64, model: Option<&str>) -> Option<f64> {
    let mut pts: Vec<(f64, u64)> = points
        .iter()
        .filter(|p| p.policy == policy || p.policy.split('(').next() == Some(policy))
        .map(|p| (p.throughput_per_s, model.and_then(|m| p.model(m)).unwrap_or(&p.latency).p99_ns))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut best: Option<f64> = None;
    for w in 0..pts.len() {
        let (x, y) = pts[w];
        if y <= p99_ns {
            best = Some(best.map_or(x, |b: f64| b.max(x)));
            if let Some(&(x2, y2)) = pts.get(w + 1)
                && y2 > p99_ns
            {
                let f = (p99_ns - y) as f64 / (y2 - y) as f64;
                best = Some(best.unwrap().max(x + f * (x2 - x)));
            }
        }
    }
    best
}

/// Like [`throughput_at_p99`] with the p99 slowdown (latency / isolated latency) as the target.
pub fn throughput_at_slowdown_p99(points: &[RunSummary], policy: &str, slowdown_p99: f64) -> Option<f64> {
    let mut pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.policy == policy || p.policy.split('(').next() == Some(policy))
        .filter_map(|p| Some((p.throughput_per_s, p.slowdown?.p99)))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut best: Option<f64> = None;
    for w in 0..pts.len() {
        let (x, y) = pts[w];
        if y <= slowdown_p99 {
            best = Some(best.map_or(x, |b: f64| b.max(x)));
            if let Some(&(x2, y2)) = pts.get(w + 1)
                && y2 > slowdown_p99
            {
                let f = (slowdown_p99 - y) / (y2 - y);
                best = Some(best.unwrap().max(x + f * (x2 - x)));
            }
        }
    }
    best
}

/// A markdown table of sweep points.
pub fn markdown_table(points: &[RunSummary], models: &[&str]) -> String {
    let mut s = String::new();
    let _ = write!(s, "| policy | offered/s | throughput/s | p50 ms | p99 ms | mean ms | p99 slowdown |");
    for m in models {
        let _ = write!(s, " {m} p99 ms | {m} mean ms |");
    }
    s.push('\n');
    let _ = write!(s, "|---|---:|---:|---:|---:|---:|---:|");
    for _ in models {
        s.push_str("---:|---:|");
    }
    s.push('\n');
    let ms = |ns: f64| ns / 1e6;
    for p in points {
        let label = match p.parameter {
            Some(t) if t >= u64::MAX as f64 => format!("{} (threshold inf)", p.policy),
            Some(t) => format!("{} (threshold {:.0} us)", p.policy, t / 1e3),
            None => p.policy.clone(),
        };
        let _ = write!(
            s,
            "| {label} | {:.0} | {:.0} | {:.3} | {:.3} | {:.3} | {} |",
            p.offered_per_s,
            p.throughput_per_s,
            ms(p.latency.p50_ns as f64),
            ms(p.latency.p99_ns as f64),
            ms(p.latency.mean_ns),
            p.slowdown.map_or("-".to_string(), |s| format!("{:.2}", s.p99))
        );
        for m in models {
            let l = p.model(m).copied().unwrap_or_default();
            let _ = write!(s, " {:.3} | {:.3} |", ms(l.p99_ns as f64), ms(l.mean_ns));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrival_processes_have_the_asked_mean() {
        let mut rng = SmallRng::seed_from_u64(7);
        for p in [ArrivalProcess::Poisson, ArrivalProcess::LogNormal { sigma: 1.5 }] {
            let t = p.times_ns(1000.0, 200_000, &mut rng);
            let mean_gap = *t.last().unwrap() as f64 / t.len() as f64;
            assert!((mean_gap / 1e6 - 1.0).abs() < 0.1, "{p:?}: mean gap {mean_gap} ns");
            assert!(t.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    fn point(policy: &str, tput: f64, p99_ms: u64) -> RunSummary {
        RunSummary {
            policy: policy.into(),
            process: String::new(),
            offered_per_s: tput,
            throughput_per_s: tput,
            latency: LatencySummary { p99_ns: p99_ms * 1_000_000, ..Default::default() },
            per_model: vec![],
            completed: 0,
            failed: 0,
            span_ns: 0,
            stats: Default::default(),
            parameter: None,
            slowdown: None,
        }
    }

    #[test]
    fn throughput_at_p99_interpolates() {
        let pts = [point("a", 100.0, 1), point("a", 200.0, 2), point("a", 300.0, 10), point("b", 100.0, 20)];
        assert_eq!(throughput_at_p99(&pts, "a", 2_000_000, None), Some(200.0));
        assert_eq!(throughput_at_p99(&pts, "a", 6_000_000, None), Some(250.0));
        assert_eq!(throughput_at_p99(&pts, "a", 50_000_000, None), Some(300.0));
        assert_eq!(throughput_at_p99(&pts, "b", 6_000_000, None), None);
    }
}

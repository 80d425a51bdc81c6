//! Where a request's time goes, kernel by kernel: the dispatcher driven in the GPU's clock with its
//! issue trace on, and every launch's timeline taken apart.
//!
//! Per launch (from [`kairos_sched::IssueRecord`], all on the host clock; device times converted by
//! the backend): the launch call (host time in `Gpu::launch`), the wait in the hardware queue (first
//! block taken, less the later of the call's end and the end of the launch it waited behind on its
//! lane), execution (first block taken to end), the record's way back (end on the device to the
//! dispatcher reading it), and the *gap* before it (its start less the end of the request's launch
//! before it: the GPU idle for this request between two of its kernels, what issue-ahead exists to
//! remove). Launches that do not report their start (whole-job streams) show only ends; their gap
//! and execution are end to end. Per request: latency, GPU time (sum of execution), the
//! dispatcher's estimate of it at admission against that, and the host's share (latency less GPU
//! time). The dispatcher's own counters (launch calls, policy, events) come with each run.
//!
//! Scenarios: each model *alone* (requests one at a time, ten isolated latencies apart: about 10%
//! of the model's capacity), and *in a mix* (the focus models among `mix8`'s, lognormal arrivals,
//! uniform). This module drives [`VirtualDriver`] itself rather than a [`crate::target::Target`],
//! because it reads the dispatcher's issue records; it changes nothing.

use crate::Error;
use crate::runner::Catalog;
use crate::workload::{Arrival, Source, Stream, Workload};
use kairos_gpu::Gpu;
use kairos_sched::{Config, IssueRecord, PolicyConfig, RequestId, RequestOptions, VirtualDriver};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

pub const BREAKDOWN_FORMAT: &str = "kairos-breakdown/1";
/// Launches traced per run at most.
pub const TRACE_LAUNCHES_MAX: usize = 4_000_000;

/// One launch's timeline (ns on the host clock; `None`: not reported).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LaunchRow {
    pub request: u64,
    pub launch: u32,
    pub behind: bool,
    pub ctas: u32,
    pub est_ns: u64,
    pub call_at_ns: u64,
    pub call_ns: u64,
    pub after_done_ns: Option<u64>,
    pub started_ns: Option<u64>,
    pub done_ns: Option<u64>,
    pub seen_ns: Option<u64>,
    pub stopped: bool,
}

/// One request's timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRow {
    pub request: u64,
    pub model: String,
    pub arrival_ns: u64,
    pub admitted_ns: u64,
    pub first_issue_ns: u64,
    pub first_start_ns: u64,
    pub last_done_ns: u64,
    pub done_ns: u64,
    pub launches: u32,
    pub gpu_ns: u64,
    pub estimated_ns: u64,
    pub ok: bool,
}

/// Medians (and 90th percentiles) of the per-launch phases and per-request figures of one model in
/// one run, in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseSummary {
    pub model: String,
    pub requests: usize,
    pub launches_per_request: f64,
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
    pub gpu_p50_us: f64,
    /// Latency less GPU time: what the host and the gaps add, per request.
    pub host_p50_us: f64,
    pub call_p50_us: f64,
    pub queue_p50_us: Option<f64>,
    pub exec_p50_us: f64,
    pub record_p50_us: f64,
    pub record_p90_us: f64,
    pub gap_p50_us: f64,
    pub gap_p90_us: f64,
    /// Sum over a request's launches of the gaps before them, median over requests.
    pub gaps_per_request_p50_us: f64,
    /// The dispatcher's estimate of a request's GPU time at admission over the GPU time it took.
    pub est_over_actual_p50: f64,
    pub est_over_actual_p90: f64,
    /// Kernel estimates at issue over their execution (launches that report their start).
    pub kernel_est_over_actual_p50: Option<f64>,
}

/// One run: a scenario under a policy. `launches_traced` holds the launches of the followed models'
/// requests only; `summaries` covers every model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BreakdownRun {
    pub scenario: String,
    pub policy: String,
    pub offered_per_s: f64,
    pub wall_s: f64,
    pub summaries: Vec<PhaseSummary>,
    pub launch_call_ns: u64,
    pub policy_ns: u64,
    pub events_ns: u64,
    pub decisions: u64,
    pub launches: u64,
    pub events: u64,
    pub completed: u64,
    pub requests: Vec<RequestRow>,
    pub launches_traced: Vec<LaunchRow>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BreakdownFile {
    pub format: String,
    pub device: String,
    pub seed: u64,
    pub runs: Vec<BreakdownRun>,
}

/// A scenario: arrivals of named models at given times (ns from the start), or requests of one
/// model alone.
pub struct Scenario {
    pub name: String,
    pub arrivals: Vec<(u64, String)>,
    pub offered_per_s: f64,
    /// `requests` of this model one at a time, ten of its warm-up latencies apart (about 10% of
    /// its capacity); `arrivals` is filled in after the warm-up.
    pub alone: Option<(String, usize)>,
}

impl Scenario {
    pub fn alone(model: &str, requests: usize) -> Scenario {
        Scenario {
            name: format!("{model} alone"),
            arrivals: Vec::new(),
            offered_per_s: 0.0,
            alone: Some((model.to_string(), requests)),
        }
    }

    /// `requests` drawn uniformly over `models`, lognormal inter-arrival times at `rate_per_s`.
    pub fn mix(
        name: &str,
        models: &[String],
        requests: usize,
        rate_per_s: f64,
        sigma: f64,
        seed: u64,
    ) -> Result<Scenario, Error> {
        let mut w = Workload::default();
        let streams = models.iter().map(|m| (w.stream(Stream::new(m, m)), 1.0)).collect();
        w.sources.push(Source { arrival: Arrival::LogNormal { rate_per_s, sigma }, streams });
        let duration_ns = (requests as f64 / rate_per_s * 1e9) as u64;
        let schedule = w.schedule(duration_ns.max(1), 0, seed).map_err(Error::Invalid)?;
        let arrivals = schedule.arrivals.iter().map(|&(t, s)| (t, w.streams[s as usize].model.clone())).collect();
        Ok(Scenario { name: name.to_string(), arrivals, offered_per_s: rate_per_s, alone: None })
    }
}

/// The value at the rounded index of `p` (see [`crate::stats::rounded_index`]); NaN for none.
fn pct(v: &mut [f64], p: f64) -> f64 {
    crate::stats::sort_f64(v);
    crate::stats::rounded_index(v, p).unwrap_or(f64::NAN)
}

/// Runs one scenario under one policy on `gpu` and returns the run (and the GPU).
pub fn run<G: Gpu>(
    gpu: G,
    base: &Config,
    policy: &PolicyConfig,
    catalog: &Catalog,
    scenario: &Scenario,
    warmup_per_model: usize,
    keep_launches_of: &[String],
) -> Result<(BreakdownRun, G), Error> {
    let cfg = Config { trace_max: TRACE_LAUNCHES_MAX, ..crate::experiment::config_for(base, policy) };
    let mut d = VirtualDriver::new(cfg, gpu)?;
    let mut models: Vec<&String> =
        scenario.arrivals.iter().map(|(_, m)| m).chain(scenario.alone.as_ref().map(|a| &a.0)).collect();
    models.sort();
    models.dedup();
    for m in &models {
        d.load_model(catalog.get(m)?.clone())?;
    }
    let options = RequestOptions { skip_io: true, ..RequestOptions::default() };
    // Warm-up: a few requests of each model one at a time (kernels loaded, estimates seeded).
    let mut warm_ns = 0u64;
    for m in &models {
        for _ in 0..warmup_per_model.max(1) {
            let now = d.now_ns();
            d.submit_at(now, m, vec![], options.clone());
            d.run_until_idle()?;
            warm_ns = d.take_records().iter().map(|r| r.latency_ns()).max().unwrap_or(0);
        }
    }
    let mut arrivals = scenario.arrivals.clone();
    let mut offered_per_s = scenario.offered_per_s;
    if let Some((m, n)) = &scenario.alone {
        let spacing_ns = (10 * warm_ns).max(200_000);
        arrivals = (0..*n).map(|i| (i as u64 * spacing_ns, m.clone())).collect();
        offered_per_s = 1e9 / spacing_ns as f64;
    }
    let trace_from = d.dispatcher().trace().len();
    let stats0 = d.dispatcher().stats();
    let wall = std::time::Instant::now();
    let t0 = d.now_ns() + 1_000_000;
    let mut model_of: HashMap<RequestId, String> = HashMap::new();
    for (t, m) in &arrivals {
        let id = d.submit_at(t0 + t, m, vec![], options.clone());
        model_of.insert(id, m.clone());
    }
    d.run_until_idle()?;
    let stats = d.dispatcher().stats();
    let records = d.take_records();
    let trace: Vec<IssueRecord> = d.dispatcher().trace()[trace_from..].to_vec();
    let requests: Vec<RequestRow> = records
        .iter()
        .filter(|r| model_of.contains_key(&r.id))
        .map(|r| {
            let t = r.result.as_ref().ok();
            RequestRow {
                request: r.id.0,
                model: model_of[&r.id].clone(),
                arrival_ns: r.arrival_ns,
                admitted_ns: t.map_or(0, |t| t.admitted_ns),
                first_issue_ns: t.map_or(0, |t| t.first_issue_ns),
                first_start_ns: t.map_or(0, |t| t.first_start_ns),
                last_done_ns: t.map_or(0, |t| t.last_done_ns),
                done_ns: r.done_ns,
                launches: t.map_or(0, |t| t.launches),
                gpu_ns: t.map_or(0, |t| t.gpu_ns),
                estimated_ns: t.map_or(0, |t| t.estimated_ns),
                ok: t.is_some(),
            }
        })
        .collect();
    let all_launches: Vec<LaunchRow> = trace
        .iter()
        .map(|r| LaunchRow {
            request: r.request.0,
            launch: r.launch,
            behind: r.behind,
            ctas: r.ctas,
            est_ns: r.est_ns,
            call_at_ns: r.at_ns,
            call_ns: r.call_ns,
            after_done_ns: r.after_done_ns,
            started_ns: r.started_ns,
            done_ns: r.done_ns,
            seen_ns: r.seen_ns,
            stopped: r.stopped,
        })
        .collect();
    let summaries = models.iter().map(|m| summarize(m, &requests, &all_launches)).collect();
    // The file keeps the launch rows of the models followed (a mix has hundreds of thousands).
    let kept: std::collections::HashSet<u64> =
        requests.iter().filter(|r| keep_launches_of.contains(&r.model)).map(|r| r.request).collect();
    let launches: Vec<LaunchRow> = all_launches.into_iter().filter(|l| kept.contains(&l.request)).collect();
    let run = BreakdownRun {
        scenario: scenario.name.clone(),
        policy: policy.to_string(),
        offered_per_s,
        wall_s: wall.elapsed().as_secs_f64(),
        summaries,
        launch_call_ns: stats.launch_call_ns - stats0.launch_call_ns,
        policy_ns: stats.policy_ns - stats0.policy_ns,
        events_ns: stats.events_ns - stats0.events_ns,
        decisions: stats.decisions - stats0.decisions,
        launches: stats.launches - stats0.launches,
        events: stats.events - stats0.events,
        completed: stats.completed - stats0.completed,
        requests,
        launches_traced: launches,
    };
    Ok((run, d.into_gpu()))
}

/// The phases of one model's requests in a run.
pub fn summarize(model: &str, requests: &[RequestRow], launches: &[LaunchRow]) -> PhaseSummary {
    let mine: Vec<&RequestRow> = requests.iter().filter(|r| r.model == model && r.ok).collect();
    let ids: std::collections::HashSet<u64> = mine.iter().map(|r| r.request).collect();
    let mut by_request: HashMap<u64, Vec<&LaunchRow>> = HashMap::new();
    for l in launches.iter().filter(|l| ids.contains(&l.request) && !l.stopped) {
        by_request.entry(l.request).or_default().push(l);
    }
    let us = |ns: u64| ns as f64 / 1e3;
    let (mut call, mut queue, mut exec, mut record, mut gap, mut gaps_req, mut kest) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for ls in by_request.values_mut() {
        // In the order they ran on the request's lane (issue order: a job's launches are issued in
        // an order its lane runs them in).
        ls.sort_by_key(|l| l.call_at_ns);
        let mut prev_done: Option<u64> = None;
        let mut sum_gap = 0.0;
        for l in ls.iter() {
            call.push(us(l.call_ns));
            let call_end = l.call_at_ns + l.call_ns;
            if let (Some(s), Some(d)) = (l.started_ns, l.done_ns) {
                queue.push(us(s.saturating_sub(call_end.max(l.after_done_ns.unwrap_or(0)))));
                exec.push(us(d.saturating_sub(s)));
                if d > s {
                    kest.push(l.est_ns as f64 / (d - s) as f64);
                }
            } else if let (Some(d), Some(p)) = (l.done_ns, prev_done) {
                exec.push(us(d.saturating_sub(p.max(call_end))));
            }
            if let (Some(d), Some(seen)) = (l.done_ns, l.seen_ns) {
                record.push(us(seen.saturating_sub(d)));
            }
            if let Some(p) = prev_done {
                let start = l.started_ns.unwrap_or_else(|| p.max(call_end));
                let g = us(start.saturating_sub(p));
                gap.push(g);
                sum_gap += g;
            }
            prev_done = l.done_ns.or(prev_done);
        }
        gaps_req.push(sum_gap);
    }
    let mut lat: Vec<f64> = mine.iter().map(|r| us(r.done_ns.saturating_sub(r.arrival_ns))).collect();
    let mut gpu: Vec<f64> = mine.iter().map(|r| us(r.gpu_ns)).collect();
    let mut host: Vec<f64> = mine.iter().map(|r| us(r.done_ns.saturating_sub(r.arrival_ns).saturating_sub(r.gpu_ns))).collect();
    let mut est: Vec<f64> = mine.iter().filter(|r| r.gpu_ns > 0).map(|r| r.estimated_ns as f64 / r.gpu_ns as f64).collect();
    let n_launches: u64 = mine.iter().map(|r| r.launches as u64).sum();
    PhaseSummary {
        model: model.to_string(),
        requests: mine.len(),
        launches_per_request: n_launches as f64 / mine.len().max(1) as f64,
        latency_p50_us: pct(&mut lat, 50.0),
        latency_p99_us: pct(&mut lat, 99.0),
        gpu_p50_us: pct(&mut gpu, 50.0),
        host_p50_us: pct(&mut host, 50.0),
        call_p50_us: pct(&mut call, 50.0),
        queue_p50_us: (!queue.is_empty()).then(|| pct(&mut queue, 50.0)),
        exec_p50_us: pct(&mut exec, 50.0),
        record_p50_us: pct(&mut record, 50.0),
        record_p90_us: pct(&mut record, 90.0),
        gap_p50_us: pct(&mut gap, 50.0),
        gap_p90_us: pct(&mut gap, 90.0),
        gaps_per_request_p50_us: pct(&mut gaps_req, 50.0),
        est_over_actual_p50: pct(&mut est, 50.0),
        est_over_actual_p90: pct(&mut est, 90.0),
        kernel_est_over_actual_p50: (!kest.is_empty()).then(|| pct(&mut kest, 50.0)),
    }
}

/// The markdown table of a breakdown file.
pub fn markdown(f: &BreakdownFile) -> String {
    let mut s = format!(
        "Breakdown on {} (µs, medians unless marked; seed {}).\n\n\
         | scenario | policy | model | req | p50 | p99 | GPU | host | call | hw queue | exec | record p50/p90 | gap p50/p90 | gaps/req | est/actual p50/p90 | kernel est/actual |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        f.device, f.seed
    );
    let o = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
    for r in &f.runs {
        for m in &r.summaries {
            s += &format!(
                "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {} | {:.1} | {:.1}/{:.1} | {:.1}/{:.1} | {:.0} | {:.2}/{:.2} | {} |\n",
                r.scenario,
                r.policy,
                m.model,
                m.requests,
                m.latency_p50_us,
                m.latency_p99_us,
                m.gpu_p50_us,
                m.host_p50_us,
                m.call_p50_us,
                o(m.queue_p50_us),
                m.exec_p50_us,
                m.record_p50_us,
                m.record_p90_us,
                m.gap_p50_us,
                m.gap_p90_us,
                m.gaps_per_request_p50_us,
                m.est_over_actual_p50,
                m.est_over_actual_p90,
                m.kernel_est_over_actual_p50.map_or("-".into(), |x| format!("{x:.2}")),
            );
        }
    }
    s += "\nDispatcher time per run (host): \n\n| scenario | policy | requests | launches | records/launch | launch call µs/launch | policy µs/decision | events µs/record | dispatcher µs/request |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
    for r in &f.runs {
        let per = |a: u64, b: u64| a as f64 / 1e3 / b.max(1) as f64;
        s += &format!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.1} |\n",
            r.scenario,
            r.policy,
            r.completed,
            r.launches,
            r.events as f64 / r.launches.max(1) as f64,
            per(r.launch_call_ns, r.launches),
            per(r.policy_ns, r.decisions),
            per(r.events_ns, r.events),
            per(r.launch_call_ns + r.policy_ns + r.events_ns, r.completed),
        );
    }
    s
}

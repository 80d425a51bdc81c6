//! What a run measured: latency percentiles (HdrHistogram, 3 significant digits), throughput,
//! goodput under an SLO, deadline misses, queue time and GPU time — overall, per metrics group
//! (REEF's real-time and best-effort, DARIS' high and low priority) and per model and group.
//!
//! Definitions (the same for kairos and for the peers, which go through this code too):
//! - The measurement window is `[warmup_ns, duration_ns)` of the schedule.
//! - Latency, queue and GPU time: requests that *arrived* in the window and completed (also during
//!   the drain). Latency = completion - scheduled arrival; GPU time = first kernel issued to
//!   completion (the peers: CUDA-event time of the forward pass); queue = latency - GPU time.
//! - Throughput: completions *in* the window, per second of the window.
//! - Goodput: those completions that met their SLO — the stream's deadline, else the run's
//!   `slo_ns` — per second (no SLO at all: equal to throughput).
//! - Deadline misses: requests with a deadline that arrived in the window and did not complete
//!   within it (unfinished, refused and failed ones count as missed).

use crate::runner::{Outcome, Status};
use crate::stats::LatencySummary;
use crate::workload::Schedule;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Highest latency the histograms resolve (longer ones are recorded as this).
pub const LATENCY_NS_MAX: u64 = 3_600_000_000_000;

/// An HdrHistogram of nanoseconds from 1 ns to [`LATENCY_NS_MAX`] at 3 significant digits.
pub struct Hist(Histogram<u64>);

impl Default for Hist {
    fn default() -> Self {
        Hist(Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3).expect("valid histogram bounds"))
    }
}

impl Hist {
    pub fn record(&mut self, ns: u64) {
        self.0.saturating_record(ns.clamp(1, LATENCY_NS_MAX));
    }

    /// The histogram's summary (values within its 3 significant digits).
    pub fn percentiles(&self) -> LatencySummary {
        let h = &self.0;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            mean_ns: h.mean(),
            p50_ns: h.value_at_quantile(0.50),
            p90_ns: h.value_at_quantile(0.90),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
        }
    }
}

/// The measurements of one set of requests (overall, a group, or one model of a group).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// "all", the group ("rt"), or "model/group".
    pub name: String,
    /// Requests that arrived in the window.
    pub requests: u64,
    pub completed: u64,
    pub rejected: u64,
    pub failed: u64,
    pub unfinished: u64,
    /// Cold: completed requests that waited for their model to load.
    pub cold: u64,
    pub latency: LatencySummary,
    pub queue: LatencySummary,
    pub gpu: LatencySummary,
    pub throughput_per_s: f64,
    pub goodput_per_s: f64,
    /// Requests with a deadline that arrived in the window, and how many missed it.
    pub with_deadline: u64,
    pub deadline_missed: u64,
    /// The reason of the first failed request, if any failed (the rest are counted, not kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_failure: Option<String>,
}

impl Summary {
    /// Fraction of requests with a deadline that missed it (`None` without deadlines).
    pub fn miss_rate(&self) -> Option<f64> {
        (self.with_deadline > 0).then(|| self.deadline_missed as f64 / self.with_deadline as f64)
    }
}

#[derive(Default)]
struct Acc {
    requests: u64,
    completed: u64,
    rejected: u64,
    failed: u64,
    unfinished: u64,
    cold: u64,
    latency: Hist,
    queue: Hist,
    gpu: Hist,
    done_in_window: u64,
    good_in_window: u64,
    with_deadline: u64,
    missed: u64,
    first_failure: Option<String>,
}

impl Acc {
    fn summary(&self, name: &str, window_s: f64) -> Summary {
        Summary {
            name: name.to_string(),
            requests: self.requests,
            completed: self.completed,
            rejected: self.rejected,
            failed: self.failed,
            unfinished: self.unfinished,
            cold: self.cold,
            latency: self.latency.percentiles(),
            queue: self.queue.percentiles(),
            gpu: self.gpu.percentiles(),
            throughput_per_s: self.done_in_window as f64 / window_s,
            goodput_per_s: self.good_in_window as f64 / window_s,
            with_deadline: self.with_deadline,
            first_failure: self.first_failure.clone(),
            deadline_missed: self.missed,
        }
    }
}

/// Everything one point (one policy or peer at one load) measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub overall: Summary,
    /// Per metrics group, by name.
    pub groups: Vec<Summary>,
    /// Per model and group ("resnet18/be"), by name.
    pub models: Vec<Summary>,
    /// Open-loop requests that arrived in the window, per second (the offered load).
    pub offered_per_s: f64,
    /// Open-loop requests that arrived in the window and completed within it, per second.
    pub served_open_per_s: f64,
}

impl Metrics {
    pub fn group(&self, name: &str) -> Option<&Summary> {
        self.groups.iter().find(|g| g.name == name)
    }

    pub fn model(&self, model: &str) -> Option<&Summary> {
        self.models.iter().find(|g| g.name.split('/').next() == Some(model))
    }

    /// Whether the target kept up: it served at least `fraction` of the offered open-loop load, and
    /// left at most 1% of the window's requests unfinished. Closed-loop-only runs never saturate.
    pub fn saturated(&self, fraction: f64) -> bool {
        let unfinished = self.overall.unfinished + self.overall.rejected;
        (self.offered_per_s > 0.0 && self.served_open_per_s < fraction * self.offered_per_s)
            || unfinished as f64 > 0.01 * self.overall.requests.max(1) as f64
    }
}

/// Computes the metrics of a run's outcomes. `slo_ns` applies to streams without a deadline.
pub fn measure(schedule: &Schedule, outcomes: &[Outcome], slo_ns: Option<u64>) -> Metrics {
    let (w0, w1) = (schedule.warmup_ns, schedule.duration_ns);
    let window_s = (w1 - w0) as f64 * 1e-9;
    let mut overall = Acc::default();
    let mut groups: BTreeMap<String, Acc> = BTreeMap::new();
    let mut models: BTreeMap<String, Acc> = BTreeMap::new();
    let mut offered = 0u64;
    let mut served_open = 0u64;
    for s in &schedule.workload.streams {
        groups.entry(s.group.clone()).or_default();
        models.entry(format!("{}/{}", s.model, s.group)).or_default();
    }
    for o in outcomes {
        let s = &schedule.workload.streams[o.stream as usize];
        let arrived_in = (w0..w1).contains(&o.arrival_ns);
        let done_in = matches!(o.status, Status::Done { done_ns, .. } if (w0..w1).contains(&done_ns));
        if arrived_in && !o.closed {
            offered += 1;
            if done_in {
                served_open += 1;
            }
        }
        let slo = s.deadline_ns.or(slo_ns);
        let key_m = format!("{}/{}", s.model, s.group);
        for acc in [&mut overall, groups.get_mut(&s.group).expect("seeded"), models.get_mut(&key_m).expect("seeded")] {
            if done_in {
                acc.done_in_window += 1;
                if slo.is_none_or(|d| o.latency_ns().is_some_and(|l| l <= d)) {
                    acc.good_in_window += 1;
                }
            }
            if !arrived_in {
                continue;
            }
            acc.requests += 1;
            match &o.status {
                Status::Done { queue_ns, gpu_ns, .. } => {
                    acc.completed += 1;
                    let l = o.latency_ns().expect("done");
                    acc.latency.record(l);
                    acc.queue.record(*queue_ns);
                    acc.gpu.record(*gpu_ns);
                    if o.cold {
                        acc.cold += 1;
                    }
                }
                Status::Rejected(_) => acc.rejected += 1,
                Status::Failed(why) => {
                    acc.failed += 1;
                    if acc.first_failure.is_none() {
                        acc.first_failure = Some(why.clone());
                    }
                }
                Status::Unfinished => acc.unfinished += 1,
            }
            if let Some(d) = s.deadline_ns {
                acc.with_deadline += 1;
                if o.latency_ns().is_none_or(|l| l > d) {
                    acc.missed += 1;
                }
            }
        }
    }
    Metrics {
        overall: overall.summary("all", window_s),
        groups: groups.iter().map(|(k, a)| a.summary(k, window_s)).collect(),
        models: models.iter().map(|(k, a)| a.summary(k, window_s)).collect(),
        offered_per_s: offered as f64 / window_s,
        served_open_per_s: served_open as f64 / window_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Arrival, Stream, StreamClass, Workload};

    fn schedule() -> Schedule {
        let mut w = Workload::default();
        w.stream_with(
            Stream::new("rt", "a").with_class(StreamClass::Rt, "rt").with_deadline_ns(10),
            Arrival::Periodic { period_ns: 10, phase_ns: Some(0) },
        );
        w.stream_with(Stream::new("be", "b").with_class(StreamClass::Be, "be"), Arrival::ClosedLoop { clients: 1, think_ns: 0 });
        Schedule { workload: w, duration_ns: 1_000, warmup_ns: 100, seed: 0, arrivals: vec![] }
    }

    fn done(stream: u32, arrival_ns: u64, latency: u64, gpu: u64, closed: bool) -> Outcome {
        Outcome {
            stream,
            arrival_ns,
            status: Status::Done { done_ns: arrival_ns + latency, queue_ns: latency - gpu, gpu_ns: gpu },
            closed,
            cold: false,
            first_block_ns: None,
            first_issue_ns: None,
            admit_ns: None,
            round_ns: None,
        }
    }

    #[test]
    fn window_goodput_and_misses() {
        let s = schedule();
        let mut o = vec![
            done(0, 50, 5, 5, false),    // warm-up: ignored for latency, and completes before the window
            done(0, 200, 5, 4, false),   // meets its deadline
            done(0, 300, 20, 10, false), // misses it
            done(0, 995, 8, 8, false),   // arrives in the window, completes after it
            done(1, 400, 100, 50, true), // best effort, closed loop
        ];
        o.push(Outcome {
            stream: 0,
            arrival_ns: 500,
            status: Status::Unfinished,
            closed: false,
            cold: false,
            first_block_ns: None,
            first_issue_ns: None,
            admit_ns: None,
            round_ns: None,
        });
        o.push(Outcome {
            stream: 0,
            arrival_ns: 600,
            status: Status::Rejected("full".into()),
            closed: false,
            cold: false,
            first_block_ns: None,
            first_issue_ns: None,
            admit_ns: None,
            round_ns: None,
        });
        let m = measure(&s, &o, None);
        let rt = m.group("rt").unwrap();
        assert_eq!((rt.requests, rt.completed, rt.unfinished, rt.rejected), (5, 3, 1, 1));
        assert_eq!((rt.with_deadline, rt.deadline_missed), (5, 3));
        assert_eq!(rt.miss_rate(), Some(0.6));
        // Completions inside [100, 1000): 205, 320 of rt (one good), 500 of be.
        let window_s = 900e-9;
        assert!((rt.throughput_per_s - 2.0 / window_s).abs() < 1e-3);
        assert!((rt.goodput_per_s - 1.0 / window_s).abs() < 1e-3);
        assert_eq!(m.overall.completed, 4);
        assert_eq!(rt.latency.max_ns, 20);
        assert_eq!(rt.queue.max_ns, 10);
        // Open loop: 5 offered in the window, 2 served within it.
        assert!((m.offered_per_s - 5.0 / window_s).abs() < 1e-3);
        assert!(m.saturated(0.9));
        assert_eq!(m.model("b").unwrap().completed, 1);
        // A run-wide SLO applies to streams without deadlines.
        let m2 = measure(&s, &o, Some(50));
        assert_eq!(m2.group("be").unwrap().goodput_per_s, 0.0);
    }

    #[test]
    fn histogram_percentiles_are_close() {
        let mut h = Hist::default();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let p = h.percentiles();
        assert_eq!(p.count, 10_000);
        for (got, want) in [(p.p50_ns, 5_000_000.0), (p.p99_ns, 9_900_000.0), (p.p999_ns, 9_990_000.0)] {
            assert!((got as f64 / want - 1.0).abs() < 2e-3, "{got} vs {want}");
        }
    }
}

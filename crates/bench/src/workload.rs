//! Workloads: who sends what, when.
//!
//! A [`Workload`] is a set of [`Stream`]s — one model with one class, priority, deadline, tenant and
//! metrics group — and of [`Source`]s that generate requests for them. An open-loop source draws
//! arrival times from an [`Arrival`] process and, for each arrival, picks one of its streams by
//! weight (Paella's mix is one lognormal process over eleven streams; DISB's real-time clients are
//! one periodic source per stream). A closed-loop source has a number of clients, each with one
//! request outstanding at a time, sending the next one `think_ns` after the previous completes.
//!
//! [`Workload::schedule`] materializes the open-loop arrivals of a run from one seed into a
//! [`Schedule`]: the same seed gives the same arrivals, which is how the PyTorch peers replay the
//! very trace kairos was given (see [`crate::trace`]). Closed-loop requests depend on completions
//! and are generated while the run goes ([`crate::runner`]).

use kairos_sched::{Class, RequestOptions, TenantId};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};
use serde::{Deserialize, Serialize};

/// Open-loop arrivals of one schedule at most (a run asking for more is an error, not a stall).
pub const ARRIVALS_MAX: usize = 4_000_000;
/// Streams of one workload at most.
pub const STREAMS_MAX: usize = 4096;
/// Clients of one closed-loop source at most.
pub const CLIENTS_MAX: u32 = 4096;

/// How a source's requests arrive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Arrival {
    /// Exponential gaps at a mean rate.
    Poisson { rate_per_s: f64 },
    /// Lognormal gaps with `sigma` (of the underlying normal) at a mean rate: bursty for sigma > 1.
    LogNormal { rate_per_s: f64, sigma: f64 },
    /// One arrival every `period_ns`, starting at `phase_ns` (drawn uniformly in one period from the
    /// seed when `None`, so periodic tasks are not released in lockstep).
    Periodic { period_ns: u64, phase_ns: Option<u64> },
    /// Counts per time window (a replayed trace, already scaled): window `w` gets `counts[w]` arrivals
    /// on average (the integer part always, the fraction with that probability), uniform inside the
    /// window; the windows repeat when the run is longer than the trace.
    Windows { window_ns: u64, counts: Vec<f64> },
    /// `clients` closed-loop clients, each sending its next request `think_ns` after its last one completed.
    ClosedLoop { clients: u32, think_ns: u64 },
}

impl Arrival {
    /// Mean open-loop rate (requests per second); `None` for closed loops.
    pub fn rate_per_s(&self) -> Option<f64> {
        match self {
            Arrival::Poisson { rate_per_s } | Arrival::LogNormal { rate_per_s, .. } => Some(*rate_per_s),
            Arrival::Periodic { period_ns, .. } => Some(1e9 / (*period_ns).max(1) as f64),
            Arrival::Windows { window_ns, counts } => {
                let total: f64 = counts.iter().sum();
                Some(total / (counts.len().max(1) as f64 * (*window_ns).max(1) as f64 * 1e-9))
            }
            Arrival::ClosedLoop { .. } => None,
        }
    }

    pub fn is_closed(&self) -> bool {
        matches!(self, Arrival::ClosedLoop { .. })
    }

    /// A short label for tables ("poisson", "lognormal(1.5)", "periodic(10ms)", ...).
    pub fn label(&self) -> String {
        match self {
            Arrival::Poisson { .. } => "poisson".into(),
            Arrival::LogNormal { sigma, .. } => format!("lognormal({sigma})"),
            Arrival::Periodic { period_ns, .. } => format!("periodic({:.3}ms)", *period_ns as f64 / 1e6),
            Arrival::Windows { window_ns, counts } => format!("trace({}x{:.0}ms)", counts.len(), *window_ns as f64 / 1e6),
            Arrival::ClosedLoop { clients, think_ns } if *think_ns > 0 => {
                format!("closed({clients}, think {:.3}ms)", *think_ns as f64 / 1e6)
            }
            Arrival::ClosedLoop { clients, .. } => format!("closed({clients})"),
        }
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |what: &str, v: f64| {
            if v.is_finite() && v > 0.0 { Ok(()) } else { Err(format!("{what} must be positive and finite, got {v}")) }
        };
        match self {
            Arrival::Poisson { rate_per_s } => positive("rate", *rate_per_s),
            Arrival::LogNormal { rate_per_s, sigma } => {
                positive("rate", *rate_per_s)?;
                positive("sigma", *sigma)
            }
            Arrival::Periodic { period_ns, phase_ns } => {
                if *period_ns == 0 {
                    return Err("period must be positive".into());
                }
                match phase_ns {
                    Some(p) if p >= period_ns => Err(format!("phase {p} ns is not inside the period {period_ns} ns")),
                    _ => Ok(()),
                }
            }
            Arrival::Windows { window_ns, counts } => {
                if *window_ns == 0 || counts.is_empty() {
                    return Err("a trace needs at least one window of positive length".into());
                }
                match counts.iter().find(|c| !c.is_finite() || **c < 0.0) {
                    Some(c) => Err(format!("trace window count {c} is not a non-negative number")),
                    None => Ok(()),
                }
            }
            Arrival::ClosedLoop { clients, .. } => {
                if *clients == 0 || *clients > CLIENTS_MAX {
                    Err(format!("closed-loop clients = {clients} must be in 1..={CLIENTS_MAX}"))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Open-loop arrival times in `[0, duration_ns)`, ascending. Closed loops have none.
    pub fn times_ns(&self, duration_ns: u64, rng: &mut SmallRng) -> Result<Vec<u64>, String> {
        self.validate()?;
        let mut out = Vec::new();
        let push = |out: &mut Vec<u64>, t: u64| -> Result<(), String> {
            if out.len() >= ARRIVALS_MAX {
                return Err(format!("more than {ARRIVALS_MAX} arrivals in one run: lower the rate or the duration"));
            }
            out.push(t);
            Ok(())
        };
        match self {
            Arrival::Poisson { rate_per_s } => {
                let d = Exp::new(*rate_per_s * 1e-9).map_err(|e| e.to_string())?;
                let mut t = d.sample(rng);
                while t < duration_ns as f64 {
                    push(&mut out, t as u64)?;
                    t += d.sample(rng);
                }
            }
            Arrival::LogNormal { rate_per_s, sigma } => {
                // E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = the mean gap.
                let mean_ns = 1e9 / rate_per_s;
                let d = LogNormal::new(mean_ns.ln() - sigma * sigma / 2.0, *sigma).map_err(|e| e.to_string())?;
                let mut t = d.sample(rng);
                while t < duration_ns as f64 {
                    push(&mut out, t as u64)?;
                    t += d.sample(rng);
                }
            }
            Arrival::Periodic { period_ns, phase_ns } => {
                let phase = phase_ns.unwrap_or_else(|| rng.random_range(0..*period_ns));
                let mut t = phase;
                while t < duration_ns {
                    push(&mut out, t)?;
                    t += period_ns;
                }
            }
            Arrival::Windows { window_ns, counts } => {
                let mut start = 0u64;
                let mut w = 0usize;
                while start < duration_ns {
                    let c = counts[w % counts.len()];
                    let n = c.floor() as u64 + u64::from(rng.random::<f64>() < c.fract());
                    let mut inside: Vec<u64> = (0..n).map(|_| start + rng.random_range(0..*window_ns)).collect();
                    inside.sort_unstable();
                    for t in inside.into_iter().filter(|&t| t < duration_ns) {
                        push(&mut out, t)?;
                    }
                    start += window_ns;
                    w += 1;
                }
            }
            Arrival::ClosedLoop { .. } => {}
        }
        Ok(out)
    }
}

/// One kind of request: a model with the options every request of the stream carries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stream {
    /// Unique within the workload ("vgg19-rt").
    pub name: String,
    /// The model as loaded (an instance name in the coldstart workload).
    pub model: String,
    pub class: StreamClass,
    pub priority: i32,
    /// Relative deadline, from arrival.
    pub deadline_ns: Option<u64>,
    pub tenant: u32,
    /// The metrics group the stream reports under ("rt", "be", "hp", "lp", "all").
    pub group: String,
}

/// REEF's classes, as written in results and traces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamClass {
    Rt,
    Be,
}

impl StreamClass {
    pub fn class(self) -> Class {
        match self {
            StreamClass::Rt => Class::RealTime,
            StreamClass::Be => Class::BestEffort,
        }
    }
    pub fn label(self) -> &'static str {
        match self {
            StreamClass::Rt => "rt",
            StreamClass::Be => "be",
        }
    }
}

impl Stream {
    /// A best-effort stream in group "all".
    pub fn new(name: &str, model: &str) -> Stream {
        Stream {
            name: name.into(),
            model: model.into(),
            class: StreamClass::Be,
            priority: 0,
            deadline_ns: None,
            tenant: 0,
            group: "all".into(),
        }
    }

    pub fn with_class(mut self, class: StreamClass, group: &str) -> Stream {
        self.class = class;
        self.group = group.into();
        self
    }

    pub fn with_priority(mut self, priority: i32) -> Stream {
        self.priority = priority;
        self
    }

    pub fn with_deadline_ns(mut self, deadline_ns: u64) -> Stream {
        self.deadline_ns = Some(deadline_ns);
        self
    }

    pub fn with_tenant(mut self, tenant: u32) -> Stream {
        self.tenant = tenant;
        self
    }

    /// The dispatcher's options for a request of this stream (benchmarks skip input and output
    /// copies: they measure scheduling, not PCIe).
    pub fn options(&self) -> RequestOptions {
        RequestOptions {
            class: self.class.class(),
            priority: self.priority,
            deadline_ns: self.deadline_ns,
            tenant: TenantId(self.tenant),
            skip_io: true,
            notify_before_done: false,
        }
    }
}

/// A generator of requests for some streams.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Source {
    pub arrival: Arrival,
    /// (stream index, weight): each request goes to one of them, chosen by weight.
    pub streams: Vec<(u32, f64)>,
}

impl Source {
    pub fn one(arrival: Arrival, stream: u32) -> Source {
        Source { arrival, streams: vec![(stream, 1.0)] }
    }

    /// Picks a stream by weight.
    pub fn pick(&self, rng: &mut SmallRng) -> u32 {
        if self.streams.len() == 1 {
            return self.streams[0].0;
        }
        let total: f64 = self.streams.iter().map(|s| s.1).sum();
        let mut u = rng.random::<f64>() * total;
        for &(s, w) in &self.streams {
            u -= w;
            if u < 0.0 {
                return s;
            }
        }
        self.streams.last().expect("a source has streams").0
    }
}

/// Streams and the sources that feed them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub streams: Vec<Stream>,
    pub sources: Vec<Source>,
}

impl Workload {
    /// Adds a stream and returns its index.
    pub fn stream(&mut self, s: Stream) -> u32 {
        self.streams.push(s);
        (self.streams.len() - 1) as u32
    }

    /// Adds a stream fed by its own source.
    pub fn stream_with(&mut self, s: Stream, arrival: Arrival) -> u32 {
        let i = self.stream(s);
        self.sources.push(Source::one(arrival, i));
        i
    }

    /// The distinct models, in first-use order.
    pub fn models(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in &self.streams {
            if !out.contains(&s.model) {
                out.push(s.model.clone());
            }
        }
        out
    }

    /// Mean open-loop rate over all sources (requests per second).
    pub fn open_rate_per_s(&self) -> f64 {
        self.sources.iter().filter_map(|s| s.arrival.rate_per_s()).sum()
    }

    pub fn has_open_loop(&self) -> bool {
        self.sources.iter().any(|s| !s.arrival.is_closed())
    }

    /// Checks every source and stream reference, and the limits.
    pub fn validate(&self) -> Result<(), String> {
        if self.streams.is_empty() || self.streams.len() > STREAMS_MAX {
            return Err(format!("a workload needs 1..={STREAMS_MAX} streams, got {}", self.streams.len()));
        }
        if self.sources.is_empty() {
            return Err("a workload needs at least one source".into());
        }
        let mut names = std::collections::HashSet::new();
        for s in &self.streams {
            if !names.insert(&s.name) {
                return Err(format!("stream name '{}' is used twice", s.name));
            }
        }
        for (i, src) in self.sources.iter().enumerate() {
            src.arrival.validate().map_err(|e| format!("source {i}: {e}"))?;
            if src.streams.is_empty() {
                return Err(format!("source {i} feeds no stream"));
            }
            for &(s, w) in &src.streams {
                if s as usize >= self.streams.len() {
                    return Err(format!("source {i} names stream {s}, the workload has {}", self.streams.len()));
                }
                if !(w.is_finite() && w > 0.0) {
                    return Err(format!("source {i}: weight {w} of stream {s} must be positive"));
                }
            }
        }
        Ok(())
    }

    /// Materializes the open-loop arrivals of `[0, duration_ns)` from `seed`: one random stream per
    /// source (so adding a source does not change the others' arrivals), merged in time order.
    pub fn schedule(&self, duration_ns: u64, warmup_ns: u64, seed: u64) -> Result<Schedule, String> {
        self.validate()?;
        if warmup_ns >= duration_ns {
            return Err(format!("warm-up {warmup_ns} ns must be shorter than the run ({duration_ns} ns)"));
        }
        let mut arrivals: Vec<(u64, u32)> = Vec::new();
        for (i, src) in self.sources.iter().enumerate() {
            let mut rng = source_rng(seed, i);
            let times = src.arrival.times_ns(duration_ns, &mut rng)?;
            if arrivals.len() + times.len() > ARRIVALS_MAX {
                return Err(format!("more than {ARRIVALS_MAX} arrivals in one run: lower the rate or the duration"));
            }
            for t in times {
                arrivals.push((t, src.pick(&mut rng)));
            }
        }
        // Stable: equal times keep source order, so the schedule is a function of the seed alone.
        arrivals.sort_by_key(|a| a.0);
        Ok(Schedule { workload: self.clone(), duration_ns, warmup_ns, seed, arrivals })
    }
}

/// The random stream of source `i` under `seed` (closed-loop stream choices use it too).
pub fn source_rng(seed: u64, i: usize) -> SmallRng {
    SmallRng::seed_from_u64(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A workload's requests for one run: open-loop arrivals fixed, closed loops described.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub workload: Workload,
    /// Arrivals happen in `[0, duration_ns)` (times relative to the run's start).
    pub duration_ns: u64,
    /// Statistics cover arrivals (latency) and completions (throughput) from here to the end.
    pub warmup_ns: u64,
    pub seed: u64,
    /// (time, stream), ascending in time.
    pub arrivals: Vec<(u64, u32)>,
}

impl Schedule {
    /// Open-loop arrivals inside the measurement window, per second.
    pub fn offered_open_per_s(&self) -> f64 {
        let n = self.arrivals.iter().filter(|a| a.0 >= self.warmup_ns).count();
        n as f64 / ((self.duration_ns - self.warmup_ns) as f64 * 1e-9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_have_their_rate() {
        let d = 200_000_000_000; // 200 s
        for a in [
            Arrival::Poisson { rate_per_s: 500.0 },
            Arrival::LogNormal { rate_per_s: 500.0, sigma: 1.5 },
            Arrival::Periodic { period_ns: 2_000_000, phase_ns: None },
            Arrival::Windows { window_ns: 1_000_000_000, counts: vec![100.0, 900.5, 0.0, 999.5] },
        ] {
            let t = a.times_ns(d, &mut SmallRng::seed_from_u64(3)).unwrap();
            let rate = t.len() as f64 / 200.0;
            assert!((rate / a.rate_per_s().unwrap() - 1.0).abs() < 0.05, "{a:?}: {rate}/s");
            assert!(t.windows(2).all(|w| w[0] <= w[1]) && t.iter().all(|&x| x < d), "{a:?}");
        }
    }

    #[test]
    fn periodic_phase_and_windows_shape() {
        let a = Arrival::Periodic { period_ns: 10, phase_ns: Some(3) };
        assert_eq!(a.times_ns(35, &mut SmallRng::seed_from_u64(0)).unwrap(), vec![3, 13, 23, 33]);
        // A trace window with no calls stays empty, a full one stays inside its window.
        let w = Arrival::Windows { window_ns: 100, counts: vec![0.0, 5.0] };
        let t = w.times_ns(200, &mut SmallRng::seed_from_u64(1)).unwrap();
        assert_eq!(t.len(), 5);
        assert!(t.iter().all(|&x| (100..200).contains(&x)));
        assert!(Arrival::Periodic { period_ns: 10, phase_ns: Some(10) }.validate().is_err());
        assert!(Arrival::ClosedLoop { clients: 0, think_ns: 0 }.validate().is_err());
    }

    #[test]
    fn schedules_are_a_function_of_the_seed() {
        let mut w = Workload::default();
        let a = w.stream(Stream::new("a", "m1"));
        let b = w.stream(Stream::new("b", "m2"));
        w.sources.push(Source { arrival: Arrival::Poisson { rate_per_s: 1000.0 }, streams: vec![(a, 1.0), (b, 3.0)] });
        w.stream_with(Stream::new("c", "m1"), Arrival::ClosedLoop { clients: 2, think_ns: 0 });
        let s1 = w.schedule(1_000_000_000, 100_000_000, 9).unwrap();
        let s2 = w.schedule(1_000_000_000, 100_000_000, 9).unwrap();
        let s3 = w.schedule(1_000_000_000, 100_000_000, 10).unwrap();
        assert_eq!(s1, s2);
        assert_ne!(s1.arrivals, s3.arrivals);
        let to_b = s1.arrivals.iter().filter(|x| x.1 == b).count() as f64 / s1.arrivals.len() as f64;
        assert!((to_b - 0.75).abs() < 0.05, "share of b {to_b}");
        assert_eq!(w.models(), vec!["m1".to_string(), "m2".to_string()]);
        assert!(s1.arrivals.iter().all(|x| x.1 != 2), "closed loops have no scheduled arrivals");
        let bad = Workload { sources: vec![Source::one(Arrival::Poisson { rate_per_s: 1.0 }, 7)], ..w.clone() };
        assert!(bad.validate().is_err());
    }
}

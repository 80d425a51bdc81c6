//! The load generator: one run of a [`Schedule`] against a [`Target`].
//!
//! Open-loop arrivals are submitted at their scheduled times; closed-loop clients send their next
//! request `think_ns` after the previous one completed (at least [`RETRY_BACKOFF_NS`] after a
//! refusal, so a refused client cannot spin). Arrivals stop at the end of the schedule's duration;
//! requests still outstanding `drain_ns` later are left unfinished and cancelled when the target
//! stops. With [`Residency::Budget`] the dispatcher runs under a weight budget (the coldstart
//! workload): every model is loaded into pinned host memory, the engine loads a model into the GPU
//! when a request needs it and evicts the least recently used idle ones; a request that waited for
//! its model's load is marked cold (`Timing::cold_start`), and the load's time counts in its
//! latency.

use crate::Error;
use crate::target::{Completion, Target};
use crate::workload::{Arrival, Schedule, source_rng};
use kairos_gpu::profile::ModelProfile;
use kairos_sched::{Config, ModelSpec};
use rand::rngs::SmallRng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// A closed-loop client waits this long after a refused or failed request before the next one.
pub const RETRY_BACKOFF_NS: u64 = 1_000_000;
/// Outstanding requests of one run at most (beyond, the generator stops submitting and says so).
pub const OUTSTANDING_MAX: usize = 1 << 20;

/// The models a workload may name, by the name streams use.
#[derive(Clone, Debug, Default)]
pub struct Catalog {
    specs: BTreeMap<String, ModelSpec>,
    /// Per model without a usable profile: the part of a stale one that still describes its plan
    /// (`ModelProfile::matching_part`), for the simulator's kernel times only; the dispatcher's
    /// estimates need a whole profile and take the roofline.
    sim_timing: BTreeMap<String, ModelProfile>,
}

impl Catalog {
    pub fn insert(&mut self, spec: ModelSpec) {
        self.specs.insert(spec.name.clone(), spec);
    }

    /// Records the measured part of `name`'s stale profile for the simulator's kernel times.
    pub fn insert_sim_timing(&mut self, name: &str, part: ModelProfile) {
        self.sim_timing.insert(name.to_string(), part);
    }

    /// The profile the simulator times `spec`'s kernels by: its own, else the measured part of a
    /// stale one.
    pub fn sim_timing<'a>(&'a self, spec: &'a ModelSpec) -> Option<&'a ModelProfile> {
        spec.profile.as_ref().or_else(|| self.sim_timing.get(&spec.name))
    }

    /// Adds `spec` under another name (a model instance sharing the plan).
    pub fn insert_as(&mut self, name: &str, spec: &ModelSpec) {
        let mut s = spec.clone();
        s.name = name.to_string();
        self.specs.insert(name.to_string(), s);
    }

    pub fn specs(&self) -> impl Iterator<Item = &ModelSpec> {
        self.specs.values()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.specs.contains_key(name)
    }

    pub fn get(&self, name: &str) -> Result<&ModelSpec, Error> {
        self.specs
            .get(name)
            .ok_or_else(|| Error::Invalid(format!("the workload names model '{name}', which is not in the catalog")))
    }

    /// GPU memory a loaded model holds: weights plus one activation arena.
    /// Bytes of a model's weights (what a weight budget counts, when every layer is loaded).
    pub fn weight_bytes(&self, name: &str) -> Result<u64, Error> {
        Ok(self.get(name)?.plan.weight_bytes)
    }
}

/// Which models are on the GPU during a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Residency {
    /// Every model of the workload is loaded before the run starts.
    All,
    /// The dispatcher's weight budget ([`Config::weight_budget_bytes`]): every model is loaded
    /// before the run, its weights in pinned host memory, and the engine moves them into the GPU
    /// on demand within `weight_bytes`, evicting least recently used idle models.
    Budget { weight_bytes: u64 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct RunOptions {
    /// After the last arrival, outstanding requests get this long to finish.
    pub drain_ns: u64,
    /// The schedule's time 0 is this long after the models are loaded.
    pub start_delay_ns: u64,
    pub residency: Residency,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { drain_ns: 1_000_000_000, start_delay_ns: 1_000_000, residency: Residency::All }
    }
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Status {
    /// Completed: times relative to the run's start; `gpu_ns` from its first kernel issued to its end.
    Done { done_ns: u64, queue_ns: u64, gpu_ns: u64 },
    /// Refused at submission (overload: the 429 / RESOURCE_EXHAUSTED case).
    Rejected(String),
    /// Failed after admission (cancelled, GPU error).
    Failed(String),
    /// Still outstanding when the drain time ran out.
    Unfinished,
}

/// One request of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub stream: u32,
    /// Scheduled arrival, relative to the run's start.
    pub arrival_ns: u64,
    pub status: Status,
    /// From a closed-loop source (not offered load).
    pub closed: bool,
    /// Its model had to be loaded first.
    pub cold: bool,
    /// From its arrival at the dispatcher to its first logical block taken on the GPU (kairos
    /// only, where a launch reported it; REEF's "RT arrival to first CTA").
    pub first_block_ns: Option<u64>,
    /// From its arrival at the dispatcher to its first launch call (kairos only): the host's part
    /// of `first_block_ns` (admission, preemption decisions, the input copy's enqueue).
    pub first_issue_ns: Option<u64>,
    /// From its arrival at the dispatcher until it was admitted (a slot, its input copies enqueued):
    /// the first part of `first_issue_ns` (kairos only).
    pub admit_ns: Option<u64>,
    /// From its arrival at the dispatcher to the start of the decision round that issued its first
    /// launch (kairos only): the part of `first_issue_ns` before that round (rounds that did not
    /// issue it, GPU events handled first); the rest is what the round did before (preemptions).
    pub round_ns: Option<u64>,
}

impl Outcome {
    pub fn latency_ns(&self) -> Option<u64> {
        match self.status {
            Status::Done { done_ns, .. } => Some(done_ns.saturating_sub(self.arrival_ns)),
            _ => None,
        }
    }
}

/// What one run produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunRecord {
    pub outcomes: Vec<Outcome>,
    pub model_loads: u64,
    pub model_unloads: u64,
    /// Time the target spent in loads during the run.
    pub load_ns: u64,
    /// Host time the run took.
    pub wall_ns: u64,
    /// The dispatcher's counters at the end of the run (in-process targets).
    pub counters: Option<crate::target::DispatcherCounters>,
}

struct Client {
    source: usize,
}

/// Runs `schedule` on `target` under `config`: starts the target, loads the models, generates the
/// load, collects every request's outcome, stops the target. `progress` is called with the
/// fraction of the schedule's duration done, at most about a hundred times.
pub fn run(
    target: &mut dyn Target,
    config: &Config,
    schedule: &Schedule,
    catalog: &Catalog,
    opts: &RunOptions,
    progress: &mut dyn FnMut(f64),
) -> Result<RunRecord, Error> {
    let wall = std::time::Instant::now();
    let w = &schedule.workload;
    w.validate().map_err(Error::Invalid)?;
    let config = match opts.residency {
        Residency::All => config.clone(),
        Residency::Budget { weight_bytes } => Config { weight_budget_bytes: Some(weight_bytes), ..config.clone() },
    };
    target.begin(&config)?;
    let result = generate(target, schedule, catalog, opts, progress);
    let counters = target.counters();
    let ended = target.end();
    let mut rec = result?;
    if let (Residency::Budget { .. }, Some(c)) = (opts.residency, &counters) {
        rec.model_loads = c.cold_starts;
        rec.model_unloads = c.evictions;
    }
    rec.counters = counters;
    ended?;
    rec.wall_ns = wall.elapsed().as_nanos() as u64;
    Ok(rec)
}

fn generate(
    target: &mut dyn Target,
    schedule: &Schedule,
    catalog: &Catalog,
    opts: &RunOptions,
    progress: &mut dyn FnMut(f64),
) -> Result<RunRecord, Error> {
    let w = &schedule.workload;
    let mut rec = RunRecord::default();
    // Under a weight budget too: the engine keeps every model's weights in host memory and moves
    // them into the GPU when a request needs them.
    for m in w.models() {
        target.load_model(catalog.get(&m)?)?;
    }
    let t0 = target.now_ns() + opts.start_delay_ns;
    let end = t0 + schedule.duration_ns;
    let drain_end = end + opts.drain_ns;

    // Closed-loop clients: (next send time, client index), earliest first.
    let mut clients: Vec<Client> = Vec::new();
    let mut closed: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut rngs: Vec<SmallRng> = Vec::new();
    let mut think: Vec<u64> = Vec::new();
    for (i, src) in w.sources.iter().enumerate() {
        rngs.push(source_rng(schedule.seed ^ 0xC105_ED00, i));
        think.push(match src.arrival {
            Arrival::ClosedLoop { think_ns, .. } => think_ns,
            _ => 0,
        });
        if let Arrival::ClosedLoop { clients: n, .. } = src.arrival {
            for _ in 0..n {
                closed.push(Reverse((t0, clients.len())));
                clients.push(Client { source: i });
            }
        }
    }
    // Per tag: the closed-loop client that sent it.
    let mut sender: Vec<Option<usize>> = Vec::new();
    let mut next_open = 0usize;
    let mut outstanding = 0usize;
    let mut comps: Vec<Completion> = Vec::new();
    let mut last_progress = 0.0f64;
    loop {
        let now = target.now_ns();
        // Submit everything due, in time order across open and closed sources.
        loop {
            let open_at = schedule.arrivals.get(next_open).map(|a| t0 + a.0);
            let closed_at = closed.peek().map(|r| r.0.0);
            let (at, stream, client) = match (open_at, closed_at) {
                (Some(o), c) if o <= now && c.is_none_or(|c| o <= c) => {
                    let s = schedule.arrivals[next_open].1;
                    next_open += 1;
                    (o, s, None)
                }
                (_, Some(c)) if c <= now => {
                    let Reverse((_, k)) = closed.pop().expect("peeked");
                    if c >= end {
                        continue; // the client stops: arrivals end with the schedule
                    }
                    let src = clients[k].source;
                    (c, w.sources[src].pick(&mut rngs[src]), Some(k))
                }
                _ => break,
            };
            if outstanding >= OUTSTANDING_MAX {
                return Err(Error::Invalid(format!(
                    "more than {OUTSTANDING_MAX} requests outstanding: the target is hopelessly overloaded"
                )));
            }
            let s = &w.streams[stream as usize];
            let name = &s.model;
            let tag = rec.outcomes.len() as u64;
            rec.outcomes.push(Outcome {
                stream,
                arrival_ns: at - t0,
                status: Status::Unfinished,
                closed: client.is_some(),
                cold: false,
                first_block_ns: None,
                first_issue_ns: None,
                admit_ns: None,
                round_ns: None,
            });
            sender.push(client);
            target.submit(tag, name, at, s.options())?;
            outstanding += 1;
        }
        let arrivals_left = next_open < schedule.arrivals.len() || !closed.is_empty();
        if !arrivals_left && outstanding == 0 {
            break;
        }
        if now >= drain_end {
            break;
        }
        let mut until = drain_end;
        if let Some(a) = schedule.arrivals.get(next_open) {
            until = until.min(t0 + a.0);
        }
        if let Some(Reverse((c, _))) = closed.peek() {
            until = until.min(*c);
        }
        target.wait(until.max(now), &mut comps)?;
        for c in comps.drain(..) {
            let tag = c.tag as usize;
            let o = rec.outcomes.get_mut(tag).ok_or_else(|| Error::Invalid(format!("completion of unknown tag {tag}")))?;
            if o.status != Status::Unfinished {
                return Err(Error::Invalid(format!("request {tag} completed twice")));
            }
            outstanding -= 1;
            let done_ns = c.done_ns.saturating_sub(t0);
            let ok = c.result.is_ok();
            o.status = match c.result {
                Ok(t) => {
                    let latency = done_ns.saturating_sub(o.arrival_ns);
                    let gpu_ns = t.done_ns.saturating_sub(t.first_issue_ns).min(latency);
                    o.first_block_ns = (t.first_start_ns > 0).then(|| t.first_start_ns.saturating_sub(t.arrival_ns));
                    o.first_issue_ns = (t.launches > 0).then(|| t.first_issue_ns.saturating_sub(t.arrival_ns));
                    o.admit_ns = (t.admitted_ns > 0).then(|| t.admitted_ns.saturating_sub(t.arrival_ns));
                    o.round_ns = (t.launches > 0 && t.first_round_ns > 0).then(|| t.first_round_ns.saturating_sub(t.arrival_ns));
                    o.cold = t.cold_start;
                    Status::Done { done_ns, queue_ns: latency - gpu_ns, gpu_ns }
                }
                Err(e @ kairos_sched::Error::Overloaded { .. }) => Status::Rejected(e.to_string()),
                Err(e) => Status::Failed(e.to_string()),
            };
            if let Some(k) = sender[tag] {
                let src = clients[k].source;
                let gap = if ok { think[src] } else { think[src].max(RETRY_BACKOFF_NS) };
                let next = c.done_ns.max(t0) + gap;
                if next < end {
                    closed.push(Reverse((next, k)));
                }
            }
        }
        let f = (target.now_ns().saturating_sub(t0) as f64 / schedule.duration_ns as f64).min(1.0);
        if f - last_progress >= 0.01 {
            last_progress = f;
            progress(f);
        }
    }
    progress(1.0);
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Source, Stream, Workload};
    use kairos_sched::{ModelInfo, RequestOptions, Timing};
    use std::sync::Arc;

    /// A target in virtual time where every request takes `service_ns` (no contention), or is
    /// refused when its model is not loaded.
    #[derive(Default)]
    struct Fake {
        now: u64,
        service_ns: u64,
        pending: std::collections::BTreeSet<(u64, u64)>,
        refused: Vec<Completion>,
        loaded: Vec<String>,
        log: Vec<String>,
    }

    impl Target for Fake {
        fn label(&self) -> String {
            "fake".into()
        }
        fn device(&self) -> String {
            "fake".into()
        }
        fn simulated(&self) -> bool {
            true
        }
        fn begin(&mut self, c: &Config) -> Result<(), Error> {
            self.loaded.clear();
            self.log.push(format!("begin, weight budget {:?}", c.weight_budget_bytes));
            Ok(())
        }
        fn end(&mut self) -> Result<(), Error> {
            self.pending.clear();
            Ok(())
        }
        fn now_ns(&self) -> u64 {
            self.now
        }
        fn load_model(&mut self, spec: &ModelSpec) -> Result<ModelInfo, Error> {
            self.log.push(format!("load {}", spec.name));
            self.loaded.push(spec.name.clone());
            self.now += 1000; // loading takes time
            Ok(ModelInfo {
                name: spec.name.clone(),
                launches: 1,
                weight_bytes: 0,
                arena_bytes: 0,
                estimated_ns: 0,
                estimate_source: kairos_sched::EstimateSource::Roofline,
            })
        }
        fn unload_model(&mut self, name: &str) -> Result<(), Error> {
            self.log.push(format!("unload {name}"));
            self.loaded.retain(|m| m != name);
            Ok(())
        }
        fn submit(&mut self, tag: u64, model: &str, arrival_ns: u64, _: RequestOptions) -> Result<(), Error> {
            if !self.loaded.iter().any(|m| m == model) {
                self.refused.push(Completion {
                    tag,
                    done_ns: self.now,
                    result: Err(kairos_sched::Error::Overloaded { what: "test", max: 0 }),
                });
            } else {
                self.pending.insert((arrival_ns.max(self.now) + self.service_ns, tag));
            }
            Ok(())
        }
        fn wait(&mut self, until_ns: u64, out: &mut Vec<Completion>) -> Result<(), Error> {
            out.append(&mut self.refused);
            if !out.is_empty() {
                return Ok(());
            }
            match self.pending.first().copied() {
                Some((t, _)) if t <= until_ns => {
                    self.now = self.now.max(t);
                    while let Some(&(t2, tag)) = self.pending.first() {
                        if t2 != t {
                            break;
                        }
                        self.pending.pop_first();
                        let timing = Timing { first_issue_ns: t - self.service_ns / 2, done_ns: t, ..Default::default() };
                        out.push(Completion { tag, done_ns: t, result: Ok(timing) });
                    }
                }
                _ => self.now = self.now.max(until_ns),
            }
            Ok(())
        }
    }

    fn catalog(names: &[&str]) -> Catalog {
        let mut c = Catalog::default();
        for n in names {
            let plan = kairos_gpu::synthetic::chain_plan(n, 1, 256);
            c.insert(ModelSpec { name: n.to_string(), plan: Arc::new(plan), profile: None });
        }
        c
    }

    #[test]
    fn closed_loops_send_after_each_completion() {
        let mut w = Workload::default();
        w.stream_with(Stream::new("a", "m"), Arrival::ClosedLoop { clients: 2, think_ns: 5_000 });
        let s = w.schedule(100_000, 10_000, 1).unwrap();
        let mut t = Fake { service_ns: 10_000, ..Fake::default() };
        let opts = RunOptions { drain_ns: 50_000, start_delay_ns: 0, residency: Residency::All };
        let rec = run(&mut t, &Config::default(), &s, &catalog(&["m"]), &opts, &mut |_| {}).unwrap();
        // Each client: sends at 0, 15, 30, ..., 90 us (service 10 + think 5), seven requests.
        assert_eq!(rec.outcomes.len(), 14);
        let arrivals: Vec<u64> = rec.outcomes.iter().map(|o| o.arrival_ns).step_by(2).collect();
        assert_eq!(arrivals, vec![0, 15_000, 30_000, 45_000, 60_000, 75_000, 90_000]);
        for o in &rec.outcomes {
            assert!(o.closed);
            assert_eq!(o.latency_ns(), Some(10_000));
            assert_eq!(o.status, Status::Done { done_ns: o.arrival_ns + 10_000, queue_ns: 5_000, gpu_ns: 5_000 });
        }
    }

    #[test]
    fn requests_past_the_drain_are_unfinished() {
        let mut w = Workload::default();
        w.stream_with(Stream::new("a", "m"), Arrival::Periodic { period_ns: 10_000, phase_ns: Some(0) });
        let s = w.schedule(100_000, 10_000, 1).unwrap();
        let mut t = Fake { service_ns: 75_000, ..Fake::default() };
        let opts = RunOptions { drain_ns: 20_000, start_delay_ns: 0, residency: Residency::All };
        let rec = run(&mut t, &Config::default(), &s, &catalog(&["m"]), &opts, &mut |_| {}).unwrap();
        assert_eq!(rec.outcomes.len(), 10);
        // Arrivals at 0..90 us (+1 us of loading), done 75 us later; the drain ends at 121 us.
        let done = rec.outcomes.iter().filter(|o| matches!(o.status, Status::Done { .. })).count();
        assert_eq!(done, 5);
        assert!(rec.outcomes[5..].iter().all(|o| o.status == Status::Unfinished));
    }

    #[test]
    fn a_weight_budget_reaches_the_dispatcher_and_every_model_loads_first() {
        let mut w = Workload::default();
        for m in ["a", "b", "c"] {
            w.stream(Stream::new(m, m));
        }
        w.sources
            .push(Source { arrival: Arrival::Periodic { period_ns: 1_000_000, phase_ns: Some(0) }, streams: vec![(0, 1.0)] });
        let mut s = w.schedule(10_000_000, 1_000_000, 1).unwrap();
        s.arrivals = vec![(0, 0), (1_000_000, 1), (2_000_000, 2), (3_000_000, 0), (4_000_000, 2)];
        let cat = catalog(&["a", "b", "c"]);
        let budget = 2 * cat.weight_bytes("a").unwrap();
        let mut t = Fake { service_ns: 100, ..Fake::default() };
        let opts = RunOptions { drain_ns: 1_000_000, start_delay_ns: 0, residency: Residency::Budget { weight_bytes: budget } };
        let rec = run(&mut t, &Config::default(), &s, &cat, &opts, &mut |_| {}).unwrap();
        assert_eq!(t.log, [format!("begin, weight budget Some({budget})"), "load a".into(), "load b".into(), "load c".into()]);
        assert!(rec.outcomes.iter().all(|o| matches!(o.status, Status::Done { .. })));
        // The fake has no counters: cold starts come from the engine (tests/presets.rs).
        assert_eq!((rec.model_loads, rec.model_unloads), (0, 0));
        let mut t = Fake { service_ns: 100, ..Fake::default() };
        let opts = RunOptions { residency: Residency::All, ..opts };
        run(&mut t, &Config::default(), &s, &cat, &opts, &mut |_| {}).unwrap();
        assert_eq!(t.log[0], "begin, weight budget None");
    }

    #[test]
    fn refused_closed_loop_clients_back_off() {
        let mut w = Workload::default();
        w.stream_with(Stream::new("a", "missing"), Arrival::ClosedLoop { clients: 1, think_ns: 0 });
        let s = w.schedule(10 * RETRY_BACKOFF_NS, RETRY_BACKOFF_NS, 1).unwrap();
        let mut c = catalog(&["m"]);
        let spec = c.get("m").unwrap().clone();
        c.insert_as("missing", &spec);
        let opts = RunOptions { drain_ns: 0, start_delay_ns: 0, residency: Residency::All };
        let mut target = Refusing(Fake { service_ns: 100, ..Fake::default() });
        let rec = run(&mut target, &Config::default(), &s, &c, &opts, &mut |_| {}).unwrap();
        assert_eq!(rec.outcomes.len(), 10, "one try per backoff period");
        assert!(rec.outcomes.iter().all(|o| matches!(o.status, Status::Rejected(_))));
    }

    /// A fake whose loads do nothing, so every request is refused.
    struct Refusing(Fake);
    impl Target for Refusing {
        fn label(&self) -> String {
            self.0.label()
        }
        fn device(&self) -> String {
            self.0.device()
        }
        fn simulated(&self) -> bool {
            true
        }
        fn begin(&mut self, c: &Config) -> Result<(), Error> {
            self.0.begin(c)
        }
        fn end(&mut self) -> Result<(), Error> {
            self.0.end()
        }
        fn now_ns(&self) -> u64 {
            self.0.now_ns()
        }
        fn load_model(&mut self, spec: &ModelSpec) -> Result<ModelInfo, Error> {
            let info = self.0.load_model(spec)?;
            self.0.loaded.clear();
            self.0.now -= 1000;
            Ok(info)
        }
        fn unload_model(&mut self, name: &str) -> Result<(), Error> {
            self.0.unload_model(name)
        }
        fn submit(&mut self, tag: u64, model: &str, arrival_ns: u64, o: RequestOptions) -> Result<(), Error> {
            self.0.submit(tag, model, arrival_ns, o)
        }
        fn wait(&mut self, until_ns: u64, out: &mut Vec<Completion>) -> Result<(), Error> {
            self.0.wait(until_ns, out)
        }
    }
}

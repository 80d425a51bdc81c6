//! Shared test support: a second GPU model (MiniGpu), a GPU wrapper that audits what the GPU
//! reports, random plans and configurations, and the seed convention.

#![allow(dead_code)]

pub mod mini;
pub mod swarm;

use kairos_gpu::synthetic::{SyntheticKernel, layered_plan};
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape, Plan};
use kairos_sched::policy::{Decision, Policy, PolicyConfig, View};
use kairos_sched::{Config, IssueRecord, RequestId};
use rand::RngExt;
use rand::rngs::SmallRng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The base of CI's seeds.
pub const SEED_BASE_DEFAULT: u64 = 20_261_121;

/// Seeds for a swarm test: `KAIROS_SEED=n` runs just n, else `count` seeds (or
/// `KAIROS_SWARM_SEEDS` of them, for long soak runs) from a fixed base, so CI is deterministic.
/// `KAIROS_SEED_BASE` moves the base; `KAIROS_SEED_RANDOM=1` draws it from the clock to explore.
/// Every seed used is printed.
pub fn seeds(count: u64) -> Vec<u64> {
    let count = std::env::var("KAIROS_SWARM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(count);
    if let Ok(s) = std::env::var("KAIROS_SEED") {
        let seed = s.parse().expect("KAIROS_SEED must be a u64");
        return vec![seed];
    }
    let random = std::env::var("KAIROS_SEED_RANDOM").is_ok_and(|v| v == "1");
    let base = std::env::var("KAIROS_SEED_BASE").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        if random {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 % 1_000_000_000
        } else {
            SEED_BASE_DEFAULT
        }
    });
    (base..base + count).collect()
}

/// Runs `f` for a seed, printing a one-line reproduction when it panics.
pub fn with_seed(test: &str, seed: u64, f: impl FnOnce(u64)) {
    eprintln!("{test}: seed {seed}");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(seed)));
    if let Err(e) = r {
        eprintln!(
            "{test} failed; reproduce with: KAIROS_SEED={seed} cargo test -p kairos-sched --test {} {test}",
            module_of(test)
        );
        std::panic::resume_unwind(e);
    }
}

/// The test binary this copy of `common` is compiled into.
fn module_of(_test: &str) -> &'static str {
    env!("CARGO_CRATE_NAME")
}

/// A random plan: a DAG of element-wise kernels of varied shapes.
pub fn random_plan(rng: &mut SmallRng, name: &str) -> Plan {
    let n = rng.random_range(1..=16usize);
    let kernels: Vec<SyntheticKernel> = (0..n)
        .map(|_| {
            let blocks = match rng.random_range(0..4) {
                0 => 1,
                1 => rng.random_range(2..=8),
                2 => rng.random_range(9..=64),
                _ => rng.random_range(65..=400),
            };
            let threads = [32, 64, 128, 256, 512, 1024][rng.random_range(0..6)];
            let smem = [0, 0, 0, 8 * 1024, 48 * 1024, 100 * 1024][rng.random_range(0..6)];
            SyntheticKernel { logical_blocks: blocks, threads_per_block: threads, shared_mem_bytes: smem }
        })
        .collect();
    let mut plan = layered_plan(name, &kernels);
    // Rewire dependencies into a random DAG (each launch writes its own buffers in this test's
    // use: MiniGpu does not compute, so only the dependency structure matters).
    for i in 1..n {
        let k = rng.random_range(0..=i.min(3));
        let mut deps: Vec<u32> = (0..k).map(|_| rng.random_range(i.saturating_sub(4)..i) as u32).collect();
        deps.sort_unstable();
        deps.dedup();
        plan.launches[i].deps = deps;
    }
    plan
}

/// A random policy with random parameters.
pub fn random_policy(rng: &mut SmallRng) -> PolicyConfig {
    match rng.random_range(0..11) {
        9 => {
            use kairos_sched::policy::krisp::RightSizeUnit;
            let green = rng.random_bool(0.5);
            // Right-sized segments (`+runs`, `+model`) come with `+green` only.
            let unit = if green {
                [RightSizeUnit::Kernel, RightSizeUnit::Segment, RightSizeUnit::Model][rng.random_range(0..3)]
            } else {
                RightSizeUnit::Kernel
            };
            PolicyConfig::Krisp {
                overlap_sms: [0, 0, 16, kairos_sched::policy::krisp::OVERLAP_ANY][rng.random_range(0..4)],
                green,
                unit,
            }
        }
        10 => PolicyConfig::Static { partitions: rng.random_range(1..=4), green: rng.random_bool(0.5) },
        7 => {
            // `+runs` and `+stopruns` (best-effort work in recorded segments) a fifth of the time.
            let be_runs = rng.random_bool(0.2);
            let kill = if be_runs { rng.random_bool(0.5) } else { rng.random_bool(0.75) };
            // Stoppable runs with and without the occupancy gate in normal mode.
            let gate_be = !(kill && be_runs) || rng.random_bool(0.5);
            // A hold-off after real-time jobs (`+hold=US`) a fifth of the time.
            let hold_ns = if rng.random_bool(0.2) { [20_000, 200_000][rng.random_range(0..2)] } else { 0 };
            PolicyConfig::Reef { kill, padding: rng.random_bool(0.75), be_runs, gate_be, hold_ns }
        }
        8 => PolicyConfig::Seq,
        6 => PolicyConfig::Edf { slowdown: [0.0, 1.0, 4.0, 100.0][rng.random_range(0..4)], backfill: rng.random_bool(0.5) },
        0 => PolicyConfig::Fifo { jobs_queued: rng.random_range(1..=3) },
        1 => PolicyConfig::Streams { streams: rng.random_range(1..=8), jobs_per_stream: rng.random_range(1..=3) },
        2 => PolicyConfig::StreamsKernel,
        3 => PolicyConfig::Paella {
            fairness_threshold_ns: [0, 10_000, 100_000, 1_000_000, u64::MAX][rng.random_range(0..5)],
            backfill: rng.random_bool(0.5),
            slowdown_bound: [None, None, Some(0.0), Some(1.0), Some(4.0)][rng.random_range(0..5)],
        },
        4 => PolicyConfig::Sjf,
        _ => PolicyConfig::Rr,
    }
}

/// A random dispatcher configuration (swarm testing): small limits make every limit bite.
pub fn random_config(rng: &mut SmallRng, policy: PolicyConfig) -> Config {
    Config {
        policy,
        headroom_ctas: [0, 1, 8, 64, 10_000][rng.random_range(0..5)],
        stream_count: [None, Some(1), Some(2), Some(4), Some(16)][rng.random_range(0..5)],
        jobs_max: [4, 16, 256][rng.random_range(0..3)],
        slots_per_model_max: [1, 2, 8][rng.random_range(0..3)],
        models_max: 8,
        tenants_max: [2, 64][rng.random_range(0..2)],
        launches_in_flight_max: [4, 16, 1024][rng.random_range(0..3)],
        decisions_per_round_max: [1, 7, 1024][rng.random_range(0..3)],
        lookahead_launches_max: [0, 1, 2, 8, 8][rng.random_range(0..5)],
        lookahead_ns: [0, 5_000, 50_000, 50_000, 10_000_000][rng.random_range(0..5)],
        cta_records: rng.random_bool(0.3),
        wake_lead_ns: [0, 50_000][rng.random_range(0..2)],
        trace_max: 1 << 20,
        record_runs: rng.random_bool(0.7),
        run_segment_ns: Some([0, 1_000, 20_000, 200_000][rng.random_range(0..4)]),
        ..Config::default()
    }
}

pub fn random_mini_config(rng: &mut SmallRng, seed: u64) -> mini::MiniConfig {
    mini::MiniConfig {
        sm_count: [1, 2, 4, 8, 16][rng.random_range(0..5)],
        hardware_queues: [1, 2, 8, 32][rng.random_range(0..4)],
        launch_latency_ns: rng.random_range(0..5_000),
        notify_delay_ns: rng.random_range(0..8_000),
        notify_jitter_ns: [0, 3_000][rng.random_range(0..2)],
        // Random plans have at most 16 launches: a whole job always fits.
        launches_in_flight_max: [0, 0, 16, 40][rng.random_range(0..4)],
        lose_one_in: [0, 0, 0, 50][rng.random_range(0..4)],
        seed,
        ..mini::MiniConfig::default()
    }
}

// ------------------------------------------------------------------------------------------
// Audit: a Gpu wrapper that checks and records what the GPU reports.

#[derive(Clone, Debug, Default)]
pub struct LaunchAudit {
    pub logical_blocks: u32,
    pub first_block: u32,
    pub res: Option<KernelResources>,
    pub first_placed_ns: Option<u64>,
    pub done_ns: Option<u64>,
    pub next_block: Option<u32>,
    pub blocks: u64,
    pub live: i64,
    /// What the dispatcher asked for (LaunchRequest::report_ctas); the inner GPU always reports
    /// CTAs to the audit, which passes them on only if asked.
    pub report_ctas: bool,
    /// LaunchRequest::report_start, and when the start was reported.
    pub report_start: bool,
    pub started_ns: Option<u64>,
    /// Reported lost (`GpuEvent::LaunchLost`) instead of done.
    pub lost: bool,
}

#[derive(Default)]
pub struct AuditLog {
    pub launches: HashMap<LaunchId, LaunchAudit>,
    pub sm_use: Vec<[u64; 4]>,
    pub violations: Vec<String>,
    pub max_ctas_on_an_sm: u64,
    pub last_event_ns: u64,
}

pub struct Audit<G: Gpu> {
    pub inner: G,
    pub log: AuditLog,
    /// Recorded runs: per launch, its logical blocks, first block and resources.
    runs: HashMap<RunId, Vec<(u32, u32, KernelResources)>>,
}

impl<G: Gpu> Audit<G> {
    pub fn new(inner: G) -> Audit<G> {
        let sms = inner.info().sm_count as usize;
        Audit { inner, log: AuditLog { sm_use: vec![[0; 4]; sms], ..Default::default() }, runs: HashMap::new() }
    }

    fn check_event(&mut self, e: &GpuEvent) {
        let limits = self.inner.info().sm_limits;
        let log = &mut self.log;
        let at = match *e {
            GpuEvent::CtasPlaced { at_ns, .. }
            | GpuEvent::CtasFinished { at_ns, .. }
            | GpuEvent::LaunchDone { at_ns, .. }
            | GpuEvent::LaunchStarted { at_ns, .. }
            | GpuEvent::LaunchLost { at_ns, .. }
            | GpuEvent::CopyDone { at_ns, .. } => at_ns,
        };
        if at < log.last_event_ns {
            log.violations.push(format!("event {e:?} is older than an event before it ({} ns)", log.last_event_ns));
        }
        log.last_event_ns = log.last_event_ns.max(at);
        match *e {
            GpuEvent::CtasPlaced { launch, sm, ctas, at_ns } => {
                let Some(a) = log.launches.get_mut(&launch) else {
                    log.violations.push(format!("placement of unknown launch {launch:?}"));
                    return;
                };
                a.first_placed_ns.get_or_insert(at_ns);
                a.live += ctas as i64;
                let r = a.res.unwrap();
                let u = &mut log.sm_use[sm as usize];
                let regs = (r.registers_per_thread.max(1) * r.threads_per_cta).next_multiple_of(256);
                u[0] += (r.threads_per_cta * ctas) as u64;
                u[1] += (regs * ctas) as u64;
                u[2] += (r.shared_mem_bytes * ctas) as u64;
                u[3] += ctas as u64;
                log.max_ctas_on_an_sm = log.max_ctas_on_an_sm.max(u[3]);
                if u[0] > limits.threads_max as u64
                    || u[1] > limits.registers_max as u64
                    || u[2] > limits.shared_mem_bytes_max as u64
                    || u[3] > limits.ctas_max as u64
                {
                    log.violations.push(format!("SM {sm} over its limits: {u:?} > {limits:?}"));
                }
            }
            GpuEvent::CtasFinished { launch, sm, ctas, blocks, .. } => {
                let Some(a) = log.launches.get_mut(&launch) else {
                    log.violations.push(format!("completion of unknown launch {launch:?}"));
                    return;
                };
                a.live -= ctas as i64;
                a.blocks += blocks as u64;
                if a.live < 0 {
                    log.violations.push(format!("launch {launch:?} finished more CTAs than it placed"));
                }
                let r = a.res.unwrap();
                let u = &mut log.sm_use[sm as usize];
                let regs = (r.registers_per_thread.max(1) * r.threads_per_cta).next_multiple_of(256);
                u[0] -= (r.threads_per_cta * ctas) as u64;
                u[1] -= (regs * ctas) as u64;
                u[2] -= (r.shared_mem_bytes * ctas) as u64;
                u[3] -= ctas as u64;
            }
            GpuEvent::LaunchDone { launch, next_block, at_ns, .. } => {
                let Some(a) = log.launches.get_mut(&launch) else {
                    log.violations.push(format!("end of unknown launch {launch:?}"));
                    return;
                };
                if a.done_ns.is_some() {
                    log.violations.push(format!("launch {launch:?} ended twice"));
                }
                a.done_ns = Some(at_ns);
                a.next_block = Some(next_block);
                if a.live != 0 {
                    log.violations.push(format!("launch {launch:?} ended with {} CTAs live", a.live));
                }
                if a.blocks != (next_block - a.first_block) as u64 {
                    log.violations
                        .push(format!("launch {launch:?} ran {} blocks but reports {}..{next_block}", a.blocks, a.first_block));
                }
            }
            GpuEvent::LaunchStarted { launch, at_ns } => {
                let Some(a) = log.launches.get_mut(&launch) else {
                    log.violations.push(format!("start of unknown launch {launch:?}"));
                    return;
                };
                if !a.report_start {
                    log.violations.push(format!("launch {launch:?} reported a start it was not asked for"));
                }
                if a.started_ns.is_some() || a.done_ns.is_some() {
                    log.violations.push(format!("launch {launch:?} started twice or after its end"));
                }
                if a.first_placed_ns.is_none_or(|p| p > at_ns) {
                    log.violations.push(format!("launch {launch:?} started before any of its CTAs was placed"));
                }
                a.started_ns = Some(at_ns);
            }
            GpuEvent::LaunchLost { launch, at_ns } => {
                let Some(a) = log.launches.get_mut(&launch) else {
                    log.violations.push(format!("loss of unknown launch {launch:?}"));
                    return;
                };
                if a.done_ns.is_some() {
                    log.violations.push(format!("launch {launch:?} lost after it ended"));
                }
                // It ended where its CTAs stopped; the dispatcher never learns where.
                a.done_ns = Some(at_ns);
                a.next_block = Some(a.first_block + a.blocks as u32);
                a.lost = true;
                if a.live != 0 {
                    log.violations.push(format!("launch {launch:?} lost with {} CTAs live", a.live));
                }
            }
            GpuEvent::CopyDone { .. } => {}
        }
    }
}

impl<G: Gpu> Gpu for Audit<G> {
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }
    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        self.inner.alloc(bytes, kind)
    }
    fn free(&mut self, a: Allocation) -> Result<()> {
        self.inner.free(a)
    }
    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.inner.write(dst, data)
    }
    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.inner.read(src, out)
    }
    fn copy_async(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<CopyId> {
        self.inner.copy_async(dst, src, bytes, stream)
    }
    fn wait_copy(&mut self, stream: StreamId, copy: CopyId) -> Result<()> {
        self.inner.wait_copy(stream, copy)
    }
    fn peer_busy(&self, peer: usize) -> bool {
        self.inner.peer_busy(peer)
    }
    fn peer_paths(&self) -> Vec<PeerPath> {
        self.inner.peer_paths()
    }
    fn copy_via_peer(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, peer: usize) -> Result<CopyId> {
        self.inner.copy_via_peer(dst, src, bytes, peer)
    }
    fn create_stream(&mut self, priority: i32) -> Result<StreamId> {
        self.inner.create_stream(priority)
    }
    fn destroy_stream(&mut self, stream: StreamId) -> Result<()> {
        self.inner.destroy_stream(stream)
    }
    fn kernel_resources(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> Result<KernelResources> {
        self.inner.kernel_resources(kernel, dtype, shape)
    }
    fn launch(&mut self, r: &LaunchRequest<'_>) -> Result<LaunchId> {
        let res = self.inner.kernel_resources(r.kernel, r.dtype, &r.shape)?;
        // The audit sees every CTA (it checks SM limits and blocks run); the dispatcher gets
        // only the events it asked for (see `poll`).
        let id = self.inner.launch(&LaunchRequest { report_ctas: true, ..*r })?;
        if r.first_block >= r.shape.logical_blocks {
            self.log.violations.push(format!("launch {id:?} starts at block {} of {}", r.first_block, r.shape.logical_blocks));
        }
        self.log.launches.insert(
            id,
            LaunchAudit {
                logical_blocks: r.shape.logical_blocks,
                first_block: r.first_block,
                res: Some(res),
                report_ctas: r.report_ctas,
                report_start: r.report_start,
                ..Default::default()
            },
        );
        Ok(id)
    }
    fn record_run(&mut self, launches: &[LaunchRequest<'_>]) -> Result<RunId> {
        let mut audited = Vec::with_capacity(launches.len());
        for r in launches {
            if r.preemptible || r.report_ctas || r.report_start || r.report_end || r.after.is_some() {
                self.log.violations.push(format!("a run records a launch that is preemptible, gated or reports itself: {r:?}"));
            }
            let res = self.inner.kernel_resources(r.kernel, r.dtype, &r.shape)?;
            audited.push((r.shape.logical_blocks, r.first_block, res));
        }
        // The audit sees every CTA (the simulator reports a run's CTAs when asked to).
        let reporting: Vec<LaunchRequest<'_>> = launches.iter().map(|r| LaunchRequest { report_ctas: true, ..*r }).collect();
        let run = self.inner.record_run(&reporting)?;
        self.runs.insert(run, audited);
        Ok(run)
    }
    fn launch_run(&mut self, run: RunId, stream: StreamId, ids: &mut Vec<LaunchId>) -> Result<()> {
        let start = ids.len();
        let result = self.inner.launch_run(run, stream, ids);
        let audited = &self.runs[&run];
        for (&id, &(logical_blocks, first_block, res)) in ids[start..].iter().zip(audited) {
            self.log.launches.insert(
                id,
                LaunchAudit {
                    logical_blocks,
                    first_block,
                    res: Some(res),
                    report_ctas: false,
                    report_start: false,
                    ..Default::default()
                },
            );
        }
        result
    }
    fn drop_run(&mut self, run: RunId) -> Result<()> {
        self.runs.remove(&run);
        self.inner.drop_run(run)
    }
    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        self.inner.preempt(launch)
    }
    fn sm_groups(&self) -> Vec<SmMask> {
        self.inner.sm_groups()
    }
    fn partition_of_groups(&mut self, groups: u64) -> Result<PartitionId> {
        self.inner.partition_of_groups(groups)
    }
    fn reset(&mut self) -> Result<()> {
        self.inner.reset()?;
        // Everything on the device is gone: launches in flight ended where they were.
        let now = self.inner.now_ns();
        self.log.sm_use.iter_mut().for_each(|u| *u = [0; 4]);
        for a in self.log.launches.values_mut().filter(|a| a.done_ns.is_none()) {
            a.done_ns = Some(now);
            a.next_block = Some(a.first_block + a.blocks as u32);
            a.lost = true;
            a.live = 0;
        }
        Ok(())
    }
    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        let start = events.len();
        self.inner.poll(events)?;
        for e in &events[start..] {
            self.check_event(e);
        }
        let launches = &self.log.launches;
        let asked = |e: &GpuEvent| match *e {
            GpuEvent::CtasPlaced { launch, .. } | GpuEvent::CtasFinished { launch, .. } => {
                launches.get(&launch).is_none_or(|a| a.report_ctas)
            }
            _ => true,
        };
        let fresh: Vec<GpuEvent> = events.drain(start..).filter(asked).collect();
        events.extend(fresh);
        Ok(())
    }
    fn wait(&mut self, until_ns: u64) -> Result<()> {
        self.inner.wait(until_ns)
    }
    fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping> {
        self.inner.map_host(memory)
    }
    fn unmap_host(&mut self, id: HostMappingId) -> Result<()> {
        self.inner.unmap_host(id)
    }
}

/// Checks a finished run: every logical block of every completed request ran exactly once
/// (at most once for failed ones), resumes were exact, and every launch started only after the
/// launches it depends on ended. `plans` maps a request to its plan; `ok` says whether it completed.
pub fn check_blocks_and_deps(
    trace: &[IssueRecord],
    log: &AuditLog,
    plan_of: &dyn Fn(RequestId) -> Arc<Plan>,
    ok: &dyn Fn(RequestId) -> bool,
) {
    let mut by_launch: HashMap<(RequestId, u32), Vec<&IssueRecord>> = HashMap::new();
    for r in trace {
        by_launch.entry((r.request, r.launch)).or_default().push(r);
    }
    for ((req, li), issues) in &by_launch {
        let plan = plan_of(*req);
        let logical = plan.launches[*li as usize].shape.logical_blocks;
        let mut expect_first = 0;
        let mut blocks = 0u64;
        for r in issues {
            let a = &log.launches[&r.gpu_launch];
            assert_eq!(
                r.first_block, expect_first,
                "request {req:?} launch {li}: resumed at {} after {expect_first}",
                r.first_block
            );
            let next =
                a.next_block.unwrap_or_else(|| panic!("request {req:?} launch {li}: GPU launch {:?} never ended", r.gpu_launch));
            expect_first = next;
            blocks += a.blocks;
        }
        if ok(*req) {
            assert_eq!(blocks, logical as u64, "request {req:?} launch {li}: {blocks} of {logical} blocks ran");
        } else {
            assert!(blocks <= logical as u64, "request {req:?} launch {li}: {blocks} blocks ran, it has {logical}");
        }
        // Dependencies: the first placement of this launch follows the end of each dependency.
        // (A launch its stream gate stopped ran no block: its CTAs came and left.)
        let first_placed =
            issues.iter().map(|r| &log.launches[&r.gpu_launch]).filter(|a| a.blocks > 0).filter_map(|a| a.first_placed_ns).min();
        if let Some(start) = first_placed {
            for &d in &plan.launches[*li as usize].deps {
                let dep = by_launch
                    .get(&(*req, d))
                    .unwrap_or_else(|| panic!("request {req:?}: launch {li} ran but its dependency {d} was never issued"));
                let dep_end = dep.iter().filter_map(|r| log.launches[&r.gpu_launch].done_ns).max().unwrap();
                assert!(
                    start >= dep_end,
                    "request {req:?}: launch {li} started at {start} before its dependency {d} ended at {dep_end}"
                );
                let dep_next = log.launches[&dep.last().unwrap().gpu_launch].next_block.unwrap();
                assert_eq!(
                    dep_next, plan.launches[d as usize].shape.logical_blocks,
                    "request {req:?}: launch {li} ran after an unfinished dependency {d}"
                );
            }
        }
    }
    // Completed requests issued every launch.
    let mut reqs: Vec<RequestId> = by_launch.keys().map(|k| k.0).collect();
    reqs.sort();
    reqs.dedup();
    for req in reqs {
        if ok(req) {
            let n = plan_of(req).launches.len() as u32;
            for li in 0..n {
                assert!(by_launch.contains_key(&(req, li)), "completed request {req:?} never issued launch {li}");
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Policy wrappers that check every decision against the view it was made from.

pub type Violations = Arc<Mutex<Vec<String>>>;

#[derive(Debug)]
pub struct Checked {
    pub inner: Box<dyn Policy>,
    pub config: PolicyConfig,
    pub violations: Arc<Mutex<Vec<String>>>,
    pub decisions: Arc<Mutex<u64>>,
}

impl Checked {
    pub fn new(config: PolicyConfig) -> (Checked, Violations, Arc<Mutex<u64>>) {
        let v = Arc::new(Mutex::new(Vec::new()));
        let d = Arc::new(Mutex::new(0));
        (Checked { inner: config.build(), config, violations: v.clone(), decisions: d.clone() }, v, d)
    }
}

impl Policy for Checked {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn preempts(&self) -> bool {
        self.inner.preempts()
    }

    fn preempts_class(&self, class: kairos_sched::Class) -> bool {
        self.inner.preempts_class(class)
    }

    fn stops_runs(&self, class: kairos_sched::Class) -> bool {
        self.inner.stops_runs(class)
    }

    fn holds(&self) -> bool {
        self.inner.holds()
    }

    fn wake_at_ns(&self, view: &View<'_>) -> Option<u64> {
        self.inner.wake_at_ns(view)
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let d = self.inner.decide(view)?;
        *self.decisions.lock().unwrap() += 1;
        let bad = |m: String| self.violations.lock().unwrap().push(m);
        match d {
            Decision::Issue { job, launch, .. } => {
                let Some(j) = view.jobs.iter().find(|j| j.key == job) else {
                    bad(format!("{}: issue for a job not in the view", self.name()));
                    return Some(d);
                };
                let Some(k) = j.next_ready.filter(|k| k.launch == launch) else {
                    bad(format!("{}: issue of launch {launch} which is not the job's next ready kernel", self.name()));
                    return Some(d);
                };
                if !self.config.is_kernel_level() {
                    bad(format!("{}: a whole-job policy issued a single kernel", self.name()));
                }
                let gated = matches!(
                    self.config,
                    PolicyConfig::Paella { .. } | PolicyConfig::Edf { .. } | PolicyConfig::Sjf | PolicyConfig::Rr
                );
                if gated && !view.gpu.fits(&k) {
                    bad(format!("{}: issued a kernel that does not pass the occupancy gate", self.name()));
                }
                if let PolicyConfig::Krisp { overlap_sms: param, .. } | PolicyConfig::Static { partitions: param, .. } =
                    self.config
                {
                    // Right-sized: a mask of whole SM groups, no larger than the kernel's right size
                    // (in groups); KRISP-I: no group of it runs another job's launch.
                    use kairos_sched::occupancy::{GROUP_SMS, group_count_of, groups_of};
                    let Decision::Issue { ctas, sm_mask, .. } = d else { unreachable!() };
                    let sm_count = view.gpu.occupancy.sm_count();
                    let n = group_count_of(sm_count).min(32);
                    match sm_mask {
                        Some(m)
                            if kairos_sched::policy::krisp::is_group_union(&m, sm_count) && !m.is_empty() && ctas.is_none() =>
                        {
                            let g = groups_of(&m);
                            if let PolicyConfig::Krisp { .. } = self.config {
                                // A window may take a last group smaller than GROUP_SMS with it.
                                let small_last =
                                    n > 0 && g & (1 << (n - 1)) != 0 && sm_count.saturating_sub((n - 1) * GROUP_SMS) < GROUP_SMS;
                                if g.count_ones() > k.right_sms.div_ceil(GROUP_SMS).clamp(1, n) + small_last as u32 {
                                    bad(format!(
                                        "krisp: {} groups for a kernel of right size {} SMs",
                                        g.count_ones(),
                                        k.right_sms
                                    ));
                                }
                                let shared: u32 = (0..n)
                                    .filter(|&i| g & (1 << i) != 0)
                                    .filter(|&i| view.gpu.group_jobs[i as usize] > (k.lane_groups >> i) & 1)
                                    .map(|i| sm_count.saturating_sub(i * GROUP_SMS).min(GROUP_SMS))
                                    .sum();
                                if shared > param {
                                    bad(format!("krisp: {shared} SMs shared with other jobs' launches, limit {param}"));
                                }
                            } else {
                                let parts = param.clamp(1, n);
                                if !(0..parts)
                                    .any(|p| kairos_sched::policy::krisp::StaticPartitions::partition_groups(p, parts, n) == g)
                                {
                                    bad(format!("static: mask {m:?} is not one of the {parts} partitions"));
                                }
                            }
                        }
                        other => bad(format!("{}: kernel issued without a group mask ({other:?}, ctas {ctas:?})", self.name())),
                    }
                }
                if let PolicyConfig::Reef { padding, gate_be, hold_ns, .. } = self.config {
                    use kairos_sched::Class;
                    let rt: Vec<_> = view.jobs.iter().filter(|o| o.class == Class::RealTime && !o.cancelled).collect();
                    let Decision::Issue { ctas, sm_mask, .. } = d else { unreachable!() };
                    if j.class == Class::RealTime {
                        if ctas.is_some() || sm_mask.is_some() {
                            bad("reef: a real-time kernel was right-sized or masked".into());
                        }
                    } else if rt.is_empty() {
                        let last = view.last_realtime_done_ns;
                        if hold_ns > 0 && last > 0 && view.now_ns < last.saturating_add(hold_ns) {
                            bad(format!(
                                "reef: a best-effort kernel issued {} ns into the {hold_ns} ns hold-off",
                                view.now_ns - last
                            ));
                        }
                        if gate_be && !view.gpu.fits(&k) {
                            bad("reef: a best-effort kernel in normal mode does not pass the gate".into());
                        }
                    } else {
                        // Real-time mode: best-effort only as padding, above the widest RT launch.
                        let widest = rt.iter().map(|o| o.widest_sms).max().unwrap_or(0);
                        let first = kairos_sched::policy::reef::Reef::padding_first_sm(widest);
                        let ok_mask = sm_mask.is_some_and(|m| m.iter().all(|sm| sm >= first) && !m.is_empty());
                        if !padding || !ok_mask || ctas.is_none() {
                            bad(format!("reef: best-effort kernel issued in real-time mode outside padding (mask {sm_mask:?})"));
                        }
                        if rt.iter().any(|o| o.next_ready.is_some_and(|rk| view.gpu.can_issue(&rk) && view.gpu.fits(&rk))) {
                            bad("reef: padding went before a real-time kernel that could go".into());
                        }
                    }
                }
                if let PolicyConfig::Paella { fairness_threshold_ns, backfill, slowdown_bound } = self.config {
                    // With backfill, only kernels that pass the gate compete.
                    let competes =
                        |k: &kairos_sched::policy::ReadyKernel| !backfill || (view.gpu.can_issue(k) && view.gpu.fits(k));
                    // Fairness: among jobs of the same class and priority, a tenant owed more than the
                    // threshold goes first.
                    let owed = view
                        .tenants
                        .iter()
                        .filter(|t| {
                            t.ready_jobs > 0 && fairness_threshold_ns != u64::MAX && t.deficit_ns > fairness_threshold_ns as f64
                        })
                        .max_by(|a, b| a.deficit_ns.total_cmp(&b.deficit_ns).then(b.tenant.cmp(&a.tenant)));
                    if let Some(t) = owed
                        && j.tenant != t.tenant
                        && view.jobs.iter().any(|o| {
                            o.tenant == t.tenant
                                && o.next_ready.is_some_and(|k| competes(&k))
                                && o.class == j.class
                                && o.priority == j.priority
                        })
                    {
                        bad(format!(
                            "paella: tenant {:?} owed {} ns (> threshold {fairness_threshold_ns}) but tenant {:?} was served",
                            t.tenant, t.deficit_ns, j.tenant
                        ));
                    }
                    // The starvation bound within the served tenant: an overdue job (in the system
                    // for S times its size) before any that is not, the earliest overdue first.
                    let overdue_at = |o: &kairos_sched::policy::JobView| {
                        slowdown_bound.and_then(|s| {
                            let at = o.arrival_ns.saturating_add((s * o.total_ns as f64) as u64);
                            (view.now_ns >= at).then_some(at)
                        })
                    };
                    let peer = |o: &kairos_sched::policy::JobView| {
                        o.next_ready.is_some() && o.tenant == j.tenant && o.class == j.class && o.priority == j.priority
                    };
                    if !backfill
                        && let Some(earlier) = view
                            .jobs
                            .iter()
                            .find(|o| peer(o) && overdue_at(o).is_some_and(|at| overdue_at(j).is_none_or(|mine| at < mine)))
                    {
                        bad(format!(
                            "paella+bound: job {:?} overdue since {:?} ns was passed over for one overdue since {:?}",
                            earlier.id,
                            overdue_at(earlier),
                            overdue_at(j)
                        ));
                    }
                    // SRPT within the served tenant (among jobs not overdue).
                    if let Some(shorter) =
                        view.jobs.iter().find(|o| peer(o) && overdue_at(j).is_none() && o.remaining_ns < j.remaining_ns)
                        && !backfill
                    {
                        bad(format!(
                            "paella: job {:?} with {} ns left was passed over for one with {} ns",
                            shorter.id, shorter.remaining_ns, j.remaining_ns
                        ));
                    }
                }
            }
            Decision::Preempt { job, launch } => {
                // Only `reef` with kill preempts: a best-effort job's running launch issued before
                // a real-time job still admitted was (not padding issued since).
                let PolicyConfig::Reef { kill: true, .. } = self.config else {
                    bad(format!("{}: preempted, but only reef (with kill) preempts", self.name()));
                    return Some(d);
                };
                let target = view.jobs.iter().find(|j| j.key == job);
                if !target.is_some_and(|j| j.class == kairos_sched::Class::BestEffort && j.running == Some(launch)) {
                    bad(format!("reef: preempted launch {launch}, not a best-effort job's running launch"));
                }
                let issued_seq = target.map_or(0, |j| j.running_issue_seq);
                if !view
                    .jobs
                    .iter()
                    .any(|j| j.class == kairos_sched::Class::RealTime && !j.cancelled && j.admitted_issue_seq >= issued_seq)
                {
                    bad("reef: preempted a launch issued after every real-time job still admitted".into());
                }
            }
            Decision::IssueAll { job, .. } => {
                if self.config.is_kernel_level() {
                    bad(format!("{}: a kernel-level policy issued a whole job", self.name()));
                }
                if !view.jobs.iter().any(|j| j.key == job && j.is_unstarted()) {
                    bad(format!("{}: IssueAll of a job that is not unstarted", self.name()));
                }
                if self.config == PolicyConfig::Seq {
                    // One job on the GPU at a time; an arrived real-time job before any best-effort one.
                    if view.gpu.streams.first().is_some_and(|s| s.jobs > 0) {
                        bad("seq: a second job on the GPU".into());
                    }
                    let this = view.jobs.iter().find(|j| j.key == job);
                    if this.is_some_and(|j| j.class != kairos_sched::Class::RealTime)
                        && view.jobs.iter().any(|o| o.is_unstarted() && o.class == kairos_sched::Class::RealTime)
                    {
                        bad("seq: a best-effort job went before an unstarted real-time one".into());
                    }
                }
            }
        }
        Some(d)
    }
}

/// Wraps a policy and, before asking it, preempts a running launch now and then (at most
/// `budget` times per run), so the dispatcher's resume path runs in the swarm.
#[derive(Debug)]
pub struct Preempting {
    inner: Box<dyn Policy>,
    budget: Mutex<u32>,
}

impl Preempting {
    pub fn new(inner: Box<dyn Policy>, budget: u32) -> Preempting {
        Preempting { inner, budget: Mutex::new(budget) }
    }
}

impl Policy for Preempting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn preempts(&self) -> bool {
        true
    }

    fn holds(&self) -> bool {
        self.inner.holds()
    }

    fn wake_at_ns(&self, view: &View<'_>) -> Option<u64> {
        self.inner.wake_at_ns(view)
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let mut budget = self.budget.lock().unwrap();
        if *budget > 0
            && (view.now_ns / 1000).is_multiple_of(7)
            && let Some(j) = view
                .jobs
                .iter()
                .filter(|j| j.running.is_some())
                .min_by_key(|j| (j.seq.wrapping_mul(2654435761) ^ view.now_ns) % 97)
        {
            *budget -= 1;
            return Some(Decision::Preempt { job: j.key, launch: j.running.unwrap() });
        }
        drop(budget);
        self.inner.decide(view)
    }
}

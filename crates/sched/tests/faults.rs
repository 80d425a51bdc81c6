//! Fault injection: the dispatcher, with recovery on (as the threaded engine runs it), on a
//! simulated GPU that loses, delays, duplicates and reorders its notifications, overflows its
//! ring, fails launch calls, runs kernels slowly, hangs them and faults for good (a sticky error).
//! Every seed draws its own mix of faults (some seeds none) and checks, from the simulator's own
//! record rather than from the notifications it garbled:
//!
//! - every request gets exactly one answer, a result or an error it may get (a fault's error, its
//!   cancellation, overload), and a request not touched by a fault is served;
//! - no logical block of any request runs twice, and a request served ran each of its blocks once;
//! - no SM ever holds more than its limits (the simulator audits itself);
//! - the dispatcher recovers: with the faults switched off afterwards, every new request is served,
//!   and nothing is left held or in flight.
//!
//! `KAIROS_SEED=<seed> cargo test -p kairos-sched --test faults` reruns one seed;
//! `KAIROS_SWARM_SEEDS=n` runs n seeds; `KAIROS_FAULTS_OFF=late,sticky` reruns it without those.

mod common;

use common::*;
use kairos_gpu::Gpu;
use kairos_ir::plan::Plan;
use kairos_sched::*;
use kairos_sim::{Faults, GpuDesc, SimGpu, SimOptions, TraceEvent};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// CI's seed count: the issue asks for at least 1000.
const SEEDS: u64 = 1000;
/// The watchdog's bound in these runs (virtual time): far above any queueing of these workloads,
/// far below a hung kernel.
const WATCHDOG_NS: u64 = 50_000_000;

fn pick<T: Copy>(rng: &mut SmallRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

fn random_faults(rng: &mut SmallRng) -> Faults {
    if rng.random_bool(0.15) {
        return Faults::none();
    }
    Faults {
        lose_launch: pick(rng, &[0.0, 0.0, 0.005, 0.05]),
        ring_overflow: pick(rng, &[0.0, 0.0, 0.0005, 0.005]),
        duplicate: pick(rng, &[0.0, 0.0, 0.01, 0.1]),
        late: pick(rng, &[0.0, 0.0, 0.01, 0.1]),
        late_ns_max: pick(rng, &[1_000, 50_000]),
        launch_failure: pick(rng, &[0.0, 0.0, 0.005, 0.03]),
        slow: pick(rng, &[0.0, 0.05]),
        slow_factor: pick(rng, &[2.0, 30.0]),
        stuck: pick(rng, &[0.0, 0.0, 0.002, 0.01]),
        sticky: pick(rng, &[0.0, 0.0, 0.002, 0.01]),
    }
}

/// An error a request may get on a faulty GPU.
fn fault_error(e: &Error) -> bool {
    match e {
        Error::GpuFailed(_) => true,
        // Its launch was lost (ring), or the launch call failed (injected, or the sticky fault
        // before the dispatcher noticed it).
        Error::Gpu(m) => m.contains("was lost") || m.contains("injected"),
        _ => false,
    }
}

#[test]
fn swarm_with_faults() {
    let started = std::time::Instant::now();
    let (mut served, mut failed, mut recoveries, mut injected) = (0u64, 0u64, 0u64, 0u64);
    let all = seeds(SEEDS);
    for &seed in &all {
        with_seed("swarm_with_faults", seed, |seed| {
            let r = run_one(seed);
            served += r.0;
            failed += r.1;
            recoveries += r.2;
            injected += r.3;
        });
    }
    eprintln!(
        "swarm_with_faults: {} seeds in {:.1} s: {injected} faults injected, {recoveries} GPU resets, {served} requests served, {failed} failed by a fault",
        all.len(),
        started.elapsed().as_secs_f64()
    );
}

/// One seed; returns (served, failed by a fault, resets, faults injected).
fn run_one(seed: u64) -> (u64, u64, u64, u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let descs = GpuDesc::builtin();
    let mut desc = descs[rng.random_range(0..descs.len())].clone();
    desc.hardware_queues = pick(&mut rng, &[1, 8, 32]);
    let mut faults = random_faults(&mut rng);
    // KAIROS_FAULTS_OFF=late,sticky,...: the same seed with those faults off (to find which one a
    // failure needs; the seed's other draws stay the same).
    for off in std::env::var("KAIROS_FAULTS_OFF").unwrap_or_default().split(',').filter(|s| !s.is_empty()) {
        let p = match off {
            "lose_launch" => &mut faults.lose_launch,
            "ring_overflow" => &mut faults.ring_overflow,
            "duplicate" => &mut faults.duplicate,
            "late" => &mut faults.late,
            "launch_failure" => &mut faults.launch_failure,
            "slow" => &mut faults.slow,
            "stuck" => &mut faults.stuck,
            "sticky" => &mut faults.sticky,
            other => panic!("KAIROS_FAULTS_OFF: unknown fault '{other}'"),
        };
        *p = 0.0;
    }
    let opts = SimOptions {
        seed,
        compute: false,
        jitter: rng.random_bool(0.8),
        record_trace: true,
        check_invariants: rng.random_bool(0.1),
        faults: faults.clone(),
    };
    let policy = random_policy(&mut rng);
    let mut cfg = random_config(&mut rng, policy);
    cfg.watchdog_ns_min = WATCHDOG_NS;
    eprintln!("  policy {}, {faults:?}", cfg.policy);
    let mut driver = VirtualDriver::new(cfg, SimGpu::new(desc, opts)).unwrap();
    driver.set_checks(true);
    driver.set_recover(true);

    let models = rng.random_range(1..=3);
    let mut plans: Vec<Arc<Plan>> = Vec::new();
    for m in 0..models {
        let plan = Arc::new(random_plan(&mut rng, &format!("m{m}")));
        driver.load_model(ModelSpec { name: format!("m{m}"), plan: plan.clone(), profile: None }).unwrap();
        plans.push(plan);
    }
    let mut plan_of: HashMap<RequestId, Arc<Plan>> = HashMap::new();
    let mut cancelled: HashSet<RequestId> = HashSet::new();
    let mut t = 0u64;
    let submit = |driver: &mut VirtualDriver<SimGpu>, rng: &mut SmallRng, t: u64, plan_of: &mut HashMap<RequestId, Arc<Plan>>| {
        let m = rng.random_range(0..models);
        let options = RequestOptions {
            tenant: TenantId(rng.random_range(0..4)),
            class: if rng.random_bool(0.2) { Class::RealTime } else { Class::BestEffort },
            skip_io: true,
            ..RequestOptions::default()
        };
        let id = driver.submit_at(t, &format!("m{m}"), vec![], options);
        plan_of.insert(id, plans[m].clone());
        id
    };
    for _ in 0..rng.random_range(1..=60) {
        t += rng.random_range(0..60_000);
        let id = submit(&mut driver, &mut rng, t, &mut plan_of);
        if rng.random_bool(0.1) {
            driver.cancel_at(t + rng.random_range(0..300_000), id);
            cancelled.insert(id);
        }
    }
    driver.run_until_idle().unwrap_or_else(|e| panic!("run with faults failed: {e}"));

    // The faults stop; the dispatcher serves again.
    driver.dispatcher_mut().gpu_mut().set_faults(Faults::none()).unwrap();
    // One at a time, so that the random (small) limits cannot refuse them.
    let mut after = Vec::new();
    for _ in 0..5 {
        let at = driver.now_ns() + 1_000;
        after.push(submit(&mut driver, &mut rng, at, &mut plan_of));
        driver.run_until_idle().unwrap_or_else(|e| panic!("run after the faults failed: {e}"));
    }

    let d = driver.dispatcher();
    let stats = d.stats();
    let sim_stats = d.gpu().stats();
    let faulty = sim_stats.faults_injected > 0;
    assert_eq!((d.jobs(), d.launches_in_flight()), (0, 0), "requests or launches left behind");

    // Exactly one answer per request, each an allowed one.
    let records = driver.records();
    let mut answered = HashSet::new();
    let mut ok = HashSet::new();
    let mut failed = 0;
    for r in records {
        assert!(answered.insert(r.id), "request {:?} answered twice", r.id);
        match &r.result {
            Ok(_) => {
                ok.insert(r.id);
            }
            Err(Error::Cancelled) => assert!(cancelled.contains(&r.id), "request {:?} cancelled without a cancel", r.id),
            Err(Error::Overloaded { .. }) => {}
            Err(e) if faulty && fault_error(e) => failed += 1,
            Err(e) => panic!("request {:?} failed: {e}", r.id),
        }
    }
    assert_eq!(answered.len(), plan_of.len(), "requests without an answer");
    for id in &after {
        let r = records.iter().find(|r| r.id == *id).map(|r| &r.result);
        assert!(ok.contains(id), "request {id:?} after the faults was not served ({r:?}): the dispatcher did not recover");
    }
    if !faulty {
        assert_eq!(stats.gpu_recoveries, 0, "a reset without a fault");
        assert_eq!(failed, 0);
    }
    // Duplicated and reordered notifications can show the policy a job a step behind the GPU: the
    // dispatcher refuses what does not hold (its safety net), and nothing else may make it refuse.
    if faults.duplicate == 0.0 && faults.late == 0.0 {
        assert_eq!(stats.refused_decisions, 0, "the dispatcher refused policy decisions");
    }
    assert_eq!(sim_stats.resets, stats.gpu_recoveries);

    // No block twice; each block of a served request once. The simulator's trace says which
    // blocks each GPU launch took; the dispatcher's, which request's launch it was.
    assert_eq!(stats.trace_dropped, 0);
    let owner: HashMap<u64, (RequestId, u32)> = d.trace().iter().map(|r| (r.gpu_launch.0, (r.request, r.launch))).collect();
    let mut ran: HashMap<(RequestId, u32), Vec<(u32, u32)>> = HashMap::new();
    for e in d.gpu().trace() {
        if let TraceEvent::Take { launch, first, count, .. } = *e {
            let key = owner.get(&launch.0).unwrap_or_else(|| panic!("GPU launch {launch:?} not issued by the dispatcher"));
            ran.entry(*key).or_default().push((first, first + count));
        }
    }
    for ((request, launch), mut ranges) in ran {
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "request {request:?} launch {launch}: blocks {:?} and {:?} both ran", w[0], w[1]);
        }
        if ok.contains(&request) {
            let blocks: u32 = ranges.iter().map(|r| r.1 - r.0).sum();
            let want = plan_of[&request].launches[launch as usize].shape.logical_blocks;
            assert_eq!(blocks, want, "request {request:?} launch {launch}: {blocks} blocks ran of {want}");
        }
    }
    d.gpu().audit().unwrap();
    eprintln!(
        "  {} requests: {} served, {failed} failed by a fault; {} faults injected, {} resets ({} by the watchdog), {} launches lost",
        records.len(),
        ok.len(),
        sim_stats.faults_injected,
        stats.gpu_recoveries,
        stats.watchdog_expiries,
        stats.launches_lost
    );
    (ok.len() as u64, failed, stats.gpu_recoveries, sim_stats.faults_injected)
}

/// A simulated GPU whose next poll fails once `trip` is set (a sticky fault, as the CUDA backend
/// reports one), until it is reset.
struct Trippable {
    inner: SimGpu,
    trip: Arc<std::sync::atomic::AtomicBool>,
    /// The reset fails too (as a CUDA device with a sticky error does).
    reset_fails: bool,
    /// A reset takes this long (CUDA's waits for the kernels still running).
    reset_delay: std::time::Duration,
    /// Resets called.
    resets: Arc<std::sync::atomic::AtomicU64>,
}

impl Gpu for Trippable {
    fn info(&self) -> &kairos_gpu::DeviceInfo {
        self.inner.info()
    }
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }
    fn alloc(&mut self, bytes: u64, kind: kairos_gpu::MemKind) -> kairos_gpu::Result<kairos_gpu::Allocation> {
        self.inner.alloc(bytes, kind)
    }
    fn free(&mut self, a: kairos_gpu::Allocation) -> kairos_gpu::Result<()> {
        self.inner.free(a)
    }
    fn write(&mut self, dst: kairos_gpu::DevicePtr, data: &[u8]) -> kairos_gpu::Result<()> {
        self.inner.write(dst, data)
    }
    fn read(&mut self, src: kairos_gpu::DevicePtr, out: &mut [u8]) -> kairos_gpu::Result<()> {
        self.inner.read(src, out)
    }
    fn copy_async(
        &mut self,
        dst: kairos_gpu::DevicePtr,
        src: kairos_gpu::DevicePtr,
        bytes: u64,
        stream: kairos_gpu::StreamId,
    ) -> kairos_gpu::Result<kairos_gpu::CopyId> {
        self.inner.copy_async(dst, src, bytes, stream)
    }
    fn wait_copy(&mut self, stream: kairos_gpu::StreamId, copy: kairos_gpu::CopyId) -> kairos_gpu::Result<()> {
        self.inner.wait_copy(stream, copy)
    }
    fn peer_busy(&self, peer: usize) -> bool {
        self.inner.peer_busy(peer)
    }
    fn peer_paths(&self) -> Vec<kairos_gpu::PeerPath> {
        self.inner.peer_paths()
    }
    fn copy_via_peer(
        &mut self,
        dst: kairos_gpu::DevicePtr,
        src: kairos_gpu::DevicePtr,
        bytes: u64,
        peer: usize,
    ) -> kairos_gpu::Result<kairos_gpu::CopyId> {
        self.inner.copy_via_peer(dst, src, bytes, peer)
    }
    fn create_stream(&mut self, priority: i32) -> kairos_gpu::Result<kairos_gpu::StreamId> {
        self.inner.create_stream(priority)
    }
    fn destroy_stream(&mut self, stream: kairos_gpu::StreamId) -> kairos_gpu::Result<()> {
        self.inner.destroy_stream(stream)
    }
    fn kernel_resources(
        &mut self,
        kernel: &kairos_ir::plan::Kernel,
        dtype: kairos_ir::DType,
        shape: &kairos_ir::plan::LaunchShape,
    ) -> kairos_gpu::Result<kairos_gpu::KernelResources> {
        self.inner.kernel_resources(kernel, dtype, shape)
    }
    fn launch(&mut self, r: &kairos_gpu::LaunchRequest<'_>) -> kairos_gpu::Result<kairos_gpu::LaunchId> {
        self.inner.launch(r)
    }
    fn record_run(&mut self, launches: &[kairos_gpu::LaunchRequest<'_>]) -> kairos_gpu::Result<kairos_gpu::RunId> {
        self.inner.record_run(launches)
    }
    fn launch_run(
        &mut self,
        run: kairos_gpu::RunId,
        stream: kairos_gpu::StreamId,
        ids: &mut Vec<kairos_gpu::LaunchId>,
    ) -> kairos_gpu::Result<()> {
        self.inner.launch_run(run, stream, ids)
    }
    fn drop_run(&mut self, run: kairos_gpu::RunId) -> kairos_gpu::Result<()> {
        self.inner.drop_run(run)
    }
    fn preempt(&mut self, launch: kairos_gpu::LaunchId) -> kairos_gpu::Result<()> {
        self.inner.preempt(launch)
    }
    fn poll(&mut self, events: &mut Vec<kairos_gpu::GpuEvent>) -> kairos_gpu::Result<()> {
        if self.trip.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(kairos_gpu::GpuError::Driver("an illegal memory access was encountered (test fault)".into()));
        }
        self.inner.poll(events)
    }
    fn wait(&mut self, until_ns: u64) -> kairos_gpu::Result<()> {
        self.inner.wait(until_ns)
    }
    fn reset(&mut self) -> kairos_gpu::Result<()> {
        self.resets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(self.reset_delay);
        if self.reset_fails {
            return Err(kairos_gpu::GpuError::Driver("the error is sticky (test fault)".into()));
        }
        self.trip.store(false, std::sync::atomic::Ordering::SeqCst);
        self.inner.reset()
    }
}

/// An engine over a [`Trippable`] simulated H100 with one random model "m" loaded; the switch
/// that makes its GPU fail.
fn trippable_engine(seed: u64, reset_fails: bool) -> (Engine, Arc<std::sync::atomic::AtomicBool>, Arc<Plan>) {
    let (engine, trip, plan, _) = trippable_engine_with(seed, reset_fails, std::time::Duration::ZERO, EngineConfig::default());
    (engine, trip, plan)
}

/// [`trippable_engine`] with a reset that takes `reset_delay`, an engine configuration, and the
/// count of resets called.
fn trippable_engine_with(
    seed: u64,
    reset_fails: bool,
    reset_delay: std::time::Duration,
    cfg: EngineConfig,
) -> (Engine, Arc<std::sync::atomic::AtomicBool>, Arc<Plan>, Arc<std::sync::atomic::AtomicU64>) {
    let trip = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let resets = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (gpu_trip, gpu_resets) = (trip.clone(), resets.clone());
    let engine = Engine::start(cfg, move || {
        let inner = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed, ..SimOptions::default() });
        Ok(Trippable { inner, trip: gpu_trip, reset_fails, reset_delay, resets: gpu_resets })
    })
    .unwrap();
    let plan = Arc::new(random_plan(&mut SmallRng::seed_from_u64(seed), "m"));
    engine.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
    (engine, trip, plan, resets)
}

/// Why the engine stopped, waiting for it 10 s at most.
fn stopped_within_10_s(engine: &Engine) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(why) = engine.stopped() {
            return why;
        }
        assert!(std::time::Instant::now() < deadline, "the engine neither recovered nor stopped");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Each request in flight at the test fault is answered within 10 s: served, or failed by it.
fn served_or_failed_by_the_fault(handles: Vec<kairos_sched::RequestHandle>) {
    for h in handles {
        match h.wait_timeout(std::time::Duration::from_secs(10)).expect("no answer") {
            Ok(_) => {}
            Err(Error::GpuFailed(cause)) => assert!(cause.contains("illegal memory access"), "{cause}"),
            Err(e) => panic!("{e}"),
        }
    }
}

fn zero_inputs(plan: &Plan) -> Vec<kairos_ir::Tensor> {
    plan.inputs.iter().map(|i| kairos_ir::Tensor::zeros(i.dtype, i.shape.clone())).collect()
}

#[test]
fn the_engine_resets_a_faulted_gpu_and_serves_again() {
    let (engine, trip, plan) = trippable_engine(7, false);
    let inputs = || zero_inputs(&plan);
    let before = engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait().unwrap();

    trip.store(true, std::sync::atomic::Ordering::SeqCst);
    // A request during the fault: served if it slipped in before, else failed with the cause.
    match engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait() {
        Ok(_) => {}
        Err(Error::GpuFailed(cause)) => assert!(cause.contains("illegal memory access"), "{cause}"),
        Err(e) => panic!("a request in flight at the fault got {e}"),
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.stats().gpu_recoveries == 0 {
        assert!(std::time::Instant::now() < deadline, "the engine did not reset the GPU");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let report = &engine.recoveries()[0];
    assert!(report.cause.contains("illegal memory access"), "{report:?}");
    assert_eq!((report.models_reloaded, report.models_lost.len()), (1, 0));
    // Serving again, with the same results.
    for _ in 0..10 {
        let r = engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait().unwrap();
        assert_eq!(r.outputs, before.outputs);
    }
    assert!(!engine.stats().recovering);
    engine.shutdown();
}

#[test]
fn an_engine_whose_gpu_cannot_be_reset_stops_and_says_why() {
    let (engine, trip, plan) = trippable_engine(8, true);
    let inputs = || zero_inputs(&plan);
    engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait().unwrap();
    assert_eq!(engine.stopped(), None);

    trip.store(true, std::sync::atomic::Ordering::SeqCst);
    let why = stopped_within_10_s(&engine);
    assert!(why.contains("sticky"), "{why}");
    assert_eq!(engine.stats().gpu_recoveries, 0);
    // Every later request is refused at once, with the reason.
    match engine.submit("m", inputs(), RequestOptions::default()) {
        Err(Error::GpuFailed(m)) => assert!(m.contains("stopped") && m.contains("sticky"), "{m}"),
        Err(e) => panic!("refused with {e}"),
        Ok(h) => panic!("a stopped engine took a request: {:?}", h.wait()),
    }
}

#[test]
fn requests_are_answered_before_a_slow_reset_ends() {
    // A reset that takes 3 s (CUDA's waits for a running kernel): the requests held at the fault
    // are answered at once, not after it.
    let delay = std::time::Duration::from_secs(3);
    let (engine, trip, plan, resets) = trippable_engine_with(9, false, delay, EngineConfig::default());
    let inputs = || zero_inputs(&plan);
    engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait().unwrap();
    let handles: Vec<_> = (0..8).map(|_| engine.submit("m", inputs(), RequestOptions::default()).unwrap()).collect();
    let t0 = std::time::Instant::now();
    trip.store(true, std::sync::atomic::Ordering::SeqCst);
    served_or_failed_by_the_fault(handles);
    let answered = t0.elapsed();
    assert!(answered < delay / 2, "the requests waited {answered:?} for the reset");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.stats().gpu_recoveries == 0 {
        assert!(std::time::Instant::now() < deadline, "the engine did not reset the GPU");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(resets.load(std::sync::atomic::Ordering::SeqCst), 1);
    engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait().unwrap();
    engine.shutdown();
}

#[test]
fn an_engine_without_resets_answers_everything_and_stops_at_a_fault() {
    // A GPU worker's engine: no reset in place, the worker's exit is the reset.
    let cfg = EngineConfig { recovery_attempts_max: 0, ..EngineConfig::default() };
    let (engine, trip, plan, resets) = trippable_engine_with(10, false, std::time::Duration::ZERO, cfg);
    let inputs = || zero_inputs(&plan);
    engine.submit("m", inputs(), RequestOptions::default()).unwrap().wait().unwrap();
    let handles: Vec<_> = (0..8).map(|_| engine.submit("m", inputs(), RequestOptions::default()).unwrap()).collect();
    trip.store(true, std::sync::atomic::Ordering::SeqCst);
    served_or_failed_by_the_fault(handles);
    let why = stopped_within_10_s(&engine);
    assert!(why.contains("does not reset"), "{why}");
    assert_eq!(resets.load(std::sync::atomic::Ordering::SeqCst), 0, "a reset was tried");
    assert!(matches!(engine.submit("m", inputs(), RequestOptions::default()), Err(Error::GpuFailed(_))));
}

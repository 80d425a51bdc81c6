//! GPU faults on a real device, three kinds, each while the engine serves a zoo model with
//! requests in flight:
//!
//! - an illegal address: one launch writes to an unmapped address (a real fault of the device:
//!   every later driver call fails, a sticky error). The engine must answer every request in
//!   flight (served, or 503-class `GpuFailed`), then either reset the device (`CudaGpu::reset`)
//!   and serve the model again with the same outputs, or — what CUDA does with a sticky error,
//!   which lasts for the life of the process — stop with that explanation and answer every later
//!   request at once (a server then reports itself not live, so that its supervisor restarts it);
//! - a ring overflow: the host stops reading the notification ring (polls report nothing) while
//!   launches fill a small ring past the producers' wait, so the device drops records. The
//!   requests whose launches lost their ends fail, the others are served, and serving goes on
//!   without a reset;
//! - a hung launch: a kernel that fills every SM for seconds goes in front of one of the model's
//!   launches, which then never starts; the watchdog takes it for hung, every request held fails
//!   with `GpuFailed`, the context is reset (killing the kernel) and serving resumes.
//!
//! `#[ignore]`d without a GPU; scripts/gpu-suite.sh runs it with `--include-ignored` (as its own process: a reset of the
//! primary context would take every other test's objects with it). Prints the times it measured.

use kairos_cuda::CudaGpu;
use kairos_gpu::*;
use kairos_gputest as suite;
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape};
use kairos_sched::{Engine, EngineConfig, Error, ModelSpec, RequestOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a request may take to get its answer during the test, fault or not.
const ANSWER_WITHIN: Duration = Duration::from_secs(60);
/// The target for getting back to serving after a fault.
const RECOVER_TARGET: Duration = Duration::from_secs(2);

/// Faults to inject into a CUDA GPU, set by the test while the engine drives it.
#[derive(Default)]
struct Injection {
    /// The next launch writes its output to an unmapped device address.
    illegal_address: AtomicBool,
    /// The next launch queues behind a kernel that fills every SM for this many ns per block
    /// (`CudaGpu::inject_hang_at_launch`); 0: none.
    hang_block_ns: AtomicU64,
    /// While set, polls report nothing and waits only sleep: the host stops reading the ring; the
    /// first launch meanwhile is preceded by a kernel whose CTA records alone outgrow the ring.
    stall_polls: AtomicBool,
    /// The inner GPU's ring overflows so far (copied after every poll).
    ring_overflows: AtomicU64,
}

/// A CUDA GPU with faults injected on demand.
struct Injected {
    inner: CudaGpu,
    injection: Arc<Injection>,
    /// Launches the test made itself (the flood of records): their events are not the engine's.
    hidden: Vec<LaunchId>,
    /// Whether this stall's flood went out.
    flooded: bool,
}

impl Injected {
    fn start(injection: &Arc<Injection>, ring_records: Option<u32>) -> Engine {
        Injected::start_with(injection, ring_records, EngineConfig::default())
    }

    fn start_with(injection: &Arc<Injection>, ring_records: Option<u32>, cfg: EngineConfig) -> Engine {
        let injection = injection.clone();
        Engine::start(cfg, move || {
            let inner = match ring_records {
                Some(n) => CudaGpu::with_ring_capacity(0, n)?,
                None => CudaGpu::new(0)?,
            };
            Ok(Injected { inner, injection, hidden: Vec::new(), flooded: false })
        })
        .unwrap()
    }
}

fn launch_of(e: &GpuEvent) -> Option<LaunchId> {
    match e {
        GpuEvent::LaunchStarted { launch, .. }
        | GpuEvent::CtasPlaced { launch, .. }
        | GpuEvent::CtasFinished { launch, .. }
        | GpuEvent::LaunchDone { launch, .. }
        | GpuEvent::LaunchLost { launch, .. } => Some(*launch),
        _ => None,
    }
}

impl Gpu for Injected {
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
    fn create_stream(&mut self, priority: i32) -> Result<StreamId> {
        self.inner.create_stream(priority)
    }
    fn destroy_stream(&mut self, stream: StreamId) -> Result<()> {
        self.inner.destroy_stream(stream)
    }
    fn prepare_plan(&mut self, plan: &kairos_ir::plan::Plan) -> Result<()> {
        self.inner.prepare_plan(plan)
    }
    fn kernel_resources(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> Result<KernelResources> {
        self.inner.kernel_resources(kernel, dtype, shape)
    }
    fn launch(&mut self, r: &LaunchRequest<'_>) -> Result<LaunchId> {
        if self.injection.illegal_address.swap(false, Ordering::SeqCst) {
            // The last argument is the output: 64 KiB into the device's address space, which
            // nothing maps.
            let mut args = r.args.to_vec();
            if let Some(out) = args.last_mut() {
                *out = DevicePtr(0x10000);
            }
            eprintln!("recovery test: launch with its output at an illegal address");
            return self.inner.launch(&LaunchRequest { args: &args, ..*r });
        }
        let hang_block_ns = self.injection.hang_block_ns.swap(0, Ordering::SeqCst);
        if hang_block_ns > 0 {
            let next = self.inner.launch_costs().launches + 1;
            self.inner.inject_hang_at_launch(next, hang_block_ns);
        }
        let stalled = self.injection.stall_polls.load(Ordering::SeqCst);
        if stalled && !self.flooded {
            // Two CTAs per SM of 1 µs blocks, each CTA group reported as it arrives and leaves:
            // hundreds of records, more than the ring holds, while nobody reads it.
            self.flooded = true;
            let blocks = self.inner.info().sm_count * 2;
            let counts = self.inner.alloc(blocks as u64 * 4, MemKind::Device)?;
            let stream = self.inner.create_stream(0)?;
            let o = self.inner.whole_device(stream);
            let flood = self.inner.launch_spin(counts.ptr, blocks, 1_000, &o)?;
            self.hidden.push(flood);
            eprintln!("recovery test: the host stopped reading; a kernel of {blocks} blocks floods the ring with records");
        }
        if !stalled {
            self.flooded = false;
        }
        self.inner.launch(r)
    }
    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        self.inner.preempt(launch)
    }
    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        if self.injection.stall_polls.load(Ordering::SeqCst) {
            return Ok(());
        }
        let before = events.len();
        let polled = self.inner.poll(events);
        self.injection.ring_overflows.store(self.inner.ring_overflows(), Ordering::SeqCst);
        if !self.hidden.is_empty() {
            let hidden = &self.hidden;
            let mut i = before;
            while i < events.len() {
                if launch_of(&events[i]).is_some_and(|l| hidden.contains(&l)) {
                    events.remove(i);
                } else {
                    i += 1;
                }
            }
        }
        polled
    }
    fn wait(&mut self, until_ns: u64) -> Result<()> {
        if self.injection.stall_polls.load(Ordering::SeqCst) {
            let left_ns = until_ns.saturating_sub(self.inner.now_ns()).min(1_000_000);
            std::thread::sleep(Duration::from_nanos(left_ns));
            return Ok(());
        }
        self.inner.wait(until_ns)
    }
    fn reset(&mut self) -> Result<()> {
        // The test's own launches went with the old context.
        self.hidden.clear();
        self.inner.reset()
    }
}

/// resnet18 f32 loaded into `engine`: the model every test serves, with its inputs.
fn serve_resnet18(engine: &Engine) -> suite::ZooModel {
    let m = suite::zoo_model("resnet18", DType::F32, 1, 32).unwrap();
    engine.load_model(ModelSpec { name: "resnet18".into(), plan: Arc::new(m.plan.clone()), profile: None }).unwrap();
    m
}

fn submit(engine: &Engine, m: &suite::ZooModel) -> kairos_sched::RequestHandle {
    engine.submit("resnet18", m.inputs.clone(), RequestOptions::default()).unwrap()
}

/// The outputs before any fault, the same in six runs.
fn outputs_before_the_fault(engine: &Engine, m: &suite::ZooModel) -> Vec<kairos_ir::Tensor> {
    let expected = submit(engine, m).wait().unwrap().outputs;
    for _ in 0..5 {
        assert_eq!(submit(engine, m).wait().unwrap().outputs, expected, "outputs differ between two runs before the fault");
    }
    expected
}

/// The ring of the overflow test: small enough that a stalled host overflows it at once.
const RING_RECORDS: u32 = kairos_cuda::protocol::RING_CAPACITY_MIN;
/// How long the host stops reading the ring: ten times the producers' wait for room.
const STALL: Duration = Duration::from_millis(500);
/// The hung-launch test's watchdog bound (the default, 2 s, suits serving; a test need not wait).
const WATCHDOG: Duration = Duration::from_millis(300);

/// Sorts the answers of requests in flight at a fault: served (with `expected`'s outputs) or failed
/// with an error that `failed_ok` accepts; anything else, or no answer, fails the test.
fn answers(
    handles: Vec<kairos_sched::RequestHandle>,
    expected: &[kairos_ir::Tensor],
    failed_ok: impl Fn(&Error) -> bool,
) -> (usize, usize) {
    let (mut served, mut failed) = (0, 0);
    for h in handles {
        match h.wait_timeout(ANSWER_WITHIN).expect("a request in flight at the fault got no answer") {
            Ok(r) => {
                assert_eq!(r.outputs, expected, "a request served around the fault is wrong");
                served += 1;
            }
            Err(e) if failed_ok(&e) => failed += 1,
            Err(e) => panic!("a request in flight at the fault got {e}"),
        }
    }
    (served, failed)
}

/// Requests until one is served (correct), then 20 more, all correct; the time of the first.
fn serving_again(run: &dyn Fn() -> kairos_sched::RequestHandle, expected: &[kairos_ir::Tensor], since: Instant) -> Duration {
    let first = loop {
        match run().wait_timeout(ANSWER_WITHIN).expect("no answer after the fault") {
            Ok(r) => {
                assert_eq!(r.outputs, expected, "wrong outputs after the fault");
                break since.elapsed();
            }
            Err(Error::GpuFailed(_)) => assert!(since.elapsed() < ANSWER_WITHIN, "not serving again"),
            Err(e) => panic!("after the fault: {e}"),
        }
    };
    for _ in 0..20 {
        assert_eq!(run().wait().unwrap().outputs, expected, "wrong outputs after the fault");
    }
    first
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-suite.sh runs it with --include-ignored"]
fn the_engine_recovers_from_an_illegal_address() {
    kairos_cuda::settings::configure_from_env();
    let name = "resnet18";
    let injection = Arc::new(Injection::default());
    let engine = Injected::start(&injection, None);
    let m = serve_resnet18(&engine);
    let run = || submit(&engine, &m);
    let expected = outputs_before_the_fault(&engine, &m);

    // The fault, with requests in flight around it.
    let faulted_at = Instant::now();
    injection.illegal_address.store(true, Ordering::SeqCst);
    let handles: Vec<_> = (0..20).map(|_| run()).collect();
    let (served, failed) = answers(handles, &expected, |e| matches!(e, Error::GpuFailed(_)));
    assert!(failed > 0, "the illegal address did not fail any request");
    let answered = faulted_at.elapsed();
    // CUDA keeps a sticky error for the life of the process: the engine either reset the GPU or
    // stopped, saying why; nothing hangs.
    loop {
        if engine.stats().gpu_recoveries > 0 {
            break;
        }
        if let Some(why) = engine.stopped() {
            assert!(why.contains("sticky"), "stopped without saying why: {why}");
            // A request now is refused at once, with the reason.
            match engine.submit(name, m.inputs.clone(), RequestOptions::default()) {
                Err(Error::GpuFailed(m)) => assert!(m.contains("stopped"), "{m}"),
                Err(e) => panic!("a stopped engine refused a request with {e}"),
                Ok(h) => panic!("a stopped engine took a request, which got {:?}", h.wait_timeout(ANSWER_WITHIN)),
            }
            println!(
                "recovery: {name} f32; around the fault {served} requests served, {failed} failed (GpuFailed), all answered \
                 {} ms after the fault; the engine stopped {} ms after the fault: {why}",
                answered.as_millis(),
                faulted_at.elapsed().as_millis()
            );
            return;
        }
        assert!(faulted_at.elapsed() < ANSWER_WITHIN, "the engine neither reset the GPU nor stopped");
        std::thread::sleep(Duration::from_millis(1));
    }
    let reset_after = faulted_at.elapsed();
    let first = serving_again(&run, &expected, faulted_at);
    let report = &engine.recoveries()[0];
    println!(
        "recovery: {name} f32; around the fault {served} requests served, {failed} failed (GpuFailed); reset {} ms after the fault \
         (the reset itself {:.1} ms, {} models loaded again); first correct answer {} ms after the fault; 20 more correct; cause: {}",
        reset_after.as_millis(),
        report.took_ns as f64 / 1e6,
        report.models_reloaded,
        first.as_millis(),
        report.cause
    );
    assert_eq!(engine.stats().gpu_recoveries, 1);
    engine.shutdown();
    assert!(first <= RECOVER_TARGET, "first correct answer {first:?} after the fault, over the {RECOVER_TARGET:?} target");
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-suite.sh runs it with --include-ignored"]
fn the_engine_recovers_from_a_ring_overflow() {
    kairos_cuda::settings::configure_from_env();
    let name = "resnet18";
    let injection = Arc::new(Injection::default());
    let engine = Injected::start(&injection, Some(RING_RECORDS));
    let m = serve_resnet18(&engine);
    let run = || submit(&engine, &m);
    let expected = outputs_before_the_fault(&engine, &m);
    assert_eq!(injection.ring_overflows.load(Ordering::SeqCst), 0, "the ring overflowed before the test stalled it");

    // The host stops reading while 20 requests' launches fill the ring.
    injection.stall_polls.store(true, Ordering::SeqCst);
    let handles: Vec<_> = (0..20).map(|_| run()).collect();
    std::thread::sleep(STALL);
    injection.stall_polls.store(false, Ordering::SeqCst);
    let resumed_at = Instant::now();
    let (served, failed) = answers(handles, &expected, |e| matches!(e, Error::Gpu(cause) if cause.contains("ring overflowed")));
    let answered = resumed_at.elapsed();
    let overflows = injection.ring_overflows.load(Ordering::SeqCst);
    assert!(overflows >= 1, "the ring of {RING_RECORDS} records did not overflow in a {STALL:?} stall");
    assert!(failed > 0, "the ring overflowed but no request lost a launch");
    let first = serving_again(&run, &expected, resumed_at);
    let stats = engine.stats();
    println!(
        "recovery: ring overflow ({RING_RECORDS}-record ring, host stalled {} ms): {name} f32; of 20 requests in flight {served} \
         served, {failed} failed (launch lost), all answered {} ms after the host read again; {overflows} overflow(s), {} \
         launches lost; first correct answer after {} ms, 20 more correct; GPU resets: {}",
        STALL.as_millis(),
        answered.as_millis(),
        stats.launches_lost,
        first.as_millis(),
        stats.gpu_recoveries
    );
    assert_eq!(stats.gpu_recoveries, 0, "a ring overflow is recovered without a reset");
    engine.shutdown();
    assert!(first <= RECOVER_TARGET, "first correct answer {first:?} after the overflow, over the {RECOVER_TARGET:?} target");
}

/// Each block of the in-place hang's kernel spins this long (each CTA runs one or two blocks).
const HANG_BLOCK_NS: u64 = 2_000_000_000;
/// The hang the engine that does not reset meets: longer than the test, so that only the
/// process's exit ends it.
const LONG_HANG_BLOCK_NS: u64 = 120_000_000_000;
/// Requests held at a hang are answered this soon after the watchdog's bound.
const ANSWER_AFTER_WATCHDOG: Duration = Duration::from_millis(500);

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-suite.sh runs it with --include-ignored"]
fn the_engine_recovers_from_a_hung_launch() {
    kairos_cuda::settings::configure_from_env();
    let name = "resnet18";
    let injection = Arc::new(Injection::default());
    let mut cfg = EngineConfig::default();
    cfg.dispatcher.watchdog_ns_min = WATCHDOG.as_nanos() as u64;
    let engine = Injected::start_with(&injection, None, cfg);
    let m = serve_resnet18(&engine);
    let run = || submit(&engine, &m);
    let expected = outputs_before_the_fault(&engine, &m);

    injection.hang_block_ns.store(HANG_BLOCK_NS, Ordering::SeqCst);
    let hung_at = Instant::now();
    let handles: Vec<_> = (0..20).map(|_| run()).collect();
    let (served, failed) = answers(handles, &expected, |e| matches!(e, Error::GpuFailed(_)));
    let answered = hung_at.elapsed();
    assert!(failed > 0, "the hung launch failed no request");
    while engine.stats().gpu_recoveries == 0 {
        if let Some(why) = engine.stopped() {
            panic!("the engine stopped instead of resetting the GPU after a hung launch: {why}");
        }
        assert!(hung_at.elapsed() < ANSWER_WITHIN, "the engine did not reset the GPU after the hung launch");
        std::thread::sleep(Duration::from_millis(1));
    }
    let reset_after = hung_at.elapsed();
    let first = serving_again(&run, &expected, hung_at);
    let report = &engine.recoveries()[0];
    println!(
        "recovery: hung launch in place (a kernel filling every SM, {} s per block, ahead of it; watchdog {} ms): {name} \
         f32; of 20 requests {served} served, {failed} failed (GpuFailed), all answered {} ms after the hang began; the \
         reset waited for the kernel: done {} ms after (the reset itself {:.1} ms, {} models loaded again); first correct \
         answer {} ms after the hang began, 20 more correct; cause: {}",
        HANG_BLOCK_NS / 1_000_000_000,
        WATCHDOG.as_millis(),
        answered.as_millis(),
        reset_after.as_millis(),
        report.took_ns as f64 / 1e6,
        report.models_reloaded,
        first.as_millis(),
        report.cause
    );
    assert!(report.cause.contains("watchdog"), "the reset's cause does not name the watchdog: {}", report.cause);
    assert_eq!(engine.stats().gpu_recoveries, 1);
    engine.shutdown();
    // The requests do not wait for the reset; the reset waits for the kernel (CUDA does not stop
    // a running kernel: only a process's exit does, which is why GPU workers do not reset).
    assert!(answered <= WATCHDOG + ANSWER_AFTER_WATCHDOG, "requests answered {answered:?} after the hang began");
    let hang = Duration::from_nanos(2 * HANG_BLOCK_NS);
    assert!(first <= hang + RECOVER_TARGET, "first correct answer {first:?} after the hang, over its {hang:?} plus the target");
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-suite.sh runs it with --include-ignored"]
fn a_hung_launch_stops_an_engine_that_does_not_reset() {
    // A GPU worker's engine (`recovery_attempts_max = 0`): at the hang it answers every request
    // and stops at once; the worker's exit then ends the kernel (this test's process, here).
    kairos_cuda::settings::configure_from_env();
    let injection = Arc::new(Injection::default());
    let mut cfg = EngineConfig { recovery_attempts_max: 0, ..EngineConfig::default() };
    cfg.dispatcher.watchdog_ns_min = WATCHDOG.as_nanos() as u64;
    let engine = Injected::start_with(&injection, None, cfg);
    let m = serve_resnet18(&engine);
    let run = || submit(&engine, &m);
    let expected = outputs_before_the_fault(&engine, &m);
    injection.hang_block_ns.store(LONG_HANG_BLOCK_NS, Ordering::SeqCst);
    let hung_at = Instant::now();
    let handles: Vec<_> = (0..20).map(|_| run()).collect();
    let (served, failed) = answers(handles, &expected, |e| matches!(e, Error::GpuFailed(_)));
    let answered = hung_at.elapsed();
    let why = loop {
        if let Some(why) = engine.stopped() {
            break why;
        }
        assert!(hung_at.elapsed() < WATCHDOG + ANSWER_AFTER_WATCHDOG, "the engine did not stop at the hang");
        std::thread::sleep(Duration::from_millis(1));
    };
    let stopped = hung_at.elapsed();
    println!(
        "recovery: hung launch, engine without resets (a GPU worker's; watchdog {} ms): of 20 requests {served} served, \
         {failed} failed (GpuFailed), all answered {} ms after the hang began; stopped {} ms after: {why}",
        WATCHDOG.as_millis(),
        answered.as_millis(),
        stopped.as_millis()
    );
    assert!(failed > 0, "the hung launch failed no request");
    assert!(why.contains("does not reset"), "{why}");
    assert!(answered <= WATCHDOG + ANSWER_AFTER_WATCHDOG, "requests answered {answered:?} after the hang began");
    // A stopped engine refuses at once.
    assert!(matches!(engine.submit("resnet18", m.inputs.clone(), RequestOptions::default()), Err(Error::GpuFailed(_))));
}

//! GPU faults on a real device: the engine serves a zoo model, one launch is made to write to an
//! illegal address (a real fault of the device: every later driver call fails, a sticky error),
//! and the engine must answer every request in flight (served, or 503-class `GpuFailed`), then
//! either reset the device (`CudaGpu::reset`) and serve the model again with the same outputs,
//! or — what CUDA does with a sticky error, which lasts for the life of the process — stop with
//! that explanation and answer every later request at once (a server then reports itself not
//! live, so that its supervisor restarts it).
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a request may take to get its answer during the test, fault or not.
const ANSWER_WITHIN: Duration = Duration::from_secs(60);
/// The target for getting back to serving after a fault.
const RECOVER_TARGET: Duration = Duration::from_secs(2);

/// A CUDA GPU whose next launch, once `trip` is set, writes its output to an unmapped device
/// address.
struct Faulting {
    inner: CudaGpu,
    trip: Arc<AtomicBool>,
}

impl Gpu for Faulting {
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
        if self.trip.swap(false, Ordering::SeqCst) {
            // The last argument is the output: 64 KiB into the device's address space, which
            // nothing maps.
            let mut args = r.args.to_vec();
            if let Some(out) = args.last_mut() {
                *out = DevicePtr(0x10000);
            }
            eprintln!("recovery test: launch with its output at an illegal address");
            return self.inner.launch(&LaunchRequest { args: &args, ..*r });
        }
        self.inner.launch(r)
    }
    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        self.inner.preempt(launch)
    }
    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        self.inner.poll(events)
    }
    fn wait(&mut self, until_ns: u64) -> Result<()> {
        self.inner.wait(until_ns)
    }
    fn reset(&mut self) -> Result<()> {
        self.inner.reset()
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-suite.sh runs it with --include-ignored"]
fn the_engine_recovers_from_an_illegal_address() {
    kairos_cuda::settings::configure_from_env();
    let name = "resnet18";
    let m = suite::zoo_model(name, DType::F32, 1, 32).unwrap();
    let trip = Arc::new(AtomicBool::new(false));
    let gpu_trip = trip.clone();
    let engine =
        Engine::start(EngineConfig::default(), move || Ok(Faulting { inner: CudaGpu::new(0)?, trip: gpu_trip })).unwrap();
    engine.load_model(ModelSpec { name: name.into(), plan: Arc::new(m.plan.clone()), profile: None }).unwrap();
    let run = || engine.submit(name, m.inputs.clone(), RequestOptions::default()).unwrap();
    let expected = run().wait().unwrap().outputs;
    for _ in 0..5 {
        assert_eq!(run().wait().unwrap().outputs, expected, "outputs differ between two runs before the fault");
    }

    // The fault, with requests in flight around it.
    let faulted_at = Instant::now();
    trip.store(true, Ordering::SeqCst);
    let handles: Vec<_> = (0..20).map(|_| run()).collect();
    let (mut served, mut failed) = (0, 0);
    for h in handles {
        match h.wait_timeout(ANSWER_WITHIN).expect("a request in flight at the fault got no answer") {
            Ok(r) => {
                assert_eq!(r.outputs, expected, "a request served around the fault is wrong");
                served += 1;
            }
            Err(Error::GpuFailed(cause)) => {
                eprintln!("recovery test: a request failed with: {cause}");
                failed += 1;
            }
            Err(e) => panic!("a request in flight at the fault got {e}"),
        }
    }
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
    // Serving again: the first correct answer, then more.
    let first = loop {
        match run().wait_timeout(ANSWER_WITHIN).expect("no answer after the reset") {
            Ok(r) => {
                assert_eq!(r.outputs, expected, "wrong outputs after the reset");
                break faulted_at.elapsed();
            }
            Err(Error::GpuFailed(_)) => assert!(faulted_at.elapsed() < ANSWER_WITHIN, "not serving again"),
            Err(e) => panic!("after the reset: {e}"),
        }
    };
    for _ in 0..20 {
        assert_eq!(run().wait().unwrap().outputs, expected, "wrong outputs after the reset");
    }
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

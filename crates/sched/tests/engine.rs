//! The threaded Engine: submit/wait from several threads, overload, cancel, load/unload,
//! shutdown with work queued, and a GPU that fails to start. The GPU is MiniGpu, optionally
//! behind a gate that holds the dispatcher thread inside `launch` until a test opens it, which
//! makes queue-full and cancel-while-running deterministic.

mod common;

use common::mini::{MiniConfig, MiniGpu};
use kairos_gpu::synthetic::{SyntheticKernel, layered_plan};
use kairos_gpu::*;
use kairos_ir::plan::{Kernel, LaunchShape};
use kairos_ir::{DType, Tensor};
use kairos_sched::*;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn closed() -> Gate {
        Gate::default()
    }
    fn open(&self) {
        *self.0.0.lock().unwrap() = true;
        self.0.1.notify_all();
    }
    fn pass(&self) {
        let mut open = self.0.0.lock().unwrap();
        while !*open {
            open = self.0.1.wait(open).unwrap();
        }
    }
}

/// MiniGpu whose launches wait for the gate.
struct Gated {
    inner: MiniGpu,
    gate: Gate,
}

impl Gpu for Gated {
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
        self.gate.pass();
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
}

fn model(name: &str, kernels: usize) -> ModelSpec {
    let k = SyntheticKernel { logical_blocks: 32, threads_per_block: 128, shared_mem_bytes: 0 };
    ModelSpec { name: name.into(), plan: Arc::new(layered_plan(name, &vec![k; kernels])), profile: None }
}

fn input(spec: &ModelSpec) -> Vec<Tensor> {
    spec.plan.inputs.iter().map(|i| Tensor::zeros(i.dtype, i.shape.clone())).collect()
}

fn config(policy: &str, queue: usize) -> EngineConfig {
    EngineConfig {
        dispatcher: Config::default().with_policy(kairos_sched::PolicyConfig::by_name(policy).unwrap()),
        submit_queue_max: queue,
        gpu_wait_ns: 20_000,
        idle_wait_ms: 5,
        ..EngineConfig::default()
    }
}

#[test]
fn many_threads_submit_and_wait() {
    for policy in ["paella", "streams", "fifo"] {
        let engine = Arc::new(Engine::start(config(policy, 1024), || Ok(MiniGpu::new(MiniConfig::default()))).unwrap());
        assert_eq!(engine.device().sm_count, 8);
        let a = model("a", 4);
        let b = model("b", 9);
        assert_eq!(engine.load_model(a.clone()).unwrap().launches, 4);
        engine.load_model(b.clone()).unwrap();
        assert!(matches!(engine.load_model(a.clone()), Err(Error::ModelExists(_))));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let engine = engine.clone();
                let (a, b) = (a.clone(), b.clone());
                std::thread::spawn(move || {
                    let handles: Vec<_> = (0..25)
                        .map(|i| {
                            let m = if (i + t) % 3 == 0 { &b } else { &a };
                            engine
                                .submit(&m.name, input(m), RequestOptions { tenant: TenantId(t), ..Default::default() })
                                .unwrap()
                        })
                        .collect();
                    for h in handles {
                        let r = h.wait().unwrap();
                        assert_eq!(r.outputs.len(), 1);
                        assert!(r.timing.done_ns >= r.timing.arrival_ns);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = engine.stats();
        assert_eq!((s.submitted, s.completed, s.failed, s.rejected), (100, 100, 0, 0), "{policy}: {s:?}");
        // Errors a caller sees at once or through its handle.
        assert!(matches!(engine.submit("nope", vec![], RequestOptions::default()).unwrap().wait(), Err(Error::UnknownModel(_))));
        assert!(matches!(engine.submit("a", vec![], RequestOptions::default()).unwrap().wait(), Err(Error::InvalidInput(_))));
        Arc::try_unwrap(engine).ok().unwrap().shutdown();
    }
}

/// With an idle spin the dispatcher thread polls its queue instead of sleeping: requests that
/// arrive while it spins are served, and a shutdown during the spin ends the thread at once.
#[test]
fn an_idle_spin_serves_requests_and_shuts_down() {
    let cfg = EngineConfig { idle_spin_ns: 60_000_000_000, ..config("reef", 64) };
    let engine = Engine::start(cfg, || Ok(MiniGpu::new(MiniConfig::default()))).unwrap();
    let a = model("a", 3);
    engine.load_model(a.clone()).unwrap();
    for i in 0..6 {
        let class = if i % 2 == 0 { kairos_sched::Class::RealTime } else { kairos_sched::Class::BestEffort };
        let r = engine.submit("a", input(&a), RequestOptions { class, ..Default::default() }).unwrap().wait().unwrap();
        assert_eq!(r.outputs.len(), 1);
        std::thread::sleep(Duration::from_millis(3));
    }
    let s = engine.stats();
    assert_eq!((s.submitted, s.completed, s.failed), (6, 6, 0), "{s:?}");
    let t = std::time::Instant::now();
    engine.shutdown();
    assert!(t.elapsed() < Duration::from_secs(5), "shutdown waited {:?} for the spinning thread", t.elapsed());
}

/// `reef+hold=US` in the threaded engine: a best-effort request that comes right after a
/// real-time one waits out the hold-off and is then served (the engine looks again when the hold
/// ends, also on a GPU whose clock only moves when waited on), with the hold in between.
#[test]
fn a_hold_off_delays_best_effort_work_and_then_serves_it() {
    let engine = Engine::start(config("reef+hold=50", 64), || Ok(MiniGpu::new(MiniConfig::default()))).unwrap();
    let a = model("a", 3);
    engine.load_model(a.clone()).unwrap();
    let rt = RequestOptions { class: kairos_sched::Class::RealTime, ..Default::default() };
    let be = RequestOptions { class: kairos_sched::Class::BestEffort, ..Default::default() };
    let rt_done = engine.submit("a", input(&a), rt).unwrap().wait().unwrap().timing.done_ns;
    let h = engine.submit("a", input(&a), be).unwrap();
    let r = h.wait_timeout(Duration::from_secs(20)).expect("the best-effort request was never served").unwrap();
    assert!(
        r.timing.first_issue_ns >= rt_done + 50_000,
        "best-effort work issued {} ns after the real-time job left, inside the 50 µs hold-off",
        r.timing.first_issue_ns - rt_done
    );
    engine.shutdown();
}

#[test]
fn a_full_queue_is_an_error_and_nothing_is_lost() {
    let gate = Gate::closed();
    let g = gate.clone();
    let engine =
        Engine::start(config("paella", 4), move || Ok(Gated { inner: MiniGpu::new(MiniConfig::default()), gate: g })).unwrap();
    let a = model("a", 3);
    engine.load_model(a.clone()).unwrap();
    // The first request parks the dispatcher thread in `launch`; the queue then fills.
    let mut handles = vec![engine.submit("a", input(&a), RequestOptions::default()).unwrap()];
    std::thread::sleep(Duration::from_millis(50));
    let mut overloaded = 0;
    for _ in 0..20 {
        match engine.submit("a", input(&a), RequestOptions::default()) {
            Ok(h) => handles.push(h),
            Err(Error::Overloaded { what, max }) => {
                assert_eq!((what, max), ("submission queue", 4));
                overloaded += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(handles.len(), 5, "the queue holds 4 behind the running one");
    assert_eq!(overloaded, 16);
    assert!(handles[1].poll().is_none());
    assert!(handles[1].wait_timeout(Duration::from_millis(10)).is_none());
    gate.open();
    for h in handles {
        h.wait().unwrap();
    }
    assert_eq!(engine.stats().rejected, 16);
}

#[test]
fn cancel_a_running_request() {
    let gate = Gate::closed();
    let g = gate.clone();
    let engine =
        Engine::start(config("paella", 16), move || Ok(Gated { inner: MiniGpu::new(MiniConfig::default()), gate: g })).unwrap();
    let a = model("a", 50);
    engine.load_model(a.clone()).unwrap();
    let h = engine.submit("a", input(&a), RequestOptions::default()).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    // The dispatcher is inside the request's first launch; the cancel is next in the queue.
    h.cancel().unwrap();
    gate.open();
    assert!(matches!(h.wait(), Err(Error::Cancelled)));
    // The engine still serves.
    engine.submit("a", input(&a), RequestOptions::default()).unwrap().wait().unwrap();
    // Cancelling something finished is harmless.
    engine.cancel(RequestId(0)).unwrap();
}

#[test]
fn unload_waits_for_running_requests() {
    let engine = Engine::start(config("sjf", 16), || Ok(MiniGpu::new(MiniConfig::default()))).unwrap();
    let a = model("a", 20);
    engine.load_model(a.clone()).unwrap();
    let handles: Vec<_> = (0..5).map(|_| engine.submit("a", input(&a), RequestOptions::default()).unwrap()).collect();
    engine.unload_model("a").unwrap();
    for h in handles {
        h.wait().unwrap();
    }
    assert!(matches!(engine.submit("a", input(&a), RequestOptions::default()).unwrap().wait(), Err(Error::UnknownModel(_))));
    assert!(matches!(engine.unload_model("a"), Err(Error::UnknownModel(_))));
    engine.load_model(a.clone()).unwrap();
    engine.submit("a", input(&a), RequestOptions::default()).unwrap().wait().unwrap();
}

#[test]
fn shutdown_answers_every_request() {
    let gate = Gate::closed();
    let g = gate.clone();
    let engine =
        Engine::start(config("streams", 64), move || Ok(Gated { inner: MiniGpu::new(MiniConfig::default()), gate: g })).unwrap();
    let a = model("a", 10);
    engine.load_model(a.clone()).unwrap();
    let handles: Vec<_> = (0..10).map(|_| engine.submit("a", input(&a), RequestOptions::default()).unwrap()).collect();
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        gate.open();
    });
    engine.shutdown();
    opener.join().unwrap();
    let mut stopped = 0;
    for h in handles {
        match h.wait() {
            Ok(_) => {}
            Err(Error::ShuttingDown) => stopped += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(stopped > 0, "requests queued behind the shutdown are refused");
}

#[test]
fn a_gpu_that_fails_to_start_is_an_error() {
    let r = Engine::start(EngineConfig::default(), || -> kairos_gpu::Result<MiniGpu> {
        Err(GpuError::NoDevice("no driver here".into()))
    });
    assert!(matches!(r, Err(Error::Gpu(m)) if m.contains("no driver here")));
}

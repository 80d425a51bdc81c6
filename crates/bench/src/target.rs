//! What the load generator drives: the [`Target`] trait and its in-process implementations.
//!
//! A target is one serving system reached one way. The load generator ([`crate::runner`]) only
//! submits requests at their arrival times and waits for completions, so one generator serves
//! every way of reaching kairos:
//!
//! - [`VirtualTarget`]: the dispatcher driven synchronously on the calling thread in the GPU's own
//!   clock ([`kairos_sched::VirtualDriver`]'s primitives). On the simulator time is virtual and a run
//!   is deterministic; on a real GPU it is the open-loop generator Paella's experiments use (arrivals
//!   are submitted at their scheduled times on the dispatcher's own thread).
//! - [`EngineTarget`]: the threaded [`Engine`] as an application embeds it: requests cross the
//!   bounded submission queue to the dispatcher thread and complete through callbacks; latency is
//!   measured on the caller's wall clock.
//! - [`crate::remote::RemoteTarget`]: a kairos server reached over KServe v2 (gRPC or REST) or the
//!   shared-memory channel, through `kairos-client`.
//!
//! Latency is always `completion - scheduled arrival` on the target's clock, so a late generator
//! or a full queue shows as latency (no coordinated omission).

use crate::Error;
use kairos_gpu::Gpu;
use kairos_sched::{
    Command, Config, Engine, EngineConfig, ModelInfo, ModelSpec, RequestId, RequestOptions, Timing, VirtualDriver,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A finished request as the target reports it.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The generator's tag given at submission.
    pub tag: u64,
    /// When the outcome was seen, on the target's clock.
    pub done_ns: u64,
    /// The dispatcher's timing (its own clock: only differences are meaningful), or the error.
    pub result: Result<Timing, kairos_sched::Error>,
}

/// What the dispatcher did during a run, when the target can tell (in-process targets).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DispatcherCounters {
    pub completed: u64,
    pub launches: u64,
    /// GPU events read: notification records (and finished copies).
    pub events: u64,
    pub launches_lost: u64,
    /// Time the dispatcher spent working (threaded engine: its thread not waiting; virtual driver
    /// on a GPU: launch calls, policy and events, the parts it measures).
    pub busy_ns: u64,
    pub launch_call_ns: u64,
    pub policy_ns: u64,
    pub events_ns: u64,
    /// Whole jobs issued as recorded runs (CUDA graphs), runs recorded, and the host time
    /// recording took (part of `launch_call_ns`' neighbours in `busy_ns`, on the dispatcher's thread).
    #[serde(default)]
    pub runs_launched: u64,
    #[serde(default)]
    pub runs_recorded: u64,
    #[serde(default)]
    pub run_record_ns: u64,
    /// Kernel-level segments issued as recorded runs.
    #[serde(default)]
    pub segments_launched: u64,
    /// Launches confined by an SM mask (`reef`'s padding, `krisp`, `static`).
    #[serde(default)]
    pub masked_launches: u64,
    /// Of those, on a hardware partition (`+green`), and `+green` masks that fell back to the
    /// software mask.
    #[serde(default)]
    pub partition_launches: u64,
    #[serde(default)]
    pub partition_fallbacks: u64,
    /// Launches a policy preempted (`reef`).
    #[serde(default)]
    pub preemptions: u64,
    /// Under a weight budget: loads a request started (cold starts) and models evicted.
    #[serde(default)]
    pub cold_starts: u64,
    #[serde(default)]
    pub evictions: u64,
}

impl DispatcherCounters {
    /// Dispatcher time per completed request (ns).
    pub fn busy_ns_per_request(&self) -> f64 {
        self.busy_ns as f64 / self.completed.max(1) as f64
    }
    pub fn events_per_launch(&self) -> f64 {
        self.events as f64 / self.launches.max(1) as f64
    }
}

/// A serving system the load generator can drive.
pub trait Target {
    /// What is being measured ("kairos, virtual-time driver").
    fn label(&self) -> String;
    /// The device ("NVIDIA H200", "simulated H200").
    fn device(&self) -> String;
    /// True when time is virtual (results are deterministic and wall time is irrelevant).
    fn simulated(&self) -> bool;
    /// Starts a fresh serving instance with this dispatcher configuration (no models loaded).
    fn begin(&mut self, config: &Config) -> Result<(), Error>;
    /// Stops it: cancels what is still queued or running and frees its memory. Completions not
    /// yet collected are dropped.
    fn end(&mut self) -> Result<(), Error>;
    /// The target's clock (ns).
    fn now_ns(&self) -> u64;
    /// Loads a model now (blocking: the time it takes is time the target spends).
    fn load_model(&mut self, spec: &ModelSpec) -> Result<ModelInfo, Error>;
    /// Starts unloading a model: new requests for it are refused, its memory is freed once its
    /// requests are done. Does not wait.
    fn unload_model(&mut self, name: &str) -> Result<(), Error>;
    /// Submits a request that arrived at `arrival_ns` (now or earlier, on the target's clock).
    /// Refusals (overload, unknown model) come back as completions with an error.
    fn submit(&mut self, tag: u64, model: &str, arrival_ns: u64, options: RequestOptions) -> Result<(), Error>;
    /// Waits until at least one completion is available (appended to `out`) or the clock reaches
    /// `until_ns`, whichever comes first.
    fn wait(&mut self, until_ns: u64, out: &mut Vec<Completion>) -> Result<(), Error>;
    /// The dispatcher's counters since `begin`, if the target can see them (before `end`).
    fn counters(&self) -> Option<DispatcherCounters> {
        None
    }
}

/// The dispatcher in the GPU's clock on the calling thread.
pub struct VirtualTarget<G: Gpu> {
    gpu: Option<G>,
    driver: Option<VirtualDriver<G>>,
    simulated: bool,
    device: String,
    tags: HashMap<RequestId, u64>,
    request_host_ns: u64,
}

impl<G: Gpu> VirtualTarget<G> {
    /// `simulated`: whether `gpu` keeps virtual time (the simulator) or real time.
    pub fn new(gpu: G, simulated: bool) -> VirtualTarget<G> {
        let name = gpu.info().name.clone();
        let device = if simulated && !name.contains("simulated") { format!("simulated {name}") } else { name };
        VirtualTarget { gpu: Some(gpu), driver: None, simulated, device, tags: HashMap::new(), request_host_ns: 0 }
    }

    /// Charges each request a serving engine's host path of `ns`: it reaches the dispatcher that
    /// long after its arrival ([`VirtualDriver::set_request_host_ns`]). For the simulator, whose
    /// GPU does not see the threaded engine's queue, thread wake-up and completion callback
    /// (`kairos_sim::LatencyDesc::request_host_ns`); 0 (the default) charges nothing.
    pub fn with_request_host_ns(mut self, ns: u64) -> VirtualTarget<G> {
        self.request_host_ns = ns;
        self
    }

    /// Ends any run and gives the GPU back.
    pub fn into_gpu(mut self) -> Result<G, Error> {
        self.end()?;
        self.gpu.take().ok_or_else(|| Error::Invalid("the target lost its GPU in a failed start".into()))
    }

    fn driver(&mut self) -> Result<&mut VirtualDriver<G>, Error> {
        self.driver.as_mut().ok_or_else(|| Error::Invalid("the target was not started (begin)".into()))
    }
}

impl<G: Gpu> Target for VirtualTarget<G> {
    fn label(&self) -> String {
        "kairos in-process, dispatcher driven in the GPU's clock".into()
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn simulated(&self) -> bool {
        self.simulated
    }

    fn begin(&mut self, config: &Config) -> Result<(), Error> {
        self.end()?;
        config.validate()?;
        let gpu = self.gpu.take().ok_or_else(|| Error::Invalid("the target lost its GPU in a failed start".into()))?;
        let mut driver = VirtualDriver::new(config.clone(), gpu)?;
        driver.set_request_host_ns(self.request_host_ns);
        self.driver = Some(driver);
        self.tags.clear();
        Ok(())
    }

    fn end(&mut self) -> Result<(), Error> {
        let Some(mut d) = self.driver.take() else { return Ok(()) };
        let now = d.now_ns();
        d.schedule_command(now, Command::Shutdown);
        let result = d.run_until_idle();
        self.gpu = Some(d.into_gpu());
        self.tags.clear();
        result.map_err(Error::from)
    }

    fn now_ns(&self) -> u64 {
        match (&self.driver, &self.gpu) {
            (Some(d), _) => d.now_ns(),
            (None, Some(g)) => g.now_ns(),
            (None, None) => 0,
        }
    }

    fn load_model(&mut self, spec: &ModelSpec) -> Result<ModelInfo, Error> {
        Ok(self.driver()?.load_model(spec.clone())?)
    }

    fn unload_model(&mut self, name: &str) -> Result<(), Error> {
        let d = self.driver()?;
        let now = d.now_ns();
        d.schedule_command(now, Command::UnloadModel(name.to_string()));
        Ok(())
    }

    fn submit(&mut self, tag: u64, model: &str, arrival_ns: u64, options: RequestOptions) -> Result<(), Error> {
        let id = self.driver()?.submit_at(arrival_ns, model, vec![], options);
        self.tags.insert(id, tag);
        Ok(())
    }

    fn counters(&self) -> Option<DispatcherCounters> {
        let s = self.driver.as_ref()?.dispatcher().stats();
        Some(DispatcherCounters {
            completed: s.completed,
            launches: s.launches,
            events: s.events,
            launches_lost: s.launches_lost,
            busy_ns: s.launch_call_ns + s.policy_ns + s.events_ns,
            launch_call_ns: s.launch_call_ns,
            policy_ns: s.policy_ns,
            events_ns: s.events_ns,
            runs_launched: s.runs_launched,
            runs_recorded: s.runs_recorded,
            run_record_ns: s.run_record_ns,
            segments_launched: s.segments_launched,
            masked_launches: s.masked_launches,
            partition_launches: s.partition_launches,
            partition_fallbacks: s.partition_fallbacks,
            preemptions: s.preemptions,
            cold_starts: s.cold_starts,
            evictions: s.evictions,
        })
    }

    fn wait(&mut self, until_ns: u64, out: &mut Vec<Completion>) -> Result<(), Error> {
        let Some(d) = self.driver.as_mut() else { return Err(Error::Invalid("the target was not started (begin)".into())) };
        loop {
            // Everything due at this instant: scheduled commands, GPU events, the policy's decisions.
            let now = d.now_ns();
            d.run_until(now)?;
            for r in d.take_records() {
                let tag = self.tags.remove(&r.id).ok_or_else(|| Error::Invalid(format!("unknown request {:?}", r.id)))?;
                out.push(Completion { tag, done_ns: r.done_ns, result: r.result });
            }
            if !out.is_empty() || d.now_ns() >= until_ns {
                return Ok(());
            }
            let disp = d.dispatcher();
            // A policy holding work back until a time (`reef`'s hold-off), or a request reaching
            // the dispatcher after its host path: wait until then.
            let wake = [disp.wake_at_ns(), d.next_scheduled_ns()].into_iter().flatten().filter(|&w| w > d.now_ns()).min();
            if disp.work_in_flight() == 0 && disp.jobs() > 0 && wake.is_none() {
                return Err(Error::Invalid(format!(
                    "the dispatcher stalled at {} ns: {} requests held and nothing in flight (policy {})",
                    d.now_ns(),
                    disp.jobs(),
                    disp.policy_name()
                )));
            }
            d.dispatcher_mut().gpu_mut().wait(wake.map_or(until_ns, |w| w.min(until_ns))).map_err(kairos_sched::Error::from)?;
        }
    }
}

/// The threaded [`Engine`], fed from the caller's thread; a fresh engine (and GPU, from the
/// factory) per `begin`.
pub struct EngineTarget<G, F>
where
    G: Gpu + 'static,
    F: Fn() -> kairos_gpu::Result<G> + Clone + Send + 'static,
{
    factory: F,
    base: EngineConfig,
    simulated: bool,
    engine: Option<Arc<Engine>>,
    device: String,
    epoch: Instant,
    tx: Sender<Completion>,
    rx: Receiver<Completion>,
    pending: Vec<Completion>,
    helpers: Vec<JoinHandle<()>>,
    _gpu: std::marker::PhantomData<fn() -> G>,
}

impl<G, F> EngineTarget<G, F>
where
    G: Gpu + 'static,
    F: Fn() -> kairos_gpu::Result<G> + Clone + Send + 'static,
{
    /// `base` gives the queue sizes and wait times; its dispatcher config is replaced per run.
    /// `simulated`: the factory builds a simulator (its virtual clock then runs as fast as the
    /// dispatcher thread spins: only functional results mean anything).
    pub fn new(factory: F, base: EngineConfig, simulated: bool) -> EngineTarget<G, F> {
        let (tx, rx) = mpsc::channel();
        EngineTarget {
            factory,
            base,
            simulated,
            engine: None,
            device: String::new(),
            epoch: Instant::now(),
            tx,
            rx,
            pending: Vec::new(),
            helpers: Vec::new(),
            _gpu: std::marker::PhantomData,
        }
    }

    fn engine(&self) -> Result<&Arc<Engine>, Error> {
        self.engine.as_ref().ok_or_else(|| Error::Invalid("the target was not started (begin)".into()))
    }
}

impl<G, F> Target for EngineTarget<G, F>
where
    G: Gpu + 'static,
    F: Fn() -> kairos_gpu::Result<G> + Clone + Send + 'static,
{
    fn label(&self) -> String {
        "kairos in-process, threaded engine (bounded queue, completion callbacks)".into()
    }

    fn device(&self) -> String {
        if self.simulated && !self.device.contains("simulated") {
            format!("simulated {}", self.device)
        } else {
            self.device.clone()
        }
    }

    fn simulated(&self) -> bool {
        self.simulated
    }

    fn begin(&mut self, config: &Config) -> Result<(), Error> {
        self.end()?;
        let cfg = EngineConfig { dispatcher: config.clone(), ..self.base.clone() };
        let engine = Engine::start(cfg, self.factory.clone())?;
        self.device = engine.device().name.clone();
        self.engine = Some(Arc::new(engine));
        // A fresh channel: completions of an earlier run can never leak into this one.
        let (tx, rx) = mpsc::channel();
        self.tx = tx;
        self.rx = rx;
        self.pending.clear();
        Ok(())
    }

    fn end(&mut self) -> Result<(), Error> {
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
        if let Some(e) = self.engine.take() {
            match Arc::try_unwrap(e) {
                Ok(engine) => engine.shutdown(),
                Err(_) => return Err(Error::Invalid("the engine is still shared at the end of a run".into())),
            }
        }
        Ok(())
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn load_model(&mut self, spec: &ModelSpec) -> Result<ModelInfo, Error> {
        Ok(self.engine()?.load_model(spec.clone())?)
    }

    fn unload_model(&mut self, name: &str) -> Result<(), Error> {
        // Engine::unload_model waits for the model's last request: do it beside the generator.
        let engine = self.engine()?.clone();
        let name = name.to_string();
        let h = std::thread::Builder::new()
            .name("kairos-bench-unload".into())
            .spawn(move || {
                let _ = engine.unload_model(&name);
            })
            .map_err(|e| Error::Invalid(format!("cannot start an unload thread: {e}")))?;
        self.helpers.push(h);
        Ok(())
    }

    fn submit(&mut self, tag: u64, model: &str, _arrival_ns: u64, options: RequestOptions) -> Result<(), Error> {
        let tx = self.tx.clone();
        let epoch = self.epoch;
        let r = self.engine()?.submit_with(model, vec![], options, move |r| {
            let done_ns = epoch.elapsed().as_nanos() as u64;
            let _ = tx.send(Completion { tag, done_ns, result: r.map(|x| x.timing) });
        });
        if let Err(e) = r {
            let done_ns = self.now_ns();
            self.pending.push(Completion { tag, done_ns, result: Err(e) });
        }
        Ok(())
    }

    fn wait(&mut self, until_ns: u64, out: &mut Vec<Completion>) -> Result<(), Error> {
        let now = self.now_ns();
        wait_on_channel(&self.rx, &mut self.pending, now, until_ns, out, "the engine's completions stopped")
    }

    fn counters(&self) -> Option<DispatcherCounters> {
        let s = self.engine.as_ref()?.stats();
        Some(DispatcherCounters {
            completed: s.completed,
            launches: s.launches,
            events: s.events,
            launches_lost: s.launches_lost,
            busy_ns: s.busy_ns,
            launch_call_ns: s.launch_call_ns,
            policy_ns: s.policy_ns,
            events_ns: s.events_ns,
            runs_launched: s.runs_launched,
            runs_recorded: s.runs_recorded,
            run_record_ns: s.run_record_ns,
            segments_launched: s.segments_launched,
            masked_launches: s.masked_launches,
            partition_launches: s.partition_launches,
            partition_fallbacks: s.partition_fallbacks,
            preemptions: s.preemptions,
            cold_starts: s.cold_starts,
            evictions: s.evictions,
        })
    }
}

/// [`Target::wait`] for targets whose completions arrive on a channel: `pending` (refusals found
/// at submission) first; if there is nothing, waits on `rx` until `until_ns` (the clock read
/// `now_ns`); then whatever else is already there.
pub(crate) fn wait_on_channel(
    rx: &Receiver<Completion>,
    pending: &mut Vec<Completion>,
    now_ns: u64,
    until_ns: u64,
    out: &mut Vec<Completion>,
    stopped: &str,
) -> Result<(), Error> {
    out.append(pending);
    if out.is_empty() && until_ns > now_ns {
        match rx.recv_timeout(Duration::from_nanos(until_ns - now_ns)) {
            Ok(c) => out.push(c),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Err(Error::Invalid(stopped.into())),
        }
    }
    while let Ok(c) = rx.try_recv() {
        out.push(c);
    }
    Ok(())
}

impl<G, F> Drop for EngineTarget<G, F>
where
    G: Gpu + 'static,
    F: Fn() -> kairos_gpu::Result<G> + Clone + Send + 'static,
{
    fn drop(&mut self) {
        let _ = self.end();
    }
}

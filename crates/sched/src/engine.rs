//! The dispatcher as an actor: one thread owns the [`Dispatcher`] and the GPU; callers on any
//! thread talk to it through a bounded queue of commands.
//!
//! ```text
//!   submit / cancel / load / unload / shutdown          completions (callbacks, handles)
//!   ---- bounded queue (submit_queue_max) ---->  [dispatcher thread]  ---->
//!                                                  poll GPU events, run the policy, launch
//! ```
//!
//! The GPU is constructed on the dispatcher thread by the factory given to [`Engine::start`]
//! (a CUDA context is thread-affine). A full queue is [`Error::Overloaded`] at once; nothing
//! blocks a submitter. Completion callbacks run on the dispatcher thread and must be quick (send
//! on a channel, wake a task); [`RequestHandle`] wraps one for callers that want to block or poll.
//!
//! **Supervision.** When the GPU fails (it cannot report its events, a sticky fault, a launch past
//! the watchdog's bound: [`Error::GpuFailed`] from [`Dispatcher::poll_gpu`]), the thread resets it
//! with [`Dispatcher::recover`]: the requests it held fail with [`Error::GpuFailed`], the models
//! and host mappings come back, and serving goes on; commands wait in the queue meanwhile. A
//! line on stderr and [`Engine::recoveries`] say what happened; [`EngineStats`] counts it. Only
//! when `EngineConfig::recovery_attempts_max` resets ([`RECOVERY_ATTEMPTS_MAX`] by default) in a row fail does the engine stop (every request then
//! fails).

use crate::SUBMIT_QUEUE_MAX;
use crate::dispatcher::{Config, Dispatcher};
use crate::request::*;
use kairos_core::Tensor;
use kairos_gpu::{DeviceInfo, Gpu, HostMapping, HostMappingId, HostMemory};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Commands taken from the queue per turn of the loop before the GPU is polled again.
const COMMANDS_PER_TURN: usize = 256;
/// Resets tried in a row after a GPU fault before the engine gives up (and fails every request).
pub const RECOVERY_ATTEMPTS_MAX: u32 = 3;
/// Pause between two reset attempts.
const RECOVERY_RETRY_MS: u64 = 200;
/// Recovery reports the engine keeps (the latest ones).
pub const RECOVERY_REPORTS_MAX: usize = 16;

#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub dispatcher: Config,
    /// Commands waiting for the dispatcher thread; a submit beyond it is refused as overloaded.
    pub submit_queue_max: usize,
    /// With launches in flight and nothing to do, the thread waits on the GPU this long before
    /// it looks at the queue again (0: spin, Paella's dedicated-core mode).
    pub gpu_wait_ns: u64,
    /// With nothing in flight, the thread sleeps on the queue this long at most.
    pub idle_wait_ms: u64,
    /// With nothing in flight, the thread first polls the queue (one core busy) for this long
    /// since it last had work, before it sleeps: a request arriving meanwhile is taken without a
    /// thread wake-up (tens of µs, more from deep CPU idle states). 0: sleep at once. A server
    /// whose real-time requests arrive further apart than this still pays the wake-up.
    pub idle_spin_ns: u64,
    /// Resets tried in a row after a GPU fault before the engine stops. 0: none — the engine
    /// answers every request held and stops at the first fault; a GPU worker process runs so,
    /// since a sticky CUDA fault outlives any reset and a reset waits for the kernels still
    /// running (a hung one for ever), while the process's exit ends them all.
    pub recovery_attempts_max: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            dispatcher: Config::default(),
            submit_queue_max: 4096,
            gpu_wait_ns: 2_000,
            idle_wait_ms: 50,
            idle_spin_ns: 0,
            recovery_attempts_max: RECOVERY_ATTEMPTS_MAX,
        }
    }
}

type Completer = Box<dyn FnOnce(Result<Response, Error>) + Send>;
type Notifier = Box<dyn FnOnce() + Send>;

enum Reply {
    None,
    Request(Completer),
    /// A request with a callback for [`Output::AlmostDone`].
    RequestNotify(Completer, Notifier),
    Load(SyncSender<Result<ModelInfo, Error>>),
    Unload(SyncSender<Result<(), Error>>),
    Map(SyncSender<Result<HostMapping, Error>>),
    Unmap(SyncSender<Result<(), Error>>),
}

struct Envelope {
    command: Command,
    reply: Reply,
}

#[derive(Default)]
struct Shared {
    next_id: AtomicU64,
    submitted: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    rejected: AtomicU64,
    jobs: AtomicU64,
    launches_in_flight: AtomicU64,
    launches: AtomicU64,
    preemptions: AtomicU64,
    events: AtomicU64,
    launches_lost: AtomicU64,
    busy_ns: AtomicU64,
    launch_call_ns: AtomicU64,
    policy_ns: AtomicU64,
    events_ns: AtomicU64,
    runs_launched: AtomicU64,
    runs_recorded: AtomicU64,
    run_record_ns: AtomicU64,
    segments_launched: AtomicU64,
    masked_launches: AtomicU64,
    partition_launches: AtomicU64,
    partition_fallbacks: AtomicU64,
    cold_starts: AtomicU64,
    loads_completed: AtomicU64,
    load_ns: AtomicU64,
    loaded_bytes: AtomicU64,
    evictions: AtomicU64,
    secondary_busy_loads: AtomicU64,
    resident_weight_bytes: AtomicU64,
    gpu_recoveries: AtomicU64,
    recovering: AtomicBool,
    /// Why the dispatcher thread stopped for good (its GPU could not be brought back).
    stopped: Mutex<Option<String>>,
    recoveries: Mutex<VecDeque<RecoveryReport>>,
}

/// A snapshot of the engine's counters (for metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// Requests accepted into the queue.
    pub submitted: u64,
    pub completed: u64,
    /// Completed with an error (cancelled, invalid, GPU error, shutdown).
    pub failed: u64,
    /// Of `failed`, those answered [`Error::Cancelled`] (a [`Command::Cancel`] stopped them).
    pub cancelled: u64,
    /// Refused at the queue (overloaded).
    pub rejected: u64,
    /// Requests in the dispatcher (waiting or admitted), as of the last turn of its loop.
    pub jobs: u64,
    pub launches_in_flight: u64,
    /// Kernel launches issued so far.
    pub launches: u64,
    /// Launches a policy preempted so far (they resume where they stopped).
    pub preemptions: u64,
    /// GPU events read (notification records, copies done): over `launches`, the records per launch.
    pub events: u64,
    /// Launches the GPU lost (notification ring overflow); their requests failed.
    pub launches_lost: u64,
    /// Time the dispatcher thread spent working (commands, GPU events, decisions, launches), i.e.
    /// not waiting on its queue or the GPU: its CPU time in the serving loop.
    pub busy_ns: u64,
    /// Of that, in `Gpu::launch` calls, in the policy, and reading and applying GPU events.
    pub launch_call_ns: u64,
    pub policy_ns: u64,
    pub events_ns: u64,
    /// Whole jobs issued as recorded runs, runs recorded, and the time recording took (see
    /// [`crate::Config::record_runs`]).
    pub runs_launched: u64,
    pub runs_recorded: u64,
    pub run_record_ns: u64,
    /// Kernel-level segments issued as recorded runs (see [`crate::Config::run_segment_ns`]).
    pub segments_launched: u64,
    /// Launches confined by an SM mask (see [`crate::DispatcherStats::masked_launches`]).
    pub masked_launches: u64,
    /// Of those, on a hardware partition, and masks that could not be one (see
    /// [`crate::DispatcherStats::partition_launches`]).
    pub partition_launches: u64,
    pub partition_fallbacks: u64,
    /// Times the GPU was reset after a fault, and whether a reset is under way now.
    pub gpu_recoveries: u64,
    pub recovering: bool,
    /// Under a weight budget ([`crate::Config::weight_budget_bytes`]): loads of models not in
    /// device memory started by a request (cold starts), loads completed and their summed time,
    /// bytes loaded, models evicted, and the device bytes of loaded and loading models now.
    pub cold_starts: u64,
    pub loads_completed: u64,
    pub load_ns: u64,
    pub loaded_bytes: u64,
    pub evictions: u64,
    /// Loads that copied a secondary GPU's part themselves because its link was busy.
    pub secondary_busy_loads: u64,
    pub resident_weight_bytes: u64,
}

/// The in-process serving API: one dispatcher thread and its GPU.
pub struct Engine {
    tx: SyncSender<Envelope>,
    shared: Arc<Shared>,
    device: DeviceInfo,
    submit_queue_max: usize,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the dispatcher thread, builds the GPU on it with `make_gpu`, and returns once the GPU
    /// is up (or with its error).
    pub fn start<G, F>(config: EngineConfig, make_gpu: F) -> Result<Engine, Error>
    where
        G: Gpu + 'static,
        F: FnOnce() -> kairos_gpu::Result<G> + Send + 'static,
    {
        config.dispatcher.validate()?;
        if config.submit_queue_max == 0 || config.submit_queue_max > SUBMIT_QUEUE_MAX {
            return Err(Error::InvalidInput(format!(
                "submit_queue_max = {} must be in 1..={SUBMIT_QUEUE_MAX}",
                config.submit_queue_max
            )));
        }
        let (tx, rx) = mpsc::sync_channel::<Envelope>(config.submit_queue_max);
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<DeviceInfo, Error>>(1);
        let shared = Arc::new(Shared::default());
        let thread_shared = shared.clone();
        let submit_queue_max = config.submit_queue_max;
        let thread = std::thread::Builder::new()
            .name("kairos-dispatcher".into())
            .spawn(move || {
                let gpu = match make_gpu() {
                    Ok(g) => g,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                let dispatcher = match Dispatcher::new(config.dispatcher.clone(), gpu) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(dispatcher.gpu().info().clone()));
                run(dispatcher, rx, &thread_shared, &config);
            })
            .map_err(|e| Error::Gpu(format!("cannot start the dispatcher thread: {e}")))?;
        let device = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(Error::Gpu("the dispatcher thread died while starting".into()));
            }
        };
        Ok(Engine { tx, shared, device, submit_queue_max, thread: Some(thread) })
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.device
    }

    /// Loads a model (uploads its weights); blocks until it is ready.
    pub fn load_model(&self, spec: ModelSpec) -> Result<ModelInfo, Error> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send_blocking(Envelope { command: Command::LoadModel(spec), reply: Reply::Load(tx) })?;
        rx.recv().map_err(|_| Error::ShuttingDown)?
    }

    /// Unloads a model; blocks until its last request is done and its memory is freed.
    pub fn unload_model(&self, name: &str) -> Result<(), Error> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send_blocking(Envelope { command: Command::UnloadModel(name.to_string()), reply: Reply::Unload(tx) })?;
        rx.recv().map_err(|_| Error::ShuttingDown)?
    }

    /// Submits a request; the result arrives through the handle.
    pub fn submit(&self, model: &str, inputs: Vec<Tensor>, options: RequestOptions) -> Result<RequestHandle, Error> {
        let slot = Arc::new(Slot { state: Mutex::new(SlotState::Pending), ready: Condvar::new() });
        let s = slot.clone();
        let id = self.submit_with(model, inputs, options, move |result| s.complete(result))?;
        Ok(RequestHandle { id, slot, tx: self.tx.clone() })
    }

    /// Submits a request; `on_done` runs on the dispatcher thread with its result.
    pub fn submit_with(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        options: RequestOptions,
        on_done: impl FnOnce(Result<Response, Error>) + Send + 'static,
    ) -> Result<RequestId, Error> {
        self.send_request(model, inputs, options, Reply::Request(Box::new(on_done)))
    }

    fn send_request(&self, model: &str, inputs: Vec<Tensor>, options: RequestOptions, reply: Reply) -> Result<RequestId, Error> {
        self.send_any(model, inputs, None, options, reply)
    }

    fn send_any(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        binding: Option<IoBinding>,
        options: RequestOptions,
        reply: Reply,
    ) -> Result<RequestId, Error> {
        let id = RequestId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let request = Request { id, model: model.to_string(), inputs, options, arrival_ns: None };
        let command = match binding {
            Some(b) => Command::SubmitBound(request, b),
            None => Command::Submit(request),
        };
        match self.tx.try_send(Envelope { command, reply }) {
            Ok(()) => {
                self.shared.submitted.fetch_add(1, Ordering::Relaxed);
                Ok(id)
            }
            Err(TrySendError::Full(_)) => {
                self.shared.rejected.fetch_add(1, Ordering::Relaxed);
                Err(Error::Overloaded { what: "submission queue", max: self.submit_queue_max as u64 })
            }
            Err(TrySendError::Disconnected(_)) => Err(match self.stopped() {
                Some(why) => Error::GpuFailed(format!("the engine stopped: {why}")),
                None => Error::ShuttingDown,
            }),
        }
    }

    /// Like [`Engine::submit_with`], and `before_done` runs on the dispatcher thread when the
    /// request's last launch is issued (see [`Output::AlmostDone`]; it does not run if the request
    /// fails before that). Sets `notify_before_done` in the options.
    pub fn submit_notify(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        mut options: RequestOptions,
        before_done: impl FnOnce() + Send + 'static,
        on_done: impl FnOnce(Result<Response, Error>) + Send + 'static,
    ) -> Result<RequestId, Error> {
        options.notify_before_done = true;
        self.send_request(model, inputs, options, Reply::RequestNotify(Box::new(on_done), Box::new(before_done)))
    }

    /// Maps caller memory into the GPU for zero-copy requests ([`Engine::submit_bound`]); blocks
    /// until the dispatcher thread answered. Backends without mapped host memory answer
    /// `Error::Gpu` with the backend's reason (the caller keeps copying).
    pub fn map_host(&self, memory: std::sync::Arc<dyn HostMemory>) -> Result<HostMapping, Error> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send_blocking(Envelope { command: Command::MapHost(memory), reply: Reply::Map(tx) })?;
        rx.recv().map_err(|_| Error::ShuttingDown)?
    }

    /// Unmaps a mapping: requests naming it are refused from now on, and this blocks until the
    /// ones already submitted have completed and the GPU let go of the memory.
    pub fn unmap_host(&self, id: HostMappingId) -> Result<(), Error> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send_blocking(Envelope { command: Command::UnmapHost(id), reply: Reply::Unmap(tx) })?;
        rx.recv().map_err(|_| Error::ShuttingDown)?
    }

    /// Submits a request whose inputs and/or outputs live in a host mapping (see [`IoBinding`]):
    /// `inputs` are the tensors of the inputs the binding does not name (none when it names
    /// them); the response carries no outputs that the binding names. `before_done`, if given,
    /// runs as in [`Engine::submit_notify`].
    pub fn submit_bound(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        binding: IoBinding,
        mut options: RequestOptions,
        before_done: Option<Box<dyn FnOnce() + Send>>,
        on_done: impl FnOnce(Result<Response, Error>) + Send + 'static,
    ) -> Result<RequestId, Error> {
        let reply = match before_done {
            Some(n) => {
                options.notify_before_done = true;
                Reply::RequestNotify(Box::new(on_done), n)
            }
            None => Reply::Request(Box::new(on_done)),
        };
        self.send_any(model, inputs, Some(binding), options, reply)
    }

    /// Cancels a request (see [`Command::Cancel`]); its completion reports [`Error::Cancelled`].
    /// Blocks while the submission queue is full.
    pub fn cancel(&self, id: RequestId) -> Result<(), Error> {
        self.send_blocking(Envelope { command: Command::Cancel(id), reply: Reply::None })
    }

    /// [`Engine::cancel`] without blocking: [`Error::Overloaded`] when the submission queue is full
    /// (try again later), [`Error::ShuttingDown`] when the engine has stopped.
    pub fn try_cancel(&self, id: RequestId) -> Result<(), Error> {
        match self.tx.try_send(Envelope { command: Command::Cancel(id), reply: Reply::None }) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(Error::Overloaded { what: "submission queue", max: self.submit_queue_max as u64 }),
            Err(TrySendError::Disconnected(_)) => Err(Error::ShuttingDown),
        }
    }

    pub fn stats(&self) -> EngineStats {
        let s = &self.shared;
        EngineStats {
            submitted: s.submitted.load(Ordering::Relaxed),
            completed: s.completed.load(Ordering::Relaxed),
            failed: s.failed.load(Ordering::Relaxed),
            cancelled: s.cancelled.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
            jobs: s.jobs.load(Ordering::Relaxed),
            launches_in_flight: s.launches_in_flight.load(Ordering::Relaxed),
            launches: s.launches.load(Ordering::Relaxed),
            preemptions: s.preemptions.load(Ordering::Relaxed),
            events: s.events.load(Ordering::Relaxed),
            launches_lost: s.launches_lost.load(Ordering::Relaxed),
            busy_ns: s.busy_ns.load(Ordering::Relaxed),
            launch_call_ns: s.launch_call_ns.load(Ordering::Relaxed),
            policy_ns: s.policy_ns.load(Ordering::Relaxed),
            events_ns: s.events_ns.load(Ordering::Relaxed),
            runs_launched: s.runs_launched.load(Ordering::Relaxed),
            runs_recorded: s.runs_recorded.load(Ordering::Relaxed),
            run_record_ns: s.run_record_ns.load(Ordering::Relaxed),
            segments_launched: s.segments_launched.load(Ordering::Relaxed),
            masked_launches: s.masked_launches.load(Ordering::Relaxed),
            partition_launches: s.partition_launches.load(Ordering::Relaxed),
            partition_fallbacks: s.partition_fallbacks.load(Ordering::Relaxed),
            cold_starts: s.cold_starts.load(Ordering::Relaxed),
            loads_completed: s.loads_completed.load(Ordering::Relaxed),
            load_ns: s.load_ns.load(Ordering::Relaxed),
            loaded_bytes: s.loaded_bytes.load(Ordering::Relaxed),
            evictions: s.evictions.load(Ordering::Relaxed),
            secondary_busy_loads: s.secondary_busy_loads.load(Ordering::Relaxed),
            resident_weight_bytes: s.resident_weight_bytes.load(Ordering::Relaxed),
            gpu_recoveries: s.gpu_recoveries.load(Ordering::Relaxed),
            recovering: s.recovering.load(Ordering::Relaxed),
        }
    }

    /// Why the engine stopped serving for good, if it did: its GPU failed and could not be reset
    /// (on CUDA, a sticky error such as an illegal address lasts as long as the process). Every
    /// request then fails; a server reports itself not live, so that its supervisor restarts it.
    pub fn stopped(&self) -> Option<String> {
        self.shared.stopped.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The latest GPU recoveries (at most [`RECOVERY_REPORTS_MAX`]), oldest first.
    pub fn recoveries(&self) -> Vec<RecoveryReport> {
        self.shared.recoveries.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }

    /// Cancels everything, frees the GPU's memory and stops the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.tx.send(Envelope { command: Command::Shutdown, reply: Reply::None });
            let _ = t.join();
        }
    }

    fn send_blocking(&self, e: Envelope) -> Result<(), Error> {
        self.tx.send(e).map_err(|_| Error::ShuttingDown)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

enum SlotState {
    Pending,
    Ready(Result<Response, Error>),
    Taken,
}

struct Slot {
    state: Mutex<SlotState>,
    ready: Condvar,
}

impl Slot {
    fn complete(&self, result: Result<Response, Error>) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = SlotState::Ready(result);
        self.ready.notify_all();
    }

    fn take(state: &mut SlotState) -> Option<Result<Response, Error>> {
        match std::mem::replace(state, SlotState::Taken) {
            SlotState::Ready(r) => Some(r),
            SlotState::Taken => Some(Err(Error::InvalidInput("the request's result was already taken".into()))),
            SlotState::Pending => {
                *state = SlotState::Pending;
                None
            }
        }
    }
}

/// A submitted request: wait for its result, poll for it, or cancel it.
pub struct RequestHandle {
    id: RequestId,
    slot: Arc<Slot>,
    tx: SyncSender<Envelope>,
}

impl RequestHandle {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Blocks until the request completes.
    pub fn wait(self) -> Result<Response, Error> {
        let mut state = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = Slot::take(&mut state) {
                return r;
            }
            state = self.slot.ready.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks up to `timeout`; `None` if the request is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<Response, Error>> {
        let state = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        let (mut state, _) = self
            .slot
            .ready
            .wait_timeout_while(state, timeout, |s| matches!(s, SlotState::Pending))
            .unwrap_or_else(|e| e.into_inner());
        Slot::take(&mut state)
    }

    /// The result if the request is done (taken out: later calls say it was taken).
    pub fn poll(&self) -> Option<Result<Response, Error>> {
        Slot::take(&mut self.slot.state.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn cancel(&self) -> Result<(), Error> {
        self.tx.send(Envelope { command: Command::Cancel(self.id), reply: Reply::None }).map_err(|_| Error::ShuttingDown)
    }
}

#[derive(Default)]
struct Waiters {
    requests: HashMap<RequestId, Completer>,
    almost: HashMap<RequestId, Notifier>,
    loads: HashMap<String, VecDeque<SyncSender<Result<ModelInfo, Error>>>>,
    unloads: HashMap<String, VecDeque<SyncSender<Result<(), Error>>>>,
    maps: VecDeque<SyncSender<Result<HostMapping, Error>>>,
    unmaps: HashMap<HostMappingId, VecDeque<SyncSender<Result<(), Error>>>>,
}

impl Waiters {
    fn register(&mut self, e: &mut Envelope) {
        match (std::mem::replace(&mut e.reply, Reply::None), &e.command) {
            (Reply::Request(c), Command::Submit(r) | Command::SubmitBound(r, _)) => {
                self.requests.insert(r.id, c);
            }
            (Reply::RequestNotify(c, n), Command::Submit(r) | Command::SubmitBound(r, _)) => {
                self.requests.insert(r.id, c);
                self.almost.insert(r.id, n);
            }
            (Reply::Load(tx), Command::LoadModel(spec)) => self.loads.entry(spec.name.clone()).or_default().push_back(tx),
            (Reply::Unload(tx), Command::UnloadModel(name)) => self.unloads.entry(name.clone()).or_default().push_back(tx),
            (Reply::Map(tx), Command::MapHost(_)) => self.maps.push_back(tx),
            (Reply::Unmap(tx), Command::UnmapHost(id)) => self.unmaps.entry(*id).or_default().push_back(tx),
            _ => {}
        }
    }

    fn deliver(&mut self, out: &mut Vec<Output>, shared: &Shared) {
        for o in out.drain(..) {
            match o {
                Output::Done { id, result } => {
                    match &result {
                        Ok(_) => shared.completed.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            if *e == Error::Cancelled {
                                shared.cancelled.fetch_add(1, Ordering::Relaxed);
                            }
                            shared.failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                    self.almost.remove(&id);
                    if let Some(c) = self.requests.remove(&id) {
                        c(result);
                    }
                }
                Output::AlmostDone { id } => {
                    if let Some(n) = self.almost.remove(&id) {
                        n();
                    }
                }
                Output::ModelLoaded { name, result } => {
                    if let Some(tx) = self.loads.get_mut(&name).and_then(|q| q.pop_front()) {
                        let _ = tx.send(result);
                    }
                }
                Output::ModelUnloaded { name, result } => {
                    if let Some(tx) = self.unloads.get_mut(&name).and_then(|q| q.pop_front()) {
                        let _ = tx.send(result);
                    }
                }
                Output::HostMapped { result } => {
                    if let Some(tx) = self.maps.pop_front() {
                        let _ = tx.send(result);
                    }
                }
                Output::HostUnmapped { id, result } => {
                    if let Some(q) = self.unmaps.get_mut(&id) {
                        if let Some(tx) = q.pop_front() {
                            let _ = tx.send(result);
                        }
                        if q.is_empty() {
                            self.unmaps.remove(&id);
                        }
                    }
                }
                Output::ShutDown => {}
                Output::Recovered(r) => {
                    eprintln!(
                        "kairos: GPU reset after a fault ({}): {} requests failed, {} models loaded again{}{}, serving again after {:.1} ms",
                        r.cause,
                        r.requests_failed,
                        r.models_reloaded,
                        if r.models_lost.is_empty() {
                            String::new()
                        } else {
                            let lost: Vec<String> = r.models_lost.iter().map(|(m, e)| format!("{m} ({e})")).collect();
                            format!(", lost: {}", lost.join(", "))
                        },
                        if r.mappings_lost > 0 { format!(", {} host mappings lost", r.mappings_lost) } else { String::new() },
                        r.took_ns as f64 / 1e6
                    );
                    shared.gpu_recoveries.fetch_add(1, Ordering::Relaxed);
                    let mut q = shared.recoveries.lock().unwrap_or_else(|e| e.into_inner());
                    if q.len() >= RECOVERY_REPORTS_MAX {
                        q.pop_front();
                    }
                    q.push_back(r);
                }
            }
        }
    }

    /// Completes everything still waiting with `e` (the GPU failed).
    fn abandon(&mut self, e: &Error) {
        self.almost.clear();
        for (_, c) in self.requests.drain() {
            c(Err(e.clone()));
        }
        for (_, q) in self.loads.drain() {
            q.into_iter().for_each(|tx| drop(tx.send(Err(e.clone()))));
        }
        for (_, q) in self.unloads.drain() {
            q.into_iter().for_each(|tx| drop(tx.send(Err(e.clone()))));
        }
        self.maps.drain(..).for_each(|tx| drop(tx.send(Err(e.clone()))));
        for (_, q) in self.unmaps.drain() {
            q.into_iter().for_each(|tx| drop(tx.send(Err(e.clone()))));
        }
    }
}

/// Hands one command to the dispatcher; true for a real-time request (the loop then asks the
/// policy at once, before it handles the GPU's events).
fn take<G: Gpu>(mut e: Envelope, d: &mut Dispatcher<G>, out: &mut Vec<Output>, waiters: &mut Waiters) -> bool {
    waiters.register(&mut e);
    let realtime = matches!(&e.command, Command::Submit(r) | Command::SubmitBound(r, _) if r.options.class == Class::RealTime);
    d.on_command(e.command, out);
    realtime
}

/// Resets the GPU after `fault` (see the module docs); false when it could not be brought back,
/// and then every waiter has been answered with the error.
fn recover<G: Gpu>(
    d: &mut Dispatcher<G>,
    fault: &Error,
    out: &mut Vec<Output>,
    waiters: &mut Waiters,
    shared: &Shared,
    cfg: &EngineConfig,
) -> bool {
    let cause = match fault {
        Error::GpuFailed(c) => c.clone(),
        e => e.to_string(),
    };
    shared.recovering.store(true, Ordering::Relaxed);
    // The requests held get their answers first: a reset can take long (CUDA's waits for the
    // kernels still running, a hung one included).
    d.fail_held(&cause, out);
    waiters.deliver(out, shared);
    // The engine stops: every later request is refused with the reason.
    let stop = |waiters: &mut Waiters, e: Error, note: String| {
        eprintln!("kairos: {note}; the engine stops");
        *shared.stopped.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        waiters.abandon(&e);
        shared.recovering.store(false, Ordering::Relaxed);
        false
    };
    if cfg.recovery_attempts_max == 0 {
        let e = Error::GpuFailed(format!("{cause}; this engine does not reset its GPU in place (a GPU worker restarts instead)"));
        let note = e.to_string();
        return stop(waiters, e, note);
    }
    let attempts = cfg.recovery_attempts_max;
    let mut result = d.recover(&cause, out);
    for _ in 1..attempts {
        if result.is_ok() {
            break;
        }
        waiters.deliver(out, shared);
        std::thread::sleep(Duration::from_millis(RECOVERY_RETRY_MS));
        result = d.recover(&cause, out);
    }
    waiters.deliver(out, shared);
    match result {
        Ok(_) => {
            shared.recovering.store(false, Ordering::Relaxed);
            true
        }
        Err(e) => {
            let note = format!("the GPU could not be reset after {attempts} attempt(s) ({e})");
            stop(waiters, e, note)
        }
    }
}

/// Leaves a GPU that could not be reset without cleaning it up: its driver state is broken (on
/// CUDA a sticky error), and freeing through it is unsafe — measured on an H100: after an illegal
/// address, dropping the context's buffers and streams crashed the process with a segmentation
/// fault inside the driver, taking the server's front ends with it. The engine has stopped and
/// answered every request; the process's exit (or the GPU worker's restart) reclaims the rest.
fn abandon_gpu<G: Gpu>(d: Dispatcher<G>) {
    std::mem::forget(d);
}

fn run<G: Gpu>(mut d: Dispatcher<G>, rx: Receiver<Envelope>, shared: &Shared, cfg: &EngineConfig) {
    let mut out = Vec::new();
    let mut waiters = Waiters::default();
    let mut disconnected = false;
    let mut busy_ns = 0u64;
    let mut active_at = std::time::Instant::now();
    loop {
        let turn = std::time::Instant::now();
        let mut busy = false;
        let mut realtime = false;
        for _ in 0..COMMANDS_PER_TURN {
            match rx.try_recv() {
                Ok(e) => {
                    busy = true;
                    realtime |= take(e, &mut d, &mut out, &mut waiters);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if !disconnected {
                        disconnected = true;
                        d.on_command(Command::Shutdown, &mut out);
                    }
                    break;
                }
            }
        }
        // A real-time arrival's first launch goes out before this turn's GPU events are handled
        // (with many best-effort launches in flight, handling them took the dispatcher up to
        // ~25 µs: measured on an H200, DISB E); poll_gpu asks the policy again after them.
        if realtime {
            d.dispatch(&mut out);
        }
        match d.poll_gpu(&mut out) {
            Ok(n) => busy |= n > 0,
            Err(e) => {
                waiters.deliver(&mut out, shared);
                if !recover(&mut d, &e, &mut out, &mut waiters, shared, cfg) {
                    abandon_gpu(d);
                    return;
                }
                continue;
            }
        }
        waiters.deliver(&mut out, shared);
        let s = d.stats();
        shared.jobs.store(d.jobs() as u64, Ordering::Relaxed);
        shared.launches_in_flight.store(d.launches_in_flight() as u64, Ordering::Relaxed);
        shared.launches.store(s.launches, Ordering::Relaxed);
        shared.preemptions.store(s.preemptions, Ordering::Relaxed);
        shared.events.store(s.events, Ordering::Relaxed);
        shared.launches_lost.store(s.launches_lost, Ordering::Relaxed);
        shared.launch_call_ns.store(s.launch_call_ns, Ordering::Relaxed);
        shared.policy_ns.store(s.policy_ns, Ordering::Relaxed);
        shared.events_ns.store(s.events_ns, Ordering::Relaxed);
        shared.runs_launched.store(s.runs_launched, Ordering::Relaxed);
        shared.runs_recorded.store(s.runs_recorded, Ordering::Relaxed);
        shared.run_record_ns.store(s.run_record_ns, Ordering::Relaxed);
        shared.segments_launched.store(s.segments_launched, Ordering::Relaxed);
        shared.masked_launches.store(s.masked_launches, Ordering::Relaxed);
        shared.partition_launches.store(s.partition_launches, Ordering::Relaxed);
        shared.partition_fallbacks.store(s.partition_fallbacks, Ordering::Relaxed);
        shared.cold_starts.store(s.cold_starts, Ordering::Relaxed);
        shared.loads_completed.store(s.loads_completed, Ordering::Relaxed);
        shared.load_ns.store(s.load_ns, Ordering::Relaxed);
        shared.loaded_bytes.store(s.loaded_bytes, Ordering::Relaxed);
        shared.evictions.store(s.evictions, Ordering::Relaxed);
        shared.secondary_busy_loads.store(s.secondary_busy_loads, Ordering::Relaxed);
        shared.resident_weight_bytes.store(d.resident_weight_bytes(), Ordering::Relaxed);
        // A turn that found nothing to do only looked: its time is waiting, not work.
        if busy || !out.is_empty() {
            busy_ns += turn.elapsed().as_nanos() as u64;
            shared.busy_ns.store(busy_ns, Ordering::Relaxed);
        }
        if d.is_shut_down() {
            return;
        }
        if busy {
            active_at = turn;
            continue;
        }
        let in_flight = d.work_in_flight();
        // The policy holds work back until a time (`reef`'s hold-off): keep looking till then,
        // waiting on the GPU in short steps as with work in flight (a simulated GPU's clock only
        // moves when waited on).
        let wake = d.wake_at_ns().filter(|&w| w > d.gpu().now_ns());
        if in_flight > 0 || wake.is_some() {
            active_at = turn;
        }
        if in_flight == 0 && wake.is_none() {
            if disconnected {
                continue;
            }
            if cfg.idle_spin_ns > 0 && (active_at.elapsed().as_nanos() as u64) < cfg.idle_spin_ns {
                std::hint::spin_loop();
                continue;
            }
            match rx.recv_timeout(Duration::from_millis(cfg.idle_wait_ms)) {
                Ok(e) => {
                    if take(e, &mut d, &mut out, &mut waiters) {
                        d.dispatch(&mut out);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    disconnected = true;
                    d.on_command(Command::Shutdown, &mut out);
                }
            }
        } else if cfg.gpu_wait_ns > 0 {
            let until = d.gpu().now_ns().saturating_add(cfg.gpu_wait_ns).min(wake.unwrap_or(u64::MAX));
            if let Err(e) = d.gpu_mut().wait(until) {
                let e = Error::GpuFailed(format!("waiting on the GPU failed: {e}"));
                if !recover(&mut d, &e, &mut out, &mut waiters, shared, cfg) {
                    abandon_gpu(d);
                    return;
                }
            }
        }
    }
}

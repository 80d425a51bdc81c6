//! The server's state: one engine per GPU, the table of models, and the one submission path that
//! every front end uses. Front ends never touch scheduler state: they resolve a model here, bind
//! their decoded tensors to its inputs, and hand the request to an engine as a command.

use crate::error::{Outcome, ServeError};
use crate::inflight::InFlight;
pub use crate::inflight::{CancelCause, Ticket};
use crate::metrics::{EngineView, Metrics, ModelMetrics, Protocol};
use crate::repository::{ModelConfig, ModelSource, Repository, ShapeBounds};
use kairos_gpu::profile::{ModelProfile, ProfileSet};
use kairos_gpu::{HostMapping, HostMemory};
use kairos_ir::plan::{IoTensor, Plan};
use kairos_ir::signature::AxisRole;
use kairos_ir::{DType, Tensor};
use kairos_sched::{Class, Engine, IoBinding, ModelInfo, RequestOptions, TenantId, Timing};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Request priority levels as Triton numbers them: 1 is the most urgent, `PRIORITY_LEVELS_MAX` the
/// least; level L becomes kairos priority `PRIORITY_LEVELS_MAX - L` (higher is more urgent).
pub const PRIORITY_LEVELS_MAX: u64 = 1000;

/// kairos' priority (higher is more urgent) of a priority level (1 is the most urgent; 0: none,
/// kairos priority 0). `level` is at most [`PRIORITY_LEVELS_MAX`].
pub fn priority_of_level(level: u64) -> i32 {
    if level == 0 { 0 } else { (PRIORITY_LEVELS_MAX - level.min(PRIORITY_LEVELS_MAX)) as i32 }
}
/// Request timeouts beyond an hour are refused.
pub const TIMEOUT_US_MAX: u64 = 3_600_000_000;
/// GPUs one server drives.
pub const GPUS_MAX: u32 = 64;
/// Engine load is sampled this often for the busy fraction.
pub const BUSY_SAMPLE_PERIOD_US: u64 = 1000;
/// Samples per busy-ratio window (one second).
pub const BUSY_WINDOW_SAMPLES: u64 = 1000;
/// What a request refused or cancelled by a drain is told.
pub const DRAINING: &str = "the server is draining";
/// The timeout watchdog looks at least this often when it has nothing to wait for.
const WATCHDOG_IDLE: Duration = Duration::from_secs(1);
/// It sends a cancel that an engine's full queue refused again after this long.
const CANCEL_RETRY: Duration = Duration::from_millis(1);

/// Shape variant builds waiting for the builder thread, across models (more: 429).
pub const VARIANT_BUILDS_QUEUED_MAX: usize = 64;
/// Requests waiting for one shape variant's build (more: 429).
pub const VARIANT_WAITERS_MAX: usize = 1024;

/// A model lowered to its plan, ready to load.
#[derive(Clone, Debug)]
pub struct PlannedModel {
    pub config: ModelConfig,
    pub plan: Arc<Plan>,
    pub profile: Option<ModelProfile>,
    /// With shape bounds (`batch_max`, `seq_len_max`): which axes of the inputs and outputs follow
    /// the batch and the sequence length.
    pub axes: Option<ShapeAxes>,
}

/// Which axis of each input and output (plan order) follows the batch or the sequence length;
/// `None` for a fixed axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeAxes {
    pub inputs: Vec<Vec<Option<AxisRole>>>,
    pub outputs: Vec<Vec<Option<AxisRole>>>,
}

/// One shape a model is planned for: its batch and sequence length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShapeKey {
    pub batch: usize,
    pub seq_len: usize,
}

impl ShapeKey {
    /// The engine's name of a variant's instance: `name@b2s40`, `name@b2s40#1`.
    pub fn engine_name(&self, model: &str, instance: Option<usize>) -> String {
        match instance {
            None => format!("{model}@b{}s{}", self.batch, self.seq_len),
            Some(i) => format!("{model}@b{}s{}#{i}", self.batch, self.seq_len),
        }
    }
}

/// A model that serves shapes within bounds: the start-up shape (the model's own instances) and
/// up to `plans_max` other shapes, each a separate engine model planned when a request first
/// needs it ([`State::submit_io`]), least recently used idle ones unloaded first.
pub struct DynamicShapes {
    pub bounds: ShapeBounds,
    pub axes: ShapeAxes,
    /// The start-up shape.
    pub base: ShapeKey,
    variants: Mutex<VariantTable>,
}

impl std::fmt::Debug for DynamicShapes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamicShapes").field("bounds", &self.bounds).field("base", &self.base).finish()
    }
}

/// A request waiting for a variant's build: runs on the builder thread with the variant (its
/// user already counted) or the build's error.
type VariantWaiter = Box<dyn FnOnce(&State, Result<Arc<Variant>, ServeError>) + Send>;

#[derive(Default)]
struct VariantTable {
    slots: BTreeMap<ShapeKey, VariantSlot>,
    /// Advances at each use, for least-recently-used eviction.
    clock: u64,
}

enum VariantSlot {
    Building(Vec<VariantWaiter>),
    Ready(Arc<Variant>),
}

/// A loaded shape variant.
pub struct Variant {
    pub key: ShapeKey,
    /// Its instances (on the GPUs of the model's own, index by index), inputs and outputs.
    pub entry: Arc<ModelEntry>,
    /// Requests that hold it (looked up and not answered yet); never evicted while above zero.
    users: AtomicU32,
    last_used: AtomicU64,
}

impl DynamicShapes {
    /// The loaded variants' shapes, for tests and the log.
    pub fn loaded_shapes(&self) -> Vec<ShapeKey> {
        let t = self.variants.lock().unwrap_or_else(|e| e.into_inner());
        t.slots.iter().filter(|(_, s)| matches!(s, VariantSlot::Ready(_))).map(|(k, _)| *k).collect()
    }
}

/// A variant build for the builder thread.
struct BuildJob {
    model: Arc<ModelEntry>,
    key: ShapeKey,
}

/// Starts the engine of one GPU and adapts plans to it. The server starts its engines before it
/// plans any model (so that it listens at once), then plans and loads the start-up models one by
/// one on a background thread.
pub trait Backend: Send + Sync {
    /// "sim (h100-sxm)", "cuda", ...
    fn describe(&self) -> String;
    /// The engine of device `gpu`, and a name for the device. `models` are models already planned
    /// for it; the server passes none (it starts the engines first) and announces each start-up
    /// model with [`Backend::register_start_model`] instead.
    fn start(&self, gpu: u32, models: &[&PlannedModel]) -> Result<(EngineHandle, String), ServeError>;
    /// Kernel profiles for the dispatcher's estimates, if the backend has a folder of them.
    fn profiles(&self) -> Option<&ProfileSet> {
        None
    }
    /// Adapts a freshly lowered plan to the device before it is loaded (the CUDA backend's
    /// autotuner chooses tiles; changes stay within the plan's logical-block contract). Returns a
    /// line for the log, if there is anything to say.
    fn prepare(&self, _plan: &mut Plan) -> Result<Option<String>, ServeError> {
        Ok(None)
    }
    /// A model of the start-up set is about to be loaded on the engine of `gpu` (called once per
    /// GPU the model names, before its instances load). The simulator registers the model's
    /// measured profile with that GPU here, as it did for the models known when it started. Nothing
    /// by default.
    fn register_start_model(&self, _gpu: u32, _model: &PlannedModel) -> Result<(), ServeError> {
        Ok(())
    }
    /// What the backend is busy with right now, for the reason the server gives while it is not
    /// ready ("compiling kernels 3/7"); `None` when nothing worth saying.
    fn activity(&self) -> Option<String> {
        None
    }
}

/// The engine of one GPU as the server drives it: in this process, or in a GPU worker process
/// ([`crate::worker`]) that the server restarts after a fault. The same calls either way.
pub enum EngineHandle {
    InProcess(Engine),
    Worker(crate::worker::WorkerEngine),
}

impl EngineHandle {
    pub fn device(&self) -> &kairos_gpu::DeviceInfo {
        match self {
            EngineHandle::InProcess(e) => e.device(),
            EngineHandle::Worker(w) => w.device(),
        }
    }

    pub fn load_model(&self, spec: kairos_sched::ModelSpec) -> Result<ModelInfo, kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.load_model(spec),
            EngineHandle::Worker(w) => w.load_model(spec),
        }
    }

    pub fn unload_model(&self, name: &str) -> Result<(), kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.unload_model(name),
            EngineHandle::Worker(w) => w.unload_model(name),
        }
    }

    /// Submits a request (see [`Engine::submit_with`] and [`Engine::submit_notify`]).
    pub fn submit(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        options: RequestOptions,
        before_done: Option<Box<dyn FnOnce() + Send>>,
        on_done: impl FnOnce(Result<kairos_sched::Response, kairos_sched::Error>) + Send + 'static,
    ) -> Result<kairos_sched::RequestId, kairos_sched::Error> {
        match (self, before_done) {
            (EngineHandle::InProcess(e), Some(n)) => e.submit_notify(model, inputs, options, n, on_done),
            (EngineHandle::InProcess(e), None) => e.submit_with(model, inputs, options, on_done),
            (EngineHandle::Worker(w), n) => w.submit(model, inputs, options, n, Box::new(on_done)),
        }
    }

    /// A request bound to a host mapping (only in process: a worker maps no host memory, so it
    /// has no mapping to bind to).
    pub fn submit_bound(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        binding: IoBinding,
        options: RequestOptions,
        before_done: Option<Box<dyn FnOnce() + Send>>,
        on_done: impl FnOnce(Result<kairos_sched::Response, kairos_sched::Error>) + Send + 'static,
    ) -> Result<kairos_sched::RequestId, kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.submit_bound(model, inputs, binding, options, before_done, on_done),
            EngineHandle::Worker(_) => {
                Err(kairos_sched::Error::InvalidInput("a GPU worker process has no host mappings to bind a request to".into()))
            }
        }
    }

    /// Cancels a request; it completes with `Error::Cancelled` (nothing for finished ones).
    pub fn cancel(&self, id: kairos_sched::RequestId) -> Result<(), kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.cancel(id),
            EngineHandle::Worker(w) => w.cancel(id),
        }
    }

    /// [`EngineHandle::cancel`] without waiting on a full submission queue (`Overloaded`: try
    /// again later). A worker's cancel is one small write to its pipe.
    pub fn try_cancel(&self, id: kairos_sched::RequestId) -> Result<(), kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.try_cancel(id),
            EngineHandle::Worker(w) => w.cancel(id),
        }
    }

    /// Maps host memory for zero-copy requests. A worker cannot see the server's memory: it
    /// answers with the reason, and requests take the copy path.
    pub fn map_host(&self, memory: Arc<dyn HostMemory>) -> Result<kairos_gpu::HostMapping, kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.map_host(memory),
            EngineHandle::Worker(_) => Err(kairos_sched::Error::Gpu(
                "zero-copy needs the engine in the server's process (--gpu-workers off); requests copy their tensors".into(),
            )),
        }
    }

    pub fn unmap_host(&self, id: kairos_gpu::HostMappingId) -> Result<(), kairos_sched::Error> {
        match self {
            EngineHandle::InProcess(e) => e.unmap_host(id),
            EngineHandle::Worker(_) => Ok(()),
        }
    }

    pub fn stats(&self) -> kairos_sched::EngineStats {
        match self {
            EngineHandle::InProcess(e) => e.stats(),
            EngineHandle::Worker(w) => w.stats(),
        }
    }

    /// Why the engine stopped serving for good, if it did.
    pub fn stopped(&self) -> Option<String> {
        match self {
            EngineHandle::InProcess(e) => e.stopped(),
            EngineHandle::Worker(w) => w.stopped(),
        }
    }

    /// The latest recoveries (in-process resets, or worker restarts), oldest first.
    pub fn recoveries(&self) -> Vec<kairos_sched::RecoveryReport> {
        match self {
            EngineHandle::InProcess(e) => e.recoveries(),
            EngineHandle::Worker(w) => w.recoveries(),
        }
    }

    /// The worker's process id, when the engine runs in one.
    pub fn worker_pid(&self) -> Option<u32> {
        match self {
            EngineHandle::InProcess(_) => None,
            EngineHandle::Worker(w) => w.worker_pid(),
        }
    }
}

/// Limits and switches of the state (the network parts live in [`crate::ServerConfig`]).
#[derive(Clone, Debug)]
pub struct StateConfig {
    pub repository: std::path::PathBuf,
    pub gpus: u32,
    /// Models to load at start: `None` loads every folder of the repository.
    pub load: Option<Vec<String>>,
}

/// One copy of a model on one GPU.
#[derive(Debug)]
pub struct Instance {
    pub gpu: u32,
    pub engine_name: String,
    /// The model's weight bytes (what `gpus = "auto"` balances over the GPUs).
    pub weight_bytes: u64,
    outstanding: AtomicU32,
}

/// A loaded model.
pub struct ModelEntry {
    pub config: ModelConfig,
    pub inputs: Vec<IoTensor>,
    pub outputs: Vec<IoTensor>,
    pub instances: Vec<Instance>,
    pub info: ModelInfo,
    pub metrics: Arc<ModelMetrics>,
    /// Shape bounds and the variants loaded for them (`None`: one shape, as planned).
    pub dynamic: Option<Arc<DynamicShapes>>,
}

impl std::fmt::Debug for ModelEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEntry").field("name", &self.config.name).field("instances", &self.instances.len()).finish()
    }
}

/// What a request asks for beyond its tensors (every field defaults to the model's configuration).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestParams {
    /// Triton's level: 1 is the most urgent.
    pub priority_level: Option<u64>,
    pub timeout_us: Option<u64>,
    pub class: Option<Class>,
    pub tenant: Option<u32>,
}

/// How a request goes to its engine: the engine's options, plus what the server itself watches.
#[derive(Clone, Debug, Default)]
pub struct SubmitOptions {
    pub engine: RequestOptions,
    /// Cancelled and answered DEADLINE_EXCEEDED (504) when not answered this long after its
    /// submission (the request's `timeout` parameter).
    pub timeout: Option<Duration>,
    /// The shared-memory connection that sent it ([`State::new_owner`]), whose requests are
    /// cancelled when it closes ([`State::cancel_owner`]).
    pub owner: Option<u64>,
}

impl From<RequestOptions> for SubmitOptions {
    fn from(engine: RequestOptions) -> SubmitOptions {
        SubmitOptions { engine, timeout: None, owner: None }
    }
}

impl ModelEntry {
    /// The GPUs its instances are on, ascending, each once (what Triton's instance group lists).
    pub fn instance_gpus(&self) -> Vec<u32> {
        let mut g: Vec<u32> = self.instances.iter().map(|i| i.gpu).collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The engine options of a request: the model's configuration, overridden by the request.
    pub fn options(&self, p: &RequestParams) -> Result<RequestOptions, ServeError> {
        let c = &self.config;
        let mut o = RequestOptions {
            class: p.class.unwrap_or(c.class),
            priority: priority_of_level(c.priority_level),
            deadline_ns: c.deadline_ns,
            tenant: TenantId(p.tenant.unwrap_or(c.tenant)),
            skip_io: false,
            notify_before_done: false,
        };
        match p.priority_level {
            None | Some(0) => {}
            Some(l) if l <= PRIORITY_LEVELS_MAX => o.priority = priority_of_level(l),
            Some(l) => {
                return Err(ServeError::invalid(format!(
                    "priority {l} is outside 1..={PRIORITY_LEVELS_MAX} (1 is the most urgent)"
                )));
            }
        }
        match p.timeout_us {
            None | Some(0) => {}
            Some(t) if t <= TIMEOUT_US_MAX => o.deadline_ns = Some(t * 1000),
            Some(t) => return Err(ServeError::invalid(format!("timeout {t} us exceeds {TIMEOUT_US_MAX} us"))),
        }
        Ok(o)
    }

    /// [`ModelEntry::options`] and the request's timeout (`timeout`, microseconds; 0: none): the
    /// engine's deadline (a scheduling target) and the server's cancellation.
    pub fn submit_options(&self, p: &RequestParams) -> Result<SubmitOptions, ServeError> {
        let engine = self.options(p)?;
        let timeout = p.timeout_us.filter(|&t| t > 0).map(Duration::from_micros);
        Ok(SubmitOptions { engine, timeout, owner: None })
    }

    /// The input index of a name.
    pub fn input_index(&self, name: &str) -> Option<usize> {
        self.inputs.iter().position(|t| t.name == name)
    }

    pub fn output_index(&self, name: &str) -> Option<usize> {
        self.outputs.iter().position(|t| t.name == name)
    }

    /// Checks one decoded input against the model and puts it in `slots` at its index.
    pub fn bind_input(&self, slots: &mut [Option<Tensor>], name: &str, tensor: Tensor) -> Result<(), ServeError> {
        let i = self.input_index(name).ok_or_else(|| {
            ServeError::invalid(format!(
                "model '{}' has no input '{name}' (inputs: {})",
                self.name(),
                self.inputs.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let decl = &self.inputs[i];
        if tensor.dtype() != decl.dtype {
            return Err(ServeError::invalid(format!(
                "input '{name}' of model '{}' is {}, the request sent {}",
                self.name(),
                decl.dtype.kserve_name(),
                tensor.dtype().kserve_name()
            )));
        }
        let sent: Vec<i64> = tensor.shape.iter().map(|&d| d as i64).collect();
        self.check_shape(i, &sent, "sent")?;
        if slots[i].is_some() {
            return Err(ServeError::invalid(format!("input '{name}' is given twice")));
        }
        slots[i] = Some(tensor);
        Ok(())
    }

    /// The bound inputs in plan order, or which are missing.
    pub fn finish_inputs(&self, slots: Vec<Option<Tensor>>) -> Result<Vec<Tensor>, ServeError> {
        let missing: Vec<&str> =
            slots.iter().zip(&self.inputs).filter(|(s, _)| s.is_none()).map(|(_, t)| t.name.as_str()).collect();
        if !missing.is_empty() {
            return Err(ServeError::invalid(format!("model '{}' needs input(s) {}", self.name(), missing.join(", "))));
        }
        Ok(slots.into_iter().map(|s| s.unwrap()).collect())
    }

    /// Checks a declared input before its data is decoded (so a wrong dtype or shape is refused
    /// before any allocation), and returns its element count.
    pub fn check_declared(&self, name: &str, datatype: &str, shape: &[i64]) -> Result<(usize, DType), ServeError> {
        let i = self.input_index(name).ok_or_else(|| {
            ServeError::invalid(format!(
                "model '{}' has no input '{name}' (inputs: {})",
                self.name(),
                self.inputs.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let decl = &self.inputs[i];
        if datatype != decl.dtype.kserve_name() {
            return Err(ServeError::invalid(format!(
                "input '{name}' of model '{}' is {}, the request says {datatype}",
                self.name(),
                decl.dtype.kserve_name()
            )));
        }
        self.check_shape(i, shape, "says")?;
        Ok((shape.iter().map(|&d| d as usize).product(), decl.dtype))
    }

    /// Checks the shape a request gives input `i`: the planned one, or for a model with shape
    /// bounds, any shape whose batch and sequence axes lie within them (fixed axes as planned).
    fn check_shape(&self, i: usize, shape: &[i64], verb: &str) -> Result<(), ServeError> {
        let decl = &self.inputs[i];
        let name = &decl.name;
        let wrong = || {
            ServeError::invalid(format!(
                "input '{name}' of model '{}' has shape {:?}, the request {verb} {shape:?}",
                self.name(),
                self.input_dims(i)
            ))
        };
        if shape.len() != decl.shape.len() || shape.iter().any(|&d| d < 0) {
            return Err(wrong());
        }
        let Some(d) = &self.dynamic else {
            return if shape.iter().zip(&decl.shape).all(|(&a, &b)| a as u64 == b as u64) { Ok(()) } else { Err(wrong()) };
        };
        for (axis, (&got, &planned)) in shape.iter().zip(&decl.shape).enumerate() {
            let got = got as usize;
            let role = d.axes.inputs.get(i).and_then(|r| r.get(axis).copied().flatten());
            let (what, lo, hi, bound) = match (role, d.bounds.batch_max, d.bounds.seq_len) {
                (Some(AxisRole::Batch), Some(max), _) => ("batch", 1, max, "1..=batch_max"),
                (Some(AxisRole::Seq), _, Some((lo, hi))) => ("sequence", lo, hi, "seq_len_min..=seq_len_max"),
                _ if got == planned => continue,
                _ => return Err(wrong()),
            };
            if !(lo..=hi).contains(&got) {
                return Err(ServeError::invalid(format!(
                    "input '{name}' of model '{}': axis {axis} ({what}) is {got}, outside {bound} = {lo}..={hi}",
                    self.name()
                )));
            }
        }
        Ok(())
    }

    /// An input's dimensions as metadata shows them: -1 for an axis within shape bounds.
    pub fn input_dims(&self, i: usize) -> Vec<i64> {
        self.dims_of(&self.inputs[i].shape, self.dynamic.as_ref().and_then(|d| d.axes.inputs.get(i)))
    }

    /// An output's dimensions as metadata shows them: -1 for an axis that follows the batch or
    /// the sequence length.
    pub fn output_dims(&self, i: usize) -> Vec<i64> {
        self.dims_of(&self.outputs[i].shape, self.dynamic.as_ref().and_then(|d| d.axes.outputs.get(i)))
    }

    fn dims_of(&self, shape: &[usize], roles: Option<&Vec<Option<AxisRole>>>) -> Vec<i64> {
        let bounds = self.dynamic.as_ref().map(|d| &d.bounds);
        shape
            .iter()
            .enumerate()
            .map(|(axis, &n)| {
                let role = roles.and_then(|r| r.get(axis).copied().flatten());
                match (role, bounds) {
                    (Some(AxisRole::Batch), Some(b)) if b.batch_max.is_some() => -1,
                    (Some(AxisRole::Seq), Some(b)) if b.seq_len.is_some() => -1,
                    _ => n as i64,
                }
            })
            .collect()
    }

    /// The most values one input may hold (its planned size, or its size at the bounds).
    pub fn input_values_max(&self) -> usize {
        let b = self.dynamic.as_ref().map(|d| &d.bounds);
        (0..self.inputs.len())
            .map(|i| {
                self.input_dims(i)
                    .iter()
                    .enumerate()
                    .map(|(axis, &n)| match (n, b) {
                        (-1, Some(b)) => {
                            let role = self.dynamic.as_ref().and_then(|d| d.axes.inputs[i][axis]);
                            match role {
                                Some(AxisRole::Batch) => b.batch_max.unwrap_or(1),
                                _ => b.seq_len.map_or(1, |s| s.1),
                            }
                        }
                        (n, _) => n as usize,
                    })
                    .fold(1usize, |a, n| a.saturating_mul(n))
            })
            .max()
            .unwrap_or(0)
    }

    /// The shape (batch, sequence length) of a request's inputs, all checked by
    /// [`ModelEntry::bind_input`]: the batch and sequence axes must agree across inputs.
    pub fn shape_key(&self, inputs: &[Tensor]) -> Result<ShapeKey, ServeError> {
        let Some(d) = &self.dynamic else { return Ok(ShapeKey { batch: self.config.batch, seq_len: self.config.seq_len }) };
        // The first (value, input) seen on the batch and the sequence axes.
        type Seen<'a> = Option<(usize, &'a str)>;
        let (mut batch, mut seq): (Seen, Seen) = (None, None);
        for (i, t) in inputs.iter().enumerate() {
            for (axis, &n) in t.shape.iter().enumerate() {
                let slot = match d.axes.inputs.get(i).and_then(|r| r.get(axis).copied().flatten()) {
                    Some(AxisRole::Batch) if d.bounds.batch_max.is_some() => &mut batch,
                    Some(AxisRole::Seq) if d.bounds.seq_len.is_some() => &mut seq,
                    _ => continue,
                };
                match slot {
                    None => *slot = Some((n, &self.inputs[i].name)),
                    Some((m, other)) if *m != n => {
                        return Err(ServeError::invalid(format!(
                            "input '{}' of model '{}' has {n} at axis {axis}, input '{other}' has {m} on the same dynamic axis",
                            self.inputs[i].name,
                            self.name()
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(ShapeKey { batch: batch.map_or(d.base.batch, |b| b.0), seq_len: seq.map_or(d.base.seq_len, |s| s.0) })
    }

    /// The index of the instance with the fewest requests outstanding.
    fn pick_instance(&self) -> usize {
        (0..self.instances.len())
            .min_by_key(|&i| self.instances[i].outstanding.load(Ordering::Relaxed))
            .expect("a model has at least one instance")
    }
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct InferDone {
    /// In plan order.
    pub outputs: Vec<Tensor>,
    pub timing: Timing,
    /// Wall time from the engine submission to the completion callback.
    pub engine_ns: u64,
    /// The request's I/O was bound to caller memory ([`EngineIo::Bound`]): the GPU wrote the
    /// outputs there, and `outputs` holds only those not bound (none, when all are).
    pub zero_copy: bool,
}

/// A request's tensors as an engine takes them.
pub enum EngineIo {
    /// Inputs copied in by the engine, outputs copied out.
    Tensors(Vec<Tensor>),
    /// Inputs and/or outputs in caller memory mapped into the engine's GPU; `inputs` are the
    /// tensors of the inputs the binding does not name.
    Bound { inputs: Vec<Tensor>, binding: IoBinding },
}

/// Caller memory (a shared-memory client's data area) mapped into every engine's GPU, for
/// zero-copy requests; see [`State::map_host_memory`].
#[derive(Debug)]
pub struct HostRegion {
    /// Per GPU: the mapping, or why there is none (that GPU's requests copy).
    pub mappings: Vec<Result<HostMapping, String>>,
}

impl HostRegion {
    pub fn mapping(&self, gpu: u32) -> Result<&HostMapping, &str> {
        match self.mappings.get(gpu as usize) {
            Some(Ok(m)) => Ok(m),
            Some(Err(e)) => Err(e.as_str()),
            None => Err("no such GPU"),
        }
    }
}

impl InferDone {
    pub fn gpu_ns(&self) -> u64 {
        self.timing.done_ns.saturating_sub(self.timing.first_issue_ns)
    }
}

#[derive(Clone, Debug)]
enum SlotState {
    Loading,
    Ready(Arc<ModelEntry>),
    Unloading,
    Unavailable(String),
}

#[derive(Clone, Debug)]
struct ModelSlot {
    version: String,
    state: SlotState,
}

/// One row of the repository index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexRow {
    pub name: String,
    pub version: String,
    pub state: &'static str,
    pub reason: String,
}

struct EngineSlot {
    engine: EngineHandle,
    device: String,
}

/// How long [`crate::RunningServer::shutdown`] waits for the start-up loader to finish the model
/// it is loading (autotuning on CUDA may take minutes); after that it leaves it behind.
pub const LOADER_STOP_WAIT: Duration = Duration::from_secs(10);

/// The start-up loading: the models to load at start, in order, and how far it got.
struct Startup {
    /// The start-up models in load order.
    names: Vec<String>,
    /// Those neither taken by the loader yet nor by a repository load or unload meanwhile.
    pending: BTreeSet<String>,
    /// Models the loader dealt with so far (loaded, failed, or left to the repository API).
    done: usize,
    /// The model being planned or loaded, since when.
    current: Option<(String, Instant)>,
    /// When the loader started, and how long it took once it ended.
    began: Option<Instant>,
    took: Option<Duration>,
    /// The loader thread ended (every model dealt with, or stopped by the shutdown).
    exited: bool,
    loader: Option<std::thread::JoinHandle<()>>,
}

/// Where the start-up loading stands ([`State::startup_progress`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StartupProgress {
    /// Models to load at start.
    pub total: usize,
    /// Of them, dealt with so far (loaded, failed, or left to the repository API).
    pub done: usize,
    /// Of them, ready now.
    pub ready: usize,
    /// Of them, unavailable now, with the reason.
    pub unavailable: Vec<(String, String)>,
    /// The model being planned or loaded, and for how long.
    pub current: Option<(String, Duration)>,
    /// Since the loading began (zero before); once it ended, how long it took.
    pub elapsed: Duration,
    /// The loading ended: every model dealt with, or stopped by the shutdown.
    pub finished: bool,
}

pub struct State {
    pub repository: Repository,
    backend: Box<dyn Backend>,
    engines: Vec<EngineSlot>,
    models: RwLock<BTreeMap<String, ModelSlot>>,
    /// Held by every change of the table that talks to the engines: a repository load or unload,
    /// and the start-up loader for one model at a time (never across the whole start-up, so
    /// health and readiness answer meanwhile). Lock order: `admin`, `startup`, `models`.
    admin: Mutex<()>,
    startup: Mutex<Startup>,
    /// Signalled when the start-up loading moves on or ends, and when the shutdown begins.
    startup_changed: Condvar,
    pub metrics: Metrics,
    /// The start-up loading finished.
    ready: AtomicBool,
    shutting_down: AtomicBool,
    /// A drain began ([`State::begin_drain`]): not ready, new requests refused.
    draining: AtomicBool,
    sampler_stop: Arc<AtomicBool>,
    /// The requests handed to an engine and not answered yet.
    inflight: Arc<InFlight>,
    next_owner: AtomicU64,
    /// Shape variant builds for the builder thread (bounded: [`VARIANT_BUILDS_QUEUED_MAX`]).
    builds: std::sync::mpsc::SyncSender<BuildJob>,
    builds_rx: Mutex<Option<std::sync::mpsc::Receiver<BuildJob>>>,
    /// Requests waiting for a shape variant's build, by ticket: their answer, so that a cancel
    /// (timeout, client gone, drain) answers them at once. Bounded by the builds' waiter limits.
    waiting: Mutex<std::collections::HashMap<u64, (AnswerCell, Arc<ModelMetrics>)>>,
    pub started: Instant,
}

impl State {
    /// [`State::new`], then [`State::start_loading`]: returns once the engines run; the models
    /// load in the background ([`State::wait_until_ready`] waits for them).
    pub fn start(cfg: StateConfig, backend: Box<dyn Backend>) -> Result<Arc<State>, ServeError> {
        let state = State::new(cfg, backend)?;
        state.start_loading()?;
        Ok(state)
    }

    /// Starts one engine per GPU and the busy sampler, and puts every model to load at start in
    /// the table as loading. Plans and loads nothing: [`State::start_loading`] does, on a thread
    /// of its own. Not ready until that loading has finished.
    pub fn new(cfg: StateConfig, backend: Box<dyn Backend>) -> Result<Arc<State>, ServeError> {
        if cfg.gpus == 0 || cfg.gpus > GPUS_MAX {
            return Err(ServeError::invalid(format!("gpus = {} must be in 1..={GPUS_MAX}", cfg.gpus)));
        }
        let repository = Repository::new(cfg.repository.clone());
        let mut names = match &cfg.load {
            None => repository.model_names()?,
            Some(v) => v.clone(),
        };
        let mut seen = BTreeSet::new();
        names.retain(|n| seen.insert(n.clone()));
        info!(repository = %repository.root.display(), backend = %backend.describe(), gpus = cfg.gpus, models = names.len(), "kairos serve starting");
        let mut engines = Vec::new();
        for gpu in 0..cfg.gpus {
            let (engine, device) = backend.start(gpu, &[])?;
            info!(gpu, device = %device, "engine started");
            engines.push(EngineSlot { engine, device });
        }
        let (builds, builds_rx) = std::sync::mpsc::sync_channel(VARIANT_BUILDS_QUEUED_MAX);
        let state = Arc::new(State {
            builds,
            builds_rx: Mutex::new(Some(builds_rx)),
            waiting: Mutex::new(Default::default()),
            metrics: Metrics::new(cfg.gpus as usize),
            repository,
            backend,
            engines,
            models: RwLock::new(BTreeMap::new()),
            admin: Mutex::new(()),
            startup: Mutex::new(Startup {
                pending: names.iter().cloned().collect(),
                names,
                done: 0,
                current: None,
                began: None,
                took: None,
                exited: false,
                loader: None,
            }),
            startup_changed: Condvar::new(),
            ready: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            sampler_stop: Arc::new(AtomicBool::new(false)),
            inflight: Arc::new(InFlight::default()),
            next_owner: AtomicU64::new(0),
            started: Instant::now(),
        });
        let names = state.lock_startup().names.clone();
        for name in &names {
            let version = state.repository.config(name).map(|c| c.version).unwrap_or_else(|_| "1".into());
            state.set_slot(name, &version, SlotState::Loading);
        }
        state.start_sampler();
        state.start_watchdog()?;
        state.start_builder()?;
        Ok(state)
    }

    /// Starts the loader thread: it plans and loads the start-up models one after another, in
    /// order (with progress in the log); each model is ready as soon as it has loaded. Models that
    /// fail are UNAVAILABLE with their reason. The server is ready once every model was dealt
    /// with. A second call does nothing.
    pub fn start_loading(self: &Arc<Self>) -> Result<(), ServeError> {
        let mut s = self.lock_startup();
        if s.began.is_some() {
            return Ok(());
        }
        let weak = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("kairos-loader".into())
            .spawn(move || load_at_start(weak))
            .map_err(|e| ServeError::Internal(format!("cannot start the model loader thread: {e}")))?;
        s.began = Some(Instant::now());
        s.loader = Some(handle);
        Ok(())
    }

    fn lock_startup(&self) -> std::sync::MutexGuard<'_, Startup> {
        self.startup.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Plans and loads start-up model `name` (the `i`th of `n`) unless a repository load or
    /// unload took it meanwhile. Holds the admin lock for this model only. False when the
    /// shutdown began (nothing was done).
    fn load_start_model(&self, i: usize, n: usize, name: &str) -> bool {
        let _admin = self.admin.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut s = self.lock_startup();
            if self.shutting_down.load(Ordering::Acquire) {
                return false;
            }
            if !s.pending.remove(name) {
                s.done += 1;
                self.startup_changed.notify_all();
                info!(progress = %format!("[{}/{n}]", i + 1), model = %name, "left to the repository API (loaded or unloaded meanwhile)");
                return true;
            }
            s.current = Some((name.to_string(), Instant::now()));
        }
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match plan_model_for(&self.repository, name, self.backend.as_ref()) {
                Ok(p) => {
                    info!(
                        progress = %format!("[{}/{n}]", i + 1),
                        model = %name,
                        source = %p.config.source.describe(),
                        dtype = %p.config.dtype,
                        kernels = p.plan.launches.len(),
                        weight_mb = format!("{:.1}", p.plan.weight_bytes as f64 / 1e6),
                        profile = p.profile.is_some(),
                        shapes = %p.config.shapes.describe(),
                        lower_s = format!("{:.2}", t.elapsed().as_secs_f64()),
                        "planned"
                    );
                    if let Err(e) = self.load_planned(p, true) {
                        warn!(model = %name, error = %e, "cannot load");
                    }
                }
                Err(e) => {
                    warn!(progress = %format!("[{}/{n}]", i + 1), model = %name, error = %e, "cannot plan");
                    self.set_slot(name, &self.slot_version(name), SlotState::Unavailable(e.to_string()));
                }
            }
        }));
        if let Err(panic) = r {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            warn!(model = %name, panic = %what, "the loader panicked");
            self.set_slot(name, &self.slot_version(name), SlotState::Unavailable(format!("loading panicked: {what}")));
        }
        let mut s = self.lock_startup();
        s.current = None;
        s.done += 1;
        self.startup_changed.notify_all();
        true
    }

    /// The loader's last step: ready (unless stopped by the shutdown; then the models it did not
    /// reach become UNAVAILABLE).
    fn finish_startup(&self, stopped: bool) {
        let mut s = self.lock_startup();
        s.current = None;
        let took = s.began.map(|b| b.elapsed()).unwrap_or_default();
        s.took = Some(took);
        let left = std::mem::take(&mut s.pending);
        for name in &left {
            self.set_slot(
                name,
                &self.slot_version(name),
                SlotState::Unavailable("the server shut down before loading it".into()),
            );
        }
        if !stopped {
            self.ready.store(true, Ordering::Release);
        }
        s.exited = true;
        self.startup_changed.notify_all();
        let total = s.names.len();
        drop(s);
        let ready = self.startup_progress().ready;
        if stopped {
            info!(
                ready,
                models = total,
                not_loaded = left.len(),
                seconds = format!("{:.1}", took.as_secs_f64()),
                "start-up loading stopped by the shutdown"
            );
        } else {
            info!(ready, models = total, seconds = format!("{:.1}", took.as_secs_f64()), "kairos serve ready");
        }
    }

    /// Live and accepting: the start-up loading finished and no shutdown began.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && self.not_ready_reason().is_none()
    }

    /// Why the server is not live (`None` when it is): an engine stopped for good because its GPU
    /// failed and could not be reset (see `Engine::stopped`); only a restart of the process helps.
    pub fn not_live_reason(&self) -> Option<String> {
        self.engines.iter().enumerate().find_map(|(gpu, e)| e.engine.stopped().map(|why| format!("GPU {gpu} stopped: {why}")))
    }

    /// Why the server is not ready (`None` when it is): "loading models: 2 of 5 done (now:
    /// resnet50, 12.3 s; compiling kernels 3/7)" — the model being loaded, and the backend's
    /// [`Backend::activity`] — or "the server is shutting down".
    pub fn not_ready_reason(&self) -> Option<String> {
        let s = self.lock_startup();
        self.reason_locked(&s)
    }

    fn reason_locked(&self, s: &Startup) -> Option<String> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Some("the server is shutting down".into());
        }
        if self.draining.load(Ordering::Acquire) {
            return Some(DRAINING.into());
        }
        if let Some(why) = self.not_live_reason() {
            return Some(why);
        }
        if let Some(gpu) = self.engines.iter().position(|e| e.engine.stats().recovering) {
            return Some(format!("GPU {gpu} is being reset after a fault"));
        }
        if self.ready.load(Ordering::Acquire) {
            return None;
        }
        let mut r = format!("loading models: {} of {} done", s.done, s.names.len());
        if s.began.is_none() {
            r.push_str(" (not started)");
        } else if let Some((name, since)) = &s.current {
            r.push_str(&format!(" (now: {name}, {:.1} s", since.elapsed().as_secs_f64()));
            if let Some(a) = self.backend.activity() {
                r.push_str("; ");
                r.push_str(&a);
            }
            r.push(')');
        }
        Some(r)
    }

    /// Where the start-up loading stands.
    pub fn startup_progress(&self) -> StartupProgress {
        let s = self.lock_startup();
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        let mut ready = 0;
        let mut unavailable = Vec::new();
        for name in &s.names {
            match m.get(name).map(|slot| &slot.state) {
                Some(SlotState::Ready(_)) => ready += 1,
                Some(SlotState::Unavailable(r)) => unavailable.push((name.clone(), r.clone())),
                _ => {}
            }
        }
        StartupProgress {
            total: s.names.len(),
            done: s.done,
            ready,
            unavailable,
            current: s.current.as_ref().map(|(n, t)| (n.clone(), t.elapsed())),
            elapsed: s.took.or_else(|| s.began.map(|b| b.elapsed())).unwrap_or_default(),
            finished: s.exited,
        }
    }

    /// Waits until the start-up loading has finished (models that failed are UNAVAILABLE; they
    /// do not keep the server from being ready). UNAVAILABLE with the reason when `timeout`
    /// passes first, or when the server shuts down.
    pub fn wait_until_ready(&self, timeout: Duration) -> Result<(), ServeError> {
        let deadline = Instant::now().checked_add(timeout);
        let mut s = self.lock_startup();
        loop {
            if self.shutting_down.load(Ordering::Acquire) {
                return Err(ServeError::Unavailable("the server is shutting down".into()));
            }
            if self.ready.load(Ordering::Acquire) {
                return Ok(());
            }
            let wait = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        let reason = self.reason_locked(&s).unwrap_or_default();
                        return Err(ServeError::Unavailable(format!("not ready after {:.1} s: {reason}", timeout.as_secs_f64())));
                    }
                    d - now
                }
            };
            s = self.startup_changed.wait_timeout(s, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Waits at most `wait` for the start-up loader to end (after [`State::begin_shutdown`] it
    /// stops before the next model) and joins it. False when it is still busy with a model; it
    /// is then left to finish that model on its own. True at once when no loader was started.
    pub fn stop_loader(&self, wait: Duration) -> bool {
        let deadline = Instant::now().checked_add(wait);
        let mut s = self.lock_startup();
        while s.loader.is_some() && !s.exited {
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => {
                    let current = s.current.as_ref().map(|(n, _)| n.clone()).unwrap_or_default();
                    warn!(model = %current, waited_s = format!("{:.1}", wait.as_secs_f64()), "the model loader is still busy; not waiting for it");
                    return false;
                }
                Some(d) => d - now,
                None => Duration::from_secs(3600),
            };
            s = self.startup_changed.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        let handle = s.loader.take();
        drop(s);
        if let Some(h) = handle
            && h.thread().id() != std::thread::current().id()
        {
            let _ = h.join();
        }
        true
    }

    /// Refuse new requests from now on (the engines stop when the state is dropped); the
    /// start-up loader stops before its next model.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.sampler_stop.store(true, Ordering::Release);
        let _s = self.lock_startup();
        self.startup_changed.notify_all();
    }

    pub fn backend_description(&self) -> String {
        self.backend.describe()
    }

    pub fn gpus(&self) -> u32 {
        self.engines.len() as u32
    }

    /// The devices the engines drive ("NVIDIA H200", "simulated H100 SXM"), one per GPU.
    pub fn device_names(&self) -> Vec<String> {
        self.engines.iter().map(|e| e.device.clone()).collect()
    }

    /// The version in the table of a model, "1" when it is not there.
    fn slot_version(&self, name: &str) -> String {
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        m.get(name).map_or_else(|| "1".to_string(), |s| s.version.clone())
    }

    fn set_slot(&self, name: &str, version: &str, state: SlotState) {
        let mut m = self.models.write().unwrap_or_else(|e| e.into_inner());
        m.insert(name.to_string(), ModelSlot { version: version.to_string(), state });
    }

    pub fn ready_models(&self) -> Vec<Arc<ModelEntry>> {
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        m.values().filter_map(|s| if let SlotState::Ready(e) = &s.state { Some(e.clone()) } else { None }).collect()
    }

    /// A ready model by name and version ("" = the current one).
    pub fn resolve(&self, name: &str, version: &str) -> Result<Arc<ModelEntry>, ServeError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ServeError::Unavailable("the server is shutting down".into()));
        }
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = m.get(name) else {
            return Err(ServeError::NotFound(format!("unknown model '{name}'")));
        };
        if !version.is_empty() && version != slot.version {
            return Err(ServeError::NotFound(format!("model '{name}' has no version '{version}' (versions: {})", slot.version)));
        }
        match &slot.state {
            SlotState::Ready(e) => Ok(e.clone()),
            SlotState::Loading => Err(ServeError::Unavailable(format!("model '{name}' is loading"))),
            SlotState::Unloading => Err(ServeError::Unavailable(format!("model '{name}' is unloading"))),
            SlotState::Unavailable(reason) => Err(ServeError::NotFound(format!("model '{name}' is not loaded: {reason}"))),
        }
    }

    /// Every model of the repository folder and of the table, with its state.
    pub fn index(&self, ready_only: bool) -> Vec<IndexRow> {
        let mut rows: BTreeMap<String, IndexRow> = BTreeMap::new();
        if let Ok(names) = self.repository.model_names() {
            for n in names {
                let version = self.repository.config(&n).map(|c| c.version).unwrap_or_else(|_| "1".into());
                rows.insert(n.clone(), IndexRow { name: n, version, state: "UNAVAILABLE", reason: "not loaded".into() });
            }
        }
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        for (name, s) in m.iter() {
            let (state, reason) = match &s.state {
                SlotState::Ready(_) => ("READY", String::new()),
                SlotState::Loading => ("LOADING", String::new()),
                SlotState::Unloading => ("UNLOADING", String::new()),
                SlotState::Unavailable(r) => ("UNAVAILABLE", r.clone()),
            };
            rows.insert(name.clone(), IndexRow { name: name.clone(), version: s.version.clone(), state, reason });
        }
        rows.into_values().filter(|r| !ready_only || r.state == "READY").collect()
    }

    /// Loads (or reloads) a model from the repository. Blocks: lowering and weight upload; during
    /// the start-up loading, also until the loader is done with the model it is loading. A
    /// start-up model the loader has not reached yet is loaded now, and the loader leaves it.
    pub fn load(&self, name: &str) -> Result<(), ServeError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ServeError::Unavailable("the server is shutting down".into()));
        }
        let _admin = self.admin.lock().unwrap_or_else(|e| e.into_inner());
        let at_start = self.lock_startup().pending.remove(name);
        let t = Instant::now();
        let planned = match plan_model_for(&self.repository, name, self.backend.as_ref()) {
            Ok(p) => p,
            Err(e) => {
                // A model that was never loaded stays out of the table (a start-up model waiting
                // for the loader is there: it becomes UNAVAILABLE); a loaded one keeps serving.
                warn!(model = %name, error = %e, "cannot plan");
                if at_start {
                    self.set_slot(name, &self.slot_version(name), SlotState::Unavailable(e.to_string()));
                }
                return Err(e);
            }
        };
        let loaded = {
            let m = self.models.read().unwrap_or_else(|e| e.into_inner());
            matches!(m.get(name).map(|s| &s.state), Some(SlotState::Ready(_)))
        };
        if loaded {
            info!(model = %name, "reloading");
            self.unload_locked(name)?;
        }
        let r = self.load_planned(planned, at_start);
        info!(model = %name, ok = r.is_ok(), seconds = format!("{:.2}", t.elapsed().as_secs_f64()), "load");
        r
    }

    /// Loads a planned model on its GPUs (the admin lock is held by the caller); `at_start`: one of
    /// the start-up models (announced to the backend first).
    /// One engine model of `p`'s plan per (GPU, engine name), in order; when one fails to load,
    /// those already loaded are unloaded and the error returned.
    fn load_instances(
        &self,
        p: &PlannedModel,
        placements: Vec<(u32, String)>,
    ) -> Result<(Vec<Instance>, Vec<kairos_sched::ModelInfo>), kairos_sched::Error> {
        let mut instances: Vec<Instance> = Vec::new();
        let mut infos = Vec::new();
        for (gpu, engine_name) in placements {
            let spec = kairos_sched::ModelSpec { name: engine_name.clone(), plan: p.plan.clone(), profile: p.profile.clone() };
            match self.engines[gpu as usize].engine.load_model(spec) {
                Ok(mi) => {
                    infos.push(mi);
                    instances.push(Instance {
                        gpu,
                        engine_name,
                        weight_bytes: p.plan.weight_bytes,
                        outstanding: AtomicU32::new(0),
                    });
                }
                Err(e) => {
                    for inst in &instances {
                        let _ = self.engines[inst.gpu as usize].engine.unload_model(&inst.engine_name);
                    }
                    return Err(e);
                }
            }
        }
        Ok((instances, infos))
    }

    fn load_planned(&self, p: PlannedModel, at_start: bool) -> Result<(), ServeError> {
        let name = p.config.name.clone();
        let version = p.config.version.clone();
        for &g in &p.config.gpus {
            if g >= self.gpus() {
                let e = ServeError::invalid(format!("model '{name}' asks for gpu {g}; the server drives {} GPU(s)", self.gpus()));
                self.set_slot(&name, &version, SlotState::Unavailable(e.to_string()));
                return Err(e);
            }
        }
        self.set_slot(&name, &version, SlotState::Loading);
        if at_start {
            // Placed by the server: any GPU may get an instance.
            let mut gpus = if p.config.gpus.is_empty() { (0..self.gpus()).collect() } else { p.config.gpus.clone() };
            gpus.sort_unstable();
            gpus.dedup();
            for g in gpus {
                if let Err(e) = self.backend.register_start_model(g, &p) {
                    self.set_slot(&name, &version, SlotState::Unavailable(e.to_string()));
                    return Err(e);
                }
            }
        }
        let mut placed_bytes = if p.config.gpus.is_empty() { self.placed_weight_bytes() } else { Vec::new() };
        let mut placements = Vec::new();
        for i in 0..p.config.instances {
            let gpu = if p.config.gpus.is_empty() {
                // The GPU with the fewest weight bytes placed (the lowest ordinal on ties).
                let g = (0..placed_bytes.len()).min_by_key(|&g| (placed_bytes[g], g)).unwrap_or(0);
                placed_bytes[g] += p.plan.weight_bytes;
                g as u32
            } else {
                p.config.gpus[i as usize % p.config.gpus.len()]
            };
            let engine_name = if p.config.instances == 1 { name.clone() } else { format!("{name}#{i}") };
            placements.push((gpu, engine_name));
        }
        let (instances, infos) = match self.load_instances(&p, placements) {
            Ok(loaded) => loaded,
            Err(e) => {
                let e = ServeError::from(e);
                self.set_slot(&name, &version, SlotState::Unavailable(e.to_string()));
                return Err(e);
            }
        };
        for (i, (inst, mi)) in instances.iter().zip(&infos).enumerate() {
            let estimated_ms = format!("{:.3}", mi.estimated_ns as f64 / 1e6);
            info!(model = %name, instance = i, gpu = inst.gpu, estimated_ms, "instance loaded");
        }
        let info = infos.into_iter().next();
        let dynamic = p.axes.map(|axes| {
            info!(model = %name, shapes = %p.config.shapes.describe(), "dynamic shapes");
            Arc::new(DynamicShapes {
                bounds: p.config.shapes.clone(),
                axes,
                base: ShapeKey { batch: p.config.batch, seq_len: p.config.seq_len },
                variants: Mutex::new(VariantTable::default()),
            })
        });
        let entry = ModelEntry {
            inputs: p.plan.inputs.clone(),
            outputs: p.plan.outputs.clone(),
            instances,
            info: info.expect("instances >= 1"),
            metrics: self.metrics.model(&name),
            config: p.config,
            dynamic,
        };
        self.set_slot(&name, &version, SlotState::Ready(Arc::new(entry)));
        Ok(())
    }

    /// Per GPU, the weight bytes of the loaded instances on it (what `gpus = "auto"` balances).
    pub fn placed_weight_bytes(&self) -> Vec<u64> {
        let mut bytes = vec![0u64; self.engines.len()];
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        for slot in m.values() {
            if let SlotState::Ready(e) = &slot.state {
                for inst in &e.instances {
                    if let Some(b) = bytes.get_mut(inst.gpu as usize) {
                        *b += inst.weight_bytes;
                    }
                }
            }
        }
        bytes
    }

    /// Unloads a model: new requests are refused at once; blocks until its requests finished.
    /// A start-up model the loader has not reached yet is taken off its list at once (UNAVAILABLE,
    /// "unloaded"); the one it is loading is unloaded once loaded.
    pub fn unload(&self, name: &str) -> Result<(), ServeError> {
        {
            let mut s = self.lock_startup();
            if s.pending.remove(name) {
                self.set_slot(name, &self.slot_version(name), SlotState::Unavailable("unloaded".into()));
                info!(model = %name, "unloaded before its start-up load");
                return Ok(());
            }
        }
        let _admin = self.admin.lock().unwrap_or_else(|e| e.into_inner());
        self.unload_locked(name)
    }

    fn unload_locked(&self, name: &str) -> Result<(), ServeError> {
        let (entry, version) = {
            let mut m = self.models.write().unwrap_or_else(|e| e.into_inner());
            let Some(slot) = m.get_mut(name) else {
                return Err(ServeError::NotFound(format!("unknown model '{name}'")));
            };
            let SlotState::Ready(e) = &slot.state else {
                return Err(ServeError::NotFound(format!("model '{name}' is not loaded")));
            };
            let e = e.clone();
            slot.state = SlotState::Unloading;
            (e, slot.version.clone())
        };
        let mut first_error = None;
        let mut instances: Vec<&Instance> = entry.instances.iter().collect();
        // Its shape variants go with it (a build under way finds the model gone and fails).
        let variants: Vec<Arc<Variant>> = match &entry.dynamic {
            Some(d) => {
                let mut t = d.variants.lock().unwrap_or_else(|e| e.into_inner());
                let ready = std::mem::take(&mut t.slots);
                let (ready, building): (Vec<_>, Vec<_>) =
                    ready.into_iter().partition(|(_, s)| matches!(s, VariantSlot::Ready(_)));
                t.slots.extend(building);
                ready.into_iter().filter_map(|(_, s)| if let VariantSlot::Ready(v) = s { Some(v) } else { None }).collect()
            }
            None => Vec::new(),
        };
        instances.extend(variants.iter().flat_map(|v| v.entry.instances.iter()));
        for inst in instances {
            if let Err(e) = self.engines[inst.gpu as usize].engine.unload_model(&inst.engine_name) {
                first_error.get_or_insert(ServeError::from(e));
            }
        }
        self.set_slot(name, &version, SlotState::Unavailable("unloaded".into()));
        info!(model = %name, "unloaded");
        first_error.map_or(Ok(()), Err)
    }

    /// Maps caller memory into every engine's GPU (blocking: a CUDA backend page-locks it on its
    /// dispatcher thread). A GPU whose backend cannot map host memory gets the reason instead, and
    /// requests going there take the copy path.
    pub fn map_host_memory(&self, memory: Arc<dyn HostMemory>) -> HostRegion {
        let mappings = self
            .engines
            .iter()
            .map(|e| match e.engine.map_host(memory.clone()) {
                Ok(m) => {
                    self.metrics.shm_mapped_regions.fetch_add(1, Ordering::Relaxed);
                    Ok(m)
                }
                Err(err) => Err(err.to_string()),
            })
            .collect();
        HostRegion { mappings }
    }

    /// Unmaps a region from every GPU; blocks until the requests using it have completed.
    pub fn unmap_host_memory(&self, region: HostRegion) {
        for (gpu, m) in region.mappings.into_iter().enumerate() {
            let Ok(m) = m else { continue };
            if let Err(e) = self.engines[gpu].engine.unmap_host(m.id) {
                warn!(gpu, error = %e, "cannot unmap a shared-memory region");
            }
            self.metrics.shm_mapped_regions.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Submits a request; `on_done` runs on the engine's dispatcher thread (keep it short: send on
    /// a channel, copy into a region). Records the engine-side metrics; front ends count outcomes.
    pub fn submit(
        &self,
        model: &Arc<ModelEntry>,
        inputs: Vec<Tensor>,
        options: impl Into<SubmitOptions>,
        on_done: impl FnOnce(Result<InferDone, ServeError>) + Send + 'static,
    ) -> Result<Ticket, ServeError> {
        self.submit_notify(model, inputs, options, None::<fn()>, on_done)
    }

    /// [`State::submit`], and `before_done` (if any) runs on the dispatcher thread when the
    /// request's last kernel is issued: the shared-memory channel wakes a sleeping client then.
    pub fn submit_notify<N: FnOnce() + Send + 'static>(
        &self,
        model: &Arc<ModelEntry>,
        inputs: Vec<Tensor>,
        options: impl Into<SubmitOptions>,
        before_done: Option<N>,
        on_done: impl FnOnce(Result<InferDone, ServeError>) + Send + 'static,
    ) -> Result<Ticket, ServeError> {
        self.submit_io(model, |_| Ok(EngineIo::Tensors(inputs)), options, before_done, on_done)
    }

    /// [`State::submit_notify`] with the request's tensors chosen once its GPU is known: `io`
    /// gets the GPU the request goes to (zero-copy needs that GPU's mapping of the caller's memory).
    ///
    /// The request is in flight from here until `on_done` runs (exactly once): [`State::cancel`]
    /// with the returned ticket stops it (its GPU work too), and a request with a timeout is
    /// cancelled when it runs past it (`on_done` then gets 504 / DEADLINE_EXCEEDED).
    pub fn submit_io<N: FnOnce() + Send + 'static>(
        &self,
        model: &Arc<ModelEntry>,
        io: impl FnOnce(u32) -> Result<EngineIo, ServeError>,
        options: impl Into<SubmitOptions>,
        before_done: Option<N>,
        on_done: impl FnOnce(Result<InferDone, ServeError>) + Send + 'static,
    ) -> Result<Ticket, ServeError> {
        let SubmitOptions { engine: options, timeout, owner } = options.into();
        self.accepting()?;
        let index = model.pick_instance();
        let gpu = model.instances[index].gpu;
        let io = io(gpu)?;
        if let (Some(d), EngineIo::Tensors(inputs)) = (&model.dynamic, &io) {
            let key = model.shape_key(inputs)?;
            if key != d.base {
                let EngineIo::Tensors(inputs) = io else { unreachable!() };
                return self.submit_variant(model, d, key, index, inputs, options, timeout, owner, before_done, on_done);
            }
        }
        let ticket = self.inflight.register(gpu, timeout, owner);
        self.submit_on(model, index, io, options, ticket, before_done, on_done)?;
        Ok(ticket)
    }

    /// New requests are taken (no shutdown, no drain).
    fn accepting(&self) -> Result<(), ServeError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ServeError::Unavailable("the server is shutting down".into()));
        }
        if self.draining.load(Ordering::Acquire) {
            return Err(ServeError::Unavailable(DRAINING.into()));
        }
        Ok(())
    }

    /// Hands a registered request to instance `index` of `model`. On an error the ticket is
    /// finished and `on_done` is not called.
    #[allow(clippy::too_many_arguments)]
    fn submit_on<N: FnOnce() + Send + 'static>(
        &self,
        model: &Arc<ModelEntry>,
        index: usize,
        io: EngineIo,
        options: RequestOptions,
        ticket: Ticket,
        before_done: Option<N>,
        on_done: impl FnOnce(Result<InferDone, ServeError>) + Send + 'static,
    ) -> Result<(), ServeError> {
        let inst = &model.instances[index];
        let zero_copy = matches!(io, EngineIo::Bound { .. });
        inst.outstanding.fetch_add(1, Ordering::Relaxed);
        let class = options.class;
        let entry = model.clone();
        let inflight = self.inflight.clone();
        let t0 = Instant::now();
        let done = move |r: Result<kairos_sched::Response, kairos_sched::Error>| {
            let engine_ns = t0.elapsed().as_nanos() as u64;
            entry.instances[index].outstanding.fetch_sub(1, Ordering::Relaxed);
            let left = inflight.finish(ticket);
            let r = match r {
                Ok(resp) => {
                    entry.metrics.completed(class, true, engine_ns, Some(&resp.timing));
                    Ok(InferDone { outputs: resp.outputs, timing: resp.timing, engine_ns, zero_copy })
                }
                Err(e) => {
                    entry.metrics.completed(class, false, engine_ns, None);
                    // A cancel of the server's own answers with its cause.
                    match (e, left.and_then(|l| l.cause.map(|c| (c, l.timeout)))) {
                        (kairos_sched::Error::Cancelled, Some((cause, timeout))) => {
                            entry.metrics.cancelled(cause);
                            Err(cancel_error(cause, timeout))
                        }
                        (e, _) => Err(ServeError::from(e)),
                    }
                }
            };
            on_done(r);
        };
        let engine = &self.engines[inst.gpu as usize].engine;
        let n = before_done.map(|n| Box::new(n) as Box<dyn FnOnce() + Send>);
        let r = match io {
            EngineIo::Tensors(inputs) => engine.submit(&inst.engine_name, inputs, options, n, done),
            EngineIo::Bound { inputs, binding } => engine.submit_bound(&inst.engine_name, inputs, binding, options, n, done),
        };
        match r {
            Ok(id) => {
                if let Some((gpu, id)) = self.inflight.accepted(ticket, id) {
                    self.send_cancel(gpu, id);
                }
                Ok(())
            }
            Err(e) => {
                // Refused: the engine never calls `done`.
                self.inflight.finish(ticket);
                inst.outstanding.fetch_sub(1, Ordering::Relaxed);
                Err(e.into())
            }
        }
    }

    /// A request whose shape differs from the model's start-up shape: served by the variant of
    /// that shape if it is loaded, else queued behind its build (started here if none is under
    /// way: concurrent requests for one new shape wait on one build). Never blocks: the builder
    /// thread submits the waiting requests when the variant is ready, or answers them with the
    /// build's error.
    #[allow(clippy::too_many_arguments)]
    fn submit_variant<N: FnOnce() + Send + 'static>(
        &self,
        model: &Arc<ModelEntry>,
        d: &Arc<DynamicShapes>,
        key: ShapeKey,
        index: usize,
        inputs: Vec<Tensor>,
        options: RequestOptions,
        timeout: Option<Duration>,
        owner: Option<u64>,
        before_done: Option<N>,
        on_done: impl FnOnce(Result<InferDone, ServeError>) + Send + 'static,
    ) -> Result<Ticket, ServeError> {
        let gpu = model.instances[index].gpu;
        let mut t = d.variants.lock().unwrap_or_else(|e| e.into_inner());
        t.clock += 1;
        let now = t.clock;
        if let Some(VariantSlot::Ready(v)) = t.slots.get(&key) {
            let v = v.clone();
            v.users.fetch_add(1, Ordering::Relaxed);
            v.last_used.store(now, Ordering::Relaxed);
            drop(t);
            let ticket = self.inflight.register(gpu, timeout, owner);
            self.submit_held(&v, index, inputs, options, ticket, before_done, Box::new(on_done))?;
            return Ok(ticket);
        }
        let waiting = match t.slots.get(&key) {
            Some(VariantSlot::Building(w)) => w.len(),
            _ => 0,
        };
        if waiting >= VARIANT_WAITERS_MAX {
            return Err(ServeError::Overloaded(format!(
                "{VARIANT_WAITERS_MAX} requests already wait for model '{}' at batch {}, seq_len {}",
                model.name(),
                key.batch,
                key.seq_len
            )));
        }
        let ticket = self.inflight.register(gpu, timeout, owner);
        let metrics = model.metrics.clone();
        let answer: AnswerCell = Arc::new(Mutex::new(Some(Box::new(on_done))));
        self.lock_waiting().insert(ticket.0, (answer.clone(), metrics.clone()));
        let waiter: VariantWaiter = Box::new(move |state: &State, built: Result<Arc<Variant>, ServeError>| {
            state.lock_waiting().remove(&ticket.0);
            let Some(on_done) = answer.lock().unwrap_or_else(|e| e.into_inner()).take() else {
                // Answered already: cancelled while it waited.
                if let Ok(v) = built {
                    v.users.fetch_sub(1, Ordering::Relaxed);
                }
                return;
            };
            let v = match built {
                Ok(v) => v,
                Err(e) => {
                    state.inflight.finish(ticket);
                    return on_done(Err(e));
                }
            };
            // Cancelled (timeout, client gone, drain) or refused while it waited.
            let cause = state.inflight.lock().entries.get(&ticket.0).and_then(|e| e.cause.map(|c| (c, e.timeout)));
            let refused = match cause {
                Some((c, timeout)) => {
                    metrics.cancelled(c);
                    Some(cancel_error(c, timeout))
                }
                None => state.accepting().err(),
            };
            if let Some(e) = refused {
                v.users.fetch_sub(1, Ordering::Relaxed);
                state.inflight.finish(ticket);
                return on_done(Err(e));
            }
            let _ = state.submit_held(&v, index, inputs, options, ticket, before_done, on_done);
        });
        match t.slots.entry(key) {
            std::collections::btree_map::Entry::Occupied(mut o) => {
                if let VariantSlot::Building(w) = o.get_mut() {
                    w.push(waiter);
                }
            }
            std::collections::btree_map::Entry::Vacant(slot) => {
                let refused = match self.builds.try_send(BuildJob { model: model.clone(), key }) {
                    Ok(()) => None,
                    Err(std::sync::mpsc::TrySendError::Full(_)) => Some(ServeError::Overloaded(format!(
                        "{VARIANT_BUILDS_QUEUED_MAX} shape variant builds are queued; try again later"
                    ))),
                    Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
                        Some(ServeError::Unavailable("the shape variant builder stopped".into()))
                    }
                };
                if let Some(e) = refused {
                    // Refused: the waiter (and so `on_done`) is dropped unanswered, as a refused
                    // submission is.
                    self.lock_waiting().remove(&ticket.0);
                    self.inflight.finish(ticket);
                    return Err(e);
                }
                info!(model = %model.name(), batch = key.batch, seq_len = key.seq_len, "building a shape variant");
                slot.insert(VariantSlot::Building(vec![waiter]));
            }
        }
        Ok(ticket)
    }

    fn lock_waiting(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, (AnswerCell, Arc<ModelMetrics>)>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers a request cancelled while it waits for a shape variant's build (nothing for one
    /// that is not waiting): it leaves the table of requests in flight at once, with its cause's
    /// error; the build goes on for the others.
    fn answer_waiting(&self, ticket: u64) {
        let Some((answer, metrics)) = self.lock_waiting().remove(&ticket) else { return };
        let Some(on_done) = answer.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
        let left = self.inflight.finish(Ticket(ticket));
        let (cause, timeout) = left.and_then(|e| e.cause.map(|c| (c, e.timeout))).unwrap_or((CancelCause::ClientGone, None));
        metrics.cancelled(cause);
        on_done(Err(cancel_error(cause, timeout)));
    }

    /// Submits a registered request to variant `v` (one user of it already counted, given back
    /// when the request is answered or refused). A refusal finishes the ticket, answers `on_done`
    /// with the error and returns it.
    #[allow(clippy::too_many_arguments)]
    fn submit_held<N: FnOnce() + Send + 'static>(
        &self,
        v: &Arc<Variant>,
        index: usize,
        inputs: Vec<Tensor>,
        options: RequestOptions,
        ticket: Ticket,
        before_done: Option<N>,
        on_done: DoneFn,
    ) -> Result<(), ServeError> {
        let cell = Arc::new(Mutex::new(Some(on_done)));
        let (held, answer) = (v.clone(), cell.clone());
        let done = move |r: Result<InferDone, ServeError>| {
            held.users.fetch_sub(1, Ordering::Relaxed);
            if let Some(f) = answer.lock().unwrap_or_else(|e| e.into_inner()).take() {
                f(r);
            }
        };
        let index = index.min(v.entry.instances.len() - 1);
        let r = self.submit_on(&v.entry, index, EngineIo::Tensors(inputs), options, ticket, before_done, done);
        if let Err(e) = &r {
            v.users.fetch_sub(1, Ordering::Relaxed);
            if let Some(f) = cell.lock().unwrap_or_else(|e| e.into_inner()).take() {
                f(Err(e.clone()));
            }
        }
        r
    }

    /// The thread that builds shape variants, one at a time, off every request's path. Holds the
    /// state only while it builds.
    fn start_builder(self: &Arc<Self>) -> Result<(), ServeError> {
        let Some(rx) = self.builds_rx.lock().unwrap_or_else(|e| e.into_inner()).take() else { return Ok(()) };
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("kairos-shape-builder".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let Some(state) = weak.upgrade() else { return };
                    state.build_variant(job);
                }
            })
            .map(|_| ())
            .map_err(|e| ServeError::Internal(format!("cannot start the shape variant builder thread: {e}")))
    }

    /// Plans and loads one shape variant, then hands it to the requests waiting for it (or the
    /// error). Planning holds no lock; loading holds the admin lock (as repository loads do).
    fn build_variant(&self, job: BuildJob) {
        let BuildJob { model, key } = job;
        let Some(d) = model.dynamic.clone() else { return };
        let name = model.name().to_string();
        let t0 = Instant::now();
        let planned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut config = model.config.clone();
            config.batch = key.batch;
            config.seq_len = key.seq_len;
            // A profile named in config.toml was measured on the start-up shape's plan: the
            // variant's is looked up by its own batch (and checked against its plan) instead.
            config.profile = None;
            plan_config(config, self.backend.profiles(), |plan| {
                if let Some(line) = self.backend.prepare(plan)? {
                    info!(model = %name, "{line}");
                }
                Ok(())
            })
        }))
        .unwrap_or_else(|p| Err(ServeError::Internal(format!("planning panicked: {}", panic_text(p)))));
        let admin = self.admin.lock().unwrap_or_else(|e| e.into_inner());
        let built = planned.and_then(|p| self.load_variant(&model, &d, key, p));
        let built = built.map_err(|e| match e {
            e @ (ServeError::Overloaded(_) | ServeError::Unavailable(_)) => e,
            e => ServeError::Unavailable(format!(
                "model '{name}' cannot serve batch {}, seq_len {}: building its plan failed: {e}",
                key.batch, key.seq_len
            )),
        });
        let waiters = {
            let mut t = d.variants.lock().unwrap_or_else(|e| e.into_inner());
            let waiters = match t.slots.remove(&key) {
                Some(VariantSlot::Building(w)) => w,
                Some(ready) => {
                    t.slots.insert(key, ready);
                    Vec::new()
                }
                None => Vec::new(),
            };
            if let Ok(v) = &built {
                t.clock += 1;
                v.last_used.store(t.clock, Ordering::Relaxed);
                v.users.fetch_add(waiters.len() as u32, Ordering::Relaxed);
                t.slots.insert(key, VariantSlot::Ready(v.clone()));
            }
            waiters
        };
        drop(admin);
        let seconds = t0.elapsed().as_secs_f64();
        model.metrics.variant_built(built.is_ok(), t0.elapsed().as_nanos() as u64);
        match &built {
            Ok(_) => {
                info!(model = %name, batch = key.batch, seq_len = key.seq_len, waiting = waiters.len(), seconds = format!("{seconds:.2}"), "shape variant loaded")
            }
            Err(e) => {
                warn!(model = %name, batch = key.batch, seq_len = key.seq_len, waiting = waiters.len(), error = %e, "shape variant failed")
            }
        }
        for w in waiters {
            w(self, built.clone());
        }
    }

    /// Loads a planned variant on the GPUs of the model's instances (the admin lock held), after
    /// making room: at most `shape_plans_max` variants, the least recently used idle one unloaded
    /// first, never one with requests.
    fn load_variant(
        &self,
        model: &Arc<ModelEntry>,
        d: &DynamicShapes,
        key: ShapeKey,
        p: PlannedModel,
    ) -> Result<Arc<Variant>, ServeError> {
        let name = model.name();
        let current = {
            let m = self.models.read().unwrap_or_else(|e| e.into_inner());
            matches!(m.get(name).map(|s| &s.state), Some(SlotState::Ready(e)) if Arc::ptr_eq(e, model))
        };
        if !current {
            return Err(ServeError::Unavailable(format!(
                "model '{name}' was unloaded or reloaded while its shape variant was built"
            )));
        }
        let evicted = {
            let mut t = d.variants.lock().unwrap_or_else(|e| e.into_inner());
            let ready: Vec<(ShapeKey, Arc<Variant>)> = t
                .slots
                .iter()
                .filter_map(|(k, s)| if let VariantSlot::Ready(v) = s { Some((*k, v.clone())) } else { None })
                .collect();
            if ready.len() < d.bounds.plans_max {
                None
            } else {
                let idle = ready
                    .iter()
                    .filter(|(_, v)| v.users.load(Ordering::Relaxed) == 0)
                    .min_by_key(|(_, v)| v.last_used.load(Ordering::Relaxed));
                match idle {
                    Some((k, v)) => {
                        t.slots.remove(k);
                        Some(v.clone())
                    }
                    None => {
                        return Err(ServeError::Overloaded(format!(
                            "model '{name}' keeps {} shape variants loaded (shape_plans_max) and each has requests in flight; try again",
                            d.bounds.plans_max
                        )));
                    }
                }
            }
        };
        if let Some(v) = evicted {
            for inst in &v.entry.instances {
                if let Err(e) = self.engines[inst.gpu as usize].engine.unload_model(&inst.engine_name) {
                    warn!(model = %name, variant = %inst.engine_name, error = %e, "cannot unload an evicted shape variant");
                }
            }
            model.metrics.variant_evicted();
            info!(model = %name, batch = v.key.batch, seq_len = v.key.seq_len, "shape variant evicted (least recently used)");
        }
        let many = model.instances.len() > 1;
        let placements =
            model.instances.iter().enumerate().map(|(i, base)| (base.gpu, key.engine_name(name, many.then_some(i)))).collect();
        let (instances, infos) = self.load_instances(&p, placements)?;
        let info = infos.into_iter().next();
        let entry = ModelEntry {
            inputs: p.plan.inputs.clone(),
            outputs: p.plan.outputs.clone(),
            instances,
            info: info.expect("a model has at least one instance"),
            metrics: model.metrics.clone(),
            config: p.config,
            dynamic: None,
        };
        Ok(Arc::new(Variant { key, entry: Arc::new(entry), users: AtomicU32::new(0), last_used: AtomicU64::new(0) }))
    }

    /// Cancels a request in flight for `cause` (nothing if it was answered already, or cancelled
    /// before): the engine stops its GPU work and it is answered with the cause's error. Never
    /// blocks (a cancel the engine's full queue refuses is sent again shortly).
    pub fn cancel(&self, ticket: Ticket, cause: CancelCause) {
        let due = InFlight::mark(&mut self.inflight.lock(), ticket.0, cause);
        if let Some((gpu, id)) = due {
            self.send_cancel(gpu, id);
        }
        self.answer_waiting(ticket.0);
    }

    /// Cancels every request in flight that the shared-memory connection `owner` sent; how many.
    pub fn cancel_owner(&self, owner: u64, cause: CancelCause) -> usize {
        self.cancel_where(|e| e.owner == Some(owner), cause)
    }

    /// Cancels every request in flight; how many.
    pub fn cancel_all(&self, cause: CancelCause) -> usize {
        self.cancel_where(|_| true, cause)
    }

    fn cancel_where(&self, pick: impl Fn(&crate::inflight::Entry) -> bool, cause: CancelCause) -> usize {
        let (marked, due) = {
            let mut t = self.inflight.lock();
            let tickets: Vec<u64> = t.entries.iter().filter(|(_, e)| e.cause.is_none() && pick(e)).map(|(&k, _)| k).collect();
            let due: Vec<_> = tickets.iter().filter_map(|&k| InFlight::mark(&mut t, k, cause)).collect();
            (tickets, due)
        };
        for (gpu, id) in due {
            self.send_cancel(gpu, id);
        }
        for &k in &marked {
            self.answer_waiting(k);
        }
        marked.len()
    }

    fn send_cancel(&self, gpu: u32, id: kairos_sched::RequestId) {
        match self.engines[gpu as usize].engine.try_cancel(id) {
            Ok(()) => {}
            Err(kairos_sched::Error::Overloaded { .. }) => {
                self.inflight.lock().retry.push((gpu, id));
                self.inflight.changed.notify_all();
            }
            // The engine stopped: it answers (fails) every request it held.
            Err(_) => {}
        }
    }

    /// A fresh id for a shared-memory connection ([`SubmitOptions::owner`]).
    pub fn new_owner(&self) -> u64 {
        self.next_owner.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The counters of each GPU's engine (requests completed, failed, cancelled, ...).
    pub fn engine_stats(&self) -> Vec<kairos_sched::EngineStats> {
        self.engines.iter().map(|e| e.engine.stats()).collect()
    }

    /// Requests handed to an engine and not answered yet (every front end).
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Blocks until no request is in flight or `until`, whichever comes first; the requests left.
    pub fn wait_in_flight(&self, until: Instant) -> usize {
        let mut t = self.inflight.lock();
        loop {
            let left = t.entries.len();
            let now = Instant::now();
            if left == 0 || now >= until {
                return left;
            }
            t = self.inflight.changed.wait_timeout(t, until - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Starts a drain: readiness turns false ("the server is draining") and new inference
    /// requests are refused with 503 / UNAVAILABLE; requests in flight go on. Liveness is not
    /// touched. See [`crate::RunningServer::drain`].
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The thread that cancels requests past their timeout and sends again the cancels a full
    /// queue refused. Holds the state only while it sends.
    fn start_watchdog(self: &Arc<Self>) -> Result<(), ServeError> {
        let weak = Arc::downgrade(self);
        let inflight = self.inflight.clone();
        std::thread::Builder::new()
            .name("kairos-timeouts".into())
            .spawn(move || {
                let mut t = inflight.lock();
                loop {
                    if t.stop {
                        return;
                    }
                    let now = Instant::now();
                    let mut due = std::mem::take(&mut t.retry);
                    let mut timed_out = Vec::new();
                    while let Some(&(d, ticket)) = t.deadlines.first() {
                        if d > now {
                            break;
                        }
                        t.deadlines.pop_first();
                        timed_out.push(ticket);
                        due.extend(InFlight::mark(&mut t, ticket, CancelCause::Timeout));
                    }
                    if !due.is_empty() || !timed_out.is_empty() {
                        drop(t);
                        let Some(state) = weak.upgrade() else { return };
                        for (gpu, id) in due {
                            state.send_cancel(gpu, id);
                        }
                        // Those waiting for a shape variant have no engine request to cancel.
                        for ticket in timed_out {
                            state.answer_waiting(ticket);
                        }
                        drop(state);
                        t = inflight.lock();
                    }
                    let mut wait =
                        t.deadlines.first().map_or(WATCHDOG_IDLE, |&(d, _)| d.saturating_duration_since(Instant::now()));
                    if !t.retry.is_empty() {
                        wait = wait.min(CANCEL_RETRY);
                    }
                    t = inflight.changed.wait_timeout(t, wait).unwrap_or_else(|e| e.into_inner()).0;
                }
            })
            .map(|_| ())
            .map_err(|e| ServeError::Internal(format!("cannot start the timeout thread: {e}")))
    }

    /// Counts a request's final outcome (every front end calls this exactly once per request).
    pub fn count(&self, model: Option<&ModelEntry>, class: Class, protocol: Protocol, outcome: Outcome) {
        match model {
            Some(m) => m.metrics.count(class, protocol, outcome),
            None => self.metrics.unknown().count(class, protocol, outcome),
        }
    }

    pub fn render_metrics(&self) -> String {
        let views: Vec<EngineView> = self
            .engines
            .iter()
            .enumerate()
            .map(|(i, e)| EngineView {
                gpu: i as u32,
                device: e.device.clone(),
                stats: e.engine.stats(),
                sample_period_s: BUSY_SAMPLE_PERIOD_US as f64 * 1e-6,
            })
            .collect();
        let serving = crate::metrics::Serving {
            models_ready: self.ready_models().len(),
            in_flight: self.in_flight(),
            draining: self.is_draining(),
        };
        self.metrics.render(&views, &serving)
    }

    fn start_sampler(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let stop = self.sampler_stop.clone();
        let spawned = std::thread::Builder::new().name("kairos-busy-sampler".into()).spawn(move || {
            let period = std::time::Duration::from_micros(BUSY_SAMPLE_PERIOD_US);
            let mut window: Vec<(u64, u64)> = Vec::new();
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(period);
                let Some(state) = weak.upgrade() else { return };
                window.resize(state.engines.len(), (0, 0));
                for (i, e) in state.engines.iter().enumerate() {
                    let busy = e.engine.stats().launches_in_flight > 0;
                    let g = &state.metrics.gpus[i];
                    g.samples.fetch_add(1, Ordering::Relaxed);
                    if busy {
                        g.busy_samples.fetch_add(1, Ordering::Relaxed);
                    }
                    let w = &mut window[i];
                    w.0 += busy as u64;
                    w.1 += 1;
                    if w.1 >= BUSY_WINDOW_SAMPLES {
                        g.busy_ratio_bits.store((w.0 as f64 / w.1 as f64).to_bits(), Ordering::Relaxed);
                        *w = (0, 0);
                    }
                }
            }
        });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the busy sampler; kairos_gpu_busy_* stay at 0");
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        self.sampler_stop.store(true, Ordering::Release);
        self.inflight.lock().stop = true;
        self.inflight.changed.notify_all();
    }
}

/// Cancels a request in flight ([`CancelCause::ClientGone`]) when dropped before
/// [`CancelOnDrop::disarm`]: REST and gRPC hold one while they await the engine's answer, and the
/// server drops their future when the client's connection or stream goes away.
pub struct CancelOnDrop {
    state: Arc<State>,
    ticket: Ticket,
    armed: bool,
}

impl CancelOnDrop {
    pub fn new(state: Arc<State>, ticket: Ticket) -> CancelOnDrop {
        CancelOnDrop { state, ticket, armed: true }
    }

    /// The request was answered: nothing to cancel.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.state.cancel(self.ticket, CancelCause::ClientGone);
        }
    }
}

/// A request's answer, boxed (a request waiting for a shape variant keeps it until it runs).
type DoneFn = Box<dyn FnOnce(Result<InferDone, ServeError>) + Send>;
/// The answer of a request waiting for a shape variant: taken by whoever answers it first (the
/// builder when the variant is ready, or a cancel).
type AnswerCell = Arc<Mutex<Option<DoneFn>>>;

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

/// What a request the server cancelled is answered.
fn cancel_error(cause: CancelCause, timeout: Option<Duration>) -> ServeError {
    match cause {
        CancelCause::Timeout => ServeError::DeadlineExceeded(format!(
            "the request ran past its timeout of {} us and was cancelled",
            timeout.map_or(0, |t| t.as_micros())
        )),
        CancelCause::Drain => ServeError::Unavailable(format!("{DRAINING}: the request was cancelled at the drain's deadline")),
        CancelCause::ClientGone => ServeError::Cancelled("the client went away".into()),
    }
}

/// The start-up loader thread: the start-up models one after another, then ready. Holds the state
/// only while it works on a model (a state dropped meanwhile ends it).
fn load_at_start(weak: Weak<State>) {
    let names = match weak.upgrade() {
        Some(state) => state.lock_startup().names.clone(),
        None => return,
    };
    let n = names.len();
    let mut stopped = false;
    for (i, name) in names.iter().enumerate() {
        let Some(state) = weak.upgrade() else { return };
        if !state.load_start_model(i, n, name) {
            stopped = true;
            break;
        }
    }
    if let Some(state) = weak.upgrade() {
        state.finish_startup(stopped);
    }
}

/// Reads a model's configuration and lowers it to a plan; finds its profile.
pub fn plan_model(repo: &Repository, name: &str, profiles: Option<&ProfileSet>) -> Result<PlannedModel, ServeError> {
    plan_with(repo, name, profiles, |_| Ok(()))
}

/// [`plan_model`] with the backend's profiles and its [`Backend::prepare`] step (autotuning on
/// CUDA) between lowering and the profile lookup.
pub fn plan_model_for(repo: &Repository, name: &str, backend: &dyn Backend) -> Result<PlannedModel, ServeError> {
    plan_with(repo, name, backend.profiles(), |plan| {
        if let Some(line) = backend.prepare(plan)? {
            info!(model = name, "{line}");
        }
        Ok(())
    })
}

fn plan_with(
    repo: &Repository,
    name: &str,
    profiles: Option<&ProfileSet>,
    prepare: impl FnOnce(&mut Plan) -> Result<(), ServeError>,
) -> Result<PlannedModel, ServeError> {
    let config = repo.config(name)?;
    let mut planned = plan_config(config, profiles, prepare)?;
    if planned.config.shapes.is_dynamic() {
        planned.axes = Some(shape_axes(&planned.config, &planned.plan)?);
    }
    Ok(planned)
}

/// Which input and output axes follow the batch and the sequence length: an .onnx file's
/// symbolic axes (axis 0 the batch, the others the sequence, as the import fixes them); a zoo
/// model's batch axis, and a transformer's sequence axis. A bound for an axis the model does not
/// have is an error.
pub fn shape_axes(config: &ModelConfig, plan: &Plan) -> Result<ShapeAxes, ServeError> {
    let name = &config.name;
    let fixed = |t: &IoTensor| vec![None; t.shape.len()];
    let axes = match &config.source {
        ModelSource::Onnx(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| ServeError::invalid(format!("model '{name}': {}: {e}", path.display())))?;
            let sig = kairos_ir::signature::read_signature(name, &bytes)
                .map_err(|e| ServeError::invalid(format!("model '{name}': {e}")))?;
            let roles = |decl: &[kairos_ir::signature::TensorSignature], t: &IoTensor| {
                decl.iter().find(|s| s.name == t.name && s.dims.len() == t.shape.len()).map_or_else(|| fixed(t), |s| s.roles())
            };
            ShapeAxes {
                inputs: plan.inputs.iter().map(|t| roles(&sig.inputs, t)).collect(),
                outputs: plan.outputs.iter().map(|t| roles(&sig.outputs, t)).collect(),
            }
        }
        ModelSource::Zoo(z) => {
            let transformer = kairos_ir::zoo::find(z).is_some_and(|e| e.kind == kairos_ir::zoo::ZooKind::Transformer);
            let roles = |t: &IoTensor, output: bool| -> Vec<Option<AxisRole>> {
                (0..t.shape.len())
                    .map(|axis| match axis {
                        0 => Some(AxisRole::Batch),
                        // Token ids [batch, seq]; hidden states and logits [batch, seq, ..].
                        1 if transformer && (!output || t.shape.len() >= 3) && t.shape[1] == config.seq_len => {
                            Some(AxisRole::Seq)
                        }
                        _ => None,
                    })
                    .collect()
            };
            ShapeAxes {
                inputs: plan.inputs.iter().map(|t| roles(t, false)).collect(),
                outputs: plan.outputs.iter().map(|t| roles(t, true)).collect(),
            }
        }
    };
    let has = |role: AxisRole| axes.inputs.iter().any(|r| r.contains(&Some(role)));
    let inputs = || plan.inputs.iter().map(|t| format!("{} {:?}", t.name, t.shape)).collect::<Vec<_>>().join(", ");
    if config.shapes.batch_max.is_some() && !has(AxisRole::Batch) {
        return Err(ServeError::invalid(format!(
            "model '{name}': batch_max is set, but no input of {} has a dynamic batch axis (inputs: {}); remove batch_max",
            config.source.describe(),
            inputs()
        )));
    }
    if config.shapes.seq_len.is_some() && !has(AxisRole::Seq) {
        return Err(ServeError::invalid(format!(
            "model '{name}': seq_len_min/seq_len_max are set, but no input of {} has a dynamic sequence axis (inputs: {}); remove them",
            config.source.describe(),
            inputs()
        )));
    }
    Ok(axes)
}

/// Lowers a configuration's model to a plan at its `batch` and `seq_len`, runs `prepare`, and
/// finds its profile.
fn plan_config(
    config: ModelConfig,
    profiles: Option<&ProfileSet>,
    prepare: impl FnOnce(&mut Plan) -> Result<(), ServeError>,
) -> Result<PlannedModel, ServeError> {
    let name = config.name.as_str();
    let mut plan = config.ir_spec().plan().map_err(|e| ServeError::invalid(format!("model '{name}': {e}")))?;
    prepare(&mut plan)?;
    let profile = match &config.profile {
        Some(p) => Some(ModelProfile::load(p).map_err(|e| ServeError::invalid(format!("model '{name}': profile: {e}")))?),
        None => {
            let batch = plan.inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1);
            let found = profiles.and_then(|s| {
                s.find(&plan.model, plan.dtype, batch).or_else(|| s.find(&config.profile_key(), plan.dtype, batch))
            });
            // A profile of an older lowering would misplace every estimate: without it, the
            // dispatcher and the simulator fall back to roofline estimates.
            match found.map(|p| (p, p.check_plan(&plan))) {
                Some((p, Ok(()))) => Some(p.clone()),
                Some((_, Err(e))) => {
                    tracing::warn!(model = name, "stale profile ignored: {e}");
                    None
                }
                None => None,
            }
        }
    };
    Ok(PlannedModel { config, plan: Arc::new(plan), profile, axes: None })
}

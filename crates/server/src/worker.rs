//! GPU worker processes: each GPU's engine in a child process of its own, restarted after a fault.
//!
//! On CUDA a sticky fault (an illegal address, a failed launch) lasts as long as the process
//! that made the context: no reset brings the GPU back (measured on an H100 on 2026-11-26:
//! `cuDevicePrimaryCtxRetain` still answers `CUDA_ERROR_ILLEGAL_ADDRESS` after
//! `cuDevicePrimaryCtxReset`). So that such a fault costs one GPU's engine a restart and not the
//! whole server, `kairos serve --gpu-workers on` runs each GPU's engine in a worker: the same
//! binary started as `kairos serve <the server's arguments> --worker-gpu N`. The server keeps the
//! front ends, the model table and every loaded model's plan; the worker keeps the dispatcher and
//! the GPU.
//!
//! ```text
//!   front ends -> State -> EngineHandle::Worker --- worker's stdin: frames --->  worker: Engine + GPU
//!                  completions <- supervisor thread <-- worker's stdout: frames --
//! ```
//!
//! A supervisor thread per GPU reads the worker's frames and completes the requests. When the
//! worker ends (it exits once its engine stopped for good, it crashed, it was killed), the
//! supervisor answers every request the worker held with [`Error::GpuFailed`] (HTTP 503 / gRPC
//! UNAVAILABLE, with the cause), refuses new ones the same way while it restarts the worker,
//! loads every model the old one had into the new one (from the plans kept here), and serves
//! again. Other GPUs' workers and the front ends go on meanwhile. A worker exits when its stdin
//! closes, so none outlives the server.
//!
//! Frames, both ways: `[u32 header bytes][u32 blob count][header JSON][per blob: u64 bytes, the
//! bytes]`, little-endian. Tensor data and weights travel as blobs, everything else in the header.
//!
//! Not through a worker: zero-copy host mappings (a worker cannot see the server's memory; the
//! shared-memory channel copies instead), and a load's weights cross the pipe once per load and
//! again after each restart (about 1-2 GB/s).

use crate::error::ServeError;
use crate::repository::{ModelConfig, ModelSource};
use crate::state::{Backend, EngineHandle, PlannedModel};
use kairos_gpu::DeviceInfo;
use kairos_gpu::profile::{ModelProfile, ProfileSet};
use kairos_ir::plan::{AlignedBytes, Plan};
use kairos_ir::{DType, Tensor, TensorData};
use kairos_sched::{EngineStats, Error, ModelInfo, ModelSpec, RecoveryReport, RequestId, RequestOptions, Response, Timing};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Largest frame header (JSON) either side accepts.
pub const FRAME_HEADER_BYTES_MAX: u32 = 256 << 20;
/// Most blobs in one frame.
pub const FRAME_BLOBS_MAX: u32 = 4096;
/// Largest blob (a model's weights travel as one).
pub const FRAME_BLOB_BYTES_MAX: u64 = 64 << 30;
/// Workers started in a row for one GPU after a fault before the server gives that GPU up (its
/// requests then fail at once, and the server reports itself not live).
pub const WORKER_START_ATTEMPTS_MAX: u32 = 3;
/// Pause between two start attempts.
const WORKER_RETRY_MS: u64 = 200;
/// How often a worker sends its engine's counters.
const STATS_INTERVAL_MS: u64 = 50;
/// How often a worker checks whether its engine stopped.
const STOP_POLL_MS: u64 = 2;
/// How long a stopping server waits for a worker to exit before it kills it.
const WORKER_EXIT_WAIT: Duration = Duration::from_secs(5);
/// The exit status of a worker whose engine stopped for good.
pub const WORKER_EXIT_ENGINE_STOPPED: i32 = 3;
/// Recovery reports kept per GPU (the latest).
const REPORTS_MAX: usize = 16;
/// The pipes' buffer (Linux's default is 64 KiB; 1 MiB is the default most an unprivileged
/// process may ask for): a request's tensors (resnet50's input: 294 KiB) go through in one write
/// instead of the writer waiting on the reader chunk by chunk.
const PIPE_BYTES: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// The wire.

#[derive(Serialize, Deserialize)]
struct WireTensor {
    dtype: DType,
    shape: Vec<usize>,
}

/// [`Error`] on the wire (its `Overloaded::what` is a static string).
#[derive(Serialize, Deserialize)]
enum WireError {
    UnknownModel(String),
    ModelExists(String),
    ModelUnloading(String),
    InvalidModel(String),
    InvalidInput(String),
    Overloaded { what: String, max: u64 },
    Cancelled,
    Gpu(String),
    ShuttingDown,
    GpuFailed(String),
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> WireError {
        match e.clone() {
            Error::UnknownModel(m) => WireError::UnknownModel(m),
            Error::ModelExists(m) => WireError::ModelExists(m),
            Error::ModelUnloading(m) => WireError::ModelUnloading(m),
            Error::InvalidModel(m) => WireError::InvalidModel(m),
            Error::InvalidInput(m) => WireError::InvalidInput(m),
            Error::Overloaded { what, max } => WireError::Overloaded { what: what.to_string(), max },
            Error::Cancelled => WireError::Cancelled,
            Error::Gpu(m) => WireError::Gpu(m),
            Error::ShuttingDown => WireError::ShuttingDown,
            Error::GpuFailed(m) => WireError::GpuFailed(m),
        }
    }
}

impl From<WireError> for Error {
    fn from(e: WireError) -> Error {
        match e {
            WireError::UnknownModel(m) => Error::UnknownModel(m),
            WireError::ModelExists(m) => Error::ModelExists(m),
            WireError::ModelUnloading(m) => Error::ModelUnloading(m),
            WireError::InvalidModel(m) => Error::InvalidModel(m),
            WireError::InvalidInput(m) => Error::InvalidInput(m),
            WireError::Overloaded { what, max } => {
                // The engine's limits, by name (a static string on this side too).
                let what = ["submission queue", "dispatcher jobs", "host mappings", "models", "tenants"]
                    .into_iter()
                    .find(|w| *w == what)
                    .unwrap_or("a worker queue");
                Error::Overloaded { what, max }
            }
            WireError::Cancelled => Error::Cancelled,
            WireError::Gpu(m) => Error::Gpu(m),
            WireError::ShuttingDown => Error::ShuttingDown,
            WireError::GpuFailed(m) => Error::GpuFailed(m),
        }
    }
}

/// The server to a worker.
// `Load` carries a whole plan; a message is built, written and dropped, never stored in bulk.
#[allow(clippy::large_enum_variant)]
#[derive(Serialize, Deserialize)]
enum ToWorker {
    /// Blob 0: the plan's weights.
    Load {
        name: String,
        plan: Plan,
        profile: Option<ModelProfile>,
    },
    Unload {
        name: String,
    },
    /// One blob per input, in order.
    Submit {
        tag: u64,
        model: String,
        options: RequestOptions,
        notify: bool,
        inputs: Vec<WireTensor>,
    },
    Cancel {
        tag: u64,
    },
    Shutdown,
}

/// A worker to the server.
#[derive(Serialize, Deserialize)]
enum FromWorker {
    Ready {
        device: DeviceInfo,
    },
    Loaded {
        name: String,
        result: Result<ModelInfo, WireError>,
    },
    Unloaded {
        name: String,
        result: Result<(), WireError>,
    },
    /// One blob per output, in order.
    Done {
        tag: u64,
        result: Result<(Timing, Vec<WireTensor>), WireError>,
    },
    AlmostDone {
        tag: u64,
    },
    Stats(EngineStats),
    /// The engine stopped for good (its GPU could not be reset); the worker exits next.
    Stopped {
        reason: String,
    },
}

/// A frame's first bytes: the lengths and the JSON header (the blobs follow, each with its length).
fn frame_head<H: Serialize>(header: &H, blob_count: usize) -> std::io::Result<Vec<u8>> {
    let h = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    if h.len() > FRAME_HEADER_BYTES_MAX as usize || blob_count > FRAME_BLOBS_MAX as usize {
        return Err(std::io::Error::other(format!(
            "a frame of {} header bytes and {blob_count} blobs is over the limits ({FRAME_HEADER_BYTES_MAX}, {FRAME_BLOBS_MAX})",
            h.len()
        )));
    }
    let mut out = Vec::with_capacity(8 + h.len());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&(blob_count as u32).to_le_bytes());
    out.extend_from_slice(&h);
    Ok(out)
}

/// Writes a frame from its head and blobs, the blobs straight from where they lie (a large write
/// goes past the writer's buffer): tensor data is copied once, into the pipe.
fn write_parts<W: Write>(w: &mut W, head: &[u8], blobs: &[&[u8]]) -> std::io::Result<()> {
    w.write_all(head)?;
    for b in blobs {
        w.write_all(&(b.len() as u64).to_le_bytes())?;
        w.write_all(b)?;
    }
    w.flush()
}

fn write_frame<W: Write, H: Serialize>(w: &mut W, header: &H, blobs: &[&[u8]]) -> std::io::Result<()> {
    write_parts(w, &frame_head(header, blobs.len())?, blobs)
}

/// The next frame's header and its blob count (its blobs follow on the stream: the caller reads
/// them with [`read_tensors`], [`read_weights`] or [`skip_blobs`]); `None` at a clean end of the
/// stream (between frames).
fn read_head<R: Read, H: DeserializeOwned>(r: &mut R) -> std::io::Result<Option<(H, u32)>> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let header_bytes = u32::from_le_bytes(head[..4].try_into().unwrap());
    let blob_count = u32::from_le_bytes(head[4..].try_into().unwrap());
    if header_bytes > FRAME_HEADER_BYTES_MAX || blob_count > FRAME_BLOBS_MAX {
        return Err(std::io::Error::other(format!("a frame announces {header_bytes} header bytes and {blob_count} blobs")));
    }
    let mut h = vec![0u8; header_bytes as usize];
    r.read_exact(&mut h)?;
    let header = serde_json::from_slice(&h).map_err(std::io::Error::other)?;
    Ok(Some((header, blob_count)))
}

fn read_blob_len<R: Read>(r: &mut R) -> std::io::Result<usize> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > FRAME_BLOB_BYTES_MAX {
        return Err(std::io::Error::other(format!("a frame announces a blob of {len} bytes")));
    }
    Ok(len as usize)
}

/// Reads and drops `count` blobs.
fn skip_blobs<R: Read>(r: &mut R, count: u32) -> std::io::Result<()> {
    for _ in 0..count {
        let len = read_blob_len(r)? as u64;
        let skipped = std::io::copy(&mut r.by_ref().take(len), &mut std::io::sink())?;
        if skipped != len {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

/// A frame's first blob as a model's weights (read straight into their aligned buffer), the rest
/// dropped; `None` without blobs.
fn read_weights<R: Read>(r: &mut R, count: u32) -> std::io::Result<Option<AlignedBytes>> {
    if count == 0 {
        return Ok(None);
    }
    let len = read_blob_len(r)?;
    let mut w = AlignedBytes::zeroed(len);
    r.read_exact(w.as_mut_slice())?;
    skip_blobs(r, count - 1)?;
    Ok(Some(w))
}

fn tensor_bytes(t: &Tensor) -> &[u8] {
    match &t.data {
        TensorData::F32(v) => bytemuck::cast_slice(v),
        TensorData::F16(v) => bytemuck::cast_slice(v),
        TensorData::I64(v) => bytemuck::cast_slice(v),
    }
}

fn wire_heads(tensors: &[Tensor]) -> Vec<WireTensor> {
    tensors.iter().map(|t| WireTensor { dtype: t.dtype(), shape: t.shape.clone() }).collect()
}

/// The tensors a frame's header announced, read straight into their elements (one copy, out of
/// the pipe). Both sides are this binary: a blob that does not fit its tensor breaks the stream.
fn read_tensors<R: Read>(r: &mut R, heads: Vec<WireTensor>, count: u32) -> std::io::Result<Vec<Tensor>> {
    if heads.len() != count as usize {
        return Err(std::io::Error::other(format!("{} tensors announced, {count} sent", heads.len())));
    }
    let mut out = Vec::with_capacity(heads.len());
    for h in heads {
        let len = read_blob_len(r)?;
        let want = h.shape.iter().try_fold(h.dtype.size_bytes(), |n, &d| n.checked_mul(d));
        if want != Some(len) {
            return Err(std::io::Error::other(format!("a {} tensor of shape {:?} came with {len} bytes", h.dtype, h.shape)));
        }
        let mut t = Tensor::zeros(h.dtype, h.shape);
        let bytes: &mut [u8] = match &mut t.data {
            TensorData::F32(v) => bytemuck::cast_slice_mut(v),
            TensorData::F16(v) => bytemuck::cast_slice_mut(v),
            TensorData::I64(v) => bytemuck::cast_slice_mut(v),
        };
        r.read_exact(bytes)?;
        out.push(t);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The worker's side.

/// Runs a GPU worker (`kairos serve ... --worker-gpu N`): the engine of GPU `gpu` started by
/// `backend`, driven by the server through stdin and stdout. Returns when the server closes stdin
/// or asks it to stop; exits the process with [`WORKER_EXIT_ENGINE_STOPPED`] once its engine
/// stopped for good. Anything else written to stdout goes to stderr from the start.
/// `test_hang_in_load` (tests only): a load of the model of this name never finishes (as one stuck
/// in the driver would), while the worker serves the other models.
pub fn run_worker(backend: Arc<dyn Backend>, gpu: u32, test_hang_in_load: Option<String>) -> Result<(), ServeError> {
    let proto = take_stdout()?;
    let out = Arc::new(Mutex::new(BufWriter::with_capacity(1 << 20, proto)));
    let send = {
        let out = out.clone();
        move |header: &FromWorker, blobs: &[&[u8]]| -> bool {
            let mut w = out.lock().unwrap_or_else(|e| e.into_inner());
            write_frame(&mut *w, header, blobs).is_ok()
        }
    };
    let (handle, name) = backend.start(gpu, &[])?;
    let EngineHandle::InProcess(engine) = handle else {
        return Err(ServeError::Internal("a GPU worker's backend must start its engine in the worker".into()));
    };
    let engine = Arc::new(engine);
    info!(gpu, device = %name, "GPU worker ready");
    if !send(&FromWorker::Ready { device: engine.device().clone() }, &[]) {
        return Err(ServeError::Internal("the server closed the worker's output".into()));
    }
    // The engine's counters, and its end: once stopped, say why and exit (the server restarts the
    // worker; nothing of this process is worth keeping).
    {
        let engine = engine.clone();
        let send = send.clone();
        std::thread::Builder::new()
            .name("kairos-worker-stats".into())
            .spawn(move || {
                let mut last_stats = Instant::now();
                loop {
                    std::thread::sleep(Duration::from_millis(STOP_POLL_MS));
                    if let Some(reason) = engine.stopped() {
                        send(&FromWorker::Stats(engine.stats()), &[]);
                        send(&FromWorker::Stopped { reason }, &[]);
                        std::process::exit(WORKER_EXIT_ENGINE_STOPPED);
                    }
                    if last_stats.elapsed() >= Duration::from_millis(STATS_INTERVAL_MS) {
                        last_stats = Instant::now();
                        if !send(&FromWorker::Stats(engine.stats()), &[]) {
                            return;
                        }
                    }
                }
            })
            .map_err(|e| ServeError::Internal(format!("cannot start the worker's stats thread: {e}")))?;
    }
    // Requests the engine holds: the server's tag -> the engine's id (for cancellation).
    let tags: Arc<Mutex<HashMap<u64, RequestId>>> = Arc::default();
    let mut input = BufReader::with_capacity(1 << 20, std::io::stdin().lock());
    loop {
        let (msg, blobs) = match read_head::<_, ToWorker>(&mut input) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                warn!(gpu, error = %e, "GPU worker: cannot read from the server; stopping");
                break;
            }
        };
        match msg {
            ToWorker::Load { name, mut plan, profile } => {
                let weights = match read_weights(&mut input, blobs) {
                    Ok(w) => w,
                    Err(e) => {
                        warn!(gpu, error = %e, "GPU worker: cannot read a model's weights; stopping");
                        break;
                    }
                };
                let Some(weights) = weights else {
                    let e = WireError::InvalidModel(format!("model '{name}' came without its weights"));
                    send(&FromWorker::Loaded { name, result: Err(e) }, &[]);
                    continue;
                };
                plan.weights = Arc::new(weights);
                // Loads block until the weights are up: on a thread of their own, so that
                // requests for the models already loaded keep flowing.
                let (engine, backend, send) = (engine.clone(), backend.clone(), send.clone());
                let hang = test_hang_in_load.as_deref() == Some(name.as_str());
                let spawned = std::thread::Builder::new().name("kairos-worker-load".into()).spawn(move || {
                    if hang {
                        warn!(gpu, model = %name, "GPU worker: this load hangs (--test-worker-hang-in-load)");
                        loop {
                            std::thread::sleep(Duration::from_secs(3600));
                        }
                    }
                    let result = load_in_worker(&*backend, &engine, gpu, &name, plan, profile);
                    send(&FromWorker::Loaded { name, result: result.map_err(|e| WireError::from(&e)) }, &[]);
                });
                if let Err(e) = spawned {
                    warn!(gpu, error = %e, "GPU worker: cannot start a load thread");
                }
            }
            ToWorker::Unload { name } => {
                if skip_blobs(&mut input, blobs).is_err() {
                    break;
                }
                let (engine, send) = (engine.clone(), send.clone());
                let spawned = std::thread::Builder::new().name("kairos-worker-unload".into()).spawn(move || {
                    let result = engine.unload_model(&name);
                    send(&FromWorker::Unloaded { name, result: result.map_err(|e| WireError::from(&e)) }, &[]);
                });
                if let Err(e) = spawned {
                    warn!(gpu, error = %e, "GPU worker: cannot start an unload thread");
                }
            }
            ToWorker::Submit { tag, model, options, notify, inputs } => {
                let inputs = match read_tensors(&mut input, inputs, blobs) {
                    Ok(t) => t,
                    Err(e) => {
                        warn!(gpu, error = %e, "GPU worker: cannot read a request's tensors; stopping");
                        break;
                    }
                };
                let done = {
                    let (send, tags) = (send.clone(), tags.clone());
                    move |r: Result<Response, Error>| {
                        tags.lock().unwrap_or_else(|e| e.into_inner()).remove(&tag);
                        match r {
                            Ok(resp) => {
                                let blobs: Vec<&[u8]> = resp.outputs.iter().map(tensor_bytes).collect();
                                send(&FromWorker::Done { tag, result: Ok((resp.timing, wire_heads(&resp.outputs))) }, &blobs);
                            }
                            Err(e) => {
                                send(&FromWorker::Done { tag, result: Err(WireError::from(&e)) }, &[]);
                            }
                        }
                    }
                };
                // The tag goes in before the completion can take it out: the completion locks
                // the map, held here until the engine has the request.
                let mut held = tags.lock().unwrap_or_else(|e| e.into_inner());
                let r = if notify {
                    let send = send.clone();
                    engine.submit_notify(
                        &model,
                        inputs,
                        options,
                        move || {
                            send(&FromWorker::AlmostDone { tag }, &[]);
                        },
                        done,
                    )
                } else {
                    engine.submit_with(&model, inputs, options, done)
                };
                match r {
                    Ok(id) => {
                        held.insert(tag, id);
                    }
                    Err(e) => {
                        drop(held);
                        send(&FromWorker::Done { tag, result: Err(WireError::from(&e)) }, &[]);
                    }
                }
            }
            ToWorker::Cancel { tag } => {
                if skip_blobs(&mut input, blobs).is_err() {
                    break;
                }
                let id = tags.lock().unwrap_or_else(|e| e.into_inner()).get(&tag).copied();
                if let Some(id) = id {
                    let _ = engine.cancel(id);
                }
            }
            ToWorker::Shutdown => break,
        }
    }
    info!(gpu, "GPU worker stopping");
    // The engine answers what it still holds (those answers go out) and frees the GPU.
    match Arc::try_unwrap(engine) {
        Ok(e) => e.shutdown(),
        Err(e) => drop(e),
    }
    let _ = out.lock().unwrap_or_else(|e| e.into_inner()).flush();
    Ok(())
}

/// Prepares (the CUDA backend's autotuner) and loads one model in a worker.
fn load_in_worker(
    backend: &dyn Backend,
    engine: &kairos_sched::Engine,
    gpu: u32,
    name: &str,
    mut plan: Plan,
    profile: Option<ModelProfile>,
) -> Result<ModelInfo, Error> {
    match backend.prepare(&mut plan) {
        Ok(Some(line)) => info!(gpu, model = %name, "{line}"),
        Ok(None) => {}
        Err(e) => return Err(Error::InvalidModel(format!("preparing '{name}' for the GPU: {e}"))),
    }
    // The server matched the profile against the plan before this worker retiled it: the same
    // launches on other tiles keep their profiled times (`ModelProfile::retiled_for`); a profile
    // of other launches would misplace every estimate and is dropped.
    let profile = profile.and_then(|p| match p.check_plan(&plan) {
        Ok(()) => Some(p),
        Err(e) => match p.retiled_for(&plan) {
            Some((kept, n)) => {
                info!(gpu, model = %name, "{n} launches retiled at load: their profiled times kept as estimates");
                Some(kept)
            }
            None => {
                warn!(gpu, model = %name, "stale profile ignored after preparing the plan: {e}");
                None
            }
        },
    });
    let plan = Arc::new(plan);
    let planned = PlannedModel {
        config: ModelConfig::defaults(name, ModelSource::Zoo(plan.model.clone())),
        plan: plan.clone(),
        profile: profile.clone(),
        axes: None,
    };
    // The simulator registers a measured profile with its timing model here (nothing on CUDA).
    backend.register_start_model(gpu, &planned).map_err(|e| Error::InvalidModel(e.to_string()))?;
    engine.load_model(ModelSpec { name: name.to_string(), plan, profile })
}

/// Keeps the process's stdout for the protocol and points file descriptor 1 at stderr, so that
/// nothing printed by accident corrupts the frames.
fn take_stdout() -> Result<std::fs::File, ServeError> {
    let fail = |e: rustix::io::Errno| ServeError::Internal(format!("GPU worker: cannot set up its output: {e}"));
    let proto = rustix::io::fcntl_dupfd_cloexec(std::io::stdout(), 3).map_err(fail)?;
    rustix::stdio::dup2_stdout(std::io::stderr()).map_err(fail)?;
    Ok(std::fs::File::from(proto))
}

// ---------------------------------------------------------------------------------------------
// The server's side.

/// How to start a worker: the binary and the arguments before `--worker-gpu N`.
#[derive(Clone, Debug)]
pub struct WorkerSpawn {
    pub exe: PathBuf,
    pub args: Vec<OsString>,
    /// How long a worker may take from its start until its engine runs and it says ready; past it
    /// the worker is killed and the start counts as failed (see [`WORKER_START_ATTEMPTS_MAX`]).
    pub start_timeout_ms: u64,
    /// How long a model's load in a running worker (the model-control API's, or start-up's) may
    /// take until the worker answers; past it the load fails and the worker counts as failed: it is
    /// killed and restarted. After a restart the worker loads the server's models again within
    /// this limit per model, or the start counts as failed.
    pub load_timeout_ms: u64,
}

/// Default of [`WorkerSpawn::load_timeout_ms`]: a load autotunes and copies gigabytes of weights.
pub const MODEL_LOAD_TIMEOUT_S_DEFAULT: u64 = 600;

/// Default of [`WorkerSpawn::start_timeout_ms`]: CUDA's initialisation fits well within it.
pub const WORKER_START_TIMEOUT_S_DEFAULT: u64 = 300;

/// How often a start watch checks whether the server stops.
const START_WATCH_POLL_MS: u64 = 50;

/// Kills a starting worker that is not ready within its time limit, or whose server stops
/// meanwhile (a hung start would otherwise hold the server's stop). Disarmed before the worker's
/// process is reaped, so that the process id it kills is still the worker's.
struct StartWatch {
    disarm: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<bool>>,
    timeout_ms: u64,
    /// What the worker had to do in time ("become ready", "load its models again").
    what: &'static str,
}

impl StartWatch {
    fn arm(pid: u32, timeout_ms: u64, what: &'static str, stopping: Arc<AtomicBool>) -> std::io::Result<StartWatch> {
        let (tx, rx) = mpsc::channel::<()>();
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let thread = std::thread::Builder::new().name("kairos-worker-start".into()).spawn(move || {
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left.min(Duration::from_millis(START_WATCH_POLL_MS))) {
                    Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => return false,
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                }
                if Instant::now() >= deadline || stopping.load(Ordering::Acquire) {
                    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                    return true;
                }
            }
        })?;
        Ok(StartWatch { disarm: Some(tx), thread: Some(thread), timeout_ms, what })
    }

    /// Stops watching; true when the watch killed the worker.
    fn disarm(&mut self) -> bool {
        drop(self.disarm.take());
        self.thread.take().is_some_and(|t| t.join().unwrap_or(false))
    }

    /// Why the start failed: the time limit when the watch killed the worker (what the reader saw
    /// then is its consequence), else `why`.
    fn cause(&mut self, why: String) -> String {
        if self.disarm() {
            format!("the GPU worker did not {} within {} s and was killed", self.what, self.timeout_ms.div_ceil(1000))
        } else {
            why
        }
    }
}

impl Drop for StartWatch {
    fn drop(&mut self) {
        self.disarm();
    }
}

type Completer = Box<dyn FnOnce(Result<Response, Error>) + Send>;
type Notifier = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Waiters {
    requests: HashMap<u64, (Completer, Option<Notifier>)>,
    loads: HashMap<String, VecDeque<SyncSender<Result<ModelInfo, Error>>>>,
    unloads: HashMap<String, VecDeque<SyncSender<Result<(), Error>>>>,
}

impl Waiters {
    /// Answers everything with `e`; returns the requests answered.
    fn abandon(&mut self, e: &Error) -> u64 {
        let n = self.requests.len() as u64;
        for (_, (c, _)) in self.requests.drain() {
            c(Err(e.clone()));
        }
        for (_, q) in self.loads.drain() {
            q.into_iter().for_each(|tx| drop(tx.send(Err(e.clone()))));
        }
        for (_, q) in self.unloads.drain() {
            q.into_iter().for_each(|tx| drop(tx.send(Err(e.clone()))));
        }
        n
    }
}

struct Shared {
    gpu: u32,
    spawn: WorkerSpawn,
    device: DeviceInfo,
    /// The running worker's stdin; `None` while it is restarted (requests are refused then).
    conn: Mutex<Option<BufWriter<ChildStdin>>>,
    child: Mutex<Option<Child>>,
    waiters: Mutex<Waiters>,
    /// Loaded models, to load again into a restarted worker.
    models: Mutex<BTreeMap<String, ModelSpec>>,
    /// The worker's latest counters.
    stats: Mutex<EngineStats>,
    /// Counters of the workers before the running one (added to its own).
    earlier: Mutex<EngineStats>,
    restarting: AtomicBool,
    restarts: AtomicU64,
    /// The generation of the worker in `child` (set before it goes there).
    generation: AtomicU64,
    /// Why the server killed the running worker (the supervisor tells it as the worker's end).
    kill_cause: Mutex<Option<String>>,
    /// Requests the server answered itself because their worker ended.
    failed_here: AtomicU64,
    /// Shared with a starting worker's [`StartWatch`], which kills it when the server stops.
    stopping: Arc<AtomicBool>,
    /// Why the latest start attempt of a restart failed (told to the requests refused meanwhile).
    last_start_error: Mutex<Option<String>>,
    stopped: Mutex<Option<String>>,
    reports: Mutex<VecDeque<RecoveryReport>>,
    next_tag: AtomicU64,
    requests_max: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A GPU's engine in a worker process (see the module docs): the same calls as
/// [`kairos_sched::Engine`], answered by the worker.
pub struct WorkerEngine {
    shared: Arc<Shared>,
    supervisor: Option<std::thread::JoinHandle<()>>,
}

struct Started {
    child: Child,
    stdin: BufWriter<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    device: DeviceInfo,
    /// Armed until the start is over (the caller disarms it once the worker serves).
    watch: StartWatch,
}

impl Started {
    /// Ends a start that failed with `why`: the worker killed and reaped; returns the cause with
    /// the worker's exit status.
    fn fail(mut self, why: String) -> String {
        let why = self.watch.cause(why);
        kill_and_reap(&mut self.child, why)
    }
}

/// Kills and reaps a worker whose start failed with `why`; returns `why` with its exit status.
fn kill_and_reap(child: &mut Child, why: String) -> String {
    let _ = child.kill();
    let status = child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
    format!("{why} (worker {status})")
}

/// Starts a worker for `gpu` and waits for it to be ready, at most `spawn.start_timeout_ms` (the
/// returned watch keeps counting until the caller disarms it) or until `stopping` is set.
fn spawn_worker(spawn: &WorkerSpawn, gpu: u32, generation: u64, stopping: &Arc<AtomicBool>) -> Result<Started, String> {
    let mut child = Command::new(&spawn.exe)
        .args(&spawn.args)
        .arg("--worker-gpu")
        .arg(gpu.to_string())
        .arg("--worker-generation")
        .arg(generation.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the GPU worker {}: {e}", spawn.exe.display()))?;
    let (stdin, stdout) = (child.stdin.take().expect("piped"), child.stdout.take().expect("piped"));
    for (pipe, what) in [(stdin.as_fd(), "stdin"), (stdout.as_fd(), "stdout")] {
        if let Err(e) = rustix::pipe::fcntl_setpipe_size(pipe, PIPE_BYTES) {
            warn!(gpu, error = %e, "the GPU worker's {what} pipe keeps its default size");
        }
    }
    let stdin = BufWriter::with_capacity(1 << 20, stdin);
    let mut stdout = BufReader::with_capacity(1 << 20, stdout);
    let mut watch = match StartWatch::arm(child.id(), spawn.start_timeout_ms.max(1), "become ready", stopping.clone()) {
        Ok(w) => w,
        Err(e) => return Err(kill_and_reap(&mut child, format!("cannot watch the GPU worker's start: {e}"))),
    };
    let why = match read_head::<_, FromWorker>(&mut stdout) {
        Ok(Some((FromWorker::Ready { device }, 0))) => return Ok(Started { child, stdin, stdout, device, watch }),
        Ok(Some(_)) => "the GPU worker spoke before it was ready".to_string(),
        Ok(None) => "the GPU worker exited before it was ready; its log says why".to_string(),
        Err(e) => format!("cannot read from the GPU worker: {e}"),
    };
    let why = watch.cause(why);
    Err(kill_and_reap(&mut child, why))
}

impl WorkerEngine {
    /// Starts the worker of `gpu` (generation 0) and its supervisor; returns once the worker's
    /// engine runs. `requests_max` bounds the requests the worker holds at once.
    /// A start that fails (the worker exits, or is not ready within `spawn.start_timeout_ms`) is
    /// tried again, [`WORKER_START_ATTEMPTS_MAX`] times in all.
    pub fn start(gpu: u32, spawn: WorkerSpawn, requests_max: usize) -> Result<WorkerEngine, ServeError> {
        let stopping = Arc::new(AtomicBool::new(false));
        let mut attempt = 0;
        let s = loop {
            attempt += 1;
            match spawn_worker(&spawn, gpu, 0, &stopping) {
                Ok(mut s) => {
                    s.watch.disarm();
                    break s;
                }
                Err(e) if attempt >= WORKER_START_ATTEMPTS_MAX => {
                    return Err(ServeError::Internal(format!("GPU {gpu}: {attempt} worker starts failed: {e}")));
                }
                Err(e) => {
                    warn!(gpu, attempt, error = %e, "cannot start a GPU worker; trying again");
                    eprintln!("kairos: GPU {gpu}: worker start {attempt} failed: {e}");
                    std::thread::sleep(Duration::from_millis(WORKER_RETRY_MS));
                }
            }
        };
        let shared = Arc::new(Shared {
            gpu,
            spawn,
            device: s.device,
            conn: Mutex::new(Some(s.stdin)),
            child: Mutex::new(Some(s.child)),
            waiters: Mutex::default(),
            models: Mutex::default(),
            stats: Mutex::default(),
            earlier: Mutex::default(),
            restarting: AtomicBool::new(false),
            restarts: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            kill_cause: Mutex::new(None),
            failed_here: AtomicU64::new(0),
            stopping,
            last_start_error: Mutex::new(None),
            stopped: Mutex::new(None),
            reports: Mutex::default(),
            next_tag: AtomicU64::new(1),
            requests_max: requests_max.max(1),
        });
        let sup = shared.clone();
        let stdout = s.stdout;
        let supervisor = std::thread::Builder::new()
            .name(format!("kairos-worker-{gpu}"))
            .spawn(move || supervise(&sup, stdout))
            .map_err(|e| ServeError::Internal(format!("cannot start the supervisor of GPU {gpu}: {e}")))?;
        Ok(WorkerEngine { shared, supervisor: Some(supervisor) })
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.shared.device
    }

    /// Why new work is refused right now, if it is.
    fn refusal(&self) -> Error {
        let s = &self.shared;
        if let Some(why) = lock(&s.stopped).clone() {
            return Error::GpuFailed(format!("GPU {} stopped: {why}", s.gpu));
        }
        if s.stopping.load(Ordering::Acquire) {
            return Error::ShuttingDown;
        }
        match lock(&s.last_start_error).clone() {
            Some(e) => {
                Error::GpuFailed(format!("the worker of GPU {} is restarting after a fault; its last start failed: {e}", s.gpu))
            }
            None => Error::GpuFailed(format!("the worker of GPU {} is restarting after a fault", s.gpu)),
        }
    }

    /// Writes one frame to the running worker, registering its waiter first, under the lock the
    /// supervisor takes before it answers every waiter: no waiter is left behind, and none is
    /// answered twice (a failed write takes its own waiter back with `undo` and answers the
    /// caller directly).
    fn send(
        &self,
        head: &[u8],
        blobs: &[&[u8]],
        register: impl FnOnce(&mut Waiters) -> Result<(), Error>,
        undo: impl FnOnce(&mut Waiters),
    ) -> Result<(), Error> {
        let mut conn = lock(&self.shared.conn);
        let Some(w) = conn.as_mut() else { return Err(self.refusal()) };
        register(&mut lock(&self.shared.waiters))?;
        if let Err(e) = write_parts(w, head, blobs) {
            // The worker is gone; its supervisor restarts it.
            *conn = None;
            undo(&mut lock(&self.shared.waiters));
            return Err(Error::GpuFailed(format!("the worker of GPU {} cannot be reached: {e}", self.shared.gpu)));
        }
        Ok(())
    }

    pub fn load_model(&self, spec: ModelSpec) -> Result<ModelInfo, Error> {
        let mut plan = (*spec.plan).clone();
        plan.weights = Arc::default();
        let msg = ToWorker::Load { name: spec.name.clone(), plan, profile: spec.profile.clone() };
        let head = frame_head(&msg, 1).map_err(|e| Error::InvalidModel(e.to_string()))?;
        let (tx, rx) = mpsc::sync_channel(1);
        let name = spec.name.clone();
        let s = &self.shared;
        let mut generation = 0;
        self.send(
            &head,
            &[spec.plan.weights.as_slice()],
            |w| {
                // Under the connection's lock: the generation of the worker that gets the load.
                generation = s.generation.load(Ordering::Acquire);
                w.loads.entry(name.clone()).or_default().push_back(tx);
                Ok(())
            },
            |w| drop(w.loads.get_mut(&name).and_then(|q| q.pop_back())),
        )?;
        let limit_ms = s.spawn.load_timeout_ms.max(1);
        let info = match rx.recv_timeout(Duration::from_millis(limit_ms)) {
            Ok(r) => r?,
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Error::ShuttingDown),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let why = format!(
                    "the load of model '{name}' on GPU {} did not finish within the model load time limit of {} s; its worker was killed and is restarted",
                    s.gpu,
                    limit_ms.div_ceil(1000)
                );
                warn!(gpu = s.gpu, model = %name, "{why}");
                self.kill_worker(generation, &why);
                return Err(Error::GpuFailed(why));
            }
        };
        lock(&self.shared.models).insert(spec.name.clone(), spec);
        Ok(info)
    }

    pub fn unload_model(&self, name: &str) -> Result<(), Error> {
        let head = frame_head(&ToWorker::Unload { name: name.to_string() }, 0).map_err(|e| Error::Gpu(e.to_string()))?;
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(
            &head,
            &[],
            |w| {
                w.unloads.entry(name.to_string()).or_default().push_back(tx);
                Ok(())
            },
            |w| drop(w.unloads.get_mut(name).and_then(|q| q.pop_back())),
        )?;
        // Whatever the worker says, the model is not to come back after a restart.
        lock(&self.shared.models).remove(name);
        rx.recv().map_err(|_| Error::ShuttingDown)?
    }

    /// Submits a request; `on_done` runs on the supervisor thread with its result, `before_done`
    /// (if any) when the worker's engine issues the request's last kernel.
    pub fn submit(
        &self,
        model: &str,
        inputs: Vec<Tensor>,
        mut options: RequestOptions,
        before_done: Option<Box<dyn FnOnce() + Send>>,
        on_done: Box<dyn FnOnce(Result<Response, Error>) + Send>,
    ) -> Result<RequestId, Error> {
        let tag = self.shared.next_tag.fetch_add(1, Ordering::Relaxed);
        options.notify_before_done |= before_done.is_some();
        let blobs: Vec<&[u8]> = inputs.iter().map(tensor_bytes).collect();
        let msg = ToWorker::Submit {
            tag,
            model: model.to_string(),
            notify: before_done.is_some(),
            options,
            inputs: wire_heads(&inputs),
        };
        let head = frame_head(&msg, blobs.len()).map_err(|e| Error::InvalidInput(e.to_string()))?;
        let max = self.shared.requests_max;
        self.send(
            &head,
            &blobs,
            |w| {
                if w.requests.len() >= max {
                    return Err(Error::Overloaded { what: "submission queue", max: max as u64 });
                }
                w.requests.insert(tag, (on_done, before_done));
                Ok(())
            },
            |w| drop(w.requests.remove(&tag)),
        )?;
        Ok(RequestId(tag))
    }

    /// Cancels a request (the worker's engine stops its GPU work); it completes with
    /// [`Error::Cancelled`]. Unknown or finished requests: nothing happens.
    pub fn cancel(&self, id: RequestId) -> Result<(), Error> {
        let head = frame_head(&ToWorker::Cancel { tag: id.0 }, 0).map_err(|e| Error::Gpu(e.to_string()))?;
        self.send(&head, &[], |_| Ok(()), |_| {})
    }

    /// The worker's counters (those of its predecessors added), with the restarts as recoveries.
    pub fn stats(&self) -> EngineStats {
        let s = &self.shared;
        let now = *lock(&s.stats);
        let before = *lock(&s.earlier);
        let mut st = add_stats(&before, &now);
        st.failed += s.failed_here.load(Ordering::Relaxed);
        st.gpu_recoveries += s.restarts.load(Ordering::Relaxed);
        st.recovering |= s.restarting.load(Ordering::Relaxed);
        st.jobs = now.jobs;
        st.launches_in_flight = now.launches_in_flight;
        st.resident_weight_bytes = now.resident_weight_bytes;
        st
    }

    /// Why this GPU stopped serving for good, if it did (no worker could be started).
    pub fn stopped(&self) -> Option<String> {
        lock(&self.shared.stopped).clone()
    }

    /// The latest restarts, oldest first.
    pub fn recoveries(&self) -> Vec<RecoveryReport> {
        lock(&self.shared.reports).iter().cloned().collect()
    }

    /// Kills the running worker if it is still the one of `generation` (a worker started since
    /// is left alone); its supervisor reaps it, answers what it held (telling `why`) and restarts
    /// it.
    fn kill_worker(&self, generation: u64, why: &str) {
        let s = &self.shared;
        let mut child = lock(&s.child);
        if s.generation.load(Ordering::Acquire) != generation {
            return;
        }
        if let Some(c) = child.as_mut() {
            *lock(&s.kill_cause) = Some(why.to_string());
            let _ = c.kill();
        }
    }

    /// The running worker's process id (tests kill it to see the server recover).
    pub fn worker_pid(&self) -> Option<u32> {
        lock(&self.shared.child).as_ref().map(|c| c.id())
    }

    fn stop(&mut self) {
        let Some(sup) = self.supervisor.take() else { return };
        let s = &self.shared;
        s.stopping.store(true, Ordering::Release);
        if let Some(mut w) = lock(&s.conn).take() {
            // Asked to stop, the worker answers what it holds and exits; closing its stdin
            // would do as well.
            let _ = write_frame(&mut w, &ToWorker::Shutdown, &[]);
        }
        let deadline = Instant::now() + WORKER_EXIT_WAIT;
        loop {
            let exited = match lock(&s.child).as_mut() {
                Some(c) => !matches!(c.try_wait(), Ok(None)),
                None => true,
            };
            if exited || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(c) = lock(&s.child).as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = sup.join();
        lock(&s.waiters).abandon(&Error::ShuttingDown);
    }

    pub fn shutdown(mut self) {
        self.stop();
    }
}

impl Drop for WorkerEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Counters summed (for the counters of a restarted worker's predecessors).
fn add_stats(a: &EngineStats, b: &EngineStats) -> EngineStats {
    EngineStats {
        submitted: a.submitted + b.submitted,
        completed: a.completed + b.completed,
        failed: a.failed + b.failed,
        cancelled: a.cancelled + b.cancelled,
        rejected: a.rejected + b.rejected,
        jobs: b.jobs,
        launches_in_flight: b.launches_in_flight,
        launches: a.launches + b.launches,
        preemptions: a.preemptions + b.preemptions,
        events: a.events + b.events,
        launches_lost: a.launches_lost + b.launches_lost,
        busy_ns: a.busy_ns + b.busy_ns,
        launch_call_ns: a.launch_call_ns + b.launch_call_ns,
        policy_ns: a.policy_ns + b.policy_ns,
        events_ns: a.events_ns + b.events_ns,
        runs_launched: a.runs_launched + b.runs_launched,
        runs_recorded: a.runs_recorded + b.runs_recorded,
        run_record_ns: a.run_record_ns + b.run_record_ns,
        segments_launched: a.segments_launched + b.segments_launched,
        masked_launches: a.masked_launches + b.masked_launches,
        partition_launches: a.partition_launches + b.partition_launches,
        partition_fallbacks: a.partition_fallbacks + b.partition_fallbacks,
        gpu_recoveries: a.gpu_recoveries + b.gpu_recoveries,
        recovering: b.recovering,
        cold_starts: a.cold_starts + b.cold_starts,
        loads_completed: a.loads_completed + b.loads_completed,
        load_ns: a.load_ns + b.load_ns,
        loaded_bytes: a.loaded_bytes + b.loaded_bytes,
        evictions: a.evictions + b.evictions,
        secondary_busy_loads: a.secondary_busy_loads + b.secondary_busy_loads,
        resident_weight_bytes: b.resident_weight_bytes,
    }
}

/// Applies one frame from the worker; `Err(cause)` when the worker announced its end.
/// Applies one frame from the worker, reading its blobs from `r`; `Ok(Err(cause))` when the
/// worker announced its end.
fn apply<R: Read>(s: &Shared, r: &mut R, msg: FromWorker, blobs: u32) -> std::io::Result<Result<(), String>> {
    if !matches!(msg, FromWorker::Done { .. }) {
        skip_blobs(r, blobs)?;
    }
    match msg {
        FromWorker::Done { tag, result } => {
            let result = match result {
                Ok((timing, heads)) => Ok(Response { id: RequestId(tag), outputs: read_tensors(r, heads, blobs)?, timing }),
                Err(e) => {
                    skip_blobs(r, blobs)?;
                    Err(e.into())
                }
            };
            let waiter = lock(&s.waiters).requests.remove(&tag);
            if let Some((done, _)) = waiter {
                done(result);
            }
        }
        FromWorker::AlmostDone { tag } => {
            let notifier = lock(&s.waiters).requests.get_mut(&tag).and_then(|(_, n)| n.take());
            if let Some(n) = notifier {
                n();
            }
        }
        FromWorker::Loaded { name, result } => {
            let tx = lock(&s.waiters).loads.get_mut(&name).and_then(|q| q.pop_front());
            if let Some(tx) = tx {
                let _ = tx.send(result.map_err(Error::from));
            }
        }
        FromWorker::Unloaded { name, result } => {
            let tx = lock(&s.waiters).unloads.get_mut(&name).and_then(|q| q.pop_front());
            if let Some(tx) = tx {
                let _ = tx.send(result.map_err(Error::from));
            }
        }
        FromWorker::Stats(st) => *lock(&s.stats) = st,
        FromWorker::Stopped { reason } => return Ok(Err(reason)),
        FromWorker::Ready { .. } => {}
    }
    Ok(Ok(()))
}

/// Reads the running worker's frames until it ends; returns why it ended.
fn serve_until_end(s: &Shared, stdout: &mut BufReader<ChildStdout>) -> String {
    loop {
        match read_head::<_, FromWorker>(stdout) {
            Ok(Some((msg, blobs))) => match apply(s, stdout, msg, blobs) {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => return format!("its engine stopped: {reason}"),
                Err(e) => return format!("reading from the worker failed: {e}"),
            },
            Ok(None) => return "the worker process ended".into(),
            Err(e) => return format!("reading from the worker failed: {e}"),
        }
    }
}

/// The supervisor of one GPU's worker (see the module docs).
fn supervise(s: &Shared, mut stdout: BufReader<ChildStdout>) {
    let mut generation = 0u64;
    loop {
        let mut cause = serve_until_end(s, &mut stdout);
        let began = Instant::now();
        if s.stopping.load(Ordering::Acquire) {
            return;
        }
        // Refuse new work, make sure the old worker is gone, answer what it held.
        s.restarting.store(true, Ordering::Release);
        let conn = lock(&s.conn).take();
        drop(conn);
        if let Some(mut c) = lock(&s.child).take() {
            let _ = c.kill();
            if let Some(why) = lock(&s.kill_cause).take() {
                cause = why;
            }
            if let Ok(status) = c.wait() {
                cause = format!("{cause} ({status})");
            }
        }
        let err = Error::GpuFailed(format!("the worker of GPU {} ended: {cause}", s.gpu));
        let failed = lock(&s.waiters).abandon(&err);
        s.failed_here.fetch_add(failed, Ordering::Relaxed);
        {
            let last = std::mem::take(&mut *lock(&s.stats));
            let mut earlier = lock(&s.earlier);
            *earlier = add_stats(&earlier, &last);
        }
        warn!(gpu = s.gpu, cause = %cause, requests_failed = failed, "GPU worker ended; starting a new one");
        eprintln!("kairos: the worker of GPU {} ended ({cause}): {failed} requests failed; restarting it", s.gpu);
        // A new worker, with every model the old one had.
        let mut attempt = 0;
        loop {
            attempt += 1;
            generation += 1;
            let started = spawn_worker(&s.spawn, s.gpu, generation, &s.stopping).and_then(|st| reload(s, st));
            match started {
                Ok((mut st, report_models)) => {
                    st.watch.disarm();
                    *lock(&s.last_start_error) = None;
                    let (reloaded, lost) = report_models;
                    for (name, _) in &lost {
                        lock(&s.models).remove(name);
                    }
                    stdout = st.stdout;
                    // The generation first: a timed-out load of the old worker must not kill this one.
                    s.generation.store(generation, Ordering::Release);
                    *lock(&s.child) = Some(st.child);
                    if s.stopping.load(Ordering::Acquire) {
                        // Stopped meanwhile: the new worker is the stopper's to end.
                        *lock(&s.conn) = Some(st.stdin);
                        return;
                    }
                    *lock(&s.conn) = Some(st.stdin);
                    let took = began.elapsed();
                    s.restarts.fetch_add(1, Ordering::Relaxed);
                    s.restarting.store(false, Ordering::Release);
                    info!(gpu = s.gpu, models = reloaded, ms = took.as_secs_f64() * 1e3, "GPU worker restarted");
                    eprintln!(
                        "kairos: GPU {} serves again {:.0} ms after its worker ended: {reloaded} models loaded again{}",
                        s.gpu,
                        took.as_secs_f64() * 1e3,
                        if lost.is_empty() {
                            String::new()
                        } else {
                            format!(", lost: {}", lost.iter().map(|(m, e)| format!("{m} ({e})")).collect::<Vec<_>>().join(", "))
                        }
                    );
                    let mut reports = lock(&s.reports);
                    if reports.len() >= REPORTS_MAX {
                        reports.pop_front();
                    }
                    reports.push_back(RecoveryReport {
                        cause: cause.clone(),
                        requests_failed: failed,
                        models_reloaded: reloaded,
                        models_lost: lost,
                        mappings_restored: 0,
                        mappings_lost: 0,
                        took_ns: took.as_nanos() as u64,
                    });
                    break;
                }
                Err(e) => {
                    warn!(gpu = s.gpu, attempt, error = %e, "cannot start a GPU worker");
                    eprintln!("kairos: GPU {}: worker start {attempt} failed: {e}", s.gpu);
                    *lock(&s.last_start_error) = Some(e.clone());
                    if attempt >= WORKER_START_ATTEMPTS_MAX || s.stopping.load(Ordering::Acquire) {
                        eprintln!("kairos: GPU {} is given up after {attempt} worker starts failed: {e}", s.gpu);
                        *lock(&s.stopped) = Some(format!("{attempt} worker starts failed after '{cause}': {e}"));
                        s.restarting.store(false, Ordering::Release);
                        lock(&s.waiters).abandon(&Error::GpuFailed(e));
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(WORKER_RETRY_MS));
                }
            }
        }
    }
}

type Reloaded = (u32, Vec<(String, Error)>);

/// Loads every model the server keeps into a freshly started worker, before it takes requests;
/// a worker that fails to is killed and reaped.
fn reload(s: &Shared, mut st: Started) -> Result<(Started, Reloaded), String> {
    match reload_into(s, &mut st) {
        Ok(r) => Ok((st, r)),
        Err(why) => Err(st.fail(why)),
    }
}

fn reload_into(s: &Shared, st: &mut Started) -> Result<Reloaded, String> {
    let models: Vec<ModelSpec> = lock(&s.models).values().cloned().collect();
    // Ready: the loads are bounded as loads are, once per model (their weights cross one pipe).
    st.watch.disarm();
    let limit_ms = s.spawn.load_timeout_ms.max(1).saturating_mul(models.len().max(1) as u64);
    st.watch = StartWatch::arm(st.child.id(), limit_ms, "load its models again", s.stopping.clone())
        .map_err(|e| format!("cannot watch the new worker's loads: {e}"))?;
    let io = |e: std::io::Error| format!("loading the models into the new worker: {e}");
    for spec in &models {
        let mut plan = (*spec.plan).clone();
        plan.weights = Arc::default();
        let msg = ToWorker::Load { name: spec.name.clone(), plan, profile: spec.profile.clone() };
        write_frame(&mut st.stdin, &msg, &[spec.plan.weights.as_slice()]).map_err(io)?;
    }
    let (mut reloaded, mut lost) = (0u32, Vec::new());
    let mut left = models.len();
    while left > 0 {
        let frame = read_head::<_, FromWorker>(&mut st.stdout).map_err(io)?;
        if let Some((_, blobs)) = &frame {
            skip_blobs(&mut st.stdout, *blobs).map_err(io)?;
        }
        match frame {
            Some((FromWorker::Loaded { name, result }, _)) => {
                left -= 1;
                match result {
                    Ok(_) => reloaded += 1,
                    Err(e) => lost.push((name, Error::from(e))),
                }
            }
            Some((FromWorker::Stats(x), _)) => *lock(&s.stats) = x,
            Some((FromWorker::Stopped { reason }, _)) => return Err(format!("the new worker's engine stopped: {reason}")),
            Some(_) => {}
            None => return Err("the new worker ended while loading the models".into()),
        }
    }
    Ok((reloaded, lost))
}

// ---------------------------------------------------------------------------------------------
// The backend.

/// A backend whose engines run in worker processes: `inner` describes the GPUs and plans for them
/// in the server; each worker builds its own `inner` from the same command line.
pub struct WorkerBackend {
    pub inner: Box<dyn Backend>,
    pub spawn: WorkerSpawn,
    /// Requests a worker holds at once (its engine's submission queue and job limit).
    pub requests_max: usize,
}

impl Backend for WorkerBackend {
    fn describe(&self) -> String {
        format!("{} in GPU worker processes", self.inner.describe())
    }

    fn start(&self, gpu: u32, _models: &[&PlannedModel]) -> Result<(EngineHandle, String), ServeError> {
        let w = WorkerEngine::start(gpu, self.spawn.clone(), self.requests_max)?;
        info!(gpu, pid = w.worker_pid().unwrap_or(0), "GPU worker started");
        let name = w.device().name.clone();
        Ok((EngineHandle::Worker(w), name))
    }

    fn profiles(&self) -> Option<&ProfileSet> {
        self.inner.profiles()
    }

    /// The worker prepares (autotunes) a plan when it loads it: the server's process never
    /// touches a GPU.
    fn prepare(&self, _plan: &mut Plan) -> Result<Option<String>, ServeError> {
        Ok(None)
    }

    /// The worker registers start-up profiles itself when it loads a model.
    fn register_start_model(&self, _gpu: u32, _model: &PlannedModel) -> Result<(), ServeError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_limits_hold() {
        let t = vec![
            Tensor::f32(vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            Tensor::i64(vec![2], vec![-1, 1 << 40]),
            Tensor::f16(vec![1, 1], vec![half::f16::from_f32(0.5)]),
        ];
        let blobs: Vec<&[u8]> = t.iter().map(tensor_bytes).collect();
        let msg = ToWorker::Submit {
            tag: 7,
            model: "m".into(),
            options: RequestOptions::default(),
            notify: true,
            inputs: wire_heads(&t),
        };
        let mut bytes = Vec::new();
        write_frame(&mut bytes, &msg, &blobs).unwrap();
        write_frame(&mut bytes, &ToWorker::Cancel { tag: 7 }, &[b"dropped".as_slice()]).unwrap();
        let mut r = std::io::Cursor::new(bytes.clone());
        let (back, count): (ToWorker, _) = read_head(&mut r).unwrap().unwrap();
        let ToWorker::Submit { tag, model, notify, inputs, .. } = back else { panic!("not a submit") };
        assert_eq!((tag, model.as_str(), notify), (7, "m", true));
        assert_eq!(read_tensors(&mut r, inputs, count).unwrap(), t);
        let (back, count): (ToWorker, _) = read_head(&mut r).unwrap().unwrap();
        assert!(matches!(back, ToWorker::Cancel { tag: 7 }) && count == 1);
        skip_blobs(&mut r, count).unwrap();
        // A clean end between frames, an error inside one.
        assert!(read_head::<_, ToWorker>(&mut r).unwrap().is_none());
        let mut cut = std::io::Cursor::new(bytes[..bytes.len() - 3].to_vec());
        let (_, count): (ToWorker, _) = read_head(&mut cut).unwrap().unwrap();
        let ToWorker::Submit { inputs, .. } =
            serde_json::from_slice(&bytes[8..8 + u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize]).unwrap()
        else {
            panic!()
        };
        read_tensors(&mut cut, inputs, count).unwrap();
        assert!(read_head::<_, ToWorker>(&mut cut).is_ok_and(|h| h.is_some()), "the second frame's head is whole");
        assert!(skip_blobs(&mut cut, 1).is_err(), "its blob is cut");
        // A length beyond the limits is refused before anything is allocated.
        let mut huge = Vec::new();
        huge.extend_from_slice(&(FRAME_HEADER_BYTES_MAX + 1).to_le_bytes());
        huge.extend_from_slice(&0u32.to_le_bytes());
        assert!(read_head::<_, ToWorker>(&mut std::io::Cursor::new(huge)).is_err());
    }

    #[test]
    fn errors_cross_the_wire_unchanged() {
        let all = [
            Error::UnknownModel("a".into()),
            Error::ModelExists("b".into()),
            Error::ModelUnloading("c".into()),
            Error::InvalidModel("d".into()),
            Error::InvalidInput("e".into()),
            Error::Overloaded { what: "dispatcher jobs", max: 9 },
            Error::Cancelled,
            Error::Gpu("f".into()),
            Error::ShuttingDown,
            Error::GpuFailed("g".into()),
        ];
        for e in all {
            let w = serde_json::to_vec(&WireError::from(&e)).unwrap();
            let back: WireError = serde_json::from_slice(&w).unwrap();
            assert_eq!(Error::from(back), e);
        }
    }
}

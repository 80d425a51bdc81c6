//! The data the dispatcher takes in and hands out: requests and their options, commands,
//! completions, and the one error enum of this layer.

use kairos_core::Tensor;
use kairos_core::plan::Plan;
use kairos_gpu::profile::ModelProfile;
use kairos_gpu::{HostMapping, HostMappingId, HostMemory};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A request's identity, unique for the lifetime of one engine or driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// Who a request is for: the unit the fairness counters are kept per.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TenantId(pub u32);

/// REEF's two classes: real-time work is latency-critical, best-effort work fills the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Class {
    RealTime,
    #[default]
    BestEffort,
}

/// How a request wants to be served. Every field has a default, so later features add fields
/// without breaking callers that write `RequestOptions { tenant, ..Default::default() }`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestOptions {
    pub class: Class,
    /// Higher is more urgent; policies that read it compare it within a class.
    pub priority: i32,
    /// Latency target, counted from the request's arrival. Policies may read it; the response
    /// says whether it was missed.
    pub deadline_ns: Option<u64>,
    pub tenant: TenantId,
    /// Benchmarks only: do not copy inputs in or outputs out (the response carries no outputs and
    /// the kernels run on whatever the request's buffers held). Timing is unchanged otherwise.
    pub skip_io: bool,
    /// Ask for [`Output::AlmostDone`] shortly before the request completes (Paella's early
    /// wake-up: a client sleeping on an event can be woken while the last kernels run and poll for
    /// the result, instead of paying the wake-up after it). It fires once the request's estimated
    /// remaining GPU time is at most `Config::wake_lead_ns`, or only its last launch is left.
    pub notify_before_done: bool,
}

impl RequestOptions {
    pub fn with_class(mut self, class: Class) -> Self {
        self.class = class;
        self
    }
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
    pub fn with_deadline_ns(mut self, deadline_ns: u64) -> Self {
        self.deadline_ns = Some(deadline_ns);
        self
    }
    pub fn with_tenant(mut self, tenant: TenantId) -> Self {
        self.tenant = tenant;
        self
    }
    pub fn with_skip_io(mut self, skip_io: bool) -> Self {
        self.skip_io = skip_io;
        self
    }
}

/// One inference request as the dispatcher sees it.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: RequestId,
    pub model: String,
    /// One tensor per model input (cast to the plan's dtype; the shape must match). Ignored with
    /// `options.skip_io`.
    pub inputs: Vec<Tensor>,
    pub options: RequestOptions,
    /// When the request arrived, on the GPU's clock; `None` means when the dispatcher takes it.
    /// Open-loop drivers set it to the scheduled arrival, so a late driver does not hide queueing.
    pub arrival_ns: Option<u64>,
}

/// A byte range of a host mapping (offsets from the mapping's first byte).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappedSpan {
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

impl MappedSpan {
    /// Whether the two spans share a byte (empty spans share none).
    pub fn overlaps(&self, other: &MappedSpan) -> bool {
        self.len_bytes > 0
            && other.len_bytes > 0
            && self.offset_bytes < other.offset_bytes.saturating_add(other.len_bytes)
            && other.offset_bytes < self.offset_bytes.saturating_add(self.len_bytes)
    }
}

/// Zero-copy I/O: a request's inputs and/or outputs live in caller memory the engine mapped into
/// its GPU ([`Command::MapHost`]), and its kernels read and write them there. Bound inputs are
/// not copied in, bound outputs are not copied out (the response carries none: the caller reads
/// its memory once the request completed). Each span must have exactly its tensor's size
/// (`IoTensor::len_bytes`), lie inside the mapping, start at the mapping's `align_bytes`, and no
/// output may overlap another output or a bound input; otherwise the request fails with
/// [`Error::InvalidInput`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoBinding {
    pub mapping: HostMappingId,
    /// One span per plan input, in plan order, or none: the inputs come as tensors.
    pub inputs: Vec<MappedSpan>,
    /// One span per plan output, in plan order, or none: the outputs come back as tensors.
    pub outputs: Vec<MappedSpan>,
}

/// A model to load: its plan (with the weight blob) and, when measured, its profile.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub name: String,
    pub plan: Arc<Plan>,
    pub profile: Option<ModelProfile>,
}

/// Where a model's kernel time estimates started from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EstimateSource {
    /// Per-launch durations of a `kairos profile` JSON.
    Profile,
    /// FLOPs and bytes over the device's rates.
    Roofline,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub launches: u32,
    pub weight_bytes: u64,
    pub arena_bytes: u64,
    /// Sum of the kernels' estimated durations: one request's GPU time on an idle GPU.
    pub estimated_ns: u64,
    pub estimate_source: EstimateSource,
}

/// When things happened to a request, on the GPU's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timing {
    pub arrival_ns: u64,
    /// When it got its buffers and became schedulable.
    pub admitted_ns: u64,
    /// When its first kernel was issued (`admitted_ns` if it had none).
    pub first_issue_ns: u64,
    /// When the dispatcher's decision round that issued its first kernel began (`admitted_ns` if
    /// it had none): `first_issue_ns` minus this is what that round did before (preemptions,
    /// other jobs' launches); this minus `arrival_ns`, the rounds that did not issue it and the
    /// GPU events handled before the round.
    #[serde(default)]
    pub first_round_ns: u64,
    pub done_ns: u64,
    pub launches: u32,
    /// Launches issued behind another launch of the request on its stream (they started when
    /// that one ended, without waiting for the host to hear of it), resumed ones included.
    pub chained: u32,
    pub deadline_missed: bool,
    /// When its first launch took its first block (0: no launch reported its start).
    pub first_start_ns: u64,
    /// When its last launch ended on the device (0: unknown).
    pub last_done_ns: u64,
    /// GPU time of its launches, first block taken to end, summed (launches that report their start).
    pub gpu_ns: u64,
    /// The dispatcher's estimate of its GPU time when it was admitted.
    pub estimated_ns: u64,
    /// Its model was not in device memory when it arrived (a cold start under a weight budget).
    pub cold_start: bool,
}

impl Timing {
    pub fn latency_ns(&self) -> u64 {
        self.done_ns.saturating_sub(self.arrival_ns)
    }
    pub fn queue_ns(&self) -> u64 {
        self.first_issue_ns.saturating_sub(self.arrival_ns)
    }
}

#[derive(Clone, Debug)]
pub struct Response {
    pub id: RequestId,
    /// The model's outputs, in plan order (empty with `skip_io` or outputs bound to a mapping).
    pub outputs: Vec<Tensor>,
    pub timing: Timing,
}

/// The commands the dispatcher takes, in one closed enum.
#[derive(Clone, Debug)]
pub enum Command {
    Submit(Request),
    /// A request whose inputs and/or outputs live in a host mapping (see [`IoBinding`]); its
    /// `inputs` are empty when the binding names inputs.
    SubmitBound(Request, IoBinding),
    /// Maps caller memory into the GPU (`Gpu::map_host`); [`Output::HostMapped`] answers.
    MapHost(std::sync::Arc<dyn HostMemory>),
    /// New requests naming the mapping are refused at once; it is unmapped when the last request
    /// using it completes (nothing of it on the GPU any more), and [`Output::HostUnmapped`] says so.
    UnmapHost(HostMappingId),
    /// Stops a request: its unissued kernels never run, its running ones are preempted at a
    /// logical-block boundary, and it completes with [`Error::Cancelled`] once nothing of it is on
    /// the GPU. Cancelling a finished or unknown request does nothing.
    Cancel(RequestId),
    LoadModel(ModelSpec),
    /// New requests for the model are refused at once; the model's memory is freed when its last
    /// request completes, and [`Output::ModelUnloaded`] says so.
    UnloadModel(String),
    /// Refuses new work, cancels everything queued or running, frees all GPU memory, then emits
    /// [`Output::ShutDown`].
    Shutdown,
}

/// What the dispatcher hands out.
#[derive(Clone, Debug)]
pub enum Output {
    Done {
        id: RequestId,
        result: Result<Response, Error>,
    },
    /// The request's last launch was issued (requests with `notify_before_done` only; at most once
    /// per request, always before its `Done`). Policies that issue a whole job at once (`streams`,
    /// `fifo`) issue its last launch with the first, so the notice comes early there.
    AlmostDone {
        id: RequestId,
    },
    ModelLoaded {
        name: String,
        result: Result<ModelInfo, Error>,
    },
    ModelUnloaded {
        name: String,
        result: Result<(), Error>,
    },
    /// The answer to [`Command::MapHost`] (in command order).
    HostMapped {
        result: Result<HostMapping, Error>,
    },
    HostUnmapped {
        id: HostMappingId,
        result: Result<(), Error>,
    },
    ShutDown,
    /// The GPU failed and was reset ([`crate::Dispatcher::recover`]): what was lost and what
    /// came back.
    Recovered(RecoveryReport),
}

/// What a recovery ([`crate::Dispatcher::recover`]) did.
#[derive(Clone, Debug, PartialEq)]
pub struct RecoveryReport {
    /// Why the GPU was reset.
    pub cause: String,
    /// Requests answered with [`Error::GpuFailed`] (or with their cancellation, if cancelled).
    pub requests_failed: u64,
    /// Models uploaded again, and those that could not be (they answer [`Error::GpuFailed`]
    /// until unloaded).
    pub models_reloaded: u32,
    pub models_lost: Vec<(String, Error)>,
    /// Host mappings mapped again, and those that could not be (requests bound to them fail).
    pub mappings_restored: u32,
    pub mappings_lost: u32,
    /// From the start of the reset to serving again, on the GPU's clock.
    pub took_ns: u64,
}

/// Errors of the scheduling layer. The server maps them to protocol status codes:
/// `Overloaded` to 429 / RESOURCE_EXHAUSTED, `UnknownModel` to 404 / NOT_FOUND,
/// `InvalidInput` to 400 / INVALID_ARGUMENT, `Cancelled` to 499 / CANCELLED,
/// `ShuttingDown` and `ModelUnloading` to 503 / UNAVAILABLE, the rest to 500 / INTERNAL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("unknown model '{0}'")]
    UnknownModel(String),
    #[error("model '{0}' is already loaded")]
    ModelExists(String),
    #[error("model '{0}' is being unloaded")]
    ModelUnloading(String),
    #[error("invalid model: {0}")]
    InvalidModel(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("overloaded: {what} is full (limit {max})")]
    Overloaded { what: &'static str, max: u64 },
    #[error("request cancelled")]
    Cancelled,
    #[error("GPU error: {0}")]
    Gpu(String),
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The GPU failed (a sticky fault, a launch past its watchdog bound, events it could not
    /// report): the request was not completed, and the device was reset (see
    /// [`crate::Dispatcher::recover`]). Retrying is safe.
    #[error("the GPU failed: {0}")]
    GpuFailed(String),
}

impl From<kairos_gpu::GpuError> for Error {
    fn from(e: kairos_gpu::GpuError) -> Self {
        Error::Gpu(e.to_string())
    }
}

//! kairos-sched: the dispatcher, kernel-by-kernel scheduling of many requests on one GPU.
//!
//! One thread owns all scheduling state. Requests come in as [`Command`]s through a bounded
//! queue; each request becomes a job with its own waitlist of kernels (a virtual stream: a kernel
//! is ready when the kernels it depends on in the plan are done); a [`Policy`](policy::Policy),
//! a pure function of a [`View`](policy::View), picks which ready kernel goes to the GPU next, and
//! occupancy-gated policies issue a kernel only when its CTAs can be placed soon (the SMs' free
//! room, as mirrored from the GPU's placement and completion events, plus a headroom of B CTAs).
//! Completions come out as [`Output`]s.
//!
//! - [`dispatcher`]: the core state machine, generic over [`kairos_gpu::Gpu`] and its clock.
//! - [`engine`]: the core on its own thread behind `Engine::submit(model, inputs, options)`, for
//!   the server and real-time benchmarks; `Engine::map_host` + `Engine::submit_bound` for
//!   zero-copy requests whose tensors live in caller memory mapped into the GPU. The GPU is built
//!   on that thread (CUDA contexts are thread-affine).
//! - [`driver`]: the same core driven synchronously in the GPU's time (virtual on the simulator):
//!   arrivals at chosen times, deterministic, for tests and benchmarks.
//! - [`policy`]: `fifo`, `streams`, `streams-kernel`, `paella`, `sjf`, `rr`.
//! - [`estimate`]: per-kernel duration estimates (profile or roofline, refined online).
//! - [`occupancy`]: per-SM resource accounting.
//! - [`cold`]: cold-start plans after DeepPlan: which weight layers to load, which to read from host.
//!
//! Paella's experiments over this dispatcher live in `kairos_bench::paella`; the synthetic plans
//! they and the tests here use, in `kairos_gpu::synthetic`.
//!
//! Architecture invariants: no CUDA, HTTP, tokio or unsafe code here; the core never reads a
//! wall clock (time is the GPU's `now_ns`); policies never mutate anything; every queue and pool
//! has a `*_max` limit below.

#![forbid(unsafe_code)]

pub mod cold;
pub mod dispatcher;
pub mod driver;
pub mod engine;
pub mod estimate;
pub mod occupancy;
pub mod policy;
pub mod request;

pub use dispatcher::{Config, Dispatcher, DispatcherStats, Eviction, IssueRecord, ResidencyState};
pub use driver::{RequestRecord, VirtualDriver};
pub use engine::{Engine, EngineConfig, EngineStats, RequestHandle};
pub use policy::{Decision, Policy, PolicyConfig};
pub use request::{
    Class, Command, Error, EstimateSource, IoBinding, MappedSpan, ModelInfo, ModelSpec, Output, RecoveryReport, Request,
    RequestId, RequestOptions, Response, TenantId, Timing,
};

/// Hard caps on the configurable limits.
pub const JOBS_MAX: usize = 65_536;
pub const SLOTS_PER_MODEL_MAX: usize = 4096;
/// Default `Config::slots_per_model_prealloc`: I/O slots allocated with the model.
pub const SLOTS_PER_MODEL_PREALLOC_DEFAULT: usize = 16;
/// Default `Config::slots_per_model_max`: as many as are made (and their runs recorded) at load. A
/// slot made on demand costs allocations and recordings on the dispatcher's thread, and its jobs
/// go launch by launch until the recording budget allows; with 64 on an H100 (8 vision models at
/// 3244 requests/s, call 25 in docs/benchmarks.md) `paella+bound=2` collapsed to 1820 served/s (p99
/// 942 ms) and `streams:8` to 2771 (246 ms); with 16 they served 3141 and 3197 (p99 85 and 82 ms).
/// Requests beyond it wait for a slot in arrival order.
pub const SLOTS_PER_MODEL_MAX_DEFAULT: usize = 16;
pub const MODELS_MAX: usize = 1024;
pub const TENANTS_MAX: usize = 65_536;
pub const STREAMS_MAX: usize = 128;
/// The stream pool's default size is the device's hardware queues, at least this many.
pub const STREAM_COUNT_DEFAULT_MIN: u32 = 32;

/// High-priority streams kept for real-time jobs' lanes by default (`Config::realtime_stream_count`),
/// and the most a configuration may ask for.
pub const REALTIME_STREAM_COUNT_DEFAULT: u32 = 4;
pub const REALTIME_STREAMS_MAX: u32 = 32;

/// The stream priority real-time lanes get (higher is more urgent; CUDA: -1).
pub const REALTIME_STREAM_PRIORITY: i32 = 1;
pub const LAUNCHES_IN_FLIGHT_MAX: usize = 65_536;
pub const LAUNCHES_PER_PLAN_MAX: usize = 1 << 20;
pub const DECISIONS_PER_ROUND_MAX: usize = 65_536;
/// Default `Config::watchdog_ns_min`: a launch at the head of its stream for longer than this
/// (or a thousand times its estimate, if more) is taken for a hung kernel and the GPU is reset.
pub const WATCHDOG_NS_MIN_DEFAULT: u64 = 2_000_000_000;
pub const SUBMIT_QUEUE_MAX: usize = 1 << 20;
pub const TRACE_MAX: usize = 1 << 24;
/// Issue-ahead per job (`Config::lookahead_ns`, `Config::lookahead_launches_max`): the caps, and
/// the defaults. The default keeps about 50 us of a job's work waiting on its lane behind the
/// running kernel, more than the ~15-20 us it takes the dispatcher to hear that a kernel started
/// and put another behind it (record latency, the launch call, the launch's own latency), so a
/// job's kernels run back to back; a longer lookahead commits more of a job's kernels to the GPU
/// ahead of other jobs' (SRPT can no longer reorder them).
pub const LOOKAHEAD_NS_MAX: u64 = 10_000_000;
pub const LOOKAHEAD_NS_DEFAULT: u64 = 50_000;
pub const LOOKAHEAD_LAUNCHES_MAX: u32 = 64;
pub const LOOKAHEAD_LAUNCHES_DEFAULT: u32 = 8;
/// Kernel-level jobs in recorded segments (`Config::run_segment_ns`): the default length of a
/// segment in estimated GPU time, and the cap. A segment is the unit the policy orders: a job
/// with a segment on the GPU cannot be overtaken before that segment ends, and every segment costs
/// a driver call, two records and the dispatcher's books. On an H200 with profiled estimates
/// (docs/benchmarks.md, "Segment length with profiled estimates"; 8- and 11-model vision mixes,
/// σ 1.5 and 2, PyTorch's CUDA graphs on 8 streams on the same arrivals), 1500 µs segments (about
/// one a request after the first kernel) had a lower p50 and p99 than 800 and 500 µs ones at every
/// load, most near capacity (the 11-model mix at 2109 req/s: p99 24 ms under `edf:0+backfill`
/// against 52 and 82 ms). The 500 µs of before had been tuned on an H100 on roofline estimates,
/// which made segments ~1.5x longer in GPU time than configured.
pub const RUN_SEGMENT_NS_DEFAULT: u64 = 1_500_000;
/// The default segment length where the pool's streams share hardware queues (more of them than
/// `CUDA_DEVICE_MAX_CONNECTIONS`): a recorded segment holds its hardware queue for its whole
/// length, so the other streams of that queue wait behind it, Paella's head-of-line blocking (in
/// the simulator's head-of-line experiment, 32 streams on 8 queues, 1500 µs segments gave p99
/// 4.5 ms where 500 µs ones kept a job's own 2.4 ms).
pub const RUN_SEGMENT_NS_SHARED_QUEUES: u64 = 500_000;
pub const RUN_SEGMENT_NS_MAX: u64 = 100_000_000;
/// Default `Config::wake_lead_ns`: a client's wake-up from an eventfd takes tens of microseconds.
pub const WAKE_LEAD_NS_DEFAULT: u64 = 50_000;
/// Host mappings (zero-copy I/O regions) one dispatcher holds at once.
pub const HOST_MAPPINGS_MAX: usize = 1024;
/// Distinct kernel resource shapes across all loaded models.
pub const CLASSES_MAX: usize = 4096;
/// Deficit counters saturate here (ns), far beyond any sensible fairness threshold.
pub const DEFICIT_NS_MAX: f64 = 1e15;

const _: () = assert!(CLASSES_MAX <= u16::MAX as usize);
const _: () = assert!(LAUNCHES_IN_FLIGHT_MAX <= u32::MAX as usize);
const _: () = assert!(JOBS_MAX <= u32::MAX as usize);

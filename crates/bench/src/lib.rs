//! kairos-bench: the benchmark harness — the workloads of the five papers, a load generator that
//! drives kairos (and, through trace files, its peers) with them, and the reports and plots.
//!
//! - [`workload`]: streams (model, class, priority, deadline, metrics group) and the sources that
//!   feed them: Poisson, lognormal, periodic, replayed traces ([`azure`]: the Azure Functions
//!   invocation-trace CSV), closed loops. One seed fixes every open-loop arrival.
//! - [`presets`]: Paella's mix, short/long and head-of-line workloads, REEF's DISB A to E, DARIS'
//!   periodic high/low-priority tasks, cold starts beyond the memory budget, and `custom`.
//! - [`target`]: what the generator drives, behind one trait: the dispatcher in the GPU's clock
//!   ([`target::VirtualTarget`]: the simulator, or a real GPU on the calling thread), the threaded
//!   engine ([`target::EngineTarget`]), a kairos server over REST, gRPC or shared memory
//!   ([`remote::RemoteTarget`]).
//! - [`runner`]: one run of a schedule (open and closed loops; cold starts under the engine's weight budget).
//! - [`stats`]: nearest-rank percentiles and the one latency summary every benchmark reports.
//! - [`metrics`]: HdrHistogram percentiles, throughput, goodput, deadline misses, queue and GPU time.
//! - [`experiment`]: offered-load sweeps per policy that stop at saturation.
//! - [`paella`]: Paella's own experiments (head-of-line blocking, lognormal mix, short vs long,
//!   fairness sweep) over any GPU, straight on the dispatcher's virtual-time driver.
//! - [`latency`]: `kairos bench latency`: each zoo model alone, one request at a time, through the
//!   in-process engine or the simulator, beside PyTorch's eager and CUDA-graph times.
//! - [`serving`]: the front ends' overhead as one client sees it (REST, gRPC, the shared-memory
//!   channel with hybrid wait or polling, its Unix socket), with the client's CPU use.
//! - [`soak`]: constant open-loop load on a running server through REST and gRPC with a flood of
//!   bad input mixed in, every good answer checked; the server's memory read from `/proc`.
//! - [`breakdown`]: where a request's time goes, launch by launch (launch call, hardware queue,
//!   execution, the record's way back, the GPU's gaps between a request's kernels), each model
//!   alone and in a mix; the one module that drives the dispatcher directly, to read its issue
//!   records.
//! - [`trace`]: the arrival traces the PyTorch peers replay (`scripts/peer_replay.py`), and their
//!   results read back; [`report`]: results JSON, markdown tables, plots ([`plot`]).
//!
//! Architecture invariants: the harness reaches kairos only through [`target::Target`] (commands in,
//! completions out) and never reads scheduler state (except [`breakdown`] and [`paella`], which
//! drive the dispatcher's virtual-time driver themselves); latency is measured from the scheduled arrival
//! (no coordinated omission); every random choice comes from the run's seed; every collection a
//! run grows has a `*_MAX` limit, and exceeding it is an error, not a stall.

#![forbid(unsafe_code)]

pub mod azure;
pub mod breakdown;
pub mod experiment;
pub mod latency;
pub mod metrics;
pub mod paella;
pub mod plot;
pub mod presets;
pub mod progress;
pub mod remote;
pub mod report;
pub mod runner;
pub mod serving;
pub mod soak;
pub mod stats;
pub mod target;
pub mod trace;
pub mod workload;

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Sched(#[from] kairos_sched::Error),
    #[error("model {model}: {message}")]
    Model { model: String, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
}

//! The dispatcher core: a state machine that owns all scheduling state and drives one [`Gpu`].
//!
//! It has three entry points and no threads, clocks or IO of its own:
//! - [`Dispatcher::on_command`]: a [`Command`] arrives (submit, cancel, load, unload, shutdown);
//! - [`Dispatcher::poll_gpu`]: the GPU's events are read and applied (placements, completions);
//! - [`Dispatcher::dispatch`]: the policy is asked, again and again, what to issue next.
//!
//! Results leave as [`Output`]s pushed onto a caller's vector. The threaded [`crate::Engine`] and
//! the virtual-time [`crate::VirtualDriver`] are two loops around these calls.
//!
//! # Jobs and waitlists
//! A submitted request becomes a job. A job first waits (FIFO per model) for an I/O slot: the
//! activation arena and input/output buffers of one in-flight request, pooled per model up to
//! `slots_per_model_max`. With a slot it is *admitted*: its inputs are copied in and its launches
//! enter its waitlist, a virtual stream with the plan's dependency semantics: a launch is ready
//! when every launch it depends on is done. Policies see admitted jobs through [`JobView`]s.
//!
//! # Zero-copy I/O
//! A request may bind its inputs and/or outputs to spans of caller memory that the dispatcher
//! mapped into the GPU ([`Command::MapHost`], `Gpu::map_host`) instead of carrying tensors
//! ([`Command::SubmitBound`]). Its slot's `Input(i)`/`Output(i)` buffers then resolve to those
//! spans for that request: nothing is written in at admission, nothing is read out at completion,
//! and the kernels read and write the caller's memory. Spans are checked at submission (sizes equal
//! to the plan's, inside the mapping, at the mapping's alignment, outputs overlapping nothing). A
//! mapping counts the jobs bound to it; [`Command::UnmapHost`] refuses new ones and unmaps when the
//! last finishes, i.e. when nothing of it is on the GPU any more.
//!
//! # Occupancy and streams
//! Launches go to a pool of GPU streams created at start. A kernel-level issue takes an idle stream
//! (nothing in flight, no job bound), so an issued kernel only ever waits for SMs, never behind
//! another kernel; a whole-job issue binds the job to one stream. Placement and completion events
//! feed the per-SM [`Occupancy`]; CTAs issued and not yet placed are `pending_ctas`.
//!
//! # Files
//! One file per mechanism, each an `impl` block of [`Dispatcher`] over the state defined here:
//! `admission.rs` (models, host mappings, submission, I/O slots, cancellation, completion),
//! `issue.rs` (decisions applied, launches, the stream pool, lookahead), `events.rs` (GPU events
//! and the occupancy mirror), `fairness.rs` (tenants' deficit counters); duration estimates live
//! in [`crate::estimate`].

use crate::estimate::{Estimates, RooflineRates};
use crate::occupancy::{Occupancy, ResourceClass};
use crate::policy::krisp::RightSizeUnit;
use crate::policy::{Decision, GpuView, JobKey, JobView, Policy, PolicyConfig, ReadyKernel, StreamView, TenantView, View};
use crate::request::*;
use crate::*;
use kairos_core::Tensor;
use kairos_core::plan::Plan;
use kairos_gpu::exec::{SpaceBases, input_bytes, upload_weights};
use kairos_gpu::{
    Allocation, DevicePtr, Gpu, GpuEvent, HostMapping, HostMappingId, HostMemory, LaunchId, LaunchRequest, MemKind, PartitionId,
    RunId, SmMask, StopWordId, StreamId,
};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

mod admission;
mod events;
mod fairness;
mod issue;
pub use issue::{RUN_RECORD_CREDIT_MAX_NS, RUN_RECORD_SHARE};
pub mod recovery;
mod residency;
pub use residency::{COLD_CHUNK_BYTES_DEFAULT, COLD_COPY_WINDOW_BYTES_DEFAULT, Eviction, ResidencyState};

use admission::{free_model, free_slot};

/// Dispatcher configuration. Every queue and pool has its `*_max`; running out is an error the
/// request sees ([`Error::Overloaded`]), never unbounded growth.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub policy: PolicyConfig,
    /// Headroom B of occupancy-gated policies: CTAs allowed to wait in hardware queues beyond what
    /// fits on the SMs now, on top of the one kernel the gate always lets wait (see
    /// [`GpuView::fits`](crate::policy::GpuView::fits)).
    pub headroom_ctas: u32,
    /// Issue-ahead per job: a kernel-level job's launches all go to its *lane* (one stream of the
    /// pool, held while the job has launches in flight), and its next launch is offered to the
    /// policy while the launches it has waiting there, issued and not yet started, add up to less
    /// than `lookahead_ns` of estimated GPU time and number fewer than `lookahead_launches_max`.
    /// So the next kernel already waits on the GPU when the running one ends (no notification
    /// round trip between a job's kernels), while the policy still picks, kernel by kernel, whose
    /// work goes out next. Each launch behind another names it as `after`, so the protocol's stream
    /// gate stops the rest of the lane if one is preempted. `lookahead_launches_max` 0: one launch
    /// of a job at a time (Paella without issue-ahead).
    pub lookahead_ns: u64,
    pub lookahead_launches_max: u32,
    /// Kernel-level launches report their CTAs per SM (`LaunchRequest::report_ctas`: up to two
    /// records per SM per launch, an exact occupancy mirror) instead of one start record per
    /// launch, from which the dispatcher models where the CTAs went (see [`crate::occupancy`]).
    pub cta_records: bool,
    /// A job handed whole to a stream goes out as a recorded run of its launches but the last
    /// ([`Gpu::record_run`]: one CUDA graph per model and I/O slot, recorded the first time the
    /// slot runs a whole job) followed by its last launch, which reports the end: one driver call
    /// instead of one per kernel, and no per-launch host work. Off, or on a backend without
    /// runs, or for a job whose I/O is bound to a host mapping: launch by launch.
    pub record_runs: bool,
    /// Kernel-level jobs go out in *segments*: runs of consecutive launches of at least this much
    /// estimated GPU time, each recorded once per I/O slot ([`Gpu::record_run`]) and replayed as
    /// one unit followed by the segment's last launch, which reports its start and end. The policy
    /// still picks, segment by segment, whose work goes out next (SRPT, fairness, the occupancy
    /// gate), and a job's next segment waits on its lane behind the running one (issue-ahead
    /// counts a segment's whole estimate). 0, `record_runs` off, a policy that preempts, or a
    /// decision that sets CTAs or an SM mask: launch by launch. `None`: [`RUN_SEGMENT_NS_DEFAULT`]
    /// when every stream of the pool has a hardware queue of its own, [`RUN_SEGMENT_NS_SHARED_QUEUES`]
    /// when the pool's streams outnumber the queues. See `issue.rs`.
    pub run_segment_ns: Option<u64>,
    /// A request asking for an early wake-up ([`RequestOptions::notify_before_done`]) gets
    /// [`Output::AlmostDone`] once its estimated remaining GPU time is at most this, or when only
    /// its last launch is left, whatever the policy.
    pub wake_lead_ns: u64,
    /// At most this many CTAs for a launch whose CTA count the policy leaves to the dispatcher
    /// (`None`: as many as fit on the GPU at once, each looping over the kernel's blocks). A cap
    /// leaves room for co-running kernels at the price of more blocks per CTA.
    pub launch_ctas_max: Option<u32>,
    /// Streams in the pool; `None` takes the device's hardware queue count, at least
    /// [`STREAM_COUNT_DEFAULT_MIN`] (streams beyond the hardware queues share them, which costs
    /// kernel-level dispatch nothing: its launches never wait on their own stream).
    pub stream_count: Option<u32>,
    /// High-priority streams beside the pool, kept for the lanes of real-time kernel-level jobs:
    /// a real-time job's first launch takes an idle one (else an idle pool stream), so the GPU
    /// places its CTAs before those of best-effort grids waiting for room. 0: real-time jobs use
    /// the pool. Whole-job policies bind jobs to pool streams only.
    pub realtime_stream_count: u32,
    /// Requests held by the dispatcher (waiting for a slot or admitted).
    pub jobs_max: usize,
    /// I/O slots (admitted requests) per model; more requests of the model wait for one, in
    /// arrival order (see [`SLOTS_PER_MODEL_MAX_DEFAULT`]).
    pub slots_per_model_max: usize,
    /// I/O slots allocated when a model is loaded (at most `slots_per_model_max`; fewer if memory
    /// runs out). Slots beyond them are allocated when a burst needs them, on the dispatcher's
    /// thread: three `cuMemAlloc`s each, which stalled every job behind them for milliseconds on an
    /// H100 (mix8 at 461 requests/s under `streams:8`: one 25 ms stall set the point's p99).
    pub slots_per_model_prealloc: usize,
    pub models_max: usize,
    /// Tenants with requests in the dispatcher at once.
    pub tenants_max: usize,
    /// Launches issued to the GPU and not done.
    pub launches_in_flight_max: u32,
    /// Decisions applied per `dispatch` call before it returns (to let events in).
    pub decisions_per_round_max: u32,
    /// Compute rates for roofline estimates of kernels without a profile.
    pub roofline_flops_per_s_f32: f64,
    pub roofline_flops_per_s_f16: f64,
    pub launch_overhead_ns: f64,
    /// Samples after which the online estimate becomes an exponential average (see [`crate::estimate`]).
    pub estimate_window: u32,
    /// Issue records kept for tests and debugging (0: none).
    pub trace_max: usize,
    /// The watchdog's least bound: a launch at the head of its stream for longer than this (or
    /// [`recovery::WATCHDOG_ESTIMATE_FACTOR`] times its estimate, if more) is taken for a hung
    /// kernel, and [`Dispatcher::poll_gpu`] reports the GPU failed so that the caller resets it
    /// ([`Dispatcher::recover`]). 0: no watchdog.
    pub watchdog_ns_min: u64,
    /// Device memory for model weights (DeepPlan's setting: more models than the GPU holds; see
    /// `residency.rs`). None: every model's weights are uploaded at load and stay. Some: models
    /// keep their weights in pinned host memory and are loaded on demand within this budget,
    /// least recently used idle ones evicted.
    pub weight_budget_bytes: Option<u64>,
    /// How a model that is not resident is loaded when a request needs it ([`crate::cold`]).
    pub cold_strategy: crate::cold::ColdStrategy,
    /// Copies of a load hold at least this many bytes of consecutive loaded layers.
    pub cold_chunk_bytes: u64,
    /// Loads' own copies go on the copy engine while less than this many bytes of them (all loads
    /// together) are on it, the load that started first first, in pieces of at most half of it (so
    /// at most 1.5x on it; a chunk no longer than that goes whole, a longer one in equal pieces);
    /// the next go out as earlier ones land. The copy engine runs its queue in order, so a warm
    /// request's input copy queued behind a whole load waited for all of it, and the dispatcher's
    /// thread with it (inputs are written synchronously). 0: a load's copies all go out at once,
    /// unsplit.
    pub cold_copy_window_bytes: u64,
    /// Which idle resident model a load evicts: LRU (DeepPlan's) or LRU-2.
    pub eviction: Eviction,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: PolicyConfig::by_name("paella").unwrap(),
            headroom_ctas: 132,
            lookahead_ns: LOOKAHEAD_NS_DEFAULT,
            lookahead_launches_max: LOOKAHEAD_LAUNCHES_DEFAULT,
            cta_records: false,
            record_runs: true,
            run_segment_ns: None,
            wake_lead_ns: WAKE_LEAD_NS_DEFAULT,
            launch_ctas_max: None,
            stream_count: None,
            realtime_stream_count: REALTIME_STREAM_COUNT_DEFAULT,
            jobs_max: 4096,
            slots_per_model_max: SLOTS_PER_MODEL_MAX_DEFAULT,
            slots_per_model_prealloc: SLOTS_PER_MODEL_PREALLOC_DEFAULT,
            models_max: 64,
            tenants_max: 1024,
            launches_in_flight_max: 8192,
            decisions_per_round_max: 1024,
            roofline_flops_per_s_f32: 30e12,
            roofline_flops_per_s_f16: 60e12,
            launch_overhead_ns: 3000.0,
            estimate_window: 32,
            trace_max: 0,
            watchdog_ns_min: WATCHDOG_NS_MIN_DEFAULT,
            weight_budget_bytes: None,
            cold_strategy: crate::cold::ColdStrategy::default(),
            cold_chunk_bytes: residency::COLD_CHUNK_BYTES_DEFAULT,
            cold_copy_window_bytes: residency::COLD_COPY_WINDOW_BYTES_DEFAULT,
            eviction: Eviction::default(),
        }
    }
}

impl Config {
    pub fn with_policy(mut self, policy: PolicyConfig) -> Config {
        self.policy = policy;
        self
    }

    /// Checks every limit against its hard cap.
    pub fn validate(&self) -> Result<(), Error> {
        let check = |what: &str, v: u64, max: u64| {
            if v == 0 || v > max { Err(Error::InvalidInput(format!("{what} = {v} must be in 1..={max}"))) } else { Ok(()) }
        };
        check("jobs_max", self.jobs_max as u64, JOBS_MAX as u64)?;
        check("slots_per_model_max", self.slots_per_model_max as u64, SLOTS_PER_MODEL_MAX as u64)?;
        check("models_max", self.models_max as u64, MODELS_MAX as u64)?;
        check("tenants_max", self.tenants_max as u64, TENANTS_MAX as u64)?;
        check("launches_in_flight_max", self.launches_in_flight_max as u64, LAUNCHES_IN_FLIGHT_MAX as u64)?;
        check("decisions_per_round_max", self.decisions_per_round_max as u64, DECISIONS_PER_ROUND_MAX as u64)?;
        if self.lookahead_launches_max > LOOKAHEAD_LAUNCHES_MAX {
            return Err(Error::InvalidInput(format!(
                "lookahead_launches_max = {} must be at most {LOOKAHEAD_LAUNCHES_MAX}",
                self.lookahead_launches_max
            )));
        }
        if self.lookahead_ns > LOOKAHEAD_NS_MAX {
            return Err(Error::InvalidInput(format!("lookahead_ns = {} must be at most {LOOKAHEAD_NS_MAX}", self.lookahead_ns)));
        }
        if let Some(n) = self.run_segment_ns.filter(|&n| n > RUN_SEGMENT_NS_MAX) {
            return Err(Error::InvalidInput(format!("run_segment_ns = {n} must be at most {RUN_SEGMENT_NS_MAX}")));
        }
        if let Some(s) = self.stream_count {
            check("stream_count", s as u64, STREAMS_MAX as u64)?;
        }
        if self.realtime_stream_count > REALTIME_STREAMS_MAX {
            return Err(Error::InvalidInput(format!(
                "realtime_stream_count = {} must be at most {REALTIME_STREAMS_MAX}",
                self.realtime_stream_count
            )));
        }
        if self.cold_chunk_bytes == 0 {
            return Err(Error::InvalidInput("cold_chunk_bytes must be at least 1".into()));
        }
        if self.trace_max > TRACE_MAX {
            return Err(Error::InvalidInput(format!("trace_max = {} exceeds {TRACE_MAX}", self.trace_max)));
        }
        Ok(())
    }
}

/// One issued launch, recorded when `trace_max` > 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IssueRecord {
    /// When the launch call began (host clock).
    pub at_ns: u64,
    pub request: RequestId,
    pub tenant: TenantId,
    pub launch: u32,
    pub gpu_launch: LaunchId,
    pub stream: u32,
    pub first_block: u32,
    pub ctas: u32,
    /// How long the launch call took on the host (the GPU's clock read before and after it).
    pub call_ns: u64,
    /// Issued behind another launch of its job on the job's lane (issue-ahead).
    pub behind: bool,
    /// The launch's estimated duration when it was issued.
    pub est_ns: u64,
    /// When the launch it was queued behind ended (device time on the host clock).
    pub after_done_ns: Option<u64>,
    /// When its first logical block was taken (launches that report their start).
    pub started_ns: Option<u64>,
    /// When it ended on the device.
    pub done_ns: Option<u64>,
    /// When the dispatcher read its end.
    pub seen_ns: Option<u64>,
    /// It ended short of its last block (preempted, stopped at the stream gate, cancelled) or its
    /// notifications were lost.
    pub stopped: bool,
}

/// Counters of what the dispatcher did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatcherStats {
    pub submitted: u64,
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
    /// Refused at submission (overload, unknown model, invalid input, shutting down).
    pub rejected: u64,
    /// Policy decisions applied.
    pub decisions: u64,
    /// Decisions the dispatcher refused as invalid (a policy bug; tests require 0).
    pub refused_decisions: u64,
    pub launches: u64,
    /// Launches a policy preempted (they resume where they stopped).
    pub preemptions: u64,
    pub events: u64,
    /// Events naming unknown launches, CTAs left at launch end, or block counts that disagree
    /// with the launch's resume point (lost or wrong notifications; tests require 0).
    pub notification_anomalies: u64,
    pub trace_dropped: u64,
    /// Launches the GPU reported lost (its notification ring overflowed; their jobs failed).
    pub launches_lost: u64,
    /// Times the GPU was reset after a fault ([`Dispatcher::recover`]), and launches the
    /// watchdog found hung.
    pub gpu_recoveries: u64,
    pub watchdog_expiries: u64,
    /// Host time spent in `Gpu::launch` calls, in asking the policy, and in reading and applying
    /// GPU events (the GPU's clock, i.e. the host's on CUDA and virtual time on the simulator).
    pub launch_call_ns: u64,
    pub policy_ns: u64,
    pub events_ns: u64,
    /// Whole jobs issued as a recorded run plus their last launch ([`Config::record_runs`]), runs
    /// recorded, and the host time recording took.
    pub runs_launched: u64,
    pub runs_recorded: u64,
    pub run_record_ns: u64,
    /// Recordings the GPU refused (the job went launch by launch).
    pub run_record_failures: u64,
    /// Kernel-level segments issued as a recorded run plus their last launch
    /// ([`Config::run_segment_ns`]).
    pub segments_launched: u64,
    /// Launches issued confined to part of the GPU by an SM mask (`reef`'s padding, `krisp`'s
    /// and `static`'s kernels).
    pub masked_launches: u64,
    /// Of those, launches that went out on a hardware partition of their mask's SM groups
    /// (`krisp+green`, `static+green`: [`PolicyConfig::hardware_masks`](crate::PolicyConfig::hardware_masks)),
    /// and masks that could not (not a union of the device's groups, or the GPU refused the
    /// partition: the software mask instead).
    pub partition_launches: u64,
    pub partition_fallbacks: u64,
    /// Under a weight budget: loads started by a request to a model not in device memory (cold
    /// starts), loads completed and their summed time (first copy queued to last copy landed),
    /// device bytes they moved, and models evicted to make room.
    pub cold_starts: u64,
    pub loads_completed: u64,
    pub load_ns: u64,
    pub loaded_bytes: u64,
    pub evictions: u64,
    /// Loads whose copies the GPU refused (written synchronously instead).
    pub load_copies_refused: u64,
    /// The most bytes of loads' own copies (not those through secondaries) that were on the copy
    /// engine at once (less than [`Config::cold_copy_window_bytes`] plus one piece), and copies
    /// of layers that a launch issued whole needed before their turn in the window.
    pub load_copy_bytes_in_flight_max: u64,
    pub load_copies_forced: u64,
    /// Loads planned through secondary GPUs that went through this GPU alone for some part
    /// because the secondary's link was busy (`Gpu::peer_busy`).
    pub secondary_busy_loads: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LState {
    /// Not issued (or returned after it stopped early): it resumes at `first_block`.
    Pending {
        first_block: u32,
    },
    Issued(LaunchId),
    Done,
}

struct IoSlot {
    allocations: Vec<Allocation>,
    bases: SpaceBases,
    /// The model's launches but its last, recorded on this slot's buffers for whole-job issue
    /// ([`Config::record_runs`]); recorded the first time a whole job runs on the slot.
    run: Option<RunId>,
    /// The model's segments recorded on this slot (index: the segment; empty until one is).
    segment_runs: Vec<Option<RunId>>,
    /// The slot's stop word, made for its first segment that a preemption may stop
    /// ([`Policy::stops_runs`]).
    stop_word: Option<StopWordId>,
    /// The model's segments recorded on this slot with `stop_word` (as `segment_runs`).
    stop_runs: Vec<Option<RunId>>,
    /// Segments recorded inside a hardware partition (`static+green`): (segment, partition, run),
    /// at most [`PARTITION_RUNS_PER_SLOT_MAX`].
    partition_runs: Vec<(u32, PartitionId, RunId)>,
}

/// Segments one I/O slot keeps recorded inside hardware partitions (beyond: launch by launch).
pub const PARTITION_RUNS_PER_SLOT_MAX: usize = 64;

/// A host mapping the dispatcher made for zero-copy requests. Its owner knows it by the id the
/// dispatcher handed out (the key of `host_maps`), which outlives a reset of the GPU; `mapping`
/// is the GPU's current one.
struct HostMap {
    memory: Arc<dyn HostMemory>,
    mapping: HostMapping,
    /// Jobs whose I/O is bound to it (waiting or admitted).
    jobs: usize,
    /// Unmap asked for: new requests are refused; it goes when `jobs` reaches 0.
    closing: bool,
}

/// A job's inputs and outputs in a host mapping, as device addresses (empty: not bound).
struct Bound {
    mapping: HostMappingId,
    inputs: Vec<DevicePtr>,
    outputs: Vec<DevicePtr>,
}

struct Model {
    name: String,
    plan: Arc<Plan>,
    /// The weights in device memory, uploaded at load (None under a weight budget: see
    /// `residency`).
    weights: Option<Allocation>,
    residency: Option<residency::Residency>,
    dependents: Vec<Vec<u32>>,
    dep_counts: Vec<u32>,
    classes: Vec<ResourceClass>,
    /// One wave of CTAs of each launch's class.
    capacity_ctas: Vec<u32>,
    estimates: Estimates,
    slots_free: Vec<IoSlot>,
    slots_total: usize,
    waiting: VecDeque<JobKey>,
    /// Real-time jobs among `waiting`.
    realtime_waiting: usize,
    /// Jobs of this model in the dispatcher (waiting or admitted).
    jobs: usize,
    unloading: bool,
    /// Kernel-level segments ([`Config::run_segment_ns`]): consecutive launch ranges, and for
    /// each launch the segment it starts (`NO_SEGMENT` if none). Empty when segments are off.
    segments: Vec<std::ops::Range<u32>>,
    segment_at: Vec<u32>,
    /// SMs its widest launch covers at its default CTAs (`JobView::widest_sms`).
    widest_sms: u32,
    /// Per launch, its right size in SMs (`ReadyKernel::right_sms`).
    right_sms: Vec<u32>,
    /// No launch reads memory it writes, so one stopped part-way may run again whole: its
    /// segments may go out in runs that a preemption stops between kernels.
    rerunnable: bool,
}

/// `Model::segment_at` of a launch that starts no segment.
const NO_SEGMENT: u32 = u32::MAX;

impl Model {
    /// CTAs of launch `i` from `first_block` when the policy leaves the count to the dispatcher:
    /// one wave of its class, at most `launch_ctas_max`, at least one, at most its blocks left.
    fn default_ctas(&self, i: usize, first_block: u32, launch_ctas_max: Option<u32>) -> u32 {
        let blocks_left = self.plan.launches[i].shape.logical_blocks - first_block;
        self.capacity_ctas[i].min(launch_ctas_max.unwrap_or(u32::MAX)).clamp(1, blocks_left.max(1))
    }

    /// The launch's dependencies, each once.
    fn dep_list(&self, i: usize) -> impl Iterator<Item = u32> + '_ {
        let deps = &self.plan.launches[i].deps;
        deps.iter().enumerate().filter(move |&(k, d)| !deps[..k].contains(d)).map(|(_, &d)| d)
    }
}

struct Job {
    key: JobKey,
    id: RequestId,
    model: usize,
    options: RequestOptions,
    arrival_ns: u64,
    admitted_ns: u64,
    first_issue_ns: Option<u64>,
    /// Start of the decision round that issued its first launch (`Timing::first_round_ns`).
    first_round_ns: Option<u64>,
    /// Input bytes held until the job gets a slot.
    inputs: Vec<Vec<u8>>,
    slot: Option<IoSlot>,
    /// Zero-copy I/O, and the slot's bases with it applied (set when admitted).
    bound: Option<Bound>,
    bound_bases: Option<SpaceBases>,
    states: Vec<LState>,
    /// Per launch, its dependencies neither issued nor done: at 0 it may be issued (behind the
    /// issued ones on the job's lane, whose stream order runs them first).
    deps_open: Vec<u32>,
    /// Launches with no open dependency, not issued and not done: the ones a policy may be offered.
    issuable: BTreeSet<u32>,
    /// Launches in flight that no one asked to stop.
    running: BTreeSet<u32>,
    /// Launches in `running` that no stop word stops (issued launch by launch): while there are
    /// none, one raised stop word stops the job's launches in flight (`apply_preempt`).
    running_unstoppable: u32,
    /// The stream of the pool this kernel-level job holds while it has launches in flight, and
    /// the last launch issued there (the next one goes `after` it).
    lane: Option<u32>,
    lane_tail: Option<LaunchId>,
    /// Launches of the job issued and not yet started (they wait on the lane), and their
    /// estimated GPU time: the issue-ahead window.
    ahead_launches: u32,
    ahead_ns: f64,
    /// A launch of the job was preempted: nothing more goes to its lane until the lane is empty.
    draining: bool,
    /// Launches of this job issued behind another one (for [`Timing::chained`]).
    chained: u32,
    unissued: u32,
    in_flight: u32,
    done: u32,
    cancelled: bool,
    error: Option<Error>,
    /// Index in `views` while admitted.
    view: Option<usize>,
    /// The stream a whole-job issue bound it to.
    stream: Option<u32>,
    /// The latest load copy this job's launches were made to wait for, and on which stream
    /// (a cold start's launches: see `residency`).
    copy_waited: Option<(u32, kairos_gpu::CopyId)>,
    /// Its model was not in device memory when it arrived (a cold start): it goes launch by
    /// launch, so that recording the model's runs again is not part of its latency (the next
    /// request records them).
    cold: bool,
    /// Estimated GPU time of the launches not yet done (current estimates).
    remaining_ns: f64,
    total_ns: f64,
    first_start_ns: Option<u64>,
    last_done_ns: u64,
    gpu_ns: u64,
    seq: u64,
    last_issue_seq: u64,
    counted_ready: bool,
    /// `AlmostDone` was queued for this job.
    notified: bool,
    /// Per group of `GROUP_SMS` SMs, its launches in flight whose mask touches the group.
    group_refs: [u16; 32],
}

struct InFlight {
    job: JobKey,
    launch: u32,
    class: ResourceClass,
    /// CTAs started.
    ctas: u32,
    /// CTAs not yet placed (reported or, without CTA records, modelled).
    unplaced: u32,
    live: u32,
    blocks: u64,
    first_block: u32,
    issued_ns: u64,
    /// The dispatcher's issue counter for this launch (`JobView::running_issue_seq`).
    issue_seq: u64,
    first_placed_ns: Option<u64>,
    started_ns: Option<u64>,
    stream: u32,
    /// Issued behind this launch of the same job on the same stream: its CTAs are not counted
    /// as pending until this one ends.
    behind: Option<LaunchId>,
    /// The launch issued behind this one.
    ahead: Option<LaunchId>,
    /// Its CTAs are reported as they arrive and leave. A launch of a whole-job stream reports
    /// only its end: its CTAs count as pending (`unplaced`) until then and never enter the
    /// occupancy map (the policies that hand out whole jobs do not place work by it).
    report_ctas: bool,
    /// It reports its start, and its CTAs enter the occupancy map as modelled placements then
    /// (`modelled`: SM, CTAs), leaving it at its end.
    report_start: bool,
    /// Its measured duration updates the estimates: false for a whole job's launches when the
    /// job has several (their ends are implied by the last one's: `LaunchRequest::report_end`).
    learns: bool,
    modelled: Vec<(u32, u32)>,
    mask: SmMask,
    /// Its estimate when issued, counted in the job's issue-ahead window until it starts (a
    /// segment's reporter: the whole segment's).
    est_ns: f64,
    in_window: bool,
    /// A segment's reporter: the first launch of the recorded run it waits behind (the run holds
    /// launches `run_from..launch`, whose estimates learn from the time the run took).
    run_from: Option<u32>,
    /// It carries its slot's stop word (a segment a preemption stops between kernels).
    stoppable: bool,
    /// Its issue record, when traced.
    trace: Option<usize>,
}

/// The dispatcher over one GPU. See the module docs.
pub struct Dispatcher<G: Gpu> {
    gpu: G,
    cfg: Config,
    policy: Box<dyn Policy>,
    whole: SmMask,
    /// `+green` (the policy's masks as hardware partitions): per device SM group
    /// ([`Gpu::sm_groups`]), the occupancy map's groups of [`GROUP_SMS`](crate::occupancy::GROUP_SMS)
    /// it holds, as map-group bits (matched by SM counts in order: an H100's or H200's 132 SMs
    /// are 16 device groups, 15 of 8 SMs and one of 12, against 17 map groups, 16 of 8 and one
    /// of 4, so the last device group holds the last two map groups). Empty: masks stay software
    /// masks (another policy, no hardware partitions, or groups that do not nest).
    device_groups: Vec<u32>,
    rates: RooflineRates,
    occupancy: Occupancy,
    models: Vec<Option<Model>>,
    model_names: HashMap<String, usize>,
    jobs: Vec<Option<Job>>,
    free_slots: Vec<u32>,
    generation: u32,
    job_count: usize,
    by_id: kairos_gpu::idmap::IdMap<RequestId, JobKey>,
    views: Vec<JobView>,
    tenants: Vec<TenantView>,
    tenant_index: kairos_gpu::idmap::IdMap<TenantId, usize>,
    /// The pool's streams (`0..pool_streams`), then the high-priority ones for real-time lanes.
    stream_ids: Vec<StreamId>,
    streams: Vec<StreamView>,
    pool_streams: usize,
    idle_realtime_streams: u32,
    /// Per stream, when its last launch ended (device clock as events report it): a launch that
    /// started early behind it (an overlapped launch) ran from then on.
    stream_last_done_ns: Vec<u64>,
    idle_streams: u32,
    /// Hardware queues the pool's streams share (stream s uses queue s mod this, as CUDA and the
    /// simulator assign streams to queues round robin), and per queue the launches waiting at
    /// its head behind a dependency: a kernel issued there would wait behind them.
    hw_queues: usize,
    blocked_queues: Vec<u32>,
    /// Per group of `GROUP_SMS` SMs, the jobs with a launch in flight whose mask touches it
    /// (`GpuView::group_jobs`; kept for the policies that mask kernels, zeros for the others).
    group_jobs: Vec<u32>,
    /// Per hardware queue, its idle streams; and the idle streams of queues with nothing blocked
    /// (what policies see as idle), kept as streams and queues change rather than counted per view.
    idle_per_queue: Vec<u32>,
    available_streams: u32,
    stream_cursor: usize,
    in_flight: kairos_gpu::idmap::IdMap<LaunchId, InFlight>,
    /// CTAs issued and not yet placed, of launches not waiting behind another on their stream.
    pending_ctas: u64,
    spare_placements: Vec<Vec<(u32, u32)>>,
    admit_seq: u64,
    issue_seq: u64,
    now_ns: u64,
    /// When the current (or last) decision round began (`Timing::first_round_ns`).
    round_ns: u64,
    /// When the last real-time job left (`View::last_realtime_done_ns`); 0: none yet.
    last_realtime_done_ns: u64,
    /// When a policy that holds work back ([`Policy::holds`]) may decide otherwise, as it said
    /// after its last round decided nothing more ([`Dispatcher::wake_at_ns`]).
    wake_at_ns: Option<u64>,
    events: Vec<GpuEvent>,
    args: Vec<kairos_gpu::DevicePtr>,
    stats: DispatcherStats,
    trace: Vec<IssueRecord>,
    /// `AlmostDone` notices waiting for the next `dispatch` to hand them out (at most one per job).
    almost_done: Vec<RequestId>,
    host_maps: HashMap<HostMappingId, HostMap>,
    next_host_map_id: u64,
    /// Models a recovery could not upload again (their error), and mappings it could not map
    /// again: requests name them in vain until they are unloaded or unmapped.
    lost_models: HashMap<String, String>,
    lost_mappings: std::collections::HashSet<HostMappingId>,
    /// The watchdog looks again at this time (see [`Dispatcher::recover`]'s module).
    watchdog_next_ns: u64,
    /// Requests [`Dispatcher::fail_held`] answered since the last reset (the next recovery report's).
    failed_before_reset: u64,
    shutting_down: bool,
    shut_down: bool,
    /// The GPU records runs (false once `record_run` said it cannot).
    runs_supported: bool,
    /// The GPU has stop words (false once `create_stop_word` said it has none).
    stop_words_supported: bool,
    /// Scratch: the ids of a run's launches.
    run_ids: Vec<LaunchId>,
    /// What recording runs for slots made on demand may still take now, and when it was last
    /// topped up (see `Dispatcher::record_whole_run`).
    run_credit_ns: f64,
    run_credit_at_ns: u64,
    /// Under a weight budget: the stream loads copy on, the device bytes of loading and resident
    /// models, models whose load waits for memory, and the model each copy in flight loads.
    copy_stream: Option<StreamId>,
    resident_bytes: u64,
    load_waiters: Vec<usize>,
    copy_owner: HashMap<kairos_gpu::CopyId, usize>,
}

/// The occupancy map's groups of [`GROUP_SMS`](crate::occupancy::GROUP_SMS) SMs held by each of a
/// device's SM groups of `device_sizes` SMs (in order, by cumulative SM counts), as map-group
/// bits; empty when some map group straddles two device groups or the counts disagree.
pub fn nest_groups(device_sizes: &[u32], sm_count: u32) -> Vec<u32> {
    use crate::occupancy::{GROUP_SMS, group_count_of};
    let map_count = group_count_of(sm_count).min(32);
    if device_sizes.is_empty() || device_sizes.iter().sum::<u32>() != sm_count || map_count == 0 {
        return Vec::new();
    }
    let mut members = vec![0u32; device_sizes.len()];
    let (mut d, mut device_end) = (0usize, device_sizes[0]);
    for g in 0..map_count {
        let (start, end) = (g * GROUP_SMS, ((g + 1) * GROUP_SMS).min(sm_count));
        while start >= device_end {
            d += 1;
            device_end += device_sizes[d];
        }
        if end > device_end {
            return Vec::new();
        }
        members[d] |= 1 << g;
    }
    members
}

impl<G: Gpu> Dispatcher<G> {
    /// Takes the GPU and creates the stream pool; the policy is `cfg.policy`.
    pub fn new(cfg: Config, gpu: G) -> Result<Dispatcher<G>, Error> {
        let policy = cfg.policy.build();
        Dispatcher::with_policy(cfg, gpu, policy)
    }

    /// Like [`Dispatcher::new`] with a policy of the caller's own (`cfg.policy` is then only a label).
    pub fn with_policy(cfg: Config, mut gpu: G, policy: Box<dyn Policy>) -> Result<Dispatcher<G>, Error> {
        cfg.validate()?;
        let info = gpu.info().clone();
        if info.sm_count == 0 || info.partitions.is_empty() {
            return Err(Error::Gpu(format!("device '{}' reports no SMs", info.name)));
        }
        // The backend's own bound on launches in flight (CUDA: its launch slots) caps ours, so
        // whole-job issue waits instead of failing requests when it runs out.
        let mut cfg = cfg;
        if info.launches_in_flight_max > 0 {
            cfg.launches_in_flight_max = cfg.launches_in_flight_max.min(info.launches_in_flight_max);
        }
        let stream_count =
            cfg.stream_count.unwrap_or(info.hardware_queues.max(STREAM_COUNT_DEFAULT_MIN)).clamp(1, STREAMS_MAX as u32);
        let stream_ids = create_streams(&mut gpu, stream_count as usize, cfg.realtime_stream_count as usize)?;
        let copy_stream = match cfg.weight_budget_bytes {
            Some(_) => Some(gpu.create_stream(0).map_err(|e| Error::Gpu(format!("creating the copy stream: {e}")))?),
            None => None,
        };
        let rates = RooflineRates {
            flops_per_s_f32: cfg.roofline_flops_per_s_f32,
            flops_per_s_f16: cfg.roofline_flops_per_s_f16,
            mem_bytes_per_s: info.device_mem_bytes_per_s,
            launch_overhead_ns: cfg.launch_overhead_ns,
            sm_count: info.sm_count,
        };
        let device_groups = if cfg.policy.hardware_masks() {
            let sizes: Vec<u32> = gpu.sm_groups().iter().map(|m| m.count()).collect();
            nest_groups(&sizes, info.sm_count)
        } else {
            Vec::new()
        };
        Ok(Dispatcher {
            policy,
            whole: info.partitions[0].sms,
            device_groups,
            rates,
            occupancy: if cfg.cta_records {
                Occupancy::new(info.sm_count, info.sm_limits)
            } else {
                Occupancy::modelled(info.sm_count, info.sm_limits)
            },
            models: Vec::new(),
            model_names: HashMap::new(),
            jobs: Vec::new(),
            free_slots: Vec::new(),
            generation: 0,
            job_count: 0,
            by_id: Default::default(),
            views: Vec::new(),
            tenants: Vec::new(),
            tenant_index: Default::default(),
            streams: vec![StreamView::default(); stream_ids.len()],
            stream_last_done_ns: vec![0; stream_ids.len()],
            pool_streams: stream_count as usize,
            idle_realtime_streams: cfg.realtime_stream_count,
            idle_streams: stream_count,
            hw_queues: info.hardware_queues.max(1) as usize,
            blocked_queues: vec![0; info.hardware_queues.max(1) as usize],
            group_jobs: vec![0; crate::occupancy::group_count_of(info.sm_count).min(32) as usize],
            idle_per_queue: issue::streams_per_queue(stream_count as usize, info.hardware_queues.max(1) as usize),
            available_streams: stream_count,
            stream_ids,
            stream_cursor: 0,
            in_flight: Default::default(),
            pending_ctas: 0,
            spare_placements: Vec::new(),
            admit_seq: 0,
            issue_seq: 0,
            now_ns: gpu.now_ns(),
            round_ns: 0,
            last_realtime_done_ns: 0,
            wake_at_ns: None,
            events: Vec::new(),
            args: Vec::new(),
            stats: DispatcherStats::default(),
            trace: Vec::new(),
            almost_done: Vec::new(),
            host_maps: HashMap::new(),
            next_host_map_id: 1,
            lost_models: HashMap::new(),
            lost_mappings: Default::default(),
            watchdog_next_ns: 0,
            failed_before_reset: 0,
            shutting_down: false,
            shut_down: false,
            runs_supported: true,
            stop_words_supported: true,
            run_ids: Vec::new(),
            run_credit_ns: issue::RUN_RECORD_CREDIT_MAX_NS as f64,
            run_credit_at_ns: 0,
            copy_stream,
            resident_bytes: 0,
            load_waiters: Vec::new(),
            copy_owner: HashMap::new(),
            cfg,
            gpu,
        })
    }

    pub fn gpu(&self) -> &G {
        &self.gpu
    }

    pub fn gpu_mut(&mut self) -> &mut G {
        &mut self.gpu
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    pub fn stats(&self) -> DispatcherStats {
        self.stats
    }

    pub fn occupancy(&self) -> &Occupancy {
        &self.occupancy
    }

    /// Issue records (when `trace_max` > 0).
    pub fn trace(&self) -> &[IssueRecord] {
        &self.trace
    }

    /// Requests held (waiting for a slot or admitted).
    pub fn jobs(&self) -> usize {
        self.job_count
    }

    pub fn launches_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Launches and load copies on the GPU that have not been reported done: while there are
    /// any, the GPU has events to come.
    pub fn work_in_flight(&self) -> usize {
        self.in_flight.len() + self.copy_owner.len()
    }

    pub fn pending_ctas(&self) -> u64 {
        self.pending_ctas
    }

    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    /// The current estimate of a loaded model's launch, for reports and tests.
    pub fn estimate_ns(&self, model: &str, launch: u32) -> Option<f64> {
        let m = self.models[*self.model_names.get(model)?].as_ref()?;
        (launch < m.plan.launches.len() as u32).then(|| m.estimates.get(launch))
    }

    /// Frees all GPU memory the dispatcher holds and gives the GPU back (after a shutdown, or to
    /// reuse the device for another run).
    pub fn into_gpu(mut self) -> G {
        for m in self.models.iter_mut().filter_map(Option::take) {
            free_model(&mut self.gpu, m);
        }
        for j in self.jobs.iter_mut().filter_map(Option::take) {
            if let Some(s) = j.slot {
                free_slot(&mut self.gpu, s);
            }
        }
        for (_, h) in self.host_maps.drain() {
            let _ = self.gpu.unmap_host(h.mapping.id);
        }
        // Streams are a bounded resource of the backend (1024 on CUDA): a GPU reused for run
        // after run must get them back.
        for s in self.stream_ids.drain(..) {
            let _ = self.gpu.destroy_stream(s);
        }
        self.gpu
    }

    /// When the policy may decide otherwise with nothing else happening (`reef`'s hold-off
    /// ending): an engine with nothing in flight looks again then instead of waiting for an event.
    /// None: only events (arrivals, GPU records, commands) can change its mind.
    pub fn wake_at_ns(&self) -> Option<u64> {
        self.wake_at_ns.filter(|_| self.job_count > 0)
    }

    /// The view policies read.
    pub fn view(&self) -> View<'_> {
        View {
            now_ns: self.now_ns,
            last_realtime_done_ns: self.last_realtime_done_ns,
            jobs: &self.views,
            tenants: &self.tenants,
            gpu: GpuView {
                occupancy: &self.occupancy,
                pending_ctas: self.pending_ctas,
                headroom_ctas: self.cfg.headroom_ctas,
                launches_in_flight: self.in_flight.len() as u32,
                launches_in_flight_max: self.cfg.launches_in_flight_max,
                streams: &self.streams[..self.pool_streams],
                idle_streams: self.available_streams(),
                idle_realtime_streams: self.idle_realtime_streams,
                group_jobs: &self.group_jobs,
            },
        }
    }

    // ---------------------------------------------------------------- commands

    pub fn on_command(&mut self, cmd: Command, out: &mut Vec<Output>) {
        self.now_ns = self.gpu.now_ns();
        match cmd {
            Command::Submit(r) => self.submit(r, None, out),
            Command::SubmitBound(r, binding) => self.submit(r, Some(binding), out),
            Command::MapHost(memory) => {
                let result = self.map_host(memory);
                out.push(Output::HostMapped { result });
            }
            Command::UnmapHost(id) => self.unmap_host(id, out),
            Command::Cancel(id) => self.cancel(id, Error::Cancelled, out),
            Command::LoadModel(spec) => {
                let name = spec.name.clone();
                let result = self.load_model(spec);
                out.push(Output::ModelLoaded { name, result });
            }
            Command::UnloadModel(name) => self.unload_model(name, out),
            Command::Shutdown => self.shutdown(out),
        }
    }

    // ---------------------------------------------------------------- bookkeeping

    fn job(&self, key: JobKey) -> Option<&Job> {
        self.jobs.get(key.slot as usize)?.as_ref().filter(|j| j.key == key)
    }

    fn job_mut(&mut self, key: JobKey) -> Option<&mut Job> {
        self.jobs.get_mut(key.slot as usize)?.as_mut().filter(|j| j.key == key)
    }

    /// Checks the dispatcher's books against each other (for tests: the swarm runs it after every
    /// step): remaining times are the sums of the current estimates of the launches not done,
    /// pending CTAs and issue-ahead windows match the launches in flight, every kernel-level job's
    /// launches in flight are on its lane, the issuable sets and open-dependency counts match the
    /// launch states, and the occupancy mirror holds exactly the modelled placements and the
    /// reported live CTAs. O(jobs x launches).
    pub fn check_invariants(&self) -> Result<(), String> {
        let pending: u64 = self.in_flight.values().filter(|f| f.behind.is_none()).map(|f| f.unplaced as u64).sum();
        if pending != self.pending_ctas {
            return Err(format!("pending CTAs {} but the launches in flight leave {pending} unplaced", self.pending_ctas));
        }
        for view in &self.views {
            let job = self.job(view.key).ok_or("a view names no job")?;
            let m = self.models[job.model].as_ref().ok_or("a job's model is gone")?;
            let n = job.states.len();
            let left: f64 = (0..n as u32).filter(|&i| job.states[i as usize] != LState::Done).map(|i| m.estimates.get(i)).sum();
            if !job.cancelled && (job.remaining_ns - left).abs() > 1.0 + 1e-9 * left {
                return Err(format!(
                    "job {:?}: remaining {} ns, its launches not done are estimated at {left} ns",
                    job.id, job.remaining_ns
                ));
            }
            let mine: Vec<&InFlight> = self.in_flight.values().filter(|f| f.job == job.key).collect();
            if mine.len() as u32 != job.in_flight {
                return Err(format!("job {:?}: {} launches in flight, it counts {}", job.id, mine.len(), job.in_flight));
            }
            let window = mine.iter().filter(|f| f.in_window);
            let (ahead, ahead_ns) = window.fold((0u32, 0.0), |(c, t), f| (c + 1, t + f.est_ns));
            if ahead != job.ahead_launches || (ahead_ns - job.ahead_ns).abs() > 1.0 + 1e-9 * ahead_ns {
                return Err(format!(
                    "job {:?}: {ahead} launches ({ahead_ns} ns) wait to start, its window counts {} ({} ns)",
                    job.id, job.ahead_launches, job.ahead_ns
                ));
            }
            if job.stream.is_none() {
                if job.in_flight > 0 && mine.iter().any(|f| Some(f.stream) != job.lane) {
                    return Err(format!("job {:?}: a launch in flight is off its lane {:?}", job.id, job.lane));
                }
                if job.in_flight == 0 && (job.lane.is_some() || job.draining) {
                    return Err(format!("job {:?}: holds lane {:?} with nothing in flight", job.id, job.lane));
                }
                if job.cancelled {
                    continue;
                }
                for i in 0..n {
                    let open = m.dep_list(i).filter(|&d| matches!(job.states[d as usize], LState::Pending { .. })).count() as u32;
                    if open != job.deps_open[i] {
                        return Err(format!(
                            "job {:?} launch {i}: {open} open dependencies, counted {}",
                            job.id, job.deps_open[i]
                        ));
                    }
                    let issuable = open == 0 && matches!(job.states[i], LState::Pending { .. });
                    if issuable != job.issuable.contains(&(i as u32)) {
                        return Err(format!("job {:?} launch {i}: issuable {issuable}, the set disagrees", job.id));
                    }
                }
            }
        }
        let mut refs: HashMap<JobKey, [u16; 32]> = HashMap::new();
        for f in self.in_flight.values().filter(|_| self.cfg.policy.masks_kernels()) {
            let bits = crate::occupancy::groups_of(&f.mask);
            let r = refs.entry(f.job).or_insert([0; 32]);
            (0..32).filter(|g| bits & (1 << g) != 0).for_each(|g| r[g] += 1);
        }
        let mut groups = vec![0u32; self.group_jobs.len()];
        for (key, r) in &refs {
            if self.job(*key).is_some_and(|j| j.group_refs != *r) {
                return Err(format!(
                    "job {key:?}: launches per SM group {:?}, its launches in flight make {r:?}",
                    self.job(*key).map(|j| j.group_refs)
                ));
            }
            groups.iter_mut().enumerate().filter(|(g, _)| r[*g] > 0).for_each(|(_, n)| *n += 1);
        }
        if groups != self.group_jobs {
            return Err(format!("jobs per SM group {:?}, the launches in flight make {groups:?}", self.group_jobs));
        }
        if self.occupancy.is_modelled() {
            let mut ctas = vec![0u64; self.occupancy.group_count() as usize];
            for f in self.in_flight.values() {
                for &(g, n) in &f.modelled {
                    ctas[g as usize] += n as u64;
                }
            }
            for (g, &want) in ctas.iter().enumerate() {
                let got = self.occupancy.group(g as u32).ctas;
                if got != want {
                    return Err(format!("group {g}: the mirror holds {got} CTAs, the modelled placements {want}"));
                }
            }
        }
        Ok(())
    }

    /// Rewrites the job's view after its state changed.
    fn refresh(&mut self, key: JobKey) {
        let Some(job) = self.jobs[key.slot as usize].as_mut().filter(|j| j.key == key) else { return };
        let Some(v) = job.view else { return };
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        // The issue-ahead window: a job with launches in flight is offered its next one only while
        // what waits on its lane is short of the lookahead.
        let window_open = job.in_flight == 0
            || (job.ahead_launches < self.cfg.lookahead_launches_max && job.ahead_ns < self.cfg.lookahead_ns as f64);
        // A cold start's launch whose layers are not yet on the copy engine has nothing to wait
        // for on the GPU: it is offered once their copy is queued (`residency`).
        let copy_unqueued = |i: u32| m.residency.as_ref().is_some_and(|r| r.reads_unqueued(i as usize));
        let next_ready = if job.cancelled || job.stream.is_some() || job.draining || !window_open {
            None
        } else {
            job.issuable.first().filter(|&&i| !copy_unqueued(i)).map(|&i| {
                let first_block = match job.states[i as usize] {
                    LState::Pending { first_block } => first_block,
                    s => unreachable!("issuable launch {i} is {s:?}"),
                };
                let blocks_left = m.plan.launches[i as usize].shape.logical_blocks - first_block;
                let capacity = m.capacity_ctas[i as usize];
                // Behind the lane's tail, it starts when that one ends and takes the room it
                // frees: in CTAs of this kernel's class, the tail's share of a full wave.
                let tail = job.lane_tail.filter(|_| job.in_flight > 0).and_then(|t| self.in_flight.get(&t));
                let frees_ctas = tail.map_or(0, |t| {
                    let tail_capacity = self.occupancy.capacity_ctas(t.class).max(1) as u64;
                    (t.ctas as u64 * capacity as u64 / tail_capacity) as u32
                });
                ReadyKernel {
                    launch: i,
                    first_block,
                    blocks_left,
                    ctas: blocks_left.min(capacity),
                    class: m.classes[i as usize],
                    est_ns: m.estimates.get(i) as u64,
                    behind: tail.is_some(),
                    frees_ctas,
                    realtime_lane: tail.is_none() && job.options.class == Class::RealTime,
                    right_sms: m.right_sms[i as usize],
                    lane_groups: if self.cfg.policy.masks_kernels() {
                        (0..32).filter(|&g| job.group_refs[g] > 0).fold(0, |b, g| b | 1 << g)
                    } else {
                        0
                    },
                }
            })
        };
        let ready_now = next_ready.is_some();
        let tenant_delta = ready_now as i32 - job.counted_ready as i32;
        job.counted_ready = ready_now;
        let view = &mut self.views[v];
        view.remaining_ns = job.remaining_ns.max(0.0) as u64;
        view.launches_unissued = job.unissued;
        view.in_flight = job.in_flight;
        view.next_ready = next_ready;
        view.ready_count = if ready_now { job.issuable.len() as u32 } else { 0 };
        view.stream = job.stream;
        view.last_issue_seq = job.last_issue_seq;
        view.running = if job.stream.is_some() { None } else { job.running.first().copied() };
        // Read only by policies that preempt (`reef`): a lookup per refresh the others need not pay.
        view.running_issue_seq = view
            .running
            .filter(|_| self.policy.preempts())
            .and_then(|l| match job.states[l as usize] {
                LState::Issued(id) => self.in_flight.get(&id).map(|f| f.issue_seq),
                _ => None,
            })
            .unwrap_or(0);
        view.cancelled = job.cancelled;
        let tenant = job.options.tenant;
        if tenant_delta != 0 {
            let t = &mut self.tenants[self.tenant_index[&tenant]];
            t.ready_jobs = (t.ready_jobs as i32 + tenant_delta) as u32;
        }
    }
}

/// The pool's streams (priority 0), then `realtime` high-priority ones.
fn create_streams<G: Gpu>(gpu: &mut G, pool: usize, realtime: usize) -> Result<Vec<StreamId>, kairos_gpu::GpuError> {
    let mut ids = Vec::with_capacity(pool + realtime);
    for i in 0..pool + realtime {
        ids.push(gpu.create_stream(if i < pool { 0 } else { REALTIME_STREAM_PRIORITY })?);
    }
    Ok(ids)
}

fn job_is_complete(job: &Job) -> bool {
    job.done as usize == job.states.len()
}

#[cfg(test)]
mod tests {
    use super::admission::segment_right_sms;
    use super::nest_groups;

    #[test]
    fn a_segments_right_size_is_where_its_summed_profile_keeps_its_speed() {
        use kairos_gpu::synthetic::{chain_plan, profile_with_durations};
        let plan = chain_plan("c", 3, 64);
        let mut p = profile_with_durations(&plan, &[100_000; 3], "sim", 132);
        // Kernel 1 keeps its speed from 32 SMs, kernel 2 only from 96: the pair needs 96.
        p.kernels[1].duration_by_sms = vec![(32, 100_000), (64, 100_000), (96, 100_000), (132, 100_000)];
        p.kernels[2].duration_by_sms = vec![(32, 300_000), (64, 150_000), (96, 104_000), (132, 100_000)];
        assert_eq!(segment_right_sms(Some(&p), &[8, 32, 96], 1..3, 132), 96);
        // A long kernel fast from 64 SMs dominates: at 64 SMs the sum is within 5% (kernel 2, 4% slower).
        p.kernels[1].duration_by_sms = vec![(32, 3_000_000), (64, 2_000_000), (96, 2_000_000), (132, 2_000_000)];
        p.kernels[2].duration_by_sms = vec![(32, 300_000), (64, 104_000), (96, 100_000), (132, 100_000)];
        assert_eq!(segment_right_sms(Some(&p), &[8, 32, 96], 1..3, 132), 64);
        // Without a profile, or one not measured by SM count: the widest kernel right size.
        assert_eq!(segment_right_sms(None, &[8, 32, 96], 1..3, 132), 96);
        p.kernels[2].duration_by_sms.clear();
        assert_eq!(segment_right_sms(Some(&p), &[8, 32, 40], 1..3, 132), 40);
    }

    #[test]
    fn device_groups_hold_whole_map_groups() {
        // An H200: 15 device groups of 8 SMs and one of 12; 17 map groups (16 of 8, one of 4).
        let mut h200 = vec![8; 15];
        h200.push(12);
        let nested = nest_groups(&h200, 132);
        assert_eq!(nested.len(), 16);
        assert!((0..15).all(|d| nested[d] == 1 << d));
        assert_eq!(nested[15], (1 << 15) | (1 << 16));
        // The same sizes as the map's: one to one.
        let mut same = vec![8; 16];
        same.push(4);
        assert_eq!(nest_groups(&same, 132), (0..17).map(|g| 1u32 << g).collect::<Vec<_>>());
        // 16-SM device groups hold two map groups each.
        let mut coarse = vec![16; 7];
        coarse.push(20);
        assert_eq!(nest_groups(&coarse, 132)[0], 0b11);
        // A map group across two device groups, or counts that disagree: no nesting.
        assert!(nest_groups(&[4, 128], 132).is_empty());
        assert!(nest_groups(&[8; 16], 132).is_empty());
        assert!(nest_groups(&[], 132).is_empty());
    }
}

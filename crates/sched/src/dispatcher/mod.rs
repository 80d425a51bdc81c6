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
use crate::policy::{Decision, GpuView, JobKey, JobView, Policy, PolicyConfig, ReadyKernel, StreamView, TenantView, View};
use crate::request::*;
use crate::*;
use kairos_gpu::exec::{SpaceBases, input_bytes, upload_weights};
use kairos_gpu::{
    Allocation, DevicePtr, Gpu, GpuEvent, HostMapping, HostMappingId, HostMemory, LaunchId, LaunchRequest, MemKind, PartitionId,
    SmMask, StreamId,
};
use kairos_ir::Tensor;
use kairos_ir::plan::Plan;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

mod admission;
mod events;
mod fairness;
mod issue;

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
    /// Lookahead per job: launches of one job that may wait on a stream behind the job's launch
    /// running there (0: none). A launch whose unfinished dependencies are all on that stream's
    /// chain is issued behind its tail, so it starts when they end instead of a notification round
    /// trip later (see [`ReadyKernel::behind`]); the protocol's stream gate stops it before it
    /// runs if a launch ahead of it stops early.
    pub chain_depth_max: u32,
    /// Streams in the pool; `None` takes the device's hardware queue count, at least
    /// [`STREAM_COUNT_DEFAULT_MIN`] (streams beyond the hardware queues share them, which costs
    /// kernel-level dispatch nothing: its launches never wait on their own stream).
    pub stream_count: Option<u32>,
    /// Requests held by the dispatcher (waiting for a slot or admitted).
    pub jobs_max: usize,
    /// I/O slots (in-flight requests) per model.
    pub slots_per_model_max: usize,
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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: PolicyConfig::by_name("paella").unwrap(),
            headroom_ctas: 132,
            chain_depth_max: CHAIN_DEPTH_DEFAULT,
            stream_count: None,
            jobs_max: 4096,
            slots_per_model_max: 64,
            models_max: 64,
            tenants_max: 1024,
            launches_in_flight_max: 8192,
            decisions_per_round_max: 1024,
            roofline_flops_per_s_f32: 30e12,
            roofline_flops_per_s_f16: 60e12,
            launch_overhead_ns: 3000.0,
            estimate_window: 32,
            trace_max: 0,
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
        if self.chain_depth_max > CHAIN_DEPTH_MAX {
            return Err(Error::InvalidInput(format!(
                "chain_depth_max = {} must be at most {CHAIN_DEPTH_MAX}",
                self.chain_depth_max
            )));
        }
        if let Some(s) = self.stream_count {
            check("stream_count", s as u64, STREAMS_MAX as u64)?;
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
    pub at_ns: u64,
    pub request: RequestId,
    pub tenant: TenantId,
    pub launch: u32,
    pub gpu_launch: LaunchId,
    pub stream: u32,
    pub first_block: u32,
    pub ctas: u32,
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LState {
    Waiting,
    Ready { first_block: u32 },
    Issued(LaunchId),
    Done,
}

struct IoSlot {
    allocations: Vec<Allocation>,
    bases: SpaceBases,
}

/// A host mapping the dispatcher made for zero-copy requests.
struct HostMap {
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
    weights: Allocation,
    dependents: Vec<Vec<u32>>,
    dep_counts: Vec<u32>,
    classes: Vec<ResourceClass>,
    /// One wave of CTAs of each launch's class.
    capacity_ctas: Vec<u32>,
    estimates: Estimates,
    slots_free: Vec<IoSlot>,
    slots_total: usize,
    waiting: VecDeque<JobKey>,
    /// Jobs of this model in the dispatcher (waiting or admitted).
    jobs: usize,
    unloading: bool,
}

struct Job {
    key: JobKey,
    id: RequestId,
    model: usize,
    options: RequestOptions,
    arrival_ns: u64,
    admitted_ns: u64,
    first_issue_ns: Option<u64>,
    /// Input bytes held until the job gets a slot.
    inputs: Vec<Vec<u8>>,
    slot: Option<IoSlot>,
    /// Zero-copy I/O, and the slot's bases with it applied (set when admitted).
    bound: Option<Bound>,
    bound_bases: Option<SpaceBases>,
    states: Vec<LState>,
    deps_left: Vec<u32>,
    ready: BinaryHeap<Reverse<u32>>,
    /// Launches in flight that no one asked to stop.
    running: BTreeSet<u32>,
    /// A launch that may go behind the tail of a chain holding all its unfinished dependencies:
    /// (launch, stream, tail).
    chainable: Option<(u32, u32, LaunchId)>,
    /// Launches of this job in flight behind another one on its stream (not started).
    queued: u32,
    /// Launches of this job issued behind another one (for [`Timing::chained`]).
    chained: u32,
    unissued: u32,
    in_flight: u32,
    done: u32,
    cancelled: bool,
    error: Option<Error>,
    /// Index in `views` while admitted.
    view: Option<usize>,
    stream: Option<u32>,
    remaining_ns: f64,
    total_ns: f64,
    seq: u64,
    last_issue_seq: u64,
    counted_ready: bool,
    /// `AlmostDone` was queued for this job.
    notified: bool,
}

struct InFlight {
    job: JobKey,
    launch: u32,
    class: ResourceClass,
    unplaced: u32,
    live: u32,
    blocks: u64,
    first_block: u32,
    issued_ns: u64,
    first_placed_ns: Option<u64>,
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
}

/// The dispatcher over one GPU. See the module docs.
pub struct Dispatcher<G: Gpu> {
    gpu: G,
    cfg: Config,
    policy: Box<dyn Policy>,
    whole: SmMask,
    rates: RooflineRates,
    occupancy: Occupancy,
    models: Vec<Option<Model>>,
    model_names: HashMap<String, usize>,
    jobs: Vec<Option<Job>>,
    free_slots: Vec<u32>,
    generation: u32,
    job_count: usize,
    by_id: HashMap<RequestId, JobKey>,
    views: Vec<JobView>,
    tenants: Vec<TenantView>,
    tenant_index: HashMap<TenantId, usize>,
    stream_ids: Vec<StreamId>,
    streams: Vec<StreamView>,
    /// Per stream, when its last launch ended (device clock as events report it): a launch that
    /// started early behind it (an overlapped launch) ran from then on.
    stream_last_done_ns: Vec<u64>,
    idle_streams: u32,
    /// Hardware queues the pool's streams share (stream s uses queue s mod this, as CUDA and the
    /// simulator assign streams to queues round robin), and per queue the launches waiting at
    /// its head behind a dependency: a kernel issued there would wait behind them.
    hw_queues: usize,
    blocked_queues: Vec<u32>,
    stream_cursor: usize,
    in_flight: HashMap<LaunchId, InFlight>,
    pending_ctas: u64,
    admit_seq: u64,
    issue_seq: u64,
    now_ns: u64,
    events: Vec<GpuEvent>,
    args: Vec<kairos_gpu::DevicePtr>,
    stats: DispatcherStats,
    trace: Vec<IssueRecord>,
    /// `AlmostDone` notices waiting for the next `dispatch` to hand them out (at most one per job).
    almost_done: Vec<RequestId>,
    host_maps: HashMap<HostMappingId, HostMap>,
    shutting_down: bool,
    shut_down: bool,
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
        let mut stream_ids = Vec::with_capacity(stream_count as usize);
        for _ in 0..stream_count {
            stream_ids.push(gpu.create_stream(0)?);
        }
        let rates = RooflineRates {
            flops_per_s_f32: cfg.roofline_flops_per_s_f32,
            flops_per_s_f16: cfg.roofline_flops_per_s_f16,
            mem_bytes_per_s: info.device_mem_bytes_per_s,
            launch_overhead_ns: cfg.launch_overhead_ns,
            sm_count: info.sm_count,
        };
        Ok(Dispatcher {
            policy,
            whole: info.partitions[0].sms,
            rates,
            occupancy: Occupancy::new(info.sm_count, info.sm_limits),
            models: Vec::new(),
            model_names: HashMap::new(),
            jobs: Vec::new(),
            free_slots: Vec::new(),
            generation: 0,
            job_count: 0,
            by_id: HashMap::new(),
            views: Vec::new(),
            tenants: Vec::new(),
            tenant_index: HashMap::new(),
            streams: vec![StreamView::default(); stream_ids.len()],
            stream_last_done_ns: vec![0; stream_ids.len()],
            idle_streams: stream_ids.len() as u32,
            hw_queues: info.hardware_queues.max(1) as usize,
            blocked_queues: vec![0; info.hardware_queues.max(1) as usize],
            stream_ids,
            stream_cursor: 0,
            in_flight: HashMap::new(),
            pending_ctas: 0,
            admit_seq: 0,
            issue_seq: 0,
            now_ns: gpu.now_ns(),
            events: Vec::new(),
            args: Vec::new(),
            stats: DispatcherStats::default(),
            trace: Vec::new(),
            almost_done: Vec::new(),
            host_maps: HashMap::new(),
            shutting_down: false,
            shut_down: false,
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
        for (id, _) in self.host_maps.drain() {
            let _ = self.gpu.unmap_host(id);
        }
        // Streams are a bounded resource of the backend (1024 on CUDA): a GPU reused for run
        // after run must get them back.
        for s in self.stream_ids.drain(..) {
            let _ = self.gpu.destroy_stream(s);
        }
        self.gpu
    }

    /// The view policies read.
    pub fn view(&self) -> View<'_> {
        View {
            now_ns: self.now_ns,
            jobs: &self.views,
            tenants: &self.tenants,
            gpu: GpuView {
                occupancy: &self.occupancy,
                pending_ctas: self.pending_ctas,
                headroom_ctas: self.cfg.headroom_ctas,
                launches_in_flight: self.in_flight.len() as u32,
                launches_in_flight_max: self.cfg.launches_in_flight_max,
                streams: &self.streams,
                idle_streams: self.available_streams(),
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

    /// The host mappings held (zero-copy I/O regions).
    // ---------------------------------------------------------------- bookkeeping

    fn job(&self, key: JobKey) -> Option<&Job> {
        self.jobs.get(key.slot as usize)?.as_ref().filter(|j| j.key == key)
    }

    fn job_mut(&mut self, key: JobKey) -> Option<&mut Job> {
        self.jobs.get_mut(key.slot as usize)?.as_mut().filter(|j| j.key == key)
    }

    /// Rewrites the job's view after its state changed.
    fn refresh(&mut self, key: JobKey) {
        let Some(job) = self.jobs[key.slot as usize].as_mut().filter(|j| j.key == key) else { return };
        let Some(v) = job.view else { return };
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let next_ready = if job.cancelled || job.stream.is_some() {
            None
        } else {
            job.ready
                .peek()
                .map(|&Reverse(i)| {
                    let first_block = match job.states[i as usize] {
                        LState::Ready { first_block } => first_block,
                        s => unreachable!("launch {i} in the ready heap is {s:?}"),
                    };
                    let blocks_left = m.plan.launches[i as usize].shape.logical_blocks - first_block;
                    ReadyKernel {
                        launch: i,
                        first_block,
                        blocks_left,
                        ctas: blocks_left.min(m.capacity_ctas[i as usize]),
                        class: m.classes[i as usize],
                        est_ns: m.estimates.get(i) as u64,
                        behind: false,
                    }
                })
                .or_else(|| {
                    job.chainable.map(|(i, _, _)| {
                        let blocks = m.plan.launches[i as usize].shape.logical_blocks;
                        ReadyKernel {
                            launch: i,
                            first_block: 0,
                            blocks_left: blocks,
                            ctas: blocks.min(m.capacity_ctas[i as usize]),
                            class: m.classes[i as usize],
                            est_ns: m.estimates.get(i) as u64,
                            behind: true,
                        }
                    })
                })
        };
        let ready_now = next_ready.is_some();
        let tenant_delta = ready_now as i32 - job.counted_ready as i32;
        job.counted_ready = ready_now;
        let view = &mut self.views[v];
        view.remaining_ns = job.remaining_ns as u64;
        view.launches_unissued = job.unissued;
        view.in_flight = job.in_flight;
        view.next_ready = next_ready;
        view.ready_count = if next_ready.is_some() { job.ready.len() as u32 } else { 0 };
        view.stream = job.stream;
        view.last_issue_seq = job.last_issue_seq;
        view.running = if job.stream.is_some() { None } else { job.running.first().copied() };
        view.cancelled = job.cancelled;
        let tenant = job.options.tenant;
        if tenant_delta != 0 {
            let t = &mut self.tenants[self.tenant_index[&tenant]];
            t.ready_jobs = (t.ready_jobs as i32 + tenant_delta) as u32;
        }
    }
}

fn job_is_complete(job: &Job) -> bool {
    job.done as usize == job.states.len()
}

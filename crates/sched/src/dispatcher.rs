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
    pub fn host_mappings(&self) -> usize {
        self.host_maps.len()
    }

    fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping, Error> {
        if self.shutting_down {
            return Err(Error::ShuttingDown);
        }
        if self.host_maps.len() >= HOST_MAPPINGS_MAX {
            return Err(Error::Overloaded { what: "host mappings", max: HOST_MAPPINGS_MAX as u64 });
        }
        let mapping = self.gpu.map_host(memory)?;
        self.host_maps.insert(mapping.id, HostMap { mapping, jobs: 0, closing: false });
        Ok(mapping)
    }

    fn unmap_host(&mut self, id: HostMappingId, out: &mut Vec<Output>) {
        let result = match self.host_maps.get_mut(&id) {
            None => Err(Error::InvalidInput(format!("host mapping {} is not mapped", id.0))),
            Some(h) if h.closing => Err(Error::InvalidInput(format!("host mapping {} is already being unmapped", id.0))),
            Some(h) => {
                h.closing = true;
                self.maybe_unmap(id, out);
                return;
            }
        };
        out.push(Output::HostUnmapped { id, result });
    }

    /// Unmaps a closing mapping once no job uses it.
    fn maybe_unmap(&mut self, id: HostMappingId, out: &mut Vec<Output>) {
        if !self.host_maps.get(&id).is_some_and(|h| h.closing && h.jobs == 0) {
            return;
        }
        self.host_maps.remove(&id);
        let result = self.gpu.unmap_host(id).map_err(Error::from);
        out.push(Output::HostUnmapped { id, result });
    }

    /// Checks a binding against the plan and the mapping; the device addresses it names.
    fn bind(&self, plan: &Plan, r: &Request, b: &IoBinding) -> Result<Bound, Error> {
        let h = match self.host_maps.get(&b.mapping) {
            Some(h) if !h.closing => &h.mapping,
            Some(_) => return Err(Error::InvalidInput(format!("host mapping {} is being unmapped", b.mapping.0))),
            None => return Err(Error::InvalidInput(format!("host mapping {} is not mapped", b.mapping.0))),
        };
        if r.options.skip_io {
            return Err(Error::InvalidInput("skip_io and I/O bound to a host mapping exclude each other".into()));
        }
        let spans = |what: &str, spans: &[MappedSpan], tensors: &[kairos_ir::plan::IoTensor]| -> Result<Vec<DevicePtr>, Error> {
            if spans.is_empty() {
                return Ok(Vec::new());
            }
            if spans.len() != tensors.len() {
                return Err(Error::InvalidInput(format!(
                    "model '{}' has {} {what}s, the binding names {}",
                    r.model,
                    tensors.len(),
                    spans.len()
                )));
            }
            let mut ptrs = Vec::with_capacity(spans.len());
            for (s, t) in spans.iter().zip(tensors) {
                if s.len_bytes != t.len_bytes() {
                    return Err(Error::InvalidInput(format!(
                        "{what} '{}' takes {} bytes, its span holds {}",
                        t.name,
                        t.len_bytes(),
                        s.len_bytes
                    )));
                }
                if s.offset_bytes.checked_add(s.len_bytes).is_none_or(|end| end > h.bytes) {
                    return Err(Error::InvalidInput(format!(
                        "{what} '{}': bytes {}..{} are outside the mapping of {} bytes",
                        t.name,
                        s.offset_bytes,
                        s.offset_bytes as u128 + s.len_bytes as u128,
                        h.bytes
                    )));
                }
                let p = h.ptr.offset(s.offset_bytes);
                if !p.0.is_multiple_of(h.align_bytes.max(1)) {
                    return Err(Error::InvalidInput(format!(
                        "{what} '{}' at offset {} is not aligned to the {} bytes the GPU's kernels need",
                        t.name, s.offset_bytes, h.align_bytes
                    )));
                }
                ptrs.push(p);
            }
            Ok(ptrs)
        };
        let inputs = spans("input", &b.inputs, &plan.inputs)?;
        let outputs = spans("output", &b.outputs, &plan.outputs)?;
        if !inputs.is_empty() && !r.inputs.is_empty() {
            return Err(Error::InvalidInput("inputs are bound to a host mapping and given as tensors too".into()));
        }
        for (i, o) in b.outputs.iter().enumerate() {
            if let Some(j) = b.outputs[..i].iter().position(|p| o.overlaps(p)) {
                return Err(Error::InvalidInput(format!("outputs {j} and {i} overlap in the host mapping")));
            }
            if let Some(j) = b.inputs.iter().position(|p| o.overlaps(p)) {
                return Err(Error::InvalidInput(format!("output {i} overlaps input {j} in the host mapping")));
            }
        }
        Ok(Bound { mapping: b.mapping, inputs, outputs })
    }

    fn load_model(&mut self, spec: ModelSpec) -> Result<ModelInfo, Error> {
        if self.shutting_down {
            return Err(Error::ShuttingDown);
        }
        if self.model_names.contains_key(&spec.name) {
            return Err(Error::ModelExists(spec.name));
        }
        let live = self.models.iter().filter(|m| m.is_some()).count();
        if live >= self.cfg.models_max {
            return Err(Error::Overloaded { what: "models", max: self.cfg.models_max as u64 });
        }
        let plan = spec.plan;
        plan.validate().map_err(|e| Error::InvalidModel(format!("{}: {e}", spec.name)))?;
        if plan.launches.len() > LAUNCHES_PER_PLAN_MAX {
            return Err(Error::InvalidModel(format!(
                "{}: {} launches exceed {LAUNCHES_PER_PLAN_MAX}",
                spec.name,
                plan.launches.len()
            )));
        }
        let mut classes = Vec::with_capacity(plan.launches.len());
        let mut capacity_ctas = Vec::with_capacity(plan.launches.len());
        for (i, l) in plan.launches.iter().enumerate() {
            let res = self.gpu.kernel_resources(&l.kernel, l.dtype, &l.shape)?;
            let class = self.occupancy.intern(res).ok_or_else(|| {
                Error::InvalidModel(format!("{}: launch {i} ({}) cannot be placed: {res:?}", spec.name, l.name))
            })?;
            classes.push(class);
            capacity_ctas.push(self.occupancy.capacity_ctas(class).max(1));
        }
        let mut dependents = vec![Vec::new(); plan.launches.len()];
        let mut dep_counts = vec![0u32; plan.launches.len()];
        for (i, l) in plan.launches.iter().enumerate() {
            let mut deps = l.deps.clone();
            deps.sort_unstable();
            deps.dedup();
            dep_counts[i] = deps.len() as u32;
            for d in deps {
                dependents[d as usize].push(i as u32);
            }
        }
        let default_ctas: Vec<u32> =
            plan.launches.iter().zip(&capacity_ctas).map(|(l, &c)| l.shape.logical_blocks.min(c)).collect();
        let estimates = Estimates::new(&plan, spec.profile.as_ref(), &self.rates, &default_ctas, self.cfg.estimate_window);
        let weights = upload_weights(&mut self.gpu, &plan, MemKind::Device)?;
        let info = ModelInfo {
            name: spec.name.clone(),
            launches: plan.launches.len() as u32,
            weight_bytes: plan.weight_bytes,
            arena_bytes: plan.arena_bytes,
            estimated_ns: estimates.total_ns() as u64,
            estimate_source: estimates.source(),
        };
        let model = Model {
            name: spec.name.clone(),
            plan,
            weights,
            dependents,
            dep_counts,
            classes,
            capacity_ctas,
            estimates,
            slots_free: Vec::new(),
            slots_total: 0,
            waiting: VecDeque::new(),
            jobs: 0,
            unloading: false,
        };
        let index = match self.models.iter().position(|m| m.is_none()) {
            Some(i) => {
                self.models[i] = Some(model);
                i
            }
            None => {
                self.models.push(Some(model));
                self.models.len() - 1
            }
        };
        self.model_names.insert(spec.name, index);
        Ok(info)
    }

    fn unload_model(&mut self, name: String, out: &mut Vec<Output>) {
        let Some(&index) = self.model_names.get(&name) else {
            out.push(Output::ModelUnloaded { name: name.clone(), result: Err(Error::UnknownModel(name)) });
            return;
        };
        let m = self.models[index].as_mut().expect("named model exists");
        if m.unloading {
            out.push(Output::ModelUnloaded { name: name.clone(), result: Err(Error::ModelUnloading(name)) });
            return;
        }
        m.unloading = true;
        self.maybe_free_model(index, out);
    }

    fn maybe_free_model(&mut self, index: usize, out: &mut Vec<Output>) {
        let Some(m) = self.models[index].as_ref() else { return };
        if !m.unloading || m.jobs > 0 {
            return;
        }
        let m = self.models[index].take().expect("checked above");
        self.model_names.remove(&m.name);
        let name = m.name.clone();
        free_model(&mut self.gpu, m);
        out.push(Output::ModelUnloaded { name, result: Ok(()) });
    }

    fn shutdown(&mut self, out: &mut Vec<Output>) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        let ids: Vec<(u64, RequestId)> = self.jobs.iter().flatten().map(|j| (j.seq, j.id)).collect();
        let mut ids = ids;
        ids.sort();
        for (_, id) in ids {
            self.cancel(id, Error::ShuttingDown, out);
        }
        self.maybe_finish_shutdown(out);
    }

    fn maybe_finish_shutdown(&mut self, out: &mut Vec<Output>) {
        if !self.shutting_down || self.shut_down || self.job_count > 0 {
            return;
        }
        for index in 0..self.models.len() {
            if let Some(m) = self.models[index].take() {
                self.model_names.remove(&m.name);
                free_model(&mut self.gpu, m);
            }
        }
        let mut ids: Vec<HostMappingId> = self.host_maps.keys().copied().collect();
        ids.sort();
        for id in ids {
            self.host_maps.remove(&id);
            let result = self.gpu.unmap_host(id).map_err(Error::from);
            out.push(Output::HostUnmapped { id, result });
        }
        self.shut_down = true;
        out.push(Output::ShutDown);
    }

    fn reject(&mut self, id: RequestId, e: Error, out: &mut Vec<Output>) {
        self.stats.rejected += 1;
        out.push(Output::Done { id, result: Err(e) });
    }

    fn submit(&mut self, r: Request, binding: Option<IoBinding>, out: &mut Vec<Output>) {
        self.stats.submitted += 1;
        if self.shutting_down {
            return self.reject(r.id, Error::ShuttingDown, out);
        }
        let Some(&model) = self.model_names.get(&r.model) else {
            return self.reject(r.id, Error::UnknownModel(r.model), out);
        };
        let m = self.models[model].as_ref().expect("named model exists");
        if m.unloading {
            return self.reject(r.id, Error::ModelUnloading(r.model), out);
        }
        if self.by_id.contains_key(&r.id) {
            return self.reject(r.id, Error::InvalidInput(format!("request id {} is already in use", r.id.0)), out);
        }
        if self.job_count >= self.cfg.jobs_max {
            return self.reject(r.id, Error::Overloaded { what: "dispatcher jobs", max: self.cfg.jobs_max as u64 }, out);
        }
        if !self.tenant_index.contains_key(&r.options.tenant) && self.tenants.len() >= self.cfg.tenants_max {
            return self.reject(r.id, Error::Overloaded { what: "tenants", max: self.cfg.tenants_max as u64 }, out);
        }
        let bound = match binding.map(|b| self.bind(&m.plan, &r, &b)).transpose() {
            Ok(b) => b,
            Err(e) => return self.reject(r.id, e, out),
        };
        let mut inputs = Vec::new();
        if !r.options.skip_io && bound.as_ref().is_none_or(|b| b.inputs.is_empty()) {
            if r.inputs.len() != m.plan.inputs.len() {
                let e = Error::InvalidInput(format!(
                    "model '{}' takes {} inputs, got {}",
                    r.model,
                    m.plan.inputs.len(),
                    r.inputs.len()
                ));
                return self.reject(r.id, e, out);
            }
            for (i, t) in r.inputs.iter().enumerate() {
                match input_bytes(&m.plan, i, t) {
                    Ok(b) => inputs.push(b),
                    Err(kairos_gpu::GpuError::Invalid(e)) => return self.reject(r.id, Error::InvalidInput(e), out),
                    Err(e) => return self.reject(r.id, Error::InvalidInput(e.to_string()), out),
                }
            }
        }
        let n = m.plan.launches.len();
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.jobs.push(None);
                (self.jobs.len() - 1) as u32
            }
        };
        self.generation = self.generation.wrapping_add(1);
        let key = JobKey { slot, generation: self.generation };
        let arrival_ns = r.arrival_ns.unwrap_or(self.now_ns);
        let job = Job {
            key,
            id: r.id,
            model,
            options: r.options,
            arrival_ns,
            admitted_ns: 0,
            first_issue_ns: None,
            inputs,
            slot: None,
            bound,
            bound_bases: None,
            states: vec![LState::Waiting; n],
            deps_left: Vec::new(),
            ready: BinaryHeap::new(),
            running: BTreeSet::new(),
            chainable: None,
            queued: 0,
            chained: 0,
            unissued: n as u32,
            in_flight: 0,
            done: 0,
            cancelled: false,
            error: None,
            view: None,
            stream: None,
            remaining_ns: 0.0,
            total_ns: 0.0,
            seq: 0,
            last_issue_seq: 0,
            counted_ready: false,
            notified: false,
        };
        let tenant = job.options.tenant;
        if let Some(b) = &job.bound {
            self.host_maps.get_mut(&b.mapping).expect("bound to a live mapping").jobs += 1;
        }
        self.jobs[slot as usize] = Some(job);
        self.by_id.insert(r.id, key);
        self.job_count += 1;
        self.tenant_add(tenant);
        let m = self.models[model].as_mut().expect("named model exists");
        m.jobs += 1;
        m.waiting.push_back(key);
        self.admit_waiting(model, out);
    }

    /// Gives free (or new, up to the limit) slots to the model's waiting jobs, in FIFO order.
    fn admit_waiting(&mut self, model: usize, out: &mut Vec<Output>) {
        loop {
            let m = self.models[model].as_mut().expect("model of a job exists");
            let Some(&key) = m.waiting.front() else { return };
            let slot = match m.slots_free.pop() {
                Some(s) => s,
                None if m.slots_total < self.cfg.slots_per_model_max => match new_slot(&mut self.gpu, &m.plan, m.weights.ptr) {
                    Ok(s) => {
                        m.slots_total += 1;
                        s
                    }
                    // Out of memory with slots still out: the next completion frees one.
                    Err(_) if m.slots_total > 0 => return,
                    Err(e) => {
                        m.waiting.pop_front();
                        self.finish(key, Some(e), out);
                        continue;
                    }
                },
                None => return,
            };
            m.waiting.pop_front();
            self.admit(key, slot, out);
        }
    }

    fn admit(&mut self, key: JobKey, slot: IoSlot, out: &mut Vec<Output>) {
        let now = self.now_ns;
        let job = self.jobs[key.slot as usize].as_mut().expect("waiting job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        // Inputs go in before any kernel can read them.
        let mut write_error = None;
        for (i, bytes) in job.inputs.drain(..).enumerate() {
            if let Err(e) = self.gpu.write(slot.bases.inputs[i], &bytes) {
                write_error = Some(Error::from(e));
                break;
            }
        }
        if let Some(b) = &job.bound {
            let mut bases = slot.bases.clone();
            if !b.inputs.is_empty() {
                bases.inputs.clone_from(&b.inputs);
            }
            if !b.outputs.is_empty() {
                bases.outputs.clone_from(&b.outputs);
            }
            job.bound_bases = Some(bases);
        }
        job.slot = Some(slot);
        job.admitted_ns = now;
        job.deps_left = m.dep_counts.clone();
        for (i, &d) in job.deps_left.iter().enumerate() {
            if d == 0 {
                job.states[i] = LState::Ready { first_block: 0 };
                job.ready.push(Reverse(i as u32));
            }
        }
        job.total_ns = m.estimates.total_ns();
        job.remaining_ns = job.total_ns;
        self.admit_seq += 1;
        job.seq = self.admit_seq;
        job.view = Some(self.views.len());
        let placeholder = JobView {
            key,
            id: job.id,
            seq: job.seq,
            model: job.model as u32,
            tenant: job.options.tenant,
            class: job.options.class,
            priority: job.options.priority,
            arrival_ns: job.arrival_ns,
            deadline_at_ns: job.options.deadline_ns.map(|d| job.arrival_ns.saturating_add(d)),
            total_ns: job.total_ns as u64,
            remaining_ns: job.remaining_ns as u64,
            launches: job.states.len() as u32,
            launches_unissued: job.unissued,
            in_flight: 0,
            next_ready: None,
            ready_count: 0,
            stream: None,
            last_issue_seq: 0,
            running: None,
            cancelled: false,
        };
        self.views.push(placeholder);
        if let Some(e) = write_error {
            self.fail(key, e, out);
            return;
        }
        if job_is_complete(self.jobs[key.slot as usize].as_ref().unwrap()) {
            // A plan without launches.
            self.finish(key, None, out);
            return;
        }
        self.refresh(key);
    }

    /// Stops a job; `reason` is what it completes with once nothing of it is on the GPU.
    fn cancel(&mut self, id: RequestId, reason: Error, out: &mut Vec<Output>) {
        let Some(&key) = self.by_id.get(&id) else { return };
        self.fail(key, reason, out);
    }

    fn fail(&mut self, key: JobKey, reason: Error, out: &mut Vec<Output>) {
        let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else { return };
        if job.cancelled {
            return;
        }
        job.cancelled = true;
        if job.slot.is_none() {
            // Still waiting for a slot: nothing was issued.
            let m = self.models[job.model].as_mut().expect("model of a job exists");
            m.waiting.retain(|k| *k != key);
            self.finish(key, Some(reason), out);
            return;
        }
        if job.in_flight == 0 {
            self.finish(key, Some(reason), out);
            return;
        }
        job.error = Some(reason);
        job.running.clear();
        job.chainable = None;
        let issued: Vec<LaunchId> =
            job.states.iter().filter_map(|s| if let LState::Issued(l) = s { Some(*l) } else { None }).collect();
        for l in issued {
            // A launch that already finished is a no-op for the GPU; its LaunchDone is on the way.
            let _ = self.gpu.preempt(l);
        }
        self.refresh(key);
    }

    // ---------------------------------------------------------------- GPU events

    /// Reads the GPU's events, applies them, then runs the policy. Returns the number of events.
    pub fn poll_gpu(&mut self, out: &mut Vec<Output>) -> Result<usize, Error> {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let polled = self.gpu.poll(&mut events);
        self.now_ns = self.gpu.now_ns();
        for e in &events {
            self.on_gpu_event(*e, out);
        }
        let n = events.len();
        self.events = events;
        polled?;
        self.dispatch(out);
        Ok(n)
    }

    /// Applies one GPU event.
    pub fn on_gpu_event(&mut self, e: GpuEvent, out: &mut Vec<Output>) {
        self.stats.events += 1;
        match e {
            GpuEvent::CtasPlaced { launch, sm, ctas, at_ns } => {
                let Some(f) = self.in_flight.get_mut(&launch).filter(|f| f.report_ctas) else {
                    self.stats.notification_anomalies += 1;
                    return;
                };
                self.occupancy.place(sm, f.class, ctas);
                let placed = ctas.min(f.unplaced);
                f.unplaced -= placed;
                if f.behind.is_none() {
                    self.pending_ctas -= placed as u64;
                }
                f.live += ctas;
                f.first_placed_ns.get_or_insert(at_ns);
                if f.unplaced == 0 && f.behind.is_none() && f.ahead.is_none() {
                    let key = f.job;
                    self.mark_chainable(key);
                }
            }
            GpuEvent::CtasFinished { launch, sm, ctas, blocks, .. } => {
                let Some(f) = self.in_flight.get_mut(&launch).filter(|f| f.report_ctas) else {
                    self.stats.notification_anomalies += 1;
                    return;
                };
                self.occupancy.finish(sm, f.class, ctas);
                if f.live < ctas {
                    self.stats.notification_anomalies += 1;
                }
                f.live = f.live.saturating_sub(ctas);
                f.blocks += blocks as u64;
            }
            GpuEvent::LaunchDone { launch, next_block, preempted, at_ns } => {
                self.launch_done(launch, next_block, preempted, at_ns, out)
            }
            GpuEvent::CopyDone { .. } => {}
        }
    }

    fn launch_done(&mut self, launch: LaunchId, next_block: u32, preempted: bool, at_ns: u64, out: &mut Vec<Output>) {
        let Some(f) = self.in_flight.remove(&launch) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        let mut unqueued = 0u32;
        if f.behind.is_none() {
            self.pending_ctas -= f.unplaced as u64;
        } else {
            unqueued += 1;
            self.blocked_queues[f.stream as usize % self.hw_queues] -= 1;
            if let Some(b) = f.behind.and_then(|b| self.in_flight.get_mut(&b)) {
                // Ended before the launch it waited behind (it was stopped): nothing is behind that one now.
                b.ahead = None;
            }
        }
        if let Some(a) = f.ahead.and_then(|a| self.in_flight.get_mut(&a)) {
            // The launch behind this one may start now: its CTAs become pending, its queue moves.
            a.behind = None;
            unqueued += 1;
            self.pending_ctas += a.unplaced as u64;
            self.blocked_queues[a.stream as usize % self.hw_queues] -= 1;
        }
        if f.report_ctas && (f.live > 0 || f.blocks != next_block.saturating_sub(f.first_block) as u64) {
            self.stats.notification_anomalies += 1;
        }
        let s = f.stream as usize;
        let prev_done_ns = std::mem::replace(&mut self.stream_last_done_ns[s], at_ns);
        let was_idle = self.stream_is_idle(s);
        self.streams[s].in_flight -= 1;
        self.stream_update(s, was_idle);
        if self.in_flight.is_empty() {
            self.occupancy.resync_idle();
        }
        let Some(job) = self.jobs.get_mut(f.job.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == f.job) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        job.in_flight -= 1;
        job.queued -= unqueued;
        job.running.remove(&f.launch);
        if job.chainable.is_some_and(|c| c.2 == launch) {
            job.chainable = None;
        }
        let m = self.models[job.model].as_mut().expect("model of a job exists");
        let logical = m.plan.launches[f.launch as usize].shape.logical_blocks;
        let i = f.launch as usize;
        let mut stopped_in_stream = false;
        if next_block < logical && !job.cancelled {
            // Preempted (by a later policy) or stopped early: resume at the first block never taken.
            if !preempted {
                self.stats.notification_anomalies += 1;
            }
            job.unissued += 1;
            if job.deps_left[i] > 0 {
                // Stopped behind a dependency that was stopped too: it waits for it again.
                job.states[i] = LState::Waiting;
            } else {
                job.states[i] = LState::Ready { first_block: next_block };
            }
            if job.stream.is_none() {
                if job.deps_left[i] == 0 {
                    job.ready.push(Reverse(f.launch));
                }
            } else {
                // Later launches of a whole-job stream already ran past it: the job cannot be repaired.
                stopped_in_stream = true;
            }
        } else if next_block >= logical {
            job.states[i] = LState::Done;
            job.done += 1;
            if f.first_block == 0 && !preempted {
                // Placed early behind the launch before it on its stream: it ran from that one's end.
                let started = f.first_placed_ns.unwrap_or(f.issued_ns).max(prev_done_ns);
                m.estimates.observe(f.launch, at_ns.saturating_sub(started));
            }
            job.remaining_ns = (job.remaining_ns - m.estimates.get(f.launch)).max(0.0);
            for &d in &m.dependents[i] {
                let left = &mut job.deps_left[d as usize];
                *left -= 1;
                if *left == 0 && job.states[d as usize] == LState::Waiting {
                    job.states[d as usize] = LState::Ready { first_block: 0 };
                    if job.stream.is_none() {
                        job.ready.push(Reverse(d));
                    }
                }
            }
        } else {
            // A cancelled job's launch stopped early: its remaining blocks never run.
            job.states[i] = LState::Done;
        }
        let key = job.key;
        if stopped_in_stream {
            self.fail(
                key,
                Error::Gpu(format!("launch {i} of a whole-job stream stopped at block {next_block} of {logical}")),
                out,
            );
        } else if job.cancelled {
            if job.in_flight == 0 {
                let e = job.error.take().unwrap_or(Error::Cancelled);
                self.finish(key, Some(e), out);
            } else {
                self.refresh(key);
            }
        } else if job_is_complete(job) {
            self.finish(key, None, out);
        } else {
            // A dependency ended or the chain moved up: a launch may fit behind a chain now.
            self.mark_chainable(key);
            self.refresh(key);
        }
    }

    // ---------------------------------------------------------------- dispatch

    /// Asks the policy for decisions and applies them until it has none (or the round's limit).
    pub fn dispatch(&mut self, out: &mut Vec<Output>) {
        self.decide(out);
        out.extend(self.almost_done.drain(..).map(|id| Output::AlmostDone { id }));
    }

    fn decide(&mut self, out: &mut Vec<Output>) {
        self.now_ns = self.gpu.now_ns();
        for _ in 0..self.cfg.decisions_per_round_max {
            let decision = self.policy.decide(&self.view());
            let Some(d) = decision else { return };
            if !self.apply(d, out) {
                self.stats.refused_decisions += 1;
                return;
            }
            self.stats.decisions += 1;
        }
    }

    /// Applies one decision; false if it was invalid (nothing changed).
    fn apply(&mut self, d: Decision, out: &mut Vec<Output>) -> bool {
        match d {
            Decision::Issue { job: key, launch, ctas, sm_mask } => {
                let Some(job) = self.job(key) else { return false };
                if job.cancelled || job.stream.is_some() || job.slot.is_none() {
                    return false;
                }
                if self.in_flight.len() >= self.cfg.launches_in_flight_max as usize {
                    return false;
                }
                let chain = job.chainable.filter(|c| c.0 == launch);
                if let Some((_, stream, after)) = chain {
                    // Behind its running dependency, on that dependency's stream.
                    let after_running =
                        self.in_flight.get(&after).is_some_and(|f| f.ahead.is_none() && job.running.contains(&f.launch));
                    if job.states.get(launch as usize) != Some(&LState::Waiting) || !after_running {
                        return false;
                    }
                    let job = self.job_mut(key).unwrap();
                    job.chainable = None;
                    match self.issue(key, launch, stream, 0, ctas, sm_mask, Some(after), Some(after)) {
                        Ok(id) => {
                            self.in_flight.get_mut(&after).expect("chained behind a launch in flight").ahead = Some(id);
                            let job = self.job_mut(key).unwrap();
                            job.queued += 1;
                            job.chained += 1;
                            self.mark_chainable(key);
                        }
                        Err(e) => self.fail(key, e, out),
                    }
                    self.refresh(key);
                    return true;
                }
                let Some(LState::Ready { first_block }) = job.states.get(launch as usize).copied() else { return false };
                let Some(stream) = self.take_idle_stream() else { return false };
                let job = self.job_mut(key).unwrap();
                if job.ready.peek() == Some(&Reverse(launch)) {
                    job.ready.pop();
                } else {
                    job.ready.retain(|r| r.0 != launch);
                }
                match self.issue(key, launch, stream, first_block, ctas, sm_mask, None, None) {
                    Ok(_) => self.mark_chainable(key),
                    Err(e) => self.fail(key, e, out),
                }
                self.refresh(key);
                true
            }
            Decision::Preempt { job: key, launch } => {
                let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else {
                    return false;
                };
                let Some(LState::Issued(id)) = job.states.get(launch as usize).copied() else { return false };
                if job.stream.is_some() || !job.running.remove(&launch) {
                    return false;
                }
                // What waits behind it on its stream must not run on a partial result: stop it too.
                if job.chainable.is_some_and(|c| c.2 == id) {
                    job.chainable = None;
                }
                // Everything chained behind it goes too (the stream gate stops what has not started).
                let mut result = self.gpu.preempt(id);
                let mut ahead = self.in_flight.get(&id).and_then(|f| f.ahead);
                while let Some(a) = ahead {
                    let f = &self.in_flight[&a];
                    job.running.remove(&f.launch);
                    if job.chainable.is_some_and(|c| c.2 == a) {
                        job.chainable = None;
                    }
                    ahead = f.ahead;
                    result = result.and(self.gpu.preempt(a));
                }
                if let Err(e) = result {
                    self.fail(key, e.into(), out);
                }
                self.stats.preemptions += 1;
                self.refresh(key);
                true
            }
            Decision::IssueAll { job: key, stream } => {
                let Some(job) = self.job(key) else { return false };
                let view = job.view.map(|v| self.views[v]);
                if !view.is_some_and(|v| v.is_unstarted()) || stream as usize >= self.streams.len() {
                    return false;
                }
                let n = job.states.len();
                if !self.in_flight.is_empty() && self.in_flight.len() + n > self.cfg.launches_in_flight_max as usize {
                    return false;
                }
                let s = stream as usize;
                let was_idle = self.stream_is_idle(s);
                self.streams[s].jobs += 1;
                self.stream_update(s, was_idle);
                let job = self.job_mut(key).unwrap();
                job.stream = Some(stream);
                job.ready.clear();
                let mut result = Ok(());
                let mut previous = None;
                for i in 0..n as u32 {
                    let first_block = match self.job(key).unwrap().states[i as usize] {
                        LState::Ready { first_block } => first_block,
                        _ => 0,
                    };
                    // Each launch reads what the ones before it on the stream wrote: the stream
                    // gate stops the rest of the job if one of them stops early.
                    match self.issue(key, i, stream, first_block, None, None, None, previous) {
                        Ok(id) => previous = Some(id),
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                if let Err(e) = result {
                    self.fail(key, e, out);
                }
                self.refresh(key);
                true
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn issue(
        &mut self,
        key: JobKey,
        launch: u32,
        stream: u32,
        first_block: u32,
        ctas: Option<u32>,
        sm_mask: Option<SmMask>,
        behind: Option<LaunchId>,
        after: Option<LaunchId>,
    ) -> Result<LaunchId, Error> {
        let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let l = &m.plan.launches[launch as usize];
        let blocks_left = l.shape.logical_blocks - first_block;
        let ctas = ctas.unwrap_or(m.capacity_ctas[launch as usize]).clamp(1, blocks_left.max(1));
        let slot = job.slot.as_ref().expect("admitted job has a slot");
        job.bound_bases.as_ref().unwrap_or(&slot.bases).resolve_all(&l.args, &mut self.args);
        // A job handed whole to a stream needs only each launch's end: its order is the
        // stream's, and no policy places other work by its CTAs.
        let report_ctas = job.stream.is_none();
        let request = LaunchRequest {
            kernel: &l.kernel,
            dtype: l.dtype,
            shape: l.shape,
            args: &self.args,
            first_block,
            ctas,
            sm_mask: sm_mask.unwrap_or(self.whole),
            partition: PartitionId::WHOLE,
            stream: self.stream_ids[stream as usize],
            after,
            report_ctas,
        };
        let id = self.gpu.launch(&request)?;
        let cost = m.estimates.get(launch);
        let class = m.classes[launch as usize];
        self.stats.launches += 1;
        self.issue_seq += 1;
        job.states[launch as usize] = LState::Issued(id);
        job.unissued -= 1;
        if job.unissued == 0 && job.options.notify_before_done && !job.notified {
            job.notified = true;
            self.almost_done.push(job.id);
        }
        job.in_flight += 1;
        job.running.insert(launch);
        job.last_issue_seq = self.issue_seq;
        job.first_issue_ns.get_or_insert(self.now_ns);
        let (tenant, request_id) = (job.options.tenant, job.id);
        self.in_flight.insert(
            id,
            InFlight {
                job: key,
                launch,
                class,
                unplaced: ctas,
                live: 0,
                blocks: 0,
                first_block,
                issued_ns: self.now_ns,
                first_placed_ns: None,
                stream,
                behind,
                ahead: None,
                report_ctas,
            },
        );
        if behind.is_none() {
            self.pending_ctas += ctas as u64;
        } else {
            self.blocked_queues[stream as usize % self.hw_queues] += 1;
        }
        let s = stream as usize;
        let was_idle = self.stream_is_idle(s);
        self.streams[s].in_flight += 1;
        self.stream_update(s, was_idle);
        self.charge(tenant, cost);
        if self.cfg.trace_max > 0 {
            if self.trace.len() < self.cfg.trace_max {
                self.trace.push(IssueRecord {
                    at_ns: self.now_ns,
                    request: request_id,
                    tenant,
                    launch,
                    gpu_launch: id,
                    stream,
                    first_block,
                    ctas,
                });
            } else {
                self.stats.trace_dropped += 1;
            }
        }
        Ok(id)
    }

    /// Offers the job's next lookahead launch: behind the tail of one of its chains (a launch
    /// in flight with nothing behind it, that no one asked to stop: a running one with all CTAs
    /// placed, or one waiting itself while fewer than `chain_depth_max` of the job's launches
    /// wait), the first waiting dependent of that tail whose unfinished dependencies are all on
    /// the tail's chain.
    fn mark_chainable(&mut self, key: JobKey) {
        let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else { return };
        if job.cancelled || job.stream.is_some() || job.chainable.is_some() || job.queued >= self.cfg.chain_depth_max {
            // (A running tail with placed CTAs and no launch waiting still needs depth >= 1.)
            return;
        }
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let mut chain: Vec<u32> = Vec::new();
        for &tail in &job.running {
            let LState::Issued(tail_id) = job.states[tail as usize] else { continue };
            // Behind a running launch once all its CTAs are on SMs (then the launch behind waits
            // for nothing but it), or deeper behind one that waits itself.
            let Some(f) = self.in_flight.get(&tail_id).filter(|f| {
                f.ahead.is_none() && if f.behind.is_none() { f.unplaced == 0 } else { job.queued < self.cfg.chain_depth_max }
            }) else {
                continue;
            };
            let stream = f.stream;
            // The chain ending at `tail`: it and the launches it waits behind, all still running.
            chain.clear();
            let mut at = Some(tail_id);
            while let Some(id) = at {
                let g = &self.in_flight[&id];
                chain.push(g.launch);
                at = g.behind;
            }
            if chain.iter().any(|l| !job.running.contains(l)) {
                continue;
            }
            let next = m.dependents[tail as usize].iter().copied().find(|&d| {
                let deps = &m.plan.launches[d as usize].deps;
                let on_chain = deps.iter().enumerate().filter(|&(i, x)| chain.contains(x) && !deps[..i].contains(x)).count();
                job.states[d as usize] == LState::Waiting && job.deps_left[d as usize] as usize == on_chain
            });
            if let Some(d) = next {
                job.chainable = Some((d, stream, tail_id));
                self.refresh(key);
                return;
            }
        }
    }

    // ---------------------------------------------------------------- completion

    /// Removes a job and emits its result: `error` if given, else its outputs.
    fn finish(&mut self, key: JobKey, error: Option<Error>, out: &mut Vec<Output>) {
        let mut job = self.jobs[key.slot as usize].take().expect("finished job exists");
        self.free_slots.push(key.slot);
        self.by_id.remove(&job.id);
        self.job_count -= 1;
        if let Some(v) = job.view.take() {
            self.views.swap_remove(v);
            if let Some(moved) = self.views.get(v).map(|x| x.key) {
                self.jobs[moved.slot as usize].as_mut().expect("viewed job exists").view = Some(v);
            }
        }
        if let Some(s) = job.stream {
            let s = s as usize;
            let was_idle = self.stream_is_idle(s);
            self.streams[s].jobs -= 1;
            self.stream_update(s, was_idle);
        }
        self.tenant_remove(job.options.tenant, job.counted_ready);
        let now = self.now_ns;
        let result = match error {
            Some(e) => {
                if e == Error::Cancelled {
                    self.stats.cancelled += 1;
                } else {
                    self.stats.failed += 1;
                }
                Err(e)
            }
            None => {
                let m = self.models[job.model].as_ref().expect("model of a job exists");
                let mut outputs = Vec::new();
                let mut read_error = None;
                let outputs_bound = job.bound.as_ref().is_some_and(|b| !b.outputs.is_empty());
                if !job.options.skip_io
                    && !outputs_bound
                    && let Some(slot) = &job.slot
                {
                    for (o, ptr) in m.plan.outputs.iter().zip(&slot.bases.outputs) {
                        let mut bytes = vec![0u8; o.len_bytes() as usize];
                        if let Err(e) = self.gpu.read(*ptr, &mut bytes) {
                            read_error = Some(Error::from(e));
                            break;
                        }
                        match Tensor::from_bytes(o.dtype, o.shape.clone(), &bytes) {
                            Ok(t) => outputs.push(t),
                            Err(e) => {
                                read_error = Some(Error::Gpu(e));
                                break;
                            }
                        }
                    }
                }
                match read_error {
                    Some(e) => {
                        self.stats.failed += 1;
                        Err(e)
                    }
                    None => {
                        self.stats.completed += 1;
                        let deadline_missed = job.options.deadline_ns.is_some_and(|d| now > job.arrival_ns.saturating_add(d));
                        Ok(Response {
                            id: job.id,
                            outputs,
                            timing: Timing {
                                arrival_ns: job.arrival_ns,
                                admitted_ns: job.admitted_ns,
                                first_issue_ns: job.first_issue_ns.unwrap_or(job.admitted_ns),
                                done_ns: now,
                                launches: job.states.len() as u32,
                                chained: job.chained,
                                deadline_missed,
                            },
                        })
                    }
                }
            }
        };
        out.push(Output::Done { id: job.id, result });
        let model = job.model;
        let m = self.models[model].as_mut().expect("model of a job exists");
        m.jobs -= 1;
        if let Some(slot) = job.slot.take() {
            m.slots_free.push(slot);
        }
        if let Some(b) = job.bound.take() {
            // Nothing of the job is on the GPU any more: the mapping may go if it is closing.
            self.host_maps.get_mut(&b.mapping).expect("bound to a live mapping").jobs -= 1;
            self.maybe_unmap(b.mapping, out);
        }
        self.admit_waiting(model, out);
        self.maybe_free_model(model, out);
        self.maybe_finish_shutdown(out);
    }

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

    fn tenant_add(&mut self, tenant: TenantId) {
        match self.tenant_index.get(&tenant) {
            Some(&i) => self.tenants[i].active_jobs += 1,
            None => {
                self.tenant_index.insert(tenant, self.tenants.len());
                self.tenants.push(TenantView { tenant, active_jobs: 1, ready_jobs: 0, deficit_ns: 0.0 });
            }
        }
    }

    fn tenant_remove(&mut self, tenant: TenantId, was_ready: bool) {
        let i = self.tenant_index[&tenant];
        let t = &mut self.tenants[i];
        t.active_jobs -= 1;
        if was_ready {
            t.ready_jobs -= 1;
        }
        if t.active_jobs == 0 {
            self.tenants.swap_remove(i);
            self.tenant_index.remove(&tenant);
            if let Some(moved) = self.tenants.get(i) {
                self.tenant_index.insert(moved.tenant, i);
            }
        }
    }

    /// Deficit counters: everyone with jobs earns an equal share of `cost`, the served tenant pays it.
    fn charge(&mut self, tenant: TenantId, cost: f64) {
        let share = cost / self.tenants.len().max(1) as f64;
        for t in &mut self.tenants {
            t.deficit_ns = (t.deficit_ns + share).clamp(-DEFICIT_NS_MAX, DEFICIT_NS_MAX);
        }
        if let Some(&i) = self.tenant_index.get(&tenant) {
            let t = &mut self.tenants[i];
            t.deficit_ns = (t.deficit_ns - cost).clamp(-DEFICIT_NS_MAX, DEFICIT_NS_MAX);
        }
    }

    fn stream_is_idle(&self, s: usize) -> bool {
        self.streams[s].in_flight == 0 && self.streams[s].jobs == 0
    }

    fn stream_update(&mut self, s: usize, was_idle: bool) {
        let idle = self.stream_is_idle(s);
        if idle && !was_idle {
            self.idle_streams += 1;
        } else if !idle && was_idle {
            self.idle_streams -= 1;
        }
    }

    /// An idle stream, scanning round robin from the last one taken (spreads kernels over the
    /// hardware queues the streams map to).
    /// Idle streams whose hardware queue has no launch waiting behind a dependency.
    fn available_streams(&self) -> u32 {
        if self.blocked_queues.iter().all(|&b| b == 0) {
            return self.idle_streams;
        }
        (0..self.streams.len()).filter(|&s| self.stream_is_idle(s) && self.blocked_queues[s % self.hw_queues] == 0).count() as u32
    }

    fn take_idle_stream(&mut self) -> Option<u32> {
        if self.idle_streams == 0 {
            return None;
        }
        let n = self.streams.len();
        for k in 0..n {
            let s = (self.stream_cursor + k) % n;
            if self.stream_is_idle(s) && self.blocked_queues[s % self.hw_queues] == 0 {
                self.stream_cursor = (s + 1) % n;
                return Some(s as u32);
            }
        }
        None
    }
}

fn job_is_complete(job: &Job) -> bool {
    job.done as usize == job.states.len()
}

fn new_slot<G: Gpu>(gpu: &mut G, plan: &Plan, weights: kairos_gpu::DevicePtr) -> Result<IoSlot, Error> {
    let mut allocations = Vec::new();
    let result = (|| {
        let arena = gpu.alloc(plan.arena_bytes.max(1), MemKind::Device)?;
        allocations.push(arena);
        let mut bases = SpaceBases { arena: arena.ptr, weights, inputs: Vec::new(), outputs: Vec::new() };
        for t in &plan.inputs {
            let a = gpu.alloc(t.len_bytes().max(1), MemKind::Device)?;
            allocations.push(a);
            bases.inputs.push(a.ptr);
        }
        for t in &plan.outputs {
            let a = gpu.alloc(t.len_bytes().max(1), MemKind::Device)?;
            allocations.push(a);
            bases.outputs.push(a.ptr);
        }
        Ok::<_, kairos_gpu::GpuError>(bases)
    })();
    match result {
        Ok(bases) => Ok(IoSlot { allocations, bases }),
        Err(e) => {
            for a in allocations {
                let _ = gpu.free(a);
            }
            Err(e.into())
        }
    }
}

fn free_slot<G: Gpu>(gpu: &mut G, slot: IoSlot) {
    for a in slot.allocations {
        let _ = gpu.free(a);
    }
}

fn free_model<G: Gpu>(gpu: &mut G, m: Model) {
    for s in m.slots_free {
        free_slot(gpu, s);
    }
    let _ = gpu.free(m.weights);
}

//! [`SimGpu`]: the event loop, the SMs, the hardware queues, the compute work distributor, the copy
//! engines and the notification ring. The crate docs describe the model; this file implements it.

use crate::bandwidth::{Flow, water_level};
use crate::desc::GpuDesc;
use crate::faults::{Faults, STUCK_SLOWDOWN};
use crate::memory::{Memory, Resolved};
use crate::slab::Slab;
use crate::timing::{self, BlockModel, CtaResources, HostSplit, LaunchSpec, MeasuredKernel, TimingTable};
use crate::trace::{TraceEvent, TraceHasher};
use kairos_core::DType;
use kairos_core::plan::{Kernel, LaunchShape, Plan};
use kairos_gpu::profile::{ModelProfile, ProfileError, ProfileSet};
use kairos_gpu::*;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Most streams one simulated GPU hands out.
pub const STREAMS_MAX: usize = 4096;
/// Most commands waiting in one hardware queue (the pushbuffer); a launch beyond it is
/// [`GpuError::Exhausted`] (a real driver would block the host instead).
pub const QUEUE_DEPTH_MAX: usize = 8192;
/// Most launches issued and not yet complete.
pub const LAUNCHES_IN_FLIGHT_MAX: usize = 1 << 16;
/// Most copies issued and not yet complete.
pub const COPIES_IN_FLIGHT_MAX: usize = 1 << 12;
/// Notifications the ring holds before the host polls; overrunning it is reported by the next
/// [`Gpu::poll`] as [`GpuError::Exhausted`], never silently.
pub const NOTIFY_RING_MAX: usize = 1 << 20;
/// Most physical CTAs one launch may ask for.
pub const CTAS_PER_LAUNCH_MAX: u32 = 1 << 24;
/// Most trace events recorded (recording stops there; the hash goes on).
pub const TRACE_EVENTS_MAX: usize = 1 << 24;
/// Most host mappings (`Gpu::map_host`) alive at once.
pub const HOST_MAPPINGS_MAX: usize = 4096;
/// Alignment that arguments in a host mapping must keep: the alignment of the simulator's own
/// allocations and of cudaMalloc, which the CUDA kernels may assume.
pub const HOST_MAPPING_ALIGN_BYTES: u64 = 256;

/// Resolution of cohort grouping: block times within one bucket of e^(1/64) (1.6%) share a cohort.
const DURATION_BUCKETS_PER_E: f64 = 64.0;
/// A new cohort joins one of its launch's cohorts that ends within block time / this.
const DURATION_JOIN_DIVISOR: u64 = 64;
/// `Grid::stalled_at` of a grid whose last placement attempt left nothing unplaced, or that has not
/// tried yet.
const NOT_STALLED: u64 = u64::MAX;
/// Fixed-point unit of an SM's load (a kernel at its own occupancy fills one unit).
const LOAD_UNIT: u64 = 1 << 20;

/// Switches of one simulated GPU.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// Drives every random choice (latency and duration jitter). Same seed, same calls: same trace.
    pub seed: u64,
    /// Run the CPU reference kernels on backed memory, so results are real. Off: memory is not
    /// backed (reads return zeros) and only timing is simulated.
    pub compute: bool,
    /// Random jitter of latencies and durations; off gives the median of everything.
    pub jitter: bool,
    /// Keep a [`TraceEvent`] log (the trace hash is kept either way).
    pub record_trace: bool,
    /// Check the model's invariants after every step (slow; for tests).
    pub check_invariants: bool,
    /// Faults to inject (none by default; see [`Faults`]).
    pub faults: Faults,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions { seed: 0, compute: true, jitter: true, record_trace: false, check_invariants: false, faults: Faults::none() }
    }
}

impl SimOptions {
    /// Timing only: no backed memory, no CPU kernels (for large benchmarks).
    pub fn timing_only(seed: u64) -> SimOptions {
        SimOptions { seed, compute: false, ..SimOptions::default() }
    }
}

/// Counters of what the simulator did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    pub launches: u64,
    pub copies: u64,
    /// Notifications handed to the host by `poll`.
    pub events_delivered: u64,
    /// Internal events processed by the event loop.
    pub steps: u64,
    /// Logical blocks executed.
    pub blocks: u64,
    /// CTAs placed (working and idle).
    pub ctas_placed: u64,
    /// Faults injected (see [`Faults`]) and resets ([`Gpu::reset`]).
    pub faults_injected: u64,
    pub resets: u64,
}

/// Occupancy of one SM at the current instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmUsage {
    pub threads: u32,
    pub registers: u32,
    pub shared_mem_bytes: u32,
    pub ctas: u32,
}

#[derive(Clone, Copy, Debug, Default)]
struct Sm {
    use_: SmUsage,
    load: u64,
    /// Value of the GPU's release counter at this SM's last release of CTAs.
    release_seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CtaCost {
    threads: u32,
    registers: u32,
    shared_mem_bytes: u32,
    load: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GridState {
    Queued,
    Dispatching,
    InCwd,
    Finished,
}

struct Grid {
    id: LaunchId,
    kernel: Kernel,
    dtype: DType,
    args: Vec<Resolved>,
    stream: u32,
    priority: i32,
    partition: u32,
    partition_sms: SmMask,
    /// SM mask within the partition.
    mask: SmMask,
    cost: CtaCost,
    first_block: u32,
    end_block: u32,
    /// First logical block not yet taken.
    next_block: u32,
    ctas_unplaced: u32,
    ctas_live: u32,
    /// CtasPlaced / CtasFinished events are sent (LaunchRequest::report_ctas).
    report_ctas: bool,
    /// LaunchStarted is sent when its first block is taken (LaunchRequest::report_start).
    report_start: bool,
    /// Its LaunchDone waits for the end of a later launch of its stream that reports its own
    /// (LaunchRequest::report_end false on a launch nothing else is asked of), as on CUDA.
    silent: bool,
    ctas_working: u32,
    model: BlockModel,
    /// Completion tail after the last CTA leaves (calibrated from the model's profile).
    tail_ns: u64,
    /// The last CTA left and the tail is running.
    in_tail: bool,
    jitter: f64,
    /// The host raised the launch's preempt flag (a store to mapped host memory, or a stream
    /// write to device memory that lands at `flag_at_ns`).
    host_flag: bool,
    /// When the raised flag is there to be read.
    flag_at_ns: u64,
    /// When the CTAs' last read of the host flag was claimed (0: the clock has not started).
    last_poll_ns: u64,
    /// When the launch's stop bit is visible to takes (a poll found the host flag set).
    stop_ns: Option<u64>,
    state: GridState,
    cwd_seq: u64,
    in_running: bool,
    /// The GPU's release counter when a placement attempt last left CTAs unplaced
    /// (`NOT_STALLED` otherwise).
    stalled_at: u64,
    /// The last CTA ran the blocks left outside the mask (see `rescue`).
    rescued: bool,
    /// End times of this launch's working cohorts (one cohort per end time).
    cohort_ends: BTreeMap<u64, u32>,
    /// Issued `after` the launch before it on its stream: the stream gate applies.
    gated: bool,
    /// The stop word it obeys (`LaunchRequest::stop_word`).
    stop_word: Option<u32>,
    /// The backend clears its stop word, in stream order, as it leaves its queue.
    clears_stop_word: bool,
    /// Which replay of a recorded run issued it (`None`: the host launched it itself).
    replay: Option<u64>,
}

/// A stop word ([`Gpu::create_stop_word`]) as the simulator keeps it.
#[derive(Clone, Copy, Debug, Default)]
struct StopWord {
    /// When a raise landed or lands (None: lowered).
    raised_at_ns: Option<u64>,
    /// Raised since the last clear was queued: the next launch that carries it clears it first.
    needs_clear: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Member {
    sm: u32,
    ctas: u32,
    /// Logical blocks each of these CTAs finished so far.
    iters: u32,
}

/// CTAs of one launch that move in lockstep: placed together, on SMs where a block takes the same
/// time, so one event ends a block on all of them.
struct Cohort {
    grid: u32,
    idle: bool,
    members: Vec<Member>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    H2D = 0,
    D2H = 1,
    D2D = 2,
}

struct CopyOp {
    id: CopyId,
    dst: Resolved,
    src: Resolved,
    bytes: u64,
    stream: u32,
    dir: Dir,
    active: bool,
    done_bytes: f64,
    rate: f64,
    last_ns: u64,
    generation: u64,
}

/// A simulated secondary GPU for parallel transmission: its PCIe link and its forward link to
/// this GPU, each busy until the end of its last piece, and its staging ring (per slot, when the
/// forward of the piece in it ends).
struct SimPeer {
    path: PeerPath,
    h2d_free_ns: u64,
    forward_free_ns: u64,
    slot_free_ns: Vec<u64>,
    next_slot: usize,
}

impl CopyOp {
    /// A copy not started yet.
    fn new(id: CopyId, dst: Resolved, src: Resolved, bytes: u64, stream: u32, dir: Dir) -> CopyOp {
        CopyOp { id, dst, src, bytes, stream, dir, active: false, done_bytes: 0.0, rate: 0.0, last_ns: 0, generation: 0 }
    }
}

#[derive(Default)]
struct Engine {
    fifo: VecDeque<u32>,
    active: Option<u32>,
}

#[derive(Clone, Copy, Debug)]
enum Cmd {
    Kernel(u32),
    Copy(u32),
    /// `Gpu::wait_copy`: the stream goes on once the copy has ended.
    WaitCopy(CopyId),
}

struct QueuedCmd {
    arrive_ns: u64,
    stream: u32,
    cmd: Cmd,
}

#[derive(Default)]
struct HwQueue {
    cmds: VecDeque<QueuedCmd>,
    last_arrive_ns: u64,
}

struct Stream {
    /// False once destroyed (the id is retired; commands queued before still complete).
    alive: bool,
    priority: i32,
    queue: u32,
    /// A command of this stream left its queue and is not complete.
    busy: bool,
    /// The protocol's stream gate: the last launch of this stream that ran stopped early, so the
    /// next one gated after it stops before running any block (protocol.cuh, "Stream gate").
    gate_closed: bool,
    /// The last launch issued on the stream (what `LaunchRequest::after` must name).
    last_launch: Option<LaunchId>,
    /// Ends of silent launches, reported with the next end of a launch that reports its own.
    /// (launch, next block, preempted, its stop word).
    silent_done: Vec<(LaunchId, u32, bool, Option<u32>)>,
    /// The replay that issued the last command to leave this stream's queue (`None`: the host
    /// launched it, or it was a copy): a launch of the same replay behind it is a graph's next
    /// node (`LatencyDesc::graph_node_gap_ns`).
    last_replay: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrive,
    GridReady(u32),
    CohortEnd(u32),
    GridComplete(u32),
    /// A launch's calibrated completion tail ended.
    TailEnd(u32),
    FlagVisible,
    CopyBegin(u32),
    CopyEnd(u32, u64),
    /// A copy through a secondary GPU ended.
    PeerCopyEnd(u32),
}

struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    /// Reversed, so the std max-heap pops the earliest (then first scheduled) event.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Clone, Copy, Debug)]
struct Levels {
    dev: f64,
    h2d: f64,
    d2h: f64,
    /// Launches with CTAs working on the GPU, each counted as the fraction of the GPU's SMs its
    /// working CTAs could cover (at most 1), for the co-run interference.
    corun: f64,
}

/// A simulated GPU. See the crate docs for the model and its assumptions.
pub struct SimGpu {
    desc: GpuDesc,
    info: DeviceInfo,
    opts: SimOptions,
    rng: SmallRng,
    /// The host's clock.
    now_ns: u64,
    /// Time of the last event processed on the GPU.
    gpu_ns: u64,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    sms: Vec<Sm>,
    partition_sms: Vec<Vec<u32>>,
    /// Partitions made of unions of SM groups ([`Gpu::partition_of_groups`]), by group bits.
    partition_by_groups: HashMap<u64, PartitionId>,
    streams: Vec<Stream>,
    /// Streams destroyed so far (ids are retired; the limit counts live streams).
    streams_destroyed: usize,
    queues: Vec<HwQueue>,
    queue_rr: usize,
    grids: Slab<Grid>,
    launch_slots: HashMap<u64, u32>,
    next_launch: u64,
    /// Grids in the compute work distributor, in placement order (priority, then arrival).
    cwd: Vec<u32>,
    cwd_seq: u64,
    /// Grids dispatched and not complete (bounded by `concurrent_grids_max`).
    cwd_grids: u32,
    cohorts: Slab<Cohort>,
    copies: Slab<CopyOp>,
    next_copy: u64,
    peers: Vec<SimPeer>,
    engines: [Engine; 3],
    copies_active: u32,
    copies_epoch: u64,
    mem: Memory,
    timing: TimingTable,
    resource_cache: Option<(Kernel, DType, LaunchShape, CtaResources, Option<MeasuredKernel>)>,
    outbox: VecDeque<(u64, GpuEvent)>,
    last_deliver_ns: u64,
    last_notify: (u64, u64),
    overrun: bool,
    error: Option<String>,
    /// An injected fault that every call reports until [`Gpu::reset`] (see [`Faults::sticky`]).
    sticky: Option<String>,
    /// `opts.faults.any()`, kept so that the notification path tests one bool.
    faults_on: bool,
    /// Launches whose notifications were dropped (injected faults): their end is reported lost.
    tainted: HashSet<LaunchId>,
    dirty_queues: bool,
    dirty_place: bool,
    pool_epoch: u64,
    /// Counts CTA releases; SMs record it at each of theirs (see `place_grid`).
    release_seq: u64,
    levels_cache: (u64, Levels),
    running: Vec<u32>,
    hash: TraceHasher,
    trace: Vec<TraceEvent>,
    stats: SimStats,
    // Scratch space reused by the hot paths.
    scratch_flows: Vec<Flow>,
    scratch_work: Vec<u32>,
    scratch_idle: Vec<u32>,
    scratch_touched: Vec<u32>,
    scratch_room: BinaryHeap<(u32, Reverse<u32>)>,
    scratch_cand: Vec<Slots>,
    spare_members: Vec<Vec<Member>>,
    scratch_timed: Vec<(u64, u64, Member)>,
    /// Recorded runs ([`Gpu::record_run`]), by id.
    runs: HashMap<u64, Vec<RecordedLaunch>>,
    next_run: u64,
    /// Replaying a run: its launches cost the host nothing one by one (the replay's call does).
    replaying: bool,
    /// Replays of recorded runs so far (each `launch_run` call is one).
    replays: u64,
    /// Stop words by id (None: free).
    stop_words: Vec<Option<StopWord>>,
}

/// One launch of a recorded run, owned.
#[derive(Clone, Debug)]
struct RecordedLaunch {
    kernel: Kernel,
    dtype: DType,
    shape: LaunchShape,
    args: Vec<DevicePtr>,
    first_block: u32,
    ctas: u32,
    sm_mask: SmMask,
    partition: PartitionId,
    report_ctas: bool,
    stop_word: Option<StopWordId>,
}

/// Recorded runs a simulated GPU holds at most.
pub const RUNS_MAX: usize = 65_536;

impl SimGpu {
    /// A simulated GPU of the given description, idle, at time 0.
    pub fn new(desc: GpuDesc, opts: SimOptions) -> SimGpu {
        desc.validate().expect("GPU description is valid");
        opts.faults.validate().expect("injected faults are valid");
        let info = desc.device_info();
        let partition_sms = info.partitions.iter().map(|p| p.sms.iter().collect()).collect();
        let sm_count = desc.sm_count as usize;
        let mem = Memory::new(opts.compute, desc.memory_bytes, desc.host_mapped_bytes_max);
        let queues = (0..desc.hardware_queues).map(|_| HwQueue::default()).collect();
        SimGpu {
            rng: SmallRng::seed_from_u64(opts.seed),
            info,
            now_ns: 0,
            gpu_ns: 0,
            heap: BinaryHeap::new(),
            seq: 0,
            sms: vec![Sm::default(); sm_count],
            partition_sms,
            partition_by_groups: HashMap::new(),
            streams: Vec::new(),
            streams_destroyed: 0,
            queues,
            queue_rr: 0,
            grids: Slab::default(),
            launch_slots: HashMap::new(),
            next_launch: 1,
            cwd: Vec::new(),
            cwd_seq: 0,
            cwd_grids: 0,
            cohorts: Slab::default(),
            copies: Slab::default(),
            next_copy: 1,
            peers: Vec::new(),
            engines: Default::default(),
            copies_active: 0,
            copies_epoch: 0,
            mem,
            timing: TimingTable::default(),
            resource_cache: None,
            outbox: VecDeque::new(),
            last_deliver_ns: 0,
            last_notify: (u64::MAX, 0),
            overrun: false,
            error: None,
            sticky: None,
            faults_on: opts.faults.any(),
            tainted: HashSet::new(),
            dirty_queues: false,
            dirty_place: false,
            pool_epoch: 1,
            release_seq: 0,
            levels_cache: (0, Levels { dev: f64::INFINITY, h2d: f64::INFINITY, d2h: f64::INFINITY, corun: 0.0 }),
            running: Vec::new(),
            hash: TraceHasher::default(),
            trace: Vec::new(),
            stats: SimStats::default(),
            scratch_flows: Vec::new(),
            scratch_work: vec![0; sm_count],
            scratch_idle: vec![0; sm_count],
            scratch_touched: Vec::new(),
            scratch_room: BinaryHeap::new(),
            scratch_cand: Vec::new(),
            spare_members: Vec::new(),
            scratch_timed: Vec::new(),
            runs: HashMap::new(),
            next_run: 1,
            replaying: false,
            replays: 0,
            stop_words: Vec::new(),
            desc,
            opts,
        }
    }

    pub fn desc(&self) -> &GpuDesc {
        &self.desc
    }

    pub fn options(&self) -> &SimOptions {
        &self.opts
    }

    pub fn seed(&self) -> u64 {
        self.opts.seed
    }

    /// Changes the faults injected from now on (see [`Faults`]); a sticky fault already hit stays
    /// until [`Gpu::reset`].
    /// Attaches a simulated secondary GPU (ordinal `gpu`) for parallel transmission
    /// ([`Gpu::copy_via_peer`]): host to it at `h2d_bytes_per_s` over its own PCIe link, forwarded
    /// to this GPU at `forward_bytes_per_s`, through `staging_bytes` of staging memory (whole
    /// [`PEER_PIECE_BYTES`] pieces, at least one). The links are independent of this GPU's own
    /// (no contention at the host is modelled).
    pub fn attach_peer(
        &mut self,
        gpu: u32,
        h2d_bytes_per_s: f64,
        forward_bytes_per_s: f64,
        staging_bytes: u64,
    ) -> Result<PeerPath> {
        let ok = |r: f64| r.is_finite() && r > 0.0;
        if !ok(h2d_bytes_per_s) || !ok(forward_bytes_per_s) {
            return Err(GpuError::Invalid(format!(
                "secondary GPU {gpu}: rates must be positive and finite ({h2d_bytes_per_s}, {forward_bytes_per_s} bytes/s)"
            )));
        }
        if self.peers.iter().any(|p| p.path.gpu == gpu) {
            return Err(GpuError::Invalid(format!("GPU {gpu} is already a secondary")));
        }
        let pieces = (staging_bytes / PEER_PIECE_BYTES).max(1);
        let path = PeerPath { gpu, h2d_bytes_per_s, forward_bytes_per_s, staging_bytes: pieces * PEER_PIECE_BYTES };
        self.peers.push(SimPeer {
            path,
            h2d_free_ns: 0,
            forward_free_ns: 0,
            slot_free_ns: vec![0; pieces as usize],
            next_slot: 0,
        });
        Ok(path)
    }

    pub fn set_faults(&mut self, faults: Faults) -> Result<()> {
        faults.validate().map_err(GpuError::Invalid)?;
        self.faults_on = faults.any();
        self.opts.faults = faults;
        Ok(())
    }

    pub fn stats(&self) -> SimStats {
        self.stats
    }

    /// Hash of everything that happened so far (internal steps and notifications, with times).
    /// Equal seeds and equal calls give equal hashes.
    pub fn trace_hash(&self) -> u64 {
        self.hash.0
    }

    /// The recorded trace (empty unless `record_trace`).
    pub fn trace(&self) -> &[TraceEvent] {
        &self.trace
    }

    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        std::mem::take(&mut self.trace)
    }

    /// The hardware queue a stream's commands go through (streams are spread round-robin).
    pub fn hardware_queue_of(&self, stream: StreamId) -> Option<u32> {
        self.streams.get(stream.0 as usize).map(|s| s.queue)
    }

    /// What SM `sm` holds right now.
    pub fn sm_usage(&self, sm: u32) -> SmUsage {
        self.sms[sm as usize].use_
    }

    /// True when nothing is in flight and every notification has been polled. A preempt flag or
    /// stop word still on its way to becoming visible (`Ev::FlagVisible`) is no work: with no
    /// launch left to read it, it changes nothing.
    pub fn is_idle(&self) -> bool {
        self.heap.iter().all(|s| matches!(s.ev, Ev::FlagVisible))
            && self.outbox.is_empty()
            && self.grids.len() == 0
            && self.copies.len() == 0
    }

    /// Registers the measured kernels of `profile`, which must have been taken on `plan`.
    /// Later launches of those kernels (same parameters and dtype) take their measured durations
    /// and resources. Returns the number of kernels registered.
    pub fn register_plan(&mut self, plan: &Plan, profile: &ModelProfile) -> Result<usize, ProfileError> {
        self.resource_cache = None;
        self.timing.insert_plan(plan, profile, self.desc.latency.profiled_launch_tail_ns)
    }

    /// Registers every plan that has a profile in `set` (matched by model name, dtype and the
    /// batch size, the first dimension of the plan's first input). Returns how many plans matched.
    ///
    /// A profile measured on another plan of the model (an older lowering: other tiles, other
    /// launches) is stale: when the plan has the same launches and only some changed their block
    /// counts, the others keep their measured times and the changed ones get roofline estimates
    /// ([`ModelProfile::matching_part`]; counted as matched); otherwise it is skipped and all the
    /// model's kernels get roofline estimates. Either way with a warning on stderr, so an outdated
    /// profile folder degrades estimates instead of refusing to start. [`Self::register_plan`]
    /// stays strict.
    pub fn register_profiles<'a>(
        &mut self,
        plans: impl IntoIterator<Item = &'a Plan>,
        set: &ProfileSet,
    ) -> Result<usize, ProfileError> {
        let mut matched = 0;
        for plan in plans {
            let batch = plan.inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1);
            if let Some(p) = set.find(&plan.model, plan.dtype, batch) {
                match crate::timing::check_profile(plan, p) {
                    Ok(()) => {
                        self.register_plan(plan, p)?;
                        matched += 1;
                    }
                    Err(e) => match p.matching_part(plan) {
                        Some((part, dropped)) => {
                            eprintln!(
                                "kairos-sim: profile of '{}' partly stale ({e}): {dropped} of {} launches get roofline \
                                 estimates, the others their measured times",
                                plan.model,
                                p.kernels.len()
                            );
                            self.register_plan(plan, &part)?;
                            matched += 1;
                        }
                        None => eprintln!("kairos-sim: stale profile skipped, roofline estimates instead: {e}"),
                    },
                }
            }
        }
        Ok(matched)
    }

    /// Loads every profile in `dir` (the layout of `data/profiles/<device>/`, see
    /// [`GpuDesc::profile_dir`]) and registers those of `plans`. A missing folder registers
    /// nothing. Returns how many plans matched.
    pub fn register_profile_dir<'a>(
        &mut self,
        dir: &std::path::Path,
        plans: impl IntoIterator<Item = &'a Plan>,
    ) -> Result<usize, ProfileError> {
        let set = ProfileSet::load_dir(dir)?;
        self.register_profiles(plans, &set)
    }

    /// Registers one kernel's timing directly (synthetic kernels of benchmarks, what-if studies).
    pub fn register_kernel(&mut self, kernel: &Kernel, dtype: DType, measured: MeasuredKernel) {
        self.resource_cache = None;
        self.timing.insert(kernel, dtype, measured);
    }

    /// Number of kernels with registered timing.
    pub fn registered_kernels(&self) -> usize {
        self.timing.len()
    }

    /// The simulator's prediction of a kernel's duration alone on `sm_count` SMs with no jitter,
    /// from its registered timing or the roofline: what a dispatcher may use where it has no profile.
    pub fn estimate_duration_ns(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape, sm_count: u32) -> Result<u64> {
        let (res, measured) = self.resources_of(kernel, dtype, shape)?;
        let occ = res.occupancy(&self.desc.sm_limits);
        let s = sm_count.clamp(1, self.desc.sm_count);
        let model = timing::calibrate(
            &self.desc,
            &LaunchSpec { kernel, dtype, occupancy: occ, sm_count: s, host: HostSplit::default(), measured: measured.as_ref() },
        );
        let n = kernel.logical_blocks().max(1) as u64;
        let ctas = (s as u64 * occ as u64).min(n);
        let waves = n.div_ceil(ctas);
        let mut flows = [Flow { demand: model.dev_demand, count: ctas as f64 }];
        let level = water_level(timing::kernel_bandwidth(&self.desc), &mut flows);
        let block = model.block_ns(1.0, 1.0, level, f64::INFINITY, f64::INFINITY);
        Ok(self.desc.latency.grid_dispatch_ns + self.desc.latency.grid_complete_ns + (waves as f64 * block).ceil() as u64)
    }

    /// Checks the model's invariants: SM usage equals the sum of resident CTAs and stays within
    /// the SM limits; launch counters are consistent; notifications are in time order.
    pub fn audit(&self) -> Result<(), String> {
        let mut usage = vec![SmUsage::default(); self.sms.len()];
        let mut load = vec![0u64; self.sms.len()];
        let mut live: HashMap<u32, (u32, u32)> = HashMap::new();
        for (_, c) in self.cohorts.iter() {
            let g = &self.grids[c.grid];
            for m in &c.members {
                let u = &mut usage[m.sm as usize];
                u.threads += g.cost.threads * m.ctas;
                u.registers += g.cost.registers * m.ctas;
                u.shared_mem_bytes += g.cost.shared_mem_bytes * m.ctas;
                u.ctas += m.ctas;
                let e = live.entry(c.grid).or_default();
                e.0 += m.ctas;
                if !c.idle {
                    e.1 += m.ctas;
                    load[m.sm as usize] += g.cost.load * m.ctas as u64;
                    if !g.mask.contains(m.sm) && !g.rescued {
                        return Err(format!("launch {:?} has a working CTA on SM {} outside its mask", g.id, m.sm));
                    }
                }
                if !g.partition_sms.contains(m.sm) {
                    return Err(format!("launch {:?} has a CTA on SM {} outside its partition", g.id, m.sm));
                }
            }
        }
        let l = &self.desc.sm_limits;
        for (i, (sm, u)) in self.sms.iter().zip(&usage).enumerate() {
            if sm.use_ != *u || sm.load != load[i] {
                return Err(format!(
                    "SM {i}: accounted {:?} load {}, resident CTAs add up to {u:?} load {}",
                    sm.use_, sm.load, load[i]
                ));
            }
            if u.threads > l.threads_max
                || u.registers > l.registers_max
                || u.shared_mem_bytes > l.shared_mem_bytes_max
                || u.ctas > l.ctas_max
            {
                return Err(format!("SM {i} over its limits: {u:?} vs {l:?}"));
            }
        }
        for (slot, g) in self.grids.iter() {
            let (ctas, working) = live.get(&slot).copied().unwrap_or((0, 0));
            if g.ctas_live != ctas || g.ctas_working != working {
                return Err(format!(
                    "launch {:?}: counts {} live {} working, cohorts hold {ctas} and {working}",
                    g.id, g.ctas_live, g.ctas_working
                ));
            }
            if g.next_block > g.end_block || g.next_block < g.first_block {
                return Err(format!(
                    "launch {:?}: next block {} outside [{}, {}]",
                    g.id, g.next_block, g.first_block, g.end_block
                ));
            }
        }
        if self.outbox.iter().zip(self.outbox.iter().skip(1)).any(|(a, b)| a.0 > b.0) {
            return Err("notification delivery times out of order".into());
        }
        if let Some(top) = self.heap.peek()
            && top.at < self.gpu_ns
        {
            return Err(format!("event at {} scheduled before the GPU clock {}", top.at, self.gpu_ns));
        }
        Ok(())
    }

    // ---------------------------------------------------------------- random draws

    fn lognormal(&mut self, sigma: f64) -> f64 {
        if !self.opts.jitter || sigma == 0.0 {
            return 1.0;
        }
        let z: f64 = StandardNormal.sample(&mut self.rng);
        (sigma * z.clamp(-5.0, 5.0)).exp()
    }

    fn latency_ns(&mut self, median_ns: u64) -> u64 {
        let f = self.lognormal(self.desc.latency.latency_sigma);
        (median_ns as f64 * f).round() as u64
    }

    // ---------------------------------------------------------------- bookkeeping

    fn record(&mut self, e: TraceEvent) {
        // Per-SM steps show in the notifications (hashed as delivered); hashing them again would
        // double the cost of the hot path for no extra coverage of the observable trace.
        if !matches!(e, TraceEvent::Place { .. } | TraceEvent::Release { .. } | TraceEvent::Take { .. }) {
            self.hash.event(&e);
        }
        if self.opts.record_trace && self.trace.len() < TRACE_EVENTS_MAX {
            self.trace.push(e);
        }
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        debug_assert!(at >= self.gpu_ns);
        self.seq += 1;
        self.heap.push(Scheduled { at, seq: self.seq, ev });
    }

    /// Puts a notification into the ring; the host sees it after the notification delay, in order
    /// (unless faults are injected: see [`Faults`]).
    fn notify(&mut self, ev: GpuEvent, at: u64) {
        if !self.faults_on {
            return self.notify_plain(ev, at);
        }
        let launch = match ev {
            GpuEvent::LaunchStarted { launch, .. }
            | GpuEvent::CtasPlaced { launch, .. }
            | GpuEvent::CtasFinished { launch, .. }
            | GpuEvent::LaunchDone { launch, .. }
            | GpuEvent::LaunchLost { launch, .. } => Some(launch),
            GpuEvent::CopyDone { .. } => None,
        };
        if let Some(l) = launch.filter(|l| self.tainted.contains(l)) {
            // Its records are lost; its end is reported as such.
            if let GpuEvent::LaunchDone { .. } = ev {
                self.tainted.remove(&l);
                self.notify_plain(GpuEvent::LaunchLost { launch: l, at_ns: at }, at);
            }
            return;
        }
        if self.roll(self.opts.faults.ring_overflow) {
            // Everything not yet read is dropped, and this record with it.
            let dropped: Vec<(u64, GpuEvent)> = self.outbox.drain(..).collect();
            for (deliver, e) in dropped {
                match e {
                    GpuEvent::CopyDone { .. } => self.outbox.push_back((deliver, e)),
                    GpuEvent::LaunchDone { launch, at_ns, .. } => {
                        self.tainted.remove(&launch);
                        self.outbox.push_back((deliver, GpuEvent::LaunchLost { launch, at_ns }));
                    }
                    GpuEvent::LaunchLost { .. } => self.outbox.push_back((deliver, e)),
                    GpuEvent::LaunchStarted { launch, .. }
                    | GpuEvent::CtasPlaced { launch, .. }
                    | GpuEvent::CtasFinished { launch, .. } => {
                        self.tainted.insert(launch);
                    }
                }
            }
            if let Some(l) = launch {
                if let GpuEvent::LaunchDone { .. } = ev {
                    self.notify_plain(GpuEvent::LaunchLost { launch: l, at_ns: at }, at);
                } else {
                    self.tainted.insert(l);
                }
            } else {
                self.notify_plain(ev, at);
            }
            // A launch tainted whose end was already kept as lost above is not lost twice.
            let lost: HashSet<LaunchId> = self
                .outbox
                .iter()
                .filter_map(|(_, e)| if let GpuEvent::LaunchLost { launch, .. } = e { Some(*launch) } else { None })
                .collect();
            self.tainted.retain(|l| !lost.contains(l));
            return;
        }
        if self.roll(self.opts.faults.late) {
            let extra = self.rng.random_range(0..=self.opts.faults.late_ns_max.max(1));
            let deliver = at + self.latency_ns(self.desc.latency.notify_delay_ns) + extra;
            // Not in order: later records may be delivered before it.
            let pos = self.outbox.iter().rposition(|&(d, _)| d <= deliver).map_or(0, |p| p + 1);
            self.outbox.insert(pos, (deliver, ev));
            return;
        }
        self.notify_plain(ev, at);
        if self.roll(self.opts.faults.duplicate) {
            self.notify_plain(ev, at);
        }
    }

    /// The faults of [`Faults`] drawn per launch, for a launch just queued as grid `g`.
    fn inject_launch_faults(&mut self, id: LaunchId, g: u32) {
        let f = self.opts.faults.clone();
        if self.roll(f.sticky) {
            self.grids[g].jitter *= STUCK_SLOWDOWN;
            self.sticky = Some(format!("launch {} hit an illegal address (injected fault); the device needs a reset", id.0));
        } else if self.roll(f.stuck) {
            self.grids[g].jitter *= STUCK_SLOWDOWN;
        } else if self.roll(f.slow) {
            self.grids[g].jitter *= f.slow_factor;
        }
        if self.roll(f.lose_launch) {
            self.tainted.insert(id);
        }
    }

    /// Draws a fault of probability `p` (no draw at all when `p` is 0).
    fn roll(&mut self, p: f64) -> bool {
        let hit = p > 0.0 && self.rng.random_bool(p);
        self.stats.faults_injected += hit as u64;
        hit
    }

    /// The sticky fault, as the error every call returns until a reset.
    fn check_sticky(&self) -> Result<()> {
        match &self.sticky {
            Some(e) => Err(GpuError::Driver(e.clone())),
            None => Ok(()),
        }
    }

    fn notify_plain(&mut self, ev: GpuEvent, at: u64) {
        if let Some((_, last)) = self.outbox.back_mut()
            && let (
                GpuEvent::CtasFinished { launch: l0, sm: s0, ctas: c0, blocks: b0, at_ns: t0 },
                GpuEvent::CtasFinished { launch, sm, ctas, blocks, at_ns },
            ) = (last, ev)
            && (*l0, *s0, *t0) == (launch, sm, at_ns)
        {
            // CTAs of one launch leaving one SM at one instant report together.
            *c0 += ctas;
            *b0 += blocks;
            return;
        }
        if self.outbox.len() >= NOTIFY_RING_MAX {
            self.overrun = true;
            return;
        }
        let delay = if self.last_notify.0 == at {
            self.last_notify.1
        } else {
            let d = self.latency_ns(self.desc.latency.notify_delay_ns);
            self.last_notify = (at, d);
            d
        };
        let deliver = (at + delay).max(self.last_deliver_ns);
        self.last_deliver_ns = deliver;
        if self.outbox.back().is_some_and(|&(d, _)| d > deliver) {
            // Behind a record delivered late (injected fault): it overtakes that one.
            let pos = self.outbox.iter().rposition(|&(d, _)| d <= deliver).map_or(0, |p| p + 1);
            self.outbox.insert(pos, (deliver, ev));
            return;
        }
        self.outbox.push_back((deliver, ev));
    }

    fn resources_of(
        &mut self,
        kernel: &Kernel,
        dtype: DType,
        shape: &LaunchShape,
    ) -> Result<(CtaResources, Option<MeasuredKernel>)> {
        if let Some((k, d, s, r, m)) = &self.resource_cache
            && k == kernel
            && *d == dtype
            && s == shape
        {
            return Ok((*r, m.clone()));
        }
        let measured = self.timing.get(kernel, dtype).cloned();
        let res = measured.as_ref().and_then(|m| m.resources).unwrap_or_else(|| CtaResources::estimate(kernel, shape));
        let limits = &self.desc.sm_limits;
        if res.threads_per_cta == 0 || res.threads_per_cta > self.desc.threads_per_cta_max {
            return Err(GpuError::Invalid(format!(
                "{}: {} threads per CTA (1..={})",
                kernel.name(),
                res.threads_per_cta,
                self.desc.threads_per_cta_max
            )));
        }
        if res.shared_mem_bytes > self.desc.shared_mem_per_cta_bytes_max {
            return Err(GpuError::Invalid(format!(
                "{}: {} bytes of shared memory per CTA (at most {})",
                kernel.name(),
                res.shared_mem_bytes,
                self.desc.shared_mem_per_cta_bytes_max
            )));
        }
        if res.occupancy(limits) == 0 {
            return Err(GpuError::Invalid(format!("{}: one CTA ({res:?}) does not fit on an SM", kernel.name())));
        }
        self.resource_cache = Some((*kernel, dtype, *shape, res, measured.clone()));
        Ok((res, measured))
    }

    // ---------------------------------------------------------------- time

    /// Runs the GPU up to and including `target`.
    fn run_until(&mut self, target: u64) {
        while let Some(top) = self.heap.peek() {
            if top.at > target {
                break;
            }
            let t = top.at;
            self.gpu_ns = t;
            while let Some(top) = self.heap.peek() {
                if top.at != t {
                    break;
                }
                let e = self.heap.pop().unwrap();
                self.stats.steps += 1;
                self.handle(t, e.ev);
            }
            self.settle(t);
        }
    }

    /// The host spends `ns` (a launch call, a synchronous copy); the GPU runs meanwhile.
    fn host_spend(&mut self, ns: u64) {
        let target = self.now_ns + ns;
        self.run_until(target);
        self.now_ns = target;
    }

    fn handle(&mut self, t: u64, ev: Ev) {
        match ev {
            Ev::Arrive => self.dirty_queues = true,
            Ev::GridReady(g) => self.grid_ready(g),
            Ev::CohortEnd(c) => self.cohort_end(c, t),
            Ev::GridComplete(g) => self.grid_complete(g, t),
            Ev::TailEnd(g) => {
                self.grids[g].tail_ns = 0;
                self.grids[g].in_tail = false;
                self.maybe_finish(g, t);
            }
            Ev::FlagVisible => self.dirty_place = true,
            Ev::CopyBegin(c) => self.copy_begin(c, t),
            Ev::CopyEnd(c, generation) => self.copy_end(c, generation, t),
            Ev::PeerCopyEnd(c) => self.peer_copy_end(c, t),
        }
    }

    fn settle(&mut self, t: u64) {
        loop {
            if self.dirty_queues {
                self.dirty_queues = false;
                self.dispatch_queues(t);
            }
            if self.dirty_place {
                self.dirty_place = false;
                self.place_all(t);
            }
            if !self.dirty_queues && !self.dirty_place {
                break;
            }
        }
        if self.copies_active > 0 && self.copies_epoch != self.pool_epoch {
            self.update_copy_rates(t);
        }
        if self.opts.check_invariants
            && let Err(e) = self.audit()
        {
            panic!("simulator invariant broken at {t} ns (seed {}): {e}", self.opts.seed);
        }
    }

    // ---------------------------------------------------------------- hardware queues

    fn dispatch_queues(&mut self, t: u64) {
        let n = self.queues.len();
        for k in 0..n {
            let q = (self.queue_rr + k) % n;
            while let Some(head) = self.queues[q].cmds.front() {
                if head.arrive_ns > t || self.streams[head.stream as usize].busy {
                    break;
                }
                if matches!(head.cmd, Cmd::Kernel(_)) && self.cwd_grids >= self.desc.concurrent_grids_max {
                    break;
                }
                if let Cmd::WaitCopy(copy) = head.cmd {
                    // Holds its queue's head (as an event wait does in a hardware queue) until
                    // the copy ends; copy_end marks the queues dirty.
                    if self.copies.iter().any(|(_, c)| c.id == copy) {
                        break;
                    }
                    self.queues[q].cmds.pop_front();
                    continue;
                }
                let head = self.queues[q].cmds.pop_front().unwrap();
                self.streams[head.stream as usize].busy = true;
                let replay = match head.cmd {
                    Cmd::Kernel(g) => self.grids[g].replay,
                    _ => None,
                };
                let last_replay = std::mem::replace(&mut self.streams[head.stream as usize].last_replay, replay);
                match head.cmd {
                    Cmd::Kernel(g) => {
                        self.cwd_grids += 1;
                        self.grids[g].state = GridState::Dispatching;
                        if self.grids[g].gated && self.streams[head.stream as usize].gate_closed {
                            // Behind a launch that stopped early: every take finds the stop bit.
                            self.grids[g].stop_ns = Some(0);
                        }
                        if let Some(w) = self.grids[g].stop_word {
                            let word = self.stop_words[w as usize].as_mut().expect("a launch's stop word is live");
                            // The clear is a stream write before it: a raise that landed is gone,
                            // one still on its way lands after.
                            if self.grids[g].clears_stop_word && word.raised_at_ns.is_some_and(|r| r <= t) {
                                word.raised_at_ns = None;
                            }
                            match word.raised_at_ns {
                                // Raised before it starts: it runs no block.
                                Some(r) if r <= t => self.grids[g].stop_ns = Some(0),
                                // Landing while it runs: a preemptible launch stops then.
                                Some(r) if !self.grids[g].silent => {
                                    let grid = &mut self.grids[g];
                                    grid.host_flag = true;
                                    grid.flag_at_ns = r;
                                    grid.stop_ns = Some(r);
                                    self.schedule(r, Ev::FlagVisible);
                                }
                                _ => {}
                            }
                        }
                        let id = self.grids[g].id;
                        self.record(TraceEvent::Dispatch { launch: id, queue: q as u32, at_ns: t });
                        let lat = &self.desc.latency;
                        let dispatch_ns = match lat.graph_node_gap_ns {
                            // A graph's next node: the rest of the node gap after the earlier
                            // node's completion (see `finish_grid`).
                            Some(gap) if replay.is_some() && replay == last_replay => gap - gap.min(lat.grid_complete_ns),
                            _ => lat.grid_dispatch_ns,
                        };
                        self.schedule(t + dispatch_ns, Ev::GridReady(g));
                    }
                    Cmd::WaitCopy(_) => unreachable!("handled at the head above"),
                    Cmd::Copy(c) => {
                        let (id, dir) = (self.copies[c].id, self.copies[c].dir);
                        self.record(TraceEvent::DispatchCopy { copy: id, queue: q as u32, at_ns: t });
                        self.engines[dir as usize].fifo.push_back(c);
                        self.start_engine(dir, t);
                    }
                }
            }
        }
        self.queue_rr = (self.queue_rr + 1) % n;
    }

    // ---------------------------------------------------------------- compute work distributor

    fn grid_ready(&mut self, g: u32) {
        let grid = &mut self.grids[g];
        grid.state = GridState::InCwd;
        grid.cwd_seq = self.cwd_seq;
        self.cwd_seq += 1;
        let p = grid.priority;
        let pos = self.cwd.partition_point(|&o| self.grids[o].priority >= p);
        self.cwd.insert(pos, g);
        self.dirty_place = true;
    }

    /// One placement pass: grids in order; a grid with CTAs left to place blocks the grids behind
    /// it that share SMs with its partition (the hardware places the next grid's CTAs only after
    /// all of the earlier grid's).
    fn place_all(&mut self, t: u64) {
        let mut blocked = SmMask::EMPTY;
        let mut finished = Vec::new();
        for i in 0..self.cwd.len() {
            let g = self.cwd[i];
            let grid = &self.grids[g];
            if grid.ctas_unplaced == 0 {
                if grid.ctas_live == 0 && !grid.in_tail {
                    finished.push(g);
                }
                continue;
            }
            let part = grid.partition_sms;
            if !part.0.iter().zip(blocked.0.iter()).any(|(a, b)| a & b != 0) {
                self.place_grid(g, t);
            }
            // Placed or not, a grid with CTAs left holds back every later grid that shares SMs with it.
            if self.grids[g].ctas_unplaced > 0 {
                blocked = blocked.union(&part);
            }
        }
        for g in finished {
            // Through its completion tail, if it has one.
            self.maybe_finish(g, t);
        }
    }

    fn fits(&self, sm: u32, c: &CtaCost) -> bool {
        let u = &self.sms[sm as usize].use_;
        let l = &self.desc.sm_limits;
        u.threads + c.threads <= l.threads_max
            && u.registers + c.registers <= l.registers_max
            && u.shared_mem_bytes + c.shared_mem_bytes <= l.shared_mem_bytes_max
            && u.ctas < l.ctas_max
    }

    fn occupy(&mut self, sm: u32, c: &CtaCost, n: u32, working: bool) {
        let s = &mut self.sms[sm as usize];
        s.use_.threads += c.threads * n;
        s.use_.registers += c.registers * n;
        s.use_.shared_mem_bytes += c.shared_mem_bytes * n;
        s.use_.ctas += n;
        if working {
            s.load += c.load * n as u64;
        }
    }

    fn release(&mut self, sm: u32, c: &CtaCost, n: u32, working: bool) {
        self.release_seq += 1;
        let s = &mut self.sms[sm as usize];
        s.release_seq = self.release_seq;
        s.use_.threads -= c.threads * n;
        s.use_.registers -= c.registers * n;
        s.use_.shared_mem_bytes -= c.shared_mem_bytes * n;
        s.use_.ctas -= n;
        if working {
            s.load -= c.load * n as u64;
        }
    }

    /// Places as many CTAs of grid `g` as fit, each on the SM with the most free thread slots
    /// (lowest id on ties), which spreads a grid breadth-first over its partition.
    fn place_grid(&mut self, g: u32, t: u64) {
        let (cost, partition, mask, flagged, id) = {
            let grid = &self.grids[g];
            (grid.cost, grid.partition as usize, grid.mask, grid.stop_ns.is_some_and(|f| f <= t), grid.id)
        };
        let grid = &self.grids[g];
        let mut work_left = if flagged { 0 } else { grid.end_block - grid.next_block };
        let mut unplaced = grid.ctas_unplaced;
        let mut touched = std::mem::take(&mut self.scratch_touched);
        touched.clear();
        let (mut placed, mut working) = (0u32, 0u32);
        let threads_max = self.desc.sm_limits.threads_max;
        // After an attempt that left CTAs unplaced, no SM of the partition had room for one more;
        // only SMs that released CTAs since can have room now. With no release at all, skip.
        let stalled_at = grid.stalled_at;
        let skip_sm = |gpu: &SimGpu, sm: u32| stalled_at != NOT_STALLED && gpu.sms[sm as usize].release_seq <= stalled_at;
        if stalled_at == self.release_seq {
            if self.opts.check_invariants {
                let none = self.reference_placement(partition, &cost, mask, work_left, grid.ctas_unplaced);
                assert!(none.is_empty(), "stalled {id:?} could place {none:?} (seed {})", self.opts.seed);
            }
            self.scratch_touched = touched;
            return;
        }

        // In checking mode, the one-by-one placement on a copy of the SMs is the reference.
        let reference = self.opts.check_invariants.then(|| self.reference_placement(partition, &cost, mask, work_left, unplaced));
        let mut cand = std::mem::take(&mut self.scratch_cand);
        cand.clear();
        if mask == self.grids[g].partition_sms {
            // Without a narrower mask, only how many CTAs land on each SM matters, and how many of
            // them are among the first `work_left` placed (those take a block; the rest find none):
            // solve the one-by-one rule in closed form (see `top_slots`).
            let l = &self.desc.sm_limits;
            let mut total = 0u64;
            for &sm in &self.partition_sms[partition] {
                if skip_sm(self, sm) || !self.fits(sm, &cost) {
                    continue;
                }
                let u = self.sms[sm as usize].use_;
                let fit = [
                    (l.threads_max - u.threads) / cost.threads.max(1),
                    (l.registers_max - u.registers).checked_div(cost.registers).unwrap_or(u32::MAX),
                    (l.shared_mem_bytes_max - u.shared_mem_bytes).checked_div(cost.shared_mem_bytes).unwrap_or(u32::MAX),
                    l.ctas_max - u.ctas,
                ]
                .into_iter()
                .min()
                .unwrap();
                cand.push(Slots { sm, fit, free: l.threads_max - u.threads, take: 0 });
                total += fit as u64;
            }
            let k = (unplaced as u64).min(total) as u32;
            let w = work_left.min(k);
            let threads = cost.threads.max(1);
            if w > 0 && w < k {
                top_slots(&mut cand, threads, w);
                for c in &cand {
                    self.scratch_work[c.sm as usize] = c.take;
                }
            }
            if k > 0 {
                if (k as u64) < total {
                    top_slots(&mut cand, threads, k);
                } else {
                    for c in cand.iter_mut() {
                        c.take = c.fit;
                    }
                }
            }
            for c in &cand {
                if c.take > 0 {
                    let all = c.take;
                    let work = if w == k {
                        all
                    } else if w == 0 {
                        0
                    } else {
                        self.scratch_work[c.sm as usize]
                    };
                    if work > 0 {
                        self.occupy(c.sm, &cost, work, true);
                    }
                    if all > work {
                        self.occupy(c.sm, &cost, all - work, false);
                    }
                    self.scratch_work[c.sm as usize] = work;
                    self.scratch_idle[c.sm as usize] = all - work;
                    touched.push(c.sm);
                    placed += all;
                    working += work;
                } else {
                    self.scratch_work[c.sm as usize] = 0;
                }
            }
            unplaced -= placed;
        } else {
            let mut room = std::mem::take(&mut self.scratch_room).into_vec();
            room.clear();
            for &sm in &self.partition_sms[partition] {
                if !skip_sm(self, sm) && self.fits(sm, &cost) {
                    room.push((threads_max - self.sms[sm as usize].use_.threads, Reverse(sm)));
                }
            }
            let mut room = BinaryHeap::from(room);
            while unplaced > 0 {
                let Some((_, Reverse(sm))) = room.pop() else { break };
                let works = work_left > 0 && mask.contains(sm);
                self.occupy(sm, &cost, 1, works);
                if self.scratch_work[sm as usize] == 0 && self.scratch_idle[sm as usize] == 0 {
                    touched.push(sm);
                }
                if works {
                    work_left -= 1;
                    working += 1;
                    self.scratch_work[sm as usize] += 1;
                } else {
                    self.scratch_idle[sm as usize] += 1;
                }
                unplaced -= 1;
                placed += 1;
                if self.fits(sm, &cost) {
                    room.push((threads_max - self.sms[sm as usize].use_.threads, Reverse(sm)));
                }
            }
            self.scratch_room = room;
        }
        self.scratch_cand = cand;
        self.grids[g].stalled_at = if unplaced > 0 { self.release_seq } else { NOT_STALLED };
        if let Some(reference) = reference {
            let mut got: Vec<(u32, u32, u32)> =
                touched.iter().map(|&sm| (sm, self.scratch_work[sm as usize], self.scratch_idle[sm as usize])).collect();
            got.sort_unstable();
            assert_eq!(got, reference, "placement of {id:?} differs from the one-by-one rule (seed {})", self.opts.seed);
        }
        if placed == 0 {
            self.scratch_touched = touched;
            return;
        }
        self.stats.ctas_placed += placed as u64;
        touched.sort_unstable();
        let first = {
            let grid = &mut self.grids[g];
            grid.ctas_unplaced = unplaced;
            grid.ctas_live += placed;
            grid.ctas_working += working;
            let first = grid.next_block;
            grid.next_block += working;
            first
        };
        if working > 0 {
            self.record(TraceEvent::Take { launch: id, first, count: working, at_ns: t });
            self.poll_flag(g, t);
            self.pool_epoch += 1;
            if !self.grids[g].in_running {
                self.grids[g].in_running = true;
                self.running.push(g);
            }
        }
        let mut idle_members = self.member_vec();
        let mut work_members = self.member_vec();
        for &sm in &touched {
            let (w, i) = (self.scratch_work[sm as usize], self.scratch_idle[sm as usize]);
            self.scratch_work[sm as usize] = 0;
            self.scratch_idle[sm as usize] = 0;
            self.record(TraceEvent::Place { launch: id, sm, working: w, idle: i, at_ns: t });
            // CTAs inside the mask report their arrival, whether or not they find a block.
            let reported = if mask.contains(sm) { w + i } else { 0 };
            if reported > 0 && self.grids[g].report_ctas {
                self.notify(GpuEvent::CtasPlaced { launch: id, sm, ctas: reported, at_ns: t }, t);
            }
            if w > 0 {
                work_members.push(Member { sm, ctas: w, iters: 0 });
            }
            if i > 0 {
                idle_members.push(Member { sm, ctas: i, iters: 0 });
            }
        }
        touched.clear();
        self.scratch_touched = touched;
        if working > 0 {
            self.note_start(g, first, t);
        }
        if !idle_members.is_empty() {
            let c = self.cohorts.insert(Cohort { grid: g, idle: true, members: idle_members });
            self.schedule(t + self.desc.latency.cta_exit_ns, Ev::CohortEnd(c));
        } else {
            self.spare_members.push(idle_members);
        }
        if !work_members.is_empty() {
            self.start_blocks(g, work_members, None, t);
        } else {
            self.spare_members.push(work_members);
        }
    }

    /// The placement rule applied one CTA at a time on a copy of the SMs: (sm, working, idle) per
    /// SM touched, by SM id. The fast paths of `place_grid` must agree with it.
    fn reference_placement(
        &self,
        partition: usize,
        cost: &CtaCost,
        mask: SmMask,
        mut work_left: u32,
        mut unplaced: u32,
    ) -> Vec<(u32, u32, u32)> {
        let l = self.desc.sm_limits;
        let mut use_: Vec<SmUsage> = self.sms.iter().map(|s| s.use_).collect();
        let fits = |u: &SmUsage| {
            u.threads + cost.threads <= l.threads_max
                && u.registers + cost.registers <= l.registers_max
                && u.shared_mem_bytes + cost.shared_mem_bytes <= l.shared_mem_bytes_max
                && u.ctas < l.ctas_max
        };
        let mut room: BinaryHeap<(u32, Reverse<u32>)> = BinaryHeap::new();
        for &sm in &self.partition_sms[partition] {
            if fits(&use_[sm as usize]) {
                room.push((l.threads_max - use_[sm as usize].threads, Reverse(sm)));
            }
        }
        let mut out: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        while unplaced > 0 {
            let Some((_, Reverse(sm))) = room.pop() else { break };
            let u = &mut use_[sm as usize];
            u.threads += cost.threads;
            u.registers += cost.registers;
            u.shared_mem_bytes += cost.shared_mem_bytes;
            u.ctas += 1;
            let e = out.entry(sm).or_default();
            if work_left > 0 && mask.contains(sm) {
                work_left -= 1;
                e.0 += 1;
            } else {
                e.1 += 1;
            }
            unplaced -= 1;
            if fits(u) {
                room.push((l.threads_max - u.threads, Reverse(sm)));
            }
        }
        out.into_iter().map(|(sm, (w, i))| (sm, w, i)).collect()
    }

    /// Water levels of the bandwidth pools, recomputed when the set of flows changed.
    fn levels(&mut self) -> Levels {
        if self.levels_cache.0 == self.pool_epoch {
            return self.levels_cache.1;
        }
        // Launches whose CTAs all left stop counting.
        let mut i = 0;
        while i < self.running.len() {
            let g = self.running[i];
            if self.grids[g].ctas_working > 0 {
                i += 1;
            } else {
                self.grids[g].in_running = false;
                self.running.remove(i);
            }
        }
        let mut flows = std::mem::take(&mut self.scratch_flows);
        let d = &self.desc;
        let copy_demand = |dir: Dir| -> Option<f64> {
            let c = self.engines[dir as usize].active?;
            self.copies[c].active.then_some(match dir {
                Dir::H2D => d.h2d_bytes_per_s / 1e9,
                Dir::D2H => d.d2h_bytes_per_s / 1e9,
                Dir::D2D => 2.0 * d.d2d_copy_bytes_per_s / 1e9,
            })
        };
        let h2d_copy = copy_demand(Dir::H2D);
        // Kernels alone reach the mapped-read rate; a DMA copy beside them can use the whole link.
        let h2d_cap =
            if h2d_copy.is_some() { d.h2d_bytes_per_s } else { d.h2d_bytes_per_s.min(d.host_mapped_read_bytes_per_s) } / 1e9;
        let lv = Levels {
            dev: pool_level(
                &mut flows,
                &self.grids,
                &self.running,
                timing::kernel_bandwidth(d),
                |m| m.dev_demand,
                copy_demand(Dir::D2D),
            ),
            h2d: pool_level(&mut flows, &self.grids, &self.running, h2d_cap, |m| m.h2d_demand, h2d_copy),
            d2h: pool_level(
                &mut flows,
                &self.grids,
                &self.running,
                d.d2h_bytes_per_s / 1e9,
                |m| m.d2h_demand,
                copy_demand(Dir::D2H),
            ),
            corun: self.running.iter().map(|&g| self.corun_weight(g)).sum(),
        };
        self.scratch_flows = flows;
        self.levels_cache = (self.pool_epoch, lv);
        lv
    }

    /// How much launch `g` counts towards the co-run interference of the others: the fraction of
    /// the GPU's SMs its working CTAs could cover, at most 1 (a grid that fills the GPU counts
    /// one; a one-CTA kernel next to nothing).
    fn corun_weight(&self, g: u32) -> f64 {
        (self.grids[g].ctas_working as f64 / self.desc.sm_count as f64).min(1.0)
    }

    /// The co-run interference factor of a block of grid `g` starting while launches of total
    /// weight `corun` (see `corun_weight`) have CTAs working: 1 + `corun_slowdown_per_launch` per
    /// unit of the others' weight.
    fn corun_factor(&self, g: u32, corun: f64) -> f64 {
        let per_launch = self.desc.model.corun_slowdown_per_launch;
        if per_launch == 0.0 {
            return 1.0;
        }
        let own = if self.grids[g].in_running { self.corun_weight(g) } else { 0.0 };
        1.0 + per_launch * (corun - own).max(0.0)
    }

    /// Starts one logical block on each CTA of `members` (all of grid `g`), grouping the SMs where
    /// a block takes equally long into one cohort each. `reuse` is a cohort slot to fill first.
    fn start_blocks(&mut self, g: u32, members: Vec<Member>, reuse: Option<(u32, Vec<Member>)>, t: u64) {
        let lv = self.levels();
        let jitter = self.grids[g].jitter * self.lognormal(self.desc.model.block_duration_sigma) * self.corun_factor(g, lv.corun);
        let model = self.grids[g].model;
        let mut timed = std::mem::take(&mut self.scratch_timed);
        timed.clear();
        for &m in &members {
            let load = self.sms[m.sm as usize].load as f64 / LOAD_UNIT as f64;
            let ns = ceil_ns(model.block_ns(load, jitter, lv.dev, lv.h2d, lv.d2h));
            timed.push((0, ns, m));
        }
        // Members come in SM order. SMs whose block times differ by less than a bucket (1.6%, below
        // the block jitter) share one cohort at their mean time, so a crowded GPU does not cost one
        // event per SM per block.
        if timed.iter().any(|x| x.1 != timed[0].1) {
            for x in timed.iter_mut() {
                x.0 = ((x.1 as f64).ln() * DURATION_BUCKETS_PER_E).round() as u64;
            }
            timed.sort_unstable_by_key(|&(bucket, _, m)| (bucket, m.sm));
        }
        let mut reuse = reuse;
        let mut i = 0;
        while i < timed.len() {
            let bucket = timed[i].0;
            let mut j = i;
            let mut group = match reuse.take() {
                Some((slot, mut v)) => {
                    v.clear();
                    (Some(slot), v)
                }
                None => (None, self.member_vec()),
            };
            let (mut weighted_ns, mut ctas) = (0u128, 0u128);
            while j < timed.len() && timed[j].0 == bucket {
                group.1.push(timed[j].2);
                weighted_ns += timed[j].1 as u128 * timed[j].2.ctas as u128;
                ctas += timed[j].2.ctas as u128;
                j += 1;
            }
            let ns = (weighted_ns.div_ceil(ctas.max(1))) as u64;
            // A cohort of this launch ending within 1/64 of a block time joins these CTAs: phases
            // that drifted apart by placement order collapse, so a crowded GPU costs few events.
            let end = t + ns;
            let tol = ns / DURATION_JOIN_DIVISOR;
            let near = self.grids[g]
                .cohort_ends
                .range(end.saturating_sub(tol).max(t + 1)..=end + tol)
                .min_by_key(|(e, _)| e.abs_diff(end))
                .map(|(_, &c)| c);
            match (near, group.0) {
                (Some(c), reuse_slot) => {
                    let mut members = group.1;
                    self.cohorts[c].members.append(&mut members);
                    match reuse_slot {
                        Some(slot) => reuse = Some((slot, members)),
                        None => self.spare_members.push(members),
                    }
                }
                (None, Some(slot)) => {
                    self.cohorts[slot].members = group.1;
                    self.grids[g].cohort_ends.insert(end, slot);
                    self.schedule(end, Ev::CohortEnd(slot));
                }
                (None, None) => {
                    let slot = self.cohorts.insert(Cohort { grid: g, idle: false, members: group.1 });
                    self.grids[g].cohort_ends.insert(end, slot);
                    self.schedule(end, Ev::CohortEnd(slot));
                }
            }
            i = j;
        }
        if let Some((slot, v)) = reuse {
            self.remove_cohort(slot, v);
        }
        self.spare_members.push(members);
        self.scratch_timed = timed;
    }

    /// A cohort's CTAs finished a block each: they take the next blocks or leave.
    fn cohort_end(&mut self, c: u32, t: u64) {
        let g = self.cohorts[c].grid;
        let members = std::mem::take(&mut self.cohorts[c].members);
        if !self.cohorts[c].idle {
            let removed = self.grids[g].cohort_ends.remove(&t);
            debug_assert_eq!(removed, Some(c));
        }
        let cost = self.grids[g].cost;
        let id = self.grids[g].id;
        if self.cohorts[c].idle {
            let mut members = members;
            // The last CTA out of a launch with blocks left and no stop runs them itself, wherever
            // it is (the protocol's rescue of a launch none of whose CTAs landed in its mask).
            let n: u32 = members.iter().map(|m| m.ctas).sum();
            let rescue = {
                let grid = &mut self.grids[g];
                let last_out = grid.ctas_live == n && grid.ctas_unplaced == 0;
                let stopped = grid.stop_ns.is_some_and(|s| s <= t);
                if last_out && !stopped && grid.next_block < grid.end_block && grid.host_flag && grid.flag_at_ns <= t {
                    // The last CTA reads the host flag itself.
                    grid.stop_ns = Some(t);
                }
                last_out && grid.next_block < grid.end_block && grid.stop_ns.is_none_or(|s| s > t)
            };
            let mask = self.grids[g].mask;
            if rescue {
                members[0].ctas -= 1;
            }
            for m in &members {
                if m.ctas == 0 {
                    continue;
                }
                self.release(m.sm, &cost, m.ctas, false);
                self.record(TraceEvent::Release { launch: id, sm: m.sm, ctas: m.ctas, blocks: 0, idle: true, at_ns: t });
                if mask.contains(m.sm) && self.grids[g].report_ctas {
                    self.notify(GpuEvent::CtasFinished { launch: id, sm: m.sm, ctas: m.ctas, blocks: 0, at_ns: t }, t);
                }
            }
            let sm = members[0].sm;
            self.remove_cohort(c, members);
            self.grids[g].ctas_live -= n - rescue as u32;
            self.dirty_place = true;
            if rescue {
                self.rescue(g, sm, t);
            } else {
                self.maybe_finish(g, t);
            }
            return;
        }
        let mut avail = {
            let grid = &self.grids[g];
            if grid.stop_ns.is_some_and(|f| f <= t) { 0 } else { grid.end_block - grid.next_block }
        };
        let mut next = self.member_vec();
        let (mut took, mut left, mut done_blocks) = (0u32, 0u32, 0u64);
        for m in &members {
            let iters = m.iters + 1;
            done_blocks += m.ctas as u64;
            let take = m.ctas.min(avail);
            avail -= take;
            took += take;
            let exit = m.ctas - take;
            if exit > 0 {
                self.release(m.sm, &cost, exit, true);
                left += exit;
                self.record(TraceEvent::Release {
                    launch: id,
                    sm: m.sm,
                    ctas: exit,
                    blocks: exit * iters,
                    idle: false,
                    at_ns: t,
                });
                if self.grids[g].report_ctas {
                    self.notify(GpuEvent::CtasFinished { launch: id, sm: m.sm, ctas: exit, blocks: exit * iters, at_ns: t }, t);
                }
            }
            if take > 0 {
                next.push(Member { sm: m.sm, ctas: take, iters });
            }
        }
        self.stats.blocks += done_blocks;
        if took > 0 {
            let first = self.grids[g].next_block;
            self.grids[g].next_block += took;
            self.record(TraceEvent::Take { launch: id, first, count: took, at_ns: t });
            self.note_start(g, first, t);
            self.poll_flag(g, t);
        }
        if left > 0 {
            let grid = &mut self.grids[g];
            grid.ctas_live -= left;
            grid.ctas_working -= left;
            self.pool_epoch += 1;
            self.dirty_place = true;
        }
        if next.is_empty() {
            self.remove_cohort(c, members);
            self.spare_members.push(next);
            self.maybe_finish(g, t);
        } else {
            self.start_blocks(g, next, Some((c, members)), t);
        }
    }

    /// Reports the launch's start when a take handed out its first block (and it asked for that).
    fn note_start(&mut self, g: u32, first: u32, t: u64) {
        let grid = &self.grids[g];
        if first == grid.first_block && grid.report_start {
            let id = grid.id;
            self.notify(GpuEvent::LaunchStarted { launch: id, at_ns: t }, t);
        }
    }

    /// A take that got a block reads the launch's flag. In device memory
    /// (`preempt_flag_write_ns` set) every take reads it before taking, which `preempt` models as
    /// the stop bit set when the write lands; nothing to do here. In host memory: the take claims
    /// the poll when the last one is `preempt_poll_ns` old (the first claim only starts the
    /// clock), and a poll that finds the flag set makes the stop bit visible one PCIe read
    /// (`preempt_flag_delay_ns`) later.
    fn poll_flag(&mut self, g: u32, t: u64) {
        let lat = &self.desc.latency;
        let grid = &mut self.grids[g];
        if lat.preempt_flag_write_ns.is_some() {
            // Takes read the device flag before taking: `preempt` set the stop for when it lands.
            return;
        }
        if grid.last_poll_ns == 0 {
            grid.last_poll_ns = t.max(1);
        } else if t - grid.last_poll_ns >= lat.preempt_poll_ns {
            grid.last_poll_ns = t;
            if grid.host_flag && grid.stop_ns.is_none() {
                let at = t + lat.preempt_flag_delay_ns;
                grid.stop_ns = Some(at);
                self.schedule(at, Ev::FlagVisible);
            }
        }
    }

    /// The launch's last CTA, on SM `sm` (outside the mask), becomes a working CTA and runs the
    /// blocks left.
    fn rescue(&mut self, g: u32, sm: u32, t: u64) {
        let (id, cost) = (self.grids[g].id, self.grids[g].cost);
        self.sms[sm as usize].load += cost.load;
        let first = {
            let grid = &mut self.grids[g];
            grid.ctas_working += 1;
            grid.rescued = true;
            let first = grid.next_block;
            grid.next_block += 1;
            if !grid.in_running {
                grid.in_running = true;
                self.running.push(g);
            }
            first
        };
        self.pool_epoch += 1;
        self.record(TraceEvent::Rescue { launch: id, sm, at_ns: t });
        self.record(TraceEvent::Take { launch: id, first, count: 1, at_ns: t });
        if self.grids[g].report_ctas {
            self.notify(GpuEvent::CtasPlaced { launch: id, sm, ctas: 1, at_ns: t }, t);
        }
        self.note_start(g, first, t);
        self.poll_flag(g, t);
        let mut members = self.member_vec();
        members.push(Member { sm, ctas: 1, iters: 0 });
        self.start_blocks(g, members, None, t);
    }

    fn member_vec(&mut self) -> Vec<Member> {
        let mut v = self.spare_members.pop().unwrap_or_default();
        v.clear();
        v
    }

    /// Frees a cohort slot, keeping its member list's allocation for reuse.
    fn remove_cohort(&mut self, c: u32, members: Vec<Member>) {
        let old = self.cohorts.remove(c);
        self.spare_members.push(members);
        if old.members.capacity() > 0 {
            self.spare_members.push(old.members);
        }
    }

    fn maybe_finish(&mut self, g: u32, t: u64) {
        let grid = &self.grids[g];
        if grid.ctas_live == 0 && grid.ctas_unplaced == 0 && grid.state == GridState::InCwd && !grid.in_tail {
            if grid.tail_ns > 0 {
                // The SMs are free; the launch completes for its stream and the host after its tail.
                let end = t + grid.tail_ns;
                self.grids[g].in_tail = true;
                self.schedule(end, Ev::TailEnd(g));
            } else {
                self.finish_grid(g, t);
            }
        }
    }

    /// The launch's last CTA left: report it, compute its blocks, complete it for its stream soon.
    fn finish_grid(&mut self, g: u32, t: u64) {
        let (id, first, next, preempted) = {
            let grid = &mut self.grids[g];
            debug_assert_eq!(grid.state, GridState::InCwd);
            grid.state = GridState::Finished;
            // As the protocol reports it: stopped early (only a preemption or the gate can do that).
            let preempted = grid.next_block < grid.end_block;
            (grid.id, grid.first_block, grid.next_block, preempted)
        };
        let stream = self.grids[g].stream as usize;
        if first < self.grids[g].end_block {
            self.streams[stream].gate_closed = preempted;
        }
        if preempted && let Some(w) = self.grids[g].stop_word {
            // Whatever raised it (a raise may land after the clear queued behind it), the next
            // launch that carries it clears it.
            if let Some(word) = self.stop_words[w as usize].as_mut() {
                word.needs_clear = true;
            }
        }
        if let Some(pos) = self.cwd.iter().position(|&x| x == g) {
            self.cwd.remove(pos);
        }
        if self.grids[g].silent {
            let word = self.grids[g].stop_word;
            self.streams[stream].silent_done.push((id, next, preempted, word));
        } else {
            // Stream order: the silent launches before it have ended, reported with it.
            for (launch, next_block, preempted, _) in std::mem::take(&mut self.streams[stream].silent_done) {
                self.notify(GpuEvent::LaunchDone { launch, next_block, preempted, at_ns: t }, t);
            }
            self.notify(GpuEvent::LaunchDone { launch: id, next_block: next, preempted, at_ns: t }, t);
        }
        self.record(TraceEvent::Done { launch: id, first_block: first, next_block: next, preempted, at_ns: t });
        if self.opts.compute && next > first {
            let grid = &self.grids[g];
            if let Err(e) = self.mem.run_kernel(&grid.kernel, grid.dtype, &grid.args, first..next) {
                self.error = Some(format!("launch {id:?} ran on memory that was freed: {e}"));
            }
        }
        let lat = &self.desc.latency;
        let complete_ns = match lat.graph_node_gap_ns {
            // A graph's node completes for its stream within the node gap (the next node's
            // dispatch takes the rest, in `dispatch_queues`).
            Some(gap) if self.grids[g].replay.is_some() => gap.min(lat.grid_complete_ns),
            _ => lat.grid_complete_ns,
        };
        self.schedule(t + complete_ns, Ev::GridComplete(g));
    }

    fn grid_complete(&mut self, g: u32, t: u64) {
        let grid = self.grids.remove(g);
        if grid.in_running {
            self.running.retain(|&x| x != g);
        }
        self.launch_slots.remove(&grid.id.0);
        self.streams[grid.stream as usize].busy = false;
        self.cwd_grids -= 1;
        self.dirty_queues = true;
        self.record(TraceEvent::Complete { launch: grid.id, at_ns: t });
    }

    // ---------------------------------------------------------------- copy engines

    fn start_engine(&mut self, dir: Dir, t: u64) {
        let e = &mut self.engines[dir as usize];
        if e.active.is_none()
            && let Some(c) = e.fifo.pop_front()
        {
            e.active = Some(c);
            self.schedule(t + self.desc.latency.copy_setup_ns, Ev::CopyBegin(c));
        }
    }

    fn copy_rate(&mut self, dir: Dir) -> f64 {
        let lv = self.levels();
        let d = &self.desc;
        match dir {
            Dir::H2D => (d.h2d_bytes_per_s / 1e9).min(lv.h2d),
            Dir::D2H => (d.d2h_bytes_per_s / 1e9).min(lv.d2h),
            Dir::D2D => (2.0 * d.d2d_copy_bytes_per_s / 1e9).min(lv.dev) / 2.0,
        }
    }

    fn copy_begin(&mut self, c: u32, t: u64) {
        self.copies[c].active = true;
        self.copies[c].last_ns = t;
        self.copies_active += 1;
        self.pool_epoch += 1;
        let id = self.copies[c].id;
        self.record(TraceEvent::CopyStart { copy: id, at_ns: t });
        self.reschedule_copy(c, t);
    }

    fn reschedule_copy(&mut self, c: u32, t: u64) {
        let rate = self.copy_rate(self.copies[c].dir);
        let op = &mut self.copies[c];
        op.done_bytes += op.rate * (t - op.last_ns) as f64;
        op.last_ns = t;
        op.rate = rate;
        // Generations are unique across copies (the event sequence number), so a stale end event
        // never matches.
        op.generation = self.seq + 1;
        let left = (op.bytes as f64 - op.done_bytes).max(0.0);
        let generation = op.generation;
        self.schedule(t + (left / rate).ceil() as u64, Ev::CopyEnd(c, generation));
    }

    fn update_copy_rates(&mut self, t: u64) {
        self.copies_epoch = self.pool_epoch;
        for dir in [Dir::H2D, Dir::D2H, Dir::D2D] {
            if let Some(c) = self.engines[dir as usize].active
                && self.copies[c].active
                && self.copy_rate(dir) != self.copies[c].rate
            {
                self.reschedule_copy(c, t);
            }
        }
    }

    fn copy_end(&mut self, c: u32, generation: u64, t: u64) {
        // A copy whose rate changed has a newer end event; the slot may even hold a new copy.
        if self.copies.get(c).is_none_or(|op| op.generation != generation) {
            return;
        }
        let op = self.copies.remove(c);
        self.engines[op.dir as usize].active = None;
        self.copies_active -= 1;
        self.pool_epoch += 1;
        if self.opts.compute {
            self.mem.copy(op.dst, op.src, op.bytes);
        }
        self.record(TraceEvent::CopyEnd { copy: op.id, at_ns: t });
        self.notify(GpuEvent::CopyDone { copy: op.id, at_ns: t }, t);
        self.streams[op.stream as usize].busy = false;
        self.dirty_queues = true;
        self.start_engine(op.dir, t);
    }

    fn peer_copy_end(&mut self, c: u32, t: u64) {
        let op = self.copies.remove(c);
        if self.opts.compute {
            self.mem.copy(op.dst, op.src, op.bytes);
        }
        self.notify(GpuEvent::CopyDone { copy: op.id, at_ns: t }, t);
        // Streams waiting for it may go on.
        self.dirty_queues = true;
    }

    // ---------------------------------------------------------------- host side

    fn check_stream(&self, stream: StreamId) -> Result<u32> {
        match self.streams.get(stream.0 as usize) {
            Some(s) if s.alive => Ok(stream.0),
            _ => Err(GpuError::Invalid(format!("unknown or destroyed stream {stream:?}"))),
        }
    }

    fn enqueue(&mut self, stream: u32, cmd: Cmd) -> Result<(u32, u64)> {
        let q = self.streams[stream as usize].queue as usize;
        if self.queues[q].cmds.len() >= QUEUE_DEPTH_MAX {
            return Err(GpuError::Exhausted { limit: "hardware queue depth", max: QUEUE_DEPTH_MAX as u64 });
        }
        let latency = self.latency_ns(self.desc.latency.launch_latency_ns);
        let arrive = (self.now_ns + latency).max(self.queues[q].last_arrive_ns);
        self.queues[q].last_arrive_ns = arrive;
        self.queues[q].cmds.push_back(QueuedCmd { arrive_ns: arrive, stream, cmd });
        self.schedule(arrive, Ev::Arrive);
        Ok((q as u32, arrive))
    }

    fn in_use(&self, a: &Allocation) -> Option<String> {
        let inside = |r: &Resolved| r.base == a.ptr.0;
        for (_, g) in self.grids.iter() {
            if g.args.iter().any(inside) {
                return Some(format!("launch {:?}", g.id));
            }
        }
        for (_, c) in self.copies.iter() {
            if inside(&c.dst) || inside(&c.src) {
                return Some(format!("copy {:?}", c.id));
            }
        }
        None
    }

    /// The (destination, source) ranges of an asynchronous copy, checked: not empty, inside
    /// allocations, not in a host mapping, and room for one more copy in flight.
    fn copy_ranges(&self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(Resolved, Resolved)> {
        if bytes == 0 {
            return Err(GpuError::Invalid("copy of 0 bytes".into()));
        }
        let d = self.mem.resolve_range(dst, bytes, "copy destination")?;
        let r = self.mem.resolve_range(src, bytes, "copy source")?;
        self.not_mapped(&d, "copy destination")?;
        self.not_mapped(&r, "copy source")?;
        if self.copies.len() >= COPIES_IN_FLIGHT_MAX {
            return Err(GpuError::Exhausted { limit: "copies in flight", max: COPIES_IN_FLIGHT_MAX as u64 });
        }
        Ok((d, r))
    }

    /// Refuses host and copy-engine access to caller memory mapped with `map_host`.
    fn not_mapped(&self, r: &Resolved, what: &str) -> Result<()> {
        if self.mem.is_mapping(r.base) {
            return Err(GpuError::Invalid(format!(
                "{what} at {:#x}: inside a host mapping, which the host reads and writes itself",
                r.base + r.offset
            )));
        }
        Ok(())
    }

    fn sync_copy_ns(&self, bytes: usize, kind: MemKind, to_device: bool) -> u64 {
        let d = &self.desc;
        let rate = match (kind, to_device) {
            (MemKind::HostMapped, _) => d.host_memcpy_bytes_per_s,
            (MemKind::Device, true) => d.h2d_bytes_per_s,
            (MemKind::Device, false) => d.d2h_bytes_per_s,
        };
        d.latency.copy_setup_ns + (bytes as f64 / rate * 1e9).ceil() as u64
    }
}

impl SimGpu {
    /// The live stop word `w`.
    fn stop_word(&self, w: StopWordId) -> Result<&StopWord> {
        self.stop_words
            .get(w.0 as usize)
            .and_then(|x| x.as_ref())
            .ok_or_else(|| GpuError::Invalid(format!("unknown stop word {}", w.0)))
    }

    /// Raises launch `g`'s preempt flag: one store to mapped host memory, or a stream write that
    /// lands in device memory a while later; CTAs find it at their next poll or take (see
    /// `poll_flag`).
    fn raise_flag(&mut self, g: u32) {
        let grid = &mut self.grids[g];
        if grid.state == GridState::Finished {
            return;
        }
        grid.host_flag = true;
        grid.flag_at_ns = self.now_ns + self.desc.latency.preempt_flag_write_ns.unwrap_or(0);
        if self.desc.latency.preempt_flag_write_ns.is_some() && grid.stop_ns.is_none() {
            // Every take from then on finds the device flag first and takes nothing.
            let at = grid.flag_at_ns;
            grid.stop_ns = Some(at);
            self.schedule(at, Ev::FlagVisible);
        }
    }

    /// Raises stop word `w` (a stream write, as a device flag): launches that carry it and leave
    /// their queue after it lands run no block (see `dispatch_queues`); a preemptible
    /// one that already left stops as if preempted; a run's launch that already left runs whole
    /// (on CUDA it may stop part-way and run again: the simulator keeps the simpler case).
    fn raise_stop_word(&mut self, w: u32) {
        let at = self.now_ns + self.desc.latency.preempt_flag_write_ns.unwrap_or(0);
        let Some(word) = self.stop_words.get_mut(w as usize).and_then(|x| x.as_mut()) else { return };
        word.needs_clear = true;
        if word.raised_at_ns.is_some() {
            return;
        }
        word.raised_at_ns = Some(at);
        let running: Vec<u32> = self
            .grids
            .iter()
            .filter(|(_, g)| g.stop_word == Some(w) && !g.silent && matches!(g.state, GridState::Dispatching | GridState::InCwd))
            .map(|(i, _)| i)
            .collect();
        for g in running {
            self.raise_flag(g);
        }
    }

    /// [`Gpu::launch`] proper (the trait method adds what a failed launch means for silent ones).
    fn launch_request(&mut self, req: &LaunchRequest<'_>) -> Result<LaunchId> {
        self.check_sticky()?;
        if self.roll(self.opts.faults.launch_failure) {
            return Err(GpuError::Driver("launch failed (injected fault)".into()));
        }
        let s = self.check_stream(req.stream)?;
        let partition = req.partition.0 as usize;
        let Some(part) = self.info.partitions.get(partition).map(|p| p.sms) else {
            return Err(GpuError::Invalid(format!("unknown partition {:?}", req.partition)));
        };
        let mask = req.sm_mask.intersect(&part);
        if mask.is_empty() {
            return Err(GpuError::Invalid(format!("SM mask {:?} has no SM in partition {partition}", req.sm_mask)));
        }
        let n = req.kernel.logical_blocks();
        if req.shape.logical_blocks != n {
            return Err(GpuError::Invalid(format!(
                "{}: shape says {} logical blocks, the kernel has {n}",
                req.kernel.name(),
                req.shape.logical_blocks
            )));
        }
        if req.first_block > n {
            return Err(GpuError::Invalid(format!("first block {} beyond the kernel's {n} blocks", req.first_block)));
        }
        if req.args.len() != timing::arg_count(req.kernel) {
            return Err(GpuError::Invalid(format!(
                "{} takes {} arguments, got {}",
                req.kernel.name(),
                timing::arg_count(req.kernel),
                req.args.len()
            )));
        }
        if req.ctas > CTAS_PER_LAUNCH_MAX {
            return Err(GpuError::Invalid(format!("{} CTAs asked, at most {CTAS_PER_LAUNCH_MAX}", req.ctas)));
        }
        if req.after.is_some() && req.after != self.streams[s as usize].last_launch {
            return Err(GpuError::Invalid(format!(
                "launch gated after {:?}, but the last launch on stream {} is {:?}",
                req.after, req.stream.0, self.streams[s as usize].last_launch
            )));
        }
        if self.grids.len() >= LAUNCHES_IN_FLIGHT_MAX {
            return Err(GpuError::Exhausted { limit: "launches in flight", max: LAUNCHES_IN_FLIGHT_MAX as u64 });
        }
        if let Some(w) = req.stop_word {
            self.stop_word(w)?;
        }
        let mut args = Vec::with_capacity(req.args.len());
        for (i, &p) in req.args.iter().enumerate() {
            args.push(self.mem.resolve(p).ok_or_else(|| {
                GpuError::Invalid(format!("{} argument {i}: {p:?} is not inside a live allocation", req.kernel.name()))
            })?);
        }
        let (res, measured) = self.resources_of(req.kernel, req.dtype, &req.shape)?;
        let limits = self.desc.sm_limits;
        let occ = res.occupancy(&limits);

        // Which share of the kernel's bytes crosses PCIe.
        let bytes = timing::arg_bytes(req.kernel, req.dtype);
        let total: u64 = bytes.iter().sum();
        let mut host = HostSplit::default();
        if total > 0 {
            let last = args.len() - 1;
            for (i, (r, b)) in args.iter().zip(&bytes).enumerate() {
                if r.kind == MemKind::HostMapped {
                    if i == last {
                        host.write += *b as f64 / total as f64;
                    } else {
                        host.read += *b as f64 / total as f64;
                    }
                }
            }
        }
        let model = timing::calibrate(
            &self.desc,
            &LaunchSpec {
                kernel: req.kernel,
                dtype: req.dtype,
                occupancy: occ,
                sm_count: mask.count(),
                host,
                measured: measured.as_ref(),
            },
        );
        let jitter = self.lognormal(self.desc.model.kernel_duration_sigma);
        let remaining = n - req.first_block;
        let partition_count = part.count();
        let ctas = if req.ctas > 0 {
            req.ctas
        } else if mask == part {
            remaining.min(partition_count * occ).max(1)
        } else {
            // CTAs land anywhere in the partition and those outside the mask leave: ask for enough
            // to fill the whole partition so the masked SMs fill too.
            partition_count * occ
        };
        let id = LaunchId(self.next_launch);
        let g = self.grids.insert(Grid {
            id,
            kernel: *req.kernel,
            dtype: req.dtype,
            args,
            stream: s,
            priority: self.streams[s as usize].priority,
            partition: partition as u32,
            partition_sms: part,
            mask,
            cost: CtaCost {
                threads: res.threads_per_cta,
                registers: res.registers_per_cta(),
                shared_mem_bytes: res.shared_mem_bytes,
                load: LOAD_UNIT / occ as u64,
            },
            first_block: req.first_block,
            end_block: n,
            next_block: req.first_block,
            ctas_unplaced: ctas,
            report_ctas: req.report_ctas,
            report_start: req.report_start,
            silent: !req.report_end && !req.report_ctas && !req.report_start && !req.preemptible,
            ctas_live: 0,
            ctas_working: 0,
            model,
            tail_ns: self.launch_tail_ns(req, &mask, &part),
            in_tail: false,
            jitter,
            host_flag: false,
            flag_at_ns: 0,
            last_poll_ns: 0,
            stop_ns: None,
            state: GridState::Queued,
            cwd_seq: 0,
            in_running: false,
            cohort_ends: BTreeMap::new(),
            rescued: false,
            stalled_at: NOT_STALLED,
            gated: req.after.is_some(),
            stop_word: None,
            clears_stop_word: false,
            replay: self.replaying.then_some(self.replays),
        });
        let (queue, arrive) = match self.enqueue(s, Cmd::Kernel(g)) {
            Ok(x) => x,
            Err(e) => {
                self.grids.remove(g);
                return Err(e);
            }
        };
        self.next_launch += 1;
        if let Some(w) = req.stop_word {
            // Raised since it was last cleared: this launch clears it as it leaves its queue.
            let word = self.stop_words[w.0 as usize].as_mut().expect("checked above");
            self.grids[g].stop_word = Some(w.0);
            self.grids[g].clears_stop_word = std::mem::take(&mut word.needs_clear);
        }
        self.streams[s as usize].last_launch = Some(id);
        self.launch_slots.insert(id.0, g);
        self.stats.launches += 1;
        if self.faults_on {
            self.inject_launch_faults(id, g);
        }
        self.record(TraceEvent::Issue { launch: id, stream: req.stream, queue, at_ns: self.now_ns, arrive_ns: arrive });
        if !self.replaying {
            self.host_spend(self.desc.latency.launch_host_ns);
        }
        Ok(id)
    }

    /// A profiled launch's completion tail: lighter for the launches kairos-cuda runs light or
    /// silent (see [`crate::LatencyDesc::light_launch_tail_ns`]).
    fn launch_tail_ns(&self, req: &LaunchRequest<'_>, mask: &SmMask, part: &SmMask) -> u64 {
        let tail = self.timing.tail_ns(req.kernel, req.dtype);
        let light = !req.preemptible && !req.report_ctas && mask == part;
        let lat = &self.desc.latency;
        match (tail, light) {
            (0, _) | (_, false) => tail,
            _ if !req.report_end && !req.report_start => lat.silent_launch_tail_ns.or(lat.light_launch_tail_ns).unwrap_or(tail),
            _ => lat.light_launch_tail_ns.unwrap_or(tail),
        }
    }

    /// A launch on stream `s` failed to queue: the silent launches before it on the stream, which
    /// counted on a later launch to report their end, report their own (as the CUDA backend does).
    fn unsilence(&mut self, s: usize) {
        let live: Vec<u32> = self.launch_slots.values().copied().collect();
        for g in live {
            let grid = &mut self.grids[g];
            if grid.stream as usize == s {
                grid.silent = false;
            }
        }
        let now = self.now_ns;
        for (launch, next_block, preempted, _) in std::mem::take(&mut self.streams[s].silent_done) {
            self.notify(GpuEvent::LaunchDone { launch, next_block, preempted, at_ns: now }, now);
        }
    }
}

impl Gpu for SimGpu {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn now_ns(&self) -> u64 {
        self.now_ns
    }

    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        self.check_sticky()?;
        self.mem.alloc(bytes, kind)
    }

    fn free(&mut self, allocation: Allocation) -> Result<()> {
        if let Some(user) = self.in_use(&allocation) {
            return Err(GpuError::Invalid(format!("free of {:?} while {user} in flight uses it", allocation.ptr)));
        }
        self.mem.free(&allocation)
    }

    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.check_sticky()?;
        let r = self.mem.resolve_range(dst, data.len() as u64, "write")?;
        self.not_mapped(&r, "write")?;
        self.mem.write(r, data);
        let ns = self.sync_copy_ns(data.len(), r.kind, true);
        self.host_spend(ns);
        Ok(())
    }

    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.check_sticky()?;
        let r = self.mem.resolve_range(src, out.len() as u64, "read")?;
        self.not_mapped(&r, "read")?;
        let ns = self.sync_copy_ns(out.len(), r.kind, false);
        self.host_spend(ns);
        self.mem.read(r, out);
        Ok(())
    }

    fn copy_async(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<CopyId> {
        self.check_sticky()?;
        let s = self.check_stream(stream)?;
        let (d, r) = self.copy_ranges(dst, src, bytes)?;
        let dir = match (r.kind, d.kind) {
            (MemKind::Device, MemKind::Device) => Dir::D2D,
            (MemKind::Device, MemKind::HostMapped) => Dir::D2H,
            (MemKind::HostMapped, _) => Dir::H2D,
        };
        let id = CopyId(self.next_copy);
        let c = self.copies.insert(CopyOp::new(id, d, r, bytes, s, dir));
        let (queue, arrive) = match self.enqueue(s, Cmd::Copy(c)) {
            Ok(x) => x,
            Err(e) => {
                self.copies.remove(c);
                return Err(e);
            }
        };
        self.next_copy += 1;
        self.stats.copies += 1;
        self.record(TraceEvent::IssueCopy { copy: id, stream, queue, at_ns: self.now_ns, arrive_ns: arrive });
        self.host_spend(self.desc.latency.launch_host_ns);
        Ok(id)
    }

    fn wait_copy(&mut self, stream: StreamId, copy: CopyId) -> Result<()> {
        self.check_sticky()?;
        let s = self.check_stream(stream)?;
        if copy.0 >= self.next_copy {
            return Err(GpuError::Invalid(format!("copy {} was never queued", copy.0)));
        }
        if !self.copies.iter().any(|(_, c)| c.id == copy) {
            return Ok(());
        }
        self.enqueue(s, Cmd::WaitCopy(copy))?;
        Ok(())
    }

    fn peer_paths(&self) -> Vec<PeerPath> {
        self.peers.iter().map(|p| p.path).collect()
    }

    fn peer_busy(&self, peer: usize) -> bool {
        // The simulated secondary serves no load of its own: busy with this GPU's copies only.
        self.peers.get(peer).is_some_and(|p| p.forward_free_ns > self.now_ns)
    }

    fn copy_via_peer(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, peer: usize) -> Result<CopyId> {
        self.check_sticky()?;
        if peer >= self.peers.len() {
            return Err(GpuError::Invalid(format!("{} secondary GPU(s) attached, not {}", self.peers.len(), peer + 1)));
        }
        let (d, r) = self.copy_ranges(dst, src, bytes)?;
        if (r.kind, d.kind) != (MemKind::HostMapped, MemKind::Device) {
            return Err(GpuError::Invalid("a copy through a secondary GPU goes from pinned host memory to device memory".into()));
        }
        // Piece by piece: the secondary's PCIe link, then its forward, a staging slot reused only
        // after the forward of the piece in it ended.
        let start_ns = self.now_ns + self.desc.latency.copy_setup_ns;
        let p = &mut self.peers[peer];
        let mut left = bytes;
        let mut end_ns = start_ns;
        let mut pieces = 0u64;
        while left > 0 {
            let len = left.min(PEER_PIECE_BYTES);
            left -= len;
            pieces += 1;
            let slot = p.next_slot;
            p.next_slot = (slot + 1) % p.slot_free_ns.len();
            let h2d_start = start_ns.max(p.h2d_free_ns).max(p.slot_free_ns[slot]);
            p.h2d_free_ns = h2d_start + (len as f64 / p.path.h2d_bytes_per_s * 1e9).ceil() as u64;
            let forward_start = p.h2d_free_ns.max(p.forward_free_ns);
            p.forward_free_ns = forward_start + (len as f64 / p.path.forward_bytes_per_s * 1e9).ceil() as u64;
            p.slot_free_ns[slot] = p.forward_free_ns;
            end_ns = p.forward_free_ns;
        }
        let id = CopyId(self.next_copy);
        // On no engine and no stream (stream 0 is never marked busy by it): Ev::PeerCopyEnd ends it.
        let c = self.copies.insert(CopyOp::new(id, d, r, bytes, 0, Dir::H2D));
        self.schedule(end_ns, Ev::PeerCopyEnd(c));
        self.next_copy += 1;
        self.stats.copies += 1;
        // Each piece is a host copy, two event records, a stream wait and a forward.
        self.host_spend(pieces * self.desc.latency.launch_host_ns);
        Ok(id)
    }

    fn create_stream(&mut self, priority: i32) -> Result<StreamId> {
        self.check_sticky()?;
        if self.streams.len() - self.streams_destroyed >= STREAMS_MAX {
            return Err(GpuError::Exhausted { limit: "streams", max: STREAMS_MAX as u64 });
        }
        let id = self.streams.len() as u32;
        self.streams.push(Stream {
            alive: true,
            priority,
            queue: id % self.desc.hardware_queues,
            busy: false,
            gate_closed: false,
            silent_done: Vec::new(),
            last_replay: None,
            last_launch: None,
        });
        Ok(StreamId(id))
    }

    fn destroy_stream(&mut self, stream: StreamId) -> Result<()> {
        let s = self.check_stream(stream)?;
        self.streams[s as usize].alive = false;
        self.streams_destroyed += 1;
        Ok(())
    }

    fn kernel_resources(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> Result<KernelResources> {
        let (res, _) = self.resources_of(kernel, dtype, shape)?;
        Ok(res.to_resources(&self.desc.sm_limits))
    }

    fn launch(&mut self, req: &LaunchRequest<'_>) -> Result<LaunchId> {
        let r = self.launch_request(req);
        if r.is_err()
            && let Ok(s) = self.check_stream(req.stream)
        {
            self.unsilence(s as usize);
        }
        r
    }

    fn record_run(&mut self, launches: &[LaunchRequest<'_>]) -> Result<RunId> {
        self.check_sticky()?;
        if launches.is_empty() || launches.len() > RUN_LAUNCHES_MAX {
            return Err(GpuError::Invalid(format!("a run holds 1 to {RUN_LAUNCHES_MAX} launches, got {}", launches.len())));
        }
        if self.runs.len() >= RUNS_MAX {
            return Err(GpuError::Exhausted { limit: "recorded runs", max: RUNS_MAX as u64 });
        }
        let stop_word = launches[0].stop_word;
        if let Some(w) = stop_word {
            self.stop_word(w)?;
            if launches.len() > STOP_RUN_LAUNCHES_MAX {
                return Err(GpuError::Invalid(format!(
                    "a run with a stop word holds at most {STOP_RUN_LAUNCHES_MAX} launches, got {}",
                    launches.len()
                )));
            }
        }
        let mut recorded = Vec::with_capacity(launches.len());
        for (i, l) in launches.iter().enumerate() {
            // (CTA records may be asked for: the simulator reports a replay's CTAs, which test
            // harnesses use to audit every CTA.)
            if l.stop_word != stop_word || l.preemptible != stop_word.is_some() {
                return Err(GpuError::Invalid(format!(
                    "launch {i} of a run: its launches are preemptible exactly when they all carry the same stop word"
                )));
            }
            if l.report_start || l.report_end || l.after.is_some() {
                return Err(GpuError::Invalid(format!("launch {i} of a run is gated or reports itself")));
            }
            // On one partition, all of it (the whole device, or one of `partition_of_groups`).
            let part = self.info.partitions.get(l.partition.0 as usize).map(|p| p.sms);
            if l.partition != launches[0].partition || part.is_none_or(|p| l.sm_mask.intersect(&p) != p) {
                return Err(GpuError::Invalid(format!("launch {i} of a run is not on the whole of the run's partition")));
            }
            if let Some(p) = l.args.iter().find(|&&p| self.mem.resolve(p).is_none()) {
                return Err(GpuError::Invalid(format!("launch {i} of a run: {p:?} is not inside a live allocation")));
            }
            recorded.push(RecordedLaunch {
                kernel: *l.kernel,
                dtype: l.dtype,
                shape: l.shape,
                args: l.args.to_vec(),
                first_block: l.first_block,
                ctas: l.ctas,
                sm_mask: l.sm_mask,
                partition: l.partition,
                report_ctas: l.report_ctas,
                stop_word: l.stop_word,
            });
        }
        let id = self.next_run;
        self.next_run += 1;
        self.runs.insert(id, recorded);
        // Recording issues every launch once into the capture (and instantiates the graph).
        self.host_spend(self.desc.latency.launch_host_ns * launches.len() as u64);
        Ok(RunId(id))
    }

    fn launch_run(&mut self, run: RunId, stream: StreamId, ids: &mut Vec<LaunchId>) -> Result<()> {
        self.check_sticky()?;
        let launches = self.runs.remove(&run.0).ok_or_else(|| GpuError::Invalid(format!("unknown run {}", run.0)))?;
        let s = self.check_stream(stream)?;
        // One call of the host for the whole run (a graph launch); its launches go on one by one.
        self.replaying = true;
        self.replays += 1;
        let mut result = Ok(());
        for l in &launches {
            let request = LaunchRequest {
                kernel: &l.kernel,
                dtype: l.dtype,
                shape: l.shape,
                args: &l.args,
                first_block: l.first_block,
                ctas: l.ctas,
                sm_mask: l.sm_mask,
                partition: l.partition,
                stream,
                after: None,
                report_ctas: l.report_ctas,
                report_start: false,
                preemptible: false,
                report_end: false,
                stop_word: l.stop_word,
            };
            match self.launch_request(&request) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.replaying = false;
        self.runs.insert(run.0, launches);
        if result.is_err() {
            self.unsilence(s as usize);
        }
        self.host_spend(self.desc.latency.launch_host_ns);
        result
    }

    fn drop_run(&mut self, run: RunId) -> Result<()> {
        match self.runs.remove(&run.0) {
            Some(_) => Ok(()),
            None => Err(GpuError::Invalid(format!("unknown run {}", run.0))),
        }
    }

    /// Aligned groups of the partition granularity, the SMs left over joined to the last one (as
    /// CUDA's split does on an H200: 132 SMs in 15 groups of 8 and one of 12).
    fn sm_groups(&self) -> Vec<SmMask> {
        let (n, size) = (self.info.sm_count, self.info.partition_granularity_sms.max(1));
        let count = (n / size).max(1);
        (0..count).map(|g| SmMask::range(g * size, if g + 1 == count { n - g * size } else { size })).collect()
    }

    fn partition_of_groups(&mut self, groups: u64) -> Result<PartitionId> {
        self.check_sticky()?;
        if let Some(&p) = self.partition_by_groups.get(&groups) {
            return Ok(p);
        }
        let all = self.sm_groups();
        if groups == 0 || (all.len() < 64 && groups >> all.len() != 0) {
            return Err(GpuError::Invalid(format!("groups {groups:#x}: the device has {} SM groups", all.len())));
        }
        let sms = (0..all.len()).filter(|&g| groups >> g & 1 == 1).fold(SmMask::EMPTY, |m, g| m.union(&all[g]));
        let id = match self.info.partitions.iter().find(|p| p.sms == sms) {
            Some(p) => p.id,
            None => {
                if self.info.partitions.len() >= PARTITIONS_MAX {
                    return Err(GpuError::Exhausted { limit: "partitions", max: PARTITIONS_MAX as u64 });
                }
                let id = PartitionId(self.info.partitions.len() as u32);
                self.info.partitions.push(Partition { id, sms });
                self.partition_sms.push(sms.iter().collect());
                id
            }
        };
        self.partition_by_groups.insert(groups, id);
        Ok(id)
    }

    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        // A run's launch that ended but is not reported yet still names its stop word.
        let ended_word = || self.streams.iter().flat_map(|s| &s.silent_done).find(|x| x.0 == launch).and_then(|x| x.3);
        if !self.launch_slots.contains_key(&launch.0)
            && let Some(w) = ended_word()
        {
            self.raise_stop_word(w);
            return Ok(());
        }
        let Some(&g) = self.launch_slots.get(&launch.0) else {
            return if launch.0 > 0 && launch.0 < self.next_launch {
                Ok(())
            } else {
                Err(GpuError::Invalid(format!("unknown launch {launch:?}")))
            };
        };
        if let Some(w) = self.grids[g].stop_word {
            self.raise_stop_word(w);
            return Ok(());
        }
        self.raise_flag(g);
        Ok(())
    }

    fn create_stop_word(&mut self) -> Result<StopWordId> {
        self.check_sticky()?;
        let free = self.stop_words.iter().position(|w| w.is_none());
        let i = match free {
            Some(i) => i,
            None if self.stop_words.len() < STOP_WORDS_MAX => {
                self.stop_words.push(None);
                self.stop_words.len() - 1
            }
            None => return Err(GpuError::Exhausted { limit: "stop words", max: STOP_WORDS_MAX as u64 }),
        };
        self.stop_words[i] = Some(StopWord::default());
        Ok(StopWordId(i as u32))
    }

    fn destroy_stop_word(&mut self, word: StopWordId) -> Result<()> {
        self.stop_word(word)?;
        if self.grids.iter().any(|(_, g)| g.stop_word == Some(word.0)) {
            return Err(GpuError::Invalid(format!("stop word {} is carried by a launch in flight", word.0)));
        }
        self.stop_words[word.0 as usize] = None;
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        // A device with a sticky fault reports nothing more than the fault.
        self.check_sticky()?;
        let before = events.len();
        while let Some(&(deliver, e)) = self.outbox.front() {
            if deliver > self.now_ns {
                break;
            }
            self.outbox.pop_front();
            events.push(e);
            self.stats.events_delivered += 1;
            self.hash.delivered(&e, deliver);
            if self.opts.record_trace && self.trace.len() < TRACE_EVENTS_MAX {
                self.trace.push(TraceEvent::Deliver { event: e, at_ns: deliver });
            }
        }
        // The dispatcher's time on the records it just took (0 unless the description sets it).
        let delivered = (events.len() - before) as u64;
        if delivered > 0 && self.desc.latency.event_host_ns > 0 {
            self.host_spend(delivered * self.desc.latency.event_host_ns);
        }
        if let Some(e) = self.error.take() {
            return Err(GpuError::Invalid(e));
        }
        if std::mem::take(&mut self.overrun) {
            return Err(GpuError::Exhausted { limit: "notification ring", max: NOTIFY_RING_MAX as u64 });
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        let mut fresh = SimGpu::new(self.desc.clone(), self.opts.clone());
        // The clock, the random generator, what was measured and registered, and the record of
        // what happened go on; ids are not handed out again.
        fresh.rng = self.rng.clone();
        fresh.now_ns = self.now_ns;
        fresh.gpu_ns = self.gpu_ns.max(self.now_ns);
        fresh.last_deliver_ns = self.now_ns;
        fresh.next_launch = self.next_launch;
        fresh.next_copy = self.next_copy;
        fresh.timing = std::mem::take(&mut self.timing);
        fresh.hash = std::mem::take(&mut self.hash);
        fresh.trace = std::mem::take(&mut self.trace);
        fresh.stats = self.stats;
        fresh.next_run = self.next_run;
        fresh.peers = std::mem::take(&mut self.peers);
        for p in &mut fresh.peers {
            p.h2d_free_ns = 0;
            p.forward_free_ns = 0;
            p.slot_free_ns.iter_mut().for_each(|t| *t = 0);
        }
        fresh.stats.resets += 1;
        fresh.record(TraceEvent::Reset { at_ns: self.now_ns });
        *self = fresh;
        Ok(())
    }

    fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping> {
        self.check_sticky()?;
        if self.mem.mappings() >= HOST_MAPPINGS_MAX {
            return Err(GpuError::Exhausted { limit: "host mappings", max: HOST_MAPPINGS_MAX as u64 });
        }
        let bytes = memory.len_bytes();
        let base = self.mem.map_host(memory)?;
        Ok(HostMapping { id: HostMappingId(base), ptr: DevicePtr(base), bytes, align_bytes: HOST_MAPPING_ALIGN_BYTES })
    }

    fn unmap_host(&mut self, id: HostMappingId) -> Result<()> {
        if !self.mem.is_mapping(id.0) {
            return Err(GpuError::Invalid(format!("unmap of host mapping {:#x}, which is not mapped", id.0)));
        }
        // A launch computes its blocks when it ends (`finish_grid`); until then it still uses
        // the mapping.
        let user = self.grids.iter().find(|(_, g)| g.state != GridState::Finished && g.args.iter().any(|r| r.base == id.0));
        if let Some((_, g)) = user {
            return Err(GpuError::Invalid(format!("unmap of host mapping {:#x} while launch {:?} uses it", id.0, g.id)));
        }
        self.mem.unmap_host(id.0)
    }

    fn wait(&mut self, until_ns: u64) -> Result<()> {
        loop {
            let next_deliver = self.outbox.front().map_or(u64::MAX, |e| e.0);
            if next_deliver <= self.now_ns {
                return Ok(());
            }
            let next_step = self.heap.peek().map_or(u64::MAX, |e| e.at);
            let t = next_step.min(next_deliver);
            if t == u64::MAX && until_ns == u64::MAX {
                return Err(GpuError::Invalid("wait(u64::MAX) on a GPU with nothing in flight would never return".into()));
            }
            if t > until_ns {
                self.now_ns = self.now_ns.max(until_ns);
                return Ok(());
            }
            if next_step <= t {
                self.run_until(t);
            }
            self.now_ns = self.now_ns.max(t);
        }
    }
}

/// Rounds a duration up to whole nanoseconds, at least 1 (without a libm call on baseline x86-64).
#[inline]
fn ceil_ns(x: f64) -> u64 {
    let n = x as u64;
    (n + ((n as f64) < x) as u64).max(1)
}

/// An SM's room for CTAs of one grid: `fit` more fit, `free` thread slots are free, `take` is
/// how many the placement puts there.
#[derive(Clone, Copy, Debug)]
struct Slots {
    sm: u32,
    fit: u32,
    free: u32,
    take: u32,
}

thread_local! {
    /// Scratch space of `top_slots` (it runs once or twice per placement).
    static FREES: std::cell::RefCell<Vec<(u32, u32)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The one-by-one placement rule in closed form. Placing CTAs one at a time, each on the SM with
/// the most free threads (lowest id on ties) among those with room, takes the `k` largest of the
/// *slots* (sm, j < fit) with value free - j * threads, ties by SM id: an SM's slots come out in
/// decreasing order, so the process merges the SMs' lists. Find the value v of the k-th slot by
/// bisection, take every slot above v and the lowest-id slots equal to v. `cand` is in SM order.
fn top_slots(cand: &mut [Slots], threads: u32, k: u32) {
    debug_assert!(k > 0 && cand.iter().map(|c| c.fit as u64).sum::<u64>() > k as u64);
    let t = threads;
    let best = cand.iter().map(|c| c.free).max().unwrap_or(0);
    let mut lo;
    if (k as usize) <= cand.len() {
        // The k-th largest first slot bounds the k-th slot from below; if even the best SM's second
        // slot is below it, every SM gets at most one CTA: the k best SMs.
        let (kth_free, kth_sm) = FREES.with_borrow_mut(|frees| {
            frees.clear();
            frees.extend(cand.iter().map(|c| (c.free, c.sm)));
            frees.select_nth_unstable_by_key(k as usize - 1, |&(free, sm)| (Reverse(free), sm));
            frees[k as usize - 1]
        });
        if best - t < kth_free {
            for c in cand.iter_mut() {
                c.take = ((c.free, Reverse(c.sm)) >= (kth_free, Reverse(kth_sm))) as u32;
            }
            return;
        }
        lo = kth_free;
    } else {
        lo = cand.iter().map(|c| c.free - (c.fit - 1) * t).min().unwrap_or(0);
    }
    // Slots of value >= v (all of an SM's slots are >= free - (fit - 1) * t >= t > 0).
    // Thread counts are usually powers of two: shift instead of dividing in the hot loop.
    let div = |x: u32| if t.is_power_of_two() { x >> t.trailing_zeros() } else { x / t };
    let count_ge = |v: u32, cand: &[Slots]| -> u64 {
        cand.iter().map(|c| if c.free >= v { c.fit.min(div(c.free - v) + 1) as u64 } else { 0 }).sum()
    };
    let mut hi = best;
    // Largest v with count_ge(v) >= k.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if count_ge(mid, cand) >= k as u64 {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let v = lo;
    let mut taken = 0u64;
    for c in cand.iter_mut() {
        c.take = if c.free > v { c.fit.min((c.free - v - 1) / t + 1) } else { 0 };
        taken += c.take as u64;
    }
    let mut rest = k as u64 - taken;
    for c in cand.iter_mut() {
        if rest == 0 {
            break;
        }
        if c.free >= v && (c.free - v) % t == 0 && (c.free - v) / t < c.fit {
            c.take += 1;
            rest -= 1;
        }
    }
    debug_assert_eq!(rest, 0);
}

/// Water level of one pool: the running launches' CTAs (demand picked from their block model)
/// and an active copy, if any.
fn pool_level(
    flows: &mut Vec<Flow>,
    grids: &Slab<Grid>,
    running: &[u32],
    capacity: f64,
    pick: impl Fn(&BlockModel) -> f64,
    copy: Option<f64>,
) -> f64 {
    flows.clear();
    for &g in running {
        let x = &grids[g];
        let demand = pick(&x.model);
        if demand > 0.0 && x.ctas_working > 0 {
            flows.push(Flow { demand, count: x.ctas_working as f64 });
        }
    }
    if let Some(demand) = copy {
        flows.push(Flow { demand, count: 1.0 });
    }
    water_level(capacity, flows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngExt;

    /// The closed form against the one-by-one rule on random SM states.
    #[test]
    fn top_slots_matches_one_by_one_placement() {
        let mut rng = SmallRng::seed_from_u64(11);
        for _ in 0..20_000 {
            let t = [1, 32, 96, 128, 256, 1024][rng.random_range(0..6)];
            let n = rng.random_range(1..40);
            let mut cand: Vec<Slots> = (0..n)
                .filter_map(|sm| {
                    let free = rng.random_range(0..=2048u32);
                    let fit = rng.random_range(0..=free / t);
                    (fit > 0).then_some(Slots { sm, fit, free, take: 0 })
                })
                .collect();
            let total: u32 = cand.iter().map(|c| c.fit).sum();
            if total < 2 {
                continue;
            }
            let k = rng.random_range(1..total);
            let mut heap: BinaryHeap<(u32, Reverse<u32>, u32)> = cand.iter().map(|c| (c.free, Reverse(c.sm), c.fit)).collect();
            let mut want: BTreeMap<u32, u32> = BTreeMap::new();
            for _ in 0..k {
                let (free, Reverse(sm), fit) = heap.pop().unwrap();
                *want.entry(sm).or_default() += 1;
                if fit > 1 {
                    heap.push((free - t, Reverse(sm), fit - 1));
                }
            }
            top_slots(&mut cand, t, k);
            let got: BTreeMap<u32, u32> = cand.iter().filter(|c| c.take > 0).map(|c| (c.sm, c.take)).collect();
            assert_eq!(got, want, "t {t} k {k}");
        }
    }
}

//! [`CudaGpu`]: the `Gpu` trait on a real NVIDIA GPU.
//!
//! One `CudaGpu` owns the device's primary context, the protocol's launch slots and notification
//! ring, the compiled modules, the streams and the hardware partitions. It is driven from one
//! thread at a time (it is `Send`, not `Sync`) and binds its context to whichever thread calls it.
//!
//! - Streams: a `StreamId` is a FIFO of work that may move between partitions; it owns one CUDA
//!   stream per partition it has used (green-context streams for partitions other than 0), and
//!   when consecutive launches of it go to different partitions an event keeps them in order.
//! - Partitions: 0 is the whole device; the others are green contexts, by default the device's
//!   split into groups of its minimum partition size (8 SMs on H100/H200). Every partition's SM
//!   set is measured at creation with a %smid probe kernel, so `Partition::sms` is what the
//!   hardware does, not what was asked for.
//! - Launches: a launch takes a protocol slot; its notifications become `GpuEvent`s in `poll`; the
//!   slot returns when its `LaunchDone` is consumed.
//! - Clocks: event times are host nanoseconds since the `CudaGpu` was made; device timestamps
//!   (%globaltimer) are mapped to that clock with an offset calibrated at start-up (the smallest
//!   observed device-to-host delay, so a mapped time is never early by more than ~1 us).

use crate::driver::{self, CUdevice, CUdevice_attribute as A, DriverError};
use crate::launcher::{Failure, Job, Launchers};
use crate::nvrtc::{self, KernelCache, Variant};
use crate::protocol::{GATE_WORDS_MAX, Gate, LAUNCH_SLOTS_MAX, Protocol, RING_TIMEOUT_NS, Raise, Record, RingError, StopFlag};
use crate::safe::{Context, DeviceBuffer, Event, Function, GreenContext, MappedBuffer, Module, Stream};
use crate::settings::UrgentLaunches;
use kairos_gpu::idmap::IdMap;
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape, Plan};
use kairos_kernels::source::{self, ParamBlock};

/// The unit of the runtime helpers and measurement kernels.
const UTIL: source::Unit = source::Unit { module: source::Module::Util, entry: None };

fn compile_error(u: source::Unit, log: String) -> GpuError {
    GpuError::Compile { kernel: format!("kernel unit {}", u.name()), log }
}
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Instant;

/// Streams a `CudaGpu` will create.
pub const STREAMS_MAX: usize = 1024;
/// Copies in flight.
pub const COPIES_MAX: usize = 4096;
/// How fast the tracked device-clock offset is let down between records (see `track_clock`), in
/// parts per million of elapsed host time: above the drift seen (~10 ppm).
const CLOCK_DRIFT_PPM: i64 = 50;
/// Launcher threads that make the driver call of each protocol launch (see [`crate::launcher`] and
/// [`crate::settings::Settings::launch_threads`]) unless the settings say otherwise.
pub const LAUNCH_THREADS_DEFAULT: usize = 2;
/// How long the start-up SM probe keeps each CTA on its SM, so a grid spreads over all SMs.
const SM_PROBE_SPIN_NS: u64 = 50_000;

fn drv(e: DriverError) -> GpuError {
    GpuError::Driver(e.to_string())
}

/// A kernel launch prepared by `CudaGpu::direct_launch`.
struct DirectLaunch {
    f: Arc<FunctionInfo>,
    name: String,
    block: ParamBlock,
    o: LaunchOptions,
    dyn_smem: u32,
}

/// What [`CudaGpu::time_held`] measured.
#[derive(Clone, Debug)]
pub struct HeldTiming {
    /// Host time `issue` took.
    pub issue_ns: u64,
    /// Per stream, from the release to the end of its last work (device events).
    pub stream_ns: Vec<u64>,
    /// The hold ended before `issue` returned: the GPU may have started before all the work was
    /// queued, so the times include host launch costs.
    pub released_early: bool,
}

/// Extra launch settings of the runtime's own helpers and tests (not part of the `Gpu` trait).
#[derive(Clone, Copy, Debug)]
pub struct LaunchOptions {
    pub first_block: u32,
    pub ctas: u32,
    pub sm_mask: SmMask,
    pub partition: PartitionId,
    pub stream: StreamId,
    /// A device buffer of `SM_COUNT_MAX / 8` bytes where CTAs that run blocks set their SM's bit.
    pub sm_bitmap: Option<DevicePtr>,
    /// See [`LaunchRequest::after`].
    pub after: Option<LaunchId>,
}

struct FunctionInfo {
    f: Function,
    /// Per thread; for a function of a quick build, at least its entry's budget (the most its
    /// optimized build may use), so what the caller is told stays true after the swap.
    registers: u32,
    static_smem_bytes: u32,
    threads_max: u32,
    /// Most dynamic shared memory a launch of it may ask for.
    dyn_smem_max_bytes: u32,
    /// From a quick build: occupancy is worked out at `registers` (see [`CudaGpu::set_quick_builds`]).
    quick: bool,
}

/// A unit's optimized build compiled in the background, or why it failed.
type UpgradeImage = ((source::Unit, Variant), std::result::Result<nvrtc::Image, String>);

/// Optimized builds compiled in the background, waiting to replace the quick builds that serve
/// meanwhile (see [`CudaGpu::set_quick_builds`]).
#[derive(Default)]
struct Upgrades {
    done: std::sync::Mutex<Vec<UpgradeImage>>,
    /// Set when `done` has something: polled without the lock.
    ready: std::sync::atomic::AtomicBool,
}

struct StreamState {
    /// False once destroyed: its CUDA streams and events are released and the id is retired.
    alive: bool,
    priority: i32,
    by_partition: IdMap<u32, Stream>,
    last_partition: Option<u32>,
    /// Per partition, an event of that partition's context that orders a move to another.
    chain: IdMap<u32, Event>,
    /// The stream's gate word in the protocol's device memory, and the last protocol launch
    /// queued on the stream (its sequence number and id): see protocol.cuh, "Stream gate".
    gate_word: u32,
    last_seq: u32,
    last_launch: Option<LaunchId>,
    /// Whether the last launch queued may stop early (a launch under the full protocol, or one
    /// that reads the gate): only a launch behind such a one needs to read the gate.
    last_may_stop: bool,
    /// Silent launches queued here and not yet known done, in issue order: (issue order, id,
    /// logical blocks, its stop word and position in its run + 1, or `NO_STOP`). A later launch
    /// on the stream that reports its end implies theirs.
    silent: VecDeque<(u64, LaunchId, u32, (u32, u32))>,
    /// Launches queued here that report their end, in issue order: (issue order, id, whether its
    /// start is implied by the end of the one before it instead of a record of its own, when it
    /// was issued on the host clock).
    reporting: VecDeque<(u64, LaunchId, bool, u64)>,
}

struct PartitionState {
    sms: SmMask,
    green: Option<GreenContext>,
}

impl PartitionState {
    /// A new CUDA stream whose work runs on this partition (of its green context, or of the
    /// primary context for the whole device).
    fn stream(&self, priority: i32) -> Result<Stream> {
        match &self.green {
            Some(g) => g.stream(priority),
            None => Stream::new(priority),
        }
        .map_err(drv)
    }
}

struct InFlight {
    id: LaunchId,
    /// The CUDA stream it was queued on: (stream, partition).
    queue: (StreamId, u32),
    /// Device time of the first placement record.
    first_placed_ns: Option<u64>,
    /// Queued by the backend itself to report the silent launches before it (no event of its own).
    internal: bool,
    /// The stop word it carries (`LaunchRequest::stop_word`).
    stop_word: Option<u32>,
}

/// A silent launch that carries no stop word (`StreamState::silent`).
const NO_STOP: (u32, u32) = (u32::MAX, 0);

/// A stop word's books on the host (`Gpu::create_stop_word`).
#[derive(Clone, Copy, Debug, Default)]
struct StopWordState {
    /// A raise was queued since the word was last cleared (another would change nothing).
    raised: bool,
    /// The next launch or replay that carries it clears it first, in its stream's order.
    needs_clear: bool,
}

/// A recorded run: the CUDA graph of its launches, and each launch's logical blocks (what its
/// silent end reports).
struct RecordedRun {
    graph: crate::safe::Graph,
    blocks: Vec<u32>,
    /// The stop word its launches obey (`LaunchRequest::stop_word`).
    stop_word: Option<u32>,
    /// The partition it was recorded in: every replay runs there (measured on an H200: a graph
    /// captured on a green context's stream stays on its SMs wherever it is launched, one
    /// captured on the whole device does not), queued on the stream's CUDA stream of it.
    partition: u32,
}

/// Recorded runs one GPU holds at most (each is a CUDA graph instance in device memory).
pub const RUNS_MAX: usize = 16_384;

// Recorded runs replay the kernels built without the protocol (one CTA per logical block,
// nothing but the kernel's blocks: on an H100 the 8 mix models' whole jobs took 3.21 ms all at
// once so, against 3.77 ms as light protocol launches in a graph and 3.70 ms for PyTorch's CUDA
// graphs) when their units are at hand without compiling; `KAIROS_RUN_KERNELS=light`
// (`settings::Settings::run_kernels_plain`) records light, silent protocol launches instead.

/// Device-measured spans (first placement to LaunchDone) kept for lookups.
const SPANS_MAX: usize = 4096;
/// Events kept for the next `poll` (from helpers that wait for one launch) before that is an error.
const HOST_EVENTS_MAX: usize = 1 << 20;
/// How often a waiting host asks the driver whether a stream with work in flight has failed.
const HEALTH_CHECK_NS: u64 = 2_000_000;
/// Device-flag writes held back at most (`CudaGpu::pending_preempts`); more go out at once.
const PENDING_PREEMPTS_MAX: usize = 64;

enum Allocated {
    Device(DeviceBuffer),
    Host(MappedBuffer),
}

impl Allocated {
    fn bytes(&self) -> u64 {
        match self {
            Allocated::Device(b) => b.bytes(),
            Allocated::Host(b) => b.bytes(),
        }
    }
}

/// A real GPU behind the `Gpu` trait.
/// Where the host time of `Gpu::launch` goes: kairos' own work before the driver call (kernel
/// lookup, argument packing, launch slot, stream gate, protocol block) and the driver call
/// (`cuLaunchKernel`), summed over launches. The times are counted only while
/// [`CudaGpu::set_launch_timing`] is on; `launches` always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LaunchCosts {
    pub launches: u64,
    pub total_ns: u64,
    pub driver_ns: u64,
}

impl LaunchCosts {
    pub fn since(&self, before: &LaunchCosts) -> LaunchCosts {
        LaunchCosts {
            launches: self.launches - before.launches,
            total_ns: self.total_ns - before.total_ns,
            driver_ns: self.driver_ns - before.driver_ns,
        }
    }
}

/// A launch shape's entry function, resolved once.
struct Entry {
    f: Arc<FunctionInfo>,
    name: Arc<str>,
    ctas_per_sm: u32,
}

pub struct CudaGpu {
    /// Launcher threads (None: launches on the caller's thread). Joined first when dropped.
    launchers: Option<Launchers>,
    /// Launch on the caller's thread even with launchers (timed work).
    launch_inline: bool,
    /// Where urgent streams (above the default priority: real-time work) make their driver
    /// calls ([`crate::settings::Settings::urgent_launches`]).
    urgent_launches: UrgentLaunches,
    info: DeviceInfo,
    epoch: Instant,
    /// host_ns = device_ns - device_clock_offset_ns. Calibrated at start, then kept up to date
    /// from the records themselves (see `track_clock`): %globaltimer and the host's clock drift
    /// apart by ~10 ppm (130 µs after seconds, measured on an H100 host).
    device_clock_offset_ns: i64,
    /// Host time of the offset's last update.
    clock_tracked_ns: u64,
    host_events: VecDeque<GpuEvent>,
    records: Vec<Record>,
    in_flight: Vec<Option<InFlight>>,
    slot_of: IdMap<LaunchId, u32>,
    spans: VecDeque<(LaunchId, u64)>,
    /// Notification records read, and ring overflows recovered from (for metrics and reports).
    records_read: u64,
    /// Launch starts reported from the end of the launch before them instead of a record.
    starts_implied: u64,
    ring_overflows: u64,
    /// Records the notification ring holds.
    ring_capacity: u32,
    last_health_check_ns: u64,
    utility_stream: Option<StreamId>,
    next_launch: u64,
    /// Host time of the protocol launches so far, split at the driver call.
    launch_costs: LaunchCosts,
    /// Whether launch calls are timed into `launch_costs` (see `set_launch_timing`).
    time_launches: bool,
    /// Tests only: the launch call (counted in `launch_costs.launches`) that faults.
    fault_at_launch: Option<u64>,
    /// Tests only: the launch before which a kernel fills every SM, and how long each of its
    /// blocks spins (see [`CudaGpu::inject_hang_at_launch`]).
    hang_at_launch: Option<(u64, u64)>,
    next_copy: u64,
    copies: VecDeque<(CopyId, Event)>,
    spare_events: Vec<Event>,
    /// Recorded runs (CUDA graphs of their launches; [`Gpu::record_run`]), by id. Before the
    /// modules their kernels come from (field order).
    runs: HashMap<u64, RecordedRun>,
    next_run: u64,
    /// Runs are recorded with plain grids where their units are ready, else light protocol launches
    /// (`KAIROS_RUN_KERNELS`, [`crate::settings::Settings::run_kernels_plain`]).
    run_kernels_plain: bool,
    /// A background compilation of plain units for runs was started (once per process).
    run_plain_compiling: bool,
    /// The stream runs are captured on (created on first use).
    capture_stream: Option<StreamId>,
    allocations: BTreeMap<u64, Allocated>,
    functions: HashMap<(String, Variant), Arc<FunctionInfo>>,
    /// Per launch shape, what the launch path looks up (entry function, its name, CTAs per SM), so a
    /// launch builds no strings and hashes a small key once.
    entries: IdMap<(source::EntryKey, u32, u32), Entry>,
    modules: HashMap<(source::Unit, Variant), Arc<Module>>,
    /// Units whose missing optimized build starts as a quick one ([`CudaGpu::set_quick_builds`]).
    quick_builds: bool,
    /// Units running their quick build now; each has an optimized build compiling.
    quick_loaded: std::collections::BTreeSet<(source::Unit, Variant)>,
    upgrades: Arc<Upgrades>,
    /// Modules replaced by optimized builds: kept loaded, since launches queued before the swap
    /// may still run their functions (at most one per unit with a quick build).
    retired_modules: Vec<Arc<Module>>,
    /// Quick builds replaced by optimized ones so far.
    upgrades_applied: u64,
    occupancy: HashMap<(String, Variant, u32, u32), u32>,
    /// Most shared memory one CTA may have (static and dynamic, opted in).
    smem_optin_bytes: u32,
    cache: KernelCache,
    priority_range: (i32, i32),
    /// Streams must drop before the green contexts they belong to (field order).
    streams: Vec<StreamState>,
    /// Streams destroyed so far (their ids are retired; the limit counts live streams).
    streams_destroyed: usize,
    /// Gate words of destroyed streams, with the stream's last launch: free once it is done.
    retired_gate_words: Vec<(u32, Option<LaunchId>)>,
    /// Protocol launches go out as programmatic dependents of the kernel before them on their
    /// stream (sm_90+, opt-in through `KAIROS_OVERLAP_LAUNCHES=1`; protocol.cuh, "Overlapped launches").
    overlap_launches: bool,
    helper_stream: Stream,
    /// Carries `Gpu::write`'s copies (each waited for; nothing else runs on it).
    write_stream: Stream,
    /// Carries the stream writes that raise device-memory preempt flags (`StopFlag::Device`): a
    /// stream of its own at the highest priority, created before the pool so that it gets a
    /// hardware queue no kernel stream is ahead of it in.
    preempt_stream: Stream,
    /// Device-flag writes `preempt` has not queued yet: they go out right after the next launch
    /// has been handed to its launcher (a real-time kernel that follows a preemption is not held
    /// behind ~1.5 µs of driver call per preempted launch), or at the next poll.
    pending_preempts: Vec<(u64, u32)>,
    partitions: Vec<PartitionState>,
    partition_by_size: HashMap<u32, PartitionId>,
    /// The device's SM groups as green-context resources ([`Gpu::sm_groups`]): the default split,
    /// then the SMs left over (if any), with their SM sets (the split's probed, the rest deduced).
    groups: Vec<(driver::CUdevResource, SmMask)>,
    /// Partitions of unions of groups (each default group alone included, from start-up), by
    /// group bits, or why the driver refused the union (asked once).
    partition_by_groups: HashMap<u64, std::result::Result<PartitionId, String>>,
    /// Why green contexts are unavailable, when they are.
    pub green_note: Option<String>,
    /// Why secondaries attached before a reset are missing after it, when they are.
    pub peer_note: Option<String>,
    /// Caller memory mapped for zero-copy I/O (released before the context: field order).
    host_maps: crate::hostmap::HostMaps,
    /// Protocol flags for the next `launch_inner` (taken there): the host-memory fence.
    next_launch_flags: u32,
    /// The next launch's start is implied by the end of the one before it (see launch_with_inner).
    next_launch_implied_start: bool,
    /// Launches issued so far, in order (silent launches end before any reporting one after them).
    issue_order: u64,
    /// Launches the caller will not preempt run as light launches (protocol.cuh, point 7);
    /// `KAIROS_LIGHT_LAUNCHES=0` ([`crate::settings::Settings::light_launches`]) turns this off (every launch under the full protocol).
    light_launches: bool,
    /// CTAs per SM of the next launch's entry when the caller already knows them.
    next_launch_per_sm: Option<u32>,
    /// The stop word the next `launch_inner` carries: (id, its position in the run being
    /// recorded + 1, or 0).
    next_launch_stop: Option<(u32, u32)>,
    /// Position + 1 of the launch `record_run` is capturing (0: not recording).
    recording_pos: u32,
    /// Stop words (protocol.cuh point 8): `STOP_WORDS_MAX` words of `source::STOP_WORD_BYTES` in
    /// device memory, made on first use; and their books by id (None: free).
    run_stop_words: Option<DeviceBuffer>,
    stop_word_states: Vec<Option<StopWordState>>,
    protocol: Protocol,
    bound: Cell<Option<ThreadId>>,
    ordinal: u32,
    dev: CUdevice,
    /// Secondary GPUs for parallel transmission ([`CudaGpu::attach_peer`]), with the copies in
    /// flight through each. Their objects belong to the secondaries' contexts; after everything
    /// of this context above (a peer binds its own context when it drops), before `ctx`.
    peers: Vec<crate::peer::SecondaryLink>,
    /// What `attach_peer` was asked for (ordinal, staging bytes), to attach again after a reset.
    peer_requests: Vec<(u32, u64)>,
    /// Last: every object above belongs to this context and must be gone before it is released.
    ctx: Context,
}

// SAFETY: every handle a CudaGpu holds belongs to one primary context, and driver handles may be
// used from any thread on which that context is current; `bind()` makes it current on the
// calling thread at the start of every method that touches the driver. Mapped host pointers are
// plain pinned memory. CudaGpu is not Sync, so one thread at a time uses it.
unsafe impl Send for CudaGpu {}

impl CudaGpu {
    /// Default launch options on the whole device, on `stream`: every SM, the whole partition, the
    /// default grid, no dependency.
    pub fn whole_device(&self, stream: StreamId) -> LaunchOptions {
        LaunchOptions {
            first_block: 0,
            ctas: 0,
            sm_mask: self.info.partitions[0].sms,
            partition: PartitionId::WHOLE,
            stream,
            sm_bitmap: None,
            after: None,
        }
    }

    /// Opens GPU `ordinal`. Without a driver, a GPU or NVRTC this is `GpuError::NoDevice`, never a panic.
    pub fn new(ordinal: u32) -> Result<CudaGpu> {
        CudaGpu::open(ordinal, Instant::now(), crate::protocol::RING_CAPACITY)
    }

    /// Opens GPU `ordinal` with a notification ring of `records` records (a power of two, at least
    /// `protocol::RING_CAPACITY_MIN`) instead of the default `protocol::RING_CAPACITY`: for
    /// fault-injection tests, which overflow a small ring on purpose. A reset keeps the size.
    pub fn with_ring_capacity(ordinal: u32, records: u32) -> Result<CudaGpu> {
        crate::protocol::check_capacity(records)?;
        CudaGpu::open(ordinal, Instant::now(), records)
    }

    /// Opens GPU `ordinal` with its clock counting from `epoch` and a ring of `ring_capacity` records.
    fn open(ordinal: u32, epoch: Instant, ring_capacity: u32) -> Result<CudaGpu> {
        if !driver::is_present() {
            return Err(GpuError::NoDevice("the NVIDIA driver library (libcuda) is not installed on this machine".into()));
        }
        driver::init().map_err(|e| GpuError::NoDevice(format!("{e}: no usable NVIDIA GPU")))?;
        let count = driver::device_count().map_err(drv)?;
        if ordinal as i32 >= count {
            return Err(GpuError::NoDevice(format!("GPU {ordinal} asked for, {count} present")));
        }
        // Without NVRTC the GPU still opens: the cache folder and the images embedded in the
        // binary may hold every unit; a unit found nowhere is then a clear compile error.
        let dev = driver::device_get(ordinal as i32).map_err(drv)?;
        let attr = |a| driver::device_attribute(dev, a).map_err(drv);
        let (major, minor) =
            (attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let sm_limits = SmLimits {
            threads_max: attr(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)? as u32,
            registers_max: attr(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)? as u32,
            shared_mem_bytes_max: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? as u32,
            ctas_max: attr(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR)? as u32,
        };
        let ctx = Context::new(dev).map_err(drv)?;
        let driver_version = driver::driver_version().map_err(drv)?;
        let cache = KernelCache::new((major * 10 + minor) as u32, driver_version);
        let priority_range = driver::stream_priority_range().map_err(drv)?;
        let preempt_stream = Stream::new(priority_range.1).map_err(drv)?;
        let stop_flag = match crate::settings::settings().stop_flag {
            StopFlag::Device if !driver::has_symbol("cuStreamWriteValue32_v2") => StopFlag::Host,
            f => f,
        };
        let protocol = Protocol::new(ring_capacity, stop_flag).map_err(drv)?;
        let helper_stream = Stream::new(priority_range.1).map_err(drv)?;
        let write_stream = Stream::new(priority_range.1).map_err(drv)?;
        let info = DeviceInfo {
            name: driver::device_name(dev).map_err(drv)?,
            arch: format!("sm_{major}{minor}"),
            sm_count,
            sm_limits,
            memory_bytes: driver::device_total_mem(dev).map_err(drv)?,
            partitions: Vec::new(),
            partition_granularity_sms: sm_count,
            hardware_queues: crate::settings::settings().hardware_queues,
            h2d_bytes_per_s: 0.0,
            d2h_bytes_per_s: 0.0,
            device_mem_bytes_per_s: 0.0,
            host_mapped_read_bytes_per_s: 0.0,
            launches_in_flight_max: LAUNCH_SLOTS_MAX,
        };
        let mut gpu = CudaGpu {
            launchers: None,
            launch_inline: false,
            urgent_launches: crate::settings::settings().urgent_launches,
            info,
            epoch,
            device_clock_offset_ns: 0,
            clock_tracked_ns: 0,
            host_events: VecDeque::new(),
            records: Vec::new(),
            in_flight: (0..LAUNCH_SLOTS_MAX).map(|_| None).collect(),
            slot_of: HashMap::default(),
            spans: VecDeque::new(),
            records_read: 0,
            starts_implied: 0,
            ring_overflows: 0,
            ring_capacity,
            last_health_check_ns: 0,
            utility_stream: None,
            next_launch: 1,
            launch_costs: LaunchCosts::default(),
            time_launches: false,
            fault_at_launch: None,
            hang_at_launch: None,
            next_copy: 1,
            copies: VecDeque::new(),
            spare_events: Vec::new(),
            runs: HashMap::new(),
            next_run: 1,
            run_kernels_plain: crate::settings::settings().run_kernels_plain,
            run_plain_compiling: false,
            capture_stream: None,
            allocations: BTreeMap::new(),
            functions: HashMap::new(),
            entries: HashMap::default(),
            modules: HashMap::new(),
            quick_builds: false,
            quick_loaded: Default::default(),
            upgrades: Arc::new(Upgrades::default()),
            retired_modules: Vec::new(),
            upgrades_applied: 0,
            occupancy: HashMap::new(),
            smem_optin_bytes: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32,
            cache,
            priority_range,
            streams: Vec::new(),
            streams_destroyed: 0,
            retired_gate_words: Vec::new(),
            overlap_launches: major >= 9 && crate::settings::settings().overlap_launches,
            helper_stream,
            write_stream,
            preempt_stream,
            pending_preempts: Vec::new(),
            partitions: Vec::new(),
            partition_by_size: HashMap::new(),
            groups: Vec::new(),
            partition_by_groups: HashMap::new(),
            green_note: None,
            peer_note: None,
            host_maps: Default::default(),
            next_launch_flags: 0,
            next_launch_implied_start: false,
            issue_order: 0,
            light_launches: crate::settings::settings().light_launches,
            next_launch_per_sm: None,
            next_launch_stop: None,
            recording_pos: 0,
            run_stop_words: None,
            stop_word_states: Vec::new(),
            protocol,
            bound: Cell::new(Some(std::thread::current().id())),
            ordinal,
            dev,
            peers: Vec::new(),
            peer_requests: Vec::new(),
            ctx,
        };
        // The whole device, as the SM probe sees it.
        let whole = gpu.probe_sms(None)?;
        if whole.count() != sm_count {
            return Err(GpuError::Driver(format!("the SM probe saw {} of {sm_count} SMs ({whole:?})", whole.count())));
        }
        gpu.partitions.push(PartitionState { sms: whole, green: None });
        gpu.partition_by_size.insert(sm_count, PartitionId::WHOLE);
        if let Err(note) = gpu.init_green_contexts() {
            gpu.green_note = Some(note);
        }
        gpu.calibrate_clock()?;
        gpu.measure_bandwidths()?;
        gpu.sync_info();
        gpu.set_launch_threads(crate::settings::settings().launch_threads)?;
        Ok(gpu)
    }

    /// Makes the driver call of each protocol launch on `threads` launcher threads (0: on the
    /// caller's thread). Waits for the launches already posted.
    pub fn set_launch_threads(&mut self, threads: usize) -> Result<()> {
        self.launchers = None;
        if threads > 0 {
            // The urgent lane spins while real-time work flows: on a host without a core for it
            // beside the dispatcher and the shared launchers, it would take one from them.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let urgent_lane = self.urgent_launches == UrgentLaunches::Lane && cores >= threads + 2;
            self.launchers = Some(Launchers::start(threads, urgent_lane, self.ctx.raw()).map_err(GpuError::Invalid)?);
        }
        Ok(())
    }

    /// Launcher threads in use (0: launches on the caller's thread).
    pub fn launch_threads(&self) -> usize {
        self.launchers.as_ref().map_or(0, |l| l.threads())
    }

    /// The launcher threads and the lane that make the driver calls of `stream`, if any: none
    /// while launches are inline, and none for an urgent stream (a higher priority than the
    /// default) under [`UrgentLaunches::Inline`]; the urgent lane for it under
    /// [`UrgentLaunches::Lane`]. Every call on one stream takes the same path (a stream's
    /// priority never changes), so its FIFO order holds. Shared lanes serve streams by id modulo
    /// threads, so a real-time launch posted there waits behind the best-effort calls queued
    /// before it: measured on an H200 (DISB A, docs/benchmarks.md), that is most of the first
    /// block's tail (p99 106-185 µs with two launcher threads, 34-49 µs with none).
    fn launcher_of(&self, stream: StreamId) -> Option<(&Launchers, usize)> {
        let urgent = self.streams.get(stream.0 as usize).is_some_and(|s| s.priority < self.priority_range.0);
        let inline = self.launch_inline || (self.urgent_launches == UrgentLaunches::Inline && urgent);
        self.launchers.as_ref().filter(|_| !inline).map(|l| (l, l.lane_of(stream.0, urgent)))
    }

    /// Host time the launcher threads spent in driver calls so far.
    pub fn launcher_busy_ns(&self) -> u64 {
        self.launchers.as_ref().map_or(0, |l| l.busy_ns())
    }

    /// Errs unless `w` is a live stop word.
    fn check_stop_word(&self, w: StopWordId) -> Result<()> {
        match self.stop_word_states.get(w.0 as usize) {
            Some(Some(_)) => Ok(()),
            _ => Err(GpuError::Invalid(format!("unknown stop word {}", w.0))),
        }
    }

    /// The device address of stop word `w` (a `KairosStopWord`).
    fn stop_word_addr(&self, w: u32) -> u64 {
        self.run_stop_words.as_ref().expect("stop words exist once one was made").ptr() + w as u64 * source::STOP_WORD_BYTES
    }

    /// Raises stop word `w` (protocol.cuh point 8) with a write on the preempt stream, as a
    /// device preempt flag (held back like one until the next launch has gone out). Once per clear.
    fn raise_stop_word(&mut self, w: u32) -> Result<()> {
        let Some(Some(state)) = self.stop_word_states.get_mut(w as usize) else { return Ok(()) };
        state.needs_clear = true;
        if std::mem::replace(&mut state.raised, true) {
            return Ok(());
        }
        self.pending_preempts.push((self.stop_word_addr(w), 1));
        if self.pending_preempts.len() >= PENDING_PREEMPTS_MAX {
            self.flush_preempts()?;
        }
        Ok(())
    }

    /// Clears stop word `w` (both its halves) on `stream`, in order with what was launched there
    /// before and after, if it was raised since it was last cleared (or is new).
    fn clear_stop_word_before(&mut self, w: u32, stream: StreamId) -> Result<()> {
        let Some(Some(state)) = self.stop_word_states.get_mut(w as usize) else {
            return Err(GpuError::Invalid(format!("unknown stop word {w}")));
        };
        if !state.needs_clear {
            return Ok(());
        }
        *state = StopWordState::default();
        let addr = self.stop_word_addr(w);
        let raw = self.stream_for(stream, 0)?.raw();
        for (at, value) in [(addr, 0u32), (addr + 4, 0u32)] {
            match self.launcher_of(stream) {
                // Behind the launches posted to the stream's launcher before it.
                Some((l, lane)) => l.post(lane, Job::write32(raw, at, value)),
                // SAFETY: `raw` is a live stream of self; `at` lies in the stop-word buffer, which
                // lives as long as self (cuMemFree waits for the device's work, this write included).
                None => unsafe { driver::stream_write_value32(raw, at, value) }.map_err(drv)?,
            }
        }
        Ok(())
    }

    /// Queues the device-flag writes `preempt` left pending (see `pending_preempts`).
    fn flush_preempts(&mut self) -> Result<()> {
        if self.pending_preempts.is_empty() {
            return Ok(());
        }
        self.bind()?;
        for (addr, value) in self.pending_preempts.drain(..) {
            // SAFETY: the preempt stream is live while self lives; `addr` is a 4-byte word of the
            // protocol's stop-word buffer in this context, released only when self drops, and
            // cuMemFree waits for the device's work in flight, this store included.
            unsafe { driver::stream_write_value32(self.preempt_stream.raw(), addr, value) }.map_err(drv)?;
        }
        Ok(())
    }

    /// Waits until every launch posted to the launcher threads went to the driver: anything that
    /// must follow launches on a stream (events, copies, synchronizing, destroying) calls this first.
    fn flush_launches(&self) {
        if let Some(l) = &self.launchers {
            l.flush();
        }
    }

    fn bind(&self) -> Result<()> {
        let me = std::thread::current().id();
        if self.bound.get() != Some(me) {
            self.ctx.bind().map_err(drv)?;
            self.bound.set(Some(me));
        }
        Ok(())
    }

    fn sync_info(&mut self) {
        self.info.partitions =
            self.partitions.iter().enumerate().map(|(i, p)| Partition { id: PartitionId(i as u32), sms: p.sms }).collect();
    }

    /// The device's SM partitioning granularity and the default partitions (groups of that size).
    fn init_green_contexts(&mut self) -> std::result::Result<(), String> {
        for sym in [
            "cuDeviceGetDevResource",
            "cuDevSmResourceSplitByCount",
            "cuDevResourceGenerateDesc",
            "cuGreenCtxCreate",
            "cuGreenCtxStreamCreate",
        ] {
            if !driver::has_symbol(sym) {
                return Err(format!("driver lacks {sym}: no green contexts"));
            }
        }
        let res = driver::device_sm_resource(self.dev).map_err(|e| e.to_string())?;
        let (_, min, _) = driver::sm_resource_counts(&res);
        let min = min.max(1);
        let (groups, rest) = driver::sm_resource_split_by_count(&res, min).map_err(|e| e.to_string())?;
        self.info.partition_granularity_sms = min;
        let mut covered = SmMask::EMPTY;
        for g in groups {
            let id = self.push_green_partition(std::slice::from_ref(&g)).map_err(|e| e.to_string())?;
            let sms = self.partitions[id.0 as usize].sms;
            covered = covered.union(&sms);
            // Each default group is already the partition of itself alone.
            self.partition_by_groups.insert(1 << self.groups.len(), Ok(id));
            self.groups.push((g, sms));
        }
        let left = self.partitions[0].sms.minus(&covered);
        if driver::sm_resource_counts(&rest).0 > 0 && !left.is_empty() {
            self.groups.push((rest, left));
        }
        Ok(())
    }

    /// [`Gpu::partition_of_groups`]: one green context over the union of the groups' resources.
    fn make_partition_of_groups(&mut self, bits: u64) -> Result<PartitionId> {
        let n = self.groups.len();
        if bits == 0 || (n < 64 && bits >> n != 0) {
            return Err(GpuError::Invalid(format!("groups {bits:#x}: the device has {n} SM groups")));
        }
        let chosen: Vec<driver::CUdevResource> = (0..n).filter(|&g| bits >> g & 1 == 1).map(|g| self.groups[g].0).collect();
        self.push_green_partition(&chosen)
    }

    /// A green context over the union of `resources`, its SMs probed, as the next partition.
    fn push_green_partition(&mut self, resources: &[driver::CUdevResource]) -> Result<PartitionId> {
        if self.partitions.len() >= PARTITIONS_MAX {
            return Err(GpuError::Exhausted { limit: "partitions", max: PARTITIONS_MAX as u64 });
        }
        let green = GreenContext::from_resources(self.dev, resources).map_err(drv)?;
        let probe = green.stream(0).map_err(drv)?;
        let sms = self.probe_sms(Some(&probe))?;
        drop(probe);
        let id = PartitionId(self.partitions.len() as u32);
        self.partitions.push(PartitionState { sms, green: Some(green) });
        self.sync_info();
        Ok(id)
    }

    /// A hardware partition of (at least) `sm_count` SMs, made on first request: the first group of
    /// the device split into groups of that size. The whole device for `sm_count >= sm_count()`.
    pub fn partition_of_size(&mut self, sm_count: u32) -> Result<PartitionId> {
        self.bind()?;
        if sm_count >= self.info.sm_count {
            return Ok(PartitionId::WHOLE);
        }
        if let Some(&p) = self.partition_by_size.get(&sm_count) {
            return Ok(p);
        }
        if let Some(note) = &self.green_note {
            return Err(GpuError::Invalid(format!("no hardware partitions on this device: {note}")));
        }
        let res = driver::device_sm_resource(self.dev).map_err(drv)?;
        let (groups, _) = driver::sm_resource_split_by_count(&res, sm_count).map_err(drv)?;
        let g =
            groups.first().ok_or_else(|| GpuError::Invalid(format!("cannot split the device into {sm_count}-SM partitions")))?;
        let id = self.push_green_partition(std::slice::from_ref(g))?;
        self.partition_by_size.insert(sm_count, id);
        Ok(id)
    }

    /// Runs the SM probe on `stream` (a green-context stream) or the helper stream: which SMs a
    /// wide grid of spinning CTAs lands on.
    fn probe_sms(&mut self, stream: Option<&Stream>) -> Result<SmMask> {
        let f = self.function_by_name("kairos_smmap", UTIL, Variant::Protocol)?;
        let bitmap = DeviceBuffer::new((source::SM_COUNT_MAX / 8) as u64).map_err(drv)?;
        bitmap.fill(0).map_err(drv)?;
        let stream = stream.unwrap_or(&self.helper_stream);
        let ptr = bitmap.ptr().to_le_bytes();
        let spin = SM_PROBE_SPIN_NS.to_le_bytes();
        // SAFETY: kairos_smmap(u32* bitmap, u64 spin_ns) takes exactly these two 8-byte
        // parameters; the bitmap buffer outlives the kernel (we synchronize before dropping it).
        unsafe { f.f.launch(self.info.sm_count * 4, 128, 0, stream, &[&ptr, &spin]) }.map_err(drv)?;
        stream.synchronize().map_err(drv)?;
        let mut bytes = [0u8; source::SM_COUNT_MAX / 8];
        bitmap.read(0, &mut bytes).map_err(drv)?;
        Ok(bitmap_to_mask(&bytes))
    }

    /// The device's GPCs, as SM sets: thread-block clusters of 2, 4, 8 and 16 CTAs (one CTA per
    /// SM: enough dynamic shared memory that no second one fits; 16 is a non-portable size,
    /// skipped where the device refuses it) run on one GPC each, so SMs that ever host CTAs of
    /// one cluster share a GPC; `rounds` launches per cluster size of two waves each, their
    /// members joined (union-find). On an H200: 12 sets, 7 GPCs of 16 or 18 SMs and one left as 8
    /// SMs and four pairs (SMs 124-131 never shared a cluster with others); clusters of up to 8
    /// alone left two more GPCs in halves. A GPC whose SMs never shared a cluster shows
    /// as several sets (the probe never joins SMs of two GPCs), an SM never reached as a set of
    /// its own. Sets in order of their lowest SM. Errors where the device has no clusters
    /// (before sm_90).
    pub fn probe_gpcs(&mut self, rounds: u32) -> Result<Vec<SmMask>> {
        self.bind()?;
        self.flush_launches();
        let f = self.function_by_name("kairos_gpcmap", UTIL, Variant::Protocol)?;
        let sm_count = self.info.sm_count;
        // More than half an SM's shared memory: one CTA per SM.
        let smem = (self.smem_optin_bytes / 2 + 1024).min(f.dyn_smem_max_bytes);
        let mut parent: Vec<u32> = (0..source::SM_COUNT_MAX as u32).collect();
        fn root(p: &mut [u32], mut x: u32) -> u32 {
            while p[x as usize] != x {
                p[x as usize] = p[p[x as usize] as usize];
                x = p[x as usize];
            }
            x
        }
        let mut seen = SmMask::EMPTY;
        for cluster in [2u32, 4, 8, 16] {
            if cluster > 8
                && f.f
                    .set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                        1,
                    )
                    .is_err()
            {
                continue;
            }
            let grid = (2 * sm_count).div_ceil(cluster) * cluster;
            let out = DeviceBuffer::new(grid as u64 * 4).map_err(drv)?;
            for round in 0..rounds.max(1) {
                out.fill(0xff).map_err(drv)?;
                let ptr = out.ptr().to_le_bytes();
                // Different spins per round, so the second wave's clusters land elsewhere.
                let spin = (20_000 + 7_000 * round as u64).to_le_bytes();
                // SAFETY: kairos_gpcmap(u32* sm_of_cta, u64 spin_ns) takes these two 8-byte
                // parameters; `out` holds `grid` u32s and lives until the stream is synchronized.
                let launched = unsafe { f.f.launch_clustered(grid, 32, cluster, smem, &self.helper_stream, &[&ptr, &spin]) };
                match launched {
                    Ok(()) => {}
                    // A non-portable size the device cannot place: the smaller sizes stand.
                    Err(_) if cluster > 8 => break,
                    Err(e) => return Err(drv(e)),
                }
                self.helper_stream.synchronize().map_err(drv)?;
                let mut bytes = vec![0u8; grid as usize * 4];
                out.read(0, &mut bytes).map_err(drv)?;
                let sms: Vec<u32> = bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                for c in sms.chunks(cluster as usize) {
                    if c.iter().any(|&sm| sm >= sm_count) {
                        return Err(GpuError::Driver(format!("GPC probe: a CTA reported SM {c:?} (of {sm_count})")));
                    }
                    for &sm in c {
                        seen.insert(sm);
                        let (a, b) = (root(&mut parent, c[0]), root(&mut parent, sm));
                        parent[a.max(b) as usize] = a.min(b);
                    }
                }
            }
        }
        let mut sets: BTreeMap<u32, SmMask> = BTreeMap::new();
        for sm in self.partitions[0].sms.iter() {
            let r = if seen.contains(sm) { root(&mut parent, sm) } else { sm };
            sets.entry(r).or_insert(SmMask::EMPTY).insert(sm);
        }
        Ok(sets.into_values().collect())
    }

    /// Where a CUDA graph's kernel runs: the SM probe kernel captured into a graph on a stream of
    /// partition `captured_on` and replayed on a stream of partition `launched_on`; the SMs its
    /// CTAs ran on. Tells whether a run recorded once can be replayed inside any partition.
    pub fn probe_graph_sms(&mut self, captured_on: PartitionId, launched_on: PartitionId) -> Result<SmMask> {
        self.bind()?;
        self.flush_launches();
        let f = self.function_by_name("kairos_smmap", UTIL, Variant::Protocol)?;
        let bitmap = DeviceBuffer::new((source::SM_COUNT_MAX / 8) as u64).map_err(drv)?;
        bitmap.fill(0).map_err(drv)?;
        let stream_of = |gpu: &CudaGpu, p: PartitionId| -> Result<Stream> {
            gpu.partitions.get(p.0 as usize).ok_or_else(|| GpuError::Invalid(format!("unknown partition {}", p.0)))?.stream(0)
        };
        let capture = stream_of(self, captured_on)?;
        let replay = stream_of(self, launched_on)?;
        let ptr = bitmap.ptr().to_le_bytes();
        let spin = SM_PROBE_SPIN_NS.to_le_bytes();
        capture.begin_capture().map_err(drv)?;
        // SAFETY: kairos_smmap(u32* bitmap, u64 spin_ns) takes exactly these two 8-byte
        // parameters; the bitmap outlives the replay (synchronized below before it drops).
        let queued = unsafe { f.f.launch(self.info.sm_count * 4, 128, 0, &capture, &[&ptr, &spin]) }.map_err(drv);
        let graph = capture.end_capture().map_err(drv);
        let graph = queued.and(graph)?;
        // SAFETY: the captured kernel's module lives as long as self; its bitmap until the sync.
        unsafe { graph.launch(&replay) }.map_err(drv)?;
        replay.synchronize().map_err(drv)?;
        let mut bytes = [0u8; source::SM_COUNT_MAX / 8];
        bitmap.read(0, &mut bytes).map_err(drv)?;
        Ok(bitmap_to_mask(&bytes))
    }

    /// Maps device time to host time: the largest (device - host) seen when the host observes a
    /// fresh %globaltimer value is the offset with the least delay in it.
    fn calibrate_clock(&mut self) -> Result<()> {
        let f = self.function_by_name("kairos_clock", UTIL, Variant::Protocol)?;
        let cell = MappedBuffer::new(16).map_err(drv)?;
        let ptr = cell.dev_ptr().to_le_bytes();
        let mut best = i64::MIN;
        for _ in 0..64 {
            cell.store_u64(0, 0);
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            // SAFETY: kairos_clock(volatile u64* dst) takes one 8-byte pointer; the cell lives
            // until after the stream is synchronized below.
            unsafe { f.f.launch(1, 32, 0, &self.helper_stream, &[&ptr]) }.map_err(drv)?;
            let t0 = Instant::now();
            while cell.load_u64(0) == 0 {
                if t0.elapsed().as_secs() > 5 {
                    return Err(GpuError::Driver("clock calibration kernel did not report within 5 s".into()));
                }
                std::hint::spin_loop();
            }
            let seen = self.now_ns() as i64;
            best = best.max(cell.load_u64(8) as i64 - seen);
            self.helper_stream.synchronize().map_err(drv)?;
        }
        self.device_clock_offset_ns = best;
        self.clock_tracked_ns = self.now_ns();
        Ok(())
    }

    /// Copy-engine bandwidths (pinned host <-> device) and device-memory bandwidth (device to
    /// device copy, bytes read plus written), measured once at start-up in a few milliseconds.
    fn measure_bandwidths(&mut self) -> Result<()> {
        const BYTES: u64 = 64 << 20;
        let host = MappedBuffer::new(BYTES).map_err(drv)?;
        let a = DeviceBuffer::new(BYTES).map_err(drv)?;
        let b = DeviceBuffer::new(BYTES).map_err(drv)?;
        let (start, end) = (Event::new(true).map_err(drv)?, Event::new(true).map_err(drv)?);
        let s = &self.helper_stream;
        let rate = |dst: u64, src: u64, factor: f64| -> Result<f64> {
            let mut best = 0f64;
            for _ in 0..3 {
                start.record(s).map_err(drv)?;
                // SAFETY: both ranges are whole live buffers of BYTES, alive until the synchronize below.
                unsafe { s.copy(dst, src, BYTES) }.map_err(drv)?;
                end.record(s).map_err(drv)?;
                end.synchronize().map_err(drv)?;
                let ms = end.elapsed_ms_since(&start).map_err(drv)? as f64;
                best = best.max(factor * BYTES as f64 / (ms.max(1e-6) * 1e-3));
            }
            Ok(best)
        };
        self.info.h2d_bytes_per_s = rate(a.ptr(), host.dev_ptr(), 1.0)?;
        self.info.d2h_bytes_per_s = rate(host.dev_ptr(), a.ptr(), 1.0)?;
        self.info.device_mem_bytes_per_s = rate(b.ptr(), a.ptr(), 2.0)?;
        // Kernels reading mapped memory move about what the copy engine does over the same link
        // (the device probe saw 51.4 vs 55.6 GB/s on an H200).
        self.info.host_mapped_read_bytes_per_s = self.info.h2d_bytes_per_s;
        Ok(())
    }

    fn module(&mut self, u: source::Unit, v: Variant) -> Result<Arc<Module>> {
        if let Some(x) = self.modules.get(&(u, v)) {
            return Ok(Arc::clone(x));
        }
        self.prepare_units(&[(u, v)], "its first use")?;
        Ok(Arc::clone(&self.modules[&(u, v)]))
    }

    /// Loads a unit's image; one from the cache or the binary that the driver refuses (made by a
    /// newer toolkit than the driver, or damaged) is compiled again here, replacing the cached file.
    fn load_unit(&mut self, u: source::Unit, v: Variant, image: nvrtc::Image) -> Result<()> {
        let module = match Module::load(&image.bytes) {
            Ok(m) => m,
            Err(e) if image.from_cache() && nvrtc::is_present() => {
                eprintln!(
                    "kairos: the driver refused the {:?} image of kernel unit {} ({e}); compiling it here",
                    image.origin,
                    u.name()
                );
                let fresh = self.cache.image_forced(u, v).map_err(|log| compile_error(u, log))?;
                Module::load(&fresh.bytes).map_err(drv)?
            }
            Err(e) => return Err(drv(e)),
        };
        self.modules.insert((u, v), module);
        Ok(())
    }

    /// Makes the given units ready: those neither loaded nor at hand (cache folder, embedded
    /// images) are compiled in parallel on every core (`KAIROS_COMPILE_JOBS`), with progress on
    /// stderr naming `what` they are for; returns the milliseconds it took.
    pub fn prepare_units(&mut self, units: &[(source::Unit, Variant)], what: &str) -> Result<f64> {
        self.bind()?;
        let t = Instant::now();
        let mut jobs: Vec<(source::Unit, Variant)> = units.iter().copied().filter(|k| !self.modules.contains_key(k)).collect();
        jobs.sort();
        jobs.dedup();
        if jobs.is_empty() {
            return Ok(0.0);
        }
        // Units with a quick build and no optimized image at hand start on the quick build; their
        // optimized builds follow in the background.
        let quick = |u: source::Unit, v: Variant| {
            self.quick_builds
                && v == Variant::Protocol
                && u.has_quick_build()
                && nvrtc::is_present()
                && !self.cache.is_ready(u, v)
        };
        let builds: Vec<(source::Unit, Variant, bool)> = jobs.iter().map(|&(u, v)| (u, v, quick(u, v))).collect();
        let images = self.cache.images_of(&builds, nvrtc::compile_workers(), what);
        let mut upgrade = Vec::new();
        for ((u, v, q), image) in builds.into_iter().zip(images) {
            let image = image.map_err(|log| compile_error(u, log))?;
            self.load_unit(u, v, image)?;
            if q {
                self.quick_loaded.insert((u, v));
                upgrade.push((u, v));
            }
        }
        if !upgrade.is_empty() {
            self.start_upgrades(upgrade);
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }

    /// Makes the units whose optimized build is missing start on a quick build (compiled in a
    /// fraction of the time, slower code) and compile the optimized build in the background; the
    /// next [`Gpu::poll`] after it is ready swaps it in: later launches and the recorded runs run
    /// it. A quick build's occupancy is worked out at its entry's register budget, the most the
    /// optimized build may use, so the CTAs per SM the caller was told still fit after the swap.
    /// Off by default: timing work (profiles, the autotuner, benchmarks) must not time quick
    /// builds; `kairos serve` and `kairos run` turn it on. The same switch decides what a recorded
    /// run whose plain units are missing does: on, it records light launches now (plain units
    /// compiling in the background); off, it compiles the plain units first.
    pub fn set_quick_builds(&mut self, on: bool) {
        self.quick_builds = on;
    }

    /// Compiles into and reads from `dir` from now on (None: no cache folder, every unit not
    /// loaded yet compiles); units already loaded stay.
    pub fn set_kernel_cache_dir(&mut self, dir: Option<std::path::PathBuf>) {
        self.cache.dir = dir;
    }

    /// Whether quick builds are on (see [`CudaGpu::set_quick_builds`]).
    pub fn quick_builds(&self) -> bool {
        self.quick_builds
    }

    /// Units now running their quick build (their optimized builds compiling), and how many quick
    /// builds were replaced so far.
    pub fn quick_build_status(&self) -> (Vec<source::Unit>, u64) {
        (self.quick_loaded.iter().map(|k| k.0).collect(), self.upgrades_applied)
    }

    /// Whether a unit's optimized build is loaded or at hand (a quick build is not).
    pub fn unit_optimized(&self, u: source::Unit, v: Variant) -> bool {
        (self.modules.contains_key(&(u, v)) && !self.quick_loaded.contains(&(u, v))) || self.cache.is_ready(u, v)
    }

    /// Waits for the optimized builds of the units running quick ones and swaps them in.
    pub fn finish_quick_builds(&mut self) -> Result<()> {
        if self.quick_loaded.is_empty() {
            return Ok(());
        }
        nvrtc::finish_background(&format!(
            "waiting for the optimized builds of {} kernel unit(s) now running quick builds",
            self.quick_loaded.len()
        ));
        self.apply_upgrades()
    }

    fn start_upgrades(&mut self, units: Vec<(source::Unit, Variant)>) {
        let cache = KernelCache { quick: false, ..self.cache.clone() };
        let upgrades = Arc::clone(&self.upgrades);
        let todo = units.clone();
        let started = nvrtc::spawn_background(move || {
            let images = cache.images(&todo, nvrtc::background_workers(), "the optimized builds");
            let mut done = upgrades.done.lock().unwrap_or_else(|e| e.into_inner());
            done.extend(todo.into_iter().zip(images));
            upgrades.ready.store(true, std::sync::atomic::Ordering::Release);
        });
        if !started {
            eprintln!("kairos: cannot start the background compilation of optimized builds; the quick builds keep serving");
            for k in units {
                self.quick_loaded.remove(&k);
            }
        }
    }

    /// Swaps in the optimized builds compiled so far: for each, its functions get new handles
    /// (resources as reported before), the recorded runs' kernel nodes are pointed at them, and
    /// the launch path looks its entries up again. Launches queued before keep the quick code
    /// (its module stays loaded).
    fn apply_upgrades(&mut self) -> Result<()> {
        use std::sync::atomic::Ordering;
        let done = {
            let mut d = self.upgrades.done.lock().unwrap_or_else(|e| e.into_inner());
            self.upgrades.ready.store(false, Ordering::Release);
            std::mem::take(&mut *d)
        };
        if done.is_empty() {
            return Ok(());
        }
        // Runs are changed below: none of their replays may be in a launcher's hands meanwhile.
        self.flush_launches();
        for ((u, v), image) in done {
            if !self.quick_loaded.remove(&(u, v)) {
                continue; // the context was reset since (units load again on first use)
            }
            let module = match image.and_then(|i| Module::load(&i.bytes).map_err(|e| e.to_string())) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!(
                        "kairos: the optimized build of kernel unit {} failed ({e}); its quick build keeps serving",
                        u.name()
                    );
                    continue;
                }
            };
            let names: Vec<String> =
                self.functions.keys().filter(|(n, fv)| *fv == v && u.functions().contains(n)).map(|k| k.0.clone()).collect();
            let mut nodes = 0;
            for name in names {
                let old = Arc::clone(&self.functions[&(name.clone(), v)]);
                let f = module.function(&name).map_err(drv)?;
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    old.dyn_smem_max_bytes as i32,
                )
                .map_err(drv)?;
                let registers = f.registers().map_err(drv)?;
                if registers > old.registers {
                    // The launch bounds make this impossible; were it to happen, launches keep
                    // their CTA counts and the extra CTAs wait for room (slower, still correct).
                    eprintln!(
                        "kairos: warning: the optimized build of {name} uses {registers} registers, above the {} its quick \
                         build was sized for",
                        old.registers
                    );
                }
                for run in self.runs.values() {
                    // SAFETY: `f` has the same parameters as the function it replaces (same entry,
                    // same source), lives in this context, and its module stays loaded while self
                    // lives (self.modules, then self.retired_modules); the launchers were flushed
                    // above and launch nothing unless this thread posts it.
                    nodes += unsafe { run.graph.replace_function(old.f.raw(), f.raw()) }.map_err(drv)?;
                }
                let info = FunctionInfo {
                    f,
                    registers: old.registers,
                    static_smem_bytes: old.static_smem_bytes,
                    threads_max: old.threads_max,
                    dyn_smem_max_bytes: old.dyn_smem_max_bytes,
                    quick: false,
                };
                self.functions.insert((name, v), Arc::new(info));
            }
            if let Some(old) = self.modules.insert((u, v), module) {
                self.retired_modules.push(old);
            }
            self.upgrades_applied += 1;
            eprintln!(
                "kairos: kernel unit {} now runs its optimized build{}",
                u.name(),
                if nodes > 0 { format!(" ({nodes} kernel nodes of recorded runs updated)") } else { String::new() }
            );
        }
        // Entries hold the functions they launch: looked up again on the next launch.
        self.entries.clear();
        Ok(())
    }

    fn function_by_name(&mut self, name: &str, u: source::Unit, v: Variant) -> Result<Arc<FunctionInfo>> {
        if let Some(f) = self.functions.get(&(name.to_string(), v)) {
            return Ok(Arc::clone(f));
        }
        self.bind()?;
        let module = self.module(u, v)?;
        let f = module.function(name).map_err(drv)?;
        let static_smem_bytes = f.static_shared_bytes().map_err(drv)?;
        // Let launches ask for dynamic shared memory up to the library's limit (the driver's
        // default is 48 KiB in all); the tensor-core engine's pipeline lives there.
        let dyn_smem_max_bytes = source::DYNAMIC_SMEM_MAX_BYTES.min(self.smem_optin_bytes.saturating_sub(static_smem_bytes));
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            dyn_smem_max_bytes as i32,
        )
        .map_err(drv)?;
        // A quick build answers for its optimized build: at least the registers that one may use.
        let quick = self.quick_loaded.contains(&(u, v));
        let budget = if quick { u.entry.map_or(0, |k| k.registers_max()) } else { 0 };
        let info = Arc::new(FunctionInfo {
            registers: f.registers().map_err(drv)?.max(budget),
            static_smem_bytes,
            threads_max: f.threads_max().map_err(drv)?,
            dyn_smem_max_bytes,
            f,
            quick,
        });
        self.functions.insert((name.to_string(), v), Arc::clone(&info));
        Ok(info)
    }

    fn kernel_function(&mut self, kernel: &Kernel, dtype: DType, threads: u32, v: Variant) -> Result<Arc<FunctionInfo>> {
        let key = source::entry_key(kernel, dtype, threads)?;
        let unit = source::Unit::of_entry(source::module_of(kernel), key);
        self.function_by_name(&format!("{}{}", key.base, key.suffix), unit, v)
    }

    fn occupancy_of(&mut self, name: &str, f: &FunctionInfo, v: Variant, threads: u32, dyn_smem_bytes: u32) -> Result<u32> {
        if let Some(&o) = self.occupancy.get(&(name.to_string(), v, threads, dyn_smem_bytes)) {
            return Ok(o);
        }
        let mut o = f.f.occupancy(threads, dyn_smem_bytes).map_err(drv)?;
        if f.quick {
            // At the register budget of the optimized build that will replace it.
            let smem = f.static_smem_bytes + dyn_smem_bytes;
            o = o.min(KernelResources::occupancy(threads, f.registers, smem, &self.info.sm_limits)).max(1);
        }
        self.occupancy.insert((name.to_string(), v, threads, dyn_smem_bytes), o);
        Ok(o)
    }

    /// The kernel cache this GPU compiles through (its folder, arch and driver version).
    pub fn kernel_cache(&self) -> &KernelCache {
        &self.cache
    }

    /// Whether a unit is loaded or its image at hand without compiling.
    pub fn unit_ready(&self, u: source::Unit, v: Variant) -> bool {
        self.modules.contains_key(&(u, v)) || self.cache.is_ready(u, v)
    }

    /// Compiles units into the cache folder on a background thread (every core, progress on
    /// stderr); a later `prepare_units` finds them there, or waits for a unit still compiling
    /// instead of compiling it twice. Errors are reported on stderr only.
    pub fn compile_in_background(&self, units: Vec<(source::Unit, Variant)>, what: String) {
        let cache = KernelCache { quick: false, ..self.cache.clone() };
        if !nvrtc::spawn_background(move || {
            let _ = cache.images(&units, nvrtc::background_workers(), &what);
        }) {
            eprintln!("kairos: cannot start a background compilation; the units compile on first use");
        }
    }

    /// Makes every unit of the library ready in the given variants (see [`CudaGpu::prepare_units`]);
    /// returns the milliseconds it took.
    pub fn prepare(&mut self, variants: &[Variant]) -> Result<f64> {
        let jobs: Vec<(source::Unit, Variant)> =
            variants.iter().flat_map(|&v| source::Unit::all().into_iter().map(move |u| (u, v))).collect();
        self.prepare_units(&jobs, "the kernel library")
    }

    /// The units a plan launches (protocol build), at its launch shapes.
    pub fn plan_units(plan: &Plan) -> Result<Vec<(source::Unit, Variant)>> {
        let mut units = Vec::new();
        for l in &plan.launches {
            let u = source::unit_of(&l.kernel, l.dtype, l.shape.threads_per_block)?;
            units.push((u, Variant::Protocol));
        }
        units.sort();
        units.dedup();
        Ok(units)
    }

    fn stream_for(&mut self, id: StreamId, partition: u32) -> Result<&Stream> {
        let st = self
            .streams
            .get_mut(id.0 as usize)
            .filter(|s| s.alive)
            .ok_or_else(|| GpuError::Invalid(format!("unknown or destroyed stream {}", id.0)))?;
        if !st.by_partition.contains_key(&partition) {
            let s = self.partitions[partition as usize].stream(st.priority)?;
            st.by_partition.insert(partition, s);
        }
        if let std::collections::hash_map::Entry::Vacant(v) = st.chain.entry(partition) {
            v.insert(Self::event_in(&self.ctx, &self.partitions[partition as usize], false)?);
        }
        if let Some(prev) = st.last_partition
            && prev != partition
        {
            // The event must follow the launches posted to this stream so far.
            if let Some(l) = &self.launchers {
                l.flush();
            }
            // Keep the stream's FIFO order across partitions: an event of the previous partition's
            // context, recorded there and waited for here (waits may cross contexts).
            st.chain[&prev].record(&st.by_partition[&prev]).map_err(drv)?;
            st.by_partition[&partition].wait(&st.chain[&prev]).map_err(drv)?;
        }
        st.last_partition = Some(partition);
        Ok(&st.by_partition[&partition])
    }

    /// An event of a partition's own context (green contexts record only their own events).
    fn event_in(ctx: &Context, part: &PartitionState, timing: bool) -> Result<Event> {
        match &part.green {
            Some(g) => g.with_current(ctx, || Event::new(timing)).map_err(drv),
            None => Event::new(timing).map_err(drv),
        }
    }

    /// CTAs to start: enough persistent CTAs to fill the allowed SMs. With a mask narrower than
    /// the partition, enough to reach every SM of the partition (the ones outside the mask leave at
    /// once), since the hardware, not kairos, picks where CTAs land.
    fn grid_size(requested: u32, per_sm: u32, mask: &SmMask, partition: &SmMask, remaining: u32) -> u32 {
        if requested > 0 {
            return requested;
        }
        if mask == partition { remaining.min(per_sm * partition.count()).max(1) } else { per_sm * partition.count() }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_inner(
        &mut self,
        name: &str,
        f: &FunctionInfo,
        args: Option<&ParamBlock>,
        total_blocks: u32,
        threads: u32,
        dyn_smem_bytes: u32,
        o: &LaunchOptions,
        variant: Variant,
    ) -> Result<LaunchId> {
        let extra_flags = std::mem::take(&mut self.next_launch_flags);
        let implied_start = std::mem::take(&mut self.next_launch_implied_start);
        let known_per_sm = self.next_launch_per_sm.take();
        let stop = self.next_launch_stop.take();
        let light = variant == Variant::Protocol && extra_flags & source::FLAG_LIGHT != 0;
        self.bind()?;
        if o.first_block > total_blocks {
            return Err(GpuError::Invalid(format!("first block {} beyond the launch's {total_blocks} blocks", o.first_block)));
        }
        if threads == 0 || threads > f.threads_max {
            return Err(GpuError::Invalid(format!("{name} runs at most {} threads per CTA, asked for {threads}", f.threads_max)));
        }
        let part = self
            .partitions
            .get(o.partition.0 as usize)
            .ok_or_else(|| GpuError::Invalid(format!("unknown partition {}", o.partition.0)))?;
        let part_sms = part.sms;
        let mask = o.sm_mask.intersect(&part_sms);
        if mask.is_empty() && variant == Variant::Protocol {
            return Err(GpuError::Invalid(format!(
                "SM mask {:?} has no SM in partition {} ({:?})",
                o.sm_mask, o.partition.0, part_sms
            )));
        }
        if dyn_smem_bytes > f.dyn_smem_max_bytes {
            return Err(GpuError::Invalid(format!(
                "{name} may use at most {} bytes of dynamic shared memory, asked for {dyn_smem_bytes}",
                f.dyn_smem_max_bytes
            )));
        }
        let per_sm = match known_per_sm {
            Some(n) => n,
            None => self.occupancy_of(name, f, variant, threads, dyn_smem_bytes)?,
        };
        if per_sm == 0 {
            return Err(GpuError::Invalid(format!("{name} does not fit on an SM at {threads} threads per CTA")));
        }
        let id = LaunchId(self.next_launch);
        self.next_launch += 1;
        // Only a launch whose start is implied needs its issue time (the clock read stays off the
        // common path).
        let issued_ns = if implied_start { self.now_ns() } else { 0 };
        let remaining = total_blocks - o.first_block;
        if remaining == 0 && variant == Variant::Protocol {
            // Nothing runs: to the stream gate it is transparent (a launch after it is gated on
            // the launch before it).
            if let Some(st) = self.streams.get_mut(o.stream.0 as usize).filter(|st| st.alive) {
                if o.after.is_none() {
                    st.last_seq = 0;
                }
                if o.after.is_none() || o.after == st.last_launch {
                    st.last_launch = Some(id);
                }
            }
            self.host_events.push_back(GpuEvent::LaunchDone {
                launch: id,
                next_block: total_blocks,
                preempted: false,
                at_ns: self.now_ns(),
            });
            return Ok(id);
        }
        // The gate is read only behind a launch that may have stopped early; a silent launch is
        // never gated (its stop could not be reported), so one that would be reports its end.
        let gated = o.after.is_some() && self.streams.get(o.stream.0 as usize).is_some_and(|st| st.alive && st.last_may_stop);
        let silent = light && extra_flags & source::FLAG_SILENT != 0 && !gated;
        let extra_flags = if silent || !light { extra_flags } else { extra_flags & !source::FLAG_SILENT };
        let (slot, grid) = match variant {
            // A silent launch has no slot: it touches none, and nothing reports it.
            Variant::Protocol if silent => (None, remaining),
            Variant::Protocol => {
                let slot = self
                    .protocol
                    .alloc_slot()
                    .ok_or(GpuError::Exhausted { limit: "launch slots", max: LAUNCH_SLOTS_MAX as u64 })?;
                let grid = if light { remaining } else { Self::grid_size(o.ctas, per_sm, &mask, &part_sms, remaining) };
                (Some(slot), grid)
            }
            Variant::Plain => (None, remaining.max(1)),
        };
        let gate = match (variant, slot) {
            (Variant::Protocol, _) => match self.streams.get(o.stream.0 as usize).filter(|st| st.alive) {
                Some(st) => {
                    if o.after.is_some() && o.after != st.last_launch {
                        if let Some(s) = slot {
                            self.protocol.free_slot(s);
                        }
                        return Err(GpuError::Invalid(format!(
                            "launch gated after {:?}, but the last launch on stream {} is {:?}",
                            o.after, o.stream.0, st.last_launch
                        )));
                    }
                    let gate_seq = if gated { st.last_seq } else { 0 };
                    Some(Gate { word: st.gate_word, seq: self.protocol.next_seq(), gate_seq })
                }
                None => None,
            },
            _ => None,
        };
        let proto = match (variant, slot) {
            (Variant::Protocol, s) => {
                let mut flags = if o.sm_bitmap.is_some() { source::FLAG_SM_BITMAP } else { 0 } | extra_flags;
                // Every CTA lands inside the mask (it is the whole partition) and each has a block
                // of its own: one take per CTA, no final take that would find the range exhausted.
                if mask == part_sms && grid >= remaining {
                    flags |= source::FLAG_ONE_TAKE;
                }
                // Light launches do not wait for a prerequisite, so they are never overlapped.
                if self.overlap_launches && !light {
                    flags |= source::FLAG_OVERLAPPED;
                }
                // An unknown stream has no gate; stream_for below refuses it.
                let gate = gate.unwrap_or_default();
                if let Some(s) = s {
                    self.protocol.bind_slot(s, gate.seq);
                }
                // A silent launch's slot fields are never read: slot 0's address stands in.
                let slot_index = s.unwrap_or(0);
                let mut p = self.protocol.params(
                    slot_index,
                    o.first_block,
                    total_blocks,
                    &mask,
                    flags,
                    o.sm_bitmap.map_or(0, |p| p.0),
                    gate,
                );
                if let Some((w, pos)) = stop {
                    // protocol.cuh point 8: the flag is the stop word; a run's silent launch
                    // carries its position in `slot` (it writes no record).
                    p.preempt_flag = self.stop_word_addr(w);
                    p.flags |= source::FLAG_STOP_WORD | source::FLAG_DEVICE_STOP;
                    if s.is_none() {
                        p.slot = pos;
                    }
                }
                p
            }
            // A plain grid of a run with a stop word reads it as light launches do (point 8).
            (Variant::Plain, _) => match stop {
                Some((w, pos)) => source::ProtoParams {
                    first_block: o.first_block,
                    total_blocks,
                    preempt_flag: self.stop_word_addr(w),
                    flags: source::FLAG_STOP_WORD,
                    slot: pos,
                    ..Default::default()
                },
                None => source::ProtoParams { first_block: o.first_block, total_blocks, ..Default::default() },
            },
        };
        let proto = proto.to_block();
        let overlap = self.overlap_launches && variant == Variant::Protocol && !light;
        let result = (|| {
            let stream_raw = self.stream_for(o.stream, o.partition.0)?.raw();
            let both = [proto.as_bytes(), args.map_or(&[][..], |a| a.as_bytes())];
            let params = &both[..1 + args.is_some() as usize];
            // SAFETY (both paths): every kernel of the library takes (KairosProto, <Args>) by value
            // (kairos_noop takes the protocol block alone), and `args` was packed for this very
            // function by kairos_kernels::source (sizes checked against the C structs); the protocol
            // buffers live as long as self; the caller keeps its own buffers alive until LaunchDone
            // (the Gpu trait's contract). Overlapped: kairos_run waits for the kernel before (every
            // thread, before the gate read and the first block) as launch_overlapped requires.
            // Posted to a launcher thread, the call happens there with the same parameters (copied
            // into the job); self outlives it (flushed before streams go, joined before modules go).
            let timed = self.time_launches;
            let clock = || if timed { Some(Instant::now()) } else { None };
            let took = |t: Option<Instant>| t.map_or(0, |t| t.elapsed().as_nanos() as u64);
            if let Some((l, lane)) = self.launcher_of(o.stream) {
                let t = clock();
                let job =
                    Job::new(f.f.raw(), stream_raw, grid, threads, dyn_smem_bytes, overlap, id, slot.unwrap_or(u32::MAX), params)
                        .map_err(GpuError::Invalid);
                let r = job.map(|job| l.post(lane, job));
                return Ok::<_, GpuError>((r, took(t)));
            }
            let stream = &self.streams[o.stream.0 as usize].by_partition[&o.partition.0];
            let t = clock();
            let r = if overlap {
                // SAFETY: as above.
                unsafe { f.f.launch_overlapped(grid, threads, dyn_smem_bytes, stream, params) }.map_err(drv)
            } else {
                // SAFETY: as above.
                unsafe { f.f.launch(grid, threads, dyn_smem_bytes, stream, params) }.map_err(drv)
            };
            Ok::<_, GpuError>((r, took(t)))
        })()
        .and_then(|(r, ns)| {
            self.launch_costs.driver_ns += ns;
            r
        });
        match (result, slot) {
            (Err(e), slot) => {
                if let Some(s) = slot {
                    self.protocol.free_slot(s);
                }
                // Silent launches before it may have counted on it to report their end.
                let mut ev = Vec::new();
                self.close_silent(o.stream, &mut ev);
                self.host_events.extend(ev);
                Err(e)
            }
            (Ok(()), Some(s)) => {
                self.issue_order += 1;
                let order = self.issue_order;
                self.in_flight[s as usize] = Some(InFlight {
                    id,
                    queue: (o.stream, o.partition.0),
                    first_placed_ns: None,
                    internal: false,
                    stop_word: stop.map(|x| x.0),
                });
                self.slot_of.insert(id, s);
                if let (Some(g), Some(st)) = (gate, self.streams.get_mut(o.stream.0 as usize)) {
                    st.last_seq = g.seq;
                    st.last_launch = Some(id);
                    st.last_may_stop = !light || g.gate_seq != 0;
                    st.reporting.push_back((order, id, implied_start, issued_ns));
                }
                Ok(id)
            }
            (Ok(()), None) if silent => {
                self.issue_order += 1;
                let order = self.issue_order;
                if let (Some(g), Some(st)) = (gate, self.streams.get_mut(o.stream.0 as usize)) {
                    st.last_seq = g.seq;
                    st.last_launch = Some(id);
                    st.last_may_stop = false;
                    st.silent.push_back((order, id, total_blocks, stop.unwrap_or(NO_STOP)));
                }
                Ok(id)
            }
            (Ok(()), None) => Ok(id),
        }
    }

    /// Whether protocol launches overlap their start with the end of the kernel before them on
    /// their stream (see [`crate::settings::Settings::overlap_launches`]).
    pub fn overlaps_launches(&self) -> bool {
        self.overlap_launches
    }

    /// Turns overlapped launches on or off (on is refused before sm_90, which lacks them).
    pub fn set_overlap_launches(&mut self, on: bool) -> Result<()> {
        if on && self.info.arch.strip_prefix("sm_").and_then(|a| a.parse::<u32>().ok()).is_none_or(|cc| cc < 90) {
            return Err(GpuError::Unsupported(format!("overlapped launches need sm_90 or newer, this is {}", self.info.arch)));
        }
        self.overlap_launches = on;
        Ok(())
    }

    /// Host time of the protocol launches so far (see [`LaunchCosts`]).
    pub fn launch_costs(&self) -> LaunchCosts {
        self.launch_costs
    }

    /// Launches a plan kernel with extra options (an SM bitmap for placement tests).
    pub fn launch_with(&mut self, request: &LaunchRequest<'_>, sm_bitmap: Option<DevicePtr>) -> Result<LaunchId> {
        self.launch_costs.launches += 1;
        if self.fault_at_launch.is_some_and(|n| self.launch_costs.launches >= n) {
            self.fault_at_launch = None;
            // The last argument is the output: 64 KiB into the address space, which nothing maps.
            let mut args = request.args.to_vec();
            if let Some(out) = args.last_mut() {
                *out = DevicePtr(0x10000);
            }
            eprintln!("kairos: test fault: launch {} writes to an unmapped address", self.launch_costs.launches);
            return self.launch_with_inner(&LaunchRequest { args: &args, ..*request }, sm_bitmap);
        }
        if let Some((n, block_ns)) = self.hang_at_launch
            && self.launch_costs.launches >= n
        {
            self.hang_at_launch = None;
            self.launch_hang(block_ns)?;
        }
        if !self.time_launches {
            return self.launch_with_inner(request, sm_bitmap);
        }
        let t0 = Instant::now();
        let r = self.launch_with_inner(request, sm_bitmap);
        self.launch_costs.total_ns += t0.elapsed().as_nanos() as u64;
        r
    }

    /// Tests only: the `n`-th launch call from the context's start (one-based, protocol launches
    /// through [`Gpu::launch`]; replays of recorded runs do not count) writes its output to an
    /// address nothing maps: an illegal-address fault, sticky for the life of the process. Proves
    /// the server's recovery on a real device.
    pub fn inject_fault_at_launch(&mut self, n: u64) {
        self.fault_at_launch = Some(n.max(1));
    }

    /// Tests only: just before the `n`-th launch call (counted as for
    /// [`CudaGpu::inject_fault_at_launch`]), a kernel of 32 blocks of 128 threads per SM, each
    /// spinning `block_ns`, goes onto a stream of its own: it fills every SM (more threads than an
    /// SM holds), so the launches behind it cannot place a CTA until it ends — a hung launch, as
    /// the dispatcher's watchdog sees it. Its events are not reported. A context reset waits for
    /// it to end (CUDA does not stop a running kernel); a process's exit ends it at once.
    pub fn inject_hang_at_launch(&mut self, n: u64, block_ns: u64) {
        self.hang_at_launch = Some((n.max(1), block_ns));
    }

    fn launch_hang(&mut self, block_ns: u64) -> Result<()> {
        let blocks = self.info.sm_count * 32;
        let counts = Gpu::alloc(self, blocks as u64 * 4, MemKind::Device)?;
        let stream = Gpu::create_stream(self, 0)?;
        let o = self.whole_device(stream);
        self.next_launch_flags = source::FLAG_NO_CTA_RECORDS | source::FLAG_LIGHT;
        let id = self.launch_spin(counts.ptr, blocks, block_ns, &o)?;
        if let Some(f) = self.slot_of.get(&id).and_then(|&s| self.in_flight[s as usize].as_mut()) {
            f.internal = true;
        }
        eprintln!(
            "kairos: test hang: before launch {}, a kernel fills every SM for {:.1} s",
            self.launch_costs.launches,
            block_ns as f64 / 1e9
        );
        Ok(())
    }

    /// Times every launch call and its driver call into [`CudaGpu::launch_costs`] (off by default:
    /// four clock reads a launch, on the dispatcher's thread).
    pub fn set_launch_timing(&mut self, on: bool) {
        self.time_launches = on;
    }

    fn launch_with_inner(&mut self, request: &LaunchRequest<'_>, sm_bitmap: Option<DevicePtr>) -> Result<LaunchId> {
        source::check_shape(request.kernel, &request.shape)?;
        let threads = request.shape.threads_per_block;
        let dyn_smem = source::dynamic_smem_bytes(request.kernel, request.dtype, &request.shape);
        let key = (source::entry_key(request.kernel, request.dtype, threads)?, threads, dyn_smem);
        let (f, name, per_sm) = match self.entries.get(&key) {
            Some(e) => (Arc::clone(&e.f), Arc::clone(&e.name), e.ctas_per_sm),
            None => {
                let f = self.kernel_function(request.kernel, request.dtype, threads, Variant::Protocol)?;
                let name: Arc<str> = source::function_name(request.kernel, request.dtype, threads)?.into();
                let per_sm = if threads == 0 || threads > f.threads_max || dyn_smem > f.dyn_smem_max_bytes {
                    0 // launch_inner refuses it with the reason
                } else {
                    self.occupancy_of(&name, &f, Variant::Protocol, threads, dyn_smem)?
                };
                if per_sm > 0 {
                    self.entries.insert(key, Entry { f: Arc::clone(&f), name: Arc::clone(&name), ctas_per_sm: per_sm });
                }
                (f, name, per_sm)
            }
        };
        self.next_launch_per_sm = (per_sm > 0).then_some(per_sm);
        let block = pack_request_args(request)?;
        let o = LaunchOptions {
            first_block: request.first_block,
            ctas: request.ctas,
            sm_mask: request.sm_mask,
            partition: request.partition,
            stream: request.stream,
            sm_bitmap,
            after: request.after,
        };
        // Arguments in mapped host memory: the CTAs fence at system scope before counting as done.
        let fence_flags = self.host_maps.fence_flags(request.args);
        let fenced = fence_flags != 0;
        // A launch no one will preempt, spread over its whole partition and not tracked CTA by
        // CTA, runs light; and silent too when the caller does not need its own end (a later
        // launch on its stream reports it) and no mapped host memory must see its writes.
        let whole = self.partitions.get(request.partition.0 as usize).is_some_and(|p| request.sm_mask.intersect(&p.sms) == p.sms);
        // A launch of a run being recorded with a stop word is light and silent: it stops between
        // kernels through the word (protocol.cuh point 8), not at its blocks.
        let stop_run = request.stop_word.is_some() && self.recording_pos > 0;
        let light =
            self.light_launches && (!request.preemptible || stop_run) && whole && sm_bitmap.is_none() && !request.report_ctas;
        if let Some(w) = request.stop_word {
            self.check_stop_word(w)?;
            if !stop_run {
                // Raised since it was last cleared: cleared first, in this stream's order.
                self.clear_stop_word_before(w.0, request.stream)?;
            }
        }
        self.next_launch_stop = request.stop_word.map(|w| (w.0, if stop_run { self.recording_pos } else { 0 }));
        let silent = light && !request.report_end && !request.report_start && !fenced;
        // A light launch queued right behind one that reports its end starts when that one ends
        // (stream order; it cannot be stopped at the gate, nothing before it may stop): its start
        // is reported then, and it writes no record of its own for it.
        let implied_start = light
            && request.report_start
            && self.streams.get(request.stream.0 as usize).is_some_and(|st| {
                st.alive && !st.last_may_stop && st.last_launch.is_some() && st.reporting.back().map(|x| x.1) == st.last_launch
            });
        self.next_launch_implied_start = implied_start;
        self.next_launch_flags = fence_flags
            | if request.report_ctas { 0 } else { source::FLAG_NO_CTA_RECORDS }
            | if request.report_start && !implied_start { source::FLAG_START_RECORD } else { 0 }
            | if light { source::FLAG_LIGHT } else { 0 }
            | if silent { source::FLAG_SILENT } else { 0 };
        let id = self.launch_inner(
            &name,
            &f,
            Some(&block),
            request.shape.logical_blocks,
            request.shape.threads_per_block,
            dyn_smem,
            &o,
            Variant::Protocol,
        )?;
        if fenced {
            let slot_of = &self.slot_of;
            self.host_maps.note_launch(id, request.args, |l| slot_of.contains_key(&l));
        }
        Ok(id)
    }

    /// Where the preempt flags of launches from now on live (the settings' `stop_flag` at open;
    /// measurements compare both in one process). `StopFlag::Device` needs the driver's stream
    /// writes.
    pub fn set_stop_flag(&mut self, stop_flag: StopFlag) -> Result<()> {
        if stop_flag == StopFlag::Device && !driver::has_symbol("cuStreamWriteValue32_v2") {
            return Err(GpuError::Invalid("this driver has no stream writes (cuStreamWriteValue32_v2)".into()));
        }
        self.flush_launches();
        self.protocol.set_stop_flag(stop_flag);
        Ok(())
    }

    pub fn stop_flag(&self) -> StopFlag {
        self.protocol.stop_flag()
    }

    /// The `kairos_spin` helper: `blocks` logical blocks of `ns_per_block` each, counting every
    /// execution of block b in `counts[b]` (u32).
    pub fn launch_spin(&mut self, counts: DevicePtr, blocks: u32, ns_per_block: u64, o: &LaunchOptions) -> Result<LaunchId> {
        let f = self.function_by_name("kairos_spin", UTIL, Variant::Protocol)?;
        let mut args = ParamBlock::default();
        args.u64(counts.0);
        args.u64(ns_per_block);
        args.finish();
        self.launch_inner("kairos_spin", &f, Some(&args), blocks, 128, 0, o, Variant::Protocol)
    }

    /// [`CudaGpu::launch_spin`] as a light launch (protocol.cuh, point 7; end record only), or a
    /// silent one (nothing reported: a later reporting launch on its stream reports it).
    pub fn launch_spin_light(
        &mut self,
        counts: DevicePtr,
        blocks: u32,
        ns_per_block: u64,
        o: &LaunchOptions,
        silent: bool,
    ) -> Result<LaunchId> {
        self.next_launch_flags = source::FLAG_NO_CTA_RECORDS | source::FLAG_LIGHT | if silent { source::FLAG_SILENT } else { 0 };
        self.launch_spin(counts, blocks, ns_per_block, o)
    }

    /// The `kairos_noop` helper: `blocks` empty logical blocks under the protocol.
    pub fn launch_noop(&mut self, blocks: u32, threads: u32, o: &LaunchOptions) -> Result<LaunchId> {
        let f = self.function_by_name("kairos_noop", UTIL, Variant::Protocol)?;
        self.launch_inner("kairos_noop", &f, None, blocks, threads, 0, o, Variant::Protocol)
    }

    /// A bare empty kernel of `ctas` CTAs (no protocol, no notification), for launch-cost baselines.
    /// Returns when it has been issued.
    pub fn launch_empty(&mut self, ctas: u32, threads: u32, stream: StreamId) -> Result<()> {
        self.flush_launches();
        let f = self.function_by_name("kairos_empty", UTIL, Variant::Protocol)?;
        let s = self.stream_for(stream, 0)?;
        // SAFETY: kairos_empty takes no parameters.
        unsafe { f.f.launch(ctas, threads, 0, s, &[]) }.map_err(drv)
    }

    /// Times work with device events around it on `stream` (in `partition`): `issue` queues the
    /// work, and when it returns a launch, its `LaunchDone` is awaited too. Returns nanoseconds.
    pub fn time_issue(
        &mut self,
        stream: StreamId,
        partition: PartitionId,
        issue: impl FnOnce(&mut CudaGpu) -> Result<Option<LaunchId>>,
    ) -> Result<u64> {
        self.bind()?;
        // Timed work is launched on this thread, right after the start event (a handoff to a
        // launcher thread would add its latency to the time).
        self.flush_launches();
        let part = self
            .partitions
            .get(partition.0 as usize)
            .ok_or_else(|| GpuError::Invalid(format!("unknown partition {}", partition.0)))?;
        let start = Self::event_in(&self.ctx, part, true)?;
        start.record(self.stream_for(stream, partition.0)?).map_err(drv)?;
        let inline = std::mem::replace(&mut self.launch_inline, true);
        let id = issue(self);
        self.launch_inline = inline;
        let id = id?;
        let last = self.streams[stream.0 as usize].last_partition.unwrap_or(partition.0);
        let end = Self::event_in(&self.ctx, &self.partitions[last as usize], true)?;
        end.record(self.stream_for(stream, last)?).map_err(drv)?;
        end.synchronize().map_err(drv)?;
        if let Some(id) = id {
            self.wait_done(id)?;
        }
        let ms = end.elapsed_ms_since(&start).map_err(drv)?;
        Ok((ms as f64 * 1e6) as u64)
    }

    /// Times one launch: the kernel under the protocol, or the same kernel built without it as a
    /// plain grid of one CTA per logical block. Returns nanoseconds.
    pub fn time_launch(&mut self, request: &LaunchRequest<'_>, variant: Variant) -> Result<u64> {
        let d = self.direct_launch(request, variant)?;
        let (blocks, threads) = (request.shape.logical_blocks, request.shape.threads_per_block);
        self.time_issue(d.o.stream, d.o.partition, |g| {
            let id = g.launch_inner(&d.name, &d.f, Some(&d.block), blocks, threads, d.dyn_smem, &d.o, variant)?;
            Ok((variant == Variant::Protocol).then_some(id))
        })
    }

    /// What launching `request`'s kernel built as `variant` straight through `launch_inner` needs
    /// (its flags as that function's defaults: all CTA records, no light launch).
    fn direct_launch(&mut self, request: &LaunchRequest<'_>, variant: Variant) -> Result<DirectLaunch> {
        source::check_shape(request.kernel, &request.shape)?;
        let threads = request.shape.threads_per_block;
        let f = self.kernel_function(request.kernel, request.dtype, threads, variant)?;
        let name = source::function_name(request.kernel, request.dtype, threads)?;
        let block = pack_request_args(request)?;
        let o = LaunchOptions {
            first_block: request.first_block,
            ctas: request.ctas,
            sm_mask: request.sm_mask,
            partition: request.partition,
            stream: request.stream,
            sm_bitmap: None,
            after: request.after,
        };
        let dyn_smem = source::dynamic_smem_bytes(request.kernel, request.dtype, &request.shape);
        Ok(DirectLaunch { f, name, block, o, dyn_smem })
    }

    /// Records runs from now on with plain grids where their units are ready (true, the default)
    /// or light, silent protocol launches (false; see [`crate::settings::Settings::run_kernels_plain`]).
    pub fn set_run_kernels_plain(&mut self, plain: bool) {
        self.run_kernels_plain = plain;
    }

    /// Whether launches the caller will not preempt run light (see [`crate::settings::Settings::light_launches`]).
    pub fn light_launches(&self) -> bool {
        self.light_launches
    }

    pub fn set_light_launches(&mut self, on: bool) {
        self.light_launches = on;
    }

    /// Launches a plan kernel as built under the protocol (as [`Gpu::launch`]) or as a plain grid
    /// of one CTA per logical block without it (`Variant::Plain`: no notification ever reports it;
    /// the caller synchronizes). Plain launches exist for measurements against the protocol.
    pub fn launch_variant(&mut self, request: &LaunchRequest<'_>, variant: Variant) -> Result<LaunchId> {
        if variant == Variant::Protocol {
            return self.launch(request);
        }
        let d = self.direct_launch(&LaunchRequest { after: None, ..*request }, variant)?;
        let (blocks, threads) = (request.shape.logical_blocks, request.shape.threads_per_block);
        // A plain grid of a run being recorded with a stop word reads it (protocol.cuh point 8).
        if let Some(w) = request.stop_word.filter(|_| self.recording_pos > 0) {
            self.check_stop_word(w)?;
            self.next_launch_stop = Some((w.0, self.recording_pos));
        }
        self.launch_inner(&d.name, &d.f, Some(&d.block), blocks, threads, d.dyn_smem, &d.o, variant)
    }

    /// Captures the plain launches `issue` makes on `stream` into a CUDA graph (nothing runs
    /// until the graph is launched). Protocol launches cannot be captured (their launch slots and
    /// notifications belong to one run): a capture in which one was made is an error.
    pub fn capture_plain(
        &mut self,
        stream: StreamId,
        issue: impl FnOnce(&mut CudaGpu) -> Result<()>,
    ) -> Result<crate::safe::Graph> {
        self.capture_in(stream, PartitionId::WHOLE, issue)
    }

    /// [`CudaGpu::capture_plain`] on the stream's CUDA stream of `partition` (a green context's:
    /// the graph's kernels then run on that partition's SMs wherever it is launched).
    fn capture_in(
        &mut self,
        stream: StreamId,
        partition: PartitionId,
        issue: impl FnOnce(&mut CudaGpu) -> Result<()>,
    ) -> Result<crate::safe::Graph> {
        self.bind()?;
        self.flush_launches();
        let slots_before = self.protocol.slots_in_flight();
        self.stream_for(stream, partition.0)?.begin_capture().map_err(drv)?;
        let inline = std::mem::replace(&mut self.launch_inline, true);
        let issued = issue(self);
        self.launch_inline = inline;
        let graph = self.stream_for(stream, partition.0)?.end_capture().map_err(drv);
        issued?;
        let graph = graph?;
        if self.protocol.slots_in_flight() != slots_before {
            return Err(GpuError::Invalid("a protocol launch was made while capturing a graph".into()));
        }
        Ok(graph)
    }

    /// Queues one run of a graph from [`CudaGpu::capture_plain`] on `stream` (whole device).
    pub fn launch_graph(&mut self, graph: &crate::safe::Graph, stream: StreamId) -> Result<()> {
        self.bind()?;
        self.flush_launches();
        let s = self.stream_for(stream, 0)?;
        // SAFETY: the captured kernels' modules live as long as self, and their buffers are the
        // caller's, kept alive until it synchronizes (this method's contract, as for launches).
        unsafe { graph.launch(s) }.map_err(drv)
    }

    /// Times work queued on several streams while they are held: the first stream runs a spin
    /// kernel of `hold_ns` and the others wait for it, `issue` queues the work (inline, on this
    /// thread), and every stream's time runs from the release to its last work's end. So the
    /// GPU sees all of the work at once, whatever the host's launch rate: device-side costs only.
    /// The protocol launches `issue` returns are awaited too.
    pub fn time_held(
        &mut self,
        streams: &[StreamId],
        hold_ns: u64,
        issue: impl FnOnce(&mut CudaGpu) -> Result<Vec<LaunchId>>,
    ) -> Result<HeldTiming> {
        let (&gate, _) = streams.split_first().ok_or_else(|| GpuError::Invalid("time_held needs a stream".into()))?;
        self.bind()?;
        self.flush_launches();
        let counts = self.alloc(4, MemKind::Device)?;
        let inline = std::mem::replace(&mut self.launch_inline, true);
        let timed = (|| {
            let o = LaunchOptions { ctas: 1, ..self.whole_device(gate) };
            let spin = self.launch_spin(counts.ptr, 1, hold_ns, &o)?;
            let start = Self::event_in(&self.ctx, &self.partitions[0], true)?;
            start.record(self.stream_for(gate, 0)?).map_err(drv)?;
            for &s in &streams[1..] {
                self.stream_for(s, 0)?.wait(&start).map_err(drv)?;
            }
            let t0 = Instant::now();
            let ids = issue(self)?;
            let issue_ns = t0.elapsed().as_nanos() as u64;
            let mut ends = Vec::new();
            for &s in streams {
                let e = Self::event_in(&self.ctx, &self.partitions[0], true)?;
                e.record(self.stream_for(s, 0)?).map_err(drv)?;
                ends.push(e);
            }
            let mut stream_ns = Vec::new();
            for e in &ends {
                e.synchronize().map_err(drv)?;
                stream_ns.push((e.elapsed_ms_since(&start).map_err(drv)? as f64 * 1e6) as u64);
            }
            self.wait_done(spin)?;
            for id in ids {
                self.wait_done(id)?;
            }
            Ok(HeldTiming { issue_ns, stream_ns, released_early: issue_ns > hold_ns })
        })();
        self.launch_inline = inline;
        self.free(counts)?;
        timed
    }

    /// The device-measured span of a finished launch: from its first placement record to its
    /// LaunchDone (both %globaltimer), i.e. how long its CTAs occupied the GPU. Kept for the
    /// last few thousand launches.
    pub fn launch_span_ns(&self, launch: LaunchId) -> Option<u64> {
        self.spans.iter().rev().find(|(l, _)| *l == launch).map(|x| x.1)
    }

    /// Runs a launch to completion and returns its device-measured span (see `launch_span_ns`).
    pub fn time_span(&mut self, request: &LaunchRequest<'_>) -> Result<u64> {
        let id = self.launch(request)?;
        self.wait_done(id)?;
        self.launch_span_ns(id).ok_or_else(|| GpuError::Driver("a finished launch has no span".into()))
    }

    /// Polls until `launch` reports `LaunchDone` (or `LaunchLost`: an error, at once, instead of
    /// waiting for an end that will never be reported). The launch's own placement and completion
    /// events are consumed; other launches' events are kept, in order, for the next `poll`.
    pub fn wait_done(&mut self, launch: LaunchId) -> Result<(u32, bool)> {
        let lost = || GpuError::Driver(format!("launch {}'s notifications were lost (the ring overflowed)", launch.0));
        let mut events = Vec::new();
        let deadline = self.now_ns() + 60_000_000_000;
        loop {
            // Its end may already sit among the events kept for `poll` (read by an earlier poll,
            // or put there by the ring's recovery): look there first, every time.
            if let Some(i) = self.host_events.iter().position(
                |e| matches!(e, GpuEvent::LaunchDone { launch: l, .. } | GpuEvent::LaunchLost { launch: l, .. } if *l == launch),
            ) {
                let done = self.host_events.remove(i);
                self.host_events.retain(|e| !Self::is_event_of(e, launch));
                return match done {
                    Some(GpuEvent::LaunchDone { next_block, preempted, .. }) => Ok((next_block, preempted)),
                    _ => Err(lost()),
                };
            }
            events.clear();
            self.poll_device(&mut events)?;
            let mut found = None;
            for e in events.drain(..) {
                match e {
                    GpuEvent::LaunchDone { launch: l, next_block, preempted, .. } if l == launch => {
                        found = Some(Ok((next_block, preempted)))
                    }
                    GpuEvent::LaunchLost { launch: l, .. } if l == launch => found = Some(Err(lost())),
                    e if Self::is_event_of(&e, launch) => {}
                    e => self.stash(e)?,
                }
            }
            if let Some(r) = found {
                return r;
            }
            if self.now_ns() > deadline {
                return Err(GpuError::Driver(format!("launch {} did not finish within 60 s", launch.0)));
            }
            self.wait_device(self.now_ns() + 1_000_000)?;
        }
    }

    fn is_event_of(e: &GpuEvent, launch: LaunchId) -> bool {
        match *e {
            GpuEvent::CtasPlaced { launch: l, .. }
            | GpuEvent::CtasFinished { launch: l, .. }
            | GpuEvent::LaunchStarted { launch: l, .. }
            | GpuEvent::LaunchLost { launch: l, .. }
            | GpuEvent::LaunchDone { launch: l, .. } => l == launch,
            GpuEvent::CopyDone { .. } => false,
        }
    }

    /// Keeps an event for the next `poll`; a caller that never polls runs into a limit, not
    /// unbounded memory.
    fn stash(&mut self, e: GpuEvent) -> Result<()> {
        if self.host_events.len() >= HOST_EVENTS_MAX {
            return Err(GpuError::Exhausted { limit: "events not yet polled", max: HOST_EVENTS_MAX as u64 });
        }
        self.host_events.push_back(e);
        Ok(())
    }

    /// Waits for everything queued on every stream.
    pub fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        self.flush_launches();
        for st in &self.streams {
            for s in st.by_partition.values() {
                s.synchronize().map_err(drv)?;
            }
        }
        self.helper_stream.synchronize().map_err(drv)
    }

    fn take_event(&mut self, timing: bool) -> Result<Event> {
        if !timing && let Some(e) = self.spare_events.pop() {
            return Ok(e);
        }
        Event::new(timing).map_err(drv)
    }

    /// Notification records read so far.
    pub fn records_read(&self) -> u64 {
        self.records_read
    }

    /// Launch starts reported without a record of their own (implied by the end of the launch
    /// before them on their stream).
    pub fn starts_implied(&self) -> u64 {
        self.starts_implied
    }

    /// Times the notification ring overflowed and was recovered.
    pub fn ring_overflows(&self) -> u64 {
        self.ring_overflows
    }

    /// Number of launches whose `LaunchDone` has not been polled yet.
    pub fn launches_in_flight(&self) -> u32 {
        self.protocol.slots_in_flight()
    }

    /// Follows the drift between the device's clock and the host's. A record read at host time h
    /// and stamped d on the device says offset >= d - h (it was written before it was read), with
    /// equality when it is read at once; so the offset is the largest such sample, and it is let
    /// down by `CLOCK_DRIFT_PPM` of the time that passed, to follow a device clock that falls
    /// behind (the samples of a busy ring lift it back within microseconds).
    fn track_clock(&mut self, records: &[Record]) {
        let Some(newest) = records.iter().map(|r| r.device_ns).max() else { return };
        let now = self.now_ns();
        let elapsed = now.saturating_sub(self.clock_tracked_ns);
        self.clock_tracked_ns = now;
        let decayed = self.device_clock_offset_ns - (elapsed as i64 * CLOCK_DRIFT_PPM / 1_000_000);
        self.device_clock_offset_ns = decayed.max(newest as i64 - now as i64);
    }

    fn device_to_host_ns(&self, device_ns: u64) -> u64 {
        let t = device_ns as i64 - self.device_clock_offset_ns;
        (t.max(0) as u64).min(self.now_ns())
    }

    fn find(&self, ptr: DevicePtr, len: u64) -> Result<(&Allocated, u64)> {
        let (&base, a) = self
            .allocations
            .range(..=ptr.0)
            .next_back()
            .ok_or_else(|| GpuError::Invalid(format!("{:#x} is not in any allocation", ptr.0)))?;
        let off = ptr.0 - base;
        if off + len > a.bytes() {
            return Err(GpuError::Invalid(format!("{len} bytes at {:#x} run past an allocation of {} bytes", ptr.0, a.bytes())));
        }
        Ok((a, off))
    }

    /// Spins until a notification record or a finished copy is available, or `until_ns`.
    fn wait_device(&mut self, until_ns: u64) -> Result<()> {
        // Callers wait in short steps (the engine: microseconds), so the health check goes by the
        // clock, not only by spins: a kernel that faulted is found within HEALTH_CHECK_NS.
        let now = self.now_ns();
        if now >= self.last_health_check_ns + HEALTH_CHECK_NS && self.protocol.slots_in_flight() > 0 {
            self.last_health_check_ns = now;
            self.check_streams()?;
        }
        let mut spins: u32 = 0;
        loop {
            if self.protocol.has_record() {
                return Ok(());
            }
            if let Some((_, e)) = self.copies.front()
                && e.is_done().map_err(drv)?
            {
                return Ok(());
            }
            for p in &self.peers {
                if let Some((_, e)) = p.copies.front()
                    && e.is_done().map_err(drv)?
                {
                    return Ok(());
                }
            }
            if self.now_ns() >= until_ns {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                let now = self.now_ns();
                if now >= self.last_health_check_ns + HEALTH_CHECK_NS {
                    self.last_health_check_ns = now;
                    self.check_streams()?;
                }
                if self.protocol.slots_in_flight() == 0 && self.copies_in_flight() == 0 {
                    // Nothing can arrive: sleep instead of spinning.
                    let left = until_ns.saturating_sub(self.now_ns());
                    std::thread::sleep(std::time::Duration::from_nanos(left.min(1_000_000)));
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Surfaces a failed kernel (illegal address, ...) as an error instead of a silent hang.
    /// Only streams with launches in flight are asked (each query is a driver call).
    fn check_streams(&self) -> Result<()> {
        let mut asked: Vec<(StreamId, u32)> = Vec::new();
        for f in self.in_flight.iter().flatten() {
            if asked.contains(&f.queue) {
                continue;
            }
            asked.push(f.queue);
            if let Some(s) = self.streams.get(f.queue.0.0 as usize).and_then(|st| st.by_partition.get(&f.queue.1)) {
                s.is_idle().map_err(drv)?;
            }
        }
        Ok(())
    }

    /// Attaches GPU `ordinal` as a secondary for parallel transmission (DeepPlan 4.3.3; see
    /// [`crate::peer`]): enables peer access both ways, reserves `staging_bytes` on it (whole
    /// [`kairos_gpu::PEER_PIECE_BYTES`] pieces, at least one) and measures the two legs of the
    /// path (host to the secondary, secondary to this GPU, 32 MiB, best of three). The secondary
    /// keeps serving its own work; its index in [`Gpu::peer_paths`] is the order of attachment.
    pub fn attach_peer(&mut self, ordinal: u32, staging_bytes: u64) -> Result<PeerPath> {
        const MEASURE_BYTES: u64 = 32 << 20;
        self.bind()?;
        if self.peers.iter().any(|p| p.ordinal == ordinal) {
            return Err(GpuError::Invalid(format!("GPU {ordinal} is already a secondary of GPU {}", self.ordinal)));
        }
        let host = MappedBuffer::new(MEASURE_BYTES).map_err(drv)?;
        let dst = DeviceBuffer::new(MEASURE_BYTES).map_err(drv)?;
        let attached = crate::peer::SecondaryLink::open(&self.ctx, self.ordinal, ordinal, staging_bytes).and_then(|mut link| {
            let bytes = MEASURE_BYTES.min(link.path.staging_bytes);
            // SAFETY: `host` is pinned portable memory of MEASURE_BYTES and `dst` a live device
            // buffer of this context of as many; `bytes` fits the staging; both outlive the
            // measurement, which waits for its copies.
            let (h2d, fwd) = unsafe { link.measure(host.dev_ptr(), dst.ptr(), bytes, self.ctx.raw()) }?;
            link.set_rates(h2d, fwd);
            Ok(link)
        });
        // SecondaryLink::open leaves the secondary's context current (on success and on most errors).
        self.ctx.bind().map_err(drv)?;
        let link = attached?;
        let path = link.path;
        self.peers.push(link);
        if !self.peer_requests.iter().any(|&(o, _)| o == ordinal) {
            self.peer_requests.push((ordinal, staging_bytes));
        }
        Ok(path)
    }

    /// Takes the copies in flight off the process-wide link registry (their context is going).
    fn forget_copies(&mut self) {
        for _ in self.copies.drain(..) {
            crate::peer::link_done(self.ordinal);
        }
        for p in &mut self.peers {
            for _ in p.copies.drain(..) {
                crate::peer::link_done(p.ordinal);
            }
        }
    }

    /// Copies in flight on this GPU's copy engines and through its secondaries.
    fn copies_in_flight(&self) -> usize {
        self.copies.len() + self.peers.iter().map(|p| p.copies.len()).sum::<usize>()
    }

    /// A normal-priority stream of this GPU's own, made once: for runners that need a stream
    /// for a while (profiles, plan runs) without adding one per call.
    pub fn utility_stream(&mut self) -> Result<StreamId> {
        if let Some(s) = self.utility_stream {
            return Ok(s);
        }
        let s = self.create_stream(0)?;
        self.utility_stream = Some(s);
        Ok(s)
    }
}

fn bitmap_to_mask(bytes: &[u8]) -> SmMask {
    let mut m = SmMask::EMPTY;
    for (i, b) in bytes.iter().enumerate() {
        for bit in 0..8 {
            if b & (1 << bit) != 0 {
                m.insert((i * 8 + bit) as u32);
            }
        }
    }
    m
}

/// Reads an SM bitmap buffer (as `LaunchOptions::sm_bitmap` fills) into a mask.
pub fn read_sm_bitmap(gpu: &mut CudaGpu, bitmap: DevicePtr) -> Result<SmMask> {
    let mut bytes = [0u8; source::SM_COUNT_MAX / 8];
    gpu.read(bitmap, &mut bytes)?;
    Ok(bitmap_to_mask(&bytes))
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        // The launchers hand over what was posted and stop before anything they use goes.
        self.launchers = None;
        // Let queued work finish before buffers, modules and streams go.
        let _ = self.ctx.bind();
        let _ = self.synchronize();
        self.forget_copies();
    }
}

impl Gpu for CudaGpu {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        self.bind()?;
        let a = match kind {
            MemKind::Device => match DeviceBuffer::new(bytes) {
                Ok(b) => Allocated::Device(b),
                Err(e) if e.code == driver::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    let free_bytes = driver::mem_get_info().map(|m| m.0).unwrap_or(0);
                    return Err(GpuError::OutOfMemory { requested_bytes: bytes, free_bytes });
                }
                Err(e) => return Err(drv(e)),
            },
            MemKind::HostMapped => Allocated::Host(MappedBuffer::new(bytes).map_err(drv)?),
        };
        let ptr = match &a {
            Allocated::Device(b) => b.ptr(),
            Allocated::Host(b) => b.dev_ptr(),
        };
        self.allocations.insert(ptr, a);
        Ok(Allocation { ptr: DevicePtr(ptr), bytes, kind })
    }

    fn free(&mut self, allocation: Allocation) -> Result<()> {
        self.bind()?;
        match self.allocations.remove(&allocation.ptr.0) {
            Some(_) => Ok(()),
            None => Err(GpuError::Invalid(format!("free of {:#x}, which is not an allocation", allocation.ptr.0))),
        }
    }

    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.bind()?;
        let (a, off) = self.find(dst, data.len() as u64)?;
        match a {
            // Complete on return: launches on our (non-blocking) streams do not wait for a copy
            // the driver left in flight (a replayed run read half-written inputs on an H100).
            Allocated::Device(b) => b.write_complete(off, data, &self.write_stream).map_err(drv),
            Allocated::Host(b) => {
                // SAFETY: `write` is a synchronous copy that the caller orders against the
                // kernels using this memory (the Gpu trait's contract), so none races with it.
                unsafe { b.write_bytes(off, data) };
                Ok(())
            }
        }
    }

    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.bind()?;
        let (a, off) = self.find(src, out.len() as u64)?;
        match a {
            Allocated::Device(b) => b.read(off, out).map_err(drv),
            Allocated::Host(b) => {
                // SAFETY: as in write: the caller orders reads after the kernels that write here.
                unsafe { b.read_bytes(off, out) };
                Ok(())
            }
        }
    }

    fn copy_async(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<CopyId> {
        self.bind()?;
        self.flush_launches();
        self.find(dst, bytes)?;
        self.find(src, bytes)?;
        if self.copies_in_flight() >= COPIES_MAX {
            return Err(GpuError::Exhausted { limit: "copies in flight", max: COPIES_MAX as u64 });
        }
        let event = self.take_event(false)?;
        // Copies use no SMs: they go on the stream's whole-device CUDA stream (ordered after its
        // launches in other partitions by stream_for), whose context owns the pool's events.
        let s = self.stream_for(stream, 0)?;
        // SAFETY: both ranges were checked to lie inside live allocations; the caller keeps them
        // alive until CopyDone (the Gpu trait's contract).
        unsafe { s.copy(dst.0, src.0, bytes) }.map_err(drv)?;
        event.record(s).map_err(drv)?;
        let id = CopyId(self.next_copy);
        self.next_copy += 1;
        self.copies.push_back((id, event));
        crate::peer::link_add(self.ordinal);
        Ok(id)
    }

    fn wait_copy(&mut self, stream: StreamId, copy: CopyId) -> Result<()> {
        self.bind()?;
        if copy.0 == 0 || copy.0 >= self.next_copy {
            return Err(GpuError::Invalid(format!("copy {} was never queued", copy.0)));
        }
        // Copies leave their queue when their CopyDone is polled: one no longer there has landed.
        // (A copy through a secondary has an event of the secondary's context: a stream may wait
        // for an event of another device.)
        let own = self.copies.iter().position(|(id, _)| *id == copy).map(|i| (None, i));
        let through_peer = || {
            self.peers.iter().enumerate().find_map(|(k, p)| p.copies.iter().position(|(id, _)| *id == copy).map(|i| (Some(k), i)))
        };
        let Some((peer, pos)) = own.or_else(through_peer) else { return Ok(()) };
        // The wait must follow the launches posted to the stream so far (stream_for flushes only
        // when the stream changes partition).
        self.flush_launches();
        self.stream_for(stream, PartitionId::WHOLE.0)?;
        let s = &self.streams[stream.0 as usize].by_partition[&PartitionId::WHOLE.0];
        let event = match peer {
            None => &self.copies[pos].1,
            Some(k) => &self.peers[k].copies[pos].1,
        };
        s.wait(event).map_err(drv)
    }

    fn peer_paths(&self) -> Vec<PeerPath> {
        self.peers.iter().map(|p| p.path).collect()
    }

    fn copy_via_peer(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, peer: usize) -> Result<CopyId> {
        self.bind()?;
        if peer >= self.peers.len() {
            return Err(GpuError::Invalid(format!(
                "GPU {} has {} secondary GPU(s), not {}",
                self.ordinal,
                self.peers.len(),
                peer + 1
            )));
        }
        if bytes == 0 {
            return Err(GpuError::Invalid("copy of 0 bytes".into()));
        }
        match (self.find(dst, bytes)?.0, self.find(src, bytes)?.0) {
            (Allocated::Device(_), Allocated::Host(_)) => {}
            _ => {
                return Err(GpuError::Invalid(
                    "a copy through a secondary GPU goes from pinned host memory to device memory".into(),
                ));
            }
        }
        if self.copies_in_flight() >= COPIES_MAX {
            return Err(GpuError::Exhausted { limit: "copies in flight", max: COPIES_MAX as u64 });
        }
        let primary = self.ctx.raw();
        let link = &mut self.peers[peer];
        link.bind()?;
        // SAFETY: both ranges were checked to lie inside live allocations of this GPU (a device
        // buffer, and pinned portable mapped host memory, valid in every context); the caller keeps
        // them alive until CopyDone (the Gpu trait's contract); `primary` is this GPU's context,
        // the one the link was opened for.
        let copied = unsafe { link.copy(dst.0, src.0, bytes, primary) };
        self.ctx.bind().map_err(drv)?;
        let event = copied?;
        let id = CopyId(self.next_copy);
        self.next_copy += 1;
        self.peers[peer].copies.push_back((id, event));
        crate::peer::link_add(self.peers[peer].ordinal);
        Ok(id)
    }

    fn peer_busy(&self, peer: usize) -> bool {
        self.peers.get(peer).is_some_and(|p| crate::peer::link_busy(p.ordinal))
    }

    fn create_stream(&mut self, priority: i32) -> Result<StreamId> {
        self.bind()?;
        if self.streams.len() - self.streams_destroyed >= STREAMS_MAX {
            return Err(GpuError::Exhausted { limit: "streams", max: STREAMS_MAX as u64 });
        }
        // CUDA: lower numbers are more urgent, from `least` (0) down to `greatest` (-5 on Hopper).
        let (least, greatest) = self.priority_range;
        let cuda_priority = (-priority).clamp(greatest, least);
        // Gate words of destroyed streams come back once their last launch is done.
        let slot_of = &self.slot_of;
        let protocol = &mut self.protocol;
        self.retired_gate_words.retain(|&(word, last)| {
            let busy = last.is_some_and(|l| slot_of.contains_key(&l));
            if !busy {
                protocol.free_gate_word(word);
            }
            busy
        });
        let gate_word = self
            .protocol
            .alloc_gate_word()
            .ok_or(GpuError::Exhausted { limit: "stream gate words", max: GATE_WORDS_MAX as u64 })?;
        let id = StreamId(self.streams.len() as u32);
        self.streams.push(StreamState {
            alive: true,
            priority: cuda_priority,
            by_partition: IdMap::default(),
            last_partition: None,
            chain: IdMap::default(),
            gate_word,
            last_seq: 0,
            last_launch: None,
            last_may_stop: false,
            silent: VecDeque::new(),
            reporting: VecDeque::new(),
        });
        self.stream_for(id, 0)?;
        self.streams[id.0 as usize].last_partition = None;
        Ok(id)
    }

    fn destroy_stream(&mut self, stream: StreamId) -> Result<()> {
        self.bind()?;
        self.flush_launches();
        let st = self
            .streams
            .get_mut(stream.0 as usize)
            .filter(|s| s.alive)
            .ok_or_else(|| GpuError::Invalid(format!("unknown or destroyed stream {}", stream.0)))?;
        // Dropping the RAII streams and events destroys them; CUDA lets queued work finish first.
        st.by_partition.clear();
        st.chain.clear();
        st.last_partition = None;
        st.alive = false;
        self.retired_gate_words.push((st.gate_word, st.last_launch));
        self.streams_destroyed += 1;
        Ok(())
    }

    fn prepare_plan(&mut self, plan: &kairos_ir::plan::Plan) -> Result<()> {
        let units = Self::plan_units(plan)?;
        self.prepare_units(&units, &plan.model).map(|_| ())
    }

    fn kernel_resources(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> Result<KernelResources> {
        source::check_shape(kernel, shape)?;
        let f = self.kernel_function(kernel, dtype, shape.threads_per_block, Variant::Protocol)?;
        let name = source::function_name(kernel, dtype, shape.threads_per_block)?;
        if shape.threads_per_block > f.threads_max {
            return Err(GpuError::Invalid(format!("{name} runs at most {} threads per CTA", f.threads_max)));
        }
        let dyn_smem = source::dynamic_smem_bytes(kernel, dtype, shape);
        let ctas_per_sm_max = self.occupancy_of(&name, &f, Variant::Protocol, shape.threads_per_block, dyn_smem)?;
        Ok(KernelResources {
            threads_per_cta: shape.threads_per_block,
            registers_per_thread: f.registers,
            shared_mem_bytes: f.static_smem_bytes + dyn_smem,
            ctas_per_sm_max,
        })
    }

    fn launch(&mut self, request: &LaunchRequest<'_>) -> Result<LaunchId> {
        let id = self.launch_with(request, None);
        self.flush_preempts()?;
        id
    }

    /// Captures the launches into a CUDA graph on a capture stream of its own, as plain grids (or
    /// light, silent protocol launches: `KAIROS_RUN_KERNELS`): their parameters hold no launch
    /// slot, sequence number or gate, so one instance replays them any number of times.
    fn record_run(&mut self, launches: &[LaunchRequest<'_>]) -> Result<RunId> {
        if launches.is_empty() || launches.len() > RUN_LAUNCHES_MAX {
            return Err(GpuError::Invalid(format!("a run holds 1 to {RUN_LAUNCHES_MAX} launches, got {}", launches.len())));
        }
        if self.runs.len() >= RUNS_MAX {
            return Err(GpuError::Exhausted { limit: "recorded runs", max: RUNS_MAX as u64 });
        }
        // Plain grids where every unit the run needs is at hand without compiling (embedded,
        // cached or loaded); otherwise, with quick builds on (serving), light launches now and the
        // plain units compile in the background for the runs recorded later, and with them off
        // (benchmarks, tests) the plain units compile first.
        let stop_word = launches[0].stop_word;
        if let Some(w) = stop_word {
            self.check_stop_word(w)?;
            if launches.len() > STOP_RUN_LAUNCHES_MAX {
                return Err(GpuError::Invalid(format!(
                    "a run with a stop word holds at most {STOP_RUN_LAUNCHES_MAX} launches, got {}",
                    launches.len()
                )));
            }
        }
        let mut plain = self.run_kernels_plain;
        if plain {
            let mut missing = Vec::new();
            for l in launches {
                let u = source::unit_of(l.kernel, l.dtype, l.shape.threads_per_block)?;
                if !self.unit_ready(u, Variant::Plain) && !missing.contains(&(u, Variant::Plain)) {
                    missing.push((u, Variant::Plain));
                }
            }
            if !missing.is_empty() && self.light_launches && self.quick_builds {
                // Serving: record now from light launches rather than wait.
                plain = false;
                if !self.run_plain_compiling {
                    self.run_plain_compiling = true;
                    self.compile_in_background(missing, "the plain grids of recorded runs".into());
                }
            } else if !missing.is_empty() {
                // Timing work (quick builds off) measures what a warm server runs: the plain grids.
                self.prepare_units(&missing, "the plain grids of recorded runs")?;
            }
        }
        if !plain && !self.light_launches {
            return Err(GpuError::Unsupported(
                "runs are recorded from light launches, which KAIROS_LIGHT_LAUNCHES=0 turned off".to_string(),
            ));
        }
        let partition = launches[0].partition;
        for (i, l) in launches.iter().enumerate() {
            if l.stop_word != stop_word || l.preemptible != stop_word.is_some() {
                return Err(GpuError::Invalid(format!(
                    "launch {i} of a run: its launches are preemptible exactly when they all carry the same stop word"
                )));
            }
            if l.report_ctas || l.report_start || l.report_end || l.after.is_some() {
                return Err(GpuError::Invalid(format!("launch {i} of a run is gated or reports itself")));
            }
            // One partition, all of it: the whole device, or a green context it is recorded in.
            let part = self.partitions.get(l.partition.0 as usize).map(|p| p.sms);
            if l.partition != partition || part.is_none_or(|p| l.sm_mask.intersect(&p) != p) {
                return Err(GpuError::Invalid(format!("launch {i} of a run is not on the whole of the run's partition")));
            }
            if self.host_maps.fence_flags(l.args) != 0 {
                return Err(GpuError::Invalid(format!("launch {i} of a run uses mapped host memory")));
            }
        }
        self.bind()?;
        let stream = match self.capture_stream {
            Some(s) => s,
            None => {
                let s = self.create_stream(0)?;
                self.capture_stream = Some(s);
                s
            }
        };
        let graph = self.capture_in(stream, partition, |g| {
            for (i, l) in launches.iter().enumerate() {
                let r = LaunchRequest { stream, ..*l };
                g.recording_pos = i as u32 + 1;
                let launched = if plain { g.launch_variant(&r, Variant::Plain) } else { g.launch(&r) };
                g.recording_pos = 0;
                launched?;
            }
            Ok(())
        });
        // Nothing ran: the capture stream's books start over (its silent launches were recorded,
        // not queued).
        if let Some(st) = self.streams.get_mut(stream.0 as usize) {
            st.silent.clear();
            st.last_launch = None;
            st.last_seq = 0;
            st.last_may_stop = false;
        }
        let graph = graph?;
        let id = self.next_run;
        self.next_run += 1;
        self.runs.insert(
            id,
            RecordedRun {
                graph,
                blocks: launches.iter().map(|l| l.shape.logical_blocks).collect(),
                stop_word: stop_word.map(|w| w.0),
                partition: partition.0,
            },
        );
        Ok(RunId(id))
    }

    fn launch_run(&mut self, run: RunId, stream: StreamId, ids: &mut Vec<LaunchId>) -> Result<()> {
        self.bind()?;
        let Some(r) = self.runs.get(&run.0) else { return Err(GpuError::Invalid(format!("unknown run {}", run.0))) };
        let (exec, count, stop_word, partition) = (r.graph.raw_exec(), r.blocks.len() as u32, r.stop_word, r.partition);
        if let Some(w) = stop_word {
            self.clear_stop_word_before(w, stream)?;
        }
        // The stream's CUDA stream of the run's partition (ordered behind its work in other
        // partitions, as for a launch).
        let raw = self.stream_for(stream, partition)?.raw();
        let first = LaunchId(self.next_launch);
        let posted = match self.launcher_of(stream) {
            Some((l, lane)) => {
                // Through the stream's launcher, behind the launches posted there before it.
                l.post(lane, Job::graph(exec, raw, first, count));
                Ok(())
            }
            // SAFETY: `exec` belongs to a run in self.runs and `raw` to a live stream of self; the
            // run's kernels' modules live as long as self, and the buffers it names stay allocated
            // while it exists (record_run's contract).
            None => unsafe { driver::graph_launch(exec, raw) }.map_err(drv),
        };
        if let Err(e) = posted {
            let mut ev = Vec::new();
            self.close_silent(stream, &mut ev);
            self.host_events.extend(ev);
            return Err(e);
        }
        self.next_launch += count as u64;
        let seq = self.protocol.next_seq();
        let r = &self.runs[&run.0];
        let st = &mut self.streams[stream.0 as usize];
        for (k, &blocks) in r.blocks.iter().enumerate() {
            self.issue_order += 1;
            let id = LaunchId(first.0 + k as u64);
            let stop = stop_word.map_or(NO_STOP, |w| (w, k as u32 + 1));
            st.silent.push_back((self.issue_order, id, blocks, stop));
            ids.push(id);
        }
        st.last_launch = ids.last().copied();
        st.last_seq = seq;
        st.last_may_stop = false;
        Ok(())
    }

    fn drop_run(&mut self, run: RunId) -> Result<()> {
        // A replay still waiting in a launcher's queue names the instance: hand those over first.
        self.flush_launches();
        self.bind()?;
        match self.runs.remove(&run.0) {
            Some(_) => Ok(()),
            None => Err(GpuError::Invalid(format!("unknown run {}", run.0))),
        }
    }

    fn sm_groups(&self) -> Vec<SmMask> {
        self.groups.iter().map(|g| g.1).collect()
    }

    /// A green context over the union of the groups' resources: its SMs probed like the default
    /// groups' (a few hundred µs, once per union); a union the driver refuses is refused again
    /// at once.
    fn partition_of_groups(&mut self, groups: u64) -> Result<PartitionId> {
        if let Some(r) = self.partition_by_groups.get(&groups) {
            return r.clone().map_err(GpuError::Invalid);
        }
        if let Some(note) = &self.green_note {
            return Err(GpuError::Unsupported(format!("no hardware partitions on this device: {note}")));
        }
        self.bind()?;
        match self.make_partition_of_groups(groups) {
            Ok(id) => {
                self.partition_by_groups.insert(groups, Ok(id));
                Ok(id)
            }
            // Out of partitions: not remembered (the caller falls back; nothing changes later either).
            Err(e @ GpuError::Exhausted { .. }) => Err(e),
            Err(e) => {
                let why = format!("no partition of SM groups {groups:#x}: {e}");
                self.partition_by_groups.insert(groups, Err(why.clone()));
                Err(GpuError::Invalid(why))
            }
        }
    }

    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        // A launch that carries a stop word (a reporter in flight, or a run's silent launch):
        // the word stops them all.
        let word = match self.slot_of.get(&launch) {
            Some(&slot) => self.in_flight[slot as usize].as_ref().and_then(|f| f.stop_word),
            None => self.streams.iter().flat_map(|st| st.silent.iter()).find(|x| x.1 == launch).map(|x| x.3.0),
        };
        if let Some(w) = word.filter(|&w| w != NO_STOP.0) {
            return self.raise_stop_word(w);
        }
        if let Some(&slot) = self.slot_of.get(&launch)
            && let Raise::WriteDevice { addr, value } = self.protocol.set_preempt(slot)
        {
            self.pending_preempts.push((addr, value));
            if self.pending_preempts.len() >= PENDING_PREEMPTS_MAX {
                self.flush_preempts()?;
            }
        }
        Ok(())
    }

    fn create_stop_word(&mut self) -> Result<StopWordId> {
        self.bind()?;
        if self.run_stop_words.is_none() {
            let words = DeviceBuffer::new(STOP_WORDS_MAX as u64 * source::STOP_WORD_BYTES).map_err(drv)?;
            words.fill(0).map_err(drv)?;
            self.run_stop_words = Some(words);
        }
        let free = self.stop_word_states.iter().position(|w| w.is_none());
        let i = match free {
            Some(i) => i,
            None if self.stop_word_states.len() < STOP_WORDS_MAX => {
                self.stop_word_states.push(None);
                self.stop_word_states.len() - 1
            }
            None => return Err(GpuError::Exhausted { limit: "stop words", max: STOP_WORDS_MAX as u64 }),
        };
        // A word used before may still be raised: its first launch clears it.
        self.stop_word_states[i] = Some(StopWordState { raised: false, needs_clear: true });
        Ok(StopWordId(i as u32))
    }

    fn destroy_stop_word(&mut self, word: StopWordId) -> Result<()> {
        self.check_stop_word(word)?;
        self.stop_word_states[word.0 as usize] = None;
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        self.bind()?;
        if self.upgrades.ready.load(std::sync::atomic::Ordering::Relaxed) {
            self.apply_upgrades()?;
        }
        events.extend(self.host_events.drain(..));
        self.poll_device(events)
    }

    fn wait(&mut self, until_ns: u64) -> Result<()> {
        self.bind()?;
        if !self.host_events.is_empty() {
            return Ok(());
        }
        self.wait_device(until_ns)
    }

    fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping> {
        self.bind()?;
        self.host_maps.map(memory)
    }

    fn unmap_host(&mut self, id: HostMappingId) -> Result<()> {
        self.bind()?;
        let slot_of = &self.slot_of;
        self.host_maps.unmap(id, |l| slot_of.contains_key(&l))
    }

    /// Resets the primary context (`cuDevicePrimaryCtxReset`: every allocation, stream, module and
    /// kernel of it is gone, a hung kernel included) and opens the device again in place. After a
    /// sticky error (an illegal address: measured on an H100, driver 580) the device keeps failing
    /// (`cuDevicePrimaryCtxRetain` returns the same error), as CUDA documents: such an error lasts
    /// for the life of the process; the reset then fails with that explanation. Otherwise the
    /// clock goes on, launch and copy ids are not handed out again, kernels are loaded again from
    /// the CUBIN cache on first use. The old state is forgotten, never freed: its handles died
    /// with the context and their values may already name new objects. Host mappings are
    /// forgotten with it (their registrations stay counted, so a region mapped before the reset
    /// stays page-locked until the process exits).
    fn reset(&mut self) -> Result<()> {
        // The launcher threads hand over what was posted and stop; they use the old context.
        let threads = self.launch_threads();
        self.launchers = None;
        self.ctx.bind().map_err(drv)?;
        self.bound.set(Some(std::thread::current().id()));
        // The streams (some in green contexts) and the green contexts go first, the normal way
        // (destroying them does not wait for their work): with them alive, the reset was refused
        // (CUDA_ERROR_NOT_PERMITTED, H100, driver 580).
        self.utility_stream = None;
        self.streams.clear();
        self.partitions.clear();
        // Secondaries live in their own (healthy) contexts: release them the normal way, and
        // attach them again to the fresh context below.
        self.forget_copies();
        self.peers.clear();
        self.ctx.bind().map_err(drv)?;
        let peer_requests = self.peer_requests.clone();
        // SAFETY: every object of the old context is forgotten below, before anything of the new one
        // is created: `old` is never dropped, so none of its handles is used or freed again.
        unsafe { driver::primary_ctx_reset(self.dev) }.map_err(drv)?;
        let mut fresh = CudaGpu::open(self.ordinal, self.epoch, self.ring_capacity).map_err(|e| {
            GpuError::Driver(format!(
                "the device still fails after its context was reset ({e}): CUDA keeps a sticky error (an illegal \
                 address, an illegal instruction, a failed launch) for the life of the process, so this GPU serves \
                 again only after kairos restarts"
            ))
        })?;
        fresh.next_launch = self.next_launch;
        fresh.next_copy = self.next_copy;
        fresh.next_run = self.next_run;
        fresh.launch_inline = self.launch_inline;
        fresh.urgent_launches = self.urgent_launches;
        fresh.time_launches = self.time_launches;
        fresh.quick_builds = self.quick_builds;
        fresh.set_launch_threads(threads)?;
        let mut failed = Vec::new();
        for &(ordinal, staging_bytes) in &peer_requests {
            if let Err(e) = fresh.attach_peer(ordinal, staging_bytes) {
                failed.push(format!("GPU {ordinal}: {e}"));
            }
        }
        // Every secondary asked for stays asked for: a later reset tries those that failed again.
        fresh.peer_requests = peer_requests;
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old);
        // The GPU serves again either way; without its secondaries cold loads go through it alone.
        self.peer_note =
            (!failed.is_empty()).then(|| format!("secondary GPUs not attached again after a reset: {}", failed.join("; ")));
        Ok(())
    }
}

impl CudaGpu {
    /// Turns ring records into events and retires the launches that ended.
    fn apply_records(&mut self, records: &[Record], events: &mut Vec<GpuEvent>) -> Result<()> {
        self.track_clock(records);
        for r in records {
            let (id, first_placed, stream, internal) = match self.in_flight.get_mut(r.slot as usize) {
                Some(Some(f)) => {
                    if r.kind == source::REC_PLACED && f.first_placed_ns.is_none() {
                        f.first_placed_ns = Some(r.device_ns);
                    }
                    (f.id, f.first_placed_ns, f.queue.0, f.internal)
                }
                _ => return Err(GpuError::Driver(format!("notification for launch slot {} with no launch in flight", r.slot))),
            };
            let at_ns = self.device_to_host_ns(r.device_ns);
            self.records_read += 1;
            let ev = match r.kind {
                // aux 1: the launch's start record (KAIROS_FLAG_START_RECORD), not a CTA group.
                source::REC_PLACED if r.aux == 1 => GpuEvent::LaunchStarted { launch: id, at_ns },
                source::REC_PLACED => GpuEvent::CtasPlaced { launch: id, sm: r.sm, ctas: r.ctas, at_ns },
                source::REC_FINISHED => GpuEvent::CtasFinished { launch: id, sm: r.sm, ctas: r.ctas, blocks: r.blocks, at_ns },
                source::REC_DONE => {
                    let mut started_next = None;
                    if let Some(st) = self.streams.get_mut(stream.0 as usize)
                        && let Some(i) = st.reporting.iter().position(|x| x.1 == id)
                    {
                        // Stream order: the silent launches queued before this one have ended too.
                        let (order, ..) = st.reporting[i];
                        // A reporter of a run with a stop word names in `ctas` where the run stopped
                        // (position + 1; 0: it ran whole): from there its launches ran no block, or
                        // part of them, and run again whole (protocol.cuh point 8).
                        let skipped = r.ctas;
                        while let Some(&(_, silent, blocks, (_, pos))) = st.silent.front().filter(|x| x.0 < order) {
                            st.silent.pop_front();
                            let stopped = skipped != 0 && pos >= skipped;
                            let (next_block, preempted) = if stopped { (0, true) } else { (blocks, false) };
                            events.push(GpuEvent::LaunchDone { launch: silent, next_block, preempted, at_ns });
                        }
                        // The launch behind it starts now, if its start is implied by this end (not
                        // before it was issued: the end may have come first, unread).
                        st.reporting.remove(i);
                        if let Some(&(_, next, true, issued_ns)) = st.reporting.get(i)
                            && r.aux == 0
                        {
                            started_next = Some((next, at_ns.max(issued_ns)));
                        }
                    }
                    if self.spans.len() >= SPANS_MAX {
                        self.spans.pop_front();
                    }
                    self.spans.push_back((id, r.device_ns.saturating_sub(first_placed.unwrap_or(r.device_ns))));
                    // Stopped by its stop word, whatever raised it: the next launch that carries
                    // it clears it (a raise may land after a clear that was queued behind it).
                    if let Some(w) = self.in_flight[r.slot as usize].as_ref().and_then(|f| f.stop_word)
                        && (r.aux != 0 || r.ctas != 0)
                        && let Some(Some(state)) = self.stop_word_states.get_mut(w as usize)
                    {
                        state.needs_clear = true;
                    }
                    self.in_flight[r.slot as usize] = None;
                    self.slot_of.remove(&id);
                    self.protocol.free_slot(r.slot);
                    if !internal {
                        events.push(GpuEvent::LaunchDone { launch: id, next_block: r.blocks, preempted: r.aux != 0, at_ns });
                    }
                    if let Some((next, start_ns)) = started_next {
                        self.starts_implied += 1;
                        events.push(GpuEvent::LaunchStarted { launch: next, at_ns: start_ns });
                    }
                    continue;
                }
                k => return Err(GpuError::Driver(format!("notification of unknown kind {k}"))),
            };
            events.push(ev);
        }
        Ok(())
    }

    /// Queues a one-block launch that reports its end on `stream` when silent launches there wait
    /// for a later launch to imply theirs and none will (the one that should have failed): its
    /// end reports them, and is not reported itself. If even that cannot be queued, they are
    /// reported lost.
    fn close_silent(&mut self, stream: StreamId, events: &mut Vec<GpuEvent>) {
        if self.streams.get(stream.0 as usize).is_none_or(|st| st.silent.is_empty() || !st.alive) {
            return;
        }
        let o = LaunchOptions { ctas: 1, ..self.whole_device(stream) };
        // Silent launches of a run with a stop word: the closer reads where it stopped.
        let word = self.streams[stream.0 as usize].silent.iter().map(|x| x.3.0).find(|&w| w != NO_STOP.0);
        if let Some(w) = word
            && let Err(e) = self.clear_stop_word_before(w, stream)
        {
            eprintln!("kairos: could not clear stop word {w} on stream {}: {e}", stream.0);
        }
        self.next_launch_stop = word.map(|w| (w, 0));
        match self.launch_noop(1, 32, &o) {
            Ok(id) => {
                if let Some(f) = self.slot_of.get(&id).and_then(|&s| self.in_flight[s as usize].as_mut()) {
                    f.internal = true;
                }
            }
            Err(e) => {
                eprintln!("kairos: could not queue the launch that reports stream {}'s silent launches: {e}", stream.0);
                let now = self.now_ns();
                for (_, id, ..) in self.streams[stream.0 as usize].silent.drain(..) {
                    events.push(GpuEvent::LaunchLost { launch: id, at_ns: now });
                }
            }
        }
    }

    /// The ring overflowed (the host stopped reading for longer than the producers wait): waits
    /// until nothing runs, takes the records that arrived, and reports every launch still in
    /// flight after them as lost, freeing its slot (its last CTA reset the slot before its end
    /// record was dropped).
    fn recover_ring(&mut self, records: &mut Vec<Record>, events: &mut Vec<GpuEvent>) -> Result<()> {
        self.synchronize()?;
        let dropped = self.protocol.recover(records).map_err(drv)?;
        self.apply_records(records, events)?;
        self.ring_overflows += 1;
        let now = self.now_ns();
        let mut lost = 0;
        for slot in 0..self.in_flight.len() {
            if let Some(f) = self.in_flight[slot].take() {
                self.slot_of.remove(&f.id);
                self.protocol.free_slot(slot as u32);
                if !f.internal {
                    events.push(GpuEvent::LaunchLost { launch: f.id, at_ns: now });
                    lost += 1;
                }
            }
        }
        // The device is idle: the silent launches have run (they never stop early), but those
        // of a run with a stop word may have stopped, where the lost end record would have said.
        for st in &mut self.streams {
            st.reporting.clear();
            for (_, id, blocks, (word, _)) in st.silent.drain(..) {
                if word == NO_STOP.0 {
                    events.push(GpuEvent::LaunchDone { launch: id, next_block: blocks, preempted: false, at_ns: now });
                } else {
                    events.push(GpuEvent::LaunchLost { launch: id, at_ns: now });
                }
            }
        }
        // Where a stop word was, the next launch that carries it starts from a lowered one.
        for state in self.stop_word_states.iter_mut().flatten() {
            state.needs_clear = true;
        }
        eprintln!(
            "kairos: the notification ring overflowed (the host stopped reading for over {} ms): {dropped} records dropped, \
             {lost} launches lost (their requests fail); serving goes on",
            RING_TIMEOUT_NS / 1_000_000
        );
        Ok(())
    }

    /// The events of the notification ring and of finished copies (not the stash). After a ring
    /// overflow it waits for the device to go idle, recovers the ring, and reports the launches
    /// whose end was dropped as [`GpuEvent::LaunchLost`] (the rest keep working).
    fn poll_device(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        self.flush_preempts()?;
        if let Some(l) = &self.launchers {
            let mut failed: Vec<Failure> = Vec::new();
            l.take_failures(&mut failed);
            let any_failed = !failed.is_empty();
            let mut to_close = Vec::new();
            for f in failed {
                if f.launch.0 == 0 {
                    // A stream write (clearing a stop word): what follows it would stop for nothing.
                    return Err(GpuError::Driver(format!("a stream write to a stop word failed in the driver: {}", f.error)));
                }
                // The driver refused it: nothing ran, the slot is still zero.
                eprintln!("kairos: launch {} failed in the driver: {}; its request fails", f.launch.0, f.error);
                let mut internal = false;
                if let Some(slot) = self.slot_of.remove(&f.launch) {
                    if let Some(x) = self.in_flight[slot as usize].take() {
                        internal = x.internal;
                        to_close.push(x.queue.0);
                    }
                    self.protocol.free_slot(slot);
                }
                // A refused replay of a run: all of its launches (consecutive ids) are lost.
                let ids = f.launch.0..f.launch.0 + f.run_launches.max(1) as u64;
                for st in &mut self.streams {
                    st.silent.retain(|x| !ids.contains(&x.1.0));
                    st.reporting.retain(|x| x.1 != f.launch);
                }
                if !internal {
                    for id in ids {
                        events.push(GpuEvent::LaunchLost { launch: LaunchId(id), at_ns: self.now_ns() });
                    }
                }
            }
            // Silent launches that waited for a refused launch to report them get another.
            for s in to_close {
                self.close_silent(s, events);
            }
            if any_failed {
                // A launch refused because the context faulted (a sticky error) is not the
                // launch's own failure: the helper stream says so at once.
                self.helper_stream.is_idle().map_err(drv)?;
            }
        }
        let mut records = std::mem::take(&mut self.records);
        records.clear();
        let polled = self.protocol.poll(&mut records);
        let applied = self.apply_records(&records, events);
        if applied.is_ok() && polled == Err(RingError::Overflow) {
            records.clear();
            let recovered = self.recover_ring(&mut records, events);
            self.records = records;
            recovered?;
        } else {
            self.records = records;
        }
        applied?;
        while let Some((_, e)) = self.copies.front() {
            if !e.is_done().map_err(drv)? {
                break;
            }
            let (id, e) = self.copies.pop_front().unwrap();
            self.spare_events.push(e);
            crate::peer::link_done(self.ordinal);
            events.push(GpuEvent::CopyDone { copy: id, at_ns: self.now_ns() });
        }
        for k in 0..self.peers.len() {
            while let Some((_, e)) = self.peers[k].copies.front() {
                if !e.is_done().map_err(drv)? {
                    break;
                }
                let (id, e) = self.peers[k].copies.pop_front().expect("front checked");
                self.peers[k].recycle(e);
                crate::peer::link_done(self.peers[k].ordinal);
                events.push(GpuEvent::CopyDone { copy: id, at_ns: self.now_ns() });
            }
        }
        Ok(())
    }
}

/// A request's kernel parameter block, packed from its argument addresses (held as words on the
/// stack for every kernel of the library: the launch path allocates nothing).
fn pack_request_args(request: &LaunchRequest<'_>) -> Result<ParamBlock> {
    let mut words = [0u64; 32];
    let spilled: Vec<u64>;
    let args: &[u64] = if request.args.len() <= words.len() {
        for (w, p) in words.iter_mut().zip(request.args) {
            *w = p.0;
        }
        &words[..request.args.len()]
    } else {
        spilled = request.args.iter().map(|p| p.0).collect();
        &spilled
    };
    source::pack_args(request.kernel, args).map_err(GpuError::from)
}

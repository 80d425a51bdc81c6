//! kairos-gpu: the `Gpu` trait, the one interface between the dispatcher and a GPU.
//!
//! It is small, synchronous and made of plain data: no CUDA, tokio or simulator types cross it.
//! Two implementations exist: `kairos-cuda` (a real NVIDIA GPU through the driver API) and
//! `kairos-sim` (a discrete-event GPU in virtual time). The dispatcher (`kairos-sched`) is generic
//! over it, and so is [`exec::execute_plan`], the simple plan runner used by `kairos run` and tests.
//! [`synthetic`] builds plans of chosen kernels and their profiles, for scheduling tests and experiments.
//!
//! # The kernel protocol, as seen from here
//! A launch has N logical blocks (see `kairos_core::plan`). Physical CTAs take logical blocks from a
//! counter until none are left or the launch's preempt flag is set; a stopped launch reports the
//! first block never taken, and a new launch with that `first_block` resumes it exactly. CTAs outside
//! the launch's SM mask exit at once. CTAs report placement and completion per SM, which the
//! dispatcher uses to account occupancy.

// Unsafe code only where an item says why (allow(unsafe_code) beside its SAFETY contract).
#![deny(unsafe_code)]

pub mod exec;
pub mod idmap;
pub mod profile;
pub mod synthetic;
pub mod topology;

use kairos_core::DType;
use kairos_core::plan::{Kernel, Launch, LaunchShape};
use serde::{Deserialize, Serialize};

/// The most SMs a mask can name.
pub const SM_COUNT_MAX: usize = 256;

/// A set of SM ids.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SmMask(pub [u64; SM_COUNT_MAX / 64]);

impl SmMask {
    pub const EMPTY: SmMask = SmMask([0; SM_COUNT_MAX / 64]);

    /// SMs [0, count).
    pub fn first(count: u32) -> SmMask {
        Self::range(0, count)
    }

    /// SMs [start, start + count).
    pub fn range(start: u32, count: u32) -> SmMask {
        assert!((start + count) as usize <= SM_COUNT_MAX, "SM range {start}+{count} exceeds {SM_COUNT_MAX}");
        let mut m = SmMask::EMPTY;
        for sm in start..start + count {
            m.insert(sm);
        }
        m
    }

    pub fn insert(&mut self, sm: u32) {
        self.0[sm as usize / 64] |= 1 << (sm % 64);
    }

    pub fn remove(&mut self, sm: u32) {
        self.0[sm as usize / 64] &= !(1 << (sm % 64));
    }

    pub fn contains(&self, sm: u32) -> bool {
        (sm as usize) < SM_COUNT_MAX && self.0[sm as usize / 64] & (1 << (sm % 64)) != 0
    }

    pub fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..SM_COUNT_MAX as u32).filter(|&s| self.contains(s))
    }

    pub fn intersect(&self, other: &SmMask) -> SmMask {
        let mut m = *self;
        for (a, b) in m.0.iter_mut().zip(other.0.iter()) {
            *a &= *b;
        }
        m
    }

    pub fn union(&self, other: &SmMask) -> SmMask {
        let mut m = *self;
        for (a, b) in m.0.iter_mut().zip(other.0.iter()) {
            *a |= *b;
        }
        m
    }

    /// The SMs of `self` not in `other`.
    pub fn minus(&self, other: &SmMask) -> SmMask {
        let mut m = *self;
        for (a, b) in m.0.iter_mut().zip(other.0.iter()) {
            *a &= !*b;
        }
        m
    }
}

impl std::fmt::Debug for SmMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Ranges read better than 256 bits: {0-7,16-23}.
        let mut parts = Vec::new();
        let mut it = self.iter().peekable();
        while let Some(start) = it.next() {
            let mut end = start;
            while it.peek() == Some(&(end + 1)) {
                end = it.next().unwrap();
            }
            parts.push(if start == end { format!("{start}") } else { format!("{start}-{end}") });
        }
        write!(f, "SmMask{{{}}}", parts.join(","))
    }
}

/// Per-SM hardware limits that bound how many CTAs fit on one SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmLimits {
    pub threads_max: u32,
    pub registers_max: u32,
    pub shared_mem_bytes_max: u32,
    pub ctas_max: u32,
}

/// A hardware SM partition (a green context on CUDA). Partition 0 is always the whole device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub id: PartitionId,
    pub sms: SmMask,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PartitionId(pub u32);

impl PartitionId {
    pub const WHOLE: PartitionId = PartitionId(0);
}

/// Bytes one piece of a copy through a secondary GPU carries (host to the secondary's staging
/// memory, then forwarded): a copy is cut into pieces so that the forward of one overlaps the
/// host copy of the next (DeepPlan's parallel-pipeline).
pub const PEER_PIECE_BYTES: u64 = 4 << 20;

/// A secondary GPU this GPU can copy weights through (DeepPlan's parallel transmission): host to
/// the secondary over the secondary's own PCIe link, then forwarded to this GPU (NVLink).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerPath {
    /// The secondary's CUDA ordinal.
    pub gpu: u32,
    /// Host to the secondary's staging memory, as measured when it was attached.
    pub h2d_bytes_per_s: f64,
    /// Secondary to this GPU, as measured when it was attached.
    pub forward_bytes_per_s: f64,
    /// Staging memory reserved on the secondary for this GPU's copies.
    pub staging_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub name: String,
    /// e.g. "sm_90".
    pub arch: String,
    pub sm_count: u32,
    pub sm_limits: SmLimits,
    pub memory_bytes: u64,
    /// Hardware partitions available to launches; [0] is the whole device.
    pub partitions: Vec<Partition>,
    /// Smallest hardware partition, in SMs (8 on H100/H200).
    pub partition_granularity_sms: u32,
    /// Hardware work queues served in FIFO order at their heads.
    pub hardware_queues: u32,
    pub h2d_bytes_per_s: f64,
    pub d2h_bytes_per_s: f64,
    pub device_mem_bytes_per_s: f64,
    /// Rate at which kernels read mapped pinned host memory (direct host access).
    pub host_mapped_read_bytes_per_s: f64,
    /// Launches the backend tracks at once (issued and not yet reported done); 0: no limit of its
    /// own. The dispatcher keeps below it, so running out is back-pressure, not a failed request.
    #[serde(default)]
    pub launches_in_flight_max: u32,
}

/// An address in the device's address space (on the simulator, a synthetic one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemKind {
    /// Device memory.
    Device,
    /// Pinned host memory mapped into the device's address space: kernels read it over PCIe
    /// (DeepPlan's direct host access), and copies from it run at full PCIe bandwidth.
    HostMapped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Allocation {
    pub ptr: DevicePtr,
    pub bytes: u64,
    pub kind: MemKind,
}

/// What the hardware needs per CTA of a kernel, and what it allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelResources {
    pub threads_per_cta: u32,
    pub registers_per_thread: u32,
    /// Static plus dynamic shared memory per CTA.
    pub shared_mem_bytes: u32,
    /// CTAs of this kernel that fit on one idle SM.
    pub ctas_per_sm_max: u32,
}

impl KernelResources {
    /// CTAs that fit on one SM given its limits (the occupancy calculation).
    pub fn occupancy(threads_per_cta: u32, registers_per_thread: u32, shared_mem_bytes: u32, limits: &SmLimits) -> u32 {
        let by_threads = limits.threads_max / threads_per_cta.max(1);
        let regs_per_cta = (registers_per_thread.max(1) * threads_per_cta).next_multiple_of(256);
        let by_regs = limits.registers_max / regs_per_cta.max(1);
        let by_smem = limits.shared_mem_bytes_max.checked_div(shared_mem_bytes).unwrap_or(u32::MAX);
        by_threads.min(by_regs).min(by_smem).min(limits.ctas_max)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StreamId(pub u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LaunchId(pub u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CopyId(pub u64);

/// A recorded run of launches ([`Gpu::record_run`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunId(pub u64);

/// Launches one recorded run may hold at most.
pub const RUN_LAUNCHES_MAX: usize = 4096;

/// A stop word ([`Gpu::create_stop_word`]): what stops a recorded run between its kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StopWordId(pub u32);

/// Launches a recorded run with a stop word may hold at most (the CUDA backend reports where a
/// stopped run stopped in 11 bits of a record).
pub const STOP_RUN_LAUNCHES_MAX: usize = 2047;

/// Hardware partitions one GPU makes at most (the whole device and the default groups included).
pub const PARTITIONS_MAX: usize = 512;

/// Stop words one GPU hands out at most.
pub const STOP_WORDS_MAX: usize = 4096;

/// A kernel launch as the dispatcher issues it.
#[derive(Clone, Copy, Debug)]
pub struct LaunchRequest<'a> {
    pub kernel: &'a Kernel,
    pub dtype: DType,
    pub shape: LaunchShape,
    /// Device addresses of the kernel's arguments, in the kernel's argument order.
    pub args: &'a [DevicePtr],
    /// First logical block to run: 0 for a fresh launch, the reported resume point after a preemption.
    pub first_block: u32,
    /// Physical CTAs to start (persistent CTAs loop over logical blocks); 0 lets the backend pick
    /// enough to fill the allowed SMs.
    pub ctas: u32,
    /// Software SM mask: CTAs placed elsewhere exit at once.
    pub sm_mask: SmMask,
    /// Hardware partition to launch into.
    pub partition: PartitionId,
    pub stream: StreamId,
    /// The launch before this one on `stream` whose results this one reads (it must be the last
    /// launch issued there): if it stops early, this one stops before running any block and
    /// reports `preempted` at `first_block` (the protocol's stream gate). None: no such launch.
    pub after: Option<LaunchId>,
    /// Report the launch's CTAs as they arrive on and leave the SMs ([`GpuEvent::CtasPlaced`],
    /// [`GpuEvent::CtasFinished`]). False: only [`GpuEvent::LaunchDone`] (for launches whose
    /// CTAs no one tracks, e.g. a whole job handed to one stream: a launch spread over the GPU
    /// sends up to two records per SM for the host to read).
    pub report_ctas: bool,
    /// Report when the launch's first logical block is taken ([`GpuEvent::LaunchStarted`]): one
    /// record per launch, whatever its size. Kernel-by-kernel dispatch learns from it when a launch
    /// left its stream's queue and how long it ran, without a record per SM.
    pub report_start: bool,
    /// The caller may preempt it ([`Gpu::preempt`]). False lets a backend run it without the
    /// machinery that mid-kernel preemption needs (on CUDA: a light launch, one CTA per block,
    /// stoppable only whole at its stream gate); `preempt` may then have no effect, and the
    /// launch ends whole.
    pub preemptible: bool,
    /// Report this launch's end. False (with `report_ctas` and `report_start` false): the backend
    /// may report it only when a later launch on the same stream that does report its end ends
    /// (stream order implies it), at that launch's time; the caller must issue such a launch
    /// (a backend whose later launch fails to queue reports the silent ones itself). Only for
    /// launches whose own end time the caller does not need.
    pub report_end: bool,
    /// A stop word ([`Gpu::create_stop_word`]) this launch obeys, or None. Raising it
    /// ([`Gpu::preempt`] of any launch that carries it) stops every launch that carries it: a
    /// preemptible launch as if preempted (it may report `next_block` 0 although blocks ran, see
    /// below), and the launches of a run recorded with it (`preemptible` true, silent, see
    /// [`Gpu::record_run`]) between their kernels: a kernel that starts after the word is raised
    /// runs no block, and the one running when it lands may stop part-way. Every stopped launch
    /// reports [`GpuEvent::LaunchDone`] with `preempted` and the block to resume from, which for a
    /// run's launch is 0 (it runs again whole): exact only for kernels that never read memory
    /// they write, which the caller checks (a plan's launches write only their last argument).
    /// The word stays raised until the backend clears it, in stream order, before it queues the
    /// next launch or replay that carries it: the caller issues that only after everything the
    /// word stopped has reported its end. A run's silent launches report with the next launch on
    /// their stream that reports its end, which must carry the same word.
    pub stop_word: Option<StopWordId>,
}

impl<'a> LaunchRequest<'a> {
    /// A plan launch from its first logical block, with the backend's choice of CTAs.
    pub fn of_launch(
        launch: &'a Launch,
        args: &'a [DevicePtr],
        sm_mask: SmMask,
        partition: PartitionId,
        stream: StreamId,
    ) -> LaunchRequest<'a> {
        LaunchRequest {
            kernel: &launch.kernel,
            dtype: launch.dtype,
            shape: launch.shape,
            args,
            first_block: 0,
            ctas: 0,
            sm_mask,
            partition,
            stream,
            after: None,
            report_ctas: true,
            report_start: false,
            preemptible: true,
            report_end: true,
            stop_word: None,
        }
    }
}

/// What a GPU reports. Times are the backend's clock ([`Gpu::now_ns`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuEvent {
    /// The launch's first logical block was taken (asked for with `LaunchRequest::report_start`):
    /// it left its stream's queue and runs. At most once per launch, before its `LaunchDone`; a
    /// launch stopped before any block (stream gate, preempted while queued) sends none.
    LaunchStarted {
        launch: LaunchId,
        at_ns: u64,
    },
    /// `ctas` CTAs of a launch started on SM `sm`.
    CtasPlaced {
        launch: LaunchId,
        sm: u32,
        ctas: u32,
        at_ns: u64,
    },
    /// `ctas` CTAs of a launch left SM `sm` after running `blocks` logical blocks between them.
    CtasFinished {
        launch: LaunchId,
        sm: u32,
        ctas: u32,
        blocks: u32,
        at_ns: u64,
    },
    /// The launch ended. `next_block` is the first logical block never taken: the launch's
    /// `logical_blocks` when it completed, less when the preempt flag stopped it.
    LaunchDone {
        launch: LaunchId,
        next_block: u32,
        preempted: bool,
        at_ns: u64,
    },
    CopyDone {
        copy: CopyId,
        at_ns: u64,
    },
    /// The backend lost the launch's notifications (its notification ring overflowed while the
    /// host was not reading) and recovered: the launch has ended, but whether and where it
    /// stopped is unknown, so its results cannot be used. Sent once, instead of `LaunchDone`; the
    /// backend is idle for the launches it reports lost and keeps serving.
    LaunchLost {
        launch: LaunchId,
        at_ns: u64,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU: {0}")]
    NoDevice(String),
    #[error("out of GPU memory: asked for {requested_bytes} bytes, {free_bytes} free")]
    OutOfMemory { requested_bytes: u64, free_bytes: u64 },
    #[error("kernel {kernel} failed to compile: {log}")]
    Compile { kernel: String, log: String },
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A launch that does not suit its kernel's GPU code (the plan's fault).
    #[error("invalid launch: {0}")]
    Launch(#[from] kairos_core::plan::LaunchError),
    #[error("{limit} exhausted (limit {max})")]
    Exhausted { limit: &'static str, max: u64 },
    #[error("driver error: {0}")]
    Driver(String),
    /// The backend cannot do this at all (e.g. map caller memory); callers fall back or give up.
    #[error("unsupported by this GPU backend: {0}")]
    Unsupported(String),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// Host memory that a caller lends to a GPU so kernels read and write it in place (zero-copy
/// I/O, e.g. the shared-memory channel's region): see [`Gpu::map_host`].
///
/// The owner implements the byte accessors; a backend that emulates the mapping (the simulator)
/// moves bytes through them, and one that maps the pages into the device (CUDA) asks for their
/// address range through [`HostMemory::pinnable`]. Accesses from the device and from other
/// threads or processes may race with these copies; they see some mix of old and new bytes, never
/// undefined behaviour, which is why they copy instead of handing out references.
pub trait HostMemory: Send + Sync + std::fmt::Debug {
    /// Its size in bytes.
    fn len_bytes(&self) -> u64;
    /// Copies `out.len()` bytes from `offset`. Callers keep `offset + out.len() <= len_bytes()`
    /// (an implementation may panic otherwise).
    fn read_at(&self, offset: u64, out: &mut [u8]);
    /// Copies `data` to `offset`, under the same bounds as [`HostMemory::read_at`].
    fn write_at(&self, offset: u64, data: &[u8]);
    /// The memory's address range in this process, for backends that map the pages themselves.
    /// `None` (the default): only emulating backends can map it.
    fn pinnable(&self) -> Option<HostRange<'_>> {
        None
    }
}

/// An address range of this process that stays valid while `'a` lasts: what
/// [`HostMemory::pinnable`] returns, borrowed from the memory's owner so that it cannot outlive it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRange<'a> {
    addr: usize,
    len: usize,
    _owner: std::marker::PhantomData<&'a ()>,
}

impl<'a> HostRange<'a> {
    /// # Safety
    /// 1. `[addr, addr + len)` is memory of this process, readable and writable, that stays
    ///    allocated and mapped at this address (not unmapped, remapped, shrunk or moved) for as
    ///    long as the value it is borrowed from for `'a` lives (the [`HostMemory`] whose `pinnable`
    ///    returns it, which a backend keeps alive while mapped), so a device may read and write it
    ///    directly during all that time.
    /// 2. Nothing in this process holds a Rust reference (`&[u8]`, `&mut [u8]`) into the range
    ///    while a device may write it: the owner accesses it through raw pointers only.
    #[allow(unsafe_code)] // a contract for the caller; the body itself does nothing unsafe
    pub unsafe fn new(addr: usize, len: usize) -> HostRange<'a> {
        HostRange { addr, len, _owner: std::marker::PhantomData }
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A mapping of host memory into a GPU's address space, named by the GPU that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostMappingId(pub u64);

/// What [`Gpu::map_host`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMapping {
    pub id: HostMappingId,
    /// The device address of the memory's first byte; byte `i` is at `ptr + i`.
    pub ptr: DevicePtr,
    pub bytes: u64,
    /// Kernel arguments placed in the mapping must start at a multiple of this (the alignment of
    /// the backend's own allocations, which its kernels may assume).
    pub align_bytes: u64,
}

/// A GPU as the dispatcher sees it.
pub trait Gpu {
    fn info(&self) -> &DeviceInfo;

    /// The backend's clock: monotonic nanoseconds (virtual time on the simulator).
    fn now_ns(&self) -> u64;

    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation>;
    fn free(&mut self, allocation: Allocation) -> Result<()>;

    /// Synchronous copy from the host into an allocation (setup, inputs).
    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<()>;
    /// Synchronous copy out of an allocation (outputs, checks).
    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<()>;

    /// Asynchronous copy between two allocations on a copy engine (host-mapped to device is
    /// how cold starts move layers); completion is reported as [`GpuEvent::CopyDone`].
    fn copy_async(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<CopyId>;

    /// Makes everything queued on `stream` after this call wait until copy `copy` (from
    /// [`Gpu::copy_async`], on another stream) has completed, without the host waiting: a cold
    /// load's kernels go out at once and each runs as soon as its layer's copy lands (DeepPlan's
    /// `cudaStreamWaitEvent` per layer). A copy that already completed is no wait; an id never
    /// handed out is an error. Backends without it return [`GpuError::Unsupported`] (the default).
    fn wait_copy(&mut self, stream: StreamId, copy: CopyId) -> Result<()> {
        let _ = stream;
        Err(GpuError::Unsupported(format!("this backend cannot make a stream wait for copy {}", copy.0)))
    }

    /// The secondary GPUs attached for parallel transmission (see [`Gpu::copy_via_peer`]), in
    /// the order their index names them. Backends without them have none (the default).
    fn peer_paths(&self) -> Vec<PeerPath> {
        Vec::new()
    }

    /// Asynchronous copy from pinned host memory (`src`, `MemKind::HostMapped`) into device
    /// memory of this GPU (`dst`) through secondary `peer` (an index into [`Gpu::peer_paths`]):
    /// the secondary copies it over its own PCIe link into its staging memory in pieces of
    /// [`PEER_PIECE_BYTES`] and forwards each piece to this GPU as soon as it has arrived. It
    /// completes like [`Gpu::copy_async`] ([`GpuEvent::CopyDone`], [`Gpu::wait_copy`]); copies
    /// through one secondary run in the order they were queued, beside this GPU's own copies.
    /// Backends without secondaries return [`GpuError::Unsupported`] (the default).
    fn copy_via_peer(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, peer: usize) -> Result<CopyId> {
        let _ = (dst, src, bytes);
        Err(GpuError::Unsupported(format!("this backend has no secondary GPU {peer} to copy through")))
    }

    /// Whether secondary `peer`'s PCIe link is carrying weight copies now (its own GPU's loads, or
    /// other GPUs' copies through it): a load that starts then copies through this GPU alone
    /// instead (parallel transmission helps only over an idle link). Default: never busy.
    fn peer_busy(&self, peer: usize) -> bool {
        let _ = peer;
        false
    }

    /// Streams: FIFO queues of launches and copies. `priority` 0 is normal, higher is more urgent.
    /// Backends bound the number of live streams; running out is [`GpuError::Exhausted`].
    fn create_stream(&mut self, priority: i32) -> Result<StreamId>;

    /// Releases a stream; work already queued on it still completes and reports its events.
    /// The id is never handed out again. Using or destroying a destroyed stream is an error.
    fn destroy_stream(&mut self, stream: StreamId) -> Result<()>;

    /// Makes ready every kernel a plan launches before its launches are looked at one by one (the
    /// CUDA backend compiles the kernel units they need in parallel, with progress); kernels not
    /// prepared are still compiled on first use. Nothing to do by default.
    fn prepare_plan(&mut self, plan: &kairos_core::plan::Plan) -> Result<()> {
        let _ = plan;
        Ok(())
    }

    /// Resources of a kernel at a launch shape, compiling and loading it on first use.
    fn kernel_resources(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> Result<KernelResources>;

    fn launch(&mut self, request: &LaunchRequest<'_>) -> Result<LaunchId>;

    /// The device's SM groups: the units its hardware partitions are made of (on CUDA the green
    /// contexts' split of the device into groups of the minimum partition size, then the SMs left
    /// over), as SM sets, in the order [`Gpu::partition_of_groups`] numbers them. Empty (the
    /// default): no hardware partitions.
    fn sm_groups(&self) -> Vec<SmMask> {
        Vec::new()
    }

    /// A hardware partition of exactly the union of SM groups `groups` (bit g: the g-th of
    /// [`Gpu::sm_groups`]; nonzero), made on the first request for that union and kept for the
    /// life of the device (at most [`PARTITIONS_MAX`] partitions in all: more is
    /// [`GpuError::Exhausted`]). A launch on it with a mask that covers it runs on those SMs and
    /// nowhere else. Backends without partitions return [`GpuError::Unsupported`] (the default).
    fn partition_of_groups(&mut self, groups: u64) -> Result<PartitionId> {
        Err(GpuError::Unsupported(format!("this backend has no hardware partitions (asked for groups {groups:#x})")))
    }

    /// Sets the launch's preempt flag: its CTAs take no further logical blocks, and its
    /// [`GpuEvent::LaunchDone`] reports where to resume. Preempting a finished launch is a no-op.
    fn preempt(&mut self, launch: LaunchId) -> Result<()>;

    /// Appends the events that happened so far; never blocks.
    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()>;

    /// Waits until an event is available or the clock reaches `until_ns`, whichever is first.
    /// On the simulator this advances virtual time.
    fn wait(&mut self, until_ns: u64) -> Result<()>;

    /// Maps caller-owned host memory into the device's address space, so kernels read and write
    /// it in place (zero-copy inputs and outputs). The backend keeps `memory` alive until
    /// [`Gpu::unmap_host`]. Launches whose arguments lie in the mapping see the memory as it is
    /// while they run, and their writes are visible to the host when their `LaunchDone` is
    /// reported. [`Gpu::write`], [`Gpu::read`] and [`Gpu::copy_async`] do not take mapped
    /// addresses: the host reads and writes its own memory. Backends that cannot map host memory
    /// return [`GpuError::Unsupported`] (the default).
    fn map_host(&mut self, memory: std::sync::Arc<dyn HostMemory>) -> Result<HostMapping> {
        let _ = memory;
        Err(GpuError::Unsupported("this backend cannot map host memory".into()))
    }

    /// Re-creates the device after a fault it cannot run on from (a sticky error, a launch that
    /// never ends): everything on it is gone — allocations, streams, modules' state, host mappings,
    /// launches and copies in flight (no event is reported for them) — and it is as if new, except
    /// that its clock goes on and launch and copy ids are not handed out again. The caller re-creates
    /// what it needs. Backends that cannot return [`GpuError::Unsupported`] (the default).
    fn reset(&mut self) -> Result<()> {
        Err(GpuError::Unsupported("this backend cannot be reset".into()))
    }

    /// Removes a mapping and releases the backend's hold on its memory. Unmapping while a launch
    /// that uses it has not reported `LaunchDone` is an error; the mapping then stays.
    fn unmap_host(&mut self, id: HostMappingId) -> Result<()> {
        Err(GpuError::Unsupported(format!("this backend has no host mapping {}", id.0)))
    }

    /// Records launches that a caller would otherwise issue one after another on one stream, so
    /// that [`Gpu::launch_run`] replays them as one unit (on CUDA: a CUDA graph, one driver call
    /// and no per-launch host work). Every launch must be one the caller will never preempt and
    /// whose own end it does not need: `preemptible`, `report_ctas`, `report_start` and
    /// `report_end` false, `after` None, all on one partition with a mask that covers it (the
    /// whole device, or a partition of [`Gpu::partition_of_groups`]: the run is recorded in it,
    /// and every replay runs there, on whatever stream it is queued); their `stream` is ignored. Or, all with the same stop word, `preemptible` true: the run
    /// stops between its kernels when the word is raised (see [`LaunchRequest::stop_word`]; at
    /// most [`STOP_RUN_LAUNCHES_MAX`] launches). The buffers they name must stay allocated, with
    /// the same addresses, for as long as the run exists (replays read and write them in place).
    /// At most [`RUN_LAUNCHES_MAX`] launches. Backends without recorded runs return
    /// [`GpuError::Unsupported`] (the default): the caller issues the launches one by one.
    fn record_run(&mut self, launches: &[LaunchRequest<'_>]) -> Result<RunId> {
        let _ = launches;
        Err(GpuError::Unsupported("this backend cannot record runs of launches".into()))
    }

    /// Queues one replay of a recorded run on `stream`, behind what is queued there. Each of its
    /// launches gets an id, appended to `ids` in order, and is silent: its
    /// [`GpuEvent::LaunchDone`] comes when a later launch on the same stream that reports its end
    /// ends (as for `report_end: false`; the caller must issue such a launch). A replay of a run
    /// must end before the run is replayed again (one slot's buffers, one job at a time).
    fn launch_run(&mut self, run: RunId, stream: StreamId, ids: &mut Vec<LaunchId>) -> Result<()> {
        let _ = (stream, ids);
        Err(GpuError::Unsupported(format!("this backend has no recorded run {}", run.0)))
    }

    /// Forgets a recorded run (replays already queued still complete).
    fn drop_run(&mut self, run: RunId) -> Result<()> {
        Err(GpuError::Unsupported(format!("this backend has no recorded run {}", run.0)))
    }

    /// A new stop word, lowered ([`LaunchRequest::stop_word`]): runs recorded with it stop between
    /// their kernels when it is raised. At most [`STOP_WORDS_MAX`] live ones
    /// ([`GpuError::Exhausted`]). Backends without them return [`GpuError::Unsupported`] (the
    /// default): the caller sends what it may stop launch by launch.
    fn create_stop_word(&mut self) -> Result<StopWordId> {
        Err(GpuError::Unsupported("this backend has no stop words".into()))
    }

    /// Releases a stop word; no launch in flight may carry it.
    fn destroy_stop_word(&mut self, word: StopWordId) -> Result<()> {
        Err(GpuError::Unsupported(format!("this backend has no stop word {}", word.0)))
    }
}

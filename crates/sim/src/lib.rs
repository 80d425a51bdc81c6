//! kairos-sim: a discrete-event GPU in virtual time behind the [`kairos_gpu::Gpu`] trait.
//!
//! The dispatcher, the policies, the server and the benchmarks run on it unchanged, anywhere, and
//! deterministically: one seed drives every random choice, so a run is a function of its seed and
//! its calls, and [`SimGpu::trace_hash`] proves it.
//!
//! ```
//! use kairos_gpu::Gpu;
//! use kairos_sim::{GpuDesc, SimGpu, SimOptions};
//! let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 7, ..SimOptions::default() });
//! assert_eq!(gpu.info().sm_count, 132);
//! ```
//!
//! # The model
//!
//! **Clock.** [`Gpu::now_ns`](kairos_gpu::Gpu::now_ns) is the host's virtual clock. It moves when the
//! host spends time in a call: a launch or async copy costs `launch_host_ns` (H100 SXM: 4.0 us, the
//! dispatcher's measured time per launch and policy decision), every notification that
//! [`Gpu::poll`](kairos_gpu::Gpu::poll) delivers costs `event_host_ns` (0.8 us), a synchronous read
//! or write costs its transfer; and in [`Gpu::wait`](kairos_gpu::Gpu::wait), which runs the GPU to
//! the next notification or the deadline. So the dispatcher's thread is a busy resource: while it
//! launches and reads records, arrivals and notifications wait. Preempting and allocating are free.
//!
//! **Launch path.** A launch reaches its stream's hardware queue `launch_latency_ns` (jittered) after
//! the call starts. Streams are spread round-robin over `hardware_queues` FIFO queues, as CUDA maps
//! streams onto its connections. A queue's head leaves only when its stream's previous command has
//! completed; while it waits, every command behind it waits too, whatever its stream: this is the
//! head-of-line blocking of multi-stream serving. A grid reaches the compute work distributor
//! `grid_dispatch_ns` later; at most `concurrent_grids_max` grids are dispatched at once.
//!
//! **Placement.** The distributor keeps grids in order: stream priority first, then arrival. A grid
//! places its CTAs one by one, each on the SM of its hardware partition with the most free thread
//! slots (lowest id on ties: a grid spreads breadth-first) that has room for one more CTA (threads,
//! registers in 256-register units, shared memory, CTA slots). While a grid still has CTAs left to
//! place, the grids behind it that share SMs with its partition place nothing (in-order placement).
//!
//! **The kernel protocol** (as `crates/kernels/cuda/protocol.cuh` implements it). A CTA on an SM
//! outside the launch's SM mask leaves at once without reporting (it holds its slot for
//! `cta_exit_ns`). A CTA inside the mask reports its placement, then takes logical blocks from the
//! launch's counter and runs them until none is left or the stop bit is set, and reports how many
//! blocks it ran when it leaves (zero for a CTA that found none: it too holds its slot for
//! `cta_exit_ns`). [`Gpu::preempt`](kairos_gpu::Gpu::preempt) raises the launch's flag. In device
//! memory (`preempt_flag_write_ns` set, as kairos-cuda's default) the write lands that much later
//! and every take from then on finds it and takes nothing. In host memory a take that got a block
//! polls it when the launch's last poll is `preempt_poll_ns` (4 us) old, and a poll that finds it
//! set makes the stop bit visible one PCIe read (`preempt_flag_delay_ns`) later. Blocks taken
//! before the stop still run. When the last CTA leaves, `LaunchDone` reports the first
//! block never taken and `preempted` when that is short of the end; the grid completes for its
//! stream `grid_complete_ns` later. If the last CTA finds blocks left and no stop (no CTA landed
//! inside the mask), it runs them itself on its SM, reporting its placement there. A launch issued
//! `after` the launch before it on its stream, when that one stopped early, has its stop bit set
//! from the start (the protocol's stream gate): it takes no block and reports `preempted` at its
//! first block. Overlapped (programmatic dependent) launches are not modelled. With `ctas = 0`
//! the simulator starts one CTA per block left up to the partition's capacity (at least one), or,
//! with a mask narrower than the partition, enough CTAs to fill the whole partition, as kairos-cuda
//! does.
//!
//! **Notifications** become visible to [`Gpu::poll`](kairos_gpu::Gpu::poll) `notify_delay_ns` after
//! the event (jittered per instant, delivered in order, as a ring in mapped memory is read).
//! CTAs of one launch leaving one SM at one instant are reported together.
//!
//! **Timing model.** CTAs of one launch placed together on SMs where a block takes equally long
//! move in lockstep (a *cohort*: one event per block for all of them), so an event costs O(SMs) and
//! not O(CTAs). SMs whose block times differ by less than 1.6% (below the block jitter) share a
//! cohort at their mean time, and CTAs of a launch starting blocks that would end within 1/64 of a
//! block time of one of its running cohorts join it: phases that drift apart as CTAs trickle onto
//! a crowded GPU collapse, at an error of at most 1.6% of one block.
//!
//! A block's time is fixed when it starts, from the launch's per-block model (see [`timing`]):
//! a compute/latency part that grows with the SM's load, plus the block's device-memory and
//! host-memory traffic at the most one CTA can pull; and at least the traffic's time at the max-min
//! fair share of a saturated pool (device memory, PCIe H2D, PCIe D2H; see [`bandwidth`]) among all
//! running CTAs and copies. An SM's load is the sum, over its resident working CTAs, of one over
//! the number of CTAs of that kernel that fit on an SM: a kernel alone at its own occupancy has
//! load one. So a kernel on fewer SMs (KRISP) runs more waves, a memory-bound kernel's CTAs go
//! faster when fewer of them share the bandwidth, and co-running kernels slow each other through
//! shared SMs and shared bandwidth.
//!
//! **Co-run interference** (`ModelDesc::corun_slowdown_per_launch`, H100 SXM 0.14). On top of
//! that, a block takes `1 + corun_slowdown_per_launch * others` times as long, `others` being the
//! other launches with CTAs working on the GPU when it starts, each weighted by the fraction of the
//! GPU's SMs its working CTAs cover (at most 1): what co-running kernels cost each
//! other beyond SM slots and the bandwidth pools (L2 evictions, memory-system queueing below the
//! bandwidth limit, instruction caches and schedulers), fitted to the H100's per-request GPU time
//! against the requests in service (`scripts/corun_slowdown.py`, data/gpus/h100_sxm.json).
//!
//! **Graph nodes** (`LatencyDesc::graph_node_gap_ns`, H100 SXM 1.5 us). Between two launches of
//! one replayed recorded run on a stream, the next one's CTAs can be placed this long after the
//! earlier one's tail, instead of `grid_complete_ns + grid_dispatch_ns` (which the profiles'
//! event-timed durations include): the GPU stages a graph's next node while one runs.
//!
//! **The engine's host path** (`LatencyDesc::request_host_ns`, H100 SXM 90 us). Not a GPU term:
//! what a request spends in the threaded serving engine outside the dispatcher (submission queue,
//! waking the dispatcher thread, completion callback), which the simulated GPU never sees. A
//! virtual serving run (`kairos bench run --backend sim`) hands each request to the dispatcher this
//! long after its arrival; measured as the queue time of the H100's requests that found a stream
//! free at light load (`scripts/host_path.py`).
//!
//! Block models come from a measured profile ([`SimGpu::register_plan`], keyed by the kernel's JSON
//! and dtype) solved to reproduce the measured duration alone (on the measured SM counts, linear in
//! between), or from a roofline for kernels without one: `block_latency_ns` plus the block's FLOPs
//! at a documented fraction of the peak (35% of dense fp16 tensor for fp16 conv/gemm, 50% of fp32 for
//! fp32 conv/gemm, 25% of fp32 for the rest) shared by the CTAs of an SM, plus its bytes at the
//! per-SM rate (device bandwidth saturates with half of the SMs), within 85% of device bandwidth
//! in total. Durations jitter by a log-normal factor per launch (sigma 0.02) and per block wave
//! (sigma 0.02); latencies by sigma 0.25 (launch to block start seen: 6 us p50, ~9 us p99).
//!
//! **Copies** go through their stream's hardware queue like kernels, then to one of three engines
//! (H2D, D2H, D2D), each serving its copies in FIFO order after `copy_setup_ns`, at the link rate
//! (55.6 GB/s pinned) shared with kernels reading or writing mapped host memory (51.4 GB/s for
//! kernels alone); device-to-device copies share device memory bandwidth with kernels.
//!
//! **Results.** With `compute` on, allocations are backed and when a launch ends, the CPU reference
//! kernels run exactly the logical blocks it executed ([`kairos_kernels::cpu::run_blocks`]), so a
//! preempted and resumed launch is checked functionally. Copies move bytes when they end. Caller
//! memory mapped with [`Gpu::map_host`](kairos_gpu::Gpu::map_host) is read and written in place at
//! that instant, through the caller's own accessors (see [`hostmem`]), and its bytes cross PCIe in
//! the timing model like any host-mapped memory.
//!
//! # What is deliberately absent
//! No L2 cache model (its effect on measured kernels is inside their profile), no clock boost or
//! power throttling, no warp-level scheduling, no TLB or page faults, no NVLink, one GPU per
//! simulator. Synchronous reads and writes do not wait for GPU work. A full hardware queue is an
//! error, where a real driver would block the host.

#![forbid(unsafe_code)]

pub mod bandwidth;
pub mod desc;
pub mod faults;
mod gpu;
pub mod hostmem;
mod memory;
mod slab;
pub mod timing;
pub mod trace;

pub use desc::{GpuDesc, LatencyDesc, ModelDesc};
pub use faults::Faults;
pub use gpu::{
    COPIES_IN_FLIGHT_MAX, CTAS_PER_LAUNCH_MAX, HOST_MAPPING_ALIGN_BYTES, HOST_MAPPINGS_MAX, LAUNCHES_IN_FLIGHT_MAX,
    NOTIFY_RING_MAX, QUEUE_DEPTH_MAX, STREAMS_MAX, SimGpu, SimOptions, SimStats, SmUsage, TRACE_EVENTS_MAX,
};
pub use timing::{CtaResources, MeasuredKernel};
pub use trace::TraceEvent;

/// Seeds for a seeded test: `KAIROS_SEED` if set (one seed, to reproduce a failure), otherwise
/// `count` seeds from `base` (or from a random base if `KAIROS_SEED_RANDOM` is set, for swarm runs
/// that explore new seeds). Every seed is printed by the caller; see `tests/`.
pub fn test_seeds(count: u64, base: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("KAIROS_SEED") {
        let seed = s.trim().parse().unwrap_or_else(|_| panic!("KAIROS_SEED={s} is not a u64"));
        return vec![seed];
    }
    let base = if std::env::var_os("KAIROS_SEED_RANDOM").is_some() {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(base)
    } else {
        base
    };
    (0..count).map(|i| base.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect()
}

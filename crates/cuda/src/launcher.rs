//! Launcher threads: the driver call of a launch, beside the dispatcher thread.
//!
//! `cuLaunchKernel` costs the calling thread 4-5 µs on an H100 host (an empty kernel, measured),
//! far more than kairos' own work to prepare a launch (about 1.5 µs: launch slot, stream gate,
//! protocol block, argument packing), and the dispatcher thread issues every kernel of every
//! request. Several host threads launching at once scale almost linearly on the same context
//! (measured on an H100 host: 185k empty launches/s from one thread, 331k from two, 637k from
//! four). So [`CudaGpu`](crate::CudaGpu) prepares a launch on the caller's thread, gives the
//! finished parameter block to a launcher thread, and returns; the launcher makes the driver call.
//!
//! Guarantees: launches of one stream go through one launcher, in the order they were posted, so
//! stream order (and with it the protocol's stream gate) is what the caller issued; anything else
//! that must follow a launch on its stream (an event, a copy, a synchronize, destroying the stream)
//! waits for [`Launchers::flush`] first, which returns once every launch posted before it has been
//! handed to the driver. A launch the driver refuses comes back from [`Launchers::take_failures`]
//! (its kernel never ran). Every queue is bounded; a full one makes the poster wait.
//!
//! A launcher spins while work arrives and for `SPIN_NS` after its last job, then parks (a posting
//! thread wakes it), so an idle server does not burn cores.

use crate::driver::{self, DResult};
use cudarc::driver::sys::{CUcontext, CUfunction, CUstream};
use kairos_gpu::LaunchId;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Launcher threads at most.
pub const LAUNCH_THREADS_MAX: usize = 16;
/// Launches waiting in one launcher's queue at most (the protocol's launch slots bound them first);
/// the launcher may hold as many again, taken from the queue and not yet handed to the driver.
pub const LAUNCH_QUEUE_MAX: usize = 1024;
/// The most parameter bytes one launch passes (the protocol block and the kernel's arguments).
pub const PARAM_BYTES_MAX: usize = 1024;
/// How long a launcher keeps spinning after its last job before it parks.
pub const SPIN_NS: u64 = 2_000_000;
/// How long the urgent lane keeps spinning after its last job: real-time requests come apart
/// (DISB A: one every 10 ms), and waking a parked thread costs tens of microseconds, the very
/// delay the lane exists to remove; it burns a core for at most this long after each.
pub const URGENT_SPIN_NS: u64 = 100_000_000;
/// Launches the driver refused, kept until polled.
pub const FAILURES_MAX: usize = 4096;

/// One launch, complete: what the driver call needs.
pub struct Job {
    pub f: CUfunction,
    pub stream: CUstream,
    pub grid: u32,
    pub block: u32,
    pub dyn_smem_bytes: u32,
    pub overlapped: bool,
    pub launch: LaunchId,
    pub slot: u32,
    /// A replay of a recorded run (a CUDA graph) instead of a kernel launch (`f` is then null):
    /// its `run_launches` launches have consecutive ids from `launch`.
    graph: driver::CUgraphExec,
    pub run_launches: u32,
    /// A stream write of `write_value` to this device address instead of a launch (0: none):
    /// what must follow the stream's launches in order, like clearing a stop word.
    write_addr: u64,
    write_value: u32,
    /// Byte lengths of the kernel's parameters, laid out one after the other (each at a 16-byte
    /// boundary) in `params`.
    lens: [u16; 2],
    count: u8,
    /// The parameters, each starting at a multiple of 16 bytes from the start (16-byte aligned:
    /// u128 words). Inline: a launch allocates nothing on the way to the driver.
    params: [u128; PARAM_BYTES_MAX / 16],
}

// SAFETY: the raw handles are driver objects usable from any thread with their context current
// (each launcher binds the context); the CudaGpu that owns the function's module and the stream
// keeps them alive until the launch has been made (it flushes the launchers before destroying a
// stream and joins them before it unloads modules or drops the context).
unsafe impl Send for Job {}

impl Job {
    /// A launch of `f` with the given parameters (at most 2, `PARAM_BYTES_MAX` bytes in all, each
    /// at a 16-byte boundary).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        f: CUfunction,
        stream: CUstream,
        grid: u32,
        block: u32,
        dyn_smem_bytes: u32,
        overlapped: bool,
        launch: LaunchId,
        slot: u32,
        params: &[&[u8]],
    ) -> Result<Job, String> {
        if params.len() > 2 {
            return Err(format!("{} kernel parameters, the launcher passes at most 2", params.len()));
        }
        let total: usize = params.iter().map(|b| b.len().next_multiple_of(16)).sum();
        if total > PARAM_BYTES_MAX {
            return Err(format!("kernel parameters of {total} bytes exceed the launcher's {PARAM_BYTES_MAX}"));
        }
        let mut p = [0u128; PARAM_BYTES_MAX / 16];
        let mut lens = [0u16; 2];
        let mut word = 0;
        for (i, b) in params.iter().enumerate() {
            for chunk in b.chunks(16) {
                let mut w = [0u8; 16];
                w[..chunk.len()].copy_from_slice(chunk);
                p[word] = u128::from_ne_bytes(w);
                word += 1;
            }
            lens[i] = b.len() as u16;
        }
        Ok(Job {
            f,
            stream,
            grid,
            block,
            dyn_smem_bytes,
            overlapped,
            launch,
            slot,
            graph: std::ptr::null_mut(),
            run_launches: 0,
            write_addr: 0,
            write_value: 0,
            lens,
            count: params.len() as u8,
            params: p,
        })
    }

    /// A replay of the CUDA graph `graph` (a recorded run of `run_launches` launches, whose ids
    /// follow from `first`) on `stream`.
    pub fn graph(graph: driver::CUgraphExec, stream: CUstream, first: LaunchId, run_launches: u32) -> Job {
        Job {
            f: std::ptr::null_mut(),
            stream,
            grid: 0,
            block: 0,
            dyn_smem_bytes: 0,
            overlapped: false,
            launch: first,
            slot: u32::MAX,
            graph,
            run_launches,
            write_addr: 0,
            write_value: 0,
            lens: [0; 2],
            count: 0,
            params: [0; PARAM_BYTES_MAX / 16],
        }
    }

    /// A stream write of `value` to the 4-byte device word at `addr` on `stream`, in order with
    /// the launches posted before and after it (its failure is reported with launch id 0).
    pub fn write32(stream: CUstream, addr: u64, value: u32) -> Job {
        Job { write_addr: addr, write_value: value, ..Job::graph(std::ptr::null_mut(), stream, LaunchId(0), 0) }
    }

    /// Makes the driver call on this thread.
    ///
    /// # Safety
    /// 1. The context of `f` and `stream` is current on this thread, and both are live.
    /// 2. The parameters match the kernel's signature, and the device memory they name stays
    ///    allocated until the kernel ends (the `Gpu::launch` contract of the poster).
    pub unsafe fn launch(&self) -> DResult<()> {
        if self.write_addr != 0 {
            // SAFETY: contract 1; the poster keeps the word allocated until the write has been
            // made (it flushes the launchers before it frees anything).
            return unsafe { driver::stream_write_value32(self.stream, self.write_addr, self.write_value) };
        }
        if !self.graph.is_null() {
            // SAFETY: contract 1 (the poster keeps the graph's instance alive until the replay has
            // been queued: it flushes the launchers before destroying one) and 2.
            return unsafe { driver::graph_launch(self.graph, self.stream) };
        }
        let mut ptrs = self.param_ptrs();
        let params = &mut ptrs[..self.count as usize];
        if self.overlapped {
            // SAFETY: contracts 1 and 2; the pointers point into self.params, alive for the call.
            unsafe { driver::launch_kernel_overlapped(self.f, self.grid, self.block, self.dyn_smem_bytes, self.stream, params) }
        } else {
            // SAFETY: as above.
            unsafe { driver::launch_kernel(self.f, self.grid, self.block, self.dyn_smem_bytes, self.stream, params) }
        }
    }
}

impl Job {
    /// Where each parameter starts (null past `count`).
    fn param_ptrs(&self) -> [*mut c_void; 2] {
        let mut ptrs = [std::ptr::null_mut::<c_void>(); 2];
        let mut word = 0usize;
        for (i, &len) in self.lens.iter().enumerate().take(self.count as usize) {
            ptrs[i] = self.params[word..].as_ptr() as *mut c_void;
            word += (len as usize).div_ceil(16);
        }
        ptrs
    }
}

/// A launch the driver refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub launch: LaunchId,
    pub slot: u32,
    /// A refused replay of a recorded run: its launches, with consecutive ids from `launch`
    /// (0: a kernel launch).
    pub run_launches: u32,
    pub error: String,
}

/// A value on cache lines of its own: what the poster writes and what the launcher writes do not
/// share a line (each write would take the line from the other core).
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

struct Lane {
    queue: Padded<Mutex<VecDeque<Job>>>,
    /// Written by the poster.
    posted: Padded<AtomicU64>,
    /// Written by the launcher.
    launched: Padded<AtomicU64>,
    parked: AtomicBool,
    busy_ns: AtomicU64,
}

struct Shared {
    /// The shared lanes (stream id modulo their count), then the urgent lane if any.
    lanes: Vec<Lane>,
    shared_lanes: usize,
    failures: Mutex<Vec<Failure>>,
    /// Failures waiting in `failures` (changed under its lock, read without it: the poller looks
    /// at every turn).
    failed: AtomicU64,
    stop: AtomicBool,
}

/// The launcher threads of one CudaGpu.
pub struct Launchers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// A context handle that may cross to the launcher threads.
#[derive(Clone, Copy)]
struct Ctx(CUcontext);
// SAFETY: a CUcontext is a driver handle usable from any thread; the CudaGpu keeps its primary
// context retained until it has joined the launchers.
unsafe impl Send for Ctx {}

impl Launchers {
    /// Starts `threads` launchers (1..=LAUNCH_THREADS_MAX) that make `ctx` current, plus one
    /// for urgent streams alone with `urgent_lane`.
    pub fn start(threads: usize, urgent_lane: bool, ctx: CUcontext) -> Result<Launchers, String> {
        if threads == 0 || threads > LAUNCH_THREADS_MAX {
            return Err(format!("{threads} launcher threads: use 1 to {LAUNCH_THREADS_MAX} (0: launch on the caller's thread)"));
        }
        let shared = Arc::new(Shared {
            shared_lanes: threads,
            lanes: (0..threads + urgent_lane as usize)
                .map(|_| Lane {
                    queue: Padded(Mutex::new(VecDeque::with_capacity(LAUNCH_QUEUE_MAX))),
                    posted: Padded(AtomicU64::new(0)),
                    launched: Padded(AtomicU64::new(0)),
                    parked: AtomicBool::new(false),
                    busy_ns: AtomicU64::new(0),
                })
                .collect(),
            failures: Mutex::new(Vec::new()),
            failed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let mut handles = Vec::with_capacity(threads);
        let ctx = Ctx(ctx);
        for i in 0..shared.lanes.len() {
            let s = Arc::clone(&shared);
            let name = if i < threads { format!("kairos-launch-{i}") } else { "kairos-launch-rt".to_string() };
            let h = std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    let ctx = ctx;
                    run(&s, i, ctx.0)
                })
                .map_err(|e| format!("cannot start a launcher thread: {e}"))?;
            handles.push(h);
        }
        Ok(Launchers { shared, threads: handles })
    }

    /// Launcher threads shared by streams (the urgent lane not counted).
    pub fn threads(&self) -> usize {
        self.shared.shared_lanes
    }

    /// Whether urgent streams have a launcher of their own.
    pub fn has_urgent_lane(&self) -> bool {
        self.shared.lanes.len() > self.shared.shared_lanes
    }

    /// The lane of a stream: the urgent lane for an urgent stream if there is one, else one of
    /// the shared lanes by stream id. A stream keeps its lane (and with it its order) for life.
    pub fn lane_of(&self, stream_key: u32, urgent: bool) -> usize {
        lane_for(stream_key, urgent, self.shared.shared_lanes, self.has_urgent_lane())
    }

    /// Hands a launch to launcher `lane` (from [`Launchers::lane_of`]: one launcher per stream
    /// keeps its order); waits while that launcher's queue is full.
    pub fn post(&self, lane_index: usize, job: Job) {
        let lane = &self.shared.lanes[lane_index];
        let mut job = Some(job);
        loop {
            {
                let mut q = lane.queue.lock().unwrap_or_else(|e| e.into_inner());
                if q.len() < LAUNCH_QUEUE_MAX {
                    q.push_back(job.take().expect("posted once"));
                    lane.posted.fetch_add(1, Ordering::SeqCst);
                }
            }
            if job.is_none() {
                break;
            }
            std::hint::spin_loop();
        }
        if lane.parked.load(Ordering::SeqCst) {
            self.threads[lane_index].thread().unpark();
        }
    }

    /// Returns once every launch posted so far has been handed to the driver.
    pub fn flush(&self) {
        for (i, lane) in self.shared.lanes.iter().enumerate() {
            let target = lane.posted.load(Ordering::Acquire);
            let mut spins = 0u32;
            while lane.launched.load(Ordering::Acquire) < target {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(1024) && lane.parked.load(Ordering::Acquire) {
                    self.threads[i].thread().unpark();
                }
                std::hint::spin_loop();
            }
        }
    }

    /// Launches the driver refused since the last call.
    pub fn take_failures(&self, out: &mut Vec<Failure>) {
        if self.shared.failed.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut f = self.shared.failures.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.failed.fetch_sub(f.len() as u64, Ordering::Release);
        out.append(&mut f);
    }

    /// Host time the launchers spent in driver calls, summed.
    pub fn busy_ns(&self) -> u64 {
        self.shared.lanes.iter().map(|l| l.busy_ns.load(Ordering::Relaxed)).sum()
    }
}

impl Drop for Launchers {
    fn drop(&mut self) {
        self.flush();
        self.shared.stop.store(true, Ordering::Release);
        for h in &self.threads {
            h.thread().unpark();
        }
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// [`Launchers::lane_of`]: the lane after the `shared` ones for an urgent stream when there is
/// one, else a shared lane by stream key.
fn lane_for(stream_key: u32, urgent: bool, shared: usize, urgent_lane: bool) -> usize {
    if urgent && urgent_lane { shared } else { stream_key as usize % shared.max(1) }
}

fn run(s: &Shared, i: usize, ctx: CUcontext) {
    let lane = &s.lanes[i];
    let spin = Duration::from_nanos(if i < s.shared_lanes { SPIN_NS } else { URGENT_SPIN_NS });
    // SAFETY: the CudaGpu keeps the context retained until it joins this thread.
    let bound = unsafe { driver::ctx_set_current(ctx) };
    let mut last_work = Instant::now();
    let mut taken = 0u64;
    // What the last look at the queue took: all of it at once (one lock per batch, not per
    // launch; the two queues trade places, so neither allocates).
    let mut batch: VecDeque<Job> = VecDeque::with_capacity(LAUNCH_QUEUE_MAX);
    loop {
        // Spin on the posted count, not on the queue's lock (the poster takes that lock).
        if batch.is_empty() && lane.posted.load(Ordering::Acquire) > taken {
            std::mem::swap(&mut *lane.queue.lock().unwrap_or_else(|e| e.into_inner()), &mut batch);
            taken += batch.len() as u64;
        }
        match batch.pop_front() {
            Some(job) => {
                let t = Instant::now();
                let r = match &bound {
                    // SAFETY: the context is current (bound above); the poster keeps the function,
                    // stream and argument memory alive until the launch is made and the kernel
                    // ends (contract of Job::launch, upheld by CudaGpu).
                    Ok(()) => unsafe { job.launch() },
                    Err(e) => Err(*e),
                };
                lane.busy_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                if let Err(e) = r {
                    let mut f = s.failures.lock().unwrap_or_else(|e| e.into_inner());
                    if f.len() < FAILURES_MAX {
                        f.push(Failure {
                            launch: job.launch,
                            slot: job.slot,
                            run_launches: job.run_launches,
                            error: e.to_string(),
                        });
                        s.failed.fetch_add(1, Ordering::Release);
                    }
                }
                lane.launched.fetch_add(1, Ordering::Release);
                last_work = Instant::now();
            }
            None => {
                if s.stop.load(Ordering::Acquire) {
                    return;
                }
                if last_work.elapsed() < spin {
                    std::hint::spin_loop();
                    continue;
                }
                lane.parked.store(true, Ordering::SeqCst);
                // Re-check after announcing: a post that saw `parked` false already counted its job.
                if lane.posted.load(Ordering::SeqCst) == taken && !s.stop.load(Ordering::Acquire) {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                lane.parked.store(false, Ordering::SeqCst);
                last_work = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urgent_streams_have_a_lane_of_their_own_when_there_is_one() {
        // Two shared lanes and the urgent one (index 2).
        assert_eq!((0..6).map(|k| lane_for(k, false, 2, true)).collect::<Vec<_>>(), [0, 1, 0, 1, 0, 1]);
        assert!((0..6).all(|k| lane_for(k, true, 2, true) == 2), "every urgent stream on the urgent lane");
        // No urgent lane: urgent streams share the lanes by key like every stream.
        assert_eq!((0..4).map(|k| lane_for(k, true, 2, false)).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert_eq!(lane_for(5, false, 1, true), 0);
    }

    #[test]
    fn parameters_are_laid_out_at_16_byte_boundaries_and_kept_whole() {
        let proto: Vec<u8> = (0..128).map(|i| i as u8).collect();
        let args: Vec<u8> = (0..40).map(|i| 200 - i as u8).collect();
        let job =
            Job::new(std::ptr::null_mut(), std::ptr::null_mut(), 1, 32, 0, false, LaunchId(7), 3, &[&proto, &args]).unwrap();
        let p = job.param_ptrs();
        assert_eq!(p[0] as usize % 16, 0);
        assert_eq!(p[1] as usize - p[0] as usize, 128);
        // SAFETY (test): both point into the job's own parameter words, of at least these lengths.
        let (a, b) =
            unsafe { (std::slice::from_raw_parts(p[0] as *const u8, 128), std::slice::from_raw_parts(p[1] as *const u8, 40)) };
        assert_eq!((a, b), (&proto[..], &args[..]));
        let odd: Vec<u8> = vec![9; 20];
        let job = Job::new(std::ptr::null_mut(), std::ptr::null_mut(), 1, 32, 0, false, LaunchId(8), 4, &[&odd, &args]).unwrap();
        let p = job.param_ptrs();
        assert_eq!(p[1] as usize - p[0] as usize, 32);
        assert!(Job::new(std::ptr::null_mut(), std::ptr::null_mut(), 1, 32, 0, false, LaunchId(9), 5, &[&[0u8; 2000]]).is_err());
        assert!(
            Job::new(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                1,
                32,
                0,
                false,
                LaunchId(9),
                5,
                &[&[0u8; 1], &[0u8; 1], &[0u8; 1]]
            )
            .is_err()
        );
    }
}

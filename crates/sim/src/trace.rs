//! The simulator's own record of what happened inside the GPU, for tests and debugging, and the
//! running hash over it that determinism tests compare.

use kairos_gpu::{CopyId, GpuEvent, LaunchId, StreamId};
use serde::{Deserialize, Serialize};

/// One step inside the simulated GPU. Recorded when `SimOptions::record_trace` is on; always hashed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TraceEvent {
    /// The host issued a launch; it reaches hardware queue `queue` at `arrive_ns`.
    Issue {
        launch: LaunchId,
        stream: StreamId,
        queue: u32,
        at_ns: u64,
        arrive_ns: u64,
    },
    /// The host issued an asynchronous copy.
    IssueCopy {
        copy: CopyId,
        stream: StreamId,
        queue: u32,
        at_ns: u64,
        arrive_ns: u64,
    },
    /// A launch left the head of its hardware queue for the compute work distributor.
    Dispatch {
        launch: LaunchId,
        queue: u32,
        at_ns: u64,
    },
    /// A copy left the head of its hardware queue for a copy engine.
    DispatchCopy {
        copy: CopyId,
        queue: u32,
        at_ns: u64,
    },
    /// CTAs were placed on an SM: `working` took a logical block, `idle` took none (outside the SM
    /// mask, nothing left, or stopped) and leave after `cta_exit_ns`; idle CTAs inside the mask
    /// report placement and completion (with 0 blocks), those outside report nothing.
    Place {
        launch: LaunchId,
        sm: u32,
        working: u32,
        idle: u32,
        at_ns: u64,
    },
    /// CTAs left an SM after running `blocks` logical blocks between them (`idle` as in `Place`).
    Release {
        launch: LaunchId,
        sm: u32,
        ctas: u32,
        blocks: u32,
        idle: bool,
        at_ns: u64,
    },
    /// The last CTA of a launch with blocks left and none of its CTAs in the mask runs them on `sm`.
    Rescue {
        launch: LaunchId,
        sm: u32,
        at_ns: u64,
    },
    /// Logical blocks [first, first + count) of a launch were taken from its counter.
    Take {
        launch: LaunchId,
        first: u32,
        count: u32,
        at_ns: u64,
    },
    /// The launch's last CTA left.
    Done {
        launch: LaunchId,
        first_block: u32,
        next_block: u32,
        preempted: bool,
        at_ns: u64,
    },
    /// The launch's grid completed for its stream (the stream's next command may start).
    Complete {
        launch: LaunchId,
        at_ns: u64,
    },
    CopyStart {
        copy: CopyId,
        at_ns: u64,
    },
    CopyEnd {
        copy: CopyId,
        at_ns: u64,
    },
    /// A notification became visible to the host.
    Deliver {
        event: GpuEvent,
        at_ns: u64,
    },
    /// The device was reset ([`kairos_gpu::Gpu::reset`]): everything on it is gone.
    Reset {
        at_ns: u64,
    },
}

/// Order-sensitive 64-bit hash of a sequence of words.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TraceHasher(pub u64);

impl Default for TraceHasher {
    fn default() -> Self {
        TraceHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl TraceHasher {
    #[inline]
    pub fn word(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(7) ^ w).wrapping_mul(0x0000_0100_0000_01b3 | (1 << 63));
    }

    pub fn event(&mut self, e: &TraceEvent) {
        match *e {
            TraceEvent::Issue { launch, stream, queue, at_ns, arrive_ns } => {
                self.words(&[1, launch.0, stream.0 as u64, queue as u64, at_ns, arrive_ns])
            }
            TraceEvent::IssueCopy { copy, stream, queue, at_ns, arrive_ns } => {
                self.words(&[2, copy.0, stream.0 as u64, queue as u64, at_ns, arrive_ns])
            }
            TraceEvent::Dispatch { launch, queue, at_ns } => self.words(&[3, launch.0, queue as u64, at_ns]),
            TraceEvent::DispatchCopy { copy, queue, at_ns } => self.words(&[4, copy.0, queue as u64, at_ns]),
            TraceEvent::Place { launch, sm, working, idle, at_ns } => {
                self.words(&[5, launch.0, sm as u64, working as u64, idle as u64, at_ns])
            }
            TraceEvent::Release { launch, sm, ctas, blocks, idle, at_ns } => {
                self.words(&[6, launch.0, sm as u64, ctas as u64, blocks as u64, idle as u64, at_ns])
            }
            TraceEvent::Take { launch, first, count, at_ns } => self.words(&[7, launch.0, first as u64, count as u64, at_ns]),
            TraceEvent::Done { launch, first_block, next_block, preempted, at_ns } => {
                self.words(&[8, launch.0, first_block as u64, next_block as u64, preempted as u64, at_ns])
            }
            TraceEvent::Complete { launch, at_ns } => self.words(&[9, launch.0, at_ns]),
            TraceEvent::CopyStart { copy, at_ns } => self.words(&[10, copy.0, at_ns]),
            TraceEvent::CopyEnd { copy, at_ns } => self.words(&[11, copy.0, at_ns]),
            TraceEvent::Rescue { launch, sm, at_ns } => self.words(&[17, launch.0, sm as u64, at_ns]),
            TraceEvent::Deliver { event, at_ns } => self.delivered(&event, at_ns),
            TraceEvent::Reset { at_ns } => self.words(&[20, at_ns]),
        }
    }

    /// Three words per notification: the hot path hashes millions of them per second.
    #[inline]
    pub fn delivered(&mut self, event: &GpuEvent, deliver_ns: u64) {
        let (kind, id, sm, ctas, blocks, at) = match *event {
            GpuEvent::CtasPlaced { launch, sm, ctas, at_ns } => (13, launch.0, sm, ctas, 0, at_ns),
            GpuEvent::CtasFinished { launch, sm, ctas, blocks, at_ns } => (14, launch.0, sm, ctas, blocks, at_ns),
            GpuEvent::LaunchDone { launch, next_block, preempted, at_ns } => {
                (15, launch.0, preempted as u32, 0, next_block, at_ns)
            }
            GpuEvent::CopyDone { copy, at_ns } => (16, copy.0, 0, 0, 0, at_ns),
            GpuEvent::LaunchStarted { launch, at_ns } => (18, launch.0, 0, 0, 0, at_ns),
            GpuEvent::LaunchLost { launch, at_ns } => (19, launch.0, 0, 0, 0, at_ns),
        };
        self.word(id ^ (kind << 56) ^ ((sm as u64) << 40));
        self.word(at ^ deliver_ns.rotate_left(32));
        self.word(ctas as u64 | (blocks as u64) << 32);
    }

    fn words(&mut self, ws: &[u64]) {
        for &w in ws {
            self.word(w);
        }
    }
}

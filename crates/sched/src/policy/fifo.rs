//! `fifo`: one CUDA stream, whole jobs in admission order.
//!
//! **Guarantee:** jobs run to completion one after another in the order they were admitted; no
//! job's kernel ever overlaps another job's, and at most `jobs_queued` jobs sit in the stream at
//! once (the next one is queued behind the running one so the GPU never waits for the dispatcher).
//!
//! **Behaviour:** the single-stream baseline. Nothing runs concurrently, so throughput is that of
//! one request at a time and every request waits for all earlier ones (head-of-line blocking by
//! construction). Kernel dependencies are enforced by the stream's FIFO order, not by the
//! dispatcher.

use super::{Decision, Policy, View};

#[derive(Clone, Copy, Debug)]
pub struct Fifo {
    pub jobs_queued: u32,
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let stream = view.gpu.streams.first()?;
        if stream.jobs >= self.jobs_queued {
            return None;
        }
        let job = view.jobs.iter().filter(|j| j.is_unstarted()).min_by_key(|j| j.seq)?;
        if !view.gpu.can_issue_launches(job.launches) {
            return None;
        }
        Some(Decision::IssueAll { job: job.key, stream: 0 })
    }
}

//! `streams`: today's multi-stream serving, the baseline Paella beats.
//!
//! **Guarantee:** jobs start in admission order; each job's kernels are all issued at once to one
//! of `streams` CUDA streams (the least loaded, lowest index first), at most `jobs_per_stream` jobs
//! per stream; the dispatcher never holds a kernel back once its job has a stream.
//!
//! **Behaviour:** like N worker threads each launching a whole model on its own stream. Kernels of
//! different jobs overlap as the hardware allows, but the order in which they get SMs is the
//! hardware's FIFO order over its queue heads, blind to job sizes, so a short job queued behind a
//! long one's kernels waits for them (head-of-line blocking), which is what Paella's experiments
//! show and `paella` removes. Streams share the GPU's few hardware queues (8 by default in CUDA):
//! a queue's head waiting for its stream's previous kernel holds up every stream behind it, so on
//! the simulated H100 jobs of 8 chained 300 us one-CTA kernels saturate at 3.7k jobs/s with 32
//! streams, where kernel-level dispatch reaches 10k.

use super::{Decision, Policy, View};

#[derive(Clone, Copy, Debug)]
pub struct Streams {
    pub streams: u32,
    pub jobs_per_stream: u32,
}

impl Policy for Streams {
    fn name(&self) -> &'static str {
        "streams"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let n = (self.streams as usize).min(view.gpu.streams.len());
        let (stream, _) = view.gpu.streams[..n]
            .iter()
            .enumerate()
            .filter(|(_, s)| s.jobs < self.jobs_per_stream)
            .min_by_key(|(i, s)| (s.jobs, s.in_flight, *i))?;
        let job = view.jobs.iter().filter(|j| j.is_unstarted()).min_by_key(|j| j.seq)?;
        if !view.gpu.can_issue_launches(job.launches) {
            return None;
        }
        Some(Decision::IssueAll { job: job.key, stream: stream as u32 })
    }
}

//! `seq`: REEF's SEQ baseline. Whole jobs one at a time on one stream, real-time first.
//!
//! **Guarantee:** at most one job is on the GPU at a time and the next one goes only when it is
//! done; the next job is the oldest admitted real-time job, else the oldest best-effort one. A
//! real-time request that arrives while a best-effort job runs waits for that job to end (no
//! preemption), as in a Clockwork-style sequential server.
//!
//! **Behaviour:** no co-running, so throughput is that of one request at a time, and a
//! real-time request waits at most one best-effort job (plus the real-time ones before it).
//! Jobs go out as recorded runs (`Config::record_runs`), so each costs one replay.

use super::{Decision, Policy, View};
use crate::request::Class;

#[derive(Clone, Copy, Debug)]
pub struct Seq;

impl Policy for Seq {
    fn name(&self) -> &'static str {
        "seq"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let stream = view.gpu.streams.first()?;
        if stream.jobs > 0 {
            return None;
        }
        let job = view.jobs.iter().filter(|j| j.is_unstarted()).min_by_key(|j| (j.class != Class::RealTime, j.seq))?;
        if !view.gpu.can_issue_launches(job.launches) {
            return None;
        }
        Some(Decision::IssueAll { job: job.key, stream: 0 })
    }
}

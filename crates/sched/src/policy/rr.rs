//! `rr`: round robin over jobs, kernel by kernel, occupancy-gated.
//!
//! **Guarantee:** the next kernel issued belongs to the job with a ready kernel that was served
//! least recently (never-served jobs first, in admission order), and only when its first CTA can
//! start now or within the headroom; a first-ranked kernel that does not fit blocks the others.
//!
//! **Behaviour:** processor sharing at kernel granularity: every admitted job advances at about the
//! same rate of kernels, so short jobs are not stuck behind long ones, but they are not favoured
//! either: with many jobs in the system every job slows down together.

use super::{Decision, Policy, View, gated_pick};

#[derive(Clone, Copy, Debug)]
pub struct RoundRobin;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "rr"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        gated_pick(view, false, |j| (j.last_issue_seq, j.seq))
    }
}

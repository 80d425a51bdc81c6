//! `sjf`: shortest job first, kernel by kernel, occupancy-gated.
//!
//! **Guarantee:** the next kernel issued belongs to the job with the smallest estimated total GPU
//! time (as estimated when it was admitted; ties by admission order), and only when its first CTA
//! can start now or within the headroom; a first-ranked kernel that does not fit blocks the others.
//!
//! **Behaviour:** like `paella` without the remaining-time refinement and without fairness: a job's
//! rank does not improve as it progresses, and a tenant sending only long jobs can starve.

use super::{Decision, Policy, View, gated_pick};

#[derive(Clone, Copy, Debug)]
pub struct Sjf;

impl Policy for Sjf {
    fn name(&self) -> &'static str {
        "sjf"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        gated_pick(view, false, |j| (j.total_ns, j.seq))
    }
}

//! `paella`: Paella's policy. Shortest remaining processing time, kernel by kernel, with deficit
//! counters per tenant and a fairness threshold, gated on occupancy with a headroom of B CTAs.
//!
//! **Guarantee:** the next kernel issued is, in this order of precedence,
//! 1. a real-time job's before any best-effort job's, and a higher-priority job's within a class;
//! 2. if some tenant with a ready kernel is owed more than `fairness_threshold_ns` of GPU time
//!    (its deficit counter, see [`TenantView`](super::TenantView)), the most-owed such tenant's;
//! 3. the job with the least estimated remaining GPU time (ties by admission order);
//!
//! and it is issued only when it passes the occupancy gate ([`GpuView::fits`](super::GpuView::fits)):
//! at most one kernel plus B CTAs wait in the hardware for room. Without `backfill`, a first-ranked
//! kernel that does not pass blocks every other kernel until it does. A job's next kernel may go
//! behind its kernels in flight on its lane (`ReadyKernel::behind`, the dispatcher's issue-ahead);
//! it needs room only beyond what the kernel it waits behind frees.
//!
//! **Behaviour** (simulated H100 SXM, timing only, roofline kernel times; `cargo run --release -p
//! kairos-sched --example paella_sim`): with the threshold at infinity it is pure SRPT: short jobs
//! overtake long ones kernel by kernel. resnet18 among inception_v3 jobs (equal GPU time each) at
//! 6.5k requests/s: resnet18 p99 0.97 ms against 3.85 ms with `streams` (4.0x). Jobs of 8 one-CTA
//! 300 us kernels: p99 stays at 2.5 ms up to 8k jobs/s where `streams` saturates at 3.7k. On the
//! uniform mix of 11 vision models the p99 slowdown (latency over isolated latency) at a given load
//! is 2-10x lower than `streams`', but the plain p99, set by the largest models, is not better:
//! SRPT makes the largest jobs wait. Lowering the threshold bounds how far a tenant falls behind an
//! equal share and moves latency from long jobs to short ones (at 0 it approaches round robin
//! between tenants). Remaining time is the sum of the estimates of the job's launches not yet done
//! (profiled, else roofline, refined online, see [`crate::estimate`]).

use super::{Decision, JobView, Policy, View, gated_pick};
use crate::request::{Class, TenantId};

/// Default fairness threshold: 10 ms of GPU time owed.
pub const FAIRNESS_THRESHOLD_NS_DEFAULT: u64 = 10_000_000;

#[derive(Clone, Copy, Debug)]
pub struct Paella {
    pub fairness_threshold_ns: u64,
    pub backfill: bool,
}

impl Paella {
    /// The tenant with a ready kernel that is owed the most, if it is owed more than the threshold.
    pub fn owed_tenant(&self, view: &View<'_>) -> Option<TenantId> {
        if self.fairness_threshold_ns == u64::MAX {
            return None;
        }
        let t = self.fairness_threshold_ns as f64;
        view.tenants
            .iter()
            .filter(|t| t.ready_jobs > 0)
            .filter(|x| x.deficit_ns > t)
            .max_by(|a, b| a.deficit_ns.total_cmp(&b.deficit_ns).then(b.tenant.cmp(&a.tenant)))
            .map(|t| t.tenant)
    }
}

impl Policy for Paella {
    fn name(&self) -> &'static str {
        "paella"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let owed = self.owed_tenant(view);
        gated_pick(view, self.backfill, |j: &JobView| {
            // (class, priority, owed tenant first) packed above the remaining time: one u128 compare.
            let rank = ((j.class != Class::RealTime) as u128) << 97
                | ((i32::MAX as i64 - j.priority as i64) as u128) << 65
                | ((Some(j.tenant) != owed) as u128) << 64
                | j.remaining_ns as u128;
            (rank, j.seq)
        })
    }
}

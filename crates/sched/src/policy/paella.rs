//! `paella`: Paella's policy. Shortest remaining processing time, kernel by kernel, with deficit
//! counters per tenant and a fairness threshold, gated on occupancy with a headroom of B CTAs.
//!
//! **Guarantee:** the next kernel issued is, in this order of precedence,
//! 1. a real-time job's before any best-effort job's, and a higher-priority job's within a class;
//! 2. if some tenant with a ready kernel is owed more than `fairness_threshold_ns` of GPU time
//!    (its deficit counter, see [`TenantView`](super::TenantView)), the most-owed such tenant's;
//! 3. with a starvation bound S (`slowdown_bound`, `paella+bound=S`): a job that has been in the
//!    system for at least S times its estimated GPU time (*overdue*) before any job that has not,
//!    overdue jobs by that point in time (arrival + S x size, earliest first);
//! 4. the job with the least estimated remaining GPU time (ties by admission order);
//!
//! and it is issued only when it passes the occupancy gate ([`GpuView::fits`](super::GpuView::fits)):
//! at most one kernel plus B CTAs wait in the hardware for room. Without `backfill`, a first-ranked
//! kernel that does not pass blocks every other kernel until it does. A job's next kernel may go
//! behind its kernels in flight on its lane (`ReadyKernel::behind`, the dispatcher's issue-ahead);
//! it needs room only beyond what the kernel it waits behind frees.
//!
//! **Behaviour** (simulated H100 SXM, timing only, roofline kernel times; `cargo run --release -p
//! kairos-bench --example paella_sim`): with the threshold at infinity it is pure SRPT: short jobs
//! overtake long ones kernel by kernel. resnet18 among inception_v3 jobs (equal GPU time each) at
//! 6.5k requests/s: resnet18 p99 0.97 ms against 3.85 ms with `streams` (4.0x). Jobs of 8 one-CTA
//! 300 us kernels: p99 stays at 2.5 ms up to 8k jobs/s where `streams` saturates at 3.7k. On the
//! uniform mix of 11 vision models the p99 slowdown (latency over isolated latency) at a given load
//! is 2-10x lower than `streams`', but the plain p99, set by the largest models, is not better:
//! SRPT makes the largest jobs wait. Lowering the threshold bounds how far a tenant falls behind an
//! equal share and moves latency from long jobs to short ones (at 0 it approaches round robin
//! between tenants). Remaining time is the sum of the estimates of the job's launches not yet done
//! (profiled, else roofline, refined online, see [`crate::estimate`]).
//!
//! The starvation bound (`paella+bound=S`, off by default, since Paella has none) caps what SRPT
//! does to the largest models within a tenant: once a job has been in the system S times its
//! size it goes before every job that has not. On an H100 (mix8, σ 1.5, 1520 requests/s, two
//! runs each) `+bound=2` lowered densenet121's p99 from 30–33 to 20–22 ms and the overall p99
//! from 17–21 to 15–16 ms, and raised resnet18's from 2.4 to 3.9–4.3 ms; at 1015 requests/s it
//! changed nothing. Whole jobs on 8 streams (`streams:8`) still had the lower p99 (9.7 ms).

use super::{Decision, JobView, Policy, View, gated_pick};
use crate::request::{Class, TenantId};

/// Default fairness threshold: 10 ms of GPU time owed.
pub const FAIRNESS_THRESHOLD_NS_DEFAULT: u64 = 10_000_000;

/// The starvation bound `paella+bound` sets: a job is overdue once it has been in the system for
/// this many times its estimated GPU time.
pub const SLOWDOWN_BOUND_DEFAULT: f64 = 4.0;

#[derive(Clone, Copy, Debug)]
pub struct Paella {
    pub fairness_threshold_ns: u64,
    pub backfill: bool,
    /// The starvation bound S (`None`: pure SRPT after fairness).
    pub slowdown_bound: Option<f64>,
}

impl Paella {
    /// When the job becomes overdue (arrival + S x its estimated GPU time), if it is by `now_ns`:
    /// SRPT no longer passes it over for shorter jobs that are not.
    pub fn overdue_since_ns(&self, j: &JobView, now_ns: u64) -> Option<u64> {
        let s = self.slowdown_bound?;
        let at = j.arrival_ns.saturating_add((s * j.total_ns as f64) as u64);
        (now_ns >= at).then_some(at)
    }

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

impl Paella {
    /// A job's rank, lowest first: (class, priority, owed tenant first, overdue first) packed above
    /// the remaining time (an overdue job's: when it became overdue), one u128 compare.
    pub fn rank(&self, j: &JobView, owed: Option<TenantId>, now_ns: u64) -> u128 {
        let overdue = self.overdue_since_ns(j, now_ns);
        ((j.class != Class::RealTime) as u128) << 98
            | ((i32::MAX as i64 - j.priority as i64) as u128) << 66
            | ((Some(j.tenant) != owed) as u128) << 65
            | (overdue.is_none() as u128) << 64
            | overdue.unwrap_or(j.remaining_ns) as u128
    }
}

impl Policy for Paella {
    fn name(&self) -> &'static str {
        "paella"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let owed = self.owed_tenant(view);
        gated_pick(view, self.backfill, |j: &JobView| (self.rank(j, owed, view.now_ns), j.seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(arrival_ns: u64, total_ns: u64, remaining_ns: u64) -> JobView {
        JobView::for_test(arrival_ns, total_ns, remaining_ns, None)
    }

    #[test]
    fn the_starvation_bound_puts_an_overdue_job_before_shorter_ones() {
        let srpt = Paella { fairness_threshold_ns: u64::MAX, backfill: false, slowdown_bound: None };
        let bound = Paella { slowdown_bound: Some(4.0), ..srpt };
        // A 2 ms job that arrived at 0 with 1.5 ms left, and a fresh 0.4 ms job, at 7.9 and 8.1 ms.
        let long = job(0, 2_000_000, 1_500_000);
        let short = job(7_800_000, 400_000, 400_000);
        for now in [7_900_000, 8_100_000] {
            assert!(srpt.rank(&short, None, now) < srpt.rank(&long, None, now), "pure SRPT: the short job first");
        }
        // Overdue once it has been in the system 4 x 2 ms.
        assert_eq!(bound.overdue_since_ns(&long, 7_900_000), None);
        assert_eq!(bound.overdue_since_ns(&long, 8_100_000), Some(8_000_000));
        assert!(bound.rank(&short, None, 7_900_000) < bound.rank(&long, None, 7_900_000));
        assert!(bound.rank(&long, None, 8_100_000) < bound.rank(&short, None, 8_100_000));
        // Two overdue jobs: the one overdue first goes first, whatever is left of them.
        let older = job(0, 1_000_000, 900_000);
        assert!(bound.rank(&older, None, 8_100_000) < bound.rank(&long, None, 8_100_000));
        // Real-time work and fairness still come first.
        let rt = JobView { class: Class::RealTime, ..job(8_000_000, 50_000_000, 50_000_000) };
        assert!(bound.rank(&rt, None, 8_100_000) < bound.rank(&long, None, 8_100_000));
        let owed = JobView { tenant: TenantId(7), ..job(8_000_000, 50_000_000, 50_000_000) };
        assert!(bound.rank(&owed, Some(TenantId(7)), 8_100_000) < bound.rank(&long, Some(TenantId(7)), 8_100_000));
    }
}

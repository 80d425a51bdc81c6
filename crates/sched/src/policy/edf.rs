//! `edf`: earliest deadline first, kernel by kernel, occupancy-gated; a request without a deadline
//! gets a virtual one proportional to its size.
//!
//! **Guarantee:** the next kernel issued is, in this order of precedence, a real-time job's before
//! any best-effort job's, a higher-priority job's within a class, and then the job with the
//! earliest deadline: its own (`RequestOptions::deadline_ns` from its arrival) if it has one, else
//! its arrival plus `slowdown` times its estimated GPU time (ties by admission order). It is issued
//! only when it passes the occupancy gate, as in `paella`; a first-ranked kernel that does not pass
//! blocks the others (with `backfill`, the best-ranked kernel that passes goes instead).
//!
//! **Behaviour:** a fresh short job ranks before a long one that arrived at about the same time
//! (its virtual deadline is nearer), as under SRPT, but a long job's deadline does not move: once
//! it has waited about `slowdown` times its own size it ranks before newer short jobs, so no job
//! is starved by a stream of shorter ones. That bounds the tail SRPT leaves to the largest models
//! of a mix (measured on an H100, mix8 at 1482 requests/s: `paella`'s p99 was 101 ms, set by
//! densenet121 and inception_v3 waiting behind a stream of smaller requests). Unlike `paella` it
//! does not track progress: a job's rank is fixed at admission.
//!
//! `edf:0` ranks by arrival alone: the oldest job's kernel first. With at most eight jobs on the
//! GPU at once (`Config::stream_count` 8) it held the p99 of the 8-model vision mix under 12 ms
//! up to 1.22-1.27x the load of PyTorch's CUDA graphs on 8 streams on an H200, with a lower p50
//! and p99 than theirs at every load, where SRPT (`paella+bound=2`) reached 1.14-1.18x: the
//! largest models set the mix's tail, and first come, first served takes them in turn
//! (docs/benchmarks.md, "Kernel-level serving past PyTorch's graphs"). With wide kernels in the
//! mix (the 11-model mix's vgg19, resnet152, densenet201) `edf:0` without backfill blocks behind
//! an oldest kernel that does not fit: p99 22 ms at 973 req/s and saturation at 2050 of 2271
//! req/s, where `edf:0+backfill` held 7.1 ms and served 2252, below PyTorch graph8's p99 at
//! every load (1.11x its load at p99 <= 12 ms).

use super::{Decision, JobView, Policy, View, gated_pick};
use crate::request::Class;

/// Default `slowdown`: a job's virtual deadline is its arrival plus this many times its size.
pub const SLOWDOWN_DEFAULT: f64 = 4.0;

#[derive(Clone, Copy, Debug)]
pub struct Edf {
    pub slowdown: f64,
    /// Issue the best-ranked kernel that passes the gate when the first-ranked one does not.
    pub backfill: bool,
}

impl Edf {
    /// The job's deadline on the GPU clock: its own, else its virtual one.
    pub fn deadline_ns(&self, j: &JobView) -> u64 {
        j.deadline_at_ns.unwrap_or_else(|| j.arrival_ns.saturating_add((self.slowdown * j.total_ns as f64) as u64))
    }
}

impl Policy for Edf {
    fn name(&self) -> &'static str {
        "edf"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        gated_pick(view, self.backfill, |j: &JobView| {
            let rank = ((j.class != Class::RealTime) as u128) << 96
                | ((i32::MAX as i64 - j.priority as i64) as u128) << 64
                | self.deadline_ns(j) as u128;
            (rank, j.seq)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_job_that_waited_ranks_before_a_fresh_short_one() {
        let p = Edf { slowdown: 4.0, backfill: false };
        let job = |arrival_ns, total_ns, deadline_at_ns| JobView::for_test(arrival_ns, total_ns, total_ns, deadline_at_ns);
        // Arriving together, the short job (1 ms) goes first; the long one (5 ms) waited 19 ms
        // when a short one arrives: the long one's deadline (20 ms) is nearer than the short
        // one's (19 + 4 = 23 ms).
        assert!(p.deadline_ns(&job(0, 1_000_000, None)) < p.deadline_ns(&job(0, 5_000_000, None)));
        assert!(p.deadline_ns(&job(0, 5_000_000, None)) < p.deadline_ns(&job(19_000_000, 1_000_000, None)));
        // A request's own deadline wins over the virtual one.
        assert_eq!(p.deadline_ns(&job(1_000, 5_000_000, Some(3_000))), 3_000);
    }
}

//! `reef`: REEF's scheduler (OSDI'22) on kairos' kernel protocol: real-time (RT) requests get the
//! GPU as if alone, best-effort (BE) work preempted in microseconds and kept busy beside them.
//!
//! **Guarantee:** while any RT job is admitted (*real-time mode*):
//! 1. the first RT job by (priority, deadline, admission order) (EDF when requests carry deadlines,
//!    FIFO otherwise) has its next kernel issued as soon as the dispatcher offers it, without the
//!    occupancy gate, on a high-priority stream;
//! 2. every BE launch issued before the newest RT job was admitted is preempted (with `kill`; `+wait`
//!    lets them run to their end, REEF's wait-based baseline): it stops at a logical-block
//!    boundary and resumes later at the first block never taken; the arriving RT job's first
//!    launch goes out before these decisions, the stop words reach the GPU with the next poll;
//!    other RT jobs follow the first in rank order when their kernel passes the gate;
//! 3. BE kernels go only as *padding* (unless `+nopad`): confined by an SM mask to the SMs above
//!    the widest RT launch's (`JobView::widest_sms`, rounded up to a group of 8), with at most
//!    the CTAs that fit there now, and only while nothing issued waits to be placed. So no RT
//!    kernel ever waits for a BE block.
//!
//! `+runs` sends BE kernel-level jobs in recorded segments as RT ones go (`Config::run_segment_ns`
//! of kernels replayed as one CUDA graph, a driver call and a record pair per segment instead of
//! per kernel), which a preempt flag cannot stop: no preemption (as `+wait`), and a BE segment
//! running when an RT job arrives runs to its end beside it, its CTAs placed after the RT
//! kernels' (high-priority streams). The trade measured on the GPU: BE throughput against the
//! RT tail (docs/benchmarks.md). `+stopruns` sends them in recorded segments that an RT arrival
//! stops between kernels (the GPU's stop words: each kernel of a replay reads one word before
//! its blocks, the kernel running when it lands may stop part-way and runs again whole, exact
//! because a plan's kernels never read what they write), so BE work keeps the speed of runs and
//! RT work still gets the GPU within about one BE kernel.
//!
//! `+hold=US` (a hold-off): for US µs after a real-time job leaves, no best-effort kernel is
//! issued either, so the next request of a closed-loop or streaming real-time client, which comes
//! back within microseconds, finds no best-effort kernel running to stop and wait for
//! ([`super::Policy::wake_at_ns`] has the dispatcher look again when the hold ends). The cost is
//! at most US µs of best-effort work per real-time request; measured on an H200 (docs/benchmarks.md)
//! `+hold=200` meets the real-time bound on DISB B closed, but on open-loop DISB C and E it costs
//! 9–11 % of the best-effort throughput for no real-time gain, so it is off unless asked for.
//!
//! Otherwise (*normal mode*) BE kernels run concurrently, the least recently served job first,
//! each when it passes the occupancy gate (the best-ranked one that does: no BE job starves
//! behind a larger one). `+stopruns+ungated` issues BE segments without the gate, each job within
//! its issue-ahead window, as a stream per job would: among BE jobs the gate's ordering matters
//! little (all are served in turn), and on an RT arrival the RT CTAs go first from high-priority
//! streams while one raised stop word per job skips all its queued kernels; but more BE kernels
//! are running when the RT job arrives, and each runs to its end. Measured on an H200
//! (docs/benchmarks.md): the gate starves the BE job with the widest kernels (DISB C: vgg19 394
//! req/s against 722 under `streams`, they rarely fit while narrower ones run); without it BE
//! throughput rises from 0.77x to 0.87x `streams`' (C) and 0.75x to 0.84x (E), at an RT mean of
//! 1.09x against 1.04x RT-Only (C) and 1.01x against 1.00x (E). RT launches are never preempted, so
//! they go out as not preemptible and in recorded segments ([`super::Policy::preempts_class`]).
//!
//! **Hopper differences.** REEF kills running kernels with a patched AMD driver and re-runs up to
//! c + 1 idempotent kernels; NVIDIA has no kill, so kairos stops BE launches at a logical-block
//! boundary (the protocol's preempt flag) and resumes exactly, with no kernel run twice. REEF's
//! dynamic kernel padding fuses BE blocks into the RT kernel's launch (one proxy kernel per
//! occupancy level, Rule 1: BE shorter than RT; Rule 2: occupancy); here padding is a separate,
//! masked, preemptible launch on SMs the RT job does not use, so neither rule is needed: the
//! masked launch keeps its own registers and shared memory, and it can outlive the RT kernel
//! without delaying the next one, which never needs those SMs. The reservation is per RT job
//! (its widest launch), coarser than REEF's per kernel; right-sizing each RT kernel (KRISP's
//! `min_sms`) would leave more room.

use super::{Decision, JobView, Policy, View, gated_pick};
use crate::occupancy::GROUP_SMS;
use crate::request::Class;
use kairos_gpu::SmMask;

#[derive(Clone, Copy, Debug)]
pub struct Reef {
    /// Preempt running best-effort launches when a real-time job arrives.
    pub kill: bool,
    /// Issue best-effort kernels on the SMs real-time work leaves while it is admitted.
    pub padding: bool,
    /// Best-effort jobs go in recorded segments like real-time ones: with `kill` (`+stopruns`)
    /// segments that a real-time arrival stops between kernels, without (`+runs`) not
    /// preemptible, so what runs when a real-time job arrives is waited for.
    pub be_runs: bool,
    /// Best-effort work passes the occupancy gate in normal mode (off: `+stopruns+ungated`, see
    /// the module's normal mode).
    pub gate_be: bool,
    /// The hold-off after a real-time job leaves (`+hold=US`; 0: none).
    pub hold_ns: u64,
}

impl Reef {
    /// An RT job's rank among RT jobs, lowest first.
    fn rt_rank(j: &JobView) -> (std::cmp::Reverse<i32>, u64, u64) {
        (std::cmp::Reverse(j.priority), j.deadline_at_ns.unwrap_or(u64::MAX), j.seq)
    }

    /// The first SM that padding may use while these RT jobs are admitted: above the widest
    /// one's SMs, rounded up to a group of [`GROUP_SMS`].
    pub fn padding_first_sm(widest_sms: u32) -> u32 {
        widest_sms.div_ceil(GROUP_SMS) * GROUP_SMS
    }

    /// When the hold-off after the last real-time job ends, if it has not yet (with no real-time
    /// job admitted: while one is, real-time mode rules best-effort work instead).
    fn hold_ends_ns(&self, view: &View<'_>) -> Option<u64> {
        let last = view.last_realtime_done_ns;
        let end = last.saturating_add(self.hold_ns);
        (self.hold_ns > 0 && last > 0 && view.now_ns < end).then_some(end)
    }
}

impl Policy for Reef {
    fn name(&self) -> &'static str {
        "reef"
    }

    /// Best-effort launches are preemptible with and without `kill` (so `+wait` differs from
    /// `reef` only in never stopping them), unless they go in recorded segments that cannot be
    /// stopped (`+runs`); real-time ones never are.
    fn preempts(&self) -> bool {
        !self.be_runs || self.kill
    }

    fn preempts_class(&self, class: Class) -> bool {
        class == Class::BestEffort && self.preempts()
    }

    fn stops_runs(&self, class: Class) -> bool {
        class == Class::BestEffort && self.be_runs && self.kill
    }

    fn holds(&self) -> bool {
        self.hold_ns > 0
    }

    fn wake_at_ns(&self, view: &View<'_>) -> Option<u64> {
        let any_rt = view.jobs.iter().any(|j| j.class == Class::RealTime && !j.cancelled);
        if any_rt { None } else { self.hold_ends_ns(view) }
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let is_rt = |j: &&JobView| j.class == Class::RealTime && !j.cancelled;
        let (mut any_rt, mut newest_rt_admitted_seq, mut widest_sms) = (false, 0, 0);
        for j in view.jobs.iter().filter(is_rt) {
            any_rt = true;
            newest_rt_admitted_seq = newest_rt_admitted_seq.max(j.admitted_issue_seq);
            widest_sms = widest_sms.max(j.widest_sms);
        }
        if !any_rt {
            // The hold-off: best-effort work waits for the next real-time request a while.
            if self.hold_ends_ns(view).is_some() {
                return None;
            }
            let least_recently_served = |j: &JobView| (j.last_issue_seq, j.seq);
            if self.gate_be {
                return gated_pick(view, true, least_recently_served);
            }
            return view
                .jobs
                .iter()
                .filter(|j| j.next_ready.is_some_and(|k| view.gpu.can_issue(&k)))
                .min_by_key(|j| least_recently_served(j))
                .and_then(super::issue);
        }
        // 1. The first RT job without the gate: its launch goes out before the preemptions below
        //    are decided (each costs the dispatcher microseconds; measured on an H200, four of them
        //    delayed an arriving RT job's first launch call by 15 µs at the median), and the raised
        //    stop words reach the GPU with the same poll either way.
        let head = view.jobs.iter().filter(is_rt).min_by_key(|j| Self::rt_rank(j))?;
        if let Some(k) = head.next_ready
            && view.gpu.can_issue(&k)
        {
            return Some(Decision::Issue { job: head.key, launch: k.launch, ctas: None, sm_mask: None });
        }
        // 2. Every BE launch issued before the newest RT job was admitted stops (one decision per
        //    BE job); padding issued since runs on.
        if self.kill
            && let Some(j) = view
                .jobs
                .iter()
                .find(|j| j.class != Class::RealTime && j.running.is_some() && j.running_issue_seq <= newest_rt_admitted_seq)
        {
            return Some(Decision::Preempt { job: j.key, launch: j.running? });
        }
        // 3. The other RT jobs gated, in rank order.
        let next_rt = view
            .jobs
            .iter()
            .filter(is_rt)
            .filter(|j| j.next_ready.is_some_and(|k| view.gpu.can_issue(&k) && view.gpu.fits(&k)))
            .min_by_key(|j| Self::rt_rank(j));
        if let Some(j) = next_rt {
            return super::issue(j);
        }
        // 4. Padding on the SMs above the RT jobs' widest launch.
        let sm_count = view.gpu.occupancy.sm_count();
        let first_sm = Self::padding_first_sm(widest_sms);
        if !self.padding || first_sm >= sm_count || view.gpu.pending_ctas > 0 {
            return None;
        }
        let (j, k, room) = view
            .jobs
            .iter()
            .filter(|j| j.class != Class::RealTime)
            .filter_map(|j| {
                let k = j.next_ready?;
                let room = view.gpu.occupancy.free_ctas_from(k.class, first_sm);
                (room > 0 && view.gpu.can_issue(&k)).then_some((j, k, room))
            })
            .min_by_key(|(j, _, _)| (j.last_issue_seq, j.seq))?;
        let mask = SmMask::range(first_sm, sm_count - first_sm);
        Some(Decision::Issue { job: j.key, launch: k.launch, ctas: Some(room.min(k.ctas)), sm_mask: Some(mask) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hold_off_keeps_best_effort_work_out_until_it_ends() {
        use crate::occupancy::Occupancy;
        use crate::policy::GpuView;
        use kairos_gpu::SmLimits;
        let limits = SmLimits { threads_max: 2048, registers_max: 65536, shared_mem_bytes_max: 233_472, ctas_max: 32 };
        let occupancy = Occupancy::new(132, limits);
        let be = JobView::for_test(0, 100_000, 100_000, None);
        let rt = JobView { class: Class::RealTime, ..be };
        let view = |jobs: &'static [JobView], now_ns: u64, last_realtime_done_ns: u64| -> Option<u64> {
            let gpu = GpuView {
                occupancy: &occupancy,
                pending_ctas: 0,
                headroom_ctas: 0,
                launches_in_flight: 0,
                launches_in_flight_max: 1,
                streams: &[],
                idle_streams: 1,
                idle_realtime_streams: 1,
                group_jobs: &[],
            };
            let v = View { now_ns, last_realtime_done_ns, jobs, tenants: &[], gpu };
            let reef = Reef { kill: true, padding: true, be_runs: false, gate_be: true, hold_ns: 50_000 };
            if reef.hold_ends_ns(&v).is_some() {
                assert_eq!(reef.decide(&v), None, "nothing goes while the hold lasts");
            }
            let plain = Reef { hold_ns: 0, ..reef };
            assert_eq!(plain.wake_at_ns(&v), None);
            assert!(reef.holds() && !plain.holds());
            reef.wake_at_ns(&v)
        };
        let be_only: &'static [JobView] = Box::leak(Box::new([be]));
        let with_rt: &'static [JobView] = Box::leak(Box::new([be, rt]));
        // No real-time job has left yet: nothing to hold.
        assert_eq!(view(be_only, 1_000_000, 0), None);
        // 10 µs after one left: held until 50 µs after it, and the dispatcher is told when.
        assert_eq!(view(be_only, 1_010_000, 1_000_000), Some(1_050_000));
        // From the end of the hold on, nothing is held.
        assert_eq!(view(be_only, 1_050_000, 1_000_000), None);
        // A real-time job admitted: real-time mode decides, not the hold.
        assert_eq!(view(with_rt, 1_010_000, 1_000_000), None);
    }

    #[test]
    fn an_arriving_real_time_job_goes_out_before_the_preemptions_and_padding_since_runs_on() {
        use crate::occupancy::{Occupancy, ResourceClass};
        use crate::policy::{GpuView, JobKey, ReadyKernel};
        use kairos_gpu::SmLimits;
        let limits = SmLimits { threads_max: 2048, registers_max: 65536, shared_mem_bytes_max: 233_472, ctas_max: 32 };
        let occupancy = Occupancy::new(132, limits);
        let ready = ReadyKernel {
            launch: 0,
            first_block: 0,
            blocks_left: 132,
            ctas: 132,
            class: ResourceClass(0),
            est_ns: 10_000,
            behind: false,
            frees_ctas: 0,
            realtime_lane: true,
            right_sms: 132,
            lane_groups: 0,
        };
        let key = |slot| JobKey { slot, generation: 0 };
        // Two best-effort jobs running: one issued (seq 5) before the real-time job was admitted
        // (at issue seq 7), one issued since (seq 9, padding).
        let be_old = JobView { key: key(0), running: Some(3), running_issue_seq: 5, ..JobView::for_test(0, 1, 1, None) };
        let be_padding = JobView { key: key(1), running: Some(2), running_issue_seq: 9, ..be_old };
        let rt = JobView {
            key: key(2),
            class: Class::RealTime,
            admitted_issue_seq: 7,
            next_ready: Some(ready),
            ..JobView::for_test(0, 1, 1, None)
        };
        let decide = |reef: Reef, jobs: &[JobView], idle_realtime_streams: u32| {
            let gpu = GpuView {
                occupancy: &occupancy,
                pending_ctas: 0,
                headroom_ctas: 0,
                launches_in_flight: 0,
                launches_in_flight_max: 16,
                streams: &[],
                idle_streams: 0,
                idle_realtime_streams,
                group_jobs: &[],
            };
            reef.decide(&View { now_ns: 1, last_realtime_done_ns: 0, jobs, tenants: &[], gpu })
        };
        let stopruns = Reef { kill: true, padding: true, be_runs: true, gate_be: true, hold_ns: 0 };
        // The real-time job's launch first, while a high-priority stream is idle.
        let jobs = [be_old, be_padding, rt];
        let issue_rt = Some(Decision::Issue { job: key(2), launch: 0, ctas: None, sm_mask: None });
        assert_eq!(decide(stopruns, &jobs, 1), issue_rt);
        // Then (or without a stream for it) the launch issued before its admission stops, and
        // only that one: the padding issued since runs on.
        let rt_started = JobView { next_ready: None, ..rt };
        let stop_old = Some(Decision::Preempt { job: key(0), launch: 3 });
        assert_eq!(decide(stopruns, &[be_old, be_padding, rt_started], 1), stop_old);
        assert_eq!(decide(stopruns, &jobs, 0), stop_old);
        let be_stopped = JobView { running: None, ..be_old };
        assert_eq!(decide(stopruns, &[be_stopped, be_padding, rt_started], 1), None);
        // Without kill (`+wait`), nothing is preempted.
        let wait = Reef { kill: false, padding: false, be_runs: false, gate_be: true, hold_ns: 0 };
        assert_eq!(decide(wait, &[be_old, be_padding, rt_started], 0), None);
    }

    #[test]
    fn padding_starts_above_the_widest_real_time_launch_on_a_group_boundary() {
        assert_eq!(Reef::padding_first_sm(0), 0);
        assert_eq!(Reef::padding_first_sm(1), 8);
        assert_eq!(Reef::padding_first_sm(64), 64);
        assert_eq!(Reef::padding_first_sm(65), 72);
        assert_eq!(Reef::padding_first_sm(132), 136);
    }
}

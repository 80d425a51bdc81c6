//! `krisp` and `static`: KRISP's kernel-wise right-sizing (HPCA'23, Chow et al.) and the
//! static-partition baseline it is measured against.
//!
//! **Guarantee (`krisp`).** Every kernel goes out on an SM mask of its *right size*
//! ([`ReadyKernel::right_sms`]: the fewest SMs at which `kairos profile` measured it within 5% of
//! its whole-GPU time, KRISP's "minimum CUs"; without a profile, the SMs its grid spreads over),
//! chosen by KRISP's Algorithm 1 over groups of [`GROUP_SMS`] SMs: groups running the fewest
//! other jobs' launches first ([`GpuView::group_jobs`](super::GpuView), KRISP's per-CU kernel
//! counters: a job's launches run one after another on its lane, as a KRISP worker's kernels on
//! its queue), and among equals the groups of its own job's launches in flight (which end before
//! it starts) before others; of the groups so taken, at most `overlap_sms` SMs may already run
//! other jobs' launches. `krisp` (KRISP-I, limit 0) never shares an SM group
//! between two jobs' kernels: a kernel that finds fewer free groups than its size gets the free
//! ones (KRISP: "we allocate only what is available"), none free, it waits; `krisp:inf` (KRISP-O)
//! shares freely; `krisp:N` is the sweep in between. Jobs are offered in round-robin order (least
//! recently served first), the first whose kernel gets a mask goes; there is no occupancy gate
//! (KRISP has none: the hardware queues what does not fit in the mask).
//!
//! **Guarantee (`static:N`).** The GPU is cut into N equal ranges of groups (KRISP's "Static
//! Equal" baseline, one partition per worker). A kernel runs on the whole partition of the
//! launches its job has in flight (its lane), and a job's first kernel (or one after its lane drained)
//! on the partition with the fewest jobs' launches in flight (lowest index among equals), so N
//! closed-loop workers each settle on a partition of their own.
//!
//! **Hopper differences.** KRISP proposes a command-processor change that applies a mask per
//! kernel and emulates it on AMD with per-queue CU masks set between barrier packets (the
//! emulation's cost is subtracted analytically). kairos has per-launch software masks: CTAs that
//! land outside the mask leave at once and the ones inside take the launch's logical blocks, so
//! a right-sized launch costs what a masked protocol launch costs (no barrier, no ioctl), measured
//! as it runs. The unit is a group of 8 SMs (the modelled occupancy map's and the green
//! contexts' granularity; a right size `kairos profile` found to one SM is rounded up to
//! whole groups), not one CU. KRISP places a kernel's CUs "Conserved" over the MI50's 4 shader
//! engines (the fewest engines that hold it, evenly); on an H200 where the SMs lie does not
//! matter: `kairos profile --placements` (GPCs from `CudaGpu::probe_gpcs`) timed every kernel of
//! five models at batch 1 and resnet50 at batch 16 on 8, 16, 32 and 64 SMs placed four ways, and
//! packed, conserved and spread sets summed to within 2.7 % of the first SM ids (docs/benchmarks.md, "Where the SMs lie"), so the
//! policy keeps no GPC map. Its sets are spread anyway: a mask group is 8 consecutive SM ids
//! (2 SMs in each of 4 GPCs), and device groups 0–7 are halves of 8 different GPCs.
//!
//! **`+green` (hardware partitions).** With `krisp+green` or `static+green`
//! ([`PolicyConfig::hardware_masks`](super::PolicyConfig::hardware_masks)) the dispatcher sends a
//! mask as a green context of the device's SM groups it covers (made on first use, kept), where
//! the kernel runs as a light launch on its whole partition. The device's groups are CUDA's split
//! (on an H200: 15 of 8 SMs, each inside one GPC, and one of 12), so map group g names device
//! group g, the map's last two the device's last one; a mask that covers no device group whole
//! keeps the software mask. Measured on an H200 (docs/benchmarks.md, "KRISP on an H200"): a
//! launch that moves its stream to another green context costs ~6 µs of host time (an event
//! recorded and waited for), so `krisp+green`, whose every kernel lands on another set of groups,
//! gains nothing over masks; `static+green`, whose jobs stay on one partition, also goes in
//! segments recorded inside the partition (a CUDA graph captured on a green context's stream runs
//! on its SMs wherever it is replayed) and serves 1.23–1.68x what `static:4` does with masks at
//! four workers.
//!
//! **Right-sized segments (`krisp+runs+green`, `krisp+model+green`).** The Hopper adaptation that
//! keeps graph speed: the unit KRISP right-sizes becomes a job's recorded segment
//! ([`RightSizeUnit`]). A segment's first launch carries the segment's right size (the fewest
//! profiled SMs at which the segment's kernels' summed durations stay within 5% of their sum on
//! the whole GPU, the dispatcher's `segment_right_sms`); the policy places it as it places a
//! kernel, but on one of a few aligned windows of consecutive groups ([`windows`]), and the
//! dispatcher replays the segment as a run recorded inside that window's green context (one
//! recording per slot, segment and window). `+model` makes the job after its first kernel one
//! segment: the per-model right size, the issue's model-level baseline. Summed over a segment the
//! H200's right sizes are large (measured profiles: densenet121@b1's segments 104, 96, 72 and 24
//! SMs, squeezenet1_1 128 at batch 1, 16 and 32, resnet50@b16 104–132): two such windows do not
//! fit side by side, so KRISP-I runs about one worker at a time, and KRISP-O (`krisp:inf`), with
//! overlapping windows, serves 0.97x the best whole-GPU policy at four batch-1 workers (2.28x and
//! 2.50x one worker; docs/benchmarks.md, "KRISP with right-sized recorded segments").

use super::{Decision, JobView, Policy, ReadyKernel, View};
use crate::occupancy::{GROUP_SMS, group_count_of, mask_of_groups};
use kairos_gpu::SmMask;

/// `krisp:inf`: KRISP-O, any overlap.
pub const OVERLAP_ANY: u32 = u32::MAX;

/// `static` without a count: four partitions (KRISP's largest worker count).
pub const STATIC_PARTITIONS_DEFAULT: u32 = 4;

/// What `krisp` right-sizes and places as one unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RightSizeUnit {
    /// Every kernel apart, launch by launch (KRISP).
    Kernel,
    /// Each recorded segment of a job (`krisp+runs+green`, `Config::run_segment_ns`): sized so the
    /// segment's summed profile stays within 5% of its whole-GPU time, replayed inside its partition.
    Segment,
    /// The job after its first kernel as one segment (`krisp+model+green`): the per-model right
    /// size (the model's latency against SMs, summed from its kernels' profiles).
    Model,
}

#[derive(Clone, Copy, Debug)]
pub struct Krisp {
    /// SMs of a kernel's mask that may already run other launches (0: KRISP-I).
    pub overlap_sms: u32,
    /// Place on aligned windows of consecutive groups ([`Krisp::choose_window`]) instead of any
    /// groups: with recorded segments each distinct partition costs a recording per slot and
    /// segment, so the partitions a job can land on are few.
    pub windows: bool,
}

/// SMs of group `g` on a GPU of `sm_count` SMs.
fn group_sms(g: u32, sm_count: u32) -> u32 {
    sm_count.saturating_sub(g * GROUP_SMS).min(GROUP_SMS)
}

impl Krisp {
    /// KRISP's Algorithm 1 over groups: the groups (bits) kernel `k` runs on now, 0 if none.
    /// `jobs[g]`: jobs with a launch in flight on group g.
    pub fn choose_groups(&self, k: &ReadyKernel, jobs: &[u32], sm_count: u32) -> u32 {
        let n = group_count_of(sm_count).min(32).min(jobs.len() as u32);
        if n == 0 {
            return 0;
        }
        let need = k.right_sms.div_ceil(GROUP_SMS).clamp(1, n) as usize;
        let others = |g: u32| jobs[g as usize].saturating_sub((k.lane_groups >> g) & 1);
        // Least loaded first, then the lane's own groups, then by index: one sort key each.
        let mut keys = [0u64; 32];
        for g in 0..n {
            let own = (k.lane_groups >> g) & 1;
            keys[g as usize] = ((others(g) as u64) << 40) | (((1 - own) as u64) << 32) | g as u64;
        }
        let keys = &mut keys[..n as usize];
        keys.sort_unstable();
        let (mut bits, mut overlapped_sms) = (0u32, 0u32);
        for &key in keys.iter().take(need) {
            let g = (key & 0xffff_ffff) as u32;
            if others(g) > 0 {
                overlapped_sms = overlapped_sms.saturating_add(group_sms(g, sm_count));
                if overlapped_sms > self.overlap_sms {
                    // Sorted: every group after this one overlaps too.
                    break;
                }
            }
            bits |= 1 << g;
        }
        bits
    }

    /// Like [`Krisp::choose_groups`], over [`windows`] of the kernel's right size: the admissible
    /// window (at most `overlap_sms` of its SMs running other jobs' launches) with the fewest
    /// other jobs' launches on its groups, among equals one holding all the groups of its job's
    /// launches in flight, then the lowest; 0 if none is admissible.
    pub fn choose_window(&self, k: &ReadyKernel, jobs: &[u32], sm_count: u32) -> u32 {
        let n = group_count_of(sm_count).min(32).min(jobs.len() as u32);
        if n == 0 {
            return 0;
        }
        let need = k.right_sms.div_ceil(GROUP_SMS).clamp(1, n);
        let others = |g: u32| jobs[g as usize].saturating_sub((k.lane_groups >> g) & 1);
        let mut best: Option<(u64, u32)> = None;
        for (i, bits) in windows(need, n, sm_count).enumerate() {
            let (mut load, mut overlapped_sms) = (0u64, 0u32);
            let mut rest = bits;
            while rest != 0 {
                let g = rest.trailing_zeros();
                rest &= rest - 1;
                if others(g) > 0 {
                    load += others(g) as u64;
                    overlapped_sms = overlapped_sms.saturating_add(group_sms(g, sm_count));
                }
            }
            if overlapped_sms > self.overlap_sms {
                continue;
            }
            let own = k.lane_groups != 0 && bits & k.lane_groups == k.lane_groups;
            let key = (load << 40) | ((!own as u64) << 32) | i as u64;
            if best.is_none_or(|(b, _)| key < b) {
                best = Some((key, bits));
            }
        }
        best.map_or(0, |(_, bits)| bits)
    }

    fn choose(&self, k: &ReadyKernel, jobs: &[u32], sm_count: u32) -> u32 {
        if self.windows { self.choose_window(k, jobs, sm_count) } else { self.choose_groups(k, jobs, sm_count) }
    }
}

/// The windows [`Krisp::choose_window`] places a kernel of `need` groups on, over `n` groups of
/// a GPU of `sm_count` SMs: `need` consecutive groups starting at 0, need, 2·need, ... and one
/// ending at the last group; a window that would leave out only a last group smaller than
/// [`GROUP_SMS`] takes it too (it lies in the device's last partition group).
pub fn windows(need: u32, n: u32, sm_count: u32) -> impl Iterator<Item = u32> {
    let need = need.clamp(1, n.max(1));
    let small_last = n > 0 && group_sms(n - 1, sm_count) < GROUP_SMS;
    let tiled = (0..n).step_by(need as usize).filter(move |&s| s + need <= n);
    let last = (n >= need && !(n - need).is_multiple_of(need)).then_some(n - need);
    tiled.chain(last).map(move |start| {
        let end = if small_last && start + need == n - 1 { n } else { start + need };
        groups_below(end) & !groups_below(start)
    })
}

/// The groups (bits) 0..k.
fn groups_below(k: u32) -> u32 {
    if k >= 32 { u32::MAX } else { (1u32 << k) - 1 }
}

/// Jobs with a kernel that can be issued, least recently served first.
fn offered<'a>(view: &'a View<'_>) -> impl Iterator<Item = (&'a JobView, ReadyKernel)> + 'a {
    view.jobs.iter().filter_map(move |j| j.next_ready.filter(|k| view.gpu.can_issue(k)).map(|k| (j, k)))
}

/// The first job (least recently served) for which `choose` finds groups: its issue on them.
fn first_placed(view: &View<'_>, choose: impl Fn(&ReadyKernel) -> u32) -> Option<Decision> {
    let sm_count = view.gpu.occupancy.sm_count();
    let rank = |j: &JobView| (j.last_issue_seq, j.seq);
    let issue = |j: &JobView, k: &ReadyKernel, groups: u32| Decision::Issue {
        job: j.key,
        launch: k.launch,
        ctas: None,
        sm_mask: Some(mask_of_groups(groups, sm_count)),
    };
    // The common case: the first-ranked job's kernel finds room.
    let (head, hk) = offered(view).min_by_key(|(j, _)| rank(j))?;
    let g = choose(&hk);
    if g != 0 {
        return Some(issue(head, &hk, g));
    }
    // Else the best-ranked one that does, in one pass (no allocation, no sort of the jobs).
    let (j, k, g) = offered(view)
        .filter(|(j, _)| j.key != head.key)
        .filter_map(|(j, k)| {
            let g = choose(&k);
            (g != 0).then_some((j, k, g))
        })
        .min_by_key(|(j, _, _)| rank(j))?;
    Some(issue(j, &k, g))
}

impl Policy for Krisp {
    fn name(&self) -> &'static str {
        "krisp"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let sm_count = view.gpu.occupancy.sm_count();
        let jobs = view.gpu.group_jobs;
        // Groups no job uses, and groups one job uses (free to that job's next kernel): with them
        // KRISP-I turns a kernel away in O(1), before any sort, when nothing is free to it.
        let n = group_count_of(sm_count).min(32).min(jobs.len() as u32);
        let bits = |want: u32| (0..n).filter(|&g| jobs[g as usize] == want).fold(0u32, |b, g| b | 1 << g);
        let (free, one) = (bits(0), bits(1));
        first_placed(view, |k| {
            if self.overlap_sms == 0 && free | (k.lane_groups & one) == 0 {
                return 0;
            }
            self.choose(k, jobs, sm_count)
        })
    }
}

#[derive(Clone, Copy, Debug)]
pub struct StaticPartitions {
    pub partitions: u32,
}

impl StaticPartitions {
    /// The groups (bits) of partition `p` of `count` over `n` groups: equal ranges, the first
    /// `n % count` one group larger.
    pub fn partition_groups(p: u32, count: u32, n: u32) -> u32 {
        let count = count.clamp(1, n.max(1));
        let (base, extra) = (n / count, n % count);
        let start = p * base + p.min(extra);
        let len = base + (p < extra) as u32;
        groups_below(start + len) & !groups_below(start)
    }

    /// The partition (groups) kernel `k` runs on.
    pub fn choose_groups(&self, k: &ReadyKernel, jobs: &[u32], sm_count: u32) -> u32 {
        let n = group_count_of(sm_count).min(32).min(jobs.len() as u32);
        let count = self.partitions.clamp(1, n.max(1));
        let parts = (0..count).map(|p| Self::partition_groups(p, count, n));
        if k.lane_groups != 0 {
            let lane = k.lane_groups.trailing_zeros();
            if let Some(g) = parts.clone().find(|g| g & (1 << lane) != 0) {
                return g;
            }
        }
        let load = |g: u32| (0..n).filter(|&i| g & (1 << i) != 0).map(|i| jobs[i as usize]).sum::<u32>();
        parts.min_by_key(|&g| load(g)).unwrap_or(0)
    }
}

impl Policy for StaticPartitions {
    fn name(&self) -> &'static str {
        "static"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        let sm_count = view.gpu.occupancy.sm_count();
        first_placed(view, |k| self.choose_groups(k, view.gpu.group_jobs, sm_count))
    }
}

/// Whether `mask` is a union of whole groups of SMs (for tests and checks).
pub fn is_group_union(mask: &SmMask, sm_count: u32) -> bool {
    *mask == mask_of_groups(crate::occupancy::groups_of(mask), sm_count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::occupancy::ResourceClass;

    fn kernel(right_sms: u32, lane_groups: u32) -> ReadyKernel {
        ReadyKernel {
            launch: 0,
            first_block: 0,
            blocks_left: 100,
            ctas: 100,
            class: ResourceClass(0),
            est_ns: 1000,
            behind: lane_groups != 0,
            frees_ctas: 0,
            realtime_lane: false,
            right_sms,
            lane_groups,
        }
    }

    #[test]
    fn krisp_i_takes_free_groups_only_and_krisp_o_the_least_loaded() {
        // 132 SMs: 17 groups (the last one of 4 SMs). Groups 0..4 busy with one launch each.
        let mut launches = vec![0u32; 17];
        launches[..4].iter_mut().for_each(|l| *l = 1);
        let isolated = Krisp { overlap_sms: 0, windows: false };
        // 24 SMs = 3 groups, all free: groups 4, 5, 6.
        assert_eq!(isolated.choose_groups(&kernel(24, 0), &launches, 132), 0b111 << 4);
        // The whole GPU asked: only the 13 free groups.
        assert_eq!(isolated.choose_groups(&kernel(132, 0), &launches, 132), ((1 << 17) - 1) & !0b1111);
        // Everything busy: nothing under KRISP-I, the least loaded under KRISP-O.
        let mut busy = vec![2u32; 17];
        busy[9] = 1;
        assert_eq!(isolated.choose_groups(&kernel(8, 0), &busy, 132), 0);
        assert_eq!(Krisp { overlap_sms: OVERLAP_ANY, windows: false }.choose_groups(&kernel(8, 0), &busy, 132), 1 << 9);
        // The sweep between: 16 SMs of overlap allowed, two groups of it.
        let mut half = vec![1u32; 17];
        half[0] = 0;
        assert_eq!(Krisp { overlap_sms: 16, windows: false }.choose_groups(&kernel(40, 0), &half, 132).count_ones(), 3);
    }

    #[test]
    fn windows_tile_the_groups_and_take_a_small_last_group() {
        // 132 SMs: 17 groups, the last of 4 SMs.
        let w: Vec<u32> = windows(6, 17, 132).collect();
        // 0..6, 6..12, and one ending at the last group (11..17).
        assert_eq!(w, vec![0b111111, 0b111111 << 6, 0b111111 << 11]);
        // A window that would leave out only the small last group takes it.
        let w: Vec<u32> = windows(8, 17, 132).collect();
        assert_eq!(w, vec![0xff, 0x1ff << 8, 0xff << 9]);
        // 128 SMs: 16 whole groups, no extension.
        assert_eq!(windows(8, 16, 128).collect::<Vec<_>>(), vec![0xff, 0xff << 8]);
        // The whole GPU and a single group.
        assert_eq!(windows(17, 17, 132).collect::<Vec<_>>(), vec![(1 << 17) - 1]);
        assert_eq!(windows(1, 17, 132).count(), 17);
    }

    #[test]
    fn window_choice_is_least_loaded_sticky_and_respects_the_overlap_limit() {
        let isolated = Krisp { overlap_sms: 0, windows: true };
        let open = Krisp { overlap_sms: OVERLAP_ANY, windows: true };
        let mut jobs = vec![0u32; 17];
        // 48 SMs: 6 groups; all free: the first window.
        assert_eq!(isolated.choose_window(&kernel(48, 0), &jobs, 132), 0b111111);
        // Groups 0..6 taken by another job: the next window.
        jobs[..6].iter_mut().for_each(|j| *j = 1);
        assert_eq!(isolated.choose_window(&kernel(48, 0), &jobs, 132), 0b111111 << 6);
        // That job's own next segment stays on its window (its launches end before it starts).
        assert_eq!(isolated.choose_window(&kernel(48, 0b111111), &jobs, 132), 0b111111);
        // Every window overlaps another job: KRISP-I waits, KRISP-O takes the least loaded.
        jobs.iter_mut().for_each(|j| *j = 2);
        jobs[11..].iter_mut().for_each(|j| *j = 1);
        assert_eq!(isolated.choose_window(&kernel(48, 0), &jobs, 132), 0);
        assert_eq!(open.choose_window(&kernel(48, 0), &jobs, 132), 0b111111 << 11);
        // Through `decide`'s path the placement is a window, never a scatter of groups.
        assert!(windows(6, 17, 132).any(|w| w == isolated.choose(&kernel(44, 0), &[0; 17], 132)));
    }

    #[test]
    fn a_kernel_behind_its_lane_reuses_the_lanes_groups() {
        // Groups 2 and 3 run this job's previous launch, which ends before this one starts.
        let mut launches = vec![0u32; 17];
        launches[2] = 1;
        launches[3] = 1;
        let k = Krisp { overlap_sms: 0, windows: false };
        assert_eq!(k.choose_groups(&kernel(16, 0b1100), &launches, 132), 0b1100);
        // A larger kernel keeps them and adds free ones.
        let g = k.choose_groups(&kernel(32, 0b1100), &launches, 132);
        assert_eq!(g & 0b1100, 0b1100);
        assert_eq!(g.count_ones(), 4);
    }

    #[test]
    fn static_partitions_are_equal_disjoint_and_sticky() {
        let n = 17;
        let parts: Vec<u32> = (0..4).map(|p| StaticPartitions::partition_groups(p, 4, n)).collect();
        assert_eq!(parts.iter().map(|g| g.count_ones()).collect::<Vec<_>>(), vec![5, 4, 4, 4]);
        assert_eq!(parts.iter().fold(0, |a, g| a | g), (1 << 17) - 1);
        assert!(parts.iter().enumerate().all(|(i, a)| parts.iter().skip(i + 1).all(|b| a & b == 0)));
        let s = StaticPartitions { partitions: 4 };
        let mut launches = vec![0u32; 17];
        // Partition 0 busy: a new job goes to partition 1.
        (0..5).for_each(|g| launches[g] = 1);
        assert_eq!(s.choose_groups(&kernel(132, 0), &launches, 132), parts[1]);
        // A job behind its lane in partition 0 stays there.
        assert_eq!(s.choose_groups(&kernel(8, 1 << 2), &launches, 132), parts[0]);
        assert!(is_group_union(&mask_of_groups(parts[3], 132), 132));
    }
}

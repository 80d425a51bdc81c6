//! Occupancy accounting per SM, mirrored from the GPU's placement and completion events.
//!
//! Every kernel of a loaded model is interned into a resource class (threads, registers and
//! shared memory per CTA, CTAs per SM). A `CtasPlaced` event adds that class's per-CTA needs to
//! the SM it names, `CtasFinished` takes them off again, so at any time the dispatcher knows what
//! each SM has left and how many more CTAs of a given class fit on the GPU ([`Occupancy::free_ctas`]).
//! That count is what occupancy-gated policies compare against before they issue a kernel.
//!
//! The accounting believes the GPU: an event that would take an SM over its limits, or below
//! zero, is applied (clamped at zero) and counted as an anomaly, because it means the resource
//! metadata or the notifications are off, which tests must catch and production must survive.
//!
//! Launches that report only their start (one record, not one per SM: what kernel-by-kernel
//! dispatch uses by default) enter the map as a *model* of where the hardware put their CTAs. A
//! map made with [`Occupancy::modelled`] keeps its use per *group* of SMs (8 consecutive SMs, the
//! H100's partition granularity) rather than per SM: [`Occupancy::place_model`] spreads a launch's
//! CTAs evenly over the SMs of its mask (as the hardware's distributor spreads a grid, breadth
//! first), and [`Occupancy::free_ctas`] packs each group as one SM of eight times the resources.
//! Both are O(groups), a few hundred nanoseconds, where a per-SM model cost microseconds per launch
//! on the dispatcher thread (measured on an H100 host). The model is right in what the gate reads
//! (how many more CTAs of a class fit) as long as the hardware spreads grids evenly; it does not
//! see fragmentation within a group.

use crate::CLASSES_MAX;
use kairos_gpu::{KernelResources, SmLimits};
use std::cell::Cell;

/// Index of an interned [`KernelResources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceClass(pub u16);

/// What one SM has in use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmUse {
    pub threads: u32,
    pub registers: u32,
    pub shared_mem_bytes: u32,
    pub ctas: u32,
}

#[derive(Clone, Copy, Debug)]
struct ClassInfo {
    res: KernelResources,
    /// Per-CTA needs, with the register file's allocation granularity applied.
    need: SmUse,
}

/// Use of a group of SMs, summed over them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupUse {
    pub threads: u64,
    pub registers: u64,
    pub shared_mem_bytes: u64,
    pub ctas: u64,
}

/// SMs per group of a modelled map.
pub const GROUP_SMS: u32 = 8;
// A group never straddles two words of an SmMask (place_model reads it from one).
const _: () = assert!(64 % GROUP_SMS == 0);

/// Groups of [`GROUP_SMS`] SMs on a GPU of `sm_count` SMs (at most 32: `SM_COUNT_MAX` / 8).
pub fn group_count_of(sm_count: u32) -> u32 {
    sm_count.div_ceil(GROUP_SMS)
}

/// The groups a mask touches, as bits (bit g: group g has an SM in the mask).
pub fn groups_of(mask: &kairos_gpu::SmMask) -> u32 {
    let mut bits = 0u32;
    for (w, &word) in mask.0.iter().enumerate() {
        for k in 0..(64 / GROUP_SMS) {
            if (word >> (k * GROUP_SMS)) & ((1u64 << GROUP_SMS) - 1) != 0 {
                bits |= 1 << (w as u32 * (64 / GROUP_SMS) + k);
            }
        }
    }
    bits
}

/// The SMs of the groups in `groups` (bits as [`groups_of`] writes them) on a GPU of `sm_count` SMs.
pub fn mask_of_groups(groups: u32, sm_count: u32) -> kairos_gpu::SmMask {
    let mut m = kairos_gpu::SmMask::EMPTY;
    let per_word = 64 / GROUP_SMS;
    for g in 0..group_count_of(sm_count).min(32) {
        if groups & (1 << g) != 0 {
            let width = (sm_count - g * GROUP_SMS).min(GROUP_SMS);
            m.0[(g / per_word) as usize] |= ((1u64 << width) - 1) << ((g % per_word) * GROUP_SMS);
        }
    }
    m
}

#[derive(Debug)]
pub struct Occupancy {
    limits: SmLimits,
    sms: Vec<SmUse>,
    /// Modelled maps: use per group of `GROUP_SMS` SMs (empty for an exact, per-SM map).
    groups: Vec<GroupUse>,
    classes: Vec<ClassInfo>,
    /// free_ctas per class, valid while its epoch equals `epoch`.
    cache: Vec<Cell<(u64, u32)>>,
    epoch: u64,
    anomalies: u64,
}

impl Occupancy {
    pub fn new(sm_count: u32, limits: SmLimits) -> Occupancy {
        Occupancy {
            limits,
            sms: vec![SmUse::default(); sm_count as usize],
            groups: Vec::new(),
            classes: Vec::new(),
            cache: Vec::new(),
            epoch: 1,
            anomalies: 0,
        }
    }

    /// A map kept per group of [`GROUP_SMS`] SMs, for modelled placements (see the module docs).
    /// Reported placements (`place`, `finish`) go to their SM's group.
    pub fn modelled(sm_count: u32, limits: SmLimits) -> Occupancy {
        let mut o = Occupancy::new(sm_count, limits);
        o.groups = vec![GroupUse::default(); sm_count.div_ceil(GROUP_SMS) as usize];
        o
    }

    pub fn is_modelled(&self) -> bool {
        !self.groups.is_empty()
    }

    /// SMs of group `g`.
    fn group_sms(&self, g: usize) -> u32 {
        (self.sms.len() as u32 - g as u32 * GROUP_SMS).min(GROUP_SMS)
    }

    /// CTAs of `class` that fit in group `g`, packing it as one SM of its SMs' summed resources.
    fn group_fit(&self, g: usize, c: &ClassInfo) -> u64 {
        let n = self.group_sms(g) as u64;
        let l = &self.limits;
        let u = &self.groups[g];
        let by = |max: u32, used: u64, need: u32| {
            if need == 0 { u64::MAX } else { (n * max as u64).saturating_sub(used) / need as u64 }
        };
        by(l.threads_max, u.threads, c.need.threads)
            .min(by(l.registers_max, u.registers, c.need.registers))
            .min(by(l.shared_mem_bytes_max, u.shared_mem_bytes, c.need.shared_mem_bytes))
            .min((n * l.ctas_max as u64).saturating_sub(u.ctas))
            .min(n * c.res.ctas_per_sm_max as u64)
    }

    fn group_add(&mut self, g: usize, c: &ClassInfo, ctas: u32, sign: i64) {
        let u = &mut self.groups[g];
        let d = |x: u64, need: u32| {
            let delta = need as u64 * ctas as u64;
            if sign > 0 { x + delta } else { x.saturating_sub(delta) }
        };
        u.threads = d(u.threads, c.need.threads);
        u.registers = d(u.registers, c.need.registers);
        u.shared_mem_bytes = d(u.shared_mem_bytes, c.need.shared_mem_bytes);
        u.ctas = d(u.ctas, 1);
    }

    /// Models the start of `ctas` CTAs of `class` on the SMs of `mask` (modelled maps): spread
    /// evenly over its SMs, group by group in proportion to the group's SMs in the mask, the
    /// remainder one CTA at a time from group `cursor` on. Appends (group, CTAs) to `out`. The
    /// model takes every CTA, room or not: CTAs beyond the room are what waits in the hardware,
    /// and the map reads full (no more CTAs fit) until they leave.
    pub fn place_model(
        &mut self,
        class: ResourceClass,
        ctas: u32,
        mask: &kairos_gpu::SmMask,
        cursor: u32,
        out: &mut Vec<(u32, u32)>,
    ) {
        debug_assert!(self.is_modelled(), "place_model on a per-SM map");
        let c = self.classes[class.0 as usize];
        let n = self.groups.len();
        if ctas == 0 || n == 0 {
            return;
        }
        let start = out.len();
        // SMs of the mask per group: a group is GROUP_SMS (8) consecutive bits of one mask word.
        let sm_count = self.sms.len();
        let sizes: [u64; 32] = std::array::from_fn(|g| {
            if g >= n {
                return 0;
            }
            let first = g * GROUP_SMS as usize;
            let width = (sm_count - first).min(GROUP_SMS as usize);
            let bits = (mask.0[first / 64] >> (first % 64)) & ((1u64 << width) - 1);
            bits.count_ones() as u64
        });
        let total: u64 = sizes.iter().sum();
        if total == 0 {
            self.anomalies += 1;
            return;
        }
        // A group's share depends only on its size (0..=GROUP_SMS SMs): one division per size.
        let by_size: [u64; GROUP_SMS as usize + 1] = std::array::from_fn(|k| ctas as u64 * k as u64 / total);
        let mut left = ctas as u64;
        let mut share = [0u64; 32];
        for g in 0..n.min(32) {
            share[g] = by_size[sizes[g] as usize];
            left -= share[g];
        }
        for k in 0..n {
            if left == 0 {
                break;
            }
            let g = (cursor as usize + k) % n;
            if g < 32 && sizes[g] > 0 {
                share[g] += 1;
                left -= 1;
            }
        }
        for (g, &s) in share.iter().enumerate().take(n.min(32)) {
            if s > 0 {
                self.group_add(g, &c, s as u32, 1);
                out.push((g as u32, s as u32));
            }
        }
        if out.len() == start {
            self.anomalies += 1;
        }
        self.epoch += 1;
    }

    /// Takes modelled placements (from [`Occupancy::place_model`]) off again.
    pub fn remove_model(&mut self, class: ResourceClass, placements: &[(u32, u32)]) {
        let c = self.classes[class.0 as usize];
        for &(g, n) in placements {
            let Some(u) = self.groups.get(g as usize) else {
                self.anomalies += 1;
                continue;
            };
            if u.ctas < n as u64 {
                self.anomalies += 1;
            }
            self.group_add(g as usize, &c, n, -1);
        }
        self.epoch += 1;
    }

    /// Use of group `g` of a modelled map.
    pub fn group(&self, g: u32) -> GroupUse {
        self.groups[g as usize]
    }

    pub fn group_count(&self) -> u32 {
        self.groups.len() as u32
    }

    pub fn sm_count(&self) -> u32 {
        self.sms.len() as u32
    }

    pub fn limits(&self) -> &SmLimits {
        &self.limits
    }

    /// The class of a kernel's resources, adding it on first sight. `None` when the class table
    /// is full ([`CLASSES_MAX`]) or the kernel cannot fit on an SM at all.
    pub fn intern(&mut self, res: KernelResources) -> Option<ResourceClass> {
        if let Some(i) = self.classes.iter().position(|c| c.res == res) {
            return Some(ResourceClass(i as u16));
        }
        if self.classes.len() >= CLASSES_MAX || res.ctas_per_sm_max == 0 || res.threads_per_cta == 0 {
            return None;
        }
        let need = SmUse {
            threads: res.threads_per_cta,
            registers: (res.registers_per_thread.max(1) * res.threads_per_cta).next_multiple_of(256),
            shared_mem_bytes: res.shared_mem_bytes,
            ctas: 1,
        };
        if need.threads > self.limits.threads_max
            || need.registers > self.limits.registers_max
            || need.shared_mem_bytes > self.limits.shared_mem_bytes_max
        {
            return None;
        }
        self.classes.push(ClassInfo { res, need });
        self.cache.push(Cell::new((0, 0)));
        Some(ResourceClass((self.classes.len() - 1) as u16))
    }

    pub fn resources(&self, class: ResourceClass) -> &KernelResources {
        &self.classes[class.0 as usize].res
    }

    /// CTAs of `class` that fit on an idle SM.
    pub fn ctas_per_sm(&self, class: ResourceClass) -> u32 {
        self.fit(&SmUse::default(), &self.classes[class.0 as usize])
    }

    /// CTAs of `class` that fit on the idle GPU: one full wave.
    pub fn capacity_ctas(&self, class: ResourceClass) -> u32 {
        self.ctas_per_sm(class) * self.sm_count()
    }

    fn fit(&self, used: &SmUse, c: &ClassInfo) -> u32 {
        let l = &self.limits;
        let by_threads = l.threads_max.saturating_sub(used.threads) / c.need.threads;
        let by_regs = l.registers_max.saturating_sub(used.registers) / c.need.registers.max(1);
        let by_smem =
            l.shared_mem_bytes_max.saturating_sub(used.shared_mem_bytes).checked_div(c.need.shared_mem_bytes).unwrap_or(u32::MAX);
        let by_ctas = l.ctas_max.saturating_sub(used.ctas);
        by_threads.min(by_regs).min(by_smem).min(by_ctas).min(c.res.ctas_per_sm_max)
    }

    /// CTAs of `class` that could be placed right now, summed over SMs. Cached until the next
    /// placement or completion, so asking for many kernels of one class costs one pass over SMs.
    pub fn free_ctas(&self, class: ResourceClass) -> u32 {
        let cell = &self.cache[class.0 as usize];
        let (epoch, free) = cell.get();
        if epoch == self.epoch {
            return free;
        }
        let c = &self.classes[class.0 as usize];
        let free = if self.is_modelled() {
            (0..self.groups.len()).map(|g| self.group_fit(g, c)).sum::<u64>().min(u32::MAX as u64) as u32
        } else {
            self.sms.iter().map(|u| self.fit(u, c)).sum()
        };
        cell.set((self.epoch, free));
        free
    }

    /// CTAs of `class` that could be placed right now on SMs `first_sm..` (for a modelled map,
    /// whole groups from the one holding `first_sm`). Not cached: one pass over those SMs.
    pub fn free_ctas_from(&self, class: ResourceClass, first_sm: u32) -> u32 {
        let c = &self.classes[class.0 as usize];
        if self.is_modelled() {
            let g0 = (first_sm / GROUP_SMS) as usize;
            (g0..self.groups.len()).map(|g| self.group_fit(g, c)).sum::<u64>().min(u32::MAX as u64) as u32
        } else {
            self.sms.iter().skip(first_sm as usize).map(|u| self.fit(u, c)).sum()
        }
    }

    /// `ctas` CTAs of `class` started on `sm`.
    pub fn place(&mut self, sm: u32, class: ResourceClass, ctas: u32) {
        let Some(u) = self.sms.get_mut(sm as usize) else {
            self.anomalies += 1;
            return;
        };
        let need = self.classes[class.0 as usize].need;
        u.threads += need.threads * ctas;
        u.registers += need.registers * ctas;
        u.shared_mem_bytes += need.shared_mem_bytes * ctas;
        u.ctas += ctas;
        let u = *u;
        if self.is_modelled() {
            let c = self.classes[class.0 as usize];
            self.group_add((sm / GROUP_SMS) as usize, &c, ctas, 1);
        }
        let l = &self.limits;
        if u.threads > l.threads_max
            || u.registers > l.registers_max
            || u.shared_mem_bytes > l.shared_mem_bytes_max
            || u.ctas > l.ctas_max
        {
            self.anomalies += 1;
        }
        self.epoch += 1;
    }

    /// `ctas` CTAs of `class` left `sm`.
    pub fn finish(&mut self, sm: u32, class: ResourceClass, ctas: u32) {
        let Some(u) = self.sms.get_mut(sm as usize) else {
            self.anomalies += 1;
            return;
        };
        let need = self.classes[class.0 as usize].need;
        let before = *u;
        u.threads = u.threads.saturating_sub(need.threads * ctas);
        u.registers = u.registers.saturating_sub(need.registers * ctas);
        u.shared_mem_bytes = u.shared_mem_bytes.saturating_sub(need.shared_mem_bytes * ctas);
        u.ctas = u.ctas.saturating_sub(ctas);
        if before.ctas < ctas || before.threads < need.threads * ctas {
            self.anomalies += 1;
        }
        if self.is_modelled() {
            let c = self.classes[class.0 as usize];
            self.group_add((sm / GROUP_SMS) as usize, &c, ctas, -1);
        }
        self.epoch += 1;
    }

    pub fn sm(&self, sm: u32) -> SmUse {
        self.sms[sm as usize]
    }

    /// Whether every SM (and, modelled, every group) is idle by this accounting.
    pub fn is_idle(&self) -> bool {
        self.sms.iter().all(|u| *u == SmUse::default()) && self.groups.iter().all(|g| *g == GroupUse::default())
    }

    /// Forgets all use: called when the dispatcher knows nothing runs (no launch in flight), which
    /// heals the accounting after lost notifications. Counts an anomaly if anything was left.
    pub fn resync_idle(&mut self) {
        if !self.is_idle() {
            self.anomalies += 1;
            self.sms.iter_mut().for_each(|u| *u = SmUse::default());
            self.groups.iter_mut().for_each(|u| *u = GroupUse::default());
            self.epoch += 1;
        }
    }

    /// Events that disagreed with the limits or with earlier events.
    pub fn anomalies(&self) -> u64 {
        self.anomalies
    }

    /// Whether any SM is over a limit now.
    pub fn over_limits(&self) -> bool {
        let l = &self.limits;
        self.sms.iter().any(|u| {
            u.threads > l.threads_max
                || u.registers > l.registers_max
                || u.shared_mem_bytes > l.shared_mem_bytes_max
                || u.ctas > l.ctas_max
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_masks_round_trip() {
        // 132 SMs: 17 groups, the last one of 4 SMs.
        assert_eq!(group_count_of(132), 17);
        let all = mask_of_groups(u32::MAX, 132);
        assert_eq!(all, kairos_gpu::SmMask::first(132));
        assert_eq!(groups_of(&all), (1 << 17) - 1);
        let some = mask_of_groups(0b1000_0000_0000_0101, 132);
        assert_eq!(some.iter().collect::<Vec<_>>(), (0..8).chain(16..24).chain(120..128).collect::<Vec<_>>());
        assert_eq!(groups_of(&some), 0b1000_0000_0000_0101);
        assert_eq!(groups_of(&kairos_gpu::SmMask::range(7, 2)), 0b11);
        assert_eq!(mask_of_groups(1 << 16, 132).count(), 4);
    }

    fn limits() -> SmLimits {
        SmLimits { threads_max: 2048, registers_max: 65536, shared_mem_bytes_max: 228 * 1024, ctas_max: 32 }
    }

    fn res(threads: u32, regs: u32, smem: u32) -> KernelResources {
        KernelResources {
            threads_per_cta: threads,
            registers_per_thread: regs,
            shared_mem_bytes: smem,
            ctas_per_sm_max: KernelResources::occupancy(threads, regs, smem, &limits()),
        }
    }

    #[test]
    fn free_ctas_follows_placements() {
        let mut o = Occupancy::new(4, limits());
        let small = o.intern(res(128, 32, 0)).unwrap();
        let big = o.intern(res(1024, 32, 100 * 1024)).unwrap();
        assert_eq!(o.intern(res(128, 32, 0)), Some(small));
        assert_eq!(o.ctas_per_sm(small), 16);
        assert_eq!(o.ctas_per_sm(big), 2);
        assert_eq!(o.free_ctas(small), 64);
        o.place(0, big, 1);
        // SM 0 has 1024 threads and 128 KiB left: 8 small CTAs, 1 big one.
        assert_eq!(o.free_ctas(small), 8 + 48);
        assert_eq!(o.free_ctas(big), 1 + 6);
        o.place(0, big, 1);
        assert_eq!(o.free_ctas(big), 6);
        assert_eq!(o.free_ctas(small), 48);
        o.finish(0, big, 2);
        assert!(o.is_idle());
        assert_eq!(o.free_ctas(small), 64);
        assert_eq!(o.anomalies(), 0);
    }

    #[test]
    fn impossible_events_are_counted_not_fatal() {
        let mut o = Occupancy::new(2, limits());
        let c = o.intern(res(1024, 32, 0)).unwrap();
        o.place(1, c, 3);
        assert!(o.over_limits());
        assert_eq!(o.anomalies(), 1);
        o.finish(1, c, 5);
        assert_eq!(o.anomalies(), 2);
        assert!(o.is_idle());
        o.place(9, c, 1);
        assert_eq!(o.anomalies(), 3);
        o.place(0, c, 1);
        o.resync_idle();
        assert!(o.is_idle());
        assert_eq!(o.anomalies(), 4);
    }

    #[test]
    fn modelled_placement_spreads_evenly_over_groups_and_masks() {
        // 20 SMs: groups of 8, 8 and 4.
        let mut o = Occupancy::modelled(20, limits());
        let small = o.intern(res(128, 32, 0)).unwrap();
        let big = o.intern(res(1024, 32, 100 * 1024)).unwrap();
        assert_eq!(o.group_count(), 3);
        assert_eq!(o.free_ctas(small), 20 * 16);
        let all = kairos_gpu::SmMask::first(20);
        let mut out = Vec::new();
        // 21 CTAs over 20 SMs: 8, 8, 4 by size, the one left over to the cursor's group.
        o.place_model(small, 21, &all, 1, &mut out);
        assert_eq!(out, vec![(0, 8), (1, 9), (2, 4)]);
        assert_eq!(o.free_ctas(small), 20 * 16 - 21);
        // The groups pack as one SM of 8 (or 4) times the resources: 8 SMs hold 16 big CTAs,
        // less what 8 or 9 small ones (1024-1152 threads) take.
        assert_eq!(o.free_ctas(big), 15 + 14 + 7);
        // Past the room, the model takes the CTAs and reads full.
        out.clear();
        o.place_model(big, 100, &all, 0, &mut out);
        assert_eq!(o.free_ctas(big), 0);
        assert_eq!(o.free_ctas(small), 0);
        o.remove_model(big, &out);
        o.remove_model(small, &[(0, 8), (1, 9), (2, 4)]);
        assert!(o.is_idle());
        // A mask confines the model to its groups.
        out.clear();
        o.place_model(small, 40, &kairos_gpu::SmMask::range(16, 4), 0, &mut out);
        assert_eq!(out, vec![(2, 40)]);
        assert_eq!(o.free_ctas(small), 16 * 16 + 4 * 16 - 40);
        o.remove_model(small, &out);
        // Reported placements land in their SM's group.
        o.place(9, small, 3);
        assert_eq!(o.group(1).ctas, 3);
        o.finish(9, small, 3);
        assert!(o.is_idle());
        assert_eq!(o.anomalies(), 0);
    }

    #[test]
    fn kernels_that_cannot_fit_are_refused() {
        let mut o = Occupancy::new(2, limits());
        assert!(o.intern(res(4096, 32, 0)).is_none());
        assert!(o.intern(KernelResources { ctas_per_sm_max: 0, ..res(128, 32, 0) }).is_none());
    }
}

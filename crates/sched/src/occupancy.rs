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

#[derive(Debug)]
pub struct Occupancy {
    limits: SmLimits,
    sms: Vec<SmUse>,
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
            classes: Vec::new(),
            cache: Vec::new(),
            epoch: 1,
            anomalies: 0,
        }
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
        let free = self.sms.iter().map(|u| self.fit(u, c)).sum();
        cell.set((self.epoch, free));
        free
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
        self.epoch += 1;
    }

    pub fn sm(&self, sm: u32) -> SmUse {
        self.sms[sm as usize]
    }

    /// Whether every SM is idle by this accounting.
    pub fn is_idle(&self) -> bool {
        self.sms.iter().all(|u| *u == SmUse::default())
    }

    /// Forgets all use: called when the dispatcher knows nothing runs (no launch in flight), which
    /// heals the accounting after lost notifications. Counts an anomaly if anything was left.
    pub fn resync_idle(&mut self) {
        if !self.is_idle() {
            self.anomalies += 1;
            self.sms.iter_mut().for_each(|u| *u = SmUse::default());
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
    fn kernels_that_cannot_fit_are_refused() {
        let mut o = Occupancy::new(2, limits());
        assert!(o.intern(res(4096, 32, 0)).is_none());
        assert!(o.intern(KernelResources { ctas_per_sm_max: 0, ..res(128, 32, 0) }).is_none());
    }
}

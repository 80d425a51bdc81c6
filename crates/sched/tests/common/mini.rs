//! MiniGpu: a small discrete-event GPU in virtual time, independent of kairos-sim, so the
//! dispatcher's tests check it against two GPU models. SMs with per-SM limits; streams mapped onto
//! a few hardware queues served in FIFO order (a launch starts when it heads its stream and its
//! queue, a queue moves on once its head has placed every CTA); persistent CTAs taking logical
//! blocks from a counter and stopping at the preempt flag; notifications after a delay with
//! optional jitter (never reordered). No computation: reads return zeros.

#![allow(dead_code)]

use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::collections::{BTreeMap, HashMap, VecDeque};

#[derive(Clone, Debug)]
pub struct MiniConfig {
    pub sm_count: u32,
    pub limits: SmLimits,
    pub hardware_queues: u32,
    pub launch_latency_ns: u64,
    pub notify_delay_ns: u64,
    pub notify_jitter_ns: u64,
    /// Duration of one logical block of a kernel.
    pub block_ns: fn(&Kernel, &LaunchShape) -> u64,
    pub seed: u64,
    /// Launches tracked at once (0: unbounded); one more is `GpuError::Exhausted`, as CUDA's
    /// launch slots.
    pub launches_in_flight_max: u32,
    /// Fault injection: one launch end in this many is lost and reported as `LaunchLost` (as the
    /// CUDA backend does after its notification ring overflowed); 0: never.
    pub lose_one_in: u32,
}

pub fn default_block_ns(k: &Kernel, s: &LaunchShape) -> u64 {
    // 2 us plus a share of the kernel's work at ~10 GFLOP/s per block.
    2_000 + k.flops() / s.logical_blocks.max(1) as u64 / 10
}

impl Default for MiniConfig {
    fn default() -> Self {
        MiniConfig {
            sm_count: 8,
            limits: SmLimits { threads_max: 2048, registers_max: 65536, shared_mem_bytes_max: 228 * 1024, ctas_max: 32 },
            hardware_queues: 8,
            launch_latency_ns: 3_000,
            notify_delay_ns: 2_000,
            notify_jitter_ns: 0,
            block_ns: default_block_ns,
            seed: 0,
            launches_in_flight_max: 0,
            lose_one_in: 0,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Eligible(u64),
    CtaStep { launch: u64, sm: u32, blocks: u32 },
    Notify(GpuEvent),
}

struct L {
    stream: usize,
    queue: usize,
    res: KernelResources,
    total: u32,
    next_block: u32,
    to_place: u32,
    live: u32,
    preempt: bool,
    block_ns: u64,
    mask: SmMask,
    scheduled: bool,
    eligible: bool,
    /// LaunchRequest::report_ctas: CtasPlaced / CtasFinished are sent.
    report_ctas: bool,
    /// LaunchRequest::report_start: LaunchStarted is sent when the first block is taken.
    report_start: bool,
    first_block: u32,
}

pub struct MiniGpu {
    info: DeviceInfo,
    cfg: MiniConfig,
    now: u64,
    seq: u64,
    last_notify: u64,
    future: BTreeMap<(u64, u64), Ev>,
    ready: VecDeque<GpuEvent>,
    launches: HashMap<u64, L>,
    streams: Vec<VecDeque<u64>>,
    queues: Vec<VecDeque<u64>>,
    active: Vec<u64>,
    sms: Vec<[u32; 4]>,
    next_launch: u64,
    next_ptr: u64,
    rng: SmallRng,
    need_place: bool,
    pub launches_total: u64,
}

impl MiniGpu {
    pub fn new(cfg: MiniConfig) -> MiniGpu {
        let info = DeviceInfo {
            name: "mini".into(),
            arch: "sm_90".into(),
            sm_count: cfg.sm_count,
            sm_limits: cfg.limits,
            memory_bytes: 1 << 40,
            partitions: vec![Partition { id: PartitionId::WHOLE, sms: SmMask::first(cfg.sm_count) }],
            partition_granularity_sms: 1,
            hardware_queues: cfg.hardware_queues,
            h2d_bytes_per_s: 50e9,
            d2h_bytes_per_s: 50e9,
            device_mem_bytes_per_s: 3e12,
            host_mapped_read_bytes_per_s: 50e9,
            launches_in_flight_max: cfg.launches_in_flight_max,
        };
        MiniGpu {
            rng: SmallRng::seed_from_u64(cfg.seed),
            sms: vec![[0; 4]; cfg.sm_count as usize],
            queues: vec![VecDeque::new(); cfg.hardware_queues.max(1) as usize],
            info,
            cfg,
            now: 0,
            seq: 0,
            last_notify: 0,
            future: BTreeMap::new(),
            ready: VecDeque::new(),
            launches: HashMap::new(),
            streams: Vec::new(),
            active: Vec::new(),
            next_launch: 1,
            next_ptr: 1 << 20,
            need_place: false,
            launches_total: 0,
        }
    }

    pub fn resources(&self, shape: &LaunchShape) -> KernelResources {
        let threads = shape.threads_per_block.max(1);
        let regs = 32;
        KernelResources {
            threads_per_cta: threads,
            registers_per_thread: regs,
            shared_mem_bytes: shape.shared_mem_bytes,
            ctas_per_sm_max: KernelResources::occupancy(threads, regs, shape.shared_mem_bytes, &self.cfg.limits),
        }
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.future.insert((t, self.seq), ev);
    }

    fn notify(&mut self, e: GpuEvent) {
        let jitter = if self.cfg.notify_jitter_ns > 0 { self.rng.random_range(0..=self.cfg.notify_jitter_ns) } else { 0 };
        let t = (self.now + self.cfg.notify_delay_ns + jitter).max(self.last_notify);
        self.last_notify = t;
        self.at(t, Ev::Notify(e));
    }

    fn check_front(&mut self, q: usize) {
        let Some(&id) = self.queues[q].front() else { return };
        let l = self.launches.get_mut(&id).unwrap();
        if l.scheduled || self.streams[l.stream].front() != Some(&id) {
            return;
        }
        l.scheduled = true;
        let t = self.now + self.cfg.launch_latency_ns;
        self.at(t, Ev::Eligible(id));
    }

    fn fits(&self, sm: usize, r: &KernelResources) -> bool {
        let u = self.sms[sm];
        let l = &self.cfg.limits;
        let regs = (r.registers_per_thread * r.threads_per_cta).next_multiple_of(256);
        u[0] + r.threads_per_cta <= l.threads_max
            && u[1] + regs <= l.registers_max
            && u[2] + r.shared_mem_bytes <= l.shared_mem_bytes_max
            && u[3] < l.ctas_max
    }

    fn use_sm(&mut self, sm: usize, r: &KernelResources, sign: i64) {
        let regs = (r.registers_per_thread * r.threads_per_cta).next_multiple_of(256);
        let u = &mut self.sms[sm];
        let d = [r.threads_per_cta, regs, r.shared_mem_bytes, 1];
        for k in 0..4 {
            u[k] = (u[k] as i64 + sign * d[k] as i64) as u32;
        }
    }

    fn try_place(&mut self) {
        let ids = self.active.clone();
        let start = if self.sms.is_empty() { 0 } else { self.rng.random_range(0..self.sms.len()) };
        for id in ids {
            if !self.launches.contains_key(&id) {
                continue;
            }
            let (res, mask, preempt) = {
                let l = &self.launches[&id];
                (l.res, l.mask, l.preempt)
            };
            if preempt {
                self.launches.get_mut(&id).unwrap().to_place = 0;
            }
            let mut placed: Vec<(u32, u32)> = Vec::new();
            let n = self.sms.len();
            for k in 0..n {
                let sm = (start + k) % n;
                if !mask.contains(sm as u32) {
                    continue;
                }
                let mut count = 0;
                while self.launches[&id].to_place > 0 && self.fits(sm, &res) {
                    self.use_sm(sm, &res, 1);
                    let l = self.launches.get_mut(&id).unwrap();
                    l.to_place -= 1;
                    l.live += 1;
                    count += 1;
                }
                if count > 0 {
                    placed.push((sm as u32, count));
                }
            }
            if self.launches[&id].to_place == 0 {
                self.active.retain(|&x| x != id);
                let q = self.launches[&id].queue;
                debug_assert_eq!(self.queues[q].front(), Some(&id));
                self.queues[q].pop_front();
                self.check_front(q);
            }
            for &(sm, count) in &placed {
                if self.launches[&id].report_ctas {
                    self.notify(GpuEvent::CtasPlaced { launch: LaunchId(id), sm, ctas: count, at_ns: self.now });
                }
                for _ in 0..count {
                    self.cta_take(id, sm, 0);
                }
            }
            self.maybe_done(id);
        }
    }

    /// A CTA that has run `blocks` blocks takes the next one or exits.
    fn cta_take(&mut self, id: u64, sm: u32, blocks: u32) {
        let l = self.launches.get_mut(&id).unwrap();
        if !l.preempt && l.next_block < l.total {
            if l.next_block == l.first_block && l.report_start {
                let e = GpuEvent::LaunchStarted { launch: LaunchId(id), at_ns: self.now };
                l.next_block += 1;
                let t = self.now + l.block_ns;
                self.notify(e);
                self.at(t, Ev::CtaStep { launch: id, sm, blocks: blocks + 1 });
                return;
            }
            l.next_block += 1;
            let t = self.now + l.block_ns;
            self.at(t, Ev::CtaStep { launch: id, sm, blocks: blocks + 1 });
        } else {
            l.live -= 1;
            let (res, report) = (l.res, l.report_ctas);
            self.use_sm(sm as usize, &res, -1);
            if report {
                self.notify(GpuEvent::CtasFinished { launch: LaunchId(id), sm, ctas: 1, blocks, at_ns: self.now });
            }
            self.maybe_done(id);
            self.need_place = true;
        }
    }

    fn settle(&mut self) {
        while self.need_place {
            self.need_place = false;
            self.try_place();
        }
    }

    fn maybe_done(&mut self, id: u64) {
        let Some(l) = self.launches.get(&id) else { return };
        if l.to_place > 0 || l.live > 0 || !l.eligible {
            return;
        }
        let l = self.launches.remove(&id).unwrap();
        if self.cfg.lose_one_in > 0 && self.rng.random_range(0..self.cfg.lose_one_in) == 0 {
            self.notify(GpuEvent::LaunchLost { launch: LaunchId(id), at_ns: self.now });
        } else {
            self.notify(GpuEvent::LaunchDone {
                launch: LaunchId(id),
                next_block: l.next_block,
                preempted: l.next_block < l.total,
                at_ns: self.now,
            });
        }
        debug_assert_eq!(self.streams[l.stream].front(), Some(&id));
        self.streams[l.stream].pop_front();
        if let Some(&next) = self.streams[l.stream].front() {
            let q = self.launches[&next].queue;
            self.check_front(q);
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Eligible(id) => {
                if let Some(l) = self.launches.get_mut(&id) {
                    l.eligible = true;
                    self.active.push(id);
                    self.active.sort_unstable();
                    self.need_place = true;
                }
            }
            Ev::CtaStep { launch, sm, blocks } => self.cta_take(launch, sm, blocks),
            Ev::Notify(e) => self.ready.push_back(e),
        }
        self.settle();
    }
}

impl Gpu for MiniGpu {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn now_ns(&self) -> u64 {
        self.now
    }

    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        let ptr = DevicePtr(self.next_ptr);
        self.next_ptr += bytes.next_multiple_of(256);
        Ok(Allocation { ptr, bytes, kind })
    }

    fn free(&mut self, _allocation: Allocation) -> Result<()> {
        Ok(())
    }

    fn write(&mut self, _dst: DevicePtr, _data: &[u8]) -> Result<()> {
        Ok(())
    }

    fn read(&mut self, _src: DevicePtr, out: &mut [u8]) -> Result<()> {
        out.fill(0);
        Ok(())
    }

    fn copy_async(&mut self, _dst: DevicePtr, _src: DevicePtr, _bytes: u64, _stream: StreamId) -> Result<CopyId> {
        Err(GpuError::Invalid("MiniGpu has no copy engine".into()))
    }

    fn create_stream(&mut self, _priority: i32) -> Result<StreamId> {
        self.streams.push(VecDeque::new());
        Ok(StreamId(self.streams.len() as u32 - 1))
    }

    fn destroy_stream(&mut self, stream: StreamId) -> Result<()> {
        if (stream.0 as usize) < self.streams.len() {
            Ok(())
        } else {
            Err(GpuError::Invalid(format!("unknown stream {stream:?}")))
        }
    }

    fn kernel_resources(&mut self, _kernel: &Kernel, _dtype: DType, shape: &LaunchShape) -> Result<KernelResources> {
        Ok(self.resources(shape))
    }

    fn launch(&mut self, r: &LaunchRequest<'_>) -> Result<LaunchId> {
        let s = r.stream.0 as usize;
        if s >= self.streams.len() {
            return Err(GpuError::Invalid(format!("no stream {s}")));
        }
        if r.first_block >= r.shape.logical_blocks {
            return Err(GpuError::Invalid("nothing to run".into()));
        }
        let max = self.cfg.launches_in_flight_max;
        if max > 0 && self.launches.len() >= max as usize {
            return Err(GpuError::Exhausted { limit: "launch slots", max: max as u64 });
        }
        let id = self.next_launch;
        self.next_launch += 1;
        self.launches_total += 1;
        let res = self.resources(&r.shape);
        let blocks_left = r.shape.logical_blocks - r.first_block;
        let ctas = if r.ctas == 0 { res.ctas_per_sm_max * r.sm_mask.count() } else { r.ctas }.min(blocks_left).max(1);
        let q = s % self.queues.len();
        self.launches.insert(
            id,
            L {
                stream: s,
                queue: q,
                res,
                total: r.shape.logical_blocks,
                next_block: r.first_block,
                to_place: ctas,
                live: 0,
                preempt: false,
                block_ns: (self.cfg.block_ns)(r.kernel, &r.shape).max(1),
                mask: r.sm_mask.intersect(&self.info.partitions[0].sms),
                scheduled: false,
                eligible: false,
                report_ctas: r.report_ctas,
                report_start: r.report_start,
                first_block: r.first_block,
            },
        );
        self.streams[s].push_back(id);
        self.queues[q].push_back(id);
        self.check_front(q);
        Ok(LaunchId(id))
    }

    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        if let Some(l) = self.launches.get_mut(&launch.0) {
            l.preempt = true;
            if l.eligible {
                self.need_place = true;
                self.settle();
            }
        }
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        events.extend(self.ready.drain(..));
        Ok(())
    }

    fn wait(&mut self, until_ns: u64) -> Result<()> {
        loop {
            if !self.ready.is_empty() {
                return Ok(());
            }
            let Some((&(t, _), _)) = self.future.first_key_value() else {
                self.now = self.now.max(until_ns);
                return Ok(());
            };
            if t > until_ns {
                self.now = self.now.max(until_ns);
                return Ok(());
            }
            let ((t, _), ev) = self.future.pop_first().unwrap();
            self.now = self.now.max(t);
            self.handle(ev);
        }
    }
}

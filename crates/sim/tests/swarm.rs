//! Swarm tests: random GPU shapes, queue counts, latencies, kernel mixes, masks, partitions,
//! priorities, copies and preemptions, driven through the `Gpu` trait by a small randomized
//! dispatcher, then checked from the outside (notifications and the recorded trace) against the
//! model's invariants:
//!
//! - no SM over any of its limits at any time (replayed from placements and releases);
//! - every logical block of every job executed exactly once across preemptions and resumes;
//! - each hardware queue dispatches in issue order; a stream's command starts after its
//!   predecessor completed; equal-priority grids sharing SMs are placed in dispatch order;
//! - notifications arrive in time order, never before they happened; every launch and copy ends.
//!
//! The simulator also audits its own accounting after every step (`check_invariants`).
//! Each test prints its seeds; `KAIROS_SEED=<seed> cargo test -p kairos-sim --test swarm` reruns one,
//! `KAIROS_SEED_RANDOM=1` explores fresh ones.

mod common;

use common::*;
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape};
use kairos_sim::*;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::collections::{HashMap, HashSet};

fn pick<T: Copy>(rng: &mut SmallRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

fn random_desc(rng: &mut SmallRng) -> GpuDesc {
    let mut d = GpuDesc::h100_sxm();
    d.key = "swarm".into();
    d.sm_count = pick(rng, &[1, 4, 8, 13, 16, 33, 64, 114, 132]);
    d.sm_limits = SmLimits {
        threads_max: pick(rng, &[1024, 1536, 2048]),
        registers_max: pick(rng, &[32768, 65536]),
        shared_mem_bytes_max: pick(rng, &[48 * 1024, 100 * 1024, 228 * 1024]),
        ctas_max: pick(rng, &[2, 8, 16, 32]),
    };
    d.threads_per_cta_max = 1024.min(d.sm_limits.threads_max);
    d.shared_mem_per_cta_bytes_max = d.sm_limits.shared_mem_bytes_max - 1024;
    let g = pick(rng, &[1, 2, 4, 8]);
    d.partition_granularity_sms = g;
    d.partition_sizes_sms = vec![g, 2 * g, 4 * g];
    d.hardware_queues = rng.random_range(1..=8);
    d.concurrent_grids_max = pick(rng, &[1, 2, 8, 128]);
    let scale = pick(rng, &[0.0, 0.3, 1.0, 3.0]);
    let l = &mut d.latency;
    for v in [
        &mut l.launch_host_ns,
        &mut l.launch_latency_ns,
        &mut l.grid_dispatch_ns,
        &mut l.grid_complete_ns,
        &mut l.notify_delay_ns,
        &mut l.event_host_ns,
        &mut l.preempt_flag_delay_ns,
        &mut l.copy_setup_ns,
        &mut l.cta_exit_ns,
    ] {
        *v = (*v as f64 * scale) as u64;
    }
    // Half the devices keep their preempt flags in device memory (kairos-cuda's default).
    l.preempt_flag_write_ns = rng.random_bool(0.5).then_some((3_000.0 * scale) as u64);
    d.validate().unwrap();
    d
}

struct KernelKind {
    kernel: Kernel,
    dtype: DType,
    shape: LaunchShape,
    args: Vec<DevicePtr>,
    res: KernelResources,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Item {
    L(LaunchId),
    C(CopyId),
}

struct LaunchRec {
    job: usize,
    partition_sms: SmMask,
    first_block: u32,
    mask: SmMask,
    preempted_by_us: bool,
    report_start: bool,
}

struct Job {
    kind: usize,
    n: u32,
    ranges: Vec<(u32, u32)>,
    launches: u32,
    done: bool,
}

struct Swarm {
    seed: u64,
    rng: SmallRng,
    desc: GpuDesc,
    gpu: SimGpu,
    streams: Vec<StreamId>,
    stream_priority: HashMap<StreamId, i32>,
    kinds: Vec<KernelKind>,
    buffers: Vec<Allocation>,
    jobs: Vec<Job>,
    launches: HashMap<LaunchId, LaunchRec>,
    in_flight: Vec<LaunchId>,
    copies: HashSet<CopyId>,
    copies_done: HashSet<CopyId>,
    delivered: Vec<(u64, GpuEvent)>,
}

impl Swarm {
    /// The workload (GPU shape, kernels, driver decisions) comes from `seed`, the simulator's own
    /// randomness from `gpu_seed`; `jitter` forces jitter on or off (else random).
    fn new(seed: u64, gpu_seed: u64, compute: bool, jitter: Option<bool>) -> Swarm {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed_5eed);
        let desc = random_desc(&mut rng);
        let jitter = jitter.unwrap_or_else(|| rng.random_bool(0.7));
        let gpu = SimGpu::new(
            desc.clone(),
            SimOptions { seed: gpu_seed, compute, jitter, record_trace: true, check_invariants: true, ..SimOptions::default() },
        );
        let mut s = Swarm {
            seed,
            rng,
            desc,
            gpu,
            streams: Vec::new(),
            stream_priority: HashMap::new(),
            kinds: Vec::new(),
            buffers: Vec::new(),
            jobs: Vec::new(),
            launches: HashMap::new(),
            in_flight: Vec::new(),
            copies: HashSet::new(),
            copies_done: HashSet::new(),
            delivered: Vec::new(),
        };
        for _ in 0..s.rng.random_range(1..=12) {
            let prio = pick(&mut s.rng, &[0, 0, 0, 1, 3]);
            let st = s.gpu.create_stream(prio).unwrap();
            s.streams.push(st);
            s.stream_priority.insert(st, prio);
        }
        let kinds = s.rng.random_range(1..=6);
        while s.kinds.len() < kinds {
            s.add_kind();
        }
        s
    }

    fn add_kind(&mut self) {
        let rng = &mut self.rng;
        let kernel = if rng.random_bool(0.5) {
            eltwise_add(rng.random_range(1..200_000), pick(rng, &[64, 256, 1024, 4096, 100_000]))
        } else {
            gemm(rng.random_range(1..300), rng.random_range(1..300), rng.random_range(1..200), pick(rng, &[16, 32, 64]))
        };
        let dtype = if matches!(kernel, Kernel::Gemm(_)) && rng.random_bool(0.5) { DType::F16 } else { DType::F32 };
        let threads = pick(rng, &[32, 64, 128, 256, 512, 1024]).min(self.desc.threads_per_cta_max);
        let smem = if rng.random_bool(0.5) { 0 } else { rng.random_range(0..=self.desc.shared_mem_per_cta_bytes_max) };
        let shape = LaunchShape { logical_blocks: kernel.logical_blocks(), threads_per_block: threads, shared_mem_bytes: smem };
        if rng.random_bool(0.4) {
            let sm = self.desc.sm_count;
            let d = rng.random_range(500..300_000);
            let by_sms = if rng.random_bool(0.5) { vec![(1.max(sm / 4), d * 3), (1.max(sm / 2), d * 2)] } else { vec![] };
            self.gpu.register_kernel(
                &kernel,
                dtype,
                MeasuredKernel { duration_ns: d, sm_count: sm, duration_by_sms: by_sms, resources: None },
            );
        }
        let Ok(res) = self.gpu.kernel_resources(&kernel, dtype, &shape) else {
            return; // does not fit this GPU: draw another
        };
        let host_args: Vec<usize> = (0..4).filter(|_| self.rng.random_bool(0.1)).collect();
        let allocs = alloc_args(&mut self.gpu, &kernel, dtype, &host_args);
        let args = ptrs(&allocs);
        self.buffers.extend(allocs);
        self.kinds.push(KernelKind { kernel, dtype, shape, args, res });
    }

    fn launch(&mut self, job: usize, first_block: u32, safe: bool) {
        let kind = &self.kinds[self.jobs[job].kind];
        let parts = &self.gpu.info().partitions;
        let partition = if safe || self.rng.random_bool(0.6) { 0 } else { self.rng.random_range(0..parts.len()) };
        let part = parts[partition].sms;
        let whole_mask = safe || self.rng.random_bool(0.6);
        let mask = if whole_mask {
            part
        } else {
            let mut m = SmMask::EMPTY;
            for sm in part.iter() {
                if self.rng.random_bool(0.5) {
                    m.insert(sm);
                }
            }
            if m.is_empty() {
                m.insert(part.iter().next().unwrap());
            }
            m
        };
        let ctas =
            if safe || self.rng.random_bool(0.7) { 0 } else { self.rng.random_range(1..=kind.kernel.logical_blocks() + 8) };
        let stream = pick(&mut self.rng, &self.streams);
        let req = LaunchRequest {
            kernel: &kind.kernel,
            dtype: kind.dtype,
            shape: kind.shape,
            args: &kind.args,
            first_block,
            ctas,
            sm_mask: mask,
            partition: PartitionId(partition as u32),
            stream,
            after: None,
            report_ctas: true,
            report_start: self.rng.random_bool(0.5),
            preemptible: true,
            report_end: true,
            stop_word: None,
        };
        let id = self.gpu.launch(&req).unwrap_or_else(|e| panic!("seed {}: launch failed: {e}", self.seed));
        self.jobs[job].launches += 1;
        self.launches.insert(
            id,
            LaunchRec {
                job,
                partition_sms: part,
                first_block,
                mask: mask.intersect(&part),
                preempted_by_us: false,
                report_start: req.report_start,
            },
        );
        self.in_flight.push(id);
    }

    fn poll(&mut self) {
        let mut buf = Vec::new();
        self.gpu.poll(&mut buf).unwrap();
        let now = self.gpu.now_ns();
        for e in buf {
            self.delivered.push((now, e));
            match e {
                GpuEvent::LaunchDone { launch, next_block, preempted, .. } => {
                    self.in_flight.retain(|&x| x != launch);
                    let rec = &self.launches[&launch];
                    assert!(
                        !preempted || rec.preempted_by_us,
                        "seed {}: {launch:?} reports a preemption nobody asked for",
                        self.seed
                    );
                    if !preempted {
                        let n = self.jobs[rec.job].n;
                        assert_eq!(next_block, n, "seed {}: {launch:?} stopped early without a preemption", self.seed);
                    }
                    let (job, first) = (rec.job, rec.first_block);
                    let j = &mut self.jobs[job];
                    j.ranges.push((first, next_block));
                    if next_block < j.n {
                        // Resume where it stopped; after a launch that made no progress, use the safe
                        // configuration (whole partition, default CTAs) so a job cannot starve.
                        let safe = next_block == first || j.launches > 16;
                        self.launch(job, next_block, safe);
                    } else {
                        j.done = true;
                    }
                }
                GpuEvent::CopyDone { copy, .. } => {
                    assert!(self.copies_done.insert(copy), "seed {}: {copy:?} done twice", self.seed);
                }
                _ => {}
            }
        }
    }

    fn run(&mut self) {
        let total_jobs = self.rng.random_range(5..80);
        let mut steps = 0u64;
        loop {
            steps += 1;
            if steps >= 1_000_000 {
                let open: Vec<_> = self
                    .jobs
                    .iter()
                    .enumerate()
                    .filter(|(_, j)| !j.done)
                    .map(|(i, j)| (i, j.n, j.ranges.clone(), j.launches))
                    .collect();
                panic!(
                    "seed {}: the workload does not finish: now {} ns, open jobs {open:?}, in flight {:?}, idle {}",
                    self.seed,
                    self.gpu.now_ns(),
                    self.in_flight,
                    self.gpu.is_idle()
                );
            }
            let all_done = self.jobs.len() == total_jobs && self.jobs.iter().all(|j| j.done);
            if all_done {
                break;
            }
            let r: f64 = self.rng.random();
            if self.jobs.len() < total_jobs && r < 0.35 {
                let kind = self.rng.random_range(0..self.kinds.len());
                let n = self.kinds[kind].kernel.logical_blocks();
                self.jobs.push(Job { kind, n, ranges: Vec::new(), launches: 0, done: false });
                let job = self.jobs.len() - 1;
                self.launch(job, 0, false);
            } else if r < 0.42 && self.buffers.len() >= 2 && self.copies.len() - self.copies_done.len() < 8 {
                let a = pick(&mut self.rng, &self.buffers);
                let b = pick(&mut self.rng, &self.buffers);
                if a.ptr != b.ptr {
                    let bytes = self.rng.random_range(1..=a.bytes.min(b.bytes));
                    let stream = pick(&mut self.rng, &self.streams);
                    let c = self.gpu.copy_async(a.ptr, b.ptr, bytes, stream).unwrap();
                    self.copies.insert(c);
                }
            } else if r < 0.55 && !self.in_flight.is_empty() {
                let id = pick(&mut self.rng, &self.in_flight);
                let rec = self.launches.get_mut(&id).unwrap();
                if self.jobs[rec.job].launches <= 16 {
                    rec.preempted_by_us = true;
                    self.gpu.preempt(id).unwrap();
                }
            } else {
                let now = self.gpu.now_ns();
                let dt = pick(&mut self.rng, &[0, 100, 2_000, 20_000, 200_000]);
                self.gpu.wait(now + dt).unwrap();
            }
            self.poll();
        }
        // Let copies finish and every notification arrive.
        let deadline = self.gpu.now_ns() + 10_000_000_000;
        while !self.gpu.is_idle() {
            let now = self.gpu.now_ns();
            assert!(now < deadline, "seed {}: the GPU never goes idle", self.seed);
            self.gpu.wait(now + 1_000_000).unwrap();
            self.poll();
        }
    }

    fn check(&self) {
        let seed = self.seed;
        let trace = self.gpu.trace();
        assert!(trace.len() < TRACE_EVENTS_MAX, "trace truncated");

        // Launches whose last CTA ran the blocks outside the mask (none of their CTAs landed in it).
        let rescued: HashSet<LaunchId> =
            trace.iter().filter_map(|e| if let TraceEvent::Rescue { launch, .. } = *e { Some(launch) } else { None }).collect();
        // Notifications: in time order, never early, each launch and copy ends exactly once.
        let mut last = 0;
        let mut done = HashSet::new();
        let mut started: HashSet<LaunchId> = HashSet::new();
        let mut placed: HashMap<(LaunchId, u32), i64> = HashMap::new();
        let mut blocks: HashMap<LaunchId, u64> = HashMap::new();
        for &(polled_ns, e) in &self.delivered {
            let at = match e {
                GpuEvent::CtasPlaced { at_ns, .. }
                | GpuEvent::CtasFinished { at_ns, .. }
                | GpuEvent::LaunchDone { at_ns, .. }
                | GpuEvent::LaunchStarted { at_ns, .. }
                | GpuEvent::LaunchLost { at_ns, .. }
                | GpuEvent::CopyDone { at_ns, .. } => at_ns,
            };
            // A start record: asked for, once, before the launch's end, after a CTA was placed.
            if let GpuEvent::LaunchStarted { launch, .. } = e {
                assert!(self.launches[&launch].report_start, "seed {seed}: {launch:?} reported a start it did not ask for");
                assert!(started.insert(launch), "seed {seed}: {launch:?} started twice");
                assert!(!done.contains(&launch), "seed {seed}: {launch:?} started after its end");
                assert!(placed.keys().any(|k| k.0 == launch), "seed {seed}: {launch:?} started before a CTA was placed");
            }
            assert!(at >= last, "seed {seed}: notification {e:?} out of time order");
            assert!(polled_ns >= at, "seed {seed}: {e:?} seen at {polled_ns} before it happened");
            last = at;
            match e {
                GpuEvent::CtasPlaced { launch, sm, ctas, .. } => {
                    assert!(
                        self.launches[&launch].mask.contains(sm) || rescued.contains(&launch),
                        "seed {seed}: {launch:?} reported a CTA on SM {sm} outside its mask"
                    );
                    *placed.entry((launch, sm)).or_default() += ctas as i64;
                }
                GpuEvent::CtasFinished { launch, sm, ctas, blocks: b, .. } => {
                    *placed.entry((launch, sm)).or_default() -= ctas as i64;
                    *blocks.entry(launch).or_default() += b as u64;
                }
                GpuEvent::LaunchDone { launch, next_block, .. } => {
                    assert!(done.insert(launch), "seed {seed}: {launch:?} done twice");
                    let ran = blocks.get(&launch).copied().unwrap_or(0);
                    let first = self.launches[&launch].first_block;
                    assert!(
                        !self.launches[&launch].report_start || (ran > 0) == started.contains(&launch),
                        "seed {seed}: {launch:?} ran {ran} blocks, start reported: {}",
                        started.contains(&launch)
                    );
                    assert_eq!(
                        ran,
                        (next_block - first) as u64,
                        "seed {seed}: {launch:?} reports {ran} blocks for [{first}, {next_block})"
                    );
                }
                GpuEvent::LaunchLost { launch, .. } => panic!("seed {seed}: {launch:?} lost"),
                GpuEvent::LaunchStarted { .. } | GpuEvent::CopyDone { .. } => {}
            }
        }
        assert_eq!(done.len(), self.launches.len(), "seed {seed}: launches without LaunchDone");
        assert_eq!(self.copies_done, self.copies, "seed {seed}: copies without CopyDone");
        assert!(placed.values().all(|&v| v == 0), "seed {seed}: CTAs placed and never finished");

        // Every job's blocks ran exactly once: its launches' ranges tile [0, n).
        for (i, j) in self.jobs.iter().enumerate() {
            let mut r = j.ranges.clone();
            r.sort_unstable();
            let mut at = 0;
            for (first, next) in r {
                if first == next {
                    continue;
                }
                assert_eq!(first, at, "seed {seed}: job {i} ranges {:?} overlap or leave a gap", j.ranges);
                at = next;
            }
            assert_eq!(at, j.n, "seed {seed}: job {i} ran {at} of {} blocks", j.n);
        }

        // Replay the trace: SM limits, contiguous block takes, queue and stream order, in-order placement.
        let res: HashMap<LaunchId, KernelResources> =
            self.launches.iter().map(|(id, rec)| (*id, self.kinds[self.jobs[rec.job].kind].res)).collect();
        let limits = self.desc.sm_limits;
        let mut usage = vec![(0u32, 0u32, 0u32, 0u32); self.desc.sm_count as usize];
        let mut next_take: HashMap<LaunchId, u32> = HashMap::new();
        let mut issued: HashMap<u32, Vec<Item>> = HashMap::new();
        let mut dispatched: HashMap<u32, Vec<Item>> = HashMap::new();
        let mut by_stream: HashMap<StreamId, Vec<Item>> = HashMap::new();
        let mut dispatch_at: HashMap<Item, u64> = HashMap::new();
        let mut complete_at: HashMap<Item, u64> = HashMap::new();
        let mut place_span: HashMap<LaunchId, (u64, u64)> = HashMap::new();
        let mut dispatch_order: Vec<LaunchId> = Vec::new();
        let mut stream_of: HashMap<LaunchId, StreamId> = HashMap::new();
        let mut t_prev = 0;
        for e in trace {
            match *e {
                TraceEvent::Issue { launch, stream, queue, .. } => {
                    issued.entry(queue).or_default().push(Item::L(launch));
                    by_stream.entry(stream).or_default().push(Item::L(launch));
                    stream_of.insert(launch, stream);
                    next_take.insert(launch, self.launches[&launch].first_block);
                }
                TraceEvent::IssueCopy { copy, stream, queue, .. } => {
                    issued.entry(queue).or_default().push(Item::C(copy));
                    by_stream.entry(stream).or_default().push(Item::C(copy));
                }
                TraceEvent::Dispatch { launch, queue, at_ns } => {
                    dispatched.entry(queue).or_default().push(Item::L(launch));
                    dispatch_at.insert(Item::L(launch), at_ns);
                    dispatch_order.push(launch);
                }
                TraceEvent::DispatchCopy { copy, queue, at_ns } => {
                    dispatched.entry(queue).or_default().push(Item::C(copy));
                    dispatch_at.insert(Item::C(copy), at_ns);
                }
                TraceEvent::Place { launch, sm, working, idle, at_ns } => {
                    assert!(at_ns >= t_prev, "seed {seed}: trace goes back in time");
                    t_prev = at_ns;
                    let r = res[&launch];
                    let n = working + idle;
                    let u = &mut usage[sm as usize];
                    u.0 += r.threads_per_cta * n;
                    u.1 += (r.registers_per_thread * r.threads_per_cta).next_multiple_of(256) * n;
                    u.2 += r.shared_mem_bytes * n;
                    u.3 += n;
                    assert!(
                        u.0 <= limits.threads_max
                            && u.1 <= limits.registers_max
                            && u.2 <= limits.shared_mem_bytes_max
                            && u.3 <= limits.ctas_max,
                        "seed {seed}: SM {sm} over its limits at {at_ns}: {u:?} vs {limits:?}"
                    );
                    let s = place_span.entry(launch).or_insert((at_ns, at_ns));
                    s.1 = at_ns;
                }
                TraceEvent::Release { launch, sm, ctas, at_ns, .. } => {
                    assert!(at_ns >= t_prev, "seed {seed}: trace goes back in time");
                    t_prev = at_ns;
                    let r = res[&launch];
                    let u = &mut usage[sm as usize];
                    u.0 -= r.threads_per_cta * ctas;
                    u.1 -= (r.registers_per_thread * r.threads_per_cta).next_multiple_of(256) * ctas;
                    u.2 -= r.shared_mem_bytes * ctas;
                    u.3 -= ctas;
                }
                TraceEvent::Take { launch, first, count, .. } => {
                    let at = next_take.get_mut(&launch).unwrap();
                    assert_eq!(first, *at, "seed {seed}: {launch:?} took blocks out of order");
                    *at += count;
                }
                TraceEvent::Done { launch, next_block, .. } => {
                    assert_eq!(
                        next_take[&launch], next_block,
                        "seed {seed}: {launch:?} took up to {} but reports {next_block}",
                        next_take[&launch]
                    );
                }
                TraceEvent::Complete { launch, at_ns } => {
                    complete_at.insert(Item::L(launch), at_ns);
                }
                TraceEvent::CopyEnd { copy, at_ns } => {
                    complete_at.insert(Item::C(copy), at_ns);
                }
                _ => {}
            }
        }
        assert!(usage.iter().all(|u| *u == (0, 0, 0, 0)), "seed {seed}: SMs not empty at the end");
        for (q, items) in &issued {
            assert_eq!(dispatched.get(q), Some(items), "seed {seed}: hardware queue {q} did not dispatch in issue order");
        }
        for (s, items) in &by_stream {
            for w in items.windows(2) {
                assert!(
                    dispatch_at[&w[1]] >= complete_at[&w[0]],
                    "seed {seed}: stream {s:?} started {:?} before {:?} completed",
                    w[1],
                    w[0]
                );
            }
        }
        for (i, a) in dispatch_order.iter().enumerate() {
            for b in &dispatch_order[i + 1..] {
                let (pa, pb) = (self.stream_priority[&stream_of[a]], self.stream_priority[&stream_of[b]]);
                let (part_a, part_b) = (self.launches[a].partition_sms, self.launches[b].partition_sms);
                if pa != pb || part_a.intersect(&part_b).is_empty() {
                    continue;
                }
                if let (Some(sa), Some(sb)) = (place_span.get(a), place_span.get(b)) {
                    assert!(
                        sb.0 >= sa.1,
                        "seed {seed}: {b:?} placed at {} before earlier {a:?} finished placing at {}",
                        sb.0,
                        sa.1
                    );
                }
            }
        }
    }
}

fn run_seed(seed: u64, gpu_seed: u64, compute: bool, jitter: Option<bool>) -> Swarm {
    let mut s = Swarm::new(seed, gpu_seed, compute, jitter);
    println!(
        "swarm seed {seed} (gpu seed {gpu_seed}): {} SMs, {} queues, {} grids max, {} streams, {} kernel kinds",
        s.desc.sm_count,
        s.desc.hardware_queues,
        s.desc.concurrent_grids_max,
        s.streams.len(),
        s.kinds.len()
    );
    s.run();
    s.check();
    s
}

#[test]
fn gpu_model_invariants_hold_on_random_configurations() {
    for seed in test_seeds(200, 0x5a17_0000) {
        let s = run_seed(seed, seed, false, None);
        let st = s.gpu.stats();
        let count = |f: &dyn Fn(&TraceEvent) -> bool| s.gpu.trace().iter().filter(|e| f(e)).count();
        let rescues = count(&|e| matches!(e, TraceEvent::Rescue { .. }));
        let stopped = count(&|e| matches!(e, TraceEvent::Done { preempted: true, .. }));
        println!(
            "  {} launches ({stopped} preempted, {rescues} rescued), {} copies, {} blocks, {} steps",
            st.launches, st.copies, st.blocks, st.steps
        );
    }
}

#[test]
fn same_seed_same_trace_and_other_seeds_differ() {
    for seed in test_seeds(4, 0xde7e_0000) {
        let a = run_seed(seed, seed, false, Some(true));
        let b = run_seed(seed, seed, false, Some(true));
        assert_eq!(a.gpu.trace_hash(), b.gpu.trace_hash(), "seed {seed}: same seed, different trace hashes");
        assert_eq!(a.delivered, b.delivered, "seed {seed}: same seed, different notifications");
        assert_eq!(a.gpu.trace(), b.gpu.trace(), "seed {seed}: same seed, different traces");
        // The same workload with another simulator seed jitters differently.
        let c = run_seed(seed, seed ^ 1, false, Some(true));
        assert_ne!(a.gpu.trace_hash(), c.gpu.trace_hash(), "seed {seed}: the simulator seed changed nothing");
    }
}

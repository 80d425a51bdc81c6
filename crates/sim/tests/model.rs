//! Behaviour of the GPU model: calibration to measured durations, fewer SMs, contention, the
//! launch path, head-of-line blocking, priorities, masks, preemption and copies. Each test checks
//! a number the model promises in the crate docs.

mod common;

use common::*;
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::plan::Kernel;
use kairos_sim::*;

fn exact() -> SimOptions {
    SimOptions { seed: 1, compute: false, jitter: false, record_trace: true, check_invariants: true, ..SimOptions::default() }
}

/// Dispatch -> grid complete span of a launch, from the trace.
fn span(trace: &[TraceEvent], id: LaunchId) -> u64 {
    let d = trace.iter().find_map(|e| match *e {
        TraceEvent::Dispatch { launch, at_ns, .. } if launch == id => Some(at_ns),
        _ => None,
    });
    let c = trace.iter().find_map(|e| match *e {
        TraceEvent::Complete { launch, at_ns } if launch == id => Some(at_ns),
        _ => None,
    });
    c.expect("complete") - d.expect("dispatched")
}

/// Runs one kernel alone on `mask` within `partition` and returns its dispatch -> complete span.
fn alone(desc: &GpuDesc, kernel: &Kernel, dtype: DType, partition: u32, mask: SmMask, measured: Option<MeasuredKernel>) -> u64 {
    let mut gpu = SimGpu::new(desc.clone(), exact());
    if let Some(m) = measured {
        gpu.register_kernel(kernel, dtype, m);
    }
    let s = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, kernel, dtype, &[]);
    let p = ptrs(&args);
    let mut req = request(kernel, dtype, shape(kernel, 256, 0), &p, s);
    req.partition = PartitionId(partition);
    req.sm_mask = mask;
    let id = gpu.launch(&req).unwrap();
    run_until_done(&mut gpu, &[id]);
    drain(&mut gpu);
    span(gpu.trace(), id)
}

fn partition_of_size(desc: &GpuDesc, size: u32) -> u32 {
    desc.partitions().iter().find(|p| p.sms.count() == size).unwrap().id.0
}

fn all() -> SmMask {
    SmMask::first(SM_COUNT_MAX as u32)
}

#[test]
fn a_measured_kernel_alone_takes_its_measured_time() {
    let desc = GpuDesc::h100_sxm();
    let k = eltwise_add(4000 * 1024, 1024);
    let m = MeasuredKernel {
        duration_ns: 100_000,
        sm_count: 132,
        duration_by_sms: vec![],
        resources: Some(CtaResources { threads_per_cta: 256, registers_per_thread: 32, shared_mem_bytes: 0 }),
    };
    let t = alone(&desc, &k, DType::F32, 0, all(), Some(m));
    assert!(t.abs_diff(100_000) <= 8, "measured 100000 ns, simulated {t}");
}

#[test]
fn measurements_at_fewer_sms_are_reproduced_and_interpolated() {
    let desc = GpuDesc::h100_sxm();
    let k = eltwise_add(4000 * 1024, 1024);
    let m = MeasuredKernel {
        duration_ns: 100_000,
        sm_count: 132,
        duration_by_sms: vec![(16, 500_000), (132, 100_000)],
        resources: Some(CtaResources { threads_per_cta: 256, registers_per_thread: 32, shared_mem_bytes: 0 }),
    };
    let t16 = alone(&desc, &k, DType::F32, partition_of_size(&desc, 16), all(), Some(m.clone()));
    assert!(t16.abs_diff(500_000) <= 50, "16 SMs: {t16}");
    // 64 SMs: linear between the points, 500000 - 48/116 * 400000.
    let t64 = alone(&desc, &k, DType::F32, partition_of_size(&desc, 64), all(), Some(m));
    let want = 500_000.0 - 48.0 / 116.0 * 400_000.0;
    assert!((t64 as f64 - want).abs() / want < 0.01, "64 SMs: {t64}, want {want}");
}

#[test]
fn fewer_sms_cost_compute_bound_kernels_waves_but_small_kernels_nothing() {
    let desc = GpuDesc::h100_sxm();
    // Big fp16 GEMM: many waves, compute-bound.
    let big = gemm(4096, 4096, 4096, 128);
    let full = alone(&desc, &big, DType::F16, 0, all(), None);
    let quarter = alone(&desc, &big, DType::F16, partition_of_size(&desc, 32), all(), None);
    let ratio = quarter as f64 / full as f64;
    assert!((3.2..4.5).contains(&ratio), "32 of 132 SMs: {quarter} vs {full} ns (x{ratio:.2})");
    // A small GEMM (64 blocks) fits on 32 SMs: right-sizing costs (almost) nothing.
    let small = gemm(512, 512, 256, 64);
    let full = alone(&desc, &small, DType::F16, 0, all(), None);
    let narrow = alone(&desc, &small, DType::F16, partition_of_size(&desc, 32), all(), None);
    assert!((narrow as f64) < full as f64 * 1.05, "small kernel on 32 SMs: {narrow} vs {full}");
}

#[test]
fn memory_bound_kernels_lose_less_than_their_sm_share() {
    let desc = GpuDesc::h100_sxm();
    let k = eltwise_add(64 << 20, 4096);
    let full = alone(&desc, &k, DType::F32, 0, all(), None);
    let half = alone(&desc, &k, DType::F32, partition_of_size(&desc, 64), all(), None);
    let ratio = half as f64 / full as f64;
    assert!(ratio < 1.3, "memory-bound kernel on 64 SMs: x{ratio:.2}");
    // It is memory-bound: 768 MiB at about the kernel share of 3.0 TB/s.
    let bytes = k.bytes_moved(DType::F32) as f64;
    let gbps = bytes / full as f64;
    assert!((2000.0..2700.0).contains(&gbps), "{gbps:.0} GB/s");
}

#[test]
fn co_running_kernels_share_memory_bandwidth_but_not_compute_across_partitions() {
    // SM sharing and bandwidth pools alone: the co-run interference off (tested below).
    let calibrated = GpuDesc::h100_sxm();
    let mut desc = calibrated.clone();
    desc.model.corun_slowdown_per_launch = 0.0;
    let p0 = partition_of_size(&desc, 64);
    let p1 = p0 + 1;
    let together_on = |desc: &GpuDesc, k: &Kernel, dtype: DType| -> (u64, u64) {
        let mut gpu = SimGpu::new(desc.clone(), exact());
        let mut ids = Vec::new();
        let mut keep = Vec::new();
        for p in [p0, p1] {
            let s = gpu.create_stream(0).unwrap();
            let args = alloc_args(&mut gpu, k, dtype, &[]);
            let pt = ptrs(&args);
            let mut req = request(k, dtype, shape(k, 256, 0), &pt, s);
            req.partition = PartitionId(p);
            ids.push(gpu.launch(&req).unwrap());
            keep.push(args);
        }
        run_until_done(&mut gpu, &ids);
        drain(&mut gpu);
        (span(gpu.trace(), ids[0]), span(gpu.trace(), ids[1]))
    };
    let together = |k: &Kernel, dtype: DType| together_on(&desc, k, dtype);
    let mem = eltwise_add(32 << 20, 4096);
    let alone_mem = alone(&desc, &mem, DType::F32, p0, all(), None);
    let (a, b) = together(&mem, DType::F32);
    assert!(
        a as f64 > alone_mem as f64 * 1.4 && b as f64 > alone_mem as f64 * 1.4,
        "memory-bound pair: {a} {b} vs alone {alone_mem}"
    );
    let cmp = gemm(2048, 2048, 2048, 128);
    let alone_cmp = alone(&desc, &cmp, DType::F16, p0, all(), None);
    let (a, b) = together(&cmp, DType::F16);
    assert!(
        (a as f64) < alone_cmp as f64 * 1.05 && (b as f64) < alone_cmp as f64 * 1.05,
        "compute-bound pair: {a} {b} vs alone {alone_cmp}"
    );
    // With the calibrated co-run interference, a block that starts while the other launch works
    // takes up to 1 + 0.14 times as long: the partitions share L2 and the memory system. (The first
    // launch's single wave started alone; the second's started beside it.)
    let factor = 1.0 + calibrated.model.corun_slowdown_per_launch;
    assert!(factor > 1.0, "the H100 SXM description calibrates a co-run interference");
    let (a, b) = together_on(&calibrated, &cmp, DType::F16);
    let (ra, rb) = (a as f64 / alone_cmp as f64, b as f64 / alone_cmp as f64);
    assert!(ra < factor * 1.05 && rb < factor * 1.05, "compute-bound pair with interference: x{ra:.3} x{rb:.3}");
    assert!(ra.max(rb) > 1.0 + 0.5 * (factor - 1.0), "the later launch is slowed: x{ra:.3} x{rb:.3}");
}

#[test]
fn kernels_sharing_sms_split_their_slots_and_slow_each_other() {
    let desc = GpuDesc::h100_sxm();
    // A: limited by registers (4 CTAs of 256 threads x 64 registers per SM).
    let a = gemm(4096, 4096, 1024, 128);
    // B: limited by shared memory (4 CTAs of 56 KiB per SM), few threads and registers.
    let b = gemm(4096, 4096, 1024, 128);
    let b_shape = shape(&b, 64, 56 * 1024);
    let run = |with_a: bool| -> (Option<u64>, u64) {
        let mut gpu = SimGpu::new(desc.clone(), exact());
        assert_eq!(gpu.kernel_resources(&a, DType::F16, &shape(&a, 256, 0)).unwrap().ctas_per_sm_max, 4);
        assert_eq!(gpu.kernel_resources(&b, DType::F16, &b_shape).unwrap().ctas_per_sm_max, 4);
        let mut keep = Vec::new();
        let mut id_a = None;
        if with_a {
            let s = gpu.create_stream(0).unwrap();
            let args = alloc_args(&mut gpu, &a, DType::F16, &[]);
            let p = ptrs(&args);
            let mut req = request(&a, DType::F16, shape(&a, 256, 0), &p, s);
            req.ctas = 132 * 2;
            id_a = Some(gpu.launch(&req).unwrap());
            keep.push(args);
        }
        let s = gpu.create_stream(0).unwrap();
        let args = alloc_args(&mut gpu, &b, DType::F16, &[]);
        let p = ptrs(&args);
        let id_b = gpu.launch(&request(&b, DType::F16, b_shape, &p, s)).unwrap();
        drain(&mut gpu);
        (id_a.map(|id| span(gpu.trace(), id)), span(gpu.trace(), id_b))
    };
    let a_alone = alone(&desc, &a, DType::F16, 0, all(), None);
    let (_, b_alone) = run(false);
    let (a_shared, b_shared) = run(true);
    let a_shared = a_shared.unwrap();
    // A on half its slots runs twice the waves, and while B runs beside it both are at SM load 1.5.
    println!("A {a_shared} (alone {a_alone}), B {b_shared} (alone {b_alone})");
    assert!(a_shared as f64 > 2.2 * a_alone as f64, "A: {a_shared} vs alone {a_alone}");
    assert!(b_shared as f64 > 1.3 * b_alone as f64, "B: {b_shared} vs alone {b_alone}");
}

#[test]
fn launch_latency_and_notifications_match_the_probe() {
    // The device probe's raw launch on an H200 (the driver called on the launching thread, no
    // dispatcher): 3.5 us to the hardware queue, 0.5 to dispatch, 2.0 until the start is seen, no
    // protocol tail and no dispatcher time per record. The H200's description itself carries the
    // dispatcher's path (a launcher thread's hop, the protocol's tails, as calibrated on the H100:
    // data/gpus/h200.json), so the probe's terms are set here.
    let mut desc = GpuDesc::h200();
    desc.latency.launch_host_ns = 2_300;
    desc.latency.launch_latency_ns = 3_500;
    desc.latency.grid_dispatch_ns = 500;
    desc.latency.grid_complete_ns = 500;
    desc.latency.notify_delay_ns = 2_000;
    desc.latency.event_host_ns = 0;
    desc.latency.profiled_launch_tail_ns = None;
    desc.latency.light_launch_tail_ns = None;
    desc.latency.silent_launch_tail_ns = None;
    let mut gpu = SimGpu::new(desc, SimOptions { seed: 42, compute: false, ..SimOptions::default() });
    println!("seed 42");
    let k = eltwise_add(256, 256);
    let s = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, &k, DType::F32, &[]);
    let p = ptrs(&args);
    let (mut start_seen, mut done_seen) = (Vec::new(), Vec::new());
    let mut buf = Vec::new();
    for _ in 0..2000 {
        let t0 = gpu.now_ns();
        let id = gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &p, s)).unwrap();
        let mut started = false;
        loop {
            buf.clear();
            gpu.poll(&mut buf).unwrap();
            for e in &buf {
                match *e {
                    GpuEvent::CtasPlaced { launch, .. } if launch == id && !started => {
                        started = true;
                        start_seen.push(gpu.now_ns() - t0);
                    }
                    GpuEvent::LaunchDone { launch, .. } if launch == id => done_seen.push(gpu.now_ns() - t0),
                    _ => {}
                }
            }
            if done_seen.len() == start_seen.len() && started {
                break;
            }
            let now = gpu.now_ns();
            gpu.wait(now + 1_000_000).unwrap();
        }
        drain(&mut gpu);
    }
    let pct = |v: &mut Vec<u64>, p: f64| {
        v.sort_unstable();
        v[((v.len() - 1) as f64 * p) as usize]
    };
    let (p50, p99) = (pct(&mut start_seen, 0.5), pct(&mut start_seen, 0.99));
    println!("launch -> start seen p50 {p50} ns p99 {p99} ns; -> done seen p50 {} ns", pct(&mut done_seen, 0.5));
    assert!((5_000..7_000).contains(&p50), "probe: 6.0 us p50, simulated {p50}");
    assert!((7_500..12_000).contains(&p99), "probe: 9.7 us p99, simulated {p99}");
    let done50 = pct(&mut done_seen, 0.5);
    assert!((6_000..9_000).contains(&done50), "launch + sync round trip 7.2 us on the probe, simulated {done50}");
}

/// Three 300 us single-CTA kernels: stream A issues two, then stream B one.
fn hol_experiment(queues: u32) -> (u64, u64) {
    let mut desc = GpuDesc::h100_sxm();
    desc.hardware_queues = queues;
    let mut gpu = SimGpu::new(desc, exact());
    let k = eltwise_add(1024, 1024);
    gpu.register_kernel(
        &k,
        DType::F32,
        MeasuredKernel { duration_ns: 300_000, sm_count: 132, duration_by_sms: vec![], resources: None },
    );
    let a = gpu.create_stream(0).unwrap();
    let b = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, &k, DType::F32, &[]);
    let p = ptrs(&args);
    let a1 = gpu.launch(&request(&k, DType::F32, shape(&k, 128, 0), &p, a)).unwrap();
    let _a2 = gpu.launch(&request(&k, DType::F32, shape(&k, 128, 0), &p, a)).unwrap();
    let b1 = gpu.launch(&request(&k, DType::F32, shape(&k, 128, 0), &p, b)).unwrap();
    let ev = drain(&mut gpu);
    (done_at(&ev, a1).2, first_placed_at(&ev, b1).unwrap())
}

#[test]
fn streams_sharing_a_hardware_queue_block_behind_its_head() {
    let (a1_done, b1_start) = hol_experiment(1);
    assert!(b1_start > a1_done, "one queue: B must wait behind A's second kernel ({b1_start} vs {a1_done})");
    let (a1_done, b1_start) = hol_experiment(8);
    assert!(b1_start < 20_000 && b1_start < a1_done, "separate queues: B starts at once ({b1_start})");
}

#[test]
fn a_stream_runs_its_commands_in_order() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), exact());
    let k = gemm(1024, 1024, 512, 64);
    let s = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, &k, DType::F16, &[]);
    let p = ptrs(&args);
    let ids: Vec<_> = (0..5).map(|_| gpu.launch(&request(&k, DType::F16, shape(&k, 256, 0), &p, s)).unwrap()).collect();
    let ev = drain(&mut gpu);
    let lat = &GpuDesc::h100_sxm().latency;
    for w in ids.windows(2) {
        let prev_done = done_at(&ev, w[0]).2;
        let next_start = first_placed_at(&ev, w[1]).unwrap();
        assert_eq!(next_start, prev_done + lat.grid_complete_ns + lat.grid_dispatch_ns, "back-to-back kernels of one stream");
    }
}

#[test]
fn higher_priority_grids_are_placed_before_waiting_ones() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), exact());
    let big = gemm(8192, 8192, 256, 128);
    let small = gemm(256, 256, 256, 64);
    let low = gpu.create_stream(0).unwrap();
    let low2 = gpu.create_stream(0).unwrap();
    let high = gpu.create_stream(5).unwrap();
    let a = alloc_args(&mut gpu, &big, DType::F16, &[]);
    let b = alloc_args(&mut gpu, &small, DType::F16, &[]);
    let (pa, pb) = (ptrs(&a), ptrs(&b));
    // The big grid has more CTAs than fit (explicit count), a second low-priority grid waits behind
    // it, then a high-priority one arrives.
    let mut req = request(&big, DType::F16, shape(&big, 256, 0), &pa, low);
    req.ctas = big.logical_blocks();
    let g_big = gpu.launch(&req).unwrap();
    let g_low = gpu.launch(&request(&small, DType::F16, shape(&small, 256, 0), &pb, low2)).unwrap();
    let g_high = gpu.launch(&request(&small, DType::F16, shape(&small, 256, 0), &pb, high)).unwrap();
    let ev = drain(&mut gpu);
    let high_start = first_placed_at(&ev, g_high).unwrap();
    let low_start = first_placed_at(&ev, g_low).unwrap();
    let big_done = done_at(&ev, g_big).2;
    assert!(high_start < low_start, "high priority placed first: {high_start} vs {low_start}");
    assert!(high_start < big_done, "the high-priority grid overtakes the big grid's unplaced CTAs");
}

#[test]
fn masked_launches_work_only_on_their_sms() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), exact());
    let k = gemm(4096, 4096, 256, 128);
    let s = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, &k, DType::F16, &[]);
    let p = ptrs(&args);
    let mut req = request(&k, DType::F16, shape(&k, 256, 0), &p, s);
    req.sm_mask = SmMask::range(10, 20);
    let id = gpu.launch(&req).unwrap();
    let ev = drain(&mut gpu);
    let (next, preempted, _) = done_at(&ev, id);
    assert_eq!((next, preempted), (k.logical_blocks(), false));
    let mut blocks = 0;
    for e in &ev {
        match *e {
            GpuEvent::CtasPlaced { sm, .. } => assert!((10..30).contains(&sm), "CTA reported on SM {sm}"),
            GpuEvent::CtasFinished { blocks: b, .. } => blocks += b,
            _ => {}
        }
    }
    assert_eq!(blocks, k.logical_blocks());
}

#[test]
fn preemption_stops_at_a_block_boundary_and_resume_finishes_the_rest() {
    // The preempt flag in mapped host memory (polled) and in device memory (read at every take).
    let host = GpuDesc::h100_sxm();
    let mut device = host.clone();
    device.latency.preempt_flag_write_ns = Some(3_000);
    // Each within its bound (blocks of ~110 us here: where the flag lands against the CTAs' takes
    // decides the latency, not how it gets there).
    preempt_and_resume(host);
    preempt_and_resume(device);
}

/// Preempts a long GEMM 100 us in; checks the stop against its bound, and the resume.
fn preempt_and_resume(desc: GpuDesc) {
    let mut gpu = SimGpu::new(desc.clone(), exact());
    let k = gemm(8192, 8192, 2048, 128);
    let n = k.logical_blocks();
    let s = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, &k, DType::F16, &[]);
    let p = ptrs(&args);
    let id = gpu.launch(&request(&k, DType::F16, shape(&k, 256, 0), &p, s)).unwrap();
    let t = gpu.now_ns();
    gpu.wait(t + 100_000).unwrap();
    let mut ev = Vec::new();
    gpu.poll(&mut ev).unwrap();
    let t_preempt = gpu.now_ns();
    gpu.preempt(id).unwrap();
    ev.extend(run_until_done(&mut gpu, &[id]));
    let (next, preempted, at) = done_at(&ev, id);
    assert!(preempted && next > 0 && next < n, "stopped at {next} of {n}");
    let occ = gpu.kernel_resources(&k, DType::F16, &shape(&k, 256, 0)).unwrap().ctas_per_sm_max;
    let block_ns =
        gpu.estimate_duration_ns(&k, DType::F16, &shape(&k, 256, 0), 132).unwrap() / (n as u64).div_ceil(132 * occ as u64);
    // The next take polls the flag (at most every preempt_poll_ns), one PCIe read later the stop bit
    // is set; blocks taken before that finish. CTAs move in waves here, so that is up to two blocks.
    // A device flag is read by the first take after its write lands.
    let flag_ns = match desc.latency.preempt_flag_write_ns {
        Some(w) => w,
        None => desc.latency.preempt_poll_ns + desc.latency.preempt_flag_delay_ns,
    };
    let bound = flag_ns + 2 * block_ns;
    println!("preempted {} ns after the call (bound {bound})", at - t_preempt);
    assert!(at - t_preempt <= bound, "preempted after {} ns", at - t_preempt);
    let mut req = request(&k, DType::F16, shape(&k, 256, 0), &p, s);
    req.first_block = next;
    let id2 = gpu.launch(&req).unwrap();
    ev.extend(drain(&mut gpu));
    assert_eq!(done_at(&ev, id2).0, n);
    let blocks: u32 = ev.iter().map(|e| if let GpuEvent::CtasFinished { blocks, .. } = e { *blocks } else { 0 }).sum();
    assert_eq!(blocks, n, "every block ran exactly once across preempt and resume");
}

#[test]
fn copies_run_at_pcie_rate_and_share_the_link_with_host_reads() {
    let desc = GpuDesc::h100_sxm();
    let bytes = 55_600_000u64;
    let copy_time = |with_kernel: bool| -> u64 {
        let mut gpu = SimGpu::new(desc.clone(), exact());
        let src = gpu.alloc(bytes, MemKind::HostMapped).unwrap();
        let dst = gpu.alloc(bytes, MemKind::Device).unwrap();
        let s = gpu.create_stream(0).unwrap();
        let k = gemm(64, 8192, 8192, 64);
        let mut keep = Vec::new();
        if with_kernel {
            // Weights (argument 1) read straight from host memory.
            let args = alloc_args(&mut gpu, &k, DType::F16, &[1]);
            let ks = gpu.create_stream(0).unwrap();
            let p = ptrs(&args);
            gpu.launch(&request(&k, DType::F16, shape(&k, 256, 0), &p, ks)).unwrap();
            keep.push(args);
        }
        let t0 = gpu.now_ns();
        let c = gpu.copy_async(dst.ptr, src.ptr, bytes, s).unwrap();
        let ev = drain(&mut gpu);
        let done = ev
            .iter()
            .find_map(|e| if let GpuEvent::CopyDone { copy, at_ns } = *e { (copy == c).then_some(at_ns) } else { None })
            .unwrap();
        done - t0
    };
    let alone_t = copy_time(false);
    assert!((1_000_000..1_010_000).contains(&alone_t), "55.6 MB at 55.6 GB/s: {alone_t} ns");
    let shared = copy_time(true);
    assert!(shared > alone_t + 100_000, "a kernel reading host memory slows the copy: {shared} vs {alone_t}");
}

#[test]
fn kernels_reading_host_memory_are_bound_by_pcie() {
    let desc = GpuDesc::h100_sxm();
    let k = gemm(64, 8192, 8192, 64);
    let run = |host: &[usize]| {
        let mut gpu = SimGpu::new(desc.clone(), exact());
        let args = alloc_args(&mut gpu, &k, DType::F16, host);
        let s = gpu.create_stream(0).unwrap();
        let p = ptrs(&args);
        let id = gpu.launch(&request(&k, DType::F16, shape(&k, 256, 0), &p, s)).unwrap();
        drain(&mut gpu);
        span(gpu.trace(), id)
    };
    let dev = run(&[]);
    let host = run(&[1]);
    let weight_bytes = 8192.0 * 8192.0 * 2.0;
    let gbps = weight_bytes / host as f64;
    assert!(host > 10 * dev, "host-mapped weights: {host} vs {dev} ns");
    assert!((40.0..52.0).contains(&gbps), "weights streamed at {gbps:.1} GB/s (probe: 51.4)");
}

#[test]
fn invalid_requests_are_errors() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), exact());
    let k = eltwise_add(4096, 256);
    let s = gpu.create_stream(0).unwrap();
    let args = alloc_args(&mut gpu, &k, DType::F32, &[]);
    let p = ptrs(&args);
    let mut req = request(&k, DType::F32, shape(&k, 256, 0), &p, s);
    req.stream = StreamId(99);
    assert!(matches!(gpu.launch(&req), Err(GpuError::Invalid(_))));
    let mut req = request(&k, DType::F32, shape(&k, 256, 0), &p, s);
    req.partition = PartitionId(1000);
    assert!(matches!(gpu.launch(&req), Err(GpuError::Invalid(_))));
    let mut req = request(&k, DType::F32, shape(&k, 256, 0), &p, s);
    req.sm_mask = SmMask::EMPTY;
    assert!(matches!(gpu.launch(&req), Err(GpuError::Invalid(_))));
    let mut req = request(&k, DType::F32, shape(&k, 256, 0), &p, s);
    req.first_block = k.logical_blocks() + 1;
    assert!(matches!(gpu.launch(&req), Err(GpuError::Invalid(_))));
    let bad = [p[0], p[1], DevicePtr(12)];
    assert!(matches!(gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &bad, s)), Err(GpuError::Invalid(_))));
    assert!(matches!(gpu.launch(&request(&k, DType::F32, shape(&k, 2048, 0), &p, s)), Err(GpuError::Invalid(_))));
    assert!(matches!(gpu.launch(&request(&k, DType::F32, shape(&k, 256, 300 * 1024), &p, s)), Err(GpuError::Invalid(_))));
    assert!(matches!(gpu.preempt(LaunchId(777)), Err(GpuError::Invalid(_))));
    // Freeing memory a launch in flight uses is refused; after it finished it is fine.
    let id = gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &p, s)).unwrap();
    assert!(matches!(gpu.free(args[0]), Err(GpuError::Invalid(_))));
    run_until_done(&mut gpu, &[id]);
    drain(&mut gpu);
    gpu.preempt(id).unwrap();
    for a in args {
        gpu.free(a).unwrap();
    }
    assert!(matches!(gpu.alloc(u64::MAX / 2, MemKind::Device), Err(GpuError::OutOfMemory { .. })));
}

#[test]
fn roofline_estimates_are_in_a_sane_range() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), exact());
    // 4096^3 fp16 GEMM = 137 GFLOP: at 35% of 989 TFLOP/s about 0.4 ms.
    let k = gemm(4096, 4096, 4096, 128);
    let t = gpu.estimate_duration_ns(&k, DType::F16, &shape(&k, 256, 0), 132).unwrap();
    assert!((300_000..700_000).contains(&t), "{t} ns");
    // A tiny element-wise kernel is dominated by latency: a few microseconds, most of them the
    // grid's dispatch and completion (3.7 us together, measured between a job's kernels on an H100).
    let k = eltwise_add(1024, 1024);
    let t = gpu.estimate_duration_ns(&k, DType::F32, &shape(&k, 256, 0), 132).unwrap();
    assert!((1_000..8_000).contains(&t), "{t} ns");
}

/// A `kairos profile` JSON of a plan drives the simulated durations of that plan's launches;
/// a profile of another plan is refused.
#[test]
fn registered_profiles_set_the_durations_of_their_plans_launches() {
    use kairos_gpu::profile::{KernelProfile, ModelProfile, ProfileSet};
    use kairos_ir::plan::*;
    let kernels = [gemm(256, 256, 256, 32), eltwise_add(256 * 256, 1024)];
    let durations = [40_000u64, 15_000];
    let launches: Vec<Launch> = kernels
        .iter()
        .enumerate()
        .map(|(i, k)| Launch {
            name: format!("k{i}"),
            kernel: *k,
            dtype: DType::F32,
            shape: shape(k, 256, 0),
            args: vec![],
            deps: vec![],
            layer: None,
            flops: k.flops(),
            bytes: k.bytes_moved(DType::F32),
        })
        .collect();
    let plan = Plan {
        model: "p".into(),
        dtype: DType::F32,
        inputs: vec![],
        outputs: vec![],
        launches,
        arena_bytes: 0,
        weight_bytes: 0,
        layers: vec![],
        weights: Default::default(),
    };
    let profile = ModelProfile {
        model: "p".into(),
        dtype: DType::F32,
        batch: 1,
        device: "NVIDIA H100 80GB HBM3".into(),
        sm_count: 132,
        latency_ns: 60_000,
        kernels: kernels
            .iter()
            .zip(durations)
            .enumerate()
            .map(|(i, (k, d))| KernelProfile {
                launch: i as u32,
                name: format!("k{i}"),
                kernel: k.name().into(),
                duration_ns: d,
                logical_blocks: k.logical_blocks(),
                ctas: k.logical_blocks(),
                threads_per_cta: 256,
                registers_per_thread: 40,
                shared_mem_bytes: 8192,
                ctas_per_sm_max: 6,
                occupancy: 0.75,
                min_sms: 32,
                duration_by_sms: vec![],
            })
            .collect(),
        layers: None,
        placements: None,
    };
    // The profile's kernel-by-kernel latency exceeds the kernels' sum: without a tail set by the
    // description, each launch completes that excess, spread evenly, after its last CTA leaves
    // (the calibrated completion tail); the H100 SXM's description sets its measured one.
    let calibrated = (profile.latency_ns - durations.iter().sum::<u64>()) / kernels.len() as u64;
    assert_eq!(calibrated, 2500);
    let h100_tail = GpuDesc::h100_sxm().latency.profiled_launch_tail_ns.expect("the H100 SXM's tail is measured");
    for (fixed, tail) in [(None, calibrated), (Some(h100_tail), h100_tail)] {
        let mut desc = GpuDesc::h100_sxm();
        desc.latency.profiled_launch_tail_ns = fixed;
        let mut gpu = SimGpu::new(desc, exact());
        assert_eq!(gpu.register_plan(&plan, &profile).unwrap(), 2);
        assert_eq!(gpu.registered_kernels(), 2);
        let s = gpu.create_stream(0).unwrap();
        for (k, d) in kernels.iter().zip(durations) {
            let res = gpu.kernel_resources(k, DType::F32, &shape(k, 256, 0)).unwrap();
            assert_eq!((res.registers_per_thread, res.shared_mem_bytes), (40, 8192), "resources come from the profile");
            let args = alloc_args(&mut gpu, k, DType::F32, &[]);
            let p = ptrs(&args);
            let id = gpu.launch(&request(k, DType::F32, shape(k, 256, 0), &p, s)).unwrap();
            drain(&mut gpu);
            let t = span(gpu.trace(), id);
            assert!(t.abs_diff(d + tail) <= 4, "profiled {d} ns + tail {tail} ns, simulated {t}");
        }
    }
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), exact());
    let mut other = profile.clone();
    other.kernels[1].logical_blocks += 1;
    assert!(gpu.register_plan(&plan, &other).is_err());
    // Through a profile set (what a profile folder gives), a launch whose block count changed
    // gets the roofline and the others keep their measured times; other launches, nothing.
    let (part, dropped) = other.matching_part(&plan).expect("the same launches");
    assert_eq!((part.kernels.len(), dropped), (1, 1));
    assert_eq!(part.latency_ns, other.latency_ns - other.kernels[1].duration_ns, "the dropped launch's time leaves the latency");
    let mut partly = SimGpu::new(GpuDesc::h100_sxm(), exact());
    assert_eq!(partly.register_profiles([&plan], &ProfileSet { models: vec![other.clone()] }).unwrap(), 1);
    assert_eq!(partly.registered_kernels(), 1);
    // Retiled (the autotuner picked other tiles): every launch keeps its time, the retiled one
    // takes the plan's block count and loses its right size.
    let (kept, retiled) = other.retiled_for(&plan).expect("the same launches");
    assert_eq!(retiled, 1);
    kept.check_plan(&plan).expect("a retiled profile matches the plan");
    assert_eq!(
        kept.kernels.iter().map(|k| k.duration_ns).collect::<Vec<_>>(),
        other.kernels.iter().map(|k| k.duration_ns).collect::<Vec<_>>()
    );
    assert_eq!((kept.kernels[1].min_sms, kept.kernels[1].duration_by_sms.len()), (0, 0));
    assert_eq!(kept.kernels[0], other.kernels[0], "an unchanged launch keeps everything");
    let mut renamed = other.clone();
    renamed.kernels[0].kernel = "softmax".into();
    assert!(renamed.matching_part(&plan).is_none(), "another kernel at a launch: nothing matches");
    assert!(renamed.retiled_for(&plan).is_none(), "another kernel at a launch: not a retiling");
    let mut none = SimGpu::new(GpuDesc::h100_sxm(), exact());
    assert_eq!(none.register_profiles([&plan], &ProfileSet { models: vec![renamed] }).unwrap(), 0);
    assert_eq!(none.registered_kernels(), 0);
    other = profile.clone();
    other.kernels[0].launch = 5;
    assert!(gpu.register_plan(&plan, &other).is_err());
    // A folder of profiles registers the plans it has a profile for; a missing folder none.
    let dir = std::env::temp_dir().join(format!("kairos-sim-profiles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    profile.save(&dir.join("p.json")).unwrap();
    let mut fresh = SimGpu::new(GpuDesc::h100_sxm(), exact());
    assert_eq!(fresh.register_profile_dir(&dir, [&plan]).unwrap(), 1);
    assert_eq!(fresh.registered_kernels(), 2);
    assert_eq!(fresh.register_profile_dir(&dir.join("missing"), [&plan]).unwrap(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

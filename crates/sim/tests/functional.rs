//! Functional results: the simulator runs the CPU reference kernels on exactly the logical blocks
//! that executed, so outputs are real, preempted-and-resumed launches included.

mod common;

use common::*;
use kairos_gpu::exec::{execute_plan, upload_weights};
use kairos_gpu::*;
use kairos_ir::plan::*;
use kairos_ir::{DType, Tensor};
use kairos_sim::*;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::sync::Arc;

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// x += 1 in place, as one job preempted at random moments and resumed from the reported block
/// each time: every element must be incremented exactly once.
#[test]
fn preempted_and_resumed_launches_run_every_block_exactly_once() {
    for seed in test_seeds(12, 0xf00d) {
        println!("seed {seed}");
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut gpu = SimGpu::new(GpuDesc::h100_pcie(), SimOptions { seed, check_invariants: true, ..SimOptions::default() });
        let n = rng.random_range(1_000..300_000u32);
        let k = eltwise_add(n, pick_block(&mut rng));
        // Long enough that preemptions land mid-run.
        let duration_ns = rng.random_range(50_000..1_000_000);
        gpu.register_kernel(
            &k,
            DType::F32,
            MeasuredKernel { duration_ns, sm_count: 114, duration_by_sms: vec![], resources: None },
        );
        let x = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        let ones = gpu.alloc(n as u64 * 4, MemKind::HostMapped).unwrap();
        let init: Vec<f32> = (0..n).map(|i| (i % 977) as f32).collect();
        gpu.write(x.ptr, &bytes_of(&init)).unwrap();
        gpu.write(ones.ptr, &bytes_of(&vec![1.0; n as usize])).unwrap();
        let s = gpu.create_stream(0).unwrap();
        let args = [x.ptr, ones.ptr, x.ptr];
        let mut first = 0;
        let mut launches = 0;
        let mut preempted = 0;
        while first < k.logical_blocks() {
            let mut req = request(&k, DType::F32, shape(&k, 256, 0), &args, s);
            req.first_block = first;
            // Few persistent CTAs take blocks over time, so a preemption finds blocks not yet taken.
            if rng.random_bool(0.8) {
                req.ctas = rng.random_range(1..32);
            }
            let id = gpu.launch(&req).unwrap();
            launches += 1;
            if launches < 20 && rng.random_bool(0.8) {
                let now = gpu.now_ns();
                gpu.wait(now + rng.random_range(0..duration_ns)).unwrap();
                gpu.preempt(id).unwrap();
            }
            let ev = run_until_done(&mut gpu, &[id]);
            let (next, _, _) = done_at(&ev, id);
            assert!(next >= first);
            if next < k.logical_blocks() {
                preempted += 1;
            }
            first = next;
        }
        drain(&mut gpu);
        println!("  {n} elements, {} blocks, {launches} launches, {preempted} stopped early", k.logical_blocks());
        let mut out = vec![0u8; n as usize * 4];
        gpu.read(x.ptr, &mut out).unwrap();
        let got = f32s(&out);
        for (i, (g, w)) in got.iter().zip(&init).enumerate() {
            assert_eq!(*g, w + 1.0, "seed {seed}: element {i} after {launches} launches");
        }
    }
}

fn pick_block(rng: &mut SmallRng) -> u32 {
    [64, 256, 1000, 4096][rng.random_range(0..4)]
}

/// A two-launch plan (GEMM with bias and ReLU, then an add) on the simulator, through the same
/// plan runner the CUDA backend uses, against the CPU reference executor.
#[test]
fn a_plan_runs_on_the_simulator_as_on_the_cpu() {
    let (m, n, k) = (33u32, 70u32, 45u32);
    let mut g = match gemm(m, n, k, 16) {
        Kernel::Gemm(p) => p,
        _ => unreachable!(),
    };
    g.epilogue = EpilogueParams { bias: true, residual: false, act: kairos_ir::graph::Act::Relu };
    let gemm_k = Kernel::Gemm(g);
    let add = eltwise_add(m * n, 256);
    let w_bytes = (k * n * 4) as u64;
    let b_off = w_bytes.next_multiple_of(BUFFER_ALIGN_BYTES);
    let weight_bytes = b_off + n as u64 * 4;
    let mut rng = SmallRng::seed_from_u64(3);
    let mut weights = AlignedBytes::zeroed(weight_bytes as usize);
    for c in weights.as_mut_slice().chunks_exact_mut(4) {
        c.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
    }
    let c_len = (m * n * 4) as u64;
    let buf = |space, offset_bytes, len_bytes| BufRef { space, offset_bytes, len_bytes };
    let launch = |name: &str, kernel: Kernel, args: Vec<BufRef>, deps: Vec<u32>| Launch {
        name: name.into(),
        kernel,
        dtype: DType::F32,
        shape: LaunchShape { logical_blocks: kernel.logical_blocks(), threads_per_block: 128, shared_mem_bytes: 0 },
        args,
        deps,
        layer: None,
        flops: kernel.flops(),
        bytes: kernel.bytes_moved(DType::F32),
    };
    let plan = Plan {
        model: "tiny".into(),
        dtype: DType::F32,
        inputs: vec![IoTensor { name: "x".into(), shape: vec![m as usize, k as usize], dtype: DType::F32 }],
        outputs: vec![IoTensor { name: "y".into(), shape: vec![m as usize, n as usize], dtype: DType::F32 }],
        launches: vec![
            launch(
                "fc",
                gemm_k,
                vec![
                    buf(Space::Input(0), 0, (m * k * 4) as u64),
                    buf(Space::Weights, 0, w_bytes),
                    buf(Space::Weights, b_off, n as u64 * 4),
                    buf(Space::Arena, 0, c_len),
                ],
                vec![],
            ),
            launch(
                "double",
                add,
                vec![buf(Space::Arena, 0, c_len), buf(Space::Arena, 0, c_len), buf(Space::Output(0), 0, c_len)],
                vec![0],
            ),
        ],
        arena_bytes: c_len.next_multiple_of(BUFFER_ALIGN_BYTES),
        weight_bytes,
        layers: vec![],
        weights: Arc::new(weights),
    };
    plan.validate().unwrap();
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let input = Tensor::from_bytes(DType::F32, vec![m as usize, k as usize], &bytes_of(&x)).unwrap();
    let want = kairos_kernels::cpu::execute_plan(&plan, std::slice::from_ref(&input)).unwrap();

    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 9, check_invariants: true, ..SimOptions::default() });
    for kind in [MemKind::Device, MemKind::HostMapped] {
        let w = upload_weights(&mut gpu, &plan, kind).unwrap();
        let got = execute_plan(&mut gpu, &plan, w.ptr, std::slice::from_ref(&input), 4).unwrap();
        assert_eq!(got.outputs[0].to_bytes(), want[0].to_bytes(), "weights in {kind:?}");
        assert!(got.total_ns > 10_000, "two dependent launches take launch latency and more: {} ns", got.total_ns);
        assert!(f32s(&got.outputs[0].to_bytes()).iter().any(|&v| v > 0.0));
        gpu.free(w).unwrap();
    }
}

/// Host -> device copy, a kernel, device -> host copy, all on one stream: bytes flow through.
#[test]
fn copies_and_kernels_on_a_stream_move_real_data() {
    let mut gpu = SimGpu::new(GpuDesc::h200(), SimOptions { seed: 5, check_invariants: true, ..SimOptions::default() });
    let n = 10_000u32;
    let host_in = gpu.alloc(n as u64 * 4, MemKind::HostMapped).unwrap();
    let host_out = gpu.alloc(n as u64 * 4, MemKind::HostMapped).unwrap();
    let dev = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
    let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    gpu.write(host_in.ptr, &bytes_of(&v)).unwrap();
    let s = gpu.create_stream(0).unwrap();
    gpu.copy_async(dev.ptr, host_in.ptr, n as u64 * 4, s).unwrap();
    let k = eltwise_add(n, 512);
    let args = [dev.ptr, dev.ptr, dev.ptr];
    gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &args, s)).unwrap();
    gpu.copy_async(host_out.ptr, dev.ptr, n as u64 * 4, s).unwrap();
    let ev = drain(&mut gpu);
    assert_eq!(ev.iter().filter(|e| matches!(e, GpuEvent::CopyDone { .. })).count(), 2);
    let mut out = vec![0u8; n as usize * 4];
    gpu.read(host_out.ptr, &mut out).unwrap();
    assert_eq!(f32s(&out), v.iter().map(|x| x * 2.0).collect::<Vec<_>>());
}

/// Timing-only mode backs no memory and still runs the same schedule.
#[test]
fn timing_only_mode_keeps_the_schedule() {
    let run = |compute: bool| {
        let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 77, compute, ..SimOptions::default() });
        let k = gemm(512, 512, 512, 64);
        let args = alloc_args(&mut gpu, &k, DType::F16, &[]);
        let p = ptrs(&args);
        let s = gpu.create_stream(0).unwrap();
        for _ in 0..10 {
            gpu.launch(&request(&k, DType::F16, shape(&k, 256, 0), &p, s)).unwrap();
        }
        drain(&mut gpu);
        gpu.trace_hash()
    };
    assert_eq!(run(true), run(false));
}

/// The protocol's stream gate: a launch queued `after` one that is preempted stops before running
/// any block (it would read a partial result), and so does the one after it; a launch queued
/// without `after` runs whatever happened before it; `after` must name the stream's last launch.
#[test]
fn launches_queued_after_a_stopped_launch_stop_before_running() {
    for seed in test_seeds(6, 0x9a7e) {
        println!("seed {seed}");
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut gpu = SimGpu::new(GpuDesc::h100_pcie(), SimOptions { seed, check_invariants: true, ..SimOptions::default() });
        let n = 200_000u32;
        let k = eltwise_add(n, 1024);
        gpu.register_kernel(
            &k,
            DType::F32,
            MeasuredKernel { duration_ns: 400_000, sm_count: 114, duration_by_sms: vec![], resources: None },
        );
        let x = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        let y = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        let z = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        let ones = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        gpu.write(x.ptr, &bytes_of(&vec![0.0; n as usize])).unwrap();
        gpu.write(y.ptr, &bytes_of(&vec![0.0; n as usize])).unwrap();
        gpu.write(z.ptr, &bytes_of(&vec![0.0; n as usize])).unwrap();
        gpu.write(ones.ptr, &bytes_of(&vec![1.0; n as usize])).unwrap();
        let s = gpu.create_stream(0).unwrap();
        // x = x + 1, then y = x + 1 after it, then z = y + 1 after that.
        let (ax, ay, az) = ([x.ptr, ones.ptr, x.ptr], [x.ptr, ones.ptr, y.ptr], [y.ptr, ones.ptr, z.ptr]);
        let mut ra = request(&k, DType::F32, shape(&k, 256, 0), &ax, s);
        ra.ctas = 4;
        let a = gpu.launch(&ra).unwrap();
        let mut rb = request(&k, DType::F32, shape(&k, 256, 0), &ay, s);
        rb.after = Some(a);
        let b = gpu.launch(&rb).unwrap();
        // Not the stream's last launch any more: refused.
        let mut wrong = request(&k, DType::F32, shape(&k, 256, 0), &az, s);
        wrong.after = Some(a);
        assert!(matches!(gpu.launch(&wrong), Err(GpuError::Invalid(_))), "after must name the stream's last launch");
        let mut rc = request(&k, DType::F32, shape(&k, 256, 0), &az, s);
        rc.after = Some(b);
        let c = gpu.launch(&rc).unwrap();
        let now = gpu.now_ns();
        gpu.wait(now + rng.random_range(50_000..300_000)).unwrap();
        gpu.preempt(a).unwrap();
        let ev = run_until_done(&mut gpu, &[a, b, c]);
        let (next_a, preempted_a, _) = done_at(&ev, a);
        assert!(preempted_a && next_a < k.logical_blocks(), "the first launch was not stopped ({next_a})");
        for id in [b, c] {
            assert_eq!(done_at(&ev, id), (0, true, done_at(&ev, id).2), "a launch behind the stopped one ran blocks");
        }
        let mut out = vec![0u8; n as usize * 4];
        gpu.read(y.ptr, &mut out).unwrap();
        assert!(f32s(&out).iter().all(|&v| v == 0.0), "seed {seed}: y was written behind a stopped launch");
        // Resumed in order (a from where it stopped, b and c from scratch): exact results. The
        // resume of a is issued without `after`: the host knows what happened before it.
        let mut ra2 = request(&k, DType::F32, shape(&k, 256, 0), &ax, s);
        ra2.first_block = next_a;
        let a2 = gpu.launch(&ra2).unwrap();
        rb.after = Some(a2);
        let b2 = gpu.launch(&rb).unwrap();
        rc.after = Some(b2);
        let c2 = gpu.launch(&rc).unwrap();
        let ev = run_until_done(&mut gpu, &[a2, b2, c2]);
        for id in [a2, b2, c2] {
            assert_eq!(done_at(&ev, id).0, k.logical_blocks());
        }
        gpu.read(z.ptr, &mut out).unwrap();
        assert!(f32s(&out).iter().all(|&v| v == 3.0), "seed {seed}: z = ((0 + 1) + 1) + 1");
    }
}

/// A launch that does not report its CTAs (`report_ctas: false`, what whole-job streams ask for)
/// sends only its end, runs every block, and computes what a reporting launch computes.
#[test]
fn launches_that_report_only_their_end_send_no_cta_events() {
    let n = 100_000u32;
    let k = eltwise_add(n, 1024);
    let run = |report_ctas: bool| {
        let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 5, check_invariants: true, ..SimOptions::default() });
        let x = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        let out = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
        gpu.write(x.ptr, &bytes_of(&(0..n).map(|i| i as f32).collect::<Vec<_>>())).unwrap();
        let s = gpu.create_stream(0).unwrap();
        let args = [x.ptr, x.ptr, out.ptr];
        let r = LaunchRequest { report_ctas, ..request(&k, DType::F32, shape(&k, 256, 0), &args, s) };
        let id = gpu.launch(&r).unwrap();
        let events = run_until_done(&mut gpu, &[id]);
        let mut bytes = vec![0u8; n as usize * 4];
        gpu.read(out.ptr, &mut bytes).unwrap();
        (events, f32s(&bytes))
    };
    let (quiet, quiet_out) = run(false);
    let (loud, loud_out) = run(true);
    let cta_events =
        |e: &[GpuEvent]| e.iter().filter(|e| matches!(e, GpuEvent::CtasPlaced { .. } | GpuEvent::CtasFinished { .. })).count();
    assert_eq!(cta_events(&quiet), 0, "{quiet:?}");
    assert!(cta_events(&loud) > 0);
    let done = quiet
        .iter()
        .filter(|e| matches!(e, GpuEvent::LaunchDone { next_block, preempted: false, .. } if *next_block == k.logical_blocks()))
        .count();
    assert_eq!(done, 1, "{quiet:?}");
    assert_eq!(quiet_out, loud_out);
    assert_eq!(quiet_out, (0..n).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
}

/// Launches that need not report their end (`report_end: false`, not preemptible, no CTA or start
/// records: what whole-job dispatch issues before a job's last launch) are reported by the next
/// launch of their stream that reports its own, at its time and before it; when that launch
/// cannot be queued, they report their own.
#[test]
fn silent_launches_end_with_the_next_reporting_launch_on_their_stream() {
    let n = 50_000u32;
    let k = eltwise_add(n, 1024);
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 9, check_invariants: true, ..SimOptions::default() });
    let x = gpu.alloc(n as u64 * 4, MemKind::Device).unwrap();
    let s = gpu.create_stream(0).unwrap();
    let args = [x.ptr, x.ptr, x.ptr];
    let silent = |after| LaunchRequest {
        report_ctas: false,
        preemptible: false,
        report_end: false,
        after,
        ..request(&k, DType::F32, shape(&k, 256, 0), &args, s)
    };
    let a = gpu.launch(&silent(None)).unwrap();
    let b = gpu.launch(&silent(Some(a))).unwrap();
    let c = gpu.launch(&LaunchRequest { report_end: true, ..silent(Some(b)) }).unwrap();
    let events = run_until_done(&mut gpu, &[a, b, c]);
    let ends: Vec<(LaunchId, u64)> = events
        .iter()
        .filter_map(|e| match *e {
            GpuEvent::LaunchDone { launch, next_block, preempted: false, at_ns } if next_block == k.logical_blocks() => {
                Some((launch, at_ns))
            }
            _ => None,
        })
        .collect();
    assert_eq!(ends.iter().map(|e| e.0).collect::<Vec<_>>(), vec![a, b, c], "{events:?}");
    assert!(ends.iter().all(|e| e.1 == ends[2].1), "silent ends carry the reporting launch's time: {ends:?}");
    let mut bytes = vec![0u8; n as usize * 4];
    gpu.read(x.ptr, &mut bytes).unwrap();
    assert!(f32s(&bytes).iter().all(|&v| v == 0.0), "x = x + x three times from zero");

    // A launch that fails to queue leaves none waiting: the silent one before it reports itself.
    let d = gpu.launch(&silent(None)).unwrap();
    gpu.set_faults(kairos_sim::Faults { launch_failure: 1.0, ..Default::default() }).unwrap();
    assert!(gpu.launch(&LaunchRequest { report_end: true, ..silent(Some(d)) }).is_err());
    gpu.set_faults(kairos_sim::Faults::default()).unwrap();
    let events = run_until_done(&mut gpu, &[d]);
    assert!(events.iter().any(|e| matches!(e, GpuEvent::LaunchDone { launch, .. } if *launch == d)), "{events:?}");
}

//! How fast the simulator runs: a busy simulated GPU for a given span of virtual time, timing only.
//!
//! Client streams (16 by default) each keep 4 launches in flight, cycling through a ResNet-50-like mix of fp16
//! convolution-shaped GEMMs (batch 1, 7x7 to 56x56 feature maps) and element-wise kernels, on a
//! simulated H100 SXM with the roofline timing model. Reports simulated kernels, notifications and
//! internal steps per wall-clock second, and how much faster than real time the simulation runs.
//!
//! `cargo run --release -p kairos-sim --example sim_speed -- [simulated_seconds] [batch] [streams] [seed]`
//!
//! Batch 1 is the extreme for the simulator: small kernels, the host issuing back to back at its
//! 2.3 us per launch (435k launches per simulated second). Batch 8 keeps the GPU itself busy.

use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::graph::Act;
use kairos_ir::plan::*;
use kairos_sim::{GpuDesc, SimGpu, SimOptions};
use std::time::Instant;

fn gemm(m: u32, n: u32, k: u32, tile: u32) -> Kernel {
    Kernel::Gemm(GemmParams {
        batch0: 1,
        batch1: 1,
        m,
        n,
        k,
        a_stride0: 0,
        a_stride1: 0,
        a_stride_m: k as u64,
        a_stride_k: 1,
        b_stride0: 0,
        b_stride1: 0,
        b_stride_k: 1,
        b_stride_n: k as u64,
        c_stride0: 0,
        c_stride1: 0,
        c_stride_m: n as u64,
        r_stride0: 0,
        r_stride1: 0,
        r_stride_m: 0,
        alpha: 1.0,
        epilogue: EpilogueParams { bias: true, residual: false, act: Act::Relu },
        tile_m: tile,
        tile_n: tile,
        split_k: 1,
    })
}

fn eltwise(n: u32) -> Kernel {
    let mut shape = [1u32; ELTWISE_RANK_MAX];
    shape[ELTWISE_RANK_MAX - 1] = n;
    let mut s = [0u64; ELTWISE_RANK_MAX];
    s[ELTWISE_RANK_MAX - 1] = 1;
    Kernel::Eltwise(EltwiseParams {
        func: EltFunc::Binary(BinaryOpParam::Add),
        act: Act::Relu,
        inputs: 2,
        shape,
        out_strides: s,
        in_strides: [s, s, [0; ELTWISE_RANK_MAX]],
        in_dtypes: [DType::F16; 3],
        out_dtype: DType::F16,
        scalars: [0.0; 2],
        elems_per_block: 2048,
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let seconds: f64 = args.next().map(|s| s.parse().expect("simulated seconds")).unwrap_or(60.0);
    let batch: u32 = args.next().map(|s| s.parse().expect("batch")).unwrap_or(1);
    let stream_count: usize = args.next().map(|s| s.parse().expect("streams")).unwrap_or(16);
    let seed: u64 = args.next().map(|s| s.parse().expect("seed")).unwrap_or(1);
    println!("seed {seed}, batch {batch}, {stream_count} streams, {seconds} simulated seconds on a simulated H100 SXM");

    // One "request" of a ResNet-50-like network at batch 1: (pixels, out channels, reduction).
    let mut mix = Vec::new();
    for &(hw, c, stages) in &[(56u32, 64u32, 3u32), (28, 128, 4), (14, 256, 6), (7, 512, 3)] {
        let m = hw * hw * batch;
        for _ in 0..stages {
            mix.push(gemm(m, c, c * 4, 64));
            mix.push(gemm(m, c, c * 9, 64));
            mix.push(gemm(m, c * 4, c, 64));
            mix.push(eltwise(m * c * 4));
        }
    }
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions::timing_only(seed));
    let bufs: Vec<(Kernel, Vec<DevicePtr>, LaunchShape)> = mix
        .iter()
        .map(|k| {
            let args = kairos_sim::timing::arg_bytes(k, DType::F16)
                .iter()
                .map(|&b| gpu.alloc(b.max(256), MemKind::Device).unwrap().ptr)
                .collect();
            (*k, args, LaunchShape { logical_blocks: k.logical_blocks(), threads_per_block: 256, shared_mem_bytes: 16 * 1024 })
        })
        .collect();
    let streams: Vec<StreamId> = (0..stream_count).map(|_| gpu.create_stream(0).unwrap()).collect();
    let mut next = vec![0usize; streams.len()];
    let mut in_flight = vec![0u32; streams.len()];
    let mut owner = std::collections::HashMap::new();
    let end_ns = (seconds * 1e9) as u64;
    let mut events = Vec::new();
    let (mut kernels_done, mut delivered) = (0u64, 0u64);
    let all_sms = SmMask::first(132);
    let wall = Instant::now();
    while gpu.now_ns() < end_ns {
        for (i, &s) in streams.iter().enumerate() {
            while in_flight[i] < 4 {
                let (k, a, shape) = &bufs[next[i] % bufs.len()];
                next[i] += 1;
                let req = LaunchRequest {
                    kernel: k,
                    dtype: DType::F16,
                    shape: *shape,
                    args: a,
                    first_block: 0,
                    ctas: 0,
                    sm_mask: all_sms,
                    partition: PartitionId::WHOLE,
                    stream: s,
                    after: None,
                    report_ctas: true,
                    report_start: false,
                    preemptible: true,
                    report_end: true,
                    stop_word: None,
                };
                let id = gpu.launch(&req).unwrap();
                owner.insert(id, i);
                in_flight[i] += 1;
            }
        }
        let now = gpu.now_ns();
        gpu.wait(now + 1_000_000).unwrap();
        events.clear();
        gpu.poll(&mut events).unwrap();
        delivered += events.len() as u64;
        for e in &events {
            if let GpuEvent::LaunchDone { launch, .. } = e {
                let i = owner.remove(launch).unwrap();
                in_flight[i] -= 1;
                kernels_done += 1;
            }
        }
    }
    let wall_s = wall.elapsed().as_secs_f64();
    let st = gpu.stats();
    let sim_s = gpu.now_ns() as f64 / 1e9;
    println!(
        "simulated {sim_s:.2} s in {wall_s:.2} s wall ({:.2}x real time): {} kernels ({:.0}/s simulated), {} blocks, {} notifications ({:.0}/s simulated)",
        sim_s / wall_s,
        kernels_done,
        kernels_done as f64 / sim_s,
        st.blocks,
        delivered,
        delivered as f64 / sim_s
    );
    println!(
        "speed: {:.0} kernels/s, {:.0} notifications/s, {:.0} internal steps/s (wall)",
        kernels_done as f64 / wall_s,
        delivered as f64 / wall_s,
        st.steps as f64 / wall_s
    );
    println!("trace hash {:016x}", gpu.trace_hash());
}

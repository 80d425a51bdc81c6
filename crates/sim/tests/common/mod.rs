//! Helpers shared by the simulator's integration tests: kernels, buffers, and a poll/wait loop.
#![allow(dead_code)]

use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::graph::Act;
use kairos_ir::plan::*;
use kairos_sim::SimGpu;

/// y = x0 + x1 over `n` contiguous elements, `per_block` elements per logical block.
pub fn eltwise_add(n: u32, per_block: u32) -> Kernel {
    let mut shape = [1u32; ELTWISE_RANK_MAX];
    shape[ELTWISE_RANK_MAX - 1] = n;
    let mut strides = [0u64; ELTWISE_RANK_MAX];
    strides[ELTWISE_RANK_MAX - 1] = 1;
    Kernel::Eltwise(EltwiseParams {
        func: EltFunc::Binary(BinaryOpParam::Add),
        act: Act::None,
        inputs: 2,
        shape,
        out_strides: strides,
        in_strides: [strides, strides, [0; ELTWISE_RANK_MAX]],
        in_dtypes: [DType::F32; 3],
        out_dtype: DType::F32,
        scalars: [0.0, 0.0],
        elems_per_block: per_block,
    })
}

/// C[m, n] = A[m, k] B[k, n] with square tiles.
pub fn gemm(m: u32, n: u32, k: u32, tile: u32) -> Kernel {
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
        b_stride_k: n as u64,
        b_stride_n: 1,
        c_stride0: 0,
        c_stride1: 0,
        c_stride_m: n as u64,
        r_stride0: 0,
        r_stride1: 0,
        r_stride_m: 0,
        alpha: 1.0,
        epilogue: EpilogueParams::default(),
        tile_m: tile,
        tile_n: tile,
        split_k: 1,
    })
}

pub fn shape(kernel: &Kernel, threads: u32, smem: u32) -> LaunchShape {
    LaunchShape { logical_blocks: kernel.logical_blocks(), threads_per_block: threads, shared_mem_bytes: smem }
}

/// One allocation per argument of `kernel`, sized by its bytes; `host[i]` puts argument i in
/// mapped host memory.
pub fn alloc_args(gpu: &mut SimGpu, kernel: &Kernel, dtype: DType, host: &[usize]) -> Vec<Allocation> {
    kairos_sim::timing::arg_bytes(kernel, dtype)
        .iter()
        .enumerate()
        .map(|(i, &b)| gpu.alloc(b.max(256), if host.contains(&i) { MemKind::HostMapped } else { MemKind::Device }).unwrap())
        .collect()
}

pub fn ptrs(allocs: &[Allocation]) -> Vec<DevicePtr> {
    allocs.iter().map(|a| a.ptr).collect()
}

/// A launch with the usual defaults: whole device, all SMs, from block 0, CTAs picked by the GPU.
pub fn request<'a>(
    kernel: &'a Kernel,
    dtype: DType,
    shape: LaunchShape,
    args: &'a [DevicePtr],
    stream: StreamId,
) -> LaunchRequest<'a> {
    LaunchRequest {
        kernel,
        dtype,
        shape,
        args,
        first_block: 0,
        ctas: 0,
        sm_mask: SmMask::first(SM_COUNT_MAX as u32),
        partition: PartitionId::WHOLE,
        stream,
        after: None,
        report_ctas: true,
        report_start: false,
        preemptible: true,
        report_end: true,
        stop_word: None,
    }
}

/// Polls and waits until every launch in `ids` reported `LaunchDone`; returns all events seen.
pub fn run_until_done(gpu: &mut SimGpu, ids: &[LaunchId]) -> Vec<GpuEvent> {
    let mut seen = Vec::new();
    let mut left: std::collections::HashSet<LaunchId> = ids.iter().copied().collect();
    let mut buf = Vec::new();
    let deadline = gpu.now_ns() + 100_000_000_000;
    while !left.is_empty() {
        buf.clear();
        gpu.poll(&mut buf).unwrap();
        for e in &buf {
            if let GpuEvent::LaunchDone { launch, .. } = e {
                left.remove(launch);
            }
        }
        seen.extend_from_slice(&buf);
        if left.is_empty() {
            break;
        }
        assert!(gpu.now_ns() < deadline, "launches {left:?} never finished");
        let now = gpu.now_ns();
        gpu.wait(now + 1_000_000_000).unwrap();
    }
    seen
}

/// Polls and waits until the simulator is idle; returns all events seen.
pub fn drain(gpu: &mut SimGpu) -> Vec<GpuEvent> {
    let mut seen = Vec::new();
    let deadline = gpu.now_ns() + 100_000_000_000;
    while !gpu.is_idle() {
        gpu.poll(&mut seen).unwrap();
        assert!(gpu.now_ns() < deadline, "the simulator never went idle");
        let now = gpu.now_ns();
        gpu.wait(now + 1_000_000_000).unwrap();
    }
    gpu.poll(&mut seen).unwrap();
    seen
}

pub fn done_at(events: &[GpuEvent], id: LaunchId) -> (u32, bool, u64) {
    events
        .iter()
        .find_map(|e| match *e {
            GpuEvent::LaunchDone { launch, next_block, preempted, at_ns } if launch == id => Some((next_block, preempted, at_ns)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no LaunchDone for {id:?}"))
}

pub fn first_placed_at(events: &[GpuEvent], id: LaunchId) -> Option<u64> {
    events.iter().find_map(|e| match *e {
        GpuEvent::CtasPlaced { launch, at_ns, .. } if launch == id => Some(at_ns),
        _ => None,
    })
}

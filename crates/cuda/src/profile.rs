//! `kairos profile`: measures a plan on the GPU, kernel by kernel.
//!
//! For each launch of the plan: the median duration on the whole GPU (the device-measured span
//! from its first CTA's placement record to its LaunchDone, both %globaltimer, so the same clock
//! serves green-context partitions), its CTAs, registers, shared memory and occupancy as the driver reports them, and
//! KRISP's right size: the fewest SMs at which the median stays within 5% of the whole GPU's,
//! found in steps of the device's partition granularity (8 on H100/H200), then SM by SM below the
//! step that kept the speed ([`kairos_gpu::profile::refine_right_size`]; `refine` false skips it).
//! Step sizes run in green-context partitions when the device has them, else under an SM mask of
//! that many SMs; the sizes between steps under masks.
//! The plan's end-to-end latency is the median of issuing all its launches in order on one stream.

use crate::gpu::CudaGpu;
use kairos_gpu::exec::SpaceBases;
use kairos_gpu::profile::{KernelProfile, ModelProfile};
use kairos_gpu::*;
use kairos_ir::plan::{IoTensor, Plan};
use kairos_ir::{DType, Tensor};

/// A launch counts as right-sized at the fewest SMs whose duration is within this factor of the whole GPU's.
pub const MIN_SMS_SLACK: f64 = 1.05;
/// `kairos profile` prints a progress line at most this often.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// A launch whose profile alone takes this long is named on stderr.
const SLOW_LAUNCH: std::time::Duration = std::time::Duration::from_secs(2);
/// Launches a plan run keeps in flight.
const QUEUE_DEPTH: usize = 256;
/// Launches a plan's first run keeps in flight ([`warm_up_plan`]). With 256, `kairos profile
/// densenet121 --batch 32` on an H200 overflowed the 65 536-record notification ring during the
/// warm-up (2965 records dropped, 8 launches lost) and then waited for ever for the lost launches.
const WARM_UP_QUEUE_DEPTH: usize = 8;

/// Deterministic inputs of sensible magnitude: floats in [-1, 1), i64 ids in [0, 100).
pub fn synthetic_input(t: &IoTensor, seed: u64) -> Tensor {
    let n: usize = t.shape.iter().product();
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match t.dtype {
        DType::I64 => Tensor::i64(t.shape.clone(), (0..n).map(|_| (next() % 100) as i64).collect()),
        d => Tensor::f32(t.shape.clone(), (0..n).map(|_| (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect()).cast(d),
    }
}

/// A plan's memory on the device: weights, arena, inputs and outputs.
pub struct PlanBuffers {
    pub bases: SpaceBases,
    allocations: Vec<Allocation>,
}

impl PlanBuffers {
    /// Allocates and fills everything a plan needs (weights of the given kind).
    pub fn new(gpu: &mut CudaGpu, plan: &Plan, inputs: &[Tensor], weights: MemKind) -> Result<PlanBuffers> {
        let mut allocations = Vec::new();
        let r = (|| {
            let w = kairos_gpu::exec::upload_weights(gpu, plan, weights)?;
            allocations.push(w);
            kairos_gpu::exec::alloc_request(gpu, plan, w.ptr, inputs, &mut allocations)
        })();
        match r {
            Ok(bases) => Ok(PlanBuffers { bases, allocations }),
            Err(e) => {
                for a in allocations {
                    let _ = gpu.free(a);
                }
                Err(e)
            }
        }
    }

    pub fn free(self, gpu: &mut CudaGpu) -> Result<()> {
        for a in self.allocations {
            gpu.free(a)?;
        }
        Ok(())
    }

    /// Reads the plan's outputs.
    pub fn outputs(&self, gpu: &mut CudaGpu, plan: &Plan) -> Result<Vec<Tensor>> {
        let mut out = Vec::new();
        for (o, ptr) in plan.outputs.iter().zip(&self.bases.outputs) {
            let mut bytes = vec![0u8; o.len_bytes() as usize];
            gpu.read(*ptr, &mut bytes)?;
            out.push(Tensor::from_bytes(o.dtype, o.shape.clone(), &bytes).map_err(GpuError::Invalid)?);
        }
        Ok(out)
    }
}

/// Issues every launch of the plan in order on `stream` and waits for the last; returns the
/// host-observed nanoseconds from the first issue to the last `LaunchDone`.
pub fn run_plan(gpu: &mut CudaGpu, plan: &Plan, bufs: &PlanBuffers, stream: StreamId) -> Result<u64> {
    run_plan_in_flight(gpu, plan, bufs, stream, QUEUE_DEPTH)
}

/// [`run_plan`] for a plan's first run in this process, with at most [`WARM_UP_QUEUE_DEPTH`]
/// launches in flight: a first launch of a kernel loads its module inside the launch call, and
/// while the host is there the launches in flight keep writing notifications nobody reads.
pub fn warm_up_plan(gpu: &mut CudaGpu, plan: &Plan, bufs: &PlanBuffers, stream: StreamId) -> Result<u64> {
    run_plan_in_flight(gpu, plan, bufs, stream, WARM_UP_QUEUE_DEPTH)
}

fn run_plan_in_flight(gpu: &mut CudaGpu, plan: &Plan, bufs: &PlanBuffers, stream: StreamId, depth: usize) -> Result<u64> {
    let whole = gpu.info().partitions[0].sms;
    let mut args = Vec::new();
    let mut events = Vec::new();
    let start = gpu.now_ns();
    let (mut next, mut done) = (0usize, 0usize);
    let mut pending = std::collections::HashSet::new();
    while done < plan.launches.len() {
        while next < plan.launches.len() && next - done < depth.max(1) {
            let l = &plan.launches[next];
            bufs.bases.resolve_all(&l.args, &mut args);
            let id = gpu.launch(&LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream))?;
            pending.insert(id);
            next += 1;
        }
        events.clear();
        gpu.poll(&mut events)?;
        for e in &events {
            if let GpuEvent::LaunchDone { launch, next_block, preempted, .. } = *e
                && pending.remove(&launch)
            {
                if preempted {
                    return Err(GpuError::Driver(format!("launch {} stopped at block {next_block} unasked", launch.0)));
                }
                done += 1;
            }
            // A launch whose end the ring dropped never reports LaunchDone: an error, not a wait
            // for ever.
            if let GpuEvent::LaunchLost { launch, .. } = *e
                && pending.contains(&launch)
            {
                return Err(GpuError::Driver(format!(
                    "launch {} of {}'s plan run was lost (the notification ring overflowed)",
                    launch.0, plan.model
                )));
            }
        }
        if events.is_empty() {
            let now = gpu.now_ns();
            gpu.wait(now + 1_000_000)?;
        }
    }
    Ok(gpu.now_ns() - start)
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// The first `n` SMs of a set.
pub fn sm_subset(set: &SmMask, n: u32) -> SmMask {
    let mut m = SmMask::EMPTY;
    for sm in set.iter().take(n as usize) {
        m.insert(sm);
    }
    m
}

/// Profiles a plan: per-launch durations, resources and right sizes (to one SM), and the plan's
/// latency.
pub fn profile_plan(gpu: &mut CudaGpu, plan: &Plan, repeats: usize) -> Result<ModelProfile> {
    profile_plan_with(gpu, plan, repeats, true)
}

/// [`profile_plan`], with right sizes refined to one SM (`refine`) or left at the partition step.
pub fn profile_plan_with(gpu: &mut CudaGpu, plan: &Plan, repeats: usize, refine: bool) -> Result<ModelProfile> {
    with_synthetic_buffers(gpu, plan, |gpu, bufs| profile_with(gpu, plan, bufs, repeats.max(1), refine))
}

/// Runs `f` with the plan's buffers in device memory, filled with [`synthetic_input`]s, and frees
/// them after, whatever `f` returned.
fn with_synthetic_buffers<T>(
    gpu: &mut CudaGpu,
    plan: &Plan,
    f: impl FnOnce(&mut CudaGpu, &PlanBuffers) -> Result<T>,
) -> Result<T> {
    let inputs: Vec<Tensor> = plan.inputs.iter().enumerate().map(|(i, t)| synthetic_input(t, i as u64 + 1)).collect();
    let bufs = PlanBuffers::new(gpu, plan, &inputs, MemKind::Device)?;
    let result = f(gpu, &bufs);
    bufs.free(gpu)?;
    result
}

/// The median device-measured span of `repeats` runs of one launch.
fn median_span(gpu: &mut CudaGpu, req: &LaunchRequest<'_>, repeats: usize) -> Result<u64> {
    let mut t: Vec<u64> = (0..repeats.max(1)).map(|_| gpu.time_span(req)).collect::<Result<_>>()?;
    Ok(median(&mut t))
}

fn profile_with(gpu: &mut CudaGpu, plan: &Plan, bufs: &PlanBuffers, repeats: usize, refine: bool) -> Result<ModelProfile> {
    let stream = gpu.utility_stream()?;
    // Warm up: compile modules, fill the arena with real activations.
    warm_up_plan(gpu, plan, bufs, stream)?;
    let mut lat: Vec<u64> = (0..repeats.max(3)).map(|_| run_plan(gpu, plan, bufs, stream)).collect::<Result<_>>()?;
    let latency_ns = median(&mut lat);

    let info = gpu.info().clone();
    let whole = info.partitions[0].sms;
    let step = info.partition_granularity_sms.clamp(1, info.sm_count);
    let mut sizes: Vec<u32> = (1..).map(|k| k * step).take_while(|&s| s < info.sm_count).collect();
    sizes.push(info.sm_count);
    // Where each size runs: a green-context partition, else an SM mask on the whole device.
    let mut places = Vec::new();
    for &s in &sizes {
        match gpu.partition_of_size(s) {
            Ok(p) => {
                let sms = gpu.info().partitions[p.0 as usize].sms;
                places.push((sms.count(), p, sms));
            }
            Err(_) => places.push((s, PartitionId::WHOLE, sm_subset(&whole, s))),
        }
    }
    let mut kernels = Vec::new();
    let mut args = Vec::new();
    let started = std::time::Instant::now();
    let mut last_line = started;
    for (i, l) in plan.launches.iter().enumerate() {
        // Progress on stderr for long profiles: a line every PROGRESS_EVERY, naming the next launch,
        // and one for any launch that alone took SLOW_LAUNCH.
        if last_line.elapsed() >= PROGRESS_EVERY {
            eprintln!(
                "profiling {}: {i}/{} launches in {:.1} s; next {} ({})",
                plan.model,
                plan.launches.len(),
                started.elapsed().as_secs_f64(),
                l.name,
                l.kernel.name()
            );
            last_line = std::time::Instant::now();
        }
        let launch_started = std::time::Instant::now();
        let res = gpu.kernel_resources(&l.kernel, l.dtype, &l.shape)?;
        bufs.bases.resolve_all(&l.args, &mut args);
        let mut by_sms = Vec::new();
        for &(count, partition, mask) in &places {
            let req = LaunchRequest::of_launch(l, &args, mask, partition, stream);
            by_sms.push((count, median_span(gpu, &req, repeats)?));
        }
        let duration_ns = by_sms.last().map(|x| x.1).unwrap_or(0);
        let mut min_sms = by_sms
            .iter()
            .filter(|(_, d)| *d as f64 <= duration_ns as f64 * MIN_SMS_SLACK)
            .map(|(s, _)| *s)
            .min()
            .unwrap_or(info.sm_count);
        // The step below the knee (0: the knee is the smallest step), then SM by SM between them.
        let below = by_sms.iter().map(|x| x.0).filter(|&s| s < min_sms).max().unwrap_or(0);
        if refine && min_sms > below + 1 {
            let (right, points) = kairos_gpu::profile::refine_right_size(min_sms, below, duration_ns, MIN_SMS_SLACK, |n| {
                let req = LaunchRequest::of_launch(l, &args, sm_subset(&whole, n), PartitionId::WHOLE, stream);
                median_span(gpu, &req, repeats)
            })?;
            min_sms = right;
            by_sms.extend(points);
            by_sms.sort_unstable_by_key(|x| x.0);
        }
        let ctas = l.shape.logical_blocks.min(res.ctas_per_sm_max * info.sm_count);
        if launch_started.elapsed() >= SLOW_LAUNCH {
            eprintln!(
                "profiling {}: launch {i} {} ({}, {} logical blocks) took {:.1} s over {} sizes (whole GPU {:.1} us, slowest size {:.1} us)",
                plan.model,
                l.name,
                l.kernel.name(),
                l.shape.logical_blocks,
                launch_started.elapsed().as_secs_f64(),
                by_sms.len(),
                duration_ns as f64 / 1e3,
                by_sms.iter().map(|x| x.1).max().unwrap_or(0) as f64 / 1e3
            );
        }
        kernels.push(KernelProfile {
            launch: i as u32,
            name: l.name.clone(),
            kernel: l.kernel.name().to_string(),
            duration_ns,
            logical_blocks: l.shape.logical_blocks,
            ctas,
            threads_per_cta: res.threads_per_cta,
            registers_per_thread: res.registers_per_thread,
            shared_mem_bytes: res.shared_mem_bytes,
            ctas_per_sm_max: res.ctas_per_sm_max,
            occupancy: (res.ctas_per_sm_max * res.threads_per_cta) as f64 / info.sm_limits.threads_max as f64,
            min_sms,
            duration_by_sms: by_sms,
        });
    }
    Ok(ModelProfile {
        model: plan.model.clone(),
        dtype: plan.dtype,
        batch: plan.inputs.first().and_then(|t| t.shape.first().copied()).unwrap_or(1),
        device: info.name.clone(),
        sm_count: info.sm_count,
        latency_ns,
        kernels,
        layers: None,
        placements: None,
    })
}

/// The GPCs `kairos profile --placements` places SM sets over: the probe's sets of at least
/// [`PLACEMENT_GPC_SMS_MIN`] SMs (on an H200 the probe leaves 8 SMs in pairs that never shared a
/// cluster; they are left out rather than counted as GPCs of 2).
pub const PLACEMENT_GPC_SMS_MIN: u32 = 8;

/// KRISP's Fig. 6 on this GPU: every launch of `plan` timed (median of `repeats`) under software
/// masks of each of `sizes` SMs placed each [`SmPlacement`](kairos_gpu::profile::SmPlacement) way
/// over `gpcs` ([`CudaGpu::probe_gpcs`]). A size the GPCs cannot hold is skipped with a note on
/// stderr.
pub fn profile_placements(
    gpu: &mut CudaGpu,
    plan: &Plan,
    repeats: usize,
    gpcs: &[SmMask],
    sizes: &[u32],
) -> Result<kairos_gpu::profile::PlacementProfile> {
    use kairos_gpu::profile::{PlacementPoint, PlacementProfile, SmPlacement, place_sms};
    let gpcs: Vec<SmMask> = gpcs.iter().copied().filter(|g| g.count() >= PLACEMENT_GPC_SMS_MIN).collect();
    with_synthetic_buffers(gpu, plan, |gpu, bufs| {
        let stream = gpu.utility_stream()?;
        warm_up_plan(gpu, plan, bufs, stream)?;
        let whole = gpu.info().partitions[0].sms;
        let mut points = Vec::new();
        let mut args = Vec::new();
        for &n in sizes {
            for how in SmPlacement::ALL {
                let Some(mask) = place_sms(&whole, &gpcs, n, how) else {
                    eprintln!("placements: {n} SMs do not fit {how:?} over {} GPCs; skipped", gpcs.len());
                    continue;
                };
                let mut duration_ns = Vec::with_capacity(plan.launches.len());
                for l in &plan.launches {
                    bufs.bases.resolve_all(&l.args, &mut args);
                    let req = LaunchRequest::of_launch(l, &args, mask, PartitionId::WHOLE, stream);
                    duration_ns.push(median_span(gpu, &req, repeats)?);
                }
                points.push(PlacementPoint { sm_count: n, placement: how, sms: mask.iter().collect(), duration_ns });
            }
        }
        Ok(PlacementProfile { gpcs: gpcs.iter().map(|g| g.iter().collect()).collect(), points })
    })
}

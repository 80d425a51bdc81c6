//! Running a whole plan on any [`Gpu`], launch after launch: the simple path behind
//! `kairos run --backend cuda|sim` and the end-to-end tests. The dispatcher does the same work
//! kernel by kernel for many requests at once; this runner keeps one request and one stream.

use crate::*;
use kairos_core::Tensor;
use kairos_core::plan::{BufRef, Plan, Space};

/// Where each memory space of a plan lives on the device.
#[derive(Clone, Debug)]
pub struct SpaceBases {
    pub arena: DevicePtr,
    pub weights: DevicePtr,
    pub inputs: Vec<DevicePtr>,
    pub outputs: Vec<DevicePtr>,
}

impl SpaceBases {
    pub fn resolve(&self, r: &BufRef) -> DevicePtr {
        let base = match r.space {
            Space::Arena => self.arena,
            Space::Weights => self.weights,
            Space::Input(i) => self.inputs[i as usize],
            Space::Output(i) => self.outputs[i as usize],
        };
        base.offset(r.offset_bytes)
    }

    pub fn resolve_all(&self, args: &[BufRef], out: &mut Vec<DevicePtr>) {
        out.clear();
        out.extend(args.iter().map(|a| self.resolve(a)));
    }
}

/// Uploads a plan's weight blob into a new allocation of the given kind.
pub fn upload_weights<G: Gpu + ?Sized>(gpu: &mut G, plan: &Plan, kind: MemKind) -> Result<Allocation> {
    let a = gpu.alloc(plan.weight_bytes.max(1), kind)?;
    if plan.weight_bytes > 0 {
        gpu.write(a.ptr, plan.weights.as_slice())?;
    }
    Ok(a)
}

/// Allocates one request's device memory for `plan` (arena, inputs written from `inputs`,
/// outputs) beside weights already at `weights`; every allocation is pushed to `allocations`, also
/// those made before a failure, so the caller frees them either way.
pub fn alloc_request<G: Gpu + ?Sized>(
    gpu: &mut G,
    plan: &Plan,
    weights: DevicePtr,
    inputs: &[Tensor],
    allocations: &mut Vec<Allocation>,
) -> Result<SpaceBases> {
    let arena = gpu.alloc(plan.arena_bytes.max(1), MemKind::Device)?;
    allocations.push(arena);
    let mut bases = SpaceBases { arena: arena.ptr, weights, inputs: Vec::new(), outputs: Vec::new() };
    for (i, t) in inputs.iter().enumerate() {
        let bytes = input_bytes(plan, i, t)?;
        let a = gpu.alloc(bytes.len().max(1) as u64, MemKind::Device)?;
        allocations.push(a);
        gpu.write(a.ptr, &bytes)?;
        bases.inputs.push(a.ptr);
    }
    for o in &plan.outputs {
        let a = gpu.alloc(o.len_bytes().max(1), MemKind::Device)?;
        allocations.push(a);
        bases.outputs.push(a.ptr);
    }
    Ok(bases)
}

/// Converts a request input to the plan's declared dtype and checks its shape.
pub fn input_bytes(plan: &Plan, index: usize, t: &Tensor) -> Result<Vec<u8>> {
    let decl = plan.inputs.get(index).ok_or_else(|| GpuError::Invalid(format!("plan has no input {index}")))?;
    if t.shape != decl.shape {
        return Err(GpuError::Invalid(format!(
            "input '{}' has shape {:?}, the model takes {:?}",
            decl.name, t.shape, decl.shape
        )));
    }
    Ok(t.cast(decl.dtype).to_bytes())
}

/// Timing of one launch as the runner saw it (backend clock).
#[derive(Clone, Copy, Debug)]
pub struct LaunchTiming {
    pub issued_ns: u64,
    pub done_ns: u64,
}

pub struct RunResult {
    pub outputs: Vec<Tensor>,
    pub timings: Vec<LaunchTiming>,
    pub total_ns: u64,
}

/// Runs one request through a plan whose weights are already on the device at `weights`, on a
/// new stream. Backends bound their streams (1024 on CUDA): to run many requests, create one
/// stream and call [`execute_plan_on`].
pub fn execute_plan<G: Gpu + ?Sized>(
    gpu: &mut G,
    plan: &Plan,
    weights: DevicePtr,
    inputs: &[Tensor],
    queue_depth: usize,
) -> Result<RunResult> {
    let stream = gpu.create_stream(0)?;
    execute_plan_on(gpu, plan, weights, inputs, queue_depth, stream)
}

/// Runs one request through a plan whose weights are already on the device at `weights`.
/// Launches go in plan order on `stream`, with up to `queue_depth` of them in flight.
pub fn execute_plan_on<G: Gpu + ?Sized>(
    gpu: &mut G,
    plan: &Plan,
    weights: DevicePtr,
    inputs: &[Tensor],
    queue_depth: usize,
    stream: StreamId,
) -> Result<RunResult> {
    if inputs.len() != plan.inputs.len() {
        return Err(GpuError::Invalid(format!(
            "model '{}' takes {} inputs, got {}",
            plan.model,
            plan.inputs.len(),
            inputs.len()
        )));
    }
    let queue_depth = queue_depth.max(1);
    gpu.prepare_plan(plan)?;
    let mut allocations = Vec::new();
    let result = (|| {
        let bases = alloc_request(gpu, plan, weights, inputs, &mut allocations)?;
        let start_ns = gpu.now_ns();
        let mut timings = vec![LaunchTiming { issued_ns: 0, done_ns: 0 }; plan.launches.len()];
        let mut ids = std::collections::HashMap::new();
        let mut args = Vec::new();
        let mut events = Vec::new();
        let mut next = 0;
        let mut done = 0;
        let whole = gpu.info().partitions[0].sms;
        while done < plan.launches.len() {
            while next < plan.launches.len() && next - done < queue_depth {
                let l = &plan.launches[next];
                gpu.kernel_resources(&l.kernel, l.dtype, &l.shape)?;
                bases.resolve_all(&l.args, &mut args);
                let req = LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream);
                let id = gpu.launch(&req)?;
                timings[next].issued_ns = gpu.now_ns();
                ids.insert(id, next);
                next += 1;
            }
            events.clear();
            gpu.poll(&mut events)?;
            if events.is_empty() {
                let now = gpu.now_ns();
                gpu.wait(now + 1_000_000_000)?;
                continue;
            }
            for e in &events {
                if let GpuEvent::LaunchDone { launch, next_block, preempted, at_ns } = *e
                    && let Some(&i) = ids.get(&launch)
                {
                    if preempted || next_block != plan.launches[i].shape.logical_blocks {
                        return Err(GpuError::Driver(format!(
                            "launch {i} stopped at block {next_block} without being preempted"
                        )));
                    }
                    timings[i].done_ns = at_ns;
                    done += 1;
                }
            }
        }
        let total_ns = gpu.now_ns() - start_ns;
        let mut outputs = Vec::new();
        for (o, ptr) in plan.outputs.iter().zip(&bases.outputs) {
            let mut bytes = vec![0u8; o.len_bytes() as usize];
            gpu.read(*ptr, &mut bytes)?;
            outputs.push(Tensor::from_bytes(o.dtype, o.shape.clone(), &bytes).map_err(GpuError::Invalid)?);
        }
        Ok(RunResult { outputs, timings, total_ns })
    })();
    for a in allocations {
        gpu.free(a)?;
    }
    result
}

/// Measures a plan's layer profile on `gpu` (DeepPlan's profiling, Sec. 4.3.1; what `kairos
/// profile --layers` and `kairos bench cold` run): every launch alone on an idle GPU, `reps` times
/// each with its weights in device memory and with them in pinned host memory read in place; its
/// duration is first block taken to end as the backend reports them (device time on CUDA). Inputs
/// are zeros (valid indices for gathers). Copy times: one copy of the whole blob from pinned host
/// memory, timed from its queueing to its `CopyDone`, gives the bandwidth each layer's `load_ns`
/// is worked out at (timing each small layer's copy alone would mostly time the host's polling).
pub fn profile_layers<G: Gpu + ?Sized>(gpu: &mut G, plan: &Plan, reps: usize) -> Result<crate::profile::LayerProfile> {
    use crate::profile::{LaunchColdTimes, LayerLoad, LayerProfile};
    let started_ns = gpu.now_ns();
    let reps = reps.max(1);
    gpu.prepare_plan(plan)?;
    let mut allocations = Vec::new();
    let result = (|| {
        let device = upload_weights(gpu, plan, MemKind::Device)?;
        allocations.push(device);
        let host = upload_weights(gpu, plan, MemKind::HostMapped)?;
        allocations.push(host);
        let zeros: Vec<Tensor> =
            plan.inputs.iter().map(|t| Tensor::f32(t.shape.clone(), vec![0.0; t.shape.iter().product()]).cast(t.dtype)).collect();
        let mut bases = alloc_request(gpu, plan, device.ptr, &zeros, &mut allocations)?;
        let stream = gpu.create_stream(0)?;
        let whole = gpu.info().partitions[0].sms;
        let mut times = vec![[Vec::with_capacity(reps), Vec::with_capacity(reps)]; plan.launches.len()];
        let mut args = Vec::new();
        let mut events = Vec::new();
        for _ in 0..reps {
            for (placement, base) in [device.ptr, host.ptr].into_iter().enumerate() {
                bases.weights = base;
                for (i, l) in plan.launches.iter().enumerate() {
                    gpu.kernel_resources(&l.kernel, l.dtype, &l.shape)?;
                    bases.resolve_all(&l.args, &mut args);
                    let req = LaunchRequest {
                        report_ctas: false,
                        report_start: true,
                        preemptible: false,
                        ..LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream)
                    };
                    let id = gpu.launch(&req)?;
                    let (mut start, mut end) = (None, None);
                    let deadline = gpu.now_ns() + 10_000_000_000;
                    while end.is_none() {
                        events.clear();
                        gpu.poll(&mut events)?;
                        for e in &events {
                            match *e {
                                GpuEvent::LaunchStarted { launch, at_ns } if launch == id => start = Some(at_ns),
                                GpuEvent::LaunchDone { launch, at_ns, .. } if launch == id => end = Some(at_ns),
                                _ => {}
                            }
                        }
                        if end.is_none() {
                            let now = gpu.now_ns();
                            if now > deadline {
                                return Err(GpuError::Driver(format!("launch {i} ({}) did not end in 10 s", l.name)));
                            }
                            gpu.wait(now + 1_000_000)?;
                        }
                    }
                    let end = end.unwrap_or(0);
                    times[i][placement].push(end.saturating_sub(start.unwrap_or(end)));
                }
            }
        }
        let median = |v: &mut Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let launches = times
            .iter_mut()
            .enumerate()
            .map(|(i, [g, h])| LaunchColdTimes { launch: i as u32, exec_gpu_ns: median(g), exec_host_ns: median(h) })
            .collect();
        // The whole blob in one copy, as a load's chunks move it.
        let mut copy_ns = Vec::with_capacity(reps);
        if plan.weight_bytes > 0 {
            for _ in 0..reps {
                let t0 = gpu.now_ns();
                let copy = gpu.copy_async(device.ptr, host.ptr, plan.weight_bytes, stream)?;
                loop {
                    events.clear();
                    gpu.poll(&mut events)?;
                    if events.iter().any(|e| matches!(e, GpuEvent::CopyDone { copy: c, .. } if *c == copy)) {
                        break;
                    }
                    let now = gpu.now_ns();
                    gpu.wait(now + 100_000)?;
                }
                copy_ns.push(gpu.now_ns().saturating_sub(t0));
            }
        }
        let blob_ns = if copy_ns.is_empty() { 0 } else { median(&mut copy_ns) };
        let layers = plan
            .layers
            .iter()
            .enumerate()
            .map(|(j, l)| LayerLoad {
                layer: j as u32,
                bytes: l.len_bytes,
                load_ns: (blob_ns as f64 * l.len_bytes as f64 / plan.weight_bytes.max(1) as f64).round() as u64,
            })
            .collect();
        gpu.destroy_stream(stream)?;
        Ok(LayerProfile { launches, layers, profiling_ns: 0 })
    })();
    for a in allocations {
        gpu.free(a)?;
    }
    let mut p = result?;
    p.profiling_ns = gpu.now_ns().saturating_sub(started_ns);
    Ok(p)
}

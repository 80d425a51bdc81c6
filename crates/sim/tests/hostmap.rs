//! Caller memory mapped into the simulator (`Gpu::map_host`): kernels read and write it in place
//! and compute exactly what they compute on device memory; bytes they do not write stay the
//! caller's; the mapping cannot go while a launch uses it; its bytes cross PCIe in the timing.

mod common;

use common::*;
use kairos_gpu::exec::{SpaceBases, execute_plan, input_bytes, upload_weights};
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::Tensor;
use kairos_ir::plan::Plan;
use kairos_sim::*;
use std::sync::{Arc, Mutex};

/// Host memory owned by the test: a vector behind a lock.
#[derive(Debug)]
struct VecMemory(Mutex<Vec<u8>>);

impl VecMemory {
    fn new(bytes: usize, fill: u8) -> Arc<VecMemory> {
        Arc::new(VecMemory(Mutex::new(vec![fill; bytes])))
    }
    fn get(&self, offset: u64, len: u64) -> Vec<u8> {
        self.0.lock().unwrap()[offset as usize..(offset + len) as usize].to_vec()
    }
    fn snapshot(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }
}

impl HostMemory for VecMemory {
    fn len_bytes(&self) -> u64 {
        self.0.lock().unwrap().len() as u64
    }
    fn read_at(&self, offset: u64, out: &mut [u8]) {
        out.copy_from_slice(&self.0.lock().unwrap()[offset as usize..offset as usize + out.len()]);
    }
    fn write_at(&self, offset: u64, data: &[u8]) {
        self.0.lock().unwrap()[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }
}

fn plan_of(model: &str, dtype: DType) -> Plan {
    let mut spec = kairos_ir::model::ModelSpec::new(model);
    spec.dtype = dtype;
    spec.seq_len = 16;
    spec.plan().unwrap_or_else(|e| panic!("{model}: {e}"))
}

/// Seeded inputs of a plan (token ids below 100).
fn inputs_of(plan: &Plan, seed: u64) -> Vec<Tensor> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    plan.inputs
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            match t.dtype {
                DType::I64 => Tensor::i64(t.shape.clone(), (0..n).map(|_| (next() % 100) as i64).collect()),
                d => Tensor::f32(t.shape.clone(), (0..n).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect()).cast(d),
            }
        })
        .collect()
}

/// Runs a plan launch after launch with its inputs and outputs at `bases` (one stream).
fn run_bound(gpu: &mut SimGpu, plan: &Plan, bases: &SpaceBases) {
    let stream = gpu.create_stream(0).unwrap();
    let mut args = Vec::new();
    for l in &plan.launches {
        bases.resolve_all(&l.args, &mut args);
        let id = gpu.launch(&request(&l.kernel, l.dtype, l.shape, &args, stream)).unwrap();
        let events = run_until_done(gpu, &[id]);
        assert_eq!(done_at(&events, id).0, l.shape.logical_blocks);
    }
    gpu.destroy_stream(stream).unwrap();
}

/// Byte extents (`hostmem::arg_extent_bytes`) never exceed the byte ranges the lowering gives
/// arguments, so staging a mapped argument never reads past what the plan owns.
#[test]
fn extents_fit_the_plans_byte_ranges() {
    for model in ["resnet18", "mobilenet_v2", "squeezenet1_1", "googlenet", "distilbert", "gpt2"] {
        for dtype in [DType::F32, DType::F16] {
            let plan = plan_of(model, dtype);
            for (i, l) in plan.launches.iter().enumerate() {
                let ext = hostmem::arg_extent_bytes(&l.kernel, l.dtype);
                assert_eq!(ext.len(), l.args.len(), "{model} launch {i}");
                for (a, (x, r)) in ext.iter().zip(&l.args).enumerate() {
                    assert!(*x <= r.len_bytes, "{model} {dtype:?} launch {i} ({}) arg {a}: extent {x} > {}", l.name, r.len_bytes);
                    assert!(*x > 0, "{model} launch {i} arg {a}: empty extent");
                }
            }
        }
    }
}

/// Inputs read from and outputs written to caller memory give the bytes the copy path gives;
/// everything else in the caller's memory is left as it was.
#[test]
fn zero_copy_outputs_match_the_copy_path_bit_for_bit() {
    for (model, dtype) in [("squeezenet1_1", DType::F16), ("distilbert", DType::F32)] {
        let plan = plan_of(model, dtype);
        let inputs = inputs_of(&plan, 5);
        let mut gpu = SimGpu::new(GpuDesc::h200(), SimOptions { seed: 11, check_invariants: false, ..SimOptions::default() });
        let w = upload_weights(&mut gpu, &plan, MemKind::Device).unwrap();
        let want = execute_plan(&mut gpu, &plan, w.ptr, &inputs, 8).unwrap().outputs;

        // Inputs then outputs, each at a 256-byte boundary of a region filled with a pattern.
        let mut offset = 4096u64;
        let mut place = |len: u64| {
            let o = offset;
            offset = (offset + len).next_multiple_of(256) + 256;
            o
        };
        let in_offsets: Vec<u64> = plan.inputs.iter().map(|t| place(t.len_bytes())).collect();
        let out_offsets: Vec<u64> = plan.outputs.iter().map(|t| place(t.len_bytes())).collect();
        let region = VecMemory::new(offset as usize + 4096, 0xa5);
        for (i, (t, &o)) in inputs.iter().zip(&in_offsets).enumerate() {
            region.write_at(o, &input_bytes(&plan, i, t).unwrap());
        }
        let before = region.snapshot();
        let m = gpu.map_host(region.clone()).unwrap();
        assert_eq!(m.bytes, region.len_bytes());
        assert_eq!(m.ptr.0 % m.align_bytes, 0);
        let arena = gpu.alloc(plan.arena_bytes.max(1), MemKind::Device).unwrap();
        let bases = SpaceBases {
            arena: arena.ptr,
            weights: w.ptr,
            inputs: in_offsets.iter().map(|&o| m.ptr.offset(o)).collect(),
            outputs: out_offsets.iter().map(|&o| m.ptr.offset(o)).collect(),
        };
        run_bound(&mut gpu, &plan, &bases);
        for (k, (t, &o)) in plan.outputs.iter().zip(&out_offsets).enumerate() {
            assert_eq!(
                region.get(o, t.len_bytes()),
                want[k].to_bytes(),
                "{model} {dtype:?}: output {k} differs from the copy path"
            );
        }
        // Outside the outputs, nothing moved (inputs included).
        let after = region.snapshot();
        let in_outputs =
            |b: usize| plan.outputs.iter().zip(&out_offsets).any(|(t, &o)| (o..o + t.len_bytes()).contains(&(b as u64)));
        let changed: Vec<usize> = (0..after.len()).filter(|&b| after[b] != before[b] && !in_outputs(b)).collect();
        assert!(changed.is_empty(), "{model}: {} bytes outside the outputs changed, first at {}", changed.len(), changed[0]);
        gpu.unmap_host(m.id).unwrap();
        gpu.free(arena).unwrap();
        gpu.free(w).unwrap();
        assert_eq!(Arc::strong_count(&region), 1, "unmapping drops the simulator's hold on the memory");
    }
}

/// A mapping cannot be unmapped while a launch that uses it runs; the host cannot copy through
/// it; it is not an allocation to free.
#[test]
fn mappings_outlive_their_launches_and_refuse_host_copies() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 3, ..SimOptions::default() });
    let n = 1 << 16;
    let k = eltwise_add(n, 1024);
    let region = VecMemory::new(3 * n as usize * 4, 0);
    {
        let mut g = region.0.lock().unwrap();
        for (i, c) in g.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&((i % 1000) as f32).to_le_bytes());
        }
    }
    let m = gpu.map_host(region.clone()).unwrap();
    let args = [m.ptr, m.ptr.offset(n as u64 * 4), m.ptr.offset(2 * n as u64 * 4)];
    let s = gpu.create_stream(0).unwrap();
    let id = gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &args, s)).unwrap();
    let e = gpu.unmap_host(m.id).unwrap_err().to_string();
    assert!(e.contains("uses it"), "{e}");
    assert!(gpu.write(m.ptr, &[0u8; 4]).is_err(), "host writes into a mapping go through the caller's memory");
    assert!(gpu.read(m.ptr, &mut [0u8; 4]).is_err());
    assert!(gpu.copy_async(m.ptr, args[1], 16, s).is_err());
    assert!(gpu.free(Allocation { ptr: m.ptr, bytes: m.bytes, kind: MemKind::HostMapped }).is_err());
    run_until_done(&mut gpu, &[id]);
    // y = x0 + x1 landed in the caller's memory.
    let y = region.get(2 * n as u64 * 4, n as u64 * 4);
    for (i, c) in y.chunks_exact(4).enumerate() {
        let want = ((i % 1000) as f32) + (((i + n as usize) % 1000) as f32);
        assert_eq!(f32::from_le_bytes(c.try_into().unwrap()), want, "element {i}");
    }
    gpu.unmap_host(m.id).unwrap();
    assert!(gpu.unmap_host(m.id).is_err(), "a mapping goes once");
    assert!(gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &args, s)).is_err(), "its addresses are gone");
}

/// Mapped arguments cross PCIe: a memory-bound kernel reading mapped memory is slower than the same
/// kernel on device memory, by about its bytes over the link's rate.
#[test]
fn mapped_arguments_cost_pcie_time() {
    let n = 1 << 22;
    let k = eltwise_add(n, 4096);
    let opts = SimOptions {
        seed: 1,
        compute: false,
        jitter: false,
        record_trace: false,
        check_invariants: false,
        ..SimOptions::default()
    };
    let time = |mapped: bool| {
        let mut gpu = SimGpu::new(GpuDesc::h200(), opts.clone());
        let s = gpu.create_stream(0).unwrap();
        let args: Vec<DevicePtr> = if mapped {
            let m = gpu.map_host(VecMemory::new(3 * n as usize * 4, 0)).unwrap();
            (0..3).map(|i| m.ptr.offset(i * n as u64 * 4)).collect()
        } else {
            (0..3).map(|_| gpu.alloc(n as u64 * 4, MemKind::Device).unwrap().ptr).collect()
        };
        let id = gpu.launch(&request(&k, DType::F32, shape(&k, 256, 0), &args, s)).unwrap();
        let t0 = gpu.now_ns();
        let events = run_until_done(&mut gpu, &[id]);
        done_at(&events, id).2 - t0
    };
    let (device, mapped) = (time(false), time(true));
    let bytes = 3.0 * n as f64 * 4.0;
    let desc = GpuDesc::h200();
    let pcie_ns = bytes / desc.host_mapped_read_bytes_per_s.min(desc.h2d_bytes_per_s) * 1e9;
    println!(
        "eltwise add of {n} floats: device {device} ns, mapped {mapped} ns, 12 bytes per element over PCIe ~{pcie_ns:.0} ns"
    );
    assert!(mapped > 3 * device, "mapped {mapped} ns vs device {device} ns");
    assert!((mapped as f64) > 0.5 * pcie_ns, "mapped {mapped} ns, PCIe alone {pcie_ns:.0} ns");
}

/// Same seed, same calls, same trace: mappings take part in the determinism.
#[test]
fn runs_with_mappings_are_deterministic() {
    let plan = plan_of("squeezenet1_1", DType::F16);
    let run = || {
        let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed: 77, compute: false, ..SimOptions::default() });
        let w = upload_weights(&mut gpu, &plan, MemKind::Device).unwrap();
        let region = VecMemory::new(1 << 20, 0);
        let m = gpu.map_host(region).unwrap();
        let arena = gpu.alloc(plan.arena_bytes, MemKind::Device).unwrap();
        let bases = SpaceBases { arena: arena.ptr, weights: w.ptr, inputs: vec![m.ptr], outputs: vec![m.ptr.offset(1 << 19)] };
        run_bound(&mut gpu, &plan, &bases);
        (gpu.trace_hash(), gpu.now_ns())
    };
    assert_eq!(run(), run());
}

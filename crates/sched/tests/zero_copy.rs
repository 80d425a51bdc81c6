//! Zero-copy requests on the simulator: inputs and outputs bound to a host mapping
//! (`Command::SubmitBound`) compute the bytes the copy path computes, wrong bindings are refused,
//! cancellation and preemption keep working, and a mapping goes only after its last request.

mod common;

use common::*;
use kairos_gpu::synthetic::{self, SyntheticKernel};
use kairos_gpu::{HostMapping, HostMemory};
use kairos_ir::plan::Plan;
use kairos_ir::{DType, Tensor};
use kairos_sched::policy::PolicyConfig;
use kairos_sched::*;
use kairos_sim::{GpuDesc, SimGpu, SimOptions};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Caller memory: a vector behind a lock.
#[derive(Debug)]
struct VecMemory(Mutex<Vec<u8>>);

impl VecMemory {
    fn new(bytes: usize) -> Arc<VecMemory> {
        Arc::new(VecMemory(Mutex::new(vec![0x5a; bytes])))
    }
    fn get(&self, span: MappedSpan) -> Vec<u8> {
        self.0.lock().unwrap()[span.offset_bytes as usize..(span.offset_bytes + span.len_bytes) as usize].to_vec()
    }
    fn put(&self, span: MappedSpan, data: &[u8]) {
        assert_eq!(data.len() as u64, span.len_bytes);
        self.write_at(span.offset_bytes, data);
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

/// These tests check mappings' lifetimes against the requests using them, not timing: the host's
/// costs per launch and per record are zero, so a request's kernels are still running at the
/// instants the tests look (with the H100's measured host costs the dispatcher's own time moves
/// the clock past them).
fn sim(seed: u64) -> SimGpu {
    let mut desc = GpuDesc::h100_sxm();
    desc.latency.launch_host_ns = 0;
    desc.latency.event_host_ns = 0;
    SimGpu::new(desc, SimOptions { seed, check_invariants: true, ..SimOptions::default() })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Spans for one request of `plan` starting at `base` (256-byte aligned): inputs, then outputs.
fn spans(plan: &Plan, base: u64) -> (Vec<MappedSpan>, Vec<MappedSpan>, u64) {
    let mut at = base;
    let mut take = |len: u64| {
        let s = MappedSpan { offset_bytes: at, len_bytes: len };
        at = (at + len).next_multiple_of(256);
        s
    };
    let i = plan.inputs.iter().map(|t| take(t.len_bytes())).collect();
    let o = plan.outputs.iter().map(|t| take(t.len_bytes())).collect();
    (i, o, at)
}

fn seeded_inputs(plan: &Plan, seed: u64) -> Vec<Tensor> {
    let mut rng = SmallRng::seed_from_u64(seed);
    plan.inputs
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            match t.dtype {
                DType::I64 => Tensor::i64(t.shape.clone(), (0..n).map(|_| rng.random_range(0..100)).collect()),
                d => Tensor::f32(t.shape.clone(), (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()).cast(d),
            }
        })
        .collect()
}

/// A zoo model and a synthetic chain: inputs bound, outputs bound, both, and neither give the
/// same bytes.
#[test]
fn bound_io_gives_the_copy_paths_bytes() {
    let mut zoo = kairos_ir::model::ModelSpec::new("squeezenet1_1");
    zoo.dtype = DType::F16;
    let plans = [
        Arc::new(zoo.plan().unwrap()),
        Arc::new(synthetic::layered_plan(
            "chain",
            &[SyntheticKernel { logical_blocks: 37, threads_per_block: 128, shared_mem_bytes: 0 }; 5],
        )),
    ];
    for plan in plans {
        let name = plan.model.clone();
        let mut d = VirtualDriver::new(Config::default(), sim(4)).unwrap();
        d.load_model(ModelSpec { name: name.clone(), plan: plan.clone(), profile: None }).unwrap();
        let inputs = seeded_inputs(&plan, 9);
        let region = VecMemory::new(8 << 20);
        let m = d.map_host(region.clone()).unwrap();
        // Four requests at once: copy path, inputs bound, outputs bound, both bound.
        let copy = d.submit_at(0, &name, inputs.clone(), RequestOptions::default());
        let mut bound = Vec::new();
        let mut base = 4096;
        for (bind_in, bind_out) in [(true, false), (false, true), (true, true)] {
            let (si, so, end) = spans(&plan, base);
            base = end + 4096;
            for (k, (t, s)) in inputs.iter().zip(&si).enumerate() {
                region.put(*s, &kairos_gpu::exec::input_bytes(&plan, k, t).unwrap());
            }
            let binding = IoBinding {
                mapping: m.id,
                inputs: if bind_in { si.clone() } else { vec![] },
                outputs: if bind_out { so.clone() } else { vec![] },
            };
            let tensors = if bind_in { vec![] } else { inputs.clone() };
            let id = d.submit_bound_at(0, &name, tensors, binding, RequestOptions::default());
            bound.push((id, bind_out, so));
        }
        d.run_until_idle().unwrap();
        let records: HashMap<RequestId, RequestRecord> = d.take_records().into_iter().map(|r| (r.id, r)).collect();
        let want: Vec<Vec<u8>> = records[&copy].outputs.iter().map(|t| t.to_bytes()).collect();
        assert_eq!(want.len(), plan.outputs.len());
        for (id, bind_out, so) in bound {
            let r = &records[&id];
            r.result.as_ref().unwrap_or_else(|e| panic!("{name}: {e}"));
            let got: Vec<Vec<u8>> = if bind_out {
                assert!(r.outputs.is_empty(), "bound outputs come back in the caller's memory only");
                so.iter().map(|s| region.get(*s)).collect()
            } else {
                r.outputs.iter().map(|t| t.to_bytes()).collect()
            };
            assert_eq!(got, want, "{name}: request {id:?} (outputs bound: {bind_out}) differs from the copy path");
        }
        assert_eq!(d.dispatcher().host_mappings(), 1);
        let gpu = d.into_gpu();
        gpu.audit().unwrap();
        assert_eq!(Arc::strong_count(&region), 1, "the GPU let go of the memory");
    }
}

/// Every malformed binding is `InvalidInput`, and the engine goes on serving.
#[test]
fn wrong_bindings_are_refused() {
    let plan = Arc::new(synthetic::layered_plan(
        "m",
        &[SyntheticKernel { logical_blocks: 4, threads_per_block: 64, shared_mem_bytes: 0 }; 2],
    ));
    let len = plan.inputs[0].len_bytes();
    assert_eq!(len, plan.outputs[0].len_bytes());
    let mut d = VirtualDriver::new(Config::default(), sim(2)).unwrap();
    d.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
    let region = VecMemory::new(1 << 16);
    let m: HostMapping = d.map_host(region).unwrap();
    let span = |offset_bytes, len_bytes| MappedSpan { offset_bytes, len_bytes };
    let x = || vec![Tensor::f32(plan.inputs[0].shape.clone(), vec![0.5; plan.inputs[0].shape.iter().product()])];
    let bad: Vec<(&str, Vec<Tensor>, IoBinding, RequestOptions)> = vec![
        ("short input", vec![], IoBinding { mapping: m.id, inputs: vec![span(0, len - 4)], outputs: vec![] }, Default::default()),
        ("long output", x(), IoBinding { mapping: m.id, inputs: vec![], outputs: vec![span(4096, len + 4)] }, Default::default()),
        (
            "two inputs",
            vec![],
            IoBinding { mapping: m.id, inputs: vec![span(0, len), span(4096, len)], outputs: vec![] },
            Default::default(),
        ),
        (
            "past the end",
            vec![],
            IoBinding { mapping: m.id, inputs: vec![span((1 << 16) - 256, len)], outputs: vec![] },
            Default::default(),
        ),
        (
            "overflow",
            vec![],
            IoBinding { mapping: m.id, inputs: vec![span(u64::MAX - 3, len)], outputs: vec![] },
            Default::default(),
        ),
        ("misaligned", vec![], IoBinding { mapping: m.id, inputs: vec![span(64, len)], outputs: vec![] }, Default::default()),
        (
            "output over input",
            vec![],
            IoBinding { mapping: m.id, inputs: vec![span(0, len)], outputs: vec![span(256, len)] },
            Default::default(),
        ),
        (
            "unknown mapping",
            vec![],
            IoBinding { mapping: kairos_gpu::HostMappingId(7), inputs: vec![span(0, len)], outputs: vec![] },
            Default::default(),
        ),
        ("tensors too", x(), IoBinding { mapping: m.id, inputs: vec![span(0, len)], outputs: vec![] }, Default::default()),
        ("no tensors", vec![], IoBinding { mapping: m.id, inputs: vec![], outputs: vec![span(8192, len)] }, Default::default()),
        (
            "skip_io",
            vec![],
            IoBinding { mapping: m.id, inputs: vec![span(0, len)], outputs: vec![] },
            RequestOptions::default().with_skip_io(true),
        ),
    ];
    let mut ids = Vec::new();
    for (what, tensors, binding, options) in bad {
        ids.push((what, d.submit_bound_at(0, "m", tensors, binding, options)));
    }
    let good = d.submit_bound_at(
        0,
        "m",
        vec![],
        IoBinding { mapping: m.id, inputs: vec![span(0, len)], outputs: vec![span(len.next_multiple_of(256), len)] },
        Default::default(),
    );
    d.run_until_idle().unwrap();
    let records: HashMap<RequestId, RequestRecord> = d.take_records().into_iter().map(|r| (r.id, r)).collect();
    for (what, id) in ids {
        match &records[&id].result {
            Err(Error::InvalidInput(e)) => eprintln!("{what}: {e}"),
            other => panic!("{what}: expected InvalidInput, got {other:?}"),
        }
    }
    assert!(records[&good].result.is_ok(), "{:?}", records[&good].result);
}

/// Through each kernel-level policy, with preemptions and cancellations: every completed bound
/// request leaves relu(its input) in its output span, cancelled ones leave no partial results
/// behind unreported, and the GPU reports nothing amiss.
#[test]
fn cancellation_and_preemption_keep_bound_results_exact() {
    for seed in seeds(3) {
        with_seed("cancellation_and_preemption_keep_bound_results_exact", seed, |seed| {
            let mut rng = SmallRng::seed_from_u64(seed);
            for name in PolicyConfig::NAMES {
                let policy = PolicyConfig::by_name(name).unwrap();
                let preempt = policy.is_kernel_level();
                let (checked, violations, _) = Checked::new(policy.clone());
                let boxed: Box<dyn kairos_sched::Policy> =
                    if preempt { Box::new(Preempting::new(Box::new(checked), 30)) } else { Box::new(checked) };
                let cfg = Config { slots_per_model_max: 3, ..Config::default().with_policy(policy.clone()) };
                let mut d = VirtualDriver::with_policy(cfg, Audit::new(sim(seed)), boxed).unwrap();
                let blocks = rng.random_range(1..=200);
                let kernels: Vec<_> = (0..rng.random_range(1..=6))
                    .map(|_| SyntheticKernel {
                        logical_blocks: blocks,
                        threads_per_block: [64, 256][rng.random_range(0..2)],
                        shared_mem_bytes: 0,
                    })
                    .collect();
                let plan = Arc::new(synthetic::layered_plan("m", &kernels));
                d.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
                let region = VecMemory::new(16 << 20);
                let m = d.map_host(region.clone()).unwrap();
                let n = plan.inputs[0].shape[0];
                let mut expect = HashMap::new();
                let mut cancelled = HashSet::new();
                let mut base = 0;
                for i in 0..12u64 {
                    let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    let (si, so, end) = spans(&plan, base);
                    base = end;
                    region.put(si[0], &f32_bytes(&x));
                    let t = i * rng.random_range(0..20_000);
                    let id = d.submit_bound_at(
                        t,
                        "m",
                        vec![],
                        IoBinding { mapping: m.id, inputs: si, outputs: so.clone() },
                        RequestOptions::default(),
                    );
                    expect.insert(id, (so[0], x));
                    if rng.random_bool(0.2) {
                        d.cancel_at(t + rng.random_range(0..50_000), id);
                        cancelled.insert(id);
                    }
                }
                d.run_until_idle().unwrap();
                assert!(violations.lock().unwrap().is_empty(), "{:?}", violations.lock().unwrap());
                let records = d.take_records();
                assert_eq!(records.len(), 12);
                for r in &records {
                    let (span, x) = &expect[&r.id];
                    match &r.result {
                        Ok(_) => {
                            let want: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
                            assert_eq!(region.get(*span), f32_bytes(&want), "{name}: request {:?}", r.id);
                        }
                        Err(Error::Cancelled) => assert!(cancelled.contains(&r.id)),
                        Err(e) => panic!("{name}: request {:?} failed: {e}", r.id),
                    }
                }
                assert_eq!(d.dispatcher().stats().notification_anomalies, 0);
                let gpu = d.into_gpu();
                assert!(gpu.log.violations.is_empty(), "{:?}", gpu.log.violations);
                gpu.inner.audit().unwrap();
            }
        });
    }
}

/// Unmapping with requests in flight: later requests naming the mapping are refused at once, the
/// ones in flight complete with their results, and the mapping goes only after the last of them.
#[test]
fn a_mapping_goes_only_after_its_last_request() {
    let plan = Arc::new(synthetic::layered_plan(
        "m",
        &[SyntheticKernel { logical_blocks: 64, threads_per_block: 128, shared_mem_bytes: 0 }; 8],
    ));
    let mut d = VirtualDriver::new(Config::default(), sim(6)).unwrap();
    d.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
    let region = VecMemory::new(1 << 20);
    let m = d.map_host(region.clone()).unwrap();
    let n = plan.inputs[0].shape[0];
    let mut first = Vec::new();
    let mut base = 0;
    for i in 0..4 {
        let (si, so, end) = spans(&plan, base);
        base = end;
        let x: Vec<f32> = (0..n).map(|k| (k as f32 - i as f32 * 7.0) / n as f32).collect();
        region.put(si[0], &f32_bytes(&x));
        let id = d.submit_bound_at(
            0,
            "m",
            vec![],
            IoBinding { mapping: m.id, inputs: si, outputs: so.clone() },
            RequestOptions::default(),
        );
        first.push((id, so[0], x));
    }
    d.schedule_command(1_000, Command::UnmapHost(m.id));
    let (si, so, _) = spans(&plan, base);
    let late =
        d.submit_bound_at(2_000, "m", vec![], IoBinding { mapping: m.id, inputs: si, outputs: so }, RequestOptions::default());
    d.run_until(1_500).unwrap();
    assert_eq!(d.dispatcher().host_mappings(), 1, "still mapped while its requests run");
    assert!(d.dispatcher().jobs() > 0, "the requests take longer than 1.5 us");
    d.run_until_idle().unwrap();
    let records = d.take_records();
    for (id, span, x) in &first {
        let r = records.iter().find(|r| r.id == *id).unwrap();
        r.result.as_ref().unwrap();
        let want: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
        assert_eq!(region.get(*span), f32_bytes(&want));
    }
    let last_done = first.iter().map(|(id, ..)| records.iter().find(|r| r.id == *id).unwrap().done_ns).max().unwrap();
    assert!(matches!(records.iter().find(|r| r.id == late).unwrap().result, Err(Error::InvalidInput(_))));
    let unmapped: Vec<_> = d.take_other_outputs().into_iter().filter(|o| matches!(o, Output::HostUnmapped { .. })).collect();
    assert!(matches!(unmapped.as_slice(), [Output::HostUnmapped { id, result: Ok(()) }] if *id == m.id), "{unmapped:?}");
    assert!(last_done > 1_000, "the unmap was asked for while requests ran");
    assert_eq!(d.dispatcher().host_mappings(), 0);
    assert_eq!(Arc::strong_count(&region), 1);
}

/// The threaded engine: map, submit bound requests, unmap (which waits for them); a GPU that
/// cannot map host memory says so.
#[test]
fn the_engine_maps_serves_and_unmaps() {
    let plan = Arc::new(synthetic::layered_plan(
        "m",
        &[SyntheticKernel { logical_blocks: 16, threads_per_block: 128, shared_mem_bytes: 0 }; 3],
    ));
    let engine = Engine::start(EngineConfig::default(), || Ok(sim(8))).unwrap();
    engine.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
    let region = VecMemory::new(1 << 20);
    let m = engine.map_host(region.clone()).unwrap();
    let n = plan.inputs[0].shape[0];
    let (tx, rx) = std::sync::mpsc::channel();
    let mut expect = Vec::new();
    let mut base = 0;
    for i in 0..8 {
        let (si, so, end) = spans(&plan, base);
        base = end;
        let x: Vec<f32> = (0..n).map(|k| ((k * 31 + i * 7) % 17) as f32 - 8.0).collect();
        region.put(si[0], &f32_bytes(&x));
        let tx = tx.clone();
        let woke = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let w = woke.clone();
        let notify: Option<Box<dyn FnOnce() + Send>> =
            if i % 2 == 0 { Some(Box::new(move || w.store(true, std::sync::atomic::Ordering::Release))) } else { None };
        let binding = IoBinding { mapping: m.id, inputs: si, outputs: so.clone() };
        engine.submit_bound("m", vec![], binding, RequestOptions::default(), notify, move |r| tx.send(r).unwrap()).unwrap();
        expect.push((so[0], x, i % 2 == 0, woke));
    }
    engine.unmap_host(m.id).unwrap();
    // Unmapping waited for all eight.
    let results: Vec<_> = rx.try_iter().collect();
    assert_eq!(results.len(), 8, "unmap_host returned before its requests completed");
    for r in results {
        assert!(r.unwrap().outputs.is_empty());
    }
    for (span, x, notified, woke) in expect {
        let want: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
        assert_eq!(region.get(span), f32_bytes(&want));
        assert_eq!(woke.load(std::sync::atomic::Ordering::Acquire), notified);
    }
    assert!(engine.unmap_host(m.id).is_err(), "a mapping goes once");
    assert_eq!(Arc::strong_count(&region), 1);
    engine.shutdown();

    let mini =
        Engine::start(EngineConfig::default(), || Ok(common::mini::MiniGpu::new(common::mini::MiniConfig::default()))).unwrap();
    let e = mini.map_host(VecMemory::new(4096)).unwrap_err();
    assert!(e.to_string().contains("unsupported"), "{e}");
}

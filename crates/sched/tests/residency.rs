//! Residency under a weight budget on the simulator (computing): cold requests compute what warm
//! ones do under every cold strategy (DHA layers included), least recently used idle models are
//! evicted and never one with requests, a load that does not fit waits for room, a model larger
//! than the budget is refused, and the pipelined load overlaps the copies with the kernels.
//!
//! One seed per test, printed; `KAIROS_SEED=N cargo test -p kairos-sched --test residency`
//! replays it.

use kairos_gpu::profile::{LaunchColdTimes, LayerLoad, LayerProfile, ModelProfile};
use kairos_ir::plan::Plan;
use kairos_ir::{DType, Tensor};
use kairos_sched::cold::ColdStrategy;
use kairos_sched::*;
use kairos_sim::{GpuDesc, SimGpu, SimOptions};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

fn seed() -> u64 {
    let s = std::env::var("KAIROS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(11);
    println!("seed {s} (KAIROS_SEED={s} reproduces)");
    s
}

fn sim(seed: u64) -> SimGpu {
    SimGpu::new(GpuDesc::h100_sxm(), SimOptions { seed, check_invariants: true, ..SimOptions::default() })
}

/// The simulator with a secondary GPU attached: its PCIe link as fast as this GPU's, forwarding
/// over NVLink at 300 GB/s.
fn sim_with_peer(seed: u64) -> SimGpu {
    let mut gpu = sim(seed);
    gpu.attach_peer(1, GpuDesc::h100_sxm().h2d_bytes_per_s, 300e9, 8 << 20).unwrap();
    gpu
}

fn plan() -> Arc<Plan> {
    let mut spec = kairos_ir::model::ModelSpec::new("squeezenet1_1");
    spec.dtype = DType::F16;
    Arc::new(spec.plan().unwrap())
}

fn inputs(plan: &Plan, seed: u64) -> Vec<Tensor> {
    let mut rng = SmallRng::seed_from_u64(seed);
    plan.inputs
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            Tensor::f32(t.shape.clone(), (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()).cast(t.dtype)
        })
        .collect()
}

/// What the model answers with every weight resident (no budget): the bytes cold answers must equal.
fn warm_outputs(plan: &Arc<Plan>, x: &[Tensor], seed: u64) -> Vec<Vec<u8>> {
    let mut d = VirtualDriver::new(Config::default(), sim(seed)).unwrap();
    d.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
    let id = d.submit_at(0, "m", x.to_vec(), RequestOptions::default());
    d.run_until_idle().unwrap();
    let r = d.take_records().into_iter().find(|r| r.id == id).unwrap();
    r.result.unwrap();
    r.outputs.iter().map(|t| t.to_bytes()).collect()
}

/// A layer profile in which the first three weight layers cost as much from host memory as from
/// device memory and take long to copy (embedding-like: DeepPlan keeps them in host memory), the
/// rest twelve times more (dense layers: loaded).
fn profile_with_cheap_early_layers(plan: &Plan) -> ModelProfile {
    let launches = plan
        .launches
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let cheap = l.layer.is_some_and(|j| j < 3);
            LaunchColdTimes { launch: i as u32, exec_gpu_ns: 20_000, exec_host_ns: if cheap { 21_000 } else { 240_000 } }
        })
        .collect();
    let layers = plan
        .layers
        .iter()
        .enumerate()
        .map(|(j, l)| LayerLoad { layer: j as u32, bytes: l.len_bytes, load_ns: if j < 3 { 400_000 } else { 30_000 } })
        .collect();
    ModelProfile {
        model: plan.model.clone(),
        dtype: plan.dtype,
        batch: 1,
        device: "NVIDIA H100 80GB HBM3".into(),
        sm_count: 132,
        latency_ns: 0,
        kernels: vec![],
        layers: Some(LayerProfile { launches, layers, profiling_ns: 0 }),
        placements: None,
    }
}

fn budget_config(policy: &str, strategy: ColdStrategy, budget_bytes: u64) -> Config {
    let mut c = Config::default().with_policy(PolicyConfig::by_name(policy).unwrap());
    c.weight_budget_bytes = Some(budget_bytes);
    c.cold_strategy = strategy;
    c.cold_chunk_bytes = 256 << 10;
    c
}

/// Outputs of requests to three instances of a model under a budget that holds one of them, in
/// an order that evicts at every switch, equal the outputs without a budget, for every strategy,
/// two policies (whole-job and kernel-level) and two copy windows (the whole load at once; one
/// 512 KiB piece at a time, which the kernel-level policy never has to bring forward).
#[test]
fn cold_requests_compute_what_warm_ones_do() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let want = warm_outputs(&plan, &x, seed);
    for (policy, window) in [("fifo", 0), ("paella", 0), ("fifo", 512 << 10), ("paella", 512 << 10)] {
        for strategy in ColdStrategy::ALL {
            let what = format!("{policy} window {window} {strategy:?} (seed {seed})");
            let gpu = if strategy.is_parallel() { sim_with_peer(seed) } else { sim(seed) };
            let mut cfg = budget_config(policy, strategy, plan.weight_bytes + 4096);
            cfg.cold_copy_window_bytes = window;
            let mut d = VirtualDriver::new(cfg, gpu).unwrap();
            for i in 0..3 {
                let profile = strategy.uses_host_reads().then(|| profile_with_cheap_early_layers(&plan));
                d.load_model(ModelSpec { name: format!("m{i}"), plan: plan.clone(), profile }).unwrap();
            }
            let cold = d.dispatcher().cold_plan_of("m0").unwrap().clone();
            if strategy.is_parallel() {
                assert!(cold.part.contains(&1), "{what}: the later layers go through the secondary: {:?}", cold.part);
                assert!(cold.forwarded_bytes > 0 && cold.forwarded_bytes < plan.weight_bytes, "{what}: {cold:?}");
            } else {
                assert!(cold.part.is_empty(), "{what}: one GPU copies everything");
            }
            if strategy.uses_host_reads() {
                assert!(cold.host.iter().any(|&h| h), "{what}: the cheap early layers stay in host memory: {:?}", cold.host);
                assert!(cold.host.iter().skip(3).all(|&h| !h), "{what}: dense layers are loaded: {:?}", cold.host);
            } else {
                assert!(cold.host.iter().all(|&h| !h), "{what}: every layer is loaded");
            }
            // m0 fits at load; m1 and m2 wait in host memory.
            assert_eq!(d.dispatcher().residency_of("m0"), Some(ResidencyState::Resident), "{what}");
            assert_eq!(d.dispatcher().residency_of("m1"), Some(ResidencyState::HostOnly), "{what}");
            let order = ["m1", "m0", "m2", "m2", "m1", "m0"];
            let mut ids = Vec::new();
            for (k, name) in order.iter().enumerate() {
                ids.push(d.submit_at(k as u64 * 3_000_000, name, x.clone(), RequestOptions::default()));
            }
            d.run_until_idle().unwrap();
            let records: HashMap<RequestId, RequestRecord> = d.take_records().into_iter().map(|r| (r.id, r)).collect();
            // Every switch is a cold start; the second m2 in a row finds it resident.
            let cold = [true, true, true, false, true, true];
            for ((id, name), cold) in ids.iter().zip(order).zip(cold) {
                let r = &records[id];
                let t = r.result.as_ref().unwrap_or_else(|e| panic!("{what}: {name}: {e}"));
                assert_eq!(t.cold_start, cold, "{what}: {name} at {} ns", r.arrival_ns);
                let got: Vec<Vec<u8>> = r.outputs.iter().map(|t| t.to_bytes()).collect();
                assert_eq!(got, want, "{what}: {name} computed something else than the warm model");
            }
            let s = d.dispatcher().stats();
            // m1, m0, m2, m1, m0: five loads, each evicting the one before.
            assert_eq!(s.cold_starts, 5, "{what}: {s:?}");
            assert_eq!(s.loads_completed, 5, "{what}: {s:?}");
            assert_eq!(s.evictions, 5, "{what}: {s:?}");
            assert!(d.dispatcher().resident_weight_bytes() <= plan.weight_bytes + 4096, "{what}");
            // The window: pieces of at most half of it, queued while less than it is on the
            // engine, unless a whole job brought one forward (never under the kernel-level policy).
            if window > 0 && strategy != ColdStrategy::LoadThenRun {
                if policy == "paella" {
                    assert_eq!(s.load_copies_forced, 0, "{what}: {s:?}");
                    assert!(s.load_copy_bytes_in_flight_max <= window + window / 2, "{what}: {s:?}");
                } else if !strategy.is_parallel() {
                    assert!(s.load_copies_forced > 0, "{what}: a whole job needs every layer queued: {s:?}");
                }
            }
            if window == 0 && !strategy.is_parallel() {
                assert!(s.load_copy_bytes_in_flight_max >= plan.weight_bytes / 2, "{what}: the load went out at once: {s:?}");
            }
            let gpu = d.into_gpu();
            gpu.audit().unwrap();
        }
    }
}

/// A model under steady traffic and a stream of models asked once, with room for three: at the
/// third cold start plain LRU evicts the steady model (its last request is older than the
/// others' loads), LRU-2 evicts a model asked once; the steady model's next request is a cold
/// start under LRU only. Answers are the warm ones either way.
#[test]
fn lru2_keeps_a_model_under_steady_traffic() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let want = warm_outputs(&plan, &x, seed);
    for eviction in [Eviction::Lru, Eviction::Lru2] {
        let what = format!("{eviction} (seed {seed})");
        let mut cfg = budget_config("paella", ColdStrategy::Pipelined, 3 * plan.weight_bytes + 4096);
        cfg.eviction = eviction;
        let mut d = VirtualDriver::new(cfg, sim(seed)).unwrap();
        for name in ["hot", "c0", "c1", "c2", "c3", "c4"] {
            d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
        }
        // hot, c0 and c1 fit at load.
        let ms = 1_000_000u64;
        let mut ids = Vec::new();
        for (at_ms, name) in [(0, "hot"), (10, "hot"), (20, "hot"), (30, "c2"), (60, "c3"), (90, "c4"), (120, "hot")] {
            ids.push((name, d.submit_at(at_ms * ms, name, x.clone(), RequestOptions::default())));
        }
        d.run_until_idle().unwrap();
        let records: HashMap<RequestId, RequestRecord> = d.take_records().into_iter().map(|r| (r.id, r)).collect();
        let mut cold = Vec::new();
        for (name, id) in &ids {
            let r = &records[id];
            let t = r.result.as_ref().unwrap_or_else(|e| panic!("{what}: {name}: {e}"));
            let got: Vec<Vec<u8>> = r.outputs.iter().map(|t| t.to_bytes()).collect();
            assert_eq!(got, want, "{what}: {name}");
            cold.push(t.cold_start);
        }
        let last_hot_cold = *cold.last().unwrap();
        assert_eq!(&cold[..6], &[false, false, false, true, true, true], "{what}");
        match eviction {
            Eviction::Lru => assert!(last_hot_cold, "{what}: LRU evicted the steady model at 90 ms"),
            Eviction::Lru2 => {
                assert!(!last_hot_cold, "{what}: LRU-2 kept the steady model");
                assert_eq!(d.dispatcher().residency_of("hot"), Some(ResidencyState::Resident), "{what}");
            }
        }
        assert_eq!(d.dispatcher().stats().evictions, 3 + last_hot_cold as u64, "{what}");
    }
}

/// Two requests at once to two models when the budget holds one: the second model's load waits
/// until the first model's request is done (a model with requests is never evicted), then runs.
#[test]
fn a_model_with_requests_is_never_evicted() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let mut d =
        VirtualDriver::new(budget_config("paella", ColdStrategy::Pipelined, plan.weight_bytes + 4096), sim(seed)).unwrap();
    for name in ["a", "b"] {
        d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
    }
    let a = d.submit_at(0, "a", x.clone(), RequestOptions::default());
    let b = d.submit_at(1_000, "b", x.clone(), RequestOptions::default());
    d.run_until_idle().unwrap();
    let records: HashMap<RequestId, RequestRecord> = d.take_records().into_iter().map(|r| (r.id, r)).collect();
    let (ta, tb) = (*records[&a].result.as_ref().unwrap(), *records[&b].result.as_ref().unwrap());
    assert!(tb.admitted_ns >= ta.done_ns, "b was admitted at {} while a ran until {}", tb.admitted_ns, ta.done_ns);
    assert_eq!(d.dispatcher().stats().evictions, 1);
    assert_eq!(d.dispatcher().residency_of("a"), Some(ResidencyState::HostOnly));
    assert_eq!(d.dispatcher().residency_of("b"), Some(ResidencyState::Resident));
}

/// A model whose loaded layers exceed the whole budget loads (it lives in host memory) but its
/// requests fail with a reason; other models keep serving.
#[test]
fn a_model_larger_than_the_budget_is_refused_with_a_reason() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let mut d = VirtualDriver::new(budget_config("fifo", ColdStrategy::Pipelined, plan.weight_bytes / 2), sim(seed)).unwrap();
    d.load_model(ModelSpec { name: "big".into(), plan: plan.clone(), profile: None }).unwrap();
    let id = d.submit_at(0, "big", x, RequestOptions::default());
    d.run_until_idle().unwrap();
    let r = d.take_records().into_iter().find(|r| r.id == id).unwrap();
    let e = r.result.unwrap_err().to_string();
    assert!(e.contains("weight budget"), "{e}");
}

/// In virtual time, a cold request under the pipelined load ends before one under load-then-run
/// (its kernels run while later layers are still being copied), and both after the copy of the
/// first layer. The simulator is a design tool: this checks the mechanism overlaps, not speed.
#[test]
fn the_pipelined_load_overlaps_copies_with_kernels() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let mut latency = Vec::new();
    for strategy in [ColdStrategy::LoadThenRun, ColdStrategy::Pipelined] {
        let mut d = VirtualDriver::new(budget_config("fifo", strategy, plan.weight_bytes + 4096), sim(seed)).unwrap();
        // "warm" takes the budget at load: "m" starts in host memory.
        for name in ["warm", "m"] {
            d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
        }
        assert_eq!(d.dispatcher().residency_of("m"), Some(ResidencyState::HostOnly));
        let id = d.submit_at(0, "m", x.clone(), RequestOptions::default());
        d.run_until_idle().unwrap();
        let r = d.take_records().into_iter().find(|r| r.id == id).unwrap();
        latency.push(r.result.unwrap().latency_ns());
        assert_eq!(d.dispatcher().stats().cold_starts, 1);
    }
    println!("cold latency in virtual time: load-then-run {} ns, pipelined {} ns", latency[0], latency[1]);
    assert!(latency[1] < latency[0], "pipelined {} ns is not below load-then-run {} ns", latency[1], latency[0]);
}

/// Two loads that start together go through the copy engine one after the other, each at the
/// engine's full rate (the first cold request answers about as fast as alone, the second one
/// load's copy time later), not sharing it piece by piece (both answering about one load's copy
/// time later than alone), under the kernel-level policy and a window much smaller than a model.
#[test]
fn loads_take_the_copy_engine_in_turn() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let mut cfg = budget_config("paella", ColdStrategy::Pipelined, 2 * plan.weight_bytes + 8192);
    cfg.cold_copy_window_bytes = 512 << 10;
    assert!(plan.weight_bytes > 4 * cfg.cold_copy_window_bytes, "the model must span many windows");
    // A slow link, so that the copies, not the kernels, make a cold start.
    let mut desc = GpuDesc::h100_sxm();
    desc.h2d_bytes_per_s = 1e9;
    let cold_latency_ns = |cold: &[&str]| {
        let gpu = SimGpu::new(desc.clone(), SimOptions { seed, check_invariants: true, ..SimOptions::default() });
        let mut d = VirtualDriver::new(cfg.clone(), gpu).unwrap();
        // "w0" and "w1" take the budget at load; the others start in host memory.
        for name in ["w0", "w1", "a", "b"] {
            d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
        }
        let ids: Vec<_> = cold.iter().map(|m| d.submit_at(0, m, x.clone(), RequestOptions::default())).collect();
        d.run_until_idle().unwrap();
        let records = d.take_records();
        assert_eq!(d.dispatcher().stats().cold_starts, cold.len() as u64);
        let s = d.dispatcher().stats();
        assert!(s.load_copy_bytes_in_flight_max <= cfg.cold_copy_window_bytes * 3 / 2, "one window for all loads: {s:?}");
        ids.iter()
            .map(|id| records.iter().find(|r| r.id == *id).unwrap().result.as_ref().unwrap().latency_ns())
            .collect::<Vec<u64>>()
    };
    let alone = cold_latency_ns(&["a"])[0];
    let both = cold_latency_ns(&["a", "b"]);
    println!("cold latency in virtual time: alone {alone} ns, two loads at once {both:?} ns");
    // One load's copies at 1 GB/s: a nanosecond a byte. Sharing the engine piece by piece, both
    // would answer about one load's copy time later than alone.
    let copy_ns = plan.weight_bytes as f64;
    assert!(
        both[0] as f64 <= alone as f64 + 0.25 * copy_ns,
        "the first load shared the engine: {} ns, {alone} ns alone",
        both[0]
    );
    assert!(both[1] as f64 >= alone as f64 + 0.75 * copy_ns, "the second load did not wait for the first: {} ns", both[1]);
}

/// The layer profile measured on the simulator (whose kernels read mapped host memory at the
/// PCIe rate): one entry per launch and per layer, kernels reading their weights from host memory
/// no faster than from device memory (within the jitter), and a plan from it that the dispatcher accepts.
#[test]
fn layer_profile_on_the_simulator() {
    let seed = seed();
    let plan = plan();
    let mut gpu = sim(seed);
    let p = kairos_gpu::exec::profile_layers(&mut gpu, &plan, 2).unwrap();
    p.check_plan(&plan).unwrap();
    assert!(p.profiling_ns > 0);
    let with_weights: Vec<_> = p.launches.iter().filter(|t| plan.launches[t.launch as usize].layer.is_some()).collect();
    assert!(!with_weights.is_empty());
    for t in &with_weights {
        assert!(t.exec_gpu_ns > 0, "launch {} has no duration", t.launch);
        // Within the simulator's jitter of a kernel's duration.
        assert!(
            t.exec_host_ns as f64 >= 0.95 * t.exec_gpu_ns as f64,
            "launch {}: host {} < device {}",
            t.launch,
            t.exec_host_ns,
            t.exec_gpu_ns
        );
    }
    assert!(with_weights.iter().any(|t| t.exec_host_ns > t.exec_gpu_ns), "reading host memory costs something");
    assert!(p.layers.iter().all(|l| l.load_ns > 0));
    let input = kairos_sched::cold::ColdInput::measured(&plan, &p).unwrap();
    let deepplan = kairos_sched::cold::plan(&input, ColdStrategy::DeepPlan);
    let pipelined = kairos_sched::cold::plan(&input, ColdStrategy::Pipelined);
    assert!(deepplan.predicted_ns <= pipelined.predicted_ns);
    println!("{}", kairos_sched::cold::explain(&input, &deepplan));
}

/// A model unloaded, and the dispatcher shut down, while a load's copies are in flight (its one
/// request cancelled at once): the memory the copies write into is freed only after they land,
/// and the unload and the shutdown are both answered.
#[test]
fn unload_and_shutdown_wait_for_a_loads_copies() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    for shutdown in [false, true] {
        let mut d =
            VirtualDriver::new(budget_config("fifo", ColdStrategy::Pipelined, plan.weight_bytes + 4096), sim(seed)).unwrap();
        for name in ["warm", "m"] {
            d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
        }
        let id = d.submit_at(1_000, "m", x.clone(), RequestOptions::default());
        d.cancel_at(1_000, id);
        d.schedule_command(1_000, if shutdown { Command::Shutdown } else { Command::UnloadModel("m".into()) });
        d.run_until_idle().unwrap();
        let other = d.take_other_outputs();
        if shutdown {
            assert!(other.iter().any(|o| matches!(o, Output::ShutDown)), "{other:?}");
        } else {
            assert!(other.iter().any(|o| matches!(o, Output::ModelUnloaded { result: Ok(()), .. })), "{other:?}");
            assert_eq!(d.dispatcher().residency_of("m"), None);
        }
        assert_eq!(d.dispatcher().stats().cold_starts, 1, "the request started the load before it was cancelled");
        assert_eq!(d.dispatcher().work_in_flight(), 0);
        d.into_gpu().audit().unwrap();
    }
}

/// In virtual time, a cold request whose later layers come through a secondary GPU (parallel
/// transmission, DeepPlan's PT) ends before the one-GPU pipelined load, computes the same outputs,
/// and without a secondary attached the parallel strategy is the pipelined one. PCIe at 1 GB/s
/// (both GPUs' links), so that the copies weigh on this small model as they do on a transformer's
/// cold start on real hardware.
#[test]
fn parallel_transmission_copies_through_the_secondary() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let slow_pcie = |peer: bool| {
        let mut desc = GpuDesc::h100_sxm();
        desc.h2d_bytes_per_s = 1e9;
        let mut gpu = SimGpu::new(desc, SimOptions { seed, check_invariants: true, ..SimOptions::default() });
        if peer {
            gpu.attach_peer(1, 1e9, 300e9, 8 << 20).unwrap();
        }
        gpu
    };
    let mut runs = Vec::new();
    for (strategy, gpu) in [
        (ColdStrategy::Pipelined, slow_pcie(false)),
        (ColdStrategy::Parallel, slow_pcie(true)),
        (ColdStrategy::Parallel, slow_pcie(false)),
    ] {
        let mut d = VirtualDriver::new(budget_config("fifo", strategy, plan.weight_bytes + 4096), gpu).unwrap();
        for name in ["warm", "m"] {
            d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
        }
        let forwarded = d.dispatcher().cold_plan_of("m").unwrap().forwarded_bytes;
        let id = d.submit_at(0, "m", x.clone(), RequestOptions::default());
        d.run_until_idle().unwrap();
        let r = d.take_records().into_iter().find(|r| r.id == id).unwrap();
        let outputs: Vec<Vec<u8>> = r.outputs.iter().map(|t| t.to_bytes()).collect();
        let t = r.result.unwrap();
        assert!(t.cold_start);
        assert_eq!(d.dispatcher().stats().loads_completed, 1);
        d.into_gpu().audit().unwrap();
        runs.push((t.latency_ns(), forwarded, outputs));
    }
    println!(
        "cold latency in virtual time: pipelined {} ns, parallel {} ns ({} bytes forwarded), parallel without a secondary {} ns",
        runs[0].0, runs[1].0, runs[1].1, runs[2].0
    );
    assert!(
        runs[1].1 > 0 && runs[0].1 == 0 && runs[2].1 == 0,
        "forwarded bytes {:?}",
        runs.iter().map(|r| r.1).collect::<Vec<_>>()
    );
    // Part 1 crosses the other link while part 0 crosses this one: at least half of its serial
    // copy time (bytes at 1 GB/s) is saved.
    let saved_ns = runs[0].0 as f64 - runs[1].0 as f64;
    let part1_copy_ns = runs[1].1 as f64 / 1e9 * 1e9;
    assert!(
        saved_ns >= 0.5 * part1_copy_ns,
        "parallel {} ns saves {saved_ns} ns over pipelined {} ns, less than half of part 1's copy ({part1_copy_ns} ns)",
        runs[1].0,
        runs[0].0
    );
    assert_eq!(runs[1].2, runs[0].2, "parallel transmission computed something else");
    assert_eq!(runs[2].2, runs[0].2);
}

/// Two loads at once with one secondary: the second finds the secondary's link busy with the
/// first's copies and copies its whole model itself (in layer order); both answer what the warm
/// model answers.
#[test]
fn a_load_copies_alone_while_the_secondary_is_busy() {
    let seed = seed();
    let plan = plan();
    let x = inputs(&plan, seed);
    let want = warm_outputs(&plan, &x, seed);
    let mut desc = GpuDesc::h100_sxm();
    desc.h2d_bytes_per_s = 1e9;
    let mut gpu = SimGpu::new(desc, SimOptions { seed, check_invariants: true, ..SimOptions::default() });
    gpu.attach_peer(1, 1e9, 300e9, 8 << 20).unwrap();
    let budget = 2 * (plan.weight_bytes + 4096);
    let mut d = VirtualDriver::new(budget_config("fifo", ColdStrategy::Parallel, budget), gpu).unwrap();
    // w1 and w2 take the budget at load; m1 and m2 start in host memory.
    for name in ["w1", "w2", "m1", "m2"] {
        d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: None }).unwrap();
    }
    assert_eq!(d.dispatcher().residency_of("m2"), Some(ResidencyState::HostOnly));
    let a = d.submit_at(0, "m1", x.clone(), RequestOptions::default());
    let b = d.submit_at(1_000, "m2", x.clone(), RequestOptions::default());
    d.run_until_idle().unwrap();
    let records: HashMap<RequestId, RequestRecord> = d.take_records().into_iter().map(|r| (r.id, r)).collect();
    for id in [a, b] {
        let r = &records[&id];
        assert!(r.result.as_ref().unwrap().cold_start);
        let got: Vec<Vec<u8>> = r.outputs.iter().map(|t| t.to_bytes()).collect();
        assert_eq!(got, want, "seed {seed}");
    }
    let s = d.dispatcher().stats();
    assert_eq!((s.cold_starts, s.loads_completed), (2, 2), "{s:?}");
    assert_eq!(s.secondary_busy_loads, 1, "the second load found the secondary busy: {s:?}");
    d.into_gpu().audit().unwrap();
}

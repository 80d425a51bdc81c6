//! Every preset on the simulated H200 (measured profiles), at a small scale: the results have the
//! shape the preset promises and sane values. Not a performance test: nothing here asserts that one
//! policy beats another. The models are lowered once for the whole file.
//!
//! Reproduce a failure with the seed it prints: `KAIROS_SEED=N cargo test -p kairos-bench --test presets`.

use kairos_bench::experiment::{Quiet, SweepOptions, lower_models, register_on_sim, run_preset};
use kairos_bench::presets::{Length, Preset, PresetOptions};
use kairos_bench::report::{Point, PresetResults, Results};
use kairos_bench::runner::Catalog;
use kairos_bench::target::{EngineTarget, VirtualTarget};
use kairos_bench::trace::{PEER_FORMAT, PeerFile, PeerRun, TraceFile};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::DType;
use kairos_sched::EngineConfig;
use kairos_sim::{GpuDesc, SimGpu, SimOptions};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn seed() -> u64 {
    std::env::var("KAIROS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(11)
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every architecture any preset needs, lowered once (fp16, with the H200 profiles).
fn catalog() -> &'static Catalog {
    static C: OnceLock<Catalog> = OnceLock::new();
    C.get_or_init(|| {
        let profiles = ProfileSet::load_dir(&repo().join("data/profiles/h200")).unwrap();
        let (opts, copies) = (PresetOptions::default(), PresetOptions { be_copies: true, ..PresetOptions::default() });
        let mut archs: Vec<String> = Vec::new();
        for n in Preset::NAMES {
            let p = Preset::by_name(n).unwrap();
            for a in p.archs(&opts).into_iter().chain(p.archs(&copies)) {
                if !archs.contains(&a) {
                    archs.push(a);
                }
            }
        }
        lower_models(&archs, DType::F16, &profiles, |_, _| {}).unwrap()
    })
}

fn sim(seed: u64) -> VirtualTarget<SimGpu> {
    let mut gpu = SimGpu::new(GpuDesc::h200(), SimOptions::timing_only(seed));
    register_on_sim(&mut gpu, catalog()).unwrap();
    VirtualTarget::new(gpu, true)
}

fn small(policies: &[&str], loads: &[f64], length: Length) -> SweepOptions {
    SweepOptions {
        policies: Some(policies.iter().map(|s| s.to_string()).collect()),
        loads: Some(loads.to_vec()),
        length: Some(length),
        seed: seed(),
        isolated_repeats: 1,
        ..SweepOptions::default()
    }
}

fn run(preset: &str, opts: &SweepOptions) -> PresetResults {
    let s = seed();
    eprintln!("{preset}: seed {s}");
    let p = Preset::by_name(preset).unwrap();
    run_preset(&mut sim(s), &p, catalog(), opts, &mut Quiet).unwrap_or_else(|e| panic!("{preset} (seed {s}): {e}"))
}

/// Checks every point: requests were measured and completed, percentiles are ordered, latency is
/// at least `min_latency_ns`, queue + GPU time make up the latency, served load never exceeds the
/// offered open-loop load by more than the closed loops' share.
fn check_points(r: &PresetResults, min_latency_ns: u64) {
    assert!(!r.points.is_empty(), "{}: no points", r.preset);
    for p in &r.points {
        let o = &p.metrics.overall;
        let ctx = format!("{} {} {} load {}", p.preset, p.variant, p.policy, p.load);
        assert!(o.requests > 0 && o.completed > 0, "{ctx}: {o:?}");
        assert_eq!(o.requests, o.completed + o.rejected + o.failed + o.unfinished, "{ctx}");
        let l = &o.latency;
        assert!(l.p50_ns <= l.p90_ns && l.p90_ns <= l.p99_ns && l.p99_ns <= l.p999_ns && l.p999_ns <= l.max_ns, "{ctx}: {l:?}");
        assert!(l.p50_ns >= min_latency_ns, "{ctx}: p50 {} ns below {min_latency_ns} ns", l.p50_ns);
        // Queue and GPU time are parts of the latency (HdrHistogram rounds by 0.1%).
        assert!(o.queue.mean_ns + o.gpu.mean_ns <= l.mean_ns * 1.01 + 1000.0, "{ctx}");
        assert!(o.goodput_per_s <= o.throughput_per_s + 1e-9, "{ctx}");
        let groups: u64 = p.metrics.groups.iter().map(|g| g.requests).sum();
        let models: u64 = p.metrics.models.iter().map(|g| g.requests).sum();
        assert_eq!((groups, models), (o.requests, o.requests), "{ctx}: groups and models partition the requests");
        if p.metrics.offered_per_s > 0.0 && !p.saturated {
            assert!(p.metrics.served_open_per_s >= 0.9 * p.metrics.offered_per_s, "{ctx}");
        }
    }
}

fn min_isolated_ns(r: &PresetResults) -> u64 {
    r.isolated_ms.values().map(|&v| (v * 1e6) as u64).min().unwrap()
}

#[test]
fn paella_mix_has_both_sigmas_and_every_policy() {
    let r = run("paella-mix", &small(&["fifo", "streams", "paella"], &[0.5, 2.0], Length::Requests(60)));
    assert_eq!(r.isolated_ms.len(), 11);
    check_points(&r, min_isolated_ns(&r) / 2);
    for v in ["sigma=1.5", "sigma=2"] {
        for pol in ["streams", "paella"] {
            assert!(r.points.iter().any(|p| p.variant == v && p.policy == pol && p.load == 2.0), "{v} {pol}");
        }
    }
    // Eleven models, one group.
    assert!(r.points.iter().all(|p| p.metrics.groups.len() == 1 && p.metrics.models.len() == 11));
    // A policy's sweep that saturated skipped its higher loads, and says so.
    let ran = r.points.len() + r.skipped.len();
    assert_eq!(ran, 2 * 3 * 2);
}

#[test]
fn paella_short_long_reports_the_short_model() {
    let r = run("paella-short-long", &small(&["streams", "paella"], &[1.0, 3.0], Length::Requests(80)));
    check_points(&r, min_isolated_ns(&r) / 2);
    for p in &r.points {
        let short = p.metrics.model("resnet18").unwrap();
        let long = p.metrics.model("inception_v3").unwrap();
        // Shares are inverse to size: more short requests than long ones.
        assert!(short.requests > long.requests, "{:?} vs {:?}", short.requests, long.requests);
        assert!(p.headline_summary(&r.headline).unwrap().name.starts_with("resnet18"));
    }
}

#[test]
fn paella_hol_jobs_take_at_least_their_eight_kernels() {
    let r = run("paella-hol", &small(&["streams", "paella"], &[0.2, 0.6], Length::Requests(100)));
    // 8 kernels of 300 us in a chain.
    check_points(&r, 8 * 300_000 * 9 / 10);
    assert!((r.isolated_ms["hol"] - 2.4).abs() < 0.5, "{:?}", r.isolated_ms);
}

fn check_disb(preset: &str, loads: &[f64], rt_streams: usize) -> PresetResults {
    let r = run(preset, &small(&["streams", "paella"], loads, Length::DurationNs(250_000_000)));
    // DISB's models (vgg19, resnet152, densenet201, inception_v3, distilbert) take well over
    // 100 us each on the simulated H200, from measured profiles or from the roofline.
    check_points(&r, 100_000);
    for p in &r.points {
        let rt = p.metrics.group("rt").expect("rt group");
        let be = p.metrics.group("be").expect("be group");
        assert!(rt.completed > 0 && be.completed > 0, "{preset}: {rt:?} {be:?}");
        let rt_models = p.metrics.models.iter().filter(|m| m.name.ends_with("/rt")).count();
        assert_eq!(rt_models, rt_streams, "{preset}");
    }
    r
}

#[test]
fn disb_a_and_b() {
    let a = check_disb("disb-a", &[0.25, 1.0], 1);
    // Load 1 offers DISB's 100 requests/s of vgg19 (periodic: exactly, within the window).
    let p = a.points.iter().find(|p| p.load == 1.0 && p.policy == "paella").unwrap();
    assert!((p.metrics.offered_per_s - 100.0).abs() < 10.0, "{}", p.metrics.offered_per_s);
    let b = check_disb("disb-b", &[1.0], 1);
    // Closed loops only: nothing offered, nothing saturates.
    assert!(b.points.iter().all(|p| p.metrics.offered_per_s == 0.0 && !p.saturated));
}

/// REEF's padding experiment: one pair, its RT-Only variant, and `reef+stopruns` with and without
/// the hold-off, which must not stall the bench's virtual target (it waits for the hold's end).
#[test]
fn reef_pairs_run_with_and_without_the_hold_off() {
    let pairs = kairos_bench::presets::parse_pairs("vgg19+resnet152").unwrap();
    for rt_only in [false, true] {
        let mut opts = small(&["reef+stopruns", "reef+stopruns+hold=200"], &[1.0], Length::DurationNs(100_000_000));
        opts.preset = PresetOptions { pairs: pairs.clone(), rt_only, ..PresetOptions::default() };
        let r = run("reef-pairs", &opts);
        check_points(&r, 100_000);
        let variant = if rt_only { "rt=vgg19,rt-only" } else { "rt=vgg19,be=resnet152" };
        assert!(r.points.iter().all(|p| p.variant == variant && p.metrics.offered_per_s == 0.0), "{variant}");
        assert_eq!(r.points.len(), 2);
        for p in &r.points {
            let rt = p.metrics.group("rt").expect("rt group");
            assert!(rt.completed > 0, "{} {variant}: {rt:?}", p.policy);
            assert_eq!(p.metrics.group("be").is_some(), !rt_only, "{} {variant}", p.policy);
        }
    }
}

#[test]
fn disb_c_d_e() {
    check_disb("disb-c", &[0.25], 1);
    check_disb("disb-d", &[0.5], 5);
    check_disb("disb-e", &[0.5], 5);
}

/// `--be-copies`: on DISB E every best-effort client asks for a copy of its model (`ARCH~be`), so
/// no model serves both classes, and both classes complete under `reef+stopruns` and `streams`.
#[test]
fn disb_e_with_best_effort_copies() {
    let mut opts = small(&["reef+stopruns", "streams"], &[0.5], Length::DurationNs(250_000_000));
    opts.preset = PresetOptions { be_copies: true, ..PresetOptions::default() };
    let r = run("disb-e", &opts);
    check_points(&r, 100_000);
    assert_eq!(r.points.len(), 2);
    for p in &r.points {
        assert_eq!(p.variant, "be-copies", "{}", p.policy);
        let (rt, be) = (p.metrics.group("rt").expect("rt group"), p.metrics.group("be").expect("be group"));
        assert!(rt.completed > 0 && be.completed > 0, "{}: {rt:?} {be:?}", p.policy);
        let copies: Vec<_> = p.metrics.models.iter().filter(|m| m.name.contains("~be")).collect();
        assert_eq!(copies.len(), 5, "{}: {:?}", p.policy, p.metrics.models.iter().map(|m| &m.name).collect::<Vec<_>>());
        assert!(copies.iter().all(|m| m.completed > 0 && m.name.ends_with("/be")), "{}: {copies:?}", p.policy);
    }
}

#[test]
fn daris_reports_deadline_misses_per_priority() {
    let r = run("daris", &small(&["streams", "paella"], &[1.0, 1.5], Length::DurationNs(600_000_000)));
    check_points(&r, min_isolated_ns(&r) / 2);
    let capacity = r.capacity_per_s.expect("daris measures the GPU's throughput on its task mix");
    for p in &r.points {
        let want = p.load * capacity;
        assert!((p.metrics.offered_per_s / want - 1.0).abs() < 0.25, "offered {} for {want}", p.metrics.offered_per_s);
        for g in ["hp", "lp"] {
            let s = p.metrics.group(g).unwrap();
            assert!(s.with_deadline > 0 && s.with_deadline == s.requests, "{g}: {s:?}");
            let rate = s.miss_rate().unwrap();
            assert!((0.0..=1.0).contains(&rate));
        }
    }
}

#[test]
fn coldstart_loads_and_evicts_within_the_budget() {
    let mut opts = small(&["streams", "paella"], &[0.5], Length::Requests(150));
    opts.preset.instances = 2;
    let r = run("coldstart", &opts);
    check_points(&r, min_isolated_ns(&r) / 2);
    for p in &r.points {
        // 16 instances, a weight budget of a third: the engine's cold starts (warm-up included) and
        // evictions, and measured requests that waited for a load marked cold.
        assert!(p.model_loads > 16 && p.model_unloads > 0, "{} loads, {} unloads", p.model_loads, p.model_unloads);
        assert!(p.metrics.overall.cold > 0, "no measured request was a cold start ({} loads)", p.model_loads);
        assert_eq!(p.metrics.models.len(), 16);
    }
}

#[test]
fn deepplan_azure_replays_the_trace_over_instances_under_the_budget() {
    let mut opts = small(&["paella"], &[0.5], Length::Requests(200));
    opts.preset.instances = 1;
    opts.preset.custom.arrival = format!("azure:{}", repo().join("data/traces/azure-functions-sample.csv").display());
    opts.preset.custom.minute_ns = 50_000_000;
    let r = run("deepplan-azure", &opts);
    check_points(&r, min_isolated_ns(&r) / 2);
    let p = &r.points[0];
    // 4 bert_base, 4 roberta_base, 1 gpt2 under a budget of a third of their weights: loads beyond
    // the first 9, evictions, cold requests measured; the 8 functions of the sample drive all 9.
    assert_eq!(p.metrics.models.len(), 9, "{:?}", p.metrics.models.iter().map(|m| &m.name).collect::<Vec<_>>());
    assert!(p.model_loads > 9 && p.model_unloads > 0, "{} loads, {} unloads", p.model_loads, p.model_unloads);
    assert!(p.metrics.overall.cold > 0, "no measured request was a cold start");
    let mut bad = opts.clone();
    bad.preset.custom.arrival = "poisson".into();
    let err = run_preset(&mut sim(seed()), &Preset::by_name("deepplan-azure").unwrap(), catalog(), &bad, &mut Quiet).unwrap_err();
    assert!(err.to_string().contains("azure:FILE"), "{err}");
}

#[test]
fn custom_replays_the_azure_sample() {
    let mut opts = small(&["streams"], &[1.0], Length::DurationNs(2_000_000_000));
    opts.preset.custom.models = vec!["resnet18".into(), "mobilenet_v2".into()];
    opts.preset.custom.arrival = format!("azure:{}", repo().join("data/traces/azure-functions-sample.csv").display());
    opts.preset.custom.rate_per_s = 200.0;
    opts.preset.custom.minute_ns = 100_000_000;
    let r = run("custom", &opts);
    check_points(&r, 100_000);
    let p = &r.points[0];
    // 200/s on average over whole replayed minutes.
    assert!((p.metrics.offered_per_s / 200.0 - 1.0).abs() < 0.2, "{}", p.metrics.offered_per_s);
    assert_eq!(p.metrics.models.len(), 2);
}

#[test]
fn same_seed_same_results_and_peers_merge() {
    let dir = std::env::temp_dir().join(format!("kairos-bench-test-{}", std::process::id()));
    let mut opts = small(&["streams", "paella"], &[0.5], Length::DurationNs(200_000_000));
    opts.trace_dir = Some(dir.join("traces"));
    let a = run("disb-e", &opts);
    let b = run("disb-e", &opts);
    let strip = |r: &PresetResults| -> Vec<Point> {
        r.points.iter().map(|p| Point { wall_s: 0.0, started_unix_ms: None, ..p.clone() }).collect()
    };
    assert_eq!(strip(&a), strip(&b), "the same seed must give the same results");

    // One trace per load, shared by the policies; a fake peer replays it: every request done 5 ms
    // after its arrival, 3 ms of it on the GPU.
    let trace_name = a.points[0].trace.clone().unwrap();
    assert!(a.points.iter().all(|p| p.trace.as_deref() == Some(trace_name.as_str())));
    let t = TraceFile::read(&dir.join("traces").join(&trace_name)).unwrap();
    let s = t.schedule().unwrap();
    let n = s.arrivals.len();
    assert!(n > 0);
    let run = PeerRun {
        trace: trace_name.clone(),
        mode: "single".into(),
        stream: s.arrivals.iter().map(|x| x.1).collect(),
        arrival_ns: s.arrivals.iter().map(|x| x.0).collect(),
        done_ns: s.arrivals.iter().map(|x| Some(x.0 + 5_000_000)).collect(),
        gpu_ns: vec![3_000_000; n],
        closed: vec![false; n],
        wall_s: 1.0,
        started_unix_ms: None,
    };
    // The replay of another trace of the same name (another run's arguments): other arrivals.
    let mut other = PeerRun { mode: "other".into(), ..run.clone() };
    other.arrival_ns[n / 2] += 1;
    let peers = PeerFile {
        format: PEER_FORMAT.into(),
        system: "pytorch".into(),
        version: "test".into(),
        device: "none".into(),
        runs: vec![run, other],
    };
    let mut results = Results::new("test", "simulated", seed());
    results.presets.push(a);
    assert_eq!(results.merge_peers(&peers, &dir.join("traces"), None).unwrap(), 1);
    assert!(!results.presets[0].points.iter().any(|p| p.policy == "pytorch-other"));
    let p = results.presets[0].points.iter().find(|p| p.system == "pytorch").unwrap();
    assert_eq!(p.policy, "pytorch-single");
    let rt = p.metrics.group("rt").unwrap();
    assert!(rt.latency.p50_ns.abs_diff(5_000_000) < 10_000 && rt.gpu.p50_ns.abs_diff(3_000_000) < 10_000, "{rt:?}");
    let md = results.markdown(true);
    assert!(md.contains("### disb-e") && md.contains("| pytorch | single |") && md.contains("rt p99 ms"), "{md}");
    let files = results.plot(&dir.join("plots")).unwrap();
    assert!(files.iter().any(|f| f.extension().is_some_and(|e| e == "png") && std::fs::metadata(f).unwrap().len() > 2000));
    results.write(&dir.join("results.json")).unwrap();
    // (serde_json's default float parsing may differ in the last bit: compare what the tables show.)
    let back = Results::read(&dir.join("results.json")).unwrap();
    assert_eq!(back.markdown(true), md);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn the_threaded_engine_serves_a_custom_workload() {
    // The engine on its own thread with a simulator behind it: a functional check of the path
    // (the simulator's virtual clock runs as fast as the dispatcher thread spins).
    let cat = catalog().clone();
    let factory = move || {
        let mut g = SimGpu::new(GpuDesc::h200(), SimOptions::timing_only(seed()));
        register_on_sim(&mut g, &cat).map_err(|e| kairos_gpu::GpuError::Invalid(e.to_string()))?;
        Ok(g)
    };
    let mut target = EngineTarget::new(factory, EngineConfig::default(), true);
    let mut opts = small(&["paella"], &[1.0], Length::DurationNs(300_000_000));
    opts.preset.custom.models = vec!["squeezenet1_1".into()];
    opts.preset.custom.rate_per_s = 100.0;
    let r = run_preset(&mut target, &Preset::Custom, catalog(), &opts, &mut Quiet).unwrap();
    let o = &r.points[0].metrics.overall;
    assert!(o.requests > 10 && o.completed == o.requests, "{o:?}");
}

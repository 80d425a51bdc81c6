//! Paella's experiments on the simulated H100 (kairos-sim, timing only), with zoo models lowered
//! by kairos-ir. Kernel durations come from profiles under data/profiles/h100_sxm when present,
//! else from the simulator's roofline.
//!
//! ```text
//! cargo run --release -p kairos-bench --example paella_sim -- [hol|mix|short-long|fairness|all]
//!     [--requests N] [--seed S] [--dtype f16|f32] [--policies a,b,c] [--loads x,y,z] [--json FILE]
//! ```

use kairos_bench::paella::{self as experiments, ExperimentParams, RunSummary};
use kairos_gpu::profile::ProfileSet;
use kairos_gpu::synthetic;
use kairos_ir::DType;
use kairos_ir::lower::{LowerOptions, lower};
use kairos_ir::onnx::{LoadOptions, load_bytes};
use kairos_ir::zoo::{self, ZooOptions};
use kairos_sched::*;
use kairos_sim::{GpuDesc, SimGpu, SimOptions};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

struct Args {
    what: String,
    requests: usize,
    seed: u64,
    dtype: DType,
    policies: Option<Vec<String>>,
    loads: Option<Vec<f64>>,
    json: Option<String>,
}

fn args() -> Args {
    let mut a = Args { what: "all".into(), requests: 2000, seed: 1, dtype: DType::F16, policies: None, loads: None, json: None };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{x} needs a value"));
        match x.as_str() {
            "--requests" => a.requests = val().parse().unwrap(),
            "--seed" => a.seed = val().parse().unwrap(),
            "--dtype" => a.dtype = DType::parse(&val()).expect("f16 or f32"),
            "--policies" => a.policies = Some(val().split(',').map(String::from).collect()),
            "--loads" => a.loads = Some(val().split(',').map(|v| v.parse().unwrap()).collect()),
            "--json" => a.json = Some(val()),
            w => a.what = w.to_string(),
        }
    }
    a
}

fn zoo_model(name: &str, dtype: DType) -> ModelSpec {
    let bytes = zoo::build(name, &ZooOptions::default()).unwrap();
    let graph = load_bytes(name, &bytes, &LoadOptions::default()).unwrap();
    let plan = lower(&graph, &LowerOptions::new(dtype)).unwrap();
    ModelSpec { name: name.into(), plan: Arc::new(plan), profile: None }
}

fn sim(seed: u64, models: &[ModelSpec], profiles: &ProfileSet) -> SimGpu {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions::timing_only(seed));
    let n = gpu.register_profiles(models.iter().map(|m| &*m.plan), profiles).unwrap();
    if n > 0 {
        eprintln!("{n} of {} models use measured profiles", models.len());
    }
    gpu
}

fn with_profiles(models: Vec<ModelSpec>, profiles: &ProfileSet, dtype: DType) -> Vec<ModelSpec> {
    models
        .into_iter()
        .map(|mut m| {
            m.profile = profiles.find(&m.name, dtype, 1).cloned();
            m
        })
        .collect()
}

fn params(a: &Args, default_policies: &[&str], default_loads: &[f64]) -> ExperimentParams {
    let names: Vec<String> = a.policies.clone().unwrap_or_else(|| default_policies.iter().map(|s| s.to_string()).collect());
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let loads = a.loads.clone().unwrap_or_else(|| default_loads.to_vec());
    ExperimentParams::new(&refs, &loads, a.requests, a.seed)
}

fn progress(p: &RunSummary) {
    eprintln!(
        "  {:<40} offered {:>8.0}/s  done {:>8.0}/s  p50 {:>8.3} ms  p99 {:>8.3} ms",
        p.policy,
        p.offered_per_s,
        p.throughput_per_s,
        p.latency.p50_ns as f64 / 1e6,
        p.latency.p99_ns as f64 / 1e6
    );
}

fn main() {
    let a = args();
    let profiles = ProfileSet::load_dir(Path::new("data/profiles/h100_sxm")).unwrap_or_default();
    let mut all: Vec<(String, Vec<RunSummary>)> = Vec::new();
    let t0 = Instant::now();
    let run = |w: &str| a.what == "all" || a.what == w;

    if run("hol") {
        println!("\n## (a) Head-of-line blocking: jobs of 8 one-CTA kernels of 300 us, Poisson arrivals\n");
        let p = params(&a, &["streams", "paella"], &[0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]);
        let plan = synthetic::chain_plan("hol", 8, 1024);
        let profile = synthetic::chain_profile(&plan, 300_000, "H100 SXM (simulated)", 132);
        let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions::timing_only(a.seed));
        gpu.register_plan(&plan, &profile).unwrap();
        let (_, points) = experiments::head_of_line(gpu, &p, 8, 1024, 300_000, Some(profile), progress).unwrap();
        println!("{}", experiments::markdown_table(&points, &[]));
        all.push(("hol".into(), points));
    }

    if run("mix") {
        let names: Vec<&str> = kairos_ir::zoo::ZOO
            .iter()
            .filter(|e| matches!(e.kind, kairos_ir::zoo::ZooKind::Vision { .. }))
            .map(|e| e.name)
            .collect();
        let t = Instant::now();
        let models = with_profiles(names.iter().map(|n| zoo_model(n, a.dtype)).collect(), &profiles, a.dtype);
        eprintln!("lowered {} models in {:.1} s", models.len(), t.elapsed().as_secs_f64());
        for sigma in [1.5, 2.0] {
            println!(
                "\n## (b) Uniform mix of {} vision models ({}), lognormal inter-arrivals sigma {sigma}\n",
                models.len(),
                a.dtype
            );
            let p = params(
                &a,
                &["fifo", "streams", "streams-kernel", "paella", "sjf", "rr"],
                &[0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0],
            );
            let gpu = sim(a.seed, &models, &profiles);
            let (_, points, iso) = experiments::mix(gpu, &p, &models, sigma, progress).unwrap();
            println!(
                "isolated latency (ms): {}",
                names.iter().zip(&iso).map(|(n, l)| format!("{n} {:.3}", *l as f64 / 1e6)).collect::<Vec<_>>().join(", ")
            );
            println!("{}", experiments::markdown_table(&points, &[]));
            if std::env::var_os("PER_MODEL").is_some() {
                println!("{}", experiments::markdown_table(&points, &names));
            }
            for target_ms in [5.0, 10.0, 20.0, 50.0] {
                let t = (target_ms * 1e6) as u64;
                let s = experiments::throughput_at_p99(&points, "streams", t, None);
                let q = experiments::throughput_at_p99(&points, "paella", t, None);
                println!(
                    "p99 <= {target_ms:>4} ms: streams {} /s, paella {} /s{}",
                    s.map_or("-".into(), |v| format!("{v:.0}")),
                    q.map_or("-".into(), |v| format!("{v:.0}")),
                    match (s, q) {
                        (Some(s), Some(q)) => format!(" ({:.2}x)", q / s),
                        _ => String::new(),
                    }
                );
            }
            for target in [2.0, 3.0, 5.0, 10.0] {
                let s = experiments::throughput_at_slowdown_p99(&points, "streams", target);
                let q = experiments::throughput_at_slowdown_p99(&points, "paella", target);
                println!(
                    "p99 slowdown <= {target:>4}: streams {} /s, paella {} /s{}",
                    s.map_or("-".into(), |v| format!("{v:.0}")),
                    q.map_or("-".into(), |v| format!("{v:.0}")),
                    match (s, q) {
                        (Some(s), Some(q)) => format!(" ({:.2}x)", q / s),
                        _ => String::new(),
                    }
                );
            }
            all.push((format!("mix-sigma{sigma}"), points));
        }
    }

    if run("short-long") || run("fairness") {
        let models = with_profiles(vec![zoo_model("resnet18", a.dtype), zoo_model("inception_v3", a.dtype)], &profiles, a.dtype);
        if run("short-long") {
            println!("\n## (c) Short vs long: resnet18 vs inception_v3 ({}), shares inverse to size, Poisson\n", a.dtype);
            let p =
                params(&a, &["fifo", "streams", "streams-kernel", "paella", "sjf", "rr"], &[0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
            let gpu = sim(a.seed, &models, &profiles);
            let (_, points) = experiments::short_long(gpu, &p, &models[0], &models[1], progress).unwrap();
            println!("{}", experiments::markdown_table(&points, &["resnet18", "inception_v3"]));
            all.push(("short-long".into(), points));
        }
        if run("fairness") {
            println!("\n## (d) Fairness threshold swept: resnet18 (tenant 0) vs inception_v3 (tenant 1), paella\n");
            let p = params(&a, &["paella"], &[]);
            let load = a.loads.as_ref().and_then(|l| l.first().copied()).unwrap_or(1.5);
            let gpu = sim(a.seed, &models, &profiles);
            let thresholds = [0, 100_000, 1_000_000, 10_000_000, 100_000_000, u64::MAX];
            let (_, points) = experiments::fairness_sweep(gpu, &p, &models[0], &models[1], load, &thresholds, progress).unwrap();
            println!("load {load} x serial capacity\n");
            println!("{}", experiments::markdown_table(&points, &["resnet18", "inception_v3"]));
            all.push(("fairness".into(), points));
        }
    }

    eprintln!("done in {:.1} s", t0.elapsed().as_secs_f64());
    if let Some(path) = &a.json {
        let map: std::collections::BTreeMap<_, _> = all.into_iter().collect();
        std::fs::write(path, serde_json::to_string_pretty(&map).unwrap()).unwrap();
    }
}

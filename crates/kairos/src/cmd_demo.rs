//! `kairos demo`: the embedded default. A mixed workload of vision models served through the
//! dispatcher on a simulated GPU, every policy side by side, as a table and a plot.

use crate::cmd_run::sim_desc;
use anyhow::{Context, Result};
use clap::Args;
use kairos_bench::paella::{self as experiments, ExperimentParams, RunSummary};
use kairos_bench::plot::{Chart, Series, draw};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::DType;
use kairos_ir::model::ModelSpec as IrModelSpec;
use kairos_sim::{SimGpu, SimOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Simulated GPU: h100-sxm, h100-pcie, h200, or a description file (.json, as data/gpus/).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub gpu: String,
    /// Requests per run (one run per policy and load).
    #[arg(long, default_value_t = 600)]
    pub requests: usize,
    /// Offered loads as multiples of the serial capacity (one request at a time).
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,1.5,2,3")]
    pub loads: Vec<f64>,
    /// Policies to compare.
    #[arg(long, value_delimiter = ',', default_value = "fifo,streams,streams-kernel,paella,sjf,rr")]
    pub policies: Vec<String>,
    /// Sigma of the lognormal inter-arrival times (Paella used 1.5 and 2).
    #[arg(long, default_value_t = 1.5)]
    pub sigma: f64,
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Folder of measured kernel profiles (`kairos profile` JSON); default: the simulated GPU's folder
    /// under data/profiles/. Models without a profile use the simulator's roofline.
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Where to write the plot and the JSON results.
    #[arg(long, default_value = "out")]
    pub out: PathBuf,
}

const MODELS: [&str; 7] = ["resnet18", "resnet50", "mobilenet_v2", "squeezenet1_1", "googlenet", "densenet121", "inception_v3"];

pub fn run(args: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let desc = sim_desc(&args.gpu)?;
    eprintln!(
        "kairos demo: a mix of {} vision models (fp16, batch 1) on a simulated {} through the dispatcher",
        MODELS.len(),
        args.gpu
    );
    eprintln!("  seed {} (reproduce with --seed {}); lognormal arrivals, sigma {}", args.seed, args.seed, args.sigma);
    let profile_dir = args.profiles.clone().unwrap_or_else(|| crate::paths::profile_dir(&desc.key));
    let profiles = ProfileSet::load_dir(&profile_dir).map_err(anyhow::Error::msg)?;
    let mut models = Vec::new();
    for name in MODELS {
        let mut spec = IrModelSpec::new(name);
        spec.dtype = DType::F16;
        let plan = spec.plan()?;
        let profile = profiles.find(name, DType::F16, 1).cloned();
        models.push(kairos_sched::ModelSpec { name: name.into(), plan: Arc::new(plan), profile });
    }
    let measured = models.iter().filter(|m| m.profile.is_some()).count();
    eprintln!(
        "  lowered {} models in {:.1} s; kernel times: {} measured profiles ({}), {} roofline estimates",
        models.len(),
        t0.elapsed().as_secs_f64(),
        measured,
        profile_dir.display(),
        models.len() - measured
    );
    let mut gpu = SimGpu::new(desc.clone(), SimOptions::timing_only(args.seed));
    gpu.register_profiles(models.iter().map(|m| &*m.plan), &profiles).map_err(anyhow::Error::msg)?;
    let policies: Vec<&str> = args.policies.iter().map(String::as_str).collect();
    let params = ExperimentParams::new(&policies, &args.loads, args.requests, args.seed);
    let mut done = 0;
    let total = policies.len() * args.loads.len();
    let (_, points, isolated) = experiments::mix(gpu, &params, &models, args.sigma, |p: &RunSummary| {
        done += 1;
        eprintln!(
            "  [{done:>2}/{total}] {:<16} offered {:>7.0}/s  served {:>7.0}/s  p50 {:>7.3} ms  p99 {:>7.3} ms",
            p.policy,
            p.offered_per_s,
            p.throughput_per_s,
            p.latency.p50_ns as f64 / 1e6,
            p.latency.p99_ns as f64 / 1e6
        );
    })?;
    println!("\nIsolated latency (one request alone on the simulated GPU):");
    for (m, iso) in models.iter().zip(&isolated) {
        println!("  {:<14} {:>8.3} ms", m.name, *iso as f64 / 1e6);
    }
    println!("\n| policy | offered (req/s) | throughput (req/s) | p50 (ms) | p99 (ms) | p99 slowdown |");
    println!("|---|---:|---:|---:|---:|---:|");
    for p in &points {
        println!(
            "| {} | {:.0} | {:.0} | {:.3} | {:.3} | {} |",
            p.policy,
            p.offered_per_s,
            p.throughput_per_s,
            p.latency.p50_ns as f64 / 1e6,
            p.latency.p99_ns as f64 / 1e6,
            p.slowdown.map(|s| format!("{:.1}", s.p99)).unwrap_or_default()
        );
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut series: Vec<Series> = Vec::new();
    for pol in &policies {
        let mut pts: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.policy.starts_with(pol) && policy_name(&p.policy) == *pol)
            .map(|p| (p.throughput_per_s, p.latency.p99_ns as f64 / 1e6))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        series.push(Series { label: pol.to_string(), points: pts });
    }
    let chart = Chart {
        title: format!(
            "kairos demo: {} vision models on a simulated {} (lognormal sigma {})",
            MODELS.len(),
            args.gpu,
            args.sigma
        ),
        x_label: "throughput (requests/s)".into(),
        y_label: "p99 latency (ms)".into(),
        series,
        log_y: true,
    };
    let png = args.out.join("demo_p99.png");
    draw(&chart, &png).map_err(anyhow::Error::msg)?;
    let json = args.out.join("demo.json");
    std::fs::write(&json, serde_json::to_string_pretty(&points)?)?;
    println!(
        "\nThis is the simulator: against an H100 (2026-11-27) it agreed on throughput, but its p50 and p99 under\n\
         load were 16-95% low (docs/benchmarks.md, \"The simulator\"). Speed claims need the GPU:\n\
         scripts/dispatch-bench.sh measures kairos and a CUDA-graph PyTorch server on the same traces."
    );
    println!("\nwrote {} and {} ({:.1} s in all)", png.display(), json.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

/// The policy's name without its parameters ("paella(B=132, ...)" -> "paella").
fn policy_name(label: &str) -> &str {
    label.split(['(', ' ', '[']).next().unwrap_or(label)
}

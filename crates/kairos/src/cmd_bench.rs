//! `kairos bench paella`: Paella's experiments on the simulator or the real GPU, every policy
//! in the same run, as markdown tables, JSON and plots.

use crate::cmd_run::{Backend, sim_desc};
use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use kairos_bench::plot::{Chart, Series, draw};
use kairos_gpu::Gpu;
use kairos_gpu::profile::ProfileSet;
use kairos_ir::DType;
use kairos_ir::model::ModelSpec as IrModelSpec;
use kairos_sched::experiments::{self, ExperimentParams, RunSummary};
use kairos_sched::{ModelSpec, synthetic};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Paella's experiments: (a) head-of-line blocking, (b) vision mix, (c) short vs long, (d) fairness.
    Paella(PaellaArgs),
}

#[derive(Args, Debug)]
pub struct PaellaArgs {
    /// hol, mix, short-long, fairness, or all.
    #[arg(default_value = "all")]
    pub experiment: String,
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "sim")]
    pub backend: Backend,
    /// The simulated GPU (sim backend).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    #[arg(long, value_delimiter = ',')]
    pub policies: Option<Vec<String>>,
    /// Offered loads as multiples of each experiment's reference capacity.
    #[arg(long, value_delimiter = ',')]
    pub loads: Option<Vec<f64>>,
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    #[arg(long, default_value = "f16", value_parser = crate::model_args::parse_dtype)]
    pub dtype: DType,
    /// Measured profiles (kernel durations for the dispatcher's estimates and the simulator);
    /// on the sim backend the simulated GPU's folder under data/profiles/ by default.
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Folder for JSON results and plots.
    #[arg(long, default_value = "out/bench")]
    pub out: PathBuf,
}

const VISION: [&str; 11] = [
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet152",
    "mobilenet_v2",
    "squeezenet1_1",
    "vgg19",
    "densenet121",
    "densenet201",
    "googlenet",
    "inception_v3",
];

fn progress(p: &RunSummary) {
    eprintln!(
        "  {:<40} offered {:>8.0}/s  served {:>8.0}/s  p50 {:>8.3} ms  p99 {:>8.3} ms",
        p.policy,
        p.offered_per_s,
        p.throughput_per_s,
        p.latency.p50_ns as f64 / 1e6,
        p.latency.p99_ns as f64 / 1e6
    );
}

fn model(name: &str, dtype: DType, profiles: &ProfileSet) -> Result<ModelSpec> {
    let mut spec = IrModelSpec::new(name);
    spec.dtype = dtype;
    let plan = spec.plan()?;
    Ok(ModelSpec { name: name.into(), plan: Arc::new(plan), profile: profiles.find(name, dtype, 1).cloned() })
}

fn policy_name(label: &str) -> &str {
    label.split(['(', ' ', '[']).next().unwrap_or(label)
}

fn plot_p99(points: &[RunSummary], title: &str, path: &Path) -> Result<()> {
    let mut by: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for p in points {
        by.entry(policy_name(&p.policy)).or_default().push((p.throughput_per_s, p.latency.p99_ns as f64 / 1e6));
    }
    let series = by
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { label: k.to_string(), points: v }
        })
        .collect();
    let chart = Chart {
        title: title.into(),
        x_label: "throughput (requests/s)".into(),
        y_label: "p99 latency (ms)".into(),
        series,
        log_y: true,
    };
    draw(&chart, path).map_err(anyhow::Error::msg)
}

fn ratio_line(points: &[RunSummary], label: &str, a: Option<f64>, b: Option<f64>) -> String {
    let _ = points;
    format!(
        "{label}: streams {} /s, paella {} /s{}",
        a.map_or("-".into(), |v| format!("{v:.0}")),
        b.map_or("-".into(), |v| format!("{v:.0}")),
        match (a, b) {
            (Some(s), Some(q)) if s > 0.0 => format!(" ({:.2}x)", q / s),
            _ => String::new(),
        }
    )
}

/// Runs the chosen experiments on `gpu`, returning the results by experiment.
fn paella_on<G: Gpu>(
    mut gpu: G,
    a: &PaellaArgs,
    profiles: &ProfileSet,
    on_sim: bool,
) -> Result<BTreeMap<String, Vec<RunSummary>>> {
    let run = |w: &str| a.experiment == "all" || a.experiment == w;
    let params = |default_policies: &[&str], default_loads: &[f64]| {
        let names: Vec<String> = a.policies.clone().unwrap_or_else(|| default_policies.iter().map(|s| s.to_string()).collect());
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        ExperimentParams::new(&refs, a.loads.as_deref().unwrap_or(default_loads), a.requests, a.seed)
    };
    let mut all = BTreeMap::new();
    if run("hol") {
        println!("\n## (a) Head-of-line blocking: jobs of 8 one-CTA kernels of ~300 us, Poisson arrivals\n");
        let p = params(&["streams", "paella"], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]);
        let (g, len, profile) = if on_sim {
            let plan = synthetic::chain_plan("hol", 8, 1024);
            let profile = synthetic::chain_profile(&plan, 300_000, "simulated", gpu.info().sm_count);
            (gpu, 1024, Some(profile))
        } else {
            let (g, len) = experiments::calibrate_chain(gpu, &p.config, 8, 300_000)?;
            eprintln!("  calibrated the chain kernel: reduce length {len} for ~300 us");
            (g, len, None)
        };
        let (g, points) = experiments::head_of_line(g, &p, 8, len, 300_000, profile, progress)?;
        gpu = g;
        println!("{}", experiments::markdown_table(&points, &[]));
        for target_ms in [2.0, 5.0, 10.0] {
            let t = (target_ms * 1e6) as u64;
            println!(
                "{}",
                ratio_line(
                    &points,
                    &format!("load at p99 <= {target_ms} ms"),
                    experiments::throughput_at_p99(&points, "streams", t, None),
                    experiments::throughput_at_p99(&points, "paella", t, None)
                )
            );
        }
        plot_p99(&points, "(a) head-of-line blocking: 8 x 300 us one-CTA kernels", &a.out.join("paella_hol.png"))?;
        all.insert("hol".to_string(), points);
    }
    if run("mix") {
        let t = Instant::now();
        let models: Vec<ModelSpec> = VISION.iter().map(|n| model(n, a.dtype, profiles)).collect::<Result<_>>()?;
        eprintln!("lowered {} vision models in {:.1} s", models.len(), t.elapsed().as_secs_f64());
        for sigma in [1.5, 2.0] {
            println!(
                "\n## (b) Uniform mix of {} vision models ({}), lognormal inter-arrivals, sigma {sigma}\n",
                models.len(),
                a.dtype
            );
            let p =
                params(&["fifo", "streams", "streams-kernel", "paella", "sjf", "rr"], &[0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
            let (g, points, iso) = experiments::mix(gpu, &p, &models, sigma, progress)?;
            gpu = g;
            println!(
                "isolated latency (ms): {}\n",
                VISION.iter().zip(&iso).map(|(n, l)| format!("{n} {:.3}", *l as f64 / 1e6)).collect::<Vec<_>>().join(", ")
            );
            println!("{}", experiments::markdown_table(&points, &[]));
            for target_ms in [5.0, 10.0, 20.0, 50.0] {
                let t = (target_ms * 1e6) as u64;
                println!(
                    "{}",
                    ratio_line(
                        &points,
                        &format!("load at p99 <= {target_ms} ms"),
                        experiments::throughput_at_p99(&points, "streams", t, None),
                        experiments::throughput_at_p99(&points, "paella", t, None)
                    )
                );
            }
            for target in [3.0, 5.0, 10.0] {
                println!(
                    "{}",
                    ratio_line(
                        &points,
                        &format!("load at p99 slowdown <= {target}"),
                        experiments::throughput_at_slowdown_p99(&points, "streams", target),
                        experiments::throughput_at_slowdown_p99(&points, "paella", target)
                    )
                );
            }
            plot_p99(
                &points,
                &format!("(b) vision mix, lognormal sigma {sigma}"),
                &a.out.join(format!("paella_mix_sigma{sigma}.png")),
            )?;
            all.insert(format!("mix-sigma{sigma}"), points);
        }
    }
    if run("short-long") || run("fairness") {
        let short = model("resnet18", a.dtype, profiles)?;
        let long = model("inception_v3", a.dtype, profiles)?;
        if run("short-long") {
            println!("\n## (c) Short vs long: resnet18 vs inception_v3 ({}), shares inverse to size, Poisson\n", a.dtype);
            let p =
                params(&["fifo", "streams", "streams-kernel", "paella", "sjf", "rr"], &[0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]);
            let (g, points) = experiments::short_long(gpu, &p, &short, &long, progress)?;
            gpu = g;
            println!("{}", experiments::markdown_table(&points, &["resnet18", "inception_v3"]));
            let by_load = |pol: &str| -> Vec<(f64, u64)> {
                points
                    .iter()
                    .filter(|p| policy_name(&p.policy) == pol)
                    .filter_map(|p| p.model("resnet18").map(|m| (p.offered_per_s, m.p99_ns)))
                    .collect()
            };
            for ((load, s), (_, q)) in by_load("streams").into_iter().zip(by_load("paella")) {
                println!(
                    "offered {load:.0}/s: resnet18 p99 streams {:.3} ms, paella {:.3} ms ({:.2}x lower)",
                    s as f64 / 1e6,
                    q as f64 / 1e6,
                    s as f64 / q.max(1) as f64
                );
            }
            plot_p99(&points, "(c) short (resnet18) vs long (inception_v3)", &a.out.join("paella_short_long.png"))?;
            all.insert("short-long".to_string(), points);
        }
        if run("fairness") {
            println!("\n## (d) Fairness threshold swept (paella): resnet18 tenant 0, inception_v3 tenant 1\n");
            let p = params(&["paella"], &[]);
            let load = a.loads.as_ref().and_then(|l| l.first().copied()).unwrap_or(2.0);
            let thresholds = [0, 100_000, 1_000_000, 10_000_000, 100_000_000, u64::MAX];
            let (g, points) = experiments::fairness_sweep(gpu, &p, &short, &long, load, &thresholds, progress)?;
            gpu = g;
            println!("load {load} x serial capacity\n\n{}", experiments::markdown_table(&points, &["resnet18", "inception_v3"]));
            all.insert("fairness".to_string(), points);
        }
    }
    drop(gpu);
    Ok(all)
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Paella(a) => {
            if !["all", "hol", "mix", "short-long", "fairness"].contains(&a.experiment.as_str()) {
                bail!("unknown experiment '{}': use hol, mix, short-long, fairness or all", a.experiment);
            }
            std::fs::create_dir_all(&a.out)?;
            let t0 = Instant::now();
            let profiles = match (&a.profiles, a.backend) {
                (Some(dir), _) => ProfileSet::load_dir(dir).map_err(anyhow::Error::msg)?,
                (None, Backend::Sim) => ProfileSet::load_dir(&sim_desc(&a.sim_gpu)?.profile_dir(std::path::Path::new(".")))
                    .map_err(anyhow::Error::msg)?,
                (None, _) => ProfileSet::default(),
            };
            eprintln!("{} measured profiles loaded; seed {}", profiles.models.len(), a.seed);
            let results = match a.backend {
                Backend::Cpu => bail!("the paella experiments need a GPU: use --backend sim or --backend cuda"),
                Backend::Sim => {
                    let mut gpu = kairos_sim::SimGpu::new(sim_desc(&a.sim_gpu)?, kairos_sim::SimOptions::timing_only(a.seed));
                    let mut plans = Vec::new();
                    for n in VISION {
                        plans.push(model(n, a.dtype, &profiles)?.plan);
                    }
                    gpu.register_profiles(plans.iter().map(|p| &**p), &profiles).map_err(anyhow::Error::msg)?;
                    // The head-of-line jobs' kernels last 300 us on the simulator by their profile.
                    let chain = synthetic::chain_plan("hol", 8, 1024);
                    let chain_profile = synthetic::chain_profile(&chain, 300_000, "simulated", gpu.info().sm_count);
                    gpu.register_plan(&chain, &chain_profile).map_err(anyhow::Error::msg)?;
                    paella_on(gpu, &a, &profiles, true)?
                }
                Backend::Cuda => paella_on(kairos_cuda::CudaGpu::new(0)?, &a, &profiles, false)?,
            };
            let path = a.out.join("paella.json");
            std::fs::write(&path, serde_json::to_string_pretty(&results)?)?;
            eprintln!("wrote {} and plots under {} ({:.1} s)", path.display(), a.out.display(), t0.elapsed().as_secs_f64());
            Ok(())
        }
    }
}

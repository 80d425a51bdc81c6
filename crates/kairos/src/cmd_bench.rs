//! `kairos bench`: the harness of kairos-bench on the command line.
//!
//! - `kairos bench run PRESET[,PRESET...]`: the papers' workloads (see `kairos bench list`) as
//!   offered-load sweeps, every policy side by side, on the simulator or the GPU; results JSON,
//!   markdown tables, PNG/SVG plots, and the arrival traces the PyTorch peers replay.
//! - `kairos bench report`: merges peer results (`scripts/peer_replay.py`) into a results file and
//!   redraws its tables and plots.
//! - `kairos bench serve`: the front ends' overhead and the client's CPU use (cmd_bench_serve).
//! - `kairos bench soak`: constant load with bad input mixed in on a child `kairos serve` (cmd_soak).
//! - `kairos bench paella`: Paella's four experiments as first written (kept for the fidelity runs).

use crate::cmd_run::{Backend, sim_desc};
use anyhow::{Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use kairos_bench::experiment::{self as bx, SweepOptions};
use kairos_bench::paella::{self as experiments, ExperimentParams, RunSummary};
use kairos_bench::plot::{Chart, Series, draw};
use kairos_bench::presets::{CustomSpec, Length, Preset, PresetOptions};
use kairos_bench::progress::Bar;
use kairos_bench::report::Results;
use kairos_bench::target::{EngineTarget, Target, VirtualTarget};
use kairos_bench::trace::PeerFile;
use kairos_bench::workload::StreamClass;
use kairos_gpu::Gpu;
use kairos_gpu::profile::ProfileSet;
use kairos_gpu::synthetic;
use kairos_ir::DType;
use kairos_ir::model::ModelSpec as IrModelSpec;
use kairos_sched::{EngineConfig, ModelSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Run workload presets (`kairos bench list`) as offered-load sweeps, every policy side by side.
    Run(Box<RunArgs>),
    /// List the presets: what each models, its loads and its default policies.
    List,
    /// Merge peer results into a results file and redraw its tables and plots.
    Report(ReportArgs),
    /// Paella's experiments: (a) head-of-line blocking, (b) vision mix, (c) short vs long, (d) fairness.
    Paella(PaellaArgs),
    /// Isolated latency per zoo model at batch 1 and 8, kairos beside PyTorch eager and CUDA graphs.
    Latency(Box<crate::cmd_latency::LatencyArgs>),
    /// One cold inference per model (weights in host memory): load-then-run, pipelined and
    /// DeepPlan's DHA plan, with the layer profile measured first (DeepPlan's Fig. 11, one GPU).
    Cold(Box<crate::cmd_cold::ColdArgs>),
    /// Serving overhead per front end (REST, gRPC, shared memory) and the client's CPU use per wait scheme.
    Serve(Box<crate::cmd_bench_serve::ServeBenchArgs>),
    /// A soak: `kairos serve` as a child process under constant REST and gRPC load with bad input
    /// mixed in; every answer checked, the server's memory sampled (fails on a lost or wrong
    /// answer, a 5xx or hang for bad input, a dead server, or memory growth past the limit).
    Soak(Box<crate::cmd_soak::SoakArgs>),
    /// Where a request's time goes, kernel by kernel (launch call, hardware queue, execution, the
    /// record's way back, the GPU's gaps between a request's kernels): models alone and in a mix.
    Breakdown(Box<BreakdownArgs>),
}

#[derive(Args, Debug)]
pub struct BreakdownArgs {
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "sim")]
    pub backend: Backend,
    /// The simulated GPU (sim backend).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
    /// Models timed alone, and followed inside the mix.
    #[arg(long, value_delimiter = ',', default_value = "resnet50,bert_base")]
    pub models: Vec<String>,
    /// The mix's other models (default: mix8's).
    #[arg(long, value_delimiter = ',')]
    pub mix_models: Option<Vec<String>>,
    #[arg(long, value_delimiter = ',', default_value = "fifo,streams,paella")]
    pub policies: Vec<String>,
    /// Requests of each model alone.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Requests of the mix.
    #[arg(long, default_value_t = 2000)]
    pub mix_requests: usize,
    /// Offered rate of the mix, requests/s (0: no mix run).
    #[arg(long, default_value_t = 400.0)]
    pub mix_rate: f64,
    /// Lognormal sigma of the mix's inter-arrival times.
    #[arg(long, default_value_t = 2.0)]
    pub sigma: f64,
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    #[arg(long, env = "KAIROS_DTYPE", default_value = "f16", value_parser = crate::model_args::parse_dtype)]
    pub dtype: DType,
    /// Measured profiles (the dispatcher's first estimates; the simulator's kernel times).
    #[arg(long, env = "KAIROS_PROFILES")]
    pub profiles: Option<PathBuf>,
    /// Keep the lowering's tiles (cuda backend).
    #[arg(long, env = "KAIROS_NO_AUTOTUNE")]
    pub no_autotune: bool,
    /// Folder for breakdown.json (every launch's and request's timeline) and breakdown.md.
    #[arg(long, default_value = "out/breakdown")]
    pub out: PathBuf,
}

fn run_breakdown(a: BreakdownArgs) -> Result<()> {
    use kairos_bench::breakdown::{self, BreakdownFile, Scenario};
    let t0 = Instant::now();
    let policies = bx::parse_policies(&a.policies)?;
    let mix: Vec<String> =
        a.mix_models.clone().unwrap_or_else(|| kairos_bench::presets::MIX8.iter().map(|s| s.to_string()).collect());
    let mut archs = a.models.clone();
    if a.mix_rate > 0.0 {
        for m in &mix {
            if !archs.contains(m) {
                archs.push(m.clone());
            }
        }
    }
    let profile_dir = match (&a.profiles, a.backend) {
        (Some(d), _) => d.clone(),
        (None, Backend::Sim) => crate::paths::profile_dir(&sim_desc(&a.sim_gpu)?.key),
        (None, _) => crate::paths::cuda_profile_dir(a.device),
    };
    let profiles = ProfileSet::load_dir(&profile_dir).map_err(anyhow::Error::msg)?;
    let mut catalog = bx::lower_models(&archs, a.dtype, &profiles, |m, s| eprintln!("  lowered {m} in {s:.1} s"))?;
    if a.backend == Backend::Cuda && !a.no_autotune {
        autotune_catalog(&mut catalog, a.device)?;
    }
    let mut scenarios: Vec<Scenario> = a.models.iter().map(|m| Scenario::alone(m, a.requests)).collect();
    if a.mix_rate > 0.0 {
        scenarios.push(Scenario::mix(
            &format!("mix of {} at {:.0}/s, sigma {}", archs.len(), a.mix_rate, a.sigma),
            &archs,
            a.mix_requests,
            a.mix_rate,
            a.sigma,
            a.seed,
        )?);
    }
    let base = kairos_sched::Config::default();
    let mut runs = Vec::new();
    let mut probe = String::new();
    let mut each =
        |gpu_runs: &mut dyn FnMut(&kairos_sched::PolicyConfig, &Scenario) -> Result<breakdown::BreakdownRun>| -> Result<()> {
            for p in &policies {
                for sc in &scenarios {
                    let r = gpu_runs(p, sc)?;
                    for m in &r.summaries {
                        eprintln!(
                            "  {:<34} {:<28} {:<14} p50 {:>8.1} us  gap p50 {:>6.1} us  record p50 {:>5.1} us",
                            sc.name,
                            p.to_string(),
                            m.model,
                            m.latency_p50_us,
                            m.gap_p50_us,
                            m.record_p50_us
                        );
                    }
                    runs.push(r);
                }
            }
            Ok(())
        };
    let device = match a.backend {
        Backend::Cpu => bail!("the breakdown needs a GPU: use --backend sim or --backend cuda"),
        Backend::Sim => {
            let mut gpu = Some(kairos_sim::SimGpu::new(sim_desc(&a.sim_gpu)?, kairos_sim::SimOptions::timing_only(a.seed)));
            bx::register_on_sim(gpu.as_mut().unwrap(), &catalog)?;
            let name = gpu.as_ref().unwrap().info().name.clone();
            each(&mut |p, sc| {
                let (r, g) = breakdown::run(gpu.take().expect("the GPU comes back"), &base, p, &catalog, sc, 3, &a.models)?;
                gpu = Some(g);
                Ok(r)
            })?;
            format!("simulated {name}")
        }
        Backend::Cuda => {
            let mut g = kairos_cuda::CudaGpu::new(a.device)?;
            probe = launch_cost_probe(&mut g, &catalog, &a.models)?;
            eprintln!("{probe}");
            let mut gpu = Some(g);
            let name = gpu.as_ref().unwrap().info().name.clone();
            each(&mut |p, sc| {
                let (r, g) = breakdown::run(gpu.take().expect("the GPU comes back"), &base, p, &catalog, sc, 5, &a.models)?;
                gpu = Some(g);
                Ok(r)
            })?;
            name
        }
    };
    let file = BreakdownFile { format: breakdown::BREAKDOWN_FORMAT.into(), device, seed: a.seed, runs };
    std::fs::create_dir_all(&a.out)?;
    std::fs::write(a.out.join("breakdown.json"), serde_json::to_string(&file)?)?;
    let md = breakdown::markdown(&file) + &probe;
    std::fs::write(a.out.join("breakdown.md"), &md)?;
    println!("{md}");
    eprintln!("wrote {} and breakdown.md in {:.1} s", a.out.join("breakdown.json").display(), t0.elapsed().as_secs_f64());
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineMode {
    /// The dispatcher driven on the generator's thread in the GPU's clock (virtual on the simulator).
    Virtual,
    /// The threaded engine behind its bounded queue, as an application embeds it (wall clock).
    Threaded,
    /// A kairos server over REST with binary tensors (in-process per run, or --server-http).
    Rest,
    /// A kairos server over gRPC (in-process per run, or --server-grpc).
    Grpc,
    /// A kairos server over the shared-memory channel, hybrid wait (in-process per run, or --server-shm).
    Shm,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Presets, comma-separated: paella-mix, paella-short-long, paella-hol, disb-a..disb-e, daris,
    /// coldstart, deepplan-azure, custom (`kairos bench list`). PRESET:L1:L2 gives that preset its own loads.
    #[arg(value_delimiter = ',', required = true)]
    pub presets: Vec<String>,
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "sim")]
    pub backend: Backend,
    /// How the generator reaches kairos.
    #[arg(long, value_enum, env = "KAIROS_BENCH_ENGINE", default_value = "virtual")]
    pub engine: EngineMode,
    /// The simulated GPU (sim backend): h100-sxm, h100-pcie, h200, or a description file (.json, as data/gpus/).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    /// Sim backend: time every launch whose shape an autotune table (a GPU's `autotune-*.json`
    /// cache file, e.g. data/autotune/h200.json) tuned as the tuned tiles ran there (its profiled
    /// time times tuned over plan time), as a GPU that autotunes at load does; the dispatcher's
    /// estimates stay the profiles'.
    #[arg(long)]
    pub sim_autotune: Option<PathBuf>,
    /// Remote engines: client threads (one request in flight each).
    #[arg(long, env = "KAIROS_BENCH_CLIENTS", default_value_t = 64)]
    pub clients: usize,
    /// Remote engines: a running server's REST address (http://host:port) instead of an in-process one.
    #[arg(long, env = "KAIROS_BENCH_SERVER_HTTP")]
    pub server_http: Option<String>,
    /// Remote engines: a running server's gRPC address (http://host:port).
    #[arg(long, env = "KAIROS_BENCH_SERVER_GRPC")]
    pub server_grpc: Option<String>,
    /// Remote engines: a running server's shared-memory socket.
    #[arg(long, env = "KAIROS_BENCH_SERVER_SHM")]
    pub server_shm: Option<PathBuf>,
    /// CUDA device ordinal (cuda backend).
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
    /// Policies (default: each preset's own list).
    #[arg(long, env = "KAIROS_BENCH_POLICIES", value_delimiter = ',')]
    pub policies: Option<Vec<String>>,
    /// Offered loads (default: each preset's own; `kairos bench list` says what a load means).
    #[arg(long, env = "KAIROS_BENCH_LOADS", value_delimiter = ',')]
    pub loads: Option<Vec<f64>>,
    /// Length of each point as a number of open-loop requests.
    #[arg(long, env = "KAIROS_BENCH_REQUESTS", conflicts_with = "duration_ms")]
    pub requests: Option<usize>,
    /// Length of each point in milliseconds (of the target's clock).
    #[arg(long, env = "KAIROS_BENCH_DURATION_MS")]
    pub duration_ms: Option<f64>,
    /// Fraction of each run left out of the statistics at its start.
    #[arg(long, env = "KAIROS_BENCH_WARMUP", default_value_t = 0.1)]
    pub warmup_frac: f64,
    /// Time outstanding requests get after the last arrival (default: half the run, 50 ms to 5 s).
    #[arg(long, env = "KAIROS_BENCH_DRAIN_MS")]
    pub drain_ms: Option<f64>,
    /// A policy's sweep stops after the first load at which it serves less than this fraction.
    #[arg(long, env = "KAIROS_BENCH_SATURATION", default_value_t = 0.9)]
    pub saturation: f64,
    /// Latency SLO for goodput of requests without a deadline (ms).
    #[arg(long, env = "KAIROS_BENCH_SLO_MS")]
    pub slo_ms: Option<f64>,
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    #[arg(long, env = "KAIROS_DTYPE", default_value = "f16", value_parser = crate::model_args::parse_dtype)]
    pub dtype: DType,
    /// Measured profiles (the dispatcher's estimates, the simulator's kernel times); default: the
    /// simulated GPU's folder under data/profiles/ (sim), the device's (cuda: h100_sxm, h100_pcie or h200), found
    /// beside the installation (see `KAIROS_DATA_DIR`).
    #[arg(long, env = "KAIROS_PROFILES")]
    pub profiles: Option<PathBuf>,
    /// Folder for results.json, results.md, plots/ and traces/.
    #[arg(long, env = "KAIROS_BENCH_OUT", default_value = "out/bench")]
    pub out: PathBuf,
    /// Write each point's arrival trace under OUT/traces for the peers (scripts/peer_replay.py).
    #[arg(long, env = "KAIROS_BENCH_TRACES")]
    pub traces: bool,
    /// Peer results to merge (JSON of scripts/peer_replay.py; traces are read from OUT/traces).
    #[arg(long)]
    pub peers: Vec<PathBuf>,
    /// Also print the per-model table.
    #[arg(long)]
    pub per_model: bool,
    /// paella-mix: lognormal sigmas (one variant each).
    #[arg(long, value_delimiter = ',', default_value = "1.5,2")]
    pub sigma: Vec<f64>,
    /// paella-mix, mix8: each model's requests from a tenant of its own (fairness acts between models).
    #[arg(long)]
    pub tenant_per_model: bool,
    /// disb-*: run each point without its best-effort clients instead (variant `rt-only`: REEF's
    /// RT-Only reference, the real-time latency the GPU gives alone).
    #[arg(long)]
    pub rt_only: bool,
    /// disb-*: each real-time client's rate in req/s at load 1, in place of DISB's (A, C: 100; D,
    /// E: 20); B's real-time client becomes uniform at this rate instead of a closed loop (REEF's
    /// Table 2: 220).
    #[arg(long, value_name = "REQ_PER_S")]
    pub rt_rate: Option<f64>,
    /// reef-pairs: the (real-time + best-effort) model pairs, comma-separated, `*` for each of
    /// DISB's five models (`vgg19+*`); default all 25. With --rt-only, each real-time model alone.
    #[arg(long, value_name = "RT+BE,...")]
    pub pairs: Option<String>,
    /// disb-*: autotune the best-effort clients' models under this block-time budget (µs): each
    /// logical block of theirs takes at most about this long where a tile allows it, so
    /// preempting them waits less (REEF's preemption floor; `--backend cuda`). Implies
    /// --be-copies: models that real-time clients request too keep their fastest tiles, and
    /// best-effort clients use a retuned copy of them.
    #[arg(long)]
    pub be_block_budget_us: Option<u64>,
    /// disb-*: best-effort clients request a copy of each model that real-time clients request
    /// too (`ARCH~be`: its own weights, I/O slots and plan; variant `be-copies`), so the classes
    /// never share a model.
    #[arg(long)]
    pub be_copies: bool,
    /// coldstart: instances of each model; deepplan-azure: k gives 4k bert_base, 4k roberta_base, k gpt2.
    #[arg(long, default_value_t = 3)]
    pub instances: u32,
    /// coldstart, deepplan-azure: the dispatcher's weight budget in MiB (default: a third of all instances' weights).
    #[arg(long)]
    pub budget_mb: Option<f64>,
    /// custom: models, comma-separated; ARCH@bN serves ARCH at batch N (resnet50@b8).
    #[arg(long, value_delimiter = ',', default_value = "resnet50")]
    pub models: Vec<String>,
    /// custom: poisson, lognormal:SIGMA, periodic, closed:CLIENTS (CLIENTS x load closed-loop
    /// clients over all models), closed-each:CLIENTS (CLIENTS x load per model) or azure:FILE.csv (Azure Functions invocation trace:
    /// HashOwner,HashApp,HashFunction,Trigger,1..1440); deepplan-azure: azure:FILE.csv (default: the
    /// synthetic sample data/traces/azure-functions-sample.csv).
    #[arg(long, default_value = "poisson")]
    pub arrival: String,
    /// custom: requests per second at load 1.
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// custom: rt or be.
    #[arg(long, default_value = "be")]
    pub class: String,
    /// custom: relative deadline of every request (ms).
    #[arg(long)]
    pub deadline_ms: Option<f64>,
    /// custom azure: functions replayed (busiest first), dealt to the models round robin
    /// (deepplan-azure: function j drives the instances i with i mod F = j).
    #[arg(long, default_value_t = 16)]
    pub functions: usize,
    /// custom azure: trace minutes replayed (default: all), each lasting --minute-ms.
    #[arg(long)]
    pub minutes: Option<usize>,
    #[arg(long, default_value_t = 1000.0)]
    pub minute_ms: f64,
    /// Keep the lowering's tiles (cuda backend): do not autotune the plans before the sweep (kairos
    /// serve autotunes at load; choices are cached beside the CUBIN cache).
    #[arg(long, env = "KAIROS_NO_AUTOTUNE")]
    pub no_autotune: bool,
    /// The occupancy gate's headroom B in CTAs (default: the dispatcher's, 132).
    #[arg(long, env = "KAIROS_HEADROOM_CTAS")]
    pub headroom_ctas: Option<u32>,
    /// At most this many CTAs per launch where the policy leaves the count to the dispatcher
    /// (default: as many as fit on the GPU).
    #[arg(long, env = "KAIROS_LAUNCH_CTAS_MAX")]
    pub launch_ctas_max: Option<u32>,
    /// Issue-ahead per job in µs of estimated GPU time (default: the dispatcher's, 50).
    #[arg(long, env = "KAIROS_LOOKAHEAD_US")]
    pub lookahead_us: Option<u64>,
    /// Issue jobs launch by launch instead of as recorded runs (CUDA graphs of a model's launches
    /// but the last, one per I/O slot, for whole jobs; of each segment for kernel-level
    /// policies): for measuring what runs save.
    #[arg(long, env = "KAIROS_NO_RUNS")]
    pub no_runs: bool,
    /// Kernel-level policies send each job in recorded segments of at least this many µs of
    /// estimated GPU time (0: launch by launch; default: the dispatcher's, 1500, or 500 where the
    /// pool's streams outnumber the hardware queues, CUDA_DEVICE_MAX_CONNECTIONS).
    #[arg(long, env = "KAIROS_RUN_SEGMENT_US")]
    pub run_segment_us: Option<u64>,
    /// Threaded engine: with nothing in flight the dispatcher thread polls its queue for this many
    /// µs since it last had work before it sleeps (one core busy; a request arriving meanwhile is
    /// taken without a thread wake-up). 0: sleep at once.
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub idle_spin_us: u64,
    /// Streams in the dispatcher's pool (default: the device's hardware queues, at least 32). A
    /// kernel-level job holds one while it has launches in flight, so this caps how many jobs run
    /// at once.
    #[arg(long, env = "KAIROS_STREAM_COUNT")]
    pub stream_count: Option<u32>,
    /// At most this many requests of one model in the dispatcher at once, each with its own I/O
    /// slot (default: the dispatcher's, 16, all made and their runs recorded at load); more wait
    /// for a slot in arrival order.
    #[arg(long, env = "KAIROS_SLOTS_PER_MODEL")]
    pub slots_per_model: Option<usize>,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A results.json written by `kairos bench run`.
    #[arg(long)]
    pub results: PathBuf,
    /// Peer results to merge.
    #[arg(long)]
    pub peers: Vec<PathBuf>,
    /// Folder of the trace files the peers replayed (default: traces/ beside the results).
    #[arg(long)]
    pub traces: Option<PathBuf>,
    /// Where to write results.json, results.md and plots/ (default: the results' folder).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub slo_ms: Option<f64>,
    #[arg(long)]
    pub per_model: bool,
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

use kairos_bench::presets::VISION;

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

fn run_paella(a: PaellaArgs) -> Result<()> {
    if !["all", "hol", "mix", "short-long", "fairness"].contains(&a.experiment.as_str()) {
        bail!("unknown experiment '{}': use hol, mix, short-long, fairness or all", a.experiment);
    }
    std::fs::create_dir_all(&a.out)?;
    let t0 = Instant::now();
    let profiles = match (&a.profiles, a.backend) {
        (Some(dir), _) => ProfileSet::load_dir(dir).map_err(anyhow::Error::msg)?,
        (None, Backend::Sim) => {
            ProfileSet::load_dir(&crate::paths::profile_dir(&sim_desc(&a.sim_gpu)?.key)).map_err(anyhow::Error::msg)?
        }
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

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Run(a) => run_presets(*a),
        BenchCommand::List => {
            list();
            Ok(())
        }
        BenchCommand::Report(a) => report(a),
        BenchCommand::Paella(a) => run_paella(a),
        BenchCommand::Latency(a) => crate::cmd_latency::run(*a),
        BenchCommand::Cold(a) => crate::cmd_cold::run(*a),
        BenchCommand::Serve(a) => crate::cmd_bench_serve::run(*a),
        BenchCommand::Soak(a) => crate::cmd_soak::run(*a),
        BenchCommand::Breakdown(a) => run_breakdown(*a),
    }
}

fn list() {
    let opts = PresetOptions::default();
    println!("| preset | what it models | load means | default loads | default policies |");
    println!("|---|---|---|---|---|");
    for name in Preset::NAMES {
        let p = Preset::by_name(name).expect("listed");
        let loads: Vec<String> = p.default_loads().iter().map(|l| l.to_string()).collect();
        println!(
            "| {name} | {} (models: {}) | {} | {} | {} |",
            p.about(),
            p.archs(&opts).join(", "),
            p.load_meaning(),
            loads.join(", "),
            p.default_policies().join(", ")
        );
    }
    println!(
        "\nPolicies: {} (with parameters: streams:N, paella:T (µs of GPU time owed, or inf), edf:S, +backfill for paella and edf, paella+bound[=S], reef+wait, reef+runs, reef+stopruns[+ungated], reef+nopad, reef...+hold=US (best-effort work held back US µs after each real-time job), krisp:N (SMs of overlap, or inf), static:N (partitions), +green after krisp or static (masks as green-context partitions)).",
        kairos_sched::PolicyConfig::NAMES.join(", ")
    );
    println!(
        "\nSources: see the module doc of kairos_bench::presets (Paella SOSP'23 section 6; DISB: github.com/SJTU-IPADS/disb benchmarks/workloads; DARIS arXiv 2504.08795)."
    );
}

fn ms_to_ns(v: f64) -> Result<u64> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("{v} ms is not a valid time");
    }
    Ok((v * 1e6).round() as u64)
}

fn preset_options(a: &RunArgs) -> Result<PresetOptions> {
    let class = match a.class.as_str() {
        "rt" => StreamClass::Rt,
        "be" => StreamClass::Be,
        other => bail!("--class '{other}': use rt or be"),
    };
    Ok(PresetOptions {
        sigmas: a.sigma.clone(),
        tenant_per_model: a.tenant_per_model,
        rt_only: a.rt_only,
        be_copies: a.be_copies || a.be_block_budget_us.is_some(),
        disb_rt_rate_per_s: a.rt_rate,
        pairs: match &a.pairs {
            Some(spec) => kairos_bench::presets::parse_pairs(spec).map_err(|e| anyhow::anyhow!("{e}"))?,
            None => kairos_bench::presets::disb_pairs(),
        },
        instances: a.instances,
        budget_bytes: a.budget_mb.map(|m| (m * 1024.0 * 1024.0) as u64),
        // deepplan-azure: --arrival azure:FILE, else the synthetic sample in the data folder.
        azure_trace: Some(match a.arrival.strip_prefix("azure:") {
            Some(f) => f.into(),
            None => crate::paths::data_dir().join("traces/azure-functions-sample.csv"),
        }),
        custom: CustomSpec {
            models: a.models.clone(),
            arrival: a.arrival.clone(),
            rate_per_s: a.rate,
            class,
            deadline_ns: a.deadline_ms.map(ms_to_ns).transpose()?,
            functions: a.functions,
            minutes: a.minutes,
            minute_ns: ms_to_ns(a.minute_ms)?,
        },
        ..PresetOptions::default()
    })
}

fn run_presets(a: RunArgs) -> Result<()> {
    let t0 = Instant::now();
    // PRESET or PRESET:LOAD:LOAD... (loads for that preset only).
    let mut presets: Vec<(Preset, Option<Vec<f64>>)> = Vec::new();
    for token in &a.presets {
        let mut parts = token.trim().split(':');
        let name = parts.next().unwrap_or_default();
        let p = Preset::by_name(name).ok_or_else(|| anyhow::anyhow!("unknown preset '{name}': {}", Preset::NAMES.join(", ")))?;
        let loads: Vec<f64> = parts
            .map(|l| l.parse::<f64>().map_err(|_| anyhow::anyhow!("'{token}': '{l}' is not a load")))
            .collect::<Result<_>>()?;
        presets.push((p, (!loads.is_empty()).then_some(loads)));
    }
    let popts = preset_options(&a)?;
    let mut archs: Vec<String> = Vec::new();
    for (p, _) in &presets {
        for m in p.archs(&popts) {
            if !archs.contains(&m) {
                archs.push(m);
            }
        }
    }
    let profile_dir = match (&a.profiles, a.backend) {
        (Some(d), _) => d.clone(),
        (None, Backend::Sim) => crate::paths::profile_dir(&sim_desc(&a.sim_gpu)?.key),
        (None, _) => crate::paths::cuda_profile_dir(a.device),
    };
    let profiles = ProfileSet::load_dir(&profile_dir).map_err(anyhow::Error::msg)?;
    eprintln!(
        "kairos bench: {} on the {:?} backend ({:?} engine); seed {} (reproduce with --seed {}); {} profiles from {}",
        a.presets.join(","),
        a.backend,
        a.engine,
        a.seed,
        a.seed,
        profiles.models.len(),
        profile_dir.display()
    );
    let mut catalog = bx::lower_models(&archs, a.dtype, &profiles, |m, s| eprintln!("  lowered {m} in {s:.1} s"))?;
    if a.backend == Backend::Cuda && !a.no_autotune {
        autotune_catalog(&mut catalog, a.device)?;
    }
    if let Some(budget_us) = a.be_block_budget_us {
        anyhow::ensure!(a.backend == Backend::Cuda, "--be-block-budget-us needs --backend cuda (it times tiles on the GPU)");
        let mut be: Vec<String> = presets.iter().flat_map(|(p, _)| p.best_effort_only_archs(true)).collect();
        be.sort_unstable();
        be.dedup();
        anyhow::ensure!(
            !be.is_empty(),
            "--be-block-budget-us: no model of these presets is requested by best-effort clients alone"
        );
        eprintln!("  best-effort plans with blocks of at most {budget_us} us: {}", be.join(", "));
        let be: Vec<&str> = be.iter().map(String::as_str).collect();
        autotune_models(&mut catalog, a.device, Some(&be), Some(budget_us * 1000))?;
    }
    if a.backend == Backend::Cuda {
        // Presets under a weight budget load models cold: DeepPlan's plan (the default cold
        // strategy) needs each model's layer profile, else it reads no layer in place.
        let mut cold: Vec<&str> = Vec::new();
        for (p, _) in &presets {
            for (m, _) in kairos_bench::presets::instances_of(p, 1) {
                if !cold.contains(&m) {
                    cold.push(m);
                }
            }
        }
        layer_profile_catalog(&mut catalog, a.device, &cold)?;
    }
    std::fs::create_dir_all(&a.out)?;
    let trace_dir = a.out.join("traces");
    let sweep = SweepOptions {
        policies: a.policies.clone(),
        loads: a.loads.clone(),
        length: match (a.requests, a.duration_ms) {
            (Some(n), _) => Some(Length::Requests(n)),
            (None, Some(d)) => Some(Length::DurationNs(ms_to_ns(d)?)),
            (None, None) => None,
        },
        warmup_fraction: a.warmup_frac,
        drain_ns: a.drain_ms.map(ms_to_ns).transpose()?,
        saturation: a.saturation,
        slo_ns: a.slo_ms.map(ms_to_ns).transpose()?,
        seed: a.seed,
        base: {
            let mut c = kairos_sched::Config::default();
            if a.launch_ctas_max.is_some() {
                c.launch_ctas_max = a.launch_ctas_max;
            }
            if let Some(h) = a.headroom_ctas {
                c.headroom_ctas = h;
            }
            if let Some(l) = a.lookahead_us {
                c.lookahead_ns = l.saturating_mul(1000);
            }
            c.record_runs = !a.no_runs;
            if let Some(us) = a.run_segment_us {
                c.run_segment_ns = Some(us.saturating_mul(1000));
            }
            if a.stream_count.is_some() {
                c.stream_count = a.stream_count;
            }
            if let Some(n) = a.slots_per_model {
                c.slots_per_model_max = n;
            }
            c
        },
        trace_dir: a.traces.then(|| trace_dir.clone()),
        // Every point's requests one by one, beside the results (a number can be rechecked).
        raw_dir: Some(a.out.join("raw")),
        preset: popts,
        ..SweepOptions::default()
    };
    let mut results = match (a.backend, a.engine) {
        (Backend::Cpu, _) => bail!("benchmarks need a GPU: use --backend sim or --backend cuda"),
        (_, EngineMode::Rest | EngineMode::Grpc | EngineMode::Shm) => {
            sweep_all(&mut remote_target(&a, &catalog)?, &presets, &catalog, &sweep, a.seed, &a.out)?
        }
        (Backend::Sim, EngineMode::Virtual) => {
            let desc = sim_desc(&a.sim_gpu)?;
            // The threaded engine's host path per request, which the simulated GPU does not see.
            let host_ns = desc.latency.request_host_ns;
            let mut gpu = kairos_sim::SimGpu::new(desc, kairos_sim::SimOptions::timing_only(a.seed));
            let scale = tuned_time_scale(a.sim_autotune.as_deref())?;
            bx::register_on_sim_scaled(&mut gpu, &catalog, &scale)?;
            let mut target = VirtualTarget::new(gpu, true).with_request_host_ns(host_ns);
            sweep_all(&mut target, &presets, &catalog, &sweep, a.seed, &a.out)?
        }
        (Backend::Sim, EngineMode::Threaded) => {
            eprintln!(
                "  note: the threaded engine on the simulator measures wall time while the GPU keeps virtual time; use it to check the path, not for numbers"
            );
            let desc = sim_desc(&a.sim_gpu)?;
            let (seed, cat) = (a.seed, Arc::new(catalog.clone()));
            let scale = tuned_time_scale(a.sim_autotune.as_deref())?;
            let factory = move || {
                let mut g = kairos_sim::SimGpu::new(desc.clone(), kairos_sim::SimOptions::timing_only(seed));
                bx::register_on_sim_scaled(&mut g, &cat, &scale).map_err(|e| kairos_gpu::GpuError::Invalid(e.to_string()))?;
                Ok(g)
            };
            sweep_all(&mut EngineTarget::new(factory, EngineConfig::default(), true), &presets, &catalog, &sweep, a.seed, &a.out)?
        }
        (Backend::Cuda, EngineMode::Virtual) => {
            let gpu = kairos_cuda::CudaGpu::new(a.device)?;
            sweep_all(&mut VirtualTarget::new(gpu, false), &presets, &catalog, &sweep, a.seed, &a.out)?
        }
        (Backend::Cuda, EngineMode::Threaded) => {
            let device = a.device;
            let factory = move || kairos_cuda::CudaGpu::new(device);
            let engine = EngineConfig { idle_spin_ns: a.idle_spin_us.saturating_mul(1000), ..EngineConfig::default() };
            sweep_all(&mut EngineTarget::new(factory, engine, false), &presets, &catalog, &sweep, a.seed, &a.out)?
        }
    };
    for p in &a.peers {
        let peers = PeerFile::read(p)?;
        let n = results.merge_peers(&peers, &trace_dir, sweep.slo_ns)?;
        eprintln!("  merged {n} peer runs from {}", p.display());
    }
    write_results(&results, &a.out, a.per_model)?;
    eprintln!("done in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// What one `Gpu::launch` costs the host on this machine: an empty kernel through the driver alone,
/// then every launch of each model's plan issued back to back through `Gpu::launch` (whole-job
/// style, end records only), one request per stream over 1 and over 32 streams; the split between
/// kairos' own work and the driver call comes from `CudaGpu::launch_costs`. Markdown lines.
fn launch_cost_probe(
    gpu: &mut kairos_cuda::CudaGpu,
    catalog: &kairos_bench::runner::Catalog,
    models: &[String],
) -> Result<String> {
    use kairos_gpu::{GpuEvent, LaunchRequest, MemKind, PartitionId, exec};
    let stream = gpu.utility_stream()?;
    let mut empty: Vec<u64> = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        gpu.launch_empty(1, 128, stream)?;
        empty.push(t.elapsed().as_nanos() as u64);
    }
    gpu.synchronize()?;
    empty.sort_unstable();
    let mut s = format!(
        "\nHost time of one launch on {} (CUDA_DEVICE_MAX_CONNECTIONS={}, {} launcher threads): an empty kernel through the driver alone, p50 {:.2} µs, p90 {:.2} µs.\n\n\
         | model | streams | launches | µs per launch (Gpu::launch) | of which kairos | of which the driver call (or the handoff to a launcher) | µs per launch, wall |\n|---|---:|---:|---:|---:|---:|---:|\n",
        gpu.info().name,
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_else(|_| "unset (8)".into()),
        gpu.launch_threads(),
        empty[empty.len() / 2] as f64 / 1e3,
        empty[empty.len() * 9 / 10] as f64 / 1e3
    );
    // Launch throughput from several host threads at once, each with its own handle (the same
    // primary context) and stream: does the driver let launches go out in parallel?
    // (Printed after the per-model table, which `s` has the header of.)
    let mut threads_table = String::from(
        "\n| host threads launching at once | empty kernels per second, all threads | µs per launch per thread |\n|---:|---:|---:|\n",
    );
    for threads in [1usize, 2, 4] {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads));
        let per_thread = 3000;
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = barrier.clone();
                std::thread::spawn(move || -> Result<(f64, f64)> {
                    let mut g = kairos_cuda::CudaGpu::new(0)?;
                    let st = g.utility_stream()?;
                    g.launch_empty(1, 128, st)?;
                    g.synchronize()?;
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..per_thread {
                        g.launch_empty(1, 128, st)?;
                    }
                    let issue = t.elapsed().as_secs_f64();
                    g.synchronize()?;
                    Ok((issue, t.elapsed().as_secs_f64()))
                })
            })
            .collect();
        let mut slowest = 0f64;
        let mut issue_sum = 0f64;
        for h in handles {
            let (issue, _) = h.join().map_err(|_| anyhow::anyhow!("a launch thread panicked"))??;
            slowest = slowest.max(issue);
            issue_sum += issue;
        }
        threads_table += &format!(
            "| {threads} | {:.0} | {:.2} |\n",
            (threads * per_thread) as f64 / slowest,
            issue_sum / threads as f64 / per_thread as f64 * 1e6
        );
    }
    let whole = gpu.info().partitions[0].sms;
    let mut events: Vec<GpuEvent> = Vec::new();
    for m in models {
        let Ok(spec) = catalog.get(m) else { continue };
        let plan = spec.plan.clone();
        let weights = exec::upload_weights(gpu, &plan, MemKind::Device)?;
        let inputs: Vec<kairos_ir::Tensor> =
            plan.inputs.iter().map(|i| kairos_ir::Tensor::zeros(i.dtype, i.shape.clone())).collect();
        let mut allocations = Vec::new();
        let bases = exec::alloc_request(gpu, &plan, weights.ptr, &inputs, &mut allocations)?;
        for n in [1usize, 32] {
            let streams: Vec<_> = (0..n).map(|_| gpu.create_stream(0)).collect::<kairos_gpu::Result<_>>()?;
            let reps = 40;
            gpu.set_launch_timing(true);
            let before = gpu.launch_costs();
            let t = Instant::now();
            let mut args = Vec::new();
            for r in 0..reps {
                for l in &plan.launches {
                    bases.resolve_all(&l.args, &mut args);
                    let mut req = LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, streams[r % n]);
                    req.report_ctas = false;
                    gpu.launch(&req)?;
                }
                // Keep below the launch slots: read the ends of what finished.
                while gpu.launches_in_flight() > 512 {
                    events.clear();
                    gpu.poll(&mut events)?;
                }
            }
            let wall_ns = t.elapsed().as_nanos() as u64;
            while gpu.launches_in_flight() > 0 {
                let now = gpu.now_ns();
                gpu.wait(now + 1_000_000)?;
                events.clear();
                gpu.poll(&mut events)?;
            }
            let c = gpu.launch_costs().since(&before);
            let per = |ns: u64| ns as f64 / 1e3 / c.launches.max(1) as f64;
            s += &format!(
                "| {m} | {n} | {} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
                c.launches,
                per(c.total_ns),
                per(c.total_ns - c.driver_ns),
                per(c.driver_ns),
                per(wall_ns)
            );
            for st in streams {
                gpu.destroy_stream(st)?;
            }
        }
        for a in allocations {
            gpu.free(a)?;
        }
        gpu.free(weights)?;
    }
    s += &threads_table;
    Ok(s)
}

/// Autotunes every plan of the catalog on the GPU, as `kairos serve` does at load (tiles, CTA
/// size and shared memory per shape; cached beside the CUBIN cache). A profile measured on the
/// lowering's tiles no longer matches a retiled plan: such a model starts from roofline estimates
/// and learns its kernels' durations online.
pub fn autotune_catalog(catalog: &mut kairos_bench::runner::Catalog, device: u32) -> Result<()> {
    autotune_models(catalog, device, None, None)
}

/// [`autotune_catalog`] for `models` only (None: all), under a block-time budget (see
/// `kairos_cuda::TuneOptions::block_budget_ns`). The plan is tuned as lowered: a budget replaces
/// an earlier tuning's choices.
pub fn autotune_models(
    catalog: &mut kairos_bench::runner::Catalog,
    device: u32,
    models: Option<&[&str]>,
    block_budget_ns: Option<u64>,
) -> Result<()> {
    let mut gpu = kairos_cuda::CudaGpu::new(device)?;
    let specs: Vec<ModelSpec> = catalog.specs().cloned().collect();
    for mut spec in specs {
        if spec.plan.launches.is_empty()
            || spec.name == kairos_bench::presets::HOL_MODEL
            || models.is_some_and(|m| !m.contains(&spec.name.as_str()))
        {
            continue;
        }
        let mut plan = (*spec.plan).clone();
        let opts = kairos_cuda::TuneOptions { dtypes: vec![plan.dtype], block_budget_ns, ..kairos_cuda::TuneOptions::default() };
        let r = kairos_cuda::autotune_plan(&mut gpu, &mut plan, &opts)?;
        if r.launches_changed > 0
            && let Some(p) = &spec.profile
            && let Err(e) = p.check_plan(&plan)
        {
            // Under a block budget the tiles are slower by design (1.1-2.5x): the profiled times
            // of the fastest tiles would not describe them.
            spec.profile = match p.retiled_for(&plan).filter(|_| block_budget_ns.is_none()) {
                Some((kept, n)) => {
                    eprintln!(
                        "  {}: {n} launches retiled by autotuning: their profiled times kept as estimates, their right sizes unknown",
                        spec.name
                    );
                    Some(kept)
                }
                None => {
                    eprintln!("  {}: profile dropped after autotuning ({e}); roofline estimates, refined online", spec.name);
                    None
                }
            };
        }
        spec.plan = Arc::new(plan);
        catalog.insert(spec);
    }
    Ok(())
}

/// Measures DeepPlan's layer profile (each launch with its weights in GPU and in host memory,
/// the copy times; `kairos profile --layers`) of the catalog's `models` on the GPU and attaches it
/// to their profiles, so the dispatcher's cold plans under a weight budget come from measured
/// times, as `kairos bench cold` and `kairos serve` with a profile do.
pub fn layer_profile_catalog(catalog: &mut kairos_bench::runner::Catalog, device: u32, models: &[&str]) -> Result<()> {
    /// Repetitions of each launch and copy (`kairos bench cold`'s default).
    const LAYER_PROFILE_REPS: usize = 5;
    if models.is_empty() {
        return Ok(());
    }
    let mut gpu = kairos_cuda::CudaGpu::new(device)?;
    for &m in models {
        let mut spec = catalog.get(m).map_err(|e| anyhow::anyhow!("{e}"))?.clone();
        let t0 = Instant::now();
        let layers = kairos_gpu::exec::profile_layers(&mut gpu, &spec.plan, LAYER_PROFILE_REPS)?;
        eprintln!("  layer profile of {m}: {} weight layers in {:.2} s", spec.plan.layers.len(), t0.elapsed().as_secs_f64());
        let profile = spec.profile.get_or_insert_with(|| kairos_gpu::profile::ModelProfile {
            model: spec.plan.model.clone(),
            dtype: spec.plan.dtype,
            batch: 1,
            device: gpu.info().name.clone(),
            sm_count: 0,
            latency_ns: 0,
            kernels: vec![],
            layers: None,
            placements: None,
        });
        profile.layers = Some(layers);
        catalog.insert(spec);
    }
    Ok(())
}

/// The generator against a kairos server: one started in-process for every run (with that run's
/// dispatcher configuration, over a repository of the catalog's models), or a running one.
fn remote_target(a: &RunArgs, catalog: &kairos_bench::runner::Catalog) -> Result<kairos_bench::remote::RemoteTarget> {
    use kairos_bench::remote::{Launched, Launcher, RemoteTarget};
    use kairos_bench::serving::{Endpoints, Transport};
    let transport = match a.engine {
        EngineMode::Rest => Transport::RestBinary,
        EngineMode::Grpc => Transport::Grpc,
        _ => Transport::ShmHybrid,
    };
    let external = Endpoints { http: a.server_http.clone(), grpc: a.server_grpc.clone(), shm: a.server_shm.clone() };
    let launcher: Launcher = if external.http.is_some() || external.grpc.is_some() || external.shm.is_some() {
        eprintln!("  remote: a running server; its own policy applies (the policies swept only label the runs)");
        Box::new(move |_| {
            Ok(Launched { endpoints: external.clone(), device: "a running kairos server".into(), stop: Box::new(|| {}) })
        })
    } else {
        let kind = match a.backend {
            Backend::Cuda => crate::cmd_serve::ServeBackend::Cuda,
            _ => crate::cmd_serve::ServeBackend::Sim,
        };
        let names: Vec<String> = catalog.specs().map(|s| s.name.clone()).collect();
        let (dtype, sim_gpu, seed, profiles) = (a.dtype, a.sim_gpu.clone(), a.seed, a.profiles.clone());
        let mut run = 0u32;
        Box::new(move |cfg| {
            let fail = |e: String| kairos_bench::Error::Invalid(format!("in-process server: {e}"));
            run += 1;
            let dir = std::env::temp_dir().join(format!("kairos-bench-remote-{}-{run}", std::process::id()));
            let repo = dir.join("models");
            for n in &names {
                let d = repo.join(n);
                std::fs::create_dir_all(&d).map_err(|e| fail(e.to_string()))?;
                std::fs::write(d.join("config.toml"), format!("model = \"{n}\"\ndtype = \"{}\"\n", dtype.name()))
                    .map_err(|e| fail(e.to_string()))?;
            }
            let engine = EngineConfig { dispatcher: cfg.clone(), ..EngineConfig::default() };
            let backend = crate::cmd_serve::make_backend_with(
                kind,
                engine,
                &sim_gpu,
                seed,
                false,
                profiles.clone(),
                false,
                crate::cmd_serve::PEER_STAGING_MIB_DEFAULT << 20,
                kairos_backends::TestFaults::default(),
            )
            .map_err(|e| fail(e.to_string()))?;
            let server = kairos_server::RunningServer::start(
                kairos_server::ServerConfig {
                    state: kairos_server::StateConfig { repository: repo, gpus: 1, load: None },
                    http: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
                    grpc: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
                    shm: Some(kairos_server::ShmConfig { socket: dir.join("kairos.sock"), ..Default::default() }),
                    request_bytes_max: 64 << 20,
                    threads: 4,
                    control: kairos_server::ControlAccess::On,
                    tls: None,
                },
                backend,
            )
            .map_err(|e| fail(e.to_string()))?;
            // The models load in the background: the benchmark's first request must find them ready.
            server.wait_until_ready(std::time::Duration::from_secs(1800)).map_err(|e| fail(e.to_string()))?;
            let endpoints = Endpoints {
                http: server.http_addr().map(|x| format!("http://{x}")),
                grpc: server.grpc_addr().map(|x| format!("http://{x}")),
                shm: server.shm_socket().map(|p| p.to_path_buf()),
            };
            let device = server.state.device_names().join(", ");
            Ok(Launched {
                endpoints,
                device,
                stop: Box::new(move || {
                    server.shutdown();
                    let _ = std::fs::remove_dir_all(dir);
                }),
            })
        })
    };
    RemoteTarget::new(transport, a.clients, a.seed, launcher).map_err(anyhow::Error::from)
}

fn sweep_all(
    target: &mut dyn Target,
    presets: &[(Preset, Option<Vec<f64>>)],
    catalog: &kairos_bench::runner::Catalog,
    sweep: &SweepOptions,
    seed: u64,
    out: &Path,
) -> Result<Results> {
    let mut results = Results::new(&target.label(), &target.device(), seed);
    let mut bar = Bar::default();
    for (p, loads) in presets {
        eprintln!("\n{}: {}", p.name(), p.about());
        let mut s = sweep.clone();
        if loads.is_some() {
            s.loads = loads.clone();
        }
        let r = bx::run_preset(target, p, catalog, &s, &mut bar)?;
        results.presets.push(r);
        // Written after every preset, so a run cut short keeps what it measured.
        results.device = target.device();
        results.write(&out.join("results.json"))?;
    }
    bar.finish();
    results.device = target.device();
    Ok(results)
}

fn write_results(results: &Results, out: &Path, per_model: bool) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let json = out.join("results.json");
    results.write(&json)?;
    let md = out.join("results.md");
    std::fs::write(&md, results.markdown(true))?;
    let plots = results.plot(&out.join("plots"))?;
    eprintln!("wrote {}, {} and {} plots under {}", json.display(), md.display(), plots.len(), out.join("plots").display());
    println!("{}", results.markdown(per_model));
    Ok(())
}

fn report(a: ReportArgs) -> Result<()> {
    let mut results = Results::read(&a.results)?;
    let dir = a.results.parent().map(Path::to_path_buf).unwrap_or_default();
    let traces = a.traces.clone().unwrap_or_else(|| dir.join("traces"));
    let slo_ns = a.slo_ms.map(ms_to_ns).transpose()?;
    for p in &a.peers {
        let peers = PeerFile::read(p)?;
        let n = results.merge_peers(&peers, &traces, slo_ns)?;
        eprintln!("merged {n} peer runs from {}", p.display());
    }
    write_results(&results, &a.out.unwrap_or(dir), a.per_model)
}

/// `--sim-autotune`: per launch, the tuned time over the plan's time of its shape in the table
/// (none without a table, for shapes it lacks, and for entries without a plan time).
fn tuned_time_scale(
    table: Option<&std::path::Path>,
) -> Result<impl Fn(&kairos_ir::plan::Launch) -> Option<f64> + Clone + Send + Sync + 'static> {
    let table = match table {
        Some(p) => Some(Arc::new(kairos_cuda::autotune::TuneTable::load(p).map_err(|e| anyhow::anyhow!("--sim-autotune: {e}"))?)),
        None => None,
    };
    if let Some(t) = &table {
        eprintln!("simulator: kernel times of the {} shapes tuned in the {} table", t.entries.len(), t.device);
    }
    Ok(move |l: &kairos_ir::plan::Launch| {
        let e = table.as_ref()?.entries.get(&kairos_cuda::autotune::shape_key(&l.kernel, l.dtype)?)?;
        (e.plan_duration_ns > 0 && e.duration_ns > 0).then(|| e.duration_ns as f64 / e.plan_duration_ns as f64)
    })
}

#[cfg(test)]
mod tests {
    use kairos_cuda::autotune::{TileChoice, TuneEntry, TuneTable, shape_key};

    #[test]
    fn the_sim_autotune_scale_is_tuned_over_plan_time_for_the_shapes_the_table_holds() {
        let plan = kairos_ir::model::ModelSpec { dtype: kairos_ir::DType::F16, ..kairos_ir::model::ModelSpec::new("resnet18") }
            .plan()
            .unwrap();
        let mut keyed = plan.launches.iter().filter_map(|l| shape_key(&l.kernel, l.dtype).map(|k| (l, k)));
        let (tuned, key) = keyed.next().expect("resnet18 has tunable convolutions");
        let other = keyed.find(|(_, k)| *k != key).expect("a second tunable shape").0;
        let choice = TileChoice { tile_m: 64, tile_n: 64, threads: 128, smem_bytes: 0 };
        let mut table = TuneTable { device: "test".into(), ..TuneTable::default() };
        table.entries.insert(key, TuneEntry { choice, duration_ns: 30, plan_duration_ns: 40, block_ns: 0 });
        let dir = std::env::temp_dir().join(format!("kairos-sim-autotune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table.json");
        table.save(&path).unwrap();
        let scale = super::tuned_time_scale(Some(&path)).unwrap();
        assert_eq!(scale(tuned), Some(0.75));
        assert_eq!(scale(other), None, "a shape the table lacks keeps its time");
        assert_eq!(super::tuned_time_scale(None).unwrap()(tuned), None, "no table, no scaling");
        let missing = super::tuned_time_scale(Some(&dir.join("none.json"))).err().unwrap().to_string();
        assert!(missing.contains("--sim-autotune") && missing.contains("none.json"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! `kairos bench cold`: one cold inference per model (DeepPlan's Fig. 11 on one GPU).
//!
//! Per model: the plan (tiles autotuned on CUDA), its layer profile measured on the device
//! (`kairos_gpu::exec::profile_layers`), then per cold strategy (`load-then-run`, `pipelined`,
//! `deepplan`) a dispatcher with a weight budget that holds one copy of the model and two
//! instances of it: each repetition asks the evicted instance (a cold start: its load, evicting
//! the other), asks it again (warm), then asks the other instance (evicting it again). Latency is
//! arrival to completion on the dispatcher's clock (the host's wall clock on CUDA, virtual time on
//! the simulator). A cold answer is checked against the warm one, byte for byte. The pure copy
//! time of the bytes a plan loads comes from the profile's whole-blob copy. Every sample is kept
//! in the JSON; the table is printed last.

use crate::cmd_run::{Backend, random_inputs, sim_desc};
use anyhow::{Context, Result, bail};
use clap::Args;
use kairos_bench::stats::rounded_index;
use kairos_gpu::Gpu;
use kairos_gpu::profile::{LayerProfile, ModelProfile};
use kairos_ir::DType;
use kairos_ir::model::ModelSpec as IrModelSpec;
use kairos_ir::plan::Plan;
use kairos_sched::cold::{self, ColdStrategy};
use kairos_sched::{Config, ModelSpec, PolicyConfig, RequestOptions, VirtualDriver};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Repetitions per model and strategy at most.
const REPS_MAX: usize = 10_000;
/// Requests per serving point at most.
const SERVE_REQUESTS_MAX: usize = 1_000_000;

#[derive(Args, Debug)]
pub struct ColdArgs {
    /// cuda (the GPU, wall clock) or sim (the simulated GPU, virtual time: a design tool only).
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "cuda")]
    pub backend: Backend,
    /// Zoo models, comma-separated.
    #[arg(long, env = "KAIROS_COLD_MODELS", value_delimiter = ',', default_value = "bert_base,gpt2,resnet50,resnet152")]
    pub models: Vec<String>,
    /// Sequence length of the transformer models.
    #[arg(long, env = "KAIROS_SEQ_LEN", default_value_t = kairos_ir::zoo::DEFAULT_SEQ_LEN)]
    pub seq_len: usize,
    #[arg(long, env = "KAIROS_DTYPE", default_value = "f16", value_parser = crate::model_args::parse_dtype)]
    pub dtype: DType,
    /// Cold strategies, comma-separated: load-then-run, pipelined, deepplan, parallel,
    /// parallel-deepplan (the parallel ones copy through --peer-gpus).
    #[arg(long, env = "KAIROS_COLD_STRATEGIES", value_delimiter = ',', default_value = "load-then-run,pipelined,deepplan")]
    pub strategies: Vec<String>,
    /// Timed cold starts per model and strategy.
    #[arg(long, env = "KAIROS_COLD_REPS", default_value_t = 20)]
    pub reps: usize,
    /// Repetitions of each launch and of the blob copy in the layer profile.
    #[arg(long, env = "KAIROS_COLD_PROFILE_REPS", default_value_t = 5)]
    pub profile_reps: usize,
    /// The dispatcher's policy.
    #[arg(long, env = "KAIROS_COLD_POLICY", default_value = "fifo")]
    pub policy: String,
    /// Copies of a load hold at least this many bytes of consecutive loaded layers.
    #[arg(long, env = "KAIROS_COLD_CHUNK_BYTES", default_value_t = kairos_sched::dispatcher::COLD_CHUNK_BYTES_DEFAULT)]
    pub chunk_bytes: u64,
    /// Loads' own copies go on the copy engine while less than this many bytes of them (all loads
    /// together, the first started first) are on it, in pieces of at most half of it (the next go
    /// out as earlier ones land); 0: the whole load at once.
    #[arg(long, env = "KAIROS_COLD_COPY_WINDOW_BYTES", default_value_t = kairos_sched::dispatcher::COLD_COPY_WINDOW_BYTES_DEFAULT)]
    pub copy_window_bytes: u64,
    /// Keep the lowering's tiles (cuda backend): skip the autotuner.
    #[arg(long, env = "KAIROS_COLD_NO_AUTOTUNE")]
    pub no_autotune: bool,
    /// CUDA device ordinal (cuda backend).
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
    /// Secondary GPUs for parallel transmission (DeepPlan's PT), comma-separated CUDA ordinals
    /// (cuda backend), or simulated secondaries with this GPU's PCIe rate (sim backend; their
    /// ordinals only name them). Attached for every strategy; only the parallel ones copy
    /// through them.
    #[arg(long, env = "KAIROS_PEER_GPUS", value_delimiter = ',')]
    pub peer_gpus: Vec<u32>,
    /// Staging memory reserved on each secondary, MiB.
    #[arg(long, env = "KAIROS_PEER_STAGING_MIB", default_value_t = crate::cmd_serve::PEER_STAGING_MIB_DEFAULT)]
    pub peer_staging_mib: u64,
    /// Forward rate of the simulated secondaries (sim backend), GB/s.
    #[arg(long, env = "KAIROS_SIM_FORWARD_GBPS", default_value_t = 300.0)]
    pub sim_forward_gbps: f64,
    /// The simulated GPU (sim backend): h100-sxm, h100-pcie, h200, or a description file (.json, as data/gpus/).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    /// DeepPlan's serving experiment scaled to one GPU instead of single cold inferences: this many
    /// instances of the first model (comma-separated counts, one point each), Poisson arrivals
    /// spread uniformly over them, a weight budget of --serve-budget-instances whole copies.
    #[arg(long, env = "KAIROS_COLD_SERVE_INSTANCES", value_delimiter = ',')]
    pub serve_instances: Vec<usize>,
    /// Offered load of the serving experiment, requests per second (comma-separated).
    #[arg(long, env = "KAIROS_COLD_SERVE_RATE", value_delimiter = ',', default_value = "100")]
    pub serve_rate: Vec<f64>,
    /// Requests per serving point.
    #[arg(long, env = "KAIROS_COLD_SERVE_REQUESTS", default_value_t = 2000)]
    pub serve_requests: usize,
    /// GPUs of the serving experiment (DeepPlan's Sec. 5.3 on several GPUs): GPU 0..N, one
    /// dispatcher each in its own thread, instance k on GPU k mod N, one arrival stream; under
    /// the parallel strategies every GPU has the others as secondaries (--peer-gpus is ignored).
    #[arg(long, env = "KAIROS_COLD_SERVE_GPUS", default_value_t = 1)]
    pub serve_gpus: u32,
    /// A tighter SLO, ms, whose goodput the serving table shows beside DeepPlan's 100 and 50 ms
    /// (a cold bert_base start takes ~4 ms on an H100, ~50 on DeepPlan's V100s).
    #[arg(long, env = "KAIROS_COLD_SERVE_SLO_MS", default_value_t = 5.0)]
    pub serve_slo_ms: f64,
    /// The serving experiment's weight budget per GPU, in whole copies of the model's weights.
    #[arg(long, env = "KAIROS_COLD_SERVE_BUDGET_INSTANCES", default_value_t = 8.0)]
    pub serve_budget_instances: f64,
    /// Which idle resident instance a load evicts in the serving experiment: lru (DeepPlan's) or
    /// lru2 (the oldest second-to-last request first: instances under steady traffic stay).
    #[arg(long, env = "KAIROS_COLD_EVICTION", default_value = "lru")]
    pub eviction: kairos_sched::Eviction,
    /// Hot instances of the serving experiment: the first N instances take --serve-hot-share of
    /// the arrivals (uniform among them) and stay resident (the budget must hold them), the others
    /// the rest: warm requests beside a stream of cold starts. 0: arrivals uniform over all.
    #[arg(long, env = "KAIROS_COLD_SERVE_HOT", default_value_t = 0)]
    pub serve_hot: usize,
    /// The share of the arrivals that go to the hot instances (with --serve-hot).
    #[arg(long, env = "KAIROS_COLD_SERVE_HOT_SHARE", default_value_t = 0.9)]
    pub serve_hot_share: f64,
    /// Also serve each rate and instance count with every instance resident (no budget): the
    /// warm reference that warm requests under cold loads are compared with.
    #[arg(long, env = "KAIROS_COLD_SERVE_BASELINE")]
    pub serve_baseline: bool,
    /// JSON with every sample (and the table as markdown beside it, `.md`).
    #[arg(long, env = "KAIROS_COLD_OUT", default_value = "out/cold.json")]
    pub out: PathBuf,
    /// Seed of the zoo's weights, the inputs and the simulator.
    #[arg(long, env = "KAIROS_SEED", default_value_t = kairos_ir::zoo::DEFAULT_SEED)]
    pub seed: u64,
}

/// Opens a fresh GPU of the chosen backend.
trait Opener: Send {
    type G: Gpu;
    fn open(&mut self) -> Result<Self::G>;
    /// An opener of GPU `gpu` of a multi-GPU serving point, with `peers` as its secondaries.
    fn for_gpu(&self, gpu: u32, peers: Vec<u32>) -> Self
    where
        Self: Sized;
    fn tune(&mut self, plan: &mut Plan) -> Result<()>;
    fn device(&self) -> String;
}

struct CudaOpener {
    device: u32,
    autotune: bool,
    name: Option<String>,
    peers: Vec<u32>,
    staging_bytes: u64,
}

impl Opener for CudaOpener {
    type G = kairos_cuda::CudaGpu;
    fn open(&mut self) -> Result<kairos_cuda::CudaGpu> {
        let g = kairos_cuda::CudaGpu::new(self.device).with_context(|| {
            format!(
                "cannot open CUDA device {}: `bench cold --backend cuda` needs an NVIDIA GPU (use --backend sim without one)",
                self.device
            )
        })?;
        self.name.get_or_insert_with(|| g.info().name.clone());
        let mut g = g;
        for &p in &self.peers {
            let path = g
                .attach_peer(p, self.staging_bytes)
                .with_context(|| format!("attaching GPU {p} as a secondary of GPU {}", self.device))?;
            eprintln!(
                "cold: GPU {p} attached as a secondary: host to it {:.1} GB/s, forward {:.1} GB/s, {} MiB staging",
                path.h2d_bytes_per_s / 1e9,
                path.forward_bytes_per_s / 1e9,
                path.staging_bytes >> 20
            );
        }
        Ok(g)
    }
    fn for_gpu(&self, gpu: u32, peers: Vec<u32>) -> Self {
        CudaOpener { device: gpu, autotune: false, name: self.name.clone(), peers, staging_bytes: self.staging_bytes }
    }
    fn tune(&mut self, plan: &mut Plan) -> Result<()> {
        if !self.autotune {
            return Ok(());
        }
        // Without secondaries: tuning needs none.
        let mut gpu = kairos_cuda::CudaGpu::new(self.device)?;
        let opts = kairos_cuda::TuneOptions { dtypes: vec![plan.dtype], progress: false, ..kairos_cuda::TuneOptions::default() };
        kairos_cuda::autotune_plan(&mut gpu, plan, &opts)?;
        Ok(())
    }
    fn device(&self) -> String {
        self.name.clone().unwrap_or_else(|| format!("CUDA device {}", self.device))
    }
}

struct SimOpener {
    desc: kairos_sim::GpuDesc,
    seed: u64,
    peers: Vec<u32>,
    staging_bytes: u64,
    forward_bytes_per_s: f64,
}

impl Opener for SimOpener {
    type G = kairos_sim::SimGpu;
    fn open(&mut self) -> Result<kairos_sim::SimGpu> {
        let mut g = kairos_sim::SimGpu::new(self.desc.clone(), kairos_sim::SimOptions { seed: self.seed, ..Default::default() });
        for &p in &self.peers {
            g.attach_peer(p, self.desc.h2d_bytes_per_s, self.forward_bytes_per_s, self.staging_bytes)?;
        }
        Ok(g)
    }
    fn for_gpu(&self, _gpu: u32, peers: Vec<u32>) -> Self {
        SimOpener {
            desc: self.desc.clone(),
            seed: self.seed,
            peers,
            staging_bytes: self.staging_bytes,
            forward_bytes_per_s: self.forward_bytes_per_s,
        }
    }
    fn tune(&mut self, _plan: &mut Plan) -> Result<()> {
        Ok(())
    }
    fn device(&self) -> String {
        format!("simulated {} (virtual time)", self.desc.name)
    }
}

pub fn run(a: ColdArgs) -> Result<()> {
    let strategies: Vec<ColdStrategy> =
        a.strategies.iter().map(|s| s.parse().map_err(|e: String| anyhow::anyhow!(e))).collect::<Result<_>>()?;
    if a.reps == 0 || a.reps > REPS_MAX {
        bail!("--reps must be in 1..={REPS_MAX}");
    }
    kairos_bench::latency::policy(&a.policy)?;
    if a.serve_requests == 0 || a.serve_requests > SERVE_REQUESTS_MAX {
        bail!("--serve-requests must be in 1..={SERVE_REQUESTS_MAX}");
    }
    if a.serve_rate.iter().any(|&r| !(r > 0.0 && r.is_finite())) {
        bail!("--serve-rate takes positive rates");
    }
    if a.serve_instances.iter().any(|&n| n == 0 || n > kairos_sched::MODELS_MAX) {
        bail!("--serve-instances takes counts in 1..={}", kairos_sched::MODELS_MAX);
    }
    let serve = !a.serve_instances.is_empty();
    if a.peer_gpus.is_empty() && strategies.iter().any(|s| s.is_parallel()) {
        eprintln!("cold: no --peer-gpus: the parallel strategies run as their one-GPU counterparts");
    }
    if a.peer_gpus.contains(&a.device) {
        bail!("--peer-gpus must not name --device ({})", a.device);
    }
    if !(a.serve_slo_ms > 0.0 && a.serve_slo_ms.is_finite()) {
        bail!("--serve-slo-ms must be positive");
    }
    if a.serve_gpus == 0 || a.serve_gpus > 16 {
        bail!("--serve-gpus must be in 1..=16");
    }
    if !(0.0..=1.0).contains(&a.serve_hot_share) {
        bail!("--serve-hot-share must be in 0..=1");
    }
    if a.serve_hot as f64 > a.serve_budget_instances * a.serve_gpus as f64 {
        bail!(
            "--serve-hot {} instances must stay resident: the budget holds {} copies per GPU on {} GPU(s)",
            a.serve_hot,
            a.serve_budget_instances,
            a.serve_gpus
        );
    }
    if a.peer_staging_mib == 0 || a.peer_staging_mib > 1 << 16 {
        bail!("--peer-staging-mib must be in 1..=65536");
    }
    match a.backend {
        Backend::Cuda => {
            let o = CudaOpener {
                device: a.device,
                autotune: !a.no_autotune,
                name: None,
                peers: a.peer_gpus.clone(),
                staging_bytes: a.peer_staging_mib << 20,
            };
            if serve { serve_all(&a, &strategies, o) } else { measure_all(&a, &strategies, o) }
        }
        Backend::Sim => {
            let desc = sim_desc(&a.sim_gpu)?;
            let o = SimOpener {
                desc,
                seed: a.seed,
                peers: a.peer_gpus.clone(),
                staging_bytes: a.peer_staging_mib << 20,
                forward_bytes_per_s: a.sim_forward_gbps * 1e9,
            };
            if serve { serve_all(&a, &strategies, o) } else { measure_all(&a, &strategies, o) }
        }
        Backend::Cpu => bail!("`bench cold` needs a GPU or the simulator (--backend cuda or sim)"),
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The 10th, 50th and 90th percentiles (rounded index) of nanoseconds, in milliseconds.
fn quantiles_ms(samples: &[u64]) -> Value {
    if samples.is_empty() {
        return Value::Null;
    }
    let mut v = samples.to_vec();
    v.sort_unstable();
    let q = |p: f64| rounded_index(&v, p).map(ms);
    json!({ "p10": q(10.0), "p50": q(50.0), "p90": q(90.0), "n": v.len() })
}

fn measure_all<O: Opener>(a: &ColdArgs, strategies: &[ColdStrategy], mut opener: O) -> Result<()> {
    let mut rows = Vec::new();
    let started = Instant::now();
    for model in &a.models {
        eprintln!("cold: {model}: lowering and tuning");
        let row = match measure_model(a, strategies, &mut opener, model) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cold: {model}: {e:#}");
                json!({ "model": model, "error": format!("{e:#}") })
            }
        };
        rows.push(row);
        write(a, &opener.device(), &rows, started.elapsed().as_secs_f64())?;
    }
    let text = table(&opener.device(), a, &rows);
    println!("{text}");
    Ok(())
}

fn write(a: &ColdArgs, device: &str, rows: &[Value], elapsed_s: f64) -> Result<()> {
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let doc = json!({
        "schema": "kairos-cold/1",
        "device": device,
        "dtype": format!("{:?}", a.dtype).to_lowercase(),
        "seq_len": a.seq_len,
        "policy": a.policy,
        "chunk_bytes": a.chunk_bytes,
        "reps": a.reps,
        "elapsed_s": elapsed_s,
        "models": rows,
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {}", a.out.display()))?;
    std::fs::write(a.out.with_extension("md"), table(device, a, rows))?;
    Ok(())
}

fn measure_model<O: Opener>(a: &ColdArgs, strategies: &[ColdStrategy], opener: &mut O, model: &str) -> Result<Value> {
    let (plan, profile) = prepare(a, opener, model)?;
    let blob_copy_ns: u64 = profile.layers.iter().map(|l| l.load_ns).sum();
    let input = cold::ColdInput::measured(&plan, &profile).map_err(|e| anyhow::anyhow!(e))?;
    let model_profile = profile_of(&plan, &profile, opener.device());
    let x = random_inputs(&plan, a.seed);
    let mut results = Vec::new();
    for &strategy in strategies {
        eprintln!("cold: {model}: {strategy}");
        let r = (|| -> Result<Value> {
            let gpu = opener.open()?;
            let peers = gpu.peer_paths();
            let input = if strategy.is_parallel() { input.clone().with_peers(&peers) } else { input.clone() };
            let cold_plan = cold::plan(&input, strategy);
            let mut cfg = Config::default().with_policy(PolicyConfig::by_name(&a.policy).context("policy")?);
            // Room for one instance's loaded layers, never two: every ask of the evicted instance is
            // a cold start (checked below).
            cfg.weight_budget_bytes = Some(cold_plan.load_bytes + cold_plan.load_bytes / 2 + (64 << 10));
            cfg.cold_strategy = strategy;
            cfg.cold_chunk_bytes = a.chunk_bytes;
            cfg.cold_copy_window_bytes = a.copy_window_bytes;
            let mut d = VirtualDriver::new(cfg, gpu)?;
            for name in ["other", "cold"] {
                d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: Some(model_profile.clone()) })?;
            }
            let ask = |d: &mut VirtualDriver<O::G>, name: &str| -> Result<(kairos_sched::Timing, Vec<Vec<u8>>)> {
                let now = d.now_ns();
                let id = d.submit_at(now, name, x.clone(), RequestOptions::default());
                d.run_until_idle()?;
                let r = d.take_records().into_iter().find(|r| r.id == id).context("no answer")?;
                let t = r.result.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
                Ok((t, r.outputs.iter().map(|t| t.to_bytes()).collect()))
            };
            // One untimed round: modules loaded, slots' first recordings done.
            ask(&mut d, "cold")?;
            ask(&mut d, "cold")?;
            ask(&mut d, "other")?;
            ask(&mut d, "other")?;
            let (mut cold_ns, mut warm_ns, mut first_warm_ns) = (Vec::new(), Vec::new(), Vec::new());
            // Per cold start: arrival to admission (the load started, and for load-then-run ended),
            // to its first launch issued, and the load's own time (first copy queued to last landed).
            let (mut admitted_ns, mut first_issue_ns, mut load_ns) = (Vec::new(), Vec::new(), Vec::new());
            let mut outputs_match = true;
            let mut last_outputs: Option<Vec<Vec<u8>>> = None;
            let mut not_cold = 0;
            for _ in 0..a.reps {
                let before = d.dispatcher().stats();
                let (c, out_cold) = ask(&mut d, "cold")?;
                let after = d.dispatcher().stats();
                not_cold += (after.cold_starts != before.cold_starts + 1) as u32;
                load_ns.push(after.load_ns - before.load_ns);
                // The first warm request after a load records the model's runs again.
                let (w1, _) = ask(&mut d, "cold")?;
                let (w, out_warm) = ask(&mut d, "cold")?;
                outputs_match &= out_cold == out_warm;
                last_outputs = Some(out_cold);
                cold_ns.push(c.latency_ns());
                admitted_ns.push(c.admitted_ns.saturating_sub(c.arrival_ns));
                first_issue_ns.push(c.first_issue_ns.saturating_sub(c.arrival_ns));
                first_warm_ns.push(w1.latency_ns());
                warm_ns.push(w.latency_ns());
                ask(&mut d, "other")?;
                ask(&mut d, "other")?;
            }
            let s = d.dispatcher().stats();
            let digest = last_outputs.as_ref().map(|o| digest(o));
            let copy_of_loaded_ns = (blob_copy_ns as f64 * cold_plan.load_bytes as f64 / plan.weight_bytes.max(1) as f64) as u64;
            Ok(json!({
                "strategy": strategy.to_string(),
                "cold_ms": quantiles_ms(&cold_ns),
                "warm_ms": quantiles_ms(&warm_ns),
                "first_warm_ms": quantiles_ms(&first_warm_ns),
                "cold_admitted_ms": quantiles_ms(&admitted_ns),
                "cold_first_issue_ms": quantiles_ms(&first_issue_ns),
                "load_ms": quantiles_ms(&load_ns),
                "cold_samples_ns": cold_ns,
                "warm_samples_ns": warm_ns,
                "outputs_match": outputs_match,
                "not_cold": not_cold,
                "outputs_digest": digest,
                "predicted_ms": cold_plan.predicted_ns / 1e6,
                "load_bytes": cold_plan.load_bytes,
                "host_bytes": cold_plan.host_bytes,
                "host_layers": cold_plan.host.iter().filter(|&&h| h).count(),
                "forwarded_bytes": cold_plan.forwarded_bytes,
                "peers": peers,
                "copy_of_loaded_ms": ms(copy_of_loaded_ns),
                "cold_starts": s.cold_starts,
                "evictions": s.evictions,
                "mean_load_ms": if s.loads_completed > 0 { s.load_ns as f64 / s.loads_completed as f64 / 1e6 } else { 0.0 },
            }))
        })();
        results.push(match r {
            Ok(v) => v,
            Err(e) => {
                eprintln!("cold: {model}: {strategy}: {e:#}");
                json!({ "strategy": strategy.to_string(), "error": format!("{e:#}") })
            }
        });
    }
    let deepplan = cold::plan(&input, ColdStrategy::DeepPlan);
    Ok(json!({
        "model": model,
        "weight_bytes": plan.weight_bytes,
        "launches": plan.launches.len(),
        "layers": plan.layers.len(),
        "blob_copy_ms": ms(blob_copy_ns),
        "profiling_ms": ms(profile.profiling_ns),
        "layer_profile": profile,
        "deepplan_explained": cold::explain(&input, &deepplan),
        "strategies": results,
    }))
}

/// FNV-1a of the outputs' bytes: strategies that compute the same bytes have the same digest.
fn digest(outputs: &[Vec<u8>]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in outputs.iter().flatten() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn table(device: &str, a: &ColdArgs, rows: &[Value]) -> String {
    let mut t = format!(
        "Cold inference, batch 1, {:?}, seq {} ({device}; policy {}; copies of >= {} KiB; {} reps; p50 ms)\n\n",
        a.dtype,
        a.seq_len,
        a.policy,
        a.chunk_bytes >> 10,
        a.reps
    );
    t += "| model | MB | blob copy | strategy | cold p50 | p90 | load p50 | warm p50 | copy of loaded | cold / copy | host MB | via peers MB | outputs |\n";
    t += "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
    for r in rows {
        let model = r["model"].as_str().unwrap_or("?");
        if let Some(e) = r["error"].as_str() {
            t += &format!("| {model} | | | error: {} | | | | | | | | | |\n", e.lines().next().unwrap_or(""));
            continue;
        }
        let mb = r["weight_bytes"].as_f64().unwrap_or(0.0) / 1e6;
        // Every strategy's answer against load-then-run's (all weights in device memory).
        let reference = r["strategies"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|s| (s["strategy"].as_str() == Some("load-then-run")).then(|| s["outputs_digest"].as_str()).flatten());
        let blob = r["blob_copy_ms"].as_f64().unwrap_or(0.0);
        for s in r["strategies"].as_array().into_iter().flatten() {
            let name = s["strategy"].as_str().unwrap_or("?");
            if let Some(e) = s["error"].as_str() {
                t += &format!(
                    "| {model} | {mb:.1} | {blob:.2} | {name}: error {} | | | | | | | | |\n",
                    e.lines().next().unwrap_or("")
                );
                continue;
            }
            let p = |k: &str, q: &str| s[k][q].as_f64().unwrap_or(f64::NAN);
            let copy = s["copy_of_loaded_ms"].as_f64().unwrap_or(f64::NAN);
            t += &format!(
                "| {model} | {mb:.1} | {blob:.2} | {name} | {:.2} | {:.2} | {:.2} | {:.2} | {copy:.2} | {:.2} | {:.1} | {:.1} | {} |\n",
                p("cold_ms", "p50"),
                p("cold_ms", "p90"),
                p("load_ms", "p50"),
                p("warm_ms", "p50"),
                p("cold_ms", "p50") / copy,
                s["host_bytes"].as_f64().unwrap_or(0.0) / 1e6,
                s["forwarded_bytes"].as_f64().unwrap_or(0.0) / 1e6,
                match (s["outputs_match"].as_bool(), reference, s["outputs_digest"].as_str()) {
                    (Some(true), Some(r), Some(d)) if r == d => "= warm = load-then-run",
                    (Some(true), None, _) => "= warm",
                    (Some(true), _, _) => "= warm, DIFFERS from load-then-run",
                    _ => "DIFFERS from warm",
                },
            );
        }
    }
    t
}

/// A profile holding only the layer profile (the dispatcher's estimates stay on the roofline).
fn profile_of(plan: &Plan, layers: &LayerProfile, device: String) -> ModelProfile {
    ModelProfile {
        model: plan.model.clone(),
        dtype: plan.dtype,
        batch: 1,
        device,
        sm_count: 0,
        latency_ns: 0,
        kernels: vec![],
        layers: Some(layers.clone()),
        placements: None,
    }
}

/// Lowers and tunes the model and measures its layer profile (what both experiments start from).
fn prepare<O: Opener>(a: &ColdArgs, opener: &mut O, model: &str) -> Result<(Arc<Plan>, LayerProfile)> {
    let spec = IrModelSpec { model: model.to_string(), batch: 1, seq_len: a.seq_len, seed: a.seed, dtype: a.dtype };
    let mut plan = spec.plan()?;
    if let Err(e) = opener.tune(&mut plan) {
        eprintln!("cold: {model}: autotune failed, keeping the lowering's tiles: {e:#}");
    }
    eprintln!("cold: {model}: layer profile ({} launches, {} layers)", plan.launches.len(), plan.layers.len());
    let mut gpu = opener.open()?;
    let profile = kairos_gpu::exec::profile_layers(&mut gpu, &plan, a.profile_reps)?;
    Ok((Arc::new(plan), profile))
}

/// DeepPlan's serving experiment (Sec. 5.3, Fig. 13) on one GPU: per strategy, rate and
/// instance count, Poisson arrivals over the instances, p50/p99, goodput at 50 and 100 ms, cold
/// starts; every request's latency kept.
fn serve_all<O: Opener>(a: &ColdArgs, strategies: &[ColdStrategy], mut opener: O) -> Result<()> {
    let model = a.models.first().context("--models names the model to serve")?.clone();
    let (plan, profile) = prepare(a, &mut opener, &model)?;
    let model_profile = profile_of(&plan, &profile, opener.device());
    let budget_bytes = (plan.weight_bytes as f64 * a.serve_budget_instances) as u64;
    let started = Instant::now();
    let mut points = Vec::new();
    for &rate in &a.serve_rate {
        for &n in &a.serve_instances {
            let runs: Vec<Option<ColdStrategy>> =
                a.serve_baseline.then_some(None).into_iter().chain(strategies.iter().map(|&s| Some(s))).collect();
            for strategy in runs {
                let label = strategy.map_or("resident".to_string(), |s| s.to_string());
                eprintln!("cold serve: {model} x{n} at {rate}/s, {label}");
                let gpus = a.serve_gpus;
                let mut openers: Vec<O> = (0..gpus)
                    .map(|g| {
                        let parallel = gpus > 1 && strategy.is_some_and(|s| s.is_parallel());
                        let peers = if parallel { (0..gpus).filter(|&o| o != g).collect() } else { Vec::new() };
                        if gpus == 1 { opener.for_gpu(a.device, a.peer_gpus.clone()) } else { opener.for_gpu(g, peers) }
                    })
                    .collect();
                let p =
                    serve_point(a, &mut openers, &plan, &model_profile, strategy, n, rate, budget_bytes).unwrap_or_else(|e| {
                        eprintln!("cold serve: {e:#}");
                        json!({ "strategy": label, "instances": n, "rate_per_s": rate, "error": format!("{e:#}") })
                    });
                points.push(p);
                let doc = json!({
                    "schema": "kairos-cold-serve/1",
                    "device": opener.device(),
                    "model": model,
                    "dtype": format!("{:?}", a.dtype).to_lowercase(),
                    "seq_len": a.seq_len,
                    "policy": a.policy,
                    "eviction": a.eviction.to_string(),
                    "copy_window_bytes": a.copy_window_bytes,
                    "hot_instances": a.serve_hot,
                    "hot_share": a.serve_hot_share,
                    "budget_bytes": budget_bytes,
                    "budget_instances": a.serve_budget_instances,
                    "gpus": a.serve_gpus,
                    "slo_ms": a.serve_slo_ms,
                    "weight_bytes": plan.weight_bytes,
                    "elapsed_s": started.elapsed().as_secs_f64(),
                    "points": points,
                });
                if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                std::fs::write(&a.out, serde_json::to_string(&doc)?)?;
                std::fs::write(a.out.with_extension("md"), serve_table(&doc))?;
            }
        }
    }
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&a.out)?)?;
    println!("{}", serve_table(&doc));
    Ok(())
}

/// What one GPU's dispatcher of a serving point answered.
struct GpuServed {
    /// [instance, arrival after the start (ns), latency (ns), answered, cold start] per request.
    records: Vec<(String, u64, u64, bool, bool)>,
    /// From the start to the last completion.
    span_ns: u64,
    cold_starts: u64,
    evictions: u64,
    /// Loads that copied a secondary's part here because its link was busy.
    secondary_busy_loads: u64,
    /// The most bytes of load copies on the copy engine at once, and copies brought forward.
    copy_bytes_in_flight_max: u64,
    copies_forced: u64,
    /// Runs recorded during the point (again after reloads) and the host time that took.
    runs_recorded: u64,
    run_record_ns: u64,
    resident_at_start: usize,
    load_s: f64,
    /// Secondaries attached.
    peers: Vec<kairos_gpu::PeerPath>,
}

/// One GPU of a serving point: its instances (k mod gpus == gpu) loaded, then at `start` (a
/// barrier: every GPU starts its clock together) the arrivals of its instances submitted and run;
/// then `end` (a barrier) before its dispatcher and GPU are released: a GPU tearing down (freeing
/// gigabytes of pinned host memory takes the driver's locks for up to a second, measured) must
/// not stall another GPU's last requests.
#[allow(clippy::too_many_arguments)]
fn serve_gpu<O: Opener>(
    a: &ColdArgs,
    opener: &mut O,
    cfg: Config,
    plan: &Arc<Plan>,
    profile: &ModelProfile,
    gpu: usize,
    gpus: usize,
    instances: usize,
    arrivals: &[(u64, usize)],
    start: &std::sync::Barrier,
    end: &std::sync::Barrier,
) -> Result<GpuServed> {
    let resident = cfg.weight_budget_bytes.is_none();
    let prepared = (|| -> Result<_> {
        let gpu_handle = opener.open()?;
        let peers = gpu_handle.peer_paths();
        let mut d = VirtualDriver::new(cfg, gpu_handle)?;
        let t_load = Instant::now();
        let mine: Vec<usize> = (0..instances).filter(|k| k % gpus == gpu).collect();
        for &k in &mine {
            d.load_model(ModelSpec { name: format!("i{k}"), plan: plan.clone(), profile: Some(profile.clone()) })?;
        }
        let resident_at_start = if resident {
            mine.len()
        } else {
            mine.iter()
                .filter(|k| d.dispatcher().residency_of(&format!("i{k}")) == Some(kairos_sched::ResidencyState::Resident))
                .count()
        };
        Ok((d, peers, t_load.elapsed().as_secs_f64(), resident_at_start))
    })();
    // Every GPU reaches both barriers, also one that failed (the others would wait forever).
    start.wait();
    let (mut d, peers, load_s, resident_at_start) = match prepared {
        Ok(p) => p,
        Err(e) => {
            end.wait();
            return Err(e);
        }
    };
    let start_ns = d.now_ns() + 50_000_000;
    // Real inputs copied in and outputs copied out, as a server does.
    let x = random_inputs(plan, a.seed);
    for &(at, k) in arrivals.iter().filter(|&&(_, k)| k % gpus == gpu) {
        d.submit_at(start_ns + at, &format!("i{k}"), x.clone(), RequestOptions::default());
    }
    let before = d.dispatcher().stats();
    let ran = d.run_until_idle();
    end.wait();
    ran?;
    let after = d.dispatcher().stats();
    let records = d.take_records();
    let span_ns = records.iter().map(|r| r.done_ns).max().unwrap_or(start_ns).saturating_sub(start_ns);
    let records = records
        .iter()
        .map(|r| {
            let cold = r.result.as_ref().is_ok_and(|t| t.cold_start);
            (r.model.to_string(), r.arrival_ns.saturating_sub(start_ns), r.latency_ns(), r.result.is_ok(), cold)
        })
        .collect();
    Ok(GpuServed {
        records,
        span_ns,
        cold_starts: after.cold_starts - before.cold_starts,
        evictions: after.evictions - before.evictions,
        secondary_busy_loads: after.secondary_busy_loads - before.secondary_busy_loads,
        copy_bytes_in_flight_max: after.load_copy_bytes_in_flight_max,
        copies_forced: after.load_copies_forced - before.load_copies_forced,
        runs_recorded: after.runs_recorded - before.runs_recorded,
        run_record_ns: after.run_record_ns - before.run_record_ns,
        resident_at_start,
        load_s,
        peers,
    })
}

/// Seeded arrivals of a serving point, (ns after the start, instance): exponential gaps at `rate`
/// per second; instances uniform, or with `hot` > 0 the first `hot` take `hot_share` of them
/// (uniform among them) and the others the rest.
fn serve_arrivals(seed: u64, requests: usize, rate: f64, instances: usize, hot: usize, hot_share: f64) -> Vec<(u64, usize)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut at = 0.0f64;
    let hot = hot.min(instances);
    (0..requests)
        .map(|_| {
            let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            at += -u.ln() / rate * 1e9;
            let k = if hot == 0 || hot == instances {
                rng.random_range(0..instances)
            } else if rng.random_bool(hot_share) {
                rng.random_range(0..hot)
            } else {
                rng.random_range(hot..instances)
            };
            (at as u64, k)
        })
        .collect()
}

/// One serving point on `openers.len()` GPUs: one seeded Poisson stream over the instances,
/// instance k on GPU k mod N, each GPU's dispatcher in a thread of its own.
#[allow(clippy::too_many_arguments)]
fn serve_point<O: Opener>(
    a: &ColdArgs,
    openers: &mut [O],
    plan: &Arc<Plan>,
    profile: &ModelProfile,
    strategy: Option<ColdStrategy>,
    instances: usize,
    rate: f64,
    budget_bytes: u64,
) -> Result<Value> {
    let mut cfg = Config::default().with_policy(PolicyConfig::by_name(&a.policy).context("policy")?);
    // None: the resident reference, no budget.
    cfg.weight_budget_bytes = strategy.map(|_| budget_bytes);
    cfg.cold_strategy = strategy.unwrap_or_default();
    cfg.cold_chunk_bytes = a.chunk_bytes;
    cfg.cold_copy_window_bytes = a.copy_window_bytes;
    cfg.eviction = a.eviction;
    // Many instances: one I/O slot each at load, a few more on demand.
    cfg.slots_per_model_prealloc = 1;
    cfg.slots_per_model_max = 4;
    cfg.models_max = instances.max(1);
    cfg.jobs_max = a.serve_requests.clamp(1, kairos_sched::JOBS_MAX);
    let seed = a.seed ^ (instances as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ rate.to_bits();
    let arrivals = serve_arrivals(seed, a.serve_requests, rate, instances, a.serve_hot, a.serve_hot_share);
    let gpus = openers.len();
    let (barrier, end) = (std::sync::Barrier::new(gpus), std::sync::Barrier::new(gpus));
    let served: Vec<Result<GpuServed>> = std::thread::scope(|scope| {
        let handles: Vec<_> = openers
            .iter_mut()
            .enumerate()
            .map(|(g, opener)| {
                let (cfg, arrivals, barrier, end) = (cfg.clone(), &arrivals, &barrier, &end);
                scope.spawn(move || serve_gpu(a, opener, cfg, plan, profile, g, gpus, instances, arrivals, barrier, end))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a GPU's thread panicked")))).collect()
    });
    let served: Vec<GpuServed> = served.into_iter().collect::<Result<_>>()?;
    let records: Vec<&(String, u64, u64, bool, bool)> = served.iter().flat_map(|g| &g.records).collect();
    let mut latency_ns = Vec::with_capacity(records.len());
    let (mut warm_ns, mut cold_ns, mut hot_warm_ns) = (Vec::new(), Vec::new(), Vec::new());
    let (mut hot_requests, mut hot_cold) = (0usize, 0usize);
    let mut failed = 0usize;
    let mut raw = Vec::with_capacity(records.len());
    let is_hot = |model: &str| model.strip_prefix('i').and_then(|k| k.parse::<usize>().ok()).is_some_and(|k| k < a.serve_hot);
    for &(model, arrival, latency, ok, cold) in &records {
        let hot = is_hot(model);
        hot_requests += hot as usize;
        hot_cold += (hot && *cold) as usize;
        if *ok {
            latency_ns.push(*latency);
            if *cold { &mut cold_ns } else { &mut warm_ns }.push(*latency);
            if hot && !*cold {
                hot_warm_ns.push(*latency);
            }
        } else {
            failed += 1;
        }
        // [instance, arrival after the first (ns), latency (ns), answered, cold start]
        raw.push(json!([model, arrival, latency, ok, cold]));
    }
    let cold_starts: u64 = served.iter().map(|g| g.cold_starts).sum();
    let evictions: u64 = served.iter().map(|g| g.evictions).sum();
    let secondary_busy_loads: u64 = served.iter().map(|g| g.secondary_busy_loads).sum();
    let copy_bytes_max: u64 = served.iter().map(|g| g.copy_bytes_in_flight_max).max().unwrap_or(0);
    let copies_forced: u64 = served.iter().map(|g| g.copies_forced).sum();
    let runs_recorded: u64 = served.iter().map(|g| g.runs_recorded).sum();
    let run_record_ns: u64 = served.iter().map(|g| g.run_record_ns).sum();
    // The longest time in which no request completed (a stall of the dispatcher or the GPU).
    let mut done_ns: Vec<u64> = records.iter().filter(|r| r.3).map(|r| r.1 + r.2).collect();
    done_ns.sort_unstable();
    let completion_gap_max_ns = done_ns.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    hot_warm_ns.sort_unstable();
    let resident_at_start: usize = served.iter().map(|g| g.resident_at_start).sum();
    let load_s = served.iter().map(|g| g.load_s).fold(0.0, f64::max);
    let span_s = served.iter().map(|g| g.span_ns).max().unwrap_or(0) as f64 / 1e9;
    let peers: Vec<Vec<kairos_gpu::PeerPath>> = served.iter().map(|g| g.peers.clone()).collect();
    let p99_of = |v: &mut Vec<u64>| {
        v.sort_unstable();
        rounded_index(v.as_slice(), 99.0).map(ms)
    };
    let n = records.len().max(1) as f64;
    let good = |slo_ms: f64| latency_ns.iter().filter(|&&l| (l as f64) <= slo_ms * 1e6).count() as f64 / n;
    let mut sorted = latency_ns.clone();
    sorted.sort_unstable();
    let q = |p: f64| rounded_index(&sorted, p).map(ms);
    Ok(json!({
        "strategy": strategy.map_or("resident".to_string(), |s| s.to_string()),
        "instances": instances,
        "rate_per_s": rate,
        "requests": records.len(),
        "warm_p99_ms": p99_of(&mut warm_ns),
        "cold_p99_ms": p99_of(&mut cold_ns),
        "warm_requests": warm_ns.len(),
        "hot_instances": a.serve_hot.min(instances),
        "hot_requests": hot_requests,
        "hot_cold_starts": hot_cold,
        "hot_warm_p50_ms": rounded_index(&hot_warm_ns, 50.0).map(ms),
        "hot_warm_p99_ms": rounded_index(&hot_warm_ns, 99.0).map(ms),
        "copy_window_bytes": a.copy_window_bytes,
        "copy_bytes_in_flight_max": copy_bytes_max,
        "copies_forced": copies_forced,
        "eviction": a.eviction.to_string(),
        "runs_recorded": runs_recorded,
        "run_record_ms": ms(run_record_ns),
        "completion_gap_max_ms": ms(completion_gap_max_ns),
        "failed": failed,
        "served_per_s": latency_ns.len() as f64 / span_s.max(1e-9),
        "p50_ms": q(50.0),
        "p99_ms": q(99.0),
        "max_ms": q(100.0),
        "goodput_100ms": good(100.0),
        "goodput_50ms": good(50.0),
        "goodput_slo": good(a.serve_slo_ms),
        "gpus": gpus,
        "peers": peers,
        "cold_starts": cold_starts,
        "cold_start_rate": cold_starts as f64 / n,
        "evictions": evictions,
        "secondary_busy_loads": secondary_busy_loads,
        "resident_at_start": resident_at_start,
        "load_s": load_s,
        "records": raw,
    }))
}

fn serve_table(doc: &Value) -> String {
    let mut t = format!(
        "Serving instances of {} (Poisson, {}; {} x {}, instance k on GPU k mod {}; weight budget {:.0} MB = {} \
         copies per GPU; policy {}; eviction {}; copy window {} bytes)\n\n",
        doc["model"].as_str().unwrap_or("?"),
        match doc["hot_instances"].as_u64().unwrap_or(0) {
            0 => "uniform over instances".to_string(),
            k => format!(
                "{:.0}% over the first {k} instances, the rest over the others",
                100.0 * doc["hot_share"].as_f64().unwrap_or(0.0)
            ),
        },
        doc["gpus"].as_u64().unwrap_or(1),
        doc["device"].as_str().unwrap_or("?"),
        doc["gpus"].as_u64().unwrap_or(1),
        doc["budget_bytes"].as_f64().unwrap_or(0.0) / 1e6,
        doc["budget_instances"],
        doc["policy"].as_str().unwrap_or("?"),
        doc["eviction"].as_str().unwrap_or("lru"),
        doc["copy_window_bytes"],
    );
    t += &format!(
        "| rate /s | instances | strategy | served /s | p50 ms | p99 ms | warm p99 ms | cold p99 ms | goodput 100 ms | goodput 50 ms | \
         goodput {} ms | cold-start rate | resident at start | hot warm p50 / p99 ms (n) |\n",
        doc["slo_ms"].as_f64().unwrap_or(f64::NAN)
    );
    t += "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for p in doc["points"].as_array().into_iter().flatten() {
        let f = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
        if let Some(e) = p["error"].as_str() {
            t += &format!(
                "| {} | {} | {} | error: {} | | | | | | | | | | |\n",
                f("rate_per_s"),
                p["instances"],
                p["strategy"].as_str().unwrap_or("?"),
                e.lines().next().unwrap_or("")
            );
            continue;
        }
        t += &format!(
            "| {:.0} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} | {} | {} |\n",
            f("rate_per_s"),
            p["instances"],
            p["strategy"].as_str().unwrap_or("?"),
            f("served_per_s"),
            f("p50_ms"),
            f("p99_ms"),
            f("warm_p99_ms"),
            f("cold_p99_ms"),
            f("goodput_100ms"),
            f("goodput_50ms"),
            f("goodput_slo"),
            f("cold_start_rate"),
            p["resident_at_start"],
            if p["hot_instances"].as_u64().unwrap_or(0) > 0 {
                format!("{:.2} / {:.2} ({})", f("hot_warm_p50_ms"), f("hot_warm_p99_ms"), p["hot_requests"].as_u64().unwrap_or(0))
            } else {
                "-".to_string()
            },
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::{serve_arrivals, serve_table};
    use serde_json::json;

    #[test]
    fn the_serving_table_says_how_arrivals_were_spread_and_shows_the_hot_requests() {
        let point = json!({"rate_per_s": 300.0, "instances": 32, "strategy": "deepplan", "served_per_s": 297.5, "p50_ms": 2.3,
            "p99_ms": 8.1, "warm_p99_ms": 4.5, "cold_p99_ms": 10.1, "goodput_100ms": 1.0, "goodput_50ms": 1.0, "goodput_slo": 0.93,
            "cold_start_rate": 0.16, "resident_at_start": 12, "hot_instances": 4, "hot_requests": 1557, "hot_warm_p50_ms": 2.15,
            "hot_warm_p99_ms": 4.19});
        let doc = json!({"model": "bert_base", "gpus": 1, "device": "GPU", "budget_bytes": 2.172e9, "budget_instances": 10.0,
            "policy": "paella", "eviction": "lru2", "copy_window_bytes": 4194304, "hot_instances": 4, "hot_share": 0.8,
            "slo_ms": 5.0, "points": [point]});
        let t = serve_table(&doc);
        assert!(t.contains("80% over the first 4 instances"), "{t}");
        assert!(t.contains("eviction lru2; copy window 4194304 bytes"), "{t}");
        assert!(t.contains("| 12 | 2.15 / 4.19 (1557) |"), "{t}");
        let uniform = serve_table(&json!({"hot_instances": 0, "points": [{"rate_per_s": 1.0, "hot_instances": 0}]}));
        assert!(uniform.contains("uniform over instances") && uniform.trim_end().ends_with("| - |"), "{uniform}");
    }

    #[test]
    fn hot_instances_take_their_share_of_the_arrivals() {
        let seed = 7;
        let a = serve_arrivals(seed, 20_000, 500.0, 32, 4, 0.8);
        let hot = a.iter().filter(|&&(_, k)| k < 4).count() as f64 / a.len() as f64;
        assert!((hot - 0.8).abs() < 0.02, "hot share {hot} (seed {seed})");
        assert!(a.iter().all(|&(_, k)| k < 32));
        // Every cold instance is asked, and the rate is the one asked for (20 000 at 500/s: ~40 s).
        assert!((4..32).all(|i| a.iter().any(|&(_, k)| k == i)));
        let span_s = a.last().unwrap().0 as f64 / 1e9;
        assert!((span_s - 40.0).abs() < 2.0, "span {span_s} s");
        assert!(a.windows(2).all(|w| w[0].0 <= w[1].0), "arrivals in time order");
        // No hot instances: uniform over all of them.
        let u = serve_arrivals(seed, 20_000, 500.0, 32, 0, 0.8);
        let low = u.iter().filter(|&&(_, k)| k < 4).count() as f64 / u.len() as f64;
        assert!((low - 4.0 / 32.0).abs() < 0.02, "share of the first 4 without hot ones: {low}");
        assert_eq!(
            serve_arrivals(seed, 100, 50.0, 8, 2, 0.5),
            serve_arrivals(seed, 100, 50.0, 8, 2, 0.5),
            "one seed, one stream"
        );
    }
}

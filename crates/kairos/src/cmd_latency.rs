//! `kairos bench latency`: isolated latency of each zoo model at the chosen batch sizes, kairos
//! issuing every kernel itself through its dispatcher (whole-job policies replay each job's
//! launches but the last as a CUDA graph recorded by kairos: `Config::record_runs`; kernel-level
//! ones each segment of a job so: `Config::run_segment_ns`), beside the PyTorch peer
//! (eager and CUDA-graph replay, `scripts/pytorch_peer.py`) when its JSON is given.
//!
//! On the GPU (`--backend cuda`) kairos runs as an application embeds it: one in-process
//! [`Engine`] (dispatcher thread, bounded queue), and the client submits one request, waits for
//! its response, and repeats. Latency is the client's wall time from `submit` to the response,
//! so it includes the hand-off to the dispatcher thread and every kernel issue. The first
//! `--warmup` requests of each model copy real inputs in (they fill the request buffers and warm
//! the caches) and are not counted; the timed ones run with inputs already resident (`--io skip`,
//! as PyTorch's peer keeps its input on the GPU) or copy them in and out (`--io copy`).
//!
//! On the GPU each plan's convolution and matrix-product tiles are first chosen by the autotuner
//! (`kairos_cuda::autotune_plan`, on a second handle of the same device while the engine is idle;
//! choices cached next to the CUBIN cache, so a second run times nothing), unless `--no-autotune`.
//!
//! On the simulator (`--backend sim`) the same dispatcher runs in virtual time with the simulated
//! GPU's measured profiles (roofline kernel times where no profile matches the batch), so a run
//! is deterministic and needs no GPU.
//!
//! Results: `latency.json` and `latency.md` under `--out`, one table per batch size with a
//! geometric-mean row; the markdown is printed on stdout, progress on stderr. A model that fails
//! (lowering, out of memory, a GPU error) is a row saying so, not the end of the run.
//!
//! This file parses the arguments and builds the runner (the CUDA engine and autotuner, or the
//! simulator); the measurement, summaries and outputs are `kairos_bench::latency`.

use crate::cmd_run::{Backend, random_inputs, sim_desc};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kairos_bench::latency::{self, EngineRunner, LatencyOptions, Peers, Report, Runner, SimRunner};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::DType;
use kairos_sched::{Config, Engine, EngineConfig};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Io {
    /// Timed requests run on inputs already in their buffers and copy nothing out (like the peer).
    Skip,
    /// Timed requests copy their inputs in and their outputs out.
    Copy,
}

#[derive(Args, Debug)]
pub struct LatencyArgs {
    /// cuda (the GPU, wall clock at the client) or sim (the simulated GPU, virtual time).
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "cuda")]
    pub backend: Backend,
    /// Batch sizes, comma-separated; one table each.
    #[arg(long, env = "KAIROS_LATENCY_BATCH", value_delimiter = ',', default_value = "1,8")]
    pub batch: Vec<usize>,
    /// Models, comma-separated (default: the whole zoo).
    #[arg(long, env = "KAIROS_LATENCY_MODELS", value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// Sequence length of the transformer models.
    #[arg(long, env = "KAIROS_SEQ_LEN", default_value_t = kairos_ir::zoo::DEFAULT_SEQ_LEN)]
    pub seq_len: usize,
    #[arg(long, env = "KAIROS_DTYPE", default_value = "f16", value_parser = crate::model_args::parse_dtype)]
    pub dtype: DType,
    /// The dispatcher's policy (fifo: whole requests on one stream, each kernel issued by kairos).
    #[arg(long, env = "KAIROS_LATENCY_POLICY", default_value = "fifo")]
    pub policy: String,
    /// Timed requests per model and batch (fewer when --budget-s runs out first).
    #[arg(long, env = "KAIROS_LATENCY_REQUESTS", default_value_t = 50)]
    pub requests: usize,
    /// Untimed warm-up requests per model and batch (with real inputs copied in).
    #[arg(long, env = "KAIROS_LATENCY_WARMUP", default_value_t = 5)]
    pub warmup: usize,
    /// Wall-time budget of the timed requests of one model and batch, in seconds.
    #[arg(long, env = "KAIROS_LATENCY_BUDGET_S", default_value_t = 20.0)]
    pub budget_s: f64,
    /// Input and output copies of the timed requests.
    #[arg(long, value_enum, env = "KAIROS_LATENCY_IO", default_value = "skip")]
    pub io: Io,
    /// JSON of scripts/pytorch_peer.py to put side by side (repeatable; rows matched by model and batch).
    #[arg(long, env = "KAIROS_LATENCY_PEER", value_delimiter = ',')]
    pub peer: Vec<PathBuf>,
    /// Folder for latency.json and latency.md.
    #[arg(long, env = "KAIROS_LATENCY_OUT", default_value = "out/latency")]
    pub out: PathBuf,
    /// CUDA device ordinal (cuda backend).
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
    /// The simulated GPU (sim backend): h100-sxm, h100-pcie, h200, or a description file (.json, as data/gpus/).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h200")]
    pub sim_gpu: String,
    /// Measured profiles (the dispatcher's estimates; the simulator's kernel times). Default: the
    /// simulated GPU's folder under data/profiles (sim), the device's (cuda), beside the installation.
    #[arg(long, env = "KAIROS_PROFILES")]
    pub profiles: Option<PathBuf>,
    /// Keep the lowering's tiles (cuda backend): skip the autotuner at load.
    #[arg(long, env = "KAIROS_LATENCY_NO_AUTOTUNE")]
    pub no_autotune: bool,
    /// Time the autotuner may spend timing new shapes of one model and batch, in seconds (shapes
    /// left keep the lowering's tiles and are tuned on a later run).
    #[arg(long, env = "KAIROS_LATENCY_AUTOTUNE_BUDGET_S", default_value_t = 30.0)]
    pub autotune_budget_s: f64,
    /// Seed of the zoo's weights, the random inputs and the simulator.
    #[arg(long, env = "KAIROS_SEED", default_value_t = kairos_ir::zoo::DEFAULT_SEED)]
    pub seed: u64,
}

impl From<Io> for latency::Io {
    fn from(io: Io) -> latency::Io {
        match io {
            Io::Skip => latency::Io::Skip,
            Io::Copy => latency::Io::Copy,
        }
    }
}

impl LatencyArgs {
    fn options(&self) -> LatencyOptions {
        LatencyOptions {
            backend: format!("{:?}", self.backend).to_lowercase(),
            batch: self.batch.clone(),
            models: self.models.clone(),
            seq_len: self.seq_len,
            dtype: self.dtype,
            policy: self.policy.clone(),
            requests: self.requests,
            warmup: self.warmup,
            budget_s: self.budget_s,
            io: self.io.into(),
            seed: self.seed,
        }
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The in-process engine on CUDA device `device`, its GPU's name as the tables give it, and the
/// autotuner (`None`: keep the lowering's tiles).
fn engine_runner(config: EngineConfig, device: u32, tune: Option<kairos_cuda::TuneOptions>) -> Result<EngineRunner> {
    let start = move || -> Result<Engine> {
        Engine::start(config.clone(), move || kairos_cuda::CudaGpu::new(device)).with_context(|| {
            format!("cannot start kairos on CUDA device {device}: `bench latency --backend cuda` needs an NVIDIA GPU and driver (use --backend sim without one)")
        })
    };
    let engine = start()?;
    let info = engine.device();
    let overlap_capable = info.arch.strip_prefix("sm_").and_then(|a| a.parse::<u32>().ok()).is_some_and(|cc| cc >= 90);
    let overlap_on = kairos_cuda::settings().overlap_launches;
    // Named in the table when launches overlap (opt-in on sm_90+).
    let mut name = if overlap_capable && overlap_on {
        format!("{} (overlapped launches: KAIROS_OVERLAP_LAUNCHES=1)", info.name)
    } else {
        info.name.clone()
    };
    // And when plans are lowered with split-K (opt-in).
    if kairos_ir::lower::LowerOptions::new(kairos_ir::DType::F16).split_k {
        name = format!("{name} (split-K: KAIROS_SPLIT_K=1)");
    }
    let tune = tune.map(|opts| -> latency::Tune {
        // A second handle of the device for the autotuner, on this thread (the engine's GPU lives
        // on the dispatcher thread); opened at the first tuning and kept.
        let mut tuner: Option<kairos_cuda::CudaGpu> = None;
        Box::new(move |plan| {
            let opts = kairos_cuda::TuneOptions { dtypes: vec![plan.dtype], ..opts.clone() };
            if tuner.is_none() {
                tuner = Some(kairos_cuda::CudaGpu::new(device).context("opening the GPU for the autotuner")?);
            }
            let gpu = tuner.as_mut().expect("just opened");
            let r = kairos_cuda::autotune_plan(gpu, plan, &opts)?;
            Ok(json!({
                "shapes": r.shapes,
                "timed": r.timed,
                "from_table": r.from_table,
                "launches_changed": r.launches_changed,
                "plan_kernel_ms": ms(r.plan_kernel_ns),
                "tuned_kernel_ms": ms(r.tuned_kernel_ns),
                "elapsed_ms": r.elapsed_ms,
            }))
        })
    });
    Ok(EngineRunner::new(engine, Box::new(start), name, tune))
}

fn build_runner(a: &LatencyArgs) -> Result<(Box<dyn Runner>, ProfileSet)> {
    let config = Config { policy: latency::policy(&a.policy)?, ..Config::default() };
    Ok(match a.backend {
        Backend::Cpu => bail!("bench latency measures a GPU: use --backend cuda, or --backend sim for the simulated one"),
        Backend::Sim => {
            let desc = sim_desc(&a.sim_gpu)?;
            let dir = a.profiles.clone().unwrap_or_else(|| crate::paths::profile_dir(&desc.key));
            let profiles = ProfileSet::load_dir(&dir).map_err(anyhow::Error::msg)?;
            eprintln!("{} measured profiles from {} (roofline kernel times for the rest)", profiles.models.len(), dir.display());
            let gpu = kairos_sim::SimGpu::new(desc, kairos_sim::SimOptions::timing_only(a.seed));
            (Box::new(SimRunner::new(config, gpu)?), profiles)
        }
        Backend::Cuda => {
            let dir = a.profiles.clone().unwrap_or_else(|| crate::paths::cuda_profile_dir(a.device));
            let profiles = ProfileSet::load_dir(&dir).map_err(anyhow::Error::msg)?;
            let tune = (!a.no_autotune).then(|| kairos_cuda::TuneOptions {
                progress: false,
                time_budget_ms: (a.autotune_budget_s.max(0.0) * 1e3) as u64,
                ..kairos_cuda::TuneOptions::default()
            });
            let runner = engine_runner(EngineConfig { dispatcher: config, ..EngineConfig::default() }, a.device, tune)?;
            (Box::new(runner), profiles)
        }
    })
}

/// Measures with the runner the arguments ask for; the report, not yet written.
fn measure_all(a: &LatencyArgs) -> Result<Report> {
    let peers = if a.peer.is_empty() { None } else { Some(Peers::read(&a.peer)?) };
    let (mut runner, profiles) = build_runner(a)?;
    latency::run_all(runner.as_mut(), &a.options(), &profiles, peers.as_ref(), random_inputs)
}

pub fn run(a: LatencyArgs) -> Result<()> {
    let t0 = Instant::now();
    let report = measure_all(&a)?;
    let (json_path, md_path) = report.write(&a.out)?;
    eprintln!("wrote {} and {} in {:.1} s", json_path.display(), md_path.display(), t0.elapsed().as_secs_f64());
    println!("{}", report.markdown);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::Value;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: LatencyArgs,
    }

    fn repo() -> PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// `bench latency` end to end on the simulated H200 for one small model: one table per batch,
    /// one row per model plus the geometric mean, the same shape in the JSON.
    #[test]
    fn latency_on_the_simulator_gives_one_table_per_batch() {
        let out = std::env::temp_dir().join(format!("kairos-latency-test-{}", std::process::id()));
        let profiles = repo().join("data/profiles/h200");
        let cli = Cli::parse_from([
            "latency",
            "--backend",
            "sim",
            "--models",
            "squeezenet1_1",
            "--batch",
            "1,2",
            "--requests",
            "4",
            "--warmup",
            "1",
            "--profiles",
            profiles.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let a = cli.a;
        let (_, set) = build_runner(&a).unwrap();
        assert!(set.find("squeezenet1_1", DType::F16, 1).is_some(), "the H200 profiles are in the repository");
        let report = measure_all(&a).unwrap();

        let tables = report.json["tables"].as_array().unwrap();
        assert_eq!(tables.len(), 2);
        for (t, batch) in tables.iter().zip([1, 2]) {
            assert_eq!(t["batch"], batch);
            let rows = t["rows"].as_array().unwrap();
            assert_eq!(rows.len(), 1);
            let r = &rows[0];
            assert_eq!(r["error"], Value::Null, "{r}");
            assert_eq!(r["requests"], 4);
            let kernels = r["kernels_per_forward"].as_f64().unwrap();
            assert!(kernels > 10.0);
            assert_eq!(r["launches_per_request"].as_f64().unwrap(), kernels, "fifo issues each kernel once");
            let (p50, p99) = (r["p50_ms"].as_f64().unwrap(), r["p99_ms"].as_f64().unwrap());
            assert!(p50 > 0.0 && p50 <= p99, "{r}");
            assert_eq!(t["geomean"]["models"].as_array().unwrap().len(), 1);
        }
        // Batch 1 runs on the measured H200 profile, batch 2 (no profile) on the roofline: the
        // tables say which, since their times are not comparable.
        let sections: Vec<&str> = report.markdown.split("### Batch ").skip(1).collect();
        assert!(sections[0].contains("measured profiles for squeezenet1_1"), "{}", sections[0]);
        assert!(sections[1].contains("roofline for squeezenet1_1"), "{}", sections[1]);

        // The markdown: per batch a heading and a table of header, rule, one row, geometric mean.
        let tables_md: Vec<Vec<&str>> =
            report.markdown.split("### Batch ").skip(1).map(|t| t.lines().filter(|l| l.starts_with('|')).collect()).collect();
        assert_eq!(tables_md.len(), 2);
        for t in &tables_md {
            assert_eq!(t.len(), 4, "{t:?}");
            let columns = t[0].matches('|').count();
            assert!(t.iter().all(|l| l.matches('|').count() == columns), "{t:?}");
            assert!(t[2].starts_with("| squeezenet1_1 |"));
            assert!(t[3].starts_with("| **geometric mean** (1 model)"));
        }
        assert!(report.markdown.contains("simulated"));
    }

    #[test]
    fn the_cpu_backend_is_refused() {
        let cli = Cli::parse_from(["latency", "--backend", "cpu"]);
        let err = build_runner(&cli.a).err().expect("refused");
        assert!(err.to_string().contains("--backend cuda"), "{err}");
    }
}

//! `kairos run`: one request through a model on the CPU reference, the simulator, or the GPU.

use crate::model_args::ModelArgs;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kairos_gpu::{Gpu, MemKind, exec};
use kairos_ir::plan::Plan;
use kairos_ir::tensor::{relative_l2_error, rms};
use kairos_ir::{DType, Tensor, npy};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The CPU reference kernels (the oracle; no GPU needed).
    Cpu,
    /// The simulated GPU (results from the CPU kernels, time in simulated nanoseconds).
    Sim,
    /// A real NVIDIA GPU through the CUDA driver.
    Cuda,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "cpu")]
    pub backend: Backend,
    /// Input tensors as .npy files, in the model's input order (random inputs when none are given).
    #[arg(long = "input", short = 'i')]
    pub inputs: Vec<PathBuf>,
    /// Where to write the first output as .npy (further outputs get a _1, _2... suffix).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Also run the model with tract (the independent ONNX oracle) and report the relative error.
    #[arg(long)]
    pub check: bool,
    /// The simulated GPU: h100-sxm, h100-pcie, h200, or a description file (.json, as data/gpus/).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    /// CUDA device ordinal.
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
    /// Run through the dispatcher with this policy (sim and cuda backends): `--requests` copies of
    /// the request at once, so their kernels interleave on the GPU; every copy must return the
    /// same outputs (without it, the plan runs launch after launch on one stream).
    #[arg(long)]
    pub policy: Option<String>,
    /// Copies of the request submitted at once with `--policy`.
    #[arg(long, default_value_t = 4)]
    pub requests: usize,
}

/// Random inputs for a plan: uniform floats in [-1, 1], token ids in [0, 1000).
pub fn random_inputs(plan: &Plan, seed: u64) -> Vec<Tensor> {
    let mut rng = SmallRng::seed_from_u64(seed);
    plan.inputs
        .iter()
        .map(|i| {
            let n: usize = i.shape.iter().product();
            match i.dtype {
                DType::I64 => Tensor::i64(i.shape.clone(), (0..n).map(|_| rng.random_range(0..1000)).collect()),
                d => Tensor::f32(i.shape.clone(), (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()).cast(d),
            }
        })
        .collect()
}

pub fn sim_desc(name: &str) -> Result<kairos_sim::GpuDesc> {
    Ok(match name {
        "h100-sxm" | "h100" => kairos_sim::GpuDesc::h100_sxm(),
        "h100-pcie" => kairos_sim::GpuDesc::h100_pcie(),
        "h200" => kairos_sim::GpuDesc::h200(),
        // A description of one's own (calibrating one: no rebuild per try); its `key` picks the
        // measured profiles (data/profiles/<key>/).
        path if path.ends_with(".json") => kairos_sim::GpuDesc::load(std::path::Path::new(path)).map_err(anyhow::Error::msg)?,
        other => {
            bail!("unknown simulated GPU '{other}': use h100-sxm, h100-pcie, h200 or a description file (.json, as data/gpus/)")
        }
    })
}

/// `requests` copies of one request through the dispatcher under `policy`, all at once; the outputs
/// of the first and the time the last took, after checking that every copy returned the same.
fn run_dispatched<G: Gpu>(gpu: G, plan: &Plan, inputs: &[Tensor], policy: &str, requests: usize) -> Result<(Vec<Tensor>, f64)> {
    use kairos_sched::{Config, RequestOptions, VirtualDriver};
    let p = kairos_bench::latency::policy(policy)?;
    let mut d = VirtualDriver::new(Config::default().with_policy(p), gpu)?;
    d.set_checks(true);
    let name = plan.model.clone();
    d.load_model(kairos_sched::ModelSpec { name: name.clone(), plan: std::sync::Arc::new(plan.clone()), profile: None })?;
    // A warm-up request (kernel loading), then the copies at once.
    let now = d.now_ns();
    d.submit_at(now, &name, inputs.to_vec(), RequestOptions::default());
    d.run_until_idle()?;
    d.take_records();
    let t0 = d.now_ns();
    for _ in 0..requests.max(1) {
        d.submit_at(t0, &name, inputs.to_vec(), RequestOptions::default());
    }
    d.run_until_idle()?;
    let records = d.take_records();
    let stats = d.dispatcher().stats();
    let mut first: Option<Vec<Tensor>> = None;
    let (mut last_ns, mut behind) = (0, 0);
    for r in records {
        let timing = r.result.map_err(|e| anyhow::anyhow!("request {:?} failed: {e}", r.id))?;
        last_ns = last_ns.max(timing.done_ns.saturating_sub(t0));
        behind += timing.chained;
        match &first {
            None => first = Some(r.outputs),
            Some(f) => {
                for (a, b) in f.iter().zip(&r.outputs) {
                    if a.to_f32_vec() != b.to_f32_vec() {
                        bail!("two copies of the same request returned different outputs under {policy}");
                    }
                }
            }
        }
    }
    eprintln!(
        "{} copies through the dispatcher ({policy}): identical outputs; {} launches ({} behind another on their lane), {} GPU events, {} anomalies",
        requests.max(1),
        stats.launches,
        behind,
        stats.events,
        stats.notification_anomalies
    );
    if stats.notification_anomalies > 0 {
        bail!("the dispatcher saw {} notification anomalies", stats.notification_anomalies);
    }
    Ok((first.unwrap_or_default(), last_ns as f64 / 1e6))
}

pub(crate) fn run_on<G: Gpu>(gpu: &mut G, plan: &Plan, inputs: &[Tensor]) -> Result<(Vec<Tensor>, f64)> {
    let weights = exec::upload_weights(gpu, plan, MemKind::Device)?;
    // One warm-up run (kernel compilation, caches), then the timed one.
    let result = exec::execute_plan(gpu, plan, weights.ptr, inputs, 64)
        .and_then(|_| exec::execute_plan(gpu, plan, weights.ptr, inputs, 64));
    gpu.free(weights)?;
    let r = result?;
    Ok((r.outputs, r.total_ns as f64 / 1e6))
}

pub fn run(args: RunArgs) -> Result<()> {
    let spec = args.model.spec();
    let started = Instant::now();
    let t = Instant::now();
    let bytes = spec.onnx_bytes()?;
    let graph = kairos_ir::onnx::load_bytes(&spec.name(), &bytes, &spec.load_options())?;
    let plan = kairos_ir::lower::lower(&graph, &kairos_ir::lower::LowerOptions::new(spec.dtype))?;
    eprintln!(
        "{}: {} kernels, {:.1} MB of weights, lowered in {:.2} s",
        plan.model,
        plan.launches.len(),
        plan.weight_bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    let inputs = if args.inputs.is_empty() {
        eprintln!("no --input given: using random inputs (seed {})", spec.seed);
        random_inputs(&plan, spec.seed)
    } else {
        if args.inputs.len() != plan.inputs.len() {
            bail!(
                "{} takes {} inputs ({}), got {}",
                plan.model,
                plan.inputs.len(),
                plan.inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", "),
                args.inputs.len()
            );
        }
        let mut v = Vec::new();
        for (p, decl) in args.inputs.iter().zip(&plan.inputs) {
            let t = npy::read(p)?;
            if t.shape != decl.shape {
                bail!("{}: input '{}' must have shape {:?}, the file holds {:?}", p.display(), decl.name, decl.shape, t.shape);
            }
            v.push(t);
        }
        v
    };
    let t = Instant::now();
    if args.policy.is_some() && args.backend == Backend::Cpu {
        bail!("--policy runs the request through the dispatcher: use --backend sim or --backend cuda");
    }
    let (outputs, time_label) = match args.backend {
        Backend::Cpu => {
            let out = kairos_kernels::cpu::execute_plan(&plan, &inputs).map_err(anyhow::Error::msg)?;
            (out, format!("{:.2} ms on the CPU reference", t.elapsed().as_secs_f64() * 1e3))
        }
        Backend::Sim => {
            let desc = sim_desc(&args.sim_gpu)?;
            let name = args.sim_gpu.clone();
            let mut gpu = kairos_sim::SimGpu::new(desc, kairos_sim::SimOptions { seed: spec.seed, ..Default::default() });
            let (out, ms) = match &args.policy {
                Some(p) => run_dispatched(gpu, &plan, &inputs, p, args.requests)?,
                None => run_on(&mut gpu, &plan, &inputs)?,
            };
            (out, format!("{ms:.3} ms simulated on {name} ({:.2} s of host time)", t.elapsed().as_secs_f64()))
        }
        Backend::Cuda => {
            let mut gpu = kairos_cuda::CudaGpu::new(args.device).context("the cuda backend needs an NVIDIA GPU and driver")?;
            // Kernel units not compiled yet start on their quick builds (seconds, slower code);
            // their optimized builds compile meanwhile and are cached for the next run.
            gpu.set_quick_builds(crate::paths::quick_builds_wanted());
            let device = gpu.info().name.clone();
            let quick_note = |units: &[kairos_kernels::source::Unit]| {
                if units.is_empty() {
                    String::new()
                } else {
                    let names: Vec<String> = units.iter().map(|u| u.name()).collect();
                    format!(
                        " (quick builds of {}: slower code while their optimized builds compile; the next run times those)",
                        names.join(", ")
                    )
                }
            };
            match &args.policy {
                Some(p) => {
                    // The dispatcher owns the GPU: whether quick builds ran is told by the log.
                    let (out, ms) = run_dispatched(gpu, &plan, &inputs, p, args.requests)?;
                    (out, format!("{ms:.3} ms on {device} for {} requests at once through the dispatcher ({p})", args.requests))
                }
                None => {
                    let (out, ms) = run_on(&mut gpu, &plan, &inputs)?;
                    let note = quick_note(&gpu.quick_build_status().0);
                    (out, format!("{ms:.3} ms on {device}, kernel by kernel{note}"))
                }
            }
        }
    };
    eprintln!("ran in {time_label}; {:.2} s since the command started", started.elapsed().as_secs_f64());
    let reference = if args.check { Some(kairos_ir::onnx::tract_reference(&bytes, &inputs)?) } else { None };
    for (k, (o, decl)) in outputs.iter().zip(&plan.outputs).enumerate() {
        let v = o.to_f32_vec();
        let head: Vec<String> = v.iter().take(5).map(|x| format!("{x:.4}")).collect();
        let (lo, hi) = v.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        println!(
            "{} {:?} {}: rms {:.4}, min {lo:.4}, max {hi:.4}, first [{}]",
            decl.name,
            o.shape,
            o.dtype(),
            rms(&v),
            head.join(", ")
        );
        if let Some(r) = &reference {
            println!("  relative L2 error vs tract: {:.3e}", relative_l2_error(&v, &r[k].to_f32_vec()));
        }
        if let Some(path) = &args.output {
            let path = if k == 0 {
                path.clone()
            } else {
                path.with_file_name(format!("{}_{k}.npy", path.file_stem().unwrap_or_default().to_string_lossy()))
            };
            npy::write(&path, o)?;
            eprintln!("wrote {}", path.display());
        }
    }
    if args.backend == Backend::Cuda {
        kairos_cuda::nvrtc::finish_background(
            "letting the optimized kernel builds finish into the cache for the next run (Ctrl-C skips them)",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::sim_desc;

    #[test]
    fn a_simulated_gpu_is_a_builtin_name_or_a_description_file() {
        assert_eq!(sim_desc("h200").unwrap().key, "h200");
        let dir = std::env::temp_dir().join(format!("kairos-sim-desc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(include_str!("../../../data/gpus/h200.json")).unwrap();
        v["name"] = "H200, calibrated here".into();
        let good = dir.join("mine.json");
        std::fs::write(&good, v.to_string()).unwrap();
        let d = sim_desc(good.to_str().unwrap()).unwrap();
        assert_eq!((d.key.as_str(), d.name.as_str()), ("h200", "H200, calibrated here"));
        // A description the simulator cannot use is refused with the file's name.
        v["sm_count"] = 0.into();
        let bad = dir.join("bad.json");
        std::fs::write(&bad, v.to_string()).unwrap();
        let e = sim_desc(bad.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("sm_count"), "{e}");
        assert!(sim_desc("h300").unwrap_err().to_string().contains("description file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

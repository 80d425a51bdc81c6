//! `kairos profile`: per-kernel durations, resources and right-sizes of a model on the GPU.

use crate::model_args::ModelArgs;
use anyhow::{Context, Result};
use clap::Args;
use kairos_gpu::Gpu;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Timed repeats per kernel (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Output JSON (the format the dispatcher and the simulator read).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
    /// Profile the lowering's tiles as they are. By default the plan is autotuned first, as
    /// `kairos serve` and `kairos bench` do at load (same cached choices), so the profile matches
    /// the plan they serve (a profile of other tiles is dropped there as stale).
    #[arg(long, env = "KAIROS_NO_AUTOTUNE")]
    pub no_autotune: bool,
    /// Also measure the layer profile cold starts plan from (DeepPlan): every launch with its
    /// weights in GPU memory and read in place from pinned host memory, and the weights' copy
    /// time; stored in the same JSON (`layers`).
    #[arg(long)]
    pub layers: bool,
    /// Right sizes (`min_sms`) in partition steps only (8 SMs on an H100/H200). By default each
    /// kernel is then measured SM by SM below the step that kept its speed, down to the fewest
    /// SMs that keep it (at most 7 more timings a kernel).
    #[arg(long)]
    pub coarse: bool,
}

pub fn run(args: ProfileArgs) -> Result<()> {
    let spec = args.model.spec();
    let mut plan = spec.plan()?;
    let mut gpu = kairos_cuda::CudaGpu::new(args.device).context("profiling needs an NVIDIA GPU")?;
    if !args.no_autotune {
        let opts = kairos_cuda::TuneOptions { dtypes: vec![plan.dtype], ..kairos_cuda::TuneOptions::default() };
        let r = kairos_cuda::autotune_plan(&mut gpu, &mut plan, &opts)?;
        eprintln!("autotuned: {} launches retiled", r.launches_changed);
    }
    eprintln!("profiling {} ({} kernels, {}) on {}", plan.model, plan.launches.len(), plan.dtype, gpu.info().name);
    let mut profile = kairos_cuda::profile_plan_with(&mut gpu, &plan, args.repeats, !args.coarse)?;
    if args.layers {
        eprintln!(
            "layer profile: {} launches twice (weights in GPU memory, then in host memory), {} layers",
            plan.launches.len(),
            plan.layers.len()
        );
        let layers = kairos_gpu::exec::profile_layers(&mut gpu, &plan, args.repeats)?;
        let input = kairos_sched::cold::ColdInput::measured(&plan, &layers).map_err(anyhow::Error::msg)?;
        println!(
            "{}",
            kairos_sched::cold::explain(&input, &kairos_sched::cold::plan(&input, kairos_sched::cold::ColdStrategy::DeepPlan))
        );
        eprintln!("layer profile took {:.2} s", layers.profiling_ns as f64 / 1e9);
        profile.layers = Some(layers);
    }
    println!(
        "{:>4} {:<10} {:>10} {:>6} {:>5} {:>7} {:>6} {:>7}  name",
        "#", "kernel", "us", "ctas", "regs", "smem", "occ", "min_sms"
    );
    for k in &profile.kernels {
        println!(
            "{:>4} {:<10} {:>10.2} {:>6} {:>5} {:>7} {:>6.2} {:>7}  {}",
            k.launch,
            k.kernel,
            k.duration_ns as f64 / 1e3,
            k.ctas,
            k.registers_per_thread,
            k.shared_mem_bytes,
            k.occupancy,
            k.min_sms,
            k.name
        );
    }
    println!(
        "latency {:.3} ms issued kernel by kernel; kernel time {:.3} ms",
        profile.latency_ns as f64 / 1e6,
        profile.kernel_time_ns() as f64 / 1e6
    );
    let path = args.output.unwrap_or_else(|| PathBuf::from(format!("{}_{}_b{}.json", plan.model, plan.dtype, spec.batch)));
    profile.save(&path).map_err(anyhow::Error::msg)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

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
    /// Also time every kernel on SM sets of `--placement-sizes` SMs placed four ways over the
    /// GPCs (the first SM ids, spread over every GPC, packed GPC after GPC, the fewest GPCs
    /// evenly: KRISP's Fig. 6), after probing the GPCs with thread-block clusters (sm_90 and
    /// later); stored in the same JSON (`placements`) with a table on stdout.
    #[arg(long)]
    pub placements: bool,
    /// SM counts `--placements` measures.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64")]
    pub placement_sizes: Vec<u32>,
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
    if args.placements {
        let gpcs = gpu.probe_gpcs(4).context("--placements probes the GPCs with thread-block clusters (sm_90 and later)")?;
        eprintln!(
            "placements: {} GPC sets probed ({:?} SMs); {} sizes x 4 placements x {} kernels",
            gpcs.len(),
            gpcs.iter().map(|g| g.count()).collect::<Vec<_>>(),
            args.placement_sizes.len(),
            plan.launches.len()
        );
        profile.placements =
            Some(kairos_cuda::profile::profile_placements(&mut gpu, &plan, args.repeats, &gpcs, &args.placement_sizes)?);
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
    if let Some(p) = &profile.placements {
        print!("{}", placement_table(p));
    }
    let path = args.output.unwrap_or_else(|| PathBuf::from(format!("{}_{}_b{}.json", plan.model, plan.dtype, spec.batch)));
    profile.save(&path).map_err(anyhow::Error::msg)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// `--placements` as a table: per size and placement, the plan's summed kernel time, over the
/// first-ids placement's, and how many launches are more than 5 % slower or faster than there.
fn placement_table(p: &kairos_gpu::profile::PlacementProfile) -> String {
    use kairos_gpu::profile::SmPlacement;
    use std::fmt::Write;
    let mut out = format!(
        "placements over {} GPCs ({:?} SMs)\n{:>5} {:<12} {:>12} {:>10} {:>8} {:>8}\n",
        p.gpcs.len(),
        p.gpcs.iter().map(|g| g.len()).collect::<Vec<_>>(),
        "SMs",
        "placement",
        "kernel ms",
        "x first",
        ">5% slo",
        ">5% fas"
    );
    for pt in &p.points {
        let base = p.points.iter().find(|b| b.sm_count == pt.sm_count && b.placement == SmPlacement::FirstIds);
        let (ratio, slower, faster) = match base {
            Some(b) => {
                let pairs = pt.duration_ns.iter().zip(&b.duration_ns);
                let slower = pairs.clone().filter(|(d, b)| **d as f64 > **b as f64 * 1.05).count();
                let faster = pairs.filter(|(d, b)| (**d as f64) * 1.05 < **b as f64).count();
                (pt.kernel_time_ns() as f64 / b.kernel_time_ns().max(1) as f64, slower, faster)
            }
            None => (f64::NAN, 0, 0),
        };
        let _ = writeln!(
            out,
            "{:>5} {:<12} {:>12.3} {:>10.3} {:>8} {:>8}",
            pt.sm_count,
            pt.placement.label(),
            pt.kernel_time_ns() as f64 / 1e6,
            ratio,
            slower,
            faster
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use kairos_gpu::profile::{PlacementPoint, PlacementProfile, SmPlacement};

    #[test]
    fn the_placement_table_compares_each_placement_with_the_first_ids_at_its_size() {
        let pt = |placement, duration_ns: Vec<u64>| PlacementPoint { sm_count: 16, placement, sms: vec![], duration_ns };
        let p = PlacementProfile {
            gpcs: vec![vec![0, 2], vec![1, 3]],
            points: vec![pt(SmPlacement::FirstIds, vec![100, 100, 100]), pt(SmPlacement::Packed, vec![110, 100, 90])],
        };
        let t = super::placement_table(&p);
        let packed = t.lines().find(|l| l.contains("packed")).unwrap();
        let cols: Vec<&str> = packed.split_whitespace().collect();
        assert_eq!(cols, vec!["16", "packed", "0.000", "1.000", "1", "1"], "{t}");
        assert!(t.starts_with("placements over 2 GPCs ([2, 2] SMs)"), "{t}");
    }
}

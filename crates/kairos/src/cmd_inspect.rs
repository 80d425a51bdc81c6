//! `kairos inspect`: what a model becomes — ops, fused ops, kernels, FLOPs, memory, weight layers;
//! or, with `--gpus`, the host's GPUs and how they are connected (no model then).

use crate::model_args::ModelArgs;
use anyhow::{Context, Result};
use clap::Args;
use kairos_ir::lower::{LowerOptions, lower, optimized};
use std::path::PathBuf;
use std::time::Instant;

/// The model argument is required unless `--gpus` is given (then it is ignored, and empty when
/// left out: `ModelArgs::model` is a plain `String`, hence the hidden empty default; clap's
/// `required_unless*` needs `required(false)` first).
#[derive(Args, Debug)]
#[command(mut_arg("model", |a| a.required(false).required_unless_present("gpus").default_value("").hide_default_value(true)))]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Also list every weight layer (byte ranges in the weight blob).
    #[arg(long)]
    pub layers: bool,
    /// Also list every kernel launch.
    #[arg(long)]
    pub launches: bool,
    /// Write the whole plan (without weights) as JSON; with --gpus, the GPU topology instead.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Show the host's GPUs instead of a model: memory, PCI address, NUMA node, PCIe switch and
    /// link, the peer matrix (NVLink, PCIe or none), and the secondary GPUs DeepPlan's parallel
    /// transmission would use for each. Needs the NVIDIA driver; no model argument.
    #[arg(long)]
    pub gpus: bool,
    /// Explain the model's cold-start plan (DeepPlan): per weight layer, loaded or read in place
    /// from host memory, and the predicted cold latency. Uses the layer profile of --profile
    /// (`kairos profile --layers`) when it was measured on this plan, else roofline estimates.
    #[arg(long)]
    pub cold_plan: bool,
    /// With --cold-plan: load-then-run, pipelined or deepplan.
    #[arg(long, default_value = "deepplan")]
    pub cold_strategy: kairos_sched::cold::ColdStrategy,
    /// With --cold-plan: a profile JSON with a layer profile.
    #[arg(long)]
    pub profile: Option<PathBuf>,
}

/// `kairos inspect --gpus`: the topology as a table on stdout, or as JSON in `json`.
fn gpus(json: Option<&std::path::Path>) -> Result<()> {
    let topology = match kairos_cuda::topology::read() {
        Ok(t) => t,
        Err(kairos_gpu::GpuError::NoDevice(why)) => anyhow::bail!("no CUDA GPU: {why}"),
        Err(e) => return Err(anyhow::Error::new(e).context("reading the GPU topology")),
    };
    match json {
        Some(path) => {
            std::fs::write(path, serde_json::to_string_pretty(&topology)?)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote the GPU topology ({} GPUs) to {}", topology.gpus.len(), path.display());
        }
        None => print!("{}", topology.describe()),
    }
    Ok(())
}

fn fmt_hist(h: &[(&str, usize)]) -> String {
    h.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
}

pub fn mb(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

pub fn run(args: InspectArgs) -> Result<()> {
    if args.gpus {
        return gpus(args.json.as_deref());
    }
    let spec = args.model.spec();
    let t0 = Instant::now();
    let graph = spec.graph()?;
    let t_load = t0.elapsed();
    let t1 = Instant::now();
    let plan = lower(&graph, &LowerOptions::new(spec.dtype))?;
    let t_lower = t1.elapsed();
    let fused = optimized(&graph);
    println!(
        "model      {} ({}), {} plan, batch {}",
        plan.model,
        if spec.is_file() { &spec.model } else { "zoo" },
        plan.dtype,
        spec.batch
    );
    // The file's own declaration: which axes are dynamic, and the value this plan fixed them at.
    let declared = if spec.is_file() {
        let bytes = spec.onnx_bytes()?;
        Some(kairos_ir::signature::read_signature(&spec.name(), &bytes)?)
    } else {
        None
    };
    for i in &plan.inputs {
        let sig = declared.as_ref().and_then(|s| s.inputs.iter().find(|t| t.name == i.name));
        match sig.filter(|t| t.dims.iter().any(|d| d.is_dynamic())) {
            Some(t) => {
                let axes: Vec<String> = t
                    .dims
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| d.is_dynamic())
                    .map(|(axis, d)| format!("axis {axis} '{d}'"))
                    .collect();
                println!(
                    "input      {} {:?} {} (declared {}; dynamic: {}; planned at --batch {} --seq-len {})",
                    i.name,
                    i.shape,
                    i.dtype,
                    t.dims_text(),
                    axes.join(", "),
                    spec.batch,
                    spec.seq_len
                );
            }
            None => println!("input      {} {:?} {}", i.name, i.shape, i.dtype),
        }
    }
    for o in &plan.outputs {
        println!("output     {} {:?} {}", o.name, o.shape, o.dtype);
    }
    println!("ops        {} nodes: {}", graph.nodes.len(), fmt_hist(&graph.op_histogram()));
    println!("fused      {} nodes: {}", fused.nodes.len(), fmt_hist(&fused.op_histogram()));
    println!("kernels    {} launches: {}", plan.launches.len(), fmt_hist(&plan.kernel_histogram()));
    println!("flops      {:.3} GFLOP", plan.flops() as f64 / 1e9);
    println!("weights    {} in {} layers", mb(plan.weight_bytes), plan.layers.len());
    println!("arena      {} peak activations per request", mb(plan.arena_bytes));
    let roots = plan.launches.iter().filter(|l| l.deps.is_empty()).count();
    println!(
        "deps       {} launches start with no dependency; {} dependency edges",
        roots,
        plan.launches.iter().map(|l| l.deps.len()).sum::<usize>()
    );
    println!("time       load {:.3} s, lower {:.3} s", t_load.as_secs_f64(), t_lower.as_secs_f64());
    if args.cold_plan {
        let layers = match &args.profile {
            Some(path) => {
                let p = kairos_gpu::profile::ModelProfile::load(path).map_err(anyhow::Error::msg)?;
                match p.layers {
                    Some(l) => match l.check_plan(&plan) {
                        Ok(()) => Some(l),
                        Err(e) => {
                            println!(
                                "\n{}: {e}; planning from roofline estimates (no layer may stay in host memory)",
                                path.display()
                            );
                            None
                        }
                    },
                    None => {
                        println!("\n{} has no layer profile (`kairos profile --layers`): roofline estimates", path.display());
                        None
                    }
                }
            }
            None => None,
        };
        let input = match layers {
            Some(l) => kairos_sched::cold::ColdInput::measured(&plan, &l).map_err(anyhow::Error::msg)?,
            None => {
                // Roofline: the H100's rates, PCIe 5 at the 48 GB/s measured for large copies.
                let rates = (60e12, 3.0e12);
                let exec: Vec<f64> = plan
                    .launches
                    .iter()
                    .map(|l| (l.flops as f64 / rates.0).max(l.bytes as f64 / rates.1) * 1e9 + 3000.0)
                    .collect();
                kairos_sched::cold::ColdInput::estimated(&plan, &exec, 48e9)
            }
        };
        let cold = kairos_sched::cold::plan(&input, args.cold_strategy);
        println!("\n{}", kairos_sched::cold::explain(&input, &cold));
    }
    if args.layers {
        println!("\n{:>5} {:>12} {:>12}  name", "layer", "offset", "bytes");
        for (i, l) in plan.layers.iter().enumerate() {
            println!("{i:>5} {:>12} {:>12}  {}", l.offset_bytes, l.len_bytes, l.name);
        }
    }
    if args.launches {
        println!(
            "\n{:>5} {:<10} {:>7} {:>7} {:>12} {:>12} {:<16} name",
            "#", "kernel", "blocks", "threads", "flops", "bytes", "deps"
        );
        for (i, l) in plan.launches.iter().enumerate() {
            let deps = l.deps.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
            println!(
                "{i:>5} {:<10} {:>7} {:>7} {:>12} {:>12} {:<16} {}",
                l.kernel.name(),
                l.shape.logical_blocks,
                l.shape.threads_per_block,
                l.flops,
                l.bytes,
                if deps.len() > 16 { format!("{}..", &deps[..14]) } else { deps },
                l.name
            );
        }
    }
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&plan)?)?;
        eprintln!("wrote the plan to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        inspect: InspectArgs,
    }

    #[test]
    fn the_model_is_needed_unless_gpus() {
        let a = Cli::try_parse_from(["inspect", "--gpus"]).unwrap().inspect;
        assert!(a.gpus && a.model.model.is_empty());
        let a = Cli::try_parse_from(["inspect", "--gpus", "--json", "t.json"]).unwrap().inspect;
        assert!(a.gpus && a.json.is_some());
        let a = Cli::try_parse_from(["inspect", "resnet50", "--layers"]).unwrap().inspect;
        assert!(!a.gpus && a.layers && a.model.model == "resnet50");
        let err = Cli::try_parse_from(["inspect", "--layers"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument, "{err}");
    }
}

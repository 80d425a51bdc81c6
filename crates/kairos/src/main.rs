//! kairos: a GPU inference server whose dispatcher owns every kernel launch.

#![forbid(unsafe_code)]

mod cmd_bench;
mod cmd_bench_serve;
mod cmd_check_onnx;
mod cmd_cold;
mod cmd_demo;
mod cmd_inspect;
mod cmd_kernels;
mod cmd_latency;
mod cmd_profile;
mod cmd_run;
mod cmd_serve;
mod cmd_soak;
mod cmd_zoo;
mod cpu_profile;
mod env;
mod model_args;
mod paths;

/// Kernel images embedded at build time (crates/kairos/build.rs; empty unless built with
/// `KAIROS_PREBUILT_KERNELS`, as scripts/build-release.sh does).
mod prebuilt_kernels {
    include!(concat!(env!("OUT_DIR"), "/prebuilt_kernels.rs"));
}

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "kairos", version, about = "A GPU inference server whose dispatcher owns every kernel launch.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a mix of vision models on a simulated GPU through the dispatcher and compare policies.
    Demo(cmd_demo::DemoArgs),
    /// The model zoo: list models, export them as ONNX.
    #[command(subcommand)]
    Zoo(cmd_zoo::ZooCommand),
    /// Show what a model lowers to: ops, fused ops, kernels, FLOPs, weight layers, arena.
    Inspect(cmd_inspect::InspectArgs),
    /// Run one request through a model (cpu, sim or cuda backend), .npy in and out.
    Run(cmd_run::RunArgs),
    /// Check an ONNX exporter corpus (scripts/onnx_corpus.py): every export loaded at each case's
    /// shapes, run, and compared with onnxruntime.
    CheckOnnx(cmd_check_onnx::CheckOnnxArgs),
    /// Profile a model's kernels on the GPU: durations, resources, occupancy, KRISP's min SMs.
    Profile(cmd_profile::ProfileArgs),
    /// Serve a model repository: Open Inference Protocol over REST and gRPC, shared memory, metrics.
    Serve(Box<cmd_serve::ServeArgs>),
    /// The kernel library: compile it into the CUBIN cache ahead of time (no GPU needed), or see
    /// which units are cached or embedded.
    #[command(subcommand)]
    Kernels(cmd_kernels::KernelsCommand),
    /// Benchmarks: the papers' experiments on the simulator or the GPU.
    #[command(subcommand)]
    Bench(cmd_bench::BenchCommand),
}

fn main() {
    let matches = Cli::command().after_help(env::help_text()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = env::install() {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
    kairos_cuda::nvrtc::register_prebuilt(prebuilt_kernels::IMAGES);
    let profile = cpu_profile::start();
    let result = match cli.command {
        Command::Demo(a) => cmd_demo::run(a),
        Command::Zoo(c) => cmd_zoo::run(c),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Run(a) => cmd_run::run(a),
        Command::CheckOnnx(a) => cmd_check_onnx::run(a),
        Command::Profile(a) => cmd_profile::run(a),
        Command::Kernels(c) => cmd_kernels::run(c),
        Command::Bench(c) => cmd_bench::run(c),
        Command::Serve(a) => cmd_serve::run(*a),
    };
    profile.finish();
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

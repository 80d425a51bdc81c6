//! Profiles zoo models on the GPU as `kairos profile` does (per-kernel durations, resources and
//! right sizes of the lowering's plan, `kairos_cuda::profile_plan`) and writes one JSON per model
//! in the layout of data/profiles/<gpu>/ (`<model>-<dtype>-b<batch>.json`), for the simulator.
//!
//!   cargo run --release -p kairos-gputest --example profile_zoo -- OUT_DIR [--dtype f16|f32] [MODEL...]
//!
//! Without models, every zoo model. Needs a GPU.

use kairos_ir::DType;
use kairos_ir::model::ModelSpec;
use std::path::PathBuf;

fn main() {
    // The CUDA backend's settings from KAIROS_CACHE_DIR, KAIROS_PROGRESS, ... (README).
    kairos_cuda::settings::configure_from_env();
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().expect("usage: profile_zoo OUT_DIR [--dtype f16|f32] [MODEL...]"));
    let mut dtype = DType::F16;
    let mut models = Vec::new();
    while let Some(a) = args.next() {
        if a == "--dtype" {
            dtype = if args.next().as_deref() == Some("f32") { DType::F32 } else { DType::F16 };
        } else {
            models.push(a);
        }
    }
    if models.is_empty() {
        models = kairos_ir::zoo::ZOO.iter().map(|e| e.name.to_string()).collect();
    }
    std::fs::create_dir_all(&out).expect("output folder");
    let mut gpu = kairos_cuda::CudaGpu::new(0).expect("a GPU");
    let mut failed = 0;
    for m in &models {
        let spec = ModelSpec { dtype, ..ModelSpec::new(m) };
        let r = spec.plan().map_err(|e| e.to_string()).and_then(|plan| {
            let p = kairos_cuda::profile_plan(&mut gpu, &plan, 5).map_err(|e| e.to_string())?;
            let path = out.join(format!("{}-{}-b{}.json", plan.model, dtype.name(), spec.batch));
            p.save(&path).map_err(|e| e.to_string())?;
            Ok((plan.launches.len(), p.latency_ns, p.kernel_time_ns(), path))
        });
        match r {
            Ok((n, lat, ker, path)) => println!(
                "{m:<14} {n:>4} launches  latency {:>8.3} ms  kernel time {:>8.3} ms  {}",
                lat as f64 / 1e6,
                ker as f64 / 1e6,
                path.display()
            ),
            Err(e) => {
                failed += 1;
                println!("{m:<14} FAILED: {e}");
            }
        }
    }
    std::process::exit(if failed > 0 { 1 } else { 0 });
}

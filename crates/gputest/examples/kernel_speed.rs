//! Kernel speed of zoo models on the GPU (batch 1 unless `--batch N`): the plan's kernel-by-kernel latency (what
//! `kairos profile` reports as its latency) and the kernel time per kernel kind, with the
//! lowering's tiles and again after the autotuner, plus both plans' outputs against the CPU
//! reference (computed on the other cores meanwhile). A table is printed last.
//!
//!   cargo run --release -p kairos-gputest --example kernel_speed -- [--dtype f16|f32] [--seq 128] [--batch 1]
//!       [--no-check] [--no-tune] [--tune-log] [--top 8] [--plain] [--ptxas] MODEL...
//!
//! `--tune-log` prints every autotuner candidate's time, not only the choice.
//! `--plain` also times every launch with device events twice, under the protocol and built as a
//! plain grid (one CTA per logical block, no protocol), and lists the slowest launches with all
//! three times (the span is from the first placement record to LaunchDone; events include the
//! launch itself). `--ptxas` prints ptxas' registers and spills of the tile-engine entries (it
//! compiles the conv and gemm modules again, minutes).
//!
//! Needs a GPU; `scripts/gpu-suite.sh speed` runs it on the device.

use kairos_cuda::CudaGpu;
use kairos_cuda::autotune::{TuneOptions, autotune_plan};
use kairos_cuda::profile::{PlanBuffers, run_plan};
use kairos_gpu::*;
use kairos_gputest as suite;
use kairos_ir::DType;
use kairos_ir::plan::Plan;
use std::collections::BTreeMap;

struct Timing {
    latency_ns: u64,
    kernel_ns: u64,
    by_kind: BTreeMap<String, (u64, usize)>,
    /// Products (gemm, and convolutions as M x N x K) by shape: (ns, launches).
    by_shape: BTreeMap<String, (u64, usize)>,
    slowest: Vec<(u64, String, String)>,
    /// Per launch with `--plain`: (events under the protocol, events as a plain grid), ns.
    plain: Vec<(u64, u64)>,
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn time_plan(gpu: &mut CudaGpu, plan: &Plan, bufs: &PlanBuffers, top: usize, plain: bool) -> Result<Timing> {
    let stream = gpu.utility_stream()?;
    run_plan(gpu, plan, bufs, stream)?;
    let mut lat: Vec<u64> = (0..15).map(|_| run_plan(gpu, plan, bufs, stream)).collect::<Result<_>>()?;
    let latency_ns = median(&mut lat);
    let whole = gpu.info().partitions[0].sms;
    let mut args = Vec::new();
    let mut by_kind: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    let mut slowest = Vec::new();
    let mut by_shape: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    let mut kernel_ns = 0;
    let mut plain_ns = Vec::new();
    for (i, l) in plan.launches.iter().enumerate() {
        bufs.bases.resolve_all(&l.args, &mut args);
        let req = LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream);
        let mut t: Vec<u64> = (0..3).map(|_| gpu.time_span(&req)).collect::<Result<_>>()?;
        let ns = median(&mut t);
        kernel_ns += ns;
        let both = if plain {
            let mut ev = |v| -> Result<u64> {
                let mut t: Vec<u64> = (0..3).map(|_| gpu.time_launch(&req, v)).collect::<Result<_>>()?;
                Ok(median(&mut t))
            };
            let p = (ev(kairos_cuda::Variant::Protocol)?, ev(kairos_cuda::Variant::Plain)?);
            plain_ns.push(p);
            format!(" events {:.1} / plain {:.1} us", p.0 as f64 / 1e3, p.1 as f64 / 1e3)
        } else {
            String::new()
        };
        let e = by_kind.entry(l.kernel.name().to_string()).or_default();
        e.0 += ns;
        e.1 += 1;
        let r = gpu.kernel_resources(&l.kernel, l.dtype, &l.shape)?;
        let res = format!("regs {} smem {} ctas/SM {}", r.registers_per_thread, r.shared_mem_bytes, r.ctas_per_sm_max);
        let tile = match &l.kernel {
            kairos_ir::plan::Kernel::Conv2d(p) => {
                // As a product: M = output pixels, N = output channels, K = reduction per group.
                let mnk =
                    format!("{}x{}x{}", p.batch * p.out_h * p.out_w, p.out_c, p.in_c / p.groups.max(1) * p.kernel_h * p.kernel_w);
                let e = by_shape.entry(format!("conv {mnk} g{} s{}", p.groups, p.stride_h)).or_default();
                e.0 += ns;
                e.1 += 1;
                format!(
                    "{mnk} tile {}x{}x{} blocks {} {res}",
                    p.tile_m, p.tile_n, l.shape.threads_per_block, l.shape.logical_blocks
                )
            }
            kairos_ir::plan::Kernel::Gemm(p) => {
                let mnk = format!("{}x{}x{}x{}", p.batch0 * p.batch1, p.m, p.n, p.k);
                let e = by_shape.entry(format!("gemm {mnk}")).or_default();
                e.0 += ns;
                e.1 += 1;
                format!(
                    "{mnk} tile {}x{}x{} blocks {} {res}",
                    p.tile_m, p.tile_n, l.shape.threads_per_block, l.shape.logical_blocks
                )
            }
            _ => format!("blocks {} {res}", l.shape.logical_blocks),
        };
        slowest.push((ns, format!("#{i} {}", l.name), format!("{tile}{both}")));
    }
    slowest.sort_by_key(|s| std::cmp::Reverse(s.0));
    slowest.truncate(top);
    Ok(Timing { latency_ns, kernel_ns, by_kind, by_shape, slowest, plain: plain_ns })
}

fn print_timing(label: &str, t: &Timing) {
    println!("  {label}: latency {:.3} ms, kernel time {:.3} ms", t.latency_ns as f64 / 1e6, t.kernel_ns as f64 / 1e6);
    let mut kinds: Vec<_> = t.by_kind.iter().collect();
    kinds.sort_by_key(|k| std::cmp::Reverse(k.1.0));
    for (k, (ns, n)) in kinds {
        println!("    {k:<10} {:>9.1} us  {n:>4} launches", *ns as f64 / 1e3);
    }
    let mut shapes: Vec<_> = t.by_shape.iter().collect();
    shapes.sort_by_key(|s| std::cmp::Reverse(s.1.0));
    for (shape, (ns, n)) in shapes.iter().take(12) {
        println!("    {:>9.1} us  {n:>3} x {:>7.1} us  {shape}", *ns as f64 / 1e3, *ns as f64 / 1e3 / *n as f64);
    }
    for (ns, name, tile) in &t.slowest {
        println!("    {:>9.1} us  {name}  [{tile}]", *ns as f64 / 1e3);
    }
    if !t.plain.is_empty() {
        let (p, q) = t.plain.iter().fold((0u64, 0u64), |a, b| (a.0 + b.0, a.1 + b.1));
        println!(
            "    device events over {} launches: protocol {:.3} ms, plain grid {:.3} ms ({:+.1}%)",
            t.plain.len(),
            p as f64 / 1e6,
            q as f64 / 1e6,
            (p as f64 / q.max(1) as f64 - 1.0) * 100.0
        );
    }
}

fn main() {
    // The CUDA backend's settings from KAIROS_CACHE_DIR, KAIROS_PROGRESS, ... (README).
    kairos_cuda::settings::configure_from_env();
    let mut dtype = DType::F16;
    let mut seq = 128usize;
    let mut batch = 1usize;
    let (mut check, mut tune, mut top, mut plain, mut ptxas, mut tune_log) = (true, true, 8usize, false, false, false);
    let mut models = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dtype" => dtype = if it.next().as_deref() == Some("f32") { DType::F32 } else { DType::F16 },
            "--seq" => seq = it.next().and_then(|v| v.parse().ok()).expect("--seq N"),
            "--batch" => batch = it.next().and_then(|v| v.parse().ok()).filter(|&b| b > 0).expect("--batch N (N > 0)"),
            "--top" => top = it.next().and_then(|v| v.parse().ok()).expect("--top N"),
            "--no-check" => check = false,
            "--no-tune" => tune = false,
            "--tune-log" => tune_log = true,
            "--plain" => plain = true,
            "--ptxas" => ptxas = true,
            m => models.push(m.to_string()),
        }
    }
    if models.is_empty() {
        models = vec!["resnet50".into(), "vgg19".into(), "bert_base".into()];
    }
    let zoo: Vec<suite::ZooModel> =
        models.iter().map(|m| suite::zoo_model(m, dtype, batch, seq).unwrap_or_else(|e| panic!("{m}: {e}"))).collect();
    let mut gpu = CudaGpu::new(0).expect("a GPU");
    let variants: &[kairos_cuda::Variant] =
        if plain { &[kairos_cuda::Variant::Protocol, kairos_cuda::Variant::Plain] } else { &[kairos_cuda::Variant::Protocol] };
    let t = gpu.prepare(variants).expect("kernel library");
    eprintln!("kernel library ready in {t:.0} ms on {}", gpu.info().name);
    // ptxas' resource report of the tile-engine kernels (registers, spills), with --ptxas: it
    // compiles both modules again with the report on (minutes; a verbose image is never cached
    // under the key a server reads).
    let verbose = kairos_cuda::nvrtc::KernelCache { verbose: true, ..gpu.kernel_cache().clone() };
    let report_modules = if ptxas {
        [kairos_kernels::source::Module::Conv, kairos_kernels::source::Module::Gemm]
            .into_iter()
            .flat_map(kairos_kernels::source::Unit::of_module)
            .collect()
    } else {
        vec![]
    };
    for m in report_modules {
        match verbose.image(m, kairos_cuda::Variant::Protocol) {
            Ok(img) => {
                for r in kairos_cuda::nvrtc::parse_ptxas_log(&img.log) {
                    println!(
                        "ptxas {:<14} {:>3} registers, {:>5} bytes smem, spills {} stores / {} loads, stack {} ({:.0} ms compile)",
                        r.function,
                        r.registers,
                        r.shared_mem_bytes,
                        r.spill_store_bytes,
                        r.spill_load_bytes,
                        r.stack_frame_bytes,
                        img.compile_ms
                    );
                }
            }
            Err(e) => println!("ptxas report of {}: {e}", m.name()),
        }
    }
    let mut rows = Vec::new();
    std::thread::scope(|s| {
        // CPU references on the other cores while the GPU works.
        let refs: Vec<_> =
            zoo.iter().map(|m| s.spawn(move || check.then(|| kairos_kernels::cpu::execute_plan(&m.plan, &m.inputs)))).collect();
        let mut outs = Vec::new();
        for m in &zoo {
            println!(
                "== {} {} batch {batch}{}",
                m.name,
                dtype,
                if m.plan.inputs.iter().any(|t| t.dtype == DType::I64) { format!(" seq {seq}") } else { String::new() }
            );
            let bufs = PlanBuffers::new(&mut gpu, &m.plan, &m.inputs, MemKind::Device).expect("buffers");
            let stream = gpu.utility_stream().unwrap();
            let before = time_plan(&mut gpu, &m.plan, &bufs, top, plain).expect("timing");
            run_plan(&mut gpu, &m.plan, &bufs, stream).unwrap();
            let out_before = bufs.outputs(&mut gpu, &m.plan).unwrap();
            print_timing("lowering's tiles", &before);
            let mut tuned = m.plan.clone();
            let (after, out_after) = if tune {
                let opts = TuneOptions { dtypes: vec![dtype], log_candidates: tune_log, ..Default::default() };
                let r = autotune_plan(&mut gpu, &mut tuned, &opts).expect("autotune");
                println!(
                    "  autotune: {} shapes ({} timed, {} from the table), {} launches changed, {:.0} ms",
                    r.shapes, r.timed, r.from_table, r.launches_changed, r.elapsed_ms
                );
                let after = time_plan(&mut gpu, &tuned, &bufs, top, plain).expect("timing");
                run_plan(&mut gpu, &tuned, &bufs, stream).unwrap();
                let out = bufs.outputs(&mut gpu, &tuned).unwrap();
                print_timing("autotuned", &after);
                (Some(after), Some(out))
            } else {
                (None, None)
            };
            bufs.free(&mut gpu).unwrap();
            outs.push((out_before, out_after));
            rows.push((m.name.clone(), before.latency_ns, before.kernel_ns, after.as_ref().map(|a| (a.latency_ns, a.kernel_ns))));
        }
        let mut errs = Vec::new();
        for (h, (ob, oa)) in refs.into_iter().zip(&outs) {
            match h.join().expect("CPU reference thread") {
                Some(Ok(cpu)) => {
                    errs.push((Some(suite::outputs_error(ob, &cpu)), oa.as_ref().map(|o| suite::outputs_error(o, &cpu))))
                }
                Some(Err(e)) => {
                    eprintln!("CPU reference failed: {e}");
                    errs.push((None, None));
                }
                None => errs.push((None, None)),
            }
        }
        let tol = suite::tolerance(dtype);
        let fmt_err = |e: Option<f64>| e.map_or("-".to_string(), |e| format!("{e:.1e}{}", if e <= tol { "" } else { " FAIL" }));
        println!(
            "\n== kernel speed ({}, {dtype}, batch {batch}, seq {seq}; ms; rel. L2 error vs CPU reference, tolerance {tol:.0e})",
            gpu.info().name
        );
        println!(
            "{:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "model", "latency", "kernels", "tuned lat", "tuned ker", "err", "tuned err"
        );
        for ((name, lat, ker, after), (eb, ea)) in rows.iter().zip(&errs) {
            println!(
                "{name:<14} {:>10.3} {:>10.3} {:>10} {:>10} {:>10} {:>10}",
                *lat as f64 / 1e6,
                *ker as f64 / 1e6,
                after.map_or("-".into(), |a| format!("{:.3}", a.0 as f64 / 1e6)),
                after.map_or("-".into(), |a| format!("{:.3}", a.1 as f64 / 1e6)),
                fmt_err(*eb),
                fmt_err(*ea)
            );
        }
        let failed = errs.iter().any(|(a, b)| a.is_some_and(|e| e > tol) || b.is_some_and(|e| e > tol));
        if failed {
            std::process::exit(1);
        }
    });
}

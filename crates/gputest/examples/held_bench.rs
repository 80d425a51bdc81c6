//! Device-side cost of a forward pass's kernels once they are all queued: the protocol against
//! plain grids and CUDA-graph replay, alone and with every model at once on its own stream.
//! `scripts/held_peer.py` measures PyTorch's CUDA graphs the same way, in the same device call
//! (`scripts/held-bench.sh`).
//!
//! Every point holds its streams behind a spin kernel, queues the work, and times from the release
//! to each stream's end (`CudaGpu::time_held`): host launch costs are out of the picture. Variants:
//!
//!   plain         the same kernels built without the protocol (one CTA per logical block)
//!   graph         those plain launches captured once into a CUDA graph and replayed
//!   job           full-protocol launches as whole-job dispatch issued them when preemptible
//!                 (gated, end record only)
//!   kernel        full-protocol launches as kernel-level dispatch issued them when preemptible
//!                 (gated, start and end records)
//!   job-light     whole-job dispatch of a policy that does not preempt: light launches, silent
//!                 but for the last (protocol.cuh, point 7)
//!   kernel-light  kernel-level dispatch of a policy that does not preempt: light launches with
//!                 start and end records
//!   job-run       whole-job dispatch with recorded runs (`Gpu::record_run`): the launches but the
//!                 last replayed as one CUDA graph of light, silent launches, then the last one
//!   job-run-plain the same with the run recorded from plain grids (`KAIROS_RUN_KERNELS=plain`)
//!   job-run-stop  the same with a run that stops between kernels (a stop word, lowered:
//!                 protocol.cuh point 8), the last launch preemptible and carrying the word, as
//!                 `reef+stopruns` sends a best-effort segment
//!
//! usage: held_bench [--models a,b,..] [--reps N] [--out FILE]

use kairos_cuda::{CudaGpu, Variant, profile};
use kairos_gpu::*;
use kairos_gputest as suite;
use kairos_ir::DType;
use serde_json::json;

const HOLD_NS: u64 = 8_000_000;
const VARIANTS: [&str; 9] =
    ["plain", "graph", "job", "kernel", "job-light", "kernel-light", "job-run", "job-run-plain", "job-run-stop"];

struct Model {
    name: String,
    plan: kairos_ir::plan::Plan,
    bufs: profile::PlanBuffers,
    graph: Option<kairos_cuda::safe::Graph>,
    /// The launches but the last as recorded runs (`Gpu::record_run`): light protocol launches,
    /// plain grids, and light launches that stop between kernels (with `stop_word`).
    runs: Option<(RunId, RunId, RunId)>,
    stop_word: Option<StopWordId>,
}

/// Queues one forward pass of `m` on `stream` as `variant` does; returns its protocol launches.
fn queue(gpu: &mut CudaGpu, m: &Model, variant: &str, stream: StreamId) -> Result<Vec<LaunchId>> {
    if variant == "graph" {
        gpu.launch_graph(m.graph.as_ref().expect("captured"), stream)?;
        return Ok(Vec::new());
    }
    let whole = gpu.info().partitions[0].sms;
    let mut args = Vec::new();
    let mut ids = Vec::new();
    let mut previous = None;
    let n = m.plan.launches.len();
    let mut first = 0;
    if let Some(run) = match variant {
        "job-run" => m.runs.map(|r| r.0),
        "job-run-plain" => m.runs.map(|r| r.1),
        "job-run-stop" => m.runs.map(|r| r.2),
        _ => None,
    } {
        // The dispatcher's whole-job issue with runs: the run, then the last launch, reporting.
        gpu.launch_run(run, stream, &mut ids)?;
        previous = ids.last().copied();
        first = n - 1;
    }
    for (i, l) in m.plan.launches.iter().enumerate().skip(first) {
        m.bufs.bases.resolve_all(&l.args, &mut args);
        let mut req = LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream);
        if variant == "plain" {
            gpu.launch_variant(&req, Variant::Plain)?;
            continue;
        }
        req.after = previous;
        req.report_ctas = false;
        req.report_start = variant.starts_with("kernel");
        req.preemptible = !variant.ends_with("-light") && (!variant.starts_with("job-run") || variant == "job-run-stop");
        if variant == "job-run-stop" {
            req.stop_word = m.stop_word;
        }
        req.report_end = variant != "job-light" || i + 1 == n;
        let id = gpu.launch(&req)?;
        previous = Some(id);
        ids.push(id);
    }
    Ok(ids)
}

/// Zeroes a model's outputs, so that a variant that ran nothing cannot pass for one that agrees.
fn clear_outputs(gpu: &mut CudaGpu, m: &Model) -> Result<()> {
    for (o, ptr) in m.plan.outputs.iter().zip(&m.bufs.bases.outputs) {
        gpu.write(*ptr, &vec![0u8; o.len_bytes() as usize])?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // The CUDA backend's settings from KAIROS_CACHE_DIR, KAIROS_PROGRESS, ... (README).
    kairos_cuda::settings::configure_from_env();
    let mut models = "resnet18,mobilenet_v2,resnet34,squeezenet1_1,resnet50,densenet121,googlenet,inception_v3".to_string();
    let mut reps = 20usize;
    let mut out = std::path::PathBuf::from("held_bench.json");
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{x} needs a value"));
        match x.as_str() {
            "--models" => models = val(),
            "--reps" => reps = val().parse().expect("--reps N"),
            "--out" => out = val().into(),
            other => panic!("unknown argument {other}"),
        }
    }
    if let Err(e) = run(&models, reps, &out) {
        eprintln!("held_bench: {e}");
        std::process::exit(1);
    }
}

fn run(names: &str, reps: usize, out: &std::path::Path) -> Result<()> {
    let mut gpu = CudaGpu::new(0)?;
    let names: Vec<&str> = names.split(',').collect();
    let mut units = Vec::new();
    let mut models = Vec::new();
    for name in &names {
        let z = suite::zoo_model(name, DType::F16, 1, 128).map_err(GpuError::Invalid)?;
        for (u, _) in CudaGpu::plan_units(&z.plan)? {
            units.push((u, Variant::Protocol));
            units.push((u, Variant::Plain));
        }
        let bufs = profile::PlanBuffers::new(&mut gpu, &z.plan, &z.inputs, MemKind::Device)?;
        let stop_word = Some(gpu.create_stop_word()?);
        models.push(Model { name: name.to_string(), plan: z.plan, bufs, graph: None, runs: None, stop_word });
    }
    units.sort();
    units.dedup();
    gpu.prepare_units(&units, "held_bench")?;
    let streams: Vec<StreamId> = (0..models.len()).map(|_| gpu.create_stream(0)).collect::<Result<_>>()?;
    // Warm up every variant once, capture the graphs, and check that plain grids compute what
    // the protocol launches compute (within the fp16 kernel tolerance).
    #[allow(clippy::needless_range_loop)] // models[i] is updated inside the loop
    for i in 0..models.len() {
        let m = &models[i];
        let record = |gpu: &mut CudaGpu, plain: bool, stop_word: Option<StopWordId>| {
            gpu.set_run_kernels_plain(plain);
            let whole = gpu.info().partitions[0].sms;
            let launches = &m.plan.launches[..m.plan.launches.len() - 1];
            let args: Vec<Vec<kairos_gpu::DevicePtr>> = launches
                .iter()
                .map(|l| {
                    let mut a = Vec::new();
                    m.bufs.bases.resolve_all(&l.args, &mut a);
                    a
                })
                .collect();
            let reqs: Vec<LaunchRequest<'_>> = launches
                .iter()
                .zip(&args)
                .map(|(l, a)| LaunchRequest {
                    preemptible: stop_word.is_some(),
                    report_ctas: false,
                    report_start: false,
                    report_end: false,
                    stop_word,
                    ..LaunchRequest::of_launch(l, a, whole, PartitionId::WHOLE, streams[0])
                })
                .collect();
            gpu.record_run(&reqs)
        };
        let runs = (record(&mut gpu, false, None)?, record(&mut gpu, true, None)?, record(&mut gpu, false, m.stop_word)?);
        gpu.set_run_kernels_plain(false);
        models[i].runs = Some(runs);
        let m = &models[i];
        gpu.time_held(&streams[..1], HOLD_NS, |g| queue(g, m, "plain", streams[0]))?;
        let plain_out = m.bufs.outputs(&mut gpu, &m.plan)?;
        let mut err = 0f64;
        for v in ["job", "job-light", "kernel-light", "job-run", "job-run-plain", "job-run-stop"] {
            clear_outputs(&mut gpu, m)?;
            gpu.time_held(&streams[..1], HOLD_NS, |g| queue(g, m, v, streams[0]))?;
            let out = m.bufs.outputs(&mut gpu, &m.plan)?;
            let e = suite::outputs_error(&plain_out, &out);
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error fails too
            if !(e <= suite::tolerance(DType::F16)) {
                return Err(GpuError::Driver(format!("{}: plain grids and {v} launches disagree (error {e:.3e})", m.name)));
            }
            err = err.max(e);
        }
        let graph = gpu.capture_plain(streams[0], |g| queue(g, m, "plain", streams[0]).map(|_| ()))?;
        eprintln!("{}: {} launches, graph of {} nodes, outputs agree ({err:.1e})", m.name, m.plan.launches.len(), graph.nodes());
        models[i].graph = Some(graph);
    }
    let mut alone = serde_json::Map::new();
    let mut early = 0usize;
    println!(
        "{:<14} {:>8} {}  (ms, device time once queued; median of {reps})",
        "model",
        "launches",
        VARIANTS.map(|v| format!("{v:>13}")).join(" ")
    );
    for m in &models {
        let mut row = serde_json::Map::new();
        let mut cells = Vec::new();
        for v in VARIANTS {
            let mut t = Vec::new();
            for _ in 0..reps {
                let h = gpu.time_held(&streams[..1], HOLD_NS, |g| queue(g, m, v, streams[0]))?;
                early += h.released_early as usize;
                t.push(h.stream_ns[0] as f64 / 1e6);
            }
            let med = median(t);
            cells.push(med);
            row.insert(v.into(), json!(med));
        }
        row.insert("launches".into(), json!(m.plan.launches.len()));
        println!(
            "{:<14} {:>8} {}",
            m.name,
            m.plan.launches.len(),
            cells.iter().map(|c| format!("{c:>13.3}")).collect::<Vec<_>>().join(" ")
        );
        alone.insert(m.name.clone(), serde_json::Value::Object(row));
    }
    let mut concurrent = serde_json::Map::new();
    println!("all {} models at once, one stream each: makespan ms (median of {reps})", models.len());
    for v in VARIANTS {
        let mut spans = Vec::new();
        let mut per_stream = vec![Vec::new(); models.len()];
        for _ in 0..reps {
            let h = gpu.time_held(&streams, HOLD_NS, |g| {
                let mut ids = Vec::new();
                for (i, m) in models.iter().enumerate() {
                    ids.extend(queue(g, m, v, streams[i])?);
                }
                Ok(ids)
            })?;
            early += h.released_early as usize;
            spans.push(h.stream_ns.iter().copied().max().unwrap_or(0) as f64 / 1e6);
            for (i, &ns) in h.stream_ns.iter().enumerate() {
                per_stream[i].push(ns as f64 / 1e6);
            }
        }
        let sum_alone: f64 = models.iter().map(|m| alone[&m.name][v].as_f64().unwrap_or(0.0)).sum();
        let makespan = median(spans);
        println!("  {v:<13} {makespan:>8.3}   (sum of alone {sum_alone:.3})");
        concurrent.insert(
            v.into(),
            json!({
                "makespan_ms": makespan,
                "sum_alone_ms": sum_alone,
                "per_stream_ms": models.iter().zip(per_stream).map(|(m, t)| (m.name.clone(), json!(median(t)))).collect::<serde_json::Map<_, _>>(),
            }),
        );
    }
    if early > 0 {
        println!("note: {early} points released before all their work was queued (host launches slower than the hold)");
    }
    let doc = json!({
        "device": gpu.info().name, "hold_ns": HOLD_NS, "reps": reps, "released_early": early,
        "alone_ms": alone, "concurrent": concurrent,
    });
    std::fs::write(out, serde_json::to_string_pretty(&doc).expect("json")).map_err(|e| GpuError::Driver(e.to_string()))?;
    for m in models {
        m.bufs.free(&mut gpu)?;
    }
    Ok(())
}

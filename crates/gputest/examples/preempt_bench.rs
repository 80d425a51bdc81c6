//! Preemption latency on the GPU, with the preempt flag in mapped host memory (polled every 4 µs)
//! and in device memory (read at every block take, raised by a stream write): the numbers behind
//! the REEF issue's "preemption floor" (docs/benchmarks.md).
//!
//! 1. Spin kernels (`kairos_spin`: blocks of a fixed time) on the whole GPU, preempted a random
//!    100-300 µs after they started: from the preempt call until the last CTA left (device clock
//!    mapped to the host's), until the host saw the launch done, and the preempt call's own cost.
//! 2. Real best-effort work: every kernel of each model's plan (fp16, batch 1) launched alone
//!    under the full protocol and preempted at a uniformly random instant of its run; the latency
//!    until its last CTA left (the SMs are free for a real-time kernel) is weighted by the
//!    kernel's duration, so the percentiles are those of a preemption at a random instant of the
//!    model's run. A kernel that ends by itself before the flag counts with the time it took.
//!
//!    Each model runs as `serve` loads it (autotuned) and autotuned under a block-time budget
//!    (`--block-budget-us`, default 10: the best-effort plan variant, `TuneOptions::block_budget_ns`).
//!
//! 3. REEF's synthetic experiment: a real-time kernel arriving during a chain of N best-effort kernels
//!    of T µs, which are preempted or waited for ([`chain_case`]).
//!
//! Writes `preempt.json` into the output folder (every sample) and prints a table last.
//!
//! usage: preempt_bench [--out DIR] [--trials N] [--kernel-trials N] [--models a,b,..] [--block-budget-us N]

use kairos_cuda::protocol::StopFlag;
use kairos_cuda::{CudaGpu, LaunchOptions, TuneOptions, Variant, autotune_plan, profile};
use kairos_gpu::*;
use kairos_gputest as suite;
use kairos_ir::DType;
use serde_json::json;

struct Args {
    out: std::path::PathBuf,
    trials: usize,
    kernel_trials: usize,
    models: Vec<String>,
    block_budget_us: u64,
}

fn args() -> Args {
    let mut a = Args {
        out: std::env::var_os("OUT").map(Into::into).unwrap_or_else(|| "out".into()),
        trials: 1000,
        kernel_trials: 4,
        models: ["resnet50", "densenet121", "inception_v3", "bert_base", "vgg19"].map(String::from).to_vec(),
        block_budget_us: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{x} needs a value"));
        match x.as_str() {
            "--out" => a.out = val().into(),
            "--trials" => a.trials = val().parse().expect("--trials N"),
            "--kernel-trials" => a.kernel_trials = val().parse().expect("--kernel-trials N"),
            "--block-budget-us" => a.block_budget_us = val().parse().expect("--block-budget-us N"),
            "--models" => a.models = val().split(',').filter(|m| !m.is_empty()).map(str::to_string).collect(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// Upper edges of the histogram's bins (µs); the last bin holds everything above.
const BINS_US: [f64; 12] = [2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0];

/// Percentiles of (value, weight) samples: the smallest value whose cumulative weight reaches p.
fn weighted_percentile(v: &mut [(f64, f64)], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = v.iter().map(|x| x.1).sum();
    let mut acc = 0.0;
    for &(x, w) in v.iter() {
        acc += w;
        if acc >= p * total {
            return x;
        }
    }
    v[v.len() - 1].0
}

/// p50/p90/p99/p99.9/max, the mean and a histogram (weight per bin, as a share).
fn summary(v: &mut [(f64, f64)]) -> serde_json::Value {
    let total: f64 = v.iter().map(|x| x.1).sum();
    let mut hist = vec![0.0; BINS_US.len() + 1];
    for &(x, w) in v.iter() {
        hist[BINS_US.iter().position(|&e| x <= e).unwrap_or(BINS_US.len())] += w / total.max(f64::MIN_POSITIVE);
    }
    let mean = v.iter().map(|x| x.0 * x.1).sum::<f64>() / total.max(f64::MIN_POSITIVE);
    json!({
        "n": v.len(), "mean": mean,
        "p50": weighted_percentile(v, 0.5), "p90": weighted_percentile(v, 0.9), "p99": weighted_percentile(v, 0.99),
        "p999": weighted_percentile(v, 0.999), "max": weighted_percentile(v, 1.0),
        "histogram_upper_edges_us": BINS_US, "histogram_share": hist,
    })
}

fn flag_name(f: StopFlag) -> &'static str {
    match f {
        StopFlag::Device => "device",
        StopFlag::Host => "host",
    }
}

/// Polls until `launch` has a placement record.
fn wait_placed(gpu: &mut CudaGpu, launch: LaunchId, events: &mut Vec<GpuEvent>) -> Result<()> {
    let deadline = gpu.now_ns() + 10_000_000_000;
    loop {
        events.clear();
        gpu.poll(events)?;
        if events.iter().any(|e| matches!(e, GpuEvent::CtasPlaced { launch: l, .. } if *l == launch)) {
            return Ok(());
        }
        if gpu.now_ns() > deadline {
            return Err(GpuError::Driver(format!("launch {launch:?} never placed a CTA")));
        }
    }
}

/// What one preemption gave: the last CTA's exit after the flag (device clock mapped), the host
/// seeing LaunchDone after the flag, the preempt call's cost, where the launch stopped.
struct Stop {
    last_left_ns: u64,
    /// The first CTA's exit after the flag (0: none left after it), and the completion records.
    first_left_ns: u64,
    finished_records: u32,
    host_done_ns: u64,
    call_ns: u64,
    next_block: u32,
    preempted: bool,
}

/// Raises the flag of `launch` at `at_ns` (busy wait) and follows it to LaunchDone. Events the
/// launch sent before the flag count too (a launch may end before it).
fn preempt_at(gpu: &mut CudaGpu, launch: LaunchId, at_ns: u64, events: &mut Vec<GpuEvent>) -> Result<Stop> {
    let mut last_left = 0u64;
    let mut first_left = u64::MAX;
    let mut finished_records = 0;
    let mut done = None;
    while gpu.now_ns() < at_ns {}
    let t_flag = gpu.now_ns();
    gpu.preempt(launch)?;
    let call_ns = gpu.now_ns() - t_flag;
    let deadline = t_flag + 10_000_000_000;
    while done.is_none() {
        events.clear();
        gpu.poll(events)?;
        for e in events.iter() {
            match *e {
                GpuEvent::CtasFinished { launch: l, at_ns, .. } if l == launch => {
                    last_left = last_left.max(at_ns);
                    if at_ns >= t_flag {
                        first_left = first_left.min(at_ns);
                    }
                    finished_records += 1;
                }
                GpuEvent::LaunchDone { launch: l, next_block, preempted, .. } if l == launch => {
                    done = Some((gpu.now_ns(), next_block, preempted))
                }
                _ => {}
            }
        }
        if gpu.now_ns() > deadline {
            return Err(GpuError::Driver(format!("launch {launch:?} never ended after its preemption")));
        }
    }
    let (t_done, next_block, preempted) = done.expect("loop ends with it");
    Ok(Stop {
        last_left_ns: last_left.saturating_sub(t_flag),
        first_left_ns: if first_left == u64::MAX { 0 } else { first_left - t_flag },
        finished_records,
        host_done_ns: t_done - t_flag,
        call_ns,
        next_block,
        preempted,
    })
}

/// Spin launches of `ns_per_block` blocks on `ctas` CTAs (0: as many as fit, 16 per SM),
/// preempted 100-300 µs after their first placement record.
fn spin_case(gpu: &mut CudaGpu, stream: StreamId, ns_per_block: u64, ctas: u32, trials: usize) -> Result<serde_json::Value> {
    let blocks = 4_000_000u32;
    let counts = gpu.alloc(blocks as u64 * 4, MemKind::Device)?;
    let o = LaunchOptions { ctas, ..suite::whole_device(gpu, stream) };
    let mut rng = suite::Rng::new(ns_per_block ^ ctas as u64);
    let (mut left, mut host, mut call, mut first) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut records, mut stopped_at) = (Vec::new(), Vec::new());
    let mut events = Vec::new();
    let mut not_preempted = 0;
    for _ in 0..trials {
        let id = gpu.launch_spin(counts.ptr, blocks, ns_per_block, &o)?;
        wait_placed(gpu, id, &mut events)?;
        let at = gpu.now_ns() + 100_000 + rng.next_u64() % 200_000;
        let s = preempt_at(gpu, id, at, &mut events)?;
        if !s.preempted || s.next_block >= blocks {
            not_preempted += 1;
        }
        left.push((us(s.last_left_ns), 1.0));
        first.push((us(s.first_left_ns), 1.0));
        host.push((us(s.host_done_ns), 1.0));
        call.push((us(s.call_ns), 1.0));
        records.push(s.finished_records);
        stopped_at.push(s.next_block);
    }
    // Every sample, in trial order, before `summary` sorts them.
    let raw = json!({
        "flag_to_last_cta_left_us": left.iter().map(|x| x.0).collect::<Vec<_>>(),
        "flag_to_first_cta_left_us": first.iter().map(|x| x.0).collect::<Vec<_>>(),
        "flag_to_host_sees_done_us": host.iter().map(|x| x.0).collect::<Vec<_>>(),
        "preempt_call_us": call.iter().map(|x| x.0).collect::<Vec<_>>(),
        "finished_records": records,
        "stopped_at_block": stopped_at,
    });
    gpu.free(counts)?;
    if not_preempted > 0 {
        return Err(GpuError::Driver(format!("{not_preempted} spin launches ran to the end despite the flag")));
    }
    Ok(json!({
        "ns_per_block": ns_per_block, "ctas": ctas, "trials": trials,
        "flag_to_last_cta_left_us": summary(&mut left),
        "flag_to_first_cta_left_us": summary(&mut first),
        "flag_to_host_sees_done_us": summary(&mut host),
        "preempt_call_us": summary(&mut call),
        "samples": raw,
    }))
}

/// Every kernel of a plan preempted at random instants of its run (see the module doc).
fn model_case(
    gpu: &mut CudaGpu,
    stream: StreamId,
    plan: &kairos_ir::plan::Plan,
    inputs: &[kairos_ir::Tensor],
    trials: usize,
    seed: u64,
) -> Result<serde_json::Value> {
    let m = Model { plan, inputs };
    let bufs = profile::PlanBuffers::new(gpu, m.plan, m.inputs, MemKind::Device)?;
    profile::run_plan(gpu, m.plan, &bufs, stream)?;
    let whole = gpu.info().partitions[0].sms;
    let mut rng = suite::Rng::new(seed);
    let mut args = Vec::new();
    let mut events = Vec::new();
    let (mut left, mut kernels, mut samples) = (Vec::new(), Vec::new(), Vec::new());
    let mut total_ns = 0u64;
    for (i, l) in m.plan.launches.iter().enumerate() {
        bufs.bases.resolve_all(&l.args, &mut args);
        let req = LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream);
        let mut d = (0..3).map(|_| gpu.time_launch(&req, Variant::Protocol)).collect::<Result<Vec<u64>>>()?;
        d.sort_unstable();
        let duration_ns = d[1];
        total_ns += duration_ns;
        let mut kernel_left = Vec::new();
        let mut stopped = 0;
        for _ in 0..trials {
            let id = gpu.launch(&req)?;
            // The flag goes up at a uniform instant of the run (its first placement record is
            // seen a few µs after its start; this slightly favours late instants).
            let t0 = gpu.now_ns();
            let at = t0 + rng.next_u64() % duration_ns.max(1);
            let s = preempt_at(gpu, id, at, &mut events)?;
            if s.preempted {
                stopped += 1;
                // Finish the launch from where it stopped, so the next trial reads the same data.
                let mut rest = req;
                rest.first_block = s.next_block;
                let r = gpu.launch(&rest)?;
                gpu.wait_done(r)?;
            }
            kernel_left.push(us(s.last_left_ns));
            left.push((us(s.last_left_ns), duration_ns as f64 / trials as f64));
            samples.push(json!([i, us(s.last_left_ns), s.preempted]));
        }
        let mut kl: Vec<(f64, f64)> = kernel_left.iter().map(|&x| (x, 1.0)).collect();
        kernels.push(json!({
            "index": i, "name": l.name, "blocks": l.shape.logical_blocks, "duration_us": us(duration_ns),
            "preempted": stopped, "trials": trials,
            "flag_to_last_cta_left_us_max": weighted_percentile(&mut kl, 1.0),
            "flag_to_last_cta_left_us_p50": weighted_percentile(&mut kl, 0.5),
        }));
    }
    bufs.free(gpu)?;
    Ok(json!({
        "model": m.plan.model, "launches": m.plan.launches.len(), "kernel_time_us": us(total_ns), "trials_per_kernel": trials,
        "flag_to_last_cta_left_us": summary(&mut left),
        "kernels": kernels,
        "samples_kernel_us_preempted": samples,
    }))
}

/// REEF's synthetic preemption experiment: a best-effort stream holds a chain of `n` spin
/// kernels of about `kernel_ns` each (every SM full, blocks of `BLOCK_NS`, so a kernel is
/// `kernel_ns / BLOCK_NS` rounds of blocks), and a real-time spin kernel (one 20 µs block per SM)
/// arrives at a random instant of the chain on the most urgent stream. With `preempt`, every
/// launch of the chain is preempted at the arrival (the running one stops at its blocks'
/// boundary, the queued ones at their first take); without, the real-time kernel waits for the
/// running one to end (its stream's priority puts its CTAs ahead of the next one's). Measured
/// from the arrival: the real-time kernel's first CTA placed and its end as the host sees it.
fn chain_case(gpu: &mut CudaGpu, n: usize, kernel_ns: u64, preempt: bool, trials: usize) -> Result<serde_json::Value> {
    const BLOCK_NS: u64 = 10_000;
    let sms = gpu.info().sm_count;
    let be = gpu.create_stream(0)?;
    let rt = gpu.create_stream(5)?; // the most urgent CUDA priority (-5 on Hopper)
    let per_launch = 16 * sms * (kernel_ns / BLOCK_NS).max(1) as u32;
    let counts = gpu.alloc(per_launch as u64 * 4, MemKind::Device)?;
    let rt_counts = gpu.alloc(sms as u64 * 4, MemKind::Device)?;
    let mut rng = suite::Rng::new(n as u64 * 7 + kernel_ns + preempt as u64);
    let (mut start, mut end) = (Vec::new(), Vec::new());
    let mut events = Vec::new();
    for _ in 0..trials {
        let mut chain: Vec<LaunchId> = Vec::new();
        for _ in 0..n {
            let o = suite::whole_device(gpu, be);
            chain.push(gpu.launch_spin(counts.ptr, per_launch, BLOCK_NS, &o)?);
        }
        wait_placed(gpu, chain[0], &mut events)?;
        let at = gpu.now_ns() + rng.next_u64() % (n as u64 * kernel_ns).max(1);
        while gpu.now_ns() < at {}
        let t0 = gpu.now_ns();
        if preempt {
            for &l in &chain {
                gpu.preempt(l)?;
            }
        }
        let o = LaunchOptions { ctas: sms, ..suite::whole_device(gpu, rt) };
        let r = gpu.launch_spin(rt_counts.ptr, sms, 20_000, &o)?;
        let (mut placed, mut done) = (None, None);
        let mut left: std::collections::HashSet<LaunchId> = chain.iter().copied().collect();
        let deadline = t0 + 10_000_000_000;
        while done.is_none() || !left.is_empty() {
            events.clear();
            gpu.poll(&mut events)?;
            for e in &events {
                match *e {
                    GpuEvent::CtasPlaced { launch, at_ns, .. } if launch == r => {
                        placed = Some(placed.map_or(at_ns, |p: u64| p.min(at_ns)))
                    }
                    GpuEvent::LaunchDone { launch, .. } if launch == r => done = Some(gpu.now_ns()),
                    GpuEvent::LaunchDone { launch, .. } => {
                        left.remove(&launch);
                    }
                    _ => {}
                }
            }
            if gpu.now_ns() > deadline {
                return Err(GpuError::Driver("a chain trial did not end within 10 s".into()));
            }
        }
        start.push((us(placed.unwrap_or(t0).saturating_sub(t0)), 1.0));
        end.push((us(done.expect("loop ends with it") - t0), 1.0));
    }
    gpu.free(counts)?;
    gpu.free(rt_counts)?;
    gpu.destroy_stream(be)?;
    gpu.destroy_stream(rt)?;
    Ok(json!({
        "kernels": n, "kernel_us": us(kernel_ns), "preempt": preempt, "trials": trials,
        "arrival_to_rt_first_cta_us": summary(&mut start),
        "arrival_to_rt_done_seen_us": summary(&mut end),
    }))
}

struct Model<'a> {
    plan: &'a kairos_ir::plan::Plan,
    inputs: &'a [kairos_ir::Tensor],
}

fn main() {
    let a = args();
    std::fs::create_dir_all(&a.out).expect("cannot create the output folder");
    suite::run_on_gpu0("preempt_bench", |gpu| run(&a, gpu));
}

fn run(a: &Args, gpu: &mut CudaGpu) -> Result<()> {
    let info = gpu.info().clone();
    println!("device {} ({}), {} SMs", info.name, info.arch, info.sm_count);
    gpu.prepare(&[Variant::Protocol])?;
    let stream = gpu.create_stream(0)?;
    let flags = [StopFlag::Host, StopFlag::Device];
    let mut spin = Vec::new();
    for (ns, ctas) in [(2_000u64, 0u32), (10_000, 0), (10_000, 2 * info.sm_count), (50_000, info.sm_count)] {
        for f in flags {
            gpu.set_stop_flag(f)?;
            let mut r = spin_case(gpu, stream, ns, ctas, a.trials)?;
            r["flag"] = json!(flag_name(f));
            println!("spin {} us blocks, {} CTAs, {} flag: {}", ns / 1000, ctas, flag_name(f), r["flag_to_last_cta_left_us"]);
            spin.push(r);
        }
    }
    // REEF's synthetic experiment: chains of N kernels of T µs, preempted or waited for (device flag).
    gpu.set_stop_flag(StopFlag::Device)?;
    let mut chains = Vec::new();
    for (n, t_us) in [(1usize, 50u64), (4, 50), (8, 50), (4, 200)] {
        for preempt in [false, true] {
            // A case that fails is reported and the others still run.
            let r = chain_case(gpu, n, t_us * 1000, preempt, a.trials.min(100))
                .unwrap_or_else(|e| json!({ "kernels": n, "kernel_us": t_us, "preempt": preempt, "error": e.to_string() }));
            println!("chain {n} x {t_us} us, preempt {preempt}: {}", r["arrival_to_rt_first_cta_us"]);
            chains.push(r);
        }
    }
    // Each model's plan autotuned as `serve` loads it, and autotuned under the block budget (the
    // best-effort variant); the host flag on the first only, for the comparison.
    let mut models = Vec::new();
    for (k, m) in a.models.iter().enumerate() {
        let zm = suite::zoo_model(m, DType::F16, 1, 128).map_err(GpuError::Invalid)?;
        for budget in [None, Some(a.block_budget_us * 1000)] {
            let mut plan = zm.plan.clone();
            let opts = TuneOptions { dtypes: vec![DType::F16], progress: false, block_budget_ns: budget, ..Default::default() };
            let tune = autotune_plan(gpu, &mut plan, &opts)?;
            let cases: &[StopFlag] = if budget.is_none() { &flags } else { &[StopFlag::Device] };
            for &f in cases {
                gpu.set_stop_flag(f)?;
                let t = std::time::Instant::now();
                let mut r = model_case(gpu, stream, &plan, &zm.inputs, a.kernel_trials, 1000 + k as u64)?;
                r["flag"] = json!(flag_name(f));
                r["block_budget_us"] = json!(budget.map(|b| b / 1000));
                r["autotune_kernel_ms"] = json!(tune.tuned_kernel_ns as f64 / 1e6);
                println!(
                    "model {m}, {} flag, block budget {:?} us ({:.1} s): {}",
                    flag_name(f),
                    budget.map(|b| b / 1000),
                    t.elapsed().as_secs_f64(),
                    r["flag_to_last_cta_left_us"]
                );
                models.push(r);
            }
        }
    }
    let out = json!({ "device": info.name, "sm_count": info.sm_count, "spin": spin, "chains": chains, "models": models });
    std::fs::write(a.out.join("preempt.json"), serde_json::to_string_pretty(&out).unwrap())
        .map_err(|e| GpuError::Invalid(e.to_string()))?;

    let g = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!();
    println!("preempt flag -> last CTA gone (us; model rows: a random instant of the model's kernels, time-weighted)");
    println!("{:<44} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}", "case", "flag", "mean", "p50", "p90", "p99", "p99.9", "max");
    let row = |case: String, flag: &serde_json::Value, s: &serde_json::Value| {
        println!(
            "{:<44} {:>6} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            case,
            flag.as_str().unwrap_or("?"),
            g(s, "mean"),
            g(s, "p50"),
            g(s, "p90"),
            g(s, "p99"),
            g(s, "p999"),
            g(s, "max")
        )
    };
    for r in &spin {
        let ctas = match r["ctas"].as_u64() {
            Some(0) => "full grid".to_string(),
            Some(c) => format!("{c} CTAs"),
            None => "?".into(),
        };
        row(format!("spin {:.0} us blocks, {ctas}", g(r, "ns_per_block") / 1e3), &r["flag"], &r["flag_to_last_cta_left_us"]);
    }
    for r in &spin {
        row(
            format!("  first CTA gone: spin {:.0} us, ctas {}", g(r, "ns_per_block") / 1e3, r["ctas"]),
            &r["flag"],
            &r["flag_to_first_cta_left_us"],
        );
    }
    for r in &spin {
        row(
            format!("  host sees done: spin {:.0} us, ctas {}", g(r, "ns_per_block") / 1e3, r["ctas"]),
            &r["flag"],
            &r["flag_to_host_sees_done_us"],
        );
    }
    for r in &spin {
        row(
            format!("  preempt call: spin {:.0} us, ctas {}", g(r, "ns_per_block") / 1e3, r["ctas"]),
            &r["flag"],
            &r["preempt_call_us"],
        );
    }
    for r in &chains {
        let what = if r["preempt"].as_bool() == Some(true) { "preempted" } else { "waited for" };
        row(
            format!("RT arrival -> first CTA: chain {} x {:.0} us, {what}", r["kernels"], g(r, "kernel_us")),
            &json!("device"),
            &r["arrival_to_rt_first_cta_us"],
        );
        row(
            format!("RT arrival -> done seen: chain {} x {:.0} us, {what}", r["kernels"], g(r, "kernel_us")),
            &json!("device"),
            &r["arrival_to_rt_done_seen_us"],
        );
    }
    for r in &models {
        let plan = match r["block_budget_us"].as_u64() {
            Some(b) => format!("blocks<={b}us"),
            None => "tuned".into(),
        };
        row(
            format!(
                "{} {plan} ({} kernels, {:.0} us)",
                r["model"].as_str().unwrap_or("?"),
                r["launches"],
                g(r, "kernel_time_us")
            ),
            &r["flag"],
            &r["flag_to_last_cta_left_us"],
        );
    }
    Ok(())
}

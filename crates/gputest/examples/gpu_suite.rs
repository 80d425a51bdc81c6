//! The measurement half of `scripts/gpu-suite.sh` (the tests are the other half): notification
//! latency, the protocol's cost on empty and model kernels, preemption latency, and `kairos
//! profile` of the zoo. Writes `measurements.json` and `profiles.json` into the output folder and
//! prints a short table last.
//!
//! usage: gpu_suite [--out DIR] [--smoke] [--models a,b,..] [--dtypes f16,f32] [--repeats N] [--profile-budget-s S]

use kairos_cuda::{CudaGpu, LaunchOptions, Variant, profile};
use kairos_gpu::profile::ProfileSet;
use kairos_gpu::*;
use kairos_gputest::{self as suite, percentile};
use kairos_ir::DType;
use serde_json::json;
use std::time::Instant;

struct Args {
    out: std::path::PathBuf,
    smoke: bool,
    models: Vec<String>,
    dtypes: Vec<DType>,
    repeats: usize,
    profile_budget_s: f64,
}

fn args() -> Args {
    let mut a = Args {
        out: std::env::var_os("OUT").map(Into::into).unwrap_or_else(|| "out".into()),
        smoke: false,
        models: kairos_ir::zoo::ZOO.iter().map(|e| e.name.to_string()).collect(),
        dtypes: vec![DType::F16, DType::F32],
        repeats: 3,
        profile_budget_s: 240.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{x} needs a value"));
        match x.as_str() {
            "--out" => a.out = val().into(),
            "--smoke" => a.smoke = true,
            "--models" => a.models = val().split(',').map(str::to_string).collect(),
            "--dtypes" => {
                a.dtypes = val().split(',').map(|d| DType::parse(d).unwrap_or_else(|| panic!("unknown dtype {d}"))).collect()
            }
            "--repeats" => a.repeats = val().parse().expect("--repeats N"),
            "--profile-budget-s" => a.profile_budget_s = val().parse().expect("--profile-budget-s S"),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

fn stats(v: &mut [f64]) -> serde_json::Value {
    json!({ "p50": percentile(v, 0.5), "p99": percentile(v, 0.99), "min": percentile(v, 0.0), "max": percentile(v, 1.0), "n": v.len() })
}

/// Launch to the host seeing the first placement record, for a 1-CTA kernel.
fn notification_latency(gpu: &mut CudaGpu, stream: StreamId, n: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let counts = gpu.alloc(4, MemKind::Device)?;
    let o = LaunchOptions { ctas: 1, ..suite::whole_device(gpu, stream) };
    let (mut placed, mut issue) = (Vec::new(), Vec::new());
    let mut events = Vec::new();
    for i in 0..n + 50 {
        let t0 = gpu.now_ns();
        let id = gpu.launch_spin(counts.ptr, 1, 20_000, &o)?;
        let t_issued = gpu.now_ns();
        let t_seen = loop {
            events.clear();
            gpu.poll(&mut events)?;
            if events.iter().any(|e| matches!(e, GpuEvent::CtasPlaced { launch, .. } if *launch == id)) {
                break gpu.now_ns();
            }
        };
        gpu.wait_done(id)?;
        if i >= 50 {
            placed.push(us(t_seen - t0));
            issue.push(us(t_issued - t0));
        }
    }
    gpu.free(counts)?;
    Ok((placed, issue))
}

/// Empty kernels with and without the protocol: device time (events) and host round trip.
fn empty_overhead(gpu: &mut CudaGpu, stream: StreamId, n: usize) -> Result<serde_json::Value> {
    let sms = gpu.info().sm_count;
    let mut out = serde_json::Map::new();
    for (label, ctas) in [("small_grid_1_cta", 1u32), ("large_grid", sms * 8)] {
        let (mut bare, mut proto) = (Vec::new(), Vec::new());
        for i in 0..n + 10 {
            let b = gpu.time_issue(stream, PartitionId::WHOLE, |g| g.launch_empty(ctas, 128, stream).map(|_| None))?;
            let o = LaunchOptions { ctas: if ctas == 1 { 1 } else { 0 }, ..suite::whole_device(gpu, stream) };
            let p = gpu.time_issue(stream, PartitionId::WHOLE, |g| g.launch_noop(ctas, 128, &o).map(Some))?;
            if i >= 10 {
                bare.push(us(b));
                proto.push(us(p));
            }
        }
        let (mut rt_bare, mut rt_proto) = (Vec::new(), Vec::new());
        for i in 0..n + 10 {
            let t0 = gpu.now_ns();
            gpu.launch_empty(ctas, 128, stream)?;
            gpu.synchronize()?;
            let t1 = gpu.now_ns();
            let o = LaunchOptions { ctas: if ctas == 1 { 1 } else { 0 }, ..suite::whole_device(gpu, stream) };
            let id = gpu.launch_noop(ctas, 128, &o)?;
            gpu.wait_done(id)?;
            let t2 = gpu.now_ns();
            if i >= 10 {
                rt_bare.push(us(t1 - t0));
                rt_proto.push(us(t2 - t1));
            }
        }
        out.insert(
            label.into(),
            json!({
                "ctas": ctas,
                "device_us_bare": stats(&mut bare), "device_us_protocol": stats(&mut proto),
                "roundtrip_us_bare_sync": stats(&mut rt_bare), "roundtrip_us_protocol_done_seen": stats(&mut rt_proto),
            }),
        );
    }
    Ok(serde_json::Value::Object(out))
}

/// The protocol's cost on real model kernels: each launch of a plan timed as built (protocol)
/// and as a plain grid, medians summed separately for small and large grids.
fn model_overhead(gpu: &mut CudaGpu, stream: StreamId, model: &str, dtype: DType, repeats: usize) -> Result<serde_json::Value> {
    let m = suite::zoo_model(model, dtype, 1, 128).map_err(GpuError::Invalid)?;
    let bufs = profile::PlanBuffers::new(gpu, &m.plan, &m.inputs, MemKind::Device)?;
    profile::run_plan(gpu, &m.plan, &bufs, stream)?;
    let sms = gpu.info().sm_count;
    let whole = gpu.info().partitions[0].sms;
    let (mut small, mut large) = ([0u64; 2], [0u64; 2]);
    let (mut n_small, mut n_large) = (0, 0);
    let mut args = Vec::new();
    let med = |mut v: Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    for l in &m.plan.launches {
        bufs.bases.resolve_all(&l.args, &mut args);
        let req = LaunchRequest::of_launch(l, &args, whole, PartitionId::WHOLE, stream);
        let mut tp = Vec::new();
        let mut tq = Vec::new();
        for _ in 0..repeats {
            tp.push(gpu.time_launch(&req, Variant::Protocol)?);
            tq.push(gpu.time_launch(&req, Variant::Plain)?);
        }
        let (p, q) = (med(tp), med(tq));
        if l.shape.logical_blocks < sms {
            small[0] += p;
            small[1] += q;
            n_small += 1;
        } else {
            large[0] += p;
            large[1] += q;
            n_large += 1;
        }
    }
    bufs.free(gpu)?;
    let pct = |x: [u64; 2]| if x[1] == 0 { 0.0 } else { (x[0] as f64 / x[1] as f64 - 1.0) * 100.0 };
    Ok(json!({
        "model": model, "dtype": dtype, "launches": m.plan.launches.len(),
        "small_grid": { "launches": n_small, "protocol_us": us(small[0]), "plain_us": us(small[1]), "overhead_pct": pct(small) },
        "large_grid": { "launches": n_large, "protocol_us": us(large[0]), "plain_us": us(large[1]), "overhead_pct": pct(large) },
        "total_overhead_pct": pct([small[0] + large[0], small[1] + large[1]]),
    }))
}

/// From setting the preempt flag on a long launch until its last CTA left (device clock mapped
/// to the host's) and until the host saw LaunchDone. `ctas` 0 fills every SM with the spin
/// kernel's CTAs (16 per SM: a worst case for the exit tail); model kernels run 1-4 per SM.
fn preemption_latency(
    gpu: &mut CudaGpu,
    stream: StreamId,
    ns_per_block: u64,
    ctas: u32,
    trials: usize,
) -> Result<serde_json::Value> {
    let blocks = 4_000_000u32;
    let counts = gpu.alloc(blocks as u64 * 4, MemKind::Device)?;
    let o = LaunchOptions { ctas, ..suite::whole_device(gpu, stream) };
    let mut rng = suite::Rng::new(ns_per_block);
    let (mut dev, mut host, mut at_block) = (Vec::new(), Vec::new(), Vec::new());
    let mut events = Vec::new();
    for _ in 0..trials {
        let id = gpu.launch_spin(counts.ptr, blocks, ns_per_block, &o)?;
        // Wait until it runs, then a random while.
        'placed: loop {
            events.clear();
            gpu.poll(&mut events)?;
            for e in &events {
                if matches!(e, GpuEvent::CtasPlaced { launch, .. } if *launch == id) {
                    break 'placed;
                }
            }
        }
        let t = gpu.now_ns() + 100_000 + (rng.next_u64() % 200_000);
        while gpu.now_ns() < t {}
        let t_flag = gpu.now_ns();
        gpu.preempt(id)?;
        let mut last_left = 0u64;
        let (t_done, next) = 'done: loop {
            events.clear();
            gpu.poll(&mut events)?;
            for e in &events {
                match *e {
                    GpuEvent::CtasFinished { launch, at_ns, .. } if launch == id => last_left = last_left.max(at_ns),
                    GpuEvent::LaunchDone { launch, next_block, preempted, .. } if launch == id => {
                        if !preempted {
                            return Err(GpuError::Driver("the spin launch finished before the preempt flag".into()));
                        }
                        break 'done (gpu.now_ns(), next_block);
                    }
                    _ => {}
                }
            }
        };
        dev.push(last_left.saturating_sub(t_flag) as f64 / 1e3);
        host.push(us(t_done - t_flag));
        at_block.push(next as f64);
    }
    gpu.free(counts)?;
    Ok(json!({
        "ns_per_block": ns_per_block, "ctas": ctas, "trials": trials,
        "flag_to_last_cta_left_us": stats(&mut dev),
        "flag_to_host_sees_done_us": stats(&mut host),
        "stopped_at_block": stats(&mut at_block),
    }))
}

fn main() {
    let a = args();
    let t_start = Instant::now();
    std::fs::create_dir_all(&a.out).expect("cannot create the output folder");
    suite::run_on_gpu0("gpu_suite", |gpu| run(&a, gpu, t_start));
}

fn run(a: &Args, gpu: &mut CudaGpu, t_start: Instant) -> Result<()> {
    let info = gpu.info().clone();
    println!(
        "device {} ({}), {} SMs, {} partitions (granularity {} SMs){}, H2D {:.1} GB/s, D2H {:.1} GB/s, device memory {:.0} GB/s",
        info.name,
        info.arch,
        info.sm_count,
        info.partitions.len(),
        info.partition_granularity_sms,
        gpu.green_note.as_ref().map(|n| format!(" [{n}]")).unwrap_or_default(),
        info.h2d_bytes_per_s / 1e9,
        info.d2h_bytes_per_s / 1e9,
        info.device_mem_bytes_per_s / 1e9
    );
    for p in &info.partitions {
        println!("  partition {}: {:?}", p.id.0, p.sms);
    }
    let compile_ms = gpu.prepare(&[Variant::Protocol, Variant::Plain])?;
    println!("kernel library ready in {compile_ms:.0} ms");
    let stream = gpu.create_stream(0)?;
    let n = if a.smoke { 200 } else { 2000 };
    let (mut placed, mut issue) = notification_latency(gpu, stream, n)?;
    let notif = json!({ "launch_to_first_placement_seen_us": stats(&mut placed), "host_issue_us": stats(&mut issue) });
    println!("notification latency: {notif}");
    let empty = empty_overhead(gpu, stream, if a.smoke { 50 } else { 500 })?;
    println!("empty kernel overhead: {empty}");
    let mut preempt = Vec::new();
    for (ns, ctas) in [(2_000u64, 0), (10_000, 0), (10_000, 2 * info.sm_count)] {
        let p = preemption_latency(gpu, stream, ns, ctas, if a.smoke { 20 } else { 300 })?;
        println!("preemption: {p}");
        preempt.push(p);
    }
    let mut overhead = Vec::new();
    let overhead_models: &[(&str, DType)] = if a.smoke {
        &[("resnet18", DType::F16)]
    } else {
        &[("resnet50", DType::F16), ("bert_base", DType::F16), ("mobilenet_v2", DType::F32)]
    };
    for &(m, d) in overhead_models {
        let o = model_overhead(gpu, stream, m, d, a.repeats.max(3))?;
        println!("model kernel overhead: {o}");
        overhead.push(o);
    }
    let measurements = json!({
        "device": info.name, "arch": info.arch, "sm_count": info.sm_count,
        "partitions": info.partitions.len(), "partition_granularity_sms": info.partition_granularity_sms,
        "h2d_gb_s": info.h2d_bytes_per_s / 1e9, "d2h_gb_s": info.d2h_bytes_per_s / 1e9, "device_mem_gb_s": info.device_mem_bytes_per_s / 1e9,
        "library_prepare_ms": compile_ms,
        "notification": notif, "empty_kernel": empty, "preemption": preempt, "model_kernel_overhead": overhead,
    });
    std::fs::write(a.out.join("measurements.json"), serde_json::to_string_pretty(&measurements).unwrap())
        .map_err(|e| GpuError::Invalid(e.to_string()))?;

    // Profiles, fp16 first, within the time budget.
    let mut set = ProfileSet::default();
    let mut skipped = Vec::new();
    let t_prof = Instant::now();
    let models: Vec<String> = if a.smoke { vec!["resnet18".into()] } else { a.models.clone() };
    for &d in &a.dtypes {
        for m in &models {
            if t_prof.elapsed().as_secs_f64() > a.profile_budget_s {
                skipped.push(format!("{m} {}", d.name()));
                continue;
            }
            let t = Instant::now();
            let zm = match suite::zoo_model(m, d, 1, 128) {
                Ok(z) => z,
                Err(e) => {
                    println!("profile {m} {}: cannot lower: {e}", d.name());
                    skipped.push(format!("{m} {} (lowering: {e})", d.name()));
                    continue;
                }
            };
            match profile::profile_plan(gpu, &zm.plan, a.repeats) {
                Ok(p) => {
                    println!(
                        "profile {m:<14} {}: {:>4} launches, latency {:>8.1} us, kernel time {:>8.1} us, median min_sms {} ({:.1} s)",
                        d.name(),
                        p.kernels.len(),
                        us(p.latency_ns),
                        us(p.kernel_time_ns()),
                        {
                            let mut v: Vec<u32> = p.kernels.iter().map(|k| k.min_sms).collect();
                            v.sort_unstable();
                            v.get(v.len() / 2).copied().unwrap_or(0)
                        },
                        t.elapsed().as_secs_f64()
                    );
                    set.models.push(p);
                }
                Err(e) => {
                    println!("profile {m} {}: failed: {e}", d.name());
                    skipped.push(format!("{m} {} ({e})", d.name()));
                }
            }
        }
    }
    std::fs::write(a.out.join("profiles.json"), serde_json::to_string(&set).unwrap())
        .map_err(|e| GpuError::Invalid(e.to_string()))?;

    // The short table, last.
    let g = |v: &serde_json::Value, path: &[&str]| -> f64 {
        let mut x = v;
        for p in path {
            x = &x[*p];
        }
        x.as_f64().unwrap_or(f64::NAN)
    };
    println!("\n== kairos GPU suite on {} ({} SMs), {:.0} s ==", info.name, info.sm_count, t_start.elapsed().as_secs_f64());
    println!("{:<52} {:>10} {:>10}", "measurement", "p50", "p99");
    println!(
        "{:<52} {:>10.2} {:>10.2}",
        "launch -> first placement seen (us)",
        g(&notif, &["launch_to_first_placement_seen_us", "p50"]),
        g(&notif, &["launch_to_first_placement_seen_us", "p99"])
    );
    println!(
        "{:<52} {:>10.2} {:>10.2}",
        "host issue of a launch (us)",
        g(&notif, &["host_issue_us", "p50"]),
        g(&notif, &["host_issue_us", "p99"])
    );
    for grid in ["small_grid_1_cta", "large_grid"] {
        println!(
            "{:<52} {:>10.2} {:>10.2}",
            format!("empty kernel {grid}: bare device us"),
            g(&empty, &[grid, "device_us_bare", "p50"]),
            g(&empty, &[grid, "device_us_bare", "p99"])
        );
        println!(
            "{:<52} {:>10.2} {:>10.2}",
            format!("empty kernel {grid}: protocol device us"),
            g(&empty, &[grid, "device_us_protocol", "p50"]),
            g(&empty, &[grid, "device_us_protocol", "p99"])
        );
    }
    for p in &preempt {
        let ns = g(p, &["ns_per_block"]);
        let ctas = match g(p, &["ctas"]) as u32 {
            0 => "full".to_string(),
            c => format!("{c} CTAs"),
        };
        println!(
            "{:<52} {:>10.2} {:>10.2}",
            format!("preempt -> last CTA left, {:.0} us blocks, {ctas} (us)", ns / 1e3),
            g(p, &["flag_to_last_cta_left_us", "p50"]),
            g(p, &["flag_to_last_cta_left_us", "p99"])
        );
        println!(
            "{:<52} {:>10.2} {:>10.2}",
            format!("preempt -> host sees done, {:.0} us blocks, {ctas} (us)", ns / 1e3),
            g(p, &["flag_to_host_sees_done_us", "p50"]),
            g(p, &["flag_to_host_sees_done_us", "p99"])
        );
    }
    for o in &overhead {
        println!(
            "{:<52} small {:>5.1}% large {:>5.1}% total {:>5.1}%",
            format!("protocol overhead {} {}", o["model"].as_str().unwrap_or(""), o["dtype"].as_str().unwrap_or("")),
            g(o, &["small_grid", "overhead_pct"]),
            g(o, &["large_grid", "overhead_pct"]),
            g(o, &["total_overhead_pct"])
        );
    }
    println!(
        "profiles: {} written{}",
        set.models.len(),
        if skipped.is_empty() { String::new() } else { format!(", skipped: {}", skipped.join("; ")) }
    );
    Ok(())
}

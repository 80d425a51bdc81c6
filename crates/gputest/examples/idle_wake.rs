//! How long a launch into an idle GPU takes to place its first CTA, against the time the GPU sat
//! idle before it: the number behind RT-Only's "arrival to first block" on DISB (p50 ~100 µs with
//! the GPU idle between requests, ~20 µs while best-effort work keeps it busy; docs/benchmarks.md).
//!
//! For each idle gap (the previous launch seen done by the host, then the host waits the gap), a
//! spin launch of one short block per SM (protocol launch, high-priority stream) is timed from the
//! launch call to its first CTA placed (device clock mapped to the host's), in three settings:
//! - `kernel`: the launch alone;
//! - `copy+kernel`: a 300 KB host-to-device copy first on the same stream (a request's input);
//! - `kept warm`: as `kernel`, with a one-CTA spin launch of 2 µs posted every `--tick-us` on
//!   another stream while the host waits (a heartbeat that keeps the GPU from idling).
//!
//! Writes `idle_wake.json` into the output folder (every sample) and prints a table last.
//!
//! usage: idle_wake [--out DIR] [--trials N] [--tick-us N]

use kairos_cuda::{CudaGpu, LaunchOptions};
use kairos_gpu::*;
use kairos_gputest as suite;
use serde_json::json;

struct Args {
    out: std::path::PathBuf,
    trials: usize,
    tick_us: u64,
}

fn args() -> Args {
    let mut a = Args { out: std::env::var_os("OUT").map(Into::into).unwrap_or_else(|| "out".into()), trials: 200, tick_us: 50 };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{x} needs a value"));
        match x.as_str() {
            "--out" => a.out = val().into(),
            "--trials" => a.trials = val().parse().expect("--trials N"),
            "--tick-us" => a.tick_us = val().parse().expect("--tick-us N"),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// Idle gaps before the timed launch, in µs.
const GAPS_US: [u64; 7] = [0, 20, 100, 500, 2_000, 10_000, 40_000];
/// The timed launch's block time: short, so a trial is about the launch, not the kernel.
const BLOCK_NS: u64 = 2_000;
/// A request-sized input copied before the kernel in `copy+kernel` (a 224x224x3 f16 image).
const INPUT_BYTES: u64 = 224 * 224 * 3 * 2;

#[derive(Clone, Copy, PartialEq)]
enum Setting {
    Kernel,
    CopyKernel,
    KeptWarm,
}

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Setting::Kernel => "kernel",
            Setting::CopyKernel => "copy+kernel",
            Setting::KeptWarm => "kept warm",
        }
    }
}

struct Bufs {
    counts: Allocation,
    tick_counts: Allocation,
    host: Allocation,
    dev: Allocation,
}

/// Polls until every launch in `pending` is done; returns the first CTA placement seen of `timed`.
fn drain(
    gpu: &mut CudaGpu,
    timed: Option<LaunchId>,
    pending: &mut Vec<LaunchId>,
    events: &mut Vec<GpuEvent>,
) -> Result<Option<u64>> {
    let mut placed: Option<u64> = None;
    let deadline = gpu.now_ns() + 10_000_000_000;
    while !pending.is_empty() {
        events.clear();
        gpu.poll(events)?;
        for e in events.iter() {
            match *e {
                GpuEvent::CtasPlaced { launch, at_ns, .. } if Some(launch) == timed => {
                    placed = Some(placed.map_or(at_ns, |p| p.min(at_ns)))
                }
                GpuEvent::LaunchDone { launch, .. } => pending.retain(|&l| l != launch),
                _ => {}
            }
        }
        if gpu.now_ns() > deadline {
            return Err(GpuError::Driver("a launch did not end within 10 s".into()));
        }
    }
    Ok(placed)
}

/// One trial: idle for `gap_ns` (with heartbeats when kept warm), then the timed launch; returns
/// launch call to first CTA placed, in ns.
fn trial(gpu: &mut CudaGpu, s: Setting, gap_ns: u64, tick_ns: u64, rt: StreamId, tick: StreamId, b: &Bufs) -> Result<u64> {
    let mut events = Vec::new();
    let mut pending: Vec<LaunchId> = Vec::new();
    let sms = gpu.info().sm_count;
    let start = gpu.now_ns();
    let mut next_tick = start;
    while gpu.now_ns() < start + gap_ns {
        if s == Setting::KeptWarm && gpu.now_ns() >= next_tick {
            let o = LaunchOptions { ctas: 1, ..suite::whole_device(gpu, tick) };
            pending.push(gpu.launch_spin(b.tick_counts.ptr, 1, BLOCK_NS, &o)?);
            next_tick += tick_ns;
        }
        events.clear();
        gpu.poll(&mut events)?;
        for e in &events {
            if let GpuEvent::LaunchDone { launch, .. } = *e {
                pending.retain(|&l| l != launch);
            }
        }
    }
    let t_call = gpu.now_ns();
    if s == Setting::CopyKernel {
        gpu.copy_async(b.dev.ptr, b.host.ptr, INPUT_BYTES, rt)?;
    }
    let o = LaunchOptions { ctas: sms, ..suite::whole_device(gpu, rt) };
    let l = gpu.launch_spin(b.counts.ptr, sms, BLOCK_NS, &o)?;
    pending.push(l);
    let placed = drain(gpu, Some(l), &mut pending, &mut events)?;
    Ok(placed.unwrap_or(t_call).saturating_sub(t_call))
}

fn main() {
    let a = args();
    std::fs::create_dir_all(&a.out).expect("cannot create the output folder");
    suite::run_on_gpu0("idle_wake", |gpu| run(&a, gpu));
}

fn run(a: &Args, gpu: &mut CudaGpu) -> Result<()> {
    let info = gpu.info().clone();
    println!("device {} ({}), {} SMs", info.name, info.arch, info.sm_count);
    gpu.prepare(&[kairos_cuda::Variant::Protocol])?;
    let rt = gpu.create_stream(5)?;
    let tick = gpu.create_stream(0)?;
    let b = Bufs {
        counts: gpu.alloc(info.sm_count as u64 * 4, MemKind::Device)?,
        tick_counts: gpu.alloc(4, MemKind::Device)?,
        host: gpu.alloc(INPUT_BYTES, MemKind::HostMapped)?,
        dev: gpu.alloc(INPUT_BYTES, MemKind::Device)?,
    };
    // Warm the paths once.
    for s in [Setting::Kernel, Setting::CopyKernel, Setting::KeptWarm] {
        trial(gpu, s, 0, a.tick_us * 1000, rt, tick, &b)?;
    }
    let mut rows = Vec::new();
    for &gap_us in &GAPS_US {
        for s in [Setting::Kernel, Setting::CopyKernel, Setting::KeptWarm] {
            if s == Setting::KeptWarm && gap_us * 1000 < 2 * a.tick_us * 1000 {
                continue;
            }
            let mut v = Vec::with_capacity(a.trials);
            for _ in 0..a.trials {
                v.push(trial(gpu, s, gap_us * 1000, a.tick_us * 1000, rt, tick, &b)? as f64 / 1e3);
            }
            let raw = v.clone();
            let mut p = |q: f64| suite::percentile(&mut v, q);
            let (p50, p90, p99) = (p(0.5), p(0.9), p(0.99));
            println!("gap {gap_us:>6} us, {:<12}: call -> first CTA p50 {p50:.1} p90 {p90:.1} p99 {p99:.1} us", s.name());
            rows.push(
                json!({ "gap_us": gap_us, "setting": s.name(), "p50_us": p50, "p90_us": p90, "p99_us": p99, "samples_us": raw }),
            );
        }
    }
    gpu.free(b.counts)?;
    gpu.free(b.tick_counts)?;
    gpu.free(b.host)?;
    gpu.free(b.dev)?;
    let out =
        json!({ "device": info.name, "tick_us": a.tick_us, "block_ns": BLOCK_NS, "input_bytes": INPUT_BYTES, "rows": rows });
    std::fs::write(a.out.join("idle_wake.json"), serde_json::to_string_pretty(&out).unwrap())
        .map_err(|e| GpuError::Invalid(e.to_string()))?;
    println!();
    println!(
        "launch call -> first CTA placed after an idle gap (us; {} trials; kept warm: a 1-CTA launch every {} us)",
        a.trials, a.tick_us
    );
    println!("{:>9} {:<12} {:>8} {:>8} {:>8}", "gap us", "setting", "p50", "p90", "p99");
    for r in &rows {
        println!(
            "{:>9} {:<12} {:>8.1} {:>8.1} {:>8.1}",
            r["gap_us"],
            r["setting"].as_str().unwrap_or("?"),
            r["p50_us"].as_f64().unwrap_or(f64::NAN),
            r["p90_us"].as_f64().unwrap_or(f64::NAN),
            r["p99_us"].as_f64().unwrap_or(f64::NAN)
        );
    }
    Ok(())
}

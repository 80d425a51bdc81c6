//! What a hardware partition costs a stream of launches (the `+green` mechanism of `krisp` and
//! `static`): one stream, a chain of light spin launches (protocol.cuh point 7: end record only,
//! what a policy that does not preempt sends), 1 µs blocks, one CTA per block, placed
//!
//!   whole       on the whole device (the reference: no partition, no mask)
//!   one         all on one green context of four SM groups (32 SMs on an H100/H200)
//!   alternate   alternately on two such green contexts (disjoint groups): every launch moves the
//!               stream to another context, so the backend records an event on the old
//!               context's stream and makes the new one wait for it
//!   union-new   a green context over a union of groups made for the first time (creation and the
//!               SM probe; what the first launch on a new union pays once)
//!
//! For each: host time per launch call (µs), and device time per launch from the first one's
//! release to the last one's end (µs). Prints a table and, with `--out FILE`, JSON.
//!
//! usage: partition_switch [--launches N] [--blocks B] [--out FILE]

use kairos_cuda::{CudaGpu, LaunchOptions};
use kairos_gpu::*;
use serde_json::json;
use std::time::Instant;

/// Where launch i of a chain goes: (partition, mask, light).
type Placement = Box<dyn Fn(usize) -> (PartitionId, SmMask, bool)>;

struct Point {
    name: &'static str,
    host_us_per_launch: f64,
    device_us_per_launch: f64,
}

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1).cloned())
}

/// Queues `launches` spin launches of `blocks` 1-µs blocks on `stream`, placed by `place(i)`
/// (partition, mask, light); returns (host µs per launch call, device µs per launch).
fn chain(
    gpu: &mut CudaGpu,
    counts: DevicePtr,
    stream: StreamId,
    launches: usize,
    blocks: u32,
    place: impl Fn(usize) -> (PartitionId, SmMask, bool),
) -> Result<(f64, f64)> {
    let mut ids = Vec::with_capacity(launches);
    let t0 = Instant::now();
    let first_ns = gpu.now_ns();
    for i in 0..launches {
        let (partition, sm_mask, light) = place(i);
        let o = LaunchOptions { first_block: 0, ctas: 0, sm_mask, partition, stream, sm_bitmap: None, after: None };
        let id = if light {
            gpu.launch_spin_light(counts, blocks, 1_000, &o, false)?
        } else {
            gpu.launch_spin(counts, blocks, 1_000, &o)?
        };
        ids.push(id);
    }
    let host_us = t0.elapsed().as_secs_f64() * 1e6 / launches as f64;
    for id in ids {
        gpu.wait_done(id)?;
    }
    let device_us = (gpu.now_ns() - first_ns) as f64 / 1e3 / launches as f64;
    Ok((host_us, device_us))
}

fn main() -> Result<()> {
    // Every launch holds a protocol slot until the host reads its end: stay below the 1024 slots.
    let launches: usize = arg("--launches").map(|v| v.parse().expect("--launches N")).unwrap_or(800).min(1000);
    let blocks: u32 = arg("--blocks").map(|v| v.parse().expect("--blocks B")).unwrap_or(64);
    let mut gpu = CudaGpu::new(0)?;
    let groups = gpu.sm_groups();
    if groups.len() < 8 {
        eprintln!("partition_switch: the device has {} SM groups (no green contexts?): nothing to measure", groups.len());
        return Ok(());
    }
    let whole = gpu.info().partitions[0].sms;
    let stream = gpu.create_stream(0)?;
    let counts = gpu.alloc(blocks as u64 * 4, MemKind::Device)?;
    let (a_bits, b_bits) = (0b1111u64, 0b1111_0000u64);
    let a = gpu.partition_of_groups(a_bits)?;
    let b = gpu.partition_of_groups(b_bits)?;
    let a_sms = gpu.info().partitions[a.0 as usize].sms;
    let b_sms = gpu.info().partitions[b.0 as usize].sms;
    // Warm-up: compile and load the spin kernel, create the streams of both contexts.
    chain(&mut gpu, counts.ptr, stream, 50, blocks, |i| if i % 2 == 0 { (a, a_sms, true) } else { (b, b_sms, true) })?;
    let mut points = Vec::new();
    let runs: [(&'static str, Placement); 3] = [
        ("whole", Box::new(move |_| (PartitionId::WHOLE, whole, true))),
        ("one", Box::new(move |_| (a, a_sms, true))),
        ("alternate", Box::new(move |i| if i % 2 == 0 { (a, a_sms, true) } else { (b, b_sms, true) })),
    ];
    for (name, place) in runs.iter() {
        let (host, device) = chain(&mut gpu, counts.ptr, stream, launches, blocks, place)?;
        points.push(Point { name, host_us_per_launch: host, device_us_per_launch: device });
    }
    // A union never asked for before: creation and probe, once.
    let fresh_bits = (1u64 << 1) | (1 << 3) | (1 << 5) | (1 << 7);
    let t0 = Instant::now();
    gpu.partition_of_groups(fresh_bits)?;
    let made_us = t0.elapsed().as_secs_f64() * 1e6;
    points.push(Point { name: "union-new", host_us_per_launch: made_us, device_us_per_launch: f64::NAN });
    println!("{launches} launches of {blocks} blocks of 1 µs on one stream ({} SM groups; partitions of 4 groups)", groups.len());
    println!("| placement | host µs per launch call | device µs per launch |");
    println!("|---|---:|---:|");
    for p in &points {
        println!("| {} | {:.2} | {:.2} |", p.name, p.host_us_per_launch, p.device_us_per_launch);
    }
    if let Some(out) = arg("--out") {
        let v = json!({
            "device": gpu.info().name, "launches": launches, "blocks": blocks, "block_ns": 1000,
            "groups": groups.len(), "a_sms": a_sms.count(), "b_sms": b_sms.count(),
            "points": points.iter().map(|p| json!({
                "placement": p.name, "host_us_per_launch": p.host_us_per_launch,
                "device_us_per_launch": if p.device_us_per_launch.is_finite() { json!(p.device_us_per_launch) } else { json!(null) },
            })).collect::<Vec<_>>(),
        });
        std::fs::write(&out, serde_json::to_string_pretty(&v).expect("json")).expect("write --out");
    }
    gpu.free(counts)?;
    Ok(())
}

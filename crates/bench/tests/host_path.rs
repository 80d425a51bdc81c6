//! The serving engine's host path per request on the simulator (`LatencyDesc::request_host_ns`):
//! a virtual run charges it on top of the dispatcher and the simulated GPU, and with 0 (every
//! description but the H100 SXM's) it runs exactly as before.

use kairos_bench::experiment::{lower_models, register_on_sim};
use kairos_bench::target::{Completion, Target, VirtualTarget};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::DType;
use kairos_sched::{Config, RequestOptions};
use kairos_sim::{GpuDesc, SimGpu, SimOptions};
use std::path::Path;

/// Latencies of `n` resnet18 requests on the simulated H100 SXM, each alone (10 ms apart).
fn latencies(host_ns: Option<u64>, n: u64) -> Vec<u64> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let profiles = ProfileSet::load_dir(&repo.join("data/profiles/h100_sxm")).unwrap();
    let catalog = lower_models(&["resnet18".to_string()], DType::F16, &profiles, |_, _| {}).unwrap();
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions::timing_only(5));
    register_on_sim(&mut gpu, &catalog).unwrap();
    let mut target = VirtualTarget::new(gpu, true);
    if let Some(ns) = host_ns {
        target = target.with_request_host_ns(ns);
    }
    target.begin(&Config::default()).unwrap();
    target.load_model(catalog.get("resnet18").unwrap()).unwrap();
    let mut out: Vec<Completion> = Vec::new();
    let mut got = Vec::new();
    for tag in 0..n {
        // Idle until the arrival, then one request, waited for.
        let arrival = target.now_ns() + 10_000_000;
        target.wait(arrival, &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(target.now_ns(), arrival);
        target.submit(tag, "resnet18", arrival, RequestOptions { skip_io: true, ..RequestOptions::default() }).unwrap();
        while out.is_empty() {
            let until = target.now_ns() + 1_000_000_000;
            target.wait(until, &mut out).unwrap();
        }
        let c = out.pop().unwrap();
        assert_eq!(c.tag, tag);
        c.result.unwrap();
        got.push(c.done_ns - arrival);
    }
    target.end().unwrap();
    got
}

#[test]
fn a_virtual_run_charges_each_request_the_engines_host_path() {
    let charge = GpuDesc::h100_sxm().latency.request_host_ns;
    assert!(charge > 0, "the H100 SXM description measures the host path");
    assert!(GpuDesc::h200().latency.request_host_ns > 0, "and so does the H200's");
    assert_eq!(GpuDesc::h100_pcie().latency.request_host_ns, 0, "the H100 PCIe's is not measured, so not charged");
    let base = latencies(None, 5);
    // 0 is no charge: the very same run.
    assert_eq!(latencies(Some(0), 5), base);
    // With the charge each request's latency grows by about it (the same GPU work, later).
    let charged = latencies(Some(charge), 5);
    for (b, c) in base.iter().zip(&charged) {
        let grew = *c as i64 - *b as i64;
        assert!((grew - charge as i64).abs() <= 5_000, "latency {b} -> {c} ns: grew by {grew}, charge {charge}");
    }
}

//! A profile of an older lowering (some launches' block counts changed since it was measured):
//! the dispatcher's estimates take the roofline, the simulator still times the launches the
//! profile describes unchanged.

use kairos_bench::experiment::{lower_models, register_on_sim};
use kairos_gpu::profile::ProfileSet;
use kairos_gpu::synthetic;
use kairos_ir::DType;
use kairos_sim::{GpuDesc, SimGpu, SimOptions};

#[test]
fn a_partly_stale_profile_times_the_unchanged_launches_on_the_simulator() {
    let models = ["squeezenet1_1".to_string()];
    let plain = lower_models(&models, DType::F16, &ProfileSet::default(), |_, _| {}).unwrap();
    let plan = plain.get("squeezenet1_1").unwrap().plan.clone();
    let fresh = synthetic::chain_profile(&plan, 20_000, "NVIDIA H100 80GB HBM3", 132);
    let mut stale = fresh.clone();
    let last = stale.kernels.len() - 1;
    stale.kernels[last].logical_blocks += 1;
    for (profile, whole, timed) in [(fresh, true, plan.launches.len()), (stale, false, plan.launches.len() - 1)] {
        let set = ProfileSet { models: vec![profile] };
        let catalog = lower_models(&models, DType::F16, &set, |_, _| {}).unwrap();
        let spec = catalog.get("squeezenet1_1").unwrap();
        assert_eq!(spec.profile.is_some(), whole, "only a whole profile reaches the dispatcher");
        assert_eq!(catalog.sim_timing(spec).map(|p| p.kernels.len()), Some(timed));
        let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions::timing_only(1));
        assert_eq!(register_on_sim(&mut gpu, &catalog).unwrap(), 1);
        // Timing is per distinct kernel, so count those the simulator learned.
        let distinct = |n: usize| {
            let mut ks: Vec<String> = plan.launches[..n].iter().map(|l| format!("{:?}", l.kernel)).collect();
            ks.sort();
            ks.dedup();
            ks.len()
        };
        assert_eq!(gpu.registered_kernels(), distinct(timed));
    }
}

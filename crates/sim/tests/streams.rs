//! Streams are a bounded resource: destroying them gives the budget back, and a destroyed id is dead.

use kairos_gpu::{Gpu, GpuError, StreamId};
use kairos_sim::{GpuDesc, SimGpu, SimOptions};

#[test]
fn destroyed_streams_free_the_budget_and_stay_dead() {
    let mut gpu = SimGpu::new(GpuDesc::h100_sxm(), SimOptions::timing_only(1));
    let max = kairos_sim::STREAMS_MAX;
    let live: Vec<StreamId> = (0..max).map(|_| gpu.create_stream(0).unwrap()).collect();
    assert!(matches!(gpu.create_stream(0), Err(GpuError::Exhausted { .. })), "the limit holds");
    for s in &live[..10] {
        gpu.destroy_stream(*s).unwrap();
    }
    for _ in 0..10 {
        let s = gpu.create_stream(0).unwrap();
        assert!(!live.contains(&s), "a destroyed id was handed out again");
    }
    assert!(matches!(gpu.create_stream(0), Err(GpuError::Exhausted { .. })));
    assert!(gpu.destroy_stream(live[0]).is_err(), "destroying twice is an error");
    assert!(gpu.destroy_stream(StreamId(u32::MAX)).is_err());
}

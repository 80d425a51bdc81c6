//! kairos-backends: the engines a server drives, beside each other — [`SimBackend`] (the simulator
//! of kairos-sim) and [`CudaBackend`] (real GPUs through kairos-cuda) — both implementing
//! [`kairos_server::Backend`]. The server knows neither; the binary picks one.

#![forbid(unsafe_code)]

mod cuda;
mod sim;
mod sim_gpu;

pub use cuda::{CudaBackend, TEST_HANG_BLOCK_NS, TestFaults};
pub use sim::SimBackend;
pub use sim_gpu::SimStartProfiles;

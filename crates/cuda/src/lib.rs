//! kairos-cuda: the `Gpu` trait on NVIDIA GPUs, through the CUDA driver API (cudarc 0.19,
//! loaded at run time, so this crate builds and its non-GPU tests run on machines without CUDA).
//!
//! Layers, as in cudarc: cudarc's `driver::sys` (raw FFI) -> [`driver`] (one checked wrapper per
//! call, `unsafe` where the caller must uphold a contract) -> [`safe`] (owning RAII types) ->
//! [`CudaGpu`] (the `Gpu` implementation). All unsafe code of kairos lives in this crate.
//!
//! - [`nvrtc`]: compiles `kairos_kernels::source` to CUBIN for the device, unit by unit in
//!   parallel, with an on-disk cache and images embedded at build time.
//! - [`progress`]: progress of compilation and autotuning on stderr, and the activity line a
//!   server reports while it is not ready.
//! - [`protocol`]: the host side of the kernel protocol (launch slots, preempt flags in mapped
//!   pinned memory, the notification ring).
//! - [`profile`]: `kairos profile` (per-kernel durations, resources, KRISP's min SMs).
//! - [`autotune`]: tile configurations per launch shape, timed at model load and cached on disk.
//! - [`hostmap`]: caller memory mapped into the device for zero-copy I/O (`Gpu::map_host`).
//! - [`launcher`]: launcher threads that make the driver call of each launch beside the
//!   dispatcher thread (`KAIROS_LAUNCH_THREADS`, default 2; 0 launches on the caller's thread).
//! - [`settings`]: the process-wide settings a program installs once ([`configure`]); this crate
//!   never reads the environment on its own ([`Settings::from_env`] does, when a program asks).
//!
//! Entry points for the binary: [`CudaGpu::new`] (a clear `GpuError::NoDevice` without a driver
//! or GPU), then `kairos_gpu::exec::{upload_weights, execute_plan}` for `kairos run --backend
//! cuda`, and [`profile::profile_plan`] for `kairos profile`.

pub mod autotune;
pub mod driver;
pub mod gpu;
pub mod hostmap;
pub mod launcher;
pub mod nvrtc;
pub mod peer;
pub mod profile;
pub mod progress;
pub mod protocol;
pub mod safe;
pub mod settings;
pub mod topology;

pub use autotune::{TuneOptions, autotune_plan};
pub use gpu::{CudaGpu, HeldTiming, LAUNCH_THREADS_DEFAULT, LaunchCosts, LaunchOptions, read_sm_bitmap};
pub use nvrtc::Variant;
pub use profile::{profile_plan, profile_plan_with};
pub use settings::{Settings, UrgentLaunches, configure, settings};

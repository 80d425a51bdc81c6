//! Real NVIDIA GPUs as a server backend: [`CudaBackend`] starts one engine per GPU through
//! kairos-cuda, autotunes fp16 plans when they load, and attaches secondary GPUs for parallel
//! transmission.

use kairos_gpu::profile::ProfileSet;
use kairos_sched::{Engine, EngineConfig};
use kairos_server::state::PlannedModel;
use kairos_server::{Backend, EngineHandle, ServeError};

/// Real GPUs through kairos-cuda.
pub struct CudaBackend {
    pub engine: EngineConfig,
    /// Staging memory each secondary reserves for a primary under a parallel cold strategy.
    pub peer_staging_bytes: u64,
    pub profiles: Option<ProfileSet>,
    /// Autotune fp16 convolution and matrix-product tiles when a model is loaded.
    pub autotune: bool,
    /// Kernel units not compiled yet serve first on their quick builds (`CudaGpu::set_quick_builds`).
    pub quick_builds: bool,
    /// Tests only: faults to inject (`kairos serve --test-fault-at-launch`, `--test-hang-at-launch`).
    pub test_faults: TestFaults,
}

/// Faults a test asks the CUDA backend to inject into its GPUs' engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TestFaults {
    /// The launch that writes to an unmapped address (`CudaGpu::inject_fault_at_launch`).
    pub fault_at_launch: Option<u64>,
    /// The launch before which a kernel fills every SM for [`TEST_HANG_BLOCK_NS`] per block
    /// (`CudaGpu::inject_hang_at_launch`).
    pub hang_at_launch: Option<u64>,
}

/// How long each block of the test hang's kernel spins: far past any watchdog bound (and each CTA
/// runs one or two blocks), so that only the process's exit (or a reset's wait) ends it.
pub const TEST_HANG_BLOCK_NS: u64 = 300_000_000_000;

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        "cuda".into()
    }

    fn start(&self, gpu: u32, _models: &[&PlannedModel]) -> Result<(EngineHandle, String), ServeError> {
        // Kernel units not compiled yet serve first on their quick builds, swapped for the optimized
        // builds as those finish compiling in the background.
        let quick = self.quick_builds;
        let parallel = self.engine.dispatcher.weight_budget_bytes.is_some() && self.engine.dispatcher.cold_strategy.is_parallel();
        let staging_bytes = self.peer_staging_bytes;
        let faults = self.test_faults;
        let engine = Engine::start(self.engine.clone(), move || {
            kairos_cuda::CudaGpu::new(gpu).map(|mut g| {
                g.set_quick_builds(quick);
                if parallel {
                    attach_secondaries(&mut g, gpu, staging_bytes);
                }
                if let Some(n) = faults.fault_at_launch {
                    tracing::warn!(gpu, launch = n, "test fault armed: this launch will write to an unmapped address");
                    g.inject_fault_at_launch(n);
                }
                if let Some(n) = faults.hang_at_launch {
                    tracing::warn!(gpu, launch = n, "test hang armed: a kernel will fill every SM before this launch");
                    g.inject_hang_at_launch(n, TEST_HANG_BLOCK_NS);
                }
                g
            })
        })
        .map_err(|e| ServeError::Internal(format!("GPU {gpu}: {e}")))?;
        let name = engine.device().name.clone();
        Ok((EngineHandle::InProcess(engine), name))
    }

    fn profiles(&self) -> Option<&ProfileSet> {
        self.profiles.as_ref()
    }

    /// What the CUDA backend is preparing (kernel units compiling, shapes autotuning), for the
    /// not-ready reason of `/v2/health/ready`.
    fn activity(&self) -> Option<String> {
        kairos_cuda::progress::activity()
    }

    fn prepare(&self, plan: &mut kairos_ir::plan::Plan) -> Result<Option<String>, ServeError> {
        if !self.autotune || plan.dtype != kairos_ir::DType::F16 {
            return Ok(None);
        }
        // Tuned on GPU 0 (instances on other GPUs of the same kind share the choice); choices
        // are cached beside the CUBIN cache, so a model seen before times nothing.
        let mut gpu = kairos_cuda::CudaGpu::new(0).map_err(|e| ServeError::Internal(format!("autotuner: {e}")))?;
        // The plan's own units as quick builds when not compiled yet (the engine loads them from
        // the cache next); only optimized builds are timed.
        gpu.set_quick_builds(self.quick_builds);
        // Bounded first load: candidates whose kernel units are not compiled yet are left out
        // (and compiled in the background for the next load) rather than waited for.
        let opts = kairos_cuda::TuneOptions {
            dtypes: vec![plan.dtype],
            progress: true,
            compile_all_candidates: false,
            ..Default::default()
        };
        let r = kairos_cuda::autotune_plan(&mut gpu, plan, &opts).map_err(|e| ServeError::Internal(format!("autotuner: {e}")))?;
        Ok(Some(format!(
            "autotuned: {} shapes ({} timed now, {} from the cache{}), {} launches retiled, kernel time {:.3} -> {:.3} ms in {:.0} ms",
            r.shapes,
            r.timed,
            r.from_table,
            if r.partial { "; without the candidates still compiling" } else { "" },
            r.launches_changed,
            r.plan_kernel_ns as f64 / 1e6,
            r.tuned_kernel_ns as f64 / 1e6,
            r.elapsed_ms
        )))
    }
}

/// Attaches the secondaries the topology picks for `gpu` (NVLink peers behind other PCIe
/// switches, DeepPlan 4.3.3); a secondary that cannot be attached is left out with a warning
/// (cold loads then go through fewer GPUs, down to this one alone).
fn attach_secondaries(g: &mut kairos_cuda::CudaGpu, gpu: u32, staging_bytes: u64) {
    let topology = match kairos_cuda::topology::read() {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(gpu, "parallel transmission off: the GPU topology could not be read: {e}");
            return;
        }
    };
    let secondaries = topology.secondaries_for(gpu, usize::MAX);
    if secondaries.is_empty() {
        tracing::warn!(gpu, "parallel transmission off: no secondary GPU with NVLink to this one (see `kairos inspect --gpus`)");
    }
    for s in secondaries {
        match g.attach_peer(s, staging_bytes) {
            Ok(p) => tracing::info!(
                gpu,
                secondary = s,
                h2d_gbps = p.h2d_bytes_per_s / 1e9,
                forward_gbps = p.forward_bytes_per_s / 1e9,
                staging_mib = p.staging_bytes >> 20,
                "secondary GPU attached for parallel transmission"
            ),
            Err(e) => tracing::warn!(gpu, secondary = s, "secondary GPU not attached: {e}"),
        }
    }
}

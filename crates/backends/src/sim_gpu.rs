//! The simulated GPU as [`crate::SimBackend`] starts it: a [`SimGpu`] with an inbox of measured
//! profiles to register.
//!
//! The server starts its engines before it plans any model, so the simulator cannot register the
//! profiles of the start-up models when its GPU is built (it did when every model was planned
//! first). Instead the loader puts a start-up model's plan and profile in the inbox of each of its
//! GPUs ([`kairos_server::Backend::register_start_model`]) before the model loads, and the GPU registers
//! them on its dispatcher thread at its next [`Gpu::kernel_resources`] call — the first thing the
//! dispatcher asks of a model it loads, so the model's kernels are timed from its profile from its
//! first launch on.

use kairos_gpu::profile::ModelProfile;
use kairos_gpu::{
    Allocation, CopyId, DeviceInfo, DevicePtr, Gpu, GpuEvent, HostMapping, HostMappingId, HostMemory, KernelResources, LaunchId,
    LaunchRequest, MemKind, PeerPath, Result, RunId, StreamId,
};
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape, Plan};
use kairos_sim::SimGpu;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Plans and profiles waiting to be registered with one simulated GPU.
#[derive(Default)]
pub(crate) struct ProfileInbox {
    pending: Mutex<Vec<(Arc<Plan>, ModelProfile)>>,
    /// Something is pending (read without the lock on every `kernel_resources` call).
    any: AtomicBool,
}

impl ProfileInbox {
    pub(crate) fn push(&self, plan: Arc<Plan>, profile: ModelProfile) {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).push((plan, profile));
        self.any.store(true, Ordering::Release);
    }

    fn drain_into(&self, gpu: &mut SimGpu) -> Result<()> {
        if !self.any.load(Ordering::Acquire) {
            return Ok(());
        }
        let pending = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            self.any.store(false, Ordering::Release);
            std::mem::take(&mut *p)
        };
        for (plan, profile) in pending {
            gpu.register_plan(&plan, &profile)?;
        }
        Ok(())
    }
}

/// The inboxes of the GPUs a [`crate::SimBackend`] started, by GPU index. Leave it at its default:
/// the backend fills it when the server starts its engines.
#[derive(Default)]
pub struct SimStartProfiles(Mutex<BTreeMap<u32, Arc<ProfileInbox>>>);

impl std::fmt::Debug for SimStartProfiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("SimStartProfiles").field("gpus", &m.keys().collect::<Vec<_>>()).finish()
    }
}

impl SimStartProfiles {
    /// A fresh inbox for GPU `gpu` (replacing the one of an earlier start).
    pub(crate) fn open(&self, gpu: u32) -> Arc<ProfileInbox> {
        let inbox = Arc::new(ProfileInbox::default());
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(gpu, inbox.clone());
        inbox
    }

    /// Queues a plan's profile for GPU `gpu`; false when that GPU was not started.
    pub(crate) fn push(&self, gpu: u32, plan: Arc<Plan>, profile: ModelProfile) -> bool {
        let inbox = self.0.lock().unwrap_or_else(|e| e.into_inner()).get(&gpu).cloned();
        match inbox {
            Some(i) => {
                i.push(plan, profile);
                true
            }
            None => false,
        }
    }
}

/// A [`SimGpu`] that registers the profiles of its inbox before it answers `kernel_resources`.
/// Every other call goes straight to the simulator. (A method the `Gpu` trait gains with a default
/// must be forwarded here too if `SimGpu` overrides it.)
pub(crate) struct InboxSimGpu {
    pub(crate) gpu: SimGpu,
    pub(crate) inbox: Arc<ProfileInbox>,
    /// With [`crate::SimBackend::real_time`]: the wall clock and the simulated clock when the GPU
    /// first waited; the simulated clock is kept from running ahead of the wall clock since then.
    pub(crate) pace: Option<Option<(std::time::Instant, u64)>>,
}

impl InboxSimGpu {
    /// Sleeps while the simulated clock is ahead of the wall clock (real-time pacing only).
    fn pace(&mut self) {
        let Some(start) = &mut self.pace else { return };
        let now_ns = self.gpu.now_ns();
        let (wall, v0) = *start.get_or_insert((std::time::Instant::now(), now_ns));
        let ahead_ns = now_ns.saturating_sub(v0).saturating_sub(wall.elapsed().as_nanos() as u64);
        if ahead_ns > 0 {
            std::thread::sleep(std::time::Duration::from_nanos(ahead_ns));
        }
    }
}

impl Gpu for InboxSimGpu {
    fn info(&self) -> &DeviceInfo {
        self.gpu.info()
    }

    fn now_ns(&self) -> u64 {
        self.gpu.now_ns()
    }

    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        self.gpu.alloc(bytes, kind)
    }

    fn free(&mut self, allocation: Allocation) -> Result<()> {
        self.gpu.free(allocation)
    }

    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.gpu.write(dst, data)
    }

    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.gpu.read(src, out)
    }

    fn copy_async(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<CopyId> {
        self.gpu.copy_async(dst, src, bytes, stream)
    }

    fn wait_copy(&mut self, stream: StreamId, copy: CopyId) -> Result<()> {
        self.gpu.wait_copy(stream, copy)
    }

    fn peer_busy(&self, peer: usize) -> bool {
        self.gpu.peer_busy(peer)
    }

    fn peer_paths(&self) -> Vec<PeerPath> {
        self.gpu.peer_paths()
    }

    fn copy_via_peer(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, peer: usize) -> Result<CopyId> {
        self.gpu.copy_via_peer(dst, src, bytes, peer)
    }

    fn record_run(&mut self, launches: &[LaunchRequest<'_>]) -> Result<RunId> {
        self.gpu.record_run(launches)
    }

    fn launch_run(&mut self, run: RunId, stream: StreamId, ids: &mut Vec<LaunchId>) -> Result<()> {
        self.gpu.launch_run(run, stream, ids)
    }

    fn drop_run(&mut self, run: RunId) -> Result<()> {
        self.gpu.drop_run(run)
    }

    fn create_stream(&mut self, priority: i32) -> Result<StreamId> {
        self.gpu.create_stream(priority)
    }

    fn destroy_stream(&mut self, stream: StreamId) -> Result<()> {
        self.gpu.destroy_stream(stream)
    }

    fn kernel_resources(&mut self, kernel: &Kernel, dtype: DType, shape: &LaunchShape) -> Result<KernelResources> {
        self.inbox.drain_into(&mut self.gpu)?;
        self.gpu.kernel_resources(kernel, dtype, shape)
    }

    fn launch(&mut self, request: &LaunchRequest<'_>) -> Result<LaunchId> {
        self.gpu.launch(request)
    }

    fn preempt(&mut self, launch: LaunchId) -> Result<()> {
        self.gpu.preempt(launch)
    }

    fn sm_groups(&self) -> Vec<kairos_gpu::SmMask> {
        self.gpu.sm_groups()
    }

    fn partition_of_groups(&mut self, groups: u64) -> Result<kairos_gpu::PartitionId> {
        self.gpu.partition_of_groups(groups)
    }

    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        self.gpu.poll(events)
    }

    fn wait(&mut self, until_ns: u64) -> Result<()> {
        let r = self.gpu.wait(until_ns);
        self.pace();
        r
    }

    fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping> {
        self.gpu.map_host(memory)
    }

    fn unmap_host(&mut self, id: HostMappingId) -> Result<()> {
        self.gpu.unmap_host(id)
    }

    fn reset(&mut self) -> Result<()> {
        self.gpu.reset()
    }
}

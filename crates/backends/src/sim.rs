//! The simulator as a server backend: [`SimBackend`] starts one engine per simulated GPU.

use crate::sim_gpu::{InboxSimGpu, SimStartProfiles};
use kairos_gpu::profile::{ModelProfile, ProfileSet};
use kairos_ir::plan::Plan;
use kairos_sched::{Engine, EngineConfig};
use kairos_server::state::PlannedModel;
use kairos_server::{Backend, EngineHandle, ServeError};
use std::sync::Arc;

/// The simulated GPU of `kairos-sim`, with computation on by default (results are real: the CPU
/// reference kernels run every logical block). The measured profiles of the start-up models are
/// registered with the simulator's timing model as they load; models loaded later through the
/// repository API run on its roofline timing.
pub struct SimBackend {
    pub desc: kairos_sim::GpuDesc,
    pub seed: u64,
    pub compute: bool,
    pub engine: EngineConfig,
    pub profiles: Option<ProfileSet>,
    /// Keep the simulated clock from running ahead of the wall clock, so that a kernel takes its
    /// simulated time in real time (off by default: the simulator runs as fast as it can). Tests of
    /// timeouts, drains and cancellations use it to make requests that last.
    pub real_time: bool,
    /// Filled when the server starts the engines; leave it at its default.
    pub start_profiles: SimStartProfiles,
}

impl SimBackend {
    pub fn new(desc: kairos_sim::GpuDesc, seed: u64) -> SimBackend {
        SimBackend {
            desc,
            seed,
            compute: true,
            engine: EngineConfig::default(),
            profiles: None,
            real_time: false,
            start_profiles: SimStartProfiles::default(),
        }
    }
}

impl Backend for SimBackend {
    fn describe(&self) -> String {
        format!("sim ({}, seed {}, compute {})", self.desc.name, self.seed, if self.compute { "on" } else { "off" })
    }

    fn start(&self, gpu: u32, models: &[&PlannedModel]) -> Result<(EngineHandle, String), ServeError> {
        let desc = self.desc.clone();
        let opts = kairos_sim::SimOptions {
            seed: self.seed.wrapping_add(gpu as u64),
            compute: self.compute,
            ..kairos_sim::SimOptions::default()
        };
        let pairs: Vec<(Arc<Plan>, Option<ModelProfile>)> = models.iter().map(|m| (m.plan.clone(), m.profile.clone())).collect();
        let name = format!("simulated {}", desc.name);
        let inbox = self.start_profiles.open(gpu);
        let pace = self.real_time.then_some(None);
        let engine = Engine::start(self.engine.clone(), move || {
            let mut g = kairos_sim::SimGpu::new(desc, opts);
            for (plan, profile) in &pairs {
                if let Some(p) = profile {
                    g.register_plan(plan, p)?;
                }
            }
            Ok(InboxSimGpu { gpu: g, inbox, pace })
        })
        .map_err(|e| ServeError::Internal(format!("cannot start the simulated GPU {gpu}: {e}")))?;
        Ok((EngineHandle::InProcess(engine), name))
    }

    fn profiles(&self) -> Option<&ProfileSet> {
        self.profiles.as_ref()
    }

    fn register_start_model(&self, gpu: u32, model: &PlannedModel) -> Result<(), ServeError> {
        if let Some(p) = &model.profile
            && !self.start_profiles.push(gpu, model.plan.clone(), p.clone())
        {
            return Err(ServeError::Internal(format!("the simulated GPU {gpu} was not started")));
        }
        Ok(())
    }
}

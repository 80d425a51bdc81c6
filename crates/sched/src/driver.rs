//! Driving the dispatcher synchronously, in the GPU's own time.
//!
//! [`VirtualDriver`] holds a [`Dispatcher`] and a schedule of commands at given times on the GPU's
//! clock. [`VirtualDriver::run_until_idle`] loops: apply the GPU's events, feed every command
//! that is due, let the policy dispatch, then `Gpu::wait` until the next scheduled command or
//! the next GPU event. On the simulator `wait` advances virtual time, so a run is deterministic
//! and takes only the CPU time of the events; on a real GPU the same loop is an open-loop load
//! generator on the dispatcher's thread, which is how the experiments run on hardware.

use crate::dispatcher::{Config, Dispatcher};
use crate::request::*;
use kairos_core::Tensor;
use kairos_gpu::Gpu;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// With launches in flight and nothing scheduled, the driver waits on the GPU in steps this long.
const WAIT_STEP_NS: u64 = 1_000_000_000;

/// What happened to one request.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    pub id: RequestId,
    pub model: Arc<str>,
    pub tenant: TenantId,
    pub class: Class,
    /// Scheduled arrival.
    pub arrival_ns: u64,
    /// When the dispatcher emitted the outcome.
    pub done_ns: u64,
    pub result: Result<Timing, Error>,
    /// Outputs, when the request copied them out.
    pub outputs: Vec<Tensor>,
}

impl RequestRecord {
    pub fn latency_ns(&self) -> u64 {
        self.done_ns.saturating_sub(self.arrival_ns)
    }
}

struct Meta {
    model: Arc<str>,
    tenant: TenantId,
    class: Class,
    arrival_ns: u64,
}

pub struct VirtualDriver<G: Gpu> {
    d: Dispatcher<G>,
    schedule: BTreeMap<(u64, u64), Command>,
    seq: u64,
    next_id: u64,
    meta: HashMap<RequestId, Meta>,
    records: Vec<RequestRecord>,
    other: Vec<Output>,
    out: Vec<Output>,
    checks: bool,
    recover: bool,
    /// Decisions the dispatcher had made when the run last looked for a stall.
    decisions_seen: u64,
    /// A submitted request reaches the dispatcher this long after its arrival.
    request_host_ns: u64,
}

impl<G: Gpu> VirtualDriver<G> {
    pub fn new(config: Config, gpu: G) -> Result<VirtualDriver<G>, Error> {
        let policy = config.policy.build();
        VirtualDriver::with_policy(config, gpu, policy)
    }

    /// With a policy of the caller's own (see [`Dispatcher::with_policy`]).
    pub fn with_policy(config: Config, gpu: G, policy: Box<dyn crate::Policy>) -> Result<VirtualDriver<G>, Error> {
        Ok(VirtualDriver {
            d: Dispatcher::with_policy(config, gpu, policy)?,
            schedule: BTreeMap::new(),
            seq: 0,
            next_id: 0,
            meta: HashMap::new(),
            records: Vec::new(),
            other: Vec::new(),
            out: Vec::new(),
            checks: false,
            recover: false,
            decisions_seen: 0,
            request_host_ns: 0,
        })
    }

    pub fn now_ns(&self) -> u64 {
        self.d.gpu().now_ns()
    }

    /// Checks the dispatcher's books after every step ([`Dispatcher::check_invariants`]): a run
    /// fails at the first step that breaks one (for tests; O(jobs x launches) per step).
    pub fn set_checks(&mut self, on: bool) {
        self.checks = on;
    }

    /// Resets the GPU when it fails ([`Dispatcher::recover`], as the threaded engine does) instead
    /// of ending the run with the error. Off by default, so that a test sees any GPU error.
    pub fn set_recover(&mut self, on: bool) {
        self.recover = on;
    }

    /// Charges every request submitted from now on a host path of `ns`: it reaches the dispatcher
    /// (`Command::Submit`) `ns` after its arrival, which stays its arrival (its latency counts the
    /// charge). For a virtual run that stands for a serving engine whose host path the GPU does
    /// not see (a threaded engine's submission queue, thread wake-up and completion callback);
    /// 0 (the default): a request reaches the dispatcher at its arrival.
    pub fn set_request_host_ns(&mut self, ns: u64) {
        self.request_host_ns = ns;
    }

    /// When the next scheduled command is due (a request reaching the dispatcher, a cancel, ...).
    pub fn next_scheduled_ns(&self) -> Option<u64> {
        self.schedule.first_key_value().map(|(k, _)| k.0)
    }

    fn check(&self) -> Result<(), Error> {
        if self.checks {
            self.d
                .check_invariants()
                .map_err(|e| Error::Gpu(format!("dispatcher invariant broken at {} ns: {e}", self.now_ns())))?;
        }
        Ok(())
    }

    pub fn dispatcher(&self) -> &Dispatcher<G> {
        &self.d
    }

    pub fn dispatcher_mut(&mut self) -> &mut Dispatcher<G> {
        &mut self.d
    }

    /// Loads a model now.
    pub fn load_model(&mut self, spec: ModelSpec) -> Result<ModelInfo, Error> {
        let mut out = Vec::new();
        self.d.on_command(Command::LoadModel(spec), &mut out);
        let mut result = Err(Error::Gpu("the dispatcher did not answer the load".into()));
        for o in out {
            match o {
                Output::ModelLoaded { result: r, .. } => result = r,
                other => self.other.push(other),
            }
        }
        result
    }

    /// Schedules a request to arrive at `at_ns` on the GPU clock (reaching the dispatcher then, or
    /// the request host path later: [`VirtualDriver::set_request_host_ns`]); returns its id.
    pub fn submit_at(&mut self, at_ns: u64, model: &str, inputs: Vec<Tensor>, options: RequestOptions) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.meta.insert(id, Meta { model: model.into(), tenant: options.tenant, class: options.class, arrival_ns: at_ns });
        let r = Request { id, model: model.to_string(), inputs, options, arrival_ns: Some(at_ns) };
        self.schedule_command(at_ns.saturating_add(self.request_host_ns), Command::Submit(r));
        id
    }

    /// Maps caller memory into the GPU now, for [`VirtualDriver::submit_bound_at`].
    pub fn map_host(&mut self, memory: Arc<dyn kairos_gpu::HostMemory>) -> Result<kairos_gpu::HostMapping, Error> {
        let mut out = Vec::new();
        self.d.on_command(Command::MapHost(memory), &mut out);
        let mut result = Err(Error::Gpu("the dispatcher did not answer the mapping".into()));
        for o in out {
            match o {
                Output::HostMapped { result: r } => result = r,
                other => self.other.push(other),
            }
        }
        result
    }

    /// Like [`VirtualDriver::submit_at`], with inputs and/or outputs in a host mapping.
    pub fn submit_bound_at(
        &mut self,
        at_ns: u64,
        model: &str,
        inputs: Vec<Tensor>,
        binding: IoBinding,
        options: RequestOptions,
    ) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.meta.insert(id, Meta { model: model.into(), tenant: options.tenant, class: options.class, arrival_ns: at_ns });
        let r = Request { id, model: model.to_string(), inputs, options, arrival_ns: Some(at_ns) };
        self.schedule_command(at_ns.saturating_add(self.request_host_ns), Command::SubmitBound(r, binding));
        id
    }

    pub fn cancel_at(&mut self, at_ns: u64, id: RequestId) {
        self.schedule_command(at_ns, Command::Cancel(id));
    }

    /// Schedules any command (unload, shutdown, ...).
    pub fn schedule_command(&mut self, at_ns: u64, command: Command) {
        self.seq += 1;
        self.schedule.insert((at_ns, self.seq), command);
    }

    /// Runs until nothing is scheduled, held or in flight. An error if the dispatcher holds
    /// jobs with nothing in flight and nothing to wait for (a stall: a scheduling bug).
    pub fn run_until_idle(&mut self) -> Result<(), Error> {
        self.run(None)
    }

    /// Runs until the GPU clock reaches `until_ns` (or everything is done before).
    pub fn run_until(&mut self, until_ns: u64) -> Result<(), Error> {
        self.run(Some(until_ns))
    }

    fn run(&mut self, until: Option<u64>) -> Result<(), Error> {
        loop {
            match self.d.poll_gpu(&mut self.out) {
                Ok(_) => {}
                Err(Error::GpuFailed(cause)) if self.recover => {
                    self.d.recover(&cause, &mut self.out)?;
                    self.check()?;
                    self.collect();
                    continue;
                }
                Err(e) => return Err(e),
            }
            self.check()?;
            self.collect();
            let now = self.d.gpu().now_ns();
            let mut fed = false;
            while let Some(entry) = self.schedule.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let cmd = entry.remove();
                self.d.on_command(cmd, &mut self.out);
                fed = true;
            }
            if fed {
                self.d.dispatch(&mut self.out);
                self.check()?;
                self.collect();
                continue;
            }
            if until.is_some_and(|u| now >= u) {
                return Ok(());
            }
            let next = self.schedule.first_key_value().map(|(k, _)| k.0);
            // The policy holding work back until a time (a hold-off): look again then.
            let wake = self.d.wake_at_ns().filter(|&w| w > now);
            let target = [next, until, wake].into_iter().flatten().min();
            if self.d.work_in_flight() == 0 {
                match target {
                    Some(t) if next.is_some() || wake.is_some() || self.d.jobs() == 0 => self.d.gpu_mut().wait(t)?,
                    _ if self.d.jobs() == 0 => return Ok(()),
                    // A round that ended on its decision limit (e.g. with a launch that failed)
                    // may have left work to decide: one more round before calling it a stall.
                    _ if self.d.stats().decisions > self.decisions_seen => {
                        self.decisions_seen = self.d.stats().decisions;
                        self.d.dispatch(&mut self.out);
                        self.check()?;
                        self.collect();
                        continue;
                    }
                    _ => {
                        let view = self.d.view();
                        return Err(Error::Gpu(format!(
                            "stalled at {now} ns: {} requests held, nothing in flight, nothing scheduled (policy {}); admitted: {:?}; {} streams available, {} CTAs pending, occupancy idle: {}; {:?}",
                            self.d.jobs(),
                            self.d.policy_name(),
                            &view.jobs[..view.jobs.len().min(4)],
                            view.gpu.idle_streams,
                            view.gpu.pending_ctas,
                            view.gpu.occupancy.is_idle(),
                            self.d.stats()
                        )));
                    }
                }
            } else {
                // Not past the watchdog's next look, so that a hung launch is found in time.
                let until = target.unwrap_or(now + WAIT_STEP_NS).min(self.d.watchdog_due_ns().unwrap_or(u64::MAX));
                self.d.gpu_mut().wait(until)?;
            }
        }
    }

    fn collect(&mut self) {
        let now = self.d.gpu().now_ns();
        for o in self.out.drain(..) {
            match o {
                Output::Done { id, result } => {
                    let meta = self.meta.remove(&id);
                    let (model, tenant, class, arrival_ns) = match meta {
                        Some(m) => (m.model, m.tenant, m.class, m.arrival_ns),
                        None => ("".into(), TenantId::default(), Class::default(), now),
                    };
                    let (result, outputs) = match result {
                        Ok(r) => (Ok(r.timing), r.outputs),
                        Err(e) => (Err(e), Vec::new()),
                    };
                    self.records.push(RequestRecord { id, model, tenant, class, arrival_ns, done_ns: now, result, outputs });
                }
                other => self.other.push(other),
            }
        }
    }

    /// Outcomes so far, in completion order.
    pub fn records(&self) -> &[RequestRecord] {
        &self.records
    }

    pub fn take_records(&mut self) -> Vec<RequestRecord> {
        std::mem::take(&mut self.records)
    }

    /// Outputs other than request completions (model loaded/unloaded, shut down).
    pub fn take_other_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.other)
    }

    /// Requests submitted whose outcome has not been seen yet.
    pub fn outstanding(&self) -> usize {
        self.meta.len()
    }

    /// Frees the dispatcher's GPU memory and returns the GPU.
    pub fn into_gpu(self) -> G {
        self.d.into_gpu()
    }
}

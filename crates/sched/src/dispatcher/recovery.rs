//! Recovery: the GPU failed for good (a sticky fault, events it could not report, a launch past
//! its watchdog bound). Every request held is answered with [`Error::GpuFailed`], the device is
//! reset ([`Gpu::reset`]), the models are uploaded again from their plans (keeping what their
//! estimates learned), the host mappings are mapped again under the ids their owners hold, and
//! serving goes on. The watchdog that finds stuck launches lives here too.

use super::*;

/// The watchdog bound of a launch is at least this many times its estimate.
pub const WATCHDOG_ESTIMATE_FACTOR: u64 = 1000;

impl<G: Gpu> Dispatcher<G> {
    /// Answers every request held with [`Error::GpuFailed`] (or its cancellation), oldest first,
    /// before the device is reset: a reset can take long (CUDA's waits for the kernels running)
    /// and the requests need not wait for it. Returns how many were failed or cancelled.
    pub fn fail_held(&mut self, cause: &str, out: &mut Vec<Output>) -> u64 {
        let mut held: Vec<Job> = self.jobs.iter_mut().filter_map(Option::take).collect();
        held.sort_by_key(|j| (j.arrival_ns, j.id.0));
        let requests_failed = held.len() as u64;
        for j in held {
            let error = match j.error {
                Some(e @ (Error::Cancelled | Error::ShuttingDown)) => e,
                _ => Error::GpuFailed(format!("{cause} (the GPU is reset; the request can be sent again)")),
            };
            if error == Error::Cancelled {
                self.stats.cancelled += 1;
            } else {
                self.stats.failed += 1;
            }
            out.push(Output::Done { id: j.id, result: Err(error) });
        }
        self.failed_before_reset += requests_failed;
        requests_failed
    }

    /// Resets the GPU after a fault and brings the dispatcher back to serving: see the module
    /// docs. Fails only when the device cannot be reset (or its stream pool not re-created); the
    /// caller then has no GPU to serve with.
    pub fn recover(&mut self, cause: &str, out: &mut Vec<Output>) -> Result<RecoveryReport, Error> {
        let t0 = self.gpu.now_ns();
        self.fail_held(cause, out);
        let requests_failed = std::mem::take(&mut self.failed_before_reset);
        self.gpu.reset().map_err(|e| Error::GpuFailed(format!("{cause}; resetting the GPU failed: {e}")))?;
        self.stats.gpu_recoveries += 1;
        self.now_ns = self.gpu.now_ns();

        self.jobs.clear();
        self.free_slots.clear();
        self.job_count = 0;
        self.by_id.clear();
        self.views.clear();
        self.tenants.clear();
        self.tenant_index.clear();
        self.almost_done.clear();
        self.in_flight.clear();
        self.group_jobs.iter_mut().for_each(|n| *n = 0);
        self.pending_ctas = 0;
        self.blocked_queues.iter_mut().for_each(|q| *q = 0);
        self.occupancy = if self.cfg.cta_records {
            Occupancy::new(self.gpu.info().sm_count, self.gpu.info().sm_limits)
        } else {
            Occupancy::modelled(self.gpu.info().sm_count, self.gpu.info().sm_limits)
        };
        self.watchdog_next_ns = 0;

        // The stream pool, again.
        let (count, pool) = (self.stream_ids.len(), self.pool_streams);
        self.stream_ids = create_streams(&mut self.gpu, pool, count - pool)
            .map_err(|e| Error::GpuFailed(format!("{cause}; after the GPU's reset: {e}")))?;
        self.streams = vec![StreamView::default(); count];
        self.stream_last_done_ns = vec![self.now_ns; count];
        self.idle_streams = pool as u32;
        self.idle_realtime_streams = (count - pool) as u32;
        self.idle_per_queue = issue::streams_per_queue(pool, self.hw_queues);
        self.available_streams = pool as u32;
        self.stream_cursor = 0;
        // Loads were lost with the device: every model is host-only until a request needs it.
        if self.copy_stream.is_some() {
            self.copy_stream = Some(
                self.gpu
                    .create_stream(0)
                    .map_err(|e| Error::GpuFailed(format!("{cause}; the copy stream after the reset: {e}")))?,
            );
        }
        self.resident_bytes = 0;
        self.load_waiters.clear();
        self.copy_owner.clear();

        // Models, in the order they were loaded; one being unloaded is gone now.
        let old: Vec<Model> = self.models.iter_mut().filter_map(Option::take).collect();
        self.models.clear();
        self.model_names.clear();
        let mut models_reloaded = 0;
        let mut models_lost = Vec::new();
        for m in old {
            if m.unloading {
                out.push(Output::ModelUnloaded { name: m.name, result: Ok(()) });
                continue;
            }
            let name = m.name.clone();
            match self.load_model(ModelSpec { name: name.clone(), plan: m.plan, profile: None }) {
                Ok(_) => {
                    let index = self.model_names[&name];
                    self.models[index].as_mut().expect("just loaded").estimates = m.estimates;
                    models_reloaded += 1;
                }
                Err(e) => {
                    self.lost_models.insert(name.clone(), e.to_string());
                    models_lost.push((name, e));
                }
            }
        }

        // Host mappings, under the ids their owners hold.
        let mut ids: Vec<HostMappingId> = self.host_maps.keys().copied().collect();
        ids.sort();
        let (mut mappings_restored, mut mappings_lost) = (0, 0);
        for id in ids {
            let h = self.host_maps.get_mut(&id).expect("listed");
            h.jobs = 0;
            if h.closing {
                self.host_maps.remove(&id);
                out.push(Output::HostUnmapped { id, result: Ok(()) });
                continue;
            }
            match self.gpu.map_host(h.memory.clone()) {
                Ok(m) => {
                    h.mapping = m;
                    mappings_restored += 1;
                }
                Err(_) => {
                    // Requests bound to it are refused as not mapped; unmapping it answers Ok.
                    self.host_maps.remove(&id);
                    self.lost_mappings.insert(id);
                    mappings_lost += 1;
                }
            }
        }

        let report = RecoveryReport {
            cause: cause.to_string(),
            requests_failed,
            models_reloaded,
            models_lost,
            mappings_restored,
            mappings_lost,
            took_ns: self.gpu.now_ns().saturating_sub(t0),
        };
        out.push(Output::Recovered(report.clone()));
        self.maybe_finish_shutdown(out);
        Ok(report)
    }

    /// When the watchdog looks next (with launches in flight and a watchdog configured): a
    /// driver in virtual time waits no longer than this.
    pub fn watchdog_due_ns(&self) -> Option<u64> {
        (self.cfg.watchdog_ns_min > 0 && !self.in_flight.is_empty()).then_some(self.watchdog_next_ns.max(self.now_ns))
    }

    /// The watchdog: a launch at the head of its stream that has run longer than its bound
    /// (`Config::watchdog_ns_min`, or [`WATCHDOG_ESTIMATE_FACTOR`] times its estimate if more)
    /// means a kernel that hangs; the GPU must be reset. Checked at most every quarter of the
    /// minimum bound. Returns the cause.
    pub(super) fn watchdog(&mut self) -> Option<String> {
        let min_ns = self.cfg.watchdog_ns_min;
        if min_ns == 0 || self.in_flight.is_empty() || self.now_ns < self.watchdog_next_ns {
            return None;
        }
        self.watchdog_next_ns = self.now_ns.saturating_add(min_ns / 4);
        // The head of each stream: its oldest launch in flight (a stream runs its launches in order).
        let mut heads: HashMap<u32, (u64, LaunchId)> = HashMap::new();
        for (&id, f) in self.in_flight.iter() {
            let e = heads.entry(f.stream).or_insert((f.issued_ns, id));
            if (f.issued_ns, id.0) < (e.0, e.1.0) {
                *e = (f.issued_ns, id);
            }
        }
        let mut worst: Option<(u64, LaunchId, u64)> = None;
        for (stream, (issued_ns, id)) in heads {
            let f = &self.in_flight[&id];
            let since_ns = issued_ns.max(self.stream_last_done_ns[stream as usize]);
            let ran_ns = self.now_ns.saturating_sub(since_ns);
            let bound_ns = min_ns.max((f.est_ns as u64).saturating_mul(WATCHDOG_ESTIMATE_FACTOR));
            if ran_ns > bound_ns && worst.is_none_or(|w| ran_ns > w.0) {
                worst = Some((ran_ns, id, bound_ns));
            }
        }
        let (ran_ns, id, bound_ns) = worst?;
        let f = &self.in_flight[&id];
        let what = self
            .job(f.job)
            .and_then(|j| {
                let m = self.models[j.model].as_ref()?;
                Some(format!("launch {} ({}) of model '{}'", f.launch, m.plan.launches[f.launch as usize].name, m.name))
            })
            .unwrap_or_else(|| format!("GPU launch {}", id.0));
        self.stats.watchdog_expiries += 1;
        Some(format!(
            "{what} has run for {:.1} ms, past its watchdog bound of {:.1} ms",
            ran_ns as f64 / 1e6,
            bound_ns as f64 / 1e6
        ))
    }
}

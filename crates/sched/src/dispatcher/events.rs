//! GPU events: starts, placements, completions and launch ends, applied to jobs, the issue-ahead
//! windows and the occupancy mirror.
//!
//! Launches with CTA records move the mirror exactly (per SM, as the GPU reports). Launches that
//! report only their start enter it as a model at their start, all their CTAs spread over their
//! mask (see [`Occupancy::place_model`]), and leave it at their end.

use super::*;

impl<G: Gpu> Dispatcher<G> {
    /// Reads the GPU's events, applies them, then runs the policy. Returns the number of events.
    ///
    /// A GPU that lost events and recovered ([`GpuEvent::LaunchLost`]) costs only the requests
    /// whose launches were lost. An error from the GPU itself, or a launch past its watchdog
    /// bound, is returned as [`Error::GpuFailed`] after the events read before it were applied:
    /// the caller resets the GPU with [`Dispatcher::recover`].
    pub fn poll_gpu(&mut self, out: &mut Vec<Output>) -> Result<usize, Error> {
        let t0 = self.gpu.now_ns();
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let polled = self.gpu.poll(&mut events);
        self.now_ns = self.gpu.now_ns();
        for e in &events {
            self.on_gpu_event(*e, out);
        }
        let n = events.len();
        self.events = events;
        self.stats.events_ns += self.gpu.now_ns().saturating_sub(t0);
        if let Err(e) = polled {
            return Err(Error::GpuFailed(format!("the GPU could not report its events: {e}")));
        }
        if let Some(cause) = self.watchdog() {
            return Err(Error::GpuFailed(cause));
        }
        self.dispatch(out);
        Ok(n)
    }

    /// Applies one GPU event.
    pub fn on_gpu_event(&mut self, e: GpuEvent, out: &mut Vec<Output>) {
        self.stats.events += 1;
        match e {
            GpuEvent::CtasPlaced { launch, sm, ctas, at_ns } => {
                let Some(f) = self.in_flight.get_mut(&launch).filter(|f| f.report_ctas) else {
                    self.stats.notification_anomalies += 1;
                    return;
                };
                self.occupancy.place(sm, f.class, ctas);
                let placed = ctas.min(f.unplaced);
                f.unplaced -= placed;
                if f.behind.is_none() {
                    self.pending_ctas -= placed as u64;
                }
                f.live += ctas;
                f.first_placed_ns.get_or_insert(at_ns);
            }
            GpuEvent::CtasFinished { launch, sm, ctas, blocks, .. } => {
                let Some(f) = self.in_flight.get_mut(&launch).filter(|f| f.report_ctas) else {
                    self.stats.notification_anomalies += 1;
                    return;
                };
                self.occupancy.finish(sm, f.class, ctas);
                if f.live < ctas {
                    self.stats.notification_anomalies += 1;
                }
                f.live = f.live.saturating_sub(ctas);
                f.blocks += blocks as u64;
            }
            GpuEvent::LaunchStarted { launch, at_ns } => self.launch_started(launch, at_ns),
            GpuEvent::LaunchDone { launch, next_block, preempted, at_ns } => {
                self.launch_done(launch, next_block, preempted, at_ns, out)
            }
            GpuEvent::LaunchLost { launch, at_ns } => self.launch_lost(launch, at_ns, out),
            GpuEvent::CopyDone { copy, .. } => self.copy_done(copy, out),
        }
    }

    fn launch_started(&mut self, launch: LaunchId, at_ns: u64) {
        let Some(f) = self.in_flight.get_mut(&launch).filter(|f| f.report_start && f.started_ns.is_none()) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        f.started_ns = Some(at_ns);
        f.first_placed_ns.get_or_insert(at_ns);
        if let Some(t) = f.trace {
            self.trace[t].started_ns = Some(at_ns);
        }
        let key = f.job;
        let left_window = std::mem::take(&mut f.in_window).then_some(f.est_ns);
        // A segment's run ended as its reporter started: from its start (its issue, or the end of
        // what went before it on the stream) to now.
        let run = f.run_from.map(|from| {
            let began_ns = f.issued_ns.max(self.stream_last_done_ns[f.stream as usize]);
            (from..f.launch, at_ns.saturating_sub(began_ns))
        });
        // The launch it waited behind has ended on the GPU, and the ring delivers that end first.
        if f.behind.is_some() {
            self.stats.notification_anomalies += 1;
        } else if !f.report_ctas {
            self.occupancy.place_model(f.class, f.unplaced, &f.mask, launch.0 as u32, &mut f.modelled);
            self.pending_ctas -= f.unplaced as u64;
            f.unplaced = 0;
        }
        if let Some(job) = self.job_mut(key) {
            job.first_start_ns.get_or_insert(at_ns);
            if let Some(est) = left_window {
                job.ahead_launches -= 1;
                job.ahead_ns = (job.ahead_ns - est).max(0.0);
            }
            if let Some((launches, took_ns)) = run {
                self.learn_run(key, launches, took_ns);
            }
            self.refresh(key);
        }
    }

    /// A segment's recorded run took `took_ns`: its launches (silent, no time of their own) learn
    /// that time in proportion to their estimates, so remaining times stay calibrated in sum
    /// although the run's kernels never report. Every job of the model with those launches not
    /// done, this one included, moves with them.
    fn learn_run(&mut self, key: JobKey, launches: std::ops::Range<u32>, took_ns: u64) {
        let Some(model) = self.job(key).map(|j| j.model) else { return };
        let m = self.models[model].as_mut().expect("model of a job exists");
        let est_ns: f64 = launches.clone().map(|i| m.estimates.get(i)).sum();
        if est_ns <= 0.0 || took_ns == 0 {
            return;
        }
        let scale = took_ns as f64 / est_ns;
        for i in launches {
            let m = self.models[model].as_mut().expect("model of a job exists");
            let observed_ns = (m.estimates.get(i) * scale).round() as u64;
            let moved_ns = m.estimates.observe(i, observed_ns);
            if moved_ns != 0.0 {
                self.estimate_moved(model, i, moved_ns, None);
            }
        }
    }

    /// Takes an ended launch out of the books (streams, lanes, occupancy, pending CTAs, the
    /// issue-ahead window); returns it.
    fn retire(&mut self, launch: LaunchId, at_ns: u64) -> Option<InFlight> {
        let mut f = self.in_flight.remove(&launch)?;
        self.count_groups(f.job, &f.mask, false);
        if let Some(t) = f.trace {
            let r = &mut self.trace[t];
            r.done_ns = Some(at_ns);
            r.seen_ns = Some(self.now_ns);
        }
        if f.behind.is_none() {
            self.pending_ctas -= f.unplaced as u64;
        } else {
            self.unblock_queue(f.stream as usize % self.hw_queues);
            if let Some(b) = f.behind.and_then(|b| self.in_flight.get_mut(&b)) {
                // Ended before the launch it waited behind (it was stopped): nothing is behind that one now.
                b.ahead = None;
            }
        }
        if let Some(a) = f.ahead.and_then(|a| self.in_flight.get_mut(&a)) {
            // The launch behind this one may start now: its CTAs become pending, its queue moves.
            a.behind = None;
            self.pending_ctas += a.unplaced as u64;
            if let Some(t) = a.trace {
                self.trace[t].after_done_ns = Some(at_ns);
            }
            let q = a.stream as usize % self.hw_queues;
            self.unblock_queue(q);
        }
        if !f.modelled.is_empty() {
            self.occupancy.remove_model(f.class, &f.modelled);
            f.modelled.clear();
        }
        self.spare_placements.push(std::mem::take(&mut f.modelled));
        let s = f.stream as usize;
        let was_idle = self.stream_is_idle(s);
        self.streams[s].in_flight -= 1;
        self.stream_update(s, was_idle);
        if self.in_flight.is_empty() {
            self.occupancy.resync_idle();
        }
        if let Some(job) = self.jobs.get_mut(f.job.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == f.job) {
            job.in_flight -= 1;
            if job.running.remove(&f.launch) && !f.stoppable {
                job.running_unstoppable -= 1;
            }
            if f.in_window {
                job.ahead_launches -= 1;
                job.ahead_ns = (job.ahead_ns - f.est_ns).max(0.0);
            }
            if job.in_flight == 0 {
                // The lane is empty: the stream goes back to the pool.
                job.lane = None;
                job.lane_tail = None;
                job.draining = false;
            }
        }
        Some(f)
    }

    fn launch_done(&mut self, launch: LaunchId, next_block: u32, preempted: bool, at_ns: u64, out: &mut Vec<Output>) {
        let Some(f) = self.retire(launch, at_ns) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        if f.report_ctas && (f.live > 0 || f.blocks != next_block.saturating_sub(f.first_block) as u64) {
            self.stats.notification_anomalies += 1;
        }
        let s = f.stream as usize;
        let prev_done_ns = std::mem::replace(&mut self.stream_last_done_ns[s], at_ns);
        let Some(job) = self.jobs.get_mut(f.job.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == f.job) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        let key = job.key;
        let model = job.model;
        let m = self.models[model].as_mut().expect("model of a job exists");
        let logical = m.plan.launches[f.launch as usize].shape.logical_blocks;
        let i = f.launch as usize;
        let mut stopped_in_stream = false;
        let mut moved_ns = 0.0;
        if next_block < logical && !job.cancelled {
            // Preempted (by a policy), stopped at the stream gate behind a launch that was, or
            // stopped early: it resumes at the first block never taken.
            if !preempted {
                self.stats.notification_anomalies += 1;
            }
            if let Some(t) = f.trace {
                self.trace[t].stopped = true;
            }
            job.unissued += 1;
            job.states[i] = LState::Pending { first_block: next_block };
            if job.stream.is_some() {
                // Later launches of a whole-job stream already ran past it: the job cannot be repaired.
                stopped_in_stream = true;
            } else {
                // Its dependents cannot go before it is issued again.
                for &d in &m.dependents[i] {
                    job.deps_open[d as usize] += 1;
                    job.issuable.remove(&d);
                }
                if job.deps_open[i] == 0 {
                    job.issuable.insert(f.launch);
                }
            }
        } else if next_block >= logical {
            // Ran whole. Its duration: first block taken to end when it reported its start, else
            // from its first placement (or the end of the launch before it on its stream, for a
            // launch that was placed early behind that one).
            let duration = match f.started_ns {
                Some(start) => at_ns.saturating_sub(start),
                None => at_ns.saturating_sub(f.first_placed_ns.unwrap_or(f.issued_ns).max(prev_done_ns)),
            };
            if f.first_block == 0 && !preempted && f.learns {
                moved_ns = m.estimates.observe(f.launch, duration);
            }
            job.states[i] = LState::Done;
            job.done += 1;
            job.remaining_ns = (job.remaining_ns + moved_ns - m.estimates.get(f.launch)).max(0.0);
            job.last_done_ns = job.last_done_ns.max(at_ns);
            if f.started_ns.is_some() {
                job.gpu_ns += duration;
            }
        } else {
            // A cancelled job's launch stopped early: its remaining blocks never run.
            job.states[i] = LState::Done;
        }
        let cancelled = job.cancelled;
        if moved_ns != 0.0 {
            self.estimate_moved(model, f.launch, moved_ns, Some(key));
        }
        if stopped_in_stream {
            self.fail(
                key,
                Error::Gpu(format!("launch {i} of a whole-job stream stopped at block {next_block} of {logical}")),
                out,
            );
        } else if cancelled {
            let job = self.job_mut(key).expect("checked above");
            if job.in_flight == 0 {
                let e = job.error.take().unwrap_or(Error::Cancelled);
                self.finish(key, Some(e), out);
            } else {
                self.refresh(key);
            }
        } else if job_is_complete(self.job(key).expect("checked above")) {
            self.finish(key, None, out);
        } else {
            self.maybe_wake(key);
            self.refresh(key);
        }
    }

    /// A launch whose notifications the GPU lost: its job fails (its results cannot be trusted),
    /// everything else goes on.
    fn launch_lost(&mut self, launch: LaunchId, at_ns: u64, out: &mut Vec<Output>) {
        let Some(f) = self.retire(launch, at_ns) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        self.stats.launches_lost += 1;
        if let Some(t) = f.trace {
            self.trace[t].stopped = true;
        }
        let Some(job) = self.job_mut(f.job) else { return };
        // It ran to an unknown point: it counts as done for the books, the job fails.
        job.states[f.launch as usize] = LState::Done;
        let key = job.key;
        let e = Error::Gpu(
            "the GPU's notification ring overflowed and this request's launch was lost; the request failed, serving continues"
                .into(),
        );
        if job.cancelled {
            if job.in_flight == 0 {
                let e = job.error.take().unwrap_or(e);
                self.finish(key, Some(e), out);
            }
        } else {
            self.fail(key, e, out);
        }
    }

    /// A launch's estimate moved by `moved_ns`: every other admitted job of the model that has the
    /// launch still to do has that much more (or less) left, so remaining times stay the sum of
    /// the current estimates of the launches not done.
    fn estimate_moved(&mut self, model: usize, launch: u32, moved_ns: f64, except: Option<JobKey>) {
        for v in 0..self.views.len() {
            let view = &mut self.views[v];
            if view.model as usize != model || Some(view.key) == except {
                continue;
            }
            let Some(job) = self.jobs[view.key.slot as usize].as_mut() else { continue };
            if job.states[launch as usize] != LState::Done {
                job.remaining_ns = (job.remaining_ns + moved_ns).max(0.0);
                view.remaining_ns = job.remaining_ns as u64;
            }
        }
    }

    /// Queues the job's early wake-up once its estimated remaining GPU time is within
    /// `wake_lead_ns`, or only its last launch is left.
    pub(super) fn maybe_wake(&mut self, key: JobKey) {
        let lead = self.cfg.wake_lead_ns as f64;
        let Some(job) = self.job_mut(key) else { return };
        if !job.options.notify_before_done || job.notified || job.cancelled {
            return;
        }
        let left = job.states.len() as u32 - job.done;
        if job.remaining_ns <= lead || left <= 1 {
            job.notified = true;
            let id = job.id;
            self.almost_done.push(id);
        }
    }
}

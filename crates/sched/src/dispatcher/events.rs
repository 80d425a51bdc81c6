//! GPU events: placements, completions and launch ends, applied to jobs and the occupancy mirror.

use super::*;

impl<G: Gpu> Dispatcher<G> {
    // ---------------------------------------------------------------- GPU events

    /// Reads the GPU's events, applies them, then runs the policy. Returns the number of events.
    pub fn poll_gpu(&mut self, out: &mut Vec<Output>) -> Result<usize, Error> {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let polled = self.gpu.poll(&mut events);
        self.now_ns = self.gpu.now_ns();
        for e in &events {
            self.on_gpu_event(*e, out);
        }
        let n = events.len();
        self.events = events;
        polled?;
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
                if f.unplaced == 0 && f.behind.is_none() && f.ahead.is_none() {
                    let key = f.job;
                    self.mark_chainable(key);
                }
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
            GpuEvent::LaunchDone { launch, next_block, preempted, at_ns } => {
                self.launch_done(launch, next_block, preempted, at_ns, out)
            }
            GpuEvent::CopyDone { .. } => {}
        }
    }

    pub(super) fn launch_done(&mut self, launch: LaunchId, next_block: u32, preempted: bool, at_ns: u64, out: &mut Vec<Output>) {
        let Some(f) = self.in_flight.remove(&launch) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        let mut unqueued = 0u32;
        if f.behind.is_none() {
            self.pending_ctas -= f.unplaced as u64;
        } else {
            unqueued += 1;
            self.blocked_queues[f.stream as usize % self.hw_queues] -= 1;
            if let Some(b) = f.behind.and_then(|b| self.in_flight.get_mut(&b)) {
                // Ended before the launch it waited behind (it was stopped): nothing is behind that one now.
                b.ahead = None;
            }
        }
        if let Some(a) = f.ahead.and_then(|a| self.in_flight.get_mut(&a)) {
            // The launch behind this one may start now: its CTAs become pending, its queue moves.
            a.behind = None;
            unqueued += 1;
            self.pending_ctas += a.unplaced as u64;
            self.blocked_queues[a.stream as usize % self.hw_queues] -= 1;
        }
        if f.report_ctas && (f.live > 0 || f.blocks != next_block.saturating_sub(f.first_block) as u64) {
            self.stats.notification_anomalies += 1;
        }
        let s = f.stream as usize;
        let prev_done_ns = std::mem::replace(&mut self.stream_last_done_ns[s], at_ns);
        let was_idle = self.stream_is_idle(s);
        self.streams[s].in_flight -= 1;
        self.stream_update(s, was_idle);
        if self.in_flight.is_empty() {
            self.occupancy.resync_idle();
        }
        let Some(job) = self.jobs.get_mut(f.job.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == f.job) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        job.in_flight -= 1;
        job.queued -= unqueued;
        job.running.remove(&f.launch);
        if job.chainable.is_some_and(|c| c.2 == launch) {
            job.chainable = None;
        }
        let m = self.models[job.model].as_mut().expect("model of a job exists");
        let logical = m.plan.launches[f.launch as usize].shape.logical_blocks;
        let i = f.launch as usize;
        let mut stopped_in_stream = false;
        if next_block < logical && !job.cancelled {
            // Preempted (by a later policy) or stopped early: resume at the first block never taken.
            if !preempted {
                self.stats.notification_anomalies += 1;
            }
            job.unissued += 1;
            if job.deps_left[i] > 0 {
                // Stopped behind a dependency that was stopped too: it waits for it again.
                job.states[i] = LState::Waiting;
            } else {
                job.states[i] = LState::Ready { first_block: next_block };
            }
            if job.stream.is_none() {
                if job.deps_left[i] == 0 {
                    job.ready.push(Reverse(f.launch));
                }
            } else {
                // Later launches of a whole-job stream already ran past it: the job cannot be repaired.
                stopped_in_stream = true;
            }
        } else if next_block >= logical {
            job.states[i] = LState::Done;
            job.done += 1;
            if f.first_block == 0 && !preempted {
                // Placed early behind the launch before it on its stream: it ran from that one's end.
                let started = f.first_placed_ns.unwrap_or(f.issued_ns).max(prev_done_ns);
                m.estimates.observe(f.launch, at_ns.saturating_sub(started));
            }
            job.remaining_ns = (job.remaining_ns - m.estimates.get(f.launch)).max(0.0);
            for &d in &m.dependents[i] {
                let left = &mut job.deps_left[d as usize];
                *left -= 1;
                if *left == 0 && job.states[d as usize] == LState::Waiting {
                    job.states[d as usize] = LState::Ready { first_block: 0 };
                    if job.stream.is_none() {
                        job.ready.push(Reverse(d));
                    }
                }
            }
        } else {
            // A cancelled job's launch stopped early: its remaining blocks never run.
            job.states[i] = LState::Done;
        }
        let key = job.key;
        if stopped_in_stream {
            self.fail(
                key,
                Error::Gpu(format!("launch {i} of a whole-job stream stopped at block {next_block} of {logical}")),
                out,
            );
        } else if job.cancelled {
            if job.in_flight == 0 {
                let e = job.error.take().unwrap_or(Error::Cancelled);
                self.finish(key, Some(e), out);
            } else {
                self.refresh(key);
            }
        } else if job_is_complete(job) {
            self.finish(key, None, out);
        } else {
            // A dependency ended or the chain moved up: a launch may fit behind a chain now.
            self.mark_chainable(key);
            self.refresh(key);
        }
    }
}

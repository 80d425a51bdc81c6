//! Issue: the policy's decisions applied, launches sent to the GPU, the stream pool and lookahead.

use super::*;

impl<G: Gpu> Dispatcher<G> {
    // ---------------------------------------------------------------- dispatch

    /// Asks the policy for decisions and applies them until it has none (or the round's limit).
    pub fn dispatch(&mut self, out: &mut Vec<Output>) {
        self.decide(out);
        out.extend(self.almost_done.drain(..).map(|id| Output::AlmostDone { id }));
    }

    pub(super) fn decide(&mut self, out: &mut Vec<Output>) {
        self.now_ns = self.gpu.now_ns();
        for _ in 0..self.cfg.decisions_per_round_max {
            let decision = self.policy.decide(&self.view());
            let Some(d) = decision else { return };
            if !self.apply(d, out) {
                self.stats.refused_decisions += 1;
                return;
            }
            self.stats.decisions += 1;
        }
    }

    /// Applies one decision; false if it was invalid (nothing changed).
    pub(super) fn apply(&mut self, d: Decision, out: &mut Vec<Output>) -> bool {
        match d {
            Decision::Issue { job: key, launch, ctas, sm_mask } => {
                let Some(job) = self.job(key) else { return false };
                if job.cancelled || job.stream.is_some() || job.slot.is_none() {
                    return false;
                }
                if self.in_flight.len() >= self.cfg.launches_in_flight_max as usize {
                    return false;
                }
                let chain = job.chainable.filter(|c| c.0 == launch);
                if let Some((_, stream, after)) = chain {
                    // Behind its running dependency, on that dependency's stream.
                    let after_running =
                        self.in_flight.get(&after).is_some_and(|f| f.ahead.is_none() && job.running.contains(&f.launch));
                    if job.states.get(launch as usize) != Some(&LState::Waiting) || !after_running {
                        return false;
                    }
                    let job = self.job_mut(key).unwrap();
                    job.chainable = None;
                    match self.issue(key, launch, stream, 0, ctas, sm_mask, Some(after), Some(after)) {
                        Ok(id) => {
                            self.in_flight.get_mut(&after).expect("chained behind a launch in flight").ahead = Some(id);
                            let job = self.job_mut(key).unwrap();
                            job.queued += 1;
                            job.chained += 1;
                            self.mark_chainable(key);
                        }
                        Err(e) => self.fail(key, e, out),
                    }
                    self.refresh(key);
                    return true;
                }
                let Some(LState::Ready { first_block }) = job.states.get(launch as usize).copied() else { return false };
                let Some(stream) = self.take_idle_stream() else { return false };
                let job = self.job_mut(key).unwrap();
                if job.ready.peek() == Some(&Reverse(launch)) {
                    job.ready.pop();
                } else {
                    job.ready.retain(|r| r.0 != launch);
                }
                match self.issue(key, launch, stream, first_block, ctas, sm_mask, None, None) {
                    Ok(_) => self.mark_chainable(key),
                    Err(e) => self.fail(key, e, out),
                }
                self.refresh(key);
                true
            }
            Decision::Preempt { job: key, launch } => {
                let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else {
                    return false;
                };
                let Some(LState::Issued(id)) = job.states.get(launch as usize).copied() else { return false };
                if job.stream.is_some() || !job.running.remove(&launch) {
                    return false;
                }
                // What waits behind it on its stream must not run on a partial result: stop it too.
                if job.chainable.is_some_and(|c| c.2 == id) {
                    job.chainable = None;
                }
                // Everything chained behind it goes too (the stream gate stops what has not started).
                let mut result = self.gpu.preempt(id);
                let mut ahead = self.in_flight.get(&id).and_then(|f| f.ahead);
                while let Some(a) = ahead {
                    let f = &self.in_flight[&a];
                    job.running.remove(&f.launch);
                    if job.chainable.is_some_and(|c| c.2 == a) {
                        job.chainable = None;
                    }
                    ahead = f.ahead;
                    result = result.and(self.gpu.preempt(a));
                }
                if let Err(e) = result {
                    self.fail(key, e.into(), out);
                }
                self.stats.preemptions += 1;
                self.refresh(key);
                true
            }
            Decision::IssueAll { job: key, stream } => {
                let Some(job) = self.job(key) else { return false };
                let view = job.view.map(|v| self.views[v]);
                if !view.is_some_and(|v| v.is_unstarted()) || stream as usize >= self.streams.len() {
                    return false;
                }
                let n = job.states.len();
                if !self.in_flight.is_empty() && self.in_flight.len() + n > self.cfg.launches_in_flight_max as usize {
                    return false;
                }
                let s = stream as usize;
                let was_idle = self.stream_is_idle(s);
                self.streams[s].jobs += 1;
                self.stream_update(s, was_idle);
                let job = self.job_mut(key).unwrap();
                job.stream = Some(stream);
                job.ready.clear();
                let mut result = Ok(());
                let mut previous = None;
                for i in 0..n as u32 {
                    let first_block = match self.job(key).unwrap().states[i as usize] {
                        LState::Ready { first_block } => first_block,
                        _ => 0,
                    };
                    // Each launch reads what the ones before it on the stream wrote: the stream
                    // gate stops the rest of the job if one of them stops early.
                    match self.issue(key, i, stream, first_block, None, None, None, previous) {
                        Ok(id) => previous = Some(id),
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                if let Err(e) = result {
                    self.fail(key, e, out);
                }
                self.refresh(key);
                true
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn issue(
        &mut self,
        key: JobKey,
        launch: u32,
        stream: u32,
        first_block: u32,
        ctas: Option<u32>,
        sm_mask: Option<SmMask>,
        behind: Option<LaunchId>,
        after: Option<LaunchId>,
    ) -> Result<LaunchId, Error> {
        let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let l = &m.plan.launches[launch as usize];
        let blocks_left = l.shape.logical_blocks - first_block;
        let ctas = ctas.unwrap_or(m.capacity_ctas[launch as usize]).clamp(1, blocks_left.max(1));
        let slot = job.slot.as_ref().expect("admitted job has a slot");
        job.bound_bases.as_ref().unwrap_or(&slot.bases).resolve_all(&l.args, &mut self.args);
        // A job handed whole to a stream needs only each launch's end: its order is the
        // stream's, and no policy places other work by its CTAs.
        let report_ctas = job.stream.is_none();
        let request = LaunchRequest {
            kernel: &l.kernel,
            dtype: l.dtype,
            shape: l.shape,
            args: &self.args,
            first_block,
            ctas,
            sm_mask: sm_mask.unwrap_or(self.whole),
            partition: PartitionId::WHOLE,
            stream: self.stream_ids[stream as usize],
            after,
            report_ctas,
        };
        let id = self.gpu.launch(&request)?;
        let cost = m.estimates.get(launch);
        let class = m.classes[launch as usize];
        self.stats.launches += 1;
        self.issue_seq += 1;
        job.states[launch as usize] = LState::Issued(id);
        job.unissued -= 1;
        if job.unissued == 0 && job.options.notify_before_done && !job.notified {
            job.notified = true;
            self.almost_done.push(job.id);
        }
        job.in_flight += 1;
        job.running.insert(launch);
        job.last_issue_seq = self.issue_seq;
        job.first_issue_ns.get_or_insert(self.now_ns);
        let (tenant, request_id) = (job.options.tenant, job.id);
        self.in_flight.insert(
            id,
            InFlight {
                job: key,
                launch,
                class,
                unplaced: ctas,
                live: 0,
                blocks: 0,
                first_block,
                issued_ns: self.now_ns,
                first_placed_ns: None,
                stream,
                behind,
                ahead: None,
                report_ctas,
            },
        );
        if behind.is_none() {
            self.pending_ctas += ctas as u64;
        } else {
            self.blocked_queues[stream as usize % self.hw_queues] += 1;
        }
        let s = stream as usize;
        let was_idle = self.stream_is_idle(s);
        self.streams[s].in_flight += 1;
        self.stream_update(s, was_idle);
        self.charge(tenant, cost);
        if self.cfg.trace_max > 0 {
            if self.trace.len() < self.cfg.trace_max {
                self.trace.push(IssueRecord {
                    at_ns: self.now_ns,
                    request: request_id,
                    tenant,
                    launch,
                    gpu_launch: id,
                    stream,
                    first_block,
                    ctas,
                });
            } else {
                self.stats.trace_dropped += 1;
            }
        }
        Ok(id)
    }

    /// Offers the job's next lookahead launch: behind the tail of one of its chains (a launch
    /// in flight with nothing behind it, that no one asked to stop: a running one with all CTAs
    /// placed, or one waiting itself while fewer than `chain_depth_max` of the job's launches
    /// wait), the first waiting dependent of that tail whose unfinished dependencies are all on
    /// the tail's chain.
    pub(super) fn mark_chainable(&mut self, key: JobKey) {
        let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else { return };
        if job.cancelled || job.stream.is_some() || job.chainable.is_some() || job.queued >= self.cfg.chain_depth_max {
            // (A running tail with placed CTAs and no launch waiting still needs depth >= 1.)
            return;
        }
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let mut chain: Vec<u32> = Vec::new();
        for &tail in &job.running {
            let LState::Issued(tail_id) = job.states[tail as usize] else { continue };
            // Behind a running launch once all its CTAs are on SMs (then the launch behind waits
            // for nothing but it), or deeper behind one that waits itself.
            let Some(f) = self.in_flight.get(&tail_id).filter(|f| {
                f.ahead.is_none() && if f.behind.is_none() { f.unplaced == 0 } else { job.queued < self.cfg.chain_depth_max }
            }) else {
                continue;
            };
            let stream = f.stream;
            // The chain ending at `tail`: it and the launches it waits behind, all still running.
            chain.clear();
            let mut at = Some(tail_id);
            while let Some(id) = at {
                let g = &self.in_flight[&id];
                chain.push(g.launch);
                at = g.behind;
            }
            if chain.iter().any(|l| !job.running.contains(l)) {
                continue;
            }
            let next = m.dependents[tail as usize].iter().copied().find(|&d| {
                let deps = &m.plan.launches[d as usize].deps;
                let on_chain = deps.iter().enumerate().filter(|&(i, x)| chain.contains(x) && !deps[..i].contains(x)).count();
                job.states[d as usize] == LState::Waiting && job.deps_left[d as usize] as usize == on_chain
            });
            if let Some(d) = next {
                job.chainable = Some((d, stream, tail_id));
                self.refresh(key);
                return;
            }
        }
    }

    pub(super) fn stream_is_idle(&self, s: usize) -> bool {
        self.streams[s].in_flight == 0 && self.streams[s].jobs == 0
    }

    pub(super) fn stream_update(&mut self, s: usize, was_idle: bool) {
        let idle = self.stream_is_idle(s);
        if idle && !was_idle {
            self.idle_streams += 1;
        } else if !idle && was_idle {
            self.idle_streams -= 1;
        }
    }

    /// An idle stream, scanning round robin from the last one taken (spreads kernels over the
    /// hardware queues the streams map to).
    /// Idle streams whose hardware queue has no launch waiting behind a dependency.
    pub(super) fn available_streams(&self) -> u32 {
        if self.blocked_queues.iter().all(|&b| b == 0) {
            return self.idle_streams;
        }
        (0..self.streams.len()).filter(|&s| self.stream_is_idle(s) && self.blocked_queues[s % self.hw_queues] == 0).count() as u32
    }

    pub(super) fn take_idle_stream(&mut self) -> Option<u32> {
        if self.idle_streams == 0 {
            return None;
        }
        let n = self.streams.len();
        for k in 0..n {
            let s = (self.stream_cursor + k) % n;
            if self.stream_is_idle(s) && self.blocked_queues[s % self.hw_queues] == 0 {
                self.stream_cursor = (s + 1) % n;
                return Some(s as u32);
            }
        }
        None
    }
}

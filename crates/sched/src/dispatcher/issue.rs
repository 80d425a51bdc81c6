//! Issue: the policy's decisions applied, launches sent to the GPU, the stream pool and the lanes.
//!
//! A kernel-level job holds one stream of the pool, its *lane*, while it has launches in flight:
//! its first launch takes an idle stream, every later one goes behind the lane's last launch
//! (`after` it, so the protocol's stream gate stops it if that one stops early) and the job gives
//! the stream back when its last launch in flight ends. Stream order runs a job's launches in the
//! order they were issued, so a launch may be issued as soon as its dependencies are issued: the
//! dispatcher offers it while the job's issue-ahead window is open (see `Config::lookahead_ns`),
//! and the next kernel of a job is on the GPU before the one before it ends.

use super::*;
use std::ops::Range;

impl<G: Gpu> Dispatcher<G> {
    /// Asks the policy for decisions and applies them until it has none (or the round's limit).
    pub fn dispatch(&mut self, out: &mut Vec<Output>) {
        self.decide(out);
        out.extend(self.almost_done.drain(..).map(|id| Output::AlmostDone { id }));
    }

    pub(super) fn decide(&mut self, out: &mut Vec<Output>) {
        self.now_ns = self.gpu.now_ns();
        self.round_ns = self.now_ns;
        for _ in 0..self.cfg.decisions_per_round_max {
            let t0 = self.gpu.now_ns();
            let decision = self.policy.decide(&self.view());
            self.stats.policy_ns += self.gpu.now_ns().saturating_sub(t0);
            let Some(d) = decision else {
                self.wake_at_ns = if self.policy.holds() { self.policy.wake_at_ns(&self.view()) } else { None };
                return;
            };
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
            Decision::Issue { job: key, launch, ctas, sm_mask } => self.apply_issue(key, launch, ctas, sm_mask, out),
            Decision::Preempt { job: key, launch } => self.apply_preempt(key, launch, out),
            Decision::IssueAll { job: key, stream } => self.apply_issue_all(key, stream, out),
        }
    }

    fn apply_issue(
        &mut self,
        key: JobKey,
        launch: u32,
        ctas: Option<u32>,
        sm_mask: Option<SmMask>,
        out: &mut Vec<Output>,
    ) -> bool {
        let Some(job) = self.job(key) else { return false };
        if job.cancelled || job.stream.is_some() || job.slot.is_none() || job.draining {
            return false;
        }
        if self.in_flight.len() >= self.cfg.launches_in_flight_max as usize {
            return false;
        }
        let Some(LState::Pending { first_block }) = job.states.get(launch as usize).copied() else { return false };
        if !job.issuable.contains(&launch) {
            return false;
        }
        let window_open = job.in_flight == 0
            || (job.ahead_launches < self.cfg.lookahead_launches_max && job.ahead_ns < self.cfg.lookahead_ns as f64);
        if !window_open {
            return false;
        }
        // On the job's lane behind its launches in flight, or on an idle stream that becomes it.
        let (stream, after) = if job.in_flight > 0 {
            match (job.lane, job.lane_tail) {
                (Some(s), Some(t)) if self.in_flight.contains_key(&t) => (s, Some(t)),
                _ => return false,
            }
        } else {
            let realtime = job.options.class == Class::RealTime;
            match realtime.then(|| self.take_idle_realtime_stream()).flatten().or_else(|| self.take_idle_stream()) {
                Some(s) => (s, None),
                None => return false,
            }
        };
        // A whole segment where one starts here (see `issue_segment`), else this launch alone.
        let segment = self.segment_to_issue(key, launch, ctas, sm_mask);
        let issued = match segment.map(|g| self.issue_segment(key, g, stream, after, sm_mask)) {
            Some(Ok(Some(id))) => {
                let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
                let m = self.models[job.model].as_ref().expect("model of a job exists");
                Ok((id, m.segments[segment.unwrap() as usize].clone()))
            }
            Some(Err(e)) => Err(e),
            Some(Ok(None)) | None => {
                self.issue(key, launch, stream, first_block, ctas, sm_mask, after, after, None).map(|id| (id, launch..launch + 1))
            }
        };
        match issued {
            Ok((id, launches)) => {
                if let Some(t) = after {
                    self.in_flight.get_mut(&t).expect("the lane's tail is in flight").ahead = Some(id);
                }
                let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
                job.lane = Some(stream);
                job.lane_tail = Some(id);
                if after.is_some() {
                    job.chained += 1;
                }
                let m = self.models[job.model].as_ref().expect("model of a job exists");
                for l in launches {
                    job.issuable.remove(&l);
                    for &d in &m.dependents[l as usize] {
                        let open = &mut job.deps_open[d as usize];
                        *open -= 1;
                        if *open == 0 && matches!(job.states[d as usize], LState::Pending { .. }) {
                            job.issuable.insert(d);
                        }
                    }
                }
            }
            Err(e) => self.fail(key, e, out),
        }
        self.refresh(key);
        true
    }

    fn apply_preempt(&mut self, key: JobKey, launch: u32, out: &mut Vec<Output>) -> bool {
        let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else {
            return false;
        };
        let Some(LState::Issued(id)) = job.states.get(launch as usize).copied() else { return false };
        if job.stream.is_some() || !self.policy.preempts_class(job.options.class) || !job.running.remove(&launch) {
            return false;
        }
        // Nothing more goes to the lane until it is empty: what waits behind the stopped launch
        // stops at the stream gate, and the dispatcher stops it too.
        job.draining = true;
        if self.in_flight.get(&id).is_some_and(|f| f.stoppable) {
            // A segment that stops between kernels: its stop word stops every launch that carries
            // it, raised once through the job's latest one (a segment's reporter, which the GPU
            // holds until it reports, where a run's launch may have ended already); the job's
            // other launches in flight are preempted one by one.
            let mut result = Ok(());
            if job.running_unstoppable == 0 {
                // All of them carry the word: raised once, through the latest (each launch looked
                // at cost the dispatcher microseconds a preemption with a few hundred in flight).
                debug_assert!(job.running.iter().all(|&l| match job.states[l as usize] {
                    LState::Issued(other) => self.in_flight.get(&other).is_none_or(|f| f.stoppable),
                    _ => true,
                }));
                let latest = job.running.last().map_or(launch, |&l| l.max(launch));
                job.running.clear();
                if let LState::Issued(other) = job.states[latest as usize] {
                    result = self.gpu.preempt(other);
                }
            } else {
                let mut raised = false;
                let mut launches: Vec<u32> = std::mem::take(&mut job.running).into_iter().chain([launch]).collect();
                launches.sort_unstable_by(|a, b| b.cmp(a));
                for l in launches {
                    let LState::Issued(other) = job.states[l as usize] else { continue };
                    let stoppable = self.in_flight.get(&other).is_some_and(|f| f.stoppable);
                    if !stoppable || !raised {
                        result = result.and(self.gpu.preempt(other));
                    }
                    raised |= stoppable;
                }
                job.running_unstoppable = 0;
            }
            if let Err(e) = result {
                self.fail(key, e.into(), out);
            }
            self.stats.preemptions += 1;
            self.refresh(key);
            return true;
        }
        // `launch` (removed above) is not stoppable.
        job.running_unstoppable -= 1;
        let mut result = self.gpu.preempt(id);
        let mut ahead = self.in_flight.get(&id).and_then(|f| f.ahead);
        while let Some(a) = ahead {
            let f = &self.in_flight[&a];
            if job.running.remove(&f.launch) && !f.stoppable {
                job.running_unstoppable -= 1;
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

    fn apply_issue_all(&mut self, key: JobKey, stream: u32, out: &mut Vec<Output>) -> bool {
        let Some(job) = self.job(key) else { return false };
        let view = job.view.map(|v| self.views[v]);
        if !view.is_some_and(|v| v.is_unstarted()) || stream as usize >= self.pool_streams {
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
        job.issuable.clear();
        let mut result = Ok(());
        let mut previous = None;
        // The launches before the last as one recorded run, where the backend has them.
        let mut first = 0;
        match self.launch_whole_run(key, stream) {
            Ok(Some(last)) => {
                previous = Some(last);
                first = n as u32 - 1;
            }
            Ok(None) => {}
            Err(e) => result = Err(e),
        }
        for i in first..n as u32 {
            if result.is_err() {
                break;
            }
            let first_block = match self.job(key).unwrap().states[i as usize] {
                LState::Pending { first_block } => first_block,
                _ => 0,
            };
            // Each launch reads what the ones before it on the stream wrote: the stream gate
            // stops the rest of the job if one of them stops early.
            match self.issue(key, i, stream, first_block, None, None, None, previous, None) {
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

    /// Sends one launch to the GPU and records it. `behind`: the launch it waits behind on its
    /// lane (its CTAs are not pending until that one ends); `after`: the launch its stream gate
    /// names.
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
        stop_word: Option<StopWordId>,
    ) -> Result<LaunchId, Error> {
        let model = self.jobs[key.slot as usize].as_ref().expect("issued job exists").model;
        // A launch issued before its layers' turn in a load's copy window (a whole job on a
        // stream) brings their copies forward: it must have a copy to wait for.
        if self.models[model].as_ref().and_then(|m| m.residency.as_ref()).is_some_and(|r| r.reads_unqueued(launch as usize)) {
            self.queue_through(model, launch as usize)?;
        }
        // `+green`: a mask of whole SM groups runs on the hardware partition of those groups.
        let partition = match sm_mask {
            Some(m) if m != self.whole && self.cfg.policy.hardware_masks() => {
                let found = self.partition_of(&m);
                self.stats.partition_fallbacks += found.is_none() as u64;
                found
            }
            _ => None,
        };
        let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let l = &m.plan.launches[launch as usize];
        let mask = sm_mask.unwrap_or(self.whole);
        let blocks_left = (l.shape.logical_blocks - first_block).max(1);
        // `ctas`: what runs (the books'); `request_ctas`: what the GPU is asked to start. A mask
        // narrower than the GPU left to the dispatcher gets its SMs' full wave: the GPU starts
        // enough CTAs to reach every SM (those outside the mask leave at once).
        let (ctas, request_ctas) = match ctas {
            Some(c) => {
                let c = c.clamp(1, blocks_left);
                (c, c)
            }
            None if mask != self.whole => {
                let per_sm = self.occupancy.ctas_per_sm(m.classes[launch as usize]).max(1);
                ((per_sm * mask.intersect(&self.whole).count()).clamp(1, blocks_left), 0)
            }
            None => {
                let c = m.default_ctas(launch as usize, first_block, self.cfg.launch_ctas_max);
                (c, c)
            }
        };
        let slot = job.slot.as_ref().expect("admitted job has a slot");
        job.bound_bases.as_ref().unwrap_or(&slot.bases).resolve_all(&l.args, &mut self.args);
        if let Some(r) = &m.residency {
            r.resolve_weights(&m.plan, &l.args, &mut self.args);
            // A cold start: the launch waits on the GPU for the copy of the layers it reads.
            if let Some(copy) = r.copy_needed(launch as usize)
                && job.copy_waited.is_none_or(|(s, c)| s != stream || c < copy)
            {
                self.gpu.wait_copy(self.stream_ids[stream as usize], copy)?;
                job.copy_waited = Some((stream, copy));
            }
        }
        // A job handed whole to a stream needs only each launch's end: its order is the
        // stream's, and no policy places other work by its CTAs. Kernel-level launches report
        // their start (one record), or every CTA with `cta_records`.
        let kernel_level = job.stream.is_none();
        let report_ctas = kernel_level && self.cfg.cta_records;
        let report_start = kernel_level;
        // A whole job's launches before its last need no end of their own: stream order makes
        // the last one's end theirs (a GPU may then skip their notifications entirely).
        let last = launch as usize + 1 == m.plan.launches.len();
        let report_end = kernel_level || last;
        // Their times then come from the last launch's end: only launches whose end and whose
        // predecessor's end are both reported teach the estimates.
        let learns = kernel_level || m.plan.launches.len() == 1;
        let request = LaunchRequest {
            kernel: &l.kernel,
            dtype: l.dtype,
            shape: l.shape,
            args: &self.args,
            first_block,
            ctas: request_ctas,
            sm_mask: if partition.is_some() { self.whole } else { mask },
            partition: partition.unwrap_or(PartitionId::WHOLE),
            stream: self.stream_ids[stream as usize],
            after,
            report_ctas,
            report_start,
            preemptible: self.policy.preempts_class(job.options.class),
            report_end,
            stop_word,
        };
        let t0 = self.gpu.now_ns();
        let id = self.gpu.launch(&request)?;
        let call_ns = self.gpu.now_ns().saturating_sub(t0);
        self.stats.launch_call_ns += call_ns;
        self.stats.partition_launches += partition.is_some() as u64;
        let stoppable = stop_word.is_some();
        let issued =
            Issued { stream, first_block, ctas, mask, behind, report_ctas, report_start, learns, stoppable, at_ns: t0, call_ns };
        self.note_issued(key, launch, id, issued);
        Ok(id)
    }

    /// The hardware partition of the device's SM groups that `mask` (a union of the occupancy
    /// map's groups) covers, made on first use ([`Gpu::partition_of_groups`]): every device group
    /// whose map groups are all in the mask. A device group the mask covers only in part is left
    /// out (an H200's last one, 12 SMs, when the mask has only its first 8 or its last 4: the
    /// kernel then runs on fewer SMs than the books say, never on SMs another job's kernel was
    /// given). None (the software mask then; `issue` counts it as a fallback) where no device
    /// group is covered whole, the mask is not a union of map groups, there is no nesting
    /// (`device_groups` empty), or the GPU refuses.
    fn partition_of(&mut self, mask: &SmMask) -> Option<PartitionId> {
        let sm_count = self.gpu.info().sm_count;
        let groups = crate::occupancy::groups_of(mask);
        let device_bits = if crate::occupancy::mask_of_groups(groups, sm_count) == *mask {
            let covered = |m: u32| m != 0 && groups & m == m;
            self.device_groups.iter().enumerate().filter(|(_, m)| covered(**m)).fold(0u64, |b, (d, _)| b | 1 << d)
        } else {
            0
        };
        (device_bits != 0).then(|| self.gpu.partition_of_groups(device_bits).ok()).flatten()
    }

    /// Records a launch the GPU accepted: the job's state, the launch in flight, the streams, the
    /// tenant's charge, the trace.
    fn note_issued(&mut self, key: JobKey, launch: u32, id: LaunchId, i: Issued) {
        let Issued { stream, first_block, ctas, mask, behind, report_ctas, report_start, learns, stoppable, at_ns: t0, call_ns } =
            i;
        let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let cost = m.estimates.get(launch);
        let class = m.classes[launch as usize];
        self.stats.launches += 1;
        self.stats.masked_launches += (mask != self.whole) as u64;
        self.issue_seq += 1;
        job.states[launch as usize] = LState::Issued(id);
        job.unissued -= 1;
        job.in_flight += 1;
        if job.running.insert(launch) && !stoppable {
            job.running_unstoppable += 1;
        }
        job.last_issue_seq = self.issue_seq;
        job.first_issue_ns.get_or_insert(t0);
        job.first_round_ns.get_or_insert(self.round_ns);
        if report_start {
            job.ahead_launches += 1;
            job.ahead_ns += cost;
        }
        let (tenant, request_id) = (job.options.tenant, job.id);
        let trace = if self.cfg.trace_max == 0 {
            None
        } else if self.trace.len() < self.cfg.trace_max {
            self.trace.push(IssueRecord {
                at_ns: t0,
                request: request_id,
                tenant,
                launch,
                gpu_launch: id,
                stream,
                first_block,
                ctas,
                call_ns,
                behind: behind.is_some(),
                est_ns: cost as u64,
                after_done_ns: None,
                started_ns: None,
                done_ns: None,
                seen_ns: None,
                stopped: false,
            });
            Some(self.trace.len() - 1)
        } else {
            self.stats.trace_dropped += 1;
            None
        };
        let modelled = if report_start && !report_ctas { self.spare_placements.pop().unwrap_or_default() } else { Vec::new() };
        self.count_groups(key, &mask, true);
        self.in_flight.insert(
            id,
            InFlight {
                job: key,
                launch,
                class,
                ctas,
                unplaced: ctas,
                live: 0,
                blocks: 0,
                first_block,
                issued_ns: t0,
                issue_seq: self.issue_seq,
                first_placed_ns: None,
                started_ns: None,
                stream,
                behind,
                ahead: None,
                report_ctas,
                report_start,
                learns,
                modelled,
                mask,
                est_ns: cost,
                in_window: report_start,
                run_from: None,
                stoppable,
                trace,
            },
        );
        if behind.is_none() {
            self.pending_ctas += ctas as u64;
        } else {
            self.block_queue(stream as usize % self.hw_queues);
        }
        let s = stream as usize;
        let was_idle = self.stream_is_idle(s);
        self.streams[s].in_flight += 1;
        self.stream_update(s, was_idle);
        self.charge(tenant, cost);
    }

    /// Issues a whole job's launches but its last as the recorded run of its I/O slot (recording
    /// it the first time): the id of the run's last launch, for the job's last launch to go
    /// behind; None when the job goes launch by launch (runs off or unsupported, a job of one or
    /// two launches, I/O bound to a host mapping), with nothing issued.
    fn launch_whole_run(&mut self, key: JobKey, stream: u32) -> Result<Option<LaunchId>, Error> {
        let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let n = m.plan.launches.len();
        if !self.cfg.record_runs || !self.runs_supported || n < 3 || job.bound_bases.is_some() || self.policy.preempts() {
            return Ok(None);
        }
        // A run does not wait for a load's copies: a loading model's jobs go launch by launch, and
        // so does a cold start (recording its model's runs again is not its latency's business).
        if job.cold || m.residency.as_ref().is_some_and(|r| r.state != residency::ResidencyState::Resident) {
            return Ok(None);
        }
        let run = match job.slot.as_ref().and_then(|s| s.run) {
            Some(r) => r,
            None => {
                let recorded = self.record_whole_run(key);
                match self.run_or_fallback(recorded) {
                    Some(r) => r,
                    None => return Ok(None),
                }
            }
        };
        let (last, result) = self.replay_run(key, run, stream, 0, true, false, self.whole);
        result?;
        self.stats.runs_launched += 1;
        Ok(last)
    }

    /// What recording a run on demand gave: the run, or None when the job goes launch by launch
    /// (the budget is spent; the backend has no runs, which turns them off; or the GPU refused to
    /// record it, counted in `run_record_failures`: that costs the job nothing, and the slot is
    /// tried again later within the budget).
    pub(super) fn run_or_fallback(&mut self, recorded: Result<Option<RunId>, kairos_gpu::GpuError>) -> Option<RunId> {
        match recorded {
            Ok(r) => r,
            Err(kairos_gpu::GpuError::Unsupported(_)) => {
                self.runs_supported = false;
                None
            }
            Err(_) => {
                self.stats.run_record_failures += 1;
                None
            }
        }
    }

    /// Replays `run`, which holds the job's launches from `first` on, on `stream`, and notes every
    /// launch it queued as issued (silent, on `mask`: the whole GPU, or the partition the run was
    /// recorded in; with their default CTAs in the occupancy books when `in_books`, else none).
    /// The launches that were queued count as issued whatever happened after them: their ends
    /// come as for any silent launch. Returns the id of the last one queued and the launch call's
    /// result.
    #[allow(clippy::too_many_arguments)]
    fn replay_run(
        &mut self,
        key: JobKey,
        run: RunId,
        stream: u32,
        first: u32,
        in_books: bool,
        stoppable: bool,
        mask: SmMask,
    ) -> (Option<LaunchId>, Result<(), kairos_gpu::GpuError>) {
        let t0 = self.gpu.now_ns();
        let mut ids = std::mem::take(&mut self.run_ids);
        ids.clear();
        let result = self.gpu.launch_run(run, self.stream_ids[stream as usize], &mut ids);
        let call_ns = self.gpu.now_ns().saturating_sub(t0);
        self.stats.launch_call_ns += call_ns;
        for (k, &id) in ids.iter().enumerate() {
            let launch = first + k as u32;
            let ctas = if in_books {
                let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
                let m = self.models[job.model].as_ref().expect("model of a job exists");
                m.default_ctas(launch as usize, 0, self.cfg.launch_ctas_max)
            } else {
                0
            };
            let issued = Issued {
                stream,
                first_block: 0,
                ctas,
                mask,
                behind: None,
                report_ctas: false,
                report_start: false,
                learns: false,
                stoppable,
                at_ns: t0,
                call_ns: if k == 0 { call_ns } else { 0 },
            };
            self.note_issued(key, launch, id, issued);
        }
        // A run recorded inside a partition: its launches count as the partition's.
        if mask != self.whole {
            self.stats.partition_launches += ids.len() as u64;
        }
        let last = ids.last().copied();
        self.run_ids = ids;
        (last, result)
    }

    /// Records the job's model's launches but the last on the job's I/O slot, and keeps the run
    /// with the slot (`Ok(None)`: the budget is spent, see [`Dispatcher::record_on_demand`]).
    fn record_whole_run(&mut self, key: JobKey) -> Result<Option<RunId>, kairos_gpu::GpuError> {
        let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
        let n = self.models[job.model].as_ref().expect("model of a job exists").plan.launches.len() as u32;
        let run = self.record_on_demand(key, 0..n - 1, None, PartitionId::WHOLE)?;
        if let Some(r) = run {
            let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
            job.slot.as_mut().expect("admitted job has a slot").run = Some(r);
        }
        Ok(run)
    }

    /// Records the job's model's `launches` on the job's I/O slot. Recording stalls the
    /// dispatcher's thread (on CUDA a capture and a graph instantiation, milliseconds), so slots
    /// made on demand are recorded within a budget: at most [`RUN_RECORD_SHARE`] of the time since
    /// the last recording, [`RUN_RECORD_CREDIT_MAX_NS`] at once; a job whose slot finds the budget
    /// spent goes launch by launch (`Ok(None)`). Without the budget a burst that made dozens of new
    /// slots stalled an H100 serving at its capacity into collapse (every stall queued more jobs,
    /// which took more new slots to record).
    fn record_on_demand(
        &mut self,
        key: JobKey,
        launches: Range<u32>,
        stop_word: Option<StopWordId>,
        partition: PartitionId,
    ) -> Result<Option<RunId>, kairos_gpu::GpuError> {
        let now = self.gpu.now_ns();
        let earned = now.saturating_sub(self.run_credit_at_ns) as f64 * RUN_RECORD_SHARE;
        self.run_credit_ns = (self.run_credit_ns + earned).min(RUN_RECORD_CREDIT_MAX_NS as f64);
        self.run_credit_at_ns = now;
        if self.run_credit_ns <= 0.0 {
            return Ok(None);
        }
        let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let slot = job.slot.as_ref().expect("admitted job has a slot");
        let (launch_ctas_max, whole, stream) = (self.cfg.launch_ctas_max, self.whole, self.stream_ids[0]);
        let run = record_slot_run(&mut self.gpu, m, slot, launches, launch_ctas_max, whole, partition, stream, stop_word);
        let took_ns = self.gpu.now_ns().saturating_sub(now);
        self.run_credit_ns -= took_ns as f64;
        self.stats.run_record_ns += took_ns;
        let run = run?;
        self.stats.runs_recorded += 1;
        Ok(Some(run))
    }

    /// Kernel-level jobs go out in recorded segments ([`Config::run_segment_ns`]): those of a
    /// class the policy never preempts ([`Policy::preempts_class`]), or whose segments it wants
    /// stopped between kernels ([`Policy::stops_runs`]).
    pub(super) fn segments_on(&self) -> bool {
        let class_on = |c| !self.policy.preempts_class(c) || self.policy.stops_runs(c);
        self.segment_ns() > 0
            && self.cfg.record_runs
            && self.runs_supported
            && self.cfg.policy.is_kernel_level()
            && (class_on(Class::RealTime) || class_on(Class::BestEffort))
            && (!self.cfg.policy.masks_kernels() || self.partition_segments())
    }

    /// The length of a kernel-level segment in estimated GPU time: `Config::run_segment_ns` (by
    /// default 1500 µs, 500 µs where the pool's streams outnumber the hardware queues: a segment
    /// holds its queue; the few real-time streams beside the pool are not counted, their work
    /// stops best-effort segments between kernels under `reef+stopruns`), or for
    /// `krisp+model+green` the longest allowed (a job after its first kernel is one segment).
    pub(super) fn segment_ns(&self) -> u64 {
        match self.cfg.policy {
            PolicyConfig::Krisp { unit: RightSizeUnit::Model, .. } => crate::RUN_SEGMENT_NS_MAX,
            _ => self.cfg.run_segment_ns.unwrap_or(if self.pool_streams > self.hw_queues {
                crate::RUN_SEGMENT_NS_SHARED_QUEUES
            } else {
                crate::RUN_SEGMENT_NS_DEFAULT
            }),
        }
    }

    /// `static+green`, `krisp+runs+green` and `krisp+model+green` on a device with hardware
    /// partitions: a job's segments go as runs recorded inside the partition the policy puts the
    /// segment's first launch on (one per slot, segment and partition), which replay at graph
    /// speed on those SMs only. (`krisp+green` sizes every kernel apart, so its kernels go launch
    /// by launch.)
    pub(super) fn partition_segments(&self) -> bool {
        let by_segment = matches!(
            self.cfg.policy,
            PolicyConfig::Static { green: true, .. }
                | PolicyConfig::Krisp { green: true, unit: RightSizeUnit::Segment | RightSizeUnit::Model, .. }
        );
        by_segment && !self.device_groups.is_empty()
    }

    /// Whether the model's segments may go out stoppable ([`Policy::stops_runs`]) for some class:
    /// segments on, the GPU has stop words, and its launches may run again whole.
    pub(super) fn stop_runs_on(&self, m: &Model) -> bool {
        self.segments_on()
            && self.stop_words_supported
            && m.rerunnable
            && (self.policy.stops_runs(Class::RealTime) || self.policy.stops_runs(Class::BestEffort))
    }

    /// The slot's stop word, made on first use; None when the GPU has none (which turns
    /// stoppable segments off) or could not make one now.
    pub(super) fn slot_stop_word(&mut self, slot: &mut IoSlot) -> Option<StopWordId> {
        if slot.stop_word.is_none() && self.stop_words_supported {
            match self.gpu.create_stop_word() {
                Ok(w) => slot.stop_word = Some(w),
                Err(kairos_gpu::GpuError::Unsupported(_)) => self.stop_words_supported = false,
                Err(_) => {}
            }
        }
        slot.stop_word
    }

    /// Counts a launch of job `key` in flight in (`add`) or out of the groups its mask touches:
    /// the job's own count per group, and the jobs per group when its own goes from or to zero.
    /// Kept only for the policies that read it (`PolicyConfig::masks_kernels`): ~140 ns a launch
    /// on the dispatcher thread that the others need not pay.
    pub(super) fn count_groups(&mut self, key: JobKey, mask: &SmMask, add: bool) {
        if !self.cfg.policy.masks_kernels() {
            return;
        }
        let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(Option::as_mut).filter(|j| j.key == key) else {
            return;
        };
        let mut groups = crate::occupancy::groups_of(mask);
        while groups != 0 {
            let g = groups.trailing_zeros() as usize;
            groups &= groups - 1;
            let mine = &mut job.group_refs[g];
            let (before, after) = if add { (*mine, *mine + 1) } else { (*mine, mine.saturating_sub(1)) };
            *mine = after;
            if let Some(n) = self.group_jobs.get_mut(g) {
                match (before, after) {
                    (0, 1) => *n += 1,
                    (1, 0) => *n = n.saturating_sub(1),
                    _ => {}
                }
            }
        }
    }

    /// The segment that launch `launch` of the job starts, if it may go out as one now: segments
    /// are on, the decision left CTAs and mask to the dispatcher, the launch starts a segment of
    /// at least [`SEGMENT_LAUNCHES_MIN`] launches that are all pending from their first block,
    /// every launch before it is issued (so each of the segment's launches finds its dependencies
    /// issued before it on the lane), its I/O is the slot's own, and the launches fit in flight.
    fn segment_to_issue(&self, key: JobKey, launch: u32, ctas: Option<u32>, sm_mask: Option<SmMask>) -> Option<u32> {
        if ctas.is_some() || (sm_mask.is_some() && !self.partition_segments()) || !self.segments_on() {
            return None;
        }
        let job = self.job(key)?;
        let m = self.models[job.model].as_ref()?;
        let g = *m.segment_at.get(launch as usize)?;
        if g == NO_SEGMENT || job.bound_bases.is_some() {
            return None;
        }
        // A class the policy may preempt goes in segments only where they stop between kernels.
        let class = job.options.class;
        if self.policy.preempts_class(class) && !(self.policy.stops_runs(class) && self.stop_runs_on(m)) {
            return None;
        }
        // A run does not wait for a load's copies: launch by launch until the model is resident,
        // and for a cold start (see `launch_whole_run`).
        if job.cold || m.residency.as_ref().is_some_and(|r| r.state != residency::ResidencyState::Resident) {
            return None;
        }
        let range = &m.segments[g as usize];
        let n = job.states.len() as u32;
        let prefix_issued = job.unissued == n - range.start;
        let pending = || range.clone().all(|i| job.states[i as usize] == LState::Pending { first_block: 0 });
        let fits = self.in_flight.len() + range.len() <= self.cfg.launches_in_flight_max as usize;
        (segment_recordable(range) && prefix_issued && fits && pending()).then_some(g)
    }

    /// Issues segment `g` of the job on `stream`: its launches but the last as the slot's
    /// recorded run of them (recording it within the budget the first time), then its last launch,
    /// which reports its start and end and stands for the whole segment on the lane: it goes
    /// `behind` the lane's tail, and the job's issue-ahead window counts the segment's whole
    /// estimate until it starts (the run before it has ended by then). The run's launches are
    /// silent, outside the window and the occupancy mirror (the reporter's CTAs wait as pending
    /// while the run executes, which keeps the gate closed about as long as the segment holds the
    /// SMs); their ends come with the reporter's. `Ok(None)`: the run is not at hand (budget
    /// spent, or the GPU refused to record it): nothing was issued, the launch goes by itself.
    fn issue_segment(
        &mut self,
        key: JobKey,
        g: u32,
        stream: u32,
        behind: Option<LaunchId>,
        sm_mask: Option<SmMask>,
    ) -> Result<Option<LaunchId>, Error> {
        // A segment on part of the GPU: its run is recorded inside that partition.
        let partition = match sm_mask {
            Some(m) if m != self.whole => match self.partition_of(&m) {
                Some(p) => p,
                None => return Ok(None),
            },
            _ => PartitionId::WHOLE,
        };
        let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        let range = m.segments[g as usize].clone();
        let segment_count = m.segments.len();
        let segment_ns: f64 = range.clone().map(|i| m.estimates.get(i)).sum();
        // A class the policy may preempt: the slot's runs that its stop word stops between kernels
        // (`segment_to_issue` checked they may be).
        let stoppable = self.policy.preempts_class(job.options.class);
        let stop_word = if stoppable {
            let mut slot = self.jobs[key.slot as usize].as_mut().and_then(|j| j.slot.take()).expect("admitted job has a slot");
            let word = self.slot_stop_word(&mut slot);
            self.jobs[key.slot as usize].as_mut().expect("issued job exists").slot = Some(slot);
            match word {
                Some(w) => Some(w),
                None => return Ok(None),
            }
        } else {
            None
        };
        let job = self.jobs[key.slot as usize].as_ref().expect("issued job exists");
        let runs = |s: &IoSlot| {
            if partition != PartitionId::WHOLE {
                return s.partition_runs.iter().find(|r| r.0 == g && r.1 == partition).map(|r| r.2);
            }
            if stoppable { &s.stop_runs } else { &s.segment_runs }.get(g as usize).copied().flatten()
        };
        let recorded = job.slot.as_ref().and_then(runs);
        let run = match recorded {
            Some(r) => r,
            None => {
                let full = partition != PartitionId::WHOLE
                    && job.slot.as_ref().is_some_and(|s| s.partition_runs.len() >= PARTITION_RUNS_PER_SLOT_MAX);
                if full {
                    return Ok(None);
                }
                let recorded = self.record_on_demand(key, segment_run_range(&range), stop_word, partition);
                let Some(r) = self.run_or_fallback(recorded) else { return Ok(None) };
                let slot = self.job_mut(key).and_then(|j| j.slot.as_mut()).expect("admitted job has a slot");
                if partition != PartitionId::WHOLE {
                    slot.partition_runs.push((g, partition, r));
                } else {
                    let runs = if stoppable { &mut slot.stop_runs } else { &mut slot.segment_runs };
                    runs.resize(segment_count, None);
                    runs[g as usize] = Some(r);
                }
                r
            }
        };
        // Outside the occupancy books: the reporter stands for the segment there.
        // The run's launches hold the partition's groups in the books (a job's lane stays there).
        let books_mask = sm_mask.unwrap_or(self.whole);
        let (run_last, result) = self.replay_run(key, run, stream, range.start, false, stoppable, books_mask);
        if let Some(t) = run_last {
            // The lane holds what went out, whatever happens next.
            let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
            job.lane = Some(stream);
            job.lane_tail = Some(t);
        }
        result?;
        let reporter = range.end - 1;
        let id = self.issue(key, reporter, stream, 0, None, sm_mask, behind, run_last, stop_word)?;
        // The window holds the whole segment until the reporter starts.
        let f = self.in_flight.get_mut(&id).expect("just issued");
        let own_ns = f.est_ns;
        f.est_ns = segment_ns;
        f.run_from = Some(range.start);
        let job = self.jobs[key.slot as usize].as_mut().expect("issued job exists");
        job.ahead_ns += segment_ns - own_ns;
        self.stats.segments_launched += 1;
        Ok(Some(id))
    }

    pub(super) fn stream_is_idle(&self, s: usize) -> bool {
        self.streams[s].in_flight == 0 && self.streams[s].jobs == 0
    }

    pub(super) fn stream_update(&mut self, s: usize, was_idle: bool) {
        let idle = self.stream_is_idle(s);
        if idle == was_idle {
            return;
        }
        if s >= self.pool_streams {
            // A real-time lane: counted apart from the pool.
            if idle {
                self.idle_realtime_streams += 1;
            } else {
                self.idle_realtime_streams -= 1;
            }
            return;
        }
        let q = s % self.hw_queues;
        let open = self.blocked_queues[q] == 0;
        if idle {
            self.idle_streams += 1;
            self.idle_per_queue[q] += 1;
            self.available_streams += open as u32;
        } else {
            self.idle_streams -= 1;
            self.idle_per_queue[q] -= 1;
            self.available_streams -= open as u32;
        }
    }

    /// A launch waits at the head of hardware queue `q` behind a dependency: its idle streams are
    /// no longer available.
    pub(super) fn block_queue(&mut self, q: usize) {
        if self.blocked_queues[q] == 0 {
            self.available_streams -= self.idle_per_queue[q];
        }
        self.blocked_queues[q] += 1;
    }

    /// A launch no longer waits at the head of queue `q` (see [`Dispatcher::block_queue`]).
    pub(super) fn unblock_queue(&mut self, q: usize) {
        self.blocked_queues[q] -= 1;
        if self.blocked_queues[q] == 0 {
            self.available_streams += self.idle_per_queue[q];
        }
    }

    /// Idle streams whose hardware queue has no launch waiting behind a dependency.
    pub(super) fn available_streams(&self) -> u32 {
        debug_assert_eq!(
            self.available_streams,
            (0..self.pool_streams).filter(|&s| self.stream_is_idle(s) && self.blocked_queues[s % self.hw_queues] == 0).count()
                as u32,
            "the available streams drifted from the pool"
        );
        self.available_streams
    }

    /// An idle stream, scanning round robin from the last one taken (spreads kernels over the
    /// hardware queues the streams map to), skipping streams whose queue has a launch waiting
    /// behind a dependency.
    pub(super) fn take_idle_stream(&mut self) -> Option<u32> {
        if self.idle_streams == 0 {
            return None;
        }
        let n = self.pool_streams;
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

impl<G: Gpu> Dispatcher<G> {
    /// An idle high-priority stream for a real-time job's lane, preferring one whose hardware
    /// queue has no launch waiting behind a dependency.
    pub(super) fn take_idle_realtime_stream(&mut self) -> Option<u32> {
        if self.idle_realtime_streams == 0 {
            return None;
        }
        let idle = (self.pool_streams..self.streams.len()).filter(|&s| self.stream_is_idle(s));
        let open = idle.clone().find(|&s| self.blocked_queues[s % self.hw_queues] == 0);
        open.or_else(|| idle.clone().next()).map(|s| s as u32)
    }
}

/// Share of the dispatcher's time that recording runs for slots made on demand may take, and the
/// most it may take at once (see [`Dispatcher::record_whole_run`]).
pub const RUN_RECORD_SHARE: f64 = 0.05;
pub const RUN_RECORD_CREDIT_MAX_NS: u64 = 20_000_000;

/// Fewest launches in a segment that goes out as a run: two in the run, plus its reporter.
pub const SEGMENT_LAUNCHES_MIN: usize = 3;

/// A segment goes out as a run plus its last launch (shorter ones go launch by launch).
pub(super) fn segment_recordable(segment: &Range<u32>) -> bool {
    segment.len() >= SEGMENT_LAUNCHES_MIN
}

/// The launches of a segment that its recorded run holds: all but its last.
pub(super) fn segment_run_range(segment: &Range<u32>) -> Range<u32> {
    segment.start..segment.end.saturating_sub(1).max(segment.start)
}

/// A model's kernel-level segments: its launches after the first cut, in order, into consecutive ranges of at
/// least `segment_ns` of estimated GPU time (the last one takes what is left, merged into the one
/// before it if shorter than half of that), and for each launch the segment it starts.
pub(super) fn segments_of(estimates: &Estimates, launches: usize, segment_ns: u64) -> (Vec<Range<u32>>, Vec<u32>) {
    let mut segments: Vec<Range<u32>> = Vec::new();
    // The first launch goes by itself: it reports when the job's first block was taken
    // (`Timing::first_start_ns`, REEF's arrival to first CTA), which a run's silent launches cannot.
    let (mut start, mut sum_ns) = (1u32, 0.0);
    for i in 1..launches as u32 {
        sum_ns += estimates.get(i);
        if sum_ns >= segment_ns as f64 {
            segments.push(start..i + 1);
            (start, sum_ns) = (i + 1, 0.0);
        }
    }
    if launches > 1 && (start as usize) < launches {
        match segments.last_mut() {
            Some(last) if sum_ns < segment_ns as f64 / 2.0 => last.end = launches as u32,
            _ => segments.push(start..launches as u32),
        }
    }
    let mut segment_at = vec![NO_SEGMENT; launches];
    for (g, r) in segments.iter().enumerate() {
        segment_at[r.start as usize] = g as u32;
    }
    (segments, segment_at)
}

/// Records launches `launches` of a model on an I/O slot's buffers as kernel-level segments and
/// whole-job issue send them (`Gpu::record_run`: default CTAs, the whole GPU, silent; with
/// `stop_word`, stopped between kernels when it is raised).
#[allow(clippy::too_many_arguments)]
pub(super) fn record_slot_run<G: Gpu>(
    gpu: &mut G,
    m: &Model,
    slot: &IoSlot,
    launches: Range<u32>,
    launch_ctas_max: Option<u32>,
    whole: SmMask,
    partition: PartitionId,
    stream: StreamId,
    stop_word: Option<StopWordId>,
) -> Result<RunId, kairos_gpu::GpuError> {
    let first = launches.start as usize;
    let launches = &m.plan.launches[launches.start as usize..launches.end as usize];
    let mut args: Vec<Vec<DevicePtr>> = Vec::with_capacity(launches.len());
    for l in launches {
        let mut a = Vec::with_capacity(l.args.len());
        slot.bases.resolve_all(&l.args, &mut a);
        if let Some(r) = &m.residency {
            r.resolve_weights(&m.plan, &l.args, &mut a);
        }
        args.push(a);
    }
    let requests: Vec<LaunchRequest<'_>> = launches
        .iter()
        .zip(&args)
        .enumerate()
        .map(|(k, (l, a))| LaunchRequest {
            ctas: m.default_ctas(first + k, 0, launch_ctas_max),
            report_ctas: false,
            preemptible: stop_word.is_some(),
            report_end: false,
            stop_word,
            ..LaunchRequest::of_launch(l, a, whole, partition, stream)
        })
        .collect();
    gpu.record_run(&requests)
}

/// How a launch went out (see [`Dispatcher::note_issued`]).
#[derive(Clone, Copy)]
struct Issued {
    stream: u32,
    first_block: u32,
    ctas: u32,
    mask: SmMask,
    behind: Option<LaunchId>,
    report_ctas: bool,
    report_start: bool,
    learns: bool,
    /// It carries its slot's stop word.
    stoppable: bool,
    at_ns: u64,
    call_ns: u64,
}

/// Streams of a pool of `streams` per hardware queue (stream s uses queue s mod `queues`).
pub(super) fn streams_per_queue(streams: usize, queues: usize) -> Vec<u32> {
    let queues = queues.max(1);
    let mut v = vec![0u32; queues];
    for s in 0..streams {
        v[s % queues] += 1;
    }
    v
}

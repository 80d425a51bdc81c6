//! Admission: models, host mappings, submissions, I/O slots, cancellation and completion.

use super::*;

impl<G: Gpu> Dispatcher<G> {
    /// The host mappings held (zero-copy I/O regions).
    pub fn host_mappings(&self) -> usize {
        self.host_maps.len()
    }

    pub(super) fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping, Error> {
        if self.shutting_down {
            return Err(Error::ShuttingDown);
        }
        if self.host_maps.len() >= HOST_MAPPINGS_MAX {
            return Err(Error::Overloaded { what: "host mappings", max: HOST_MAPPINGS_MAX as u64 });
        }
        let mapping = self.gpu.map_host(memory.clone())?;
        let id = HostMappingId(self.next_host_map_id);
        self.next_host_map_id += 1;
        self.host_maps.insert(id, HostMap { memory, mapping, jobs: 0, closing: false });
        Ok(HostMapping { id, ..mapping })
    }

    pub(super) fn unmap_host(&mut self, id: HostMappingId, out: &mut Vec<Output>) {
        let result = match self.host_maps.get_mut(&id) {
            // A recovery could not map it again: there is nothing left to unmap.
            None if self.lost_mappings.remove(&id) => Ok(()),
            None => Err(Error::InvalidInput(format!("host mapping {} is not mapped", id.0))),
            Some(h) if h.closing => Err(Error::InvalidInput(format!("host mapping {} is already being unmapped", id.0))),
            Some(h) => {
                h.closing = true;
                self.maybe_unmap(id, out);
                return;
            }
        };
        out.push(Output::HostUnmapped { id, result });
    }

    /// Unmaps a closing mapping once no job uses it.
    pub(super) fn maybe_unmap(&mut self, id: HostMappingId, out: &mut Vec<Output>) {
        if !self.host_maps.get(&id).is_some_and(|h| h.closing && h.jobs == 0) {
            return;
        }
        let h = self.host_maps.remove(&id).expect("checked above");
        let result = self.gpu.unmap_host(h.mapping.id).map_err(Error::from);
        out.push(Output::HostUnmapped { id, result });
    }

    /// Checks a binding against the plan and the mapping; the device addresses it names.
    pub(super) fn bind(&self, plan: &Plan, r: &Request, b: &IoBinding) -> Result<Bound, Error> {
        let h = match self.host_maps.get(&b.mapping) {
            Some(h) if !h.closing => &h.mapping,
            Some(_) => return Err(Error::InvalidInput(format!("host mapping {} is being unmapped", b.mapping.0))),
            None if self.lost_mappings.contains(&b.mapping) => {
                return Err(Error::GpuFailed(format!(
                    "host mapping {} could not be mapped again after the GPU was reset; map the memory again",
                    b.mapping.0
                )));
            }
            None => return Err(Error::InvalidInput(format!("host mapping {} is not mapped", b.mapping.0))),
        };
        if r.options.skip_io {
            return Err(Error::InvalidInput("skip_io and I/O bound to a host mapping exclude each other".into()));
        }
        let spans =
            |what: &str, spans: &[MappedSpan], tensors: &[kairos_core::plan::IoTensor]| -> Result<Vec<DevicePtr>, Error> {
                if spans.is_empty() {
                    return Ok(Vec::new());
                }
                if spans.len() != tensors.len() {
                    return Err(Error::InvalidInput(format!(
                        "model '{}' has {} {what}s, the binding names {}",
                        r.model,
                        tensors.len(),
                        spans.len()
                    )));
                }
                let mut ptrs = Vec::with_capacity(spans.len());
                for (s, t) in spans.iter().zip(tensors) {
                    if s.len_bytes != t.len_bytes() {
                        return Err(Error::InvalidInput(format!(
                            "{what} '{}' takes {} bytes, its span holds {}",
                            t.name,
                            t.len_bytes(),
                            s.len_bytes
                        )));
                    }
                    if s.offset_bytes.checked_add(s.len_bytes).is_none_or(|end| end > h.bytes) {
                        return Err(Error::InvalidInput(format!(
                            "{what} '{}': bytes {}..{} are outside the mapping of {} bytes",
                            t.name,
                            s.offset_bytes,
                            s.offset_bytes as u128 + s.len_bytes as u128,
                            h.bytes
                        )));
                    }
                    let p = h.ptr.offset(s.offset_bytes);
                    if !p.0.is_multiple_of(h.align_bytes.max(1)) {
                        return Err(Error::InvalidInput(format!(
                            "{what} '{}' at offset {} is not aligned to the {} bytes the GPU's kernels need",
                            t.name, s.offset_bytes, h.align_bytes
                        )));
                    }
                    ptrs.push(p);
                }
                Ok(ptrs)
            };
        let inputs = spans("input", &b.inputs, &plan.inputs)?;
        let outputs = spans("output", &b.outputs, &plan.outputs)?;
        if !inputs.is_empty() && !r.inputs.is_empty() {
            return Err(Error::InvalidInput("inputs are bound to a host mapping and given as tensors too".into()));
        }
        for (i, o) in b.outputs.iter().enumerate() {
            if let Some(j) = b.outputs[..i].iter().position(|p| o.overlaps(p)) {
                return Err(Error::InvalidInput(format!("outputs {j} and {i} overlap in the host mapping")));
            }
            if let Some(j) = b.inputs.iter().position(|p| o.overlaps(p)) {
                return Err(Error::InvalidInput(format!("output {i} overlaps input {j} in the host mapping")));
            }
        }
        Ok(Bound { mapping: b.mapping, inputs, outputs })
    }

    pub(super) fn load_model(&mut self, spec: ModelSpec) -> Result<ModelInfo, Error> {
        if self.shutting_down {
            return Err(Error::ShuttingDown);
        }
        if self.model_names.contains_key(&spec.name) {
            return Err(Error::ModelExists(spec.name));
        }
        // Loading it again is the way back for a model a recovery could not upload.
        self.lost_models.remove(&spec.name);
        let live = self.models.iter().filter(|m| m.is_some()).count();
        if live >= self.cfg.models_max {
            return Err(Error::Overloaded { what: "models", max: self.cfg.models_max as u64 });
        }
        let plan = spec.plan;
        plan.validate().map_err(|e| Error::InvalidModel(format!("{}: {e}", spec.name)))?;
        if plan.launches.len() > LAUNCHES_PER_PLAN_MAX {
            return Err(Error::InvalidModel(format!(
                "{}: {} launches exceed {LAUNCHES_PER_PLAN_MAX}",
                spec.name,
                plan.launches.len()
            )));
        }
        self.gpu.prepare_plan(&plan)?;
        let mut classes = Vec::with_capacity(plan.launches.len());
        let mut capacity_ctas = Vec::with_capacity(plan.launches.len());
        for (i, l) in plan.launches.iter().enumerate() {
            let res = self.gpu.kernel_resources(&l.kernel, l.dtype, &l.shape)?;
            let class = self.occupancy.intern(res).ok_or_else(|| {
                Error::InvalidModel(format!("{}: launch {i} ({}) cannot be placed: {res:?}", spec.name, l.name))
            })?;
            classes.push(class);
            capacity_ctas.push(self.occupancy.capacity_ctas(class).max(1));
        }
        let mut dependents = vec![Vec::new(); plan.launches.len()];
        let mut dep_counts = vec![0u32; plan.launches.len()];
        for (i, l) in plan.launches.iter().enumerate() {
            let mut deps = l.deps.clone();
            deps.sort_unstable();
            deps.dedup();
            dep_counts[i] = deps.len() as u32;
            for d in deps {
                dependents[d as usize].push(i as u32);
            }
        }
        let default_ctas: Vec<u32> =
            plan.launches.iter().zip(&capacity_ctas).map(|(l, &c)| l.shape.logical_blocks.min(c)).collect();
        let estimates = Estimates::new(&plan, spec.profile.as_ref(), &self.rates, &default_ctas, self.cfg.estimate_window);
        let sm_count = self.occupancy.sm_count();
        let widest_sms = default_ctas
            .iter()
            .zip(&classes)
            .map(|(&c, &class)| c.div_ceil(self.occupancy.ctas_per_sm(class).max(1)).min(sm_count))
            .max()
            .unwrap_or(0);
        let right_sms = right_sizes(&plan, spec.profile.as_ref(), &default_ctas, sm_count);
        // Under a weight budget the weights live in pinned host memory and are loaded on demand.
        let residency = self.new_residency(&plan, spec.profile.as_ref(), &estimates)?;
        let weights = match residency {
            Some(_) => None,
            None => Some(upload_weights(&mut self.gpu, &plan, MemKind::Device)?),
        };
        let info = ModelInfo {
            name: spec.name.clone(),
            launches: plan.launches.len() as u32,
            weight_bytes: plan.weight_bytes,
            arena_bytes: plan.arena_bytes,
            estimated_ns: estimates.total_ns() as u64,
            estimate_source: estimates.source(),
        };
        // Slots for the first burst, now rather than on the dispatcher's path later; running
        // out of memory here only leaves fewer (the rest come on demand, up to the limit).
        let prealloc = self.cfg.slots_per_model_prealloc.min(self.cfg.slots_per_model_max);
        let mut slots_free = Vec::with_capacity(prealloc);
        let weights_ptr = weights.map_or(DevicePtr(0), |w| w.ptr);
        while slots_free.len() < prealloc {
            match new_slot(&mut self.gpu, &plan, weights_ptr) {
                Ok(s) => slots_free.push(s),
                Err(_) => break,
            }
        }
        let slots_total = slots_free.len();
        let mut model = Model {
            name: spec.name.clone(),
            plan,
            weights,
            residency,
            dependents,
            dep_counts,
            classes,
            capacity_ctas,
            estimates,
            slots_free,
            slots_total,
            waiting: VecDeque::new(),
            jobs: 0,
            unloading: false,
            segments: Vec::new(),
            segment_at: Vec::new(),
            widest_sms,
            right_sms,
            realtime_waiting: 0,
            rerunnable: false,
        };
        model.rerunnable = model.plan.launches_rerunnable();
        if self.segments_on() {
            (model.segments, model.segment_at) =
                issue::segments_of(&model.estimates, model.plan.launches.len(), self.segment_ns());
            // Right-sized segments: a segment's first launch carries the segment's right size (the
            // policy places the segment by it).
            if self.partition_segments() && matches!(self.cfg.policy, PolicyConfig::Krisp { .. }) {
                for range in &model.segments {
                    model.right_sms[range.start as usize] =
                        segment_right_sms(spec.profile.as_ref(), &model.right_sms, range.clone(), sm_count);
                }
            }
        }
        if let Err(e) = self.make_resident_if_room(&mut model) {
            free_model(&mut self.gpu, model);
            return Err(e);
        }
        // Runs name device addresses: a model that is not resident records its runs once loaded.
        let resident = model.residency.as_ref().is_none_or(|r| r.state == ResidencyState::Resident);
        // Whole-job issue replays each slot's recorded run: record those of the slots made now,
        // while nothing is served (slots made on demand are recorded at their first job).
        let n = model.plan.launches.len() as u32;
        if resident
            && self.cfg.record_runs
            && self.runs_supported
            && !self.cfg.policy.is_kernel_level()
            && !self.policy.preempts()
            && n >= 3
        {
            for i in 0..model.slots_free.len() {
                let Some(run) = self.record_at_load(&model, i, 0..n - 1, None) else { break };
                model.slots_free[i].run = Some(run);
            }
        }
        // Kernel-level segments likewise, every segment of every slot made now.
        // (Segments inside partitions are recorded when a job first runs one there.)
        if resident && self.segments_on() && !self.partition_segments() {
            'slots: for i in 0..model.slots_free.len() {
                for g in 0..model.segments.len() {
                    if !issue::segment_recordable(&model.segments[g]) {
                        continue;
                    }
                    let range = issue::segment_run_range(&model.segments[g]);
                    let Some(run) = self.record_at_load(&model, i, range.clone(), None) else { break 'slots };
                    let runs = &mut model.slots_free[i].segment_runs;
                    runs.resize(model.segments.len(), None);
                    runs[g] = Some(run);
                    // And stoppable ones for the jobs a preemption may stop.
                    if self.stop_runs_on(&model) {
                        let Some(word) = self.slot_stop_word(&mut model.slots_free[i]) else { continue };
                        let Some(run) = self.record_at_load(&model, i, range, Some(word)) else { break 'slots };
                        let runs = &mut model.slots_free[i].stop_runs;
                        runs.resize(model.segments.len(), None);
                        runs[g] = Some(run);
                    }
                }
            }
        }
        let index = match self.models.iter().position(|m| m.is_none()) {
            Some(i) => {
                self.models[i] = Some(model);
                i
            }
            None => {
                self.models.push(Some(model));
                self.models.len() - 1
            }
        };
        self.model_names.insert(spec.name, index);
        Ok(info)
    }

    pub(super) fn unload_model(&mut self, name: String, out: &mut Vec<Output>) {
        let Some(&index) = self.model_names.get(&name) else {
            let result = if self.lost_models.remove(&name).is_some() { Ok(()) } else { Err(Error::UnknownModel(name.clone())) };
            out.push(Output::ModelUnloaded { name, result });
            return;
        };
        let m = self.models[index].as_mut().expect("named model exists");
        if m.unloading {
            out.push(Output::ModelUnloaded { name: name.clone(), result: Err(Error::ModelUnloading(name)) });
            return;
        }
        m.unloading = true;
        self.maybe_free_model(index, out);
    }

    pub(super) fn maybe_free_model(&mut self, index: usize, out: &mut Vec<Output>) {
        let Some(m) = self.models[index].as_ref() else { return };
        // A load's copies write into the model's device memory until they land (its last
        // CopyDone calls this again).
        let loading = m.residency.as_ref().is_some_and(|r| r.state == ResidencyState::Loading);
        if !m.unloading || m.jobs > 0 || loading {
            return;
        }
        let m = self.models[index].take().expect("checked above");
        self.model_names.remove(&m.name);
        let name = m.name.clone();
        free_model(&mut self.gpu, m);
        out.push(Output::ModelUnloaded { name, result: Ok(()) });
    }

    pub(super) fn shutdown(&mut self, out: &mut Vec<Output>) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        let ids: Vec<(u64, RequestId)> = self.jobs.iter().flatten().map(|j| (j.seq, j.id)).collect();
        let mut ids = ids;
        ids.sort();
        for (_, id) in ids {
            self.cancel(id, Error::ShuttingDown, out);
        }
        self.maybe_finish_shutdown(out);
    }

    pub(super) fn maybe_finish_shutdown(&mut self, out: &mut Vec<Output>) {
        // Nor while a load's copies are in flight (the last one's CopyDone calls this again).
        if !self.shutting_down || self.shut_down || self.job_count > 0 || !self.copy_owner.is_empty() {
            return;
        }
        for index in 0..self.models.len() {
            if let Some(m) = self.models[index].take() {
                self.model_names.remove(&m.name);
                free_model(&mut self.gpu, m);
            }
        }
        let mut ids: Vec<HostMappingId> = self.host_maps.keys().copied().collect();
        ids.sort();
        for id in ids {
            let h = self.host_maps.remove(&id).expect("listed");
            let result = self.gpu.unmap_host(h.mapping.id).map_err(Error::from);
            out.push(Output::HostUnmapped { id, result });
        }
        self.shut_down = true;
        out.push(Output::ShutDown);
    }

    pub(super) fn reject(&mut self, id: RequestId, e: Error, out: &mut Vec<Output>) {
        self.stats.rejected += 1;
        out.push(Output::Done { id, result: Err(e) });
    }

    pub(super) fn submit(&mut self, r: Request, binding: Option<IoBinding>, out: &mut Vec<Output>) {
        self.stats.submitted += 1;
        if self.shutting_down {
            return self.reject(r.id, Error::ShuttingDown, out);
        }
        let Some(&model) = self.model_names.get(&r.model) else {
            if let Some(e) = self.lost_models.get(&r.model) {
                let e = Error::GpuFailed(format!("model '{}' could not be loaded again after the GPU was reset: {e}", r.model));
                return self.reject(r.id, e, out);
            }
            return self.reject(r.id, Error::UnknownModel(r.model), out);
        };
        let m = self.models[model].as_ref().expect("named model exists");
        if m.unloading {
            return self.reject(r.id, Error::ModelUnloading(r.model), out);
        }
        if self.by_id.contains_key(&r.id) {
            return self.reject(r.id, Error::InvalidInput(format!("request id {} is already in use", r.id.0)), out);
        }
        if self.job_count >= self.cfg.jobs_max {
            return self.reject(r.id, Error::Overloaded { what: "dispatcher jobs", max: self.cfg.jobs_max as u64 }, out);
        }
        if !self.tenant_index.contains_key(&r.options.tenant) && self.tenants.len() >= self.cfg.tenants_max {
            return self.reject(r.id, Error::Overloaded { what: "tenants", max: self.cfg.tenants_max as u64 }, out);
        }
        let bound = match binding.map(|b| self.bind(&m.plan, &r, &b)).transpose() {
            Ok(b) => b,
            Err(e) => return self.reject(r.id, e, out),
        };
        let mut inputs = Vec::new();
        if !r.options.skip_io && bound.as_ref().is_none_or(|b| b.inputs.is_empty()) {
            if r.inputs.len() != m.plan.inputs.len() {
                let e = Error::InvalidInput(format!(
                    "model '{}' takes {} inputs, got {}",
                    r.model,
                    m.plan.inputs.len(),
                    r.inputs.len()
                ));
                return self.reject(r.id, e, out);
            }
            for (i, t) in r.inputs.iter().enumerate() {
                match input_bytes(&m.plan, i, t) {
                    Ok(b) => inputs.push(b),
                    Err(kairos_gpu::GpuError::Invalid(e)) => return self.reject(r.id, Error::InvalidInput(e), out),
                    Err(e) => return self.reject(r.id, Error::InvalidInput(e.to_string()), out),
                }
            }
        }
        let n = m.plan.launches.len();
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.jobs.push(None);
                (self.jobs.len() - 1) as u32
            }
        };
        self.generation = self.generation.wrapping_add(1);
        let key = JobKey { slot, generation: self.generation };
        let arrival_ns = r.arrival_ns.unwrap_or(self.now_ns);
        let job = Job {
            key,
            id: r.id,
            model,
            options: r.options,
            arrival_ns,
            admitted_ns: 0,
            first_issue_ns: None,
            first_round_ns: None,
            inputs,
            slot: None,
            bound,
            bound_bases: None,
            states: vec![LState::Pending { first_block: 0 }; n],
            deps_open: Vec::new(),
            issuable: BTreeSet::new(),
            running: BTreeSet::new(),
            running_unstoppable: 0,
            lane: None,
            lane_tail: None,
            ahead_launches: 0,
            ahead_ns: 0.0,
            draining: false,
            chained: 0,
            unissued: n as u32,
            in_flight: 0,
            done: 0,
            cancelled: false,
            error: None,
            view: None,
            stream: None,
            copy_waited: None,
            cold: m.residency.as_ref().is_some_and(|r| r.state != ResidencyState::Resident),
            remaining_ns: 0.0,
            total_ns: 0.0,
            first_start_ns: None,
            last_done_ns: 0,
            gpu_ns: 0,
            seq: 0,
            last_issue_seq: 0,
            counted_ready: false,
            notified: false,
            group_refs: [0; 32],
        };
        let tenant = job.options.tenant;
        let class = job.options.class;
        if let Some(b) = &job.bound {
            self.host_maps.get_mut(&b.mapping).expect("bound to a live mapping").jobs += 1;
        }
        self.jobs[slot as usize] = Some(job);
        self.by_id.insert(r.id, key);
        self.job_count += 1;
        self.tenant_add(tenant);
        let m = self.models[model].as_mut().expect("named model exists");
        m.jobs += 1;
        if let Some(r) = m.residency.as_mut() {
            r.arrivals_ns = [arrival_ns.max(1), r.arrivals_ns[0]];
        }
        m.waiting.push_back(key);
        m.realtime_waiting += (class == Class::RealTime) as usize;
        self.admit_waiting(model, out);
    }

    /// Gives free (or new, up to the limit) slots to the model's waiting jobs: real-time ones first,
    /// in arrival order within a class.
    pub(super) fn admit_waiting(&mut self, model: usize, out: &mut Vec<Output>) {
        self.admit_waiting_now(model, out);
        // A load this started copies now, behind the inputs of the requests it admitted.
        self.queue_copies_after_admission(model, out);
    }

    fn admit_waiting_now(&mut self, model: usize, out: &mut Vec<Output>) {
        loop {
            let m = self.models[model].as_ref().expect("model of a job exists");
            // Real-time requests take a free slot before best-effort ones (arrival order within
            // a class).
            let jobs = &self.jobs;
            let is_rt = |k: &JobKey| jobs[k.slot as usize].as_ref().is_some_and(|j| j.options.class == Class::RealTime);
            let at = if m.realtime_waiting > 0 { m.waiting.iter().position(is_rt).unwrap_or(0) } else { 0 };
            let Some(&key) = m.waiting.get(at) else { return };
            let rt = is_rt(&key);
            // A model not in device memory is loaded first (or waits for room).
            if !self.ready_to_admit(model, out) {
                return;
            }
            let m = self.models[model].as_mut().expect("model of a job exists");
            let slot = match m.slots_free.pop() {
                Some(s) => s,
                None if m.slots_total < self.cfg.slots_per_model_max => {
                    match new_slot(&mut self.gpu, &m.plan, m.weights.map_or(DevicePtr(0), |w| w.ptr)) {
                        Ok(s) => {
                            m.slots_total += 1;
                            s
                        }
                        // Out of memory with slots still out: the next completion frees one.
                        Err(_) if m.slots_total > 0 => return,
                        Err(e) => {
                            m.waiting.remove(at);
                            m.realtime_waiting -= rt as usize;
                            self.finish(key, Some(e), out);
                            continue;
                        }
                    }
                }
                None => return,
            };
            m.waiting.remove(at);
            m.realtime_waiting -= rt as usize;
            if let Some(r) = m.residency.as_mut() {
                r.last_used_ns = self.now_ns;
            }
            self.admit(key, slot, out);
        }
    }

    pub(super) fn admit(&mut self, key: JobKey, slot: IoSlot, out: &mut Vec<Output>) {
        let now = self.now_ns;
        let job = self.jobs[key.slot as usize].as_mut().expect("waiting job exists");
        let m = self.models[job.model].as_ref().expect("model of a job exists");
        // Inputs go in before any kernel can read them.
        let mut write_error = None;
        for (i, bytes) in job.inputs.drain(..).enumerate() {
            if let Err(e) = self.gpu.write(slot.bases.inputs[i], &bytes) {
                write_error = Some(Error::from(e));
                break;
            }
        }
        if let Some(b) = &job.bound {
            let mut bases = slot.bases.clone();
            if !b.inputs.is_empty() {
                bases.inputs.clone_from(&b.inputs);
            }
            if !b.outputs.is_empty() {
                bases.outputs.clone_from(&b.outputs);
            }
            job.bound_bases = Some(bases);
        }
        job.slot = Some(slot);
        job.admitted_ns = now;
        job.deps_open = m.dep_counts.clone();
        job.issuable = job.deps_open.iter().enumerate().filter(|&(_, &d)| d == 0).map(|(i, _)| i as u32).collect();
        job.total_ns = m.estimates.total_ns();
        job.remaining_ns = job.total_ns;
        self.admit_seq += 1;
        job.seq = self.admit_seq;
        job.view = Some(self.views.len());
        let placeholder = JobView {
            key,
            id: job.id,
            seq: job.seq,
            model: job.model as u32,
            tenant: job.options.tenant,
            class: job.options.class,
            priority: job.options.priority,
            arrival_ns: job.arrival_ns,
            deadline_at_ns: job.options.deadline_ns.map(|d| job.arrival_ns.saturating_add(d)),
            total_ns: job.total_ns as u64,
            remaining_ns: job.remaining_ns as u64,
            launches: job.states.len() as u32,
            launches_unissued: job.unissued,
            in_flight: 0,
            next_ready: None,
            ready_count: 0,
            stream: None,
            last_issue_seq: 0,
            running: None,
            running_issue_seq: 0,
            admitted_issue_seq: self.issue_seq,
            cancelled: false,
            widest_sms: m.widest_sms,
        };
        self.views.push(placeholder);
        if let Some(e) = write_error {
            self.fail(key, e, out);
            return;
        }
        if job_is_complete(self.jobs[key.slot as usize].as_ref().unwrap()) {
            // A plan without launches.
            self.finish(key, None, out);
            return;
        }
        self.maybe_wake(key);
        self.refresh(key);
    }

    /// Stops a job; `reason` is what it completes with once nothing of it is on the GPU.
    pub(super) fn cancel(&mut self, id: RequestId, reason: Error, out: &mut Vec<Output>) {
        let Some(&key) = self.by_id.get(&id) else { return };
        self.fail(key, reason, out);
    }

    pub(super) fn fail(&mut self, key: JobKey, reason: Error, out: &mut Vec<Output>) {
        let Some(job) = self.jobs.get_mut(key.slot as usize).and_then(|j| j.as_mut()).filter(|j| j.key == key) else { return };
        if job.cancelled {
            return;
        }
        job.cancelled = true;
        if job.slot.is_none() {
            // Still waiting for a slot: nothing was issued.
            let m = self.models[job.model].as_mut().expect("model of a job exists");
            m.waiting.retain(|k| *k != key);
            m.realtime_waiting -= (job.options.class == Class::RealTime) as usize;
            self.finish(key, Some(reason), out);
            return;
        }
        if job.in_flight == 0 {
            self.finish(key, Some(reason), out);
            return;
        }
        job.error = Some(reason);
        job.running.clear();
        job.running_unstoppable = 0;
        job.issuable.clear();
        let issued: Vec<LaunchId> =
            job.states.iter().filter_map(|s| if let LState::Issued(l) = s { Some(*l) } else { None }).collect();
        for l in issued {
            // A launch that already finished is a no-op for the GPU; its LaunchDone is on the way.
            let _ = self.gpu.preempt(l);
        }
        self.refresh(key);
    }

    // ---------------------------------------------------------------- completion

    /// Removes a job and emits its result: `error` if given, else its outputs.
    pub(super) fn finish(&mut self, key: JobKey, error: Option<Error>, out: &mut Vec<Output>) {
        let mut job = self.jobs[key.slot as usize].take().expect("finished job exists");
        self.free_slots.push(key.slot);
        self.by_id.remove(&job.id);
        self.job_count -= 1;
        if let Some(v) = job.view.take() {
            self.views.swap_remove(v);
            if let Some(moved) = self.views.get(v).map(|x| x.key) {
                self.jobs[moved.slot as usize].as_mut().expect("viewed job exists").view = Some(v);
            }
        }
        if let Some(s) = job.stream {
            let s = s as usize;
            let was_idle = self.stream_is_idle(s);
            self.streams[s].jobs -= 1;
            self.stream_update(s, was_idle);
        }
        self.tenant_remove(job.options.tenant, job.counted_ready);
        let now = self.now_ns;
        if job.options.class == Class::RealTime {
            self.last_realtime_done_ns = now.max(1);
        }
        let result = match error {
            Some(e) => {
                if e == Error::Cancelled {
                    self.stats.cancelled += 1;
                } else {
                    self.stats.failed += 1;
                }
                Err(e)
            }
            None => {
                let m = self.models[job.model].as_ref().expect("model of a job exists");
                let mut outputs = Vec::new();
                let mut read_error = None;
                let outputs_bound = job.bound.as_ref().is_some_and(|b| !b.outputs.is_empty());
                if !job.options.skip_io
                    && !outputs_bound
                    && let Some(slot) = &job.slot
                {
                    for (o, ptr) in m.plan.outputs.iter().zip(&slot.bases.outputs) {
                        let mut bytes = vec![0u8; o.len_bytes() as usize];
                        if let Err(e) = self.gpu.read(*ptr, &mut bytes) {
                            read_error = Some(Error::from(e));
                            break;
                        }
                        match Tensor::from_bytes(o.dtype, o.shape.clone(), &bytes) {
                            Ok(t) => outputs.push(t),
                            Err(e) => {
                                read_error = Some(Error::Gpu(e));
                                break;
                            }
                        }
                    }
                }
                match read_error {
                    Some(e) => {
                        self.stats.failed += 1;
                        Err(e)
                    }
                    None => {
                        self.stats.completed += 1;
                        let deadline_missed = job.options.deadline_ns.is_some_and(|d| now > job.arrival_ns.saturating_add(d));
                        Ok(Response {
                            id: job.id,
                            outputs,
                            timing: Timing {
                                arrival_ns: job.arrival_ns,
                                admitted_ns: job.admitted_ns,
                                first_issue_ns: job.first_issue_ns.unwrap_or(job.admitted_ns),
                                first_round_ns: job.first_round_ns.unwrap_or(job.admitted_ns),
                                done_ns: now,
                                launches: job.states.len() as u32,
                                chained: job.chained,
                                deadline_missed,
                                first_start_ns: job.first_start_ns.unwrap_or(0),
                                last_done_ns: job.last_done_ns,
                                gpu_ns: job.gpu_ns,
                                estimated_ns: job.total_ns as u64,
                                cold_start: job.cold,
                            },
                        })
                    }
                }
            }
        };
        out.push(Output::Done { id: job.id, result });
        let model = job.model;
        let m = self.models[model].as_mut().expect("model of a job exists");
        m.jobs -= 1;
        if let Some(slot) = job.slot.take() {
            m.slots_free.push(slot);
        }
        if let Some(b) = job.bound.take() {
            // Nothing of the job is on the GPU any more: the mapping may go if it is closing.
            self.host_maps.get_mut(&b.mapping).expect("bound to a live mapping").jobs -= 1;
            self.maybe_unmap(b.mapping, out);
        }
        if let Some(r) = self.models[model].as_mut().and_then(|m| m.residency.as_mut()) {
            r.last_used_ns = now;
        }
        self.admit_waiting(model, out);
        self.maybe_free_model(model, out);
        // Its model may now be evicted for a load that waited for room.
        self.retry_loads(out);
        self.maybe_finish_shutdown(out);
    }
}

impl<G: Gpu> Dispatcher<G> {
    /// Records `launches` of a model being loaded on its slot `slot` (see
    /// [`issue::record_slot_run`]); None when the GPU has no runs or refused (not fatal: the slot is
    /// recorded, or goes launch by launch, later).
    fn record_at_load(
        &mut self,
        model: &Model,
        slot: usize,
        launches: std::ops::Range<u32>,
        stop_word: Option<StopWordId>,
    ) -> Option<RunId> {
        let t0 = self.gpu.now_ns();
        let (launch_ctas_max, whole, stream) = (self.cfg.launch_ctas_max, self.whole, self.stream_ids[0]);
        let slot = &model.slots_free[slot];
        let recorded = issue::record_slot_run(
            &mut self.gpu,
            model,
            slot,
            launches,
            launch_ctas_max,
            whole,
            PartitionId::WHOLE,
            stream,
            stop_word,
        );
        let run = self.run_or_fallback(recorded.map(Some))?;
        self.stats.runs_recorded += 1;
        self.stats.run_record_ns += self.gpu.now_ns().saturating_sub(t0);
        Some(run)
    }
}

pub(super) fn new_slot<G: Gpu>(gpu: &mut G, plan: &Plan, weights: kairos_gpu::DevicePtr) -> Result<IoSlot, Error> {
    let mut allocations = Vec::new();
    let result = (|| {
        let arena = gpu.alloc(plan.arena_bytes.max(1), MemKind::Device)?;
        allocations.push(arena);
        let mut bases = SpaceBases { arena: arena.ptr, weights, inputs: Vec::new(), outputs: Vec::new() };
        for t in &plan.inputs {
            let a = gpu.alloc(t.len_bytes().max(1), MemKind::Device)?;
            allocations.push(a);
            bases.inputs.push(a.ptr);
        }
        for t in &plan.outputs {
            let a = gpu.alloc(t.len_bytes().max(1), MemKind::Device)?;
            allocations.push(a);
            bases.outputs.push(a.ptr);
        }
        Ok::<_, kairos_gpu::GpuError>(bases)
    })();
    match result {
        Ok(bases) => Ok(IoSlot {
            allocations,
            bases,
            run: None,
            segment_runs: Vec::new(),
            stop_word: None,
            stop_runs: Vec::new(),
            partition_runs: Vec::new(),
        }),
        Err(e) => {
            for a in allocations {
                let _ = gpu.free(a);
            }
            Err(e.into())
        }
    }
}

pub(super) fn free_slot<G: Gpu>(gpu: &mut G, slot: IoSlot) {
    let partition_runs = slot.partition_runs.into_iter().map(|(_, _, r)| r);
    for r in slot
        .run
        .into_iter()
        .chain(slot.segment_runs.into_iter().flatten())
        .chain(slot.stop_runs.into_iter().flatten())
        .chain(partition_runs)
    {
        let _ = gpu.drop_run(r);
    }
    if let Some(w) = slot.stop_word {
        let _ = gpu.destroy_stop_word(w);
    }
    for a in slot.allocations {
        let _ = gpu.free(a);
    }
}

pub(super) fn free_model<G: Gpu>(gpu: &mut G, m: Model) {
    for s in m.slots_free {
        free_slot(gpu, s);
    }
    if let Some(w) = m.weights {
        let _ = gpu.free(w);
    }
    if let Some(r) = m.residency {
        residency::free_residency(gpu, r);
    }
}

/// KRISP's right size for a run of consecutive launches: the fewest SMs, among the sizes the
/// profile measured, at which the launches' summed durations stay within [`RIGHT_SIZE_SLACK`] of
/// their sum on the whole GPU (a model-level latency-against-SMs curve from the kernels' own).
/// Without a profile that covers them: the largest of their right sizes (`right_sms`).
pub(super) fn segment_right_sms(
    profile: Option<&kairos_gpu::profile::ModelProfile>,
    right_sms: &[u32],
    launches: std::ops::Range<u32>,
    sm_count: u32,
) -> u32 {
    let widest = || launches.clone().map(|i| right_sms[i as usize]).max().unwrap_or(sm_count).clamp(1, sm_count.max(1));
    let Some(p) = profile else { return widest() };
    let kernels = match p.kernels.get(launches.start as usize..launches.end as usize) {
        Some(k)
            if !k.is_empty() && k.iter().zip(launches.clone()).all(|(k, i)| k.launch == i && !k.duration_by_sms.is_empty()) =>
        {
            k
        }
        _ => return widest(),
    };
    // A kernel's duration at `sms`: its measurement at the smallest size measured at or above it.
    let at = |k: &kairos_gpu::profile::KernelProfile, sms: u32| {
        k.duration_by_sms.iter().filter(|(s, _)| *s >= sms).min_by_key(|(s, _)| *s).map_or(k.duration_ns, |x| x.1)
    };
    let whole: u64 = kernels.iter().map(|k| at(k, sm_count)).sum();
    let mut sizes: Vec<u32> = kernels[0].duration_by_sms.iter().map(|x| x.0).filter(|&s| s > 0 && s <= sm_count).collect();
    sizes.sort_unstable();
    sizes
        .into_iter()
        .find(|&s| kernels.iter().map(|k| at(k, s)).sum::<u64>() as f64 <= whole as f64 * RIGHT_SIZE_SLACK)
        .unwrap_or(sm_count)
}

/// [`segment_right_sms`]'s tolerance, as `kairos profile`'s per kernel (`min_sms`): within 5%.
pub const RIGHT_SIZE_SLACK: f64 = 1.05;

/// Each launch's right size in SMs (KRISP's minimum CUs): the profile's `min_sms` when the
/// profile was measured on this plan (one entry per launch, in order), else the SMs its default
/// grid spreads over (one CTA per SM, as the hardware spreads a grid), at most the GPU.
pub(super) fn right_sizes(
    plan: &kairos_core::plan::Plan,
    profile: Option<&kairos_gpu::profile::ModelProfile>,
    default_ctas: &[u32],
    sm_count: u32,
) -> Vec<u32> {
    let n = plan.launches.len();
    let measured = profile.filter(|p| p.kernels.len() == n && p.kernels.iter().enumerate().all(|(i, k)| k.launch as usize == i));
    (0..n)
        .map(|i| match measured {
            Some(p) if p.kernels[i].min_sms > 0 => p.kernels[i].min_sms.min(sm_count),
            _ => default_ctas[i].clamp(1, sm_count.max(1)),
        })
        .collect()
}

//! Residency: more models than GPU memory holds (DeepPlan's setting, EuroSys'23).
//!
//! With a weight budget ([`Config::weight_budget_bytes`]) every model keeps its whole weight blob
//! in pinned host memory mapped into the device (`MemKind::HostMapped`), and its *cold plan*
//! ([`crate::cold`]) says which weight layers live in device memory when it is resident (loaded)
//! and which stay in host memory, read in place by their kernels (direct host access, DHA). A
//! model is `HostOnly` (nothing on the device), `Loading` (its loaded layers being copied, chunk by
//! chunk, on the dispatcher's copy stream) or `Resident`. The budget counts the device bytes of
//! the loaded layers of every model that is loading or resident.
//!
//! A request to a host-only model starts its load when it is admitted: least recently used
//! resident models with no request in the dispatcher are evicted until the load fits (a model
//! with requests is never evicted; when nothing can go, the request waits, and loads waiting for
//! memory are retried as requests finish). Under the `load-then-run` strategy the model's
//! requests wait for the whole copy; under `pipelined` and `deepplan` they are admitted at once
//! and each launch that reads a layer still in flight goes out behind a GPU-side wait for that
//! layer's copy ([`Gpu::wait_copy`]: the host never waits, and a launch runs as soon as its layer
//! has landed). Other models' requests are not held back by a load: the copies use a stream of
//! their own and a copy engine, not SMs, and only a window of them ([`Config::cold_copy_window_bytes`])
//! sits on the copy engine at once, the next going out as each lands: the engine runs its queue in
//! order, so an input copy of a warm request (written synchronously by the dispatcher's thread)
//! queued behind a whole load would wait for all of it. A kernel-level job of a loading model is
//! offered to the policy only when the layers its next launch reads are landed or on the engine; a
//! launch issued before its layers' turn (a whole job on a stream) brings their copies forward.
//! While a model is loading its jobs go launch by launch (recorded runs do not wait for copies);
//! its slots' runs, dropped at eviction since they name the old device addresses, are recorded
//! again on demand.
//!
//! Device addresses: the loaded layers are packed into one device allocation, consecutive loaded
//! layers at the same distance as in the blob (so a run of them is one contiguous copy), a host
//! layer between them leaving no hole. A weight argument resolves through the layer holding its
//! offset (`Model::resolve_weights`).

use super::*;
use crate::cold::{self, ColdPlan, ColdStrategy};
use kairos_core::plan::Space;
use kairos_gpu::CopyId;

/// Default [`Config::cold_chunk_bytes`]: copies of at least 2 MiB run at full PCIe bandwidth
/// (one copy per small tensor does not: resnet50's 161 tensors at 24 GB/s against 48 for BERT's
/// larger ones, measured with PyTorch on an H100).
pub const COLD_CHUNK_BYTES_DEFAULT: u64 = 2 << 20;
/// Default [`Config::cold_copy_window_bytes`]: a load's copies are queued while less than it is
/// on the copy engine, in pieces of at most half of it (a chunk of the plan, 2-5 MiB for BERT's
/// layers, goes whole; a longer one is cut into equal pieces), so two or more are in flight and
/// the engine stays busy while the host learns of each landing; an input copy behind them waits
/// for at most 24 MiB, ~0.45 ms at PCIe 5's ~55 GB/s, instead of a whole load (4 ms for bert_base
/// f16). Smaller pieces cost bandwidth: with a 4 or 8 MiB window (chunks cut into 2 MiB pieces) a
/// single cold bert_base's load took 0.2 ms (7%) longer than with whole chunks, and DeepPlan's
/// serving experiment, bound by the copy engine, lost up to half its goodput (H200, 2026-11-28;
/// PyTorch's 2 MiB copies run at 48.8 GB/s against 52-54 in one copy, H100).
pub const COLD_COPY_WINDOW_BYTES_DEFAULT: u64 = 16 << 20;
/// Alignment of a loaded layer that follows a host layer in the device blob.
const DEVICE_LAYER_ALIGN_BYTES: u64 = 256;

/// Which resident model a load evicts (only models with no request in the dispatcher are
/// candidates, whichever the rule).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Eviction {
    /// Least recently used (DeepPlan's rule): the oldest last admission or completion.
    #[default]
    Lru,
    /// LRU-2 (O'Neil, O'Neil and Weikum, SIGMOD'93): the oldest second-to-last request arrival
    /// first (a model asked once has none: it goes before any model asked twice), then least
    /// recently used. A model under steady traffic is not evicted by a burst of requests to models
    /// asked once, which plain LRU does whenever its last request is older than the burst's
    /// loads (measured on an H200: with 6 copies in the budget, 4 hot bert_base instances beside
    /// 28 cold ones, 22% of the hot requests became cold starts under LRU).
    Lru2,
}

impl Eviction {
    pub fn name(self) -> &'static str {
        match self {
            Eviction::Lru => "lru",
            Eviction::Lru2 => "lru2",
        }
    }
}

impl std::fmt::Display for Eviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Eviction {
    type Err = String;

    /// `lru` or `lru2`.
    fn from_str(s: &str) -> Result<Eviction, String> {
        [Eviction::Lru, Eviction::Lru2]
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("unknown eviction rule '{s}' (expected lru or lru2)"))
    }
}

/// Where a model's weights are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidencyState {
    HostOnly,
    Loading,
    Resident,
}

/// Residency of one model under a weight budget.
pub(super) struct Residency {
    pub(super) state: ResidencyState,
    /// The whole blob in pinned host memory mapped into the device (source of loads, and what DHA
    /// layers are read from).
    host: Allocation,
    /// The loaded layers on the device while loading or resident.
    device: Option<Allocation>,
    pub(super) cold: ColdPlan,
    /// Per layer, its offset in the device allocation (None: a host layer).
    device_offset: Vec<Option<u64>>,
    /// Bytes of the device allocation (what the budget counts).
    pub(super) device_bytes: u64,
    /// The copies a load issues, as layer ranges.
    chunks: Vec<std::ops::Range<u32>>,
    /// Per layer, the copy bringing it while it is in flight (its chunk's latest piece queued).
    layer_copy: Vec<Option<CopyId>>,
    /// Per layer, loaded but its chunk not (wholly) on the copy engine yet.
    unqueued: Vec<bool>,
    /// The load's own pieces not queued yet, in issue order (see `top_up`).
    pieces: std::collections::VecDeque<Piece>,
    /// The load's own copies on the copy engine, and their bytes.
    own_in_flight: Vec<(CopyId, u64)>,
    /// A copy was refused: the rest of the load is written synchronously.
    refused: bool,
    /// Per launch, the weight layers it reads.
    reads: Vec<Vec<u32>>,
    copies_pending: usize,
    /// The load's copies are queued (`queue_copies`).
    copies_queued: bool,
    load_started_ns: u64,
    /// Last time a request of the model was admitted or finished (LRU).
    pub(super) last_used_ns: u64,
    /// Arrival times of the model's last two requests, the latest first (0: none; LRU-2).
    pub(super) arrivals_ns: [u64; 2],
}

impl Residency {
    /// The copy a launch must wait for: the latest one in flight among the layers it reads (one
    /// copy stream completes them in order, so waiting for it covers the earlier ones).
    pub(super) fn copy_needed(&self, launch: usize) -> Option<CopyId> {
        if self.state != ResidencyState::Loading {
            return None;
        }
        self.reads[launch].iter().filter_map(|&l| self.layer_copy[l as usize]).max()
    }

    /// Whether a launch reads a layer whose copy is not on the copy engine yet (nothing to wait
    /// for on the GPU: it must not be issued before that copy is queued).
    pub(super) fn reads_unqueued(&self, launch: usize) -> bool {
        self.state == ResidencyState::Loading && self.reads[launch].iter().any(|&l| self.unqueued[l as usize])
    }

    /// Rewrites the weight arguments of a launch (resolved against the plain blob layout) to where
    /// the cold plan put their layers.
    pub(super) fn resolve_weights(&self, plan: &Plan, args: &[kairos_core::plan::BufRef], out: &mut [DevicePtr]) {
        let device = self.device.map(|d| d.ptr.0).unwrap_or(0);
        for (a, p) in args.iter().zip(out.iter_mut()) {
            if a.space != Space::Weights {
                continue;
            }
            let l = layer_at(plan, a.offset_bytes);
            let layer_offset = plan.layers[l].offset_bytes;
            *p = match self.device_offset[l] {
                Some(d) => DevicePtr(device + d + (a.offset_bytes - layer_offset)),
                None => DevicePtr(self.host.ptr.0 + a.offset_bytes),
            };
        }
    }
}

/// One copy of a load through this GPU's own link: part of chunk `chunk` (the last part: its
/// layers are wholly queued once it is), blob bytes `from..to` to device offset `at`.
#[derive(Clone, Debug)]
struct Piece {
    chunk: usize,
    from: u64,
    to: u64,
    at: u64,
    last: bool,
}

/// The layer whose range holds blob offset `offset` (every weight argument lies in one).
fn layer_at(plan: &Plan, offset: u64) -> usize {
    plan.layers.partition_point(|l| l.offset_bytes <= offset).saturating_sub(1)
}

/// Per launch, the layers its weight arguments lie in (each once).
fn layers_read(plan: &Plan) -> Vec<Vec<u32>> {
    plan.launches
        .iter()
        .map(|l| {
            let mut v: Vec<u32> =
                l.args.iter().filter(|a| a.space == Space::Weights).map(|a| layer_at(plan, a.offset_bytes) as u32).collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect()
}

/// Device offsets of the loaded layers (see the module doc) and the allocation's size.
fn pack(plan: &Plan, host: &[bool]) -> (Vec<Option<u64>>, u64) {
    let mut offsets = Vec::with_capacity(plan.layers.len());
    let mut end = 0u64;
    let mut previous_loaded: Option<usize> = None;
    for (i, l) in plan.layers.iter().enumerate() {
        if host[i] {
            offsets.push(None);
            previous_loaded = None;
            continue;
        }
        let at = match previous_loaded {
            Some(p) => offsets[p].expect("loaded") + (l.offset_bytes - plan.layers[p].offset_bytes),
            None => end.next_multiple_of(DEVICE_LAYER_ALIGN_BYTES),
        };
        offsets.push(Some(at));
        end = at + l.len_bytes;
        previous_loaded = Some(i);
    }
    (offsets, end)
}

/// The byte ranges `[from, to)` is copied in: the fewest pieces of at most `piece_max` bytes,
/// of equal length (within a byte), since a short tail would be a slow copy of its own; none for
/// an empty range.
fn equal_pieces(from: u64, to: u64, piece_max: u64) -> impl Iterator<Item = (u64, u64)> {
    let len = to.saturating_sub(from);
    let n = len.div_ceil(piece_max.max(1));
    (0..n).map(move |k| (from + len * k / n, from + len * (k + 1) / n))
}

/// The order a load issues its chunks in: round robin over the parts (`part`, per layer; a chunk
/// never spans two), in layer order within each, so every GPU's link starts at once instead of
/// waiting behind the host's issue of the parts before its own.
fn interleave_parts(chunks: &[std::ops::Range<u32>], part: &[u32]) -> Vec<usize> {
    let part_of = |c: &std::ops::Range<u32>| part.get(c.start as usize).copied().unwrap_or(0) as usize;
    let parts = chunks.iter().map(part_of).max().map_or(0, |p| p + 1);
    let mut by_part: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); parts];
    for (i, c) in chunks.iter().enumerate() {
        by_part[part_of(c)].push_back(i);
    }
    let mut order = Vec::with_capacity(chunks.len());
    while order.len() < chunks.len() {
        for q in by_part.iter_mut() {
            order.extend(q.pop_front());
        }
    }
    order
}

impl<G: Gpu> Dispatcher<G> {
    /// The residency of a model being loaded under a weight budget: its blob in pinned host memory
    /// and its cold plan (from the profile's layer times when it has them for this plan, else
    /// from the duration estimates, which allows no DHA layer). None without a budget.
    pub(super) fn new_residency(
        &mut self,
        plan: &Plan,
        profile: Option<&kairos_gpu::profile::ModelProfile>,
        estimates: &Estimates,
    ) -> Result<Option<Residency>, Error> {
        if self.cfg.weight_budget_bytes.is_none() {
            return Ok(None);
        }
        let measured = profile.and_then(|p| p.layers.as_ref()).and_then(|l| cold::ColdInput::measured(plan, l).ok());
        let input = match measured {
            Some(i) => i,
            None => {
                let exec: Vec<f64> = (0..plan.launches.len() as u32).map(|i| estimates.get(i)).collect();
                cold::ColdInput::estimated(plan, &exec, self.gpu.info().h2d_bytes_per_s.max(1.0))
            }
        };
        // Parallel transmission copies through the secondaries the GPU has attached (none: the
        // parallel strategies plan as their one-GPU counterparts).
        let input = if self.cfg.cold_strategy.is_parallel() { input.with_peers(&self.gpu.peer_paths()) } else { input };
        let cold = cold::plan(&input, self.cfg.cold_strategy);
        let (device_offset, device_bytes) = pack(plan, &cold.host);
        let chunks = cold::copy_chunks(&plan.layers, &cold.host, &cold.part, self.cfg.cold_chunk_bytes);
        let host = upload_weights(&mut self.gpu, plan, MemKind::HostMapped)?;
        Ok(Some(Residency {
            state: ResidencyState::HostOnly,
            host,
            device: None,
            cold,
            device_offset,
            device_bytes,
            chunks,
            layer_copy: vec![None; plan.layers.len()],
            unqueued: vec![false; plan.layers.len()],
            pieces: Default::default(),
            own_in_flight: Vec::new(),
            refused: false,
            reads: layers_read(plan),
            copies_pending: 0,
            copies_queued: false,
            load_started_ns: 0,
            last_used_ns: self.now_ns,
            arrivals_ns: [0; 2],
        }))
    }

    /// Makes a model resident at once if its loaded layers fit the budget without evicting
    /// anything (at model load, before it serves): a synchronous upload.
    pub(super) fn make_resident_if_room(&mut self, m: &mut Model) -> Result<(), Error> {
        let (Some(budget), Some(r)) = (self.cfg.weight_budget_bytes, m.residency.as_mut()) else { return Ok(()) };
        if self.resident_bytes + r.device_bytes > budget {
            return Ok(());
        }
        let device = self.gpu.alloc(r.device_bytes.max(1), MemKind::Device)?;
        for c in &r.chunks {
            let (first, last) = (&m.plan.layers[c.start as usize], &m.plan.layers[c.end as usize - 1]);
            let (from, to) = (first.offset_bytes as usize, (last.offset_bytes + last.len_bytes) as usize);
            let at = r.device_offset[c.start as usize].expect("chunks hold loaded layers");
            if let Err(e) = self.gpu.write(device.ptr.offset(at), &m.plan.weights.as_slice()[from..to]) {
                let _ = self.gpu.free(device);
                return Err(e.into());
            }
        }
        r.device = Some(device);
        r.state = ResidencyState::Resident;
        self.resident_bytes += r.device_bytes;
        Ok(())
    }

    /// Starts loading a host-only model, evicting least recently used idle models to make room.
    /// False when it cannot start now (no room, nothing left to evict): the model waits among
    /// `load_waiters` and is tried again as requests finish.
    pub(super) fn begin_load(&mut self, model: usize) -> Result<bool, Error> {
        let budget = self.cfg.weight_budget_bytes.unwrap_or(u64::MAX);
        let need = self.models[model].as_ref().and_then(|m| m.residency.as_ref()).map_or(0, |r| r.device_bytes);
        if need > budget {
            let name = &self.models[model].as_ref().expect("model exists").name;
            return Err(Error::InvalidModel(format!(
                "model '{name}' needs {need} bytes of device memory for its loaded layers, more than the whole weight budget of {budget}"
            )));
        }
        // What eviction frees is reused for this load where it is large enough: a device
        // allocation and its release cost the dispatcher's thread hundreds of microseconds each
        // (and a release may wait for the device), and instances of one architecture have the
        // same size.
        let mut freed: Vec<Allocation> = Vec::new();
        let release = |gpu: &mut G, freed: &mut Vec<Allocation>| {
            for a in freed.drain(..) {
                let _ = gpu.free(a);
            }
        };
        while self.resident_bytes + need > budget {
            match self.evict_lru(model) {
                Some(a) => freed.extend(a),
                None => {
                    release(&mut self.gpu, &mut freed);
                    if !self.load_waiters.contains(&model) {
                        self.load_waiters.push(model);
                    }
                    return Ok(false);
                }
            }
        }
        let reuse = freed.iter().enumerate().filter(|(_, a)| a.bytes >= need.max(1)).min_by_key(|(_, a)| a.bytes).map(|(i, _)| i);
        let device = match reuse {
            Some(i) => {
                let a = freed.swap_remove(i);
                release(&mut self.gpu, &mut freed);
                a
            }
            None => {
                release(&mut self.gpu, &mut freed);
                loop {
                    match self.gpu.alloc(need.max(1), MemKind::Device) {
                        Ok(d) => break d,
                        // The device itself is full (arenas, other allocations): evict more if we can.
                        Err(kairos_gpu::GpuError::OutOfMemory { .. }) => match self.evict_lru(model) {
                            Some(a) => release(&mut self.gpu, &mut a.into_iter().collect()),
                            None if self.loads_in_flight() > 0 => {
                                if !self.load_waiters.contains(&model) {
                                    self.load_waiters.push(model);
                                }
                                return Ok(false);
                            }
                            None => {
                                return Err(Error::Gpu(format!(
                                    "no device memory for {need} bytes of weights, and no idle model left to evict"
                                )));
                            }
                        },
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        };
        let now = self.gpu.now_ns();
        let m = self.models[model].as_mut().expect("model exists");
        let r = m.residency.as_mut().expect("loads are of models under a budget");
        r.device = Some(device);
        r.state = ResidencyState::Loading;
        r.copies_queued = false;
        // Nothing is on the copy engine until `queue_copies`: no launch of it may go out before.
        r.unqueued = r.cold.host.iter().map(|&h| !h).chain(std::iter::repeat(true)).take(r.unqueued.len()).collect();
        r.pieces.clear();
        r.own_in_flight.clear();
        r.refused = false;
        r.load_started_ns = now;
        self.resident_bytes += r.device_bytes;
        self.stats.cold_starts += 1;
        self.stats.loaded_bytes += r.device_bytes;
        Ok(true)
    }

    /// Queues the copies of a load that `begin_load` started, once the requests it admits have
    /// written their inputs: a request's input copy queued behind a whole model's weights on the
    /// copy engine waits for all of them (measured on an H200: resnet50's 301 KB image waited
    /// ~1.2 ms, the whole load, so its kernels never overlapped the copies). The parts copied
    /// through secondaries go out at once; this GPU's own go in pieces through the window
    /// (`top_up`). A copy the GPU refuses is written synchronously instead, with the rest of the
    /// load (slow, but a launch never reads a layer that is not there).
    pub(super) fn queue_copies(&mut self, model: usize) -> Result<(), Error> {
        let Some(r) = self.models[model].as_ref().and_then(|m| m.residency.as_ref()) else { return Ok(()) };
        if r.state != ResidencyState::Loading || r.copies_queued {
            return Ok(());
        }
        let window = self.cfg.cold_copy_window_bytes;
        let piece_max = if window == 0 { u64::MAX } else { (window / 2).max(1) };
        let m = self.models[model].as_mut().expect("model exists");
        let r = m.residency.as_mut().expect("checked above");
        r.copies_queued = true;
        // A secondary whose link is busy now (its own loads, other GPUs' copies) would make this
        // load wait behind them: its part goes through this GPU instead, for the whole load.
        // Who copies each layer now: its part's secondary, or this GPU (part 0) for the parts whose
        // secondary is busy, so those go out in layer order with this GPU's own.
        let parts = r.cold.part.iter().copied().max().unwrap_or(0) as usize;
        let through: Vec<bool> = (0..parts).map(|k| !self.gpu.peer_busy(k)).collect();
        if through.iter().any(|&t| !t) {
            self.stats.secondary_busy_loads += 1;
        }
        let copier: Vec<u32> = r.cold.part.iter().map(|&k| if k > 0 && through[k as usize - 1] { k } else { 0 }).collect();
        for c in interleave_parts(&r.chunks, &copier) {
            let m = self.models[model].as_mut().expect("model exists");
            let r = m.residency.as_mut().expect("checked above");
            let range = r.chunks[c].clone();
            let (first, last) = (&m.plan.layers[range.start as usize], &m.plan.layers[range.end as usize - 1]);
            let (from, to) = (first.offset_bytes, last.offset_bytes + last.len_bytes);
            let at = r.device_offset[range.start as usize].expect("chunks hold loaded layers");
            match copier.get(range.start as usize).copied().unwrap_or(0) as usize {
                0 => {
                    for (p, q) in equal_pieces(from, to, piece_max) {
                        r.pieces.push_back(Piece { chunk: c, from: p, to: q, at: at + (p - from), last: q == to });
                    }
                    self.top_up(model, None)?;
                }
                k => {
                    let device = r.device.expect("a loading model has its device allocation");
                    let copied = if r.refused {
                        None
                    } else {
                        match self.gpu.copy_via_peer(device.ptr.offset(at), r.host.ptr.offset(from), to - from, k - 1) {
                            Ok(id) => Some(id),
                            Err(_) => {
                                self.stats.load_copies_refused += 1;
                                None
                            }
                        }
                    };
                    let m = self.models[model].as_mut().expect("model exists");
                    let r = m.residency.as_mut().expect("checked above");
                    match copied {
                        Some(id) => {
                            r.copies_pending += 1;
                            self.copy_owner.insert(id, model);
                            for l in range {
                                r.layer_copy[l as usize] = Some(id);
                                r.unqueued[l as usize] = false;
                            }
                        }
                        None => {
                            r.refused = true;
                            self.write_piece(model, Piece { chunk: c, from, to, at, last: true })?;
                        }
                    }
                }
            }
        }
        let r = self.models[model].as_ref().and_then(|m| m.residency.as_ref()).expect("checked above");
        if r.copies_pending == 0 && r.pieces.is_empty() {
            self.load_done(model);
        }
        Ok(())
    }

    /// Bytes of the loads' own pieces on the copy engine, every load's together (one window for
    /// the engine, whichever loads fill it).
    fn load_bytes_on_engine(&self) -> u64 {
        let loads = self.models.iter().flatten().filter_map(|m| m.residency.as_ref());
        loads.map(|r| r.own_in_flight.iter().map(|&(_, b)| b).sum::<u64>()).sum()
    }

    /// Whether a load that started before `model`'s (ties: the lower index) still has pieces to
    /// queue: the engine takes the loads in the order they started.
    fn older_load_waiting(&self, model: usize) -> bool {
        let key = |i: usize, r: &Residency| (r.load_started_ns, i);
        let Some(mine) = self.models[model].as_ref().and_then(|m| m.residency.as_ref()).map(|r| key(model, r)) else {
            return false;
        };
        self.models.iter().enumerate().any(|(i, m)| {
            m.as_ref()
                .and_then(|m| m.residency.as_ref())
                .is_some_and(|r| r.state == ResidencyState::Loading && !r.pieces.is_empty() && key(i, r) < mine)
        })
    }

    /// Queues the load's own pieces while fewer bytes than the window are on the engine, all
    /// loads' pieces counted, and no load that started earlier has pieces left (pieces are at most
    /// half the window, so two or more are in flight and the engine does not idle while the host
    /// learns of a landing; one at a time cost a cold bert_base 7-12% on an H200), or, with
    /// `through`, until that launch reads no layer left unqueued. Loads thus go through the
    /// engine one after another, each at its full rate, as whole loads queued at once do; with
    /// a window per load, loads started together shared the engine and all finished late. After
    /// a refusal, writes them synchronously.
    fn top_up(&mut self, model: usize, through: Option<usize>) -> Result<(), Error> {
        let window = self.cfg.cold_copy_window_bytes;
        let copy_stream = self.copy_stream.expect("a weight budget creates the copy stream");
        loop {
            let on_engine = self.load_bytes_on_engine();
            let older_first = window > 0 && self.older_load_waiting(model);
            let Some(r) = self.models[model].as_mut().and_then(|m| m.residency.as_mut()) else { return Ok(()) };
            if r.pieces.is_empty() {
                return Ok(());
            }
            let forced = through.is_some_and(|l| r.reads_unqueued(l));
            if !r.refused && !forced && window > 0 && (on_engine >= window || older_first) {
                return Ok(());
            }
            let p = r.pieces.pop_front().expect("looked at");
            if r.refused {
                self.write_piece(model, p)?;
                continue;
            }
            let device = r.device.expect("a loading model has its device allocation");
            let (dst, src, bytes) = (device.ptr.offset(p.at), r.host.ptr.offset(p.from), p.to - p.from);
            match self.gpu.copy_async(dst, src, bytes, copy_stream) {
                Ok(id) => {
                    let r = self.models[model].as_mut().and_then(|m| m.residency.as_mut()).expect("looked at");
                    r.copies_pending += 1;
                    r.own_in_flight.push((id, bytes));
                    self.copy_owner.insert(id, model);
                    for l in r.chunks[p.chunk].clone() {
                        r.layer_copy[l as usize] = Some(id);
                        r.unqueued[l as usize] &= !p.last;
                    }
                    self.stats.load_copy_bytes_in_flight_max = self.stats.load_copy_bytes_in_flight_max.max(on_engine + bytes);
                    self.stats.load_copies_forced += forced as u64;
                }
                Err(_) => {
                    self.stats.load_copies_refused += 1;
                    let r = self.models[model].as_mut().and_then(|m| m.residency.as_mut()).expect("looked at");
                    r.refused = true;
                    self.write_piece(model, p)?;
                }
            }
        }
    }

    /// Writes a piece of a load synchronously (after a refused copy).
    fn write_piece(&mut self, model: usize, p: Piece) -> Result<(), Error> {
        let m = self.models[model].as_mut().expect("model exists");
        let r = m.residency.as_mut().expect("a loading model");
        let device = r.device.expect("a loading model has its device allocation");
        if let Err(e) = self.gpu.write(device.ptr.offset(p.at), &m.plan.weights.as_slice()[p.from as usize..p.to as usize]) {
            return Err(Error::Gpu(format!("loading model '{}': {e}", m.name)));
        }
        if p.last {
            for l in r.chunks[p.chunk].clone() {
                r.unqueued[l as usize] = false;
            }
        }
        Ok(())
    }

    /// Brings forward the copies of the layers `launch` reads (a launch issued before their turn
    /// in the window: a whole job on a stream).
    pub(super) fn queue_through(&mut self, model: usize, launch: usize) -> Result<(), Error> {
        self.top_up(model, Some(launch))
    }

    fn loads_in_flight(&self) -> usize {
        self.models.iter().flatten().filter(|m| m.residency.as_ref().is_some_and(|r| r.state == ResidencyState::Loading)).count()
    }

    /// Evicts the least recently used resident model with no request in the dispatcher (never
    /// `keep`), handing back its device allocation for the caller to reuse or free; None if there
    /// is no such model.
    fn evict_lru(&mut self, keep: usize) -> Option<Option<Allocation>> {
        let victim = self
            .models
            .iter()
            .enumerate()
            .filter(|&(i, m)| i != keep && m.as_ref().is_some_and(|m| m.jobs == 0))
            .filter_map(|(i, m)| m.as_ref().and_then(|m| m.residency.as_ref()).map(|r| (i, r)))
            .filter(|(_, r)| r.state == ResidencyState::Resident)
            .min_by_key(|(i, r)| match self.cfg.eviction {
                Eviction::Lru => (0, r.last_used_ns, *i),
                Eviction::Lru2 => (r.arrivals_ns[1], r.last_used_ns, *i),
            })
            .map(|(i, _)| i);
        let v = victim?;
        let m = self.models[v].as_mut().expect("listed");
        // Runs name the device addresses that go now: drop them (recorded again on demand).
        for s in &mut m.slots_free {
            let partition_runs = s.partition_runs.drain(..).map(|(_, _, r)| r);
            for run in s
                .run
                .take()
                .into_iter()
                .chain(s.segment_runs.drain(..).flatten())
                .chain(s.stop_runs.drain(..).flatten())
                .chain(partition_runs)
            {
                let _ = self.gpu.drop_run(run);
            }
        }
        let r = m.residency.as_mut().expect("listed");
        let device = r.device.take();
        r.state = ResidencyState::HostOnly;
        self.resident_bytes -= r.device_bytes;
        self.stats.evictions += 1;
        Some(device)
    }

    /// A copy of a load landed.
    pub(super) fn copy_done(&mut self, copy: CopyId, out: &mut Vec<Output>) {
        let Some(model) = self.copy_owner.remove(&copy) else {
            self.stats.notification_anomalies += 1;
            return;
        };
        let Some(r) = self.models[model].as_mut().and_then(|m| m.residency.as_mut()) else { return };
        for c in r.layer_copy.iter_mut().filter(|c| **c == Some(copy)) {
            *c = None;
        }
        r.own_in_flight.retain(|&(c, _)| c != copy);
        r.copies_pending = r.copies_pending.saturating_sub(1);
        // The window has room again: the next pieces go out, the oldest load's first (this one's
        // or another's), and jobs waiting for them may be offered again.
        let mut loads: Vec<(u64, usize)> = (self.models.iter().enumerate())
            .filter_map(|(i, m)| m.as_ref().and_then(|m| m.residency.as_ref()).map(|r| (i, r)))
            .filter(|(_, r)| r.state == ResidencyState::Loading && !r.pieces.is_empty())
            .map(|(i, r)| (r.load_started_ns, i))
            .collect();
        loads.sort_unstable();
        let pieces_left =
            |d: &Self, m: usize| d.models[m].as_ref().and_then(|x| x.residency.as_ref()).map_or(0, |r| r.pieces.len());
        for (_, m) in loads {
            let before = pieces_left(self, m);
            if let Err(e) = self.top_up(m, None) {
                self.fail_model_jobs(m, e, out);
            }
            // Only a load that queued pieces (or the one whose copy landed) has jobs whose next
            // launch may now go out.
            if m == model || pieces_left(self, m) != before {
                self.refresh_model_jobs(m);
            }
        }
        let Some(r) = self.models[model].as_mut().and_then(|m| m.residency.as_mut()) else { return };
        if r.copies_pending == 0 && r.pieces.is_empty() && r.state == ResidencyState::Loading {
            self.load_done(model);
            // Load-then-run holds the model's requests until here.
            self.admit_waiting(model, out);
            // An unload or a shutdown that waited for the copies.
            self.maybe_free_model(model, out);
        }
        self.maybe_finish_shutdown(out);
    }

    fn load_done(&mut self, model: usize) {
        let now = self.gpu.now_ns();
        let r = self.models[model].as_mut().and_then(|m| m.residency.as_mut()).expect("a loading model");
        r.state = ResidencyState::Resident;
        self.stats.load_ns += now.saturating_sub(r.load_started_ns);
        self.stats.loads_completed += 1;
    }

    /// Whether the model's requests may be admitted now; starts its load when it is host-only.
    /// A load that cannot start fails the model's waiting requests with the reason.
    pub(super) fn ready_to_admit(&mut self, model: usize, out: &mut Vec<Output>) -> bool {
        let Some(r) = self.models[model].as_ref().and_then(|m| m.residency.as_ref()) else { return true };
        match r.state {
            ResidencyState::Resident => true,
            ResidencyState::Loading => r.cold.strategy != ColdStrategy::LoadThenRun,
            ResidencyState::HostOnly => match self.begin_load(model) {
                // Load-then-run admits nobody before the load ends: its copies go now (the others'
                // after their first requests are admitted, see `admit_waiting`).
                Ok(true) if self.cfg.cold_strategy == ColdStrategy::LoadThenRun => match self.queue_copies(model) {
                    Ok(()) => self.ready_to_admit(model, out),
                    Err(e) => {
                        self.fail_waiting(model, e, out);
                        false
                    }
                },
                Ok(true) => self.ready_to_admit(model, out),
                Ok(false) => false,
                Err(e) => {
                    self.fail_waiting(model, e, out);
                    false
                }
            },
        }
    }

    /// Answers every waiting request of a model with `e`.
    fn fail_waiting(&mut self, model: usize, e: Error, out: &mut Vec<Output>) {
        let m = self.models[model].as_mut().expect("model exists");
        let waiting: Vec<JobKey> = m.waiting.drain(..).collect();
        m.realtime_waiting = 0;
        for key in waiting {
            self.finish(key, Some(e.clone()), out);
        }
    }

    /// After admitting a loading model's requests: queue its copies; if that fails, its admitted
    /// requests fail with the reason (their launches may not run on missing layers).
    pub(super) fn queue_copies_after_admission(&mut self, model: usize, out: &mut Vec<Output>) {
        if let Err(e) = self.queue_copies(model) {
            self.fail_model_jobs(model, e, out);
        }
        self.refresh_model_jobs(model);
    }

    /// Fails a model's admitted and waiting requests with `e` (its load could not go on).
    fn fail_model_jobs(&mut self, model: usize, e: Error, out: &mut Vec<Output>) {
        let keys: Vec<JobKey> =
            self.jobs.iter().flatten().filter(|j| j.model == model && j.slot.is_some()).map(|j| j.key).collect();
        for key in keys {
            self.fail(key, e.clone(), out);
        }
        self.fail_waiting(model, e, out);
    }

    /// Rewrites the views of a model's admitted jobs (what their next launch may read changed).
    fn refresh_model_jobs(&mut self, model: usize) {
        let keys: Vec<JobKey> =
            self.jobs.iter().flatten().filter(|j| j.model == model && j.view.is_some()).map(|j| j.key).collect();
        for key in keys {
            self.refresh(key);
        }
    }

    /// Tries again the loads that waited for memory (after requests finished or models went).
    pub(super) fn retry_loads(&mut self, out: &mut Vec<Output>) {
        if self.load_waiters.is_empty() {
            return;
        }
        let waiters = std::mem::take(&mut self.load_waiters);
        for model in waiters {
            if self.models[model].as_ref().is_some_and(|m| !m.waiting.is_empty()) {
                self.admit_waiting(model, out);
            }
        }
    }

    /// Residency of a model by name, for callers and tests (None: unknown, or no budget).
    pub fn residency_of(&self, name: &str) -> Option<ResidencyState> {
        let &i = self.model_names.get(name)?;
        self.models[i].as_ref()?.residency.as_ref().map(|r| r.state)
    }

    /// The cold plan of a model by name (None: unknown, or no budget).
    pub fn cold_plan_of(&self, name: &str) -> Option<&ColdPlan> {
        let &i = self.model_names.get(name)?;
        self.models[i].as_ref()?.residency.as_ref().map(|r| &r.cold)
    }

    /// Device bytes the resident and loading models' weights take under the budget.
    pub fn resident_weight_bytes(&self) -> u64 {
        self.resident_bytes
    }
}

/// Frees what a model's residency holds.
pub(super) fn free_residency<G: Gpu>(gpu: &mut G, r: Residency) {
    if let Some(d) = r.device {
        let _ = gpu.free(d);
    }
    let _ = gpu.free(r.host);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_keeps_runs_contiguous_and_skips_host_layers() {
        let mut plan = kairos_gpu::synthetic::chain_plan("p", 2, 4);
        plan.layers = vec![
            kairos_core::plan::Layer { name: "a".into(), offset_bytes: 0, len_bytes: 100 },
            kairos_core::plan::Layer { name: "b".into(), offset_bytes: 256, len_bytes: 1000 },
            kairos_core::plan::Layer { name: "c".into(), offset_bytes: 1280, len_bytes: 10 },
            kairos_core::plan::Layer { name: "d".into(), offset_bytes: 1536, len_bytes: 64 },
        ];
        let (o, end) = pack(&plan, &[false, true, false, false]);
        assert_eq!(o, vec![Some(0), None, Some(256), Some(256 + 256)]);
        assert_eq!(end, 256 + 256 + 64);
        let (o, end) = pack(&plan, &[false; 4]);
        assert_eq!(o, vec![Some(0), Some(256), Some(1280), Some(1536)]);
        assert_eq!(end, 1600);
        assert_eq!(layer_at(&plan, 0), 0);
        assert_eq!(layer_at(&plan, 300), 1);
        assert_eq!(layer_at(&plan, 1535), 2);
        assert_eq!(layer_at(&plan, 1599), 3);
    }

    #[test]
    fn chunks_go_out_round_robin_over_parts() {
        assert_eq!(interleave_parts(&[0..1, 1..2, 2..3, 3..4], &[0, 0, 1, 1]), vec![0, 2, 1, 3]);
        assert_eq!(interleave_parts(&[0..2, 2..3, 3..4], &[0, 0, 1, 2]), vec![0, 1, 2]);
        assert_eq!(interleave_parts(&[0..1, 1..2, 2..3], &[]), vec![0, 1, 2]);
        assert_eq!(interleave_parts(&[0..1, 1..2, 2..3], &[0, 1, 1]), vec![0, 1, 2]);
        assert!(interleave_parts(&[], &[0]).is_empty());
    }

    #[test]
    fn a_chunk_is_copied_in_equal_pieces() {
        let pieces = |from, to, max| equal_pieces(from, to, max).collect::<Vec<_>>();
        // A chunk no longer than a piece goes whole.
        assert_eq!(pieces(100, 4196, 4096), vec![(100, 4196)]);
        // One byte over: two halves, not a full piece and a 1-byte tail.
        assert_eq!(pieces(0, 4097, 4096), vec![(0, 2048), (2048, 4097)]);
        assert_eq!(pieces(0, 12288, 4096), vec![(0, 4096), (4096, 8192), (8192, 12288)]);
        assert!(pieces(5, 5, 4096).is_empty());
        for (from, to, max) in [(7u64, 10_000_007u64, 1u64 << 20), (0, 5_000_000, 2 << 20), (3, 4, 1)] {
            let p = pieces(from, to, max);
            assert_eq!((p[0].0, p[p.len() - 1].1), (from, to), "{p:?}");
            assert!(p.windows(2).all(|w| w[0].1 == w[1].0), "contiguous: {p:?}");
            let (short, long) = (p.iter().map(|(a, b)| b - a).min().unwrap(), p.iter().map(|(a, b)| b - a).max().unwrap());
            assert!(long <= max && long - short <= 1, "{p:?}");
            assert_eq!(p.len() as u64, (to - from).div_ceil(max), "{p:?}");
        }
    }
}

//! Secondary GPUs for DeepPlan's parallel transmission (EuroSys'23, section 4.3.3): a
//! [`SecondaryLink`] lets a primary GPU copy weights through another GPU's PCIe link. The secondary
//! copies each piece from pinned host memory into staging memory of its own (a ring of
//! [`PEER_PIECE_BYTES`] slots reserved at attach time) on its *load stream*, and its *migration
//! stream* forwards the piece to the primary (`cuMemcpyPeerAsync`, NVLink where the pair has it)
//! as soon as it has landed, so forwarding overlaps the next piece's host copy (the
//! parallel-pipeline). A slot is refilled only after its last forward ended (a GPU-side wait:
//! the host never blocks). Every object here belongs to the secondary's primary context; the
//! caller makes that context current around each call ([`SecondaryLink::bind`]) and its own again
//! afterwards.
//!
//! Hopper differences from DeepPlan's V100 setting: one NVLink forward (334–375 GB/s measured with
//! copies between two H100s, NV18) is six to seven times a PCIe Gen5 link (52–54 GB/s), so a
//! secondary's forward is never the bottleneck; the host side can be (two H100s' links together
//! took 90.8 GB/s from one host's memory, not 104), and so can compute: a cold bert_base start is
//! 1.5 ms of kernels that no copy speed removes.

use crate::driver::{self, CUcontext};
use crate::safe::{Context, DeviceBuffer, Event, Stream};
use kairos_gpu::{GpuError, PEER_PIECE_BYTES, PeerPath, Result};
use std::sync::atomic::{AtomicU32, Ordering};

fn drv(e: driver::DriverError) -> GpuError {
    GpuError::Driver(e.to_string())
}

/// GPUs the process-wide link registry tracks (ordinals at or above it are never busy).
pub const LINKS_MAX: usize = 64;

/// Per GPU ordinal, the weight copies in flight over that GPU's PCIe link in this process: its own
/// `copy_async` loads and other GPUs' copies through it as a secondary. Engines of different GPUs
/// run on different threads; this is what they share to leave a busy secondary alone.
static LINK_COPIES: [AtomicU32; LINKS_MAX] = [const { AtomicU32::new(0) }; LINKS_MAX];

/// One more copy in flight over GPU `ordinal`'s link.
pub(crate) fn link_add(ordinal: u32) {
    if let Some(c) = LINK_COPIES.get(ordinal as usize) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// One copy over GPU `ordinal`'s link completed (or was forgotten with its context).
pub(crate) fn link_done(ordinal: u32) {
    if let Some(c) = LINK_COPIES.get(ordinal as usize) {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

/// Whether copies are in flight over GPU `ordinal`'s link.
pub fn link_busy(ordinal: u32) -> bool {
    LINK_COPIES.get(ordinal as usize).is_some_and(|c| c.load(Ordering::Relaxed) > 0)
}

/// Default staging memory reserved on a secondary for one primary: 16 pieces in flight
/// (`kairos serve --peer-staging-mib`'s default).
pub const PEER_STAGING_BYTES_DEFAULT: u64 = 16 * PEER_PIECE_BYTES;

/// One slot of the staging ring.
struct Slot {
    offset_bytes: u64,
    /// Recorded on the load stream after the host copy into the slot.
    landed: Event,
    /// Recorded on the migration stream after the slot's forward.
    forwarded: Event,
    /// Whether `forwarded` has been recorded (the next fill must wait for it).
    used: bool,
}

/// A secondary GPU attached to a primary (field order: every object of the secondary's context
/// drops before the context reference).
pub struct SecondaryLink {
    pub(crate) path: PeerPath,
    pub(crate) ordinal: u32,
    slots: Vec<Slot>,
    next_slot: usize,
    /// Copies in flight through this secondary, in queue order, with their completion events.
    pub(crate) copies: std::collections::VecDeque<(kairos_gpu::CopyId, Event)>,
    /// Completion events of finished copies, for reuse (events of this context only).
    spare_events: Vec<Event>,
    load: Stream,
    migrate: Stream,
    staging: DeviceBuffer,
    ctx: Context,
}

impl SecondaryLink {
    /// Attaches GPU `ordinal` as a secondary of the primary whose context is `primary` (current on
    /// this thread): checks peer access both ways, enables it, reserves `staging_bytes` (rounded
    /// down to whole pieces, at least one) on the secondary and creates its two streams. Leaves
    /// the secondary's context current: the caller binds its own again. The path's rates are 0
    /// until [`SecondaryLink::set_rates`].
    pub(crate) fn open(primary: &Context, primary_ordinal: u32, ordinal: u32, staging_bytes: u64) -> Result<SecondaryLink> {
        if ordinal == primary_ordinal {
            return Err(GpuError::Invalid(format!("GPU {ordinal} cannot be its own secondary")));
        }
        let count = driver::device_count().map_err(drv)?;
        if ordinal as i32 >= count {
            return Err(GpuError::Invalid(format!("secondary GPU {ordinal} asked for, {count} present")));
        }
        let dev = driver::device_get(ordinal as i32).map_err(drv)?;
        let primary_dev = primary.device();
        let both = driver::device_can_access_peer(primary_dev, dev).map_err(drv)?
            && driver::device_can_access_peer(dev, primary_dev).map_err(drv)?;
        if !both {
            return Err(GpuError::Unsupported(format!(
                "GPUs {primary_ordinal} and {ordinal} cannot access each other's memory (no peer-to-peer path); \
                 parallel transmission needs one"
            )));
        }
        let pieces = (staging_bytes / PEER_PIECE_BYTES).max(1);
        // Context::new makes the secondary's context current.
        let ctx = Context::new(dev).map_err(drv)?;
        // SAFETY: the secondary's context is current; `primary` is live (the caller's).
        unsafe { driver::ctx_enable_peer_access(primary.raw()) }.map_err(drv)?;
        let staging = DeviceBuffer::new(pieces * PEER_PIECE_BYTES).map_err(|e| match e.code {
            driver::CUresult::CUDA_ERROR_OUT_OF_MEMORY => GpuError::OutOfMemory {
                requested_bytes: pieces * PEER_PIECE_BYTES,
                free_bytes: driver::mem_get_info().map(|(f, _)| f).unwrap_or(0),
            },
            _ => drv(e),
        })?;
        let load = Stream::new(0).map_err(drv)?;
        let migrate = Stream::new(0).map_err(drv)?;
        let slots = (0..pieces)
            .map(|i| {
                Ok(Slot {
                    offset_bytes: i * PEER_PIECE_BYTES,
                    landed: Event::new(false).map_err(drv)?,
                    forwarded: Event::new(false).map_err(drv)?,
                    used: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        primary.bind().map_err(drv)?;
        // SAFETY: the primary's context is current now; the secondary's is live (held by `ctx`).
        unsafe { driver::ctx_enable_peer_access(ctx.raw()) }.map_err(drv)?;
        ctx.bind().map_err(drv)?;
        let path =
            PeerPath { gpu: ordinal, h2d_bytes_per_s: 0.0, forward_bytes_per_s: 0.0, staging_bytes: pieces * PEER_PIECE_BYTES };
        Ok(SecondaryLink {
            path,
            ordinal,
            slots,
            next_slot: 0,
            copies: Default::default(),
            spare_events: Vec::new(),
            load,
            migrate,
            staging,
            ctx,
        })
    }

    /// Makes the secondary's context current on this thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind().map_err(drv)
    }

    pub(crate) fn set_rates(&mut self, h2d_bytes_per_s: f64, forward_bytes_per_s: f64) {
        self.path.h2d_bytes_per_s = h2d_bytes_per_s;
        self.path.forward_bytes_per_s = forward_bytes_per_s;
    }

    /// Queues the copy of `bytes` from `src` (pinned host memory, portable and mapped: its
    /// address is valid in every context) to `dst` in the primary's context `primary` through
    /// the staging ring, piece by piece, and returns an event (of this context) recorded after
    /// the last forward. The secondary's context must be current.
    ///
    /// # Safety
    /// 1. `[src, src + bytes)` is pinned, portable host memory and `[dst, dst + bytes)` lies in one
    ///    live device allocation of `primary`; both stay alive until the returned event completes.
    /// 2. `primary` is the live context this link was opened for.
    pub(crate) unsafe fn copy(&mut self, dst: u64, src: u64, bytes: u64, primary: CUcontext) -> Result<Event> {
        let mut done_bytes = 0;
        while done_bytes < bytes {
            let len = (bytes - done_bytes).min(PEER_PIECE_BYTES);
            let n = self.slots.len();
            let slot = &mut self.slots[self.next_slot];
            self.next_slot = (self.next_slot + 1) % n;
            if slot.used {
                self.load.wait(&slot.forwarded).map_err(drv)?;
            }
            let staged = self.staging.ptr() + slot.offset_bytes;
            // SAFETY: the slot lies inside the staging buffer (pieces are at most a slot long); the
            // source range is the caller's (contract 1); the slot's previous forward is waited for above.
            unsafe { self.load.copy(staged, src + done_bytes, len) }.map_err(drv)?;
            slot.landed.record(&self.load).map_err(drv)?;
            self.migrate.wait(&slot.landed).map_err(drv)?;
            // SAFETY: destination inside the caller's allocation (contract 1) in `primary` (contract 2);
            // the staging slot stays untouched until `forwarded` (recorded next) completes.
            unsafe { driver::memcpy_peer_async(dst + done_bytes, primary, staged, self.ctx.raw(), len, self.migrate.raw()) }
                .map_err(drv)?;
            slot.forwarded.record(&self.migrate).map_err(drv)?;
            slot.used = true;
            done_bytes += len;
        }
        let done = match self.spare_events.pop() {
            Some(e) => e,
            None => Event::new(false).map_err(drv)?,
        };
        done.record(&self.migrate).map_err(drv)?;
        Ok(done)
    }

    /// Takes back a completed copy's event for reuse.
    pub(crate) fn recycle(&mut self, event: Event) {
        self.spare_events.push(event);
    }

    /// Measures (host to staging, staging to `dst`) in bytes per second with `bytes` from
    /// `host` (pinned, portable), best of three each. The secondary's context must be current.
    ///
    /// # Safety
    /// 1. `[host, host + bytes)` is pinned portable host memory and `[dst, dst + bytes)` a live
    ///    device allocation of `primary`; `bytes` is at most the staging size.
    pub(crate) unsafe fn measure(&self, host: u64, dst: u64, bytes: u64, primary: CUcontext) -> Result<(f64, f64)> {
        let (start, end) = (Event::new(true).map_err(drv)?, Event::new(true).map_err(drv)?);
        let time = |f: &dyn Fn() -> driver::DResult<()>| -> Result<f64> {
            let mut best = 0f64;
            for _ in 0..3 {
                start.record(&self.load).map_err(drv)?;
                f().map_err(drv)?;
                end.record(&self.load).map_err(drv)?;
                end.synchronize().map_err(drv)?;
                let ms = end.elapsed_ms_since(&start).map_err(drv)? as f64;
                best = best.max(bytes as f64 / (ms.max(1e-6) * 1e-3));
            }
            Ok(best)
        };
        let staged = self.staging.ptr();
        // SAFETY: contract 1; both copies go on the load stream and are waited for inside `time`.
        let h2d = time(&|| unsafe { self.load.copy(staged, host, bytes) })?;
        // SAFETY: as above.
        let fwd = time(&|| unsafe { driver::memcpy_peer_async(dst, primary, staged, self.ctx.raw(), bytes, self.load.raw()) })?;
        Ok((h2d, fwd))
    }
}

impl Drop for SecondaryLink {
    /// Makes the secondary's context current so that its objects (fields, in order) are released
    /// in it; the owner binds its own context again afterwards.
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // Let forwards in flight end before their staging memory goes.
        let _ = self.migrate.synchronize();
    }
}

//! The host side of the kernel protocol (`crates/kernels/cuda/protocol.cuh`): launch slots with
//! their preempt flags and device counters, and the notification ring the host polls.
//!
//! Guarantees: a record is consumed exactly once and in the order its producer reserved it; the
//! device never overwrites an unconsumed record (a full ring stalls producers up to
//! [`RING_TIMEOUT_NS`], after which the record is dropped and [`Protocol::poll`] fails with
//! `ring overflow`); a slot is reused only after its launch's `Done` record was consumed, which
//! the device writes after restoring the slot's counters to zero.

use crate::driver::DResult;
use crate::safe::{DeviceBuffer, MappedBuffer};
use kairos_gpu::SmMask;
use kairos_kernels::source::{self, ProtoParams};
use std::sync::atomic::{Ordering, fence};

/// Records the ring holds (a power of two). At 32 bytes each, 2 MiB of pinned memory.
pub const RING_CAPACITY: u32 = 1 << 16;
/// Launches in flight at once (one slot each).
pub const LAUNCH_SLOTS_MAX: u32 = 1024;
/// How long a producer waits for room in a full ring before it drops a record.
pub const RING_TIMEOUT_NS: u64 = 50_000_000;
/// How often, at most, a launch's CTAs read the host's preempt flag (one PCIe read per launch per
/// interval: such reads serialize across the device, so not every CTA may poll).
pub const PREEMPT_POLL_NS: u32 = 4_000;

const _: () = assert!(RING_CAPACITY.is_power_of_two());

/// One notification as the device wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub kind: u32,
    pub sm: u32,
    pub slot: u32,
    pub ctas: u32,
    /// Finished: blocks run by the group; Done: the first block never taken.
    pub blocks: u32,
    /// Done: 1 when stopped by the preempt flag.
    pub aux: u32,
    /// The device's %globaltimer when written.
    pub device_ns: u64,
}

/// Why polling failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingError {
    /// A producer found the ring full for longer than [`RING_TIMEOUT_NS`] and dropped a record.
    Overflow,
}

pub struct Protocol {
    records: MappedBuffer,
    ring_host: MappedBuffer,
    flags: MappedBuffer,
    ring_dev: DeviceBuffer,
    slots: DeviceBuffer,
    consumed: u64,
    free_slots: Vec<u32>,
}

impl Protocol {
    pub fn new() -> DResult<Protocol> {
        let records = MappedBuffer::new(RING_CAPACITY as u64 * source::RECORD_BYTES as u64)?;
        let ring_host = MappedBuffer::new(source::RING_HOST_BYTES as u64)?;
        let flags = MappedBuffer::new(LAUNCH_SLOTS_MAX as u64 * 4)?;
        let ring_dev = DeviceBuffer::new(source::RING_DEV_BYTES as u64)?;
        let mut init = [0u8; 16];
        init[8..].copy_from_slice(&(RING_CAPACITY as u64).to_le_bytes());
        ring_dev.write(0, &init)?;
        let slots = DeviceBuffer::new(LAUNCH_SLOTS_MAX as u64 * source::SLOT_BYTES as u64)?;
        slots.fill(0)?;
        Ok(Protocol {
            records,
            ring_host,
            flags,
            ring_dev,
            slots,
            consumed: 0,
            free_slots: (0..LAUNCH_SLOTS_MAX).rev().collect(),
        })
    }

    /// Takes a free slot and clears its preempt flag, or None when all are in flight.
    pub fn alloc_slot(&mut self) -> Option<u32> {
        let s = self.free_slots.pop()?;
        self.flags.store_u32(s as u64 * 4, 0);
        fence(Ordering::SeqCst);
        Some(s)
    }

    /// Returns a slot whose `Done` record has been consumed (or whose launch never started).
    pub fn free_slot(&mut self, slot: u32) {
        debug_assert!(!self.free_slots.contains(&slot), "slot {slot} freed twice");
        self.free_slots.push(slot);
    }

    pub fn slots_in_flight(&self) -> u32 {
        LAUNCH_SLOTS_MAX - self.free_slots.len() as u32
    }

    /// Raises a slot's preempt flag: one store to pinned memory the device reads.
    pub fn set_preempt(&self, slot: u32) {
        self.flags.store_u32(slot as u64 * 4, 1);
        fence(Ordering::SeqCst);
    }

    /// The protocol parameters of a launch in `slot`.
    pub fn params(
        &self,
        slot: u32,
        first_block: u32,
        total_blocks: u32,
        mask: &SmMask,
        flags: u32,
        sm_bitmap: u64,
    ) -> ProtoParams {
        ProtoParams {
            slot_state: self.slots.ptr() + slot as u64 * source::SLOT_BYTES as u64,
            preempt_flag: self.flags.dev_ptr() + slot as u64 * 4,
            ring_records: self.records.dev_ptr(),
            ring_host: self.ring_host.dev_ptr(),
            ring_dev: self.ring_dev.ptr(),
            sm_mask: mask.0,
            sm_bitmap,
            ring_timeout_ns: RING_TIMEOUT_NS,
            slot,
            first_block,
            total_blocks,
            ring_capacity: RING_CAPACITY,
            flags: source::FLAG_NOTIFY | flags,
            poll_ns: PREEMPT_POLL_NS,
        }
    }

    fn record_offset(&self, index: u64) -> u64 {
        (index & (RING_CAPACITY as u64 - 1)) * source::RECORD_BYTES as u64
    }

    /// The record at `index` when all four of its words have arrived.
    fn read_record(&self, index: u64) -> Option<Record> {
        let off = self.record_offset(index);
        let seq = (index + 1) as u32;
        let mut w = [0u32; 4];
        for (i, x) in w.iter_mut().enumerate() {
            // Each 8-byte word arrives whole; a word from an older lap has another sequence number.
            let v = self.records.load_u64(off + 8 * i as u64);
            if (v >> 32) as u32 != seq {
                return None;
            }
            *x = v as u32;
        }
        let (kind, aux, slot, sm, ctas) = source::unpack_record_word0(w[0]);
        Some(Record { kind, sm, slot, ctas, blocks: w[1], aux, device_ns: w[2] as u64 | (w[3] as u64) << 32 })
    }

    /// Whether the next record has arrived (a cheap check for spinning).
    pub fn has_record(&self) -> bool {
        self.read_record(self.consumed).is_some()
    }

    /// Appends every record that has arrived, in order, and tells the device how far it got.
    pub fn poll(&mut self, out: &mut Vec<Record>) -> Result<usize, RingError> {
        let start = self.consumed;
        while let Some(r) = self.read_record(self.consumed) {
            out.push(r);
            self.consumed += 1;
        }
        let n = (self.consumed - start) as usize;
        if n > 0 {
            fence(Ordering::Release);
            self.ring_host.store_u64(0, self.consumed);
        }
        if self.ring_host.load_u32(8) != 0 {
            return Err(RingError::Overflow);
        }
        Ok(n)
    }
}

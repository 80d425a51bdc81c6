//! The host side of the kernel protocol (`crates/kernels/cuda/protocol.cuh`): launch slots with
//! their preempt flags and device counters, and the notification ring the host polls.
//!
//! Guarantees: a record is consumed exactly once and in the order its producer reserved it; the
//! device never overwrites an unconsumed record (a full ring stalls producers up to
//! [`RING_TIMEOUT_NS`], after which the record is dropped and [`Protocol::poll`] fails with
//! `ring overflow`); a slot is reused only after its launch's `Done` record was consumed, which
//! the device writes after restoring the slot's counters to zero. After an overflow, once the
//! device is idle, [`Protocol::recover`] hands over every record that did arrive, skips the
//! dropped ones and makes the ring usable again; the launches whose end it never saw are the
//! caller's to report lost.

use crate::driver::DResult;
use crate::safe::{DeviceBuffer, MappedBuffer};
use kairos_gpu::SmMask;
use kairos_kernels::source::{self, ProtoParams};
use std::sync::atomic::{Ordering, fence};

/// Records the ring holds by default (a power of two). At 32 bytes each, 2 MiB of pinned memory.
pub const RING_CAPACITY: u32 = 1 << 16;
/// The smallest ring [`Protocol::new`] takes (fault-injection tests use small rings to overflow
/// them on purpose).
pub const RING_CAPACITY_MIN: u32 = 64;
/// Launches in flight at once (one slot each).
pub const LAUNCH_SLOTS_MAX: u32 = 1024;
/// How long a producer waits for room in a full ring before it drops a record.
pub const RING_TIMEOUT_NS: u64 = 50_000_000;
/// Stream gate words (one per live stream; see protocol.cuh, "Stream gate").
pub const GATE_WORDS_MAX: u32 = 2048;
/// How often, at most, a launch's CTAs read the host's preempt flag when it lives in mapped host
/// memory ([`StopFlag::Host`]; one PCIe read per launch per interval: such reads serialize across
/// the device, so not every CTA may poll). The device-memory flag is read at every take.
pub const PREEMPT_POLL_NS: u32 = 4_000;

/// Where launches' preempt flags live (protocol.cuh, point 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopFlag {
    /// A word per slot in device memory, written with a stream memory operation (the launch's
    /// `seq`), read at every take.
    Device,
    /// A word per slot in mapped pinned host memory, set with one store, polled every
    /// [`PREEMPT_POLL_NS`].
    Host,
}

/// What raising a preempt flag takes from the caller: nothing more (the host word was stored), or
/// a stream write of `value` at the device address `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Raise {
    Stored,
    WriteDevice { addr: u64, value: u32 },
}

const _: () = assert!(RING_CAPACITY.is_power_of_two() && RING_CAPACITY >= RING_CAPACITY_MIN);

/// Whether a ring of `capacity` records can be made: a power of two from [`RING_CAPACITY_MIN`] to
/// 2^24 (512 MiB of pinned memory).
pub fn check_capacity(capacity: u32) -> Result<(), kairos_gpu::GpuError> {
    if capacity.is_power_of_two() && (RING_CAPACITY_MIN..=1 << 24).contains(&capacity) {
        Ok(())
    } else {
        Err(kairos_gpu::GpuError::Invalid(format!(
            "a notification ring holds a power of two of records, {RING_CAPACITY_MIN}..=16777216, not {capacity}"
        )))
    }
}

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
    gate_words: DeviceBuffer,
    free_gate_words: Vec<u32>,
    /// Launch sequence numbers: the last one handed out (never 0).
    seq: u32,
    /// Where the preempt flags live; with [`StopFlag::Device`], `stop_words` holds them.
    stop_flag: StopFlag,
    stop_words: DeviceBuffer,
    /// The `seq` of the launch each slot carries (what its device flag must hold) and where that
    /// launch reads its flag (a switch of `stop_flag` leaves launches in flight as they were).
    slot_seq: Vec<(u32, StopFlag)>,
    /// Records the ring holds: a power of two, at least [`RING_CAPACITY_MIN`].
    capacity: u32,
}

/// Where a launch sits in its stream's order: its gate word and the sequence numbers the device
/// compares (see protocol.cuh, "Stream gate").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gate {
    pub word: u32,
    pub seq: u32,
    pub gate_seq: u32,
}

impl Protocol {
    /// A protocol whose ring holds `capacity` records; the caller checks the capacity
    /// ([`check_capacity`]).
    pub fn new(capacity: u32, stop_flag: StopFlag) -> DResult<Protocol> {
        debug_assert!(check_capacity(capacity).is_ok());
        let records = MappedBuffer::new(capacity as u64 * source::RECORD_BYTES as u64)?;
        let ring_host = MappedBuffer::new(source::RING_HOST_BYTES as u64)?;
        let flags = MappedBuffer::new(LAUNCH_SLOTS_MAX as u64 * 4)?;
        let ring_dev = DeviceBuffer::new(source::RING_DEV_BYTES as u64)?;
        let mut init = [0u8; 16];
        init[8..].copy_from_slice(&(capacity as u64).to_le_bytes());
        ring_dev.write(0, &init)?;
        let slots = DeviceBuffer::new(LAUNCH_SLOTS_MAX as u64 * source::SLOT_BYTES as u64)?;
        slots.fill(0)?;
        let gate_words = DeviceBuffer::new(GATE_WORDS_MAX as u64 * 4)?;
        gate_words.fill(0)?;
        // Zero is never a launch's seq: no flag starts raised.
        let stop_words = DeviceBuffer::new(LAUNCH_SLOTS_MAX as u64 * 4)?;
        stop_words.fill(0)?;
        Ok(Protocol {
            stop_flag,
            stop_words,
            slot_seq: vec![(0, stop_flag); LAUNCH_SLOTS_MAX as usize],
            records,
            ring_host,
            flags,
            ring_dev,
            slots,
            consumed: 0,
            free_slots: (0..LAUNCH_SLOTS_MAX).rev().collect(),
            gate_words,
            free_gate_words: (0..GATE_WORDS_MAX).rev().collect(),
            capacity,
            seq: 0,
        })
    }

    /// A gate word for a new stream, or None when every word belongs to a stream.
    pub fn alloc_gate_word(&mut self) -> Option<u32> {
        self.free_gate_words.pop()
    }

    /// Returns a gate word no launch will write any more. A stale value in it is harmless: it is
    /// the `seq` of a launch that no later launch names as its `gate_seq`.
    pub fn free_gate_word(&mut self, word: u32) {
        debug_assert!(!self.free_gate_words.contains(&word), "gate word {word} freed twice");
        self.free_gate_words.push(word);
    }

    /// The next launch sequence number (wraps around, skipping 0).
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
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

    /// Raises the preempt flag of the launch last given `slot`'s parameters: one store to the
    /// pinned word the device polls ([`StopFlag::Host`]), or the stream write the caller must queue
    /// ([`StopFlag::Device`]: the launch's `seq` into the slot's device word; a write that lands
    /// after the launch ended is ignored by the slot's later launches, whose `seq` differs).
    pub fn set_preempt(&self, slot: u32) -> Raise {
        let (seq, flag) = self.slot_seq[slot as usize];
        match flag {
            StopFlag::Host => {
                self.flags.store_u32(slot as u64 * 4, 1);
                fence(Ordering::SeqCst);
                Raise::Stored
            }
            StopFlag::Device => Raise::WriteDevice { addr: self.stop_words.ptr() + slot as u64 * 4, value: seq },
        }
    }

    /// Notes which launch (its `seq`) `slot` now carries, and that it reads the flag where
    /// [`Protocol::params`] will point it now: what raising it takes.
    pub fn bind_slot(&mut self, slot: u32, seq: u32) {
        self.slot_seq[slot as usize] = (seq, self.stop_flag);
    }

    pub fn stop_flag(&self) -> StopFlag {
        self.stop_flag
    }

    /// Where the flags of launches given parameters from now on live (launches in flight keep
    /// theirs: `set_preempt` raises a slot's flag where its launch reads it).
    pub fn set_stop_flag(&mut self, stop_flag: StopFlag) {
        self.stop_flag = stop_flag;
    }

    /// The protocol parameters of a launch in `slot`.
    #[allow(clippy::too_many_arguments)]
    pub fn params(
        &self,
        slot: u32,
        first_block: u32,
        total_blocks: u32,
        mask: &SmMask,
        flags: u32,
        sm_bitmap: u64,
        gate: Gate,
    ) -> ProtoParams {
        let (preempt_flag, flags) = match self.stop_flag {
            StopFlag::Host => (self.flags.dev_ptr() + slot as u64 * 4, flags),
            StopFlag::Device => (self.stop_words.ptr() + slot as u64 * 4, flags | source::FLAG_DEVICE_STOP),
        };
        ProtoParams {
            slot_state: self.slots.ptr() + slot as u64 * source::SLOT_BYTES as u64,
            preempt_flag,
            ring_records: self.records.dev_ptr(),
            ring_host: self.ring_host.dev_ptr(),
            ring_dev: self.ring_dev.ptr(),
            sm_mask: mask.0,
            sm_bitmap,
            ring_timeout_ns: RING_TIMEOUT_NS,
            slot,
            first_block,
            total_blocks,
            ring_capacity: self.capacity,
            flags: source::FLAG_NOTIFY | flags,
            poll_ns: PREEMPT_POLL_NS,
            gate_word: self.gate_words.ptr() + gate.word as u64 * 4,
            seq: gate.seq,
            gate_seq: gate.gate_seq,
        }
    }

    fn record_offset(&self, index: u64) -> u64 {
        (index & (self.capacity as u64 - 1)) * source::RECORD_BYTES as u64
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

    /// After an overflow, with nothing running on the device (every producer has written or
    /// dropped its record): appends the records that arrived, in order, skipping the dropped
    /// ones, then moves the ring past everything reserved and clears the overflow word. Returns
    /// how many records were dropped.
    pub fn recover(&mut self, out: &mut Vec<Record>) -> DResult<u64> {
        let mut dev = [0u8; 16];
        self.ring_dev.read(0, &mut dev)?;
        let reserved = u64::from_le_bytes(dev[..8].try_into().expect("8 bytes"));
        let mut dropped = 0;
        for index in self.consumed..reserved.max(self.consumed) {
            match self.read_record(index) {
                Some(r) => out.push(r),
                None => dropped += 1,
            }
        }
        self.consumed = reserved.max(self.consumed);
        fence(Ordering::Release);
        self.ring_host.store_u64(0, self.consumed);
        self.ring_host.store_u32(8, 0);
        let limit = self.consumed + self.capacity as u64;
        self.ring_dev.write(8, &limit.to_le_bytes())?;
        Ok(dropped)
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

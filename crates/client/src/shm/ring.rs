//! A lock-free single-producer single-consumer ring, and the sleep/wake handshake around it.
//!
//! **Guarantee.** With one producer and one consumer that follow the protocol, every pushed item
//! is popped exactly once, in push order, and no slot is read while it is written (the loom tests
//! in `tests/loom_ring.rs` check this over all interleavings of small cases). With a peer that
//! does *not* follow it (a client process scribbling over the indices), each side still only
//! touches slots inside the ring and keeps its own index privately: it reports
//! [`RingError::Corrupt`] instead of trusting an impossible index.
//!
//! **Behaviour.** Indices are free-running u32 counters (wrapping), the slot of index `i` is
//! `i & (capacity - 1)`. The producer writes the slot, then publishes `tail` with a release store;
//! the consumer reads `tail` with an acquire load, copies the slot out, then releases it by
//! storing `head`. Each side caches nothing of the other's index (one acquire load per call).
//!
//! The ring is generic over where its indices and slots live ([`RingMemory`]): the shared-memory
//! region in production, loom's model in the tests. The same code runs in both.
//!
//! **Sleeping.** A side that finds nothing to do may sleep on an eventfd; the other side wakes it
//! only when it announced that it sleeps (a flag word in the region), so a busy pair makes no
//! system calls. The handshake is the classic store-fence-load pair on both sides:
//! the sleeper stores the flag, fences, and checks the ring again before sleeping
//! ([`prepare_sleep`]); the publisher stores the ring index, fences, and swaps the flag
//! ([`should_wake`]). Either the sleeper sees the new item or the publisher sees the flag (or both:
//! a spurious wake-up, which sleepers tolerate).

use std::sync::atomic::Ordering;

/// The atomic operations the ring needs on a u32 word (std's `AtomicU32` in shared memory, loom's
/// in the model checker).
pub trait Atomic32 {
    fn load(&self, order: Ordering) -> u32;
    fn store(&self, value: u32, order: Ordering);
    fn swap(&self, value: u32, order: Ordering) -> u32;
    /// A fence of the same memory model as the word (`std::sync::atomic::fence` or loom's).
    fn fence(order: Ordering);
}

impl Atomic32 for std::sync::atomic::AtomicU32 {
    fn load(&self, order: Ordering) -> u32 {
        std::sync::atomic::AtomicU32::load(self, order)
    }
    fn store(&self, value: u32, order: Ordering) {
        std::sync::atomic::AtomicU32::store(self, value, order)
    }
    fn swap(&self, value: u32, order: Ordering) -> u32 {
        std::sync::atomic::AtomicU32::swap(self, value, order)
    }
    fn fence(order: Ordering) {
        std::sync::atomic::fence(order)
    }
}

/// Where a ring's two indices and its slots live.
pub trait RingMemory<T: Copy> {
    type Word: Atomic32;
    /// A power of two.
    fn capacity(&self) -> u32;
    /// Written by the consumer only.
    fn head(&self) -> &Self::Word;
    /// Written by the producer only.
    fn tail(&self) -> &Self::Word;
    /// Writes slot `index` (< capacity).
    ///
    /// # Safety
    /// 1. `index < self.capacity()`.
    /// 2. The caller is the ring's one producer and the slot is free (the consumer released it).
    unsafe fn write_slot(&self, index: u32, value: T);
    /// Copies slot `index` (< capacity) out.
    ///
    /// # Safety
    /// 1. `index < self.capacity()`.
    /// 2. The caller is the ring's one consumer and the slot was published to it.
    unsafe fn read_slot(&self, index: u32) -> T;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingError {
    /// The producer finds every slot taken.
    Full,
    /// The indices describe an impossible state (the peer broke the protocol).
    Corrupt { head: u32, tail: u32 },
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::Full => f.write_str("the ring is full"),
            RingError::Corrupt { head, tail } => write!(f, "the ring's indices are impossible (head {head}, tail {tail})"),
        }
    }
}

/// The producing side's private state: its own index.
#[derive(Debug, Default)]
pub struct Producer {
    tail: u32,
}

impl Producer {
    pub fn new() -> Producer {
        Producer { tail: 0 }
    }

    /// Items pushed and not yet released by the consumer (as of one acquire load), or `Corrupt`.
    pub fn used<T: Copy, M: RingMemory<T>>(&self, m: &M) -> Result<u32, RingError> {
        let head = m.head().load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        if used > m.capacity() {
            return Err(RingError::Corrupt { head, tail: self.tail });
        }
        Ok(used)
    }

    pub fn push<T: Copy, M: RingMemory<T>>(&mut self, m: &M, value: T) -> Result<(), RingError> {
        let cap = m.capacity();
        debug_assert!(cap.is_power_of_two());
        if self.used(m)? == cap {
            return Err(RingError::Full);
        }
        // SAFETY: the index is masked into the ring (1); `used < cap` means the consumer released
        // this slot with its release store of `head`, which our acquire load saw (2).
        unsafe { m.write_slot(self.tail & (cap - 1), value) };
        self.tail = self.tail.wrapping_add(1);
        m.tail().store(self.tail, Ordering::Release);
        Ok(())
    }
}

/// The consuming side's private state: its own index.
#[derive(Debug, Default)]
pub struct Consumer {
    head: u32,
}

impl Consumer {
    pub fn new() -> Consumer {
        Consumer { head: 0 }
    }

    /// Items published and not yet popped (as of one acquire load), or `Corrupt`.
    pub fn available<T: Copy, M: RingMemory<T>>(&self, m: &M) -> Result<u32, RingError> {
        let tail = m.tail().load(Ordering::Acquire);
        let n = tail.wrapping_sub(self.head);
        if n > m.capacity() {
            return Err(RingError::Corrupt { head: self.head, tail });
        }
        Ok(n)
    }

    pub fn pop<T: Copy, M: RingMemory<T>>(&mut self, m: &M) -> Result<Option<T>, RingError> {
        if self.available(m)? == 0 {
            return Ok(None);
        }
        let cap = m.capacity();
        // SAFETY: masked index (1); the producer published this slot with its release store of
        // `tail`, which our acquire load in `available` saw, and we have not released it (2).
        let value = unsafe { m.read_slot(self.head & (cap - 1)) };
        self.head = self.head.wrapping_add(1);
        m.head().store(self.head, Ordering::Release);
        Ok(Some(value))
    }
}

/// The sleeper's half of the handshake: announce the sleep. The caller must then check its ring
/// again, sleep only if it is still empty, and call [`end_sleep`] when it wakes (or decides not to
/// sleep).
pub fn prepare_sleep<W: Atomic32>(flag: &W) {
    flag.swap(1, Ordering::SeqCst);
    W::fence(Ordering::SeqCst);
}

pub fn end_sleep<W: Atomic32>(flag: &W) {
    flag.swap(0, Ordering::SeqCst);
}

/// The publisher's half: after publishing an item, whether the peer sleeps and must be woken
/// (at most one publisher gets `true` per announced sleep).
pub fn should_wake<W: Atomic32>(flag: &W) -> bool {
    W::fence(Ordering::SeqCst);
    // A plain load first keeps the common case (peer awake) free of a locked instruction.
    flag.load(Ordering::Relaxed) == 1 && flag.swap(0, Ordering::SeqCst) == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::UnsafeCell;
    use std::sync::atomic::AtomicU32;

    struct Mem {
        head: AtomicU32,
        tail: AtomicU32,
        slots: Vec<UnsafeCell<u64>>,
    }

    impl RingMemory<u64> for Mem {
        type Word = AtomicU32;
        fn capacity(&self) -> u32 {
            self.slots.len() as u32
        }
        fn head(&self) -> &AtomicU32 {
            &self.head
        }
        fn tail(&self) -> &AtomicU32 {
            &self.tail
        }
        unsafe fn write_slot(&self, index: u32, value: u64) {
            // SAFETY: the caller guarantees exclusive access to the slot (single thread here).
            unsafe { *self.slots[index as usize].get() = value }
        }
        unsafe fn read_slot(&self, index: u32) -> u64 {
            // SAFETY: as above.
            unsafe { *self.slots[index as usize].get() }
        }
    }

    fn mem(cap: usize) -> Mem {
        Mem { head: AtomicU32::new(0), tail: AtomicU32::new(0), slots: (0..cap).map(|_| UnsafeCell::new(0)).collect() }
    }

    #[test]
    fn fifo_full_and_wrapping() {
        let m = mem(4);
        let (mut p, mut c) = (Producer::new(), Consumer::new());
        // Start near the u32 wrap to cross it.
        p.tail = u32::MAX - 2;
        c.head = u32::MAX - 2;
        m.head.store(u32::MAX - 2, Ordering::Relaxed);
        m.tail.store(u32::MAX - 2, Ordering::Relaxed);
        let mut next = 0u64;
        let mut expect = 0u64;
        for round in 0..10 {
            for _ in 0..(round % 4 + 1) {
                p.push(&m, next).unwrap();
                next += 1;
            }
            if round % 4 == 3 {
                assert_eq!(p.push(&m, 99), Err(RingError::Full));
            }
            while let Some(v) = c.pop(&m).unwrap() {
                assert_eq!(v, expect);
                expect += 1;
            }
        }
        assert_eq!(expect, next);
    }

    #[test]
    fn impossible_indices_are_reported_not_trusted() {
        let m = mem(8);
        let (mut p, mut c) = (Producer::new(), Consumer::new());
        p.push(&m, 1).unwrap();
        // A peer writes a tail far ahead: the consumer refuses it.
        m.tail.store(1000, Ordering::Relaxed);
        assert!(matches!(c.pop(&m), Err(RingError::Corrupt { .. })));
        // A peer writes a head behind the producer's tail by more than the capacity.
        m.head.store(2_000_000, Ordering::Relaxed);
        assert!(matches!(p.push(&m, 2), Err(RingError::Corrupt { .. })));
    }

    #[test]
    fn wake_only_when_announced() {
        let flag = AtomicU32::new(0);
        assert!(!should_wake(&flag));
        prepare_sleep(&flag);
        assert!(should_wake(&flag));
        assert!(!should_wake(&flag), "one wake per announced sleep");
        prepare_sleep(&flag);
        end_sleep(&flag);
        assert!(!should_wake(&flag));
    }
}

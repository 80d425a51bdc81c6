//! Model checks of the shared-memory ring and its sleep/wake handshake with loom: the very code the
//! channel runs (`kairos_client::shm::ring`), instantiated over loom's atomics and cells, so every
//! interleaving (and every weak-memory outcome loom models) of these small cases is explored.
//!
//! They run in the ordinary `cargo test` (loom is a dev-dependency and the ring is generic over its
//! memory), so no `--cfg loom` build is needed.

use kairos_client::shm::ring::{self, Atomic32, Consumer, Producer, RingMemory};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU32, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

struct Word(AtomicU32);

impl Atomic32 for Word {
    fn load(&self, order: Ordering) -> u32 {
        self.0.load(order)
    }
    fn store(&self, value: u32, order: Ordering) {
        self.0.store(value, order)
    }
    fn swap(&self, value: u32, order: Ordering) -> u32 {
        self.0.swap(value, order)
    }
    fn fence(order: Ordering) {
        loom::sync::atomic::fence(order)
    }
}

struct Mem {
    head: Word,
    tail: Word,
    slots: Vec<UnsafeCell<u64>>,
}

impl Mem {
    fn new(capacity: usize) -> Mem {
        Mem {
            head: Word(AtomicU32::new(0)),
            tail: Word(AtomicU32::new(0)),
            slots: (0..capacity).map(|_| UnsafeCell::new(0)).collect(),
        }
    }
}

impl RingMemory<u64> for Mem {
    type Word = Word;
    fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }
    fn head(&self) -> &Word {
        &self.head
    }
    fn tail(&self) -> &Word {
        &self.tail
    }
    unsafe fn write_slot(&self, index: u32, value: u64) {
        // loom checks that no read of this slot races with the write.
        self.slots[index as usize].with_mut(|p| unsafe { *p = value })
    }
    unsafe fn read_slot(&self, index: u32) -> u64 {
        self.slots[index as usize].with(|p| unsafe { *p })
    }
}

/// Every item arrives once, in order, through a ring smaller than the stream (slots are reused),
/// and no slot access races.
#[test]
fn spsc_delivers_in_order_without_races() {
    loom::model(|| {
        let mem = Arc::new(Mem::new(2));
        let m = mem.clone();
        let producer = thread::spawn(move || {
            let mut p = Producer::new();
            let mut next = 1u64;
            while next <= 3 {
                match p.push(&*m, next) {
                    Ok(()) => next += 1,
                    Err(ring::RingError::Full) => thread::yield_now(),
                    Err(e) => panic!("{e}"),
                }
            }
        });
        let mut c = Consumer::new();
        let mut expect = 1u64;
        while expect <= 3 {
            match c.pop(&*mem).unwrap() {
                Some(v) => {
                    assert_eq!(v, expect);
                    expect += 1;
                }
                None => thread::yield_now(),
            }
        }
        producer.join().unwrap();
        assert_eq!(c.pop(&*mem).unwrap(), None);
    });
}

/// An eventfd, as loom can model it: a counter, a blocking read that takes it, a write that adds.
struct EventFd {
    count: Mutex<u64>,
    ready: Condvar,
}

impl EventFd {
    fn write(&self) {
        *self.count.lock().unwrap() += 1;
        self.ready.notify_one();
    }
    fn read(&self) {
        let mut n = self.count.lock().unwrap();
        while *n == 0 {
            n = self.ready.wait(n).unwrap();
        }
        *n = 0;
    }
}

/// The hybrid wait never loses a wake-up: a consumer that announces its sleep, checks the ring
/// once more and sleeps is always woken by a producer that publishes and then checks the flag
/// (loom reports a deadlock if some interleaving leaves the consumer asleep with an item ready).
#[test]
fn sleep_wake_handshake_loses_no_wake_up() {
    loom::model(|| {
        let mem = Arc::new(Mem::new(2));
        let flag = Arc::new(Word(AtomicU32::new(0)));
        let event = Arc::new(EventFd { count: Mutex::new(0), ready: Condvar::new() });
        let (m, f, e) = (mem.clone(), flag.clone(), event.clone());
        let producer = thread::spawn(move || {
            let mut p = Producer::new();
            for v in 1..=2u64 {
                p.push(&*m, v).unwrap();
                if ring::should_wake(&*f) {
                    e.write();
                }
            }
        });
        let mut c = Consumer::new();
        let mut got = Vec::new();
        while got.len() < 2 {
            if let Some(v) = c.pop(&*mem).unwrap() {
                got.push(v);
                continue;
            }
            ring::prepare_sleep(&*flag);
            if c.available(&*mem).unwrap() == 0 {
                event.read();
            }
            ring::end_sleep(&*flag);
        }
        assert_eq!(got, vec![1, 2]);
        producer.join().unwrap();
    });
}

/// The producer never overwrites a slot the consumer has not released: with a full ring of one
/// slot, pushes fail until the pop's release store is seen.
#[test]
fn full_ring_refuses_until_released() {
    loom::model(|| {
        let mem = Arc::new(Mem::new(1));
        let mut p = Producer::new();
        p.push(&*mem, 7).unwrap();
        let m = mem.clone();
        let consumer = thread::spawn(move || {
            let mut c = Consumer::new();
            loop {
                if let Some(v) = c.pop(&*m).unwrap() {
                    return v;
                }
                thread::yield_now();
            }
        });
        loop {
            match p.push(&*mem, 8) {
                Ok(()) => break,
                Err(ring::RingError::Full) => thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(consumer.join().unwrap(), 7);
    });
}

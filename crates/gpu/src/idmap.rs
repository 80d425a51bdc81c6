//! Hash maps keyed by small ids on the launch path (launch ids, request ids, tenants, kernel entry
//! keys): hashed with a multiply per word instead of SipHash, which costs tens of nanoseconds per
//! lookup on a path that does a few lookups per launch and per GPU event. The keys are not chosen
//! by an adversary: launch ids come from the GPU backend, request ids from the engine's counter.
//! Shared by the dispatcher (kairos-sched) and the CUDA backend.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_over_buckets() {
        // Sequential ids must not collide in their low bits (HashMap's bucket index), and must
        // spread over the top 7 bits (its control-byte tag).
        let (mut low, mut tag) = (std::collections::HashSet::new(), std::collections::HashSet::new());
        for i in 0..1024u64 {
            let mut h = IdHasher::default();
            h.write_u64(i);
            low.insert(h.finish() & 1023);
            tag.insert(h.finish() >> 57);
        }
        assert_eq!(low.len(), 1024, "sequential ids collide in the low 10 bits");
        assert!(tag.len() > 100, "{} distinct tags of 128", tag.len());
        let m: IdMap<u64, u64> = (0..1000).map(|i| (i, i * 2)).collect();
        assert!((0..1000).all(|i| m[&i] == i * 2));
    }
}

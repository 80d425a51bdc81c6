//! Messages on the shared-memory channel's Unix socket (SOCK_SEQPACKET: one message per send,
//! never split or merged). The socket carries the hand-shake (and with it, as SCM_RIGHTS, the
//! region's memfd and the two eventfds), model look-ups, and — as the baseline that Paella's
//! Figure 14 compares against — whole requests and responses ("socket" mode).
//!
//! Every message starts with an op byte. Integers are little-endian; a string is a u16 length and
//! UTF-8 bytes; a byte string a u64 length and the bytes. Readers check every length.
//!
//! | op | client -> server | server -> client |
//! |---|---|---|
//! | HELLO | version u32, sq_entries u32, cq_entries u32, data_bytes u64 | status u32, message str (+ 3 fds on success: region, completion eventfd, doorbell eventfd) |
//! | OPEN_MODEL | name str, version str | status u32, message str, then on success: handle u32, version str, inputs, outputs (each: count u16, then name str, dtype u8, rank u8, dims u64...) |
//! | INFER | tag u64, model u32, priority i32, timeout_us u64, class u8, flags u32, tenant u32, count u16, tensors (bytes each) | tag u64, status u32, message str, engine_ns u64, gpu_ns u64, queue_ns u64, deadline_missed u8, count u16, tensors |

use kairos_core::DType;

pub const OP_HELLO: u8 = 1;
pub const OP_OPEN_MODEL: u8 = 2;
pub const OP_INFER: u8 = 3;
/// The largest message either side sends or accepts (socket-mode tensors included).
pub const MESSAGE_BYTES_MAX: usize = 192 * 1024;
/// File descriptors passed with a successful HELLO reply.
pub const HELLO_FDS: usize = 3;
pub const RANK_MAX: usize = 8;

pub fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::I64 => 3,
    }
}

pub fn dtype_from_code(c: u8) -> Option<DType> {
    match c {
        1 => Some(DType::F32),
        2 => Some(DType::F16),
        3 => Some(DType::I64),
        _ => None,
    }
}

/// A tensor's name, element type and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// The tensor's size in bytes; a shape whose size does not fit u64 (a peer may send any
    /// dimensions) saturates at `u64::MAX`, which no span or message can match.
    pub fn len_bytes(&self) -> u64 {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape.iter().try_fold(self.dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d as u64)).unwrap_or(u64::MAX)
    }
}

#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new(op: u8) -> Writer {
        Writer { buf: vec![op] }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Strings longer than u16::MAX bytes are cut (at a character boundary).
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut n = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        self.u16(n as u16);
        self.buf.extend_from_slice(&s.as_bytes()[..n]);
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u64(b.len() as u64);
        self.buf.extend_from_slice(b);
        self
    }
    pub fn tensor_specs(&mut self, specs: &[TensorSpec]) -> &mut Self {
        self.u16(specs.len() as u16);
        for s in specs {
            self.str(&s.name).u8(dtype_code(s.dtype)).u8(s.shape.len() as u8);
            for &d in &s.shape {
                self.u64(d as u64);
            }
        }
        self
    }
}

/// A bounds-checked cursor over one received message.
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

pub type WireResult<T> = Result<T, String>;

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, at: 0 }
    }
    fn take(&mut self, n: usize) -> WireResult<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("truncated message: {n} more bytes wanted at byte {} of {}", self.at, self.buf.len()))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> WireResult<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> WireResult<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> WireResult<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn i32(&mut self) -> WireResult<i32> {
        Ok(i32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> WireResult<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn str(&mut self) -> WireResult<String> {
        let n = self.u16()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "a string is not UTF-8".to_string())
    }
    pub fn bytes(&mut self) -> WireResult<&'a [u8]> {
        let n = self.u64()?;
        let n = usize::try_from(n).map_err(|_| format!("a byte string of {n} bytes"))?;
        self.take(n)
    }
    pub fn tensor_specs(&mut self) -> WireResult<Vec<TensorSpec>> {
        let n = self.u16()? as usize;
        let mut v = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let name = self.str()?;
            let code = self.u8()?;
            let dtype = dtype_from_code(code).ok_or_else(|| format!("unknown dtype code {code}"))?;
            let rank = self.u8()? as usize;
            if rank > RANK_MAX {
                return Err(format!("rank {rank} exceeds {RANK_MAX}"));
            }
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                shape.push(usize::try_from(self.u64()?).map_err(|_| "a dimension does not fit usize".to_string())?);
            }
            v.push(TensorSpec { name, dtype, shape });
        }
        Ok(v)
    }
    pub fn is_done(&self) -> bool {
        self.at == self.buf.len()
    }
    pub fn finish(&self) -> WireResult<()> {
        if self.is_done() { Ok(()) } else { Err(format!("{} trailing bytes", self.buf.len() - self.at)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let specs = vec![TensorSpec { name: "x".into(), dtype: DType::F16, shape: vec![1, 3, 4] }];
        let mut w = Writer::new(OP_OPEN_MODEL);
        w.u32(7).str("héllo").i32(-5).bytes(b"abc").tensor_specs(&specs);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u8().unwrap(), OP_OPEN_MODEL);
        assert_eq!(r.u32().unwrap(), 7);
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.i32().unwrap(), -5);
        assert_eq!(r.bytes().unwrap(), b"abc");
        assert_eq!(r.tensor_specs().unwrap(), specs);
        r.finish().unwrap();
        assert_eq!(specs[0].len_bytes(), 24);
        // Every prefix is a clean error, never a panic.
        for n in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..n]);
            let ok = (|| -> WireResult<()> {
                r.u8()?;
                r.u32()?;
                r.str()?;
                r.i32()?;
                r.bytes()?;
                r.tensor_specs()?;
                Ok(())
            })();
            assert!(ok.is_err(), "prefix of {n} bytes parsed");
        }
        // A huge claimed length is refused, not allocated.
        let mut w = Writer::new(OP_INFER);
        w.u64(u64::MAX);
        let mut r = Reader::new(&w.buf[1..]);
        assert!(r.bytes().is_err());
    }

    /// Regression (fuzzing, issue 25): dimensions read off the wire whose product overflows made
    /// `len_bytes` panic ("attempt to multiply with overflow"); it saturates now.
    #[test]
    fn huge_dimensions_saturate() {
        let spec = TensorSpec { name: "x".into(), dtype: DType::F32, shape: vec![1 << 40, 1 << 40] };
        assert_eq!(spec.len_bytes(), u64::MAX);
        let mut w = Writer::new(OP_OPEN_MODEL);
        w.tensor_specs(std::slice::from_ref(&spec));
        let got = Reader::new(&w.buf[1..]).tensor_specs().unwrap();
        assert_eq!(got[0].len_bytes(), u64::MAX);
        assert_eq!(TensorSpec { shape: vec![], ..spec.clone() }.len_bytes(), 4);
        assert_eq!(TensorSpec { shape: vec![1 << 62, 3, 0], ..spec }.len_bytes(), 0);
    }
}

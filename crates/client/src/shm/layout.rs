//! The shared-memory region's layout: one definition for the server and the client.
//!
//! ```text
//!   0 ........ 4096   control page: Header (written once by the server), then the ring indices
//!                     and the two sleep flags, each on its own 128-byte line
//!   sq_offset         submission ring: sq_entries x Submission (client -> server)
//!   cq_offset         completion ring: cq_entries x Completion (server -> client)
//!   data_offset       data area: the client's input and output buffers (data_bytes)
//! ```
//!
//! Every section starts on a page. Buffers are named by [`Span`]s relative to the data area, so a
//! client can only ever name bytes of its own region: the server checks `offset + len <= data_bytes`
//! (without overflow) before it touches a byte, and it never reads layout values back from the
//! region (the client can scribble over them; the server keeps its own copy of the [`Layout`]).

use bytemuck::{Pod, Zeroable};

/// "KAIROSHM" little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KAIROSHM");
/// Bumped on any change of this file's types, offsets or flags (2: `Completion::flags`; 3:
/// [`FLAG_DEADLINE_ONLY`]).
pub const VERSION: u32 = 3;
/// Inputs and outputs one submission can name.
pub const INPUTS_MAX: usize = 8;
pub const OUTPUTS_MAX: usize = 8;
const _: () = assert!(OUTPUTS_MAX <= u8::MAX as usize);
/// Error text carried inline in a completion (longer messages are cut).
pub const MESSAGE_BYTES_MAX: usize = 128;
/// Ring sizes are powers of two in 2..=RING_ENTRIES_MAX.
pub const RING_ENTRIES_MAX: u32 = 4096;
/// The largest region a client may ask for (the server's own limit is usually lower).
pub const REGION_BYTES_MAX: u64 = 1 << 36;
pub const PAGE_BYTES: u64 = 4096;
/// Indices and flags each get a line of their own (two 64-byte lines: adjacent-line prefetch).
pub const LINE_BYTES: u64 = 128;

/// Offsets, in the control page, of the shared words (u32 each, on lines of their own).
pub const SQ_HEAD_OFFSET: u64 = 512;
pub const SQ_TAIL_OFFSET: u64 = SQ_HEAD_OFFSET + LINE_BYTES;
pub const CQ_HEAD_OFFSET: u64 = SQ_HEAD_OFFSET + 2 * LINE_BYTES;
pub const CQ_TAIL_OFFSET: u64 = SQ_HEAD_OFFSET + 3 * LINE_BYTES;
/// Set by the server's client thread before it sleeps on its doorbell eventfd.
pub const SERVER_SLEEPING_OFFSET: u64 = SQ_HEAD_OFFSET + 4 * LINE_BYTES;
/// Set by the client before it sleeps on its completion eventfd.
pub const CLIENT_WAITING_OFFSET: u64 = SQ_HEAD_OFFSET + 5 * LINE_BYTES;
const _: () = assert!(CLIENT_WAITING_OFFSET + LINE_BYTES <= PAGE_BYTES);
const _: () = assert!(std::mem::size_of::<Header>() as u64 <= SQ_HEAD_OFFSET);

/// A byte range of the data area.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Span {
    pub offset: u64,
    pub len: u64,
}

impl Span {
    /// The range as `usize` bounds inside a data area of `data_bytes`, or `None` when it does not
    /// fit (overflow included).
    pub fn range_in(&self, data_bytes: u64) -> Option<std::ops::Range<usize>> {
        let end = self.offset.checked_add(self.len)?;
        (end <= data_bytes).then_some(self.offset as usize..end as usize)
    }
}

/// `Submission::class` values.
pub const CLASS_MODEL_DEFAULT: u8 = 0;
pub const CLASS_REAL_TIME: u8 = 1;
pub const CLASS_BEST_EFFORT: u8 = 2;
/// `Submission::flags` bits.
pub const FLAG_TENANT: u32 = 1;
/// `timeout_us` is a deadline only (the `kairos_deadline_us` parameter): scheduled for and
/// reported as missed, never cancelled.
pub const FLAG_DEADLINE_ONLY: u32 = 2;
/// Every `Submission::flags` bit this version knows (the server refuses others).
pub const FLAGS_KNOWN: u32 = FLAG_TENANT | FLAG_DEADLINE_ONLY;
/// `Completion::flags` bits: the GPU read the inputs from and wrote the outputs into the region
/// directly (zero-copy); without it the server copied them.
pub const COMPLETION_ZERO_COPY: u8 = 1;

/// One request, written by the client into the submission ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Submission {
    /// The client's own tag, echoed in the completion.
    pub tag: u64,
    /// Deadline (latency target) in microseconds; 0: the model's configured one.
    pub timeout_us: u64,
    /// A model handle from the control socket's `OpenModel`.
    pub model: u32,
    /// Triton's convention: 0 = the model's priority, 1 = the most urgent, larger = less urgent.
    pub priority: i32,
    /// Used when `flags & FLAG_TENANT`.
    pub tenant: u32,
    pub flags: u32,
    pub input_count: u16,
    pub output_count: u16,
    /// `CLASS_*`.
    pub class: u8,
    pub reserved: [u8; 3],
    /// Input bytes, in the model's input order, exactly the input's size each.
    pub inputs: [Span; INPUTS_MAX],
    /// Where each output goes, in the model's output order, at least the output's size each.
    pub outputs: [Span; OUTPUTS_MAX],
}

/// One result, written by the server into the completion ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Completion {
    pub tag: u64,
    /// 0 when the outputs are in place; otherwise a [`crate::Code`] number (gRPC numbering).
    pub status: u32,
    pub output_count: u8,
    /// `COMPLETION_*` bits.
    pub flags: u8,
    pub deadline_missed: u8,
    pub message_len: u8,
    /// Wall time in the engine: submission to completion, as the server measured it.
    pub engine_ns: u64,
    /// First kernel issued to done, on the engine's GPU clock (simulated time on the simulator).
    pub gpu_ns: u64,
    /// Arrival to first kernel issued, on the engine's GPU clock.
    pub queue_ns: u64,
    pub output_lens: [u64; OUTPUTS_MAX],
    pub message: [u8; MESSAGE_BYTES_MAX],
}

impl Default for Completion {
    fn default() -> Self {
        Zeroable::zeroed()
    }
}

impl Completion {
    pub fn message(&self) -> String {
        let n = (self.message_len as usize).min(MESSAGE_BYTES_MAX);
        String::from_utf8_lossy(&self.message[..n]).into_owned()
    }

    pub fn set_message(&mut self, text: &str) {
        // Cut at a character boundary.
        let mut n = text.len().min(MESSAGE_BYTES_MAX);
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        self.message[..n].copy_from_slice(&text.as_bytes()[..n]);
        self.message_len = n as u8;
    }
}

/// The header at offset 0, written once by the server (informational for the client).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Header {
    pub magic: u64,
    pub version: u32,
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub reserved: u32,
    pub region_bytes: u64,
    pub sq_offset: u64,
    pub cq_offset: u64,
    pub data_offset: u64,
    pub data_bytes: u64,
}

/// Where everything is, computed the same way on both sides from three numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub sq_offset: u64,
    pub cq_offset: u64,
    pub data_offset: u64,
    pub data_bytes: u64,
    pub region_bytes: u64,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl Layout {
    /// A layout for rings of `sq_entries` and `cq_entries` (powers of two) and a data area of at
    /// least `data_bytes` (rounded up to a page).
    pub fn new(sq_entries: u32, cq_entries: u32, data_bytes: u64) -> Result<Layout, String> {
        for (what, n) in [("sq_entries", sq_entries), ("cq_entries", cq_entries)] {
            if !(2..=RING_ENTRIES_MAX).contains(&n) || !n.is_power_of_two() {
                return Err(format!("{what} = {n} must be a power of two in 2..={RING_ENTRIES_MAX}"));
            }
        }
        if data_bytes > REGION_BYTES_MAX {
            return Err(format!("a data area of {data_bytes} bytes exceeds the region limit of {REGION_BYTES_MAX} bytes"));
        }
        let data_bytes = round_up(data_bytes.max(PAGE_BYTES), PAGE_BYTES);
        let sq_offset = PAGE_BYTES;
        let cq_offset = round_up(sq_offset + sq_entries as u64 * std::mem::size_of::<Submission>() as u64, PAGE_BYTES);
        let data_offset = round_up(cq_offset + cq_entries as u64 * std::mem::size_of::<Completion>() as u64, PAGE_BYTES);
        let region_bytes = data_offset
            .checked_add(data_bytes)
            .filter(|&r| r <= REGION_BYTES_MAX)
            .ok_or_else(|| format!("a data area of {data_bytes} bytes exceeds the region limit of {REGION_BYTES_MAX} bytes"))?;
        Ok(Layout { sq_entries, cq_entries, sq_offset, cq_offset, data_offset, data_bytes, region_bytes })
    }

    pub fn header(&self) -> Header {
        Header {
            magic: MAGIC,
            version: VERSION,
            sq_entries: self.sq_entries,
            cq_entries: self.cq_entries,
            reserved: 0,
            region_bytes: self.region_bytes,
            sq_offset: self.sq_offset,
            cq_offset: self.cq_offset,
            data_offset: self.data_offset,
            data_bytes: self.data_bytes,
        }
    }

    /// The layout a header describes, if it is one this version would have written.
    pub fn from_header(h: &Header) -> Result<Layout, String> {
        if h.magic != MAGIC {
            return Err("not a kairos shared-memory region (bad magic)".into());
        }
        if h.version != VERSION {
            return Err(format!("region version {} (this client speaks {VERSION})", h.version));
        }
        let l = Layout::new(h.sq_entries, h.cq_entries, h.data_bytes)?;
        if l.header() != *h {
            return Err("the region's header disagrees with its own sizes".into());
        }
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_offsets() {
        assert_eq!(std::mem::size_of::<Submission>(), 40 + 2 * 16 * INPUTS_MAX);
        assert_eq!(std::mem::size_of::<Completion>(), 40 + 8 * OUTPUTS_MAX + MESSAGE_BYTES_MAX);
        let l = Layout::new(64, 64, 1 << 20).unwrap();
        assert_eq!(l.sq_offset, 4096);
        assert!(l.cq_offset >= l.sq_offset + 64 * 296);
        assert_eq!(l.data_offset % PAGE_BYTES, 0);
        assert_eq!(l.region_bytes, l.data_offset + (1 << 20));
        assert_eq!(Layout::from_header(&l.header()).unwrap(), l);
        assert!(Layout::new(3, 64, 0).is_err());
        assert!(Layout::new(64, 8192, 0).is_err());
        assert!(Layout::new(64, 64, u64::MAX - 10).is_err());
        let mut h = l.header();
        h.data_offset += 1;
        assert!(Layout::from_header(&h).is_err());
    }

    #[test]
    fn spans_are_checked_without_overflow() {
        assert_eq!(Span { offset: 0, len: 10 }.range_in(10), Some(0..10));
        assert_eq!(Span { offset: 1, len: 10 }.range_in(10), None);
        assert_eq!(Span { offset: u64::MAX, len: 2 }.range_in(10), None);
        assert_eq!(Span { offset: 10, len: 0 }.range_in(10), Some(10..10));
    }

    #[test]
    fn messages_are_cut_at_char_boundaries() {
        let mut c = Completion::default();
        let long = "é".repeat(100);
        c.set_message(&long);
        assert!(c.message_len as usize <= MESSAGE_BYTES_MAX);
        assert!(c.message().chars().all(|ch| ch == 'é'));
        c.set_message("bad shape");
        assert_eq!(c.message(), "bad shape");
    }
}

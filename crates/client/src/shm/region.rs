//! The mapped shared-memory region: the only place in kairos' front ends with `unsafe` code.
//!
//! The server creates the region as a sealed memfd (it cannot be shrunk or grown, so no peer can
//! make the other side's accesses fault), maps it, writes the [`Header`], and passes the fd to one
//! client over its Unix socket; the fd is reachable by no one else. Both sides access the region
//! only through raw pointers: the ring words as `AtomicU32`s, slots and buffers by copying bytes
//! (`ptr::copy_nonoverlapping`), never through references that assume no one else writes. Every
//! data access is bounds-checked against the server's own [`Layout`] (a client may scribble over
//! the header; the server never reads layout values back from the region).

use super::layout::*;
use super::ring::RingMemory;
use kairos_gpu::{HostMemory, HostRange};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fd::OwnedFd;
use std::marker::PhantomData;
use std::sync::atomic::AtomicU32;

/// A span outside the data area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanError {
    pub span: Span,
    pub data_bytes: u64,
}

impl std::fmt::Display for SpanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "bytes {}..{} are outside the data area of {} bytes",
            self.span.offset,
            self.span.offset as u128 + self.span.len as u128,
            self.data_bytes
        )
    }
}

pub struct Region {
    map: MmapRaw,
    layout: Layout,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("layout", &self.layout).finish()
    }
}

impl Region {
    /// Server side: a new sealed memfd of `layout.region_bytes`, mapped, with its header written.
    pub fn create(layout: Layout, name: &str) -> std::io::Result<(Region, OwnedFd)> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, layout.region_bytes)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let file = std::fs::File::from(fd.try_clone()?);
        let map = MmapOptions::new().len(layout.region_bytes as usize).map_raw(&file)?;
        let region = Region { map, layout };
        let header = layout.header();
        // SAFETY: the header fits in the control page (a const assertion in layout.rs), the map is
        // `region_bytes` long, and no one else has the fd yet.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytemuck::bytes_of(&header).as_ptr(),
                region.map.as_mut_ptr(),
                std::mem::size_of::<Header>(),
            )
        };
        Ok((region, fd))
    }

    /// Client side: maps a region received from the server and checks its header and size.
    pub fn open(fd: OwnedFd) -> Result<Region, String> {
        let stat = rustix::fs::fstat(&fd).map_err(|e| format!("fstat of the region: {e}"))?;
        let file_bytes = stat.st_size as u64;
        if file_bytes < PAGE_BYTES {
            return Err(format!("the region is {file_bytes} bytes, smaller than its control page"));
        }
        let file = std::fs::File::from(fd);
        let map = MmapOptions::new().len(file_bytes as usize).map_raw(&file).map_err(|e| format!("mmap of the region: {e}"))?;
        let mut header = Header::default();
        // SAFETY: the map is at least one page long and the header is smaller than that.
        unsafe {
            std::ptr::copy_nonoverlapping(
                map.as_ptr(),
                bytemuck::bytes_of_mut(&mut header).as_mut_ptr(),
                std::mem::size_of::<Header>(),
            )
        };
        let layout = Layout::from_header(&header)?;
        if layout.region_bytes > file_bytes {
            return Err(format!("the header claims {} bytes, the region has {file_bytes}", layout.region_bytes));
        }
        Ok(Region { map, layout })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn word(&self, offset: u64) -> &AtomicU32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= PAGE_BYTES);
        // SAFETY: the offset is 4-aligned inside the control page of a live, page-aligned map that
        // `self` owns, so the reference lives no longer than the map; AtomicU32 has the size and
        // alignment of u32 and is lock-free, so atomic accesses are sound in shared memory.
        unsafe { &*(self.map.as_ptr().add(offset as usize) as *const AtomicU32) }
    }

    /// The submission ring (client produces, server consumes).
    pub fn sq(&self) -> ShmRing<'_, Submission> {
        ShmRing {
            region: self,
            head: self.word(SQ_HEAD_OFFSET),
            tail: self.word(SQ_TAIL_OFFSET),
            offset: self.layout.sq_offset,
            capacity: self.layout.sq_entries,
            _item: PhantomData,
        }
    }

    /// The completion ring (server produces, client consumes).
    pub fn cq(&self) -> ShmRing<'_, Completion> {
        ShmRing {
            region: self,
            head: self.word(CQ_HEAD_OFFSET),
            tail: self.word(CQ_TAIL_OFFSET),
            offset: self.layout.cq_offset,
            capacity: self.layout.cq_entries,
            _item: PhantomData,
        }
    }

    pub fn server_sleeping(&self) -> &AtomicU32 {
        self.word(SERVER_SLEEPING_OFFSET)
    }

    pub fn client_waiting(&self) -> &AtomicU32 {
        self.word(CLIENT_WAITING_OFFSET)
    }

    fn data_range(&self, span: Span) -> Result<std::ops::Range<usize>, SpanError> {
        span.range_in(self.layout.data_bytes).ok_or(SpanError { span, data_bytes: self.layout.data_bytes })
    }

    /// Copies `src` into the data area at `span` (`src.len()` must equal `span.len`).
    pub fn write_data(&self, span: Span, src: &[u8]) -> Result<(), SpanError> {
        let r = self.data_range(span)?;
        assert_eq!(src.len(), r.len(), "write_data: the source must fill the span");
        // SAFETY: the range is inside the data area (checked above), which lies inside the map;
        // `src` is ordinary memory of this process, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(self.layout.data_offset as usize + r.start),
                r.len(),
            )
        };
        Ok(())
    }

    /// Copies the data area's `span` into `dst` (`dst.len()` must equal `span.len`).
    pub fn read_data(&self, span: Span, dst: &mut [u8]) -> Result<(), SpanError> {
        let r = self.data_range(span)?;
        assert_eq!(dst.len(), r.len(), "read_data: the destination must match the span");
        // SAFETY: as in `write_data`. Bytes a peer writes concurrently arrive torn at worst; every
        // bit pattern is a valid u8.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(self.layout.data_offset as usize + r.start),
                dst.as_mut_ptr(),
                r.len(),
            )
        };
        Ok(())
    }

    pub fn read_data_vec(&self, span: Span) -> Result<Vec<u8>, SpanError> {
        self.data_range(span)?;
        let mut v = vec![0u8; span.len as usize];
        self.read_data(span, &mut v)?;
        Ok(v)
    }

    /// The data area's `span` as a mutable slice, to write inputs in place.
    ///
    /// # Safety
    /// 1. No other slice of this process overlapping `span` is alive while the returned one is.
    /// 2. The server does not write `span` meanwhile: no submitted, uncompleted request names it as
    ///    an output.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn data_mut(&self, span: Span) -> Result<&mut [u8], SpanError> {
        let r = self.data_range(span)?;
        // SAFETY: inside the map (checked); exclusivity is the caller's contract (1, 2).
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(self.layout.data_offset as usize + r.start), r.len())
        })
    }

    /// The data area's `span` as a slice, to read outputs in place.
    ///
    /// # Safety
    /// 1. No mutable slice of this process overlapping `span` is alive while the returned one is.
    /// 2. The server does not write `span` meanwhile (no uncompleted request names it as an output).
    pub unsafe fn data(&self, span: Span) -> Result<&[u8], SpanError> {
        let r = self.data_range(span)?;
        // SAFETY: inside the map (checked); no concurrent writer is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.layout.data_offset as usize + r.start), r.len()) })
    }
}

/// A region's data area lent to a GPU for zero-copy requests (`kairos_gpu::Gpu::map_host`): the
/// server maps it into each engine's GPU, which then reads inputs and writes outputs in place.
/// Offsets are relative to the data area. It holds the region alive, so a GPU that holds it keeps
/// the mapping valid; the memfd is sealed, so the client cannot shrink the pages away under it.
#[derive(Debug)]
pub struct DataArea(pub std::sync::Arc<Region>);

impl HostMemory for DataArea {
    fn len_bytes(&self) -> u64 {
        self.0.layout.data_bytes
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) {
        let span = Span { offset, len: out.len() as u64 };
        self.0.read_data(span, out).unwrap_or_else(|e| panic!("DataArea::read_at: {e}"));
    }

    fn write_at(&self, offset: u64, data: &[u8]) {
        let span = Span { offset, len: data.len() as u64 };
        self.0.write_data(span, data).unwrap_or_else(|e| panic!("DataArea::write_at: {e}"));
    }

    fn pinnable(&self) -> Option<HostRange<'_>> {
        let l = &self.0.layout;
        // SAFETY: the data area lies inside the map (the layout says so, and the map is
        // `region_bytes` long) and is readable and writable; the map lives as long as the Region,
        // which this value holds, and is never remapped; the memfd behind it is sealed against
        // shrinking, so no peer can take the pages away (1). This process touches the data area
        // only through raw-pointer copies (`read_data`, `write_data`) except in the client's
        // `data`/`data_mut`, whose contracts forbid a slice over a span the server (here: the
        // GPU) may write, i.e. an output of an uncompleted request (2).
        Some(unsafe { HostRange::new(self.0.map.as_ptr() as usize + l.data_offset as usize, l.data_bytes as usize) })
    }
}

/// One of the region's two rings, as [`RingMemory`].
pub struct ShmRing<'a, T> {
    region: &'a Region,
    head: &'a AtomicU32,
    tail: &'a AtomicU32,
    offset: u64,
    capacity: u32,
    _item: PhantomData<T>,
}

impl<T: bytemuck::Pod> RingMemory<T> for ShmRing<'_, T> {
    type Word = AtomicU32;

    fn capacity(&self) -> u32 {
        self.capacity
    }
    fn head(&self) -> &AtomicU32 {
        self.head
    }
    fn tail(&self) -> &AtomicU32 {
        self.tail
    }

    unsafe fn write_slot(&self, index: u32, value: T) {
        assert!(index < self.capacity);
        let at = self.offset as usize + index as usize * std::mem::size_of::<T>();
        // SAFETY: the slot lies inside the ring's section of the map (index < capacity and the
        // layout reserves capacity slots); the bytes are copied, so alignment does not matter.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytemuck::bytes_of(&value).as_ptr(),
                self.region.map.as_mut_ptr().add(at),
                std::mem::size_of::<T>(),
            )
        };
    }

    unsafe fn read_slot(&self, index: u32) -> T {
        assert!(index < self.capacity);
        let at = self.offset as usize + index as usize * std::mem::size_of::<T>();
        let mut value = T::zeroed();
        // SAFETY: as in `write_slot`; T is Pod, so any bytes (even torn by a misbehaving peer) are
        // a valid T.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.region.map.as_ptr().add(at),
                bytemuck::bytes_of_mut(&mut value).as_mut_ptr(),
                std::mem::size_of::<T>(),
            )
        };
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ring::{Consumer, Producer};

    #[test]
    fn create_open_and_share() {
        let layout = Layout::new(8, 8, 1 << 16).unwrap();
        let (server, fd) = Region::create(layout, "kairos-test").unwrap();
        let client = Region::open(fd.try_clone().unwrap()).unwrap();
        assert_eq!(client.layout(), server.layout());
        // The memfd is sealed: it cannot shrink under the other side.
        assert!(rustix::fs::ftruncate(&fd, 0).is_err());
        // Data written by one mapping is seen by the other.
        let span = Span { offset: 100, len: 5 };
        client.write_data(span, b"hello").unwrap();
        assert_eq!(server.read_data_vec(span).unwrap(), b"hello");
        assert!(server.read_data_vec(Span { offset: layout.data_bytes - 2, len: 5 }).is_err());
        assert!(client.write_data(Span { offset: u64::MAX, len: 1 }, b"x").is_err());
        // A submission crosses through the ring.
        let (mut p, mut c) = (Producer::new(), Consumer::new());
        let s = Submission { tag: 42, model: 3, input_count: 1, ..Default::default() };
        p.push(&client.sq(), s).unwrap();
        assert_eq!(c.pop(&server.sq()).unwrap(), Some(s));
        assert_eq!(c.pop(&server.sq()).unwrap(), None);
    }

    #[test]
    fn the_data_area_is_lent_as_host_memory() {
        let layout = Layout::new(8, 8, 1 << 16).unwrap();
        let (server, fd) = Region::create(layout, "kairos-test").unwrap();
        let client = Region::open(fd).unwrap();
        let area = DataArea(std::sync::Arc::new(server));
        assert_eq!(area.len_bytes(), layout.data_bytes);
        let r = area.pinnable().unwrap();
        assert_eq!(r.addr() % PAGE_BYTES as usize, 0);
        assert_eq!(r.len() as u64, layout.data_bytes);
        // Bytes the client writes are what the lent memory reads, and the other way round.
        client.write_data(Span { offset: 4096, len: 3 }, b"abc").unwrap();
        let mut out = [0u8; 3];
        area.read_at(4096, &mut out);
        assert_eq!(&out, b"abc");
        area.write_at(8192, b"xyz");
        assert_eq!(client.read_data_vec(Span { offset: 8192, len: 3 }).unwrap(), b"xyz");
        assert!(std::panic::catch_unwind(|| area.read_at(layout.data_bytes - 1, &mut [0u8; 2])).is_err());
    }

    #[test]
    fn a_foreign_fd_is_refused() {
        let fd = rustix::fs::memfd_create("not-kairos", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 8192).unwrap();
        assert!(Region::open(fd).unwrap_err().contains("magic"));
    }
}

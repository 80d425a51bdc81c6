//! Simulated allocations: synthetic addresses, optional backing bytes, and the `KernelMemory`
//! view the CPU reference kernels run on.

use kairos_core::DType;
use kairos_core::plan::{AlignedBytes, Kernel};
use kairos_gpu::{Allocation, DevicePtr, GpuError, HostMemory, MemKind, Result};
use kairos_kernels::cpu::KernelMemory;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// Allocations are aligned like cudaMalloc's and separated by a guard gap, so that a pointer one
/// past the end of an allocation is never inside the next one.
const ALLOC_ALIGN_BYTES: u64 = 256;
const GUARD_BYTES: u64 = 4096;
/// First synthetic address (leaves 0 and small values invalid).
const BASE_ADDRESS: u64 = 1 << 32;

pub(crate) struct Alloc {
    pub bytes: u64,
    pub kind: MemKind,
    /// Backing bytes, when the simulator computes results.
    pub data: Option<AlignedBytes>,
    /// Caller memory mapped in with `Gpu::map_host` (kind `HostMapped`, no backing of its own).
    pub host: Option<Arc<dyn HostMemory>>,
}

pub(crate) struct Memory {
    allocs: BTreeMap<u64, Alloc>,
    next_address: u64,
    backed: bool,
    pub device_used_bytes: u64,
    pub host_used_bytes: u64,
    device_bytes_max: u64,
    host_bytes_max: u64,
}

/// Where a pointer lands: its allocation's base and the offset into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub base: u64,
    pub offset: u64,
    pub bytes: u64,
    pub kind: MemKind,
}

impl Resolved {
    /// Bytes from the pointer to the end of its allocation.
    pub fn len_to_end(&self) -> u64 {
        self.bytes - self.offset
    }
}

impl Memory {
    pub fn new(backed: bool, device_bytes_max: u64, host_bytes_max: u64) -> Memory {
        Memory {
            allocs: BTreeMap::new(),
            next_address: BASE_ADDRESS,
            backed,
            device_used_bytes: 0,
            host_used_bytes: 0,
            device_bytes_max,
            host_bytes_max,
        }
    }

    pub fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        if bytes == 0 {
            return Err(GpuError::Invalid("allocation of 0 bytes".into()));
        }
        let (used, max) = match kind {
            MemKind::Device => (self.device_used_bytes, self.device_bytes_max),
            MemKind::HostMapped => (self.host_used_bytes, self.host_bytes_max),
        };
        let rounded = bytes.next_multiple_of(ALLOC_ALIGN_BYTES);
        if used + rounded > max {
            return Err(GpuError::OutOfMemory { requested_bytes: bytes, free_bytes: max - used });
        }
        if self.backed && usize::try_from(bytes).is_err() {
            return Err(GpuError::Invalid(format!("allocation of {bytes} bytes cannot be backed on this host")));
        }
        let base = self.next_address;
        self.next_address = (base + rounded + GUARD_BYTES).next_multiple_of(ALLOC_ALIGN_BYTES);
        let data = self.backed.then(|| AlignedBytes::zeroed(bytes as usize));
        self.allocs.insert(base, Alloc { bytes, kind, data, host: None });
        match kind {
            MemKind::Device => self.device_used_bytes += rounded,
            MemKind::HostMapped => self.host_used_bytes += rounded,
        }
        Ok(Allocation { ptr: DevicePtr(base), bytes, kind })
    }

    /// Gives caller memory a synthetic address range of kind `HostMapped` (not counted against
    /// the device's host-mapped budget: the caller owns it). Returns its base address.
    pub fn map_host(&mut self, memory: Arc<dyn HostMemory>) -> Result<u64> {
        let bytes = memory.len_bytes();
        if bytes == 0 {
            return Err(GpuError::Invalid("mapping of 0 bytes".into()));
        }
        if usize::try_from(bytes).is_err() {
            return Err(GpuError::Invalid(format!("a mapping of {bytes} bytes does not fit this host's address space")));
        }
        let base = self.next_address;
        self.next_address = (base + bytes.next_multiple_of(ALLOC_ALIGN_BYTES) + GUARD_BYTES).next_multiple_of(ALLOC_ALIGN_BYTES);
        self.allocs.insert(base, Alloc { bytes, kind: MemKind::HostMapped, data: None, host: Some(memory) });
        Ok(base)
    }

    /// Removes a mapping made by [`Memory::map_host`], dropping the simulator's hold on the memory.
    pub fn unmap_host(&mut self, base: u64) -> Result<()> {
        match self.allocs.get(&base) {
            Some(a) if a.host.is_some() => {
                self.allocs.remove(&base);
                Ok(())
            }
            _ => Err(GpuError::Invalid(format!("unmap of {base:#x}: not a host mapping"))),
        }
    }

    /// Whether an allocation is a host mapping.
    pub fn is_mapping(&self, base: u64) -> bool {
        self.allocs.get(&base).is_some_and(|a| a.host.is_some())
    }

    pub fn mappings(&self) -> usize {
        self.allocs.values().filter(|a| a.host.is_some()).count()
    }

    pub fn free(&mut self, a: &Allocation) -> Result<()> {
        match self.allocs.get(&a.ptr.0) {
            Some(e) if e.bytes == a.bytes && e.kind == a.kind && e.host.is_none() => {}
            _ => return Err(GpuError::Invalid(format!("free of {:?}: not a live allocation", a.ptr))),
        }
        let e = self.allocs.remove(&a.ptr.0).unwrap();
        let rounded = e.bytes.next_multiple_of(ALLOC_ALIGN_BYTES);
        match e.kind {
            MemKind::Device => self.device_used_bytes -= rounded,
            MemKind::HostMapped => self.host_used_bytes -= rounded,
        }
        Ok(())
    }

    pub fn resolve(&self, ptr: DevicePtr) -> Option<Resolved> {
        let (&base, a) = self.allocs.range(..=ptr.0).next_back()?;
        (ptr.0 < base + a.bytes).then_some(Resolved { base, offset: ptr.0 - base, bytes: a.bytes, kind: a.kind })
    }

    /// Resolves a range `[ptr, ptr + bytes)` that must lie inside one allocation.
    pub fn resolve_range(&self, ptr: DevicePtr, bytes: u64, what: &str) -> Result<Resolved> {
        let r = self.resolve(ptr).ok_or_else(|| GpuError::Invalid(format!("{what}: {ptr:?} is not inside a live allocation")))?;
        if bytes > r.len_to_end() {
            return Err(GpuError::Invalid(format!("{what}: {bytes} bytes at {ptr:?} run past the end of its allocation")));
        }
        Ok(r)
    }

    pub fn write(&mut self, r: Resolved, data: &[u8]) {
        if let Some(d) = self.allocs.get_mut(&r.base).and_then(|a| a.data.as_mut()) {
            let o = r.offset as usize;
            d.as_mut_slice()[o..o + data.len()].copy_from_slice(data);
        }
    }

    /// Reads into `out`; unbacked memory reads as zeros.
    pub fn read(&self, r: Resolved, out: &mut [u8]) {
        match self.allocs.get(&r.base).and_then(|a| a.data.as_ref()) {
            Some(d) => {
                let o = r.offset as usize;
                out.copy_from_slice(&d.as_slice()[o..o + out.len()]);
            }
            None => out.fill(0),
        }
    }

    /// Copies bytes between (possibly the same) allocations; a no-op if either is gone or unbacked.
    pub fn copy(&mut self, dst: Resolved, src: Resolved, bytes: u64) {
        let n = bytes as usize;
        if dst.base == src.base {
            if let Some(d) = self.allocs.get_mut(&dst.base).and_then(|a| a.data.as_mut()) {
                d.as_mut_slice().copy_within(src.offset as usize..src.offset as usize + n, dst.offset as usize);
            }
            return;
        }
        let Some(src_bytes) =
            self.allocs.get(&src.base).and_then(|a| a.data.as_ref()).map(|d| d.as_slice()[src.offset as usize..][..n].to_vec())
        else {
            return;
        };
        if let Some(d) = self.allocs.get_mut(&dst.base).and_then(|a| a.data.as_mut()) {
            d.as_mut_slice()[dst.offset as usize..][..n].copy_from_slice(&src_bytes);
        }
    }

    /// Runs logical blocks `blocks` of a kernel on its arguments with the CPU reference: on the
    /// backing bytes of device and host-mapped allocations, and on staged copies of arguments in
    /// host mappings (see [`crate::hostmem`]). An error when an argument's allocation is gone or
    /// not backed (the launch ran on freed memory).
    pub fn run_kernel(&mut self, kernel: &Kernel, dtype: DType, args: &[Resolved], blocks: Range<u32>) -> Result<(), String> {
        let mut sources = Vec::with_capacity(args.len());
        let mut mapped = Vec::new();
        for (i, r) in args.iter().enumerate() {
            match self.allocs.get(&r.base) {
                Some(a) if a.host.is_some() => {
                    sources.push(ArgSource::Staged { buf: usize::MAX, offset: 0 });
                    mapped.push(i);
                }
                Some(a) if a.data.is_some() => sources.push(ArgSource::Backed(*r)),
                _ => return Err(format!("argument {i} at {:#x} is not live, backed memory", r.base + r.offset)),
            }
        }
        if mapped.is_empty() {
            let mut view = ArgView { allocs: &mut self.allocs, staged: &mut [], sources: &sources };
            kairos_kernels::cpu::run_blocks(kernel, dtype, &mut view, blocks);
            return Ok(());
        }
        // Stage every mapped argument's extent; overlapping extents of one mapping share a buffer.
        let extents = crate::hostmem::arg_extent_bytes(kernel, dtype);
        let mut ranges: Vec<(u64, u64, u64, usize)> = mapped
            .iter()
            .map(|&i| {
                let r = args[i];
                let len = extents.get(i).copied().unwrap_or(r.len_to_end()).min(r.len_to_end());
                (r.base, r.offset, r.offset + len, i)
            })
            .collect();
        ranges.sort_unstable();
        let mut staged: Vec<Staged> = Vec::new();
        for (base, start, end, i) in ranges {
            let merge = staged.last().is_some_and(|s| s.base == base && start <= s.end);
            if !merge {
                let start_aligned = start - start % ALLOC_ALIGN_BYTES;
                staged.push(Staged { base, start: start_aligned, end, bytes: AlignedBytes::zeroed(0), before: Vec::new() });
            }
            let buf = staged.len() - 1;
            let s = &mut staged[buf];
            s.end = s.end.max(end);
            sources[i] = ArgSource::Staged { buf, offset: (start - s.start) as usize };
        }
        for s in &mut staged {
            let host = self.allocs[&s.base].host.clone().expect("a mapping");
            s.bytes = AlignedBytes::zeroed((s.end - s.start) as usize);
            host.read_at(s.start, s.bytes.as_mut_slice());
            s.before = s.bytes.as_slice().to_vec();
        }
        {
            let mut bufs: Vec<AlignedBytes> =
                staged.iter_mut().map(|s| std::mem::replace(&mut s.bytes, AlignedBytes::zeroed(0))).collect();
            let mut view = ArgView { allocs: &mut self.allocs, staged: &mut bufs, sources: &sources };
            kairos_kernels::cpu::run_blocks(kernel, dtype, &mut view, blocks);
            for (s, b) in staged.iter_mut().zip(bufs) {
                s.bytes = b;
            }
        }
        // Write back what the kernel changed, run by run: bytes it did not write stay the
        // caller's, even if the caller changed them meanwhile.
        for s in &staged {
            let host = self.allocs[&s.base].host.clone().expect("a mapping");
            let (now, before) = (s.bytes.as_slice(), s.before.as_slice());
            let mut k = 0;
            while k < now.len() {
                if now[k] == before[k] {
                    k += 1;
                    continue;
                }
                let run_start = k;
                while k < now.len() && now[k] != before[k] {
                    k += 1;
                }
                host.write_at(s.start + run_start as u64, &now[run_start..k]);
            }
        }
        Ok(())
    }
}

/// A staged range `[start, end)` of one host mapping (at `base`).
struct Staged {
    base: u64,
    start: u64,
    end: u64,
    bytes: AlignedBytes,
    /// The bytes as read, to find what the kernel wrote.
    before: Vec<u8>,
}

#[derive(Clone, Copy)]
enum ArgSource {
    Backed(Resolved),
    Staged { buf: usize, offset: usize },
}

/// The memory a CPU reference kernel runs on: argument i starts at its address and ends at the end
/// of its allocation (device or host-mapped backing) or of its staged range (host mappings).
struct ArgView<'a> {
    allocs: &'a mut BTreeMap<u64, Alloc>,
    staged: &'a mut [AlignedBytes],
    sources: &'a [ArgSource],
}

impl KernelMemory for ArgView<'_> {
    fn arg(&self, i: usize) -> &[u8] {
        match self.sources[i] {
            ArgSource::Backed(r) => {
                &self.allocs[&r.base].data.as_ref().expect("checked in run_kernel").as_slice()[r.offset as usize..]
            }
            ArgSource::Staged { buf, offset } => &self.staged[buf].as_slice()[offset..],
        }
    }

    fn arg_mut(&mut self, i: usize) -> &mut [u8] {
        match self.sources[i] {
            ArgSource::Backed(r) => &mut self
                .allocs
                .get_mut(&r.base)
                .expect("checked in run_kernel")
                .data
                .as_mut()
                .expect("checked in run_kernel")
                .as_mut_slice()[r.offset as usize..],
            ArgSource::Staged { buf, offset } => &mut self.staged[buf].as_mut_slice()[offset..],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_resolve_inside_their_allocation_only() {
        let mut m = Memory::new(true, 1 << 20, 1 << 20);
        let a = m.alloc(1000, MemKind::Device).unwrap();
        let b = m.alloc(10, MemKind::HostMapped).unwrap();
        assert_eq!(m.resolve(a.ptr.offset(999)).unwrap().offset, 999);
        assert!(m.resolve(a.ptr.offset(1000)).is_none(), "one past the end is in the guard gap");
        assert_eq!(m.resolve(b.ptr).unwrap().kind, MemKind::HostMapped);
        assert!(m.resolve_range(a.ptr.offset(10), 991, "x").is_err());
        assert!(m.resolve_range(a.ptr.offset(10), 990, "x").is_ok());
        m.free(&a).unwrap();
        assert!(m.resolve(a.ptr).is_none());
        assert!(m.free(&a).is_err(), "double free is an error");
    }

    #[test]
    fn running_out_of_memory_is_an_error_with_the_numbers() {
        let mut m = Memory::new(false, 4096, 0);
        m.alloc(4000, MemKind::Device).unwrap();
        match m.alloc(512, MemKind::Device) {
            Err(GpuError::OutOfMemory { requested_bytes: 512, free_bytes: 0 }) => {}
            other => panic!("{other:?}"),
        }
        assert!(m.alloc(1, MemKind::HostMapped).is_err());
    }

    #[test]
    fn copies_move_bytes_within_and_across_allocations() {
        let mut m = Memory::new(true, 1 << 20, 1 << 20);
        let a = m.alloc(16, MemKind::HostMapped).unwrap();
        let b = m.alloc(16, MemKind::Device).unwrap();
        let ra = m.resolve(a.ptr).unwrap();
        m.write(ra, &(0u8..16).collect::<Vec<_>>());
        m.copy(m.resolve(b.ptr.offset(4)).unwrap(), m.resolve(a.ptr).unwrap(), 8);
        m.copy(m.resolve(a.ptr).unwrap(), m.resolve(a.ptr.offset(8)).unwrap(), 8);
        let mut out = [0u8; 16];
        m.read(m.resolve(b.ptr).unwrap(), &mut out);
        assert_eq!(out, [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0]);
        m.read(m.resolve(a.ptr).unwrap(), &mut out);
        assert_eq!(&out[..8], &[8, 9, 10, 11, 12, 13, 14, 15]);
    }
}

//! Caller memory mapped into the device (`Gpu::map_host`): zero-copy inputs and outputs.
//!
//! A caller lends memory it owns (the shared-memory channel's region) as a
//! [`kairos_gpu::HostMemory`] whose [`pinnable`](kairos_gpu::HostMemory::pinnable) range the
//! driver page-locks and maps into the device's address space (`cuMemHostRegister` with
//! `DEVICEMAP | PORTABLE`, then `cuMemHostGetDevicePointer`); kernels then read and write it over
//! PCIe, as they read mapped weights (DeepPlan's direct host access).
//!
//! Guarantees:
//! - The memory stays registered, and its owner alive (the mapping holds its `Arc`), until
//!   `unmap_host`, which refuses while a launch with an argument in it has not reported
//!   `LaunchDone` (its CTAs have then finished every block and fenced their writes).
//! - Launches with an argument in a mapping carry `FLAG_FENCE_SYSTEM`: their CTAs fence at system
//!   scope before counting as done, so the host sees their writes no later than their
//!   `LaunchDone` (without it, a write could still be in flight over PCIe when the notification
//!   lands).
//! - A range is registered once per process however many GPUs map it (registrations are
//!   process-wide with `PORTABLE`): a reference-counted registry registers it for the first
//!   mapping and unregisters it after the last.
//!
//! Layers as in the rest of the crate: the result layer (one checked wrapper per driver call,
//! `unsafe` with its contract), the process-wide registry, then [`HostMaps`], which `CudaGpu`
//! owns. [`PageBuffer`] is page-aligned memory of this process that can be mapped (tests,
//! in-process callers).

use crate::driver::{CUdeviceptr, DResult, DriverError};
use cudarc::driver::sys;
use kairos_gpu::{DevicePtr, GpuError, HostMapping, HostMappingId, HostMemory, HostRange, LaunchId, Result};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Ranges must start and end on this boundary (the smallest host page).
pub const HOST_MAP_PAGE_BYTES: usize = 4096;
/// Kernel arguments in a mapping must start at this alignment: what `cuMemAlloc` guarantees, and
/// so what the kernels were written and tested against.
pub const HOST_MAP_ALIGN_BYTES: u64 = 256;
/// Mappings one `CudaGpu` holds at once.
pub const HOST_MAPS_MAX: usize = 1024;
/// Launches using a mapping remembered before the finished ones are pruned.
const USERS_PRUNE_AT: usize = 4096;

fn check(call: &'static str, code: sys::CUresult) -> DResult<()> {
    if code == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(DriverError { call, code }) }
}

// ------------------------------------------------------------------ result layer

/// Page-locks `[host, host + bytes)` and maps it into the address space of every context
/// (`CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE`).
///
/// # Safety
/// 1. The range is memory of this process, readable and writable, that stays allocated and mapped
///    at this address until [`mem_host_unregister`] of `host` has returned.
/// 2. A context is current on the calling thread.
pub unsafe fn mem_host_register(host: *mut u8, bytes: usize) -> DResult<()> {
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: contracts 1 and 2; the driver rejects a range that overlaps a registered one
    // (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) rather than touching it.
    check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(host as *mut c_void, bytes, flags) })
}

/// Unmaps and unlocks a range registered by [`mem_host_register`].
///
/// # Safety
/// 1. `host` is the start of a range registered by [`mem_host_register`] and not unregistered.
/// 2. No kernel that may still access the range is running or queued on any context.
/// 3. A context is current on the calling thread.
pub unsafe fn mem_host_unregister(host: *mut u8) -> DResult<()> {
    // SAFETY: contracts 1-3.
    check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(host as *mut c_void) })
}

/// The device address of a registered host byte, in the current context.
///
/// # Safety
/// 1. `host` lies in a range registered by [`mem_host_register`] and not unregistered.
/// 2. A context is current on the calling thread.
pub unsafe fn mem_host_registered_device_pointer(host: *mut u8) -> DResult<CUdeviceptr> {
    let mut d = 0;
    // SAFETY: contracts 1 and 2; the out-pointer is a live local; flags must be 0.
    check("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host as *mut c_void, 0) })?;
    Ok(d)
}

// ------------------------------------------------------------------ process-wide registry

/// Registered ranges: start address -> (length, mappings using it).
static REGISTRY: Mutex<BTreeMap<usize, (usize, u32)>> = Mutex::new(BTreeMap::new());

/// Registers a range for one more mapping (the driver call happens for the first one only).
///
/// # Safety
/// 1. As [`mem_host_register`] 1, until the matching [`release`] returned.
/// 2. A context is current on the calling thread.
unsafe fn acquire(addr: usize, bytes: usize) -> Result<()> {
    let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((len, users)) = reg.get_mut(&addr) {
        if *len != bytes {
            return Err(GpuError::Invalid(format!(
                "host range {addr:#x}+{bytes} overlaps the mapped range {addr:#x}+{len} of another owner"
            )));
        }
        *users += 1;
        return Ok(());
    }
    let overlaps = reg.range(..addr + bytes).next_back().is_some_and(|(&a, &(l, _))| a + l > addr);
    if overlaps {
        return Err(GpuError::Invalid(format!("host range {addr:#x}+{bytes} overlaps a range already mapped")));
    }
    // SAFETY: contracts 1 and 2 of this function are those of the call.
    unsafe { mem_host_register(addr as *mut u8, bytes) }.map_err(|e| GpuError::Driver(e.to_string()))?;
    reg.insert(addr, (bytes, 1));
    Ok(())
}

/// Gives back one mapping's hold on a range; the last one unregisters it.
///
/// # Safety
/// 1. Matches an [`acquire`] of the same range that succeeded.
/// 2. If this is the last hold: no kernel that may still access the range runs or is queued.
/// 3. A context is current on the calling thread.
unsafe fn release(addr: usize) -> Result<()> {
    let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_, users)) = reg.get_mut(&addr) else {
        return Err(GpuError::Invalid(format!("host range {addr:#x} is not registered")));
    };
    *users -= 1;
    if *users > 0 {
        return Ok(());
    }
    reg.remove(&addr);
    // SAFETY: the range was registered by `acquire` (1) and nothing uses it any more (2, 3).
    unsafe { mem_host_unregister(addr as *mut u8) }.map_err(|e| GpuError::Driver(e.to_string()))
}

// ------------------------------------------------------------------ per-GPU mappings

struct Mapped {
    id: HostMappingId,
    dev: u64,
    bytes: u64,
    host_addr: usize,
    /// Keeps the memory's owner, and so the range (the `HostRange` contract), alive.
    _memory: Arc<dyn HostMemory>,
}

/// The mappings of one `CudaGpu`.
#[derive(Default)]
pub struct HostMaps {
    /// By device address of the first byte (and id: the same memory may be mapped twice).
    maps: BTreeMap<(u64, u64), Mapped>,
    next_id: u64,
    /// Launches issued with an argument in a mapping, and the mapping (pruned as they finish).
    users: Vec<(LaunchId, HostMappingId)>,
}

impl HostMaps {
    /// Registers `memory`'s range (see the module docs) and maps it into the current context.
    /// The caller has bound its context.
    pub fn map(&mut self, memory: Arc<dyn HostMemory>) -> Result<HostMapping> {
        if self.maps.len() >= HOST_MAPS_MAX {
            return Err(GpuError::Exhausted { limit: "host mappings", max: HOST_MAPS_MAX as u64 });
        }
        let (addr, bytes) = {
            let range: HostRange<'_> = memory.pinnable().ok_or_else(|| {
                GpuError::Unsupported("this memory does not expose an address range the driver could page-lock".into())
            })?;
            (range.addr(), range.len())
        };
        if bytes as u64 != memory.len_bytes() {
            return Err(GpuError::Invalid(format!(
                "a pinnable range of {bytes} bytes for memory of {} bytes",
                memory.len_bytes()
            )));
        }
        if bytes == 0 || !addr.is_multiple_of(HOST_MAP_PAGE_BYTES) || !bytes.is_multiple_of(HOST_MAP_PAGE_BYTES) {
            return Err(GpuError::Invalid(format!(
                "host range {addr:#x}+{bytes} is empty or not on {HOST_MAP_PAGE_BYTES}-byte pages"
            )));
        }
        // SAFETY: `memory.pinnable()` promised (HostRange::new's contract) that the range stays
        // valid for as long as `memory` lives, and `Mapped` holds `memory` until after `release`;
        // the caller bound this GPU's context.
        unsafe { acquire(addr, bytes) }?;
        // SAFETY: the range was just registered; the context is current.
        let dev = match unsafe { mem_host_registered_device_pointer(addr as *mut u8) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: matches the acquire above; no kernel has seen the range through this
                // mapping.
                let _ = unsafe { release(addr) };
                return Err(GpuError::Driver(e.to_string()));
            }
        };
        self.next_id += 1;
        let id = HostMappingId(self.next_id);
        self.maps.insert((dev, id.0), Mapped { id, dev, bytes: bytes as u64, host_addr: addr, _memory: memory });
        Ok(HostMapping { id, ptr: DevicePtr(dev), bytes: bytes as u64, align_bytes: HOST_MAP_ALIGN_BYTES })
    }

    /// The mapping a device address lies in.
    fn find(&self, p: u64) -> Option<&Mapped> {
        self.maps.range(..=(p, u64::MAX)).next_back().map(|(_, m)| m).filter(|m| p < m.dev + m.bytes)
    }

    /// `FLAG_FENCE_SYSTEM` when an argument lies in a mapping (the launch may write host memory),
    /// else 0.
    pub fn fence_flags(&self, args: &[DevicePtr]) -> u32 {
        if !self.maps.is_empty() && args.iter().any(|a| self.find(a.0).is_some()) {
            kairos_kernels::source::FLAG_FENCE_SYSTEM
        } else {
            0
        }
    }

    /// Remembers that `launch` uses the mappings its arguments lie in, until it is done
    /// (`in_flight` says which launches still are).
    pub fn note_launch(&mut self, launch: LaunchId, args: &[DevicePtr], in_flight: impl Fn(LaunchId) -> bool) {
        for a in args {
            // Every mapping the address lies in: the same memory may be mapped more than once
            // (same device address), and unmapping any of them must wait for this launch.
            for m in self.maps.values().filter(|m| m.dev <= a.0 && a.0 < m.dev + m.bytes) {
                if !self.users.contains(&(launch, m.id)) {
                    self.users.push((launch, m.id));
                }
            }
        }
        if self.users.len() >= USERS_PRUNE_AT {
            self.users.retain(|(l, _)| in_flight(*l));
        }
    }

    /// Removes a mapping, unless a launch that uses it is still in flight. The caller has bound
    /// its context.
    pub fn unmap(&mut self, id: HostMappingId, in_flight: impl Fn(LaunchId) -> bool) -> Result<()> {
        let Some(key) = self.maps.values().find(|m| m.id == id).map(|m| (m.dev, m.id.0)) else {
            return Err(GpuError::Invalid(format!("host mapping {} is not mapped", id.0)));
        };
        self.users.retain(|(l, _)| in_flight(*l));
        if let Some((l, _)) = self.users.iter().find(|(_, m)| *m == id) {
            return Err(GpuError::Invalid(format!("unmap of host mapping {} while launch {} uses it", id.0, l.0)));
        }
        let m = self.maps.remove(&key).expect("found above");
        // SAFETY: matches the acquire of `map`; every launch that used this mapping reported
        // LaunchDone (checked above), after which its CTAs touch no argument memory; the caller
        // bound the context. `m` (and the memory's owner) drops after the range is released.
        unsafe { release(m.host_addr) }
    }

    pub fn len(&self) -> usize {
        self.maps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

impl Drop for HostMaps {
    fn drop(&mut self) {
        // CudaGpu's Drop binds its context and synchronizes every stream before its fields drop,
        // so no kernel uses these ranges any more.
        for (_, m) in std::mem::take(&mut self.maps) {
            // SAFETY: matches the acquire of `map`; the device is idle and the context current
            // (see above).
            let _ = unsafe { release(m.host_addr) };
        }
    }
}

// ------------------------------------------------------------------ page-aligned host memory

/// Zeroed, page-aligned memory of this process that a GPU can map ([`HostMemory`] with a
/// pinnable range): for tests and in-process callers of zero-copy requests.
pub struct PageBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the buffer is plain memory owned by this value; every access goes through raw-pointer
// copies (never references), so sharing it between threads (and with a device) races on bytes at
// worst, which every bit pattern of u8 tolerates.
unsafe impl Send for PageBuffer {}
// SAFETY: as above.
unsafe impl Sync for PageBuffer {}

impl std::fmt::Debug for PageBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageBuffer({} bytes at {:p})", self.bytes, self.ptr)
    }
}

impl PageBuffer {
    fn layout(bytes: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(bytes, HOST_MAP_PAGE_BYTES).expect("page-aligned layout")
    }

    /// `bytes` rounded up to whole pages, zeroed.
    pub fn new(bytes: usize) -> PageBuffer {
        let bytes = bytes.max(1).next_multiple_of(HOST_MAP_PAGE_BYTES);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(Self::layout(bytes)) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(bytes)));
        PageBuffer { ptr, bytes }
    }

    fn check(&self, offset: u64, len: usize) -> usize {
        let end = offset.checked_add(len as u64).expect("offset overflows");
        assert!(end <= self.bytes as u64, "bytes {offset}..{end} outside a buffer of {} bytes", self.bytes);
        offset as usize
    }
}

impl HostMemory for PageBuffer {
    fn len_bytes(&self) -> u64 {
        self.bytes as u64
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) {
        let o = self.check(offset, out.len());
        // SAFETY: the range is inside the allocation (checked); `out` is a distinct slice of
        // ordinary memory; bytes a device writes meanwhile arrive whole or not at all per byte.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(o), out.as_mut_ptr(), out.len()) }
    }

    fn write_at(&self, offset: u64, data: &[u8]) {
        let o = self.check(offset, data.len());
        // SAFETY: as in read_at.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(o), data.len()) }
    }

    fn pinnable(&self) -> Option<HostRange<'_>> {
        // SAFETY: the allocation is ours, readable and writable, and is freed only in Drop, which
        // cannot run while `&self` (and so the returned range) is alive; we hand out no
        // references into it, only copies.
        Some(unsafe { HostRange::new(self.ptr.as_ptr() as usize, self.bytes) })
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.bytes)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_buffers_are_aligned_and_bounds_checked() {
        let b = PageBuffer::new(5000);
        assert_eq!(b.len_bytes(), 8192);
        let r = b.pinnable().unwrap();
        assert_eq!(r.addr() % HOST_MAP_PAGE_BYTES, 0);
        assert_eq!(r.len(), 8192);
        b.write_at(8190, &[1, 2]);
        let mut out = [0u8; 3];
        b.read_at(8189, &mut out);
        assert_eq!(out, [0, 1, 2]);
        assert!(std::panic::catch_unwind(|| b.read_at(8190, &mut [0u8; 3])).is_err());
    }

    #[test]
    fn fence_flags_follow_the_mappings() {
        // No driver here: only the bookkeeping without a registered range.
        let maps = HostMaps::default();
        assert_eq!(maps.fence_flags(&[DevicePtr(0x1000)]), 0);
        assert!(maps.is_empty());
    }
}

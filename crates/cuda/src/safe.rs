//! The safe layer: owning wrappers over driver objects that free them on drop.
//!
//! Every object here belongs to the primary context that [`Context`] retains; the owner of a
//! `Context` (the `CudaGpu`) keeps it alive until every other object is dropped, and binds it to
//! the calling thread before using them.

use crate::driver::{
    self, CUdevResource, CUdevice, CUdeviceptr, CUevent, CUfunction, CUfunction_attribute, CUgreenCtx, CUmodule,
};
use crate::driver::{CUstream, DResult};
use std::ffi::{CString, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

/// The device's primary context, retained for the life of this value.
pub struct Context {
    dev: CUdevice,
    ctx: driver::CUcontext,
}

impl Context {
    pub fn new(dev: CUdevice) -> DResult<Context> {
        let ctx = driver::primary_ctx_retain(dev)?;
        let c = Context { dev, ctx };
        c.bind()?;
        Ok(c)
    }

    pub fn device(&self) -> CUdevice {
        self.dev
    }

    /// The raw handle (for threads that make it current themselves; it stays valid while self lives).
    pub fn raw(&self) -> driver::CUcontext {
        self.ctx
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> DResult<()> {
        // SAFETY: self.ctx stays retained while self lives.
        unsafe { driver::ctx_set_current(self.ctx) }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: one release for the one retain in new(); the owner drops every object of the
        // context before this (field order in CudaGpu).
        let _ = unsafe { driver::primary_ctx_release(self.dev) };
    }
}

/// Device memory.
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: u64,
}

impl DeviceBuffer {
    pub fn new(bytes: u64) -> DResult<DeviceBuffer> {
        Ok(DeviceBuffer { ptr: driver::mem_alloc(bytes.max(1))?, bytes })
    }

    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Sets every byte (synchronous).
    pub fn fill(&self, value: u8) -> DResult<()> {
        // SAFETY: the whole range is this live allocation.
        unsafe { driver::memset_d8(self.ptr, value, self.bytes) }
    }

    /// Synchronous copy into the buffer at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> DResult<()> {
        assert!(offset + data.len() as u64 <= self.bytes, "write past the end of a device buffer");
        // SAFETY: the range was checked to lie inside this live allocation.
        unsafe { driver::memcpy_htod(self.ptr + offset, data) }
    }

    /// Copy into the buffer at `offset` through `stream`, complete when it returns (see
    /// [`driver::memcpy_htod_complete`]: `write` may leave the DMA in flight).
    pub fn write_complete(&self, offset: u64, data: &[u8], stream: &Stream) -> DResult<()> {
        assert!(offset + data.len() as u64 <= self.bytes, "write past the end of a device buffer");
        // SAFETY: the range was checked to lie inside this live allocation; the stream is live
        // (borrowed) and the caller keeps long work off it.
        unsafe { driver::memcpy_htod_complete(self.ptr + offset, data, stream.raw) }
    }

    /// Synchronous copy out of the buffer at `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> DResult<()> {
        assert!(offset + out.len() as u64 <= self.bytes, "read past the end of a device buffer");
        // SAFETY: the range was checked to lie inside this live allocation.
        unsafe { driver::memcpy_dtoh(out, self.ptr + offset) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in new(), freed once here; no launch using it outlives its owner
        // (the CudaGpu synchronizes its streams before dropping buffers).
        let _ = unsafe { driver::mem_free(self.ptr) };
    }
}

/// Pinned host memory mapped into the device's address space. The host reads and writes it
/// directly; kernels reach it through [`MappedBuffer::dev_ptr`] over PCIe.
pub struct MappedBuffer {
    host: NonNull<u8>,
    dev: CUdeviceptr,
    bytes: u64,
}

impl MappedBuffer {
    /// Allocates and zeroes `bytes` of mapped pinned memory.
    pub fn new(bytes: u64) -> DResult<MappedBuffer> {
        let host = driver::mem_host_alloc_mapped(bytes.max(1))?;
        let host = NonNull::new(host).expect("cuMemHostAlloc returned success and a null pointer");
        // Owned from here on: an error below frees it through Drop.
        let mut b = MappedBuffer { host, dev: 0, bytes };
        // SAFETY: the allocation is bytes.max(1) long and not yet shared with the device.
        unsafe { std::ptr::write_bytes(host.as_ptr(), 0, bytes as usize) };
        // SAFETY: host points into the live allocation just made.
        b.dev = unsafe { driver::mem_host_device_pointer(host.as_ptr()) }?;
        Ok(b)
    }

    pub fn dev_ptr(&self) -> CUdeviceptr {
        self.dev
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn check<T>(&self, offset: u64) -> *mut T {
        let size = std::mem::size_of::<T>() as u64;
        assert!(
            offset + size <= self.bytes && offset.is_multiple_of(size),
            "mapped access at {offset} out of range or misaligned"
        );
        // SAFETY: offset + size is inside the allocation (checked above).
        unsafe { self.host.as_ptr().add(offset as usize) as *mut T }
    }

    /// Volatile load of a word the device may write at any time.
    pub fn load_u32(&self, offset: u64) -> u32 {
        // SAFETY: in range and aligned (checked); volatile, because the device writes it
        // concurrently; every bit pattern is a valid u32.
        unsafe { std::ptr::read_volatile(self.check::<u32>(offset)) }
    }

    pub fn load_u64(&self, offset: u64) -> u64 {
        // SAFETY: as in load_u32.
        unsafe { std::ptr::read_volatile(self.check::<u64>(offset)) }
    }

    /// Volatile store of a word the device may read at any time.
    pub fn store_u32(&self, offset: u64, v: u32) {
        // SAFETY: in range and aligned (checked); volatile, because the device reads it concurrently.
        unsafe { std::ptr::write_volatile(self.check::<u32>(offset), v) }
    }

    pub fn store_u64(&self, offset: u64, v: u64) {
        // SAFETY: as in store_u32.
        unsafe { std::ptr::write_volatile(self.check::<u64>(offset), v) }
    }

    /// Copies bytes in.
    ///
    /// # Safety
    /// 1. No kernel reads or writes `[offset, offset + data.len())` while the copy runs.
    pub unsafe fn write_bytes(&self, offset: u64, data: &[u8]) {
        assert!(offset + data.len() as u64 <= self.bytes, "write past the end of a mapped buffer");
        // SAFETY: the range is inside the allocation (checked) and no device access races with
        // it (contract 1); the source is a live slice that cannot overlap pinned memory we own.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.host.as_ptr().add(offset as usize), data.len()) }
    }

    /// Copies bytes out.
    ///
    /// # Safety
    /// 1. No kernel writes `[offset, offset + out.len())` while the copy runs.
    pub unsafe fn read_bytes(&self, offset: u64, out: &mut [u8]) {
        assert!(offset + out.len() as u64 <= self.bytes, "read past the end of a mapped buffer");
        // SAFETY: in range (checked), no concurrent device write (contract 1), disjoint buffers.
        unsafe { std::ptr::copy_nonoverlapping(self.host.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) }
    }
}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in new(), freed once here; its owner synchronizes the device first.
        let _ = unsafe { driver::mem_free_host(self.host.as_ptr()) };
    }
}

/// A non-blocking stream (of the primary context or of a green context).
pub struct Stream {
    raw: CUstream,
}

impl Stream {
    pub fn new(priority: i32) -> DResult<Stream> {
        Ok(Stream { raw: driver::stream_create(priority)? })
    }

    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// True when everything queued so far has completed.
    pub fn is_idle(&self) -> DResult<bool> {
        // SAFETY: self.raw is live while self lives.
        unsafe { driver::stream_query(self.raw) }
    }

    pub fn synchronize(&self) -> DResult<()> {
        // SAFETY: as above.
        unsafe { driver::stream_synchronize(self.raw) }
    }

    /// Later work on this stream waits for the event's last record.
    pub fn wait(&self, event: &Event) -> DResult<()> {
        // SAFETY: both handles are live while their owners live.
        unsafe { driver::stream_wait_event(self.raw, event.raw) }
    }

    /// Starts recording this stream's work into a graph (nothing queued runs until
    /// [`Stream::end_capture`]); only this thread's calls on the stream are captured.
    pub fn begin_capture(&self) -> DResult<()> {
        // SAFETY: the stream is live and is one of ours (never the legacy default stream); a stream
        // already capturing makes the driver return an error.
        unsafe { driver::stream_begin_capture(self.raw) }
    }

    /// Ends the capture and instantiates what it recorded.
    pub fn end_capture(&self) -> DResult<Graph> {
        // SAFETY: live stream; a stream that is not capturing makes the driver return an error.
        let graph = unsafe { driver::stream_end_capture(self.raw) }?;
        // SAFETY: `graph` was just returned by the driver and is live; on failure it is destroyed
        // here and not used again.
        let nodes = unsafe { driver::graph_node_count(graph) }.and_then(|n| {
            // SAFETY: as above.
            unsafe { driver::graph_instantiate(graph) }.map(|exec| (n, exec))
        });
        match nodes {
            Ok((nodes, exec)) => Ok(Graph { graph, exec, nodes }),
            Err(e) => {
                // SAFETY: as above; not used after this.
                let _ = unsafe { driver::graph_destroy(graph) };
                Err(e)
            }
        }
    }

    /// Asynchronous copy between device addresses (device or mapped host memory).
    ///
    /// # Safety
    /// 1. Both ranges lie inside allocations that stay alive until the copy completes.
    pub unsafe fn copy(&self, dst: CUdeviceptr, src: CUdeviceptr, bytes: u64) -> DResult<()> {
        // SAFETY: contract 1; the stream is live.
        unsafe { driver::memcpy_async(dst, src, bytes, self.raw) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once; queued work still completes (driver semantics).
        let _ = unsafe { driver::stream_destroy(self.raw) };
    }
}

/// A captured CUDA graph and its executable instance (see [`Stream::begin_capture`]).
pub struct Graph {
    graph: driver::CUgraph,
    exec: driver::CUgraphExec,
    nodes: usize,
}

impl Graph {
    /// Its node count (one per captured launch or copy).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The executable instance's handle (for a launcher thread to launch; this Graph must outlive
    /// that launch).
    pub fn raw_exec(&self) -> driver::CUgraphExec {
        self.exec
    }

    /// Makes the kernel nodes that run `old` run `new` in the runs queued from now on (runs
    /// already queued keep `old`); returns how many nodes changed.
    ///
    /// # Safety
    /// 1. `new` is a live function with the same parameters as `old`, in this graph's context, and
    ///    its module outlives every later run of this graph.
    /// 2. No other thread queues a run of this graph during the call.
    pub unsafe fn replace_function(&self, old: driver::CUfunction, new: driver::CUfunction) -> DResult<usize> {
        let mut changed = 0;
        // SAFETY: the graph is live while self is.
        for node in unsafe { driver::graph_nodes(self.graph) }? {
            // SAFETY: `node` is a node of our live graph; its parameters are used right away,
            // before anything changes the node.
            let Some(mut p) = unsafe { driver::graph_kernel_node_params(node) }? else { continue };
            if p.func != old {
                continue;
            }
            p.func = new;
            p.kern = std::ptr::null_mut();
            // SAFETY: the exec was instantiated from this graph (Stream::end_capture); contracts
            // 1 and 2; `p` is the node's own parameters with only the function changed.
            unsafe { driver::graph_exec_kernel_node_set_params(self.exec, node, &p) }?;
            changed += 1;
        }
        Ok(changed)
    }

    /// Queues one run of the graph on `stream`.
    ///
    /// # Safety
    /// 1. Every buffer the captured kernels use (and each kernel's module) outlives the run.
    pub unsafe fn launch(&self, stream: &Stream) -> DResult<()> {
        // SAFETY: contract 1; both handles are live while their owners live.
        unsafe { driver::graph_launch(self.exec, stream.raw) }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both created by Stream::end_capture and destroyed once here; a run still in flight
        // completes and the driver frees the instance after it (cuGraphExecDestroy's contract).
        unsafe {
            let _ = driver::graph_exec_destroy(self.exec);
            let _ = driver::graph_destroy(self.graph);
        }
    }
}

pub struct Event {
    raw: CUevent,
}

impl Event {
    pub fn new(timing: bool) -> DResult<Event> {
        Ok(Event { raw: driver::event_create(timing)? })
    }

    pub fn record(&self, stream: &Stream) -> DResult<()> {
        // SAFETY: both handles are live.
        unsafe { driver::event_record(self.raw, stream.raw) }
    }

    pub fn is_done(&self) -> DResult<bool> {
        // SAFETY: live handle.
        unsafe { driver::event_query(self.raw) }
    }

    pub fn synchronize(&self) -> DResult<()> {
        // SAFETY: live handle.
        unsafe { driver::event_synchronize(self.raw) }
    }

    /// Milliseconds from `start` to `self`; both must have been created with timing and completed.
    pub fn elapsed_ms_since(&self, start: &Event) -> DResult<f32> {
        // SAFETY: live handles; the driver reports an error status (not UB) for events that were
        // not recorded, not completed or lack timing.
        unsafe { driver::event_elapsed_ms(start.raw, self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once.
        let _ = unsafe { driver::event_destroy(self.raw) };
    }
}

/// A loaded module; functions keep it alive through an `Arc`.
pub struct Module {
    raw: CUmodule,
}

impl Module {
    pub fn load(image: &[u8]) -> DResult<Arc<Module>> {
        Ok(Arc::new(Module { raw: driver::module_load_data(image)? }))
    }

    pub fn function(self: &Arc<Module>, name: &str) -> DResult<Function> {
        let c = CString::new(name).expect("function names have no NUL");
        // SAFETY: the module is live (we hold it).
        let raw = unsafe { driver::module_get_function(self.raw, &c) }?;
        Ok(Function { raw, _module: Arc::clone(self) })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: last reference gone, so no Function of it remains.
        let _ = unsafe { driver::module_unload(self.raw) };
    }
}

// SAFETY: a CUmodule is a process-wide driver handle and the driver API is thread-safe; every
// use happens with the owning context current (CudaGpu binds it on each call), and unloading
// happens once, when the last Arc goes.
unsafe impl Send for Module {}
// SAFETY: as above; &Module only looks functions up, which the driver serializes itself.
unsafe impl Sync for Module {}

/// A kernel function; holds its module alive.
#[derive(Clone)]
pub struct Function {
    raw: CUfunction,
    _module: Arc<Module>,
}

impl Function {
    /// The raw handle (valid while the module lives: as long as this value, or its CudaGpu).
    pub fn raw(&self) -> CUfunction {
        self.raw
    }
}

// SAFETY: a CUfunction is a driver handle usable from any thread with its context current; the
// module it belongs to is kept alive by the Arc beside it.
unsafe impl Send for Function {}
// SAFETY: attribute queries and launches through &Function are thread-safe driver calls.
unsafe impl Sync for Function {}

impl Function {
    pub fn attribute(&self, attr: CUfunction_attribute) -> DResult<i32> {
        // SAFETY: the module is alive while self lives.
        unsafe { driver::func_get_attribute(self.raw, attr) }
    }

    pub fn set_attribute(&self, attr: CUfunction_attribute, value: i32) -> DResult<()> {
        // SAFETY: the module is alive while self lives.
        unsafe { driver::func_set_attribute(self.raw, attr, value) }
    }

    pub fn registers(&self) -> DResult<u32> {
        Ok(self.attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)? as u32)
    }

    pub fn static_shared_bytes(&self) -> DResult<u32> {
        Ok(self.attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)? as u32)
    }

    pub fn threads_max(&self) -> DResult<u32> {
        Ok(self.attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32)
    }

    pub fn occupancy(&self, threads: u32, dynamic_smem_bytes: u32) -> DResult<u32> {
        // SAFETY: the module is alive while self lives.
        unsafe { driver::occupancy_max_active_blocks(self.raw, threads, dynamic_smem_bytes) }
    }

    /// Launches a 1-D grid. `params` are the kernel's parameters, each as its bytes.
    ///
    /// # Safety
    /// 1. `params` match the kernel's parameter list in number, order and size.
    /// 2. Every device address inside them stays valid, and its memory is not freed, until the
    ///    kernel has finished.
    ///
    /// More `dynamic_smem_bytes` than the function's MAX_DYNAMIC_SHARED_SIZE_BYTES attribute
    /// allows is a driver error, not undefined behaviour.
    pub unsafe fn launch(
        &self,
        grid: u32,
        block: u32,
        dynamic_smem_bytes: u32,
        stream: &Stream,
        params: &[&[u8]],
    ) -> DResult<()> {
        let mut ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
        // SAFETY: the function's module and the stream are live; ptrs point to live parameter
        // buffers of the right sizes (contract 1) that the driver copies during the call;
        // addresses inside stay valid (contract 2); the driver checks the shared memory size.
        unsafe { driver::launch_kernel(self.raw, grid, block, dynamic_smem_bytes, stream.raw, &mut ptrs) }
    }

    /// [`launch`](Self::launch) as thread-block clusters of `cluster_ctas` CTAs (`grid` a multiple
    /// of it), each cluster on one GPC (sm_90+).
    ///
    /// # Safety
    /// As [`launch`](Self::launch).
    pub unsafe fn launch_clustered(
        &self,
        grid: u32,
        block: u32,
        cluster_ctas: u32,
        dynamic_smem_bytes: u32,
        stream: &Stream,
        params: &[&[u8]],
    ) -> DResult<()> {
        let mut ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
        // SAFETY: as in `launch`: live function and stream, parameter buffers of the right sizes
        // (contract 1), device addresses valid until the kernel ends (contract 2).
        unsafe { driver::launch_kernel_clustered(self.raw, grid, block, cluster_ctas, dynamic_smem_bytes, stream.raw, &mut ptrs) }
    }

    /// [`launch`](Self::launch) as a programmatic dependent launch: the kernel's CTAs may start
    /// while the previous kernel on `stream` finishes; the kernel executes `griddepcontrol.wait`
    /// before touching anything that kernel wrote (every kernel of the library does, in the
    /// protocol).
    ///
    /// # Safety
    /// As [`launch`](Self::launch), and the kernel waits as said above.
    pub unsafe fn launch_overlapped(
        &self,
        grid: u32,
        block: u32,
        dynamic_smem_bytes: u32,
        stream: &Stream,
        params: &[&[u8]],
    ) -> DResult<()> {
        let mut ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
        // SAFETY: as in launch; the kernel's wait (contract) orders its reads after the previous
        // kernel's writes.
        unsafe { driver::launch_kernel_overlapped(self.raw, grid, block, dynamic_smem_bytes, stream.raw, &mut ptrs) }
    }
}

/// A green context: a hardware partition of the device's SMs.
pub struct GreenContext {
    raw: CUgreenCtx,
}

impl GreenContext {
    pub fn new(dev: CUdevice, resource: &CUdevResource) -> DResult<GreenContext> {
        Self::from_resources(dev, std::slice::from_ref(resource))
    }

    /// One green context over the union of several SM resources (groups of one split).
    pub fn from_resources(dev: CUdevice, resources: &[CUdevResource]) -> DResult<GreenContext> {
        Ok(GreenContext { raw: driver::green_ctx_create(dev, resources)? })
    }

    /// Runs `f` with the green context current on this thread (objects it creates, such as
    /// events, belong to the green context), then makes `restore` current again.
    pub fn with_current<T>(&self, restore: &Context, f: impl FnOnce() -> DResult<T>) -> DResult<T> {
        // SAFETY: the green context is live while self lives; the handle it yields needs no release.
        let ctx = unsafe { driver::ctx_from_green_ctx(self.raw) }?;
        // SAFETY: ctx stays valid while the green context lives (for the whole call).
        unsafe { driver::ctx_set_current(ctx) }?;
        let r = f();
        restore.bind()?;
        r
    }

    /// A stream whose kernels run only on this partition's SMs.
    pub fn stream(&self, priority: i32) -> DResult<Stream> {
        // SAFETY: the green context is live while self lives.
        Ok(Stream { raw: unsafe { driver::green_ctx_stream_create(self.raw, priority) }? })
    }
}

impl Drop for GreenContext {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once, after its streams (field order of the owner).
        let _ = unsafe { driver::green_ctx_destroy(self.raw) };
    }
}

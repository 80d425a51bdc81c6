//! The result layer over the CUDA driver API: one thin function per driver call that turns the
//! status code into a [`DriverError`]. The sys layer underneath is cudarc's `driver::sys`
//! (dynamically loaded); the safe layer on top is [`crate::safe`].
//!
//! Functions that take only plain values are safe (the driver validates handles it owns, and a
//! missing library is ruled out by [`is_present`] before anything here runs); functions that take
//! raw pointers, or handles whose lifetime the caller manages, are `unsafe` with their contract
//! listed under `# Safety`.

use cudarc::driver::sys;
use std::ffi::{CStr, c_void};

pub use sys::{
    CUcontext, CUdevResource, CUdevResourceDesc, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUfunction,
    CUfunction_attribute, CUgraph, CUgraphExec, CUgreenCtx, CUmodule, CUresult, CUstream,
};

/// A failed driver call: which call, and the status it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverError {
    pub call: &'static str,
    pub code: CUresult,
}

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed with {:?}", self.call, self.code)
    }
}

impl std::error::Error for DriverError {}

pub type DResult<T> = Result<T, DriverError>;

fn check(call: &'static str, code: CUresult) -> DResult<()> {
    if code == CUresult::CUDA_SUCCESS { Ok(()) } else { Err(DriverError { call, code }) }
}

/// Whether libcuda can be loaded at all. Everything else in this module may only run after it
/// returned true (cudarc panics on a missing library).
pub fn is_present() -> bool {
    // SAFETY: is_culib_present only tries to open the library by its candidate names; opening
    // libcuda runs no code with preconditions on our side.
    unsafe { sys::is_culib_present() }
}

/// Whether the loaded driver exports `name` (newer calls such as green contexts are optional).
pub fn has_symbol(name: &str) -> bool {
    // SAFETY: culib() is only reached after is_present() returned true (callers check), and
    // looking a symbol up does not call it.
    unsafe { sys::culib().get::<*const c_void>(name.as_bytes()).is_ok() }
}

pub fn init() -> DResult<()> {
    // SAFETY: cuInit takes a flags word (must be 0) and touches no caller memory.
    check("cuInit", unsafe { sys::cuInit(0) })
}

pub fn device_count() -> DResult<i32> {
    let mut n = 0;
    // SAFETY: the out-pointer is a live local.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

pub fn device_get(ordinal: i32) -> DResult<CUdevice> {
    let mut d = 0;
    // SAFETY: the out-pointer is a live local; the driver validates the ordinal.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
    Ok(d)
}

pub fn device_name(dev: CUdevice) -> DResult<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer is 256 bytes long and we pass that length; the driver NUL-terminates.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) })?;
    // SAFETY: the buffer was NUL-terminated by the driver within its length.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

pub fn device_attribute(dev: CUdevice, attr: CUdevice_attribute) -> DResult<i32> {
    let mut v = 0;
    // SAFETY: the out-pointer is a live local; device and attribute are validated by the driver.
    check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) })?;
    Ok(v)
}

pub fn device_total_mem(dev: CUdevice) -> DResult<u64> {
    let mut v = 0usize;
    // SAFETY: the out-pointer is a live local.
    check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut v, dev) })?;
    Ok(v as u64)
}

pub fn driver_version() -> DResult<i32> {
    let mut v = 0;
    // SAFETY: the out-pointer is a live local.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) })?;
    Ok(v)
}

pub fn primary_ctx_retain(dev: CUdevice) -> DResult<CUcontext> {
    let mut c = std::ptr::null_mut();
    // SAFETY: the out-pointer is a live local; retaining has no other precondition.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut c, dev) })?;
    Ok(c)
}

/// # Safety
/// 1. Every retain of `dev`'s primary context is matched by exactly one release.
/// 2. No object created in the context is used after the last release.
pub unsafe fn primary_ctx_release(dev: CUdevice) -> DResult<()> {
    // SAFETY: the caller upholds the retain/release pairing (contract 1, 2).
    check("cuDevicePrimaryCtxRelease", unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) })
}

/// Destroys every allocation and all state of `dev`'s primary context in this process (what
/// recovers a context from a sticky error or a kernel that never ends); the retain count is kept,
/// and the context comes back fresh on its next use.
///
/// # Safety
/// 1. No handle created in the context before the reset (memory, streams, events, modules, green
///    contexts) is used or freed afterwards: they are gone, and their values may be handed out
///    again for new objects.
pub unsafe fn primary_ctx_reset(dev: CUdevice) -> DResult<()> {
    // SAFETY: the caller forgets every object of the context (contract 1).
    check("cuDevicePrimaryCtxReset", unsafe { sys::cuDevicePrimaryCtxReset_v2(dev) })
}

/// # Safety
/// 1. `ctx` is a live context (retained and not released).
pub unsafe fn ctx_set_current(ctx: CUcontext) -> DResult<()> {
    // SAFETY: ctx is live (contract 1).
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// (least, greatest) stream priorities of the current context; greater urgency is a lower number.
pub fn stream_priority_range() -> DResult<(i32, i32)> {
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: both out-pointers are live locals.
    check("cuCtxGetStreamPriorityRange", unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) })?;
    Ok((least, greatest))
}

pub fn mem_get_info() -> DResult<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both out-pointers are live locals; needs a current context, else it reports an error.
    check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free as u64, total as u64))
}

pub fn stream_create(priority: i32) -> DResult<CUstream> {
    let mut s = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: the out-pointer is a live local.
    check("cuStreamCreateWithPriority", unsafe { sys::cuStreamCreateWithPriority(&mut s, flags, priority) })?;
    Ok(s)
}

/// Queues a 4-byte store of `value` at `addr` on `stream` (a stream memory operation: the GPU's
/// front end performs it when the stream reaches it, without a kernel or a copy engine).
///
/// # Safety
/// 1. `stream` is live.
/// 2. `addr` is a 4-byte-aligned device address of this context that stays allocated until the
///    store has happened (until the stream has passed it).
pub unsafe fn stream_write_value32(stream: CUstream, addr: CUdeviceptr, value: u32) -> DResult<()> {
    // SAFETY: contracts 1 and 2; flags 0 is the default (the write is not ordered with earlier
    // writes of other streams, which nothing here needs).
    check("cuStreamWriteValue32", unsafe { sys::cuStreamWriteValue32_v2(stream, addr, value, 0) })
}

/// # Safety
/// 1. `stream` is live and is not used after this call.
pub unsafe fn stream_destroy(stream: CUstream) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(stream) })
}

/// True when all work on the stream has completed; an error if the stream or context failed.
///
/// # Safety
/// 1. `stream` is live.
pub unsafe fn stream_query(stream: CUstream) -> DResult<bool> {
    // SAFETY: contract 1.
    match unsafe { sys::cuStreamQuery(stream) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(DriverError { call: "cuStreamQuery", code }),
    }
}

/// # Safety
/// 1. `stream` is live.
pub unsafe fn stream_synchronize(stream: CUstream) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })
}

/// # Safety
/// 1. `stream` and `event` are live.
pub unsafe fn stream_wait_event(stream: CUstream, event: CUevent) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, event, 0) })
}

/// Starts capturing `stream`'s work into a graph instead of running it (relaxed mode: other
/// threads' driver calls are not checked against the capture).
///
/// # Safety
/// 1. `stream` is live, not the legacy default stream, and not already capturing.
pub unsafe fn stream_begin_capture(stream: CUstream) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
    })
}

/// Ends the capture begun on `stream` and returns the graph it recorded (owned by the caller).
///
/// # Safety
/// 1. `stream` is live and capturing (begun by [`stream_begin_capture`] on this thread).
pub unsafe fn stream_end_capture(stream: CUstream) -> DResult<CUgraph> {
    let mut g = std::ptr::null_mut();
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream, &mut g) })?;
    Ok(g)
}

/// An executable instance of `graph` (owned by the caller; independent of the graph afterwards).
///
/// # Safety
/// 1. `graph` is live.
pub unsafe fn graph_instantiate(graph: CUgraph) -> DResult<CUgraphExec> {
    let mut e = std::ptr::null_mut();
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuGraphInstantiateWithFlags", unsafe { sys::cuGraphInstantiateWithFlags(&mut e, graph, 0) })?;
    Ok(e)
}

/// The number of nodes of `graph`.
///
/// # Safety
/// 1. `graph` is live.
pub unsafe fn graph_node_count(graph: CUgraph) -> DResult<usize> {
    let mut n = 0usize;
    // SAFETY: contract 1; a null node array asks for the count only.
    check("cuGraphGetNodes", unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) })?;
    Ok(n)
}

/// The nodes of `graph`.
///
/// # Safety
/// 1. `graph` is live.
pub unsafe fn graph_nodes(graph: CUgraph) -> DResult<Vec<sys::CUgraphNode>> {
    // SAFETY: contract 1.
    let mut n = unsafe { graph_node_count(graph) }?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: contract 1; the array holds `n` nodes and the driver writes at most that many (and
    // says how many it wrote).
    check("cuGraphGetNodes", unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) })?;
    nodes.truncate(n);
    Ok(nodes)
}

/// A kernel node's launch parameters, or None for a node of another type.
///
/// # Safety
/// 1. `node` is a live node of a live graph. The returned parameter pointers belong to the node
///    and are valid only while it lives and is not changed.
pub unsafe fn graph_kernel_node_params(node: sys::CUgraphNode) -> DResult<Option<sys::CUDA_KERNEL_NODE_PARAMS>> {
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuGraphNodeGetType", unsafe { sys::cuGraphNodeGetType(node, &mut t) })?;
    if t != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
    }
    // SAFETY: all-zero is a valid value of this plain C struct (null handles and pointers).
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: contract 1; the node is a kernel node and the out-pointer a live local.
    check("cuGraphKernelNodeGetParams", unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) })?;
    Ok(Some(p))
}

/// Sets the parameters of kernel node `node` in the executable instance `exec` (future runs only).
///
/// # Safety
/// 1. `exec` was instantiated from the graph `node` belongs to, both live, and no other thread
///    uses `exec` during the call.
/// 2. `params` came from [`graph_kernel_node_params`] of that node (its parameter pointers still
///    valid), with at most `func` changed to a live function of the same signature and context.
pub unsafe fn graph_exec_kernel_node_set_params(
    exec: CUgraphExec,
    node: sys::CUgraphNode,
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
) -> DResult<()> {
    // SAFETY: contracts 1 and 2.
    check("cuGraphExecKernelNodeSetParams", unsafe { sys::cuGraphExecKernelNodeSetParams_v2(exec, node, params) })
}

/// Queues one run of `exec` on `stream`.
///
/// # Safety
/// 1. `exec` and `stream` are live, and every buffer the graph's kernels use outlives the run.
pub unsafe fn graph_launch(exec: CUgraphExec, stream: CUstream) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, stream) })
}

/// # Safety
/// 1. `exec` is live, has no run in flight, and is not used after this call.
pub unsafe fn graph_exec_destroy(exec: CUgraphExec) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuGraphExecDestroy", unsafe { sys::cuGraphExecDestroy(exec) })
}

/// # Safety
/// 1. `graph` is live and not used after this call.
pub unsafe fn graph_destroy(graph: CUgraph) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) })
}

pub fn event_create(timing: bool) -> DResult<CUevent> {
    let mut e = std::ptr::null_mut();
    let flags = if timing { 0 } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 };
    // SAFETY: the out-pointer is a live local.
    check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags) })?;
    Ok(e)
}

/// # Safety
/// 1. `event` is live and not used after this call.
pub unsafe fn event_destroy(event: CUevent) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) })
}

/// # Safety
/// 1. `event` and `stream` are live.
pub unsafe fn event_record(event: CUevent, stream: CUstream) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuEventRecord", unsafe { sys::cuEventRecord(event, stream) })
}

/// # Safety
/// 1. `event` is live.
pub unsafe fn event_query(event: CUevent) -> DResult<bool> {
    // SAFETY: contract 1.
    match unsafe { sys::cuEventQuery(event) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(DriverError { call: "cuEventQuery", code }),
    }
}

/// # Safety
/// 1. `event` is live.
pub unsafe fn event_synchronize(event: CUevent) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event) })
}

/// Milliseconds between two completed timing events.
///
/// # Safety
/// 1. Both events are live, were created with timing, and have completed.
pub unsafe fn event_elapsed_ms(start: CUevent, end: CUevent) -> DResult<f32> {
    let mut ms = 0f32;
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime_v2(&mut ms, start, end) })?;
    Ok(ms)
}

pub fn mem_alloc(bytes: u64) -> DResult<CUdeviceptr> {
    let mut p = 0;
    // SAFETY: the out-pointer is a live local; needs a current context (else an error status).
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes as usize) })?;
    Ok(p)
}

/// # Safety
/// 1. `ptr` came from [`mem_alloc`], is not freed twice and not used afterwards.
pub unsafe fn mem_free(ptr: CUdeviceptr) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
}

/// Pinned host memory mapped into the device's address space (portable across contexts).
pub fn mem_host_alloc_mapped(bytes: u64) -> DResult<*mut u8> {
    let mut p = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: the out-pointer is a live local.
    check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, bytes as usize, flags) })?;
    Ok(p as *mut u8)
}

/// # Safety
/// 1. `ptr` came from [`mem_host_alloc_mapped`], is not freed twice, and neither the host nor the
///    device uses it afterwards.
pub unsafe fn mem_free_host(ptr: *mut u8) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr as *mut c_void) })
}

/// # Safety
/// 1. `host` points into a live allocation of [`mem_host_alloc_mapped`].
pub unsafe fn mem_host_device_pointer(host: *mut u8) -> DResult<CUdeviceptr> {
    let mut d = 0;
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host as *mut c_void, 0) })?;
    Ok(d)
}

/// # Safety
/// 1. `[dst, dst + src.len())` lies inside one live device allocation.
pub unsafe fn memcpy_htod(dst: CUdeviceptr, src: &[u8]) -> DResult<()> {
    // SAFETY: contract 1; src is a live slice of the stated length.
    check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()) })
}

/// Copies host memory into device memory and returns once the data is in device memory. A plain
/// `cuMemcpyHtoD` from pageable memory may return while the DMA from its staging buffer is still
/// in flight, and kernels on non-blocking streams (all of ours) do not wait for it: the copy goes
/// on `stream` and the call waits for that stream.
///
/// # Safety
/// 1. `[dst, dst + src.len())` lies inside one live device allocation.
/// 2. `stream` is live and nothing else waits on it for long (the call synchronizes it).
pub unsafe fn memcpy_htod_complete(dst: CUdeviceptr, src: &[u8], stream: CUstream) -> DResult<()> {
    // SAFETY: contract 1; src is a live slice of the stated length, and outlives the copy (the
    // stream is synchronized before returning).
    check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream) })?;
    // SAFETY: contract 2.
    unsafe { stream_synchronize(stream) }
}

/// # Safety
/// 1. `[src, src + dst.len())` lies inside one live device allocation.
pub unsafe fn memcpy_dtoh(dst: &mut [u8], src: CUdeviceptr) -> DResult<()> {
    // SAFETY: contract 1; dst is a live mutable slice of the stated length.
    check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()) })
}

/// # Safety
/// 1. Both ranges lie inside live allocations (device or mapped host) that stay alive until the
///    copy has completed on `stream`.
/// 2. `stream` is live.
pub unsafe fn memcpy_async(dst: CUdeviceptr, src: CUdeviceptr, bytes: u64, stream: CUstream) -> DResult<()> {
    // SAFETY: contracts 1 and 2.
    check("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst, src, bytes as usize, stream) })
}

/// # Safety
/// 1. `[dst, dst + bytes)` lies inside one live device allocation.
pub unsafe fn memset_d8(dst: CUdeviceptr, value: u8, bytes: u64) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dst, value, bytes as usize) })
}

/// Loads a CUBIN, or NUL-terminated PTX, image into the current context.
pub fn module_load_data(image: &[u8]) -> DResult<CUmodule> {
    let mut m = std::ptr::null_mut();
    // SAFETY: the image is a live buffer; the driver parses it (CUBIN is self-delimiting through
    // its ELF header, PTX images are NUL-terminated by our loader).
    check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) })?;
    Ok(m)
}

/// # Safety
/// 1. `module` is live, none of its functions is launched or queried afterwards.
pub unsafe fn module_unload(module: CUmodule) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) })
}

/// # Safety
/// 1. `module` is live.
pub unsafe fn module_get_function(module: CUmodule, name: &CStr) -> DResult<CUfunction> {
    let mut f = std::ptr::null_mut();
    // SAFETY: contract 1; name is NUL-terminated; the out-pointer is a live local.
    check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) })?;
    Ok(f)
}

/// # Safety
/// 1. `f` belongs to a live module.
pub unsafe fn func_get_attribute(f: CUfunction, attr: CUfunction_attribute) -> DResult<i32> {
    let mut v = 0;
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuFuncGetAttribute", unsafe { sys::cuFuncGetAttribute(&mut v, attr, f) })?;
    Ok(v)
}

/// Sets a function attribute (e.g. the most dynamic shared memory its launches may ask for).
///
/// # Safety
/// 1. `f` belongs to a live module.
pub unsafe fn func_set_attribute(f: CUfunction, attr: CUfunction_attribute, value: i32) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuFuncSetAttribute", unsafe { sys::cuFuncSetAttribute(f, attr, value) })
}

/// CTAs of `f` that fit on one SM at this CTA size and dynamic shared memory.
///
/// # Safety
/// 1. `f` belongs to a live module.
pub unsafe fn occupancy_max_active_blocks(f: CUfunction, threads: u32, dynamic_smem_bytes: u32) -> DResult<u32> {
    let mut n = 0;
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, threads as i32, dynamic_smem_bytes as usize)
    })?;
    Ok(n.max(0) as u32)
}

/// # Safety
/// 1. `f` belongs to a live module and `stream` is live.
/// 2. `params` holds one pointer per kernel parameter, each to a buffer of that parameter's size,
///    all alive for the duration of this call (the driver copies them).
/// 3. Every device address inside the parameters stays valid until the kernel has finished.
pub unsafe fn launch_kernel(
    f: CUfunction,
    grid: u32,
    block: u32,
    dynamic_smem_bytes: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> DResult<()> {
    let p = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
    // SAFETY: contracts 1-3.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(f, grid, 1, 1, block, 1, 1, dynamic_smem_bytes, stream, p, std::ptr::null_mut())
    })
}

/// `cuLaunchKernelEx` with programmatic stream serialization (Hopper's programmatic dependent
/// launch): the kernel may start while the kernel before it on `stream` finishes, and must wait
/// for it (`griddepcontrol.wait`) before reading what that kernel wrote.
///
/// # Safety
/// As [`launch_kernel`].
pub unsafe fn launch_kernel_overlapped(
    f: CUfunction,
    grid: u32,
    block: u32,
    dynamic_smem_bytes: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> DResult<()> {
    // SAFETY: CUlaunchAttribute is plain old data (an id and a union of plain fields) for which
    // all-zero bytes are valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    // SAFETY: contracts 1-3 of launch_kernel, passed on.
    unsafe { launch_kernel_ex(f, grid, block, dynamic_smem_bytes, stream, params, attr) }
}

/// `cuLaunchKernelEx` of a 1-D grid with one launch attribute.
///
/// # Safety
/// As [`launch_kernel`].
unsafe fn launch_kernel_ex(
    f: CUfunction,
    grid: u32,
    block: u32,
    dynamic_smem_bytes: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
    mut attr: sys::CUlaunchAttribute,
) -> DResult<()> {
    let config = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: dynamic_smem_bytes,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    let p = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
    // SAFETY: contracts 1-3 of launch_kernel; `config` and `attr` are live locals the driver
    // reads during the call.
    check("cuLaunchKernelEx", unsafe { sys::cuLaunchKernelEx(&config, f, p, std::ptr::null_mut()) })
}

/// `cuLaunchKernelEx` as thread-block clusters of `cluster_ctas` CTAs along x (`grid` a multiple
/// of it): the CTAs of a cluster are co-scheduled on one GPC (sm_90+).
///
/// # Safety
/// As [`launch_kernel`].
pub unsafe fn launch_kernel_clustered(
    f: CUfunction,
    grid: u32,
    block: u32,
    cluster_ctas: u32,
    dynamic_smem_bytes: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> DResult<()> {
    // SAFETY: CUlaunchAttribute is plain old data for which all-zero bytes are valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = cluster_ctas;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    // SAFETY: contracts 1-3 of launch_kernel, passed on.
    unsafe { launch_kernel_ex(f, grid, block, dynamic_smem_bytes, stream, params, attr) }
}

/// The device's whole SM resource (for green contexts).
pub fn device_sm_resource(dev: CUdevice) -> DResult<CUdevResource> {
    // SAFETY: CUdevResource is plain old data for which all-zero bytes are a valid value.
    let mut r: CUdevResource = unsafe { std::mem::zeroed() };
    // SAFETY: the out-pointer is a live local.
    check("cuDeviceGetDevResource", unsafe {
        sys::cuDeviceGetDevResource(dev, &mut r, sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM)
    })?;
    Ok(r)
}

/// SM count of an SM resource, its minimum partition size and alignment.
pub fn sm_resource_counts(r: &CUdevResource) -> (u32, u32, u32) {
    // SAFETY: SM resources (type CU_DEV_RESOURCE_TYPE_SM, the only kind this module makes) use the
    // `sm` member of the union.
    let sm = unsafe { r.__bindgen_anon_1.sm };
    (sm.smCount, sm.minSmPartitionSize, sm.smCoscheduledAlignment)
}

/// Splits an SM resource into groups of at least `min_count` SMs: (groups, remainder).
pub fn sm_resource_split_by_count(input: &CUdevResource, min_count: u32) -> DResult<(Vec<CUdevResource>, CUdevResource)> {
    const GROUPS_MAX: usize = 64;
    // SAFETY: CUdevResource is plain old data; all-zero is a valid value.
    let mut groups: Vec<CUdevResource> = vec![unsafe { std::mem::zeroed() }; GROUPS_MAX];
    // SAFETY: as above.
    let mut rem: CUdevResource = unsafe { std::mem::zeroed() };
    let mut n = GROUPS_MAX as u32;
    // SAFETY: `groups` holds n entries; input and rem are live; flags 0.
    check("cuDevSmResourceSplitByCount", unsafe {
        sys::cuDevSmResourceSplitByCount(groups.as_mut_ptr(), &mut n, input, &mut rem, 0, min_count)
    })?;
    groups.truncate(n as usize);
    Ok((groups, rem))
}

/// Creates a green context over the union of SM resources (one, or groups of one split).
pub fn green_ctx_create(dev: CUdevice, resources: &[CUdevResource]) -> DResult<CUgreenCtx> {
    let mut res = resources.to_vec();
    if res.is_empty() {
        return Err(DriverError { call: "cuDevResourceGenerateDesc", code: CUresult::CUDA_ERROR_INVALID_VALUE });
    }
    let mut desc: CUdevResourceDesc = std::ptr::null_mut();
    // SAFETY: `res` holds res.len() live resources; the out-pointer is a live local.
    check("cuDevResourceGenerateDesc", unsafe { sys::cuDevResourceGenerateDesc(&mut desc, res.as_mut_ptr(), res.len() as u32) })?;
    let mut g = std::ptr::null_mut();
    let flags = sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32;
    // SAFETY: desc was just generated; the out-pointer is a live local.
    check("cuGreenCtxCreate", unsafe { sys::cuGreenCtxCreate(&mut g, desc, dev, flags) })?;
    Ok(g)
}

/// The CUcontext handle of a green context (not separately owned).
///
/// # Safety
/// 1. `g` is live; the handle is used only while it is.
pub unsafe fn ctx_from_green_ctx(g: CUgreenCtx) -> DResult<CUcontext> {
    let mut c = std::ptr::null_mut();
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuCtxFromGreenCtx", unsafe { sys::cuCtxFromGreenCtx(&mut c, g) })?;
    Ok(c)
}

/// # Safety
/// 1. `g` is live; no stream of it is used afterwards.
pub unsafe fn green_ctx_destroy(g: CUgreenCtx) -> DResult<()> {
    // SAFETY: contract 1.
    check("cuGreenCtxDestroy", unsafe { sys::cuGreenCtxDestroy(g) })
}

/// # Safety
/// 1. `g` is live.
pub unsafe fn green_ctx_stream_create(g: CUgreenCtx, priority: i32) -> DResult<CUstream> {
    let mut s = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: contract 1; the out-pointer is a live local.
    check("cuGreenCtxStreamCreate", unsafe { sys::cuGreenCtxStreamCreate(&mut s, g, flags, priority) })?;
    Ok(s)
}

// ---- Several GPUs: topology and peer access (DeepPlan's parallel transmission) ----

/// Whether contexts on `dev` may map memory of `peer` (`cuDeviceCanAccessPeer`).
pub fn device_can_access_peer(dev: CUdevice, peer: CUdevice) -> DResult<bool> {
    let mut can = 0;
    // SAFETY: the out-pointer is a live local; the driver validates both devices.
    check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) })?;
    Ok(can != 0)
}

/// One attribute of the link from `src` to `dst` (`cuDeviceGetP2PAttribute`).
pub fn device_p2p_attribute(attr: sys::CUdevice_P2PAttribute, src: CUdevice, dst: CUdevice) -> DResult<i32> {
    let mut v = 0;
    // SAFETY: the out-pointer is a live local; the driver validates the devices and the attribute.
    check("cuDeviceGetP2PAttribute", unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst) })?;
    Ok(v)
}

pub use sys::CUdevice_P2PAttribute;

/// The device's PCI address as the driver writes it (`0000:1b:00.0`, domain:bus:device.function).
pub fn device_pci_bus_id(dev: CUdevice) -> DResult<String> {
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: the buffer is 64 bytes long and we pass that length; the driver NUL-terminates.
    check("cuDeviceGetPCIBusId", unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) })?;
    // SAFETY: NUL-terminated by the driver within its length.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// Lets the current context access `peer`'s memory (`cuCtxEnablePeerAccess`); true if it was
/// enabled now, false if it already was.
///
/// # Safety
/// 1. A context is current on this thread and `peer` is a live context of another device.
pub unsafe fn ctx_enable_peer_access(peer: CUcontext) -> DResult<bool> {
    // SAFETY: contract 1; flags must be 0.
    let code = unsafe { sys::cuCtxEnablePeerAccess(peer, 0) };
    if code == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(false);
    }
    check("cuCtxEnablePeerAccess", code)?;
    Ok(true)
}

/// Copies `bytes` from `src` in context `src_ctx` to `dst` in context `dst_ctx` on `stream`
/// (`cuMemcpyPeerAsync`: over NVLink or PCIe peer-to-peer where peer access is enabled, through
/// host memory otherwise).
///
/// # Safety
/// 1. Both ranges lie inside live device allocations of their contexts that stay alive until the
///    copy has completed on `stream`.
/// 2. Both contexts and `stream` are live.
pub unsafe fn memcpy_peer_async(
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    bytes: u64,
    stream: CUstream,
) -> DResult<()> {
    // SAFETY: contracts 1 and 2.
    check("cuMemcpyPeerAsync", unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes as usize, stream) })
}

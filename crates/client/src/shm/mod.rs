//! The local shared-memory channel, client side.
//!
//! ```text
//!  client process                                   kairos server
//!  ShmClient::connect ---- HELLO (Unix socket) ---->  creates a sealed memfd region + 2 eventfds
//!                    <--- fds (SCM_RIGHTS) --------
//!  open_model -------------- OPEN_MODEL ------------>  handle, tensor names, dtypes, shapes
//!  write inputs in place (region data area)
//!  submit: Submission -> submission ring; ring the doorbell only if the server's thread sleeps
//!                                                     server thread: pops, checks every span,
//!                                                     submits to the engine
//!  wait (hybrid): announce, sleep on the eventfd <---  engine completion: outputs into the
//!                 then poll the completion ring        region, Completion -> ring, eventfd
//!                                                     write only if the client announced a sleep
//! ```
//!
//! The server fires the eventfd when the request's last kernel is issued (Paella's hybrid
//! wake-up): after the wake-up the client polls and never sleeps again for that request.
//!
//! Where the backend can (CUDA: the region's data area page-locked and mapped into the GPU; the
//! simulator emulates it), the GPU reads the inputs from and writes the outputs into the region
//! directly: no copy on either side ([`ShmResult::zero_copy`] says so per request). Buffers are
//! handed out at [`BUFFER_ALIGN_BYTES`] for that; spans a client places itself at other offsets,
//! or inputs and outputs that overlap, take the copy path.

pub mod layout;
pub mod region;
pub mod ring;
pub mod wire;

use crate::{ClientError, Code, InferOptions, Result, ServerTiming};
use kairos_core::Tensor;
use layout::*;
use region::Region;
use ring::{Consumer, Producer};
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketType};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};
pub use wire::TensorSpec;

/// A submission's `timeout_us` and `flags` for `opts`: the timeout (a deadline that cancels), or
/// the deadline only (`FLAG_DEADLINE_ONLY`); the channel carries one of the two.
fn submission_flags(opts: &InferOptions) -> Result<(u64, u32)> {
    let tenant = if opts.tenant.is_some() { FLAG_TENANT } else { 0 };
    match (opts.timeout_us, opts.deadline_us) {
        (t, 0) => Ok((t, tenant)),
        (0, d) => Ok((d, tenant | FLAG_DEADLINE_ONLY)),
        _ => Err(ClientError::Usage(
            "the shared-memory channel carries timeout_us or deadline_us, not both: set one of them".into(),
        )),
    }
}

/// How [`ShmClient::wait`] waits for a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Spin on the completion ring (lowest latency, a busy core).
    Poll,
    /// Paella's hybrid: sleep on the eventfd the server fires, then poll.
    Hybrid,
}

/// Sizes the client asks for at connection.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    pub sq_entries: u32,
    pub cq_entries: u32,
    /// The data area for input and output buffers.
    pub data_bytes: u64,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions { sq_entries: 64, cq_entries: 64, data_bytes: 64 << 20 }
    }
}

/// A model opened on the channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmModel {
    pub handle: u32,
    pub name: String,
    pub version: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

/// A buffer in the region's data area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub span: Span,
}

/// A finished request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmResult {
    pub tag: u64,
    pub timing: ServerTiming,
    /// Bytes written into each output buffer.
    pub output_lens: Vec<u64>,
    /// The GPU read the inputs and wrote the outputs in the region itself (no copies).
    pub zero_copy: bool,
}

/// Buffers kept per model by [`ShmClient::infer`].
struct Scratch {
    inputs: Vec<Buffer>,
    outputs: Vec<Buffer>,
}

/// Alignment of buffers handed out by [`ShmClient::alloc`]: what GPU allocations get (kernels may
/// assume it), so that the GPU can read and write the buffers in place.
pub const BUFFER_ALIGN_BYTES: u64 = 256;

pub struct ShmClient {
    sock: OwnedFd,
    region: Region,
    completion_event: OwnedFd,
    doorbell: OwnedFd,
    sq: Producer,
    cq: Consumer,
    /// Completions popped while waiting for another tag.
    stash: HashMap<u64, Completion>,
    in_flight: usize,
    next_tag: u64,
    /// Free ranges of the data area: offset -> length.
    free: BTreeMap<u64, u64>,
    scratch: HashMap<u32, Scratch>,
    recv_buf: Vec<u8>,
    /// Completed requests by data path: (zero-copy, copied).
    paths: (u64, u64),
}

impl std::fmt::Debug for ShmClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmClient").field("layout", self.layout()).field("in_flight", &self.in_flight).finish()
    }
}

fn transport(what: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Transport(format!("{what}: {e}"))
}

fn send_msg(sock: &OwnedFd, msg: &[u8]) -> Result<()> {
    if msg.len() > wire::MESSAGE_BYTES_MAX {
        return Err(ClientError::Usage(format!(
            "a socket message of {} bytes exceeds {} bytes: use the shared-memory ring for large tensors",
            msg.len(),
            wire::MESSAGE_BYTES_MAX
        )));
    }
    let n = rustix::net::send(sock, msg, SendFlags::NOSIGNAL).map_err(|e| transport("send", e))?;
    if n != msg.len() {
        return Err(ClientError::Transport(format!("short send: {n} of {} bytes", msg.len())));
    }
    Ok(())
}

fn recv_msg(sock: &OwnedFd, buf: &mut Vec<u8>) -> Result<usize> {
    buf.resize(wire::MESSAGE_BYTES_MAX, 0);
    loop {
        match rustix::net::recv(sock, &mut buf[..], RecvFlags::empty()) {
            Ok((_, 0)) => return Err(ClientError::Transport("the server closed the connection".into())),
            Ok((_, n)) => return Ok(n.min(buf.len())),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(transport("recv", e)),
        }
    }
}

fn status_error(status: u32, message: String) -> ClientError {
    ClientError::Server { code: Code::from_u32(status), message }
}

fn protocol(e: String) -> ClientError {
    ClientError::Protocol(e)
}

impl ShmClient {
    /// Connects to a server's shared-memory socket and maps the region it creates for this client.
    pub fn connect(path: impl AsRef<Path>, opts: ConnectOptions) -> Result<ShmClient> {
        let path = path.as_ref();
        let sock = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, rustix::net::SocketFlags::CLOEXEC, None)
            .map_err(|e| transport("socket", e))?;
        let addr = SocketAddrUnix::new(path).map_err(|e| transport("socket path", e))?;
        rustix::net::connect(&sock, &addr).map_err(|e| transport(&format!("connect to {}", path.display()), e))?;
        let mut w = wire::Writer::new(wire::OP_HELLO);
        w.u32(VERSION).u32(opts.sq_entries).u32(opts.cq_entries).u64(opts.data_bytes);
        send_msg(&sock, &w.buf)?;
        // The reply carries the region and the two eventfds.
        let mut buf = vec![0u8; 4096];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(wire::HELLO_FDS))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let got =
            rustix::net::recvmsg(&sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC).map_err(|e| transport("recvmsg", e))?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in control.drain() {
            if let rustix::net::RecvAncillaryMessage::ScmRights(it) = m {
                fds.extend(it);
            }
        }
        let n = got.bytes;
        if n == 0 {
            return Err(ClientError::Transport("the server closed the connection during the hand-shake".into()));
        }
        let mut r = wire::Reader::new(&buf[..n]);
        let op = r.u8().map_err(protocol)?;
        if op != wire::OP_HELLO {
            return Err(ClientError::Protocol(format!("expected a HELLO reply, got op {op}")));
        }
        let status = r.u32().map_err(protocol)?;
        let message = r.str().map_err(protocol)?;
        if status != 0 {
            return Err(status_error(status, message));
        }
        if fds.len() != wire::HELLO_FDS {
            return Err(ClientError::Protocol(format!("the HELLO reply carried {} fds, not {}", fds.len(), wire::HELLO_FDS)));
        }
        let doorbell = fds.pop().unwrap();
        let completion_event = fds.pop().unwrap();
        let region = Region::open(fds.pop().unwrap()).map_err(ClientError::Protocol)?;
        let mut free = BTreeMap::new();
        free.insert(0, region.layout().data_bytes);
        Ok(ShmClient {
            sock,
            region,
            completion_event,
            doorbell,
            sq: Producer::new(),
            cq: Consumer::new(),
            stash: HashMap::new(),
            in_flight: 0,
            next_tag: 1,
            free,
            scratch: HashMap::new(),
            recv_buf: Vec::new(),
            paths: (0, 0),
        })
    }

    pub fn layout(&self) -> &Layout {
        self.region.layout()
    }

    /// The mapped region itself (its ring words included): a client can break its own connection
    /// through it, never another client's.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Looks a model up; the handle names it in submissions.
    pub fn open_model(&mut self, name: &str, version: &str) -> Result<ShmModel> {
        let mut w = wire::Writer::new(wire::OP_OPEN_MODEL);
        w.str(name).str(version);
        send_msg(&self.sock, &w.buf)?;
        let mut buf = std::mem::take(&mut self.recv_buf);
        let result = (|| {
            let n = recv_msg(&self.sock, &mut buf)?;
            let mut r = wire::Reader::new(&buf[..n]);
            let op = r.u8().map_err(protocol)?;
            if op != wire::OP_OPEN_MODEL {
                return Err(ClientError::Protocol(format!("expected an OPEN_MODEL reply, got op {op}")));
            }
            let status = r.u32().map_err(protocol)?;
            let message = r.str().map_err(protocol)?;
            if status != 0 {
                return Err(status_error(status, message));
            }
            let handle = r.u32().map_err(protocol)?;
            let version = r.str().map_err(protocol)?;
            let inputs = r.tensor_specs().map_err(protocol)?;
            let outputs = r.tensor_specs().map_err(protocol)?;
            r.finish().map_err(protocol)?;
            Ok(ShmModel { handle, name: name.to_string(), version, inputs, outputs })
        })();
        self.recv_buf = buf;
        result
    }

    /// A buffer of `len` bytes in the data area (first fit, [`BUFFER_ALIGN_BYTES`] aligned).
    pub fn alloc(&mut self, len: u64) -> Result<Buffer> {
        let want = len.max(1).div_ceil(BUFFER_ALIGN_BYTES) * BUFFER_ALIGN_BYTES;
        let found = self.free.iter().find(|&(_, &l)| l >= want).map(|(&o, &l)| (o, l));
        let Some((offset, l)) = found else {
            return Err(ClientError::Usage(format!(
                "no free range of {want} bytes in the region's data area ({} bytes): free buffers or connect with a larger data_bytes",
                self.layout().data_bytes
            )));
        };
        self.free.remove(&offset);
        if l > want {
            self.free.insert(offset + want, l - want);
        }
        Ok(Buffer { span: Span { offset, len } })
    }

    /// Returns a buffer to the data area (merging free neighbours).
    pub fn free(&mut self, buf: Buffer) {
        let mut offset = buf.span.offset;
        let mut len = buf.span.len.max(1).div_ceil(BUFFER_ALIGN_BYTES) * BUFFER_ALIGN_BYTES;
        if let Some((&o, &l)) = self.free.range(..offset).next_back()
            && o + l == offset
        {
            self.free.remove(&o);
            offset = o;
            len += l;
        }
        if let Some(&l) = self.free.get(&(offset + len)) {
            self.free.remove(&(offset + len));
            len += l;
        }
        self.free.insert(offset, len);
    }

    /// The buffer's bytes, to write an input in place. Do not hold it across a submission that
    /// names the buffer as an output, and do not change a submitted request's inputs before its
    /// completion: on the zero-copy path the GPU reads them in place while the request runs.
    pub fn buffer_mut(&mut self, buf: &Buffer) -> Result<&mut [u8]> {
        // SAFETY: `&mut self` keeps every other slice of this client's region dead while this one
        // lives (1); the server writes a buffer only as the output of a submitted request, and the
        // documented contract keeps callers from writing such a buffer before its completion (2).
        unsafe { self.region.data_mut(buf.span) }.map_err(|e| ClientError::Usage(e.to_string()))
    }

    /// The buffer's bytes, to read an output in place after its request completed.
    pub fn buffer(&self, buf: &Buffer) -> Result<&[u8]> {
        // SAFETY: mutable slices need `&mut self`, so none is alive (1); reading an output before
        // its completion is outside the documented contract (2).
        unsafe { self.region.data(buf.span) }.map_err(|e| ClientError::Usage(e.to_string()))
    }

    /// Requests completed so far (successfully) by data path: (zero-copy, copied by the server).
    pub fn data_paths(&self) -> (u64, u64) {
        self.paths
    }

    /// Requests in flight (submitted, completion not yet returned by `wait`).
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Submits one request naming buffers of this region; returns its tag. The buffers belong to
    /// the request until its completion (the GPU may read the inputs and write the outputs in
    /// place all that time). Buffers from [`ShmClient::alloc`] suit the zero-copy path; spans at
    /// other alignments, and outputs overlapping an input or another output, are served by copies.
    pub fn submit(&mut self, model: &ShmModel, inputs: &[Buffer], outputs: &[Buffer], opts: &InferOptions) -> Result<u64> {
        if inputs.len() > INPUTS_MAX || outputs.len() > OUTPUTS_MAX {
            return Err(ClientError::Usage(format!("at most {INPUTS_MAX} inputs and {OUTPUTS_MAX} outputs per submission")));
        }
        let cq_entries = self.layout().cq_entries as usize;
        if self.in_flight + self.stash.len() >= cq_entries {
            return Err(ClientError::Usage(format!(
                "{} requests in flight or unclaimed: the completion ring holds {cq_entries}",
                self.in_flight + self.stash.len()
            )));
        }
        let (timeout_us, flags) = submission_flags(opts)?;
        let tag = self.next_tag;
        self.next_tag += 1;
        let mut s = Submission {
            tag,
            timeout_us,
            model: model.handle,
            priority: opts.priority.min(i32::MAX as u32) as i32,
            tenant: opts.tenant.unwrap_or(0),
            flags,
            input_count: inputs.len() as u16,
            output_count: outputs.len() as u16,
            class: match opts.real_time {
                None => CLASS_MODEL_DEFAULT,
                Some(true) => CLASS_REAL_TIME,
                Some(false) => CLASS_BEST_EFFORT,
            },
            ..Default::default()
        };
        for (d, b) in s.inputs.iter_mut().zip(inputs) {
            *d = b.span;
        }
        for (d, b) in s.outputs.iter_mut().zip(outputs) {
            *d = b.span;
        }
        let start = Instant::now();
        loop {
            match self.sq.push(&self.region.sq(), s) {
                Ok(()) => break,
                Err(ring::RingError::Full) if start.elapsed() < Duration::from_secs(5) => {
                    self.ring_doorbell();
                    std::thread::yield_now();
                }
                Err(e) => return Err(ClientError::Transport(format!("submission ring: {e}"))),
            }
        }
        self.in_flight += 1;
        if ring::should_wake(self.region.server_sleeping()) {
            self.ring_doorbell();
        }
        Ok(tag)
    }

    fn ring_doorbell(&self) {
        // An eventfd write of 1 only fails when the counter would overflow, which leaves the
        // server awake anyway.
        let _ = rustix::io::write(&self.doorbell, &1u64.to_ne_bytes());
    }

    fn take(&mut self, c: Completion) -> Result<ShmResult> {
        self.in_flight -= 1;
        if c.status != 0 {
            return Err(status_error(c.status, c.message()));
        }
        let n = (c.output_count as usize).min(OUTPUTS_MAX);
        let zero_copy = c.flags & COMPLETION_ZERO_COPY != 0;
        if zero_copy {
            self.paths.0 += 1;
        } else {
            self.paths.1 += 1;
        }
        Ok(ShmResult {
            tag: c.tag,
            timing: ServerTiming {
                engine_ns: c.engine_ns,
                gpu_ns: c.gpu_ns,
                queue_ns: c.queue_ns,
                deadline_missed: c.deadline_missed != 0,
            },
            output_lens: c.output_lens[..n].to_vec(),
            zero_copy,
        })
    }

    fn pop_completion(&mut self) -> Result<Option<Completion>> {
        self.cq.pop(&self.region.cq()).map_err(|e| ClientError::Protocol(format!("completion ring: {e}")))
    }

    /// Any finished request, without waiting.
    pub fn try_next(&mut self) -> Result<Option<ShmResult>> {
        if let Some(&tag) = self.stash.keys().next() {
            let c = self.stash.remove(&tag).unwrap();
            return self.take(c).map(Some);
        }
        match self.pop_completion()? {
            Some(c) => self.take(c).map(Some),
            None => Ok(None),
        }
    }

    /// Waits for the request `tag`. Completions of other requests that arrive meanwhile are kept
    /// for their own `wait`.
    pub fn wait(&mut self, tag: u64, how: Wait) -> Result<ShmResult> {
        let mut polling = how == Wait::Poll;
        loop {
            if let Some(c) = self.stash.remove(&tag) {
                return self.take(c);
            }
            while let Some(c) = self.pop_completion()? {
                if c.tag == tag {
                    return self.take(c);
                }
                self.stash.insert(c.tag, c);
            }
            if polling {
                std::hint::spin_loop();
                continue;
            }
            // Hybrid: announce the sleep, look once more, then sleep on the eventfd.
            ring::prepare_sleep(self.region.client_waiting());
            let ready =
                self.cq.available(&self.region.cq()).map_err(|e| ClientError::Protocol(format!("completion ring: {e}")))?;
            if ready == 0 {
                let mut v = [0u8; 8];
                match rustix::io::read(&self.completion_event, &mut v) {
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => {
                        ring::end_sleep(self.region.client_waiting());
                        return Err(transport("eventfd read", e));
                    }
                }
            }
            ring::end_sleep(self.region.client_waiting());
            // Woken: from here on, poll (the server may signal before the result lands).
            polling = true;
        }
    }

    fn scratch_for(&mut self, model: &ShmModel) -> Result<()> {
        if self.scratch.contains_key(&model.handle) {
            return Ok(());
        }
        let mut inputs = Vec::new();
        for s in &model.inputs {
            inputs.push(self.alloc(s.len_bytes())?);
        }
        let mut outputs = Vec::new();
        for s in &model.outputs {
            outputs.push(self.alloc(s.len_bytes())?);
        }
        self.scratch.insert(model.handle, Scratch { inputs, outputs });
        Ok(())
    }

    /// One request with tensors: copies them into buffers kept for the model, submits, waits,
    /// and reads the outputs back.
    pub fn infer(
        &mut self,
        model: &ShmModel,
        inputs: &[Tensor],
        how: Wait,
        opts: &InferOptions,
    ) -> Result<(Vec<Tensor>, ServerTiming)> {
        check_inputs(model, inputs)?;
        self.scratch_for(model)?;
        let (ins, outs) = {
            let s = &self.scratch[&model.handle];
            (s.inputs.clone(), s.outputs.clone())
        };
        for ((t, spec), b) in inputs.iter().zip(&model.inputs).zip(&ins) {
            let bytes = t.cast(spec.dtype).to_bytes();
            self.buffer_mut(b)?.copy_from_slice(&bytes);
        }
        let tag = self.submit(model, &ins, &outs, opts)?;
        let r = self.wait(tag, how)?;
        let mut outputs = Vec::with_capacity(outs.len());
        for (spec, b) in model.outputs.iter().zip(&outs) {
            let t = Tensor::from_bytes(spec.dtype, spec.shape.clone(), self.buffer(b)?).map_err(ClientError::Protocol)?;
            outputs.push(t);
        }
        Ok((outputs, r.timing))
    }

    /// The baseline of Paella's Figure 14: the same request sent whole over the Unix socket, the
    /// client blocking in `recv` until the server sends the outputs back.
    pub fn infer_socket(
        &mut self,
        model: &ShmModel,
        inputs: &[Tensor],
        opts: &InferOptions,
    ) -> Result<(Vec<Tensor>, ServerTiming)> {
        check_inputs(model, inputs)?;
        let (timeout_us, flags) = submission_flags(opts)?;
        let tag = self.next_tag;
        self.next_tag += 1;
        let mut w = wire::Writer::new(wire::OP_INFER);
        w.u64(tag)
            .u32(model.handle)
            .i32(opts.priority.min(i32::MAX as u32) as i32)
            .u64(timeout_us)
            .u8(match opts.real_time {
                None => CLASS_MODEL_DEFAULT,
                Some(true) => CLASS_REAL_TIME,
                Some(false) => CLASS_BEST_EFFORT,
            })
            .u32(flags)
            .u32(opts.tenant.unwrap_or(0))
            .u16(inputs.len() as u16);
        for (t, spec) in inputs.iter().zip(&model.inputs) {
            w.bytes(&t.cast(spec.dtype).to_bytes());
        }
        send_msg(&self.sock, &w.buf)?;
        let mut buf = std::mem::take(&mut self.recv_buf);
        let result = (|| {
            let n = recv_msg(&self.sock, &mut buf)?;
            let mut r = wire::Reader::new(&buf[..n]);
            let op = r.u8().map_err(protocol)?;
            if op != wire::OP_INFER {
                return Err(ClientError::Protocol(format!("expected an INFER reply, got op {op}")));
            }
            let got_tag = r.u64().map_err(protocol)?;
            if got_tag != tag {
                return Err(ClientError::Protocol(format!("reply for tag {got_tag}, expected {tag}")));
            }
            let status = r.u32().map_err(protocol)?;
            let message = r.str().map_err(protocol)?;
            let timing = ServerTiming {
                engine_ns: r.u64().map_err(protocol)?,
                gpu_ns: r.u64().map_err(protocol)?,
                queue_ns: r.u64().map_err(protocol)?,
                deadline_missed: r.u8().map_err(protocol)? != 0,
            };
            if status != 0 {
                return Err(status_error(status, message));
            }
            let count = r.u16().map_err(protocol)? as usize;
            if count != model.outputs.len() {
                return Err(ClientError::Protocol(format!("{count} outputs, the model has {}", model.outputs.len())));
            }
            let mut outputs = Vec::with_capacity(count);
            for spec in &model.outputs {
                let b = r.bytes().map_err(protocol)?;
                outputs.push(Tensor::from_bytes(spec.dtype, spec.shape.clone(), b).map_err(ClientError::Protocol)?);
            }
            r.finish().map_err(protocol)?;
            Ok((outputs, timing))
        })();
        self.recv_buf = buf;
        result
    }

    /// The socket, for callers that poll it themselves.
    pub fn socket(&self) -> rustix::fd::BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

fn check_inputs(model: &ShmModel, inputs: &[Tensor]) -> Result<()> {
    if inputs.len() != model.inputs.len() {
        return Err(ClientError::Usage(format!(
            "model '{}' takes {} inputs, got {}",
            model.name,
            model.inputs.len(),
            inputs.len()
        )));
    }
    for (t, spec) in inputs.iter().zip(&model.inputs) {
        if t.shape != spec.shape {
            return Err(ClientError::Usage(format!(
                "input '{}' has shape {:?}, the model takes {:?}",
                spec.name, t.shape, spec.shape
            )));
        }
    }
    Ok(())
}

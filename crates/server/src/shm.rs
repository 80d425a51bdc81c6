//! The local shared-memory channel, server side (the client and the wire layout are in
//! `kairos_client::shm`).
//!
//! One thread accepts connections on a Unix SOCK_SEQPACKET socket (mode 0600: only the server's
//! user connects). Each client gets a thread of its own and, at HELLO, a fresh sealed memfd region
//! of the size it asked for (within `region_bytes_max`) and two eventfds, passed with SCM_RIGHTS:
//! no other process can name that memory, and a client's spans are checked against its own region
//! only. The client thread:
//!
//! - pops submissions from the ring, checks them (model handle, tensor counts, every span inside
//!   the data area, input spans exactly the input's size, output spans large enough) and submits
//!   them to the engine; a bad submission completes at once with INVALID_ARGUMENT / NOT_FOUND and
//!   the thread goes on;
//! - zero-copy: at connection the client's data area is mapped into every engine's GPU
//!   (`State::map_host_memory`; on CUDA page-locked and mapped, on the simulator emulated), and a
//!   request whose GPU has it mapped, whose spans start at the mapping's alignment (256 bytes, as
//!   the client's allocator hands them out), whose outputs overlap nothing and whose tensors
//!   total at most `ShmConfig::zero_copy_bytes_max` (64 KiB by default) is submitted with
//!   its tensors bound to the region (`EngineIo::Bound`): the GPU reads the inputs and writes the
//!   outputs in place, nothing is copied. Other requests take the copy path (inputs copied out of
//!   the region, outputs copied back in), and the reason is logged once per client and kind. At
//!   disconnection the region is unmapped once the client's requests in flight have completed
//!   (the engine defers the unmap until then); `kairos_shm_requests_total{path}` counts both paths;
//! - spins on the ring for `spin_us` after its last piece of work, then announces that it sleeps and
//!   waits on the socket and its doorbell eventfd (which the client rings only when it sees the
//!   announcement);
//! - answers OPEN_MODEL and the socket-mode INFER baseline.
//!
//! When the dispatcher issues a ring request's last kernel, it fires the client's eventfd if the
//! client announced a sleep (Paella's hybrid wake-up: the client wakes while that kernel runs and
//! polls for the result). Completions are written by the engine's completion callback on the
//! dispatcher thread: outputs copied into the client's output spans (copy path only), a `Completion`
//! pushed into the ring (flagged `COMPLETION_ZERO_COPY` on the zero-copy path), and the eventfd written again only if the client is (still) asleep. Each submission reserves its completion
//! slot when it is taken from the submission ring, so a completion never finds the ring full; when
//! the client does not drain completions, the thread stops taking submissions (back-pressure), so
//! nothing grows without bound. A client that writes impossible ring indices is disconnected.

/// Default largest request (inputs plus outputs, bytes) that takes the zero-copy path
/// ([`ShmConfig::zero_copy_bytes_max`], `kairos serve --shm-zero-copy-bytes-max`). Kernels read a
/// mapped input over PCIe every time they touch it, in small scattered transactions: on an H200
/// a 600 KB image read in place made its 370 µs model take 1.8 ms, while a one-off copy costs
/// about 11 µs per 600 KB; small tensors (the cases the channel is for) gain the copies' fixed
/// costs instead (`kairos bench serve`, docs/benchmarks.md).
pub const ZERO_COPY_BYTES_MAX: u64 = 64 * 1024;

use crate::decode::{self, Param, Params};
use crate::error::{Outcome, ServeError};
use crate::metrics::Protocol;
use crate::state::{CancelCause, EngineIo, HostRegion, InferDone, ModelEntry, State, SubmitOptions};
use kairos_client::Code;
use kairos_client::shm::layout::*;
use kairos_client::shm::region::{DataArea, Region};
use kairos_client::shm::ring::{self, Consumer, Producer, RingError};
use kairos_client::shm::wire::{self, Reader, TensorSpec, Writer};
use kairos_ir::Tensor;
use kairos_sched::{Class, IoBinding, MappedSpan};
use rustix::event::{PollFd, PollFlags};
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{RecvFlags, SendFlags};
use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Model handles one connection may open.
pub const HANDLES_MAX: usize = 1024;
/// Socket-mode requests of one connection in the engine at once.
pub const SOCKET_IN_FLIGHT_MAX: u32 = 64;
/// Replies of one connection waiting for the socket to drain.
pub const PENDING_REPLIES_MAX: usize = SOCKET_IN_FLIGHT_MAX as usize;
/// Submissions taken per turn of a client thread before it looks at its socket again.
const SUBMISSIONS_PER_TURN: usize = 64;
/// How long a connection may take to say HELLO.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub struct ShmConfig {
    pub socket: PathBuf,
    pub clients_max: usize,
    /// The largest region (rings plus data area) one client may ask for.
    pub region_bytes_max: u64,
    /// How long a client thread spins on its ring after its last piece of work before it sleeps.
    pub spin_us: u64,
    /// Largest request (inputs plus outputs, bytes) served zero-copy; larger ones are copied
    /// (see [`ZERO_COPY_BYTES_MAX`], the default).
    pub zero_copy_bytes_max: u64,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            socket: PathBuf::from("/tmp/kairos.sock"),
            clients_max: 64,
            region_bytes_max: 1 << 30,
            spin_us: 20,
            zero_copy_bytes_max: ZERO_COPY_BYTES_MAX,
        }
    }
}

pub struct ShmServer {
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl ShmServer {
    /// Binds the socket (replacing a stale one) and starts accepting clients.
    pub fn start(state: Arc<State>, cfg: ShmConfig) -> std::io::Result<ShmServer> {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        if let Ok(meta) = std::fs::symlink_metadata(&cfg.socket) {
            use std::os::unix::fs::FileTypeExt;
            if meta.file_type().is_socket() {
                std::fs::remove_file(&cfg.socket)?;
            } else {
                return Err(std::io::Error::other(format!("{} exists and is not a socket", cfg.socket.display())));
            }
        }
        let sock = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let addr = SocketAddrUnix::new(&cfg.socket)?;
        rustix::net::bind(&sock, &addr)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(0o600))?;
        }
        rustix::net::listen(&sock, 64)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let path = cfg.socket.clone();
        let acceptor =
            std::thread::Builder::new().name("kairos-shm-accept".into()).spawn(move || accept_loop(state, cfg, sock, s))?;
        info!(socket = %path.display(), "shared-memory channel listening");
        Ok(ShmServer { stop, acceptor: Some(acceptor), path })
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Stops accepting, disconnects every client, removes the socket.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn poll_ms(fds: &mut [PollFd<'_>], ms: u64) -> std::io::Result<usize> {
    let ts = rustix::time::Timespec { tv_sec: (ms / 1000) as i64, tv_nsec: ((ms % 1000) * 1_000_000) as i64 };
    match rustix::event::poll(fds, Some(&ts)) {
        Ok(n) => Ok(n),
        Err(rustix::io::Errno::INTR) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

fn accept_loop(state: Arc<State>, cfg: ShmConfig, sock: OwnedFd, stop: Arc<AtomicBool>) {
    let mut clients: Vec<JoinHandle<()>> = Vec::new();
    let live = Arc::new(AtomicU64::new(0));
    while !stop.load(Ordering::Acquire) {
        clients.retain(|h| !h.is_finished());
        let mut fds = [PollFd::new(&sock, PollFlags::IN)];
        match poll_ms(&mut fds, 100) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "shm accept poll failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        }
        let conn = match rustix::net::accept_with(&sock, rustix::net::SocketFlags::CLOEXEC) {
            Ok(c) => c,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
            Err(e) => {
                warn!(error = %e, "shm accept failed");
                continue;
            }
        };
        let peer = rustix::net::sockopt::socket_peercred(&conn).ok();
        if live.load(Ordering::Acquire) as usize >= cfg.clients_max {
            let mut w = Writer::new(wire::OP_HELLO);
            w.u32(Code::ResourceExhausted.as_u32())
                .str(&format!("the server serves {} shared-memory clients at most", cfg.clients_max));
            let _ = rustix::net::send(&conn, &w.buf, SendFlags::NOSIGNAL | SendFlags::DONTWAIT);
            continue;
        }
        live.fetch_add(1, Ordering::AcqRel);
        state.metrics.shm_clients.fetch_add(1, Ordering::Relaxed);
        let (st, c, s, l) = (state.clone(), cfg.clone(), stop.clone(), live.clone());
        let spawned = std::thread::Builder::new().name("kairos-shm-client".into()).spawn(move || {
            if let Some(p) = peer {
                info!(pid = p.pid.as_raw_nonzero().get(), uid = p.uid.as_raw(), "shared-memory client connected");
            }
            if let Err(e) = serve_client(&st, &c, conn, &s) {
                info!(reason = %e, "shared-memory client gone");
            }
            st.metrics.shm_clients.fetch_sub(1, Ordering::Relaxed);
            l.fetch_sub(1, Ordering::AcqRel);
        });
        match spawned {
            Ok(h) => clients.push(h),
            Err(e) => {
                warn!(error = %e, "cannot start a shared-memory client thread");
                state.metrics.shm_clients.fetch_sub(1, Ordering::Relaxed);
                live.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
    for h in clients {
        let _ = h.join();
    }
}

/// What callbacks on the dispatcher thread need of a connection.
struct Conn {
    region: Arc<Region>,
    sock: OwnedFd,
    cq: Mutex<Producer>,
    completion_event: OwnedFd,
    doorbell: OwnedFd,
    /// Ring submissions taken and not yet completed: each holds a completion slot.
    reserved: AtomicU32,
    socket_in_flight: AtomicU32,
    pending: Mutex<VecDeque<Vec<u8>>>,
    /// The client broke the completion ring's protocol.
    broken: AtomicBool,
}

impl Conn {
    fn complete(&self, c: Completion) {
        let pushed = {
            let mut p = self.cq.lock().unwrap_or_else(|e| e.into_inner());
            p.push(&self.region.cq(), c)
        };
        self.reserved.fetch_sub(1, Ordering::AcqRel);
        match pushed {
            Ok(()) => {}
            Err(RingError::Full) => warn!("shm completion ring full despite the reservation (client changed its indices?)"),
            Err(e @ RingError::Corrupt { .. }) => {
                warn!(error = %e, "shm client broke its completion ring; disconnecting");
                self.broken.store(true, Ordering::Release);
                self.ring_doorbell();
            }
        }
        self.wake_if_sleeping();
    }

    /// Writes the client's eventfd if it announced that it sleeps.
    fn wake_if_sleeping(&self) {
        if ring::should_wake(self.region.client_waiting()) {
            let _ = rustix::io::write(&self.completion_event, &1u64.to_ne_bytes());
        }
    }

    fn ring_doorbell(&self) {
        let _ = rustix::io::write(&self.doorbell, &1u64.to_ne_bytes());
    }

    fn fail(&self, tag: u64, e: &ServeError) {
        let mut c = Completion { tag, status: e.status().grpc.as_u32(), ..Default::default() };
        c.set_message(&e.to_string());
        self.complete(c);
    }

    /// Sends a socket reply without blocking; queues it for the client thread when the socket is full.
    fn send_reply(&self, msg: Vec<u8>) {
        match rustix::net::send(&self.sock, &msg, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
            Ok(_) => {}
            Err(rustix::io::Errno::AGAIN) => {
                let mut q = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                if q.len() < PENDING_REPLIES_MAX {
                    q.push_back(msg);
                }
                drop(q);
                self.ring_doorbell();
            }
            Err(_) => {} // The client is gone; its thread notices on the socket.
        }
    }
}

fn hello_reply(status: Code, message: &str) -> Vec<u8> {
    let mut w = Writer::new(wire::OP_HELLO);
    w.u32(status.as_u32()).str(message);
    w.buf
}

fn hello(cfg: &ShmConfig, sock: &OwnedFd) -> Result<Arc<Conn>, String> {
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    if poll_ms(&mut fds, HELLO_TIMEOUT.as_millis() as u64).map_err(|e| e.to_string())? == 0 {
        return Err("no HELLO within 5 s".into());
    }
    let mut buf = vec![0u8; 256];
    let (_, n) = rustix::net::recv(sock, &mut buf[..], RecvFlags::empty()).map_err(|e| e.to_string())?;
    let parsed = (|| {
        let mut r = Reader::new(&buf[..n.min(buf.len())]);
        if r.u8()? != wire::OP_HELLO {
            return Err("the first message must be HELLO".to_string());
        }
        let (version, sq, cq, data) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?);
        r.finish()?;
        Ok((version, sq, cq, data))
    })();
    let refuse = |code: Code, m: String| {
        let _ = rustix::net::send(sock, &hello_reply(code, &m), SendFlags::NOSIGNAL);
        Err(m)
    };
    let (version, sq, cq, data) = match parsed {
        Ok(v) => v,
        Err(e) => return refuse(Code::InvalidArgument, e),
    };
    if version != VERSION {
        return refuse(Code::InvalidArgument, format!("client speaks region version {version}, the server {VERSION}"));
    }
    let layout = match Layout::new(sq, cq, data) {
        Ok(l) if l.region_bytes <= cfg.region_bytes_max => l,
        Ok(l) => {
            return refuse(
                Code::InvalidArgument,
                format!("a region of {} bytes exceeds the server's limit of {} bytes", l.region_bytes, cfg.region_bytes_max),
            );
        }
        Err(e) => return refuse(Code::InvalidArgument, e),
    };
    let (region, memfd) = Region::create(layout, "kairos-shm").map_err(|e| e.to_string())?;
    let completion_event = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).map_err(|e| e.to_string())?;
    let doorbell = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).map_err(|e| e.to_string())?;
    {
        let reply = hello_reply(Code::Ok, "");
        let fds = [memfd.as_fd(), completion_event.as_fd(), doorbell.as_fd()];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(wire::HELLO_FDS))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        if !control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)) {
            return Err("cannot attach the region's fds".into());
        }
        rustix::net::sendmsg(sock, &[std::io::IoSlice::new(&reply)], &mut control, SendFlags::NOSIGNAL)
            .map_err(|e| e.to_string())?;
    }
    drop(memfd);
    let sock = sock.try_clone().map_err(|e| e.to_string())?;
    Ok(Arc::new(Conn {
        region: Arc::new(region),
        sock,
        cq: Mutex::new(Producer::new()),
        completion_event,
        doorbell,
        reserved: AtomicU32::new(0),
        socket_in_flight: AtomicU32::new(0),
        pending: Mutex::new(VecDeque::new()),
        broken: AtomicBool::new(false),
    }))
}

struct Client<'a> {
    state: &'a Arc<State>,
    conn: Arc<Conn>,
    /// The region's data area as each GPU maps it (zero-copy), or why not.
    host: HostRegion,
    /// Reasons for the copy path already logged for this client.
    copy_notes: HashSet<&'static str>,
    zero_copy_bytes_max: u64,
    sq: Consumer,
    /// Handle -> (name, version), as opened.
    handles: Vec<(String, String)>,
    recv_buf: Vec<u8>,
    /// This connection's id for the requests it sends ([`State::cancel_owner`]).
    owner: u64,
}

fn serve_client(state: &Arc<State>, cfg: &ShmConfig, sock: OwnedFd, stop: &AtomicBool) -> Result<(), String> {
    let conn = hello(cfg, &sock)?;
    let layout = *conn.region.layout();
    info!(sq = layout.sq_entries, cq = layout.cq_entries, data_bytes = layout.data_bytes, "shared-memory region mapped");
    let host = state.map_host_memory(Arc::new(DataArea(conn.region.clone())));
    for (gpu, m) in host.mappings.iter().enumerate() {
        match m {
            Ok(m) => info!(gpu, bytes = m.bytes, "zero-copy: the client's data area is mapped into the GPU"),
            Err(e) => info!(gpu, reason = %e, "zero-copy unavailable on this GPU: the client's requests there are copied"),
        }
    }
    let mut c = Client {
        state,
        conn,
        host,
        copy_notes: HashSet::new(),
        zero_copy_bytes_max: cfg.zero_copy_bytes_max,
        sq: Consumer::new(),
        handles: Vec::new(),
        recv_buf: vec![0u8; wire::MESSAGE_BYTES_MAX + 1],
        owner: state.new_owner(),
    };
    let r = c.serve(cfg, stop);
    // Nobody will read the answers of the requests still in flight: stop their GPU work.
    let cause = if stop.load(Ordering::Acquire) { CancelCause::Drain } else { CancelCause::ClientGone };
    let cancelled = state.cancel_owner(c.owner, cause);
    if cancelled > 0 {
        info!(requests = cancelled, "shared-memory client gone: its requests in flight are cancelled");
    }
    // The engines unmap the region once the requests in flight that use it have completed; this
    // waits for that.
    let host = std::mem::replace(&mut c.host, HostRegion { mappings: Vec::new() });
    state.unmap_host_memory(host);
    r
}

impl Client<'_> {
    fn serve(&mut self, cfg: &ShmConfig, stop: &AtomicBool) -> Result<(), String> {
        let c = self;
        let spin = Duration::from_micros(cfg.spin_us);
        let mut last_work = Instant::now();
        let mut turns = 0u32;
        loop {
            if stop.load(Ordering::Acquire) {
                return Err("server stopping".into());
            }
            if c.conn.broken.load(Ordering::Acquire) {
                return Err("the client broke its completion ring".into());
            }
            let (taken, blocked) = c.drain_submissions()?;
            let flushed = c.flush_pending()?;
            if taken > 0 || flushed {
                last_work = Instant::now();
                continue;
            }
            turns = turns.wrapping_add(1);
            if last_work.elapsed() < spin && !blocked {
                if turns.is_multiple_of(64) && !c.poll_socket(0)? {
                    return Err("the client closed the connection".into());
                }
                std::hint::spin_loop();
                continue;
            }
            // Sleep: announce, look once more, wait on the socket and the doorbell.
            ring::prepare_sleep(c.conn.region.server_sleeping());
            let ready = c.sq.available(&c.conn.region.sq()).map_err(|e| format!("submission ring: {e}"))?;
            if ready > 0 && !blocked {
                ring::end_sleep(c.conn.region.server_sleeping());
                continue;
            }
            let alive = c.poll_socket(if blocked { 1 } else { 100 })?;
            ring::end_sleep(c.conn.region.server_sleeping());
            if !alive {
                return Err("the client closed the connection".into());
            }
            last_work = Instant::now();
        }
    }
}

impl Client<'_> {
    /// Waits up to `ms` on the socket and the doorbell and handles what came; false when the
    /// client has gone.
    fn poll_socket(&mut self, ms: u64) -> Result<bool, String> {
        let (sock_ready, bell_ready, hup) = {
            let mut fds = [PollFd::new(&self.conn.sock, PollFlags::IN), PollFd::new(&self.conn.doorbell, PollFlags::IN)];
            poll_ms(&mut fds, ms).map_err(|e| e.to_string())?;
            let s = fds[0].revents();
            (s.contains(PollFlags::IN), fds[1].revents().contains(PollFlags::IN), s.intersects(PollFlags::HUP | PollFlags::ERR))
        };
        if bell_ready {
            let mut v = [0u8; 8];
            let _ = rustix::io::read(&self.conn.doorbell, &mut v);
        }
        if sock_ready {
            return self.read_messages();
        }
        Ok(!hup)
    }

    /// Handles every message waiting on the socket; false on end of file.
    fn read_messages(&mut self) -> Result<bool, String> {
        loop {
            let got = rustix::net::recv(&self.conn.sock, &mut self.recv_buf[..], RecvFlags::DONTWAIT | RecvFlags::TRUNC);
            let n = match got {
                Ok((_, 0)) => return Ok(false),
                Ok((_, n)) => n,
                Err(rustix::io::Errno::AGAIN) => return Ok(true),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(format!("socket: {e}")),
            };
            if n > wire::MESSAGE_BYTES_MAX {
                warn!(bytes = n, "shm socket message above the limit; dropped");
                let msg = self.error_reply(
                    self.recv_buf[0],
                    0,
                    ServeError::TooLarge(format!("a socket message of {n} bytes exceeds {} bytes", wire::MESSAGE_BYTES_MAX)),
                );
                self.conn.send_reply(msg);
                continue;
            }
            let msg = self.recv_buf[..n].to_vec();
            self.handle_message(&msg)?;
        }
    }

    fn error_reply(&self, op: u8, tag: u64, e: ServeError) -> Vec<u8> {
        let mut w = Writer::new(op);
        if op == wire::OP_INFER {
            w.u64(tag);
        }
        w.u32(e.status().grpc.as_u32()).str(&e.to_string());
        if op == wire::OP_INFER {
            w.u64(0).u64(0).u64(0).u8(0);
        }
        w.buf
    }

    fn handle_message(&mut self, msg: &[u8]) -> Result<(), String> {
        let mut r = Reader::new(msg);
        match r.u8()? {
            wire::OP_OPEN_MODEL => {
                let reply = match self.open_model(&mut r) {
                    Ok(reply) => reply,
                    Err(e) => self.error_reply(wire::OP_OPEN_MODEL, 0, e),
                };
                self.conn.send_reply(reply);
                Ok(())
            }
            wire::OP_INFER => {
                let tag = r.u64().unwrap_or(0);
                if let Err(e) = self.socket_infer(tag, &mut r) {
                    let reply = self.error_reply(wire::OP_INFER, tag, e);
                    self.conn.send_reply(reply);
                }
                Ok(())
            }
            op => Err(format!("unexpected op {op} on the socket")),
        }
    }

    fn open_model(&mut self, r: &mut Reader<'_>) -> Result<Vec<u8>, ServeError> {
        let name = r.str().map_err(ServeError::Invalid)?;
        let version = r.str().map_err(ServeError::Invalid)?;
        r.finish().map_err(ServeError::Invalid)?;
        let m = self.state.resolve(&name, &version)?;
        if m.inputs.len() > INPUTS_MAX || m.outputs.len() > OUTPUTS_MAX {
            return Err(ServeError::Unsupported(format!(
                "model '{name}' has {} inputs and {} outputs; the channel carries {INPUTS_MAX} and {OUTPUTS_MAX}",
                m.inputs.len(),
                m.outputs.len()
            )));
        }
        let handle = match self.handles.iter().position(|(n, v)| *n == name && *v == version) {
            Some(h) => h,
            None if self.handles.len() < HANDLES_MAX => {
                self.handles.push((name, version));
                self.handles.len() - 1
            }
            None => return Err(ServeError::Overloaded(format!("{HANDLES_MAX} model handles per connection at most"))),
        };
        let spec = |v: &[kairos_ir::plan::IoTensor]| -> Vec<TensorSpec> {
            v.iter().map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() }).collect()
        };
        let mut w = Writer::new(wire::OP_OPEN_MODEL);
        w.u32(0).str("").u32(handle as u32).str(&m.config.version).tensor_specs(&spec(&m.inputs)).tensor_specs(&spec(&m.outputs));
        Ok(w.buf)
    }

    fn model(&self, handle: u32) -> Result<Arc<ModelEntry>, ServeError> {
        let (name, version) = self
            .handles
            .get(handle as usize)
            .ok_or_else(|| ServeError::NotFound(format!("model handle {handle} was never opened on this connection")))?;
        self.state.resolve(name, version)
    }

    /// Takes submissions while a completion slot is free for each. Returns (taken, blocked by a
    /// full completion ring).
    fn drain_submissions(&mut self) -> Result<(usize, bool), String> {
        let conn = self.conn.clone();
        let cq_entries = conn.region.layout().cq_entries;
        let mut taken = 0;
        while taken < SUBMISSIONS_PER_TURN {
            let used = {
                let p = conn.cq.lock().unwrap_or_else(|e| e.into_inner());
                p.used(&conn.region.cq()).map_err(|e| format!("completion ring: {e}"))?
            };
            if used + conn.reserved.load(Ordering::Acquire) >= cq_entries {
                return Ok((taken, true));
            }
            let Some(s) = self.sq.pop(&conn.region.sq()).map_err(|e| format!("submission ring: {e}"))? else {
                return Ok((taken, false));
            };
            conn.reserved.fetch_add(1, Ordering::AcqRel);
            taken += 1;
            self.submission(s);
        }
        Ok((taken, false))
    }

    /// A submission's fields in the decoder's neutral form, decoded against `m`.
    fn options(
        m: &ModelEntry,
        priority: i32,
        timeout_us: u64,
        class: u8,
        flags: u32,
        tenant: u32,
    ) -> Result<SubmitOptions, ServeError> {
        if flags & !FLAGS_KNOWN != 0 {
            return Err(ServeError::invalid(format!(
                "unknown submission flags {:#x} (known: {FLAGS_KNOWN:#x})",
                flags & !FLAGS_KNOWN
            )));
        }
        let mut p = Params::new();
        p.insert("priority".into(), Param::Int(priority.into()));
        // The one field is the timeout (cancels), or with FLAG_DEADLINE_ONLY the deadline only.
        let key = if flags & FLAG_DEADLINE_ONLY != 0 { decode::DEADLINE_US } else { "timeout" };
        p.insert(key.into(), Param::Uint(timeout_us));
        if let Some(c) = decode::class_code(class)? {
            p.insert("kairos_class".into(), c);
        }
        if flags & FLAG_TENANT != 0 {
            p.insert("kairos_tenant".into(), Param::Uint(tenant.into()));
        }
        // Every output goes back, each into its span.
        Ok(decode::decode(m, &p, &[])?.options)
    }

    fn submission(&mut self, s: Submission) {
        let mut class = Class::BestEffort;
        let mut entry = None;
        let mut path: Option<Result<(), &'static str>> = None;
        let r = (|| -> Result<(), ServeError> {
            let m = self.model(s.model)?;
            class = m.config.class;
            entry = Some(m.clone());
            let t_in = Instant::now();
            let mut options = Self::options(&m, s.priority, s.timeout_us, s.class, s.flags, s.tenant)?;
            options.owner = Some(self.owner);
            class = options.engine.class;
            let (ni, no) = (s.input_count as usize, s.output_count as usize);
            if ni != m.inputs.len() || no != m.outputs.len() {
                return Err(ServeError::invalid(format!(
                    "model '{}' takes {} inputs and gives {} outputs; the submission names {ni} and {no}",
                    m.name(),
                    m.inputs.len(),
                    m.outputs.len()
                )));
            }
            let data_bytes = self.conn.region.layout().data_bytes;
            for (span, decl) in s.inputs[..ni].iter().zip(&m.inputs) {
                check_span(SpanUse::Input, &decl.name, *span, decl.len_bytes(), data_bytes)?;
            }
            let mut outputs = [Span::default(); OUTPUTS_MAX];
            let mut out_lens = [0u64; OUTPUTS_MAX];
            for (i, (span, decl)) in s.outputs[..no].iter().zip(&m.outputs).enumerate() {
                check_span(SpanUse::Output, &decl.name, *span, decl.len_bytes(), data_bytes)?;
                outputs[i] = *span;
                out_lens[i] = decl.len_bytes();
            }
            // Zero-copy when the request's GPU maps the region and the spans suit its kernels;
            // otherwise the inputs are copied out of the region here.
            let inputs = &s.inputs[..ni];
            let written: Vec<MappedSpan> =
                (0..no).map(|i| MappedSpan { offset_bytes: outputs[i].offset, len_bytes: out_lens[i] }).collect();
            let read: Vec<MappedSpan> =
                inputs.iter().map(|sp| MappedSpan { offset_bytes: sp.offset, len_bytes: sp.len }).collect();
            let overlapping = written
                .iter()
                .enumerate()
                .any(|(i, o)| written[..i].iter().any(|p| o.overlaps(p)) || read.iter().any(|p| o.overlaps(p)));
            let region = &self.conn.region;
            let host = &self.host;
            let zero_copy_bytes_max = self.zero_copy_bytes_max;
            let decls = &m.inputs;
            // Counted by data path here, once the path is taken and before the request can
            // complete: a client that has its response and reads the metrics sees it counted.
            let server_metrics = &self.state.metrics;
            let io = |gpu: u32| -> Result<EngineIo, ServeError> {
                let why = match host.mapping(gpu) {
                    Err(_) => "the GPU has no mapping of the region",
                    Ok(_) if overlapping => "an output overlaps an input or another output",
                    Ok(_) if read.iter().chain(&written).map(|sp| sp.len_bytes).sum::<u64>() > zero_copy_bytes_max => {
                        "tensors larger than the zero-copy limit (kernels reading host memory are slower than one copy)"
                    }
                    Ok(h)
                        if read
                            .iter()
                            .chain(&written)
                            .any(|sp| !(h.ptr.0 + sp.offset_bytes).is_multiple_of(h.align_bytes.max(1))) =>
                    {
                        "a span is not aligned for the GPU's kernels"
                    }
                    Ok(h) => {
                        path = Some(Ok(()));
                        server_metrics.shm_zero_copy.fetch_add(1, Ordering::Relaxed);
                        let binding = IoBinding { mapping: h.id, inputs: read.clone(), outputs: written.clone() };
                        return Ok(EngineIo::Bound { inputs: Vec::new(), binding });
                    }
                };
                path = Some(Err(why));
                let mut tensors = Vec::with_capacity(ni);
                for (span, decl) in inputs.iter().zip(decls) {
                    let bytes =
                        region.read_data_vec(*span).map_err(|e| ServeError::invalid(format!("input '{}': {e}", decl.name)))?;
                    tensors.push(Tensor::from_bytes(decl.dtype, decl.shape.clone(), &bytes).map_err(ServeError::Invalid)?);
                }
                server_metrics.shm_copied.fetch_add(1, Ordering::Relaxed);
                Ok(EngineIo::Tensors(tensors))
            };
            let conn = self.conn.clone();
            let tag = s.tag;
            let metrics = m.metrics.clone();
            // Paella's hybrid wait: wake a sleeping client when the last kernel is issued; it polls
            // the ring from then on.
            let early = self.conn.clone();
            let wake = move || early.wake_if_sleeping();
            let submitted = self.state.submit_io(&m, io, options, Some(wake), move |r| {
                let outcome = match &r {
                    Ok(_) => Outcome::Ok,
                    Err(e) => e.status().outcome,
                };
                metrics.count(class, Protocol::Shm, outcome);
                complete_ring(&conn, tag, &outputs[..no], &out_lens[..no], &metrics, r)
            });
            m.metrics.compute_input.add(t_in.elapsed().as_nanos() as u64);
            submitted.map(|_| ())
        })();
        if let Some(Err(why)) = path
            && r.is_ok()
            && self.copy_notes.insert(why)
        {
            info!(reason = why, "shared-memory request copied instead of zero-copy (logged once per client and reason)");
        }
        if let Err(e) = r {
            self.state.count(entry.as_deref(), class, Protocol::Shm, e.status().outcome);
            self.conn.fail(s.tag, &e);
        }
    }

    fn socket_infer(&mut self, tag: u64, r: &mut Reader<'_>) -> Result<(), ServeError> {
        let bad = |e: String| ServeError::invalid(format!("malformed INFER message: {e}"));
        let header = (|| Ok::<_, String>((r.u32()?, r.i32()?, r.u64()?, r.u8()?, r.u32()?, r.u32()?, r.u16()? as usize)))();
        let (handle, priority, timeout_us, class_code, flags, tenant, count) = match header {
            Ok(h) => h,
            Err(e) => {
                let e = bad(e);
                self.state.count(None, Class::BestEffort, Protocol::Shm, e.status().outcome);
                return Err(e);
            }
        };
        let m = match self.model(handle) {
            Ok(m) => m,
            Err(e) => {
                self.state.count(None, Class::BestEffort, Protocol::Shm, e.status().outcome);
                return Err(e);
            }
        };
        let mut class = m.config.class;
        let submitted = (|| -> Result<(), ServeError> {
            let mut options = Self::options(&m, priority, timeout_us, class_code, flags, tenant)?;
            options.owner = Some(self.owner);
            class = options.engine.class;
            if count != m.inputs.len() {
                return Err(ServeError::invalid(format!(
                    "model '{}' takes {} inputs, the message carries {count}",
                    m.name(),
                    m.inputs.len()
                )));
            }
            let mut inputs = Vec::with_capacity(count);
            for decl in &m.inputs {
                let b = r.bytes().map_err(bad)?;
                if b.len() as u64 != decl.len_bytes() {
                    return Err(ServeError::invalid(format!(
                        "input '{}' takes {} bytes, the message carries {}",
                        decl.name,
                        decl.len_bytes(),
                        b.len()
                    )));
                }
                inputs.push(Tensor::from_bytes(decl.dtype, decl.shape.clone(), b).map_err(ServeError::Invalid)?);
            }
            r.finish().map_err(bad)?;
            let out_bytes: u64 = m.outputs.iter().map(|t| t.len_bytes() + 8).sum::<u64>() + 64;
            if out_bytes > wire::MESSAGE_BYTES_MAX as u64 {
                return Err(ServeError::TooLarge(format!(
                    "the outputs of '{}' ({out_bytes} bytes) do not fit a socket message ({} bytes): use the ring",
                    m.name(),
                    wire::MESSAGE_BYTES_MAX
                )));
            }
            if self.conn.socket_in_flight.fetch_add(1, Ordering::AcqRel) >= SOCKET_IN_FLIGHT_MAX {
                self.conn.socket_in_flight.fetch_sub(1, Ordering::AcqRel);
                return Err(ServeError::Overloaded(format!(
                    "{SOCKET_IN_FLIGHT_MAX} socket requests in flight per connection at most"
                )));
            }
            let conn = self.conn.clone();
            let metrics = m.metrics.clone();
            let r = self.state.submit(&m, inputs, options, move |r| {
                metrics.count(class, Protocol::Shm, r.as_ref().map_or_else(|e| e.status().outcome, |_| Outcome::Ok));
                let mut w = Writer::new(wire::OP_INFER);
                w.u64(tag);
                match r {
                    Ok(done) => {
                        w.u32(0)
                            .str("")
                            .u64(done.engine_ns)
                            .u64(done.gpu_ns())
                            .u64(done.timing.queue_ns())
                            .u8(done.timing.deadline_missed as u8);
                        w.u16(done.outputs.len() as u16);
                        for t in &done.outputs {
                            w.bytes(&t.to_bytes());
                        }
                    }
                    Err(e) => {
                        w.u32(e.status().grpc.as_u32()).str(&e.to_string()).u64(0).u64(0).u64(0).u8(0);
                    }
                }
                conn.socket_in_flight.fetch_sub(1, Ordering::AcqRel);
                conn.send_reply(w.buf);
            });
            if r.is_err() {
                self.conn.socket_in_flight.fetch_sub(1, Ordering::AcqRel);
            }
            r.map(|_| ())
        })();
        if let Err(e) = &submitted {
            m.metrics.count(class, Protocol::Shm, e.status().outcome);
        }
        submitted
    }

    /// Sends queued socket replies (blocking on the socket); true if any was sent.
    fn flush_pending(&mut self) -> Result<bool, String> {
        let mut sent = false;
        loop {
            let msg = self.conn.pending.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
            let Some(msg) = msg else { return Ok(sent) };
            rustix::net::send(&self.conn.sock, &msg, SendFlags::NOSIGNAL).map_err(|e| format!("socket: {e}"))?;
            sent = true;
        }
    }
}

/// What a span of a submission carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanUse {
    /// An input: the span holds exactly the tensor's bytes.
    Input,
    /// An output: the span has room for at least the tensor's bytes.
    Output,
}

/// Checks a span a client names for tensor `name` of `tensor_bytes` bytes against its own data
/// area of `data_bytes` bytes: the span must lie wholly inside the area (no u64 wraparound of
/// offset + length) and fit the tensor. Returns the byte range of the area it covers. Every span of
/// a ring submission goes through here before the server reads or writes the region.
pub fn check_span(
    what: SpanUse,
    name: &str,
    span: Span,
    tensor_bytes: u64,
    data_bytes: u64,
) -> Result<std::ops::Range<usize>, ServeError> {
    let kind = match what {
        SpanUse::Input => "input",
        SpanUse::Output => "output",
    };
    let range = span.range_in(data_bytes).ok_or_else(|| {
        ServeError::invalid(format!(
            "{kind} '{name}': bytes {}..{} are outside the data area of {data_bytes} bytes",
            span.offset,
            span.offset as u128 + span.len as u128
        ))
    })?;
    match what {
        SpanUse::Input if span.len != tensor_bytes => {
            Err(ServeError::invalid(format!("input '{name}' takes {tensor_bytes} bytes, its span holds {}", span.len)))
        }
        SpanUse::Output if span.len < tensor_bytes => {
            Err(ServeError::invalid(format!("output '{name}' needs {tensor_bytes} bytes, its span holds {}", span.len)))
        }
        _ => Ok(range),
    }
}

/// The completion callback of a ring request (runs on the dispatcher thread). On the zero-copy
/// path the GPU already wrote the outputs (`out_lens` bytes at the start of each span).
fn complete_ring(
    conn: &Conn,
    tag: u64,
    outputs: &[Span],
    out_lens: &[u64],
    metrics: &crate::metrics::ModelMetrics,
    r: Result<InferDone, ServeError>,
) {
    let done = match r {
        Ok(d) => d,
        Err(e) => return conn.fail(tag, &e),
    };
    let t_out = Instant::now();
    let mut c = Completion {
        tag,
        status: 0,
        output_count: outputs.len() as u8,
        flags: if done.zero_copy { COMPLETION_ZERO_COPY } else { 0 },
        deadline_missed: done.timing.deadline_missed as u8,
        engine_ns: done.engine_ns,
        gpu_ns: done.gpu_ns(),
        queue_ns: done.timing.queue_ns(),
        ..Default::default()
    };
    if done.zero_copy {
        c.output_lens[..out_lens.len()].copy_from_slice(out_lens);
    }
    for (i, (span, t)) in outputs.iter().zip(&done.outputs).enumerate() {
        let bytes = t.to_bytes();
        let target = Span { offset: span.offset, len: bytes.len() as u64 };
        if let Err(e) = conn.region.write_data(target, &bytes) {
            return conn.fail(tag, &ServeError::invalid(format!("output {i}: {e}")));
        }
        c.output_lens[i] = bytes.len() as u64;
    }
    metrics.compute_output.add(t_out.elapsed().as_nanos() as u64);
    conn.complete(c);
}

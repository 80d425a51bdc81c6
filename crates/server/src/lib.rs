//! kairos-server: the front ends. The only layer of kairos that knows JSON, protobuf, HTTP, gRPC
//! or tokio.
//!
//! - [`rest`]: the Open Inference Protocol (KServe v2) over HTTP/1.1 with axum, JSON tensors and
//!   the binary tensor data extension, Triton's repository, configuration and statistics
//!   extensions, and `/metrics`.
//! - [`grpc`]: the same over gRPC with tonic (`proto/inference.proto`, compiled by protox in
//!   build.rs: no protoc).
//! - [`shm`]: the local shared-memory channel (Paella's client path; wire layout and ring in
//!   `kairos_client::shm`).
//! - [`decode`]: the one decoder of request parameters and output selection; each front end
//!   converts its wire form into its neutral form.
//! - [`repository`]: the model repository folder and its `config.toml` format; paths never leave
//!   the repository's root.
//! - [`control`]: who may use the model-control API (`on`, `off`, or a key).
//! - [`tls`]: TLS for the REST and gRPC listeners (rustls, ring), handshakes off the accept path.
//! - [`state`]: one engine per GPU, the model table, load/unload, and the one submission path all
//!   front ends share; [`metrics`]: Prometheus text; [`error`]: one error enum and the table that
//!   maps it to HTTP statuses and gRPC codes.
//!
//! Architecture invariant: front ends never touch scheduler state. They resolve a model, check and
//! decode tensors, and send the engine a command (`Engine::submit_with`, `load_model`,
//! `unload_model`); results come back through the engine's completion callback. Every queue has a
//! limit: the engine's submission queue and job limit (429 / RESOURCE_EXHAUSTED when full), the
//! body and message limits (413), the shared-memory rings (back-pressure) and client count.

#![forbid(unsafe_code)]

pub mod control;
pub mod decode;
pub mod error;
pub mod fixtures;
pub mod grpc;
pub mod inflight;
pub mod metrics;
pub mod repository;
pub mod rest;
pub mod shm;
pub mod state;
pub mod tls;
pub mod worker;

pub use control::ControlAccess;
pub use error::ServeError;
pub use repository::{ModelConfig, ModelSource, Repository};
pub use shm::ShmConfig;
pub use state::{Backend, CancelCause, EngineHandle, StartupProgress, State, StateConfig};
pub use tls::TlsConfig;
pub use worker::{WorkerBackend, WorkerSpawn};

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Default of [`RunningServer::drain`]'s timeout in `kairos serve` (`--drain-timeout-s`).
pub const DRAIN_TIMEOUT_S_DEFAULT: u64 = 30;
/// How long a drain waits for the requests it cancelled at its deadline to be answered.
pub const DRAIN_CANCEL_WAIT: Duration = Duration::from_secs(5);
/// A drain logs the requests still in flight this often.
const DRAIN_LOG_PERIOD: Duration = Duration::from_secs(1);
/// A drain looks at its stop flag this often.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// What [`RunningServer::drain`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// Requests in flight when the drain began.
    pub in_flight_at_start: usize,
    /// Of those (and any accepted while the drain began), cancelled at the deadline.
    pub cancelled: usize,
    /// Requests still not answered when the drain returned (cancelled ones whose answer did not
    /// come within [`DRAIN_CANCEL_WAIT`], or everything when it was stopped early).
    pub left: usize,
    /// A stop (a second signal) cut the drain short.
    pub interrupted: bool,
    pub took: Duration,
}

/// SIGINT (Ctrl-C) and SIGTERM, caught from [`RunningServer::signals`] on: the first one is
/// waited for with [`Signals::wait`], every later one sets [`Signals::again`].
pub struct Signals {
    first: std::sync::mpsc::Receiver<()>,
    again: Arc<AtomicBool>,
}

impl Signals {
    /// Blocks until the first signal.
    pub fn wait(&self) {
        let _ = self.first.recv();
    }

    /// Set by a signal after the first (stop at once).
    pub fn again(&self) -> &Arc<AtomicBool> {
        &self.again
    }
}

/// Everything `kairos serve` configures.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub state: StateConfig,
    /// REST address (`None`: no REST). Port 0 picks a free port.
    pub http: Option<SocketAddr>,
    /// gRPC address (`None`: no gRPC).
    pub grpc: Option<SocketAddr>,
    /// The shared-memory channel (`None`: off).
    pub shm: Option<ShmConfig>,
    /// Largest REST body and gRPC message accepted.
    pub request_bytes_max: usize,
    /// tokio worker threads for REST and gRPC.
    pub threads: usize,
    /// Who may use the model-control API (repository index, load, unload) over REST and gRPC.
    pub control: ControlAccess,
    /// TLS certificate and key (`None`: plain TCP). When set, the REST and gRPC listeners speak
    /// only TLS; the shared-memory channel is local and unaffected.
    pub tls: Option<TlsConfig>,
}

impl ServerConfig {
    /// Local defaults: REST on 8000, gRPC on 8001, no shared memory.
    pub fn new(repository: impl Into<std::path::PathBuf>) -> ServerConfig {
        ServerConfig {
            state: StateConfig { repository: repository.into(), gpus: 1, load: None },
            http: Some(SocketAddr::from(([127, 0, 0, 1], 8000))),
            grpc: Some(SocketAddr::from(([127, 0, 0, 1], 8001))),
            shm: None,
            request_bytes_max: 64 << 20,
            threads: 2,
            control: ControlAccess::On,
            tls: None,
        }
    }
}

/// A started server: its addresses, and the way to stop it.
pub struct RunningServer {
    pub state: Arc<State>,
    runtime: Option<tokio::runtime::Runtime>,
    http_addr: Option<SocketAddr>,
    grpc_addr: Option<SocketAddr>,
    shutdown: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    shm: Option<shm::ShmServer>,
}

impl RunningServer {
    /// Starts the engines, binds the listeners and serves on background threads, then plans and
    /// loads the repository's start-up models on a thread of its own (progress in the log). Returns
    /// once listening: each model serves as soon as it has loaded, and the server is ready (REST
    /// `/v2/health/ready`, gRPC ServerReady) once all were dealt with; until then readiness says
    /// why not ([`State::not_ready_reason`]). Callers that need every model loaded before they go
    /// on call [`RunningServer::wait_until_ready`].
    ///
    /// With [`ServerConfig::tls`], the certificate and key are read and checked first: a file that
    /// cannot be read or parsed, or a key that does not fit the certificate, fails here naming the
    /// file (before any engine starts).
    pub fn start(cfg: ServerConfig, backend: Box<dyn Backend>) -> Result<RunningServer, ServeError> {
        let tls_acceptors = match &cfg.tls {
            Some(t) => {
                let identity = t.load()?;
                Some((identity.acceptor(&[b"http/1.1"])?, identity.acceptor(&[b"h2"])?))
            }
            None => None,
        };
        let state = State::new(cfg.state.clone(), backend)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads.max(1))
            .thread_name("kairos-net")
            .enable_all()
            .build()
            .map_err(|e| ServeError::Internal(format!("cannot start the tokio runtime: {e}")))?;
        let (shutdown, rx) = tokio::sync::watch::channel(false);
        let mut tasks = Vec::new();
        let bind = |addr: SocketAddr| {
            runtime
                .block_on(tokio::net::TcpListener::bind(addr))
                .map_err(|e| ServeError::Internal(format!("cannot listen on {addr}: {e}")))
        };
        let mut http_addr = None;
        if let Some(addr) = cfg.http {
            let listener = bind(addr)?;
            http_addr = listener.local_addr().ok();
            let app =
                rest::App { state: state.clone(), body_bytes_max: cfg.request_bytes_max, control: Arc::new(cfg.control.clone()) };
            let mut rx = rx.clone();
            let router = rest::router(app);
            let tls = tls_acceptors.as_ref().map(|(rest, _)| rest.clone());
            tasks.push(runtime.spawn(async move {
                let signal = async move {
                    let _ = rx.wait_for(|&stop| stop).await;
                };
                let r = match tls {
                    Some(acceptor) => match tls::TlsListener::spawn(listener, acceptor, "REST") {
                        Ok(l) => axum::serve(l, router).with_graceful_shutdown(signal).await,
                        Err(e) => Err(e),
                    },
                    None => {
                        use axum::serve::ListenerExt;
                        let listener = listener.tap_io(|tcp| {
                            let _ = tcp.set_nodelay(true);
                        });
                        axum::serve(listener, router).with_graceful_shutdown(signal).await
                    }
                };
                if let Err(e) = r {
                    tracing::error!(error = %e, "the REST server failed");
                }
            }));
            info!(address = %http_addr.unwrap_or(addr), tls = tls_acceptors.is_some(), "REST (Open Inference Protocol) listening");
        }
        let mut grpc_addr = None;
        if let Some(addr) = cfg.grpc {
            let listener = bind(addr)?;
            grpc_addr = listener.local_addr().ok();
            let svc = grpc::service(state.clone(), cfg.request_bytes_max, cfg.control.clone());
            let mut rx = rx.clone();
            let tls = tls_acceptors.as_ref().map(|(_, grpc)| grpc.clone());
            tasks.push(runtime.spawn(async move {
                let signal = async move {
                    let _ = rx.wait_for(|&stop| stop).await;
                };
                let server = tonic::transport::Server::builder().add_service(svc);
                let r = match tls {
                    Some(acceptor) => match tls::TlsListener::spawn(listener, acceptor, "gRPC") {
                        Ok(l) => server.serve_with_incoming_shutdown(l.into_stream(), signal).await,
                        Err(e) => {
                            tracing::error!(error = %e, "the gRPC server failed");
                            return;
                        }
                    },
                    None => {
                        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
                        server.serve_with_incoming_shutdown(incoming, signal).await
                    }
                };
                if let Err(e) = r {
                    tracing::error!(error = %e, "the gRPC server failed");
                }
            }));
            info!(address = %grpc_addr.unwrap_or(addr), tls = tls_acceptors.is_some(), "gRPC (Open Inference Protocol) listening");
        }
        let shm = match &cfg.shm {
            Some(c) => Some(
                shm::ShmServer::start(state.clone(), c.clone())
                    .map_err(|e| ServeError::Internal(format!("shared-memory socket {}: {e}", c.socket.display())))?,
            ),
            None => None,
        };
        let server = RunningServer { state, runtime: Some(runtime), http_addr, grpc_addr, shutdown, tasks, shm };
        server.state.start_loading()?;
        Ok(server)
    }

    /// Blocks until the start-up models were all dealt with (loaded, or UNAVAILABLE with their
    /// reason), at most `timeout`; see [`State::wait_until_ready`].
    pub fn wait_until_ready(&self, timeout: Duration) -> Result<(), ServeError> {
        self.state.wait_until_ready(timeout)
    }

    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc_addr
    }

    pub fn shm_socket(&self) -> Option<&std::path::Path> {
        self.shm.as_ref().map(|s| s.path())
    }

    /// Catches SIGINT (Ctrl-C) and SIGTERM from now on (they no longer end the process): see
    /// [`Signals`].
    pub fn signals(&self) -> Result<Signals, ServeError> {
        use tokio::signal::unix::{SignalKind, signal};
        let rt = self.runtime.as_ref().ok_or_else(|| ServeError::Unavailable("the server has stopped".into()))?;
        let (mut int, mut term) = {
            let _in_runtime = rt.enter();
            let e = |e: std::io::Error| ServeError::Internal(format!("cannot catch signals: {e}"));
            (signal(SignalKind::interrupt()).map_err(e)?, signal(SignalKind::terminate()).map_err(e)?)
        };
        let (tx, first) = std::sync::mpsc::sync_channel(1);
        let again = Arc::new(AtomicBool::new(false));
        let flag = again.clone();
        rt.spawn(async move {
            let mut seen = 0u32;
            loop {
                let name = tokio::select! {
                    _ = int.recv() => "SIGINT",
                    _ = term.recv() => "SIGTERM",
                };
                seen += 1;
                if seen == 1 {
                    info!(signal = name, "signal received: draining");
                    let _ = tx.try_send(());
                } else {
                    warn!(signal = name, "another signal during the drain: stopping at once");
                    flag.store(true, Ordering::Release);
                }
            }
        });
        Ok(Signals { first, again })
    }

    /// Blocks until SIGINT (Ctrl-C) or SIGTERM; the flag is set by any later one.
    pub fn wait_for_signal(&self) -> Result<Arc<AtomicBool>, ServeError> {
        let s = self.signals()?;
        s.wait();
        Ok(s.again)
    }

    /// Drains, as a supervisor (Kubernetes) expects on SIGTERM: readiness turns false at once
    /// (REST `/v2/health/ready` 503 "the server is draining", gRPC ServerReady false) while
    /// liveness stays true; new inference requests (REST, gRPC, shared memory) are refused with
    /// 503 / UNAVAILABLE; the requests in flight go on until they are all answered or `timeout`
    /// has passed, and then whatever is left is cancelled (its GPU work stopped) and answered 503 /
    /// UNAVAILABLE. Returns once nothing is in flight (waiting [`DRAIN_CANCEL_WAIT`] at most for
    /// the cancelled ones), or at once when `stop` is set (everything left is cancelled then, its
    /// answer not waited for). The listeners stay open: call
    /// [`RunningServer::shutdown`] next. Progress in the log every second.
    pub fn drain(&self, timeout: Duration, stop: &AtomicBool) -> DrainReport {
        let t0 = Instant::now();
        let state = &self.state;
        state.begin_drain();
        let in_flight_at_start = state.in_flight();
        info!(
            requests_in_flight = in_flight_at_start,
            timeout_s = timeout.as_secs_f64(),
            "draining: not ready, new requests refused"
        );
        let deadline = t0 + timeout;
        let mut next_log = t0 + DRAIN_LOG_PERIOD;
        let mut left = in_flight_at_start;
        // Stopped early: everything still in flight is cancelled, and the drain returns at once.
        let stopped = |left: usize, cancelled: usize| {
            let now = state.cancel_all(CancelCause::Drain);
            warn!(requests_in_flight = left, cancelled = now, "drain stopped early: cancelling what is left");
            DrainReport { in_flight_at_start, cancelled: cancelled + now, left, interrupted: true, took: t0.elapsed() }
        };
        while left > 0 && Instant::now() < deadline {
            if stop.load(Ordering::Acquire) {
                return stopped(left, 0);
            }
            left = state.wait_in_flight((Instant::now() + DRAIN_POLL).min(deadline));
            if left > 0 && Instant::now() >= next_log {
                info!(
                    requests_in_flight = left,
                    remaining_s = deadline.saturating_duration_since(Instant::now()).as_secs_f64(),
                    "draining"
                );
                next_log += DRAIN_LOG_PERIOD;
            }
        }
        let mut cancelled = 0;
        if left > 0 {
            cancelled = state.cancel_all(CancelCause::Drain);
            warn!(requests = cancelled, "drain deadline reached: cancelling the requests still in flight");
            let until = Instant::now() + DRAIN_CANCEL_WAIT;
            while left > 0 && Instant::now() < until {
                if stop.load(Ordering::Acquire) {
                    return stopped(left, cancelled);
                }
                left = state.wait_in_flight((Instant::now() + DRAIN_POLL).min(until));
            }
        }
        let report = DrainReport { in_flight_at_start, cancelled, left, interrupted: false, took: t0.elapsed() };
        info!(took_s = report.took.as_secs_f64(), cancelled, left, "drained");
        report
    }

    /// Stops accepting requests, lets the listeners finish their connections (5 s at most), stops
    /// the shared-memory channel and the start-up loader (it finishes the model it is loading,
    /// waited for [`state::LOADER_STOP_WAIT`] at most), then the engines.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.state.begin_shutdown();
        let _ = self.shutdown.send(true);
        if let Some(rt) = self.runtime.take() {
            let tasks = std::mem::take(&mut self.tasks);
            rt.block_on(async {
                for t in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
                }
            });
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        if let Some(s) = self.shm.take() {
            s.stop();
        }
        self.state.stop_loader(state::LOADER_STOP_WAIT);
        info!("kairos serve stopped");
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if self.runtime.is_some() {
            self.stop();
        }
    }
}

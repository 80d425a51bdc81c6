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

pub mod control;
pub mod error;
pub mod fixtures;
pub mod grpc;
pub mod metrics;
pub mod repository;
pub mod rest;
pub mod shm;
mod sim_gpu;
pub mod state;
pub mod tls;

pub use control::ControlAccess;
pub use error::ServeError;
pub use repository::{ModelConfig, ModelSource, Repository};
pub use shm::ShmConfig;
pub use state::{Backend, SimBackend, SimStartProfiles, StartupProgress, State, StateConfig};
pub use tls::TlsConfig;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

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

    /// Blocks until SIGINT (Ctrl-C) or SIGTERM.
    pub fn wait_for_signal(&self) {
        let Some(rt) = &self.runtime else { return };
        rt.block_on(async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
            }
        });
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

//! TLS for the REST and gRPC listeners (`kairos serve --tls-cert FILE --tls-key FILE`): rustls
//! with the ring provider. When configured, both listeners speak only TLS (REST offers ALPN
//! `http/1.1`, gRPC `h2`).
//!
//! One accept loop per listener takes TCP connections (TCP_NODELAY on each) and runs every
//! handshake in a task of its own, so a slow or failing client never holds up the others: at most
//! [`HANDSHAKES_MAX`] handshakes at a time per listener, each cut off after [`HANDSHAKE_TIMEOUT`].
//! A failed handshake closes that one connection and is logged at debug level (clients choose how
//! often that happens; the log is not theirs to fill). Finished handshakes wait in a queue of
//! [`READY_QUEUE`] connections for the HTTP server to take them.

use crate::ServeError;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long one client may take over its handshake before its connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most handshakes in progress at once on one listener; further connections wait in the
/// kernel's accept backlog.
pub const HANDSHAKES_MAX: usize = 256;
/// Finished handshakes waiting for the HTTP server to take them.
pub const READY_QUEUE: usize = 64;
/// The largest certificate or key file read (PEM files are a few KiB).
pub const TLS_FILE_BYTES_MAX: u64 = 1 << 20;

/// The server's certificate chain and private key, as PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    /// The certificate chain (PEM, the server's own certificate first).
    pub cert: PathBuf,
    /// The private key of the first certificate (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// A checked certificate chain and key, ready to make acceptors from.
pub struct TlsIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    cert_path: PathBuf,
    key_path: PathBuf,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        write!(f, "TlsIdentity({} certificates from {})", self.chain.len(), self.cert_path.display())
    }
}

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, ServeError> {
    let fail = |problem: String| ServeError::Invalid(format!("TLS {what} file {}: {problem}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| fail(format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(fail("is not a regular file".into()));
    }
    if meta.len() > TLS_FILE_BYTES_MAX {
        return Err(fail(format!("is {} bytes, more than the {TLS_FILE_BYTES_MAX} a PEM file may have", meta.len())));
    }
    std::fs::read(path).map_err(|e| fail(format!("cannot read it: {e}")))
}

fn pem_problem(e: &pem::Error) -> String {
    match e {
        pem::Error::MissingSectionEnd { .. } => "a PEM section has no END line".into(),
        pem::Error::IllegalSectionStart { .. } => "a PEM BEGIN line is malformed".into(),
        pem::Error::Base64Decode(e) => format!("a PEM section is not valid base64 ({e})"),
        other => format!("is not valid PEM ({other})"),
    }
}

impl TlsConfig {
    /// Reads and checks both files: the certificate file holds at least one certificate, the key
    /// file a private key, and the key belongs to the first certificate. Errors name the file and
    /// the problem.
    pub fn load(&self) -> Result<TlsIdentity, ServeError> {
        let cert_pem = read_pem(&self.cert, "certificate")?;
        let key_pem = read_pem(&self.key, "key")?;
        let cert_err = |p: String| ServeError::Invalid(format!("TLS certificate file {}: {p}", self.cert.display()));
        let key_err = |p: String| ServeError::Invalid(format!("TLS key file {}: {p}", self.key.display()));
        let chain =
            CertificateDer::pem_slice_iter(&cert_pem).collect::<Result<Vec<_>, _>>().map_err(|e| cert_err(pem_problem(&e)))?;
        if chain.is_empty() {
            return Err(cert_err("holds no PEM certificate (a '-----BEGIN CERTIFICATE-----' section)".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
            pem::Error::NoItemsFound => key_err(
                "holds no PEM private key (a '-----BEGIN PRIVATE KEY-----', 'RSA PRIVATE KEY' or 'EC PRIVATE KEY' section)"
                    .into(),
            ),
            e => key_err(pem_problem(&e)),
        })?;
        let identity = TlsIdentity { chain, key, cert_path: self.cert.clone(), key_path: self.key.clone() };
        // Builds one configuration now so that a key that does not fit the certificate fails here.
        identity.server_config(&[])?;
        Ok(identity)
    }
}

impl TlsIdentity {
    fn server_config(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, ServeError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ServeError::Internal(format!("TLS: {e}")))?
            .with_no_client_auth()
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| {
                ServeError::Invalid(format!(
                    "TLS certificate file {} with key file {}: {e}",
                    self.cert_path.display(),
                    self.key_path.display()
                ))
            })?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }

    /// An acceptor that offers the ALPN protocols `alpn` (`b"http/1.1"` for REST, `b"h2"` for gRPC).
    pub fn acceptor(&self, alpn: &[&[u8]]) -> Result<TlsAcceptor, ServeError> {
        Ok(TlsAcceptor::from(Arc::new(self.server_config(alpn)?)))
    }
}

/// A TLS connection the accept loop finished the handshake of.
pub struct TlsIo(TlsStream<TcpStream>);

impl TlsIo {
    /// The ALPN protocol the client and server agreed on, if any.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        self.0.get_ref().1.alpn_protocol()
    }
}

impl AsyncRead for TlsIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for TlsIo {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        tonic::transport::server::Connected::connect_info(self.0.get_ref().0)
    }
}

/// A listener whose connections have finished their TLS handshake. Serves axum directly (it is an
/// `axum::serve::Listener`) and tonic through [`TlsListener::into_stream`]. Must be made inside
/// the tokio runtime (it spawns its accept loop); dropping it stops the loop.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsIo, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Starts the accept loop on `listener`; `what` names the listener in the log.
    pub fn spawn(listener: TcpListener, acceptor: TlsAcceptor, what: &'static str) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        tokio::spawn(accept_loop(listener, acceptor, tx, what));
        Ok(TlsListener { ready, local })
    }

    /// The finished connections as a stream, for tonic's `serve_with_incoming_shutdown`.
    pub fn into_stream(self) -> impl tokio_stream::Stream<Item = std::io::Result<TlsIo>> + Send + 'static {
        use tokio_stream::StreamExt;
        tokio_stream::wrappers::ReceiverStream::new(self.ready).map(|(io, _)| Ok(io))
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TlsIo, SocketAddr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept loop ended (it only does so once this listener is gone, or if the
            // runtime is shutting down): no more connections.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, ready: mpsc::Sender<(TlsIo, SocketAddr)>, what: &'static str) {
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_MAX));
    loop {
        let permit = tokio::select! {
            p = handshakes.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = ready.closed() => return,
        };
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors or a connection reset before accept: wait a moment
                    // (an immediate retry would spin), then go on.
                    tracing::warn!(listener = what, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = ready.closed() => return,
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                // The permit is held until the connection is queued: waiting connections count
                // towards the limit too.
                Ok(Ok(tls)) => {
                    let _ = ready.send((TlsIo(tls), peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(listener = what, %peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(listener = what, %peer, "TLS handshake timed out"),
            }
        });
    }
}

//! kairos-client: talk to a kairos server.
//!
//! - [`shm`]: the local shared-memory channel (Paella's client path). A client maps a region the
//!   server created for it, writes input tensors in place, submits through a lock-free ring and
//!   waits with the hybrid scheme (sleep on an eventfd, then poll). Also the channel's wire layout
//!   and its ring, which the server uses too: one definition for both sides.
//! - [`grpc`] and [`rest`] (feature `remote`, on by default): the Open Inference Protocol (KServe
//!   v2) over gRPC (tonic) and HTTP/JSON with the binary tensor extension (hyper).
//!
//! Both remote clients can connect over TLS (`https://` urls, trusting a CA certificate given as
//! PEM: rustls with the ring provider) and send the model-control key on repository calls; see
//! [`rest::RestClient::builder`] and [`grpc::GrpcClient::builder`].
//!
//! Errors carry the server's status as a [`Code`] (gRPC numbering; HTTP statuses map onto it).
//! Tensors are `kairos_core::Tensor`s (f32, f16, i64).

// Unsafe code only where an item says why (allow(unsafe_code) beside its SAFETY contract).
#![deny(unsafe_code)]

// Shared memory: mapping a region another process writes, and a lock-free ring in it (SAFETY
// comments at each block; loom tests for the ring).
#[allow(unsafe_code)]
pub mod shm;

#[cfg(feature = "remote")]
pub mod grpc;
#[cfg(feature = "remote")]
pub mod rest;
#[cfg(feature = "remote")]
mod tls;

/// The REST header and gRPC metadata key that carries the model-control key (servers started with
/// `kairos serve --control-api KEY` want it on repository index, load and unload).
pub const CONTROL_KEY_HEADER: &str = "x-kairos-control-key";

/// The generated gRPC types of `proto/inference.proto` (package `inference`).
#[cfg(feature = "remote")]
pub mod pb {
    tonic::include_proto!("inference");
}

/// A status code, in gRPC's numbering (the shared-memory channel uses the same numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    Ok,
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn as_u32(self) -> u32 {
        self as u32
    }

    pub fn from_u32(v: u32) -> Code {
        use Code::*;
        [
            Ok,
            Cancelled,
            Unknown,
            InvalidArgument,
            DeadlineExceeded,
            NotFound,
            AlreadyExists,
            PermissionDenied,
            ResourceExhausted,
            FailedPrecondition,
            Aborted,
            OutOfRange,
            Unimplemented,
            Internal,
            Unavailable,
            DataLoss,
            Unauthenticated,
        ]
        .get(v as usize)
        .copied()
        .unwrap_or(Unknown)
    }

    /// The code an HTTP status of kairos' REST API stands for.
    pub fn from_http(status: u16) -> Code {
        match status {
            200..=299 => Code::Ok,
            400 | 413 | 415 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            429 => Code::ResourceExhausted,
            499 => Code::Cancelled,
            503 => Code::Unavailable,
            501 => Code::Unimplemented,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error.
    #[error("server: {code:?}: {message}")]
    Server { code: Code, message: String },
    /// Connecting, sending or receiving failed.
    #[error("transport: {0}")]
    Transport(String),
    /// The server's answer could not be understood.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The caller asked for something this client cannot do (wrong tensor count, too many requests
    /// in flight, a buffer too small).
    #[error("{0}")]
    Usage(String),
}

impl ClientError {
    /// The server's code, if the server answered.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, ClientError>;

/// An error with its sources (transport errors of hyper and tonic say little at the top: the
/// reason, a refused connection or a certificate the client does not trust, is further down).
#[cfg(feature = "remote")]
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        // Some errors already print their source.
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

/// What the server measured about one request (REST and gRPC carry it in the response's
/// parameters, the shared-memory channel in its completion).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerTiming {
    /// Wall time inside the engine: submission to completion.
    pub engine_ns: u64,
    /// First kernel issued to done on the engine's GPU clock (simulated time on the simulator).
    pub gpu_ns: u64,
    /// Arrival to first kernel issued, on the engine's GPU clock.
    pub queue_ns: u64,
    pub deadline_missed: bool,
}

/// Options of one request (all default to the model's configuration).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InferOptions {
    /// Triton's convention: 0 = the model's priority, 1 = the most urgent, larger = less urgent.
    pub priority: u32,
    /// Deadline (latency target) in microseconds; 0: the model's. The server also cancels a request
    /// not answered within it (504 / DEADLINE_EXCEEDED).
    pub timeout_us: u64,
    /// A deadline in microseconds with no cancellation (the `kairos_deadline_us` parameter): the
    /// server schedules for it and reports a miss (`ServerTiming::deadline_missed`), and a late
    /// result is still delivered; 0: none. With `timeout_us` too, this is the deadline and
    /// `timeout_us` only cancels (the shared-memory channel carries one of the two: both is refused).
    pub deadline_us: u64,
    /// Overrides the model's class.
    pub real_time: Option<bool>,
    pub tenant: Option<u32>,
}

/// A tensor's name, protocol datatype ("FP32", "FP16", "INT64", ...) and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// The answer to one inference request over gRPC or REST.
#[derive(Clone, Debug, PartialEq)]
pub struct InferResult {
    pub model_name: String,
    pub model_version: String,
    pub id: String,
    /// Outputs in the order the server sent them, by name.
    pub outputs: Vec<(String, kairos_core::Tensor)>,
    pub timing: ServerTiming,
}

impl InferResult {
    pub fn output(&self, name: &str) -> Option<&kairos_core::Tensor> {
        self.outputs.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
}

/// The kairos element type of a protocol datatype string.
pub fn dtype_of(datatype: &str) -> Option<kairos_core::DType> {
    match datatype {
        "FP32" => Some(kairos_core::DType::F32),
        "FP16" => Some(kairos_core::DType::F16),
        "INT64" => Some(kairos_core::DType::I64),
        _ => None,
    }
}

/// Shape as the protocol writes it.
pub fn shape_i64(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| d as i64).collect()
}

/// Shape from the protocol, refusing negative dimensions.
pub fn shape_usize(shape: &[i64]) -> std::result::Result<Vec<usize>, String> {
    shape.iter().map(|&d| usize::try_from(d).map_err(|_| format!("dimension {d} in shape {shape:?}"))).collect()
}

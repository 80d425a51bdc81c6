//! The soak: constant open-loop load on a running kairos server through REST (JSON and binary
//! tensors) and gRPC, with a flood of bad input mixed in, every good answer checked against the
//! outputs the caller computed up front. `kairos bench soak` starts the server as a child process,
//! samples its memory ([`process_tree_rss_bytes`]) and judges the run; this module is the client
//! side and knows nothing of how the server was started.
//!
//! Schedule: request `i` is due at `i / rate` seconds; client thread `i % clients` sends it at that
//! time whether or not earlier requests came back (open loop: a slow server does not slow the
//! offered load). Whether request `i` is good or bad, its model, protocol and (for bad ones) the
//! kind of bad input come from the seed.

use crate::Error;
use kairos_client::grpc::{GrpcClient, infer_request};
use kairos_client::rest::RestClient;
use kairos_client::{ClientError, Code, InferOptions, InferResult};
use kairos_ir::Tensor;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Failures kept verbatim per bad-input kind (the rest are counted).
const FAILURES_KEPT_MAX: usize = 5;
/// Wrong or failed good answers kept verbatim in the summary (every one is in the records).
const EXAMPLES_KEPT_MAX: usize = 10;

/// One model the soak sends to, with its inputs and the outputs they must produce.
#[derive(Clone, Debug)]
pub struct SoakModel {
    pub name: String,
    /// Input names in the model's order.
    pub input_names: Vec<String>,
    /// Input sets and the expected outputs of each, by output name.
    pub cases: Vec<SoakCase>,
    /// Largest relative L2 error an output may have against the expected one.
    pub tolerance: f64,
}

#[derive(Clone, Debug)]
pub struct SoakCase {
    pub inputs: Vec<Tensor>,
    pub expected: Vec<(String, Tensor)>,
}

#[derive(Clone, Debug)]
pub struct SoakOptions {
    /// The server's REST and gRPC base URLs (`http://host:port`).
    pub http: String,
    pub grpc: String,
    pub duration: Duration,
    /// Requests per second, good and bad together.
    pub rate_per_s: f64,
    /// Share of the requests that are bad input.
    pub bad_fraction: f64,
    /// Client threads, each with its own connections.
    pub clients: usize,
    /// A request without an answer by then is lost (good) or a hang (bad).
    pub timeout: Duration,
    /// The server's body / message limit: oversized requests go one past it.
    pub request_bytes_max: usize,
    /// Requests one client thread keeps in flight at most; a request due beyond it is not sent
    /// (counted as `not_sent`: the client, not the server, fell behind).
    pub in_flight_max: usize,
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    RestJson,
    RestBinary,
    Grpc,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::RestJson => "rest-json",
            Protocol::RestBinary => "rest-binary",
            Protocol::Grpc => "grpc",
        }
    }
}

/// The kinds of bad input, each with the answer it must get.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BadKind {
    RestMalformedJson,
    RestWrongShape,
    RestWrongDatatype,
    RestUnknownModel,
    RestUnknownVersion,
    RestMissingInput,
    RestTruncatedBinary,
    RestOversized,
    RestOversizedChunked,
    RestGarbageHttp,
    RestDisconnectMidBody,
    RestAbandoned,
    GrpcGarbageProtobuf,
    GrpcWrongShape,
    GrpcWrongDatatype,
    GrpcUnknownModel,
    GrpcTruncatedRaw,
    GrpcMissingInput,
    GrpcOversized,
    GrpcCancelled,
}

impl BadKind {
    pub const ALL: [BadKind; 20] = [
        BadKind::RestMalformedJson,
        BadKind::RestWrongShape,
        BadKind::RestWrongDatatype,
        BadKind::RestUnknownModel,
        BadKind::RestUnknownVersion,
        BadKind::RestMissingInput,
        BadKind::RestTruncatedBinary,
        BadKind::RestOversized,
        BadKind::RestOversizedChunked,
        BadKind::RestGarbageHttp,
        BadKind::RestDisconnectMidBody,
        BadKind::RestAbandoned,
        BadKind::GrpcGarbageProtobuf,
        BadKind::GrpcWrongShape,
        BadKind::GrpcWrongDatatype,
        BadKind::GrpcUnknownModel,
        BadKind::GrpcTruncatedRaw,
        BadKind::GrpcMissingInput,
        BadKind::GrpcOversized,
        BadKind::GrpcCancelled,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BadKind::RestMalformedJson => "rest-malformed-json",
            BadKind::RestWrongShape => "rest-wrong-shape",
            BadKind::RestWrongDatatype => "rest-wrong-datatype",
            BadKind::RestUnknownModel => "rest-unknown-model",
            BadKind::RestUnknownVersion => "rest-unknown-version",
            BadKind::RestMissingInput => "rest-missing-input",
            BadKind::RestTruncatedBinary => "rest-truncated-binary",
            BadKind::RestOversized => "rest-oversized",
            BadKind::RestOversizedChunked => "rest-oversized-chunked",
            BadKind::RestGarbageHttp => "rest-garbage-http",
            BadKind::RestDisconnectMidBody => "rest-disconnect-mid-body",
            BadKind::RestAbandoned => "rest-abandoned",
            BadKind::GrpcGarbageProtobuf => "grpc-garbage-protobuf",
            BadKind::GrpcWrongShape => "grpc-wrong-shape",
            BadKind::GrpcWrongDatatype => "grpc-wrong-datatype",
            BadKind::GrpcUnknownModel => "grpc-unknown-model",
            BadKind::GrpcTruncatedRaw => "grpc-truncated-raw",
            BadKind::GrpcMissingInput => "grpc-missing-input",
            BadKind::GrpcOversized => "grpc-oversized",
            BadKind::GrpcCancelled => "grpc-cancelled",
        }
    }

    /// What must come back. The oversized kinds are rarer (each sends a body past the limit).
    fn expect(self) -> Expect {
        use BadKind::*;
        match self {
            RestMalformedJson | RestWrongShape | RestWrongDatatype | RestMissingInput | RestTruncatedBinary => {
                Expect::Http(&[400])
            }
            RestUnknownModel | RestUnknownVersion => Expect::Http(&[404]),
            RestOversized => Expect::Http(&[413]),
            // The server may close the connection while the body is still being written (the
            // 413 is then lost with the reset): the server's health is judged by the rest.
            RestOversizedChunked => Expect::HttpOrClosed(&[413]),
            RestGarbageHttp => Expect::HttpOrClosed(&[400]),
            RestDisconnectMidBody | RestAbandoned | GrpcCancelled => Expect::Nothing,
            GrpcGarbageProtobuf | GrpcWrongShape | GrpcWrongDatatype | GrpcTruncatedRaw | GrpcMissingInput => {
                Expect::Grpc(&[Code::InvalidArgument])
            }
            GrpcUnknownModel => Expect::Grpc(&[Code::NotFound]),
            // tonic refuses a message past its limit before decoding it.
            GrpcOversized => Expect::Grpc(&[Code::OutOfRange, Code::ResourceExhausted]),
        }
    }

    /// Relative frequency among bad requests.
    fn weight(self) -> u64 {
        match self {
            BadKind::RestOversized | BadKind::RestOversizedChunked | BadKind::GrpcOversized => 1,
            _ => 4,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Expect {
    Http(&'static [u16]),
    HttpOrClosed(&'static [u16]),
    Grpc(&'static [Code]),
    /// The client goes away: no answer to check (the server must keep serving).
    Nothing,
}

/// What one request got.
#[derive(Debug)]
enum Answer {
    Http(u16),
    Grpc(Code),
    /// Closed by the server without a status line.
    Closed,
    /// The client went away on purpose.
    Gone,
    Transport(String),
    Timeout,
}

impl Answer {
    fn label(&self) -> String {
        match self {
            Answer::Http(s) => format!("HTTP {s}"),
            Answer::Grpc(c) => format!("{c:?}"),
            Answer::Closed => "closed without an answer".into(),
            Answer::Gone => "client went away".into(),
            Answer::Transport(_) => "transport error".into(),
            Answer::Timeout => "no answer (hang)".into(),
        }
    }
}

/// Whether `answer` is what `expect` allows.
fn judge(expect: Expect, answer: &Answer) -> bool {
    match (expect, answer) {
        (Expect::Http(ok) | Expect::HttpOrClosed(ok), Answer::Http(s)) => ok.contains(s),
        (Expect::HttpOrClosed(_), Answer::Closed) => true,
        (Expect::Grpc(ok), Answer::Grpc(c)) => ok.contains(c),
        (Expect::Nothing, Answer::Gone | Answer::Closed) => true,
        (Expect::Nothing, Answer::Http(s)) => *s < 500,
        (Expect::Nothing, Answer::Grpc(c)) => !server_fault(*c),
        _ => false,
    }
}

/// gRPC codes that say the server failed rather than the request.
fn server_fault(c: Code) -> bool {
    matches!(c, Code::Internal | Code::Unknown | Code::Unavailable | Code::DataLoss)
}

/// One good request's record.
#[derive(Clone, Debug, Serialize)]
pub struct GoodRecord {
    /// When it was due, ms after the start of the load.
    pub t_ms: f64,
    pub model: String,
    pub protocol: Protocol,
    /// Due time to answer (0 when lost or not sent).
    pub latency_us: u64,
    /// correct, wrong, error, overloaded, lost, not-sent.
    pub outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Largest relative L2 error of its outputs (answered ones).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_rel_l2: Option<f64>,
    /// Every output byte equal to the expected one.
    pub bit_exact: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct BadStats {
    pub sent: u64,
    /// Answers by label ("HTTP 400", "InvalidArgument", "closed without an answer", ...).
    pub answers: BTreeMap<String, u64>,
    /// Answers the kind does not allow: a 5xx, a success, a hang, another code.
    pub failed: u64,
    pub failures: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct GoodSummary {
    pub sent: u64,
    pub correct: u64,
    pub wrong: u64,
    /// Answered with an error other than overload, by status.
    pub errors: BTreeMap<String, u64>,
    /// 429 / RESOURCE_EXHAUSTED: the server shed load (not a failure; counted apart).
    pub overloaded: u64,
    pub lost: u64,
    pub not_sent: u64,
    pub bit_exact: u64,
    pub error_rel_l2_max: f64,
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
    pub latency_max_us: f64,
    pub examples: Vec<String>,
}

impl GoodSummary {
    pub fn errors_total(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// Counters so far, for the progress line.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub elapsed: Duration,
    pub good_sent: u64,
    pub good_correct: u64,
    pub good_wrong: u64,
    pub good_errors: u64,
    pub good_lost: u64,
    pub bad_sent: u64,
    pub bad_failed: u64,
}

#[derive(Debug)]
pub struct SoakResult {
    pub good: GoodSummary,
    pub bad: BTreeMap<&'static str, BadStats>,
    pub records: Vec<GoodRecord>,
    /// Load time actually run (shorter when the progress callback stopped it).
    pub elapsed: Duration,
    pub stopped_early: bool,
}

impl SoakResult {
    pub fn bad_sent(&self) -> u64 {
        self.bad.values().map(|b| b.sent).sum()
    }
    pub fn bad_failed(&self) -> u64 {
        self.bad.values().map(|b| b.failed).sum()
    }
}

/// xorshift64*: every random choice of the soak.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What request `i` is.
#[derive(Clone, Copy, Debug)]
enum Plan {
    Good { model: usize, case: usize, protocol: Protocol },
    Bad { model: usize, case: usize, kind: BadKind },
}

fn plan_of(i: u64, seed: u64, models: &[SoakModel], bad_fraction: f64) -> Plan {
    let mut r = Rng::new(seed ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93));
    let model = r.below(models.len() as u64) as usize;
    let case = r.below(models[model].cases.len() as u64) as usize;
    if r.unit() < bad_fraction {
        let total: u64 = BadKind::ALL.iter().map(|k| k.weight()).sum();
        let mut pick = r.below(total);
        let kind = BadKind::ALL
            .iter()
            .copied()
            .find(|k| {
                if pick < k.weight() {
                    true
                } else {
                    pick -= k.weight();
                    false
                }
            })
            .unwrap_or(BadKind::RestMalformedJson);
        Plan::Bad { model, case, kind }
    } else {
        let protocol = [Protocol::RestJson, Protocol::RestBinary, Protocol::Grpc][r.below(3) as usize];
        Plan::Good { model, case, protocol }
    }
}

/// What a client thread reports for one request.
enum Event {
    Good(GoodRecord),
    Bad { kind: BadKind, answer: Answer, ok: bool, detail: String },
}

fn named<'a>(m: &'a SoakModel, inputs: &'a [Tensor]) -> Vec<(&'a str, &'a Tensor)> {
    m.input_names.iter().map(String::as_str).zip(inputs.iter()).collect()
}

/// Compares an answer with the expected outputs: `Ok((max relative L2 error, bit exact))` or what
/// is wrong.
fn compare(m: &SoakModel, case: &SoakCase, got: &InferResult) -> Result<(f64, bool), String> {
    if got.outputs.len() != case.expected.len() {
        return Err(format!("{} outputs, expected {}", got.outputs.len(), case.expected.len()));
    }
    let (mut worst, mut exact) = (0.0f64, true);
    for (name, want) in &case.expected {
        let g = got.output(name).ok_or_else(|| format!("no output '{name}'"))?;
        if g.shape != want.shape {
            return Err(format!("output '{name}' has shape {:?}, expected {:?}", g.shape, want.shape));
        }
        let (gv, wv) = (g.to_f32_vec(), want.to_f32_vec());
        let e = kairos_ir::tensor::relative_l2_error(&gv, &wv);
        worst = worst.max(e);
        exact &= g.dtype() == want.dtype() && g.to_bytes() == want.to_bytes();
        if e > m.tolerance || e.is_nan() {
            return Err(format!(
                "output '{name}': relative L2 error {e:.3e} over {:.0e}; got {:?}... expected {:?}...",
                m.tolerance,
                &gv[..4.min(gv.len())],
                &wv[..4.min(wv.len())]
            ));
        }
    }
    Ok((worst, exact))
}

/// The answer a client error stands for.
fn answer_of(e: &ClientError, protocol_http: bool) -> Answer {
    match e {
        ClientError::Server { code, message } => {
            if protocol_http {
                // "HTTP nnn: ..." (see `HttpReply::error`).
                let status = message.strip_prefix("HTTP ").and_then(|s| s.get(..3)).and_then(|s| s.parse().ok());
                match status {
                    Some(s) => Answer::Http(s),
                    None => Answer::Transport(format!("{code:?}: {message}")),
                }
            } else {
                Answer::Grpc(*code)
            }
        }
        other => Answer::Transport(other.to_string()),
    }
}

/// One input set's REST bodies: the JSON body, and the binary body with its JSON header's length.
type RestBodies = (Vec<u8>, (Vec<u8>, usize));

/// A client thread's shared pieces.
struct Shared {
    opts: SoakOptions,
    models: Vec<SoakModel>,
    /// REST JSON and binary bodies per (model, case).
    bodies: Vec<Vec<RestBodies>>,
    http_addr: String,
}

async fn good_request(
    s: &Shared,
    rest: &RestClient,
    grpc: &GrpcClient,
    model: usize,
    case: usize,
    protocol: Protocol,
) -> Result<InferResult, ClientError> {
    let m = &s.models[model];
    let c = &m.cases[case];
    match protocol {
        Protocol::RestJson | Protocol::RestBinary => {
            let path = format!("/v2/models/{}/infer", m.name);
            let (body, header) = if protocol == Protocol::RestJson {
                (s.bodies[model][case].0.clone(), None)
            } else {
                let (b, n) = &s.bodies[model][case].1;
                (b.clone(), Some(*n))
            };
            let reply = rest.request("POST", &path, body, header).await?;
            kairos_client::rest::decode_infer_reply(&reply)
        }
        Protocol::Grpc => grpc.infer(&m.name, "", &named(m, &c.inputs), &InferOptions::default()).await,
    }
}

/// Sends raw bytes on a fresh connection and reads the status line; `close_after_send` drops the
/// connection without reading (the client going away).
async fn raw_http(addr: &str, head: String, body: &[u8], close_after_send: bool, chunk_bytes: usize) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = match tokio::net::TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => return Answer::Transport(format!("connect: {e}")),
    };
    let _ = s.set_nodelay(true);
    let mut sent = s.write_all(head.as_bytes()).await;
    if sent.is_ok() {
        for c in body.chunks(chunk_bytes.max(1)) {
            sent = s.write_all(c).await;
            if sent.is_err() {
                break;
            }
        }
    }
    if close_after_send {
        return Answer::Gone;
    }
    // The status line: "HTTP/1.1 413 Payload Too Large".
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    loop {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.windows(2).any(|w| w == b"\r\n") || buf.len() > 4096 {
                    break;
                }
            }
        }
    }
    let text = String::from_utf8_lossy(&buf);
    match text.split(' ').nth(1).and_then(|c| c.parse::<u16>().ok()) {
        Some(code) if text.starts_with("HTTP/") => Answer::Http(code),
        _ => Answer::Closed,
    }
}

/// gRPC with raw bytes as the message (garbage protobuf).
mod raw_grpc {
    use bytes::{Buf, BufMut};
    use tonic::Status;
    use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    #[derive(Clone, Copy, Default)]
    pub struct Bytes;
    pub struct Enc;
    pub struct Dec;

    impl Codec for Bytes {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = Enc;
        type Decoder = Dec;
        fn encoder(&mut self) -> Enc {
            Enc
        }
        fn decoder(&mut self) -> Dec {
            Dec
        }
    }

    impl Encoder for Enc {
        type Item = Vec<u8>;
        type Error = Status;
        fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
            dst.put_slice(&item);
            Ok(())
        }
        fn buffer_settings(&self) -> BufferSettings {
            BufferSettings::default()
        }
    }

    impl Decoder for Dec {
        type Item = Vec<u8>;
        type Error = Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
            let v = src.chunk().to_vec();
            src.advance(v.len());
            Ok(Some(v))
        }
        fn buffer_settings(&self) -> BufferSettings {
            BufferSettings::default()
        }
    }

    pub async fn model_infer(channel: tonic::transport::Channel, message: Vec<u8>) -> Result<Vec<u8>, Status> {
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.map_err(|e| Status::unavailable(e.to_string()))?;
        let path = tonic::codegen::http::uri::PathAndQuery::from_static("/inference.GRPCInferenceService/ModelInfer");
        grpc.unary(tonic::Request::new(message), path, Bytes).await.map(|r| r.into_inner())
    }
}

async fn bad_request(
    s: &Shared,
    grpc: &GrpcClient,
    channel: &tonic::transport::Channel,
    model: usize,
    case: usize,
    kind: BadKind,
    salt: u64,
) -> Answer {
    use serde_json::json;
    let m = &s.models[model];
    let c = &m.cases[case];
    let addr = s.http_addr.as_str();
    let infer_path = format!("/v2/models/{}/infer", m.name);
    let post = |path: &str, body: &[u8], extra: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n",
            body.len()
        )
    };
    let first = &c.inputs[0];
    let first_name = &m.input_names[0];
    let json_of = |v: serde_json::Value| serde_json::to_vec(&v).expect("plain JSON");
    let zeros_f32 = |n: usize| vec![0.0f32; n];
    let grpc_err = |r: Result<InferResult, ClientError>| match r {
        Ok(_) => Answer::Grpc(Code::Ok),
        Err(e) => answer_of(&e, false),
    };
    match kind {
        BadKind::RestMalformedJson => {
            // The good body cut in the middle.
            let good = &s.bodies[model][case].0;
            let cut = &good[..(good.len() / 2).max(1)];
            raw_http(addr, post(&infer_path, cut, ""), cut, false, 1 << 16).await
        }
        BadKind::RestWrongShape => {
            let mut shape: Vec<i64> = first.shape.iter().map(|&d| d as i64).collect();
            shape.push(2);
            let n = first.len() * 2;
            let b = json_of(
                json!({ "inputs": [{ "name": first_name, "datatype": first.dtype().kserve_name(), "shape": shape, "data": zeros_f32(n) }] }),
            );
            raw_http(addr, post(&infer_path, &b, ""), &b, false, 1 << 16).await
        }
        BadKind::RestWrongDatatype => {
            let dt = if first.dtype() == kairos_ir::DType::I64 { "FP32" } else { "INT64" };
            let b = json_of(
                json!({ "inputs": [{ "name": first_name, "datatype": dt, "shape": first.shape, "data": vec![1; first.len()] }] }),
            );
            raw_http(addr, post(&infer_path, &b, ""), &b, false, 1 << 16).await
        }
        BadKind::RestUnknownModel => {
            let b = &s.bodies[model][case].0;
            let path = format!("/v2/models/{}_no_such_model_{}/infer", m.name, salt % 1000);
            raw_http(addr, post(&path, b, ""), b, false, 1 << 16).await
        }
        BadKind::RestUnknownVersion => {
            let b = &s.bodies[model][case].0;
            let path = format!("/v2/models/{}/versions/{}/infer", m.name, 900 + salt % 99);
            raw_http(addr, post(&path, b, ""), b, false, 1 << 16).await
        }
        BadKind::RestMissingInput => {
            let b = json_of(json!({ "inputs": [] }));
            raw_http(addr, post(&infer_path, &b, ""), &b, false, 1 << 16).await
        }
        BadKind::RestTruncatedBinary => {
            let (body, n) = &s.bodies[model][case].1;
            // One byte short of the last tensor, or up to half of it.
            let tensor_bytes = body.len() - n;
            let cut = 1 + (salt as usize % tensor_bytes.div_ceil(2).max(1));
            let b = &body[..body.len() - cut.min(tensor_bytes)];
            let head = format!(
                "POST {infer_path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/octet-stream\r\ninference-header-content-length: {n}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                b.len()
            );
            raw_http(addr, head, b, false, 1 << 16).await
        }
        BadKind::RestOversized => {
            // Content-Length past the limit: 413 before the body is read (a first part is sent).
            let declared = s.opts.request_bytes_max + 1;
            let head = format!(
                "POST {infer_path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\nconnection: close\r\n\r\n"
            );
            raw_http(addr, head, &[b' '; 4096], false, 4096).await
        }
        BadKind::RestOversizedChunked => {
            // No Content-Length: the limit must hold while reading.
            let head = format!(
                "POST {infer_path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            );
            let piece = 1 << 16;
            let mut body = Vec::with_capacity(s.opts.request_bytes_max + 2 * piece);
            while body.len() < s.opts.request_bytes_max + piece {
                body.extend_from_slice(format!("{piece:x}\r\n").as_bytes());
                body.extend(std::iter::repeat_n(b' ', piece));
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n\r\n");
            raw_http(addr, head, &body, false, piece).await
        }
        BadKind::RestGarbageHttp => {
            let mut r = Rng::new(salt);
            let junk: Vec<u8> = (0..64).map(|_| r.next() as u8).collect();
            let mut head = String::from("\u{1}GARBAGE \u{7f} HTTP/9.9\r\n");
            head.push_str(&String::from_utf8_lossy(&junk).replace('\n', " "));
            head.push_str("\r\n\r\n");
            raw_http(addr, head, &[], false, 1).await
        }
        BadKind::RestDisconnectMidBody => {
            let b = &s.bodies[model][case].0;
            let half = &b[..b.len() / 2];
            raw_http(addr, post(&infer_path, b, ""), half, true, 1 << 16).await
        }
        BadKind::RestAbandoned => {
            // A whole good request; the client leaves before the answer.
            let b = &s.bodies[model][case].0;
            raw_http(addr, post(&infer_path, b, ""), b, true, 1 << 16).await
        }
        BadKind::GrpcGarbageProtobuf => {
            // Field 1 (model_name) claiming a length far past the message, then noise.
            let mut r = Rng::new(salt);
            let mut msg = vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f];
            msg.extend((0..(r.below(64) as usize)).map(|_| r.next() as u8));
            match raw_grpc::model_infer(channel.clone(), msg).await {
                Ok(_) => Answer::Grpc(Code::Ok),
                Err(st) => Answer::Grpc(Code::from_u32(st.code() as i32 as u32)),
            }
        }
        BadKind::GrpcWrongShape => {
            let mut req = infer_request(&m.name, "", &named(m, &c.inputs), &InferOptions::default());
            req.inputs[0].shape.push(1);
            req.inputs[0].shape[0] += 1;
            grpc_err(grpc.infer_raw(req).await)
        }
        BadKind::GrpcWrongDatatype => {
            let mut req = infer_request(&m.name, "", &named(m, &c.inputs), &InferOptions::default());
            req.inputs[0].datatype = "BYTES".into();
            grpc_err(grpc.infer_raw(req).await)
        }
        BadKind::GrpcUnknownModel => {
            let req = infer_request(&format!("{}_no_such_model", m.name), "", &named(m, &c.inputs), &InferOptions::default());
            grpc_err(grpc.infer_raw(req).await)
        }
        BadKind::GrpcTruncatedRaw => {
            let mut req = infer_request(&m.name, "", &named(m, &c.inputs), &InferOptions::default());
            let n = req.raw_input_contents[0].len();
            req.raw_input_contents[0] = req.raw_input_contents[0].slice(..n - 1 - (salt as usize % n.max(1)).min(n - 1));
            grpc_err(grpc.infer_raw(req).await)
        }
        BadKind::GrpcMissingInput => {
            let mut req = infer_request(&m.name, "", &named(m, &c.inputs), &InferOptions::default());
            req.inputs.clear();
            req.raw_input_contents.clear();
            grpc_err(grpc.infer_raw(req).await)
        }
        BadKind::GrpcOversized => {
            let mut req = infer_request(&m.name, "", &named(m, &c.inputs), &InferOptions::default());
            req.id = "x".repeat(s.opts.request_bytes_max + 1);
            grpc_err(grpc.infer_raw(req).await)
        }
        BadKind::GrpcCancelled => {
            // A good request dropped after 0 to 2 ms: the stream is reset while the server works.
            let wait = Duration::from_micros(salt % 2000);
            match tokio::time::timeout(wait, grpc.infer(&m.name, "", &named(m, &c.inputs), &InferOptions::default())).await {
                Err(_) => Answer::Gone,
                Ok(r) => grpc_err(r),
            }
        }
    }
}

/// One client thread: sends requests `k, k + clients, ...` at their due times.
fn client_thread(
    k: usize,
    s: Arc<Shared>,
    start: Instant,
    stop: Arc<AtomicBool>,
    events: mpsc::Sender<Event>,
) -> Result<(), Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start a tokio runtime: {e}")))?;
    let rest = RestClient::new(&s.opts.http).map_err(|e| Error::Invalid(e.to_string()))?;
    let (grpc, channel) = rt.block_on(async {
        let g = GrpcClient::connect(&s.opts.grpc).await.map_err(|e| Error::Invalid(e.to_string()))?;
        let ch = tonic::transport::Endpoint::from_shared(s.opts.grpc.clone())
            .map_err(|e| Error::Invalid(e.to_string()))?
            .connect()
            .await
            .map_err(|e| Error::Invalid(format!("connect to {}: {e}", s.opts.grpc)))?;
        Ok::<_, Error>((g, ch))
    })?;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let period_s = 1.0 / s.opts.rate_per_s;
    rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        let mut i = k as u64;
        loop {
            let due = Duration::from_secs_f64(i as f64 * period_s);
            if due >= s.opts.duration || stop.load(Ordering::Relaxed) {
                break;
            }
            tokio::time::sleep_until(tokio::time::Instant::from_std(start + due)).await;
            // Reap finished tasks so the set stays bounded.
            while tasks.try_join_next().is_some() {}
            let plan = plan_of(i, s.opts.seed, &s.models, s.opts.bad_fraction);
            let t_ms = due.as_secs_f64() * 1e3;
            if in_flight.load(Ordering::Relaxed) >= s.opts.in_flight_max {
                if let Plan::Good { model, protocol, .. } = plan {
                    let _ = events.send(Event::Good(GoodRecord {
                        t_ms,
                        model: s.models[model].name.clone(),
                        protocol,
                        latency_us: 0,
                        outcome: "not-sent",
                        status: None,
                        detail: Some(format!("{} requests of this client in flight", s.opts.in_flight_max)),
                        error_rel_l2: None,
                        bit_exact: false,
                    }));
                }
                i += s.opts.clients as u64;
                continue;
            }
            in_flight.fetch_add(1, Ordering::Relaxed);
            let (s2, rest, grpc, channel, events, in_flight) =
                (s.clone(), rest.clone(), grpc.clone(), channel.clone(), events.clone(), in_flight.clone());
            let timeout = s.opts.timeout;
            let salt = i;
            tasks.spawn(async move {
                let due_at = start + due;
                let event = match plan {
                    Plan::Good { model, case, protocol } => {
                        let r = tokio::time::timeout(timeout, good_request(&s2, &rest, &grpc, model, case, protocol)).await;
                        let latency_us = due_at.elapsed().as_micros() as u64;
                        let m = &s2.models[model];
                        let mut rec = GoodRecord {
                            t_ms,
                            model: m.name.clone(),
                            protocol,
                            latency_us,
                            outcome: "correct",
                            status: None,
                            detail: None,
                            error_rel_l2: None,
                            bit_exact: false,
                        };
                        match r {
                            Err(_) => {
                                rec.outcome = "lost";
                                rec.latency_us = 0;
                                rec.detail = Some(format!("no answer within {:.1} s", timeout.as_secs_f64()));
                            }
                            Ok(Ok(res)) => match compare(m, &m.cases[case], &res) {
                                Ok((e, exact)) => {
                                    rec.error_rel_l2 = Some(e);
                                    rec.bit_exact = exact;
                                }
                                Err(why) => {
                                    rec.outcome = "wrong";
                                    rec.detail = Some(why);
                                }
                            },
                            Ok(Err(e)) => {
                                let a = answer_of(&e, protocol != Protocol::Grpc);
                                let overload = matches!(a, Answer::Http(429) | Answer::Grpc(Code::ResourceExhausted));
                                rec.outcome = if overload { "overloaded" } else { "error" };
                                rec.status = Some(a.label());
                                rec.detail = Some(e.to_string());
                            }
                        }
                        Event::Good(rec)
                    }
                    Plan::Bad { model, case, kind } => {
                        let answer =
                            match tokio::time::timeout(timeout, bad_request(&s2, &grpc, &channel, model, case, kind, salt)).await
                            {
                                Ok(a) => a,
                                Err(_) => Answer::Timeout,
                            };
                        let ok = judge(kind.expect(), &answer);
                        let detail = match &answer {
                            Answer::Transport(m) => m.clone(),
                            a => a.label(),
                        };
                        Event::Bad { kind, answer, ok, detail }
                    }
                };
                in_flight.fetch_sub(1, Ordering::Relaxed);
                let _ = events.send(event);
            });
            i += s.opts.clients as u64;
        }
        while tasks.join_next().await.is_some() {}
    });
    Ok(())
}

/// Runs the soak against a running server. `progress` is called about every `progress_every`
/// with the counters so far; returning false stops the load early (the server died, say).
pub fn run(
    models: Vec<SoakModel>,
    opts: SoakOptions,
    progress_every: Duration,
    mut progress: impl FnMut(&Progress) -> bool,
) -> Result<SoakResult, Error> {
    if models.is_empty() || models.iter().any(|m| m.cases.is_empty() || m.input_names.is_empty()) {
        return Err(Error::Invalid("the soak needs at least one model with inputs and one input set each".into()));
    }
    if opts.rate_per_s.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        || opts.clients == 0
        || !(0.0..=1.0).contains(&opts.bad_fraction)
    {
        return Err(Error::Invalid("the soak needs a positive rate, at least one client and a bad fraction in [0, 1]".into()));
    }
    let http_addr = opts
        .http
        .strip_prefix("http://")
        .ok_or_else(|| Error::Invalid(format!("'{}' is not an http:// url", opts.http)))?
        .trim_end_matches('/')
        .to_string();
    let mut bodies = Vec::new();
    for m in &models {
        let mut per = Vec::new();
        for c in &m.cases {
            let named = named(m, &c.inputs);
            let (json, _) = kairos_client::rest::infer_body(&named, &InferOptions::default(), false);
            let (bin, n) = kairos_client::rest::infer_body(&named, &InferOptions::default(), true);
            if json.len() > opts.request_bytes_max {
                return Err(Error::Invalid(format!(
                    "a JSON request of {} is {} bytes, over the server's limit of {} bytes: raise it",
                    m.name,
                    json.len(),
                    opts.request_bytes_max
                )));
            }
            per.push((json, (bin, n.unwrap_or(0))));
        }
        bodies.push(per);
    }
    let shared = Arc::new(Shared { opts: opts.clone(), models, bodies, http_addr });
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<Event>();
    let start = Instant::now() + Duration::from_millis(100);
    let mut threads = Vec::new();
    for k in 0..opts.clients {
        let (s, st, tx) = (shared.clone(), stop.clone(), tx.clone());
        let h = std::thread::Builder::new()
            .name(format!("soak-client-{k}"))
            .spawn(move || client_thread(k, s, start, st, tx))
            .map_err(|e| Error::Invalid(format!("cannot start a client thread: {e}")))?;
        threads.push(h);
    }
    drop(tx);
    let mut good = GoodSummary::default();
    let mut bad: BTreeMap<&'static str, BadStats> = BTreeMap::new();
    let mut records = Vec::new();
    let mut p = Progress::default();
    let mut next_progress = start + progress_every;
    let mut stopped_early = false;
    loop {
        let now = Instant::now();
        let wait = next_progress.saturating_duration_since(now).max(Duration::from_millis(1));
        match rx.recv_timeout(wait) {
            Ok(Event::Good(rec)) => {
                good.sent += 1;
                p.good_sent += 1;
                match rec.outcome {
                    "correct" => {
                        good.correct += 1;
                        p.good_correct += 1;
                        good.bit_exact += rec.bit_exact as u64;
                        good.error_rel_l2_max = good.error_rel_l2_max.max(rec.error_rel_l2.unwrap_or(0.0));
                    }
                    "wrong" => {
                        good.wrong += 1;
                        p.good_wrong += 1;
                    }
                    "overloaded" => good.overloaded += 1,
                    "lost" => {
                        good.lost += 1;
                        p.good_lost += 1;
                    }
                    "not-sent" => {
                        good.sent -= 1;
                        p.good_sent -= 1;
                        good.not_sent += 1;
                    }
                    _ => {
                        *good.errors.entry(rec.status.clone().unwrap_or_default()).or_default() += 1;
                        p.good_errors += 1;
                    }
                }
                if matches!(rec.outcome, "wrong" | "error" | "lost") && good.examples.len() < EXAMPLES_KEPT_MAX {
                    good.examples.push(format!(
                        "{} {} at {:.0} ms: {}: {}",
                        rec.model,
                        rec.protocol.name(),
                        rec.t_ms,
                        rec.outcome,
                        rec.detail.clone().unwrap_or_default()
                    ));
                }
                records.push(rec);
            }
            Ok(Event::Bad { kind, answer, ok, detail }) => {
                let b = bad.entry(kind.name()).or_default();
                b.sent += 1;
                p.bad_sent += 1;
                *b.answers.entry(answer.label()).or_default() += 1;
                if !ok {
                    b.failed += 1;
                    p.bad_failed += 1;
                    if b.failures.len() < FAILURES_KEPT_MAX {
                        b.failures.push(detail);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if Instant::now() >= next_progress {
            p.elapsed = start.elapsed();
            if !progress(&p) && !stopped_early {
                stopped_early = true;
                stop.store(true, Ordering::Relaxed);
            }
            next_progress += progress_every;
        }
    }
    let elapsed = start.elapsed().min(opts.duration);
    for t in threads {
        match t.join() {
            Ok(r) => r?,
            Err(_) => return Err(Error::Invalid("a soak client thread panicked".into())),
        }
    }
    let mut lat: Vec<u64> = records.iter().filter(|r| r.outcome == "correct").map(|r| r.latency_us).collect();
    lat.sort_unstable();
    let at = |p: f64| crate::stats::rounded_index(&lat, p).unwrap_or(0) as f64;
    good.latency_p50_us = at(50.0);
    good.latency_p99_us = at(99.0);
    good.latency_max_us = lat.last().copied().unwrap_or(0) as f64;
    records.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    Ok(SoakResult { good, bad, records, elapsed, stopped_early })
}

/// Waits until `GET /v2/health/ready` answers 200, or `alive` says the server is gone, or
/// `timeout` passes.
pub fn wait_ready(http: &str, timeout: Duration, mut alive: impl FnMut() -> Result<(), String>) -> Result<Duration, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start a tokio runtime: {e}")))?;
    let rest = RestClient::new(http).map_err(|e| Error::Invalid(e.to_string()))?;
    let t = Instant::now();
    loop {
        alive().map_err(Error::Invalid)?;
        let ready = rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), rest.server_ready()).await });
        if let Ok(Ok(true)) = ready {
            return Ok(t.elapsed());
        }
        if t.elapsed() > timeout {
            return Err(Error::Invalid(format!("the server at {http} was not ready after {:.0} s", timeout.as_secs_f64())));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether the server still answers `GET /v2/health/live` with 200 (within 5 s).
pub fn server_live(http: &str) -> bool {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return false };
    let Ok(rest) = RestClient::new(http) else { return false };
    matches!(rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), rest.server_live()).await }), Ok(Ok(true)))
}

/// The resident set of process `pid` and every descendant of it, bytes (Linux: `/proc`). None if
/// `pid` is gone or `/proc` cannot be read.
pub fn process_tree_rss_bytes(pid: u32) -> Option<u64> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields follow the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
        if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|v| v.parse().ok()) {
            parent_of.push((p, ppid));
        }
    }
    let mut tree = vec![pid];
    let mut k = 0;
    while k < tree.len() {
        let q = tree[k];
        tree.extend(parent_of.iter().filter(|(_, pp)| *pp == q).map(|(c, _)| *c));
        k += 1;
    }
    let mut total = 0u64;
    for (i, p) in tree.iter().enumerate() {
        match rss_bytes(*p) {
            Some(b) => total += b,
            None if i == 0 => return None,
            None => {}
        }
    }
    Some(total)
}

/// `VmRSS` of one process (not its children), bytes (Linux: `/proc`).
pub fn process_rss_bytes(pid: u32) -> Option<u64> {
    rss_bytes(pid)
}

/// `VmRSS` of one process, bytes.
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Sends SIGTERM to `pid`.
pub fn terminate(pid: u32) -> Result<(), Error> {
    let pid = rustix::process::Pid::from_raw(pid as i32).ok_or_else(|| Error::Invalid(format!("bad pid {pid}")))?;
    rustix::process::kill_process(pid, rustix::process::Signal::TERM)
        .map_err(|e| Error::Invalid(format!("SIGTERM to {}: {e}", pid.as_raw_nonzero())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_rss_is_found_and_positive() {
        let b = process_tree_rss_bytes(std::process::id()).unwrap();
        let own = process_rss_bytes(std::process::id()).unwrap();
        // This process has no children: its own memory is the tree's, up to what the other test
        // threads allocated between the two reads.
        assert!(own > 0 && own.abs_diff(b) <= b / 4, "own {own}, tree {b}");
        assert!(b > 1 << 20, "{b}");
        assert!(process_tree_rss_bytes(u32::MAX - 1).is_none());
    }

    #[test]
    fn judging_follows_the_expectations() {
        assert!(judge(BadKind::RestWrongShape.expect(), &Answer::Http(400)));
        assert!(!judge(BadKind::RestWrongShape.expect(), &Answer::Http(500)));
        assert!(!judge(BadKind::RestWrongShape.expect(), &Answer::Http(200)));
        assert!(!judge(BadKind::RestWrongShape.expect(), &Answer::Timeout));
        assert!(judge(BadKind::RestOversizedChunked.expect(), &Answer::Closed));
        assert!(!judge(BadKind::RestOversized.expect(), &Answer::Closed));
        assert!(judge(BadKind::GrpcUnknownModel.expect(), &Answer::Grpc(Code::NotFound)));
        assert!(!judge(BadKind::GrpcUnknownModel.expect(), &Answer::Grpc(Code::Internal)));
        assert!(judge(BadKind::GrpcCancelled.expect(), &Answer::Gone));
        assert!(!judge(BadKind::GrpcCancelled.expect(), &Answer::Grpc(Code::Internal)));
        assert!(!judge(BadKind::RestAbandoned.expect(), &Answer::Transport("refused".into())));
    }

    #[test]
    fn the_plan_is_deterministic_and_mixes_as_asked() {
        let m = SoakModel {
            name: "m".into(),
            input_names: vec!["x".into()],
            cases: vec![SoakCase { inputs: vec![], expected: vec![] }; 3],
            tolerance: 0.0,
        };
        let models = vec![m.clone(), m];
        let bad = (0..10_000).filter(|&i| matches!(plan_of(i, 7, &models, 0.3), Plan::Bad { .. })).count();
        assert!((2700..3300).contains(&bad), "{bad}");
        let a: Vec<String> = (0..50).map(|i| format!("{:?}", plan_of(i, 7, &models, 0.3))).collect();
        let b: Vec<String> = (0..50).map(|i| format!("{:?}", plan_of(i, 7, &models, 0.3))).collect();
        assert_eq!(a, b);
    }
}

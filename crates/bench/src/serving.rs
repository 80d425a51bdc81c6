//! The serving overhead of kairos' front ends, as a client sees it.
//!
//! One client on the calling thread sends requests one after another (closed loop, one in flight)
//! to a running server, over each transport in turn: REST with JSON tensors, REST with the binary
//! tensor extension, gRPC, the shared-memory channel with Paella's hybrid wait, the shared-memory
//! channel polling, the same channel with its buffers placed so that the server must copy
//! (`shm-copy`, the path zero-copy replaces), and the same channel's Unix socket carrying the
//! tensors (the baseline of Paella's Figure 14). Per request it records the latency the client observed and the timing the
//! server returned with the answer; the overhead of a request is its client latency minus its own
//! GPU time (first kernel issued to last kernel done), and minus its engine time (submission to
//! completion inside the dispatcher). Percentiles are of those per-request differences, not
//! differences of percentiles.
//!
//! Client CPU use is the calling thread's CPU clock over the measured loop divided by its wall time
//! (REST and gRPC run on a current-thread tokio runtime on that same thread, so their connection
//! tasks count too). The server's own threads are not counted.
//!
//! The first answer of every transport is compared with the first transport's: the same request
//! must give the same tensors whichever way it travelled.
//!
//! The shared-memory transports report which data path the server took for the measured requests
//! (`data_path`): `zero-copy` when the GPU read the inputs from and wrote the outputs into the
//! client's region in place (mapped pinned memory on CUDA), `copy` when the server copied them
//! between the region and the engine, or the mix.

use crate::Error;
use kairos_client::grpc::GrpcClient;
use kairos_client::rest::RestClient;
use kairos_client::shm::layout::Span;
use kairos_client::shm::{Buffer, ConnectOptions, ShmClient, ShmModel, Wait};
use kairos_client::{InferOptions, ServerTiming};
use kairos_ir::{DType, Tensor};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// The most requests one transport may be asked for (every latency is kept for exact percentiles).
pub const REQUESTS_MAX: usize = 1_000_000;

/// How a request travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// KServe v2 over HTTP/1.1, tensors as JSON numbers.
    RestJson,
    /// KServe v2 over HTTP/1.1 with the binary tensor data extension.
    RestBinary,
    /// KServe v2 over gRPC (GRPCInferenceService/ModelInfer).
    Grpc,
    /// The shared-memory channel: tensors in place, the hybrid wait (eventfd sleep, then polling).
    ShmHybrid,
    /// The shared-memory channel, spinning on the completion ring.
    ShmPoll,
    /// The shared-memory channel with the hybrid wait and buffers placed off the GPU's alignment,
    /// so the server copies the tensors between the region and the engine (the path zero-copy
    /// replaces), for comparison on the same server.
    ShmCopy,
    /// The channel's Unix socket carrying the tensors both ways, the client blocked in `recv`.
    Socket,
}

impl Transport {
    pub const ALL: [Transport; 7] = [
        Transport::RestJson,
        Transport::RestBinary,
        Transport::Grpc,
        Transport::ShmHybrid,
        Transport::ShmPoll,
        Transport::ShmCopy,
        Transport::Socket,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Transport::RestJson => "rest-json",
            Transport::RestBinary => "rest-binary",
            Transport::Grpc => "grpc",
            Transport::ShmHybrid => "shm-hybrid",
            Transport::ShmPoll => "shm-poll",
            Transport::ShmCopy => "shm-copy",
            Transport::Socket => "socket",
        }
    }

    pub fn parse(s: &str) -> Result<Transport, Error> {
        Transport::ALL.into_iter().find(|t| t.name() == s).ok_or_else(|| {
            let names: Vec<_> = Transport::ALL.iter().map(|t| t.name()).collect();
            Error::Invalid(format!("unknown transport '{s}' (known: {})", names.join(", ")))
        })
    }
}

/// Where the server listens.
#[derive(Clone, Debug)]
pub struct Endpoints {
    /// `http://host:port` of the REST front end.
    pub http: Option<String>,
    /// `http://host:port` of the gRPC front end.
    pub grpc: Option<String>,
    /// The shared-memory channel's socket.
    pub shm: Option<PathBuf>,
}

/// One measurement's size.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub requests: usize,
    /// Requests sent first and not measured (connections, caches, the server's first-use paths).
    pub warmup: usize,
    pub seed: u64,
}

/// Percentiles of one quantity, microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Spread {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

impl Spread {
    /// Exact percentiles (nearest rank) of values in nanoseconds; an empty set gives zeros.
    pub fn of_ns(values: &mut [i64]) -> Spread {
        if values.is_empty() {
            return Spread::default();
        }
        values.sort_unstable();
        let rank = |p: f64| crate::stats::nearest_rank(values, p).expect("not empty") as f64 / 1e3;
        let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64 / 1e3;
        Spread { p50_us: rank(50.0), p90_us: rank(90.0), p99_us: rank(99.0), mean_us: mean }
    }
}

/// What one transport measured for one model.
#[derive(Clone, Debug, Serialize)]
pub struct TransportResult {
    pub model: String,
    pub transport: Transport,
    pub requests: usize,
    /// Latency the client observed (send to answer decoded).
    pub client: Spread,
    /// The server's GPU time of the same requests.
    pub gpu: Spread,
    /// The server's engine time (submission to completion inside the dispatcher).
    pub engine: Spread,
    /// Client latency minus the request's GPU time.
    pub over_gpu: Spread,
    /// Client latency minus the request's engine time: the front end and transport alone.
    pub over_engine: Spread,
    /// Client thread CPU time per request, microseconds.
    pub client_cpu_per_request_us: f64,
    /// Client thread CPU time over wall time during the loop (1.0: a core kept busy).
    pub client_cpu_fraction: f64,
    /// Requests per second the single closed-loop client achieved.
    pub throughput_per_s: f64,
    /// Shared-memory transports: the server's data path for the measured requests (`zero-copy`,
    /// `copy`, or `mixed: Z zero-copy, C copied`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_path: Option<String>,
    /// Why this transport could not serve the model (the other fields are then zero).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Seeded inputs for a model's input specs: floats in [-1, 1], token ids in [0, 100).
pub fn seeded_inputs(specs: &[kairos_client::shm::TensorSpec], seed: u64) -> Vec<Tensor> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    specs
        .iter()
        .map(|d| {
            let n: usize = d.shape.iter().product();
            match d.dtype {
                DType::I64 => Tensor::i64(d.shape.clone(), (0..n).map(|_| (next() % 100) as i64).collect()),
                dt => Tensor::f32(d.shape.clone(), (0..n).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect()).cast(dt),
            }
        })
        .collect()
}

fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn client_err(what: &str, e: kairos_client::ClientError) -> Error {
    Error::Invalid(format!("{what}: {e}"))
}

/// One transport's client, connected.
pub(crate) enum Client {
    Rest {
        rt: tokio::runtime::Runtime,
        client: RestClient,
        binary: bool,
    },
    Grpc {
        rt: tokio::runtime::Runtime,
        client: GrpcClient,
    },
    Shm {
        client: Box<ShmClient>,
        wait: Option<Wait>,
    },
    /// The ring with buffers at 64 bytes past the GPU's alignment (kept per model handle).
    ShmCopy {
        client: Box<ShmClient>,
        buffers: std::collections::HashMap<u32, (Vec<Buffer>, Vec<Buffer>)>,
    },
}

/// How far past an aligned buffer `shm-copy` places its tensors: the client's buffers start on
/// 256-byte boundaries (what GPU kernels may assume), 64 bytes off is not one.
const SHM_COPY_SKEW_BYTES: u64 = 64;

fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start a tokio runtime: {e}")))
}

/// How the server served `(zero-copy, copied)` requests.
fn data_path_name((zero_copy, copied): (u64, u64)) -> String {
    match (zero_copy, copied) {
        (0, 0) => "none".into(),
        (_, 0) => "zero-copy".into(),
        (0, _) => "copy".into(),
        (z, c) => format!("mixed: {z} zero-copy, {c} copied"),
    }
}

impl Client {
    /// Shared-memory ring clients: requests completed so far by data path (zero-copy, copied).
    pub(crate) fn data_paths(&self) -> Option<(u64, u64)> {
        match self {
            Client::Shm { client, wait: Some(_) } | Client::ShmCopy { client, .. } => Some(client.data_paths()),
            _ => None,
        }
    }

    pub(crate) fn connect(t: Transport, at: &Endpoints) -> Result<Client, Error> {
        let need = |v: &Option<String>, what: &str| {
            v.clone().ok_or_else(|| Error::Invalid(format!("transport {} needs the server's {what} address", t.name())))
        };
        Ok(match t {
            Transport::RestJson | Transport::RestBinary => {
                let rt = runtime()?;
                let client = RestClient::new(&need(&at.http, "REST")?).map_err(|e| client_err("REST client", e))?;
                Client::Rest { rt, client, binary: t == Transport::RestBinary }
            }
            Transport::Grpc => {
                let rt = runtime()?;
                let url = need(&at.grpc, "gRPC")?;
                let client = rt.block_on(GrpcClient::connect(&url)).map_err(|e| client_err("gRPC connect", e))?;
                Client::Grpc { rt, client }
            }
            Transport::ShmCopy => {
                let path = at
                    .shm
                    .clone()
                    .ok_or_else(|| Error::Invalid(format!("transport {} needs the server's shared-memory socket", t.name())))?;
                let client = ShmClient::connect(&path, ConnectOptions::default()).map_err(|e| client_err("shm connect", e))?;
                Client::ShmCopy { client: Box::new(client), buffers: std::collections::HashMap::new() }
            }
            Transport::ShmHybrid | Transport::ShmPoll | Transport::Socket => {
                let path = at
                    .shm
                    .clone()
                    .ok_or_else(|| Error::Invalid(format!("transport {} needs the server's shared-memory socket", t.name())))?;
                let client = ShmClient::connect(&path, ConnectOptions::default()).map_err(|e| client_err("shm connect", e))?;
                let wait = match t {
                    Transport::ShmHybrid => Some(Wait::Hybrid),
                    Transport::ShmPoll => Some(Wait::Poll),
                    _ => None,
                };
                Client::Shm { client: Box::new(client), wait }
            }
        })
    }

    pub(crate) fn infer(
        &mut self,
        model: &ShmModel,
        inputs: &[Tensor],
        opts: &InferOptions,
    ) -> kairos_client::Result<(Vec<Tensor>, ServerTiming)> {
        match self {
            Client::Rest { rt, client, binary } => {
                let named: Vec<(&str, &Tensor)> = model.inputs.iter().map(|s| s.name.as_str()).zip(inputs).collect();
                let r = rt.block_on(client.infer(&model.name, &model.version, &named, opts, *binary))?;
                Ok((ordered(model, r.outputs)?, r.timing))
            }
            Client::Grpc { rt, client } => {
                let named: Vec<(&str, &Tensor)> = model.inputs.iter().map(|s| s.name.as_str()).zip(inputs).collect();
                let r = rt.block_on(client.infer(&model.name, &model.version, &named, opts))?;
                Ok((ordered(model, r.outputs)?, r.timing))
            }
            Client::Shm { client, wait: Some(w) } => {
                let m = client.open_model(&model.name, &model.version)?;
                client.infer(&m, inputs, *w, opts)
            }
            Client::Shm { client, wait: None } => {
                let m = client.open_model(&model.name, &model.version)?;
                client.infer_socket(&m, inputs, opts)
            }
            Client::ShmCopy { client, buffers } => {
                let m = client.open_model(&model.name, &model.version)?;
                if let std::collections::hash_map::Entry::Vacant(slot) = buffers.entry(m.handle) {
                    let mut skewed = |len: u64| -> kairos_client::Result<Buffer> {
                        let b = client.alloc(len + SHM_COPY_SKEW_BYTES)?;
                        Ok(Buffer { span: Span { offset: b.span.offset + SHM_COPY_SKEW_BYTES, len } })
                    };
                    let ins = m.inputs.iter().map(|s| skewed(s.len_bytes())).collect::<kairos_client::Result<Vec<_>>>()?;
                    let outs = m.outputs.iter().map(|s| skewed(s.len_bytes())).collect::<kairos_client::Result<Vec<_>>>()?;
                    slot.insert((ins, outs));
                }
                let (ins, outs) = &buffers[&m.handle];
                for ((t, spec), b) in inputs.iter().zip(&m.inputs).zip(ins) {
                    client.buffer_mut(b)?.copy_from_slice(&t.cast(spec.dtype).to_bytes());
                }
                let tag = client.submit(&m, ins, outs, opts)?;
                let r = client.wait(tag, Wait::Hybrid)?;
                let outputs = m
                    .outputs
                    .iter()
                    .zip(outs)
                    .map(|(spec, b)| {
                        Tensor::from_bytes(spec.dtype, spec.shape.clone(), client.buffer(b)?)
                            .map_err(kairos_client::ClientError::Protocol)
                    })
                    .collect::<kairos_client::Result<Vec<_>>>()?;
                Ok((outputs, r.timing))
            }
        }
    }
}

/// Outputs in the model's order (REST and gRPC name them).
fn ordered(model: &ShmModel, mut named: Vec<(String, Tensor)>) -> kairos_client::Result<Vec<Tensor>> {
    model
        .outputs
        .iter()
        .map(|s| {
            let i = named
                .iter()
                .position(|(n, _)| n == &s.name)
                .ok_or_else(|| kairos_client::ClientError::Protocol(format!("the answer lacks output '{}'", s.name)))?;
            Ok(named.swap_remove(i).1.cast(s.dtype))
        })
        .collect()
}

/// The model's tensors as the server describes them (through the shared-memory channel).
pub fn describe_model(at: &Endpoints, name: &str) -> Result<ShmModel, Error> {
    let path = at.shm.as_ref().ok_or_else(|| Error::Invalid("describing a model needs the shared-memory socket".into()))?;
    let mut c = ShmClient::connect(path, ConnectOptions::default()).map_err(|e| client_err("shm connect", e))?;
    c.open_model(name, "").map_err(|e| client_err(&format!("model {name}"), e))
}

/// Largest relative L2 difference between two output lists (shapes must agree).
fn relative_difference(a: &[Tensor], b: &[Tensor]) -> Result<f64, Error> {
    if a.len() != b.len() {
        return Err(Error::Invalid(format!("{} outputs against {}", a.len(), b.len())));
    }
    let mut worst = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        if x.shape != y.shape {
            return Err(Error::Invalid(format!("output shape {:?} against {:?}", x.shape, y.shape)));
        }
        let xs = x.cast(DType::F32).to_f32_vec();
        let ys = y.cast(DType::F32).to_f32_vec();
        let (mut d, mut n) = (0.0f64, 0.0f64);
        for (p, q) in xs.iter().zip(&ys) {
            d += ((p - q) as f64).powi(2);
            n += (*q as f64).powi(2);
        }
        worst = worst.max(if n > 0.0 { (d / n).sqrt() } else { d.sqrt() });
    }
    Ok(worst)
}

/// Measures every transport for one model, in order; `progress` hears about each as it finishes.
pub fn measure_model(
    at: &Endpoints,
    model: &ShmModel,
    transports: &[Transport],
    opts: Options,
    mut progress: impl FnMut(&TransportResult),
) -> Result<Vec<TransportResult>, Error> {
    if opts.requests == 0 || opts.requests > REQUESTS_MAX {
        return Err(Error::Invalid(format!("requests must be 1..={REQUESTS_MAX}, got {}", opts.requests)));
    }
    let inputs = seeded_inputs(&model.inputs, opts.seed);
    let request = InferOptions::default();
    let mut first_answer: Option<(Transport, Vec<Tensor>)> = None;
    let mut results = Vec::new();
    for &t in transports {
        let r = match measure_one(at, model, t, &inputs, &request, opts, &mut first_answer) {
            Ok(r) => r,
            // A difference in answers is a bug, not a limit of the transport: stop.
            Err(e @ Error::Model { .. }) => return Err(e),
            Err(e) => TransportResult {
                model: model.name.clone(),
                transport: t,
                requests: 0,
                client: Spread::default(),
                gpu: Spread::default(),
                engine: Spread::default(),
                over_gpu: Spread::default(),
                over_engine: Spread::default(),
                client_cpu_per_request_us: 0.0,
                client_cpu_fraction: 0.0,
                throughput_per_s: 0.0,
                data_path: None,
                error: Some(e.to_string()),
            },
        };
        progress(&r);
        results.push(r);
    }
    Ok(results)
}

fn measure_one(
    at: &Endpoints,
    model: &ShmModel,
    t: Transport,
    inputs: &[Tensor],
    request: &InferOptions,
    opts: Options,
    first_answer: &mut Option<(Transport, Vec<Tensor>)>,
) -> Result<TransportResult, Error> {
    {
        let mut client = Client::connect(t, at)?;
        for _ in 0..opts.warmup {
            client.infer(model, inputs, request).map_err(|e| client_err(t.name(), e))?;
        }
        let mut client_ns = Vec::with_capacity(opts.requests);
        let mut gpu_ns = Vec::with_capacity(opts.requests);
        let mut engine_ns = Vec::with_capacity(opts.requests);
        let mut over_gpu = Vec::with_capacity(opts.requests);
        let mut over_engine = Vec::with_capacity(opts.requests);
        let paths0 = client.data_paths();
        let cpu0 = thread_cpu_ns();
        let wall0 = Instant::now();
        for i in 0..opts.requests {
            let t0 = Instant::now();
            let (outputs, timing) = client.infer(model, inputs, request).map_err(|e| client_err(t.name(), e))?;
            let latency = t0.elapsed().as_nanos() as i64;
            if i == 0 {
                match first_answer {
                    None => *first_answer = Some((t, outputs)),
                    Some((t_ref, reference)) => {
                        let d = relative_difference(&outputs, reference)?;
                        if d > 1e-6 {
                            return Err(Error::Model {
                                model: model.name.clone(),
                                message: format!(
                                    "{} answered differently from {} (relative difference {d:.2e})",
                                    t.name(),
                                    t_ref.name()
                                ),
                            });
                        }
                    }
                }
            }
            client_ns.push(latency);
            gpu_ns.push(timing.gpu_ns as i64);
            engine_ns.push(timing.engine_ns as i64);
            over_gpu.push(latency - timing.gpu_ns as i64);
            over_engine.push(latency - timing.engine_ns as i64);
        }
        let wall = wall0.elapsed().as_nanos() as f64;
        let cpu = (thread_cpu_ns() - cpu0) as f64;
        let data_path = match (paths0, client.data_paths()) {
            (Some(a), Some(b)) => Some(data_path_name((b.0 - a.0, b.1 - a.1))),
            _ => None,
        };
        let r = TransportResult {
            model: model.name.clone(),
            transport: t,
            requests: opts.requests,
            client: Spread::of_ns(&mut client_ns),
            gpu: Spread::of_ns(&mut gpu_ns),
            engine: Spread::of_ns(&mut engine_ns),
            over_gpu: Spread::of_ns(&mut over_gpu),
            over_engine: Spread::of_ns(&mut over_engine),
            client_cpu_per_request_us: cpu / opts.requests as f64 / 1e3,
            client_cpu_fraction: if wall > 0.0 { cpu / wall } else { 0.0 },
            throughput_per_s: if wall > 0.0 { opts.requests as f64 / (wall / 1e9) } else { 0.0 },
            data_path,
            error: None,
        };
        Ok(r)
    }
}

/// The results as a markdown table.
pub fn markdown(results: &[TransportResult]) -> String {
    let mut s = String::from(
        "| model | transport | data path | client p50 (µs) | client p99 (µs) | GPU p50 (µs) | over GPU p50 (µs) | over GPU p99 (µs) | over engine p50 (µs) | over engine p99 (µs) | client CPU / request (µs) | client CPU busy |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in results {
        if let Some(e) = &r.error {
            let e: String = e.chars().map(|c| if c == '|' { '/' } else { c }).collect();
            s.push_str(&format!("| {} | {} | not measured: {e} |||||||||||\n", r.model, r.transport.name()));
            continue;
        }
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% |\n",
            r.model,
            r.transport.name(),
            r.data_path.as_deref().unwrap_or(match r.transport {
                Transport::Socket => "socket message",
                _ => "serialized",
            }),
            r.client.p50_us,
            r.client.p99_us,
            r.gpu.p50_us,
            r.over_gpu.p50_us,
            r.over_gpu.p99_us,
            r.over_engine.p50_us,
            r.over_engine.p99_us,
            r.client_cpu_per_request_us,
            r.client_cpu_fraction * 100.0
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<i64> = (1..=100).map(|x| x * 1000).collect();
        let s = Spread::of_ns(&mut v);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p90_us, 90.0);
        assert_eq!(s.p99_us, 99.0);
        assert!((s.mean_us - 50.5).abs() < 1e-9);
        let mut one = vec![-3000];
        assert_eq!(Spread::of_ns(&mut one).p99_us, -3.0);
        assert_eq!(Spread::of_ns(&mut []).p50_us, 0.0);
    }

    #[test]
    fn data_paths_are_named() {
        assert_eq!(data_path_name((100, 0)), "zero-copy");
        assert_eq!(data_path_name((0, 100)), "copy");
        assert_eq!(data_path_name((3, 97)), "mixed: 3 zero-copy, 97 copied");
    }

    #[test]
    fn transport_names_round_trip() {
        for t in Transport::ALL {
            assert_eq!(Transport::parse(t.name()).unwrap(), t);
        }
        assert!(Transport::parse("carrier-pigeon").is_err());
    }
}

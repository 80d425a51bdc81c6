//! Bad input gets a clear error with the right status on every front end, and the server keeps
//! serving; full queues give 429 / RESOURCE_EXHAUSTED.

mod common;

use common::*;
use kairos_client::grpc::{GrpcClient, infer_request};
use kairos_client::pb;
use kairos_client::rest::RestClient;
use kairos_client::shm::layout::Span;
use kairos_client::shm::{Buffer, ConnectOptions, ShmClient, ShmModel, Wait};
use kairos_client::{Code, InferOptions};
use serde_json::json;

fn mlp_input(s: &TestServer) -> Vec<f32> {
    s.inputs("mlp", 0)[0].to_f32_vec()
}

#[test]
fn rest_bad_requests() {
    let s = start("rest-errors");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let x = mlp_input(&s);
    let x63: Vec<f32> = x[..63].to_vec();
    let good = json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "data": x }] });
    let pair_a = json!({ "name": "a", "datatype": "FP32", "shape": [1, 16], "data": vec![0.5f32; 16] });
    type Case = (&'static str, Vec<u8>, Option<usize>, u16, &'static str);
    let body = |v: serde_json::Value| serde_json::to_vec(&v).unwrap();
    let mut binary_short = body(
        json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "parameters": { "binary_data_size": 256 } }] }),
    );
    let hl = binary_short.len();
    binary_short.extend_from_slice(&[0u8; 100]);
    let mut binary_extra = body(
        json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "parameters": { "binary_data_size": 256 } }] }),
    );
    let hl2 = binary_extra.len();
    binary_extra.extend_from_slice(&[0u8; 300]);
    let cases: Vec<Case> = vec![
        ("/v2/models/nope/infer", body(good.clone()), None, 404, "unknown model 'nope'"),
        ("/v2/models/mlp/versions/9/infer", body(good.clone()), None, 404, "no version '9'"),
        ("/v2/models/mlp/infer", b"{\"inputs\": [".to_vec(), None, 400, "malformed inference request JSON"),
        ("/v2/models/mlp/infer", b"not json at all".to_vec(), None, 400, "malformed"),
        ("/v2/models/mlp/infer", body(json!({ "outputs": [] })), None, 400, "missing field `inputs`"),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": [{ "name": "x", "datatype": "INT64", "shape": [1, 64], "data": vec![1; 64] }] })),
            None,
            400,
            "is FP32, the request says INT64",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 63], "data": x63 }] })),
            None,
            400,
            "has shape [1, 64], the request says [1, 63]",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, -64], "data": x }] })),
            None,
            400,
            "has shape",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "data": x63 }] })),
            None,
            400,
            "has 63 values",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": [{ "name": "z", "datatype": "FP32", "shape": [1, 64], "data": x }] })),
            None,
            400,
            "has no input 'z'",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "data": ["a"] }] })),
            None,
            400,
            "malformed",
        ),
        ("/v2/models/pair/infer", body(json!({ "inputs": [pair_a] })), None, 400, "needs input(s) b"),
        ("/v2/models/pair/infer", body(json!({ "inputs": [pair_a, pair_a] })), None, 400, "given twice"),
        (
            "/v2/models/embed/infer",
            body(
                json!({ "inputs": [{ "name": "ids", "datatype": "INT64", "shape": [1, 8], "data": [1, 2, 3, 4, 5, 6, 7, 8.5] }] }),
            ),
            None,
            400,
            "is INT64 but holds 8.5",
        ),
        (
            "/v2/models/mlp/infer",
            body(
                json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "parameters": { "binary_data_size": 255 } }] }),
            ),
            Some(0),
            400,
            "",
        ),
        ("/v2/models/mlp/infer", binary_short, Some(hl), 400, "256 binary bytes, 100 are left"),
        ("/v2/models/mlp/infer", binary_extra, Some(hl2), 400, "44 binary bytes after the last input"),
        ("/v2/models/mlp/infer", body(good.clone()), Some(1 << 30), 400, "exceeds the body's"),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": good["inputs"], "outputs": [{ "name": "nope" }] })),
            None,
            400,
            "has no output 'nope'",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": good["inputs"], "parameters": { "priority": "high" } })),
            None,
            400,
            "priority",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": good["inputs"], "parameters": { "priority": 1001 } })),
            None,
            400,
            "outside 1..=1000",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": good["inputs"], "parameters": { "sequence_id": 7 } })),
            None,
            400,
            "sequence",
        ),
        (
            "/v2/models/mlp/infer",
            body(json!({ "inputs": good["inputs"], "parameters": { "kairos_class": "urgent" } })),
            None,
            400,
            "kairos_class",
        ),
        ("/v2/does/not/exist", Vec::new(), None, 404, "no such endpoint"),
    ];
    for (path, b, header_length, status, fragment) in cases {
        let reply = rt.block_on(rest.request("POST", path, b, header_length)).unwrap();
        let msg = String::from_utf8_lossy(&reply.body).into_owned();
        assert_eq!(reply.status, status, "{path}: {msg}");
        assert!(msg.contains(fragment), "{path}: '{fragment}' not in {msg}");
        assert!(serde_json::from_slice::<serde_json::Value>(&reply.body).unwrap()["error"].is_string(), "{msg}");
        // And the server still answers a good request.
        let r = rt.block_on(rest.request("POST", "/v2/models/mlp/infer", serde_json::to_vec(&good).unwrap(), None)).unwrap();
        assert_eq!(r.status, 200);
    }
    // A binary header that is not a number.
    let req = hyper_request(&s.http, "/v2/models/mlp/infer", &[("inference-header-content-length", "ten")], b"{}");
    assert_eq!(rt.block_on(req).0, 400);
    let good_bytes = serde_json::to_vec(&good).unwrap();
    let (status, text) =
        rt.block_on(hyper_request(&s.http, "/v2/models/mlp/infer", &[("content-encoding", "gzip")], &good_bytes));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("Content-Encoding"), "{text}");
    // Repository calls with bad bodies.
    let r = rt.block_on(rest.request("POST", "/v2/repository/index", b"{".to_vec(), None)).unwrap();
    assert_eq!(r.status, 400);
    let r = rt
        .block_on(rest.request(
            "POST",
            "/v2/repository/models/mlp/load",
            serde_json::to_vec(&json!({ "parameters": { "config": "{}" } })).unwrap(),
            None,
        ))
        .unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
}

/// A raw POST with extra headers, for what `RestClient` never sends.
async fn hyper_request(base: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\nconnection: close\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

#[test]
fn payload_limit_gives_413() {
    let s = start_with("limit", |cfg, _| cfg.request_bytes_max = 4096);
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let x = s.inputs("mlp", 0);
    // 64 floats fit in binary form; as JSON with padding they do not.
    rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &InferOptions::default(), true)).unwrap();
    let pad = "x".repeat(5000);
    let big = json!({ "id": pad, "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "data": x[0].to_f32_vec() }] });
    let r = rt.block_on(rest.request("POST", "/v2/models/mlp/infer", serde_json::to_vec(&big).unwrap(), None)).unwrap();
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    // Without a Content-Length (chunked), the limit still holds.
    let (status, text) = rt.block_on(chunked_post(&s.http, "/v2/models/mlp/infer", &serde_json::to_vec(&big).unwrap()));
    assert_eq!(status, 413, "{text}");
    let mut req = infer_request("mlp", "", &[("x", &x[0])], &InferOptions::default());
    req.id = pad;
    let e = rt.block_on(grpc.infer_raw(req)).unwrap_err();
    // tonic refuses it before decoding, with its own code for "message too large".
    assert_eq!(e.code(), Some(Code::OutOfRange), "{e}");
    assert!(e.to_string().contains("the limit is: 4096 bytes"), "{e}");
    // Still serving.
    rt.block_on(grpc.infer("mlp", "", &[("x", &x[0])], &InferOptions::default())).unwrap();
}

async fn chunked_post(base: &str, path: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    // The server may answer 413 and close before the whole body is sent: stop writing then and
    // read the answer.
    let sent: std::io::Result<()> = async {
        for c in body.chunks(1000) {
            s.write_all(format!("{:x}\r\n", c.len()).as_bytes()).await?;
            s.write_all(c).await?;
            s.write_all(b"\r\n").await?;
        }
        s.write_all(b"0\r\n\r\n").await
    }
    .await;
    let _ = sent;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    (text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0), text)
}

/// Sends raw bytes as the ModelInfer message.
mod raw {
    use bytes::{Buf, BufMut};
    use tonic::Status;
    use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    #[derive(Default, Clone)]
    pub struct Raw;
    pub struct Enc;
    pub struct Dec;

    impl Codec for Raw {
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
        fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
            buf.put_slice(&item);
            Ok(())
        }
        fn buffer_settings(&self) -> BufferSettings {
            BufferSettings::default()
        }
    }
    impl Decoder for Dec {
        type Item = Vec<u8>;
        type Error = Status;
        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
            let v = buf.chunk().to_vec();
            buf.advance(v.len());
            Ok(Some(v))
        }
        fn buffer_settings(&self) -> BufferSettings {
            BufferSettings::default()
        }
    }

    pub async fn model_infer(url: &str, bytes: Vec<u8>) -> Result<Vec<u8>, Status> {
        let channel = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await.unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static("/inference.GRPCInferenceService/ModelInfer");
        grpc.unary(tonic::Request::new(bytes), path, Raw).await.map(|r| r.into_inner())
    }
}

#[test]
fn grpc_bad_requests() {
    let s = start("grpc-errors");
    let rt = runtime();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let x = s.inputs("mlp", 0);
    let good = || infer_request("mlp", "", &[("x", &x[0])], &InferOptions::default());
    let contents = |v: Vec<f32>| pb::InferTensorContents { fp32_contents: v, ..Default::default() };
    type Edit = Box<dyn Fn(&mut pb::ModelInferRequest)>;
    let cases: Vec<(&str, Edit, Code, &str)> = vec![
        ("unknown model", Box::new(|r| r.model_name = "nope".into()), Code::NotFound, "unknown model"),
        ("unknown version", Box::new(|r| r.model_version = "2".into()), Code::NotFound, "no version '2'"),
        (
            "wrong dtype",
            Box::new(|r| r.inputs[0].datatype = "FP16".into()),
            Code::InvalidArgument,
            "is FP32, the request says FP16",
        ),
        ("wrong shape", Box::new(|r| r.inputs[0].shape = vec![64, 1]), Code::InvalidArgument, "has shape"),
        (
            "short raw",
            Box::new(|r| r.raw_input_contents[0] = r.raw_input_contents[0].slice(..100)),
            Code::InvalidArgument,
            "100 raw bytes",
        ),
        (
            "extra raw",
            Box::new(|r| r.raw_input_contents.push(bytes::Bytes::from_static(b"1234"))),
            Code::InvalidArgument,
            "2 raw_input_contents for 1 inputs",
        ),
        (
            "contents count",
            Box::new(move |r| {
                r.raw_input_contents.clear();
                r.inputs[0].contents = Some(contents(vec![1.0; 63]));
            }),
            Code::InvalidArgument,
            "has 63 values",
        ),
        (
            "no data",
            Box::new(|r| {
                r.raw_input_contents.clear();
            }),
            Code::InvalidArgument,
            "has no contents",
        ),
        (
            "unknown output",
            Box::new(|r| {
                r.outputs.push(pb::model_infer_request::InferRequestedOutputTensor {
                    name: "q".into(),
                    parameters: Default::default(),
                })
            }),
            Code::InvalidArgument,
            "has no output 'q'",
        ),
        (
            "no inputs",
            Box::new(|r| {
                r.inputs.clear();
                r.raw_input_contents.clear();
            }),
            Code::InvalidArgument,
            "needs input(s) x",
        ),
        (
            "bad priority type",
            Box::new(|r| {
                r.parameters.insert(
                    "priority".into(),
                    pb::InferParameter {
                        parameter_choice: Some(pb::infer_parameter::ParameterChoice::StringParam("high".into())),
                    },
                );
            }),
            Code::InvalidArgument,
            "priority",
        ),
    ];
    for (what, edit, code, fragment) in cases {
        let mut r = good();
        edit(&mut r);
        let e = rt.block_on(grpc.infer_raw(r)).unwrap_err();
        assert_eq!(e.code(), Some(code), "{what}: {e}");
        assert!(e.to_string().contains(fragment), "{what}: '{fragment}' not in {e}");
        rt.block_on(grpc.infer_raw(good())).unwrap();
    }
    // FP32 contents instead of raw bytes are fine.
    let mut r = good();
    r.raw_input_contents.clear();
    r.inputs[0].contents = Some(contents(x[0].to_f32_vec()));
    let got = rt.block_on(grpc.infer_raw(r)).unwrap();
    assert_same(&got.outputs[0].1, &s.reference("mlp", &x)[0], "contents");
    // Malformed protobuf is INVALID_ARGUMENT.
    let e = rt.block_on(raw::model_infer(&s.grpc, vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f])).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("malformed protobuf"), "{e:?}");
    rt.block_on(grpc.infer_raw(good())).unwrap();
}

fn bad_submit(c: &mut ShmClient, m: &ShmModel, inputs: &[Buffer], outputs: &[Buffer]) -> kairos_client::ClientError {
    let tag = c.submit(m, inputs, outputs, &InferOptions::default()).unwrap();
    c.wait(tag, Wait::Hybrid).unwrap_err()
}

#[test]
fn shm_bad_submissions_and_isolation() {
    let s = start("shm-errors");
    let mut c = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 8, cq_entries: 8, data_bytes: 1 << 16 }).unwrap();
    let m = c.open_model("mlp", "").unwrap();
    assert_eq!(c.open_model("nope", "").unwrap_err().code(), Some(Code::NotFound));
    assert_eq!(c.open_model("mlp", "4").unwrap_err().code(), Some(Code::NotFound));
    let x = s.inputs("mlp", 5);
    let want = s.reference("mlp", &x);
    let input = c.alloc(256).unwrap();
    let output = c.alloc(40).unwrap();
    c.buffer_mut(&input).unwrap().copy_from_slice(&x[0].to_bytes());
    let data = c.layout().data_bytes;
    let span = |offset: u64, len: u64| Buffer { span: Span { offset, len } };
    let cases: Vec<(Vec<Buffer>, Vec<Buffer>, Code, &str)> = vec![
        (vec![span(data - 100, 256)], vec![output], Code::InvalidArgument, "outside the data area"),
        (vec![span(u64::MAX - 10, 256)], vec![output], Code::InvalidArgument, "outside the data area"),
        (vec![span(input.span.offset, 255)], vec![output], Code::InvalidArgument, "takes 256 bytes"),
        (vec![input], vec![span(output.span.offset, 39)], Code::InvalidArgument, "needs 40 bytes"),
        (vec![input], vec![span(data, 40)], Code::InvalidArgument, "outside the data area"),
        (vec![input, input], vec![output], Code::InvalidArgument, "takes 1 inputs"),
        (vec![], vec![output], Code::InvalidArgument, "takes 1 inputs"),
    ];
    for (ins, outs, code, fragment) in cases {
        let e = bad_submit(&mut c, &m, &ins, &outs);
        assert_eq!(e.code(), Some(code), "{e}");
        assert!(e.to_string().contains(fragment), "'{fragment}' not in {e}");
    }
    let ghost = ShmModel { handle: 99, ..m.clone() };
    assert_eq!(bad_submit(&mut c, &ghost, &[input], &[output]).code(), Some(Code::NotFound));
    // The socket path refuses wrong sizes too.
    let e = c.infer_socket(&m, &[s.inputs("pair", 0)[0].clone()], &InferOptions::default()).unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
    // After all that, a good request through the same buffers.
    let tag = c.submit(&m, &[input], &[output], &InferOptions::default()).unwrap();
    let r = c.wait(tag, Wait::Poll).unwrap();
    assert_eq!(r.output_lens, vec![40]);
    let got = kairos_ir::Tensor::from_bytes(kairos_ir::DType::F32, vec![1, 10], c.buffer(&output).unwrap()).unwrap();
    assert_same(&got, &want[0], "after errors");

    // Isolation: a second client's region is its own memory; corrupting one's ring indices
    // disconnects that client only.
    let mut other = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
    let om = other.open_model("mlp", "").unwrap();
    let marker = c.alloc(16).unwrap();
    c.buffer_mut(&marker).unwrap().copy_from_slice(b"only-in-client-A");
    let probe = other.alloc(other.layout().data_bytes - 4096).unwrap();
    assert!(!other.buffer(&probe).unwrap().windows(16).any(|w| w == b"only-in-client-A"));
    // Client A writes an impossible submission tail.
    {
        use kairos_client::shm::ring::RingMemory;
        c.region().sq().tail().store(1_000_000, std::sync::atomic::Ordering::Release);
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let e = c.open_model("mlp", "").unwrap_err();
    assert!(matches!(e, kairos_client::ClientError::Transport(_)), "{e}");
    let (got, _) = other.infer(&om, &x, Wait::Hybrid, &InferOptions::default()).unwrap();
    assert_same(&got[0], &want[0], "other client");
    // A region above the server's limit is refused at HELLO.
    let e = ShmClient::connect(&s.shm, ConnectOptions { data_bytes: 1 << 34, ..ConnectOptions::default() }).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let e = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 3, ..ConnectOptions::default() }).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
}

#[test]
fn full_queues_give_resource_exhausted() {
    let s = start_with("overload", |_, backend| {
        backend.engine.submit_queue_max = 1;
        backend.engine.dispatcher.jobs_max = 1;
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let rest = RestClient::new(&s.http).unwrap();
    let cases: Vec<_> = (0..96u64).map(|i| s.inputs("mlp", i)).collect();
    let wants: Vec<_> = cases.iter().map(|x| s.reference("mlp", x)).collect();
    let results = rt.block_on(async {
        let mut tasks = Vec::new();
        for (i, x) in cases.iter().enumerate() {
            let (g, r, x) = (grpc.clone(), rest.clone(), x[0].clone());
            tasks.push(tokio::spawn(async move {
                if i % 2 == 0 {
                    g.infer("mlp", "", &[("x", &x)], &InferOptions::default()).await
                } else {
                    r.infer("mlp", "", &[("x", &x)], &InferOptions::default(), true).await
                }
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let (mut ok, mut exhausted) = (0, 0);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                assert_same(&r.outputs[0].1, &wants[i][0], &format!("request {i}"));
                ok += 1;
            }
            Err(e) => {
                assert_eq!(e.code(), Some(Code::ResourceExhausted), "request {i}: {e}");
                assert!(i % 2 == 0 || e.to_string().contains("HTTP 429"), "{e}");
                exhausted += 1;
            }
        }
    }
    assert!(ok > 0 && exhausted > 0, "ok {ok}, exhausted {exhausted}");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert!(text.contains("outcome=\"overloaded\""), "{text}");
    // The shared-memory channel: many submissions in flight, each answered or refused.
    let mut c = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 64, cq_entries: 64, data_bytes: 1 << 20 }).unwrap();
    let m = c.open_model("mlp", "").unwrap();
    let mut bufs = Vec::new();
    for x in cases.iter().take(48) {
        let (i, o) = (c.alloc(256).unwrap(), c.alloc(40).unwrap());
        c.buffer_mut(&i).unwrap().copy_from_slice(&x[0].to_bytes());
        bufs.push((i, o));
    }
    let tags: Vec<u64> = bufs.iter().map(|(i, o)| c.submit(&m, &[*i], &[*o], &InferOptions::default()).unwrap()).collect();
    let (mut ok, mut exhausted) = (0, 0);
    for (k, tag) in tags.iter().enumerate().rev() {
        match c.wait(*tag, Wait::Hybrid) {
            Ok(_) => {
                let got =
                    kairos_ir::Tensor::from_bytes(kairos_ir::DType::F32, vec![1, 10], c.buffer(&bufs[k].1).unwrap()).unwrap();
                assert_same(&got, &wants[k][0], &format!("shm {k}"));
                ok += 1;
            }
            Err(e) => {
                assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}");
                exhausted += 1;
            }
        }
    }
    assert_eq!(ok + exhausted, 48);
    assert!(ok > 0, "ok {ok}, exhausted {exhausted}");
}

#[test]
fn a_request_that_does_not_decode_is_counted_under_the_model_class_on_every_protocol() {
    // mlp is real-time (fixtures); the requests ask for best-effort but carry a 63-element input
    // for [1, 64].
    let s = start("class-label");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let short = kairos_ir::Tensor::f32(vec![1, 63], mlp_input(&s)[..63].to_vec());
    let be_opts = InferOptions { real_time: Some(false), ..InferOptions::default() };
    let e = rt.block_on(rest.infer("mlp", "", &[("x", &short)], &be_opts, true)).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let e = rt.block_on(grpc.infer("mlp", "", &[("x", &short)], &be_opts)).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let text = rt.block_on(rest.metrics()).unwrap();
    for protocol in ["http", "grpc"] {
        let counted =
            format!("kairos_requests_total{{model=\"mlp\",class=\"real-time\",protocol=\"{protocol}\",outcome=\"invalid\"}} 1");
        assert!(text.contains(&counted), "{protocol}: {text}");
        assert!(!text.contains(&format!("class=\"best-effort\",protocol=\"{protocol}\",outcome=\"invalid\"")), "{text}");
    }
    // A request that decodes is counted under the class it ran as.
    let x = kairos_ir::Tensor::f32(vec![1, 64], mlp_input(&s));
    rt.block_on(grpc.infer("mlp", "", &[("x", &x)], &be_opts)).unwrap();
    let text = rt.block_on(rest.metrics()).unwrap();
    assert!(
        text.contains("kairos_requests_total{model=\"mlp\",class=\"best-effort\",protocol=\"grpc\",outcome=\"ok\"} 1"),
        "{text}"
    );
}

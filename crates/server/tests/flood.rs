//! The flood: REST, gRPC and shared-memory clients at once, each sending bad requests of many
//! kinds interleaved with good ones for random models; every good request must come back with
//! exactly the CPU reference's outputs, every bad one with its error code, and the server must
//! keep serving. One seed drives the mix (printed; `KAIROS_SEED=N` reproduces a run).

mod common;

use common::*;
use kairos_client::grpc::{GrpcClient, infer_request};
use kairos_client::rest::RestClient;
use kairos_client::shm::layout::Span;
use kairos_client::shm::{Buffer, ConnectOptions, ShmClient, ShmModel, Wait};
use kairos_client::{Code, InferOptions};
use kairos_ir::Tensor;
use std::sync::Arc;

const PER_CLIENT: usize = 150;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn seed() -> u64 {
    let s = std::env::var("KAIROS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0xf100d);
    eprintln!("flood seed {s} (reproduce with KAIROS_SEED={s})");
    s
}

fn named<'a>(names: &'a [String], ts: &'a [Tensor]) -> Vec<(&'a str, &'a Tensor)> {
    names.iter().map(String::as_str).zip(ts.iter()).collect()
}

fn check(s: &TestServer, model: &str, inputs: &[Tensor], got: &[(String, Tensor)], what: &str) {
    let want = s.reference(model, inputs);
    let names = s.output_names(model);
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, w) in want.iter().enumerate() {
        let g = &got.iter().find(|(n, _)| *n == names[i]).unwrap_or_else(|| panic!("{what}: no output {}", names[i])).1;
        assert_same(g, w, what);
    }
}

fn rest_client(s: Arc<TestServer>, seed: u64) -> (usize, usize) {
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let mut rng = Rng(seed | 1);
    let (mut good, mut bad) = (0, 0);
    for i in 0..PER_CLIENT {
        let model = MODELS[rng.below(4) as usize];
        let inputs = s.inputs(model, rng.next());
        let names = s.input_names(model);
        let kind = rng.below(8);
        let what = format!("REST #{i} {model} kind {kind}");
        if kind < 3 {
            let r =
                rt.block_on(rest.infer(model, "", &named(&names, &inputs), &InferOptions::default(), kind == 0)).expect(&what);
            check(&s, model, &inputs, &r.outputs, &what);
            good += 1;
            continue;
        }
        let (path, body, header_length, status): (String, Vec<u8>, Option<usize>, u16) = match kind {
            3 => (format!("/v2/models/{model}/infer"), b"{\"inputs\": [{\"name\": ".to_vec(), None, 400),
            4 => {
                let b = serde_json::json!({ "inputs": [{ "name": names[0], "datatype": "FP16", "shape": [1], "data": [1.0] }] });
                (format!("/v2/models/{model}/infer"), serde_json::to_vec(&b).unwrap(), None, 400)
            }
            5 => (format!("/v2/models/{model}_missing/infer"), b"{}".to_vec(), None, 404),
            6 => {
                // Binary data one byte short.
                let (mut body, n) = kairos_client::rest::infer_body(&named(&names, &inputs), &InferOptions::default(), true);
                body.pop();
                (format!("/v2/models/{model}/infer"), body, n, 400)
            }
            _ => {
                let b = serde_json::json!({ "inputs": [], "outputs": [{ "name": "nope" }] });
                (format!("/v2/models/{model}/infer"), serde_json::to_vec(&b).unwrap(), None, 400)
            }
        };
        let r = rt.block_on(rest.request("POST", &path, body, header_length)).expect(&what);
        assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
        bad += 1;
    }
    (good, bad)
}

fn grpc_client(s: Arc<TestServer>, seed: u64) -> (usize, usize) {
    let rt = runtime();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let mut rng = Rng(seed.rotate_left(17) | 1);
    let (mut good, mut bad) = (0, 0);
    for i in 0..PER_CLIENT {
        let model = MODELS[rng.below(4) as usize];
        let inputs = s.inputs(model, rng.next());
        let names = s.input_names(model);
        let kind = rng.below(6);
        let what = format!("gRPC #{i} {model} kind {kind}");
        let mut req = infer_request(model, "", &named(&names, &inputs), &InferOptions::default());
        let code = match kind {
            0 | 1 => {
                let r = rt.block_on(grpc.infer_raw(req)).expect(&what);
                check(&s, model, &inputs, &r.outputs, &what);
                good += 1;
                continue;
            }
            2 => {
                req.model_name.push_str("_missing");
                Code::NotFound
            }
            3 => {
                req.inputs[0].shape.push(1);
                Code::InvalidArgument
            }
            4 => {
                let n = req.raw_input_contents[0].len();
                req.raw_input_contents[0] = req.raw_input_contents[0].slice(..n - 1);
                Code::InvalidArgument
            }
            _ => {
                req.inputs[0].datatype = "BYTES".into();
                Code::InvalidArgument
            }
        };
        let e = rt.block_on(grpc.infer_raw(req)).expect_err(&what);
        assert_eq!(e.code(), Some(code), "{what}: {e}");
        bad += 1;
    }
    (good, bad)
}

fn shm_client(s: Arc<TestServer>, seed: u64) -> (usize, usize) {
    let mut c = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 16, cq_entries: 16, data_bytes: 1 << 20 }).unwrap();
    let models: Vec<ShmModel> = MODELS.iter().map(|m| c.open_model(m, "").unwrap()).collect();
    let mut rng = Rng(seed.rotate_left(33) | 1);
    let (mut good, mut bad) = (0, 0);
    let data = c.layout().data_bytes;
    for i in 0..PER_CLIENT {
        let k = rng.below(4) as usize;
        let (model, m) = (MODELS[k], models[k].clone());
        let inputs = s.inputs(model, rng.next());
        let kind = rng.below(7);
        let what = format!("shm #{i} {model} kind {kind}");
        let outs = |got: Vec<Tensor>| -> Vec<(String, Tensor)> { s.output_names(model).into_iter().zip(got).collect() };
        match kind {
            0 | 1 => {
                let how = if kind == 0 { Wait::Poll } else { Wait::Hybrid };
                let (got, _) = c.infer(&m, &inputs, how, &InferOptions::default()).expect(&what);
                check(&s, model, &inputs, &outs(got), &what);
                good += 1;
                continue;
            }
            2 => {
                let (got, _) = c.infer_socket(&m, &inputs, &InferOptions::default()).expect(&what);
                check(&s, model, &inputs, &outs(got), &what);
                good += 1;
                continue;
            }
            _ => {}
        }
        let ins: Vec<Buffer> = m.inputs.iter().map(|t| c.alloc(t.len_bytes()).unwrap()).collect();
        let mut outs_b: Vec<Buffer> = m.outputs.iter().map(|t| c.alloc(t.len_bytes()).unwrap()).collect();
        let mut model_handle = m.clone();
        let mut ins_b = ins.clone();
        let code = match kind {
            3 => {
                ins_b[0] = Buffer { span: Span { offset: data - 8, len: ins[0].span.len } };
                Code::InvalidArgument
            }
            4 => {
                outs_b[0].span.len -= 1;
                Code::InvalidArgument
            }
            5 => {
                model_handle.handle = 1000 + i as u32;
                Code::NotFound
            }
            _ => {
                ins_b[0].span.len += 8;
                Code::InvalidArgument
            }
        };
        let tag = c.submit(&model_handle, &ins_b, &outs_b, &InferOptions::default()).expect(&what);
        let e = c.wait(tag, Wait::Hybrid).expect_err(&what);
        assert_eq!(e.code(), Some(code), "{what}: {e}");
        for b in ins.into_iter().chain(outs_b) {
            c.free(b);
        }
        bad += 1;
    }
    (good, bad)
}

#[test]
fn flood_of_bad_requests_interleaved_with_good_ones() {
    let s = Arc::new(start("flood"));
    let seed = seed();
    let (a, b, c) = (s.clone(), s.clone(), s.clone());
    let t1 = std::thread::spawn(move || rest_client(a, seed));
    let t2 = std::thread::spawn(move || grpc_client(b, seed));
    let t3 = std::thread::spawn(move || shm_client(c, seed));
    let (r, g, m) = (t1.join().unwrap(), t2.join().unwrap(), t3.join().unwrap());
    eprintln!("good/bad: REST {r:?}, gRPC {g:?}, shm {m:?}");
    for (good, bad) in [r, g, m] {
        assert!(good > 20 && bad > 20, "the mix must hold both: {good} good, {bad} bad");
    }
    // Still serving, and the counters agree with what the clients saw.
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    assert!(rt.block_on(rest.server_ready()).unwrap());
    let text = rt.block_on(rest.metrics()).unwrap();
    let ok_total = |protocol: &str| -> u64 {
        text.lines()
            .filter(|l| {
                l.starts_with("kairos_requests_total{")
                    && l.contains(&format!("protocol=\"{protocol}\""))
                    && l.contains("outcome=\"ok\"")
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(ok_total("http"), r.0 as u64);
    assert_eq!(ok_total("grpc"), g.0 as u64);
    assert_eq!(ok_total("shm"), m.0 as u64);
}

//! Fuzzing on stable Rust (issue 25): every decoder that takes bytes from outside, called directly,
//! on random inputs and on mutations of the valid seeds in `tests/fuzz_corpus/` (byte flips,
//! truncations, insertions, removals, interesting tokens, and for JSON whole fields replaced).
//!
//! Each property checks that the decoder never panics, that what it accepts is consistent with
//! the model (or limits) it decodes against, that a refusal is a client error with a message, and
//! that no single allocation is larger than a small multiple of the input (a counting allocator:
//! a claimed length or shape is refused before anything is allocated for it).
//!
//! `KAIROS_FUZZ_CASES` sets the cases per property (default [`DEFAULT_CASES`], which keeps this
//! file well under a minute in a debug build on two cores); `KAIROS_FUZZ_SEED` replays a run (the
//! seed is printed). Every property prints how many inputs it executed.

mod common;

use axum::http::{HeaderMap, HeaderValue};
use kairos_client::shm::layout::{Header, Layout, REGION_BYTES_MAX, Span};
use kairos_client::shm::region::Region;
use kairos_client::shm::wire::{self, Reader, TensorSpec, Writer};
use kairos_ir::DType;
use kairos_server::ServeError;
use kairos_server::grpc::pb;
use kairos_server::repository::{self, Repository};
use kairos_server::shm::{SpanUse, check_span};
use kairos_server::state::ModelEntry;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use prost::Message;
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// Cases per property unless `KAIROS_FUZZ_CASES` says otherwise (about 15 s for the file in a
/// debug build on two cores).
const DEFAULT_CASES: u32 = 10_000;
/// Repository layouts touch the file system: they run this many times fewer cases.
const FILE_SYSTEM_CASES_DIVISOR: u32 = 8;
/// A decoder may allocate at most this many times its input in one allocation ...
const ALLOC_PER_INPUT_BYTE_MAX: usize = 64;
/// ... plus this much (fixed-size tables, error messages, a parser's buffers).
const ALLOC_SLACK_BYTES: usize = 4 << 20;

// ------------------------------------------------------------------ the counting allocator

/// Records the largest single allocation a thread makes while armed (see [`largest_alloc`]).
struct Counting;

thread_local! {
    /// Inputs the current property's decoder accepted (see [`accepted`]).
    static ACCEPTED: Cell<u64> = const { Cell::new(0) };
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the bookkeeping touches only
// const-initialized thread-locals (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's own layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's own layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: forwarded with the caller's own pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded with the caller's own pointer, layout and size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the largest single allocation it made on this thread.
/// A panic inside `f` (tract's, which the ONNX loader catches) is not printed: the default hook
/// would capture and symbolize a backtrace, megabytes of allocations that are not the decoder's.
fn largest_alloc<R>(f: impl FnOnce() -> R) -> (R, usize) {
    static QUIET_HOOK: std::sync::Once = std::sync::Once::new();
    QUIET_HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !ARMED.try_with(|a| a.get()).unwrap_or(false) {
                default(info);
            }
        }));
    });
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    (r, LARGEST.with(|l| l.get()))
}

fn check_alloc(what: &str, input_bytes: usize, largest: usize) -> Result<(), TestCaseError> {
    let limit = input_bytes * ALLOC_PER_INPUT_BYTE_MAX + ALLOC_SLACK_BYTES;
    prop_assert!(largest <= limit, "{what}: one allocation of {largest} bytes for {input_bytes} input bytes (limit {limit})");
    Ok(())
}

// ------------------------------------------------------------------ the harness

/// Counts one input the decoder accepted (printed beside the executions: a property whose
/// mutations never get past the first check would fuzz nothing).
fn accepted() {
    ACCEPTED.with(|a| a.set(a.get() + 1));
}

fn cases() -> u32 {
    match std::env::var("KAIROS_FUZZ_CASES") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("KAIROS_FUZZ_CASES='{v}' is not a number")),
        Err(_) => DEFAULT_CASES,
    }
}

fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("KAIROS_FUZZ_SEED") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("KAIROS_FUZZ_SEED='{v}' is not a number")),
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1),
    })
}

/// Runs `test` on `cases()` values of `strategy` (shrinking a failure to a minimal input), prints
/// the number of executions, and fails the test on the first property violation.
fn fuzz<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    fuzz_cases(name, cases(), strategy, test)
}

fn fuzz_cases<S: Strategy>(name: &str, cases: u32, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    ACCEPTED.with(|a| a.set(0));
    let config = Config { cases, failure_persistence: None, rng_seed: RngSeed::Fixed(seed()), ..Config::default() };
    let executions = Cell::new(0u64);
    let t = std::time::Instant::now();
    let result = TestRunner::new(config).run(&strategy, |v| {
        executions.set(executions.get() + 1);
        test(v)
    });
    eprintln!(
        "fuzz {name}: {} executions ({} accepted) in {:.1} s (KAIROS_FUZZ_SEED={})",
        executions.get(),
        ACCEPTED.with(|a| a.get()),
        t.elapsed().as_secs_f64(),
        seed()
    );
    if let Err(e) = result {
        panic!("fuzz {name} (KAIROS_FUZZ_SEED={}): {e}", seed());
    }
}

/// One change to a byte string; positions are taken modulo the length.
#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Remove { at: usize, len: usize },
    Token { at: usize, token: usize, replace: bool },
    Duplicate { at: usize, len: usize },
}

/// Tokens that tend to reach edge cases in text and binary formats.
const TOKENS: &[&[u8]] = &[
    b"1e12",
    b"-1",
    b"0",
    b"18446744073709551615",
    b"9223372036854775808",
    b"99999999999999999999999",
    b"1e400",
    b"NaN",
    b"null",
    b"true",
    b"[]",
    b"{}",
    b"[[[[[[[[[[[[[[[[",
    b"\"",
    b"\\",
    b"\\u0000",
    b",",
    b":",
    b"=",
    b"#",
    b"\n",
    b"binary_data_size",
    b"shape",
    b"data",
    b"../",
    b"/etc/passwd",
    b"\0",
    b"\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
    b"\x00\x00\x00\x00",
    b"\xc3\x28",
    b"\xe2\x82",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..32).prop_map(|(at, len)| Mutation::Remove { at, len }),
        3 => (any::<usize>(), 0..TOKENS.len(), any::<bool>()).prop_map(|(at, token, replace)| Mutation::Token { at, token, replace }),
        1 => (any::<usize>(), 1usize..64).prop_map(|(at, len)| Mutation::Duplicate { at, len }),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    prop::collection::vec(mutation(), 1..6)
}

fn apply(seed: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for m in muts {
        let pos = |at: usize, b: &Vec<u8>| if b.is_empty() { 0 } else { at % (b.len() + 1) };
        match m {
            Mutation::Flip { at, bit } if !b.is_empty() => {
                let i = at % b.len();
                b[i] ^= 1 << bit;
            }
            Mutation::Set { at, byte } if !b.is_empty() => {
                let i = at % b.len();
                b[i] = *byte;
            }
            Mutation::Truncate { at } => b.truncate(pos(*at, &b)),
            Mutation::Insert { at, bytes } => {
                let i = pos(*at, &b);
                b.splice(i..i, bytes.iter().copied());
            }
            Mutation::Remove { at, len } => {
                let i = pos(*at, &b);
                let end = (i + len).min(b.len());
                b.drain(i..end);
            }
            Mutation::Token { at, token, replace } => {
                let i = pos(*at, &b);
                let t = TOKENS[*token];
                let end = if *replace { (i + t.len()).min(b.len()) } else { i };
                b.splice(i..end, t.iter().copied());
            }
            Mutation::Duplicate { at, len } => {
                let i = pos(*at, &b);
                let end = (i + len).min(b.len());
                let copy = b[i..end].to_vec();
                b.splice(end..end, copy);
            }
            _ => {}
        }
    }
    b
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus")
}

/// The corpus files of one folder, sorted: (file name, bytes).
fn corpus(folder: &str) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(corpus_dir().join(folder))
        .unwrap_or_else(|e| panic!("fuzz_corpus/{folder}: {e}"))
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "fuzz_corpus/{folder} is empty");
    v
}

// ------------------------------------------------------------------ the server's models

/// One server over the tiny repository for every property of this file (models are decoded
/// against, never run).
fn server() -> &'static common::TestServer {
    static SERVER: OnceLock<common::TestServer> = OnceLock::new();
    SERVER.get_or_init(|| common::start("fuzz"))
}

fn model(name: &str) -> Arc<ModelEntry> {
    server().server.as_ref().unwrap().state.resolve(name, "").unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every refusal of a decoder is the client's fault and says what is wrong.
fn check_client_error(what: &str, e: &ServeError) -> Result<(), TestCaseError> {
    prop_assert!(
        matches!(e, ServeError::Invalid(_) | ServeError::Unsupported(_) | ServeError::NotFound(_) | ServeError::TooLarge(_)),
        "{what}: not a client error: {e:?}"
    );
    prop_assert!(e.to_string().len() >= 8, "{what}: unclear error '{e}'");
    Ok(())
}

/// An accepted request's inputs are exactly the model's.
fn check_inputs(m: &ModelEntry, inputs: &[kairos_ir::Tensor]) -> Result<(), TestCaseError> {
    prop_assert_eq!(inputs.len(), m.inputs.len());
    for (t, d) in inputs.iter().zip(&m.inputs) {
        prop_assert_eq!(&t.shape, &d.shape, "input {}", d.name);
        prop_assert_eq!(t.dtype(), d.dtype, "input {}", d.name);
        prop_assert_eq!(t.to_bytes().len() as u64, d.len_bytes(), "input {}", d.name);
    }
    Ok(())
}

// ------------------------------------------------------------------ REST

/// A REST seed: model, JSON header, binary part (the binary tensor extension) if any.
struct RestSeed {
    model: String,
    json: Vec<u8>,
    binary: Vec<u8>,
}

fn rest_seeds() -> Vec<RestSeed> {
    corpus("rest")
        .into_iter()
        .map(|(file, json)| {
            let model = file.split('.').next().unwrap().to_string();
            let v: Value = serde_json::from_slice(&json).unwrap_or_else(|e| panic!("{file}: {e}"));
            let binary_bytes: u64 =
                v["inputs"].as_array().unwrap().iter().filter_map(|i| i["parameters"]["binary_data_size"].as_u64()).sum();
            let binary = (0..binary_bytes).map(|i| (i * 7 % 251) as u8).collect();
            RestSeed { model, json, binary }
        })
        .collect()
}

fn rest_decode(model_name: &str, head: &[u8], binary: &[u8], header_len: Option<&[u8]>) -> Result<(), TestCaseError> {
    let m = model(model_name);
    let mut headers = HeaderMap::new();
    if let Some(v) = header_len
        && let Ok(v) = HeaderValue::from_bytes(v)
    {
        headers.insert(kairos_server::rest::HEADER_LENGTH, v);
    }
    let body = [head, binary].concat();
    let (r, largest) = largest_alloc(|| kairos_server::rest::decode_infer_request(&m, &headers, &body));
    check_alloc("REST inference request", body.len(), largest)?;
    match r {
        Ok(d) => {
            accepted();
            check_inputs(&m, &d.inputs)
        }
        Err(e) => check_client_error("REST inference request", &e),
    }
}

fn header_len_of(seed: &RestSeed, json_len: usize) -> Option<Vec<u8>> {
    (!seed.binary.is_empty()).then(|| json_len.to_string().into_bytes())
}

#[test]
fn rest_seeds_decode() {
    for s in rest_seeds() {
        let m = model(&s.model);
        let mut headers = HeaderMap::new();
        if let Some(v) = header_len_of(&s, s.json.len()) {
            headers.insert(kairos_server::rest::HEADER_LENGTH, HeaderValue::from_bytes(&v).unwrap());
        }
        let body = [&s.json[..], &s.binary[..]].concat();
        let d = kairos_server::rest::decode_infer_request(&m, &headers, &body)
            .unwrap_or_else(|e| panic!("seed {} does not decode: {e}", String::from_utf8_lossy(&s.json)));
        check_inputs(&m, &d.inputs).unwrap();
    }
}

#[test]
fn fuzz_rest_mutated_bytes() {
    let seeds = rest_seeds();
    let n = seeds.len();
    let strategy = (0..n, mutations(), prop::option::of(-8i64..8), any::<bool>());
    fuzz("rest_mutated_bytes", strategy, |(i, muts, header_delta, mutate_binary)| {
        let s = &seeds[i];
        let (json, binary) =
            if mutate_binary { (s.json.clone(), apply(&s.binary, &muts)) } else { (apply(&s.json, &muts), s.binary.clone()) };
        let header = match header_delta {
            None => header_len_of(s, json.len()),
            Some(d) => Some((json.len() as i64 + d).to_string().into_bytes()),
        };
        rest_decode(&s.model, &json, &binary, header.as_deref())
    });
}

/// A JSON value meant to break a decoder: huge or negative sizes, wrong types, deep nesting.
fn nasty_json() -> impl Strategy<Value = Value> {
    use serde_json::json;
    let leaf = prop_oneof![
        Just(json!(1e12)),
        Just(json!(1_000_000_000_000u64)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1.5)),
        Just(json!(null)),
        Just(json!(true)),
        Just(json!("")),
        Just(json!("FP16")),
        Just(json!("INT64")),
        Just(json!("x")),
        Just(json!({})),
        Just(json!([])),
        Just(json!([1_000_000_000_000u64])),
        Just(json!([1, 1_000_000_000_000u64, 1_000_000_000_000u64])),
        Just(json!([u64::MAX, u64::MAX])),
        Just(json!({ "binary_data_size": u64::MAX })),
        Just(json!({ "binary_data_size": 1_000_000_000_000u64 })),
        Just(json!({ "binary_data": "yes", "classification": 3 })),
        Just(json!({ "sequence_id": 5, "priority": 1_000_000, "timeout": u64::MAX })),
        Just(json!({ "kairos_class": "urgent", "kairos_tenant": u64::MAX })),
        Just(json!([{ "name": "x" }, { "name": "x" }])),
        (0usize..200).prop_map(|depth| {
            let mut v = json!(1);
            for _ in 0..depth {
                v = json!([v]);
            }
            v
        }),
        prop::collection::vec(any::<i64>(), 0..80).prop_map(|v| json!(v)),
        prop::collection::vec(any::<f64>(), 0..80).prop_map(|v| json!(v)),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf
}

/// Replaces the `k`-th node (pre-order) of `v` with `new`; returns whether it found it.
fn replace_node(v: &mut Value, k: &mut usize, new: &Value) -> bool {
    if *k == 0 {
        *v = new.clone();
        return true;
    }
    *k -= 1;
    match v {
        Value::Array(a) => a.iter_mut().any(|x| replace_node(x, k, new)),
        Value::Object(o) => o.values_mut().any(|x| replace_node(x, k, new)),
        _ => false,
    }
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

#[test]
fn fuzz_rest_field_changes() {
    let seeds = rest_seeds();
    let n = seeds.len();
    let strategy = (0..n, prop::collection::vec((any::<usize>(), nasty_json()), 1..4));
    fuzz("rest_field_changes", strategy, |(i, changes)| {
        let s = &seeds[i];
        let mut v: Value = serde_json::from_slice(&s.json).unwrap();
        for (at, new) in &changes {
            let mut k = at % count_nodes(&v);
            replace_node(&mut v, &mut k, new);
        }
        let json = serde_json::to_vec(&v).unwrap();
        let header = header_len_of(s, json.len());
        rest_decode(&s.model, &json, &s.binary, header.as_deref())
    });
}

#[test]
fn fuzz_rest_random_bytes() {
    let models = common::MODELS;
    let strategy = (
        0..models.len(),
        prop::collection::vec(any::<u8>(), 0..512),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..24)),
    );
    fuzz("rest_random_bytes", strategy, |(i, body, header)| rest_decode(models[i], &body, &[], header.as_deref()));
}

/// Regression: a binary_data_size far beyond the body, and a shape claiming 10^12 elements, are
/// refused before anything is allocated for them.
#[test]
fn rest_huge_claims_are_refused_before_allocating() {
    use serde_json::json;
    let m = model("mlp");
    for (v, binary, want) in [
        (
            json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "parameters": { "binary_data_size": u64::MAX } }] }),
            0,
            "declares",
        ),
        (
            json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1_000_000, 1_000_000], "parameters": { "binary_data_size": 4_000_000_000_000u64 } }] }),
            16,
            "has shape [1, 64]",
        ),
        (
            json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 1_000_000_000_000u64], "data": [1.0] }] }),
            0,
            "has shape [1, 64]",
        ),
        (
            json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "parameters": { "binary_data_size": 256 } }] }),
            100,
            "100 are left",
        ),
    ] {
        let json = serde_json::to_vec(&v).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(kairos_server::rest::HEADER_LENGTH, HeaderValue::from(json.len()));
        let body = [json, vec![0u8; binary]].concat();
        let (r, largest) = largest_alloc(|| kairos_server::rest::decode_infer_request(&m, &headers, &body));
        let e = r.err().expect("refused");
        assert!(e.to_string().contains(want), "{e}");
        assert!(largest < 1 << 20, "allocated {largest} bytes");
    }
}

// ------------------------------------------------------------------ gRPC

/// gRPC seeds: the REST seeds as ModelInferRequests, once with raw contents and once with typed
/// contents where the protocol has them.
fn grpc_seeds() -> Vec<pb::ModelInferRequest> {
    let mut out = Vec::new();
    for s in rest_seeds() {
        let m = model(&s.model);
        let mut headers = HeaderMap::new();
        if let Some(v) = header_len_of(&s, s.json.len()) {
            headers.insert(kairos_server::rest::HEADER_LENGTH, HeaderValue::from_bytes(&v).unwrap());
        }
        let body = [&s.json[..], &s.binary[..]].concat();
        let d = kairos_server::rest::decode_infer_request(&m, &headers, &body).unwrap();
        let tensors: Vec<pb::model_infer_request::InferInputTensor> = m
            .inputs
            .iter()
            .map(|t| pb::model_infer_request::InferInputTensor {
                name: t.name.clone(),
                datatype: t.dtype.kserve_name().into(),
                shape: t.shape.iter().map(|&d| d as i64).collect(),
                ..Default::default()
            })
            .collect();
        let outputs = m
            .outputs
            .iter()
            .map(|t| pb::model_infer_request::InferRequestedOutputTensor { name: t.name.clone(), ..Default::default() })
            .collect();
        let mut parameters = std::collections::HashMap::new();
        parameters.insert(
            "priority".to_string(),
            pb::InferParameter { parameter_choice: Some(pb::infer_parameter::ParameterChoice::Int64Param(2)) },
        );
        let raw = pb::ModelInferRequest {
            model_name: s.model.clone(),
            id: "seed".into(),
            inputs: tensors.clone(),
            outputs,
            raw_input_contents: d.inputs.iter().map(|t| t.to_bytes().into()).collect(),
            parameters,
            ..Default::default()
        };
        let mut typed = pb::ModelInferRequest { raw_input_contents: Vec::new(), ..raw.clone() };
        let mut all_typed = true;
        for (pbt, t) in typed.inputs.iter_mut().zip(&d.inputs) {
            pbt.contents = match &t.data {
                kairos_ir::tensor::TensorData::F32(v) => {
                    Some(pb::InferTensorContents { fp32_contents: v.clone(), ..Default::default() })
                }
                kairos_ir::tensor::TensorData::I64(v) => {
                    Some(pb::InferTensorContents { int64_contents: v.clone(), ..Default::default() })
                }
                kairos_ir::tensor::TensorData::F16(_) => {
                    all_typed = false;
                    None
                }
            };
        }
        out.push(raw);
        if all_typed {
            out.push(typed);
        }
    }
    out
}

fn grpc_decode(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (r, largest) = largest_alloc(|| {
        let Ok(mut req) = pb::ModelInferRequest::decode(bytes) else { return None };
        let m = match server().server.as_ref().unwrap().state.resolve(&req.model_name, &req.model_version) {
            Ok(m) => m,
            Err(e) => return Some(Err(e)),
        };
        Some(kairos_server::grpc::decode_infer_request(&m, &mut req).map(|d| (m, d)))
    });
    check_alloc("gRPC ModelInferRequest", bytes.len(), largest)?;
    match r {
        None => Ok(()),
        Some(Ok((m, d))) => {
            accepted();
            check_inputs(&m, &d.inputs)?;
            prop_assert!(d.outputs.iter().all(|&i| i < m.outputs.len()));
            Ok(())
        }
        Some(Err(e)) => check_client_error("gRPC ModelInferRequest", &e),
    }
}

#[test]
fn grpc_seeds_decode() {
    for r in grpc_seeds() {
        let m = model(&r.model_name);
        let d = kairos_server::grpc::decode_infer_request(&m, &mut r.clone()).unwrap_or_else(|e| panic!("{r:?}: {e}"));
        check_inputs(&m, &d.inputs).unwrap();
    }
}

#[test]
fn fuzz_grpc_mutated_bytes() {
    let seeds: Vec<Vec<u8>> = grpc_seeds().iter().map(|r| r.encode_to_vec()).collect();
    let n = seeds.len();
    fuzz("grpc_mutated_bytes", (0..n, mutations()), |(i, muts)| grpc_decode(&apply(&seeds[i], &muts)));
}

#[test]
fn fuzz_grpc_field_changes() {
    let seeds = grpc_seeds();
    let n = seeds.len();
    let shape = prop_oneof![
        Just(vec![1i64, 64]),
        Just(vec![1i64, 16]),
        Just(vec![1i64, 8]),
        Just(vec![1_000_000_000_000i64]),
        Just(vec![i64::MAX, i64::MAX]),
        Just(vec![-1i64, 64]),
        prop::collection::vec(any::<i64>(), 0..5),
    ];
    let datatype = prop_oneof![Just("FP32"), Just("FP16"), Just("INT64"), Just("BYTES"), Just("")];
    let strategy = (
        0..n,
        0usize..4,
        shape,
        datatype,
        prop::option::of(prop::collection::vec(any::<u8>(), 0..600)),
        prop::option::of(prop::collection::vec(any::<f32>(), 0..80)),
        prop::option::of("[a-z_]{0,8}"),
        any::<bool>(),
    );
    fuzz("grpc_field_changes", strategy, |(i, which, shape, datatype, raw, fp32, name, drop_raw)| {
        let mut r = seeds[i].clone();
        if !r.inputs.is_empty() {
            let k = which % r.inputs.len();
            r.inputs[k].shape = shape;
            r.inputs[k].datatype = datatype.into();
            if let Some(name) = name {
                r.inputs[k].name = name;
            }
            if let Some(v) = fp32 {
                r.inputs[k].contents = Some(pb::InferTensorContents { fp32_contents: v, ..Default::default() });
            }
            if let Some(raw) = raw
                && k < r.raw_input_contents.len()
            {
                r.raw_input_contents[k] = raw.into();
            }
        }
        if drop_raw {
            r.raw_input_contents.pop();
        }
        grpc_decode(&r.encode_to_vec())
    });
}

#[test]
fn fuzz_grpc_random_bytes() {
    fuzz("grpc_random_bytes", prop::collection::vec(any::<u8>(), 0..512), |b| grpc_decode(&b));
}

// ------------------------------------------------------------------ shared memory

/// The server's span check against plain arithmetic without wraparound: accepted exactly when
/// offset + length <= the data area (in u128) and the length fits the tensor.
#[test]
fn fuzz_shm_span_check() {
    let edge = prop_oneof![
        any::<u64>(),
        Just(0u64),
        Just(u64::MAX),
        (0u64..64).prop_map(|d| u64::MAX - d),
        0u64..(1 << 20),
        (0u64..64).prop_map(|d| (1 << 20) - d),
    ];
    let strategy = (edge.clone(), edge.clone(), edge, prop_oneof![Just(0u64), Just(256u64), 0u64..(1 << 21)], any::<bool>());
    fuzz("shm_span_check", strategy, |(offset, len, data_bytes, tensor_bytes, input)| {
        let what = if input { SpanUse::Input } else { SpanUse::Output };
        let span = Span { offset, len };
        let r = check_span(what, "x", span, tensor_bytes, data_bytes);
        let inside = offset as u128 + len as u128 <= data_bytes as u128;
        let fits = if input { len == tensor_bytes } else { len >= tensor_bytes };
        prop_assert_eq!(r.is_ok(), inside && fits, "{:?} in {} bytes: {:?}", span, data_bytes, r);
        match r {
            Ok(range) => {
                accepted();
                prop_assert_eq!(range.start as u64, offset);
                prop_assert_eq!(range.end as u128, offset as u128 + len as u128);
            }
            Err(e) => check_client_error("shared-memory span", &e)?,
        }
        Ok(())
    });
}

/// A client's spans against a real region: reads and writes outside the data area are refused
/// without allocating, and a write inside changes exactly its span.
#[test]
fn fuzz_shm_region_access() {
    let layout = Layout::new(4, 4, 8192).unwrap();
    let (region, _fd) = Region::create(layout, "kairos-fuzz").unwrap();
    let data_bytes = layout.data_bytes;
    let pattern: Vec<u8> = (0..data_bytes).map(|i| (i % 253) as u8).collect();
    let offset = prop_oneof![0u64..data_bytes + 16, any::<u64>(), (0u64..64).prop_map(|d| u64::MAX - d)];
    let len = prop_oneof![0u64..=data_bytes + 16, (0u64..64).prop_map(|d| u64::MAX - d), any::<u64>()];
    fuzz("shm_region_access", (offset, len, any::<bool>()), |(offset, len, write)| {
        let span = Span { offset, len };
        let inside = offset as u128 + len as u128 <= data_bytes as u128;
        region.write_data(Span { offset: 0, len: data_bytes }, &pattern).unwrap();
        if write {
            if len > data_bytes + 16 {
                return Ok(()); // no source buffer of that size
            }
            let src = vec![0xa5u8; len as usize];
            let r = region.write_data(span, &src);
            prop_assert_eq!(r.is_ok(), inside, "{:?}: {:?}", span, r);
            let now = region.read_data_vec(Span { offset: 0, len: data_bytes }).unwrap();
            for (i, (&got, &was)) in now.iter().zip(&pattern).enumerate() {
                let in_span = inside && (i as u64) >= offset && (i as u64) < offset + len;
                prop_assert_eq!(got, if in_span { 0xa5 } else { was }, "byte {} after writing {:?}", i, span);
            }
        } else {
            let (r, largest) = largest_alloc(|| region.read_data_vec(span));
            prop_assert_eq!(r.is_ok(), inside, "{:?}: {:?}", span, r.as_ref().err());
            match r {
                Ok(v) => {
                    accepted();
                    prop_assert_eq!(&v[..], &pattern[offset as usize..(offset + len) as usize]);
                }
                Err(e) => prop_assert!(largest <= 1024, "refused {} after allocating {} bytes", e, largest),
            }
        }
        Ok(())
    });
}

/// The socket messages the server parses (HELLO, OPEN_MODEL, INFER) and the OPEN_MODEL reply the
/// client parses, mutated: a clean error or a value, never a panic, never an allocation beyond
/// the message.
#[test]
fn fuzz_shm_wire_messages() {
    let specs = vec![
        TensorSpec { name: "x".into(), dtype: DType::F32, shape: vec![1, 64] },
        TensorSpec { name: "ids".into(), dtype: DType::I64, shape: vec![1, 8] },
    ];
    let mut seeds = Vec::new();
    let mut w = Writer::new(wire::OP_HELLO);
    w.u32(kairos_client::shm::layout::VERSION).u32(64).u32(64).u64(1 << 20);
    seeds.push(w.buf);
    let mut w = Writer::new(wire::OP_OPEN_MODEL);
    w.str("mlp").str("");
    seeds.push(w.buf);
    let mut w = Writer::new(wire::OP_INFER);
    w.u64(7).u32(0).i32(1).u64(5000).u8(0).u32(0).u32(0).u16(1).bytes(&[0u8; 256]);
    seeds.push(w.buf);
    let mut w = Writer::new(wire::OP_OPEN_MODEL);
    w.u32(0).str("").u32(0).str("1").tensor_specs(&specs).tensor_specs(&specs[..1]);
    seeds.push(w.buf);
    let n = seeds.len();
    fuzz("shm_wire_messages", (0..n, mutations()), |(i, muts)| {
        let msg = apply(&seeds[i], &muts);
        let (r, largest) = largest_alloc(|| -> Result<u64, String> {
            let mut r = Reader::new(&msg);
            let op = r.u8()?;
            match (i, op) {
                (0, wire::OP_HELLO) => {
                    let (_version, sq, cq, data) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?);
                    r.finish()?;
                    let l = Layout::new(sq, cq, data)?;
                    Ok(l.region_bytes)
                }
                (1, wire::OP_OPEN_MODEL) => {
                    let (name, version) = (r.str()?, r.str()?);
                    r.finish()?;
                    Ok((name.len() + version.len()) as u64)
                }
                (2, wire::OP_INFER) => {
                    let _header = (r.u64()?, r.u32()?, r.i32()?, r.u64()?, r.u8()?, r.u32()?, r.u32()?);
                    let count = r.u16()?;
                    let mut total = 0u64;
                    for _ in 0..count {
                        total += r.bytes()?.len() as u64;
                    }
                    r.finish()?;
                    Ok(total)
                }
                (3, wire::OP_OPEN_MODEL) => {
                    let (_status, _message, _handle, _version) = (r.u32()?, r.str()?, r.u32()?, r.str()?);
                    let ins = r.tensor_specs()?;
                    let outs = r.tensor_specs()?;
                    r.finish()?;
                    Ok(ins.iter().chain(&outs).map(TensorSpec::len_bytes).fold(0u64, u64::saturating_add))
                }
                _ => Err(format!("op {op}")),
            }
        });
        check_alloc("shared-memory message", msg.len(), largest)?;
        if r.is_ok() {
            accepted();
        }
        if let (Ok(region_bytes), 0) = (&r, i) {
            prop_assert!(*region_bytes <= REGION_BYTES_MAX);
        }
        Ok(())
    });
}

/// Region headers a peer could have scribbled on: a layout is accepted only when it is exactly
/// one this version writes.
#[test]
fn fuzz_shm_region_header() {
    let good = Layout::new(64, 64, 1 << 20).unwrap().header();
    let field = prop_oneof![any::<u64>(), Just(0u64), Just(u64::MAX), 0u64..(1 << 21)];
    fuzz("shm_region_header", (prop::collection::vec((0usize..9, field), 0..4), any::<u32>()), |(changes, entries)| {
        let mut h: Header = good;
        for (f, v) in changes {
            match f {
                0 => h.magic = v,
                1 => h.version = v as u32,
                2 => h.sq_entries = entries,
                3 => h.cq_entries = v as u32,
                4 => h.region_bytes = v,
                5 => h.sq_offset = v,
                6 => h.cq_offset = v,
                7 => h.data_offset = v,
                _ => h.data_bytes = v,
            }
        }
        if let Ok(l) = Layout::from_header(&h) {
            accepted();
            prop_assert_eq!(l.header(), h);
            prop_assert!(l.region_bytes <= REGION_BYTES_MAX);
            prop_assert!(l.data_offset.checked_add(l.data_bytes) == Some(l.region_bytes));
        }
        Ok(())
    });
}

// ------------------------------------------------------------------ config.toml and repositories

/// A model folder for the config seeds: `model.onnx` and `profile.json` beside `config.toml`.
fn config_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = common::temp_dir("fuzz-config").join("m");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("model.onnx"), b"not onnx").unwrap();
        std::fs::write(d.join("profile.json"), b"{}").unwrap();
        d
    })
}

fn check_config(text: &[u8]) -> Result<(), TestCaseError> {
    let dir = config_dir();
    let text = String::from_utf8_lossy(text);
    let (r, largest) = largest_alloc(|| repository::parse_config("m", dir, &text));
    check_alloc("config.toml", text.len(), largest)?;
    match r {
        Ok(c) => {
            accepted();
            prop_assert!((1..=repository::BATCH_MAX).contains(&c.batch));
            prop_assert!((1..=repository::SEQ_LEN_MAX).contains(&c.seq_len));
            prop_assert!((1..=repository::INSTANCES_MAX).contains(&c.instances));
            prop_assert!(!c.gpus.is_empty());
            prop_assert!(repository::valid_model_name(&c.version));
            prop_assert!(c.deadline_ns.is_none_or(|d| d > 0 && d as f64 <= repository::DEADLINE_MS_MAX * 1e6));
            if let kairos_server::ModelSource::Onnx(p) = &c.source {
                prop_assert!(p.starts_with(dir), "model file {} outside {}", p.display(), dir.display());
            }
            if let Some(p) = &c.profile {
                prop_assert!(p.starts_with(dir), "profile {} outside {}", p.display(), dir.display());
                prop_assert!(!p.components().any(|c| c == std::path::Component::ParentDir), "{}", p.display());
            }
        }
        Err(e) => prop_assert!(e.starts_with("config.toml:") && e.len() > 16, "unclear error '{e}'"),
    }
    Ok(())
}

#[test]
fn config_seeds_parse() {
    for (file, text) in corpus("config") {
        repository::parse_config("m", config_dir(), std::str::from_utf8(&text).unwrap())
            .unwrap_or_else(|e| panic!("seed {file}: {e}"));
    }
}

#[test]
fn fuzz_config_mutated() {
    let seeds = corpus("config");
    let n = seeds.len();
    fuzz("config_mutated", (0..n, mutations()), |(i, muts)| check_config(&apply(&seeds[i].1, &muts)));
}

#[test]
fn fuzz_config_random_lines() {
    let key = prop_oneof![
        Just("model".to_string()),
        Just("profile".to_string()),
        Just("batch".to_string()),
        Just("gpus".to_string()),
        Just("deadline_ms".to_string()),
        Just("version".to_string()),
        Just("dtype".to_string()),
        "[a-z_]{1,10}"
    ];
    let value = prop_oneof![
        Just("\"../../etc/passwd.onnx\"".to_string()),
        Just("\"/etc/passwd.onnx\"".to_string()),
        Just("\"sub/../../x.onnx\"".to_string()),
        Just("\"a\\u0000b\"".to_string()),
        Just("[1, 2, 99999999999999999999]".to_string()),
        Just("1e308".to_string()),
        Just("-0".to_string()),
        "\\PC{0,24}",
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| v.to_string()),
    ];
    let line = (key, value).prop_map(|(k, v)| format!("{k} = {v}"));
    fuzz("config_random_lines", prop::collection::vec(line, 0..6), |lines| check_config(lines.join("\n").as_bytes()));
}

/// Odd repository layouts: folder names, missing and garbage files, links inside and outside the
/// root, loops. Every model name either resolves to files inside the root or is a clear error.
#[test]
fn fuzz_repository_layouts() {
    let base = common::temp_dir("fuzz-repo");
    let outside = base.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("hidden.onnx"), b"secret").unwrap();
    std::fs::write(outside.join("config.toml"), "secret line\n").unwrap();
    let names = prop_oneof![
        Just("a".to_string()),
        Just("b.v2".to_string()),
        Just("..".to_string()),
        Just(".".to_string()),
        Just(".hidden".to_string()),
        Just("with space".to_string()),
        Just("ünï".to_string()),
        Just("x".repeat(repository::MODEL_NAME_BYTES_MAX + 1)),
        "[a-z]{1,3}",
    ];
    #[derive(Clone, Debug)]
    enum Entry {
        Config(String),
        Onnx(Vec<u8>),
        SecondOnnx,
        LinkedFolderOutside,
        LinkedConfigOutside,
        LinkedOnnxOutside,
        LinkedToSibling,
        Dangling,
        Loop,
        ConfigIsFolder,
    }
    let entry = prop_oneof![
        Just(Entry::Config("model = \"m.onnx\"\n".into())),
        Just(Entry::Config("model = \"../outside/hidden.onnx\"\n".into())),
        Just(Entry::Config("profile = \"../../outside/config.toml\"\n".into())),
        Just(Entry::Config("model = \"/etc/hostname\"\n".into())),
        Just(Entry::Config("model = \"resnet18\"\nbatch = 0\n".into())),
        "\\PC{0,40}".prop_map(Entry::Config),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(Entry::Onnx),
        Just(Entry::SecondOnnx),
        Just(Entry::LinkedFolderOutside),
        Just(Entry::LinkedConfigOutside),
        Just(Entry::LinkedOnnxOutside),
        Just(Entry::LinkedToSibling),
        Just(Entry::Dangling),
        Just(Entry::Loop),
        Just(Entry::ConfigIsFolder),
    ];
    let asked = prop_oneof![
        Just("../outside".to_string()),
        Just("/etc".to_string()),
        Just("a/b".to_string()),
        Just("a\0b".to_string()),
        Just("".to_string()),
        "\\PC{0,8}",
    ];
    let counter = Cell::new(0u64);
    let strategy = (prop::collection::vec((names, prop::collection::vec(entry, 0..3)), 0..5), prop::collection::vec(asked, 0..3));
    fuzz_cases("repository_layouts", cases().div_ceil(FILE_SYSTEM_CASES_DIVISOR), strategy, |(folders, asked)| {
        counter.set(counter.get() + 1);
        let root = base.join(format!("repo{}", counter.get()));
        std::fs::create_dir_all(&root).unwrap();
        for (name, entries) in &folders {
            if name == "." || name == ".." {
                continue; // asked for below, never created (they would write into the root or above it)
            }
            let dir = root.join(name);
            if entries.iter().any(|e| matches!(e, Entry::LinkedFolderOutside)) {
                let _ = std::os::unix::fs::symlink(&outside, &dir);
                continue;
            }
            if std::fs::create_dir_all(&dir).is_err() {
                continue;
            }
            for e in entries {
                let _ = match e {
                    Entry::Config(t) => std::fs::write(dir.join("config.toml"), t),
                    Entry::Onnx(b) => std::fs::write(dir.join("m.onnx"), b),
                    Entry::SecondOnnx => std::fs::write(dir.join("n.onnx"), b""),
                    Entry::LinkedFolderOutside => Ok(()),
                    Entry::LinkedConfigOutside => {
                        std::os::unix::fs::symlink(outside.join("config.toml"), dir.join("config.toml"))
                    }
                    Entry::LinkedOnnxOutside => std::os::unix::fs::symlink(outside.join("hidden.onnx"), dir.join("m.onnx")),
                    Entry::LinkedToSibling => std::os::unix::fs::symlink("../a/m.onnx", dir.join("s.onnx")),
                    Entry::Dangling => std::os::unix::fs::symlink(root.join("nowhere.onnx"), dir.join("d.onnx")),
                    Entry::Loop => std::os::unix::fs::symlink(dir.join("loop.onnx"), dir.join("loop.onnx")),
                    Entry::ConfigIsFolder => std::fs::create_dir_all(dir.join("config.toml")),
                };
            }
        }
        let repo = Repository::new(&root);
        let real_root = root.canonicalize().unwrap();
        let mut names = repo.model_names().map_err(|e| TestCaseError::fail(e.to_string()))?;
        names.extend(asked);
        for name in &names {
            match repo.config(name) {
                Ok(c) => {
                    accepted();
                    if let kairos_server::ModelSource::Onnx(p) = &c.source {
                        let real = p.canonicalize().unwrap();
                        prop_assert!(real.starts_with(&real_root), "model '{}' serves {}", name, real.display());
                    }
                }
                Err(e) => {
                    check_client_error("repository", &e)?;
                    prop_assert!(!e.to_string().contains("secret line"), "{e}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&root);
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&base);
}

// ------------------------------------------------------------------ .npy and ONNX

fn check_npy(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (r, largest) = largest_alloc(|| kairos_ir::npy::from_bytes(bytes));
    check_alloc(".npy", bytes.len(), largest)?;
    match r {
        Ok(t) => {
            accepted();
            let n: usize = t.shape.iter().product();
            prop_assert_eq!(n, t.len());
            // Wider types read from narrower ones (f64 -> f32, i32 -> i64) at most double.
            prop_assert!(t.to_bytes().len() <= 2 * bytes.len(), "{} bytes from a {}-byte file", t.to_bytes().len(), bytes.len());
        }
        Err(e) => prop_assert!(e.to_string().len() > 8, "unclear error '{e}'"),
    }
    Ok(())
}

#[test]
fn npy_seeds_parse() {
    for (file, b) in corpus("npy") {
        kairos_ir::npy::from_bytes(&b).unwrap_or_else(|e| panic!("seed {file}: {e}"));
    }
}

#[test]
fn fuzz_npy_mutated() {
    let seeds = corpus("npy");
    let n = seeds.len();
    fuzz("npy_mutated", (0..n, mutations()), |(i, muts)| check_npy(&apply(&seeds[i].1, &muts)));
}

#[test]
fn fuzz_npy_random_headers() {
    let dims = prop::collection::vec(prop_oneof![any::<u64>(), 0u64..8, Just(u64::MAX), Just(1 << 32)], 0..4);
    let descr = prop_oneof![
        Just("<f4".to_string()),
        Just("<f2".to_string()),
        Just("<f8".to_string()),
        Just("<i8".to_string()),
        Just("<i4".to_string()),
        Just(">f4".to_string()),
        Just("|b1".to_string()),
        "[<>|][a-z][0-9]"
    ];
    let strategy = (descr, dims, any::<bool>(), prop::collection::vec(any::<u8>(), 0..64), 1u8..4);
    fuzz("npy_random_headers", strategy, |(descr, dims, fortran, data, version)| {
        let shape = dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
        let header = format!(
            "{{'descr': '{descr}', 'fortran_order': {}, 'shape': ({shape}{}), }}\n",
            if fortran { "True" } else { "False" },
            if dims.len() == 1 { "," } else { "" }
        );
        let mut b = b"\x93NUMPY".to_vec();
        b.extend_from_slice(&[version, 0]);
        if version == 1 {
            b.extend_from_slice(&(header.len() as u16).to_le_bytes());
        } else {
            b.extend_from_slice(&(header.len() as u32).to_le_bytes());
        }
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(&data);
        check_npy(&b)
    });
}

/// The tiny fixtures as ONNX seeds.
fn onnx_seeds() -> Vec<Vec<u8>> {
    use kairos_server::fixtures;
    vec![fixtures::mlp_onnx(), fixtures::pair_onnx(), fixtures::embed_onnx()]
}

/// Loads (and, when that works, lowers) ONNX bytes: an error, never a panic; no allocation beyond
/// a multiple of the file.
fn check_onnx(bytes: &[u8]) -> Result<(), TestCaseError> {
    let opts = kairos_ir::onnx::LoadOptions { batch: Some(1), seq_len: Some(8) };
    let (r, largest) = largest_alloc(|| {
        let g = kairos_ir::onnx::load_bytes("fuzz", bytes, &opts)?;
        kairos_ir::lower::lower(&g, &kairos_ir::lower::LowerOptions::new(DType::F32))
    });
    check_alloc("ONNX", bytes.len(), largest)?;
    match r {
        Ok(_) => accepted(),
        Err(e) => prop_assert!(e.to_string().len() > 8, "unclear error '{e}'"),
    }
    Ok(())
}

#[test]
fn onnx_seeds_load() {
    for b in onnx_seeds() {
        let opts = kairos_ir::onnx::LoadOptions { batch: Some(1), seq_len: Some(8) };
        kairos_ir::onnx::load_bytes("seed", &b, &opts).unwrap();
    }
}

#[test]
fn fuzz_onnx_mutated() {
    let seeds = onnx_seeds();
    let n = seeds.len();
    fuzz("onnx_mutated", (0..n, mutations()), |(i, muts)| check_onnx(&apply(&seeds[i], &muts)));
}

/// Regression (fuzzing): a JSON `data` array far longer than any input of the model was parsed
/// whole before its count was checked (16 bytes per number: a 64 MiB body became a 1 GiB
/// allocation); it is refused as soon as it passes the model's largest input.
#[test]
fn rest_long_data_is_refused_while_parsing() {
    let m = model("mlp");
    let values = vec![0.5f32; 200_000];
    let body = serde_json::to_vec(
        &serde_json::json!({ "inputs": [{ "name": "x", "datatype": "FP32", "shape": [1, 64], "data": values }] }),
    )
    .unwrap();
    let (r, largest) = largest_alloc(|| kairos_server::rest::decode_infer_request(&m, &HeaderMap::new(), &body));
    let e = r.err().expect("refused");
    assert!(e.to_string().contains("more than 64 values"), "{e}");
    assert!(largest < 64 << 10, "allocated {largest} bytes for a 64-value input");
}

/// Found by fuzzing: two bytes changed in `pair.onnx` make tract panic while building its model
/// ("no entry found for key", tract-onnx 0.23.9 model.rs:187); the loader turns that into an error
/// naming the model, so a bad file in a repository never takes the server down.
#[test]
fn onnx_tract_panic_is_an_error() {
    let mut b = kairos_server::fixtures::pair_onnx();
    assert_eq!(b.len(), 935, "the fixture changed: find a new mutation with fuzz_onnx_mutated");
    b[569] = 68;
    b[914] ^= 1 << 4;
    let opts = kairos_ir::onnx::LoadOptions { batch: Some(1), seq_len: Some(8) };
    let (r, _) = largest_alloc(|| kairos_ir::onnx::load_bytes("pair", &b, &opts));
    let e = r.expect_err("the mutated file is refused");
    assert!(e.to_string().contains("model 'pair': cannot read ONNX"), "{e}");
}

//! Draining, cancellation and timeouts on the simulated GPU, paced in real time so that a request
//! lasts as long as its kernels' simulated time: a deep MLP is given a profile that times each of
//! its kernels at 50 ms.
//!
//! - a drain lets the requests in flight finish while readiness is false, liveness true and new
//!   requests (REST, gRPC, shared memory) are refused with 503 / UNAVAILABLE;
//! - a drain past its deadline cancels what is left (503 / UNAVAILABLE, the engine's books say
//!   cancelled);
//! - a REST or gRPC client that goes away, and a shared-memory client that disconnects, get their
//!   requests cancelled (GPU work stopped);
//! - a request past its `timeout` is cancelled and answered 504 / DEADLINE_EXCEEDED.

mod common;

use common::*;
use kairos_client::grpc::GrpcClient;
use kairos_client::rest::RestClient;
use kairos_client::shm::{ConnectOptions, ShmClient, Wait};
use kairos_client::{Code, InferOptions};
use kairos_ir::Tensor;
use kairos_server::State;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// Each kernel of the `deep` model lasts this long (simulated, paced in real time): a cancel stops
/// a request within about one kernel (a kernel of one logical block runs to its end).
const KERNEL_NS: u64 = 50_000_000;
/// How long the tests wait for something that should happen at once.
const PROMPTLY: Duration = Duration::from_secs(10);

/// A server with only `deep` (an MLP of `depth` hidden layers on a [1, 64] input, so about
/// `depth + 1` kernels of [`KERNEL_NS`] each) on the simulator paced in real time; and the
/// model's plan for the reference.
fn start_deep(tag: &str, depth: usize) -> (TestServer, kairos_ir::plan::Plan) {
    let mut plan = None;
    let s = start_with(tag, |cfg, backend| {
        let repo = cfg.state.repository.clone();
        let d = repo.join("deep");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("deep.onnx"), kairos_server::fixtures::mlp_sized_onnx("deep", 64, depth)).unwrap();
        std::fs::write(d.join("config.toml"), "model = \"deep.onnx\"\n").unwrap();
        write_profile(&repo, "deep", KERNEL_NS);
        plan = Some(kairos_server::state::plan_model(&kairos_server::Repository::new(&repo), "deep", None).unwrap().plan);
        cfg.state.load = Some(vec!["deep".into()]);
        backend.real_time = true;
    });
    let plan = Arc::try_unwrap(plan.unwrap()).unwrap_or_else(|p| (*p).clone());
    (s, plan)
}

/// An input of `deep` (and its reference output).
fn input(s: &TestServer, plan: &kairos_ir::plan::Plan, seed: u64) -> (Vec<Tensor>, Vec<Tensor>) {
    let x = s.inputs("mlp", seed);
    let want = kairos_kernels::cpu::execute_plan(plan, &x).unwrap();
    (x, want)
}

fn state(s: &TestServer) -> &State {
    &s.server.as_ref().unwrap().state
}

fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The engine's counters once its books are settled (they are published after each turn of its
/// loop, just after the answers of that turn went out): nothing of any request left on the GPU.
fn settled(s: &TestServer) -> kairos_sched::EngineStats {
    wait_for("the GPU idle", PROMPTLY, || {
        let e = state(s).engine_stats()[0];
        e.jobs == 0 && e.launches_in_flight == 0
    });
    state(s).engine_stats()[0]
}

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn metric(text: &str, line_start: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {line_start} in\n{text}"))
}

#[test]
fn drain_lets_requests_in_flight_finish_and_refuses_new_ones() {
    let (s, plan) = start_deep("drain-finish", 60);
    let rt = multi_thread();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let (x, want) = input(&s, &plan, 1);
    let mut calls = Vec::new();
    for i in 0..3 {
        let (rest, grpc, x) = (rest.clone(), grpc.clone(), x[0].clone());
        calls.push(rt.spawn(async move {
            if i < 2 {
                rest.infer("deep", "", &[("x", &x)], &InferOptions::default(), i == 0).await
            } else {
                grpc.infer("deep", "", &[("x", &x)], &InferOptions::default()).await
            }
        }));
    }
    wait_for("3 requests in flight", PROMPTLY, || state(&s).in_flight() == 3);
    let server = s.server.as_ref().unwrap();
    let stop = AtomicBool::new(false);
    let report = std::thread::scope(|scope| {
        let drain = scope.spawn(|| server.drain(Duration::from_secs(60), &stop));
        wait_for("the drain begins", PROMPTLY, || state(&s).is_draining());
        // Not ready, with the reason; still live.
        let ready = rt.block_on(rest.request("GET", "/v2/health/ready", Vec::new(), None)).unwrap();
        assert_eq!(ready.status, 503);
        assert!(String::from_utf8_lossy(&ready.body).contains("draining"), "{ready:?}");
        assert!(rt.block_on(rest.server_live()).unwrap());
        assert!(!rt.block_on(grpc.server_ready()).unwrap());
        assert!(rt.block_on(grpc.server_live()).unwrap());
        // New requests are refused on every front end.
        let e = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &InferOptions::default(), false)).unwrap_err();
        assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
        assert!(e.to_string().contains("HTTP 503") && e.to_string().contains("draining"), "{e}");
        let e = rt.block_on(grpc.infer("deep", "", &[("x", &x[0])], &InferOptions::default())).unwrap_err();
        assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
        assert!(e.to_string().contains("draining"), "{e}");
        let mut c = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
        let m = c.open_model("deep", "").unwrap();
        let e = c.infer(&m, &x, Wait::Hybrid, &InferOptions::default()).unwrap_err();
        assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
        // The three accepted requests are still running.
        assert_eq!(state(&s).in_flight(), 3);
        drain.join().unwrap()
    });
    assert_eq!((report.in_flight_at_start, report.cancelled, report.left, report.interrupted), (3, 0, 0, false), "{report:?}");
    assert!(report.took < Duration::from_secs(60), "{report:?}");
    for (i, c) in calls.into_iter().enumerate() {
        let r = rt.block_on(c).unwrap().unwrap_or_else(|e| panic!("request {i} in flight during the drain: {e}"));
        assert_same(&r.outputs[0].1, &want[0], &format!("request {i}"));
    }
    let stats = settled(&s);
    assert_eq!((stats.completed, stats.cancelled), (3, 0), "{stats:?}");
}

#[test]
fn drain_past_its_deadline_cancels_the_rest() {
    let (s, plan) = start_deep("drain-deadline", 200);
    let rt = multi_thread();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let (x, _) = input(&s, &plan, 2);
    let (r1, g1, x1, x2) = (rest.clone(), grpc.clone(), x[0].clone(), x[0].clone());
    let calls = [
        rt.spawn(async move { r1.infer("deep", "", &[("x", &x1)], &InferOptions::default(), true).await }),
        rt.spawn(async move { g1.infer("deep", "", &[("x", &x2)], &InferOptions::default()).await }),
    ];
    wait_for("2 requests in flight", PROMPTLY, || state(&s).in_flight() == 2);
    let t = Instant::now();
    let report = s.server.as_ref().unwrap().drain(Duration::from_millis(300), &AtomicBool::new(false));
    assert!(t.elapsed() >= Duration::from_millis(300), "{report:?}");
    assert!(t.elapsed() < Duration::from_millis(300) + kairos_server::DRAIN_CANCEL_WAIT, "{report:?}");
    assert_eq!((report.in_flight_at_start, report.cancelled, report.left), (2, 2, 0), "{report:?}");
    for (i, c) in calls.into_iter().enumerate() {
        let e = rt.block_on(c).unwrap().unwrap_err();
        assert_eq!(e.code(), Some(Code::Unavailable), "request {i}: {e}");
        assert!(e.to_string().contains("draining"), "{e}");
    }
    let stats = settled(&s);
    assert_eq!((stats.completed, stats.cancelled, stats.launches_in_flight), (0, 2, 0), "{stats:?}");
    // The listeners are still open until the shutdown: the metrics say why they were cancelled.
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, "kairos_requests_cancelled_total{model=\"deep\",cause=\"drain\"}"), 2);
    assert_eq!(metric(&text, "kairos_draining "), 1);
    assert_eq!(metric(&text, "kairos_requests_in_flight "), 0);
}

#[test]
fn a_client_that_goes_away_has_its_request_cancelled() {
    let (s, plan) = start_deep("client-gone", 200);
    let rt = multi_thread();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let (x, _) = input(&s, &plan, 3);
    // The engine counts the cancellation before the server forgets the request: wait for both.
    let gone = |n: u64| {
        wait_for("the request cancelled and forgotten", PROMPTLY, || {
            state(&s).engine_stats()[0].cancelled == n && state(&s).in_flight() == 0
        });
    };
    // REST: the client gives up (its connection is dropped) while the request runs.
    let r = rt.block_on(async {
        tokio::time::timeout(Duration::from_millis(300), rest.infer("deep", "", &[("x", &x[0])], &InferOptions::default(), true))
            .await
    });
    assert!(r.is_err(), "the request cannot have finished");
    gone(1);
    // gRPC: the call is dropped (the stream is reset).
    let r = rt.block_on(async {
        tokio::time::timeout(Duration::from_millis(300), grpc.infer("deep", "", &[("x", &x[0])], &InferOptions::default())).await
    });
    assert!(r.is_err(), "the request cannot have finished");
    gone(2);
    // Shared memory: the client disconnects with a request in flight.
    let mut c = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
    let m = c.open_model("deep", "").unwrap();
    let (i, o) = (c.alloc(256).unwrap(), c.alloc(40).unwrap());
    c.buffer_mut(&i).unwrap().copy_from_slice(&x[0].to_bytes());
    c.submit(&m, &[i], &[o], &InferOptions::default()).unwrap();
    wait_for("the shared-memory request in flight", PROMPTLY, || state(&s).in_flight() == 1);
    drop(c);
    gone(3);
    let stats = settled(&s);
    assert_eq!((stats.completed, stats.launches_in_flight), (0, 0), "{stats:?}");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, "kairos_requests_cancelled_total{model=\"deep\",cause=\"client_gone\"}"), 3);
    // The server goes on serving.
    assert!(rt.block_on(rest.server_ready()).unwrap());
}

#[test]
fn a_request_past_its_timeout_is_cancelled_with_deadline_exceeded() {
    let (s, plan) = start_deep("timeout", 20);
    let rt = multi_thread();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let (x, want) = input(&s, &plan, 4);
    let short = InferOptions { timeout_us: 100_000, ..InferOptions::default() };
    let t = Instant::now();
    let e = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &short, false)).unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    assert!(e.to_string().contains("HTTP 504") && e.to_string().contains("timeout of 100000 us"), "{e}");
    assert!(t.elapsed() < Duration::from_millis(900), "answered after {:?}: the request ran on", t.elapsed());
    let e = rt.block_on(grpc.infer("deep", "", &[("x", &x[0])], &short)).unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    let mut c = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
    let m = c.open_model("deep", "").unwrap();
    let e = c.infer(&m, &x, Wait::Hybrid, &short).unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    let stats = settled(&s);
    assert_eq!((stats.completed, stats.cancelled, stats.launches_in_flight), (0, 3, 0), "{stats:?}");
    // A timeout longer than the request changes nothing.
    let long = InferOptions { timeout_us: 30_000_000, ..InferOptions::default() };
    let r = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &long, false)).unwrap();
    assert_same(&r.outputs[0].1, &want[0], "within its timeout");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, "kairos_requests_cancelled_total{model=\"deep\",cause=\"timeout\"}"), 3);
    assert!(text.contains("outcome=\"deadline_exceeded\"} 1"), "{text}");
}

#[test]
fn a_deadline_only_request_is_served_late_and_reported_missed() {
    // 4 kernels of 50 ms: 200 ms a request, past a 50 ms deadline.
    let (s, plan) = start_deep("deadline-only", 4);
    let rt = multi_thread();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let (x, want) = input(&s, &plan, 5);
    let late = InferOptions { deadline_us: 50_000, ..InferOptions::default() };
    let r = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &late, false)).expect("REST: served past its deadline");
    assert!(r.timing.deadline_missed, "REST: {:?}", r.timing);
    assert_same(&r.outputs[0].1, &want[0], "REST, late");
    let r = rt.block_on(grpc.infer("deep", "", &[("x", &x[0])], &late)).expect("gRPC: served past its deadline");
    assert!(r.timing.deadline_missed, "gRPC: {:?}", r.timing);
    assert_same(&r.outputs[0].1, &want[0], "gRPC, late");
    let mut c = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
    let m = c.open_model("deep", "").unwrap();
    let (out, timing) = c.infer(&m, &x, Wait::Hybrid, &late).expect("shared memory: served past its deadline");
    assert!(timing.deadline_missed, "shared memory: {timing:?}");
    assert_same(&out[0], &want[0], "shared memory, late");
    // A deadline met is not reported missed.
    let loose = InferOptions { deadline_us: 30_000_000, ..InferOptions::default() };
    let r = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &loose, false)).unwrap();
    assert!(!r.timing.deadline_missed, "{:?}", r.timing);
    // The same lateness through `timeout` is cancelled; with both, `timeout` cancels.
    let short = InferOptions { timeout_us: 50_000, ..InferOptions::default() };
    let e = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &short, false)).unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    let both = InferOptions { timeout_us: 60_000, deadline_us: 30_000_000, ..InferOptions::default() };
    let e = rt.block_on(grpc.infer("deep", "", &[("x", &x[0])], &both)).unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    // The shared-memory channel carries one of the two: both is the caller's mistake.
    let e = c.infer(&m, &x, Wait::Hybrid, &both).unwrap_err();
    assert!(e.to_string().contains("not both"), "{e}");
    // Out of range: refused on every path.
    let bad = InferOptions { deadline_us: u64::MAX / 2, ..InferOptions::default() };
    let e = rt.block_on(rest.infer("deep", "", &[("x", &x[0])], &bad, false)).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("kairos_deadline_us"), "{e}");
    let e = rt.block_on(grpc.infer("deep", "", &[("x", &x[0])], &bad)).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let e = c.infer(&m, &x, Wait::Hybrid, &bad).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let stats = settled(&s);
    assert_eq!(stats.cancelled, 2, "only the two requests with a timeout were cancelled: {stats:?}");
}

//! The server listens at once and loads its start-up models in the background: readiness says why
//! it is not ready yet, each model serves as soon as it has loaded, repository calls meanwhile do
//! not break the loading, and a shutdown meanwhile returns promptly. A backend whose `prepare`
//! waits for the test's go-ahead holds the loader on a model, so every step is observed in a
//! known state (no sleeps).

mod common;

use common::*;
use kairos_backends::SimBackend;
use kairos_client::grpc::GrpcClient;
use kairos_client::rest::{HttpReply, RestClient};
use kairos_client::{Code, InferOptions};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::plan::Plan;
use kairos_server::EngineHandle;
use kairos_server::state::PlannedModel;
use kairos_server::{Backend, ServeError, State};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest a test waits for something that should happen at once.
const WAIT: Duration = Duration::from_secs(60);

/// The simulator, with a `prepare` that announces the plan (and whether the start-up loader
/// thread asks) on `entered` and then waits for a token on `release` (at most [`WAIT`]: then the
/// model fails, so a broken test never hangs).
struct Gated {
    inner: SimBackend,
    entered: Mutex<Sender<(String, bool)>>,
    release: Mutex<Receiver<()>>,
    /// What `activity` says while a plan is held.
    busy: Mutex<Option<String>>,
}

impl Backend for Gated {
    fn describe(&self) -> String {
        format!("gated {}", self.inner.describe())
    }

    fn start(&self, gpu: u32, models: &[&PlannedModel]) -> Result<(EngineHandle, String), ServeError> {
        self.inner.start(gpu, models)
    }

    fn profiles(&self) -> Option<&ProfileSet> {
        self.inner.profiles()
    }

    fn prepare(&self, plan: &mut Plan) -> Result<Option<String>, ServeError> {
        *self.busy.lock().unwrap() = Some(format!("tuning {}", plan.model));
        let by_loader = std::thread::current().name() == Some("kairos-loader");
        let _ = self.entered.lock().unwrap().send((plan.model.clone(), by_loader));
        let r = self.release.lock().unwrap().recv_timeout(WAIT);
        *self.busy.lock().unwrap() = None;
        match r {
            Ok(()) => self.inner.prepare(plan),
            Err(e) => Err(ServeError::Internal(format!("the test never released {}: {e}", plan.model))),
        }
    }

    fn register_start_model(&self, gpu: u32, model: &PlannedModel) -> Result<(), ServeError> {
        self.inner.register_start_model(gpu, model)
    }

    fn activity(&self) -> Option<String> {
        self.busy.lock().unwrap().clone()
    }
}

/// The test's side of the gate.
struct Gate {
    entered: Receiver<(String, bool)>,
    release: Sender<()>,
}

impl Gate {
    /// The next plan the backend holds, planned by the start-up loader.
    fn next(&self) -> String {
        let (model, by_loader) = self.next_by();
        assert!(by_loader, "{model} planned by a repository call, expected the start-up loader");
        model
    }

    /// The next plan the backend holds, and whether the start-up loader plans it.
    fn next_by(&self) -> (String, bool) {
        self.entered.recv_timeout(WAIT).expect("the server should plan another model")
    }

    /// Lets the held plan go on.
    fn open(&self) {
        self.release.send(()).expect("the backend is alive");
    }

    /// No plan was held beyond those seen.
    fn assert_quiet(&self) {
        if let Ok(m) = self.entered.try_recv() {
            panic!("the server planned {m:?} too");
        }
    }
}

/// A server over the tiny repository that loads `load` at start through a gated backend; returns
/// once it listens (the loader is held in the first model's `prepare` by then or soon after).
fn start_gated(tag: &str, load: &[&str]) -> (TestServer, Gate) {
    let (entered_tx, entered) = channel();
    let (release, release_rx) = channel();
    let load: Vec<String> = load.iter().map(|s| s.to_string()).collect();
    let s = start_custom(
        tag,
        |cfg, _| cfg.state.load = Some(load),
        |inner| {
            Box::new(Gated { inner, entered: Mutex::new(entered_tx), release: Mutex::new(release_rx), busy: Mutex::new(None) })
        },
    );
    (s, Gate { entered, release })
}

fn state(s: &TestServer) -> Arc<State> {
    s.server.as_ref().unwrap().state.clone()
}

/// The `error` field of a JSON error reply.
fn error_of(r: &HttpReply) -> String {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("a JSON body: {e}: {:?}", r.body));
    v["error"].as_str().unwrap_or_else(|| panic!("an error field: {v}")).to_string()
}

fn index_row(rt: &tokio::runtime::Runtime, rest: &RestClient, model: &str) -> (String, String) {
    let idx = rt.block_on(rest.repository_index(false)).unwrap();
    let row = idx.as_array().unwrap().iter().find(|r| r["name"] == model).unwrap_or_else(|| panic!("{model} in {idx}"));
    (row["state"].as_str().unwrap().to_string(), row["reason"].as_str().unwrap().to_string())
}

#[test]
fn models_load_in_the_background_and_readiness_says_why() {
    // `start_gated` returned with the loader held in mlp's prepare: the server listens already.
    let (s, gate) = start_gated("startup-ready", &["mlp", "pair"]);
    assert_eq!(gate.next(), "mlp");
    let state = state(&s);
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let get = |path: &str| rt.block_on(rest.request("GET", path, Vec::new(), None)).unwrap();
    let x = s.inputs("mlp", 1);
    let want = s.reference("mlp", &x);
    let infer_rest = || rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &InferOptions::default(), false));
    let infer_grpc = || rt.block_on(grpc.infer("mlp", "", &[("x", &x[0])], &InferOptions::default()));

    // Live at once; not ready, with the reason: the model being loaded and the backend's activity.
    assert_eq!(get("/v2/health/live").status, 200);
    let r = get("/v2/health/ready");
    assert_eq!(r.status, 503, "ready while mlp loads");
    let reason = error_of(&r);
    assert!(reason.starts_with("loading models: 0 of 2 done (now: mlp, "), "{reason}");
    assert!(reason.ends_with("; tuning mlp)"), "the backend's activity: {reason}");
    assert!(state.not_ready_reason().unwrap().starts_with("loading models: 0 of 2 done (now: mlp, "));
    assert!(!state.is_ready());
    assert!(rt.block_on(grpc.server_live()).unwrap());
    assert!(!rt.block_on(grpc.server_ready()).unwrap());
    let p = state.startup_progress();
    assert_eq!((p.total, p.done, p.ready, p.finished), (2, 0, 0, false), "{p:?}");
    assert_eq!(p.current.as_ref().map(|c| c.0.as_str()), Some("mlp"));
    // Both models are loading: not ready, and inference is 503 / UNAVAILABLE saying so.
    for m in ["mlp", "pair"] {
        assert!(!rt.block_on(rest.model_ready(m, "")).unwrap(), "{m} ready");
        assert!(!rt.block_on(grpc.model_ready(m, "")).unwrap(), "{m} ready (gRPC)");
        assert_eq!(index_row(&rt, &rest, m).0, "LOADING", "{m}");
    }
    let r = get("/v2/models/mlp/ready");
    assert_eq!((r.status, error_of(&r).as_str()), (503, "model 'mlp' is loading"));
    let e = infer_rest().unwrap_err();
    assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
    assert!(e.to_string().contains("HTTP 503: model 'mlp' is loading"), "{e}");
    let e = infer_grpc().unwrap_err();
    assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
    assert!(e.to_string().contains("model 'mlp' is loading"), "{e}");

    // mlp goes on; the loader is held in pair's prepare next, by which time mlp serves.
    gate.open();
    assert_eq!(gate.next(), "pair");
    assert!(rt.block_on(rest.model_ready("mlp", "")).unwrap() && rt.block_on(grpc.model_ready("mlp", "")).unwrap());
    assert_eq!(index_row(&rt, &rest, "mlp").0, "READY");
    assert_same(&infer_rest().unwrap().outputs[0].1, &want[0], "mlp over REST while pair loads");
    assert_same(&infer_grpc().unwrap().outputs[0].1, &want[0], "mlp over gRPC while pair loads");
    assert!(!rt.block_on(rest.model_ready("pair", "")).unwrap());
    let r = get("/v2/health/ready");
    assert_eq!(r.status, 503);
    let reason = error_of(&r);
    assert!(reason.starts_with("loading models: 1 of 2 done (now: pair, ") && reason.ends_with("; tuning pair)"), "{reason}");

    // The last model loads: ready.
    gate.open();
    s.server.as_ref().unwrap().wait_until_ready(WAIT).expect("ready once pair has loaded");
    let r = get("/v2/health/ready");
    assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    assert!(rt.block_on(grpc.server_ready()).unwrap());
    assert_eq!(state.not_ready_reason(), None);
    assert!(rt.block_on(rest.model_ready("pair", "")).unwrap());
    let p = state.startup_progress();
    assert_eq!((p.total, p.done, p.ready, p.finished, p.current.clone()), (2, 2, 2, true, None), "{p:?}");
    assert!(p.unavailable.is_empty(), "{p:?}");
    // Models outside the start-up set were not touched.
    assert_eq!(index_row(&rt, &rest, "embed"), ("UNAVAILABLE".to_string(), "not loaded".to_string()));
    gate.assert_quiet();
}

#[test]
fn repository_calls_during_start_up_loading() {
    let (s, gate) = start_gated("startup-admin", &["mlp", "pair", "embed"]);
    assert_eq!(gate.next(), "mlp");
    let state = state(&s);
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    // Unloading a model the loader has not reached answers at once (the loader holds the admin
    // lock for mlp): it will not be loaded.
    rt.block_on(rest.unload_model("pair")).unwrap();
    assert_eq!(index_row(&rt, &rest, "pair"), ("UNAVAILABLE".to_string(), "unloaded".to_string()));
    // Loading a model the loader has not reached waits for the loader's model (mlp). Whoever
    // takes the admin lock first loads embed next (pair was unloaded): the repository call (the
    // loader then leaves embed alone), or the loader (the repository call then reloads it).
    let http = s.http.clone();
    let loading = std::thread::spawn(move || runtime().block_on(RestClient::new(&http).unwrap().load_model("embed")));
    gate.open();
    let (model, by_loader) = gate.next_by();
    assert_eq!(model, "embed", "pair was unloaded: embed is next");
    gate.open();
    if by_loader {
        let (model, by_loader) = gate.next_by();
        assert_eq!((model.as_str(), by_loader), ("embed", false), "the repository call reloads embed");
        gate.open();
    }
    loading.join().unwrap().expect("the repository load of embed");
    s.server.as_ref().unwrap().wait_until_ready(WAIT).expect("ready");
    gate.assert_quiet();
    assert_eq!(index_row(&rt, &rest, "mlp").0, "READY");
    assert_eq!(index_row(&rt, &rest, "embed").0, "READY");
    assert_eq!(index_row(&rt, &rest, "pair"), ("UNAVAILABLE".to_string(), "unloaded".to_string()));
    let p = state.startup_progress();
    assert_eq!((p.total, p.done, p.ready, p.finished), (3, 3, 2, true), "{p:?}");
    assert_eq!(p.unavailable, vec![("pair".to_string(), "unloaded".to_string())]);
    // The server is ready with pair unloaded, and pair still loads on request afterwards.
    assert!(rt.block_on(rest.server_ready()).unwrap());
    let loading = std::thread::spawn({
        let http = s.http.clone();
        move || runtime().block_on(RestClient::new(&http).unwrap().load_model("pair"))
    });
    assert_eq!(gate.next_by(), ("pair".to_string(), false));
    gate.open();
    loading.join().unwrap().expect("pair loads after the start-up");
    assert!(rt.block_on(rest.model_ready("pair", "")).unwrap());
}

#[test]
fn shutdown_during_start_up_loading_returns_promptly() {
    let (mut s, gate) = start_gated("startup-shutdown", &["mlp", "pair", "embed"]);
    assert_eq!(gate.next(), "mlp");
    let state = state(&s);
    // The shutdown begins while mlp is being planned; the loader finishes mlp, then stops.
    state.begin_shutdown();
    gate.open();
    let t = Instant::now();
    s.server.take().unwrap().shutdown();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    gate.assert_quiet();
    let p = state.startup_progress();
    assert!(p.finished, "{p:?}");
    assert_eq!(p.done, 1, "{p:?}");
    let left: Vec<&str> = p
        .unavailable
        .iter()
        .map(|(n, r)| {
            assert_eq!(r, "the server shut down before loading it");
            n.as_str()
        })
        .collect();
    assert_eq!(left, ["pair", "embed"], "in load order: {p:?}");
    assert_eq!(state.not_ready_reason().as_deref(), Some("the server is shutting down"));
    assert!(state.wait_until_ready(WAIT).is_err());
}

#[test]
fn stopping_the_loader_waits_a_bounded_time() {
    let (mut s, gate) = start_gated("startup-stuck", &["mlp", "pair"]);
    assert_eq!(gate.next(), "mlp");
    let state = state(&s);
    state.begin_shutdown();
    // A model that takes long to plan is not waited for beyond the bound.
    let t = Instant::now();
    assert!(!state.stop_loader(Duration::from_millis(300)), "the loader is still planning mlp");
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(5), "waited {took:?}");
    assert!(state.wait_until_ready(Duration::from_millis(50)).unwrap_err().to_string().contains("shutting down"));
    // Once mlp is planned the loader ends without planning pair.
    gate.open();
    assert!(state.stop_loader(WAIT), "the loader ends after mlp");
    gate.assert_quiet();
    let t = Instant::now();
    s.server.take().unwrap().shutdown();
    assert!(t.elapsed() < Duration::from_secs(5), "shutdown took {:?}", t.elapsed());
}

#[test]
fn waiting_for_readiness_times_out_with_the_reason() {
    let (s, gate) = start_gated("startup-timeout", &["mlp"]);
    assert_eq!(gate.next(), "mlp");
    let e = s.server.as_ref().unwrap().wait_until_ready(Duration::from_millis(100)).unwrap_err();
    assert_eq!(e.status().http, 503);
    assert!(e.to_string().starts_with("not ready after 0.1 s: loading models: 0 of 1 done (now: mlp, "), "{e}");
    gate.open();
    s.server.as_ref().unwrap().wait_until_ready(WAIT).expect("ready");
}

#[test]
fn start_up_models_run_on_their_measured_profiles() {
    // The simulator times a start-up model's kernels from its profile (registered as the model
    // loads, the engines having started before any model was planned); a model loaded later
    // through the repository API runs on roofline timing, as before.
    const KERNEL_NS: u64 = 1_000_000;
    let s = start_with("startup-profiles", |cfg, _| {
        write_profile(&cfg.state.repository, "mlp", KERNEL_NS);
        write_profile(&cfg.state.repository, "mlp_f16", KERNEL_NS);
        cfg.state.load = Some(vec!["mlp".into()]);
    });
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let x = s.inputs("mlp", 2);
    let want = s.reference("mlp", &x);
    let launches = s.plan("mlp").launches.len() as u64;
    let r = rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &InferOptions::default(), false)).unwrap();
    assert_same(&r.outputs[0].1, &want[0], "mlp");
    assert!(r.timing.gpu_ns >= launches * KERNEL_NS, "{launches} kernels of 1 ms each took {} ns", r.timing.gpu_ns);
    rt.block_on(rest.load_model("mlp_f16")).unwrap();
    let r = rt.block_on(rest.infer("mlp_f16", "", &[("x", &x[0])], &InferOptions::default(), false)).unwrap();
    assert!(r.timing.gpu_ns < KERNEL_NS, "roofline timing of a later load: {} ns", r.timing.gpu_ns);
}

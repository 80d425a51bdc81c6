//! Dynamic shapes on the simulated GPU: a model with a dynamic batch and sequence serves every
//! shape within its bounds with a plan for exactly that shape (answers equal the CPU reference's at
//! that shape), refuses shapes outside them, keeps at most `shape_plans_max` variants (least
//! recently used idle one unloaded first), builds a variant off every other request's path, and
//! refuses bounds a model cannot take.

mod common;

use common::*;
use kairos_client::grpc::GrpcClient;
use kairos_client::rest::RestClient;
use kairos_client::{Code, InferOptions};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::plan::Plan;
use kairos_ir::{DType, Tensor};
use kairos_server::state::{EngineHandle, PlannedModel};
use kairos_server::{Backend, ServeError, fixtures};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const DYN_CONFIG: &str = "batch = 1\nseq_len = 4\nbatch_max = 4\nseq_len_min = 2\nseq_len_max = 16\n";

/// Writes the `dyn` model (x [batch, seq, 16] -> y [batch, seq, 8]) into the repository.
fn write_dyn(repo: &Path, extra: &str) {
    fixtures::write_model(repo, "dyn", &fixtures::dyn_seq_onnx(), "dyn_seq.onnx", &format!("{DYN_CONFIG}{extra}")).unwrap();
}

fn x(batch: usize, seq: usize, seed: u64) -> Tensor {
    let n = batch * seq * 16;
    Tensor::f32(vec![batch, seq, 16], (0..n).map(|i| ((i as u64 * 37 + seed * 11) % 201) as f32 / 100.0 - 1.0).collect())
}

/// The CPU reference of `dyn` planned at (batch, seq).
fn reference(repo: &Path, x: &Tensor) -> Tensor {
    let spec = kairos_ir::model::ModelSpec {
        model: repo.join("dyn/dyn_seq.onnx").display().to_string(),
        batch: x.shape[0],
        seq_len: x.shape[1],
        seed: 0,
        dtype: DType::F32,
    };
    kairos_kernels::cpu::execute_plan(&spec.plan().unwrap(), std::slice::from_ref(x)).unwrap().remove(0)
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn loaded_variants(rt: &tokio::runtime::Runtime, rest: &RestClient) -> String {
    let c = rt.block_on(rest.model_config("dyn", "")).unwrap();
    c["parameters"]["shape_variants_loaded"]["string_value"].as_str().unwrap().to_string()
}

#[test]
fn two_shapes_answer_like_the_cpu_reference_and_metadata_shows_dynamic_axes() {
    let s = start_with("dyn-answers", |cfg, _| write_dyn(&cfg.state.repository, ""));
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let repo = s.repository();
    // The start-up shape (1, 4), then two others, each over REST and gRPC.
    for (b, q) in [(1, 4), (2, 5), (3, 16), (2, 5)] {
        let x = x(b, q, (b * 100 + q) as u64);
        let want = reference(&repo, &x);
        assert_eq!(want.shape, vec![b, q, 8]);
        let r = rt.block_on(rest.infer("dyn", "", &[("x", &x)], &InferOptions::default(), true)).unwrap();
        assert_same(r.output("y").unwrap(), &want, &format!("REST ({b}, {q})"));
        let r = rt.block_on(grpc.infer("dyn", "", &[("x", &x)], &InferOptions::default())).unwrap();
        assert_same(r.output("y").unwrap(), &want, &format!("gRPC ({b}, {q})"));
    }
    assert_eq!(loaded_variants(&rt, &rest), "b2s5,b3s16");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, r#"kairos_shape_variant_builds_total{model="dyn",outcome="ok"}"#), 2.0);
    assert!(metric(&text, r#"kairos_shape_variant_build_seconds_total{model="dyn"}"#) > 0.0);
    assert_eq!(metric(&text, r#"kairos_requests_total{model="dyn",class="best-effort",protocol="http",outcome="ok"}"#), 4.0);
    // Metadata: dynamic axes are -1 (KServe v2); the variants are no models of their own.
    for m in [rt.block_on(rest.model_metadata("dyn", "")).unwrap(), rt.block_on(grpc.model_metadata("dyn", "")).unwrap()] {
        assert_eq!(m.inputs[0].shape, vec![-1, -1, 16]);
        assert_eq!(m.outputs[0].shape, vec![-1, -1, 8]);
    }
    let c = rt.block_on(grpc.model_config("dyn", "")).unwrap();
    assert_eq!((c.input[0].dims.clone(), c.output[0].dims.clone()), (vec![-1, -1, 16], vec![-1, -1, 8]));
    let c = rt.block_on(rest.model_config("dyn", "")).unwrap();
    for (k, v) in [("batch_max", "4"), ("seq_len_min", "2"), ("seq_len_max", "16"), ("shape_plans_max", "4")] {
        assert_eq!(c["parameters"][k]["string_value"], v, "{k}: {c}");
    }
    let idx = rt.block_on(rest.repository_index(false)).unwrap();
    assert!(idx.as_array().unwrap().iter().all(|r| !r["name"].as_str().unwrap().contains('@')), "{idx}");
    // A model without bounds is as it was: its one shape, -1 nowhere.
    let m = rt.block_on(rest.model_metadata("mlp", "")).unwrap();
    assert_eq!(m.inputs[0].shape, vec![1, 64]);
}

#[test]
fn shapes_outside_the_bounds_are_refused_naming_input_axis_value_and_bound() {
    let s = start_with("dyn-bounds", |cfg, _| write_dyn(&cfg.state.repository, ""));
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    for (b, q, want) in [
        (5, 4, "input 'x' of model 'dyn': axis 0 (batch) is 5, outside 1..=batch_max = 1..=4"),
        (1, 17, "input 'x' of model 'dyn': axis 1 (sequence) is 17, outside seq_len_min..=seq_len_max = 2..=16"),
        (1, 1, "axis 1 (sequence) is 1, outside seq_len_min..=seq_len_max = 2..=16"),
    ] {
        let x = x(b, q, 0);
        let e = rt.block_on(rest.infer("dyn", "", &[("x", &x)], &InferOptions::default(), true)).unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains(want), "{e}");
        let e = rt.block_on(grpc.infer("dyn", "", &[("x", &x)], &InferOptions::default())).unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains(want), "{e}");
    }
    // A fixed axis is still fixed.
    let bad = Tensor::f32(vec![1, 4, 15], vec![0.0; 60]);
    let e = rt.block_on(rest.infer("dyn", "", &[("x", &bad)], &InferOptions::default(), false)).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("has shape [-1, -1, 16]"), "{e}");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, r#"kairos_shape_variant_builds_total{model="dyn",outcome="ok"}"#), 0.0);
}

#[test]
fn the_variant_cache_keeps_shape_plans_max_and_unloads_the_least_recently_used() {
    let s = start_with("dyn-lru", |cfg, _| write_dyn(&cfg.state.repository, "shape_plans_max = 2\n"));
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let repo = s.repository();
    let infer = |b: usize, q: usize| {
        let x = x(b, q, 1);
        let r = rt.block_on(rest.infer("dyn", "", &[("x", &x)], &InferOptions::default(), true)).unwrap();
        assert_same(r.output("y").unwrap(), &reference(&repo, &x), &format!("({b}, {q})"));
    };
    infer(2, 5);
    infer(3, 6);
    assert_eq!(loaded_variants(&rt, &rest), "b2s5,b3s6");
    infer(2, 5); // (3, 6) is now the least recently used
    infer(4, 7);
    assert_eq!(loaded_variants(&rt, &rest), "b2s5,b4s7");
    infer(3, 6); // built again; (2, 5) goes
    assert_eq!(loaded_variants(&rt, &rest), "b3s6,b4s7");
    infer(1, 4); // the start-up shape is no variant: nothing built, nothing evicted
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, r#"kairos_shape_variant_builds_total{model="dyn",outcome="ok"}"#), 4.0);
    assert_eq!(metric(&text, r#"kairos_shape_variant_evictions_total{model="dyn"}"#), 2.0);
    // Unloading the model unloads its variants with it; a reload starts with none.
    rt.block_on(rest.unload_model("dyn")).unwrap();
    rt.block_on(rest.load_model("dyn")).unwrap();
    assert_eq!(loaded_variants(&rt, &rest), "");
    infer(2, 5);
}

/// Holds the build of the `dyn_seq` plan at batch `hold_batch` until released; fails the one at
/// `fail_batch`. Everything else is the simulator's.
struct Hooked {
    inner: kairos_backends::SimBackend,
    hook: Arc<Hook>,
}

struct Hook {
    hold_batch: usize,
    fail_batch: usize,
    /// (builds that reached the hold, released)
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl Hook {
    fn wait_held(&self, n: usize) {
        let deadline = Instant::now() + READY_WAIT;
        let mut s = self.state.lock().unwrap();
        while s.0 < n {
            let left = deadline.checked_duration_since(Instant::now()).expect("the build reaches the hook");
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
    }

    fn release(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
}

impl Backend for Hooked {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn start(&self, gpu: u32, models: &[&PlannedModel]) -> Result<(EngineHandle, String), ServeError> {
        self.inner.start(gpu, models)
    }
    fn profiles(&self) -> Option<&ProfileSet> {
        self.inner.profiles()
    }
    fn prepare(&self, plan: &mut Plan) -> Result<Option<String>, ServeError> {
        let batch = plan.inputs[0].shape[0];
        if plan.model == "dyn_seq" && batch == self.hook.fail_batch {
            return Err(ServeError::Internal("the test hook fails this shape".into()));
        }
        if plan.model == "dyn_seq" && batch == self.hook.hold_batch {
            let mut s = self.hook.state.lock().unwrap();
            s.0 += 1;
            self.hook.changed.notify_all();
            while !s.1 {
                s = self.hook.changed.wait(s).unwrap();
            }
        }
        self.inner.prepare(plan)
    }
    fn register_start_model(&self, gpu: u32, model: &PlannedModel) -> Result<(), ServeError> {
        self.inner.register_start_model(gpu, model)
    }
}

#[test]
fn requests_are_answered_while_a_variant_builds_and_one_build_serves_its_waiters() {
    let hook = Arc::new(Hook { hold_batch: 3, fail_batch: 4, state: Mutex::new((0, false)), changed: Condvar::new() });
    let h = hook.clone();
    let s =
        start_custom("dyn-slow", |cfg, _| write_dyn(&cfg.state.repository, ""), move |inner| Box::new(Hooked { inner, hook: h }));
    s.server.as_ref().unwrap().wait_until_ready(READY_WAIT).unwrap();
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let repo = s.repository();
    let slow = x(3, 6, 9);
    // Two requests for the same new shape, from two threads of their own.
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let (http, grpc_addr, x) = (s.http.clone(), s.grpc.clone(), slow.clone());
            std::thread::spawn(move || {
                let rt = runtime();
                let r = if i == 0 {
                    let rest = RestClient::new(&http).unwrap();
                    rt.block_on(rest.infer("dyn", "", &[("x", &x)], &InferOptions::default(), true))
                } else {
                    let grpc = rt.block_on(GrpcClient::connect(&grpc_addr)).unwrap();
                    rt.block_on(grpc.infer("dyn", "", &[("x", &x)], &InferOptions::default()))
                };
                r.unwrap().output("y").unwrap().clone()
            })
        })
        .collect();
    hook.wait_held(1);
    // Both wait (in flight, unanswered) behind the one build.
    let deadline = Instant::now() + READY_WAIT;
    while metric(&rt.block_on(rest.metrics()).unwrap(), "kairos_requests_in_flight") < 2.0 {
        assert!(Instant::now() < deadline, "the two requests never reached the server");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A request with a timeout waiting behind the held build is answered at its timeout (504),
    // not when the build ends.
    let (tx, rx) = std::sync::mpsc::channel();
    let (http, x36) = (s.http.clone(), slow.clone());
    std::thread::spawn(move || {
        let rt = runtime();
        let rest = RestClient::new(&http).unwrap();
        let opts = InferOptions { timeout_us: 50_000, ..Default::default() };
        let _ = tx.send(rt.block_on(rest.infer("dyn", "", &[("x", &x36)], &opts, true)).map(|_| ()));
    });
    let e = rx.recv_timeout(READY_WAIT).expect("answered while the build is held").unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, r#"kairos_requests_cancelled_total{model="dyn",cause="timeout"}"#), 1.0);
    assert_eq!(metric(&text, "kairos_requests_in_flight"), 2.0);
    // Meanwhile: another model, this model's start-up shape, and a variant's build failing.
    let mx = s.inputs("mlp", 0);
    let r = rt.block_on(grpc.infer("mlp", "", &[("x", &mx[0])], &InferOptions::default())).unwrap();
    assert_same(r.output("y").unwrap(), &s.reference("mlp", &mx)[0], "mlp during the build");
    let base = x(1, 4, 2);
    let r = rt.block_on(rest.infer("dyn", "", &[("x", &base)], &InferOptions::default(), true)).unwrap();
    assert_same(r.output("y").unwrap(), &reference(&repo, &base), "dyn (1, 4) during the build");
    assert!(waiters.iter().all(|w| !w.is_finished()), "answered before its variant was built");
    // The failing build waits behind the held one (one builder thread): release first.
    hook.release();
    for w in waiters {
        assert_same(&w.join().unwrap(), &reference(&repo, &slow), "(3, 6) after the build");
    }
    let e = rt.block_on(rest.infer("dyn", "", &[("x", &x(4, 4, 0))], &InferOptions::default(), true)).unwrap_err();
    assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
    assert!(e.to_string().contains("cannot serve batch 4, seq_len 4: building its plan failed"), "{e}");
    assert!(e.to_string().contains("the test hook fails this shape"), "{e}");
    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(hook.state.lock().unwrap().0, 1, "one build for both requests");
    assert_eq!(metric(&text, r#"kairos_shape_variant_builds_total{model="dyn",outcome="ok"}"#), 1.0);
    assert_eq!(metric(&text, r#"kairos_shape_variant_builds_total{model="dyn",outcome="failed"}"#), 1.0);
    assert_eq!(metric(&text, "kairos_requests_in_flight"), 0.0);
}

#[test]
fn bounds_a_model_cannot_take_are_config_errors() {
    let s = start("dyn-config");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let repo = s.repository();
    let mlp = fixtures::mlp_onnx();
    let batch_only = {
        use kairos_ir::signature::Dim;
        let mut b = kairos_ir::zoo::builder::OnnxBuilder::new("batch_only", 17, 1);
        let x = b.input_dims("x", DType::F32, &[Dim::Symbol("n".into()), Dim::Fixed(16)]);
        let y = b.gemm_linear(&x, "fc", 16, 8);
        b.output_dims(&y, "y", DType::F32, &[Dim::Symbol("n".into()), Dim::Fixed(8)]);
        b.finish_bytes()
    };
    for (name, onnx, config, want) in [
        ("fixed_b", &mlp, "batch_max = 4\n", "batch_max is set, but no input of"),
        ("fixed_s", &mlp, "seq_len_max = 64\n", "seq_len_min/seq_len_max are set, but no input of"),
        ("batch_s", &batch_only, "seq_len_max = 64\n", "no input of"),
        ("range_b", &batch_only, "batch_max = 5000\n", "batch_max = 5000 must be in 1..=4096"),
        ("range_p", &batch_only, "batch_max = 4\nshape_plans_max = 0\n", "shape_plans_max = 0 must be in 1..=64"),
    ] {
        fixtures::write_model(&repo, name, onnx, "m.onnx", config).unwrap();
        let e = rt.block_on(rest.load_model(name)).unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{name}: {e}");
        assert!(e.to_string().contains(want), "{name}: {e}");
    }
    // A batch-only model takes batch_max, and serves batch 3.
    fixtures::write_model(&repo, "batch_ok", &batch_only, "m.onnx", "batch_max = 4\n").unwrap();
    rt.block_on(rest.load_model("batch_ok")).unwrap();
    let x = Tensor::f32(vec![3, 16], (0..48).map(|i| i as f32 / 48.0).collect());
    let r = rt.block_on(rest.infer("batch_ok", "", &[("x", &x)], &InferOptions::default(), true)).unwrap();
    assert_eq!(r.output("y").unwrap().shape, vec![3, 8]);
    assert_eq!(rt.block_on(rest.model_metadata("batch_ok", "")).unwrap().inputs[0].shape, vec![-1, 16]);
}

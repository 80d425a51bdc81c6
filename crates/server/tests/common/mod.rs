//! A server on the simulated GPU (computation on) over the tiny fixture repository, on free ports,
//! with its shared-memory socket in a temporary folder; and the CPU reference to check answers.
#![allow(dead_code)]

use kairos_backends::SimBackend;
use kairos_ir::{DType, Tensor};
use kairos_server::state::{PlannedModel, plan_model};
use kairos_server::{Backend, Repository, RunningServer, ServerConfig, ShmConfig, fixtures};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a test waits for the tiny repository to load before it fails.
pub const READY_WAIT: Duration = Duration::from_secs(60);

pub struct TestServer {
    pub server: Option<RunningServer>,
    pub dir: PathBuf,
    pub http: String,
    pub grpc: String,
    pub shm: PathBuf,
    plans: HashMap<String, PlannedModel>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kairos-{tag}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Starts a server and waits until its models are loaded; `tweak` may change the configuration
/// and the simulated backend.
pub fn start_with(tag: &str, tweak: impl FnOnce(&mut ServerConfig, &mut SimBackend)) -> TestServer {
    let s = start_custom(tag, tweak, |b| Box::new(b));
    s.server.as_ref().unwrap().wait_until_ready(READY_WAIT).expect("the tiny repository loads");
    s
}

/// Starts a server on the backend `wrap` makes of the simulated one, and returns once it listens
/// (its models load in the background).
pub fn start_custom(
    tag: &str,
    tweak: impl FnOnce(&mut ServerConfig, &mut SimBackend),
    wrap: impl FnOnce(SimBackend) -> Box<dyn Backend>,
) -> TestServer {
    let dir = temp_dir(tag);
    let repo = dir.join("models");
    std::fs::create_dir_all(&repo).unwrap();
    let names = fixtures::write_tiny_repository(&repo).unwrap();
    let mut cfg = ServerConfig::new(&repo);
    cfg.http = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.grpc = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.shm = Some(ShmConfig { socket: dir.join("kairos.sock"), ..ShmConfig::default() });
    let mut backend = SimBackend::new(kairos_sim::GpuDesc::h100_sxm(), 7);
    tweak(&mut cfg, &mut backend);
    let shm = cfg.shm.as_ref().map(|s| s.socket.clone()).unwrap_or_default();
    let server = RunningServer::start(cfg, wrap(backend)).expect("server starts");
    let r = Repository::new(&repo);
    let plans = names.iter().map(|n| (n.clone(), plan_model(&r, n, None).unwrap())).collect();
    TestServer {
        http: format!("http://{}", server.http_addr().unwrap()),
        grpc: format!("http://{}", server.grpc_addr().unwrap()),
        shm,
        server: Some(server),
        dir,
        plans,
    }
}

pub fn start(tag: &str) -> TestServer {
    start_with(tag, |_, _| {})
}

impl TestServer {
    pub fn plan(&self, model: &str) -> &kairos_ir::plan::Plan {
        &self.plans[model].plan
    }

    /// Seeded inputs for a model: floats in [-1, 1], token ids in [0, 100).
    pub fn inputs(&self, model: &str, seed: u64) -> Vec<Tensor> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        self.plan(model)
            .inputs
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

    /// The CPU reference's outputs.
    pub fn reference(&self, model: &str, inputs: &[Tensor]) -> Vec<Tensor> {
        kairos_kernels::cpu::execute_plan(self.plan(model), inputs).unwrap()
    }

    pub fn input_names(&self, model: &str) -> Vec<String> {
        self.plan(model).inputs.iter().map(|t| t.name.clone()).collect()
    }

    pub fn output_names(&self, model: &str) -> Vec<String> {
        self.plan(model).outputs.iter().map(|t| t.name.clone()).collect()
    }

    pub fn repository(&self) -> PathBuf {
        self.dir.join("models")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Asserts two tensors are equal element by element (the simulator runs the very CPU reference
/// kernels, block by block, so results match exactly).
pub fn assert_same(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(
        got.to_bytes(),
        want.to_bytes(),
        "{what}: values differ: got {:?}... want {:?}...",
        &got.to_f32_vec()[..4.min(got.len())],
        &want.to_f32_vec()[..4.min(want.len())]
    );
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

pub const MODELS: [&str; 4] = ["mlp", "mlp_f16", "pair", "embed"];

/// Writes a profile that times every kernel of `model`'s plan at `kernel_ns` into its folder, and
/// names it in its config.
pub fn write_profile(repo: &std::path::Path, model: &str, kernel_ns: u64) {
    use kairos_gpu::profile::{KernelProfile, ModelProfile};
    let plan = kairos_server::state::plan_model(&kairos_server::Repository::new(repo), model, None).unwrap().plan;
    let profile = ModelProfile {
        model: plan.model.clone(),
        dtype: plan.dtype,
        batch: 1,
        device: "NVIDIA H100 80GB HBM3".into(),
        sm_count: 132,
        latency_ns: kernel_ns * plan.launches.len() as u64,
        kernels: plan
            .launches
            .iter()
            .enumerate()
            .map(|(i, l)| KernelProfile {
                launch: i as u32,
                name: l.name.clone(),
                kernel: l.kernel.name().into(),
                duration_ns: kernel_ns,
                logical_blocks: l.shape.logical_blocks,
                ctas: l.shape.logical_blocks,
                threads_per_cta: 0,
                registers_per_thread: 0,
                shared_mem_bytes: 0,
                ctas_per_sm_max: 0,
                occupancy: 0.0,
                min_sms: 0,
                duration_by_sms: vec![],
            })
            .collect(),
        layers: None,
        placements: None,
    };
    let dir = repo.join(model);
    profile.save(&dir.join("profile.json")).unwrap();
    let mut config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    config.push_str("profile = \"profile.json\"\n");
    std::fs::write(dir.join("config.toml"), config).unwrap();
}

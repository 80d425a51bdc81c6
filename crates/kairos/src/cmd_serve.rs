//! `kairos serve`: the inference server (Open Inference Protocol over REST and gRPC, the local
//! shared-memory channel, Prometheus metrics) over a model repository folder.

use crate::cmd_run::sim_desc;
use anyhow::{Context, Result, bail};
use clap::{ArgAction, Args, ValueEnum};
use kairos_backends::{CudaBackend, SimBackend, TestFaults};
use kairos_gpu::profile::ProfileSet;
use kairos_sched::EngineConfig;
use kairos_server::{Backend, RunningServer, ServerConfig, ShmConfig, StateConfig, WorkerBackend, WorkerSpawn};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Where each GPU's engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpuWorkers {
    /// In worker processes with the CUDA backend, in the server's process on the simulator.
    Auto,
    /// In a worker process per GPU, restarted after a GPU fault.
    On,
    /// In the server's process (a sticky CUDA fault then stops the server's GPU for good).
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ServeBackend {
    /// The GPU when the NVIDIA driver reports one, else the simulator.
    Auto,
    /// The simulated GPU, with computation on (results come from the CPU reference kernels).
    Sim,
    /// Real NVIDIA GPUs through the CUDA driver.
    Cuda,
}

/// `kairos serve --help`'s text after the options: the repository's `config.toml` keys (from
/// [`kairos_server::repository::CONFIG_KEYS`]) and the requests the server takes.
fn repository_help() -> String {
    format!(
        "MODEL REPOSITORY
  One folder per model; the folder's name is the model's name. A folder holds an .onnx file and/or
  a config.toml (TOML: top-level `key = value` lines, # comments, no tables; unknown keys are
  refused). Without config.toml, a folder with one .onnx file serves it, and any other folder is the
  zoo model of its name (`kairos zoo list`). The keys, each with an example:

{}
{REQUESTS_HELP}",
        kairos_server::repository::config_keys_help(2, 100)
    )
}

const REQUESTS_HELP: &str = "\
REQUESTS
  Open Inference Protocol (KServe v2) over REST (/v2/...) and gRPC (inference.GRPCInferenceService),
  with Triton's repository (index/load/unload), model configuration and statistics extensions; the
  binary tensor data extension on REST. Request parameters: priority (Triton's levels: 1 is the most
  urgent, 0 the model's own), timeout (microseconds: the request's deadline, and past it the request is
  cancelled and answered 504 / DEADLINE_EXCEEDED), kairos_deadline_us (microseconds: a deadline only,
  scheduled for and reported in kairos_deadline_missed, the late result still delivered; with timeout
  too, it is the deadline and timeout only cancels), kairos_class
  (real-time / best-effort), kairos_tenant. Responses carry kairos_engine_ns, kairos_gpu_ns,
  kairos_queue_ns and kairos_deadline_missed. Prometheus metrics on GET /metrics (REST port).
  Local clients: the shared-memory channel on --shm-socket (kairos_client::shm::ShmClient).";

#[derive(Args, Debug)]
#[command(after_long_help = repository_help())]
pub struct ServeArgs {
    /// The model repository folder (see `kairos serve --help`).
    #[arg(long, short = 'r', env = "KAIROS_MODEL_REPOSITORY", default_value = "models")]
    pub repository: PathBuf,
    /// Where kernels run.
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "auto")]
    pub backend: ServeBackend,
    /// GPUs to drive (CUDA ordinals 0..N, or N simulated GPUs).
    #[arg(long, env = "KAIROS_GPUS", default_value_t = 1)]
    pub gpus: u32,
    /// Models to load at start, comma-separated (default: every folder of the repository; `none`: none).
    #[arg(long, env = "KAIROS_LOAD", value_delimiter = ',')]
    pub load: Option<Vec<String>>,
    /// REST address, or `off`.
    #[arg(long, env = "KAIROS_HTTP", default_value = "0.0.0.0:8000")]
    pub http: String,
    /// gRPC address, or `off`.
    #[arg(long, env = "KAIROS_GRPC", default_value = "0.0.0.0:8001")]
    pub grpc: String,
    /// Unix socket of the shared-memory channel (mode 0600), or `off`.
    #[arg(long, env = "KAIROS_SHM_SOCKET", default_value = "/tmp/kairos.sock")]
    pub shm_socket: String,
    /// Scheduling policy: fifo, streams, streams-kernel, paella, edf, sjf, rr, reef, seq, krisp, static (with parameters: see
    /// `kairos bench list`).
    #[arg(long, env = "KAIROS_POLICY", default_value = "paella")]
    pub policy: String,
    /// Largest REST body / gRPC message, bytes (413 / refused beyond).
    #[arg(long, env = "KAIROS_REQUEST_BYTES_MAX", default_value_t = 64 << 20)]
    pub request_bytes_max: usize,
    /// Who may index, load and unload models over REST and gRPC: `on` (everyone), `off` (no one:
    /// 403 / PERMISSION_DENIED), or a key of 16 to 256 printable characters that requests must carry
    /// in the `x-kairos-control-key` header (REST) or metadata (gRPC). Prefer the environment
    /// variable for a key: command lines are visible to other users.
    #[arg(long, env = "KAIROS_CONTROL_API", default_value = "on", hide_env_values = true)]
    pub control_api: kairos_server::ControlAccess,
    /// TLS certificate chain (PEM, the server's certificate first) for the REST and gRPC
    /// listeners; needs --tls-key. With both, those listeners speak only TLS (rustls; HTTPS and
    /// gRPC over TLS); without, plain TCP. The shared-memory channel is local and unaffected.
    #[arg(long, env = "KAIROS_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert's certificate (PEM: PKCS#8, PKCS#1 or SEC1); needs --tls-cert.
    #[arg(long, env = "KAIROS_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Commands waiting for each dispatcher thread; more is 429 / RESOURCE_EXHAUSTED.
    #[arg(long, env = "KAIROS_SUBMIT_QUEUE_MAX", default_value_t = 4096)]
    pub submit_queue_max: usize,
    /// With nothing in flight each dispatcher thread polls its queue for this many µs since it
    /// last had work before it sleeps (a core busy meanwhile; a request arriving then is taken
    /// without a thread wake-up: for real-time requests on a server that is often idle). 0: sleep
    /// at once.
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub idle_spin_us: u64,
    /// Requests each dispatcher holds (waiting or running); more is 429 / RESOURCE_EXHAUSTED.
    #[arg(long, env = "KAIROS_JOBS_MAX", default_value_t = 4096)]
    pub jobs_max: usize,
    /// Streams in each dispatcher's pool (default: the device's hardware queues, at least 32). A
    /// kernel-level job holds one while it has launches in flight, so this caps how many run at
    /// once: on an H200 `--policy edf:0+backfill --stream-count 8` held the tail of an 8-model
    /// vision mix to 1.22-1.27x the load of PyTorch's CUDA graphs on 8 streams (`edf:0`, which
    /// the backfill does not change there) and of the 11-model mix to 1.11x, with a lower p99 than
    /// theirs at every load (docs/benchmarks.md).
    #[arg(long, env = "KAIROS_STREAM_COUNT", value_parser = clap::value_parser!(u32).range(1..=kairos_sched::STREAMS_MAX as i64))]
    pub stream_count: Option<u32>,
    /// GPU memory for model weights, in MiB, per GPU (DeepPlan): models keep their weights in
    /// pinned host memory and are loaded when a request needs them, least recently used idle
    /// models evicted to make room. Unset: every model's weights stay in GPU memory from its load.
    #[arg(long, env = "KAIROS_WEIGHT_BUDGET_MIB")]
    pub weight_budget_mib: Option<u64>,
    /// How a model not in GPU memory is loaded (with --weight-budget-mib): load-then-run,
    /// pipelined (each kernel waits only for its own layer's copy) or deepplan (pipelined, with the
    /// layers DeepPlan's planner picks read in place from host memory; needs a layer profile from
    /// `kairos profile --layers`, else it loads every layer), parallel or parallel-deepplan
    /// (DeepPlan's parallel transmission: the later layers copied by NVLink peer GPUs and
    /// forwarded; CUDA only; without a peer they are pipelined and deepplan).
    #[arg(long, env = "KAIROS_COLD_STRATEGY", default_value = "deepplan")]
    pub cold_strategy: kairos_sched::cold::ColdStrategy,
    /// Loads' copies go on the copy engine while less than this many KiB of them (all loads
    /// together, the first started first) are there, in pieces of at most half of it (with
    /// --weight-budget-mib): the engine runs its queue in order, so warm requests' input copies
    /// wait behind at most 1.5x this much of loads. 0: each load's copies all at once.
    #[arg(long, env = "KAIROS_COLD_COPY_WINDOW_KIB", default_value_t = kairos_sched::dispatcher::COLD_COPY_WINDOW_BYTES_DEFAULT >> 10)]
    pub cold_copy_window_kib: u64,
    /// Which idle resident model a load evicts (with --weight-budget-mib): lru (least recently
    /// used, DeepPlan's) or lru2 (the oldest second-to-last request first, then least recently
    /// used: a model under steady traffic is not evicted by a burst of models asked once).
    #[arg(long, env = "KAIROS_EVICTION", default_value = "lru")]
    pub eviction: kairos_sched::Eviction,
    /// Staging memory, MiB, that each secondary GPU reserves for each GPU it copies for under
    /// the parallel cold strategies (parallel, parallel-deepplan: DeepPlan's parallel transmission
    /// through the NVLink peers `kairos inspect --gpus` lists; CUDA backend only).
    #[arg(long, env = "KAIROS_PEER_STAGING_MIB", default_value_t = PEER_STAGING_MIB_DEFAULT)]
    pub peer_staging_mib: u64,
    /// Shared-memory clients served at once.
    #[arg(long, env = "KAIROS_SHM_CLIENTS_MAX", default_value_t = 64)]
    pub shm_clients_max: usize,
    /// Largest shared-memory region one client may ask for, bytes.
    #[arg(long, env = "KAIROS_SHM_REGION_BYTES_MAX", default_value_t = 1 << 30)]
    pub shm_region_bytes_max: u64,
    /// Microseconds a shared-memory client thread spins on its ring before it sleeps.
    #[arg(long, env = "KAIROS_SHM_SPIN_US", default_value_t = 20)]
    pub shm_spin_us: u64,
    /// Largest shared-memory request (inputs plus outputs, bytes) whose tensors the GPU reads and
    /// writes in place in the client's region; larger ones are copied (kernels reading host
    /// memory over PCIe are slower than one copy of a large tensor).
    #[arg(long, env = "KAIROS_SHM_ZERO_COPY_BYTES_MAX", default_value_t = kairos_server::shm::ZERO_COPY_BYTES_MAX)]
    pub shm_zero_copy_bytes_max: u64,
    /// tokio worker threads for REST and gRPC.
    #[arg(long, env = "KAIROS_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// On SIGTERM or Ctrl-C, drain: not ready at once, new requests refused (503 / UNAVAILABLE),
    /// requests in flight finish, and those still running after this many seconds are cancelled;
    /// then the process exits with status 0. 0: cancel at once. A second signal stops at once.
    #[arg(long, env = "KAIROS_DRAIN_TIMEOUT_S", default_value_t = kairos_server::DRAIN_TIMEOUT_S_DEFAULT)]
    pub drain_timeout_s: u64,
    /// Simulated GPU: h100-sxm, h100-pcie, h200, or a description file (.json, as data/gpus/).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    /// Run the CPU reference kernels on the simulator so results are real (`false`: timing only,
    /// outputs are zeros).
    #[arg(long, env = "KAIROS_SIM_COMPUTE", default_value_t = true, action = ArgAction::Set)]
    pub sim_compute: bool,
    /// Seed of the simulator.
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Folder of `kairos profile` JSONs for kernel time estimates (default: data/profiles/<sim gpu>
    /// on the simulator, the device's on CUDA, when present; found beside the installation).
    #[arg(long, env = "KAIROS_PROFILES")]
    pub profiles: Option<PathBuf>,
    /// CUDA: keep the lowering's tiles (by default fp16 convolution and matrix-product tiles are
    /// autotuned when a model loads; choices are cached beside the CUBIN cache).
    #[arg(long, env = "KAIROS_NO_AUTOTUNE")]
    pub no_autotune: bool,
    /// Log filter (tracing's env-filter syntax), also read from RUST_LOG.
    #[arg(long, env = "KAIROS_LOG", default_value = "info")]
    pub log: String,
    /// Each GPU's engine in a worker process that the server restarts after a GPU fault (a sticky
    /// CUDA error lasts as long as the process that hit it): auto (on with CUDA, off on the
    /// simulator), on, off. A worker costs each request a pipe hop both ways, and shared-memory
    /// requests are copied instead of read in place.
    #[arg(long, value_enum, env = "KAIROS_GPU_WORKERS", default_value = "auto")]
    pub gpu_workers: GpuWorkers,
    /// Seconds a GPU worker may take from its start until it says ready (CUDA's initialisation);
    /// past it the worker is killed and the start counts as failed (a GPU is given up after 3 failed starts in a row; its requests get 503 /
    /// UNAVAILABLE with the cause meanwhile).
    #[arg(long, env = "KAIROS_WORKER_START_TIMEOUT_S", default_value_t = kairos_server::worker::WORKER_START_TIMEOUT_S_DEFAULT,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub worker_start_timeout_s: u64,
    /// Seconds a model's load in a GPU worker (the model-control API's, or start-up's) may take
    /// (autotuning, copying the weights); past it the load fails with 503 / UNAVAILABLE and the
    /// worker, stuck, is killed and restarted with the other models. A restarted worker loads the
    /// models again within this limit per model, or its start counts as failed.
    #[arg(long, env = "KAIROS_MODEL_LOAD_TIMEOUT_S", default_value_t = kairos_server::worker::MODEL_LOAD_TIMEOUT_S_DEFAULT,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub model_load_timeout_s: u64,
    /// Internal: run as the worker of this GPU (the server starts its workers with it).
    #[arg(long, hide = true)]
    pub worker_gpu: Option<u32>,
    /// Internal: how many workers of this GPU ran before this one.
    #[arg(long, hide = true, default_value_t = 0)]
    pub worker_generation: u64,
    /// Tests only: the CUDA backend's N-th kernel launch writes to an address nothing maps (a
    /// sticky GPU fault); in a worker, only the first worker of each GPU does.
    #[arg(long, hide = true)]
    pub test_fault_at_launch: Option<u64>,
    /// Tests only: before the CUDA backend's N-th kernel launch, a kernel fills every SM for
    /// minutes (a hung launch for the watchdog); in a worker, only the first worker of each GPU.
    #[arg(long, hide = true)]
    pub test_hang_at_launch: Option<u64>,
    /// Tests only: the workers of generation N and later (0: the first of each GPU) never say
    /// ready; each waits until its stdin closes, then exits.
    #[arg(long, hide = true)]
    pub test_worker_hang_from_generation: Option<u64>,
    /// Tests only: the first worker of each GPU never finishes loading the model of this name (it
    /// serves the others meanwhile).
    #[arg(long, hide = true)]
    pub test_worker_hang_in_load: Option<String>,
}

fn address(s: &str, what: &str) -> Result<Option<SocketAddr>> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    Ok(Some(s.parse().with_context(|| format!("--{what} {s}: expected HOST:PORT or off"))?))
}

/// Default staging memory a secondary GPU reserves for each primary (parallel transmission).
pub const PEER_STAGING_MIB_DEFAULT: u64 = kairos_cuda::peer::PEER_STAGING_BYTES_DEFAULT >> 20;

/// `args` without the option `name` (`name value` or `name=value`): clap refuses an option given twice.
fn without_option(args: Vec<std::ffi::OsString>, name: &str) -> Vec<std::ffi::OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        match a.to_str() {
            Some(s) if s == name => skip_value = true,
            Some(s) if s.strip_prefix(name).is_some_and(|rest| rest.starts_with('=')) => {}
            _ => out.push(a),
        }
    }
    out
}

fn gpu_present() -> bool {
    kairos_cuda::driver::is_present()
        && kairos_cuda::driver::init().is_ok()
        && kairos_cuda::driver::device_count().map(|n| n > 0).unwrap_or(false)
}

fn load_profiles(dir: Option<PathBuf>, default: PathBuf) -> Result<Option<ProfileSet>> {
    let dir = dir.unwrap_or(default);
    if !dir.is_dir() {
        return Ok(None);
    }
    let set = ProfileSet::load_dir(&dir).map_err(anyhow::Error::msg)?;
    tracing::info!(folder = %dir.display(), profiles = set.models.len(), "kernel profiles");
    Ok(Some(set))
}

/// The engine factory of a server: CUDA when asked (or, for `auto`, when a GPU is present), else the
/// simulator; the dispatcher configured with `policy` and the queue limits.
#[allow(clippy::too_many_arguments)]
pub fn make_backend(
    kind: ServeBackend,
    policy: &str,
    submit_queue_max: usize,
    jobs_max: usize,
    sim_gpu: &str,
    seed: u64,
    sim_compute: bool,
    profiles: Option<PathBuf>,
    autotune: bool,
) -> Result<Box<dyn Backend>> {
    let policy = kairos_bench::latency::policy(policy)?;
    let mut engine = EngineConfig { submit_queue_max, ..EngineConfig::default() };
    engine.dispatcher = engine.dispatcher.with_policy(policy);
    engine.dispatcher.jobs_max = jobs_max;
    make_backend_with(
        kind,
        engine,
        sim_gpu,
        seed,
        sim_compute,
        profiles,
        autotune,
        PEER_STAGING_MIB_DEFAULT << 20,
        TestFaults::default(),
    )
}

/// [`make_backend`] with the engine configured by the caller.
#[allow(clippy::too_many_arguments)]
pub fn make_backend_with(
    kind: ServeBackend,
    engine: EngineConfig,
    sim_gpu: &str,
    seed: u64,
    sim_compute: bool,
    profiles: Option<PathBuf>,
    autotune: bool,
    peer_staging_bytes: u64,
    test_faults: TestFaults,
) -> Result<Box<dyn Backend>> {
    let cuda = kind == ServeBackend::Cuda || (kind == ServeBackend::Auto && gpu_present());
    Ok(if cuda {
        if kind == ServeBackend::Auto {
            tracing::info!("an NVIDIA GPU is present: backend cuda");
        }
        Box::new(CudaBackend {
            engine,
            peer_staging_bytes,
            profiles: load_profiles(profiles, crate::paths::cuda_profile_dir(0))?,
            autotune,
            quick_builds: crate::paths::quick_builds_wanted(),
            test_faults,
        })
    } else {
        if kind == ServeBackend::Auto {
            tracing::info!("no NVIDIA GPU: backend sim (--backend cuda to insist)");
        }
        let desc = sim_desc(sim_gpu)?;
        let profiles = load_profiles(profiles, crate::paths::profile_dir(&desc.key))?;
        Box::new(SimBackend { compute: sim_compute, engine, profiles, ..SimBackend::new(desc, seed) })
    })
}

pub fn run(args: ServeArgs) -> Result<()> {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| args.log.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&filter).context("--log")?)
        .with_writer(std::io::stderr)
        .init();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(kairos_server::TlsConfig { cert: cert.clone(), key: key.clone() }),
        (None, None) => None,
        // clap's `requires` refuses these already; kept for callers that build ServeArgs.
        _ => bail!("--tls-cert and --tls-key go together: give both (TLS) or neither (plain TCP)"),
    };
    // The files are checked before any GPU work starts (RunningServer::start checks them again).
    if let Some(t) = &tls {
        t.load().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let policy = kairos_bench::latency::policy(&args.policy)?;
    let mut engine = EngineConfig {
        submit_queue_max: args.submit_queue_max,
        idle_spin_ns: args.idle_spin_us.saturating_mul(1000),
        ..EngineConfig::default()
    };
    engine.dispatcher = engine.dispatcher.with_policy(policy);
    engine.dispatcher.jobs_max = args.jobs_max;
    if args.stream_count.is_some() {
        engine.dispatcher.stream_count = args.stream_count;
    }
    engine.dispatcher.weight_budget_bytes = args.weight_budget_mib.map(|m| m << 20);
    engine.dispatcher.cold_strategy = args.cold_strategy;
    engine.dispatcher.cold_copy_window_bytes = args.cold_copy_window_kib.saturating_mul(1 << 10);
    engine.dispatcher.eviction = args.eviction;
    if args.worker_gpu.is_some() {
        // A GPU worker resets nothing in place: a sticky CUDA fault outlives any reset and a reset
        // waits for the kernels still running (a hung one for ever); the worker's exit ends them
        // all, and the server starts a new worker.
        engine.recovery_attempts_max = 0;
    }
    // The test faults hit the first worker of each GPU only (or the in-process engine).
    let faults = if args.worker_generation == 0 {
        TestFaults { fault_at_launch: args.test_fault_at_launch, hang_at_launch: args.test_hang_at_launch }
    } else {
        TestFaults::default()
    };
    let backend = make_backend_with(
        args.backend,
        engine,
        &args.sim_gpu,
        args.seed,
        args.sim_compute,
        args.profiles.clone(),
        !args.no_autotune,
        args.peer_staging_mib << 20,
        faults,
    )?;
    if let Some(gpu) = args.worker_gpu {
        if args.test_worker_hang_from_generation.is_some_and(|g| args.worker_generation >= g) {
            tracing::warn!(
                gpu,
                generation = args.worker_generation,
                "GPU worker: hanging before ready (--test-worker-hang-from-generation)"
            );
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            return Ok(());
        }
        let hang_in_load = args.test_worker_hang_in_load.clone().filter(|_| args.worker_generation == 0);
        return kairos_server::worker::run_worker(std::sync::Arc::from(backend), gpu, hang_in_load)
            .map_err(|e| anyhow::anyhow!("GPU worker {gpu}: {e}"));
    }
    let cuda = backend.describe() == "cuda";
    let workers = match args.gpu_workers {
        GpuWorkers::On => true,
        GpuWorkers::Off => false,
        GpuWorkers::Auto => cuda,
    };
    let backend: Box<dyn Backend> = if workers {
        // The workers get this server's arguments, with the backend it settled on.
        let mut worker_args = without_option(std::env::args_os().skip(1).collect(), "--backend");
        worker_args.extend(["--backend".into(), if cuda { "cuda" } else { "sim" }.into()]);
        let exe = std::env::current_exe().context("the GPU workers run this binary: cannot find it")?;
        tracing::info!("GPU engines in worker processes (--gpu-workers off keeps them in this process)");
        Box::new(WorkerBackend {
            inner: backend,
            spawn: WorkerSpawn {
                exe,
                args: worker_args,
                start_timeout_ms: args.worker_start_timeout_s.saturating_mul(1000),
                load_timeout_ms: args.model_load_timeout_s.saturating_mul(1000),
            },
            requests_max: args.submit_queue_max + args.jobs_max,
        })
    } else {
        backend
    };
    let load = match &args.load {
        Some(v) if v.len() == 1 && v[0] == "none" => Some(Vec::new()),
        other => other.clone(),
    };
    if !args.repository.is_dir() {
        bail!("the model repository {} is not a folder (see `kairos serve --help`)", args.repository.display());
    }
    let cfg = ServerConfig {
        state: StateConfig { repository: args.repository.clone(), gpus: args.gpus, load },
        http: address(&args.http, "http")?,
        grpc: address(&args.grpc, "grpc")?,
        shm: (!args.shm_socket.eq_ignore_ascii_case("off")).then(|| ShmConfig {
            socket: PathBuf::from(&args.shm_socket),
            clients_max: args.shm_clients_max,
            region_bytes_max: args.shm_region_bytes_max,
            spin_us: args.shm_spin_us,
            zero_copy_bytes_max: args.shm_zero_copy_bytes_max,
        }),
        request_bytes_max: args.request_bytes_max,
        threads: args.threads,
        control: args.control_api.clone(),
        tls,
    };
    let tls_note = if cfg.tls.is_some() { " over TLS" } else { "" };
    let server = RunningServer::start(cfg, backend).map_err(|e| anyhow::anyhow!("{e}"))?;
    // Caught from here on, so that a SIGTERM always drains.
    let signals = server.signals().map_err(|e| anyhow::anyhow!("{e}"))?;
    eprintln!(
        "kairos serve: listening (REST {}, gRPC {}, shared memory {}); loading {} model(s) in the background (Ctrl-C or SIGTERM drains and stops)",
        server.http_addr().map(|a| format!("{a}{tls_note}")).unwrap_or_else(|| "off".into()),
        server.grpc_addr().map(|a| format!("{a}{tls_note}")).unwrap_or_else(|| "off".into()),
        server.shm_socket().map(|p| p.display().to_string()).unwrap_or_else(|| "off".into()),
        server.state.startup_progress().total,
    );
    // Says when the start-up loading is over (nothing if the server stops first).
    let state = server.state.clone();
    let announce = std::thread::Builder::new().name("kairos-ready".into()).spawn(move || {
        if state.wait_until_ready(std::time::Duration::MAX).is_ok() {
            let p = state.startup_progress();
            let failed = if p.unavailable.is_empty() {
                String::new()
            } else {
                let names: Vec<&str> = p.unavailable.iter().map(|(n, _)| n.as_str()).collect();
                format!("; not loaded: {} (reasons in the log and the repository index)", names.join(", "))
            };
            eprintln!("kairos serve: {} of {} model(s) ready after {:.1} s{failed}", p.ready, p.total, p.elapsed.as_secs_f64());
        }
    });
    if let Err(e) = announce {
        tracing::warn!(error = %e, "cannot start the thread that announces readiness");
    }
    signals.wait();
    eprintln!(
        "kairos serve: draining ({} request(s) in flight, {} s at most; a second signal stops at once)",
        server.state.in_flight(),
        args.drain_timeout_s
    );
    let report = server.drain(std::time::Duration::from_secs(args.drain_timeout_s), signals.again());
    eprintln!(
        "kairos serve: drained in {:.1} s ({} in flight at the start, {} cancelled{}); stopping",
        report.took.as_secs_f64(),
        report.in_flight_at_start,
        report.cancelled,
        if report.interrupted { ", stopped early by a second signal" } else { "" }
    );
    server.shutdown();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{ServeArgs, without_option};
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn the_stream_pool_is_the_devices_unless_given_and_never_empty() {
        assert_eq!(Cli::try_parse_from(["serve"]).unwrap().serve.stream_count, None);
        assert_eq!(Cli::try_parse_from(["serve", "--stream-count", "8"]).unwrap().serve.stream_count, Some(8));
        for bad in ["0", "129"] {
            let err = Cli::try_parse_from(["serve", "--stream-count", bad]).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation, "{err}");
        }
    }

    #[test]
    fn a_workers_arguments_drop_the_backend_given() {
        let args = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            without_option(args(&["serve", "--backend", "auto", "-r", "m", "--backend=sim", "--backendx", "1"]), "--backend"),
            args(&["serve", "-r", "m", "--backendx", "1"])
        );
    }
}

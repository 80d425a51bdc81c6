//! `kairos bench serve`: the serving overhead of each front end (REST, gRPC, the shared-memory
//! channel) and the client's CPU use per wait scheme, measured by one client against a server it
//! starts in-process (or against a running `kairos serve`).

use crate::cmd_serve::{ServeBackend, make_backend};
use anyhow::{Context, Result, bail};
use clap::Args;
use kairos_bench::serving::{self, Endpoints, Options, Transport, TransportResult};
use kairos_server::{RunningServer, ServerConfig, ShmConfig, StateConfig, fixtures};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Models to measure. Without --http/--grpc/--shm-socket a server is started in-process over a
    /// repository of the benchmark models: `mlp` (64 -> 128 -> 10, the small model), `gap224` (a
    /// 602 KB image in, 12 bytes out), `mlp_w1024_d8` (eight 1024-wide layers), and any zoo name
    /// (served in fp16 at batch 1).
    #[arg(long, env = "KAIROS_BENCH_MODELS", value_delimiter = ',', default_value = "mlp,gap224,mlp_w1024_d8")]
    pub models: Vec<String>,
    /// Transports, in order: rest-json, rest-binary, grpc, shm-hybrid, shm-poll (both zero-copy
    /// where the backend maps the client's region), shm-copy (the ring with buffers off the GPU's
    /// alignment, so the server copies: the path zero-copy replaces), socket.
    #[arg(
        long,
        env = "KAIROS_BENCH_TRANSPORTS",
        value_delimiter = ',',
        default_value = "rest-json,rest-binary,grpc,shm-hybrid,shm-poll,shm-copy,socket"
    )]
    pub transports: Vec<String>,
    /// Measured requests per model and transport (one in flight).
    #[arg(long, env = "KAIROS_BENCH_REQUESTS", default_value_t = 2000)]
    pub requests: usize,
    /// Unmeasured requests first, per model and transport.
    #[arg(long, env = "KAIROS_BENCH_WARMUP", default_value_t = 200)]
    pub warmup: usize,
    /// A running server's REST address (http://host:port); with --grpc and --shm-socket, measure it
    /// instead of starting one.
    #[arg(long, env = "KAIROS_BENCH_HTTP")]
    pub http: Option<String>,
    /// A running server's gRPC address (http://host:port).
    #[arg(long, env = "KAIROS_BENCH_GRPC")]
    pub grpc: Option<String>,
    /// A running server's shared-memory socket.
    #[arg(long, env = "KAIROS_BENCH_SHM_SOCKET")]
    pub shm_socket: Option<PathBuf>,
    /// Where the in-process server runs kernels.
    #[arg(long, value_enum, env = "KAIROS_BACKEND", default_value = "auto")]
    pub backend: ServeBackend,
    /// Scheduling policy of the in-process server.
    #[arg(long, env = "KAIROS_POLICY", default_value = "paella")]
    pub policy: String,
    /// Simulated GPU of the in-process server (on the simulator).
    #[arg(long, env = "KAIROS_SIM_GPU", default_value = "h100-sxm")]
    pub sim_gpu: String,
    /// tokio worker threads of the in-process server.
    #[arg(long, env = "KAIROS_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// Microseconds the server's shared-memory threads spin on a client's ring before sleeping.
    #[arg(long, env = "KAIROS_SHM_SPIN_US", default_value_t = 20)]
    pub shm_spin_us: u64,
    /// Seed of the inputs and of the simulator.
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Folder for serve.json and serve.md.
    #[arg(long, env = "KAIROS_BENCH_OUT", default_value = "out/bench-serve")]
    pub out: PathBuf,
}

/// A repository with the benchmark models and the zoo names asked for.
fn write_repository(dir: &std::path::Path, models: &[String]) -> Result<()> {
    let built = fixtures::write_bench_repository(dir, &[(1024, 8)])
        .with_context(|| format!("writing the benchmark repository {}", dir.display()))?;
    for m in models {
        if built.contains(m) {
            continue;
        }
        if kairos_ir::zoo::find(m).is_none() {
            bail!("unknown model '{m}': use {} or a zoo name (`kairos zoo list`)", built.join(", "));
        }
        let d = dir.join(m);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(kairos_server::repository::CONFIG_FILE), format!("model = \"{m}\"\ndtype = \"f16\"\n"))?;
    }
    Ok(())
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    let transports = a.transports.iter().map(|t| Transport::parse(t)).collect::<Result<Vec<_>, _>>()?;
    let remote = a.http.is_some() || a.grpc.is_some() || a.shm_socket.is_some();
    let mut server = None;
    let mut scratch = None;
    let endpoints = if remote {
        Endpoints { http: a.http.clone(), grpc: a.grpc.clone(), shm: a.shm_socket.clone() }
    } else {
        let dir = std::env::temp_dir().join(format!("kairos-bench-serve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let repo = dir.join("models");
        std::fs::create_dir_all(&repo)?;
        write_repository(&repo, &a.models)?;
        let backend = make_backend(a.backend, &a.policy, 4096, 4096, &a.sim_gpu, a.seed, true, None, true)?;
        let cfg = ServerConfig {
            state: StateConfig { repository: repo, gpus: 1, load: Some(a.models.clone()) },
            http: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            grpc: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            shm: Some(ShmConfig { socket: dir.join("kairos.sock"), spin_us: a.shm_spin_us, ..ShmConfig::default() }),
            request_bytes_max: 64 << 20,
            threads: a.threads,
            control: kairos_server::ControlAccess::On,
            tls: None,
        };
        eprintln!("starting a server in-process ({}), loading {}", backend.describe(), a.models.join(", "));
        let t = Instant::now();
        let s = RunningServer::start(cfg, backend).map_err(|e| anyhow::anyhow!("{e}"))?;
        s.wait_until_ready(std::time::Duration::from_secs(1800)).map_err(|e| anyhow::anyhow!("{e}"))?;
        eprintln!("server ready in {:.1} s", t.elapsed().as_secs_f64());
        let e = Endpoints {
            http: s.http_addr().map(|x| format!("http://{x}")),
            grpc: s.grpc_addr().map(|x| format!("http://{x}")),
            shm: s.shm_socket().map(|p| p.to_path_buf()),
        };
        server = Some(s);
        scratch = Some(dir);
        e
    };
    let device = server.as_ref().map(|s| s.state.device_names().join(", ")).unwrap_or_else(|| "a remote server".into());
    let opts = Options { requests: a.requests, warmup: a.warmup, seed: a.seed };
    let mut all: Vec<TransportResult> = Vec::new();
    let outcome = (|| -> Result<()> {
        for m in &a.models {
            let model = serving::describe_model(&endpoints, m)?;
            eprintln!("{m}: {} request(s) per transport after {} warm-up", a.requests, a.warmup);
            let r = serving::measure_model(&endpoints, &model, &transports, opts, |r| {
                if let Some(e) = &r.error {
                    eprintln!("  {:<12} not measured: {e}", r.transport.name());
                    return;
                }
                eprintln!(
                    "  {:<12} {:<10} client p50 {:>8.1} µs p99 {:>8.1} µs | over GPU p50 {:>8.1} µs | over engine p50 {:>7.1} µs | client CPU {:>6.1} µs/request ({:.0}% busy)",
                    r.transport.name(),
                    r.data_path.as_deref().unwrap_or(""),
                    r.client.p50_us,
                    r.client.p99_us,
                    r.over_gpu.p50_us,
                    r.over_engine.p50_us,
                    r.client_cpu_per_request_us,
                    r.client_cpu_fraction * 100.0
                );
            })?;
            all.extend(r);
        }
        Ok(())
    })();
    if let Some(s) = server {
        s.shutdown();
    }
    if let Some(d) = scratch {
        let _ = std::fs::remove_dir_all(d);
    }
    outcome?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let json = serde_json::json!({
        "format": "kairos-serve-bench/1",
        "device": device,
        "requests": a.requests,
        "warmup": a.warmup,
        "policy": a.policy,
        "results": all,
    });
    std::fs::write(a.out.join("serve.json"), serde_json::to_string_pretty(&json)?)?;
    let table = format!(
        "Serving overhead on {device}: one client, one request in flight, {} requests per row after {} warm-up.\n\
         \"over GPU\": client latency minus the request's GPU time; \"over engine\": minus its time inside the engine.\n\
         \"data path\" of the shared-memory rows: zero-copy (the GPU reads and writes the client's region in place) or copy.\n\n{}",
        a.requests,
        a.warmup,
        serving::markdown(&all)
    );
    std::fs::write(a.out.join("serve.md"), &table)?;
    println!("{table}");
    eprintln!("wrote {}/serve.json and serve.md", a.out.display());
    Ok(())
}

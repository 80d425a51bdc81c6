//! `kairos bench soak`: `kairos serve` started as a child process (this same binary) on a model
//! repository written to a scratch folder, driven for a while at a constant open-loop rate through
//! REST (JSON and binary tensors) and gRPC with a flood of bad input mixed in
//! (`kairos_bench::soak`). Every good answer is checked against the CPU reference's outputs,
//! computed once up front; every bad request must get its client error (never a 5xx, never a
//! hang); the child's memory (its resident set and its descendants') is sampled every second. The
//! command fails when a good answer is lost or wrong, a bad input gets a server error or no
//! answer, the server dies, or its memory grows more than allowed after the warm-up.

use crate::cmd_serve::ServeBackend;
use anyhow::{Context, Result, bail};
use clap::Args;
use kairos_bench::soak::{self, SoakCase, SoakModel, SoakOptions};
use kairos_ir::{DType, Tensor};
use kairos_server::{Repository, fixtures};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The fixture models `--models` may name besides zoo names.
const FIXTURES: [&str; 4] = ["mlp", "mlp_f16", "pair", "embed"];
/// How long the server gets to exit after SIGTERM before it is killed.
const EXIT_WAIT: Duration = Duration::from_secs(60);
/// Memory samples kept (one a second: over a day).
const RSS_SAMPLES_MAX: usize = 100_000;

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Models: the tiny fixtures (mlp, mlp_f16, pair, embed) and/or zoo names (`kairos zoo list`,
    /// served in --dtype at batch 1).
    #[arg(long, env = "KAIROS_SOAK_MODELS", value_delimiter = ',', default_value = "mlp,mlp_f16,pair,embed")]
    pub models: Vec<String>,
    /// Storage type of the zoo models.
    #[arg(long, env = "KAIROS_DTYPE", default_value = "f16", value_parser = crate::model_args::parse_dtype)]
    pub dtype: DType,
    /// Where the server runs kernels (passed to `kairos serve --backend`).
    #[arg(long, env = "KAIROS_BACKEND", value_enum, default_value = "sim")]
    pub backend: ServeBackend,
    /// Seconds of load.
    #[arg(long, env = "KAIROS_SOAK_DURATION_S", default_value_t = 60.0)]
    pub duration_s: f64,
    /// Seconds of warm-up: memory growth is measured from its end (default: 10% of the duration).
    #[arg(long, env = "KAIROS_SOAK_WARMUP_S")]
    pub warmup_s: Option<f64>,
    /// Requests per second, good and bad together, open loop.
    #[arg(long, env = "KAIROS_SOAK_RATE", default_value_t = 50.0)]
    pub rate: f64,
    /// Share of the requests that are bad input.
    #[arg(long, env = "KAIROS_SOAK_BAD_FRACTION", default_value_t = 0.3)]
    pub bad_fraction: f64,
    /// Client threads, each with its own REST and gRPC connections.
    #[arg(long, env = "KAIROS_SOAK_CLIENTS", default_value_t = 4)]
    pub clients: usize,
    /// Seconds a request may wait for its answer before it counts as lost (or, bad, as a hang).
    #[arg(long, env = "KAIROS_SOAK_TIMEOUT_S", default_value_t = 30.0)]
    pub timeout_s: f64,
    /// Distinct input sets per model (each checked against its own expected outputs).
    #[arg(long, env = "KAIROS_SOAK_INPUTS_PER_MODEL", default_value_t = 4)]
    pub inputs_per_model: usize,
    /// The server's body / message limit (`kairos serve --request-bytes-max`); the oversized
    /// bad inputs go past it.
    #[arg(long, env = "KAIROS_REQUEST_BYTES_MAX", default_value_t = 4 << 20)]
    pub request_bytes_max: usize,
    /// Largest growth of the server's resident memory from the end of the warm-up to the end, %.
    #[arg(long, env = "KAIROS_SOAK_RSS_GROWTH_MAX_PCT", default_value_t = 5.0)]
    pub rss_growth_max_pct: f64,
    /// Requests each client thread keeps in flight at most (more are counted as not sent).
    #[arg(long, env = "KAIROS_SOAK_IN_FLIGHT_MAX", default_value_t = 256)]
    pub in_flight_max: usize,
    /// Scheduling policy of the server.
    #[arg(long, env = "KAIROS_POLICY", default_value = "paella")]
    pub policy: String,
    /// The server's tokio worker threads.
    #[arg(long, env = "KAIROS_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// The server's log filter (its log goes to OUT/server.log).
    #[arg(long, env = "KAIROS_SOAK_SERVER_LOG", default_value = "warn")]
    pub server_log: String,
    /// Seconds to wait for the server to be ready (model loading; kernel compilation on CUDA).
    #[arg(long, env = "KAIROS_SOAK_READY_TIMEOUT_S", default_value_t = 900.0)]
    pub ready_timeout_s: f64,
    /// Seed of the inputs and of the request mix.
    #[arg(long, env = "KAIROS_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Folder for results.json (the summary), requests.json (every good request) and server.log.
    #[arg(long, env = "KAIROS_SOAK_OUT", default_value = "out/soak")]
    pub out: PathBuf,
}

/// Kills the server if the soak ends before it stopped it.
struct ServerChild(Option<Child>);

impl Drop for ServerChild {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut()
            && let Ok(None) = c.try_wait()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Seeded inputs: floats in [-1, 1] in steps of 0.001, token ids in [0, 100).
fn inputs_for(plan: &kairos_ir::plan::Plan, seed: u64) -> Vec<Tensor> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    plan.inputs
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

/// Writes the repository: the fixtures, and a folder per zoo name asked for.
fn write_repository(repo: &Path, models: &[String], dtype: DType) -> Result<()> {
    fixtures::write_tiny_repository(repo).with_context(|| format!("writing {}", repo.display()))?;
    for m in models {
        if FIXTURES.contains(&m.as_str()) {
            continue;
        }
        if kairos_ir::zoo::find(m).is_none() {
            bail!("unknown model '{m}': use {} or a zoo name (`kairos zoo list`)", FIXTURES.join(", "));
        }
        let d = repo.join(m);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(kairos_server::repository::CONFIG_FILE), format!("model = \"{m}\"\ndtype = \"{dtype}\"\n"))?;
    }
    Ok(())
}

/// The models with their inputs and the CPU reference's outputs for them.
fn expected_outputs(repo: &Path, models: &[String], per_model: usize, seed: u64) -> Result<Vec<SoakModel>> {
    let r = Repository::new(repo);
    let mut out = Vec::new();
    for (k, name) in models.iter().enumerate() {
        let t = Instant::now();
        let planned = kairos_server::state::plan_model(&r, name, None).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        let plan = &planned.plan;
        let mut cases = Vec::new();
        for c in 0..per_model.max(1) {
            let inputs = inputs_for(plan, seed ^ ((k as u64) << 32) ^ c as u64);
            let outs = kairos_kernels::cpu::execute_plan(plan, &inputs).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            let expected = plan.outputs.iter().map(|o| o.name.clone()).zip(outs).collect();
            cases.push(SoakCase { inputs, expected });
        }
        let tolerance = kairos_kernels::cpu::tolerance(plan.dtype);
        eprintln!(
            "{name}: {} input set(s), expected outputs from the CPU reference in {:.2} s (tolerance: relative L2 {tolerance:.0e}, {})",
            cases.len(),
            t.elapsed().as_secs_f64(),
            plan.dtype
        );
        out.push(SoakModel {
            name: name.clone(),
            input_names: plan.inputs.iter().map(|i| i.name.clone()).collect(),
            cases,
            tolerance,
        });
    }
    Ok(out)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn exit_status(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => format!("{s}"),
    }
}

// `!(x > 0.0)` and `!(growth <= limit)` reject NaN too.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn run(a: SoakArgs) -> Result<()> {
    if !(a.duration_s > 0.0) || !(a.rate > 0.0) || a.clients == 0 || !(0.0..=1.0).contains(&a.bad_fraction) {
        bail!("--duration-s and --rate must be positive, --clients at least 1, --bad-fraction in [0, 1]");
    }
    let warmup_s = a.warmup_s.unwrap_or(a.duration_s * 0.1).clamp(0.0, a.duration_s);
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let scratch = std::env::temp_dir().join(format!(
        "kairos-soak-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
    ));
    let repo = scratch.join("models");
    std::fs::create_dir_all(&repo).with_context(|| format!("creating {}", repo.display()))?;
    let outcome = soak_in(&a, warmup_s, &repo);
    let _ = std::fs::remove_dir_all(&scratch);
    outcome
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN fails the checks too
fn soak_in(a: &SoakArgs, warmup_s: f64, repo: &Path) -> Result<()> {
    write_repository(repo, &a.models, a.dtype)?;
    let models = expected_outputs(repo, &a.models, a.inputs_per_model, a.seed)?;
    let (http_port, grpc_port) = (free_port()?, free_port()?);
    let http = format!("http://127.0.0.1:{http_port}");
    let grpc = format!("http://127.0.0.1:{grpc_port}");
    let log_path = a.out.join("server.log");
    let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding this program's path")?;
    let backend = match a.backend {
        ServeBackend::Auto => "auto",
        ServeBackend::Sim => "sim",
        ServeBackend::Cuda => "cuda",
    };
    let mut cmd = Command::new(&exe);
    cmd.arg("serve")
        .arg("--repository")
        .arg(repo)
        .args(["--backend", backend, "--http", &format!("127.0.0.1:{http_port}"), "--grpc", &format!("127.0.0.1:{grpc_port}")])
        .args(["--shm-socket", "off", "--load", &a.models.join(","), "--policy", &a.policy])
        .args(["--request-bytes-max", &a.request_bytes_max.to_string(), "--threads", &a.threads.to_string()])
        .args(["--seed", &a.seed.to_string(), "--log", &a.server_log])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    eprintln!("starting `{} serve` ({backend}; REST {http}, gRPC {grpc}; log in {})", exe.display(), log_path.display());
    let child = cmd.spawn().with_context(|| format!("starting {}", exe.display()))?;
    let pid = child.id();
    let mut server = ServerChild(Some(child));
    let ready = soak::wait_ready(&http, Duration::from_secs_f64(a.ready_timeout_s), || {
        match server.0.as_mut().expect("the child").try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(s)) => Err(format!("the server exited before it was ready ({}); see {}", exit_status(s), log_path.display())),
            Err(e) => Err(format!("cannot watch the server: {e}")),
        }
    })?;
    let rss_ready = soak::process_tree_rss_bytes(pid).unwrap_or(0);
    eprintln!(
        "server (pid {pid}) ready in {:.1} s, {:.1} MiB resident; {:.0} s of load at {} requests/s ({:.0}% bad input), {} client threads",
        ready.as_secs_f64(),
        mib(rss_ready),
        a.duration_s,
        a.rate,
        a.bad_fraction * 100.0,
        a.clients
    );

    // Memory, once a second, from the start of the load: the whole tree (the server and its GPU
    // workers), and the server's own process.
    let samples: Arc<Mutex<Vec<(f64, u64, u64)>>> = Arc::new(Mutex::new(Vec::new()));
    let sampling = Arc::new(AtomicBool::new(true));
    let load_start = Instant::now();
    let sampler = {
        let (samples, sampling) = (samples.clone(), sampling.clone());
        std::thread::Builder::new().name("soak-rss".into()).spawn(move || {
            let mut next = Instant::now();
            while sampling.load(Ordering::Relaxed) {
                if let Some(b) = soak::process_tree_rss_bytes(pid) {
                    let own = soak::process_rss_bytes(pid).unwrap_or(0);
                    let mut s = samples.lock().unwrap_or_else(|e| e.into_inner());
                    if s.len() < RSS_SAMPLES_MAX {
                        s.push((load_start.elapsed().as_secs_f64(), b, own));
                    }
                }
                next += Duration::from_secs(1);
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
        })?
    };
    let opts = SoakOptions {
        http: http.clone(),
        grpc,
        duration: Duration::from_secs_f64(a.duration_s),
        rate_per_s: a.rate,
        bad_fraction: a.bad_fraction,
        clients: a.clients,
        timeout: Duration::from_secs_f64(a.timeout_s),
        request_bytes_max: a.request_bytes_max,
        in_flight_max: a.in_flight_max,
        seed: a.seed,
    };
    let mut died: Option<String> = None;
    let result = soak::run(models, opts, Duration::from_secs(10), |p| {
        let rss = samples.lock().unwrap_or_else(|e| e.into_inner()).last().map(|s| s.1).unwrap_or(0);
        eprintln!(
            "[{:>5.0} s] good {} sent, {} correct, {} wrong, {} errors, {} lost | bad {} sent, {} not as expected | server {:.1} MiB",
            p.elapsed.as_secs_f64(),
            p.good_sent,
            p.good_correct,
            p.good_wrong,
            p.good_errors,
            p.good_lost,
            p.bad_sent,
            p.bad_failed,
            mib(rss)
        );
        if let Ok(Some(s)) = server.0.as_mut().expect("the child").try_wait() {
            died = Some(exit_status(s));
            eprintln!("the server exited during the soak ({}): stopping", died.as_deref().unwrap_or(""));
            return false;
        }
        true
    });
    let rss_end_now = soak::process_tree_rss_bytes(pid);
    let server_rss_end_now = soak::process_rss_bytes(pid);
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.join();
    let result = result?;

    // Alive at the end, and answering.
    let child = server.0.as_mut().expect("the child");
    if died.is_none()
        && let Ok(Some(s)) = child.try_wait()
    {
        died = Some(exit_status(s));
    }
    let live_at_end = died.is_none() && soak::server_live(&http);
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
    let rss_warm = samples.iter().find(|s| s.0 >= warmup_s).or(samples.last()).map(|s| s.1).unwrap_or(0);
    let rss_end = rss_end_now.or(samples.last().map(|s| s.1)).unwrap_or(0);
    let rss_peak = samples.iter().map(|s| s.1).max().unwrap_or(0).max(rss_end);
    let growth_pct = if rss_warm > 0 { (rss_end as f64 - rss_warm as f64) / rss_warm as f64 * 100.0 } else { f64::NAN };
    // Which process grows: the server's own share, and the rest (its GPU workers).
    let server_warm = samples.iter().find(|s| s.0 >= warmup_s).or(samples.last()).map(|s| s.2).unwrap_or(0);
    let server_end = server_rss_end_now.or(samples.last().map(|s| s.2)).unwrap_or(0);
    let (workers_warm, workers_end) = (rss_warm.saturating_sub(server_warm), rss_end.saturating_sub(server_end));
    let pct = |from: u64, to: u64| if from > 0 { (to as f64 - from as f64) / from as f64 * 100.0 } else { f64::NAN };
    let finite = |v: f64| if v.is_finite() { serde_json::json!(v) } else { serde_json::Value::Null };

    // SIGTERM, and the exit status.
    let t = Instant::now();
    let exit = if died.is_none() {
        soak::terminate(pid)?;
        loop {
            match child.try_wait()? {
                Some(s) => break exit_status(s),
                None if t.elapsed() > EXIT_WAIT => {
                    let _ = child.kill();
                    let s = child.wait()?;
                    break format!("did not exit {:.0} s after SIGTERM: killed ({})", EXIT_WAIT.as_secs_f64(), exit_status(s));
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    } else {
        format!("exited during the soak: {}", died.clone().unwrap_or_default())
    };
    let exit_s = t.elapsed().as_secs_f64();
    server.0 = None;

    // The verdict.
    let g = &result.good;
    let mut failures = Vec::new();
    if g.lost > 0 {
        failures.push(format!("{} good request(s) lost (no answer within {} s)", g.lost, a.timeout_s));
    }
    if g.wrong > 0 {
        failures.push(format!("{} good request(s) answered wrong", g.wrong));
    }
    if g.errors_total() > 0 {
        failures.push(format!("{} good request(s) answered with an error: {:?}", g.errors_total(), g.errors));
    }
    if result.bad_failed() > 0 {
        failures.push(format!("{} bad request(s) not answered with their client error", result.bad_failed()));
    }
    if !live_at_end {
        failures.push(format!("the server was not alive at the end ({exit})"));
    }
    if !(growth_pct <= a.rss_growth_max_pct) {
        failures.push(format!("resident memory grew {growth_pct:.1}% after the warm-up (limit {}%)", a.rss_growth_max_pct));
    }
    if result.stopped_early {
        failures.push("the load stopped early".into());
    }
    if g.correct == 0 {
        failures.push("no good request was answered correctly".into());
    }

    let bad_json: serde_json::Map<String, serde_json::Value> =
        result.bad.iter().map(|(k, v)| (k.to_string(), serde_json::to_value(v).unwrap_or_default())).collect();
    let summary = serde_json::json!({
        "format": "kairos-soak/1",
        "backend": backend,
        "models": a.models,
        "dtype_of_zoo_models": a.dtype.to_string(),
        "duration_s": a.duration_s,
        "load_s": result.elapsed.as_secs_f64(),
        "warmup_s": warmup_s,
        "rate_per_s": a.rate,
        "bad_fraction": a.bad_fraction,
        "clients": a.clients,
        "timeout_s": a.timeout_s,
        "seed": a.seed,
        "check": "every good answer against the CPU reference's outputs for its inputs (kairos_kernels::cpu), relative L2 error within the zoo tests' tolerance for the plan's dtype",
        "good": g,
        "bad_sent": result.bad_sent(),
        "bad_failed": result.bad_failed(),
        "bad": bad_json,
        "server": {
            "pid": pid,
            "ready_s": ready.as_secs_f64(),
            "rss_ready_bytes": rss_ready,
            "rss_warmup_end_bytes": rss_warm,
            "rss_end_bytes": rss_end,
            "rss_peak_bytes": rss_peak,
            "rss_growth_pct": if growth_pct.is_finite() { serde_json::json!(growth_pct) } else { serde_json::Value::Null },
            "rss_growth_max_pct": a.rss_growth_max_pct,
            "server_rss_warmup_end_bytes": server_warm,
            "server_rss_end_bytes": server_end,
            "server_rss_growth_pct": finite(pct(server_warm, server_end)),
            "workers_rss_warmup_end_bytes": workers_warm,
            "workers_rss_end_bytes": workers_end,
            "workers_rss_growth_pct": finite(pct(workers_warm, workers_end)),
            "rss_samples_columns": ["seconds", "tree_bytes", "server_bytes"],
            "rss_samples": samples.iter().map(|s| [s.0, s.1 as f64, s.2 as f64]).collect::<Vec<_>>(),
            "live_at_end": live_at_end,
            "exit": exit,
            "exit_after_sigterm_s": exit_s,
        },
        "passed": failures.is_empty(),
        "failures": failures,
    });
    std::fs::write(a.out.join("results.json"), serde_json::to_string_pretty(&summary)?)?;
    std::fs::write(a.out.join("requests.json"), serde_json::to_string(&result.records)?)?;

    let mut t = String::new();
    t.push_str(&format!(
        "\nsoak: {:.0} s at {} requests/s on {backend} ({}), {:.0}% bad input\n",
        result.elapsed.as_secs_f64(),
        a.rate,
        a.models.join(", "),
        a.bad_fraction * 100.0
    ));
    t.push_str(&format!(
        "  good requests   {:>7} sent  {:>7} correct ({} bit-exact, worst relative L2 {:.1e})  {} wrong  {} errors  {} overloaded (429)  {} lost  {} not sent\n",
        g.sent, g.correct, g.bit_exact, g.error_rel_l2_max, g.wrong, g.errors_total(), g.overloaded, g.lost, g.not_sent
    ));
    t.push_str(&format!(
        "  latency         p50 {:.0} µs  p99 {:.0} µs  max {:.0} µs (from the due time)\n",
        g.latency_p50_us, g.latency_p99_us, g.latency_max_us
    ));
    t.push_str(&format!("  bad requests    {:>7} sent  {} not answered as expected\n", result.bad_sent(), result.bad_failed()));
    for (k, b) in &result.bad {
        let answers: Vec<String> = b.answers.iter().map(|(s, n)| format!("{s} x{n}")).collect();
        t.push_str(&format!("    {k:<26} {:>6}  {}{}\n", b.sent, answers.join(", "), if b.failed > 0 { "  FAILED" } else { "" }));
    }
    t.push_str(&format!(
        "  server memory   {:.1} MiB ready, {:.1} MiB after the {warmup_s:.0} s warm-up, {:.1} MiB at the end (peak {:.1}): {growth_pct:+.2}% (limit {}%)\n",
        mib(rss_ready),
        mib(rss_warm),
        mib(rss_end),
        mib(rss_peak),
        a.rss_growth_max_pct
    ));
    t.push_str(&format!(
        "    of which       the server's process {:.1} -> {:.1} MiB ({:+.2}%), its GPU workers {:.1} -> {:.1} MiB ({:+.2}%)\n",
        mib(server_warm),
        mib(server_end),
        pct(server_warm, server_end),
        mib(workers_warm),
        mib(workers_end),
        pct(workers_warm, workers_end)
    ));
    t.push_str(&format!("  server          alive at the end: {live_at_end}; after SIGTERM: {exit} in {exit_s:.2} s\n"));
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{t}");
    if failures.is_empty() {
        let _ = writeln!(out, "PASSED (results in {})", a.out.display());
        Ok(())
    } else {
        for e in &g.examples {
            let _ = writeln!(out, "  e.g. {e}");
        }
        for (k, b) in &result.bad {
            for f in &b.failures {
                let _ = writeln!(out, "  e.g. {k}: {f}");
            }
        }
        bail!("the soak failed: {} (results in {})", failures.join("; "), a.out.display())
    }
}

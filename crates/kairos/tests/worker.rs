//! GPU worker processes (`kairos serve --gpu-workers on`, here on the simulator): the real binary
//! serves through a worker; the worker is killed with requests in flight; every request gets an
//! answer (a result, or 503 with the cause), the server restarts the worker, loads the models
//! again, and serves the same answers as before. The front ends never stop.

use kairos_client::rest::RestClient;
use kairos_client::{ClientError, Code, InferOptions};
use kairos_ir::Tensor;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the server may take to be ready (a debug build plans and loads the tiny models).
const READY_WAIT: Duration = Duration::from_secs(120);
/// Every request in flight at the fault is answered within this.
const ANSWER_WITHIN: Duration = Duration::from_secs(60);

struct Server {
    child: Child,
    http: String,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh folder for one test's repository (the `Server` removes it when dropped).
fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build().unwrap()
}

/// The value of `kairos_gpu_recoveries_total` on `/metrics`.
async fn recoveries_counted(c: &RestClient) -> String {
    let metrics = c.metrics().await.unwrap();
    let line = metrics.lines().find(|l| l.starts_with("kairos_gpu_recoveries_total")).expect("the recoveries counter");
    line.rsplit(' ').next().unwrap_or_default().to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start(dir: &Path) -> Server {
    start_with(dir, &[])
}

fn start_with(dir: &Path, extra: &[&str]) -> Server {
    let repo = dir.join("models");
    std::fs::create_dir_all(&repo).unwrap();
    kairos_server::fixtures::write_tiny_repository(&repo).unwrap();
    // A slower model, so that requests are in flight when the worker dies.
    let slow = repo.join("slow");
    std::fs::create_dir_all(&slow).unwrap();
    std::fs::write(slow.join("slow.onnx"), kairos_server::fixtures::mlp_sized_onnx("slow", 512, 8)).unwrap();
    std::fs::write(slow.join("config.toml"), "model = \"slow.onnx\"\n").unwrap();
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["serve", "--backend", "sim", "--gpu-workers", "on", "--grpc", "off", "--shm-socket", "off", "--log", "warn"])
        .arg("--repository")
        .arg(&repo)
        .arg("--http")
        .arg(format!("127.0.0.1:{port}"))
        .args(extra)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("kairos serve starts");
    Server { child, http: format!("http://127.0.0.1:{port}"), dir: dir.to_path_buf() }
}

/// The worker processes of `pid` (its children, zombies left out).
fn children_of(pid: u32) -> Vec<u32> {
    children_in_state(pid, false)
}

/// The children of `pid`; with `zombies`, those exited and not reaped too.
fn children_in_state(pid: u32, zombies: bool) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // pid (comm) state ppid ...: comm may hold spaces, so split after its closing parenthesis.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|f| f.parse::<u32>().ok()) == Some(pid) && (zombies || fields.first() != Some(&"Z")) {
            out.push(p);
        }
    }
    out
}

async fn wait_ready(c: &RestClient, within: Duration) -> Duration {
    let t = Instant::now();
    loop {
        if c.server_ready().await.unwrap_or(false) {
            return t.elapsed();
        }
        assert!(t.elapsed() < within, "the server was not ready within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn input(width: usize, seed: f32) -> Tensor {
    Tensor::f32(vec![1, width], (0..width).map(|i| (i as f32 * 0.37 + seed).sin()).collect())
}

#[test]
fn a_killed_worker_is_restarted_and_every_request_is_answered() {
    let dir = test_dir("kairos-worker-test");
    let server = start(&dir);
    let rt = runtime(4);
    rt.block_on(async {
        let c = RestClient::new(&server.http).unwrap();
        let started = Instant::now();
        loop {
            if c.server_live().await.unwrap_or(false) {
                break;
            }
            assert!(started.elapsed() < READY_WAIT, "the server did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        wait_ready(&c, READY_WAIT).await;
        let workers = children_of(server.child.id());
        assert_eq!(workers.len(), 1, "one GPU, one worker process (found {workers:?})");
        let x = input(64, 0.5);
        let opts = InferOptions::default();
        let before = c.infer("mlp", "", &[("x", &x)], &opts, false).await.expect("mlp through the worker").outputs;
        let xs = input(512, 1.5);
        let slow_before = c.infer("slow", "", &[("x", &xs)], &opts, true).await.expect("slow through the worker").outputs;

        // Requests in flight, then the worker dies.
        let mut inflight = Vec::new();
        for i in 0..24 {
            let c = RestClient::new(&server.http).unwrap();
            let (xs, model) = if i % 2 == 0 { (input(512, 1.5), "slow") } else { (input(64, 0.5), "mlp") };
            inflight.push(tokio::spawn(async move {
                let name = "x";
                tokio::time::timeout(ANSWER_WITHIN, c.infer(model, "", &[(name, &xs)], &InferOptions::default(), false)).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let killed_at = Instant::now();
        let status = Command::new("kill").args(["-9", &workers[0].to_string()]).status().unwrap();
        assert!(status.success(), "kill -9 of the worker");
        let (mut served, mut unavailable) = (0, 0);
        for h in inflight {
            match h.await.unwrap().expect("a request in flight at the fault got no answer") {
                Ok(r) => {
                    let want = if r.model_name == "slow" { &slow_before } else { &before };
                    assert_eq!(&r.outputs, want, "a request served around the fault is wrong");
                    served += 1;
                }
                Err(ClientError::Server { code: Code::Unavailable, message }) => {
                    assert!(message.contains("worker"), "the 503 names the cause: {message}");
                    unavailable += 1;
                }
                Err(e) => panic!("a request in flight at the fault got {e}"),
            }
        }
        eprintln!("worker test: {served} served, {unavailable} answered 503 around the kill");

        // Serving again: a new worker, the same answers.
        let ready_after = wait_ready(&c, Duration::from_secs(30)).await.max(killed_at.elapsed());
        let t = Instant::now();
        let again = loop {
            match c.infer("mlp", "", &[("x", &x)], &opts, false).await {
                Ok(r) => break r.outputs,
                Err(e) => {
                    assert!(t.elapsed() < Duration::from_secs(30), "the server does not serve after the restart: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        eprintln!("worker test: ready again {:.0} ms after the kill", ready_after.as_secs_f64() * 1e3);
        assert_eq!(again, before, "mlp answers differently after the restart");
        let slow_again = c.infer("slow", "", &[("x", &xs)], &opts, true).await.expect("slow after the restart").outputs;
        assert_eq!(slow_again, slow_before, "slow answers differently after the restart");
        let now = children_of(server.child.id());
        assert_eq!(now.len(), 1, "one worker after the restart (found {now:?})");
        assert_ne!(now[0], workers[0], "the worker was restarted");
        assert_eq!(recoveries_counted(&c).await, "1", "one recovery counted");
        assert!(c.server_live().await.unwrap(), "the server stayed live");
    });
}

/// A restarted worker that never becomes ready (here: one that hangs before it says so, as one
/// stuck in CUDA's initialisation would) is killed after --worker-start-timeout-s and counted as a
/// failed start; meanwhile requests get 503 naming the cause, the server's front end stays up, and
/// after the third failed start the GPU is given up with no worker process left behind.
#[test]
fn a_worker_that_never_becomes_ready_is_killed_after_the_start_timeout() {
    let dir = test_dir("kairos-worker-hang-test");
    // The first worker serves; every restarted one hangs before ready.
    let server = start_with(&dir, &["--worker-start-timeout-s", "2", "--test-worker-hang-from-generation", "1", "--load", "mlp"]);
    let rt = runtime(2);
    rt.block_on(async {
        let c = RestClient::new(&server.http).unwrap();
        let started = Instant::now();
        while !c.server_live().await.unwrap_or(false) {
            assert!(started.elapsed() < READY_WAIT, "the server did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        wait_ready(&c, READY_WAIT).await;
        let x = input(64, 0.5);
        let opts = InferOptions::default();
        c.infer("mlp", "", &[("x", &x)], &opts, false).await.expect("mlp through the first worker");
        let workers = children_of(server.child.id());
        assert_eq!(workers.len(), 1, "one worker (found {workers:?})");
        let killed_at = Instant::now();
        assert!(Command::new("kill").args(["-9", &workers[0].to_string()]).status().unwrap().success());

        // While the restarts hang: live, not ready, requests refused naming the time limit.
        let mut saw_cause = None;
        let mut hung_workers = std::collections::BTreeSet::new();
        while saw_cause.is_none() {
            assert!(killed_at.elapsed() < Duration::from_secs(20), "no request was refused naming the start time limit");
            hung_workers.extend(children_of(server.child.id()));
            match c.infer("mlp", "", &[("x", &x)], &opts, false).await {
                Err(ClientError::Server { code: Code::Unavailable, message }) => {
                    if message.contains("did not become ready within 2 s") {
                        saw_cause = Some(message);
                    }
                }
                Ok(_) => panic!("a request was served while every new worker hangs"),
                Err(e) => panic!("expected 503 while the worker restarts, got {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let after = killed_at.elapsed();
        eprintln!("hang test: refused naming the time limit {:.1} s after the kill: {}", after.as_secs_f64(), saw_cause.unwrap());
        assert!(after >= Duration::from_secs(2), "the time limit was not waited for ({after:?})");
        assert!(!c.server_ready().await.unwrap(), "ready while the GPU's worker cannot start");
        // (The killed worker may still show, briefly, before it is a zombie.)
        hung_workers.remove(&workers[0]);
        assert!(!hung_workers.is_empty(), "a new (hanging) worker was started");

        // Three failed starts: the GPU is given up (liveness now says why), the front end answers.
        let t = Instant::now();
        let message = loop {
            assert!(t.elapsed() < Duration::from_secs(30), "the GPU was not given up after three timed-out starts");
            match c.infer("mlp", "", &[("x", &x)], &opts, false).await {
                Err(ClientError::Server { code: Code::Unavailable, message }) if message.contains("stopped") => break message,
                Err(ClientError::Server { code: Code::Unavailable, .. }) => {}
                r => panic!("expected 503 while the worker restarts, got {:?}", r.map(|r| r.model_name)),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(message.contains("3 worker starts failed") && message.contains("did not become ready within 2 s"), "{message}");
        assert!(!c.server_live().await.unwrap(), "a GPU given up makes the server not live (restart the process)");
        assert!(!c.server_ready().await.unwrap());
        // Every worker that hung was killed and reaped.
        let left = children_in_state(server.child.id(), true);
        assert!(left.is_empty(), "worker processes left behind (zombies included): {left:?}");
        for pid in &hung_workers {
            assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the hung worker {pid} still exists");
        }
    });
}

/// A load that hangs in a running worker (here: its load of `slow` never finishes, as one stuck in
/// the driver would) fails after --model-load-timeout-s with 503 naming the limit; the worker,
/// stuck, is killed (reaped, no zombie) and restarted with the other models, which serve again;
/// the model that hung loads in the new worker.
#[test]
fn a_load_that_hangs_fails_after_the_load_timeout_and_the_worker_is_restarted() {
    let dir = test_dir("kairos-worker-load-hang-test");
    let server = start_with(&dir, &["--model-load-timeout-s", "2", "--test-worker-hang-in-load", "slow", "--load", "mlp"]);
    let rt = runtime(2);
    rt.block_on(async {
        let c = RestClient::new(&server.http).unwrap();
        let started = Instant::now();
        while !c.server_live().await.unwrap_or(false) {
            assert!(started.elapsed() < READY_WAIT, "the server did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        wait_ready(&c, READY_WAIT).await;
        let x = input(64, 0.5);
        let opts = InferOptions::default();
        let before = c.infer("mlp", "", &[("x", &x)], &opts, false).await.expect("mlp through the first worker").outputs;
        let workers = children_of(server.child.id());
        assert_eq!(workers.len(), 1, "one worker (found {workers:?})");

        // The load hangs in the worker: its answer comes after the limit, naming it.
        let loading = {
            let c = RestClient::new(&server.http).unwrap();
            tokio::spawn(async move {
                let t = Instant::now();
                (tokio::time::timeout(Duration::from_secs(30), c.load_model("slow")).await, t.elapsed())
            })
        };
        // Meanwhile the worker serves the other models.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let during = c.infer("mlp", "", &[("x", &x)], &opts, false).await.expect("mlp while a load hangs").outputs;
        assert_eq!(during, before);
        let (answer, took) = loading.await.unwrap();
        let answer = answer.expect("the hung load got no answer within 30 s");
        match answer {
            Err(ClientError::Server { code: Code::Unavailable, message }) => {
                eprintln!("load hang test: answered after {:.1} s: {message}", took.as_secs_f64());
                assert!(message.contains("did not finish within the model load time limit of 2 s"), "{message}");
                assert!(message.contains("slow"), "the answer names the model: {message}");
            }
            other => panic!("expected 503 for the hung load, got {other:?}"),
        }
        assert!(took >= Duration::from_secs(2), "the limit was not waited for ({took:?})");
        assert!(took < Duration::from_secs(10), "the load's answer came late ({took:?})");

        // The stuck worker is killed and a new one serves mlp again.
        let t = Instant::now();
        let again = loop {
            match c.infer("mlp", "", &[("x", &x)], &opts, false).await {
                Ok(r) => break r.outputs,
                Err(ClientError::Server { code: Code::Unavailable, message }) => {
                    assert!(message.contains("worker"), "the 503 names the cause: {message}");
                    assert!(t.elapsed() < Duration::from_secs(30), "mlp is not served after the restart: {message}");
                }
                Err(e) => panic!("expected mlp served or 503 while the worker restarts, got {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(again, before, "mlp answers differently after the restart");
        let now = children_in_state(server.child.id(), true);
        assert_eq!(now.len(), 1, "one worker after the restart, no zombie (found {now:?})");
        assert_ne!(now[0], workers[0], "the stuck worker was restarted");
        assert!(!Path::new(&format!("/proc/{}", workers[0])).exists(), "the stuck worker {} still exists", workers[0]);
        assert_eq!(recoveries_counted(&c).await, "1", "one recovery counted");
        // The model that hung loads in the new worker (the hang was the first worker's only).
        c.load_model("slow").await.expect("slow loads in the restarted worker");
        let xs = input(512, 1.5);
        c.infer("slow", "", &[("x", &xs)], &opts, false).await.expect("slow after its load");
        assert!(c.server_live().await.unwrap() && c.server_ready().await.unwrap(), "live and ready again");
    });
}

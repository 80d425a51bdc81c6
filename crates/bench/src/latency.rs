//! `kairos bench latency`'s measurement: isolated latency of each zoo model at the chosen batch
//! sizes, kairos issuing every kernel itself through its dispatcher, beside the PyTorch peer
//! (eager and CUDA-graph replay, `scripts/pytorch_peer.py`) when its JSON is given. The binary
//! (crates/kairos/src/cmd_latency.rs) parses the arguments and builds the [`Runner`]; everything
//! else is here: warm-up and timed requests, the summaries, `latency.json` and `latency.md`.
//!
//! On the GPU ([`EngineRunner`]) kairos runs as an application embeds it: one in-process
//! [`Engine`] (dispatcher thread, bounded queue), and the client submits one request, waits for
//! its response, and repeats. Latency is the client's wall time from `submit` to the response,
//! so it includes the hand-off to the dispatcher thread and every kernel issue. The first
//! `warmup` requests of each model copy real inputs in (they fill the request buffers and warm
//! the caches) and are not counted; the timed ones run with inputs already resident
//! ([`Io::Skip`], as PyTorch's peer keeps its input on the GPU) or copy them in and out
//! ([`Io::Copy`]). The engine's GPU and the autotuner come from the caller (closures), so this
//! crate needs no CUDA.
//!
//! On the simulator ([`SimRunner`]) the same dispatcher runs in virtual time with the simulated
//! GPU's measured profiles (roofline kernel times where no profile matches the batch), so a run
//! is deterministic and needs no GPU.
//!
//! Results ([`Report`]): one markdown table per batch size with a geometric-mean row, and the
//! same in JSON. A model that fails (lowering, out of memory, a GPU error) is a row saying so,
//! not the end of the run.

use crate::stats::nearest_rank;
use anyhow::{Context, Result, bail};
use kairos_gpu::profile::ProfileSet;
use kairos_ir::model::ModelSpec as IrModelSpec;
use kairos_ir::plan::Plan;
use kairos_ir::{DType, Tensor};
use kairos_sched::{
    Command, Config, Engine, EstimateSource, ModelInfo, ModelSpec, Output, PolicyConfig, RequestOptions, VirtualDriver,
};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request that has not answered after this long is a failure of its model.
pub const REQUEST_TIMEOUT_S: u64 = 60;
/// Timed requests per model and batch, at most.
pub const REQUESTS_MAX: usize = 100_000;

/// Input and output copies of the timed requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Io {
    /// Timed requests run on inputs already in their buffers and copy nothing out (like the peer).
    Skip,
    /// Timed requests copy their inputs in and their outputs out.
    Copy,
}

/// What to measure, and how.
#[derive(Clone, Debug)]
pub struct LatencyOptions {
    /// The backend as the JSON names it: `cuda` or `sim` (the simulator's tables say which
    /// models ran on measured profiles).
    pub backend: String,
    /// Batch sizes; one table each.
    pub batch: Vec<usize>,
    /// Models (`None`: the whole zoo).
    pub models: Option<Vec<String>>,
    /// Sequence length of the transformer models.
    pub seq_len: usize,
    pub dtype: DType,
    /// The dispatcher's policy, by name.
    pub policy: String,
    /// Timed requests per model and batch (fewer when `budget_s` runs out first).
    pub requests: usize,
    /// Untimed warm-up requests per model and batch (with real inputs copied in).
    pub warmup: usize,
    /// Wall-time budget of the timed requests of one model and batch, in seconds.
    pub budget_s: f64,
    pub io: Io,
    /// Seed of the zoo's weights and the inputs.
    pub seed: u64,
}

impl LatencyOptions {
    fn simulated(&self) -> bool {
        self.backend == "sim"
    }
}

/// One timed request.
pub struct Sample {
    /// Submit to response as the client measures it (wall clock; virtual time on the simulator).
    pub latency_ns: u64,
    /// Arrival to completion on the dispatcher's GPU clock.
    pub dispatcher_ns: u64,
    /// Kernel launches the dispatcher issued for the request.
    pub launches: u32,
    /// Of those, issued behind the one before on its stream (no notification round trip).
    pub chained: u32,
}

impl Sample {
    /// A request the client saw take `latency_ns`, with the dispatcher's account of it.
    pub fn new(latency_ns: u64, tm: &kairos_sched::Timing) -> Sample {
        Sample { latency_ns, dispatcher_ns: tm.done_ns.saturating_sub(tm.arrival_ns), launches: tm.launches, chained: tm.chained }
    }
}

/// Where the requests go: the threaded engine on a GPU, or the virtual-time driver on the simulator.
pub trait Runner {
    fn device(&self) -> String;
    /// How latency is measured, for the table's heading.
    fn clock(&self) -> &'static str;
    /// Whether `tune` rewrites plans (for the table's heading).
    fn tunes(&self) -> bool {
        false
    }
    /// Chooses the plan's tiles on this device before it is loaded; what it did, as JSON.
    fn tune(&mut self, _plan: &mut Plan) -> Result<Option<Value>> {
        Ok(None)
    }
    fn load(&mut self, spec: ModelSpec) -> Result<ModelInfo>;
    fn request(&mut self, model: &str, inputs: Vec<Tensor>, options: RequestOptions) -> Result<Sample>;
    fn unload(&mut self, model: &str) -> Result<()>;
}

/// Starts an engine on the device (again, after a failure took the last one down).
pub type StartEngine = Box<dyn FnMut() -> Result<Engine>>;
/// Chooses a plan's tiles on the device before it is loaded; what it did, as JSON.
pub type Tune = Box<dyn FnMut(&mut Plan) -> Result<Value>>;

/// The threaded engine on a GPU, one request at a time, timed at the client.
pub struct EngineRunner {
    engine: Option<Engine>,
    start: StartEngine,
    name: String,
    /// The autotuner; `None` keeps the lowering's tiles.
    tune: Option<Tune>,
}

impl EngineRunner {
    /// A runner on `engine` (started by `start`, which starts another after a failure), named
    /// `name` in the tables.
    pub fn new(engine: Engine, start: StartEngine, name: String, tune: Option<Tune>) -> EngineRunner {
        EngineRunner { engine: Some(engine), start, name, tune }
    }

    /// The engine, started again if an earlier failure took it down.
    fn live(&mut self) -> Result<&Engine> {
        if self.engine.is_none() {
            eprintln!("  restarting the engine after a failure");
            self.engine = Some((self.start)()?);
        }
        Ok(self.engine.as_ref().expect("just started"))
    }

    /// Forgets the engine after a GPU-level failure, so the next model gets a fresh one.
    fn fail(&mut self, e: &kairos_sched::Error) {
        if matches!(e, kairos_sched::Error::Gpu(_) | kairos_sched::Error::ShuttingDown) {
            self.engine = None;
        }
    }
}

impl Runner for EngineRunner {
    fn device(&self) -> String {
        self.name.clone()
    }

    fn clock(&self) -> &'static str {
        "wall clock at the client of the in-process engine, submit to response"
    }

    fn tunes(&self) -> bool {
        self.tune.is_some()
    }

    fn tune(&mut self, plan: &mut Plan) -> Result<Option<Value>> {
        match &mut self.tune {
            Some(tune) => tune(plan).map(Some),
            None => Ok(None),
        }
    }

    fn load(&mut self, spec: ModelSpec) -> Result<ModelInfo> {
        let r = self.live()?.load_model(spec);
        r.as_ref().err().inspect(|e| self.fail(e));
        Ok(r?)
    }

    fn request(&mut self, model: &str, inputs: Vec<Tensor>, options: RequestOptions) -> Result<Sample> {
        let engine = self.live()?;
        let t = Instant::now();
        let handle = engine.submit(model, inputs, options)?;
        let Some(result) = handle.wait_timeout(Duration::from_secs(REQUEST_TIMEOUT_S)) else {
            // A GPU that hangs would hang the engine's shutdown too: leave that engine behind.
            if let Some(e) = self.engine.take() {
                std::mem::forget(e);
            }
            bail!("no response within {REQUEST_TIMEOUT_S} s");
        };
        let latency_ns = t.elapsed().as_nanos() as u64;
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                self.fail(&e);
                return Err(e.into());
            }
        };
        Ok(Sample::new(latency_ns, &response.timing))
    }

    fn unload(&mut self, model: &str) -> Result<()> {
        match &self.engine {
            Some(e) => Ok(e.unload_model(model)?),
            None => Ok(()),
        }
    }
}

/// The dispatcher's virtual-time driver on the simulated GPU: deterministic, no GPU needed.
pub struct SimRunner {
    driver: VirtualDriver<kairos_sim::SimGpu>,
    name: String,
}

impl SimRunner {
    /// The dispatcher configured by `config` on `gpu`, named "simulated ..." in the tables.
    pub fn new(config: Config, gpu: kairos_sim::SimGpu) -> Result<SimRunner> {
        let name = kairos_gpu::Gpu::info(&gpu).name.clone();
        let name = if name.contains("simulated") { name } else { format!("simulated {name}") };
        Ok(SimRunner { driver: VirtualDriver::new(config, gpu)?, name })
    }
}

impl Runner for SimRunner {
    fn device(&self) -> String {
        self.name.clone()
    }

    fn clock(&self) -> &'static str {
        "virtual time of the simulated GPU, arrival to completion"
    }

    fn load(&mut self, spec: ModelSpec) -> Result<ModelInfo> {
        if let Some(p) = &spec.profile {
            self.driver.dispatcher_mut().gpu_mut().register_plan(&spec.plan, p).map_err(anyhow::Error::msg)?;
        }
        Ok(self.driver.load_model(spec)?)
    }

    fn request(&mut self, model: &str, inputs: Vec<Tensor>, options: RequestOptions) -> Result<Sample> {
        let now = self.driver.now_ns();
        self.driver.submit_at(now, model, inputs, options);
        self.driver.run_until_idle()?;
        let records = self.driver.take_records();
        let [r] = records.as_slice() else { bail!("expected one completion, the dispatcher gave {}", records.len()) };
        let tm = r.result.clone()?;
        Ok(Sample::new(r.latency_ns(), &tm))
    }

    fn unload(&mut self, model: &str) -> Result<()> {
        let now = self.driver.now_ns();
        self.driver.schedule_command(now, Command::UnloadModel(model.to_string()));
        self.driver.run_until_idle()?;
        for o in self.driver.take_other_outputs() {
            if let Output::ModelUnloaded { result, .. } = o {
                result?;
            }
        }
        Ok(())
    }
}

/// One model at one batch size.
#[derive(Clone, Debug, Default)]
struct Row {
    model: String,
    /// Kernels in the plan: launches per forward pass.
    kernels: Option<usize>,
    /// Client latencies of the timed requests, sorted (ns).
    samples_ns: Vec<u64>,
    /// The dispatcher's arrival-to-completion times (ns), sorted.
    dispatcher_ns: Vec<u64>,
    /// Launches issued per timed request, on average.
    launches_per_request: Option<f64>,
    /// Of those, launches issued behind the one before on its stream, on average.
    chained_per_request: Option<f64>,
    /// Lowering, tuning and loading time (s).
    load_s: f64,
    /// What the autotuner did (JSON of its report), or why it failed.
    autotune: Option<Value>,
    /// Where the dispatcher's kernel estimates (and the simulator's kernel times) came from.
    estimates: Option<EstimateSource>,
    error: Option<String>,
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl Row {
    fn p50_ms(&self) -> Option<f64> {
        nearest_rank(&self.samples_ns, 50.0).map(ms)
    }
    fn p99_ms(&self) -> Option<f64> {
        nearest_rank(&self.samples_ns, 99.0).map(ms)
    }
    fn ok(&self) -> bool {
        self.error.is_none() && !self.samples_ns.is_empty()
    }
}

/// The PyTorch peer's numbers for one model and batch.
#[derive(Clone, Debug, Default)]
struct PeerRow {
    kernels: Option<u64>,
    eager_ms: Option<f64>,
    graph_ms: Option<f64>,
    error: Option<String>,
}

/// The PyTorch peer's JSON files, rows by model and batch.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    /// "PyTorch 2.11.0+cu130 on NVIDIA H200", one per file.
    sources: Vec<String>,
    rows: HashMap<(String, usize), PeerRow>,
}

impl Peers {
    /// Reads the JSON files of scripts/pytorch_peer.py.
    pub fn read(paths: &[PathBuf]) -> Result<Peers> {
        let mut p = Peers::default();
        for path in paths {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the peer file {}", path.display()))?;
            p.add(&text).with_context(|| format!("{} is not a JSON of scripts/pytorch_peer.py", path.display()))?;
        }
        Ok(p)
    }

    fn add(&mut self, text: &str) -> Result<()> {
        let v: Value = serde_json::from_str(text)?;
        let rows = v["rows"].as_array().context("no 'rows' array")?;
        self.sources.push(format!(
            "PyTorch {} on {} ({})",
            v["torch"].as_str().unwrap_or("?"),
            v["device"].as_str().unwrap_or("?"),
            v["dtype"].as_str().unwrap_or("?")
        ));
        for r in rows {
            let model = r["model"].as_str().context("a row without 'model'")?.to_string();
            let batch = r["batch"].as_u64().unwrap_or(1) as usize;
            let row = PeerRow {
                kernels: r["kernels_per_forward"].as_u64(),
                eager_ms: r["eager_ms"].as_f64(),
                graph_ms: r["graph_ms"].as_f64(),
                error: r["error"].as_str().map(str::to_string),
            };
            self.rows.insert((model, batch), row);
        }
        Ok(())
    }

    fn get(&self, model: &str, batch: usize) -> Option<&PeerRow> {
        self.rows.get(&(model.to_string(), batch))
    }
}

fn geomean(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan() || *v <= 0.0) {
        return None;
    }
    Some((values.iter().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp())
}

/// Geometric means of one table: kairos p50, eager, graph and the two ratios, over the models
/// with every number present (with peers), or every model kairos measured (without).
#[derive(Clone, Debug, Default, PartialEq)]
struct GeomeanSummary {
    models: Vec<String>,
    kairos_ms: Option<f64>,
    eager_ms: Option<f64>,
    graph_ms: Option<f64>,
    kairos_over_eager: Option<f64>,
    kairos_over_graph: Option<f64>,
}

fn summarize(rows: &[Row], batch: usize, peers: Option<&Peers>) -> GeomeanSummary {
    let mut s = GeomeanSummary::default();
    let (mut k, mut e, mut g) = (Vec::new(), Vec::new(), Vec::new());
    for r in rows.iter().filter(|r| r.ok()) {
        let kairos = r.p50_ms().expect("ok rows have samples");
        match peers {
            None => k.push(kairos),
            Some(p) => {
                let Some(pr) = p.get(&r.model, batch) else { continue };
                let (Some(eager), Some(graph)) = (pr.eager_ms, pr.graph_ms) else { continue };
                k.push(kairos);
                e.push(eager);
                g.push(graph);
            }
        }
        s.models.push(r.model.clone());
    }
    s.kairos_ms = geomean(&k);
    s.eager_ms = geomean(&e);
    s.graph_ms = geomean(&g);
    // The geometric mean of per-model ratios is the ratio of the geometric means over one set.
    s.kairos_over_eager = s.kairos_ms.zip(s.eager_ms).map(|(a, b)| a / b);
    s.kairos_over_graph = s.kairos_ms.zip(s.graph_ms).map(|(a, b)| a / b);
    s
}

fn f3(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.3}"))
}

fn f2(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.2}"))
}

/// An error in one table cell: one line, short.
fn cell_error(e: &str) -> String {
    let line = e.lines().next().unwrap_or("").replace('|', "/");
    let short: String = line.chars().take(90).collect();
    if short.len() < line.len() { format!("{short}…") } else { short }
}

struct TableContext<'a> {
    device: &'a str,
    clock: &'a str,
    policy: &'a str,
    dtype: DType,
    seq_len: usize,
    requests: usize,
    warmup: usize,
    io: Io,
    tuned: bool,
    simulated: bool,
    date: &'a str,
}

/// The markdown table of one batch size.
fn markdown(cx: &TableContext, batch: usize, rows: &[Row], peers: Option<&Peers>) -> String {
    let mut s = String::new();
    let io = match cx.io {
        Io::Skip => "inputs resident, no copies in the timed requests",
        Io::Copy => "inputs copied in and outputs out in every request",
    };
    s.push_str(&format!(
        "### Batch {batch}: kairos on {} ({}, policy {}, transformers at sequence {}; {})\n\n",
        cx.device, cx.dtype, cx.policy, cx.seq_len, cx.date
    ));
    let segments = format!(
        "each job sent in segments of at least {} us of estimated GPU time ({} us where streams share hardware queues), each segment's kernels but its last replayed as a CUDA graph that kairos recorded, its last launched by the dispatcher (`Config::run_segment_ns`)",
        kairos_sched::RUN_SEGMENT_NS_DEFAULT / 1000,
        kairos_sched::RUN_SEGMENT_NS_SHARED_QUEUES / 1000
    );
    s.push_str(&format!(
        "kairos: p50 and p99 of {} requests one at a time after {} warm-up, {}; {}; {}; {}.",
        cx.requests,
        cx.warmup,
        cx.clock,
        io,
        if cx.tuned { "tiles autotuned at load" } else { "the lowering's tiles" },
        match policy(cx.policy) {
            Ok(p) if !p.is_kernel_level() => {
                "each job's kernels but the last replayed as a CUDA graph that kairos recorded (a recorded run), the last launched by the dispatcher"
            }
            Ok(p) if !p.build().preempts() => &segments,
            _ => "every kernel issued by the dispatcher, no CUDA graphs",
        }
    ));
    if let Some(p) = peers {
        s.push_str(&format!(
            " Peer: {} (eager and CUDA-graph replay, medians of CUDA-event timings; `scripts/pytorch_peer.py`).",
            p.sources.join("; ")
        ));
    }
    s.push_str("\n\n");
    if cx.simulated {
        let names = |src: EstimateSource| -> Vec<&str> {
            rows.iter().filter(|r| r.estimates == Some(src)).map(|r| r.model.as_str()).collect()
        };
        let (measured, roofline) = (names(EstimateSource::Profile), names(EstimateSource::Roofline));
        s.push_str(&format!(
            "Simulated kernel times: measured profiles for {}; roofline for {}.\n\n",
            if measured.is_empty() { "none".into() } else { measured.join(", ") },
            if roofline.is_empty() { "none".into() } else { roofline.join(", ") }
        ));
    }
    if peers.is_some() {
        s.push_str("| model | kairos kernels | kairos p50 (ms) | kairos p99 (ms) | PyTorch kernels | eager (ms) | CUDA graph (ms) | kairos / eager | kairos / graph |\n");
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    } else {
        s.push_str("| model | kairos kernels | kairos p50 (ms) | kairos p99 (ms) | requests |\n");
        s.push_str("|---|---:|---:|---:|---:|\n");
    }
    for r in rows {
        let kernels = r.kernels.map_or("–".into(), |k| k.to_string());
        let (p50, p99) = match &r.error {
            Some(e) => (format!("failed: {}", cell_error(e)), "–".to_string()),
            None => (f3(r.p50_ms()), f3(r.p99_ms())),
        };
        match peers {
            None => s.push_str(&format!("| {} | {kernels} | {p50} | {p99} | {} |\n", r.model, r.samples_ns.len())),
            Some(p) => {
                let pr = p.get(&r.model, batch).cloned().unwrap_or_default();
                let (eager, graph) = match (&pr.error, p.get(&r.model, batch)) {
                    (Some(e), _) => (format!("failed: {}", cell_error(e)), "–".to_string()),
                    (None, None) => ("not measured".to_string(), "–".to_string()),
                    (None, Some(_)) => (f3(pr.eager_ms), f3(pr.graph_ms)),
                };
                let k = r.ok().then(|| r.p50_ms()).flatten();
                let ratio = |peer: Option<f64>| f2(k.zip(peer).map(|(a, b)| a / b));
                s.push_str(&format!(
                    "| {} | {kernels} | {p50} | {p99} | {} | {eager} | {graph} | {} | {} |\n",
                    r.model,
                    pr.kernels.map_or("–".into(), |k| k.to_string()),
                    ratio(pr.eager_ms),
                    ratio(pr.graph_ms)
                ));
            }
        }
    }
    let sum = summarize(rows, batch, peers);
    let n = sum.models.len();
    let label = format!("**geometric mean** ({n} model{})", if n == 1 { "" } else { "s" });
    match peers {
        None => s.push_str(&format!("| {label} | | {} | | |\n", f3(sum.kairos_ms))),
        Some(_) => s.push_str(&format!(
            "| {label} | | {} | | | {} | {} | **{}** | **{}** |\n",
            f3(sum.kairos_ms),
            f3(sum.eager_ms),
            f3(sum.graph_ms),
            f2(sum.kairos_over_eager),
            f2(sum.kairos_over_graph)
        )),
    }
    s
}

fn row_json(r: &Row, batch: usize, peers: Option<&Peers>) -> Value {
    let q = |v: &[u64], p: f64| nearest_rank(v, p).map(ms);
    let mean = (!r.samples_ns.is_empty()).then(|| r.samples_ns.iter().sum::<u64>() as f64 / r.samples_ns.len() as f64 / 1e6);
    let mut v = json!({
        "model": r.model,
        "batch": batch,
        "kernels_per_forward": r.kernels,
        "launches_per_request": r.launches_per_request,
        "chained_per_request": r.chained_per_request,
        "requests": r.samples_ns.len(),
        "p50_ms": q(&r.samples_ns, 50.0),
        "p99_ms": q(&r.samples_ns, 99.0),
        "mean_ms": mean,
        "min_ms": r.samples_ns.first().copied().map(ms),
        "dispatcher_p50_ms": q(&r.dispatcher_ns, 50.0),
        "load_s": r.load_s,
        "autotune": r.autotune,
        "estimates": r.estimates.map(|e| format!("{e:?}").to_lowercase()),
        "error": r.error,
    });
    if let Some(pr) = peers.and_then(|p| p.get(&r.model, batch)) {
        let k = r.ok().then(|| r.p50_ms()).flatten();
        v["peer"] = json!({
            "kernels_per_forward": pr.kernels,
            "eager_ms": pr.eager_ms,
            "graph_ms": pr.graph_ms,
            "error": pr.error,
            "kairos_over_eager": k.zip(pr.eager_ms).map(|(a, b)| a / b),
            "kairos_over_graph": k.zip(pr.graph_ms).map(|(a, b)| a / b),
        });
    }
    v
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock.
fn today_utc() -> String {
    time::OffsetDateTime::now_utc().date().to_string()
}

/// Whether a measured profile was taken on this very plan (same launches, same logical blocks).
fn profile_matches(plan: &Plan, p: &kairos_gpu::profile::ModelProfile) -> bool {
    p.dtype == plan.dtype
        && p.kernels
            .iter()
            .all(|k| plan.launches.get(k.launch as usize).is_some_and(|l| l.shape.logical_blocks == k.logical_blocks))
}

/// Lowers, loads, warms up and times one model at one batch size.
fn measure(runner: &mut dyn Runner, a: &LatencyOptions, profiles: &ProfileSet, inputs: Inputs, model: &str, batch: usize) -> Row {
    let mut row = Row { model: model.to_string(), ..Row::default() };
    let t = Instant::now();
    let spec = IrModelSpec { model: model.to_string(), batch, seq_len: a.seq_len, seed: a.seed, dtype: a.dtype };
    let mut plan = match spec.plan() {
        Ok(p) => p,
        Err(e) => {
            row.error = Some(format!("lowering: {e}"));
            return row;
        }
    };
    match runner.tune(&mut plan) {
        Ok(report) => row.autotune = report,
        Err(e) => {
            // The lowering's tiles are correct too: measure them, and say so.
            eprintln!("  {model} batch {batch}: autotune failed, keeping the lowering's tiles: {e:#}");
            row.autotune = Some(json!({ "error": format!("{e:#}") }));
        }
    }
    row.kernels = Some(plan.launches.len());
    let inputs = inputs(&plan, a.seed);
    let name = format!("{model}/b{batch}");
    let profile = profiles.find(model, a.dtype, batch).filter(|p| {
        let ok = profile_matches(&plan, p);
        if !ok {
            eprintln!("  {name}: its profile was measured on another plan (kernels changed since): using roofline estimates");
        }
        ok
    });
    let profile = profile.cloned();
    let loaded = runner.load(ModelSpec { name: name.clone(), plan: Arc::new(plan), profile });
    row.load_s = t.elapsed().as_secs_f64();
    match loaded {
        Ok(info) => row.estimates = Some(info.estimate_source),
        Err(e) => {
            row.error = Some(format!("load: {e:#}"));
            return row;
        }
    }
    let result = (|| -> Result<()> {
        for _ in 0..a.warmup {
            runner.request(&name, inputs.clone(), RequestOptions::default())?;
        }
        let budget = Duration::from_secs_f64(a.budget_s.max(0.0));
        let t = Instant::now();
        let (mut launches, mut chained) = (0u64, 0u64);
        while row.samples_ns.len() < a.requests.min(REQUESTS_MAX) && (row.samples_ns.is_empty() || t.elapsed() < budget) {
            let s = match a.io {
                Io::Skip => runner.request(&name, vec![], RequestOptions { skip_io: true, ..Default::default() })?,
                Io::Copy => runner.request(&name, inputs.clone(), RequestOptions::default())?,
            };
            row.samples_ns.push(s.latency_ns);
            row.dispatcher_ns.push(s.dispatcher_ns);
            launches += u64::from(s.launches);
            chained += u64::from(s.chained);
        }
        row.launches_per_request = Some(launches as f64 / row.samples_ns.len().max(1) as f64);
        row.chained_per_request = Some(chained as f64 / row.samples_ns.len().max(1) as f64);
        Ok(())
    })();
    if let Err(e) = result {
        row.error = Some(format!("{e:#}"));
        row.samples_ns.clear();
        row.dispatcher_ns.clear();
    }
    if let Err(e) = runner.unload(&name) {
        eprintln!("  {name}: unload failed: {e:#}");
    }
    row.samples_ns.sort_unstable();
    row.dispatcher_ns.sort_unstable();
    row
}

/// What a run produced: the tables' markdown and the JSON document.
pub struct Report {
    pub markdown: String,
    pub json: Value,
}

impl Report {
    /// Writes `latency.json` and `latency.md` into `out` (created if missing); their paths.
    pub fn write(&self, out: &Path) -> Result<(PathBuf, PathBuf)> {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        let (json_path, md_path) = (out.join("latency.json"), out.join("latency.md"));
        std::fs::write(&json_path, serde_json::to_string_pretty(&self.json)?)?;
        std::fs::write(&md_path, &self.markdown)?;
        Ok((json_path, md_path))
    }
}

/// The inputs of a plan's requests, from a seed.
pub type Inputs = fn(&Plan, u64) -> Vec<Tensor>;

/// Measures every model at every batch size with `runner` (progress on stderr) and builds the
/// tables; `inputs` gives each plan's request inputs.
pub fn run_all(
    runner: &mut dyn Runner,
    a: &LatencyOptions,
    profiles: &ProfileSet,
    peers: Option<&Peers>,
    inputs: Inputs,
) -> Result<Report> {
    let models: Vec<String> =
        a.models.clone().unwrap_or_else(|| kairos_ir::zoo::ZOO.iter().map(|z| z.name.to_string()).collect());
    if models.is_empty() || a.batch.is_empty() || a.batch.contains(&0) {
        bail!("give at least one model and batch sizes of at least 1");
    }
    let device = runner.device();
    eprintln!(
        "kairos bench latency: {} models x batch {:?} on {device} ({}, policy {}, {} requests after {} warm-up each)",
        models.len(),
        a.batch,
        a.dtype,
        a.policy,
        a.requests,
        a.warmup
    );
    let mut tables: Vec<(usize, Vec<Row>)> = a.batch.iter().map(|&b| (b, Vec::new())).collect();
    for (i, m) in models.iter().enumerate() {
        for (batch, rows) in tables.iter_mut() {
            let t = Instant::now();
            let r = measure(runner, a, profiles, inputs, m, *batch);
            match &r.error {
                Some(e) => eprintln!("[{}/{}] {m} batch {batch}: FAILED {}", i + 1, models.len(), cell_error(e)),
                None => eprintln!(
                    "[{}/{}] {m} batch {batch}: {} kernels ({:.0} chained){}, p50 {} ms, p99 {} ms over {} requests ({:.1} s)",
                    i + 1,
                    models.len(),
                    r.kernels.unwrap_or(0),
                    r.chained_per_request.unwrap_or(0.0),
                    r.autotune.as_ref().map_or(String::new(), |t| match t["launches_changed"].as_u64() {
                        Some(n) => format!(
                            " ({n} retiled by the autotuner, {} of {} shapes timed now)",
                            t["timed"].as_u64().unwrap_or(0),
                            t["shapes"].as_u64().unwrap_or(0)
                        ),
                        None => " (autotune failed)".into(),
                    }),
                    f3(r.p50_ms()),
                    f3(r.p99_ms()),
                    r.samples_ns.len(),
                    t.elapsed().as_secs_f64()
                ),
            }
            rows.push(r);
        }
    }
    let date = today_utc();
    let cx = TableContext {
        device: &device,
        clock: runner.clock(),
        policy: &a.policy,
        dtype: a.dtype,
        seq_len: a.seq_len,
        requests: a.requests,
        warmup: a.warmup,
        io: a.io,
        tuned: runner.tunes(),
        simulated: a.simulated(),
        date: &date,
    };
    let mut md = String::new();
    let mut json_tables = Vec::new();
    for (batch, rows) in &tables {
        md.push_str(&markdown(&cx, *batch, rows, peers));
        md.push('\n');
        let s = summarize(rows, *batch, peers);
        json_tables.push(json!({
            "batch": batch,
            "rows": rows.iter().map(|r| row_json(r, *batch, peers)).collect::<Vec<_>>(),
            "geomean": {
                "models": s.models,
                "kairos_p50_ms": s.kairos_ms,
                "eager_ms": s.eager_ms,
                "graph_ms": s.graph_ms,
                "kairos_over_eager": s.kairos_over_eager,
                "kairos_over_graph": s.kairos_over_graph,
            },
        }));
    }
    let json = json!({
        "date": date,
        "device": device,
        "backend": a.backend,
        "clock": runner.clock(),
        "policy": a.policy,
        "dtype": a.dtype.to_string(),
        "seq_len": a.seq_len,
        "requests": a.requests,
        "warmup": a.warmup,
        "io": format!("{:?}", a.io).to_lowercase(),
        "autotune": runner.tunes(),
        "peers": peers.map(|p| p.sources.clone()).unwrap_or_default(),
        "tables": json_tables,
    });
    Ok(Report { markdown: md, json })
}

/// The dispatcher's policy by name; an unknown name is an error that lists every policy.
pub fn policy(name: &str) -> Result<PolicyConfig> {
    PolicyConfig::by_name(name).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown policy '{name}': use one of {} (parameters: `kairos bench list`)",
            PolicyConfig::NAMES.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geomean_row_uses_the_models_with_every_number() {
        let row = |m: &str, ns: u64| Row { model: m.into(), kernels: Some(3), samples_ns: vec![ns], ..Row::default() };
        let rows = vec![
            row("a", 2_000_000),
            row("b", 8_000_000),
            row("c", 1_000_000),
            Row { model: "d".into(), error: Some("out of memory".into()), ..Row::default() },
        ];
        let mut peers = Peers::default();
        peers
            .add(
                r#"{"torch":"2.11","device":"H200","dtype":"fp16","rows":[
                {"model":"a","batch":1,"kernels_per_forward":10,"eager_ms":1.0,"graph_ms":0.5},
                {"model":"b","batch":1,"kernels_per_forward":10,"eager_ms":4.0,"graph_ms":2.0},
                {"model":"c","batch":1,"error":"boom"},
                {"model":"a","batch":8,"eager_ms":9.0,"graph_ms":9.0}]}"#,
            )
            .unwrap();
        let s = summarize(&rows, 1, Some(&peers));
        assert_eq!(s.models, vec!["a", "b"]);
        assert!((s.kairos_ms.unwrap() - 4.0).abs() < 1e-9);
        assert!((s.kairos_over_eager.unwrap() - 2.0).abs() < 1e-9);
        assert!((s.kairos_over_graph.unwrap() - 4.0).abs() < 1e-9);
        let without = summarize(&rows, 1, None);
        assert_eq!(without.models, vec!["a", "b", "c"]);
        assert!((without.kairos_ms.unwrap() - 16f64.cbrt()).abs() < 1e-9);
    }
}

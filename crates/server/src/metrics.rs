//! Prometheus metrics on `/metrics`, in the OpenMetrics text format ([`CONTENT_TYPE`]) that
//! prometheus-client (the Prometheus project's Rust client) encodes; Prometheus scrapes it as it is.
//! The names below are the samples' (a counter family's `# TYPE` line names it without `_total`).
//!
//! Recording is lock-free (atomics in per-model structures created when a model is first loaded and
//! kept for the server's lifetime, so counters never go backwards); only `/metrics` rendering and
//! the first load of a model name take a lock. Label values are bounded: models of the repository,
//! two classes, three protocols, nine outcomes, three cancellation causes; requests naming an unknown model are counted under
//! `model=""`, so a client cannot grow the label set.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kairos_requests_total` | counter | model, class, protocol, outcome |
//! | `kairos_request_duration_seconds` | histogram | model, class (engine wall time, submission to completion) |
//! | `kairos_request_queue_seconds` | histogram | model, class (arrival to first kernel, engine clock) |
//! | `kairos_request_gpu_seconds` | histogram | model, class (first kernel to done, engine clock) |
//! | `kairos_deadline_misses_total` | counter | model, class |
//! | `kairos_requests_cancelled_total` | counter | model, cause (`client_gone`, `timeout`, `drain`: requests the server cancelled, GPU work stopped) |
//! | `kairos_shape_variant_builds_total` | counter | model, outcome (`ok`, `failed`: shape variants planned and loaded for a request's shape) |
//! | `kairos_shape_variant_build_seconds_total`, `kairos_shape_variant_evictions_total` | counter | model (their planning and loading time; variants unloaded to make room) |
//! | `kairos_requests_in_flight`, `kairos_draining` | gauge | (requests handed to an engine and not answered; 1 while a drain is under way) |
//! | `kairos_gpu_busy_ratio` | gauge | gpu (share of 1 ms samples with kernels in flight, last second) |
//! | `kairos_gpu_busy_seconds_total` | counter | gpu |
//! | `kairos_preemptions_total`, `kairos_launches_total` | counter | gpu |
//! | `kairos_launches_lost_total`, `kairos_gpu_recoveries_total` | counter | gpu (lost notifications; GPU resets after a fault) |
//! | `kairos_engine_jobs`, `kairos_engine_rejected_total` | gauge / counter | gpu |
//! | `kairos_cold_starts_total`, `kairos_model_evictions_total`, `kairos_weight_loaded_bytes_total`, `kairos_weight_load_seconds_total` | counter | gpu (under a weight budget: loads a request started, models evicted, bytes moved, load time) |
//! | `kairos_secondary_busy_loads_total` | counter | gpu (parallel transmission: loads that copied a secondary's part themselves, its link busy) |
//! | `kairos_resident_weight_bytes` | gauge | gpu (device bytes of loaded and loading models' weights) |
//! | `kairos_models_ready`, `kairos_shm_clients` | gauge | |
//! | `kairos_shm_requests_total` | counter | path (`zero_copy`: the GPU read and wrote the client's region; `copy`: the server copied) |
//! | `kairos_shm_mapped_regions` | gauge | (clients' regions mapped into a GPU, one per client and GPU) |

use crate::error::Outcome;
use crate::inflight::CancelCause;
use kairos_sched::Class;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelValue, EncodeMetric, LabelValueEncoder, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What `/metrics` answers with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Histogram bucket upper bounds, seconds.
pub const BUCKETS_S: [f64; 20] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0,
    10.0, 30.0,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    Http,
    Grpc,
    Shm,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Http, Protocol::Grpc, Protocol::Shm];
    pub fn label(self) -> &'static str {
        match self {
            Protocol::Http => "http",
            Protocol::Grpc => "grpc",
            Protocol::Shm => "shm",
        }
    }
}

const CLASSES: [Class; 2] = [Class::RealTime, Class::BestEffort];

fn class_index(c: Class) -> usize {
    match c {
        Class::RealTime => 0,
        Class::BestEffort => 1,
    }
}

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS_S.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe_ns(&self, ns: u64) {
        let s = ns as f64 * 1e-9;
        if let Some(i) = BUCKETS_S.iter().position(|&b| s <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The histogram as read now; the count is at least the buckets' sum (a concurrent
    /// observation may have reached its bucket and not yet the count).
    fn sample(&self) -> Sample {
        let mut buckets: Vec<(f64, u64)> =
            BUCKETS_S.iter().zip(&self.buckets).map(|(&b, c)| (b, c.load(Ordering::Relaxed))).collect();
        let in_buckets: u64 = buckets.iter().map(|&(_, c)| c).sum();
        let count = self.count.load(Ordering::Relaxed).max(in_buckets);
        // The encoder writes `le="+Inf"` for an upper bound of f64::MAX.
        buckets.push((f64::MAX, count - in_buckets));
        Sample::Histogram { sum_s: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9, count, buckets }
    }
}

/// A count and a total duration (Triton's statistics).
#[derive(Default)]
pub struct Duration {
    pub count: AtomicU64,
    pub ns: AtomicU64,
}

impl Duration {
    pub fn add(&self, ns: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }
    pub fn get(&self) -> (u64, u64) {
        (self.count.load(Ordering::Relaxed), self.ns.load(Ordering::Relaxed))
    }
}

/// Everything recorded about one model name.
#[derive(Default)]
pub struct ModelMetrics {
    requests: [[[AtomicU64; Outcome::ALL.len()]; Protocol::ALL.len()]; 2],
    duration: [Histogram; 2],
    queue: [Histogram; 2],
    gpu: [Histogram; 2],
    deadline_misses: [AtomicU64; 2],
    cancelled: [AtomicU64; CancelCause::ALL.len()],
    /// Shape variants built (planned and loaded on demand): succeeded, failed; their build time.
    variant_builds: [AtomicU64; 2],
    variant_build_ns: AtomicU64,
    variant_evictions: AtomicU64,
    // Triton's statistics extension.
    pub success: Duration,
    pub fail: Duration,
    pub queue_stat: Duration,
    pub compute_input: Duration,
    pub compute_infer: Duration,
    pub compute_output: Duration,
    /// Milliseconds since the Unix epoch of the last request.
    pub last_inference_ms: AtomicU64,
}

impl ModelMetrics {
    /// A request the server cancelled (its engine answered the cancel).
    pub fn cancelled(&self, cause: CancelCause) {
        self.cancelled[cause.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn cancellations(&self, cause: CancelCause) -> u64 {
        self.cancelled[cause.index()].load(Ordering::Relaxed)
    }

    /// A shape variant build ended (`ok`: loaded) after `ns` of planning and loading.
    pub fn variant_built(&self, ok: bool, ns: u64) {
        self.variant_builds[ok as usize].fetch_add(1, Ordering::Relaxed);
        self.variant_build_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Shape variant builds that loaded (`ok`) or failed.
    pub fn variant_builds(&self, ok: bool) -> u64 {
        self.variant_builds[ok as usize].load(Ordering::Relaxed)
    }

    /// A loaded shape variant was unloaded to make room for another.
    pub fn variant_evicted(&self) {
        self.variant_evictions.fetch_add(1, Ordering::Relaxed);
    }

    pub fn variant_evictions(&self) -> u64 {
        self.variant_evictions.load(Ordering::Relaxed)
    }

    pub fn count(&self, class: Class, protocol: Protocol, outcome: Outcome) {
        self.requests[class_index(class)][protocol as usize][outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn requests(&self, class: Class, protocol: Protocol, outcome: Outcome) -> u64 {
        self.requests[class_index(class)][protocol as usize][outcome.index()].load(Ordering::Relaxed)
    }

    /// A completed request (success or engine-side failure).
    pub fn completed(&self, class: Class, ok: bool, engine_ns: u64, timing: Option<&kairos_sched::Timing>) {
        let c = class_index(class);
        self.duration[c].observe_ns(engine_ns);
        if ok {
            self.success.add(engine_ns)
        } else {
            self.fail.add(engine_ns)
        }
        if let Some(t) = timing {
            self.queue[c].observe_ns(t.queue_ns());
            self.queue_stat.add(t.queue_ns());
            let gpu_ns = t.done_ns.saturating_sub(t.first_issue_ns);
            self.gpu[c].observe_ns(gpu_ns);
            self.compute_infer.add(gpu_ns);
            if t.deadline_missed {
                self.deadline_misses[c].fetch_add(1, Ordering::Relaxed);
            }
        }
        let now_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        self.last_inference_ms.store(now_ms, Ordering::Relaxed);
    }

    pub fn deadline_misses(&self, class: Class) -> u64 {
        self.deadline_misses[class_index(class)].load(Ordering::Relaxed)
    }
}

/// Samples of one GPU's engine, taken by the server's sampler thread.
#[derive(Default)]
pub struct GpuSamples {
    pub busy_samples: AtomicU64,
    pub samples: AtomicU64,
    /// f64 bits of the busy share over the last window.
    pub busy_ratio_bits: AtomicU64,
}

/// A live view of one engine for rendering.
pub struct EngineView {
    pub gpu: u32,
    pub device: String,
    pub stats: kairos_sched::EngineStats,
    pub sample_period_s: f64,
}

pub struct Metrics {
    models: Mutex<BTreeMap<String, Arc<ModelMetrics>>>,
    unknown: Arc<ModelMetrics>,
    pub gpus: Vec<GpuSamples>,
    pub shm_clients: AtomicU64,
    /// Shared-memory ring requests submitted to an engine: zero-copy, copied.
    pub shm_zero_copy: AtomicU64,
    pub shm_copied: AtomicU64,
    pub shm_mapped_regions: AtomicU64,
}

impl Metrics {
    pub fn new(gpus: usize) -> Metrics {
        Metrics {
            models: Mutex::new(BTreeMap::new()),
            unknown: Arc::new(ModelMetrics::default()),
            gpus: (0..gpus).map(|_| GpuSamples::default()).collect(),
            shm_clients: AtomicU64::new(0),
            shm_zero_copy: AtomicU64::new(0),
            shm_copied: AtomicU64::new(0),
            shm_mapped_regions: AtomicU64::new(0),
        }
    }

    /// The metrics of a model name (created on first use; the repository bounds the names).
    pub fn model(&self, name: &str) -> Arc<ModelMetrics> {
        let mut m = self.models.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(name.to_string()).or_default().clone()
    }

    /// Requests that named no loaded model.
    pub fn unknown(&self) -> &ModelMetrics {
        &self.unknown
    }

    /// Everything as OpenMetrics text ([`CONTENT_TYPE`]), read from the atomics now.
    pub fn render(&self, engines: &[EngineView], serving: &Serving) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Snapshot(self.families(engines, serving))));
        let mut out = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail; the encoder's error type is fmt's.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }

    /// Every family's samples as read now, in exposition order.
    fn families(&self, engines: &[EngineView], serving: &Serving) -> Vec<Family> {
        let models: Vec<(String, Arc<ModelMetrics>)> = {
            let m = self.models.lock().unwrap_or_else(|e| e.into_inner());
            m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        // The unknown model's row (`model=""`) comes last and only where it counted something.
        let mut all: Vec<(&str, &ModelMetrics)> = models.iter().map(|(k, v)| (k.as_str(), &**v)).collect();
        all.push(("", &self.unknown));
        let class = |c: Class| LabelValue::from(crate::repository::class_name(c));
        let mut families = Vec::with_capacity(32);

        let mut requests = Family::new("kairos_requests", "Inference requests by model, class, protocol and outcome", COUNTER);
        for &(name, m) in &all {
            for c in CLASSES {
                for p in Protocol::ALL {
                    for o in Outcome::ALL {
                        let n = m.requests(c, p, o);
                        if n > 0 || (o == Outcome::Ok && !name.is_empty()) {
                            let labels = vec![
                                ("model", LabelValue::from(name)),
                                ("class", class(c)),
                                ("protocol", p.label().into()),
                                ("outcome", o.label().into()),
                            ];
                            requests.push(labels, Sample::Counter(n.into()));
                        }
                    }
                }
            }
        }
        families.push(requests);
        for (metric, help, pick) in [
            (
                "kairos_request_duration_seconds",
                "Engine wall time of a request, submission to completion",
                (|m: &ModelMetrics, c: usize| &m.duration[c]) as fn(&ModelMetrics, usize) -> &Histogram,
            ),
            ("kairos_request_queue_seconds", "Arrival to first kernel issued, on the engine's clock", |m, c| &m.queue[c]),
            ("kairos_request_gpu_seconds", "First kernel issued to done, on the engine's clock", |m, c| &m.gpu[c]),
        ] {
            let mut f = Family::new(metric, help, MetricType::Histogram);
            for &(name, m) in &all {
                for c in CLASSES {
                    let h = pick(m, class_index(c));
                    if h.count() == 0 && name.is_empty() {
                        continue;
                    }
                    f.push(vec![("model", name.into()), ("class", class(c))], h.sample());
                }
            }
            families.push(f);
        }
        let known = || all.iter().filter(|(n, _)| !n.is_empty());
        let mut misses = Family::new("kairos_deadline_misses", "Requests that finished after their deadline", COUNTER);
        for &(name, m) in known() {
            for c in CLASSES {
                misses.push(vec![("model", name.into()), ("class", class(c))], Sample::Counter(m.deadline_misses(c).into()));
            }
        }
        families.push(misses);
        let mut cancelled = Family::new(
            "kairos_requests_cancelled",
            "Requests the server cancelled, by cause: client_gone (the client closed its connection), timeout (past \
             the request's timeout), drain (left at the drain's deadline)",
            COUNTER,
        );
        for &(name, m) in known() {
            for cause in CancelCause::ALL {
                let labels = vec![("model", name.into()), ("cause", cause.label().into())];
                cancelled.push(labels, Sample::Counter(m.cancellations(cause).into()));
            }
        }
        families.push(cancelled);
        let mut builds = Family::new(
            "kairos_shape_variant_builds",
            "Shape variants planned and loaded on demand for a request shape, by outcome (ok, failed)",
            COUNTER,
        );
        let mut build_seconds =
            Family::new("kairos_shape_variant_build_seconds", "Time spent planning and loading shape variants", COUNTER);
        let mut evictions = Family::new(
            "kairos_shape_variant_evictions",
            "Shape variants unloaded to make room for another (least recently used idle first)",
            COUNTER,
        );
        for &(name, m) in known() {
            for (ok, label) in [(true, "ok"), (false, "failed")] {
                let labels = vec![("model", name.into()), ("outcome", label.into())];
                builds.push(labels, Sample::Counter(m.variant_builds(ok).into()));
            }
            let ns = m.variant_build_ns.load(Ordering::Relaxed);
            build_seconds.push(vec![("model", name.into())], Sample::Counter((ns as f64 * 1e-9).into()));
            evictions.push(vec![("model", name.into())], Sample::Counter(m.variant_evictions().into()));
        }
        families.extend([builds, build_seconds, evictions]);

        let per_gpu = |name: &'static str, help: &'static str, kind: MetricType, f: &dyn Fn(&EngineView) -> Value| {
            let mut family = Family::new(name, help, kind);
            for e in engines {
                let labels = vec![("gpu", e.gpu.to_string().into()), ("device", e.device.as_str().into())];
                family.push(labels, Sample::of(kind, f(e)));
            }
            family
        };
        let gpu_samples = |e: &EngineView| self.gpus.get(e.gpu as usize);
        families.extend([
            per_gpu(
                "kairos_gpu_busy_ratio",
                "Share of 1 ms samples over the last second at which the GPU had kernels in flight",
                MetricType::Gauge,
                &|e| f64::from_bits(gpu_samples(e).map(|g| g.busy_ratio_bits.load(Ordering::Relaxed)).unwrap_or(0)).into(),
            ),
            per_gpu("kairos_gpu_busy_seconds", "Sampled time the GPU had kernels in flight", COUNTER, &|e| {
                (gpu_samples(e).map(|g| g.busy_samples.load(Ordering::Relaxed)).unwrap_or(0) as f64 * e.sample_period_s).into()
            }),
            per_gpu("kairos_preemptions", "Kernel launches preempted by the policy", COUNTER, &|e| e.stats.preemptions.into()),
            per_gpu("kairos_launches", "Kernel launches issued", COUNTER, &|e| e.stats.launches.into()),
            per_gpu(
                "kairos_launches_lost",
                "Kernel launches whose notifications the GPU lost (their requests failed)",
                COUNTER,
                &|e| e.stats.launches_lost.into(),
            ),
            per_gpu(
                "kairos_gpu_recoveries",
                "Times the GPU was reset after a fault (its requests in flight failed with 503 / UNAVAILABLE)",
                COUNTER,
                &|e| e.stats.gpu_recoveries.into(),
            ),
            per_gpu(
                "kairos_cold_starts",
                "Loads of models not in GPU memory that a request started (weight budget)",
                COUNTER,
                &|e| e.stats.cold_starts.into(),
            ),
            per_gpu(
                "kairos_model_evictions",
                "Idle models whose weights left GPU memory to make room for a load",
                COUNTER,
                &|e| e.stats.evictions.into(),
            ),
            per_gpu(
                "kairos_secondary_busy_loads",
                "Loads planned through a secondary GPU that copied its part themselves: its link was busy (parallel \
                 transmission)",
                COUNTER,
                &|e| e.stats.secondary_busy_loads.into(),
            ),
            per_gpu("kairos_weight_loaded_bytes", "Weight bytes copied into GPU memory by cold starts", COUNTER, &|e| {
                e.stats.loaded_bytes.into()
            }),
            per_gpu(
                "kairos_weight_load_seconds",
                "Time completed loads took, first copy queued to last copy landed",
                COUNTER,
                &|e| (e.stats.load_ns as f64 / 1e9).into(),
            ),
            per_gpu(
                "kairos_resident_weight_bytes",
                "GPU memory the weights of loaded and loading models take under the weight budget",
                MetricType::Gauge,
                &|e| e.stats.resident_weight_bytes.into(),
            ),
            per_gpu("kairos_engine_jobs", "Requests held by the dispatcher", MetricType::Gauge, &|e| e.stats.jobs.into()),
            per_gpu("kairos_engine_rejected", "Requests refused at the engine's full submission queue", COUNTER, &|e| {
                e.stats.rejected.into()
            }),
        ]);
        let single = |name: &'static str, help: &'static str, kind: MetricType, v: Value| {
            let mut f = Family::new(name, help, kind);
            f.push(Vec::new(), Sample::of(kind, v));
            f
        };
        let load = |a: &AtomicU64| Value::Int(a.load(Ordering::Relaxed));
        families.push(single(
            "kairos_models_ready",
            "Models ready to serve",
            MetricType::Gauge,
            Value::Int(serving.models_ready as u64),
        ));
        families.push(single(
            "kairos_shm_clients",
            "Connected shared-memory clients",
            MetricType::Gauge,
            load(&self.shm_clients),
        ));
        let mut shm_requests = Family::new(
            "kairos_shm_requests",
            "Shared-memory ring requests by data path, counted when the path is taken: zero_copy (the GPU reads and \
             writes the client's region) or copy",
            COUNTER,
        );
        shm_requests.push(vec![("path", "zero_copy".into())], Sample::Counter(load(&self.shm_zero_copy)));
        shm_requests.push(vec![("path", "copy".into())], Sample::Counter(load(&self.shm_copied)));
        families.push(shm_requests);
        families.push(single(
            "kairos_shm_mapped_regions",
            "Shared-memory regions mapped into a GPU for zero-copy requests (one per client and GPU)",
            MetricType::Gauge,
            load(&self.shm_mapped_regions),
        ));
        families.push(single(
            "kairos_requests_in_flight",
            "Inference requests handed to an engine and not answered yet",
            MetricType::Gauge,
            Value::Int(serving.in_flight as u64),
        ));
        families.push(single(
            "kairos_draining",
            "1 while the server drains (not ready, new requests refused)",
            MetricType::Gauge,
            Value::Int(serving.draining as u64),
        ));
        families
    }
}

/// The server-wide serving state `/metrics` reports besides the recorded counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Serving {
    pub models_ready: usize,
    /// Requests handed to an engine and not answered.
    pub in_flight: usize,
    pub draining: bool,
}

const COUNTER: MetricType = MetricType::Counter;

/// A label value, escaped for the text format (the encoder writes label values as given).
#[derive(Clone, Debug)]
struct LabelValue(String);

impl From<&str> for LabelValue {
    fn from(v: &str) -> LabelValue {
        LabelValue(v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
    }
}

impl From<String> for LabelValue {
    fn from(v: String) -> LabelValue {
        LabelValue::from(v.as_str())
    }
}

impl EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(&self.0)
    }
}

type Labels = Vec<(&'static str, LabelValue)>;

/// A sample's number: counts print as integers, seconds and ratios as decimals.
#[derive(Clone, Copy, Debug)]
enum Value {
    Int(u64),
    Float(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Value {
        Value::Int(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Value {
        Value::Float(v)
    }
}

#[derive(Debug)]
enum Sample {
    Counter(Value),
    Gauge(Value),
    /// Sum in seconds, count, and per bucket (upper bound in seconds, observations in it alone).
    Histogram {
        sum_s: f64,
        count: u64,
        buckets: Vec<(f64, u64)>,
    },
}

impl Sample {
    fn of(kind: MetricType, v: Value) -> Sample {
        match kind {
            MetricType::Counter => Sample::Counter(v),
            _ => Sample::Gauge(v),
        }
    }
}

/// One metric family: the name without the `_total` a counter's samples get from the encoder.
#[derive(Debug)]
struct Family {
    name: &'static str,
    /// One sentence, without a final period.
    help: &'static str,
    kind: MetricType,
    samples: Vec<(Labels, Sample)>,
}

impl Family {
    fn new(name: &'static str, help: &'static str, kind: MetricType) -> Family {
        Family { name, help, kind, samples: Vec::new() }
    }

    fn push(&mut self, labels: Labels, sample: Sample) {
        self.samples.push((labels, sample));
    }
}

/// The families of one scrape, handed to prometheus-client's encoder.
#[derive(Debug)]
struct Snapshot(Vec<Family>);

fn encode_sample(sample: &Sample, mut encoder: MetricEncoder) -> std::fmt::Result {
    match sample {
        Sample::Counter(Value::Int(v)) => ConstCounter::new(*v).encode(encoder),
        Sample::Counter(Value::Float(v)) => ConstCounter::new(*v).encode(encoder),
        Sample::Gauge(Value::Int(v)) => ConstGauge::new(*v).encode(encoder),
        Sample::Gauge(Value::Float(v)) => ConstGauge::new(*v).encode(encoder),
        Sample::Histogram { sum_s, count, buckets } => encoder.encode_histogram::<NoLabelSet>(*sum_s, *count, buckets, None),
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        for f in &self.0 {
            let mut metric = encoder.encode_descriptor(f.name, f.help, None, f.kind)?;
            match f.samples.as_slice() {
                // No labels: `name value` (a family with an empty label set would print `name{} value`).
                [(labels, sample)] if labels.is_empty() => encode_sample(sample, metric)?,
                samples => {
                    for (labels, sample) in samples {
                        encode_sample(sample, metric.encode_family(labels)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let m = Metrics::new(0);
        let mm = m.model("m");
        for ns in [5_000, 3_000_000, 100_000_000_000] {
            // 5 us: the first bucket; 3 ms; 100 s: only +Inf.
            mm.completed(Class::BestEffort, true, ns, None);
        }
        let text = m.render(&[], &Serving::default());
        let row = |le: &str| format!("kairos_request_duration_seconds_bucket{{le=\"{le}\",model=\"m\",class=\"best-effort\"}}");
        assert!(text.contains(&format!("{} 1\n", row("0.00001"))), "{text}");
        assert!(text.contains(&format!("{} 2\n", row("0.005"))), "{text}");
        assert!(text.contains(&format!("{} 2\n", row("30.0"))), "{text}");
        assert!(text.contains(&format!("{} 3\n", row("+Inf"))), "{text}");
        assert!(text.contains("kairos_request_duration_seconds_count{model=\"m\",class=\"best-effort\"} 3\n"), "{text}");
        assert!(text.contains("kairos_request_duration_seconds_sum{model=\"m\",class=\"best-effort\"} 100.003005\n"), "{text}");
    }

    #[test]
    fn render_labels_and_escaping() {
        let m = Metrics::new(1);
        let mm = m.model("we\"ird");
        mm.count(Class::RealTime, Protocol::Grpc, Outcome::Overloaded);
        let t = kairos_sched::Timing {
            arrival_ns: 0,
            admitted_ns: 0,
            first_issue_ns: 1000,
            done_ns: 5000,
            launches: 1,
            chained: 0,
            deadline_missed: true,
            ..Default::default()
        };
        mm.completed(Class::RealTime, true, 7000, Some(&t));
        m.unknown().count(Class::BestEffort, Protocol::Http, Outcome::NotFound);
        let text = m.render(&[], &Serving { models_ready: 1, in_flight: 2, draining: true });
        assert!(
            text.contains(r#"kairos_requests_total{model="we\"ird",class="real-time",protocol="grpc",outcome="overloaded"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kairos_requests_total{model="",class="best-effort",protocol="http",outcome="not_found"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"kairos_deadline_misses_total{model="we\"ird",class="real-time"} 1"#), "{text}");
        assert!(text.contains(r#"kairos_request_gpu_seconds_count{model="we\"ird",class="real-time"} 1"#), "{text}");
        assert!(text.contains("kairos_models_ready 1\n"), "{text}");
        assert!(text.contains("kairos_requests_in_flight 2\n"), "{text}");
        assert!(text.contains("kairos_draining 1\n"), "{text}");
        assert!(text.contains("# TYPE kairos_requests counter\n"), "{text}");
        assert!(text.contains("# HELP kairos_models_ready Models ready to serve\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        // Every sample line is `name{labels} value` or `name value`, and each family is described once.
        let mut described = std::collections::HashSet::new();
        for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            assert!(described.insert(line.split(' ').nth(2).unwrap().to_string()), "{line}");
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}

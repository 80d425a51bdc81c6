//! Prometheus metrics, written by hand in the text exposition format (no exporter dependency).
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
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (b, c) in BUCKETS_S.iter().zip(&self.buckets) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9);
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
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

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
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

    /// The text exposition format.
    pub fn render(&self, engines: &[EngineView], models_ready: usize) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let models: Vec<(String, Arc<ModelMetrics>)> = {
            let m = self.models.lock().unwrap_or_else(|e| e.into_inner());
            m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let mut all: Vec<(String, &ModelMetrics)> = models.iter().map(|(k, v)| (escape(k), &**v)).collect();
        all.push((String::new(), &self.unknown));

        out.push_str("# HELP kairos_requests_total Inference requests by model, class, protocol and outcome.\n");
        out.push_str("# TYPE kairos_requests_total counter\n");
        for (name, m) in &all {
            for class in CLASSES {
                for p in Protocol::ALL {
                    for o in Outcome::ALL {
                        let n = m.requests(class, p, o);
                        if n > 0 || (o == Outcome::Ok && !name.is_empty()) {
                            let _ = writeln!(
                                out,
                                "kairos_requests_total{{model=\"{name}\",class=\"{}\",protocol=\"{}\",outcome=\"{}\"}} {n}",
                                crate::repository::class_name(class),
                                p.label(),
                                o.label()
                            );
                        }
                    }
                }
            }
        }
        for (metric, help, pick) in [
            (
                "kairos_request_duration_seconds",
                "Engine wall time of a request, submission to completion.",
                (|m: &ModelMetrics, c: usize| &m.duration[c]) as fn(&ModelMetrics, usize) -> &Histogram,
            ),
            ("kairos_request_queue_seconds", "Arrival to first kernel issued, on the engine's clock.", |m, c| &m.queue[c]),
            ("kairos_request_gpu_seconds", "First kernel issued to done, on the engine's clock.", |m, c| &m.gpu[c]),
        ] {
            let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} histogram");
            for (name, m) in &all {
                for class in CLASSES {
                    let h = pick(m, class_index(class));
                    if h.count() == 0 && name.is_empty() {
                        continue;
                    }
                    h.render(&mut out, metric, &format!("model=\"{name}\",class=\"{}\"", crate::repository::class_name(class)));
                }
            }
        }
        out.push_str("# HELP kairos_deadline_misses_total Requests that finished after their deadline.\n");
        out.push_str("# TYPE kairos_deadline_misses_total counter\n");
        for (name, m) in all.iter().filter(|(n, _)| !n.is_empty()) {
            for class in CLASSES {
                let _ = writeln!(
                    out,
                    "kairos_deadline_misses_total{{model=\"{name}\",class=\"{}\"}} {}",
                    crate::repository::class_name(class),
                    m.deadline_misses(class)
                );
            }
        }
        out.push_str("# HELP kairos_requests_cancelled_total Requests the server cancelled, by cause: client_gone (the client closed its connection), timeout (past the request's timeout), drain (left at the drain's deadline).\n");
        out.push_str("# TYPE kairos_requests_cancelled_total counter\n");
        for (name, m) in all.iter().filter(|(n, _)| !n.is_empty()) {
            for cause in CancelCause::ALL {
                let _ = writeln!(
                    out,
                    "kairos_requests_cancelled_total{{model=\"{name}\",cause=\"{}\"}} {}",
                    cause.label(),
                    m.cancellations(cause)
                );
            }
        }
        let gauge = |out: &mut String, metric: &str, kind: &str, help: &str, rows: Vec<(String, String)>| {
            let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} {kind}");
            for (labels, v) in rows {
                let _ = writeln!(out, "{metric}{labels} {v}");
            }
        };
        let per_gpu = |f: &dyn Fn(&EngineView) -> String| -> Vec<(String, String)> {
            engines.iter().map(|e| (format!("{{gpu=\"{}\",device=\"{}\"}}", e.gpu, escape(&e.device)), f(e))).collect()
        };
        gauge(
            &mut out,
            "kairos_gpu_busy_ratio",
            "gauge",
            "Share of 1 ms samples over the last second at which the GPU had kernels in flight.",
            per_gpu(&|e| {
                let bits = self.gpus.get(e.gpu as usize).map(|g| g.busy_ratio_bits.load(Ordering::Relaxed)).unwrap_or(0);
                format!("{}", f64::from_bits(bits))
            }),
        );
        gauge(
            &mut out,
            "kairos_gpu_busy_seconds_total",
            "counter",
            "Sampled time the GPU had kernels in flight.",
            per_gpu(&|e| {
                let n = self.gpus.get(e.gpu as usize).map(|g| g.busy_samples.load(Ordering::Relaxed)).unwrap_or(0);
                format!("{}", n as f64 * e.sample_period_s)
            }),
        );
        gauge(
            &mut out,
            "kairos_preemptions_total",
            "counter",
            "Kernel launches preempted by the policy.",
            per_gpu(&|e| e.stats.preemptions.to_string()),
        );
        gauge(
            &mut out,
            "kairos_launches_total",
            "counter",
            "Kernel launches issued.",
            per_gpu(&|e| e.stats.launches.to_string()),
        );
        gauge(
            &mut out,
            "kairos_launches_lost_total",
            "counter",
            "Kernel launches whose notifications the GPU lost (their requests failed).",
            per_gpu(&|e| e.stats.launches_lost.to_string()),
        );
        gauge(
            &mut out,
            "kairos_gpu_recoveries_total",
            "counter",
            "Times the GPU was reset after a fault (its requests in flight failed with 503 / UNAVAILABLE).",
            per_gpu(&|e| e.stats.gpu_recoveries.to_string()),
        );
        gauge(
            &mut out,
            "kairos_cold_starts_total",
            "counter",
            "Loads of models not in GPU memory that a request started (weight budget).",
            per_gpu(&|e| e.stats.cold_starts.to_string()),
        );
        gauge(
            &mut out,
            "kairos_model_evictions_total",
            "counter",
            "Idle models whose weights left GPU memory to make room for a load.",
            per_gpu(&|e| e.stats.evictions.to_string()),
        );
        gauge(
            &mut out,
            "kairos_secondary_busy_loads_total",
            "counter",
            "Loads planned through a secondary GPU that copied its part themselves: its link was busy (parallel transmission).",
            per_gpu(&|e| e.stats.secondary_busy_loads.to_string()),
        );
        gauge(
            &mut out,
            "kairos_weight_loaded_bytes_total",
            "counter",
            "Weight bytes copied into GPU memory by cold starts.",
            per_gpu(&|e| e.stats.loaded_bytes.to_string()),
        );
        gauge(
            &mut out,
            "kairos_weight_load_seconds_total",
            "counter",
            "Time completed loads took, first copy queued to last copy landed.",
            per_gpu(&|e| format!("{}", e.stats.load_ns as f64 / 1e9)),
        );
        gauge(
            &mut out,
            "kairos_resident_weight_bytes",
            "gauge",
            "GPU memory the weights of loaded and loading models take under the weight budget.",
            per_gpu(&|e| e.stats.resident_weight_bytes.to_string()),
        );
        gauge(
            &mut out,
            "kairos_engine_jobs",
            "gauge",
            "Requests held by the dispatcher.",
            per_gpu(&|e| e.stats.jobs.to_string()),
        );
        gauge(
            &mut out,
            "kairos_engine_rejected_total",
            "counter",
            "Requests refused at the engine's full submission queue.",
            per_gpu(&|e| e.stats.rejected.to_string()),
        );
        gauge(
            &mut out,
            "kairos_models_ready",
            "gauge",
            "Models ready to serve.",
            vec![(String::new(), models_ready.to_string())],
        );
        gauge(
            &mut out,
            "kairos_shm_clients",
            "gauge",
            "Connected shared-memory clients.",
            vec![(String::new(), self.shm_clients.load(Ordering::Relaxed).to_string())],
        );
        gauge(
            &mut out,
            "kairos_shm_requests_total",
            "counter",
            "Shared-memory ring requests by data path, counted when the path is taken: zero_copy (the GPU reads and writes the client's region) or copy.",
            vec![
                ("{path=\"zero_copy\"}".to_string(), self.shm_zero_copy.load(Ordering::Relaxed).to_string()),
                ("{path=\"copy\"}".to_string(), self.shm_copied.load(Ordering::Relaxed).to_string()),
            ],
        );
        gauge(
            &mut out,
            "kairos_shm_mapped_regions",
            "gauge",
            "Shared-memory regions mapped into a GPU for zero-copy requests (one per client and GPU).",
            vec![(String::new(), self.shm_mapped_regions.load(Ordering::Relaxed).to_string())],
        );
        out
    }

    /// The serving gauges of the state: requests in flight, and whether a drain is under way.
    pub fn render_serving(out: &mut String, in_flight: usize, draining: bool) {
        let _ = writeln!(
            out,
            "# HELP kairos_requests_in_flight Inference requests handed to an engine and not answered yet.\n# TYPE kairos_requests_in_flight gauge\nkairos_requests_in_flight {in_flight}"
        );
        let _ = writeln!(
            out,
            "# HELP kairos_draining 1 while the server drains (not ready, new requests refused).\n# TYPE kairos_draining gauge\nkairos_draining {}",
            draining as u8
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::default();
        h.observe_ns(5_000); // 5 us: first bucket
        h.observe_ns(3_000_000); // 3 ms
        h.observe_ns(100_000_000_000); // 100 s: only +Inf
        let mut s = String::new();
        h.render(&mut s, "x", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.00001\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.005\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"30\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3\n"), "{s}");
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
        let text = m.render(&[], 1);
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
        assert!(text.contains("kairos_models_ready 1"), "{text}");
        // Every sample line is `name{labels} value` or `name value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}

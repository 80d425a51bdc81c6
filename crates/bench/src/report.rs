//! Results: the JSON the harness writes, markdown tables, and plots like the papers'
//! (latency against throughput, one line per policy or peer; deadline misses against load).

use crate::Error;
use crate::metrics::{Metrics, Summary, measure};
use crate::plot::{Chart, Series, draw};
use crate::presets::Headline;
use crate::trace::{PeerFile, TraceFile, read_json, write_json};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

pub const RESULTS_FORMAT: &str = "kairos-bench/1";

/// One policy (or peer mode) at one load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub preset: String,
    pub variant: String,
    /// "kairos" or the peer ("pytorch").
    pub system: String,
    /// Short name ("paella", "pytorch-streams4").
    pub policy: String,
    /// With parameters ("paella(threshold=1000us)").
    pub policy_detail: String,
    pub load: f64,
    pub duration_ns: u64,
    pub warmup_ns: u64,
    pub metrics: Metrics,
    pub saturated: bool,
    pub model_loads: u64,
    pub model_unloads: u64,
    pub wall_s: f64,
    /// The trace file the point ran (relative to the results' folder).
    pub trace: Option<String>,
    /// Its requests one by one (`kairos-raw/1`, relative to the results' folder; kairos points).
    #[serde(default)]
    pub raw: Option<String>,
    /// What the dispatcher did (in-process kairos targets).
    #[serde(default)]
    pub dispatcher: Option<crate::target::DispatcherCounters>,
    /// When the point started, in milliseconds since the Unix epoch (kairos points): joins the
    /// point with samples taken beside the run (GPU power for energy per inference); it ended
    /// `wall_s` later.
    #[serde(default)]
    pub started_unix_ms: Option<u64>,
}

impl Point {
    /// The policy without the system's prefix ("streams4" for "pytorch-streams4").
    pub fn short_policy(&self) -> &str {
        self.policy.strip_prefix(&format!("{}-", self.system)).unwrap_or(&self.policy)
    }

    /// "kairos paella" / "pytorch streams4".
    pub fn series(&self) -> String {
        format!("{} {}", self.system, self.short_policy())
    }

    /// The summary the preset's headline reads.
    pub fn headline_summary(&self, h: &Headline) -> Option<&Summary> {
        match h {
            Headline::Overall | Headline::Misses => Some(&self.metrics.overall),
            Headline::Group(g) => self.metrics.group(g),
            Headline::Model(m) => self.metrics.model(m),
        }
    }
}

/// All points of one preset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PresetResults {
    pub preset: String,
    pub about: String,
    pub load_meaning: String,
    pub headline: Headline,
    /// Isolated latency (ms) of each model on the target, when the workload depends on it.
    pub isolated_ms: BTreeMap<String, f64>,
    /// Requests per second the target sustained on the preset's capacity workload (load 1), if any.
    #[serde(default)]
    pub capacity_per_s: Option<f64>,
    pub points: Vec<Point>,
    /// Points not run (a policy's loads past its saturation).
    pub skipped: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub format: String,
    /// What was driven ("kairos in-process, ...").
    pub target: String,
    pub device: String,
    pub seed: u64,
    pub created_unix_s: u64,
    pub version: String,
    /// Peers merged in ("pytorch 2.11.0 on NVIDIA H200").
    pub peers: Vec<String>,
    pub presets: Vec<PresetResults>,
}

impl Results {
    pub fn new(target: &str, device: &str, seed: u64) -> Results {
        Results {
            format: RESULTS_FORMAT.into(),
            target: target.into(),
            device: device.into(),
            seed,
            created_unix_s: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            version: env!("CARGO_PKG_VERSION").into(),
            peers: Vec::new(),
            presets: Vec::new(),
        }
    }

    pub fn write(&self, path: &Path) -> Result<(), Error> {
        write_json(path, self)
    }

    pub fn read(path: &Path) -> Result<Results, Error> {
        let r: Results = read_json(path)?;
        if r.format != RESULTS_FORMAT {
            return Err(Error::Invalid(format!("{}: format '{}', expected '{RESULTS_FORMAT}'", path.display(), r.format)));
        }
        Ok(r)
    }

    /// Adds the peer's runs as points of the presets whose traces they replayed (measured by the
    /// same code as kairos' points). Trace paths are relative to `traces_dir`. Runs of presets these
    /// results do not hold (their traces are not in `traces_dir`) are left out, and so are runs of
    /// another trace of the same name (their open-loop arrivals are not the trace's: runs with other
    /// arguments write traces named by preset and load alone). Returns how many points were added.
    pub fn merge_peers(&mut self, peers: &PeerFile, traces_dir: &Path, slo_ns: Option<u64>) -> Result<usize, Error> {
        let mut added = 0;
        let mut cache: BTreeMap<String, TraceFile> = BTreeMap::new();
        for run in &peers.runs {
            if !cache.contains_key(&run.trace) {
                let p = if Path::new(&run.trace).is_absolute() { PathBuf::from(&run.trace) } else { traces_dir.join(&run.trace) };
                if !p.exists() {
                    continue; // a trace of another results folder
                }
                cache.insert(run.trace.clone(), TraceFile::read(&p)?);
            }
            let t = &cache[&run.trace];
            if !self.presets.iter().any(|p| p.preset == t.preset) {
                continue;
            }
            let schedule = t.schedule()?;
            let outcomes = run.outcomes()?;
            let mut replayed: Vec<(u64, u32)> = outcomes.iter().filter(|o| !o.closed).map(|o| (o.arrival_ns, o.stream)).collect();
            let mut scheduled = schedule.arrivals.clone();
            replayed.sort_unstable();
            scheduled.sort_unstable();
            if replayed != scheduled {
                continue; // the replay of another trace of this name
            }
            if outcomes.iter().any(|o| o.stream as usize >= schedule.workload.streams.len()) {
                return Err(Error::Invalid(format!("peer run {} / {} names unknown streams", run.trace, run.mode)));
            }
            let metrics = measure(&schedule, &outcomes, slo_ns);
            let pr = self.presets.iter_mut().find(|p| p.preset == t.preset).expect("checked above");
            let policy = format!("{}-{}", peers.system, run.mode);
            pr.points.retain(|p| !(p.policy == policy && p.variant == t.variant && p.load == t.load));
            pr.points.push(Point {
                preset: t.preset.clone(),
                variant: t.variant.clone(),
                system: peers.system.clone(),
                policy: policy.clone(),
                policy_detail: format!("{} {} ({})", peers.system, run.mode, peers.version),
                load: t.load,
                duration_ns: t.duration_ns,
                warmup_ns: t.warmup_ns,
                saturated: metrics.saturated(0.9),
                metrics,
                model_loads: 0,
                model_unloads: 0,
                wall_s: run.wall_s,
                trace: Some(run.trace.clone()),
                raw: None,
                dispatcher: None,
                started_unix_ms: run.started_unix_ms,
            });
            added += 1;
        }
        let label = format!("{} {} on {}", peers.system, peers.version, peers.device);
        if !self.peers.contains(&label) {
            self.peers.push(label);
        }
        Ok(added)
    }

    /// Markdown: per preset, the headline table and the per-model table.
    pub fn markdown(&self, per_model: bool) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "Target: {}; device: {}; seed {}.", self.target, self.device, self.seed);
        if !self.peers.is_empty() {
            let _ = writeln!(s, "Peers: {}.", self.peers.join("; "));
        }
        for p in &self.presets {
            s.push('\n');
            s.push_str(&p.markdown(per_model));
        }
        s
    }

    /// Writes one PNG and one SVG per preset and variant into `dir`; returns the files.
    pub fn plot(&self, dir: &Path) -> Result<Vec<PathBuf>, Error> {
        let mut out = Vec::new();
        for p in &self.presets {
            out.extend(p.plot(dir, &self.device)?);
        }
        Ok(out)
    }
}

fn ms(ns: f64) -> String {
    let v = ns / 1e6;
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn rate(v: f64) -> String {
    if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

impl PresetResults {
    /// Points in table order: variant, system (kairos first), policy, load.
    fn sorted(&self) -> Vec<&Point> {
        let mut v: Vec<&Point> = self.points.iter().collect();
        v.sort_by(|a, b| {
            (&a.variant, a.system != "kairos", &a.policy)
                .cmp(&(&b.variant, b.system != "kairos", &b.policy))
                .then(a.load.total_cmp(&b.load))
        });
        v
    }

    fn groups(&self) -> Vec<String> {
        let mut g: Vec<String> = Vec::new();
        for p in &self.points {
            for s in &p.metrics.groups {
                if !g.contains(&s.name) {
                    g.push(s.name.clone());
                }
            }
        }
        g
    }

    pub fn markdown(&self, per_model: bool) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "### {} — {}\n", self.preset, self.about);
        let _ = writeln!(s, "Load: {}.", self.load_meaning);
        if !self.isolated_ms.is_empty() {
            let iso: Vec<String> = self.isolated_ms.iter().map(|(m, v)| format!("{m} {v:.2}")).collect();
            let _ = writeln!(s, "Isolated latency (ms): {}.", iso.join(", "));
        }
        if let Some(c) = self.capacity_per_s {
            let _ = writeln!(s, "Load 1 = {c:.1} requests/s (measured).");
        }
        s.push('\n');
        let groups = self.groups();
        let deadlines = self.points.iter().any(|p| p.metrics.overall.with_deadline > 0);
        let cold = self.points.iter().any(|p| p.model_loads > 0);
        let _ = write!(
            s,
            "| system | policy | variant | load | offered/s | served/s | goodput/s | p50 ms | p90 ms | p99 ms | p99.9 ms |"
        );
        let mut sep = String::from("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        if groups.len() > 1 {
            for g in &groups {
                let _ = write!(s, " {g} p99 ms |");
                sep.push_str("---:|");
            }
        }
        if deadlines {
            for g in &groups {
                let _ = write!(s, " {g} miss % |");
                sep.push_str("---:|");
            }
        }
        let _ = write!(s, " queue p50 ms | GPU p50 ms |");
        sep.push_str("---:|---:|");
        if cold {
            let _ = write!(s, " loads |");
            sep.push_str("---:|");
        }
        let _ = writeln!(s, " notes |\n{sep}---|");
        for p in self.sorted() {
            let m = &p.metrics;
            let o = &m.overall;
            let _ = write!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                p.system,
                p.short_policy(),
                if p.variant.is_empty() { "-" } else { &p.variant },
                p.load,
                rate(m.offered_per_s),
                rate(o.throughput_per_s),
                rate(o.goodput_per_s),
                ms(o.latency.p50_ns as f64),
                ms(o.latency.p90_ns as f64),
                ms(o.latency.p99_ns as f64),
                ms(o.latency.p999_ns as f64),
            );
            if groups.len() > 1 {
                for g in &groups {
                    let v = m
                        .group(g)
                        .map_or("-".to_string(), |x| if x.completed > 0 { ms(x.latency.p99_ns as f64) } else { "-".into() });
                    let _ = write!(s, " {v} |");
                }
            }
            if deadlines {
                for g in &groups {
                    let v = m.group(g).and_then(|x| x.miss_rate()).map_or("-".to_string(), |r| format!("{:.1}", r * 100.0));
                    let _ = write!(s, " {v} |");
                }
            }
            let _ = write!(s, " {} | {} |", ms(o.queue.p50_ns as f64), ms(o.gpu.p50_ns as f64));
            if cold {
                let _ = write!(s, " {} |", p.model_loads);
            }
            let mut notes = Vec::new();
            if p.saturated {
                notes.push("saturated".to_string());
            }
            if o.unfinished + o.rejected + o.failed > 0 {
                notes.push(format!("{} unfinished, {} refused, {} failed", o.unfinished, o.rejected, o.failed));
                if let Some(why) = &o.first_failure {
                    let short: String = why.chars().take(120).map(|c| if c == '|' { '/' } else { c }).collect();
                    notes.push(format!("first failure: {short}"));
                }
            }
            let _ = writeln!(s, " {} |", notes.join("; "));
        }
        if !self.skipped.is_empty() {
            let _ = writeln!(s, "\nNot run (past saturation): {}.", self.skipped.join(", "));
        }
        if per_model {
            let _ = writeln!(s, "\nPer model and group:\n");
            let _ = writeln!(
                s,
                "| system | policy | variant | load | model/group | done | p50 ms | p90 ms | p99 ms | p99.9 ms | queue p50 ms | GPU p50 ms | miss % |"
            );
            let _ = writeln!(s, "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
            for p in self.sorted() {
                for x in &p.metrics.models {
                    if x.requests == 0 {
                        continue;
                    }
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        p.system,
                        p.short_policy(),
                        if p.variant.is_empty() { "-" } else { &p.variant },
                        p.load,
                        x.name,
                        x.completed,
                        ms(x.latency.p50_ns as f64),
                        ms(x.latency.p90_ns as f64),
                        ms(x.latency.p99_ns as f64),
                        ms(x.latency.p999_ns as f64),
                        ms(x.queue.p50_ns as f64),
                        ms(x.gpu.p50_ns as f64),
                        x.miss_rate().map_or("-".to_string(), |r| format!("{:.1}", r * 100.0))
                    );
                }
            }
        }
        s
    }

    /// One chart per variant (PNG and SVG).
    pub fn plot(&self, dir: &Path, device: &str) -> Result<Vec<PathBuf>, Error> {
        let mut variants: Vec<&str> = self.points.iter().map(|p| p.variant.as_str()).collect();
        variants.sort();
        variants.dedup();
        let mut files = Vec::new();
        std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.display().to_string(), source: e })?;
        for v in variants {
            let pts: Vec<&Point> = self.points.iter().filter(|p| p.variant == v).collect();
            let mut by: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
            let (x_label, y_label, log_y) = match &self.headline {
                Headline::Misses => {
                    for p in &pts {
                        for g in &p.metrics.groups {
                            if let Some(r) = g.miss_rate() {
                                by.entry(format!("{} ({})", p.series(), g.name)).or_default().push((p.load, r * 100.0));
                            }
                        }
                    }
                    ("load".to_string(), "deadline misses (%)".to_string(), false)
                }
                h => {
                    for p in &pts {
                        if let Some(sm) = p.headline_summary(h).filter(|sm| sm.completed > 0) {
                            by.entry(p.series())
                                .or_default()
                                .push((p.metrics.overall.throughput_per_s, sm.latency.p99_ns as f64 / 1e6));
                        }
                    }
                    let what = match h {
                        Headline::Group(g) => format!("{g} p99 latency (ms)"),
                        Headline::Model(m) => format!("{m} p99 latency (ms)"),
                        _ => "p99 latency (ms)".into(),
                    };
                    ("throughput (requests/s)".to_string(), what, true)
                }
            };
            let series: Vec<Series> = by
                .into_iter()
                .map(|(label, mut points)| {
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    Series { label, points }
                })
                .collect();
            if series.iter().all(|s| s.points.is_empty()) {
                continue;
            }
            let title =
                if v.is_empty() { format!("{} on {device}", self.preset) } else { format!("{} ({v}) on {device}", self.preset) };
            let chart = Chart { title, x_label, y_label, series, log_y };
            let stem = if v.is_empty() { self.preset.clone() } else { format!("{}-{}", self.preset, v.replace('=', "")) };
            for ext in ["png", "svg"] {
                let f = dir.join(format!("{stem}.{ext}"));
                draw(&chart, &f).map_err(Error::Invalid)?;
                files.push(f);
            }
        }
        Ok(files)
    }
}

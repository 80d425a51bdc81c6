//! The arrival trace of one run as a file, for the peers (`scripts/peer_replay.py`) to replay the
//! very requests kairos was given, and the peers' results read back.
//!
//! Trace (`kairos-trace/1`, JSON): the run's identity (preset, variant, load, seed), its window
//! (`duration_ns`, `warmup_ns`, `drain_ns`), the models (name → zoo architecture, dtype, batch,
//! sequence length), the streams (model, class `rt`/`be`, priority, deadline, group), the sources
//! (closed-loop ones with their clients and the streams they pick from by weight), and the
//! open-loop arrivals as two columns `t_ns` and `stream`.
//!
//! Peer results (`kairos-peer/1`): per replayed trace and serving mode, the columns `stream`,
//! `arrival_ns` (scheduled, relative to the trace's time 0), `done_ns` (absent: unfinished),
//! `gpu_ns` and `closed`; [`PeerRun::outcomes`] turns them into the harness' outcomes so the very
//! same metrics code measures kairos and the peers.

use crate::Error;
use crate::runner::{Outcome, Status};
use crate::workload::{Schedule, Source, Stream};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const TRACE_FORMAT: &str = "kairos-trace/1";
pub const PEER_FORMAT: &str = "kairos-peer/1";
pub const RAW_FORMAT: &str = "kairos-raw/1";

/// Every request of one kairos run, as the generator saw it (`kairos-raw/1`), so a point's numbers
/// can be recomputed: per request its stream, scheduled arrival and outcome, times relative to the
/// run's start. `status`: `done`, `rejected`, `failed` or `unfinished`; `done_ns`, `queue_ns` and
/// `gpu_ns` are set for `done` only (`gpu_ns`: first kernel issued to completion).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RawFile {
    pub format: String,
    pub preset: String,
    pub variant: String,
    pub policy: String,
    pub load: f64,
    pub duration_ns: u64,
    pub warmup_ns: u64,
    /// Stream names, indexed by `stream`.
    pub streams: Vec<String>,
    pub stream: Vec<u32>,
    pub arrival_ns: Vec<u64>,
    pub status: Vec<String>,
    pub done_ns: Vec<Option<u64>>,
    pub queue_ns: Vec<Option<u64>>,
    pub gpu_ns: Vec<Option<u64>>,
    pub closed: Vec<bool>,
    /// The error text of failed and rejected requests.
    pub error: Vec<Option<String>>,
    /// Arrival at the dispatcher to the first logical block taken, where known (`Outcome::first_block_ns`).
    #[serde(default)]
    pub first_block_ns: Vec<Option<u64>>,
    /// Arrival at the dispatcher to the first launch call, where known (`Outcome::first_issue_ns`).
    #[serde(default)]
    pub first_issue_ns: Vec<Option<u64>>,
    /// Arrival at the dispatcher to admission, where known (`Outcome::admit_ns`).
    #[serde(default)]
    pub admit_ns: Vec<Option<u64>>,
    /// Arrival at the dispatcher to the start of the decision round that issued the first launch,
    /// where known (`Outcome::round_ns`).
    #[serde(default)]
    pub round_ns: Vec<Option<u64>>,
}

impl RawFile {
    pub fn new(preset: &str, variant: &str, policy: &str, load: f64, schedule: &Schedule, outcomes: &[Outcome]) -> RawFile {
        let mut f = RawFile {
            format: RAW_FORMAT.into(),
            preset: preset.into(),
            variant: variant.into(),
            policy: policy.into(),
            load,
            duration_ns: schedule.duration_ns,
            warmup_ns: schedule.warmup_ns,
            streams: schedule.workload.streams.iter().map(|s| s.name.clone()).collect(),
            stream: Vec::with_capacity(outcomes.len()),
            arrival_ns: Vec::with_capacity(outcomes.len()),
            status: Vec::with_capacity(outcomes.len()),
            done_ns: Vec::with_capacity(outcomes.len()),
            queue_ns: Vec::with_capacity(outcomes.len()),
            gpu_ns: Vec::with_capacity(outcomes.len()),
            closed: Vec::with_capacity(outcomes.len()),
            error: Vec::with_capacity(outcomes.len()),
            first_block_ns: Vec::with_capacity(outcomes.len()),
            first_issue_ns: Vec::with_capacity(outcomes.len()),
            admit_ns: Vec::with_capacity(outcomes.len()),
            round_ns: Vec::with_capacity(outcomes.len()),
        };
        for o in outcomes {
            f.stream.push(o.stream);
            f.arrival_ns.push(o.arrival_ns);
            f.closed.push(o.closed);
            f.first_block_ns.push(o.first_block_ns);
            f.first_issue_ns.push(o.first_issue_ns);
            f.admit_ns.push(o.admit_ns);
            f.round_ns.push(o.round_ns);
            let (status, done, queue, gpu, error) = match &o.status {
                Status::Done { done_ns, queue_ns, gpu_ns } => ("done", Some(*done_ns), Some(*queue_ns), Some(*gpu_ns), None),
                Status::Rejected(e) => ("rejected", None, None, None, Some(e.clone())),
                Status::Failed(e) => ("failed", None, None, None, Some(e.clone())),
                Status::Unfinished => ("unfinished", None, None, None, None),
            };
            f.status.push(status.into());
            f.done_ns.push(done);
            f.queue_ns.push(queue);
            f.gpu_ns.push(gpu);
            f.error.push(error);
        }
        f
    }

    pub fn write(&self, path: &Path) -> Result<(), Error> {
        write_json(path, self)
    }

    pub fn read(path: &Path) -> Result<RawFile, Error> {
        let f: RawFile = read_json(path)?;
        if f.format != RAW_FORMAT {
            return Err(Error::Invalid(format!("{}: format '{}', expected {RAW_FORMAT}", path.display(), f.format)));
        }
        Ok(f)
    }
}

/// A model as the peer must build it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceModel {
    /// The name streams use.
    pub name: String,
    /// The zoo architecture (torchvision / transformers equivalent), or "synthetic-chain".
    pub arch: String,
    pub dtype: String,
    pub batch: usize,
    pub seq_len: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Arrivals {
    pub t_ns: Vec<u64>,
    pub stream: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceFile {
    pub format: String,
    pub preset: String,
    pub variant: String,
    pub load: f64,
    pub seed: u64,
    pub duration_ns: u64,
    pub warmup_ns: u64,
    pub drain_ns: u64,
    pub models: Vec<TraceModel>,
    pub streams: Vec<Stream>,
    pub sources: Vec<Source>,
    pub arrivals: Arrivals,
}

impl TraceFile {
    pub fn new(preset: &str, variant: &str, load: f64, schedule: &Schedule, drain_ns: u64, models: Vec<TraceModel>) -> TraceFile {
        TraceFile {
            format: TRACE_FORMAT.into(),
            preset: preset.into(),
            variant: variant.into(),
            load,
            seed: schedule.seed,
            duration_ns: schedule.duration_ns,
            warmup_ns: schedule.warmup_ns,
            drain_ns,
            models,
            streams: schedule.workload.streams.clone(),
            sources: schedule.workload.sources.clone(),
            arrivals: Arrivals {
                t_ns: schedule.arrivals.iter().map(|a| a.0).collect(),
                stream: schedule.arrivals.iter().map(|a| a.1).collect(),
            },
        }
    }

    /// The schedule back (checked).
    pub fn schedule(&self) -> Result<Schedule, Error> {
        if self.format != TRACE_FORMAT {
            return Err(Error::Invalid(format!("trace format '{}', expected '{TRACE_FORMAT}'", self.format)));
        }
        if self.arrivals.t_ns.len() != self.arrivals.stream.len() {
            return Err(Error::Invalid("trace arrival columns differ in length".into()));
        }
        let workload = crate::workload::Workload { streams: self.streams.clone(), sources: self.sources.clone() };
        workload.validate().map_err(Error::Invalid)?;
        let arrivals: Vec<(u64, u32)> = self.arrivals.t_ns.iter().copied().zip(self.arrivals.stream.iter().copied()).collect();
        if arrivals.iter().any(|a| a.1 as usize >= self.streams.len() || a.0 >= self.duration_ns)
            || arrivals.windows(2).any(|w| w[0].0 > w[1].0)
        {
            return Err(Error::Invalid("trace arrivals are out of order, out of the run or name unknown streams".into()));
        }
        if self.warmup_ns >= self.duration_ns {
            return Err(Error::Invalid("trace warm-up is not shorter than its duration".into()));
        }
        Ok(Schedule { workload, duration_ns: self.duration_ns, warmup_ns: self.warmup_ns, seed: self.seed, arrivals })
    }

    pub fn write(&self, path: &Path) -> Result<(), Error> {
        write_json(path, self)
    }

    pub fn read(path: &Path) -> Result<TraceFile, Error> {
        read_json(path)
    }
}

/// One replay by a peer: one trace in one serving mode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerRun {
    /// The trace file's name (relative to the peer file's folder, or absolute).
    pub trace: String,
    /// "single", "streams4", "priority4", ...
    pub mode: String,
    pub stream: Vec<u32>,
    pub arrival_ns: Vec<u64>,
    /// Completion, relative to the trace's time 0; `None` for requests left unfinished.
    pub done_ns: Vec<Option<u64>>,
    pub gpu_ns: Vec<u64>,
    pub closed: Vec<bool>,
    #[serde(default)]
    pub wall_s: f64,
    /// When the run started, in milliseconds since the Unix epoch (see `Point::started_unix_ms`).
    #[serde(default)]
    pub started_unix_ms: Option<u64>,
}

impl PeerRun {
    pub fn outcomes(&self) -> Result<Vec<Outcome>, Error> {
        let n = self.stream.len();
        if [self.arrival_ns.len(), self.done_ns.len(), self.gpu_ns.len(), self.closed.len()].iter().any(|&l| l != n) {
            return Err(Error::Invalid(format!("peer run {} / {}: columns differ in length", self.trace, self.mode)));
        }
        Ok((0..n)
            .map(|i| {
                let arrival_ns = self.arrival_ns[i];
                let status = match self.done_ns[i] {
                    Some(d) => {
                        let latency = d.saturating_sub(arrival_ns);
                        let gpu_ns = self.gpu_ns[i].min(latency);
                        Status::Done { done_ns: d, queue_ns: latency - gpu_ns, gpu_ns }
                    }
                    None => Status::Unfinished,
                };
                Outcome {
                    stream: self.stream[i],
                    arrival_ns,
                    status,
                    closed: self.closed[i],
                    cold: false,
                    first_block_ns: None,
                    first_issue_ns: None,
                    admit_ns: None,
                    round_ns: None,
                }
            })
            .collect())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerFile {
    pub format: String,
    /// "pytorch".
    pub system: String,
    /// Version string of the peer ("2.11.0+cu130").
    pub version: String,
    pub device: String,
    pub runs: Vec<PeerRun>,
}

impl PeerFile {
    pub fn read(path: &Path) -> Result<PeerFile, Error> {
        let f: PeerFile = read_json(path)?;
        if f.format != PEER_FORMAT {
            return Err(Error::Invalid(format!("{}: format '{}', expected '{PEER_FORMAT}'", path.display(), f.format)));
        }
        Ok(f)
    }
}

pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), Error> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.display().to_string(), source: e })?;
    }
    let text = serde_json::to_string(value).map_err(|e| Error::Invalid(format!("cannot serialize {}: {e}", path.display())))?;
    std::fs::write(path, text).map_err(|e| Error::Io { path: path.display().to_string(), source: e })
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.display().to_string(), source: e })?;
    serde_json::from_str(&text).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Arrival, Stream, StreamClass, Workload};

    #[test]
    fn trace_round_trip_and_peer_outcomes() {
        let mut w = Workload::default();
        w.stream_with(Stream::new("a", "resnet18").with_class(StreamClass::Rt, "rt"), Arrival::Poisson { rate_per_s: 2000.0 });
        w.stream_with(Stream::new("b", "vgg19"), Arrival::ClosedLoop { clients: 2, think_ns: 0 });
        let s = w.schedule(100_000_000, 10_000_000, 4).unwrap();
        let models =
            vec![TraceModel { name: "resnet18".into(), arch: "resnet18".into(), dtype: "f16".into(), batch: 1, seq_len: 128 }];
        let t = TraceFile::new("custom", "", 1.0, &s, 5, models);
        let dir = std::env::temp_dir().join(format!("kairos-trace-{}", std::process::id()));
        let p = dir.join("t.json");
        t.write(&p).unwrap();
        let back = TraceFile::read(&p).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.schedule().unwrap(), s);
        let mut bad = back.clone();
        bad.arrivals.stream[0] = 9;
        assert!(bad.schedule().is_err());
        std::fs::remove_dir_all(dir).ok();

        let run = PeerRun {
            trace: "t.json".into(),
            mode: "single".into(),
            stream: vec![0, 1],
            arrival_ns: vec![100, 200],
            done_ns: vec![Some(400), None],
            gpu_ns: vec![250, 0],
            closed: vec![false, true],
            wall_s: 0.0,
            started_unix_ms: None,
        };
        let o = run.outcomes().unwrap();
        assert_eq!(o[0].status, Status::Done { done_ns: 400, queue_ns: 50, gpu_ns: 250 });
        assert_eq!(o[1].status, Status::Unfinished);
        assert!(o[1].closed);
    }
}

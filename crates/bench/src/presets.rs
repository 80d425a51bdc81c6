//! The workloads of the papers, as presets.
//!
//! | preset | models | arrivals | load 1.0 means |
//! |---|---|---|---|
//! | `paella-mix` | the 11 vision models of the zoo, uniform | one lognormal process (sigma 1.5 and 2) | serial capacity: 1 / mean isolated latency |
//! | `mix8` | 8 vision models (no resnet152, densenet201, vgg19), uniform | one lognormal process (sigma 1.5 and 2) | serial capacity: 1 / mean isolated latency |
//! | `paella-short-long` | resnet18 (tenant 0) vs inception_v3 (tenant 1), shares inverse to isolated latency | Poisson | serial capacity of the mix |
//! | `paella-hol` | jobs of 8 chained one-CTA kernels of ~300 us | Poisson | 32 streams busy: 32 / isolated latency |
//! | `disb-a`..`disb-e` | vgg19, resnet152, densenet201, inception_v3, distilbert | real-time clients at fixed rates, best-effort clients in closed loop | the DISB rates |
//! | `reef-pairs` | one real-time and one best-effort model of DISB's five, each pair a variant (`rt=vgg19,be=resnet152`; `--pairs`) | both in closed loop | no effect (closed loops) |
//! | `daris` | high priority: resnet18, mobilenet_v2, resnet50; low: googlenet, inception_v3, densenet121 | periodic, deadline = period | the GPU's throughput for this task mix, measured in closed loop |
//! | `coldstart` | 3 instances each of 8 vision models under the engine's weight budget (LRU) | Poisson, uniform over instances | serial capacity of the warm models |
//! | `deepplan-azure` | instances of bert_base, roberta_base and gpt2 in 4:4:1 (`--instances` k: 4k, 4k, k) under the weight budget | an Azure Functions trace (`--arrival azure:FILE`): function j drives the instances i with i mod F = j | serial capacity of the warm models |
//! | `custom` | `--models` (`ARCH@bN`: batch N) | `--arrival` poisson, lognormal:S, periodic, closed:N (N x load clients over all models), closed-each:N (N x load per model) or azure:FILE | `--rate` (closed: clients) |
//!
//! Sources of the parameters:
//! - Paella (SOSP'23, Ng et al.), section 6: the vision mix with lognormal inter-arrival times
//!   (sigma 1.5 and 2), short vs long jobs with shares inverse to size, jobs of 8 kernels of one CTA
//!   of ~300 us for head-of-line blocking. Loads as multiples of a capacity are kairos' axis.
//! - DISB, REEF's benchmark (OSDI'22, Han et al.): `benchmarks/workloads/workloads.md` of
//!   github.com/SJTU-IPADS/disb. A: vgg19 real-time uniform 100 req/s + resnet152 best-effort
//!   closed loop. B: vgg19 real-time closed loop + resnet152 best-effort closed loop. C: vgg19
//!   real-time uniform 100 req/s + best-effort closed loops of resnet152, densenet201, vgg19,
//!   inception_v3, distilbert. D: those five real-time, uniform 20 req/s each, + the same five
//!   best-effort closed loops. E: as D with Poisson 20 req/s. (The REEF artifact's Fig. 10 configs,
//!   github.com/SJTU-IPADS/reef-artifacts `evaluation/fig10/*.json`, use the same rates; its E replays
//!   a recorded trace instead of Poisson.) One closed-loop client per best-effort entry; DISB sets no
//!   deadlines; distilbert runs at sequence length 128 here.
//! - REEF's padding experiment (OSDI'22, section 7.4, Fig. 16): "one RT client and one BE client
//!   simultaneously send requests at a high-enough frequency to keep the GPU busy", all one-to-one
//!   combinations of the five DISB models (25 pairs), against RT-Only and GPU streams. Here each
//!   client is one closed loop; a point runs until about [`PAIR_RT_REQUESTS`] real-time requests
//!   at [`PAIR_RT_SLACK`] times the real-time model's isolated latency.
//! - DARIS (Babaei and Chantem, arXiv 2504.08795, 2025): periodic real-time DNN tasks of high and
//!   low priority, deadlines equal to periods; the paper reports zero high-priority misses and under
//!   2% low-priority misses. Its evaluation's exact task set was not available to us: the task set,
//!   the periods (6x each model's isolated latency at 100%, so equal GPU time per task), and the loads
//!   100% and 150% (the issue's) are kairos' choice. 100% is the throughput the target sustains on
//!   this task mix, measured before the sweep with 4 closed-loop clients per task under the base
//!   policy; the task set is replicated until it offers that much (a GPU runs many of these models
//!   at once: the serial utilization sum(C_i / T_i) would call a load "150%" that leaves the GPU
//!   half idle), and higher loads shorten every period (150%: 4x the isolated latency).
//! - Cold starts (DeepPlan, EuroSys'23, models beyond GPU memory): Poisson requests spread
//!   uniformly over more model instances than the budget holds, served under the dispatcher's
//!   weight budget (its residency manager, LRU), which stands in for GPU memory (the zoo's fp16
//!   weights are far smaller than an H200's 141 GB).
//! - DeepPlan's Azure serving (EuroSys'23, Sec. 5): transformer instances under the budget, arrivals
//!   from the Azure Functions 2019 trace. The issue asks for bert_base, roberta_base and gpt2 4:4:1;
//!   the authors' artifact (github.com/Sys-KU/DeepPlan, `scripts/fig14/run.sh`) runs 5 bert_base :
//!   4 roberta_base at 100 req/s with 216 instances. How functions map to instances is kairos'
//!   choice (function j drives the instances i with i mod F = j), as is load 1 (the warm models'
//!   serial capacity).

use crate::Error;
use crate::azure::AzureTrace;
use crate::runner::{Catalog, Residency};
use crate::workload::{Arrival, Source, Stream, StreamClass, Workload};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The vision models of the zoo (Paella's mix).
pub const VISION: [&str; 11] = [
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet152",
    "mobilenet_v2",
    "squeezenet1_1",
    "vgg19",
    "densenet121",
    "densenet201",
    "googlenet",
    "inception_v3",
];

/// The 8 vision models of `mix8`: the serving test that compared kairos with a PyTorch server
/// replaying CUDA graphs (the issue that built kairos' issue-ahead dispatch).
pub const MIX8: [&str; 8] =
    ["resnet18", "mobilenet_v2", "resnet34", "squeezenet1_1", "resnet50", "densenet121", "googlenet", "inception_v3"];

/// DISB's five models.
pub const DISB_MODELS: [&str; 5] = ["vgg19", "resnet152", "densenet201", "inception_v3", "distilbert"];
pub const DARIS_HIGH: [&str; 3] = ["resnet18", "mobilenet_v2", "resnet50"];
pub const DARIS_LOW: [&str; 3] = ["googlenet", "inception_v3", "densenet121"];
/// A DARIS task's period (and deadline) at load 1, in multiples of its isolated latency.
pub const DARIS_PERIOD_FACTOR: f64 = 6.0;
/// Copies of the DARIS task set at most.
pub const DARIS_REPLICAS_MAX: u32 = 256;
pub const COLDSTART_MODELS: [&str; 8] =
    ["resnet18", "resnet34", "resnet50", "mobilenet_v2", "squeezenet1_1", "googlenet", "densenet121", "inception_v3"];
/// `deepplan-azure`'s architectures and their instances per `--instances` unit (the 4:4:1
/// of bert_base, roberta_base and gpt2; DeepPlan's artifact runs its Azure figure with bert_base
/// and roberta_base instances 5:4).
pub const DEEPPLAN_AZURE_MODELS: [(&str, u32); 3] = [("bert_base", 4), ("roberta_base", 4), ("gpt2", 1)];
/// `reef-pairs`: real-time requests a point is sized for (at the isolated latency times
/// [`PAIR_RT_SLACK`], after the warm-up), unless `--duration-ms` or `--requests` says otherwise.
pub const PAIR_RT_REQUESTS: f64 = 2000.0;
/// `reef-pairs`: how much slower than alone a real-time request may run for a point still to see
/// [`PAIR_RT_REQUESTS`] of them (REEF: GPU streams slow real-time work by up to 1.70x).
pub const PAIR_RT_SLACK: f64 = 1.8;
/// `reef-pairs`: the longest point, whatever the model.
pub const PAIR_DURATION_NS_MAX: u64 = 30_000_000_000;

/// The synthetic head-of-line job's model name.
pub const HOL_MODEL: &str = "hol";
pub const HOL_KERNELS: u32 = 8;
pub const HOL_KERNEL_NS: u64 = 300_000;
/// Streams busy at `paella-hol`'s load 1 (the `streams` policy's pool).
pub const HOL_STREAMS: f64 = 32.0;

/// What a preset's plots and headline column show.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "name", rename_all = "snake_case")]
pub enum Headline {
    /// p99 latency of all requests against throughput.
    Overall,
    /// p99 latency of one metrics group against total throughput.
    Group(String),
    /// p99 latency of one model against total throughput.
    Model(String),
    /// Deadline-miss rate per group against load.
    Misses,
}

/// Options of the presets that take some (and of `custom`).
#[derive(Clone, Debug, PartialEq)]
pub struct PresetOptions {
    /// Lognormal sigmas of `paella-mix` (one variant each).
    pub sigmas: Vec<f64>,
    /// Instances per model of `coldstart`.
    pub instances: u32,
    /// `coldstart`'s weight budget as a fraction of all instances' weights (when `budget_bytes` is unset).
    pub budget_fraction: f64,
    pub budget_bytes: Option<u64>,
    pub custom: CustomSpec,
    /// `paella-mix`, `mix8`: each model's requests come from a tenant of their own (tenant i for
    /// the i-th model), so fairness between tenants (`paella`'s threshold) acts between models.
    pub tenant_per_model: bool,
    /// `disb-*`: run the variant `rt-only` instead, without the best-effort clients (REEF's RT-Only).
    pub rt_only: bool,
    /// `disb-*`: each real-time client's rate (req/s at load 1) in place of DISB's (100 for A and
    /// C, 20 for D and E); B's real-time client, a closed loop by default, becomes uniform at this
    /// rate (REEF's Table 2 runs B at 220 req/s). Variant `rt-rate=R`.
    pub disb_rt_rate_per_s: Option<f64>,
    /// `deepplan-azure`: the Azure Functions trace to replay (else `custom.arrival`'s `azure:FILE`).
    pub azure_trace: Option<std::path::PathBuf>,
    /// `reef-pairs`: the (real-time, best-effort) model pairs, one variant each (default: the 25
    /// pairs of DISB's five models); with `rt_only`, one RT-Only variant per real-time model instead.
    pub pairs: Vec<(String, String)>,
    /// `disb-*`: best-effort clients request a copy of each model that real-time clients request
    /// too (`ARCH~be`: its own weights, I/O slots and plan), so a best-effort plan variant (a
    /// block-time budget) can replace the copy's plan without touching real-time requests, and
    /// the two classes never wait for each other's slots. Variant `be-copies`.
    pub be_copies: bool,
}

/// The tag of a best-effort copy of a model (`PresetOptions::be_copies`): `vgg19~be`.
pub const BE_COPY_TAG: &str = "~be";

/// Every (real-time, best-effort) pair of DISB's five models, real-time model first in DISB's order.
pub fn disb_pairs() -> Vec<(String, String)> {
    DISB_MODELS.iter().flat_map(|rt| DISB_MODELS.iter().map(move |be| (rt.to_string(), be.to_string()))).collect()
}

/// `reef-pairs`' `--pairs`: comma-separated `RT+BE` (zoo architectures), where `*` on either side
/// stands for each of DISB's five models (`vgg19+*`: vgg19 real-time against each of them).
pub fn parse_pairs(spec: &str) -> Result<Vec<(String, String)>, Error> {
    let mut out: Vec<(String, String)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (rt, be) = part
            .split_once('+')
            .filter(|(a, b)| !a.is_empty() && !b.is_empty())
            .ok_or_else(|| Error::Invalid(format!("--pairs: '{part}' is not RT+BE (e.g. vgg19+resnet152, vgg19+*)")))?;
        let side = |m: &str| -> Vec<String> {
            if m == "*" { DISB_MODELS.iter().map(|s| s.to_string()).collect() } else { vec![m.to_string()] }
        };
        for r in side(rt) {
            for b in side(be) {
                if !out.contains(&(r.clone(), b.clone())) {
                    out.push((r.clone(), b));
                }
            }
        }
    }
    if out.is_empty() {
        return Err(Error::Invalid("--pairs: no pair given".into()));
    }
    Ok(out)
}

impl Default for PresetOptions {
    fn default() -> Self {
        PresetOptions {
            sigmas: vec![1.5, 2.0],
            instances: 3,
            budget_fraction: 1.0 / 3.0,
            budget_bytes: None,
            custom: CustomSpec::default(),
            tenant_per_model: false,
            rt_only: false,
            disb_rt_rate_per_s: None,
            azure_trace: None,
            pairs: disb_pairs(),
            be_copies: false,
        }
    }
}

/// A workload from the command line.
#[derive(Clone, Debug, PartialEq)]
pub struct CustomSpec {
    pub models: Vec<String>,
    /// `poisson`, `lognormal:SIGMA`, `periodic`, `closed:CLIENTS` (clients over all models),
    /// `closed-each:CLIENTS` (clients per model, each sending its model only), or `azure:FILE.csv`.
    pub arrival: String,
    /// Requests per second at load 1 (all models together).
    pub rate_per_s: f64,
    pub class: StreamClass,
    pub deadline_ns: Option<u64>,
    /// Azure replay: functions kept (busiest first) and minutes replayed (from the first).
    pub functions: usize,
    pub minutes: Option<usize>,
    /// How long one replayed minute lasts in the benchmark.
    pub minute_ns: u64,
}

impl Default for CustomSpec {
    fn default() -> Self {
        CustomSpec {
            models: vec!["resnet50".into()],
            arrival: "poisson".into(),
            rate_per_s: 100.0,
            class: StreamClass::Be,
            deadline_ns: None,
            functions: 16,
            minutes: None,
            minute_ns: 1_000_000_000,
        }
    }
}

/// How long each point runs by default.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Length {
    /// About this many open-loop requests at the point's offered rate.
    Requests(usize),
    /// This long.
    DurationNs(u64),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Preset {
    PaellaMix,
    Mix8,
    PaellaShortLong,
    PaellaHol,
    /// 'a' to 'e'.
    Disb(char),
    Daris,
    Coldstart,
    /// DeepPlan's Azure-trace serving (EuroSys'23, Sec. 5): instances of three transformers under
    /// a weight budget, arrivals from the Azure Functions trace.
    DeepPlanAzure,
    /// REEF's padding experiment (section 7.4): one real-time and one best-effort closed loop.
    ReefPairs,
    Custom,
}

/// Isolated latency (one request alone) of each model the preset needs, measured on the target.
pub type Isolated = BTreeMap<String, u64>;

/// What the workloads of a preset are scaled by, measured on the target before the sweep.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    pub isolated: Isolated,
    /// Requests per second the target completes on the preset's capacity workload (DARIS).
    pub capacity_per_s: Option<f64>,
}

impl Preset {
    pub const NAMES: [&'static str; 14] = [
        "paella-mix",
        "mix8",
        "paella-short-long",
        "paella-hol",
        "disb-a",
        "disb-b",
        "disb-c",
        "disb-d",
        "disb-e",
        "daris",
        "coldstart",
        "deepplan-azure",
        "reef-pairs",
        "custom",
    ];

    pub fn by_name(name: &str) -> Option<Preset> {
        Some(match name {
            "paella-mix" => Preset::PaellaMix,
            "mix8" => Preset::Mix8,
            "paella-short-long" => Preset::PaellaShortLong,
            "paella-hol" => Preset::PaellaHol,
            "disb-a" => Preset::Disb('a'),
            "disb-b" => Preset::Disb('b'),
            "disb-c" => Preset::Disb('c'),
            "disb-d" => Preset::Disb('d'),
            "disb-e" => Preset::Disb('e'),
            "daris" => Preset::Daris,
            "coldstart" => Preset::Coldstart,
            "deepplan-azure" => Preset::DeepPlanAzure,
            "reef-pairs" => Preset::ReefPairs,
            "custom" => Preset::Custom,
            _ => return None,
        })
    }

    pub fn name(&self) -> String {
        match self {
            Preset::PaellaMix => "paella-mix".into(),
            Preset::Mix8 => "mix8".into(),
            Preset::PaellaShortLong => "paella-short-long".into(),
            Preset::PaellaHol => "paella-hol".into(),
            Preset::Disb(c) => format!("disb-{c}"),
            Preset::Daris => "daris".into(),
            Preset::Coldstart => "coldstart".into(),
            Preset::DeepPlanAzure => "deepplan-azure".into(),
            Preset::ReefPairs => "reef-pairs".into(),
            Preset::Custom => "custom".into(),
        }
    }

    pub fn about(&self) -> String {
        match self {
            Preset::PaellaMix => "Paella (b): uniform mix of the 11 vision models, lognormal inter-arrival times".into(),
            Preset::Mix8 => format!("uniform mix of 8 vision models ({}), lognormal inter-arrival times", MIX8.join(", ")),
            Preset::PaellaShortLong => {
                "Paella (c): resnet18 (short) vs inception_v3 (long), shares inverse to size, Poisson".into()
            }
            Preset::PaellaHol => {
                "Paella (a): jobs of 8 chained one-CTA kernels of ~300 us, Poisson (head-of-line blocking)".into()
            }
            Preset::Disb(c) => format!("REEF's DISB workload {}: {}", c.to_ascii_uppercase(), disb_text(*c)),
            Preset::Daris => "DARIS: periodic high- and low-priority real-time tasks, deadlines = periods".into(),
            Preset::Coldstart => {
                "cold starts: Poisson requests over more model instances than fit the memory budget (LRU)".into()
            }
            Preset::DeepPlanAzure => {
                "DeepPlan: bert_base, roberta_base, gpt2 instances 4:4:1 under the memory budget, Azure Functions trace arrivals"
                    .into()
            }
            Preset::ReefPairs => {
                "REEF's padding experiment: one real-time and one best-effort closed loop, pairs of DISB's models".into()
            }
            Preset::Custom => "a workload from --models, --arrival and --rate".into(),
        }
    }

    /// What "load" means for the preset.
    pub fn load_meaning(&self) -> &'static str {
        match self {
            Preset::PaellaMix | Preset::Mix8 | Preset::PaellaShortLong => {
                "multiple of the serial capacity (1 / mean isolated latency)"
            }
            Preset::PaellaHol => "fraction of the rate that keeps 32 streams busy",
            Preset::Disb(_) => "multiple of DISB's real-time rates (best-effort clients stay closed-loop)",
            Preset::Daris => "fraction of the GPU's measured throughput on this task mix (closed loop, base policy)",
            Preset::Coldstart | Preset::DeepPlanAzure => "multiple of the warm models' serial capacity",
            Preset::ReefPairs => "none (both clients are closed loops)",
            Preset::Custom => "multiple of --rate",
        }
    }

    /// The zoo architectures (or [`HOL_MODEL`]) the preset needs.
    pub fn archs(&self, opts: &PresetOptions) -> Vec<String> {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect();
        match self {
            Preset::PaellaMix => v(&VISION),
            Preset::Mix8 => v(&MIX8),
            Preset::PaellaShortLong => v(&["resnet18", "inception_v3"]),
            Preset::PaellaHol => v(&[HOL_MODEL]),
            Preset::Disb(c) => {
                let mut archs = v(if matches!(c, 'a' | 'b') { &["vgg19", "resnet152"] } else { &DISB_MODELS });
                if opts.be_copies && !opts.rt_only {
                    archs.extend(self.best_effort_only_archs(true).into_iter().filter(|m| m.ends_with(BE_COPY_TAG)));
                }
                archs
            }
            Preset::Daris => DARIS_HIGH.iter().chain(DARIS_LOW.iter()).map(|s| s.to_string()).collect(),
            Preset::Coldstart => v(&COLDSTART_MODELS),
            Preset::DeepPlanAzure => DEEPPLAN_AZURE_MODELS.iter().map(|(m, _)| m.to_string()).collect(),
            Preset::ReefPairs => {
                let mut archs: Vec<String> = Vec::new();
                for (rt, be) in &opts.pairs {
                    // RT-Only runs load the real-time models alone.
                    let wanted: &[&String] = if opts.rt_only { &[rt] } else { &[rt, be] };
                    for &m in wanted {
                        if !archs.contains(m) {
                            archs.push(m.clone());
                        }
                    }
                }
                archs
            }
            Preset::Custom => opts.custom.models.clone(),
        }
    }

    /// Models only best-effort clients of a DISB preset request (its best-effort models that none
    /// of its real-time clients use; with `be_copies`, every best-effort model, shared ones as
    /// their `~be` copies): the ones a best-effort plan variant may replace without touching
    /// real-time requests. Empty for the other presets.
    pub fn best_effort_only_archs(&self, be_copies: bool) -> Vec<String> {
        let Preset::Disb(c) = self else { return Vec::new() };
        let mut w = Workload::default();
        if disb(&mut w, *c, 1.0, true, None, be_copies).is_err() {
            return Vec::new();
        }
        let of = |class: StreamClass| w.streams.iter().filter(move |s| s.class == class).map(|s| s.model.clone());
        let rt: Vec<String> = of(StreamClass::Rt).collect();
        let mut be: Vec<String> = of(StreamClass::Be).filter(|m| !rt.contains(m)).collect();
        be.dedup();
        be
    }

    pub fn default_loads(&self) -> Vec<f64> {
        match self {
            Preset::PaellaMix | Preset::Mix8 => vec![0.5, 1.0, 1.5, 2.0, 3.0, 4.0],
            Preset::PaellaShortLong => vec![0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
            Preset::PaellaHol => vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
            Preset::Disb('b') | Preset::ReefPairs => vec![1.0],
            Preset::Disb(_) => vec![0.1, 0.25, 0.5, 1.0],
            Preset::Daris => vec![1.0, 1.5],
            Preset::Coldstart | Preset::DeepPlanAzure => vec![0.25, 0.5, 1.0],
            Preset::Custom => vec![0.5, 1.0],
        }
    }

    pub fn default_policies(&self) -> Vec<&'static str> {
        match self {
            Preset::PaellaMix | Preset::Mix8 | Preset::PaellaShortLong => {
                vec!["fifo", "streams", "streams-kernel", "paella", "sjf", "rr"]
            }
            Preset::PaellaHol => vec!["streams", "paella"],
            Preset::Disb(_) => vec!["seq", "streams", "paella", "reef"],
            Preset::ReefPairs => vec!["reef", "streams"],
            Preset::Daris => vec!["fifo", "streams", "paella", "sjf"],
            Preset::Coldstart | Preset::DeepPlanAzure | Preset::Custom => vec!["streams", "paella"],
        }
    }

    pub fn default_length(&self) -> Length {
        match self {
            Preset::PaellaMix
            | Preset::Mix8
            | Preset::PaellaShortLong
            | Preset::PaellaHol
            | Preset::Coldstart
            | Preset::DeepPlanAzure => Length::Requests(2000),
            Preset::Disb(_) | Preset::Custom => Length::DurationNs(2_000_000_000),
            // Sized per variant by `variant_duration_ns` (2 s where it cannot tell).
            Preset::ReefPairs => Length::Requests(PAIR_RT_REQUESTS as usize),
            Preset::Daris => Length::DurationNs(3_000_000_000),
        }
    }

    pub fn headline(&self) -> Headline {
        match self {
            Preset::PaellaShortLong => Headline::Model("resnet18".into()),
            Preset::Disb(_) | Preset::ReefPairs => Headline::Group("rt".into()),
            Preset::Daris => Headline::Misses,
            _ => Headline::Overall,
        }
    }

    /// Variants run side by side (paella-mix: one per sigma); "" when there is one.
    pub fn variants(&self, opts: &PresetOptions) -> Vec<String> {
        match self {
            Preset::PaellaMix | Preset::Mix8 => opts
                .sigmas
                .iter()
                .map(|s| format!("sigma={s}{}", if opts.tenant_per_model { ",tenant-per-model" } else { "" }))
                .collect(),
            Preset::Disb(_) => {
                let mut parts = Vec::new();
                if opts.rt_only {
                    parts.push("rt-only".to_string());
                }
                if let Some(r) = opts.disb_rt_rate_per_s {
                    parts.push(format!("rt-rate={r}"));
                }
                if opts.be_copies && !opts.rt_only {
                    parts.push("be-copies".to_string());
                }
                vec![parts.join(",")]
            }
            Preset::ReefPairs if opts.rt_only => {
                let mut v: Vec<String> = Vec::new();
                for (rt, _) in &opts.pairs {
                    let name = format!("rt={rt},rt-only");
                    if !v.contains(&name) {
                        v.push(name);
                    }
                }
                v
            }
            Preset::ReefPairs => opts.pairs.iter().map(|(rt, be)| format!("rt={rt},be={be}")).collect(),
            _ => vec![String::new()],
        }
    }

    /// How long a point of `variant` runs when the preset sizes it itself (no `--duration-ms`):
    /// `reef-pairs`, [`PAIR_RT_REQUESTS`] real-time requests at [`PAIR_RT_SLACK`] times the
    /// real-time model's isolated latency, over the measured fraction of the run.
    pub fn variant_duration_ns(&self, variant: &str, calib: &Calibration, warmup_fraction: f64) -> Option<u64> {
        let Preset::ReefPairs = self else { return None };
        let rt = variant.split(',').find_map(|p| p.strip_prefix("rt="))?;
        let iso_ns = *calib.isolated.get(rt)? as f64;
        let measured = (1.0 - warmup_fraction.clamp(0.0, 0.9)).max(0.1);
        Some(((PAIR_RT_REQUESTS * PAIR_RT_SLACK * iso_ns / measured) as u64).min(PAIR_DURATION_NS_MAX))
    }

    /// Whether the sweep measures its models' isolated latencies first: workloads built from them,
    /// slowdowns, and for DISB REEF's normalised best-effort throughput (`scripts/reef_table.py`:
    /// best-effort completions weighted by their model's isolated latency over the real-time one's).
    pub fn needs_isolated(&self) -> bool {
        matches!(
            self,
            Preset::PaellaMix
                | Preset::Mix8
                | Preset::PaellaShortLong
                | Preset::PaellaHol
                | Preset::Daris
                | Preset::Coldstart
                | Preset::DeepPlanAzure
                | Preset::Disb(_)
                | Preset::ReefPairs
        )
    }

    /// The closed-loop workload whose throughput defines load 1 (DARIS: its tasks, in their
    /// shares, 4 clients per task), if the preset has one.
    pub fn capacity_workload(&self, calib: &Calibration) -> Result<Option<Workload>, Error> {
        match self {
            Preset::Daris => {
                let mut w = Workload::default();
                let mut streams = Vec::new();
                for (i, m) in DARIS_HIGH.iter().chain(DARIS_LOW.iter()).enumerate() {
                    let c =
                        calib.isolated.get(*m).copied().ok_or_else(|| Error::Invalid(format!("no isolated latency for {m}")))?;
                    streams.push((w.stream(Stream::new(&format!("{m}-{i}"), m)), 1.0 / c.max(1) as f64));
                }
                let clients = 4 * streams.len() as u32;
                w.sources.push(Source { arrival: Arrival::ClosedLoop { clients, think_ns: 0 }, streams });
                Ok(Some(w))
            }
            _ => Ok(None),
        }
    }

    /// The workload at `load` for `variant`, and how models are kept resident.
    pub fn workload(
        &self,
        load: f64,
        variant: &str,
        calib: &Calibration,
        catalog: &Catalog,
        opts: &PresetOptions,
    ) -> Result<(Workload, Residency), Error> {
        if !(load.is_finite() && load > 0.0) {
            return Err(Error::Invalid(format!("load {load} must be positive")));
        }
        let isolated = &calib.isolated;
        let iso = |m: &str| -> Result<f64, Error> {
            isolated
                .get(m)
                .map(|&v| v.max(1) as f64)
                .ok_or_else(|| Error::Invalid(format!("no isolated latency measured for {m}")))
        };
        let mut w = Workload::default();
        let mut residency = Residency::All;
        match self {
            Preset::PaellaMix | Preset::Mix8 => {
                let models: &[&str] = if *self == Preset::Mix8 { &MIX8 } else { &VISION };
                let (sigma_text, per_model) = match variant.split_once(',') {
                    Some((s, "tenant-per-model")) => (s, true),
                    Some(_) => (variant, false),
                    None => (variant, false),
                };
                let sigma: f64 = sigma_text.strip_prefix("sigma=").and_then(|s| s.parse().ok()).ok_or_else(|| {
                    Error::Invalid(format!("{} variant '{variant}' is not sigma=S[,tenant-per-model]", self.name()))
                })?;
                let mean = models.iter().map(|m| iso(m)).sum::<Result<f64, Error>>()? / models.len() as f64;
                let streams: Vec<(u32, f64)> = models
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        let tenant = if per_model { i as u32 } else { 0 };
                        (w.stream(Stream::new(m, m).with_tenant(tenant)), 1.0)
                    })
                    .collect();
                w.sources.push(Source { arrival: Arrival::LogNormal { rate_per_s: load * 1e9 / mean, sigma }, streams });
            }
            Preset::PaellaShortLong => {
                let (ls, ll) = (iso("resnet18")?, iso("inception_v3")?);
                let (ws, wl) = (1.0 / ls, 1.0 / ll);
                let (ps, pl) = (ws / (ws + wl), wl / (ws + wl));
                let capacity = 1e9 / (ps * ls + pl * ll);
                let s = w.stream(Stream::new("resnet18", "resnet18").with_tenant(0).with_class(StreamClass::Be, "short"));
                let l = w.stream(Stream::new("inception_v3", "inception_v3").with_tenant(1).with_class(StreamClass::Be, "long"));
                w.sources
                    .push(Source { arrival: Arrival::Poisson { rate_per_s: load * capacity }, streams: vec![(s, ps), (l, pl)] });
            }
            Preset::PaellaHol => {
                let capacity = HOL_STREAMS * 1e9 / iso(HOL_MODEL)?;
                w.stream_with(Stream::new(HOL_MODEL, HOL_MODEL), Arrival::Poisson { rate_per_s: load * capacity });
            }
            Preset::Disb(c) => {
                let (mut with_be, mut rt_rate, mut be_copies) = (true, None, false);
                for part in variant.split(',').filter(|p| !p.is_empty()) {
                    match part.split_once('=') {
                        None if part == "rt-only" => with_be = false,
                        None if part == "be-copies" => be_copies = true,
                        Some(("rt-rate", r)) => {
                            rt_rate = Some(r.parse::<f64>().ok().filter(|r| r.is_finite() && *r > 0.0).ok_or_else(|| {
                                Error::Invalid(format!("disb variant '{variant}': rt-rate '{r}' is not a positive rate"))
                            })?)
                        }
                        _ => {
                            return Err(Error::Invalid(format!(
                                "disb variant '{variant}': '{part}' is not rt-only, rt-rate=R or be-copies (comma-separated)"
                            )));
                        }
                    }
                }
                disb(&mut w, *c, load, with_be, rt_rate, be_copies)?
            }
            Preset::Daris => {
                let capacity = calib
                    .capacity_per_s
                    .ok_or_else(|| Error::Invalid("daris: the GPU's throughput on the task mix was not measured".into()))?;
                // Each task's period is DARIS_PERIOD_FACTOR x its isolated latency at load 1 (equal GPU
                // time per task); the task set is replicated until it offers the measured capacity.
                let base_per_s: f64 = DARIS_HIGH
                    .iter()
                    .chain(DARIS_LOW.iter())
                    .map(|m| iso(m).map(|c| 1e9 / (DARIS_PERIOD_FACTOR * c)))
                    .sum::<Result<f64, Error>>()?;
                let replicas = (capacity / base_per_s).round().clamp(1.0, DARIS_REPLICAS_MAX as f64) as u32;
                let scale = capacity / (replicas as f64 * base_per_s);
                for (models, group, priority) in [(&DARIS_HIGH, "hp", 1), (&DARIS_LOW, "lp", 0)] {
                    for m in models.iter() {
                        let period_ns = (DARIS_PERIOD_FACTOR * iso(m)? / (load * scale)).round() as u64;
                        for r in 0..replicas {
                            w.stream_with(
                                Stream::new(&format!("{m}-{group}-{r}"), m)
                                    .with_class(StreamClass::Rt, group)
                                    .with_priority(priority)
                                    .with_deadline_ns(period_ns),
                                Arrival::Periodic { period_ns, phase_ns: None },
                            );
                        }
                    }
                }
            }
            Preset::Coldstart => {
                let mean = COLDSTART_MODELS.iter().map(|m| iso(m)).sum::<Result<f64, Error>>()? / COLDSTART_MODELS.len() as f64;
                let mut streams = Vec::new();
                let mut total_bytes = 0u64;
                for (m, k) in instances_of(self, opts.instances) {
                    let name = instance_name(m, k);
                    total_bytes += catalog.weight_bytes(m)?;
                    streams.push((w.stream(Stream::new(&name, &name)), 1.0));
                }
                w.sources.push(Source { arrival: Arrival::Poisson { rate_per_s: load * 1e9 / mean }, streams });
                let budget_bytes = opts.budget_bytes.unwrap_or((total_bytes as f64 * opts.budget_fraction) as u64);
                residency = Residency::Budget { weight_bytes: budget_bytes };
            }
            Preset::DeepPlanAzure => residency = deepplan_azure(&mut w, load, catalog, opts, &iso)?,
            Preset::ReefPairs => reef_pair(&mut w, variant)?,
            Preset::Custom => custom(&mut w, &opts.custom, load)?,
        }
        w.validate().map_err(Error::Invalid)?;
        Ok((w, residency))
    }
}

/// The instance names of the coldstart preset ("resnet50.2").
pub fn instance_name(model: &str, k: u32) -> String {
    format!("{model}.{k}")
}

/// The instances a preset serves, as (architecture, instance index): `coldstart`'s and
/// `deepplan-azure`'s (interleaved 4 bert_base, 4 roberta_base, 1 gpt2 per unit), none for the others.
pub fn instances_of(preset: &Preset, instances: u32) -> Vec<(&'static str, u32)> {
    let units = instances.max(1);
    match preset {
        Preset::Coldstart => COLDSTART_MODELS.iter().flat_map(|&m| (0..units).map(move |k| (m, k))).collect(),
        Preset::DeepPlanAzure => (0..units)
            .flat_map(|u| DEEPPLAN_AZURE_MODELS.iter().flat_map(move |&(m, n)| (0..n).map(move |j| (m, u * n + j))))
            .collect(),
        _ => Vec::new(),
    }
}

/// Adds a preset's instances ([`instances_of`]) to a catalog holding the architectures.
pub fn add_instances(catalog: &mut Catalog, preset: &Preset, instances: u32) -> Result<(), Error> {
    for (m, k) in instances_of(preset, instances) {
        let spec = catalog.get(m)?.clone();
        catalog.insert_as(&instance_name(m, k), &spec);
    }
    Ok(())
}

/// `deepplan-azure`: the instances under a weight budget, driven by the Azure trace of
/// `opts.custom` (`azure:FILE`, its busiest `functions`, `minutes` of `minute_ns` each); function j
/// of F drives the instances i with i mod F = j (uniform among them), so every instance is asked
/// and the trace's skew and bursts fall on groups of instances; load 1 is the warm models' serial
/// capacity.
fn deepplan_azure(
    w: &mut Workload,
    load: f64,
    catalog: &Catalog,
    opts: &PresetOptions,
    iso: &dyn Fn(&str) -> Result<f64, Error>,
) -> Result<Residency, Error> {
    let c = &opts.custom;
    let file = match (&opts.azure_trace, c.arrival.strip_prefix("azure:")) {
        (Some(f), _) => f.clone(),
        (None, Some(f)) => f.into(),
        (None, None) => {
            return Err(Error::Invalid(format!(
                "deepplan-azure replays an Azure Functions trace: --arrival azure:FILE.csv, not '{}'",
                c.arrival
            )));
        }
    };
    let trace = AzureTrace::load(&file).map_err(Error::Invalid)?;
    let instances = instances_of(&Preset::DeepPlanAzure, opts.instances);
    let mut total_bytes = 0u64;
    let mut mean_ns = 0.0;
    let mut streams = Vec::with_capacity(instances.len());
    for &(m, k) in &instances {
        let name = instance_name(m, k);
        total_bytes += catalog.weight_bytes(m)?;
        mean_ns += iso(m)? / instances.len() as f64;
        streams.push(w.stream(Stream::new(&name, &name)));
    }
    let functions = c.functions.min(trace.functions.len()).max(1);
    let minutes = c.minutes.unwrap_or(trace.minutes()).min(trace.minutes());
    let mut sources = trace.sources(functions, 0, minutes, c.minute_ns, load * 1e9 / mean_ns, |_| 0).map_err(Error::Invalid)?;
    let f = sources.len();
    for (j, source) in sources.iter_mut().enumerate() {
        let mine: Vec<(u32, f64)> = (0..streams.len()).filter(|i| i % f == j).map(|i| (streams[i], 1.0)).collect();
        source.streams = if mine.is_empty() { vec![(streams[j % streams.len()], 1.0)] } else { mine };
    }
    w.sources.extend(sources);
    let budget_bytes = opts.budget_bytes.unwrap_or((total_bytes as f64 * opts.budget_fraction) as u64);
    Ok(Residency::Budget { weight_bytes: budget_bytes })
}

fn disb_text(c: char) -> &'static str {
    match c {
        'a' => "vgg19 real-time at 100 req/s, resnet152 best-effort closed loop",
        'b' => "vgg19 real-time closed loop, resnet152 best-effort closed loop",
        'c' => "vgg19 real-time at 100 req/s, five best-effort closed loops",
        'd' => "five models real-time at 20 req/s each (uniform), five best-effort closed loops",
        'e' => "five models real-time at 20 req/s each (Poisson), five best-effort closed loops",
        _ => "unknown",
    }
}

/// DISB workload `c` at `load`; `with_be` false leaves out its best-effort clients (RT-Only);
/// `rt_rate` replaces each real-time client's rate (and makes B's uniform); `be_copies` has the
/// best-effort clients of a model the real-time ones request too ask for its copy
/// (`ARCH~be`, [`BE_COPY_TAG`]). Streams keep their names (`M-rt`, `M-be`).
fn disb(w: &mut Workload, c: char, load: f64, with_be: bool, rt_rate: Option<f64>, be_copies: bool) -> Result<(), Error> {
    let rt = |m: &str| Stream::new(&format!("{m}-rt"), m).with_class(StreamClass::Rt, "rt").with_priority(1);
    let uniform = |rate: f64| {
        let rate = rt_rate.unwrap_or(rate);
        Arrival::Periodic { period_ns: (1e9 / (rate * load)).round() as u64, phase_ns: None }
    };
    let closed = Arrival::ClosedLoop { clients: 1, think_ns: 0 };
    let be_models: &[&str] = match c {
        'a' => {
            w.stream_with(rt("vgg19"), uniform(100.0));
            &["resnet152"]
        }
        'b' => {
            w.stream_with(
                rt("vgg19"),
                match rt_rate {
                    Some(r) => uniform(r),
                    None => closed.clone(),
                },
            );
            &["resnet152"]
        }
        'c' => {
            w.stream_with(rt("vgg19"), uniform(100.0));
            &DISB_BE
        }
        'd' | 'e' => {
            for m in DISB_BE {
                let a = if c == 'd' { uniform(20.0) } else { Arrival::Poisson { rate_per_s: rt_rate.unwrap_or(20.0) * load } };
                w.stream_with(rt(m), a);
            }
            &DISB_BE
        }
        _ => return Err(Error::Invalid(format!("DISB has workloads a to e, not '{c}'"))),
    };
    if with_be {
        let rt_models: Vec<String> = w.streams.iter().map(|s| s.model.clone()).collect();
        for m in be_models {
            let model = if be_copies && rt_models.iter().any(|r| r == m) { format!("{m}{BE_COPY_TAG}") } else { m.to_string() };
            w.stream_with(Stream::new(&format!("{m}-be"), &model).with_class(StreamClass::Be, "be"), closed.clone());
        }
    }
    Ok(())
}

/// `reef-pairs` variant `rt=M,be=N` (or `rt=M,rt-only`): a real-time closed loop of M and a
/// best-effort closed loop of N (REEF section 7.4), streams named as DISB's (`M-rt`, `N-be`).
fn reef_pair(w: &mut Workload, variant: &str) -> Result<(), Error> {
    let (mut rt, mut be, mut rt_only) = (None, None, false);
    for part in variant.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some(("rt", m)) if !m.is_empty() => rt = Some(m),
            Some(("be", m)) if !m.is_empty() => be = Some(m),
            None if part == "rt-only" => rt_only = true,
            _ => return Err(Error::Invalid(format!("reef-pairs variant '{variant}': '{part}' is not rt=M, be=M or rt-only"))),
        }
    }
    let closed = Arrival::ClosedLoop { clients: 1, think_ns: 0 };
    let rt = rt.ok_or_else(|| Error::Invalid(format!("reef-pairs variant '{variant}' names no rt=MODEL")))?;
    w.stream_with(Stream::new(&format!("{rt}-rt"), rt).with_class(StreamClass::Rt, "rt").with_priority(1), closed.clone());
    match (be, rt_only) {
        (Some(be), false) => {
            w.stream_with(Stream::new(&format!("{be}-be"), be).with_class(StreamClass::Be, "be"), closed);
        }
        (None, true) => {}
        _ => {
            return Err(Error::Invalid(format!(
                "reef-pairs variant '{variant}': give be=MODEL, or rt-only for the real-time client alone"
            )));
        }
    }
    Ok(())
}

/// DISB's best-effort clients of workloads C to E (and its real-time ones of D and E), in its order.
const DISB_BE: [&str; 5] = ["resnet152", "densenet201", "vgg19", "inception_v3", "distilbert"];

fn custom(w: &mut Workload, c: &CustomSpec, load: f64) -> Result<(), Error> {
    if c.models.is_empty() {
        return Err(Error::Invalid("custom workload: --models is empty".into()));
    }
    let rate = c.rate_per_s * load;
    let group = c.class.label();
    let streams: Vec<(u32, f64)> = c
        .models
        .iter()
        .map(|m| {
            let mut s = Stream::new(m, m).with_class(c.class, group);
            s.deadline_ns = c.deadline_ns;
            (w.stream(s), 1.0)
        })
        .collect();
    let (kind, arg) = c.arrival.split_once(':').unwrap_or((c.arrival.as_str(), ""));
    let bad = |what: &str| Error::Invalid(format!("custom arrival '{}': {what}", c.arrival));
    match kind {
        "poisson" => w.sources.push(Source { arrival: Arrival::Poisson { rate_per_s: rate }, streams }),
        "lognormal" => {
            let sigma: f64 = arg.parse().map_err(|_| bad("use lognormal:SIGMA"))?;
            w.sources.push(Source { arrival: Arrival::LogNormal { rate_per_s: rate, sigma }, streams });
        }
        "periodic" => {
            let per = rate / streams.len() as f64;
            for (s, _) in streams {
                w.sources.push(Source::one(Arrival::Periodic { period_ns: (1e9 / per).round() as u64, phase_ns: None }, s));
            }
        }
        "closed" => {
            // The load multiplies the clients (KRISP's 1, 2 and 4 workers are loads 1, 2, 4 of closed:1).
            let clients: u32 = arg.parse().map_err(|_| bad("use closed:CLIENTS"))?;
            let clients = ((clients as f64 * load).round() as u32).max(1);
            w.sources.push(Source { arrival: Arrival::ClosedLoop { clients, think_ns: 0 }, streams });
        }
        "closed-each" => {
            // CLIENTS x load closed-loop clients per model, each sending only its model's requests
            // (KRISP's pairs of different models: one worker per model).
            let clients: u32 = arg.parse().map_err(|_| bad("use closed-each:CLIENTS"))?;
            let clients = ((clients as f64 * load).round() as u32).max(1);
            for (s, _) in streams {
                w.sources.push(Source::one(Arrival::ClosedLoop { clients, think_ns: 0 }, s));
            }
        }
        "azure" => {
            let trace = AzureTrace::load(std::path::Path::new(arg)).map_err(Error::Invalid)?;
            let minutes = c.minutes.unwrap_or(trace.minutes()).min(trace.minutes());
            // Each replayed minute lasts `minute_ns` of the benchmark; the run's duration decides how
            // many are replayed (they repeat when it is longer).
            let n = streams.len();
            let sources = trace
                .sources(c.functions.min(trace.functions.len()), 0, minutes, c.minute_ns, rate, |k| streams[k % n].0)
                .map_err(Error::Invalid)?;
            w.sources.extend(sources);
        }
        _ => return Err(bad("use poisson, lognormal:SIGMA, periodic, closed:CLIENTS, closed-each:CLIENTS or azure:FILE.csv")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iso_all() -> Calibration {
        Calibration {
            isolated: VISION
                .iter()
                .chain(DISB_MODELS.iter())
                .chain([HOL_MODEL].iter())
                .map(|m| (m.to_string(), 10_000_000))
                .collect(),
            capacity_per_s: Some(400.0),
        }
    }

    #[test]
    fn best_effort_only_models_are_requested_by_best_effort_streams_alone() {
        let opts = PresetOptions::default();
        for name in ["disb-a", "disb-b", "disb-c", "disb-d", "disb-e"] {
            let p = Preset::by_name(name).unwrap();
            let (w, _) = p.workload(1.0, &p.variants(&opts)[0], &iso_all(), &Catalog::default(), &opts).unwrap();
            let with = |class: StreamClass| -> Vec<&str> {
                w.streams.iter().filter(|s| s.class == class).map(|s| s.model.as_str()).collect()
            };
            let (rt, be) = (with(StreamClass::Rt), with(StreamClass::Be));
            let mut want: Vec<&str> = be.iter().copied().filter(|m| !rt.contains(m)).collect();
            want.sort_unstable();
            want.dedup();
            let mut got = p.best_effort_only_archs(false);
            got.sort_unstable();
            assert_eq!(got, want, "{name}");
        }
        assert_eq!(Preset::Disb('a').best_effort_only_archs(false), ["resnet152"]);
        assert_eq!(Preset::Disb('c').best_effort_only_archs(false).len(), 4);
        assert!(Preset::Disb('e').best_effort_only_archs(false).is_empty());
    }

    #[test]
    fn best_effort_copies_separate_the_classes_models() {
        let opts = PresetOptions { be_copies: true, ..PresetOptions::default() };
        for (name, copies) in [("disb-a", 0), ("disb-b", 0), ("disb-c", 1), ("disb-d", 5), ("disb-e", 5)] {
            let p = Preset::by_name(name).unwrap();
            let variant = &p.variants(&opts)[0];
            assert_eq!(variant, "be-copies", "{name}");
            let (w, _) = p.workload(1.0, variant, &iso_all(), &Catalog::default(), &opts).unwrap();
            let models = |class: StreamClass| -> Vec<&str> {
                w.streams.iter().filter(|s| s.class == class).map(|s| s.model.as_str()).collect()
            };
            let (rt, be) = (models(StreamClass::Rt), models(StreamClass::Be));
            // No model serves both classes; the copies are exactly the shared models, tagged.
            assert!(rt.iter().all(|m| !be.contains(m)), "{name}: {rt:?} {be:?}");
            let tagged: Vec<&str> = be.iter().copied().filter(|m| m.ends_with(BE_COPY_TAG)).collect();
            assert_eq!(tagged.len(), copies, "{name}: {be:?}");
            assert!(tagged.iter().all(|m| rt.contains(&m.trim_end_matches(BE_COPY_TAG))), "{name}");
            // Stream names stay DISB's (`M-be`), so tables key them by architecture.
            assert!(w.streams.iter().filter(|s| s.class == StreamClass::Be).all(|s| s.name.ends_with("-be")));
            // The preset loads the copies, and every best-effort model is now the best-effort clients' alone.
            let archs = p.archs(&opts);
            assert!(w.models().iter().all(|m| archs.contains(m)), "{name}: {archs:?}");
            let mut alone = p.best_effort_only_archs(true);
            alone.sort_unstable();
            let mut want: Vec<&str> = be.clone();
            want.sort_unstable();
            want.dedup();
            assert_eq!(alone, want, "{name}");
        }
        // RT-Only runs have no best-effort clients, so no copies either.
        let rt_only = PresetOptions { be_copies: true, rt_only: true, ..PresetOptions::default() };
        let p = Preset::Disb('e');
        assert_eq!(p.variants(&rt_only), ["rt-only"]);
        assert!(p.archs(&rt_only).iter().all(|m| !m.ends_with(BE_COPY_TAG)));
    }

    #[test]
    fn every_preset_builds_a_valid_workload() {
        let opts = PresetOptions::default();
        let iso = iso_all();
        for name in Preset::NAMES {
            let p = Preset::by_name(name).unwrap();
            assert_eq!(p.name(), name);
            if matches!(p, Preset::Coldstart | Preset::DeepPlanAzure) {
                continue; // needs plans in the catalog (and a trace): covered by the integration tests
            }
            for v in p.variants(&opts) {
                for load in p.default_loads() {
                    let (w, _) = p.workload(load, &v, &iso, &Catalog::default(), &opts).unwrap();
                    let models = w.models();
                    let archs = p.archs(&opts);
                    assert!(models.iter().all(|m| archs.contains(m)), "{name}: {models:?} not in {archs:?}");
                }
            }
        }
        assert!(Preset::by_name("disb-f").is_none());
    }

    #[test]
    fn deepplan_azure_instances_are_4_4_1_and_interleaved() {
        let i = instances_of(&Preset::DeepPlanAzure, 2);
        let count = |m: &str| i.iter().filter(|(a, _)| *a == m).count();
        assert_eq!((count("bert_base"), count("roberta_base"), count("gpt2")), (8, 8, 2));
        assert_eq!(
            &i[..9].iter().map(|(a, _)| *a).collect::<Vec<_>>(),
            &[
                "bert_base",
                "bert_base",
                "bert_base",
                "bert_base",
                "roberta_base",
                "roberta_base",
                "roberta_base",
                "roberta_base",
                "gpt2"
            ]
        );
        let names: std::collections::BTreeSet<String> = i.iter().map(|&(m, k)| instance_name(m, k)).collect();
        assert_eq!(names.len(), 18, "instance names are unique: {names:?}");
        assert_eq!(instances_of(&Preset::Coldstart, 3).len(), 24);
        assert!(instances_of(&Preset::Mix8, 3).is_empty());
    }

    #[test]
    fn reef_pairs_are_every_pair_of_disb_models_in_closed_loop() {
        let iso = iso_all();
        let opts = PresetOptions::default();
        let v = Preset::ReefPairs.variants(&opts);
        assert_eq!(v.len(), 25);
        assert_eq!(v[1], "rt=vgg19,be=resnet152");
        let (w, _) = Preset::ReefPairs.workload(1.0, &v[1], &iso, &Catalog::default(), &opts).unwrap();
        let classes: Vec<(&str, StreamClass, i32)> = w.streams.iter().map(|s| (s.name.as_str(), s.class, s.priority)).collect();
        assert_eq!(classes, vec![("vgg19-rt", StreamClass::Rt, 1), ("resnet152-be", StreamClass::Be, 0)]);
        assert!(w.sources.iter().all(|s| matches!(s.arrival, Arrival::ClosedLoop { clients: 1, .. })));
        assert_eq!(w.open_rate_per_s(), 0.0);
        // A model against itself: two streams of one model.
        let (w, _) = Preset::ReefPairs.workload(1.0, "rt=vgg19,be=vgg19", &iso, &Catalog::default(), &opts).unwrap();
        assert_eq!(w.models(), vec!["vgg19".to_string()]);
        // RT-Only: one variant per real-time model, no best-effort stream, only those models loaded.
        let rt_opts = PresetOptions { rt_only: true, pairs: parse_pairs("vgg19+*,resnet152+vgg19").unwrap(), ..opts.clone() };
        let v = Preset::ReefPairs.variants(&rt_opts);
        assert_eq!(v, vec!["rt=vgg19,rt-only".to_string(), "rt=resnet152,rt-only".to_string()]);
        assert_eq!(Preset::ReefPairs.archs(&rt_opts), vec!["vgg19".to_string(), "resnet152".to_string()]);
        let (w, _) = Preset::ReefPairs.workload(1.0, &v[0], &iso, &Catalog::default(), &rt_opts).unwrap();
        assert_eq!(w.streams.len(), 1);
        for bad in ["", "rt=vgg19", "be=vgg19", "rt=vgg19,be=resnet152,rt-only", "rt=vgg19,x=1", "rt=,be=vgg19"] {
            assert!(Preset::ReefPairs.workload(1.0, bad, &iso, &Catalog::default(), &opts).is_err(), "{bad}");
        }
        // A point is long enough for the real-time requests at the slack, after the warm-up.
        let mut fast = iso.clone();
        fast.isolated.insert("vgg19".into(), 850_000);
        let d = Preset::ReefPairs.variant_duration_ns("rt=vgg19,be=resnet152", &fast, 0.1).unwrap();
        assert!((d as f64 - PAIR_RT_REQUESTS * PAIR_RT_SLACK * 850_000.0 / 0.9).abs() < 2.0, "{d}");
        // ... and at most PAIR_DURATION_NS_MAX (10 ms a request would be 40 s).
        assert_eq!(Preset::ReefPairs.variant_duration_ns("rt=vgg19,be=resnet152", &iso, 0.1), Some(PAIR_DURATION_NS_MAX));
        assert_eq!(Preset::Disb('b').variant_duration_ns("", &iso, 0.1), None);
    }

    #[test]
    fn pairs_parse_with_wildcards_and_reject_the_rest() {
        assert_eq!(parse_pairs("vgg19+resnet152").unwrap(), vec![("vgg19".to_string(), "resnet152".to_string())]);
        let all = parse_pairs("*+*").unwrap();
        assert_eq!(all, disb_pairs());
        let some = parse_pairs("*+vgg19, vgg19+vgg19").unwrap();
        assert_eq!(some.len(), 5, "duplicates are dropped: {some:?}");
        assert!(some.iter().all(|(_, be)| be == "vgg19"));
        for bad in ["", "vgg19", "vgg19+", "+vgg19", ","] {
            assert!(parse_pairs(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_tenant_per_model_when_asked() {
        let iso = iso_all();
        let mut opts = PresetOptions { sigmas: vec![2.0], ..PresetOptions::default() };
        let v = Preset::Mix8.variants(&opts);
        let (w, _) = Preset::Mix8.workload(1.0, &v[0], &iso, &Catalog::default(), &opts).unwrap();
        assert!(w.streams.iter().all(|s| s.tenant == 0));
        opts.tenant_per_model = true;
        let v = Preset::Mix8.variants(&opts);
        assert_eq!(v, vec!["sigma=2,tenant-per-model".to_string()]);
        let (w, _) = Preset::Mix8.workload(1.0, &v[0], &iso, &Catalog::default(), &opts).unwrap();
        let tenants: std::collections::BTreeSet<u32> = w.streams.iter().map(|s| s.tenant).collect();
        assert_eq!(tenants.len(), MIX8.len());
        assert!(Preset::Mix8.workload(1.0, "sigma=2,other", &iso, &Catalog::default(), &opts).is_err());
    }

    #[test]
    fn closed_loop_clients_scale_with_the_load() {
        let iso = iso_all();
        let mut opts = PresetOptions::default();
        opts.custom.models = vec!["resnet50@b8".into()];
        opts.custom.arrival = "closed:1".into();
        for (load, clients) in [(1.0, 1), (2.0, 2), (4.0, 4), (0.2, 1)] {
            let (w, _) = Preset::Custom.workload(load, "", &iso, &Catalog::default(), &opts).unwrap();
            assert_eq!(w.streams[0].model, "resnet50@b8");
            assert!(
                matches!(w.sources[0].arrival, Arrival::ClosedLoop { clients: c, .. } if c == clients),
                "load {load}: {:?}",
                w.sources[0].arrival
            );
        }
    }

    #[test]
    fn closed_each_gives_every_model_its_own_clients() {
        let iso = iso_all();
        let mut opts = PresetOptions::default();
        opts.custom.models = vec!["squeezenet1_1".into(), "densenet121".into()];
        opts.custom.arrival = "closed-each:1".into();
        for (load, clients) in [(1.0, 1), (2.0, 2)] {
            let (w, _) = Preset::Custom.workload(load, "", &iso, &Catalog::default(), &opts).unwrap();
            assert_eq!(w.sources.len(), 2, "one source per model");
            for (i, src) in w.sources.iter().enumerate() {
                assert!(matches!(src.arrival, Arrival::ClosedLoop { clients: c, .. } if c == clients), "{:?}", src.arrival);
                assert_eq!(src.streams.len(), 1);
                assert_eq!(w.streams[src.streams[0].0 as usize].model, opts.custom.models[i]);
            }
        }
        opts.custom.arrival = "closed-each:x".into();
        assert!(Preset::Custom.workload(1.0, "", &iso, &Catalog::default(), &opts).is_err());
    }

    #[test]
    fn rates_follow_the_papers() {
        let opts = PresetOptions::default();
        let iso = iso_all();
        let (a, _) = Preset::Disb('a').workload(1.0, "", &iso, &Catalog::default(), &opts).unwrap();
        assert_eq!(a.open_rate_per_s(), 100.0);
        assert_eq!(a.streams.iter().filter(|s| s.class == StreamClass::Rt).count(), 1);
        let (d, _) = Preset::Disb('d').workload(0.5, "", &iso, &Catalog::default(), &opts).unwrap();
        assert!((d.open_rate_per_s() - 50.0).abs() < 1e-6);
        assert_eq!(d.sources.iter().filter(|s| s.arrival.is_closed()).count(), 5);
        // RT-Only: the same real-time streams and rates, no best-effort client.
        assert_eq!(Preset::Disb('d').variants(&opts), vec![String::new()]);
        let rt_opts = PresetOptions { rt_only: true, ..PresetOptions::default() };
        assert_eq!(Preset::Disb('d').variants(&rt_opts), vec!["rt-only".to_string()]);
        let (d_rt, _) = Preset::Disb('d').workload(0.5, "rt-only", &iso, &Catalog::default(), &rt_opts).unwrap();
        assert!((d_rt.open_rate_per_s() - 50.0).abs() < 1e-6);
        assert!(d_rt.streams.iter().all(|s| s.class == StreamClass::Rt) && d_rt.streams.len() == 5);
        assert!(d_rt.sources.iter().all(|s| !s.arrival.is_closed()));
        assert!(Preset::Disb('d').workload(0.5, "other", &iso, &Catalog::default(), &rt_opts).is_err());
        // B at REEF's 220 req/s: the closed real-time loop becomes uniform; RT-Only keeps the rate.
        let b_opts = PresetOptions { rt_only: true, disb_rt_rate_per_s: Some(220.0), ..PresetOptions::default() };
        assert_eq!(Preset::Disb('b').variants(&b_opts), vec!["rt-only,rt-rate=220".to_string()]);
        let (b, _) = Preset::Disb('b').workload(1.0, "rt-rate=220", &iso, &Catalog::default(), &b_opts).unwrap();
        assert!((b.open_rate_per_s() - 220.0).abs() < 1e-3);
        assert_eq!(b.sources.iter().filter(|s| s.arrival.is_closed()).count(), 1, "resnet152's best-effort loop");
        let (b_rt, _) = Preset::Disb('b').workload(1.0, "rt-only,rt-rate=220", &iso, &Catalog::default(), &b_opts).unwrap();
        assert!((b_rt.open_rate_per_s() - 220.0).abs() < 1e-3 && b_rt.sources.iter().all(|s| !s.arrival.is_closed()));
        let (e, _) = Preset::Disb('e').workload(1.0, "rt-rate=30", &iso, &Catalog::default(), &b_opts).unwrap();
        assert!((e.open_rate_per_s() - 150.0).abs() < 1e-6);
        for bad in ["rt-rate=0", "rt-rate=x", "rt-rate", "rt-only,fast"] {
            assert!(Preset::Disb('b').workload(1.0, bad, &iso, &Catalog::default(), &b_opts).is_err(), "{bad}");
        }
        // Paella's mix at load 2 with 10 ms models: 200 requests/s.
        let (m, _) = Preset::PaellaMix.workload(2.0, "sigma=2", &iso, &Catalog::default(), &opts).unwrap();
        assert!((m.open_rate_per_s() - 200.0).abs() < 1e-6);
        assert!(Preset::PaellaMix.workload(2.0, "", &iso, &Catalog::default(), &opts).is_err());
        // DARIS at 150% of a measured 400 requests/s: four copies of the six tasks (each offers
        // 1 / (6 x 10 ms) at load 1), 600 requests/s, periods 4x the isolated latency, deadlines = periods.
        let (r, _) = Preset::Daris.workload(1.5, "", &iso, &Catalog::default(), &opts).unwrap();
        assert!((r.open_rate_per_s() - 600.0).abs() < 0.5, "{}", r.open_rate_per_s());
        assert_eq!(r.streams.len(), 24);
        assert!(r.sources.iter().all(|s| matches!(s.arrival, Arrival::Periodic { period_ns: 40_000_000, .. })));
        let cap = Preset::Daris.capacity_workload(&iso).unwrap().unwrap();
        assert_eq!(cap.streams.len(), 6);
        assert!(!cap.has_open_loop());
        let no_cap = Calibration { capacity_per_s: None, ..iso.clone() };
        assert!(Preset::Daris.workload(1.0, "", &no_cap, &Catalog::default(), &opts).is_err());
        for (s, src) in r.streams.iter().zip(&r.sources) {
            let Arrival::Periodic { period_ns, .. } = src.arrival else { panic!() };
            assert_eq!(s.deadline_ns, Some(period_ns));
        }
    }
}

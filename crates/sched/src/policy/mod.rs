//! Scheduling policies behind one trait.
//!
//! A policy is a pure function of a [`View`]: it reads the dispatcher's state (the admitted jobs
//! with their next ready kernel and remaining-time estimates, the tenants' fairness counters, the
//! GPU's occupancy and streams) and returns the next [`Decision`], or `None` when nothing should
//! be issued now. It does no IO and reads no clock; `View::now_ns` is the GPU's clock as the
//! dispatcher last read it. The dispatcher applies the decision, updates its state, and asks again
//! until the policy returns `None`, so a policy only ever ranks the current candidates.
//!
//! Two ways of issuing exist. [`Decision::Issue`] releases one ready kernel (its plan dependencies
//! are done) onto an idle stream: kernel-by-kernel dispatch, where the dispatcher keeps each job's
//! waitlist and the policy decides the order. [`Decision::IssueAll`] hands every remaining launch of
//! a job to one stream in plan order, where the stream's FIFO order enforces the dependencies:
//! today's whole-model serving, kept as the baseline.
//!
//! | name | module | issues | gate |
//! |---|---|---|---|
//! | `fifo` | [`fifo`] | whole jobs, one stream | none |
//! | `streams` | [`streams`] | whole jobs, N streams | none |
//! | `streams-kernel` | [`streams_kernel`] | kernels, oldest job first | none |
//! | `paella` | [`paella`] | kernels, SRPT + per-tenant deficits | occupancy + headroom |
//! | `edf` | [`edf`] | kernels, earliest (virtual) deadline | occupancy + headroom |
//! | `sjf` | [`sjf`] | kernels, shortest job first | occupancy + headroom |
//! | `rr` | [`rr`] | kernels, least recently served job | occupancy + headroom |
//! | `reef` | [`reef`] | kernels; real-time first, preempts best-effort, pads | real-time: none; padding: free SMs |
//! | `seq` | [`seq`] | whole jobs one at a time, real-time first | none |
//! | `krisp` | [`krisp`] | kernels, round robin, each on its right-sized SM mask (`+green`: green context; `+runs+green`, `+model+green`: right-sized segments recorded in it) | free SM groups (KRISP-I) |
//! | `static` | [`krisp`] | kernels, round robin, each on its job's equal partition (`+green`: green context, segments recorded in it) | none |

pub mod edf;
pub mod fifo;
pub mod krisp;
pub mod paella;
pub mod reef;
pub mod rr;
pub mod seq;
pub mod sjf;
pub mod streams;
pub mod streams_kernel;

use crate::occupancy::{Occupancy, ResourceClass};
use crate::request::{Class, RequestId, TenantId};
use kairos_gpu::SmMask;

/// A job's slot in the dispatcher, with a generation so stale keys are refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobKey {
    pub slot: u32,
    pub generation: u32,
}

/// The next kernel of a job whose dependencies are done.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadyKernel {
    /// Index of the launch in the model's plan.
    pub launch: u32,
    /// First logical block to run (non-zero when resuming a preempted launch).
    pub first_block: u32,
    pub blocks_left: u32,
    /// CTAs the dispatcher starts by default: enough for the blocks left, at most one full wave.
    pub ctas: u32,
    pub class: ResourceClass,
    /// Estimated duration on the whole GPU.
    pub est_ns: u64,
    /// The job has launches in flight on its lane: issued, this one waits behind the last of them
    /// on that stream (no idle stream needed) and starts when it ends.
    pub behind: bool,
    /// When `behind`: the CTAs of this kernel's class that the launch it waits behind frees when
    /// it ends (its share of a full wave, in this class's CTAs). Only CTAs beyond these need room
    /// (see [`GpuView::fits`]).
    pub frees_ctas: u32,
    /// Not behind, and its job is real-time: the dispatcher puts it on an idle high-priority
    /// stream (`GpuView::idle_realtime_streams`) when there is one, else on an idle pool stream.
    pub realtime_lane: bool,
    /// Its right size: the fewest SMs that keep its speed (KRISP; `min_sms` of the model's
    /// profile, else the SMs its default grid spreads over).
    pub right_sms: u32,
    /// The groups of SMs ([`crate::occupancy::groups_of`]) its job's launches in flight touch: they
    /// run on its lane, so they end before this kernel starts (0 unless the policy masks kernels,
    /// see [`GpuView::group_jobs`]).
    pub lane_groups: u32,
}

/// An admitted job (it has its buffers and can be scheduled), as policies see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JobView {
    pub key: JobKey,
    pub id: RequestId,
    /// Admission order, unique and increasing: the tie-breaker that makes every policy deterministic.
    pub seq: u64,
    pub model: u32,
    pub tenant: TenantId,
    pub class: Class,
    pub priority: i32,
    pub arrival_ns: u64,
    /// Absolute deadline on the GPU clock.
    pub deadline_at_ns: Option<u64>,
    /// Estimated GPU time of the whole job when it was admitted.
    pub total_ns: u64,
    /// Estimated GPU time of its launches not yet done.
    pub remaining_ns: u64,
    pub launches: u32,
    pub launches_unissued: u32,
    pub in_flight: u32,
    /// Its lowest-indexed launch whose dependencies are all issued or done, while its issue-ahead
    /// window is open (see `Config::lookahead_ns`); `None` for a cancelled job, a job bound to a
    /// stream, or one whose lane is full or draining after a preemption.
    pub next_ready: Option<ReadyKernel>,
    pub ready_count: u32,
    /// The stream an `IssueAll` bound the job to.
    pub stream: Option<u32>,
    /// The dispatcher's issue counter when this job last had a kernel issued; 0 if never.
    pub last_issue_seq: u64,
    /// Lowest-indexed launch of the job in flight and not asked to stop: what a
    /// [`Decision::Preempt`] can name (`None` for jobs bound to a stream).
    pub running: Option<u32>,
    /// The dispatcher's issue counter when `running` was issued (0 when none): `reef` preempts
    /// the best-effort launches issued before a real-time job was admitted, not the padding
    /// issued after it.
    pub running_issue_seq: u64,
    /// The dispatcher's issue counter when the job was admitted: every launch issued since has a
    /// greater one.
    pub admitted_issue_seq: u64,
    pub cancelled: bool,
    /// SMs that the widest launch of its model covers at its default CTAs (a full wave: all of
    /// them): what a job must keep free for its kernels never to wait for room (REEF's padding).
    pub widest_sms: u32,
}

impl JobView {
    /// A best-effort job of one unissued launch for policy unit tests: arrived at `arrival_ns`,
    /// `total_ns` in all with `remaining_ns` left, an optional absolute deadline.
    #[cfg(test)]
    pub(crate) fn for_test(arrival_ns: u64, total_ns: u64, remaining_ns: u64, deadline_at_ns: Option<u64>) -> JobView {
        JobView {
            key: JobKey { slot: 0, generation: 0 },
            id: crate::RequestId(0),
            seq: 0,
            model: 0,
            tenant: crate::TenantId(0),
            class: crate::Class::BestEffort,
            priority: 0,
            arrival_ns,
            deadline_at_ns,
            total_ns,
            remaining_ns,
            launches: 1,
            launches_unissued: 1,
            in_flight: 0,
            next_ready: None,
            ready_count: 0,
            stream: None,
            last_issue_seq: 0,
            running: None,
            running_issue_seq: 0,
            admitted_issue_seq: 0,
            cancelled: false,
            widest_sms: 0,
        }
    }

    /// Nothing of it was issued yet and it is still wanted.
    pub fn is_unstarted(&self) -> bool {
        !self.cancelled && self.stream.is_none() && self.launches_unissued == self.launches && self.in_flight == 0
    }
}

/// Fairness state of a tenant with admitted jobs.
///
/// Deficit counters: when a kernel (or a whole job) with estimated cost c is issued, every tenant
/// with admitted jobs is credited c / n (n such tenants) and the tenant served is charged c. A
/// positive deficit is GPU time the tenant is owed relative to an equal share; the sum over
/// tenants is zero while the set of tenants is unchanged. A tenant's counter is dropped when its
/// last job completes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TenantView {
    pub tenant: TenantId,
    pub active_jobs: u32,
    /// Admitted jobs with a ready kernel.
    pub ready_jobs: u32,
    pub deficit_ns: f64,
}

/// State of one stream of the dispatcher's pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamView {
    /// Launches issued on it and not done.
    pub in_flight: u32,
    /// Jobs bound to it by `IssueAll` and not done.
    pub jobs: u32,
}

/// The GPU as policies see it.
#[derive(Clone, Copy, Debug)]
pub struct GpuView<'a> {
    pub occupancy: &'a Occupancy,
    /// CTAs issued but not yet reported placed.
    pub pending_ctas: u64,
    /// The headroom B: how many CTAs may wait in the hardware queues beyond what fits now.
    pub headroom_ctas: u32,
    pub launches_in_flight: u32,
    pub launches_in_flight_max: u32,
    pub streams: &'a [StreamView],
    /// Streams a kernel can go to now: nothing in flight, no job bound, and no launch waiting
    /// behind a dependency at the head of the hardware queue they share.
    pub idle_streams: u32,
    /// Idle high-priority streams, kept for real-time jobs' lanes (`Config::realtime_stream_count`).
    pub idle_realtime_streams: u32,
    /// Per group of [`crate::occupancy::GROUP_SMS`] SMs, the jobs with a launch in flight (issued,
    /// not ended) whose SM mask touches it: KRISP's per-CU kernel counters (a job's launches run
    /// one after another on its lane, as a KRISP worker's kernels do on its queue). Kept for the
    /// policies that mask kernels ([`PolicyConfig::masks_kernels`]); zeros for the others.
    pub group_jobs: &'a [u32],
}

impl GpuView<'_> {
    /// The occupancy gate: the kernel needs no more room than the launch it waits behind frees
    /// (issue-ahead on a job's lane), or nothing issued is waiting to be placed, or the CTAs it
    /// needs beyond that (at most one wave) fit in the SMs' free room plus the headroom B behind
    /// the CTAs already issued and not yet placed. So the hardware queues hold at most one kernel,
    /// plus B CTAs, that cannot start now (besides the launches waiting on their lanes, each no
    /// larger than what its predecessor frees): enough to hide the notification round trip, too
    /// little to make a kernel the policy ranks first wait behind work it ranked later.
    pub fn fits(&self, k: &ReadyKernel) -> bool {
        let need = if k.behind { k.ctas.saturating_sub(k.frees_ctas) } else { k.ctas };
        need == 0
            || self.pending_ctas == 0
            || self.pending_ctas + need as u64 <= self.occupancy.free_ctas(k.class) as u64 + self.headroom_ctas as u64
    }

    /// A kernel can be issued at all: a launch slot is free, and an idle stream unless it goes
    /// behind its dependency (a real-time job's first kernel may take an idle high-priority one).
    pub fn can_issue(&self, k: &ReadyKernel) -> bool {
        self.launches_in_flight < self.launches_in_flight_max
            && (k.behind || self.idle_streams > 0 || (k.realtime_lane && self.idle_realtime_streams > 0))
    }

    /// `launches` more launches fit under the in-flight limit (a job larger than the limit may go
    /// when nothing else is in flight, or it could never run).
    pub fn can_issue_launches(&self, launches: u32) -> bool {
        self.launches_in_flight == 0 || self.launches_in_flight as u64 + launches as u64 <= self.launches_in_flight_max as u64
    }
}

/// Everything a policy may read.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub now_ns: u64,
    /// When the last real-time job left the dispatcher (done, failed or cancelled); 0 if none
    /// has yet (`reef`'s hold-off, [`Policy::wake_at_ns`]).
    pub last_realtime_done_ns: u64,
    /// Admitted jobs, in no particular order (use `seq` to order by age).
    pub jobs: &'a [JobView],
    /// Tenants with admitted jobs, in no particular order.
    pub tenants: &'a [TenantView],
    pub gpu: GpuView<'a>,
}

/// What a policy asks the dispatcher to do next.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    /// Issue the job's next ready launch: on its lane behind its launches in flight, or on an
    /// idle stream that becomes its lane. `ctas` and `sm_mask` default to the ready kernel's
    /// CTAs and the whole GPU (later policies right-size with them).
    Issue { job: JobKey, launch: u32, ctas: Option<u32>, sm_mask: Option<SmMask> },
    /// Bind the unstarted job to stream `stream` of the pool and issue all its launches there.
    IssueAll { job: JobKey, stream: u32 },
    /// Set the preempt flag of the job's running launch: its CTAs stop at a logical-block
    /// boundary, and the launch becomes ready again at the first block never taken (for
    /// preemptive policies: `reef`; only launches of a class the policy preempts
    /// ([`Policy::preempts_class`]) can be stopped, a decision naming another is refused).
    Preempt { job: JobKey, launch: u32 },
}

/// A scheduling policy: a pure function of the view.
pub trait Policy: Send + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn decide(&self, view: &View<'_>) -> Option<Decision>;
    /// Whether it may ever decide [`Decision::Preempt`]. The launches of a policy that does not
    /// are issued as not preemptible, which a GPU may run more cheaply (on CUDA: light launches,
    /// ~3 µs less per launch on an H100).
    fn preempts(&self) -> bool {
        false
    }
    /// Whether it may preempt launches of jobs of `class` (default: [`Policy::preempts`]). The
    /// launches of a class it never preempts go out as not preemptible, and kernel-level jobs of
    /// that class in recorded segments (`Config::run_segment_ns`): `reef` preempts best-effort
    /// work only, so real-time jobs run at the speed of whole runs.
    fn preempts_class(&self, class: Class) -> bool {
        let _ = class;
        self.preempts()
    }
    /// Whether kernel-level jobs of `class`, which it may preempt, still go in recorded segments
    /// that a preemption stops between kernels (a GPU's stop words, [`kairos_gpu::Gpu::create_stop_word`];
    /// where the GPU has none, or a model's kernels may not run twice, launch by launch as usual).
    /// Default: never (`reef+stopruns` does for best-effort jobs).
    fn stops_runs(&self, class: Class) -> bool {
        let _ = class;
        false
    }
    /// Whether it may hold back work it could issue until a time passes ([`Policy::wake_at_ns`]);
    /// the dispatcher asks for that time only of policies that do.
    fn holds(&self) -> bool {
        false
    }
    /// When it decided nothing: the time at which it may decide otherwise with nothing else
    /// changed (`reef`'s hold-off ending), so the engine looks again then even if the GPU and the
    /// clients stay quiet. None: only an event can change its mind.
    fn wake_at_ns(&self, view: &View<'_>) -> Option<u64> {
        let _ = view;
        None
    }
}

/// The policies by name, with their parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyConfig {
    Fifo {
        jobs_queued: u32,
    },
    Streams {
        streams: u32,
        jobs_per_stream: u32,
    },
    StreamsKernel,
    Paella {
        fairness_threshold_ns: u64,
        backfill: bool,
        slowdown_bound: Option<f64>,
    },
    Edf {
        slowdown: f64,
        backfill: bool,
    },
    Sjf,
    Rr,
    /// `hold_ns`: after a real-time job leaves, best-effort work waits this long for the next
    /// real-time request (`+hold=US`; 0: off).
    Reef {
        kill: bool,
        padding: bool,
        be_runs: bool,
        gate_be: bool,
        hold_ns: u64,
    },
    Seq,
    /// `green`: masks go out as hardware partitions (`+green`, see [`PolicyConfig::hardware_masks`]);
    /// `unit`: what is right-sized and placed as one (`+runs`, `+model`; with `+green` only).
    Krisp {
        overlap_sms: u32,
        green: bool,
        unit: krisp::RightSizeUnit,
    },
    Static {
        partitions: u32,
        green: bool,
    },
}

impl PolicyConfig {
    pub const NAMES: [&'static str; 11] =
        ["fifo", "streams", "streams-kernel", "paella", "edf", "sjf", "rr", "reef", "seq", "krisp", "static"];

    /// A policy by name with its default parameters, or `name:value` for its main parameter:
    /// `streams:N` (streams), `paella:T` (fairness threshold in µs, or `inf`), `edf:S` (slowdown);
    /// a `+backfill` suffix lets `paella` and `edf` issue the best-ranked kernel that passes the
    /// gate when the first-ranked one does not (`paella+backfill`, `edf:2+backfill`); `+bound` or
    /// `+bound=S` gives `paella` a starvation bound (see [`paella`]; S defaults to
    /// [`paella::SLOWDOWN_BOUND_DEFAULT`]). Suffixes come in that order. `reef` takes `+wait`
    /// (no preemption: best-effort launches already issued run to their end, REEF's wait-based
    /// baseline) and `+nopad` (no best-effort kernel while real-time work is admitted), in that
    /// order; `+runs` in place of `+wait` sends best-effort kernel-level jobs in recorded segments
    /// as well (not preemptible, so no preemption either), and `+stopruns` sends them in recorded
    /// segments that real-time arrivals stop between kernels ([`Policy::stops_runs`]), and
    /// `+stopruns+ungated` issues those without the occupancy gate in normal mode; a last `+hold=US`
    /// keeps best-effort work out for US µs after each real-time job leaves (a closed-loop or
    /// streaming real-time client's next request finds none to stop). `krisp:N` allows N SMs of overlap per
    /// kernel (`krisp` = `krisp:0`, KRISP-I; `krisp:inf`, KRISP-O); `static:N` cuts the GPU into
    /// N equal partitions; both take a last `+green` (their masks as green-context partitions,
    /// [`PolicyConfig::hardware_masks`]), and `krisp` with `+green` a `+runs` or `+model` before
    /// it (`krisp+runs+green`: each recorded segment of a job right-sized and replayed inside its
    /// partition; `krisp+model+green`: the job after its first kernel as one such segment, the
    /// per-model right size; see [`krisp::RightSizeUnit`]).
    pub fn by_name(name: &str) -> Option<PolicyConfig> {
        if let Some(base) = name.strip_suffix("+green") {
            // `krisp+runs+green`, `krisp+model+green`: right-sized recorded segments (hardware
            // partitions only: a run is recorded inside one).
            let (base, unit) = match (base.strip_suffix("+runs"), base.strip_suffix("+model")) {
                (Some(b), _) => (b, Some(krisp::RightSizeUnit::Segment)),
                (_, Some(b)) => (b, Some(krisp::RightSizeUnit::Model)),
                _ => (base, None),
            };
            return match (PolicyConfig::by_name(base)?, unit) {
                (PolicyConfig::Krisp { overlap_sms, green: false, unit: krisp::RightSizeUnit::Kernel }, unit) => {
                    Some(PolicyConfig::Krisp { overlap_sms, green: true, unit: unit.unwrap_or(krisp::RightSizeUnit::Kernel) })
                }
                (PolicyConfig::Static { partitions, green: false }, None) => {
                    Some(PolicyConfig::Static { partitions, green: true })
                }
                _ => None,
            };
        }
        if let Some(rest) = name.strip_prefix("reef") {
            let (rest, hold_ns) = match rest.rsplit_once("+hold=") {
                Some((r, us)) => (r, us.parse::<u64>().ok().filter(|&us| us > 0)?.checked_mul(1000)?),
                None => (rest, 0),
            };
            let (kill, be_runs, rest) = if let Some(r) = rest.strip_prefix("+wait") {
                (false, false, r)
            } else if let Some(r) = rest.strip_prefix("+runs") {
                (false, true, r)
            } else if let Some(r) = rest.strip_prefix("+stopruns") {
                (true, true, r)
            } else {
                (true, false, rest)
            };
            // Stoppable runs may go without the occupancy gate (`+ungated`); the others always pass it.
            let (gate_be, rest) = match rest.strip_prefix("+ungated") {
                Some(r) if kill && be_runs => (false, r),
                Some(_) => return None,
                None => (true, rest),
            };
            return match rest {
                "" => Some(PolicyConfig::Reef { kill, padding: true, be_runs, gate_be, hold_ns }),
                "+nopad" => Some(PolicyConfig::Reef { kill, padding: false, be_runs, gate_be, hold_ns }),
                _ => None,
            };
        }
        let (name, bound) = match name.split_once("+bound") {
            Some((n, "")) => (n, Some(paella::SLOWDOWN_BOUND_DEFAULT)),
            Some((n, s)) => (n, Some(s.strip_prefix('=')?.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0)?)),
            None => (name, None),
        };
        let (name, with_backfill) = match name.strip_suffix("+backfill") {
            Some(n) => (n, true),
            None => (name, false),
        };
        let (base, param) = match name.split_once(':') {
            Some((b, p)) => (b, Some(p)),
            None => (name, None),
        };
        let mut p = match base {
            "fifo" => PolicyConfig::Fifo { jobs_queued: 2 },
            "streams" => PolicyConfig::Streams { streams: 32, jobs_per_stream: 1 },
            "streams-kernel" => PolicyConfig::StreamsKernel,
            "paella" => PolicyConfig::Paella {
                fairness_threshold_ns: paella::FAIRNESS_THRESHOLD_NS_DEFAULT,
                backfill: false,
                slowdown_bound: None,
            },
            "edf" => PolicyConfig::Edf { slowdown: edf::SLOWDOWN_DEFAULT, backfill: false },
            "sjf" => PolicyConfig::Sjf,
            "rr" => PolicyConfig::Rr,
            "seq" => PolicyConfig::Seq,
            "krisp" => PolicyConfig::Krisp { overlap_sms: 0, green: false, unit: krisp::RightSizeUnit::Kernel },
            "static" => PolicyConfig::Static { partitions: krisp::STATIC_PARTITIONS_DEFAULT, green: false },
            _ => return None,
        };
        if let Some(v) = param {
            match &mut p {
                PolicyConfig::Streams { streams, .. } => *streams = v.parse().ok().filter(|&n| n > 0)?,
                PolicyConfig::Paella { fairness_threshold_ns, .. } => {
                    *fairness_threshold_ns = if v == "inf" { u64::MAX } else { v.parse::<u64>().ok()?.checked_mul(1000)? }
                }
                PolicyConfig::Edf { slowdown, .. } => *slowdown = v.parse().ok().filter(|s: &f64| s.is_finite() && *s >= 0.0)?,
                PolicyConfig::Krisp { overlap_sms, .. } => {
                    *overlap_sms =
                        if v == "inf" { krisp::OVERLAP_ANY } else { v.parse().ok().filter(|&n| n != krisp::OVERLAP_ANY)? }
                }
                PolicyConfig::Static { partitions, .. } => *partitions = v.parse().ok().filter(|&n| n > 0 && n <= 32)?,
                _ => return None,
            }
        }
        if with_backfill {
            match &mut p {
                PolicyConfig::Paella { backfill, .. } | PolicyConfig::Edf { backfill, .. } => *backfill = true,
                _ => return None,
            }
        }
        if bound.is_some() {
            match &mut p {
                PolicyConfig::Paella { slowdown_bound, .. } => *slowdown_bound = bound,
                _ => return None,
            }
        }
        Some(p)
    }

    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::Fifo { .. } => "fifo",
            PolicyConfig::Streams { .. } => "streams",
            PolicyConfig::StreamsKernel => "streams-kernel",
            PolicyConfig::Paella { .. } => "paella",
            PolicyConfig::Edf { .. } => "edf",
            PolicyConfig::Sjf => "sjf",
            PolicyConfig::Rr => "rr",
            PolicyConfig::Reef { .. } => "reef",
            PolicyConfig::Seq => "seq",
            PolicyConfig::Krisp { .. } => "krisp",
            PolicyConfig::Static { .. } => "static",
        }
    }

    /// The name `by_name` reads back: the policy's name, its main parameter when it is not the
    /// default (`streams:8`, `paella:0`, `edf:2`), and `+backfill` when set.
    pub fn label(&self) -> String {
        let mut l = self.name().to_string();
        match *self {
            PolicyConfig::Streams { streams, .. } if streams != 32 => l += &format!(":{streams}"),
            PolicyConfig::Paella { fairness_threshold_ns, .. }
                if fairness_threshold_ns != paella::FAIRNESS_THRESHOLD_NS_DEFAULT =>
            {
                l += &if fairness_threshold_ns == u64::MAX {
                    ":inf".to_string()
                } else {
                    format!(":{}", fairness_threshold_ns / 1000)
                }
            }
            PolicyConfig::Edf { slowdown, .. } if slowdown != edf::SLOWDOWN_DEFAULT => l += &format!(":{slowdown}"),
            PolicyConfig::Krisp { overlap_sms: krisp::OVERLAP_ANY, .. } => l += ":inf",
            PolicyConfig::Krisp { overlap_sms, .. } if overlap_sms != 0 => l += &format!(":{overlap_sms}"),
            PolicyConfig::Static { partitions, .. } if partitions != krisp::STATIC_PARTITIONS_DEFAULT => {
                l += &format!(":{partitions}")
            }
            _ => {}
        }
        if matches!(self, PolicyConfig::Paella { backfill: true, .. } | PolicyConfig::Edf { backfill: true, .. }) {
            l += "+backfill";
        }
        match *self {
            PolicyConfig::Paella { slowdown_bound: Some(s), .. } if s == paella::SLOWDOWN_BOUND_DEFAULT => l += "+bound",
            PolicyConfig::Paella { slowdown_bound: Some(s), .. } => l += &format!("+bound={s}"),
            _ => {}
        }
        if let PolicyConfig::Reef { kill, padding, be_runs, gate_be, hold_ns } = *self {
            if be_runs && kill {
                l += "+stopruns";
                if !gate_be {
                    l += "+ungated";
                }
            } else if be_runs {
                l += "+runs";
            } else if !kill {
                l += "+wait";
            }
            if !padding {
                l += "+nopad";
            }
            if hold_ns > 0 {
                l += &format!("+hold={}", hold_ns / 1000);
            }
        }
        match *self {
            PolicyConfig::Krisp { unit: krisp::RightSizeUnit::Segment, .. } => l += "+runs",
            PolicyConfig::Krisp { unit: krisp::RightSizeUnit::Model, .. } => l += "+model",
            _ => {}
        }
        if self.hardware_masks() {
            l += "+green";
        }
        l
    }

    /// Whether its SM masks go out as hardware partitions (`+green`): a mask that is a union of
    /// the device's SM groups becomes a green context of exactly those groups (made on first use
    /// and kept, [`kairos_gpu::Gpu::partition_of_groups`]), and the launch runs there on its whole
    /// partition, as a light launch (one CTA per block, no CTA leaving at once, no per-SM
    /// records) instead of a masked protocol launch. Where the device has no such partition, the
    /// software mask (counted in `DispatcherStats::partition_fallbacks`).
    pub fn hardware_masks(&self) -> bool {
        matches!(self, PolicyConfig::Krisp { green: true, .. } | PolicyConfig::Static { green: true, .. })
    }

    /// Whether the policy issues kernel by kernel (and so reads the dispatcher's waitlists).
    pub fn is_kernel_level(&self) -> bool {
        !matches!(self, PolicyConfig::Fifo { .. } | PolicyConfig::Streams { .. } | PolicyConfig::Seq)
    }

    /// Whether it puts every kernel on an SM mask of its own choosing (`krisp`, `static`): its
    /// jobs go launch by launch, never in recorded segments (runs are recorded on the whole GPU).
    pub fn masks_kernels(&self) -> bool {
        matches!(self, PolicyConfig::Krisp { .. } | PolicyConfig::Static { .. })
    }

    pub fn build(&self) -> Box<dyn Policy> {
        match *self {
            PolicyConfig::Fifo { jobs_queued } => Box::new(fifo::Fifo { jobs_queued: jobs_queued.max(1) }),
            PolicyConfig::Streams { streams, jobs_per_stream } => {
                Box::new(streams::Streams { streams: streams.max(1), jobs_per_stream: jobs_per_stream.max(1) })
            }
            PolicyConfig::StreamsKernel => Box::new(streams_kernel::StreamsKernel),
            PolicyConfig::Paella { fairness_threshold_ns, backfill, slowdown_bound } => {
                Box::new(paella::Paella { fairness_threshold_ns, backfill, slowdown_bound })
            }
            PolicyConfig::Edf { slowdown, backfill } => Box::new(edf::Edf { slowdown, backfill }),
            PolicyConfig::Sjf => Box::new(sjf::Sjf),
            PolicyConfig::Rr => Box::new(rr::RoundRobin),
            PolicyConfig::Reef { kill, padding, be_runs, gate_be, hold_ns } => {
                Box::new(reef::Reef { kill, padding, be_runs, gate_be, hold_ns })
            }
            PolicyConfig::Seq => Box::new(seq::Seq),
            PolicyConfig::Krisp { overlap_sms, unit, .. } => {
                Box::new(krisp::Krisp { overlap_sms, windows: unit != krisp::RightSizeUnit::Kernel })
            }
            PolicyConfig::Static { partitions, .. } => Box::new(krisp::StaticPartitions { partitions: partitions.max(1) }),
        }
    }
}

impl std::fmt::Display for PolicyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyConfig::Fifo { jobs_queued } => write!(f, "fifo(jobs_queued={jobs_queued})"),
            PolicyConfig::Streams { streams, jobs_per_stream } => {
                write!(f, "streams(n={streams},jobs_per_stream={jobs_per_stream})")
            }
            PolicyConfig::Paella { fairness_threshold_ns, backfill, slowdown_bound } => {
                let backfill = if *backfill { ",backfill" } else { "" };
                let bound = slowdown_bound.map(|s| format!(",bound={s}")).unwrap_or_default();
                if *fairness_threshold_ns == u64::MAX {
                    write!(f, "paella(threshold=inf{backfill}{bound})")
                } else {
                    write!(f, "paella(threshold={}us{backfill}{bound})", fairness_threshold_ns / 1000)
                }
            }
            PolicyConfig::Edf { slowdown, backfill } => {
                write!(f, "edf(slowdown={slowdown}{})", if *backfill { ",backfill" } else { "" })
            }
            PolicyConfig::Reef { kill, padding, be_runs, gate_be, hold_ns } => {
                write!(f, "reef(kill={kill},padding={padding},be_runs={be_runs},gate_be={gate_be}")?;
                if *hold_ns > 0 {
                    write!(f, ",hold={}us", hold_ns / 1000)?;
                }
                f.write_str(")")
            }
            PolicyConfig::Krisp { overlap_sms, green, unit } => {
                if *overlap_sms == krisp::OVERLAP_ANY {
                    f.write_str("krisp(overlap=any")?;
                } else {
                    write!(f, "krisp(overlap={overlap_sms}sms")?;
                }
                match unit {
                    krisp::RightSizeUnit::Kernel => {}
                    krisp::RightSizeUnit::Segment => f.write_str(",unit=segment")?,
                    krisp::RightSizeUnit::Model => f.write_str(",unit=model")?,
                }
                write!(f, "{})", if *green { ",green" } else { "" })
            }
            PolicyConfig::Static { partitions, green } => {
                write!(f, "static(partitions={partitions}{})", if *green { ",green" } else { "" })
            }
            other => f.write_str(other.name()),
        }
    }
}

/// Shared core of the kernel-level, occupancy-gated policies: the job with a ready kernel that
/// ranks first by `key` is issued if its kernel passes the gate. Without `backfill` a first-ranked
/// kernel that does not fit blocks the rest (strict order: the head gets the next free room);
/// with it, the best-ranked kernel that fits goes instead.
pub(crate) fn gated_pick<K: Ord>(view: &View<'_>, backfill: bool, key: impl Fn(&JobView) -> K) -> Option<Decision> {
    let ok = |k: &ReadyKernel| view.gpu.can_issue(k) && view.gpu.fits(k);
    let best = if backfill {
        // The first job of least key whose kernel passes: the gate is asked only of jobs that
        // would improve on the best so far.
        let mut best: Option<(K, &JobView)> = None;
        for j in view.jobs {
            let Some(k) = &j.next_ready else { continue };
            let jk = key(j);
            if best.as_ref().is_some_and(|(b, _)| *b <= jk) || !ok(k) {
                continue;
            }
            best = Some((jk, j));
        }
        best?.1
    } else {
        let best = view.jobs.iter().filter(|j| j.next_ready.is_some()).min_by_key(|j| key(j))?;
        if !ok(&best.next_ready?) {
            return None;
        }
        best
    };
    issue(best)
}

/// Issue of a job's next ready kernel with default CTAs and mask.
pub(crate) fn issue(j: &JobView) -> Option<Decision> {
    let k = j.next_ready?;
    Some(Decision::Issue { job: j.key, launch: k.launch, ctas: None, sm_mask: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_parameters_read_back() {
        for n in [
            "fifo",
            "streams",
            "streams:8",
            "paella",
            "paella:0",
            "paella:inf+backfill",
            "paella+bound",
            "paella:2000+backfill+bound=2.5",
            "paella+bound=0",
            "edf",
            "edf:2",
            "edf:2+backfill",
            "sjf",
            "rr",
            "reef",
            "reef+wait",
            "reef+nopad",
            "reef+wait+nopad",
            "reef+runs",
            "reef+runs+nopad",
            "reef+stopruns",
            "reef+stopruns+nopad",
            "reef+stopruns+ungated",
            "reef+stopruns+ungated+nopad",
            "reef+hold=100",
            "reef+stopruns+hold=200",
            "reef+stopruns+ungated+nopad+hold=50",
            "seq",
            "krisp",
            "krisp:16",
            "krisp:inf",
            "static",
            "static:2",
            "krisp+green",
            "krisp:inf+green",
            "static+green",
            "static:2+green",
            "krisp+runs+green",
            "krisp:inf+runs+green",
            "krisp:16+model+green",
        ] {
            let p = PolicyConfig::by_name(n).unwrap_or_else(|| panic!("{n} does not parse"));
            assert_eq!(p.label(), n);
            assert_eq!(PolicyConfig::by_name(&p.label()), Some(p));
        }
        for bad in [
            "nope",
            "streams:0",
            "fifo:3",
            "edf:-1",
            "sjf+backfill",
            "paella:x",
            "edf+bound",
            "paella+bound=x",
            "paella+bound=-1",
            "paella+bound4",
            "paella+bound+backfill",
            "reef:2",
            "reef+nopad+wait",
            "reef+wait+runs",
            "reef+runs+wait",
            "reef+nopad+runs",
            "reef+stopruns+wait",
            "reef+ungated",
            "reef+runs+ungated",
            "reef+wait+ungated",
            "reef+stopruns+nopad+ungated",
            "reef+stopruns+gated",
            "reef+runs+stopruns",
            "reef+backfill",
            "seq:1",
            "krisp:x",
            "krisp:-8",
            "static:0",
            "static:33",
            "krisp+backfill",
            "paella+green",
            "reef+green",
            "krisp+green+green",
            "krisp+green:16",
            "krisp+runs",
            "krisp+model",
            "krisp+runs+model+green",
            "krisp+green+runs",
            "static+runs+green",
            "paella+runs+green",
            "reef+hold=0",
            "reef+hold=",
            "reef+hold=x",
            "reef+hold=100+nopad",
            "paella+hold=100",
        ] {
            assert_eq!(PolicyConfig::by_name(bad), None, "{bad}");
        }
    }
}

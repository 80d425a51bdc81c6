//! The swarm run shared by the MiniGpu and SimGpu tests.

#![allow(dead_code)]

use super::*;
use kairos_gpu::Gpu;
use kairos_ir::Tensor;
use kairos_ir::plan::Plan;
use kairos_sched::policy::PolicyConfig;
use kairos_sched::*;
use rand::RngExt;
use rand::rngs::SmallRng;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

pub struct Outcome {
    /// (id, done_ns, ok) in completion order.
    pub records: Vec<(RequestId, u64, bool)>,
}

/// One swarm run on `gpu` with a random workload from `rng`: checks every invariant listed in
/// tests/dispatcher.rs. With `preempt`, the policy also preempts running launches now and then.
pub fn run_swarm<G: Gpu>(rng: &mut SmallRng, gpu: G, policy: PolicyConfig, cfg: Config, preempt: bool) -> (Outcome, G) {
    eprintln!(
        "  policy {policy}{}, config {cfg:?}, gpu {} SMs {} queues",
        if preempt { " + preemption" } else { "" },
        gpu.info().sm_count,
        gpu.info().hardware_queues
    );
    let gpu = Audit::new(gpu);
    let (checked, violations, _decisions) = Checked::new(policy.clone());
    let boxed: Box<dyn kairos_sched::Policy> =
        if preempt { Box::new(Preempting::new(Box::new(checked), 40)) } else { Box::new(checked) };
    let mut driver = VirtualDriver::with_policy(cfg.clone(), gpu, boxed).unwrap();
    driver.set_checks(true);
    let rng = &mut *rng;

    let models = rng.random_range(1..=3);
    let mut plans: Vec<Arc<Plan>> = Vec::new();
    for m in 0..models {
        let plan = Arc::new(random_plan(rng, &format!("m{m}")));
        let info = driver.load_model(ModelSpec { name: format!("m{m}"), plan: plan.clone(), profile: None }).unwrap();
        assert_eq!(info.launches as usize, plan.launches.len());
        plans.push(plan);
    }
    assert!(matches!(
        driver.load_model(ModelSpec { name: "m0".into(), plan: plans[0].clone(), profile: None }),
        Err(Error::ModelExists(_))
    ));

    let n = rng.random_range(1..=60);
    let mut t = 0u64;
    let mut plan_of: HashMap<RequestId, Arc<Plan>> = HashMap::new();
    let mut cancelled: HashSet<RequestId> = HashSet::new();
    let mut wants_notice: HashSet<RequestId> = HashSet::new();
    let mut expect_error: HashMap<RequestId, &'static str> = HashMap::new();
    for _ in 0..n {
        t += rng.random_range(0..60_000);
        let m = rng.random_range(0..models);
        let skip_io = rng.random_bool(0.5);
        let options = RequestOptions {
            tenant: TenantId(rng.random_range(0..4)),
            class: if rng.random_bool(0.2) { Class::RealTime } else { Class::BestEffort },
            priority: rng.random_range(0..2),
            deadline_ns: rng.random_bool(0.3).then(|| rng.random_range(10_000..1_000_000)),
            skip_io,
            notify_before_done: rng.random_bool(0.5),
        };
        let notify = options.notify_before_done;
        let plan = &plans[m];
        let inputs = if skip_io { vec![] } else { plan.inputs.iter().map(|i| Tensor::zeros(i.dtype, i.shape.clone())).collect() };
        let id = driver.submit_at(t, &format!("m{m}"), inputs, options);
        plan_of.insert(id, plan.clone());
        if notify {
            wants_notice.insert(id);
        }
        if rng.random_bool(0.15) {
            driver.cancel_at(t + rng.random_range(0..300_000), id);
            cancelled.insert(id);
        }
    }
    // Requests that must fail: an unknown model, the wrong inputs.
    let bad_model = driver.submit_at(t / 2, "nope", vec![], RequestOptions::default());
    expect_error.insert(bad_model, "unknown model");
    let bad_inputs =
        driver.submit_at(t / 3, "m0", vec![Tensor::zeros(kairos_ir::DType::F32, vec![3]); 2], RequestOptions::default());
    expect_error.insert(bad_inputs, "invalid input");

    driver.run_until_idle().unwrap_or_else(|e| panic!("run failed: {e}"));

    // No request lost, none answered twice, every outcome allowed.
    let records = driver.records().to_vec();
    let mut seen = HashSet::new();
    let mut ok = HashSet::new();
    let mut lost = HashSet::new();
    for r in &records {
        assert!(seen.insert(r.id), "request {:?} answered twice", r.id);
        match (&r.result, expect_error.get(&r.id)) {
            (Err(Error::UnknownModel(_)), Some(&"unknown model")) | (Err(Error::InvalidInput(_)), Some(&"invalid input")) => {}
            // Limits are checked before inputs.
            (Err(Error::Overloaded { .. }), Some(&"invalid input")) => {}
            (_, Some(what)) => panic!("request {:?} should have failed with {what}: {:?}", r.id, r.result),
            (Ok(timing), None) => {
                ok.insert(r.id);
                assert!(
                    timing.done_ns >= timing.first_issue_ns
                        && timing.first_issue_ns >= timing.first_round_ns
                        && timing.first_round_ns >= timing.admitted_ns
                        && timing.admitted_ns >= timing.arrival_ns,
                    "request {:?}: timing out of order: {timing:?}",
                    r.id
                );
                let plan = &plan_of[&r.id];
                if !r.outputs.is_empty() {
                    assert_eq!(r.outputs.len(), plan.outputs.len());
                    assert_eq!(r.outputs[0].shape, plan.outputs[0].shape);
                }
            }
            (Err(Error::Cancelled), None) => assert!(cancelled.contains(&r.id), "request {:?} cancelled without a cancel", r.id),
            (Err(Error::Overloaded { .. }), None) => {}
            // A launch of it was lost (fault injection): it fails, the rest goes on.
            (Err(Error::Gpu(m)), None) if m.contains("was lost") => lost.insert(r.id).then_some(()).unwrap(),
            (Err(e), None) => panic!("request {:?} failed: {e}", r.id),
        }
    }
    assert_eq!(seen.len(), plan_of.len() + expect_error.len(), "requests lost");
    // Early wake-up notices: only to requests that asked, at most once, and to every one of them
    // that completed.
    let mut noticed = HashSet::new();
    for o in driver.take_other_outputs() {
        if let kairos_sched::Output::AlmostDone { id } = o {
            assert!(wants_notice.contains(&id), "request {id:?} got a notice it did not ask for");
            assert!(noticed.insert(id), "request {id:?} got two notices");
        }
    }
    for id in ok.iter().filter(|id| wants_notice.contains(id)) {
        assert!(noticed.contains(id), "request {id:?} completed without its notice");
    }
    assert_eq!(driver.outstanding(), 0);

    let d = driver.dispatcher();
    let stats = d.stats();
    assert!(lost.is_empty() || stats.launches_lost > 0, "requests failed as lost with no launch lost");
    assert_eq!(stats.refused_decisions, 0, "the dispatcher refused policy decisions");
    assert_eq!(stats.notification_anomalies, 0);
    assert_eq!(d.occupancy().anomalies(), 0, "mirrored occupancy disagreed with the GPU");
    assert!(d.occupancy().is_idle());
    assert_eq!((d.jobs(), d.launches_in_flight(), d.pending_ctas()), (0, 0, 0));
    let v = violations.lock().unwrap();
    assert!(v.is_empty(), "policy violations: {:?}", &v[..v.len().min(5)]);
    let trace = d.trace().to_vec();
    assert_eq!(stats.trace_dropped, 0);

    if let PolicyConfig::Fifo { .. } = policy {
        // One stream: jobs finish in the order they started.
        let mut done: Vec<_> =
            records.iter().filter_map(|r| r.result.as_ref().ok().map(|t| (t.first_issue_ns, t.done_ns))).collect();
        done.sort();
        assert!(done.windows(2).all(|w| w[0].1 <= w[1].1), "fifo finished jobs out of order");
    }

    eprintln!(
        "  {} requests: {} ok, {} cancelled, {} overloaded, {} lost; {} launches ({} behind another), {} decisions, {} preemptions, {} resumed launches",
        records.len(),
        ok.len(),
        records.iter().filter(|r| matches!(r.result, Err(Error::Cancelled))).count(),
        records.iter().filter(|r| matches!(r.result, Err(Error::Overloaded { .. }))).count(),
        lost.len(),
        stats.launches,
        trace.iter().filter(|r| r.behind).count(),
        stats.decisions,
        stats.preemptions,
        trace.iter().filter(|r| r.first_block > 0).count()
    );
    let gpu = driver.into_gpu();
    assert!(gpu.log.violations.is_empty(), "GPU audit: {:?}", &gpu.log.violations[..gpu.log.violations.len().min(5)]);
    check_blocks_and_deps(&trace, &gpu.log, &|r| plan_of[&r].clone(), &|r| ok.contains(&r));
    (Outcome { records: records.iter().map(|r| (r.id, r.done_ns, r.result.is_ok())).collect() }, gpu.inner)
}

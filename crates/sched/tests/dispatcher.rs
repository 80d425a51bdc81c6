//! Swarm tests of the dispatcher in virtual time: random plans, random configurations (every
//! policy, small limits), random arrivals and cancellations, on MiniGpu behind an auditing
//! wrapper. One seed drives every choice; `KAIROS_SEED=n` reruns one seed.
//!
//! Checked on every run: no request lost (each gets exactly one outcome, of an allowed kind);
//! each logical block of a completed request ran exactly once (at most once if cancelled), and
//! preempted launches resumed exactly; a launch started only after its plan dependencies ended;
//! no SM went over its limits; every policy decision was valid for the view it saw (gated
//! policies only issued kernels that passed the occupancy gate; `paella` served the most-owed
//! tenant above the threshold first, and SRPT otherwise); the dispatcher's mirrored occupancy saw
//! no anomaly and ends idle; `fifo` completes jobs in the order it started them; runs are
//! deterministic.

mod common;

use common::mini::MiniGpu;
use common::swarm::{Outcome, run_swarm};
use common::*;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

fn run_on_mini(seed: u64) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(seed);
    let policy = random_policy(&mut rng);
    let cfg = random_config(&mut rng, policy.clone());
    let preempt = policy.is_kernel_level() && rng.random_bool(0.3);
    let gpu = MiniGpu::new(random_mini_config(&mut rng, seed));
    run_swarm(&mut rng, gpu, policy, cfg, preempt).0
}

#[test]
fn swarm_on_mini_gpu() {
    for seed in seeds(600) {
        with_seed("swarm_on_mini_gpu", seed, |s| {
            run_on_mini(s);
        });
    }
}

#[test]
fn same_seed_same_run() {
    for seed in seeds(20) {
        with_seed("same_seed_same_run", seed, |s| {
            let a = run_on_mini(s);
            let b = run_on_mini(s);
            assert_eq!(a.records, b.records, "two runs of one seed differ");
        });
    }
}

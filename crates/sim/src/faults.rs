//! Faults the simulator injects on purpose (all off by default): what a real GPU and its driver
//! do wrong now and then, so that the dispatcher's and the engine's recovery can be tested in
//! virtual time, seed by seed.
//!
//! Each fault has a probability per occasion (a launch call, a launch, a notification), drawn
//! from the simulator's one seeded generator, and only when that probability is above 0, so a
//! simulator without faults makes exactly the draws it made before faults existed.

/// Faults injected by one simulated GPU; see the module docs. Probabilities are in 0..=1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults {
    /// Per launch: its notifications are lost and it is reported [`kairos_gpu::GpuEvent::LaunchLost`]
    /// when it ends, as the CUDA backend reports launches whose records a recovered ring lost.
    pub lose_launch: f64,
    /// Per notification: the ring overflows there: every record not yet read by the host is
    /// dropped, and each launch that lost a record is reported lost (at once if its end was among
    /// them, else when it ends). Copy completions are kept.
    pub ring_overflow: f64,
    /// Per notification: it is delivered twice.
    pub duplicate: f64,
    /// Per notification: it is delivered late by up to `late_ns_max` (records after it may
    /// overtake it: the host sees them out of order).
    pub late: f64,
    pub late_ns_max: u64,
    /// Per launch call: it fails with a driver error and nothing is queued.
    pub launch_failure: f64,
    /// Per launch: its blocks take `slow_factor` times as long.
    pub slow: f64,
    pub slow_factor: f64,
    /// Per launch: it never ends (a kernel that hangs, deaf to its preempt flag); only
    /// [`kairos_gpu::Gpu::reset`] clears it.
    pub stuck: f64,
    /// Per launch: it faults (an illegal address): it never ends, and from then on every call
    /// fails with the fault (a sticky error) until [`kairos_gpu::Gpu::reset`].
    pub sticky: f64,
}

/// A launch's blocks take this many times as long when it is stuck: ~10^4 s for a 10 µs block,
/// forever for any test.
pub(crate) const STUCK_SLOWDOWN: f64 = 1e9;

impl Faults {
    /// No fault at all (the default).
    pub fn none() -> Faults {
        Faults::default()
    }

    pub fn any(&self) -> bool {
        self != &Faults { slow_factor: self.slow_factor, late_ns_max: self.late_ns_max, ..Faults::default() }
    }

    /// Checks the probabilities and the factors.
    pub fn validate(&self) -> Result<(), String> {
        for (name, p) in [
            ("lose_launch", self.lose_launch),
            ("ring_overflow", self.ring_overflow),
            ("duplicate", self.duplicate),
            ("late", self.late),
            ("launch_failure", self.launch_failure),
            ("slow", self.slow),
            ("stuck", self.stuck),
            ("sticky", self.sticky),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("fault probability {name} = {p} is not in 0..=1"));
            }
        }
        if self.slow > 0.0 && !(self.slow_factor >= 1.0 && self.slow_factor.is_finite()) {
            return Err(format!("slow_factor = {} must be a finite factor >= 1", self.slow_factor));
        }
        Ok(())
    }
}

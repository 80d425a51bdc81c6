//! `streams-kernel`: kernel-by-kernel dispatch with no occupancy gate.
//!
//! **Guarantee:** a kernel is issued as soon as its plan dependencies are done and a stream of the
//! pool is idle, oldest job first; the dispatcher never holds a ready kernel back for occupancy.
//!
//! **Behaviour:** the dispatcher's virtual streams without its knowledge of the GPU: kernels of
//! different jobs interleave, but once issued they queue in the hardware, where the GPU, not the
//! dispatcher, decides who gets SMs next. It isolates what kernel-level dispatch buys from what
//! occupancy gating buys.

use super::{Decision, Policy, View, issue};

#[derive(Clone, Copy, Debug)]
pub struct StreamsKernel;

impl Policy for StreamsKernel {
    fn name(&self) -> &'static str {
        "streams-kernel"
    }

    fn decide(&self, view: &View<'_>) -> Option<Decision> {
        issue(view.jobs.iter().filter(|j| j.next_ready.is_some_and(|k| view.gpu.can_issue(&k))).min_by_key(|j| j.seq)?)
    }
}

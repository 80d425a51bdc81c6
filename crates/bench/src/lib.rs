//! kairos-bench: the benchmark harness. Workload generators, runners, reports and plots.

pub mod plot;

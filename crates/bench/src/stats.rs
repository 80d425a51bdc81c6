//! Percentiles and latency summaries, for every benchmark of the workspace (the harness's runs,
//! Paella's experiments, `kairos bench latency`, `bench cold`, the soak, the breakdown).
//!
//! Two definitions, both exact over all samples:
//! - [`nearest_rank`] (and [`percentile`], its `u64` form): the value of rank `ceil(p/100 * n)`,
//!   the classical nearest-rank percentile; every latency summary uses it.
//! - [`rounded_index`]: the value at index `round(p/100 * (n - 1))`; kept for the outputs that
//!   have always been computed so (`bench cold`'s quantiles, the soak's, the breakdown's), so
//!   their numbers do not change. On large sets the two differ by at most one rank.
//!
//! The harness's runs record into HdrHistograms ([`crate::metrics::Hist`]) and summarize into
//! the same [`LatencySummary`].

use serde::{Deserialize, Serialize};

/// Nearest-rank percentile of sorted values, `p` in [0, 100]: the value of rank `ceil(p/100 * n)`
/// (at least 1). `None` for an empty slice.
pub fn nearest_rank<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Nearest-rank percentile of sorted nanoseconds, `p` in [0, 100]; 0 for an empty slice.
pub fn percentile(sorted_ns: &[u64], p: f64) -> u64 {
    nearest_rank(sorted_ns, p).unwrap_or(0)
}

/// The value at index `round(p/100 * (n - 1))` of sorted values, `p` in [0, 100]. `None` for an
/// empty slice.
pub fn rounded_index<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let index = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    Some(sorted[index.min(sorted.len() - 1)])
}

/// Sorts floats in place in IEEE total order (NaNs last), for the functions above.
pub fn sort_f64(values: &mut [f64]) {
    values.sort_by(|a, b| a.total_cmp(b));
}

/// The latency of a set of requests, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
}

impl LatencySummary {
    /// Exact nearest-rank summary of all `values_ns` (any order); all zeros when there are none.
    pub fn of(mut values_ns: Vec<u64>) -> LatencySummary {
        values_ns.sort_unstable();
        LatencySummary::of_sorted(&values_ns)
    }

    /// [`LatencySummary::of`] for values already sorted.
    pub fn of_sorted(sorted_ns: &[u64]) -> LatencySummary {
        let Some(&max_ns) = sorted_ns.last() else { return LatencySummary::default() };
        let sum: f64 = sorted_ns.iter().map(|&v| v as f64).sum();
        LatencySummary {
            count: sorted_ns.len() as u64,
            mean_ns: sum / sorted_ns.len() as f64,
            p50_ns: percentile(sorted_ns, 50.0),
            p90_ns: percentile(sorted_ns, 90.0),
            p99_ns: percentile(sorted_ns, 99.0),
            p999_ns: percentile(sorted_ns, 99.9),
            max_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_of_one_to_a_hundred() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&v, 100.0), 100);
        assert_eq!(percentile(&v, 0.0), 1);
        assert_eq!(percentile(&[], 50.0), 0);
        let s = LatencySummary::of(vec![5, 1, 3]);
        assert_eq!((s.count, s.p50_ns, s.max_ns, s.mean_ns), (3, 3, 5, 3.0));
        assert_eq!(LatencySummary::of(vec![]).count, 0);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=50).collect();
        assert_eq!(nearest_rank(&v, 50.0), Some(25));
        assert_eq!(nearest_rank(&v, 99.0), Some(50));
        assert_eq!(nearest_rank(&[7u64], 99.0), Some(7));
        assert_eq!(nearest_rank::<u64>(&[], 50.0), None);
        let f = [-3.0, 0.5, 2.0];
        assert_eq!(nearest_rank(&f, 50.0), Some(0.5));
        assert_eq!(nearest_rank(&[-3i64], 99.0), Some(-3));
    }

    /// Nearest rank is not interpolation nor rounding to the nearest index: with ten values the
    /// 15th percentile has rank ceil(1.5) = 2, and the median of an even set is its lower middle.
    #[test]
    fn nearest_rank_rounds_the_rank_up_not_to_nearest() {
        let v: Vec<u64> = (1..=10).map(|x| x * 10).collect();
        assert_eq!(percentile(&v, 15.0), 20);
        assert_eq!(percentile(&v, 10.0), 10);
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 90.1), 100);
        // The rounded index differs: round(0.15 * 9) = 1 -> 20, round(0.5 * 9) = 5 (4.5 rounds up) -> 60.
        assert_eq!(rounded_index(&v, 15.0), Some(20));
        assert_eq!(rounded_index(&v, 50.0), Some(60));
        assert_eq!(rounded_index(&v, 10.0), Some(20));
        assert_eq!(rounded_index::<u64>(&[], 10.0), None);
        let s = LatencySummary::of(v);
        assert_eq!((s.p50_ns, s.p90_ns, s.p99_ns, s.p999_ns, s.max_ns), (50, 90, 100, 100, 100));
        assert_eq!(s.mean_ns, 55.0);
    }

    #[test]
    fn floats_sort_in_total_order() {
        let mut v = [3.0, -1.0, 2.5];
        sort_f64(&mut v);
        assert_eq!(v, [-1.0, 2.5, 3.0]);
        assert_eq!(rounded_index(&v, 50.0), Some(2.5));
    }
}

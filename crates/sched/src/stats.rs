//! Latency summaries (exact percentiles over all samples, nearest rank).

use serde::Serialize;

/// Nearest-rank percentile of sorted values, `p` in [0, 100].
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: usize,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
}

impl LatencySummary {
    pub fn of(mut values: Vec<u64>) -> LatencySummary {
        values.sort_unstable();
        if values.is_empty() {
            return LatencySummary::default();
        }
        let sum: f64 = values.iter().map(|&v| v as f64).sum();
        LatencySummary {
            count: values.len(),
            mean_ns: sum / values.len() as f64,
            p50_ns: percentile(&values, 50.0),
            p90_ns: percentile(&values, 90.0),
            p99_ns: percentile(&values, 99.0),
            p999_ns: percentile(&values, 99.9),
            max_ns: *values.last().unwrap(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&v, 100.0), 100);
        assert_eq!(percentile(&v, 0.0), 1);
        let s = LatencySummary::of(vec![5, 1, 3]);
        assert_eq!((s.count, s.p50_ns, s.max_ns, s.mean_ns), (3, 3, 5, 3.0));
        assert_eq!(LatencySummary::of(vec![]).count, 0);
    }
}

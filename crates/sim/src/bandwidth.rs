//! Max-min fair sharing of one bandwidth pool (device memory, the PCIe link in one direction).
//!
//! Every flow has a demand (the rate it would use uncontended) and a multiplicity (CTAs of one
//! launch share one demand). The pool's *water level* is the rate above which no flow is served:
//! flows that want less than the level get all they want, the others get the level, and together
//! they use the whole capacity. A level of infinity means the pool is not saturated.

/// One class of flows: `count` flows that each want `demand` (bytes per ns).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Flow {
    pub demand: f64,
    pub count: f64,
}

/// The water level of `capacity` shared among `flows` (sorted in place by demand).
pub(crate) fn water_level(capacity: f64, flows: &mut [Flow]) -> f64 {
    let total: f64 = flows.iter().map(|f| f.demand * f.count).sum();
    if total <= capacity {
        return f64::INFINITY;
    }
    flows.sort_by(|a, b| a.demand.total_cmp(&b.demand));
    let mut cap_left = capacity;
    let mut count_left: f64 = flows.iter().map(|f| f.count).sum();
    for f in flows.iter() {
        if count_left <= 0.0 {
            break;
        }
        let level = cap_left / count_left;
        if f.demand <= level {
            cap_left -= f.demand * f.count;
            count_left -= f.count;
        } else {
            return level;
        }
    }
    // Only reachable through rounding: every flow fit.
    f64::INFINITY
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(level: f64, flows: &[Flow]) -> f64 {
        flows.iter().map(|f| f.demand.min(level) * f.count).sum()
    }

    #[test]
    fn unsaturated_pool_has_no_level() {
        let mut f = [Flow { demand: 1.0, count: 2.0 }, Flow { demand: 3.0, count: 1.0 }];
        assert_eq!(water_level(10.0, &mut f), f64::INFINITY);
    }

    #[test]
    fn small_flows_keep_their_demand_and_big_ones_share_the_rest() {
        let mut f = [Flow { demand: 10.0, count: 2.0 }, Flow { demand: 1.0, count: 4.0 }];
        let level = water_level(12.0, &mut f);
        // 4 small flows take 4, two big ones share 8.
        assert!((level - 4.0).abs() < 1e-9, "{level}");
        assert!((served(level, &f) - 12.0).abs() < 1e-9);
    }

    #[test]
    fn saturated_pool_serves_exactly_its_capacity() {
        for cap in [0.5, 3.0, 7.7, 20.0] {
            let mut f = [Flow { demand: 0.3, count: 5.0 }, Flow { demand: 2.0, count: 3.0 }, Flow { demand: 9.0, count: 1.0 }];
            let level = water_level(cap, &mut f);
            let total: f64 = f.iter().map(|x| x.demand * x.count).sum();
            let want = cap.min(total);
            assert!((served(level, &f) - want).abs() < 1e-9, "cap {cap}: level {level}");
        }
    }
}

//! Fairness: per-tenant deficit counters (Paella's fairness between tenants).

use super::*;

impl<G: Gpu> Dispatcher<G> {
    pub(super) fn tenant_add(&mut self, tenant: TenantId) {
        match self.tenant_index.get(&tenant) {
            Some(&i) => self.tenants[i].active_jobs += 1,
            None => {
                self.tenant_index.insert(tenant, self.tenants.len());
                self.tenants.push(TenantView { tenant, active_jobs: 1, ready_jobs: 0, deficit_ns: 0.0 });
            }
        }
    }

    pub(super) fn tenant_remove(&mut self, tenant: TenantId, was_ready: bool) {
        let i = self.tenant_index[&tenant];
        let t = &mut self.tenants[i];
        t.active_jobs -= 1;
        if was_ready {
            t.ready_jobs -= 1;
        }
        if t.active_jobs == 0 {
            self.tenants.swap_remove(i);
            self.tenant_index.remove(&tenant);
            if let Some(moved) = self.tenants.get(i) {
                self.tenant_index.insert(moved.tenant, i);
            }
        }
    }

    /// Deficit counters: everyone with jobs earns an equal share of `cost`, the served tenant pays it.
    pub(super) fn charge(&mut self, tenant: TenantId, cost: f64) {
        let share = cost / self.tenants.len().max(1) as f64;
        for t in &mut self.tenants {
            t.deficit_ns = (t.deficit_ns + share).clamp(-DEFICIT_NS_MAX, DEFICIT_NS_MAX);
        }
        if let Some(&i) = self.tenant_index.get(&tenant) {
            let t = &mut self.tenants[i];
            t.deficit_ns = (t.deficit_ns - cost).clamp(-DEFICIT_NS_MAX, DEFICIT_NS_MAX);
        }
    }
}

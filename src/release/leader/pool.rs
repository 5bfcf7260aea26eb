//! A Calico IP pool (a `Key::Pool`, the pool guard): its gauges, and the holds in it past
//! a policy's `maxPoolShare` or the global `--max-pool-share` of its unallocated addresses
//! — released oldest first, at their policies' pace. It remembers which (pool, policy)
//! pairs it is releasing from (a `PoolShareReached` Event when one gets there).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use tracing::warn;

use super::context::Shared;
use crate::calico::entry;
use crate::events::policy_ref;
use crate::release::decide::{self, ReleaseReason};
use crate::release::{cap, consistency};

#[derive(Default)]
pub struct PoolWork {
    /// (pool, policy) pairs being released from.
    over_pool: Mutex<HashSet<(String, String)>>,
}

impl PoolWork {
    /// Holds whose address Calico's IPAM still has allocated (the Pod not yet gone) are
    /// neither counted nor released.
    pub async fn reconcile(&self, s: &Shared, name: &str) {
        let Some(store) = s.pools.as_ref().filter(|p| p.is_synced()) else { return };
        let gauges = &s.metrics.release.pools;
        let (Some(pool), Some(usage)) = (store.pools().into_iter().find(|p| p.name == name), store.usage(name)) else {
            gauges.forget(name);
            return;
        };
        let held = s.records.matching(|r| {
            consistency::check(r).is_ok()
                && entry::single_ip(&r.spec.cidr).is_some_and(|ip| pool.cidr.contains(&ip) && !store.is_allocated(ip))
        });
        let unused = usage.unused();
        gauges.set(name, usage.size, unused.saturating_sub(held.len() as u128), held.len());
        if pool.disabled {
            return;
        }
        let matcher = s.matcher.load();
        let now = Timestamp::now();
        let victims = {
            let pacer = s.pacer();
            let counted: Vec<cap::Counted<'_>> = held
                .iter()
                .filter(|r| s.in_scope(&r.spec.policy) && !pacer.contains(r))
                .map(|r| cap::Counted {
                    name: r.metadata.name.as_deref().unwrap_or_default(),
                    group: &r.spec.policy,
                    namespace: &r.spec.pod.namespace,
                    // The pool guard counts only holds whose address Calico freed.
                    present: false,
                    created: r.metadata.creation_timestamp.as_ref().map_or(r.spec.reserved_at.0, |t| t.0),
                    reserved_at: r.spec.reserved_at.0,
                    // Counted, never chosen, while a sticky claim keeps it.
                    kept: r
                        .claim()
                        .and_then(|c| decide::claim_pending(c, matcher.get(&r.spec.policy).map(|p| &**p), now))
                        .is_some(),
                })
                .collect();
            let share = |p: &str| matcher.get(p).and_then(|c| c.max_pool_share);
            cap::over_pool_share(unused, s.settings.max_pool_share, share, counted)
        };
        let mut by_policy: BTreeMap<String, Vec<Arc<capo_api::ReservedIP>>> = BTreeMap::new();
        for v in &victims {
            if let Some(record) = s.records.get(v) {
                by_policy.entry(record.spec.policy.clone()).or_default().push(record);
            }
        }
        let newly_over: Vec<String> = {
            let mut over_pool = self.over_pool.lock().expect("pool memory lock");
            over_pool.retain(|(p, policy)| p != name || by_policy.contains_key(policy));
            by_policy.keys().filter(|policy| over_pool.insert((name.to_string(), (*policy).clone()))).cloned().collect()
        };
        let max_share = s.settings.max_pool_share;
        for policy in newly_over {
            let bound = match matcher.get(&policy).and_then(|c| c.max_pool_share) {
                Some(share) => format!("maxPoolShare={share}% or --max-pool-share={max_share}%"),
                None => format!("--max-pool-share={max_share}%"),
            };
            let note = format!(
                "IP pool {name} ({}): capo holds {} of its {unused} unallocated addresses, more than {bound}: releasing this policy's oldest holds in it",
                pool.cidr,
                held.len()
            );
            warn!(
                pool = name,
                policy,
                held = held.len(),
                unused = unused as u64,
                "pool guard: releasing the oldest holds"
            );
            s.events.publish(&policy_ref(&policy), EventType::Warning, "PoolShareReached", "Release", note).await;
        }
        for (policy, records) in by_policy {
            s.submit(&policy, records.into_iter().map(|r| s.leaving(r, ReleaseReason::Pool, now)));
        }
    }
}

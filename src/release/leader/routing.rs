//! Events → keys. An event touches only the keys it concerns: a Pod's event its own
//! records, a policy's edit that policy's records, a shard's change the records of the
//! entries it gained or lost, a record's change its policy, shard and pool. Missed events
//! (a lagging receiver, a relist) mean looking at everything again.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use capo_api::CalicoApiGroup;
use capo_api::reserved_ip::record_name;
use kube::ResourceExt;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, watch};

use super::Leader;
use super::context::{Key, POOL_SETTLE};
use crate::calico::writing::Groups;
use crate::calico::{IndexEvent, entry};
use crate::store::pods::PodEvent;
use crate::store::records::RecordEvent;
use crate::store::workloads::WorkloadEvent;

/// How long a shard's changes are gathered before repair looks at it. A look reads every
/// entry of the shard, and each hold changes its shard and its record: looking once per
/// change made a hold's cost grow with the shard. Repair acts only on mismatches older
/// than the settle time (seconds), and a non-CIDR entry is still removed within this.
const SHARD_GATHER: Duration = Duration::from_millis(500);

/// How long record changes are gathered before their policy's cap is looked at (a look
/// reads all of the policy's holds; a storm changes many at once). Well within any
/// `releaseInterval`.
const POLICY_GATHER: Duration = Duration::from_millis(100);

/// The release work's subscriptions, taken before anything is listed so that no change is
/// missed.
pub struct Receivers {
    pub pods: broadcast::Receiver<PodEvent>,
    pub namespaces: broadcast::Receiver<String>,
    pub workloads: broadcast::Receiver<WorkloadEvent>,
    pub records: broadcast::Receiver<RecordEvent>,
    pub index: broadcast::Receiver<IndexEvent>,
    pub policies: broadcast::Receiver<()>,
    pub pools: Option<broadcast::Receiver<String>>,
    /// Where new holds go, and where Calico reads (a datastore migration moves both).
    pub writing: watch::Receiver<Groups>,
}

/// The next pool change, or never when there is no pool guard.
async fn next_pool(rx: &mut Option<broadcast::Receiver<String>>) -> Result<String, RecvError> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// A received event, or a sign that some were lost (look at everything again).
pub fn got<T: Clone>(r: Result<T, RecvError>) -> Option<Option<T>> {
    match r {
        Ok(v) => Some(Some(v)),
        Err(RecvError::Lagged(_)) => Some(None),
        Err(RecvError::Closed) => None,
    }
}

impl Leader {
    pub(super) fn enqueue_everything(&self) {
        let s = &self.s;
        for name in s.records.all_names() {
            s.queue.add(Key::Record(name));
        }
        let mut policies: BTreeSet<String> = s.records.policies().into_iter().collect();
        policies.extend(s.matcher.load().policies().iter().map(|p| p.name.clone()));
        for p in policies {
            s.queue.add(Key::Policy(p));
        }
        for (group, view) in s.index.all().into_values() {
            s.queue.add(Key::Shard(group, view.name.clone()));
        }
        for (ns, name) in s.pods.keys() {
            self.pod_changed(&ns, &name);
        }
        self.policies_changed();
        s.all_pools_changed();
    }

    /// A Pod changed: its records (whether it is still there also decides their place at
    /// the cap).
    fn pod_changed(&self, namespace: &str, name: &str) {
        let s = &self.s;
        for r in s.records.for_pod(namespace, name) {
            if let Some(rec) = s.records.get(&r) {
                self.records.note_pod_gone(s, &rec);
                if s.in_scope(&rec.spec.policy) {
                    s.queue.add_after(Key::Policy(rec.spec.policy.clone()), POLICY_GATHER);
                }
            }
            s.queue.add(Key::Record(r));
        }
    }

    /// The policies changed: the ones whose compiled form differs, and their records.
    fn policies_changed(&self) {
        let s = &self.s;
        let changed = self.policies.changed(s);
        if !changed.is_empty() {
            s.all_pools_changed();
        }
        for p in changed {
            for r in s.records.for_policy(&p) {
                s.queue.add(Key::Record(r));
            }
            s.queue.add(Key::Policy(p));
        }
    }

    fn record_changed(
        &self,
        name: String,
        before: Option<Arc<capo_api::ReservedIP>>,
        after: Option<Arc<capo_api::ReservedIP>>,
    ) {
        let s = &self.s;
        for r in before.iter().chain(&after) {
            s.pool_of_changed(&r.spec.cidr);
            s.queue.add_after(Key::Policy(r.spec.policy.clone()), POLICY_GATHER);
            if let Ok(group) = r.spec.calico_api_group.parse::<CalicoApiGroup>() {
                let group = s.index.canonical(group);
                s.queue.add_after(Key::Shard(group, r.spec.reservation.clone()), SHARD_GATHER);
            }
        }
        if let Some(old) = &before
            && after.as_ref().is_none_or(|a| a.metadata.uid != old.metadata.uid)
        {
            s.pacer().seen_gone(&name, old.metadata.uid.as_deref());
        }
        if let Some(rec) = &after {
            self.records.note_pod_gone(s, rec);
        }
        if let (None, Some(new)) = (&before, &after) {
            self.policies.arrived(&new.spec.policy);
        }
        s.queue.add(Key::Record(name));
    }

    /// Turns events into keys until the term ends.
    pub(super) async fn pump(self: Arc<Self>, mut rx: Receivers) {
        let s = &self.s;
        let mut writing_told = true;
        loop {
            tokio::select! {
                e = rx.pods.recv() => match got(e) {
                    Some(Some(PodEvent::Changed { namespace, name })) => self.pod_changed(&namespace, &name),
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.namespaces.recv() => match got(e) {
                    Some(Some(ns)) if !ns.is_empty() => {
                        for r in s.records.for_namespace(&ns) {
                            s.queue.add(Key::Record(r));
                        }
                    }
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.workloads.recv() => match got(e) {
                    Some(Some(WorkloadEvent::Changed((ns, kind, name)))) => {
                        for r in s.records.for_controller(&ns, &kind, &name) {
                            s.queue.add(Key::Record(r));
                        }
                    }
                    Some(Some(WorkloadEvent::Listed { kind })) => {
                        let owned = |r: &capo_api::ReservedIP| r.spec.pod.controller.as_ref().is_some_and(|c| c.kind == kind);
                        for r in s.records.matching(owned) {
                            s.queue.add(Key::Record(r.name_any()));
                        }
                    }
                    Some(None) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.records.recv() => match got(e) {
                    Some(Some(RecordEvent::Changed { name, before, after })) => self.record_changed(name, before, after),
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.index.recv() => match got(e) {
                    Some(Some(IndexEvent::Shard { key, added, removed })) => {
                        for e in added.iter().chain(&removed) {
                            if let Some(ip) = entry::single_ip(e) {
                                s.queue.add(Key::Record(record_name(ip)));
                            }
                        }
                        s.queue.add_after(Key::Shard(key.0, key.1), SHARD_GATHER);
                    }
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.policies.recv() => match got(e) {
                    Some(_) => self.policies_changed(),
                    None => return,
                },
                moved = rx.writing.changed(), if writing_told => match moved {
                    // Every hold is looked at again: those only in the old group are
                    // re-asserted where Calico reads now.
                    Ok(()) => self.enqueue_everything(),
                    Err(_) => writing_told = false,
                },
                e = next_pool(&mut rx.pools) => match got(e) {
                    Some(Some(pool)) if !pool.is_empty() => s.queue.add_after(Key::Pool(pool), POOL_SETTLE),
                    Some(_) => s.all_pools_changed(),
                    None => return,
                },
            }
            s.metrics.release.queue_depth.set(s.queue.busy() as i64);
        }
    }
}

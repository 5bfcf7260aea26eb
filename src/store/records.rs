//! The leader's index of `ReservedIP` records, in every Calico API group: by name, by the
//! Pod they hold for, by policy, by namespace and by the Pod's controller, so that one
//! event touches only the holds it concerns.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use crate::store::Guarded;
use capo_api::ReservedIP;
use kube::api::Api;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::{broadcast, watch};

use super::{Change, guarded_watch};

/// A record was added, changed or removed.
#[derive(Clone, Debug)]
pub enum RecordEvent {
    Changed { name: String, before: Option<Arc<ReservedIP>>, after: Option<Arc<ReservedIP>> },
    Resync,
}

#[derive(Default)]
struct Inner {
    records: HashMap<String, Arc<ReservedIP>>,
    by_pod: HashMap<(String, String), BTreeSet<String>>,
    /// The records themselves, by policy: a policy's reconcile reads all of them, on every
    /// change of one, so no lookup per record.
    by_policy: HashMap<String, BTreeMap<String, Arc<ReservedIP>>>,
    by_namespace: HashMap<String, BTreeSet<String>>,
    by_controller: HashMap<(String, String, String), BTreeSet<String>>,
}

/// A record as the leader keeps it: without `managedFields`, which it never reads and
/// which the API server's field tracking makes the largest part of a record in memory
/// (a tree of values per writer: the webhook's create, the leader's status writes).
pub fn trim(mut record: ReservedIP) -> ReservedIP {
    record.metadata.managed_fields = None;
    record
}

/// (namespace, pod name), policy, namespace, (namespace, controller kind, controller name).
type RecordKeys = ((String, String), String, String, Option<(String, String, String)>);

fn keys(r: &ReservedIP) -> RecordKeys {
    let p = &r.spec.pod;
    (
        (p.namespace.clone(), p.name.clone()),
        r.spec.policy.clone(),
        p.namespace.clone(),
        p.controller.as_ref().map(|c| (p.namespace.clone(), c.kind.clone(), c.name.clone())),
    )
}

fn unlink<K: std::hash::Hash + Eq>(map: &mut HashMap<K, BTreeSet<String>>, key: K, name: &str) {
    if let Some(set) = map.get_mut(&key) {
        set.remove(name);
        if set.is_empty() {
            map.remove(&key);
        }
    }
}

impl Inner {
    fn remove(&mut self, name: &str) -> Option<Arc<ReservedIP>> {
        let old = self.records.remove(name)?;
        let (pod, policy, ns, controller) = keys(&old);
        unlink(&mut self.by_pod, pod, name);
        if let Some(m) = self.by_policy.get_mut(&policy) {
            m.remove(name);
            if m.is_empty() {
                self.by_policy.remove(&policy);
            }
        }
        unlink(&mut self.by_namespace, ns, name);
        if let Some(c) = controller {
            unlink(&mut self.by_controller, c, name);
        }
        Some(old)
    }

    fn insert(&mut self, record: Arc<ReservedIP>) -> Option<Arc<ReservedIP>> {
        let name = record.name_any();
        let old = self.remove(&name);
        let (pod, policy, ns, controller) = keys(&record);
        self.by_pod.entry(pod).or_default().insert(name.clone());
        self.by_policy.entry(policy).or_default().insert(name.clone(), record.clone());
        self.by_namespace.entry(ns).or_default().insert(name.clone());
        if let Some(c) = controller {
            self.by_controller.entry(c).or_default().insert(name.clone());
        }
        self.records.insert(name, record);
        old
    }
}

pub struct RecordIndex {
    inner: RwLock<Inner>,
    events: broadcast::Sender<RecordEvent>,
    synced: watch::Sender<bool>,
}

impl Default for RecordIndex {
    fn default() -> Self {
        Self { inner: Default::default(), events: broadcast::channel(8192).0, synced: watch::Sender::new(false) }
    }
}

impl RecordIndex {
    pub fn get(&self, name: &str) -> Option<Arc<ReservedIP>> {
        self.inner.read().expect("record index lock").records.get(name).cloned()
    }

    fn names(&self, pick: impl FnOnce(&Inner) -> Option<&BTreeSet<String>>) -> Vec<String> {
        let inner = self.inner.read().expect("record index lock");
        pick(&inner).map(|s| s.iter().cloned().collect()).unwrap_or_default()
    }

    /// Records whose Pod is `namespace/name` (whatever its UID).
    pub fn for_pod(&self, namespace: &str, name: &str) -> Vec<String> {
        self.names(|i| i.by_pod.get(&(namespace.to_string(), name.to_string())))
    }

    pub fn for_policy(&self, policy: &str) -> Vec<String> {
        let inner = self.inner.read().expect("record index lock");
        inner.by_policy.get(policy).map(|m| m.keys().cloned().collect()).unwrap_or_default()
    }

    pub fn for_namespace(&self, namespace: &str) -> Vec<String> {
        self.names(|i| i.by_namespace.get(namespace))
    }

    pub fn for_controller(&self, namespace: &str, kind: &str, name: &str) -> Vec<String> {
        self.names(|i| i.by_controller.get(&(namespace.to_string(), kind.to_string(), name.to_string())))
    }

    /// The records of `policy` themselves.
    pub fn records_of(&self, policy: &str) -> Vec<Arc<ReservedIP>> {
        let inner = self.inner.read().expect("record index lock");
        inner.by_policy.get(policy).map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    /// The records `keep` accepts (a scan of all of them).
    pub fn matching(&self, keep: impl Fn(&ReservedIP) -> bool) -> Vec<Arc<ReservedIP>> {
        let inner = self.inner.read().expect("record index lock");
        inner.records.values().filter(|r| keep(r)).cloned().collect()
    }

    pub fn policies(&self) -> Vec<String> {
        self.inner.read().expect("record index lock").by_policy.keys().cloned().collect()
    }

    pub fn all_names(&self) -> Vec<String> {
        self.inner.read().expect("record index lock").records.keys().cloned().collect()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<RecordEvent> {
        self.events.subscribe()
    }

    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Puts a record in by hand (tests).
    pub fn put(&self, record: ReservedIP) {
        self.inner.write().expect("record index lock").insert(Arc::new(record));
    }

    pub async fn watch(self: Arc<Self>, client: Client) {
        let api = Api::<Guarded<ReservedIP>>::all(client);
        let mut listing = Vec::new();
        guarded_watch("reservedips", api, watcher::Config::default(), |change| match change {
            Change::Restart => listing.clear(),
            Change::Apply { object, initial: true } => listing.push(Arc::new(trim(object))),
            Change::Listed => {
                let mut fresh = Inner::default();
                for r in listing.drain(..) {
                    fresh.insert(r);
                }
                *self.inner.write().expect("record index lock") = fresh;
                self.synced.send_replace(true);
                let _ = self.events.send(RecordEvent::Resync);
            }
            Change::Apply { object, initial: false } => {
                let name = object.name_any();
                let after = Arc::new(trim(object));
                let before = self.inner.write().expect("record index lock").insert(after.clone());
                let _ = self.events.send(RecordEvent::Changed { name, before, after: Some(after) });
            }
            Change::Delete(object) => {
                let name = object.name_any();
                let before = self.inner.write().expect("record index lock").remove(&name);
                let _ = self.events.send(RecordEvent::Changed { name, before, after: None });
            }
            Change::Invalid(_) | Change::Failed(_) => {}
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What the leader reads of a record survives the trim; the field tracking does not.
    #[test]
    fn a_kept_record_has_everything_but_its_managed_fields() {
        let whole: ReservedIP = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
            "metadata": { "name": "10.0.0.1", "uid": "u1", "resourceVersion": "7",
                "creationTimestamp": "2026-11-25T05:00:00Z",
                "managedFields": [{ "manager": "capo", "operation": "Update", "apiVersion": "capo.io/v1alpha1",
                    "fieldsType": "FieldsV1", "fieldsV1": { "f:spec": { "f:ip": {} } } }] },
            "spec": { "ip": "10.0.0.1", "cidr": "10.0.0.1/32", "reservation": "capo-p",
                "calicoApiGroup": "crd.projectcalico.org/v1", "policy": "p",
                "pod": { "namespace": "ns", "name": "redis-0", "uid": "pod-uid" },
                "trigger": "Delete", "reservedAt": "2026-11-25T05:00:00.000000Z", "reserveFor": "40m" },
            "status": { "podGoneAt": "2026-11-25T05:00:01.000000Z", "releaseAt": "2026-11-25T05:40:01.000000Z" },
        }))
        .unwrap();
        let kept = trim(whole.clone());
        assert!(kept.metadata.managed_fields.is_none());
        assert_eq!(kept.spec, whole.spec);
        assert_eq!(kept.status, whole.status);
        assert_eq!(
            (kept.metadata.uid, kept.metadata.resource_version, kept.metadata.creation_timestamp),
            (whole.metadata.uid, whole.metadata.resource_version, whole.metadata.creation_timestamp)
        );
    }
}

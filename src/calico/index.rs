//! The watched copy of capo-owned reservations, in every Calico API group the cluster
//! serves: shards by name, which shard holds an entry, and how full each is. The webhook
//! picks shards and checks for entries already held from it; the leader releases from it
//! (no read before a write). Subscribers get the entries each change added or removed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};

use capo_api::CalicoApiGroup;
use capo_api::calico::RESERVED_CIDRS;
use capo_api::keys::{LEADER_EPOCH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{broadcast, watch};
use tracing::warn;

use super::datastore::{ETCD_RESERVATIONS, object_of};
use super::etcd::{Etcd, Kv, PrefixEvent};

/// A reservation, by API group and name.
pub type ShardKey = (CalicoApiGroup, String);

/// One capo-owned reservation as last seen.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardView {
    pub name: String,
    /// Its `capo.io/policy` label.
    pub policy: Option<String>,
    pub entries: Vec<String>,
    /// The epoch of the last leader that stamped it ([`LEADER_EPOCH_ANNOTATION`]).
    pub epoch: Option<u64>,
    pub has_annotations: bool,
    pub resource_version: Option<String>,
}

impl ShardView {
    pub fn from_object(obj: &DynamicObject) -> Self {
        let entries = obj.data["spec"][RESERVED_CIDRS]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
            .unwrap_or_default();
        Self {
            name: obj.name_any(),
            policy: obj.labels().get(POLICY_LABEL).cloned(),
            entries,
            epoch: obj.annotations().get(LEADER_EPOCH_ANNOTATION).and_then(|e| e.parse().ok()),
            has_annotations: obj.metadata.annotations.is_some(),
            resource_version: obj.metadata.resource_version.clone(),
        }
    }

    pub fn position(&self, entry: &str) -> Option<usize> {
        self.entries.iter().position(|e| e == entry)
    }

    pub fn is_owned(obj: &DynamicObject) -> bool {
        obj.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY_VALUE)
    }
}

/// What changed in the index.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexEvent {
    /// A shard was added, changed or removed: the entries it gained and lost.
    Shard { key: ShardKey, added: Vec<String>, removed: Vec<String> },
    /// The index was rebuilt from a fresh list: look at everything again.
    Resync,
}

#[derive(Default)]
struct Inner {
    shards: HashMap<ShardKey, Arc<ShardView>>,
    /// entry → the shards that list it (normally one).
    by_entry: HashMap<String, Vec<ShardKey>>,
}

impl Inner {
    fn unlink(&mut self, key: &ShardKey, entries: &[String]) {
        for e in entries {
            if let Some(keys) = self.by_entry.get_mut(e) {
                keys.retain(|k| k != key);
                if keys.is_empty() {
                    self.by_entry.remove(e);
                }
            }
        }
    }

    fn link(&mut self, key: &ShardKey, entries: &[String]) {
        for e in entries {
            // Nearly always one shard: no room kept for more.
            let keys = self.by_entry.entry(e.clone()).or_insert_with(|| Vec::with_capacity(1));
            if !keys.contains(key) {
                keys.push(key.clone());
            }
        }
    }

    /// Stores `view` under `key` (`None`: removes it); returns the entries added and removed.
    fn put(&mut self, key: &ShardKey, view: Option<ShardView>) -> (Vec<String>, Vec<String>) {
        let old = self.shards.remove(key);
        let before: HashSet<&str> = old.iter().flat_map(|o| o.entries.iter().map(String::as_str)).collect();
        let after: HashSet<&str> = view.iter().flat_map(|v| v.entries.iter().map(String::as_str)).collect();
        let added: Vec<String> = after.difference(&before).map(|s| s.to_string()).collect();
        let removed: Vec<String> = before.difference(&after).map(|s| s.to_string()).collect();
        self.unlink(key, &removed);
        self.link(key, &added);
        if let Some(v) = view {
            self.shards.insert(key.clone(), Arc::new(v));
        }
        (added, removed)
    }
}

pub struct ReservationIndex {
    inner: RwLock<Inner>,
    events: broadcast::Sender<IndexEvent>,
    synced: watch::Sender<HashSet<CalicoApiGroup>>,
}

impl Default for ReservationIndex {
    fn default() -> Self {
        Self {
            inner: Default::default(),
            events: broadcast::channel(4096).0,
            synced: watch::Sender::new(HashSet::new()),
        }
    }
}

impl ReservationIndex {
    pub fn get(&self, group: CalicoApiGroup, name: &str) -> Option<Arc<ShardView>> {
        self.inner.read().expect("index lock").shards.get(&(group, name.to_string())).cloned()
    }

    /// The shards (of any group) that list `entry`.
    pub fn shards_with(&self, entry: &str) -> Vec<(CalicoApiGroup, Arc<ShardView>)> {
        let inner = self.inner.read().expect("index lock");
        inner
            .by_entry
            .get(entry)
            .into_iter()
            .flatten()
            .filter_map(|k| inner.shards.get(k).map(|v| (k.0, v.clone())))
            .collect()
    }

    /// Every shard, by key.
    pub fn all(&self) -> BTreeMap<(String, String), (CalicoApiGroup, Arc<ShardView>)> {
        let inner = self.inner.read().expect("index lock");
        inner.shards.iter().map(|(k, v)| ((k.0.api_version(), k.1.clone()), (k.0, v.clone()))).collect()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<IndexEvent> {
        self.events.subscribe()
    }

    /// Waits until the first list of `group` is in.
    pub async fn synced(&self, group: CalicoApiGroup) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| s.contains(&group)).await;
    }

    fn apply(&self, group: CalicoApiGroup, view: ShardView) {
        let key = (group, view.name.clone());
        let (added, removed) = self.inner.write().expect("index lock").put(&key, Some(view));
        let _ = self.events.send(IndexEvent::Shard { key, added, removed });
    }

    fn delete(&self, group: CalicoApiGroup, name: String) {
        let key = (group, name);
        let (added, removed) = self.inner.write().expect("index lock").put(&key, None);
        let _ = self.events.send(IndexEvent::Shard { key, added, removed });
    }

    fn replace(&self, group: CalicoApiGroup, views: Vec<ShardView>) {
        {
            let mut inner = self.inner.write().expect("index lock");
            let stale: Vec<ShardKey> = inner.shards.keys().filter(|k| k.0 == group).cloned().collect();
            for k in stale {
                inner.put(&k, None);
            }
            for v in views {
                let key = (group, v.name.clone());
                inner.put(&key, Some(v));
            }
        }
        self.synced.send_modify(|s| {
            s.insert(group);
        });
        let _ = self.events.send(IndexEvent::Resync);
    }

    /// Keeps the index current for `group` (capo-owned objects only) until the task is
    /// dropped.
    pub async fn watch(self: Arc<Self>, client: Client, group: CalicoApiGroup) {
        let api = Api::<DynamicObject>::all_with(client, &group.ip_reservation());
        let config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
        let what = match group {
            CalicoApiGroup::CrdV1 => "reservations (crd.projectcalico.org/v1)",
            CalicoApiGroup::V3 => "reservations (projectcalico.org/v3)",
        };
        let mut events = watcher(api, config).default_backoff().boxed();
        let mut listing = Vec::new();
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(obj)) => listing.push(ShardView::from_object(&obj)),
                Ok(watcher::Event::InitDone) => self.replace(group, std::mem::take(&mut listing)),
                Ok(watcher::Event::Apply(obj)) => self.apply(group, ShardView::from_object(&obj)),
                Ok(watcher::Event::Delete(obj)) => self.delete(group, obj.name_any()),
                Err(e) => warn!(watch = what, error = %e, "watching capo's IPReservations failed; retrying"),
            }
        }
    }

    /// Keeps the index current from Calico's etcd datastore (capo-owned
    /// `projectcalico.org/v3` objects only) until the task is dropped. A value capo cannot
    /// read is reported and skipped, as the API server's watches skip one.
    pub async fn watch_etcd(self: Arc<Self>, etcd: Etcd) {
        let group = CalicoApiGroup::V3;
        let owned = |kv: &Kv| -> Option<ShardView> {
            match object_of(kv) {
                Some(obj) => ShardView::is_owned(&obj).then(|| ShardView::from_object(&obj)),
                None => {
                    warn!(key = kv.key, "a value in Calico's etcd is not an IPReservation capo can read; skipped");
                    None
                }
            }
        };
        let name_of = |key: &str| key.strip_prefix(ETCD_RESERVATIONS).unwrap_or(key).to_string();
        let mut events = etcd.follow(ETCD_RESERVATIONS.to_string()).boxed();
        while let Some(event) = events.next().await {
            match event {
                PrefixEvent::Listed(kvs) => self.replace(group, kvs.iter().filter_map(owned).collect()),
                PrefixEvent::Put(kv) => match owned(&kv) {
                    Some(view) => self.apply(group, view),
                    None if self.get(group, &name_of(&kv.key)).is_some() => self.delete(group, name_of(&kv.key)),
                    None => {}
                },
                PrefixEvent::Deleted(key) if self.get(group, &name_of(&key)).is_some() => {
                    self.delete(group, name_of(&key))
                }
                PrefixEvent::Deleted(_) => {}
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn put_for_test(&self, group: CalicoApiGroup, view: ShardView) {
        self.apply(group, view);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(name: &str, entries: &[&str]) -> ShardView {
        ShardView { name: name.into(), entries: entries.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn entries_are_indexed_and_changes_reported() {
        let index = ReservationIndex::default();
        let mut events = index.subscribe();
        index.apply(CalicoApiGroup::CrdV1, view("capo-p", &["10.0.0.1/32", "10.0.0.2/32"]));
        index.apply(CalicoApiGroup::V3, view("capo-p", &["10.0.0.1/32"]));
        assert_eq!(index.shards_with("10.0.0.1/32").len(), 2);
        index.apply(CalicoApiGroup::CrdV1, view("capo-p", &["10.0.0.2/32", "10.0.0.3/32"]));
        assert_eq!(index.shards_with("10.0.0.1/32").len(), 1);
        assert_eq!(index.shards_with("10.0.0.3/32")[0].1.name, "capo-p");
        events.try_recv().unwrap();
        events.try_recv().unwrap();
        match events.try_recv().unwrap() {
            IndexEvent::Shard { added, removed, .. } => {
                assert_eq!(added, vec!["10.0.0.3/32".to_string()]);
                assert_eq!(removed, vec!["10.0.0.1/32".to_string()]);
            }
            other => panic!("{other:?}"),
        }
        index.delete(CalicoApiGroup::V3, "capo-p".into());
        assert!(index.shards_with("10.0.0.1/32").is_empty());
        index.replace(CalicoApiGroup::CrdV1, vec![view("capo-q", &["10.0.0.9/32"])]);
        assert!(index.get(CalicoApiGroup::CrdV1, "capo-p").is_none());
        assert_eq!(index.shards_with("10.0.0.9/32").len(), 1);
    }
}

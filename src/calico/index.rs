//! The watched copy of capo-owned reservations, in every Calico API group the cluster
//! serves: shards by name, which shard holds an entry, and how full each is. The webhook
//! picks shards and checks for entries already held from it; the leader releases from it
//! (no read before a write). Subscribers get the entries each change added or removed.
//!
//! One stored object is one shard, whatever API serves it: where calico-apiserver serves
//! `projectcalico.org/v3` as a view of the `crd.projectcalico.org/v1` objects, only one
//! group is watched and the other is an alias of it ([`ReservationIndex::with_alias`]).
//! A write through that view moves every label and annotation of the stored object into
//! one annotation, [`CALICO_METADATA_ANNOTATION`]; a shard is read the way Calico reads
//! it back (its labels and annotations merged with those in that annotation), so capo
//! still knows it as its own, and [`ShardView::moved`] says its labels need putting back.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

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

/// Where Calico keeps the labels and annotations of an object written through
/// `projectcalico.org/v3` (by calico-apiserver, `calicoctl`, or Calico's own client on the
/// Kubernetes datastore): one JSON `ObjectMeta` in this annotation of the stored
/// `crd.projectcalico.org/v1` object.
pub const CALICO_METADATA_ANNOTATION: &str = "projectcalico.org/metadata";

/// How long after this replica first saw an entry in a shard the leader leaves it there
/// (a release or repair of it waits out the rest). A repeated review of a deletion this
/// replica held less than [`crate::hold`]'s `ANSWERED_FROM_ACK` ago is answered from the
/// append's acknowledgement, with no read: this is what makes that answer still true.
/// The entry's write was sent before it was committed, and no watch shows it before its
/// commit, so its removal comes at least this long after the append was sent.
pub const YOUNG_ENTRY: Duration = Duration::from_secs(6);

/// What [`CALICO_METADATA_ANNOTATION`] holds that capo reads.
#[derive(Default, serde::Deserialize)]
struct MovedMetadata {
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

/// An object's labels and annotations as Calico reads them back: its own, merged with
/// those moved into [`CALICO_METADATA_ANNOTATION`] (which win), that annotation left out.
/// `moved` says whether any were found there.
pub struct Effective {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub moved: bool,
}

impl Effective {
    pub fn of(obj: &DynamicObject) -> Self {
        let mut labels = obj.labels().clone();
        let mut annotations = obj.annotations().clone();
        let moved = annotations
            .remove(CALICO_METADATA_ANNOTATION)
            .and_then(|m| serde_json::from_str::<MovedMetadata>(&m).ok())
            .unwrap_or_default();
        let found = moved.labels.as_ref().is_some_and(|l| !l.is_empty())
            || moved.annotations.as_ref().is_some_and(|a| !a.is_empty());
        labels.extend(moved.labels.unwrap_or_default());
        annotations.extend(moved.annotations.unwrap_or_default());
        Self { labels, annotations, moved: found }
    }

    pub fn is_owned(&self) -> bool {
        self.labels.get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY_VALUE)
    }
}

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
    /// A write through `projectcalico.org/v3` moved its labels and annotations into
    /// [`CALICO_METADATA_ANNOTATION`]: capo's writes, which test its labels, need them
    /// put back first.
    pub moved: bool,
}

impl ShardView {
    pub fn from_object(obj: &DynamicObject) -> Self {
        let entries = obj.data["spec"][RESERVED_CIDRS]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
            .unwrap_or_default();
        let meta = Effective::of(obj);
        Self {
            name: obj.name_any(),
            policy: meta.labels.get(POLICY_LABEL).cloned(),
            entries,
            epoch: meta.annotations.get(LEADER_EPOCH_ANNOTATION).and_then(|e| e.parse().ok()),
            has_annotations: obj.metadata.annotations.is_some(),
            resource_version: obj.metadata.resource_version.clone(),
            moved: meta.moved,
        }
    }

    pub fn position(&self, entry: &str) -> Option<usize> {
        self.entries.iter().position(|e| e == entry)
    }

    /// Whether `obj` is capo's: labelled so, directly or (after a write through
    /// `projectcalico.org/v3`) in [`CALICO_METADATA_ANNOTATION`].
    pub fn is_owned(obj: &DynamicObject) -> bool {
        Effective::of(obj).is_owned()
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
    /// Entries first seen less than [`YOUNG_ENTRY`] ago, by shard, with when (the newest
    /// sight of each; an entry listed again after a fresh list counts as seen then).
    young: HashMap<(ShardKey, String), Instant>,
    /// The same, in the order seen: what to forget once it is old.
    young_order: VecDeque<(Instant, ShardKey, String)>,
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

    /// Notes `entries` of shard `key` as seen `now`, and forgets those seen long enough ago.
    fn seen(&mut self, key: &ShardKey, entries: &[String], now: Instant) {
        while let Some((at, _, _)) = self.young_order.front()
            && now.saturating_duration_since(*at) >= YOUNG_ENTRY
        {
            let (at, k, e) = self.young_order.pop_front().expect("front");
            let id = (k, e);
            if self.young.get(&id) == Some(&at) {
                self.young.remove(&id);
            }
        }
        for e in entries {
            self.young.insert((key.clone(), e.clone()), now);
            self.young_order.push_back((now, key.clone(), e.clone()));
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
    /// `(alias, canonical)`: the objects named through `alias` are those of `canonical`
    /// ([`Alias`]); ended when the two groups become stores of their own.
    alias: AtomicU8,
}

/// [`ReservationIndex`]'s alias, as one atomic value: it is read on every lookup.
struct Alias;

impl Alias {
    const NONE: u8 = 0;
    const V3_IS_V1: u8 = 1;
    const V1_IS_V3: u8 = 2;

    fn encode(alias: Option<(CalicoApiGroup, CalicoApiGroup)>) -> u8 {
        match alias {
            Some((CalicoApiGroup::V3, CalicoApiGroup::CrdV1)) => Self::V3_IS_V1,
            Some((CalicoApiGroup::CrdV1, CalicoApiGroup::V3)) => Self::V1_IS_V3,
            _ => Self::NONE,
        }
    }

    fn decode(v: u8) -> Option<(CalicoApiGroup, CalicoApiGroup)> {
        match v {
            Self::V3_IS_V1 => Some((CalicoApiGroup::V3, CalicoApiGroup::CrdV1)),
            Self::V1_IS_V3 => Some((CalicoApiGroup::CrdV1, CalicoApiGroup::V3)),
            _ => None,
        }
    }
}

impl Default for ReservationIndex {
    fn default() -> Self {
        Self::with_alias(None)
    }
}

impl ReservationIndex {
    /// An index in which group `alias.0` names the same objects as group `alias.1` (where
    /// calico-apiserver serves `projectcalico.org/v3` as a view of
    /// `crd.projectcalico.org/v1`): a shard or record that names either is one object,
    /// kept once, under `alias.1` (the group capo watches and writes through).
    pub fn with_alias(alias: Option<(CalicoApiGroup, CalicoApiGroup)>) -> Self {
        Self {
            inner: Default::default(),
            events: broadcast::channel(4096).0,
            synced: watch::Sender::new(HashSet::new()),
            alias: AtomicU8::new(Alias::encode(alias)),
        }
    }

    /// The group capo reads and writes the objects `group` names through: itself, unless
    /// it is an alias of another.
    pub fn canonical(&self, group: CalicoApiGroup) -> CalicoApiGroup {
        match self.alias() {
            Some((view, stored)) if view == group => stored,
            _ => group,
        }
    }

    /// `(alias, canonical)`, while both groups name one store.
    pub fn alias(&self) -> Option<(CalicoApiGroup, CalicoApiGroup)> {
        Alias::decode(self.alias.load(Ordering::Acquire))
    }

    /// The two groups are stores of their own from now on (calico-apiserver's APIService
    /// went: a datastore migration): the alias names its own objects, which its own watch
    /// brings in. Returns the group that was the alias, if there was one.
    pub fn end_alias(&self) -> Option<CalicoApiGroup> {
        let was = Alias::decode(self.alias.swap(Alias::NONE, Ordering::AcqRel));
        was.map(|(view, _)| view)
    }

    /// `view` names the objects of `stored` again (calico-apiserver's APIService came back:
    /// a cancelled datastore migration): what the index held under `view` goes, since those
    /// are the same objects as `stored`'s.
    pub fn alias_again(&self, view: CalicoApiGroup, stored: CalicoApiGroup) {
        self.replace(view, Vec::new());
        self.synced.send_modify(|s| {
            s.remove(&view);
        });
        self.alias.store(Alias::encode(Some((view, stored))), Ordering::Release);
    }

    pub fn get(&self, group: CalicoApiGroup, name: &str) -> Option<Arc<ShardView>> {
        let group = self.canonical(group);
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

    /// How long the leader must still wait before it removes `entries` from shard `name`:
    /// [`YOUNG_ENTRY`] after this index first showed each there; the whole of it for an
    /// entry it does not show there yet (its watch has not caught up with the write).
    pub fn young_for(&self, group: CalicoApiGroup, name: &str, entries: &BTreeSet<String>) -> Duration {
        let key = (self.canonical(group), name.to_string());
        let inner = self.inner.read().expect("index lock");
        let now = Instant::now();
        let listed = inner.shards.get(&key);
        entries
            .iter()
            .map(|e| {
                if listed.is_none_or(|v| v.position(e).is_none()) {
                    return YOUNG_ENTRY;
                }
                match inner.young.get(&(key.clone(), e.clone())) {
                    Some(at) => YOUNG_ENTRY.saturating_sub(now.saturating_duration_since(*at)),
                    None => Duration::ZERO,
                }
            })
            .max()
            .unwrap_or_default()
    }

    /// Every shard, by key.
    pub fn all(&self) -> BTreeMap<(String, String), (CalicoApiGroup, Arc<ShardView>)> {
        let inner = self.inner.read().expect("index lock");
        inner.shards.iter().map(|(k, v)| ((k.0.api_version(), k.1.clone()), (k.0, v.clone()))).collect()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<IndexEvent> {
        self.events.subscribe()
    }

    /// Whether the first list of `group` is in.
    pub fn is_synced(&self, group: CalicoApiGroup) -> bool {
        self.synced.borrow().contains(&self.canonical(group))
    }

    /// Waits until the first list of `group` is in.
    pub async fn synced(&self, group: CalicoApiGroup) {
        let group = self.canonical(group);
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| s.contains(&group)).await;
    }

    fn apply(&self, group: CalicoApiGroup, view: ShardView) {
        let group = self.canonical(group);
        let key = (group, view.name.clone());
        let (added, removed) = {
            let mut inner = self.inner.write().expect("index lock");
            let (added, removed) = inner.put(&key, Some(view));
            inner.seen(&key, &added, Instant::now());
            (added, removed)
        };
        let _ = self.events.send(IndexEvent::Shard { key, added, removed });
    }

    fn delete(&self, group: CalicoApiGroup, name: String) {
        let group = self.canonical(group);
        let key = (group, name);
        let (added, removed) = self.inner.write().expect("index lock").put(&key, None);
        let _ = self.events.send(IndexEvent::Shard { key, added, removed });
    }

    fn replace(&self, group: CalicoApiGroup, views: Vec<ShardView>) {
        let group = self.canonical(group);
        {
            let mut inner = self.inner.write().expect("index lock");
            let stale: Vec<ShardKey> = inner.shards.keys().filter(|k| k.0 == group).cloned().collect();
            // What a fresh list shows that the index already had keeps its first sight.
            let mut before: HashMap<ShardKey, HashSet<String>> = HashMap::new();
            for k in stale {
                let (_, removed) = inner.put(&k, None);
                before.insert(k, removed.into_iter().collect());
            }
            let now = Instant::now();
            for v in views {
                let key = (group, v.name.clone());
                let (added, _) = inner.put(&key, Some(v));
                let known = before.get(&key);
                let new: Vec<String> = added.into_iter().filter(|e| known.is_none_or(|k| !k.contains(e))).collect();
                inner.seen(&key, &new, now);
            }
        }
        self.synced.send_modify(|s| {
            s.insert(group);
        });
        let _ = self.events.send(IndexEvent::Resync);
    }

    /// Keeps the index current for `group` (capo-owned objects only) until the task is
    /// dropped. Every IPReservation is watched, not only those labelled as capo's: a write
    /// through `projectcalico.org/v3` moves the labels of the stored object into
    /// [`CALICO_METADATA_ANNOTATION`], and a label-selected watch would lose the shard
    /// (clusters keep few reservations of their own; capo keeps none of theirs).
    pub async fn watch(self: Arc<Self>, client: Client, group: CalicoApiGroup) {
        let api = Api::<DynamicObject>::all_with(client, &group.ip_reservation());
        let what = match group {
            CalicoApiGroup::CrdV1 => "reservations (crd.projectcalico.org/v1)",
            CalicoApiGroup::V3 => "reservations (projectcalico.org/v3)",
        };
        let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut listing = Vec::new();
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(obj)) if ShardView::is_owned(&obj) => {
                    listing.push(ShardView::from_object(&obj))
                }
                Ok(watcher::Event::InitApply(_)) => {}
                Ok(watcher::Event::InitDone) => self.replace(group, std::mem::take(&mut listing)),
                Ok(watcher::Event::Apply(obj)) if ShardView::is_owned(&obj) => {
                    self.apply(group, ShardView::from_object(&obj))
                }
                Ok(watcher::Event::Apply(obj)) | Ok(watcher::Event::Delete(obj)) => {
                    if self.get(group, &obj.name_any()).is_some() {
                        self.delete(group, obj.name_any());
                    }
                }
                Err(e) => warn!(watch = what, error = %e, "watching Calico's IPReservations failed; retrying"),
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
    fn an_entry_is_young_from_when_this_index_first_showed_it() {
        let index = ReservationIndex::default();
        let set = |es: &[&str]| es.iter().map(|e| e.to_string()).collect::<BTreeSet<String>>();
        let g = CalicoApiGroup::CrdV1;
        // Not shown yet (the watch behind the write): the whole wait.
        assert_eq!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32"])), YOUNG_ENTRY);
        index.apply(g, view("capo-p", &["10.0.0.1/32"]));
        let left = index.young_for(g, "capo-p", &set(&["10.0.0.1/32"]));
        assert!(left > YOUNG_ENTRY - Duration::from_secs(1) && left <= YOUNG_ENTRY, "{left:?}");
        // Seen long enough ago: no wait; a shard's other entries do not make it wait.
        let old = Instant::now().checked_sub(YOUNG_ENTRY + Duration::from_secs(1)).unwrap();
        index.inner.write().unwrap().young.insert(((g, "capo-p".into()), "10.0.0.1/32".into()), old);
        assert_eq!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32"])), Duration::ZERO);
        index.apply(g, view("capo-p", &["10.0.0.1/32", "10.0.0.2/32"]));
        assert_eq!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32"])), Duration::ZERO);
        assert!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32", "10.0.0.2/32"])) > Duration::from_secs(5));
        // Removed and written again: young again. Listed afresh (a relist): young again.
        index.apply(g, view("capo-p", &["10.0.0.2/32"]));
        index.apply(g, view("capo-p", &["10.0.0.2/32", "10.0.0.1/32"]));
        assert!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32"])) > Duration::from_secs(5));
        // A fresh list (a watch that had to list again) keeps what the index knew: an old
        // entry stays old, a new one is young. A fresh index (a new process) knows nothing.
        index.inner.write().unwrap().young.clear();
        index.replace(g, vec![view("capo-p", &["10.0.0.1/32", "10.0.0.3/32"])]);
        assert_eq!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32", "10.0.0.2/32"])), YOUNG_ENTRY, "10.0.0.2 left");
        assert_eq!(index.young_for(g, "capo-p", &set(&["10.0.0.1/32"])), Duration::ZERO);
        assert!(index.young_for(g, "capo-p", &set(&["10.0.0.3/32"])) > Duration::from_secs(5));
        let fresh = ReservationIndex::default();
        fresh.replace(g, vec![view("capo-p", &["10.0.0.1/32"])]);
        assert!(fresh.young_for(g, "capo-p", &set(&["10.0.0.1/32"])) > Duration::from_secs(5));
        // The same shard through the alias is the same entry.
        let aliased = ReservationIndex::with_alias(Some((CalicoApiGroup::V3, g)));
        aliased.apply(g, view("capo-p", &["10.0.0.1/32"]));
        assert!(aliased.young_for(CalicoApiGroup::V3, "capo-p", &set(&["10.0.0.1/32"])) > Duration::from_secs(5));
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

    fn object(labels: serde_json::Value, annotations: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "crd.projectcalico.org/v1", "kind": "IPReservation",
            "metadata": { "name": "capo-p", "labels": labels, "annotations": annotations, "resourceVersion": "7" },
            "spec": { "reservedCIDRs": ["10.0.0.1/32"] },
        }))
        .unwrap()
    }

    /// What calico-apiserver leaves of a shard after a write through projectcalico.org/v3:
    /// no labels, one annotation holding them. capo reads it the way Calico reads it back.
    #[test]
    fn a_shard_written_through_v3_is_still_capos_and_says_its_labels_moved() {
        let meta = serde_json::json!({
            "creationTimestamp": "2026-11-26T06:29:40Z",
            "labels": { MANAGED_BY_LABEL: MANAGED_BY_VALUE, POLICY_LABEL: "p", "team": "db" },
            "annotations": { LEADER_EPOCH_ANNOTATION: "3" },
        });
        let moved = object(serde_json::json!({}), serde_json::json!({ CALICO_METADATA_ANNOTATION: meta.to_string() }));
        assert!(ShardView::is_owned(&moved));
        let view = ShardView::from_object(&moved);
        assert_eq!(view.policy.as_deref(), Some("p"));
        assert_eq!(view.epoch, Some(3));
        assert!(view.moved);
        assert_eq!(view.entries, vec!["10.0.0.1/32".to_string()]);

        // Moved values win over stale ones left on the object, as in Calico's reading.
        let both = object(
            serde_json::json!({ MANAGED_BY_LABEL: MANAGED_BY_VALUE, POLICY_LABEL: "p" }),
            serde_json::json!({ LEADER_EPOCH_ANNOTATION: "1", CALICO_METADATA_ANNOTATION: meta.to_string() }),
        );
        assert_eq!(ShardView::from_object(&both).epoch, Some(3));

        let plain = object(
            serde_json::json!({ MANAGED_BY_LABEL: MANAGED_BY_VALUE, POLICY_LABEL: "p" }),
            serde_json::json!({ CALICO_METADATA_ANNOTATION: r#"{"creationTimestamp":"2026-11-26T06:29:40Z"}"# }),
        );
        assert!(!ShardView::from_object(&plain).moved, "nothing moved: only Calico's own metadata there");
        let foreign = object(
            serde_json::json!({}),
            serde_json::json!({ CALICO_METADATA_ANNOTATION: r#"{"labels":{"team":"db"}}"# }),
        );
        assert!(!ShardView::is_owned(&foreign));
        let garbled = object(serde_json::json!({}), serde_json::json!({ CALICO_METADATA_ANNOTATION: "{not json" }));
        assert!(!ShardView::is_owned(&garbled), "an annotation capo cannot read makes nothing capo's");
    }

    /// Where v3 is calico-apiserver's view of v1, a shard or record naming either group is
    /// one shard, kept under the group capo watches.
    #[test]
    fn an_alias_group_names_the_same_shards() {
        let index = ReservationIndex::with_alias(Some((CalicoApiGroup::V3, CalicoApiGroup::CrdV1)));
        index.apply(CalicoApiGroup::CrdV1, view("capo-p", &["10.0.0.1/32"]));
        index.apply(CalicoApiGroup::V3, view("capo-p", &["10.0.0.1/32", "10.0.0.2/32"]));
        assert_eq!(index.all().len(), 1, "one object, one shard");
        assert_eq!(index.shards_with("10.0.0.1/32").len(), 1);
        assert_eq!(index.shards_with("10.0.0.1/32")[0].0, CalicoApiGroup::CrdV1);
        assert!(index.get(CalicoApiGroup::V3, "capo-p").is_some_and(|v| v.entries.len() == 2));
        assert_eq!(index.canonical(CalicoApiGroup::V3), CalicoApiGroup::CrdV1);
        assert_eq!(ReservationIndex::default().canonical(CalicoApiGroup::V3), CalicoApiGroup::V3);
    }
}

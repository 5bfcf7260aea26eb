//! The leader's view of the objects that own Pods, by API group, kind and UID (metadata
//! only): whether a Pod's owner still exists, and whether it is being deleted — a Pod
//! whose owner is going (background or foreground cascade) is not held, and a policy may
//! release early once it is gone.
//!
//! StatefulSets, ReplicaSets and DaemonSets are watched from the start. An owner of any
//! other kind (an OpenKruise Advanced StatefulSet or CloneSet, a StrimziPodSet) starts a
//! watch of its kind the first time it is asked about, found through discovery; until
//! that kind is listed — and for good when it is not served or capo may not list it — its
//! owners are [`Owner::Unknown`], which every caller treats as present, never as gone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use capo_api::ControllerRef;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{DaemonSet, ReplicaSet, StatefulSet};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::core::PartialObjectMeta;
use kube::discovery::Scope;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use prometheus::IntGaugeVec;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinSet;
use tracing::{info, warn};

/// An owner's API group and kind (`("apps", "StatefulSet")`).
pub type GroupKind = (String, String);
/// (namespace, kind, name): the records of the Pods such an owner controls are indexed so.
pub type WorkloadKey = (String, String, String);

/// Where a Pod's owner is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Exists and is not being deleted.
    Present,
    /// Being deleted (foreground cascade: it waits for its Pods).
    Deleting,
    /// No object of that group, kind, namespace and name — or one with another UID.
    Gone,
    /// A kind capo does not see (yet, or at all): treated as present.
    Unknown,
}

/// A change the release controller reacts to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkloadEvent {
    /// One owner appeared, changed or went.
    Changed(WorkloadKey),
    /// Every object of `kind` was listed again (or for the first time): any record whose
    /// owner is of that kind may have a new answer.
    Listed { kind: String },
}

/// Kinds watched from the start; the leader waits for them before it decides anything.
const FROM_THE_START: usize = 3;
/// Kinds started on demand, at most (each is one metadata watch).
const MAX_ON_DEMAND: usize = 32;
/// How long a kind that could not be listed (not served, or forbidden) waits to try again.
const RETRY_UNAVAILABLE: Duration = Duration::from_secs(300);

struct Object {
    uid: String,
    deleting: bool,
}

enum KindState {
    /// Asked about; being discovered and listed.
    Starting,
    Listed {
        namespaced: bool,
        objects: HashMap<(String, String), Object>,
    },
    /// Not served here, or capo may not list it.
    Unavailable,
}

impl KindState {
    fn label(&self) -> &'static str {
        match self {
            KindState::Starting => "starting",
            KindState::Listed { .. } => "watched",
            KindState::Unavailable => "unavailable",
        }
    }
}

pub struct WorkloadStore {
    kinds: RwLock<HashMap<GroupKind, KindState>>,
    wanted: mpsc::UnboundedSender<GroupVersionKind>,
    wanted_rx: Mutex<Option<mpsc::UnboundedReceiver<GroupVersionKind>>>,
    events: broadcast::Sender<WorkloadEvent>,
    /// Kinds watched from the start that were listed (or found unavailable) once.
    settled: watch::Sender<usize>,
    /// `capo_owner_kinds{state}`.
    gauge: Option<IntGaugeVec>,
}

impl Default for WorkloadStore {
    fn default() -> Self {
        Self::new(None)
    }
}

impl WorkloadStore {
    pub fn new(gauge: Option<IntGaugeVec>) -> Self {
        let (wanted, rx) = mpsc::unbounded_channel();
        Self {
            kinds: Default::default(),
            wanted,
            wanted_rx: Mutex::new(Some(rx)),
            events: broadcast::channel(1024).0,
            settled: watch::Sender::new(0),
            gauge,
        }
    }

    /// Where the owner `owner` of a Pod in `namespace` is. Asking about a kind not seen
    /// before starts its watch (and answers [`Owner::Unknown`] until it is listed).
    pub fn owner(&self, namespace: &str, owner: &ControllerRef) -> Owner {
        let Some(gk) = owner.group_kind() else { return Owner::Unknown };
        {
            let kinds = self.kinds.read().expect("workload store lock");
            match kinds.get(&gk) {
                Some(KindState::Listed { namespaced, objects }) => {
                    let ns = if *namespaced { namespace } else { "" };
                    return match objects.get(&(ns.to_string(), owner.name.clone())) {
                        None => Owner::Gone,
                        Some(o) if owner.uid.as_deref().is_some_and(|u| !u.is_empty() && u != o.uid) => Owner::Gone,
                        Some(o) if o.deleting => Owner::Deleting,
                        Some(_) => Owner::Present,
                    };
                }
                Some(_) => return Owner::Unknown,
                None => {}
            }
        }
        self.want(owner, gk);
        Owner::Unknown
    }

    /// Starts watching `owner`'s kind if nothing watches it yet, so that the answer is ready
    /// when a Pod it owns leaves.
    pub fn note(&self, owner: &ControllerRef) {
        if let Some(gk) = owner.group_kind()
            && !self.kinds.read().expect("workload store lock").contains_key(&gk)
        {
            self.want(owner, gk);
        }
    }

    fn want(&self, owner: &ControllerRef, gk: GroupKind) {
        let version = owner.api_version.as_deref().and_then(|v| v.rsplit('/').next()).unwrap_or("v1").to_string();
        let mut kinds = self.kinds.write().expect("workload store lock");
        if kinds.contains_key(&gk) {
            return;
        }
        kinds.insert(gk.clone(), KindState::Starting);
        self.publish_gauge(&kinds);
        drop(kinds);
        let _ = self.wanted.send(GroupVersionKind::gvk(&gk.0, &version, &gk.1));
    }

    pub fn subscribe(&self) -> broadcast::Receiver<WorkloadEvent> {
        self.events.subscribe()
    }

    /// Waits until the kinds watched from the start are listed (or found unavailable).
    pub async fn synced(&self) {
        let mut rx = self.settled.subscribe();
        let _ = rx.wait_for(|n| *n >= FROM_THE_START).await;
    }

    /// Watches StatefulSets, ReplicaSets and DaemonSets, and each kind asked about later,
    /// until the returned task is aborted.
    pub fn watch(self: &Arc<Self>, client: &Client) -> Vec<tokio::task::JoinHandle<()>> {
        let mut wanted = self.wanted_rx.lock().expect("workload store lock").take().expect("watched once");
        let store = self.clone();
        let client = client.clone();
        vec![tokio::spawn(async move {
            let mut tasks = JoinSet::new();
            for ar in [
                ApiResource::erase::<StatefulSet>(&()),
                ApiResource::erase::<ReplicaSet>(&()),
                ApiResource::erase::<DaemonSet>(&()),
            ] {
                let gk = (ar.group.clone(), ar.kind.clone());
                store.kinds.write().expect("workload store lock").insert(gk, KindState::Starting);
                tasks.spawn(store.clone().watch_kind(client.clone(), ar, true, true));
            }
            let mut on_demand = 0;
            while let Some(gvk) = wanted.recv().await {
                if on_demand == MAX_ON_DEMAND {
                    warn!(group = gvk.group, kind = gvk.kind, "too many owner kinds: its owners count as present");
                    store.set(&(gvk.group.clone(), gvk.kind.clone()), KindState::Unavailable);
                    continue;
                }
                on_demand += 1;
                tasks.spawn(store.clone().discover_and_watch(client.clone(), gvk));
            }
        })]
    }

    async fn discover_and_watch(self: Arc<Self>, client: Client, gvk: GroupVersionKind) {
        let gk = (gvk.group.clone(), gvk.kind.clone());
        loop {
            match discover(&client, &gvk).await {
                Ok((ar, namespaced)) => {
                    info!(group = gvk.group, kind = gvk.kind, version = ar.version, "watching owners of this kind");
                    self.clone().watch_kind(client.clone(), ar, namespaced, false).await;
                }
                Err(e) => {
                    warn!(group = gvk.group, kind = gvk.kind, error = %e,
                        "a Pod owner's kind is not served here: its owners count as present");
                    self.set(&gk, KindState::Unavailable);
                }
            }
            tokio::time::sleep(RETRY_UNAVAILABLE).await;
        }
    }

    /// Follows every object of `ar`'s kind. Returns when it cannot be listed (forbidden,
    /// or no longer served); the kind is then unavailable.
    async fn watch_kind(self: Arc<Self>, client: Client, ar: ApiResource, namespaced: bool, from_the_start: bool) {
        let gk = (ar.group.clone(), ar.kind.clone());
        let api = Api::<PartialObjectMeta<DynamicObject>>::all_with(client, &ar);
        let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let key = |o: &PartialObjectMeta<DynamicObject>| {
            (if namespaced { o.namespace().unwrap_or_default() } else { String::new() }, o.name_any())
        };
        let object = |o: &PartialObjectMeta<DynamicObject>| Object {
            uid: o.metadata.uid.clone().unwrap_or_default(),
            deleting: o.metadata.deletion_timestamp.is_some(),
        };
        let mut listing = HashMap::new();
        let mut settled = false;
        let mut listed_once = false;
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(o)) => {
                    listing.insert(key(&o), object(&o));
                }
                Ok(watcher::Event::InitDone) => {
                    self.set(&gk, KindState::Listed { namespaced, objects: std::mem::take(&mut listing) });
                    listed_once = true;
                    if from_the_start && !settled {
                        settled = true;
                        self.settled.send_modify(|n| *n += 1);
                    }
                    let _ = self.events.send(WorkloadEvent::Listed { kind: ar.kind.clone() });
                }
                Ok(watcher::Event::Apply(o)) => {
                    let (ns, name) = key(&o);
                    self.update(&gk, (ns.clone(), name.clone()), Some(object(&o)));
                    let _ = self.events.send(WorkloadEvent::Changed((ns, ar.kind.clone(), name)));
                }
                Ok(watcher::Event::Delete(o)) => {
                    let (ns, name) = key(&o);
                    self.update(&gk, (ns.clone(), name.clone()), None);
                    let _ = self.events.send(WorkloadEvent::Changed((ns, ar.kind.clone(), name)));
                }
                Err(watcher::Error::InitialListFailed(kube::Error::Api(s)))
                    if !listed_once && matches!(s.code, 403 | 404) =>
                {
                    warn!(group = ar.group, kind = ar.kind, code = s.code, error = %s.message,
                        "capo may not list this kind of Pod owner: its owners count as present");
                    self.set(&gk, KindState::Unavailable);
                    if from_the_start && !settled {
                        settled = true;
                        self.settled.send_modify(|n| *n += 1);
                    }
                    if !from_the_start {
                        return;
                    }
                    tokio::time::sleep(RETRY_UNAVAILABLE).await;
                }
                Err(e) => warn!(group = ar.group, kind = ar.kind, error = %e, "watching Pod owners failed; retrying"),
            }
        }
    }

    fn set(&self, gk: &GroupKind, state: KindState) {
        let mut kinds = self.kinds.write().expect("workload store lock");
        kinds.insert(gk.clone(), state);
        self.publish_gauge(&kinds);
    }

    fn update(&self, gk: &GroupKind, key: (String, String), object: Option<Object>) {
        let mut kinds = self.kinds.write().expect("workload store lock");
        if let Some(KindState::Listed { objects, .. }) = kinds.get_mut(gk) {
            match object {
                Some(o) => objects.insert(key, o),
                None => objects.remove(&key),
            };
        }
    }

    fn publish_gauge(&self, kinds: &HashMap<GroupKind, KindState>) {
        let Some(gauge) = &self.gauge else { return };
        for state in ["starting", "watched", "unavailable"] {
            gauge.with_label_values(&[state]).set(kinds.values().filter(|k| k.label() == state).count() as i64);
        }
    }
}

/// The resource of `gvk` (its own version, or the group's preferred one when that
/// version is not served) and whether it is namespaced.
async fn discover(client: &Client, gvk: &GroupVersionKind) -> Result<(ApiResource, bool), kube::Error> {
    let (ar, caps) = match kube::discovery::pinned_kind(client, gvk).await {
        Ok(found) => found,
        Err(_) => {
            let group = kube::discovery::group(client, &gvk.group).await?;
            group
                .recommended_kind(&gvk.kind)
                .ok_or_else(|| kube::Error::Discovery(kube::error::DiscoveryError::MissingKind(gvk.kind.clone())))?
        }
    };
    Ok((ar, caps.scope == Scope::Namespaced))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(api_version: Option<&str>, kind: &str, name: &str, uid: Option<&str>) -> ControllerRef {
        ControllerRef {
            api_version: api_version.map(String::from),
            kind: kind.into(),
            name: name.into(),
            uid: uid.map(String::from),
        }
    }

    fn listed(store: &WorkloadStore, group: &str, kind: &str, objects: &[(&str, &str, &str, bool)]) {
        let objects = objects
            .iter()
            .map(|(ns, name, uid, deleting)| {
                ((ns.to_string(), name.to_string()), Object { uid: uid.to_string(), deleting: *deleting })
            })
            .collect();
        store.set(&(group.into(), kind.into()), KindState::Listed { namespaced: true, objects });
    }

    #[test]
    fn owners_are_matched_by_group_kind_name_and_uid() {
        let store = WorkloadStore::default();
        listed(&store, "apps", "StatefulSet", &[("shop", "redis", "u1", false), ("shop", "old", "u2", true)]);
        let apps = |name, uid| owner(Some("apps/v1"), "StatefulSet", name, uid);
        assert_eq!(store.owner("shop", &apps("redis", Some("u1"))), Owner::Present);
        assert_eq!(store.owner("shop", &apps("old", Some("u2"))), Owner::Deleting);
        assert_eq!(store.owner("shop", &apps("gone", Some("u3"))), Owner::Gone);
        // Deleted and created again under the same name: another owner.
        assert_eq!(store.owner("shop", &apps("redis", Some("u9"))), Owner::Gone);
        // A record written before owners had a UID and an apiVersion: the name decides.
        assert_eq!(store.owner("shop", &owner(None, "StatefulSet", "redis", None)), Owner::Present);
        assert_eq!(store.owner("other", &apps("redis", Some("u1"))), Owner::Gone);
    }

    #[test]
    fn an_owner_of_a_kind_not_listed_is_unknown_never_gone() {
        let store = WorkloadStore::default();
        listed(&store, "apps", "StatefulSet", &[]);
        // An OpenKruise Advanced StatefulSet has the kind of an apps StatefulSet, not its group.
        let kruise = owner(Some("apps.kruise.io/v1beta1"), "StatefulSet", "redis", Some("k1"));
        assert_eq!(store.owner("shop", &kruise), Owner::Unknown);
        // Asking started its watch, once.
        let mut rx = store.wanted_rx.lock().unwrap().take().unwrap();
        assert_eq!(rx.try_recv().unwrap(), GroupVersionKind::gvk("apps.kruise.io", "v1beta1", "StatefulSet"));
        assert_eq!(store.owner("shop", &kruise), Owner::Unknown);
        assert!(rx.try_recv().is_err());
        // A kind whose group a record does not say (and not of the apps group): no watch.
        assert_eq!(store.owner("shop", &owner(None, "CloneSet", "c", None)), Owner::Unknown);
        assert!(rx.try_recv().is_err());
        listed(&store, "apps.kruise.io", "StatefulSet", &[("shop", "redis", "k1", false)]);
        assert_eq!(store.owner("shop", &kruise), Owner::Present);
        store.set(&("apps.kruise.io".into(), "StatefulSet".into()), KindState::Unavailable);
        assert_eq!(store.owner("shop", &kruise), Owner::Unknown);
    }
}

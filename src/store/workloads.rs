//! The leader's view of the workloads that own Pods (StatefulSets and ReplicaSets,
//! metadata only): whether one still exists, and whether it is being deleted — a Pod
//! whose owner is going (background or foreground cascade) is not held, and a policy may
//! release early once it is gone.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::store::Guarded;
use k8s_openapi::api::apps::v1::{ReplicaSet, StatefulSet};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tokio::sync::{broadcast, watch};

use super::{Change, guarded_watch};

/// (namespace, kind, name)
pub type WorkloadKey = (String, String, String);

/// Where a Pod's owner is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Exists and is not being deleted.
    Present,
    /// Being deleted (foreground cascade: it waits for its Pods).
    Deleting,
    Gone,
    /// A kind capo does not watch.
    Unknown,
}

pub struct WorkloadStore {
    inner: RwLock<HashMap<WorkloadKey, bool>>,
    events: broadcast::Sender<WorkloadKey>,
    synced: watch::Sender<usize>,
}

impl Default for WorkloadStore {
    fn default() -> Self {
        Self { inner: Default::default(), events: broadcast::channel(1024).0, synced: watch::Sender::new(0) }
    }
}

const KINDS: usize = 2;

impl WorkloadStore {
    pub fn owner(&self, namespace: &str, kind: &str, name: &str) -> Owner {
        if !matches!(kind, "StatefulSet" | "ReplicaSet") {
            return Owner::Unknown;
        }
        let key = (namespace.to_string(), kind.to_string(), name.to_string());
        match self.inner.read().expect("workload store lock").get(&key) {
            Some(false) => Owner::Present,
            Some(true) => Owner::Deleting,
            None => Owner::Gone,
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<WorkloadKey> {
        self.events.subscribe()
    }

    /// Waits until both kinds are listed.
    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|n| *n >= KINDS).await;
    }

    /// Watches StatefulSets and ReplicaSets until the returned tasks are aborted.
    pub fn watch(self: &Arc<Self>, client: &Client) -> Vec<tokio::task::JoinHandle<()>> {
        vec![
            tokio::spawn(self.clone().watch_kind::<StatefulSet>(client.clone(), "statefulsets")),
            tokio::spawn(self.clone().watch_kind::<ReplicaSet>(client.clone(), "replicasets")),
        ]
    }

    async fn watch_kind<K>(self: Arc<Self>, client: Client, what: &'static str)
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    {
        let kind = K::kind(&()).to_string();
        let api = Api::<Guarded<PartialObjectMeta<K>>>::all(client);
        let key = |o: &PartialObjectMeta<K>| (o.namespace().unwrap_or_default(), kind.clone(), o.name_any());
        let mut listing = HashMap::new();
        guarded_watch(what, api, watcher::Config::default(), |change| match change {
            Change::Restart => listing.clear(),
            Change::Apply { object, initial: true } => {
                listing.insert(key(&object), object.metadata.deletion_timestamp.is_some());
            }
            Change::Listed => {
                let mut inner = self.inner.write().expect("workload store lock");
                inner.retain(|k, _| k.1 != kind);
                inner.extend(listing.drain());
                drop(inner);
                self.synced.send_modify(|n| *n += 1);
            }
            Change::Apply { object, initial: false } => {
                let k = key(&object);
                self.inner
                    .write()
                    .expect("workload store lock")
                    .insert(k.clone(), object.metadata.deletion_timestamp.is_some());
                let _ = self.events.send(k);
            }
            Change::Delete(object) => {
                let k = key(&object);
                self.inner.write().expect("workload store lock").remove(&k);
                let _ = self.events.send(k);
            }
            Change::Invalid(_) | Change::Failed(_) => {}
        })
        .await;
    }
}

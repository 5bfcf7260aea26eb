//! Namespaces: their labels (with `kubernetes.io/metadata.name`, always present on a real
//! server) and whether they are being deleted.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use crate::store::Guarded;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::broadcast;

use super::{Change, guarded_watch};
use crate::health::Readiness;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceFacts {
    pub labels: BTreeMap<String, String>,
    pub terminating: bool,
}

impl NamespaceFacts {
    pub fn from_meta(name: &str, labels: Option<&BTreeMap<String, String>>, terminating: bool) -> Self {
        let mut labels = labels.cloned().unwrap_or_default();
        labels.entry("kubernetes.io/metadata.name".into()).or_insert_with(|| name.to_string());
        Self { labels, terminating }
    }
}

pub struct NamespaceStore {
    inner: RwLock<HashMap<String, Arc<NamespaceFacts>>>,
    events: broadcast::Sender<String>,
}

impl Default for NamespaceStore {
    fn default() -> Self {
        Self { inner: Default::default(), events: broadcast::channel(1024).0 }
    }
}

impl NamespaceStore {
    pub fn get(&self, name: &str) -> Option<Arc<NamespaceFacts>> {
        self.inner.read().expect("namespace store lock").get(name).cloned()
    }

    /// Names of namespaces that changed or went (an empty name: the store was rebuilt).
    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.events.subscribe()
    }

    /// Puts a namespace in by hand (tests, benchmarks).
    pub fn put(&self, name: &str, facts: NamespaceFacts) {
        self.inner.write().expect("namespace store lock").insert(name.to_string(), Arc::new(facts));
    }

    pub async fn watch(self: Arc<Self>, client: Client, readiness: Arc<Readiness>) {
        let api = Api::<Guarded<PartialObjectMeta<Namespace>>>::all(client);
        let facts = |ns: &PartialObjectMeta<Namespace>| {
            Arc::new(NamespaceFacts::from_meta(
                &ns.name_any(),
                ns.metadata.labels.as_ref(),
                ns.metadata.deletion_timestamp.is_some(),
            ))
        };
        let mut listing = HashMap::new();
        guarded_watch("namespaces", api, watcher::Config::default(), |change| match change {
            Change::Restart => listing.clear(),
            Change::Apply { object, initial: true } => {
                readiness.watch_ok("namespaces");
                listing.insert(object.name_any(), facts(&object));
            }
            Change::Listed => {
                readiness.watch_ok("namespaces");
                *self.inner.write().expect("namespace store lock") = std::mem::take(&mut listing);
                readiness.set_namespaces_synced();
                let _ = self.events.send(String::new());
            }
            Change::Apply { object, initial: false } => {
                readiness.watch_ok("namespaces");
                self.inner.write().expect("namespace store lock").insert(object.name_any(), facts(&object));
                let _ = self.events.send(object.name_any());
            }
            Change::Delete(object) => {
                readiness.watch_ok("namespaces");
                self.inner.write().expect("namespace store lock").remove(&object.name_any());
                let _ = self.events.send(object.name_any());
            }
            Change::Invalid(_) => readiness.watch_ok("namespaces"),
            Change::Failed(_) => readiness.watch_failed("namespaces"),
        })
        .await;
    }
}

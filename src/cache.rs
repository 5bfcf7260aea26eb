//! In-memory views of Namespaces and Pods, kept current by watches, so the admission
//! path never reads the API server to decide.
//!
//! Pods are trimmed to [`PodFacts`] and only those with an IP (and not on the host
//! network) are kept: nothing else can ever be held.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tracing::{debug, warn};

use crate::health::Readiness;
use crate::pod::{PodFacts, Unholdable};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceFacts {
    pub labels: BTreeMap<String, String>,
    pub terminating: bool,
}

type PodKey = (String, String);

#[derive(Default)]
pub struct Caches {
    namespaces: RwLock<HashMap<String, Arc<NamespaceFacts>>>,
    pods: RwLock<HashMap<PodKey, Arc<PodFacts>>>,
}

impl Caches {
    pub fn namespace(&self, name: &str) -> Option<Arc<NamespaceFacts>> {
        self.namespaces.read().expect("namespace cache lock").get(name).cloned()
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Arc<PodFacts>> {
        let key = (namespace.to_string(), name.to_string());
        self.pods.read().expect("pod cache lock").get(&key).cloned()
    }

    pub async fn watch_namespaces(self: Arc<Self>, client: Client, readiness: Arc<Readiness>) {
        let api = Api::<PartialObjectMeta<Namespace>>::all(client);
        let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut listing = HashMap::new();
        let facts = |ns: &PartialObjectMeta<Namespace>| {
            let mut labels = ns.labels().clone();
            // Always present on a real server; make it so for a cache entry too.
            labels.entry("kubernetes.io/metadata.name".into()).or_insert_with(|| ns.name_any());
            Arc::new(NamespaceFacts { labels, terminating: ns.metadata.deletion_timestamp.is_some() })
        };
        while let Some(event) = events.next().await {
            match &event {
                Ok(_) => readiness.watch_ok("namespaces"),
                Err(_) => readiness.watch_failed("namespaces"),
            }
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(ns)) => {
                    listing.insert(ns.name_any(), facts(&ns));
                }
                Ok(watcher::Event::InitDone) => {
                    *self.namespaces.write().expect("namespace cache lock") = std::mem::take(&mut listing);
                    readiness.set_namespaces_synced();
                }
                Ok(watcher::Event::Apply(ns)) => {
                    self.namespaces.write().expect("namespace cache lock").insert(ns.name_any(), facts(&ns));
                }
                Ok(watcher::Event::Delete(ns)) => {
                    self.namespaces.write().expect("namespace cache lock").remove(&ns.name_any());
                }
                Err(e) => warn!(error = %e, "watching Namespaces failed; retrying"),
            }
        }
    }

    pub async fn watch_pods(self: Arc<Self>, client: Client, readiness: Arc<Readiness>) {
        let api = Api::<Pod>::all(client);
        let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut listing = HashMap::new();
        // Pods that could be held (the matcher's rule), and opted-out ones too: an eviction
        // reaches capo without the Pod, and an opted-out Pod must be answered from memory
        // (no API read for a Pod capo will not hold).
        let keep = |pod: &Pod| {
            let facts = PodFacts::from_pod(pod);
            matches!(facts.unholdable(), None | Some(Unholdable::OptedOut)).then(|| Arc::new(facts))
        };
        while let Some(event) = events.next().await {
            match &event {
                Ok(_) => readiness.watch_ok("pods"),
                Err(_) => readiness.watch_failed("pods"),
            }
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(pod)) => {
                    if let Some(f) = keep(&pod) {
                        listing.insert(f.key(), f);
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    let count = listing.len();
                    *self.pods.write().expect("pod cache lock") = std::mem::take(&mut listing);
                    debug!(count, "pod cache synced");
                    readiness.set_pods_synced();
                }
                Ok(watcher::Event::Apply(pod)) => {
                    let key = (pod.namespace().unwrap_or_default(), pod.name_any());
                    let mut pods = self.pods.write().expect("pod cache lock");
                    match keep(&pod) {
                        Some(f) => pods.insert(key, f),
                        None => pods.remove(&key),
                    };
                }
                Ok(watcher::Event::Delete(pod)) => {
                    let key = (pod.namespace().unwrap_or_default(), pod.name_any());
                    self.pods.write().expect("pod cache lock").remove(&key);
                }
                Err(e) => warn!(error = %e, "watching Pods failed; retrying"),
            }
        }
    }
}

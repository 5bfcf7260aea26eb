//! The one Pod store, shared by the admission path and the leader: Pods trimmed at the
//! watch ([`TrimmedPod`]) and kept only if capo could ever hold them or must answer for
//! them (an IP, not on the host network; opted-out ones too, so an eviction of one is
//! answered from memory). Indexed by namespace/name and by IP.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use crate::store::Guarded;
use kube::api::Api;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::broadcast;
use tracing::debug;

use super::{Change, guarded_watch};
use crate::health::Readiness;
use crate::pod::{PodFacts, TrimmedPod, Unholdable};

pub type PodKey = (String, String);

/// A Pod changed (or went): look at `namespace/name` in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodEvent {
    Changed {
        namespace: String,
        name: String,
    },
    /// The store was rebuilt from a fresh list.
    Resync,
}

#[derive(Default)]
struct Inner {
    pods: HashMap<PodKey, Arc<PodFacts>>,
    /// The Pods that list an IP (nearly always one; two while an address moves on).
    by_ip: HashMap<IpAddr, Vec<Arc<PodFacts>>>,
}

impl Inner {
    fn remove(&mut self, key: &PodKey) -> Option<Arc<PodFacts>> {
        let old = self.pods.remove(key)?;
        for ip in &old.ips {
            if let Some(pods) = self.by_ip.get_mut(ip) {
                pods.retain(|p| !Arc::ptr_eq(p, &old));
                if pods.is_empty() {
                    self.by_ip.remove(ip);
                }
            }
        }
        Some(old)
    }

    fn insert(&mut self, pod: Arc<PodFacts>) {
        let key = pod.key();
        self.remove(&key);
        for ip in &pod.ips {
            self.by_ip.entry(*ip).or_insert_with(|| Vec::with_capacity(1)).push(pod.clone());
        }
        self.pods.insert(key, pod);
    }
}

pub struct PodStore {
    inner: RwLock<Inner>,
    events: broadcast::Sender<PodEvent>,
}

impl Default for PodStore {
    fn default() -> Self {
        Self { inner: Default::default(), events: broadcast::channel(8192).0 }
    }
}

/// Whether the store keeps this Pod.
fn kept(facts: &PodFacts) -> bool {
    matches!(facts.unholdable(), None | Some(Unholdable::OptedOut))
}

impl PodStore {
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<PodFacts>> {
        let key = (namespace.to_string(), name.to_string());
        self.inner.read().expect("pod store lock").pods.get(&key).cloned()
    }

    /// The Pods that list `ip` in their status.
    pub fn with_ip(&self, ip: IpAddr) -> Vec<Arc<PodFacts>> {
        let inner = self.inner.read().expect("pod store lock");
        inner.by_ip.get(&ip).cloned().unwrap_or_default()
    }

    /// Every Pod kept (for a full look after a resync).
    pub fn keys(&self) -> Vec<PodKey> {
        self.inner.read().expect("pod store lock").pods.keys().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.inner.read().expect("pod store lock").pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn subscribe(&self) -> broadcast::Receiver<PodEvent> {
        self.events.subscribe()
    }

    fn changed(&self, namespace: String, name: String) {
        let _ = self.events.send(PodEvent::Changed { namespace, name });
    }

    /// Puts a Pod in by hand (tests, benchmarks).
    pub fn put(&self, facts: PodFacts) {
        self.inner.write().expect("pod store lock").insert(Arc::new(facts));
    }

    /// Keeps the store current until the task is dropped.
    /// `events` counts the changes and deletions handled.
    pub async fn watch(self: Arc<Self>, client: Client, readiness: Arc<Readiness>, events: prometheus::IntCounter) {
        let api = Api::<Guarded<TrimmedPod>>::all(client);
        let mut listing: Vec<Arc<PodFacts>> = Vec::new();
        guarded_watch("pods", api, watcher::Config::default(), |change| match change {
            Change::Restart => listing.clear(),
            Change::Apply { object, initial: true } => {
                readiness.watch_ok("pods");
                if kept(&object.facts) {
                    listing.push(Arc::new(object.facts));
                }
            }
            Change::Listed => {
                readiness.watch_ok("pods");
                let mut fresh = Inner::default();
                for p in listing.drain(..) {
                    fresh.insert(p);
                }
                let count = fresh.pods.len();
                *self.inner.write().expect("pod store lock") = fresh;
                debug!(count, "pod store synced");
                readiness.set_pods_synced();
                let _ = self.events.send(PodEvent::Resync);
            }
            Change::Apply { object, initial: false } => {
                readiness.watch_ok("pods");
                events.inc();
                let (namespace, name) = (object.namespace().unwrap_or_default(), object.name_any());
                {
                    let mut inner = self.inner.write().expect("pod store lock");
                    if kept(&object.facts) {
                        inner.insert(Arc::new(object.facts));
                    } else {
                        inner.remove(&(namespace.clone(), name.clone()));
                    }
                }
                self.changed(namespace, name);
            }
            Change::Delete(object) => {
                readiness.watch_ok("pods");
                events.inc();
                let key = (object.namespace().unwrap_or_default(), object.name_any());
                self.inner.write().expect("pod store lock").remove(&key);
                self.changed(key.0, key.1);
            }
            Change::Invalid(_) => readiness.watch_ok("pods"),
            Change::Failed(_) => readiness.watch_failed("pods"),
        })
        .await;
    }
}

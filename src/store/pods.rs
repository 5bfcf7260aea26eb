//! The one Pod store, shared by the admission path and the leader: Pods trimmed at the
//! watch ([`TrimmedPod`]) and kept only if capo could ever hold them or must answer for
//! them (an IP, not on the host network; opted-out ones too, so an eviction of one is
//! answered from memory). Indexed by namespace/name and by IP.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

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
    departed: Mutex<Departed>,
}

impl Default for PodStore {
    fn default() -> Self {
        Self { inner: Default::default(), events: broadcast::channel(8192).0, departed: Default::default() }
    }
}

/// How long the store remembers that it saw a Pod leave. The leader needs it only while a
/// hold is younger than the settle time (5 s by default); past this it counts a Pod missing
/// from the store as gone anyway.
const DEPARTED_KEPT: Duration = Duration::from_secs(120);

/// The UIDs of Pods this store saw leave (deleted, no longer holdable, or missing from a
/// fresh list after it had them): evidence that a Pod is gone, where a Pod merely missing
/// may not have reached a lagging watch yet.
#[derive(Default)]
struct Departed {
    at: HashMap<String, Instant>,
    order: std::collections::VecDeque<(Instant, String)>,
}

impl Departed {
    fn note(&mut self, uid: &str, now: Instant) {
        if uid.is_empty() {
            return;
        }
        while let Some((t, _)) = self.order.front()
            && now.duration_since(*t) > DEPARTED_KEPT
        {
            let (t, uid) = self.order.pop_front().expect("front checked");
            if self.at.get(&uid) == Some(&t) {
                self.at.remove(&uid);
            }
        }
        self.at.insert(uid.to_string(), now);
        self.order.push_back((now, uid.to_string()));
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

    /// Whether this store saw the Pod with `uid` leave (within the last two minutes).
    pub fn saw_depart(&self, uid: &str) -> bool {
        self.departed.lock().expect("departed lock").at.contains_key(uid)
    }

    fn departs(&self, uids: impl IntoIterator<Item = String>) {
        let now = Instant::now();
        let mut departed = self.departed.lock().expect("departed lock");
        for uid in uids {
            departed.note(&uid, now);
        }
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
                // Pods the store had that the fresh list lacks left during the gap.
                let left: Vec<String> = {
                    let mut inner = self.inner.write().expect("pod store lock");
                    let left = inner
                        .pods
                        .values()
                        .filter(|p| fresh.pods.get(&p.key()).is_none_or(|n| n.uid != p.uid))
                        .map(|p| p.uid.clone())
                        .collect();
                    *inner = fresh;
                    left
                };
                self.departs(left);
                debug!(count, "pod store synced");
                readiness.set_pods_synced();
                let _ = self.events.send(PodEvent::Resync);
            }
            Change::Apply { object, initial: false } => {
                readiness.watch_ok("pods");
                events.inc();
                let (namespace, name) = (object.namespace().unwrap_or_default(), object.name_any());
                let replaced = {
                    let mut inner = self.inner.write().expect("pod store lock");
                    let key = (namespace.clone(), name.clone());
                    if kept(&object.facts) {
                        let uid = object.facts.uid.clone();
                        let old = inner.pods.get(&key).filter(|o| o.uid != uid).map(|o| o.uid.clone());
                        inner.insert(Arc::new(object.facts));
                        old
                    } else {
                        inner.remove(&key).map(|o| o.uid.clone()).or(Some(object.facts.uid))
                    }
                };
                self.departs(replaced);
                self.changed(namespace, name);
            }
            Change::Delete(object) => {
                readiness.watch_ok("pods");
                events.inc();
                let key = (object.namespace().unwrap_or_default(), object.name_any());
                self.inner.write().expect("pod store lock").remove(&key);
                self.departs([object.facts.uid]);
                self.changed(key.0, key.1);
            }
            Change::Invalid(_) => readiness.watch_ok("pods"),
            Change::Failed(_) => readiness.watch_failed("pods"),
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn departures_are_remembered_for_two_minutes_and_then_forgotten() {
        let mut d = Departed::default();
        let t0 = Instant::now();
        d.note("a", t0);
        d.note("", t0);
        d.note("b", t0 + Duration::from_secs(60));
        assert!(d.at.contains_key("a") && d.at.contains_key("b") && d.at.len() == 2, "no empty UID");
        d.note("c", t0 + Duration::from_secs(121));
        assert!(!d.at.contains_key("a"), "older than two minutes");
        assert!(d.at.contains_key("b") && d.at.contains_key("c"));
        // Noted again: the later time counts, the earlier queue slot does not drop it.
        d.note("b", t0 + Duration::from_secs(170));
        d.note("z", t0 + Duration::from_secs(182));
        assert!(d.at.contains_key("b"), "re-noted at 170 s");
        assert_eq!(d.order.len(), 3, "b's first slot went");
    }
}

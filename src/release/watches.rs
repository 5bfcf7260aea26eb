//! The leader's view of the cluster: reflector stores kept current by watches, each change
//! waking the engine. Pods are trimmed before they are stored.

use std::sync::Arc;

use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use capo_api::{CalicoApiGroup, CapoPolicy, ReservedIP};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{ReplicaSet, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Pod, PodSpec, PodStatus};
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::warn;

/// The stores the engine plans from.
pub struct Views {
    pub records: Store<ReservedIP>,
    pub reservations: Store<DynamicObject>,
    pub pods: Store<Pod>,
    pub policies: Store<CapoPolicy>,
    pub statefulsets: Store<PartialObjectMeta<StatefulSet>>,
    pub replicasets: Store<PartialObjectMeta<ReplicaSet>>,
    pub namespaces: Store<PartialObjectMeta<Namespace>>,
    pub changed: Arc<Notify>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Views {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Keeps what the leader needs of a Pod: identity, labels, capo's annotations, owner,
/// node, host network, phase, IPs and deletion state.
fn trim_pod(pod: &mut Pod) {
    let meta = &mut pod.metadata;
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.retain(|k, _| k.starts_with(capo_api::keys::CAPO_PREFIX));
    }
    pod.spec =
        pod.spec.take().map(|s| PodSpec { node_name: s.node_name, host_network: s.host_network, ..Default::default() });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        pod_ip: s.pod_ip,
        pod_ips: s.pod_ips,
        ..Default::default()
    });
}

fn spawn_watch<K, S>(what: &'static str, stream: S, changed: Arc<Notify>) -> JoinHandle<()>
where
    K: Resource + Clone + 'static,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => changed.notify_one(),
                Err(e) => warn!(watch = what, error = %e, "leader watch failed; retrying"),
            }
        }
    })
}

impl Views {
    pub fn start(client: &Client, group: CalicoApiGroup) -> Views {
        let changed = Arc::new(Notify::new());
        let owned = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));

        let (records, w) = reflector::store();
        let s =
            reflector(w, watcher(Api::<ReservedIP>::all(client.clone()), watcher::Config::default()).default_backoff());
        let mut tasks = vec![spawn_watch("reservedips", s, changed.clone())];

        let w = reflector::store::Writer::new(group.ip_reservation());
        let reservations = w.as_reader();
        let api = Api::<DynamicObject>::all_with(client.clone(), &group.ip_reservation());
        tasks.push(spawn_watch("ipreservations", reflector(w, watcher(api, owned).default_backoff()), changed.clone()));

        let (pods, w) = reflector::store();
        let s = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default()).default_backoff().modify(trim_pod);
        tasks.push(spawn_watch("pods", reflector(w, s), changed.clone()));

        let (policies, w) = reflector::store();
        let s = watcher(Api::<CapoPolicy>::all(client.clone()), watcher::Config::default()).default_backoff();
        tasks.push(spawn_watch("capopolicies", reflector(w, s), changed.clone()));

        let (statefulsets, w) = reflector::store();
        let s = watcher(Api::<PartialObjectMeta<StatefulSet>>::all(client.clone()), watcher::Config::default())
            .default_backoff();
        tasks.push(spawn_watch("statefulsets", reflector(w, s), changed.clone()));

        let (replicasets, w) = reflector::store();
        let s = watcher(Api::<PartialObjectMeta<ReplicaSet>>::all(client.clone()), watcher::Config::default())
            .default_backoff();
        tasks.push(spawn_watch("replicasets", reflector(w, s), changed.clone()));

        let (namespaces, w) = reflector::store();
        let s = watcher(Api::<PartialObjectMeta<Namespace>>::all(client.clone()), watcher::Config::default())
            .default_backoff();
        tasks.push(spawn_watch("namespaces", reflector(w, s), changed.clone()));

        Views { records, reservations, pods, policies, statefulsets, replicasets, namespaces, changed, tasks }
    }

    /// Waits until every store has its first full list.
    pub async fn ready(&self) {
        let _ = self.records.wait_until_ready().await;
        let _ = self.reservations.wait_until_ready().await;
        let _ = self.pods.wait_until_ready().await;
        let _ = self.policies.wait_until_ready().await;
        let _ = self.statefulsets.wait_until_ready().await;
        let _ = self.replicasets.wait_until_ready().await;
        let _ = self.namespaces.wait_until_ready().await;
    }

    /// A namespace's labels (with `kubernetes.io/metadata.name`) and whether it is being
    /// deleted; `None` if it does not exist.
    pub fn namespace(&self, name: &str) -> Option<(std::collections::BTreeMap<String, String>, bool)> {
        let ns = self.namespaces.get(&ObjectRef::new(name))?;
        let mut labels = ns.metadata.labels.clone().unwrap_or_default();
        labels.entry("kubernetes.io/metadata.name".into()).or_insert_with(|| name.to_string());
        Some((labels, ns.metadata.deletion_timestamp.is_some()))
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Arc<Pod>> {
        self.pods.get(&ObjectRef::new(name).within(namespace))
    }

    /// `None` for a kind capo does not watch.
    pub fn workload_exists(&self, namespace: &str, kind: &str, name: &str) -> Option<bool> {
        match kind {
            "StatefulSet" => Some(self.statefulsets.get(&ObjectRef::new(name).within(namespace)).is_some()),
            "ReplicaSet" => Some(self.replicasets.get(&ObjectRef::new(name).within(namespace)).is_some()),
            _ => None,
        }
    }
}

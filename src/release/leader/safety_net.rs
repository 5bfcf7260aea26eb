//! The safety net's loop, beside the release work: Pod events → its own queue of Pods →
//! [`SafetyNet::check`]. A Pod in a terminal phase is looked at at once; one being deleted
//! after a moment (so its owner's deletion, a cascade, is known by then); a Pod that left
//! the store is forgotten. A failed hold comes back with backoff and says so
//! (`SafetyNetHoldFailed`).

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::EventType;
use tokio::sync::broadcast;
use tracing::{debug, warn};

use super::routing::got;
use crate::events::{Events, pod_ref, policy_ref};
use crate::hold::safety_net::{NetError, SafetyNet};
use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::release::queue::WorkQueue;
use crate::store::PodStore;
use crate::store::pods::PodEvent;

type PodKey = (String, String);

pub struct NetLoop {
    net: SafetyNet,
    pods: Arc<PodStore>,
    fence: Fence,
    metrics: Arc<Metrics>,
    events: Events,
    /// How long a Pod being deleted waits before it is looked at.
    settle: Duration,
    queue: WorkQueue<PodKey>,
}

impl NetLoop {
    pub fn new(
        net: SafetyNet,
        pods: Arc<PodStore>,
        fence: Fence,
        metrics: Arc<Metrics>,
        events: Events,
        settle: Duration,
    ) -> Self {
        let queue = WorkQueue::new(Duration::from_millis(250), Duration::from_secs(30));
        Self { net, pods, fence, metrics, events, settle: settle.min(Duration::from_secs(2)), queue }
    }

    /// Looks at every Pod now, then at each Pod event, with `workers` Pods at once.
    pub fn spawn(
        self: &Arc<Self>,
        rx: broadcast::Receiver<PodEvent>,
        workers: usize,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        self.look_at_everything();
        let mut tasks = vec![tokio::spawn(self.clone().pump(rx))];
        tasks.extend((0..workers.max(1)).map(|_| tokio::spawn(self.clone().work())));
        tasks
    }

    /// The term is over: nothing more is looked at, and nothing is remembered.
    pub fn end(&self) {
        self.queue.close();
        self.net.clear();
    }

    fn look_at_everything(&self) {
        for (ns, name) in self.pods.keys() {
            self.pod_changed(&ns, &name);
        }
    }

    fn pod_changed(&self, namespace: &str, name: &str) {
        let key = (namespace.to_string(), name.to_string());
        match self.pods.get(namespace, name) {
            Some(p) if p.terminal() => self.queue.add(key),
            Some(p) if p.deleting => self.queue.add_after(key, self.settle),
            Some(_) => {}
            None => self.net.forget(namespace, name),
        }
    }

    async fn pump(self: Arc<Self>, mut rx: broadcast::Receiver<PodEvent>) {
        loop {
            match got(rx.recv().await) {
                Some(Some(PodEvent::Changed { namespace, name })) => self.pod_changed(&namespace, &name),
                // Relisted, or events were missed: what left is forgotten, the rest looked at.
                Some(_) => {
                    self.net.prune();
                    self.look_at_everything();
                }
                None => return,
            }
        }
    }

    async fn work(self: Arc<Self>) {
        while let Some(key) = self.queue.next().await {
            self.metrics.release.reconciles.with_label_values(&["pod"]).inc();
            match self.net.check(&key.0, &key.1, &self.fence).await {
                Ok(_) => self.queue.forget(&key),
                Err(NetError::NotLeader(e)) => {
                    debug!(error = %e, "safety net: not leading any more");
                    self.queue.done(&key);
                    return;
                }
                Err(e) => self.failed(&key, e).await,
            }
            self.queue.done(&key);
        }
    }

    /// A hold or mark that failed: counted, said (on the policy when one selected the Pod,
    /// else on the Pod), and tried again with backoff.
    async fn failed(&self, key: &PodKey, e: NetError) {
        let policy = match &e {
            NetError::Hold { policy, .. } => policy.clone(),
            _ => String::new(),
        };
        let release = &self.metrics.release;
        release.failures.with_label_values(&[&policy, "safety_net"]).inc();
        release.retries.with_label_values(&[&policy]).inc();
        let after = self.queue.retry(key.clone());
        warn!(namespace = %key.0, pod = %key.1, policy, error = %e, retry_in = ?after, "safety net: could not hold a Pod that left; retrying");
        let reference = match policy.as_str() {
            "" => pod_ref(&key.0, &key.1, ""),
            p => policy_ref(p),
        };
        self.events.publish(&reference, EventType::Warning, "SafetyNetHoldFailed", "Hold", e.to_string()).await;
    }
}

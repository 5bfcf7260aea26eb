//! The safety net: the leader holds a selected Pod that leaves (deleted, or in a terminal
//! phase with its IPs still in status) without passing through the webhook — a kubelet's
//! node-pressure eviction, a webhook outage under `failurePolicy: Ignore`. It is a hold
//! like the webhook's, decided by the same [rule](super::rule), driven by that Pod's
//! events.
//!
//! It acts at most once per Pod UID: a hold in place is left alone; a Pod whose hold was
//! released while it stayed carries `capo.io/released`, and one whose IPs it found taken
//! carries `capo.io/not-held` — neither is ever held again, by this leader or the next.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use capo_api::HoldTrigger;
use capo_api::keys::NOT_HELD_ANNOTATION;
use kube::Client;
use kube::runtime::events::EventType;
use tracing::{info, warn};

use super::rule::{Origin, decide};
use super::{HoldError, HoldRequest, HoldWriter, marks};
use crate::calico::shards;
use crate::events::{Events, pod_ref};
use crate::leader::{Fence, NotLeader};
use crate::metrics::Metrics;
use crate::policy::{Decision, SharedMatcher};
use crate::store::workloads::Owner;
use crate::store::{NamespaceStore, PodStore, RecordIndex, WorkloadStore};

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("holding {namespace}/{pod}: {message}")]
    Hold { namespace: String, pod: String, policy: String, message: String },
    #[error("marking Pod {namespace}/{pod}: {source}")]
    Mark { namespace: String, pod: String, source: kube::Error },
}

/// What the safety net did for one Pod.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Nothing,
    Skipped(&'static str),
    Held { new: usize, lost: usize },
}

pub struct SafetyNet {
    pub client: Client,
    pub writer: HoldWriter,
    pub pods: Arc<PodStore>,
    pub namespaces: Arc<NamespaceStore>,
    pub workloads: Arc<WorkloadStore>,
    pub records: Arc<RecordIndex>,
    pub matcher: SharedMatcher,
    pub metrics: Arc<Metrics>,
    pub events: Events,
    pub excluded: Vec<String>,
    /// Only policies whose name starts with this (tests share one API server).
    pub policy_prefix: Option<String>,
    /// Pods (namespace/name → UID) this leader has dealt with.
    done: Mutex<HashMap<(String, String), String>>,
}

impl SafetyNet {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        writer: HoldWriter,
        pods: Arc<PodStore>,
        namespaces: Arc<NamespaceStore>,
        workloads: Arc<WorkloadStore>,
        records: Arc<RecordIndex>,
        matcher: SharedMatcher,
        metrics: Arc<Metrics>,
        events: Events,
        excluded: Vec<String>,
        policy_prefix: Option<String>,
    ) -> Self {
        Self {
            client,
            writer,
            pods,
            namespaces,
            workloads,
            records,
            matcher,
            metrics,
            events,
            excluded,
            policy_prefix,
            done: Default::default(),
        }
    }

    /// Forgets a Pod that left the store (deleted): the memory stays bounded by the Pods
    /// that exist.
    pub fn forget(&self, namespace: &str, name: &str) {
        let mut done = self.done.lock().expect("safety net lock");
        if done.remove(&(namespace.to_string(), name.to_string())).is_some() {
            self.metrics.release.safety_net_remembered.set(done.len() as i64);
        }
    }

    /// Forgets every Pod the store no longer has with the same UID (after a fresh list, or
    /// when Pod events were missed).
    pub fn prune(&self) {
        let mut done = self.done.lock().expect("safety net lock");
        done.retain(|(ns, name), uid| self.pods.get(ns, name).is_some_and(|p| p.uid == *uid));
        self.metrics.release.safety_net_remembered.set(done.len() as i64);
    }

    /// Remembers a Pod looked at, while the store still has it: a Pod that left meanwhile
    /// (its `forget` may have run already) is not remembered for ever. The store drops a Pod
    /// before it announces the change, and `forget` takes this lock, so either this sees it
    /// gone or `forget` comes after.
    fn remember(&self, key: (String, String), uid: String) {
        let mut done = self.done.lock().expect("safety net lock");
        if self.pods.get(&key.0, &key.1).is_some_and(|p| p.uid == uid) {
            done.insert(key, uid);
        }
        self.metrics.release.safety_net_remembered.set(done.len() as i64);
    }

    /// Forgets everything when the term ends: a follower looks at nothing, and a gauge left
    /// at the last term's count would outlive what it measured.
    pub fn clear(&self) {
        self.done.lock().expect("safety net lock").clear();
        self.metrics.release.safety_net_remembered.set(0);
    }

    /// Whether a record holds `ip`, and for which Pod UID.
    fn holder_of(&self, ip: IpAddr) -> Option<String> {
        self.records.get(&capo_api::reserved_ip::record_name(ip)).map(|r| r.spec.pod.uid.clone())
    }

    /// Looks at the Pod `namespace/name` after an event.
    pub async fn check(&self, namespace: &str, name: &str, fence: &Fence) -> Result<Outcome, NetError> {
        let key = (namespace.to_string(), name.to_string());
        let Some(pod) = self.pods.get(namespace, name) else {
            self.forget(namespace, name);
            return Ok(Outcome::Nothing);
        };
        // Its owner's kind is watched before the Pod leaves, so the answer is ready then.
        if let Some(owner) = &pod.controller {
            self.workloads.note(owner);
        }
        if self.done.lock().expect("safety net lock").get(&key) == Some(&pod.uid) {
            return Ok(Outcome::Nothing);
        }
        if !pod.leaving() || pod.ips.is_empty() || pod.host_network || pod.uid.is_empty() {
            return Ok(Outcome::Nothing);
        }
        // IPs held already — for this Pod, or for another (a record per IP): nothing to do.
        let open: Vec<IpAddr> = pod.ips.iter().copied().filter(|ip| self.holder_of(*ip).is_none()).collect();
        if open.is_empty() {
            return Ok(Outcome::Nothing);
        }
        let Some(ns) = self.namespaces.get(namespace) else { return Ok(Outcome::Nothing) };
        let owner = pod.controller.as_ref().map_or(Owner::Unknown, |c| self.workloads.owner(namespace, c));
        let plan = match decide(&self.matcher.load(), &pod, &ns, Origin::SafetyNet { owner }, &self.excluded) {
            Decision::Skip(reason) => {
                self.metrics.release.safety_net_skipped.with_label_values(&[reason.as_str()]).inc();
                self.remember(key, pod.uid.clone());
                return Ok(Outcome::Skipped(reason.as_str()));
            }
            Decision::Hold(plan) => plan,
        };
        let policy = plan.policy.name.clone();
        if self.policy_prefix.as_deref().is_some_and(|p| !policy.starts_with(p)) {
            return Ok(Outcome::Nothing);
        }
        fence.check()?;
        // An IP another Pod that is not leaving already has: not this Pod's to hold.
        let (lost, keep): (Vec<IpAddr>, Vec<IpAddr>) =
            open.iter().partition(|ip| self.pods.with_ip(**ip).iter().any(|o| o.uid != pod.uid && !o.leaving()));
        if !lost.is_empty() {
            let ips = lost.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
            marks::mark(&self.client, namespace, name, &pod.uid, NOT_HELD_ANNOTATION, &ips)
                .await
                .map_err(|source| NetError::Mark { namespace: namespace.into(), pod: name.into(), source })?;
            self.metrics.release.safety_net_lost_races.with_label_values(&[&policy]).inc_by(lost.len() as u64);
            warn!(namespace, pod = name, ips, "safety net too late: the IP is already another Pod's");
            let note = format!(
                "capo saw this Pod terminate without a hold, too late: {ips} already belongs to another Pod; not held"
            );
            self.events
                .publish(&pod_ref(namespace, name, &pod.uid), EventType::Warning, "LateHoldLost", "Hold", note)
                .await;
        }
        let mut new = 0;
        if !keep.is_empty() {
            let mut facts = (*pod).clone();
            facts.ips = keep;
            let req = HoldRequest {
                policy: &policy,
                shards: shards::count(plan.policy.max_reserved),
                reserve_for: plan.reserve_for,
                pod: &facts,
                trigger: HoldTrigger::SafetyNet,
                forced: false,
            };
            match self.writer.hold(&req).await {
                Ok(held) => {
                    new = held.iter().filter(|h| h.is_new()).count();
                    if new > 0 {
                        self.metrics.release.safety_net_holds.with_label_values(&[&policy]).inc_by(new as u64);
                        info!(namespace, pod = name, policy, "safety net held a Pod that left without a hold");
                    }
                }
                Err(errors) => {
                    let message = errors.iter().map(HoldError::to_string).collect::<Vec<_>>().join("; ");
                    return Err(NetError::Hold { namespace: namespace.into(), pod: name.into(), policy, message });
                }
            }
        }
        self.remember(key, pod.uid.clone());
        Ok(Outcome::Held { new, lost: lost.len() })
    }
}

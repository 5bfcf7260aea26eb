//! Sticky IPs: the mutating review of a Pod CREATE. A StatefulSet Pod created again under
//! the name of a Pod whose addresses capo holds, by a policy with `sticky.enabled`, gets
//! them back: the answer names them in `cni.projectcalico.org/ipAddrs`, and Calico's CNI
//! plugin assigns exactly those (`AssignIP` ignores reservations, which keep them from
//! everyone else meanwhile).
//!
//! Every hold handed back is claimed first (`status.claim`, written against the record's
//! version), so the leader cannot release it between this answer and the CNI call. It is
//! all or nothing: a Pod that got one family of its addresses back and not the other would
//! come up with one family only. Nothing is handed back from a hold the safety net made,
//! from a forced deletion (grace 0), or while the old Pod's node is not Ready: there the
//! old Pod may still run with the address.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Instant;

use capo_api::keys::{
    CALICO_IP_ADDRS_ANNOTATION, HOLD_ANNOTATION, OWNER_UID_LABEL, STICKY_ANNOTATION, STICKY_CLAIM_ANNOTATION,
};
use capo_api::{HoldTrigger, ReservedIP, StickyClaim};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::admission::AdmissionResponse;
use serde_json::json;
use tracing::{debug, info, warn};

use super::handler::{Admission, within};
use super::respond::allow;
use super::review::ReviewRequest;
use crate::calico::entry::pointer_escape;
use crate::pod::PodFacts;
use crate::release::decide::plus;

/// How often a claim is tried against a record the leader keeps writing.
const CLAIM_ATTEMPTS: usize = 3;

#[derive(Debug, thiserror::Error)]
enum ClaimError {
    #[error("the hold is gone")]
    Gone,
    #[error("the hold changed since it was read (released, claimed or held for another Pod)")]
    Changed,
    #[error(transparent)]
    Api(kube::Error),
}

/// Where the API server sends Pod CREATE reviews (the mutating webhook).
pub const STICKY_PATH: &str = "/sticky-pod-create";

/// Why nothing was handed back; the `outcome` label of `capo_sticky_claims_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Passed {
    NotStatefulSet,
    OptedOut,
    AddressesNamed,
    HostNetwork,
    /// No policy has `sticky.enabled`: answered without reading anything.
    NoStickyPolicy,
    /// No sticky policy selects the Pod (its labels, namespace, workload, opt-in).
    NotSelected,
    /// A Pod of that name (another than the held one) is in the cache: this CREATE cannot
    /// succeed (or the review is forged), and a claim would only strand the hold.
    NameTaken,
    NothingHeld,
    PolicyNotSticky,
    SafetyNet,
    Forced,
    FellBack,
    /// The hold's claims reached their bound (`fallbackAfter` after the first claim).
    ClaimBound,
    PoolNodeSelector,
    /// The pool no longer gives addresses to Pods (`allowedUses` without `Workload`): Calico
    /// 3.33's CNI plugin would refuse the named address, and the Pod would not start.
    PoolNotForWorkloads,
    /// One of the old Pod's addresses is no longer held (a dual-stack Pod's other family).
    FamilyNotHeld,
    NodeNotReady,
    Unreadable,
    ClaimFailed,
}

impl Passed {
    fn as_str(self) -> &'static str {
        match self {
            Self::NotStatefulSet => "not_statefulset",
            Self::OptedOut => "opted_out",
            Self::AddressesNamed => "addresses_named",
            Self::HostNetwork => "host_network",
            Self::NoStickyPolicy => "no_sticky_policy",
            Self::NotSelected => "not_selected",
            Self::NameTaken => "name_taken",
            Self::NothingHeld => "nothing_held",
            Self::PolicyNotSticky => "policy_not_sticky",
            Self::SafetyNet => "safety_net_hold",
            Self::Forced => "forced_deletion",
            Self::FellBack => "fell_back_before",
            Self::ClaimBound => "claim_bound_reached",
            Self::PoolNodeSelector => "pool_node_selector",
            Self::PoolNotForWorkloads => "pool_not_for_workloads",
            Self::FamilyNotHeld => "address_not_held",
            Self::NodeNotReady => "node_not_ready",
            Self::Unreadable => "unreadable",
            Self::ClaimFailed => "claim_failed",
        }
    }
}

/// The Pod's controlling StatefulSet (any API group: an OpenKruise Advanced StatefulSet
/// keeps names too), by uid.
fn statefulset_uid(pod: &Pod) -> Option<String> {
    pod.owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "StatefulSet" && !o.uid.is_empty())
        .map(|o| o.uid.clone())
}

/// `ipAddrs`' value: the addresses, IPv4 first, as a JSON list.
pub(crate) fn ip_addrs_value(ips: &[IpAddr]) -> String {
    let mut ips = ips.to_vec();
    ips.sort_by_key(|ip| (ip.is_ipv6(), *ip));
    serde_json::to_string(&ips.iter().map(ToString::to_string).collect::<Vec<_>>()).expect("strings")
}

impl Admission {
    /// Reviews a Pod CREATE: `Err` only for a request that is not a well-formed review.
    pub(super) async fn sticky(
        &self,
        req: &ReviewRequest<'_>,
        resp: AdmissionResponse,
        deadline: Instant,
    ) -> Result<(&'static str, AdmissionResponse), String> {
        if !(req.operation == "CREATE" && req.resource == "pods" && req.sub_resource.is_none()) {
            return Ok(("ignored", allow(resp, vec![])));
        }
        let namespace = req.namespace.clone().unwrap_or_default();
        if self.settings.excluded_namespaces.contains(&namespace) {
            return Ok(("excluded", allow(resp, vec![])));
        }
        if req.dry_run {
            // Claims are side effects: a dry run gets no addresses back.
            return Ok(("dry_run", allow(resp, vec![])));
        }
        let raw = req.object.ok_or("a Pod CREATE review without object")?;
        let pod: Pod = serde_json::from_str(raw.get()).map_err(|e| format!("object: not a Pod object: {e}"))?;
        let name = pod.metadata.name.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| req.name.clone());
        match self.hand_back(&namespace, &name, &pod, deadline).await {
            Ok((policy, ips)) => {
                self.metrics.sticky_claims.with_label_values(&[&policy, "claimed"]).inc();
                let list = ip_addrs_value(&ips);
                info!(namespace, pod = %name, policy, ips = %list, "sticky: handed the held addresses back");
                let mut ops = Vec::new();
                if pod.metadata.annotations.is_none() {
                    ops.push(json!({ "op": "add", "path": "/metadata/annotations", "value": {} }));
                }
                for key in [CALICO_IP_ADDRS_ANNOTATION, STICKY_CLAIM_ANNOTATION] {
                    ops.push(json!({ "op": "add", "path": format!("/metadata/annotations/{}", pointer_escape(key)), "value": list }));
                }
                let patch: json_patch::Patch = serde_json::from_value(json!(ops)).expect("patch shape");
                let warning = format!("capo: {list} handed back to {namespace}/{name} (sticky IPs, policy {policy})");
                let resp = allow(resp, vec![warning]);
                resp.with_patch(patch).map(|r| ("claimed", r)).map_err(|e| format!("building the patch: {e}"))
            }
            Err((policy, passed, note)) => {
                self.metrics.sticky_claims.with_label_values(&[policy.as_deref().unwrap_or(""), passed.as_str()]).inc();
                debug!(namespace, pod = %name, outcome = passed.as_str(), "sticky: nothing handed back");
                let warnings = note.map(|n| vec![format!("capo: {n}")]).unwrap_or_default();
                Ok((passed.as_str(), allow(resp, warnings)))
            }
        }
    }

    /// Claims the holds of the Pod `namespace/name` had before and returns their
    /// addresses, or why none are handed back (with the policy, and a note for the user).
    async fn hand_back(
        &self,
        namespace: &str,
        name: &str,
        pod: &Pod,
        deadline: Instant,
    ) -> Result<(String, Vec<IpAddr>), (Option<String>, Passed, Option<String>)> {
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        let Some(owner) = statefulset_uid(pod) else { return Err((None, Passed::NotStatefulSet, None)) };
        if [STICKY_ANNOTATION, HOLD_ANNOTATION].iter().any(|k| annotations.get(*k).is_some_and(|v| v == "false")) {
            return Err((None, Passed::OptedOut, None));
        }
        if annotations.contains_key(CALICO_IP_ADDRS_ANNOTATION) {
            return Err((None, Passed::AddressesNamed, None));
        }
        if pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
            return Err((None, Passed::HostNetwork, None));
        }
        // Most clusters have no sticky policy, and most StatefulSets no sticky policy
        // selects: the API server still calls (the webhook is installed), and capo answers
        // from memory, without a read (DESIGN §6).
        let matcher = self.matcher.load();
        if !matcher.policies().iter().any(|p| p.sticky.is_some()) {
            return Err((None, Passed::NoStickyPolicy, None));
        }
        let facts = PodFacts::from_pod(pod);
        let facts = PodFacts { namespace: namespace.to_string(), name: name.to_string(), ..facts };
        let ns_labels = self.namespaces.get(namespace).map(|n| n.labels.clone());
        if !matcher.sticky_may_select(&facts, ns_labels.as_ref()) {
            return Err((None, Passed::NotSelected, None));
        }
        // Not held across the read below (a guard pins the policy set it loaded); the
        // holds' policy is looked up afterwards in the set as it is then.
        drop(matcher);
        let records = match self.held_for(namespace, name, &owner, deadline).await {
            Ok(r) if r.is_empty() => return Err((None, Passed::NothingHeld, None)),
            Ok(r) => r,
            Err(e) => {
                warn!(namespace, pod = %name, error = %e, "sticky: could not list the holds of the Pod");
                let note = format!("could not look up held addresses for {namespace}/{name}: {e}");
                return Err((None, Passed::Unreadable, Some(note)));
            }
        };
        let policy = records[0].spec.policy.clone();
        let passed = |p: Passed| Err((Some(policy.clone()), p, None));
        // The Pod the holds were made for is gone before its StatefulSet creates it again;
        // a live Pod of that name means the API server will refuse this CREATE (a retry
        // that lost a race) or nobody is creating one (a forged review).
        if self.pods.get(namespace, name).is_some_and(|p| p.uid != records[0].spec.pod.uid) {
            return passed(Passed::NameTaken);
        }
        let Some(fallback_after) = self.matcher.load().get(&policy).and_then(|p| p.sticky) else {
            return passed(Passed::PolicyNotSticky);
        };
        let now = Timestamp::now();
        for r in &records {
            if r.spec.policy != policy {
                return passed(Passed::PolicyNotSticky);
            }
            if !matches!(r.spec.trigger, HoldTrigger::Delete | HoldTrigger::Eviction) {
                return passed(Passed::SafetyNet);
            }
            if r.spec.forced {
                return passed(Passed::Forced);
            }
            if let Some(c) = r.claim() {
                // However often the Pod is created again, a hold's claims end at most
                // `fallbackAfter` after the first: past it the hold runs its course (a tenant
                // recreating an unschedulable Pod must not keep an address forever).
                if c.fell_back_at.is_none() && now >= plus(c.first(), fallback_after) {
                    let note = format!(
                        "the held addresses of {namespace}/{name} are not handed back again: they were first handed back at {}, and a claim lasts at most sticky.fallbackAfter ({:?}) however often the Pod is created again",
                        c.first(),
                        fallback_after
                    );
                    return Err((Some(policy), Passed::ClaimBound, Some(note)));
                }
                if c.fell_back_at.is_some() || !c.pending(now) {
                    return passed(Passed::FellBack);
                }
            }
        }
        // A renewal (the claim is pending: the Pod was created again before it showed the
        // address) keeps the first claim's time, and its bound.
        let earlier = records.iter().filter_map(|r| r.claim()).min_by_key(|c| c.first());
        let first = earlier.map_or(now, |c| c.first());
        let renewals = earlier.map_or(0, |c| c.renewals.saturating_add(1));
        let ips: Vec<IpAddr> = records.iter().filter_map(|r| r.spec.ip.parse().ok()).collect();
        // A pool no longer for Pods: the CNI plugin would refuse the address.
        if let Some(pools) = &self.pools
            && ips.iter().any(|ip| pools.pool_of(*ip).is_some_and(|p| !p.for_workloads))
        {
            return passed(Passed::PoolNotForWorkloads);
        }
        // A pool that serves only some nodes: the new Pod may land on a node it does not
        // serve (capo answers before the scheduler places the Pod).
        if let Some(pools) = &self.pools
            && ips.iter().any(|ip| pools.pool_of(*ip).is_some_and(|p| p.node_restricted))
        {
            return passed(Passed::PoolNodeSelector);
        }

        // The old Pod's every address must still be held: a Pod that named only some of
        // them would come up without the others' family.
        let had: Vec<IpAddr> = records[0].spec.pod.addresses.iter().filter_map(|a| a.parse().ok()).collect();
        if had.iter().any(|a| !ips.contains(a)) {
            return passed(Passed::FamilyNotHeld);
        }
        if let Some(node) = records.iter().find_map(|r| r.spec.pod.node.clone()) {
            match self.node_ready(&node, deadline).await {
                Ok(true) => {}
                Ok(false) => {
                    let note = format!(
                        "the held addresses of {namespace}/{name} are not handed back: node {node} is not Ready, the old Pod may still run there"
                    );
                    return Err((Some(policy), Passed::NodeNotReady, Some(note)));
                }
                Err(e) => {
                    warn!(namespace, pod = %name, node, error = %e, "sticky: could not read the old Pod's node");
                    return Err((Some(policy), Passed::Unreadable, None));
                }
            }
        }
        let claim = StickyClaim {
            at: MicroTime(now),
            until: MicroTime(plus(first.min(now), fallback_after)),
            first_at: Some(MicroTime(first)),
            renewals,
            fell_back_at: None,
            fell_back_reason: None,
        };
        let mut claimed: Vec<(String, String)> = Vec::new();
        for r in &records {
            let left = deadline.saturating_duration_since(Instant::now());
            let outcome = match tokio::time::timeout(left, self.claim(r, &claim)).await {
                Ok(outcome) => outcome.map_err(|e| e.to_string()),
                Err(_) => Err("no answer from the API server within the review's deadline".to_string()),
            };
            match outcome {
                Ok(version) => claimed.push((r.name_any(), version)),
                Err(e) => {
                    warn!(namespace, pod = %name, record = %r.name_any(), error = %e, "sticky: could not claim the hold");
                    for (record, version) in claimed {
                        self.unclaim(&record, &version).await;
                    }
                    return passed(Passed::ClaimFailed);
                }
            }
        }
        Ok((policy, ips))
    }

    /// The holds of the Pod `namespace/name` of the StatefulSet `owner` (from the API
    /// server's watch cache; the claim itself is written against each record's version).
    async fn held_for(
        &self,
        namespace: &str,
        name: &str,
        owner: &str,
        deadline: Instant,
    ) -> Result<Vec<ReservedIP>, String> {
        let api = Api::<ReservedIP>::all(self.client.clone());
        let lp = ListParams::default().labels(&format!("{OWNER_UID_LABEL}={owner}")).match_any();
        let list = within(deadline, api.list(&lp)).await?;
        let mut held: Vec<ReservedIP> = list
            .items
            .into_iter()
            .filter(|r| {
                let p = &r.spec.pod;
                p.namespace == namespace
                    && p.name == name
                    && p.controller.as_ref().and_then(|c| c.uid.as_deref()) == Some(owner)
                    && r.metadata.deletion_timestamp.is_none()
            })
            .collect();
        // One Pod's addresses: the most recent hold per family (an older record of the
        // same name may be another, earlier Pod's).
        held.sort_by_key(|r| std::cmp::Reverse(r.spec.reserved_at.0));
        let mut by_family: BTreeMap<bool, ReservedIP> = BTreeMap::new();
        for r in held {
            let v6 = r.spec.ip.contains(':');
            by_family.entry(v6).or_insert(r);
        }
        let newest = by_family.values().map(|r| r.spec.pod.uid.clone()).next();
        Ok(by_family.into_values().filter(|r| Some(&r.spec.pod.uid) == newest.as_ref()).collect())
    }

    /// Writes the claim on `rec`, against the version read; returns the record's new
    /// version. The list came from the API server's cache: on a conflict (the leader wrote
    /// the countdown meanwhile) the record is read afresh and claimed if it is still the
    /// same hold, unclaimed by anyone else since.
    async fn claim(&self, rec: &ReservedIP, claim: &StickyClaim) -> Result<String, ClaimError> {
        let api = Api::<ReservedIP>::all(self.client.clone());
        let mut version = rec.resource_version();
        for _ in 0..CLAIM_ATTEMPTS {
            let patch = json!({ "metadata": { "resourceVersion": version }, "status": { "claim": claim } });
            match api.patch_status(&rec.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await {
                Ok(done) => return Ok(done.resource_version().unwrap_or_default()),
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(ClaimError::Api(e)),
            }
            let now = api.get_opt(&rec.name_any()).await.map_err(ClaimError::Api)?.ok_or(ClaimError::Gone)?;
            let same = now.metadata.uid == rec.metadata.uid && now.spec == rec.spec;
            if !same || now.claim() != rec.claim() {
                return Err(ClaimError::Changed);
            }
            version = now.resource_version();
        }
        Err(ClaimError::Changed)
    }

    /// Takes back a claim this review wrote (another of the Pod's holds could not be
    /// claimed). Best effort: a claim left behind only keeps its hold until `until`.
    async fn unclaim(&self, record: &str, version: &str) {
        let api = Api::<ReservedIP>::all(self.client.clone());
        let patch = json!({ "metadata": { "resourceVersion": version }, "status": { "claim": null } });
        if let Err(e) = api.patch_status(record, &PatchParams::default(), &Patch::Merge(patch)).await {
            warn!(record, error = %e, "sticky: could not take back a claim");
        }
    }

    /// Whether `node` is Ready (a node that is gone is not).
    async fn node_ready(&self, node: &str, deadline: Instant) -> Result<bool, String> {
        let api = Api::<Node>::all(self.client.clone());
        let Some(node) = within(deadline, api.get_opt(node)).await? else { return Ok(false) };
        Ok(node
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_addrs_lists_ipv4_first_as_json() {
        let ips: Vec<IpAddr> = vec!["fd00::5".parse().unwrap(), "10.0.0.5".parse().unwrap()];
        assert_eq!(ip_addrs_value(&ips), r#"["10.0.0.5","fd00::5"]"#);
    }
}

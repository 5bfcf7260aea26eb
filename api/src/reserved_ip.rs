//! `ReservedIP`: capo's record of one held IP, the source of truth for its release.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// One IP that capo holds in a Calico `IPReservation` on behalf of a deleted Pod.
/// Named after the IP (`10.0.0.5`, `fd00--5` for `fd00::5`).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "capo.io",
    version = "v1alpha1",
    kind = "ReservedIP",
    plural = "reservedips",
    singular = "reservedip",
    shortname = "rip",
    category = "capo",
    status = "ReservedIPStatus",
    derive = "PartialEq",
    doc = "An IP capo holds in a Calico IPReservation after its Pod was deleted or evicted.",
    printcolumn(name = "IP", type_ = "string", json_path = ".spec.ip"),
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.policy"),
    printcolumn(name = "Namespace", type_ = "string", json_path = ".spec.pod.namespace"),
    printcolumn(name = "Pod", type_ = "string", json_path = ".spec.pod.name"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.pod.node", priority = 1),
    printcolumn(name = "Trigger", type_ = "string", json_path = ".spec.trigger"),
    printcolumn(name = "Hold", type_ = "string", json_path = ".spec.reserveFor"),
    printcolumn(name = "Reserved", type_ = "date", json_path = ".spec.reservedAt"),
    printcolumn(name = "Manual", type_ = "string", json_path = ".status.manual.action", priority = 1),
    printcolumn(name = "By", type_ = "string", json_path = ".status.manual.by", priority = 1)
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.cidr == self.ip + (self.ip.contains(':') ? '/128' : '/32')").message("spec.cidr must be the one address spec.ip: spec.ip + '/32' (IPv6: '/128')"))]
#[x_kube(validation = Rule::new("self.reservation == 'capo-' + self.policy || (self.reservation.startsWith('capo-' + self.policy + '.') && self.reservation.substring(size(self.policy) + 6).matches('^[1-9][0-9]{0,3}$'))").message("spec.reservation must be one of its policy's reservations: capo-<policy> or capo-<policy>.<n>"))]
#[x_kube(validation = Rule::new("self.calicoApiGroup in ['crd.projectcalico.org/v1', 'projectcalico.org/v3']").message("spec.calicoApiGroup must be crd.projectcalico.org/v1 or projectcalico.org/v3"))]
pub struct ReservedIPSpec {
    /// The held address.
    #[schemars(length(max = 45))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.ip cannot change: delete the record instead"))]
    pub ip: String,
    /// The entry in the reservation: `<ip>/32` or `<ip>/128`.
    #[schemars(length(max = 49))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.cidr cannot change: delete the record instead"))]
    pub cidr: String,
    /// The capo-owned Calico `IPReservation` holding the entry.
    #[schemars(length(max = 80))]
    pub reservation: String,
    /// The Calico API group the reservation was written in.
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.calicoApiGroup cannot change: delete the record instead"))]
    pub calico_api_group: String,
    /// The `CapoPolicy` that selected the Pod.
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.policy cannot change: delete the record instead"))]
    pub policy: String,
    /// The Pod that had the IP.
    pub pod: PodRef,
    /// What started the hold.
    pub trigger: HoldTrigger,
    /// When capo first wrote the hold. Repeated deletions keep it.
    pub reserved_at: MicroTime,
    /// How long the IP stays held once the Pod is gone (policy `reserveFor`, or the Pod's
    /// permitted override).
    pub reserve_for: String,
    /// An operator's request (`capo release`, `capo extend`), carried out by the leader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manual: Option<ManualChange>,
    /// The Pod was deleted with a grace period of 0 (forced): its containers may still
    /// run with the address, so it is never handed back (sticky IPs).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forced: bool,
}

/// What an operator asked for, and who.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ManualChange {
    pub action: ManualAction,
    /// The user who asked (from a SelfSubjectReview), e.g. `alice@example.com`.
    pub by: String,
    /// When they asked.
    pub at: MicroTime,
    /// `Extend`: the new release time, replacing the TTL's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<MicroTime>,
    /// When the leader took the request into its plan (`capo extend` waits for it); set
    /// by the leader on the status' request only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_at: Option<MicroTime>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ManualAction {
    /// Release now (paced by the policy's releaseInterval).
    Release,
    /// Keep the IP held until `until`.
    Extend,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.pod.namespace cannot change: delete the record instead"))]
    pub namespace: String,
    #[schemars(length(max = 253))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.pod.name cannot change: delete the record instead"))]
    pub name: String,
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.pod.uid cannot change: delete the record instead"))]
    pub uid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The Pod's controller (e.g. its StatefulSet), for early release when it is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<ControllerRef>,
    /// Every address the Pod had when it was held (each held by a record of its own): a
    /// dual-stack Pod's addresses are handed back together or not at all (sticky IPs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub addresses: Vec<String>,
}

/// A Pod's controlling owner, as its owner reference names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControllerRef {
    /// e.g. `apps/v1`, or `apps.kruise.io/v1beta1` for an OpenKruise Advanced
    /// StatefulSet. Older records lack it: `apps` is assumed for that group's kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 317))]
    pub api_version: Option<String>,
    #[schemars(length(max = 63))]
    pub kind: String,
    #[schemars(length(max = 253))]
    pub name: String,
    /// The owner's UID: an owner deleted and created again under the same name is
    /// another owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub uid: Option<String>,
}

/// Kinds of the `apps` group a record written without `apiVersion` may name.
const APPS_KINDS: [&str; 4] = ["StatefulSet", "ReplicaSet", "DaemonSet", "Deployment"];

impl ControllerRef {
    /// The owner's API group and kind; `None` when the record does not say its group and
    /// the kind is not one of the `apps` group's.
    pub fn group_kind(&self) -> Option<(String, String)> {
        let group = match &self.api_version {
            Some(v) => v.rsplit_once('/').map_or("", |(g, _)| g).to_string(),
            None if APPS_KINDS.contains(&self.kind.as_str()) => "apps".to_string(),
            None => return None,
        };
        Some((group, self.kind.clone()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum HoldTrigger {
    /// A Pod DELETE request reached the webhook.
    Delete,
    /// A `pods/eviction` CREATE request reached the webhook.
    Eviction,
    /// The leader saw a selected Pod terminate without passing through the webhook.
    SafetyNet,
    /// The leader found the entry in a capo-owned reservation without a record (a crash
    /// between the two writes, or an entry written by hand) and adopted it.
    Adopted,
    /// Taken over from the original capo (`capo take-over`), with its reserve time.
    Migrated,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReservedIPStatus {
    /// When capo saw the Pod object gone (or in a terminal phase); the hold's clock
    /// starts here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_gone_at: Option<MicroTime>,
    /// When the leader will release the IP (podGoneAt + reserveFor, or an operator's
    /// `capo extend`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_at: Option<MicroTime>,
    /// Since when the leader has seen the Pod still running and not being deleted (an
    /// eviction refused by a PodDisruptionBudget after capo held, a deletion denied by
    /// another webhook). Such a hold is dropped after a grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_kept_since: Option<MicroTime>,
    /// An operator's request (`capo release`, `capo extend`) made through the status
    /// subresource: it needs `patch` on `reservedips/status` only, never on the record's
    /// spec. The leader keeps it until it carries it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manual: Option<ManualChange>,
    /// Sticky IPs: the Pod created again under the held Pod's name was given this address
    /// back (by `cni.projectcalico.org/ipAddrs`). While the claim is pending the hold is
    /// never released; it ends once that Pod shows the address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<StickyClaim>,
}

/// A recreated Pod's claim on a held address.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StickyClaim {
    /// When capo's webhook handed the address back (the latest time).
    pub at: MicroTime,
    /// Until when the Pod may take to show it; past it capo falls back.
    pub until: MicroTime,
    /// When the hold was first claimed; a renewal (the Pod created again before it showed
    /// the address) keeps it. However often it is renewed, a hold's claim ends at most
    /// `fallbackAfter` after this. Absent on claims written before capo had the bound:
    /// `at` stands in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_at: Option<MicroTime>,
    /// How many times a CREATE renewed the claim.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub renewals: u32,
    /// When capo fell back: the Pod did not show the address in time, its annotation was
    /// removed, and the hold runs its course. A claim that fell back is never made again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back_at: Option<MicroTime>,
    /// Why it fell back: `NotShown` (no Pod showed the address by `until`),
    /// `BoundReached` (renewed until `firstAt` + `fallbackAfter`), `Released` (an
    /// operator's `capo release`), `WorkloadGone` (its workload or namespace was deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back_reason: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl StickyClaim {
    /// Whether the claim still protects the hold at `now`.
    pub fn pending(&self, now: k8s_openapi::jiff::Timestamp) -> bool {
        self.fell_back_at.is_none() && now < self.until.0
    }

    /// When the hold was first claimed.
    pub fn first(&self) -> k8s_openapi::jiff::Timestamp {
        self.first_at.as_ref().unwrap_or(&self.at).0
    }
}

impl ReservedIP {
    /// The claim of a recreated Pod (sticky IPs), if any.
    pub fn claim(&self) -> Option<&StickyClaim> {
        self.status.as_ref().and_then(|s| s.claim.as_ref())
    }

    /// The operator's latest request: the status subresource's or (written by capo before
    /// 0.x, or by hand) the spec's, whichever was made last.
    pub fn manual(&self) -> Option<&ManualChange> {
        let by_status = self.status.as_ref().and_then(|s| s.manual.as_ref());
        match (by_status, self.spec.manual.as_ref()) {
            (Some(a), Some(b)) => Some(if b.at.0 > a.at.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

/// The object name of the record for `ip`: the IP itself, with `:` spelled `-` for IPv6.
pub fn record_name(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            // Canonical form, with a leading or trailing `::` given an explicit zero so the
            // name starts and ends with an alphanumeric character.
            let mut s = v6.to_string();
            if s.starts_with("::") {
                s.insert(0, '0');
            }
            if s.ends_with("::") {
                s.push('0');
            }
            s.replace(':', "-")
        }
    }
}

/// The reservation entry for `ip`: a single-address CIDR in canonical form.
pub fn single_ip_cidr(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}/32"),
        IpAddr::V6(v6) => format!("{v6}/128"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_are_valid_object_names_and_distinct_per_family() {
        let v4: IpAddr = "10.1.2.3".parse().unwrap();
        let v6: IpAddr = "FD00:0:0::A".parse().unwrap();
        assert_eq!(record_name(v4), "10.1.2.3");
        assert_eq!(record_name(v6), "fd00--a");
        let edges: [IpAddr; 2] = ["::1".parse().unwrap(), "fd00:1::".parse().unwrap()];
        assert_eq!(record_name(edges[0]), "0--1");
        assert_eq!(record_name(edges[1]), "fd00-1--0");
        for n in [record_name(v4), record_name(v6), record_name(edges[0]), record_name(edges[1])] {
            assert!(n.len() <= 253);
            assert!(!n.starts_with('-') && !n.ends_with('-'), "{n}");
            assert!(n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'));
        }
    }

    #[test]
    fn single_ip_cidrs_are_canonical() {
        assert_eq!(single_ip_cidr("10.1.2.3".parse().unwrap()), "10.1.2.3/32");
        assert_eq!(single_ip_cidr("FD00:0000::0001".parse().unwrap()), "fd00::1/128");
    }
}

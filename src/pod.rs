//! The few facts about a Pod that capo decides on, trimmed from the full object so the
//! cache grows with the number of Pods, not the size of their specs.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Deserialize;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub labels: capo_api::Labels,
    /// Only capo's own annotations (`capo.io/...`) are kept.
    pub annotations: BTreeMap<String, String>,
    /// The controlling owner reference.
    pub controller: Option<capo_api::ControllerRef>,
    pub node: Option<String>,
    pub host_network: bool,
    /// Every IP in `status.podIPs` (both families when dual-stack), deduplicated.
    pub ips: Vec<IpAddr>,
    pub phase: Option<String>,
    pub deleting: bool,
}

/// Why a Pod can never be held, whatever the policies say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unholdable {
    NoIps,
    HostNetwork,
    OptedOut,
}

impl PodFacts {
    /// The one definition of "this Pod can be held", shared by the matcher, the Pod cache
    /// and (as CEL) the webhook's `matchConditions` (`webhook_config::MATCH_CONDITION`;
    /// `admission::match_conditions_agree_with_the_pods_own_rule` checks they agree).
    pub fn unholdable(&self) -> Option<Unholdable> {
        if self.ips.is_empty() {
            Some(Unholdable::NoIps)
        } else if self.host_network {
            Some(Unholdable::HostNetwork)
        } else if self.annotations.get(capo_api::keys::HOLD_ANNOTATION).map(String::as_str) == Some("false") {
            Some(Unholdable::OptedOut)
        } else {
            None
        }
    }
}

/// The wire shape of a Pod, reduced to what [`PodFacts`] needs; unknown fields are skipped
/// without being allocated.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct PodWire {
    metadata: MetaWire,
    spec: SpecWire,
    status: StatusWire,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct MetaWire {
    name: String,
    namespace: String,
    uid: String,
    resource_version: Option<String>,
    labels: capo_api::Labels,
    annotations: BTreeMap<String, String>,
    owner_references: Vec<OwnerWire>,
    deletion_timestamp: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct OwnerWire {
    api_version: String,
    kind: String,
    name: String,
    uid: String,
    controller: Option<bool>,
}

impl OwnerWire {
    fn into_ref(self) -> capo_api::ControllerRef {
        capo_api::ControllerRef {
            api_version: Some(self.api_version).filter(|v| !v.is_empty()),
            kind: self.kind,
            name: self.name,
            uid: Some(self.uid).filter(|u| !u.is_empty()),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct SpecWire {
    node_name: Option<String>,
    host_network: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct StatusWire {
    phase: Option<String>,
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pod_ips: Vec<PodIpWire>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PodIpWire {
    ip: String,
}

#[derive(Debug, thiserror::Error)]
#[error("not a Pod object: {0}")]
pub struct PodParseError(#[from] serde_json::Error);

/// A Pod as capo's watch decodes it: straight from the API server's JSON into
/// [`PodFacts`] (everything else skipped unread), plus the few metadata fields a watch
/// needs. Nothing of a Pod's spec or status beyond that is ever allocated.
#[derive(Clone, Debug)]
pub struct TrimmedPod {
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    pub facts: PodFacts,
}

impl kube::Resource for TrimmedPod {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Pod".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "pods".into()
    }
    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &mut self.metadata
    }
}

impl<'de> Deserialize<'de> for TrimmedPod {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = PodWire::deserialize(d)?;
        let metadata = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(wire.metadata.name.clone()),
            namespace: Some(wire.metadata.namespace.clone()),
            uid: Some(wire.metadata.uid.clone()).filter(|u| !u.is_empty()),
            resource_version: wire.metadata.resource_version.clone(),
            ..Default::default()
        };
        Ok(Self { metadata, facts: PodFacts::from_wire(wire) })
    }
}

impl PodFacts {
    /// From a Pod's JSON (an admission request's `oldObject`).
    pub fn from_json(value: &serde_json::Value) -> Result<Self, PodParseError> {
        let wire = PodWire::deserialize(value)?;
        Ok(Self::from_wire(wire))
    }

    /// From a typed Pod (the watch cache).
    pub fn from_pod(pod: &k8s_openapi::api::core::v1::Pod) -> Self {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        let listed = status.and_then(|s| s.pod_ips.as_ref()).into_iter().flatten().map(|p| p.ip.as_str());
        let single = status.and_then(|s| s.pod_ip.as_deref());
        Self {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default().into(),
            annotations: capo_annotations(meta.annotations.iter().flatten().map(|(k, v)| (k.clone(), v.clone()))),
            controller: meta.owner_references.iter().flatten().find(|o| o.controller == Some(true)).map(|o| {
                capo_api::ControllerRef {
                    api_version: Some(o.api_version.clone()).filter(|v| !v.is_empty()),
                    kind: o.kind.clone(),
                    name: o.name.clone(),
                    uid: Some(o.uid.clone()).filter(|u| !u.is_empty()),
                }
            }),
            node: spec.and_then(|s| s.node_name.clone()).filter(|n| !n.is_empty()),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            ips: parse_ips(listed.chain(single)),
            phase: status.and_then(|s| s.phase.clone()),
            deleting: meta.deletion_timestamp.is_some(),
        }
    }

    fn from_wire(w: PodWire) -> Self {
        let listed = w.status.pod_ips.iter().map(|p| p.ip.as_str());
        let ips = parse_ips(listed.chain(w.status.pod_ip.as_deref()));
        let controller =
            w.metadata.owner_references.into_iter().find(|o| o.controller == Some(true)).map(OwnerWire::into_ref);
        Self {
            namespace: w.metadata.namespace,
            name: w.metadata.name,
            uid: w.metadata.uid,
            labels: w.metadata.labels,
            annotations: capo_annotations(w.metadata.annotations),
            controller,
            node: w.spec.node_name.filter(|n| !n.is_empty()),
            host_network: w.spec.host_network.unwrap_or(false),
            ips,
            phase: w.status.phase,
            deleting: w.metadata.deletion_timestamp.is_some(),
        }
    }

    pub fn key(&self) -> (String, String) {
        (self.namespace.clone(), self.name.clone())
    }

    /// Whether the webhook is called for a DELETE of this Pod (the `matchConditions`): it
    /// could be held, and its deletion is not under way already.
    pub fn reviewed(&self) -> bool {
        self.unholdable().is_none() && !self.deleting
    }

    /// In a terminal phase: its containers are gone and the CNI has freed its IPs.
    pub fn terminal(&self) -> bool {
        matches!(self.phase.as_deref(), Some("Succeeded" | "Failed"))
    }

    /// Being deleted, or terminal: on its way out.
    pub fn leaving(&self) -> bool {
        self.deleting || self.terminal()
    }

    /// Whether capo is done with this very Pod (this UID): its hold was released while the
    /// object stayed, or the safety net found its IPs taken. Such a Pod is never held again.
    /// The annotation counts only if it names this Pod's UID (a copy on another Pod does not).
    /// A KubeVirt VM's launcher Pod (controlled by a `VirtualMachineInstance`, or labelled
    /// `kubevirt.io=virt-launcher`). Calico 3.32+ keeps a VM's address through its
    /// launcher Pod's deletion while the VM lives (`kubeVirtVMAddressPersistence`, on by
    /// default): the address is not freed, so there is nothing for capo to hold, and a
    /// hold would count it twice against its pool.
    pub fn is_kubevirt_vm(&self) -> bool {
        let launcher = self.labels.get("kubevirt.io").is_some_and(|v| v == "virt-launcher");
        let vmi = self.controller.as_ref().is_some_and(|c| {
            c.kind == "VirtualMachineInstance"
                && c.api_version.as_deref().is_some_and(|v| v.starts_with("kubevirt.io/"))
        });
        launcher || vmi
    }

    pub fn hold_done(&self) -> Option<&'static str> {
        [(capo_api::keys::RELEASED_ANNOTATION, "released"), (capo_api::keys::NOT_HELD_ANNOTATION, "not_held")]
            .into_iter()
            .find(|(key, _)| {
                self.annotations
                    .get(*key)
                    .is_some_and(|v| !self.uid.is_empty() && v.split(' ').next() == Some(&self.uid))
            })
            .map(|(_, what)| what)
    }
}

/// Every parseable IP once, in order (`status.podIPs` lists `status.podIP` again).
/// The Pod's addresses: at most one per family (the Kubernetes rule for `podIPs`; a body
/// that lists more is not a Pod the API server wrote), the first of each.
fn parse_ips<'a>(raw: impl Iterator<Item = &'a str>) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = Vec::with_capacity(2);
    for ip in raw.filter_map(|r| r.parse::<IpAddr>().ok()) {
        if !ips.iter().any(|held| held.is_ipv4() == ip.is_ipv4()) {
            ips.push(ip);
        }
    }
    ips
}

fn capo_annotations(all: impl IntoIterator<Item = (String, String)>) -> BTreeMap<String, String> {
    all.into_iter().filter(|(k, _)| k.starts_with(capo_api::keys::CAPO_PREFIX)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_every_ip_of_a_dual_stack_pod_once() {
        let pod = PodFacts::from_json(&json!({
            "metadata": {"name": "r-0", "namespace": "ns", "uid": "u1",
                "annotations": {"capo.io/hold": "true", "other.io/x": "y"},
                "ownerReferences": [
                    {"kind": "Other", "name": "o", "apiVersion": "v1", "uid": "1"},
                    {"kind": "StatefulSet", "name": "r", "controller": true, "apiVersion": "apps/v1", "uid": "2"}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}
        }))
        .unwrap();
        assert_eq!(pod.ips, vec!["10.0.0.1".parse::<IpAddr>().unwrap(), "fd00::1".parse().unwrap()]);
        let owner = pod.controller.as_ref().expect("the controller");
        assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("StatefulSet", "r"));
        assert_eq!(owner.group_kind(), Some(("apps".into(), "StatefulSet".into())));
        assert_eq!(owner.uid.as_deref(), Some("2"));
        assert_eq!(pod.annotations.len(), 1, "only capo.io annotations are kept");
        assert_eq!(pod.node.as_deref(), Some("n1"));
        assert!(!pod.host_network && !pod.deleting);
    }

    #[test]
    fn a_pod_without_status_has_no_ips() {
        let pod = PodFacts::from_json(&json!({"metadata": {"name": "p", "namespace": "n"}})).unwrap();
        assert!(pod.ips.is_empty());
        assert!(PodFacts::from_json(&json!("not an object")).is_err());
    }

    #[test]
    fn typed_and_json_pods_give_the_same_facts() {
        let value = json!({
            "metadata": {"name": "r-0", "namespace": "ns", "uid": "u1", "labels": {"a": "b"},
                "annotations": {"capo.io/hold": "true"},
                "ownerReferences": [{"kind": "StatefulSet", "name": "r", "controller": true, "apiVersion": "apps/v1", "uid": "2"}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}
        });
        let typed: k8s_openapi::api::core::v1::Pod = serde_json::from_value(value.clone()).unwrap();
        assert_eq!(PodFacts::from_pod(&typed), PodFacts::from_json(&value).unwrap());
    }

    /// The Kubernetes rule for `podIPs`: one address per family. A body that lists more
    /// (a forged review) gets the first of each family, never hundreds of holds.
    #[test]
    fn at_most_one_address_per_family_is_kept() {
        let mut listed = vec![json!({ "ip": "10.0.0.1" }), json!({ "ip": "10.0.0.2" })];
        listed.extend((1..=300).map(|i| json!({ "ip": format!("fd00::{i:x}") })));
        let pod = PodFacts::from_json(&json!({"status": {"podIP": "10.0.0.9", "podIPs": listed}})).unwrap();
        assert_eq!(pod.ips, vec!["10.0.0.1".parse::<IpAddr>().unwrap(), "fd00::1".parse().unwrap()]);
    }

    #[test]
    fn malformed_ips_are_ignored() {
        let pod = PodFacts::from_json(&json!({"status": {"podIPs": [{"ip": "nope"}, {"ip": "10.0.0.2"}]}})).unwrap();
        assert_eq!(pod.ips, vec!["10.0.0.2".parse::<IpAddr>().unwrap()]);
    }
}

//! `ReservedIP` records: one per held IP, created once per hold. A repeated deletion of
//! the same Pod keeps the first record (and its `reservedAt`); a record that described
//! another Pod is replaced by a new object, so the new hold starts with no status and a
//! `creationTimestamp` of its own (its countdown and its place in the cap's order).

use std::net::IpAddr;
use std::sync::Arc;

use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, NAMESPACE_LABEL, OWNER_UID_LABEL, POLICY_LABEL};
use capo_api::reserved_ip::record_name;
use capo_api::{ReservedIP, ReservedIPSpec};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, Error as KubeError};
use serde_json::json;

use crate::store::PodStore;

const ATTEMPTS: usize = 5;

#[derive(Debug, Clone, PartialEq)]
pub enum RecordOutcome {
    /// A new hold: the record's uid.
    Created { uid: String },
    /// The same Pod was already held: the first record stays as it was.
    Kept { uid: String },
    /// The IP was recorded for another Pod; a new record describes this one.
    Replaced { previous_pod: String, uid: String },
    /// The IP is recorded for another Pod that still has it (an address a Pod named in
    /// `cni.projectcalico.org/ipAddrs` while it was held): that hold stays as it was, and
    /// the IP stays held by it.
    HeldForOther { pod: String, uid: String },
}

impl RecordOutcome {
    /// Whether this request wrote the record (rather than finding a hold in place).
    pub fn created_here(&self) -> bool {
        matches!(self, Self::Created { .. } | Self::Replaced { .. })
    }

    pub fn uid(&self) -> &str {
        match self {
            Self::Created { uid }
            | Self::Kept { uid }
            | Self::Replaced { uid, .. }
            | Self::HeldForOther { uid, .. } => uid,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the ReservedIP API is not served: are capo's CRDs installed?")]
    NotServed,
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("gave up after {ATTEMPTS} conflicting attempts")]
    Contention,
    #[error("{0}")]
    Api(#[source] KubeError),
}

/// Whether two specs are the same as the API server keeps them (`reservedAt` to the
/// microsecond: a spec made here holds nanoseconds the server never sees).
fn same_on_the_wire(a: &ReservedIPSpec, b: &ReservedIPSpec) -> bool {
    matches!((serde_json::to_value(a), serde_json::to_value(b)), (Ok(a), Ok(b)) if a == b)
}

fn classify(e: KubeError) -> RecordError {
    match &e {
        KubeError::Api(s) if crate::calico::is_type_not_served(s) => RecordError::NotServed,
        KubeError::Api(s) if s.code == 403 => RecordError::Forbidden(s.message.clone()),
        _ => RecordError::Api(e),
    }
}

/// Whether `v` can be a label value (a uid always can; anything else is left out).
fn is_label_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && v.chars().next().is_none_or(|c| c.is_ascii_alphanumeric())
        && v.chars().last().is_none_or(|c| c.is_ascii_alphanumeric())
}

#[derive(Clone)]
pub struct Records {
    api: Api<ReservedIP>,
    /// The Pod store, to tell whether the Pod another record names still has its IP.
    pods: Option<Arc<PodStore>>,
}

impl Records {
    pub fn new(client: Client) -> Self {
        Self { api: Api::all(client), pods: None }
    }

    /// Never replaces a record whose Pod the store shows still there with that IP.
    pub fn with_pods(mut self, pods: Arc<PodStore>) -> Self {
        self.pods = Some(pods);
        self
    }

    /// Whether the Pod `existing` names is still there (same uid) with `ip`.
    fn holder_still_has(&self, existing: &ReservedIP, ip: IpAddr) -> bool {
        let p = &existing.spec.pod;
        self.pods
            .as_ref()
            .and_then(|pods| pods.get(&p.namespace, &p.name))
            .is_some_and(|pod| !p.uid.is_empty() && pod.uid == p.uid && pod.ips.contains(&ip))
    }

    /// Records the hold of `ip` (the address `spec.ip` spells).
    pub async fn record(&self, ip: IpAddr, spec: ReservedIPSpec) -> Result<RecordOutcome, RecordError> {
        let name = record_name(ip);
        let mut labels: std::collections::BTreeMap<String, String> =
            [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, spec.policy.as_str())]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into();
        if is_label_value(&spec.pod.namespace) {
            labels.insert(NAMESPACE_LABEL.to_string(), spec.pod.namespace.clone());
        }
        // The webhook finds the holds of a Pod its controller creates again by this label.
        if let Some(uid) = spec.pod.controller.as_ref().and_then(|c| c.uid.as_deref())
            && is_label_value(uid)
        {
            labels.insert(OWNER_UID_LABEL.to_string(), uid.to_string());
        }
        let fresh = ReservedIP {
            metadata: ObjectMeta { name: Some(name.clone()), labels: Some(labels), ..Default::default() },
            spec,
            status: None,
        };
        let mut previous_pod = None;
        // A create whose connection closed before the answer may have landed.
        let mut maybe_landed = false;
        for attempt in 0..ATTEMPTS {
            match self.api.create(&PostParams::default(), &fresh).await {
                Ok(created) => {
                    let uid = created.metadata.uid.unwrap_or_default();
                    return Ok(match previous_pod {
                        Some(previous_pod) => RecordOutcome::Replaced { previous_pod, uid },
                        None => RecordOutcome::Created { uid },
                    });
                }
                Err(KubeError::Api(s)) if s.code == 409 => {}
                // Sent again: if the first one landed, the 409 below finds it, the same
                // spec as sent, and counts it as created here.
                Err(e) if crate::client::is_transport(&e) && attempt + 1 < ATTEMPTS => {
                    maybe_landed = true;
                    crate::client::pause_before_retry(attempt).await;
                    continue;
                }
                Err(e) => return Err(classify(e)),
            }
            let existing = match self.api.get_opt(&name).await {
                Ok(existing) => existing,
                Err(e) if crate::client::is_transport(&e) && attempt + 1 < ATTEMPTS => {
                    crate::client::pause_before_retry(attempt).await;
                    continue;
                }
                Err(e) => return Err(classify(e)),
            };
            let Some(existing) = existing else {
                continue; // released meanwhile; create again
            };
            let uid = existing.metadata.uid.clone().unwrap_or_default();
            if maybe_landed && same_on_the_wire(&existing.spec, &fresh.spec) {
                // This request's own create (its `reservedAt` to the microsecond), which
                // landed before its connection closed: made here, not found.
                return Ok(match previous_pod {
                    Some(previous_pod) => RecordOutcome::Replaced { previous_pod, uid },
                    None => RecordOutcome::Created { uid },
                });
            }
            if existing.spec.pod.uid == fresh.spec.pod.uid {
                // The first hold stays; a later forced deletion of the same Pod (after an
                // eviction a PodDisruptionBudget refused) still says so on it.
                if fresh.spec.forced && !existing.spec.forced {
                    self.mark_forced(&existing).await?;
                }
                return Ok(RecordOutcome::Kept { uid: existing.metadata.uid.unwrap_or_default() });
            }
            // Another Pod's, and that Pod still has the IP: a review for this Pod must not
            // replace its hold (and so restart its countdown under this Pod's policy).
            if self.holder_still_has(&existing, ip) {
                let pod = format!("{}/{}", existing.spec.pod.namespace, existing.spec.pod.name);
                return Ok(RecordOutcome::HeldForOther { pod, uid: existing.metadata.uid.unwrap_or_default() });
            }
            // Another Pod's: that hold is over (the IP is this Pod's now). Remove exactly
            // that record and create this one.
            previous_pod = Some(format!("{}/{}", existing.spec.pod.namespace, existing.spec.pod.name));
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: existing.metadata.uid.clone(),
                    resource_version: existing.metadata.resource_version.clone(),
                }),
                ..Default::default()
            };
            match self.api.delete(&name, &dp).await {
                Ok(_) => {}
                Err(KubeError::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => return Err(classify(e)),
            }
        }
        Err(RecordError::Contention)
    }

    /// Sets `spec.forced` on exactly that record (its uid tested): its address is never
    /// handed back (sticky IPs).
    async fn mark_forced(&self, existing: &ReservedIP) -> Result<(), RecordError> {
        let patch: json_patch::Patch = serde_json::from_value(json!([
            { "op": "test", "path": "/metadata/uid", "value": existing.metadata.uid },
            { "op": "add", "path": "/spec/forced", "value": true },
        ]))
        .expect("static patch shape");
        let name = existing.metadata.name.clone().unwrap_or_default();
        match self.api.patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => Ok(()),
            // Gone, or another record since: nothing of this hold left to mark.
            Err(KubeError::Api(s)) if s.code == 404 || s.code == 422 => Ok(()),
            Err(e) => Err(classify(e)),
        }
    }

    /// The record of `ip`, read now.
    pub async fn get(&self, ip: IpAddr) -> Result<Option<ReservedIP>, RecordError> {
        self.api.get_opt(&record_name(ip)).await.map_err(classify)
    }

    /// Points the record (exactly that one) at the shard its entry went to, when that is
    /// not the one foreseen.
    pub async fn moved(&self, ip: IpAddr, uid: &str, reservation: &str) -> Result<(), RecordError> {
        let patch: json_patch::Patch = serde_json::from_value(json!([
            { "op": "test", "path": "/metadata/uid", "value": uid },
            { "op": "replace", "path": "/spec/reservation", "value": reservation },
        ]))
        .expect("static patch shape");
        match self.api.patch(&record_name(ip), &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => Ok(()),
            Err(KubeError::Api(s)) if s.code == 404 || s.code == 422 => Ok(()),
            Err(e) => Err(classify(e)),
        }
    }

    /// Deletes a record this request created, when the request was denied: a denied
    /// deletion leaves no record behind. Only that very record (uid precondition).
    pub async fn forget(&self, ip: IpAddr, uid: &str) -> Result<(), RecordError> {
        let dp = DeleteParams {
            preconditions: Some(Preconditions { uid: Some(uid.to_string()), resource_version: None }),
            ..Default::default()
        };
        match self.api.delete(&record_name(ip), &dp).await {
            Ok(_) => Ok(()),
            Err(KubeError::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(classify(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the webhook sent and what the API server gives back for it are the same hold;
    /// another `reservedAt` (a later hold of the same Pod) is not.
    #[test]
    fn a_spec_is_the_same_as_the_server_keeps_it_to_the_microsecond() {
        let spec = |at: k8s_openapi::jiff::Timestamp| -> ReservedIPSpec {
            serde_json::from_value(json!({
                "ip": "10.0.0.1", "cidr": "10.0.0.1/32", "reservation": "capo-p", "calicoApiGroup": "crd.projectcalico.org/v1",
                "policy": "p", "pod": { "namespace": "redis", "name": "redis-0", "uid": "u1" },
                "trigger": "Delete", "reservedAt": at, "reserveFor": "40m",
            }))
            .map(|mut s: ReservedIPSpec| {
                s.reserved_at = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(at);
                s
            })
            .unwrap()
        };
        let sent = spec(k8s_openapi::jiff::Timestamp::from_nanosecond(1_800_000_000_123_456_789).unwrap());
        let kept: ReservedIPSpec = serde_json::from_value(serde_json::to_value(&sent).unwrap()).unwrap();
        assert_ne!(sent, kept, "the server keeps microseconds only");
        assert!(same_on_the_wire(&sent, &kept));
        let later = spec(k8s_openapi::jiff::Timestamp::from_nanosecond(1_800_000_000_123_457_789).unwrap());
        assert!(!same_on_the_wire(&later, &kept));
    }
}

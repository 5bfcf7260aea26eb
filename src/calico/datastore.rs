//! Where Calico keeps its `IPReservation`s: in the API server (the Kubernetes datastore:
//! `crd.projectcalico.org/v1` CRDs, or `projectcalico.org/v3`), or in Calico's own etcd
//! (the etcd datastore: `projectcalico.org/v3` objects under
//! `/calico/resources/v3/projectcalico.org/ipreservations/<name>`).
//!
//! The reservation writer ([`super::writer`]) speaks one protocol to both: read an object,
//! create it, apply a JSON patch whose `test` operations guard it. With etcd, capo plays
//! the API server's part: it reads the key, applies the patch to the stored object (a
//! failed test is refused with 422, as the API server refuses it), checks what Calico's
//! validation checks (every entry a CIDR, no entry twice), and writes the result in one
//! etcd transaction that compares the key's revision with the one it read, so a
//! concurrent write is never lost: a changed key is read again and the patch applied
//! again. Values are stored exactly as Calico's own client stores them (its `clientv3` on
//! the `etcdv3` backend): the v3 object as JSON, without `resourceVersion`, which is the
//! key's mod revision.

use std::collections::{BTreeMap, HashSet};

use capo_api::CalicoApiGroup;
use capo_api::calico::RESERVED_CIDRS;
use k8s_openapi::jiff::{Timestamp, Unit};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::Status;
use kube::core::response::StatusDetails;
use kube::{Client, Error as KubeError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::entry::is_cidr;
use super::etcd::{Etcd, EtcdError, Expect, Kv, Written};

/// Where Calico's etcd datastore keeps IPReservations.
pub const ETCD_RESERVATIONS: &str = "/calico/resources/v3/projectcalico.org/ipreservations/";
/// Calico's IP pools in its etcd datastore.
pub const ETCD_POOLS: &str = "/calico/resources/v3/projectcalico.org/ippools/";
/// Calico IPAM's blocks in its etcd datastore (`ipv4/block/<cidr>`, `ipv6/block/<cidr>`).
pub const ETCD_BLOCKS: &str = "/calico/ipam/v2/assignment/";

/// How often a patch is applied again when the key changed under it.
const PATCH_ATTEMPTS: usize = 16;

/// Calico's datastore, as far as capo's reservations go.
#[derive(Clone)]
pub enum Datastore {
    /// The API server (both groups, whichever serves).
    Kubernetes(Client),
    /// Calico's etcd: every reservation is a `projectcalico.org/v3` object there.
    Etcd(Etcd),
}

fn status(code: u16, reason: &str, message: String, name: Option<&str>) -> KubeError {
    let mut s = Status::failure(&message, reason).with_code(code);
    if let Some(name) = name {
        s = s.with_details(StatusDetails {
            name: name.to_string(),
            group: "projectcalico.org".into(),
            kind: "ipreservations".into(),
            uid: String::new(),
            causes: Vec::new(),
            retry_after_seconds: 0,
        });
    }
    KubeError::Api(s.boxed())
}

/// How an etcd failure reaches the writer: as the API server would answer.
fn from_etcd(name: &str, e: EtcdError) -> KubeError {
    if e.is_too_large() {
        return status(413, "RequestEntityTooLarge", format!("IPReservation {name} is too large: {e}"), Some(name));
    }
    KubeError::Service(Box::new(e))
}

fn not_found(name: &str) -> KubeError {
    status(
        404,
        "NotFound",
        format!("ipreservations.projectcalico.org \"{name}\" not found (Calico's etcd)"),
        Some(name),
    )
}

fn invalid(name: &str, message: String) -> KubeError {
    status(422, "Invalid", format!("IPReservation.projectcalico.org \"{name}\" is invalid: {message}"), Some(name))
}

/// The stored form of an IPReservation, in the field order of Calico's Go types (so capo's
/// values read byte for byte like those `clientv3` writes).
#[derive(Serialize, Deserialize)]
struct Stored {
    kind: String,
    #[serde(rename = "apiVersion")]
    api_version: String,
    metadata: StoredMeta,
    spec: StoredSpec,
}

#[derive(Serialize, Deserialize)]
struct StoredMeta {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uid: Option<String>,
    #[serde(rename = "creationTimestamp", default)]
    creation_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
    /// Whatever else somebody stored (kept as it is).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

#[derive(Serialize, Deserialize)]
struct StoredSpec {
    #[serde(rename = "reservedCIDRs", default, skip_serializing_if = "Option::is_none")]
    reserved_cidrs: Option<Vec<String>>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// A fresh uid, as Calico's client gives every object it creates (UUID version 4).
fn new_uid() -> String {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 16];
    ring::rand::SystemRandom::new().fill(&mut b).expect("the system's random source");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// The object stored at `kv`, with its mod revision as `resourceVersion`.
pub fn object_of(kv: &Kv) -> Option<DynamicObject> {
    let mut value: Value = serde_json::from_slice(&kv.value).ok()?;
    value.get_mut("metadata")?.as_object_mut()?.insert("resourceVersion".into(), kv.mod_revision.to_string().into());
    serde_json::from_value(value).ok()
}

/// What Calico checks of an IPReservation (and the v3 CRD's schema: `format: cidr`,
/// `x-kubernetes-list-type: set`).
fn validate(object: &Value) -> Result<(), String> {
    let Some(entries) = object.pointer(&format!("/spec/{RESERVED_CIDRS}")) else { return Ok(()) };
    let Some(entries) = entries.as_array() else { return Err(format!("spec.{RESERVED_CIDRS}: not a list")) };
    let mut seen = HashSet::new();
    for (i, entry) in entries.iter().enumerate() {
        let Some(entry) = entry.as_str() else { return Err(format!("spec.{RESERVED_CIDRS}[{i}]: not a string")) };
        if !is_cidr(entry) {
            return Err(format!("spec.{RESERVED_CIDRS}[{i}]: Invalid value: {entry:?}: must be a CIDR"));
        }
        if !seen.insert(entry) {
            return Err(format!("spec.{RESERVED_CIDRS}[{i}]: Duplicate value: {entry:?}"));
        }
    }
    Ok(())
}

/// `object` in Calico's stored form (no `resourceVersion`, no `selfLink`).
fn encode(name: &str, mut object: Value) -> Result<Vec<u8>, KubeError> {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("resourceVersion");
        meta.remove("selfLink");
    }
    let stored: Stored =
        serde_json::from_value(object).map_err(|e| invalid(name, format!("not an IPReservation: {e}")))?;
    serde_json::to_vec(&stored).map_err(|e| invalid(name, e.to_string()))
}

fn to_object(name: &str, mut object: Value, revision: i64) -> Result<DynamicObject, KubeError> {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), revision.to_string().into());
    }
    serde_json::from_value(object).map_err(|e| invalid(name, e.to_string()))
}

impl Datastore {
    pub fn is_etcd(&self) -> bool {
        matches!(self, Self::Etcd(_))
    }

    fn api(client: &Client, group: CalicoApiGroup) -> Api<DynamicObject> {
        Api::all_with(client.clone(), &group.ip_reservation())
    }

    fn key(name: &str) -> String {
        format!("{ETCD_RESERVATIONS}{name}")
    }

    /// Reads reservation `name`.
    pub async fn get(&self, group: CalicoApiGroup, name: &str) -> Result<DynamicObject, KubeError> {
        match self {
            Self::Kubernetes(client) => Self::api(client, group).get(name).await,
            Self::Etcd(etcd) => {
                let kv =
                    etcd.get(&Self::key(name)).await.map_err(|e| from_etcd(name, e))?.ok_or_else(|| not_found(name))?;
                object_of(&kv).ok_or_else(|| invalid(name, "the stored value is not an IPReservation".into()))
            }
        }
    }

    /// Creates `object` (its name, labels, annotations and spec).
    pub async fn create(&self, group: CalicoApiGroup, object: &DynamicObject) -> Result<DynamicObject, KubeError> {
        let etcd = match self {
            Self::Kubernetes(client) => return Self::api(client, group).create(&PostParams::default(), object).await,
            Self::Etcd(etcd) => etcd,
        };
        let name = object.metadata.name.clone().unwrap_or_default();
        let mut meta = Map::new();
        meta.insert("name".into(), name.clone().into());
        meta.insert("uid".into(), new_uid().into());
        meta.insert(
            "creationTimestamp".into(),
            Timestamp::now().round(Unit::Second).unwrap_or(Timestamp::now()).to_string().into(),
        );
        if let Some(labels) = &object.metadata.labels {
            meta.insert("labels".into(), serde_json::to_value(labels).unwrap_or_default());
        }
        if let Some(annotations) = &object.metadata.annotations {
            meta.insert("annotations".into(), serde_json::to_value(annotations).unwrap_or_default());
        }
        let value = serde_json::json!({
            "kind": "IPReservation",
            "apiVersion": CalicoApiGroup::V3.api_version(),
            "metadata": meta,
            "spec": object.data.get("spec").cloned().unwrap_or_else(|| Value::Object(Map::new())),
        });
        validate(&value).map_err(|m| invalid(&name, m))?;
        let bytes = encode(&name, value.clone())?;
        match etcd.put_if(&Self::key(&name), &bytes, Expect::Absent).await.map_err(|e| from_etcd(&name, e))? {
            Written::At(revision) => to_object(&name, value, revision),
            Written::Changed(_) => Err(status(
                409,
                "AlreadyExists",
                format!("ipreservations.projectcalico.org \"{name}\" already exists (Calico's etcd)"),
                Some(&name),
            )),
        }
    }

    /// Applies the JSON patch `ops` to reservation `name`, atomically.
    pub async fn patch(&self, group: CalicoApiGroup, name: &str, ops: Vec<Value>) -> Result<DynamicObject, KubeError> {
        let patch: json_patch::Patch =
            serde_json::from_value(Value::Array(ops)).map_err(|e| invalid(name, e.to_string()))?;
        let etcd = match self {
            Self::Kubernetes(client) => {
                return Self::api(client, group).patch(name, &PatchParams::default(), &Patch::Json::<()>(patch)).await;
            }
            Self::Etcd(etcd) => etcd,
        };
        let key = Self::key(name);
        let mut current = etcd.get(&key).await.map_err(|e| from_etcd(name, e))?;
        for _ in 0..PATCH_ATTEMPTS {
            let Some(kv) = current else { return Err(not_found(name)) };
            let mut object: Value = serde_json::from_slice(&kv.value)
                .map_err(|e| invalid(name, format!("the stored value is not JSON: {e}")))?;
            if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.insert("resourceVersion".into(), kv.mod_revision.to_string().into());
            }
            json_patch::patch(&mut object, &patch)
                .map_err(|e| invalid(name, format!("the patch does not apply: {e}")))?;
            validate(&object).map_err(|m| invalid(name, m))?;
            let bytes = encode(name, object.clone())?;
            if bytes == kv.value {
                return to_object(name, object, kv.mod_revision); // only tests: nothing to write
            }
            match etcd
                .put_if(&key, &bytes, Expect::ModRevision(kv.mod_revision))
                .await
                .map_err(|e| from_etcd(name, e))?
            {
                Written::At(revision) => return to_object(name, object, revision),
                Written::Changed(now) => current = now,
            }
        }
        Err(status(409, "Conflict", format!("IPReservation {name} kept changing in Calico's etcd"), Some(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_stored_form_is_calicos() {
        let object = json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "IPReservation",
            "metadata": {
                "labels": { "capo.io/policy": "p", "app.kubernetes.io/managed-by": "capo" },
                "creationTimestamp": "2026-11-25T04:40:00Z",
                "name": "capo-p",
                "resourceVersion": "17",
                "uid": "6d1c6f0e-7b7e-4a57-9d0b-0d3c2f7a1e55",
            },
            "spec": { "reservedCIDRs": ["10.0.0.1/32"] },
        });
        let bytes = encode("capo-p", object).unwrap();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            r#"{"kind":"IPReservation","apiVersion":"projectcalico.org/v3","metadata":{"name":"capo-p","uid":"6d1c6f0e-7b7e-4a57-9d0b-0d3c2f7a1e55","creationTimestamp":"2026-11-25T04:40:00Z","labels":{"app.kubernetes.io/managed-by":"capo","capo.io/policy":"p"}},"spec":{"reservedCIDRs":["10.0.0.1/32"]}}"#
        );
    }

    #[test]
    fn calicos_checks() {
        assert!(validate(&json!({ "spec": { "reservedCIDRs": ["10.0.0.1/32", "fd00::/64"] } })).is_ok());
        assert!(validate(&json!({ "spec": {} })).is_ok());
        let dup = validate(&json!({ "spec": { "reservedCIDRs": ["10.0.0.1/32", "10.0.0.1/32"] } })).unwrap_err();
        assert!(dup.contains("Duplicate"), "{dup}");
        let bad = validate(&json!({ "spec": { "reservedCIDRs": ["10.0.0.1"] } })).unwrap_err();
        assert!(bad.contains("must be a CIDR"), "{bad}");
    }

    #[test]
    fn uids_are_version_4() {
        let uid = new_uid();
        assert_eq!(uid.len(), 36);
        assert_eq!(&uid[14..15], "4");
        assert_ne!(uid, new_uid());
    }

    #[test]
    fn a_stored_object_reads_with_its_revision() {
        let kv = Kv {
            key: format!("{ETCD_RESERVATIONS}capo-p"),
            value: br#"{"kind":"IPReservation","apiVersion":"projectcalico.org/v3","metadata":{"name":"capo-p"},"spec":{}}"#.to_vec(),
            mod_revision: 42,
        };
        let obj = object_of(&kv).unwrap();
        assert_eq!(obj.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(obj.metadata.name.as_deref(), Some("capo-p"));
    }
}

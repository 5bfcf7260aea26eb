//! The part of an AdmissionReview capo reads, decoded straight from the request body.
//!
//! Everything else is skipped unread: the Pod in `oldObject` is borrowed as raw JSON and
//! only its name, namespace, uid and (at most a few) addresses are decoded, so a 4 MiB
//! review costs its own bytes and nothing more, whatever its shape (a generic JSON tree of
//! a body of small numbers is many times the body). The Pod capo decides on is the
//! cluster's, never this one: see `Admission::confirm`.

use std::fmt;
use std::net::IpAddr;

use serde::Deserialize;
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// The only review version capo answers.
pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewWire<'a> {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    #[serde(borrow)]
    request: Option<RequestWire<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestWire<'a> {
    uid: String,
    resource: ResourceWire,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    operation: String,
    #[serde(default)]
    user_info: UserWire,
    #[serde(default)]
    dry_run: Option<bool>,
    #[serde(default, borrow)]
    old_object: Option<&'a RawValue>,
    /// An Eviction, or the Pod of a CREATE: kept raw, decoded by what reads it.
    #[serde(default, borrow)]
    object: Option<&'a RawValue>,
    /// A DELETE's options.
    #[serde(default)]
    options: Option<DeleteOptionsWire>,
}

#[derive(Deserialize)]
struct ResourceWire {
    resource: String,
}

#[derive(Deserialize, Default)]
struct UserWire {
    #[serde(default)]
    username: Option<String>,
}

/// An Eviction (the `object` of a `pods/eviction` review); for any other object only
/// the absence of `deleteOptions` is read.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct EvictionWire {
    #[serde(default)]
    delete_options: Option<DeleteOptionsWire>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DeleteOptionsWire {
    #[serde(default)]
    dry_run: Option<Vec<String>>,
    #[serde(default)]
    grace_period_seconds: Option<i64>,
}

/// One admission request, as far as capo reads it.
#[derive(Debug)]
pub struct ReviewRequest<'a> {
    pub uid: String,
    /// The resource (`pods`), its subresource (`eviction`) and the operation
    /// (`DELETE`, `CREATE`, ...), as sent.
    pub resource: String,
    pub sub_resource: Option<String>,
    pub operation: String,
    pub name: String,
    pub namespace: Option<String>,
    pub username: Option<String>,
    /// The request is a dry run (`?dryRun=All`).
    pub dry_run: bool,
    /// An Eviction whose own `deleteOptions.dryRun` is set (`kubectl drain --dry-run=server`).
    pub eviction_dry_run: bool,
    /// The Pod being deleted, undecoded.
    pub old_object: Option<&'a RawValue>,
    /// The request's object (the Pod of a CREATE), undecoded.
    pub object: Option<&'a RawValue>,
    /// The deletion asks for a grace period of 0 (`--force --grace-period=0`): the
    /// API server removes the Pod at once, whether its containers stopped or not.
    pub forced: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("malformed AdmissionReview: {0}")]
    Json(#[from] serde_json::Error),
    #[error("malformed AdmissionReview: apiVersion {api_version:?} kind {kind:?}; capo answers {API_VERSION} {KIND}")]
    Version { api_version: String, kind: String },
    #[error("malformed AdmissionReview: no request")]
    NoRequest,
}

/// Decodes the request of an `admission.k8s.io/v1` AdmissionReview.
pub fn parse(body: &[u8]) -> Result<ReviewRequest<'_>, ReviewError> {
    let wire: ReviewWire<'_> = serde_json::from_slice(body)?;
    if wire.kind != KIND || wire.api_version != API_VERSION {
        return Err(ReviewError::Version { api_version: wire.api_version, kind: wire.kind });
    }
    let r = wire.request.ok_or(ReviewError::NoRequest)?;
    let object = r.object.filter(|raw| raw.get() != "null");
    let eviction = match r.sub_resource.as_deref() {
        Some("eviction") => object.map(|raw| serde_json::from_str::<EvictionWire>(raw.get())).transpose()?,
        _ => None,
    };
    let eviction_options = eviction.and_then(|e| e.delete_options);
    let eviction_dry_run =
        eviction_options.as_ref().and_then(|d| d.dry_run.as_ref()).is_some_and(|modes| !modes.is_empty());
    let grace = match r.operation.as_str() {
        "DELETE" => r.options.and_then(|o| o.grace_period_seconds),
        _ => eviction_options.and_then(|d| d.grace_period_seconds),
    };
    Ok(ReviewRequest {
        uid: r.uid,
        resource: r.resource.resource,
        sub_resource: r.sub_resource.filter(|s| !s.is_empty()),
        operation: r.operation,
        name: r.name,
        namespace: r.namespace,
        username: r.user_info.username,
        dry_run: r.dry_run.unwrap_or(false),
        eviction_dry_run,
        old_object: r.old_object.filter(|raw| raw.get() != "null"),
        object,
        forced: grace == Some(0),
    })
}

/// What a DELETE review's `oldObject` says about its Pod: a claim to be confirmed against
/// the cluster, and what is logged when it is not.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ClaimedPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// At most [`CLAIMED_IPS`] addresses, as claimed.
    pub ips: Vec<IpAddr>,
}

/// The most addresses of a claim kept (for the log); a Pod has at most one per family.
const CLAIMED_IPS: usize = 4;

#[derive(Deserialize, Default)]
#[serde(default)]
struct ClaimWire {
    metadata: ClaimMetaWire,
    status: ClaimStatusWire,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ClaimMetaWire {
    name: String,
    namespace: String,
    uid: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ClaimStatusWire {
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pod_ips: FirstFew,
}

#[derive(Deserialize)]
struct IpWire {
    #[serde(default)]
    ip: String,
}

/// The first [`CLAIMED_IPS`] entries of a list; the rest are skipped unread.
#[derive(Default)]
struct FirstFew(Vec<String>);

impl<'de> Deserialize<'de> for FirstFew {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Few;
        impl<'de> Visitor<'de> for Few {
            type Value = FirstFew;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of {ip} objects")
            }
            fn visit_unit<E>(self) -> Result<FirstFew, E> {
                Ok(FirstFew::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FirstFew, A::Error> {
                let mut kept = Vec::new();
                while kept.len() < CLAIMED_IPS {
                    match seq.next_element::<IpWire>()? {
                        Some(ip) => kept.push(ip.ip),
                        None => return Ok(FirstFew(kept)),
                    }
                }
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(FirstFew(kept))
            }
        }
        d.deserialize_any(Few)
    }
}

impl ClaimedPod {
    pub fn parse(raw: &RawValue) -> Result<Self, serde_json::Error> {
        let wire: ClaimWire = serde_json::from_str(raw.get())?;
        let mut ips: Vec<IpAddr> = Vec::with_capacity(2);
        let listed = wire.status.pod_ips.0.iter().map(String::as_str);
        for ip in listed.chain(wire.status.pod_ip.as_deref()).filter_map(|r| r.parse::<IpAddr>().ok()) {
            if !ips.contains(&ip) && ips.len() < CLAIMED_IPS {
                ips.push(ip);
            }
        }
        Ok(Self { namespace: wire.metadata.namespace, name: wire.metadata.name, uid: wire.metadata.uid, ips })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn review(request: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&json!({ "apiVersion": API_VERSION, "kind": KIND, "request": request })).unwrap()
    }

    #[test]
    fn reads_what_capo_decides_on_and_skips_the_rest() {
        let body = review(json!({
            "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "zk-0", "namespace": "ns", "operation": "DELETE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "dryRun": true,
            "oldObject": {
                "metadata": {"name": "zk-0", "namespace": "ns", "uid": "abc", "labels": {"app": "zk"}},
                "spec": {"containers": [{"name": "c", "image": "zk"}]},
                "status": {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]},
            },
            "options": {"kind": "DeleteOptions"},
        }));
        let r = parse(&body).unwrap();
        assert_eq!((r.uid.as_str(), r.resource.as_str(), r.operation.as_str()), ("u1", "pods", "DELETE"));
        assert_eq!((r.name.as_str(), r.namespace.as_deref()), ("zk-0", Some("ns")));
        assert_eq!(r.username.as_deref(), Some("alice"));
        assert!(r.dry_run && !r.eviction_dry_run && r.sub_resource.is_none());
        let claimed = ClaimedPod::parse(r.old_object.unwrap()).unwrap();
        assert_eq!(claimed.uid, "abc");
        assert_eq!(claimed.ips, vec!["10.0.0.1".parse::<IpAddr>().unwrap(), "fd00::1".parse().unwrap()]);
    }

    #[test]
    fn an_evictions_own_dry_run_is_read() {
        let body = review(json!({
            "uid": "u1", "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": "eviction",
            "name": "zk-0", "namespace": "ns", "operation": "CREATE", "userInfo": {},
            "object": {"apiVersion": "policy/v1", "kind": "Eviction", "deleteOptions": {"dryRun": ["All"]}},
            "oldObject": null,
        }));
        let r = parse(&body).unwrap();
        assert!(r.eviction_dry_run && !r.dry_run);
        assert_eq!(r.sub_resource.as_deref(), Some("eviction"));
        assert!(r.old_object.is_none());
    }

    #[test]
    fn a_grace_period_of_zero_is_a_forced_deletion_and_only_that() {
        let delete = |options: serde_json::Value| {
            review(json!({
                "uid": "u1", "resource": {"resource": "pods"}, "name": "zk-0", "namespace": "ns",
                "operation": "DELETE", "options": options, "oldObject": {"metadata": {"uid": "x"}},
            }))
        };
        assert!(parse(&delete(json!({"gracePeriodSeconds": 0}))).unwrap().forced);
        assert!(!parse(&delete(json!({"gracePeriodSeconds": 30}))).unwrap().forced);
        assert!(!parse(&delete(json!({}))).unwrap().forced);
        assert!(!parse(&delete(json!(null))).unwrap().forced);
        let evict = review(json!({
            "uid": "u1", "resource": {"resource": "pods"}, "subResource": "eviction", "name": "zk-0",
            "namespace": "ns", "operation": "CREATE",
            "object": {"kind": "Eviction", "deleteOptions": {"gracePeriodSeconds": 0}},
        }));
        assert!(parse(&evict).unwrap().forced, "an eviction with grace 0 too");
        // A Pod CREATE keeps its object for the sticky webhook, and is not "forced".
        let create = review(json!({
            "uid": "u1", "resource": {"resource": "pods"}, "name": "zk-0", "namespace": "ns",
            "operation": "CREATE", "object": {"metadata": {"name": "zk-0"}},
        }));
        let r = parse(&create).unwrap();
        assert!(!r.forced && r.object.is_some_and(|o| o.get().contains("zk-0")));
    }

    #[test]
    fn a_huge_claim_keeps_a_few_addresses_and_nothing_else() {
        let many: Vec<_> = (0..10_000).map(|i| json!({"ip": format!("10.1.{}.{}", i / 250, i % 250)})).collect();
        let pod = json!({"metadata": {"uid": "x", "huge": vec![0; 100_000]}, "status": {"podIPs": many}});
        let raw = serde_json::value::to_raw_value(&pod).unwrap();
        let claimed = ClaimedPod::parse(&raw).unwrap();
        assert_eq!(claimed.ips.len(), CLAIMED_IPS);
    }

    #[test]
    fn refuses_other_versions_and_shapes_with_the_reason() {
        let v1beta1 = serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": KIND})).unwrap();
        assert!(matches!(parse(&v1beta1), Err(ReviewError::Version { .. })));
        let none = serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND})).unwrap();
        assert!(matches!(parse(&none), Err(ReviewError::NoRequest)));
        let bad_uid = review(json!({"uid": 5, "resource": {"resource": "pods"}, "operation": "DELETE"}));
        let e = parse(&bad_uid).unwrap_err().to_string();
        assert!(e.starts_with("malformed AdmissionReview: invalid type"), "{e}");
        assert!(parse(b"{").is_err());
    }
}

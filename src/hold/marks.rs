//! capo's marks on a Pod it is done with (`capo.io/released`, `capo.io/not-held`): they
//! name the Pod's UID, so they live and die with that very Pod, survive any restart or
//! change of leader, and tell `kubectl describe pod` what capo did.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, Error as KubeError};
use serde_json::json;

/// The value of a mark: `<pod uid> <what> <time>`.
pub fn value(uid: &str, what: &str) -> String {
    format!("{uid} {what} {}", k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ"))
}

/// Sets annotation `key` on the Pod `namespace/name` if it is still the Pod `uid`.
/// `Ok(false)`: that Pod is gone (nothing to mark).
pub async fn mark(
    client: &Client,
    namespace: &str,
    name: &str,
    uid: &str,
    key: &str,
    what: &str,
) -> Result<bool, KubeError> {
    // The uid in the patch is a precondition: a Pod recreated under the name is not touched.
    let patch = json!({ "metadata": { "uid": uid, "annotations": { key: value(uid, what) } } });
    match Api::<Pod>::namespaced(client.clone(), namespace)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => Ok(true),
        Err(KubeError::Api(s)) if s.code == 404 || s.code == 409 || s.code == 422 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Sticky IPs' fallback: removes the addresses capo handed back to the Pod
/// `namespace/name` (`cni.projectcalico.org/ipAddrs` and `capo.io/sticky-claim`, which
/// say the same) when it is not the held Pod `held_uid` and they name `ip`, so that
/// Calico's CNI plugin assigns it new addresses on its next try. Both values and the
/// Pod's uid are tested in the patch: addresses a user named are never touched.
/// `Ok(Some(uid))`: the Pod's uid, its annotations removed; `Ok(None)`: nothing to take.
pub async fn take_back(
    client: &Client,
    namespace: &str,
    name: &str,
    held_uid: &str,
    ip: std::net::IpAddr,
) -> Result<Option<String>, KubeError> {
    use capo_api::keys::{CALICO_IP_ADDRS_ANNOTATION, STICKY_CLAIM_ANNOTATION};
    let api = Api::<Pod>::namespaced(client.clone(), namespace);
    let Some(pod) = api.get_opt(name).await? else { return Ok(None) };
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let annotations = pod.metadata.annotations.unwrap_or_default();
    let (Some(claim), Some(named)) =
        (annotations.get(STICKY_CLAIM_ANNOTATION), annotations.get(CALICO_IP_ADDRS_ANNOTATION))
    else {
        return Ok(None);
    };
    let names_ip = serde_json::from_str::<Vec<String>>(claim)
        .is_ok_and(|list| list.iter().any(|a| a.parse::<std::net::IpAddr>().is_ok_and(|a| a == ip)));
    if uid == held_uid || claim != named || !names_ip {
        return Ok(None);
    }
    let path = |key: &str| format!("/metadata/annotations/{}", crate::calico::entry::pointer_escape(key));
    let patch: json_patch::Patch = serde_json::from_value(json!([
        { "op": "test", "path": "/metadata/uid", "value": uid },
        { "op": "test", "path": path(STICKY_CLAIM_ANNOTATION), "value": claim },
        { "op": "test", "path": path(CALICO_IP_ADDRS_ANNOTATION), "value": named },
        { "op": "remove", "path": path(STICKY_CLAIM_ANNOTATION) },
        { "op": "remove", "path": path(CALICO_IP_ADDRS_ANNOTATION) },
    ]))
    .expect("static patch shape");
    match api.patch(name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
        Ok(_) => Ok(Some(uid)),
        Err(KubeError::Api(s)) if s.code == 404 || s.code == 409 || s.code == 422 => Ok(None),
        Err(e) => Err(e),
    }
}

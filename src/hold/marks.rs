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

//! The `ValidatingWebhookConfiguration` capo writes for itself when it runs outside the
//! cluster (local runs, tests): its webhooks call `https://<addr>/review-pod-deletion` with capo's own CA.
//! In a cluster, Helm or kustomize ship the same configuration.

use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

/// Namespaces labelled with this get `failurePolicy: Fail` (the hard guarantee); all
/// others `Ignore`, backed by the safety net.
pub const FAILURE_POLICY_LABEL: &str = "capo.io/failure-policy";

#[derive(Clone, Debug)]
pub struct Registration {
    pub name: String,
    /// Base URL of the webhook server, e.g. `https://127.0.0.1:9443`.
    pub url: String,
    pub ca_pem: String,
    pub excluded_namespaces: Vec<String>,
    /// Further restricts the namespaces (tests scope a capo to their own namespace).
    pub only_namespaces: Option<Vec<String>>,
    pub timeout_seconds: i32,
}

/// CEL pre-filter: skip Pods that cannot be held (no IP, host network, opted out)
/// before the API server even calls capo.
pub const MATCH_CONDITION: &str = "request.subResource == 'eviction' || (\
has(oldObject.status) && has(oldObject.status.podIPs) && size(oldObject.status.podIPs) > 0 && \
!(has(oldObject.spec.hostNetwork) && oldObject.spec.hostNetwork) && \
!(has(oldObject.metadata.annotations) && 'capo.io/hold' in oldObject.metadata.annotations && \
oldObject.metadata.annotations['capo.io/hold'] == 'false'))";

pub fn render(reg: &Registration) -> ValidatingWebhookConfiguration {
    let ca = base64::engine::general_purpose::STANDARD.encode(reg.ca_pem.as_bytes());
    let webhook = |name: &str, failure_policy: &str, fail_ns_operator: &str| {
        let mut expressions = vec![
            json!({ "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": reg.excluded_namespaces }),
            json!({ "key": FAILURE_POLICY_LABEL, "operator": fail_ns_operator, "values": ["Fail"] }),
        ];
        if let Some(only) = &reg.only_namespaces {
            expressions.push(json!({ "key": "kubernetes.io/metadata.name", "operator": "In", "values": only }));
        }
        json!({
            "name": name,
            "clientConfig": { "url": format!("{}{}", reg.url.trim_end_matches('/'), crate::admission::REVIEW_PATH), "caBundle": ca },
            "rules": [
                { "apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["pods"], "scope": "Namespaced" },
                { "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods/eviction"], "scope": "Namespaced" },
            ],
            "namespaceSelector": { "matchExpressions": expressions },
            "matchConditions": [{ "name": "holdable-pod", "expression": MATCH_CONDITION }],
            "failurePolicy": failure_policy,
            "sideEffects": "NoneOnDryRun",
            "timeoutSeconds": reg.timeout_seconds,
            "admissionReviewVersions": ["v1"],
            "matchPolicy": "Equivalent",
        })
    };
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": { "name": reg.name, "labels": { capo_api::keys::MANAGED_BY_LABEL: capo_api::keys::MANAGED_BY_VALUE } },
        "webhooks": [
            webhook("hold.capo.io", "Ignore", "NotIn"),
            webhook("hold-required.capo.io", "Fail", "In"),
        ],
    }))
    .expect("static webhook configuration")
}

/// Creates or updates the configuration (server-side apply).
pub async fn apply(client: &Client, reg: &Registration) -> Result<(), kube::Error> {
    let api = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    api.patch(&reg.name, &PatchParams::apply("capo").force(), &Patch::Apply(render(reg))).await?;
    Ok(())
}

pub async fn delete(client: &Client, name: &str) -> Result<(), kube::Error> {
    let api = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    match api.delete(name, &Default::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

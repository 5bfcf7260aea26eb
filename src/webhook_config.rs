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
    /// The caBundle; `None`: written without one (capo's injector fills it in).
    pub ca_pem: Option<String>,
    pub excluded_namespaces: Vec<String>,
    /// Further restricts the namespaces (tests scope a capo to their own namespace).
    pub only_namespaces: Option<Vec<String>>,
    pub timeout_seconds: i32,
}

/// CEL pre-filter: skip Pods that cannot be held (no IP, host network, opted out), and
/// DELETEs that finish a deletion already under way, before the API server even calls
/// capo ([`crate::pod::PodFacts::reviewed`] says the same).
pub const MATCH_CONDITION: &str = "(has(request.subResource) && request.subResource == 'eviction') || (\
!has(oldObject.metadata.deletionTimestamp) && \
has(oldObject.status) && has(oldObject.status.podIPs) && size(oldObject.status.podIPs) > 0 && \
!(has(oldObject.spec.hostNetwork) && oldObject.spec.hostNetwork) && \
!(has(oldObject.metadata.annotations) && 'capo.io/hold' in oldObject.metadata.annotations && \
oldObject.metadata.annotations['capo.io/hold'] == 'false'))";

/// Where the API server reaches capo.
enum Endpoint<'a> {
    /// A URL, with capo's own CA or none (local runs, tests).
    Url { url: &'a str, ca_pem: Option<&'a str> },
    /// capo's Service in the cluster; the caBundle is injected later (cert-manager) and is
    /// deliberately absent here, so Argo CD sees no drift.
    Service { namespace: &'a str, name: &'a str },
}

/// The two webhooks: `Ignore` for every namespace, `Fail` for namespaces labelled
/// `capo.io/failure-policy=Fail`. One definition for self-registration and the manifests.
fn configuration(
    name: &str,
    endpoint: Endpoint<'_>,
    excluded_namespaces: &[String],
    only_namespaces: Option<&[String]>,
    timeout_seconds: i32,
) -> serde_json::Value {
    let client_config = match endpoint {
        Endpoint::Url { url, ca_pem } => {
            let mut config =
                json!({ "url": format!("{}{}", url.trim_end_matches('/'), crate::admission::REVIEW_PATH) });
            if let Some(pem) = ca_pem {
                config["caBundle"] = json!(base64::engine::general_purpose::STANDARD.encode(pem.as_bytes()));
            }
            config
        }
        Endpoint::Service { namespace, name } => json!({
            "service": { "namespace": namespace, "name": name, "path": crate::admission::REVIEW_PATH, "port": 443 },
        }),
    };
    let webhook = |name: &str, failure_policy: &str, fail_ns_operator: &str| {
        let mut expressions = vec![
            json!({ "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded_namespaces }),
            json!({ "key": FAILURE_POLICY_LABEL, "operator": fail_ns_operator, "values": ["Fail"] }),
        ];
        if let Some(only) = only_namespaces {
            expressions.push(json!({ "key": "kubernetes.io/metadata.name", "operator": "In", "values": only }));
        }
        json!({
            "name": name,
            "clientConfig": client_config,
            "rules": [
                { "apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["pods"], "scope": "Namespaced" },
                { "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods/eviction"], "scope": "Namespaced" },
            ],
            "namespaceSelector": { "matchExpressions": expressions },
            "matchConditions": [{ "name": "holdable-pod", "expression": MATCH_CONDITION }],
            "failurePolicy": failure_policy,
            "sideEffects": "NoneOnDryRun",
            "timeoutSeconds": timeout_seconds,
            "admissionReviewVersions": ["v1"],
            "matchPolicy": "Equivalent",
        })
    };
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": { "name": name, "labels": { capo_api::keys::MANAGED_BY_LABEL: capo_api::keys::MANAGED_BY_VALUE } },
        "webhooks": [
            webhook("hold.capo.io", "Ignore", "NotIn"),
            webhook("hold-required.capo.io", "Fail", "In"),
        ],
    })
}

pub fn render(reg: &Registration) -> ValidatingWebhookConfiguration {
    let endpoint = Endpoint::Url { url: &reg.url, ca_pem: reg.ca_pem.as_deref() };
    let value = configuration(
        &reg.name,
        endpoint,
        &reg.excluded_namespaces,
        reg.only_namespaces.as_deref(),
        reg.timeout_seconds,
    );
    serde_json::from_value(value).expect("static webhook configuration")
}

/// The configuration the manifests install (`make manifests` writes it to
/// `config/webhook/manifests.yaml`): capo's Service in `namespace`, kube-system and that
/// namespace excluded, 5 s timeout, no caBundle.
pub fn in_cluster(namespace: &str) -> serde_json::Value {
    let excluded = ["kube-system".to_string(), namespace.to_string()];
    let mut config = configuration("capo", Endpoint::Service { namespace, name: "capo" }, &excluded, None, 5);
    // Argo CD applies it after the controller (wave -1) and before the policies (1).
    config["metadata"]["annotations"] = json!({ "argocd.argoproj.io/sync-wave": "0" });
    config
}

/// `config/webhook/manifests.yaml`, as checked in.
pub fn in_cluster_yaml() -> String {
    let yaml = capo_api::crds::to_yaml(&in_cluster("capo-system")).expect("serializes");
    format!("# Generated by `make manifests` from src/webhook_config.rs. Do not edit.\n{yaml}")
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

#[cfg(test)]
mod tests {
    /// The checked-in webhook manifest is exactly what the code generates.
    #[test]
    fn webhook_manifest_does_not_drift() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/webhook/manifests.yaml");
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(on_disk == super::in_cluster_yaml(), "{} drifted; run `make manifests`", path.display());
        assert!(!on_disk.contains("caBundle"), "no caBundle in the manifests (injected in the cluster)");
    }
}

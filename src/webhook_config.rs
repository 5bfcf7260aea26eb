//! The `ValidatingWebhookConfiguration` capo writes for itself when it runs outside the
//! cluster (local runs, tests): its webhooks call `https://<addr>/review-pod-deletion` with capo's own CA.
//! In a cluster, Helm or kustomize ship the same configuration.

use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
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

/// CEL pre-filter of the sticky webhook: only a StatefulSet's Pods, not on the host
/// network, that name no addresses of their own and have not opted out.
pub const STICKY_MATCH_CONDITION: &str = "has(object.metadata.ownerReferences) && \
object.metadata.ownerReferences.exists(r, has(r.controller) && r.controller && r.kind == 'StatefulSet') && \
!(has(object.spec.hostNetwork) && object.spec.hostNetwork) && \
!(has(object.metadata.annotations) && ('cni.projectcalico.org/ipAddrs' in object.metadata.annotations || \
('capo.io/sticky' in object.metadata.annotations && object.metadata.annotations['capo.io/sticky'] == 'false')))";

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
fn client_config(endpoint: &Endpoint<'_>, path: &str) -> serde_json::Value {
    match endpoint {
        Endpoint::Url { url, ca_pem } => {
            let mut config = json!({ "url": format!("{}{path}", url.trim_end_matches('/')) });
            if let Some(pem) = ca_pem {
                config["caBundle"] = json!(base64::engine::general_purpose::STANDARD.encode(pem.as_bytes()));
            }
            config
        }
        Endpoint::Service { namespace, name } => json!({
            "service": { "namespace": namespace, "name": name, "path": path, "port": 443 },
        }),
    }
}

/// The namespaces a webhook is called for: none of `excluded`, only `only` (if given), and
/// whatever `extra` adds.
fn namespace_expressions(
    excluded: &[String],
    only: Option<&[String]>,
    extra: Option<serde_json::Value>,
) -> Vec<serde_json::Value> {
    let mut expressions =
        vec![json!({ "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded })];
    expressions.extend(extra);
    if let Some(only) = only {
        expressions.push(json!({ "key": "kubernetes.io/metadata.name", "operator": "In", "values": only }));
    }
    expressions
}

/// The sticky IPs' webhook (Pod CREATE, `Ignore`: a Pod is never kept from being created,
/// it only gets new addresses), a MutatingWebhookConfiguration of the same name.
fn sticky_configuration(
    name: &str,
    endpoint: Endpoint<'_>,
    excluded_namespaces: &[String],
    only_namespaces: Option<&[String]>,
    timeout_seconds: i32,
) -> serde_json::Value {
    let expressions = namespace_expressions(excluded_namespaces, only_namespaces, None);
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": { "name": name, "labels": { capo_api::keys::MANAGED_BY_LABEL: capo_api::keys::MANAGED_BY_VALUE } },
        "webhooks": [{
            "name": "sticky.capo.io",
            "clientConfig": client_config(&endpoint, crate::admission::STICKY_PATH),
            "rules": [
                { "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced" },
            ],
            "namespaceSelector": { "matchExpressions": expressions },
            "matchConditions": [{ "name": "statefulset-pod", "expression": STICKY_MATCH_CONDITION }],
            "failurePolicy": "Ignore",
            "sideEffects": "NoneOnDryRun",
            "reinvocationPolicy": "Never",
            "timeoutSeconds": timeout_seconds,
            "admissionReviewVersions": ["v1"],
            "matchPolicy": "Equivalent",
        }],
    })
}

fn configuration(
    name: &str,
    endpoint: Endpoint<'_>,
    excluded_namespaces: &[String],
    only_namespaces: Option<&[String]>,
    timeout_seconds: i32,
) -> serde_json::Value {
    let client_config = client_config(&endpoint, crate::admission::REVIEW_PATH);
    let webhook = |name: &str, failure_policy: &str, fail_ns_operator: &str| {
        let failure_policy_label =
            json!({ "key": FAILURE_POLICY_LABEL, "operator": fail_ns_operator, "values": ["Fail"] });
        let expressions = namespace_expressions(excluded_namespaces, only_namespaces, Some(failure_policy_label));
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

/// The validating configuration for self-registration.
pub fn render(reg: &Registration) -> ValidatingWebhookConfiguration {
    rendered(reg, configuration)
}

/// The sticky IPs' mutating configuration for self-registration.
pub fn render_sticky(reg: &Registration) -> MutatingWebhookConfiguration {
    rendered(reg, sticky_configuration)
}

type Build = fn(&str, Endpoint<'_>, &[String], Option<&[String]>, i32) -> serde_json::Value;

fn rendered<T: serde::de::DeserializeOwned>(reg: &Registration, build: Build) -> T {
    let endpoint = Endpoint::Url { url: &reg.url, ca_pem: reg.ca_pem.as_deref() };
    let value =
        build(&reg.name, endpoint, &reg.excluded_namespaces, reg.only_namespaces.as_deref(), reg.timeout_seconds);
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

/// The sticky IPs' configuration the manifests install, beside [`in_cluster`].
pub fn in_cluster_sticky(namespace: &str) -> serde_json::Value {
    let excluded = ["kube-system".to_string(), namespace.to_string()];
    let mut config = sticky_configuration("capo", Endpoint::Service { namespace, name: "capo" }, &excluded, None, 5);
    config["metadata"]["annotations"] = json!({ "argocd.argoproj.io/sync-wave": "0" });
    config
}

/// `config/webhook/manifests.yaml`, as checked in.
pub fn in_cluster_yaml() -> String {
    let yaml = capo_api::crds::to_yaml(&in_cluster("capo-system")).expect("serializes");
    let sticky = capo_api::crds::to_yaml(&in_cluster_sticky("capo-system")).expect("serializes");
    format!("# Generated by `make manifests` from src/webhook_config.rs. Do not edit.\n{yaml}---\n{sticky}")
}

/// Creates or updates both configurations (server-side apply).
pub async fn apply(client: &Client, reg: &Registration) -> Result<(), kube::Error> {
    let api = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    api.patch(&reg.name, &PatchParams::apply("capo").force(), &Patch::Apply(render(reg))).await?;
    let api = Api::<MutatingWebhookConfiguration>::all(client.clone());
    api.patch(&reg.name, &PatchParams::apply("capo").force(), &Patch::Apply(render_sticky(reg))).await?;
    Ok(())
}

pub async fn delete(client: &Client, name: &str) -> Result<(), kube::Error> {
    let gone = |r: Result<_, kube::Error>| match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    };
    gone(Api::<MutatingWebhookConfiguration>::all(client.clone()).delete(name, &Default::default()).await.map(|_| ()))?;
    gone(Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(name, &Default::default()).await.map(|_| ()))
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

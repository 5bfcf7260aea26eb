//! The install manifests against the real API server: `deploy/capo.yaml` is exactly what
//! kustomize renders from `config/default`, every manifest is accepted by a server-side
//! dry run, capo's ServiceAccount has least privilege (`kubectl auth can-i`), and capo
//! running with exactly that RBAC holds and releases.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;
use support::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Minimal stand-ins for cert-manager's, the Prometheus operator's and Argo CD's CRDs, so
/// manifests that use them can be checked.
fn fixture_crd(group: &str, kind: &str, plural: &str) -> CustomResourceDefinition {
    let version = match group {
        "argoproj.io" => "v1alpha1",
        _ => "v1",
    };
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("{plural}.{group}") },
        "spec": { "group": group, "scope": "Namespaced",
                  "names": { "kind": kind, "plural": plural, "singular": kind.to_lowercase() },
                  "versions": [{ "name": version, "served": true, "storage": true,
                                 "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }] },
    }))
    .unwrap()
}

async fn setup() -> Client {
    let client = client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    install_crd(&client, fixture_crd("cert-manager.io", "Issuer", "issuers")).await;
    install_crd(&client, fixture_crd("cert-manager.io", "Certificate", "certificates")).await;
    install_crd(&client, fixture_crd("monitoring.coreos.com", "ServiceMonitor", "servicemonitors")).await;
    install_crd(&client, fixture_crd("monitoring.coreos.com", "PrometheusRule", "prometheusrules")).await;
    install_crd(&client, fixture_crd("argoproj.io", "Application", "applications")).await;
    install_crd(&client, fixture_crd("argoproj.io", "AppProject", "appprojects")).await;
    for name in ["capo-system", "argocd"] {
        let ns = serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap();
        let _ =
            Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await;
    }
    client
}

#[tokio::test]
async fn the_plain_install_yaml_is_what_kustomize_renders() {
    let (ok, rendered) = kubectl(&["kustomize", repo("config/default").to_str().unwrap()], None).await;
    assert!(ok, "{rendered}");
    let on_disk = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    assert!(rendered == on_disk, "deploy/capo.yaml drifted from config/default; run `make manifests`");
}

#[tokio::test]
async fn every_manifest_passes_a_server_side_dry_run() {
    let _client = setup().await;
    for (how, path) in [("-f", "deploy/capo.yaml"), ("-k", "config/samples"), ("-k", "config/default")] {
        let (ok, out) =
            kubectl(&["apply", "--server-side", "--dry-run=server", how, repo(path).to_str().unwrap()], None).await;
        assert!(ok, "{path}: {out}");
        assert!(out.contains("(server dry run)"), "{path}: {out}");
    }
    let deploy = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    assert!(!deploy.contains("caBundle"), "no caBundle in the manifests: it is injected in the cluster");
}

/// The RBAC objects of `deploy/capo.yaml`, applied for real (once at a time: two tests
/// need them).
async fn apply_rbac() {
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = ONE.lock().await;
    let deploy = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    let rbac: Vec<&str> = deploy
        .split("\n---\n")
        .filter(|doc| ["kind: ServiceAccount", "kind: ClusterRole", "kind: Role"].iter().any(|k| doc.contains(k)))
        .collect();
    let (ok, out) =
        kubectl(&["apply", "--server-side", "--force-conflicts", "-f", "-"], Some(&rbac.join("\n---\n"))).await;
    assert!(ok, "{out}");
}

const SA: &str = "system:serviceaccount:capo-system:capo";

#[tokio::test]
async fn capos_service_account_has_least_privilege() {
    let _client = setup().await;
    apply_rbac().await;
    let allowed: &[&[&str]] = &[
        &["watch", "pods"],
        &["get", "namespaces"],
        &["patch", "ipreservations.crd.projectcalico.org"],
        &["create", "ipreservations.projectcalico.org"],
        &["create", "reservedips.capo.io"],
        &["delete", "reservedips.capo.io"],
        &["patch", "capopolicies.capo.io", "--subresource=status"],
        &["create", "events.events.k8s.io", "-n", "shop"],
        &["patch", "leases.coordination.k8s.io", "-n", "capo-system"],
        &["watch", "statefulsets.apps"],
    ];
    let denied: &[&[&str]] = &[
        &["delete", "ipreservations.crd.projectcalico.org"],
        &["delete", "pods"],
        &["create", "pods/eviction"],
        &["get", "secrets", "-n", "capo-system"],
        &["patch", "leases.coordination.k8s.io", "-n", "kube-system"],
        &["update", "capopolicies.capo.io"],
        &["create", "validatingwebhookconfigurations.admissionregistration.k8s.io"],
        &["get", "statefulsets.apps"],
    ];
    for (want, cases) in [(true, allowed), (false, denied)] {
        for args in cases {
            let mut full = vec!["auth", "can-i"];
            full.extend_from_slice(args);
            full.extend_from_slice(&["--as", SA]);
            let (_, out) = kubectl(&full, None).await;
            let yes = out.trim().starts_with("yes");
            assert_eq!(yes, want, "can-i {args:?}: {out}");
        }
    }
}

/// capo with exactly the manifests' RBAC (its client impersonates the ServiceAccount)
/// holds a Pod's IP and releases it after the TTL. Only the self-registration of the
/// webhook, which the manifests do in a cluster, gets an extra permission, through a
/// group the ServiceAccount itself is not in.
#[tokio::test]
async fn capo_with_exactly_its_rbac_holds_and_releases() {
    let admin = setup().await;
    apply_rbac().await;
    let ns = TestNamespace::create(&admin, "install-rbac").await;
    let registration = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": { "name": "capo-test-self-registration" },
        "rules": [{ "apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations"], "verbs": ["get", "create", "patch", "delete"] }],
    });
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": { "name": "capo-test-self-registration" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "capo-test-self-registration" },
        "subjects": [{ "kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "capo-test:self-registration" }],
    });
    let list = json!({ "apiVersion": "v1", "kind": "List", "items": [registration, binding] });
    let (ok, out) = kubectl(&["apply", "-f", "-"], Some(&list.to_string())).await;
    assert!(ok, "{out}");
    let mut config = capo_testenv::config_from_kubeconfig(&capo_testenv::shared().kubeconfig).await.unwrap();
    config.auth_info.impersonate = Some(SA.into());
    // The ServiceAccount's own rights, plus a group that may only self-register.
    config.auth_info.impersonate_groups = Some(vec!["capo-test:self-registration".into()]);
    config.default_retry = true;
    let as_capo = Client::try_from(config).unwrap();
    let mut settings =
        capo_settings(&format!("capo-test-{}", ns.name), &[&ns.name], Some(capo_api::CalicoApiGroup::CrdV1));
    settings.release = Some(capo::app::ReleaseSettings {
        election: Some(capo::leader::LeaderSettings {
            lease_name: format!("capo-{}", ns.name),
            namespace: "capo-system".into(),
            identity: "rbac".into(),
            duration: Duration::from_secs(3),
            grace: Duration::from_secs(1),
        }),
        engine: capo::release::EngineSettings { policy_prefix: Some(format!("{}-", ns.name)), ..Default::default() },
        identity: "rbac".into(),
    });
    let capo = start_capo_with(&as_capo, &ns.name, settings).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(
        &admin,
        &policy,
        &ns.name,
        json!({ "podSelector": {}, "reserveFor": "2s", "releaseInterval": "100ms" }),
    )
    .await;
    let ip = Ips::v4();
    create_pod_with_ips(&admin, &ns.name, unscheduled_pod("redis-0", &[], &[]), &[ip]).await;
    delete_pod(&admin, &ns.name, "redis-0").await.expect("held and allowed");
    assert!(record(&admin, ip).await.is_some(), "held with the ServiceAccount's rights");
    eventually("released with the ServiceAccount's rights", Duration::from_secs(30), || async {
        record(&admin, ip).await.is_none().then_some(())
    })
    .await;
    let entries = reservation(&admin, capo_api::CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.unwrap();
    assert!(!entries.contains(&format!("{ip}/32")));
    let failures: f64 = capo
        .metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("capo_release_failures_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failures, 0.0, "no write was forbidden");
}

/// Argo CD compares what is in git with what is live: after capo has run (it writes
/// CapoPolicy status) and cert-manager has injected the webhook's caBundle, a server-side
/// diff of the manifests must be empty.
#[tokio::test]
async fn after_capo_has_run_a_server_side_diff_of_the_manifests_is_empty() {
    let admin = setup().await;
    let ns = TestNamespace::create(&admin, "install-diff").await;
    let deploy = repo("deploy/capo.yaml");
    let (ok, out) = kubectl(&["apply", "--server-side", "-f", deploy.to_str().unwrap()], None).await;
    assert!(ok, "{out}");
    // What cert-manager's CA injector does: it owns the caBundle, not the manifests.
    let patch = json!({ "webhooks": [
        { "name": "hold.capo.io", "clientConfig": { "caBundle": "Y2EK" } },
        { "name": "hold-required.capo.io", "clientConfig": { "caBundle": "Y2EK" } },
    ]});
    let (ok, out) = kubectl(
        &[
            "patch",
            "validatingwebhookconfiguration",
            "capo",
            "--type=strategic",
            "--field-manager=cainjector",
            "-p",
            &patch.to_string(),
        ],
        None,
    )
    .await;
    assert!(ok, "{out}");
    // A policy from git, and a capo that loads it and writes its status.
    let policy = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
        "metadata": { "name": format!("{}-p", ns.name) },
        "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } } } });
    let file = std::env::temp_dir().join(format!("{}-policy.json", ns.name));
    std::fs::write(&file, policy.to_string()).unwrap();
    let (ok, out) = kubectl(&["apply", "--server-side", "-f", file.to_str().unwrap()], None).await;
    assert!(ok, "{out}");
    let _capo = start_capo(&admin, &[&ns.name], None).await;
    wait_policy_ready(&admin, &format!("{}-p", ns.name), Some(1), "True").await;
    for path in [deploy.clone(), file.clone()] {
        let (ok, out) = kubectl(&["diff", "--server-side", "-f", path.to_str().unwrap()], None).await;
        assert!(ok && out.trim().is_empty(), "{}: kubectl diff shows drift:\n{out}", path.display());
    }
    let _ = std::fs::remove_file(&file);
}

//! The install manifests against the real API server: `deploy/capo.yaml` is exactly what
//! kustomize renders from `config/default`; every manifest (kustomize, plain YAML,
//! samples, Prometheus objects, everything in `argocd/`) passes a server-side dry run
//! against the real CRDs of Argo CD, cert-manager and the Prometheus operator; capo's
//! ServiceAccount has least privilege (`kubectl auth can-i`); and `deploy/capo.yaml`,
//! installed as it is, works: capo (outside the cluster, as its ServiceAccount and with
//! nothing but the manifests' RBAC) is reached through the manifests' Service, makes its
//! own certificate, injects its CA, holds and releases, and leaves nothing for Argo CD to
//! see as drift.

mod support;

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;
use support::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// One test at a time applies the manifests' RBAC and webhook configuration for real.
static INSTALLED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn setup() -> Client {
    let client = client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    install_third_party_crds().await;
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
    let manifests: &[(&str, &str, Option<&str>)] = &[
        ("-f", "deploy/capo.yaml", None),
        ("-k", "config/default", None),
        ("-k", "config/default-cert-manager", None),
        ("-k", "config/samples", None),
        ("-k", "config/prometheus", Some("capo-system")),
        ("-k", "argocd/manifests", None),
        ("-f", "argocd/project.yaml", None),
        ("-f", "argocd/capo.yaml", None),
        ("-f", "argocd/capo-helm.yaml", None),
        ("-f", "argocd/policies.yaml", None),
        ("-f", "argocd/policies", None),
        ("-f", "argocd/argocd-cm-patch.yaml", None),
    ];
    for (how, path, namespace) in manifests {
        let path_arg = repo(path);
        let mut args = vec!["apply", "--server-side", "--dry-run=server", how, path_arg.to_str().unwrap()];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        let (ok, out) = kubectl(&args, None).await;
        assert!(ok, "{path}: {out}");
        assert!(out.contains("(server dry run)"), "{path}: {out}");
    }
    let deploy = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    assert!(!deploy.contains("caBundle"), "no caBundle in the manifests: capo injects it");
    // Argo CD must never take capo's Secret for part of its Application (and prune it).
    assert!(!deploy.contains("kind: Secret"), "the certificate Secret is capo's, not the manifests'");
}

/// The RBAC objects of `deploy/capo.yaml`, applied for real.
async fn apply_rbac() {
    let deploy = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    let rbac: Vec<&str> = deploy
        .split("\n---\n")
        .filter(|doc| {
            ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
                .iter()
                .any(|k| doc.contains(&format!("\nkind: {k}\n")))
        })
        .collect();
    let (ok, out) =
        kubectl(&["apply", "--server-side", "--force-conflicts", "-f", "-"], Some(&rbac.join("\n---\n"))).await;
    assert!(ok, "{out}");
}

const SA: &str = "system:serviceaccount:capo-system:capo";

/// Whether capo's ServiceAccount may `verb` the cluster-scoped `group`/`resource` `name`,
/// by a SubjectAccessReview.
async fn access_allowed(client: &Client, verb: &str, group: &str, resource: &str, name: &str) -> bool {
    use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(SA.into()),
            groups: Some(vec!["system:serviceaccounts".into(), "system:serviceaccounts:capo-system".into()]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                name: Some(name.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone()).create(&PostParams::default(), &review).await;
    answer.expect("SubjectAccessReview").status.is_some_and(|s| s.allowed)
}

#[tokio::test]
async fn capos_service_account_has_least_privilege() {
    let client = setup().await;
    let _one = INSTALLED.lock().await;
    apply_rbac().await;
    // A group the API server does not serve (Calico's v3 before a migration) is one kubectl
    // cannot map: asked of the API server directly.
    for (verb, name, want) in [("get", "default", true), ("get", "other", false), ("update", "default", false)] {
        let got = access_allowed(&client, verb, "projectcalico.org", "clusterinformations", name).await;
        assert_eq!(got, want, "{verb} clusterinformations.projectcalico.org/{name}");
    }
    let allowed: &[&[&str]] = &[
        &["watch", "pods"],
        &["patch", "pods", "-n", "shop"],
        &["get", "namespaces"],
        &["patch", "ipreservations.crd.projectcalico.org"],
        &["create", "ipreservations.projectcalico.org"],
        &["create", "reservedips.capo.io"],
        &["delete", "reservedips.capo.io"],
        &["patch", "capopolicies.capo.io", "--subresource=status"],
        &["create", "events.events.k8s.io", "-n", "shop"],
        &["patch", "leases.coordination.k8s.io", "-n", "capo-system"],
        &["watch", "statefulsets.apps"],
        &["get", "apiservices.apiregistration.k8s.io/v3.projectcalico.org"],
        &["get", "clusterinformations.crd.projectcalico.org/default"],
        // Self-managed certificates: its own Secret, and the caBundle of its own webhook.
        &["get", "secrets/capo-webhook-tls", "-n", "capo-system"],
        &["watch", "secrets/capo-webhook-tls", "-n", "capo-system"],
        &["update", "secrets/capo-webhook-tls", "-n", "capo-system"],
        &["create", "secrets", "-n", "capo-system"],
        &["patch", "validatingwebhookconfigurations.admissionregistration.k8s.io/capo"],
        &["watch", "validatingwebhookconfigurations.admissionregistration.k8s.io/capo"],
        &["patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io/capo"],
        &["watch", "mutatingwebhookconfigurations.admissionregistration.k8s.io/capo"],
        // Sticky IPs: whether the old Pod's node is Ready.
        &["get", "nodes"],
    ];
    let denied: &[&[&str]] = &[
        &["delete", "ipreservations.crd.projectcalico.org"],
        &["delete", "pods"],
        &["update", "pods", "-n", "shop"],
        &["patch", "pods", "--subresource=status", "-n", "shop"],
        &["create", "pods/eviction"],
        &["get", "secrets", "-n", "capo-system"],
        &["get", "secrets/other", "-n", "capo-system"],
        &["delete", "secrets/capo-webhook-tls", "-n", "capo-system"],
        &["create", "secrets", "-n", "kube-system"],
        &["get", "secrets/capo-webhook-tls", "-n", "kube-system"],
        &["patch", "leases.coordination.k8s.io", "-n", "kube-system"],
        &["update", "capopolicies.capo.io"],
        &["update", "reservedips.capo.io"],
        &["create", "validatingwebhookconfigurations.admissionregistration.k8s.io"],
        &["patch", "validatingwebhookconfigurations.admissionregistration.k8s.io/other"],
        &["delete", "validatingwebhookconfigurations.admissionregistration.k8s.io/capo"],
        &["patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io/other"],
        &["delete", "mutatingwebhookconfigurations.admissionregistration.k8s.io/capo"],
        &["patch", "nodes"],
        &["get", "statefulsets.apps"],
        &["get", "apiservices.apiregistration.k8s.io/v1.capo.io"],
        &["list", "apiservices.apiregistration.k8s.io"],
        &["get", "clusterinformations.crd.projectcalico.org/other"],
        &["patch", "clusterinformations.crd.projectcalico.org/default"],
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

/// `deploy/capo.yaml`, installed as a user would (`kubectl apply --server-side`), with capo
/// running outside the cluster as its ServiceAccount, with the Deployment's settings: the
/// API server reaches it through the manifests' Service (the test control plane routes
/// Services to their endpoints; the endpoints point at this machine), verifies the
/// certificate capo made for `capo.capo-system.svc` against the CA capo injected into the
/// manifests' webhook configuration, and capo holds and releases with nothing but the
/// manifests' RBAC. Afterwards `kubectl diff --server-side` of the manifests and of a
/// policy is empty: nothing for Argo CD to see as drift.
#[tokio::test]
async fn the_installed_manifests_work_as_they_are_and_show_no_drift() {
    let admin = setup().await;
    let _one = INSTALLED.lock().await;
    let ns = TestNamespace::create(&admin, "install").await;
    let deploy = repo("deploy/capo.yaml");
    let (ok, out) =
        kubectl(&["apply", "--server-side", "--force-conflicts", "-f", deploy.to_str().unwrap()], None).await;
    assert!(ok, "{out}");
    let addr = host_addr();
    capo_testenv::route::route_service(&admin, "capo-system", "capo", "webhook", addr)
        .await
        .expect("route the Service");

    let as_capo = as_capo_service_account().await;
    let settings = installed_settings(addr, &format!("{}-", ns.name));
    // Returns once the API server has called capo through the Service.
    let capo = start_capo_with(&as_capo, &ns.name, settings).await;

    let secret = Api::<Secret>::namespaced(admin.clone(), "capo-system").get("capo-webhook-tls").await.unwrap();
    assert_eq!(secret.labels().get("app.kubernetes.io/managed-by").map(String::as_str), Some("capo"));
    assert!(
        !secret.labels().contains_key("app.kubernetes.io/instance"),
        "no Argo CD tracking label on capo's own Secret"
    );
    let served = capo.serving.current().unwrap();
    assert_eq!(served.info.hosts, ["capo.capo-system.svc", "capo.capo-system.svc.cluster.local"]);
    assert!(capo.serving.handshakes_with(&served.info.serial) > 0, "the API server came through the Service");

    // A policy from git; capo loads it and writes its status.
    let policy_name = format!("{}-p", ns.name);
    let policy = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
        "metadata": { "name": policy_name },
        "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } },
                  "podSelector": {}, "reserveFor": "2s", "releaseInterval": "100ms" } });
    let file = std::env::temp_dir().join(format!("{}-policy.json", ns.name));
    std::fs::write(&file, policy.to_string()).unwrap();
    let (ok, out) = kubectl(&["apply", "--server-side", "-f", file.to_str().unwrap()], None).await;
    assert!(ok, "{out}");
    wait_policy_ready(&admin, &policy_name, Some(1), "True").await;

    holds_and_releases(&admin, &ns.name, &policy_name, "redis-0").await;
    for failures in [
        "capo_release_failures_total",
        "capo_certificate_errors_total",
        "capo_ca_bundle_injections_total{result=\"failed\"",
    ] {
        let n: f64 = capo
            .metrics
            .render()
            .lines()
            .filter(|l| l.starts_with(failures))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(n, 0.0, "{failures}: no write was forbidden");
    }

    // Argo CD compares git with what is live: nothing to sync back.
    for path in [deploy.clone(), file.clone()] {
        let (ok, out) = kubectl(&["diff", "--server-side", "-f", path.to_str().unwrap()], None).await;
        assert!(ok && out.trim().is_empty(), "{}: kubectl diff shows drift:\n{out}", path.display());
    }
    capo.shutdown().await;
    let _ = std::fs::remove_file(&file);
    let (ok, out) = kubectl(
        &["delete", "validatingwebhookconfiguration,mutatingwebhookconfiguration", "capo", "--ignore-not-found"],
        None,
    )
    .await;
    assert!(ok, "{out}");
}

/// The rights table of docs/install.md, one `scope|group|resource|name|verb` per right.
fn documented_rights() -> std::collections::BTreeSet<String> {
    let doc = std::fs::read_to_string(repo("docs/install.md")).unwrap();
    let table = doc.split("<!-- rights:begin -->").nth(1).unwrap().split("<!-- rights:end -->").next().unwrap();
    let mut rights = std::collections::BTreeSet::new();
    for row in table.lines().filter(|l| l.starts_with('|')).skip(2) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        let (scope, groups, resources, verbs) = (cells[0], cells[1], cells[2], cells[3]);
        let (resources, name) = match resources.split_once(" (") {
            Some((r, n)) => (r, n.trim_end_matches(')')),
            None => (resources, ""),
        };
        for group in groups.split(", ") {
            let group = if group == "core" { "" } else { group };
            for resource in resources.split(", ") {
                for verb in verbs.split(", ") {
                    rights.insert(format!("{scope}|{group}|{resource}|{name}|{verb}"));
                }
            }
        }
    }
    rights
}

/// The rights the ClusterRoles and Roles of `deploy/capo.yaml` grant capo, the same way
/// (the operator's roles, capo-operator, capo-view and capo-edit, are people's: they are
/// in docs/operations.md).
fn manifest_rights() -> std::collections::BTreeSet<String> {
    let deploy = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    let mut rights = std::collections::BTreeSet::new();
    for doc in deploy.split("\n---\n") {
        let Ok(obj) = serde_saphyr::from_str::<serde_json::Value>(doc) else { continue };
        let scope = match obj["kind"].as_str() {
            Some("ClusterRole") => "cluster",
            Some("Role") => "capo's namespace",
            _ => continue,
        };
        if ["capo-operator", "capo-view", "capo-edit"].contains(&obj["metadata"]["name"].as_str().unwrap_or_default()) {
            continue;
        }
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array().map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect()).unwrap_or_default()
        };
        for rule in obj["rules"].as_array().unwrap() {
            let names = strings(&rule["resourceNames"]);
            let names = if names.is_empty() { vec![String::new()] } else { names };
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for name in &names {
                        for verb in strings(&rule["verbs"]) {
                            rights.insert(format!("{scope}|{group}|{resource}|{name}|{verb}"));
                        }
                    }
                }
            }
        }
    }
    rights
}

/// docs/install.md lists capo's rights in a table: exactly those the manifests grant.
#[test]
fn the_rights_in_the_docs_are_the_rights_in_the_manifests() {
    let (documented, granted) = (documented_rights(), manifest_rights());
    assert!(granted.len() > 20, "{granted:?}");
    let undocumented: Vec<_> = granted.difference(&documented).collect();
    let not_granted: Vec<_> = documented.difference(&granted).collect();
    assert!(
        undocumented.is_empty() && not_granted.is_empty(),
        "granted but not in docs/install.md: {undocumented:?}; in docs/install.md but not granted: {not_granted:?}"
    );
}

/// `patch pods` is cluster-wide; the ValidatingAdmissionPolicy of the manifests leaves
/// capo's ServiceAccount nothing of a Pod to change but its two marks, and the addresses
/// its sticky webhook handed back (removed together).
#[tokio::test]
async fn capos_service_account_may_change_nothing_of_a_pod_but_its_marks() {
    let client = setup().await;
    let _one = INSTALLED.lock().await;
    apply_rbac().await;
    let deploy = std::fs::read_to_string(repo("deploy/capo.yaml")).unwrap();
    let policy: Vec<&str> = deploy
        .split("\n---\n")
        .filter(|doc| {
            doc.contains("\nkind: ValidatingAdmissionPolicy\n")
                || doc.contains("\nkind: ValidatingAdmissionPolicyBinding\n")
        })
        .collect();
    assert_eq!(policy.len(), 2, "the policy and its binding are in deploy/capo.yaml");
    let (ok, out) =
        kubectl(&["apply", "--server-side", "--force-conflicts", "-f", "-"], Some(&policy.join("\n---\n"))).await;
    assert!(ok, "{out}");
    let ns = TestNamespace::create(&client, "marks-only").await;
    let pod =
        create_pod_with_ips(&client, &ns.name, unscheduled_pod("zk-0", &[("app", "zk")], &[]), &[Ips::v4()]).await;
    let uid = pod.uid().unwrap();
    let as_capo = as_capo_service_account().await;
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(as_capo, &ns.name);
    // Strategic merge patches, as kubectl sends them (only what is named changes).
    let patch_with = |p: serde_json::Value, params: kube::api::PatchParams| {
        let pods = pods.clone();
        async move { pods.patch("zk-0", &params, &kube::api::Patch::Strategic(p)).await }
    };
    let patch = |p: serde_json::Value| patch_with(p, kube::api::PatchParams::default());
    let image = json!({ "spec": { "containers": [{ "name": "app", "image": "evil:latest" }] } });
    // The policy reaches the API server's admission chain asynchronously: wait with dry
    // runs (admission runs, nothing is stored).
    eventually("the policy in force", std::time::Duration::from_secs(30), || async {
        patch_with(image.clone(), kube::api::PatchParams::default().dry_run()).await.is_err().then_some(())
    })
    .await;
    let refused = match patch(image).await {
        Err(kube::Error::Api(s)) => s.message,
        other => panic!("an image change by capo's ServiceAccount: {other:?}"),
    };
    assert!(refused.contains("capo-pod-marks-only") && refused.contains("spec"), "{refused}");
    for (what, change) in [
        ("a label", json!({ "metadata": { "labels": { "app": "other" } } })),
        ("another annotation", json!({ "metadata": { "annotations": { "team": "x" } } })),
        ("a finalizer", json!({ "metadata": { "finalizers": ["example.com/keep"] } })),
    ] {
        let e = patch(change).await.expect_err(what);
        assert!(e.to_string().contains("capo-pod-marks-only"), "{what}: {e}");
    }
    // capo's own marks, as src/hold/marks.rs writes them (the uid as precondition).
    let mark = capo::hold::marks::value(&uid, "released");
    patch(json!({ "metadata": { "uid": uid, "annotations": { "capo.io/released": mark } } })).await.expect("a mark");
    patch(json!({ "metadata": { "uid": uid, "annotations": { "capo.io/not-held": "x" } } })).await.expect("a mark");
    let now = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &ns.name).get("zk-0").await.unwrap();
    assert_eq!(now.annotations().get("capo.io/released"), Some(&mark));
    assert_eq!(now.labels().get("app").map(String::as_str), Some("zk"));
    assert_ne!(now.spec.unwrap().containers[0].image.as_deref(), Some("evil:latest"));
    // Sticky IPs' fallback: the two annotations capo's webhook wrote, removed together and
    // only while they say the same; never an address a user named on their own.
    let ip = Ips::v4();
    let named = format!("[\"{ip}\"]");
    let handed_back = [("cni.projectcalico.org/ipAddrs", named.as_str()), ("capo.io/sticky-claim", named.as_str())];
    let back = unscheduled_pod("zk-1", &[("app", "zk")], &handed_back);
    let back = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &ns.name)
        .create(&Default::default(), &back)
        .await
        .unwrap();
    let only_one = json!({ "metadata": { "annotations": { "cni.projectcalico.org/ipAddrs": null } } });
    let e = pods.patch("zk-1", &Default::default(), &kube::api::Patch::Merge(only_one)).await.expect_err("one of two");
    assert!(e.to_string().contains("capo-pod-marks-only"), "{e}");
    let as_capo = as_capo_service_account().await;
    let took = capo::hold::marks::take_back(&as_capo, &ns.name, "zk-1", "the-held-pod", ip).await.unwrap();
    assert_eq!(took, back.uid(), "capo's fallback removes both");
    let mine = [("cni.projectcalico.org/ipAddrs", named.as_str())];
    let user = unscheduled_pod("zk-2", &[("app", "zk")], &mine);
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &ns.name)
        .create(&Default::default(), &user)
        .await
        .unwrap();
    let remove = json!({ "metadata": { "annotations": { "cni.projectcalico.org/ipAddrs": null } } });
    let e = pods.patch("zk-2", &Default::default(), &kube::api::Patch::Merge(remove)).await.expect_err("a user's");
    assert!(e.to_string().contains("capo-pod-marks-only"), "{e}");
    let took = capo::hold::marks::take_back(&as_capo, &ns.name, "zk-2", "the-held-pod", ip).await.unwrap();
    assert_eq!(took, None, "an address the user named is never taken back");
    // Everyone else is untouched by the policy: the admin changes a label.
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &ns.name)
        .patch("zk-0", &Default::default(), &kube::api::Patch::Merge(json!({ "metadata": { "labels": { "x": "y" } } })))
        .await
        .expect("the admin is not bound by capo's policy");
}

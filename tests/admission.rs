//! Admission-path defects found by trying to break it, each proven against a real API
//! server calling capo over TLS.

mod support;

use std::time::Duration;

use capo_api::CalicoApiGroup;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, EvictParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::leading::wait_metric;
use support::*;

/// A metric of `app`; 0 when it has not been counted yet.
fn metric(app: &capo::App, needle: &str) -> f64 {
    metric_value(app, needle).unwrap_or(0.0)
}

/// `kubectl drain --dry-run=server`: the Eviction's body carries `deleteOptions.dryRun`,
/// the admission request's own `dryRun` is false. Nothing may be written.
#[tokio::test]
async fn a_server_side_dry_run_drain_writes_nothing() {
    let (client, ns) = setup("adm-drain-dry").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "zk" } } })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("zk-0", &[("app", "zk")], &[]), &[ip]).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    // Exactly what kubectl drain sends: no dryRun query parameter, dryRun in the body.
    let eviction = json!({
        "apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": { "name": "zk-0", "namespace": ns.name },
        "deleteOptions": { "dryRun": ["All"] },
    });
    let req = axum::http::Request::post(format!("/api/v1/namespaces/{}/pods/zk-0/eviction", ns.name))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&eviction).unwrap())
        .unwrap();
    client.request_text(req).await.expect("dry-run eviction allowed");
    assert!(pods.get_opt("zk-0").await.unwrap().is_some(), "a dry run deletes nothing");
    assert!(record(&client, ip).await.is_none(), "a dry run writes no record");
    let entries = reservation(&client, capo_api::CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await;
    assert!(entries.unwrap_or_default().is_empty(), "a dry run writes no reservation entry");
    // capo was asked, and answered it as a dry run.
    assert_eq!(metric(&capo, "capo_admission_requests_total{operation=\"eviction\",outcome=\"dry_run\"}"), 1.0);
    // The same eviction for real is held.
    pods.evict("zk-0", &EvictParams::default()).await.expect("eviction allowed");
    eventually("the real eviction held", Duration::from_secs(5), || async { record(&client, ip).await }).await;
}

#[tokio::test]
async fn a_ten_megabyte_body_gets_413_with_the_reason() {
    let (client, ns) = setup("adm-413").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let http = reqwest::Client::builder().danger_accept_invalid_certs(true).build().unwrap();
    let url = format!("https://{}{}", capo.webhook_addr, capo::admission::REVIEW_PATH);
    let body = vec![b' '; 10 << 20];
    let resp = http
        .post(&url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("an answer, not a reset");
    assert_eq!(resp.status(), 413);
    let text = resp.text().await.unwrap();
    assert!(text.contains("an AdmissionReview is at most"), "{text}");
    assert_eq!(metric(&capo, "capo_admission_requests_total{operation=\"unknown\",outcome=\"too_large\"}"), 1.0);
    // capo keeps serving.
    let resp = http.post(&url).json(&json!({})).send().await.unwrap();
    assert_eq!(resp.status(), 400);
}

/// capo's router, called directly (no webhook registration), with caches that never
/// synced, one policy, and a real client for its writes.
fn direct_router(
    client: &Client,
    policy: &capo_api::CapoPolicy,
) -> (axum::Router, std::sync::Arc<capo::metrics::Metrics>) {
    let (name, spec) = (policy.name_any(), serde_json::to_value(&policy.spec).unwrap());
    let admission = standalone_admission(client, [(name.as_str(), spec)], Duration::from_secs(10));
    let metrics = admission.metrics.clone();
    (capo::admission::router(std::sync::Arc::new(admission)), metrics)
}

fn delete_review(namespace: &str, name: &str, ip: std::net::IpAddr) -> axum::http::Request<axum::body::Body> {
    delete_review_of(namespace, name, &format!("uid-{ip}"), &[ip])
}

/// A DELETE review, as anybody who can reach capo's port could write one.
fn delete_review_of(
    namespace: &str,
    name: &str,
    uid: &str,
    ips: &[std::net::IpAddr],
) -> axum::http::Request<axum::body::Body> {
    let pod_ips: Vec<_> = ips.iter().map(|ip| json!({ "ip": ip.to_string() })).collect();
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": namespace, "uid": uid },
        "spec": { "containers": [] },
        "status": { "podIP": ips.first().map(|ip| ip.to_string()), "podIPs": pod_ips },
    });
    pod_review_post(capo::admission::REVIEW_PATH, "DELETE", namespace, name, "alice", pod)
}

/// kube-system and capo's own namespace are never held: the webhook configuration keeps
/// them out, and capo skips them even if asked.
#[tokio::test]
async fn kube_system_and_capos_own_namespace_are_never_held() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let (client, ns) = setup("adm-system").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let config = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get(&format!("capo-test-{}", ns.name))
        .await
        .unwrap();
    for webhook in config.webhooks.unwrap() {
        let exprs = webhook.namespace_selector.unwrap().match_expressions.unwrap();
        let excluded = exprs
            .iter()
            .find(|e| e.key == "kubernetes.io/metadata.name" && e.operator == "NotIn")
            .expect("an exclusion");
        let values = excluded.values.clone().unwrap();
        assert!(
            values.contains(&"kube-system".to_string()) && values.contains(&"capo-system".to_string()),
            "{values:?}"
        );
    }
    let policy: capo_api::CapoPolicy = serde_json::from_value(json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": format!("{}-all", ns.name) },
        "spec": { "podSelector": {} },
    }))
    .unwrap();
    let (router, metrics) = direct_router(&client, &policy);
    for namespace in ["kube-system", "capo-system"] {
        let ip = Ips::v4();
        let answer = send_review(&router, delete_review(namespace, "coredns-0", ip)).await;
        assert_eq!(answer["response"]["allowed"], true, "{answer}");
        assert!(record(&client, ip).await.is_none(), "{namespace}: nothing held");
    }
    let m = metrics.render();
    assert!(m.contains("capo_admission_requests_total{operation=\"delete\",outcome=\"excluded\"} 2"), "{m}");
}

/// A Namespace the watch has not delivered yet (created a moment ago) is read from the
/// API server, not guessed from its name: its labels decide whether the Pod is selected.
/// The review goes straight to capo's router with caches that never synced, so the cache
/// miss is certain; the writes go to the real API server.
#[tokio::test]
async fn a_namespace_missing_from_the_cache_is_read_not_guessed() {
    let (client, ns) = setup("adm-ns-miss").await;
    let labelled = TestNamespace::create_with_labels(&client, "adm-ns-new", &[("ip-reserve", "enabled")]).await;
    let policy: capo_api::CapoPolicy = serde_json::from_value(json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
        "metadata": { "name": format!("{}-p", ns.name) },
        "spec": { "namespaceSelector": { "matchLabels": { "ip-reserve": "enabled" } } },
    }))
    .unwrap();
    let (router, metrics) = direct_router(&client, &policy);
    let ip = Ips::v4();
    let pod = create_pod_with_ips(&client, &labelled.name, unscheduled_pod("db-0", &[], &[]), &[ip]).await;
    let req = delete_review_of(&labelled.name, "db-0", &pod.uid().unwrap(), &[ip]);
    let answer = send_review(&router, req).await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(record(&client, ip).await.is_some(), "held: the namespace's labels select the Pod");
    let m = metrics.render();
    assert!(m.contains("capo_namespace_cache_misses_total{result=\"read\"} 1"), "{m}");
    // The Pod store never synced either: the Pod was read to confirm the review.
    assert!(m.contains("capo_pod_cache_misses_total{result=\"read\"} 1"), "{m}");
}

/// What the webhook is told is a claim (invariant 11): a review anybody can send to capo's
/// port, for a Pod that does not exist, for a real Pod with another uid, or for a real
/// Pod with addresses it does not have, holds nothing that Pod does not have. Each is
/// allowed, counted by reason, and logged with the caller; a real Pod's review holds
/// the Pod's own address, one per family, whatever the body lists.
#[tokio::test]
async fn a_forged_review_holds_nothing_the_cluster_does_not_confirm() {
    let (client, ns) = setup("adm-forged").await;
    let policy: capo_api::CapoPolicy = serde_json::from_value(json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
        "metadata": { "name": format!("{}-p", ns.name) },
        "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } } },
    }))
    .unwrap();
    let (router, metrics) = direct_router(&client, &policy);
    let real_ip = Ips::v4();
    let pod = create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-0", &[], &[]), &[real_ip]).await;
    let uid = pod.uid().unwrap();

    let (nobody, other_uid, other_ip, extra_v6) = (Ips::v4(), Ips::v4(), Ips::v4(), Ips::v6());
    for (what, req) in [
        ("a Pod that does not exist", delete_review_of(&ns.name, "forged-0", "f0rged", &[nobody])),
        ("the real Pod under another uid", delete_review_of(&ns.name, "redis-0", "not-its-uid", &[other_uid])),
    ] {
        let answer = send_review(&router, req).await;
        assert_eq!(answer["response"]["allowed"], true, "{what}: {answer}");
        assert!(answer["response"]["warnings"].is_null(), "{what}: nothing said to be held: {answer}");
    }
    for ip in [nobody, other_uid] {
        assert!(record(&client, ip).await.is_none(), "{ip}: nothing held");
    }
    let m = metrics.render();
    assert!(m.contains("capo_admission_unconfirmed_total{reason=\"no_such_pod\"} 1"), "{m}");
    assert!(m.contains("capo_admission_unconfirmed_total{reason=\"other_uid\"} 1"), "{m}");
    assert!(m.contains("capo_admission_requests_total{operation=\"delete\",outcome=\"unconfirmed\"} 2"), "{m}");

    // The real Pod, with its uid, but a body listing other addresses: the Pod's own is held.
    let answer = send_review(&router, delete_review_of(&ns.name, "redis-0", &uid, &[other_ip, extra_v6])).await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(answer.to_string().contains(&real_ip.to_string()), "the Pod's own address held: {answer}");
    let rec = record(&client, real_ip).await.expect("the Pod's own address held");
    assert_eq!(rec.spec.pod.uid, uid);
    for ip in [other_ip, extra_v6] {
        assert!(record(&client, ip).await.is_none(), "{ip}: an address the Pod does not have is never held");
    }
    let entries = policy_entries(&client, capo_api::CalicoApiGroup::CrdV1, &format!("{}-p", ns.name)).await;
    assert_eq!(entries, vec![cidr(real_ip)]);
}

/// The API server refuses one entry (here a ValidatingAdmissionPolicy standing in for any
/// server-side rule): that deletion is denied at once with the server's reason, leaves no
/// record behind, and the other deletions of the same burst are held.
#[tokio::test]
async fn a_refused_entry_is_denied_with_the_servers_reason_and_does_not_fail_its_batch() {
    use kube::api::{DynamicObject, Patch, PatchParams};
    let (client, ns) = setup("adm-refused").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;
    let bad = Ips::v4();
    let vap = format!("refuse-{}", ns.name);
    deny_by_policy(
        &client,
        &vap,
        json!({ "resourceRules": [{ "apiGroups": ["crd.projectcalico.org"], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["ipreservations"] }] }),
        json!({
            "expression": format!("!has(object.spec.reservedCIDRs) || !object.spec.reservedCIDRs.exists(c, c == '{bad}/32')"),
            "message": format!("{bad} is quarantined by the network team"),
        }),
    )
    .await;
    // The policy reaches the admission chain asynchronously: wait until it refuses a probe.
    let probe_name = format!("probe-{}", ns.name);
    let reservations =
        Api::<DynamicObject>::all_with(client.clone(), &capo_api::CalicoApiGroup::CrdV1.ip_reservation());
    eventually("the policy to refuse the entry", Duration::from_secs(30), || {
        let reservations = reservations.clone();
        let probe_name = probe_name.clone();
        async move {
            let obj = json!({ "apiVersion": "crd.projectcalico.org/v1", "kind": "IPReservation",
                              "metadata": { "name": probe_name }, "spec": { "reservedCIDRs": [format!("{bad}/32")] } });
            let r =
                reservations.patch(&probe_name, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj)).await;
            matches!(r, Err(kube::Error::Api(s)) if s.code == 422).then_some(())
        }
    })
    .await;
    let good: Vec<_> = (0..6).map(|_| Ips::v4()).collect();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("bad", &[("app", "redis")], &[]), &[bad]).await;
    for (i, ip) in good.iter().enumerate() {
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(&format!("good-{i}"), &[("app", "redis")], &[]), &[*ip])
            .await;
    }
    let started = std::time::Instant::now();
    let mut names = vec!["bad".to_string()];
    names.extend((0..6).map(|i| format!("good-{i}")));
    let results = futures::future::join_all(names.iter().map(|n| delete_pod(&client, &ns.name, n))).await;
    let denied = results[0].as_ref().expect_err("the refused entry denies its deletion");
    let message = denied.to_string();
    assert!(message.contains("quarantined by the network team"), "the server's reason is kept: {message}");
    assert!(started.elapsed() < Duration::from_secs(5), "denied at once, not after retries: {:?}", started.elapsed());
    for (r, ip) in results[1..].iter().zip(&good) {
        assert!(r.is_ok(), "the rest of the burst is allowed: {r:?}");
        assert!(record(&client, *ip).await.is_some(), "{ip} held");
    }
    assert!(record(&client, bad).await.is_none(), "a denied deletion leaves no record");
    let _ = reservations.delete(&probe_name, &Default::default()).await;
}

fn delete_reviews(app: &capo::App) -> f64 {
    app.metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("capo_admission_requests_total{operation=\"delete\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The webhook's matchConditions (CEL, evaluated by the API server) and capo's own rule
/// (`PodFacts::unholdable`) agree: capo is called for exactly the Pods it could hold.
#[tokio::test]
async fn match_conditions_agree_with_the_pods_own_rule() {
    let (client, ns) = setup("adm-matchcond").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    type Shape<'a> = (&'a str, Vec<(&'a str, &'a str)>, bool, bool);
    let shapes: Vec<Shape> = vec![
        // (name, annotations, has an IP, host network)
        ("plain", vec![], true, false),
        ("no-ip", vec![], false, false),
        ("host", vec![], true, true),
        ("opted-out", vec![("capo.io/hold", "false")], true, false),
        ("opted-in", vec![("capo.io/hold", "true")], true, false),
        ("odd-value", vec![("capo.io/hold", "FALSE")], true, false),
        ("other-annotation", vec![("example.com/hold", "false")], true, false),
        ("deleting", vec![], true, false),
    ];
    for (name, annotations, has_ip, host) in shapes {
        let mut pod = unscheduled_pod(name, &[], &annotations);
        pod.spec.as_mut().unwrap().host_network = Some(host);
        if name == "deleting" {
            pod.metadata.finalizers = Some(vec!["capo.test/keep".into()]);
        }
        let ips = if has_ip { vec![Ips::v4()] } else { vec![] };
        let created = create_pod_with_ips(&client, &ns.name, pod, &ips).await;
        if name == "deleting" {
            // Its deletion begins (reviewed and held) and waits on the finalizer; the next
            // DELETE finishes nothing new.
            delete_pod(&client, &ns.name, name).await.unwrap();
        }
        let live = pods.get(name).await.unwrap();
        let expected_call = capo::pod::PodFacts::from_pod(&live).reviewed();
        let before = delete_reviews(&capo);
        delete_pod(&client, &ns.name, name).await.unwrap();
        let called = delete_reviews(&capo) > before;
        assert_eq!(
            called, expected_call,
            "{name}: API server called capo = {called}, capo's rule says {expected_call}"
        );
        if called || name == "deleting" {
            assert!(record(&client, ips[0]).await.is_some(), "{name}: held");
        }
        if name == "deleting" {
            pods.patch(name, &PatchParams::default(), &Patch::Merge(json!({ "metadata": { "finalizers": null } })))
                .await
                .unwrap();
        }
        drop(created);
    }
}

/// A namespace labelled `capo.io/failure-policy=Fail` gets no deletion without a hold,
/// even while capo is down; both recovery commands in the README unlock it.
#[tokio::test]
async fn the_fail_webhook_locks_a_namespace_while_capo_is_down_and_the_readme_commands_unlock_it() {
    let client = client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    let ns = TestNamespace::create_with_labels(&client, "adm-fail", &[("capo.io/failure-policy", "Fail")]).await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let webhook = format!("capo-test-{}", ns.name);
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    for pod in ["a", "b", "c"] {
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(pod, &[], &[]), &[Ips::v4()]).await;
    }
    // capo crashes: its webhook configuration stays, nobody answers.
    drop(capo);
    let err = delete_pod(&client, &ns.name, "a").await.expect_err("no deletion without a hold");
    assert!(err.to_string().contains("hold-required.capo.io"), "{err}");
    // Recovery 1 (README): back to Ignore for that namespace.
    let (ok, out) = kubectl(&["label", "namespace", &ns.name, "capo.io/failure-policy-"], None).await;
    assert!(ok, "{out}");
    eventually("the namespace unlocked", Duration::from_secs(20), || async {
        delete_pod(&client, &ns.name, "a").await.ok()
    })
    .await;
    // Recovery 2 (README): remove the webhook altogether.
    let (ok, out) = kubectl(&["label", "namespace", &ns.name, "capo.io/failure-policy=Fail"], None).await;
    assert!(ok, "{out}");
    eventually("the namespace locked again", Duration::from_secs(20), || async {
        let r = Api::<Pod>::namespaced(client.clone(), &ns.name)
            .delete("b", &kube::api::DeleteParams { dry_run: true, ..Default::default() })
            .await;
        r.is_err().then_some(())
    })
    .await;
    let (ok, out) = kubectl(&["delete", "validatingwebhookconfiguration", &webhook], None).await;
    assert!(ok, "{out}");
    eventually("deletions allowed without the webhook", Duration::from_secs(20), || async {
        delete_pod(&client, &ns.name, "b").await.ok()
    })
    .await;
}

/// A DELETE capo must deny (the hold cannot be written) is answered 503, which clients
/// treat as retryable; and a clean shutdown removes the self-registered configuration.
#[tokio::test]
async fn a_denied_delete_is_a_503_and_shutdown_removes_the_webhook_configuration() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let (client, ns) = setup("adm-503").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    // The API server refuses every write to this policy's reservations: the hold cannot
    // be written.
    let vap = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": format!("capo-tests-{policy}") },
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": { "resourceRules": [{ "apiGroups": ["crd.projectcalico.org"], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["ipreservations"] }] },
            "validations": [{ "expression": format!("!has(object.metadata.labels) || !('capo.io/policy' in object.metadata.labels) || object.metadata.labels['capo.io/policy'] != '{policy}'"),
                              "message": "capo-tests: no holds for this policy" }],
        },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": format!("capo-tests-{policy}") },
        "spec": { "policyName": format!("capo-tests-{policy}"), "validationActions": ["Deny"] },
    });
    let (ok, out) = kubectl(
        &["apply", "--server-side", "-f", "-"],
        Some(&json!({ "apiVersion": "v1", "kind": "List", "items": [vap, binding] }).to_string()),
    )
    .await;
    assert!(ok, "{out}");
    let mut n = 0;
    let s = eventually("a DELETE denied because the hold cannot be written", Duration::from_secs(30), || {
        n += 1;
        let (client, ns) = (client.clone(), ns.name.clone());
        async move {
            let name = format!("p-{n}");
            create_pod_with_ips(&client, &ns, unscheduled_pod(&name, &[], &[]), &[Ips::v4()]).await;
            match delete_pod(&client, &ns, &name).await {
                Err(kube::Error::Api(s)) => Some(s),
                _ => None, // the refusal has not reached the admission chain yet
            }
        }
    })
    .await;
    assert_eq!(s.code, 503, "{s:?}");
    assert!(s.message.contains("no holds for this policy"), "{}", s.message);
    assert!(s.message.contains("onHoldFailure=Deny"), "{}", s.message);
    let configs = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    let name = format!("capo-test-{}", ns.name);
    assert!(configs.get_opt(&name).await.unwrap().is_some());
    capo.shutdown().await;
    assert!(configs.get_opt(&name).await.unwrap().is_none(), "removed on exit");
}

/// The point of it all: a StatefulSet Pod deleted while capo holds its IP comes back with
/// a new IP, from Calico's own IPAM (the test environment's capo-calico-ipam).
#[tokio::test]
async fn the_recreated_pod_gets_a_new_ip() {
    let (client, ns) = setup("adm-new-ip").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;
    let sts: k8s_openapi::api::apps::v1::StatefulSet = serde_json::from_value(json!({
        "metadata": { "name": "redis" },
        "spec": { "replicas": 1, "serviceName": "redis", "selector": { "matchLabels": { "app": "redis" } },
                  "template": { "metadata": { "labels": { "app": "redis" } },
                                "spec": { "tolerations": [{ "operator": "Exists" }],
                                          "containers": [{ "name": "redis", "image": "registry.invalid/redis:7" }] } } },
    }))
    .unwrap();
    Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), &ns.name)
        .create(&kube::api::PostParams::default(), &sts)
        .await
        .unwrap();
    let old = wait_running(&client, &ns.name, "redis-0").await;
    let old_ip = pod_ips(&old)[0];
    let old_uid = old.metadata.uid.clone().unwrap();
    delete_pod(&client, &ns.name, "redis-0").await.expect("held and allowed");
    assert!(record(&client, old_ip).await.is_some());
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let new_ip = eventually("redis-0 recreated with an IP", Duration::from_secs(60), || {
        let pods = pods.clone();
        let old_uid = old_uid.clone();
        async move {
            let p = pods.get_opt("redis-0").await.ok()??;
            if p.metadata.uid.as_deref() == Some(old_uid.as_str()) {
                return None;
            }
            pod_ips(&p).first().copied()
        }
    })
    .await;
    assert_ne!(new_ip, old_ip, "the recreated Pod got a new IP; the old one stays held");
    assert!(record(&client, old_ip).await.is_some());
}

/// A KubeVirt VM's launcher Pod, as KubeVirt creates it (`kubevirt.io=virt-launcher`, the
/// VM's name label), under a policy that selects every Pod: its deletion is allowed with
/// no hold (Calico 3.32+ keeps the VM's address while the VM lives), counted as
/// `kubevirt_vm`; a plain Pod beside it is held.
#[tokio::test]
async fn a_kubevirt_vms_launcher_pod_is_not_held() {
    let (client, ns) = setup("adm-kubevirt").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    let (vm_ip, plain_ip) = (Ips::v4(), Ips::v4());
    let launcher = unscheduled_pod(
        "virt-launcher-vm1-abcde",
        &[("kubevirt.io", "virt-launcher"), ("vm.kubevirt.io/name", "vm1")],
        &[("kubevirt.io/domain", "vm1")],
    );
    create_pod_with_ips(&client, &ns.name, launcher, &[vm_ip]).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("plain", &[], &[]), &[plain_ip]).await;
    delete_pod(&client, &ns.name, "virt-launcher-vm1-abcde").await.expect("allowed");
    delete_pod(&client, &ns.name, "plain").await.expect("allowed, held");
    wait_metric(&capo, "capo_admission_skipped_total{reason=\"kubevirt_vm\"}", 1.0).await;
    eventually("the plain Pod held", Duration::from_secs(20), || async { record(&client, plain_ip).await }).await;
    assert!(record(&client, vm_ip).await.is_none(), "no hold for the VM's address");
    let entries = policy_entries(&client, CalicoApiGroup::CrdV1, &policy).await;
    assert!(!entries.contains(&cidr(vm_ip)) && entries.contains(&cidr(plain_ip)), "{entries:?}");
}

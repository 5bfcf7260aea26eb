//! Policy reload against a real API server: a CapoPolicy capo cannot read does not stall
//! the others, and status writes do not feed on their own watch events.
//!
//! This binary has its own control plane: it installs a CapoPolicy CRD whose `spec` the
//! API server does not check, so a malformed policy can get in (as one can through an
//! older or hand-edited CRD).

mod support;

use std::time::Duration;

use capo_api::CapoPolicy;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use support::*;

/// capo's CapoPolicy CRD with an unchecked `spec`.
fn loose_capopolicy_crd() -> CustomResourceDefinition {
    let mut crd = serde_json::to_value(CapoPolicy::crd()).unwrap();
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    schema["properties"]["spec"] = json!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true });
    if let Some(o) = schema.as_object_mut() {
        o.remove("x-kubernetes-validations");
    }
    serde_json::from_value(crd).unwrap()
}

async fn setup(prefix: &str) -> (kube::Client, TestNamespace) {
    let client = client().await;
    install_crd(&client, loose_capopolicy_crd()).await;
    install_crd(&client, capo_api::ReservedIP::crd()).await;
    install_calico_crds(&client).await;
    let ns = TestNamespace::create(&client, prefix).await;
    (client, ns)
}

/// The tests here count status writes of cluster-scoped policies: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Waits until the counter stops moving and returns its value.
async fn settled(app: &capo::App, needle: &str) -> f64 {
    eventually("the counter to settle", Duration::from_secs(15), || async {
        let a = metric(app, needle);
        tokio::time::sleep(Duration::from_millis(500)).await;
        (a == metric(app, needle)).then_some(a)
    })
    .await
}

/// A metric of `app`; 0 when it has not been counted yet.
fn metric(app: &capo::App, needle: &str) -> f64 {
    metric_value(app, needle).unwrap_or(0.0)
}

#[tokio::test]
async fn a_policy_capo_cannot_read_is_marked_not_ready_while_the_others_work() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-malformed").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let good = format!("{}-good", ns.name);
    apply_policy(&client, &good, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;
    let bad = format!("{}-bad", ns.name);
    // Read and written untyped: capo's own type cannot read it either.
    let untyped =
        Api::<kube::api::DynamicObject>::all_with(client.clone(), &kube::api::ApiResource::erase::<CapoPolicy>(&()));
    let obj = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": bad },
                      "spec": { "podSelector": {}, "maxReserved": "lots" } });
    untyped.patch(&bad, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj)).await.expect("applied");
    let cond = eventually("the malformed policy marked Ready=False", Duration::from_secs(30), || {
        let untyped = untyped.clone();
        let bad = bad.clone();
        async move {
            let o = untyped.get(&bad).await.ok()?;
            let c = o.data.pointer("/status/conditions/0")?.clone();
            (c["status"] == "False").then_some(c)
        }
    })
    .await;
    assert_eq!(cond["reason"], "Malformed");
    let message = cond["message"].as_str().unwrap();
    assert!(message.contains("lots") || message.contains("u32"), "{message}");
    // The matcher is not frozen: the good policy holds, and a new one loads.
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-0", &[("app", "redis")], &[]), &[ip]).await;
    delete_pod(&client, &ns.name, "redis-0").await.unwrap();
    assert!(record(&client, ip).await.is_some(), "the good policy still holds");
    let later = format!("{}-later", ns.name);
    apply_policy(&client, &later, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "kafka" } } })).await;
    assert_eq!(metric(&capo, "capo_policies{state=\"invalid\"}"), 1.0);
    // A capo starting now, with the malformed policy in place, gets ready.
    let other = TestNamespace::create(&client, "pol-malformed-b").await;
    let second = tokio::time::timeout(Duration::from_secs(60), start_capo(&client, &[&other.name], None)).await;
    assert!(second.is_ok(), "startup stalled on the malformed policy");
}

#[tokio::test]
async fn policy_status_is_written_once_per_change_not_per_watch_event() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-storm").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let base = settled(&capo, "capo_policy_status_writes_total").await;
    let names: Vec<String> = (0..20).map(|i| format!("{}-p{i}", ns.name)).collect();
    for name in &names {
        try_apply_policy(
            &client,
            name,
            json!({ "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } } }),
        )
        .await
        .unwrap();
    }
    for name in &names {
        wait_policy_ready(&client, name, Some(1), "True").await;
    }
    // Let the echoes of those writes come back; none may cause another write.
    let api = Api::<CapoPolicy>::all(client.clone());
    let after = settled(&capo, "capo_policy_status_writes_total").await;
    assert_eq!(after - base, 20.0, "one status write per new policy");
    // A spec change: one more write, for that policy only.
    api.patch(
        &names[0],
        &PatchParams::apply("capo-tests").force(),
        &Patch::Apply(json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": names[0] },
                             "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } }, "reserveFor": "1h" } })),
    )
    .await
    .unwrap();
    wait_policy_ready(&client, &names[0], Some(2), "True").await;
    assert_eq!(settled(&capo, "capo_policy_status_writes_total").await - base, 21.0);
}

#[tokio::test]
async fn readiness_is_withdrawn_while_a_watch_keeps_failing_and_comes_back_after() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-watchfail").await;
    let mut settings = capo_settings(&format!("capo-test-{}", ns.name), &[&ns.name], None);
    settings.watch_failure_grace = Duration::from_secs(2);
    let capo = start_capo_with(&client, &ns.name, settings).await;
    let readyz = format!("http://{}/readyz", capo.probe_addr.unwrap());
    let get = |url: String| async move {
        let r = reqwest::get(&url).await.ok()?;
        Some((r.status().as_u16(), r.text().await.ok()?))
    };
    assert_eq!(get(readyz.clone()).await.unwrap().0, 200);
    // The CapoPolicy API goes away: capo's policy watch fails from now on.
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    crds.delete("capopolicies.capo.io", &Default::default()).await.unwrap();
    let (_, why) = eventually("readiness withdrawn", Duration::from_secs(60), || {
        let readyz = readyz.clone();
        async move { get(readyz).await.filter(|(code, _)| *code == 503) }
    })
    .await;
    assert!(why.contains("the policies watch (failing for"), "{why}");
    assert!(!capo.readiness.is_ready());
    // Back: ready again without a restart.
    install_crd(&client, loose_capopolicy_crd()).await;
    eventually("ready again", Duration::from_secs(60), || {
        let readyz = readyz.clone();
        async move { get(readyz).await.filter(|(code, _)| *code == 200) }
    })
    .await;
}

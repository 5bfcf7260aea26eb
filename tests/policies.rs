//! Policy reload against a real API server: a CapoPolicy capo cannot read does not stall
//! the others, and status writes do not feed on their own watch events.
//!
//! This binary has its own control plane: it installs CapoPolicy and ReservedIP CRDs whose
//! `spec` the API server does not check, so a malformed policy or record can get in (as
//! one can through an older or hand-edited CRD), and an IPReservation CRD without
//! `format: cidr` (as with the etcd datastore or an old CRD), so a non-CIDR entry can.

mod support;

use std::time::Duration;

use capo_api::CapoPolicy;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::CustomResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use support::leading::*;
use support::*;

/// `crd` with an unchecked `spec`.
fn loose(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let mut crd = serde_json::to_value(crd).unwrap();
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    schema["properties"]["spec"] = json!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true });
    if let Some(o) = schema.as_object_mut() {
        o.remove("x-kubernetes-validations");
    }
    serde_json::from_value(crd).unwrap()
}

fn loose_capopolicy_crd() -> CustomResourceDefinition {
    loose(CapoPolicy::crd())
}

/// Calico's v1 IPReservation CRD without `format: cidr` on its entries (still a set).
fn formatless_ipreservation_crd() -> CustomResourceDefinition {
    let mut crd = serde_json::to_value(capo_api::CalicoApiGroup::CrdV1.ip_reservation_crd()).unwrap();
    let items = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["reservedCIDRs"]
        ["items"];
    items.as_object_mut().unwrap().remove("format");
    serde_json::from_value(crd).unwrap()
}

async fn setup(prefix: &str) -> (kube::Client, TestNamespace) {
    let client = client().await;
    install_crd(&client, loose_capopolicy_crd()).await;
    install_crd(&client, loose(capo_api::ReservedIP::crd())).await;
    install_crd(&client, formatless_ipreservation_crd()).await;
    install_crd(&client, capo_api::CalicoApiGroup::V3.ip_reservation_crd()).await;
    let ns = TestNamespace::create(&client, prefix).await;
    (client, ns)
}

/// The tests here count status writes of cluster-scoped policies: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Waits until capo has handled `events` more policy watch events than `base` (the
/// echoes of its own status writes included), then returns its status writes.
async fn writes_after(app: &capo::App, base: f64, events: f64) -> f64 {
    eventually(&format!("{events} policy events handled"), Duration::from_secs(30), || async {
        (metric(app, "capo_policy_events_total") >= base + events).then_some(())
    })
    .await;
    metric(app, "capo_policy_status_writes_total")
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
    let base = metric(&capo, "capo_policy_status_writes_total");
    let events = metric(&capo, "capo_policy_events_total");
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
    // The echoes of those writes come back (20 creations, 20 status updates); none may
    // cause another write.
    let api = Api::<CapoPolicy>::all(client.clone());
    let after = writes_after(&capo, events, 40.0).await;
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
    assert_eq!(writes_after(&capo, events, 42.0).await - base, 21.0);
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

/// Invariant 10: a policy whose name cannot be a label value (here 100 characters,
/// created through an older CRD without the name rule) would make every hold write fail
/// (the API server refuses the `capo.io/policy` label), and with `onHoldFailure: Deny`
/// refuse every deletion of the Pods it selects. capo marks it `Ready=False`
/// (`NameTooLong`) and never loads it: those Pods' deletions are allowed, and another
/// policy holds them.
#[tokio::test]
async fn a_policy_name_too_long_for_a_label_never_locks_deletions_out() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-long").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let long = format!("{}-{}", ns.name, "x".repeat(99 - ns.name.len()));
    let spec = json!({ "podSelector": {}, "priority": 100, "onHoldFailure": "Deny",
                       "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } } });
    let bad = try_apply_policy(&client, &long, spec).await.expect("the loose CRD takes it");
    let bad = wait_policy_ready(&client, &long, bad.metadata.generation, "False").await;
    let cond = bad.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(cond.reason, "NameTooLong", "{}", cond.message);
    assert!(cond.message.contains("at most 63"), "{}", cond.message);
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-0", &[], &[]), &[ip]).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("never refused because of the policy's name");
    assert!(record(&client, ip).await.is_none(), "the policy was not loaded");
    let good = format!("{}-good", ns.name);
    apply_policy(&client, &good, &ns.name, json!({ "podSelector": {} })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-1", &[], &[]), &[ip]).await;
    delete_pod(&client, &ns.name, "redis-1").await.expect("held by the other policy");
    assert_eq!(record(&client, ip).await.expect("held").spec.policy, good);
    // (The other tests of this binary count policies: leave none behind.)
    let policies = Api::<CapoPolicy>::all(client.clone());
    policies.delete(&long, &Default::default()).await.unwrap();
    policies.delete(&good, &Default::default()).await.unwrap();
}

/// Defect 2: one object capo cannot decode stops nothing. A malformed CapoPolicy and a
/// malformed ReservedIP are there before capo starts; the fresh capo's leader still
/// counts the good policy's hold down and releases it on time, and marks the bad policy
/// `Ready=False`.
#[tokio::test]
async fn d02_objects_capo_cannot_read_do_not_stop_releases() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-d02").await;
    let untyped =
        Api::<kube::api::DynamicObject>::all_with(client.clone(), &kube::api::ApiResource::erase::<CapoPolicy>(&()));
    let bad = format!("{}-bad", ns.name);
    let obj = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": bad },
                      "spec": { "podSelector": {}, "maxReserved": "lots" } });
    untyped.patch(&bad, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj)).await.expect("applied");
    let records = Api::<kube::api::DynamicObject>::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<capo_api::ReservedIP>(&()),
    );
    let bad_record = format!("{}-bad-record", ns.name);
    let obj = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP", "metadata": { "name": bad_record },
                      "spec": { "ip": 5, "policy": format!("{}-good", ns.name) } });
    records.patch(&bad_record, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj)).await.expect("applied");

    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    let good = format!("{}-good", ns.name);
    apply_policy(
        &client,
        &good,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "2s", "releaseInterval": "100ms" }),
    )
    .await;
    let ip = selected_pod(&client, &ns.name, "redis-0", false).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("held and allowed");
    let release_at = wait_status(&client, ip).await.status.unwrap().release_at.unwrap().0;
    let released = wait_released(&client, ip, Duration::from_secs(20)).await;
    let late = released.duration_since(release_at).as_secs_f64();
    assert!((-0.05..=1.5).contains(&late), "released {late:.2}s after its releaseAt");
    eventually("the malformed policy marked Ready=False", Duration::from_secs(30), || {
        let untyped = untyped.clone();
        let bad = bad.clone();
        async move { (untyped.get(&bad).await.ok()?.data.pointer("/status/conditions/0/status")? == "False").then_some(()) }
    })
    .await;
    assert!(records.get_opt(&bad_record).await.unwrap().is_some(), "a record capo cannot read is left alone");
    // (The other tests of this binary count policies: leave none behind.)
    untyped.delete(&bad, &Default::default()).await.unwrap();
    records.delete(&bad_record, &Default::default()).await.unwrap();
}

/// Issue 23 item 5: a record is not write input unless capo could have written it. A
/// hand-made `ReservedIP` (made through a CRD without the rules that now refuse it) whose
/// `cidr` is `10.0.0.0/8`, and one pointing at a reservation that is not its policy's, are
/// reported (metric, Event) and left alone: nothing is written back into a reservation, and
/// a real hold of the policy is still released on time beside them.
#[tokio::test]
async fn records_capo_did_not_write_never_reach_a_reservation() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-forged").await;
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    let spec =
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "3s", "releaseInterval": "100ms" });
    let Scene { client, ns, capo, policy } = scene_with(client, ns, capo, spec).await;
    // A real hold first: the policy's reservation exists, capo-owned.
    let real = held_gone_pod(&client, &ns.name, "redis-0").await;
    let records = Api::<kube::api::DynamicObject>::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<capo_api::ReservedIP>(&()),
    );
    let forged = |ip: std::net::IpAddr, cidr: &str, reservation: &str| {
        json!({ "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
                "metadata": { "name": capo_api::reserved_ip::record_name(ip),
                              "labels": { "app.kubernetes.io/managed-by": "capo", "capo.io/policy": policy } },
                "spec": { "ip": ip.to_string(), "cidr": cidr, "reservation": reservation,
                          "calicoApiGroup": "crd.projectcalico.org/v1", "policy": policy,
                          "pod": { "namespace": ns.name, "name": "gone", "uid": "forged" },
                          "trigger": "Delete", "reservedAt": Timestamp::now(), "reserveFor": "1h" } })
    };
    let (wide, elsewhere) = (Ips::v4(), Ips::v4());
    for (ip, cidr, reservation) in [
        (wide, "10.0.0.0/8".to_string(), format!("capo-{policy}")),
        (elsewhere, cidr(elsewhere), "capo-someone-else".into()),
    ] {
        let obj = forged(ip, &cidr, &reservation);
        let name = capo_api::reserved_ip::record_name(ip);
        records.patch(&name, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj)).await.expect("applied");
    }
    for reason in ["cidr", "reservation"] {
        wait_metric(&capo, &format!("capo_records_ignored_total{{reason=\"{reason}\"}}"), 1.0).await;
    }
    wait_event(&client, "default", &capo_api::reserved_ip::record_name(wide), "Inconsistent").await;
    // The real hold is released on time beside them; by then the leader has looked at
    // every record many times over (repair settles in 1 s here).
    wait_released(&client, real, Duration::from_secs(20)).await;
    let entries = policy_entries(&client, V1, &policy).await;
    assert!(!entries.contains(&"10.0.0.0/8".to_string()), "a forged record's cidr written back: {entries:?}");
    assert!(!entries.contains(&cidr(elsewhere)), "{entries:?}");
    let other = Api::<kube::api::DynamicObject>::all_with(client.clone(), &V1.ip_reservation());
    assert!(other.get_opt("capo-someone-else").await.unwrap().is_none(), "no reservation made for a forged record");
    for ip in [wide, elsewhere] {
        assert!(records.get_opt(&capo_api::reserved_ip::record_name(ip)).await.unwrap().is_some(), "left alone");
        records.delete(&capo_api::reserved_ip::record_name(ip), &Default::default()).await.unwrap();
    }
    Api::<CapoPolicy>::all(client.clone()).delete(&policy, &Default::default()).await.unwrap();
}

/// Defect 11 (invariant 3): repair removes from a capo-owned reservation only entries that
/// are not CIDRs (one breaks every Calico allocation in the cluster); a valid CIDR capo did
/// not write stays, and is reported.
#[tokio::test]
async fn d11_repair_removes_only_entries_that_are_not_cidrs() {
    let _one = SERIAL.lock().await;
    let (client, ns) = setup("pol-d11").await;
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(
        &client,
        &policy,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" }),
    )
    .await;
    let held = selected_pod(&client, &ns.name, "redis-0", false).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("held and allowed");
    wait_status(&client, held).await;
    let record_name = capo_api::reserved_ip::record_name(held);
    let reservation =
        Api::<capo_api::ReservedIP>::all(client.clone()).get(&record_name).await.unwrap().spec.reservation;
    let api = Api::<kube::api::DynamicObject>::all_with(client.clone(), &V1.ip_reservation());
    let foreign = ["198.19.240.0/24", "198.19.241.6/31"];
    let patch: json_patch::Patch = serde_json::from_value(json!([
        { "op": "add", "path": "/spec/reservedCIDRs/-", "value": "not-an-ip" },
        { "op": "add", "path": "/spec/reservedCIDRs/-", "value": foreign[0] },
        { "op": "add", "path": "/spec/reservedCIDRs/-", "value": foreign[1] },
    ]))
    .unwrap();
    api.patch(&reservation, &PatchParams::default(), &Patch::<()>::Json(patch)).await.unwrap();
    eventually("the non-CIDR entry removed", Duration::from_secs(20), || async {
        (!entries(&client, &policy).await.contains(&"not-an-ip".to_string())).then_some(())
    })
    .await;
    let mut want = vec![cidr(held), foreign[0].to_string(), foreign[1].to_string()];
    want.sort();
    assert_eq!(entries(&client, &policy).await, want, "valid CIDRs stay");
    assert_eq!(metric(&capo, "capo_repairs_total{action=\"garbage_removed\"}"), 1.0);
    wait_metric(&capo, &format!("capo_foreign_entries{{policy=\"{policy}\"}}"), 2.0).await;
    let note = wait_event(&client, "default", &policy, "ForeignEntries").await;
    assert!(note.contains(foreign[0]) && note.contains(&reservation), "{note}");
    // Left alone for good: still there after the leader planned again (a new hold).
    let later = selected_pod(&client, &ns.name, "redis-1", false).await;
    delete_pod(&client, &ns.name, "redis-1").await.expect("held and allowed");
    wait_status(&client, later).await;
    let left = entries(&client, &policy).await;
    assert!(foreign.iter().all(|f| left.contains(&f.to_string())), "{left:?}");
}

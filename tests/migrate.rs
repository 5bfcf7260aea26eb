//! `capo take-over` against the real API server: the original capo's state — its
//! `projectcalico.org/v3` IPReservation `ip-reserve-delay-release` with bare IPs, the
//! placeholder `1.1.1.1` and a duplicate, and its ConfigMap of reserve times in the
//! container's local time — is taken over with the original reserve times, and capo's
//! leader releases each IP when the original would have.
//!
//! The original ran with calico-apiserver, which accepts bare IPs; Calico's native v3 CRD
//! (and capo's binding of it) does not, nor duplicates. This binary's control plane stands
//! in for calico-apiserver with a v3 IPReservation CRD whose entries are plain strings.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use capo::app::ReleaseSettings;
use capo::release::EngineSettings;
use capo_api::{CalicoApiGroup, HoldTrigger};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::jiff::{SignedDuration, Timestamp, tz};
use kube::api::{Api, DynamicObject, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::leading::wait_metric;
use support::*;

/// Calico's v3 IPReservation as calico-apiserver serves it: entries are any strings, and
/// duplicates are kept.
fn loose(mut v: Value) -> Value {
    match &mut v {
        Value::Object(m) => {
            m.remove("format");
            m.remove("x-kubernetes-list-type");
            for (_, x) in m.iter_mut() {
                *x = loose(x.take());
            }
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                *x = loose(x.take());
            }
        }
        _ => {}
    }
    v
}

/// `at` as the original wrote it: local time of a container at UTC+8.
fn original_time(at: Timestamp) -> String {
    let offset = tz::Offset::from_hours(8).unwrap();
    at.to_zoned(tz::TimeZone::fixed(offset)).strftime("%Y-%m-%d-%H:%M:%S").to_string()
}

async fn original_objects(
    client: &Client,
    ns: &str,
    entries: &[String],
    data: &[(IpAddr, String)],
) -> (String, String) {
    let _ = Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": "ip-reserve" } })).unwrap(),
        )
        .await;
    let reservations = Api::<DynamicObject>::all_with(client.clone(), &CalicoApiGroup::V3.ip_reservation());
    let original: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "projectcalico.org/v3", "kind": "IPReservation",
        "metadata": { "name": "ip-reserve-delay-release" },
        "spec": { "reservedCIDRs": entries },
    }))
    .unwrap();
    let original = reservations.create(&PostParams::default(), &original).await.expect("the original's reservation");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": "ip-reserve-delay-release" },
        "data": data.iter().map(|(ip, v)| (ip.to_string(), json!(format!("{ns}_{v}")))).collect::<serde_json::Map<_, _>>(),
    }))
    .unwrap();
    let cm =
        Api::<ConfigMap>::namespaced(client.clone(), "ip-reserve").create(&PostParams::default(), &cm).await.unwrap();
    (original.resource_version().unwrap(), cm.resource_version().unwrap())
}

#[tokio::test]
async fn the_originals_holds_are_taken_over_with_their_reserve_times() {
    let client = client().await;
    install_capo_crds(&client).await;
    install_crd(&client, CalicoApiGroup::CrdV1.ip_reservation_crd()).await;
    let v3 = serde_json::to_value(CalicoApiGroup::V3.ip_reservation_crd()).unwrap();
    install_crd(&client, serde_json::from_value(loose(v3)).unwrap()).await;
    let ns = TestNamespace::create(&client, "migrate").await;
    let policy = format!("{}-migrated", ns.name);
    try_apply_policy(
        &client,
        &policy,
        json!({ "namespaceSelector": { "matchLabels": { "ip-reserve": "enabled" } },
                "podSelector": { "matchExpressions": [{ "key": "statefulset.kubernetes.io/pod-name", "operator": "Exists" }] },
                "reserveFor": "40m", "releaseInterval": "100ms" }),
    )
    .await
    .unwrap();

    // The original's state: one hold 2 minutes old, one 50 minutes old (past its 40m), an
    // IPv6 one, the placeholder and a duplicate in the reservation. The original could
    // not record the IPv6 one's time: a ConfigMap key cannot contain ':'.
    let now = Timestamp::now();
    let (fresh, stale, v6) = (Ips::v4(), Ips::v4(), Ips::v6());
    let fresh_at = now - SignedDuration::from_mins(2);
    let stale_at = now - SignedDuration::from_mins(50);
    let entries: Vec<String> =
        ["1.1.1.1".to_string(), fresh.to_string(), fresh.to_string(), stale.to_string(), v6.to_string()].to_vec();
    let data = [
        (fresh, format!("redis-0_node-1_{}", original_time(fresh_at))),
        (stale, format!("redis-1_node-2_{}", original_time(stale_at))),
    ];
    let (reservation_rv, cm_rv) = original_objects(&client, &ns.name, &entries, &data).await;
    let base = [
        "take-over",
        "--policy",
        &policy,
        "--original-utc-offset",
        "+08:00",
        "--calico-api",
        "crd.projectcalico.org/v1",
    ];

    // A dry run says what it would do and writes nothing.
    let (code, out, err) = capo_cli(&[&base[..], &["--dry-run"]].concat()).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("would be taken over").count(), 3, "{out}");
    assert!(out.contains("1.1.1.1") && out.contains("the original's placeholder"), "{out}");
    for ip in [fresh, stale, v6] {
        assert!(record(&client, ip).await.is_none(), "dry run wrote {ip}");
    }

    let (code, out, err) = capo_cli(&base).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches(&format!("taken over into capo-{policy}")).count(), 3, "{out}");
    let seconds = |t: Timestamp| t.as_second();
    assert!(out.contains("no ConfigMap entry; counted from now"), "{out}");
    for (ip, at, pod) in [(fresh, fresh_at, "redis-0"), (stale, stale_at, "redis-1")] {
        let rec = record(&client, ip).await.unwrap_or_else(|| panic!("no record for {ip}"));
        assert_eq!(rec.spec.trigger, HoldTrigger::Migrated);
        assert_eq!((rec.spec.pod.namespace.as_str(), rec.spec.pod.name.as_str()), (ns.name.as_str(), pod));
        assert_eq!(seconds(rec.spec.reserved_at.0), seconds(at), "{ip}: the original's reserve time");
        let status = rec.status.clone().expect("status");
        assert_eq!(seconds(status.pod_gone_at.unwrap().0), seconds(at), "{ip}: counted from the original's time");
    }
    let rec = record(&client, v6).await.expect("the IPv6 hold");
    assert_eq!(rec.spec.trigger, HoldTrigger::Migrated);
    assert!((rec.spec.reserved_at.0.as_second() - now.as_second()).abs() < 60, "no time recorded: counted from now");
    let held = reservation(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.unwrap();
    for ip in [fresh, stale, v6] {
        assert!(held.contains(&cidr(ip)), "{ip} in capo's reservation: {held:?}");
    }
    assert!(!held.iter().any(|e| e.starts_with("1.1.1.1")), "no placeholder: {held:?}");
    // The original's objects are not capo's to write.
    let original = Api::<DynamicObject>::all_with(client.clone(), &CalicoApiGroup::V3.ip_reservation())
        .get("ip-reserve-delay-release")
        .await
        .unwrap();
    assert_eq!(original.resource_version().unwrap(), reservation_rv);
    let cm = Api::<ConfigMap>::namespaced(client.clone(), "ip-reserve").get("ip-reserve-delay-release").await.unwrap();
    assert_eq!(cm.resource_version().unwrap(), cm_rv);

    // Again: nothing changes.
    let before = record(&client, fresh).await.unwrap().resource_version();
    let (code, out, err) = capo_cli(&base).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("already held by capo").count(), 3, "{out}");
    assert_eq!(record(&client, fresh).await.unwrap().resource_version(), before);

    // capo's leader releases the one the original would have released by now, and keeps
    // the others until their original due time.
    let mut settings = capo_settings(&format!("capo-test-{}", ns.name), &[&ns.name], Some(CalicoApiGroup::CrdV1));
    settings.release = Some(ReleaseSettings {
        election: None,
        engine: EngineSettings { policy_prefix: Some(format!("{}-", ns.name)), ..Default::default() },
        identity: "migrate".into(),
    });
    let capo = start_capo_with(&client, &ns.name, settings).await;
    eventually("the overdue hold released", Duration::from_secs(30), || async {
        record(&client, stale).await.is_none().then_some(())
    })
    .await;
    let held = reservation(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.unwrap();
    assert!(!held.contains(&cidr(stale)) && held.contains(&cidr(fresh)), "{held:?}");
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&capo, &ttl, 1.0).await, 1.0, "released by the leader for its TTL");
    let rec = record(&client, fresh).await.expect("the fresh hold stays");
    let release_at = rec.status.unwrap().release_at.unwrap().0;
    assert_eq!(seconds(release_at), seconds(fresh_at + SignedDuration::from_mins(40)), "due when the original's was");
    capo.shutdown().await;

    // Clear errors.
    let (code, _, err) = capo_cli(&["take-over", "--policy", "no-such-policy"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("CapoPolicy no-such-policy does not exist"), "{err}");
    let (code, _, err) = capo_cli(&["take-over", "--policy", &policy, "--reservation", "nope"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nothing to take over"), "{err}");
    let (code, _, err) = capo_cli(&["take-over", "--policy", &policy, "--original-utc-offset", "CST"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a UTC offset"), "{err}");
}

//! capo beside a real calico-apiserver (v3.28.5, `Calico::ApiServer`): Calico's aggregated
//! API server serves `projectcalico.org/v3` as a view of the `crd.projectcalico.org/v1`
//! objects, as on clusters installed by Calico's operator before 3.32. Both groups name
//! one stored object, and a write through v3 moves the stored object's labels and
//! annotations into one `projectcalico.org/metadata` annotation. capo must keep one
//! stored object as one shard, keep owning it whoever writes through v3, and hold and
//! release each IP once. Every test of this binary runs on that control plane.

mod support;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use capo_api::CalicoApiGroup;
use capo_testenv::Calico;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::leading::*;
use support::*;

const V3: CalicoApiGroup = CalicoApiGroup::V3;

/// The control plane with calico-apiserver, capo's CRDs (Calico's v1 CRDs come with the
/// IPAM driver; v3 is calico-apiserver's) and a namespace of the test's own.
async fn setup_apiserver(prefix: &str) -> (Client, TestNamespace) {
    let client = capo_testenv::shared_with(Calico::ApiServer).client().await;
    install_capo_crds(&client).await;
    let ns = TestNamespace::create(&client, prefix).await;
    (client, ns)
}

/// A leading capo for `ns` (Calico's API detected, or `calico` forced), and the policy
/// `<namespace>-p` with `spec`.
async fn scene_on_apiserver(prefix: &str, calico: Option<CalicoApiGroup>, spec: serde_json::Value) -> Scene {
    let (client, ns) = setup_apiserver(prefix).await;
    let mut settings = leading_settings(&ns.name, "a", Duration::from_secs(600));
    settings.calico_api = calico;
    let capo = start_capo_with(&client, &ns.name, settings).await;
    scene_with(client, ns, capo, spec).await
}

/// A Pod `app=redis` with an IPv4 address from Calico's IPAM.
async fn calico_pod(client: &Client, ns: &str, name: &str) -> IpAddr {
    let pod = unscheduled_pod(name, &[("app", "redis")], &[]);
    let pod = create_pod_with_calico_ips(client, ns, pod, IpFamilies::V4).await;
    pod.status.unwrap().pod_ip.unwrap().parse().unwrap()
}

fn api(client: &Client, group: CalicoApiGroup) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &group.ip_reservation())
}

fn listed(obj: &DynamicObject) -> Vec<String> {
    obj.data["spec"]["reservedCIDRs"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

fn repairs(capo: &capo::App) -> f64 {
    capo.metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("capo_repairs_total{") && !l.contains("labels_restored"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The arrangement capo must recognise: discovery serves both groups, and an object
/// written through one reads back through the other.
#[tokio::test]
async fn calico_apiserver_serves_v3_as_a_view_of_the_v1_objects() {
    let (client, _ns) = setup_apiserver("cas-view").await;
    let name = format!("capo-test-view-{}", std::process::id());
    support::calico::write_reservation(&client, CalicoApiGroup::CrdV1, &name, &["198.51.100.7/32".to_string()]).await;
    let through_v3 = api(&client, V3).get(&name).await.expect("the v1 object read through projectcalico.org/v3");
    assert_eq!(listed(&through_v3), vec!["198.51.100.7/32".to_string()]);
    api(&client, CalicoApiGroup::CrdV1).delete(&name, &Default::default()).await.expect("delete");
    eventually("the object gone through v3 too", Duration::from_secs(10), || {
        let v3 = api(&client, V3);
        let name = name.clone();
        async move { v3.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
}

/// A hold made through the webhook stays in the stored object for all of its time (the
/// same object read through v3 is not a second shard to repair), capo's labels stay on
/// it, Calico's own client sees the entry, and it is released once, at its due time.
#[tokio::test]
async fn a_hold_stays_in_the_stored_object_until_its_due_time_and_is_released_once() {
    let Scene { client, ns, capo, policy } = scene_on_apiserver(
        "cas-hold",
        None,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "65s", "releaseInterval": "100ms" }),
    )
    .await;
    assert_eq!(capo.calico_api, CalicoApiGroup::CrdV1, "Calico's rule: v1 where both are served");
    let ip = calico_pod(&client, &ns.name, "redis-0").await;
    let entry = cidr(ip);
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    let deleted = Instant::now();
    let shard = record(&client, ip).await.expect("the record of the hold").spec.reservation;
    assert_eq!(shard, format!("capo-{policy}"));

    let v1 = api(&client, CalicoApiGroup::CrdV1);
    let mut polls = 0;
    let mut calico_checked = false;
    while deleted.elapsed() < Duration::from_secs(60) {
        let obj = v1.get(&shard).await.expect("read the stored object");
        let at = deleted.elapsed().as_secs_f64();
        assert!(listed(&obj).contains(&entry), "{entry} left {shard} {at:.1}s after the deletion: {:?}", obj.data);
        assert_eq!(
            obj.labels().get("app.kubernetes.io/managed-by").map(String::as_str),
            Some("capo"),
            "{shard} lost capo's label {at:.1}s after the deletion: {:?}",
            obj.metadata
        );
        assert!(
            !obj.annotations().contains_key("projectcalico.org/metadata"),
            "capo wrote through projectcalico.org/v3 ({at:.1}s): {:?}",
            obj.metadata
        );
        if !calico_checked && deleted.elapsed() > Duration::from_secs(10) {
            let through_v3 = api(&client, V3).get(&shard).await.expect("read through v3");
            assert!(listed(&through_v3).contains(&entry), "v3 view: {:?}", through_v3.data);
            let kubeconfig = &capo_testenv::shared().kubeconfig;
            let seen = support::calico::seen_by_calico(kubeconfig, &[]).await;
            let ours = seen.iter().find(|r| r.name == shard).expect("Calico's client lists capo's shard");
            assert!(ours.reserved_cidrs.contains(&entry), "Calico's client: {:?}", ours.reserved_cidrs);
            calico_checked = true;
        }
        polls += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(polls > 100, "polled {polls} times");
    assert_eq!(repairs(&capo), 0.0, "no repair action:\n{}", capo.metrics.render());

    let rec = wait_status(&client, ip).await;
    let release_at = rec.status.unwrap().release_at.unwrap().0;
    let released = wait_released(&client, ip, Duration::from_secs(30)).await;
    let late = released.duration_since(release_at).as_secs_f64();
    assert!(late >= -0.05, "released {late:.3}s before its releaseAt");
    assert!(!listed(&v1.get(&shard).await.unwrap()).contains(&entry), "the entry left the stored object");
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&capo, &ttl, 1.0).await, 1.0);
    assert_eq!(metric_value(&capo, &format!("capo_releases_total{{policy=\"{policy}\",reason=\"repair\"}}")), None);
    assert_eq!(repairs(&capo), 0.0, "no repair action:\n{}", capo.metrics.render());
}

/// `kubectl label` through `projectcalico.org/v3` (as `calicoctl` or any v3 client would
/// write) makes calico-apiserver move every label of the stored object into its
/// `projectcalico.org/metadata` annotation. capo finds its shard there, puts its labels
/// back (keeping the one the user added), says so, keeps holding, puts the next hold in
/// the same shard, and releases both once.
#[tokio::test]
async fn a_write_through_v3_leaves_capo_owning_its_shard() {
    let Scene { client, ns, capo, policy } = scene_on_apiserver(
        "cas-write",
        None,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "25s", "releaseInterval": "100ms" }),
    )
    .await;
    let first = calico_pod(&client, &ns.name, "redis-0").await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    let shard = format!("capo-{policy}");
    let v1 = api(&client, CalicoApiGroup::CrdV1);
    assert!(listed(&v1.get(&shard).await.unwrap()).contains(&cidr(first)));

    let (ok, out) = kubectl(&["label", "ipreservations.projectcalico.org", &shard, "team=db"], None).await;
    assert!(ok, "kubectl label through v3: {out}");
    let note = wait_event(&client, "default", &policy, "LabelsRestored").await;
    assert!(note.contains(&shard), "{note}");
    let obj = eventually("capo's labels back on the stored object", Duration::from_secs(20), || {
        let v1 = v1.clone();
        let shard = shard.clone();
        async move {
            let obj = v1.get(&shard).await.ok()?;
            (obj.labels().get("app.kubernetes.io/managed-by").map(String::as_str) == Some("capo")).then_some(obj)
        }
    })
    .await;
    assert_eq!(obj.labels().get("capo.io/policy"), Some(&policy), "{:?}", obj.metadata);
    assert_eq!(obj.labels().get("team").map(String::as_str), Some("db"), "the user's label kept: {:?}", obj.metadata);
    assert!(listed(&obj).contains(&cidr(first)), "still held: {:?}", obj.data);
    let restored = wait_metric(&capo, "capo_repairs_total{action=\"labels_restored\"}", 1.0).await;
    assert!(restored >= 1.0);
    let through_v3 = api(&client, V3).get(&shard).await.unwrap();
    assert_eq!(through_v3.labels().get("team").map(String::as_str), Some("db"), "{:?}", through_v3.metadata);

    // The next hold goes to the same shard: capo still owns it.
    let second = calico_pod(&client, &ns.name, "redis-1").await;
    delete_pod(&client, &ns.name, "redis-1").await.expect("deletion allowed");
    let rec = record(&client, second).await.expect("the second hold's record");
    assert_eq!(rec.spec.reservation, shard, "held in the same shard");
    assert!(v1.get_opt(&format!("{shard}.1")).await.unwrap().is_none(), "no second shard");
    let both = [cidr(first), cidr(second)];
    let now = listed(&v1.get(&shard).await.unwrap());
    assert!(both.iter().all(|e| now.contains(e)), "both held: {now:?}");

    for ip in [first, second] {
        wait_released(&client, ip, Duration::from_secs(60)).await;
    }
    let left = listed(&v1.get(&shard).await.unwrap());
    assert!(both.iter().all(|e| !left.contains(e)), "both released: {left:?}");
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&capo, &ttl, 2.0).await, 2.0);
    assert_eq!(repairs(&capo), 0.0, "no repair action:\n{}", capo.metrics.render());
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    assert!(pods.get_opt("redis-1").await.unwrap().is_none());
}

/// capo told to use `projectcalico.org/v3` (`--calico-api`) on the same cluster: its holds
/// go through calico-apiserver into the same stored objects, are watched once, and are
/// released once.
#[tokio::test]
async fn holds_written_through_v3_are_released_once() {
    let Scene { client, ns, capo, policy } = scene_on_apiserver(
        "cas-v3",
        Some(V3),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "3s", "releaseInterval": "100ms" }),
    )
    .await;
    assert_eq!(capo.calico_api, V3);
    let ip = calico_pod(&client, &ns.name, "redis-0").await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    let shard = format!("capo-{policy}");
    let stored = api(&client, CalicoApiGroup::CrdV1).get(&shard).await.expect("the stored object");
    assert!(listed(&stored).contains(&cidr(ip)), "in the stored object: {:?}", stored.data);
    wait_released(&client, ip, Duration::from_secs(30)).await;
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&capo, &ttl, 1.0).await, 1.0);
    assert!(!listed(&api(&client, V3).get(&shard).await.unwrap()).contains(&cidr(ip)));
    assert_eq!(repairs(&capo), 0.0, "no repair action:\n{}", capo.metrics.render());
}

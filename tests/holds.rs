//! capo's core promise against a real API server that calls capo's webhook over TLS:
//! when a selected Pod is deleted or evicted, every IP it has is in a capo-owned Calico
//! IPReservation, and recorded, by the time the API server answers the request.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use capo_api::{CalicoApiGroup, HoldTrigger};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::*;

/// Asserts the IPs are held right now: in the reservation and recorded.
async fn assert_held(
    client: &Client,
    group: CalicoApiGroup,
    policy: &str,
    pod: &str,
    ips: &[IpAddr],
    trigger: HoldTrigger,
) {
    let reservation = format!("capo-{policy}");
    let entries = reservation_for(client, group, &reservation).await;
    for &ip in ips {
        assert!(entries.contains(&cidr(ip)), "{} missing from {reservation}: {entries:?}", cidr(ip));
        let rec = record(client, ip).await.unwrap_or_else(|| panic!("no ReservedIP for {ip}"));
        assert_eq!(rec.spec.ip, ip.to_string());
        assert_eq!(rec.spec.policy, policy);
        assert_eq!(rec.spec.pod.name, pod);
        assert_eq!(rec.spec.trigger, trigger);
        assert_eq!(rec.spec.reservation, reservation);
        assert_eq!(rec.spec.calico_api_group, group.api_version());
    }
}

async fn reservation_for(client: &Client, group: CalicoApiGroup, name: &str) -> Vec<String> {
    reservation(client, group, name).await.unwrap_or_else(|| panic!("IPReservation {name} does not exist"))
}

async fn assert_not_held(client: &Client, ips: &[IpAddr]) {
    for &ip in ips {
        assert!(record(client, ip).await.is_none(), "{ip} was recorded");
    }
}

#[tokio::test]
async fn deleting_a_selected_pod_holds_every_ip_before_the_delete_returns() {
    let (client, ns) = setup("hold-delete").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    assert_eq!(
        capo.calico_api,
        CalicoApiGroup::CrdV1,
        "both groups served: Calico's rule picks crd.projectcalico.org/v1"
    );
    let policy = format!("{}-redis", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;

    let cases = [("v4", vec![Ips::v4()]), ("v6", vec![Ips::v6()]), ("dual", vec![Ips::v4(), Ips::v6()])];
    for (name, ips) in &cases {
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(name, &[("app", "redis")], &[]), ips).await;
    }
    for (name, ips) in &cases {
        delete_pod(&client, &ns.name, name).await.expect("deletion allowed");
        // No waiting: the hold must already be there when the API server answered.
        assert_held(&client, CalicoApiGroup::CrdV1, &policy, name, ips, HoldTrigger::Delete).await;
    }
    let entries = reservation_for(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await;
    assert_eq!(entries.len(), 4, "one entry per IP: {entries:?}");
    let labels = Api::<kube::api::DynamicObject>::all_with(client.clone(), &CalicoApiGroup::CrdV1.ip_reservation())
        .get(&format!("capo-{policy}"))
        .await
        .unwrap()
        .labels()
        .clone();
    assert_eq!(labels.get("app.kubernetes.io/managed-by").map(String::as_str), Some("capo"));
    let metrics = capo.metrics.render();
    assert!(metrics.contains(&format!("capo_holds_total{{policy=\"{policy}\",trigger=\"delete\"}} 4")), "{metrics}");
}

#[tokio::test]
async fn pods_that_are_not_selected_get_nothing_written() {
    let (client, ns) = setup("hold-skip").await;
    let other = TestNamespace::create(&client, "hold-skip-other").await;
    let _capo = start_capo(&client, &[&ns.name, &other.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;

    let wrong_labels = [Ips::v4()];
    let opted_out = [Ips::v4()];
    let other_ns = [Ips::v4()];
    let host_network = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("web", &[("app", "web")], &[]), &wrong_labels).await;
    create_pod_with_ips(
        &client,
        &ns.name,
        unscheduled_pod("out", &[("app", "redis")], &[("capo.io/hold", "false")]),
        &opted_out,
    )
    .await;
    create_pod_with_ips(&client, &other.name, unscheduled_pod("elsewhere", &[("app", "redis")], &[]), &other_ns).await;
    let mut host = unscheduled_pod("host", &[("app", "redis")], &[]);
    host.spec.as_mut().unwrap().host_network = Some(true);
    create_pod_with_ips(&client, &ns.name, host, &host_network).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("no-ip", &[("app", "redis")], &[]), &[]).await;

    for (n, p) in
        [(&ns.name, "web"), (&ns.name, "out"), (&other.name, "elsewhere"), (&ns.name, "host"), (&ns.name, "no-ip")]
    {
        delete_pod(&client, n, p).await.expect("deletion allowed");
    }
    assert_not_held(&client, &[wrong_labels[0], opted_out[0], other_ns[0], host_network[0]]).await;
    assert!(
        reservation(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.is_none(),
        "no reservation was created"
    );
}

#[tokio::test]
async fn evicting_a_selected_pod_holds_its_ip() {
    let (client, ns) = setup("hold-evict").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-zk", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "zk" } } })).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    // A Pod on a kwok node: scheduled by kube-scheduler, given its IP by kwok.
    pods.create(&PostParams::default(), &kwok_pod("zk-0", &[("app", "zk")])).await.unwrap();
    let running = wait_running(&client, &ns.name, "zk-0").await;
    let ips = pod_ips(&running);
    // The eviction is decided from capo's Pod cache: wait until it has seen the IP.
    pods.evict("zk-0", &EvictParams::default()).await.expect("eviction allowed");
    assert_held(&client, CalicoApiGroup::CrdV1, &policy, "zk-0", &ips, HoldTrigger::Eviction).await;
}

#[tokio::test]
async fn dry_run_deletion_writes_nothing() {
    let (client, ns) = setup("hold-dry").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    let ips = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("p", &[], &[]), &ips).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    pods.delete("p", &DeleteParams { dry_run: true, ..Default::default() }).await.expect("dry run allowed");
    let dry = EvictParams {
        delete_options: Some(DeleteParams { dry_run: true, ..Default::default() }),
        post_options: PostParams { dry_run: true, ..Default::default() },
    };
    pods.evict("p", &dry).await.expect("dry-run eviction allowed");
    assert!(pods.get_opt("p").await.unwrap().is_some(), "a dry run deletes nothing");
    assert_not_held(&client, &ips).await;
    assert!(reservation(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.is_none());
}

/// `kubectl delete --dry-run=server` says what capo would do: "would hold" for a selected
/// Pod, and why not for a Pod a policy nearly selects (its namespace not labelled, an opt-in
/// the policy does not allow) or selects but skips (a KubeVirt VM's launcher), through the
/// API server's own warnings. (An opted-out Pod's DELETE never reaches capo: the webhook's
/// CEL pre-filter leaves it out; `capo explain` says why.)
#[tokio::test]
async fn a_dry_run_deletion_says_why_a_nearly_selected_pod_would_not_be_held() {
    let (client, ns) = setup("hold-whynot").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let here = format!("{}-p", ns.name);
    apply_policy(&client, &here, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;
    let elsewhere = format!("{}-elsewhere", ns.name);
    let team = json!({ "matchLabels": { "capo-test-team": ns.name } });
    apply_policy(
        &client,
        &elsewhere,
        &ns.name,
        json!({ "namespaceSelector": team, "podSelector": { "matchLabels": { "app": "kafka" } } }),
    )
    .await;
    type Pairs<'a> = &'a [(&'a str, &'a str)];
    let pods: [(&str, Pairs<'_>, Pairs<'_>); 5] = [
        ("redis-0", &[("app", "redis")], &[]),
        ("redis-1", &[("app", "redis"), ("kubevirt.io", "virt-launcher")], &[]),
        ("kafka-0", &[("app", "kafka")], &[]),
        ("web-0", &[("app", "web")], &[("capo.io/policy", here.as_str())]),
        ("web-1", &[("app", "web")], &[]),
    ];
    for (name, labels, annotations) in pods {
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(name, labels, annotations), &[Ips::v4()]).await;
    }
    let dry_delete = |pod: &'static str| {
        let ns = ns.name.clone();
        async move {
            let (ok, out) = kubectl(&["delete", "pod", pod, "-n", &ns, "--dry-run=server"], None).await;
            assert!(ok, "{out}");
            out
        }
    };
    let out = dry_delete("redis-0").await;
    assert!(out.contains("capo: dry run; would hold"), "{out}");
    let out = dry_delete("redis-1").await;
    assert!(out.contains("capo: dry run; not held: it is a KubeVirt VM's launcher"), "{out}");
    let out = dry_delete("kafka-0").await;
    assert!(
        out.contains(&format!("not held: policy {elsewhere} selects this Pod but not its namespace {}", ns.name)),
        "{out}"
    );
    let out = dry_delete("web-0").await;
    assert!(
        out.contains(&format!("asks policy {here} to hold it by annotation, but the policy allows no opt-in")),
        "{out}"
    );
    // A Pod none of this test's policies comes near: nothing about them.
    let out = dry_delete("web-1").await;
    assert!(!out.contains(&here) && !out.contains(&elsewhere), "{out}");
    for name in ["redis-0", "redis-1", "kafka-0", "web-0", "web-1"] {
        assert!(Api::<Pod>::namespaced(client.clone(), &ns.name).get_opt(name).await.unwrap().is_some(), "{name} kept");
    }
}

/// Invariant 7: the same Pod reviewed again and again keeps one hold with its first
/// `reservedAt` — by the replica that wrote it, and by a restarted one that goes to the API
/// server and finds the entries (a duplicate is success) and the records in place. The
/// reviews are evictions a PodDisruptionBudget refuses after capo held (the Pod is not
/// ready, so the budget is never met), retried as `kubectl drain` does.
#[tokio::test]
async fn deleting_the_same_pod_twice_keeps_one_hold_and_the_first_reserved_at() {
    let (client, ns) = setup("hold-twice").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    let ips = [Ips::v4(), Ips::v6()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("p", &[("app", "twice")], &[]), &ips).await;
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "twice" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "twice" } } },
    }))
    .unwrap();
    let pdbs = Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(client.clone(), &ns.name);
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let reviews = |app: &capo::App| {
        metric_value(app, "capo_admission_requests_total{operation=\"eviction\",outcome=\"held\"}").unwrap_or(0.0)
    };
    let evict = || async {
        match pods.evict("p", &Default::default()).await {
            Err(kube::Error::Api(s)) if s.code == 429 => true,
            other => panic!("the budget refuses the eviction: {other:?}"),
        }
    };
    // The budget is computed asynchronously: evict until capo has reviewed one.
    eventually("capo to review an eviction", Duration::from_secs(30), || async {
        evict().await;
        (reviews(&capo) > 0.0).then_some(())
    })
    .await;
    let first = record(&client, ips[0]).await.expect("held");
    // Again, reviewed by the same replica.
    let before = reviews(&capo);
    evict().await;
    assert!(reviews(&capo) > before, "capo reviewed the eviction again");
    // And again after a restart.
    drop(capo);
    let restarted = start_capo(&client, &[&ns.name], None).await;
    eventually("the restarted capo to review an eviction", Duration::from_secs(30), || async {
        evict().await;
        (reviews(&restarted) > 0.0).then_some(())
    })
    .await;
    let last = record(&client, ips[0]).await.expect("still held");
    assert_eq!(first.spec.reserved_at, last.spec.reserved_at, "the first reservedAt is kept");
    assert_eq!(first.metadata.resource_version, last.metadata.resource_version, "the record is untouched");
    let entries = policy_entries(&client, CalicoApiGroup::CrdV1, &policy).await;
    assert_eq!(entries.len(), 2, "{entries:?}");
    // The deletion itself: the same hold.
    pdbs.delete("twice", &Default::default()).await.unwrap();
    delete_pod(&client, &ns.name, "p").await.expect("deleted now");
    let end = record(&client, ips[0]).await.expect("held");
    assert_eq!(end.metadata.resource_version, last.metadata.resource_version);
}

#[tokio::test]
async fn a_review_for_another_pod_never_replaces_the_hold_of_a_pod_that_still_has_the_ip() {
    let (client, ns) = setup("hold-other").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("a", &[("app", "a")], &[]), &[ip]).await;
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "a" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "a" } } },
    }))
    .unwrap();
    Api::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &pdb).await.unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    // Pod a's eviction is refused: a is held and still has the IP.
    let held = eventually("a held on a refused eviction", Duration::from_secs(30), || async {
        match pods.evict("a", &Default::default()).await {
            Err(kube::Error::Api(s)) if s.code == 429 => {}
            other => panic!("the budget refuses the eviction: {other:?}"),
        }
        record(&client, ip).await
    })
    .await;
    assert_eq!(held.spec.pod.name, "a");
    // Pod b gets the same address (a Pod may name a held address in
    // cni.projectcalico.org/ipAddrs, and Calico assigns it) and is deleted.
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("b", &[("app", "b")], &[]), &[ip]).await;
    eventually("capo's store to have b", Duration::from_secs(10), || async {
        capo.pods.get(&ns.name, "b").map(|_| ())
    })
    .await;
    delete_pod(&client, &ns.name, "b").await.expect("b's deletion allowed");
    let after = record(&client, ip).await.expect("still held");
    assert_eq!(after.spec.pod.name, "a", "b's review replaced the hold of a, which still has {ip}");
    assert_eq!(after.metadata.uid, held.metadata.uid, "the same record");
    assert_eq!(after.spec.reserved_at, held.spec.reserved_at);
    assert!(policy_entries(&client, CalicoApiGroup::CrdV1, &policy).await.contains(&cidr(ip)), "{ip} still reserved");
}

#[tokio::test]
async fn addresses_outside_every_calico_ip_pool_are_never_held() {
    let (client, ns) = setup("hold-pools").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let pools = capo.pools.clone().expect("Calico's IP pools are served here");
    eventually("capo to list Calico's IP pools", Duration::from_secs(30), || async {
        pools.pools_listed().then_some(())
    })
    .await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    // The test environment's pools: 198.18.0.0/16 and 2001:2:0:1::/112 (IPAM's), and the
    // disabled 198.19.0.0/16 and 2001:2::/64 its hand-made addresses come from. These two
    // are in none (another IPAM's, or a status written by hand).
    let (outside_v4, outside_v6): (IpAddr, IpAddr) = ("10.99.7.1".parse().unwrap(), "fd00:99::7".parse().unwrap());
    let inside = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("mixed", &[], &[]), &[inside, outside_v6]).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("foreign", &[], &[]), &[outside_v4]).await;
    for pod in ["mixed", "foreign"] {
        eventually(&format!("capo's store to have {pod}"), Duration::from_secs(10), || async {
            capo.pods.get(&ns.name, pod).map(|_| ())
        })
        .await;
        delete_pod(&client, &ns.name, pod).await.expect("deletion allowed");
    }
    assert_held(&client, CalicoApiGroup::CrdV1, &policy, "mixed", &[inside], HoldTrigger::Delete).await;
    assert_not_held(&client, &[outside_v4, outside_v6]).await;
    let entries = policy_entries(&client, CalicoApiGroup::CrdV1, &policy).await;
    assert_eq!(entries, vec![cidr(inside)], "only the address in a pool is reserved");
    // (The API server may review one deletion more than once.)
    let dropped = metric_value(&capo, "capo_admission_unconfirmed_total{reason=\"outside_pools\"}").unwrap_or(0.0);
    assert!(dropped >= 2.0, "both outside addresses counted: {dropped}");
    let answered = metric_value(&capo, "capo_admission_requests_total{operation=\"delete\",outcome=\"outside_pools\"}");
    assert!(answered >= Some(1.0), "foreign's deletion answered outside_pools: {answered:?}");
    // A host-network Pod (its node's address, in no pool) is evicted, as a drain does: not
    // held for being host-network, not reported as an address outside the pools.
    let mut host = unscheduled_pod("host", &[], &[]);
    host.spec.as_mut().unwrap().host_network = Some(true);
    create_pod_with_ips(&client, &ns.name, host, &["10.99.7.2".parse().unwrap()]).await;
    // (The store keeps no host-network Pod: capo reads it for the eviction.)
    Api::<Pod>::namespaced(client.clone(), &ns.name).evict("host", &EvictParams::default()).await.expect("evicted");
    let evictions = |outcome: &str| {
        metric_value(&capo, &format!("capo_admission_requests_total{{operation=\"eviction\",outcome=\"{outcome}\"}}"))
    };
    assert!(evictions("skipped") >= Some(1.0), "the eviction was reviewed and skipped");
    assert_eq!(evictions("outside_pools"), None, "a Pod capo would not hold is not checked against the pools");
}

#[tokio::test]
async fn two_hundred_concurrent_deletions_are_all_held() {
    let (client, ns) = setup("hold-200").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    // One shard (⌈500 / 500⌉): all 200 appends race for one object.
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {}, "maxReserved": 500 })).await;
    let pods: Vec<(String, IpAddr)> = (0..200).map(|i| (format!("p-{i}"), Ips::v4())).collect();
    futures::stream::iter(pods.iter().cloned())
        .for_each_concurrent(16, |(name, ip)| {
            let client = client.clone();
            let ns = ns.name.clone();
            async move {
                create_pod_with_ips(&client, &ns, unscheduled_pod(&name, &[], &[]), &[ip]).await;
            }
        })
        .await;
    let results: Vec<_> = futures::stream::iter(pods.iter().cloned())
        .map(|(name, _)| {
            let client = client.clone();
            let ns = ns.name.clone();
            async move { delete_pod(&client, &ns, &name).await.map_err(|e| format!("{name}: {e}")) }
        })
        .buffer_unordered(200)
        .collect()
        .await;
    let denied: Vec<_> = results.into_iter().filter_map(Result::err).collect();
    assert!(denied.is_empty(), "{} deletions failed: {:?}", denied.len(), &denied[..denied.len().min(5)]);
    let entries = reservation_for(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await;
    assert_eq!(entries.len(), 200, "no append lost");
    for (_, ip) in &pods {
        assert!(entries.contains(&cidr(*ip)), "{ip} lost");
    }
    let records = Api::<capo_api::ReservedIP>::all(client.clone())
        .list(&kube::api::ListParams::default().labels(&format!("capo.io/policy={policy}")))
        .await
        .unwrap();
    assert_eq!(records.items.len(), 200);
    let metrics = capo.metrics.render();
    // The API server may call the webhook more than once for one DELETE (it re-validates
    // when its cached copy of the Pod was stale); every extra call finds the hold in place.
    assert!(metrics.contains(&format!("capo_holds_total{{policy=\"{policy}\",trigger=\"delete\"}} 200")), "{metrics}");
    assert!(!metrics.contains("hold_failures_total"), "{metrics}");
}

#[tokio::test]
async fn policy_edits_take_effect_without_restart() {
    let (client, ns) = setup("hold-edit").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(
        &client,
        &policy,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "a" } }, "reserveFor": "40m" }),
    )
    .await;
    let before = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("b-1", &[("app", "b")], &[]), &before).await;
    delete_pod(&client, &ns.name, "b-1").await.unwrap();
    assert_not_held(&client, &before).await;

    // Edit selector and TTL; once capo reports the new generation, the next delete uses it.
    apply_policy(
        &client,
        &policy,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "b" } }, "reserveFor": "2h" }),
    )
    .await;
    let after = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("b-2", &[("app", "b")], &[]), &after).await;
    delete_pod(&client, &ns.name, "b-2").await.unwrap();
    let rec = record(&client, after[0]).await.expect("held under the edited policy");
    assert_eq!(rec.spec.reserve_for, "2h");
}

#[tokio::test]
async fn invalid_policies_are_refused_at_apply_with_a_clear_message() {
    let client = client().await;
    install_capo_crds(&client).await;
    let cases = [
        (json!({ "podSelector": {}, "reserveFor": "forever" }), "spec.reserveFor"),
        (json!({ "podSelector": {}, "reserveFor": "0s" }), "reserveFor must be at least 1s"),
        (json!({ "reserveFor": "1h" }), "a policy must select something"),
        (
            json!({ "podSelector": { "matchExpressions": [{ "key": "a", "operator": "In" }] } }),
            "In and NotIn need at least one value",
        ),
        (
            json!({ "podSelector": { "matchExpressions": [{ "key": "a", "operator": "Maybe" }] } }),
            "Unsupported value: \"Maybe\"",
        ),
        (
            json!({ "podSelector": {}, "podOverrides": { "minReserveFor": "2h", "maxReserveFor": "1h" } }),
            "minReserveFor must not exceed",
        ),
        (json!({ "podSelector": {}, "onHoldFailure": "Sometimes" }), "spec.onHoldFailure"),
        (json!({ "podSelector": {}, "maxReserved": 0 }), "spec.maxReserved"),
    ];
    for (i, (spec, expected)) in cases.into_iter().enumerate() {
        let err = try_apply_policy(&client, &format!("invalid-{i}"), spec.clone()).await.expect_err("refused");
        let msg = err.to_string();
        assert!(msg.contains(expected), "{spec}: expected {expected:?} in {msg}");
    }
}

/// Invariant 10: no field value locks deletions out. A policy name is the value of the
/// `capo.io/policy` label on every reservation and record, so one longer than a label
/// value (63) would make every hold write fail (a 100-character name, with
/// `onHoldFailure: Deny`, refused every deletion of the Pods it selected). 64 and 253
/// are refused at apply; 63 holds.
#[tokio::test]
async fn policy_names_that_cannot_be_label_values_are_refused_and_63_holds() {
    let (client, ns) = setup("hold-names").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    for len in [64, 253] {
        let name = format!("{}-{}", ns.name, "x".repeat(len - ns.name.len() - 1));
        assert_eq!(name.len(), len);
        let err = try_apply_policy(&client, &name, json!({ "podSelector": {} })).await.expect_err("refused at apply");
        assert!(err.to_string().contains("at most 63 characters"), "{len}: {err}");
    }
    let longest = format!("{}-{}", ns.name, "x".repeat(62 - ns.name.len()));
    assert_eq!(longest.len(), 63);
    apply_policy(&client, &longest, &ns.name, json!({ "podSelector": {}, "onHoldFailure": "Deny" })).await;
    let ips = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("p", &[], &[]), &ips).await;
    delete_pod(&client, &ns.name, "p").await.expect("a 63-character policy holds");
    assert_held(&client, CalicoApiGroup::CrdV1, &longest, "p", &ips, HoldTrigger::Delete).await;
}

#[tokio::test]
async fn holds_are_written_in_the_projectcalico_v3_group_when_chosen() {
    let (client, ns) = setup("hold-v3").await;
    let capo = start_capo(&client, &[&ns.name], Some(CalicoApiGroup::V3)).await;
    assert_eq!(capo.calico_api, CalicoApiGroup::V3);
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    let ips = [Ips::v4(), Ips::v6()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("p", &[], &[]), &ips).await;
    delete_pod(&client, &ns.name, "p").await.unwrap();
    assert_held(&client, CalicoApiGroup::V3, &policy, "p", &ips, HoldTrigger::Delete).await;
    assert!(
        reservation(&client, CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.is_none(),
        "nothing in the other group"
    );
}

#[tokio::test]
async fn a_malformed_admission_review_gets_400_with_the_reason() {
    let (client, ns) = setup("hold-malformed").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let http = reqwest::Client::builder().danger_accept_invalid_certs(true).build().unwrap();
    let url = format!("https://{}{}", capo.webhook_addr, capo::admission::REVIEW_PATH);
    for (body, reason) in [
        ("{not json", "malformed AdmissionReview"),
        (r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#, "malformed AdmissionReview"),
        (
            r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"1"}}"#,
            "malformed AdmissionReview",
        ),
    ] {
        let resp = http.post(&url).header("content-type", "application/json").body(body).send().await.unwrap();
        assert_eq!(resp.status(), 400, "{body}");
        let text = resp.text().await.unwrap();
        assert!(text.contains(reason), "{body}: {text}");
    }
    // A DELETE review without its oldObject is malformed too.
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "p", "namespace": ns.name, "operation": "DELETE", "userInfo": {},
        }
    });
    let resp = http.post(&url).json(&review).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.text().await.unwrap().contains("without oldObject"));
    // capo keeps serving.
    let resp = http.post(&url).json(&json!({})).send().await.unwrap();
    assert_eq!(resp.status(), 400);
}

/// capo's client impersonates a ServiceAccount that may do everything capo needs except
/// write IPReservations.
async fn client_without_reservation_rights(client: &Client, ns: &str) -> Client {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let name = format!("capo-limited-{ns}");
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": { "name": name },
        "rules": [
            { "apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["get", "list", "watch"] },
            { "apiGroups": ["capo.io"], "resources": ["capopolicies", "capopolicies/status", "reservedips"], "verbs": ["*"] },
            { "apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations", "mutatingwebhookconfigurations"], "verbs": ["*"] },
            { "nonResourceURLs": ["*"], "verbs": ["get"] },
        ],
    }))
    .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": { "name": name },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name },
        "subjects": [{ "kind": "ServiceAccount", "name": "capo", "namespace": ns }],
    }))
    .unwrap();
    let pp = PatchParams::apply("capo-tests").force();
    Api::<ClusterRole>::all(client.clone()).patch(&name, &pp, &Patch::Apply(role)).await.unwrap();
    Api::<ClusterRoleBinding>::all(client.clone()).patch(&name, &pp, &Patch::Apply(binding)).await.unwrap();
    let mut config = capo_testenv::config_from_kubeconfig(&capo_testenv::shared().kubeconfig).await.unwrap();
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{ns}:capo"));
    Client::try_from(config).unwrap()
}

#[tokio::test]
async fn a_hold_that_cannot_be_written_denies_or_allows_as_the_policy_says() {
    let (client, ns) = setup("hold-forbidden").await;
    let limited = client_without_reservation_rights(&client, &ns.name).await;
    let _capo = start_capo(&limited, &[&ns.name], None).await;
    let deny = format!("{}-deny", ns.name);
    let allow = format!("{}-allow", ns.name);
    apply_policy(&client, &deny, &ns.name, json!({ "podSelector": { "matchLabels": { "p": "deny" } } })).await;
    apply_policy(
        &client,
        &allow,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "p": "allow" } }, "onHoldFailure": "Allow" }),
    )
    .await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);

    create_pod_with_ips(&client, &ns.name, unscheduled_pod("strict", &[("p", "deny")], &[]), &[Ips::v4()]).await;
    let err = delete_pod(&client, &ns.name, "strict").await.expect_err("denied");
    let msg = err.to_string();
    assert!(
        msg.contains("capo could not hold") && msg.contains("forbidden") && msg.contains("onHoldFailure=Deny"),
        "{msg}"
    );
    assert!(pods.get_opt("strict").await.unwrap().is_some(), "the Pod stays");
    let err = pods.evict("strict", &EvictParams::default()).await.expect_err("eviction denied");
    match err {
        kube::Error::Api(s) => assert_eq!(s.code, 429, "eviction clients retry on 429: {s:?}"),
        other => panic!("{other}"),
    }

    create_pod_with_ips(&client, &ns.name, unscheduled_pod("lenient", &[("p", "allow")], &[]), &[Ips::v4()]).await;
    delete_pod(&client, &ns.name, "lenient").await.expect("allowed by onHoldFailure=Allow");
    assert!(pods.get_opt("lenient").await.unwrap().is_none());
}

#[tokio::test]
async fn no_hold_when_nobody_comes_back_owner_or_namespace_deleted() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let (client, ns) = setup("hold-gone").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;

    // The owner is deleted: the garbage collector deletes the Pod, and capo skips it.
    let owner: ConfigMap = serde_json::from_value(json!({ "metadata": { "name": "owner" } })).unwrap();
    let owner =
        Api::<ConfigMap>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &owner).await.unwrap();
    let mut pod = unscheduled_pod("owned", &[], &[]);
    pod.metadata.owner_references =
        Some(vec![serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.uid().unwrap(), "controller": true,
    }))
    .unwrap()]);
    let owned_ips = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, pod, &owned_ips).await;
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name).delete("owner", &Default::default()).await.unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    eventually("the garbage collector to delete the Pod", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move { pods.get_opt("owned").await.ok()?.is_none().then_some(()) }
    })
    .await;
    assert_not_held(&client, &owned_ips).await;
    // capo was asked and chose to skip (not merely left out of the request).
    assert!(capo.metrics.render().contains("capo_admission_skipped_total{reason=\"owner_deleted\"}"));

    // A selected Pod deleted by hand in the same namespace is held (the skip is not blanket).
    let kept = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("by-hand", &[], &[]), &kept).await;
    delete_pod(&client, &ns.name, "by-hand").await.unwrap();
    assert_held(&client, CalicoApiGroup::CrdV1, &policy, "by-hand", &kept, HoldTrigger::Delete).await;

    // The namespace is deleted: its Pods go with it, unheld.
    let doomed = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("doomed", &[], &[]), &doomed).await;
    delete_namespace_and_wait(&client, &ns.name).await;
    assert_not_held(&client, &doomed).await;
    let m = capo.metrics.render();
    assert!(m.contains("capo_admission_skipped_total{reason=\"namespace_terminating\"}"), "{m}");
}

#[tokio::test]
async fn an_ipreservation_capo_does_not_own_is_never_touched() {
    let (client, ns) = setup("hold-foreign").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    // Somebody else's object with capo's naming, without capo's label.
    let api = Api::<kube::api::DynamicObject>::all_with(client.clone(), &CalicoApiGroup::CrdV1.ip_reservation());
    let mut foreign = kube::api::DynamicObject::new(&format!("capo-{policy}"), &CalicoApiGroup::CrdV1.ip_reservation());
    foreign.data = json!({ "spec": { "reservedCIDRs": ["198.19.255.0/24"] } });
    api.create(&PostParams::default(), &foreign).await.unwrap();
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;

    // The hold goes to the policy's next reservation instead: nothing refused, nothing
    // written to the object capo does not own.
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("p", &[], &[]), &[ip]).await;
    delete_pod(&client, &ns.name, "p").await.expect("held elsewhere and allowed");
    let rec = record(&client, ip).await.expect("held");
    assert_eq!(rec.spec.reservation, format!("capo-{policy}.1"), "the next shard");
    let next = reservation_for(&client, CalicoApiGroup::CrdV1, &rec.spec.reservation).await;
    assert_eq!(next, vec![cidr(ip)]);
    let after = api.get(&format!("capo-{policy}")).await.unwrap();
    assert_eq!(after.data["spec"]["reservedCIDRs"], json!(["198.19.255.0/24"]), "the foreign object is unchanged");
    assert!(after.metadata.labels.is_none() && after.metadata.annotations.is_none(), "not even labelled or stamped");
}

#[tokio::test]
async fn pods_opt_in_by_annotation_and_ask_for_a_hold_time_within_bounds() {
    let (client, ns) = setup("hold-annot").await;
    let _capo = start_capo(&client, &[&ns.name], None).await;
    let policy = format!("{}-p", ns.name);
    let mut spec = json!({
        "podSelector": { "matchLabels": { "app": "nothing-has-this" } },
        "reserveFor": "40m",
        "podOverrides": { "minReserveFor": "10m", "maxReserveFor": "2h" },
    });
    apply_policy(&client, &policy, &ns.name, spec.clone()).await;
    // Opt-in by annotation is off unless the policy allows it.
    let ip = Ips::v4();
    let annotations = [("capo.io/policy", policy.as_str())];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("not-allowed", &[], &annotations), &[ip]).await;
    delete_pod(&client, &ns.name, "not-allowed").await.unwrap();
    assert!(record(&client, ip).await.is_none(), "the policy does not allow opt-in");
    spec["podOverrides"]["allowOptIn"] = json!(true);
    apply_policy(&client, &policy, &ns.name, spec).await;
    let cases = [("asks-1h", "1h", "1h"), ("asks-too-much", "24h", "2h"), ("asks-too-little", "1m", "10m")];
    for (name, asked, granted) in cases {
        let ip = Ips::v4();
        let annotations = [("capo.io/policy", policy.as_str()), ("capo.io/reserve-for", asked)];
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(name, &[], &annotations), &[ip]).await;
        delete_pod(&client, &ns.name, name).await.unwrap();
        let rec = record(&client, ip).await.unwrap_or_else(|| panic!("{name}: opted in, so held"));
        assert_eq!((rec.spec.policy.as_str(), rec.spec.reserve_for.as_str()), (policy.as_str(), granted), "{name}");
    }
}

/// The API server reviews one deletion several times, and clients repeat theirs (`kubectl
/// drain` retries an eviction a budget refuses every few seconds): a later review of the
/// same Pod within 5 s of the append is answered from the API server's answer to it, with
/// no request (the leader leaves a new entry of a Pod still there alone for 6 s); later,
/// it confirms the hold by one read of its shard (the entry there now implies its record:
/// capo removes a record only after its entry) instead of sending both writes again — an
/// append refused as a duplicate and a read of the whole reservation, a create refused as
/// existing and a read of the record.
#[tokio::test]
async fn a_repeated_review_of_the_same_pod_checks_its_hold_instead_of_writing_it_again() {
    repeated_review("h-repeat", false).await;
}

/// The same while the watched copy of the reservations lags (here: never arrives, its
/// list and watch refused): the confirming read goes to the shard the first write's
/// answer named, whatever the watched copy shows.
#[tokio::test]
async fn a_repeated_review_confirms_the_entry_where_the_write_put_it_while_the_watched_copy_lags() {
    repeated_review("h-repeat-lag", true).await;
}

async fn repeated_review(prefix: &str, lagging: bool) {
    use axum::http::Method;
    use support::faults::{Fault, FaultProxy, Rule};
    let (client, ns) = setup(prefix).await;
    let proxy = FaultProxy::start(client.clone()).await;
    if lagging {
        proxy.set(vec![Rule::new(Method::GET, "/ipreservations?", Fault::Status(500, None))]);
    }
    let name = format!("capo-test-{}", ns.name);
    let capo = start_capo_with(&proxy.client(), &ns.name, capo_settings(&name, &[&ns.name], None)).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "redis" } } })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-0", &[("app", "redis")], &[]), &[ip]).await;
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "redis" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "redis" } } },
    }))
    .unwrap();
    Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &pdb)
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let held = || metric_value(&capo, "capo_admission_requests_total{operation=\"eviction\",outcome=\"held\"}");
    let evict = || async {
        match pods.evict("redis-0", &Default::default()).await {
            Err(kube::Error::Api(s)) if s.code == 429 => {}
            other => panic!("the budget refuses the eviction: {other:?}"),
        }
    };
    proxy.clear_requests();
    // The budget is computed asynchronously: evict until capo has held on one.
    eventually("capo to hold on an eviction", Duration::from_secs(30), || async {
        evict().await;
        held().filter(|n| *n > 0.0)
    })
    .await;
    // The append was sent before this instant.
    let appended_before = std::time::Instant::now();
    assert_held(&client, CalicoApiGroup::CrdV1, &policy, "redis-0", &[ip], HoldTrigger::Eviction).await;
    let requests = |method: &Method, part: &str| {
        let calls: Vec<_> = proxy.requests().into_iter().filter(|(_, p)| !p.contains("watch=")).collect();
        let n = calls.iter().filter(|(m, p)| m == method && p.contains(part)).count();
        (n, calls)
    };
    let answered_held = || async {
        let before = held().unwrap_or(0.0);
        evict().await;
        assert!(held().unwrap_or(0.0) > before, "the repeated eviction was reviewed and answered held");
    };
    answered_held().await;
    let fast = appended_before.elapsed();
    let (reads, calls) = requests(&Method::GET, "/ipreservations/");
    if fast < Duration::from_secs(5) {
        assert_eq!(reads, 0, "answered from the append {fast:?} after it, no read: {calls:?}");
    }
    // Past 5 s the append is no answer any more: one read of the shard.
    tokio::time::sleep_until((appended_before + Duration::from_millis(5200)).into()).await;
    answered_held().await;
    let (reads_then, calls) = requests(&Method::GET, "/ipreservations/");
    assert_eq!(reads_then, reads + 1, "one confirming read of the shard for the later repeated review: {calls:?}");
    assert_eq!(requests(&Method::POST, "/reservedips").0, 1, "one record created: {calls:?}");
    assert_eq!(requests(&Method::PATCH, "/ipreservations/").0, 1, "one append, nothing patched again: {calls:?}");
    assert_eq!(requests(&Method::GET, "/reservedips/").0, 0, "the record never read: {calls:?}");
    drop(capo);
}

/// The ReservedIP CRD refuses records capo would never write, and any change to a
/// record's identity: a `cidr` wider than its address, a reservation that is not one of
/// its policy's, an unknown Calico group; `ip`, `cidr`, `policy` and the Pod cannot change
/// (only `reservation`, to another shard of the policy, and `manual`).
#[tokio::test]
async fn the_crd_refuses_records_capo_would_not_write_and_identity_changes() {
    let client = client().await;
    install_capo_crds(&client).await;
    let api = Api::<capo_api::ReservedIP>::all(client.clone());
    let ip = Ips::v4();
    let name = capo_api::reserved_ip::record_name(ip);
    let record = |cidr: String, reservation: &str, group: &str| -> capo_api::ReservedIP {
        serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP", "metadata": { "name": name },
            "spec": { "ip": ip.to_string(), "cidr": cidr, "reservation": reservation, "calicoApiGroup": group,
                      "policy": "crd-rules", "pod": { "namespace": "n", "name": "x", "uid": "u" }, "trigger": "Delete",
                      "reservedAt": "2026-01-01T00:00:00.000000Z", "reserveFor": "1h" },
        }))
        .unwrap()
    };
    let v1 = "crd.projectcalico.org/v1";
    for (bad, says) in [
        (record("10.0.0.0/8".into(), "capo-crd-rules", v1), "spec.cidr must be the one address"),
        (record(cidr(ip), "capo-someone-else", v1), "spec.reservation must be one of its policy's reservations"),
        (record(cidr(ip), "capo-crd-rules.0", v1), "spec.reservation must be one of its policy's reservations"),
        (record(cidr(ip), "capo-crd-rules", "example.com/v1"), "spec.calicoApiGroup must be"),
    ] {
        let e = api.create(&PostParams::default(), &bad).await.expect_err(says);
        assert!(e.to_string().contains(says), "{e}");
    }
    api.create(&PostParams::default(), &record(cidr(ip), "capo-crd-rules.7", v1)).await.expect("a record capo writes");
    let merge = |p: serde_json::Value| {
        let api = api.clone();
        let name = name.clone();
        async move { api.patch(&name, &PatchParams::default(), &Patch::Merge(p)).await }
    };
    for (change, field) in [
        (json!({ "spec": { "policy": "other" } }), "spec.policy cannot change"),
        (json!({ "spec": { "pod": { "uid": "v" } } }), "spec.pod.uid cannot change"),
        (json!({ "spec": { "calicoApiGroup": "projectcalico.org/v3" } }), "spec.calicoApiGroup cannot change"),
    ] {
        let e = merge(change).await.expect_err(field);
        assert!(e.to_string().contains(field), "{e}");
    }
    merge(json!({ "spec": { "reservation": "capo-crd-rules" } })).await.expect("moved to another shard of its policy");
    api.delete(&name, &DeleteParams::default()).await.unwrap();
}

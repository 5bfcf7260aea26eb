//! capo where Calico keeps its objects in native `projectcalico.org/v3` CRDs: Calico
//! 3.32's, the default of new 3.33 installs (`../shared/calico/projectcalico.org-v3`), with
//! no `crd.projectcalico.org/v1` CRDs and no calico-apiserver. Its own test binary: its
//! control plane starts without Calico, and gets only the native set.
//!
//! The invariant tests of the v1 datastore run here where native v3 can differ:
//! - what an entry may be: the v3 CRD validates `reservedCIDRs` (`format: cidr`, so a bare
//!   address is refused; `x-kubernetes-list-type: set`, so a duplicate is refused, and
//!   with it the whole write: every hold of a shared append);
//! - the object as stored: labels and annotations on the object itself (no
//!   `projectcalico.org/metadata` annotation, as calico-apiserver writes);
//! - concurrent and repeated reviews into one shard (where a duplicate would come from);
//! - releases on time, the cap's oldest first, and a next leader reading v3 back.
//!
//! Not proven here: that Calico's IPAM skips these addresses. The IPAM driver the project
//! builds is Calico's v3.28.5 library, whose Kubernetes backend reads
//! `crd.projectcalico.org/v1` only. It is proven for v1 (`calico_ipam`) and for the same
//! `projectcalico.org/v3` IPReservation type in Calico's etcd (`calico_etcd`).

mod support;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capo_api::CalicoApiGroup;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::json;
use support::calico::{calico_crd, resource, set_datastore_ready};
use support::leading::*;
use support::*;

const V3: CalicoApiGroup = CalicoApiGroup::V3;

/// Calico 3.32.1's native v3 CRDs: every one this directory has.
const NATIVE: [&str; 7] = [
    "projectcalico.org_blockaffinities.yaml",
    "projectcalico.org_clusterinformations.yaml",
    "projectcalico.org_ipamblocks.yaml",
    "projectcalico.org_ipamconfigurations.yaml",
    "projectcalico.org_ipamhandles.yaml",
    "projectcalico.org_ippools.yaml",
    "projectcalico.org_ipreservations.yaml",
];

/// Creates a v3 `kind` object `name` with `spec` (there already: left as it is).
async fn create_v3(client: &Client, kind: &str, plural: &str, name: &str, spec: serde_json::Value) {
    let api = Api::<DynamicObject>::all_with(client.clone(), &resource(V3, kind, plural));
    let mut obj = DynamicObject::new(name, &resource(V3, kind, plural));
    obj.data = json!({ "spec": spec });
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create {kind} {name}: {e}"),
    }
}

/// capo's CRDs, Calico's native v3 set (its datastore ready), the disabled pools the
/// tests' hand-made addresses come from (as the IPAM driver makes them on v1: every
/// address a test Pod has is in a Calico pool, as on a real cluster), and a namespace.
async fn setup_v3(prefix: &str) -> (Client, TestNamespace) {
    let client = client_without_calico().await;
    install_capo_crds(&client).await;
    for file in NATIVE {
        install_crd(&client, calico_crd("projectcalico.org-v3", file)).await;
    }
    set_datastore_ready(&client, V3, true).await;
    for (name, cidr) in [("capo-testenv-handmade-ipv4", "198.19.0.0/16"), ("capo-testenv-handmade-ipv6", "2001:2::/64")]
    {
        let spec = json!({
            "cidr": cidr, "disabled": true, "ipipMode": "Never", "vxlanMode": "Never",
            "nodeSelector": "!all()", "allowedUses": ["Workload"],
        });
        create_v3(&client, "IPPool", "ippools", name, spec).await;
    }
    let ns = TestNamespace::create(&client, prefix).await;
    (client, ns)
}

/// A leading capo on native v3 and the policy `<namespace>-p` with `spec`.
async fn scene_v3(prefix: &str, spec: serde_json::Value) -> Scene {
    let (client, ns) = setup_v3(prefix).await;
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    assert_eq!(capo.calico_api, V3, "only projectcalico.org/v3 serves IPReservations here");
    scene_with(client, ns, capo, spec).await
}

fn reservations(client: &Client) -> Api<DynamicObject> {
    Api::<DynamicObject>::all_with(client.clone(), &V3.ip_reservation())
}

/// The entries of `policy`'s shards in v3, as stored (unsorted, duplicates kept).
async fn stored_entries(client: &Client, policy: &str) -> Vec<String> {
    let lp = ListParams::default().labels(&format!("capo.io/policy={policy}"));
    reservations(client)
        .list(&lp)
        .await
        .expect("list v3 IPReservations")
        .items
        .iter()
        .flat_map(|o| o.data["spec"]["reservedCIDRs"].as_array().cloned().unwrap_or_default())
        .map(|v| v.as_str().expect("a string entry").to_string())
        .collect()
}

/// Each address: whether it was seen held, and when it was first seen gone after that.
type Seen = BTreeMap<IpAddr, (bool, Option<Instant>)>;

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

fn no_hold_failures(capo: &capo::App) {
    let text = capo.metrics.render();
    let failures: Vec<&str> = text.lines().filter(|l| l.starts_with("capo_hold_failures_total{")).collect();
    assert!(failures.is_empty(), "holds that could not be written: {failures:?}");
}

/// The CRD refuses what capo must never write, so every hold the API server took is an
/// entry Calico's schema accepts. A dual-stack Pod's two addresses are one `/32` and one
/// `/128` each, once, also when its deletion is reviewed twice; the shard carries capo's
/// labels on itself.
#[tokio::test]
async fn holds_in_native_v3_are_entries_its_schema_accepts_and_a_repeated_review_adds_none() {
    let (client, ns) = setup_v3("v3-hold").await;
    for (what, cidrs) in
        [("a bare address", json!(["192.0.2.1"])), ("a duplicate", json!(["192.0.2.1/32", "192.0.2.1/32"]))]
    {
        let mut obj = DynamicObject::new("capo-test-v3-schema", &V3.ip_reservation());
        obj.data = json!({ "spec": { "reservedCIDRs": cidrs } });
        let err = reservations(&client).create(&PostParams::default(), &obj).await.expect_err(what);
        assert!(matches!(&err, kube::Error::Api(s) if s.code == 422), "{what}: refused as invalid, got {err}");
    }
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    assert_eq!(capo.calico_api, V3, "only projectcalico.org/v3 serves IPReservations here");
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" });
    let Scene { client, ns, capo, policy } = scene_with(client, ns, capo, spec).await;

    // Kept by a finalizer (no node: the Pod garbage collector ends it within 20 s if the
    // test does not), so the second DELETE is reviewed too.
    let (v4, v6) = (Ips::v4(), Ips::v6());
    let mut pod = unscheduled_pod("redis-0", &[("app", "redis")], &[]);
    pod.metadata.finalizers = Some(vec!["capo.test/keep".into()]);
    create_pod_with_ips(&client, &ns.name, pod, &[v4, v6]).await;
    for review in 1..=2 {
        delete_pod(&client, &ns.name, "redis-0").await.unwrap_or_else(|e| panic!("review {review}: refused: {e}"));
        let stored = stored_entries(&client, &policy).await;
        assert_eq!(sorted(stored.clone()), sorted(vec![cidr(v4), cidr(v6)]), "review {review}: each address once");
    }
    assert!(cidr(v4).ends_with("/32") && cidr(v6).ends_with("/128"));
    let lp = ListParams::default().labels(&format!("capo.io/policy={policy}"));
    let shards = reservations(&client).list(&lp).await.expect("list v3 IPReservations").items;
    assert_eq!(shards.len(), 1, "one shard");
    let annotations = shards[0].metadata.annotations.clone().unwrap_or_default();
    assert!(
        !annotations.contains_key("projectcalico.org/metadata"),
        "labels on the object itself, not in calico-apiserver's annotation: {annotations:?}"
    );
    no_hold_failures(&capo);
    let_go(&client, &ns.name, "redis-0").await;
}

/// Deletions of 30 Pods at once, each reviewed twice at once (a client retrying), into one
/// shard: every one is allowed with its address held, each address once. One duplicate in
/// a shared append would have the API server refuse the write, and every hold with it.
#[tokio::test]
async fn a_storm_into_one_native_v3_shard_loses_no_hold_and_writes_no_duplicate() {
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" });
    let Scene { client, ns, capo, policy } = scene_v3("v3-storm", spec).await;
    let mut ips = Vec::new();
    for i in 0..30 {
        let mut pod = unscheduled_pod(&format!("redis-{i}"), &[("app", "redis")], &[]);
        pod.metadata.finalizers = Some(vec!["capo.test/keep".into()]);
        let ip = Ips::v4();
        create_pod_with_ips(&client, &ns.name, pod, &[ip]).await;
        ips.push(ip);
    }
    let mut deletions = tokio::task::JoinSet::new();
    for i in 0..30 {
        for _ in 0..2 {
            let (client, ns) = (client.clone(), ns.name.clone());
            deletions.spawn(async move {
                let name = format!("redis-{i}");
                delete_pod(&client, &ns, &name).await.map_err(|e| format!("{name}: {e}"))
            });
        }
    }
    let refused: Vec<String> = deletions.join_all().await.into_iter().filter_map(Result::err).collect();
    assert!(refused.is_empty(), "deletions refused: {refused:?}");
    let stored = stored_entries(&client, &policy).await;
    assert_eq!(sorted(stored), sorted(ips.iter().map(|&ip| cidr(ip)).collect()), "every address held, once");
    no_hold_failures(&capo);
    for i in 0..30 {
        let_go(&client, &ns.name, &format!("redis-{i}")).await;
    }
}

/// Releases from native v3: at the cap the two oldest go at once; the leader then gives
/// up the Lease (a rolling update) and the next one, reading v3 back, releases the other
/// two when their `reserveFor` has run from their deletion, neither before nor long after.
#[tokio::test]
async fn native_v3_holds_leave_oldest_first_at_the_cap_and_on_time_under_the_next_leader() {
    let reserve = Duration::from_secs(8);
    let spec = json!({
        "podSelector": { "matchLabels": { "app": "redis" } },
        "reserveFor": "8s", "maxReserved": 2, "releaseInterval": "100ms",
    });
    let Scene { client, ns, capo: a, policy } = scene_v3("v3-release", spec).await;
    let mut ips = Vec::new();
    for i in 0..4 {
        ips.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
    }
    // When each address was first seen gone from v3, once it had been seen held there.
    let left: Arc<Mutex<Seen>> = Arc::new(Mutex::new(ips.iter().map(|&ip| (ip, (false, None))).collect()));
    let monitor = {
        let (client, policy, left) = (client.clone(), policy.clone(), left.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(list) =
                    reservations(&client).list(&ListParams::default().labels(&format!("capo.io/policy={policy}"))).await
                {
                    let now: Vec<String> = list
                        .items
                        .iter()
                        .flat_map(|o| o.data["spec"]["reservedCIDRs"].as_array().cloned().unwrap_or_default())
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect();
                    for (ip, (seen, gone)) in left.lock().unwrap().iter_mut() {
                        match (now.contains(&cidr(*ip)), *seen) {
                            (true, _) => *seen = true,
                            (false, true) if gone.is_none() => *gone = Some(Instant::now()),
                            _ => {}
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut deleted = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        delete_pod(&client, &ns.name, &format!("redis-{i}")).await.expect("held and allowed");
        deleted.push(Instant::now());
        assert!(policy_entries(&client, V3, &policy).await.contains(&cidr(*ip)), "held in v3 when allowed");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for &ip in &ips[..2] {
        wait_released(&client, ip, Duration::from_secs(15)).await;
    }
    let held = policy_entries(&client, V3, &policy).await;
    assert_eq!(sorted(held), sorted(ips[2..].iter().map(|&ip| cidr(ip)).collect()), "the two newest stay");
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(wait_metric(&a, &cap, 2.0).await, 2.0);

    a.shutdown().await;
    let b = start_leading(&client, &ns.name, "b", Duration::from_secs(600)).await;
    assert_eq!(b.calico_api, V3);
    wait_leader(&b).await;
    for &ip in &ips[2..] {
        wait_released(&client, ip, reserve + Duration::from_secs(15)).await;
    }
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&b, &ttl, 2.0).await, 2.0, "the next leader released the two by their TTL");
    eventually("both gone from v3", Duration::from_secs(10), || async {
        let left = left.lock().unwrap();
        ips[2..].iter().all(|ip| left[ip].1.is_some()).then_some(())
    })
    .await;
    monitor.abort();
    let left = left.lock().unwrap().clone();
    for (i, ip) in ips.iter().enumerate().skip(2) {
        let after = left[ip].1.expect("gone") - deleted[i];
        eprintln!("{ip} left v3 {after:?} after its deletion");
        assert!(after >= reserve, "{ip} left {after:?} after its deletion, before reserveFor ({reserve:?})");
        assert!(after <= reserve + Duration::from_secs(4), "{ip} left {after:?} after its deletion: late");
    }
    assert!(stored_entries(&client, &policy).await.is_empty(), "nothing left behind");
}

/// A KubeVirt VM's address as Calico 3.32+ keeps it (`kubeVirtVMAddressPersistence`, on by
/// default): its launcher Pod's CNI DEL leaves the address allocated to the VM's handle
/// (`k8s-pod-network.vmi.<namespace>.<vm>`) with the VMI's attributes (`vmi-name`,
/// `vmi-uid`, `vm-uid`; the launcher's `pod` cleared). The launcher Pod's deletion, under
/// a policy selecting every Pod, is allowed with no hold; a plain Pod's address in the
/// same pool is held. The pool guard counts the VM's address once, as Calico's: of the
/// pool's 16 addresses, one allocated (the VM), one held (the plain Pod), 14 free.
#[tokio::test]
async fn a_vms_persisted_address_is_neither_held_nor_counted_twice_by_the_pool_guard() {
    let spec = json!({ "podSelector": {}, "reserveFor": "1h" });
    let Scene { client, ns, capo, policy } = scene_v3("v3-vm", spec).await;
    let pool = format!("{}-vms", ns.name);
    let pool_spec = json!({
        "cidr": "10.250.0.0/28", "blockSize": 28, "ipipMode": "Never", "vxlanMode": "Never",
        "natOutgoing": true, "nodeSelector": "all()", "allowedUses": ["Workload", "Tunnel"],
    });
    create_v3(&client, "IPPool", "ippools", &pool, pool_spec).await;
    // The VM's address is ordinal 2 (10.250.0.2); every other address is free.
    let mut allocations = vec![serde_json::Value::Null; 16];
    allocations[2] = json!(0);
    let unallocated: Vec<u32> = (0..16).filter(|o| *o != 2).collect();
    let block = json!({
        "cidr": "10.250.0.0/28", "affinity": "host:kwok-node-0", "strictAffinity": false,
        "allocations": allocations, "unallocated": unallocated, "sequenceNumber": 3,
        "attributes": [{
            "handle_id": format!("k8s-pod-network.vmi.{}.vm1", ns.name),
            "secondary": {
                "namespace": ns.name, "node": "kwok-node-0", "timestamp": "2026-12-07 10:00:00 +0000 UTC",
                "vmi-name": "vm1", "vmi-uid": "5f0c1e9a-0000-4000-8000-00000000a001",
                "vm-uid": "5f0c1e9a-0000-4000-8000-00000000b001",
            },
        }],
    });
    create_v3(&client, "IPAMBlock", "ipamblocks", "10-250-0-0-28", block).await;
    let (vm_ip, plain_ip): (IpAddr, IpAddr) = ("10.250.0.2".parse().unwrap(), "10.250.0.5".parse().unwrap());
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
    let entries = policy_entries(&client, V3, &policy).await;
    assert_eq!(entries, vec![cidr(plain_ip)], "the plain Pod's address held, the VM's not");
    assert!(record(&client, vm_ip).await.is_none(), "no hold for the VM's address");
    let gauge = |name: &str| metric_value(&capo, &format!("{name}{{pool=\"{pool}\"}}"));
    let seen = eventually("the pool guard to count the pool", Duration::from_secs(20), || async {
        let seen = (gauge("capo_pool_addresses"), gauge("capo_pool_held_ips"), gauge("capo_pool_free_addresses"));
        (seen.1 == Some(1.0)).then_some(seen)
    })
    .await;
    assert_eq!(seen, (Some(16.0), Some(1.0), Some(14.0)), "(addresses, held, free): the VM's address counted once");
}

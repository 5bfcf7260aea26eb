//! The pool guard against Calico's own IPAM: a /26 pool that Pods fill while capo holds
//! addresses in it. capo never lets its holds starve the pool: past a policy's
//! `maxPoolShare` or the global `--max-pool-share` of the pool's unallocated addresses,
//! the oldest holds in that pool go first, and deletions are never refused for it.

mod support;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::calico::kwok_node;
use support::leading::*;
use support::*;

const POOL: &str = "capo-test-pool-guard";
const POOL_CIDR: &str = "192.0.2.0/26";

fn ip_pools() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("crd.projectcalico.org", "v1", "IPPool"), "ippools")
}

/// A /26 pool no node selects: only Pods that ask for it by annotation get its addresses.
async fn create_small_pool(client: &Client) {
    let api = Api::<DynamicObject>::all_with(client.clone(), &ip_pools());
    let _ = api.delete(POOL, &DeleteParams::default()).await;
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crd.projectcalico.org/v1",
        "kind": "IPPool",
        "metadata": { "name": POOL },
        "spec": {
            "cidr": POOL_CIDR, "blockSize": 28, "nodeSelector": "!all()",
            "ipipMode": "Never", "vxlanMode": "Never", "allowedUses": ["Workload", "Tunnel"],
        },
    }))
    .unwrap();
    api.create(&PostParams::default(), &pool).await.expect("create the /26 IPPool");
}

/// Creates Pods `<app>-<i>` on `node`, their addresses from the small pool (Calico's CNI
/// annotation), and waits until each has one.
async fn pods_in_pool(client: &Client, ns: &str, node: &str, app: &str, range: std::ops::Range<usize>) -> Vec<IpAddr> {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    for i in range.clone() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": format!("{app}-{i}"), "labels": { "app": app },
                          "annotations": { "cni.projectcalico.org/ipv4pools": format!("[\"{POOL}\"]") } },
            "spec": { "nodeName": node, "containers": [{ "name": "app", "image": "registry.invalid/app:1" }],
                      "tolerations": [{ "operator": "Exists" }] },
        }))
        .unwrap();
        api.create(&PostParams::default(), &pod).await.expect("create pod");
    }
    let net: IpNet = POOL_CIDR.parse().unwrap();
    let mut ips = Vec::new();
    for i in range {
        let name = format!("{app}-{i}");
        let ip = eventually(&format!("{ns}/{name} has an address of {POOL_CIDR}"), Duration::from_secs(120), || {
            let api = api.clone();
            let name = name.clone();
            async move { pod_ips(&api.get(&name).await.ok()?).first().copied() }
        })
        .await;
        assert!(net.contains(&ip), "{name} got {ip}, outside {POOL_CIDR}");
        ips.push(ip);
    }
    ips
}

/// Deletes `<app>-<i>` (each deletion allowed, its IP held when it returns).
async fn delete_pods(client: &Client, ns: &str, app: &str, range: std::ops::Range<usize>, ips: &[IpAddr]) {
    for i in range {
        delete_pod(client, ns, &format!("{app}-{i}")).await.expect("the deletion is allowed");
        assert!(record(client, ips[i]).await.is_some(), "{app}-{i}'s {} is held", ips[i]);
    }
}

/// The addresses still held (records) among `ips`.
async fn held(client: &Client, ips: &[IpAddr]) -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    for &ip in ips {
        if record(client, ip).await.is_some() {
            out.insert(ip);
        }
    }
    out
}

/// Waits until exactly `want` of `ips` are held.
async fn wait_held(client: &Client, what: &str, ips: &[IpAddr], want: &[IpAddr]) {
    let want: BTreeSet<IpAddr> = want.iter().copied().collect();
    eventually(what, Duration::from_secs(60), || {
        let want = want.clone();
        async move { (held(client, ips).await == want).then_some(()) }
    })
    .await;
}

/// Pods of the pool that have no address (yet).
async fn without_address(client: &Client, ns: &str) -> Vec<String> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns).list(&ListParams::default()).await.unwrap();
    pods.items.iter().filter(|p| pod_ips(p).is_empty()).map(|p| p.name_any()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capo_never_starves_a_small_pool_that_calico_fills() {
    let (client, ns) = setup("pool-guard").await;
    create_small_pool(&client).await;
    let node = format!("pool-guard-{}", std::process::id());
    kwok_node(&client, &node).await;
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    let redis = format!("{}-redis", ns.name);
    let kafka = format!("{}-kafka", ns.name);
    let common = json!({ "reserveFor": "1h", "maxReserved": 100, "releaseInterval": "1s" });
    let mut spec = common.clone();
    spec["podSelector"] = json!({ "matchLabels": { "app": "redis" } });
    apply_policy(&client, &redis, &ns.name, spec).await;
    let mut spec = common;
    spec["podSelector"] = json!({ "matchLabels": { "app": "kafka" } });
    spec["maxPoolShare"] = json!(10);
    apply_policy(&client, &kafka, &ns.name, spec).await;

    let r = pods_in_pool(&client, &ns.name, &node, "redis", 0..20).await;
    let k = pods_in_pool(&client, &ns.name, &node, "kafka", 0..8).await;
    let all: Vec<IpAddr> = r.iter().chain(&k).copied().collect();

    // 1. kafka's own bound. 12 redis and 6 kafka Pods go: 10 Pods keep their addresses,
    // 54 are unallocated, capo holds 18 of them. kafka may hold 10% of 54 = 5: its
    // oldest goes; the global 50% (27) leaves the rest.
    delete_pods(&client, &ns.name, "redis", 0..12, &r).await;
    delete_pods(&client, &ns.name, "kafka", 0..6, &k).await;
    let mut want: Vec<IpAddr> = r[0..12].iter().chain(&k[1..6]).copied().collect();
    wait_held(&client, "kafka's oldest hold released by its maxPoolShare", &all, &want).await;
    let pool_metric = |name: &str| format!("capo_{name}{{pool=\"{POOL}\"}}");
    eventually("the pool's gauges", Duration::from_secs(20), || async {
        let size = metric_value(&capo, &pool_metric("pool_addresses"))?;
        let held = metric_value(&capo, &pool_metric("pool_held_ips"))?;
        let free = metric_value(&capo, &pool_metric("pool_free_addresses"))?;
        (size == 64.0 && held == 17.0 && free == 64.0 - 10.0 - 17.0).then_some(())
    })
    .await;
    let note = wait_event(&client, "default", &kafka, "PoolShareReached").await;
    assert!(note.contains(POOL) && note.contains("maxPoolShare=10%"), "{note}");
    let (code, out, err) = capo_cli(&["policies"]).await;
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with(&kafka)).unwrap_or_default();
    assert!(line.contains("10%") && line.contains(&format!("{POOL} 10% (5/54)")), "{out}");

    // 2. Pods fill the pool: 28 more take addresses (38 allocated, 26 unallocated). kafka
    // may keep 10% of 26 = 2 (its three oldest go); all may keep 50% = 13, so of the 12
    // redis holds and 2 kafka holds the oldest, redis-0, goes too.
    let f = pods_in_pool(&client, &ns.name, &node, "filler", 0..28).await;
    want = r[1..12].iter().chain(&k[4..6]).copied().collect();
    wait_held(&client, "the oldest holds released as the pool fills", &all, &want).await;
    let pool_releases = |policy: &str| format!("capo_releases_total{{policy=\"{policy}\",reason=\"pool\"}}");
    assert_eq!(wait_metric(&capo, &pool_releases(&kafka), 4.0).await, 4.0);
    assert_eq!(wait_metric(&capo, &pool_releases(&redis), 1.0).await, 1.0);

    // 3. More Pods than addresses are free: 13 are free, 20 Pods come. Without the guard
    // seven would get no address while capo holds 13; with it, capo lets go of its oldest
    // holds as the pool fills, and every Pod gets an address.
    let g = pods_in_pool(&client, &ns.name, &node, "late", 0..20).await;
    assert!(without_address(&client, &ns.name).await.is_empty());
    let taken: BTreeSet<IpAddr> = f.iter().chain(&g).chain(&r[12..]).chain(&k[6..]).copied().collect();
    assert_eq!(taken.len(), 20 + 28 + 8 + 2, "no address handed out twice");
    // 58 allocated, 6 unallocated: capo comes down to at most 3 (and kafka to none).
    let left = eventually("capo down to 50% of the 6 unallocated addresses", Duration::from_secs(30), || async {
        let left = held(&client, &all).await;
        (left.len() <= 3).then_some(left)
    })
    .await;
    assert!(left.iter().all(|ip| !taken.contains(ip)), "no held address was handed out");
    assert!(k.iter().all(|ip| !left.contains(ip)), "kafka holds nothing of 6 unallocated at 10%");

    for app in ["redis", "kafka", "filler", "late"] {
        let _ = Api::<Pod>::namespaced(client.clone(), &ns.name)
            .delete_collection(&DeleteParams::default(), &ListParams::default().labels(&format!("app={app}")))
            .await;
    }
}

/// Issue 24, defect 7, against a real API server: an address in Calico's IP cooldown
/// (Calico 3.33's `ipCooldownSeconds`: released, its allocation kept with `releasedAt` until
/// the cooldown ends) is free for the pool guard, not taken by a Pod. The test's Calico
/// (3.28.5) has no cooldown and its IPAMBlock CRD would prune `releasedAt`, so the CRD
/// gets the field as Calico's newer CRD has it, and the block is written as a 3.33 IPAM
/// leaves it: a /28 whose 16 addresses are all allocated, two of them cooling — the two
/// capo holds. Of 2 unused addresses capo may hold 50%: the older hold goes. On the code
/// before, the two cooling addresses counted as taken by Pods and nothing was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_in_calicos_ip_cooldown_count_as_free_for_the_pool_guard() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Patch, PatchParams};

    const COOL_POOL: &str = "capo-test-cooldown";
    const COOL_CIDR: &str = "192.0.2.64/28";
    let (client, ns) = setup("pool-cool").await;
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let released_at = json!([{ "op": "add",
        "path": "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/attributes/items/properties/releasedAt",
        "value": { "type": "string", "format": "date-time" } }]);
    let patch: json_patch::Patch = serde_json::from_value(released_at).unwrap();
    crds.patch("ipamblocks.crd.projectcalico.org", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .expect("IPAMBlock's CRD with releasedAt");
    let pools = Api::<DynamicObject>::all_with(client.clone(), &ip_pools());
    let _ = pools.delete(COOL_POOL, &DeleteParams::default()).await;
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPPool", "metadata": { "name": COOL_POOL },
        "spec": { "cidr": COOL_CIDR, "blockSize": 28, "nodeSelector": "!all()",
                  "ipipMode": "Never", "vxlanMode": "Never", "allowedUses": ["Workload"] },
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.expect("create the /28 IPPool");
    let blocks = Api::<DynamicObject>::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("crd.projectcalico.org", "v1", "IPAMBlock"),
            "ipamblocks",
        ),
    );
    // Ordinals 0-13 belong to live Pods (attribute 0), 14 and 15 cool (attribute 1).
    let mut allocations: Vec<u32> = vec![0; 14];
    allocations.extend([1, 1]);
    let block_name = "192-0-2-64-28";
    let cooling = k8s_openapi::jiff::Timestamp::now().to_string();
    let block = json!({
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPAMBlock", "metadata": { "name": block_name },
        "spec": { "cidr": COOL_CIDR, "affinity": "host:capo-test-nowhere", "strictAffinity": false,
                  "allocations": allocations, "unallocated": [],
                  "attributes": [ { "handle_id": "k8s-pod-network.live" },
                                  { "handle_id": "k8s-pod-network.gone", "releasedAt": cooling } ] },
    });
    // The CRD's new schema reaches the API server's decoder a moment after the patch.
    eventually("the block written with its cooling allocations", Duration::from_secs(30), || {
        let (blocks, block) = (blocks.clone(), block.clone());
        async move {
            let _ = blocks.delete(block_name, &DeleteParams::default()).await;
            let obj: DynamicObject = serde_json::from_value(block).unwrap();
            let written = blocks.create(&PostParams::default(), &obj).await.ok()?;
            written.data["spec"]["attributes"][1].get("releasedAt").is_some().then_some(())
        }
    })
    .await;

    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    let policy = format!("{}-redis", ns.name);
    let spec =
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "releaseInterval": "1s" });
    apply_policy(&client, &policy, &ns.name, spec).await;
    let ips: Vec<IpAddr> = ["192.0.2.78", "192.0.2.79"].iter().map(|s| s.parse().unwrap()).collect();
    for (i, ip) in ips.iter().enumerate() {
        let name = format!("redis-{i}");
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(&name, &[("app", "redis")], &[]), &[*ip]).await;
        delete_pod(&client, &ns.name, &name).await.expect("the deletion is allowed");
        let c = &client;
        eventually(&format!("{name}'s {ip} held"), Duration::from_secs(10), || async move {
            record(c, *ip).await.map(|_| ())
        })
        .await;
    }
    // 16 addresses, 14 taken by Pods, 2 unused (the cooling ones), both held: 50% of 2 is 1.
    wait_held(&client, "the older hold released by the pool guard", &ips, &ips[1..]).await;
    let releases = format!("capo_releases_total{{policy=\"{policy}\",reason=\"pool\"}}");
    assert_eq!(wait_metric(&capo, &releases, 1.0).await, 1.0);
    let gauge = |name: &str| format!("capo_{name}{{pool=\"{COOL_POOL}\"}}");
    eventually("the pool's gauges count the cooling addresses as free", Duration::from_secs(20), || async {
        let size = metric_value(&capo, &gauge("pool_addresses"))?;
        let held = metric_value(&capo, &gauge("pool_held_ips"))?;
        let free = metric_value(&capo, &gauge("pool_free_addresses"))?;
        (size == 16.0 && held == 1.0 && free == 1.0).then_some(())
    })
    .await;
    assert!(held(&client, &ips).await.contains(&ips[1]), "the newer hold stays");
    let _ = blocks.delete(block_name, &DeleteParams::default()).await;
    let _ = pools.delete(COOL_POOL, &DeleteParams::default()).await;
}

//! Sticky IPs (issue 26) against a real API server, Calico's own IPAM (the driver does
//! what Calico's CNI plugin does with `cni.projectcalico.org/ipAddrs`: `AssignIP` with the
//! Pod's handle, the same errors, retried) and kube-controller-manager's StatefulSet
//! controller: a StatefulSet Pod deleted and created again gets its held addresses back,
//! and the hold ends; a force-deleted Pod, a policy without `sticky` and an address
//! another handle owns do not.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use capo_api::keys::{CALICO_IP_ADDRS_ANNOTATION, STICKY_CLAIM_ANNOTATION};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::calico::{driver_ok, kwok_node};
use support::leading::*;
use support::*;

/// A StatefulSet `name` of one Pod on `node`, its Pods annotated with `annotations`.
fn statefulset(name: &str, node: &str, annotations: serde_json::Value) -> StatefulSet {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": 1, "serviceName": name, "podManagementPolicy": "Parallel",
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name }, "annotations": annotations },
                "spec": {
                    "nodeSelector": { "kubernetes.io/hostname": node },
                    "tolerations": [{ "operator": "Exists" }],
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{ "name": "app", "image": "registry.invalid/app:1" }],
                },
            },
        },
    }))
    .unwrap()
}

/// The test's namespace, kwok node, leading capo and policy `<ns>-p` over `app` Pods.
async fn scene(prefix: &str, sticky: serde_json::Value) -> (Client, TestNamespace, capo::App, String, String) {
    let (client, ns) = setup(prefix).await;
    let node = format!("{prefix}-{}", std::process::id());
    kwok_node(&client, &node).await;
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    let policy = format!("{}-p", ns.name);
    let spec = json!({ "podSelector": {}, "reserveFor": "1h", "releaseInterval": "1s", "sticky": sticky });
    apply_policy(&client, &policy, &ns.name, spec).await;
    (client, ns, capo, policy, node)
}

/// The Pod `name` once it is not `old_uid` and has addresses.
async fn recreated(client: &Client, ns: &str, name: &str, old_uid: &str) -> Pod {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    eventually(&format!("{name} recreated with addresses"), Duration::from_secs(90), || {
        let pods = pods.clone();
        async move {
            let p = pods.get_opt(name).await.ok()??;
            (p.uid().as_deref() != Some(old_uid) && !pod_ips(&p).is_empty()).then_some(p)
        }
    })
    .await
}

/// Pod annotations: dual-stack (the driver's family annotation).
fn dual_stack() -> serde_json::Value {
    json!({ "capo-test/ip-families": "v4,v6" })
}

async fn start_statefulset(client: &Client, ns: &str, name: &str, node: &str, annotations: serde_json::Value) -> Pod {
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &statefulset(name, node, annotations))
        .await
        .unwrap();
    wait_running(client, ns, &format!("{name}-0")).await
}

async fn wait_held(client: &Client, ips: &[IpAddr]) {
    for ip in ips {
        eventually(&format!("{ip} held"), Duration::from_secs(20), || async move { record(client, *ip).await }).await;
    }
}

/// Scales StatefulSet `name` to zero: its Pod is deleted (and `ip` held) and not created
/// again yet.
async fn scale_to_zero(client: &Client, ns: &str, name: &str, ip: IpAddr) {
    let sts = Api::<StatefulSet>::namespaced(client.clone(), ns);
    sts.patch(name, &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 0 } }))).await.unwrap();
    wait_held(client, &[ip]).await;
    let pod = format!("{name}-0");
    eventually(&format!("{pod} gone"), Duration::from_secs(30), || async {
        Api::<Pod>::namespaced(client.clone(), ns).get_opt(&pod).await.ok()?.is_none().then_some(())
    })
    .await;
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

/// Points 1–3 and 5: a dual-stack StatefulSet Pod deleted (gracefully) comes back with
/// both its addresses; the webhook claimed both holds before answering; once the new Pod
/// shows them the holds end (reason `sticky`), entries and records gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_statefulset_pod_gets_its_held_addresses_back() {
    let (client, ns, capo, policy, node) = scene("sticky-back", json!({ "enabled": true })).await;
    let old = start_statefulset(&client, &ns.name, "redis", &node, dual_stack()).await;
    let ips = pod_ips(&old);
    assert_eq!(ips.len(), 2, "dual-stack: {ips:?}");

    delete_pod(&client, &ns.name, "redis-0").await.unwrap();
    let new = recreated(&client, &ns.name, "redis-0", &old.uid().unwrap()).await;
    let mut got = pod_ips(&new);
    got.sort();
    let mut want = ips.clone();
    want.sort();
    assert_eq!(got, want, "the recreated Pod has its old addresses back");
    let named = annotation(&new, CALICO_IP_ADDRS_ANNOTATION).expect("capo named the addresses");
    assert_eq!(named, format!("[\"{}\",\"{}\"]", ips[0], ips[1]), "IPv4 first, as Calico reads it");
    assert_eq!(annotation(&new, STICKY_CLAIM_ANNOTATION), Some(named), "marked as capo's own");

    for ip in &ips {
        wait_released(&client, *ip, Duration::from_secs(30)).await;
    }
    assert!(entries(&client, &policy).await.is_empty(), "the holds ended: no entry left");
    let sticky = format!("capo_releases_total{{policy=\"{policy}\",reason=\"sticky\"}}");
    assert_eq!(wait_metric(&capo, &sticky, 2.0).await, 2.0);
    let claimed = format!("capo_sticky_claims_total{{outcome=\"claimed\",policy=\"{policy}\"}}");
    assert_eq!(metric_value(&capo, &claimed), Some(1.0), "one claim, for both addresses");

    // Deleted again: held again, and back again (a hold that ended sticky is no obstacle).
    delete_pod(&client, &ns.name, "redis-0").await.unwrap();
    let third = recreated(&client, &ns.name, "redis-0", &new.uid().unwrap()).await;
    let mut got = pod_ips(&third);
    got.sort();
    assert_eq!(got, want, "back a second time");
    capo.shutdown().await;
}

/// Point 2: a force deletion (grace 0) is held, and its address is not handed back: the
/// old Pod's containers may still run with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_deleted_pods_address_is_held_and_not_handed_back() {
    let (client, ns, capo, policy, node) = scene("sticky-force", json!({ "enabled": true })).await;
    let old = start_statefulset(&client, &ns.name, "zk", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    let force = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    Api::<Pod>::namespaced(client.clone(), &ns.name).delete("zk-0", &force).await.unwrap();
    let new = recreated(&client, &ns.name, "zk-0", &old.uid().unwrap()).await;
    assert_ne!(pod_ips(&new)[0], x, "a new address");
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None);
    let rec = record(&client, x).await.expect("the old address stays held");
    assert!(rec.spec.forced, "the record says the deletion was forced");
    assert!(rec.claim().is_none(), "and nobody claimed it");
    let (code, out, err) = capo_cli(&["holds"]).await;
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with(&format!("{x} "))).unwrap_or_default();
    assert!(line.trim_end().ends_with("no (forced deletion)"), "capo holds says why:\n{out}");
    let passed = format!("capo_sticky_claims_total{{outcome=\"forced_deletion\",policy=\"{policy}\"}}");
    // Each CREATE the StatefulSet controller sends is reviewed, also one the API server then
    // refuses because its cache still showed the old Pod's name taken (seen: 2 on 1.35).
    assert!(wait_metric(&capo, &passed, 1.0).await >= 1.0);
    capo.shutdown().await;
}

/// Point 5, policy off: behaviour unchanged (a new address, the old one held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sticky_a_recreated_pod_gets_a_new_address() {
    let (client, ns, capo, policy, node) = scene("sticky-off", json!({ "enabled": false })).await;
    let old = start_statefulset(&client, &ns.name, "kafka", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    delete_pod(&client, &ns.name, "kafka-0").await.unwrap();
    let new = recreated(&client, &ns.name, "kafka-0", &old.uid().unwrap()).await;
    assert_ne!(pod_ips(&new)[0], x);
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None);
    assert!(record(&client, x).await.is_some_and(|r| r.claim().is_none()), "held as before, unclaimed");
    // Both CREATEs (the first and the recreation) answered from memory: no sticky policy
    // selects the Pod (or none exists at all, when no other test of this binary runs).
    let outcome = |o: &str| format!("capo_sticky_claims_total{{outcome=\"{o}\",policy=\"\"}}");
    let passed = eventually("the CREATE answered from memory", Duration::from_secs(10), || async {
        let n = metric_value(&capo, &outcome("not_selected")).unwrap_or(0.0)
            + metric_value(&capo, &outcome("no_sticky_policy")).unwrap_or(0.0);
        (n >= 2.0).then_some(n)
    })
    .await;
    assert_eq!(passed, 2.0);
    let read = format!("capo_sticky_claims_total{{outcome=\"policy_not_sticky\",policy=\"{policy}\"}}");
    assert_eq!(metric_value(&capo, &read), None, "no read of the holds");
    capo.shutdown().await;
}

/// Point 3, the fallback: the held address is assigned to another IPAM handle meanwhile
/// (as when the old Pod's CNI DEL has not run). Calico refuses it to the recreated Pod,
/// which retries; past `fallbackAfter` capo takes the addresses back, the Pod gets a new
/// one, the old one stays held (the claim noted as fallen back) and an Event says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_another_handle_owns_falls_back_to_a_new_one_and_stays_held() {
    let (client, ns, capo, policy, node) =
        scene("sticky-fallback", json!({ "enabled": true, "fallbackAfter": "5s" })).await;
    let old = start_statefulset(&client, &ns.name, "etcd", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    // Scaled to zero: the Pod is deleted (and held) and not created again yet.
    let sts = Api::<StatefulSet>::namespaced(client.clone(), &ns.name);
    scale_to_zero(&client, &ns.name, "etcd", x).await;
    let scale = |n: i32| json!({ "spec": { "replicas": n } });
    let handle = format!("sticky-test-{}", std::process::id());
    let kc = capo_testenv::shared().kubeconfig.clone();
    let list = format!("[\"{x}\"]");
    driver_ok(&kc, &["assign", "--host", &node, "--handle", &handle, "--ip", &list], &[]).await;

    // A dry run of the Pod's creation claims nothing (invariant 5).
    let owner = sts.get("etcd").await.unwrap();
    let dry: Pod = serde_json::from_value(json!({
        "metadata": { "name": "etcd-0", "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "StatefulSet",
            "name": "etcd", "uid": owner.uid().unwrap(), "controller": true }] },
        "spec": { "containers": [{ "name": "app", "image": "registry.invalid/app:1" }] },
    }))
    .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let answered = pods.create(&PostParams { dry_run: true, ..Default::default() }, &dry).await.unwrap();
    assert_eq!(annotation(&answered, CALICO_IP_ADDRS_ANNOTATION), None, "nothing handed back to a dry run");
    assert!(record(&client, x).await.is_some_and(|r| r.claim().is_none()), "no claim written by a dry run");
    let dry_runs = "capo_admission_requests_total{operation=\"create\",outcome=\"dry_run\"}";
    assert_eq!(metric_value(&capo, dry_runs), Some(1.0), "capo saw the dry run");

    sts.patch("etcd", &PatchParams::default(), &Patch::Merge(scale(1))).await.unwrap();
    let new = recreated(&client, &ns.name, "etcd-0", &old.uid().unwrap()).await;
    let y = pod_ips(&new)[0];
    assert_ne!(y, x, "Calico refused {x} (another handle owns it); after the fallback the Pod got {y}");
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None, "capo took its addresses back");
    assert_eq!(annotation(&new, STICKY_CLAIM_ANNOTATION), None);
    let rec = record(&client, x).await.expect("the old address stays held");
    let claim = rec.claim().expect("the claim is kept");
    let fell = claim.fell_back_at.as_ref().expect("noted as fallen back").0;
    assert!(fell >= claim.until.0, "no sooner than fallbackAfter after the claim: {claim:?}");
    let note = wait_event(&client, &ns.name, "etcd-0", "StickyFellBack").await;
    assert!(note.contains(&x.to_string()) && note.contains("stays held"), "{note}");
    let fallbacks = format!("capo_sticky_fallbacks_total{{policy=\"{policy}\",reason=\"not_shown\"}}");
    assert_eq!(wait_metric(&capo, &fallbacks, 1.0).await, 1.0);
    assert!(entries(&client, &policy).await.contains(&cidr(x)), "{x} still in the reservation");
    let (code, out, err) = capo_cli(&["holds"]).await;
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with(&format!("{x} "))).unwrap_or_default();
    assert!(
        line.trim_end().ends_with("fell back (not shown in time)"),
        "capo holds shows the claim fell back, and why:\n{out}"
    );
    support::calico::release(&kc, &handle, &[]).await;
    capo.shutdown().await;
}

const POOL: &str = "capo-test-sticky";
const POOL_CIDR: &str = "192.0.2.128/26";

/// Creates (anew) IP pool `name` of `cidr`, for Pods of any node, that only Pods naming it
/// (`cni.projectcalico.org/ipv4pools`) get addresses from (`nodeSelector: "!all()"`): no
/// other test's Pod takes one, and its deletion at the end strands nobody's hold.
async fn pool_only_for_pods_naming_it(client: &Client, name: &str, cidr: &str) -> Api<DynamicObject> {
    let pools = Api::<DynamicObject>::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("crd.projectcalico.org", "v1", "IPPool"), "ippools"),
    );
    let _ = pools.delete(name, &DeleteParams::default()).await;
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPPool", "metadata": { "name": name },
        "spec": { "cidr": cidr, "blockSize": 28, "nodeSelector": "!all()", "ipipMode": "Never",
                  "vxlanMode": "Never", "allowedUses": ["Workload", "Tunnel"] },
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.expect("create the pool");
    pools
}

/// Point 4 and the node check: an address of a pool with a `nodeSelector` is not handed
/// back (capo answers before the scheduler places the Pod: it may land where the pool
/// does not serve), and neither is one whose old Pod's node is gone (not Ready: the old
/// Pod may still run there). Both Pods get new addresses; both old ones stay held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_address_goes_back_from_a_node_selector_pool_or_off_a_node_that_is_gone() {
    let (client, ns, capo, policy, node) = scene("sticky-nodes", json!({ "enabled": true })).await;
    let pools = pool_only_for_pods_naming_it(&client, POOL, POOL_CIDR).await;
    let outcome = |o: &str| format!("capo_sticky_claims_total{{outcome=\"{o}\",policy=\"{policy}\"}}");

    let pooled = json!({ "cni.projectcalico.org/ipv4pools": format!("[\"{POOL}\"]") });
    let old = start_statefulset(&client, &ns.name, "pooled", &node, pooled).await;
    let x = pod_ips(&old)[0];
    assert!(POOL_CIDR.parse::<ipnet::IpNet>().unwrap().contains(&x), "{x} from the pool");
    delete_pod(&client, &ns.name, "pooled-0").await.unwrap();
    let new = recreated(&client, &ns.name, "pooled-0", &old.uid().unwrap()).await;
    assert_ne!(pod_ips(&new)[0], x, "a new address");
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None);
    assert!(record(&client, x).await.is_some_and(|r| r.claim().is_none()), "{x} held, unclaimed");
    assert_eq!(wait_metric(&capo, &outcome("pool_node_selector"), 1.0).await, 1.0);

    let old = start_statefulset(&client, &ns.name, "moved", &node, json!({})).await;
    let y = pod_ips(&old)[0];
    scale_to_zero(&client, &ns.name, "moved", y).await;
    // The node goes; the StatefulSet's Pod will run on another.
    let other = format!("{node}-b");
    kwok_node(&client, &other).await;
    Api::<Node>::all(client.clone()).delete(&node, &DeleteParams::default()).await.unwrap();
    let patch = json!({ "spec": { "replicas": 1, "template": { "spec": {
        "nodeSelector": { "kubernetes.io/hostname": other } } } } });
    Api::<StatefulSet>::namespaced(client.clone(), &ns.name)
        .patch("moved", &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    let new = recreated(&client, &ns.name, "moved-0", &old.uid().unwrap()).await;
    assert_ne!(pod_ips(&new)[0], y, "a new address");
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None);
    assert!(record(&client, y).await.is_some_and(|r| r.claim().is_none()), "{y} held, unclaimed");
    assert_eq!(wait_metric(&capo, &outcome("node_not_ready"), 1.0).await, 1.0);

    let _ = Api::<StatefulSet>::namespaced(client.clone(), &ns.name).delete("pooled", &DeleteParams::default()).await;
    let _ = Api::<Pod>::namespaced(client.clone(), &ns.name).delete("pooled-0", &DeleteParams::default()).await;
    let _ = pools.delete(POOL, &DeleteParams::default()).await;
    capo.shutdown().await;
}

/// An address from a pool that an operator then closed to Pods (`allowedUses` without
/// `Workload`) is not handed back: Calico 3.33's CNI plugin would refuse it and the Pod
/// would not start. The hold stays a plain hold, with the reason counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_address_goes_back_from_a_pool_no_longer_for_workloads() {
    let (client, ns, capo, policy, node) = scene("sticky-uses", json!({ "enabled": true })).await;
    let name = format!("{POOL}-uses");
    let cidr = "192.0.2.192/26";
    let pools = pool_only_for_pods_naming_it(&client, &name, cidr).await;
    let outcome = |o: &str| format!("capo_sticky_claims_total{{outcome=\"{o}\",policy=\"{policy}\"}}");

    let pooled = json!({ "cni.projectcalico.org/ipv4pools": format!("[\"{name}\"]") });
    let old = start_statefulset(&client, &ns.name, "tunnel", &node, pooled).await;
    let x = pod_ips(&old)[0];
    assert!(cidr.parse::<ipnet::IpNet>().unwrap().contains(&x), "{x} from the pool");
    scale_to_zero(&client, &ns.name, "tunnel", x).await;
    // The operator keeps the pool for tunnels only; capo's pool watch sees it.
    let patch = json!({ "spec": { "allowedUses": ["Tunnel"] } });
    pools.patch(&name, &PatchParams::default(), &Patch::Merge(patch)).await.expect("patch the pool");
    let store = capo.pools.clone().expect("capo watches Calico's pools");
    eventually("capo sees the pool closed to Pods", Duration::from_secs(20), || async {
        store.pool_of(x).is_some_and(|p| !p.for_workloads).then_some(())
    })
    .await;
    let sts = Api::<StatefulSet>::namespaced(client.clone(), &ns.name);
    sts.patch("tunnel", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 1 } }))).await.unwrap();
    // The recreated Pod names no address (it may get none from this pool: that is the
    // operator's change, not capo's to work around).
    let new = eventually("tunnel-0 recreated", Duration::from_secs(60), || async {
        let p = Api::<Pod>::namespaced(client.clone(), &ns.name).get_opt("tunnel-0").await.ok()??;
        (p.uid() != old.uid()).then_some(p)
    })
    .await;
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None, "no address named");
    // At least once: the StatefulSet controller may send the CREATE again.
    assert!(wait_metric(&capo, &outcome("pool_not_for_workloads"), 1.0).await >= 1.0);
    assert!(record(&client, x).await.is_some_and(|r| r.claim().is_none()), "{x} held, unclaimed");

    let _ = sts.delete("tunnel", &DeleteParams::default()).await;
    let _ = Api::<Pod>::namespaced(client.clone(), &ns.name).delete("tunnel-0", &DeleteParams::default()).await;
    let _ = pools.delete(&name, &DeleteParams::default()).await;
    capo.shutdown().await;
}

/// A hold kept from an earlier review of the same Pod (an eviction a PodDisruptionBudget
/// refused after capo held) becomes `forced` when the Pod is then force-deleted: its
/// address is not handed back, although the hold itself is the first review's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_deletion_after_a_refused_eviction_marks_the_kept_hold_forced() {
    let (client, ns, capo, policy, node) = scene("sticky-kept", json!({ "enabled": true })).await;
    let old = start_statefulset(&client, &ns.name, "zk", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "zk" },
        "spec": { "maxUnavailable": 0, "selector": { "matchLabels": { "app": "zk" } } },
    }))
    .unwrap();
    Api::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &pdb).await.unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let refused = pods.evict("zk-0", &Default::default()).await;
    assert!(matches!(&refused, Err(kube::Error::Api(s)) if s.code == 429), "the PDB refuses: {refused:?}");
    let first = record(&client, x).await.expect("held on the refused eviction");
    assert!(!first.spec.forced);

    let force = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    pods.delete("zk-0", &force).await.unwrap();
    let rec = record(&client, x).await.expect("still held");
    assert_eq!(rec.metadata.uid, first.metadata.uid, "the first hold is kept");
    assert!(rec.spec.forced, "and now says the deletion was forced");
    let new = recreated(&client, &ns.name, "zk-0", &old.uid().unwrap()).await;
    assert_ne!(pod_ips(&new)[0], x, "not handed back");
    let passed = format!("capo_sticky_claims_total{{outcome=\"forced_deletion\",policy=\"{policy}\"}}");
    assert_eq!(wait_metric(&capo, &passed, 1.0).await, 1.0);
    capo.shutdown().await;
}

/// A Pod CREATE review of `namespace/name`, a Pod of the StatefulSet `owner` (by uid), as
/// anybody who can reach capo's port could write one.
fn create_review(namespace: &str, name: &str, owner: &str) -> axum::http::Request<axum::body::Body> {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": namespace, "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kv", "uid": owner, "controller": true }] },
        "spec": { "containers": [{ "name": "app", "image": "registry.invalid/app:1" }] },
    });
    pod_review_post(capo::admission::STICKY_PATH, "CREATE", namespace, name, "mallory", pod)
}

/// capo's admission (no webhook registration, caches never synced) over the given
/// policies, with `client` for its reads and writes; the answer to `req`, and the metrics.
async fn review_directly(
    client: &Client,
    policies: &[serde_json::Value],
    pods: &[capo::pod::PodFacts],
    req: axum::http::Request<axum::body::Body>,
) -> (serde_json::Value, String) {
    let named: Vec<(String, serde_json::Value)> =
        policies.iter().map(|p| (p["metadata"]["name"].as_str().unwrap().to_string(), p["spec"].clone())).collect();
    let admission =
        standalone_admission(client, named.iter().map(|(n, s)| (n.as_str(), s.clone())), Duration::from_secs(10));
    for pod in pods {
        admission.pods.put(pod.clone());
    }
    let metrics = admission.metrics.clone();
    let router = capo::admission::router(std::sync::Arc::new(admission));
    (send_review(&router, req).await, metrics.render())
}

fn policy_object(name: &str, sticky: bool) -> serde_json::Value {
    json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": name },
        "spec": { "podSelector": {}, "reserveFor": "1h", "sticky": { "enabled": sticky } },
    })
}

/// Part 2, DESIGN §6 (reads on the admission path): with no sticky policy anywhere, or
/// none that selects the Pod, a StatefulSet Pod CREATE (which reaches capo wherever the
/// webhook is installed) is answered without a read — here against an address nothing
/// listens on, where a read fails and says so (`unreadable`, as the review under a
/// sticky policy that selects it shows).
#[tokio::test]
async fn without_a_sticky_policy_a_pod_create_is_answered_without_a_read() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let nowhere = kube::Client::try_from(kube::Config::new("https://127.0.0.1:9".parse().unwrap())).unwrap();
    let (answer, m) =
        review_directly(&nowhere, &[policy_object("plain", false)], &[], create_review("shop", "kv-0", "sts-uid"))
            .await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(answer["response"]["patch"].is_null(), "{answer}");
    assert!(m.contains("capo_sticky_claims_total{outcome=\"no_sticky_policy\",policy=\"\"} 1"), "{m}");

    // A sticky policy that selects other Pods: answered from memory too.
    let mut redis = policy_object("redis", true);
    redis["spec"]["podSelector"] = json!({ "matchLabels": { "app": "redis" } });
    let (answer, m) = review_directly(&nowhere, &[redis], &[], create_review("shop", "kv-0", "sts-uid")).await;
    assert!(answer["response"]["patch"].is_null(), "{answer}");
    assert!(m.contains("capo_sticky_claims_total{outcome=\"not_selected\",policy=\"\"} 1"), "{m}");

    let (answer, m) =
        review_directly(&nowhere, &[policy_object("kv", true)], &[], create_review("shop", "kv-0", "sts-uid")).await;
    assert_eq!(answer["response"]["allowed"], true, "never refused, even when capo cannot read: {answer}");
    assert!(answer["response"]["patch"].is_null(), "{answer}");
    assert!(m.contains("capo_sticky_claims_total{outcome=\"unreadable\",policy=\"\"} 1"), "{m}");
}

/// Part 2, a CREATE that cannot be the Pod's: while capo's cache shows a live Pod of that
/// name (another than the held one), a CREATE review of the name claims nothing — the
/// API server would refuse that CREATE, or the review is forged; either way a claim would
/// keep the hold from its release and end in a fallback the real Pod would inherit. The
/// same review without that Pod claims (the guard, not the review, made the difference).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_for_a_name_a_live_pod_has_claims_nothing() {
    let (client, ns, capo, policy, node) = scene("sticky-taken", json!({ "enabled": true })).await;
    let old = start_statefulset(&client, &ns.name, "kv", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    scale_to_zero(&client, &ns.name, "kv", x).await;
    let owner = old.owner_references()[0].uid.clone();
    let sticky_policy = policy_object(&policy, true);

    let live = capo::pod::PodFacts {
        namespace: ns.name.clone(),
        name: "kv-0".into(),
        uid: "a-live-pod".into(),
        labels: Default::default(),
        annotations: Default::default(),
        controller: None,
        node: Some(node.clone()),
        host_network: false,
        ips: vec![],
        phase: Some("Running".into()),
        deleting: false,
    };
    let (answer, m) = review_directly(
        &client,
        std::slice::from_ref(&sticky_policy),
        &[live],
        create_review(&ns.name, "kv-0", &owner),
    )
    .await;
    assert!(answer["response"]["patch"].is_null(), "nothing handed back: {answer}");
    assert!(m.contains(&format!("capo_sticky_claims_total{{outcome=\"name_taken\",policy=\"{policy}\"}} 1")), "{m}");
    assert!(record(&client, x).await.is_some_and(|r| r.claim().is_none()), "{x} held, unclaimed");

    let (answer, m) =
        review_directly(&client, std::slice::from_ref(&sticky_policy), &[], create_review(&ns.name, "kv-0", &owner))
            .await;
    assert!(!answer["response"]["patch"].is_null(), "without the live Pod the same review claims: {answer}");
    assert!(m.contains(&format!("capo_sticky_claims_total{{outcome=\"claimed\",policy=\"{policy}\"}} 1")), "{m}");
    assert!(record(&client, x).await.is_some_and(|r| r.claim().is_some()), "{x} claimed");
    capo.shutdown().await;
}

/// Part 2, the node check with the node still there: the old Pod's node is present but
/// not Ready (kwok no longer keeps it, its Ready condition False — a partitioned node,
/// whose kubelet may still run the old Pod with the address). The Pod created again names
/// no address, the hold stays unclaimed, and the outcome says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_address_goes_back_off_a_node_that_is_there_but_not_ready() {
    let (client, ns, capo, policy, node) = scene("sticky-notready", json!({ "enabled": true })).await;
    let old = start_statefulset(&client, &ns.name, "ha", &node, json!({})).await;
    let y = pod_ips(&old)[0];
    scale_to_zero(&client, &ns.name, "ha", y).await;

    let nodes = Api::<Node>::all(client.clone());
    let unmanaged = json!({ "metadata": { "annotations": { capo_testenv::KWOK_NODE_ANNOTATION: null } } });
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(unmanaged)).await.unwrap();
    let not_ready = json!({ "status": { "conditions": [{
        "type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "partitioned (test)",
        "lastHeartbeatTime": k8s_openapi::jiff::Timestamp::now().to_string(), "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string() }] } });
    nodes.patch_status(&node, &PatchParams::default(), &Patch::Strategic(not_ready)).await.unwrap();
    let ready = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready").cloned())
    };
    eventually(&format!("{node} not Ready"), Duration::from_secs(10), || async {
        nodes.get(&node).await.ok().and_then(|n| ready(&n)).filter(|c| c.status != "True").map(|_| ())
    })
    .await;

    Api::<StatefulSet>::namespaced(client.clone(), &ns.name)
        .patch("ha", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 1 } })))
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let old_uid = old.uid().unwrap();
    let new = eventually("ha-0 created again", Duration::from_secs(30), || async {
        pods.get_opt("ha-0").await.ok()?.filter(|p| p.uid().as_deref() != Some(old_uid.as_str()))
    })
    .await;
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None, "no address named");
    let outcome = format!("capo_sticky_claims_total{{outcome=\"node_not_ready\",policy=\"{policy}\"}}");
    assert_eq!(wait_metric(&capo, &outcome, 1.0).await, 1.0);
    assert!(record(&client, y).await.is_some_and(|r| r.claim().is_none()), "{y} held, unclaimed");
    assert!(
        nodes.get(&node).await.ok().and_then(|n| ready(&n)).is_some_and(|c| c.status != "True"),
        "the node was still not Ready when capo looked"
    );

    let _ = Api::<StatefulSet>::namespaced(client.clone(), &ns.name).delete("ha", &DeleteParams::default()).await;
    let _ = pods.delete("ha-0", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await;
    let _ = nodes.delete(&node, &DeleteParams::default()).await;
    capo.shutdown().await;
}

/// Point 4, `strictAffinity: true` (Calico's IPAMConfig; cluster-wide, so on a control
/// plane of its own): capo hands back regardless (it does not read the setting). On the
/// old node the Pod gets its address back (the block is that node's); on another node
/// Calico's own `AssignIP` refuses it ("Block host affinity does not match", in the
/// driver's log), and past `fallbackAfter` the Pod gets a new address from its node's
/// block while the old one stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_strict_affinity_the_address_comes_back_only_on_its_nodes_block() {
    let plane = support::plane::private_plane("sticky-strict", false);
    let client = plane.client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    let ipam_config = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("crd.projectcalico.org", "v1", "IPAMConfig"),
        "ipamconfigs",
    );
    let config: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPAMConfig", "metadata": { "name": "default" },
        "spec": { "strictAffinity": true, "autoAllocateBlocks": true },
    }))
    .unwrap();
    Api::<DynamicObject>::all_with(client.clone(), &ipam_config)
        .patch("default", &PatchParams::apply("capo-test").force(), &Patch::Apply(config))
        .await
        .expect("strictAffinity on");
    let ns = TestNamespace::create(&client, "sticky-strict").await;
    let (a, b) = ("strict-a".to_string(), "strict-b".to_string());
    kwok_node(&client, &a).await;
    kwok_node(&client, &b).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("canary", &[], &[]), &[Ips::v4()]).await;
    let settings = leading_settings(&ns.name, "a", Duration::from_secs(600));
    let capo = start_capo_on(&client, &ns.name, "canary", settings).await;
    wait_leader(&capo).await;
    let policy = format!("{}-p", ns.name);
    let sticky = json!({ "enabled": true, "fallbackAfter": "5s" });
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {}, "reserveFor": "1h", "sticky": sticky })).await;

    // The same node: back.
    let old = start_statefulset(&client, &ns.name, "pinned", &a, json!({})).await;
    let x = pod_ips(&old)[0];
    delete_pod(&client, &ns.name, "pinned-0").await.unwrap();
    let new = recreated(&client, &ns.name, "pinned-0", &old.uid().unwrap()).await;
    assert_eq!(pod_ips(&new), vec![x], "on its node's block the address comes back under strict affinity");

    // Another node: Calico refuses it; the Pod falls back to an address of its own node.
    let old = start_statefulset(&client, &ns.name, "roaming", &a, json!({})).await;
    let y = pod_ips(&old)[0];
    scale_to_zero(&client, &ns.name, "roaming", y).await;
    let patch = json!({ "spec": { "replicas": 1, "template": { "spec": {
        "nodeSelector": { "kubernetes.io/hostname": b } } } } });
    Api::<StatefulSet>::namespaced(client.clone(), &ns.name)
        .patch("roaming", &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    let new = recreated(&client, &ns.name, "roaming-0", &old.uid().unwrap()).await;
    let z = pod_ips(&new)[0];
    assert_ne!(z, y, "Calico refused {y} on {b} (strict affinity); after the fallback the Pod got {z}");
    assert_eq!(annotation(&new, CALICO_IP_ADDRS_ANNOTATION), None, "capo took its addresses back");
    let rec = record(&client, y).await.expect("the old address stays held");
    assert!(rec.claim().and_then(|c| c.fell_back_at.clone()).is_some(), "the claim fell back: {:?}", rec.status);
    let log = std::fs::read_to_string(plane.state_dir.join(format!("{}.log", capo_testenv::CALICO_IPAM))).unwrap();
    assert!(
        log.lines().any(|l| l.contains("roaming-0") && l.contains("Block host affinity does not match")),
        "Calico's AssignIP refused {y} for its block's affinity"
    );
    let fallbacks = format!("capo_sticky_fallbacks_total{{policy=\"{policy}\",reason=\"not_shown\"}}");
    assert_eq!(wait_metric(&capo, &fallbacks, 1.0).await, 1.0);
    capo.shutdown().await;
    drop(plane);
}

/// Point 3 and invariant 4 for a claimed hold: while a claim is pending its hold outlives
/// its TTL (3 s here), and its entry, lost meanwhile (a hand edit), is written back — not
/// dropped with the record. When the claim runs out (no Pod ever came up with the address)
/// it falls back, and only then is the hold, long past due, released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_claim_outlives_its_ttl_and_gets_a_lost_entry_written_back() {
    let (client, ns, capo, policy, node) = scene("sticky-pending", json!({ "enabled": true })).await;
    let sticky = json!({ "enabled": true, "fallbackAfter": "20s" });
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {}, "reserveFor": "3s", "sticky": sticky })).await;
    let old = start_statefulset(&client, &ns.name, "kv", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    scale_to_zero(&client, &ns.name, "kv", x).await;
    let owner = old.owner_references()[0].uid.clone();
    let sticky_policy = json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": policy },
        "spec": { "podSelector": {}, "reserveFor": "3s", "sticky": sticky },
    });
    let (answer, _) = review_directly(&client, &[sticky_policy], &[], create_review(&ns.name, "kv-0", &owner)).await;
    assert!(!answer["response"]["patch"].is_null(), "claimed: {answer}");
    let rec = record(&client, x).await.expect("held");
    let until = rec.claim().expect("claimed").until.0;

    // Past its TTL, the hold stays while the claim is pending.
    let due = wait_status(&client, x).await.status.and_then(|s| s.release_at).expect("counting down").0;
    let past_due = due + k8s_openapi::jiff::SignedDuration::from_secs(2);
    eventually("two seconds past due", Duration::from_secs(10), || async {
        (k8s_openapi::jiff::Timestamp::now() > past_due).then_some(())
    })
    .await;
    let rec = record(&client, x).await.expect("still held past its TTL: the claim keeps it");
    assert!(entries(&client, &policy).await.contains(&cidr(x)), "its entry too");
    assert!(k8s_openapi::jiff::Timestamp::now() < until, "the claim was still pending");

    // The entry is lost while the claim is pending: written back.
    let shards = Api::<DynamicObject>::all_with(client.clone(), &V1.ip_reservation());
    let shard = shards.get(&rec.spec.reservation).await.unwrap();
    let rest: Vec<String> = shard.data["spec"]["reservedCIDRs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c.as_str().map(String::from))
        .filter(|c| *c != cidr(x))
        .collect();
    let patch =
        json!({ "metadata": { "resourceVersion": shard.resource_version() }, "spec": { "reservedCIDRs": rest } });
    shards.patch(&rec.spec.reservation, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    let back = eventually("the lost entry written back", Duration::from_secs(20), || async {
        entries(&client, &policy).await.contains(&cidr(x)).then(k8s_openapi::jiff::Timestamp::now)
    })
    .await;
    assert!(back < until, "written back while the claim was pending (until {until})");

    // No Pod shows the address: at `until` the claim falls back; then the hold, past due, goes.
    let released = wait_released(&client, x, Duration::from_secs(40)).await;
    assert!(released >= until, "released at {released}, before the claim ran out at {until}");
    let fallbacks = format!("capo_sticky_fallbacks_total{{policy=\"{policy}\",reason=\"not_shown\"}}");
    assert_eq!(wait_metric(&capo, &fallbacks, 1.0).await, 1.0);
    capo.shutdown().await;
}

/// Points the StatefulSet `name` (scaled to zero, `x` held) at a node that does not exist
/// and scales it to one: its Pod is created (the webhook claims `x` for it) and stays
/// Pending, never showing the address. Returns the claim's first time.
async fn recreate_unschedulable(client: &Client, ns: &str, name: &str, x: IpAddr) -> k8s_openapi::jiff::Timestamp {
    let nowhere = format!("nowhere-{}", std::process::id());
    let patch = json!({ "spec": { "replicas": 1, "template": { "spec": {
        "nodeSelector": { "kubernetes.io/hostname": nowhere } } } } });
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    eventually(&format!("{x} claimed by the unschedulable {name}-0"), Duration::from_secs(30), || async move {
        record(client, x).await?.claim().map(|c| c.first())
    })
    .await
}

/// Issue 55 (a): a tenant keeps its StatefulSet's Pod unschedulable and deletes it every
/// 3 s, so each CREATE would renew the claim. The claims end `fallbackAfter` (10 s) after
/// the first however often they are renewed (later CREATEs are refused), and the hold is
/// released by `reserveFor` (20 s) after its Pod went — at most `reserveFor` + the bound.
/// Meanwhile the claimed hold counts against `maxReserved: 1`: a second hold is released
/// by the cap while the claim keeps the first. On 8402e5c the claim was renewed at every
/// CREATE, the second hold stayed, and the first was never released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_renewed_by_a_pod_recreated_again_and_again_ends_at_its_bound_and_counts_against_the_cap() {
    let sticky = json!({ "enabled": true, "fallbackAfter": "10s" });
    let (client, ns, capo, policy, node) = scene("sticky-bound", sticky.clone()).await;
    let spec =
        json!({ "podSelector": {}, "reserveFor": "20s", "releaseInterval": "1s", "maxReserved": 1, "sticky": sticky });
    apply_policy(&client, &policy, &ns.name, spec).await;
    let old = start_statefulset(&client, &ns.name, "kv", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    let gone = k8s_openapi::jiff::Timestamp::now();
    scale_to_zero(&client, &ns.name, "kv", x).await;
    let first = recreate_unschedulable(&client, &ns.name, "kv", x).await;
    let since = |t: k8s_openapi::jiff::Timestamp| t.duration_since(gone).as_secs_f64();
    eprintln!("timeline (s from the deletion): first claim {:.1}", since(first));

    // While the claim is pending, a second hold of the policy: the cap of 1 counts the
    // claimed hold, so the second goes (the claimed one is never the one chosen).
    let y = selected_pod(&client, &ns.name, "other", false).await;
    delete_pod(&client, &ns.name, "other").await.unwrap();
    let y_gone = wait_released(&client, y, Duration::from_secs(15)).await;
    eprintln!("timeline: second hold {y} released by the cap {:.1}", since(y_gone));
    let rec = record(&client, x).await.expect("the claimed hold stays");
    assert!(rec.claim().is_some_and(|c| c.pending(y_gone)), "{y} went while {x}'s claim was pending: {:?}", rec.status);
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(metric_value(&capo, &cap), Some(1.0), "{y} went by the cap");

    // The tenant deletes the Pending Pod every 3 s; the StatefulSet creates it again.
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let deadline = gone + k8s_openapi::jiff::SignedDuration::from_secs(60);
    let (mut renewals, mut fell_logged) = (0, false);
    let released = loop {
        let Some(rec) = record(&client, x).await else { break k8s_openapi::jiff::Timestamp::now() };
        if let Some(c) = rec.claim() {
            if c.renewals > renewals {
                renewals = c.renewals;
                eprintln!("timeline: renewal {renewals} until {:.1}", since(c.until.0));
            }
            if let Some(at) = c.fell_back_at.as_ref().filter(|_| !fell_logged) {
                eprintln!("timeline: fell back ({:?}) {:.1}", c.fell_back_reason, since(at.0));
                fell_logged = true;
            }
        }
        assert!(
            k8s_openapi::jiff::Timestamp::now() < deadline,
            "{x} still held 60 s after its Pod went: {:?}",
            rec.status
        );
        if pods.get_opt("kv-0").await.unwrap().is_some() {
            pods.delete("kv-0", &DeleteParams::default()).await.ok();
        }
        // The tenant's pace, not a wait for an outcome (the loop's deadline bounds it).
        tokio::time::sleep(Duration::from_secs(3)).await;
    };
    eprintln!("timeline: {x} released {:.1}", since(released));
    assert!(renewals >= 1, "the recreated Pods renewed the claim");
    let bound = first + k8s_openapi::jiff::SignedDuration::from_secs(10);
    let due = (gone + k8s_openapi::jiff::SignedDuration::from_secs(20)).max(bound);
    // The countdown runs from the Pod going (the webhook's deletion, just after `gone`)
    // and the poll above looks every 3 s.
    assert!(released >= gone + k8s_openapi::jiff::SignedDuration::from_secs(20), "{x} released before its reserveFor");
    assert!(
        released <= due + k8s_openapi::jiff::SignedDuration::from_secs(3 + 5),
        "{x} released at {:.1}s, due at {:.1}s (reserveFor, or the claim bound at {:.1}s)",
        since(released),
        since(due),
        since(bound)
    );
    let fell = format!("capo_sticky_fallbacks_total{{policy=\"{policy}\",reason=\"bound_reached\"}}");
    assert_eq!(metric_value(&capo, &fell), Some(1.0), "the claim fell back at its bound");
    let note = wait_event(&client, "default", &x.to_string(), "StickyFellBack").await;
    assert!(note.contains("a claim lasts at most sticky.fallbackAfter"), "{note}");
    let refused = ["fell_back_before", "claim_bound_reached"]
        .iter()
        .filter_map(|o| {
            metric_value(&capo, &format!("capo_sticky_claims_total{{outcome=\"{o}\",policy=\"{policy}\"}}"))
        })
        .sum::<f64>();
    assert!(refused >= 1.0, "a CREATE past the bound got nothing back");
    capo.shutdown().await;
}

/// Issue 55 (b): an operator's `capo release` beats a pending claim: the claim falls back
/// (the Pending Pod's addresses taken back) and the hold is released within seconds, not
/// at the claim's end (60 s here). On 8402e5c the release waited for the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capo_release_ends_a_pending_claim_and_releases_at_once() {
    let (client, ns, capo, policy, node) =
        scene("sticky-release", json!({ "enabled": true, "fallbackAfter": "60s" })).await;
    let old = start_statefulset(&client, &ns.name, "kv", &node, json!({})).await;
    let x = pod_ips(&old)[0];
    scale_to_zero(&client, &ns.name, "kv", x).await;
    recreate_unschedulable(&client, &ns.name, "kv", x).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let pending = pods.get("kv-0").await.unwrap();
    assert!(annotation(&pending, CALICO_IP_ADDRS_ANNOTATION).is_some(), "{x} handed back to the Pending Pod");

    let asked = k8s_openapi::jiff::Timestamp::now();
    let (code, out, err) = capo_cli(&["release", &x.to_string()]).await;
    assert_eq!(code, 0, "{out}{err}");
    let released = wait_released(&client, x, Duration::from_secs(15)).await;
    assert!(
        released.duration_since(asked) < k8s_openapi::jiff::SignedDuration::from_secs(10),
        "released {released}, asked {asked}"
    );
    let manual = format!("capo_releases_total{{policy=\"{policy}\",reason=\"manual\"}}");
    assert_eq!(wait_metric(&capo, &manual, 1.0).await, 1.0);
    let fell = format!("capo_sticky_fallbacks_total{{policy=\"{policy}\",reason=\"released\"}}");
    assert_eq!(metric_value(&capo, &fell), Some(1.0), "the claim ended first");
    let pending = pods.get("kv-0").await.unwrap();
    assert_eq!(annotation(&pending, CALICO_IP_ADDRS_ANNOTATION), None, "the Pending Pod no longer names {x}");
    capo.shutdown().await;
}

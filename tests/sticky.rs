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
    assert_eq!(wait_metric(&capo, &passed, 1.0).await, 1.0);
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
    let passed = format!("capo_sticky_claims_total{{outcome=\"policy_not_sticky\",policy=\"{policy}\"}}");
    assert_eq!(wait_metric(&capo, &passed, 1.0).await, 1.0);
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
    let fallbacks = format!("capo_sticky_fallbacks_total{{policy=\"{policy}\"}}");
    assert_eq!(wait_metric(&capo, &fallbacks, 1.0).await, 1.0);
    assert!(entries(&client, &policy).await.contains(&cidr(x)), "{x} still in the reservation");
    let (code, out, err) = capo_cli(&["holds"]).await;
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with(&format!("{x} "))).unwrap_or_default();
    assert!(line.trim_end().ends_with("fell back"), "capo holds shows the claim fell back:\n{out}");
    support::calico::release(&kc, &handle, &[]).await;
    capo.shutdown().await;
}

const POOL: &str = "capo-test-sticky";
const POOL_CIDR: &str = "192.0.2.128/26";

/// Point 4 and the node check: an address of a pool with a `nodeSelector` is not handed
/// back (capo answers before the scheduler places the Pod: it may land where the pool
/// does not serve), and neither is one whose old Pod's node is gone (not Ready: the old
/// Pod may still run there). Both Pods get new addresses; both old ones stay held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_address_goes_back_from_a_node_selector_pool_or_off_a_node_that_is_gone() {
    let (client, ns, capo, policy, node) = scene("sticky-nodes", json!({ "enabled": true })).await;
    let pools = Api::<DynamicObject>::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("crd.projectcalico.org", "v1", "IPPool"), "ippools"),
    );
    let _ = pools.delete(POOL, &DeleteParams::default()).await;
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPPool", "metadata": { "name": POOL },
        "spec": { "cidr": POOL_CIDR, "blockSize": 28, "nodeSelector": "!all()", "ipipMode": "Never",
                  "vxlanMode": "Never", "allowedUses": ["Workload", "Tunnel"] },
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.expect("create the pool");
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

//! Pod owners are matched by API group, kind, name and UID (issue 24, defect 4): an
//! OpenKruise Advanced StatefulSet is not an `apps` StatefulSet, and a DaemonSet is an
//! owner capo sees go.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use capo_api::HoldTrigger;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::leading::*;
use support::*;

/// The smallest CRD that serves `apps.kruise.io/v1beta1` StatefulSets, as OpenKruise's
/// own CRD names them (group, kind, plural); the schema keeps whatever it is given.
async fn advanced_statefulsets(client: &Client) -> ApiResource {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": { "name": "statefulsets.apps.kruise.io" },
        "spec": {
            "group": "apps.kruise.io",
            "scope": "Namespaced",
            "names": { "kind": "StatefulSet", "listKind": "StatefulSetList", "plural": "statefulsets",
                       "singular": "statefulset", "shortNames": ["asts"] },
            "versions": [{ "name": "v1beta1", "served": true, "storage": true,
                           "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }],
        },
    }))
    .unwrap();
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create the Advanced StatefulSet CRD: {e}"),
    }
    eventually("the Advanced StatefulSet CRD to be established", Duration::from_secs(30), || {
        let crds = crds.clone();
        async move {
            let crd = crds.get("statefulsets.apps.kruise.io").await.ok()?;
            let conditions = crd.status?.conditions?;
            conditions.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
        }
    })
    .await;
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apps.kruise.io", "v1beta1", "StatefulSet"),
        "statefulsets",
    )
}

/// A Pod labelled `app=redis` controlled by `owner` (apiVersion, kind, name, uid), with a
/// fresh IPv4 address.
async fn owned_pod(client: &Client, ns: &str, name: &str, owner: (&str, &str, &str, &str)) -> IpAddr {
    let ip = Ips::v4();
    let mut pod = unscheduled_pod(name, &[("app", "redis")], &[]);
    let (api_version, kind, owner_name, uid) = owner;
    pod.metadata.owner_references = Some(vec![
        serde_json::from_value(json!({
            "apiVersion": api_version, "kind": kind, "name": owner_name, "uid": uid, "controller": true,
        }))
        .unwrap(),
    ]);
    create_pod_with_ips(client, ns, pod, &[ip]).await;
    ip
}

/// An Advanced StatefulSet `redis` exists while no `apps` StatefulSet of that name does:
/// its Pods' holds stay (the old code took the owner for gone and released them at once),
/// its Failed Pod is held by the safety net (the old code took it for the garbage
/// collector's work and skipped it), and both are released early once it is deleted.
#[tokio::test]
async fn an_advanced_statefulset_is_not_an_apps_statefulset_and_is_seen_when_it_goes() {
    let Scene { client, ns, capo, policy } = scene(
        "own-kruise",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h",
                "releaseEarly": { "workloadDeleted": true }, "releaseInterval": "100ms" }),
    )
    .await;
    let ar = advanced_statefulsets(&client).await;
    let asts = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &ar);
    let mut object = DynamicObject::new("redis", &ar);
    object.data = json!({ "spec": { "replicas": 2 } });
    let uid =
        asts.create(&PostParams::default(), &object).await.expect("create the Advanced StatefulSet").uid().unwrap();
    let owner = ("apps.kruise.io/v1beta1", "StatefulSet", "redis", uid.as_str());

    let deleted = owned_pod(&client, &ns.name, "redis-0", owner).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("held and allowed");
    wait_status(&client, deleted).await;
    let failed = owned_pod(&client, &ns.name, "redis-1", owner).await;
    set_phase(&client, &ns.name, "redis-1", "Failed").await;
    let netted = eventually("the safety net to hold the Failed Pod", Duration::from_secs(20), || {
        let client = client.clone();
        async move { record(&client, failed).await }
    })
    .await;
    assert_eq!(netted.spec.trigger, HoldTrigger::SafetyNet);
    let controller = netted.spec.pod.controller.expect("the record names the owner");
    assert_eq!(controller.api_version.as_deref(), Some("apps.kruise.io/v1beta1"));
    assert_eq!(controller.uid.as_deref(), Some(uid.as_str()));
    // By now the leader has decided the first hold many times over (100 ms slots).
    assert!(record(&client, deleted).await.is_some(), "released while its Advanced StatefulSet exists");
    let early = format!("capo_releases_total{{policy=\"{policy}\",reason=\"workload-gone\"}}");
    assert_eq!(metric_value(&capo, &early), None);
    wait_metric(&capo, "capo_owner_kinds{state=\"watched\"}", 4.0).await;

    asts.delete("redis", &DeleteParams::default()).await.expect("delete the Advanced StatefulSet");
    for ip in [deleted, failed] {
        wait_released(&client, ip, Duration::from_secs(20)).await;
    }
    assert_eq!(wait_metric(&capo, &early, 2.0).await, 2.0);
}

/// The Pods of a DaemonSet: one deleted by hand is held; when the DaemonSet goes, the
/// Pods the garbage collector deletes are not held by the safety net (the old code did
/// not know DaemonSets and held them), and the hand-deleted Pod's hold is released early
/// (the old code never did).
#[tokio::test]
async fn a_daemonsets_pods_are_not_netted_when_it_goes_and_its_holds_go_with_it() {
    let Scene { client, ns, capo, policy } = scene(
        "own-ds",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "agent" } }, "reserveFor": "1h",
                "releaseEarly": { "workloadDeleted": true }, "releaseInterval": "100ms" }),
    )
    .await;
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": { "name": "agent" },
        "spec": { "selector": { "matchLabels": { "app": "agent" } },
                  "template": { "metadata": { "labels": { "app": "agent" } },
                                "spec": { "containers": [{ "name": "c", "image": "registry.invalid/agent:1" }],
                                          "nodeSelector": { "type": "kwok" },
                                          "tolerations": [{ "operator": "Exists" }] } } },
    }))
    .unwrap();
    let daemonsets = Api::<DaemonSet>::namespaced(client.clone(), &ns.name);
    daemonsets.create(&PostParams::default(), &ds).await.expect("create the DaemonSet");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let running = |pods: Api<Pod>| async move {
        let list = pods.list(&ListParams::default().labels("app=agent")).await.ok()?;
        let up: Vec<Pod> = list
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && !pod_ips(p).is_empty())
            .collect();
        Some(up)
    };
    let first = eventually("the DaemonSet's Pods running", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move { running(pods).await.filter(|up| !up.is_empty()) }
    })
    .await;
    let nodes = first.len();
    let by_hand = first[0].clone();
    let held_ip = pod_ips(&by_hand)[0];
    delete_pod(&client, &ns.name, &by_hand.name_any()).await.expect("held and allowed");
    let rec = wait_status(&client, held_ip).await;
    let controller = rec.spec.pod.controller.expect("the record names the DaemonSet");
    assert_eq!((controller.api_version.as_deref(), controller.kind.as_str()), (Some("apps/v1"), "DaemonSet"));
    // The DaemonSet replaces it; then it goes, and the garbage collector takes its Pods.
    let replaced = eventually("the DaemonSet to replace its Pod", Duration::from_secs(60), || {
        let pods = pods.clone();
        let gone = by_hand.uid();
        async move { running(pods).await.filter(|up| up.len() >= nodes && up.iter().all(|p| p.uid() != gone)) }
    })
    .await;
    daemonsets.delete("agent", &DeleteParams::default()).await.expect("delete the DaemonSet");
    eventually("the DaemonSet's Pods to be gone", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move { pods.list(&ListParams::default().labels("app=agent")).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    let records = Api::<capo_api::ReservedIP>::all(client.clone()).list(&ListParams::default()).await.unwrap();
    for pod in &replaced {
        if let Some(r) = records.items.iter().find(|r| Some(r.spec.pod.uid.as_str()) == pod.metadata.uid.as_deref()) {
            panic!("{} taken by the garbage collector was held (trigger {:?})", pod.name_any(), r.spec.trigger);
        }
    }
    wait_released(&client, held_ip, Duration::from_secs(20)).await;
    let early = format!("capo_releases_total{{policy=\"{policy}\",reason=\"workload-gone\"}}");
    assert_eq!(wait_metric(&capo, &early, 1.0).await, 1.0);
}

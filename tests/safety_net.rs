//! The safety net's memory against a real API server: bounded by the Pods that exist.
//! Its own test binary, so no other test's Pods come and go meanwhile.

mod support;

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use support::leading::*;
use support::*;

const PODS: usize = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_safety_nets_memory_of_leaving_pods_no_policy_selects_goes_with_the_pods() {
    let Scene { client, ns, capo, .. } = scene(
        "net-mem",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" }),
    )
    .await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    // A thousand Pods no policy selects (a batch of Jobs, say) finish: the safety net looks
    // at each as it leaves, and holds none.
    futures::stream::iter(0..PODS)
        .for_each_concurrent(16, |i| {
            let (client, ns, pods) = (client.clone(), ns.name.clone(), pods.clone());
            async move {
                let name = format!("job-{i}");
                create_pod_with_ips(&client, &ns, unscheduled_pod(&name, &[("app", "batch")], &[]), &[Ips::v4()]).await;
                let done = json!({ "status": { "phase": "Succeeded" } });
                pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(done)).await.expect("finish");
            }
        })
        .await;
    let gauge = "capo_safety_net_remembered_pods";
    let seen = eventually("the safety net to look at every finished Pod", Duration::from_secs(60), || async {
        metric_value(&capo, gauge).filter(|v| *v >= PODS as f64)
    })
    .await;
    assert_eq!(seen, PODS as f64);
    let skipped = metric_value(&capo, "capo_safety_net_skipped_total{reason=\"not_selected\"}").unwrap_or_default();
    assert!(skipped >= PODS as f64, "each skipped as not selected: {skipped}");
    // Another replica takes the Lease, and renews it while the test looks: this one's term
    // ends, and with it what its safety net remembered (a follower looks at nothing; the
    // next term looks at every Pod again).
    let leases = Api::<Lease>::namespaced(client.clone(), "default");
    let lease = format!("capo-{}", ns.name);
    let other_renews = || async {
        let taken = json!({ "spec": {
            "holderIdentity": "another-replica",
            "leaseDurationSeconds": 3,
            "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now()),
        } });
        leases.patch(&lease, &PatchParams::default(), &Patch::Merge(taken)).await.expect("the other replica renews");
    };
    let fence = capo.fence.clone().expect("release on");
    eventually("a term that ended to forget what it remembered", Duration::from_secs(20), || async {
        other_renews().await;
        (!fence.is_leader() && metric_value(&capo, gauge) == Some(0.0)).then_some(())
    })
    .await;
    // The other replica is gone: this one leads again, and looks at every finished Pod.
    wait_leader(&capo).await;
    eventually("the new term to look at every finished Pod", Duration::from_secs(60), || async {
        metric_value(&capo, gauge).filter(|v| *v >= PODS as f64)
    })
    .await;
    // They go: so does the memory of them.
    futures::stream::iter(0..PODS)
        .for_each_concurrent(16, |i| {
            let pods = pods.clone();
            async move {
                pods.delete(&format!("job-{i}"), &DeleteParams::default()).await.expect("delete");
            }
        })
        .await;
    eventually("the safety net to forget the Pods that went", Duration::from_secs(60), || async {
        (metric_value(&capo, gauge) == Some(0.0)).then_some(())
    })
    .await;
}

//! Which Calico API is served decides where capo writes (its own test binary, so its
//! control plane starts without Calico CRDs): with none, a hold cannot be written and capo
//! says so clearly; with only `projectcalico.org/v3`, capo detects and uses it.

mod support;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use serde_json::json;
use support::*;

#[tokio::test]
async fn calico_api_detection_and_a_clear_denial_without_calico() {
    let client = client_without_calico().await;
    install_capo_crds(&client).await;
    let ns = TestNamespace::create(&client, "no-calico").await;
    let capo = start_capo(&client, &[&ns.name], None).await;
    assert_eq!(capo.calico_api, capo_api::CalicoApiGroup::CrdV1, "nothing served: the Kubernetes-datastore default");
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": {} })).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("p", &[], &[]), &[Ips::v4()]).await;
    let err = delete_pod(&client, &ns.name, "p").await.expect_err("denied");
    let msg = err.to_string();
    assert!(msg.contains("is Calico (or its CRDs) installed?"), "{msg}");
    assert!(Api::<Pod>::namespaced(client.clone(), &ns.name).get_opt("p").await.unwrap().is_some());
    assert!(capo.metrics.render().contains(&format!(
        "capo_hold_failures_total{{action=\"deny\",policy=\"{policy}\",reason=\"calico_not_served\"}} 1"
    )));
}

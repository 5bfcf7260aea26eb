//! The test control plane is real: the API server enforces CRD schemas, calls a webhook
//! over TLS on Pod DELETE and `pods/eviction` CREATE, and with kube-controller-manager,
//! kube-scheduler and kwok runs StatefulSets and deletes namespaces.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::routing::post;
use capo_api::CalicoApiGroup;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DynamicObject, EvictParams, PostParams};
use kube::core::admission::{AdmissionResponse, AdmissionReview};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::*;

async fn create_reservation(
    client: &Client,
    group: CalicoApiGroup,
    name: &str,
    cidrs: &[&str],
) -> Result<(), kube::Error> {
    let api = Api::<DynamicObject>::all_with(client.clone(), &group.ip_reservation());
    let mut obj = DynamicObject::new(name, &group.ip_reservation());
    obj.data = json!({ "spec": { "reservedCIDRs": cidrs } });
    api.create(&PostParams::default(), &obj).await.map(|_| ())
}

fn rejection(e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 422, "{s:?}");
            s.message
        }
        other => panic!("expected a 422 rejection, got {other}"),
    }
}

#[tokio::test]
async fn calico_ipreservation_schema_is_enforced_like_calicos() {
    let client = client().await;
    install_calico_crds(&client).await;
    for group in CalicoApiGroup::ALL {
        let v = group.version();
        create_reservation(
            &client,
            group,
            &format!("smoke-ok-{v}"),
            &["198.19.0.1/32", "2001:2::1/128", "198.19.1.0/24"],
        )
        .await
        .expect("valid CIDRs are accepted");
        let msg = rejection(
            create_reservation(&client, group, &format!("smoke-bad-{v}"), &["not-a-cidr"]).await.unwrap_err(),
        );
        assert!(msg.contains("reservedCIDRs") && msg.contains("cidr"), "{msg}");
        let msg = rejection(
            create_reservation(&client, group, &format!("smoke-dup-{v}"), &["198.19.0.2/32", "198.19.0.2/32"])
                .await
                .unwrap_err(),
        );
        assert!(msg.contains("Duplicate value"), "{msg}");
    }
}

#[derive(Default)]
struct Seen {
    reviews: Vec<(String, String, String)>, // operation, resource/subresource, name
}

async fn record_and_decide(
    State(seen): State<Arc<Mutex<Seen>>>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let req: kube::core::admission::AdmissionRequest<DynamicObject> = review.try_into().unwrap();
    let sub = req.sub_resource.clone().unwrap_or_default();
    seen.lock().unwrap().reviews.push((
        format!("{:?}", req.operation),
        format!("{}/{sub}", req.resource.resource),
        req.name.clone(),
    ));
    let deny = req.old_object.as_ref().is_some_and(|o| o.labels().get("deny").is_some_and(|v| v == "true"));
    let resp = AdmissionResponse::from(&req);
    let resp = if deny { resp.deny("smoke webhook says no") } else { resp };
    Json(resp.into_review())
}

#[tokio::test]
async fn api_server_calls_a_tls_webhook_on_pod_delete_and_eviction() {
    let client = client().await;
    let ns = TestNamespace::create(&client, "smoke-webhook").await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certs = capo::certs::self_signed(&["127.0.0.1".into()]).unwrap();
    let tls =
        axum_server::tls_rustls::RustlsConfig::from_pem(certs.cert_pem.clone().into(), certs.key_pem.clone().into())
            .await
            .unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let router =
        axum::Router::new().route(capo::admission::REVIEW_PATH, post(record_and_decide)).with_state(seen.clone());
    let handle: axum_server::Handle<std::net::SocketAddr> = axum_server::Handle::new();
    let server = axum_server::bind_rustls("127.0.0.1:0".parse().unwrap(), tls).handle(handle.clone());
    tokio::spawn(server.serve(router.into_make_service()));
    let addr = handle.listening().await.unwrap();
    let reg = capo::webhook_config::Registration {
        name: format!("smoke-{}", ns.name),
        url: format!("https://{addr}"),
        ca_pem: Some(certs.ca_pem.clone()),
        excluded_namespaces: vec!["kube-system".into()],
        only_namespaces: Some(vec![ns.name.clone()]),
        timeout_seconds: 5,
    };
    capo::webhook_config::apply(&client, &reg).await.unwrap();

    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let ip = [Ips::v4()];
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("deleted", &[], &[]), &ip).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("evicted", &[], &[]), &[Ips::v4()]).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("denied", &[("deny", "true")], &[]), &[Ips::v4()]).await;

    // Webhook configurations take effect asynchronously; retry the first call until seen.
    eventually("the API server to call the webhook on DELETE", Duration::from_secs(30), || {
        let seen = seen.clone();
        let client = client.clone();
        let ns = ns.name.clone();
        async move {
            let _ = delete_pod(&client, &ns, "deleted").await;
            let s = seen.lock().unwrap();
            s.reviews.iter().any(|(op, res, name)| op == "Delete" && res == "pods/" && name == "deleted").then_some(())
        }
    })
    .await;

    pods.evict("evicted", &EvictParams::default()).await.expect("eviction allowed");
    assert!(
        seen.lock()
            .unwrap()
            .reviews
            .iter()
            .any(|(op, res, name)| op == "Create" && res == "pods/eviction" && name == "evicted"),
        "eviction was not reviewed: {:?}",
        seen.lock().unwrap().reviews
    );

    let err = delete_pod(&client, &ns.name, "denied").await.expect_err("the webhook denies this deletion");
    assert!(err.to_string().contains("smoke webhook says no"), "{err}");
    assert!(pods.get_opt("denied").await.unwrap().is_some(), "a denied deletion leaves the Pod in place");

    capo::webhook_config::delete(&client, &reg.name).await.unwrap();
    handle.shutdown();
}

#[tokio::test]
async fn statefulset_runs_on_kwok_and_recreates_a_deleted_pod() {
    let client = client().await;
    let ns = TestNamespace::create(&client, "smoke-sts").await;
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": { "name": "redis" },
        "spec": {
            "serviceName": "redis", "replicas": 2,
            "selector": { "matchLabels": { "app": "redis" } },
            "template": {
                "metadata": { "labels": { "app": "redis" } },
                "spec": {
                    "containers": [{ "name": "redis", "image": "registry.invalid/redis:7" }],
                    "tolerations": [{ "operator": "Exists" }],
                    "terminationGracePeriodSeconds": 5,
                },
            },
        },
    }))
    .unwrap();
    Api::<StatefulSet>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &sts).await.unwrap();
    let first = wait_running(&client, &ns.name, "redis-0").await;
    let second = wait_running(&client, &ns.name, "redis-1").await;
    for p in [&first, &second] {
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
        assert!(node.starts_with("kwok-node-"), "scheduled onto a kwok node, got {node:?}");
        assert!(!pod_ips(p).is_empty());
    }

    let old_uid = first.uid().unwrap();
    delete_pod(&client, &ns.name, "redis-0").await.unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    let recreated = eventually("redis-0 recreated by the StatefulSet controller", Duration::from_secs(60), || {
        let pods = pods.clone();
        let old_uid = old_uid.clone();
        async move {
            let p = pods.get_opt("redis-0").await.ok()??;
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            (p.uid().as_deref() != Some(old_uid.as_str()) && running).then_some(p)
        }
    })
    .await;
    assert!(!pod_ips(&recreated).is_empty(), "the recreated Pod has an IP");
}

#[tokio::test]
async fn deleting_a_namespace_completes() {
    let client = client().await;
    let ns = TestNamespace::create(&client, "smoke-nsdel").await;
    let cm: ConfigMap = serde_json::from_value(json!({ "metadata": { "name": "c" }, "data": { "k": "v" } })).unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &cm).await.unwrap();
    Api::<Pod>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &kwok_pod("p", &[])).await.unwrap();
    wait_running(&client, &ns.name, "p").await;
    delete_namespace_and_wait(&client, &ns.name).await;
}

//! Fuzzing the admission path: random and mutated AdmissionReviews and Pods go through
//! capo's real router (decoder, decision, hold attempt, answer). No panic, and every
//! answer is well-formed: an AdmissionReview for the request's uid, or a 4xx/503 with a
//! reason.
//!
//! `make test` runs a few hundred cases per property. A long run:
//! `CAPO_FUZZ_CASES=1000000 cargo test --release --test fuzz` (see docs/testing.md).
//!
//! No API server: the client points at a closed port, so a hold that is attempted fails
//! at once and the answer is the policy's denial — which is part of what is checked.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt;

fn cases() -> u32 {
    std::env::var("CAPO_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

fn router() -> axum::Router {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let policies = ["statefulsets", "everything"].map(|name| {
        let spec = if name == "everything" {
            json!({ "podSelector": {}, "onHoldFailure": "Allow", "priority": -1 })
        } else {
            json!({ "podSelector": { "matchExpressions": [{ "key": "statefulset.kubernetes.io/pod-name", "operator": "Exists" }] } })
        };
        let p: capo_api::CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": name }, "spec": spec,
        }))
        .unwrap();
        capo::policy::CompiledPolicy::compile(&p).unwrap()
    });
    let mut config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
    config.connect_timeout = Some(Duration::from_millis(200));
    let client = kube::Client::try_from(config).unwrap();
    let readiness = Arc::new(capo::health::Readiness::default());
    readiness.set_policies_synced();
    readiness.set_namespaces_synced();
    readiness.set_pods_synced();
    capo::admission::router(Arc::new(capo::admission::Admission {
        matcher: Arc::new(arc_swap::ArcSwap::from_pointee(capo::policy::Matcher::new(policies))),
        caches: Arc::new(capo::cache::Caches::default()),
        store: capo::hold::HoldWriter::new(client.clone(), capo_api::CalicoApiGroup::CrdV1),
        client,
        metrics: Arc::new(capo::metrics::Metrics::new()),
        readiness,
        settings: capo::admission::AdmissionSettings {
            excluded_namespaces: vec!["kube-system".into()],
            max_review_time: Duration::from_secs(2),
        },
    }))
}

/// Sends `body` and checks the answer is well-formed.
async fn check(router: &axum::Router, body: Vec<u8>) -> Result<(), TestCaseError> {
    let uid = serde_json::from_slice::<Value>(&body).ok().and_then(|v| v.pointer("/request/uid").cloned());
    let req = Request::post(format!("{}?timeout=1s", capo::admission::REVIEW_PATH))
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
    match status {
        200 => {
            let answer: Value =
                serde_json::from_slice(&bytes).map_err(|e| TestCaseError::fail(format!("200 not JSON: {e}")))?;
            prop_assert_eq!(&answer["kind"], "AdmissionReview");
            prop_assert!(answer["response"]["allowed"].is_boolean(), "{}", answer);
            if let Some(uid) = uid {
                prop_assert_eq!(&answer["response"]["uid"], &uid);
            }
            if answer["response"]["allowed"] == false {
                let message = answer["response"]["status"]["message"].as_str().unwrap_or_default();
                prop_assert!(!message.is_empty(), "a denial says why: {}", answer);
            }
        }
        400 | 413 | 503 => prop_assert!(!bytes.is_empty(), "an error says why"),
        other => prop_assert!(false, "unexpected status {other}"),
    }
    Ok(())
}

fn review(operation: &str, sub_resource: Option<&str>, pod: Value, dry_run: bool) -> Value {
    let mut request = json!({
        "uid": "fuzz-uid", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "name": pod.pointer("/metadata/name").cloned().unwrap_or(json!("p")),
        "namespace": pod.pointer("/metadata/namespace").cloned().unwrap_or(json!("ns")),
        "operation": operation, "userInfo": {"username": "fuzz"}, "dryRun": dry_run,
    });
    if let Some(sub) = sub_resource {
        request["subResource"] = json!(sub);
        request["object"] = json!({ "apiVersion": "policy/v1", "kind": "Eviction", "metadata": { "name": "p" } });
    } else {
        request["oldObject"] = pod;
    }
    json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request })
}

fn arb_ip() -> impl Strategy<Value = String> {
    prop_oneof![
        (any::<u8>(), any::<u8>()).prop_map(|(a, b)| format!("10.1.{a}.{b}")),
        any::<u16>().prop_map(|a| format!("fd00::{a:x}")),
        "[0-9a-f:.]{0,20}",
    ]
}

fn arb_pod() -> impl Strategy<Value = Value> {
    (
        "[a-z0-9-]{0,12}",
        prop::collection::btree_map("[a-z./-]{1,20}", "[a-z0-9-]{0,8}", 0..4),
        prop::collection::btree_map("capo\\.io/(hold|policy|reserve-for)", "[a-z0-9]{0,6}", 0..3),
        prop::collection::vec(arb_ip(), 0..3),
        any::<bool>(),
        prop::option::of(prop_oneof!["Running", "Failed", "Pending", "x"]),
    )
        .prop_map(|(name, labels, annotations, ips, host, phase)| {
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": { "name": name, "namespace": "ns", "uid": "u", "labels": labels, "annotations": annotations },
                "spec": { "hostNetwork": host, "containers": [] },
                "status": { "phase": phase, "podIP": ips.first(), "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>() },
            })
        })
}

/// Replaces the value at a random path with a random JSON value, or removes it.
fn mutate(mut v: Value, picks: &[(usize, u8)]) -> Value {
    fn paths(v: &Value, prefix: String, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, c)| {
                let p = format!("{prefix}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                paths(c, p, out);
            }),
            Value::Array(a) => a.iter().enumerate().for_each(|(i, c)| {
                let p = format!("{prefix}/{i}");
                out.push(p.clone());
                paths(c, p, out);
            }),
            _ => {}
        }
    }
    for (pick, how) in picks {
        let mut all = Vec::new();
        paths(&v, String::new(), &mut all);
        if all.is_empty() {
            break;
        }
        let path = &all[pick % all.len()];
        let replacement = match how % 6 {
            0 => Value::Null,
            1 => json!(12345),
            2 => json!("x"),
            3 => json!([]),
            4 => json!({}),
            _ => json!(true),
        };
        if let Some(slot) = v.pointer_mut(path) {
            *slot = replacement;
        }
    }
    v
}

/// One runtime and one router for every case (a kube client needs a running runtime).
fn fixture() -> &'static (tokio::runtime::Runtime, axum::Router) {
    static FIXTURE: std::sync::OnceLock<(tokio::runtime::Runtime, axum::Router)> = std::sync::OnceLock::new();
    FIXTURE.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let router = rt.block_on(async { router() });
        (rt, router)
    })
}

fn run(body: Vec<u8>) -> Result<(), TestCaseError> {
    let (rt, router) = fixture();
    rt.block_on(check(router, body))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_get_a_well_formed_answer(body in prop::collection::vec(any::<u8>(), 0..512)) {
        run(body)?;
    }

    #[test]
    fn random_pods_and_reviews_get_a_well_formed_answer(
        pod in arb_pod(),
        op in prop_oneof![Just(("DELETE", None)), Just(("CREATE", Some("eviction"))), Just(("UPDATE", None))],
        dry_run in any::<bool>(),
    ) {
        run(serde_json::to_vec(&review(op.0, op.1, pod, dry_run)).unwrap())?;
    }

    #[test]
    fn mutated_reviews_get_a_well_formed_answer(
        pod in arb_pod(),
        picks in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4),
    ) {
        run(serde_json::to_vec(&mutate(review("DELETE", None, pod, false), &picks)).unwrap())?;
    }
}

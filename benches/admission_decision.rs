//! The in-memory part of an admission review: parse the Pod from `oldObject`, then let
//! the matcher decide; and what decoding one Pod watch event costs (capo's own guard
//! against kube's `DeserializeGuard`, which builds the whole object as a value tree
//! first). Run with `cargo bench --bench admission_decision`.
//!
//! Method: a realistic Pod (~3 KiB of JSON, managedFields included), 50 policies of which
//! none or one selects it; each case runs 5 x 20,000 iterations and reports the median
//! per-iteration time of the 5 rounds. Memory rows: the heap bytes one object keeps once
//! decoded (a counting allocator, 2,000 objects kept, the mean).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use capo::pod::{PodFacts, TrimmedPod};
use capo::policy::{CompiledPolicy, Matcher, RequestContext};
use serde_json::json;

fn pod_json() -> serde_json::Value {
    let managed: Vec<_> = (0..6)
        .map(|i| {
            json!({"manager": format!("m{i}"), "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {"f:app": {}, "f:tier": {}}}, "f:status": {"f:conditions": {}}}})
        })
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "redis-7", "namespace": "shop", "uid": "0b4c2f1e-7a65-4c4e-9d1a-2f3c4d5e6f70",
            "labels": {"app": "redis", "tier": "cache", "statefulset.kubernetes.io/pod-name": "redis-7", "controller-revision-hash": "redis-5d8f"},
            "annotations": {"prometheus.io/scrape": "true", "kubectl.kubernetes.io/restartedAt": "2026-11-20T10:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "redis", "uid": "1", "controller": true}],
            "managedFields": managed,
        },
        "spec": {
            "nodeName": "node-12",
            "containers": [{"name": "redis", "image": "redis:7", "ports": [{"containerPort": 6379}],
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                "env": (0..10).map(|i| json!({"name": format!("E{i}"), "value": "x".repeat(20)})).collect::<Vec<_>>()}],
        },
        "status": {"phase": "Running", "podIP": "10.42.3.17", "podIPs": [{"ip": "10.42.3.17"}, {"ip": "fd00:42::3:17"}],
            "conditions": (0..4).map(|i| json!({"type": format!("C{i}"), "status": "True"})).collect::<Vec<_>>()},
    })
}

/// Counts the heap bytes in use.
struct Counting;

static IN_USE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        IN_USE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        IN_USE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The heap bytes one value made by `make` keeps, the mean over 2,000 kept at once.
fn kept_bytes<T>(make: impl Fn() -> T) -> f64 {
    let before = IN_USE.load(Ordering::SeqCst);
    let kept: Vec<T> = (0..2_000).map(|_| make()).collect();
    let after = IN_USE.load(Ordering::SeqCst);
    drop(black_box(kept));
    (after - before) as f64 / 2_000.0
}

/// A ReservedIP as the API server returns it after the webhook's create and the leader's
/// status write: the field tracking of both writers included.
fn record_json() -> serde_json::Value {
    let spec_fields: serde_json::Map<String, serde_json::Value> =
        ["ip", "cidr", "reservation", "calicoApiGroup", "policy", "trigger", "reservedAt", "reserveFor"]
            .iter()
            .map(|f| (format!("f:{f}"), json!({})))
            .chain([(
                "f:pod".to_string(),
                json!({"f:namespace": {}, "f:name": {}, "f:uid": {}, "f:node": {},
                "f:controller": {"f:kind": {}, "f:name": {}}}),
            )])
            .collect();
    json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
        "metadata": {
            "name": "10.42.3.17", "uid": "6d1c6f0e-7b7e-4a57-9d0b-0d3c2f7a1e55", "resourceVersion": "123456",
            "generation": 1, "creationTimestamp": "2026-11-25T05:00:00Z",
            "labels": {"app.kubernetes.io/managed-by": "capo", "capo.io/policy": "statefulsets"},
            "managedFields": [
                {"manager": "capo", "operation": "Update", "apiVersion": "capo.io/v1alpha1", "time": "2026-11-25T05:00:00Z",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {".": {},
                    "f:app.kubernetes.io/managed-by": {}, "f:capo.io/policy": {}}}, "f:spec": spec_fields}},
                {"manager": "capo", "operation": "Update", "apiVersion": "capo.io/v1alpha1", "time": "2026-11-25T05:00:01Z",
                 "fieldsType": "FieldsV1", "subresource": "status", "fieldsV1": {"f:status": {".": {},
                    "f:podGoneAt": {}, "f:releaseAt": {}}}},
            ],
        },
        "spec": {"ip": "10.42.3.17", "cidr": "10.42.3.17/32", "reservation": "capo-statefulsets.3",
            "calicoApiGroup": "crd.projectcalico.org/v1", "policy": "statefulsets",
            "pod": {"namespace": "shop", "name": "redis-7", "uid": "0b4c2f1e-7a65-4c4e-9d1a-2f3c4d5e6f70",
                    "node": "node-12", "controller": {"kind": "StatefulSet", "name": "redis"}},
            "trigger": "Delete", "reservedAt": "2026-11-25T05:00:00.123456Z", "reserveFor": "40m"},
        "status": {"podGoneAt": "2026-11-25T05:00:01.000000Z", "releaseAt": "2026-11-25T05:40:01.000000Z"},
    })
}

fn matcher(selecting: bool) -> Matcher {
    let policies = (0..50).map(|i| {
        let app = if selecting && i == 49 { "redis".to_string() } else { format!("app-{i}") };
        let p: capo_api::CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": {"name": format!("p{i:02}")},
            "spec": {"namespaceSelector": {"matchLabels": {"ip-reserve": "enabled"}},
                     "podSelector": {"matchLabels": {"app": app}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]}},
        }))
        .unwrap();
        CompiledPolicy::compile(&p).unwrap()
    });
    Matcher::new(policies)
}

fn median_ns(iters: u32, mut f: impl FnMut()) -> f64 {
    let mut rounds: Vec<f64> = (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    rounds.sort_by(|a, b| a.partial_cmp(b).unwrap());
    rounds[2]
}

fn main() {
    let pod = pod_json();
    let bytes = serde_json::to_vec(&pod).unwrap();
    let ns: BTreeMap<String, String> = [("ip-reserve".to_string(), "enabled".to_string())].into();
    let ctx = RequestContext { namespace_labels: &ns, namespace_terminating: false, by_garbage_collector: false };
    println!("pod JSON: {} bytes", bytes.len());
    let facts = PodFacts::from_json(&pod).unwrap();
    println!(
        "a Pod kept as the Pod store keeps it:    {:>8.0} bytes",
        kept_bytes(|| PodFacts::from_json(&pod).unwrap())
    );
    let parse = median_ns(20_000, || {
        let v: serde_json::Value = serde_json::from_slice(black_box(&bytes)).unwrap();
        black_box(PodFacts::from_json(&v).unwrap());
    });
    println!("parse oldObject bytes -> PodFacts:        {:>8.0} ns/op", parse);
    // As the API server writes it: the type first.
    let line = format!(r#"{{"type":"MODIFIED","object":{}}}"#, serde_json::to_string(&pod).unwrap());
    type Event<K> = kube::core::WatchEvent<K>;
    let kube_guard = median_ns(20_000, || {
        black_box(serde_json::from_str::<Event<kube::core::DeserializeGuard<TrimmedPod>>>(black_box(&line)).unwrap());
    });
    println!("watch event -> kube DeserializeGuard:    {:>8.0} ns/op", kube_guard);
    let guarded = median_ns(20_000, || {
        black_box(serde_json::from_str::<Event<capo::store::Guarded<TrimmedPod>>>(black_box(&line)).unwrap());
    });
    println!("watch event -> capo Guarded:             {:>8.0} ns/op", guarded);
    for (name, selecting) in [("decide, 50 policies, none selects", false), ("decide, 50 policies, last selects", true)]
    {
        let m = matcher(selecting);
        let t = median_ns(20_000, || {
            black_box(m.decide(black_box(&facts), &ctx));
        });
        println!("{name:<40} {:>8.0} ns/op", t);
    }
    let record = serde_json::to_string(&record_json()).unwrap();
    let decode = || serde_json::from_str::<capo_api::ReservedIP>(&record).unwrap();
    println!("record JSON: {} bytes", record.len());
    println!("a ReservedIP kept whole:                 {:>8.0} bytes", kept_bytes(decode));
    println!(
        "a ReservedIP kept as the leader keeps it:{:>8.0} bytes",
        kept_bytes(|| capo::store::records::trim(decode()))
    );
}

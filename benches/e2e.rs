//! The admission path and capo's cost measured end to end on the local control plane, side
//! by side in one run, and written to `docs/performance.md`:
//!
//! - a bare API write (the reference) and a Pod DELETE with no webhook;
//! - the same DELETE through an allow-all webhook on capo's own TLS stack and webhook
//!   configuration (the floor of any webhook), through capo for a Pod it does not select,
//!   and through capo holding the IP — with the policy holding nothing yet and with 10,000
//!   held; the rows a target compares are measured side by side (alternating blocks);
//! - a storm of concurrent deletions with and without capo;
//! - the two writes of a hold on their own (what moving the record after the answer
//!   could save), and an append to the shard of the last hold beside the held deletions
//!   (what a hold adds is compared with it);
//! - what the storm's holds cost the API server in requests, besides the DELETEs;
//! - capo's RSS with 10,000 Pods cached and about 1,000 holds, and the CPU time it spends
//!   absorbing 10,000 updates of Pods it does not select.
//!
//! capo runs as its own process (release build), one replica leading. Run with
//! `make bench` (`cargo bench --bench e2e`). `CAPO_BENCH_N` (default 200) sets the
//! sequential samples, `CAPO_BENCH_STORM` (1000) the storm size, `CAPO_BENCH_PODS`
//! (10000) the Pods cached and the holds already made.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt};
use serde_json::json;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Clone, Copy)]
struct Stats {
    p50: Duration,
    p99: Duration,
    n: usize,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Stats { p50: at(0.50), p99: at(0.99), n: samples.len() }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

async fn install(client: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut crds = vec![capo_api::CapoPolicy::crd(), capo_api::ReservedIP::crd()];
    crds.extend(capo_api::CalicoApiGroup::ALL.map(|g| g.ip_reservation_crd()));
    for crd in crds {
        let name = crd.metadata.name.clone().unwrap();
        api.patch(&name, &PatchParams::apply("capo-bench").force(), &Patch::Apply(crd)).await.unwrap();
        loop {
            let c = api.get(&name).await.unwrap();
            if c.status
                .and_then(|s| s.conditions)
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Established" && c.status == "True"))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn namespace(client: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap();
    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await;
}

async fn policy(client: &Client, name: &str, ns: &str, app: &str, max: u32) {
    let policy = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": name },
        "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns } },
                  "podSelector": { "matchLabels": { "app": app } }, "reserveFor": "1h", "maxReserved": max } });
    Api::<capo_api::CapoPolicy>::all(client.clone())
        .patch(name, &PatchParams::apply("capo-bench").force(), &Patch::Apply(policy))
        .await
        .unwrap();
}

/// Starts capo (release build, its own process, leading) for `namespaces` and returns once
/// the API server calls it: a dry-run DELETE of a canary in each shows up in its metrics.
async fn start_capo(
    client: &Client,
    kubeconfig: &std::path::Path,
    namespaces: &[&str],
) -> (tokio::process::Child, u16) {
    let (port, probe) = (free_port(), free_port());
    let capo = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
        .args([
            "run",
            &format!("--webhook-addr=127.0.0.1:{port}"),
            &format!("--self-register-url=https://127.0.0.1:{port}"),
            &format!("--probe-addr=127.0.0.1:{probe}"),
            &format!("--webhook-namespaces={}", namespaces.join(",")),
            // Its own configuration: an earlier capo's clean shutdown deletes its own.
            &format!("--webhook-config-name=capo-bench-{port}"),
            "--leader-elect=false",
            "--calico-api=crd.projectcalico.org/v1",
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    for ns in namespaces {
        create_pods(client, ns, "canary", "none", 0..1).await;
        wait_called(client, ns, || async {
            let m = reqwest::get(format!("http://127.0.0.1:{probe}/metrics")).await.ok()?.text().await.ok()?;
            Some(metric(&m, "capo_admission_requests_total") as usize)
        })
        .await;
    }
    (capo, probe)
}

/// Waits until a dry-run DELETE of `ns`'s canary reaches the webhook: `calls` reads how
/// many reviews it has answered so far.
async fn wait_called<F, Fut>(client: &Client, ns: &str, calls: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Option<usize>>,
{
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    for _ in 0..300 {
        let before = calls().await.unwrap_or_default();
        let _ = pods.delete("canary-0", &DeleteParams { dry_run: true, ..Default::default() }).await;
        if calls().await.unwrap_or_default() > before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the API server never called the webhook for {ns}");
}

/// An address for the raw write measurements (no Pod has it).
fn write_ip(n: usize) -> IpAddr {
    format!("10.{}.{}.{}", 113 + n / 65536, (n / 256) % 256, n % 256).parse().unwrap()
}

/// An address in the test environment's disabled pool for hand-made addresses
/// (198.19.0.0/16: capo holds only addresses in a Calico pool), `n` modulo its 65,536.
/// The ranges the benchmark uses at once stay apart: 0.., 100,000.. (34,464..) and
/// 200,000.. (3,392..).
fn ip(n: usize) -> IpAddr {
    let n = n % 65_536;
    format!("198.19.{}.{}", n / 256, n % 256).parse().unwrap()
}

/// Creates Pods (unscheduled, so only this harness touches them) with an IP each.
async fn create_pods(client: &Client, ns: &str, prefix: &str, app: &str, range: std::ops::Range<usize>) {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    futures::stream::iter(range)
        .for_each_concurrent(32, |i| {
            let pods = pods.clone();
            async move {
                let name = format!("{prefix}-{i}");
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": { "name": name, "labels": { "app": app } },
                    "spec": { "schedulerName": "none", "containers": [{ "name": "c", "image": "x" }] },
                }))
                .unwrap();
                if pods.create(&PostParams::default(), &pod).await.is_err() {
                    return; // already there (a rerun)
                }
                let status = json!({ "status": { "phase": "Running", "podIP": ip(i).to_string(), "podIPs": [{ "ip": ip(i).to_string() }] } });
                pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
            }
        })
        .await;
}

async fn delete_each(client: &Client, ns: &str, prefix: &str, range: impl Iterator<Item = usize>) -> Vec<Duration> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let mut samples = Vec::new();
    for i in range {
        let t = Instant::now();
        pods.delete(&format!("{prefix}-{i}"), &DeleteParams::default()).await.unwrap();
        samples.push(t.elapsed());
    }
    samples
}

async fn delete_sequentially(client: &Client, ns: &str, prefix: &str, range: std::ops::Range<usize>) -> Stats {
    stats(delete_each(client, ns, prefix, range).await)
}

/// Rows compared by a target are measured side by side: the Pods of each `(namespace,
/// prefix)` are deleted one at a time in blocks of ten, the sides taking turns (and
/// starting in turn), so every row sees the same machine — the same leader work in the
/// background, the same API server load — and a ratio between rows is not the drift of a
/// shared 2-core machine between two moments. Returns each side's latencies and capo's own
/// mean time per review on that side (its `capo_admission_duration_seconds` over that
/// side's blocks; zero where capo is not called).
async fn delete_interleaved(
    client: &Client,
    probe: u16,
    sides: &[(&str, &str)],
    range: std::ops::Range<usize>,
) -> Vec<(Stats, Duration)> {
    delete_interleaved_with(client, probe, sides, None, range).await.0
}

/// As [`delete_interleaved`], with one more side taking its turn: an append of an address
/// no Pod has to the shard that holds the last IP capo held for `(namespace, prefix)`,
/// timed on its own and taken out again at once (untimed, before capo's repair would
/// adopt it). What a hold adds over "called, not selected" is compared with it: the one
/// write no hold can do without, to the same object, at the same moment.
async fn delete_interleaved_with(
    client: &Client,
    probe: u16,
    sides: &[(&str, &str)],
    append_beside: Option<(&str, &str)>,
    range: std::ops::Range<usize>,
) -> (Vec<(Stats, Duration)>, Option<Stats>) {
    const BLOCK: usize = 10;
    let inside = |m: &str| {
        let sum = metric(m, "capo_admission_duration_seconds_sum{operation=\"delete\"");
        let count = metric(m, "capo_admission_duration_seconds_count{operation=\"delete\"");
        (sum, count)
    };
    let turns = sides.len() + usize::from(append_beside.is_some());
    let mut samples = vec![Vec::new(); sides.len()];
    let mut appends = Vec::new();
    let mut own = vec![(0.0, 0.0); sides.len()];
    let indices: Vec<usize> = range.collect();
    for (b, block) in indices.chunks(BLOCK).enumerate() {
        for k in 0..turns {
            let s = (b + k) % turns;
            if s == sides.len() {
                let (ns, prefix) = append_beside.expect("an append side");
                let held = sides.iter().position(|side| *side == (ns, prefix)).expect("the held side");
                // The first turn of the append side comes after the held side's first block.
                if samples[held].is_empty() {
                    continue;
                }
                let last_held = ip(block[0].saturating_sub(1).max(indices[0]));
                appends.extend(append_each(client, last_held, block.iter().map(|i| 300_000 + i)).await);
                continue;
            }
            let (ns, prefix) = sides[s];
            let before = inside(&metrics(probe).await);
            samples[s].extend(delete_each(client, ns, prefix, block.iter().copied()).await);
            let after = inside(&metrics(probe).await);
            own[s].0 += after.0 - before.0;
            own[s].1 += after.1 - before.1;
        }
    }
    let rows = samples
        .into_iter()
        .zip(own)
        .map(|(v, (sum, count))| (stats(v), Duration::from_secs_f64(if count > 0.0 { sum / count } else { 0.0 })))
        .collect();
    (rows, append_beside.map(|_| stats(appends)))
}

/// Appends each `write_ip(i)` to the shard the record of `held` names, timing the append
/// alone (a JSON patch adding one entry, as capo's writer sends it); removes it again.
async fn append_each(client: &Client, held: IpAddr, range: impl Iterator<Item = usize>) -> Vec<Duration> {
    let records = Api::<capo_api::ReservedIP>::all(client.clone());
    let shard = records.get(&capo_api::reserved_ip::record_name(held)).await.unwrap().spec.reservation;
    let shards = Api::<DynamicObject>::all_with(client.clone(), &capo_api::CalicoApiGroup::CrdV1.ip_reservation());
    let mut samples = Vec::new();
    for i in range {
        let entry = format!("{}/32", write_ip(i));
        let add: json_patch::Patch =
            serde_json::from_value(json!([{ "op": "add", "path": "/spec/reservedCIDRs/-", "value": entry }])).unwrap();
        let t = Instant::now();
        let written = shards.patch(&shard, &PatchParams::default(), &Patch::<()>::Json(add)).await.unwrap();
        samples.push(t.elapsed());
        let list = written.data["spec"]["reservedCIDRs"].as_array().cloned().unwrap_or_default();
        let at = list.iter().position(|e| e.as_str() == Some(entry.as_str())).expect("the appended entry");
        let remove: json_patch::Patch = serde_json::from_value(json!([
            { "op": "test", "path": format!("/spec/reservedCIDRs/{at}"), "value": entry },
            { "op": "remove", "path": format!("/spec/reservedCIDRs/{at}") }
        ]))
        .unwrap();
        // capo may have written to the shard in between: find the entry again.
        if shards.patch(&shard, &PatchParams::default(), &Patch::<()>::Json(remove)).await.is_err() {
            let now = shards.get(&shard).await.unwrap();
            let list = now.data["spec"]["reservedCIDRs"].as_array().cloned().unwrap_or_default();
            if let Some(at) = list.iter().position(|e| e.as_str() == Some(entry.as_str())) {
                let remove: json_patch::Patch = serde_json::from_value(json!([
                    { "op": "test", "path": format!("/spec/reservedCIDRs/{at}"), "value": entry },
                    { "op": "remove", "path": format!("/spec/reservedCIDRs/{at}") }
                ]))
                .unwrap();
                shards.patch(&shard, &PatchParams::default(), &Patch::<()>::Json(remove)).await.unwrap();
            }
        }
    }
    samples
}

/// Deletes the Pods 50 at a time; returns the wall time and how many were refused.
async fn storm(client: &Client, ns: &str, prefix: &str, range: std::ops::Range<usize>) -> (Duration, usize) {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    futures::stream::iter(range)
        .for_each_concurrent(50, |i| {
            let pods = pods.clone();
            let refused = refused.clone();
            async move {
                if pods.delete(&format!("{prefix}-{i}"), &DeleteParams::default()).await.is_err() {
                    refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
        .await;
    (t.elapsed(), refused.load(std::sync::atomic::Ordering::Relaxed))
}

fn proc_stat(pid: u32) -> (u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (rss, ticks as f64 / 100.0)
}

/// The pid of this process's child named `comm` (a control-plane component).
fn child(comm: &str) -> Option<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (ppid == me && name.starts_with(comm)).then_some(pid)
    })
}

async fn metrics(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.unwrap().text().await.unwrap()
}

fn metric(m: &str, needle: &str) -> f64 {
    m.lines().filter(|l| l.starts_with(needle)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

/// kube-apiserver's `apiserver_request_total` for what a held deletion may cost besides the
/// DELETE itself: every request on `ipreservations`, `reservedips` (and its status) and
/// `events`, every request on `pods` but a DELETE, and every create, update or delete of a
/// ConfigMap (the leader's countdowns; the benchmark's own ConfigMap writes are PATCHes).
/// (resource/subresource verb, count).
async fn hold_requests(client: &Client) -> std::collections::BTreeMap<String, f64> {
    let req = axum::http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    let mut out = std::collections::BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let label = |k: &str| {
            l.split_once(&format!("{k}=\"")).and_then(|(_, r)| r.split_once('"')).map_or("", |(v, _)| v).to_string()
        };
        let (resource, sub, verb) = (label("resource"), label("subresource"), label("verb"));
        let counted = matches!(resource.as_str(), "ipreservations" | "reservedips" | "events")
            || (resource == "pods" && verb != "DELETE")
            || (resource == "configmaps" && matches!(verb.as_str(), "POST" | "PUT" | "DELETE"));
        if !counted || label("group") == "coordination.k8s.io" {
            continue;
        }
        let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        let key = if sub.is_empty() { format!("{verb} {resource}") } else { format!("{verb} {resource}/{sub}") };
        *out.entry(key).or_insert(0.0) += v;
    }
    out
}

/// What `after` adds to `before`, per key, leaving out keys that did not change.
fn requests_between(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> Vec<(String, f64)> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect()
}

/// Waits (up to a minute) until capo's leader has no work queued: the holds' countdowns
/// written, so what they cost the API server is all in.
async fn leader_idle(probe: u16) {
    for _ in 0..600 {
        if metric(&metrics(probe).await, "capo_release_queue_depth") == 0.0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A webhook that allows everything, on capo's own TLS server and with capo's own webhook
/// configuration (rules, matchConditions, timeouts): what any webhook costs at least.
async fn allow_all(client: &Client, ns: &str) -> (capo::server::WebhookServer, Arc<std::sync::atomic::AtomicUsize>) {
    use axum::routing::post;
    use kube::core::admission::{AdmissionResponse, AdmissionReview};
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    let router = axum::Router::new().route(
        capo::admission::REVIEW_PATH,
        post(move |body: Bytes| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let review: AdmissionReview<DynamicObject> = serde_json::from_slice(&body).unwrap();
                let req: kube::core::admission::AdmissionRequest<DynamicObject> = review.try_into().unwrap();
                axum::Json(AdmissionResponse::from(&req).into_review())
            }
        }),
    );
    let made = capo::certs::self_signed(&["127.0.0.1".to_string()]).unwrap();
    let serving = capo::certs::ServingCert::new(None);
    serving.set("the bench certificate", &made.cert_pem, &made.key_pem).unwrap();
    let server = capo::server::WebhookServer::start(
        "127.0.0.1:0".parse().unwrap(),
        router,
        serving,
        Default::default(),
        capo::metrics::Metrics::new().connections,
        &Default::default(),
    )
    .await
    .unwrap();
    let reg = capo::webhook_config::Registration {
        name: "capo-bench-allow-all".into(),
        url: format!("https://{}", server.addr),
        ca_pem: Some(made.ca_pem.clone()),
        excluded_namespaces: vec!["kube-system".into()],
        only_namespaces: Some(vec![ns.to_string()]),
        timeout_seconds: 10,
    };
    capo::webhook_config::apply(client, &reg).await.unwrap();
    create_pods(client, ns, "canary", "none", 0..1).await;
    let c = calls.clone();
    wait_called(client, ns, || {
        let n = c.load(std::sync::atomic::Ordering::Relaxed);
        async move { Some(n) }
    })
    .await;
    (server, calls)
}

/// The two writes of a hold, each on its own and both at once, as the API server answers
/// them: an entry appended to a shard, and a record created.
async fn hold_writes(client: &Client, n: usize) -> (Stats, Stats, Stats) {
    let shards = Api::<DynamicObject>::all_with(client.clone(), &capo_api::CalicoApiGroup::CrdV1.ip_reservation());
    let mut obj = DynamicObject::new("capo-bench-writes", &capo_api::CalicoApiGroup::CrdV1.ip_reservation());
    obj.metadata.labels = Some([("app.kubernetes.io/managed-by".to_string(), "capo".to_string())].into());
    obj.data = json!({ "spec": { "reservedCIDRs": [] } });
    let _ = shards.create(&PostParams::default(), &obj).await;
    let records = Api::<capo_api::ReservedIP>::all(client.clone());
    let append = |i: usize| {
        let shards = shards.clone();
        async move {
            let patch: json_patch::Patch = serde_json::from_value(json!([
                { "op": "add", "path": "/spec/reservedCIDRs/-", "value": format!("{}/32", write_ip(i)) }
            ]))
            .unwrap();
            shards.patch("capo-bench-writes", &PatchParams::default(), &Patch::<()>::Json(patch)).await.unwrap();
        }
    };
    let record = |i: usize| {
        let records = records.clone();
        async move {
            let ip = write_ip(i);
            let r: capo_api::ReservedIP = serde_json::from_value(json!({
                "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
                "metadata": { "name": format!("bench-{i}"), "labels": { "capo-bench": "writes" } },
                "spec": { "ip": ip.to_string(), "cidr": format!("{ip}/32"), "reservation": "capo-bench-writes",
                          "calicoApiGroup": "crd.projectcalico.org/v1", "policy": "bench-writes",
                          "pod": { "namespace": "bench", "name": "p", "uid": "u" }, "trigger": "Delete",
                          "reservedAt": k8s_openapi::jiff::Timestamp::now(), "reserveFor": "1h" },
            }))
            .unwrap();
            records.create(&PostParams::default(), &r).await.unwrap();
        }
    };
    let (mut a, mut r, mut both) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let t = Instant::now();
        append(i).await;
        a.push(t.elapsed());
        let t = Instant::now();
        record(i).await;
        r.push(t.elapsed());
        let t = Instant::now();
        tokio::join!(append(n + i), record(n + i));
        both.push(t.elapsed());
    }
    (stats(a), stats(r), stats(both))
}

/// Removes what [`hold_writes`] wrote: its records and its reservation are measurements,
/// not holds (capo would adopt the entries as orphans and count them in its memory).
async fn remove_hold_writes(client: &Client) {
    let records = Api::<capo_api::ReservedIP>::all(client.clone());
    let lp = kube::api::ListParams::default().labels("capo-bench=writes");
    records.delete_collection(&DeleteParams::default(), &lp).await.unwrap();
    let shards = Api::<DynamicObject>::all_with(client.clone(), &capo_api::CalicoApiGroup::CrdV1.ip_reservation());
    shards.delete("capo-bench-writes", &DeleteParams::default()).await.unwrap();
    for _ in 0..300 {
        if records.list(&lp).await.unwrap().items.is_empty()
            && shards.get_opt("capo-bench-writes").await.unwrap().is_none()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the benchmark's own records and reservation were not removed");
}

#[tokio::main]
async fn main() {
    let n = env("CAPO_BENCH_N", 200);
    let storm_n = env("CAPO_BENCH_STORM", 1000);
    let big = env("CAPO_BENCH_PODS", 10_000);
    let shared = capo_testenv::shared();
    let client = shared.client().await;
    install(&client).await;
    // capo-system: capo's namespace, where its leader keeps the countdowns.
    for ns in ["bench", "bench-allow", "bench-storm", "bench-big", "bench-zero", "capo-system"] {
        namespace(&client, ns).await;
    }

    // The reference: one bare API write.
    let cms = Api::<ConfigMap>::namespaced(client.clone(), "bench");
    let cm: ConfigMap = serde_json::from_value(json!({ "metadata": { "name": "rtt" }, "data": { "n": "0" } })).unwrap();
    let _ = cms.create(&PostParams::default(), &cm).await;
    let mut samples = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        cms.patch("rtt", &PatchParams::default(), &Patch::Merge(json!({ "data": { "n": i.to_string() } })))
            .await
            .unwrap();
        samples.push(t.elapsed());
    }
    let bare = stats(samples);
    eprintln!("bare write: p50 {} p99 {}", ms(bare.p50), ms(bare.p99));

    // No webhook: one at a time, and a storm.
    create_pods(&client, "bench", "plain", "none", 0..n).await;
    let plain = delete_sequentially(&client, "bench", "plain", 0..n).await;
    eprintln!("delete, no webhook: p50 {} p99 {}", ms(plain.p50), ms(plain.p99));
    create_pods(&client, "bench-storm", "plain", "redis", 0..storm_n).await;
    let (storm_plain, _) = storm(&client, "bench-storm", "plain", 0..storm_n).await;
    eprintln!("storm of {storm_n}, no webhook: {storm_plain:?}");

    // The writes of a hold, on their own.
    let (entry_write, record_write, both_writes) = hold_writes(&client, n).await;
    eprintln!(
        "entry append p50 {}, record create p50 {}, both at once p50 {}",
        ms(entry_write.p50),
        ms(record_write.p50),
        ms(both_writes.p50)
    );
    remove_hold_writes(&client).await;

    // capo, and beside it the floor of any webhook.
    policy(&client, "bench", "bench", "redis", 12_000).await;
    policy(&client, "bench-storm", "bench-storm", "redis", 12_000).await;
    policy(&client, "bench-big", "bench-big", "redis", 12_000).await;
    policy(&client, "bench-zero", "bench-zero", "redis", 12_000).await;
    let (mut capo, probe) =
        start_capo(&client, &shared.kubeconfig, &["bench", "bench-storm", "bench-big", "bench-zero"]).await;
    let pid = capo.id().unwrap();
    let (allow, _) = allow_all(&client, "bench-allow").await;
    create_pods(&client, "bench-allow", "plain", "redis", 0..n).await;
    create_pods(&client, "bench", "skipped", "web", 0..n).await;
    create_pods(&client, "bench", "held", "redis", 0..n).await;
    let (rows, append_beside) = delete_interleaved_with(
        &client,
        probe,
        &[("bench-allow", "plain"), ("bench", "skipped"), ("bench", "held")],
        Some(("bench", "held")),
        0..n,
    )
    .await;
    let [(allowed, _), (skipped, skipped_inside), (held0, held_inside)] = rows[..] else { unreachable!() };
    let append_beside = append_beside.expect("measured");
    eprintln!(
        "append to the held Pods' shard, beside them: p50 {} p99 {}",
        ms(append_beside.p50),
        ms(append_beside.p99)
    );
    // The same storm through the allow-all webhook, and through capo for Pods it does not
    // select: what being called costs a storm, before any hold is written.
    let apiserver = child("kube-apiserve").unwrap_or(0);
    let storm_through = |ns: &'static str, prefix: &'static str, app: &'static str| {
        let client = client.clone();
        async move {
            create_pods(&client, ns, prefix, app, 0..storm_n).await;
            let api_before = proc_stat(apiserver).1;
            let (wall, refused) = storm(&client, ns, prefix, 0..storm_n).await;
            assert_eq!(refused, 0, "a storm through a webhook that holds nothing refused {refused}");
            (wall, proc_stat(apiserver).1 - api_before)
        }
    };
    let (storm_allowed, storm_allowed_api) = storm_through("bench-allow", "stormy", "redis").await;
    eprintln!("storm of {storm_n}, allow-all webhook: {storm_allowed:?}");
    let (storm_skipped, storm_skipped_api) = storm_through("bench", "stormskip", "web").await;
    eprintln!("storm of {storm_n}, capo called, not selected: {storm_skipped:?}");
    allow.shutdown(Duration::from_secs(1)).await;
    let _ = capo::webhook_config::delete(&client, "capo-bench-allow-all").await;
    eprintln!("delete, allow-all webhook: p50 {} p99 {}", ms(allowed.p50), ms(allowed.p99));
    eprintln!("delete, capo called, not selected: p50 {} p99 {}", ms(skipped.p50), ms(skipped.p99));
    eprintln!("delete, capo holding (policy holding 0 → {n}): p50 {} p99 {}", ms(held0.p50), ms(held0.p99));
    create_pods(&client, "bench-storm", "held", "redis", 100_000..100_000 + storm_n).await;
    let (_, storm_cpu_before) = proc_stat(pid);
    let (_, storm_api_before) = proc_stat(apiserver);
    leader_idle(probe).await;
    let requests_before = hold_requests(&client).await;
    let (storm_capo, storm_refused) = storm(&client, "bench-storm", "held", 100_000..100_000 + storm_n).await;
    let storm_cpu = proc_stat(pid).1 - storm_cpu_before;
    let storm_api = proc_stat(apiserver).1 - storm_api_before;
    let m = metrics(probe).await;
    let storm_held = metric(&m, "capo_holds_total{policy=\"bench-storm\"");
    eprintln!("storm of {storm_n} with capo: {storm_capo:?}, refused {storm_refused}, held {storm_held}");
    // What the storm's holds cost the API server besides their DELETEs, the leader's
    // countdowns included.
    leader_idle(probe).await;
    let storm_requests = requests_between(&requests_before, &hold_requests(&client).await);
    let storm_per_hold = storm_requests.iter().map(|(_, d)| d).sum::<f64>() / storm_held.max(1.0);
    eprintln!("requests per held deletion in the storm, besides the DELETE: {storm_per_hold:.2} {storm_requests:?}");

    // Memory with `big` Pods cached and about a thousand holds; CPU for `big` updates of
    // Pods capo does not select.
    // Labelled so that no policy selects them while their updates are measured; the
    // policy takes them up afterwards, to make the holds.
    create_pods(&client, "bench-big", "cached", "later", 200_000..200_000 + big).await;
    let seen = |m: &str| metric(m, "capo_pod_events_total");
    let settle = async |target: f64| {
        for _ in 0..600 {
            if seen(&metrics(probe).await) >= target {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    settle(seen(&metrics(probe).await)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss, cpu_before) = proc_stat(pid);
    let m = metrics(probe).await;
    let holds_now = metric(&m, "capo_held_ips");
    for l in m.lines().filter(|l| l.starts_with("capo_held_ips")) {
        eprintln!("  {l}");
    }
    eprintln!("capo RSS with {big} Pods cached and {holds_now} holds: {} MiB", rss / 1024);
    let events_before = seen(&metrics(probe).await);
    let pods = Api::<Pod>::namespaced(client.clone(), "bench-big");
    futures::stream::iter(200_000..200_000 + big)
        .for_each_concurrent(32, |i| {
            let pods = pods.clone();
            async move {
                let patch = json!({ "metadata": { "labels": { "tier": "updated" } } });
                pods.patch(&format!("cached-{i}"), &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
            }
        })
        .await;
    settle(events_before + big as f64).await;
    let (_, cpu_after) = proc_stat(pid);
    let update_cpu = cpu_after - cpu_before;
    eprintln!("capo CPU for {big} Pod updates that select nothing: {update_cpu:.2} s");

    // Holding with `big` already held: the cached Pods are selected; delete them all.
    policy(&client, "bench-big", "bench-big", "later", 12_000).await;
    let selected = || async {
        metric(&metrics(probe).await, "capo_admission_requests_total{operation=\"delete\",outcome=\"dry_run\"}")
    };
    let before = selected().await;
    let cached = Api::<Pod>::namespaced(client.clone(), "bench-big");
    for _ in 0..300 {
        let _ = cached.delete("cached-200000", &DeleteParams { dry_run: true, ..Default::default() }).await;
        if selected().await > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, prefill_cpu_before) = proc_stat(pid);
    let (_, prefill_api_before) = proc_stat(apiserver);
    let (prefill, _) = storm(&client, "bench-big", "cached", 200_000..200_000 + big).await;
    let prefill_cpu = proc_stat(pid).1 - prefill_cpu_before;
    let prefill_api = proc_stat(apiserver).1 - prefill_api_before;
    eprintln!("capo CPU while {big} holds were made: {prefill_cpu:.1} s");
    eprintln!("{big} holds made in {prefill:?}");
    // The leader has its own work for every new hold (its countdown): measured once it has
    // caught up, so the row shows what a hold costs with this many held, not with this many
    // still being counted down.
    let caught_up = Instant::now();
    for _ in 0..6000 {
        let m = metrics(probe).await;
        if metric(&m, "capo_release_queue_depth") == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let caught_up = caught_up.elapsed();
    eprintln!("the leader caught up {caught_up:?} after the last of the {big} holds");
    // Side by side: a policy holding `big` and one holding none yet, in the same capo.
    create_pods(&client, "bench-big", "held", "later", 0..n).await;
    create_pods(&client, "bench-zero", "held", "redis", 0..n).await;
    let rows = delete_interleaved(&client, probe, &[("bench-zero", "held"), ("bench-big", "held")], 0..n).await;
    let [(held_zero, zero_inside), (held_big, big_inside)] = rows[..] else { unreachable!() };
    eprintln!("capo's own time per held review with {big} held: {} (0 held: {})", ms(big_inside), ms(zero_inside));
    eprintln!("delete, capo holding ({big} already held): p50 {} p99 {}", ms(held_big.p50), ms(held_big.p99));
    eprintln!("delete, capo holding (beside it, 0 held): p50 {} p99 {}", ms(held_zero.p50), ms(held_zero.p99));
    let _ = capo.kill().await;

    let cores = std::thread::available_parallelism().map_or(0, |p| p.get());
    let mut doc = String::new();
    let _ = writeln!(doc, "# Performance\n");
    let _ = writeln!(
        doc,
        "Generated by `make bench` (`cargo bench --bench e2e`, release build) on the local control plane: \
         kube-apiserver, etcd, controller-manager, scheduler and kwok from `hack/`, capo as its own process, \
         one replica leading, all on this machine ({cores} cores). One run; {n} sequential samples per latency \
         row, storms of {storm_n} Pods deleted 50 at a time. Pods are unscheduled, so a DELETE completes at once \
         and only the admission path differs between rows. Policies have `maxReserved: 12000` (24 shards). \
         Rows a target compares are measured side by side, in alternating blocks of ten deletions: the \
         allow-all webhook, \"not selected\", \"policy holding 0\" and one append to the shard of the last hold \
         together, with capo running; \"holding {big}\" with a second policy holding none beside it. The storm \
         runs three times with capo running: through the allow-all webhook, through capo for Pods it does not \
         select, then held; kube-apiserver's CPU is read from `/proc` around each. The storm's \
         requests are counted from kube-apiserver's `apiserver_request_total` before the storm and once capo's \
         leader has no work queued after it. The holds of the storm and of \
         the {big} are made in between; the RSS row is measured after the storm, before the {big} holds.\n"
    );
    let _ = writeln!(doc, "| measurement | p50 | p99 |\n| --- | --- | --- |");
    for (what, s) in [
        ("bare API write (ConfigMap PATCH), the reference", &bare),
        ("Pod DELETE, no webhook", &plain),
        ("Pod DELETE, allow-all webhook on capo's TLS stack and configuration", &allowed),
        ("Pod DELETE, capo called, Pod not selected", &skipped),
        ("Pod DELETE, capo holds its IP, policy holding 0 at the start", &held0),
        (
            &format!(
                "Pod DELETE, capo holds its IP, policy holding 0 at the start, beside the next row ({big} more held by capo)"
            ),
            &held_zero,
        ),
        (&format!("Pod DELETE, capo holds its IP, policy holding {big}"), &held_big),
        (
            "one entry appended to the shard of the held Pods' last hold, beside the rows above (API write)",
            &append_beside,
        ),
        ("a hold's entry append on its own (API write)", &entry_write),
        ("a hold's record create on its own (API write)", &record_write),
        ("both at once, as capo writes them", &both_writes),
    ] {
        let _ = writeln!(doc, "| {what} (n={}) | {} | {} |", s.n, ms(s.p50), ms(s.p99));
    }
    let _ = writeln!(doc);
    let _ = writeln!(doc, "| other | measured |\n| --- | --- |");
    let _ = writeln!(doc, "| storm of {storm_n}, no webhook | {:.2} s |", storm_plain.as_secs_f64());
    let _ = writeln!(
        doc,
        "| storm of {storm_n}, allow-all webhook; kube-apiserver CPU during it | {:.2} s ({:.2}× no webhook); {storm_allowed_api:.2} s |",
        storm_allowed.as_secs_f64(),
        storm_allowed.as_secs_f64() / storm_plain.as_secs_f64()
    );
    let _ = writeln!(
        doc,
        "| storm of {storm_n}, capo called, not selected; kube-apiserver CPU during it | {:.2} s ({:.2}× no webhook); {storm_skipped_api:.2} s |",
        storm_skipped.as_secs_f64(),
        storm_skipped.as_secs_f64() / storm_plain.as_secs_f64()
    );
    let _ = writeln!(
        doc,
        "| storm of {storm_n}, capo holding | {:.2} s, {storm_refused} refused, {storm_held} held |",
        storm_capo.as_secs_f64()
    );
    let _ = writeln!(
        doc,
        "| CPU during the storm of {storm_n}: capo; kube-apiserver | {storm_cpu:.2} s; {storm_api:.2} s |"
    );
    let per_kind: Vec<String> =
        storm_requests.iter().map(|(k, d)| format!("{k} {:.2}", d / storm_held.max(1.0))).collect();
    let _ = writeln!(
        doc,
        "| API requests per held deletion in the storm of {storm_n}, besides its DELETE (kube-apiserver's `apiserver_request_total`, the leader's work for them included) | {storm_per_hold:.2}: {} |",
        per_kind.join(", ")
    );
    let _ = writeln!(
        doc,
        "| capo's own time per review (mean, its `capo_admission_duration_seconds`): not selected / holding | {} / {} |",
        ms(skipped_inside),
        ms(held_inside)
    );
    let _ = writeln!(doc, "| capo RSS, {big} Pods cached and {holds_now} holds | {} MiB |", rss / 1024);
    let _ = writeln!(doc, "| capo CPU for {big} updates of Pods it does not select | {update_cpu:.2} s |");
    let _ = writeln!(
        doc,
        "| {big} holds made by a storm (50 at a time): wall; CPU meanwhile of capo; of kube-apiserver | {:.1} s; {prefill_cpu:.1} s; {prefill_api:.1} s |",
        prefill.as_secs_f64()
    );
    let _ = writeln!(
        doc,
        "| the leader's work for those {big} holds done (queue empty) after the storm | {:.2} s |",
        caught_up.as_secs_f64()
    );
    let _ = writeln!(
        doc,
        "| capo's own time per held review with {big} held / 0 held beside it (mean) | {} / {} |\n",
        ms(big_inside),
        ms(zero_inside)
    );

    let yes = |b: bool| if b { "yes" } else { "no" };
    let r_big = held_big.p50.as_secs_f64() / held_zero.p50.as_secs_f64();
    let added = held0.p50.saturating_sub(skipped.p50);
    let r_skip = skipped.p50.as_secs_f64() / allowed.p50.as_secs_f64();
    let r_storm = storm_capo.as_secs_f64() / storm_plain.as_secs_f64();
    let _ = writeln!(doc, "| target | measured | met |\n| --- | --- | --- |");
    let _ = writeln!(
        doc,
        "| held DELETE p50 with {big} held ≤ 1.2 × with 0 held | {} vs {} ({r_big:.2}×) | {} |",
        ms(held_big.p50),
        ms(held_zero.p50),
        yes(r_big <= 1.2)
    );
    let r_added = added.as_secs_f64() / append_beside.p50.as_secs_f64();
    let _ = writeln!(
        doc,
        "| what a hold adds over \"capo called, not selected\" (p50) ≤ 1.2 × one append to the same shard beside it | {} added vs {} ({r_added:.2}×) | {} |",
        ms(added),
        ms(append_beside.p50),
        yes(r_added <= 1.2)
    );
    let _ = writeln!(
        doc,
        "| requests per held deletion besides the DELETE, in the storm ≤ 1.3 (at a StatefulSet's pace: `make bench-calls`) | {storm_per_hold:.2} | {} |",
        yes(storm_per_hold <= 1.3)
    );
    let _ = writeln!(
        doc,
        "| \"capo called, not selected\" ≤ 1.2 × the allow-all webhook | {} vs {} ({r_skip:.2}×) | {} |",
        ms(skipped.p50),
        ms(allowed.p50),
        yes(r_skip <= 1.2)
    );
    let _ = writeln!(
        doc,
        "| storm of {storm_n}: 0 refused, every IP held, wall ≤ 2.0 × without capo (stretch 1.5×) | {:.2} s vs {:.2} s ({r_storm:.2}×), {storm_refused} refused, {storm_held} held | {} |",
        storm_capo.as_secs_f64(),
        storm_plain.as_secs_f64(),
        yes(r_storm <= 2.0 && storm_refused == 0 && storm_held as usize == storm_n)
    );
    let _ = writeln!(
        doc,
        "| RSS ≤ 40 MiB at {big} Pods and ~1,000 holds | {} MiB | {} |",
        rss / 1024,
        yes(rss / 1024 <= 40)
    );
    let _ = writeln!(
        doc,
        "| {big} unselected Pod updates cost ≤ 1 CPU-second of capo | {update_cpu:.2} s | {} |",
        yes(update_cpu <= 1.0)
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/performance.md");
    let notes = std::fs::read_to_string(&path)
        .ok()
        .and_then(|old| old.split_once("\n## Notes").map(|(_, n)| format!("\n## Notes{n}")))
        .unwrap_or_default();
    std::fs::write(&path, format!("{doc}{notes}")).unwrap();
    eprintln!("wrote {}", path.display());
}

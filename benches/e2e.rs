//! The admission path measured end to end on the local control plane, side by side in one
//! run: a bare API write (the reference), a Pod DELETE with no webhook, the same DELETE
//! with capo (release build, a separate process) holding the IP or skipping the Pod, and
//! a storm of concurrent deletions with and without capo; then capo's RSS with many Pods
//! cached and many holds. Writes `docs/performance.md`.
//!
//! Run with `make bench` (`cargo bench --bench e2e`). `CAPO_BENCH_N` (default 200)
//! sets the sequential samples, `CAPO_BENCH_STORM` (1000) the storm size,
//! `CAPO_BENCH_PODS` (10000) the Pods cached for the memory figure.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt};
use serde_json::json;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

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

/// Starts capo (release build, its own process) with `extra` flags and returns once the
/// API server calls it: a dry-run DELETE of the selected canary shows up in its metrics.
async fn start_capo(
    client: &Client,
    kubeconfig: &std::path::Path,
    ns: &str,
    extra: &[&str],
) -> (tokio::process::Child, u16) {
    let (port, probe) = (free_port(), free_port());
    let capo = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
        .args([
            &format!("--webhook-addr=127.0.0.1:{port}"),
            &format!("--self-register-url=https://127.0.0.1:{port}"),
            &format!("--probe-addr=127.0.0.1:{probe}"),
            &format!("--webhook-namespaces={ns}"),
            "--leader-elect=false",
            "--calico-api=crd.projectcalico.org/v1",
        ])
        .args(extra)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    loop {
        let _ = pods.delete("canary-0", &DeleteParams { dry_run: true, ..Default::default() }).await;
        if let Ok(m) = reqwest::get(format!("http://127.0.0.1:{probe}/metrics")).await
            && m.text().await.unwrap_or_default().contains("outcome=\"dry_run\"")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (capo, probe)
}

fn ip(n: usize) -> IpAddr {
    format!("10.{}.{}.{}", 100 + n / 65536, (n / 256) % 256, n % 256).parse().unwrap()
}

/// Creates Pods (unscheduled, so only this harness touches them) with an IP each.
async fn create_pods(client: &Client, ns: &str, prefix: &str, app: &str, range: std::ops::Range<usize>) {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    futures::stream::iter(range)
        .for_each_concurrent(32, |i| {
            let pods = pods.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": { "name": format!("{prefix}-{i}"), "labels": { "app": app } },
                    "spec": { "schedulerName": "none", "containers": [{ "name": "c", "image": "x" }] },
                }))
                .unwrap();
                let name = format!("{prefix}-{i}");
                pods.create(&PostParams::default(), &pod).await.unwrap();
                let status = json!({ "status": { "phase": "Running", "podIP": ip(i).to_string(), "podIPs": [{ "ip": ip(i).to_string() }] } });
                pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
            }
        })
        .await;
}

async fn delete_sequentially(client: &Client, ns: &str, prefix: &str, n: usize) -> Stats {
    delete_sequentially_from(client, ns, prefix, 0, n).await
}

async fn delete_sequentially_from(client: &Client, ns: &str, prefix: &str, start: usize, n: usize) -> Stats {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let mut samples = Vec::new();
    for i in start..start + n {
        let t = Instant::now();
        pods.delete(&format!("{prefix}-{i}"), &DeleteParams::default()).await.unwrap();
        samples.push(t.elapsed());
    }
    stats(samples)
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

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

async fn metrics(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.unwrap().text().await.unwrap()
}

/// The p99 of capo's own handler time for an outcome, from its histogram buckets (upper
/// bound of the bucket holding the 99th percentile).
fn handler_p99(metrics: &str, outcome: &str) -> Option<f64> {
    let mut buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("capo_admission_duration_seconds_bucket") && l.contains(&format!("outcome=\"{outcome}\""))
        })
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    let total = buckets.last()?.1;
    buckets.iter().find(|(_, c)| *c >= 0.99 * total).map(|(le, _)| *le)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::main]
async fn main() {
    let n = env("CAPO_BENCH_N", 200);
    let storm_n = env("CAPO_BENCH_STORM", 1000);
    let cached = env("CAPO_BENCH_PODS", 10_000);
    let shared = capo_testenv::shared();
    let client = shared.client().await;
    install(&client).await;
    let ns = "bench";
    let _ = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap())
        .await;

    // The reference: one bare API write.
    let cms = Api::<ConfigMap>::namespaced(client.clone(), ns);
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

    // DELETE and a storm with no webhook.
    create_pods(&client, ns, "plain", "redis", 0..n).await;
    let plain = delete_sequentially(&client, ns, "plain", n).await;
    eprintln!("delete, no webhook: p50 {} p99 {}", ms(plain.p50), ms(plain.p99));
    create_pods(&client, ns, "storm0", "redis", 0..storm_n).await;
    let (storm_plain, _) = storm(&client, ns, "storm0", 0..storm_n).await;
    eprintln!("storm of {storm_n}, no webhook: {storm_plain:?}");

    let policy = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": "bench" },
        "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns } },
                  "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": 100000 } });
    Api::<capo_api::CapoPolicy>::all(client.clone())
        .patch("bench", &PatchParams::apply("capo-bench").force(), &Patch::Apply(policy))
        .await
        .unwrap();
    create_pods(&client, ns, "canary", "redis", 0..1).await;

    // What TCP_NODELAY on capo's connections to the API server is worth: two capos side
    // by side, one with kube's default connector (Nagle on), each with its own namespace,
    // policy and reservation (both start empty), their deletions interleaved.
    let mut ab = Vec::new();
    for (side, extra) in [("off", "--api-tcp-nodelay=false"), ("on", "--api-tcp-nodelay=true")] {
        let side_ns = format!("bench-nodelay-{side}");
        let _ = Api::<Namespace>::all(client.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": side_ns } })).unwrap(),
            )
            .await;
        let name = format!("bench-nodelay-{side}");
        let policy = json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": name },
            "spec": { "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": side_ns } },
                      "podSelector": {}, "reserveFor": "1h", "maxReserved": 100000 } });
        Api::<capo_api::CapoPolicy>::all(client.clone())
            .patch(&name, &PatchParams::apply("capo-bench").force(), &Patch::Apply(policy))
            .await
            .unwrap();
        create_pods(&client, &side_ns, "canary", "redis", 0..1).await;
        let start = 300_000 + if side == "on" { 10_000 } else { 0 };
        create_pods(&client, &side_ns, "ab", "redis", start..start + n).await;
        let config = format!("--webhook-config-name={name}");
        let prefix = format!("--policy-prefix={name}");
        let (child, _) = start_capo(&client, &shared.kubeconfig, &side_ns, &[extra, &config, &prefix]).await;
        ab.push((child, side_ns, start, Vec::new()));
    }
    for i in 0..n {
        for (_, side_ns, start, samples) in ab.iter_mut() {
            let pods = Api::<Pod>::namespaced(client.clone(), side_ns);
            let t = Instant::now();
            pods.delete(&format!("ab-{}", *start + i), &DeleteParams::default()).await.unwrap();
            samples.push(t.elapsed());
        }
    }
    let mut ab_stats = Vec::new();
    for (mut child, _, _, samples) in ab {
        let _ = child.kill().await;
        ab_stats.push(stats(samples));
    }
    let (nagle, nodelay) = (ab_stats.remove(0), ab_stats.remove(0));
    eprintln!("delete, capo holding, API connections without TCP_NODELAY: p50 {} p99 {}", ms(nagle.p50), ms(nagle.p99));
    eprintln!(
        "delete, capo holding, API connections with TCP_NODELAY: p50 {} p99 {}",
        ms(nodelay.p50),
        ms(nodelay.p99)
    );

    // capo, release build, its own process.
    let (mut capo, probe) = start_capo(&client, &shared.kubeconfig, ns, &["--webhook-config-name=capo-bench"]).await;
    create_pods(&client, ns, "held", "redis", 0..n).await;
    let held = delete_sequentially(&client, ns, "held", n).await;
    eprintln!("delete, capo holding: p50 {} p99 {}", ms(held.p50), ms(held.p99));
    create_pods(&client, ns, "skipped", "web", 0..n).await;
    let skipped = delete_sequentially(&client, ns, "skipped", n).await;
    eprintln!("delete, capo skipping: p50 {} p99 {}", ms(skipped.p50), ms(skipped.p99));
    create_pods(&client, ns, "storm1", "redis", 100_000..100_000 + storm_n).await;
    let (storm_capo, storm_refused) = storm(&client, ns, "storm1", 100_000..100_000 + storm_n).await;
    let m = metrics(probe).await;
    let held_total: f64 = m
        .lines()
        .filter(|l| l.starts_with("capo_holds_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    eprintln!("storm of {storm_n} with capo: {storm_capo:?}, refused {storm_refused}, holds_total {held_total}");
    let skip_p99 = handler_p99(&m, "skipped");

    // Memory: many Pods with IPs in capo's cache, and the holds above.
    create_pods(&client, ns, "cached", "web", 200_000..200_000 + cached).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = capo.id().unwrap();
    let rss = rss_kib(pid);
    eprintln!("capo RSS with {cached} Pods cached and {held_total} holds: {} MiB", rss / 1024);
    let _ = capo.kill().await;

    let added = held.p50.saturating_sub(plain.p50);
    let mut doc = String::new();
    let _ = writeln!(doc, "# Performance\n");
    let _ = writeln!(
        doc,
        "Generated by `make bench` (`cargo bench --bench e2e`, release build) on the local control plane: \
         kube-apiserver, etcd, controller-manager, scheduler and kwok from `hack/`, capo as its own process \
         with leader election off, all on this machine ({} cores). One run; {n} sequential samples per latency \
         row, storms of {storm_n} Pods deleted 50 at a time. Pods are unscheduled, so a DELETE completes at once \
         and only the admission path differs between rows.\n",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );
    let _ = writeln!(doc, "| measurement | p50 | p99 |\n| --- | --- | --- |");
    for (what, s) in [
        ("bare API write (ConfigMap PATCH), the reference", &bare),
        ("Pod DELETE, no webhook", &plain),
        ("Pod DELETE, capo holds its IP", &held),
        ("Pod DELETE, capo holds its IP; side by side: capo's API connections with TCP_NODELAY", &nodelay),
        ("Pod DELETE, capo holds its IP; side by side: capo's API connections without TCP_NODELAY", &nagle),
        ("Pod DELETE, capo called, Pod not selected", &skipped),
    ] {
        let _ = writeln!(doc, "| {what} (n={}) | {} | {} |", s.n, ms(s.p50), ms(s.p99));
    }
    let _ = writeln!(doc);
    let target_latency = added.as_secs_f64() <= 1.2 * bare.p50.as_secs_f64();
    let ratio = storm_capo.as_secs_f64() / storm_plain.as_secs_f64();
    let _ = writeln!(doc, "| target | measured | met |\n| --- | --- | --- |");
    let _ = writeln!(
        doc,
        "| added DELETE latency p50 ≤ 1.2 × bare write p50 | {} added vs {} | {} |",
        ms(added),
        ms(bare.p50.mul_f64(1.2)),
        if target_latency { "yes" } else { "no" }
    );
    let _ = writeln!(
        doc,
        "| storm of {storm_n}: every IP held, none denied, wall ≤ 1.5 × without capo | {:.2} s vs {:.2} s ({ratio:.2}×), {storm_refused} refused, {held_total} holds counted | {} |",
        storm_capo.as_secs_f64(),
        storm_plain.as_secs_f64(),
        if ratio <= 1.5 && storm_refused == 0 { "yes" } else { "no" }
    );
    let _ = writeln!(
        doc,
        "| a non-selected Pod: no API call, handler ≤ 200 µs p99 | handler p99 ≤ {} (histogram bucket bound) | {} |",
        skip_p99.map_or("?".into(), |s| format!("{:.0} µs", s * 1e6)),
        if skip_p99.is_some_and(|s| s <= 0.0002) { "yes" } else { "see note" }
    );
    let _ = writeln!(
        doc,
        "| RSS with {cached} Pods cached and {held_total} holds ≤ 40 MiB | {} MiB | {} |",
        rss / 1024,
        if rss / 1024 <= 40 { "yes" } else { "no" }
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/performance.md");
    let notes = std::fs::read_to_string(&path)
        .ok()
        .and_then(|old| old.split_once("\n## Notes").map(|(_, n)| format!("\n## Notes{n}")))
        .unwrap_or_default();
    std::fs::write(&path, format!("{doc}{notes}")).unwrap();
    eprintln!("wrote {}", path.display());
}

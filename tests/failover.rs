//! Two capo processes (the real binary) on a control plane of their own, which writes an
//! audit log: every write to a reservation, a record or the Lease is counted as the API
//! server saw it. One replica leads; kill it during a storm of deletions, let its Lease run
//! out while releases are due, partition it while one of its writes is in flight, skew the
//! other's clock: no hold is lost, each IP is released exactly once, on schedule (or within
//! the stated bound after a leader loss), and no write of a replica that lost the Lease
//! lands.

mod support;

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::Method;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use support::audit::AuditEvent;
use support::faults::{Fault, FaultProxy, Rule};
use support::plane::{PrivatePlane, private_plane};
use support::*;
use tokio::process::{Child, Command};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Replica {
    identity: String,
    probe: u16,
    child: Child,
    /// The replica's log (its stdout), shown when a test fails with the replica running.
    log: PathBuf,
}

impl Drop for Replica {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(80)..];
            eprintln!(
                "--- the last {} lines of replica {}'s log ({}) ---",
                tail.len(),
                self.identity,
                self.log.display()
            );
            for line in tail {
                eprintln!("{line}");
            }
        }
    }
}

/// How a replica runs.
struct Launch<'a> {
    identity: &'a str,
    kubeconfig: &'a Path,
    /// A clock this many seconds ahead of the machine's (libfaketime), if any.
    clock_ahead: Option<i64>,
}

async fn spawn_replica(ns: &str, launch: Launch<'_>) -> Replica {
    let (port, probe) = (free_port(), free_port());
    let identity = launch.identity;
    let log = std::env::temp_dir().join(format!("capo-failover-{ns}-{identity}.log"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_capo"));
    cmd.args([
        "run",
        &format!("--webhook-addr=127.0.0.1:{port}"),
        &format!("--self-register-url=https://127.0.0.1:{port}"),
        &format!("--probe-addr=127.0.0.1:{probe}"),
        &format!("--webhook-config-name=capo-test-{ns}-{identity}"),
        &format!("--webhook-namespaces={ns}"),
        "--namespace=capo-system",
        &format!("--lease-name=capo-{ns}"),
        "--lease-duration=3s",
        "--lease-renew-grace=1s",
        &format!("--identity={identity}"),
        &format!("--policy-prefix={ns}-"),
        "--repair-settle=1s",
        "--calico-api=crd.projectcalico.org/v1",
    ])
    .env("KUBECONFIG", launch.kubeconfig)
    .env("RUST_LOG", "capo=info")
    .env("NO_COLOR", "1")
    .stdout(std::fs::File::create(&log).expect("the replica's log file"))
    .stderr(Stdio::inherit())
    .kill_on_drop(true);
    if let Some(ahead) = launch.clock_ahead {
        cmd.env("LD_PRELOAD", faketime_library())
            .env("FAKETIME", format!("{ahead:+}s"))
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("FAKETIME_NO_CACHE", "1");
    }
    let child = cmd.spawn().expect("start capo");
    Replica { identity: identity.into(), probe, child, log }
}

/// Debian's libfaketime (`hack/tools.sh` installs it).
fn faketime_library() -> PathBuf {
    let candidates =
        ["/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libfaketime is missing: run `make tools` (apt package faketime)"))
}

async fn metrics(r: &Replica) -> Option<String> {
    reqwest::get(format!("http://127.0.0.1:{}/metrics", r.probe)).await.ok()?.text().await.ok()
}

fn value(metrics: &str, needle: &str) -> Option<f64> {
    metrics.lines().find(|l| l.starts_with(needle)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// capo's and Calico's CRDs, the namespace for Leases, and a namespace for the test.
async fn prepare(client: &Client, ns: &str, labels: serde_json::Value) {
    install_capo_crds(client).await;
    install_calico_crds(client).await;
    for (name, labels) in [("capo-system", json!({})), (ns, labels)] {
        let obj: Namespace = serde_json::from_value(json!({ "metadata": { "name": name, "labels": labels } })).unwrap();
        let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &obj).await;
    }
}

/// Waits until the API server calls each replica (a dry-run DELETE of a canary reaches it).
async fn wait_called(client: &Client, ns: &str, replicas: &[&Replica]) {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    if pods.get_opt("canary").await.unwrap().is_none() {
        create_pod_with_ips(client, ns, unscheduled_pod("canary", &[], &[]), &[Ips::v4()]).await;
    }
    for r in replicas {
        eventually(&format!("replica {} called by the API server", r.identity), Duration::from_secs(60), || {
            let pods = pods.clone();
            async move {
                let _ = pods.delete("canary", &DeleteParams { dry_run: true, ..Default::default() }).await;
                metrics(r).await?.contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
            }
        })
        .await;
    }
}

async fn holder(client: &Client, ns: &str) -> Option<String> {
    let lease = Api::<Lease>::namespaced(client.clone(), "capo-system").get_opt(&format!("capo-{ns}")).await.ok()??;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

async fn selected_pods(client: &Client, ns: &str, n: usize) -> Vec<IpAddr> {
    let mut ips = Vec::new();
    for i in 0..n {
        let ip = Ips::v4();
        create_pod_with_ips(client, ns, unscheduled_pod(&format!("redis-{i}"), &[("app", "redis")], &[]), &[ip]).await;
        ips.push(ip);
    }
    ips
}

/// From the audit log: each entry removed once and each record deleted once, by whom.
fn releases(audit: &[AuditEvent]) -> (HashMap<String, usize>, HashMap<String, usize>) {
    let mut removed: HashMap<String, usize> = HashMap::new();
    let mut deleted: HashMap<String, usize> = HashMap::new();
    for e in audit.iter().filter(|e| e.ok()) {
        match (e.resource.as_str(), e.verb.as_str()) {
            ("ipreservations", "patch") => {
                for entry in e.removed_entries() {
                    *removed.entry(entry).or_default() += 1;
                }
            }
            ("reservedips", "delete") => *deleted.entry(e.name.clone()).or_default() += 1,
            _ => {}
        }
    }
    (removed, deleted)
}

async fn wait_all_released(client: &Client, ips: &[IpAddr], limit: Duration) {
    for ip in ips {
        eventually(
            &format!("{ip} released"),
            limit,
            || async move { record(client, *ip).await.is_none().then_some(()) },
        )
        .await;
    }
}

#[tokio::test]
async fn sigkill_the_leader_during_a_storm_loses_no_hold_and_releases_each_ip_once_on_schedule() {
    let plane = private_plane("kill", true);
    let client = plane.client().await;
    let ns = "failover";
    prepare(&client, ns, json!({})).await;
    let policy = format!("{ns}-p");
    let launch = |identity| Launch { identity, kubeconfig: &plane.kubeconfig, clock_ahead: None };
    let mut replicas = vec![spawn_replica(ns, launch("a")).await, spawn_replica(ns, launch("b")).await];
    wait_called(&client, ns, &replicas.iter().collect::<Vec<_>>()).await;
    apply_policy(
        &client,
        &policy,
        ns,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "6s",
                "releaseInterval": "100ms", "releaseBatch": 100 }),
    )
    .await;
    let leader = eventually("a leader", Duration::from_secs(30), || holder(&client, ns)).await;

    // The storm: 40 selected Pods deleted at once; the leader is killed while some of the
    // deletions have returned and others are still under way.
    let ips = selected_pods(&client, ns, 40).await;
    let done = Arc::new(AtomicUsize::new(0));
    // Told the moment the fifth deletion returns: a poll every 100 ms missed the storm on
    // a loaded machine (all 40 had returned between two looks).
    let fifth = Arc::new(tokio::sync::Notify::new());
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let deletions: Vec<_> = (0..40)
        .map(|i| {
            let (pods, done, fifth) = (pods.clone(), done.clone(), fifth.clone());
            tokio::spawn(async move {
                let r = pods.delete(&format!("redis-{i}"), &DeleteParams::default()).await.map(|_| ());
                if done.fetch_add(1, Ordering::SeqCst) + 1 == 5 {
                    fifth.notify_one();
                }
                r
            })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(30), fifth.notified()).await.expect("five deletions to return");
    let at_kill = done.load(Ordering::SeqCst);
    let i = replicas.iter().position(|r| r.identity == leader).unwrap();
    let mut killed = replicas.remove(i);
    killed.child.start_kill().expect("SIGKILL the leader");
    let _ = killed.child.wait().await;
    assert!(at_kill < 40, "the leader died while deletions were under way ({at_kill} of 40 had returned)");
    for d in deletions {
        d.await.unwrap().expect("every deletion allowed (and so held)");
    }
    let entries = policy_entries(&client, capo_api::CalicoApiGroup::CrdV1, &policy).await;
    for ip in &ips {
        assert!(entries.contains(&cidr(*ip)), "{ip} lost");
    }
    let survivor = &replicas[0];
    eventually("the survivor to lead", Duration::from_secs(20), || async {
        (value(&metrics(survivor).await?, "capo_leader") == Some(1.0)).then_some(())
    })
    .await;
    // Every IP released, once, on schedule: each record deleted once and each entry
    // removed once, as the API server saw it.
    let mut release_at = HashMap::new();
    for ip in &ips {
        let r = eventually(&format!("{ip} counted down"), Duration::from_secs(20), || async {
            let r = record(&client, *ip).await?;
            r.status?.release_at.map(|t| t.0)
        })
        .await;
        release_at.insert(capo_api::reserved_ip::record_name(*ip), r);
    }
    wait_all_released(&client, &ips, Duration::from_secs(30)).await;
    let audit = plane.audit();
    let (removed, deleted) = releases(&audit);
    for ip in &ips {
        let name = capo_api::reserved_ip::record_name(*ip);
        assert_eq!(removed.get(&cidr(*ip)), Some(&1), "{ip}: its entry removed exactly once");
        assert_eq!(deleted.get(&name), Some(&1), "{ip}: its record deleted exactly once");
        let gone = audit.iter().find(|e| e.ok() && e.verb == "delete" && e.name == name).unwrap().at;
        let late = gone.duration_since(release_at[&name]).as_secs_f64();
        assert!((-0.05..=1.5).contains(&late), "{ip} released {late:.3}s from its releaseAt");
    }
    let m = metrics(survivor).await.unwrap();
    let ttl = value(&m, &format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}")).unwrap_or(0.0);
    assert!(ttl >= 1.0, "the survivor released what was due after it took over: {ttl}");
    // What every Prometheus job expects of a process: its build and its resources.
    let version = format!("capo_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"));
    assert_eq!(value(&m, &version), Some(1.0), "{version}");
    let rss = value(&m, "process_resident_memory_bytes").unwrap_or(0.0);
    assert!(rss > 1e6, "process_resident_memory_bytes {rss}");
    assert!(value(&m, "process_start_time_seconds").unwrap_or(0.0) > 1.7e9, "process_start_time_seconds");
    assert!(policy_entries(&client, capo_api::CalicoApiGroup::CrdV1, &policy).await.is_empty());
}

/// Two replicas on a private plane, a policy with `reserveFor: 4s`, and ten selected Pods.
struct Lateness {
    plane: PrivatePlane,
    client: Client,
    replicas: Vec<Replica>,
    leader: String,
    ips: Vec<IpAddr>,
}

async fn lateness_scene(plane: &str, ns: &str) -> Lateness {
    let plane = private_plane(plane, true);
    let client = plane.client().await;
    prepare(&client, ns, json!({})).await;
    let policy = format!("{ns}-p");
    let launch = |identity| Launch { identity, kubeconfig: &plane.kubeconfig, clock_ahead: None };
    let replicas = vec![spawn_replica(ns, launch("a")).await, spawn_replica(ns, launch("b")).await];
    wait_called(&client, ns, &replicas.iter().collect::<Vec<_>>()).await;
    apply_policy(
        &client,
        &policy,
        ns,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "4s",
                "releaseInterval": "100ms", "releaseBatch": 100 }),
    )
    .await;
    let leader = eventually("a leader", Duration::from_secs(30), || holder(&client, ns)).await;
    let ips = selected_pods(&client, ns, 10).await;
    Lateness { plane, client, replicas, leader, ips }
}

/// SIGKILLs the replica `identity` and waits until it is gone.
async fn sigkill(replicas: &mut Vec<Replica>, identity: &str) {
    let i = replicas.iter().position(|r| r.identity == identity).unwrap();
    let mut killed = replicas.remove(i);
    killed.child.start_kill().unwrap();
    let _ = killed.child.wait().await;
}

/// The lateness bound after a leader loss: releases that fall due while no replica leads
/// are carried out at most the Lease duration (3 s here) plus 2 s after they were due.
#[tokio::test]
async fn releases_due_while_the_leader_is_dead_are_late_by_at_most_the_lease_duration_and_two_seconds() {
    let ns = "lateness";
    let Lateness { plane, client, mut replicas, leader, ips } = lateness_scene("late", ns).await;
    for i in 0..10 {
        delete_pod(&client, ns, &format!("redis-{i}")).await.expect("held and allowed");
    }
    let mut due = Vec::new();
    for ip in &ips {
        due.push(
            eventually(&format!("{ip} counted down"), Duration::from_secs(20), || async {
                record(&client, *ip).await?.status?.release_at.map(|t| t.0)
            })
            .await,
        );
    }
    // The leader dies half a second before the first release is due.
    let first = *due.iter().min().unwrap();
    eventually("just before the first release", Duration::from_secs(10), || async {
        (Timestamp::now() >= first.checked_sub(k8s_openapi::jiff::SignedDuration::from_millis(500)).unwrap())
            .then_some(())
    })
    .await;
    sigkill(&mut replicas, &leader).await;
    wait_all_released(&client, &ips, Duration::from_secs(30)).await;
    let audit = plane.audit();
    let mut worst: f64 = 0.0;
    for (ip, due) in ips.iter().zip(&due) {
        let name = capo_api::reserved_ip::record_name(*ip);
        let gone = audit.iter().find(|e| e.ok() && e.verb == "delete" && e.name == name).unwrap().at;
        let late = gone.duration_since(*due).as_secs_f64();
        assert!(late >= -0.05, "{ip} released {late:.2}s early");
        worst = worst.max(late);
    }
    eprintln!("lateness after the leader's loss: at most {worst:.2}s");
    assert!(worst <= 5.0, "released {worst:.2}s late: more than the Lease duration (3s) + 2s");
}

/// The lateness bound for countdowns the leader had not flushed yet: the leader is killed
/// the moment ten deletions returned, before its countdown starts (kept in memory,
/// flushed to capo's namespace at most once a second) are all written. The new leader
/// starts what it did not find when it first looks: each hold is released no earlier
/// than its Pod left plus `reserveFor` (4 s), and late by at most the flush interval
/// (1 s) + the Lease duration (3 s) + 2 s.
#[tokio::test]
async fn countdowns_not_yet_flushed_when_the_leader_dies_start_late_never_early() {
    let ns = "unflushed";
    let Lateness { plane, client, mut replicas, leader, ips } = lateness_scene("unflushed", ns).await;
    let left: Vec<Timestamp> = futures::future::join_all((0..10).map(|i| {
        let client = client.clone();
        async move {
            delete_pod(&client, ns, &format!("redis-{i}")).await.expect("held and allowed");
            Timestamp::now()
        }
    }))
    .await;
    sigkill(&mut replicas, &leader).await;
    let flushed = capo::release::countdowns::read(&client, Some("capo-system")).await.expect("read the countdowns");
    wait_all_released(&client, &ips, Duration::from_secs(40)).await;
    let audit = plane.audit();
    let mut worst: f64 = 0.0;
    for (ip, left) in ips.iter().zip(&left) {
        let name = capo_api::reserved_ip::record_name(*ip);
        let gone = audit.iter().find(|e| e.ok() && e.verb == "delete" && e.name == name).unwrap().at;
        let late = gone.duration_since(*left).as_secs_f64() - 4.0;
        assert!(late >= -0.1, "{ip} released {:.2}s early", -late);
        worst = worst.max(late);
    }
    eprintln!(
        "{} of 10 countdowns flushed when the leader died; lateness after its loss: at most {worst:.2}s",
        flushed.len()
    );
    assert!(worst <= 6.0, "released {worst:.2}s late: more than the flush (1s) + the Lease duration (3s) + 2s");
}

/// Defect 5: a replica that lost the Lease cannot release anything. The follower's clock
/// runs 10 s ahead (libfaketime): it must not take over while the leader renews (with the
/// old election it did at once, and both released). Then the leader is cut off from the
/// Lease while one of its release writes is held in flight for 5 s: the follower takes
/// over, and when the stale write reaches the API server it is refused. From the audit log:
/// no write by the old leader succeeds after the new one took the Lease; every entry
/// removed once, every record deleted once.
#[tokio::test]
async fn d05_a_replica_that_lost_the_lease_cannot_release_anything_whatever_the_clocks_say() {
    let plane = private_plane("fence", true);
    let client = plane.client().await;
    let ns = "fencing";
    prepare(&client, ns, json!({})).await;
    let policy = format!("{ns}-p");
    // The first leader talks to the API server through a proxy that can delay or refuse
    // its requests; the second's clock is 10 s ahead.
    let proxy = FaultProxy::start(client.clone()).await;
    let proxied = plane.state_dir.join("proxied.kubeconfig");
    std::fs::write(
        &proxied,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: p, cluster: {{server: \"{}\"}}}}]\nusers: [{{name: u, user: {{}}}}]\ncontexts: [{{name: c, context: {{cluster: p, user: u}}}}]\ncurrent-context: c\n",
            proxy.url
        ),
    )
    .unwrap();
    let a = spawn_replica(ns, Launch { identity: "a", kubeconfig: &proxied, clock_ahead: None }).await;
    eventually("a to lead", Duration::from_secs(30), || async { (holder(&client, ns).await? == "a").then_some(()) })
        .await;
    let b = spawn_replica(ns, Launch { identity: "b", kubeconfig: &plane.kubeconfig, clock_ahead: Some(10) }).await;
    wait_called(&client, ns, &[&a, &b]).await;
    apply_policy(
        &client,
        &policy,
        ns,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "8s",
                "releaseInterval": "200ms", "releaseBatch": 5 }),
    )
    .await;
    let ips = selected_pods(&client, ns, 20).await;
    for i in 0..20 {
        delete_pod(&client, ns, &format!("redis-{i}")).await.expect("held and allowed");
    }
    for ip in &ips {
        eventually(&format!("{ip} counted down"), Duration::from_secs(20), || async {
            record(&client, *ip).await?.status?.release_at.map(|_| ())
        })
        .await;
    }
    // Phase 1: two whole Lease durations and more, with the follower's clock 10 s ahead.
    let watch_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < watch_until {
        assert_eq!(holder(&client, ns).await.as_deref(), Some("a"), "the follower whose clock runs ahead took over");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Phase 2: the releases fall due; a's writes to reservations are held 6 s in flight,
    // and once one is, a is cut off from the Lease.
    let held = || Rule::new(Method::PATCH, "/ipreservations/", Fault::Delay(Duration::from_secs(6)));
    proxy.set(vec![held()]);
    eventually("a release write of a's in flight", Duration::from_secs(30), || async {
        (proxy.delayed() > 0).then_some(())
    })
    .await;
    proxy.set(vec![held(), Rule::new(Method::PUT, "/leases/", Fault::Status(503, None))]);
    eventually("b to lead", Duration::from_secs(20), || async { (holder(&client, ns).await? == "b").then_some(()) })
        .await;
    wait_all_released(&client, &ips, Duration::from_secs(40)).await;
    // The writes a had in flight reach the API server and are answered.
    eventually("a's held writes to be answered", Duration::from_secs(20), || async {
        (proxy.delayed() == 0).then_some(())
    })
    .await;
    let audit = plane.audit();
    let taken = audit
        .iter()
        .filter(|e| e.ok() && e.resource == "leases" && e.by("b"))
        .map(|e| e.at)
        .min()
        .expect("b wrote the Lease");
    let stale: Vec<String> = audit
        .iter()
        .filter(|e| e.by("a") && e.ok() && e.at > taken && e.verb != "get")
        .filter(|e| matches!(e.resource.as_str(), "ipreservations" | "reservedips"))
        .map(|e| format!("{} {} {} {}", e.verb, e.resource, e.name, e.code))
        .collect();
    assert!(stale.is_empty(), "writes of the replica that lost the Lease landed: {stale:?}");
    let late: Vec<&AuditEvent> = audit
        .iter()
        .filter(|e| e.by("a") && e.resource == "ipreservations" && e.verb == "patch" && e.at > taken)
        .collect();
    assert!(!late.is_empty(), "a had a release write in flight when it lost the Lease");
    eprintln!(
        "writes of the old leader that reached the API server after the handover: {} (codes {:?})",
        late.len(),
        late.iter().map(|e| e.code).collect::<Vec<_>>()
    );
    let (removed, deleted) = releases(&audit);
    for ip in &ips {
        assert_eq!(removed.get(&cidr(*ip)), Some(&1), "{ip}: its entry removed exactly once");
        assert_eq!(deleted.get(&capo_api::reserved_ip::record_name(*ip)), Some(&1), "{ip}: record deleted once");
    }
    drop((a, b));
}

async fn start_storm_capo(client: &kube::Client) -> capo::App {
    let mut settings = capo_settings("capo-storm", &["storm"], Some(capo_api::CalicoApiGroup::CrdV1));
    settings.release = Some(capo::app::ReleaseSettings {
        election: Some(capo::leader::LeaderSettings {
            lease_name: "capo".into(),
            namespace: "default".into(),
            identity: format!("storm-{}", Timestamp::now().as_microsecond()),
            duration: Duration::from_secs(3),
            grace: Duration::from_secs(1),
        }),
        engine: Default::default(),
        identity: "storm".into(),
    });
    init_tracing();
    let app = capo::App::start(client.clone(), settings).await.expect("start capo");
    let pods = Api::<Pod>::namespaced(client.clone(), "storm");
    eventually("the API server to call the new capo", Duration::from_secs(60), || {
        let pods = pods.clone();
        let metrics = app.metrics.clone();
        async move {
            let _ = pods.delete("canary", &DeleteParams { dry_run: true, ..Default::default() }).await;
            metrics.render().contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
        }
    })
    .await;
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_capo_and_the_api_server_during_a_storm_loses_no_hold() {
    let plane: PrivatePlane = private_plane("storm", false);
    let client = plane.client().await;
    // The hard guarantee for this namespace: no deletion without a hold, even while capo
    // restarts (the webhook configuration of the crashed capo stays, failurePolicy Fail).
    prepare(&client, "storm", json!({ "capo.io/failure-policy": "Fail" })).await;
    create_pod_with_ips(&client, "storm", unscheduled_pod("canary", &[], &[]), &[Ips::v4()]).await;
    let mut capo = Some(start_storm_capo(&client).await);
    apply_policy(
        &client,
        "storm",
        "storm",
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" }),
    )
    .await;
    let ips = selected_pods(&client, "storm", 30).await;
    // Deletions one after another, each retried until the API server (and capo) allow it.
    let done = Arc::new(AtomicUsize::new(0));
    let storm = {
        let pods = Api::<Pod>::namespaced(client.clone(), "storm");
        let done = done.clone();
        tokio::spawn(async move {
            let mut refused = 0;
            for i in 0..30 {
                let deadline = Instant::now() + Duration::from_secs(90);
                loop {
                    match pods.delete(&format!("redis-{i}"), &DeleteParams::default()).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 404 => break,
                        Err(e) => {
                            if refused < 3 {
                                eprintln!("redis-{i}: {e}");
                            }
                            refused += 1
                        }
                    }
                    assert!(Instant::now() < deadline, "redis-{i} could not be deleted");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                done.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            refused
        })
    };
    eventually("the storm to be under way", Duration::from_secs(30), || async {
        (done.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    plane.restart("kube-apiserver").await;
    // capo crashes (no clean shutdown: its webhook configuration stays) and comes back.
    drop(capo.take());
    capo = Some(start_storm_capo(&client).await);
    assert!(done.load(Ordering::SeqCst) < 30, "the restarts happened during the storm");
    let refused = storm.await.unwrap();
    eprintln!("deletions refused or failed during the restarts: {refused}");
    let entries = policy_entries(&client, capo_api::CalicoApiGroup::CrdV1, "storm").await;
    for ip in &ips {
        assert!(entries.contains(&cidr(*ip)), "{ip}: entry lost");
        assert!(record(&client, *ip).await.is_some(), "{ip}: record lost");
    }
    // The new leader counts every hold down.
    let c = &client;
    for ip in &ips {
        eventually(&format!("{ip} counted down"), Duration::from_secs(30), || async move {
            record(c, *ip).await?.status?.release_at.map(|_| ())
        })
        .await;
    }
    drop(capo);
    drop(plane);
}

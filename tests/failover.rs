//! Two capo processes (the real binary) on one real API server: one leads; SIGKILL it in
//! the middle of a storm of deletions and the other takes over. No hold is lost and every
//! IP is released exactly once, on schedule.

mod support;

use std::collections::HashMap;
use std::net::IpAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use capo_api::ReservedIP;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use support::*;
use tokio::process::{Child, Command};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Replica {
    identity: String,
    probe: u16,
    child: Child,
}

async fn spawn_replica(ns: &str, identity: &str) -> Replica {
    let (port, probe) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_capo"))
        .args([
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
        .env("KUBECONFIG", &capo_testenv::shared().kubeconfig)
        .env("RUST_LOG", "capo=info")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start capo");
    Replica { identity: identity.into(), probe, child }
}

async fn metrics(r: &Replica) -> Option<String> {
    reqwest::get(format!("http://127.0.0.1:{}/metrics", r.probe)).await.ok()?.text().await.ok()
}

fn value(metrics: &str, needle: &str) -> Option<f64> {
    metrics.lines().find(|l| l.starts_with(needle)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test]
async fn sigkill_the_leader_during_a_storm_loses_no_hold_and_releases_each_ip_once_on_schedule() {
    let client = client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    let _ = Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": "capo-system" } })).unwrap(),
        )
        .await;
    let ns = TestNamespace::create(&client, "failover").await;
    let policy = format!("{}-p", ns.name);
    let mut replicas = vec![spawn_replica(&ns.name, "a").await, spawn_replica(&ns.name, "b").await];

    // Both serve, and the API server calls both (a dry-run DELETE of a canary reaches each).
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("canary", &[], &[]), &[Ips::v4()]).await;
    for r in &replicas {
        eventually(&format!("replica {} called by the API server", r.identity), Duration::from_secs(60), || {
            let pods = pods.clone();
            async move {
                let _ = pods.delete("canary", &DeleteParams { dry_run: true, ..Default::default() }).await;
                metrics(r).await?.contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
            }
        })
        .await;
    }
    apply_policy(
        &client,
        &policy,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "6s",
                "releaseInterval": "100ms", "releaseBatch": 100 }),
    )
    .await;
    let leases = Api::<Lease>::namespaced(client.clone(), "capo-system");
    let lease_name = format!("capo-{}", ns.name);
    let holder = eventually("a leader", Duration::from_secs(30), || {
        let leases = leases.clone();
        let lease_name = lease_name.clone();
        async move { leases.get_opt(&lease_name).await.ok()??.spec?.holder_identity }
    })
    .await;

    // Every record's life as the API server tells it: creations and deletions with times.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(HashMap::<
        String,
        (u32, u32, Option<Timestamp>, Option<Timestamp>),
    >::new()));
    let records_watch = {
        let seen = seen.clone();
        let api = Api::<ReservedIP>::all(client.clone());
        let prefix = policy.clone();
        tokio::spawn(async move {
            let mut created_once = std::collections::HashSet::new();
            let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
            while let Some(Ok(ev)) = stream.next().await {
                let mut seen = seen.lock().unwrap();
                match ev {
                    watcher::Event::Apply(r) | watcher::Event::InitApply(r) if r.spec.policy == prefix => {
                        let e = seen.entry(r.name_any()).or_default();
                        if created_once.insert(r.uid().unwrap_or_default()) {
                            e.0 += 1;
                        }
                        if let Some(at) = r.status.as_ref().and_then(|s| s.release_at.as_ref()) {
                            e.2 = Some(at.0);
                        }
                    }
                    watcher::Event::Delete(r) if r.spec.policy == prefix => {
                        let e = seen.entry(r.name_any()).or_default();
                        e.1 += 1;
                        e.3 = Some(Timestamp::now());
                    }
                    _ => {}
                }
            }
        })
    };

    // The storm: 40 selected Pods deleted at once; the leader is killed in the middle.
    let mut ips: Vec<IpAddr> = Vec::new();
    for i in 0..40 {
        let ip = Ips::v4();
        create_pod_with_ips(&client, &ns.name, unscheduled_pod(&format!("redis-{i}"), &[("app", "redis")], &[]), &[ip])
            .await;
        ips.push(ip);
    }
    let deletions: Vec<_> = (0..40)
        .map(|i| {
            let pods = pods.clone();
            tokio::spawn(async move { pods.delete(&format!("redis-{i}"), &DeleteParams::default()).await.map(|_| ()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let leader = replicas.iter().position(|r| r.identity == holder).unwrap();
    let mut killed = replicas.remove(leader);
    killed.child.start_kill().expect("SIGKILL the leader");
    let killed_at = Instant::now();
    let _ = killed.child.wait().await;
    for d in deletions {
        d.await.unwrap().expect("every deletion allowed (and so held)");
    }
    // No hold lost: every IP is recorded and in the reservation.
    let entries = reservation(&client, capo_api::CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.unwrap();
    for ip in &ips {
        assert!(entries.contains(&format!("{ip}/32")), "{ip} lost");
    }
    // The survivor takes over.
    let survivor = &replicas[0];
    eventually("the survivor to lead", Duration::from_secs(20), || async {
        (value(&metrics(survivor).await?, "capo_leader") == Some(1.0)).then_some(())
    })
    .await;
    eprintln!("takeover {:?} after SIGKILL", killed_at.elapsed());
    // Every IP released, once, on schedule.
    let c = &client;
    for ip in &ips {
        eventually(&format!("{ip} released"), Duration::from_secs(30), || async move {
            record(c, *ip).await.is_none().then_some(())
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    records_watch.abort();
    let seen = seen.lock().unwrap().clone();
    for ip in &ips {
        let (created, deleted, release_at, deleted_at) = seen.get(&ip.to_string()).copied().unwrap_or_default();
        assert_eq!((created, deleted), (1, 1), "{ip}: held once, released once");
        let late = deleted_at.unwrap().duration_since(release_at.expect("releaseAt was set")).as_secs_f64();
        assert!((-0.05..=1.5).contains(&late), "{ip} released {late:.3}s from its releaseAt");
    }
    let m = metrics(survivor).await.unwrap();
    assert_eq!(value(&m, &format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}")), Some(40.0), "{m}");
    let left = reservation(&client, capo_api::CalicoApiGroup::CrdV1, &format!("capo-{policy}")).await.unwrap();
    assert!(left.is_empty(), "{left:?}");
}

/// A control plane of this test's own, whose components can be restarted. Its components
/// die with the thread that started them, so that thread owns it and takes restart
/// requests until the handle is dropped.
type RestartRequest = (String, std::sync::mpsc::Sender<Result<(), String>>);

struct PrivatePlane {
    kubeconfig: std::path::PathBuf,
    requests: Option<std::sync::mpsc::Sender<RestartRequest>>,
    owner: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PrivatePlane {
    /// Stops the components and removes the state before the test ends.
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(owner) = self.owner.take() {
            let _ = owner.join();
        }
    }
}

fn private_plane(name: &str) -> PrivatePlane {
    let (requests, rx) = std::sync::mpsc::channel::<RestartRequest>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let dir = std::env::temp_dir().join(format!("capo-private-{name}-{}", std::process::id()));
    let owner = std::thread::spawn(move || {
        let opts = capo_testenv::Options { state_dir: dir.clone(), nodes: 1 };
        let mut cp = match capo_testenv::ControlPlane::start(opts) {
            Ok(cp) => cp,
            Err(e) => {
                let _ = ready_tx.send(Err(e.to_string()));
                return;
            }
        };
        let _ = ready_tx.send(Ok(cp.kubeconfig.clone()));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        while let Ok((component, reply)) = rx.recv() {
            let _ = reply.send(rt.block_on(cp.restart(&component)).map_err(|e| e.to_string()));
        }
        cp.stop();
        let _ = std::fs::remove_dir_all(&dir);
    });
    let kubeconfig = ready_rx.recv().unwrap().unwrap_or_else(|e| panic!("private control plane: {e}"));
    PrivatePlane { kubeconfig, requests: Some(requests), owner: Some(owner) }
}

impl PrivatePlane {
    async fn restart(&self, component: &str) {
        let (tx, rx) = std::sync::mpsc::channel();
        self.requests.as_ref().unwrap().send((component.to_string(), tx)).unwrap();
        tokio::task::spawn_blocking(move || rx.recv().unwrap()).await.unwrap().expect("restart");
    }
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
    let plane = private_plane("storm");
    let client = capo_testenv::client_from_kubeconfig(&plane.kubeconfig).await.unwrap();
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    // The hard guarantee for this namespace: no deletion without a hold, even while capo
    // restarts (the webhook configuration of the crashed capo stays, failurePolicy Fail).
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": { "name": "storm", "labels": { "capo.io/failure-policy": "Fail" } }
    }))
    .unwrap();
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
    create_pod_with_ips(&client, "storm", unscheduled_pod("canary", &[], &[]), &[Ips::v4()]).await;
    let mut capo = Some(start_storm_capo(&client).await);
    apply_policy(
        &client,
        "storm",
        "storm",
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" }),
    )
    .await;
    let mut ips = Vec::new();
    for i in 0..30 {
        let ip = Ips::v4();
        create_pod_with_ips(&client, "storm", unscheduled_pod(&format!("redis-{i}"), &[("app", "redis")], &[]), &[ip])
            .await;
        ips.push(ip);
    }
    // Deletions one after another, each retried until the API server (and capo) allow it.
    let storm = {
        let pods = Api::<Pod>::namespaced(client.clone(), "storm");
        tokio::spawn(async move {
            let mut refused = 0;
            for i in 0..30 {
                let deadline = Instant::now() + Duration::from_secs(90);
                loop {
                    match pods.delete(&format!("redis-{i}"), &DeleteParams::default()).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 404 => break,
                        Err(_) => refused += 1,
                    }
                    assert!(Instant::now() < deadline, "redis-{i} could not be deleted");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            refused
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    plane.restart("kube-apiserver").await;
    // capo crashes (no clean shutdown: its webhook configuration stays) and comes back.
    drop(capo.take());
    capo = Some(start_storm_capo(&client).await);
    let refused = storm.await.unwrap();
    eprintln!("deletions refused or failed during the restarts: {refused}");
    let entries = reservation(&client, capo_api::CalicoApiGroup::CrdV1, "capo-storm").await.unwrap();
    for ip in &ips {
        assert!(entries.contains(&format!("{ip}/32")), "{ip}: entry lost");
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

//! What a held deletion costs the API server, in capo's own requests: capo (webhook and
//! leader, one replica) talks to the real API server through a proxy that logs every
//! request (`support/faults.rs`, no faults set), a burst of selected Pods is deleted, and
//! once the leader has nothing queued the requests are counted per hold. `make bench`
//! measures the same from kube-apiserver's side during a storm (docs/performance.md); this
//! test fails when a change adds a request per hold that nobody meant to add.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use support::faults::FaultProxy;
use support::leading::*;
use support::*;

/// `(method, resource[/subresource])` of a logged request, or `None` for what is not per
/// hold: watches, lists, the Lease, Events (a summary per policy and burst), Calico's
/// migration state.
fn kind(method: &axum::http::Method, path: &str) -> Option<String> {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    // Calico's migration state (the APIService, each group's ClusterInformation) is a
    // look every 5 s, not a request of a hold.
    let migration = path.contains("/clusterinformations/") || path.contains("/apiservices/");
    if query.contains("watch=") || path.contains("/leases") || path.contains("/events") || migration {
        return None;
    }
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    // /api/v1/namespaces/ns/pods/name[/sub], /apis/g/v/[namespaces/ns/]res[/name[/sub]]
    let rest = match parts.first() {
        Some(&"api") => &parts[2..],
        Some(&"apis") => &parts[3..],
        _ => return None,
    };
    let rest = if rest.first() == Some(&"namespaces") && rest.len() > 2 { &rest[2..] } else { rest };
    let resource = rest.first()?.to_string();
    if rest.len() == 1 && *method == axum::http::Method::GET {
        return None; // a list
    }
    Some(match rest.get(2) {
        Some(sub) => format!("{method} {resource}/{sub}"),
        None => format!("{method} {resource}"),
    })
}

/// Deletes `PODS` selected Pods, 20 at a time, under a policy with `maxReserved`; once the
/// leader has flushed every countdown and has nothing queued: capo's requests by kind,
/// and how many reviews were answered held.
async fn cost_of_a_burst(name: &str, max_reserved: u32) -> (BTreeMap<String, usize>, usize) {
    let (client, ns) = setup(name).await;
    let proxy = FaultProxy::start(client.clone()).await;
    // The production settle time (5 s; the tests' 1 s would have a busy API server's
    // slower deletions counted as Pods kept, each a status write and its undoing).
    let mut settings = leading_settings(&ns.name, "a", Duration::from_secs(600));
    settings.release.as_mut().unwrap().engine.plan.settle = capo::release::PlanSettings::default().settle;
    let capo = start_capo_with(&proxy.client(), &ns.name, settings).await;
    let Scene { client, ns, capo, policy } = scene_with(
        client,
        ns,
        capo,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": max_reserved }),
    )
    .await;
    let ips: Vec<_> = (0..PODS).map(|_| Ips::v4()).collect();
    for (i, ip) in ips.iter().enumerate() {
        let pod = unscheduled_pod(&format!("redis-{i}"), &[("app", "redis")], &[]);
        create_pod_with_ips(&client, &ns.name, pod, &[*ip]).await;
    }
    // capo's Pod store has them all (else the webhook reads a Pod it has not seen yet).
    eventually("capo to see every Pod with its IP", Duration::from_secs(30), || async {
        let seen = (0..PODS).all(|i| capo.pods.get(&ns.name, &format!("redis-{i}")).is_some_and(|p| !p.ips.is_empty()));
        seen.then_some(())
    })
    .await;
    proxy.clear_requests();
    let refused: Vec<String> = futures::stream::iter(0..PODS)
        .map(|i| {
            let client = client.clone();
            let ns = ns.name.clone();
            async move { delete_pod(&client, &ns, &format!("redis-{i}")).await.err().map(|e| e.to_string()) }
        })
        .buffer_unordered(20)
        .filter_map(|e| async move { e })
        .collect()
        .await;
    assert!(refused.is_empty(), "{refused:?}");
    // Every countdown written (the leader's work for the holds done).
    let holds = format!("capo_holds_total{{policy=\"{policy}\"");
    eventually("every hold counted down and the leader idle", Duration::from_secs(60), || async {
        let mut counted = 0;
        for ip in &ips {
            if record(&client, *ip).await.is_some_and(|r| r.status.is_some_and(|s| s.pod_gone_at.is_some())) {
                counted += 1;
            }
        }
        (counted == PODS && metric_value(&capo, "capo_release_queue_depth") == Some(0.0)).then_some(())
    })
    .await;
    let count = |prefix: &str| -> f64 {
        let m = capo.metrics.render();
        m.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    };
    assert_eq!(count(&holds), PODS as f64, "every deletion held once");
    // kube-apiserver reviews the DELETE of a Pod on no node twice (the graceful update,
    // then the deletion of the changed object): the second review is answered from the
    // API server's answer to the append a moment ago, with no read (the leader leaves a
    // new entry alone longer than that: `calico::index::YOUNG_ENTRY`).
    let reviews = count("capo_admission_requests_total{operation=\"delete\",outcome=\"held\"}") as usize;
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for (method, path) in proxy.requests() {
        if let Some(k) = kind(&method, &path) {
            *per.entry(k).or_default() += 1;
        }
    }
    (per, reviews)
}

const PODS: usize = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_deletion_costs_an_append_and_a_record_and_no_read_when_reviewed_again() {
    let (per, reviews) = cost_of_a_burst("cost", 500).await;
    let of = |k: &str| per.get(k).copied().unwrap_or(0);
    let total: usize = per.values().sum();
    eprintln!(
        "capo's requests for {PODS} held deletions (20 at a time; {reviews} reviews answered held), per hold: {:.2}; {per:?}",
        total as f64 / PODS as f64
    );
    // Per hold at most one append (shared in a burst) and one record create; one shard
    // created. The countdowns are not written into the records: the leader flushes them to
    // one ConfigMap per shard at most once a second (a burst of 60 over a few seconds:
    // a handful of writes, not one per hold). A read confirms a repeated review only when
    // it comes more than 5 s after the append (a slow API server): at most a fifth of them
    // here (before: one read for each).
    assert!(of("PATCH ipreservations") <= PODS, "{per:?}");
    assert_eq!(of("POST reservedips"), PODS, "{per:?}");
    assert_eq!(of("PATCH reservedips/status"), 0, "no status write per hold: {per:?}");
    let countdowns = of("PUT configmaps") + of("POST configmaps");
    assert!(countdowns >= 1, "the countdowns were written somewhere: {per:?}");
    assert!(countdowns * 4 <= PODS, "countdown writes are shared, one per shard and second: {per:?}");
    assert!(of("POST ipreservations") <= 1, "one shard: {per:?}");
    let reads: usize = per.iter().filter(|(k, _)| k.starts_with("GET ")).map(|(_, v)| v).sum();
    assert!(reviews > PODS, "the API server reviewed some deletions twice ({reviews} reviews): nothing to show here");
    assert!(
        reads * 5 <= reviews - PODS,
        "{reads} reads for {} repeated reviews: they are answered from the append: {per:?}",
        reviews - PODS
    );
    let expected = [
        "PATCH ipreservations",
        "POST reservedips",
        "PUT configmaps",
        "POST configmaps",
        "POST ipreservations",
        "GET ipreservations",
    ];
    let others: Vec<_> = per.keys().filter(|k| !expected.contains(&k.as_str())).collect();
    assert!(others.is_empty(), "no other request per hold: {others:?}");
}

/// A burst under a policy with many shards (`maxReserved: 12000`, 24 of them) shares its
/// appends: a hold joins a shard of the policy that has an append in flight rather than
/// starting one in its home shard (`calico::shards::JOIN_BELOW`), and its record names
/// that shard from the start (no record is patched after its create). Measured: 60
/// deletions 20 at a time: without joining 56 appends and 22 shards created, with it 11 and 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_many_shards_shares_its_appends() {
    let (per, _) = cost_of_a_burst("cost-shards", 12_000).await;
    let of = |k: &str| per.get(k).copied().unwrap_or(0);
    eprintln!("appends for {PODS} holds over 24 shards: {}; {per:?}", of("PATCH ipreservations"));
    assert!(of("PATCH ipreservations") * 2 <= PODS, "at most one append per two holds: {per:?}");
    assert_eq!(of("POST reservedips"), PODS, "{per:?}");
    assert_eq!(of("PATCH reservedips"), 0, "every record named its shard when created: {per:?}");
    assert!(of("POST ipreservations") < 24, "the burst went to fewer shards than the policy has: {per:?}");
}

//! capo at scale, against the real API server: a policy holding thousands of IPs spread over
//! bounded shards and released on schedule; holds in the single reservation object of
//! earlier versions after an upgrade; and one Pod's event costing the leader only that
//! Pod's holds. (`make bench` measures the speed; these tests check the behaviour.)

mod support;

use std::net::IpAddr;
use std::time::Duration;

use axum::http::Method;
use capo::calico::shards::SHARD_SIZE;
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::json;
use support::faults::FaultProxy;
use support::leading::*;
use support::*;

/// The tests take turns: the thousands of holds of the first would starve the others'
/// countdowns on 2 cores.
static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Every capo-owned reservation of `policy`: (name, entries).
async fn shards(client: &Client, policy: &str) -> Vec<(String, usize)> {
    let api = Api::<DynamicObject>::all_with(client.clone(), &V1.ip_reservation());
    let lp = ListParams::default().labels(&format!("capo.io/policy={policy}"));
    let mut out: Vec<(String, usize)> = api
        .list(&lp)
        .await
        .unwrap()
        .items
        .iter()
        .map(|o| {
            let n = o.data["spec"]["reservedCIDRs"].as_array().map_or(0, |a| a.len());
            (o.metadata.name.clone().unwrap(), n)
        })
        .collect();
    out.sort();
    out
}

/// Creates `n` selected Pods (`app=redis`) with an IP each, `concurrency` at a time.
async fn many_pods(client: &Client, ns: &str, prefix: &str, n: usize) -> Vec<IpAddr> {
    let ips: Vec<IpAddr> = (0..n).map(|_| Ips::v4()).collect();
    futures::stream::iter(ips.iter().enumerate())
        .for_each_concurrent(32, |(i, ip)| {
            let client = client.clone();
            async move {
                let pod = unscheduled_pod(&format!("{prefix}-{i}"), &[("app", "redis")], &[]);
                create_pod_with_ips(&client, ns, pod, &[*ip]).await;
            }
        })
        .await;
    ips
}

async fn delete_all(client: &Client, ns: &str, prefix: &str, n: usize) {
    let denied: Vec<String> = futures::stream::iter(0..n)
        .map(|i| {
            let client = client.clone();
            async move {
                match delete_pod(&client, ns, &format!("{prefix}-{i}")).await {
                    Ok(_) => None,
                    Err(kube::Error::Api(s)) if s.code == 404 => None, // deleted already
                    Err(e) => Some(e.to_string()),
                }
            }
        })
        .buffer_unordered(64)
        .filter_map(|e| async move { e })
        .collect()
        .await;
    assert!(denied.is_empty(), "{} deletions refused, e.g. {:?}", denied.len(), denied.first());
}

/// How late any release of the storm may be (a bucket of `capo_release_lateness_seconds`),
/// against when it fell due: `reserveFor` after the leader's stores first showed its Pod
/// gone, however long the hold then waited for a worker. Due countdowns go before the
/// leader's other work (`release::queue`), and a hold keeps its due time while it waits
/// behind a storm of new holds. Measured: 2,000 holds (the default here, a debug build) all
/// within 1 s; 20,000 by hand with a release build (`CAPO_SCALE_HOLDS=20000 cargo test
/// --release --test scale -- thousands`): since no hold costs a status write (issue 27,
/// part 4) 146 s of deletions, all within 2 s, 18,806 within 1 s — the target,
/// all within 10 s, is this bound. Before: 218 s of deletions, all within 30 s, 19,284
/// within 10 s; and before the leader noted when it saw a Pod gone and kept due times in
/// its backlog, that run looked better than it was (a countdown started when a worker got
/// round to the hold) and still missed: 17,606 within 30 s.
const LATENESS_BOUND: Duration = Duration::from_secs(10);

/// A policy with room for 25,000 holds (one object fits about 80,000 at most, and every
/// hold would rewrite it) holds 2,000 IPs (`CAPO_SCALE_HOLDS`; 20,000 by hand takes about
/// 5 minutes on 2 cores with `--release`, creating and deleting the Pods): they are spread
/// over its 50 shards (a burst fills a few first: `calico::shards::JOIN_BELOW`), none above
/// its bound, and all released on schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_holds_spread_over_bounded_shards_and_are_released_on_schedule() {
    let _turn = TURNS.lock().await;
    let n: usize = std::env::var("CAPO_SCALE_HOLDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    let Scene { client, ns, capo, policy } = scene(
        "scale-20k",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "30s", "maxReserved": 25000,
                "releaseInterval": "100ms", "releaseBatch": 1000 }),
    )
    .await;
    many_pods(&client, &ns.name, "redis", n).await;
    let started = std::time::Instant::now();
    delete_all(&client, &ns.name, "redis", n).await;
    eprintln!("{n} deletions held in {:?}", started.elapsed());
    // Every IP held: none refused above, and every one released below with a record (the
    // first holds fall due while the last deletions still come in, so the shards hold the
    // rest, never more).
    let released = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    let before = metric_value(&capo, &released).unwrap_or(0.0) as usize;
    let layout = shards(&client, &policy).await;
    let total: usize = layout.iter().map(|(_, c)| c).sum();
    assert!(total <= n - before, "{total} entries for {n} holds of which {before} were released: {layout:?}");
    // A burst's holds join a shard with an append in flight while it holds fewer than
    // `JOIN_BELOW` (so the storm needs few appends), then go to their home shards: none
    // past its bound, and no overflow shard needed.
    assert!(layout.len() <= 50, "within the policy's 50 shards: {layout:?}");
    let biggest = layout.iter().map(|(_, c)| *c).max().unwrap();
    assert!(biggest <= SHARD_SIZE, "a shard above its bound of {SHARD_SIZE}: {layout:?}");
    eprintln!("shards: {} of at most {biggest} entries", layout.len());
    // Released on schedule: the wait is ten times the lateness bound asserted below, so a
    // release later than the bound fails that assertion, not this wait.
    eventually("every hold released", Duration::from_secs(30) + LATENESS_BOUND * 10, || async {
        (metric_value(&capo, &released) == Some(n as f64)).then_some(())
    })
    .await;
    // How late, against when each hold fell due: the holds fall due as fast as the webhook
    // took them, and the leader (a debug build sharing 2 cores with the API server and
    // this test) releases slower than that; `make bench` measures the release build.
    let within = |le: &str| {
        let bucket = format!("capo_release_lateness_seconds_bucket{{policy=\"{policy}\",le=\"{le}\"}}");
        metric_value(&capo, &bucket).unwrap_or(0.0)
    };
    let spread: Vec<(&str, f64)> =
        ["1", "2", "5", "10", "30", "60", "300"].into_iter().map(|le| (le, within(le))).collect();
    eprintln!("releases within (le seconds, count): {spread:?}");
    let bound = LATENESS_BOUND.as_secs().to_string();
    assert_eq!(within(&bound), n as f64, "every release within {bound} s of its due time: {spread:?}");
    assert!(shards(&client, &policy).await.iter().all(|(_, c)| *c == 0));
    assert!(
        Api::<capo_api::ReservedIP>::all(client.clone())
            .list(&ListParams::default().labels(&format!("capo.io/policy={policy}")))
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

/// After an upgrade: the policy's holds sit in the one object earlier versions wrote
/// (`capo-<policy>`, no leader epoch, records with their status); the new capo releases
/// them from there on schedule, and puts new holds in the shards its cap gives.
#[tokio::test]
async fn holds_in_the_single_reservation_of_earlier_versions_are_released_from_where_they_are() {
    let _turn = TURNS.lock().await;
    let (client, ns) = setup("scale-upgrade").await;
    let policy = format!("{}-p", ns.name);
    // What an earlier capo left: one object with 300 entries, records counting down.
    let old: Vec<IpAddr> = (0..300).map(|_| Ips::v4()).collect();
    let gone = Timestamp::now();
    let mut obj = DynamicObject::new(&format!("capo-{policy}"), &V1.ip_reservation());
    obj.metadata.labels = Some(
        [("app.kubernetes.io/managed-by", "capo"), ("capo.io/policy", policy.as_str())]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
    );
    obj.data = json!({ "spec": { "reservedCIDRs": old.iter().map(|ip| cidr(*ip)).collect::<Vec<_>>() } });
    Api::<DynamicObject>::all_with(client.clone(), &V1.ip_reservation())
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
    let records = Api::<capo_api::ReservedIP>::all(client.clone());
    futures::stream::iter(&old)
        .for_each_concurrent(16, |ip| {
            let (records, policy, ns) = (records.clone(), policy.clone(), ns.name.clone());
            async move {
                let rec: capo_api::ReservedIP = serde_json::from_value(json!({
                    "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
                    "metadata": { "name": capo_api::reserved_ip::record_name(*ip),
                                  "labels": { "app.kubernetes.io/managed-by": "capo", "capo.io/policy": policy } },
                    "spec": { "ip": ip.to_string(), "cidr": cidr(*ip), "reservation": format!("capo-{policy}"),
                              "calicoApiGroup": "crd.projectcalico.org/v1", "policy": policy,
                              "pod": { "namespace": ns, "name": format!("old-{}", ip.to_string().replace('.', "-")), "uid": format!("old-{ip}") },
                              "trigger": "Delete", "reservedAt": gone, "reserveFor": "8s" },
                }))
                .unwrap();
                records.create(&PostParams::default(), &rec).await.unwrap();
            }
        })
        .await;
    // The new capo, with a cap that gives the policy five shards.
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    apply_policy(
        &client,
        &policy,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "8s", "maxReserved": 2500,
                "releaseInterval": "100ms", "releaseBatch": 1000 }),
    )
    .await;
    let new = many_pods(&client, &ns.name, "redis", 50).await;
    delete_all(&client, &ns.name, "redis", 50).await;
    for ip in &new {
        let rec = record(&client, *ip).await.expect("held");
        let shard = &rec.spec.reservation;
        let i = capo::calico::shards::index_of(shard, &policy);
        assert!(i.is_some_and(|i| i < 5), "{ip} in {shard}: one of the five shards the cap gives");
        let listed = reservation(&client, V1, shard).await.unwrap();
        assert!(listed.contains(&cidr(*ip)), "{ip}'s record names {shard}, which lists it");
    }
    // The old holds are released from the old object, on schedule.
    let due: Vec<(IpAddr, Timestamp)> = eventually("every old hold counting down", Duration::from_secs(20), || async {
        let recs = support::records(&client, &old).await;
        old.iter().map(|ip| Some((*ip, recs.get(ip)?.status.as_ref()?.release_at.as_ref()?.0))).collect()
    })
    .await;
    for (ip, at) in &due {
        let released = wait_released(&client, *ip, Duration::from_secs(60)).await;
        let late = released.duration_since(*at).as_secs_f64();
        assert!(late >= -0.05, "{ip} released {late:.2}s early");
    }
    let left = reservation(&client, V1, &format!("capo-{policy}")).await.unwrap();
    assert!(old.iter().all(|ip| !left.contains(&cidr(*ip))), "the old entries left capo-{policy}");
}

/// The leader's cost follows the event: with 100 holds in place, one Pod that goes away
/// costs exactly one write (its shard's countdowns) and no read.
#[tokio::test]
async fn one_pod_event_costs_the_leader_only_that_pods_hold() {
    let _turn = TURNS.lock().await;
    let (client, ns) = setup("scale-event").await;
    let proxy = FaultProxy::start(client.clone()).await;
    init_tracing();
    let capo = capo::App::start(proxy.client(), leading_settings(&ns.name, "a", Duration::from_secs(600)))
        .await
        .expect("start capo");
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" });
    let Scene { client, ns, capo, .. } = scene_with(client, ns, capo, spec).await;
    // 100 holds through the webhook, all counted down (their Pods gone).
    let ips = many_pods(&client, &ns.name, "redis", 100).await;
    let canary = Ips::v4();
    let mut pod = unscheduled_pod("one", &[("app", "redis")], &[]);
    keep_while_deleted(&client, &mut pod).await;
    create_pod_with_ips(&client, &ns.name, pod, &[canary]).await;
    // The webhook registration reaches the API server asynchronously.
    eventually("capo to hold", Duration::from_secs(30), || async {
        delete_pod(&client, &ns.name, "redis-0").await.ok()?;
        record(&client, ips[0]).await.map(|_| ())
    })
    .await;
    delete_all(&client, &ns.name, "redis", 100).await;
    delete_pod(&client, &ns.name, "one").await.unwrap();
    for ip in &ips {
        wait_status(&client, *ip).await;
    }
    let one =
        eventually("the kept Pod's hold", Duration::from_secs(20), || async { record(&client, canary).await }).await;
    assert!(one.status.as_ref().and_then(|s| s.pod_gone_at.as_ref()).is_none(), "not gone yet: not counting down");
    // Quiet: nothing left to do. Then one Pod goes away.
    eventually("the leader to go quiet", Duration::from_secs(30), || async {
        (metric_value(&capo, "capo_release_queue_depth") == Some(0.0)).then_some(())
    })
    .await;
    proxy.clear_requests();
    let_go(&client, &ns.name, "one").await;
    wait_status(&client, canary).await;
    let calls: Vec<(Method, String)> =
        // Watches and the Lease's renewal (every few seconds, whatever happens) aside.
        proxy.requests().into_iter().filter(|(_, path)| !path.contains("watch=") && !path.contains("/leases/")).collect();
    // That hold's countdown, flushed with its shard's (one replace of one ConfigMap): no
    // status write, no read.
    assert!(
        calls.iter().all(|(m, p)| *m == Method::PUT && p.contains("/configmaps/capo-countdowns-")),
        "only that hold's shard's countdowns were written: {calls:?}"
    );
    assert_eq!(calls.len(), 1, "{calls:?}");
    drop(capo);
}

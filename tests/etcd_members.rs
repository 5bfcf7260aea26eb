//! capo's etcd client against a three-member etcd cluster (issue 24, defect 5): a watch
//! whose member stops answering is left for another member within its bound, and what
//! was written meanwhile through another member is not missed.

use std::time::{Duration, Instant};

use capo::calico::etcd::{Etcd, EtcdConfig, PrefixEvent};
use futures::StreamExt;
use serde_json::json;

const PREFIX: &str = "/calico/resources/v3/projectcalico.org/ipreservations/";

fn b64(s: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// Writes `key` through the member at `endpoint`, trying again while the cluster elects a
/// new leader.
async fn put(endpoint: &str, key: &str) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    let body = json!({ "key": b64(key.as_bytes()), "value": b64(b"{}") });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match http.post(format!("{endpoint}/v3/kv/put")).json(&body).send().await {
            Ok(r) if r.status().is_success() => return,
            Ok(r) if Instant::now() > deadline => panic!("put {key} at {endpoint}: HTTP {}", r.status()),
            Err(e) if Instant::now() > deadline => panic!("put {key} at {endpoint}: {e}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Whether `event` shows `key` present.
fn shows(event: &PrefixEvent, key: &str) -> bool {
    match event {
        PrefixEvent::Listed(kvs) => kvs.iter().any(|kv| kv.key == key),
        PrefixEvent::Put(kv) => kv.key == key,
        PrefixEvent::Deleted(_) => false,
    }
}

/// Member 0 is paused (SIGSTOP: its connections stay open and nothing answers on them,
/// as a member behind a stalled network looks to its clients) while capo follows the
/// reservations through it; a reservation written through member 1 reaches capo within
/// the watch's bound (10 s of silence, then a 3 s linearizable read). On the code before
/// it the watch stayed open and silent for good.
#[tokio::test]
async fn a_watch_whose_member_stops_answering_moves_to_another_and_misses_nothing() {
    let dir = std::env::temp_dir().join(format!("capo-etcd-members-{}", std::process::id()));
    let cluster = capo_testenv::EtcdCluster::start(&dir, 3).await.expect("a three-member etcd");
    let endpoints = cluster.endpoints().to_vec();
    let etcd = Etcd::new(&EtcdConfig { endpoints: endpoints.clone(), ..Default::default() }).unwrap();
    let mut events = Box::pin(etcd.follow(PREFIX.to_string()));
    let first = tokio::time::timeout(Duration::from_secs(10), events.next()).await.expect("listed").unwrap();
    assert_eq!(first, PrefixEvent::Listed(Vec::new()));

    // While all is well, a write through another member arrives at once.
    let before = format!("{PREFIX}before");
    put(&endpoints[1], &before).await;
    let event = tokio::time::timeout(Duration::from_secs(5), events.next()).await.expect("a change").unwrap();
    assert!(shows(&event, &before), "{event:?}");

    cluster.pause(0);
    let paused = Instant::now();
    let during = format!("{PREFIX}during");
    put(&endpoints[1], &during).await;
    let seen = tokio::time::timeout(Duration::from_secs(40), async {
        while let Some(event) = events.next().await {
            if shows(&event, &during) {
                return Some(event);
            }
        }
        None
    })
    .await
    .unwrap_or_else(|_| panic!("{during} not seen 40 s after member 0 stopped answering"))
    .expect("the stream goes on");
    let after = paused.elapsed();
    eprintln!("seen {after:.1?} after member 0 was paused: {seen:?}");
    assert!(after < Duration::from_secs(25), "seen only after {after:?}");
    cluster.resume(0);
}

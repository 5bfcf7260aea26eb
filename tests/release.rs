//! Release, repair, the safety net and leader election against a real API server that
//! calls capo's webhook over TLS. Each test's capo only acts on its own policies (named
//! after the test's namespace), so tests share one control plane.

mod support;

use std::time::{Duration, Instant};

use capo_api::HoldTrigger;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, EvictParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::leading::*;
use support::*;

#[tokio::test]
async fn a_short_ttl_is_released_on_time_and_never_before_the_pod_is_gone() {
    let Scene { client, ns, capo, policy } = scene(
        "rel-ttl",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "2s", "releaseInterval": "100ms" }),
    )
    .await;
    let ip = selected_pod(&client, &ns.name, "redis-0", true).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    assert!(entries(&client, &policy).await.contains(&cidr(ip)), "held when the DELETE returned");

    // The Pod is kept by a finalizer: being deleted, not gone. Well past the 2s TTL the
    // hold is still there and not counting down.
    let deadline = Instant::now() + Duration::from_secs(4);
    while Instant::now() < deadline {
        let rec = record(&client, ip).await.expect("still held while the Pod is not gone");
        if rec.status.as_ref().and_then(|s| s.pod_gone_at.as_ref()).is_some() {
            let pod = Api::<Pod>::namespaced(client.clone(), &ns.name).get_opt("redis-0").await.unwrap();
            let phase = pod.as_ref().and_then(|p| p.status.as_ref()?.phase.clone());
            panic!(
                "counted down too early: {:?}; the Pod (phase {phase:?}) is still there: {}",
                rec.status,
                pod.is_some()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let_go(&client, &ns.name, "redis-0").await;
    let rec = wait_status(&client, ip).await;
    let st = rec.status.clone().unwrap();
    let gone = st.pod_gone_at.unwrap().0;
    let release_at = st.release_at.unwrap().0;
    assert_eq!(release_at.duration_since(gone).as_secs_f64(), 2.0, "releaseAt = podGoneAt + reserveFor");
    let released = wait_released(&client, ip, Duration::from_secs(20)).await;
    let late = released.duration_since(release_at).as_secs_f64();
    assert!(late >= -0.05, "released {late:.3}s before its releaseAt");
    assert!(late <= 1.2, "released {late:.3}s after its releaseAt");
    assert!(!entries(&client, &policy).await.contains(&cidr(ip)), "the entry left the Calico reservation");
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&capo, &ttl, 1.0).await, 1.0);
    let lateness = format!("capo_release_lateness_seconds_count{{policy=\"{policy}\"}}");
    assert_eq!(wait_metric(&capo, &lateness, 1.0).await, 1.0);
    assert_eq!(metric_value(&capo, "capo_leader"), Some(1.0));
}

#[tokio::test]
async fn the_cap_releases_the_oldest_first_and_the_count_never_stays_above_it() {
    let Scene { client, ns, capo, policy } = scene("rel-cap", Duration::from_secs(600), json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": 2, "releaseInterval": "1s" })).await;
    let mut ips = Vec::new();
    for i in 0..5 {
        ips.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
    }
    // Watch the count while deleting: it may exceed the cap, but never for longer than
    // one releaseInterval (plus the time to notice and write).
    let watcher = {
        let client = client.clone();
        let policy = policy.clone();
        tokio::spawn(async move {
            let mut over_since: Option<Instant> = None;
            let mut worst = Duration::ZERO;
            let end = Instant::now() + Duration::from_secs(12);
            while Instant::now() < end {
                let n = entries(&client, &policy).await.len();
                match (n > 2, over_since) {
                    (true, None) => over_since = Some(Instant::now()),
                    (false, Some(t)) => {
                        worst = worst.max(t.elapsed());
                        over_since = None;
                    }
                    _ => {}
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            worst.max(over_since.map_or(Duration::ZERO, |t| t.elapsed()))
        })
    };
    for i in 0..5 {
        delete_pod(&client, &ns.name, &format!("redis-{i}")).await.expect("deletion allowed");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for &ip in &ips[..3] {
        wait_released(&client, ip, Duration::from_secs(15)).await;
    }
    for &ip in &ips[3..] {
        assert!(record(&client, ip).await.is_some(), "the two newest stay held");
    }
    let worst = watcher.await.unwrap();
    assert!(worst <= Duration::from_millis(2500), "above the cap for {worst:?}");
    let mut left = entries(&client, &policy).await;
    left.sort();
    let mut want: Vec<String> = ips[3..].iter().map(|&ip| cidr(ip)).collect();
    want.sort();
    assert_eq!(left, want);
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(wait_metric(&capo, &cap, 3.0).await, 3.0);
    let note = wait_event(&client, "default", &policy, "CapReached").await;
    assert!(note.contains("maxReserved=2"), "{note}");
    // kubectl describe lists only the Events whose object carries the policy's UID.
    let (ok, described) = kubectl(&["describe", "capopolicy", &policy], None).await;
    assert!(
        ok && described.contains("CapReached"),
        "kubectl describe capopolicy shows the policy's Events: {described}"
    );
    let note = wait_event(&client, &ns.name, "redis-4", "IPHeld").await;
    assert!(note.contains(&ips[4].to_string()), "{note}");
    assert_eq!(metric_value(&capo, &format!("capo_held_ips{{policy=\"{policy}\"}}")), Some(2.0));
    assert_eq!(metric_value(&capo, &format!("capo_max_reserved{{policy=\"{policy}\"}}")), Some(2.0));
}

/// A repeated review of a deletion is answered from the append a moment ago, with no read
/// (`hold::ANSWERED_FROM_ACK`, 5 s): so the leader leaves an entry whose Pod may still be
/// reviewed alone until `calico::index::YOUNG_ENTRY` (6 s) after its watch first showed it,
/// even when the cap chooses it at once. (A Pod that has left is released at once: the cap
/// test above, at most 2.5 s above the cap.)
#[tokio::test]
async fn the_cap_leaves_a_new_entry_of_a_pod_still_there_alone_until_a_repeated_review_could_no_longer_rely_on_it() {
    let Scene { client, ns, capo, policy } = scene(
        "rel-young",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": 1, "releaseInterval": "1s" }),
    )
    .await;
    // Deleted, it stays (a finalizer and a node): its kubelet's deletion is still to come.
    let staying = selected_pod(&client, &ns.name, "redis-0", true).await;
    let leaving = selected_pod(&client, &ns.name, "redis-1", false).await;
    let sent = Instant::now();
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    delete_pod(&client, &ns.name, "redis-1").await.expect("deletion allowed");
    // Two holds under maxReserved 1: the older (redis-0's) goes, but not before 6 s after
    // its append was sent (its commit, and the leader's first sight, came later still).
    let entry = cidr(staying);
    let removed = eventually("redis-0's entry removed by the cap", Duration::from_secs(30), || {
        let client = client.clone();
        let (policy, entry) = (policy.clone(), entry.clone());
        async move { (!entries(&client, &policy).await.contains(&entry)).then(Instant::now) }
    })
    .await;
    let after = removed.duration_since(sent);
    assert!(after >= Duration::from_secs(6), "removed {after:?} after its append was sent");
    assert!(after < Duration::from_secs(20), "removed only {after:?} after its append was sent");
    wait_released(&client, staying, Duration::from_secs(15)).await;
    assert!(record(&client, leaving).await.is_some(), "the newer hold stays");
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(wait_metric(&capo, &cap, 1.0).await, 1.0);
    let_go(&client, &ns.name, "redis-0").await;
}

/// Holds at a human pace get an `IPHeld` Event each, on their Pod. A burst (a drain, a
/// failed node) gets them for the first ten of a policy within 10 s, then one `IPsHeld`
/// Event on the policy that counts the rest: one API write instead of one per hold.
#[tokio::test]
async fn a_burst_of_holds_is_announced_one_by_one_up_to_ten_then_summed_up_on_the_policy() {
    let Scene { client, ns, capo: _capo, policy } = scene(
        "rel-burst",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" }),
    )
    .await;
    let mut ips = Vec::new();
    for i in 0..25 {
        ips.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
    }
    let deleted = Instant::now();
    futures::future::join_all((0..25).map(|i| {
        let (client, ns) = (client.clone(), ns.name.clone());
        async move { delete_pod(&client, &ns, &format!("redis-{i}")).await.expect("deletion allowed") }
    }))
    .await;
    for &ip in &ips {
        assert!(record(&client, ip).await.is_some(), "every one held");
    }
    let note = wait_event_within(&client, "default", &policy, "IPsHeld", Duration::from_secs(30)).await;
    let waited = deleted.elapsed();
    assert!(note.contains("capo held 15 more IPs of policy"), "{note}");
    assert!(note.contains("and 10 more"), "five named, ten counted: {note}");
    assert!(waited >= Duration::from_secs(9), "the summary waits for its window to end ({waited:?})");
    // The window opened with the first hold, right after the deletions: its summary comes
    // at its end, not whenever the leader next gets round to it (the wait above is longer).
    assert!(waited <= Duration::from_secs(20), "the summary comes when its window ends ({waited:?})");
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), &ns.name);
    let each: Vec<_> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("IPHeld"))
        .filter_map(|e| e.regarding.and_then(|r| r.name))
        .collect();
    assert_eq!(each.len(), 10, "ten announced one by one: {each:?}");
    let named = |pod: &String| note.contains(&format!("{}/{pod} ", ns.name));
    assert!(!each.iter().any(named), "a hold is announced once, by one of the two: {note} / {each:?}");
    assert_eq!(event_count(&client, "default", &policy, "IPsHeld").await, 1, "one summary");

    // The next hold, after the window, is announced on its Pod again.
    let ip = selected_pod(&client, &ns.name, "redis-late", false).await;
    delete_pod(&client, &ns.name, "redis-late").await.expect("deletion allowed");
    let note = wait_event(&client, &ns.name, "redis-late", "IPHeld").await;
    assert!(note.contains(&ip.to_string()), "{note}");
}

/// A storm of new holds keeps the leader busy; here one worker, and the fault proxy holds
/// every status write and every countdown ConfigMap write back 2 s. A hold's countdown
/// still runs from when the leader saw its Pod gone, and the hold is released when it runs
/// out, not after the writes made for the holds queued before it (six holds, a 2 s TTL:
/// with one 2 s write each on the worker, the last would be released at about 12 s).
#[tokio::test]
async fn a_backlog_of_slow_writes_neither_starts_countdowns_late_nor_delays_releases() {
    use axum::http::Method;
    use support::faults::{Fault, FaultProxy, Rule};
    let (client, ns) = setup("rel-backlog").await;
    let proxy = FaultProxy::start(client.clone()).await;
    let mut settings = leading_settings(&ns.name, "a", Duration::from_secs(600));
    settings.release.as_mut().unwrap().engine.workers = 1;
    let capo = start_capo_with(&proxy.client(), &ns.name, settings).await;
    let spec =
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "2s", "releaseInterval": "100ms" });
    let Scene { client, ns, capo: _capo, .. } = scene_with(client, ns, capo, spec).await;
    let mut ips = Vec::new();
    for i in 0..6 {
        ips.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
    }
    proxy.set(vec![
        Rule::new(Method::PATCH, "/status", Fault::Delay(Duration::from_secs(2))),
        Rule::new(Method::PUT, "/configmaps", Fault::Delay(Duration::from_secs(2))),
        Rule::new(Method::POST, "/configmaps", Fault::Delay(Duration::from_secs(2))),
    ]);
    let deleted = Instant::now();
    futures::future::join_all((0..6).map(|i| {
        let (client, ns) = (client.clone(), ns.name.clone());
        async move { delete_pod(&client, &ns, &format!("redis-{i}")).await.expect("deletion allowed") }
    }))
    .await;
    // When each record goes (its entry is removed first), polled every 50 ms.
    let mut released: Vec<Option<Duration>> = vec![None; ips.len()];
    while released.iter().any(Option::is_none) && deleted.elapsed() < Duration::from_secs(30) {
        for (i, ip) in ips.iter().enumerate() {
            if released[i].is_none() && record(&client, *ip).await.is_none() {
                released[i] = Some(deleted.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let released: Vec<Duration> = released.into_iter().map(|r| r.expect("every hold released")).collect();
    eprintln!("released after {released:?}");
    assert!(proxy.injected() > 0, "the countdown writes were held back");
    let first = released.iter().min().unwrap();
    let last = released.iter().max().unwrap();
    assert!(*first >= Duration::from_secs(2), "never before the TTL: {released:?}");
    assert!(*last <= Duration::from_secs(7), "each released when its own countdown ran out: {released:?}");
}

/// The leader's deletion of a released hold's record gets no answer: once after it landed
/// (the connection closes before the answer), once before it was sent. Either way the record
/// goes, the release is counted once, and the next hold is released as usual. On af805d7 a
/// lost answer left the release uncounted (the scale test waited for its count in vain)
/// and a dropped request left the record behind with its entry gone.
#[tokio::test]
async fn a_record_deletion_that_gets_no_answer_is_read_back_and_counted_once() {
    use axum::http::Method;
    use support::faults::{Fault, FaultProxy, Rule};
    let (client, ns) = setup("rel-lost").await;
    let proxy = FaultProxy::start(client.clone()).await;
    let capo =
        start_capo_with(&proxy.client(), &ns.name, leading_settings(&ns.name, "a", Duration::from_secs(600))).await;
    let spec =
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1s", "releaseInterval": "100ms" });
    let Scene { client, ns, capo, policy } = scene_with(client, ns, capo, spec).await;
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    let cases = [("answer lost after the deletion landed", Fault::DropAnswer), ("request dropped", Fault::Drop)];
    for (i, (what, fault)) in cases.into_iter().enumerate() {
        let pod = format!("redis-{i}");
        let ip = selected_pod(&client, &ns.name, &pod, false).await;
        proxy.set(vec![Rule::new(Method::DELETE, "/reservedips/", fault).times(1)]);
        let injected = proxy.injected();
        delete_pod(&client, &ns.name, &pod).await.expect("deletion allowed");
        wait_released(&client, ip, Duration::from_secs(20)).await;
        assert_eq!(proxy.injected(), injected + 1, "{what}: the fault fired");
        assert!(!entries(&client, &policy).await.contains(&cidr(ip)), "{what}: the entry is out");
        // Counted once: exactly i + 1 releases, and it stays so.
        assert_eq!(wait_metric(&capo, &ttl, (i + 1) as f64).await, (i + 1) as f64, "{what}");
    }
    proxy.clear();
    // Nothing counted twice once the retries settle.
    let ip = selected_pod(&client, &ns.name, "redis-last", false).await;
    delete_pod(&client, &ns.name, "redis-last").await.expect("deletion allowed");
    wait_released(&client, ip, Duration::from_secs(20)).await;
    assert_eq!(wait_metric(&capo, &ttl, 3.0).await, 3.0);
}

#[tokio::test]
async fn two_replicas_elect_one_leader_and_the_other_takes_over() {
    let (client, ns) = setup("rel-ha").await;
    let a = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    let b = start_leading(&client, &ns.name, "b", Duration::from_secs(600)).await;
    let leaders = || [&a, &b].iter().filter(|x| x.fence.as_ref().unwrap().is_leader()).count();
    eventually("a leader", Duration::from_secs(20), || async { (leaders() == 1).then_some(()) }).await;
    // Stable: still exactly one a few renewals later.
    for _ in 0..20 {
        assert_eq!(leaders(), 1, "exactly one leader");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (leader, follower) = if a.fence.as_ref().unwrap().is_leader() { (a, b) } else { (b, a) };
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), "default")
        .get(&format!("capo-{}", ns.name))
        .await
        .unwrap();
    let holder = lease.spec.unwrap().holder_identity.unwrap();
    assert!(holder == "a" || holder == "b");
    assert_eq!(metric_value(&follower, "capo_leader"), Some(0.0));
    // The leader shuts down: it gives the Lease up and the other takes over.
    let handed_over = Instant::now();
    leader.shutdown().await;
    let f = follower.fence.clone().unwrap();
    eventually("the follower to lead", Duration::from_secs(15), || {
        let f = f.clone();
        async move { f.is_leader().then_some(()) }
    })
    .await;
    eprintln!("takeover after a graceful shutdown: {:?}", handed_over.elapsed());
    eventually("capo_leader 1 on the new leader", Duration::from_secs(5), || async {
        (metric_value(&follower, "capo_leader") == Some(1.0)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn deleting_a_policy_never_releases_its_holds_early() {
    let Scene { client, ns, capo: _capo, policy } = scene(
        "rel-pdel",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "4s", "releaseInterval": "100ms" }),
    )
    .await;
    let ip = selected_pod(&client, &ns.name, "redis-0", false).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    let rec = wait_status(&client, ip).await;
    let release_at = rec.status.unwrap().release_at.unwrap().0;
    Api::<capo_api::CapoPolicy>::all(client.clone()).delete(&policy, &DeleteParams::default()).await.unwrap();
    let released = wait_released(&client, ip, Duration::from_secs(20)).await;
    let late = released.duration_since(release_at).as_secs_f64();
    assert!(late >= -0.05, "a deleted policy's hold was released {late:.3}s early");
    assert!(late <= 1.2, "released {late:.3}s late");
}

#[tokio::test]
async fn repair_adopts_orphans_writes_back_missing_entries_and_leaves_foreign_cidrs() {
    let Scene { client, ns, capo, policy } = scene(
        "rel-repair",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h" }),
    )
    .await;
    // A real hold, whose entry is then lost (a restore, a hand edit).
    let held = selected_pod(&client, &ns.name, "redis-0", false).await;
    delete_pod(&client, &ns.name, "redis-0").await.expect("deletion allowed");
    wait_status(&client, held).await;
    let orphan = Ips::v4();
    let api = Api::<DynamicObject>::all_with(client.clone(), &V1.ip_reservation());
    let name = format!("capo-{policy}");
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "reservedCIDRs": [cidr(orphan), "198.19.240.0/24", "198.19.241.7/31"] } })),
    )
    .await
    .unwrap();
    // The orphan is adopted, the lost entry written back; the valid CIDRs capo did not
    // write stay (and are reported).
    let c = &client;
    let adopted = eventually("the orphan adopted", Duration::from_secs(20), || async move {
        let r = record(c, orphan).await?;
        r.status.as_ref()?.release_at.as_ref()?;
        Some(r)
    })
    .await;
    assert_eq!(adopted.spec.trigger, HoldTrigger::Adopted);
    assert_eq!(adopted.spec.reserve_for, "1h");
    let mut want = vec![cidr(held), cidr(orphan), "198.19.240.0/24".to_string(), "198.19.241.7/31".to_string()];
    want.sort();
    eventually("entries repaired", Duration::from_secs(20), || {
        let want = want.clone();
        let client = client.clone();
        let policy = policy.clone();
        async move {
            let mut got = entries(&client, &policy).await;
            got.sort();
            (got == want).then_some(())
        }
    })
    .await;
    assert!(record(&client, held).await.is_some(), "the real hold kept its record");
    assert_eq!(metric_value(&capo, "capo_repairs_total{action=\"garbage_removed\"}").unwrap_or(0.0), 0.0);
    assert_eq!(metric_value(&capo, &format!("capo_foreign_entries{{policy=\"{policy}\"}}")), Some(2.0));
    assert_eq!(metric_value(&capo, "capo_repairs_total{action=\"adopted\"}"), Some(1.0));
    assert!(metric_value(&capo, "capo_repairs_total{action=\"written_back\"}").unwrap_or(0.0) >= 1.0);
}

#[tokio::test]
async fn a_failed_pod_with_ips_is_held_by_the_safety_net() {
    let Scene { client, ns, capo, policy } =
        scene("rel-net", Duration::from_secs(600), json!({ "podSelector": { "matchLabels": { "app": "redis" } } }))
            .await;
    let ip = selected_pod(&client, &ns.name, "redis-0", false).await;
    // What a kubelet does on a node-pressure eviction: no API request capo could review.
    Api::<Pod>::namespaced(client.clone(), &ns.name)
        .patch_status(
            "redis-0",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Failed", "reason": "Evicted" } })),
        )
        .await
        .unwrap();
    let c = &client;
    let rec =
        eventually("the safety net to hold", Duration::from_secs(20), || async move { record(c, ip).await }).await;
    assert_eq!(rec.spec.trigger, HoldTrigger::SafetyNet);
    // The entry and the record are written at once; the record may show up first.
    eventually("the entry in the reservation", Duration::from_secs(10), || async {
        entries(&client, &policy).await.contains(&cidr(ip)).then_some(())
    })
    .await;
    let holds = format!("capo_safety_net_holds_total{{policy=\"{policy}\"}}");
    eventually("the safety-net hold counted", Duration::from_secs(5), || async {
        (metric_value(&capo, &holds) == Some(1.0)).then_some(())
    })
    .await;
    // Its clock runs from the terminal phase: status.podGoneAt is set although the Pod exists.
    let rec = wait_status(&client, ip).await;
    assert!(rec.status.unwrap().pod_gone_at.is_some());

    // A second Failed Pod whose IP another running Pod already has: not reserved.
    let shared_ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("other", &[("app", "web")], &[]), &[shared_ip]).await;
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("late", &[("app", "redis")], &[]), &[shared_ip]).await;
    Api::<Pod>::namespaced(client.clone(), &ns.name)
        .patch_status("late", &PatchParams::default(), &Patch::Merge(json!({ "status": { "phase": "Failed" } })))
        .await
        .unwrap();
    eventually("the lost race counted", Duration::from_secs(20), || async {
        (metric_value(&capo, &format!("capo_safety_net_lost_races_total{{policy=\"{policy}\"}}")) == Some(1.0))
            .then_some(())
    })
    .await;
    assert!(record(&client, shared_ip).await.is_none(), "someone else's address was not reserved");
    let note = wait_event(&client, &ns.name, "late", "LateHoldLost").await;
    assert!(note.contains(&shared_ip.to_string()), "{note}");
}

#[tokio::test]
async fn a_pdb_refused_eviction_does_not_leave_a_hold_forever() {
    let Scene { client, ns, capo, policy } =
        scene("rel-pdb", Duration::from_secs(8), json!({ "podSelector": { "matchLabels": { "app": "zk" } } })).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    pods.create(&PostParams::default(), &kwok_pod("zk-0", &[("app", "zk")])).await.unwrap();
    let pod = wait_running(&client, &ns.name, "zk-0").await;
    let ip = pod_ips(&pod)[0];
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "zk" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "zk" } } },
    }))
    .unwrap();
    Api::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &pdb).await.unwrap();
    let refused = pods.evict("zk-0", &EvictParams::default()).await;
    // The PDB's refusal (capo's own would say "capo could not hold").
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 429 && s.message.contains("disruption budget")),
        "the PDB refuses: {refused:?}"
    );
    // capo held before the PDB said no; the Pod stays, so the hold is dropped after the grace.
    let Some(rec) = record(&client, ip).await else {
        let metrics = capo.metrics.render();
        let answers: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                ["capo_admission", "capo_hold", "capo_pod_cache", "capo_webhook_tls", "capo_releases"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .collect();
        panic!("not held on the eviction; capo's answers and handshakes:\n{}", answers.join("\n"))
    };
    assert_eq!(rec.spec.trigger, HoldTrigger::Eviction);
    wait_released(&client, ip, Duration::from_secs(30)).await;
    assert!(!entries(&client, &policy).await.contains(&cidr(ip)));
    assert!(pods.get("zk-0").await.is_ok(), "the Pod still runs");
    assert_eq!(
        metric_value(&capo, &format!("capo_releases_total{{policy=\"{policy}\",reason=\"pod-kept\"}}")),
        Some(1.0)
    );
}

/// A PodDisruptionBudget that refuses every eviction of the Pods labelled `kept=yes`.
async fn refuse_evictions(client: &kube::Client, ns: &str) {
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "kept" },
        "spec": { "maxUnavailable": 0, "selector": { "matchLabels": { "kept": "yes" } } },
    }))
    .unwrap();
    Api::namespaced(client.clone(), ns).create(&PostParams::default(), &pdb).await.unwrap();
}

/// A Pod kwok runs (selected by `app=redis`, covered by [`refuse_evictions`]) whose
/// eviction is refused: capo holds it on the eviction, and the Pod stays. With `settled`,
/// waits until the leader counts the hold as staying (`podKeptSince`). Returns its IP.
async fn refused_eviction(client: &kube::Client, ns: &str, name: &str, settled: bool) -> std::net::IpAddr {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &kwok_pod(name, &[("app", "redis"), ("kept", "yes")])).await.unwrap();
    let ip = pod_ips(&wait_running(client, ns, name).await)[0];
    // The disruption controller must have counted the Pod before the PDB refuses.
    let what = format!("the eviction of {name} refused by the PDB");
    eventually(&what, Duration::from_secs(30), || {
        let pods = pods.clone();
        async move {
            match pods.evict(name, &EvictParams::default()).await {
                Err(kube::Error::Api(s)) if s.code == 429 && s.message.contains("disruption budget") => Some(()),
                Err(kube::Error::Api(s)) if s.code == 429 => None,
                other => panic!("the PDB should refuse the eviction of {name}: {other:?}"),
            }
        }
    })
    .await;
    assert!(record(client, ip).await.is_some(), "{name} held on its eviction");
    if settled {
        eventually(
            &format!("{name}'s hold counted as staying (podKeptSince)"),
            Duration::from_secs(30),
            || async move { record(client, ip).await?.status?.pod_kept_since.map(|_| ()) },
        )
        .await;
    }
    ip
}

#[tokio::test]
async fn at_the_cap_holds_of_pods_still_there_go_before_holds_of_pods_that_left() {
    let Scene { client, ns, capo, policy } = scene(
        "rel-fair",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": 2, "releaseInterval": "200ms" }),
    )
    .await;
    let mut gone = Vec::new();
    for i in 0..2 {
        gone.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
        delete_pod(&client, &ns.name, &format!("redis-{i}")).await.expect("deletion allowed");
    }
    for ip in &gone {
        wait_status(&client, *ip).await;
    }
    refuse_evictions(&client, &ns.name).await;
    let kept = [
        refused_eviction(&client, &ns.name, "kept-0", false).await,
        refused_eviction(&client, &ns.name, "kept-1", false).await,
    ];
    // Four holds under maxReserved 2: the two whose Pods still run go, though newer.
    for ip in kept {
        wait_released(&client, ip, Duration::from_secs(30)).await;
    }
    for ip in &gone {
        assert!(record(&client, *ip).await.is_some(), "{ip}: a hold of a Pod that left was released by the cap");
        assert!(entries(&client, &policy).await.contains(&cidr(*ip)), "{ip} still reserved");
    }
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(wait_metric(&capo, &cap, 2.0).await, 2.0);
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    assert!(pods.get("kept-0").await.is_ok() && pods.get("kept-1").await.is_ok(), "the Pods still run");
}

/// Tenants share a policy's cap by default (no `maxReservedPerNamespace`): a namespace
/// that churns gives up its own holds before a quiet namespace loses one, though the quiet
/// namespace's holds are the oldest.
#[tokio::test]
async fn at_the_cap_a_namespace_that_churns_gives_before_a_quiet_one_loses_any() {
    let (client, quiet) = setup("rel-quiet").await;
    let churn = TestNamespace::create(&client, "rel-churn").await;
    let mut settings = capo_settings(&format!("capo-test-{}-a", quiet.name), &[&quiet.name, &churn.name], None);
    settings.release = Some(release_settings(&quiet.name, "a", Duration::from_secs(600)));
    let capo = start_capo_with(&client, &quiet.name, settings).await;
    wait_leader(&capo).await;
    let policy = format!("{}-p", quiet.name);
    let both = json!({ "matchExpressions": [{ "key": "kubernetes.io/metadata.name", "operator": "In", "values": [quiet.name, churn.name] }] });
    apply_policy(
        &client,
        &policy,
        &quiet.name,
        json!({ "namespaceSelector": both, "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": 4, "releaseInterval": "200ms" }),
    )
    .await;
    let mut held = Vec::new();
    for (ns, n) in [(&quiet.name, 2), (&churn.name, 4)] {
        for i in 0..n {
            held.push(held_gone_pod(&client, ns, &format!("redis-{i}")).await);
        }
    }
    let (quiet_ips, churn_ips) = held.split_at(2);
    // Six holds under maxReserved 4, two namespaces: churn holds four, more than its
    // share, and gives its two oldest; quiet keeps both of its older holds.
    for ip in &churn_ips[..2] {
        wait_released(&client, *ip, Duration::from_secs(30)).await;
    }
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(wait_metric(&capo, &cap, 2.0).await, 2.0);
    for ip in quiet_ips.iter().chain(&churn_ips[2..]) {
        assert!(record(&client, *ip).await.is_some(), "{ip} released by the cap");
        assert!(entries(&client, &policy).await.contains(&cidr(*ip)), "{ip} still reserved");
    }
}

#[tokio::test]
async fn a_queued_cap_release_is_decided_afresh_when_its_pod_leaves_before_its_slot() {
    let Scene { client, ns, capo, policy } = scene(
        "rel-stale",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h", "maxReserved": 2, "releaseInterval": "15s" }),
    )
    .await;
    refuse_evictions(&client, &ns.name).await;
    let spent = selected_pod(&client, &ns.name, "redis-spent", false).await;
    delete_pod(&client, &ns.name, "redis-spent").await.unwrap();
    wait_status(&client, spent).await;
    let kept = refused_eviction(&client, &ns.name, "kept-0", true).await;
    // A manual release spends this policy's slot: the next opens 15 s later.
    let (code, _, err) = capo_cli(&["release", &spent.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    // Three holds under maxReserved 2: the refused eviction's is chosen and waits for the slot.
    let mut gone = Vec::new();
    for i in 0..2 {
        gone.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
        delete_pod(&client, &ns.name, &format!("redis-{i}")).await.unwrap();
    }
    wait_event(&client, "default", &policy, "CapReached").await;
    // Before that slot the eviction is retried and allowed: the webhook answers "held",
    // and the Pod leaves. Its hold is now as real as any.
    Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(client.clone(), &ns.name)
        .delete("kept", &DeleteParams::default())
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    eventually("the eviction allowed", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move { pods.evict("kept-0", &EvictParams::default()).await.ok() }
    })
    .await;
    eventually("kept-0 gone", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move { pods.get_opt("kept-0").await.unwrap().is_none().then_some(()) }
    })
    .await;
    // At the slot the cap is decided afresh: the oldest hold of a Pod that left goes, not
    // the one just answered "held".
    wait_released(&client, gone[0], Duration::from_secs(30)).await;
    assert!(record(&client, kept).await.is_some(), "the hold answered \"held\" was released");
    assert!(entries(&client, &policy).await.contains(&cidr(kept)), "{kept} still reserved");
    assert!(record(&client, gone[1]).await.is_some());
    let cap = format!("capo_releases_total{{policy=\"{policy}\",reason=\"cap\"}}");
    assert_eq!(wait_metric(&capo, &cap, 1.0).await, 1.0);
}

#[tokio::test]
async fn workload_or_namespace_deleted_releases_early_only_where_the_policy_says_so() {
    let (client, ns) = setup("rel-early").await;
    let capo = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    wait_leader(&capo).await;
    let early = format!("{}-early", ns.name);
    let keep = format!("{}-keep", ns.name);
    apply_policy(
        &client,
        &early,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "1h",
                "releaseEarly": { "workloadDeleted": true, "namespaceDeleted": true }, "releaseInterval": "100ms" }),
    )
    .await;
    apply_policy(
        &client,
        &keep,
        &ns.name,
        json!({ "podSelector": { "matchLabels": { "app": "kafka" } }, "reserveFor": "1h" }),
    )
    .await;
    // A StatefulSet whose Pod no scheduler places: the test plays its CNI.
    let sts: k8s_openapi::api::apps::v1::StatefulSet = serde_json::from_value(json!({
        "metadata": { "name": "redis" },
        "spec": { "replicas": 1, "serviceName": "redis", "selector": { "matchLabels": { "app": "redis" } },
                  "template": { "metadata": { "labels": { "app": "redis" } },
                                "spec": { "schedulerName": "capo-tests-no-scheduler",
                                          "containers": [{ "name": "c", "image": "registry.invalid/x:1" }] } } },
    }))
    .unwrap();
    Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &sts)
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    eventually("the StatefulSet's Pod", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move { pods.get_opt("redis-0").await.ok()? }
    })
    .await;
    let by_sts = Ips::v4();
    let status = json!({ "status": { "phase": "Running", "podIP": by_sts.to_string(), "podIPs": [{ "ip": by_sts.to_string() }] } });
    pods.patch_status("redis-0", &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
    let kafka = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("kafka-0", &[("app", "kafka")], &[]), &[kafka]).await;
    let loose = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-x", &[("app", "redis")], &[]), &[loose]).await;
    for pod in ["redis-0", "kafka-0", "redis-x"] {
        delete_pod(&client, &ns.name, pod).await.unwrap();
    }
    for ip in [by_sts, kafka, loose] {
        wait_status(&client, ip).await;
    }
    // The StatefulSet goes: its Pod's IP is released early.
    Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), &ns.name)
        .delete("redis", &DeleteParams::default())
        .await
        .unwrap();
    wait_released(&client, by_sts, Duration::from_secs(20)).await;
    // The leader counts a release once its write went through: the record may be gone a
    // moment before the count moves.
    let gone = format!("capo_releases_total{{policy=\"{early}\",reason=\"workload-gone\"}}");
    eventually("the early release counted", Duration::from_secs(10), || async {
        (metric_value(&capo, &gone) == Some(1.0)).then_some(())
    })
    .await;
    assert!(record(&client, loose).await.is_some(), "no workload gone for this one yet");
    // The namespace goes: the early policy releases, the other keeps its hold.
    delete_namespace_and_wait(&client, &ns.name).await;
    wait_released(&client, loose, Duration::from_secs(20)).await;
    eventually("the early release counted", Duration::from_secs(10), || async {
        (metric_value(&capo, &gone) == Some(2.0)).then_some(())
    })
    .await;
    let still = record(&client, kafka).await.expect("the other policy keeps its hold when the namespace goes");
    assert!(still.status.unwrap().release_at.is_some());
    drop(capo);
}

/// `capo explain`, run as the operator would: for live Pods it says what a deletion would
/// do (the policy and the time, the cap's choice, or why not), the webhook then does just
/// that, and for a Pod that is gone it shows the hold and when it is due.
#[tokio::test]
async fn explain_says_what_a_deletion_would_do_and_the_webhook_does_it() {
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "40m", "maxReserved": 1,
        "releaseInterval": "100ms", "priority": 1000 });
    let Scene { client, ns, capo: _capo, policy } = scene("rel-explain", Duration::from_secs(600), spec).await;
    let a = selected_pod(&client, &ns.name, "redis-0", false).await;
    selected_pod(&client, &ns.name, "redis-1", false).await;
    let web = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("web-0", &[("app", "web")], &[]), &[web]).await;
    let explain = |pod: &str| {
        let args = ["explain".to_string(), format!("{}/{pod}", ns.name)];
        async move { capo_cli(&args.iter().map(String::as_str).collect::<Vec<_>>()).await }
    };

    let (code, out, err) = explain("redis-0").await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("Deleted or evicted now: HOLD its addresses by policy {policy}, for 40m")), "{out}");
    assert!(out.contains("cap: 1 of maxReserved 1 with this Pod's: within the bounds"), "{out}");
    assert!(out.contains(&format!("{policy} (priority 1000): namespace covered; selected")), "{out}");
    assert!(out.contains("owner is being deleted: NOT HELD") && out.contains("skip.ownerDeleted"), "{out}");
    // NAME with -n, as kubectl takes it.
    let (code, out, err) = capo_cli(&["explain", "web-0", "-n", &ns.name]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("NOT HELD: no policy selects it (not_selected)"), "{out}");
    assert!(out.contains(&format!("{policy} (priority 1000): namespace covered; not selected")), "{out}");

    // The webhook does what explain said.
    delete_pod(&client, &ns.name, "web-0").await.unwrap();
    assert!(record(&client, web).await.is_none(), "web-0 is not held");
    delete_pod(&client, &ns.name, "redis-0").await.unwrap();
    wait_status(&client, a).await;

    // With redis-0 held, the cap is full: redis-1's hold would push redis-0's out.
    let (_, out, _) = explain("redis-1").await;
    eprintln!("capo explain {}/redis-1:\n{out}", ns.name);
    assert!(out.contains(&format!("2 of maxReserved 1 with this Pod's: over, so the leader releases {a}")), "{out}");
    // redis-0 is gone: its hold, when it is due, and why.
    let (code, out, err) = explain("redis-0").await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("no such Pod") && out.contains("Held now:"), "{out}");
    let held = out.lines().find(|l| l.trim_start().starts_with(&a.to_string())).unwrap_or_else(|| panic!("{out}"));
    assert!(held.contains(&format!("by policy {policy} (Delete at")), "{held}");
    assert!(out.contains("the Pod left at") && out.contains("(in 39m"), "due in about 40m: {out}");
    let (code, out, _) = capo_cli(&["explain", &format!("{}/redis-0", ns.name), "-o", "json"]).await;
    assert_eq!(code, 0);
    let e: Vec<serde_json::Value> = serde_json::from_str(&out).expect("JSON");
    assert_eq!((e[0]["live"].as_bool(), e[0]["holds"][0]["ip"].as_str()), (Some(false), Some(a.to_string().as_str())));
    // The short name is capo's own (`cpol` is Kyverno's ClusterPolicy's).
    let (ok, out) = kubectl(&["get", "capopol", &policy, "-o", "name"], None).await;
    assert!(ok && out.trim() == format!("capopolicy.capo.io/{policy}"), "{out}");
    // A Pod capo never saw: no hold, and where to look.
    let (code, out, _) = explain("nope").await;
    assert_eq!(code, 0);
    assert!(out.contains("No hold for it now") && out.contains("involvedObject.name=nope"), "{out}");
}

/// Runs the `capo` binary's operator subcommand against the test control plane.
/// Async, so the in-process capo keeps running while the command waits for it.
#[tokio::test]
async fn the_operator_cli_lists_releases_and_extends_holds_with_clear_exit_codes() {
    let Scene { client, ns, capo, policy } = scene("rel-cli", Duration::from_secs(600), json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "40m", "maxReserved": 7, "releaseInterval": "100ms" })).await;
    let a = selected_pod(&client, &ns.name, "redis-0", false).await;
    let b = selected_pod(&client, &ns.name, "redis-1", false).await;
    for pod in ["redis-0", "redis-1"] {
        delete_pod(&client, &ns.name, pod).await.unwrap();
    }
    wait_status(&client, a).await;
    wait_status(&client, b).await;

    let (code, out, err) = capo_cli(&["holds"]).await;
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with(&a.to_string())).unwrap_or_else(|| panic!("{a} not listed:\n{out}"));
    assert!(
        line.contains(&format!("{}/redis-0", ns.name)) && line.contains(&policy) && line.contains("Delete"),
        "{line}"
    );
    assert!(line.contains("39m"), "due in about 40m: {line}");
    assert!(out.starts_with("IP "), "a header: {out}");

    let (code, out, _) = capo_cli(&["holds", "-o", "json"]).await;
    assert_eq!(code, 0);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).expect("JSON");
    let row = rows.iter().find(|r| r["ip"] == a.to_string()).expect("listed");
    assert_eq!(row["policy"], policy.as_str());
    assert!(row["dueInSeconds"].as_i64().unwrap() > 2300);

    let (code, out, _) = capo_cli(&["policies"]).await;
    assert_eq!(code, 0);
    let line = out.lines().find(|l| l.starts_with(&policy)).expect("policy listed");
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&cols[1..7], &["Ready", "Compiled", "2", "7", "40m", "global"], "{line}");
    // The pool column: the test's hand-made addresses are in the test environment's
    // disabled pool for them.
    assert_eq!(cols[7], "capo-testenv-handmade-ipv4", "{line}");

    let b_ip = b.to_string();
    let (code, out, err) = capo_cli(&["extend", &b.to_string(), "--for", "2h"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("extended by admin") || out.contains("extended by"), "{out}");
    let rec = record(&client, b).await.unwrap();
    let manual = rec.status.as_ref().and_then(|s| s.manual.clone()).expect("the record's status shows who");
    assert!(rec.spec.manual.is_none(), "the request went through the status subresource");
    assert_eq!(manual.action, capo_api::ManualAction::Extend);
    assert!(!manual.by.is_empty() && manual.by != "unknown", "{manual:?}");
    let due = rec.status.unwrap().release_at.unwrap().0.duration_since(Timestamp::now()).as_secs();
    assert!((7100..=7200).contains(&due), "released in about 2h: {due}s");

    let (code, out, err) = capo_cli(&["release", &a.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("{a} released")), "{out}");
    assert!(record(&client, a).await.is_none());
    assert!(!entries(&client, &policy).await.contains(&cidr(a)));
    assert_eq!(
        metric_value(&capo, &format!("capo_releases_total{{policy=\"{policy}\",reason=\"manual\"}}")),
        Some(1.0)
    );

    let (code, _, err) = capo_cli(&["release", "192.0.2.250"]).await;
    assert_eq!(code, 3, "unknown IP: {err}");
    assert!(err.contains("no hold for 192.0.2.250"), "{err}");
    let (code, _, err) = capo_cli(&["extend", "192.0.2.250", "--for", "1h"]).await;
    assert_eq!(code, 3, "{err}");
    let (code, _, err) = capo_cli(&["extend", &b.to_string(), "--for", "soon"]).await;
    assert_eq!(code, 2, "a bad duration is a usage error: {err}");

    // A user with no rights on capo's objects gets a clear "permission denied", exit 4.
    let mut kc: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&capo_testenv::shared().kubeconfig).unwrap()).unwrap();
    kc["users"][0]["user"]["as"] = "capo-test-nobody".into();
    let nobody = std::env::temp_dir().join(format!("capo-nobody-{}.kubeconfig", ns.name));
    std::fs::write(&nobody, serde_saphyr::to_string(&kc).unwrap()).unwrap();
    for args in [vec!["holds"], vec!["policies"], vec!["release", &b_ip]] {
        let (code, _, err) = capo_cli_as(&nobody, &args).await;
        assert_eq!(code, 4, "{args:?}: {err}");
        assert!(err.contains("permission denied") && err.contains("capo-test-nobody"), "{err}");
    }
    let _ = std::fs::remove_file(&nobody);

    // With no leader, a request is written but not carried out: exit 5, still held. (Before:
    // `extend` returned 0 at once, whatever the leader did.)
    drop(capo);
    let (code, _, err) = capo_cli(&["extend", &b.to_string(), "--for", "3h", "--wait", "2s"]).await;
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("did not act in time"), "{err}");
    let (code, _, err) = capo_cli(&["release", &b.to_string(), "--wait", "2s"]).await;
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("did not act in time"), "{err}");
    assert!(record(&client, b).await.is_some(), "only a leader releases");
}

/// The operator roles as docs/operations.md ships them (config/rbac/operator_role.yaml) run
/// every `capo` command, the way kubectl users type them: `-n` is the Pods' namespace, `-o`
/// takes kubectl's formats, `--kubeconfig` and `--context` pick the cluster, and the binary
/// works as the kubectl plugin `kubectl capo`. The operator needs no write access to a
/// record's spec: `extend` and `release` write the request into its status, with their name.
/// Before: `holds` as the documented operator failed (exit 4, no rights on the countdown
/// ConfigMaps), and `holds -n <pods' namespace>` showed every hold as "pod not gone".
#[tokio::test]
async fn the_documented_operator_role_runs_every_command_the_kubectl_way() {
    let Scene { client, ns, capo: _capo, policy } = scene(
        "rel-operator",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "40m", "releaseInterval": "100ms" }),
    )
    .await;
    let ip = held_gone_pod(&client, &ns.name, "redis-0").await;
    let user = format!("capo-test-operator-{}", ns.name);
    // The tests' leaders keep their countdowns in `default` (capo's namespace here).
    let operator = documented_operator(&user, "default", false).await;
    let (_, can) = kubectl(&["auth", "can-i", "patch", "reservedips.capo.io", "--as", &user], None).await;
    assert!(can.trim().starts_with("no"), "the operator cannot write a record's spec: {can}");
    // The ClusterRole alone: the holds, without their countdowns, and a warning that says why.
    let (code, out, err) = capo_cli_as(&operator, &["holds", "-n", &ns.name]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("cannot list ConfigMaps in namespace default"), "{err}");
    assert!(out.lines().any(|l| l.starts_with(&ip.to_string()) && l.contains("pod not gone")), "{out}");
    // With the Role in capo's namespace: when each is due.
    documented_operator(&user, "default", true).await;
    let line = eventually("the operator reads the countdowns", Duration::from_secs(10), || async {
        let (code, out, err) = capo_cli_as(&operator, &["holds", "-n", &ns.name]).await;
        assert_eq!(code, 0, "{out}{err}");
        out.lines().find(|l| l.starts_with(&ip.to_string()) && l.contains("39m")).map(str::to_string)
    })
    .await;
    assert!(line.contains(&format!("{}/redis-0", ns.name)) && line.contains(&policy), "{line}");
    let (code, out, _) = capo_cli_as(&operator, &["holds", "-n", "capo-test-nowhere"]).await;
    assert_eq!((code, out.as_str()), (0, "No IPs held for Pods in namespace capo-test-nowhere.\n"));
    let (code, _, err) = capo_cli_as(&operator, &["holds", "-n", &ns.name, "-A"]).await;
    assert_eq!(code, 2, "-n and -A together are a usage error: {err}");
    let record_name = capo_api::reserved_ip::record_name(ip);
    let (code, out, _) = capo_cli_as(&operator, &["holds", "-n", &ns.name, "-o", "name"]).await;
    assert_eq!((code, out), (0, format!("reservedip.capo.io/{record_name}\n")));
    let (code, out, _) = capo_cli_as(&operator, &["holds", "-A", "-o", "yaml"]).await;
    assert_eq!(code, 0);
    let rows: Vec<serde_json::Value> = serde_saphyr::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let row = rows.iter().find(|r| r["ip"] == ip.to_string()).unwrap_or_else(|| panic!("{ip} in {out}"));
    assert_eq!((row["policy"].as_str(), row["namespace"].as_str()), (Some(policy.as_str()), Some(ns.name.as_str())));
    let (code, out, _) = capo_cli_as(&operator, &["holds", "-n", &ns.name, "-o", "wide"]).await;
    assert_eq!(code, 0);
    assert!(out.starts_with("IP ") && out.contains("RELEASE AT") && out.contains(&record_name), "{out}");
    let (code, out, err) = capo_cli_as(&operator, &["policies", "-o", "name"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().any(|l| l == format!("capopolicy.capo.io/{policy}")), "{out}");
    // Tenants find their holds by label, with kubectl alone.
    let (ok, out) = kubectl(
        &["get", "reservedips", "-l", &format!("capo.io/namespace={}", ns.name), "-o", "name", "--as", &user],
        None,
    )
    .await;
    assert!(ok && out.trim() == format!("reservedip.capo.io/{record_name}"), "{out}");

    // The kubectl plugin, the cluster named by --kubeconfig (no KUBECONFIG) and --context.
    let plugins = std::env::temp_dir().join(format!("capo-plugins-{}", ns.name));
    std::fs::create_dir_all(&plugins).unwrap();
    let _ = std::fs::remove_file(plugins.join("kubectl-capo"));
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_capo"), plugins.join("kubectl-capo")).unwrap();
    let path = format!("{}:{}", plugins.display(), std::env::var("PATH").unwrap_or_default());
    let plugin = |args: Vec<String>| {
        let path = path.clone();
        async move {
            let out = tokio::process::Command::new("kubectl")
                .arg("capo")
                .args(&args)
                .env("PATH", path)
                .env_remove("KUBECONFIG")
                .env("HOME", std::env::temp_dir())
                .env("POD_NAMESPACE", "default")
                .output()
                .await
                .expect("kubectl capo");
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
        }
    };
    let kubeconfig = operator.display().to_string();
    let (code, out, err) =
        plugin(vec!["holds".into(), "-n".into(), ns.name.clone(), "--kubeconfig".into(), kubeconfig.clone()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().any(|l| l.starts_with(&ip.to_string()) && l.contains("39m")), "{out}");
    let (code, out, _) = plugin(vec!["--help".into()]).await;
    assert_eq!(code, 0);
    assert!(out.contains("Usage: kubectl capo"), "help names the plugin: {out}");
    let (code, _, err) =
        plugin(vec!["holds".into(), "--kubeconfig".into(), kubeconfig.clone(), "--context".into(), "nope".into()])
            .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("context nope"), "{err}");
    let (code, _, err) = plugin(vec!["holds".into()]).await;
    assert_eq!(code, 1, "no kubeconfig at all: {err}");

    // extend waits until the leader took the new time into its plan; release until it is done.
    let (code, out, err) = capo_cli_as(&operator, &["extend", &ip.to_string(), "--for", "2h"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let rec = record(&client, ip).await.unwrap();
    let manual = rec.status.as_ref().and_then(|s| s.manual.clone()).expect("the request, in the status");
    assert_eq!((manual.action, manual.by.as_str()), (capo_api::ManualAction::Extend, user.as_str()));
    assert!(manual.taken_at.is_some(), "extend returned once the leader took it: {manual:?}");
    let due = rec.status.unwrap().release_at.unwrap().0.duration_since(Timestamp::now()).as_secs();
    assert!((7100..=7200).contains(&due), "released in about 2h: {due}s");
    let (code, out, err) = capo_cli_as(&operator, &["release", &ip.to_string()]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(record(&client, ip).await.is_none(), "released");
    assert!(!entries(&client, &policy).await.contains(&cidr(ip)));
    let _ = std::fs::remove_file(&operator);
    let _ = std::fs::remove_dir_all(&plugins);
    let binding = format!("capo-operator-{user}");
    let _ = kubectl(&["delete", "clusterrolebinding", &binding], None).await;
    let _ = kubectl(&["-n", "default", "delete", "rolebinding", &binding], None).await;
}

/// A bare `capo` prints its help and starts nothing (a controller runs as `capo run`);
/// controller flags without a subcommand, as manifests before `run` wrote them, still run it.
#[tokio::test]
async fn a_bare_capo_prints_help_and_starts_no_controller() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
        .env("KUBECONFIG", "/nonexistent")
        .output()
        .await
        .expect("run capo");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "usage: {err}");
    assert!(err.contains("Usage: capo") && err.contains("run ") && err.contains("holds"), "{err}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo")).arg("--version").output().await.unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("capo "));
    // The old form: flags alone are `capo run`; a bad one is refused as `run` refuses it.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
        .args(["--lease-duration", "5s", "--lease-renew-grace", "5s"])
        .env("KUBECONFIG", "/nonexistent")
        .output()
        .await
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() && said.contains("--lease-duration must be longer"), "{said}");
    // --log-level: a bad one is refused at start, and the level given is the one used.
    let run = |level: &'static str| async move {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
            .args(["run", "--log-level", level, "--lease-duration", "5s", "--lease-renew-grace", "5s"])
            .env("KUBECONFIG", "/nonexistent")
            .env_remove("RUST_LOG")
            .env("NO_COLOR", "1")
            .output()
            .await
            .unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (ok, said) = run("loud!").await;
    assert!(!ok && said.contains("--log-level \"loud!\": \"loud!\" is not a level"), "{said}");
    let (ok, said) = run("error").await;
    assert!(!ok && said.contains("capo stopped"), "an error is logged at error: {said}");
    let (ok, said) = run("off").await;
    assert!(!ok && said.trim().is_empty(), "nothing is logged with the level off: {said}");
}

/// `capo migrate` turns the original capo's default configuration into CapoPolicies that
/// the API server (with capo's CRD schema and CEL rules) accepts.
#[tokio::test]
async fn migrate_prints_policies_the_api_server_accepts() {
    let (_client, ns) = setup("rel-migrate").await;
    let config = std::env::temp_dir().join(format!("capo_config-{}.yaml", ns.name));
    std::fs::write(
        &config,
        "apiVersion: config.capo.io/v1\nkind: CapoConfig\nipReserveMaxCount: 300\nipReserveTime: 40m\nipReleasePeriod: 5s\n\
         labelSelector:\n  matchExpressions:\n  - {key: statefulset.kubernetes.io/pod-name, operator: Exists}\n  - {key: brokerId, operator: Exists}\n",
    )
    .unwrap();
    let (code, out, err) = capo_cli(&["migrate", "-f", config.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("kind: CapoPolicy").count(), 2, "{out}");
    let (ok, said) = kubectl(&["apply", "--dry-run=server", "-f", "-"], Some(&out)).await;
    assert!(ok, "{said}");
    assert_eq!(said.matches("created (server dry run)").count(), 2, "{said}");
    let (code, _, err) = capo_cli(&["migrate", "-f", "/nonexistent/capo_config.yaml"]).await;
    assert_eq!(code, 1, "{err}");
    let _ = std::fs::remove_file(&config);
}

/// Issue 24, defect 1: one Pod whose mark cannot be written must not stall its policy. A
/// ValidatingAdmissionPolicy refuses every UPDATE of Pods labelled `freeze=true` (as
/// Gatekeeper, Kyverno or a Pod webhook that is down would refuse capo's patch). A frozen
/// Pod that failed (held by the safety net, counted down from its terminal phase) is due
/// first; five Pods deleted right after, with 2 s holds, are released within 5 s all the
/// same, and the frozen one stays held (its release deferred, said on the Pod).
#[tokio::test]
async fn a_pod_that_cannot_be_marked_does_not_stall_its_policys_releases() {
    let Scene { client, ns, capo, policy } = scene(
        "rel-frozen",
        Duration::from_secs(600),
        json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "2s", "releaseInterval": "100ms" }),
    )
    .await;
    let vap = format!("freeze-{}", ns.name);
    deny_by_policy(
        &client,
        &vap,
        json!({
            "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": ns.name } },
            "resourceRules": [{ "apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"] }],
        }),
        json!({
            "expression": "!(has(object.metadata.labels) && 'freeze' in object.metadata.labels)",
            "message": "frozen Pods are not changed", "reason": "Forbidden",
        }),
    )
    .await;
    let frozen_ip = Ips::v4();
    let frozen = unscheduled_pod("frozen", &[("app", "redis"), ("freeze", "true")], &[]);
    create_pod_with_ips(&client, &ns.name, frozen, &[frozen_ip]).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    // The policy reaches the admission chain asynchronously: wait until it refuses.
    eventually("the policy to refuse a change of the frozen Pod", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move {
            let r = pods
                .patch(
                    "frozen",
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "metadata": { "annotations": { "probe": "1" } } })),
                )
                .await;
            matches!(r, Err(kube::Error::Api(s)) if s.message.contains("frozen Pods are not changed")).then_some(())
        }
    })
    .await;
    set_phase(&client, &ns.name, "frozen", "Failed").await;
    let c = &client;
    let rec = eventually("the safety net to hold the frozen Pod", Duration::from_secs(20), || async move {
        record(c, frozen_ip).await
    })
    .await;
    assert_eq!(rec.spec.trigger, HoldTrigger::SafetyNet);
    wait_status(&client, frozen_ip).await;

    let mut ips = Vec::new();
    for i in 0..5 {
        ips.push(selected_pod(&client, &ns.name, &format!("redis-{i}"), false).await);
    }
    let deleted = Instant::now();
    for i in 0..5 {
        delete_pod(&client, &ns.name, &format!("redis-{i}")).await.expect("held and allowed");
    }
    for &ip in &ips {
        let left = Duration::from_secs(5).saturating_sub(deleted.elapsed());
        wait_released(&client, ip, left.max(Duration::from_millis(100))).await;
    }
    eprintln!("five released {:.2}s after their deletions", deleted.elapsed().as_secs_f64());
    assert!(record(&client, frozen_ip).await.is_some(), "the frozen Pod's hold stays");
    assert!(entries(&client, &policy).await.contains(&cidr(frozen_ip)));
    let note = wait_event(&client, &ns.name, "frozen", "ReleaseDeferred").await;
    assert!(note.contains("frozen Pods are not changed"), "{note}");
    let ttl = format!("capo_releases_total{{policy=\"{policy}\",reason=\"ttl\"}}");
    assert_eq!(wait_metric(&capo, &ttl, 5.0).await, 5.0);
    assert!(
        metric_value(&capo, &format!("capo_release_failures_total{{policy=\"{policy}\",reason=\"mark\"}}"))
            >= Some(1.0)
    );

    // The frozen Pod goes: its hold is released then, on the next look.
    remove_policy(&client, &vap).await;
    pods.delete("frozen", &Default::default()).await.unwrap();
    wait_released(&client, frozen_ip, Duration::from_secs(30)).await;
}

/// The safety net's own loop: a hold it cannot write (here a ValidatingAdmissionPolicy
/// refuses the record of one address, as a cluster's admission rules could) is said on the
/// policy (`SafetyNetHoldFailed`, quoting the refusal), counted, and tried again with
/// backoff; the address stays in the reservation all the while (the entry got in), and has
/// its record once the refusal goes (the safety net's retry or the repair's adoption,
/// whichever comes first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_safety_net_hold_that_cannot_be_written_says_so_and_is_tried_again() {
    let Scene { client, ns, capo, policy } =
        scene("rel-netfail", Duration::from_secs(600), json!({ "podSelector": { "matchLabels": { "app": "redis" } } }))
            .await;
    let ip = Ips::v4();
    let vap = format!("no-hold-{}", ns.name);
    deny_by_policy(
        &client,
        &vap,
        json!({ "resourceRules": [{ "apiGroups": ["capo.io"], "apiVersions": ["*"], "operations": ["CREATE"], "resources": ["reservedips"] }] }),
        json!({ "expression": format!("object.spec.ip != '{ip}'"), "message": "this address is not held", "reason": "Forbidden" }),
    )
    .await;
    // The policy reaches the admission chain asynchronously: wait until it refuses.
    let probe: capo_api::ReservedIP = serde_json::from_value(json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
        "metadata": { "name": capo_api::reserved_ip::record_name(ip) },
        "spec": { "ip": ip.to_string(), "cidr": cidr(ip), "reservation": format!("capo-{policy}"),
                  "calicoApiGroup": "crd.projectcalico.org/v1", "policy": policy,
                  "pod": { "namespace": ns.name, "name": "probe", "uid": "probe" },
                  "trigger": "Delete", "reservedAt": Timestamp::now(), "reserveFor": "1h" },
    }))
    .unwrap();
    let records = Api::<capo_api::ReservedIP>::all(client.clone());
    let dry = PostParams { dry_run: true, ..Default::default() };
    eventually("the policy to refuse the record", Duration::from_secs(30), || {
        let (records, probe, dry) = (records.clone(), probe.clone(), dry.clone());
        async move {
            let r = records.create(&dry, &probe).await;
            matches!(r, Err(kube::Error::Api(s)) if s.message.contains("this address is not held")).then_some(())
        }
    })
    .await;

    create_pod_with_ips(&client, &ns.name, unscheduled_pod("redis-0", &[("app", "redis")], &[]), &[ip]).await;
    set_phase(&client, &ns.name, "redis-0", "Failed").await;
    let note = wait_event(&client, "default", &policy, "SafetyNetHoldFailed").await;
    assert!(note.contains("this address is not held") && note.contains("redis-0"), "{note}");
    // Tried again (with backoff), and refused again.
    let failures = format!("capo_release_failures_total{{policy=\"{policy}\",reason=\"safety_net\"}}");
    assert!(wait_metric(&capo, &failures, 2.0).await >= 2.0);
    assert!(record(&client, ip).await.is_none(), "refused, so no record yet");
    assert!(entries(&client, &policy).await.contains(&cidr(ip)), "the entry got in: the address is held meanwhile");

    remove_policy(&client, &vap).await;
    let c = &client;
    let rec =
        eventually("a record once the refusal is gone", Duration::from_secs(60), || async move { record(c, ip).await })
            .await;
    assert!(matches!(rec.spec.trigger, HoldTrigger::SafetyNet | HoldTrigger::Adopted), "{:?}", rec.spec.trigger);
    assert!(entries(&client, &policy).await.contains(&cidr(ip)), "still held");
}

//! Calico's datastore migration (v1 behind calico-apiserver → native `projectcalico.org/v3`
//! CRDs) run under a holding capo, step by step as Calico's `DatastoreMigration` controller
//! runs it (`../shared/notes/calico-migration.md`): lock v1, remove calico-apiserver's
//! APIService, copy the IPReservations to Calico's own v3 CRDs (`../shared/calico/`),
//! unlock v3. This binary changes its control plane for good, so it has one of its own.

mod support;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capo_api::CalicoApiGroup;
use capo_testenv::Calico;
use kube::api::{Api, DynamicObject, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::calico::{calico_crd, resource, set_datastore_ready};
use support::leading::*;
use support::*;

const V1: CalicoApiGroup = CalicoApiGroup::CrdV1;
const V3: CalicoApiGroup = CalicoApiGroup::V3;

/// Calico 3.32.1's native v3 CRDs that capo reads and calico-apiserver serves too (the
/// migration installs them all); `ipamblocks`, which calico-apiserver does not serve, is
/// installed once its APIService is gone (a watch of it would wait for it in vain before).
const NATIVE: [&str; 3] = [
    "projectcalico.org_ipreservations.yaml",
    "projectcalico.org_clusterinformations.yaml",
    "projectcalico.org_ippools.yaml",
];

fn gauge(capo: &capo::App, name: &str) -> Option<f64> {
    metric_value(capo, name)
}

async fn wait_gauge(capo: &capo::App, name: &str, want: f64, limit: Duration) -> Duration {
    let started = Instant::now();
    eventually(&format!("{name} = {want}"), limit, || async { (gauge(capo, name) == Some(want)).then_some(()) }).await;
    started.elapsed()
}

async fn calico_pod(client: &Client, ns: &str, name: &str) -> IpAddr {
    let pod = unscheduled_pod(name, &[("app", "redis")], &[]);
    let pod = create_pod_with_calico_ips(client, ns, pod, IpFamilies::V4).await;
    pod.status.unwrap().pod_ip.unwrap().parse().unwrap()
}

/// Calico's copy step for one kind: every v1 object to a v3 object of the same name,
/// labels, annotations and spec (no resourceVersion, a new uid).
async fn copy_kind(client: &Client, kind: &str, plural: &str) -> usize {
    let v1 = Api::<DynamicObject>::all_with(client.clone(), &resource(V1, kind, plural));
    let v3 = Api::<DynamicObject>::all_with(client.clone(), &resource(V3, kind, plural));
    let mut copied = 0;
    for obj in v1.list(&Default::default()).await.unwrap_or_else(|e| panic!("list v1 {plural}: {e}")).items {
        let mut copy = DynamicObject::new(&obj.name_any(), &resource(V3, kind, plural));
        copy.metadata.labels = obj.metadata.labels.clone();
        copy.metadata.annotations = obj.metadata.annotations.clone();
        let mut spec = obj.data["spec"].clone();
        // Go's empty slices are null in v1's JSON; the v3 CRDs take them as lists.
        if let Some(spec) = spec.as_object_mut() {
            for list in ["allocations", "attributes", "unallocated"] {
                if spec.get(list).is_some_and(|v| v.is_null()) {
                    spec.insert(list.into(), json!([]));
                }
            }
            spec.retain(|_, v| !v.is_null());
        }
        copy.data = json!({ "spec": spec });
        v3.create(&PostParams::default(), &copy)
            .await
            .unwrap_or_else(|e| panic!("copy {kind} {} to v3: {e}", obj.name_any()));
        copied += 1;
    }
    copied
}

/// Calico's copy step for what capo reads: IP pools, IPAM blocks, IPReservations (the
/// number of IPReservations copied).
async fn copy_reservations(client: &Client) -> usize {
    copy_kind(client, "IPPool", "ippools").await;
    copy_kind(client, "IPAMBlock", "ipamblocks").await;
    copy_kind(client, "IPReservation", "ipreservations").await
}

fn apiservice() -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "apiregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "apiregistration.k8s.io/v1".into(),
        kind: "APIService".into(),
        plural: "apiservices".into(),
    }
}

fn apiservices(client: &Client) -> Api<DynamicObject> {
    Api::<DynamicObject>::all_with(client.clone(), &apiservice())
}

/// Step 3: calico-apiserver's APIService goes (kept, to be put back by a cancel); returns
/// once v3 is served by the native CRDs.
async fn unregister_calico_apiserver(client: &Client, shard: &str) -> DynamicObject {
    let saved = apiservices(client).get("v3.projectcalico.org").await.expect("calico-apiserver's APIService");
    apiservices(client).delete("v3.projectcalico.org", &Default::default()).await.expect("remove the APIService");
    eventually("v3 served by the native CRDs", Duration::from_secs(30), || async {
        let v3 = Api::<DynamicObject>::all_with(client.clone(), &V3.ip_reservation());
        v3.get_opt(shard).await.ok()?.is_none().then_some(())
    })
    .await;
    saved
}

/// A cancel before Converged: the APIService is put back (v3 is calico-apiserver's view
/// of v1 again); returns once v3 shows v1's shard `shard` again.
async fn register_calico_apiserver(client: &Client, saved: &DynamicObject, shard: &str) {
    // The API server registered a local APIService of that name for the native CRDs
    // (automanaged): it is replaced by calico-apiserver's.
    let api = apiservices(client);
    match api.get_opt(&saved.name_any()).await.expect("read the APIService") {
        Some(mut local) => {
            local.metadata.labels = saved.metadata.labels.clone();
            local.metadata.annotations = saved.metadata.annotations.clone();
            local.data["spec"] = saved.data["spec"].clone();
            api.replace(&saved.name_any(), &PostParams::default(), &local).await.expect("put the APIService back");
        }
        None => {
            let mut again = DynamicObject::new(&saved.name_any(), &apiservice());
            again.metadata.labels = saved.metadata.labels.clone();
            again.data = json!({ "spec": saved.data["spec"].clone() });
            api.create(&PostParams::default(), &again).await.expect("put the APIService back");
        }
    }
    eventually("v3 served by calico-apiserver again", Duration::from_secs(60), || async {
        let v3 = Api::<DynamicObject>::all_with(client.clone(), &V3.ip_reservation());
        v3.get_opt(shard).await.ok()?.is_some().then_some(())
    })
    .await;
}

/// Every entry of `policy`'s reservations in `group`, or `None` when listing fails.
async fn entries_or_none(client: &Client, group: CalicoApiGroup, policy: &str) -> Option<Vec<String>> {
    let api = Api::<DynamicObject>::all_with(client.clone(), &group.ip_reservation());
    let lp = kube::api::ListParams::default().labels(&format!("capo.io/policy={policy}"));
    let list = api.list(&lp).await.ok()?;
    Some(
        list.items
            .iter()
            .flat_map(|o| o.data["spec"]["reservedCIDRs"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_str().map(String::from))
            .collect(),
    )
}

/// Each held address, and when it first left both groups.
type Departures = Vec<(IpAddr, Option<Instant>)>;

fn holds_in(capo: &capo::App) -> CalicoApiGroup {
    capo.writing.get()
}

/// A migration cancelled, then one run to its end, under one capo that is never
/// restarted. The cancelled one (v1 locked, the APIService gone, then put back and v1
/// unlocked) moves nothing: capo holds in v1 throughout. The real one: capo sees the lock
/// and holds in v1 through it (the migration copies those holds); a hold made after the
/// copy is in v1 only; when v3 is unlocked capo moves new holds to v3 and re-asserts that
/// late hold there. At every deletion the address is held in the group Calico reads at
/// that moment; every hold leaves v3 (and v1) no earlier than its due time, and nothing
/// is left behind. A capo started afterwards holds in v3 from its start.
#[tokio::test]
async fn a_datastore_migration_cancelled_then_run_moves_a_running_capo_to_v3_with_no_hold_lost_or_early() {
    let client = capo_testenv::shared_with(Calico::ApiServer).client().await;
    install_capo_crds(&client).await;
    install_crd(&client, calico_crd("v3.32.1", "crd.projectcalico.org_clusterinformations.yaml")).await;
    set_datastore_ready(&client, V1, true).await;
    let ns = TestNamespace::create(&client, "mig").await;
    let reserve = Duration::from_secs(20);
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "20s", "releaseInterval": "100ms" });
    let a = start_leading(&client, &ns.name, "a", Duration::from_secs(600)).await;
    let Scene { client, ns, capo: a, policy } = scene_with(client, ns, a, spec).await;
    assert_eq!(a.calico_api, V1, "before: calico-apiserver's v3 is a view of v1");
    assert_eq!(gauge(&a, "capo_calico_api_moved"), Some(0.0));
    let shard = format!("capo-{policy}");
    let mut due: Vec<(&str, IpAddr, Instant)> = Vec::new();
    // Watches both groups every 200 ms throughout: when each held address first left both.
    let watched: Arc<Mutex<Departures>> = Arc::default();
    let monitor = {
        let (client, policy, watched) = (client.clone(), policy.clone(), watched.clone());
        tokio::spawn(async move {
            loop {
                // Only addresses pushed before this round's lists: one pushed while they ran
                // may be missing from a list taken before its hold was written.
                let known = watched.lock().unwrap().len();
                // A round whose lists fail (a CRD's storage reinitializing) is skipped.
                let (Some(mut now), Some(v3)) =
                    (entries_or_none(&client, V1, &policy).await, entries_or_none(&client, V3, &policy).await)
                else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                now.extend(v3);
                for (ip, left) in watched.lock().unwrap().iter_mut().take(known) {
                    if left.is_none() && !now.contains(&cidr(*ip)) {
                        *left = Some(Instant::now());
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // Deletes Pod `name` and checks its address is held where Calico reads then.
    let delete_held = async |name: &'static str, reads: CalicoApiGroup, due: &mut Vec<(&str, IpAddr, Instant)>| {
        let ip = calico_pod(&client, &ns.name, name).await;
        delete_pod(&client, &ns.name, name).await.unwrap_or_else(|e| panic!("{name}: deletion refused: {e}"));
        due.push((name, ip, Instant::now()));
        watched.lock().unwrap().push((ip, None));
        let there = policy_entries(&client, reads, &policy).await;
        assert!(there.contains(&cidr(ip)), "{name}: {ip} held in {reads}, which Calico reads: {there:?}");
        ip
    };

    // Before: a hold in v1.
    delete_held("redis-before", V1, &mut due).await;

    // A cancelled migration: lock v1, the APIService goes, then comes back, unlock v1.
    set_datastore_ready(&client, V1, false).await;
    wait_gauge(&a, "capo_calico_datastore_locked", 1.0, Duration::from_secs(15)).await;
    for file in NATIVE {
        install_crd(&client, calico_crd("projectcalico.org-v3", file)).await;
    }
    let saved = unregister_calico_apiserver(&client, &shard).await;
    install_crd(&client, calico_crd("projectcalico.org-v3", "projectcalico.org_ipamblocks.yaml")).await;
    delete_held("redis-cancelled", V1, &mut due).await;
    register_calico_apiserver(&client, &saved, &shard).await;
    set_datastore_ready(&client, V1, true).await;
    wait_gauge(&a, "capo_calico_datastore_locked", 0.0, Duration::from_secs(15)).await;
    assert_eq!(holds_in(&a), V1, "a cancelled migration moves nothing");
    delete_held("redis-after-cancel", V1, &mut due).await;

    // 1. Lock v1: capo sees it and keeps holding in v1 (the copy takes it along).
    let migration = Instant::now();
    set_datastore_ready(&client, V1, false).await;
    let seen = wait_gauge(&a, "capo_calico_datastore_locked", 1.0, Duration::from_secs(15)).await;
    eprintln!("lock seen after {seen:?}");
    delete_held("redis-during", V1, &mut due).await;
    // 3. calico-apiserver's APIService goes: v3 is native; still v1 while locked.
    unregister_calico_apiserver(&client, &shard).await;
    delete_held("redis-unregistered", V1, &mut due).await;
    // 5–6. Lock v3, copy.
    set_datastore_ready(&client, V3, false).await;
    let copied = copy_reservations(&client).await;
    // A hold after the copy: in v1 only, which Calico will not read again.
    let late = delete_held("redis-late", V1, &mut due).await;
    assert!(!policy_entries(&client, V3, &policy).await.contains(&cidr(late)), "not copied: written after the copy");
    assert_eq!(holds_in(&a), V1, "during the lock capo holds in v1");
    // 7. Unlock v3 (Converged): v1 stays locked for good.
    set_datastore_ready(&client, V3, true).await;
    let converged = Instant::now();
    eprintln!("migration: {copied} reservations copied, converged {:?} after the lock", migration.elapsed());

    // The running capo moves new holds to v3, and re-asserts the late hold there.
    eventually("capo holds in v3", Duration::from_secs(15), || async { (holds_in(&a) == V3).then_some(()) }).await;
    let switched = converged.elapsed();
    eventually("the late hold re-asserted in v3", Duration::from_secs(15), || async {
        policy_entries(&client, V3, &policy).await.contains(&cidr(late)).then_some(())
    })
    .await;
    let reasserted = converged.elapsed();
    assert_eq!(gauge(&a, "capo_calico_api_moved"), Some(0.0), "capo holds where Calico reads");
    assert_eq!(gauge(&a, "capo_calico_datastore_locked"), Some(0.0), "v3 is not locked");
    assert!(metric_value(&a, "capo_repairs_total{action=\"reasserted\"}").unwrap_or(0.0) >= 1.0);
    // The pool guard (and the webhook's pools) follow too: a pool only in v3 is seen.
    let pools = Api::<DynamicObject>::all_with(client.clone(), &resource(V3, "IPPool", "ippools"));
    let mut only_v3 = DynamicObject::new(&format!("{policy}-v3-only"), &resource(V3, "IPPool", "ippools"));
    only_v3.data = json!({ "spec": { "cidr": "192.0.2.0/28", "disabled": true } });
    pools.create(&PostParams::default(), &only_v3).await.expect("create a pool in v3 only");
    let only_v3 = format!("capo_pool_addresses{{pool=\"{policy}-v3-only\"}}");
    eventually("the pool guard to see the v3-only pool", Duration::from_secs(15), || async {
        (gauge(&a, &only_v3) == Some(16.0)).then_some(())
    })
    .await;
    pools.delete(&format!("{policy}-v3-only"), &Default::default()).await.expect("delete the v3-only pool");
    let after = delete_held("redis-after", V3, &mut due).await;
    assert!(!policy_entries(&client, V1, &policy).await.contains(&cidr(after)), "and not in the locked v1");
    eprintln!(
        "after convergence: new holds to v3 at {switched:?}, the late hold re-asserted at {reasserted:?}, first v3 hold {:?}",
        converged.elapsed()
    );
    // Every hold leaves both groups, none before its due time.
    let limit = Instant::now() + reserve * 2 + Duration::from_secs(30);
    eventually("every hold gone from both groups", limit - Instant::now(), || async {
        watched.lock().unwrap().iter().all(|(_, left)| left.is_some()).then_some(())
    })
    .await;
    monitor.abort();
    let left: Vec<(&str, Duration)> = {
        let watched = watched.lock().unwrap();
        due.iter()
            .zip(watched.iter())
            .map(|((name, _, deleted), (_, left))| (*name, left.unwrap() - *deleted))
            .collect()
    };
    eprintln!("left both groups after their deletion: {left:?}");
    for (name, after) in &left {
        assert!(*after >= reserve, "{name} left {after:?} after its deletion, before reserveFor");
    }

    // A capo started now holds in v3 from its start.
    a.shutdown().await;
    let b = start_leading(&client, &ns.name, "b", Duration::from_secs(600)).await;
    wait_leader(&b).await;
    assert_eq!(b.calico_api, V3, "after the migration Calico reads v3");
    assert_eq!(gauge(&b, "capo_calico_api_moved"), Some(0.0));
}

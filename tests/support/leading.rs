//! capo with its leader's work on: short Lease timings, only the test's own policies, and
//! the waits that release tests share.

use std::net::IpAddr;
use std::time::Duration;

use capo::app::{ReleaseSettings, Settings};
use capo::leader::LeaderSettings;
use capo::release::{EngineSettings, PlanSettings};
use capo_api::{CalicoApiGroup, ReservedIP};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use super::*;

pub const V1: CalicoApiGroup = CalicoApiGroup::CrdV1;

/// Leader settings for a test: its own Lease (in `default`: some tests delete their
/// namespace), short timings, and only its own policies (`<namespace>-…`).
pub fn release_settings(ns: &str, identity: &str, kept_grace: Duration) -> ReleaseSettings {
    ReleaseSettings {
        election: Some(LeaderSettings {
            lease_name: format!("capo-{ns}"),
            namespace: "default".into(),
            identity: identity.into(),
            duration: Duration::from_secs(3),
            grace: Duration::from_secs(1),
        }),
        engine: EngineSettings {
            plan: PlanSettings { kept_pod_grace: kept_grace, settle: Duration::from_secs(1), ..Default::default() },
            policy_prefix: Some(format!("{ns}-")),
            excluded_namespaces: vec!["kube-system".into()],
            ..Default::default()
        },
        identity: identity.into(),
    }
}

/// Settings of a capo that serves the webhook for `ns` and competes for the leadership.
pub fn leading_settings(ns: &str, identity: &str, kept_grace: Duration) -> Settings {
    let mut settings: Settings = capo_settings(&format!("capo-test-{ns}-{identity}"), &[ns], None);
    settings.release = Some(release_settings(ns, identity, kept_grace));
    settings
}

/// A capo that serves the webhook for `ns` and competes for the leadership.
pub async fn start_leading(client: &Client, ns: &str, identity: &str, kept_grace: Duration) -> capo::App {
    start_capo_with(client, ns, leading_settings(ns, identity, kept_grace)).await
}

pub async fn wait_leader(app: &capo::App) {
    let fence = app.fence.clone().expect("release on");
    eventually("this capo to lead", Duration::from_secs(30), || {
        let f = fence.clone();
        async move { f.is_leader().then_some(()) }
    })
    .await;
}

/// A test's namespace, its leading capo, and its policy `<namespace>-p` (Ready).
pub struct Scene {
    pub client: Client,
    pub ns: TestNamespace,
    pub capo: capo::App,
    pub policy: String,
}

pub async fn scene(prefix: &str, kept_grace: Duration, spec: serde_json::Value) -> Scene {
    let (client, ns) = setup(prefix).await;
    let capo = start_leading(&client, &ns.name, "a", kept_grace).await;
    scene_with(client, ns, capo, spec).await
}

/// A [`Scene`] around a capo started by the test (its own settings or client): once it
/// leads, with the policy `<namespace>-p` applied and Ready.
pub async fn scene_with(client: Client, ns: TestNamespace, capo: capo::App, spec: serde_json::Value) -> Scene {
    wait_leader(&capo).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, spec).await;
    Scene { client, ns, capo, policy }
}

/// An unscheduled Pod labelled `app=redis` with a fresh IPv4 address (a finalizer keeps it
/// once deleted, if asked).
pub async fn selected_pod(client: &Client, ns: &str, name: &str, finalizer: bool) -> IpAddr {
    let ip = Ips::v4();
    let mut pod = unscheduled_pod(name, &[("app", "redis")], &[]);
    if finalizer {
        keep_while_deleted(client, &mut pod).await;
    }
    create_pod_with_ips(client, ns, pod, &[ip]).await;
    ip
}

/// A selected Pod (`app=redis`) deleted and held: its address, once its countdown is
/// written.
pub async fn held_gone_pod(client: &Client, ns: &str, name: &str) -> IpAddr {
    let ip = selected_pod(client, ns, name, false).await;
    delete_pod(client, ns, name).await.expect("held and allowed");
    wait_status(client, ip).await;
    ip
}

/// A Node no kubelet or kwok runs (so nothing changes its Pods), created once: Pods bound
/// to it are neither unscheduled nor orphaned for the Pod garbage collector. The node
/// lifecycle controller only taints it unreachable after 40 s, and its Pods tolerate that
/// for five minutes.
pub async fn quiet_node(client: &Client) -> String {
    use k8s_openapi::api::core::v1::Node;
    const NAME: &str = "capo-test-quiet";
    let nodes = Api::<Node>::all(client.clone());
    let node: Node = serde_json::from_value(json!({ "metadata": { "name": NAME } })).unwrap();
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create Node {NAME}: {e}"),
    }
    NAME.to_string()
}

/// Makes `pod` stay, being deleted, until [`let_go`]: a finalizer, and a node. (A Pod
/// being deleted that no node has is marked Failed and force-deleted by the Pod garbage
/// collector within 20 s; one on a node waits for its kubelet, as on a real cluster.)
pub async fn keep_while_deleted(client: &Client, pod: &mut Pod) {
    pod.metadata.finalizers = Some(vec!["capo.test/keep".into()]);
    pod.spec.as_mut().expect("spec").node_name = Some(quiet_node(client).await);
}

/// Ends the deletion of a Pod made by [`keep_while_deleted`]: its finalizer goes, and the
/// Pod is deleted with grace 0, as its kubelet does once its containers have stopped.
pub async fn let_go(client: &Client, ns: &str, name: &str) {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    pods.patch(name, &PatchParams::default(), &Patch::Merge(json!({ "metadata": { "finalizers": null } })))
        .await
        .expect("remove finalizer");
    match pods.delete(name, &kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("delete {ns}/{name} with grace 0: {e}"),
    }
}

/// Sets a Pod's phase, as a kubelet does (e.g. `Failed` on a node-pressure eviction).
pub async fn set_phase(client: &Client, ns: &str, name: &str, phase: &str) {
    Api::<Pod>::namespaced(client.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(json!({ "status": { "phase": phase } })))
        .await
        .expect("set the Pod's phase");
}

/// Every entry of every capo-owned reservation of `policy` (all its shards), sorted.
pub async fn entries(client: &Client, policy: &str) -> Vec<String> {
    policy_entries(client, V1, policy).await
}

/// Polls until the record of `ip` is gone; returns when that was first seen.
pub async fn wait_released(client: &Client, ip: IpAddr, limit: Duration) -> Timestamp {
    eventually(
        &format!("{ip} released"),
        limit,
        || async move { record(client, ip).await.is_none().then(Timestamp::now) },
    )
    .await
}

/// Waits for an Event with `reason` about the object `name` (in `namespace`; cluster-scoped
/// objects get theirs in `default`).
pub async fn wait_event(client: &Client, namespace: &str, name: &str, reason: &str) -> String {
    wait_event_within(client, namespace, name, reason, Duration::from_secs(20)).await
}

pub async fn wait_event_within(client: &Client, namespace: &str, name: &str, reason: &str, within: Duration) -> String {
    let api = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), namespace);
    eventually(&format!("a {reason} Event about {name}"), within, || {
        let api = api.clone();
        async move {
            let list = api.list(&Default::default()).await.ok()?;
            list.items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                })
                .and_then(|e| e.note)
        }
    })
    .await
}

/// How many Events with `reason` about `name` there are, counting repeats of a series.
pub async fn event_count(client: &Client, namespace: &str, name: &str, reason: &str) -> i32 {
    let api = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), namespace);
    let list = api.list(&Default::default()).await.expect("list Events");
    list.items
        .iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason) && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .map(|e| e.series.as_ref().map_or(1, |s| s.count))
        .sum()
}

/// Waits until the leader counts the hold of `ip` down (`status.releaseAt` set).
pub async fn wait_status(client: &Client, ip: IpAddr) -> ReservedIP {
    eventually(&format!("{ip} counted down (status.releaseAt)"), Duration::from_secs(20), || async move {
        let r = record(client, ip).await?;
        r.status.as_ref()?.release_at.as_ref()?;
        Some(r)
    })
    .await
}

/// Waits until `app`'s metric `needle` reaches at least `at_least`.
/// The value of a counter once it reached `at_least` (counters move just after the API
/// write they count is answered, so a test that saw the write may read them a moment
/// early). Assert the exact value on what this returns.
pub async fn wait_metric(app: &capo::App, needle: &str, at_least: f64) -> f64 {
    eventually(&format!("{needle} >= {at_least}"), Duration::from_secs(30), || async {
        metric_value(app, needle).filter(|v| *v >= at_least)
    })
    .await
}

//! GitOps against a real Argo CD (v3.6, built by `hack/build-argocd.sh`, run next to the
//! test control plane by `capo_testenv::argocd`): capo and its CapoPolicies synced from
//! a git repository holding this worktree's `argocd/`, `config/` and `charts/`, with the
//! Applications' repoURL rewritten to a `file://` URL as a fork would. The tests share
//! one Argo CD and one capo install, so they run one at a time.
//!
//! The suite runs on the default Kubernetes version only: `make test-compat` sets
//! `CAPO_SKIP_GITOPS`, and each test then says it is skipped and returns.

mod support;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use capo_api::{CalicoApiGroup, CapoPolicy, ReservedIP};
use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams};
use kube::{Client, Resource};
use serde_json::{Value, json};
use support::argocd::*;
use support::*;

/// One test at a time: they share Argo CD's namespace, capo's install in capo-system and,
/// for the health check, the moment no capo runs.
static SUITE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A test's turn in the suite; says how long the test took when it ends.
struct Turn {
    _guard: tokio::sync::MutexGuard<'static, ()>,
    test: &'static str,
    started: Instant,
}

impl Drop for Turn {
    fn drop(&mut self) {
        eprintln!("gitops {}: {:.1}s", self.test, self.started.elapsed().as_secs_f64());
    }
}

/// Takes the suite's turn and the test binary's Argo CD, or `None` in the compatibility
/// pass (`CAPO_SKIP_GITOPS`, set by `make test-compat`).
async fn turn(test: &'static str) -> Option<(Turn, Argo)> {
    if std::env::var_os("CAPO_SKIP_GITOPS").is_some() {
        eprintln!("{test}: skipped (CAPO_SKIP_GITOPS: the GitOps suite runs on the default Kubernetes version only)");
        return None;
    }
    let guard = SUITE.lock().await;
    let argo = argocd().await;
    Some((Turn { _guard: guard, test, started: Instant::now() }, argo))
}

const SYNC_LIMIT: Duration = Duration::from_secs(120);

fn name_of(manifest: &Value) -> String {
    manifest["metadata"]["name"].as_str().expect("metadata.name").to_string()
}

fn wave_of(manifest: &Value) -> i64 {
    manifest["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"].as_str().map_or(0, |w| w.parse().unwrap())
}

/// When the object was created, as the API server recorded it.
fn created<K: Resource>(obj: &K) -> Timestamp {
    obj.meta().creation_timestamp.as_ref().expect("creationTimestamp").0
}

// ---------------------------------------------------------------------------------------
// capo itself, from argocd/capo.yaml or argocd/capo-helm.yaml, then argocd/policies.yaml
// ---------------------------------------------------------------------------------------

/// The Applications of `argocd/` (project, capo's Application from `app_file`, the
/// policies) applied in their sync waves, as an app of apps does: wave 0 (the project and
/// capo) until Synced and Healthy, then wave 1 (the policies). capo itself must be
/// running by then, which the caller starts in `between`.
#[tokio::test]
async fn the_manifests_application_syncs_in_waves_and_stays_synced_with_capo_running() {
    let Some((_turn, argo)) = turn("manifests").await else { return };
    installs_in_waves_and_stays_synced(&argo, "argocd/capo.yaml").await;
}

#[tokio::test]
async fn the_chart_application_syncs_in_waves_and_stays_synced_with_capo_running() {
    let Some((_turn, argo)) = turn("chart").await else { return };
    install_prometheus_crds().await;
    installs_in_waves_and_stays_synced(&argo, "argocd/capo-helm.yaml").await;
}

async fn installs_in_waves_and_stays_synced(argo: &Argo, app_file: &str) {
    let admin = client().await;
    // The policies' creation times are compared with the webhook's below: none may be
    // left over from an earlier test of this binary.
    let capo_policies = Api::<CapoPolicy>::all(admin.clone());
    if capo_policies.delete("statefulsets", &DeleteParams::default()).await.is_ok() {
        eventually("a leftover CapoPolicy statefulsets gone", Duration::from_secs(30), || async {
            capo_policies.get_opt("statefulsets").await.ok()?.is_none().then_some(())
        })
        .await;
    }
    no_capo_install(argo, &admin).await;
    install_calico_crds(&admin).await;
    let repo = GitRepo::with_capo_layout(app_file.trim_start_matches("argocd/").trim_end_matches(".yaml"));
    let (project, capo_app, policies_app) =
        (repo.yaml("argocd/project.yaml"), repo.yaml(app_file), repo.yaml("argocd/policies.yaml"));
    let (app, policies) = (name_of(&capo_app), name_of(&policies_app));
    assert_eq!((wave_of(&capo_app), wave_of(&policies_app)), (0, 1), "capo first, its policies after");
    assert_eq!(capo_app["spec"]["syncPolicy"]["automated"], json!({ "prune": true, "selfHeal": true }));

    // Wave 0: the project and capo.
    argo.apply(&project).await;
    argo.apply(&capo_app).await;
    let status = argo.wait_synced_healthy(&app, None, SYNC_LIMIT).await;
    let webhook_created = assert_synced_in_waves(&admin, &status).await;

    // capo, as the installed Deployment runs it (see tests/install.rs), so that its
    // caBundle injection and policy status are what Argo CD compares against.
    let ns = TestNamespace::create(&admin, "gitops-install").await;
    let addr = host_addr();
    capo_testenv::route::route_service(&admin, "capo-system", "capo", "webhook", addr).await.expect("route");
    let capo =
        start_capo_with(&as_capo_service_account().await, &ns.name, installed_settings(addr, &format!("{}-", ns.name)))
            .await;

    // Wave 1: the policies; Healthy once capo has loaded them.
    argo.apply(&policies_app).await;
    let status = argo.wait_synced_healthy(&policies, None, SYNC_LIMIT).await;
    assert_eq!(resource_health(&status, "CapoPolicy", "statefulsets").0, "Healthy", "{status:#}");
    let policy = Api::<CapoPolicy>::all(admin.clone()).get("statefulsets").await.unwrap();
    // Creation times have a resolution of one second.
    assert!(
        created(&policy) >= webhook_created,
        "the policies come after the webhook (wave 1 after wave 0): policy {}, webhook {webhook_created}",
        created(&policy)
    );
    let webhooks = Api::<ValidatingWebhookConfiguration>::all(admin.clone()).get("capo").await.unwrap();
    assert!(
        webhooks.webhooks.unwrap().iter().all(|w| w.client_config.ca_bundle.as_ref().is_some_and(|b| !b.0.is_empty())),
        "capo injected its caBundle"
    );

    stays_synced(argo, &[&app, &policies]).await;

    capo.shutdown().await;
    argo.delete_cascade(&policies).await;
    argo.delete_cascade(&app).await;
    // The chart's Application creates the namespace (CreateNamespace) and leaves it.
    let _ = Api::<Namespace>::all(admin.clone()).delete("capo-system", &DeleteParams::default()).await;
    wait_namespace_gone(&admin, "capo-system").await;
}

/// The last sync ran capo's CRDs (wave -2), then its Deployment (-1), then its webhook
/// configuration (0): in Argo CD's own account (the waves it read, the order it ran
/// them) and in the objects' creation times (Argo CD waits for a wave to be healthy, and
/// 2 s more, before the next). Returns when the webhook configuration was created.
async fn assert_synced_in_waves(admin: &Client, status: &Value) -> Timestamp {
    let crds = ["capopolicies.capo.io", "reservedips.capo.io"];
    for crd in crds {
        assert_eq!(resource(status, "CustomResourceDefinition", crd).unwrap()["syncWave"], -2, "{crd}");
    }
    assert_eq!(resource(status, "Deployment", "capo").unwrap()["syncWave"], -1);
    let vwc = resource(status, "ValidatingWebhookConfiguration", "capo").unwrap();
    assert!(vwc["syncWave"].is_null() || vwc["syncWave"] == 0, "{vwc}");

    // The order Argo CD ran the tasks in, when the last operation is that first sync.
    // Right after it Argo CD often self-heals the last wave's objects once (its cache had
    // not seen them yet; nothing changes, and it does not recur): that operation's result
    // lists only those.
    if status["operationState"]["operation"]["sync"]["resources"].is_null() {
        let ran = sync_results(status);
        let position = |kind: &str, name: &str| {
            ran.iter()
                .position(|r| r["kind"] == kind && r["name"] == name)
                .unwrap_or_else(|| panic!("{kind}/{name} not in the sync result: {ran:#?}"))
        };
        let (deployment, webhook) =
            (position("Deployment", "capo"), position("ValidatingWebhookConfiguration", "capo"));
        for crd in crds {
            assert!(position("CustomResourceDefinition", crd) < deployment, "{crd} before the Deployment");
        }
        assert!(deployment < webhook, "the Deployment before the webhook configuration");
    } else {
        eprintln!(
            "the last operation re-applied {} (self-heal)",
            status["operationState"]["operation"]["sync"]["resources"]
        );
    }

    let crd_api = Api::<CustomResourceDefinition>::all(admin.clone());
    let deployment = Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), "capo-system");
    let deployment_created = created(&deployment.get("capo").await.unwrap());
    let webhook_created =
        created(&Api::<ValidatingWebhookConfiguration>::all(admin.clone()).get("capo").await.unwrap());
    for crd in crds {
        assert!(created(&crd_api.get(crd).await.unwrap()) < deployment_created, "{crd} created first");
    }
    assert!(deployment_created < webhook_created, "the Deployment created before the webhook configuration");
    webhook_created
}

/// For at least four resync periods (the controller compares every Application with git
/// that often), and until the controller really did compare each one three times more
/// (`reconciledAt` advanced three times: a loaded controller compares less often than its
/// period, so this waits for it, up to twelve periods), every Application stays Synced and
/// Healthy and no sync operation starts (self-heal is on: drift would show as an operation).
async fn stays_synced(argo: &Argo, apps: &[&str]) {
    let window = argo.resync * 4;
    let deadline = argo.resync * 12;
    let mut before = Vec::new();
    for app in apps {
        let status = argo.status(app).await;
        before.push((status["operationState"]["startedAt"].clone(), status["history"].as_array().map(Vec::len)));
    }
    let mut reconciled: Vec<BTreeSet<String>> = vec![BTreeSet::new(); apps.len()];
    let start = Instant::now();
    while start.elapsed() < window || (reconciled.iter().any(|seen| seen.len() < 4) && start.elapsed() < deadline) {
        for (i, app) in apps.iter().enumerate() {
            let status = argo.status(app).await;
            assert_eq!(sync_status(&status), "Synced", "{app} drifted after {:?}:\n{status:#}", start.elapsed());
            assert_eq!(health(&status).0, "Healthy", "{app} after {:?}:\n{status:#}", start.elapsed());
            let now = (status["operationState"]["startedAt"].clone(), status["history"].as_array().map(Vec::len));
            assert_eq!(now, before[i], "{app}: a sync ran during the window (self-heal of drift?):\n{status:#}");
            reconciled[i].insert(status["reconciledAt"].as_str().unwrap_or_default().to_string());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for (app, seen) in apps.iter().zip(&reconciled) {
        assert!(
            seen.len() >= 4,
            "{app}: the controller compared it only {} times in {:?}: {seen:?}",
            seen.len(),
            start.elapsed()
        );
    }
}

/// No capo install and no Application from an earlier test: capo-system, the webhook
/// configuration and the Applications gone (capo's CRDs may stay, as they do in a
/// cluster: Argo CD never deletes them).
async fn no_capo_install(argo: &Argo, admin: &Client) {
    for app in ["capo", "capo-helm", "capo-policies"] {
        argo.delete_cascade(app).await;
    }
    let _ = Api::<ValidatingWebhookConfiguration>::all(admin.clone()).delete("capo", &DeleteParams::default()).await;
    let _ = Api::<MutatingWebhookConfiguration>::all(admin.clone()).delete("capo", &DeleteParams::default()).await;
    if Api::<Namespace>::all(admin.clone()).get_opt("capo-system").await.unwrap().is_some() {
        let _ = Api::<Namespace>::all(admin.clone()).delete("capo-system", &DeleteParams::default()).await;
    }
    wait_namespace_gone(admin, "capo-system").await;
}

async fn wait_namespace_gone(admin: &Client, name: &str) {
    let namespaces = Api::<Namespace>::all(admin.clone());
    eventually(&format!("namespace {name} gone"), Duration::from_secs(90), || async {
        namespaces.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
}

/// The Prometheus operator's CRDs, for the chart's ServiceMonitor and PrometheusRule
/// (capo-helm.yaml turns them on); from `hack/tools.sh`'s cache.
async fn install_prometheus_crds() {
    let cache = std::env::var_os("CAPO_CRDS").map(std::path::PathBuf::from).unwrap_or_else(|| {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache"));
        base.join("capo/crds/current")
    });
    let dir = std::fs::canonicalize(&cache).unwrap_or_else(|e| panic!("{}: {e}; run `make tools`", cache.display()));
    for file in ["monitoring.coreos.com_servicemonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml"] {
        let path = dir.join(file);
        let (ok, out) =
            kubectl(&["apply", "--server-side", "--force-conflicts", "-f", path.to_str().unwrap()], None).await;
        assert!(ok, "{out}");
    }
    let (ok, out) = kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/servicemonitors.monitoring.coreos.com",
            "crd/prometheusrules.monitoring.coreos.com",
        ],
        None,
    )
    .await;
    assert!(ok, "{out}");
}

// ---------------------------------------------------------------------------------------
// The policies Application on its own: a test's own folder of policies
// ---------------------------------------------------------------------------------------

/// A test's own policies Application (`<namespace>-policies`, argocd/policies.yaml renamed)
/// over its own repository, whose `argocd/policies` holds `files` instead of the sample.
struct Policies {
    repo: GitRepo,
    app: String,
}

impl Policies {
    async fn sync(argo: &Argo, ns: &str, files: &[(&str, Value)]) -> Policies {
        let repo = GitRepo::with_capo_layout(ns);
        repo.remove("argocd/policies/statefulsets.yaml");
        for (file, policy) in files {
            repo.write(&format!("argocd/policies/{file}"), &serde_saphyr::to_string(policy).unwrap());
        }
        repo.commit_and_push("this test's policies");
        let mut app = repo.yaml("argocd/policies.yaml");
        let name = format!("{ns}-policies");
        app["metadata"]["name"] = json!(name);
        argo.apply(&repo.yaml("argocd/project.yaml")).await;
        argo.apply(&app).await;
        Policies { repo, app: name }
    }

    /// Commits what the closure changed in the work tree, pushes it and asks Argo CD to
    /// refresh (as a git webhook would); returns the commit.
    async fn commit(&self, argo: &Argo, message: &str, change: impl FnOnce(&GitRepo)) -> String {
        change(&self.repo);
        let commit = self.repo.commit_and_push(message);
        argo.refresh(&self.app).await;
        commit
    }
}

fn policy(name: &str, ns: &str, spec: Value) -> Value {
    let mut spec = spec;
    spec["namespaceSelector"] = json!({ "matchLabels": { "kubernetes.io/metadata.name": ns } });
    json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
            "metadata": { "name": name, "annotations": { "argocd.argoproj.io/sync-wave": "1" } },
            "spec": spec })
}

/// Leader settings for a test's capo: its own Lease, and only its own policies.
fn leading(ns: &str) -> capo::app::ReleaseSettings {
    capo::app::ReleaseSettings {
        election: Some(capo::leader::LeaderSettings {
            lease_name: format!("capo-{ns}"),
            namespace: "default".into(),
            identity: "gitops".into(),
            duration: Duration::from_secs(3),
            grace: Duration::from_secs(1),
        }),
        engine: capo::release::EngineSettings {
            plan: capo::release::PlanSettings { settle: Duration::from_secs(1), ..Default::default() },
            policy_prefix: Some(format!("{ns}-")),
            excluded_namespaces: vec!["kube-system".into()],
            ..Default::default()
        },
        identity: "gitops".into(),
    }
}

/// capo serving the webhook for `ns` and leading (its release engine running), for the
/// policies of `ns`.
async fn start_leading_capo(client: &Client, ns: &str) -> capo::App {
    let mut settings = capo_settings(&format!("capo-test-{ns}"), &[ns], None);
    settings.release = Some(leading(ns));
    let app = start_capo_with(client, ns, settings).await;
    let fence = app.fence.clone().expect("release on");
    eventually("capo to lead", Duration::from_secs(30), || {
        let f = fence.clone();
        async move { f.is_leader().then_some(()) }
    })
    .await;
    app
}

async fn setup(prefix: &str) -> (Client, TestNamespace) {
    let client = client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    let ns = TestNamespace::create(&client, prefix).await;
    (client, ns)
}

/// A Pod of `ns` with an IP, deleted: held (capo's webhook) and, once the leader saw the
/// Pod gone, counting down. Returns the IP and its record.
async fn held(client: &Client, ns: &str, pod: &str) -> (IpAddr, ReservedIP) {
    let ip = Ips::v4();
    create_pod_with_ips(client, ns, unscheduled_pod(pod, &[], &[]), &[ip]).await;
    delete_pod(client, ns, pod).await.expect("deletion allowed");
    let rec = eventually(&format!("{ip} counting down"), Duration::from_secs(20), || async move {
        let r = record(client, ip).await?;
        r.status.as_ref()?.release_at.as_ref()?;
        Some(r)
    })
    .await;
    (ip, rec)
}

fn release_at(rec: &ReservedIP) -> Timestamp {
    rec.status.as_ref().and_then(|s| s.release_at.as_ref()).expect("releaseAt").0
}

/// Argo CD computes each CapoPolicy's health with capo's health check (argocd-cm): a
/// policy capo has not loaded yet is Progressing; once capo runs, a valid one is Healthy
/// and one capo rejects (it passes the schema, but `capo-<name>` would be too long a
/// name) is Degraded with capo's reason — and the Application with it.
#[tokio::test]
async fn argo_cd_reports_capopolicy_health_with_capos_health_check() {
    let Some((_turn, argo)) = turn("health").await else { return };
    let (client, ns) = setup("gitops-health").await;
    let good = format!("{}-good", ns.name);
    // One character past a label value: refused at apply (the CRD's rule), so it can
    // never make a hold write fail; Argo CD shows the API server's reason.
    let long = format!("{}-{}", ns.name, "x".repeat(63 - ns.name.len()));
    assert_eq!(long.len(), 64);
    let files = [
        ("good.yaml", policy(&good, &ns.name, json!({ "podSelector": {} }))),
        ("too-long.yaml", policy(&long, &ns.name, json!({ "podSelector": {}, "priority": 100 }))),
    ];
    let policies = Policies::sync(&argo, &ns.name, &files).await;

    // No capo runs: the good one is waiting for it; the long one was refused.
    let status = argo
        .wait(&policies.app, "the good policy Progressing, the long one refused", SYNC_LIMIT, |s| {
            resource_health(s, "CapoPolicy", &good).0 == "Progressing"
                && s["operationState"]["message"].as_str().is_some_and(|m| m.contains("at most 63 characters"))
        })
        .await;
    assert_eq!(resource_health(&status, "CapoPolicy", &good).1, "Waiting for capo to load the policy");
    let result = sync_results(&status).into_iter().find(|r| r["name"] == long.as_str()).expect("a result for it");
    assert_eq!(result["status"], "SyncFailed", "{result}");
    assert!(Api::<CapoPolicy>::all(client.clone()).get_opt(&long).await.unwrap().is_none());

    let capo = start_capo(&client, &[&ns.name], None).await;
    let status = argo
        .wait(&policies.app, "the good policy Healthy", SYNC_LIMIT, |s| {
            resource_health(s, "CapoPolicy", &good).0 == "Healthy"
        })
        .await;
    assert_eq!(sync_status(&status), "OutOfSync", "git holds a policy the cluster refused");
    eprintln!("Argo CD: {good}: {:?}; {long}: {result}", resource_health(&status, "CapoPolicy", &good));

    capo.shutdown().await;
    argo.delete_cascade(&policies.app).await;
}

/// A commit that removes a CapoPolicy holding an IP: Argo CD prunes the policy, and the
/// hold stays until its due time — released then, not before (capo's leader runs).
#[tokio::test]
async fn a_pruned_policy_keeps_its_holds_until_they_are_due() {
    let Some((_turn, argo)) = turn("prune").await else { return };
    let (client, ns) = setup("gitops-prune").await;
    garbage_collector_knows_capopolicies(&client, &ns.name).await;
    let capo = start_leading_capo(&client, &ns.name).await;
    let name = format!("{}-p", ns.name);
    let spec = json!({ "podSelector": {}, "reserveFor": "20s", "releaseInterval": "100ms" });
    let policies = Policies::sync(&argo, &ns.name, &[("p.yaml", policy(&name, &ns.name, spec))]).await;
    argo.wait_synced_healthy(&policies.app, None, SYNC_LIMIT).await;

    let (ip, rec) = held(&client, &ns.name, "redis-0").await;
    let due = release_at(&rec);
    let committed = Timestamp::now();
    let commit = policies.commit(&argo, "drop the policy", |r| r.remove("argocd/policies/p.yaml")).await;
    let status = argo.wait_synced_healthy(&policies.app, Some(&commit), SYNC_LIMIT).await;
    assert!(Api::<CapoPolicy>::all(client.clone()).get_opt(&name).await.unwrap().is_none(), "Argo CD pruned it");
    assert!(resource(&status, "CapoPolicy", &name).is_none(), "no longer part of the Application: {status:#}");
    let pruned_at = Timestamp::now();
    assert!(pruned_at < due, "pruned before the hold was due (else the test proves nothing)");
    assert!(record(&client, ip).await.is_some(), "the hold outlives its policy");
    let entries = reservation(&client, CalicoApiGroup::CrdV1, &format!("capo-{name}")).await.unwrap_or_default();
    assert!(entries.contains(&cidr(ip)), "{ip} still reserved: {entries:?}");

    let c = &client;
    let released = eventually(&format!("{ip} released"), Duration::from_secs(30), || async move {
        record(c, ip).await.is_none().then(Timestamp::now)
    })
    .await;
    let late = released.duration_since(due).as_secs_f64();
    assert!(late >= -0.05, "the pruned policy's hold was released {:.3}s early", -late);
    assert!(late <= 1.5, "released {late:.3}s late");
    eprintln!(
        "pruned {:.1}s after the commit, {:.1}s before the hold was due; released {late:.3}s after it was due",
        pruned_at.duration_since(committed).as_secs_f64(),
        due.duration_since(pruned_at).as_secs_f64()
    );
    capo.shutdown().await;
    argo.delete_cascade(&policies.app).await;
}

/// Argo CD prunes with foreground propagation, which the garbage collector completes; it
/// learns of a new kind when it next rereads discovery (every 30 s), and until then a
/// pruned CapoPolicy stays "Pending deletion; blocked by finalizers: foregroundDeletion".
/// The CRD may be seconds old here (a fresh control plane), so wait until a foreground
/// deletion of a throwaway policy completes.
async fn garbage_collector_knows_capopolicies(client: &Client, ns: &str) {
    let probe = format!("{ns}-gc-probe");
    try_apply_policy(
        client,
        &probe,
        json!({ "podSelector": {}, "namespaceSelector": { "matchLabels": { "none": "x" } } }),
    )
    .await
    .expect("probe policy");
    let api = Api::<CapoPolicy>::all(client.clone());
    api.delete(&probe, &DeleteParams::foreground()).await.expect("delete the probe");
    eventually("the garbage collector to handle CapoPolicies", Duration::from_secs(60), || async {
        api.get_opt(&probe).await.ok()?.is_none().then_some(())
    })
    .await;
}

/// A commit that changes `reserveFor` is applied live: the policy's new generation is
/// loaded (Healthy in Argo CD), a hold made before keeps the reserveFor and due time it was
/// made with, and the next hold uses the new one (docs/release.md).
#[tokio::test]
async fn a_new_reserve_for_applies_to_the_next_hold_and_not_to_earlier_ones() {
    let Some((_turn, argo)) = turn("reserveFor").await else { return };
    let (client, ns) = setup("gitops-ttl").await;
    let capo = start_leading_capo(&client, &ns.name).await;
    let name = format!("{}-p", ns.name);
    let spec = |ttl: &str| json!({ "podSelector": {}, "reserveFor": ttl, "releaseInterval": "100ms" });
    let policies = Policies::sync(&argo, &ns.name, &[("p.yaml", policy(&name, &ns.name, spec("1m")))]).await;
    argo.wait_synced_healthy(&policies.app, None, SYNC_LIMIT).await;
    let (first, before) = held(&client, &ns.name, "redis-0").await;
    assert_eq!(before.spec.reserve_for, "1m");

    let file = serde_saphyr::to_string(&policy(&name, &ns.name, spec("3s"))).unwrap();
    let commit = policies.commit(&argo, "reserveFor: 3s", |r| r.write("argocd/policies/p.yaml", &file)).await;
    argo.wait_synced_healthy(&policies.app, Some(&commit), SYNC_LIMIT).await;
    let live = wait_policy_ready(&client, &name, Some(2), "True").await;
    assert_eq!(live.spec.reserve_for, "3s", "applied live");
    let status = argo.wait(&policies.app, "the policy Healthy", SYNC_LIMIT, |s| health(s).0 == "Healthy").await;
    assert_eq!(resource_health(&status, "CapoPolicy", &name).0, "Healthy");

    let (second, next) = held(&client, &ns.name, "redis-1").await;
    assert_eq!(next.spec.reserve_for, "3s", "the next hold uses the new reserveFor");
    let c = &client;
    let released = eventually(&format!("{second} released"), Duration::from_secs(20), || async move {
        record(c, second).await.is_none().then(Timestamp::now)
    })
    .await;
    assert!(released.duration_since(release_at(&next)).as_secs_f64() >= -0.05, "not before its due time");
    let earlier = record(&client, first).await.expect("the earlier hold is still held");
    assert_eq!(earlier.spec.reserve_for, "1m", "the earlier hold keeps the reserveFor it was made with");
    assert_eq!(release_at(&earlier), release_at(&before), "and its due time");
    capo.shutdown().await;
    argo.delete_cascade(&policies.app).await;
}

/// A commit with a CapoPolicy the API server refuses: the sync fails with the API
/// server's validation message in the Application, the policy is not created, and nothing
/// capo holds changes.
#[tokio::test]
async fn an_invalid_policy_fails_the_sync_with_the_api_servers_message_and_changes_nothing() {
    let Some((_turn, argo)) = turn("invalid").await else { return };
    let (client, ns) = setup("gitops-invalid").await;
    let capo = start_leading_capo(&client, &ns.name).await;
    let name = format!("{}-p", ns.name);
    let spec = json!({ "podSelector": {}, "reserveFor": "1h" });
    let policies = Policies::sync(&argo, &ns.name, &[("p.yaml", policy(&name, &ns.name, spec))]).await;
    argo.wait_synced_healthy(&policies.app, None, SYNC_LIMIT).await;
    let (ip, rec) = held(&client, &ns.name, "redis-0").await;
    let reservation_name = format!("capo-{name}");
    let entries = reservation(&client, CalicoApiGroup::CrdV1, &reservation_name).await;
    let generation = Api::<CapoPolicy>::all(client.clone()).get(&name).await.unwrap().metadata.generation;

    let bad = format!("{}-bad", ns.name);
    let file = serde_saphyr::to_string(&policy(&bad, &ns.name, json!({ "podSelector": {}, "reserveFor": "forever" })))
        .unwrap();
    let commit = policies.commit(&argo, "a bad policy", |r| r.write("argocd/policies/bad.yaml", &file)).await;
    let status = argo
        .wait(&policies.app, "the sync to fail on the bad policy", SYNC_LIMIT, |s| {
            s["operationState"]["syncResult"]["revision"] == commit.as_str()
                && s["operationState"]["message"].as_str().is_some_and(|m| m.contains("spec.reserveFor"))
        })
        .await;
    let message = status["operationState"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("CapoPolicy.capo.io \"{bad}\" is invalid")), "{message}");
    let result = sync_results(&status).into_iter().find(|r| r["name"] == bad.as_str()).expect("a result for it");
    assert_eq!(result["status"], "SyncFailed", "{result}");
    assert!(result["message"].as_str().unwrap().contains("spec.reserveFor"), "{result}");
    assert_eq!(sync_status(&status), "OutOfSync", "git and the cluster differ");
    eprintln!("Argo CD: {message}");

    // Nothing changed: not the bad policy, not the good one, not the hold.
    assert!(Api::<CapoPolicy>::all(client.clone()).get_opt(&bad).await.unwrap().is_none());
    let now = Api::<CapoPolicy>::all(client.clone()).get(&name).await.unwrap();
    assert_eq!(now.metadata.generation, generation);
    let after = record(&client, ip).await.expect("still held");
    assert_eq!(after.metadata.resource_version, rec.metadata.resource_version, "the record is untouched");
    assert_eq!(reservation(&client, CalicoApiGroup::CrdV1, &reservation_name).await, entries);

    // Fixed forward: the Applications retry on the newest commit (`retry.refresh`), so the
    // fix is synced at the next retry (5 s, 10 s, … up to 1 min apart), not once the bad
    // commit's retries have run out (306.8 s was seen without it).
    let fixed =
        serde_saphyr::to_string(&policy(&bad, &ns.name, json!({ "podSelector": {}, "reserveFor": "2h" }))).unwrap();
    let pushed = Instant::now();
    let fix = policies.commit(&argo, "fix the bad policy", |r| r.write("argocd/policies/bad.yaml", &fixed)).await;
    let policies_api = Api::<CapoPolicy>::all(client.clone());
    eventually("the fix-forward commit to be synced", Duration::from_secs(75), || async {
        policies_api.get_opt(&bad).await.ok()?.map(|_| ())
    })
    .await;
    eprintln!("the fix-forward commit was applied {:.1} s after its push", pushed.elapsed().as_secs_f64());
    argo.wait_synced_healthy(&policies.app, Some(&fix), SYNC_LIMIT).await;
    capo.shutdown().await;
    argo.delete_cascade(&policies.app).await;
}

//! Shared by the integration tests: the real control plane (one per test binary),
//! capo's CRDs, an in-process capo whose webhook the API server calls over TLS, and
//! helpers for Pods, policies and Calico reservations.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use capo::app::{SelfRegister, Settings, TlsSource};
use capo_api::{CalicoApiGroup, CapoPolicy, ReservedIP};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;

#[allow(unused_imports)]
pub use capo_testenv::TestNamespace;

pub mod argocd;
pub mod audit;
pub mod calico;
pub mod etcd;
pub mod faults;
pub mod leading;
pub mod plane;

#[allow(unused_imports)]
pub use calico::{IpFamilies, create_pod_with_calico_ips};

pub async fn client() -> Client {
    capo_testenv::shared().client().await
}

/// The client of a test binary whose control plane runs without Calico (no Calico CRDs,
/// no IPAM driver); every test of that binary must use it.
pub async fn client_without_calico() -> Client {
    capo_testenv::shared_with(capo_testenv::Calico::Off).client().await
}

/// The usual start of a test: capo's and Calico's CRDs, and a namespace of its own.
pub async fn setup(prefix: &str) -> (Client, TestNamespace) {
    let client = client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    let ns = TestNamespace::create(&client, prefix).await;
    (client, ns)
}

/// The value of the first metric line of `app` that starts with `needle` (name and
/// labels), if there is one.
pub fn metric_value(app: &capo::App, needle: &str) -> Option<f64> {
    app.metrics.render().lines().find(|l| l.starts_with(needle)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Runs kubectl against the test control plane (with `stdin` if given); returns whether
/// it succeeded and what it printed.
pub async fn kubectl(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    kubectl_with(&capo_testenv::shared().kubeconfig, args, stdin).await
}

/// [`kubectl`] against the control plane of `kubeconfig`.
pub async fn kubectl_with(kubeconfig: &std::path::Path, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl");
    let mut input = child.stdin.take().expect("stdin");
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).await.expect("write to kubectl");
    }
    drop(input);
    let out = child.wait_with_output().await.expect("kubectl");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The helm `make tools` installs (`CAPO_HELM` overrides it).
pub fn helm() -> std::path::PathBuf {
    use std::path::PathBuf;
    if let Some(h) = std::env::var_os("CAPO_HELM") {
        return h.into();
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache"));
    let path = cache.join("capo/tools/helm-v3.22.0/helm");
    assert!(path.exists(), "{} missing: run `make tools` (make test does)", path.display());
    path
}

pub fn cidr(ip: IpAddr) -> String {
    capo_api::reserved_ip::single_ip_cidr(ip)
}

/// Polls `f` until it yields `Some`, failing the test with `what` after `limit`.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Installs (server-side apply) a CRD and waits until it is Established.
pub async fn install_crd(client: &Client, crd: CustomResourceDefinition) {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let name = crd.name_any();
    api.patch(&name, &PatchParams::apply("capo-tests").force(), &Patch::Apply(crd)).await.expect("apply CRD");
    eventually(&format!("CRD {name} Established"), Duration::from_secs(30), || {
        let api = api.clone();
        let name = name.clone();
        async move {
            let crd = api.get(&name).await.ok()?;
            let established = crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True");
            established.then_some(())
        }
    })
    .await;
    // Established is not the end of it: right after a CRD is created the API server may
    // still answer watches with 429 "storage is (re)initializing", which would send a
    // capo started now into a watch backoff. Wait until a watch starts cleanly.
    let crd = api.get(&name).await.expect("read CRD");
    let version = crd.spec.versions.iter().find(|v| v.storage).map(|v| v.name.clone()).unwrap_or_default();
    let ar = kube::api::ApiResource {
        group: crd.spec.group.clone(),
        version: version.clone(),
        api_version: format!("{}/{version}", crd.spec.group),
        kind: crd.spec.names.kind.clone(),
        plural: crd.spec.names.plural.clone(),
    };
    let objects = Api::<DynamicObject>::all_with(client.clone(), &ar);
    eventually(&format!("watches of {name} to start"), Duration::from_secs(30), || {
        let objects = objects.clone();
        async move {
            use futures::StreamExt;
            let wp = kube::api::WatchParams::default().timeout(1);
            let mut stream = objects.watch(&wp, "0").await.ok()?.boxed();
            match tokio::time::timeout(Duration::from_millis(1500), stream.next()).await {
                Ok(Some(Err(_))) => None,
                Ok(Some(Ok(kube::api::WatchEvent::Error(_)))) => None,
                _ => Some(()),
            }
        }
    })
    .await;
}

pub async fn install_capo_crds(client: &Client) {
    install_crd(client, CapoPolicy::crd()).await;
    install_crd(client, ReservedIP::crd()).await;
    records_writable(client).await;
}

/// Right after a fresh control plane installed its CRDs (Calico's ~20 of them, then
/// capo's), the API server was seen to leave the first `ReservedIP` create of a test
/// unanswered for many seconds — far beyond anything a cluster whose CRDs were installed
/// before capo shows. Round-trips a throwaway record until one is answered at once.
async fn records_writable(client: &Client) {
    let api = Api::<ReservedIP>::all(client.clone());
    let name = "0.0.0.0";
    let rec: ReservedIP = serde_json::from_value(json!({
        "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
        "metadata": { "name": name, "labels": { "capo-test/warm-up": "true" } },
        "spec": { "ip": "0.0.0.0", "cidr": "0.0.0.0/32", "reservation": "capo-warm-up",
                  "calicoApiGroup": "crd.projectcalico.org/v1", "policy": "warm-up",
                  "pod": { "namespace": "", "name": "", "uid": "" },
                  "trigger": "Adopted", "reservedAt": "2026-01-01T00:00:00.000000Z", "reserveFor": "1s" },
    }))
    .expect("a warm-up record");
    eventually("a ReservedIP create answered at once", Duration::from_secs(60), || {
        let (api, rec) = (api.clone(), rec.clone());
        async move {
            let created = tokio::time::timeout(Duration::from_secs(2), api.create(&PostParams::default(), &rec)).await;
            let _ = api.delete(name, &DeleteParams::default()).await;
            match created {
                Ok(Ok(_)) => Some(()),
                Ok(Err(kube::Error::Api(s))) if s.code == 409 => Some(()),
                _ => None,
            }
        }
    })
    .await;
}

pub async fn install_calico_crds(client: &Client) {
    for group in CalicoApiGroup::ALL {
        install_crd(client, group.ip_reservation_crd()).await;
    }
}

/// Settings for an in-process capo whose webhook only covers `namespaces`.
pub fn capo_settings(webhook_name: &str, namespaces: &[&str], calico: Option<CalicoApiGroup>) -> Settings {
    Settings {
        webhook_addr: "127.0.0.1:0".parse().unwrap(),
        probe_addr: Some("127.0.0.1:0".parse().unwrap()),
        tls: TlsSource::SelfSigned { hosts: vec!["127.0.0.1".into()], write_to: None },
        inject_ca_bundle: None,
        self_register: Some(SelfRegister {
            name: webhook_name.to_string(),
            url: None,
            only_namespaces: Some(namespaces.iter().map(|s| s.to_string()).collect()),
            timeout_seconds: 10,
        }),
        calico_api: calico,
        calico_etcd: None,
        excluded_namespaces: vec!["kube-system".into(), "capo-system".into()],
        max_review_time: Duration::from_secs(10),
        limits: Default::default(),
        caller_auth: Default::default(),
        field_manager: "capo".into(),
        sync_timeout: Duration::from_secs(60),
        release: None,
        watch_failure_grace: Duration::from_secs(30),
    }
}

/// Starts capo against the test control plane, its webhook registered for `namespaces`,
/// and returns once the API server really calls it: webhook configurations reach the API
/// server's admission chain asynchronously, and until then (failurePolicy Ignore) a
/// deletion would pass unreviewed. The probe is a dry-run DELETE of a canary Pod.
pub async fn start_capo(client: &Client, namespaces: &[&str], calico: Option<CalicoApiGroup>) -> capo::App {
    let name = format!("capo-test-{}", namespaces[0]);
    start_capo_with(client, namespaces[0], capo_settings(&name, namespaces, calico)).await
}

/// Starts capo with `settings` and returns once the API server calls it for Pods in `ns`.
/// capo's logs in the test's output (`RUST_LOG`, default warnings).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter(filter).try_init();
}

pub async fn start_capo_with(client: &Client, ns: &str, settings: Settings) -> capo::App {
    init_tracing();
    let name = settings.self_register.as_ref().map(|r| r.name.clone()).unwrap_or_default();
    let app = capo::App::start(client.clone(), settings).await.expect("start capo");
    let admin = self::client().await;
    let pods = Api::<Pod>::namespaced(admin.clone(), ns);
    if pods.get_opt("capo-canary").await.unwrap().is_none() {
        create_pod_with_ips(&admin, ns, unscheduled_pod("capo-canary", &[], &[]), &[Ips::v4()]).await;
    }
    let dry = DeleteParams { dry_run: true, ..Default::default() };
    eventually(&format!("the API server to call webhook {name}"), Duration::from_secs(30), || {
        let pods = pods.clone();
        let dry = dry.clone();
        let metrics = app.metrics.clone();
        async move {
            pods.delete("capo-canary", &dry).await.ok()?;
            metrics.render().contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
        }
    })
    .await;
    app
}

/// Starts capo with `settings` against `client`'s control plane (a private one, say) and
/// returns once the API server calls it: a dry-run DELETE of the Pod `canary` in `ns`
/// (which the test made) reaches capo's webhook.
pub async fn start_capo_on(client: &Client, ns: &str, canary: &str, settings: Settings) -> capo::App {
    init_tracing();
    let app = capo::App::start(client.clone(), settings).await.expect("start capo");
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    eventually("the API server to call capo", Duration::from_secs(60), || {
        let (pods, metrics) = (pods.clone(), app.metrics.clone());
        async move {
            let _ = pods.delete(canary, &DeleteParams { dry_run: true, ..Default::default() }).await;
            metrics.render().contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
        }
    })
    .await;
    app
}

/// Applies a CapoPolicy whose namespaceSelector is `namespace` plus `spec`, and waits until
/// capo reports it Ready for this generation.
pub async fn apply_policy(client: &Client, name: &str, namespace: &str, mut spec: serde_json::Value) -> CapoPolicy {
    spec.as_object_mut()
        .unwrap()
        .entry("namespaceSelector")
        .or_insert_with(|| json!({ "matchLabels": { "kubernetes.io/metadata.name": namespace } }));
    let policy = try_apply_policy(client, name, spec).await.expect("apply CapoPolicy");
    wait_policy_ready(client, name, policy.metadata.generation, "True").await
}

pub async fn try_apply_policy(client: &Client, name: &str, spec: serde_json::Value) -> Result<CapoPolicy, kube::Error> {
    let api = Api::<CapoPolicy>::all(client.clone());
    let obj =
        json!({ "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": name }, "spec": spec });
    api.patch(name, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj)).await
}

/// Waits until capo has seen `generation` of the policy and reports `Ready=<ready>`.
pub async fn wait_policy_ready(client: &Client, name: &str, generation: Option<i64>, ready: &str) -> CapoPolicy {
    let api = Api::<CapoPolicy>::all(client.clone());
    eventually(
        &format!("CapoPolicy {name} Ready={ready} at generation {generation:?}"),
        Duration::from_secs(30),
        || {
            let api = api.clone();
            async move {
                let p = api.get(name).await.ok()?;
                let status = p.status.as_ref()?;
                let cond = status.condition("Ready")?;
                (status.observed_generation == generation && cond.status == ready).then_some(p.clone())
            }
        },
    )
    .await
}

/// Unique test addresses from the benchmarking ranges (RFC 2544 / RFC 5180), so tests
/// in one binary, and runs attached to one long-lived control plane, do not collide.
pub struct Ips;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A 16-bit number: a random start per process, then counting up.
fn unique() -> u32 {
    static BASE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        nanos ^ std::process::id().rotate_left(16)
    });
    (base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))) & 0xffff
}

impl Ips {
    pub fn v4() -> IpAddr {
        let n = unique();
        format!("198.19.{}.{}", n >> 8, n & 0xff).parse().unwrap()
    }
    pub fn v6() -> IpAddr {
        let n = unique();
        format!("2001:2::c:{n:x}").parse().unwrap()
    }
}

/// A Pod no scheduler picks up (so nothing but the test touches its status).
pub fn unscheduled_pod(name: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
    let labels: BTreeMap<_, _> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let annotations: BTreeMap<_, _> = annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    serde_json::from_value(json!({
        "metadata": { "name": name, "labels": labels, "annotations": annotations },
        "spec": {
            "schedulerName": "capo-tests-no-scheduler",
            "containers": [{ "name": "app", "image": "registry.invalid/app:1" }],
        },
    }))
    .unwrap()
}

/// Creates `pod` in `ns` and gives it `ips` in its status, as a CNI would.
pub async fn create_pod_with_ips(client: &Client, ns: &str, pod: Pod, ips: &[IpAddr]) -> Pod {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let created = api.create(&PostParams::default(), &pod).await.expect("create pod");
    if ips.is_empty() {
        return created;
    }
    let status = json!({ "status": {
        "phase": "Running",
        "podIP": ips[0].to_string(),
        "podIPs": ips.iter().map(|ip| json!({ "ip": ip.to_string() })).collect::<Vec<_>>(),
    }});
    api.patch_status(&created.name_any(), &PatchParams::default(), &Patch::Merge(status)).await.expect("set pod IPs")
}

/// A Pod the scheduler places on a kwok node, where kwok runs it and gives it an IP.
pub fn kwok_pod(name: &str, labels: &[(&str, &str)]) -> Pod {
    let labels: BTreeMap<_, _> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    serde_json::from_value(json!({
        "metadata": { "name": name, "labels": labels },
        "spec": {
            "containers": [{ "name": "app", "image": "registry.invalid/app:1" }],
            "tolerations": [{ "operator": "Exists" }],
        },
    }))
    .unwrap()
}

/// Waits until the Pod runs with an IP.
pub async fn wait_running(client: &Client, ns: &str, name: &str) -> Pod {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    eventually(&format!("pod {ns}/{name} Running with an IP"), Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let p = api.get(name).await.ok()?;
            let s = p.status.as_ref()?;
            (s.phase.as_deref() == Some("Running") && s.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty()))
                .then_some(p.clone())
        }
    })
    .await
}

pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ips.clone())
        .unwrap_or_default()
        .iter()
        .map(|p| p.ip.parse().unwrap())
        .collect()
}

/// The entries of a Calico IPReservation (`None`: the object does not exist).
pub async fn reservation(client: &Client, group: CalicoApiGroup, name: &str) -> Option<Vec<String>> {
    let api = Api::<DynamicObject>::all_with(client.clone(), &group.ip_reservation());
    let obj = api.get_opt(name).await.expect("read IPReservation")?;
    Some(
        obj.data["spec"]["reservedCIDRs"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default(),
    )
}

/// Every entry of the capo-owned reservations of `policy` in `group` (all of its shards),
/// sorted.
pub async fn policy_entries(client: &Client, group: CalicoApiGroup, policy: &str) -> Vec<String> {
    let api = Api::<DynamicObject>::all_with(client.clone(), &group.ip_reservation());
    let lp = kube::api::ListParams::default().labels(&format!("capo.io/policy={policy}"));
    let mut all: Vec<String> = api
        .list(&lp)
        .await
        .expect("list IPReservations")
        .items
        .iter()
        .flat_map(|o| o.data["spec"]["reservedCIDRs"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    all.sort();
    all
}

/// The record of `ip`, its countdown (kept by the leader in a countdown ConfigMap, in
/// whichever namespace that leader runs) shown in its status as `capo holds` shows it.
pub async fn record(client: &Client, ip: IpAddr) -> Option<ReservedIP> {
    let mut rec = Api::<ReservedIP>::all(client.clone())
        .get_opt(&capo_api::reserved_ip::record_name(ip))
        .await
        .expect("read record")?;
    let starts = capo::release::countdowns::read(client, None).await.expect("read the countdowns");
    capo::release::countdowns::overlay(&mut rec, &starts, &Default::default());
    Some(rec)
}

/// The records of `ips` that exist, as [`record`] shows them, read in one pass (one list
/// of the records, one of the countdowns): for many holds that count down fast.
#[allow(dead_code)]
pub async fn records(client: &Client, ips: &[IpAddr]) -> std::collections::HashMap<IpAddr, ReservedIP> {
    let names: std::collections::HashMap<String, IpAddr> =
        ips.iter().map(|ip| (capo_api::reserved_ip::record_name(*ip), *ip)).collect();
    let list = Api::<ReservedIP>::all(client.clone()).list(&Default::default()).await.expect("list records");
    let starts = capo::release::countdowns::read(client, None).await.expect("read the countdowns");
    list.items
        .into_iter()
        .filter_map(|mut rec| {
            let ip = *names.get(&rec.name_any())?;
            capo::release::countdowns::overlay(&mut rec, &starts, &Default::default());
            Some((ip, rec))
        })
        .collect()
}

pub async fn delete_pod(client: &Client, ns: &str, name: &str) -> Result<(), kube::Error> {
    Api::<Pod>::namespaced(client.clone(), ns).delete(name, &DeleteParams::default()).await.map(|_| ())
}

/// Deletes a namespace and waits until the namespace controller has finished with it.
pub async fn delete_namespace_and_wait(client: &Client, name: &str) {
    use k8s_openapi::api::core::v1::Namespace;
    let namespaces = Api::<Namespace>::all(client.clone());
    namespaces.delete(name, &Default::default()).await.expect("delete namespace");
    eventually(&format!("namespace {name} to be gone"), Duration::from_secs(90), || {
        let namespaces = namespaces.clone();
        async move { namespaces.get_opt(name).await.ok()?.is_none().then_some(()) }
    })
    .await;
}

/// Installs the real CRDs of Argo CD (Application, AppProject), cert-manager (Certificate,
/// Issuer) and the Prometheus operator (ServiceMonitor, PrometheusRule), which
/// `hack/tools.sh` fetches from the Go module proxy, so manifests using them are checked
/// against their real schemas.
pub async fn install_third_party_crds() {
    static ONCE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    ONCE.get_or_init(|| async {
        let dir = std::env::var_os("CAPO_CRDS").map(std::path::PathBuf::from).unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache"));
            cache.join("capo/crds/current")
        });
        assert!(dir.join(".done").exists(), "{} missing: run `make tools` (make test does)", dir.display());
        let dir = std::fs::canonicalize(&dir).unwrap(); // kubectl does not follow a symlinked directory
        let (ok, out) =
            kubectl(&["apply", "--server-side", "--force-conflicts", "-f", dir.to_str().unwrap()], None).await;
        assert!(ok, "{out}");
        let crds = [
            "applications.argoproj.io",
            "appprojects.argoproj.io",
            "certificates.cert-manager.io",
            "issuers.cert-manager.io",
            "servicemonitors.monitoring.coreos.com",
            "prometheusrules.monitoring.coreos.com",
        ];
        let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        let names: Vec<String> = crds.iter().map(|c| format!("crd/{c}")).collect();
        args.extend(names.iter().map(String::as_str));
        let (ok, out) = kubectl(&args, None).await;
        assert!(ok, "{out}");
    })
    .await;
}

/// A free port on this machine's non-loopback address (Service endpoints may not be
/// loopback), for a capo reached through its Service (`capo_testenv::route`).
pub fn host_addr() -> std::net::SocketAddr {
    let ip = capo_testenv::route::host_ip().expect("this machine needs a non-loopback IPv4 address");
    let probe = std::net::TcpListener::bind((ip, 0)).expect("bind a port on the host address");
    probe.local_addr().unwrap()
}

/// A client that is ServiceAccount `capo-system/capo`, with its rights and nothing else.
pub async fn as_capo_service_account() -> Client {
    let mut config = capo_testenv::config_from_kubeconfig(&capo_testenv::shared().kubeconfig).await.unwrap();
    config.auth_info.impersonate = Some("system:serviceaccount:capo-system:capo".into());
    config.default_retry = true;
    Client::try_from(config).unwrap()
}

/// capo as the installed Deployment runs it (config/manager, the chart's defaults):
/// self-managed certificates in `capo-webhook-tls` for `capo.capo-system.svc`, injected
/// into the webhook configuration `capo`, the Lease `capo` in capo-system; it listens on
/// `addr`, and its leader releases only the policies whose name starts with `prefix`.
pub fn installed_settings(addr: std::net::SocketAddr, prefix: &str) -> Settings {
    Settings {
        webhook_addr: addr,
        probe_addr: None,
        tls: TlsSource::Managed(capo::certs::managed::ManagedSettings {
            secret: "capo-webhook-tls".into(),
            namespace: "capo-system".into(),
            hosts: capo::certs::managed::service_hosts("capo-system"),
            cert_validity: Duration::from_secs(90 * 86400),
            ca_validity: Duration::from_secs(5 * 365 * 86400),
        }),
        inject_ca_bundle: Some("capo".into()),
        self_register: None,
        calico_api: Some(CalicoApiGroup::CrdV1),
        calico_etcd: None,
        excluded_namespaces: vec!["capo-system".into(), "kube-system".into()],
        max_review_time: Duration::from_secs(10),
        limits: Default::default(),
        caller_auth: Default::default(),
        field_manager: "capo".into(),
        sync_timeout: Duration::from_secs(60),
        release: Some(capo::app::ReleaseSettings {
            election: Some(capo::leader::LeaderSettings {
                lease_name: "capo".into(),
                namespace: "capo-system".into(),
                identity: "installed".into(),
                duration: Duration::from_secs(3),
                grace: Duration::from_secs(1),
            }),
            engine: capo::release::EngineSettings {
                policy_prefix: Some(prefix.to_string()),
                namespace: "capo-system".into(),
                ..Default::default()
            },
            identity: "installed".into(),
        }),
        watch_failure_grace: Duration::from_secs(30),
    }
}

/// Runs the `capo` binary (an operator subcommand) against the test control plane;
/// returns its exit code, standard output and standard error.
pub async fn capo_cli(args: &[&str]) -> (i32, String, String) {
    capo_cli_as(&capo_testenv::shared().kubeconfig, args).await
}

/// [`capo_cli`] with another kubeconfig (another user).
pub async fn capo_cli_as(kubeconfig: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        // Where the tests' leaders keep their countdowns (EngineSettings' default).
        .env("POD_NAMESPACE", "default")
        .output()
        .await
        .expect("run capo");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A kubeconfig of the shared control plane that acts as `user`, and nothing more.
pub fn kubeconfig_as(user: &str) -> std::path::PathBuf {
    let mut kc: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&capo_testenv::shared().kubeconfig).unwrap()).unwrap();
    kc["users"][0]["user"]["as"] = user.into();
    let path = std::env::temp_dir().join(format!("capo-{user}.kubeconfig"));
    std::fs::write(&path, serde_saphyr::to_string(&kc).unwrap()).unwrap();
    path
}

/// The operator roles exactly as docs/operations.md ships them (config/rbac/operator_role.yaml),
/// applied with the Role in `capo_namespace`, and `user` bound to the ClusterRole and (if
/// `with_role`) the Role, as the docs' two `kubectl create …binding` lines do.
pub async fn documented_operator(user: &str, capo_namespace: &str, with_role: bool) -> std::path::PathBuf {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/config/rbac/operator_role.yaml");
    let (ok, out) =
        kubectl(&["apply", "--server-side", "--force-conflicts", "-n", capo_namespace, "-f", file], None).await;
    assert!(ok, "{out}");
    let binding = format!("capo-operator-{user}");
    let (ok, out) =
        kubectl(&["create", "clusterrolebinding", &binding, "--clusterrole", "capo-operator", "--user", user], None)
            .await;
    assert!(ok || out.contains("already exists"), "{out}");
    if with_role {
        let (ok, out) = kubectl(
            &["-n", capo_namespace, "create", "rolebinding", &binding, "--role", "capo-operator", "--user", user],
            None,
        )
        .await;
        assert!(ok || out.contains("already exists"), "{out}");
    }
    kubeconfig_as(user)
}

/// The core scenario: a Pod of `ns` with an IP is deleted; its IP is held (entry and
/// record) when the DELETE returns, and released by the leader once `policy`'s (short)
/// reserveFor has passed: the record goes, the entry leaves `capo-<policy>` (v1 group).
pub async fn holds_and_releases(admin: &Client, ns: &str, policy: &str, pod: &str) {
    let ip = Ips::v4();
    create_pod_with_ips(admin, ns, unscheduled_pod(pod, &[], &[]), &[ip]).await;
    delete_pod(admin, ns, pod).await.expect("held and allowed");
    assert!(record(admin, ip).await.is_some(), "{ip} recorded when the DELETE returned");
    let reservation_name = format!("capo-{policy}");
    let entries = reservation(admin, CalicoApiGroup::CrdV1, &reservation_name).await.unwrap_or_default();
    assert!(entries.contains(&cidr(ip)), "{ip} in {reservation_name} when the DELETE returned: {entries:?}");
    eventually(&format!("{ip} released"), Duration::from_secs(30), || async {
        record(admin, ip).await.is_none().then_some(())
    })
    .await;
    let entries = reservation(admin, CalicoApiGroup::CrdV1, &reservation_name).await.unwrap_or_default();
    assert!(!entries.contains(&cidr(ip)), "{ip} left {reservation_name}: {entries:?}");
}

/// A ValidatingAdmissionPolicy `name` (and its Deny binding) that refuses what
/// `match_constraints` matches unless `validation` holds: a server-side rule of the kind
/// Gatekeeper, Kyverno or a network team writes. It reaches the admission chain
/// asynchronously: wait until it refuses something before relying on it.
pub async fn deny_by_policy(
    client: &Client,
    name: &str,
    match_constraints: serde_json::Value,
    validation: serde_json::Value,
) {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": name },
        "spec": { "failurePolicy": "Fail", "matchConstraints": match_constraints, "validations": [validation] },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": name }, "spec": { "policyName": name, "validationActions": ["Deny"] },
    });
    let apply = PatchParams::apply("capo-tests").force();
    Api::<ValidatingAdmissionPolicy>::all(client.clone()).patch(name, &apply, &Patch::Apply(policy)).await.unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .patch(name, &apply, &Patch::Apply(binding))
        .await
        .unwrap();
}

/// Removes what [`deny_by_policy`] made.
pub async fn remove_policy(client: &Client, name: &str) {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).delete(name, &Default::default()).await.unwrap();
    Api::<ValidatingAdmissionPolicy>::all(client.clone()).delete(name, &Default::default()).await.unwrap();
}

/// capo's admission called directly (no webhook registration; caches that never synced,
/// for the test to fill) over the policies given by name and spec, with `client` for its
/// reads and writes; kube-system excluded.
pub fn standalone_admission<'a>(
    client: &Client,
    policies: impl IntoIterator<Item = (&'a str, serde_json::Value)>,
    max_review_time: Duration,
) -> capo::admission::Admission {
    let compiled = policies.into_iter().map(|(name, spec)| {
        let policy: CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": { "name": name }, "spec": spec,
        }))
        .unwrap();
        capo::policy::CompiledPolicy::compile(&policy).unwrap()
    });
    capo::admission::Admission::standalone(
        client.clone(),
        std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(capo::policy::Matcher::new(compiled))),
        CalicoApiGroup::CrdV1,
        capo::admission::AdmissionSettings {
            excluded_namespaces: vec!["kube-system".into(), "capo-system".into()],
            max_review_time,
            limits: Default::default(),
        },
    )
}

/// An AdmissionReview of the Pod `namespace/name`: `operation` by `user`, with `pod` as
/// its `object` (CREATE) or `oldObject` (DELETE), posted to capo's `path` as anybody who
/// can reach capo's port could post it.
pub fn pod_review_post(
    path: &str,
    operation: &str,
    namespace: &str,
    name: &str,
    user: &str,
    pod: serde_json::Value,
) -> axum::http::Request<axum::body::Body> {
    let field = if operation == "CREATE" { "object" } else { "oldObject" };
    let request = json!({
        "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "name": name, "namespace": namespace, "operation": operation, "userInfo": {"username": user},
        field: pod,
    });
    let review = json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request });
    axum::http::Request::post(format!("{path}?timeout=10s"))
        .header("content-type", "application/json")
        .body(axum::body::Body::from(serde_json::to_vec(&review).unwrap()))
        .unwrap()
}

/// Sends `req` to capo's `router` and returns the AdmissionReview it answers (200).
pub async fn send_review(router: &axum::Router, req: axum::http::Request<axum::body::Body>) -> serde_json::Value {
    use tower::ServiceExt;
    let resp = router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

//! Calico IPAM in the tests: Pods with Calico-assigned IPs, and the `capo-calico-ipam`
//! driver's commands (Calico's own IPAM library at v3.28.5, see docs/calico.md).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use super::eventually;

/// Asks capo-calico-ipam to give an unscheduled Pod IPs as if it ran on this node.
pub const IPAM_HOST_ANNOTATION: &str = "capo-test/ipam-host";
/// The Pod's IP families: `v4`, `v6` or `v4,v6` (kwok Pods without it: `v4`).
pub const IP_FAMILIES_ANNOTATION: &str = "capo-test/ip-families";
/// The node unscheduled Pods get their IPs on unless a test says otherwise.
pub const DEFAULT_IPAM_HOST: &str = "kwok-node-0";
/// The test environment's IP pools (capo-calico-ipam's defaults).
pub const V4_POOL: &str = "198.18.0.0/16";
pub const V6_POOL: &str = "2001:2:0:1::/112";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpFamilies {
    V4,
    V6,
    DualStack,
}

impl IpFamilies {
    pub fn annotation(self) -> &'static str {
        match self {
            Self::V4 => "v4",
            Self::V6 => "v6",
            Self::DualStack => "v4,v6",
        }
    }

    pub fn count(self) -> usize {
        if self == Self::DualStack { 2 } else { 1 }
    }
}

/// Creates `pod` (an [`super::unscheduled_pod`]) so that capo-calico-ipam gives it IPs from
/// Calico IPAM on `kwok-node-0` (CNI ADD, handle `k8s-pod-network.<uid>`) and phase
/// Running, and waits until they are in its status. Deleting the Pod releases them.
pub async fn create_pod_with_calico_ips(client: &Client, ns: &str, pod: Pod, families: IpFamilies) -> Pod {
    create_pod_with_calico_ips_on(client, ns, pod, families, DEFAULT_IPAM_HOST).await
}

/// [`create_pod_with_calico_ips`] on the given node.
pub async fn create_pod_with_calico_ips_on(
    client: &Client,
    ns: &str,
    mut pod: Pod,
    families: IpFamilies,
    host: &str,
) -> Pod {
    assert!(
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_none(),
        "an unscheduled Pod (a kwok node's Pods get Calico IPs anyway)"
    );
    let annotations = pod.annotations_mut();
    annotations.insert(IPAM_HOST_ANNOTATION.into(), host.into());
    annotations.insert(IP_FAMILIES_ANNOTATION.into(), families.annotation().into());
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let name = api.create(&PostParams::default(), &pod).await.expect("create pod").name_any();
    eventually(&format!("Calico IPs ({}) for pod {ns}/{name}", families.annotation()), Duration::from_secs(60), || {
        let api = api.clone();
        let name = name.clone();
        async move {
            let p = api.get(&name).await.ok()?;
            let s = p.status.as_ref()?;
            let running = s.phase.as_deref() == Some("Running");
            (running && s.pod_ips.as_ref().is_some_and(|ips| ips.len() == families.count())).then_some(p)
        }
    })
    .await
}

/// The `capo-calico-ipam` binary (built by `hack/build-calico-ipam.sh`).
pub fn driver_binary() -> PathBuf {
    capo_testenv::locate_calico_ipam().expect("capo-calico-ipam").join("bin/capo-calico-ipam")
}

/// What a `capo-calico-ipam` command printed and how it ended.
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `capo-calico-ipam <args>` against the API server of `kubeconfig` with `env`
/// (the etcd datastore's variables, say).
pub async fn driver(kubeconfig: &Path, args: &[&str], env: &[(String, String)]) -> Output {
    let out = tokio::process::Command::new(driver_binary())
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .envs(env.iter().cloned())
        .output()
        .await
        .expect("run capo-calico-ipam");
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Like [`driver`], failing the test unless the command succeeds.
pub async fn driver_ok(kubeconfig: &Path, args: &[&str], env: &[(String, String)]) -> String {
    let out = driver(kubeconfig, args, env).await;
    assert_eq!(out.code, 0, "capo-calico-ipam {args:?} failed:\n{}\n{}", out.stdout, out.stderr);
    out.stdout
}

/// `capo-calico-ipam oracle`: every address Calico's AutoAssign handed out, cycle by cycle.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OracleReport {
    pub host: String,
    pub cycles: usize,
    pub handed_out: Vec<Vec<IpAddr>>,
    pub blocks: Vec<String>,
    pub distinct: usize,
    pub reserved_at_start: usize,
    pub reserved_hits: Vec<serde_json::Value>,
    pub seconds: f64,
    pub assign_millis: Latency,
}

#[derive(Debug, Deserialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub max: f64,
}

pub async fn oracle(kubeconfig: &Path, host: &str, families: IpFamilies, cycles: usize) -> OracleReport {
    let cycles = cycles.to_string();
    let args = ["oracle", "--host", host, "--families", families.annotation(), "--cycles", &cycles];
    let out = driver_ok(kubeconfig, &args, &[]).await;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("oracle output: {e}\n{out}"))
}

/// `capo-calico-ipam assign`: one AutoAssign for `handle` on `host`.
#[derive(Debug, Deserialize)]
pub struct Assigned {
    pub ips: Vec<IpAddr>,
    pub blocks: Vec<String>,
}

pub async fn assign(kubeconfig: &Path, host: &str, handle: &str, num4: usize, env: &[(String, String)]) -> Assigned {
    let n = num4.to_string();
    let out = driver_ok(kubeconfig, &["assign", "--host", host, "--handle", handle, "--num4", &n], env).await;
    let a: Assigned = serde_json::from_str(&out).unwrap_or_else(|e| panic!("assign output: {e}\n{out}"));
    assert_eq!(a.ips.len(), num4, "{out}");
    a
}

pub async fn release(kubeconfig: &Path, handle: &str, env: &[(String, String)]) {
    driver_ok(kubeconfig, &["release", "--handle", handle], env).await;
}

/// `capo-calico-ipam check`: the IPReservations Calico's library sees.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeenReservation {
    pub name: String,
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(rename = "reservedCIDRs")]
    pub reserved_cidrs: Vec<String>,
}

pub async fn seen_by_calico(kubeconfig: &Path, env: &[(String, String)]) -> Vec<SeenReservation> {
    let out = driver_ok(kubeconfig, &["check"], env).await;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("check output: {e}\n{out}"))
}

/// A Node for Calico only (the Kubernetes datastore needs one per host): no kwok, so no
/// Pod runs there and nothing but the test assigns addresses on it.
pub async fn calico_host(client: &Client, name: &str) {
    let node: Node = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "capo-test": "calico-host" } },
        "spec": { "taints": [{ "key": "capo-test/calico-host", "effect": "NoSchedule" }] },
    }))
    .unwrap();
    match Api::<Node>::all(client.clone()).create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create Node {name}: {e}"),
    }
}

/// Writes a capo-style IPReservation (labelled as managed by capo) in `group` with exactly
/// `cidrs` (server-side apply, the way a test stands in for capo's webhook).
pub async fn write_reservation(client: &Client, group: capo_api::CalicoApiGroup, name: &str, cidrs: &[String]) {
    let api = Api::<DynamicObject>::all_with(client.clone(), &group.ip_reservation());
    let obj = json!({
        "apiVersion": group.api_version(),
        "kind": "IPReservation",
        "metadata": { "name": name, "labels": { "app.kubernetes.io/managed-by": "capo" } },
        "spec": { "reservedCIDRs": cidrs },
    });
    api.patch(name, &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj))
        .await
        .unwrap_or_else(|e| panic!("write IPReservation {name} ({}): {e}", group.api_version()));
}

/// `/32` or `/128`.
pub fn single(ip: IpAddr) -> String {
    super::cidr(ip)
}

/// A kwok node named `name` (created unless it exists), on which the IPAM driver serves
/// Pods: a test that needs its own node's blocks uses one.
pub async fn kwok_node(client: &Client, name: &str) {
    let node: Node = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "annotations": { capo_testenv::KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0" },
            "labels": { "type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux" },
        },
        "status": { "allocatable": { "cpu": "32", "memory": "256Gi", "pods": "110" },
                    "capacity": { "cpu": "32", "memory": "256Gi", "pods": "110" } },
    }))
    .unwrap();
    let nodes = Api::<Node>::all(client.clone());
    if nodes.get_opt(name).await.unwrap().is_none() {
        nodes.create(&PostParams::default(), &node).await.expect("create kwok node");
    }
}

/// One of Calico's CRDs as `../shared/calico/<dir>/<file>` defines it (v3.32.1: `v3.32.1`
/// for the `crd.projectcalico.org/v1` set, `projectcalico.org-v3` for the native one).
pub fn calico_crd(
    dir: &str,
    file: &str,
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/calico").join(dir).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A Calico kind of `group`, for a dynamic client.
pub fn resource(group: capo_api::CalicoApiGroup, kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: group.group().into(),
        version: group.version().into(),
        api_version: group.api_version(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// `ClusterInformation default` of `group` with `datastoreReady: ready`.
pub async fn set_datastore_ready(client: &Client, group: capo_api::CalicoApiGroup, ready: bool) {
    let api =
        Api::<DynamicObject>::all_with(client.clone(), &resource(group, "ClusterInformation", "clusterinformations"));
    let obj = json!({
        "apiVersion": group.api_version(), "kind": "ClusterInformation",
        "metadata": { "name": "default" },
        "spec": { "datastoreReady": ready, "clusterType": "k8s" },
    });
    api.patch("default", &PatchParams::apply("capo-tests").force(), &Patch::Apply(obj))
        .await
        .expect("write ClusterInformation default");
}

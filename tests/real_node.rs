//! capo against a real node: containerd and a real kubelet (built from the control plane's
//! own Kubernetes module) run the Pods, and Calico's own CNI plugin and IPAM (v3.28.5)
//! give them their addresses and take them back (see `capo_testenv::real_node`). What the
//! kwok nodes cannot show: a kubelet that really stops containers after the API server
//! marks a Pod deleted, Calico's CNI DEL freeing the address after capo held it, and a
//! recreated Pod wired by Calico's CNI ADD.
//!
//! The compatibility pass (`make test-compat`, `CAPO_SKIP_REAL_NODE=1`) skips these
//! tests, saying so: the real node's kubelet is built for the default Kubernetes only.

mod support;

use std::io::Read;
use std::net::{IpAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use capo_testenv::Calico;
use capo_testenv::real_node::{CAPO_IMAGE_REPOSITORY, LISTEN_IMAGE, REAL_NODE, cni_log};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::leading::{V1, release_settings, wait_metric, wait_released};
use support::plane::{PrivatePlane, private_plane_with_real_node};
use support::*;

/// One real node at a time: each test's machine-state checks must not see another's.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn skipped() -> bool {
    if std::env::var_os("CAPO_SKIP_REAL_NODE").is_some() {
        eprintln!("skipped: CAPO_SKIP_REAL_NODE is set (the compatibility pass runs no real node)");
        return true;
    }
    false
}

async fn prepare(client: &Client, ns: &str) {
    install_capo_crds(client).await;
    for name in ["capo-system", ns] {
        create_namespace(client, name).await;
    }
    // The canary through which start-up checks that the API server calls capo.
    create_pod_with_ips(client, ns, unscheduled_pod("canary", &[], &[]), &[Ips::v4()]).await;
}

/// Creates `name` and waits for its `default` ServiceAccount: beside the real node the API
/// server admits a Pod only once its ServiceAccount exists, as in any cluster.
async fn create_namespace(client: &Client, name: &str) {
    let obj: Namespace = serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap();
    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &obj).await;
    let accounts = Api::<ServiceAccount>::namespaced(client.clone(), name);
    eventually(&format!("{name}/default ServiceAccount"), Duration::from_secs(30), || {
        let accounts = accounts.clone();
        async move { accounts.get_opt("default").await.ok()?.map(|_| ()) }
    })
    .await;
}

/// A test's real node: its control plane (with the real node), an in-process capo that
/// serves the webhook for `ns` and leads (on Calico's etcd when the plane runs Calico
/// there), and the policy `<ns>-redis` over the Pods labelled `app: redis`.
struct Bench {
    plane: PrivatePlane,
    client: Client,
    capo: capo::App,
    policy: String,
}

async fn bench(name: &str, calico: Calico, ns: &str, reserve_for: &str) -> Bench {
    let plane = private_plane_with_real_node(name, calico);
    let client = plane.client().await;
    prepare(&client, ns).await;
    let mut settings = capo_settings(&format!("capo-{ns}"), &[ns], None);
    settings.calico_etcd = plane.calico_etcd.as_ref().map(support::etcd::etcd_config);
    settings.release = Some(release_settings(ns, "a", Duration::from_secs(600)));
    let capo = start_capo_on(&client, ns, "canary", settings).await;
    let policy = format!("{ns}-redis");
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": reserve_for });
    apply_policy(&client, &policy, ns, spec).await;
    Bench { plane, client, capo, policy }
}

/// A one-replica StatefulSet on the real node: capo's test workload, listening on 6379
/// and answering with its Pod's name, Ready when the kubelet's TCP probe reaches it.
fn redis_statefulset(name: &str) -> StatefulSet {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "nodeSelector": { "kubernetes.io/hostname": REAL_NODE },
                    "terminationGracePeriodSeconds": 5,
                    "enableServiceLinks": false,
                    "automountServiceAccountToken": false,
                    "containers": [{
                        "name": "listen",
                        "image": LISTEN_IMAGE,
                        "imagePullPolicy": "Never",
                        "env": [{ "name": "POD_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }],
                        "ports": [{ "containerPort": 6379, "name": "redis" }],
                        "readinessProbe": { "tcpSocket": { "port": 6379 }, "periodSeconds": 1 },
                    }],
                },
            },
        },
    }))
    .unwrap()
}

/// Waits until `name` is a Pod other than `not_uid`, Ready on the real node with an IP.
async fn wait_ready(client: &Client, ns: &str, name: &str, not_uid: Option<&str>) -> Pod {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    eventually(&format!("{ns}/{name} Ready on {REAL_NODE}"), Duration::from_secs(90), || {
        let api = api.clone();
        async move {
            let p = api.get_opt(name).await.ok()??;
            if not_uid.is_some_and(|u| p.uid().as_deref() == Some(u)) || p.metadata.deletion_timestamp.is_some() {
                return None;
            }
            let s = p.status.as_ref()?;
            let ready = s.conditions.as_ref()?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
            (ready && s.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())).then_some(p.clone())
        }
    })
    .await
}

/// What answers on `ip`:6379 (the workload writes its Pod's name), from this machine
/// through the route Calico's CNI plugin made.
fn who_answers(ip: IpAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&(ip, 6379).into(), Duration::from_secs(3))?;
    stream.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut out = String::new();
    stream.read_to_string(&mut out)?;
    Ok(out.trim().to_string())
}

/// The times (UTC) of the lines of Calico's CNI log that contain every one of `needles`.
fn cni_log_times(state_dir: &Path, needles: &[&str]) -> Vec<(Timestamp, String)> {
    let text = std::fs::read_to_string(cni_log(state_dir)).unwrap_or_default();
    text.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .filter_map(|l| {
            // "2026-11-27 08:20:01.123 [INFO][42] ...": local time, which is UTC here.
            let at = l.get(..23)?.replacen(' ', "T", 1) + "Z";
            Some((at.parse().ok()?, l.to_string()))
        })
        .collect()
}

/// The IPAM handle (`k8s-pod-network.<sandbox id>`) Calico's IPAM plugin assigned `ip`
/// under, from its log.
fn handle_assigned(state_dir: &Path, ip: IpAddr) -> Option<String> {
    let text = std::fs::read_to_string(cni_log(state_dir)).unwrap_or_default();
    let assigned = format!("IPAM assigned addresses IPv4=[{ip}/");
    text.lines().filter(|l| l.contains(&assigned)).find_map(|l| {
        let start = l.find("HandleID=\"")? + "HandleID=\"".len();
        Some(l[start..].split('"').next()?.to_string())
    })
}

/// The real path end to end: a StatefulSet Pod on the real node gets its address from
/// Calico's CNI ADD and answers on it; `kubectl delete pod` holds the address (in capo's
/// reservation when the DELETE returns, as the API server's audit log times it) before the
/// kubelet stops the containers and Calico's CNI DEL frees it (the CNI plugin's log times
/// that); the recreated Pod gets another address from Calico's CNI ADD and answers there;
/// the held one is released after `reserveFor`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pods_address_is_held_before_calicos_cni_del_and_the_new_pod_gets_another() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-holds";
    let Bench { plane, client, policy, capo: _capo } = bench("real-node-holds", Calico::Kubernetes, ns, "20s").await;

    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns);
    sets.create(&PostParams::default(), &redis_statefulset("redis")).await.unwrap();
    let first = wait_ready(&client, ns, "redis-0", None).await;
    let x = pod_ips(&first)[0];
    assert_eq!(first.spec.as_ref().unwrap().node_name.as_deref(), Some(REAL_NODE));
    assert_eq!(who_answers(x).unwrap(), "redis-0", "redis-0 answers on {x}, through Calico's route");
    let handle = handle_assigned(&plane.state_dir, x)
        .unwrap_or_else(|| panic!("Calico's IPAM plugin assigned {x} to redis-0:\n{}", cni_text(&plane)));
    assert!(handle.starts_with("k8s-pod-network."), "{handle}");

    Api::<Pod>::namespaced(client.clone(), ns).delete("redis-0", &DeleteParams::default()).await.unwrap();
    let rec = record(&client, x).await.expect("the record, when the DELETE returns");
    assert_eq!(rec.spec.pod.name, "redis-0");
    let entries = policy_entries(&client, V1, &policy).await;
    assert!(entries.contains(&cidr(x)), "{x} held when the DELETE returns: {entries:?}");
    let held_at = audit_hold_time(&plane, &cidr(x));

    let second = wait_ready(&client, ns, "redis-0", first.uid().as_deref()).await;
    let y = pod_ips(&second)[0];
    assert_ne!(y, x, "the recreated redis-0 was given another address");
    assert_eq!(who_answers(y).unwrap(), "redis-0");
    // Calico's CNI DEL released the old sandbox's handle, after capo held its address.
    let freed_at = cni_released_at(&plane, &handle);
    eprintln!("held at {held_at}, freed by Calico's CNI DEL at {freed_at}");
    assert!(held_at < freed_at, "held ({held_at}) before Calico freed it ({freed_at})");
    let entries = policy_entries(&client, V1, &policy).await;
    assert!(entries.contains(&cidr(x)), "{x} still held after Calico's CNI DEL: {entries:?}");

    eventually(&format!("{x} released after reserveFor"), Duration::from_secs(60), || async {
        (record(&client, x).await.is_none() && !policy_entries(&client, V1, &policy).await.contains(&cidr(x)))
            .then_some(())
    })
    .await;
    // The recreated Pod has lived through several of the IPAM driver's garbage collections
    // (every 2 s beside a real node): Calico's handle for it is still there, and it still
    // answers on its address.
    let handle_y = handle_assigned(&plane.state_dir, y).expect("Calico's IPAM plugin assigned y");
    let handles = Api::<kube::api::DynamicObject>::all_with(
        client.clone(),
        &kube::api::ApiResource {
            group: "crd.projectcalico.org".into(),
            version: "v1".into(),
            api_version: "crd.projectcalico.org/v1".into(),
            kind: "IPAMHandle".into(),
            plural: "ipamhandles".into(),
        },
    );
    assert!(handles.get_opt(&handle_y).await.unwrap().is_some(), "{handle_y} of the running redis-0 is kept");
    assert_eq!(who_answers(y).unwrap(), "redis-0", "the running redis-0 keeps {y}");
    drop(plane);
}

/// Issue 26 with Calico's real CNI plugin: with `sticky`, redis-0 deleted on the real node
/// comes back with the same address. capo's webhook named it in
/// `cni.projectcalico.org/ipAddrs`; Calico's CNI plugin asked its IPAM plugin for exactly
/// that address (its log says so), the kubelet started the Pod on it, it answers there, and
/// the hold ends (`reason="sticky"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sticky_calicos_cni_plugin_gives_the_recreated_pod_its_address_back() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-sticky";
    let Bench { plane, client, policy, capo } = bench("real-node-sticky", Calico::Kubernetes, ns, "10m").await;
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": "10m",
                       "sticky": { "enabled": true } });
    apply_policy(&client, &policy, ns, spec).await;

    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns);
    sets.create(&PostParams::default(), &redis_statefulset("redis")).await.unwrap();
    let first = wait_ready(&client, ns, "redis-0", None).await;
    let x = pod_ips(&first)[0];
    assert_eq!(who_answers(x).unwrap(), "redis-0");

    Api::<Pod>::namespaced(client.clone(), ns).delete("redis-0", &DeleteParams::default()).await.unwrap();
    assert!(record(&client, x).await.is_some(), "{x} held when the DELETE returns");
    let second = wait_ready(&client, ns, "redis-0", first.uid().as_deref()).await;
    assert_eq!(pod_ips(&second), vec![x], "the recreated redis-0 has its address back");
    let named = second.metadata.annotations.as_ref().and_then(|a| a.get("cni.projectcalico.org/ipAddrs"));
    assert_eq!(named.map(String::as_str), Some(format!("[\"{x}\"]").as_str()));
    let asked = cni_log_times(&plane.state_dir, &["Calico CNI IPAM request IP", &x.to_string()]);
    assert!(!asked.is_empty(), "Calico's CNI plugin asked its IPAM for {x}:\n{}", cni_text(&plane));
    assert_eq!(who_answers(x).unwrap(), "redis-0", "the new redis-0 answers on {x}");
    wait_released(&client, x, Duration::from_secs(30)).await;
    assert!(!policy_entries(&client, V1, &policy).await.contains(&cidr(x)), "the hold ended");
    let sticky = format!("capo_releases_total{{policy=\"{policy}\",reason=\"sticky\"}}");
    assert_eq!(wait_metric(&capo, &sticky, 1.0).await, 1.0);
    drop(plane);
}

/// When the API server answered the write that put `entry` into a capo reservation.
fn audit_hold_time(plane: &PrivatePlane, entry: &str) -> Timestamp {
    audit_time(plane, "ipreservations", entry)
}

/// When the API server first answered a write to `resource` whose body contains `needle`.
fn audit_time(plane: &PrivatePlane, resource: &str, needle: &str) -> Timestamp {
    plane
        .audit()
        .into_iter()
        .filter(|e| e.ok() && e.resource == resource && e.request.to_string().contains(needle))
        .map(|e| e.at)
        .min()
        .unwrap_or_else(|| panic!("no write to {resource} with {needle} in the audit log"))
}

/// The first time Calico's CNI log says it released `handle` (CNI DEL).
fn cni_released_at(plane: &PrivatePlane, handle: &str) -> Timestamp {
    let released = cni_log_times(&plane.state_dir, &["Releasing address using handleID", handle]);
    let (at, line) =
        released.first().cloned().unwrap_or_else(|| panic!("Calico's CNI DEL released {handle}:\n{}", cni_text(plane)));
    eprintln!("Calico's CNI DEL: {line}");
    at
}

fn cni_text(plane: &PrivatePlane) -> String {
    std::fs::read_to_string(cni_log(&plane.state_dir)).unwrap_or_default()
}

/// The same path with Calico on its etcd datastore (a kubeasz-style cluster): the CNI
/// plugin assigns from and frees to Calico's etcd, and capo holds there: the address is in
/// capo's reservation in etcd, and its record written, before Calico's CNI DEL frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_calicos_etcd_the_address_is_held_in_etcd_before_calicos_cni_del() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-etcd";
    let Bench { plane, client, capo, policy: _ } = bench("real-node-etcd", Calico::Etcd, ns, "10m").await;
    assert_eq!(capo.calico_api, capo_api::CalicoApiGroup::V3, "capo holds in Calico's etcd");
    let etcd = plane.calico_etcd.clone().expect("Calico's etcd");
    let http = support::etcd::etcd_http(&etcd, true);
    // Its writes to Calico's etcd are not in the API server's audit log: the test sees the
    // hold in etcd right after the DELETE returns, and a preStop sleep keeps the kubelet
    // from stopping the Pod (and Calico's CNI DEL from running) within 2 s of the deletion.
    let mut set = redis_statefulset("redis");
    let container = &mut set.spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
    container.lifecycle = Some(serde_json::from_value(json!({ "preStop": { "sleep": { "seconds": 2 } } })).unwrap());
    Api::<StatefulSet>::namespaced(client.clone(), ns).create(&PostParams::default(), &set).await.unwrap();
    let first = wait_ready(&client, ns, "redis-0", None).await;
    let x = pod_ips(&first)[0];
    assert_eq!(who_answers(x).unwrap(), "redis-0");
    let handle = handle_assigned(&plane.state_dir, x)
        .unwrap_or_else(|| panic!("Calico's IPAM plugin assigned {x}:\n{}", cni_text(&plane)));
    let key = format!("/calico/ipam/v2/handle/{handle}");
    assert!(
        !support::etcd::etcd_range(&http, &etcd, &key).await.is_empty(),
        "Calico's CNI plugin keeps its handle in Calico's etcd ({key})"
    );

    Api::<Pod>::namespaced(client.clone(), ns).delete("redis-0", &DeleteParams::default()).await.unwrap();
    assert!(held_in_etcd(&http, &etcd, x).await, "{x} in capo's reservation in Calico's etcd when the DELETE returns");
    let seen_at = Timestamp::now();
    let second = wait_ready(&client, ns, "redis-0", first.uid().as_deref()).await;
    assert_ne!(pod_ips(&second)[0], x);
    let freed_at = cni_released_at(&plane, &handle);
    eprintln!("seen held in etcd at {seen_at}, freed by Calico's CNI DEL at {freed_at}");
    assert!(seen_at < freed_at, "held ({seen_at}) before Calico freed it ({freed_at})");
    assert!(held_in_etcd(&http, &etcd, x).await, "{x} still held after Calico's CNI DEL");
}

/// Whether `ip` is in one of capo's reservations in Calico's etcd.
async fn held_in_etcd(http: &reqwest::Client, etcd: &capo_testenv::CalicoEtcd, ip: IpAddr) -> bool {
    support::etcd::etcd_range(http, etcd, support::etcd::RESERVATIONS_KEY)
        .await
        .into_iter()
        .any(|(_, v)| String::from_utf8_lossy(&v).contains(&format!("\"{}\"", cidr(ip))))
}

/// What a real node could leave behind on this machine: mounts, network interfaces and
/// routes, processes of the runtime and the Pods, cgroups, host paths containerd, the
/// kubelet and Calico's CNI plugin use by default, and forwarding sysctls.
#[derive(Debug, PartialEq, Eq)]
struct Machine {
    mounts: Vec<String>,
    links: Vec<String>,
    addresses: Vec<String>,
    routes: Vec<String>,
    processes: Vec<String>,
    cgroups: Vec<String>,
    paths: Vec<String>,
    sysctls: Vec<String>,
}

impl Machine {
    fn fields(&self) -> [(&'static str, &Vec<String>); 8] {
        [
            ("mounts", &self.mounts),
            ("links", &self.links),
            ("addresses", &self.addresses),
            ("routes", &self.routes),
            ("processes", &self.processes),
            ("cgroups", &self.cgroups),
            ("paths", &self.paths),
            ("sysctls", &self.sysctls),
        ]
    }

    /// What `self` has that `before` had not (+), and the reverse (-), field by field.
    fn diff(&self, before: &Machine) -> String {
        let mut out = String::new();
        for ((name, now), (_, then)) in self.fields().into_iter().zip(before.fields()) {
            let added: Vec<&String> = now.iter().filter(|x| !then.contains(x)).collect();
            let gone: Vec<&String> = then.iter().filter(|x| !now.contains(x)).collect();
            if !added.is_empty() || !gone.is_empty() || now.len() != then.len() {
                out.push_str(&format!("\n{name}: +{added:?} -{gone:?} ({} → {})", then.len(), now.len()));
            }
        }
        out
    }
}

/// Whether a `/proc/<pid>/stat` line is a zombie's: its state follows the command name,
/// which is in parentheses and may itself contain spaces or parentheses.
fn zombie(stat: &str) -> bool {
    stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
}

fn machine() -> Machine {
    let lines = |path: &str| -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_string).collect();
        v.sort();
        v
    };
    let names = |path: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(path)
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        v.sort();
        v
    };
    let mut mounts: Vec<String> =
        lines("/proc/self/mountinfo").iter().filter_map(|l| l.split(' ').nth(4).map(str::to_string)).collect();
    mounts.sort();
    // The real node's own programs, by their exact names (a command name is cut at 15
    // characters: containerd-shim-runc-v2 shows as containerd-shim). Other test binaries
    // run beside this one (make test runs several at once) with programs of their own,
    // calico-apiserver among them, which start and stop as they please.
    let programs = ["kubelet", "containerd", "containerd-shim", "runc", "pause", "listen", "calico", "calico-ipam"];
    let mut processes: Vec<String> = names("/proc")
        .into_iter()
        .filter(|p| p.parse::<u32>().is_ok())
        // A killed process whose parent has not reaped it yet (a zombie) holds nothing but
        // its pid: the shims and containers SIGKILLed by the clean-up are reparented to
        // init, which reaps them when it gets to it.
        .filter(|p| !std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| zombie(&s)))
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| programs.contains(&c.as_str()))
        .collect();
    processes.sort();
    let cgroups = lines("/proc/self/mountinfo")
        .iter()
        .filter(|l| l.contains(" - cgroup"))
        .filter_map(|l| l.split(' ').nth(4))
        .flat_map(|m| names(m).into_iter().map(move |n| format!("{m}/{n}")))
        .filter(|p| std::path::Path::new(p).is_dir())
        .collect();
    let paths = [
        "/run/containerd",
        "/var/lib/containerd",
        "/var/lib/kubelet",
        "/var/log/pods",
        "/var/log/containers",
        "/run/calico",
        "/var/lib/calico",
        "/var/log/calico",
        "/etc/cni",
        "/opt/cni",
        "/run/netns",
        "/var/run/netns",
        "/run/nri",
        "/etc/containerd",
    ]
    .iter()
    .filter(|p| std::path::Path::new(p).exists())
    .map(|p| p.to_string())
    .collect();
    let sysctls = ["net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding"]
        .iter()
        .map(|s| format!("{s}={}", std::fs::read_to_string(format!("/proc/sys/{s}")).unwrap_or_default().trim()))
        .collect();
    // "<interface> <address>/<prefix>" of every address, from `ip -o addr`.
    let out = std::process::Command::new("ip").args(["-o", "addr", "show"]).output().expect("ip -o addr show");
    let mut addresses: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(format!("{} {}", f.get(1)?, f.get(3)?))
        })
        .collect();
    addresses.sort();
    Machine {
        mounts,
        links: names("/sys/class/net"),
        addresses,
        routes: [lines("/proc/net/route"), lines("/proc/net/ipv6_route")].concat(),
        processes,
        cgroups,
        paths,
        sysctls,
    }
}

/// A real node with a Pod running leaves nothing behind once its control plane stops,
/// whether it stops in order (as `capo-testenv down` stops its supervisor, or a test's
/// plane is dropped) or its supervisor was killed and only the clean-up runs
/// (`capo-testenv down` after a SIGKILL, the sweep of a crashed test binary's state):
/// no mount, interface, address, route, process, cgroup, host path or sysctl differs from
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_node_leaves_the_machine_as_it_found_it() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    for killed in [false, true] {
        let before = machine();
        let plane = private_plane_with_real_node(
            if killed { "real-node-killed" } else { "real-node-stopped" },
            Calico::Kubernetes,
        );
        let client = plane.client().await;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": "listen" },
            "spec": redis_statefulset("listen").spec.unwrap().template.spec,
        }))
        .unwrap();
        Api::<Pod>::namespaced(client.clone(), "default").create(&PostParams::default(), &pod).await.unwrap();
        let pod = wait_ready(&client, "default", "listen", None).await;
        assert_eq!(who_answers(pod_ips(&pod)[0]).unwrap(), "listen");
        let during = machine();
        assert_ne!(during.links, before.links, "the Pod's interface is on the machine while it runs");
        assert_ne!(during.mounts, before.mounts, "the Pod's root filesystem is mounted while it runs");
        if killed {
            // What `capo-testenv down` does when its supervisor is gone: the clean-up alone,
            // with every process still running.
            capo_testenv::real_node::clean(&plane.state_dir);
        }
        drop(plane);
        let after = machine();
        assert!(after == before, "the machine after the real node (killed: {killed}) differs: {}", after.diff(&before));
    }
}

/// A kubelet restart is not a deletion: the running Pod keeps its sandbox and address and
/// capo holds nothing; a deletion after the restart is held as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_holds_nothing_and_deletions_after_it_are_held() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-restart";
    let Bench { plane, client, policy, capo: _capo } = bench("real-node-restart", Calico::Kubernetes, ns, "10m").await;
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &redis_statefulset("redis"))
        .await
        .unwrap();
    let pod = wait_ready(&client, ns, "redis-0", None).await;
    let x = pod_ips(&pod)[0];

    plane.restart("kubelet").await;
    // The kubelet is back when it reports the Node Ready again after its restart, and has
    // looked at the Pod (its Ready condition is probed anew).
    let restarted = eventually("the restarted kubelet to report its Pod", Duration::from_secs(60), || async {
        let p = Api::<Pod>::namespaced(client.clone(), ns).get("redis-0").await.ok()?;
        let s = p.status.clone()?;
        let ready = s.conditions?.into_iter().find(|c| c.type_ == "Ready" && c.status == "True")?;
        (ready.last_transition_time? > pod.status.as_ref()?.start_time.clone()?).then_some(p)
    })
    .await;
    assert_eq!(restarted.uid(), pod.uid(), "the same Pod");
    assert_eq!(pod_ips(&restarted), vec![x], "the same address");
    assert_eq!(who_answers(x).unwrap(), "redis-0");
    assert!(record(&client, x).await.is_none(), "a kubelet restart holds nothing");
    assert!(policy_entries(&client, V1, &policy).await.is_empty());

    Api::<Pod>::namespaced(client.clone(), ns).delete("redis-0", &DeleteParams::default()).await.unwrap();
    assert!(record(&client, x).await.is_some(), "{x} held when the DELETE returns, after the restart");
    assert!(policy_entries(&client, V1, &policy).await.contains(&cidr(x)));
    let again = wait_ready(&client, ns, "redis-0", pod.uid().as_deref()).await;
    assert_ne!(pod_ips(&again)[0], x);
}

/// `kubectl drain` of the real node: the StatefulSet's Pods are evicted one at a time
/// through their PodDisruptionBudget (the eviction API, as drain calls it), each address is
/// held with the trigger `Eviction` when its eviction is admitted, and the Pods come back
/// on the other (kwok) node with other addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_real_node_holds_each_evicted_pods_address() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-drain";
    let Bench { plane, client, policy, capo: _capo } = bench("real-node-drain", Calico::Kubernetes, ns, "10m").await;
    let mut set = redis_statefulset("redis");
    let spec = set.spec.as_mut().unwrap();
    spec.replicas = Some(2);
    spec.pod_management_policy = Some("Parallel".into());
    // Template changes reach a Pod only when it is recreated (here: after its eviction).
    spec.update_strategy = Some(serde_json::from_value(json!({ "type": "OnDelete" })).unwrap());
    Api::<StatefulSet>::namespaced(client.clone(), ns).create(&PostParams::default(), &set).await.unwrap();
    let pdb = json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": { "name": "redis", "namespace": ns },
        "spec": { "maxUnavailable": 1, "selector": { "matchLabels": { "app": "redis" } } },
    });
    let (ok, out) = kubectl_on(&plane, &["apply", "-f", "-"], Some(&pdb.to_string())).await;
    assert!(ok, "{out}");
    let mut before = vec![];
    for name in ["redis-0", "redis-1"] {
        let p = wait_ready(&client, ns, name, None).await;
        assert_eq!(p.spec.as_ref().unwrap().node_name.as_deref(), Some(REAL_NODE), "{name} starts on the real node");
        before.push((name, p.uid().unwrap(), pod_ips(&p)[0]));
    }
    // Once evicted, a Pod may come back on any node (the kwok node, the real one being
    // cordoned by the drain).
    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns);
    let unpin = json!({ "spec": { "template": { "spec": { "nodeSelector": null } } } });
    sets.patch("redis", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&unpin)).await.unwrap();

    let (ok, out) = kubectl_on(
        &plane,
        &[
            "drain",
            REAL_NODE,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--pod-selector=app=redis",
            "--timeout=120s",
        ],
        None,
    )
    .await;
    assert!(ok, "kubectl drain: {out}");
    for (name, uid, ip) in &before {
        let rec = record(&client, *ip).await.unwrap_or_else(|| panic!("{ip} of {name} held"));
        assert_eq!(rec.spec.pod.name, *name);
        assert_eq!(rec.spec.trigger, capo_api::HoldTrigger::Eviction, "{name} was evicted");
        let again = wait_ready(&client, ns, name, Some(uid)).await;
        assert_ne!(again.spec.as_ref().unwrap().node_name.as_deref(), Some(REAL_NODE), "{name} moved off the node");
        assert_ne!(pod_ips(&again)[0], *ip);
    }
    let entries = policy_entries(&client, V1, &policy).await;
    for (_, _, ip) in &before {
        assert!(entries.contains(&cidr(*ip)), "{ip} in {entries:?}");
    }
}

/// kubectl against `plane`.
async fn kubectl_on(plane: &PrivatePlane, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    kubectl_with(&plane.kubeconfig, args, stdin).await
}

/// capo from its own image (`hack/build-image.sh`), installed by its Helm chart onto the
/// real node as a platform team would: two replicas run as the chart's non-root user with
/// its ServiceAccount, RBAC, probes and self-managed certificate; they reach the API server
/// at the `kubernetes` Service, one leads through the Lease, and the API server calls the
/// webhook through the chart's Service at the Pods' addresses. A StatefulSet Pod deleted
/// with kubectl is held by the webhook; the leader Pod deleted, the other replica takes the
/// Lease and releases the hold after `reserveFor`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_runs_capos_image_on_the_real_node_and_the_api_server_calls_it_through_its_service() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-chart";
    let plane = private_plane_with_real_node("real-node-chart", Calico::Kubernetes);
    let client = plane.client().await;
    create_namespace(&client, ns).await;
    create_namespace(&client, "capo-system").await;
    helm_install(&plane, &["replicaCount=2"]);
    let replicas = wait_capo_ready(&plane, &client, 2).await;
    let leader = lease_holder(&client).await;
    assert!(replicas.contains(&leader), "the Lease is held by one of {replicas:?}: {leader}");

    let (policy, x) = deletion_held(&plane, &client, ns, "40s").await;
    let reserved_at = record(&client, x).await.expect("held").spec.reserved_at.0;

    // The leader goes; the other replica leads and releases the hold on time.
    Api::<Pod>::namespaced(client.clone(), "capo-system").delete(&leader, &DeleteParams::default()).await.unwrap();
    let next = eventually("another capo Pod to hold the Lease", Duration::from_secs(60), || async {
        let holder = lease_holder(&client).await;
        (holder != leader && !holder.is_empty()).then_some(holder)
    })
    .await;
    assert!(replicas.contains(&next), "{next} is the other replica of {replicas:?}");
    let released = eventually(&format!("{x} released after reserveFor by {next}"), Duration::from_secs(90), || async {
        (record(&client, x).await.is_none() && !policy_entries(&client, V1, &policy).await.contains(&cidr(x)))
            .then(Timestamp::now)
    })
    .await;
    // The countdown starts when the Pod is gone, after the hold was written: never sooner.
    let held_for = released.duration_since(reserved_at).as_secs_f64();
    assert!(held_for >= 40.0 - 0.05, "released {held_for:.2}s after it was held, before reserveFor (40s)");
    drop(plane);
}

/// The path every install must give, on the real node: a policy `<ns>-redis` Ready (its
/// status written by the leader Pod), a StatefulSet Pod `redis-0` deleted with kubectl,
/// its address held by the webhook when the DELETE returns (in capo's reservation: in the
/// API server, or in Calico's etcd when the plane runs Calico there), and the recreated
/// Pod given another address. Returns the policy and the held address.
async fn deletion_held(plane: &PrivatePlane, client: &Client, ns: &str, reserve_for: &str) -> (String, IpAddr) {
    let policy = format!("{ns}-redis");
    let spec = json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "reserveFor": reserve_for });
    apply_policy(client, &policy, ns, spec).await;
    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns);
    sets.create(&PostParams::default(), &redis_statefulset("redis")).await.unwrap();
    let first = wait_ready(client, ns, "redis-0", None).await;
    let x = pod_ips(&first)[0];

    let (ok, text) =
        kubectl_with(&plane.kubeconfig, &["-n", ns, "delete", "pod", "redis-0", "--wait=false"], None).await;
    assert!(ok, "kubectl delete pod: {text}");
    let rec = record(client, x).await.expect("the record, when the DELETE returns");
    assert_eq!(rec.spec.trigger, capo_api::HoldTrigger::Delete, "held by the webhook, called through the Service");
    match &plane.calico_etcd {
        Some(etcd) => {
            let http = support::etcd::etcd_http(etcd, true);
            assert!(held_in_etcd(&http, etcd, x).await, "{x} in capo's reservation in Calico's etcd");
        }
        None => {
            let entries = policy_entries(client, V1, &policy).await;
            assert!(entries.contains(&cidr(x)), "{x} in capo's reservation: {entries:?}");
        }
    }
    let second = wait_ready(client, ns, "redis-0", first.uid().as_deref()).await;
    assert_ne!(pod_ips(&second)[0], x, "the recreated redis-0 was given another address");
    (policy, x)
}

/// `config/default` (and, for Calico's etcd, the `config/calico-etcd` component) applied
/// with kubectl through an overlay as a platform team writes one: capo's own image, the
/// real node, `replicas` replicas; on Calico's etcd, the ConfigMap and Secret the
/// component reads, from the plane's etcd.
async fn kustomize_install(plane: &PrivatePlane, client: &Client, replicas: u32) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let overlay = plane.state_dir.join("overlay");
    std::fs::create_dir_all(&overlay).unwrap();
    // kustomize takes no absolute paths: the way up from the overlay to `/`, then down.
    let up = "../".repeat(overlay.components().count() - 1);
    let from_overlay = |dir: &str| format!("{up}{}", config.join(dir).strip_prefix("/").unwrap().display());
    let components = match plane.calico_etcd {
        Some(_) => format!("components: [{}]\n", from_overlay("calico-etcd")),
        None => String::new(),
    };
    let kustomization = format!(
        r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{default}]
{components}images: [{{name: ghcr.io/capo-io/capo, newName: {CAPO_IMAGE_REPOSITORY}, newTag: {tag}}}]
patches:
- patch: |-
    apiVersion: apps/v1
    kind: Deployment
    metadata: {{name: capo, namespace: capo-system}}
    spec:
      replicas: {replicas}
      template:
        spec:
          nodeSelector: {{type: real}}
          containers: [{{name: capo, imagePullPolicy: Never}}]
"#,
        default = from_overlay("default"),
        tag = env!("CARGO_PKG_VERSION"),
    );
    std::fs::write(overlay.join("kustomization.yaml"), kustomization).unwrap();
    create_namespace(client, "capo-system").await;
    if let Some(etcd) = &plane.calico_etcd {
        let endpoints = etcd.pod_endpoints.clone().expect("Calico's etcd, reachable from the real node's Pods");
        let literal = format!("--from-literal=etcd_endpoints={endpoints}");
        let args = ["-n", "capo-system", "create", "configmap", "capo-calico-etcd", &literal];
        let (ok, text) = kubectl_with(&plane.kubeconfig, &args, None).await;
        assert!(ok, "the ConfigMap: {text}");
        calico_etcd_secret(plane, etcd).await;
    }
    let args = ["kustomize", "--load-restrictor=LoadRestrictionsNone", overlay.to_str().unwrap()];
    let (ok, rendered) = kubectl_with(&plane.kubeconfig, &args, None).await;
    assert!(ok, "kubectl kustomize: {rendered}");
    let (ok, text) = kubectl_with(&plane.kubeconfig, &["apply", "--server-side", "-f", "-"], Some(&rendered)).await;
    assert!(ok, "kubectl apply: {text}");
}

/// Calico's own Secret layout (`calico-etcd-secrets`: `etcd-ca`, `etcd-cert`, `etcd-key`)
/// in `capo-system`, from the plane's etcd client certificate.
async fn calico_etcd_secret(plane: &PrivatePlane, etcd: &capo_testenv::CalicoEtcd) {
    let from = |key: &str, path: &Path| format!("--from-file={key}={}", path.display());
    let (ca, cert, key) =
        (from("etcd-ca", &etcd.ca_cert_file), from("etcd-cert", &etcd.cert_file), from("etcd-key", &etcd.key_file));
    let args = ["-n", "capo-system", "create", "secret", "generic", "calico-etcd-secrets", &ca, &cert, &key];
    let (ok, text) = kubectl_with(&plane.kubeconfig, &args, None).await;
    assert!(ok, "the Secret: {text}");
}

/// `config/default` applied with kubectl (kustomize) onto the real node: the same Pods,
/// Service, RBAC and certificates as the chart's, two replicas, one leading; a deletion
/// held through the Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_default_by_kustomize_runs_capo_on_the_real_node_and_holds() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-kustomize";
    let plane = private_plane_with_real_node("real-node-kustomize", Calico::Kubernetes);
    let client = plane.client().await;
    create_namespace(&client, ns).await;
    kustomize_install(&plane, &client, 2).await;
    let replicas = wait_capo_ready(&plane, &client, 2).await;
    let leader = lease_holder(&client).await;
    assert!(replicas.contains(&leader), "the Lease is held by one of {replicas:?}: {leader}");
    deletion_held(&plane, &client, ns, "10m").await;
    drop(plane);
}

/// `config/default` with the `config/calico-etcd` component onto the real node, Calico on
/// its etcd: capo runs as its non-root user, reads Calico's etcd client key, and holds in
/// Calico's etcd. (With the key mounted 0400 and no `fsGroup`, as before the trust fix,
/// capo stops at once: `reading the etcd CA /calico-secrets/etcd-ca: Permission denied`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_calico_etcd_by_kustomize_runs_capo_as_its_non_root_user_and_holds_in_etcd() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-kustomize-etcd";
    let plane = private_plane_with_real_node("real-node-kustomize-etcd", Calico::Etcd);
    let client = plane.client().await;
    create_namespace(&client, ns).await;
    kustomize_install(&plane, &client, 1).await;
    wait_capo_ready(&plane, &client, 1).await;
    deletion_held(&plane, &client, ns, "10m").await;
    drop(plane);
}

/// capo's Helm chart installed as release `capo` in `capo-system` with capo's own image,
/// onto the real node, with `sets` (`--set` values) on top.
fn helm_install(plane: &PrivatePlane, sets: &[&str]) {
    let image = format!(
        "image.repository={CAPO_IMAGE_REPOSITORY},image.tag={},image.pullPolicy=Never",
        env!("CARGO_PKG_VERSION")
    );
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/capo");
    let mut helm = std::process::Command::new(helm());
    helm.args(["install", "capo", chart.to_str().unwrap(), "-n", "capo-system", "--kubeconfig"])
        .arg(&plane.kubeconfig)
        .args(["--set", &image, "--set", "nodeSelector.type=real,logFormat=text"]);
    for set in sets {
        helm.args(["--set", set]);
    }
    let out = helm.output().unwrap();
    assert!(out.status.success(), "helm install: {}", String::from_utf8_lossy(&out.stderr));
}

/// capo's chart with `calico.datastore: etcdv3`, as on a kubeasz-style cluster: capo runs
/// as the chart's non-root user (65532), reads Calico's etcd client certificate and key
/// from Calico's own Secret layout (`calico-etcd-secrets`: `etcd-ca`, `etcd-cert`,
/// `etcd-key`), and a StatefulSet Pod deleted on the real node is held in capo's
/// reservation in Calico's etcd when the DELETE returns. With the key mounted 0400 and no
/// `fsGroup` (the manifests before the trust fix), capo cannot read its key and never
/// becomes Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_on_calicos_etcd_runs_capo_as_its_non_root_user_and_holds_in_etcd() {
    if skipped() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let ns = "real-chart-etcd";
    let plane = private_plane_with_real_node("real-node-chart-etcd", Calico::Etcd);
    let client = plane.client().await;
    create_namespace(&client, ns).await;
    create_namespace(&client, "capo-system").await;
    let etcd = plane.calico_etcd.clone().expect("Calico's etcd");
    let endpoints = etcd.pod_endpoints.clone().expect("Calico's etcd, reachable from the real node's Pods");
    calico_etcd_secret(&plane, &etcd).await;
    helm_install(&plane, &["replicaCount=1", "calico.datastore=etcdv3", &format!("calico.etcd.endpoints={endpoints}")]);
    let replicas = wait_capo_ready(&plane, &client, 1).await;
    let pod = Api::<Pod>::namespaced(client.clone(), "capo-system").get(&replicas[0]).await.unwrap();
    let user = pod.spec.as_ref().and_then(|s| s.security_context.as_ref()).and_then(|c| c.run_as_user);
    assert_eq!(user, Some(65532), "capo runs as the chart's non-root user");

    deletion_held(&plane, &client, ns, "10m").await;
    drop(plane);
}

/// The holder of capo's Lease (`capo-system/capo`), or "" while none.
async fn lease_holder(client: &Client) -> String {
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), "capo-system");
    let lease = leases.get_opt("capo").await.ok().flatten();
    lease.and_then(|l| l.spec).and_then(|s| s.holder_identity).unwrap_or_default()
}

/// Waits until the Deployment `capo-system/capo` has `n` Ready Pods on the real node and
/// returns their names; on timeout, panics with the Pods, their Events and their logs.
async fn wait_capo_ready(plane: &PrivatePlane, client: &Client, n: usize) -> Vec<String> {
    let pods = Api::<Pod>::namespaced(client.clone(), "capo-system");
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    loop {
        let list = pods.list(&Default::default()).await.unwrap();
        let ready: Vec<String> = list
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(REAL_NODE))
            .filter(|p| {
                let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
                conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .map(|p| p.name_any())
            .collect();
        if ready.len() == n {
            return ready;
        }
        if std::time::Instant::now() > deadline {
            let k = &plane.kubeconfig;
            let (_, pods) = kubectl_with(k, &["-n", "capo-system", "get", "pods", "-o", "wide"], None).await;
            let (_, events) = kubectl_with(k, &["-n", "capo-system", "get", "events"], None).await;
            let (_, logs) =
                kubectl_with(k, &["-n", "capo-system", "logs", "-l", "app.kubernetes.io/name=capo", "--tail=40"], None)
                    .await;
            panic!("{n} capo Pods Ready on {REAL_NODE} within 180 s:\n{pods}\n{events}\n{logs}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

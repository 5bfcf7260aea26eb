//! The Helm chart (`charts/capo`): rendered by a real helm (built by `hack/tools.sh`),
//! it grants the same RBAC and registers the same webhooks as the kustomize manifests,
//! carries no caBundle, validates its values, passes a server-side dry run with default
//! values and with every option on, and its README is generated from `values.yaml`
//! (`make chart-readme`).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use support::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{cmd:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

fn template(args: &[&str]) -> String {
    run(Command::new(helm())
        .args(["template", "capo", repo("charts/capo").to_str().unwrap(), "-n", "capo-system"])
        .args(args))
}

const EVERY_OPTION: &[&str] = &[
    "--set",
    "metrics.serviceMonitor.enabled=true,metrics.prometheusRule.enabled=true,metrics.grafanaDashboard.enabled=true",
    "--set",
    "certificates.mode=secret,webhook.excludedNamespaces={redis-system},webhook.failurePolicy=Fail",
    "--set",
    "networkPolicy.enabled=true",
    "--set",
    "webhook.auth.clientCASecret=capo-webhook-client-ca,webhook.auth.tokenSecret=capo-webhook-token",
    "--set-json",
    r#"ownerKinds=[{"apiGroup":"apps.kruise.io","resources":["statefulsets","clonesets"]}]"#,
];

/// The RBAC objects of a rendering, by kind and name, with their rules.
fn rbac(docs: &[Value]) -> Vec<(String, String, Value)> {
    let mut out: Vec<_> = docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRole" || d["kind"] == "Role")
        .map(|d| {
            (
                d["kind"].as_str().unwrap().to_string(),
                d["metadata"]["name"].as_str().unwrap().to_string(),
                d["rules"].clone(),
            )
        })
        .collect();
    out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    out
}

fn docs(yaml: &str) -> Vec<Value> {
    yaml.split("\n---")
        .filter_map(|d| serde_saphyr::from_str::<Value>(d).ok())
        .filter(|v| v.get("kind").is_some())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter().find(|d| d["kind"] == kind && d["metadata"]["name"] == name).unwrap_or_else(|| panic!("{kind}/{name}"))
}

/// The parts of a webhook both installs must agree on.
fn webhook_contract(w: &Value) -> Value {
    serde_json::json!({
        "name": w["name"], "rules": w["rules"], "failurePolicy": w["failurePolicy"], "sideEffects": w["sideEffects"],
        "matchConditions": w["matchConditions"], "namespaceSelector": w["namespaceSelector"],
        "admissionReviewVersions": w["admissionReviewVersions"], "timeoutSeconds": w["timeoutSeconds"],
        "service": w["clientConfig"]["service"],
    })
}

#[test]
fn the_chart_and_kustomize_grant_the_same_rbac_and_register_the_same_webhooks() {
    // Self-managed certificates (both defaults), and cert-manager's.
    for (values, overlay) in
        [(vec![], "config/default"), (vec!["--set", "certificates.mode=cert-manager"], "config/default-cert-manager")]
    {
        let chart = docs(&template(&values));
        let kustomize = docs(&run(Command::new("kubectl").args(["kustomize", repo(overlay).to_str().unwrap()])));
        compare(&chart, &kustomize, overlay);
    }
    let self_managed = rbac(&docs(&template(&[])));
    let names: Vec<_> = self_managed.iter().map(|(k, n, _)| format!("{k}/{n}")).collect();
    assert_eq!(
        names,
        [
            "ClusterRole/capo",
            "ClusterRole/capo-ca-injector",
            "ClusterRole/capo-edit",
            "ClusterRole/capo-operator",
            "ClusterRole/capo-view",
            "Role/capo-certificates",
            "Role/capo-leader-election",
            "Role/capo-operator",
        ]
    );
    let without_policy = docs(&template(&["--set", "podMarksPolicy.enabled=false"]));
    assert!(
        !without_policy.iter().any(|d| d["kind"].as_str().is_some_and(|k| k.starts_with("ValidatingAdmissionPolicy"))),
        "podMarksPolicy.enabled=false ships no policy"
    );
    let cert_manager = rbac(&docs(&template(&["--set", "certificates.mode=cert-manager"])));
    let operators = ["capo-operator", "capo-view", "capo-edit"];
    assert_eq!(
        cert_manager.iter().filter(|(_, name, _)| !operators.contains(&name.as_str())).count(),
        2,
        "with cert-manager capo gets no rights on Secrets or its webhook: {cert_manager:?}"
    );
}

/// kustomize's `config/calico-etcd` Component (in an overlay as a user writes one: their
/// endpoints in a ConfigMap) grants what the chart grants with `calico.datastore: etcdv3`
/// (no rights on Calico's objects) and gives capo the same settings and mount.
#[test]
fn the_calico_etcd_component_matches_the_charts_etcd_datastore() {
    let kustomize = kustomize_with(
        &["config/calico-etcd"],
        "configMapGenerator:\n\
         - {name: capo-calico-etcd, literals: [etcd_endpoints=https://10.0.0.1:2379], options: {disableNameSuffixHash: true}}\n",
    );
    let chart = docs(&template(&["--set", "calico.datastore=etcdv3,calico.etcd.endpoints=https://10.0.0.1:2379"]));
    compare(&chart, &kustomize, "config/calico-etcd");
    assert!(!serde_json::to_string(&rbac(&kustomize)).unwrap().contains("projectcalico.org"));
    let pod = &find(&kustomize, "Deployment", "capo")["spec"]["template"]["spec"];
    let env: BTreeMap<String, Value> = pod["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e.get("value").or(e.get("valueFrom")).cloned().unwrap()))
        .collect();
    assert_eq!(env["DATASTORE_TYPE"], "etcdv3");
    assert_eq!(env["ETCD_ENDPOINTS"]["configMapKeyRef"]["name"], "capo-calico-etcd");
    assert_eq!(env["ETCD_KEY_FILE"], "/calico-secrets/etcd-key");
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "calico-etcd").expect("volume");
    assert_eq!(volume["secret"]["secretName"], "calico-etcd-secrets");
    let cm = find(&kustomize, "ConfigMap", "capo-calico-etcd");
    assert_eq!(cm["data"]["etcd_endpoints"], "https://10.0.0.1:2379");
}

/// `config/default` with `components` (and the overlay lines `extra`) added, rendered by
/// kustomize.
fn kustomize_with(components: &[&str], extra: &str) -> Vec<Value> {
    let dir = std::env::temp_dir().join(format!(
        "capo-overlay-{}-{}",
        std::process::id(),
        components.join("-").replace('/', "_")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let up = "../".repeat(dir.components().count() - 1);
    let rel = |p: &str| format!("{up}{}", repo(p).display().to_string().trim_start_matches('/'));
    let overlay = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: capo-system\n\
         resources: [{}]\ncomponents: [{}]\n{extra}",
        rel("config/default"),
        components.iter().map(|c| rel(c)).collect::<Vec<_>>().join(", ")
    );
    std::fs::write(dir.join("kustomization.yaml"), overlay).unwrap();
    let rendered = run(Command::new("kubectl").args(["kustomize", dir.to_str().unwrap()]));
    let _ = std::fs::remove_dir_all(&dir);
    docs(&rendered)
}

#[test]
fn the_network_policy_admits_the_webhook_and_metrics_ports_only_from_their_sources() {
    let chart = docs(&template(&["--set", "networkPolicy.enabled=true"]));
    let kustomize = kustomize_with(&["config/network-policy"], "");
    let (a, b) = (find(&chart, "NetworkPolicy", "capo"), find(&kustomize, "NetworkPolicy", "capo"));
    assert_eq!(a["spec"]["ingress"], b["spec"]["ingress"], "the chart's defaults and the component agree");
    assert_eq!(a["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    // It selects capo's Pods, and its named ports are the container's.
    let pod = &find(&chart, "Deployment", "capo")["spec"]["template"];
    for (k, v) in a["spec"]["podSelector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&pod["metadata"]["labels"][k], v, "the chart's policy selects capo's Pods");
    }
    let ports: Vec<&str> =
        pod["spec"]["containers"][0]["ports"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    let kpod = &find(&kustomize, "Deployment", "capo")["spec"]["template"];
    for (k, v) in b["spec"]["podSelector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&kpod["metadata"]["labels"][k], v, "the component's policy selects capo's Pods");
    }
    for rule in a["spec"]["ingress"].as_array().unwrap() {
        let port = rule["ports"][0]["port"].as_str().unwrap();
        assert!(ports.contains(&port), "{port} is a port of capo's container: {ports:?}");
        assert!(
            !rule["from"].as_array().unwrap().is_empty(),
            "every rule names its sources (an empty from admits all)"
        );
    }
    let from = |rule: usize| a["spec"]["ingress"][rule]["from"].clone();
    assert_eq!(a["spec"]["ingress"][0]["ports"][0]["port"], "webhook");
    assert_eq!(a["spec"]["ingress"][1]["ports"][0]["port"], "probes");
    assert_eq!(from(1)[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], "monitoring");

    // Narrowed to the API servers' addresses, and no metrics source: no rule admits all.
    let narrowed = docs(&template(&[
        "--set",
        "networkPolicy.enabled=true,networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/24,networkPolicy.metricsFrom=null",
    ]));
    let np = find(&narrowed, "NetworkPolicy", "capo");
    assert_eq!(np["spec"]["ingress"].as_array().unwrap().len(), 1, "no metrics rule: {np}");
    assert_eq!(np["spec"]["ingress"][0]["from"], serde_json::json!([{ "ipBlock": { "cidr": "10.0.0.0/24" } }]));
    // An empty webhookFrom would cut the API server off: refused with a clear message.
    let out = Command::new(helm())
        .args(["template", "capo", repo("charts/capo").to_str().unwrap()])
        .args(["--set", "networkPolicy.enabled=true,networkPolicy.webhookFrom=null"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("networkPolicy.webhookFrom must list"));
    // Off by default.
    assert!(!docs(&template(&[])).iter().any(|d| d["kind"] == "NetworkPolicy"));
}

/// A file mode as YAML 1.1 writes it (a leading 0 is octal, as Kubernetes reads it) or as
/// a plain number.
fn mode_of(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        let s = v.as_str()?;
        if s.len() > 1 && s.starts_with('0') { u64::from_str_radix(&s[1..], 8).ok() } else { s.parse().ok() }
    })
}

/// Whether capo's container can read every file of the Secret volume `volume`, by the
/// kubelet's rules: files are owned by root, and with a Pod `fsGroup` by that group (the
/// kubelet adds group read); `defaultMode` decides the rest.
fn secret_readable_by_capo(pod: &Value, volume: &str) -> Result<(), String> {
    let v = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == volume).ok_or("no such volume")?;
    let mode = mode_of(&v["secret"]["defaultMode"]).unwrap_or(0o644);
    let ctx = &pod["securityContext"];
    let container = &pod["containers"][0]["securityContext"];
    let user = container["runAsUser"].as_u64().or(ctx["runAsUser"].as_u64()).unwrap_or(0);
    let group = container["runAsGroup"].as_u64().or(ctx["runAsGroup"].as_u64()).unwrap_or(0);
    let fs_group = ctx["fsGroup"].as_u64();
    let supplemental: Vec<u64> =
        ctx["supplementalGroups"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
    let groups: Vec<u64> = std::iter::once(group).chain(fs_group).chain(supplemental).collect();
    let readable = user == 0
        || mode & 0o004 != 0
        || (fs_group.is_some_and(|g| groups.contains(&g)) && (mode | 0o440) & 0o040 != 0)
        || (fs_group.is_none() && group == 0 && mode & 0o040 != 0);
    if readable {
        Ok(())
    } else {
        Err(format!("mode {mode:o}, user {user}, group {group}, fsGroup {fs_group:?}: capo cannot read it"))
    }
}

/// Issue 23 item 7: with Calico's etcd datastore capo runs as 65532 and must read its etcd
/// client key. The key was mounted `0400` and root-owned with no `fsGroup`: capo could not
/// read it in any real Pod. The chart and `config/calico-etcd` mount it 0440 with
/// `fsGroup` 65532, and nobody else can read it.
#[test]
fn capos_user_can_read_calicos_etcd_key_and_nobody_else_can() {
    let chart = docs(&template(&["--set", "calico.datastore=etcdv3,calico.etcd.endpoints=https://10.0.0.1:2379"]));
    let pod = &find(&chart, "Deployment", "capo")["spec"]["template"]["spec"];
    secret_readable_by_capo(pod, "calico-etcd").unwrap();
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "calico-etcd").unwrap();
    let mode = mode_of(&volume["secret"]["defaultMode"]).expect("a defaultMode");
    assert_eq!(mode & 0o007, 0, "not readable by others: {mode:o}");
    let kustomize = repo("config/calico-etcd/kustomization.yaml");
    let component = std::fs::read_to_string(&kustomize).unwrap();
    assert!(component.contains("defaultMode: 288}"), "{}", kustomize.display());
    let manager = docs(&run(Command::new("kubectl").args(["kustomize", repo("config/default").to_str().unwrap()])));
    let ctx = &find(&manager, "Deployment", "capo")["spec"]["template"]["spec"]["securityContext"];
    assert_eq!(ctx["fsGroup"], 65532, "{ctx}");
    // What it was: root-owned 0400, no fsGroup.
    let mut before = pod.clone();
    before["securityContext"].as_object_mut().unwrap().remove("fsGroup");
    for v in before["volumes"].as_array_mut().unwrap() {
        if v["name"] == "calico-etcd" {
            v["secret"]["defaultMode"] = 0o400.into();
        }
    }
    assert!(secret_readable_by_capo(&before, "calico-etcd").is_err());
}

fn compare(chart: &[Value], kustomize: &[Value], overlay: &str) {
    assert_eq!(rbac(chart), rbac(kustomize), "the chart and {overlay} grant the same rights");
    for kind in ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] {
        let (a, b) = (find(chart, kind, "capo-pod-marks-only"), find(kustomize, kind, "capo-pod-marks-only"));
        assert_eq!(a["spec"], b["spec"], "{overlay}: the same {kind}");
    }
    let (chart, kustomize) = (chart.to_vec(), kustomize.to_vec());
    let (a, b) = (
        find(&chart, "ValidatingWebhookConfiguration", "capo"),
        find(&kustomize, "ValidatingWebhookConfiguration", "capo"),
    );
    let contract = |v: &Value| v["webhooks"].as_array().unwrap().iter().map(webhook_contract).collect::<Vec<_>>();
    assert_eq!(contract(a), contract(b));
    assert_eq!(
        a["metadata"]["annotations"], b["metadata"]["annotations"],
        "{overlay}: the same cert-manager injection"
    );
    for w in a["webhooks"].as_array().unwrap() {
        assert!(w["clientConfig"].get("caBundle").is_none(), "no caBundle field in the rendered chart: {w}");
    }
    let (a, b) = (
        find(&chart, "MutatingWebhookConfiguration", "capo"),
        find(&kustomize, "MutatingWebhookConfiguration", "capo"),
    );
    assert_eq!(contract(a), contract(b), "{overlay}: the same sticky webhook");
    assert_eq!(a["metadata"]["annotations"], b["metadata"]["annotations"], "{overlay}: the same injection (sticky)");
}

#[test]
fn the_chart_copies_of_the_cel_filter_and_the_alerts_are_current() {
    let cel = std::fs::read_to_string(repo("charts/capo/files/match-condition.cel")).unwrap();
    assert_eq!(cel.trim(), capo::webhook_config::MATCH_CONDITION, "run `make crds`");
    let cel = std::fs::read_to_string(repo("charts/capo/files/sticky-match-condition.cel")).unwrap();
    assert_eq!(cel.trim(), capo::webhook_config::STICKY_MATCH_CONDITION, "run `make crds`");
    let alerts: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(repo("charts/capo/files/alerts.yaml")).unwrap()).unwrap();
    let rule: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(repo("config/prometheus/prometheus_rule.yaml")).unwrap())
            .unwrap();
    assert_eq!(alerts, rule["spec"], "run `make crds`");
}

#[test]
fn values_are_validated_by_the_schema() {
    let out = Command::new(helm())
        .args(["template", "capo", repo("charts/capo").to_str().unwrap(), "--set", "webhook.failurePolicy=Sometimes"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failurePolicy") && err.contains("Ignore"), "{err}");
    run(Command::new(helm()).args(["lint", repo("charts/capo").to_str().unwrap()]));
    let all = docs(&template(EVERY_OPTION));
    let vwc = find(&all, "ValidatingWebhookConfiguration", "capo");
    assert_eq!(vwc["webhooks"][0]["failurePolicy"], "Fail");
    let excluded = &vwc["webhooks"][0]["namespaceSelector"]["matchExpressions"][0]["values"];
    assert_eq!(
        excluded,
        &serde_json::json!(["kube-system", "capo-system", "redis-system"]),
        "kube-system and the release namespace always"
    );
    let role = find(&all, "ClusterRole", "capo");
    let kruise =
        role["rules"].as_array().unwrap().iter().find(|r| r["apiGroups"] == serde_json::json!(["apps.kruise.io"]));
    assert_eq!(
        kruise.map(|r| (&r["resources"], &r["verbs"])),
        Some((&serde_json::json!(["statefulsets", "clonesets"]), &serde_json::json!(["list", "watch"]))),
        "ownerKinds become list and watch rights"
    );
    let out = Command::new(helm())
        .args([
            "template",
            "capo",
            repo("charts/capo").to_str().unwrap(),
            "--set-json",
            r#"ownerKinds=[{"apiGroup":"x"}]"#,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "an ownerKinds entry without resources is refused");
}

/// `webhook.auth`: the client CA and the token are mounted from their Secrets where the
/// flags point, and the flags are ones capo's CLI takes (as are the limits').
#[test]
fn webhook_auth_mounts_the_client_ca_and_the_token_where_the_flags_point() {
    use clap::Parser;
    let all = docs(&template(EVERY_OPTION));
    let pod = &find(&all, "Deployment", "capo")["spec"]["template"]["spec"];
    let args: Vec<String> =
        pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
    let cli = capo::cli::Cli::try_parse_from(std::iter::once("capo".to_string()).chain(args.clone()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let settings = cli.into_run().expect("capo run").settings().unwrap();
    let auth = settings.caller_auth;
    assert_eq!(auth.client_ca_file.as_deref(), Some(std::path::Path::new("/webhook-client-ca/ca.crt")));
    assert_eq!(auth.token_file.as_deref(), Some(std::path::Path::new("/webhook-token/token")));
    assert_eq!(settings.limits.connections.header_timeout, std::time::Duration::from_secs(10));
    assert_eq!(settings.limits.reviews.bytes_in_flight, 64 << 20);
    let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
    for (volume, path, secret, key) in [
        ("webhook-client-ca", "/webhook-client-ca", "capo-webhook-client-ca", "ca.crt"),
        ("webhook-token", "/webhook-token", "capo-webhook-token", "token"),
    ] {
        assert!(mounts.iter().any(|m| m["name"] == volume && m["mountPath"] == path && m["readOnly"] == true));
        let v = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == volume).expect("volume");
        assert_eq!(v["secret"]["secretName"], secret);
        assert_eq!(v["secret"]["items"][0]["key"], key);
    }
    let plain = docs(&template(&[]));
    let args =
        serde_json::to_string(&find(&plain, "Deployment", "capo")["spec"]["template"]["spec"]["containers"][0]["args"])
            .unwrap();
    assert!(!args.contains("client-ca") && !args.contains("token-file"), "nothing asked by default: {args}");
}

/// `calico.datastore: etcdv3`: capo gets Calico's etcd settings as flags its CLI accepts,
/// the client certificate from Calico's own Secret layout (`etcd-ca`, `etcd-cert`,
/// `etcd-key`) mounted read-only beside the webhook's, and no RBAC on Calico's objects in
/// the API server (it never touches them there). Without endpoints the chart refuses.
#[test]
fn the_etcd_datastore_mounts_calicos_etcd_secret_and_asks_no_calico_rbac() {
    use clap::Parser;
    let all = docs(&template(&[
        "--set",
        "calico.datastore=etcdv3,calico.etcd.endpoints=https://10.0.0.1:2379\\,https://10.0.0.2:2379",
        "--set",
        "certificates.mode=secret",
    ]));
    let pod = &find(&all, "Deployment", "capo")["spec"]["template"]["spec"];
    let args: Vec<String> =
        pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
    let cli = capo::cli::Cli::try_parse_from(std::iter::once("capo".to_string()).chain(args.clone()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let etcd = cli.into_run().expect("capo run").settings().unwrap().calico_etcd.expect("the etcd datastore");
    assert_eq!(etcd.endpoints, vec!["https://10.0.0.1:2379".to_string(), "https://10.0.0.2:2379".to_string()]);
    assert_eq!(etcd.key_file.as_deref(), Some(std::path::Path::new("/calico-secrets/etcd-key")));
    let mounts = &pod["containers"][0]["volumeMounts"];
    assert!(mounts.as_array().unwrap().iter().any(|m| m["mountPath"] == "/calico-secrets" && m["readOnly"] == true));
    assert!(mounts.as_array().unwrap().iter().any(|m| m["mountPath"] == "/tls"), "the webhook's mount stays");
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "calico-etcd").expect("volume");
    assert_eq!(volume["secret"]["secretName"], "calico-etcd-secrets");
    let rules = serde_json::to_string(&rbac(&all)).unwrap();
    assert!(!rules.contains("projectcalico.org"), "no Calico RBAC with etcd: {rules}");
    let default_rules = serde_json::to_string(&rbac(&docs(&template(&[])))).unwrap();
    assert!(default_rules.contains("crd.projectcalico.org"), "the Kubernetes datastore keeps it");

    let out = Command::new(helm())
        .args(["template", "capo", repo("charts/capo").to_str().unwrap(), "--set", "calico.datastore=etcdv3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("calico.etcd.endpoints is required"), "{err}");
}

#[tokio::test]
async fn the_chart_passes_a_server_side_dry_run_with_default_values_and_every_option() {
    let client = client().await;
    install_calico_crds(&client).await;
    install_third_party_crds().await;
    install_capo_crds(&client).await;
    let ns = serde_json::from_value(serde_json::json!({ "metadata": { "name": "capo-system" } })).unwrap();
    let _ =
        kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone()).create(&Default::default(), &ns).await;
    // Not while the live install below owns these objects (its field manager, helm).
    let _one = LIVE.lock().await;
    let cert_manager: &[&str] = &["--include-crds", "--set", "certificates.mode=cert-manager"];
    for args in [vec!["--include-crds"], [&["--include-crds"][..], EVERY_OPTION].concat(), cert_manager.to_vec()] {
        let rendered = template(&args);
        let (ok, said) = kubectl(&["apply", "--server-side", "--dry-run=server", "-f", "-"], Some(&rendered)).await;
        assert!(ok, "{args:?}: {said}");
    }
}

/// `charts/capo/README.md` from the `# --` comments of values.yaml.
fn chart_readme() -> String {
    let values = std::fs::read_to_string(repo("charts/capo/values.yaml")).unwrap();
    let mut rows = Vec::new();
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut doc: Option<String> = None;
    for line in values.lines() {
        let indent = line.len() - line.trim_start().len();
        let text = line.trim();
        if let Some(d) = text.strip_prefix("# --") {
            doc = Some(d.trim().to_string());
            continue;
        }
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let Some((key, value)) = text.split_once(':') else { continue };
        path.retain(|(i, _)| *i < indent);
        path.push((indent, key.trim().to_string()));
        if let Some(d) = doc.take() {
            let full = path.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>().join(".");
            let default =
                if value.trim().is_empty() { "see values.yaml".to_string() } else { format!("`{}`", value.trim()) };
            rows.push(format!("| `{full}` | {default} | {d} |"));
        }
    }
    format!(
        "<!-- Generated by `make chart-readme` from values.yaml. Do not edit. -->\n# capo Helm chart\n\n\
         Installs capo: the webhook (every replica), the leader's release engine, RBAC, the webhook \
         configuration (never a caBundle: capo writes it, or cert-manager's CA injector does), \
         a PodDisruptionBudget that never blocks a drain, and optionally a ServiceMonitor, capo's \
         alerts and a Grafana dashboard. The CRDs are in `crds/`. See docs/install.md.\n\n\
         ```sh\nhelm install capo charts/capo -n capo-system --create-namespace\n```\n\n\
         | value | default | description |\n| --- | --- | --- |\n{}\n",
        rows.join("\n")
    )
}

#[test]
fn the_chart_readme_is_generated_from_the_values() {
    let path = repo("charts/capo/README.md");
    if std::env::var_os("CAPO_REGENERATE").is_some() {
        std::fs::write(&path, chart_readme()).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(on_disk == chart_readme(), "{} drifted from values.yaml; run `make chart-readme`", path.display());
}

/// One test at a time works on the objects of the release in capo-system.
static LIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs helm against the test control plane.
fn helm_live(args: &[&str]) -> String {
    run(Command::new(helm()).args(args).env("KUBECONFIG", &capo_testenv::shared().kubeconfig))
}

/// The chart installed for real with `helm install` (default values: self-managed
/// certificates), capo running outside the cluster as the chart's ServiceAccount and
/// reached through the chart's Service: it makes its certificate, injects its CA, holds
/// and releases. A `helm upgrade` then changes the webhook configuration and keeps the
/// injected caBundle (Helm's three-way merge leaves alone a field its manifests never
/// had), and the next deletion is held at once.
#[tokio::test]
async fn the_chart_installed_with_helm_works_and_an_upgrade_keeps_the_injected_ca() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let admin = client().await;
    install_calico_crds(&admin).await;
    let _one = LIVE.lock().await;
    let chart = repo("charts/capo");
    helm_live(&["install", "capo", chart.to_str().unwrap(), "-n", "capo-system", "--create-namespace"]);
    let ns = TestNamespace::create(&admin, "chart-live").await;
    let addr = host_addr();
    capo_testenv::route::route_service(&admin, "capo-system", "capo", "webhook", addr).await.expect("route");
    let capo =
        start_capo_with(&as_capo_service_account().await, &ns.name, installed_settings(addr, &format!("{}-", ns.name)))
            .await;
    let policy = format!("{}-p", ns.name);
    apply_policy(
        &admin,
        &policy,
        &ns.name,
        serde_json::json!({ "podSelector": {}, "reserveFor": "2s", "releaseInterval": "100ms" }),
    )
    .await;
    holds_and_releases(&admin, &ns.name, &policy, "redis-0").await;

    let webhooks = kube::Api::<ValidatingWebhookConfiguration>::all(admin.clone());
    let bundle = |c: &ValidatingWebhookConfiguration| {
        c.webhooks.as_ref().unwrap().iter().map(|w| w.client_config.ca_bundle.clone()).collect::<Vec<_>>()
    };
    let before = webhooks.get("capo").await.unwrap();
    assert!(bundle(&before).iter().all(|b| b.is_some()), "capo injected its CA");
    helm_live(&["upgrade", "capo", chart.to_str().unwrap(), "-n", "capo-system", "--set", "webhook.timeoutSeconds=7"]);
    let after = webhooks.get("capo").await.unwrap();
    assert_eq!(after.webhooks.as_ref().unwrap()[0].timeout_seconds, Some(7), "the upgrade applied");
    assert_eq!(bundle(&after), bundle(&before), "the upgrade kept the injected caBundle");
    let second = Ips::v4();
    create_pod_with_ips(&admin, &ns.name, unscheduled_pod("redis-1", &[], &[]), &[second]).await;
    delete_pod(&admin, &ns.name, "redis-1").await.expect("held and allowed");
    assert!(record(&admin, second).await.is_some(), "held right after the upgrade");
    capo.shutdown().await;
    helm_live(&["uninstall", "capo", "-n", "capo-system"]);
}

//! capo's Argo CD health check for CapoPolicy, run through a real Lua 5.1 interpreter on
//! the cases of `argocd/health/capo.io/CapoPolicy/health_test.yaml` (Argo CD's own test
//! format), and the argocd-cm patch that registers it.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("argocd/health/capo.io/CapoPolicy")
}

/// A JSON value as a Lua table constructor.
fn lua(v: &Value) -> String {
    match v {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let escaped: String = s
                .chars()
                .map(|c| match c {
                    '\\' => "\\\\".to_string(),
                    '"' => "\\\"".to_string(),
                    '\n' => "\\n".to_string(),
                    c => c.to_string(),
                })
                .collect();
            format!("\"{escaped}\"")
        }
        Value::Array(a) => format!("{{{}}}", a.iter().map(lua).collect::<Vec<_>>().join(", ")),
        Value::Object(m) => {
            format!(
                "{{{}}}",
                m.iter()
                    .map(|(k, v)| format!("[{}] = {}", lua(&Value::String(k.clone())), lua(v)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    }
}

/// Runs health.lua on `obj` in lua5.1; returns (status, message).
fn health(obj: &Value) -> (String, String) {
    let script = std::fs::read_to_string(dir().join("health.lua")).unwrap();
    let program = format!(
        "obj = {}\nlocal function check()\n{script}\nend\nlocal hs = check()\nio.write(hs.status, \"\\n\", hs.message or \"\")\n",
        lua(obj)
    );
    let mut child = std::process::Command::new("lua5.1")
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("lua5.1 (make test installs it through hack/tools.sh)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(program.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "lua5.1: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (status, message) = text.split_once('\n').unwrap_or((&text, ""));
    (status.to_string(), message.to_string())
}

#[test]
fn the_capopolicy_health_check_passes_its_argo_cd_tests() {
    let tests: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(dir().join("health_test.yaml")).unwrap()).unwrap();
    let cases = tests["tests"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for case in cases {
        let input = case["inputPath"].as_str().unwrap();
        let obj: Value = serde_saphyr::from_str(&std::fs::read_to_string(dir().join(input)).unwrap()).unwrap();
        let (status, message) = health(&obj);
        assert_eq!(status, case["healthStatus"]["status"].as_str().unwrap(), "{input}");
        assert_eq!(message, case["healthStatus"]["message"].as_str().unwrap(), "{input}");
    }
}

#[test]
fn the_argocd_cm_patch_carries_exactly_the_tested_script() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let patch: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("argocd/argocd-cm-patch.yaml")).unwrap()).unwrap();
    let embedded = patch["data"]["resource.customizations.health.capo.io_CapoPolicy"].as_str().unwrap();
    let script = std::fs::read_to_string(dir().join("health.lua")).unwrap();
    assert_eq!(embedded, script, "argocd/argocd-cm-patch.yaml drifted from health.lua");
}

fn yaml_docs(text: &str) -> Vec<Value> {
    text.split("\n---")
        .filter_map(|d| serde_saphyr::from_str::<Value>(d).ok())
        .filter(|v| v.get("kind").is_some())
        .collect()
}

fn wave(doc: &Value) -> &str {
    doc["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"].as_str().unwrap_or("none")
}

/// What Argo CD syncs comes in order — CRDs (-2, never pruned or deleted), the controller
/// (-1), the webhook configuration (0), the policies (1) — from the manifests and from the
/// chart alike, and both capo Applications leave the injected caBundle alone.
#[test]
fn argo_cd_syncs_crds_then_the_controller_then_the_webhook_then_the_policies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let kustomize = std::process::Command::new("kubectl")
        .args(["kustomize", root.join("argocd/manifests").to_str().unwrap()])
        .output()
        .expect("kubectl");
    assert!(kustomize.status.success(), "{}", String::from_utf8_lossy(&kustomize.stderr));
    let helm = std::env::var_os("CAPO_HELM").map(std::path::PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache"));
        cache.join("capo/tools/helm-v3.22.0/helm")
    });
    let chart = std::process::Command::new(helm)
        .args(["template", "capo", root.join("charts/capo").to_str().unwrap(), "-n", "capo-system", "--include-crds"])
        .output()
        .expect("helm (make test builds it through hack/tools.sh)");
    assert!(chart.status.success(), "{}", String::from_utf8_lossy(&chart.stderr));
    for (source, out) in [("argocd/manifests", &kustomize.stdout), ("charts/capo", &chart.stdout)] {
        let docs = yaml_docs(&String::from_utf8_lossy(out));
        let of = |kind: &str| docs.iter().filter(move |d| d["kind"] == kind).collect::<Vec<_>>();
        for crd in of("CustomResourceDefinition") {
            assert_eq!(wave(crd), "-2", "{source}: {}", crd["metadata"]["name"]);
            assert_eq!(
                crd["metadata"]["annotations"]["argocd.argoproj.io/sync-options"], "Prune=false,Delete=false",
                "{source}: {}",
                crd["metadata"]["name"]
            );
        }
        assert_eq!(of("CustomResourceDefinition").len(), 2, "{source}");
        assert_eq!(wave(of("Deployment")[0]), "-1", "{source}");
        assert_eq!(wave(of("ValidatingWebhookConfiguration")[0]), "0", "{source}");
        assert_eq!(wave(of("MutatingWebhookConfiguration")[0]), "0", "{source}");
    }
    let read = |p: &str| -> Value { serde_saphyr::from_str(&std::fs::read_to_string(root.join(p)).unwrap()).unwrap() };
    let policies = read("argocd/policies.yaml");
    assert_eq!(wave(&policies), "1");
    let options: Vec<&str> =
        policies["spec"]["syncPolicy"]["syncOptions"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(options.contains(&"SkipDryRunOnMissingResource=true"), "{options:?}");
    // Argo CD reads the folder's YAML files (its README keeps the folder in git).
    let files = std::fs::read_dir(root.join("argocd/policies")).unwrap().map(|e| e.unwrap().path());
    for path in files.filter(|p| p.extension().is_some_and(|e| e == "yaml")) {
        let policy: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(wave(&policy), "1", "{}", policy["metadata"]["name"]);
    }
    for app in ["argocd/capo.yaml", "argocd/capo-helm.yaml"] {
        let app = read(app);
        let options: Vec<&str> =
            app["spec"]["syncPolicy"]["syncOptions"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        assert!(options.contains(&"RespectIgnoreDifferences=true"), "{options:?}");
        let ignored = &app["spec"]["ignoreDifferences"][0];
        assert_eq!(ignored["kind"], "ValidatingWebhookConfiguration");
        assert_eq!(ignored["jqPathExpressions"][0], ".webhooks[]?.clientConfig.caBundle");
    }
}

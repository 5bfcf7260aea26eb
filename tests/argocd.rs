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
        serde_norway::from_str(&std::fs::read_to_string(dir().join("health_test.yaml")).unwrap()).unwrap();
    let cases = tests["tests"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for case in cases {
        let input = case["inputPath"].as_str().unwrap();
        let obj: Value = serde_norway::from_str(&std::fs::read_to_string(dir().join(input)).unwrap()).unwrap();
        let (status, message) = health(&obj);
        assert_eq!(status, case["healthStatus"]["status"].as_str().unwrap(), "{input}");
        assert_eq!(message, case["healthStatus"]["message"].as_str().unwrap(), "{input}");
    }
}

#[test]
fn the_argocd_cm_patch_carries_exactly_the_tested_script() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let patch: Value =
        serde_norway::from_str(&std::fs::read_to_string(root.join("argocd/argocd-cm-patch.yaml")).unwrap()).unwrap();
    let embedded = patch["data"]["resource.customizations.health.capo.io_CapoPolicy"].as_str().unwrap();
    let script = std::fs::read_to_string(dir().join("health.lua")).unwrap();
    assert_eq!(embedded, script, "argocd/argocd-cm-patch.yaml drifted from health.lua");
}

//! capo's alerts (`config/prometheus/prometheus_rule.yaml`) pass `promtool test rules`
//! with `config/prometheus/rules_test.yaml` (promtool from Debian's prometheus package,
//! installed by `hack/tools.sh`, which `make test` runs).

use std::path::Path;

#[test]
fn the_alerts_pass_promtool_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/prometheus");
    let rule: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("prometheus_rule.yaml")).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("capo-promtool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("rules.yaml"), serde_saphyr::to_string(&rule["spec"]).unwrap()).unwrap();
    std::fs::copy(root.join("rules_test.yaml"), dir.join("rules_test.yaml")).unwrap();
    let check = std::process::Command::new("promtool")
        .args(["check", "rules", "rules.yaml"])
        .current_dir(&dir)
        .output()
        .expect("promtool (make test installs it through hack/tools.sh)");
    assert!(
        check.status.success(),
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let out = std::process::Command::new("promtool")
        .args(["test", "rules", "rules_test.yaml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// Every alert has a promtool case in which it fires.
#[test]
fn every_alert_has_a_test_in_which_it_fires() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/prometheus");
    let rule: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("prometheus_rule.yaml")).unwrap()).unwrap();
    let tests: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("rules_test.yaml")).unwrap()).unwrap();
    let firing: Vec<&str> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|c| c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()))
        .filter_map(|c| c["alertname"].as_str())
        .collect();
    for group in rule["spec"]["groups"].as_array().unwrap() {
        for r in group["rules"].as_array().unwrap() {
            let alert = r["alert"].as_str().unwrap();
            assert!(firing.contains(&alert), "{alert} has no promtool case in which it fires");
        }
    }
}
